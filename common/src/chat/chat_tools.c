/* chat_tools.c - tool definitions and tool calls rendered in the Hermes format (Qwen2.5's
 * ChatML template): the text the chat templates put in the system message and in an
 * assistant turn that called tools.
 *
 * JSON is re-written with jansson's default separators (", " and ": ") and the keys in the
 * order given, which is what Jinja's tojson (Python's json.dumps) writes for the same value.
 */
#include "chat_tools.h"

#include "tandem/chat.h"

#include <jansson.h>
#include <stdlib.h>
#include <string.h>

static const char tools_intro[] =
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>";
static const char tools_outro[] =
    "\n</tools>\n\nFor each function call, return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";

/* Appends v as Python's json.dumps(v, ensure_ascii=False) writes it. */
static int dump_python(tdm_buf_t *sb, const json_t *v)
{
    char *s = json_dumps(v, JSON_ENCODE_ANY);
    if (!s)
        return TDM_ERESOURCE;
    int rc = tdm_buf_puts(sb, s);
    free(s);
    return rc;
}

static json_t *load_array(const char *text, const char *what, size_t index, tdm_error_t *err)
{
    json_error_t jerr;
    json_t *v = json_loads(text, 0, &jerr);
    if (!v || !json_is_array(v)) {
        if (v)
            json_decref(v);
        if (strcmp(what, "tools") == 0)
            tdm_error_set(err, TDM_EINVALID, "tools must be a JSON array of tool objects%s%s",
                          v ? "" : ": ", v ? "" : jerr.text);
        else
            tdm_error_set(err, TDM_EINVALID,
                          "message %zu: tool_calls must be a JSON array of calls%s%s", index,
                          v ? "" : ": ", v ? "" : jerr.text);
        return NULL;
    }
    return v;
}

int chat_tools_block(const char *tools, tdm_buf_t *sb, tdm_error_t *err)
{
    json_t *a = load_array(tools, "tools", 0, err);
    if (!a)
        return TDM_EINVALID;
    int rc = tdm_buf_puts(sb, tools_intro);
    size_t i;
    json_t *tool;
    json_array_foreach(a, i, tool)
    {
        if (!json_is_object(tool)) {
            rc = tdm_error_set(err, TDM_EINVALID, "tools[%zu] must be an object", i);
            break;
        }
        if (rc == TDM_OK)
            rc = tdm_buf_puts(sb, "\n");
        if (rc == TDM_OK)
            rc = dump_python(sb, tool);
    }
    if (rc == TDM_OK)
        rc = tdm_buf_puts(sb, tools_outro);
    json_decref(a);
    if (rc == TDM_ERESOURCE)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering the tools");
    return rc;
}

/* ARGS of one call: the arguments JSON text re-written, or as a JSON string when it does not
 * parse; an object given as is (some clients send one) is written as it is. */
static int append_arguments(tdm_buf_t *sb, const json_t *args)
{
    if (!args || json_is_null(args))
        return tdm_buf_puts(sb, "{}");
    if (!json_is_string(args))
        return dump_python(sb, args);
    json_t *parsed =
        json_loadb(json_string_value(args), json_string_length(args), JSON_DECODE_ANY, NULL);
    int rc = dump_python(sb, parsed ? parsed : args);
    if (parsed)
        json_decref(parsed);
    return rc;
}

int chat_tool_calls_text(const char *tool_calls, size_t index, tdm_buf_t *sb, tdm_error_t *err)
{
    json_t *a = load_array(tool_calls, "tool_calls", index, err);
    if (!a)
        return TDM_EINVALID;
    int rc = TDM_OK;
    size_t i;
    json_t *call;
    json_array_foreach(a, i, call)
    {
        /* OpenAI's {"function": {"name", "arguments"}}, or the function object itself */
        json_t *fn = json_object_get(call, "function");
        if (!fn)
            fn = call;
        const char *name = json_string_value(json_object_get(fn, "name"));
        if (!json_is_object(call) || !name) {
            rc = tdm_error_set(err, TDM_EINVALID,
                               "message %zu: tool_calls[%zu].function.name must be a string", index,
                               i);
            break;
        }
        if (rc == TDM_OK)
            rc = tdm_buf_puts(sb, "\n<tool_call>\n{\"name\": \"");
        if (rc == TDM_OK)
            rc = tdm_buf_puts(sb, name);
        if (rc == TDM_OK)
            rc = tdm_buf_puts(sb, "\", \"arguments\": ");
        if (rc == TDM_OK)
            rc = append_arguments(sb, json_object_get(fn, "arguments"));
        if (rc == TDM_OK)
            rc = tdm_buf_puts(sb, "}\n</tool_call>");
    }
    json_decref(a);
    if (rc == TDM_ERESOURCE)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering tool calls");
    return rc;
}

