/* router_internal.h - the router's shared state: the struct definitions only, every field
 * group marked with the one file that writes it (others read). Functions are declared in
 * the header of the file that defines them:
 *
 *   router.c    the object, sockets, event loop, timers, HEALTH / MODELS / STATUS (router.h)
 *   request.c   the request table (index by id and by client call, deadline heap), GENERATE
 *               intake, and how a request ends: failed, dropped, cancelled, deadline, shutdown
 *   scheduler.c request state: the queue, dispatch (DecodeReserve), the reservation's answer,
 *               re-dispatch, the prefill policies; nothing else writes rt_req_t.state
 *   stream.c    a request's output: reorder buffer, detokenizer, stop strings, chunks, the
 *               final answer
 *   nodes.c     node registration, heartbeats, liveness and failure; routes node messages
 *   embed.c     EMBED calls: their own table, one EmbedTask per input, results, failures
 *   stats.c     histograms and the end-of-request counters
 *   metrics.c   renders tdm_router_metrics_t and the node figures (read only)
 *
 * Request lifecycle (states, all written by scheduler.c): QUEUED (waiting for a decode node
 * with room) -> RESERVING (DecodeReserve sent, reply pending; the PrefillTask went right after
 * it, so the prefill node's first token may come now) -> RUNNING (reservation acknowledged, or
 * local prefill) -> freed (completed, failed, cancelled). A refused reservation cancels the
 * attempt's prefill and dispatches again.
 * Re-dispatch puts a request back through dispatch with its delivered output kept: the new
 * attempt resumes at the next output index (migration: its nodes prefill prompt + the tokens
 * delivered, rt_req_t.output, and sample from index next_index on).
 */
#ifndef TANDEM_ROUTER_INTERNAL_H
#define TANDEM_ROUTER_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "heap.h"
#include "index.h"
#include "router.h"
#include "template_cache.h"
#include "transport.h"
#include "tandem/base.h"
#include "tandem/chat.h"
#include "tandem/config.h"
#include "tandem/kv.h"
#include "tandem/list.h"
#include "tandem/model.h"
#include "tandem/net.h"
#include "tandem/node_load.h"
#include "tandem/proto.h"
#include "tandem/sampling.h"
#include "tandem/tokenizer.h"

typedef struct rt_req rt_req_t;

/* Most choices one GENERATE call may ask for (GenerateRequest.n, and best_of on the HTTP API):
 * vLLM has no limit; this one keeps a call's fan-out bounded. */
#define RT_MAX_CHOICES 16

/* The choices of one GENERATE call with n > 1 (request.c): n sibling requests, each a whole
 * request of its own (attempt, detokenizer, stop strings, finish, usage) with seed + i. Choice
 * 0 is dispatched as any request; the others ask the decode node choice 0 runs on to fork its
 * sequence (DecodeReserve.fork_of: one prefill, the prompt blocks shared by reference), and
 * run on their own (their own prefill) when that is not possible. The call's END comes once
 * every choice completed; one choice failing fails the call and ends its siblings. */
typedef struct rt_group {
    rt_req_t *kids[RT_MAX_CHOICES]; /* [n] choice i's request; NULL once it ended */
    uint32_t n;
    uint32_t n_live;        /* choices not ended yet */
    uint32_t refs;          /* n_live, + 1 while the intake still walks kids */
    uint32_t max_generated; /* the most output tokens of a choice completed so far (stream.c) */
} rt_group_t;

/* A DecodeReserve awaiting its END (scheduler.c). req is NULL once the request went away (its
 * NodeCancel was sent then); the entry stays until the reply so the reserved blocks are
 * accounted. */
typedef struct rt_pending {
    uint64_t call_id;
    uint32_t n_blocks;
    rt_req_t *req;
    uint64_t attempt_id; /* the attempt the reservation is for */
    double sent_at;      /* monotonic s; unanswered after the heartbeat timeout, the router
                            gives up on it (scheduler.c rt_sched_check_reserves) */
} rt_pending_t;

/* An attempt the router gave up on while node n may still hold it (its reservation was not
 * answered in time, or n was down when the request left it): NodeCancel is owed to n until
 * it can have arrived (scheduler.c). */
