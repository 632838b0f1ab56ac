/* http_responses.c - OpenAI's Responses API (POST /v1/responses, GET and DELETE
 * /v1/responses/{id}) as a front of the chat path: the Responses body becomes a chat request
 * body (instructions as the system message, the stored conversation of previous_response_id,
 * the input items as messages, flat function tools as chat tools, text.format as
 * response_format, max_output_tokens as max_completion_tokens), which http_generate.c parses and
 * runs as it runs /v1/chat/completions; the chat deltas it writes (content, reasoning_content,
 * tool_calls) come here instead of becoming chat chunks and are restated as the Responses
 * events. A stream=false answer goes through the same writer as one chunk, so the output items
 * (reasoning, messages, function calls in the order the model wrote them) are the same streamed
 * or not, in response.completed and in the stored response. So the prompt, the constraints and
 * the tool-call and reasoning parsers are the chat path's own.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "http_responses.h"
#include "responses_store.h"
#include "tandem/tokenizer.h"

/* OpenAI's limits on metadata: pairs, key and value lengths (characters; bytes here). */
#define RESP_METADATA_MAX_PAIRS 16
#define RESP_METADATA_MAX_KEY 64
#define RESP_METADATA_MAX_VALUE 512

typedef enum resp_open {
    RESP_OPEN_NONE = 0,
    RESP_OPEN_REASONING,
    RESP_OPEN_MESSAGE,
    RESP_OPEN_CALL,
} resp_open_t;

/* A streamed function call: the chat tool call index k's item. */
typedef struct resp_stream_call {
    size_t output_index;
    json_t *item; /* the function_call item (arguments grow as they come) */
} resp_stream_call_t;

struct resp_call {
    tdm_http_t *h;
    json_t *root;    /* the Responses body */
    json_t *chat;    /* the chat body made from it */
    char *chat_text; /* its JSON text */
    size_t chat_len;
    json_t *labels; /* [messages] the Responses field each chat message came from */
    json_t *conv;   /* the conversation so far: the previous response's items, then this
                       input's */
    bool store, stream;
    char id[64]; /* "resp_…" */
    long long created;
    char finish[16]; /* the chat finish_reason of the answer ("" before it) */
    /* the stream's writer */
    uint64_t seq;              /* sequence_number of the next event */
    json_t *output;            /* the finished output items */
    resp_open_t open;          /* the item being written */
    json_t *open_item;         /* its item (reasoning or message) */
    size_t open_index;         /* its output_index */
    tdm_buf_t open_text;       /* its text so far */
    resp_stream_call_t *calls; /* [n_calls] by chat tool-call index */
    size_t n_calls;
    size_t open_call;  /* RESP_OPEN_CALL: which */
    tdm_buf_t thought; /* all reasoning text streamed, for reasoning_tokens */
};

/* ---- the request ---- */

static json_t *get(json_t *o, const char *key)
{
    json_t *v = json_object_get(o, key);
    return json_is_null(v) ? NULL : v;
}

/* Appends message m (consumed) to the chat messages with the Responses field it came from. */
static int add_message(resp_call_t *rc, json_t *msgs, json_t *m, const char *label)
{
    if (!m || json_array_append_new(msgs, m) != 0 ||
        json_array_append_new(rc->labels, json_string(label)) != 0)
        return TDM_ERESOURCE;
    return TDM_OK;
}

/* A content value of item field name for the chat message: a string as it is, an array of
 * text parts (input_text, output_text; refusal's refusal) as chat's text parts (the chat path
 * joins them). Other parts are refused naming name[j].type. *out is a new reference. */
static int content_parts(json_t *c, const char *name, json_t **out, tdm_error_t *err)
{
    if (json_is_string(c)) {
        *out = json_incref(c);
        return TDM_OK;
    }
    if (!c)
        return tdm_error_set_field(err, TDM_EINVALID, name,
                                   "%s is required: a string or an array of content parts", name);
    if (!json_is_array(c))
        return tdm_error_set_field(err, TDM_EINVALID, name,
                                   "%s must be a string or an array of content parts, got %s", name,
                                   oai_type_name(c));
    json_t *parts = json_array();
    size_t j;
    json_t *p;
    json_array_foreach(c, j, p)
    {
        char f[TDM_ERRFIELD_MAX];
        snprintf(f, sizeof f, "%s[%zu].type", name, j);
        const char *ty = json_string_value(json_object_get(p, "type"));
        int st = TDM_OK;
        if (!json_is_object(p) || !ty)
            st = tdm_error_set_field(err, TDM_EINVALID, f,
                                     "%s is required: a content part is an object with a type", f);
        else if (strcmp(ty, "input_text") != 0 && strcmp(ty, "output_text") != 0 &&
                 strcmp(ty, "refusal") != 0 && strcmp(ty, "text") != 0)
            st = tdm_error_set_field(err, TDM_EINVALID, f,
                                     "%s '%.64s' is not supported: Tandem serves text models; "
                                     "the parts it reads are input_text and output_text",
                                     f, ty);
        const char *key = ty && strcmp(ty, "refusal") == 0 ? "refusal" : "text";
        json_t *text = json_object_get(p, key);
        if (st == TDM_OK && !json_is_string(text)) {
            snprintf(f, sizeof f, "%s[%zu].%s", name, j, key);
            st = tdm_error_set_field(err, TDM_EINVALID, f, "%s must be a string", f);
        }
        if (st == TDM_OK &&
            json_array_append_new(parts, json_pack("{s:s, s:O}", "type", "text", "text", text)))
            st = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        if (st != TDM_OK) {
            json_decref(parts);
            return st;
        }
    }
    *out = parts;
    return parts ? TDM_OK : tdm_error_set(err, TDM_ERESOURCE, "out of memory");
}

/* The string member key of item (named name), required. */
static int item_string(json_t *item, const char *name, const char *key, json_t **out,
                       tdm_error_t *err)
{
    *out = json_object_get(item, key);
    if (json_is_string(*out))
        return TDM_OK;
    char f[TDM_ERRFIELD_MAX];
    snprintf(f, sizeof f, "%s.%s", name, key);
    return tdm_error_set_field(err, TDM_EINVALID, f, "%s must be a string%s", f,
                               *out ? "" : " (it is required)");
}

/* The walk of a list of items into chat messages (items_to_messages). */
typedef struct item_walk {
    resp_call_t *rc;
    json_t *msgs;
    json_t *last_assistant;   /* the message function calls join, or NULL */
    json_t *reasoning;        /* a reasoning item's text waiting for its message, or NULL */
    char f[TDM_ERRFIELD_MAX]; /* the item's field: "input[3]" */
    const char *label;        /* the field chat errors about its message name */
    tdm_error_t *err;
} item_walk_t;

/* An assistant message takes the reasoning waiting for it. */
static void take_reasoning(item_walk_t *w, json_t *m)
{
    if (m && w->reasoning) {
        json_object_set_new(m, "reasoning_content", w->reasoning);
        w->reasoning = NULL;
    }
}

