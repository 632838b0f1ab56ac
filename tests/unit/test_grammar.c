/* test_grammar.c - GBNF grammars and the token mask (tandem/grammar.h): parser errors with
 * their exact positions, every construct, UTF-8 split across tokens, end-of-generation
 * tokens, and the mask against a brute-force reference (each token's bytes fed to a copy of
 * the matcher) on sampled states of three grammars, over a small vocabulary built here and
 * over the default model's (SmolLM2) vocabulary. The default model missing is a failure
 * (scripts/setup installs it), as in test_tokenizer_smollm2.c.
 */
#include "tdm_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/gguf.h"
#include "tandem/grammar.h"
#include "tandem/tokenizer.h"
#include "tiny_model.h"

/* ---- grammars used below ---- */

/* JSON, with llama.cpp's grammars/json.gbnf semantics (written for this test). */
static const char JSON_GBNF[] =
    "# any JSON object\n"
    "root   ::= object\n"
    "value  ::= object | array | string | number | (\"true\" | \"false\" | \"null\") ws\n"
    "object ::=\n"
    "  \"{\" ws (\n"
    "    string \":\" ws value\n"
    "    (\",\" ws string \":\" ws value)*\n"
    "  )? \"}\" ws\n"
    "array  ::= \"[\" ws ( value (\",\" ws value)* )? \"]\" ws\n"
    "string ::= \"\\\"\" ( [^\"\\\\\\x7F\\x00-\\x1F] | \"\\\\\" ([\"\\\\/bfnrt] | \"u\" "
    "[0-9a-fA-F]{4}) )* \"\\\"\" ws\n"
    "number ::= \"-\"? ([0-9] | [1-9] [0-9]{1,15}) (\".\" [0-9]+)? ([eE] [-+]? [0-9]{1,4})? ws\n"
    "ws     ::= | \" \" | \"\\n\" [ \\t]{0,20}\n";

/* Recursive: arithmetic expressions. */
static const char EXPR_GBNF[] = "root   ::= expr\n"
                                "expr   ::= term ((\"+\" | \"-\") term)*\n"
                                "term   ::= factor ((\"*\" | \"/\") factor)*\n"
                                "factor ::= [0-9]+ | \"(\" expr \")\" | \"-\" factor\n";

/* Classes, negation, `.`, bounded repetition, non-ASCII. */
static const char CLASS_GBNF[] = "root ::= word (\",\" word){1,3} tail?\n"
                                 "word ::= [a-zA-Z_]{2,4} | [^a-z,\\n\"]{1,2}\n"
                                 "tail ::= \"\\n\" .? \"\\u00e9\"* [\\u03b1-\\u03c9]+\n";

/* Counted repetitions of characters (the mask's uniform-successor shortcut, near its
 * bounds). */
static const char COUNT_GBNF[] =
    "root ::= \"\\\"\" [^\"\\\\\\n]{0,40} \"\\\"\" (\" \" [a-z]{3,20})?\n";

/* ---- helpers ---- */

static tdm_grammar_t *parse_ok(const char *text)
{
    tdm_error_t err = {0};
    tdm_grammar_t *g = tdm_grammar_parse(text, strlen(text), NULL, &err);
    if (!g)
        fail_msg("grammar refused: %s\n%s", err.msg, text);
    return g;
}

static void expect_error(const char *text, const char *want)
{
    tdm_error_t err = {0};
    tdm_grammar_t *g = tdm_grammar_parse(text, strlen(text), NULL, &err);
    if (g)
        fail_msg("grammar accepted, expected \"%s\":\n%s", want, text);
    assert_int_equal(err.code, TDM_EINVALID);
    if (strcmp(err.msg, want) != 0)
        fail_msg("got  \"%s\"\nwant \"%s\"", err.msg, want);
}

/* A small byte-level vocabulary: the 256 byte tokens (GPT-2's order), multi-byte tokens that
 * span several terminals or end inside a UTF-8 character, then <|im_start|> (control) and
 * <|im_end|> (control, EOS). */
static const char *const EXTRA_TOKENS[] = {
    "ab",
    "{\"",
    "\":",
    "\",\"",
    "\"}",
    "}}",
    "]]",
    "[1",
    "[[",
    ", ",
    "true",
    "false",
    "null",
    "\\n",
    "\\\"",
    "\xc3\xa9",
    "\"\xc3\xa9",
    "a\xc3",
    "\xa9"
    "b",
    "\xe2\x82",
    "\x82\xac\"",
    "\xce\xb1\xce\xb2",
    " \"",
    "12",
    "3.5",
    "-1",
    "e+",
    "((",
    "))",
    "+(",
    "1+",
    "x*",
    "aaa",
    "aaaa",
    "\t\n",
    "\"\n",
    "\xcf\x89\xcf",
    "_A",
    "AB,",
    "\xc3\xa9\xc3\xa9",
    "\n\xc3\xa9",
};
#define N_EXTRA (sizeof EXTRA_TOKENS / sizeof EXTRA_TOKENS[0])

static uint32_t tiny_vocab_size(void)
{
    return 256 + (uint32_t)N_EXTRA + 2;
}

