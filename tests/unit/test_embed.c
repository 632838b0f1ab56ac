/* test_embed.c - embeddings (model.h's pooling, worker.h's embedding sequences) against
 * llama.cpp's on the same GGUF (tests/golden/embed_golden.json, made by
 * tests/golden/make_embed_golden.py): cosine >= 0.999 for pooling last and mean on SmolLM2-135M
 * Q4_1 and Gemma 3 270M; and bitwise equality of one prompt's vector computed alone in one
 * forward pass (the single-process path), through a worker alone, and through a worker in
 * chunks mixed with other embeddings of other lengths and a generating sequence (batch
 * invariance: what a prefill node under load computes). */
#include "tdm_test.h"

#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/model.h"
#include "tandem/tokenizer.h"
#include "tandem/worker.h"

#define GOLDEN_PATH TDM_SOURCE_DIR "/tests/golden/embed_golden.json"
/* The bound on the cosine to llama.cpp's vector: 0.999 (issue #38), or, where llama.cpp itself
 * differs more between two of its own attention kernels (the file's llama_cpp_self_min: flash
 * attention on against off), 1 - 2 * (1 - llama_cpp_self_min), twice its own distance, as
 * test_golden.c bounds logits. Measured 2026-12-05 on this CPU: SmolLM2-135M Q4_1 lowest
 * 0.99963 (llama.cpp self 0.99950: bound 0.999); Gemma 3 270M Q4_K_M lowest 0.99739, last
 * pooling of the short prompts (llama.cpp self 0.99703 on the same cases: bound 0.99407).
 * Gemma's hidden states carry a few very large channels, which every implementation rounds
 * differently. */
#define MIN_COSINE 0.999
#define N_CTX 1024u
#define MAX_ROWS 256u
#define MAX_RUNNING 8u
#define MAX_CASES 16u

typedef struct ecase {
    const char *name;
    tdm_pooling_t pooling;
    int32_t *tokens;
    uint32_t n;
    float *ref; /* [n_embd] llama.cpp's */
} ecase_t;

typedef struct fixture {
    json_t *doc;
    double min_cosine; /* the bound for this model (MIN_COSINE above) */
    tdm_model_t *model;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_tokenizer_t *tok;
    uint32_t n_embd;
    ecase_t cases[MAX_CASES];
    uint32_t n_cases;
} fixture_t;

/* Opens model `file` (the default model when NULL) and the golden cases of `name`; skips when
 * the optional model is not installed. */
