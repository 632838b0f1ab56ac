/* chat_jinja.c - Jinja chat templates (tandem/chat.h): picking a model's template and
 * rendering it with the variables transformers' apply_chat_template passes.
 *
 * The renderer is tandem/jinja.h (byte-equal to jinja2 on llama.cpp's 70 templates); this file
 * only builds its inputs: the messages as JSON (tool-call arguments parsed into objects, as
 * transformers and vLLM hand them over), tools, bos/eos texts and the request's kwargs.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/chat.h"

static const tdm_jinja_options_t HF_OPTIONS = {.trim_blocks = true, .lstrip_blocks = true};

tdm_jinja_t *tdm_chat_jinja_compile(const char *src, size_t len, tdm_error_t *err)
{
    if (len > TDM_CHAT_TEMPLATE_MAX_BYTES) {
        tdm_error_set(err, TDM_EINVALID, "the template has %zu bytes, more than the limit of %d",
                      len, TDM_CHAT_TEMPLATE_MAX_BYTES);
        return NULL;
    }
    return tdm_jinja_new(src, len, "chat_template", &HF_OPTIONS, err);
}

/* The text of token id (the vocabulary string, as transformers' bos_token holds it) into buf;
 * "" when the id is -1 or the text does not fit. */
static void token_text(const tdm_tokenizer_t *tok, tdm_token_t id, char *buf, size_t cap)
{
    size_t len = 0;
    const char *p = tok && id >= 0 ? tdm_tokenizer_piece(tok, id, &len) : NULL;
    if (!p || len + 1 > cap)
        len = 0;
    if (len)
        memcpy(buf, p, len);
    buf[len] = '\0';
}

void tdm_chat_pick_release(tdm_chat_pick_t *pick)
{
    if (pick)
        tdm_jinja_destroy(&pick->jinja);
}

/* Reads and compiles the template file path into out->jinja. */
static int pick_file(const char *path, tdm_chat_pick_t *out, tdm_error_t *err)
{
    char *src = NULL;
    size_t len = 0;
    int rc = tdm_read_file(path, TDM_CHAT_TEMPLATE_MAX_BYTES, &src, &len, err);
    if (rc != TDM_OK)
        return tdm_error_prefix(err, rc,
                                "chat template '%s' is not a built-in name (%s) nor a readable "
                                "template file of at most %d bytes: ",
                                path, TDM_CHAT_TEMPLATE_NAMES, TDM_CHAT_TEMPLATE_MAX_BYTES);
    out->jinja = tdm_chat_jinja_compile(src, len, err);
    free(src);
    if (!out->jinja) {
        tdm_error_prefix(err, err ? err->code : TDM_EINVALID, "%s", path);
        return tdm_error_field(err, "chat_template");
    }
    snprintf(out->origin, sizeof out->origin, "file");
    return TDM_OK;
}

/* The model's own tokenizer.chat_template when it has one: compiled into out->jinja and *found
 * set; *found false when the key is absent. */
static int pick_gguf(const tdm_gguf_t *g, tdm_chat_pick_t *out, bool *found, tdm_error_t *err)
{
    tdm_gguf_str_t s;
    tdm_error_t kv_err = {0};
    *found = false;
    int rc = tdm_gguf_get_str(g, "tokenizer.chat_template", &s, &kv_err);
    if (rc != TDM_OK)
        return TDM_OK; /* absent or not a string: the built-in families decide */
    *found = true;
    out->jinja = tdm_chat_jinja_compile(s.data, (size_t)s.len, err);
    if (!out->jinja) {
        tdm_error_prefix(err, err ? err->code : TDM_EINVALID,
                         "the model's tokenizer.chat_template does not compile (set "
                         "model.chat_template or --chat-template to a built-in name (%s) or a "
                         "template file to serve it anyway): ",
                         TDM_CHAT_TEMPLATE_NAMES);
        return tdm_error_field(err, "tokenizer.chat_template");
    }
    snprintf(out->origin, sizeof out->origin, "gguf");
    return TDM_OK;
}

/* A built-in family named by the override: the model's default system message is kept only
 * when the model's own template is of that family (it was written for it). */
static void pick_named(const tdm_gguf_t *g, tdm_chat_template_t named, tdm_chat_pick_t *out)
{
    tdm_chat_template_t detected;
    tdm_error_t ignored = {0};
    out->tmpl = named;
    if (tdm_chat_template_detect(g, &detected, out->default_system, sizeof out->default_system,
                                 &ignored) != TDM_OK ||
        detected != named)
        out->default_system[0] = '\0';
    snprintf(out->origin, sizeof out->origin, "%s", tdm_chat_template_name(named));
}

