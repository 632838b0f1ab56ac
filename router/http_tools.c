/* http_tools.c - OpenAI tool calling in the HTTP gateway: tools / tool_choice /
 * parallel_tool_calls (and the legacy functions / function_call) into the router's request,
 * and generated Hermes-style calls back into OpenAI's tool_calls and delta.tool_calls.
 *
 * The model sees the tools through its chat template (tdm_chat_apply_tools, the Hermes format
 * Qwen2.5 and NousResearch's Hermes models use); it answers with
 * "<tool_call>\n{"name": …, "arguments": …}\n</tool_call>" blocks, which the parser below
 * finds in the text. tool_choice "required" or a named function constrains the output with a
 * grammar built from the functions' parameter schemas. A call is only reported once its
 * closing tag is generated and its JSON parses, so text that merely looks like a call stays
 * content; streamed, such calls arrive whole (a delta with id and name, then one with the
 * arguments). Constrained output (required / a named function) can only be calls, so there
 * the arguments stream as they are generated. An output cut by max_tokens (the parser's cut)
 * never gives the call it cut as content: that call is dropped, or, streamed incrementally,
 * kept with the arguments it had (docs/api.md "Tool calling"); the same non-streamed.
 *
 * Other families (http_family.h: Llama 3.x JSON, Mistral's [TOOL_CALLS] array and [ARGS]
 * forms) are parsed when the output ends, and their required / named grammars are written in
 * their own markup; every required grammar ends after OAI_TOOL_MAX_CALLS calls at most.
 */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "http.h"
#include "http_openai.h"
#include "http_json.h"
#include "tandem/json_schema.h"

#define TOOL_NAME_MAX 64 /* OpenAI: function names are [a-zA-Z0-9_-]{1,64} */

/* The field's value, or NULL when absent or null. */
static json_t *get(const json_t *o, const char *name)
{
    json_t *v = json_object_get(o, name);
    return v && !json_is_null(v) ? v : NULL;
}

static bool valid_name(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > TOOL_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '_' || c == '-'))
            return false;
    }
    return true;
}

/* ---- tools and tool_choice ---- */

typedef struct req_ctx {
    tdm_error_t *err;
} req_ctx_t;

/* The function object fn at path ("tools[1].function", "functions[0]") checked and, as
 * {"type": "function", "function": {name, description?, parameters?}}, appended to out. */
static int add_function(req_ctx_t *c, const json_t *fn, const char *path, json_t *out)
{
    char f[96];
    if (!json_is_object(fn))
        return tdm_error_set_field(c->err, TDM_EINVALID, path, "%s must be an object", path);
    const char *name = json_string_value(get(fn, "name"));
    snprintf(f, sizeof f, "%s.name", path);
    if (!name || !valid_name(name))
        return tdm_error_set_field(c->err, TDM_EINVALID, f,
                                   "%s must be a string of 1 to %d letters, digits, '_' or '-'", f,
                                   TOOL_NAME_MAX);
    size_t i;
    json_t *tool;
    json_array_foreach(out, i, tool)
    {
        if (strcmp(json_string_value(json_object_get(json_object_get(tool, "function"), "name")),
                   name) == 0)
            return tdm_error_set_field(c->err, TDM_EINVALID, f,
                                       "%s: the function '%s' is defined twice", f, name);
    }
    static const struct {
        const char *key;
        json_type type;
        const char *what;
    } opt[] = {{"description", JSON_STRING, "a string"},
               {"parameters", JSON_OBJECT, "an object (a JSON Schema)"},
               {"strict", JSON_TRUE, "a boolean"}};
    json_t *norm = json_pack("{s:s}", "name", name);
    for (size_t k = 0; norm && k < sizeof opt / sizeof opt[0]; k++) {
        json_t *v = get(fn, opt[k].key);
        bool ok =
            !v || json_typeof(v) == opt[k].type || (opt[k].type == JSON_TRUE && json_is_boolean(v));
        if (!ok) {
            json_decref(norm);
            snprintf(f, sizeof f, "%s.%s", path, opt[k].key);
            return tdm_error_set_field(c->err, TDM_EINVALID, f, "%s must be %s", f, opt[k].what);
        }
        /* strict is not forwarded: required / named calls always match the schema (the
         * grammar), auto calls are only checked to be JSON (docs/api.md) */
        if (v && opt[k].type != JSON_TRUE)
            json_object_set(norm, opt[k].key, v);
    }
    if (!norm || json_array_append_new(
                     out, json_pack("{s:s, s:o}", "type", "function", "function", norm)) != 0)
        return tdm_error_set(c->err, TDM_ERESOURCE, "out of memory");
    return TDM_OK;
}

