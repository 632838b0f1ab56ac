/* test_http_family.c - model families in the HTTP gateway (router/http_family.c and the
 * per-family tool-call formats of router/http_tools.c): the reasoning parser and every tool
 * format on fixed texts fed whole, split at every byte boundary and byte by byte; detection
 * from template sources; the required grammars of each format (bounded call count) and the
 * grammar that frees the reasoning before a constraint, run through a byte matcher;
 * reasoning_effort passed or refused; reasoning in responses and SSE deltas. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "http_openai.h"
#include "tandem/grammar.h"

/* ---- the reasoning parser ---- */

/* Feeds text cut at `cut` (0: whole; SIZE_MAX: byte by byte) and checks the split. */
static void reason_case(oai_reasoning_t mode, const char *text, const char *want_reasoning,
                        const char *want_content)
{
    size_t len = strlen(text);
    for (size_t cut = 0; cut <= len + 1; cut++) {
        oai_reason_t r;
        oai_reason_init(&r, mode);
        tdm_buf_t rs = TDM_BUF_INIT, ct = TDM_BUF_INIT;
        if (cut == len + 1) { /* byte by byte */
            for (size_t i = 0; i < len; i++)
                assert_int_equal(oai_reason_feed(&r, text + i, 1, false, &rs, &ct), TDM_OK);
            assert_int_equal(oai_reason_feed(&r, "", 0, true, &rs, &ct), TDM_OK);
        } else {
            assert_int_equal(oai_reason_feed(&r, text, cut, false, &rs, &ct), TDM_OK);
            assert_int_equal(oai_reason_feed(&r, text + cut, len - cut, true, &rs, &ct), TDM_OK);
        }
        if (strcmp(rs.data ? rs.data : "", want_reasoning) != 0 ||
            strcmp(ct.data ? ct.data : "", want_content) != 0)
            fail_msg("mode %d cut %zu of '%s': reasoning '%s' content '%s'", (int)mode, cut, text,
                     rs.data ? rs.data : "", ct.data ? ct.data : "");
        tdm_buf_free(&rs);
        tdm_buf_free(&ct);
        oai_reason_free(&r);
    }
}

static void test_reasoning_parser(void **state)
{
    (void)state;
    /* DeepSeek-R1: the prompt opened <think> */
    reason_case(OAI_REASONING_INSIDE, "Let me see.\n</think>\n\nThe answer is 4.", "Let me see.\n",
                "The answer is 4.");
    reason_case(OAI_REASONING_INSIDE, "<think>\nHmm </thin k.</think>4", "Hmm </thin k.", "4");
    reason_case(OAI_REASONING_INSIDE, "never closed <thi", "never closed <thi", "");
    reason_case(OAI_REASONING_INSIDE, "</think>just content", "", "just content");
    reason_case(OAI_REASONING_INSIDE, "a < b </think> c </think> d", "a < b ", "c </think> d");
    /* Qwen3: a leading <think> opens the reasoning */
    reason_case(OAI_REASONING_OPTIONAL, "<think>\nOkay.\n</think>\n\nHello!", "Okay.\n", "Hello!");
    reason_case(OAI_REASONING_OPTIONAL, "  <think>x</think>y", "x", "y");
    reason_case(OAI_REASONING_OPTIONAL, "Hello <think>not reasoning</think>", "",
                "Hello <think>not reasoning</think>");
    reason_case(OAI_REASONING_OPTIONAL, "<thin", "", "<thin");
    reason_case(OAI_REASONING_OPTIONAL, "<think>open only", "open only", "");
    reason_case(OAI_REASONING_OPTIONAL, "", "", "");
    reason_case(OAI_REASONING_NONE, "<think>a</think>b", "", "<think>a</think>b");
}

/* ---- tool-call formats ---- */

typedef struct want_call {
    const char *name, *arguments;
} want_call_t;

static bool tools_cut; /* the parsers' cut flag (an output ended by max_tokens) */

