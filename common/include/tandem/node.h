/* node.h - what prefill and decode nodes share: the runtime (model, tokenizer, KV pool sized
 * from the node's memory budget, engine, continuous-batching worker) and the link to the
 * router (an I/O thread that registers the node, sends heartbeats and relays messages).
 *
 * Threads (DESIGN.md "Processes and sockets"): the engine thread owns the runtime and talks
 * to the router through tdm_node_link_sock(), a DEALER connected over inproc:// to the link's
 * I/O thread; the I/O thread owns the TCP socket to the router, so heartbeats keep flowing
 * while a long forward pass runs. The engine thread publishes its load figures with
 * tdm_node_link_set_load (a mutex-protected copy).
 */
#ifndef TANDEM_NODE_H
#define TANDEM_NODE_H

#include <signal.h>
#include <stdbool.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/constraint.h"
#include "tandem/device.h"
#include "tandem/kv.h"
#include "tandem/log.h"
#include "tandem/model.h"
#include "tandem/net.h"
#include "tandem/serve.h"
#include "tandem/tokenizer.h"
#include "tandem/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- CURVE keys ---- */

/* A node daemon's CURVE material (DESIGN.md "Security and identity"): its own pair, the
 * secret read from its curve_secret_key_file (and no other node's), and the keys it trusts. */
typedef struct tdm_node_keys {
    bool on;                 /* CURVE is on (tdm_config_curve_on); everything below is empty
                                when it is off */
    char public_key[41];     /* this node's key, nodes[].curve_public_key */
    char secret_key[41];     /* from nodes[].curve_secret_key_file (tdm_net_curve_secret_read) */
    char router_key[41];     /* router.curve_public_key: the server key of the router link */
    tdm_node_role_t role;    /* the node's role: a decode node's KV side is a server */
    tdm_curve_peer_t *peers; /* decode nodes: [n_peers] the prefill nodes admitted on the KV
                                endpoint, named by node id (strings borrowed from the config);
                                NULL for prefill nodes */
    size_t n_peers;
} tdm_node_keys_t;

/* Loads node `node`'s keys into *k (previous contents ignored) when CURVE is on, and checks
 * that a decode node may bind its kv_endpoint (tdm_config_bind_check, guard CURVE). The
 * strings of cfg must outlive *k. Returns 0; with *err set: what tdm_net_curve_secret_read
 * returns for the node's secret key file (the message names nodes[i].curve_secret_key_file
 * and the path), TDM_EPRECONDITION (insecure bind), TDM_ERESOURCE. On error *k holds nothing
 * to close; on success release it with tdm_node_keys_close. */
int tdm_node_keys_open(tdm_node_keys_t *k, const tdm_config_t *cfg, const tdm_node_config_t *node,
                       tdm_error_t *err);

/* Wipes the secret and frees the peer list; zeroes *k. NULL-safe. */
void tdm_node_keys_close(tdm_node_keys_t *k);

/* The keys of the link to the router (client: the node's pair; server: the router's key) in
 * *out, or NULL when CURVE is off. *out points into k. Cannot fail. */
const tdm_curve_keys_t *tdm_node_curve_router(const tdm_node_keys_t *k, tdm_curve_keys_t *out);

/* The keys of the node's KV side in *out, or NULL when CURVE is off: a decode node's receiver
 * (server: its own pair; clients: every prefill node's key), a prefill node's sender (client:
 * its own pair; the receiver's key comes with each transfer, tdm_kv_send_req_t.server_key).
 * *out points into k. Cannot fail. */
const tdm_curve_keys_t *tdm_node_curve_kv(const tdm_node_keys_t *k, tdm_curve_keys_t *out);

/* ---- runtime ---- */

/* TDM_NODE_MAX_WAITING (limits.h): requests a node queues beyond its running batch
 * (node.max_running), its worker's max_waiting; its request table holds max_running + that. */

/* GPUs a node lists at registration, at most (the UUIDs of the first ones it sees). */
#define TDM_NODE_MAX_GPUS 16

