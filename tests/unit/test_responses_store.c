/* test_responses_store.c - the gateway's store of Responses API answers
 * (router/responses_store.c): put and get, replacement, least-recently-used eviction by count
 * and by bytes, an entry over the byte limit, a store of no entries, delete. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "responses_store.h"
#include "tandem/base.h"

static void put_ok(resp_store_t *s, const char *id, const char *resp, const char *conv)
{
    assert_int_equal(resp_store_put(s, id, resp, conv), TDM_OK);
}

static void get_is(resp_store_t *s, const char *id, const char *resp, const char *conv)
{
    char *r = NULL, *c = NULL;
    assert_int_equal(resp_store_get(s, id, &r, &c), TDM_OK);
    assert_string_equal(r, resp);
    assert_string_equal(c, conv);
    free(r);
    free(c);
}

static void gone(resp_store_t *s, const char *id)
{
    char *r = (char *)"x";
    assert_int_equal(resp_store_get(s, id, &r, NULL), TDM_ENOTFOUND);
    assert_null(r);
}

static void test_put_get_replace_delete(void **state)
{
    (void)state;
    resp_store_t *s = resp_store_new(4, 1 << 20);
    assert_non_null(s);
    put_ok(s, "resp_a", "{\"id\":\"resp_a\"}", "[1]");
    put_ok(s, "resp_b", "{\"id\":\"resp_b\"}", "[2]");
    get_is(s, "resp_a", "{\"id\":\"resp_a\"}", "[1]");
    gone(s, "resp_c");
    put_ok(s, "resp_a", "{\"v\":2}", "[1,2]"); /* replaced, not added */
    get_is(s, "resp_a", "{\"v\":2}", "[1,2]");
    resp_store_stats_t st = resp_store_stats(s);
    assert_int_equal(st.count, 2);
    /* bytes: id, response and conversation with their NULs */
    assert_int_equal(st.bytes, (7 + 8 + 6) + (7 + 16 + 4));
    assert_true(resp_store_delete(s, "resp_a"));
    assert_false(resp_store_delete(s, "resp_a"));
    gone(s, "resp_a");
    assert_int_equal(resp_store_stats(s).count, 1);
    resp_store_destroy(&s);
    assert_null(s);
    resp_store_destroy(&s); /* NULL-safe */
}

static void test_evicts_least_recently_used_by_count(void **state)
{
    (void)state;
    resp_store_t *s = resp_store_new(3, 1 << 20);
    put_ok(s, "a", "1", "[]");
    put_ok(s, "b", "2", "[]");
    put_ok(s, "c", "3", "[]");
    get_is(s, "a", "1", "[]"); /* a is now the most recent: b goes first */
    put_ok(s, "d", "4", "[]");
    gone(s, "b");
    get_is(s, "a", "1", "[]");
    get_is(s, "c", "3", "[]");
    get_is(s, "d", "4", "[]");
    resp_store_stats_t st = resp_store_stats(s);
    assert_int_equal(st.count, 3);
    assert_int_equal(st.evicted, 1);
    resp_store_destroy(&s);
}

static void test_evicts_by_bytes_and_refuses_an_entry_over_the_limit(void **state)
{
    (void)state;
    /* each entry: id 2 + response 11 + conversation 3 = 16 bytes; 40 bytes hold two */
    resp_store_t *s = resp_store_new(100, 40);
    put_ok(s, "a", "0123456789", "[]");
    put_ok(s, "b", "0123456789", "[]");
    put_ok(s, "c", "0123456789", "[]");
    gone(s, "a");
    get_is(s, "b", "0123456789", "[]");
    assert_int_equal(resp_store_stats(s).bytes, 32);
    char big[64];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    assert_int_equal(resp_store_put(s, "e", big, "[]"), TDM_EINVALID);
    gone(s, "e");
    assert_int_equal(resp_store_stats(s).count, 2); /* nothing evicted for it */
    resp_store_destroy(&s);
}

static void test_a_store_of_no_entries_keeps_none(void **state)
{
    (void)state;
    resp_store_t *s = resp_store_new(0, 1 << 20);
    assert_int_equal(resp_store_put(s, "a", "1", "[]"), TDM_EINVALID);
    gone(s, "a");
    resp_store_destroy(&s);
}

static void test_many_entries_hash_and_evict_in_order(void **state)
{
    (void)state;
    resp_store_t *s = resp_store_new(100, 1 << 20);
    char id[32], val[32];
    for (int i = 0; i < 250; i++) {
        snprintf(id, sizeof id, "resp_%d", i);
        snprintf(val, sizeof val, "%d", i);
        put_ok(s, id, val, "[]");
    }
    for (int i = 0; i < 250; i++) {
        snprintf(id, sizeof id, "resp_%d", i);
        snprintf(val, sizeof val, "%d", i);
        if (i < 150)
            gone(s, id);
        else
            get_is(s, id, val, "[]");
    }
    assert_int_equal(resp_store_stats(s).evicted, 150);
    resp_store_destroy(&s);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_put_get_replace_delete),
        cmocka_unit_test(test_evicts_least_recently_used_by_count),
        cmocka_unit_test(test_evicts_by_bytes_and_refuses_an_entry_over_the_limit),
        cmocka_unit_test(test_a_store_of_no_entries_keeps_none),
        cmocka_unit_test(test_many_entries_hash_and_evict_in_order),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