/* Parses text in format f at every cut (and byte by byte) and checks content and calls. */
static void tools_case_par(oai_tool_format_t f, bool parallel, const char *text,
                           const char *want_content, const want_call_t *want, size_t n_want)
{
    size_t len = strlen(text);
    for (size_t cut = 0; cut <= len + 1; cut++) {
        oai_tool_parser_t p;
        oai_tool_parser_init_format(&p, f, parallel, false);
        p.cut = tools_cut;
        tdm_buf_t ct = TDM_BUF_INIT;
        if (cut == len + 1) {
            for (size_t i = 0; i < len; i++)
                assert_int_equal(oai_tool_parser_feed(&p, text + i, 1, false, &ct), TDM_OK);
            assert_int_equal(oai_tool_parser_feed(&p, "", 0, true, &ct), TDM_OK);
        } else {
            assert_int_equal(oai_tool_parser_feed(&p, text, cut, false, &ct), TDM_OK);
            assert_int_equal(oai_tool_parser_feed(&p, text + cut, len - cut, true, &ct), TDM_OK);
        }
        if (strcmp(ct.data ? ct.data : "", want_content) != 0 || p.n_calls != n_want)
            fail_msg("format %s cut %zu of '%s': content '%s', %zu calls", oai_tool_format_name(f),
                     cut, text, ct.data ? ct.data : "", p.n_calls);
        for (size_t k = 0; k < n_want; k++) {
            assert_string_equal(p.calls[k].name, want[k].name);
            assert_string_equal(p.calls[k].arguments, want[k].arguments);
        }
        tdm_buf_free(&ct);
        oai_tool_parser_free(&p);
    }
}

static void tools_case(oai_tool_format_t f, const char *text, const char *want_content,
                       const want_call_t *want, size_t n_want)
{
    tools_case_par(f, true, text, want_content, want, n_want);
}

static void test_tool_formats(void **state)
{
    (void)state;
    static const want_call_t paris[] = {{"get_weather", "{\"city\":\"Paris\"}"}};
    static const want_call_t two[] = {{"a", "{\"x\":1}"}, {"b", "{}"}};
    /* Llama 3.x JSON, bare and after <|python_tag|>, several "; "-separated */
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON,
               "{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Paris\"}}", "", paris, 1);
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON,
               "<|python_tag|>{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", "
               "\"arguments\": {}}",
               "", two, 2);
    /* not a call: content, exactly */
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON, "{\"answer\": 42}", "{\"answer\": 42}", NULL, 0);
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON, "The weather is {sunny}.", "The weather is {sunny}.",
               NULL, 0);
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON, "{\"name\": \"a\", \"parameters\": {\"x\": 1}} and",
               "{\"name\": \"a\", \"parameters\": {\"x\": 1}} and", NULL, 0);
    /* Mistral: the JSON array form, after content */
    tools_case(OAI_TOOL_FORMAT_MISTRAL,
               "Sure.\n[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": "
               "\"Paris\"}}]",
               "Sure.", paris, 1);
    tools_case(OAI_TOOL_FORMAT_MISTRAL,
               "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", "
               "\"arguments\": \"{}\"}]",
               "", two, 2);
    /* Mistral's [ARGS] form, one marker per call */
    tools_case(OAI_TOOL_FORMAT_MISTRAL_ARGS, "[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Paris\"}",
               "", paris, 1);
    tools_case(OAI_TOOL_FORMAT_MISTRAL_ARGS, "[TOOL_CALLS]a[ARGS]{\"x\":1}[TOOL_CALLS]b[ARGS]{}",
               "", two, 2);
    /* broken calls stay content, marker included */
    tools_case(OAI_TOOL_FORMAT_MISTRAL,
               "Hi [TOOL_CALLS][{\"name\": ", "Hi [TOOL_CALLS][{\"name\": ", NULL, 0);
    tools_case(OAI_TOOL_FORMAT_MISTRAL_ARGS, "[TOOL_CALLS]a b[ARGS]{}", "[TOOL_CALLS]a b[ARGS]{}",
               NULL, 0);
    tools_case(OAI_TOOL_FORMAT_MISTRAL, "no calls here [TOOL_CALL", "no calls here [TOOL_CALL",
               NULL, 0);
    /* cut by max_tokens inside the next call: the whole calls are kept, the rest is content */
    static const want_call_t one_a[] = {{"a", "{\"x\":1}"}};
    tools_case(OAI_TOOL_FORMAT_MISTRAL_ARGS, "[TOOL_CALLS]a[ARGS]{\"x\":1}[TOOL_CALLS]b[ARGS]{\"y",
               "[TOOL_CALLS]b[ARGS]{\"y", one_a, 1);
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON,
               "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"param",
               "; {\"name\": \"b\", \"param", one_a, 1);
    tools_case(OAI_TOOL_FORMAT_MISTRAL,
               "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}][TOOL_CALLS][{\"na",
               "[TOOL_CALLS][{\"na", one_a, 1);
    /* the same cut by max_tokens (finish reason length): the cut call is dropped, text before
     * the calls kept; Llama 3's bare "{" may be JSON content and stays */
    tools_cut = true;
    tools_case(OAI_TOOL_FORMAT_MISTRAL_ARGS, "[TOOL_CALLS]a[ARGS]{\"x\":1}[TOOL_CALLS]b[ARGS]{\"y",
               "", one_a, 1);
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON,
               "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", \"param", "",
               one_a, 1);
    tools_case(OAI_TOOL_FORMAT_MISTRAL,
               "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}][TOOL_CALLS][{\"na", "",
               one_a, 1);
    tools_case(OAI_TOOL_FORMAT_MISTRAL, "Hi [TOOL_CALLS][{\"name\": ", "Hi", NULL, 0);
    tools_case(OAI_TOOL_FORMAT_MISTRAL,
               "Hi [TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b", "Hi",
               one_a, 1);
    tools_case(OAI_TOOL_FORMAT_MISTRAL, "no calls here [TOOL_CALL", "no calls here", NULL, 0);
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON, "<|python_tag|>{\"name\": \"a\", \"par", "", NULL, 0);
    tools_case(OAI_TOOL_FORMAT_LLAMA3_JSON, "{\"name\": \"a\", \"par", "{\"name\": \"a\", \"par",
               NULL, 0);
    tools_cut = false;
    /* parallel_tool_calls false: one call, as the <tool_call> format; the next is content (an
     * array's later elements are dropped with it) */
    tools_case_par(OAI_TOOL_FORMAT_LLAMA3_JSON, false,
                   "{\"name\": \"a\", \"parameters\": {\"x\": 1}}; {\"name\": \"b\", "
                   "\"parameters\": {}}",
                   "; {\"name\": \"b\", \"parameters\": {}}", one_a, 1);
    tools_case_par(OAI_TOOL_FORMAT_LLAMA3_JSON, false,
                   "{\"name\": \"a\", \"parameters\": {\"x\": 1}} and",
                   "{\"name\": \"a\", \"parameters\": {\"x\": 1}} and", NULL, 0);
    tools_case_par(OAI_TOOL_FORMAT_MISTRAL_ARGS, false,
                   "[TOOL_CALLS]a[ARGS]{\"x\":1}[TOOL_CALLS]b[ARGS]{}", "[TOOL_CALLS]b[ARGS]{}",
                   one_a, 1);
    tools_case_par(OAI_TOOL_FORMAT_MISTRAL, false,
                   "[TOOL_CALLS][{\"name\": \"a\", \"arguments\": {\"x\": 1}}, {\"name\": \"b\", "
                   "\"arguments\": \"{}\"}]",
                   "", one_a, 1);
}

