/* http_family.h - a chat template's model family in the HTTP gateway (http_family.c): which
 * reasoning markup ("<think>…</think>") and which tool-call format its model writes, the parser
 * that splits generated text into reasoning_content and content, the grammar prefix that lets
 * the reasoning run free before a structured-output or tool-call constraint, and
 * reasoning_effort. The detection rules and the per-family table are in docs/models.md
 * ("Reasoning and tool-call formats"); the API in docs/api.md ("Reasoning").
 * Included by http_openai.h; not installed.
 */
#ifndef TANDEM_ROUTER_HTTP_FAMILY_H
#define TANDEM_ROUTER_HTTP_FAMILY_H

#include <stdbool.h>
#include <stddef.h>

#include "tandem/base.h"
#include "tandem/chat.h"
#include "tandem/config.h"
#include "tandem/jinja.h"
#include "tandem/proto.h"

/* How a request's output begins with respect to reasoning. */
typedef enum oai_reasoning {
    OAI_REASONING_NONE = 0, /* no reasoning markup: all output is content */
    /* DeepSeek-R1 (vLLM's deepseek_r1): the prompt opened "<think>", so the output begins
     * inside the reasoning (a repeated "<think>" at its start is dropped); "</think>" ends it;
     * output without "</think>" is all reasoning */
    OAI_REASONING_INSIDE = 1,
    /* Qwen3 (vLLM's qwen3): the output is content unless it begins with "<think>" (after
     * whitespace), which opens the reasoning up to "</think>" */
    OAI_REASONING_OPTIONAL = 2,
} oai_reasoning_t;

/* The format a model writes tool calls in (config model.tool_call_parser). */
typedef enum oai_tool_format {
    OAI_TOOL_FORMAT_HERMES = 0,       /* "<tool_call>\n{"name", "arguments"}\n</tool_call>" (Hermes,
                                         Qwen2.5/3, and the generic fallback) */
    OAI_TOOL_FORMAT_LLAMA3_JSON = 1,  /* Llama 3.x: {"name": …, "parameters": …} objects at the
                                         start of the output, "; "-separated, after an optional
                                         "<|python_tag|>" */
    OAI_TOOL_FORMAT_MISTRAL = 2,      /* "[TOOL_CALLS][{"name", "arguments"}, …]" */
    OAI_TOOL_FORMAT_MISTRAL_ARGS = 3, /* "[TOOL_CALLS]NAME[ARGS]{…}" per call (Mistral tokenizer
                                         v11+: Mistral Small 3.2, Devstral, Ministral 3) */
} oai_tool_format_t;

/* "hermes", "llama3_json", "mistral", "mistral" (the [ARGS] form): the format's name as the
 * docs and logs say it. Cannot fail. */
const char *oai_tool_format_name(oai_tool_format_t f);

/* A template's family. */
typedef struct oai_family {
    bool thinks;             /* the template has "<think>" markup (or the config names a
                                reasoning parser) */
    oai_reasoning_t forced;  /* the config's parser (NONE: decided per request from the
                                template's generation prompt, see oai_family_reasoning) */
    oai_tool_format_t tools; /* the tool-call format */
} oai_family_t;

/* The family of template t (NULL: a built-in template, which writes no reasoning markup and
 * renders tools in the Hermes format) under the config's model.reasoning_parser and
 * model.tool_call_parser (tandem/config.h; AUTO: from the template as docs/models.md says).
 * Cannot fail. */
oai_family_t oai_family_detect(const tdm_jinja_t *t, tdm_reasoning_parser_t reasoning,
                               tdm_tool_call_parser_t tools);

/* How a request's output begins, for family f rendered with template t (NULL: built-in) and the
 * request's kwargs (a JSON object or NULL; chat_template_kwargs such as enable_thinking) and
 * pick's bos/eos texts: NONE when !f->thinks; the config's parser when it names one; otherwise
 * the generation prompt of a one-message chat decides: ending with "<think>" (whitespace
 * aside) gives INSIDE, anything else OPTIONAL (Qwen3 with enable_thinking false ends its prompt
 * with an empty "<think>\n\n</think>", after which a model writes no markup). Cannot fail: a
 * template that does not render gives OPTIONAL. */
oai_reasoning_t oai_family_reasoning(const oai_family_t *f, const tdm_jinja_t *t,
                                     const tdm_chat_pick_t *pick, const json_t *kwargs);

/* An assistant message's reasoning (messages[i], the JSON object m: "reasoning_content", or
 * "reasoning" as newer vLLM writes it) into msg->reasoning_content (pointing into m), so a
 * template that reads message.reasoning_content (Qwen3's) renders it. Returns 0, or
 * TDM_EINVALID naming the field ("messages[2].reasoning_content": not a string, or on a message
 * that is not the assistant's). */
int oai_reasoning_message(json_t *m, size_t i, Tandem__V1__ChatMessage *msg, tdm_error_t *err);

/* ---- the reasoning parser ---- */

/* Splits generated text, fed in pieces, into reasoning and content as the oai_reasoning_t
 * values above say. Leading whitespace of the reasoning and of the content after "</think>" is
 * dropped; bytes that may begin a tag are held until the next piece decides them (at most 8).
 * Zero-initialise, then oai_reason_init. */
typedef struct oai_reason {
    int state;      /* parser state (http_family.c) */
    bool skip_ws;   /* drop whitespace before the next byte given out */
    tdm_buf_t hold; /* bytes that may begin the tag looked for */
} oai_reason_t;

void oai_reason_init(oai_reason_t *r, oai_reasoning_t mode);

/* The first needle[0..m) in s[0..n), NULL when there is none (s when m is 0); s may be NULL
 * when n is 0. Cannot fail. */
const char *oai_find(const char *s, size_t n, const char *needle, size_t m);

/* The length (0..tag_len - 1 bytes) of the longest tail of s[0..n) that begins tag[0..tag_len)
 * without being all of it: what a streaming parser holds back because the next piece may
 * complete the tag. Cannot fail. */
size_t oai_tag_tail(const char *s, size_t n, const char *tag, size_t tag_len);

/* Feeds n bytes; final: the last piece (what is held is then given out). Appends what this
 * piece settles to *reasoning and *content. Returns 0 or TDM_ERESOURCE (out of memory). */
int oai_reason_feed(oai_reason_t *r, const char *s, size_t n, bool final, tdm_buf_t *reasoning,
                    tdm_buf_t *content);

/* Frees the parser's memory. NULL-safe. */
void oai_reason_free(oai_reason_t *r);

/* ---- the grammar of a constrained answer after reasoning ---- */

/* Appends to out a GBNF whose start rule `root` lets the reasoning run free (any text without
 * "</think>", then "</think>" and whitespace; for OPTIONAL all of it optional and opened by
 * "<think>") and then matches the grammar gbnf[0..len) (start rule root). Every rule of gbnf is
 * renamed "u-<name>", so none collides with the wrapper's own (root, think-t0..7) whatever
 * the user named them. Returns 0, TDM_EINVALID when mode is NONE, TDM_ERESOURCE. */
int oai_reason_grammar(oai_reasoning_t mode, const char *gbnf, size_t len, tdm_buf_t *out,
                       tdm_error_t *err);

#endif /* TANDEM_ROUTER_HTTP_FAMILY_H */
