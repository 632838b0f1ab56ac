/* http_openai.h - the OpenAI API's translation in the HTTP gateway: request bodies to
 * GenerateRequests (http_openai.c, http_logit_bias.c, http_structured.c) and chunks back to
 * OpenAI's JSON and server-sent events (http_openai_out.c).
 */
#ifndef TANDEM_ROUTER_HTTP_OPENAI_H
#define TANDEM_ROUTER_HTTP_OPENAI_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <jansson.h>

#include "http_json.h"
#include "http_tools.h"
#include "tandem/client.h"
#include "tandem/proto.h"

typedef enum oai_kind {
    OAI_COMPLETION = 0, /* POST /v1/completions */
    OAI_CHAT = 1,       /* POST /v1/chat/completions */
} oai_kind_t;

/* The usage a streamed chunk carries under continuous_usage (the counts as of the chunk). */
typedef struct oai_usage_now {
    bool set;
    uint32_t prompt_tokens, completion_tokens, cached_tokens;
} oai_usage_now_t;

/* An OpenAI request and the GenerateRequest made from it. Every string in the message points
 * into root or into arrays owned here. */
typedef struct oai_req {
    oai_kind_t kind;
    bool for_tokenize; /* parsed for /tokenize (oai_parse_tokenize) */
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
    int32_t *allowed_ids;   /* [sp.n_allowed_token_ids] allowed_token_ids, or NULL */
    const char **bad_words; /* [n_bad_words] bad_words (strings of root), or NULL */
    size_t n_bad_words;
    tdm_client_request_t creq; /* what the gateway sends: made from g */
    tdm_chat_message_t *cmsgs; /* [chat.n_messages] creq.messages */
    char id[64]; /* "cmpl-…" / "chatcmpl-…": the response id and the native request_id */
    char native_id[128]; /* a client's X-Request-Id made unique: the native request_id; or "" */
    char model[256];     /* the model name echoed in responses */
    long long created;
    bool stream;
    bool include_usage;          /* stream_options.include_usage */
    int prompt_logprobs;         /* prompt_logprobs (0..20); -1 when not asked (or streamed) */
    bool continuous_usage;       /* stream_options.continuous_usage_stats with include_usage (vLLM
                                    needs both): every streamed chunk carries usage so far */
    oai_usage_now_t *usage_now;  /* continuous_usage: the counts the next chunk written carries
                                    (heap, set by oai_sse_chunk before it writes); else NULL */
    bool add_generation_prompt;  /* chat: add_generation_prompt (default true) */
    bool continue_final_message; /* chat: continue_final_message (default false) */
    const char *chat_echo; /* chat with echo: the last message's content, put before the answer's
                              (vLLM: when the last message has the answer's role); else NULL */
    bool logprobs;         /* return logprobs */
    int top_logprobs;      /* how many alternatives per token */
    const char *echo;      /* completions with echo: the prompt text to put first; else NULL */
    oai_tools_t tools;     /* chat: tools, tool_choice, parallel_tool_calls (http_tools.c) */
    const char *chat_template;  /* chat: the request's chat_template (points into root), or NULL */
    char *chat_template_kwargs; /* chat: chat_template_kwargs as JSON object text (heap), or NULL */
    oai_reasoning_t reasoning;  /* chat: how the output begins (http_family.c); NONE: no
                                   reasoning parsed (oai_apply_family) */
    bool hide_reasoning;        /* chat: vLLM's include_reasoning false: reasoning is dropped */
    char *reason_grammar;       /* the constraint with the free reasoning before it (heap), or
                                   NULL */

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

    /* a /v1/responses request (http_responses.c): each chat delta the writers make goes to
     * on_delta(delta_arg, delta (consumed; NULL for the finish alone), finish (NULL: none), b)
     * instead of becoming a chat chunk in b; its return is the writer's. NULL: chat chunks. */
    int (*on_delta)(void *arg, json_t *delta, const char *finish, tdm_buf_t *b);
    void *delta_arg;
} oai_req_t;