/* ---- detection ---- */

static tdm_jinja_t *compile(const char *src)
{
    tdm_error_t err = {0};
    tdm_jinja_t *t = tdm_chat_jinja_compile(src, strlen(src), &err);
    if (!t)
        fail_msg("%s: %s", src, err.msg);
    return t;
}

/* A Qwen3-like template: enable_thinking false closes an empty think block. */
static const char qwen3_like[] =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
    "{# <tool_call> #}";
/* A DeepSeek-R1-like template: the generation prompt opens <think>. */
static const char r1_like[] = "{% for m in messages %}{{ m.content }}{% endfor %}"
                              "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}"
                              "{# </think> #}";

static void test_detection(void **state)
{
    (void)state;
    tdm_jinja_t *q = compile(qwen3_like), *r = compile(r1_like);
    tdm_jinja_t *llama = compile("{{ '<|python_tag|>' }}{{ messages[0].content }}");
    tdm_jinja_t *mis = compile("[TOOL_CALLS]{{ x }}[ARGS]"), *mis_old = compile("[TOOL_CALLS]");
    tdm_jinja_t *plain = compile("{{ messages[0].content }}");
    oai_family_t f = oai_family_detect(q, TDM_REASONING_PARSER_AUTO, TDM_TOOL_CALL_PARSER_AUTO);
    assert_true(f.thinks);
    assert_int_equal(f.tools, OAI_TOOL_FORMAT_HERMES);
    assert_int_equal(oai_family_reasoning(&f, q, NULL, NULL), OAI_REASONING_OPTIONAL);
    json_t *off = json_pack("{s:b}", "enable_thinking", 0);
    assert_int_equal(oai_family_reasoning(&f, q, NULL, off), OAI_REASONING_OPTIONAL);
    json_decref(off);
    f = oai_family_detect(r, TDM_REASONING_PARSER_AUTO, TDM_TOOL_CALL_PARSER_AUTO);
    assert_true(f.thinks);
    assert_int_equal(oai_family_reasoning(&f, r, NULL, NULL), OAI_REASONING_INSIDE);
    /* the config wins */
    f = oai_family_detect(r, TDM_REASONING_PARSER_QWEN3, TDM_TOOL_CALL_PARSER_LLAMA3_JSON);
    assert_int_equal(oai_family_reasoning(&f, r, NULL, NULL), OAI_REASONING_OPTIONAL);
    assert_int_equal(f.tools, OAI_TOOL_FORMAT_LLAMA3_JSON);
    f = oai_family_detect(r, TDM_REASONING_PARSER_NONE, TDM_TOOL_CALL_PARSER_AUTO);
    assert_int_equal(oai_family_reasoning(&f, r, NULL, NULL), OAI_REASONING_NONE);
    f = oai_family_detect(llama, TDM_REASONING_PARSER_AUTO, TDM_TOOL_CALL_PARSER_AUTO);
    assert_false(f.thinks);
    assert_int_equal(f.tools, OAI_TOOL_FORMAT_LLAMA3_JSON);
    f = oai_family_detect(mis, TDM_REASONING_PARSER_AUTO, TDM_TOOL_CALL_PARSER_AUTO);
    assert_int_equal(f.tools, OAI_TOOL_FORMAT_MISTRAL_ARGS);
    f = oai_family_detect(mis_old, TDM_REASONING_PARSER_AUTO, TDM_TOOL_CALL_PARSER_AUTO);
    assert_int_equal(f.tools, OAI_TOOL_FORMAT_MISTRAL);
    /* no markup, and the built-ins (NULL): the generic Hermes format, no reasoning */
    f = oai_family_detect(plain, TDM_REASONING_PARSER_AUTO, TDM_TOOL_CALL_PARSER_AUTO);
    assert_false(f.thinks);
    assert_int_equal(f.tools, OAI_TOOL_FORMAT_HERMES);
    f = oai_family_detect(NULL, TDM_REASONING_PARSER_AUTO, TDM_TOOL_CALL_PARSER_AUTO);
    assert_int_equal(oai_family_reasoning(&f, NULL, NULL, NULL), OAI_REASONING_NONE);
    tdm_jinja_destroy(&q);
    tdm_jinja_destroy(&r);
    tdm_jinja_destroy(&llama);
    tdm_jinja_destroy(&mis);
    tdm_jinja_destroy(&mis_old);
    tdm_jinja_destroy(&plain);
}

