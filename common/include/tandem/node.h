/* node.h - the one serve loop of the prefill and decode nodes (tdm_node_t) and its request
 * table: a node is its runtime (node_runtime.h), its link to the router (node_link.h) and a
 * handler (tdm_node_ops_t) for the tasks it takes (node_spec.h), all run on the engine thread
 * but the link's I/O. */
#ifndef TANDEM_NODE_H
#define TANDEM_NODE_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/constraint.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/node_link.h"
#include "tandem/node_runtime.h"
#include "tandem/node_spec.h"
#include "tandem/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One attempt a node holds: the first member of each handler's request struct (the table's
 * entries are ops->req_size bytes). The router's attempt id is its key (O(1) lookup by a hash
 * of it); its worker sequence (seq_id att.attempt_id) carries the entry as
 * tdm_worker_req_t.user, so worker events reach it without a lookup. */
typedef struct tdm_node_req {
    tdm_node_attempt_t att;
    uint64_t deadline_ms; /* the task's deadline (unix ms); 0: none */
    double wait_until;    /* tdm_time_now seconds when the handler's own wait for this request
                             (decode: the KV pages) ends it, retryable; 0: none */
    bool used;            /* private to serve.c */
    uint32_t next;        /* private to serve.c: the key's hash chain */
    const tdm_grammar_t *grammar; /* the task's constraint (tdm_node_constraint), held from
                                     the runtime's cache until the request is dropped; NULL:
                                     free text */
} tdm_node_req_t;

typedef struct tdm_node tdm_node_t;

/* What makes a node a prefill or a decode node: its handler (h, given to tdm_node_new) and
 * these hooks, all called on the engine thread from tdm_node_serve. */
typedef struct tdm_node_ops {
    tdm_node_role_t role;
    tdm_worker_mode_t mode;
    size_t req_size;          /* bytes of the handler's request struct, tdm_node_req_t first */
    bool shutdown_retryable;  /* TaskFailed.retryable for what is in flight at shutdown */
    const char *deadline_msg; /* TaskFailed message when a request's deadline passes */
    const char *wait_msg;     /* TaskFailed message when its wait_until passes */
    /* A frame from the router other than NODE_CANCEL and NODE_STATUS (which the loop serves).
     * Returns false when the node does not serve the method: the loop answers a REQUEST with
     * INVALID_ARGUMENT. */
    bool (*frame)(void *h, const tdm_frame_t *f);
    /* A worker event of request r (the sequence's tdm_worker_req_t.user). */
    void (*event)(void *h, tdm_node_req_t *r, const tdm_worker_event_t *ev);
    /* Once per loop turn, before the forward pass: the handler's own I/O (KV sender or
     * receiver). */
    void (*tick)(void *h);
    /* What the loop waits on besides the router link while the worker is idle: *zsock another
     * ZeroMQ socket or NULL; returns the wait in milliseconds. */
    int (*wait)(void *h, void **zsock);
    /* r leaves the node: release what the handler holds for it (worker sequence, transfer,
     * blocks, buffers). The loop frees the entry afterwards. */
    void (*drop)(void *h, tdm_node_req_t *r);
} tdm_node_ops_t;

/* Opens the node `node_id` of cfg (or cfg's first node of ops->role) for a handler: its
 * runtime (tdm_node_runtime_open in ops->mode) and its request table (max_running +
 * TDM_NODE_MAX_WAITING entries of ops->req_size bytes). cfg, ops and h must outlive the node. The
 * link to the router starts with tdm_node_connect. Returns NULL with *err set: tdm_node_pick's
 * errors, tdm_node_runtime_open's, TDM_ERESOURCE (out of memory). */
tdm_node_t *tdm_node_new(const tdm_config_t *cfg, const char *node_id, const tdm_node_ops_t *ops,
                         void *h, tdm_net_t *net, const tdm_logger_t *log, tdm_error_t *err);

/* Starts the link to the router (tdm_node_link_start; kv_endpoint: what a decode node
 * registers, NULL for a prefill node). Errors as tdm_node_link_new. */
int tdm_node_connect(tdm_node_t *n, const char *kv_endpoint, tdm_error_t *err);

/* Drops every request still held (ops->drop for each; no report). NULL-safe. */
void tdm_node_drop_all(tdm_node_t *n);

/* Drops every request still held (tdm_node_drop_all), stops the link, closes the runtime.
 * NULL-safe, nulls *self_p. A handler calls tdm_node_drop_all first when what ops->drop uses
 * (its KV sender) must go before the runtime's pool. */
void tdm_node_destroy(tdm_node_t **self_p);

/* Serves until *stop becomes nonzero: polls the router link (and ops->wait's socket), serves
 * NODE_CANCEL and NODE_STATUS, hands other frames to ops->frame, runs ops->tick and the
 * worker's steps (events to ops->event), and every 50 ms publishes the load and ends requests
 * whose router instance is gone (dropped), whose deadline passed (DEADLINE_EXCEEDED) or whose
 * wait_until passed (DEADLINE_EXCEEDED, retryable). On stop (or when the router refuses the
 * node: TDM_EPRECONDITION with its reason in *err) every request is reported failed
 * (UNAVAILABLE, ops->shutdown_retryable) and dropped, and the link is flushed (at most
 * 300 ms). Returns 0 after a requested stop. */
int tdm_node_serve(tdm_node_t *n, volatile sig_atomic_t *stop, tdm_error_t *err);

/* The node's parts, owned by it (valid until tdm_node_destroy): runtime, config entry, logger,
 * router link, the link's engine socket. Cannot fail. */
