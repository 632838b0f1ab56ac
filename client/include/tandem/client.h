/* client.h - libtandem-client: the C client of the router's client API (Generate, Health,
 * Models, Status; proto/tandem.proto) over one ZeroMQ DEALER socket (common/net).
 *
 * A tdm_client_t holds one DEALER socket connected to the router's client endpoint and, like
 * that socket, belongs to one thread. Every call gets a call id unique on the connection, so
 * many calls can be in flight over the one socket and the responses find their call by id:
 *   - tdm_client_generate_start starts a Generate call and returns at once; tdm_client_poll
 *     receives what has arrived, hands each streamed chunk to the call's on_chunk callback,
 *     expires deadlines and finishes calls through their on_done callback. One thread can
 *     drive hundreds of concurrent requests this way (`tandem bench`).
 *   - The blocking calls (tdm_client_generate, _health, _models, _status) run the same loop
 *     until their own call ends, so async calls started earlier keep being served meanwhile.
 *
 * Deadlines: every call has one (the request's timeout, else the client's default). It travels
 * in the REQUEST so that the router gives up too, and the client enforces it itself: when it
 * passes, the client sends CANCEL and the call ends with TDM_EDEADLINE even if the router never
 * answers (it is down, or the network is).
 * Losing the router: when the connection to the router drops (it was killed or restarted, or
 * ZeroMQ's heartbeat found its host gone; a socket monitor reports it), every call running
 * then, streams included, ends at once with TDM_EUNAVAILABLE "router connection lost: ..."
 * (what the router sent before it went is delivered first; the call may or may not have run).
 * The socket reconnects by itself and later calls go to the router that answers then; nothing
 * of the old connection is kept. An inproc:// endpoint is not watched (the router is in the
 * same process).
 * Cancellation: an on_chunk callback returning nonzero, tdm_client_generate_cancel, or the
 * client's cancel flag (set from a signal handler) sends CANCEL with the call's id; the router
 * then frees the request and sends nothing more. Frames that arrive later for a call that has
 * ended are dropped.
 * Callbacks: on_done runs exactly once for every call that tdm_client_generate_start accepted
 * (also when the client is destroyed with the call still running); no callback runs for a call
 * whose start failed (libuv's rule). Callbacks may start and cancel other calls, also while a
 * lost connection or passed deadlines end several calls (each still ends once; a call started
 * then is not ended by that loss or sweep); they must not poll or make blocking calls
 * (TDM_EPRECONDITION).
 * Unary calls (Health, Models, Status, Metrics) can be async too (tdm_client_call_start), and a
 * thread that serves a client and a queue other threads fill waits on both with
 * tdm_client_poll_fd: the router's HTTP gateway works that way, over the router's inproc://
 * endpoint on the router's own ZMQ context (tdm_client_opts_t.net).
 */
#ifndef TANDEM_CLIENT_H
#define TANDEM_CLIENT_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/chat.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/sampling.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Default router client endpoint (config router.client_endpoint's default). */
#define TDM_CLIENT_DEFAULT_ENDPOINT "tcp://127.0.0.1:7600"

/* Routers one client connects to at most (a comma-separated endpoint list). */
#define TDM_CLIENT_MAX_ROUTERS 16

/* Default deadline of a call, seconds (the router's default request timeout). */
#define TDM_CLIENT_DEFAULT_TIMEOUT_S 600.0

/* Every sampling field (the TDM_PROTO_SET_* bits of proto.h) for
 * tdm_client_request_t.sampling_set. */
#define TDM_CLIENT_SAMPLING_ALL                                                                    \
    (TDM_PROTO_SET_TEMPERATURE | TDM_PROTO_SET_TOP_K | TDM_PROTO_SET_TOP_P | TDM_PROTO_SET_MIN_P | \
     TDM_PROTO_SET_REPETITION_PENALTY | TDM_PROTO_SET_PRESENCE_PENALTY |                           \
     TDM_PROTO_SET_FREQUENCY_PENALTY | TDM_PROTO_SET_PENALTY_LAST_N | TDM_PROTO_SET_SEED |         \
     TDM_PROTO_SET_STOP_TOKEN_IDS | TDM_PROTO_SET_IGNORE_EOS | TDM_PROTO_SET_N_LOGPROBS |          \
     TDM_PROTO_SET_LOGIT_BIAS | TDM_PROTO_SET_MIN_TOKENS | TDM_PROTO_SET_BAD_WORDS |               \
     TDM_PROTO_SET_ALLOWED_TOKEN_IDS)

