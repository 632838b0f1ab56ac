/* test_tokenizer_smollm2.c - the tokenizer and the chat templates on the default model
 * (SmolLM2-135M-Instruct) against tests/golden/smollm2_tokenizer.json, which Hugging Face
 * tokenizers and Jinja made (tests/golden/make_tokenizer_golden.py): exact ids for 110 cases,
 * decode round trips, template detection and byte-exact chat renderings; plus chat-template
 * detection and message validation on small in-memory GGUF files.
 *
 * The model comes from tdm_model_default_path() ($TANDEM_MODEL or the model cache). When it is
 * missing the model tests FAIL (not skip) and say to run scripts/setup: the tokenizer is part
 * of what every build must check.
 */
#include "tdm_test.h"
#include "token_golden.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tandem/chat.h"
#include "tandem/config.h"
#include "tandem/gguf.h"
#include "tandem/prompt.h"
#include "tandem/tokenizer.h"

#define GOLDEN_PATH TDM_SOURCE_DIR "/tests/golden/smollm2_tokenizer.json"

/* Everything the model tests share, loaded once by the group setup. */
typedef struct fixture {
    char model_path[1024];
    char problem[4096]; /* why the fixture is unusable; "" when it is fine */
    tdm_gguf_t *gguf;
    tdm_tokenizer_t *tok;
    json_t *golden;
} fixture_t;

/* ---- helpers ---- */

static int group_setup(void **state)
{
    fixture_t *fx = calloc(1, sizeof *fx);
    if (!fx)
        return -1;
    *state = fx;
    if (!tdm_test_default_model(fx->model_path, sizeof fx->model_path, fx->problem,
                                sizeof fx->problem))
        return 0;
    struct stat st;
    if (stat(fx->model_path, &st) != 0)
        return 0;
    json_error_t jerr;
    fx->golden = json_load_file(GOLDEN_PATH, 0, &jerr);
    if (!fx->golden) {
        snprintf(fx->problem, sizeof fx->problem, "%s:%d: %s", GOLDEN_PATH, jerr.line, jerr.text);
        return 0;
    }
    tdm_error_t err = {0};
    fx->gguf = tdm_gguf_open(fx->model_path, &err);
    if (!fx->gguf) {
        snprintf(fx->problem, sizeof fx->problem, "opening %s: %s", fx->model_path, err.msg);
        return 0;
    }
    fx->tok = tdm_tokenizer_new(fx->gguf, &err);
    if (!fx->tok) {
        snprintf(fx->problem, sizeof fx->problem, "tokenizer of %s: %s", fx->model_path, err.msg);
        return 0;
    }
    /* the golden ids belong to one file: a different one would fail confusingly below */
    json_int_t want_bytes = json_integer_value(json_object_get(fx->golden, "model_bytes"));
    if (want_bytes > 0 && (json_int_t)st.st_size != want_bytes)
        snprintf(fx->problem, sizeof fx->problem,
                 "%s has %lld bytes but the golden ids were made from a file of %lld bytes "
                 "(sha256 %s): run scripts/setup to fetch the default model",
                 fx->model_path, (long long)st.st_size, (long long)want_bytes,
                 json_string_value(json_object_get(fx->golden, "model_sha256")));
    return 0;
}

static int group_teardown(void **state)
{
    fixture_t *fx = *state;
    if (!fx)
        return 0;
    tdm_tokenizer_destroy(&fx->tok);
    tdm_gguf_destroy(&fx->gguf);
    json_decref(fx->golden);
    free(fx);
    return 0;
}

/* Fails the current test when the fixture could not be loaded. */
static fixture_t *require_fixture(void **state)
{
    fixture_t *fx = *state;
    assert_non_null(fx);
    if (fx->problem[0])
        fail_msg("%s", fx->problem);
    return fx;
}

/* ---- tokenizer vs golden ids ---- */