static void fixture_open(fixture_t *fx, const char *name, const char *file)
{
    char path[1024], problem[1024];
    memset(fx, 0, sizeof *fx);
    if (!file) {
        if (!tdm_test_default_model(path, sizeof path, problem, sizeof problem))
            fail_msg("%s", problem);
    } else if (!tdm_test_cached_model("TANDEM_GEMMA3_MODEL", file, TDM_TEST_GEMMA3_SETUP, path,
                                      sizeof path, problem, sizeof problem)) {
        print_message("skipped: %s\n", problem);
        skip();
    }
    json_error_t jerr;
    fx->doc = json_load_file(GOLDEN_PATH, 0, &jerr);
    if (!fx->doc)
        fail_msg("%s:%d: %s", GOLDEN_PATH, jerr.line, jerr.text);
    tdm_error_t err = {0};
    fx->model = tdm_model_load(path, &err);
    if (!fx->model)
        fail_msg("load %s: %s", path, err.msg);
    const tdm_llama_hparams_t *hp = tdm_model_hparams(fx->model);
    fx->n_embd = hp->n_embd;
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, TDM_KV_F16};
    fx->pool = tdm_kv_pool_new(&kl, 256, &err);
    assert_non_null(fx->pool);
    tdm_engine_params_t p;
    tdm_engine_params_default(&p);
    p.max_batch_tokens = MAX_ROWS;
    p.max_logits = MAX_RUNNING;
    p.n_ctx = N_CTX;
    fx->engine = tdm_engine_new(fx->model, fx->pool, &p, &err);
    if (!fx->engine)
        fail_msg("engine: %s", err.msg);
    fx->tok = tdm_tokenizer_new(tdm_model_gguf(fx->model), &err);
    assert_non_null(fx->tok);

    const json_t *models = json_object_get(fx->doc, "models");
    for (size_t m = 0; m < json_array_size(models); m++) {
        const json_t *jm = json_array_get(models, m);
        if (strcmp(json_string_value(json_object_get(jm, "name")), name) != 0)
            continue;
        double self = json_number_value(json_object_get(jm, "llama_cpp_self_min"));
        assert_true(self > 0.9 && self <= 1.0);
        fx->min_cosine = 1.0 - 2.0 * (1.0 - self);
        if (fx->min_cosine > MIN_COSINE)
            fx->min_cosine = MIN_COSINE;
        const json_t *cases = json_object_get(jm, "cases");
        for (size_t i = 0; i < json_array_size(cases) && fx->n_cases < MAX_CASES; i++) {
            const json_t *jc = json_array_get(cases, i);
            ecase_t *c = &fx->cases[fx->n_cases++];
            c->name = json_string_value(json_object_get(jc, "name"));
            assert_int_equal(
                tdm_pooling_parse(json_string_value(json_object_get(jc, "pooling")), &c->pooling),
                TDM_OK);
            const json_t *toks = json_object_get(jc, "tokens");
            const json_t *emb = json_object_get(jc, "embedding");
            c->n = (uint32_t)json_array_size(toks);
            assert_int_equal(json_array_size(emb), fx->n_embd);
            c->tokens = calloc(c->n, sizeof *c->tokens);
            c->ref = calloc(fx->n_embd, sizeof *c->ref);
            assert_non_null(c->tokens);
            assert_non_null(c->ref);
            for (uint32_t t = 0; t < c->n; t++)
                c->tokens[t] = (int32_t)json_integer_value(json_array_get(toks, t));
            for (uint32_t d = 0; d < fx->n_embd; d++)
                c->ref[d] = (float)json_number_value(json_array_get(emb, d));
        }
    }
    assert_true(fx->n_cases >= 4);
}

static void fixture_close(fixture_t *fx)
{
    for (uint32_t i = 0; i < fx->n_cases; i++) {
        free(fx->cases[i].tokens);
        free(fx->cases[i].ref);
    }
    tdm_tokenizer_destroy(&fx->tok);
    tdm_engine_destroy(&fx->engine);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(fx->pool, &st);
    assert_int_equal(st.n_used, 0); /* every embedding gave its blocks back */
    tdm_kv_pool_destroy(&fx->pool);
    tdm_model_destroy(&fx->model);
    json_decref(fx->doc);
}

/* Runs cases pick[0..n) through one worker (max_batch_tokens rows per step; with `generate`,
 * a generating sequence of random-ish tokens shares the steps) and writes case pick[i]'s
 * vector to out[i][n_embd]. */
