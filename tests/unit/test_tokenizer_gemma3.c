/* test_tokenizer_gemma3.c - the SentencePiece tokenizer on Gemma 3 270M against
 * tests/golden/gemma3_tokenizer.json, which llama.cpp made (tests/golden/
 * make_gemma3_tokenizer_golden.py): exact ids for every case (parse_special off and on), decode
 * round trips, the special and end-of-generation tokens, the Gemma chat template picked for a
 * file without tokenizer.chat_template and its renderings' ids, and encoding speed over the
 * 262,144-token vocabulary.
 *
 * The model comes from $TANDEM_GEMMA3_MODEL or the model cache (`scripts/setup --model
 * gemma3-270m`; scripts/test installs it for CI). When it is missing the test prints why and
 * exits 77, which ctest reports as skipped; a file of another size fails.
 */
#include "tdm_test.h"
#include "token_golden.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "tandem/chat.h"
#include "tandem/config.h"
#include "tandem/gguf.h"
#include "tandem/prompt.h"
#include "tandem/tokenizer.h"

#define GOLDEN_PATH TDM_SOURCE_DIR "/tests/golden/gemma3_tokenizer.json"

/* Everything the tests share, loaded once by the group setup. */
typedef struct fixture {
    char model_path[1024];
    char problem[4096]; /* why the fixture is unusable; "" when it is fine */
    tdm_gguf_t *gguf;
    tdm_tokenizer_t *tok;
    json_t *golden;
} fixture_t;

/* The one fixture: main finds the model, the group setup loads the rest. */
static fixture_t the_fixture;

/* ---- helpers ---- */

/* Checks the model file is the one the golden ids belong to (by size: hashing 241 MiB per
 * run would cost more than the test). Writes the problem into fx->problem. */
static void check_model_size(fixture_t *fx)
{
    struct stat st;
    json_int_t want = json_integer_value(json_object_get(fx->golden, "model_bytes"));
    if (stat(fx->model_path, &st) == 0 && (json_int_t)st.st_size == want)
        return;
    snprintf(fx->problem, sizeof fx->problem,
             "%s has %lld bytes but the golden ids were made from a file of %lld bytes "
             "(sha256 %s): run `scripts/setup --model " TDM_TEST_GEMMA3_SETUP "`",
             fx->model_path, (long long)st.st_size, (long long)want,
             json_string_value(json_object_get(fx->golden, "model_sha256")));
}

static int group_setup(void **state)
{
    fixture_t *fx = &the_fixture;
    *state = fx;
    json_error_t jerr;
    fx->golden = json_load_file(GOLDEN_PATH, 0, &jerr);
    if (!fx->golden) {
        snprintf(fx->problem, sizeof fx->problem, "%s:%d: %s", GOLDEN_PATH, jerr.line, jerr.text);
        return 0;
    }
    tdm_error_t err = {0};
    fx->gguf = tdm_gguf_open(fx->model_path, &err);
    if (!fx->gguf) {
        snprintf(fx->problem, sizeof fx->problem, "opening %.1024s: %.2048s", fx->model_path,
                 err.msg);
        return 0;
    }
    fx->tok = tdm_tokenizer_new(fx->gguf, &err);
    if (!fx->tok) {
        snprintf(fx->problem, sizeof fx->problem, "tokenizer of %.1024s: %.2048s", fx->model_path,
                 err.msg);
        return 0;
    }
    check_model_size(fx);
    return 0;
}

