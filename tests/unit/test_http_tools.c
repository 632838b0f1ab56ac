/* test_http_tools.c - the HTTP gateway's tool calling (router/http_tools.c): the parser of
 * generated calls (whole, fed at every split point, malformed JSON kept as text, several
 * calls), request validation through oai_parse, and the responses' tool_calls shapes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "http_openai.h"

/* ---- the parser ---- */

#define CLOSE_LEN_T (sizeof "</tool_call>" - 1)

typedef struct parsed {
    tdm_buf_t content;
    oai_tool_parser_t p;
} parsed_t;

/* Feeds text cut at the offsets cuts[0..n_cuts) (increasing). */
static bool incremental_mode; /* the parser's incremental flag for parse_cut */

static void parse_cut(parsed_t *r, const char *text, bool parallel, const size_t *cuts,
                      size_t n_cuts)
{
    memset(r, 0, sizeof *r);
    oai_tool_parser_init(&r->p, parallel, incremental_mode);
    size_t len = strlen(text), at = 0;
    for (size_t k = 0; k <= n_cuts; k++) {
        size_t end = k < n_cuts ? cuts[k] : len;
        assert_int_equal(oai_tool_parser_feed(&r->p, text + at, end - at, k == n_cuts, &r->content),
                         TDM_OK);
        at = end;
    }
}

static void parse_whole(parsed_t *r, const char *text, bool parallel)
{
    parse_cut(r, text, parallel, NULL, 0);
}

static const char *content_of(const parsed_t *r)
{
    return r->content.data ? r->content.data : "";
}

static void parsed_free(parsed_t *r)
{
    tdm_buf_free(&r->content);
    oai_tool_parser_free(&r->p);
}

static void test_parser_one_call(void **state)
{
    (void)state;
    parsed_t r;
    parse_whole(&r,
                "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
                "\"days\": [1, 2.50]}}\n</tool_call>",
                true);
    assert_string_equal(content_of(&r), "");
    assert_int_equal(r.p.n_calls, 1);
    assert_string_equal(r.p.calls[0].name, "get_weather");
    /* the arguments exactly as generated (2.50 not re-written) */
    assert_string_equal(r.p.calls[0].arguments, "{\"city\": \"Paris\", \"days\": [1, 2.50]}");
    assert_int_equal(strncmp(r.p.calls[0].id, "call_", 5), 0);
    assert_int_equal(strlen(r.p.calls[0].id), 5 + 24);
    parsed_free(&r);
}

static const char two_calls[] =
    "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": \"}</tool_call>\"}}\n"
    "</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"b_2\"}\n</tool_call>\nDone.";

static void test_parser_several_calls(void **state)
{
    (void)state;
    parsed_t r;
    const char text[] = "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n"
                        "</tool_call>\n<tool_call>\n{\"arguments\": {}, \"name\": \"b_2\"}\n"
                        "</tool_call>\nDone.";
    parse_whole(&r, text, true);
    assert_string_equal(content_of(&r), "Let me check.Done.");
    assert_int_equal(r.p.n_calls, 2);
    assert_string_equal(r.p.calls[0].arguments, "{\"x\": 1}");
    assert_string_equal(r.p.calls[1].name, "b_2");
    assert_string_equal(r.p.calls[1].arguments, "{}");
    parsed_free(&r);

    /* parallel_tool_calls false: the second call stays text */
    parse_whole(&r, text, false);
    assert_int_equal(r.p.n_calls, 1);
    assert_string_equal(content_of(&r), "Let me check.<tool_call>\n{\"arguments\": {}, \"name\": "
                                        "\"b_2\"}\n</tool_call>\nDone.");
    parsed_free(&r);
}

/* Each call knows where it stands in the content its feed gave out (.at): the order the
 * Responses API keeps its items in. */
static void test_parser_call_places(void **state)
{
    (void)state;
    parsed_t r;
    const char text[] = "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n"
                        "</tool_call>\nWait.\n<tool_call>\n{\"name\": \"b\", \"arguments\": "
                        "{}}\n</tool_call>\nDone.";
    parse_whole(&r, text, true);
    assert_string_equal(content_of(&r), "Let me check.Wait.Done.");
    assert_int_equal(r.p.n_calls, 2);
    assert_int_equal(r.p.calls[0].at, strlen("Let me check."));
    assert_int_equal(r.p.calls[1].at, strlen("Let me check.Wait."));
    parsed_free(&r);
    /* fed in two pieces: .at counts the content of the piece that added the call */
    size_t cut = (size_t)(strstr(text, "Wait.") - text);
    parse_cut(&r, text, true, &cut, 1);
    assert_string_equal(content_of(&r), "Let me check.Wait.Done.");
    assert_int_equal(r.p.calls[0].at, strlen("Let me check."));
    assert_int_equal(r.p.calls[1].at, strlen("Wait."));
    parsed_free(&r);
}