/* ---- grammars ---- */

/* Whether grammar g accepts text exactly (all of it, and may end there). */
static bool accepts(const char *g, const char *text)
{
    tdm_error_t err = {0};
    tdm_grammar_t *gr = tdm_grammar_parse(g, strlen(g), NULL, &err);
    if (!gr)
        fail_msg("grammar does not parse: %s\n%s", err.msg, g);
    tdm_grammar_matcher_t *m = tdm_grammar_matcher_new(gr, NULL, &err);
    assert_non_null(m);
    bool ok = tdm_grammar_matcher_accept_bytes(m, text, strlen(text)) &&
              tdm_grammar_matcher_is_accepting(m);
    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_destroy(&gr);
    return ok;
}

static const oai_family_ctx_t plain_ctx = {0};

/* A parsed request fitted to a family whose tool format is f and reasoning mode is mode. */
static void fitted(const char *body, oai_tool_format_t f, oai_reasoning_t mode, oai_req_t *q)
{
    tdm_error_t err = {0};
    assert_int_equal(oai_parse(OAI_CHAT, body, strlen(body), "m", q, &err), TDM_OK);
    oai_family_ctx_t ctx = plain_ctx;
    ctx.family.tools = f;
    ctx.family.thinks = mode != OAI_REASONING_NONE;
    ctx.family.forced = mode;
    ctx.plain_mode = mode;
    if (oai_apply_family(q, &ctx, &err) != TDM_OK)
        fail_msg("%s: %s", body, err.msg);
}