/* A message item: {role, content}. */
static int item_message(item_walk_t *w, json_t *item)
{
    json_t *role;
    int st = item_string(item, w->f, "role", &role, w->err);
    if (st != TDM_OK)
        return st;
    const char *r = json_string_value(role);
    char f[TDM_ERRFIELD_MAX + 16];
    if (strcmp(r, "user") != 0 && strcmp(r, "system") != 0 && strcmp(r, "developer") != 0 &&
        strcmp(r, "assistant") != 0) {
        snprintf(f, sizeof f, "%s.role", w->f);
        return tdm_error_set_field(w->err, TDM_EINVALID, f,
                                   "%s '%.32s' is not one of user, system, developer, assistant", f,
                                   r);
    }
    snprintf(f, sizeof f, "%s.content", w->f);
    json_t *text = NULL;
    if ((st = content_parts(json_object_get(item, "content"), f, &text, w->err)) != TDM_OK)
        return st;
    json_t *m = json_pack("{s:s, s:o}", "role", strcmp(r, "developer") == 0 ? "system" : r,
                          "content", text);
    bool assistant = strcmp(r, "assistant") == 0;
    if (assistant)
        take_reasoning(w, m);
    w->last_assistant = assistant ? m : NULL;
    return add_message(w->rc, w->msgs, m, w->label);
}

/* A function_call item: a tool call of the assistant message before it, or of a new one. */
static int item_function_call(item_walk_t *w, json_t *item)
{
    json_t *call_id, *fname, *args;
    int st;
    if ((st = item_string(item, w->f, "call_id", &call_id, w->err)) != TDM_OK ||
        (st = item_string(item, w->f, "name", &fname, w->err)) != TDM_OK ||
        (st = item_string(item, w->f, "arguments", &args, w->err)) != TDM_OK)
        return st;
    if (!w->last_assistant) {
        json_t *m = json_pack("{s:s, s:n}", "role", "assistant", "content");
        take_reasoning(w, m);
        if ((st = add_message(w->rc, w->msgs, m, w->label)) != TDM_OK)
            return st;
        w->last_assistant = m;
    }
    json_t *calls = json_object_get(w->last_assistant, "tool_calls");
    if (!calls) {
        calls = json_array();
        json_object_set_new(w->last_assistant, "tool_calls", calls);
    }
    json_t *call = json_pack("{s:O, s:s, s:{s:O, s:O}}", "id", call_id, "type", "function",
                             "function", "name", fname, "arguments", args);
    return call && json_array_append_new(calls, call) == 0 ? TDM_OK : TDM_ERESOURCE;
}

/* A function_call_output item: a tool message. */
static int item_function_output(item_walk_t *w, json_t *item)
{
    json_t *call_id, *text = NULL;
    int st = item_string(item, w->f, "call_id", &call_id, w->err);
    if (st != TDM_OK)
        return st;
    char f[TDM_ERRFIELD_MAX + 16];
    snprintf(f, sizeof f, "%s.output", w->f);
    if ((st = content_parts(json_object_get(item, "output"), f, &text, w->err)) != TDM_OK)
        return st;
    w->last_assistant = NULL;
    return add_message(
        w->rc, w->msgs,
        json_pack("{s:s, s:O, s:o}", "role", "tool", "tool_call_id", call_id, "content", text),
        w->label);
}

/* A reasoning item: its text (content, else the summary) goes with the assistant message after
 * it, as a chat request's reasoning_content; the template decides what it keeps. */
static int item_reasoning(item_walk_t *w, json_t *item)
{
    tdm_buf_t t = TDM_BUF_INIT;
    json_t *parts = get(item, "content");
    if (!json_array_size(parts))
        parts = get(item, "summary");
    size_t j;
    json_t *p;
    json_array_foreach(parts, j, p)
    {
        json_t *s = json_object_get(p, "text");
        if (json_is_string(s))
            tdm_buf_append(&t, json_string_value(s), json_string_length(s));
    }
    json_decref(w->reasoning);
    w->reasoning = t.len ? http_json_text(t.data, t.len) : NULL;
    tdm_buf_free(&t);
    w->last_assistant = NULL;
    return TDM_OK;
}

/* One item of the walk by its type ({role, content} without one is a message). */
static int walk_item(item_walk_t *w, json_t *item)
{
    if (!json_is_object(item))
        return tdm_error_set_field(w->err, TDM_EINVALID, w->f, "%s must be an object, got %s", w->f,
                                   oai_type_name(item));
    const char *ty = json_string_value(json_object_get(item, "type"));
    if (!ty && json_object_get(item, "role"))
        ty = "message"; /* the easy input message */
    char f[TDM_ERRFIELD_MAX + 16];
    snprintf(f, sizeof f, "%s.type", w->f);
    if (!ty)
        return tdm_error_set_field(w->err, TDM_EINVALID, f,
                                   "%s is required (message, function_call, "
                                   "function_call_output or reasoning)",
                                   f);
    if (strcmp(ty, "message") == 0)
        return item_message(w, item);
    if (strcmp(ty, "function_call") == 0)
        return item_function_call(w, item);
    if (strcmp(ty, "function_call_output") == 0)
        return item_function_output(w, item);
    if (strcmp(ty, "reasoning") == 0)
        return item_reasoning(w, item);
    return tdm_error_set_field(w->err, TDM_EINVALID, f,
                               "%s '%.64s' is not supported: the items Tandem reads are message, "
                               "function_call, function_call_output and reasoning (no hosted "
                               "tools)",
                               f, ty);
}

/* The items (a JSON array; name "input", or "previous_response_id" for the stored ones) into
 * chat messages: message items as messages (developer read as system), function_call items as
 * the tool_calls of an assistant message (consecutive ones together, after the assistant's text
 * when it came just before), function_call_output items as tool messages, reasoning items as
 * the reasoning_content of the assistant message after them. */
static int items_to_messages(resp_call_t *rc, json_t *items, const char *name, json_t *msgs,
                             tdm_error_t *err)
{
    item_walk_t w = {.rc = rc, .msgs = msgs, .err = err};
    bool stored = strcmp(name, "previous_response_id") == 0;
    size_t i;
    json_t *item;
    int st = TDM_OK;
    json_array_foreach(items, i, item)
    {
        snprintf(w.f, sizeof w.f, "%s[%zu]", name, i);
        w.label = stored ? name : w.f;
        if ((st = walk_item(&w, item)) != TDM_OK)
            break;
    }
    json_decref(w.reasoning);
    if (st != TDM_OK && !err->code)
        tdm_error_set(err, st, "out of memory");
    return st;
}

/* input: a string (one user message) or an array of items, as the items of this turn (rc->conv
 * gets them after the stored ones). */