typedef struct tdm_client tdm_client_t;

/* What a request's output must match (GenerateRequest.constraint; values of the proto's
 * ConstraintKind). */
typedef enum tdm_client_constraint {
    TDM_CLIENT_CONSTRAINT_NONE = 0,
    TDM_CLIENT_CONSTRAINT_JSON_SCHEMA = 1,
    TDM_CLIENT_CONSTRAINT_JSON_OBJECT = 2,
    TDM_CLIENT_CONSTRAINT_GRAMMAR = 3, /* GBNF (tandem/grammar.h), start rule `root` */
    TDM_CLIENT_CONSTRAINT_REGEX = 4,
    TDM_CLIENT_CONSTRAINT_CHOICE = 5,
} tdm_client_constraint_t;

/* Options of tdm_client_new. Zero-initialise, then set what you need. */
typedef struct tdm_client_opts {
    const char *api_key;           /* sent in every REQUEST (FrameHeader.api_key); NULL or "":
                                      none. At most TDM_NET_API_KEY_MAX - 1 bytes. Copied. */
    const tdm_curve_keys_t *curve; /* CURVE: client_public, client_secret and server_public
                                      (Z85); NULL: plain TCP. Used during tdm_client_new only */
    double timeout_s;              /* default deadline of a call, seconds; 0 =
                                      TDM_CLIENT_DEFAULT_TIMEOUT_S, < 0 = no deadline */
    const volatile sig_atomic_t *cancel_flag; /* NULL, or a flag a signal handler sets: once it
                                      is nonzero, tdm_client_poll and the blocking calls cancel
                                      every running call (CANCEL sent, status TDM_ECANCELLED).
                                      Checked after every wait, which a signal interrupts. The
                                      caller owns it; it must outlive the client */
    tdm_net_t *net;          /* ZMQ context to use (not owned; must outlive the client);
                                NULL: the client makes its own */
    const tdm_logger_t *log; /* dropped and late frames are logged here at debug level;
                                NULL: stderr at INFO (so they are not shown) */
} tdm_client_opts_t;

/* Connects a client to the router's client endpoint ("tcp://127.0.0.1:7600"). ZeroMQ connects
 * in the background: this does not wait for the router, and a router that is down shows up
 * as calls ending with TDM_EDEADLINE (a quick tdm_client_health tells). opts may be NULL
 * (defaults). Returns NULL with *err set: TDM_EINVALID (bad endpoint, CURVE keys or API key),
 * TDM_ERESOURCE (out of memory, no ZMQ context). Caller frees with tdm_client_destroy.
 *
 * Several routers: endpoint may list up to TDM_CLIENT_MAX_ROUTERS endpoints separated by commas
 * ("tcp://r0:7600,tcp://r1:7600"; no repeats; not inproc://), routers that serve the same node
 * pools (docs/operations.md "Several routers"). The client then keeps one connection to each
 * (ZMQ_IMMEDIATE: a message only goes out on a connection that is up) and sends each new call
 * to the next router in turn that has one. A call is sent again, under the same call id, to the
 * next router when its router's connection is lost, or its router ends it with
 * TDM_EUNAVAILABLE, before any chunk of it reached the caller: a Generate call whose first
 * token was delivered is never sent again (it ends TDM_EUNAVAILABLE as with one router); each
 * router gets a call once at most. A call no router can take now (none connected yet, or all
 * down) waits in the table, sent as soon as a connection comes up, until its deadline
 * (TDM_EDEADLINE). tdm_client_retried counts the calls sent again. */
tdm_client_t *tdm_client_new(const char *endpoint, const tdm_client_opts_t *opts, tdm_error_t *err);

/* Cancels every running call (CANCEL sent; each on_done runs with TDM_ECANCELLED), closes the
 * socket and frees the client. Must not be called from a callback. NULL-safe, nulls *self_p. */
void tdm_client_destroy(tdm_client_t **self_p);

/* The message of the last failed call on this client ("" if none); owned by the client,
 * valid until its next call. */
const char *tdm_client_errmsg(const tdm_client_t *c);