/* Byte-level form of raw bytes (each byte as GPT-2's stand-in character). */
static char *byte_level(const char *raw)
{
    size_t n = strlen(raw);
    char *out = malloc(2 * n + 1), *p = out;
    assert_non_null(out);
    for (size_t i = 0; i < n; i++)
        p += tdm_test_gpt2_byte_char((uint8_t)raw[i], p);
    *p = '\0';
    return out;
}

static tdm_tokenizer_t *tiny_tokenizer(void)
{
    uint32_t n = tiny_vocab_size();
    char **tokens = calloc(n, sizeof *tokens);
    int32_t *types = calloc(n, sizeof *types);
    assert_true(tokens && types);
    for (uint32_t b = 0; b < 256; b++) {
        char c[3];
        uint32_t id = tdm_test_tiny_byte_token((uint8_t)b);
        tdm_test_gpt2_byte_char((uint8_t)b, c);
        tokens[id] = strdup(c);
        types[id] = TDM_TOKEN_NORMAL;
    }
    for (uint32_t i = 0; i < N_EXTRA; i++) {
        tokens[256 + i] = byte_level(EXTRA_TOKENS[i]);
        types[256 + i] = TDM_TOKEN_NORMAL;
    }
    tokens[n - 2] = strdup("<|im_start|>");
    tokens[n - 1] = strdup("<|im_end|>");
    types[n - 2] = types[n - 1] = TDM_TOKEN_CONTROL;
    static const char *const merges[] = {"a b"};
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2"), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.ggml.pre", "smollm"), TDM_OK);
    assert_int_equal(
        tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", (const char *const *)tokens, n),
        TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, n), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, 1), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", n - 1), TDM_OK);
    assert_int_equal(tdm_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", n - 2), TDM_OK);
    void *data;
    size_t size;
    assert_int_equal(tdm_gguf_writer_to_memory(w, &data, &size), TDM_OK);
    tdm_gguf_writer_destroy(&w);
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open_memory(data, size, &err);
    assert_non_null(g);
    tdm_tokenizer_t *tok = tdm_tokenizer_new(g, &err);
    if (!tok)
        fail_msg("tiny tokenizer: %s", err.msg);
    tdm_gguf_destroy(&g);
    free(data);
    for (uint32_t i = 0; i < n; i++)
        free(tokens[i]);
    free(tokens);
    free(types);
    return tok;
}

/* The id of the tiny vocabulary's token with these raw bytes. */
static int32_t tiny_token(const char *raw)
{
    if (strlen(raw) == 1)
        return (int32_t)tdm_test_tiny_byte_token((uint8_t)raw[0]);
    for (uint32_t i = 0; i < N_EXTRA; i++)
        if (strcmp(EXTRA_TOKENS[i], raw) == 0)
            return (int32_t)(256 + i);
    fail_msg("no tiny token for \"%s\"", raw);
    return -1;
}

/* Everything the tests share: the tiny vocabulary, and the default model's when present. */
typedef struct fixture {
    tdm_tokenizer_t *tiny_tok;
    tdm_grammar_vocab_t *tiny;
    tdm_gguf_t *gguf;
    tdm_tokenizer_t *tok;
    tdm_grammar_vocab_t *vocab;
    char problem[4096];
} fixture_t;

static int group_setup(void **state)
{
    fixture_t *fx = calloc(1, sizeof *fx);
    if (!fx)
        return -1;
    *state = fx;
    tdm_error_t err = {0};
    fx->tiny_tok = tiny_tokenizer();
    fx->tiny = tdm_grammar_vocab_new(fx->tiny_tok, &err);
    if (!fx->tiny)
        return -1;
    char path[1024];
    if (!tdm_test_default_model(path, sizeof path, fx->problem, sizeof fx->problem))
        return 0;
    fx->gguf = tdm_gguf_open(path, &err);
    fx->tok = fx->gguf ? tdm_tokenizer_new(fx->gguf, &err) : NULL;
    fx->vocab = fx->tok ? tdm_grammar_vocab_new(fx->tok, &err) : NULL;
    if (!fx->vocab)
        snprintf(fx->problem, sizeof fx->problem, "default model %s: %s", path, err.msg);
    return 0;
}

static int group_teardown(void **state)
{
    fixture_t *fx = *state;
    tdm_grammar_vocab_destroy(&fx->tiny);
    tdm_tokenizer_destroy(&fx->tiny_tok);
    tdm_grammar_vocab_destroy(&fx->vocab);
    tdm_tokenizer_destroy(&fx->tok);
    tdm_gguf_destroy(&fx->gguf);
    free(fx);
    return 0;
}

static tdm_grammar_matcher_t *matcher(const tdm_grammar_t *g, const tdm_grammar_vocab_t *v)
{
    tdm_error_t err = {0};
    tdm_grammar_matcher_t *m = tdm_grammar_matcher_new(g, v, &err);
    if (!m)
        fail_msg("matcher: %s", err.msg);
    return m;
}