#define USER "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]"
#define TOOLS                                                                                      \
    "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"w\", \"parameters\": "        \
    "{\"type\": \"object\", \"properties\": {\"c\": {\"type\": \"string\"}}, \"required\": "       \
    "[\"c\"]}}}]"

/* n copies of call joined by sep, with open before and close after. */
static char *repeat(const char *open, const char *call, const char *sep, const char *close, int n)
{
    tdm_buf_t b = TDM_BUF_INIT;
    tdm_buf_puts(&b, open);
    for (int i = 0; i < n; i++) {
        if (i)
            tdm_buf_puts(&b, sep);
        tdm_buf_puts(&b, call);
    }
    tdm_buf_puts(&b, close);
    return tdm_buf_take(&b);
}

static void test_required_grammars(void **state)
{
    (void)state;
    static const struct {
        oai_tool_format_t f;
        const char *open, *call, *sep, *close;
    } cases[] = {
        {OAI_TOOL_FORMAT_HERMES, "",
         "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"x\"}}\n</tool_call>", "\n", ""},
        {OAI_TOOL_FORMAT_LLAMA3_JSON, "", "{\"name\": \"w\", \"parameters\": {\"c\": \"x\"}}", "; ",
         ""},
        {OAI_TOOL_FORMAT_MISTRAL, "[TOOL_CALLS][",
         "{\"name\": \"w\", \"arguments\": {\"c\": \"x\"}}", ", ", "]"},
        {OAI_TOOL_FORMAT_MISTRAL_ARGS, "", "[TOOL_CALLS]w[ARGS]{\"c\": \"x\"}", "", ""},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        oai_req_t q;
        fitted("{" USER ", " TOOLS ", \"tool_choice\": \"required\"}", cases[k].f,
               OAI_REASONING_NONE, &q);
        assert_int_equal(q.creq.constraint_kind, TDM_CLIENT_CONSTRAINT_GRAMMAR);
        /* Mistral's markers are control tokens: their text is asked for */
        assert_int_equal(q.creq.render_special, cases[k].f == OAI_TOOL_FORMAT_MISTRAL ||
                                                    cases[k].f == OAI_TOOL_FORMAT_MISTRAL_ARGS);
        const char *g = q.creq.constraint;
        char *one = repeat(cases[k].open, cases[k].call, cases[k].sep, cases[k].close, 1);
        char *most =
            repeat(cases[k].open, cases[k].call, cases[k].sep, cases[k].close, OAI_TOOL_MAX_CALLS);
        char *over = repeat(cases[k].open, cases[k].call, cases[k].sep, cases[k].close,
                            OAI_TOOL_MAX_CALLS + 1);
        if (!accepts(g, one))
            fail_msg("%s: one call refused:\n%s\n%s", oai_tool_format_name(cases[k].f), one, g);
        assert_true(accepts(g, most));
        assert_false(accepts(g, over)); /* the calls end: no repeat loops to max_tokens */
        assert_false(accepts(g, "hello"));
        /* the parser reads back what the grammar allows */
        oai_tool_parser_t p;
        oai_tool_parser_init_format(&p, cases[k].f, true, false);
        tdm_buf_t ct = TDM_BUF_INIT;
        assert_int_equal(oai_tool_parser_feed(&p, most, strlen(most), true, &ct), TDM_OK);
        assert_int_equal(p.n_calls, OAI_TOOL_MAX_CALLS);
        assert_string_equal(p.calls[0].name, "w");
        assert_int_equal(ct.len, 0);
        tdm_buf_free(&ct);
        oai_tool_parser_free(&p);
        oai_req_clear(&q);
        /* parallel_tool_calls false: exactly one */
        fitted("{" USER ", " TOOLS ", \"tool_choice\": \"required\", \"parallel_tool_calls\": "
               "false}",
               cases[k].f, OAI_REASONING_NONE, &q);
        char *two = repeat(cases[k].open, cases[k].call, cases[k].sep, cases[k].close, 2);
        assert_true(accepts(q.creq.constraint, one));
        assert_false(accepts(q.creq.constraint, two));
        oai_req_clear(&q);
        /* a named function: exactly one too */
        fitted("{" USER ", " TOOLS ", \"tool_choice\": {\"type\": \"function\", \"function\": "
               "{\"name\": \"w\"}}}",
               cases[k].f, OAI_REASONING_NONE, &q);
        assert_true(accepts(q.creq.constraint, one));
        assert_false(accepts(q.creq.constraint, two));
        oai_req_clear(&q);
        free(one);
        free(two);
        free(most);
        free(over);
    }
}