static void run_worker(fixture_t *fx, const uint32_t *pick, uint32_t n, uint32_t max_batch_tokens,
                       bool generate, float *out)
{
    tdm_worker_opts_t o = {.mode = TDM_WORKER_MODE_DECODE,
                           .max_batch_tokens = max_batch_tokens,
                           .max_running = MAX_RUNNING,
                           .max_waiting = 64,
                           .n_ctx = N_CTX,
                           .prefix_caching = true};
    tdm_error_t err = {0};
    tdm_worker_t *w = tdm_worker_new(fx->engine, fx->pool, fx->tok,
                                     tdm_model_hparams(fx->model)->n_vocab, &o, &err);
    if (!w)
        fail_msg("worker: %s", err.msg);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 0.0f;
    sp.max_tokens = 12;
    sp.ignore_eos = true;
    if (generate) {
        /* a long prompt of its own, so its prefill chunks share steps with the embeddings */
        static int32_t prompt[90];
        for (uint32_t i = 0; i < 90; i++)
            prompt[i] = fx->cases[0].tokens[i % fx->cases[0].n] + (int32_t)i;
        tdm_worker_req_t g = {.seq_id = 1000, .prompt = prompt, .n_prompt = 90, .sampling = &sp};
        assert_int_equal(tdm_worker_add(w, &g, &err), TDM_OK);
    }
    for (uint32_t i = 0; i < n; i++) {
        const ecase_t *c = &fx->cases[pick[i]];
        tdm_worker_req_t r = {.seq_id = i + 1,
                              .prompt = c->tokens,
                              .n_prompt = c->n,
                              .embed = true,
                              .pooling = c->pooling};
        if (tdm_worker_add(w, &r, &err) != TDM_OK)
            fail_msg("add %s: %s", c->name, err.msg);
    }
    uint32_t got = 0;
    for (int guard = 0; tdm_worker_busy(w) && guard < 10000; guard++) {
        const tdm_worker_event_t *ev;
        uint32_t n_ev;
        if (tdm_worker_step(w, &ev, &n_ev, &err) != TDM_OK)
            fail_msg("step: %s", err.msg);
        for (uint32_t e = 0; e < n_ev; e++) {
            if (ev[e].kind == TDM_WORKER_EVENT_FAILED)
                fail_msg("seq %llu failed: %s", (unsigned long long)ev[e].seq_id, ev[e].message);
            if (ev[e].kind != TDM_WORKER_EVENT_EMBEDDING)
                continue;
            uint64_t k = ev[e].seq_id - 1;
            assert_true(k < n);
            assert_int_equal(ev[e].n_embd, fx->n_embd);
            assert_int_equal(ev[e].n_tokens, fx->cases[pick[k]].n);
            memcpy(out + k * fx->n_embd, ev[e].embedding, fx->n_embd * sizeof *out);
            got++;
        }
    }
    assert_int_equal(got, n);
    tdm_worker_destroy(&w);
}

/* The single-process path: the whole prompt in one forward pass, pooled here. */
static void run_direct(fixture_t *fx, const ecase_t *c, float *out)
{
    tdm_kv_seq_t kv;
    tdm_kv_seq_init(&kv);
    assert_int_equal(tdm_kv_seq_reserve(fx->pool, &kv, c->n), TDM_OK);
    uint32_t *pos = calloc(c->n, sizeof *pos), *seq = calloc(c->n, sizeof *seq);
    float *hidden = calloc((size_t)c->n * fx->n_embd, sizeof *hidden);
    double *acc = calloc(fx->n_embd, sizeof *acc);
    bool *want = calloc(c->n, sizeof *want);
    assert_true(pos && seq && hidden && acc && want);
    for (uint32_t i = 0; i < c->n; i++)
        pos[i] = i;
    tdm_batch_seq_t bs = {kv.blocks, kv.n_blocks, NULL};
    tdm_batch_t b = {c->n, c->tokens, pos, seq, want, 1, &bs};
    tdm_error_t err = {0};
    if (tdm_engine_forward_hidden(fx->engine, &b, NULL, hidden, &err) != TDM_OK)
        fail_msg("forward: %s", err.msg);
    for (uint32_t i = 0; i < c->n; i++)
        tdm_embedding_add(c->pooling, acc, hidden + (size_t)i * fx->n_embd, fx->n_embd);
    tdm_embedding_finish(c->pooling, acc, c->n, fx->n_embd, out);
    tdm_kv_seq_release(fx->pool, &kv);
    free(pos);
    free(seq);
    free(hidden);
    free(acc);
    free(want);
}

static double cosine(const float *a, const float *b, uint32_t n)
{
    double ab = 0, aa = 0, bb = 0;
    for (uint32_t i = 0; i < n; i++) {
        ab += (double)a[i] * b[i];
        aa += (double)a[i] * a[i];
        bb += (double)b[i] * b[i];
    }
    return ab / sqrt(aa * bb);
}