int tdm_chat_template_pick(const tdm_gguf_t *g, const tdm_tokenizer_t *tok, const char *override,
                           tdm_chat_pick_t *out, tdm_error_t *err)
{
    memset(out, 0, sizeof *out);
    token_text(tok, tok ? tdm_tokenizer_bos(tok) : -1, out->bos_token, sizeof out->bos_token);
    token_text(tok, tok ? tdm_tokenizer_eos(tok) : -1, out->eos_token, sizeof out->eos_token);
    tdm_chat_template_t named;
    if (override && tdm_chat_template_from_name(override, &named, NULL) == TDM_OK) {
        pick_named(g, named, out);
        return TDM_OK;
    }
    if (override)
        return pick_file(override, out, err);
    bool found;
    int rc = pick_gguf(g, out, &found, err);
    if (rc != TDM_OK || found)
        return rc;
    rc = tdm_chat_template_detect(g, &out->tmpl, out->default_system, sizeof out->default_system,
                                  err);
    if (rc == TDM_OK)
        snprintf(out->origin, sizeof out->origin, "%s", tdm_chat_template_name(out->tmpl));
    return rc;
}

int tdm_chat_template_check(const char *override, tdm_error_t *err)
{
    tdm_chat_template_t named;
    if (tdm_chat_template_from_name(override, &named, NULL) == TDM_OK)
        return TDM_OK;
    tdm_chat_pick_t pick;
    memset(&pick, 0, sizeof pick);
    int rc = pick_file(override, &pick, err);
    tdm_chat_pick_release(&pick);
    return rc;
}

/* ---- the variables ---- */

/* One tool call with its function.arguments parsed from JSON text into a value (transformers
 * templates write `tool_call.arguments | tojson`); text that does not parse stays a string. */
static void parse_arguments(json_t *call)
{
    json_t *fn = json_object_get(call, "function");
    json_t *args = json_object_get(fn, "arguments");
    if (!json_is_string(args))
        return;
    json_t *v = json_loadb(json_string_value(args), json_string_length(args),
                           JSON_DECODE_ANY | JSON_ALLOW_NUL, NULL);
    if (v)
        json_object_set_new(fn, "arguments", v);
}

/* The checks every template gets, as the built-in ones make them: a known role, content
 * unless an assistant message calls tools, tool_calls only on assistant messages. Where each
 * role may stand is the template's business (many raise_exception on what they refuse). */
static int message_check(const tdm_chat_message_t *m, size_t i, tdm_error_t *err)
{
    static const char *const names[] = {"system", "user", "assistant", "tool"};
    bool known = false;
    for (size_t k = 0; m->role && k < sizeof names / sizeof names[0]; k++)
        known |= strcmp(m->role, names[k]) == 0;
    if (!m->role)
        return tdm_error_set(err, TDM_EINVALID, "message %zu has no role", i);
    if (!known)
        return tdm_error_set(err, TDM_EINVALID,
                             "message %zu has role '%.32s'; expected system, user, assistant or "
                             "tool",
                             i, m->role);
    bool calls = m->tool_calls && m->tool_calls[0];
    bool assistant = strcmp(m->role, "assistant") == 0;
    if (!m->content && !(assistant && calls))
        return tdm_error_set(err, TDM_EINVALID, "message %zu (role '%.32s') has no content", i,
                             m->role);
    if (calls && !assistant)
        return tdm_error_set(err, TDM_EINVALID,
                             "message %zu has role '%s'; only assistant messages have tool_calls",
                             i, m->role);
    return TDM_OK;
}