/* A close tag inside a string: the body before it is not JSON, so that block is text; the
 * parser then goes on outside a call. */
static void test_parser_close_tag_in_string(void **state)
{
    (void)state;
    parsed_t r;
    parse_whole(&r, two_calls, true);
    assert_int_equal(r.p.n_calls, 1);
    assert_string_equal(r.p.calls[0].name, "b_2");
    assert_non_null(strstr(content_of(&r), "<tool_call>\n{\"name\": \"a\""));
    parsed_free(&r);
}

/* Every split point, every pair of split points and byte by byte give what the whole text
 * gives. */
static void test_parser_split_points(void **state)
{
    (void)state;
    static const char *const texts[] = {
        "Let me check.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": [1, {\"y\": "
        "\"<\"}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"b\", \"arguments\": \"{\\\"k\\\": "
        "2}\"}\n</tool_call>  ",
        "a < b <tool but <tool_call not closed",
        "x <tool_call>{\"name\": 1}</tool_call> y",
    };
    for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
        parsed_t whole;
        parse_whole(&whole, texts[t], true);
        size_t len = strlen(texts[t]);
        for (size_t i = 0; i <= len; i++) {
            for (size_t j = i; j <= len; j++) {
                size_t cuts[2] = {i, j};
                parsed_t r;
                parse_cut(&r, texts[t], true, cuts, 2);
                assert_string_equal(content_of(&r), content_of(&whole));
                assert_int_equal(r.p.n_calls, whole.p.n_calls);
                for (size_t k = 0; k < r.p.n_calls; k++) {
                    assert_string_equal(r.p.calls[k].name, whole.p.calls[k].name);
                    assert_string_equal(r.p.calls[k].arguments, whole.p.calls[k].arguments);
                }
                parsed_free(&r);
            }
        }
        size_t *bytes = calloc(len ? len : 1, sizeof *bytes);
        assert_non_null(bytes);
        for (size_t i = 0; i < len; i++)
            bytes[i] = i;
        parsed_t r;
        parse_cut(&r, texts[t], true, bytes, len);
        assert_string_equal(content_of(&r), content_of(&whole));
        assert_int_equal(r.p.n_calls, whole.p.n_calls);
        parsed_free(&r);
        free(bytes);
        if (t == 0) {
            assert_string_equal(content_of(&whole), "Let me check.");
            assert_int_equal(whole.p.n_calls, 2);
            assert_string_equal(whole.p.calls[0].arguments, "{\"x\": [1, {\"y\": \"<\"}]}");
            assert_string_equal(whole.p.calls[1].arguments, "{\"k\": 2}");
        } else {
            /* no call: the content is exactly the text */
            assert_string_equal(content_of(&whole), texts[t]);
            assert_int_equal(whole.p.n_calls, 0);
        }
        parsed_free(&whole);
    }
}

/* A long call (64 KiB of arguments, the unconstrained form, parsed at its close) fed in small
 * chunks gives the calls and content it gives whole, and each chunk's search for the close tag
 * starts where the last one stopped (less the bytes a split tag may begin in), so the held call
 * is not searched again from its start on every chunk; a close tag split across two chunks,
 * "</tool" + "_call>", is found. */
static void test_parser_long_call_scans_once(void **state)
{
    (void)state;
    tdm_buf_t text = TDM_BUF_INIT;
    tdm_buf_puts(&text, "Sure.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"s\": \"");
    for (int i = 0; i < 8192; i++)
        tdm_buf_puts(&text, "a</tool ");
    tdm_buf_puts(&text, "\"}}\n</tool_call> done");
    assert_false(text.oom);
    parsed_t whole;
    parse_whole(&whole, text.data, true);
    assert_int_equal(whole.p.n_calls, 1);
    assert_int_equal(strlen(whole.p.calls[0].arguments), 7 + 8192 * 8 + 2);
    assert_string_equal(content_of(&whole), "Sure.done"); /* whitespace around calls goes */
    for (size_t step = 5; step <= 7; step++) {            /* 7: the tag's "</tool" ends a chunk */
        parsed_t r;
        memset(&r, 0, sizeof r);
        oai_tool_parser_init(&r.p, true, false);
        size_t len = text.len, at = 0, in_call_fed = 0;
        while (at < len) {
            size_t n = len - at < step ? len - at : step;
            bool last = at + n == len;
            assert_int_equal(oai_tool_parser_feed(&r.p, text.data + at, n, last, &r.content),
                             TDM_OK);
            at += n;
            if (r.p.in_call && !last) {
                in_call_fed += n;
                /* what is held is searched up to its last 11 bytes, no further back */
                assert_int_equal(r.p.close_scan, r.p.hold.len > 11 ? r.p.hold.len - 11 : 0);
            }
        }
        assert_true(in_call_fed > 8192 * 8);
        assert_int_equal(r.p.n_calls, 1);
        assert_string_equal(r.p.calls[0].name, "w");
        assert_string_equal(r.p.calls[0].arguments, whole.p.calls[0].arguments);
        assert_string_equal(content_of(&r), content_of(&whole));
        parsed_free(&r);
    }
    parsed_free(&whole);
    tdm_buf_free(&text);
}

/* Incremental (constrained output): the same calls at every pair of split points as parsed
 * whole, and the open call's arguments grow before its close tag arrives. */
static void test_parser_incremental(void **state)
{
    (void)state;
    static const char text[] =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", "
        "\"n\": [1, {\"a\": \"}\"}]}}\n</tool_call>\n<tool_call>\n{\"name\": \"t\", "
        "\"arguments\": {}}\n</tool_call>";
    parsed_t whole;
    parse_whole(&whole, text, true);
    assert_int_equal(whole.p.n_calls, 2);
    size_t len = strlen(text);
    incremental_mode = true;
    for (size_t i = 0; i <= len; i++) {
        for (size_t j = i; j <= len; j++) {
            size_t cuts[2] = {i, j};
            parsed_t r;
            parse_cut(&r, text, true, cuts, 2);
            assert_string_equal(content_of(&r), "");
            assert_int_equal(r.p.n_calls, 2);
            for (size_t k = 0; k < 2; k++) {
                assert_string_equal(r.p.calls[k].name, whole.p.calls[k].name);
                assert_string_equal(r.p.calls[k].arguments, whole.p.calls[k].arguments);
            }
            parsed_free(&r);
        }
    }
    /* fed up to the middle of the first call's arguments: the call is open, its arguments
     * so far are there, less the bytes that could be the call's end */
    oai_tool_parser_t p;
    oai_tool_parser_init(&p, true, true);
    tdm_buf_t content = TDM_BUF_INIT;
    const char *mid = strstr(text, "[1,");
    assert_int_equal(oai_tool_parser_feed(&p, text, (size_t)(mid - text) + 3, false, &content),
                     TDM_OK);
    assert_int_equal(p.n_calls, 1);
    assert_string_equal(p.calls[0].name, "get_weather");
    assert_string_equal(p.calls[0].arguments, "{\"city\": \"Pa"); /* 14 bytes held */
    /* a call in another form is parsed whole, as without incremental */
    assert_int_equal(oai_tool_parser_feed(&p, mid + 3, strlen(mid + 3), false, &content), TDM_OK);
    static const char other[] = "\n<tool_call>{\"arguments\": {}, \"name\": \"x\"}</tool_call>";
    assert_int_equal(oai_tool_parser_feed(&p, other, strlen(other), true, &content), TDM_OK);
    assert_int_equal(p.n_calls, 3);
    assert_string_equal(p.calls[2].name, "x");
    assert_string_equal(p.calls[2].arguments, "{}");
    tdm_buf_free(&content);
    oai_tool_parser_free(&p);
    incremental_mode = false;
    parsed_free(&whole);
}

static void test_parser_malformed_stays_text(void **state)
{
    (void)state;
    static const char *const bad[] = {
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>",
        "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                 /* no name */
        "<tool_call>\n{\"name\": \"\", \"arguments\": {}}\n</tool_call>", /* empty name */
        "<tool_call>\n[\"f\"]\n</tool_call>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": 3}\n</tool_call>",
        "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": 1}", /* cut at max_tokens */
        "text then <tool_call>",
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        parsed_t r;
        parse_whole(&r, bad[i], true);
        assert_int_equal(r.p.n_calls, 0);
        assert_string_equal(content_of(&r), bad[i]);
        parsed_free(&r);
    }
    /* a call without its close tag at the very end still counts when its JSON is whole */
    parsed_t r;
    parse_whole(&r, "<tool_call>\n{\"name\": \"f\", \"parameters\": {\"a\": 1}}", true);
    assert_int_equal(r.p.n_calls, 1);
    assert_string_equal(r.p.calls[0].arguments, "{\"a\": 1}");
    parsed_free(&r);
}

