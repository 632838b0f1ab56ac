/* http_family.c - a chat template's model family: its reasoning markup and tool-call format,
 * the reasoning parser, and the grammar that leaves the reasoning free before a constraint.
 *
 * The parser follows vLLM's deepseek_r1 and qwen3 reasoning parsers, with one choice made for
 * streaming's sake: what was streamed as reasoning stays reasoning, so an output that opens
 * "<think>" and never closes it is all reasoning, streamed or not.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http_family.h"
#include "http_openai.h"
#include "tandem/constraint.h"

static const char think_open[] = "<think>";
static const char think_close[] = "</think>";
#define THINK_OPEN_LEN (sizeof think_open - 1)
#define THINK_CLOSE_LEN (sizeof think_close - 1)

const char *oai_tool_format_name(oai_tool_format_t f)
{
    switch (f) {
    case OAI_TOOL_FORMAT_HERMES: return "hermes";
    case OAI_TOOL_FORMAT_LLAMA3_JSON: return "llama3_json";
    case OAI_TOOL_FORMAT_MISTRAL:
    case OAI_TOOL_FORMAT_MISTRAL_ARGS: return "mistral";
    }
    return "?";
}

oai_family_t oai_family_detect(const tdm_jinja_t *t, tdm_reasoning_parser_t reasoning,
                               tdm_tool_call_parser_t tools)
{
    oai_family_t f = {0};
    switch (reasoning) {
    case TDM_REASONING_PARSER_AUTO: f.thinks = tdm_jinja_source_has(t, think_close); break;
    case TDM_REASONING_PARSER_NONE: break;
    case TDM_REASONING_PARSER_DEEPSEEK_R1:
        f.thinks = true;
        f.forced = OAI_REASONING_INSIDE;
        break;
    case TDM_REASONING_PARSER_QWEN3:
        f.thinks = true;
        f.forced = OAI_REASONING_OPTIONAL;
        break;
    }
    bool mistral = tdm_jinja_source_has(t, "[TOOL_CALLS]");
    bool args = tdm_jinja_source_has(t, "[ARGS]");
    switch (tools) {
    case TDM_TOOL_CALL_PARSER_AUTO:
        /* the first family whose markup the template writes; a template that renders tools
         * some other way (or none: the Hermes text is inlined) gets the generic Hermes */
        if (mistral)
            f.tools = args ? OAI_TOOL_FORMAT_MISTRAL_ARGS : OAI_TOOL_FORMAT_MISTRAL;
        else if (tdm_jinja_source_has(t, "<tool_call>"))
            f.tools = OAI_TOOL_FORMAT_HERMES;
        else if (tdm_jinja_source_has(t, "<|python_tag|>") ||
                 tdm_jinja_source_has(t, "\"parameters\": dictionary of argument name"))
            f.tools = OAI_TOOL_FORMAT_LLAMA3_JSON;
        break;
    case TDM_TOOL_CALL_PARSER_HERMES: f.tools = OAI_TOOL_FORMAT_HERMES; break;
    case TDM_TOOL_CALL_PARSER_LLAMA3_JSON: f.tools = OAI_TOOL_FORMAT_LLAMA3_JSON; break;
    case TDM_TOOL_CALL_PARSER_MISTRAL:
        f.tools = args ? OAI_TOOL_FORMAT_MISTRAL_ARGS : OAI_TOOL_FORMAT_MISTRAL;
        break;
    }
    return f;
}