typedef struct rt_orphan {
    uint64_t attempt_id;
    uint64_t sent_epoch; /* n->failures when NodeCancel was sent; RT_ORPHAN_UNSENT: not yet */
    double at;           /* monotonic s it was recorded */
    char id[TDM_REQUEST_ID_MAX + 1];
} rt_orphan_t;

#define RT_ORPHAN_UNSENT UINT64_MAX
#define RT_ORPHANS_MAX 32 /* per node; the oldest goes when full */

/* A decode node's step time against its batch size, for admission control (admit.c): the
 * exponentially weighted sums of heartbeat samples (batch b, mean step time t), from which a
 * least-squares line t(b) is read. All 0 = no sample yet. */
typedef struct rt_step_fit {
    double w, sb, sbb, st, sbt; /* sums of weights, w*b, w*b^2, w*t, w*b*t */
} rt_step_fit_t;

/* One served model (cfg->models[index]) as the router holds it (router.c at start; read only
 * after): its tokenizer, chat template and the figures its nodes must match at registration. */
typedef struct rt_model {
    size_t index;                  /* in r->models and cfg->models */
    const tdm_model_config_t *cfg; /* into the router's config */
    tdm_model_t *model;            /* mmap'd, no engine */
    tdm_tokenizer_t *tok;
    bool have_template;
    tdm_chat_pick_t chat;          /* the template chat requests use; set when have_template */
    rt_template_cache_t templates; /* requests' own chat_template, compiled (template_cache.h) */
    char template_error[TDM_ERRMSG_MAX];
    uint32_t n_ctx, n_vocab;
    uint32_t max_token_bytes; /* the longest text one token stands for (special ones included):
                                 a prompt of more than n_ctx times this many bytes cannot fit,
                                 so it is refused before it is tokenized (validate.c) */
    uint64_t fingerprint;
    tdm_kv_layout_t layout;
    tdm_kv_groups_t kv_groups; /* the model's layer groups (tdm_model_kv_groups), for the nodes
                                  that allocate per group (tdm_node_kv_groups) */
    bool have_kv_groups;       /* the model has sliding-window layers */
    uint32_t n_layer_windows;  /* with have_kv_groups: each layer's window (0 = every key), */
    uint32_t layer_windows[TDM_KV_MAX_LAYERS]; /* ModelInfo.layer_windows */
    /* the figures of this model's requests and nodes that the vLLM-compatible series report
     * with its model_name (the files that write r->metrics write these too; metrics.c renders
     * them); r->metrics stays the whole cluster's */
    tdm_router_metrics_t metrics;
} rt_model_t;

/* One configured node and the router's view of it. */
/* A node's own counters (NodeLoad: since its process started) that /metrics exposes. */
typedef struct rt_node_counters {
    uint64_t prefix_queries, prefix_hits;
    uint64_t spec_drafts, spec_draft_tokens, spec_accepted_tokens;
    uint64_t stale_router_frames;
    double process_cpu_seconds;
} rt_node_counters_t;

