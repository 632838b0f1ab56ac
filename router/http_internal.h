/* http_internal.h - what the HTTP gateway's files share: the gateway thread's call API
 * (http_gateway.c), the OpenAI translation (http_openai.c), the dashboard (dashboard.c) and
 * small helpers (http.c). Not installed; see http.h for the public API.
 */
#ifndef TANDEM_ROUTER_HTTP_INTERNAL_H
#define TANDEM_ROUTER_HTTP_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "http.h"
#include "http_tools.h"
#include "tandem/client.h"
#include "tandem/proto.h"

/* ---- JSON into a tdm_buf_t ---- */

/* Appends the compact JSON text of v (not consumed) to b. TDM_ERESOURCE on out of memory. */
int http_json_append(tdm_buf_t *b, const json_t *v);

/* A JSON string of the n bytes at s (NULL: ""), each byte that is not part of valid UTF-8
 * (and each NUL) replaced by U+FFFD, so that every reply is valid UTF-8 JSON (jansson's
 * json_string refuses invalid UTF-8). New reference, NULL on out of memory. */
json_t *http_json_text(const char *s, size_t n);
/* http_json_text of a NUL-terminated string. */
json_t *http_json_str(const char *s);

/* ---- the gateway thread: the router's calls through the client library ---- */

typedef struct gw gw_t;
typedef struct gw_call gw_call_t;
typedef struct gw_chunk gw_chunk_t;

/* What happened to a call: a streamed chunk or the END. */
typedef struct gw_event {
    struct gw_event *next;
    int kind;                         /* TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM or _END */
    gw_chunk_t *chunk;                /* STREAM: owned; see gw_event_chunk */
    int status;                       /* END: 0 or a negative tdm status */
    char *message;                    /* END: the router's (or the gateway's) message; owned */
    tdm_client_error_detail_t detail; /* END of a refused GENERATE: the field at fault, ... */
    ProtobufCMessage *resp;           /* END OK of a unary call: the response; owned */
} gw_event_t;

/* Frees an event. NULL-safe. */
void gw_event_free(gw_event_t *ev);

/* The chunk of a STREAM event (valid as long as the event). */
const tdm_client_chunk_t *gw_event_chunk(const gw_event_t *ev);

/* Starts the gateway thread with a client (tandem/client.h) connected to endpoint, the router's
 * inproc:// endpoint on net, the router's context (any endpoint a client reaches works). Every
 * call sends api_key (NULL: none): the gateway checks its HTTP clients' keys itself. net and
 * log are borrowed. Returns NULL with *err set (TDM_EINVALID bad endpoint, TDM_ERESOURCE out of
 * memory or no thread). Free with gw_destroy. */
gw_t *gw_new(tdm_net_t *net, const char *endpoint, const char *api_key, const tdm_logger_t *log,
             tdm_error_t *err);

/* Ends every call with UNAVAILABLE "the HTTP gateway is shutting down" (CANCEL sent to the
 * router), makes new calls fail, stops and joins the thread. The object stays valid for the
 * calls still referenced (gw_call_next returns their END, gw_call_release frees them).
 * Idempotent. */
void gw_shutdown(gw_t *gw);

/* gw_shutdown, then frees everything. Every call must have been released. NULL-safe. */
void gw_destroy(gw_t **gw_p);

/* Starts a GENERATE call with req (its timeout_s is the deadline the client library sends
 * and enforces). The call takes ownership of req_owner and frees it with req_free(req_owner)
 * when the call is freed (req points into it). Returns a call holding one reference for the
 * caller (gw_call_release), or NULL with *err set: TDM_EUNAVAILABLE (the gateway is shutting
 * down), TDM_ERESOURCE; req_owner is then freed already. A request the client library refuses
 * ends at once with its status, message and detail.field. May be called from any thread. */
gw_call_t *gw_generate_start(gw_t *gw, const tdm_client_request_t *req, void (*req_free)(void *),
                             void *req_owner, tdm_error_t *err);

/* Takes the call's next event, waiting up to timeout_ms (< 0: without limit) for one. While
 * waiting it watches client_fd (>= 0: the HTTP client's socket) for a hang-up. Returns 1 with
 * *ev set (caller frees with gw_event_free; after the END event nothing more comes), 0 when
 * nothing arrived in time, -1 when the client hung up (the caller cancels the call). */
