/* engine_runner.c - see engine_runner.h. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tdm_test.h"
#include "engine_runner.h"

void tdm_test_engine_open(tdm_test_engine_t *f, const char *path, tdm_kv_dtype_t dtype,
                          uint32_t n_ctx)
{
    tdm_error_t err = {0};
    f->model = tdm_model_load(path, &err);
    if (!f->model)
        fail_msg("load %s: %s", path, err.msg);
    const tdm_llama_hparams_t *hp = tdm_model_hparams(f->model);
    f->n_vocab = hp->n_vocab;
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, dtype};
    f->pool = tdm_kv_pool_new(&kl, 256, &err);
    assert_non_null(f->pool);
    tdm_engine_params_t p;
    tdm_engine_params_default(&p);
    p.max_batch_tokens = TDM_TEST_MAX_ROWS;
    p.max_logits = TDM_TEST_MAX_LOGITS;
    p.n_ctx = n_ctx;
    f->engine = tdm_engine_new(f->model, f->pool, &p, &err);
    if (!f->engine)
        fail_msg("engine: %s", err.msg);
}

void tdm_test_engine_close(tdm_test_engine_t *f)
{
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(f->pool, &st);
    assert_int_equal(st.n_used, 0); /* every test releases every sequence */
    assert_int_equal(st.n_used + st.n_cached + st.n_free, st.n_blocks);
    tdm_engine_destroy(&f->engine);
    tdm_kv_pool_destroy(&f->pool);
    tdm_model_destroy(&f->model);
    assert_null(f->engine);
}

void tdm_test_engine_write_tiny(tdm_test_engine_t *f, const tdm_tiny_llama_spec_t *spec)
{
    snprintf(f->path, sizeof f->path, "/tmp/tandem-test-model-%d.gguf", (int)getpid());
    tdm_error_t err = {0};
    if (tdm_test_write_tiny_llama(f->path, spec, &err) != TDM_OK)
        fail_msg("tiny model: %s", err.msg);
}

void tdm_test_seq_start(tdm_test_engine_t *f, tdm_test_seq_t *s, const int32_t *tokens, uint32_t n)
{
    s->tokens = tokens;
    s->n = n;
    tdm_kv_seq_init(&s->kv);
    assert_int_equal(tdm_kv_seq_reserve(f->pool, &s->kv, n), TDM_OK);
    s->logits = calloc((size_t)n * f->n_vocab, sizeof(float));
    assert_non_null(s->logits);
}

void tdm_test_seq_end(tdm_test_engine_t *f, tdm_test_seq_t *s)
{
    tdm_kv_seq_release(f->pool, &s->kv);
    free(s->logits);
}

/* Runs sequences together: each step takes up to chunk[i] next tokens of sequence i (all
 * sequences in one batch), asking logits for every row, until all are done. */
void tdm_test_run_together(tdm_test_engine_t *f, tdm_test_seq_t *seqs, uint32_t n_seqs,
                           const uint32_t *chunk)
{
    static int32_t tokens[TDM_TEST_MAX_ROWS];
    static uint32_t pos[TDM_TEST_MAX_ROWS], seq[TDM_TEST_MAX_ROWS];
    tdm_batch_seq_t bseq[TDM_TEST_MAX_SEQS];
    uint32_t done[TDM_TEST_MAX_SEQS] = {0};
    assert_true(n_seqs <= TDM_TEST_MAX_SEQS);
    float *logits = malloc((size_t)TDM_TEST_MAX_LOGITS * f->n_vocab * sizeof(float));
    assert_non_null(logits);
    for (;;) {
        uint32_t n = 0;
        for (uint32_t i = 0; i < n_seqs; i++) {
            bseq[i] = (tdm_batch_seq_t){seqs[i].kv.blocks, seqs[i].kv.n_blocks, NULL};
            for (uint32_t k = 0; k < chunk[i] && done[i] + k < seqs[i].n; k++) {
                tokens[n] = seqs[i].tokens[done[i] + k];
                pos[n] = done[i] + k;
                seq[n] = i;
                n++;
            }
        }
        if (n == 0)
            break;
        assert_true(n <= TDM_TEST_MAX_LOGITS);
        tdm_batch_t b = {n, tokens, pos, seq, NULL, n_seqs, bseq};
        tdm_error_t err = {0};
        if (tdm_engine_forward(f->engine, &b, logits, &err) != TDM_OK)
            fail_msg("forward: %s", err.msg);
        for (uint32_t r = 0; r < n; r++)
            memcpy(seqs[seq[r]].logits + (size_t)pos[r] * f->n_vocab,
                   logits + (size_t)r * f->n_vocab, f->n_vocab * sizeof(float));
        for (uint32_t i = 0; i < n_seqs; i++)
            done[i] = done[i] + chunk[i] < seqs[i].n ? done[i] + chunk[i] : seqs[i].n;
    }
    free(logits);
}

void tdm_test_random_tokens(int32_t *t, uint32_t n, uint32_t n_vocab, uint64_t seed)
{
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = (int32_t)((seed >> 33) % (n_vocab - 3));
    }
}

int tdm_test_tok_engine_setup(void **state)
{
    tdm_test_tok_engine_t *fx = calloc(1, sizeof *fx);
    assert_non_null(fx);
    tdm_tiny_llama_spec_t spec = {0};
    spec.n_ctx = 512;
    spec.seed = 7;
    tdm_test_engine_write_tiny(&fx->f, &spec);
    tdm_test_engine_open(&fx->f, fx->f.path, TDM_KV_F16, 512);
    tdm_error_t err = {0};
    fx->tok = tdm_tokenizer_new(tdm_model_gguf(fx->f.model), &err);
    assert_non_null(fx->tok);
    *state = fx;
    return 0;
}

int tdm_test_tok_engine_teardown(void **state)
{
    tdm_test_tok_engine_t *fx = *state;
    tdm_tokenizer_destroy(&fx->tok);
    tdm_test_engine_close(&fx->f);
    remove(fx->f.path);
    free(fx);
    return 0;
}