typedef struct rt_node {
    /* fixed at start (nodes.c) */
    const tdm_node_config_t *cfg; /* into the router's config */
    size_t index;                 /* position in r->nodes */
    rt_model_t *model;            /* the model it serves (nodes[].model), in r->models */
    /* registration and liveness (nodes.c) */
    bool registered;      /* registered at least once */
    bool up;              /* registered and not declared down */
    bool suspect;         /* up, but silent for more than the heartbeat timeout: no new work is
                             dispatched to it, its running work continues; any message clears it */
    uint64_t instance_id; /* the registered instance (FrameHeader.instance_id) */
    uint8_t peer[TDM_NET_PEER_MAX]; /* routing id of the registered instance's connection:
                                       only messages from it are this node's */
    size_t peer_len;
    char refused_reason[TDM_ERRMSG_MAX]; /* last registration refused with this id ("" none
                                            since it was last accepted) */
    double refused_at;                   /* monotonic s of that refusal */
    uint64_t refused_count;              /* refusals since it was last accepted */
    double last_seen;                    /* monotonic seconds of the last message */
    double seen_live;                    /* r->live_clock of the last message (liveness) */
    char down_reason[160];               /* why it was last marked down ("" if never) */
    uint64_t failures;                   /* times marked down (metrics) */
    uint64_t suspicions;                 /* times marked suspect (metrics) */
    /* from RegisterRequest (nodes.c) */
    uint32_t kv_blocks_total, max_running, max_batch_tokens, n_ctx;
    bool kv_grouped;   /* its pool allocates per layer group (model->kv_groups; kv_layout's
                          group_windows): kv_blocks_* count blocks of one group's layers */
    char *kv_endpoint; /* decode: where prefill nodes send KV pages (heap) */
    char device[32];
    rt_place_t place; /* host and GPUs, for the KV transport choice (transport.c) */
    /* its last heartbeat's load (nodes.c; kv_blocks_free = kv_blocks_total right after
     * registering, the gauges zeroed when it goes down; scheduler.c zeroes kv_blocks_free and
     * kv_blocks_cached when a reservation is refused for room). Counters are cumulative per
     * node process. */
    tdm_node_load_t load;
    /* what its instance iter_instance last reported of its forward passes (heartbeats;
     * rt_metrics_iterations adds what is new to r->metrics) */
    uint64_t iter_instance;
    uint64_t iter_counts[TDM_WORKER_ITERATION_BUCKETS];
    uint64_t iter_tokens;
    /* its counters over every process it ran as, for /metrics, which must never go back
     * (rt_metrics_iterations): counters_done holds the sums of the processes before
     * iter_instance, counters_now the highest that instance has reported */
    rt_node_counters_t counters_done, counters_now;
    rt_step_fit_t step_fit; /* decode: step time by batch size (admit.c; reset on registering) */
    /* the router's own load bookkeeping since the last heartbeat (scheduler.c; nodes.c resets
     * it on a heartbeat, a new registration and a failure) */
    uint64_t tokens_since_hb;  /* prefill: prompt tokens sent */
    uint32_t reserved_pending; /* decode: blocks of reservations awaiting a reply */
    uint32_t reserved_acked;   /* decode: blocks acknowledged since the last heartbeat */
    rt_pending_t *pending;     /* reserve calls awaiting END */
    size_t n_pending, cap_pending;
    /* attempts owed a NodeCancel (scheduler.c) */
    rt_orphan_t orphans[RT_ORPHANS_MAX];
    size_t n_orphans;
    uint64_t embed_tokens; /* tokens of EmbedTasks sent to it and not answered (embed.c) */
    uint32_t embed_inputs; /* EmbedTasks sent to it and not answered: at most its max_running */
} rt_node_t;

typedef enum rt_state {
    RT_QUEUED = 0,
    RT_RESERVING = 1,
    RT_RUNNING = 2,
} rt_state_t;

/* A token event waiting for earlier indices (reorder buffer, stream.c). */
typedef struct rt_event {
    uint32_t index;
    int32_t token;
    float logprob;
    uint32_t n_top;
    tdm_token_logprob_t top[TDM_SAMPLING_MAX_LOGPROBS];
    uint32_t cached_prompt_tokens;
    double prefill_s;
} rt_event_t;

/* Output accumulated for the next GenerateChunk (stream) or the whole answer (no stream);
 * stream.c. */
typedef struct rt_chunk {
    uint32_t index;                 /* output index of ids[0] */
    int32_t *ids;                   /* [n] */
    float *logprobs;                /* [n] when logprobs are asked for */
    Tandem__V1__TopLogprobs **tops; /* [n] when logprobs are asked for; each heap */
    char **texts;                   /* [n] when echo_token_text; each heap */
    size_t n, cap;
    tdm_buf_t text; /* text delta */
} rt_chunk_t;

/* Prompt logprobs one request may ask for: prompt tokens x (alternatives + 1). They travel in
 * one TokenEvent and one GenerateChunk, at most TDM_NET_MAX_BODY_BYTES (16 MiB) each, and an
 * entry with its text takes about 30 bytes: 400,000 fit with room (a 19,000-token prompt with
 * 20 alternatives, any prompt with none). */
#define RT_PROMPT_LOGPROBS_MAX_ENTRIES 400000u
/* The packed bytes of one request's prompt logprobs with their texts: long token texts can
 * make fewer entries than the limit above too large for one message; such a request fails
 * INVALID_ARGUMENT (field prompt_logprobs) when its prompt logprobs arrive. 1 MiB of the
 * message is left for the rest of the chunk. */