/* An output cut by max_tokens (cut set) at every byte of its second call: the first call
 * and the text before it are kept, the cut call is not content. Parsed whole, the second call
 * counts once its JSON is whole; incremental (constrained output), once its head is seen, with
 * the arguments generated so far, as they were streamed. Fed whole and byte by byte. */
static void test_parser_cut_by_max_tokens(void **state)
{
    (void)state;
    static const char text[] =
        "Sure.\n<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Pa\"}}\n"
        "</tool_call>";
    const char *second = strstr(text, "</tool_call>") + CLOSE_LEN_T;
    size_t from = (size_t)(second - text);
    size_t head_end = (size_t)(strstr(second, "{\"city") - text);
    size_t args_end = (size_t)(strstr(second, "}}") - text) + 1; /* after the arguments */
    size_t json_end = args_end + 1;                              /* after the call object */
    size_t close_at = (size_t)(strstr(second, "</tool_call>") - text);
    for (int inc = 0; inc < 2; inc++) {
        for (size_t len = from; len < close_at + CLOSE_LEN_T; len++) {
            for (int bytewise = 0; bytewise < 2; bytewise++) {
                oai_tool_parser_t p;
                oai_tool_parser_init(&p, true, inc);
                p.cut = true;
                tdm_buf_t ct = TDM_BUF_INIT;
                for (size_t at = 0; bytewise && at < len; at++)
                    assert_int_equal(oai_tool_parser_feed(&p, text + at, 1, false, &ct), TDM_OK);
                assert_int_equal(oai_tool_parser_feed(&p, text, bytewise ? 0 : len, true, &ct),
                                 TDM_OK);
                bool two = inc ? len >= head_end : len >= json_end;
                if (strcmp(ct.data ? ct.data : "", "Sure.") != 0 || p.n_calls != 1u + two)
                    fail_msg("incremental %d cut at %zu: content '%s', %zu calls", inc, len,
                             ct.data ? ct.data : "", p.n_calls);
                assert_string_equal(p.calls[0].name, "a");
                assert_string_equal(p.calls[0].arguments, "{\"x\": 1}");
                if (two) {
                    size_t alen = (len < args_end ? len : args_end) - head_end;
                    while (alen > 0 && text[head_end + alen - 1] == ' ')
                        alen--; /* trailing whitespace is not given */
                    assert_string_equal(p.calls[1].name, "get_weather");
                    if (strlen(p.calls[1].arguments) != alen ||
                        memcmp(p.calls[1].arguments, text + head_end, alen) != 0)
                        fail_msg("incremental %d cut at %zu: arguments '%s'", inc, len,
                                 p.calls[1].arguments);
                }
                tdm_buf_free(&ct);
                oai_tool_parser_free(&p);
            }
        }
    }
    /* auto: text, then a call cut inside its tag or body: the text stays, the markup goes */
    static const char *const cut_calls[] = {"Let me check. <tool_ca",
                                            "Let me check.\n<tool_call>\n{\"name\": \"get_wea"};
    for (size_t i = 0; i < 2; i++) {
        oai_tool_parser_t p;
        oai_tool_parser_init(&p, true, false);
        p.cut = true;
        tdm_buf_t ct = TDM_BUF_INIT;
        assert_int_equal(oai_tool_parser_feed(&p, cut_calls[i], strlen(cut_calls[i]), true, &ct),
                         TDM_OK);
        assert_string_equal(ct.data, "Let me check.");
        assert_int_equal(p.n_calls, 0);
        tdm_buf_free(&ct);
        oai_tool_parser_free(&p);
    }
}