static int input_items(resp_call_t *rc, json_t **items, tdm_error_t *err)
{
    json_t *in = get(rc->root, "input");
    if (!in)
        return tdm_error_set_field(err, TDM_EINVALID, "input",
                                   "input is required: a string or an array of items");
    if (json_is_string(in)) {
        *items = json_pack("[{s:s, s:s, s:O}]", "type", "message", "role", "user", "content", in);
        return *items ? TDM_OK : tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    if (!json_is_array(in))
        return tdm_error_set_field(err, TDM_EINVALID, "input",
                                   "input must be a string or an array of items, got %s",
                                   oai_type_name(in));
    if (json_array_size(in) == 0)
        return tdm_error_set_field(err, TDM_EINVALID, "input", "input is empty");
    *items = json_incref(in);
    return TDM_OK;
}

/* tools[i] (t), a flat function tool, as a chat tool into *out. */
static int tool_to_chat(json_t *t, size_t i, json_t **out, tdm_error_t *err)
{
    char f[TDM_ERRFIELD_MAX];
    snprintf(f, sizeof f, "tools[%zu].type", i);
    const char *ty = json_string_value(json_object_get(t, "type"));
    if (!json_is_object(t) || !ty)
        return tdm_error_set_field(err, TDM_EINVALID, f,
                                   "%s is required: a tool is an object with a type", f);
    if (strcmp(ty, "function") != 0)
        return tdm_error_set_field(err, TDM_EINVALID, f,
                                   "%s '%.64s' is not supported: Tandem runs no hosted tools; "
                                   "give function tools",
                                   f, ty);
    if (json_object_get(t, "function") && !json_object_get(t, "name")) {
        snprintf(f, sizeof f, "tools[%zu].name", i);
        return tdm_error_set_field(err, TDM_EINVALID, f,
                                   "%s is required (the Responses API's function tools are flat: "
                                   "{type, name, description, parameters, strict}, not chat's "
                                   "{type, function})",
                                   f);
    }
    json_t *fn = json_object();
    static const char *keys[] = {"name", "description", "parameters", "strict"};
    for (size_t k = 0; fn && k < sizeof keys / sizeof keys[0]; k++) {
        json_t *v = json_object_get(t, keys[k]);
        if (v && !(json_is_null(v) && strcmp(keys[k], "name") != 0))
            json_object_set(fn, keys[k], v);
    }
    *out = fn ? json_pack("{s:s, s:o}", "type", "function", "function", fn) : NULL;
    return *out ? TDM_OK : tdm_error_set(err, TDM_ERESOURCE, "out of memory");
}

/* tool_choice: a string as it is, {type: "function", name} as chat's {type, function: {name}}. */
static int tool_choice_to_chat(resp_call_t *rc, tdm_error_t *err)
{
    json_t *tc = get(rc->root, "tool_choice");
    const char *s = json_string_value(tc);
    if (tc && !json_is_object(tc) &&
        (!s || (strcmp(s, "auto") != 0 && strcmp(s, "none") != 0 && strcmp(s, "required") != 0)))
        return tdm_error_set_field(err, TDM_EINVALID, "tool_choice",
                                   "tool_choice must be \"auto\", \"none\", \"required\" or "
                                   "{\"type\": \"function\", \"name\": ...}, got %s%s%.64s%s",
                                   oai_type_name(tc), s ? " '" : "", s ? s : "", s ? "'" : "");
    if (!json_is_object(tc)) {
        if (tc)
            json_object_set(rc->chat, "tool_choice", tc);
        return TDM_OK;
    }
    const char *ty = json_string_value(json_object_get(tc, "type"));
    if (!ty || strcmp(ty, "function") != 0)
        return tdm_error_set_field(err, TDM_EINVALID, "tool_choice.type",
                                   "tool_choice.type '%.64s' is not supported: give \"auto\", "
                                   "\"none\", \"required\" or {\"type\": \"function\", \"name\": "
                                   "...}",
                                   ty ? ty : "(none)");
    json_t *name = json_object_get(tc, "name");
    if (!json_is_string(name))
        return tdm_error_set_field(err, TDM_EINVALID, "tool_choice.name",
                                   "tool_choice.name must be a string (the function's name), "
                                   "got %s",
                                   oai_type_name(name));
    json_object_set_new(rc->chat, "tool_choice",
                        json_pack("{s:s, s:{s:O}}", "type", "function", "function", "name", name));
    return TDM_OK;
}

/* tools: flat function tools ({type, name, description, parameters, strict}) into chat tools,
 * and tool_choice. */
static int tools_to_chat(resp_call_t *rc, tdm_error_t *err)
{
    json_t *tools = get(rc->root, "tools");
    if (tools && !json_is_array(tools))
        return tdm_error_set_field(err, TDM_EINVALID, "tools", "tools must be an array, got %s",
                                   oai_type_name(tools));
    json_t *out = tools ? json_array() : NULL;
    size_t i;
    json_t *t;
    json_array_foreach(tools, i, t)
    {
        json_t *ct = NULL;
        int st = tool_to_chat(t, i, &ct, err);
        if (st == TDM_OK && json_array_append_new(out, ct) != 0)
            st = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        if (st != TDM_OK) {
            json_decref(out);
            return st;
        }
    }
    if (out)
        json_object_set_new(rc->chat, "tools", out);
    return tool_choice_to_chat(rc, err);
}

/* text.format into response_format. */
static int format_to_chat(resp_call_t *rc, tdm_error_t *err)
{
    json_t *text = get(rc->root, "text");
    if (!text)
        return TDM_OK;
    if (!json_is_object(text))
        return tdm_error_set_field(err, TDM_EINVALID, "text", "text must be an object, got %s",
                                   oai_type_name(text));
    json_t *fmt = get(text, "format");
    if (!fmt)
        return TDM_OK;
    const char *ty = json_string_value(json_object_get(fmt, "type"));
    if (!json_is_object(fmt) || !ty)
        return tdm_error_set_field(err, TDM_EINVALID, "text.format.type",
                                   "text.format.type is required: text, json_object or "
                                   "json_schema");
    if (strcmp(ty, "text") == 0)
        return TDM_OK;
    if (strcmp(ty, "json_object") == 0) {
        json_object_set_new(rc->chat, "response_format", json_pack("{s:s}", "type", ty));
        return TDM_OK;
    }
    if (strcmp(ty, "json_schema") != 0)
        return tdm_error_set_field(err, TDM_EINVALID, "text.format.type",
                                   "text.format.type '%.64s' is not one of text, json_object, "
                                   "json_schema",
                                   ty);
    /* The Responses API requires the schema (chat's response_format does not: there a
     * json_schema without one means any JSON object). */
    json_t *schema = json_object_get(fmt, "schema");
    if (!json_is_object(schema) && !json_is_boolean(schema))
        return tdm_error_set_field(err, TDM_EINVALID, "text.format.schema",
                                   "text.format.schema is required with type json_schema: a "
                                   "JSON Schema object, got %s",
                                   schema ? oai_type_name(schema) : "nothing");
    json_t *js = json_object();
    static const char *keys[] = {"name", "schema", "strict", "description"};
    for (size_t k = 0; js && k < sizeof keys / sizeof keys[0]; k++) {
        json_t *v = json_object_get(fmt, keys[k]);
        if (v)
            json_object_set(js, keys[k], v);
    }
    json_object_set_new(rc->chat, "response_format",
                        json_pack("{s:s, s:o}", "type", "json_schema", "json_schema", js));
    return TDM_OK;
}

/* The fields Tandem cannot honour: refused rather than ignored. */
static int refuse_unsupported(resp_call_t *rc, tdm_error_t *err)
{
    json_t *v;
    if ((v = get(rc->root, "background")) && !json_is_false(v))
        return tdm_error_set_field(err, TDM_EINVALID, "background",
                                   "background: background responses are not supported here");
    if (get(rc->root, "conversation"))
        return tdm_error_set_field(err, TDM_EINVALID, "conversation",
                                   "conversation: conversations are not supported here; chain "
                                   "responses with previous_response_id");
    if (get(rc->root, "prompt"))
        return tdm_error_set_field(err, TDM_EINVALID, "prompt",
                                   "prompt: stored prompt templates are not supported here");
    if ((v = get(rc->root, "top_logprobs")) && !(json_is_integer(v) && json_integer_value(v) == 0))
        return tdm_error_set_field(err, TDM_EINVALID, "top_logprobs",
                                   "top_logprobs: log probabilities are not returned by "
                                   "/v1/responses here (use /v1/chat/completions)");
    const char *tr = json_string_value(get(rc->root, "truncation"));
    if (get(rc->root, "truncation") && (!tr || strcmp(tr, "disabled") != 0))
        return tdm_error_set_field(err, TDM_EINVALID, "truncation",
                                   "truncation: only \"disabled\" is supported (an input over "
                                   "the context is refused)");
    json_t *md = get(rc->root, "metadata");
    if (md && !json_is_object(md))
        return tdm_error_set_field(err, TDM_EINVALID, "metadata",
                                   "metadata must be an object of strings, got %s",
                                   oai_type_name(md));
    if (json_object_size(md) > RESP_METADATA_MAX_PAIRS)
        return tdm_error_set_field(err, TDM_EINVALID, "metadata",
                                   "metadata has %zu pairs, at most %d allowed",
                                   json_object_size(md), RESP_METADATA_MAX_PAIRS);
    const char *k;
    json_object_foreach(md, k, v)
    {
        if (strlen(k) > RESP_METADATA_MAX_KEY || !json_is_string(v) ||
            json_string_length(v) > RESP_METADATA_MAX_VALUE)
            return tdm_error_set_field(err, TDM_EINVALID, "metadata",
                                       "metadata[\"%.64s\"]: keys are at most %d bytes and values "
                                       "strings of at most %d bytes",
                                       k, RESP_METADATA_MAX_KEY, RESP_METADATA_MAX_VALUE);
    }
    return TDM_OK;
}

/* The scalar fields the chat request takes as they are (max_output_tokens renamed). */
static int scalars_to_chat(resp_call_t *rc, tdm_error_t *err)
{
    static const char *same[] = {"model", "temperature", "top_p", "parallel_tool_calls",
                                 "user",  "seed"};
    for (size_t k = 0; k < sizeof same / sizeof same[0]; k++) {
        json_t *v = json_object_get(rc->root, same[k]);
        if (v)
            json_object_set(rc->chat, same[k], v);
    }
    json_t *v = json_object_get(rc->root, "max_output_tokens");
    if (v)
        json_object_set(rc->chat, "max_completion_tokens", v);
    json_t *st = get(rc->root, "stream");
    if (st && !json_is_boolean(st))
        return tdm_error_set_field(err, TDM_EINVALID, "stream", "stream must be a boolean, got %s",
                                   oai_type_name(st));
    rc->stream = json_is_true(st);
    json_object_set_new(rc->chat, "stream", json_boolean(rc->stream));
    json_t *store = get(rc->root, "store");
    if (store && !json_is_boolean(store))
        return tdm_error_set_field(err, TDM_EINVALID, "store", "store must be a boolean, got %s",
                                   oai_type_name(store));
    rc->store = !json_is_false(store);
    json_t *instr = get(rc->root, "instructions");
    if (instr && !json_is_string(instr))
        return tdm_error_set_field(err, TDM_EINVALID, "instructions",
                                   "instructions must be a string, got %s", oai_type_name(instr));
    json_t *reasoning = get(rc->root, "reasoning");
    if (reasoning && !json_is_object(reasoning))
        return tdm_error_set_field(err, TDM_EINVALID, "reasoning",
                                   "reasoning must be an object, got %s", oai_type_name(reasoning));
    json_t *effort = get(reasoning, "effort");
    if (effort) /* the chat path passes it to a template that reads it, else refuses it */
        json_object_set(rc->chat, "reasoning_effort", effort);
    return TDM_OK;
}

/* The previous response's conversation into *items (NULL: none asked for). TDM_ENOTFOUND
 * names the id. */
static int previous_items(resp_call_t *rc, json_t **items, tdm_error_t *err)
{
    *items = NULL;
    json_t *prev = get(rc->root, "previous_response_id");
    if (!prev)
        return TDM_OK;
    if (!json_is_string(prev))
        return tdm_error_set_field(err, TDM_EINVALID, "previous_response_id",
                                   "previous_response_id must be a string, got %s",
                                   oai_type_name(prev));
    char *conv = NULL;
    int st = resp_store_get(rc->h->responses, json_string_value(prev), NULL, &conv);
    if (st == TDM_ENOTFOUND)
        return tdm_error_set_field(err, TDM_ENOTFOUND, "previous_response_id",
                                   "previous_response_id: no response '%.80s' is stored on this "
                                   "router (never made here, made with store false, evicted or "
                                   "deleted); response ids are per router: send a follow-up to "
                                   "the router that answered the response it continues",
                                   json_string_value(prev));
    if (st != TDM_OK)
        return tdm_error_set(err, st, "out of memory");
    *items = json_loads(conv, 0, NULL);
    free(conv);
    return *items ? TDM_OK : tdm_error_set(err, TDM_EINTERNAL, "the stored conversation is bad");
}

/* The chat body of the Responses body in rc->root. */
static int translate(resp_call_t *rc, tdm_error_t *err)
{
    int st;
    json_t *prev = NULL, *items = NULL;
    if ((st = refuse_unsupported(rc, err)) != TDM_OK || (st = scalars_to_chat(rc, err)) != TDM_OK ||
        (st = tools_to_chat(rc, err)) != TDM_OK || (st = format_to_chat(rc, err)) != TDM_OK ||
        (st = input_items(rc, &items, err)) != TDM_OK ||
        (st = previous_items(rc, &prev, err)) != TDM_OK)
        goto out;
    json_t *msgs = json_array();
    json_object_set_new(rc->chat, "messages", msgs);
    json_t *instr = get(rc->root, "instructions");
    if (instr &&
        (st = add_message(rc, msgs, json_pack("{s:s, s:O}", "role", "system", "content", instr),
                          "instructions")) != TDM_OK)
        goto out;
    if (prev && (st = items_to_messages(rc, prev, "previous_response_id", msgs, err)) != TDM_OK)
        goto out;
    if ((st = items_to_messages(rc, items, "input", msgs, err)) != TDM_OK)
        goto out;
    rc->conv = prev ? json_incref(prev) : json_array();
    if (!rc->conv || json_array_extend(rc->conv, items) != 0) {
        st = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out;
    }
    rc->chat_text = json_dumps(rc->chat, JSON_COMPACT);
    rc->chat_len = rc->chat_text ? strlen(rc->chat_text) : 0;
    if (!rc->chat_text)
        st = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
out:
    if (st == TDM_ERESOURCE && !err->msg[0])
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    json_decref(prev);
    json_decref(items);
    return st;
}

void resp_call_free(resp_call_t **rc_p)
{
    if (!rc_p || !*rc_p)
        return;
    resp_call_t *rc = *rc_p;
    json_decref(rc->root);
    json_decref(rc->chat);
    free(rc->chat_text);
    json_decref(rc->labels);
    json_decref(rc->conv);
    json_decref(rc->output);
    json_decref(rc->open_item);
    tdm_buf_free(&rc->open_text);
    tdm_buf_free(&rc->thought);
    for (size_t k = 0; k < rc->n_calls; k++)
        json_decref(rc->calls[k].item);
    free(rc->calls);
    free(rc);
    *rc_p = NULL;
}

enum MHD_Result http_responses(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r)
{
    enum MHD_Result ret;
    if (!http_check_key(h, c, &ret))
        return ret;
    tdm_error_t err = {0};
    resp_call_t *rc = calloc(1, sizeof *rc);
    json_error_t jerr;
    if (!rc)
        return http_reply_error(c, TDM_EINTERNAL, NULL, NULL, "out of memory");
    rc->h = h;
    rc->root = json_loadb(r->body.data ? r->body.data : "", r->body.len, 0, &jerr);
    rc->chat = json_object();
    rc->labels = json_array();
    rc->output = json_array();
    int st = TDM_OK;
    if (!rc->root)
        st = tdm_error_set_field(&err, TDM_EINVALID, "", "the body is not valid JSON: %s (line %d)",
                                 jerr.text, jerr.line);
    else if (!json_is_object(rc->root))
        st = tdm_error_set_field(&err, TDM_EINVALID, "", "the body must be a JSON object, got %s",
                                 oai_type_name(rc->root));
    else if (!rc->chat || !rc->labels || !rc->output)
        st = tdm_error_set(&err, TDM_ERESOURCE, "out of memory");
    else
        st = translate(rc, &err);
    if (st != TDM_OK) {
        resp_call_free(&rc);
        http_counters_refusal(h->counters, err.field, st);
        return http_reply_error(c, st, st == TDM_ENOTFOUND ? "response_not_found" : NULL,
                                err.field[0] ? err.field : NULL, "%s", err.msg);
    }
    r->resp = rc;
    return http_generate(h, c, r, OAI_CHAT);
}

const char *resp_chat_body(const resp_call_t *rc, size_t *len)
{
    *len = rc->chat_len;
    return rc->chat_text;
}

static int on_delta(void *arg, json_t *delta, const char *finish, tdm_buf_t *b);

void resp_bind(resp_call_t *rc, oai_req_t *q)
{
    const char *hex = strchr(q->id, '-');
    snprintf(rc->id, sizeof rc->id, "resp_%.58s", hex ? hex + 1 : q->id);
    snprintf(q->id, sizeof q->id, "%s", rc->id);
    rc->created = q->created;
    q->on_delta = on_delta;
    q->delta_arg = rc;
}

/* ---- names ---- */

void resp_rename(const resp_call_t *rc, tdm_error_t *err)
{
    static const struct {
        const char *chat, *resp;
    } map[] = {
        {"max_completion_tokens", "max_output_tokens"},
        {"max_tokens", "max_output_tokens"},
        {"response_format.json_schema", "text.format"},
        {"response_format", "text.format"},
        {"tool_choice.function", "tool_choice"},
        {"reasoning_effort", "reasoning.effort"},
        {"messages", "input"},
    };
    const char *f = err->field;
    char to[TDM_ERRFIELD_MAX] = "";
    size_t from_len = 0;
    size_t n = 0;
    if (strncmp(f, "messages[", 9) == 0) {
        char *end = NULL;
        unsigned long k = strtoul(f + 9, &end, 10);
        const char *label = json_string_value(json_array_get(rc->labels, k));
        if (label && end && *end == ']') {
            from_len = (size_t)(end + 1 - f);
            snprintf(to, sizeof to, "%s", label);
        }
    } else if (strncmp(f, "tools[", 6) == 0 && (n = strcspn(f, "]")) && f[n] == ']' &&
               strncmp(f + n + 1, ".function", 9) == 0) {
        from_len = n + 10;
        snprintf(to, sizeof to, "%.*s", (int)(n + 1), f);
    } else {
        for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
            size_t l = strlen(map[i].chat);
            if (strncmp(f, map[i].chat, l) == 0 && (f[l] == '\0' || f[l] == '.' || f[l] == '[')) {
                from_len = l;
                snprintf(to, sizeof to, "%s", map[i].resp);
                break;
            }
        }
    }
    if (!from_len)
        return;
    char field[TDM_ERRFIELD_MAX], msg[TDM_ERRMSG_MAX];
    snprintf(field, sizeof field, "%s%s", to, f + from_len);
    /* the message names the field first when it is about it (tdm_error_t's rule) */
    if (strncmp(err->msg, f, strlen(f)) == 0)
        snprintf(msg, sizeof msg, "%s%s", field, err->msg + strlen(f));
    else if (strncmp(err->msg, f, from_len) == 0)
        snprintf(msg, sizeof msg, "%s%s", to, err->msg + from_len);
    else
        snprintf(msg, sizeof msg, "%s", err->msg);
    snprintf(err->field, sizeof err->field, "%s", field);
    snprintf(err->msg, sizeof err->msg, "%s", msg);
}

