/* router.h - the router daemon's core: client API, node registry, scheduler, request table.
 *
 * One tdm_router_t owns two ZMQ ROUTER sockets: the client endpoint (METHOD_GENERATE / HEALTH
 * / MODELS / STATUS from libtandem-client, `tandem`, tests) and the node endpoint (prefill and
 * decode nodes register, heartbeat, receive DecodeReserve / PrefillTask / NodeCancel and send
 * TokenEvent / Finished / TaskFailed; docs/architecture.md "Router" and the node protocol).
 * It loads the model itself (mmap, no engine) for the tokenizer, the chat template, n_vocab,
 * the fingerprint and the context length, so nodes see token ids only and the router owns
 * text: tokenization, incremental detokenization and stop strings.
 *
 * Threading: everything runs on the thread that calls tdm_router_poll / tdm_router_run (the
 * sockets are made by tdm_router_new and then belong to that thread). Nothing is global, so
 * a test can run a router, fake nodes and a fake client in one process.
 */
#ifndef TANDEM_ROUTER_H
#define TANDEM_ROUTER_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/prompt.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/worker.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A GENERATE without max_tokens (0) gets what the context leaves after its prompt, at most
 * this many tokens (the OpenAI chat default of vLLM-like servers: answers end by EOS first). */
#define TDM_ROUTER_MAX_TOKENS_DEFAULT 1024u
/* Times a request is dispatched again after a retryable TaskFailed or a prefill node loss. */
#define TDM_ROUTER_MAX_REDISPATCH 3
/* Leading full blocks of a prompt that make the prefix_aware routing key (see router.c). */
#define TDM_ROUTER_PREFIX_KEY_BLOCKS 4u

/* A latency histogram, Prometheus-style: buckets[i] counts observations <= bound i
 * (tdm_router_hist_bounds; not cumulative here), the last bucket is +Inf. Seconds. */
#define TDM_ROUTER_HIST_BUCKETS 16
typedef struct tdm_router_hist {
    uint64_t count;
    double sum; /* seconds */
    uint64_t buckets[TDM_ROUTER_HIST_BUCKETS];
} tdm_router_hist_t;

/* Upper bounds (seconds) of the first TDM_ROUTER_HIST_BUCKETS - 1 buckets, ascending; the
 * last bucket is +Inf. Points to constant storage. Cannot fail. */
const double *tdm_router_hist_bounds(void);

/* Counters and latency figures for the metrics endpoint (router/metrics.h renders them as
 * Prometheus text). Monotonic. */