int gw_call_next(gw_call_t *c, int client_fd, int timeout_ms, gw_event_t **ev);

/* How gw_call_take parks its caller's connection while the call has no event: park runs at
 * once (suspend the connection), unpark later, once, from the gateway thread (resume it). Both
 * run with the gateway's lock held, so they must not call gw_* functions. */
typedef struct gw_parker {
    void (*park)(void *arg);
    void (*unpark)(void *arg);
    void *arg;
} gw_parker_t;

/* Takes the call's next event without waiting. Returns 1 with *ev set (caller frees with
 * gw_event_free; after the END event nothing more comes), or 0 when none is queued: then
 * pk->park has run and pk->unpark will run once, when an event is queued, the call ends, or
 * client_fd (>= 0: the HTTP client's socket, watched while parked) hangs up; the caller takes
 * again then and checks the socket itself. -1: out of memory (the call has ended). */
int gw_call_take(gw_call_t *c, int client_fd, const gw_parker_t *pk, gw_event_t **ev);

/* Cancels the call if it has not ended: CANCEL goes to the router (which frees the request's
 * KV blocks) and the call ends with CANCELLED. Any thread; idempotent. */
void gw_call_cancel(gw_call_t *c);

/* True when the call's END has been queued (it may not have been taken yet). */
bool gw_call_ended(gw_call_t *c);

/* True when the call's END has been queued with an error status and not taken yet. */
bool gw_call_failed(gw_call_t *c);

/* Drops the caller's reference (and its parking, if any); the call is freed with the last
 * one. NULL-safe, nulls *c_p. */
void gw_call_release(gw_call_t **c_p);

/* A unary call (HEALTH, MODELS, STATUS, METRICS): runs it with req (only read while the call
 * runs), waits for its end and hands over the response in *resp (of type resp_desc; caller
 * frees with protobuf_c_message_free_unpacked). timeout_s > 0 is its deadline. Returns 0, or
 * the call's status with the message in *err. Any thread but the gateway's. */
int gw_unary(gw_t *gw, int method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, double timeout_s, ProtobufCMessage **resp,
             tdm_error_t *err);

/* ---- the served model, as the router's MODELS call reports it ---- */

typedef struct http_model {
    char name[256];
    char chat_template[32];
    uint64_t fingerprint;
    uint32_t n_ctx, n_vocab;
    uint32_t n_layers, n_kv_heads, head_dim, n_heads, n_embd;
    uint64_t weight_bytes;
    uint32_t kv_block_size;
    int kv_dtype; /* tdm_kv_dtype_t */
} http_model_t;

/* Fills *m from a ModelInfo. Cannot fail. */
void http_model_from_proto(const Tandem__V1__ModelInfo *mi, http_model_t *m);

/* ---- errors in OpenAI's shape ---- */

/* {"error": {"message", "type", "param", "code"}} for status (a tdm status): type from its row
 * of the status table (tdm_status_info: "invalid_request_error", "authentication_error", ...),
 * code the given one or, when NULL, the row's ("invalid_argument"). param may be NULL. The HTTP
 * status to send it with is the row's http_status. Returns a new reference, NULL on out of
 * memory. */
json_t *http_error_json(int status, const char *code, const char *param, const char *message);

/* ---- OpenAI request translation (http_openai.c) ---- */

typedef enum oai_kind {
    OAI_COMPLETION = 0, /* POST /v1/completions */
    OAI_CHAT = 1,       /* POST /v1/chat/completions */
} oai_kind_t;

/* An OpenAI request and the GenerateRequest made from it. Every string in the message points
 * into root or into arrays owned here. */
