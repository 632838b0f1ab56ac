/* http_tools.h - OpenAI tool calling in the HTTP gateway (http_tools.c): the request fields
 * (tools, tool_choice, parallel_tool_calls, the legacy functions / function_call), the tool
 * fields of messages, and the parser that turns generated calls into OpenAI tool_calls: the
 * Hermes style ("<tool_call>\n{"name": …, "arguments": …}\n</tool_call>") and the other
 * families' formats of http_family.h (Llama 3.x JSON, Mistral's [TOOL_CALLS]).
 * Included by http_openai.h; not installed. The format is documented in docs/api.md.
 */
#ifndef TANDEM_ROUTER_HTTP_TOOLS_H
#define TANDEM_ROUTER_HTTP_TOOLS_H

#include <stdbool.h>
#include <stddef.h>

#include <jansson.h>

#include "http_family.h"
#include "tandem/base.h"
#include "tandem/client.h"
#include "tandem/proto.h"

typedef enum oai_tool_choice {
    OAI_TOOL_CHOICE_NONE = 0,     /* "none" (the default without tools): no calls parsed */
    OAI_TOOL_CHOICE_AUTO = 1,     /* "auto" (the default with tools): the model decides */
    OAI_TOOL_CHOICE_REQUIRED = 2, /* "required": at least one call, grammar-constrained */
    OAI_TOOL_CHOICE_NAMED = 3,    /* {"type": "function", "function": {"name"}}: that one */
} oai_tool_choice_t;

/* A request's tool settings. Zero-initialise; free with oai_tools_clear. */
typedef struct oai_tools {
    char *text;     /* the tools as JSON array text for the router (ChatList.tools);
                       NULL when the request has none */
    size_t n_tools; /* entries of text */
    oai_tool_choice_t choice;
    char named[72]; /* OAI_TOOL_CHOICE_NAMED: the function's name */
    bool parallel;  /* parallel_tool_calls (default true): several calls may be made */
    bool parse;     /* the output is parsed into tool_calls (tools given, choice not none) */
    oai_tool_format_t format; /* the family's call format (http_family.h); HERMES until
                                 oai_tools_set_format */
    char *grammar; /* required / named: the GBNF the output is constrained to, else NULL */
    char **owned;  /* [n_owned] strings made for the messages (tool_calls JSON text) */
    size_t n_owned;
} oai_tools_t;

/* The tool fields of the request root (an object) into *t: tools / functions, tool_choice /
 * function_call, parallel_tool_calls, and the conflict with response_format (and vLLM's
 * guided_* / structured_outputs): both would constrain the output. Returns 0, or TDM_EINVALID
 * with the field at fault in param ("tools[1].function.name", "tool_choice",
 * "response_format") and *err set; TDM_ERESOURCE on out of memory. On error *t may hold
 * memory: oai_tools_clear frees it. */
int oai_tools_parse(json_t *root, oai_tools_t *t, tdm_error_t *err);

/* The tool fields of messages[i] (the JSON object m) into msg, whose role and content the
 * caller has set: an assistant's tool_calls (or legacy function_call), a tool message's
 * tool_call_id and name; the legacy role "function" becomes "tool". Strings point into m or
 * into memory t owns. Returns 0, or TDM_EINVALID naming the field
 * ("messages[2].tool_call_id"), TDM_ERESOURCE. */
int oai_tools_message(json_t *m, size_t i, Tandem__V1__ChatMessage *msg, oai_tools_t *t,
                      tdm_error_t *err);

/* Sets the client request's tools and, for tool_choice required or a named function, its
 * grammar constraint (the tools' parameter schemas compiled by tdm_json_schema_to_gbnf_rule).
 * Returns 0, or TDM_EINVALID naming the tool whose parameters do not compile
 * ("tools[0].function.parameters"), TDM_ERESOURCE. */
int oai_tools_request(oai_tools_t *t, tdm_client_request_t *c, tdm_error_t *err);

/* The most calls a required grammar allows (parallel_tool_calls true); with parallel_tool_calls
 * false or a named function it allows exactly one. The grammar ends after them, so a model
 * that would repeat a call cannot loop until max_tokens. */
#define OAI_TOOL_MAX_CALLS 8

/* Sets the call format of t (the template's family) and, when c has the grammar of
 * required / named calls, rebuilds it in that format's markup. Returns as oai_tools_request. */