typedef struct tdm_node_runtime {
    tdm_model_t *model;
    tdm_tokenizer_t *tok;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *worker;
    tdm_kv_layout_t layout;
    uint32_t n_ctx; /* tokens per sequence at most */
    uint32_t n_vocab;
    uint64_t fingerprint;                           /* tdm_model_fingerprint */
    uint64_t weight_bytes, scratch_bytes, kv_bytes; /* the budget's split (device bytes on
                                                       a cuda node) */
    uint64_t budget_bytes;                          /* what the split divides */
    bool on_device;       /* device: cuda:N (the engine's backend is cuda, KV on the device) */
    int device_index;     /* N of cuda:N */
    void *kv_device_base; /* the engine's device copy of the pool (tdm_engine_kv_device_base);
                             NULL on the CPU */
    uint64_t device_total_bytes, device_free_bytes;         /* cudaMemGetInfo at start */
    char gpu_uuid[TDM_DEVICE_UUID_MAX];                     /* the node's GPU ("" on the CPU) */
    char gpu_uuids[TDM_NODE_MAX_GPUS][TDM_DEVICE_UUID_MAX]; /* every GPU it sees (cuda) */
    uint32_t n_gpu_uuids;                                   /* 0 on the CPU */
    tdm_node_keys_t keys; /* the node's CURVE keys, loaded before the model */

    /* structured output */
    tdm_grammar_vocab_t *grammar_vocab; /* the tokenizer's vocabulary for token masks, built
                                           once at open; the worker's */
    tdm_grammar_cache_t *grammars;      /* compiled grammars by hash (node.grammar_cache_bytes) */
} tdm_node_runtime_t;

/* What sizes a node's KV pool (tdm_node_size_pool). Bytes. */
typedef struct tdm_node_sizing {
    const char *node_id;           /* for the messages */
    tdm_kv_layout_t layout;        /* the served model's KV layout */
    uint32_t n_ctx;                /* tokens of one full-context sequence */
    uint64_t weight_bytes;         /* weights in the budget's memory (device copies on cuda) */
    uint64_t scratch_bytes;        /* engine scratch in that memory */
    uint64_t memory_budget;        /* node.memory_budget; 0: gpu_memory_utilization */
    bool on_device;                /* a cuda:N node: the figures below count */
    int device_index;              /* N */
    double gpu_memory_utilization; /* (0, 1] when memory_budget is 0 */
    uint64_t device_total_bytes;   /* the device's memory (cudaMemGetInfo) */
    uint64_t device_free_bytes;    /* free on it at start */
} tdm_node_sizing_t;

/* The pool tdm_node_size_pool chose. */
typedef struct tdm_node_pool_size {
    uint64_t budget_bytes; /* memory_budget, or floor(gpu_memory_utilization x total) */
    uint64_t block_bytes;  /* tdm_kv_block_bytes(layout) */
    uint32_t n_blocks;     /* tdm_kv_plan's pool_blocks, capped at 2^32 - 2 */
} tdm_node_pool_size_t;

/* Sizes a node's KV pool: budget = memory_budget, or on a device node without one
 * floor(gpu_memory_utilization x device_total_bytes); a device node's budget must be at most
 * device_free_bytes (two nodes on one GPU each take a share, e.g. 0.4). Blocks =
 * tdm_kv_plan's pool_blocks for that budget after weight_bytes + scratch_bytes (the same
 * arithmetic as `tandem kvcalc`). Pure: the device figures are given, not queried.
 * Errors (*out zeroed, message in *err with every figure in bytes: total, free, budget,
 * weights, scratch, blocks, one full-context sequence, the budget needed): TDM_ERESOURCE when
 * the budget exceeds the free memory or holds less than one full-context sequence of KV;
 * TDM_EINVALID for a bad layout or utilization (tdm_kv_plan's message). */
int tdm_node_size_pool(const tdm_node_sizing_t *in, tdm_node_pool_size_t *out, tdm_error_t *err);

/* This host's id for transport choice: /proc/sys/kernel/random/boot_id without its newline
 * into buf (cap >= 37), "" when it cannot be read (a node on another OS: then no pair is
 * on the same host). Cannot fail. */
void tdm_node_host_id(char *buf, size_t cap);

/* Opens the runtime of node `node` of cluster cfg: loads its CURVE keys (tdm_node_keys_open,
 * first, so that a bad key file fails at once), loads cfg->model.path, sizes the KV pool
 * as (budget - weight bytes - engine scratch bytes) / block bytes (tdm_node_size_pool: the
 * same sizing function as `tandem kvcalc`; on device cuda:N the budget is in device memory,
 * the engine's backend is cuda on device N, and weights and scratch are the engine's device
 * figures), creates the engine (node->threads,
 * node->max_batch_tokens rows, node->max_running logit rows), the grammar vocabulary and
 * cache (structured output) and a worker in `mode`.
 * Errors (*err, message with the numbers): TDM_ENOTFOUND (model file), TDM_EINVALID (model,
 * config), TDM_ERESOURCE when the budget does not hold the weights plus one full-context
 * sequence (n_ctx tokens of KV), or a device budget exceeds its free memory, or out of
 * memory; TDM_EPRECONDITION for a cuda device in a build without CUDA (the message names the
 * build); TDM_EUNAVAILABLE / TDM_EINVALID for a device the CUDA runtime cannot use or does
 * not have. On error nothing is left to close. */