typedef struct oai_req {
    oai_kind_t kind;
    json_t *root;
    Tandem__V1__GenerateRequest g;
    Tandem__V1__SamplingParams sp;
    Tandem__V1__ChatList chat;
    Tandem__V1__ChatMessage *msgs;     /* [chat.n_messages] */
    Tandem__V1__ChatMessage **msg_ptr; /* [chat.n_messages] */
    char **joined;                     /* [chat.n_messages] content joined from parts, or NULL */
    Tandem__V1__TokenList tokens;
    int32_t *ids;
    char **stop;
    int32_t *stop_ids;
    /* [sp.n_logit_bias] pointers, then the messages they point to: one block */
    Tandem__V1__LogitBias **bias;
    tdm_client_request_t creq; /* what the gateway sends: made from g */
    tdm_chat_message_t *cmsgs; /* [chat.n_messages] creq.messages */
    char id[64]; /* "cmpl-…" / "chatcmpl-…": the response id and the native request_id */
    char native_id[128]; /* a client's X-Request-Id made unique: the native request_id; or "" */
    char model[256];     /* the model name echoed in responses */
    long long created;
    bool stream;
    bool include_usage; /* stream_options.include_usage */
    bool logprobs;      /* return logprobs */
    int top_logprobs;   /* how many alternatives per token */
    const char *echo;   /* completions with echo: the prompt text to put first; else NULL */
    oai_tools_t tools;  /* chat: tools, tool_choice, parallel_tool_calls (http_tools.c) */

    /* choices and prompt lists: the answer has n_prompts * n choices, choice p * n + j being
     * the j-th of prompt p; each prompt is one GENERATE call (creqs[p]) asking best_of >= n
     * choices, of which the n with the highest sum of token logprobs are kept */
    uint32_t n;                  /* n (1..OAI_MAX_CHOICES) */
    uint32_t best_of;            /* completions' best_of (n..OAI_MAX_CHOICES); n for chat */
    size_t n_prompts;            /* completions' prompt list length (1..OAI_MAX_PROMPTS); 1 */
    tdm_client_request_t *creqs; /* [n_prompts] the calls (oai_prompt_requests); creqs[0] may
                                    be &creq */
    int32_t **list_ids;          /* [n_prompts] a token-id list's ids (heap), else NULL */
    size_t *list_n_ids;          /* [n_prompts] */
    char (*list_rids)[TDM_REQUEST_ID_MAX + 1]; /* [n_prompts] request ids of calls 1.. */
    int refs; /* the calls holding q (atomic; oai_req_unref frees it with the last) */

    /* structured output (http_structured.c) */
    char *constraint_text;     /* structured output: creq.constraint (heap), or NULL */
    char constraint_param[40]; /* the field that carried it ("response_format", "guided_json",
                                  "structured_outputs.regex"): error.param of its refusals */
} oai_req_t;

/* "an object", "a string", "an integer", ...: the JSON type of v, as the gateway's type errors
 * say it ("temperature must be a number, got a string"). Cannot fail. */
const char *oai_type_name(const json_t *v);

/* Parses an OpenAI request body into *q (zeroed first): type checks with a message naming the
 * field (err->field: the OpenAI name, "" when none), n and best_of in range, defaults (completions
 * max_tokens 16; chat none, so the router gives what the context leaves, at most 1024). served is
 * the model name used when the body names none. Returns 0, or TDM_EINVALID (or TDM_ERESOURCE) with
 * *err set; q then holds nothing to free. On success free with oai_req_clear. */
int oai_parse(oai_kind_t kind, const char *body, size_t len, const char *served, oai_req_t *q,
              tdm_error_t *err);

/* The logit_bias field of q->root into q->sp (http_logit_bias.c): an object of token ids (as
 * decimal strings) to biases in [-100, 100], at most TDM_SAMPLING_MAX_LOGIT_BIAS entries.
 * Returns 0, TDM_EINVALID naming the field (err->field "logit_bias" or logit_bias["<key>"]), or
 * TDM_ERESOURCE. The ids' upper bound (n_vocab) is the router's check. */
int oai_parse_logit_bias(oai_req_t *q, tdm_error_t *err);

/* The structured-output fields of q->root (response_format, guided_json / guided_regex /
 * guided_choice / guided_grammar, structured_outputs; docs/api.md "Structured output") into
 * q->creq's constraint, q->constraint_text and q->constraint_param (http_structured.c); nothing
 * when none asks for one. After q->creq is made. Returns 0, or TDM_EINVALID naming the field in
 * err->field (a wrong type, an unknown response_format type, two sources at once), TDM_ERESOURCE.
 */
int oai_parse_structured(oai_req_t *q, tdm_error_t *err);

/* Frees what *q owns (q itself when heap-allocated is freed by oai_req_destroy). NULL-safe. */
void oai_req_clear(oai_req_t *q);
/* For gw_call_start's req_free: oai_req_clear and free a heap-allocated oai_req_t. */
void oai_req_destroy(void *q);
/* For gw_call_start's req_free when several calls share q: drops one of q->refs (atomically)
 * and destroys q with the last. */