/* "an object", "a string", "an integer", ...: the JSON type of v, as the gateway's type errors
 * say it ("temperature must be a number, got a string"); NULL (an absent member) is "nothing
 * (the field is missing)". Cannot fail. */
const char *oai_type_name(const json_t *v);

/* Parses an OpenAI request body into *q (zeroed first): type checks with a message naming the
 * field (err->field: the OpenAI name, "" when none), n and best_of in range, defaults (completions
 * max_tokens 16; chat none, so the router gives what the context leaves, at most 1024). served is
 * the model name used when the body names none. Returns 0, or TDM_EINVALID (or TDM_ERESOURCE) with
 * *err set; q then holds nothing to free. On success free with oai_req_clear. */
int oai_parse(oai_kind_t kind, const char *body, size_t len, const char *served, oai_req_t *q,
              tdm_error_t *err);

/* oai_parse of a /tokenize body with messages (a chat): the same checks, except that vLLM's
 * generation fields Tandem refuses are not looked at (/tokenize generates nothing and its own
 * add_special_tokens is the BOS switch). */
int oai_parse_tokenize(const char *body, size_t len, const char *served, oai_req_t *q,
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

/* What the gateway knows of the model's chat template, for oai_apply_family. Borrowed. */
typedef struct oai_family_ctx {
    const tdm_chat_pick_t *pick; /* the model's template (NULL: none) */
    oai_family_t family;         /* its family under the config (oai_family_detect) */
    oai_reasoning_t plain_mode;  /* oai_family_reasoning for a request without a template or
                                    chat_template_kwargs of its own (rendered once at start) */
    tdm_reasoning_parser_t reasoning_cfg; /* model.reasoning_parser */
    tdm_tool_call_parser_t tools_cfg;     /* model.tool_call_parser */
} oai_family_ctx_t;

/* The chat request q (parsed by oai_parse, before oai_prompt_requests) fitted to its
 * template's family (http_family.h): the tool-call format and its grammar, the reasoning mode
 * (q->reasoning), vLLM's include_reasoning, reasoning_effort (passed to a template that reads
 * it as the variable reasoning_effort, else refused), and a constraint made to follow the
 * reasoning. The template is the request's chat_template (compiled here) or ctx's. Nothing for
 * completions. Returns 0, or TDM_EINVALID naming the field ("reasoning_effort",
 * "include_reasoning", "chat_template", the constraint's field), TDM_ERESOURCE; q then still
 * needs oai_req_clear. */
int oai_apply_family(oai_req_t *q, const oai_family_ctx_t *ctx, tdm_error_t *err);

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
    oai_reason_t *reason;     /* streamed chat with reasoning: the parser (http_family.c) */
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

/* Appends "data: {chunk with one choice}\n\n" for the choice with this index: the chat delta
 * (consumed) or the completion's text[text_len]; logprobs consumed (NULL = null); finish NULL =
 * null. 0 or TDM_ERESOURCE. */
int oai_emit_choice_at(const oai_req_t *q, uint32_t index, tdm_buf_t *b, json_t *delta,
                       const char *text, size_t text_len, json_t *logprobs, const char *finish);

/* The logprobs of ch's tokens in OpenAI's shape; NULL when the request asked for none. */
json_t *oai_logprobs_json(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch);

/* Tool calls in responses (http_tools.c). A streamed chat chunk of a request that parses tool
 * calls: its content and the calls it completes as SSE events appended to b (the finish event is
 * the caller's). 0 or TDM_ERESOURCE. */
int oai_tools_sse(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch, tdm_buf_t *b);

/* "tool_calls" when the streamed output held calls and ended with reason STOP, else NULL. */
const char *oai_tools_finish(const oai_out_t *o, int reason);

/* The non-streamed message of text: content (null when calls took all of it) and
 * tool_calls; *n_calls tells how many. cut: the output ended at max_tokens (finish reason
 * length): a call it left open is not content (oai_tool_parser_t.cut), as in the stream. New
 * reference, NULL on out of memory. */
json_t *oai_tools_message_json(const oai_req_t *q, const char *text, bool cut, size_t *n_calls);

#endif /* TANDEM_ROUTER_HTTP_OPENAI_H */
