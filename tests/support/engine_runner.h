/* engine_runner.h - drives the engine in tests: a model + KV pool + engine fixture, sequences
 * with their block tables, and a runner that feeds several sequences together in chunks and
 * keeps the logits of every position. */
#ifndef TANDEM_TEST_ENGINE_RUNNER_H
#define TANDEM_TEST_ENGINE_RUNNER_H

#include <stdbool.h>
#include <stdint.h>

#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/tokenizer.h"
#include "tiny_model.h"

#define TDM_TEST_MAX_ROWS 256   /* rows per forward pass */
#define TDM_TEST_MAX_LOGITS 160 /* rows asking for logits per pass */
#define TDM_TEST_MAX_SEQS 8     /* sequences run together */

typedef struct tdm_test_engine {
    char path[256]; /* model file (tiny models: written by tdm_test_engine_write_tiny) */
    tdm_model_t *model;
    tdm_kv_pool_t *pool; /* 256 blocks of 16 tokens */
    tdm_engine_t *engine;
    uint32_t n_vocab;
} tdm_test_engine_t;

/* A group fixture for the worker tests: a tiny model (n_ctx 512, seed 7) with an f16 KV pool
 * of 512 blocks and its tokenizer; tdm_test_tok_engine_setup/teardown are cmocka group
 * setup/teardown functions (*state is the tdm_test_tok_engine_t). */
typedef struct tdm_test_tok_engine {
    tdm_test_engine_t f;
    tdm_tokenizer_t *tok;
} tdm_test_tok_engine_t;

int tdm_test_tok_engine_setup(void **state);
int tdm_test_tok_engine_teardown(void **state);

/* One sequence being run: its tokens, block table and the logits of every position. */
typedef struct tdm_test_seq {
    const int32_t *tokens;
    uint32_t n;
    tdm_kv_seq_t kv;
    float *logits; /* [n][n_vocab] */
} tdm_test_seq_t;

/* Writes a tiny model to a per-process temporary path stored in f->path (fails the test on
 * error). */
void tdm_test_engine_write_tiny(tdm_test_engine_t *f, const tdm_tiny_llama_spec_t *spec);
/* Loads path and creates pool and engine (fails the test on error). */
void tdm_test_engine_open(tdm_test_engine_t *f, const char *path, tdm_kv_dtype_t dtype,
                          uint32_t n_ctx);
/* Checks no KV block is still in use, then frees everything. */
void tdm_test_engine_close(tdm_test_engine_t *f);
/* Starts a sequence: reserves blocks for n tokens and allocates its logits. */
void tdm_test_seq_start(tdm_test_engine_t *f, tdm_test_seq_t *s, const int32_t *tokens, uint32_t n);
void tdm_test_seq_end(tdm_test_engine_t *f, tdm_test_seq_t *s);
/* Runs sequences together: each step takes up to chunk[i] next tokens of sequence i (all in
 * one batch), asking logits for every row, until all are done. */
void tdm_test_run_together(tdm_test_engine_t *f, tdm_test_seq_t *seqs, uint32_t n_seqs,
                           const uint32_t *chunk);
/* n pseudo-random token ids in [0, n_vocab - 3) from seed (an LCG; same seed, same ids). */
void tdm_test_random_tokens(int32_t *t, uint32_t n, uint32_t n_vocab, uint64_t seed);

#endif
