/* embed.h - EMBED calls in the router (embed.c): the inputs checked and tokenized, one
 * EmbedTask attempt per input on a node of the model, the vectors gathered in input order into
 * one EmbedResponse (docs/api.md "Embeddings", docs/protocol.md).
 */
#ifndef TANDEM_ROUTER_EMBED_H
#define TANDEM_ROUTER_EMBED_H

#include <stdbool.h>
#include <stdint.h>

#include "router_internal.h"

/* Inputs one EMBED call may carry (OpenAI's limit for one embeddings request). */
#define RT_EMBED_MAX_INPUTS 2048u
/* EmbedTasks of one call on the nodes at a time: the rest wait for these to answer, so one call
 * of many inputs does not hold every node's room. A node takes at most its max_running
 * embedding inputs from a router at once (embed.c), so the calls together do not fill its
 * worker's queue (max_waiting). */
#define RT_EMBED_WINDOW 32u

/* The check of one input's token ids against a model of n_vocab tokens and a context of n_ctx
 * tokens, the one rule the router and the HTTP gateway apply: 1..n_ctx ids, each in
 * [0, n_vocab). TDM_EINVALID with field `what` ("texts[2]", "input[2]") for a length, or
 * `what[j]` for id j, and a message naming the limit. Cannot fail otherwise. */
int tdm_router_embed_check(const int32_t *ids, size_t n, uint32_t n_vocab, uint32_t n_ctx,
                           const char *what, tdm_error_t *err);

/* Sets up and frees the router's table of EMBED calls (at router start / end). rt_embed_init
 * returns 0 or TDM_ERESOURCE. */
int rt_embed_init(tdm_router_t *r);
void rt_embed_fini(tdm_router_t *r);

/* An EMBED request frame from a client: checked (a refusal is an END with the status and an
 * ErrorDetail naming the field), then dispatched. */
void rt_embed(tdm_router_t *r, const tdm_frame_t *f);

/* The client's CANCEL of call f->call_id: true when it was an EMBED call (ended, NodeCancel to
 * its nodes, no reply). */
bool rt_embed_cancel(tdm_router_t *r, const tdm_frame_t *f);

/* A node's EmbeddingResult (METHOD_EMBEDDING). */
void rt_embed_on_result(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f);

/* A node's TaskFailed for attempt tf->attempt_id: true when it was an embedding's (retried
 * once when retryable, else the call fails). */
bool rt_embed_task_failed(tdm_router_t *r, rt_node_t *n, const Tandem__V1__TaskFailed *tf);

/* Node n is down: its embeddings go to another node (or their calls fail UNAVAILABLE). */
void rt_embed_node_down(tdm_router_t *r, rt_node_t *n);

/* Calls past their deadline end DEADLINE_EXCEEDED, NodeCancel to their nodes, and the calls
 * waiting for room are sent what now fits (a node that came up) (the timers, every
 * TIMER_PERIOD_S). A call waits for room on the nodes up, never for a node to come up: one whose
 * inputs find none up (and none of its own in flight) fails at once (UNAVAILABLE). */
void rt_embed_timers(tdm_router_t *r, uint64_t now_ms);

/* The EMBED calls of model m (NULL: every model) now: *running with an input on a node,
 * *queued with none (waiting in the router for a node with room). Counted beside GENERATE's
 * requests in requests_running / requests_queued (ModelInfo, ClusterStatus, the metrics). */
void rt_embed_count(const tdm_router_t *r, const rt_model_t *m, size_t *running, size_t *queued);

/* Router shutdown: every call ends UNAVAILABLE "router shutting down". */
void rt_embed_shutdown(tdm_router_t *r);

#endif /* TANDEM_ROUTER_EMBED_H */