typedef struct tdm_router_metrics {
    uint64_t requests_total;         /* GENERATE requests received (valid or not) */
    uint64_t requests_by_status[17]; /* finished requests by final gRPC code (0 = OK) */
    uint64_t requests_by_finish[5];  /* OK requests by FinishReason (STOP, LENGTH, ...);
                                        cancelled ones count under CANCELLED */
    uint64_t prompt_tokens;          /* prompt tokens of accepted requests */
    uint64_t generation_tokens;      /* output tokens delivered to clients */
    uint64_t cached_prompt_tokens;   /* prompt tokens the prefill nodes found cached */
    uint64_t computed_prompt_tokens; /* prompt tokens the prefill nodes computed: counted with
                                        cached_prompt_tokens when a request's first token
                                        arrives, so both only grow */
    uint64_t redispatches;           /* requests dispatched again (TaskFailed, node loss) */
    uint64_t migrations;             /* of those, dispatches that resumed a request after
                                        output tokens already delivered (migration) */
    uint64_t shed;                   /* refused by admission control (no node in time) */
    uint64_t reserve_rejects;        /* DecodeReserve refused with RESOURCE_EXHAUSTED */
    uint64_t node_failures;          /* nodes marked down */
    uint64_t duplicate_events;       /* token events dropped as already delivered */
    uint64_t queue_full;             /* requests refused because the queue was full */
    tdm_router_hist_t queue;         /* arrival -> reservation acknowledged */
    tdm_router_hist_t ttft;          /* arrival -> first token out */
    tdm_router_hist_t itl;           /* between consecutive tokens out */
    tdm_router_hist_t tpot;          /* per request: decode_s / (completion - 1) */
    tdm_router_hist_t e2e;           /* arrival -> final message */
    tdm_router_hist_t prefill;       /* node-measured prefill compute */
    tdm_router_hist_t kv_transfer;   /* node-measured KV transfer */
    tdm_router_hist_t reserve;       /* DecodeReserve sent -> its answer (the round trip the
                                        prefill no longer waits for) */

    /* The ended requests of requests_by_status again, by (final gRPC code, FinishReason);
     * FinishReason 0 (UNSPECIFIED) counts requests refused before they started (validation,
     * API key, deadline on arrival). */
    uint64_t requests_by_status_finish[17][5];
    /* KV bytes decode nodes received for finished requests (Finished.kv_transfer_bytes). */
    uint64_t kv_transfer_bytes;
    /* Retryable TaskFailed from a prefill node after its first token (its transfer had
     * started) or from a decode node before the KV arrived (rejected or never came). */
    uint64_t kv_transfer_failures;
    /* Node messages dropped because they belong to an attempt of a request that is not its
     * current one (a reused request id, a superseded dispatch). */
    uint64_t stale_attempt_messages;
    /* EMBED calls (embed.c) that ended, by final gRPC code (0 = OK), and the prompt tokens of
     * the answered ones (counted in prompt_tokens too, as vLLM counts a pooling request's) */
    uint64_t embed_requests_by_status[17];
    uint64_t embed_prompt_tokens;
    /* Node messages dropped because they came from a connection or instance that is not the
     * registered instance of that node (an impostor, a restarted node's old connection). */
    uint64_t stale_instance_messages;
    /* Registrations refused (unknown id, second instance of a live node, key of another
     * node, config mismatch). */
    uint64_t registrations_refused;
    /* The router loop: how long each iteration took (handling what one poll returned, then
     * the timers; not the wait), the longest since start, and the heartbeat checks that came
     * late (more than a heartbeat interval, at least 100 ms, after the previous one: the loop
     * was stalled, and the excess was not charged to the nodes' silence). */
    tdm_router_hist_t loop;
    double loop_max_s;
    uint64_t loop_stalls;
    double loop_stall_s; /* the time those stalls were not charged, seconds */
    /* Completed requests (the vLLM-compatible series, docs/operations.md): decode time (first
     * to last token), inference time (dispatch to end), and over tdm_router_token_bounds the
     * prompt and output tokens and the preemptions each request had on its decode node. */
    tdm_router_hist_t decode;
    tdm_router_hist_t inference;
    tdm_router_hist_t prompt_len;
    tdm_router_hist_t generation_len;
    /* Per completed call: the most output tokens of its choices (its only one's for n = 1),
     * observed when the last choice completes (vLLM's request_max_num_generation_tokens). */
    tdm_router_hist_t max_generation_len;
    tdm_router_hist_t preemptions_per_request;
    uint64_t preemptions; /* sum of Finished.preemptions */
    /* Tokens per forward pass, over every node instance that reported them in heartbeats
     * (rt_metrics_iterations): passes per bucket of tdm_worker_iteration_bounds (not
     * cumulative; the last is +Inf) and the tokens of them all. A node that restarted or went
     * away keeps what it had reported. */
    uint64_t iteration_counts[TDM_WORKER_ITERATION_BUCKETS];
    uint64_t iteration_tokens;
    /* Accepted GENERATE calls, over tdm_router_token_bounds: their n (choices) and their
     * max_tokens as the router resolved it (vLLM's request_params_n and _max_tokens). */
    tdm_router_hist_t params_n;
    tdm_router_hist_t params_max_tokens;
} tdm_router_metrics_t;

/* Upper bounds of the token-count histograms (1, 2, 5, 10, ... 50000, like vLLM's 1-2-5
 * buckets), TDM_ROUTER_HIST_BUCKETS - 1 of them. Points to constant storage. */
const double *tdm_router_token_bounds(void);

typedef struct tdm_router tdm_router_t;

/* A node silent for this many heartbeat timeouts is down; after one it is suspect. */
#define TDM_ROUTER_DOWN_TIMEOUTS 2u

/* Creates a router: loads every model of cfg->models (tdm_model_load: mmap, no engine), builds
 * each one's tokenizer and picks its chat template (config override or the model's, with its
 * default system message), binds the client endpoint and the node endpoint (CURVE server keys on
 * the node endpoint when cfg->security has them), and logs "router ready client=ENDPOINT
 * nodes=ENDPOINT" with the endpoints actually bound (a "tcp://HOST:*" endpoint reports its port). A
 * model without a recognised chat template is accepted; chat requests then fail with
 * FAILED_PRECONDITION. cfg, net and log are borrowed and must outlive the router (log may be NULL:
 * stderr). Returns NULL with *err set: TDM_ENOTFOUND / TDM_EINVALID (model or tokenizer; the
 * message names the file), TDM_EUNAVAILABLE (endpoint in use), TDM_EINVALID (bad endpoint or keys),
 * TDM_ERESOURCE (out of memory). Caller frees with tdm_router_destroy. */
tdm_router_t *tdm_router_new(const tdm_config_t *cfg, tdm_net_t *net, const tdm_logger_t *log,
                             tdm_error_t *err);

/* Shuts down (tdm_router_shutdown) if that was not done, closes the sockets and frees
 * everything. NULL-safe; nulls *self_p. */
void tdm_router_destroy(tdm_router_t **self_p);

