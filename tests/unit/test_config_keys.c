/* test_config_keys.c - the config key table itself: every row complete and consistent (a doc
 * line, a default inside its own bounds, what its type needs), no key twice, every default
 * accepted when written out, and the Markdown tables' shape. */
#include "tdm_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/src/config/config_internal.h"
#include "tandem/config.h"

/* Whether the default of a numeric row lies within the row's bounds. */
static bool default_in_bounds(const tdm_config_key_t *k)
{
    if (k->flags & TDM_CONFIG_DERIVED)
        return true; /* 0 until config_finish fills it */
    bool open = k->flags & TDM_CONFIG_MIN_OPEN;
    if ((open ? k->def <= k->min : k->def < k->min) || k->def > k->max)
        return false;
    long long x = (long long)k->def;
    return !(k->flags & TDM_CONFIG_POW2) || (x & (x - 1)) == 0;
}

/* What each row's type needs, and a doc line for every row. */
static void check_row(const tdm_config_key_t *k)
{
    if (!k->name || !k->name[0] || !k->doc || !k->doc[0])
        fail_msg("a row of section %d lacks a name or a doc line", (int)k->section);
    if ((k->flags & TDM_CONFIG_DERIVED) && !k->def_text)
        fail_msg("%s: a derived default needs its description in def_text", k->name);
    if (strchr(k->doc, '|') || (k->def_text && strchr(k->def_text, '|')))
        fail_msg("%s: a '|' would split the Markdown table's row", k->name);
    switch (k->type) {
    case TDM_CONFIG_TYPE_INT:
    case TDM_CONFIG_TYPE_NUMBER:
    case TDM_CONFIG_TYPE_BYTES:
        if (!(k->min <= k->max) || !default_in_bounds(k))
            fail_msg("%s: default %g outside [%g, %g]", k->name, k->def, k->min, k->max);
        break;
    case TDM_CONFIG_TYPE_ENUM:
        assert_non_null(k->values);
        assert_true(k->def >= 0 && k->def < k->values->n_values);
        assert_true(k->size == sizeof(int) || k->size == sizeof(bool));
        break;
    case TDM_CONFIG_TYPE_LIST: assert_non_null(k->item); break;
    case TDM_CONFIG_TYPE_MAPPING:
        assert_true(k->sub > k->section && k->sub < TDM_CONFIG_N_SECTIONS);
        break;
    default: break;
    }
}

static void test_rows(void **state)
{
    (void)state;
    size_t n;
    const tdm_config_key_t *keys = tdm_config_keys(&n);
    assert_true(n > 40);
    for (size_t i = 0; i < n; i++) {
        check_row(&keys[i]);
        assert_ptr_equal(tdm_config_key_find(keys[i].section, keys[i].name), &keys[i]);
        assert_int_equal(tdm_config_key_index(&keys[i]), i);
        /* sections in order, each in one run of rows */
        if (i > 0)
            assert_true(keys[i].section >= keys[i - 1].section);
    }
    assert_null(tdm_config_key_find(TDM_CONFIG_SECTION_ROUTER, "htp_port"));
}

/* Every key written with its table default loads (the defaults pass their own checks). */
static void test_defaults_load(void **state)
{
    (void)state;
    tdm_config_t cfg, back;
    tdm_error_t err = {0};
    setenv("XDG_CACHE_HOME", "/tmp/xdg-cache", 1);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    assert_int_equal(tdm_config_dump(&cfg, f), TDM_OK);
    assert_int_equal(fclose(f), 0);
    if (tdm_config_load_string(text, len, "defaults.yaml", &back, &err) != TDM_OK)
        fail_msg("%s", err.msg);
    assert_int_equal(back.router.http_port, 8000);
    assert_int_equal(back.nodes[0].spec_max_draft, TDM_CONFIG_DEFAULT_SPEC_MAX_DRAFT);
    assert_true(back.router.metrics_compat_vllm);
    free(text);
    tdm_config_free(&back);
    tdm_config_free(&cfg);
}

static void test_markdown(void **state)
{
    (void)state;
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    assert_non_null(f);
    assert_int_equal(tdm_config_keys_markdown("nodes", f), TDM_OK);
    assert_int_equal(tdm_config_keys_markdown("nodez", f), TDM_ENOTFOUND);
    assert_int_equal(fclose(f), 0);
    assert_non_null(strstr(text, "| key | type | default | range / meaning |\n"));
    assert_non_null(strstr(text, "| `id` | string | required | "));
    assert_non_null(strstr(text, "| `role` | `prefill` \\| `decode` | required | "));
    assert_non_null(strstr(text, "| `speculative` | mapping | `{max_draft: 8, row_cost: 0}` | "));
    assert_non_null(strstr(text, "| `speculative.max_draft` | int | `8` | 0–16 tokens: "));
    assert_non_null(strstr(text, "| `grammar_cache_bytes` | bytes | `64MiB` | `0`–`16GiB`: "));
    assert_non_null(strstr(text, "| `kv_endpoint` | endpoint | `tcp://127.0.0.1:(7610 + n)` for "
                                 "the n-th decode node, counting from 0 | decode nodes only (an "
                                 "error on a prefill node): "));
    assert_null(strstr(text, "<!--")); /* one section: no marker line */
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rows),
        cmocka_unit_test(test_defaults_load),
        cmocka_unit_test(test_markdown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