int tdm_node_runtime_open(tdm_node_runtime_t *rt, const tdm_config_t *cfg,
                          const tdm_node_config_t *node, tdm_worker_mode_t mode, tdm_error_t *err);

/* Frees everything the runtime holds; zeroes it. NULL-safe. */
void tdm_node_runtime_close(tdm_node_runtime_t *rt);

/* ---- link to the router ---- */

/* Figures sent in each heartbeat. */
typedef struct tdm_node_load {
    uint32_t kv_blocks_free, kv_blocks_used, kv_blocks_cached;
    uint32_t running, waiting;
    uint64_t queued_prefill_tokens;
    double step_s;              /* last forward pass, seconds */
    uint32_t batch_size;        /* sequences in the last forward pass */
    double decode_step_s;       /* last pass of decode rows only, seconds (0: none yet) */
    uint32_t decode_batch_size; /* sequences in it */
    uint64_t prefix_queries, prefix_hits;
    /* forward passes by tokens since the node started (tdm_worker_stats_t's) */
    uint64_t iteration_counts[TDM_WORKER_ITERATION_BUCKETS];
    uint64_t iteration_tokens;
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens; /* tdm_worker_stats_t's */
} tdm_node_load_t;

typedef enum tdm_node_link_state {
    TDM_NODE_LINK_CONNECTING = 0, /* registering (the router may not be up yet) */
    TDM_NODE_LINK_REGISTERED = 1,
    TDM_NODE_LINK_REJECTED = 2, /* the router refused the node: see the message */
} tdm_node_link_state_t;

typedef struct tdm_node_link_opts {
    const char *router_endpoint;            /* router.node_endpoint */
    const tdm_curve_keys_t *curve;          /* NULL: plain TCP */
    const Tandem__V1__RegisterRequest *reg; /* packed and kept; the DEALER identity is
                                               "<node_id>.<instance_id as 16 hex digits>" */
    const tdm_logger_t *log;
    const tdm_node_load_t *initial_load; /* what the first heartbeats say until the engine
                                            publishes (NULL: zeros, i.e. no free blocks) */
} tdm_node_link_opts_t;

typedef struct tdm_node_link tdm_node_link_t;

/* Starts the I/O thread, which connects to the router and registers (retrying every second
 * until acknowledged; again whenever the router answers a heartbeat with NOT_FOUND).
 * Returns NULL with *err set (TDM_EINVALID, TDM_ERESOURCE, TDM_EINTERNAL). */
tdm_node_link_t *tdm_node_link_new(tdm_net_t *net, const tdm_node_link_opts_t *opts,
                                   tdm_error_t *err);

/* Stops the I/O thread and closes both sockets (the engine-side one too: call from the
 * engine thread after it stopped using it). NULL-safe, nulls *self_p. */
void tdm_node_link_destroy(tdm_node_link_t **self_p);

/* The engine thread's socket: frames from the router arrive here (tdm_sock_recv), and
 * NOTIFY/END frames sent here go to the router. */
tdm_sock_t *tdm_node_link_sock(tdm_node_link_t *l);

/* Publishes the load for the next heartbeat. Thread-safe. */
void tdm_node_link_set_load(tdm_node_link_t *l, const tdm_node_load_t *load);

/* The registration state; with REJECTED, msg (cap bytes) gets the router's reason. */
tdm_node_link_state_t tdm_node_link_state(tdm_node_link_t *l, char *msg, size_t cap);

/* The instance id of the router this node is registered with (RegisterAck), 0 before the
 * first registration. When it changes the router restarted: work dispatched by an older
 * instance is orphaned and the engine drops it. Thread-safe. */
uint64_t tdm_node_link_router_instance(tdm_node_link_t *l);

/* Frames from the router the link dropped because they came from another router instance
 * than the registered one, since the link started; every heartbeat reports it
 * (Heartbeat.stale_router_frames, the router's tandem_node_stale_router_frames_total).
 * Thread-safe. */
uint64_t tdm_node_link_stale_frames(tdm_node_link_t *l);

/* Fills a load from a worker and pool. */
void tdm_node_load_collect(const tdm_worker_t *w, const tdm_kv_pool_t *pool, tdm_node_load_t *out);

/* ---- helpers shared by the node daemons ---- */

/* The node `node_id` of cfg, or (node_id NULL) its first node of `role`. NULL with *err:
 * TDM_ENOTFOUND (no such node; the message lists the ids of that role), TDM_EINVALID (the
 * node has another role). */
const tdm_node_config_t *tdm_node_pick(const tdm_config_t *cfg, const char *node_id,
                                       tdm_node_role_t role, tdm_error_t *err);