/* ---- the answer ---- */

static json_t *text_part(const char *text, size_t len)
{
    return json_pack("{s:s, s:o, s:[], s:[]}", "type", "output_text", "text",
                     http_json_text(text, len), "annotations", "logprobs");
}

static json_t *message_item(const resp_call_t *rc, size_t index, const char *text, size_t len,
                            const char *status)
{
    char id[96];
    snprintf(id, sizeof id, "msg_%s_%zu", rc->id + 5, index);
    json_t *content = json_array();
    if (content && text)
        json_array_append_new(content, text_part(text, len));
    return json_pack("{s:s, s:s, s:s, s:s, s:o}", "id", id, "type", "message", "role", "assistant",
                     "status", status, "content", content);
}

static json_t *reasoning_item(const resp_call_t *rc, size_t index, const char *text, size_t len,
                              const char *status)
{
    char id[96];
    snprintf(id, sizeof id, "rs_%s_%zu", rc->id + 5, index);
    json_t *content = json_array();
    if (content && text)
        json_array_append_new(content, json_pack("{s:s, s:o}", "type", "reasoning_text", "text",
                                                 http_json_text(text, len)));
    return json_pack("{s:s, s:s, s:[], s:o, s:s}", "id", id, "type", "reasoning", "summary",
                     "content", content, "status", status);
}