static void test_grammar_after_reasoning(void **state)
{
    (void)state;
    oai_req_t q;
    /* tools after a DeepSeek-R1 reasoning section */
    fitted("{" USER ", " TOOLS ", \"tool_choice\": \"required\"}", OAI_TOOL_FORMAT_HERMES,
           OAI_REASONING_INSIDE, &q);
    static const char call[] =
        "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"x\"}}\n</tool_call>";
    char text[512];
    snprintf(text, sizeof text, "I should call w. <tag> </thin </think>\n\n%s", call);
    assert_true(accepts(q.creq.constraint, text));
    assert_false(accepts(q.creq.constraint, call));                      /* no reasoning end */
    assert_false(accepts(q.creq.constraint, "a </think> b </think>\n")); /* one end only */
    oai_req_clear(&q);
    /* a JSON schema after an optional Qwen3 reasoning section */
    fitted("{" USER ", \"response_format\": {\"type\": \"json_schema\", \"json_schema\": "
           "{\"name\": \"n\", \"schema\": {\"type\": \"object\", \"properties\": {\"root\": "
           "{\"type\": \"integer\"}}, \"required\": [\"root\"]}}}}",
           OAI_TOOL_FORMAT_HERMES, OAI_REASONING_OPTIONAL, &q);
    assert_int_equal(q.creq.constraint_kind, TDM_CLIENT_CONSTRAINT_GRAMMAR);
    assert_true(accepts(q.creq.constraint, "<think>\nok</think>\n{\"root\": 1}"));
    assert_true(accepts(q.creq.constraint, "{\"root\": 1}"));
    assert_false(accepts(q.creq.constraint, "plain text"));
    oai_req_clear(&q);
    /* a user grammar whose rules have the wrapper's names (and a count, {1,2}, whose digits
     * are no names): the user's rules are its own */
    for (int mode = 0; mode < 2; mode++) {
        fitted("{" USER ", \"structured_outputs\": {\"grammar\": \"root ::= think-answer think-t0 "
               "u-root\\nthink-answer ::= \\\"A\\\"\\nthink-t0 ::= \\\"B\\\"{1,2}\\nthink-t7 ::= "
               "\\\"C\\\"\\nu-root ::= think-t7 | \\\"D\\\" # think-t1\\n\"}}",
               OAI_TOOL_FORMAT_HERMES, mode ? OAI_REASONING_INSIDE : OAI_REASONING_OPTIONAL, &q);
        assert_int_equal(q.creq.constraint_kind, TDM_CLIENT_CONSTRAINT_GRAMMAR);
        const char *g = q.creq.constraint;
        const char *pre = mode ? "x</think>\n" : "<think>\nx</think>\n";
        char t[64];
        snprintf(t, sizeof t, "%sABC", pre);
        assert_true(accepts(g, t));
        snprintf(t, sizeof t, "%sABBD", pre);
        assert_true(accepts(g, t));
        snprintf(t, sizeof t, "%sAC", pre); /* think-t0 is the user's "B"{1,2} */
        assert_false(accepts(g, t));
        snprintf(t, sizeof t, "%sABBBC", pre);
        assert_false(accepts(g, t));
        assert_true(accepts(g, "ABBC") == !mode); /* the reasoning is optional, or not */
        oai_req_clear(&q);
    }
}

/* ---- requests ---- */