/* The request field (a GenerateRequest path: "stop[1]", "max_tokens", ...) this library's own
 * check named when tdm_client_generate(_start) last refused a request, or the field the
 * router's ErrorDetail named when a blocking unary call (tdm_client_embed: "texts[2]",
 * "token_inputs[0].ids[5]", "model") last failed; "" when none or when the last start or call
 * succeeded. Owned by the client. The router's refusals of GENERATE carry theirs in
 * tdm_client_result_t.error. */
const char *tdm_client_errfield(const tdm_client_t *c);

/* ---- Generate ---- */

/* A Generate request. Start from tdm_client_request_init, then set the input and what you
 * need. Every pointer is the caller's and is only read during tdm_client_generate(_start). */
typedef struct tdm_client_request {
    const char *request_id; /* NULL or "": the router makes one */
    const char *model;      /* NULL or "": the router's first model; else a served name or
                               alias (NOT_FOUND for another) */
    /* input: exactly one of prompt, messages and token_ids */
    const char *prompt;                 /* raw UTF-8 text; special tokens are parsed */
    const tdm_chat_message_t *messages; /* [n_messages] rendered with the model's template */
    size_t n_messages;
    const int32_t *token_ids; /* [n_token_ids] used as is */
    size_t n_token_ids;
    tdm_sampling_params_t sampling; /* only the fields named in sampling_set are sent;
                                       sampling.max_tokens is never sent (see max_tokens) */
    uint32_t sampling_set;          /* TDM_PROTO_SET_* bits (or TDM_CLIENT_SAMPLING_ALL); the
                                       router uses Tandem's defaults (sampling.h) for the
                                       others and draws a seed unless SEED is set */
    int32_t max_tokens;             /* output tokens at most; 0 = what the context leaves
                                       after the prompt, at most 1024 (the router decides) */
    const char *const *stop;        /* [n_stop] stop strings, 1..256 bytes each, at most 16 */
    size_t n_stop;
    bool stream;           /* true (default): chunks as tokens arrive; false: one chunk at the
                              end with everything */
    bool include_stop_str; /* keep a matched stop string in the text */
    bool echo_token_text;  /* fill tdm_client_chunk_t.token_texts */
    bool render_special;   /* control tokens' text stays in the output (not end-of-generation
                              ones): GenerateRequest.render_special */
    bool no_speculation;   /* GenerateRequest.speculative OFF: no prompt-lookup drafts for this
                              request (false: the decode node's config; outputs are the same) */
    tdm_client_constraint_t constraint_kind; /* structured output; TDM_CLIENT_CONSTRAINT_NONE
                                                (default): free text */
    const char *constraint; /* the constraint's source text (NUL-terminated): the schema JSON,
                               GBNF, regex or a JSON array of choice strings; unused for NONE
                               and JSON_OBJECT */
    double timeout_s;       /* deadline, seconds from the start of the call; 0 = the client's
                               default, < 0 = none */
    const char *tools;      /* chat only: NULL/"" or OpenAI's tools as a JSON array text, rendered
                               by the model's chat template (tdm_chat_apply_tools) */
    const char *chat_template; /* chat only: NULL/"" = the model's; else Jinja source rendered
                                  instead (at most TDM_CHAT_TEMPLATE_MAX_BYTES, 256 KiB) */
    const char *chat_template_kwargs; /* chat only: NULL/"" or a JSON object text of more
                                         template variables (a Jinja template's) */
    bool no_generation_prompt;        /* chat only: render without the generation prompt
                                         (vLLM's add_generation_prompt: false) */
    bool continue_final_message;      /* chat only: the rendering ends after the last message's
                                         content (an assistant message), so the model continues
                                         it; needs no_generation_prompt */
    bool prompt_logprobs;             /* the prompt tokens' logprobs (vLLM's prompt_logprobs),
                                         computed in the prefill pass (no prefix-cache hit),
                                         on the call's first chunk */
    uint32_t prompt_logprobs_top;     /* ... each with this many most likely tokens, 0..20 */
    bool continuous_usage;            /* every chunk's usage holds the counts so far (vLLM's
                                         stream_options.continuous_usage_stats), not only the
                                         last one's */
    /* Choices of the prompt, 0 or 1 = one, at most 16: choice i is sampled with seed + i (the
     * router draws the seed when SEED is not set) and the choices share the prompt's one
     * prefill. Each chunk names its choice (tdm_client_chunk_t.choice); every choice ends with
     * its own last chunk (finish reason, usage); with stream false each choice's whole answer
     * is one chunk. The call ends once every choice has. The result's text and token_ids
     * join the choices in arrival order, its usage sums their completion tokens: read the
     * chunks to tell the choices apart. */
    uint32_t n;
    /* vLLM's bad_words: [n_bad_words] words (1..256 bytes of UTF-8 each, at most 128), sent
     * as text for the router to tokenize (docs/sampling.md); sent whenever n_bad_words > 0,
     * with any token sequences of sampling (bad_tokens) when sampling_set has BAD_WORDS. */
    const char *const *bad_words;
    size_t n_bad_words;
    /* vLLM's truncate_prompt_tokens: keep the last k tokens of the tokenized (or rendered)
     * prompt; 0 = off, -1 = the context length, else 1..n_ctx (the router checks) */
    int32_t truncate_prompt_tokens;
} tdm_client_request_t;