static json_t *call_item(const resp_call_t *rc, size_t index, const char *call_id, const char *name,
                         const char *args, const char *status)
{
    char id[96];
    snprintf(id, sizeof id, "fc_%s_%zu", rc->id + 5, index);
    return json_pack("{s:s, s:s, s:o, s:o, s:o, s:s}", "id", id, "type", "function_call", "call_id",
                     http_json_str(call_id), "name", http_json_str(name), "arguments",
                     http_json_str(args), "status", status);
}

/* output_tokens_details.reasoning_tokens: the reasoning text re-encoded with the model's
 * tokenizer (its think tags not counted; at most the output tokens), 0 without a tokenizer.
 * The engine counts tokens, not where the reasoning ends, so this is the count of the text. */
static uint32_t reasoning_tokens(const resp_call_t *rc, const oai_req_t *q, const oai_out_t *o,
                                 const char *text, size_t len)
{
    if (!len)
        return 0;
    int mi = tdm_config_model_index(rc->h->cfg, q->g.model);
    const tdm_tokenizer_t *tok = rc->h->vocabs[mi < 0 ? 0 : mi].tok;
    tdm_token_t *ids = NULL;
    size_t n = 0;
    tdm_error_t err = {0};
    if (!tok || tdm_tokenizer_encode(tok, text, len, false, false, &ids, &n, &err) != TDM_OK)
        return 0;
    free(ids);
    return n < o->completion_tokens ? (uint32_t)n : o->completion_tokens;
}