tdm_node_runtime_t *tdm_node_rt(tdm_node_t *n);
const tdm_node_config_t *tdm_node_cfg(const tdm_node_t *n);
const tdm_logger_t *tdm_node_log(const tdm_node_t *n);
tdm_node_link_t *tdm_node_router(tdm_node_t *n); /* the first router's link; NULL before
                                                    tdm_node_connect */
size_t tdm_node_n_routers(const tdm_node_t *n);  /* links (tdm_config_router_endpoints) */
tdm_node_link_t *tdm_node_router_at(tdm_node_t *n, size_t i); /* link i; NULL past the last */

/* The engine socket of the link registered with router instance router_instance (a frame's
 * FrameHeader.instance_id, a request's tdm_node_attempt_t.router_instance): what answers,
 * token events and reports of that router's requests go on. NULL when no link is registered
 * with it (the router is gone): then there is nobody to tell. Cannot fail. */
tdm_sock_t *tdm_node_sock(tdm_node_t *n, uint64_t router_instance);

/* A new zeroed entry (ops->req_size bytes) for attempt a, or NULL when the table is full. The
 * caller has checked that the attempt is not held yet (tdm_node_req_find). */
tdm_node_req_t *tdm_node_req_new(tdm_node_t *n, const tdm_node_attempt_t *a);

/* The entry of attempt_id, or NULL. O(1). */
tdm_node_req_t *tdm_node_req_find(tdm_node_t *n, uint64_t attempt_id);

/* Ends r without a report: ops->drop, then the entry is freed (r is invalid afterwards). */
void tdm_node_req_drop(tdm_node_t *n, tdm_node_req_t *r);

/* Reports r failed (tdm_node_report_failed) and drops it. */
void tdm_node_req_fail(tdm_node_t *n, tdm_node_req_t *r, int status, bool retryable,
                       const char *msg);

/* Reports r failed with a worker FAILED event's status, message and request_fault (never
 * retryable: a failure the worker saw recurs elsewhere) and drops it. */
void tdm_node_req_fail_event(tdm_node_t *n, tdm_node_req_t *r, const tdm_worker_event_t *ev);

/* Reports attempt a failed on the link of the router that dispatched it (an attempt with no
 * entry, e.g. a task refused before it got one); nothing when that router is gone. */
void tdm_node_fail(tdm_node_t *n, const tdm_node_attempt_t *a, int status, bool retryable,
                   const char *msg);

/* Tells the router attempt a failed on this node (NOTIFY TaskFailed: request and attempt,
 * status, message, whether the router may re-dispatch it) and logs it as a warning under the
 * request id. s NULL (the router is gone): only the log. */
void tdm_node_report_failed(tdm_sock_t *s, const tdm_logger_t *log, const tdm_node_attempt_t *a,
                            int status, bool retryable, const char *msg);

/* tdm_node_report_failed with TaskFailed.request_fault: true when the request's own
 * constraints caused the failure (tdm_worker_event_t.request_fault), so the router keeps
 * status (a 400) instead of reporting INTERNAL. */
void tdm_node_report_failed_ex(tdm_sock_t *s, const tdm_logger_t *log, const tdm_node_attempt_t *a,
                               int status, bool retryable, bool request_fault, const char *msg);

/* Sends a worker TOKEN event of attempt a to the router as a TokenEvent (NOTIFY).
 * TDM_EUNAVAILABLE when s is NULL (the router is gone). */
int tdm_node_send_token(tdm_sock_t *s, const tdm_node_attempt_t *a, const tdm_worker_event_t *ev);

/* An EmbedTask frame f (METHOD_EMBED_TASK, protocol 2.8) for a handler: decodes and checks it
 * (the spec's identity, 1..n_ctx prompt tokens in the vocabulary, a known pooling, no
 * generation fields), makes the attempt's entry (deadline from the spec) and adds its
 * embedding sequence to the worker (tdm_worker_req_t.embed, user = the entry). Returns the
 * entry, held by the worker until its EMBEDDING or FAILED event (the handler marks it so, for
 * its drop hook), or NULL when nothing was started: a frame that does not decode or a
 * duplicate attempt is dropped (logged); a bad task is reported (TaskFailed INVALID_ARGUMENT
 * naming the field, e.g. "prompt_tokens[3]: token id ..."), a full worker too
 * (RESOURCE_EXHAUSTED, retryable). */
tdm_node_req_t *tdm_node_embed_start(tdm_node_t *n, const tdm_frame_t *f);

/* Sends a worker EMBEDDING event of attempt a to the router as an EmbeddingResult (NOTIFY).
 * TDM_EUNAVAILABLE when s is NULL (the router is gone); else tdm_sock_notify's status. */
int tdm_node_send_embedding(tdm_sock_t *s, const tdm_node_attempt_t *a,
                            const tdm_worker_event_t *ev);

/* Answers a NODE_STATUS request f with the node's NodeStatus: its config entry, the name of the
 * model it serves (cfg's, as in its REGISTER) and a NodeLoad of its figures now
 * (tdm_node_load_collect from rt's worker and pool, the process figures, and link's stale
 * router frames; link may be NULL: 0). Returns tdm_sock_reply's status. */
int tdm_node_reply_status(tdm_sock_t *s, const tdm_frame_t *f, const tdm_config_t *cfg,
                          const tdm_node_config_t *node, const tdm_node_runtime_t *rt,
                          tdm_node_link_t *link);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NODE_H */