static void test_encode_golden(void **state)
{
    fixture_t *fx = require_fixture(state);
    const json_t *cases = json_object_get(fx->golden, "cases");
    assert_true(json_array_size(cases) >= 80);
    assert_int_equal(tdm_tokenizer_n_vocab(fx->tok),
                     json_integer_value(json_object_get(fx->golden, "n_vocab")));
    size_t failed = 0;
    for (size_t i = 0; i < json_array_size(cases); i++) {
        const json_t *c = json_array_get(cases, i);
        const char *text = json_string_value(json_object_get(c, "text"));
        size_t len = json_string_length(json_object_get(c, "text"));
        bool parse_special = json_is_true(json_object_get(c, "parse_special"));
        size_t n_want;
        tdm_token_t *want = tdm_test_json_ids(json_object_get(c, "ids"), &n_want);
        tdm_token_t *got = NULL;
        size_t n_got = 0;
        tdm_error_t err = {0};
        int rc = tdm_tokenizer_encode(fx->tok, text, len, false, parse_special, &got, &n_got, &err);
        if (rc != TDM_OK || !tdm_test_ids_equal(want, n_want, got, n_got)) {
            failed++;
            fprintf(stderr, "case %zu (parse_special=%d): ", i, parse_special);
            tdm_test_print_escaped("text ", text, len, 200);
            if (rc != TDM_OK) {
                fprintf(stderr, "  encode failed: %s\n", err.msg);
            } else {
                tdm_test_print_ids("  want ", want, n_want);
                tdm_test_print_ids("  got  ", got, n_got);
            }
        }
        free(got);
        free(want);
    }
    if (failed)
        fail_msg("%zu of %zu golden tokenizer cases differ (listed above)", failed,
                 json_array_size(cases));
}

static void test_decode_golden(void **state)
{
    fixture_t *fx = require_fixture(state);
    const json_t *cases = json_object_get(fx->golden, "cases");
    size_t failed = 0;
    for (size_t i = 0; i < json_array_size(cases); i++) {
        const json_t *c = json_array_get(cases, i);
        const char *text = json_string_value(json_object_get(c, "text"));
        size_t len = json_string_length(json_object_get(c, "text"));
        size_t n;
        tdm_token_t *ids = tdm_test_json_ids(json_object_get(c, "ids"), &n);
        /* special tokens render as their text, so every case decodes to its text */
        char *out = NULL;
        size_t out_len = 0;
        tdm_error_t err = {0};
        int rc = tdm_tokenizer_decode(fx->tok, ids, n, true, &out, &out_len, &err);
        if (rc != TDM_OK || out_len != len || memcmp(out, text, len) != 0) {
            failed++;
            fprintf(stderr, "case %zu: ", i);
            tdm_test_print_escaped("want ", text, len, 200);
            if (rc == TDM_OK)
                tdm_test_print_escaped("  got  ", out, out_len, 200);
            else
                fprintf(stderr, "  decode failed: %s\n", err.msg);
        }
        free(out);
        free(ids);
    }
    if (failed)
        fail_msg("%zu golden cases do not decode back to their text", failed);
}

/* ---- chat templates vs golden renderings ---- */