static json_t *usage_json(const oai_out_t *o, uint32_t reasoning_tokens)
{
    return json_pack("{s:i, s:{s:i}, s:i, s:{s:i}, s:i}", "input_tokens", (int)o->prompt_tokens,
                     "input_tokens_details", "cached_tokens", (int)o->cached_tokens,
                     "output_tokens", (int)o->completion_tokens, "output_tokens_details",
                     "reasoning_tokens", (int)reasoning_tokens, "total_tokens",
                     (int)(o->prompt_tokens + o->completion_tokens));
}

/* A request field echoed in the response, or dflt (consumed) when absent. */
static json_t *echo(const resp_call_t *rc, const char *key, json_t *dflt)
{
    json_t *v = json_object_get(rc->root, key);
    if (v) {
        json_decref(dflt);
        return json_incref(v);
    }
    return dflt;
}

/* The response object: status "in_progress", "completed", "incomplete" or "failed"; output
 * (consumed, NULL: []); usage (consumed, NULL: null); error (consumed, NULL: null). */
static json_t *response_json(const resp_call_t *rc, const oai_req_t *q, const char *status,
                             json_t *output, json_t *usage, json_t *error)
{
    json_t *effort = json_object_get(get(rc->root, "reasoning"), "effort");
    json_t *reasoning = json_pack("{s:O, s:n}", "effort", effort ? effort : json_null(), "summary");
    json_t *text = get(rc->root, "text") ? json_deep_copy(get(rc->root, "text"))
                                         : json_pack("{s:{s:s}}", "format", "type", "text");
    json_t *v = json_object();
    if (!v)
        goto oom;
    json_object_set_new(v, "id", json_string(rc->id));
    json_object_set_new(v, "object", json_string("response"));
    json_object_set_new(v, "created_at", json_integer(rc->created));
    json_object_set_new(v, "status", json_string(status));
    bool incomplete = strcmp(status, "incomplete") == 0;
    json_object_set_new(v, "error", error ? error : json_null());
    json_object_set_new(v, "incomplete_details",
                        incomplete ? json_pack("{s:s}", "reason", "max_output_tokens")
                                   : json_null());
    json_object_set_new(v, "instructions", echo(rc, "instructions", json_null()));
    json_object_set_new(v, "max_output_tokens", echo(rc, "max_output_tokens", json_null()));
    json_object_set_new(v, "model", http_json_str(q->model));
    json_object_set_new(v, "output", output ? output : json_array());
    json_object_set_new(v, "parallel_tool_calls", echo(rc, "parallel_tool_calls", json_true()));
    json_object_set_new(v, "previous_response_id", echo(rc, "previous_response_id", json_null()));
    json_object_set_new(v, "reasoning", reasoning ? reasoning : json_null());
    json_object_set_new(v, "store", json_boolean(rc->store));
    json_object_set_new(v, "temperature", echo(rc, "temperature", json_real(1.0)));
    json_object_set_new(v, "text", text ? text : json_null());
    json_object_set_new(v, "tool_choice", echo(rc, "tool_choice", json_string("auto")));
    json_object_set_new(v, "tools", echo(rc, "tools", json_array()));
    json_object_set_new(v, "top_p", echo(rc, "top_p", json_real(1.0)));
    json_object_set_new(v, "truncation", json_string("disabled"));
    json_object_set_new(v, "usage", usage ? usage : json_null());
    json_object_set_new(v, "user", echo(rc, "user", json_null()));
    json_object_set_new(v, "metadata", echo(rc, "metadata", json_object()));
    return v;
oom:
    json_decref(output);
    json_decref(usage);
    json_decref(error);
    json_decref(reasoning);
    json_decref(text);
    return NULL;
}

/* Stores the response v and the conversation it ends, when the request asked for it. */
static void store_response(resp_call_t *rc, json_t *v)
{
    if (!rc->store || !v || rc->h->cfg->router.responses_store_max == 0)
        return; /* router.responses_store_max 0: the operator keeps none */
    json_t *conv = json_copy(rc->conv);
    if (conv)
        json_array_extend(conv, json_object_get(v, "output"));
    char *resp_text = json_dumps(v, JSON_COMPACT);
    char *conv_text = conv ? json_dumps(conv, JSON_COMPACT) : NULL;
    int st = resp_text && conv_text ? resp_store_put(rc->h->responses, rc->id, resp_text, conv_text)
                                    : TDM_ERESOURCE;
    if (st != TDM_OK)
        tdm_log_write(&rc->h->log, TDM_LOG_WARN, rc->id, NULL, "response not stored (%s): %s",
                      tdm_status_name(st),
                      st == TDM_EINVALID ? "larger than router.responses_store_bytes"
                                         : "out of memory");
    free(resp_text);
    free(conv_text);
    json_decref(conv);
}

static bool finished_by_length(const resp_call_t *rc)
{
    return strcmp(rc->finish, "length") == 0;
}

/* ---- the stream ---- */