/* msgs[i] as the JSON object the template sees. */
static int message_json(const tdm_chat_message_t *m, size_t i, json_t **out, tdm_error_t *err)
{
    int rc = message_check(m, i, err);
    if (rc != TDM_OK)
        return rc;
    json_t *o = json_object();
    if (!o)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    int bad = json_object_set_new(o, "role", json_string(m->role ? m->role : ""));
    bad |= json_object_set_new(o, "content", m->content ? json_string(m->content) : json_null());
    if (m->tool_calls && m->tool_calls[0]) {
        json_t *calls = json_loads(m->tool_calls, JSON_DECODE_ANY, NULL);
        if (!json_is_array(calls)) {
            json_decref(calls);
            json_decref(o);
            return tdm_error_set(err, TDM_EINVALID,
                                 "messages[%zu].tool_calls: not a JSON array of tool calls", i);
        }
        size_t k;
        json_t *call;
        json_array_foreach(calls, k, call) parse_arguments(call);
        bad |= json_object_set_new(o, "tool_calls", calls);
    }
    if (m->tool_call_id && m->tool_call_id[0])
        bad |= json_object_set_new(o, "tool_call_id", json_string(m->tool_call_id));
    if (m->name && m->name[0])
        bad |= json_object_set_new(o, "name", json_string(m->name));
    if (m->reasoning_content && m->reasoning_content[0])
        bad |= json_object_set_new(o, "reasoning_content", json_string(m->reasoning_content));
    if (bad) {
        json_decref(o);
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    *out = o;
    return TDM_OK;
}

/* The messages array. */
static int messages_json(const tdm_chat_jinja_input_t *in, json_t *ctx, tdm_error_t *err)
{
    json_t *arr = json_array();
    if (!arr || json_object_set_new(ctx, "messages", arr) != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    for (size_t i = 0; i < in->n; i++) {
        json_t *m = NULL;
        int rc = message_json(&in->msgs[i], i, &m, err);
        if (rc != TDM_OK)
            return rc;
        if (json_array_append_new(arr, m) != 0)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    return TDM_OK;
}

/* kwargs' members into ctx; messages and tools come from the request's own fields. */
static int merge_kwargs(const json_t *kwargs, json_t *ctx, tdm_error_t *err)
{
    if (!kwargs)
        return TDM_OK;
    if (!json_is_object(kwargs))
        return tdm_error_set(err, TDM_EINVALID, "chat_template_kwargs: must be a JSON object");
    static const char *const reserved[] = {"messages", "tools"};
    for (size_t i = 0; i < sizeof reserved / sizeof reserved[0]; i++)
        if (json_object_get(kwargs, reserved[i]))
            return tdm_error_set(err, TDM_EINVALID,
                                 "chat_template_kwargs.%s: is set by the request's own %s field",
                                 reserved[i], reserved[i]);
    if (json_object_update(ctx, (json_t *)kwargs) != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    return TDM_OK;
}

/* The whole context of one rendering into *out (caller decrefs). */
static int context_json(const tdm_chat_jinja_input_t *in, json_t **out, tdm_error_t *err)
{
    json_t *ctx = json_object();
    if (!ctx)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    int rc = messages_json(in, ctx, err);
    json_t *tools = json_null();
    if (rc == TDM_OK && in->tools && in->tools[0]) {
        json_decref(tools);
        tools = json_loads(in->tools, JSON_DECODE_ANY, NULL);
        if (!json_is_array(tools))
            rc = tdm_error_set(err, TDM_EINVALID, "tools: not a JSON array of tools");
    }
    if (rc == TDM_OK) {
        int bad = json_object_set(ctx, "tools", tools);
        bad |= json_object_set_new(ctx, "documents", json_null());
        bad |= json_object_set_new(ctx, "add_generation_prompt",
                                   json_boolean(in->add_generation_prompt));
        bad |=
            json_object_set_new(ctx, "bos_token", json_string(in->bos_token ? in->bos_token : ""));
        bad |=
            json_object_set_new(ctx, "eos_token", json_string(in->eos_token ? in->eos_token : ""));
        if (bad)
            rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    json_decref(tools);
    if (rc == TDM_OK)
        rc = merge_kwargs(in->kwargs, ctx, err);
    if (rc != TDM_OK) {
        json_decref(ctx);
        return rc;
    }
    *out = ctx;
    return TDM_OK;
}

int tdm_chat_apply_jinja(const tdm_jinja_t *tmpl, const tdm_chat_jinja_input_t *in, char **out,
                         size_t *out_len, bool *raised, tdm_error_t *err)
{
    *out = NULL;
    if (raised)
        *raised = false;
    json_t *ctx;
    int rc = context_json(in, &ctx, err);
    if (rc != TDM_OK)
        return rc;
    tdm_jinja_render_options_t ro = {.now = in->now};
    size_t len = 0;
    bool by_template = false;
    rc = tdm_jinja_render(tmpl, ctx, &ro, out, &len, &by_template, err);
    if (raised)
        *raised = by_template;
    json_decref(ctx);
    /* every render failure is the template's or its input's: a limit it passed included (the
     * memory a rendering may use is bounded by the output limit, tandem/jinja.h) */
    if (rc != TDM_OK) {
        if (!by_template) /* raise_exception's message stays exactly the template's */
            tdm_error_prefix(err, TDM_EINVALID, "chat template: ");
        if (err)
            err->code = TDM_EINVALID;
        return TDM_EINVALID;
    }
    if (out_len)
        *out_len = len;
    return TDM_OK;
}