#define RT_PROMPT_LOGPROBS_MAX_BYTES (TDM_NET_MAX_BODY_BYTES - (1u << 20))

struct rt_req {
    /* what the client asked (request.c, set at intake and not changed after) */
    char id[TDM_REQUEST_ID_MAX + 1];
    uint8_t peer[TDM_NET_PEER_MAX]; /* the client's routing id */
    size_t peer_len;
    uint64_t call_id;
    bool stream, include_stop_str, echo;
    bool render_special;   /* GenerateRequest.render_special: control tokens' text is output */
    bool no_speculation;   /* GenerateRequest.speculative OFF, passed on in DecodeReserve */
    bool continuous_usage; /* GenerateRequest.continuous_usage: usage on every chunk */
    /* GenerateRequest.prompt_logprobs: asked (top alternatives in plp_ask.top) by choice 0's
     * first attempt; what the index-0 TokenEvent brought, texts filled, until the first chunk
     * carries it (heap: plp[n_plp] pointing into plp_tops, owned by the request) */
    bool want_plp;
    Tandem__V1__PromptLogprobsAsk plp_ask;
    Tandem__V1__PromptLogprob **plp; /* [n_plp] into plp_msgs */
    size_t n_plp;
    Tandem__V1__PromptLogprob *plp_msgs; /* [n_plp] */
    Tandem__V1__TopLogprob *plp_tops;    /* [n_plp_tops] every entry's top, in order */
    Tandem__V1__TopLogprob **plp_topp;   /* [n_plp_tops] */
    size_t n_plp_tops;
    bool plp_sent;
    rt_model_t *model; /* the model the request's model field named (the first when none):
                          its tokenizer and nodes serve it */
    int32_t *prompt;   /* [n_prompt] heap */
    uint32_t n_prompt;
    tdm_sampling_params_t sp; /* validated; seed drawn when the client gave none */
    char **stop;              /* [n_stop] heap strings */
    size_t n_stop;
    uint64_t deadline_ms; /* unix ms */
    double t_arrival;     /* monotonic s */
    char *gbnf;           /* structured output: the compiled constraint (NUL-terminated heap
                             text, tdm_constraint_compile) sent to the nodes; NULL: free text */
    uint64_t gbnf_hash;   /* tdm_constraint_hash of gbnf */
    rt_group_t *group;    /* n > 1: the call's choices (request.c); NULL: a call of one */
    uint32_t choice;      /* this request's index in group (GenerateChunk.choice) */
    /* scheduling (scheduler.c) */
    rt_state_t state;
    bool fork;    /* the current attempt forks choice 0's sequence (DecodeReserve.fork_of) */
    bool no_fork; /* a fork failed or was refused: dispatched on its own from now on */
    rt_node_t *decode, *prefill; /* current assignment; prefill NULL: none or local */
    bool local_prefill;
    uint32_t n_blocks; /* prompt blocks the reservation asks for */
    uint64_t reserve_call;
    uint64_t attempt_id; /* the current dispatch attempt (0: none yet); node messages of any
                            other attempt are ignored and counted */
    bool *tried;         /* [r->n_nodes] decode nodes that refused this round (allocated at
                            intake) */
    bool *timed_out;     /* [r->n_nodes] decode nodes that did not answer a reservation of this
                            request in time: not chosen again while another decode node takes
                            work (scheduler.c; in tried's allocation, never cleared) */
    int redispatches;
    uint32_t resume_index; /* output tokens delivered when the current attempt was dispatched:
                              its first token (prefill node or local prefill) has this index */
    double t_dispatch;     /* monotonic s of the last PrefillTask / local start; 0 = not yet */
    tdm_list_t queue_link; /* on r->queue while QUEUED and waiting */
    /* progress of the current attempt (stream.c from node events; scheduler.c resets it for
     * each attempt) */
    bool decode_started; /* an index > resume_index or Finished came from the decode node */
    bool prefilled;      /* this attempt's prefill node sent its first token, index
                            resume_index (its KV transfer began) */
    /* output (stream.c) */
    uint32_t next_index; /* tokens delivered to the output so far */
    int32_t *output;     /* [next_index] (capacity cap_output) the token ids delivered, in
                            order: what a migrated attempt resumes after */
    uint32_t cap_output;
    rt_event_t *buf; /* out-of-order events */
    size_t n_buf, cap_buf;
    bool finished; /* Finished received */
    int finish_reason;
    uint32_t completion_tokens;
    uint32_t preemptions; /* Finished.preemptions of the decode node (metrics) */
    double kv_transfer_s;
    tdm_detok_t detok;
    tdm_buf_t hold; /* text produced but not sent: could start a stop string */
    rt_chunk_t chunk;
    uint32_t cached_prompt_tokens;
    double prefill_s;
    double t_first, t_last; /* monotonic s; 0 = not yet */
    /* the request table (request.c) */
    tdm_list_t all_link;         /* on r->requests, newest first */
    rt_index_entry_t by_id;      /* in r->by_id under the id */
    rt_index_entry_t by_call;    /* in r->by_call under (peer, call id) */
    rt_heap_entry_t by_deadline; /* on r->deadlines while deadline_ms is set */
};