/* 1 when text is a complete string of the grammar, 0 when rejected, -1 when a prefix. */
static int judge(const tdm_grammar_t *g, const tdm_grammar_vocab_t *v, const char *text, size_t n)
{
    tdm_grammar_matcher_t *m = matcher(g, v);
    int r = !tdm_grammar_matcher_accept_bytes(m, text, n) ? 0
            : tdm_grammar_matcher_is_accepting(m)         ? 1
                                                          : -1;
    tdm_grammar_matcher_destroy(&m);
    return r;
}

#define JUDGE(g, v, s) judge((g), (v), (s), sizeof(s) - 1)

static bool mask_has(const uint32_t *mask, int32_t t)
{
    return (mask[t >> 5] >> (t & 31)) & 1u;
}

/* ---- parser errors ---- */

static void test_parse_errors(void **state)
{
    (void)state;
    expect_error("root ::= foo\n", "line 1, column 10 (rule root): undefined rule 'foo'");
    expect_error("root ::= \"a\" x\nx ::= \"b\" y\n",
                 "line 2, column 11 (rule x): undefined rule 'y'");
    expect_error("root ::= \"abc\n", "line 1, column 10 (rule root): unterminated string literal");
    expect_error("root ::= [a-z\n", "line 1, column 10 (rule root): unterminated character class");
    expect_error("root ::= \"a\"\nx ::= \"b\" )\n", "line 2, column 11 (rule x): unmatched ')'");
    expect_error("root ::= * \"a\"\n",
                 "line 1, column 10 (rule root): expecting an item before '*'");
    expect_error("root ::= \"a\"{3,2}\n",
                 "line 1, column 13 (rule root): repetition {m,n} with n < m");
    expect_error("root ::= \"a\"{20000}\n",
                 "line 1, column 14 (rule root): repetition count 20000 is above the limit of "
                 "10000");
    expect_error("root ::= \"a\"{3,123456789012345678901234567890}\n",
                 "line 1, column 16 (rule root): repetition count 123456789012345678901234 is "
                 "above the limit of 10000");
    expect_error("root ::= \"\\q\"\n", "line 1, column 11 (rule root): unknown escape '\\q'");
    expect_error("root ::= \"\\x4\"\n",
                 "line 1, column 11 (rule root): expecting 2 hex digits after '\\x'");
    expect_error("root ::= [z-a]\n",
                 "line 1, column 13 (rule root): class range end is below its start");
    expect_error("a ::= \"x\"\n", "line 1, column 1 (rule root): no rule named 'root'");
    expect_error("root := \"x\"\n", "line 1, column 6 (rule root): expecting '::='");
    expect_error("# no name\n  ::= \"x\"\n", "line 2, column 3: expecting a rule name");
    expect_error("root ::= \"a\"\nroot ::= \"b\"\n",
                 "line 2, column 1 (rule root): rule defined twice");
    expect_error("root ::= (\"a\" | \"b\"\n",
                 "line 1, column 10 (rule root): expecting ')' to close this group");
    expect_error("root ::= \"a\" $\n", "line 1, column 14 (rule root): unexpected character '$'");
    expect_error("root ::= \"\xc3\xa9\" \"a\"{2\n",
                 "line 1, column 17 (rule root): expecting '}' to close the repetition");
    /* left recursion is refused, not a hang */
    expect_error("root ::= expr\nexpr ::= expr \"+\" term | term\nterm ::= [0-9]\n",
                 "line 2, column 1 (rule expr): left recursion: 'expr' can begin with itself");
    expect_error("root ::= a\na ::= b? \"x\" | \"y\"\nb ::= \"z\"? a \"w\"\n",
                 "line 2, column 1 (rule a): left recursion: 'a' can begin with itself");
    /* no finite accepting string */
    expect_error("root ::= \"a\" root\n",
                 "line 1, column 1 (rule root): no finite string matches the start rule");
    expect_error("# comment\nroot ::= [^\\x00-\\U0010FFFF]\n",
                 "line 2, column 1 (rule root): no finite string matches the start rule");
}

/* Repetition expansion is capped by element count, with the limit named. */
static void test_expansion_cap(void **state)
{
    (void)state;
    tdm_buf_t b = {0};
    assert_int_equal(tdm_buf_puts(&b, "root ::= r0\n"), TDM_OK);
    for (int i = 0; i < 420; i++)
        assert_int_equal(tdm_buf_printf(&b, "r%d ::= [a-z]{10000}\n", i), TDM_OK);
    tdm_error_t err = {0};
    tdm_grammar_t *g = tdm_grammar_parse(b.data, b.len, NULL, &err);
    assert_null(g);
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "(rule r419): the grammar expands to more than 4194304 "
                                    "elements once its repetitions are unrolled"));
    tdm_buf_free(&b);
    /* over the text limit */
    char *big = calloc(TDM_GRAMMAR_MAX_TEXT_BYTES + 2, 1);
    assert_non_null(big);
    memset(big, ' ', TDM_GRAMMAR_MAX_TEXT_BYTES + 1);
    assert_null(tdm_grammar_parse(big, TDM_GRAMMAR_MAX_TEXT_BYTES + 1, NULL, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "TDM_GRAMMAR_MAX_TEXT_BYTES"));
    free(big);
}

