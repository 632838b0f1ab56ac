/* router_internal.h - the router's private state, shared by router.c (loop, client API,
 * status), request.c (validation, output, completion) and nodes.c (registry, scheduling).
 *
 * Request lifecycle (states): QUEUED (waiting for a decode node with room) -> RESERVING
 * (DecodeReserve sent, reply pending) -> RUNNING (reservation acknowledged, PrefillTask sent
 * or local prefill) -> freed (completed, failed, cancelled). Re-dispatch puts a request back
 * through dispatch with its delivered output kept.
 */
#ifndef TANDEM_ROUTER_INTERNAL_H
#define TANDEM_ROUTER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "router.h"
#include "tandem/chat.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/prompt.h"
#include "tandem/proto.h"
#include "tandem/sampling.h"
#include "tandem/serve.h"
#include "tandem/tokenizer.h"

typedef struct rt_req rt_req_t;

/* A DecodeReserve awaiting its END. req is NULL once the request went away (its NodeCancel
 * was sent then); the entry stays until the reply so the reserved blocks are accounted. */
typedef struct rt_pending {
    uint64_t call_id;
    uint32_t n_blocks;
    rt_req_t *req;
} rt_pending_t;

/* One configured node and the router's view of it. */
typedef struct rt_node {
    const tdm_node_config_t *cfg;   /* into the router's config */
    size_t index;                   /* position in r->nodes */
    bool registered;                /* registered at least once */
    bool up;                        /* registered and heard from within the timeout */
    uint64_t instance_id;           /* the registered instance (FrameHeader.instance_id) */
    uint8_t peer[TDM_NET_PEER_MAX]; /* routing id of the registered instance's connection:
                                       only messages from it are this node's */
    size_t peer_len;
    char refused_reason[TDM_ERRMSG_MAX]; /* last registration refused with this id ("" none
                                            since it was last accepted) */
    double refused_at;                   /* monotonic s of that refusal */
    uint64_t refused_count;              /* refusals since it was last accepted */
    double last_seen;                    /* monotonic seconds of the last message */
    char down_reason[160];               /* why it was last marked down ("" if never) */
    uint64_t failures;                   /* times marked down (metrics) */
    /* from RegisterRequest */
    uint32_t kv_blocks_total, max_running, max_batch_tokens, n_ctx;
    char *kv_endpoint; /* decode: where prefill nodes send KV pages (heap) */
    char device[32];
    /* last heartbeat (kv_blocks_free = kv_blocks_total right after registering) */
    uint32_t kv_free, kv_used, kv_cached, running, waiting, batch_size;
    uint64_t queued_prefill_tokens, prefix_queries, prefix_hits;
    double step_time_s;
    /* router's own bookkeeping since the last heartbeat */
    uint64_t tokens_since_hb;  /* prefill: prompt tokens sent */
    uint32_t reserved_pending; /* decode: blocks of reservations awaiting a reply */
    uint32_t reserved_acked;   /* decode: blocks acknowledged since the last heartbeat */
    rt_pending_t *pending;     /* reserve calls awaiting END */
    size_t n_pending, cap_pending;
} rt_node_t;

typedef enum rt_state {
    RT_QUEUED = 0,
    RT_RESERVING = 1,
    RT_RUNNING = 2,
} rt_state_t;

/* A token event waiting for earlier indices (reorder buffer). */
typedef struct rt_event {
    uint32_t index;
    int32_t token;
    float logprob;
    uint32_t n_top;
    tdm_token_logprob_t top[TDM_SAMPLING_MAX_LOGPROBS];
    uint32_t cached_prompt_tokens;
    double prefill_s;
} rt_event_t;

/* Output accumulated for the next GenerateChunk (stream) or the whole answer (no stream). */
typedef struct rt_chunk {
    uint32_t index;                 /* output index of ids[0] */
    int32_t *ids;                   /* [n] */
    float *logprobs;                /* [n] when logprobs are asked for */
    Tandem__V1__TopLogprobs **tops; /* [n] when logprobs are asked for; each heap */
    char **texts;                   /* [n] when echo_token_text; each heap */
    size_t n, cap;
    char *text; /* text delta, NUL-terminated */
    size_t text_len, text_cap;
} rt_chunk_t;