/* Fills *req with an empty request: no input, sampling from tdm_sampling_params_default with
 * sampling_set 0 (all router defaults), max_tokens 0, stream true, timeout 0. Cannot fail. */
void tdm_client_request_init(tdm_client_request_t *req);

typedef enum tdm_client_finish {
    TDM_CLIENT_FINISH_NONE = 0,      /* not given (the call failed before its end) */
    TDM_CLIENT_FINISH_STOP = 1,      /* end-of-generation token, stop token or stop string */
    TDM_CLIENT_FINISH_LENGTH = 2,    /* max_tokens, or the context is full */
    TDM_CLIENT_FINISH_CANCELLED = 3, /* cancelled (by the client, a deadline or the router) */
    TDM_CLIENT_FINISH_ERROR = 4,     /* the call ended with an error status */
} tdm_client_finish_t;

/* "stop", "length", "cancelled", "error", "none"; "?" outside the enum. Cannot fail. */
const char *tdm_client_finish_name(tdm_client_finish_t f);

/* One of the most likely tokens at an output position. */
typedef struct tdm_client_top_logprob {
    int32_t token_id;
    float logprob;    /* natural log */
    const char *text; /* the token's text ("" when the router sent none) */
} tdm_client_top_logprob_t;

/* The top logprobs of one output token, most likely first. */
typedef struct tdm_client_token_top {
    const tdm_client_top_logprob_t *entries; /* [n_entries] */
    size_t n_entries;
} tdm_client_token_top_t;

/* The logprob of one prompt token given the tokens before it (prompt_logprobs). */
typedef struct tdm_client_prompt_logprob {
    int32_t token_id;           /* the prompt token */
    float logprob;              /* natural log, of the model's raw logits */
    uint32_t rank;              /* 1 + the tokens at least as likely, other than itself; 0:
                                   none (the first prompt token) */
    const char *text;           /* its text */
    tdm_client_token_top_t top; /* the prompt_logprobs_top most likely, most likely first */
} tdm_client_prompt_logprob_t;

/* Token counts of a finished request. */
typedef struct tdm_client_usage {
    uint32_t prompt_tokens;
    uint32_t completion_tokens;
    uint32_t cached_prompt_tokens; /* prompt tokens found in a prefix cache */
} tdm_client_usage_t;

/* Timings in seconds (proto Timings). The router's are measured by the router (prefill_s and
 * kv_transfer_s by the nodes); the client's by this library, from sending the REQUEST: ttft_s
 * to the first chunk with a token, decode_s from there to the last token's chunk, tpot_s =
 * decode_s / (tokens - 1) (0 for one token), e2e_s to the end of the call; queue_s, prefill_s
 * and kv_transfer_s are 0 there. */
typedef struct tdm_client_timings {
    double queue_s;       /* arrival until the prefill task was sent */
    double ttft_s;        /* time to first token */
    double tpot_s;        /* time per output token after the first */
    double decode_s;      /* first token until the last */
    double prefill_s;     /* prefill node compute time */
    double kv_transfer_s; /* KV pages sent until acknowledged */
    double e2e_s;         /* end to end */
} tdm_client_timings_t;

/* One streamed chunk: the tokens produced since the previous one. Everything it points to is
 * owned by the client and valid only during the on_chunk callback. */