/* ---- constructs ---- */

static void test_constructs(void **state)
{
    fixture_t *fx = *state;
    const tdm_grammar_vocab_t *v = fx->tiny;
    tdm_grammar_t *g = parse_ok("root ::= (\"ab\" | \"c\")+ tail-2 # comment\n"
                                "tail-2 ::= \"!\"?\n");
    assert_int_equal(JUDGE(g, v, "ab"), 1);
    assert_int_equal(JUDGE(g, v, "abcab!"), 1);
    assert_int_equal(JUDGE(g, v, "a"), -1);
    assert_int_equal(JUDGE(g, v, ""), -1);
    assert_int_equal(JUDGE(g, v, "!"), 0);
    assert_int_equal(JUDGE(g, v, "ab!!"), 0);
    assert_true(tdm_grammar_n_rules(g) >= 2);
    assert_true(tdm_grammar_size_bytes(g) > 0);
    tdm_grammar_destroy(&g);
    assert_null(g);

    g = parse_ok("root ::= \"x\"{3} \"y\"{2,} \"z\"{0,2} \"w\"{1,2}\n");
    assert_int_equal(JUDGE(g, v, "xxxyyw"), 1);
    assert_int_equal(JUDGE(g, v, "xxxyyyyyzzww"), 1);
    assert_int_equal(JUDGE(g, v, "xxyyw"), 0);
    assert_int_equal(JUDGE(g, v, "xxxyw"), 0);
    assert_int_equal(JUDGE(g, v, "xxxyyzzzw"), 0);
    assert_int_equal(JUDGE(g, v, "xxxyywww"), 0);
    tdm_grammar_destroy(&g);
}

/* Literals and their escapes, classes, negation, `.`, groups across lines, other roots. */
static void test_constructs_chars(void **state)
{
    fixture_t *fx = *state;
    const tdm_grammar_vocab_t *v = fx->tiny;
    tdm_grammar_t *g;
    /* a repeated literal repeats as a whole; escapes; classes; negation; any */
    g = parse_ok(
        "root ::= \"ab\"* \"\\n\\t\\r\\\\\\\"\\x41\\u00e9\\U0001F600\" [a-c0-9_] [^a-z] .\n");
    assert_int_equal(JUDGE(g, v,
                           "abab\n\t\r\\\"A\xc3\xa9\xf0\x9f\x98\x80"
                           "5Z\n"),
                     1);
    assert_int_equal(JUDGE(g, v, "\n\t\r\\\"A\xc3\xa9\xf0\x9f\x98\x80_\xc3\xa9\xe2\x82\xac"), 1);
    assert_int_equal(JUDGE(g, v, "aba"), -1);
    assert_int_equal(JUDGE(g, v, "abb"), 0);
    assert_int_equal(JUDGE(g, v,
                           "\n\t\r\\\"A\xc3\xa9\xf0\x9f\x98\x80"
                           "dZ."),
                     0);
    assert_int_equal(JUDGE(g, v,
                           "\n\t\r\\\"A\xc3\xa9\xf0\x9f\x98\x80"
                           "5q."),
                     0);
    tdm_grammar_destroy(&g);

    /* newlines inside groups and after |; empty alternatives; nullable items under * */
    g = parse_ok("root ::= (\n  \"a\"\n  | \"b\" ) ( \"c\"? )* end\nend ::= | \"$\"\n");
    assert_int_equal(JUDGE(g, v, "a"), 1);
    assert_int_equal(JUDGE(g, v, "bccc$"), 1);
    assert_int_equal(JUDGE(g, v, "ab"), 0);
    tdm_grammar_destroy(&g);

    /* another start rule */
    tdm_error_t err = {0};
    const char *two = "root ::= \"a\"\nother ::= \"b\"+\n";
    g = tdm_grammar_parse(two, strlen(two), "other", &err);
    assert_non_null(g);
    assert_int_equal(JUDGE(g, v, "bbb"), 1);
    assert_int_equal(JUDGE(g, v, "a"), 0);
    tdm_grammar_destroy(&g);
}

/* Recursive grammars (not left-recursive) and JSON. */
static void test_constructs_recursive(void **state)
{
    fixture_t *fx = *state;
    const tdm_grammar_vocab_t *v = fx->tiny;
    tdm_grammar_t *g;
    g = parse_ok(EXPR_GBNF);
    assert_int_equal(JUDGE(g, v, "(1+2)*-3/((4))"), 1);
    assert_int_equal(JUDGE(g, v, "(1+2"), -1);
    assert_int_equal(JUDGE(g, v, "1+*2"), 0);
    tdm_grammar_destroy(&g);

    g = parse_ok(JSON_GBNF);
    assert_int_equal(JUDGE(g, v, "{\"a\": [1, -2.5e+3, true, null, {\"b\\u00e9\": \"\\n\"}]}"), 1);
    assert_int_equal(JUDGE(g, v, "{\"a\":01}"), 0);
    assert_int_equal(JUDGE(g, v, "{\"a\":\"\x01\"}"), 0);
    assert_int_equal(JUDGE(g, v, "{\"a\":"), -1);
    tdm_grammar_destroy(&g);
}