void oai_req_unref(void *q);

/* The most choices (n, best_of) and prompts (a completions prompt list) one request may ask
 * for; the errors name them. */
#define OAI_MAX_CHOICES 16
#define OAI_MAX_PROMPTS 64

/* After the request ids are final (q->creq.request_id): q->creqs, one call per prompt of a
 * list (request ids "<id>-<p>" from p = 1), each asking best_of choices. 0 or TDM_ERESOURCE. */
int oai_prompt_requests(oai_req_t *q);

/* Choices the calls of q ask for in all: n_prompts * best_of. */
static inline size_t oai_candidates(const oai_req_t *q)
{
    return q->n_prompts * q->best_of;
}

/* What the response writer keeps between chunks, per choice. Zero-initialise. */
typedef struct oai_out {
    uint32_t index; /* the choice's index in the answer */
    bool started;   /* the first event (role chunk / echo) was written */
    bool finished;  /* the finish chunk was written */
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
    int finish_reason;   /* tdm_client_finish_t */
    uint64_t text_chars; /* completions logprobs text_offset */
    double ttft_s, tpot_s;
    oai_tool_parser_t *tools; /* streamed chat with tools: the parser (http_tools.c), else NULL */
} oai_out_t;

/* Frees what o holds (the tool-call parser). NULL-safe. */
void oai_out_clear(oai_out_t *o);

/* Appends the SSE events ("data: {json}\n\n") for one streamed chunk to b. */
int oai_sse_chunk(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch, tdm_buf_t *b);

/* Appends the end of a stream: on success the usage chunk (stream_options.include_usage) and
 * "data: [DONE]"; after an error an event {"error": {...}} and "data: [DONE]". */
int oai_sse_end(const oai_req_t *q, oai_out_t *o, int status, const char *message, tdm_buf_t *b);

/* The non-streaming response body for the one chunk the router sent (stream=false). New
 * reference, NULL on out of memory. Fills o's usage. */
json_t *oai_response(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch);

/* The usage of the whole answer into *sum from the choices' outs[oai_candidates(q)]: the
 * completion tokens of every choice made (best_of's unreturned ones too, as OpenAI bills
 * them), each prompt's tokens once, and the first choice's timings. */
void oai_usage_sum(const oai_req_t *q, const oai_out_t *outs, oai_out_t *sum);

/* The non-streaming body of a request of several choices from each candidate's one chunk
 * (chs[oai_candidates(q)], candidate p * best_of + k of prompt p; NULL: none came, an error):
 * of each prompt's best_of candidates the n with the highest sum of sampled-token logprobs,
 * highest first (in candidate order when best_of == n), as choices p * n + j; usage over all
 * (oai_usage_sum, into *sum). New reference, NULL on out of memory. */
json_t *oai_response_multi(const oai_req_t *q, oai_out_t *outs, const tdm_client_chunk_t **chs,
                           oai_out_t *sum);

/* Appends "data: {chunk with one choice}\n\n": the chat delta (consumed) or the completion's
 * text[text_len]; logprobs consumed (NULL = null); finish NULL = null. 0 or TDM_ERESOURCE. */
int oai_emit_choice(const oai_req_t *q, tdm_buf_t *b, json_t *delta, const char *text,
                    size_t text_len, json_t *logprobs, const char *finish);
/* oai_emit_choice for the choice with this index. */
int oai_emit_choice_at(const oai_req_t *q, uint32_t index, tdm_buf_t *b, json_t *delta,
                       const char *text, size_t text_len, json_t *logprobs, const char *finish);

/* The logprobs of ch's tokens in OpenAI's shape; NULL when the request asked for none. */
json_t *oai_logprobs_json(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch);

/* ---- tool calls in responses (http_tools.c) ---- */

/* A streamed chat chunk of a request that parses tool calls: its content and the calls it
 * completes as SSE events appended to b (the finish event is the caller's). 0 or
 * TDM_ERESOURCE. */
int oai_tools_sse(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch, tdm_buf_t *b);

/* "tool_calls" when the streamed output held calls and ended with reason STOP, else NULL. */
const char *oai_tools_finish(const oai_out_t *o, int reason);

/* The non-streamed message of text: content (null when calls took all of it) and
 * tool_calls; *n_calls tells how many. New reference, NULL on out of memory. */
