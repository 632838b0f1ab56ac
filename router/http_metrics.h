/* http_metrics.h - the HTTP gateway's own counters: responses by status code and requests it
 * refused before they reached the router, by reason (the field at fault) and by status. One
 * set per gateway (tdm_http_t owns it; the dashboard reads it), lock-free, callable from any
 * gateway thread.
 */
#ifndef TANDEM_ROUTER_HTTP_METRICS_H
#define TANDEM_ROUTER_HTTP_METRICS_H

#include "tandem/proto.h"

typedef struct http_counters http_counters_t;

/* A zeroed set of counters; NULL on out of memory. Free with http_counters_destroy. */
http_counters_t *http_counters_new(void);
/* Frees *c_p and nulls it; accepts NULL. Nothing may count on it any more. */
void http_counters_destroy(http_counters_t **c_p);

/* Counts one HTTP response with this status (100..599; others count as 0). Cannot fail. */
void http_counters_response(http_counters_t *c, unsigned status);

/* Counts a request the gateway refused itself; reason: the OpenAI field at fault ("n",
 * "logit_bias"; an index or key in it is dropped: "messages[2]" counts as "messages"), "" or
 * NULL for the request as a whole ("request"). Reasons beyond the first
 * TDM_HTTP_REFUSAL_REASONS distinct ones count as "other". status: the refusal's (a negative
 * tdm status, TDM_EINVALID mostly; another value counts as UNKNOWN). Cannot fail. */
#define TDM_HTTP_REFUSAL_REASONS 64
void http_counters_refusal(http_counters_t *c, const char *reason, int status);

/* Adds the refusals by status to the router's tandem_requests_total{status,
 * finish_reason="none"} in m (its own refusals' series without model_name, or a new one: the
 * gateway refused them before a model was chosen), so that family counts
 * every GENERATE refused, the gateway's included; nothing when m has no such family. m is a
 * message protobuf_c_message_free_unpacked(…, NULL) frees (malloc'd parts). Returns TDM_OK or
 * TDM_ERESOURCE (m stays valid, perhaps without some). */
int http_counters_merge_refusals(http_counters_t *c, Tandem__V1__MetricsResponse *m);

/* http_counters_merge_refusals, then appends tandem_http_requests_total{code} and
 * tandem_http_requests_refused_total{reason} to m. Returns TDM_OK or TDM_ERESOURCE (m stays
 * valid, perhaps without them). */
int http_counters_append(http_counters_t *c, Tandem__V1__MetricsResponse *m);

#endif /* TANDEM_ROUTER_HTTP_METRICS_H */