/* A long chain of rules, each defined before the one it needs: the checks resolve it in one
 * pass (worklist), and the matcher follows it. */
static void test_rule_chain(void **state)
{
    fixture_t *fx = *state;
    enum { N = 3000 };
    tdm_buf_t b = {0};
    assert_int_equal(tdm_buf_puts(&b, "root ::= r0\n"), TDM_OK);
    for (int i = 0; i < N; i++)
        assert_int_equal(tdm_buf_printf(&b, "r%d ::= \"a\" r%d | \"c\"\n", i, i + 1), TDM_OK);
    assert_int_equal(tdm_buf_printf(&b, "r%d ::= \"b\"\n", N), TDM_OK);
    tdm_grammar_t *g = parse_ok(b.data);
    assert_int_equal(tdm_grammar_n_rules(g), N + 2);
    char *text = malloc(N + 2);
    assert_non_null(text);
    memset(text, 'a', N);
    text[N] = 'b';
    assert_int_equal(judge(g, fx->tiny, text, N + 1), 1);
    text[N - 1] = 'c';
    assert_int_equal(judge(g, fx->tiny, text, N + 1), 0);
    assert_int_equal(judge(g, fx->tiny, text, N), 1);
    free(text);
    tdm_buf_free(&b);
    tdm_grammar_destroy(&g);
}

/* ---- UTF-8 ---- */

static void test_utf8_split(void **state)
{
    fixture_t *fx = *state;
    const tdm_grammar_vocab_t *v = fx->tiny;
    uint32_t *mask = calloc((tdm_grammar_vocab_n_vocab(v) + 31) / 32, sizeof *mask);
    assert_non_null(mask);
    tdm_grammar_t *g = parse_ok("root ::= \"\\u00e9\" [\\u03b1-\\u03c9]+ \"\\u20ac\\\"\"?\n");
    tdm_grammar_matcher_t *m = matcher(g, v);

    /* at the start: the lead byte of é and whole é; not C2, not "a\xc3" */
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask), 2);
    assert_true(mask_has(mask, tiny_token("\xc3")));
    assert_true(mask_has(mask, tiny_token("\xc3\xa9")));
    assert_false(mask_has(mask, tiny_token("\xc3\xa9\xc3\xa9")));
    assert_false(mask_has(mask, tiny_token("\xc2")));
    assert_false(mask_has(mask, tiny_token("\"\xc3\xa9")));
    assert_false(mask_has(mask, tiny_token("a\xc3")));

    /* é fed as two one-byte tokens; è (C3 A8) refused at its second byte */
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\xc3")), TDM_OK);
    assert_false(tdm_grammar_matcher_is_accepting(m));
    tdm_grammar_matcher_fill_mask(m, mask);
    assert_true(mask_has(mask, tiny_token("\xa9")));
    assert_false(mask_has(mask, tiny_token("\xa8")));
    assert_false(mask_has(mask, tiny_token("\xa9"
                                           "b")));
    assert_false(tdm_grammar_matcher_accept_bytes(m, "\xa8", 1));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\xa8")), TDM_EINVALID);
    assert_non_null(strstr(tdm_grammar_matcher_errmsg(m), "does not continue the grammar"));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\xa9")), TDM_OK);

    /* α..ω: CE B1..CF 89; "ωϏ"'s last byte CF is a valid prefix of ω */
    tdm_grammar_matcher_fill_mask(m, mask);
    assert_true(mask_has(mask, tiny_token("\xce\xb1\xce\xb2")));
    assert_true(mask_has(mask, tiny_token("\xce")));
    assert_true(mask_has(mask, tiny_token("\xcf")));
    assert_false(mask_has(mask, tiny_token("\xcd")));
    assert_true(mask_has(mask, tiny_token("\xcf\x89\xcf")));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\xcf\x89\xcf")), TDM_OK);
    tdm_grammar_matcher_fill_mask(m, mask);
    assert_true(mask_has(mask, tiny_token("\x89")));
    assert_false(mask_has(mask, tiny_token("\x8a"))); /* U+03CA is past ω */
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\x89")), TDM_OK);
    assert_true(tdm_grammar_matcher_is_accepting(m));

    /* € split as E2 82 | 82 AC " across two tokens */
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\xe2\x82")), TDM_OK);
    assert_false(tdm_grammar_matcher_is_accepting(m));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\x82\xac\"")), TDM_EINVALID);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\xac")), TDM_OK);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("\"")), TDM_OK);
    assert_true(tdm_grammar_matcher_is_done(m));

    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_destroy(&g);
    free(mask);
}

/* Invalid UTF-8 never matches, not even `.`; a character cut short is a prefix. */
static void test_utf8_invalid(void **state)
{
    fixture_t *fx = *state;
    const tdm_grammar_vocab_t *v = fx->tiny;
    tdm_grammar_t *any = parse_ok("root ::= .+\n");
    assert_int_equal(JUDGE(any, v, "\xc0\x80"), 0);         /* overlong */
    assert_int_equal(JUDGE(any, v, "\xed\xa0\x80"), 0);     /* surrogate */
    assert_int_equal(JUDGE(any, v, "\xf4\x90\x80\x80"), 0); /* above U+10FFFF */
    assert_int_equal(JUDGE(any, v, "\xe2\x82"), -1);
    assert_int_equal(JUDGE(any, v, "\xf0\x9f\x98\x80"), 1);
    tdm_grammar_destroy(&any);
}

