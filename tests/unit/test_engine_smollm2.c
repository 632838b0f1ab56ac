/* test_engine_smollm2.c - batch invariance on the real default model (SmolLM2-135M, Q4_1 and
 * Q8_0 weights): two prompts run alone in one pass each, then together with prefill chunks of 7
 * and 1 tokens, give bitwise identical logits at every position; with a q8 KV cache every kernel
 * family gives the scalar reference's logits. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tdm_test.h"
#include "engine_runner.h"
#include "tandem/config.h"

static void test_invariance_smollm2(void **state)
{
    (void)state;
    tdm_test_engine_t f;
    char path[512];
    tdm_model_default_path(path, sizeof path);
    if (access(path, R_OK) != 0)
        fail_msg("default model %s is missing: run scripts/setup", path);
    tdm_test_engine_open(&f, path, TDM_KV_F16, 512);
    int32_t a[40], b[23];
    tdm_test_random_tokens(a, 40, f.n_vocab, 9);
    tdm_test_random_tokens(b, 23, f.n_vocab, 10);
    const int32_t *prompts[2] = {a, b};
    uint32_t lens[2] = {40, 23};
    tdm_test_seq_t ref[2], s[2];
    for (int i = 0; i < 2; i++) {
        tdm_test_seq_start(&f, &ref[i], prompts[i], lens[i]);
        tdm_test_run_together(&f, &ref[i], 1, &lens[i]);
    }
    uint32_t chunks[2] = {7, 1};
    for (int i = 0; i < 2; i++)
        tdm_test_seq_start(&f, &s[i], prompts[i], lens[i]);
    tdm_test_run_together(&f, s, 2, chunks);
    for (int i = 0; i < 2; i++) {
        assert_memory_equal(s[i].logits, ref[i].logits, (size_t)lens[i] * f.n_vocab * 4);
        tdm_test_seq_end(&f, &s[i]);
        tdm_test_seq_end(&f, &ref[i]);
    }
    tdm_test_engine_close(&f);
}

/* Logits of prompt a (12 tokens, one pass) beside b (5 tokens, one a pass: decode rows) on the
 * default model with a q8 KV cache and TANDEM_CPU_KERNELS=family, [12 + 5][n_vocab]; fails
 * when a's differ from a alone (batch invariance). The backend name goes to name. */
static float *q8_family_logits(const char *path, const char *family, char *name, size_t name_len,
                               size_t *n_floats)
{
    setenv("TANDEM_CPU_KERNELS", family, 1);
    tdm_test_engine_t f;
    tdm_test_engine_open(&f, path, TDM_KV_Q8, 512);
    unsetenv("TANDEM_CPU_KERNELS");
    snprintf(name, name_len, "%s", tdm_engine_backend_name(f.engine));
    int32_t a[12], b[5];
    tdm_test_random_tokens(a, 12, f.n_vocab, 11);
    tdm_test_random_tokens(b, 5, f.n_vocab, 12);
    size_t na = (size_t)12 * f.n_vocab, nb = (size_t)5 * f.n_vocab;
    tdm_test_seq_t ref, s[2];
    uint32_t whole = 12, chunks[2] = {12, 1};
    tdm_test_seq_start(&f, &ref, a, 12);
    tdm_test_run_together(&f, &ref, 1, &whole);
    tdm_test_seq_start(&f, &s[0], a, 12);
    tdm_test_seq_start(&f, &s[1], b, 5);
    tdm_test_run_together(&f, s, 2, chunks);
    if (memcmp(s[0].logits, ref.logits, na * sizeof(float)) != 0)
        fail_msg("%s, q8 KV: a prompt's logits differ beside another", name);
    float *out = malloc((na + nb) * sizeof *out);
    assert_non_null(out);
    memcpy(out, s[0].logits, na * sizeof *out);
    memcpy(out + na, s[1].logits, nb * sizeof *out);
    *n_floats = na + nb;
    tdm_test_seq_end(&f, &ref);
    tdm_test_seq_end(&f, &s[0]);
    tdm_test_seq_end(&f, &s[1]);
    tdm_test_engine_close(&f);
    return out;
}

/* A q8 KV cache on the default model (head_dim 64, GQA groups of 3): the AVX2 and AVX-512
 * families (the grouped q8 tiles) give the scalar family's logits (the per-head reference
 * path) bit for bit, for a prefill pass and for decode rows. */
static void test_q8_families_smollm2(void **state)
{
    (void)state;
    char path[512], ref_name[64], name[64], last[64];
    tdm_model_default_path(path, sizeof path);
    if (access(path, R_OK) != 0)
        fail_msg("default model %s is missing: run scripts/setup", path);
    size_t n_ref, n;
    float *ref = q8_family_logits(path, "scalar", ref_name, sizeof ref_name, &n_ref);
    assert_string_equal(ref_name, "cpu/scalar");
    snprintf(last, sizeof last, "%s", ref_name);
    static const char *const families[] = {"avx2", "avx512"};
    for (size_t k = 0; k < sizeof families / sizeof families[0]; k++) {
        float *got = q8_family_logits(path, families[k], name, sizeof name, &n);
        if (strcmp(name, last) != 0) { /* a family this CPU lacks caps to the one below */
            printf("q8 KV: %s gives %s's logits bit for bit\n", name, ref_name);
            assert_int_equal(n, n_ref);
            if (memcmp(got, ref, n * sizeof *got) != 0)
                fail_msg("q8 KV: %s logits differ from the scalar reference", name);
            snprintf(last, sizeof last, "%s", name);
        }
        free(got);
    }
    free(ref);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invariance_smollm2),
        cmocka_unit_test(test_q8_families_smollm2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