/* One step of the event loop: waits up to timeout_ms (0: do not wait; < 0 or more than
 * 50 ms: 50 ms, so the timers run) for messages on either socket, handles every message waiting (up
 * to a few hundred per socket, so timers stay on time), then the timers: every node message
 * still waiting, liveness (tdm_router_check_liveness: suspect, down) and request deadlines.
 * Returns 0; TDM_ECANCELLED when the wait was interrupted by a signal
 * or the context is shutting down (the caller checks its stop flag); TDM_EINTERNAL on a ZMQ
 * failure; TDM_EPRECONDITION after tdm_router_shutdown. */
int tdm_router_poll(tdm_router_t *r, int timeout_ms);

/* Runs tdm_router_poll until *stop becomes non-zero (set it from a signal handler), then
 * tdm_router_shutdown. Returns 0, or TDM_EINTERNAL when polling failed (after shutting
 * down). */
int tdm_router_run(tdm_router_t *r, volatile sig_atomic_t *stop);

/* Stops serving: every request in flight or queued ends with END UNAVAILABLE "router
 * shutting down" to its client and NodeCancel to its nodes, and is freed. Later polls return
 * TDM_EPRECONDITION. Idempotent; cannot fail. */
void tdm_router_shutdown(tdm_router_t *r);

/* The endpoints actually bound ("tcp://127.0.0.1:41234"); owned by the router. */
const char *tdm_router_client_endpoint(const tdm_router_t *r);
/* The client socket's in-process endpoint ("inproc://tandem-router-<instance>"), bound too so
 * that a client in this process on the router's tdm_net_t (the HTTP gateway) needs no TCP. */
const char *tdm_router_inproc_endpoint(const tdm_router_t *r);
/* The router's tokenizer of its first model, its chat template (NULL when the model has none
 * the router knows) and the context length in tokens: immutable for the router's life, so other
 * threads (the HTTP gateway's /tokenize) may use them with tdm_prompt_encode while the router runs.
 * Owned by the router. */
void tdm_router_vocab(const tdm_router_t *r, const tdm_tokenizer_t **tok,
                      const tdm_chat_pick_t **pick, uint32_t *n_ctx);
/* The same for served model index (cfg->models[index]); false (nothing written) for an index
 * past the models. */
bool tdm_router_model_vocab(const tdm_router_t *r, size_t index, const tdm_tokenizer_t **tok,
                            const tdm_chat_pick_t **pick, uint32_t *n_ctx);
const char *tdm_router_node_endpoint(const tdm_router_t *r);

/* Heartbeat figures sent to nodes in RegisterAck and used for liveness: a node not heard
 * from for timeout_ms is suspect (no new work; its running work continues), for
 * TDM_ROUTER_DOWN_TIMEOUTS x timeout_ms it is marked down (its work failed or re-dispatched).
 * Silence is measured on the router's liveness clock, which leaves out the router loop's own
 * stalls (tdm_router_check_liveness). Defaults TDM_HEARTBEAT_INTERVAL_MS /
 * TDM_HEARTBEAT_TIMEOUT_MS; tests shorten or lengthen them. Applies to registrations
 * after the call and to the liveness check at once. 0 keeps the current value. */
void tdm_router_set_heartbeat(tdm_router_t *r, uint32_t interval_ms, uint32_t timeout_ms);

/* The first served model's figures: context length (tokens), vocabulary size, fingerprint. */
uint32_t tdm_router_n_ctx(const tdm_router_t *r);
uint32_t tdm_router_n_vocab(const tdm_router_t *r);
uint64_t tdm_router_fingerprint(const tdm_router_t *r);
/* The router's instance id (random per start, never 0; FrameHeader.instance_id of every
 * frame it sends to nodes). */
uint64_t tdm_router_instance(const tdm_router_t *r);

/* Requests dispatched to nodes (reserving or running) / waiting in the queue. */
size_t tdm_router_n_running(const tdm_router_t *r);
size_t tdm_router_n_queued(const tdm_router_t *r);

/* True when the configured node `id` is registered and not marked down. */
bool tdm_router_node_up(const tdm_router_t *r, const char *id);
/* True when the configured node `id` is up but suspect (silent for the heartbeat timeout). */
bool tdm_router_node_suspect(const tdm_router_t *r, const char *id);

/* The liveness check the loop's timers run, as at monotonic time now (seconds, tdm_time_now's
 * clock): nodes silent for the heartbeat timeout become suspect, for
 * TDM_ROUTER_DOWN_TIMEOUTS timeouts down. The liveness clock advances by the time since the
 * previous check but by at most max(heartbeat interval, 100 ms): a loop that was stalled
 * (starved of CPU, a long iteration) does not count its stall against the nodes, whose
 * messages waited in the socket meanwhile. A now earlier than the previous check advances
 * nothing. Tests call it with a later now to inject a stall. Cannot fail. */
void tdm_router_check_liveness(tdm_router_t *r, double now);

/* The router's counters; points into the router (valid until tdm_router_destroy). */
const tdm_router_metrics_t *tdm_router_metrics(const tdm_router_t *r);

/* Last error message of the router ("" if none). */
const char *tdm_router_errmsg(const tdm_router_t *r);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_ROUTER_H */