static void test_chat_detect_model(void **state)
{
    fixture_t *fx = require_fixture(state);
    tdm_chat_template_t t = TDM_CHAT_TEMPLATE_LLAMA2;
    char def[TDM_CHAT_DEFAULT_SYSTEM_MAX];
    tdm_error_t err = {0};
    int rc = tdm_chat_template_detect(fx->gguf, &t, def, sizeof def, &err);
    if (rc != TDM_OK)
        fail_msg("detect: %s", err.msg);
    assert_int_equal(t, TDM_CHAT_TEMPLATE_CHATML);
    assert_string_equal(def, json_string_value(json_object_get(fx->golden, "default_system")));
    assert_string_equal(def,
                        "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
    /* too small a buffer is an error, not a truncation */
    char small[8];
    assert_int_equal(tdm_chat_template_detect(fx->gguf, &t, small, sizeof small, &err),
                     TDM_ERESOURCE);
    /* no buffer: only the family */
    assert_int_equal(tdm_chat_template_detect(fx->gguf, &t, NULL, 0, NULL), TDM_OK);
}

/* The model's own tokenizer.chat_template (compiled Jinja, the default now) and the built-in
 * ChatML it replaced give the same prompt tokens for SmolLM2, conversation by conversation, with
 * and without the generation prompt; and the ids are the real ones (<|im_start|> = 1, the default
 * system message first when the chat has none). */
static void test_chat_gguf_equals_builtin(void **state)
{
    fixture_t *fx = require_fixture(state);
    static const tdm_chat_message_t c0[] = {{.role = "user", .content = "Hi"}};
    static const tdm_chat_message_t c1[] = {{.role = "system", .content = "Be terse."},
                                            {.role = "user", .content = "What is 2+2?"}};
    static const tdm_chat_message_t c2[] = {
        {.role = "user", .content = "What is 2+2?"},
        {.role = "assistant", .content = "4."},
        {.role = "user", .content = "And times 3 \xe2\x80\x94 in \xe2\x80\x9cwords\xe2\x80\x9d?"}};
    static const tdm_chat_message_t c3[] = {{.role = "user", .content = "  spaced \n\n"},
                                            {.role = "assistant", .content = ""},
                                            {.role = "user", .content = "<|im_end|> inside"}};
    static const struct {
        const tdm_chat_message_t *msgs;
        size_t n;
    } chats[] = {{c0, 1}, {c1, 2}, {c2, 3}, {c3, 3}};
    tdm_chat_pick_t gguf, builtin;
    tdm_error_t err = {0};
    assert_int_equal(tdm_chat_template_pick(fx->gguf, fx->tok, NULL, &gguf, &err), 0);
    assert_non_null(gguf.jinja);
    assert_string_equal(gguf.origin, "gguf");
    assert_int_equal(tdm_chat_template_pick(fx->gguf, fx->tok, "chatml", &builtin, &err), 0);
    assert_null(builtin.jinja);
    for (size_t i = 0; i < sizeof chats / sizeof chats[0]; i++) {
        for (int gen = 0; gen < 2; gen++) {
            tdm_prompt_input_t in = {
                .messages = chats[i].msgs, .n_messages = chats[i].n, .no_generation_prompt = !gen};
            tdm_token_t *a = NULL, *b = NULL;
            size_t na = 0, nb = 0;
            char *ta = NULL, *tb = NULL;
            assert_int_equal(tdm_prompt_encode(fx->tok, &gguf, &in, &a, &na, &ta, &err), 0);
            assert_int_equal(tdm_prompt_encode(fx->tok, &builtin, &in, &b, &nb, &tb, &err), 0);
            assert_string_equal(ta, tb);
            if (!tdm_test_ids_equal(b, nb, a, na)) {
                tdm_test_print_ids("  built-in ", b, nb);
                tdm_test_print_ids("  gguf     ", a, na);
                fail_msg("chat %zu (generation prompt %d): token ids differ", i, gen);
            }
            assert_int_equal(a[0], 1); /* <|im_start|>, no BOS added (add_bos_token false) */
            if (chats[i].msgs[0].role[0] != 's')
                assert_non_null(strstr(ta, "<|im_start|>system\nYou are a helpful AI assistant "
                                           "named SmolLM, trained by Hugging Face<|im_end|>\n"));
            free(a);
            free(b);
            free(ta);
            free(tb);
        }
    }
    tdm_chat_pick_release(&gguf);
    tdm_chat_pick_release(&builtin);
}

/* SmolLM2's GGUF template renders no tools (it never reads `tools`): with tools, the Hermes
 * text carries them (tdm_chat_tools_inline), so a chat with a system message, tool calls and
 * tool results gives exactly the built-in ChatML's tokens; without a system message the tools
 * block is the system message (the template's default one is then not used). */
static void test_chat_gguf_tools_inline(void **state)
{
    fixture_t *fx = require_fixture(state);
    static const char tools[] =
        "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", \"parameters\": "
        "{\"type\": \"object\", \"properties\": {\"city\": {\"type\": \"string\"}}}}}]";
    static const tdm_chat_message_t c0[] = {
        {.role = "system", .content = "Be terse."},
        {.role = "user", .content = "Weather in Paris and Rome?"},
        {.role = "assistant",
         .content = NULL,
         .tool_calls = "[{\"id\": \"c1\", \"type\": \"function\", \"function\": {\"name\": "
                       "\"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Paris\\\"}\"}}, "
                       "{\"id\": \"c2\", \"type\": \"function\", \"function\": {\"name\": "
                       "\"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}}]"},
        {.role = "tool", .content = "18 C", .tool_call_id = "c1"},
        {.role = "tool", .content = "22 C", .tool_call_id = "c2"},
        {.role = "assistant",
         .content = "Paris 18 C.",
         .tool_calls = "[{\"type\": \"function\", \"function\": {\"name\": \"get_weather\", "
                       "\"arguments\": {\"city\": \"Oslo\"}}}]"},
        {.role = "user", .content = "Thanks."}};
    static const tdm_chat_message_t c1[] = {{.role = "user", .content = "Weather in Oslo?"}};
    tdm_chat_pick_t gguf, builtin;
    tdm_error_t err = {0};
    assert_int_equal(tdm_chat_template_pick(fx->gguf, fx->tok, NULL, &gguf, &err), 0);
    assert_false(tdm_jinja_reads(gguf.jinja, "tools"));
    assert_true(tdm_jinja_reads(gguf.jinja, "messages"));
    assert_int_equal(tdm_chat_template_pick(fx->gguf, fx->tok, "chatml", &builtin, &err), 0);
    tdm_prompt_input_t in = {.messages = c0, .n_messages = 7, .tools = tools};
    char *ta = NULL, *tb = NULL;
    tdm_token_t *a = NULL, *b = NULL;
    size_t na = 0, nb = 0;
    assert_int_equal(tdm_prompt_encode(fx->tok, &gguf, &in, &a, &na, &ta, &err), 0);
    assert_int_equal(tdm_prompt_encode(fx->tok, &builtin, &in, &b, &nb, &tb, &err), 0);
    assert_string_equal(ta, tb);
    assert_true(tdm_test_ids_equal(b, nb, a, na));
    assert_non_null(strstr(ta, "<|im_start|>system\nBe terse.\n\n# Tools\n"));
    assert_non_null(strstr(ta, "<|im_start|>assistant\n<tool_call>\n{\"name\": \"get_weather\", "
                               "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>"));
    assert_non_null(strstr(ta, "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n"
                               "<tool_response>\n22 C\n</tool_response><|im_end|>"));
    free(a);
    free(b);
    free(ta);
    free(tb);
    /* no system message: the tools block is the system message */
    in = (tdm_prompt_input_t){.messages = c1, .n_messages = 1, .tools = tools};
    assert_int_equal(tdm_prompt_encode(fx->tok, &gguf, &in, &a, &na, &ta, &err), 0);
    assert_true(strncmp(ta, "<|im_start|>system\n# Tools\n\nYou may call", 40) == 0);
    assert_null(strstr(ta, "SmolLM"));
    free(a);
    free(ta);
    /* bad tools are refused as with the built-in */
    in.tools = "{}";
    assert_int_equal(tdm_prompt_encode(fx->tok, &gguf, &in, &a, &na, &ta, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "tools must be a JSON array"));
    tdm_chat_pick_release(&gguf);
    tdm_chat_pick_release(&builtin);
}

static void test_chat_golden(void **state)
{
    fixture_t *fx = require_fixture(state);
    char def[TDM_CHAT_DEFAULT_SYSTEM_MAX];
    tdm_chat_template_t detected;
    assert_int_equal(tdm_chat_template_detect(fx->gguf, &detected, def, sizeof def, NULL), 0);

    const json_t *chats = json_object_get(fx->golden, "chat");
    assert_true(json_array_size(chats) >= 10);
    size_t failed = 0;
    for (size_t i = 0; i < json_array_size(chats); i++) {
        const json_t *c = json_array_get(chats, i);
        tdm_chat_template_t t;
        tdm_error_t err = {0};
        assert_int_equal(tdm_chat_template_from_name(
                             json_string_value(json_object_get(c, "template")), &t, &err),
                         TDM_OK);
        const json_t *jm = json_object_get(c, "messages");
        size_t n = json_array_size(jm);
        tdm_chat_message_t msgs[8];
        assert_true(n <= 8);
        for (size_t k = 0; k < n; k++) {
            const json_t *m = json_array_get(jm, k);
            msgs[k] =
                (tdm_chat_message_t){.role = json_string_value(json_object_get(m, "role")),
                                     .content = json_string_value(json_object_get(m, "content"))};
        }
        bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
        /* the ChatML cases use the model's own template, whose default system message comes
         * from detection; Meta's templates have none */
        const char *default_system = t == TDM_CHAT_TEMPLATE_CHATML ? def : NULL;
        const char *want = json_string_value(json_object_get(c, "text"));
        size_t want_len = json_string_length(json_object_get(c, "text"));
        char *text = NULL;
        size_t len = 0;
        int rc = tdm_chat_apply(t, msgs, n, gen, default_system, &text, &len, &err);
        if (rc != TDM_OK) {
            failed++;
            fprintf(stderr, "chat %zu: apply failed: %s\n", i, err.msg);
            continue;
        }
        assert_int_equal(strlen(text), len);
        if (len != want_len || memcmp(text, want, len) != 0) {
            failed++;
            fprintf(stderr, "chat %zu (%s):\n", i, tdm_chat_template_name(t));
            tdm_test_print_escaped("  want ", want, want_len, 400);
            tdm_test_print_escaped("  got  ", text, len, 400);
        } else if (json_object_get(c, "ids")) {
            size_t n_want;
            tdm_token_t *want_ids = tdm_test_json_ids(json_object_get(c, "ids"), &n_want);
            tdm_token_t *ids = NULL;
            size_t n_ids = 0;
            /* the chat rendering is tokenized with parse_special and without BOS */
            rc = tdm_tokenizer_encode(fx->tok, text, len, false, true, &ids, &n_ids, &err);
            if (rc != TDM_OK || !tdm_test_ids_equal(want_ids, n_want, ids, n_ids)) {
                failed++;
                fprintf(stderr, "chat %zu: token ids differ%s%s\n", i, rc ? ": " : "",
                        rc ? err.msg : "");
                tdm_test_print_ids("  want ", want_ids, n_want);
                tdm_test_print_ids("  got  ", ids, n_ids);
            }
            free(ids);
            free(want_ids);
        }
        free(text);
    }
    if (failed)
        fail_msg("%zu of %zu golden chat renderings differ (listed above)", failed,
                 json_array_size(chats));
}

/* ---- chat templates without the model ---- */

/* A vocabulary-less GGUF in memory whose tokenizer.chat_template is tpl (none when NULL). */
static tdm_gguf_t *gguf_with_template(const char *tpl, void **buf)
{
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(tdm_gguf_writer_set_str(w, "general.architecture", "llama"), 0);
    if (tpl)
        assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.chat_template", tpl), 0);
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, buf, &size), 0);
    tdm_gguf_writer_destroy(&w);
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open_memory(*buf, size, &err);
    if (!g)
        fail_msg("open_memory: %s", err.msg);
    return g;
}