/* Golden cosine, then the three paths bit for bit. */
static void check_model(const char *name, const char *file)
{
    fixture_t fx;
    fixture_open(&fx, name, file);
    uint32_t n = fx.n_cases, d = fx.n_embd;
    float *alone = calloc((size_t)n * d, sizeof(float));
    float *mixed = calloc((size_t)n * d, sizeof(float));
    float *direct = calloc(d, sizeof(float));
    uint32_t pick[MAX_CASES] = {0};
    assert_true(alone && mixed && direct);
    double worst = 1.0;
    for (uint32_t i = 0; i < n; i++) {
        pick[i] = i;
        run_worker(&fx, &pick[i], 1, MAX_ROWS, false, alone + (size_t)i * d);
        double cs = cosine(alone + (size_t)i * d, fx.cases[i].ref, d);
        double norm = cosine(alone + (size_t)i * d, alone + (size_t)i * d, d);
        print_message("%s %-8s %-4s %3u tokens: cosine %.6f\n", name, fx.cases[i].name,
                      tdm_pooling_name(fx.cases[i].pooling), fx.cases[i].n, cs);
        assert_true(fabs(norm - 1.0) < 1e-6);
        if (cs < worst)
            worst = cs;
        run_direct(&fx, &fx.cases[i], direct);
        assert_memory_equal(direct, alone + (size_t)i * d, d * sizeof(float));
    }
    print_message("%s: lowest cosine vs llama.cpp %.6f (bound %.5f)\n", name, worst, fx.min_cosine);
    assert_true(worst >= fx.min_cosine);
    /* every case at once, in reverse order, 48 rows a step (the long prompt in chunks), next to
     * a generating sequence: identical bits */
    uint32_t rev[MAX_CASES] = {0};
    for (uint32_t i = 0; i < n; i++)
        rev[i] = n - 1 - i;
    run_worker(&fx, rev, n, 48, true, mixed);
    for (uint32_t i = 0; i < n; i++)
        assert_memory_equal(mixed + (size_t)i * d, alone + (size_t)(n - 1 - i) * d,
                            d * sizeof(float));
    free(alone);
    free(mixed);
    free(direct);
    fixture_close(&fx);
}

static void test_smollm2(void **state)
{
    (void)state;
    check_model("smollm2", NULL);
}

static void test_gemma3(void **state)
{
    (void)state;
    check_model("gemma3", TDM_TEST_GEMMA3_FILE);
}

/* Pooling arithmetic on a hand example: mean of (3, 0) and (0, 4) is (1.5, 2) -> (0.6, 0.8);
 * last is (0, 4) -> (0, 1); names parse both ways and refuse others. */
static void test_pooling(void **state)
{
    (void)state;
    const float r0[2] = {3.0f, 0.0f}, r1[2] = {0.0f, 4.0f};
    double acc[2] = {0, 0};
    float out[2];
    tdm_embedding_add(TDM_POOLING_MEAN, acc, r0, 2);
    tdm_embedding_add(TDM_POOLING_MEAN, acc, r1, 2);
    tdm_embedding_finish(TDM_POOLING_MEAN, acc, 2, 2, out);
    assert_float_equal(out[0], 0.6f, 1e-7);
    assert_float_equal(out[1], 0.8f, 1e-7);
    double last[2] = {0, 0};
    tdm_embedding_add(TDM_POOLING_LAST, last, r0, 2);
    tdm_embedding_add(TDM_POOLING_LAST, last, r1, 2);
    tdm_embedding_finish(TDM_POOLING_LAST, last, 2, 2, out);
    assert_float_equal(out[0], 0.0f, 0);
    assert_float_equal(out[1], 1.0f, 0);
    tdm_pooling_t p = TDM_POOLING_LAST;
    assert_int_equal(tdm_pooling_parse("mean", &p), TDM_OK);
    assert_int_equal(p, TDM_POOLING_MEAN);
    assert_int_equal(tdm_pooling_parse("cls", &p), TDM_EINVALID);
    assert_int_equal(p, TDM_POOLING_MEAN);
    assert_string_equal(tdm_pooling_name(TDM_POOLING_LAST), "last");
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_pooling),
        cmocka_unit_test(test_smollm2),
        cmocka_unit_test(test_gemma3),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