/* ---- end of generation and special tokens ---- */

static void test_eos(void **state)
{
    fixture_t *fx = *state;
    const tdm_grammar_vocab_t *v = fx->tiny;
    int32_t eos = (int32_t)tiny_vocab_size() - 1, bos = eos - 1;
    uint32_t *mask = calloc((tdm_grammar_vocab_n_vocab(v) + 31) / 32, sizeof *mask);
    assert_non_null(mask);
    tdm_grammar_t *g = parse_ok("root ::= \"ab\" \"c\"?\n");
    tdm_grammar_matcher_t *m = matcher(g, v);
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask), 2); /* "a", "ab" */
    assert_true(mask_has(mask, tiny_token("ab")));
    assert_false(mask_has(mask, eos));
    assert_false(mask_has(mask, bos));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, eos), TDM_EINVALID);
    assert_non_null(strstr(tdm_grammar_matcher_errmsg(m), "does not accept yet"));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, bos), TDM_EINVALID);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("ab")), TDM_OK);
    assert_true(tdm_grammar_matcher_is_accepting(m));
    assert_false(tdm_grammar_matcher_is_done(m));
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask), 2); /* "c", EOS */
    assert_true(mask_has(mask, eos));
    assert_true(mask_has(mask, tiny_token("c")));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("c")), TDM_OK);
    assert_true(tdm_grammar_matcher_is_done(m));
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask), 1); /* EOS only */
    assert_true(mask_has(mask, eos));
    assert_int_equal(tdm_grammar_matcher_accept_token(m, eos), TDM_OK);
    assert_true(tdm_grammar_matcher_is_done(m));
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask), 0);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, tiny_token("c")), TDM_EINVALID);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, -1), TDM_EINVALID);
    assert_int_equal(tdm_grammar_matcher_accept_token(m, eos + 1), TDM_EINVALID);
    /* copies only between matchers of one grammar and vocabulary */
    tdm_grammar_t *other = parse_ok("root ::= \"x\"\n");
    tdm_grammar_matcher_t *o = matcher(other, v);
    assert_int_equal(tdm_grammar_matcher_copy(o, m), TDM_EINVALID);
    tdm_grammar_matcher_destroy(&o);
    tdm_grammar_destroy(&other);
    /* reset starts over */
    tdm_grammar_matcher_reset(m);
    assert_false(tdm_grammar_matcher_is_accepting(m));
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, mask), 2);
    tdm_grammar_matcher_destroy(&m);
    assert_null(m);
    tdm_grammar_destroy(&g);
    free(mask);
}

/* ---- bounds ---- */

/* 150,000 nested brackets: the matcher's tables pass their bounds inside one call and are
 * rebuilt around the state reached; a refused byte afterwards leaves the state as it was. */
static void test_deep_nesting(void **state)
{
    (void)state;
    enum { DEPTH = 150000 };
    tdm_grammar_t *g = parse_ok("root ::= \"[\" root? \"]\"\n");
    tdm_grammar_matcher_t *m = matcher(g, NULL);
    char *open = malloc(DEPTH), *close = malloc(DEPTH);
    assert_true(open && close);
    memset(open, '[', DEPTH);
    memset(close, ']', DEPTH);
    assert_true(tdm_grammar_matcher_accept_bytes(m, open, DEPTH));
    assert_false(tdm_grammar_matcher_accept_bytes(m, "]]x", 3));
    assert_true(tdm_grammar_matcher_accept_bytes(m, close, DEPTH - 1));
    assert_false(tdm_grammar_matcher_is_accepting(m));
    assert_false(tdm_grammar_matcher_accept_bytes(m, "]]", 2));
    assert_true(tdm_grammar_matcher_accept_bytes(m, "]", 1));
    assert_true(tdm_grammar_matcher_is_done(m));
    /* byte-only matchers have no tokens */
    assert_int_equal(tdm_grammar_matcher_accept_token(m, 0), TDM_EINVALID);
    free(open);
    free(close);
    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_destroy(&g);
}

/* tdm_grammar_check: limits on size and rules, and an exponentially ambiguous grammar found
 * before any input (each "a" doubles the stacks, "b" or "c" to close it: 9 of them pass 1,024). */