static int group_teardown(void **state)
{
    fixture_t *fx = *state;
    tdm_tokenizer_destroy(&fx->tok);
    tdm_gguf_destroy(&fx->gguf);
    json_decref(fx->golden);
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

/* Encodes golden case c and compares; prints the difference. Returns true when equal. */
static bool encode_case(const tdm_tokenizer_t *tok, const json_t *c, size_t i)
{
    const char *text = json_string_value(json_object_get(c, "text"));
    size_t len = json_string_length(json_object_get(c, "text"));
    bool parse_special = json_is_true(json_object_get(c, "parse_special"));
    size_t n_want;
    tdm_token_t *want = tdm_test_json_ids(json_object_get(c, "ids"), &n_want);
    tdm_token_t *got = NULL;
    size_t n_got = 0;
    tdm_error_t err = {0};
    int rc = tdm_tokenizer_encode(tok, text, len, false, parse_special, &got, &n_got, &err);
    bool ok = rc == TDM_OK && tdm_test_ids_equal(want, n_want, got, n_got);
    if (!ok) {
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
    return ok;
}

/* ---- tokenizer vs golden ids ---- */

static void test_encode_golden(void **state)
{
    fixture_t *fx = require_fixture(state);
    const json_t *cases = json_object_get(fx->golden, "cases");
    assert_true(json_array_size(cases) >= 150);
    assert_int_equal(tdm_tokenizer_kind(fx->tok), TDM_TOKENIZER_SPM);
    assert_int_equal(tdm_tokenizer_n_vocab(fx->tok),
                     json_integer_value(json_object_get(fx->golden, "n_vocab")));
    size_t failed = 0;
    for (size_t i = 0; i < json_array_size(cases); i++)
        failed += !encode_case(fx->tok, json_array_get(cases, i), i);
    fprintf(stderr, "%zu of %zu golden cases equal llama.cpp's ids\n",
            json_array_size(cases) - failed, json_array_size(cases));
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
        /* llama.cpp's detokenization: the text, except where the text held U+2581 */
        const json_t *jw = json_object_get(c, "decoded");
        if (!jw)
            jw = json_object_get(c, "text");
        const char *want = json_string_value(jw);
        size_t want_len = json_string_length(jw);
        size_t n;
        tdm_token_t *ids = tdm_test_json_ids(json_object_get(c, "ids"), &n);
        char *out = NULL;
        size_t out_len = 0;
        tdm_error_t err = {0};
        int rc = tdm_tokenizer_decode(fx->tok, ids, n, true, &out, &out_len, &err);
        if (rc != TDM_OK || out_len != want_len || memcmp(out, want, want_len) != 0) {
            failed++;
            fprintf(stderr, "case %zu: ", i);
            tdm_test_print_escaped("want ", want, want_len, 200);
            if (rc == TDM_OK)
                tdm_test_print_escaped("  got  ", out, out_len, 200);
            else
                fprintf(stderr, "  decode failed: %s\n", err.msg);
        }
        free(out);
        free(ids);
    }
    if (failed)
        fail_msg("%zu golden cases do not decode as llama.cpp decodes them", failed);
}

/* BOS, EOS and the end of turn: <end_of_turn> (106) ends a chat turn. */
static void test_special_tokens(void **state)
{
    fixture_t *fx = require_fixture(state);
    const json_t *sp = json_object_get(fx->golden, "special_ids");
    assert_int_equal(tdm_tokenizer_bos(fx->tok),
                     json_integer_value(json_object_get(fx->golden, "bos")));
    assert_int_equal(tdm_tokenizer_eos(fx->tok),
                     json_integer_value(json_object_get(fx->golden, "eos")));
    tdm_token_t eot =
        (tdm_token_t)json_integer_value(json_array_get(json_object_get(sp, "<end_of_turn>"), 0));
    assert_int_equal(eot, 106);
    assert_int_equal(tdm_tokenizer_eot(fx->tok), eot);
    assert_true(tdm_tokenizer_is_eog(fx->tok, eot));
    assert_true(tdm_tokenizer_is_eog(fx->tok, tdm_tokenizer_eos(fx->tok)));
    assert_false(tdm_tokenizer_is_eog(fx->tok, 105)); /* <start_of_turn> */
    assert_false(tdm_tokenizer_is_eog(fx->tok, tdm_tokenizer_bos(fx->tok)));
    assert_true(tdm_tokenizer_add_bos(fx->tok));
    assert_int_equal(tdm_tokenizer_attr(fx->tok, eot), TDM_TOKEN_CONTROL);
}

/* ---- the chat template ---- */

/* Gemma 3 270M carries no tokenizer.chat_template: its architecture picks Gemma's. */
static void test_chat_pick_model(void **state)
{
    fixture_t *fx = require_fixture(state);
    tdm_gguf_str_t s;
    assert_int_equal(tdm_gguf_get_str(fx->gguf, "tokenizer.chat_template", &s, NULL),
                     TDM_ENOTFOUND);
    tdm_chat_pick_t pick;
    tdm_error_t err = {0};
    if (tdm_chat_template_pick(fx->gguf, fx->tok, NULL, &pick, &err) != TDM_OK)
        fail_msg("pick: %s", err.msg);
    assert_int_equal(pick.tmpl, TDM_CHAT_TEMPLATE_GEMMA);
    assert_string_equal(pick.default_system, "");

    /* the prompt rule: the rendering writes <bos> itself, so exactly one BOS */
    const tdm_chat_message_t msgs[] = {{.role = "user", .content = "Hi"}};
    tdm_prompt_input_t in = {.messages = msgs, .n_messages = 1};
    tdm_token_t *ids = NULL;
    size_t n = 0;
    char *text = NULL;
    assert_int_equal(tdm_prompt_encode(fx->tok, &pick, &in, &ids, &n, &text, &err), TDM_OK);
    assert_string_equal(text, "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n");
    assert_true(n > 4);
    assert_int_equal(ids[0], 2);
    assert_int_not_equal(ids[1], 2);
    assert_int_equal(ids[1], 105);
    free(ids);
    free(text);
}

/* Gemma 3's own Jinja template (google/gemma-3-*-it's, tests/golden/gemma3_chat_template.jinja,
 * given as a template file since the 270M GGUF carries none) and the built-in Gemma path give
 * the same prompt ids as llama.cpp's golden ones for every golden chat: the template writes
 * "<bos>" (bos_token), the prompt rule cuts it and the tokenizer adds BOS, so one BOS (id 2). */
static void test_chat_jinja_equals_builtin(void **state)
{
    fixture_t *fx = require_fixture(state);
    tdm_chat_pick_t jinja, builtin;
    tdm_error_t err = {0};
    if (tdm_chat_template_pick(fx->gguf, fx->tok,
                               TDM_SOURCE_DIR "/tests/golden/gemma3_chat_template.jinja", &jinja,
                               &err) != TDM_OK)
        fail_msg("pick: %s", err.msg);
    assert_non_null(jinja.jinja);
    assert_string_equal(jinja.bos_token, "<bos>");
    assert_int_equal(tdm_chat_template_pick(fx->gguf, fx->tok, NULL, &builtin, &err), 0);
    assert_null(builtin.jinja);
    const json_t *chats = json_object_get(fx->golden, "chat");
    for (size_t i = 0; i < json_array_size(chats); i++) {
        const json_t *c = json_array_get(chats, i);
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
        tdm_prompt_input_t in = {.messages = msgs,
                                 .n_messages = n,
                                 .no_generation_prompt =
                                     !json_is_true(json_object_get(c, "add_generation_prompt"))};
        tdm_token_t *a = NULL, *b = NULL;
        size_t na = 0, nb = 0;
        assert_int_equal(tdm_prompt_encode(fx->tok, &jinja, &in, &a, &na, NULL, &err), 0);
        assert_int_equal(tdm_prompt_encode(fx->tok, &builtin, &in, &b, &nb, NULL, &err), 0);
        size_t n_want;
        tdm_token_t *want = tdm_test_json_ids(json_object_get(c, "ids"), &n_want);
        if (!tdm_test_ids_equal(want, n_want, a, na) || !tdm_test_ids_equal(b, nb, a, na)) {
            tdm_test_print_ids("  golden   ", want, n_want);
            tdm_test_print_ids("  built-in ", b, nb);
            tdm_test_print_ids("  jinja    ", a, na);
            fail_msg("chat %zu: token ids differ", i);
        }
        assert_int_equal(a[0], 2);
        assert_int_not_equal(a[1], 2);
        free(a);
        free(b);
        free(want);
    }
    /* the template's own refusal comes back as jinja2's message, exactly */
    const tdm_chat_message_t two[] = {{.role = "user", .content = "a"},
                                      {.role = "user", .content = "b"}};
    tdm_prompt_input_t in = {.messages = two, .n_messages = 2};
    tdm_token_t *ids = NULL;
    size_t n_ids = 0;
    assert_int_equal(tdm_prompt_encode(fx->tok, &jinja, &in, &ids, &n_ids, NULL, &err),
                     TDM_EINVALID);
    assert_string_equal(err.msg,
                        "Conversation roles must alternate user/assistant/user/assistant/...");
    tdm_chat_pick_release(&jinja);
}

static void test_chat_golden_ids(void **state)
{
    fixture_t *fx = require_fixture(state);
    const json_t *chats = json_object_get(fx->golden, "chat");
    assert_true(json_array_size(chats) >= 10);
    size_t failed = 0;
    for (size_t i = 0; i < json_array_size(chats); i++) {
        const json_t *c = json_array_get(chats, i);
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
        char *text = NULL;
        size_t len = 0;
        tdm_error_t err = {0};
        bool gen = json_is_true(json_object_get(c, "add_generation_prompt"));
        assert_int_equal(
            tdm_chat_apply(TDM_CHAT_TEMPLATE_GEMMA, msgs, n, gen, NULL, &text, &len, &err), 0);
        /* the text itself is compared in test_chat.c; here its ids, as prompts get them */
        size_t n_want;
        tdm_token_t *want = tdm_test_json_ids(json_object_get(c, "ids"), &n_want);
        tdm_token_t *ids = NULL;
        size_t n_ids = 0;
        int rc = tdm_tokenizer_encode(fx->tok, text, len, false, true, &ids, &n_ids, &err);
        if (rc != TDM_OK || !tdm_test_ids_equal(want, n_want, ids, n_ids)) {
            failed++;
            fprintf(stderr, "chat %zu: token ids differ\n", i);
            tdm_test_print_ids("  want ", want, n_want);
            tdm_test_print_ids("  got  ", ids, n_ids);
        }
        free(ids);
        free(want);
        free(text);
    }
    if (failed)
        fail_msg("%zu of %zu golden chat renderings tokenize differently", failed,
                 json_array_size(chats));
}

/* ---- speed ---- */

/* About bytes bytes of mixed text: prose, HTML (user-defined tags, many '<'), code with
 * indentation runs, CJK and emoji, and a long word. Caller frees. */
static char *mixed_text(size_t bytes, size_t *len)
{
    static const char *const parts[] = {
        "The quick brown fox jumps over the lazy dog; 12345 apples cost $6.78. ",
        "<table><tr><td>cell</td><td><b>bold</b></td></tr></table><div><span>x</span></div> ",
        "int main(void) {\n        if (x < y && y < z) {\n\t\treturn a[i] << 2;\n    }\n}\n",
        "\xe4\xbd\xa0\xe5\xa5\xbd\xef\xbc\x8c\xe4\xb8\x96\xe7\x95\x8c \xf0\x9f\x98\x80 "
        "caf\xc3\xa9 ",
        "pneumonoultramicroscopicsilicovolcanoconiosis<start_of_turn><unused12>     \n\n\n",
    };
    char *s = malloc(bytes + 256);
    assert_non_null(s);
    size_t n = 0;
    for (size_t k = 0; n < bytes; k++) {
        const char *p = parts[k % (sizeof parts / sizeof parts[0])];
        size_t m = strlen(p);
        memcpy(s + n, p, m);
        n += m;
    }
    *len = n;
    return s;
}

/* Encoding costs a few hash look-ups per character, whatever the vocabulary size: 1 MiB of
 * mixed text takes well under a second (the bound is loose for sanitizer builds and busy CI
 * machines; an O(vocabulary) step per token or per '<' would take minutes). */
static void test_encode_speed(void **state)
{
    fixture_t *fx = require_fixture(state);
    size_t len;
    char *text = mixed_text(1u << 20, &len);
    for (int special = 0; special < 2; special++) {
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        tdm_token_t *ids = NULL;
        size_t n = 0;
        tdm_error_t err = {0};
        assert_int_equal(tdm_tokenizer_encode(fx->tok, text, len, false, special, &ids, &n, &err),
                         0);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        double s = (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
        fprintf(stderr, "encode %zu bytes (parse_special=%d): %zu tokens in %.3f s, %.2f MB/s\n",
                len, special, n, s, (double)len / s / 1e6);
        assert_true(s < 20.0);
        free(ids);
    }
    free(text);
}

int main(void)
{
    fixture_t *fx = &the_fixture;
    if (!tdm_test_cached_model("TANDEM_GEMMA3_MODEL", TDM_TEST_GEMMA3_FILE, TDM_TEST_GEMMA3_SETUP,
                               fx->model_path, sizeof fx->model_path, fx->problem,
                               sizeof fx->problem)) {
        fprintf(stderr, "SKIP: %s\n", fx->problem);
        return 77;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_encode_golden),   cmocka_unit_test(test_decode_golden),
        cmocka_unit_test(test_special_tokens),  cmocka_unit_test(test_chat_pick_model),
        cmocka_unit_test(test_chat_golden_ids), cmocka_unit_test(test_chat_jinja_equals_builtin),
        cmocka_unit_test(test_encode_speed),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