/* ---- requests ---- */

static int parse_chat(const char *body, oai_req_t *q, tdm_error_t *err)
{
    return oai_parse(OAI_CHAT, body, strlen(body), "m", q, err);
}

static void expect_bad(const char *body, const char *want_param, const char *want_msg)
{
    oai_req_t q;
    tdm_error_t err = {0};
    int rc = parse_chat(body, &q, &err);
    if (rc != TDM_EINVALID || strcmp(err.field, want_param) != 0 || !strstr(err.msg, want_msg))
        fail_msg("%s: rc %d param '%s' message '%s'", body, rc, err.field, err.msg);
}

#define USER "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]"
#define TOOL_A "{\"type\": \"function\", \"function\": {\"name\": \"a\"}}"

static void test_request_validation(void **state)
{
    (void)state;
    expect_bad("{" USER ", \"tools\": [" TOOL_A ", {\"type\": \"function\", \"function\": "
               "{\"name\": \"bad name\"}}]}",
               "tools[1].function.name", "tools[1].function.name");
    expect_bad("{" USER ", \"tools\": [" TOOL_A ", " TOOL_A "]}", "tools[1].function.name",
               "twice");
    expect_bad("{" USER ", \"tools\": [{\"type\": \"retrieval\"}]}", "tools[0].type", "function");
    expect_bad("{" USER ", \"tools\": {}}", "tools", "array");
    expect_bad("{" USER ", \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"a\", "
               "\"parameters\": []}}]}",
               "tools[0].function.parameters", "object");
    expect_bad("{" USER ", \"tools\": [" TOOL_A "], \"tool_choice\": {\"type\": \"function\", "
               "\"function\": {\"name\": \"zzz\"}}}",
               "tool_choice", "'zzz'");
    expect_bad("{" USER ", \"tools\": [" TOOL_A "], \"tool_choice\": \"sometimes\"}", "tool_choice",
               "required");
    expect_bad("{" USER ", \"tool_choice\": \"required\"}", "tool_choice", "needs tools");
    expect_bad("{" USER ", \"tools\": [" TOOL_A "], \"parallel_tool_calls\": 1}",
               "parallel_tool_calls", "boolean");
    expect_bad("{" USER ", \"tools\": [" TOOL_A "], \"response_format\": {\"type\": "
               "\"json_schema\", \"json_schema\": {\"name\": \"x\", \"schema\": {}}}}",
               "response_format", "tools");
    expect_bad("{" USER ", \"tools\": [" TOOL_A "], \"guided_json\": {}}", "guided_json", "tools");
    expect_bad("{" USER ", \"tools\": [" TOOL_A "], \"functions\": [{\"name\": \"b\"}]}",
               "functions", "not both");
    expect_bad("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}, {\"role\": \"tool\", "
               "\"content\": \"x\"}]}",
               "messages[1].tool_call_id", "required");
    expect_bad("{\"messages\": [{\"role\": \"assistant\", \"content\": null, \"tool_calls\": "
               "[{\"type\": \"function\", \"function\": {\"arguments\": \"{}\"}}]}]}",
               "messages[0].tool_calls[0].function.name", "string");
    expect_bad("{\"messages\": [{\"role\": \"user\", \"content\": \"x\", \"tool_calls\": []}]}",
               "messages[0].tool_calls", "only assistant");
}

