/* test_serve.c - the served-model loader the router and the nodes share (tandem/serve.h): the
 * figures they compare at registration, and its errors. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tandem/serve.h"
#include "tiny_model.h"

static void load_yaml(const char *yaml, tdm_config_t *cfg)
{
    tdm_error_t err = {0};
    if (tdm_config_load_string(yaml, strlen(yaml), "test.yaml", cfg, &err) != TDM_OK)
        fail_msg("config: %s", err.msg);
}

static void test_open(void **state)
{
    (void)state;
    char dir[] = "/tmp/tdm-serve-XXXXXX";
    assert_non_null(mkdtemp(dir));
    char path[128], yaml[512];
    snprintf(path, sizeof path, "%s/tiny.gguf", dir);
    tdm_error_t err = {0};
    tdm_tiny_llama_spec_t spec = {.n_vocab = 512, .n_ctx = 256, .n_layers = 3, .seed = 3};
    assert_int_equal(tdm_test_write_tiny_llama(path, &spec, &err), 0);
    snprintf(yaml, sizeof yaml,
             "model:\n  path: %s\nkv:\n  block_size: 32\n  dtype: f32\n"
             "nodes:\n  - id: decode-0\n    role: decode\n",
             path);
    tdm_config_t cfg;
    load_yaml(yaml, &cfg);
    tdm_served_model_t sm;
    assert_int_equal(tdm_served_model_open(&sm, &cfg, &err), TDM_OK);
    assert_non_null(sm.model);
    assert_non_null(sm.tok);
    assert_int_equal(sm.n_ctx, 256); /* min(4096, the model's 256) */
    assert_int_equal(sm.n_vocab, 512);
    assert_true(sm.fingerprint == tdm_model_fingerprint(sm.model));
    const tdm_llama_hparams_t *hp = tdm_model_hparams(sm.model);
    assert_int_equal(sm.layout.n_layers, 3);
    assert_int_equal(sm.layout.n_kv_heads, hp->n_kv_heads);
    assert_int_equal(sm.layout.head_dim, hp->head_dim);
    assert_int_equal(sm.layout.block_size, 32);
    assert_int_equal(sm.layout.dtype, TDM_KV_F32);
    tdm_served_model_close(&sm);
    assert_null(sm.model);
    tdm_served_model_close(&sm); /* twice is harmless */
    tdm_config_free(&cfg);

    /* a missing file names the path, and nothing is left open */
    snprintf(yaml, sizeof yaml,
             "model:\n  path: %s/none.gguf\nnodes:\n  - id: d\n    role: decode\n", dir);
    load_yaml(yaml, &cfg);
    assert_int_equal(tdm_served_model_open(&sm, &cfg, &err), TDM_ENOTFOUND);
    char want[160];
    snprintf(want, sizeof want, "model %s/none.gguf: ", dir);
    assert_int_equal(strncmp(err.msg, want, strlen(want)), 0);
    assert_null(sm.model);
    assert_null(sm.tok);
    tdm_config_free(&cfg);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