typedef struct tdm_client_chunk {
    uint64_t call_id;
    const char *request_id;   /* the router's request id */
    uint32_t choice;          /* which of the request's n choices (0 for n <= 1) */
    uint32_t index;           /* output index of token_ids[0] (0 = the first output token) */
    const int32_t *token_ids; /* [n_tokens] */
    size_t n_tokens;
    const char *text;      /* text delta, whole UTF-8 characters only; NUL-terminated */
    size_t text_len;       /* bytes of text */
    const float *logprobs; /* [n_logprobs]: per token when requested (n_logprobs > 0 in
                              the sampling params); n_logprobs 0 otherwise */
    size_t n_logprobs;
    const tdm_client_token_top_t *top_logprobs; /* [n_top_logprobs], per token */
    size_t n_top_logprobs;
    const char *const *token_texts; /* [n_token_texts] when echo_token_text was asked */
    size_t n_token_texts;
    bool last;                         /* the final chunk: the fields below are set */
    tdm_client_finish_t finish_reason; /* NONE unless last */
    const char *stop_reason;           /* the stop string that matched, "" if none */
    /* prompt_logprobs: on the first chunk of choice 0, [n_prompt_logprobs] one per prompt token
     * (entry i is prompt token i; entry 0, which has no prefix, has rank 0, logprob 0 and no
     * top); else NULL / 0 */
    const tdm_client_prompt_logprob_t *prompt_logprobs;
    size_t n_prompt_logprobs;
    const tdm_client_usage_t *usage;     /* NULL unless last, or the request asked for
                                            continuous_usage: then on every chunk, the counts
                                            as of it (completion_tokens: output tokens up to
                                            and including this chunk's) */
    const tdm_client_timings_t *timings; /* router's; NULL unless last */
} tdm_client_chunk_t;

/* Why the router refused a Generate request, beyond the message (proto ErrorDetail): read
 * these instead of parsing tdm_client_result_t.message. */
typedef struct tdm_client_error_detail {
    char field[64];          /* the GenerateRequest field at fault as a path ("max_tokens",
                                "stop[1]", "chat.messages[0].content", "sampling.top_p",
                                "model", "request_id", ...); "" when none is named */
    uint32_t prompt_tokens;  /* a request too long for the context: the prompt's tokens, */
    uint32_t n_ctx;          /* the context length (0: the error is not about length) */
    uint32_t max_tokens_fit; /* and the most output tokens that fit (n_ctx - prompt_tokens;
                                0 when the prompt alone fills the context) */
    uint32_t retry_after_s;  /* RESOURCE_EXHAUSTED because the cluster cannot finish the
                                request before its deadline: seconds until the estimated
                                earliest start (>= 1); 0 otherwise */
} tdm_client_error_detail_t;

/* The outcome of a Generate call. Owns text, token_ids, request_id and stop_reason; release
 * with tdm_client_result_clear. */
typedef struct tdm_client_result {
    uint64_t call_id;
    int status;                   /* TDM_OK or a negative tdm_status_t */
    char message[TDM_ERRMSG_MAX]; /* "" on success; else the router's or the client's reason */
    char *request_id;             /* the router's id ("" when no chunk arrived); never NULL
                                     after the call */
    tdm_client_finish_t finish_reason;
    char *stop_reason;                   /* the stop string that matched, "" if none; never NULL */
    tdm_client_usage_t usage;            /* from the final chunk (zero when it never came) */
    tdm_client_timings_t timings;        /* the router's, from the final chunk */
    tdm_client_timings_t client_timings; /* measured here (see tdm_client_timings_t) */
    char *text;                          /* all text deltas joined, NUL-terminated; never NULL */
    size_t text_len;
    int32_t *token_ids; /* [n_tokens] every output token received; NULL when none */
    size_t n_tokens;
    uint32_t n_chunks;               /* chunks received */
    tdm_client_error_detail_t error; /* the router's detail of a refusal; all zero otherwise */
} tdm_client_result_t;

/* Initialises an empty result (no allocation). Cannot fail. */
void tdm_client_result_init(tdm_client_result_t *r);

/* Frees what r owns and empties it; it may be reused. NULL-safe. */
void tdm_client_result_clear(tdm_client_result_t *r);

/* Called for each chunk, in arrival order (once, with everything, when stream is false).
 * Returning nonzero cancels the call: CANCEL is sent and the call ends with TDM_ECANCELLED
 * (finish reason CANCELLED), even on the last chunk. */
typedef int (*tdm_client_chunk_fn)(void *user, const tdm_client_chunk_t *chunk);

/* Called once when an async call ends, however it ends. result (text, tokens, usage, ...) is
 * owned by the client and valid only during the callback; copy what you keep. */