static bool is_ws(char c)
{
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

oai_reasoning_t oai_family_reasoning(const oai_family_t *f, const tdm_jinja_t *t,
                                     const tdm_chat_pick_t *pick, const json_t *kwargs)
{
    if (!f->thinks)
        return OAI_REASONING_NONE;
    if (f->forced != OAI_REASONING_NONE)
        return f->forced;
    if (!t)
        return OAI_REASONING_OPTIONAL;
    tdm_chat_message_t m = {.role = "user", .content = "Hi"};
    tdm_chat_jinja_input_t in = {.msgs = &m,
                                 .n = 1,
                                 .add_generation_prompt = true,
                                 .bos_token = pick ? pick->bos_token : "",
                                 .eos_token = pick ? pick->eos_token : "",
                                 .kwargs = kwargs,
                                 .now = -1};
    char *text = NULL;
    size_t len = 0;
    tdm_error_t err = {0};
    if (tdm_chat_apply_jinja(t, &in, &text, &len, NULL, &err) != TDM_OK)
        return OAI_REASONING_OPTIONAL;
    while (len > 0 && is_ws(text[len - 1]))
        len--;
    bool inside = len >= THINK_OPEN_LEN &&
                  memcmp(text + len - THINK_OPEN_LEN, think_open, THINK_OPEN_LEN) == 0;
    free(text);
    return inside ? OAI_REASONING_INSIDE : OAI_REASONING_OPTIONAL;
}

int oai_reasoning_message(json_t *m, size_t i, Tandem__V1__ChatMessage *msg, tdm_error_t *err)
{
    const char *key = "reasoning_content";
    json_t *v = json_object_get(m, key);
    if (!v || json_is_null(v)) {
        key = "reasoning";
        v = json_object_get(m, key);
    }
    if (!v || json_is_null(v))
        return TDM_OK;
    char f[64];
    snprintf(f, sizeof f, "messages[%zu].%s", i, key);
    if (!json_is_string(v))
        return tdm_error_set_field(err, TDM_EINVALID, f, "%s must be a string", f);
    if (strcmp(msg->role, "assistant") != 0)
        return tdm_error_set_field(err, TDM_EINVALID, f,
                                   "%s: only assistant messages have reasoning", f);
    msg->reasoning_content = (char *)json_string_value(v);
    return TDM_OK;
}

/* ---- the reasoning parser ---- */

enum {
    RS_START = 0,     /* OPTIONAL: before the first non-space byte; may be "<think>" */
    RS_OPEN = 1,      /* INSIDE: at the start; a repeated "<think>" is dropped */
    RS_REASONING = 2, /* inside the reasoning; "</think>" ends it */
    RS_CONTENT = 3,   /* the rest is content */
};

void oai_reason_init(oai_reason_t *r, oai_reasoning_t mode)
{
    memset(r, 0, sizeof *r);
    r->state = mode == OAI_REASONING_INSIDE     ? RS_OPEN
               : mode == OAI_REASONING_OPTIONAL ? RS_START
                                                : RS_CONTENT;
    r->skip_ws = mode != OAI_REASONING_NONE;
}

void oai_reason_free(oai_reason_t *r)
{
    if (!r)
        return;
    tdm_buf_free(&r->hold);
    memset(r, 0, sizeof *r);
}

/* Gives out s[0..n) to out, less leading whitespace while r->skip_ws. */
static void give(oai_reason_t *r, const char *s, size_t n, tdm_buf_t *out)
{
    if (r->skip_ws)
        while (n > 0 && is_ws(*s))
            s++, n--;
    if (n > 0) {
        r->skip_ws = false;
        (void)tdm_buf_append(out, s, n);
    }
}

size_t oai_tag_tail(const char *s, size_t n, const char *tag, size_t tag_len)
{
    for (size_t k = n < tag_len - 1 ? n : tag_len - 1; k > 0; k--)
        if (memcmp(s + n - k, tag, k) == 0)
            return k;
    return 0;
}

const char *oai_find(const char *s, size_t n, const char *needle, size_t m)
{
    for (size_t i = 0; i + m <= n; i++)
        if (memcmp(s + i, needle, m) == 0)
            return s + i;
    return NULL;
}

int oai_reason_feed(oai_reason_t *r, const char *s, size_t n, bool final, tdm_buf_t *reasoning,
                    tdm_buf_t *content)
{
    if (r->state == RS_CONTENT && r->hold.len == 0) {
        give(r, s, n, content);
        return content->oom ? TDM_ERESOURCE : TDM_OK;
    }
    if (tdm_buf_append(&r->hold, s, n) != TDM_OK || tdm_buf_reserve(&r->hold, 0) != TDM_OK)
        return TDM_ERESOURCE;
    for (;;) {
        const char *h = r->hold.data ? r->hold.data : "";
        size_t len = r->hold.len, used = 0;
        if (r->state == RS_START || r->state == RS_OPEN) {
            size_t i = 0;
            while (i < len && is_ws(h[i]))
                i++;
            size_t rest = len - i, cmp = rest < THINK_OPEN_LEN ? rest : THINK_OPEN_LEN;
            if (memcmp(h + i, think_open, cmp) != 0 || (final && rest < THINK_OPEN_LEN)) {
                /* not "<think>": INSIDE reasons from here, OPTIONAL answers */
                r->state = r->state == RS_OPEN ? RS_REASONING : RS_CONTENT;
                continue;
            }
            if (rest < THINK_OPEN_LEN)
                break; /* may still be "<think>": wait */
            used = i + THINK_OPEN_LEN;
            r->state = RS_REASONING;
            r->skip_ws = true;
        } else if (r->state == RS_REASONING) {
            const char *end = oai_find(h, len, think_close, THINK_CLOSE_LEN);
            if (end) {
                give(r, h, (size_t)(end - h), reasoning);
                used = (size_t)(end - h) + THINK_CLOSE_LEN;
                r->state = RS_CONTENT;
                r->skip_ws = true;
            } else {
                size_t keep = final ? 0 : oai_tag_tail(h, len, think_close, THINK_CLOSE_LEN);
                give(r, h, len - keep, reasoning);
                used = len - keep;
                memmove(r->hold.data, h + used, len - used);
                r->hold.len = len - used;
                break;
            }
        } else {
            give(r, h, len, content);
            used = len;
        }
        memmove(r->hold.data, h + used, len - used);
        r->hold.len = len - used;
        if (r->state == RS_CONTENT && r->hold.len == 0)
            break;
    }
    return reasoning->oom || content->oom ? TDM_ERESOURCE : TDM_OK;
}

/* ---- the grammar ---- */

/* Text without "</think>": a DFA over the tag's prefixes, one rule per state (think-tN: the
 * first N bytes of the tag were just seen). Each may end, so the text can stop anywhere. */
static void think_text_rules(tdm_buf_t *g)
{
    static const char tag[] = "</think>";
    for (size_t k = 0; k < THINK_CLOSE_LEN; k++) {
        (void)tdm_buf_printf(g, "think-t%zu ::= ", k);
        if (k == 0)
            (void)tdm_buf_puts(g, "[^<] think-t0 | \"<\" think-t1 | \"\"\n");
        else if (k + 1 < THINK_CLOSE_LEN)
            (void)tdm_buf_printf(g, "[^%c<] think-t0 | \"<\" think-t1 | \"%c\" think-t%zu | \"\"\n",
                                 tag[k], tag[k], k + 1);
        else
            (void)tdm_buf_printf(g, "[^%c<] think-t0 | \"<\" think-t1 | \"\"\n", tag[k]);
    }
}

static bool name_char(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '-';
}

/* The prefix of every rule name of the user's grammar inside the wrapper: the wrapper's own
 * rules (root, think-tN) never begin with it, so no user name can collide with them. */
#define USER_RULE_PREFIX "u-"

/* Copies gbnf[0..len) to out with every rule name (a run of name characters outside literals,
 * classes, comments and {m,n} counts: a definition or a reference) prefixed by
 * USER_RULE_PREFIX; `root` becomes USER_RULE_PREFIX "root". */
static void prefix_names(const char *s, size_t len, tdm_buf_t *out)
{
    size_t i = 0;
    while (i < len) {
        char c = s[i];
        size_t j = i + 1;
        if (c == '"' || c == '[') {
            char close = c == '"' ? '"' : ']';
            while (j < len && s[j] != close) {
                if (s[j] == '\\' && j + 1 < len)
                    j++;
                j++;
            }
            j = j < len ? j + 1 : len;
        } else if (c == '#') {
            while (j < len && s[j] != '\n')
                j++;
        } else if (c == '{') { /* a repetition count: digits, not a name */
            while (j < len && s[j] != '}')
                j++;
            j = j < len ? j + 1 : len;
        } else if (name_char(c)) {
            while (j < len && name_char(s[j]))
                j++;
            (void)tdm_buf_puts(out, USER_RULE_PREFIX);
        }
        (void)tdm_buf_append(out, s + i, j - i);
        i = j;
    }
}

int oai_reason_grammar(oai_reasoning_t mode, const char *gbnf, size_t len, tdm_buf_t *out,
                       tdm_error_t *err)
{
    if (mode == OAI_REASONING_NONE)
        return tdm_error_set(err, TDM_EINVALID, "no reasoning to put before the grammar");
    if (mode == OAI_REASONING_INSIDE)
        (void)tdm_buf_puts(out, "root ::= think-t0 \"</think>\" [ \\t\\r\\n]* " USER_RULE_PREFIX
                                "root\n");
    else
        (void)tdm_buf_puts(
            out, "root ::= (\"<think>\" think-t0 \"</think>\" [ \\t\\r\\n]*)? " USER_RULE_PREFIX
                 "root\n");
    think_text_rules(out);
    prefix_names(gbnf, len, out);
    (void)tdm_buf_puts(out, "\n");
    return out->oom ? tdm_error_set(err, TDM_ERESOURCE, "out of memory") : TDM_OK;
}

/* ---- a request fitted to its family ---- */

/* reasoning_effort (vLLM: "low" | "medium" | "high"): set in *kwargs (created when NULL) as
 * the template variable reasoning_effort when template t reads it, unless chat_template_kwargs
 * set it already; refused otherwise, so a model never silently ignores it. */
static int reasoning_effort(const json_t *root, const tdm_jinja_t *t, json_t **kwargs,
                            tdm_error_t *err)
{
    json_t *v = json_object_get(root, "reasoning_effort");
    if (!v || json_is_null(v))
        return TDM_OK;
    const char *s = json_string_value(v);
    if (!s || (strcmp(s, "low") != 0 && strcmp(s, "medium") != 0 && strcmp(s, "high") != 0))
        return tdm_error_set_field(err, TDM_EINVALID, "reasoning_effort",
                                   "reasoning_effort must be \"low\", \"medium\" or \"high\"");
    if (!tdm_jinja_reads(t, "reasoning_effort"))
        return tdm_error_set_field(
            err, TDM_EINVALID, "reasoning_effort",
            "reasoning_effort: the chat template does not read reasoning_effort, so the model "
            "cannot apply it (templates such as gpt-oss's do); leave it out");
    if (!*kwargs && !(*kwargs = json_object()))
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    if (!json_object_get(*kwargs, "reasoning_effort") &&
        json_object_set_new(*kwargs, "reasoning_effort", json_string(s)) != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    return TDM_OK;
}

/* The request's constraint (tools' grammar or structured output) compiled to GBNF and put
 * after a free reasoning section (oai_reason_grammar). */
static int constraint_after_reasoning(oai_req_t *q, tdm_error_t *err)
{
    tdm_buf_t gbnf = TDM_BUF_INIT, out = TDM_BUF_INIT;
    uint64_t hash = 0;
    const char *text = q->creq.constraint ? q->creq.constraint : "";
    int rc =
        tdm_constraint_compile((int)q->creq.constraint_kind, text, strlen(text), &gbnf, &hash, err);
    if (rc == TDM_EINVALID) {
        const char *fld = q->tools.grammar ? "tools" : q->constraint_param;
        char why[TDM_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s", err->msg);
        rc = tdm_error_set_field(err, TDM_EINVALID, fld, "%s: %s", fld, why);
    }
    if (rc == TDM_OK)
        rc = oai_reason_grammar(q->reasoning, gbnf.data ? gbnf.data : "", gbnf.len, &out, err);
    tdm_buf_free(&gbnf);
    if (rc == TDM_OK && !(q->reason_grammar = tdm_buf_take(&out)))
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    tdm_buf_free(&out);
    if (rc != TDM_OK)
        return rc;
    q->creq.constraint_kind = TDM_CLIENT_CONSTRAINT_GRAMMAR;
    q->creq.constraint = q->reason_grammar;
    return TDM_OK;
}

int oai_apply_family(oai_req_t *q, const oai_family_ctx_t *ctx, tdm_error_t *err)
{
    if (q->kind != OAI_CHAT)
        return TDM_OK;
    const tdm_jinja_t *t = ctx->pick ? ctx->pick->jinja : NULL;
    oai_family_t fam = ctx->family;
    tdm_jinja_t *own = NULL;
    json_t *kwargs = NULL;
    int rc = TDM_OK;
    if (q->chat_template && q->chat_template[0]) {
        if (!(own = tdm_chat_jinja_compile(q->chat_template, strlen(q->chat_template), err))) {
            char why[TDM_ERRMSG_MAX];
            snprintf(why, sizeof why, "%s", err->msg);
            return tdm_error_set_field(err, err->code == TDM_EINVALID ? TDM_EINVALID : err->code,
                                       "chat_template", "chat_template: %s", why);
        }
        t = own;
        fam = oai_family_detect(t, ctx->reasoning_cfg, ctx->tools_cfg);
    }
    if (q->chat_template_kwargs && !(kwargs = json_loads(q->chat_template_kwargs, 0, NULL)))
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    bool had_effort = kwargs && json_object_get(kwargs, "reasoning_effort");
    if (rc == TDM_OK)
        rc = reasoning_effort(q->root, t, &kwargs, err);
    if (rc == TDM_OK && kwargs && !had_effort && json_object_get(kwargs, "reasoning_effort")) {
        char *text = json_dumps(kwargs, JSON_COMPACT);
        if (!text) {
            rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        } else {
            free(q->chat_template_kwargs);
            q->chat_template_kwargs = text;
            q->creq.chat_template_kwargs = text;
        }
    }
    json_t *ir = json_object_get(q->root, "include_reasoning");
    if (rc == TDM_OK && ir && !json_is_null(ir) && !json_is_boolean(ir))
        rc = tdm_error_set_field(err, TDM_EINVALID, "include_reasoning",
                                 "include_reasoning must be a boolean");
    q->hide_reasoning = json_is_false(ir);
    if (rc == TDM_OK) {
        q->reasoning =
            own || kwargs ? oai_family_reasoning(&fam, t, ctx->pick, kwargs) : ctx->plain_mode;
        if (q->tools.parse)
            rc = oai_tools_set_format(&q->tools, fam.tools, &q->creq, err);
        /* Mistral's [TOOL_CALLS] and [ARGS] are control tokens of its vocabulary: their text
         * must reach the parser (vLLM turns skip_special_tokens off for it too) */
        q->creq.render_special = q->tools.parse && (fam.tools == OAI_TOOL_FORMAT_MISTRAL ||
                                                    fam.tools == OAI_TOOL_FORMAT_MISTRAL_ARGS);
    }
    if (rc == TDM_OK && q->reasoning != OAI_REASONING_NONE &&
        q->creq.constraint_kind != TDM_CLIENT_CONSTRAINT_NONE)
        rc = constraint_after_reasoning(q, err);
    json_decref(kwargs);
    tdm_jinja_destroy(&own);
    return rc;
}