struct rt_req {
    char id[TDM_ROUTER_REQUEST_ID_MAX + 1];
    uint8_t peer[TDM_NET_PEER_MAX]; /* the client's routing id */
    size_t peer_len;
    uint64_t call_id;
    bool stream, include_stop_str, echo;
    int32_t *prompt; /* [n_prompt] heap */
    uint32_t n_prompt;
    tdm_sampling_params_t sp; /* validated; seed drawn when the client gave none */
    char **stop;              /* [n_stop] heap strings */
    size_t n_stop;
    uint64_t deadline_ms; /* unix ms */
    rt_state_t state;
    rt_node_t *decode, *prefill; /* current assignment; prefill NULL: none or local */
    bool local_prefill;
    uint32_t n_blocks; /* prompt blocks the reservation asks for */
    uint64_t reserve_call;
    uint64_t attempt_id; /* the current dispatch attempt (0: none yet); node messages of any
                            other attempt are ignored and counted */
    bool *tried;         /* [r->n_nodes] decode nodes that refused this round */
    int redispatches;
    /* output */
    uint32_t next_index; /* tokens delivered to the output so far */
    rt_event_t *buf;     /* out-of-order events */
    size_t n_buf, cap_buf;
    bool finished; /* Finished received */
    int finish_reason;
    uint32_t completion_tokens;
    double kv_transfer_s;
    bool decode_started; /* an index >= 1 or Finished came from the decode node */
    bool prefilled;      /* this attempt's prefill node sent index 0 (its KV transfer began) */
    tdm_detok_t detok;
    char *hold; /* text produced but not sent: could start a stop string */
    size_t hold_len, hold_cap;
    rt_chunk_t chunk;
    uint32_t cached_prompt_tokens;
    double prefill_s;
    double t_arrival, t_dispatch, t_first, t_last; /* monotonic s; 0 = not yet */
    /* links */
    rt_req_t *prev, *next;   /* all requests */
    rt_req_t *qprev, *qnext; /* the queue */
    rt_req_t *hnext;         /* hash chain */
    bool queued;
};

struct tdm_router {
    const tdm_config_t *cfg;
    tdm_net_t *net;
    tdm_logger_t log;
    tdm_error_t err;
    tdm_model_t *model;
    tdm_tokenizer_t *tok;
    bool have_template;
    tdm_chat_pick_t chat; /* the template chat requests use; set when have_template */
    char template_error[TDM_ERRMSG_MAX];
    uint32_t n_ctx, n_vocab, block_size;
    uint64_t fingerprint;
    tdm_kv_layout_t layout;
    tdm_sock_t *client, *nodesock;
    char client_ep[256], node_ep[256];
    char inproc_ep[64]; /* the client socket's second endpoint, for the in-process gateway */
    uint32_t hb_interval_ms, hb_timeout_ms;
    rt_node_t *nodes;
    size_t n_nodes;
    size_t rr_next; /* round robin cursor */
    /* prefix_aware: direct-mapped table block hash -> node index + 1 (0 = empty) */
    uint64_t *prefix_keys;
    uint32_t *prefix_nodes;
    size_t prefix_mask;
    /* requests */
    rt_req_t *head;  /* all requests, newest first */
    rt_req_t **hash; /* by id */
    size_t hash_cap, n_reqs;
    rt_req_t *qhead, *qtail;
    size_t n_queued;
    uint64_t next_call;
    uint64_t instance_id;  /* this router's instance: random per start, never 0 */
    uint64_t next_attempt; /* next dispatch attempt id (random start, never 0) */
    /* registrations refused for node ids that are not in the config, most recent first */
    struct {
        char node_id[TDM_NODE_ID_MAX + 1];
        char reason[TDM_ERRMSG_MAX];
        double at;
        uint64_t count;
    } refused[8];
    size_t n_refused;
    double next_timers;
    bool shut;
    tdm_router_metrics_t metrics;
};

/* ---- router.c ---- */
void rt_hist_observe(tdm_router_hist_t *h, double seconds);
/* ---- metrics.c ---- */
/* Answers a METRICS REQUEST with MetricsResponse{text} (router/metrics.h). */
void rt_client_metrics(tdm_router_t *r, const tdm_frame_t *f);
/* Sends END(status, message) for a client call; returns tdm_sock_send's code. */
int rt_send_end(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id, int status,
                const char *message, const ProtobufCMessage *body);
/* NOTIFY to a node by its id (its routing id). Failures are logged at debug and ignored. */
void rt_node_notify(tdm_router_t *r, rt_node_t *n, int method, const ProtobufCMessage *body);