typedef void (*tdm_client_done_fn)(void *user, const tdm_client_result_t *result);

/* Runs a Generate call to its end: sends the request, delivers chunks to on_chunk (may be
 * NULL) as they arrive and fills *result (initialised here; the caller clears it with
 * tdm_client_result_clear whatever the status). Returns result->status: 0, TDM_EINVALID (bad
 * request: this library's checks, message naming the field, or the router's), TDM_EDEADLINE
 * (the deadline passed; CANCEL sent), TDM_ECANCELLED (on_chunk returned nonzero or the cancel
 * flag was set; CANCEL sent), TDM_EPRECONDITION (called from a callback), TDM_EINTERNAL (a
 * malformed answer or a ZMQ failure), or any status the router ended the call with
 * (TDM_EUNAUTHENTICATED, TDM_ERESOURCE, TDM_EUNAVAILABLE, ...). result keeps the text and
 * tokens that arrived before an error. */
int tdm_client_generate(tdm_client_t *c, const tdm_client_request_t *req,
                        tdm_client_chunk_fn on_chunk, void *user, tdm_client_result_t *result);

/* Starts a Generate call and returns without waiting; tdm_client_poll then drives it. on_chunk
 * may be NULL; on_done must not be. The call id (unique on this client, > 0) is stored in
 * *call_id when call_id is not NULL. Returns 0, or (no callback will run) TDM_EINVALID for a
 * bad request (message in tdm_client_errmsg), TDM_EUNAVAILABLE when the socket's queue is full,
 * TDM_ERESOURCE on out of memory. May be called from a callback. */
int tdm_client_generate_start(tdm_client_t *c, const tdm_client_request_t *req,
                              tdm_client_chunk_fn on_chunk, tdm_client_done_fn on_done, void *user,
                              uint64_t *call_id);

/* Waits up to timeout_ms (0: not at all; < 0: until something happens) for frames, then
 * handles every frame already received, delivering chunks and ending calls (on_done), and
 * ends the calls whose deadline has passed (CANCEL sent, TDM_EDEADLINE), or every call when the
 * connection to the router was lost (TDM_EUNAVAILABLE, see "Losing the router" above). The
 * wait is cut short by the first frame, by the nearest deadline, by a lost connection and by
 * a signal. Returns the number of
 * calls that ended (>= 0), or TDM_ECANCELLED when the cancel flag is set (every running call
 * was cancelled), TDM_EPRECONDITION when called from a callback, TDM_EINTERNAL when the socket
 * failed (every running call ended with that error). */
int tdm_client_poll(tdm_client_t *c, int timeout_ms);

/* Cancels a running async call (Generate or unary): sends CANCEL and ends it now with
 * TDM_ECANCELLED (its on_done runs before this returns). Returns 0, TDM_ENOTFOUND when no such
 * call is running (it has ended), TDM_EPRECONDITION when called from the call's own on_chunk
 * (return nonzero instead). tdm_client_generate_cancel is the same function. */
int tdm_client_cancel(tdm_client_t *c, uint64_t call_id);
int tdm_client_generate_cancel(tdm_client_t *c, uint64_t call_id);

/* tdm_client_poll that also returns when fd (>= 0; -1: none) is readable, e.g. an eventfd
 * other threads write to hand this thread work; the caller reads fd. Same returns. */
int tdm_client_poll_fd(tdm_client_t *c, int timeout_ms, int fd);

/* Called once when an async unary call ends, however it ends: status 0 with *resp the decoded
 * response (of the call's resp_desc), or the error with message (valid during the callback)
 * and *resp NULL. The callee may take the response: it then sets *resp = NULL and frees it
 * with protobuf_c_message_free_unpacked; else the client frees it after the callback. */
typedef void (*tdm_client_unary_fn)(void *user, int status, const char *message,
                                    ProtobufCMessage **resp);

/* Starts a unary call (method TANDEM__V1__METHOD__METHOD_HEALTH, _MODELS, _STATUS or _METRICS
 * with its request message req, only read here; resp_desc the response type) and returns
 * without waiting; tdm_client_poll drives it, on_done ends it (exactly once), and
 * tdm_client_cancel cancels it. timeout_s as for the blocking calls. The call id goes to
 * *call_id when not NULL. Returns 0, or (no callback will run) TDM_EINVALID (NULL argument,
 * GENERATE, NaN timeout), TDM_EUNAVAILABLE (the socket's queue is full), TDM_ERESOURCE. May be
 * called from a callback. */