json_t *oai_tools_message_json(const oai_req_t *q, const char *text, size_t *n_calls);

/* ---- HTTP conventions (http_conv.c) ---- */

struct MHD_Connection;
struct MHD_Response;

/* Whether s (NUL-terminated; NULL: no) is a request id a client may choose: 1 to
 * TDM_REQUEST_ID_MAX bytes of 0x21..0x7E. */
bool http_request_id_ok(const char *s);

/* A new id "req-<24 hex digits>" into buf (cap >= 29). Cannot fail. */
void http_request_id_new(char *buf, size_t cap);

/* The Access-Control-Allow-Origin value for the request's Origin: "*" when router.cors_origins
 * has "*", the Origin itself when it is listed (ASCII case ignored), NULL when there is no
 * Origin or it is not allowed (or no CORS is configured). Valid while c's request is. */
const char *http_cors_origin(const tdm_config_t *cfg, struct MHD_Connection *c);

/* Adds what every reply carries: X-Request-Id: rid (when not empty) and, for an allowed
 * Origin, Access-Control-Allow-Origin (Vary: Origin) and Access-Control-Expose-Headers. */
void http_conv_headers(const tdm_config_t *cfg, struct MHD_Connection *c, struct MHD_Response *resp,
                       const char *rid);

/* Answers OPTIONS: 204 with Allow and X-Request-Id: rid; for an allowed Origin also the CORS
 * preflight headers (Allow-Origin, -Methods, -Headers, -Max-Age). Returns MHD's result. */
int http_options(const tdm_config_t *cfg, struct MHD_Connection *c, const char *rid);

/* ---- /tokenize and /detokenize (http_tokenize.c) ---- */

/* POST /tokenize: body {model?, prompt | messages (+ tools), add_special_tokens (default
 * true; false: no BOS), add_generation_prompt (chat; default true), return_token_strs} ->
 * {"count", "max_model_len", "tokens", "token_strs" (null unless asked)}; served is the model a
 * given "model" must name. Sets *status (200, 400 naming the field, 404 for another model).
 * Returns a new reference, NULL on out of memory. */
json_t *http_tokenize_json(const tdm_http_vocab_t *v, const char *served, const char *body,
                           size_t len, unsigned *status);

/* POST /detokenize: body {model?, tokens} -> {"prompt": the text, special tokens rendered};
 * a token out of the vocabulary is a 400 naming "tokens" (the message its index). As above. */
json_t *http_detokenize_json(const tdm_http_vocab_t *v, const char *served, const char *body,
                             size_t len, unsigned *status);

/* ---- dashboard (dashboard.c) ---- */

typedef struct dash dash_t;

/* Starts the dashboard's sampler thread: a STATUS and a METRICS call through gw every second,
 * kept for the last TDM_DASH_HISTORY seconds. Returns NULL with *err set (TDM_ERESOURCE). Free
 * with dash_destroy before gw. */
#define TDM_DASH_HISTORY 300
dash_t *dash_new(gw_t *gw, tdm_error_t *err);
void dash_destroy(dash_t **d_p);

/* Counts a finished HTTP generate request by its status (/api/status's "http"). Any thread. */
void dash_record(dash_t *d, int status);

/* Counts streams in flight (+1 when one starts, -1 when it ends). Any thread. */
void dash_streams(dash_t *d, int delta);

/* GET /api/status: the last ClusterStatus as JSON, the history and the model (m may be NULL).
 * New reference, NULL on out of memory. */
json_t *dash_status_json(dash_t *d, const http_model_t *m);

/* GET /api/capacity: get(ctx, NAME) returns the query parameter NAME or NULL. Returns the
 * JSON (new reference) with *http_status 200, or an OpenAI-shaped error with 400 naming the
 * parameter; NULL on out of memory. m (the served model, may be NULL) is used for
 * model=served; nodes for node=ID come from the last status. */
json_t *dash_capacity_json(dash_t *d, const http_model_t *m,
                           const char *(*get)(void *ctx, const char *name), void *ctx,
                           unsigned *http_status);

/* The embedded page (dashboard.html, generated into dashboard_html.c at build time). */
extern const unsigned char tdm_dashboard_html[];
extern const size_t tdm_dashboard_html_len;

#endif /* TANDEM_ROUTER_HTTP_INTERNAL_H */