/* Builds the node's RegisterRequest (id, role, version, model fingerprint, KV layout and
 * blocks, kv_endpoint (decode nodes; NULL otherwise), transports, device, limits, n_ctx, a
 * random instance id) and starts the link to cfg->router.node_endpoint, over CURVE with
 * rt->keys when CURVE is on. Logs a warning when security.insecure is true. */
tdm_node_link_t *tdm_node_link_start(tdm_net_t *net, const tdm_config_t *cfg,
                                     const tdm_node_config_t *node, const tdm_node_runtime_t *rt,
                                     const char *kv_endpoint, const tdm_logger_t *log,
                                     tdm_error_t *err);

/* Waits until everything the engine thread sent on tdm_node_link_sock before this call has
 * reached the router, or timeout_ms passed. The I/O thread relays what is queued, then sends
 * a heartbeat and waits for its answer: the router answers in order, so the answer proves the
 * rest arrived. Call from the engine thread (it writes to the engine socket). Returns 0 once
 * drained; TDM_EDEADLINE when timeout_ms passed first (router down or slow), TDM_EUNAVAILABLE
 * when the request cannot be queued. Used before shutdown, since the link's sockets drop what
 * is unsent when they close. */
int tdm_node_link_flush(tdm_node_link_t *l, int timeout_ms);

/* Sampling parameters of a task: defaults, then the message's fields (set_mask), then
 * max_tokens; validated against n_vocab. TDM_EINVALID naming the field otherwise. m may be
 * NULL (defaults). */
int tdm_node_sampling(const Tandem__V1__SamplingParams *m, int32_t max_tokens, uint32_t n_vocab,
                      tdm_sampling_params_t *out, tdm_error_t *err);

/* The constraint of a task (PrefillTask.constraint, DecodeReserve.constraint) into *g: NULL
 * when c is NULL or of kind NONE; else the compiled grammar from the cache (held until
 * tdm_grammar_cache_release; tdm_node_req_drop releases a request's). Returns 0; TDM_EINVALID
 * naming "constraint" for a kind other than GRAMMAR, a text over TDM_GRAMMAR_MAX_TEXT_BYTES, a
 * hash that does not match the text or a grammar that does not compile; TDM_ERESOURCE. */
int tdm_node_constraint(tdm_grammar_cache_t *cache, const Tandem__V1__Constraint *c,
                        const tdm_grammar_t **g, tdm_error_t *err);

/* One dispatch attempt held by a node (docs/protocol.md "Identities"). The router's attempt id
 * is the key of all node state: the worker's sequence id, the KV reservation and the
 * transfer; the client's request id is only a label carried back on messages and logs, so a
 * request id reused by a client can never reach another attempt's state. */
typedef struct tdm_node_attempt {
    uint64_t attempt_id;      /* never 0 */
    uint64_t router_instance; /* FrameHeader.instance_id of the router that dispatched it */
    char key[17];             /* "%016" PRIx64 of attempt_id: its printable form, for logs */
    char label[TDM_REQUEST_ID_MAX + 1]; /* the client's request id */
} tdm_node_attempt_t;

/* Fills *a from a task message's request_id and attempt_id and the frame's router instance.
 * TDM_EINVALID naming the field when request_id is empty, too long or not printable ASCII,
 * or attempt_id is 0. */
int tdm_node_attempt_init(tdm_node_attempt_t *a, const char *request_id, uint64_t attempt_id,
                          uint64_t router_instance, tdm_error_t *err);

/* ---- the serve loop ---- */

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
tdm_node_link_t *tdm_node_router(tdm_node_t *n); /* NULL before tdm_node_connect */
tdm_sock_t *tdm_node_sock(tdm_node_t *n);        /* tdm_node_link_sock of the link */

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

/* Reports attempt a failed on this node's link (an attempt with no entry, e.g. a task refused
 * before it got one). */
void tdm_node_fail(tdm_node_t *n, const tdm_node_attempt_t *a, int status, bool retryable,
                   const char *msg);

/* Tells the router attempt a failed on this node (NOTIFY TaskFailed: request and attempt,
 * status, message, whether the router may re-dispatch it) and logs it as a warning under the
 * request id. */
void tdm_node_report_failed(tdm_sock_t *s, const tdm_logger_t *log, const tdm_node_attempt_t *a,
                            int status, bool retryable, const char *msg);

/* Sends a worker TOKEN event of attempt a to the router as a TokenEvent (NOTIFY). */
int tdm_node_send_token(tdm_sock_t *s, const tdm_node_attempt_t *a, const tdm_worker_event_t *ev);

/* Answers a NODE_STATUS request with the node's live figures. */
int tdm_node_reply_status(tdm_sock_t *s, const tdm_frame_t *f, const tdm_node_config_t *node,
                          const tdm_node_runtime_t *rt, tdm_node_link_t *link);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NODE_H */