static void test_check_admission(void **state)
{
    (void)state;
    tdm_error_t err;
    tdm_grammar_t *g = parse_ok("root ::= \"a\" root \"b\" | \"a\" root \"c\" | \"x\"\n");
    assert_int_equal(tdm_grammar_check(g, NULL, &err), TDM_EINVALID);
    assert_string_equal(err.field, "grammar.stacks");
    assert_non_null(strstr(err.msg, "a prefix of 9 bytes needs more than 1024 parse stacks"));
    tdm_grammar_destroy(&g);
    g = parse_ok(
        "root ::= \"{\" item ( \",\" item )* \"}\"\nitem ::= [a-z]+ | \"[\" [0-9]* \"]\"\n");
    assert_int_equal(tdm_grammar_check(g, NULL, &err), 0);
    tdm_grammar_limits_t lim;
    tdm_grammar_limits_default(&lim);
    lim.max_rules = 1;
    assert_int_equal(tdm_grammar_check(g, &lim, &err), TDM_EINVALID);
    assert_string_equal(err.field, "grammar.rules");
    tdm_grammar_limits_default(&lim);
    lim.max_bytes = 16;
    assert_int_equal(tdm_grammar_check(g, &lim, &err), TDM_EINVALID);
    assert_string_equal(err.field, "grammar.size");
    tdm_grammar_destroy(&g);
}

/* An ambiguous grammar whose stacks grow with the input: past TDM_GRAMMAR_MAX_STACKS the
 * byte is refused and errmsg says why (memory stays bounded). */
static void test_ambiguity_bound(void **state)
{
    (void)state;
    tdm_grammar_t *g = parse_ok("root ::= (\"a\" | \"a\" root \"b\")*\n");
    tdm_grammar_matcher_t *m = matcher(g, NULL);
    int fed = 0;
    while (fed < 2000 && tdm_grammar_matcher_accept_bytes(m, "a", 1))
        fed++;
    assert_int_equal(fed, 340); /* each "a" adds about three stacks */
    assert_non_null(strstr(tdm_grammar_matcher_errmsg(m), "TDM_GRAMMAR_MAX_STACKS"));
    assert_true(tdm_grammar_matcher_accept_bytes(m, "b", 1)); /* the state is intact */
    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_destroy(&g);
}

/* ---- the mask against brute force ---- */

/* What the reference thinks of token t in m's state: its bytes (straight from the tokenizer)
 * fed to ref, a copy of m; EOG tokens when m accepts; other special tokens never. */
static bool reference_allows(tdm_grammar_matcher_t *ref, const tdm_grammar_matcher_t *m,
                             const tdm_tokenizer_t *tok, int32_t t)
{
    if (tdm_tokenizer_is_eog(tok, t))
        return tdm_grammar_matcher_is_accepting(m);
    tdm_token_attr_t a = tdm_tokenizer_attr(tok, t);
    if (a != TDM_TOKEN_NORMAL && a != TDM_TOKEN_USER_DEFINED && a != TDM_TOKEN_BYTE)
        return false;
    char buf[512];
    int n = tdm_tokenizer_token_bytes(tok, t, false, buf, sizeof buf);
    assert_true(n >= 0 && n <= (int)sizeof buf);
    if (n == 0 || !tdm_grammar_matcher_accept_bytes(ref, buf, (size_t)n))
        return false;
    assert_int_equal(tdm_grammar_matcher_copy(ref, m), TDM_OK);
    return true;
}

/* Compares m's mask with the reference for every token; returns the mask's count. */
static uint32_t check_mask(tdm_grammar_matcher_t *m, const tdm_tokenizer_t *tok, uint32_t *mask,
                           const char *what, int step)
{
    uint32_t n_vocab = tdm_tokenizer_n_vocab(tok);
    uint32_t count = tdm_grammar_matcher_fill_mask(m, mask), seen = 0;
    tdm_error_t err = {0};
    tdm_grammar_matcher_t *ref = tdm_grammar_matcher_clone(m, &err);
    assert_non_null(ref);
    for (uint32_t t = 0; t < n_vocab; t++) {
        bool want = reference_allows(ref, m, tok, (int32_t)t);
        if (want != mask_has(mask, (int32_t)t)) {
            char buf[64] = "";
            int n = tdm_tokenizer_token_bytes(tok, (int32_t)t, true, buf, sizeof buf - 1);
            buf[n < 0 ? 0 : n < 63 ? n : 63] = '\0';
            fail_msg("%s, step %d: token %u \"%s\": mask %d, reference %d", what, step, t, buf,
                     mask_has(mask, (int32_t)t), want);
        }
        seen += want;
    }
    assert_int_equal(count, seen);
    /* the second call comes from the cache and must be the same */
    uint32_t *again = calloc((n_vocab + 31) / 32, sizeof *again);
    assert_non_null(again);
    assert_int_equal(tdm_grammar_matcher_fill_mask(m, again), count);
    assert_memory_equal(again, mask, (n_vocab + 31) / 32 * sizeof *mask);
    free(again);
    tdm_grammar_matcher_destroy(&ref);
    return count;
}