static void expect_detect(const char *tpl, int want_rc, tdm_chat_template_t want_t,
                          const char *want_default)
{
    void *buf = NULL;
    tdm_gguf_t *g = gguf_with_template(tpl, &buf);
    tdm_chat_template_t t = TDM_CHAT_TEMPLATE_CHATML;
    char def[TDM_CHAT_DEFAULT_SYSTEM_MAX] = "unchanged";
    tdm_error_t err = {0};
    int rc = tdm_chat_template_detect(g, &t, def, sizeof def, &err);
    if (rc != want_rc)
        fail_msg("detect returned %d (%s), want %d", rc, err.msg, want_rc);
    if (rc == TDM_OK) {
        assert_int_equal(t, want_t);
        assert_string_equal(def, want_default);
    } else {
        /* the message says how to choose a template */
        assert_non_null(strstr(err.msg, "model.chat_template"));
        assert_non_null(strstr(err.msg, "--chat-template"));
    }
    tdm_gguf_destroy(&g);
    free(buf);
}

static void test_chat_detect_families(void **state)
{
    (void)state;
    /* Qwen2.5-style: escaped newlines in the template source, a default after a branch that
     * builds the system message from the chat */
    expect_detect("{%- if messages[0]['role'] == 'system' %}"
                  "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
                  "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. "
                  "You are a helpful assistant.<|im_end|>\\n' }}{%- endif %}",
                  TDM_OK, TDM_CHAT_TEMPLATE_CHATML,
                  "You are Qwen, created by Alibaba Cloud. You are a helpful assistant.");
    /* ChatML without a default; a double-quoted literal with an apostrophe and escapes */
    expect_detect("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] + "
                  "'<|im_end|>\\n'}}{% endfor %}",
                  TDM_OK, TDM_CHAT_TEMPLATE_CHATML, "");
    expect_detect("{{ \"<|im_start|>system\\nIt's \\\"quoted\\\"\\tand \\u00e9<|im_end|>\\n\" }}",
                  TDM_OK, TDM_CHAT_TEMPLATE_CHATML, "It's \"quoted\"\tand \xc3\xa9");
    expect_detect("{% set loop_messages = messages %}{% for message in loop_messages %}"
                  "{% set content = '<|start_header_id|>' + message['role'] + "
                  "'<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' %}"
                  "{{ content }}{% endfor %}",
                  TDM_OK, TDM_CHAT_TEMPLATE_LLAMA3, "");
    expect_detect("{{ bos_token + '[INST] ' + '<<SYS>>\\n' + system + '\\n<</SYS>>\\n\\n' }}",
                  TDM_OK, TDM_CHAT_TEMPLATE_LLAMA2, "");
    /* Mistral's [INST] template renders differently from Llama-2's: not recognised */
    expect_detect("{{ bos_token }}{% for message in messages %}{{ '[INST] ' + message['content'] "
                  "+ ' [/INST]' }}{% endfor %}",
                  TDM_EINVALID, 0, NULL);
    expect_detect("{% for m in messages %}<start_of_turn>{{ m['content'] }}{% endfor %}", TDM_OK,
                  TDM_CHAT_TEMPLATE_GEMMA, "");
    expect_detect("{% for m in messages %}<|user|>{{ m['content'] }}{% endfor %}", TDM_EINVALID, 0,
                  NULL);
    expect_detect(NULL, TDM_EINVALID, 0, NULL);
}

