/* stats.h - the router's latency histograms and end-of-request counters
 * (tdm_router_metrics_t in router.h; metrics.c renders them).
 */
#ifndef TANDEM_ROUTER_STATS_H
#define TANDEM_ROUTER_STATS_H

#include "router.h"

/* Counts one observation (seconds; negative or NaN counts as 0) in h. Cannot fail. */
void rt_hist_observe(tdm_router_hist_t *h, double seconds);

/* Counts one observation of a count (tokens, preemptions) over tdm_router_token_bounds. */
void rt_hist_observe_count(tdm_router_hist_t *h, double n);

/* Counts an ended GENERATE request of model (NULL: refused before its model was known; the
 * cluster's counters only): final status (0 or a negative TDM_E code) and FinishReason (-1:
 * refused before it started). Cannot fail. */
void rt_count_end(tdm_router_t *r, rt_model_t *model, int status, int finish);

#endif /* TANDEM_ROUTER_STATS_H */