/* Appends "event: TYPE\ndata: {…, "type", "sequence_number"}\n\n" of ev (consumed). */
static int emit(resp_call_t *rc, tdm_buf_t *b, const char *type, json_t *ev)
{
    if (!ev)
        return TDM_ERESOURCE;
    json_object_set_new(ev, "type", json_string(type));
    json_object_set_new(ev, "sequence_number", json_integer((json_int_t)rc->seq++));
    int st = tdm_buf_append(b, "event: ", 7);
    if (st == TDM_OK)
        st = tdm_buf_append(b, type, strlen(type));
    if (st == TDM_OK)
        st = tdm_buf_append(b, "\ndata: ", 7);
    if (st == TDM_OK)
        st = http_json_append(b, ev);
    if (st == TDM_OK)
        st = tdm_buf_append(b, "\n\n", 2);
    json_decref(ev);
    return st;
}

static const char *item_id(json_t *item)
{
    return json_string_value(json_object_get(item, "id"));
}

/* output_item.added of item (a reference kept by the caller) at the next output index, once
 * the item before it is closed. */
static int item_added(resp_call_t *rc, tdm_buf_t *b, json_t *item, size_t *index)
{
    *index = json_array_size(rc->output); /* none is open: the one before is closed */
    return emit(rc, b, "response.output_item.added",
                json_pack("{s:i, s:O}", "output_index", (int)*index, "item", item));
}

/* Closes the open item: its done events, then it joins the output. */
static int close_open(resp_call_t *rc, tdm_buf_t *b)
{
    int st = TDM_OK;
    const char *status = finished_by_length(rc) ? "incomplete" : "completed";
    json_t *item = NULL;
    size_t idx = rc->open_index;
    const char *text = rc->open_text.data ? rc->open_text.data : "";
    size_t len = rc->open_text.len;
    if (rc->open == RESP_OPEN_REASONING || rc->open == RESP_OPEN_MESSAGE) {
        bool msg = rc->open == RESP_OPEN_MESSAGE;
        const char *id = item_id(rc->open_item);
        json_t *part = msg ? text_part(text, len)
                           : json_pack("{s:s, s:o}", "type", "reasoning_text", "text",
                                       http_json_text(text, len));
        st = emit(rc, b, msg ? "response.output_text.done" : "response.reasoning_text.done",
                  msg ? json_pack("{s:s, s:i, s:i, s:o, s:[]}", "item_id", id, "output_index",
                                  (int)idx, "content_index", 0, "text", http_json_text(text, len),
                                  "logprobs")
                      : json_pack("{s:s, s:i, s:i, s:o}", "item_id", id, "output_index", (int)idx,
                                  "content_index", 0, "text", http_json_text(text, len)));
        if (st == TDM_OK)
            st = emit(rc, b, "response.content_part.done",
                      json_pack("{s:s, s:i, s:i, s:O}", "item_id", id, "output_index", (int)idx,
                                "content_index", 0, "part", part));
        item = msg ? message_item(rc, idx, text, len, status)
                   : reasoning_item(rc, idx, text, len, status);
        json_decref(part);
    } else if (rc->open == RESP_OPEN_CALL) {
        json_t *c = rc->calls[rc->open_call].item;
        json_object_set_new(c, "status", json_string(status));
        st = emit(rc, b, "response.function_call_arguments.done",
                  json_pack("{s:s, s:i, s:O, s:O}", "item_id", item_id(c), "output_index", (int)idx,
                            "arguments", json_object_get(c, "arguments"), "name",
                            json_object_get(c, "name")));
        item = json_incref(c);
    } else {
        return TDM_OK;
    }
    if (st == TDM_OK && item)
        st = emit(rc, b, "response.output_item.done",
                  json_pack("{s:i, s:O}", "output_index", (int)idx, "item", item));
    if (!item || json_array_append_new(rc->output, item) != 0)
        st = TDM_ERESOURCE;
    json_decref(rc->open_item);
    rc->open_item = NULL;
    tdm_buf_clear(&rc->open_text);
    rc->open = RESP_OPEN_NONE;
    return st;
}

/* Opens a reasoning or message item (closing another open one). */
static int open_text_item(resp_call_t *rc, tdm_buf_t *b, resp_open_t kind)
{
    if (rc->open == kind)
        return TDM_OK;
    int st = close_open(rc, b);
    if (st != TDM_OK)
        return st;
    bool msg = kind == RESP_OPEN_MESSAGE;
    size_t idx = json_array_size(rc->output);
    json_t *item = msg ? message_item(rc, idx, NULL, 0, "in_progress")
                       : reasoning_item(rc, idx, NULL, 0, "in_progress");
    if (!item)
        return TDM_ERESOURCE;
    st = item_added(rc, b, item, &idx);
    rc->open = kind;
    rc->open_item = item;
    rc->open_index = idx;
    json_t *part =
        msg ? text_part("", 0) : json_pack("{s:s, s:s}", "type", "reasoning_text", "text", "");
    if (st == TDM_OK)
        st = emit(rc, b, "response.content_part.added",
                  json_pack("{s:s, s:i, s:i, s:o}", "item_id", item_id(item), "output_index",
                            (int)idx, "content_index", 0, "part", part));
    return st;
}

static int text_delta(resp_call_t *rc, tdm_buf_t *b, resp_open_t kind, json_t *s)
{
    if (!json_is_string(s) || json_string_length(s) == 0)
        return TDM_OK;
    int st = open_text_item(rc, b, kind);
    if (st != TDM_OK)
        return st;
    tdm_buf_append(&rc->open_text, json_string_value(s), json_string_length(s));
    if (kind == RESP_OPEN_REASONING)
        tdm_buf_append(&rc->thought, json_string_value(s), json_string_length(s));
    bool msg = kind == RESP_OPEN_MESSAGE;
    json_t *ev = json_pack("{s:s, s:i, s:i, s:O}", "item_id", item_id(rc->open_item),
                           "output_index", (int)rc->open_index, "content_index", 0, "delta", s);
    if (ev && msg)
        json_object_set_new(ev, "logprobs", json_array());
    return emit(rc, b, msg ? "response.output_text.delta" : "response.reasoning_text.delta", ev);
}