static void test_chat_names(void **state)
{
    (void)state;
    tdm_chat_template_t t;
    tdm_error_t err = {0};
    const char *names[] = {"chatml", "llama3", "llama2", "gemma"};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(tdm_chat_template_from_name(names[i], &t, &err), TDM_OK);
        assert_string_equal(tdm_chat_template_name(t), names[i]);
    }
    assert_int_equal(tdm_chat_template_from_name("ChatML-ish", &t, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "ChatML-ish"));
    assert_non_null(strstr(err.msg, "llama3"));
    assert_int_equal(tdm_chat_template_from_name(NULL, &t, NULL), TDM_EINVALID);
    assert_string_equal(tdm_chat_template_name((tdm_chat_template_t)42), "?");
    assert_false(tdm_chat_template_writes_bos(TDM_CHAT_TEMPLATE_CHATML));
    assert_true(tdm_chat_template_writes_bos(TDM_CHAT_TEMPLATE_LLAMA3));
    assert_true(tdm_chat_template_writes_bos(TDM_CHAT_TEMPLATE_LLAMA2));
    assert_true(tdm_chat_template_writes_bos(TDM_CHAT_TEMPLATE_GEMMA));
}

static void expect_apply_error(tdm_chat_template_t t, const tdm_chat_message_t *msgs, size_t n,
                               const char *want1, const char *want2)
{
    char *out = (char *)"sentinel";
    tdm_error_t err = {0};
    assert_int_equal(tdm_chat_apply(t, msgs, n, true, NULL, &out, NULL, &err), TDM_EINVALID);
    assert_null(out);
    if (!strstr(err.msg, want1) || (want2 && !strstr(err.msg, want2)))
        fail_msg("message \"%s\" lacks \"%s\"%s%s", err.msg, want1, want2 ? " or " : "",
                 want2 ? want2 : "");
}