/* tools (or the legacy functions) into the array out. */
static int parse_tool_list(req_ctx_t *c, json_t *root, json_t *out)
{
    json_t *tools = get(root, "tools"), *fns = get(root, "functions");
    if (tools && fns)
        return tdm_error_set_field(c->err, TDM_EINVALID, "functions",
                                   "functions: give tools or the legacy functions, not both");
    const char *name = tools ? "tools" : "functions";
    json_t *v = tools ? tools : fns;
    if (!v)
        return TDM_OK;
    if (!json_is_array(v))
        return tdm_error_set_field(c->err, TDM_EINVALID, name, "%s must be an array", name);
    if (json_array_size(v) > TDM_HTTP_MAX_TOOLS)
        return tdm_error_set_field(c->err, TDM_EINVALID, name,
                                   "%s has %zu entries; at most %u are served (OpenAI's limit)",
                                   name, json_array_size(v), TDM_HTTP_MAX_TOOLS);
    size_t i;
    json_t *e;
    json_array_foreach(v, i, e)
    {
        char path[64];
        int rc;
        if (fns) {
            snprintf(path, sizeof path, "functions[%zu]", i);
            rc = add_function(c, e, path, out);
        } else {
            snprintf(path, sizeof path, "tools[%zu].type", i);
            const char *type = json_string_value(get(e, "type"));
            if (!json_is_object(e) || !type || strcmp(type, "function") != 0)
                return tdm_error_set_field(
                    c->err, TDM_EINVALID, path,
                    "%s must be \"function\" (the only tool type Tandem serves)", path);
            snprintf(path, sizeof path, "tools[%zu].function", i);
            rc = add_function(c, get(e, "function"), path, out);
        }
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

static bool has_tool(const json_t *tools, const char *name)
{
    size_t i;
    json_t *tool;
    json_array_foreach(tools, i, tool)
    {
        const char *n =
            json_string_value(json_object_get(json_object_get(tool, "function"), "name"));
        if (n && strcmp(n, name) == 0)
            return true;
    }
    return false;
}

/* tool_choice (or the legacy function_call) into t->choice / t->named. */
static int parse_choice(req_ctx_t *c, json_t *root, const json_t *tools, oai_tools_t *t)
{
    const char *f = "tool_choice";
    json_t *v = get(root, f);
    if (!v && (v = get(root, "function_call")) != NULL)
        f = "function_call";
    t->choice = json_array_size(tools) > 0 ? OAI_TOOL_CHOICE_AUTO : OAI_TOOL_CHOICE_NONE;
    if (!v)
        return TDM_OK;
    const char *s = json_string_value(v);
    if (s && strcmp(s, "none") == 0)
        t->choice = OAI_TOOL_CHOICE_NONE;
    else if (s && strcmp(s, "auto") == 0)
        t->choice = json_array_size(tools) > 0 ? OAI_TOOL_CHOICE_AUTO : OAI_TOOL_CHOICE_NONE;
    else if (s && strcmp(s, "required") == 0 && strcmp(f, "tool_choice") == 0)
        t->choice = OAI_TOOL_CHOICE_REQUIRED;
    else if (json_is_object(v)) {
        /* tool_choice {"type": "function", "function": {"name"}}; function_call {"name"} */
        const json_t *fn = strcmp(f, "tool_choice") == 0 ? get(v, "function") : v;
        const char *name = json_string_value(get(fn, "name"));
        const char *type = json_string_value(get(v, "type"));
        if (!name || (strcmp(f, "tool_choice") == 0 && (!type || strcmp(type, "function") != 0)))
            return tdm_error_set_field(
                c->err, TDM_EINVALID, f,
                "%s must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                "\"function\": {\"name\": ...}}",
                f);
        if (!has_tool(tools, name))
            return tdm_error_set_field(c->err, TDM_EINVALID, f,
                                       "%s names the function '%.64s', which is not in tools", f,
                                       name);
        snprintf(t->named, sizeof t->named, "%s", name);
        t->choice = OAI_TOOL_CHOICE_NAMED;
    } else {
        return tdm_error_set_field(
            c->err, TDM_EINVALID, f,
            "%s must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
            "\"function\": {\"name\": ...}}",
            f);
    }
    if (t->choice == OAI_TOOL_CHOICE_REQUIRED && json_array_size(tools) == 0)
        return tdm_error_set_field(c->err, TDM_EINVALID, f, "%s \"required\" needs tools", f);
    return TDM_OK;
}

/* response_format and vLLM's guided decoding fields constrain the whole output, which leaves
 * no room for calls: refused together with active tools. */
static int check_conflicts(req_ctx_t *c, json_t *root)
{
    json_t *rf = get(root, "response_format");
    const char *type = json_string_value(get(rf, "type"));
    if (rf && (!type || strcmp(type, "text") != 0))
        return tdm_error_set_field(
            c->err, TDM_EINVALID, "response_format",
            "response_format %s cannot be combined with tools: both constrain the "
            "output (drop one, or set tool_choice to \"none\")",
            type ? type : "?");
    static const char *const guided[] = {"guided_json", "guided_regex", "guided_choice",
                                         "guided_grammar", "structured_outputs"};
    for (size_t k = 0; k < sizeof guided / sizeof guided[0]; k++)
        if (get(root, guided[k]))
            return tdm_error_set_field(
                c->err, TDM_EINVALID, guided[k],
                "%s cannot be combined with tools: both constrain the output", guided[k]);
    return TDM_OK;
}

int oai_tools_parse(json_t *root, oai_tools_t *t, tdm_error_t *err)
{
    req_ctx_t c = {err};
    memset(t, 0, sizeof *t);
    t->parallel = true;
    json_t *tools = json_array();
    if (!tools)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    int rc = parse_tool_list(&c, root, tools);
    if (rc == TDM_OK)
        rc = parse_choice(&c, root, tools, t);
    json_t *pc = get(root, "parallel_tool_calls");
    if (rc == TDM_OK && pc && !json_is_boolean(pc))
        rc = tdm_error_set_field(err, TDM_EINVALID, "parallel_tool_calls",
                                 "parallel_tool_calls must be a boolean");
    t->parallel = !pc || json_is_true(pc);
    t->n_tools = json_array_size(tools);
    t->parse = t->n_tools > 0 && t->choice != OAI_TOOL_CHOICE_NONE;
    if (rc == TDM_OK && t->parse)
        rc = check_conflicts(&c, root);
    if (rc == TDM_OK && t->n_tools > 0 && !(t->text = json_dumps(tools, JSON_COMPACT)))
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    json_decref(tools);
    return rc;
}

/* ---- messages ---- */

static int own(oai_tools_t *t, char *s, tdm_error_t *err)
{
    char **o = s ? realloc(t->owned, (t->n_owned + 1) * sizeof *o) : NULL;
    if (!o) {
        free(s);
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    t->owned = o;
    t->owned[t->n_owned++] = s;
    return TDM_OK;
}

/* An assistant's tool_calls array, checked (each call a function with a name and arguments
 * as a string or an object). */
static int check_calls(req_ctx_t *c, const json_t *calls, size_t i)
{
    char f[96];
    snprintf(f, sizeof f, "messages[%zu].tool_calls", i);
    if (!json_is_array(calls))
        return tdm_error_set_field(c->err, TDM_EINVALID, f, "%s must be an array", f);
    size_t j;
    json_t *call;
    json_array_foreach(calls, j, call)
    {
        const json_t *fn = get(call, "function");
        snprintf(f, sizeof f, "messages[%zu].tool_calls[%zu].function", i, j);
        if (!json_is_object(fn))
            return tdm_error_set_field(c->err, TDM_EINVALID, f, "%s must be an object", f);
        snprintf(f, sizeof f, "messages[%zu].tool_calls[%zu].function.name", i, j);
        if (!json_is_string(get(fn, "name")))
            return tdm_error_set_field(c->err, TDM_EINVALID, f, "%s must be a string", f);
        const json_t *args = get(fn, "arguments");
        snprintf(f, sizeof f, "messages[%zu].tool_calls[%zu].function.arguments", i, j);
        if (args && !json_is_string(args) && !json_is_object(args))
            return tdm_error_set_field(c->err, TDM_EINVALID, f, "%s must be a string (JSON text)",
                                       f);
    }
    return TDM_OK;
}

/* An assistant message: tool_calls, or the legacy function_call as one call. */
static int assistant_calls(req_ctx_t *c, json_t *m, size_t i, Tandem__V1__ChatMessage *msg,
                           oai_tools_t *t)
{
    json_t *calls = get(m, "tool_calls"), *fc = get(m, "function_call");
    json_t *made = NULL;
    if (!calls && fc)
        calls = made = json_pack("[{s:s, s:s, s:O}]", "id", "", "type", "function", "function", fc);
    if (!calls)
        return TDM_OK;
    int rc = check_calls(c, calls, i);
    if (rc == TDM_OK && json_array_size(calls) > 0 &&
        (rc = own(t, json_dumps(calls, JSON_COMPACT), c->err)) == TDM_OK)
        msg->tool_calls = t->owned[t->n_owned - 1];
    json_decref(made);
    return rc;
}

int oai_tools_message(json_t *m, size_t i, Tandem__V1__ChatMessage *msg, oai_tools_t *t,
                      tdm_error_t *err)
{
    req_ctx_t c = {err};
    char f[64];
    if (strcmp(msg->role, "function") == 0)
        msg->role = (char *)"tool"; /* the legacy function result */
    if (strcmp(msg->role, "assistant") == 0)
        return assistant_calls(&c, m, i, msg, t);
    if (get(m, "tool_calls")) {
        snprintf(f, sizeof f, "messages[%zu].tool_calls", i);
        return tdm_error_set_field(err, TDM_EINVALID, f,
                                   "%s: only assistant messages have tool_calls", f);
    }
    if (strcmp(msg->role, "tool") != 0)
        return TDM_OK;
    json_t *id = get(m, "tool_call_id"), *name = get(m, "name");
    snprintf(f, sizeof f, "messages[%zu].tool_call_id", i);
    if (id && !json_is_string(id))
        return tdm_error_set_field(err, TDM_EINVALID, f, "%s must be a string", f);
    if (!id && !name)
        return tdm_error_set_field(err, TDM_EINVALID, f,
                                   "%s is required in a message with role tool", f);
    snprintf(f, sizeof f, "messages[%zu].name", i);
    if (name && !json_is_string(name))
        return tdm_error_set_field(err, TDM_EINVALID, f, "%s must be a string", f);
    if (id)
        msg->tool_call_id = (char *)json_string_value(id);
    if (name)
        msg->name = (char *)json_string_value(name);
    return TDM_OK;
}

/* ---- the grammar of required / named calls ---- */

/* Appends one function's rules in format f: fn-K ::= the call of function NAME with
 * fn-K-args, the rules of its parameters' schema (any object when it has none). Hermes and
 * Mistral's array: {"name": "NAME", "arguments": ARGS}; Llama 3: {"name": "NAME",
 * "parameters": ARGS}; Mistral's [ARGS] form: NAME[ARGS]ARGS. */
static int function_rules(const json_t *fn, size_t k, oai_tool_format_t f, tdm_buf_t *g,
                          tdm_error_t *err)
{
    char rule[32];
    const char *name = json_string_value(json_object_get(fn, "name"));
    snprintf(rule, sizeof rule, "fn-%zu-args", k);
    if (f == OAI_TOOL_FORMAT_MISTRAL_ARGS)
        (void)tdm_buf_printf(g, "fn-%zu ::= \"%s[ARGS]\" %s\n", k, name, rule);
    else
        (void)tdm_buf_printf(g, "fn-%zu ::= \"{\\\"name\\\": \\\"%s\\\", \\\"%s\\\": \" %s \"}\"\n",
                             k, name, f == OAI_TOOL_FORMAT_LLAMA3_JSON ? "parameters" : "arguments",
                             rule);
    const json_t *params = get(fn, "parameters");
    char *schema = params ? json_dumps(params, JSON_COMPACT) : strdup("{\"type\":\"object\"}");
    if (!schema)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    int rc = tdm_json_schema_to_gbnf_rule(schema, strlen(schema), rule, g, err);
    free(schema);
    if (rc == TDM_EINVALID) {
        char fld[64];
        snprintf(fld, sizeof fld, "tools[%zu].function.parameters", k);
        char why[TDM_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", err->msg);
        return tdm_error_set_field(err, TDM_EINVALID, fld, "%s: %s", fld, why);
    }
    return rc;
}

/* The calls' start rule in t->format: one call, or (parallel_tool_calls and tool_choice
 * required) 1 to OAI_TOOL_MAX_CALLS of them with the format's separator, then the end. */
static void calls_rule(const oai_tools_t *t, tdm_buf_t *g)
{
    unsigned more =
        t->parallel && t->choice == OAI_TOOL_CHOICE_REQUIRED ? OAI_TOOL_MAX_CALLS - 1 : 0;
    const char *open = "", *sep = "", *close = "";
    switch (t->format) {
    case OAI_TOOL_FORMAT_HERMES:
        (void)tdm_buf_puts(g, "tool-call ::= \"<tool_call>\\n\" call \"\\n</tool_call>\"\n");
        sep = "\\n";
        break;
    case OAI_TOOL_FORMAT_LLAMA3_JSON:
        (void)tdm_buf_puts(g, "tool-call ::= call\n");
        sep = "; ";
        break;
    case OAI_TOOL_FORMAT_MISTRAL:
        (void)tdm_buf_puts(g, "tool-call ::= call\n");
        open = "[TOOL_CALLS][";
        sep = ", ";
        close = "]";
        break;
    case OAI_TOOL_FORMAT_MISTRAL_ARGS:
        (void)tdm_buf_puts(g, "tool-call ::= \"[TOOL_CALLS]\" call\n");
        break;
    }
    (void)tdm_buf_printf(g, "root ::= \"%s\" tool-call", open);
    if (more)
        (void)tdm_buf_printf(g, " (\"%s\" tool-call){0,%u}", sep, more);
    (void)tdm_buf_printf(g, " \"%s\"\n", close);
}

/* The grammar of required / named calls in t->format (calls_rule), each call one of the
 * allowed functions with arguments matching its parameters. */
static int build_grammar(oai_tools_t *t, tdm_error_t *err)
{
    json_t *tools = json_loads(t->text, 0, NULL);
    if (!tools)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    tdm_buf_t g = TDM_BUF_INIT;
    calls_rule(t, &g);
    (void)tdm_buf_puts(&g, "call ::=");
    size_t k, n = 0;
    json_t *tool;
    int rc = TDM_OK;
    json_array_foreach(tools, k, tool)
    {
        const json_t *fn = json_object_get(tool, "function");
        if (t->choice == OAI_TOOL_CHOICE_NAMED &&
            strcmp(json_string_value(json_object_get(fn, "name")), t->named) != 0)
            continue;
        (void)tdm_buf_printf(&g, "%s fn-%zu", n++ ? " |" : "", k);
    }
    (void)tdm_buf_puts(&g, "\n");
    json_array_foreach(tools, k, tool)
    {
        const json_t *fn = json_object_get(tool, "function");
        if (rc == TDM_OK && (t->choice != OAI_TOOL_CHOICE_NAMED ||
                             strcmp(json_string_value(json_object_get(fn, "name")), t->named) == 0))
            rc = function_rules(fn, k, t->format, &g, err);
    }
    json_decref(tools);
    size_t bytes = g.len;
    free(t->grammar);
    t->grammar = tdm_buf_take(&g);
    if (rc == TDM_OK && !t->grammar)
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    if (rc == TDM_OK && bytes > TDM_HTTP_MAX_TOOL_GRAMMAR_BYTES)
        rc = tdm_error_set_field(err, TDM_EINVALID, "tools",
                                 "tools: the grammar of the calls tool_choice allows is %zu bytes; "
                                 "at most %u (fewer functions or smaller parameter schemas)",
                                 bytes, TDM_HTTP_MAX_TOOL_GRAMMAR_BYTES);
    return rc;
}

int oai_tools_request(oai_tools_t *t, tdm_client_request_t *c, tdm_error_t *err)
{
    c->tools = t->text;
    if (t->choice != OAI_TOOL_CHOICE_REQUIRED && t->choice != OAI_TOOL_CHOICE_NAMED)
        return TDM_OK;
    int rc = build_grammar(t, err);
    if (rc != TDM_OK)
        return rc;
    c->constraint_kind = TDM_CLIENT_CONSTRAINT_GRAMMAR;
    c->constraint = t->grammar;
    return TDM_OK;
}

int oai_tools_set_format(oai_tools_t *t, oai_tool_format_t format, tdm_client_request_t *c,
                         tdm_error_t *err)
{
    t->format = format;
    if (format == OAI_TOOL_FORMAT_HERMES || !t->grammar)
        return TDM_OK;
    return oai_tools_request(t, c, err);
}

void oai_tools_clear(oai_tools_t *t)
{
    if (!t)
        return;
    free(t->text);
    free(t->grammar);
    for (size_t i = 0; i < t->n_owned; i++)
        free(t->owned[i]);
    free(t->owned);
    memset(t, 0, sizeof *t);
}

/* ---- the output parser ---- */

static const char open_tag[] = "<tool_call>";
static const char close_tag[] = "</tool_call>";
#define OPEN_LEN (sizeof open_tag - 1)
#define CLOSE_LEN (sizeof close_tag - 1)

void oai_tool_parser_init(oai_tool_parser_t *p, bool parallel, bool incremental)
{
    oai_tool_parser_init_format(p, OAI_TOOL_FORMAT_HERMES, parallel, incremental);
}

void oai_tool_parser_init_format(oai_tool_parser_t *p, oai_tool_format_t format, bool parallel,
                                 bool incremental)
{
    memset(p, 0, sizeof *p);
    p->format = format;
    p->parallel = parallel;
    p->incremental = incremental && format == OAI_TOOL_FORMAT_HERMES;
}

void oai_tool_parser_free(oai_tool_parser_t *p)
{
    if (!p)
        return;
    for (size_t i = 0; i < p->n_calls; i++) {
        free(p->calls[i].name);
        free(p->calls[i].arguments);
    }
    free(p->calls);
    tdm_buf_free(&p->hold);
    tdm_buf_free(&p->ws);
    memset(p, 0, sizeof *p);
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* Gives out content s[0..n): whitespace at its end waits in p->ws until more content follows
 * (it is dropped when a call comes next); whitespace right after a call is dropped. */
static void content_out(oai_tool_parser_t *p, const char *s, size_t n, tdm_buf_t *out)
{
    if (p->after_call)
        while (n > 0 && is_ws(*s))
            s++, n--;
    size_t end = n;
    while (end > 0 && is_ws(s[end - 1]))
        end--;
    if (end > 0) {
        p->after_call = false;
        p->given += p->ws.len + end;
        (void)tdm_buf_append(out, p->ws.data ? p->ws.data : "", p->ws.len);
        tdm_buf_clear(&p->ws);
        (void)tdm_buf_append(out, s, end);
    }
    (void)tdm_buf_append(&p->ws, s + end, n - end);
}

/* The end of the JSON value that starts at s[i] (the text is valid JSON: jansson checked it),
 * or n when it runs out. */
static size_t skip_value(const char *s, size_t n, size_t i)
{
    int depth = 0;
    bool in_str = false;
    for (; i < n; i++) {
        char ch = s[i];
        if (in_str) {
            if (ch == '\\')
                i++;
            else if (ch == '"')
                in_str = false;
            if (!in_str && depth == 0)
                return i + 1;
            continue;
        }
        if (ch == '"') {
            in_str = true;
        } else if (ch == '{' || ch == '[') {
            depth++;
        } else if (ch == '}' || ch == ']') {
            if (depth == 0)
                return i; /* the end of the enclosing object: a scalar ends here */
            if (--depth == 0)
                return i + 1;
        } else if (depth == 0 && (ch == ',' || is_ws(ch))) {
            return i;
        }
    }
    return n;
}

/* The text of the top-level member key of the JSON object s[0..n) (valid JSON): sets *at and
 * returns its length, or returns 0 when absent. */
static size_t member_text(const char *s, size_t n, const char *key, size_t *at)
{
    size_t i = 0, klen = strlen(key);
    while (i < n && s[i] != '{')
        i++;
    for (i++; i < n;) {
        while (i < n && (is_ws(s[i]) || s[i] == ','))
            i++;
        if (i >= n || s[i] != '"')
            return 0;
        size_t kstart = i + 1, kend = skip_value(s, n, i) - 1;
        for (i = kend + 1; i < n && (is_ws(s[i]) || s[i] == ':'); i++)
            ;
        size_t vend = skip_value(s, n, i);
        if (kend - kstart == klen && memcmp(s + kstart, key, klen) == 0) {
            *at = i;
            return vend - i;
        }
        i = vend;
    }
    return 0;
}

/* Appends a call named name with the given arguments (both heap strings, taken; freed on
 * failure) and a fresh id. Returns the call, NULL on out of memory. */
static oai_tool_call_t *add_call(oai_tool_parser_t *p, char *name, char *arguments)
{
    if (name && arguments && p->n_calls == p->cap) {
        size_t cap = p->cap ? p->cap * 2 : 4;
        oai_tool_call_t *c = realloc(p->calls, cap * sizeof *c);
        if (c)
            p->calls = c, p->cap = cap;
    }
    if (!name || !arguments || p->n_calls == p->cap) {
        free(name);
        free(arguments);
        p->oom = true;
        return NULL;
    }
    oai_tool_call_t *c = &p->calls[p->n_calls++];
    memset(c, 0, sizeof *c);
    uint8_t r[12] = {0};
    if (getrandom(r, sizeof r, 0) != (ssize_t)sizeof r)
        memcpy(r, &p->n_calls, sizeof p->n_calls);
    if (p->format == OAI_TOOL_FORMAT_MISTRAL || p->format == OAI_TOOL_FORMAT_MISTRAL_ARGS) {
        /* Mistral's templates refuse a call id that is not 9 letters and digits when the
         * call comes back in the history (vLLM's mistral parser makes such ids too) */
        static const char alnum[] =
            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
        for (size_t k = 0; k < 9; k++)
            c->id[k] = alnum[r[k] % (sizeof alnum - 1)];
        c->id[9] = '\0';
    } else {
        int off = snprintf(c->id, sizeof c->id, "call_");
        for (size_t k = 0; k < sizeof r; k++)
            off += snprintf(c->id + off, sizeof c->id - (size_t)off, "%02x", r[k]);
    }
    c->name = name;
    c->arguments = arguments;
    c->at = p->given;
    return c;
}

/* BODY of a call: {"name": string, "arguments": object | JSON text in a string}. Appends the
 * call and returns true when it is one. */
static bool parse_call(oai_tool_parser_t *p, const char *s, size_t n)
{
    json_t *v = json_loadb(s, n, 0, NULL);
    const char *name = json_string_value(json_object_get(v, "name"));
    const char *key = json_object_get(v, "arguments") ? "arguments" : "parameters";
    json_t *args = json_object_get(v, key);
    bool ok = json_is_object(v) && name && name[0] &&
              (!args || json_is_object(args) || json_is_string(args));
    char *name_copy = ok ? strdup(name) : NULL;
    char *args_copy = NULL;
    size_t at = 0, len = ok && json_is_object(args) ? member_text(s, n, key, &at) : 0;
    if (len > 0)
        args_copy = strndup(s + at, len);
    else if (ok && json_is_string(args))
        args_copy = strdup(json_string_value(args));
    else if (ok)
        args_copy = strdup("{}");
    json_decref(v);
    return ok && add_call(p, name_copy, args_copy) != NULL;
}

/* ---- incremental arguments (constrained output) ---- */

/* What the grammar of tool_choice required / a named function makes a call start with, after
 * the open tag: "\n{\"name\": \"" NAME "\", \"arguments\": " (build_grammar). */
static const char head_a[] = "\n{\"name\": \"";
static const char head_b[] = "\", \"arguments\": ";
/* While a call's arguments stream, this many bytes stay held: the "}\n</tool_call>" that
 * ends the call may be arriving. */
#define ARGS_TAIL (CLOSE_LEN + 2)

/* Matches the call head at h[0..n): 1 (a call opened; *used bytes of head), 0 (could still
 * be one: wait), -1 (not this form: parse the call whole). */
static int open_streamed_call(oai_tool_parser_t *p, const char *h, size_t n, size_t *used)
{
    size_t la = sizeof head_a - 1, lb = sizeof head_b - 1;
    if (memcmp(h, head_a, n < la ? n : la) != 0)
        return -1;
    if (n < la)
        return 0;
    size_t i = la;
    while (i < n && i - la <= TOOL_NAME_MAX &&
           (h[i] == '_' || h[i] == '-' || (h[i] >= '0' && h[i] <= '9') ||
            (h[i] >= 'a' && h[i] <= 'z') || (h[i] >= 'A' && h[i] <= 'Z')))
        i++;
    if (i - la > TOOL_NAME_MAX || (i < n && i == la))
        return -1;
    size_t rest = n - i;
    if (i == n || memcmp(h + i, head_b, rest < lb ? rest : lb) != 0)
        return i == n ? 0 : -1;
    if (rest < lb)
        return 0;
    if (!add_call(p, strndup(h + la, i - la), strdup("")))
        return -1;
    *used = i + lb;
    return 1;
}

static void append_arguments(oai_tool_parser_t *p, const char *s, size_t n)
{
    oai_tool_call_t *c = &p->calls[p->n_calls - 1];
    size_t len = strlen(c->arguments);
    char *a = n ? realloc(c->arguments, len + n + 1) : c->arguments;
    if (!a) {
        p->oom = true;
        return;
    }
    memcpy(a + len, s, n);
    a[len + n] = '\0';
    c->arguments = a;
}

static void hold_drop(oai_tool_parser_t *p, size_t n)
{
    memmove(p->hold.data, p->hold.data + n, p->hold.len - n);
    p->hold.len -= n;
    p->hold.data[p->hold.len] = '\0';
    p->close_scan = 0;
}

/* The end of an output inside a streamed call's arguments h[n] (no close tag): a start of
 * the close tag and whitespace are not arguments, nor a last "}" that closes the call
 * object (the arguments are JSON without it, not with it). */
static void final_arguments(oai_tool_parser_t *p, const char *h, size_t n)
{
    size_t len = n - oai_tag_tail(h, n, close_tag, CLOSE_LEN);
    while (len > 0 && is_ws(h[len - 1]))
        len--;
    append_arguments(p, h, len);
    char *a = p->calls[p->n_calls - 1].arguments;
    size_t alen = strlen(a);
    json_t *with = alen > 0 && a[alen - 1] == '}' ? json_loads(a, 0, NULL) : NULL;
    json_t *without =
        alen > 0 && a[alen - 1] == '}' && !with ? json_loadb(a, alen - 1, 0, NULL) : NULL;
    if (without)
        a[alen - 1] = '\0';
    json_decref(with);
    json_decref(without);
}

/* A streamed call's arguments: what cannot be the call's end goes to the open call; at the
 * close tag the rest, less the "}" that closes the call object. Returns true at the end. */
static bool stream_arguments(oai_tool_parser_t *p, bool final)
{
    const char *h = p->hold.data;
    size_t n = p->hold.len;
    const char *end = oai_find(h, n, close_tag, CLOSE_LEN);
    if (!end && final) {
        final_arguments(p, h, n);
        hold_drop(p, n);
        p->streaming = p->in_call = false;
        return false;
    }
    if (!end) {
        size_t give = n > ARGS_TAIL ? n - ARGS_TAIL : 0;
        append_arguments(p, h, give);
        hold_drop(p, give);
        return false;
    }
    size_t body = (size_t)(end - h), len = body;
    while (len > 0 && is_ws(h[len - 1]))
        len--;
    if (len > 0 && h[len - 1] == '}')
        len--;
    append_arguments(p, h, len);
    hold_drop(p, body + CLOSE_LEN);
    p->streaming = p->in_call = false;
    p->after_call = true;
    tdm_buf_clear(&p->ws);
    return true;
}

/* One step over p->hold: settles what it can; returns true when it changed state (call
 * again). */
static bool parse_step(oai_tool_parser_t *p, bool final, tdm_buf_t *out)
{
    const char *h = p->hold.data ? p->hold.data : "";
    size_t n = p->hold.len;
    bool closed_to_calls = !p->parallel && p->n_calls > 0;
    if (!p->in_call) {
        const char *at = closed_to_calls ? NULL : oai_find(h, n, open_tag, OPEN_LEN);
        /* at the end of a cut output, a tail that begins the open tag is a cut call: dropped */
        size_t keep = at || (final && !p->cut) || closed_to_calls
                          ? 0
                          : oai_tag_tail(h, n, open_tag, OPEN_LEN);
        size_t give = at ? (size_t)(at - h) : n - keep;
        content_out(p, h, give, out);
        if (final && keep > 0)
            tdm_buf_clear(&p->ws);
        hold_drop(p, at ? give + OPEN_LEN : final ? n : give);
        p->in_call = at != NULL;
        return at != NULL;
    }
    if (p->incremental && !p->streaming && !p->whole_call) {
        size_t used = 0;
        int r = open_streamed_call(p, h, n, &used);
        if (r > 0) {
            hold_drop(p, used);
            p->streaming = true;
            return true;
        }
        if (r == 0 && !final)
            return false;
        p->whole_call = true;
    }
    if (p->streaming)
        return stream_arguments(p, final);
    /* only what came since the last search, and the CLOSE_LEN - 1 bytes before it that a tag
     * split across chunks may begin in */
    size_t from = p->close_scan < n ? p->close_scan : n;
    const char *end = oai_find(h + from, n - from, close_tag, CLOSE_LEN);
    if (!end && !final) {
        p->close_scan = n > CLOSE_LEN - 1 ? n - (CLOSE_LEN - 1) : 0;
        return false;
    }
    /* at the end without the close tag, a start of it is not the call's JSON */
    size_t body = end ? (size_t)(end - h) : n - oai_tag_tail(h, n, close_tag, CLOSE_LEN);
    size_t used = end ? body + CLOSE_LEN : n;
    if (parse_call(p, h, body)) {
        tdm_buf_clear(&p->ws);
        p->after_call = true;
    } else if (!end && p->cut) { /* a call cut off by max_tokens: neither call nor content */
        tdm_buf_clear(&p->ws);
    } else { /* not a call: the text stays, tags included */
        content_out(p, open_tag, OPEN_LEN, out);
        content_out(p, h, used, out);
    }
    hold_drop(p, used);
    p->in_call = p->whole_call = false;
    return true;
}

/* ---- the other families' formats ---- */

static const char mistral_tag[] = "[TOOL_CALLS]";
static const char python_tag[] = "<|python_tag|>";
#define MISTRAL_TAG_LEN (sizeof mistral_tag - 1)
#define PYTHON_TAG_LEN (sizeof python_tag - 1)

static size_t skip_ws(const char *s, size_t n, size_t i)
{
    while (i < n && is_ws(s[i]))
        i++;
    return i;
}

static bool starts(const char *s, size_t n, size_t i, const char *lit, size_t m)
{
    return n - i >= m && memcmp(s + i, lit, m) == 0;
}

/* A call from a parsed object: "name" (a string) and args_key's value (an object, or a
 * string of JSON text; absent: {}). Appended with the arguments as compact JSON text. */
static bool object_call(oai_tool_parser_t *p, const json_t *v, const char *args_key)
{
    const char *name = json_string_value(json_object_get(v, "name"));
    json_t *args = json_object_get(v, args_key);
    if (!args && strcmp(args_key, "parameters") == 0)
        args = json_object_get(v, "arguments"); /* Llama 3.x models write either */
    if (!json_is_object(v) || !name || !name[0] ||
        (args && !json_is_object(args) && !json_is_string(args)))
        return false;
    char *a = !args                  ? strdup("{}")
              : json_is_string(args) ? strdup(json_string_value(args))
                                     : json_dumps(args, JSON_COMPACT);
    return add_call(p, strdup(name), a) != NULL;
}

/* Parses the JSON value at s[i..n) (ending where skip_value says) into *v; returns the index
 * after it, or 0 when it is not JSON. */
static size_t json_at(const char *s, size_t n, size_t i, json_t **v)
{
    size_t end = skip_value(s, n, i);
    *v = end > i ? json_loadb(s + i, end - i, 0, NULL) : NULL;
    return *v ? end : 0;
}

/* How far a parse of held calls got: the text index after the last whole call (or array of
 * calls), the number of calls then, and whether a separator after it began another call. */
typedef struct parse_mark {
    size_t at, calls;
    bool next;
} parse_mark_t;

/* Llama 3.x: [<|python_tag|>] OBJ (";" OBJ)* with whitespace around. */
static bool parse_llama3(oai_tool_parser_t *p, const char *s, size_t n, parse_mark_t *m)
{
    size_t i = skip_ws(s, n, 0);
    if (starts(s, n, i, python_tag, PYTHON_TAG_LEN))
        i = skip_ws(s, n, i + PYTHON_TAG_LEN);
    do {
        json_t *v = NULL;
        if (i >= n || s[i] != '{' || !(i = json_at(s, n, i, &v)) ||
            !object_call(p, v, "parameters")) {
            json_decref(v);
            return false;
        }
        json_decref(v);
        *m = (parse_mark_t){i, p->n_calls, false};
        i = skip_ws(s, n, i);
        if (i < n && s[i] == ';') {
            i = skip_ws(s, n, i + 1);
            m->next = true;
            if (!p->parallel) /* one call: the next is content */
                return false;
        }
    } while (i < n);
    return true;
}

/* Frees p's calls from index k on. */
static void drop_calls_from(oai_tool_parser_t *p, size_t k)
{
    for (size_t j = k; j < p->n_calls; j++) {
        free(p->calls[j].name);
        free(p->calls[j].arguments);
    }
    if (k < p->n_calls)
        p->n_calls = k;
}

/* An array of calls s[i] = "[" cut by max_tokens: its whole calls appended (only the first
 * when not parallel), *m after them with next set, so that the cut one is dropped. */
static void array_cut(oai_tool_parser_t *p, const char *s, size_t n, size_t i, parse_mark_t *m)
{
    size_t before = p->n_calls, at = i;
    for (i = skip_ws(s, n, i + 1); i < n && s[i] == '{';) {
        json_t *v = NULL;
        size_t end = json_at(s, n, i, &v);
        bool ok = end && object_call(p, v, "arguments");
        json_decref(v);
        if (!ok)
            break;
        at = end;
        i = skip_ws(s, n, end);
        if (i >= n || s[i] != ',')
            break;
        i = skip_ws(s, n, i + 1);
    }
    if (!p->parallel)
        drop_calls_from(p, before + 1);
    if (p->n_calls > before)
        *m = (parse_mark_t){at, p->n_calls, true};
}

/* Mistral, after the first [TOOL_CALLS]: an array of {"name", "arguments"} objects, or
 * NAME[ARGS]OBJ; either repeated after further [TOOL_CALLS] markers. */
static bool parse_mistral(oai_tool_parser_t *p, const char *s, size_t n, parse_mark_t *m)
{
    size_t i = skip_ws(s, n, 0);
    do {
        json_t *v = NULL;
        if (i < n && s[i] == '[') {
            size_t start = i;
            if (!(i = json_at(s, n, i, &v)) || !json_is_array(v) || json_array_size(v) == 0) {
                json_decref(v);
                if (p->cut)
                    array_cut(p, s, n, start, m);
                return false;
            }
            size_t k;
            json_t *e;
            json_array_foreach(v, k, e)
            {
                if (!object_call(p, e, "arguments")) {
                    json_decref(v);
                    return false;
                }
            }
        } else {
            size_t name = i;
            while (i < n && i - name <= TOOL_NAME_MAX &&
                   (s[i] == '_' || s[i] == '-' || (s[i] >= '0' && s[i] <= '9') ||
                    (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z')))
                i++;
            size_t name_len = i - name;
            if (name_len == 0 || name_len > TOOL_NAME_MAX || !starts(s, n, i, "[ARGS]", 6))
                return false;
            i = skip_ws(s, n, i + 6);
            if (i >= n || s[i] != '{' || !(i = json_at(s, n, i, &v))) {
                json_decref(v);
                return false;
            }
            char *a = json_dumps(v, JSON_COMPACT);
            if (!add_call(p, strndup(s + name, name_len), a)) {
                json_decref(v);
                return false;
            }
        }
        json_decref(v);
        if (!p->parallel) /* one call: an array's first; what follows it is content */
            drop_calls_from(p, m->calls + 1);
        *m = (parse_mark_t){i, p->n_calls, false};
        i = skip_ws(s, n, i);
        if (starts(s, n, i, mistral_tag, MISTRAL_TAG_LEN)) {
            i = skip_ws(s, n, i + MISTRAL_TAG_LEN);
            m->next = true;
            if (!p->parallel) /* one call: the next is content */
                return false;
        } else if (i < n)
            return false;
    } while (i < n);
    return true;
}

/* The end of an answer in the other formats: the held calls h[n] (after the first marker)
 * parsed into p's calls; what is not a whole call is given out as content. Whole calls are
 * kept when the next call after them does not parse: that rest is content, or dropped when the
 * answer was cut by max_tokens (p->cut), as the <tool_call> format does; text after the calls
 * without a separator makes it all content. */
static void other_parse_held(oai_tool_parser_t *p, const char *h, size_t n, bool llama,
                             tdm_buf_t *out)
{
    size_t before = p->n_calls;
    parse_mark_t m = {0, before, false};
    bool ok = llama ? parse_llama3(p, h, n, &m) : parse_mistral(p, h, n, &m);
    if (p->oom || (!ok && !m.next))
        m = (parse_mark_t){0, before, false};
    drop_calls_from(p, m.calls);
    p->oom = false;
    /* cut by max_tokens inside a call after a separator, or inside marked calls: the cut
     * call is dropped (Llama 3's bare "{" may be JSON content: it stays) */
    bool marked = !llama || starts(h, n, skip_ws(h, n, 0), python_tag, PYTHON_TAG_LEN);
    bool drop_cut = p->cut && !ok && (m.calls > before ? m.next : marked);
    if (m.calls > before) {
        tdm_buf_clear(&p->ws);
        p->after_call = true;
        if (!ok && !drop_cut)
            content_out(p, h + m.at, n - m.at, out);
    } else if (drop_cut) {
        tdm_buf_clear(&p->ws);
    } else {
        if (!llama)
            content_out(p, mistral_tag, MISTRAL_TAG_LEN, out);
        content_out(p, h, n, out);
    }
    hold_drop(p, n);
    p->fstate = 2;
}

/* The other formats: content until the calls begin (Llama 3: the output's first non-space
 * byte is "{" or "<|python_tag|>"; Mistral: "[TOOL_CALLS]" anywhere), then everything is held
 * and parsed at the end; calls that do not parse are given out as content, marker
 * included. */
static void other_feed(oai_tool_parser_t *p, bool final, tdm_buf_t *out)
{
    const char *h = p->hold.data ? p->hold.data : "";
    size_t n = p->hold.len;
    bool llama = p->format == OAI_TOOL_FORMAT_LLAMA3_JSON;
    if (p->fstate == 0 && llama) {
        size_t i = skip_ws(h, n, 0), rest = n - i;
        bool brace = rest > 0 && h[i] == '{';
        size_t cmp = rest < PYTHON_TAG_LEN ? rest : PYTHON_TAG_LEN;
        bool tag = memcmp(h + i, python_tag, cmp) == 0;
        if (brace || (tag && rest >= PYTHON_TAG_LEN))
            p->fstate = 1;
        else if (rest > 0 && (!tag || final))
            p->fstate = 2;
        else if (!final)
            return; /* whitespace or a beginning of the tag so far */
        else
            p->fstate = 2;
    } else if (p->fstate == 0) {
        const char *at = oai_find(h, n, mistral_tag, MISTRAL_TAG_LEN);
        size_t keep =
            at || (final && !p->cut) ? 0 : oai_tag_tail(h, n, mistral_tag, MISTRAL_TAG_LEN);
        size_t give = at ? (size_t)(at - h) : n - keep;
        content_out(p, h, give, out);
        if (final && keep > 0) /* cut inside the marker: dropped */
            tdm_buf_clear(&p->ws);
        hold_drop(p, at ? give + MISTRAL_TAG_LEN : final ? n : give);
        if (!at)
            return;
        p->fstate = 1;
        h = p->hold.data;
        n = p->hold.len;
    }
    if (p->fstate == 2) {
        content_out(p, h, n, out);
        hold_drop(p, n);
        return;
    }
    if (final)
        other_parse_held(p, h, n, llama, out);
}

int oai_tool_parser_feed(oai_tool_parser_t *p, const char *s, size_t n, bool final,
                         tdm_buf_t *content)
{
    p->given = 0;
    if (p->format != OAI_TOOL_FORMAT_HERMES) {
        if (tdm_buf_append(&p->hold, s, n) != TDM_OK || tdm_buf_reserve(&p->hold, 0) != TDM_OK)
            return TDM_ERESOURCE;
        other_feed(p, final, content);
        if (final && p->n_calls == 0) {
            (void)tdm_buf_append(content, p->ws.data ? p->ws.data : "", p->ws.len);
            tdm_buf_clear(&p->ws);
        }
        return content->oom || p->ws.oom || p->oom ? TDM_ERESOURCE : TDM_OK;
    }
    if (tdm_buf_append(&p->hold, s, n) != TDM_OK || tdm_buf_reserve(&p->hold, 0) != TDM_OK)
        return TDM_ERESOURCE;
    while (parse_step(p, final, content))
        ;
    if (final && p->n_calls == 0) {
        (void)tdm_buf_append(content, p->ws.data ? p->ws.data : "", p->ws.len);
        tdm_buf_clear(&p->ws);
    }
    return content->oom || p->ws.oom || p->oom ? TDM_ERESOURCE : TDM_OK;
}

/* ---- responses ---- */

static json_t *call_json(const oai_tool_call_t *c, long index, bool whole)
{
    json_t *j =
        json_pack("{s:s, s:s, s:{s:o, s:o}}", "id", c->id, "type", "function", "function", "name",
                  http_json_str(c->name), "arguments", http_json_str(whole ? c->arguments : ""));
    if (j && index >= 0)
        json_object_set_new(j, "index", json_integer(index));
    return j;
}

/* The deltas of call k not sent yet: index, id, type and name (arguments "") once, then the
 * arguments that came since the last delta. */
static int emit_call(const oai_req_t *q, uint32_t index, tdm_buf_t *b, size_t k, oai_tool_call_t *c)
{
    int rc = TDM_OK;
    if (!c->announced) {
        c->announced = true;
        rc = oai_emit_choice_at(q, index, b,
                                json_pack("{s:[o]}", "tool_calls", call_json(c, (long)k, false)),
                                NULL, 0, NULL, NULL);
    }
    size_t len = strlen(c->arguments);
    if (rc == TDM_OK && c->sent < len)
        rc = oai_emit_choice_at(q, index, b,
                                json_pack("{s:[{s:i, s:{s:o}}]}", "tool_calls", "index", (int)k,
                                          "function", "arguments",
                                          http_json_text(c->arguments + c->sent, len - c->sent)),
                                NULL, 0, NULL, NULL);
    c->sent = len;
    return rc;
}

/* A content delta of content[from..to) with the chunk's logprobs lp (consumed; NULL: none). */
static int content_delta(const oai_req_t *q, const oai_out_t *o, tdm_buf_t *b,
                         const tdm_buf_t *content, size_t from, size_t to, json_t *lp)
{
    const char *text = content->data ? content->data + from : "";
    return oai_emit_choice_at(q, o->index, b,
                              json_pack("{s:o}", "content", http_json_text(text, to - from)), NULL,
                              0, lp, NULL);
}

int oai_tools_sse(const oai_req_t *q, oai_out_t *o, const tdm_client_chunk_t *ch, tdm_buf_t *b)
{
    if (!o->tools) {
        o->tools = calloc(1, sizeof *o->tools);
        if (!o->tools)
            return TDM_ERESOURCE;
        oai_tool_parser_init_format(o->tools, q->tools.format, q->tools.parallel,
                                    q->tools.grammar != NULL);
    }
    tdm_buf_t content = TDM_BUF_INIT;
    o->tools->cut = ch->finish_reason == TDM_CLIENT_FINISH_LENGTH;
    int rc = oai_tool_parser_feed(o->tools, ch->text, strlen(ch->text),
                                  ch->finish_reason != TDM_CLIENT_FINISH_NONE, &content);
    bool lp_wanted = q->logprobs && ch->n_tokens > 0;
    json_t *lp =
        rc == TDM_OK && (content.len > 0 || lp_wanted) ? oai_logprobs_json(q, o, ch) : NULL;
    bool lp_due = rc == TDM_OK && lp_wanted; /* an empty content delta carries them */
    /* in output order: the content before each call this piece added, the call, the rest */
    size_t done = 0;
    for (size_t k = 0; rc == TDM_OK && k < o->tools->n_calls; k++) {
        oai_tool_call_t *c = &o->tools->calls[k];
        size_t at = c->at < content.len ? c->at : content.len;
        if (!c->announced && (at > done || lp_due)) {
            rc = content_delta(q, o, b, &content, done, at, lp);
            lp = NULL;
            lp_due = false;
            done = at;
        }
        if (rc == TDM_OK)
            rc = emit_call(q, o->index, b, k, c);
    }
    if (rc == TDM_OK && (content.len > done || lp_due))
        rc = content_delta(q, o, b, &content, done, content.len, lp);
    else
        json_decref(lp);
    tdm_buf_free(&content);
    return rc;
}

const char *oai_tools_finish(const oai_out_t *o, int reason)
{
    return o->tools && o->tools->n_calls > 0 && reason == TDM_CLIENT_FINISH_STOP ? "tool_calls"
                                                                                 : NULL;
}

json_t *oai_tools_message_json(const oai_req_t *q, const char *text, bool cut, size_t *n_calls)
{
    oai_tool_parser_t p;
    /* parsed as the stream parses it (incremental for constrained output), so that a call cut
     * inside its arguments comes out the same both ways */
    oai_tool_parser_init_format(&p, q->tools.format, q->tools.parallel, q->tools.grammar != NULL);
    p.cut = cut;
    tdm_buf_t content = TDM_BUF_INIT;
    json_t *msg = NULL;
    *n_calls = 0;
    if (oai_tool_parser_feed(&p, text, strlen(text), true, &content) != TDM_OK)
        goto out_free;
    json_t *calls = json_array();
    for (size_t k = 0; calls && k < p.n_calls; k++)
        json_array_append_new(calls, call_json(&p.calls[k], -1, true));
    json_t *c =
        p.n_calls > 0 && content.len == 0 ? json_null() : http_json_text(content.data, content.len);
    msg = json_pack("{s:s, s:o, s:n}", "role", "assistant", "content", c, "refusal");
    if (msg && calls && p.n_calls > 0)
        json_object_set_new(msg, "tool_calls", calls);
    else
        json_decref(calls);
    *n_calls = p.n_calls;
out_free:
    tdm_buf_free(&content);
    oai_tool_parser_free(&p);
    return msg;
}

void oai_out_clear(oai_out_t *o)
{
    if (!o)
        return;
    if (o->tools) {
        oai_tool_parser_free(o->tools);
        free(o->tools);
        o->tools = NULL;
    }
    if (o->reason) {
        oai_reason_free(o->reason);
        free(o->reason);
        o->reason = NULL;
    }
}
