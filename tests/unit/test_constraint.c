/* test_constraint.c - the constraint compiler (each kind to GBNF that parses, refusals with the
 * compiler's message, the hash) and the nodes' grammar cache (hits, LRU eviction in bytes,
 * held grammars never evicted, a hash that does not match its text refused). */
#include "tdm_test.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include "tandem/constraint.h"

/* Compiles and expects success; returns the GBNF (caller frees). */
static char *compile_ok(int kind, const char *text)
{
    tdm_buf_t b = {0};
    uint64_t hash = 0;
    tdm_error_t err = {0};
    int rc = tdm_constraint_compile(kind, text, text ? strlen(text) : 0, &b, &hash, &err);
    if (rc != TDM_OK)
        fail_msg("%s '%s': %s", tdm_constraint_kind_name(kind), text ? text : "", err.msg);
    assert_true(hash == XXH3_64bits(b.data, b.len));
    assert_true(hash == tdm_constraint_hash(b.data, b.len));
    return tdm_buf_take(&b);
}

static void compile_bad(int kind, const char *text, const char *has)
{
    tdm_buf_t b = {0};
    uint64_t hash = 0;
    tdm_error_t err = {0};
    assert_int_equal(tdm_constraint_compile(kind, text, strlen(text), &b, &hash, &err),
                     TDM_EINVALID);
    if (!strstr(err.msg, has))
        fail_msg("%s '%s': message '%s' lacks '%s'", tdm_constraint_kind_name(kind), text, err.msg,
                 has);
    tdm_buf_free(&b);
}

static void test_compile(void **state)
{
    (void)state;
    char *g = compile_ok(TDM_CONSTRAINT_GRAMMAR, "root ::= \"yes\" | \"no\"\n");
    assert_string_equal(g, "root ::= \"yes\" | \"no\"\n"); /* a grammar is used as given */
    free(g);
    free(compile_ok(TDM_CONSTRAINT_JSON_OBJECT, NULL));
    free(compile_ok(TDM_CONSTRAINT_JSON_SCHEMA, "{\"type\":\"object\",\"properties\":{\"a\":"
                                                "{\"type\":\"integer\"}},\"required\":[\"a\"]}"));
    free(compile_ok(TDM_CONSTRAINT_REGEX, "[0-9]{3}-[a-z]+"));
    g = compile_ok(TDM_CONSTRAINT_CHOICE, "[\"red\",\"green\",\"blue, dark\"]");
    assert_non_null(strstr(g, "root"));
    free(g);
    compile_bad(TDM_CONSTRAINT_GRAMMAR, "root ::= (", "line 1");
    compile_bad(TDM_CONSTRAINT_GRAMMAR, "root ::= \"a\" root", "root"); /* no finite string */
    compile_bad(TDM_CONSTRAINT_JSON_SCHEMA,
                "{\"type\":\"object\",\"properties\":{\"a\":{\"propertyNames\":{}}}}",
                "/properties/a/propertyNames");
    compile_bad(TDM_CONSTRAINT_CHOICE, "[]", "choice");
    compile_bad(TDM_CONSTRAINT_CHOICE, "[\"a\", 2]", "choice[1]");
    compile_bad(TDM_CONSTRAINT_CHOICE, "{\"a\":1}", "choice");
    compile_bad(TDM_CONSTRAINT_CHOICE, "[\"a\"", "choice: not JSON");
    /* too ambiguous for the matcher from the first byte: refused here, not on a node */
    tdm_buf_t re = TDM_BUF_INIT;
    tdm_buf_puts(&re, "(a");
    for (int i = 1; i < 10000; i++)
        tdm_buf_puts(&re, "|a");
    tdm_buf_puts(&re, ")+b");
    compile_bad(TDM_CONSTRAINT_REGEX, re.data,
                "regex: grammar.stacks: a prefix of 1 bytes needs "
                "more than 1024 parse stacks");
    tdm_buf_clear(&re);
    tdm_buf_puts(&re, "root ::= r0\n");
    for (int i = 0; i < 10000; i++)
        tdm_buf_printf(&re, "r%d ::= r%d | \"x\"\n", i, i + 1);
    tdm_buf_puts(&re, "r10000 ::= \"y\"\n");
    compile_bad(TDM_CONSTRAINT_GRAMMAR, re.data, "the grammar is too ambiguous");
    tdm_buf_free(&re);
    compile_bad(TDM_CONSTRAINT_NONE, "x", "not a constraint");
    compile_bad(7, "x", "not a constraint");
    assert_string_equal(tdm_constraint_kind_name(TDM_CONSTRAINT_JSON_SCHEMA), "json_schema");
    assert_string_equal(tdm_constraint_kind_name(99), "?");
}