int oai_tools_set_format(oai_tools_t *t, oai_tool_format_t format, tdm_client_request_t *c,
                         tdm_error_t *err);

/* Frees what t owns and zeroes it. NULL-safe. */
void oai_tools_clear(oai_tools_t *t);

/* ---- the output parser ---- */

/* One parsed call. */
typedef struct oai_tool_call {
    char id[40];     /* "call_" + 24 hex digits; Mistral formats: 9 letters and digits */
    char *name;      /* function.name */
    char *arguments; /* function.arguments: the arguments' JSON text as generated (so far,
                        while an incremental call is open) */
    bool announced;  /* streaming: the delta with id and name was sent */
    size_t sent;     /* streaming: bytes of arguments sent */
    size_t at;       /* bytes of content the feed that added it had given out before it: where
                        the call stands in that feed's content (output order) */
} oai_tool_call_t;

/* Splits generated text, fed in pieces, into content and calls. A call is
 * "<tool_call>" BODY "</tool_call>" where BODY is a JSON object with "name" (a string) and
 * "arguments" (or "parameters": an object, or a string holding JSON); a call whose BODY does
 * not parse stays content, text and tags included; so does everything after the first call
 * when parallel is false. Whitespace next to calls is dropped; without calls the content is
 * exactly the text. incremental (for grammar-constrained output, whose calls all begin
 * "\n{\"name\": \"NAME\", \"arguments\": " after the tag): a call is added as soon as that
 * head is seen and its arguments grow as they are fed (the "}" closing the call object
 * dropped), all but the last bytes that could be the call's end; a call of another form is
 * parsed whole. With cut set, the final feed drops what an output cut by max_tokens left
 * open instead of giving it out as content. Zero-initialise, then oai_tool_parser_init. */
typedef struct oai_tool_parser {
    oai_tool_format_t format; /* HERMES (the above); the other formats (http_family.h) are
                                 found at the start (llama3_json) or at "[TOOL_CALLS]" and
                                 parsed when the output ends: streamed, their calls arrive
                                 whole in the last deltas; text that does not parse as calls
                                 stays content, markers included */
    int fstate;               /* the other formats: 0 content, 1 calls held, 2 plain content */
    bool parallel;
    bool in_call;           /* inside <tool_call>: hold is the call's BODY so far */
    bool after_call;        /* the last thing seen was a call: leading whitespace is dropped */
    bool incremental;       /* stream the arguments of calls in the constrained form */
    bool streaming;         /* in a call whose head was seen: calls[n_calls - 1] grows */
    bool whole_call;        /* in a call not of the constrained form: parsed at its close */
    bool oom;               /* an allocation failed */
    bool cut;               /* the output was cut off (finish reason length; set before the
                               final feed): a call left open at the end, or the start of its
                               tag, is dropped, not content; a streamed call (incremental)
                               keeps the arguments given so far */
    tdm_buf_t hold;         /* outside a call: a tail that may begin "<tool_call>" */
    size_t close_scan;      /* in a whole call: hold[0..close_scan) holds no start of
                               "</tool_call>" (searched already; a chunk's search starts
                               there, so a long call costs linear, not quadratic, time) */
    tdm_buf_t ws;           /* whitespace outside calls not yet given out */
    oai_tool_call_t *calls; /* [n_calls] */
    size_t n_calls, cap;
    size_t given; /* bytes of content the current feed has given out (oai_tool_call_t.at) */
} oai_tool_parser_t;

void oai_tool_parser_init(oai_tool_parser_t *p, bool parallel, bool incremental);
/* As oai_tool_parser_init, for calls in format (incremental applies to HERMES only). */
void oai_tool_parser_init_format(oai_tool_parser_t *p, oai_tool_format_t format, bool parallel,
                                 bool incremental);

/* Feeds n bytes of text; final says it is the last piece (what is held is then decided).
 * Appends the content this piece settles to *content; calls completed (or, incremental,
 * opened) are appended to p->calls, each with .at, its place in this piece's content (the
 * content before it is content[0..at) of what this call appended). Returns 0 or
 * TDM_ERESOURCE (out of memory). */
int oai_tool_parser_feed(oai_tool_parser_t *p, const char *s, size_t n, bool final,
                         tdm_buf_t *content);

/* Frees the parser's memory. NULL-safe. */
void oai_tool_parser_free(oai_tool_parser_t *p);

#endif /* TANDEM_ROUTER_HTTP_TOOLS_H */