struct tdm_router {
    /* the object and its loop (router.c) */
    const tdm_config_t *cfg;
    tdm_net_t *net;
    tdm_logger_t log;
    tdm_error_t err; /* the last failure of the router's own loop (tdm_router_errmsg) */
    tdm_sock_t *client, *nodesock;
    char client_ep[256], node_ep[256];
    char inproc_ep[64];   /* the client socket's second endpoint, for the in-process gateway */
    uint64_t instance_id; /* this router's instance: random per start, never 0 */
    double next_timers;
    bool shut;
    double loop_t0; /* monotonic s when the current loop iteration began (its poll returned) */
    /* the served models (router.c at start; read only after): models[n_models], one per
     * cfg->models entry, in that order */
    rt_model_t *models;
    size_t n_models;
    uint32_t block_size; /* kv.block_size, every model's */
    /* the nodes (nodes.c; router.c's tdm_router_set_heartbeat sets the figures) */
    uint32_t hb_interval_ms, hb_timeout_ms;
    /* the liveness clock (nodes.c): monotonic seconds with the router loop's own stalls taken
     * out, so a starved router does not charge its lateness to the nodes (rt_live_now) */
    double live_clock;   /* its value at the last heartbeat check */
    double live_checked; /* monotonic seconds of that check */
    rt_node_t *nodes;
    size_t n_nodes;
    /* registrations refused for node ids that are not in the config, most recent first */
    struct {
        char node_id[TDM_NODE_ID_MAX + 1];
        char reason[TDM_ERRMSG_MAX];
        double at;
        uint64_t count;
    } refused[8];
    size_t n_refused;
    /* the scheduler (scheduler.c) */
    tdm_list_t queue; /* requests waiting for a decode node, FIFO (rt_req_t.queue_link) */
    size_t n_queued;
    size_t rr_next; /* round robin cursor */
    /* prefix_aware: direct-mapped table block hash -> node index + 1 (0 = empty) */
    uint64_t *prefix_keys;
    uint32_t *prefix_nodes;
    size_t prefix_mask;
    uint64_t next_call;    /* call id of the next DecodeReserve */
    uint64_t next_attempt; /* next dispatch attempt id (random start, never 0) */
    /* the request table (request.c) */
    tdm_list_t requests; /* every request, newest first (rt_req_t.all_link) */
    rt_index_t by_id;    /* by request id */
    rt_index_t by_call;  /* by (client routing id, call id) */
    rt_heap_t deadlines; /* by deadline_ms, earliest first */
    size_t n_reqs;
    uint64_t sibling_frees; /* requests freed because a sibling failed or was dropped (request.c):
                               a loop over requests that may fail one restarts when it moves */
    /* EMBED calls (embed.c; the struct is its own) */
    struct rt_embeds *embeds;
    /* counters: each written by the file that sees the event */
    tdm_router_metrics_t metrics;
};

/* The model whose name or alias is served (router.c), or NULL (none; served NULL or ""). */
rt_model_t *rt_model_find(tdm_router_t *r, const char *served);

#endif /* TANDEM_ROUTER_INTERNAL_H */