static const char *const texts[3] = {
    "root ::= \"a\" | \"b\"\n",
    "root ::= [0-9]+\n",
    "root ::= \"x\" \"y\"?\n",
};

static const tdm_grammar_t *get_ok(tdm_grammar_cache_t *c, int i)
{
    const tdm_grammar_t *g = NULL;
    tdm_error_t err = {0};
    size_t n = strlen(texts[i]);
    if (tdm_grammar_cache_get(c, texts[i], n, tdm_constraint_hash(texts[i], n), &g, &err) != 0)
        fail_msg("get %d: %s", i, err.msg);
    assert_non_null(g);
    return g;
}

/* Bytes one cached entry of texts[i] takes. */
static size_t entry_bytes(int i)
{
    tdm_error_t err = {0};
    tdm_grammar_t *g = tdm_grammar_parse(texts[i], strlen(texts[i]), NULL, &err);
    assert_non_null(g);
    size_t b = tdm_grammar_size_bytes(g) + strlen(texts[i]);
    tdm_grammar_destroy(&g);
    return b;
}

static void test_cache(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    size_t b0 = entry_bytes(0), b1 = entry_bytes(1), b2 = entry_bytes(2);
    size_t cap = b0 + b1 + b2 - 1; /* room for any two, not all three */
    tdm_grammar_cache_t *c = tdm_grammar_cache_new(cap, &err);
    assert_non_null(c);
    const tdm_grammar_t *g0 = get_ok(c, 0);
    const tdm_grammar_t *again = get_ok(c, 0);
    assert_ptr_equal(g0, again); /* one compile per text */
    tdm_grammar_cache_stats_t st;
    tdm_grammar_cache_stats(c, &st);
    assert_int_equal(st.hits, 1);
    assert_int_equal(st.misses, 1);
    assert_int_equal(st.entries, 1);
    assert_int_equal(st.bytes, b0);
    tdm_grammar_cache_release(c, again);
    tdm_grammar_cache_release(c, g0);
    const tdm_grammar_t *g1 = get_ok(c, 1);
    tdm_grammar_cache_release(c, g1);
    /* 0 is the least recently used and nobody holds it: the third entry evicts it */
    const tdm_grammar_t *g2 = get_ok(c, 2);
    tdm_grammar_cache_stats(c, &st);
    assert_int_equal(st.evictions, 1);
    assert_int_equal(st.entries, 2);
    assert_int_equal(st.bytes, b1 + b2);
    /* held grammars are never evicted, even past the bound */
    const tdm_grammar_t *h1 = get_ok(c, 1);
    g0 = get_ok(c, 0);
    tdm_grammar_cache_stats(c, &st);
    assert_int_equal(st.entries, 3);
    assert_true(st.bytes > cap);
    tdm_grammar_cache_release(c, g2); /* now 2 may go: back under the bound */
    tdm_grammar_cache_stats(c, &st);
    assert_int_equal(st.entries, 2);
    assert_true(st.bytes <= cap);
    tdm_grammar_cache_release(c, h1);
    tdm_grammar_cache_release(c, g0);
    tdm_grammar_cache_destroy(&c);
    assert_null(c);
    tdm_grammar_cache_destroy(NULL);
}

/* A hash that is not the text's and a grammar that does not compile are refused; a cache of 0
 * bytes keeps nothing once released. */
static void test_cache_refusals(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_grammar_cache_t *c = tdm_grammar_cache_new(1 << 20, &err);
    tdm_grammar_cache_stats_t st;
    const tdm_grammar_t *g = NULL;
    assert_int_equal(tdm_grammar_cache_get(c, texts[2], strlen(texts[2]), 12345, &g, &err),
                     TDM_EINVALID);
    assert_null(g);
    assert_non_null(strstr(err.msg, "hash"));
    /* a grammar that does not compile: the parser's message */
    const char *bad = "root ::= (";
    assert_int_equal(
        tdm_grammar_cache_get(c, bad, strlen(bad), tdm_constraint_hash(bad, strlen(bad)), &g, &err),
        TDM_EINVALID);
    tdm_grammar_cache_release(c, NULL); /* nothing */
    tdm_grammar_cache_stats(c, &st);
    assert_int_equal(st.entries, 0);
    tdm_grammar_cache_destroy(&c);

    c = tdm_grammar_cache_new(0, &err);
    g = get_ok(c, 1);
    tdm_grammar_cache_release(c, g);
    tdm_grammar_cache_stats(c, &st);
    assert_int_equal(st.entries, 0);
    assert_int_equal(st.bytes, 0);
    tdm_grammar_cache_destroy(&c);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_compile),
        cmocka_unit_test(test_cache),
        cmocka_unit_test(test_cache_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
