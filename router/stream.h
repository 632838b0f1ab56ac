/* stream.h - a request's output in the router: token events put back in order (reorder
 * buffer), incremental detokenization, stop strings, GenerateChunk streaming and the final
 * answer (usage, timings, END OK).
 */
#ifndef TANDEM_ROUTER_STREAM_H
#define TANDEM_ROUTER_STREAM_H

#include <stdbool.h>

#include "router_internal.h"

/* A TokenEvent frame from node n (its registered connection, up): delivered in order to the
 * client when it belongs to the current attempt of a running request; the request may end
 * (stop string, last token, client gone, out of memory) and be freed. */
void rt_stream_on_token(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f);

/* A Finished frame from decode node n: the request completes once every token up to
 * Finished.completion_tokens is delivered (at once when they all are). */
void rt_stream_on_finished(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f);

/* A KvShipped frame from prefill node n: the decode node acknowledged the attempt's KV; its
 * kv_transfer_s (sender-measured) replaces the decode node's estimate in the request's
 * timings and the KV-transfer histogram. */
void rt_stream_on_kv_shipped(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f);

/* A streaming request that fails after tokens were delivered: sends the last GenerateChunk
 * with finish_reason ERROR (usage: the tokens delivered; timings), so a stream that breaks
 * says so in its last chunk before the END that carries the status (the caller sends it).
 * Does nothing for a request that streamed nothing yet or does not stream. Cannot fail. */
void rt_stream_fail(tdm_router_t *r, const rt_req_t *q);

/* Before q is dispatched again (migration): when the output already delivered ends it (its
 * last token ends generation for q's sampling parameters, tdm_worker_token_ends, or it holds
 * max_tokens tokens: its node was lost between the last token and its Finished), completes q
 * as the node would have (finish_reason STOP or LENGTH, END OK) after NodeCancel to its nodes,
 * frees it and returns true; otherwise returns false and changes nothing. Cannot fail. */
bool rt_stream_end_delivered(tdm_router_t *r, rt_req_t *q);

/* Frees q's output state (reorder buffer, held text, chunk); q itself stays. Cannot fail. */
void rt_stream_free(rt_req_t *q);

#endif /* TANDEM_ROUTER_STREAM_H */
