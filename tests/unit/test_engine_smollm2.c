/* test_engine_smollm2.c - batch invariance on the real default model (SmolLM2-135M, Q4_1 and
 * Q8_0 weights): two prompts run alone in one pass each, then together with prefill chunks of 7
 * and 1 tokens, give bitwise identical logits at every position. */
#include <stdio.h>
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_invariance_smollm2),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
