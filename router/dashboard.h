/* dashboard.h - the status dashboard of the HTTP gateway (dashboard.c): its sampler
 * thread, /api/status, /api/capacity and the embedded page.
 */
#ifndef TANDEM_ROUTER_DASHBOARD_H
#define TANDEM_ROUTER_DASHBOARD_H

#include <stddef.h>

#include <jansson.h>

#include "http_gateway.h"
#include "http_json.h"
#include "http_metrics.h"

typedef struct dash dash_t;

/* Starts the dashboard's sampler thread: a STATUS and a METRICS call through gw every second,
 * kept for the last TDM_DASH_HISTORY seconds; the gateway's own refusals (counters, borrowed)
 * count in its error rate. Returns NULL with *err set (TDM_ERESOURCE). Free with dash_destroy
 * before gw and counters. */
#define TDM_DASH_HISTORY 300
dash_t *dash_new(gw_t *gw, http_counters_t *counters, tdm_error_t *err);
void dash_destroy(dash_t **d_p);

/* Counts a finished HTTP generate request by its status (/api/status's "http"). Any thread. */
void dash_record(dash_t *d, int status);

/* Counts streams in flight (+1 when one starts, -1 when it ends). Any thread. */
void dash_streams(dash_t *d, int delta);

/* GET /api/status: the last ClusterStatus as JSON (each node with the model it serves and its
 * pool as that model's plan sees it), the history, the first model (model_info) and every
 * model (models), from models[n_models] (none: NULL, 0). New reference, NULL on out of
 * memory. */
json_t *dash_status_json(dash_t *d, const http_model_t *models, size_t n_models);

/* GET /api/capacity: get(ctx, NAME) returns the query parameter NAME or NULL. Returns the
 * JSON (new reference) with *http_status 200, or an OpenAI-shaped error with 400 naming the
 * parameter; NULL on out of memory. m (the served model, may be NULL) is used for
 * model=served; nodes for node=ID come from the last status. */
json_t *dash_capacity_json(dash_t *d, const http_model_t *m,
                           const char *(*get)(void *ctx, const char *name), void *ctx,
                           unsigned *http_status);

/* The embedded page (dashboard.html, generated into dashboard_html.c at build time). */
extern const unsigned char tdm_dashboard_html[];
extern const size_t tdm_dashboard_html_len;

#endif /* TANDEM_ROUTER_DASHBOARD_H */