static void test_reasoning_effort(void **state)
{
    (void)state;
    tdm_jinja_t *reads = compile("{{ reasoning_effort }}{{ messages[0].content }}");
    tdm_jinja_t *ignores = compile("{{ messages[0].content }}");
    tdm_chat_pick_t pick;
    memset(&pick, 0, sizeof pick);
    oai_family_ctx_t ctx = plain_ctx;
    ctx.pick = &pick;
    oai_req_t q;
    tdm_error_t err = {0};
    static const char body[] = "{" USER ", \"reasoning_effort\": \"high\"}";
    pick.jinja = ignores;
    assert_int_equal(oai_parse(OAI_CHAT, body, strlen(body), "m", &q, &err), TDM_OK);
    assert_int_equal(oai_apply_family(&q, &ctx, &err), TDM_EINVALID);
    assert_string_equal(err.field, "reasoning_effort");
    assert_non_null(strstr(err.msg, "does not read reasoning_effort"));
    oai_req_clear(&q);
    pick.jinja = reads;
    assert_int_equal(oai_parse(OAI_CHAT, body, strlen(body), "m", &q, &err), TDM_OK);
    assert_int_equal(oai_apply_family(&q, &ctx, &err), TDM_OK);
    assert_string_equal(q.creq.chat_template_kwargs, "{\"reasoning_effort\":\"high\"}");
    oai_req_clear(&q);
    static const char bad[] = "{" USER ", \"reasoning_effort\": \"max\"}";
    assert_int_equal(oai_parse(OAI_CHAT, bad, strlen(bad), "m", &q, &err), TDM_OK);
    assert_int_equal(oai_apply_family(&q, &ctx, &err), TDM_EINVALID);
    assert_string_equal(err.field, "reasoning_effort");
    oai_req_clear(&q);
    /* a request's own template is what decides */
    static const char own[] = "{" USER ", \"reasoning_effort\": \"low\", \"chat_template\": "
                              "\"{{ reasoning_effort }}\"}";
    pick.jinja = ignores;
    assert_int_equal(oai_parse(OAI_CHAT, own, strlen(own), "m", &q, &err), TDM_OK);
    assert_int_equal(oai_apply_family(&q, &ctx, &err), TDM_OK);
    assert_string_equal(q.creq.chat_template_kwargs, "{\"reasoning_effort\":\"low\"}");
    oai_req_clear(&q);
    static const char ir[] = "{" USER ", \"include_reasoning\": 1}";
    assert_int_equal(oai_parse(OAI_CHAT, ir, strlen(ir), "m", &q, &err), TDM_OK);
    assert_int_equal(oai_apply_family(&q, &ctx, &err), TDM_EINVALID);
    assert_string_equal(err.field, "include_reasoning");
    oai_req_clear(&q);
    tdm_jinja_destroy(&reads);
    tdm_jinja_destroy(&ignores);
}