static void test_request_fields(void **state)
{
    (void)state;
    static const char body[] =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"weather?\"}, {\"role\": "
        "\"assistant\", \"content\": null, \"tool_calls\": [{\"id\": \"call_1\", \"type\": "
        "\"function\", \"function\": {\"name\": \"w\", \"arguments\": \"{\\\"c\\\": 1}\"}}]}, "
        "{\"role\": \"tool\", \"tool_call_id\": \"call_1\", \"content\": [{\"type\": \"text\", "
        "\"text\": \"sunny\"}]}], \"tools\": [{\"type\": \"function\", \"function\": {\"name\": "
        "\"w\", \"description\": \"d\", \"strict\": true, \"parameters\": {\"type\": "
        "\"object\"}}}], \"parallel_tool_calls\": false}";
    oai_req_t q;
    tdm_error_t err = {0};
    assert_int_equal(parse_chat(body, &q, &err), TDM_OK);
    assert_true(q.tools.parse);
    assert_false(q.tools.parallel);
    assert_int_equal(q.tools.choice, OAI_TOOL_CHOICE_AUTO);
    /* normalized: strict dropped, key order kept */
    assert_string_equal(q.creq.tools, "[{\"type\":\"function\",\"function\":{\"name\":\"w\","
                                      "\"description\":\"d\",\"parameters\":{\"type\":"
                                      "\"object\"}}}]");
    assert_int_equal(q.creq.n_messages, 3);
    assert_string_equal(q.creq.messages[1].content, "");
    assert_string_equal(q.creq.messages[1].tool_calls,
                        "[{\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"w\","
                        "\"arguments\":\"{\\\"c\\\": 1}\"}}]");
    assert_string_equal(q.creq.messages[2].role, "tool");
    assert_string_equal(q.creq.messages[2].tool_call_id, "call_1");
    assert_string_equal(q.creq.messages[2].content, "sunny");
    assert_int_equal(q.creq.constraint_kind, TDM_CLIENT_CONSTRAINT_NONE);
    oai_req_clear(&q);

    /* tool_choice none: tools still rendered, nothing parsed; legacy functions map to tools */
    static const char legacy[] = "{" USER ", \"functions\": [{\"name\": \"f\"}], "
                                 "\"function_call\": \"none\"}";
    assert_int_equal(parse_chat(legacy, &q, &err), TDM_OK);
    assert_false(q.tools.parse);
    assert_string_equal(q.creq.tools, "[{\"type\":\"function\",\"function\":{\"name\":\"f\"}}]");
    oai_req_clear(&q);

    /* no tools: nothing changes */
    assert_int_equal(parse_chat("{" USER "}", &q, &err), TDM_OK);
    assert_false(q.tools.parse);
    assert_null(q.creq.tools);
    assert_string_equal(q.creq.messages[0].tool_calls, ""); /* the proto default */
    oai_req_clear(&q);
}

/* ---- responses ---- */

static const char generated[] =
    "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"Paris\"}}\n</tool_call>";

/* The non-streamed response to text ended by finish, with o the answer's output state (the
 * caller clears it). */
static json_t *whole_response(oai_req_t *q, oai_out_t *o, const char *text,
                              tdm_client_finish_t finish)
{
    tdm_client_usage_t usage;
    memset(&usage, 0, sizeof usage);
    tdm_client_chunk_t ch;
    memset(&ch, 0, sizeof ch);
    ch.text = text;
    ch.text_len = strlen(text);
    ch.last = true;
    ch.finish_reason = finish;
    ch.usage = &usage;
    json_t *r = oai_response(q, o, &ch);
    assert_non_null(r);
    return r;
}

/* Streams text through oai_sse_chunk in pieces of `piece` bytes (the whole text when it is
 * shorter), the last one ended by finish; the events are appended to sse. */