/* ---- request.c ---- */
/* Counts an ended GENERATE request: final status (0 or a negative TDM_E code) and
 * FinishReason (-1: refused before it started). */
void rt_count_end(tdm_router_t *r, int status, int finish);
/* Handles a GENERATE REQUEST frame (validation, tokenization, dispatch). */
void rt_generate(tdm_router_t *r, const tdm_frame_t *f);
/* Client CANCEL for (peer, call id). */
void rt_client_cancel(tdm_router_t *r, const tdm_frame_t *f);
rt_req_t *rt_req_find(tdm_router_t *r, const char *id);
/* The request with this id whose current attempt is `attempt`, or NULL; *id_known tells
 * whether any request in flight has the id (so NULL means a stale attempt, not an unknown
 * request). Client ids may repeat across clients: node messages are matched by attempt. */
rt_req_t *rt_req_find_attempt(tdm_router_t *r, const char *id, uint64_t attempt, bool *id_known);
/* Ends a request with an error: END status to the client, NodeCancel to its nodes (when
 * cancel_nodes), metrics, freed. */
void rt_req_fail(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Drops a request without telling the client (cancel / client gone): NodeCancel, freed. */
void rt_req_drop(tdm_router_t *r, rt_req_t *q, const char *why);
/* Sends NodeCancel(status) to the request's prefill and decode nodes and detaches a pending
 * reservation. Leaves the assignment cleared. */
void rt_req_release_nodes(tdm_router_t *r, rt_req_t *q, int status);
/* A token event for q (from its prefill or decode node). Returns true when q was freed. */
bool rt_req_token_event(tdm_router_t *r, rt_req_t *q, const Tandem__V1__TokenEvent *ev);
/* Finished for q. Returns true when q was freed. */
bool rt_req_finished(tdm_router_t *r, rt_req_t *q, const Tandem__V1__Finished *fin);
/* Deadline scan. */
void rt_req_check_deadlines(tdm_router_t *r, uint64_t now_ms);
/* Frees every request with END UNAVAILABLE "router shutting down". */
void rt_req_shutdown_all(tdm_router_t *r);
/* Frees the request and unlinks it everywhere (no messages). */
void rt_req_free(tdm_router_t *r, rt_req_t *q);
void rt_queue_push(tdm_router_t *r, rt_req_t *q, bool front);
void rt_queue_remove(tdm_router_t *r, rt_req_t *q);

/* ---- nodes.c ---- */
void rt_node_message(tdm_router_t *r, const tdm_frame_t *f);
rt_node_t *rt_node_find(tdm_router_t *r, const char *id, size_t len);
/* The node whose registered connection has routing id peer, or NULL. */
rt_node_t *rt_node_by_peer(tdm_router_t *r, const uint8_t *peer, size_t len);
/* A new dispatch attempt id (never 0, never repeated by this router instance). */
uint64_t rt_next_attempt(tdm_router_t *r);
/* Appends to buf (cap bytes) why decode nodes that were refused are not serving ("" when
 * none was refused), for the error of a request that waited for one. */
void rt_refused_decode_note(const tdm_router_t *r, char *buf, size_t cap);
/* Places q (not queued) on a decode node: sends DecodeReserve to the up decode node with
 * the most room that q has not tried this round. Returns 0 when sent, 1 when no decode node
 * is up or has room (the caller queues q), or a negative status when q can never be served
 * (the caller fails it with r->err's message). */
int rt_dispatch(tdm_router_t *r, rt_req_t *q);
/* Dispatches queued requests (FIFO) while decode nodes have room. */
void rt_drain_queue(tdm_router_t *r);
/* Puts q back through dispatch after a failure of its current attempt (NodeCancel to its
 * nodes first; delivered output is kept). count: whether it counts against
 * TDM_ROUTER_MAX_REDISPATCH; past the limit q fails with status and why. Returns true when
 * q was freed. */
bool rt_redispatch(tdm_router_t *r, rt_req_t *q, bool count, int status, const char *why);
void rt_check_heartbeats(tdm_router_t *r, double now);
/* Heartbeat-age of a node in seconds (-1 when never heard from). */
double rt_node_age(const rt_node_t *n, double now);
/* Decode blocks the router believes free on n (heartbeat free + cached - reservations). */
int64_t rt_node_avail(const rt_node_t *n);
/* Forgets pending entry pointers to q (q is going away). */
void rt_node_detach(rt_node_t *n, rt_req_t *q);

#endif /* TANDEM_ROUTER_INTERNAL_H */