static void test_reasoning_in_history(void **state)
{
    (void)state;
    static const char body[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"q\"}, {\"role\": "
        "\"assistant\", \"content\": \"a\", \"reasoning_content\": \"because\"}, {\"role\": "
        "\"user\", \"content\": \"q2\"}]}";
    oai_req_t q;
    tdm_error_t err = {0};
    assert_int_equal(oai_parse(OAI_CHAT, body, strlen(body), "m", &q, &err), TDM_OK);
    assert_string_equal(q.creq.messages[1].reasoning_content, "because");
    /* a template that reads it renders it */
    tdm_jinja_t *t = compile("{% for m in messages %}[{{ m.content }}|{{ m.reasoning_content }}]"
                             "{% endfor %}");
    tdm_chat_jinja_input_t in = {.msgs = q.creq.messages, .n = q.creq.n_messages, .now = -1};
    char *out = NULL;
    assert_int_equal(tdm_chat_apply_jinja(t, &in, &out, NULL, NULL, &err), TDM_OK);
    assert_string_equal(out, "[q|][a|because][q2|]");
    free(out);
    tdm_jinja_destroy(&t);
    oai_req_clear(&q);
    static const char on_user[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"q\", \"reasoning\": \"x\"}]}";
    assert_int_equal(oai_parse(OAI_CHAT, on_user, strlen(on_user), "m", &q, &err), TDM_EINVALID);
    assert_string_equal(err.field, "messages[0].reasoning");
    static const char not_string[] =
        "{\"messages\": [{\"role\": \"assistant\", \"content\": \"a\", "
        "\"reasoning_content\": 1}]}";
    assert_int_equal(oai_parse(OAI_CHAT, not_string, strlen(not_string), "m", &q, &err),
                     TDM_EINVALID);
    assert_string_equal(err.field, "messages[0].reasoning_content");
}

/* ---- responses ---- */

static const char thought_and_call[] =
    "<think>\nCall w.\n</think>\n\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": "
    "\"Paris\"}}\n</tool_call>";

static void test_reasoning_responses(void **state)
{
    (void)state;
    oai_req_t q;
    fitted("{" USER ", " TOOLS "}", OAI_TOOL_FORMAT_HERMES, OAI_REASONING_OPTIONAL, &q);
    tdm_client_usage_t usage;
    memset(&usage, 0, sizeof usage);
    tdm_client_chunk_t ch;
    memset(&ch, 0, sizeof ch);
    ch.text = thought_and_call;
    ch.text_len = strlen(ch.text);
    ch.last = true;
    ch.finish_reason = TDM_CLIENT_FINISH_STOP;
    ch.usage = &usage;
    oai_out_t o;
    memset(&o, 0, sizeof o);
    json_t *r = oai_response(&q, &o, &ch);
    json_t *choice = json_array_get(json_object_get(r, "choices"), 0);
    json_t *msg = json_object_get(choice, "message");
    assert_string_equal(json_string_value(json_object_get(msg, "reasoning_content")), "Call w.\n");
    assert_true(json_is_null(json_object_get(msg, "content")));
    json_t *fn = json_object_get(json_array_get(json_object_get(msg, "tool_calls"), 0), "function");
    assert_string_equal(json_string_value(json_object_get(fn, "name")), "w");
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "tool_calls");
    json_decref(r);

    /* streamed in 2-byte pieces: reasoning deltas, then the call */
    tdm_buf_t sse = TDM_BUF_INIT;
    size_t len = strlen(thought_and_call);
    for (size_t at = 0; at < len; at += 2) {
        char piece[3] = {0};
        size_t n = len - at < 2 ? len - at : 2;
        memcpy(piece, thought_and_call + at, n);
        memset(&ch, 0, sizeof ch);
        ch.text = piece;
        ch.text_len = n;
        if (at + 2 >= len) {
            ch.last = true;
            ch.finish_reason = TDM_CLIENT_FINISH_STOP;
            ch.usage = &usage;
        }
        assert_int_equal(oai_sse_chunk(&q, &o, &ch, &sse), TDM_OK);
    }
    tdm_buf_t reasoning = TDM_BUF_INIT, content = TDM_BUF_INIT;
    const char *name = NULL;
    json_t *keep = json_array();
    for (const char *ev = strstr(sse.data, "data: "); ev; ev = strstr(ev + 1, "data: ")) {
        json_t *c = json_loads(ev + 6, JSON_DISABLE_EOF_CHECK, NULL);
        assert_non_null(c);
        json_array_append_new(keep, c);
        json_t *d = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "delta");
        const char *s = json_string_value(json_object_get(d, "reasoning_content"));
        if (s)
            tdm_buf_puts(&reasoning, s);
        s = json_string_value(json_object_get(d, "content"));
        if (s)
            tdm_buf_puts(&content, s);
        json_t *tc = json_array_get(json_object_get(d, "tool_calls"), 0);
        if (json_string_value(json_object_get(json_object_get(tc, "function"), "name")))
            name = json_string_value(json_object_get(json_object_get(tc, "function"), "name"));
    }
    assert_string_equal(reasoning.data, "Call w.\n");
    assert_true(content.len == 0);
    assert_string_equal(name, "w");
    json_decref(keep);
    tdm_buf_free(&reasoning);
    tdm_buf_free(&content);
    tdm_buf_free(&sse);
    oai_out_clear(&o);
    oai_req_clear(&q);

    /* include_reasoning false: the reasoning is dropped, the answer kept */
    fitted("{" USER ", \"include_reasoning\": false}", OAI_TOOL_FORMAT_HERMES, OAI_REASONING_INSIDE,
           &q);
    memset(&ch, 0, sizeof ch);
    ch.text = "hidden</think>shown";
    ch.text_len = strlen(ch.text);
    ch.last = true;
    ch.finish_reason = TDM_CLIENT_FINISH_STOP;
    ch.usage = &usage;
    memset(&o, 0, sizeof o);
    r = oai_response(&q, &o, &ch);
    msg = json_object_get(json_array_get(json_object_get(r, "choices"), 0), "message");
    assert_true(json_is_null(json_object_get(msg, "reasoning_content")));
    assert_string_equal(json_string_value(json_object_get(msg, "content")), "shown");
    json_decref(r);
    oai_req_clear(&q);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_reasoning_parser),
        cmocka_unit_test(test_tool_formats),
        cmocka_unit_test(test_detection),
        cmocka_unit_test(test_required_grammars),
        cmocka_unit_test(test_grammar_after_reasoning),
        cmocka_unit_test(test_reasoning_effort),
        cmocka_unit_test(test_reasoning_responses),
        cmocka_unit_test(test_reasoning_in_history),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