static uint64_t next_random(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* A random walk: at each step check the mask, then take a random allowed token (EOS last). */
static void random_walk(const char *gbnf, const tdm_grammar_vocab_t *v, const tdm_tokenizer_t *tok,
                        uint64_t seed, int steps, int check_every)
{
    tdm_grammar_t *g = parse_ok(gbnf);
    tdm_grammar_matcher_t *m = matcher(g, v);
    uint32_t n_vocab = tdm_tokenizer_n_vocab(tok);
    uint32_t *mask = calloc((n_vocab + 31) / 32, sizeof *mask);
    assert_non_null(mask);
    for (int step = 0; step < steps && !tdm_grammar_matcher_is_done(m); step++) {
        uint32_t count = step % check_every == 0 ? check_mask(m, tok, mask, gbnf, step)
                                                 : tdm_grammar_matcher_fill_mask(m, mask);
        assert_true(count > 0);
        uint32_t pick = (uint32_t)(next_random(&seed) % count), t = 0;
        for (; t < n_vocab; t++)
            if (mask_has(mask, (int32_t)t) && !tdm_tokenizer_is_eog(tok, (int32_t)t) && pick-- == 0)
                break;
        if (t >= n_vocab)
            break; /* only EOS was left */
        assert_int_equal(tdm_grammar_matcher_accept_token(m, (int32_t)t), TDM_OK);
    }
    free(mask);
    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_destroy(&g);
}

static void test_mask_tiny_vocab(void **state)
{
    fixture_t *fx = *state;
    for (uint64_t seed = 1; seed <= 6; seed++) {
        random_walk(JSON_GBNF, fx->tiny, fx->tiny_tok, seed * 7919, 80, 1);
        random_walk(EXPR_GBNF, fx->tiny, fx->tiny_tok, seed * 104729, 60, 1);
        random_walk(CLASS_GBNF, fx->tiny, fx->tiny_tok, seed * 1299709, 40, 1);
        random_walk(COUNT_GBNF, fx->tiny, fx->tiny_tok, seed * 15485863, 60, 1);
    }
}

/* Feeds a text's tokens (the model's own tokenization) checking the mask at sampled steps. */
static void follow_text(const char *gbnf, const char *text, const tdm_grammar_vocab_t *v,
                        const tdm_tokenizer_t *tok, int check_every)
{
    tdm_error_t err = {0};
    tdm_token_t *ids;
    size_t n_ids;
    assert_int_equal(
        tdm_tokenizer_encode(tok, text, strlen(text), false, false, &ids, &n_ids, &err), TDM_OK);
    tdm_grammar_t *g = parse_ok(gbnf);
    tdm_grammar_matcher_t *m = matcher(g, v);
    uint32_t *mask = calloc((tdm_tokenizer_n_vocab(tok) + 31) / 32, sizeof *mask);
    assert_non_null(mask);
    for (size_t i = 0; i < n_ids; i++) {
        if ((int)i % check_every == 0)
            check_mask(m, tok, mask, text, (int)i);
        else
            tdm_grammar_matcher_fill_mask(m, mask);
        if (!mask_has(mask, ids[i]))
            fail_msg("%s: token %zu (%d) not in the mask", text, i, (int)ids[i]);
        assert_int_equal(tdm_grammar_matcher_accept_token(m, ids[i]), TDM_OK);
    }
    check_mask(m, tok, mask, text, (int)n_ids);
    assert_true(tdm_grammar_matcher_is_accepting(m));
    assert_true(mask_has(mask, tdm_tokenizer_eos(tok)));
    free(mask);
    free(ids);
    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_destroy(&g);
}

static void test_mask_default_model(void **state)
{
    fixture_t *fx = *state;
    if (!fx->vocab)
        fail_msg("%s", fx->problem);
    assert_int_equal(tdm_grammar_vocab_n_vocab(fx->vocab), tdm_tokenizer_n_vocab(fx->tok));
    follow_text(JSON_GBNF,
                "{\"name\": \"Zo\\u00eb \\\"Z\\\" K\xc3\xb6nig\", \"age\": 42, \"tags\": [\"a\", "
                "\"\xe6\x97\xa5\xe6\x9c\xac\"], \"ok\": true, \"pi\": -3.14e+2,\n  \"n\": null, "
                "\"o\": {}}",
                fx->vocab, fx->tok, 4);
    follow_text(EXPR_GBNF, "(12+3)*-(45/6)-((7))", fx->vocab, fx->tok, 2);
    follow_text(CLASS_GBNF, "ab,Zq_,XY\n\xc3\xa9\xce\xb1\xcf\x89", fx->vocab, fx->tok, 1);
    random_walk(JSON_GBNF, fx->vocab, fx->tok, 12345, 12, 3);
    random_walk(CLASS_GBNF, fx->vocab, fx->tok, 777, 8, 2);
    random_walk(COUNT_GBNF, fx->vocab, fx->tok, 4242, 30, 1);
    follow_text(COUNT_GBNF, "\"It was the best of times, it was the wor\" off", fx->vocab, fx->tok,
                1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_expansion_cap),
        cmocka_unit_test(test_constructs),
        cmocka_unit_test(test_constructs_chars),
        cmocka_unit_test(test_constructs_recursive),
        cmocka_unit_test(test_rule_chain),
        cmocka_unit_test(test_utf8_split),
        cmocka_unit_test(test_utf8_invalid),
        cmocka_unit_test(test_eos),
        cmocka_unit_test(test_deep_nesting),
        cmocka_unit_test(test_ambiguity_bound),
        cmocka_unit_test(test_check_admission),
        cmocka_unit_test(test_mask_tiny_vocab),
        cmocka_unit_test(test_mask_default_model),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