static void stream_text(oai_req_t *q, oai_out_t *o, const char *text, size_t piece,
                        tdm_client_finish_t finish, tdm_buf_t *sse)
{
    tdm_client_usage_t usage;
    memset(&usage, 0, sizeof usage);
    size_t len = strlen(text);
    for (size_t at = 0; at < len; at += piece) {
        size_t n = len - at < piece ? len - at : piece;
        char *part = strndup(text + at, n); /* a chunk's own NUL-terminated text */
        assert_non_null(part);
        tdm_client_chunk_t ch;
        memset(&ch, 0, sizeof ch);
        ch.text = part;
        ch.text_len = n;
        if (at + n >= len) {
            ch.last = true;
            ch.finish_reason = finish;
            ch.usage = &usage;
        }
        assert_int_equal(oai_sse_chunk(q, o, &ch, sse), TDM_OK);
        free(part);
    }
}

static oai_req_t *tool_request(void)
{
    static oai_req_t q;
    tdm_error_t err = {0};
    assert_int_equal(parse_chat("{" USER ", \"tools\": [" TOOL_A "]}", &q, &err), TDM_OK);
    return &q;
}

static void test_response_tool_calls(void **state)
{
    (void)state;
    oai_req_t *q = tool_request();
    oai_out_t o;
    memset(&o, 0, sizeof o);
    json_t *r = whole_response(q, &o, generated, TDM_CLIENT_FINISH_STOP);
    json_t *choice = json_array_get(json_object_get(r, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "tool_calls");
    json_t *msg = json_object_get(choice, "message");
    assert_true(json_is_null(json_object_get(msg, "content")));
    json_t *call = json_array_get(json_object_get(msg, "tool_calls"), 0);
    assert_string_equal(json_string_value(json_object_get(call, "type")), "function");
    json_t *fn = json_object_get(call, "function");
    assert_string_equal(json_string_value(json_object_get(fn, "name")), "w");
    assert_string_equal(json_string_value(json_object_get(fn, "arguments")), "{\"c\": \"Paris\"}");
    json_decref(r);

    /* length: a cut call is neither call nor content, and the reason stays length */
    r = whole_response(q, &o, "<tool_call>\n{\"name\": \"w\", \"argu", TDM_CLIENT_FINISH_LENGTH);
    choice = json_array_get(json_object_get(r, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "length");
    msg = json_object_get(choice, "message");
    assert_true(json_is_null(json_object_get(msg, "content")) ||
                strcmp(json_string_value(json_object_get(msg, "content")), "") == 0);
    assert_null(json_object_get(msg, "tool_calls"));
    json_decref(r);
    /* the same with a whole call before: that call, no content, length */
    r = whole_response(q, &o,
                       "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"Paris\"}}\n"
                       "</tool_call>\n<tool_call>\n{\"name\": \"w\", \"argu",
                       TDM_CLIENT_FINISH_LENGTH);
    choice = json_array_get(json_object_get(r, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "length");
    msg = json_object_get(choice, "message");
    assert_true(json_is_null(json_object_get(msg, "content")));
    assert_int_equal(json_array_size(json_object_get(msg, "tool_calls")), 1);
    json_decref(r);
    oai_req_clear(q);
}

static size_t reassemble_and_check(const char *sse);

/* One chunk holding text, a call and text again (a whole answer, or a chunk the gateway
 * coalesced): the deltas keep that order, parsed whole or incrementally. */
static void stream_order(bool constrained)
{
    oai_req_t *q = tool_request();
    if (constrained)
        q->tools.grammar = strdup("root ::= \"x\""); /* what oai_tools_request sets */
    oai_out_t o;
    memset(&o, 0, sizeof o);
    tdm_buf_t sse = TDM_BUF_INIT;
    char text[256];
    snprintf(text, sizeof text, "Before. %s\nAfter.", generated);
    stream_text(q, &o, text, sizeof text, TDM_CLIENT_FINISH_STOP, &sse); /* one chunk */
    tdm_buf_t order = TDM_BUF_INIT; /* c:TEXT for content, n:NAME, a:ARGS for a call */
    for (const char *ev = strstr(sse.data, "data: "); ev; ev = strstr(ev + 1, "data: ")) {
        json_t *c = json_loads(ev + 6, JSON_DISABLE_EOF_CHECK, NULL);
        assert_non_null(c);
        json_t *d = json_object_get(json_array_get(json_object_get(c, "choices"), 0), "delta");
        const char *t = json_string_value(json_object_get(d, "content"));
        json_t *fn =
            json_object_get(json_array_get(json_object_get(d, "tool_calls"), 0), "function");
        const char *name = json_string_value(json_object_get(fn, "name"));
        const char *args = json_string_value(json_object_get(fn, "arguments"));
        if (t && t[0])
            tdm_buf_printf(&order, "c:%s|", t);
        if (name)
            tdm_buf_printf(&order, "n:%s|", name);
        if (args && args[0])
            tdm_buf_printf(&order, "a:%s|", args);
        json_decref(c);
    }
    assert_string_equal(order.data, "c:Before.|n:w|a:{\"c\": \"Paris\"}|c:After.|");
    tdm_buf_free(&order);
    tdm_buf_free(&sse);
    oai_out_clear(&o);
    oai_req_clear(q);
}

static void test_stream_order(void **state)
{
    (void)state;
    stream_order(false);
    stream_order(true);
}

/* The SSE events of the text fed in pieces of 3 bytes reassemble to the call: parsed whole
 * (tool_choice auto) and streamed incrementally (a constrained request: several argument
 * deltas). */
static void stream_deltas(bool constrained)
{
    oai_req_t *q = tool_request();
    if (constrained)
        q->tools.grammar = strdup("root ::= \"x\""); /* what oai_tools_request sets */
    oai_out_t o;
    memset(&o, 0, sizeof o);
    tdm_buf_t sse = TDM_BUF_INIT;
    stream_text(q, &o, generated, 3, TDM_CLIENT_FINISH_STOP, &sse);
    size_t pieces = reassemble_and_check(sse.data);
    assert_true(constrained ? pieces > 3 : pieces == 1);
    tdm_buf_free(&sse);
    oai_out_clear(&o);
    oai_req_clear(q);
}

static void test_stream_deltas(void **state)
{
    (void)state;
    stream_deltas(false);
    stream_deltas(true);
}

/* The message a stream of text (3-byte pieces, finish reason length) reassembles to:
 * {"content": text or null, "tool_calls": [{"name", "arguments"}] or absent}, and its finish
 * reason (borrowed from a static). */
static json_t *streamed_message(oai_req_t *q, const char *text, const char **finish)
{
    static char reason[16];
    oai_out_t o;
    memset(&o, 0, sizeof o);
    tdm_buf_t sse = TDM_BUF_INIT, content = TDM_BUF_INIT;
    stream_text(q, &o, text, 3, TDM_CLIENT_FINISH_LENGTH, &sse);
    json_t *calls = json_array();
    for (const char *ev = strstr(sse.data, "data: "); ev; ev = strstr(ev + 1, "data: ")) {
        json_t *c = json_loads(ev + 6, JSON_DISABLE_EOF_CHECK, NULL);
        json_t *choice = json_array_get(json_object_get(c, "choices"), 0);
        json_t *d = json_object_get(choice, "delta");
        if (json_is_string(json_object_get(choice, "finish_reason")))
            snprintf(reason, sizeof reason, "%s",
                     json_string_value(json_object_get(choice, "finish_reason")));
        if (json_is_string(json_object_get(d, "content")))
            tdm_buf_puts(&content, json_string_value(json_object_get(d, "content")));
        json_t *tc = json_array_get(json_object_get(d, "tool_calls"), 0);
        if (tc) {
            size_t k = (size_t)json_integer_value(json_object_get(tc, "index"));
            json_t *fn = json_object_get(tc, "function");
            if (k == json_array_size(calls))
                json_array_append_new(
                    calls,
                    json_pack("{s:O, s:s}", "name", json_object_get(fn, "name"), "arguments", ""));
            json_t *call = json_array_get(calls, k);
            tdm_buf_t a = TDM_BUF_INIT;
            tdm_buf_puts(&a, json_string_value(json_object_get(call, "arguments")));
            tdm_buf_puts(&a, json_string_value(json_object_get(fn, "arguments")));
            json_object_set_new(call, "arguments", json_string(a.data ? a.data : ""));
            tdm_buf_free(&a);
        }
        json_decref(c);
    }
    json_t *m =
        json_pack("{s:o}", "content", content.len ? json_string(content.data) : json_null());
    if (json_array_size(calls) > 0)
        json_object_set(m, "tool_calls", calls);
    json_decref(calls);
    *finish = reason;
    tdm_buf_free(&sse);
    tdm_buf_free(&content);
    oai_out_clear(&o);
    return m;
}

/* The non-streamed response to text ended by max_tokens; its finish reason checked. */
static json_t *cut_response(oai_req_t *q, const char *text)
{
    oai_out_t o;
    memset(&o, 0, sizeof o);
    json_t *r = whole_response(q, &o, text, TDM_CLIENT_FINISH_LENGTH);
    json_t *choice = json_array_get(json_object_get(r, "choices"), 0);
    assert_string_equal(json_string_value(json_object_get(choice, "finish_reason")), "length");
    oai_out_clear(&o);
    return r;
}

/* An output cut by max_tokens inside its second call, at every byte: streamed and not, the
 * same calls (the first whole; the cut one only when constrained and named, as streamed),
 * the same content without markup, finish reason length. */
static void test_cut_stream_agrees(void **state)
{
    (void)state;
    static const char text[] =
        "Sure.\n<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"Paris\"}}\n</tool_call>\n"
        "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"c\": \"Rome\"}}\n</tool_call>";
    size_t from = (size_t)(strstr(text, "</tool_call>") - text) + 12;
    char cut[sizeof text];
    for (int constrained = 0; constrained < 2; constrained++) {
        oai_req_t *q = tool_request();
        if (constrained)
            q->tools.grammar = strdup("root ::= \"x\"");
        for (size_t len = from; len < sizeof text - 1; len++) {
            memcpy(cut, text, len);
            cut[len] = '\0';
            const char *finish = NULL;
            json_t *sm = streamed_message(q, cut, &finish);
            assert_string_equal(finish, "length");
            json_t *r = cut_response(q, cut);
            json_t *msg =
                json_object_get(json_array_get(json_object_get(r, "choices"), 0), "message");
            assert_string_equal(json_string_value(json_object_get(msg, "content")), "Sure.");
            assert_string_equal(json_string_value(json_object_get(sm, "content")), "Sure.");
            json_t *calls = json_object_get(msg, "tool_calls"),
                   *scalls = json_object_get(sm, "tool_calls");
            assert_true(json_array_size(calls) >= 1);
            assert_int_equal(json_array_size(calls), json_array_size(scalls));
            for (size_t k = 0; k < json_array_size(calls); k++) {
                json_t *fn = json_object_get(json_array_get(calls, k), "function");
                json_t *s = json_array_get(scalls, k);
                assert_true(json_equal(json_object_get(fn, "name"), json_object_get(s, "name")));
                if (!json_equal(json_object_get(fn, "arguments"), json_object_get(s, "arguments")))
                    fail_msg("constrained %d cut at %zu: '%s' streamed, '%s' not", constrained, len,
                             json_string_value(json_object_get(s, "arguments")),
                             json_string_value(json_object_get(fn, "arguments")));
            }
            json_decref(r);
            json_decref(sm);
        }
        oai_req_clear(q);
    }
}

/* Reassembles the SSE events: content deltas and tool_calls[index].function.arguments
 * pieces give back the call. Returns the number of non-empty argument pieces. */
static size_t reassemble_and_check(const char *sse)
{
    size_t pieces = 0;
    tdm_buf_t args = TDM_BUF_INIT, content = TDM_BUF_INIT;
    const char *name = NULL, *finish = NULL;
    json_t *keep = json_array();
    for (const char *ev = strstr(sse, "data: "); ev; ev = strstr(ev + 1, "data: ")) {
        json_t *c = json_loads(ev + 6, JSON_DISABLE_EOF_CHECK, NULL);
        assert_non_null(c);
        json_array_append_new(keep, c);
        json_t *choice = json_array_get(json_object_get(c, "choices"), 0);
        json_t *d = json_object_get(choice, "delta");
        if (json_is_string(json_object_get(choice, "finish_reason")))
            finish = json_string_value(json_object_get(choice, "finish_reason"));
        const char *text = json_string_value(json_object_get(d, "content"));
        if (text)
            tdm_buf_puts(&content, text);
        json_t *tc = json_array_get(json_object_get(d, "tool_calls"), 0);
        if (!tc)
            continue;
        assert_int_equal(json_integer_value(json_object_get(tc, "index")), 0);
        json_t *fn = json_object_get(tc, "function");
        if (json_object_get(fn, "name")) {
            assert_null(name); /* id and name come once, in the first delta */
            name = json_string_value(json_object_get(fn, "name"));
            assert_non_null(json_string_value(json_object_get(tc, "id")));
        }
        const char *piece = json_string_value(json_object_get(fn, "arguments"));
        pieces += piece[0] != '\0';
        tdm_buf_puts(&args, piece);
    }
    assert_string_equal(name, "w");
    assert_string_equal(args.data, "{\"c\": \"Paris\"}");
    assert_true(content.len == 0 || strcmp(content.data, "") == 0);
    assert_string_equal(finish, "tool_calls");
    json_decref(keep);
    tdm_buf_free(&args);
    tdm_buf_free(&content);
    return pieces;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parser_one_call),
        cmocka_unit_test(test_parser_several_calls),
        cmocka_unit_test(test_parser_call_places),
        cmocka_unit_test(test_parser_close_tag_in_string),
        cmocka_unit_test(test_parser_split_points),
        cmocka_unit_test(test_parser_long_call_scans_once),
        cmocka_unit_test(test_parser_incremental),
        cmocka_unit_test(test_parser_malformed_stays_text),
        cmocka_unit_test(test_parser_cut_by_max_tokens),
        cmocka_unit_test(test_request_validation),
        cmocka_unit_test(test_request_fields),
        cmocka_unit_test(test_response_tool_calls),
        cmocka_unit_test(test_stream_deltas),
        cmocka_unit_test(test_stream_order),
        cmocka_unit_test(test_cut_stream_agrees),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