void tdm_chat_inline_release(tdm_chat_inline_t *in)
{
    if (!in)
        return;
    for (size_t i = 0; i < in->n_texts; i++)
        free(in->texts[i]);
    free(in->texts);
    free(in->msgs);
    memset(in, 0, sizeof *in);
}

/* Keeps text (heap, or NULL: out of memory) in out; returns it. */
static const char *keep_text(tdm_chat_inline_t *out, char *text)
{
    if (text)
        out->texts[out->n_texts++] = text;
    return text;
}

/* The system message: its text (or none), "\n\n" when it is not empty, the tools block. */
static const char *inline_system(const char *system, const char *tools, tdm_chat_inline_t *out,
                                 tdm_error_t *err)
{
    tdm_buf_t sb = TDM_BUF_INIT;
    if (system && system[0]) {
        tdm_buf_puts(&sb, system);
        tdm_buf_puts(&sb, "\n\n");
    }
    if (chat_tools_block(tools, &sb, err) != TDM_OK) {
        tdm_buf_free(&sb);
        return NULL;
    }
    const char *t = keep_text(out, tdm_buf_take(&sb));
    if (!t)
        tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering the tools");
    return t;
}

/* An assistant message's content with its tool calls after it (the calls' leading "\n"
 * dropped when there is no content, as the Hermes template writes the turn). */
static const char *inline_calls(const tdm_chat_message_t *m, size_t index, tdm_chat_inline_t *out,
                                tdm_error_t *err)
{
    tdm_buf_t sb = TDM_BUF_INIT;
    bool has_content = m->content && m->content[0];
    if (has_content)
        tdm_buf_puts(&sb, m->content);
    if (chat_tool_calls_text(m->tool_calls, index, &sb, err) != TDM_OK) {
        tdm_buf_free(&sb);
        return NULL;
    }
    char *t = tdm_buf_take(&sb);
    if (t && !has_content && t[0] == '\n')
        memmove(t, t + 1, strlen(t));
    if (!keep_text(out, t))
        tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering tool calls");
    return t;
}

/* The run of tool messages msgs[*i..] as one user message's text; *i moves past it. */
static const char *inline_results(const tdm_chat_message_t *msgs, size_t n, size_t *i,
                                  tdm_chat_inline_t *out, tdm_error_t *err)
{
    tdm_buf_t sb = TDM_BUF_INIT;
    for (bool first = true; *i < n && strcmp(msgs[*i].role, "tool") == 0; (*i)++, first = false) {
        tdm_buf_puts(&sb, first ? "<tool_response>\n" : "\n<tool_response>\n");
        tdm_buf_puts(&sb, msgs[*i].content ? msgs[*i].content : "");
        tdm_buf_puts(&sb, "\n</tool_response>");
    }
    const char *t = keep_text(out, tdm_buf_take(&sb));
    if (!t)
        tdm_error_set(err, TDM_ERESOURCE, "out of memory rendering tool results");
    return t;
}

int tdm_chat_tools_inline(const tdm_chat_message_t *msgs, size_t n, const char *tools,
                          tdm_chat_inline_t *out, tdm_error_t *err)
{
    memset(out, 0, sizeof *out);
    /* at most n + 1 messages (a system message added) and as many texts */
    out->msgs = calloc(n + 1, sizeof *out->msgs);
    out->texts = calloc(n + 1, sizeof *out->texts);
    if (!out->msgs || !out->texts) {
        tdm_chat_inline_release(out);
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    size_t i = 0;
    bool has_system = n > 0 && msgs[0].role && strcmp(msgs[0].role, "system") == 0;
    const char *sys = inline_system(has_system ? msgs[0].content : NULL, tools, out, err);
    if (!sys)
        goto fail;
    out->msgs[out->n++] = (tdm_chat_message_t){.role = "system", .content = sys};
    i = has_system ? 1 : 0;
    while (i < n) {
        const tdm_chat_message_t *m = &msgs[i];
        if (m->role && strcmp(m->role, "tool") == 0) {
            const char *t = inline_results(msgs, n, &i, out, err);
            if (!t)
                goto fail;
            out->msgs[out->n++] = (tdm_chat_message_t){.role = "user", .content = t};
            continue;
        }
        tdm_chat_message_t copy = *m;
        if (m->tool_calls && m->tool_calls[0]) {
            if (!(copy.content = inline_calls(m, i, out, err)))
                goto fail;
            copy.tool_calls = NULL;
        }
        out->msgs[out->n++] = copy;
        i++;
    }
    return TDM_OK;
fail:
    tdm_chat_inline_release(out);
    return err ? err->code : TDM_EINVALID;
}
