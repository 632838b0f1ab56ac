/* metrics.h - the router's metrics: the MetricsResponse METHOD_METRICS returns (families of
 * labelled samples) and, rendered from it by tdm_proto_metrics_text, the Prometheus text
 * exposition format 0.0.4 the HTTP gateway serves at GET /metrics.
 *
 * Every metric, its type, labels and meaning is listed in docs/operations.md ("Metrics").
 * Counters come from tdm_router_metrics_t and from the nodes' heartbeats (prefix cache
 * figures, cumulative per node process: they restart from 0 when a node restarts, which
 * Prometheus's rate() treats as a counter reset; the tokens per forward pass are summed over
 * node instances by the router instead, so they never go back). Histograms are in seconds with the
 * buckets of tdm_router_hist_bounds (the text renders them cumulatively: _bucket{le=...}, _sum,
 * _count).
 */
#ifndef TANDEM_ROUTER_METRICS_H
#define TANDEM_ROUTER_METRICS_H

#include <stddef.h>

#include "router.h"
#include "tandem/proto.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The Content-Type an HTTP server sends with the text. */
#define TDM_ROUTER_METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* The router's counters, histograms and gauges (router and per configured node) as a
 * MetricsResponse: every family with its name, help and type, also those with no sample yet
 * (node gauges while no node is up). Call it on the router's thread (it reads the router's
 * state without locks). On success *out is a heap message the caller frees with
 * protobuf_c_message_free_unpacked(&(*out)->base, NULL). Returns 0, or TDM_ERESOURCE (out of
 * memory; *out NULL). */
int tdm_router_metrics_snapshot(const tdm_router_t *r, Tandem__V1__MetricsResponse **out);

/* tdm_router_metrics_snapshot rendered by tdm_proto_metrics_text: a "# HELP" and a "# TYPE"
 * line per family, one sample per line, label values escaped, '\n' line ends. On success
 * *text is a NUL-terminated heap string of *len bytes (len may be NULL). Returns 0, or
 * TDM_ERESOURCE (out of memory; *text NULL). Caller frees *text with free(). */
int tdm_router_metrics_text(const tdm_router_t *r, char **text, size_t *len);

/* Adds what the load n just got from a heartbeat of instance instance_id says about its
 * forward passes beyond what that instance had reported before (NodeLoad.iteration_tokens_counts,
 * _sum: since the node process started) to r->metrics.iteration_counts and iteration_tokens; a
 * new instance starts from 0. A load without the counts (all 0) adds nothing. Likewise the
 * node's own counters /metrics shows (prefix cache, speculative decoding, stale router frames,
 * CPU seconds) are summed over its processes into n->counters_done / counters_now, so that
 * every counter series stays monotonic for the router's life across node restarts. Router
 * thread. Cannot fail. */
struct rt_node;
void rt_metrics_iterations(tdm_router_t *r, struct rt_node *n, uint64_t instance_id);

/* Answers a METRICS REQUEST frame f on the router's client endpoint with
 * MetricsResponse{text}, or END RESOURCE_EXHAUSTED. Call it on the router's thread. */
void rt_client_metrics(tdm_router_t *r, const tdm_frame_t *f);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_ROUTER_METRICS_H */