/* One chat tool-call delta ({index, id?, function: {name?, arguments?}}). */
static int call_delta(resp_call_t *rc, tdm_buf_t *b, json_t *d)
{
    size_t k = (size_t)json_integer_value(json_object_get(d, "index"));
    json_t *fn = json_object_get(d, "function");
    json_t *id = json_object_get(d, "id");
    int st = TDM_OK;
    if (json_is_string(id)) { /* a new call */
        if (k >= rc->n_calls) {
            resp_stream_call_t *grown = realloc(rc->calls, (k + 1) * sizeof *grown);
            if (!grown)
                return TDM_ERESOURCE;
            memset(grown + rc->n_calls, 0, (k + 1 - rc->n_calls) * sizeof *grown);
            rc->calls = grown;
            rc->n_calls = k + 1;
        }
        if ((st = close_open(rc, b)) != TDM_OK)
            return st;
        size_t idx = json_array_size(rc->output);
        json_t *item = call_item(rc, idx, json_string_value(id),
                                 json_string_value(json_object_get(fn, "name")), "", "in_progress");
        if (!item)
            return TDM_ERESOURCE;
        json_decref(rc->calls[k].item);
        rc->calls[k].item = item;
        st = item_added(rc, b, item, &idx);
        rc->calls[k].output_index = idx;
        rc->open = RESP_OPEN_CALL;
        rc->open_call = k;
        rc->open_index = idx;
    }
    json_t *args = json_object_get(fn, "arguments");
    if (st != TDM_OK || k >= rc->n_calls || !rc->calls[k].item || !json_is_string(args) ||
        json_string_length(args) == 0)
        return st;
    json_t *item = rc->calls[k].item;
    tdm_buf_t t = TDM_BUF_INIT;
    const char *had = json_string_value(json_object_get(item, "arguments"));
    tdm_buf_append(&t, had ? had : "", had ? strlen(had) : 0);
    tdm_buf_append(&t, json_string_value(args), json_string_length(args));
    json_object_set_new(item, "arguments", http_json_text(t.data ? t.data : "", t.len));
    tdm_buf_free(&t);
    return emit(rc, b, "response.function_call_arguments.delta",
                json_pack("{s:s, s:i, s:O}", "item_id", item_id(item), "output_index",
                          (int)rc->calls[k].output_index, "delta", args));
}

/* q->on_delta: a chat delta of the answer (consumed; NULL with finish set: the finish). */
static int on_delta(void *arg, json_t *delta, const char *finish, tdm_buf_t *b)
{
    resp_call_t *rc = arg;
    int st = TDM_OK;
    if (delta) {
        st = text_delta(rc, b, RESP_OPEN_REASONING, json_object_get(delta, "reasoning_content"));
        if (st == TDM_OK)
            st = text_delta(rc, b, RESP_OPEN_MESSAGE, json_object_get(delta, "content"));
        size_t i;
        json_t *d;
        json_array_foreach(json_object_get(delta, "tool_calls"), i, d)
        {
            if (st == TDM_OK)
                st = call_delta(rc, b, d);
        }
        json_decref(delta);
    }
    if (finish)
        snprintf(rc->finish, sizeof rc->finish, "%s", finish);
    return st;
}

/* The end of the output: the open item closed; a message, empty when nothing was said, when
 * the output holds neither a message nor a function call. */
static int close_output(resp_call_t *rc, tdm_buf_t *b)
{
    int st = close_open(rc, b);
    bool any = false;
    size_t i;
    json_t *item;
    json_array_foreach(rc->output, i, item)
    {
        const char *ty = json_string_value(json_object_get(item, "type"));
        any = any || strcmp(ty, "message") == 0 || strcmp(ty, "function_call") == 0;
    }
    if (st == TDM_OK && !any) {
        st = open_text_item(rc, b, RESP_OPEN_MESSAGE);
        if (st == TDM_OK)
            st = close_open(rc, b);
    }
    return st;
}

/* The finished response of the closed output rc->output (copied), stored when asked: the one
 * object stream=false answers, response.completed carries and GET /v1/responses/{id} gives.
 * NULL on out of memory. */
static json_t *finished_response(resp_call_t *rc, const oai_req_t *q, const oai_out_t *o)
{
    bool incomplete = finished_by_length(rc);
    uint32_t n_thought = reasoning_tokens(rc, q, o, rc->thought.data, rc->thought.len);
    json_t *v = response_json(rc, q, incomplete ? "incomplete" : "completed",
                              json_deep_copy(rc->output), usage_json(o, n_thought), NULL);
    store_response(rc, v);
    return v;
}

int resp_sse_begin(resp_call_t *rc, const oai_req_t *q, tdm_buf_t *b)
{
    int st =
        emit(rc, b, "response.created",
             json_pack("{s:o}", "response", response_json(rc, q, "in_progress", NULL, NULL, NULL)));
    if (st == TDM_OK)
        st = emit(
            rc, b, "response.in_progress",
            json_pack("{s:o}", "response", response_json(rc, q, "in_progress", NULL, NULL, NULL)));
    return st;
}

int resp_sse_end(resp_call_t *rc, const oai_req_t *q, const oai_out_t *o, int status,
                 const char *message, tdm_buf_t *b)
{
    if (status != TDM_OK) {
        /* ResponseError.code is one of OpenAI's values: rate_limit_exceeded for a refusal
         * for load, server_error for the rest */
        const char *code = status == TDM_EUNAVAILABLE || status == TDM_ERESOURCE
                               ? "rate_limit_exceeded"
                               : "server_error";
        json_t *output = json_deep_copy(rc->output);
        return emit(rc, b, "response.failed",
                    json_pack("{s:o}", "response",
                              response_json(rc, q, "failed", output, usage_json(o, 0),
                                            json_pack("{s:s, s:o}", "code", code, "message",
                                                      http_json_str(message && message[0]
                                                                        ? message
                                                                        : tdm_strerror(status))))));
    }
    int st = close_output(rc, b);
    if (st != TDM_OK)
        return st;
    json_t *v = finished_response(rc, q, o);
    return emit(rc, b, finished_by_length(rc) ? "response.incomplete" : "response.completed",
                v ? json_pack("{s:o}", "response", v) : NULL);
}

json_t *resp_whole(resp_call_t *rc, const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch)
{
    /* the whole answer is one chunk through the chat stream's parsers and this stream's item
     * writer (q->on_delta), its events dropped: rc->output then holds the items a stream of
     * the same text gives, in the same order with the same ids */
    tdm_buf_t events = TDM_BUF_INIT;
    int st = oai_sse_chunk(q, o, ch, &events);
    if (st == TDM_OK)
        st = close_output(rc, &events);
    tdm_buf_free(&events);
    return st == TDM_OK ? finished_response(rc, q, o) : NULL;
}

/* ---- GET and DELETE /v1/responses/{id} ---- */

enum MHD_Result http_responses_item(tdm_http_t *h, struct MHD_Connection *c, const char *id,
                                    bool del)
{
    enum MHD_Result ret;
    if (!http_check_key(h, c, &ret))
        return ret;
    static const char why[] = "(never made here, made with store false, evicted or deleted); "
                              "response ids are per router: ask the router that made it";
    if (del) {
        if (!resp_store_delete(h->responses, id))
            return http_reply_error(c, TDM_ENOTFOUND, "response_not_found", "response_id",
                                    "no response '%.80s' is stored on this router %s", id, why);
        return http_reply_json(
            c, 200, json_pack("{s:s, s:s, s:b}", "id", id, "object", "response", "deleted", 1));
    }
    char *text = NULL;
    int st = resp_store_get(h->responses, id, &text, NULL);
    if (st == TDM_ENOTFOUND)
        return http_reply_error(c, TDM_ENOTFOUND, "response_not_found", "response_id",
                                "no response '%.80s' is stored on this router %s", id, why);
    json_t *v = st == TDM_OK ? json_loads(text, 0, NULL) : NULL;
    free(text);
    return http_reply_json(c, 200, v);
}