static void test_chat_validation(void **state)
{
    (void)state;
    const tdm_chat_message_t robot[] = {{.role = "user", .content = "hi"},
                                        {.role = "robot", .content = "x"}};
    expect_apply_error(TDM_CHAT_TEMPLATE_CHATML, robot, 2, "message 1", "'robot'");
    const tdm_chat_message_t late_system[] = {{.role = "user", .content = "hi"},
                                              {.role = "system", .content = "x"}};
    expect_apply_error(TDM_CHAT_TEMPLATE_LLAMA3, late_system, 2, "message 1", "'system'");
    const tdm_chat_message_t no_role[] = {{.role = NULL, .content = "hi"}};
    expect_apply_error(TDM_CHAT_TEMPLATE_CHATML, no_role, 1, "message 0", NULL);
    const tdm_chat_message_t no_content[] = {{.role = "user", .content = NULL}};
    expect_apply_error(TDM_CHAT_TEMPLATE_CHATML, no_content, 1, "message 0", "content");
    const tdm_chat_message_t two_users[] = {{.role = "system", .content = "s"},
                                            {.role = "user", .content = "a"},
                                            {.role = "user", .content = "b"}};
    expect_apply_error(TDM_CHAT_TEMPLATE_LLAMA2, two_users, 3, "message 2", "alternate");
    const tdm_chat_message_t assistant_first[] = {{.role = "assistant", .content = "a"}};
    expect_apply_error(TDM_CHAT_TEMPLATE_LLAMA2, assistant_first, 1, "message 0", "'assistant'");
    expect_apply_error((tdm_chat_template_t)7, two_users, 1, "template", NULL);
    expect_apply_error(TDM_CHAT_TEMPLATE_CHATML, NULL, 1, "message", NULL);

    /* the same messages are fine where the template allows them */
    char *out = NULL;
    size_t len = 0;
    assert_int_equal(
        tdm_chat_apply(TDM_CHAT_TEMPLATE_CHATML, two_users, 3, false, NULL, &out, &len, NULL),
        TDM_OK);
    assert_string_equal(out, "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\na<|im_end|>\n"
                             "<|im_start|>user\nb<|im_end|>\n");
    free(out);
    /* no messages: only the generation prompt; an empty result is still a heap string */
    assert_int_equal(
        tdm_chat_apply(TDM_CHAT_TEMPLATE_LLAMA2, NULL, 0, true, "sys", &out, &len, NULL), TDM_OK);
    assert_string_equal(out, "");
    assert_int_equal(len, 0);
    free(out);
    /* default system messages for the Llama families; Unicode whitespace is trimmed */
    const tdm_chat_message_t user[] = {{.role = "user", .content = "\xe3\x80\x80 hi \xc2\xa0\n"}};
    assert_int_equal(
        tdm_chat_apply(TDM_CHAT_TEMPLATE_LLAMA3, user, 1, true, "Be kind.", &out, &len, NULL),
        TDM_OK);
    assert_string_equal(out, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n"
                             "Be kind.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
                             "hi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");
    free(out);
    assert_int_equal(
        tdm_chat_apply(TDM_CHAT_TEMPLATE_LLAMA2, user, 1, true, "Be kind.", &out, &len, NULL),
        TDM_OK);
    /* Llama-2 strips system + content as one string: the content's leading space stays */
    assert_string_equal(out, "<s>[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\n\xe3\x80\x80 hi [/INST]");
    free(out);
    /* invalid UTF-8 is kept, never taken for whitespace */
    const tdm_chat_message_t bad[] = {{.role = "user", .content = " \xff\xc2 "}};
    assert_int_equal(
        tdm_chat_apply(TDM_CHAT_TEMPLATE_LLAMA2, bad, 1, false, NULL, &out, &len, NULL), TDM_OK);
    assert_string_equal(out, "<s>[INST] \xff\xc2 [/INST]");
    free(out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_encode_golden),
        cmocka_unit_test(test_decode_golden),
        cmocka_unit_test(test_chat_detect_model),
        cmocka_unit_test(test_chat_golden),
        cmocka_unit_test(test_chat_detect_families),
        cmocka_unit_test(test_chat_names),
        cmocka_unit_test(test_chat_validation),
        cmocka_unit_test(test_chat_gguf_equals_builtin),
        cmocka_unit_test(test_chat_gguf_tools_inline),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