int tdm_client_call_start(tdm_client_t *c, int method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, double timeout_s,
                          tdm_client_unary_fn on_done, void *user, uint64_t *call_id);

/* Calls sent again to another router (several routers; see tdm_client_new) since the client
 * was made. Cannot fail. */
uint64_t tdm_client_retried(const tdm_client_t *c);

/* Number of calls started and not yet ended. Cannot fail. */
size_t tdm_client_pending(const tdm_client_t *c);

/* ---- Health, Models, Status (unary calls) ----
 * Each blocks until the answer or timeout_s (seconds; 0 = the client's default; < 0 = none).
 * Errors, message in tdm_client_errmsg: TDM_EDEADLINE (no answer in time: the router is down
 * or unreachable), TDM_ECANCELLED (cancel flag), TDM_EPRECONDITION (called from a callback),
 * TDM_EINTERNAL (malformed answer), or the router's status (TDM_EUNAUTHENTICATED, ...). */

typedef struct tdm_client_health {
    bool live;        /* the router answers */
    bool ready;       /* at least one prefill-capable and one decode node are up */
    char version[64]; /* the router's software version */
} tdm_client_health_t;

/* Asks the router whether it is live and ready. Fills *out on success. */
int tdm_client_health(tdm_client_t *c, double timeout_s, tdm_client_health_t *out);

typedef struct tdm_client_model {
    char *name;
    uint64_t fingerprint;
    uint32_t n_ctx;
    uint32_t n_vocab;
    char *chat_template; /* the template: "gguf" (the model's own), "file" or a built-in name
                            ("chatml"); "" if not told */
    char *state;         /* "ready" (a decode node of it is up), "unavailable" (none is: its
                            requests wait); "" from a router before 2.5 */
    uint32_t prefill_nodes_up, decode_nodes_up;
    uint32_t requests_running; /* its requests dispatched to its nodes (0 from a router before
                                  2.7) */
    uint32_t requests_queued;  /* its requests waiting for one of its decode nodes (0 before 2.7) */
} tdm_client_model_t;

/* The models a router serves. Owns its arrays and strings. */
typedef struct tdm_client_models {
    tdm_client_model_t *models; /* [n_models] */
    size_t n_models;
} tdm_client_models_t;

/* Lists the served models into *out (previous contents ignored); on success the caller frees
 * it with tdm_client_models_clear; on error *out holds nothing. TDM_ERESOURCE on out of
 * memory. */
int tdm_client_models(tdm_client_t *c, double timeout_s, tdm_client_models_t *out);

/* Frees what *m owns and zeroes it. NULL-safe. */
void tdm_client_models_clear(tdm_client_models_t *m);

/* ---- Embed (unary, protocol 2.8) ---- */

/* The inputs of an EMBED call: texts (tokenized by the router as a raw prompt is) or token id
 * lists, not both; 1..2048 inputs, each 1..n_ctx tokens (docs/api.md "Embeddings"). */
typedef struct tdm_client_embed_req {
    const char *model;        /* served name or alias; NULL/"": the router's first */
    const char *request_id;   /* NULL/"": the router makes one */
    const char *const *texts; /* [n_texts] UTF-8 */
    size_t n_texts;
    const int32_t *const *token_ids; /* [n_token_inputs] lists of token ids ... */
    const size_t *n_token_ids;       /* [n_token_inputs] ... of these lengths */
    size_t n_token_inputs;
    bool mean; /* pooling: mean over the positions; false: the last position (default) */
} tdm_client_embed_req_t;

/* An EMBED answer. Owns its arrays. */
typedef struct tdm_client_embeddings {
    float *values;           /* [n][n_embd]: input i's L2-normalised vector at i * n_embd */
    uint32_t *prompt_tokens; /* [n] tokens of each input */
    size_t n;
    uint32_t n_embd;
    uint64_t total_prompt_tokens;
    char *model; /* the model's served name */
} tdm_client_embeddings_t;

/* Asks the router for the embeddings of req's inputs into *out (previous contents ignored); on
 * success the caller frees it with tdm_client_embeddings_clear; on error *out holds nothing.
 * Errors as the unary calls above; a refused input is TDM_EINVALID with a message that starts
 * with the field ("texts[2]: ...", "token_inputs[0].ids[5]: ..."), and tdm_client_errfield(c)
 * is that field (from the router's ErrorDetail; "model" for an unknown model, TDM_ENOTFOUND);
 * TDM_ERESOURCE "queue full" when router.max_queue requests wait; TDM_EUNAVAILABLE when no node
 * of the model is up; TDM_EINTERNAL for a malformed answer. */
int tdm_client_embed(tdm_client_t *c, const tdm_client_embed_req_t *req, double timeout_s,
                     tdm_client_embeddings_t *out);

/* Frees what *e owns and zeroes it. NULL-safe. */
void tdm_client_embeddings_clear(tdm_client_embeddings_t *e);

/* One node as the router sees it (proto NodeStatus). */
typedef struct tdm_client_node_status {
    char *node_id;
    char *role;   /* "prefill" | "decode" */
    char *device; /* "cpu" | "cuda:N" */
    bool up;
    uint32_t kv_blocks_total;
    uint32_t kv_layer_groups; /* groups its pool allocates per (blocks of one group's layers);
                                 1: every layer in every block; 0: not registered (2.6) */
    uint32_t kv_blocks_used;
    uint32_t kv_blocks_cached; /* free blocks kept for the prefix cache */
    uint32_t reserved_blocks;  /* the router's outstanding reservations */
    uint32_t running;          /* sequences running */
    uint32_t waiting;          /* sequences waiting */
    uint32_t batch_size;       /* sequences in the last step */
    uint64_t queued_prefill_tokens;
    uint64_t prefix_queries; /* blocks looked up in the prefix cache */
    uint64_t prefix_hits;
    double step_time_s; /* the last forward pass, seconds (NodeLoad.step_s) */
    double last_heartbeat_age_s;
    char *refused_reason; /* why the router last refused a registration with this id ("" when
                             none since it was last accepted) */
    double refused_age_s; /* seconds since that refusal */
    uint64_t instance_id; /* the registered instance (0: never registered) */
    bool suspect;         /* up, but silent for the heartbeat timeout: the router sends it no new
                             work until it is heard from again (down after twice the timeout) */
    char *host_id;        /* the host it registered (boot id; "" unknown) */
    char *gpu_uuid;       /* the GPU it computes on ("" on the CPU) */
    char *model;          /* the model it serves (the router's config; "" from a 2.3 router) */
} tdm_client_node_status_t;

/* The KV transport the router chooses for a (prefill, decode) pair of up nodes. */
typedef struct tdm_client_kv_route {
    char *prefill_node_id;
    char *decode_node_id;
    char *transport; /* "tcp" | "nccl" | "cuda_ipc" */
} tdm_client_kv_route_t;

/* A registration the router refused for a node id its config does not have. */
typedef struct tdm_client_refused {
    char *node_id; /* as sent, non-printable bytes shown as '?' */
    char *reason;
    double age_s;   /* seconds since the last one */
    uint64_t count; /* refusals of this id */
} tdm_client_refused_t;

/* The cluster as the router sees it (proto ClusterStatus). Owns its arrays and strings. */
typedef struct tdm_client_cluster_status {
    char *version;
    char *model;
    tdm_client_node_status_t *nodes; /* [n_nodes] in the router's order */
    size_t n_nodes;
    uint32_t requests_running;
    uint32_t requests_queued;
    uint64_t requests_total;
    tdm_client_refused_t *refused; /* [n_refused] unknown node ids refused, most recent first */
    size_t n_refused;
    uint64_t router_instance_id;
    tdm_client_kv_route_t *kv_routes; /* [n_kv_routes] every up (prefill, decode) pair */
    size_t n_kv_routes;
} tdm_client_cluster_status_t;

/* Fetches the cluster status into *out (previous contents ignored); on success the caller
 * frees it with tdm_client_cluster_status_clear; on error *out holds nothing. TDM_ERESOURCE
 * on out of memory. */
int tdm_client_status(tdm_client_t *c, double timeout_s, tdm_client_cluster_status_t *out);

/* Frees what *s owns and zeroes it. NULL-safe. */
void tdm_client_cluster_status_clear(tdm_client_cluster_status_t *s);

/* The node with this id in *s, or NULL. Cannot fail. */
const tdm_client_node_status_t *tdm_client_status_find_node(const tdm_client_cluster_status_t *s,
                                                            const char *node_id);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_CLIENT_H */
