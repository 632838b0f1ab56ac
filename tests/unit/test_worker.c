/* test_worker.c - continuous batching: outputs equal a sequence run alone whatever the mix,
 * chunking and preemption; prefill-to-decode hand-off; cancel and errors free every block. */
#include "engine_runner.h"
#include "tdm_test.h"

#include "tandem/worker.h"

#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Allocation accounting: tests/CMakeLists.txt links this test with -Wl,--wrap for the
 * allocator, so every allocation of the code linked into it (libtandem included) comes through
 * the functions below. While g_alloc_watch is set each one is counted, and with g_alloc_fail it
 * fails. The linker's names (__wrap_x, __real_x) break the house rule on "__" unavoidably. */
static atomic_int g_alloc_watch, g_alloc_fail, g_allocs;
void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);

static bool alloc_seen(void)
{
    if (!atomic_load(&g_alloc_watch))
        return false;
    atomic_fetch_add(&g_allocs, 1);
    return atomic_load(&g_alloc_fail) != 0;
}

void *__wrap_malloc(size_t n)
{
    return alloc_seen() ? NULL : __real_malloc(n);
}

void *__wrap_calloc(size_t k, size_t n)
{
    return alloc_seen() ? NULL : __real_calloc(k, n);
}

void *__wrap_realloc(void *p, size_t n)
{
    return alloc_seen() ? NULL : __real_realloc(p, n);
}

/* Starts counting allocations (failing each one when fail is set). */
static void alloc_watch(bool fail)
{
    atomic_store(&g_allocs, 0);
    atomic_store(&g_alloc_fail, fail);
    atomic_store(&g_alloc_watch, 1);
}

/* Stops counting; returns the allocations seen since alloc_watch. */
static int alloc_unwatch(void)
{
    atomic_store(&g_alloc_watch, 0);
    atomic_store(&g_alloc_fail, 0);
    return atomic_load(&g_allocs);
}

#define N_REQ 6
#define MAX_OUT 40

typedef tdm_test_tok_engine_t fixture_t; /* engine_runner.h */

/* Prefill rows per sequence per step in the rigs below (0: no limit). */
static uint32_t g_prefill_chunk;
static uint64_t g_plp_reserve; /* rig_open's opts.plp_reserve_bytes (0: the default) */
/* The grammar vocabulary of the rigs below (NULL: constrained sequences are refused). */
static const tdm_grammar_vocab_t *g_grammar_vocab;

/* A worker with its own pool and engine. */
typedef struct rig {
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *w;
} rig_t;

static void rig_open(fixture_t *fx, rig_t *r, tdm_worker_mode_t mode, uint32_t n_blocks,
                     uint32_t max_batch, uint32_t max_running)
{
    tdm_error_t err = {0};
    const tdm_llama_hparams_t *hp = tdm_model_hparams(fx->f.model);
    tdm_kv_layout_t l = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, TDM_KV_F16};
    r->pool = tdm_kv_pool_new(&l, n_blocks, &err);
    assert_non_null(r->pool);
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.n_ctx = 512;
    ep.max_batch_tokens = max_batch;
    ep.max_logits = max_running;
    ep.n_threads = 1;
    r->engine = tdm_engine_new(fx->f.model, r->pool, &ep, &err);
    assert_non_null(r->engine);
    tdm_worker_opts_t o = {.mode = mode,
                           .max_batch_tokens = max_batch,
                           .max_running = max_running,
                           .max_waiting = 64,
                           .n_ctx = 512,
                           .prefix_caching = true,
                           .max_prefill_chunk = g_prefill_chunk,
                           .grammar_vocab = g_grammar_vocab,
                           .plp_reserve_bytes = g_plp_reserve};
    r->w = tdm_worker_new(r->engine, r->pool, fx->tok, fx->f.n_vocab, &o, &err);
    if (!r->w)
        fail_msg("%s", err.msg);
}

static void rig_close(rig_t *r)
{
    tdm_worker_destroy(&r->w);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(r->pool, &st);
    assert_int_equal(st.n_used, 0);
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_pool_check(r->pool, &err), 0);
    tdm_engine_destroy(&r->engine);
    tdm_kv_pool_destroy(&r->pool);
}

typedef struct out {
    int32_t tokens[MAX_OUT];
    uint32_t n;
    bool finished;
    tdm_worker_finish_t why;
    uint32_t completion;
    uint32_t preemptions;
    int failed;
} out_t;

/* The worker's id of request k (a sequence id is never 0), and back. */
static uint64_t seq_of(int k)
{
    return (uint64_t)k + 1;
}

static int id_index(uint64_t seq_id)
{
    return (int)seq_id - 1;
}

/* Steps until idle, recording events into outs[] (request k has id seq_of(k)). */
static uint64_t drain(rig_t *r, out_t *outs)
{
    uint64_t steps = 0;
    while (tdm_worker_busy(r->w)) {
        const tdm_worker_event_t *ev;
        uint32_t n;
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_step(r->w, &ev, &n, &err), 0);
        steps++;
        assert_true(steps < 100000);
        for (uint32_t i = 0; i < n; i++) {
            out_t *o = &outs[id_index(ev[i].seq_id)];
            switch (ev[i].kind) {
            case TDM_WORKER_EVENT_TOKEN:
                assert_int_equal(ev[i].index, o->n);
                o->tokens[o->n++] = ev[i].sample.token;
                break;
            case TDM_WORKER_EVENT_FINISHED:
                o->finished = true;
                o->why = ev[i].finish;
                o->completion = ev[i].completion_tokens;
                o->preemptions = ev[i].preemptions;
                break;
            case TDM_WORKER_EVENT_FAILED: o->failed = ev[i].status; break;
            default: fail_msg("unexpected event kind %d", ev[i].kind);
            }
        }
    }
    return steps;
}

static void make_prompt(int32_t *p, uint32_t n, uint32_t n_vocab, uint64_t seed)
{
    tdm_test_random_tokens(p, n, n_vocab, seed);
}

static const uint32_t prompt_len[N_REQ] = {5, 40, 17, 100, 1, 64};
static const int32_t max_tokens[N_REQ] = {30, 12, 25, 8, 20, 33};

static void add_all(fixture_t *fx, rig_t *r, int32_t prompts[N_REQ][128], bool greedy)
{
    for (int k = 0; k < N_REQ; k++) {
        make_prompt(prompts[k], prompt_len[k], fx->f.n_vocab, 100 + (uint64_t)k);
        tdm_sampling_params_t sp;
        tdm_sampling_params_default(&sp);
        sp.temperature = greedy ? 0.0f : 0.9f;
        sp.seed = 1234 + (uint64_t)k;
        sp.max_tokens = max_tokens[k];
        sp.ignore_eos = true;
        uint64_t id = seq_of(k);
        tdm_worker_req_t req = {
            .seq_id = id, .prompt = prompts[k], .n_prompt = prompt_len[k], .sampling = &sp};
        tdm_error_t err = {0};
        if (tdm_worker_add(r->w, &req, &err) != 0)
            fail_msg("%s", err.msg);
    }
}

/* Reference: each request alone, whole prompt in one pass. */
static void reference(fixture_t *fx, out_t *ref, bool greedy)
{
    for (int k = 0; k < N_REQ; k++) {
        rig_t r;
        rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
        int32_t prompts[N_REQ][128];
        make_prompt(prompts[k], prompt_len[k], fx->f.n_vocab, 100 + (uint64_t)k);
        tdm_sampling_params_t sp;
        tdm_sampling_params_default(&sp);
        sp.temperature = greedy ? 0.0f : 0.9f;
        sp.seed = 1234 + (uint64_t)k;
        sp.max_tokens = max_tokens[k];
        sp.ignore_eos = true;
        uint64_t id = seq_of(k);
        tdm_worker_req_t req = {
            .seq_id = id, .prompt = prompts[k], .n_prompt = prompt_len[k], .sampling = &sp};
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
        drain(&r, ref);
        assert_true(ref[k].finished);
        assert_int_equal(ref[k].n, (uint32_t)max_tokens[k]);
        assert_int_equal(ref[k].why, TDM_WORKER_FINISH_LENGTH);
        rig_close(&r);
    }
}

static void check_equal(const out_t *a, const out_t *b)
{
    for (int k = 0; k < N_REQ; k++) {
        assert_true(b[k].finished);
        assert_int_equal(a[k].n, b[k].n);
        assert_memory_equal(a[k].tokens, b[k].tokens, a[k].n * sizeof(int32_t));
        assert_int_equal(a[k].completion, b[k].completion);
    }
}

/* Six requests batched together with 24-token chunks give each request's solo output. */
static void test_batched_equals_alone(void **state)
{
    fixture_t *fx = *state;
    for (int greedy = 1; greedy >= 0; greedy--) {
        out_t ref[N_REQ] = {0}, got[N_REQ] = {0};
        reference(fx, ref, greedy);
        rig_t r;
        rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 128, 24, 8);
        int32_t prompts[N_REQ][128];
        add_all(fx, &r, prompts, greedy);
        uint64_t steps = drain(&r, got);
        check_equal(ref, got);
        tdm_worker_stats_t st;
        tdm_worker_stats(r.w, &st);
        assert_int_equal(st.running, 0);
        assert_int_equal(st.waiting, 0);
        assert_true(st.steps == steps || st.steps + 1 == steps || st.steps <= steps);
        rig_close(&r);
    }
}

/* Decode nodes cap each sequence's prefill rows per step (max_prefill_chunk) so a long local
 * prefill does not stall the running batch: same tokens, and the running sequences keep
 * getting one token per step while a long prompt is prefilled. */
static void test_prefill_chunk_limit(void **state)
{
    fixture_t *fx = *state;
    out_t ref[N_REQ] = {0}, got[N_REQ] = {0};
    reference(fx, ref, true);
    g_prefill_chunk = 7;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 128, 64, 8);
    int32_t prompts[N_REQ][128];
    add_all(fx, &r, prompts, true);
    drain(&r, got);
    g_prefill_chunk = 0;
    check_equal(ref, got);
    tdm_worker_stats_t st;
    tdm_worker_stats(r.w, &st);
    /* the 100-token prompt alone needs ceil(99 / 7) chunked steps once others run */
    assert_true(st.steps >= 15);
    rig_close(&r);
}

/* The stats tell decode passes apart: a pass holding a prompt chunk leaves decode_step_s as
 * it was (0 before any decode pass), a pass of decode rows only sets it and its batch. */
static void test_decode_step_stats(void **state)
{
    fixture_t *fx = *state;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 128, 64, 8);
    int32_t prompt[10];
    make_prompt(prompt, 10, fx->f.n_vocab, 7);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 0.0f;
    sp.max_tokens = 3;
    sp.ignore_eos = true;
    tdm_worker_req_t req = {.seq_id = seq_of(0), .prompt = prompt, .n_prompt = 10, .sampling = &sp};
    tdm_error_t err = {0};
    assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    const tdm_worker_event_t *ev;
    uint32_t n;
    tdm_worker_stats_t st;
    assert_int_equal(tdm_worker_step(r.w, &ev, &n, &err), 0); /* the prompt */
    tdm_worker_stats(r.w, &st);
    assert_true(st.last_step_s > 0);
    assert_true(st.decode_step_s == 0.0);
    assert_int_equal(st.decode_batch_size, 0);
    assert_int_equal(tdm_worker_step(r.w, &ev, &n, &err), 0); /* one decode row */
    tdm_worker_stats(r.w, &st);
    assert_true(st.decode_step_s > 0);
    assert_true(st.decode_step_s == st.last_step_s);
    assert_int_equal(st.decode_batch_size, 1);
    while (tdm_worker_busy(r.w))
        assert_int_equal(tdm_worker_step(r.w, &ev, &n, &err), 0);
    rig_close(&r);
}

/* A pool too small for all six at once: sequences get preempted and recomputed, and the
 * tokens are still the same. */
static void test_preemption_keeps_outputs(void **state)
{
    fixture_t *fx = *state;
    out_t ref[N_REQ] = {0}, got[N_REQ] = {0};
    reference(fx, ref, false);
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 9, 128, 8);
    int32_t prompts[N_REQ][128];
    add_all(fx, &r, prompts, false);
    drain(&r, got);
    check_equal(ref, got);
    tdm_worker_stats_t st;
    tdm_worker_stats(r.w, &st);
    assert_true(st.preemptions > 0);
    uint32_t total = 0;
    for (int k = 0; k < N_REQ; k++)
        total += got[k].preemptions;
    assert_int_equal(total, st.preemptions);
    rig_close(&r);
}

/* PREFILL worker -> blocks copied to another pool -> DECODE worker continues: same tokens as
 * the single-worker run (the disaggregated path in one process). */
static void test_prefill_then_decode(void **state)
{
    fixture_t *fx = *state;
    out_t ref[N_REQ] = {0}, got[N_REQ] = {0};
    reference(fx, ref, false);
    rig_t p, d;
    rig_open(fx, &p, TDM_WORKER_MODE_PREFILL, 64, 64, 4);
    rig_open(fx, &d, TDM_WORKER_MODE_DECODE, 128, 64, 8);
    int32_t prompts[N_REQ][128];
    add_all(fx, &p, prompts, false);
    uint64_t block_bytes = tdm_kv_pool_block_bytes(p.pool);
    int prefilled = 0;
    while (tdm_worker_busy(p.w)) {
        const tdm_worker_event_t *ev;
        uint32_t n;
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_step(p.w, &ev, &n, &err), 0);
        for (uint32_t i = 0; i < n; i++) {
            int k = id_index(ev[i].seq_id);
            if (ev[i].kind == TDM_WORKER_EVENT_TOKEN) {
                assert_int_equal(ev[i].index, 0);
                got[k].tokens[got[k].n++] = ev[i].sample.token;
                continue;
            }
            assert_int_equal(ev[i].kind, TDM_WORKER_EVENT_PREFILLED);
            assert_int_equal(ev[i].n_tokens, prompt_len[k]);
            assert_int_equal(ev[i].first_token, got[k].tokens[0]);
            /* "ship" the blocks into the decode pool */
            tdm_kv_seq_t dst;
            tdm_kv_seq_init(&dst);
            assert_int_equal(tdm_kv_seq_reserve(d.pool, &dst, ev[i].n_tokens), 0);
            for (uint32_t b = 0; b < ev[i].seq.n_blocks; b++)
                memcpy((uint8_t *)tdm_kv_pool_base(d.pool) + dst.blocks[b] * block_bytes,
                       (uint8_t *)tdm_kv_pool_base(p.pool) + ev[i].seq.blocks[b] * block_bytes,
                       block_bytes);
            dst.n_tokens = ev[i].n_tokens;
            tdm_kv_seq_t src = ev[i].seq;
            tdm_kv_seq_release(p.pool, &src);
            tdm_sampling_params_t sp;
            tdm_sampling_params_default(&sp);
            sp.temperature = 0.9f;
            sp.seed = 1234 + (uint64_t)k;
            sp.max_tokens = max_tokens[k];
            sp.ignore_eos = true;
            tdm_worker_req_t req = {.seq_id = ev[i].seq_id,
                                    .prompt = prompts[k],
                                    .n_prompt = prompt_len[k],
                                    .sampling = &sp,
                                    .prefilled = &dst,
                                    .first_token = ev[i].first_token};
            assert_int_equal(tdm_worker_add(d.w, &req, &err), 0);
            assert_int_equal(dst.n_blocks, 0); /* taken over */
            prefilled++;
        }
    }
    assert_int_equal(prefilled, N_REQ);
    drain(&d, got);
    check_equal(ref, got);
    rig_close(&p);
    rig_close(&d);
}

/* max_tokens 1 on a prefilled sequence finishes without a forward pass; a first token that is
 * a stop token finishes with STOP. */
static void test_prefilled_finishes_at_once(void **state)
{
    fixture_t *fx = *state;
    rig_t d;
    rig_open(fx, &d, TDM_WORKER_MODE_DECODE, 32, 64, 4);
    int32_t prompt[20];
    make_prompt(prompt, 20, fx->f.n_vocab, 9);
    out_t outs[2] = {0};
    for (int k = 0; k < 2; k++) {
        tdm_kv_seq_t seq;
        tdm_kv_seq_init(&seq);
        assert_int_equal(tdm_kv_seq_reserve(d.pool, &seq, 20), 0);
        seq.n_tokens = 20;
        tdm_sampling_params_t sp;
        tdm_sampling_params_default(&sp);
        sp.max_tokens = k == 0 ? 1 : 10;
        sp.stop_token_ids[0] = 42;
        sp.n_stop_token_ids = 1;
        uint64_t id = seq_of(k);
        tdm_worker_req_t req = {.seq_id = id,
                                .prompt = prompt,
                                .n_prompt = 20,
                                .sampling = &sp,
                                .prefilled = &seq,
                                .first_token = k == 0 ? 7 : 42};
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_add(d.w, &req, &err), 0);
    }
    uint64_t steps = drain(&d, outs);
    assert_int_equal(steps, 1);
    tdm_worker_stats_t st;
    tdm_worker_stats(d.w, &st);
    assert_int_equal(st.steps, 0);
    assert_true(outs[0].finished && outs[1].finished);
    assert_int_equal(outs[0].why, TDM_WORKER_FINISH_LENGTH);
    assert_int_equal(outs[1].why, TDM_WORKER_FINISH_STOP);
    assert_int_equal(outs[0].completion, 1);
    rig_close(&d);
}

/* Cancel in the middle frees the blocks; bad requests are refused with the field named. */
static void test_cancel_and_errors(void **state)
{
    fixture_t *fx = *state;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 32, 4);
    int32_t prompts[N_REQ][128];
    add_all(fx, &r, prompts, true);
    const tdm_worker_event_t *ev;
    uint32_t n;
    tdm_error_t err = {0};
    for (int i = 0; i < 5; i++)
        assert_int_equal(tdm_worker_step(r.w, &ev, &n, &err), 0);
    assert_int_equal(tdm_worker_cancel(r.w, seq_of(1)), 0);
    assert_int_equal(tdm_worker_cancel(r.w, seq_of(1)), TDM_ENOTFOUND);
    assert_false(tdm_worker_has(r.w, seq_of(1)));
    assert_true(tdm_worker_has(r.w, seq_of(0)));

    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    tdm_worker_req_t dup = {
        .seq_id = seq_of(0), .prompt = prompts[0], .n_prompt = 5, .sampling = &sp};
    assert_int_equal(tdm_worker_add(r.w, &dup, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "already"));
    tdm_worker_req_t zero = {.seq_id = 0, .prompt = prompts[0], .n_prompt = 5, .sampling = &sp};
    assert_int_equal(tdm_worker_add(r.w, &zero, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "seq_id"));
    tdm_worker_req_t empty = {.seq_id = 'x', .prompt = prompts[0], .sampling = &sp};
    assert_int_equal(tdm_worker_add(r.w, &empty, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "prompt"));
    static int32_t big[600];
    tdm_worker_req_t toolong = {.seq_id = 'y', .prompt = big, .n_prompt = 600, .sampling = &sp};
    assert_int_equal(tdm_worker_add(r.w, &toolong, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "context"));
    int32_t bad = (int32_t)fx->f.n_vocab;
    tdm_worker_req_t oov = {.seq_id = 'z', .prompt = &bad, .n_prompt = 1, .sampling = &sp};
    assert_int_equal(tdm_worker_add(r.w, &oov, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "vocabulary"));
    for (int k = 0; k < N_REQ; k++)
        tdm_worker_cancel(r.w, seq_of(k));
    assert_false(tdm_worker_busy(r.w));
    rig_close(&r);
}

/* Steps allocate nothing, also while the pool is short and sequences are preempted and
 * recomputed: counted, and then with every allocation failing the outputs are still those of
 * each request alone (out of memory would fail a sequence; preemption must not). */
static void test_step_allocates_nothing(void **state)
{
    fixture_t *fx = *state;
    out_t ref[N_REQ] = {0};
    reference(fx, ref, false);
    for (int fail = 0; fail <= 1; fail++) {
        out_t got[N_REQ] = {0};
        rig_t r;
        rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 9, 128, 8);
        int32_t prompts[N_REQ][128];
        add_all(fx, &r, prompts, false);
        alloc_watch(fail);
        drain(&r, got);
        int allocs = alloc_unwatch();
        assert_int_equal(allocs, 0);
        check_equal(ref, got);
        for (int k = 0; k < N_REQ; k++)
            assert_int_equal(got[k].failed, 0);
        tdm_worker_stats_t st;
        tdm_worker_stats(r.w, &st);
        assert_true(st.preemptions > 0);
        rig_close(&r);
    }
}

/* PREFILL mode too: admission, chunked prefill and the hand-over of the block table. */
static void test_prefill_step_allocates_nothing(void **state)
{
    fixture_t *fx = *state;
    rig_t p;
    rig_open(fx, &p, TDM_WORKER_MODE_PREFILL, 64, 32, 4);
    int32_t prompts[N_REQ][128];
    add_all(fx, &p, prompts, false);
    int handed = 0;
    while (tdm_worker_busy(p.w)) {
        const tdm_worker_event_t *ev;
        uint32_t n;
        tdm_error_t err = {0};
        alloc_watch(false);
        int rc = tdm_worker_step(p.w, &ev, &n, &err);
        assert_int_equal(alloc_unwatch(), 0);
        assert_int_equal(rc, 0);
        for (uint32_t i = 0; i < n; i++)
            if (ev[i].kind == TDM_WORKER_EVENT_PREFILLED) {
                /* the table was sized at admission for prompt + max_new tokens */
                assert_true(ev[i].seq.cap >= ev[i].seq.n_blocks);
                tdm_kv_seq_t seq = ev[i].seq;
                tdm_kv_seq_release(p.pool, &seq);
                handed++;
            }
    }
    assert_int_equal(handed, N_REQ);
    rig_close(&p);
}

/* Embedding sequences (worker.h tdm_worker_req_t.embed) in a tight pool next to generating
 * ones, in chunks of a small budget with preemptions: each EMBEDDING event comes once, unit
 * norm, bitwise the vector of the same prompt computed alone, the generating sequences' outputs
 * are unchanged, no step allocates, and every block is back at the end. */
#define N_EMB 3
static void test_embed_in_batch_under_preemption(void **state)
{
    fixture_t *fx = *state;
    static const uint32_t emb_len[N_EMB] = {70, 3, 33};
    static const tdm_pooling_t emb_pool[N_EMB] = {TDM_POOLING_MEAN, TDM_POOLING_LAST,
                                                  TDM_POOLING_MEAN};
    int32_t emb_prompt[N_EMB][70];
    uint32_t n_embd = 0; /* the engine's, set below */
    float alone[N_EMB][256], mixed[N_EMB][256];
    for (int k = 0; k < N_EMB; k++)
        make_prompt(emb_prompt[k], emb_len[k], fx->f.n_vocab, 900 + (uint64_t)k);
    /* alone, each in a roomy pool */
    for (int k = 0; k < N_EMB; k++) {
        rig_t a;
        rig_open(fx, &a, TDM_WORKER_MODE_DECODE, 64, 128, 8);
        n_embd = tdm_engine_n_embd(a.engine);
        assert_true(n_embd <= 256);
        tdm_worker_req_t req = {.seq_id = 500,
                                .prompt = emb_prompt[k],
                                .n_prompt = emb_len[k],
                                .embed = true,
                                .pooling = emb_pool[k]};
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_add(a.w, &req, &err), 0);
        int got = 0;
        while (tdm_worker_busy(a.w)) {
            const tdm_worker_event_t *ev;
            uint32_t n;
            assert_int_equal(tdm_worker_step(a.w, &ev, &n, &err), 0);
            for (uint32_t i = 0; i < n; i++) {
                assert_int_equal(ev[i].kind, TDM_WORKER_EVENT_EMBEDDING);
                assert_int_equal(ev[i].n_tokens, emb_len[k]);
                memcpy(alone[k], ev[i].embedding, n_embd * sizeof(float));
                got++;
            }
        }
        assert_int_equal(got, 1);
        double norm = 0;
        for (uint32_t d = 0; d < n_embd; d++)
            norm += (double)alone[k][d] * alone[k][d];
        assert_true(fabs(norm - 1.0) < 1e-5);
        rig_close(&a);
    }
    { /* an embedding takes no KV handed over, in a plain or a grouped form */
        rig_t a;
        rig_open(fx, &a, TDM_WORKER_MODE_DECODE, 64, 128, 8);
        tdm_kv_hseq_t hs;
        memset(&hs, 0, sizeof hs);
        tdm_worker_req_t req = {.seq_id = 501,
                                .prompt = emb_prompt[0],
                                .n_prompt = emb_len[0],
                                .embed = true,
                                .prefilled_groups = &hs};
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_add(a.w, &req, &err), TDM_EINVALID);
        assert_non_null(strstr(err.msg, "no prefilled KV"));
        assert_false(tdm_worker_busy(a.w));
        rig_close(&a);
    }
    out_t ref[N_REQ] = {0};
    reference(fx, ref, false);
    /* together with the generating sequences: 9 blocks, 8 rows a step */
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 9, 8, 8);
    int32_t prompts[N_REQ][128];
    add_all(fx, &r, prompts, false);
    for (int k = 0; k < N_EMB; k++) {
        tdm_worker_req_t req = {.seq_id = 500 + (uint64_t)k,
                                .prompt = emb_prompt[k],
                                .n_prompt = emb_len[k],
                                .embed = true,
                                .pooling = emb_pool[k]};
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    }
    out_t got[N_REQ] = {0};
    int n_emb = 0;
    uint32_t emb_preempted = 0;
    for (int steps = 0; tdm_worker_busy(r.w); steps++) {
        assert_true(steps < 100000);
        const tdm_worker_event_t *ev;
        uint32_t n;
        tdm_error_t err = {0};
        alloc_watch(false);
        int rc = tdm_worker_step(r.w, &ev, &n, &err);
        assert_int_equal(alloc_unwatch(), 0);
        assert_int_equal(rc, 0);
        for (uint32_t i = 0; i < n; i++) {
            if (ev[i].kind == TDM_WORKER_EVENT_EMBEDDING) {
                int k = (int)(ev[i].seq_id - 500);
                assert_true(k >= 0 && k < N_EMB);
                memcpy(mixed[k], ev[i].embedding, n_embd * sizeof(float));
                emb_preempted += ev[i].preemptions;
                n_emb++;
                continue;
            }
            out_t *o = &got[id_index(ev[i].seq_id)];
            if (ev[i].kind == TDM_WORKER_EVENT_TOKEN)
                o->tokens[o->n++] = ev[i].sample.token;
            else if (ev[i].kind == TDM_WORKER_EVENT_FINISHED)
                o->finished = true;
            else
                fail_msg("seq %llu failed: %s", (unsigned long long)ev[i].seq_id, ev[i].message);
        }
    }
    assert_int_equal(n_emb, N_EMB);
    print_message("embedding sequences preempted %u times\n", emb_preempted);
    assert_true(emb_preempted > 0); /* recomputed and pooled again from scratch */
    for (int k = 0; k < N_EMB; k++)
        assert_memory_equal(mixed[k], alone[k], n_embd * sizeof(float));
    for (int k = 0; k < N_REQ; k++) {
        assert_true(got[k].finished);
        assert_int_equal(got[k].n, ref[k].n);
        assert_memory_equal(got[k].tokens, ref[k].tokens, ref[k].n * sizeof(int32_t));
    }
    tdm_worker_stats_t st;
    tdm_worker_stats(r.w, &st);
    assert_true(st.preemptions > 0);
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(r.pool, &ks);
    assert_int_equal(ks.n_used, 0);
    rig_close(&r);
}

/* Out of memory is an error of tdm_worker_add, named as memory, with nothing left behind;
 * an empty pool is not, and a pool that could never hold the sequence even alone is
 * refused by tdm_worker_add too, naming the tokens and the blocks, before it takes any. */
static void test_oom_is_not_pool_exhaustion(void **state)
{
    fixture_t *fx = *state;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 2, 128, 4);
    int32_t prompt[100];
    make_prompt(prompt, 100, fx->f.n_vocab, 5);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.max_tokens = 4;
    tdm_worker_req_t req = {.seq_id = 'a', .prompt = prompt, .n_prompt = 100, .sampling = &sp};
    tdm_error_t err = {0};
    alloc_watch(true);
    int rc = tdm_worker_add(r.w, &req, &err);
    assert_true(alloc_unwatch() > 0);
    assert_int_equal(rc, TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "out of memory"));
    assert_false(tdm_worker_has(r.w, 'a'));
    assert_false(tdm_worker_busy(r.w));

    /* a prefilled table that cannot be sized stays with the caller, blocks and all */
    tdm_kv_seq_t seq;
    tdm_kv_seq_init(&seq);
    assert_int_equal(tdm_kv_seq_reserve(r.pool, &seq, 20), 0);
    seq.n_tokens = 20;
    tdm_worker_req_t pre = {.seq_id = 'p',
                            .prompt = prompt,
                            .n_prompt = 20,
                            .sampling = &sp,
                            .prefilled = &seq,
                            .first_token = 3};
    sp.max_tokens = 400; /* a table of 420 tokens: more than the 8 entries it has */
    alloc_watch(true);
    rc = tdm_worker_add(r.w, &pre, &err);
    alloc_unwatch();
    assert_int_equal(rc, TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "out of memory"));
    assert_int_equal(seq.n_blocks, 2);
    tdm_kv_seq_release(r.pool, &seq);

    /* the pool (2 blocks, 32 tokens) can never hold 100 tokens: refused at once */
    sp.max_tokens = 4;
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_ERESOURCE);
    assert_string_equal(err.msg, "KV pool too small for the sequence: the prompt (100 tokens) and "
                                 "up to 4 output tokens need the KV of 103 tokens, 7 blocks of 16 "
                                 "tokens at their peak; the pool has 2 blocks");
    assert_false(tdm_worker_has(r.w, 'a'));
    /* the last token sampled is never computed: 20 + 13 tokens need 32 tokens' KV, 2 blocks */
    req.n_prompt = 20;
    sp.max_tokens = 14;
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "the KV of 33 tokens, 3 blocks"));
    sp.max_tokens = 13;
    sp.ignore_eos = true;
    assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    out_t outs['a'] = {0};
    drain(&r, outs);
    assert_true(outs[id_index('a')].finished);
    assert_int_equal(outs[id_index('a')].n, 13);
    assert_false(tdm_worker_busy(r.w));
    rig_close(&r);
}

/* Two long prompts chunked side by side in a pool that holds either alone but not both: each
 * takes blocks for its chunks until neither can get its next one, and nothing runs that could
 * free any. The worker goes on with the oldest alone (the other preempted, recomputed later)
 * instead of waiting forever, and both outputs are those of a run alone. */
static void test_prefill_stall_preempts(void **state)
{
    fixture_t *fx = *state;
    enum { N = 2, LEN = 100, OUT = 8 };
    int32_t prompts[N][LEN];
    out_t ref[N] = {0}, got[N] = {0};
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 0.0f;
    sp.max_tokens = OUT;
    sp.ignore_eos = true;
    tdm_error_t err = {0};
    for (int k = 0; k < N; k++) {
        make_prompt(prompts[k], LEN, fx->f.n_vocab, 900 + (uint64_t)k);
        rig_t r;
        rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
        tdm_worker_req_t req = {
            .seq_id = seq_of(k), .prompt = prompts[k], .n_prompt = LEN, .sampling = &sp};
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
        drain(&r, ref);
        rig_close(&r);
    }
    /* 9 blocks of 16: each needs 7 (107 tokens' KV); chunks of 16 rows, 32 per step: at 96
     * and 64 tokens (6 + 4 blocks) neither gets its next chunk */
    g_prefill_chunk = 16;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 9, 32, 4);
    for (int k = 0; k < N; k++) {
        tdm_worker_req_t req = {
            .seq_id = seq_of(k), .prompt = prompts[k], .n_prompt = LEN, .sampling = &sp};
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    }
    drain(&r, got);
    g_prefill_chunk = 0;
    for (int k = 0; k < N; k++) {
        assert_true(got[k].finished);
        assert_int_equal(got[k].failed, 0);
        assert_int_equal(got[k].n, OUT);
        assert_memory_equal(got[k].tokens, ref[k].tokens, OUT * sizeof(int32_t));
    }
    assert_int_equal(got[0].preemptions, 0); /* the oldest went on */
    assert_true(got[1].preemptions >= 1);
    rig_close(&r);
}

/* Every event carries the sequence's tdm_worker_req_t.user. */
static void test_events_carry_user(void **state)
{
    fixture_t *fx = *state;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 64, 4);
    int32_t prompt[3][10];
    int tags[3];
    for (int k = 0; k < 3; k++) {
        make_prompt(prompt[k], 10, fx->f.n_vocab, 50 + (uint64_t)k);
        tdm_sampling_params_t sp;
        tdm_sampling_params_default(&sp);
        sp.max_tokens = 3 + k;
        sp.ignore_eos = true;
        uint64_t id = seq_of(k);
        tags[k] = k;
        tdm_worker_req_t req = {
            .seq_id = id, .prompt = prompt[k], .n_prompt = 10, .sampling = &sp, .user = &tags[k]};
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    }
    int seen[3] = {0};
    while (tdm_worker_busy(r.w)) {
        const tdm_worker_event_t *ev;
        uint32_t n;
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_step(r.w, &ev, &n, &err), 0);
        for (uint32_t i = 0; i < n; i++) {
            int k = id_index(ev[i].seq_id);
            assert_ptr_equal(ev[i].user, &tags[k]);
            seen[k]++;
        }
    }
    for (int k = 0; k < 3; k++)
        assert_int_equal(seen[k], 3 + k + 1); /* tokens + FINISHED */
    rig_close(&r);
}

/* ---- resuming a request after output delivered (migration) ---- */

/* The sampling of the resume tests: greedy, or seeded with every penalty on over a window
 * short enough that it slides over the resumed output, and the request masks on at every step
 * (allowed_token_ids: the byte tokens below 200; bad_words: token 7, and t + 1 right after t),
 * which read the output so far: the resumed tokens must count as output. */
static void resume_params(tdm_sampling_params_t *sp, bool greedy, int32_t max)
{
    tdm_sampling_params_default(sp);
    sp->temperature = greedy ? 0.0f : 0.9f;
    sp->seed = 4321;
    sp->max_tokens = max;
    sp->ignore_eos = true;
    sp->repetition_penalty = 1.3f;
    sp->frequency_penalty = 0.4f;
    sp->presence_penalty = 0.2f;
    sp->penalty_last_n = 8;
    for (int32_t t = 0; t < 200; t++)
        sp->allowed[t] = t;
    sp->n_allowed = 200;
    tdm_error_t err = {0};
    int32_t seven = 7;
    assert_int_equal(tdm_sampling_bad_seq_add(sp, &seven, 1, &err), 0);
    for (int32_t t = 0; t < 199; t++) {
        int32_t seq[2] = {t, t + 1};
        assert_int_equal(tdm_sampling_bad_seq_add(sp, seq, 2, &err), 0);
    }
}

/* The sequence seq_of(0) (prompt[n_prompt], resume_params) run alone from the start into *ref. */
static void resume_reference(fixture_t *fx, const int32_t *prompt, uint32_t n_prompt, bool greedy,
                             int32_t max, out_t *ref)
{
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
    tdm_sampling_params_t sp;
    resume_params(&sp, greedy, max);
    tdm_worker_req_t req = {
        .seq_id = seq_of(0), .prompt = prompt, .n_prompt = n_prompt, .sampling = &sp};
    tdm_error_t err = {0};
    assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    drain(&r, ref);
    assert_int_equal(ref->n, (uint32_t)max);
    for (uint32_t i = 0; i < ref->n; i++) { /* the masks held */
        assert_true(ref->tokens[i] >= 0 && ref->tokens[i] < 200 && ref->tokens[i] != 7);
        assert_true(i == 0 || ref->tokens[i] != ref->tokens[i - 1] + 1);
    }
    rig_close(&r);
}

/* Local prefill of prompt + ref's first cut tokens in a DECODE worker: the rest into *got
 * (which starts with those cut tokens, so drain checks the indices from cut on). */
static void resume_local(fixture_t *fx, const int32_t *prompt, uint32_t n_prompt, bool greedy,
                         int32_t max, const out_t *ref, uint32_t cut, out_t *got)
{
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 24, 4);
    tdm_sampling_params_t sp;
    resume_params(&sp, greedy, max);
    memcpy(got->tokens, ref->tokens, cut * sizeof *ref->tokens);
    got->n = cut;
    tdm_worker_req_t req = {.seq_id = seq_of(0),
                            .prompt = prompt,
                            .n_prompt = n_prompt,
                            .sampling = &sp,
                            .output = ref->tokens,
                            .n_output = cut};
    tdm_error_t err = {0};
    assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    drain(&r, got);
    rig_close(&r);
}

/* The disaggregated resume: a PREFILL worker prefills prompt + cut tokens and samples index
 * cut; its KV is copied to a DECODE worker, which goes on from index cut + 1. */
static void resume_remote(fixture_t *fx, const int32_t *prompt, uint32_t n_prompt, bool greedy,
                          int32_t max, const out_t *ref, uint32_t cut, out_t *got)
{
    rig_t p, d;
    rig_open(fx, &p, TDM_WORKER_MODE_PREFILL, 64, 64, 4);
    rig_open(fx, &d, TDM_WORKER_MODE_DECODE, 64, 64, 4);
    tdm_sampling_params_t sp;
    resume_params(&sp, greedy, max);
    memcpy(got->tokens, ref->tokens, cut * sizeof *ref->tokens);
    got->n = cut;
    tdm_worker_req_t req = {.seq_id = seq_of(0),
                            .prompt = prompt,
                            .n_prompt = n_prompt,
                            .sampling = &sp,
                            .output = ref->tokens,
                            .n_output = cut};
    tdm_error_t err = {0};
    assert_int_equal(tdm_worker_add(p.w, &req, &err), 0);
    const tdm_worker_event_t *ev = NULL;
    uint32_t n = 0;
    while (n == 0 || ev[n - 1].kind != TDM_WORKER_EVENT_PREFILLED)
        assert_int_equal(tdm_worker_step(p.w, &ev, &n, &err), 0);
    assert_int_equal(n, 2);
    assert_int_equal(ev[0].kind, TDM_WORKER_EVENT_TOKEN);
    assert_int_equal(ev[0].index, cut);
    got->tokens[got->n++] = ev[0].sample.token;
    assert_int_equal(ev[1].n_tokens, n_prompt + cut); /* the KV of prompt + resumed output */
    assert_int_equal(ev[1].first_token, ev[0].sample.token);
    uint64_t bb = tdm_kv_pool_block_bytes(p.pool);
    tdm_kv_seq_t dst;
    tdm_kv_seq_init(&dst);
    assert_int_equal(tdm_kv_seq_reserve(d.pool, &dst, ev[1].n_tokens), 0);
    for (uint32_t b = 0; b < ev[1].seq.n_blocks; b++)
        memcpy((uint8_t *)tdm_kv_pool_base(d.pool) + dst.blocks[b] * bb,
               (uint8_t *)tdm_kv_pool_base(p.pool) + ev[1].seq.blocks[b] * bb, bb);
    dst.n_tokens = ev[1].n_tokens;
    tdm_kv_seq_t src = ev[1].seq;
    int32_t first = ev[1].first_token;
    tdm_kv_seq_release(p.pool, &src);
    tdm_worker_req_t dr = {.seq_id = seq_of(0),
                           .prompt = prompt,
                           .n_prompt = n_prompt,
                           .sampling = &sp,
                           .prefilled = &dst,
                           .first_token = first,
                           .output = ref->tokens,
                           .n_output = cut};
    assert_int_equal(tdm_worker_add(d.w, &dr, &err), 0);
    drain(&d, got);
    rig_close(&p);
    rig_close(&d);
}

/* A request resumed after `cut` output tokens (prompt + those tokens prefilled as context, the
 * next token sampled at output index cut) continues exactly as the undisturbed run, greedy and
 * seeded with penalties, prefilled locally or by a prefill node; max_tokens counts the resumed
 * tokens (completion_tokens is the whole output). */
static void test_resume_equals_undisturbed(void **state)
{
    fixture_t *fx = *state;
    int32_t prompt[37];
    make_prompt(prompt, 37, fx->f.n_vocab, 77);
    const int32_t max = 30;
    const uint32_t cuts[3] = {1, 13, 29};
    for (int greedy = 1; greedy >= 0; greedy--) {
        out_t ref = {0};
        resume_reference(fx, prompt, 37, greedy, max, &ref);
        for (int c = 0; c < 3; c++)
            for (int remote = 0; remote < 2; remote++) {
                out_t got = {0};
                if (remote)
                    resume_remote(fx, prompt, 37, greedy, max, &ref, cuts[c], &got);
                else
                    resume_local(fx, prompt, 37, greedy, max, &ref, cuts[c], &got);
                assert_true(got.finished);
                assert_int_equal(got.why, TDM_WORKER_FINISH_LENGTH);
                assert_int_equal(got.completion, (uint32_t)max);
                assert_int_equal(got.n, ref.n);
                assert_memory_equal(got.tokens, ref.tokens, ref.n * sizeof *ref.tokens);
            }
    }
}

/* A resumed request's output is checked like its prompt: as many tokens as max_tokens (nothing
 * left to generate), more than the context holds after the prompt, a token outside the
 * vocabulary, or a prefilled table without their KV are refused, naming the field. */
static void test_resume_errors(void **state)
{
    fixture_t *fx = *state;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 64, 4);
    int32_t prompt[8];
    make_prompt(prompt, 8, fx->f.n_vocab, 5);
    static int32_t out[600];
    tdm_sampling_params_t sp;
    resume_params(&sp, true, 4);
    tdm_error_t err = {0};
    tdm_worker_req_t full = {.seq_id = 'a',
                             .prompt = prompt,
                             .n_prompt = 8,
                             .sampling = &sp,
                             .output = out,
                             .n_output = 4};
    assert_int_equal(tdm_worker_add(r.w, &full, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "max_tokens is 4"));
    sp.max_tokens = 600;
    tdm_worker_req_t big = {.seq_id = 'b',
                            .prompt = prompt,
                            .n_prompt = 8,
                            .sampling = &sp,
                            .output = out,
                            .n_output = 504};
    assert_int_equal(tdm_worker_add(r.w, &big, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "context of 512"));
    out[2] = (int32_t)fx->f.n_vocab;
    tdm_worker_req_t oov = {.seq_id = 'c',
                            .prompt = prompt,
                            .n_prompt = 8,
                            .sampling = &sp,
                            .output = out,
                            .n_output = 3};
    assert_int_equal(tdm_worker_add(r.w, &oov, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "output[2]"));
    out[2] = 0;
    tdm_kv_seq_t seq;
    tdm_kv_seq_init(&seq);
    assert_int_equal(tdm_kv_seq_reserve(r.pool, &seq, 8), 0);
    seq.n_tokens = 8; /* the prompt's KV only */
    tdm_worker_req_t pre = {.seq_id = 'd',
                            .prompt = prompt,
                            .n_prompt = 8,
                            .sampling = &sp,
                            .prefilled = &seq,
                            .first_token = 1,
                            .output = out,
                            .n_output = 3};
    assert_int_equal(tdm_worker_add(r.w, &pre, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "prefilled KV covers 8 tokens"));
    tdm_kv_seq_release(r.pool, &seq);
    assert_false(tdm_worker_busy(r.w));
    rig_close(&r);
}

/* ---- structured output ---- */

/* Braces around 5..30 of "a", "b", "c", " ": the tiny model's random weights wander inside,
 * and the closing brace ends it (the matcher is done). */
static const char tiny_gbnf[] = "root ::= \"{\" [a-c ]{5,30} \"}\"\n";

/* The text of out's tokens. */
static void out_text(const fixture_t *fx, const out_t *o, char *text, size_t cap)
{
    size_t len = 0;
    for (uint32_t i = 0; i < o->n; i++) {
        int n = tdm_tokenizer_token_bytes(fx->tok, o->tokens[i], false, text + len, cap - len);
        assert_true(n >= 0 && (size_t)n < cap - len);
        len += (size_t)n;
    }
    text[len] = '\0';
}

/* True when text is in tiny_gbnf's language (complete) or a prefix of a string in it. */
static bool tiny_match(const char *text, bool complete)
{
    size_t n = strlen(text);
    if (n == 0)
        return !complete;
    if (text[0] != '{')
        return false;
    size_t body = 1;
    while (body < n && strchr("abc ", text[body]))
        body++;
    if (body - 1 > 30)
        return false;
    if (body == n)
        return !complete;
    return body - 1 >= 5 && text[body] == '}' && body + 1 == n;
}

/* Adds constrained sequence r<k> (prompt from seed k) to r: greedy or sampled with seed. */
static void add_constrained(fixture_t *fx, rig_t *r, int k, int32_t *prompt, const tdm_grammar_t *g,
                            bool greedy, int32_t max_new)
{
    make_prompt(prompt, 12, fx->f.n_vocab, 500 + (uint64_t)k);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = greedy ? 0.0f : 1.0f;
    sp.seed = 77 + (uint64_t)k;
    sp.max_tokens = max_new;
    uint64_t id = seq_of(k);
    tdm_worker_req_t req = {
        .seq_id = id, .prompt = prompt, .n_prompt = 12, .sampling = &sp, .grammar = g};
    tdm_error_t err = {0};
    if (tdm_worker_add(r->w, &req, &err) != 0)
        fail_msg("%s", err.msg);
}

/* Constrained sequences (greedy and sampled) batched with six unconstrained ones in a pool
 * small enough to preempt: the unconstrained outputs equal their solo runs bit for bit, the
 * constrained ones equal theirs, match the grammar and end with STOP; one cut at 4 tokens
 * ends with LENGTH and is a prefix of the language. */
static void test_constrained_in_batch(void **state)
{
    fixture_t *fx = *state;
    tdm_error_t err = {0};
    tdm_grammar_vocab_t *gv = tdm_grammar_vocab_new(fx->tok, &err);
    assert_non_null(gv);
    tdm_grammar_t *g = tdm_grammar_parse(tiny_gbnf, strlen(tiny_gbnf), NULL, &err);
    if (!g)
        fail_msg("%s", err.msg);
    g_grammar_vocab = gv;
    out_t ref[N_REQ + 3] = {0}, got[N_REQ + 3] = {0};
    reference(fx, ref, true);
    int32_t cprompt[3][12];
    for (int k = N_REQ; k < N_REQ + 3; k++) { /* alone */
        rig_t r;
        rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
        add_constrained(fx, &r, k, cprompt[k - N_REQ], g, k == N_REQ, k == N_REQ + 2 ? 4 : 36);
        drain(&r, ref);
        rig_close(&r);
    }
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 9, 128, 8);
    int32_t prompts[N_REQ][128];
    add_all(fx, &r, prompts, true);
    for (int k = N_REQ; k < N_REQ + 3; k++)
        add_constrained(fx, &r, k, cprompt[k - N_REQ], g, k == N_REQ, k == N_REQ + 2 ? 4 : 36);
    drain(&r, got);
    check_equal(ref, got);
    tdm_worker_stats_t st;
    tdm_worker_stats(r.w, &st);
    assert_true(st.preemptions > 0);
    for (int k = N_REQ; k < N_REQ + 3; k++) {
        char text[256];
        out_text(fx, &got[k], text, sizeof text);
        assert_true(got[k].finished);
        assert_int_equal(got[k].n, ref[k].n);
        assert_memory_equal(got[k].tokens, ref[k].tokens, got[k].n * sizeof(int32_t));
        bool cut = k == N_REQ + 2;
        assert_int_equal(got[k].why, cut ? TDM_WORKER_FINISH_LENGTH : TDM_WORKER_FINISH_STOP);
        if (!tiny_match(text, !cut))
            fail_msg("r%d: '%s' is not %s of the grammar", k, text, cut ? "a prefix" : "a string");
    }
    rig_close(&r);
    g_grammar_vocab = NULL;
    tdm_grammar_destroy(&g);
    tdm_grammar_vocab_destroy(&gv);
}

/* A constrained request resumed after `cut` output tokens (migration: prompt + cut prefilled
 * as context) replays them into its matcher and goes on exactly as the undisturbed run; an
 * output the grammar does not allow is refused at add. */
static void test_constrained_resume(void **state)
{
    fixture_t *fx = *state;
    tdm_error_t err = {0};
    tdm_grammar_vocab_t *gv = tdm_grammar_vocab_new(fx->tok, &err);
    tdm_grammar_t *g = tdm_grammar_parse(tiny_gbnf, strlen(tiny_gbnf), NULL, &err);
    assert_true(gv && g);
    g_grammar_vocab = gv;
    out_t ref[N_REQ + 2] = {0};
    int32_t prompt[12];
    rig_t a;
    rig_open(fx, &a, TDM_WORKER_MODE_DECODE, 64, 256, 1);
    add_constrained(fx, &a, N_REQ + 1, prompt, g, false, 36);
    drain(&a, ref);
    rig_close(&a);
    const out_t *want = &ref[N_REQ + 1];
    assert_true(want->n > 4);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 1.0f;
    sp.seed = 77 + N_REQ + 1;
    sp.max_tokens = 36;
    uint64_t id = seq_of(N_REQ + 1);
    for (uint32_t cut = 1; cut < want->n; cut += 3) {
        out_t got[N_REQ + 2] = {0};
        memcpy(got[N_REQ + 1].tokens, want->tokens, cut * sizeof *want->tokens);
        got[N_REQ + 1].n = cut;
        rig_t r;
        rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
        tdm_worker_req_t req = {.seq_id = id,
                                .prompt = prompt,
                                .n_prompt = 12,
                                .sampling = &sp,
                                .output = want->tokens,
                                .n_output = cut,
                                .grammar = g};
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
        drain(&r, got);
        rig_close(&r);
        assert_int_equal(got[N_REQ + 1].n, want->n);
        assert_memory_equal(got[N_REQ + 1].tokens, want->tokens, want->n * sizeof *want->tokens);
        assert_int_equal(got[N_REQ + 1].why, TDM_WORKER_FINISH_STOP);
    }
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
    int32_t wrong[2] = {want->tokens[0], (int32_t)tdm_test_tiny_byte_token('x')};
    tdm_worker_req_t bad = {.seq_id = id,
                            .prompt = prompt,
                            .n_prompt = 12,
                            .sampling = &sp,
                            .output = wrong,
                            .n_output = 2,
                            .grammar = g};
    assert_int_equal(tdm_worker_add(r.w, &bad, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "output token 1"));
    rig_close(&r);
    g_grammar_vocab = NULL;
    tdm_grammar_destroy(&g);
    tdm_grammar_vocab_destroy(&gv);
}

/* ignore_eos holds for a constrained sequence too: end-of-generation tokens are masked while
 * the grammar allows more, so an open-ended grammar runs to max_tokens (LENGTH). */
static void test_constrained_ignore_eos(void **state)
{
    fixture_t *fx = *state;
    static const char open_gbnf[] = "root ::= [a-c ]+\n";
    tdm_error_t err = {0};
    tdm_grammar_vocab_t *gv = tdm_grammar_vocab_new(fx->tok, &err);
    tdm_grammar_t *g = tdm_grammar_parse(open_gbnf, strlen(open_gbnf), NULL, &err);
    assert_true(gv && g);
    g_grammar_vocab = gv;
    int32_t prompt[12];
    make_prompt(prompt, 12, fx->f.n_vocab, 9);
    for (int seed = 0; seed < 4; seed++) {
        tdm_sampling_params_t sp;
        tdm_sampling_params_default(&sp);
        sp.seed = (uint64_t)seed;
        sp.max_tokens = 20;
        sp.ignore_eos = true;
        out_t got[1] = {0};
        rig_t r;
        rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
        tdm_worker_req_t req = {
            .seq_id = seq_of(0), .prompt = prompt, .n_prompt = 12, .sampling = &sp, .grammar = g};
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
        drain(&r, got);
        rig_close(&r);
        assert_int_equal(got[0].why, TDM_WORKER_FINISH_LENGTH);
        assert_int_equal(got[0].n, 20);
    }
    g_grammar_vocab = NULL;
    tdm_grammar_destroy(&g);
    tdm_grammar_vocab_destroy(&gv);
}

/* A constrained sequence split between a PREFILL worker (first token under the mask) and a
 * DECODE worker (the first token replayed into a fresh matcher) gives the single-worker output;
 * a first token the grammar does not allow is refused at add. */
static void test_constrained_handoff(void **state)
{
    fixture_t *fx = *state;
    tdm_error_t err = {0};
    tdm_grammar_vocab_t *gv = tdm_grammar_vocab_new(fx->tok, &err);
    tdm_grammar_t *g = tdm_grammar_parse(tiny_gbnf, strlen(tiny_gbnf), NULL, &err);
    assert_true(gv && g);
    g_grammar_vocab = gv;
    out_t ref[N_REQ + 2] = {0}, got[N_REQ + 2] = {0};
    int32_t prompt[12];
    rig_t a, p, d;
    rig_open(fx, &a, TDM_WORKER_MODE_DECODE, 64, 256, 1);
    add_constrained(fx, &a, N_REQ + 1, prompt, g, false, 36);
    drain(&a, ref);
    rig_close(&a);
    rig_open(fx, &p, TDM_WORKER_MODE_PREFILL, 64, 64, 2);
    rig_open(fx, &d, TDM_WORKER_MODE_DECODE, 64, 64, 2);
    add_constrained(fx, &p, N_REQ + 1, prompt, g, false, 36);
    const tdm_worker_event_t *ev;
    uint32_t n = 0;
    while (n == 0 || ev[n - 1].kind != TDM_WORKER_EVENT_PREFILLED)
        assert_int_equal(tdm_worker_step(p.w, &ev, &n, &err), 0);
    tdm_kv_seq_t dst;
    tdm_kv_seq_init(&dst);
    assert_int_equal(tdm_kv_seq_reserve(d.pool, &dst, 12), 0);
    uint64_t bb = tdm_kv_pool_block_bytes(p.pool);
    for (uint32_t b = 0; b < ev[n - 1].seq.n_blocks; b++)
        memcpy((uint8_t *)tdm_kv_pool_base(d.pool) + dst.blocks[b] * bb,
               (uint8_t *)tdm_kv_pool_base(p.pool) + ev[n - 1].seq.blocks[b] * bb, bb);
    dst.n_tokens = 12;
    got[N_REQ + 1].tokens[got[N_REQ + 1].n++] = ev[n - 1].first_token;
    int32_t first = ev[n - 1].first_token;
    tdm_kv_seq_t src = ev[n - 1].seq;
    tdm_kv_seq_release(p.pool, &src);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.seed = 77 + N_REQ + 1;
    sp.max_tokens = 36;
    int32_t bad = (int32_t)tdm_test_tiny_byte_token('x'); /* not "{" */
    tdm_worker_req_t wrong = {.seq_id = seq_of(7),
                              .prompt = prompt,
                              .n_prompt = 12,
                              .sampling = &sp,
                              .prefilled = &dst,
                              .first_token = bad,
                              .grammar = g};
    assert_int_equal(tdm_worker_add(d.w, &wrong, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "constraint"));
    tdm_worker_req_t req = {.seq_id = seq_of(7),
                            .prompt = prompt,
                            .n_prompt = 12,
                            .sampling = &sp,
                            .prefilled = &dst,
                            .first_token = first,
                            .grammar = g};
    assert_int_equal(tdm_worker_add(d.w, &req, &err), 0);
    drain(&d, got);
    assert_int_equal(got[N_REQ + 1].n, ref[N_REQ + 1].n);
    assert_memory_equal(got[N_REQ + 1].tokens, ref[N_REQ + 1].tokens, ref[N_REQ + 1].n * 4);
    assert_int_equal(got[N_REQ + 1].why, TDM_WORKER_FINISH_STOP);
    rig_close(&p);
    rig_close(&d);
    g_grammar_vocab = NULL;
    tdm_grammar_destroy(&g);
    tdm_grammar_vocab_destroy(&gv);
}

/* ---- forks (n > 1) ---- */

static void fork_params(tdm_sampling_params_t *sp, uint64_t seed)
{
    tdm_sampling_params_default(sp);
    sp->temperature = 1.0f;
    sp->seed = seed;
    sp->max_tokens = 20;
    sp->ignore_eos = true;
}

/* "r<k>" with fork_params(seed) alone in a fresh worker, into *ref. */
static void fork_reference(fixture_t *fx, const int32_t *prompt, uint32_t n_prompt, int k,
                           uint64_t seed, out_t *ref)
{
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 1);
    tdm_sampling_params_t sp;
    fork_params(&sp, seed);
    uint64_t id = seq_of(k);
    tdm_worker_req_t req = {.seq_id = id, .prompt = prompt, .n_prompt = n_prompt, .sampling = &sp};
    tdm_error_t err = {0};
    assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
    out_t all[3] = {0};
    drain(&r, all);
    *ref = all[k];
    assert_int_equal(ref->n, 20);
    rig_close(&r);
}

/* Blocks of the pool whose reference count is want. */
static uint32_t blocks_with_refs(const tdm_kv_pool_t *pool, uint32_t want)
{
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    uint32_t n = 0;
    for (uint32_t b = 0; b < st.n_blocks; b++)
        n += tdm_kv_pool_refcount(pool, b) == want;
    return n;
}

/* A parent and two forks of a prompt of n_prompt tokens: the forks share the parent's
 * (n_prompt - 1) / 16 full prompt blocks (reference count 3) and each samples what a fresh
 * sequence with its seed samples. */
static void fork_case(fixture_t *fx, uint32_t n_prompt)
{
    int32_t prompt[64];
    make_prompt(prompt, n_prompt, fx->f.n_vocab, 77 + n_prompt);
    out_t ref[3];
    for (int k = 0; k < 3; k++)
        fork_reference(fx, prompt, n_prompt, k, 500 + (uint64_t)k, &ref[k]);
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 256, 4);
    tdm_sampling_params_t sp[3];
    tdm_worker_req_t req[3];
    for (int k = 0; k < 3; k++) {
        fork_params(&sp[k], 500 + (uint64_t)k);
        req[k] = (tdm_worker_req_t){
            .seq_id = seq_of(k), .prompt = prompt, .n_prompt = n_prompt, .sampling = &sp[k]};
    }
    tdm_error_t err = {0};
    assert_int_equal(tdm_worker_add(r.w, &req[0], &err), 0);
    assert_int_equal(tdm_worker_fork(r.w, seq_of(0), &req[1], &err), TDM_EPRECONDITION);
    out_t got[3] = {0};
    const tdm_worker_event_t *ev;
    uint32_t n_ev;
    assert_int_equal(tdm_worker_step(r.w, &ev, &n_ev, &err), 0); /* the prompt, token 0 */
    assert_int_equal(n_ev, 1);
    got[0].tokens[got[0].n++] = ev[0].sample.token;
    assert_int_equal(tdm_worker_fork(r.w, 999, &req[1], &err), TDM_ENOTFOUND);
    req[1].n_prompt = n_prompt - 1;
    assert_int_equal(tdm_worker_fork(r.w, seq_of(0), &req[1], &err), TDM_EINVALID);
    req[1].n_prompt = n_prompt;
    for (int k = 1; k < 3; k++)
        if (tdm_worker_fork(r.w, seq_of(0), &req[k], &err) != 0)
            fail_msg("%s", err.msg);
    uint32_t shared = (n_prompt - 1) / 16;
    assert_int_equal(blocks_with_refs(r.pool, 3), shared);
    drain(&r, got);
    for (int k = 0; k < 3; k++) {
        assert_int_equal(got[k].n, 20);
        assert_memory_equal(got[k].tokens, ref[k].tokens, 20 * sizeof(int32_t));
    }
    assert_memory_not_equal(got[1].tokens, got[2].tokens, 20 * sizeof(int32_t));
    rig_close(&r); /* every block back: n_used 0, pool consistent */
}

static void test_fork_shares_prompt_blocks(void **state)
{
    fixture_t *fx = *state;
    fork_case(fx, 40); /* 2 shared blocks, the fork recomputes 8 rows */
    fork_case(fx, 33); /* 2 shared, 1 row */
    fork_case(fx, 32); /* 1 shared, 16 rows (position 31 ends block 1) */
    fork_case(fx, 5);  /* nothing shared */
}

/* ---- prompt logprobs ---- */

#define PLP_N 30
#define PLP_TOP 5

/* The first token's event of seq_of(0) (its sample and prompt logprobs copied), stepping r
 * until idle. */
static void plp_drain(rig_t *r, uint64_t want, tdm_token_logprobs_t *plp,
                      tdm_sample_result_t *first, uint32_t *cached)
{
    bool seen = false;
    for (int steps = 0; tdm_worker_busy(r->w); steps++) {
        assert_true(steps < 10000);
        const tdm_worker_event_t *ev;
        uint32_t n;
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_step(r->w, &ev, &n, &err), 0);
        for (uint32_t i = 0; i < n; i++) {
            assert_int_not_equal(ev[i].kind, TDM_WORKER_EVENT_FAILED);
            if (ev[i].kind == TDM_WORKER_EVENT_PREFILLED) {
                tdm_kv_seq_t seq = ev[i].seq;
                tdm_kv_seq_release(r->pool, &seq);
            }
            if (ev[i].kind != TDM_WORKER_EVENT_TOKEN || ev[i].seq_id != want || ev[i].index != 0)
                continue;
            seen = true;
            *first = ev[i].sample;
            *cached = ev[i].cached_prompt_tokens;
            if (plp) {
                assert_non_null(ev[i].prompt_logprobs);
                assert_int_equal(ev[i].n_prompt_logprobs, PLP_N);
                /* sized by the request's top, not the most alternatives */
                assert_int_equal(ev[i].prompt_logprobs_bytes, tdm_worker_plp_bytes(PLP_N, PLP_TOP));
                for (uint32_t k = 0; k < PLP_N; k++) {
                    const tdm_prompt_logprob_t *e = &ev[i].prompt_logprobs[k];
                    memset(&plp[k], 0, sizeof plp[k]);
                    plp[k].token = e->token;
                    plp[k].logprob = e->logprob;
                    plp[k].rank = e->rank;
                    plp[k].n_top = e->n_top;
                    assert_true(e->n_top <= PLP_TOP);
                    memcpy(plp[k].top, e->top, e->n_top * sizeof *e->top);
                }
            } else {
                assert_null(ev[i].prompt_logprobs);
            }
        }
    }
    assert_true(seen);
}

/* Prompt logprobs from a chunked prefill, batched with another sequence and with the prompt
 * in the prefix cache, equal bitwise the logprobs greedy decoding reports for the token after
 * each prefix computed alone; the prefix cache is not used for them. */
static void test_prompt_logprobs(void **state)
{
    fixture_t *fx = *state;
    int32_t prompt[PLP_N], other[PLP_N];
    make_prompt(prompt, PLP_N, fx->f.n_vocab, 77);
    make_prompt(other, PLP_N, fx->f.n_vocab, 78);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 0.0f;
    sp.max_tokens = 2;
    tdm_error_t err = {0};
    for (int mode = 0; mode < 2; mode++) {
        rig_t r; /* 3 logit rows, 8 rows a step: the prompt goes in chunks of at most 3 */
        rig_open(fx, &r, mode ? TDM_WORKER_MODE_PREFILL : TDM_WORKER_MODE_DECODE, 64, 8, 3);
        tdm_worker_req_t warm = {
            .seq_id = seq_of(1), .prompt = prompt, .n_prompt = PLP_N, .sampling = &sp};
        assert_int_equal(tdm_worker_add(r.w, &warm, &err), 0); /* fills the prefix cache */
        tdm_token_logprobs_t plp[PLP_N];
        tdm_sample_result_t first, alone;
        uint32_t cached = 1;
        plp_drain(&r, seq_of(1), NULL, &first, &cached);
        tdm_worker_req_t req = {.seq_id = seq_of(0),
                                .prompt = prompt,
                                .n_prompt = PLP_N,
                                .sampling = &sp,
                                .prompt_logprobs = true,
                                .prompt_logprobs_top = PLP_TOP};
        tdm_worker_req_t req2 = {
            .seq_id = seq_of(2), .prompt = other, .n_prompt = PLP_N, .sampling = &sp};
        assert_int_equal(tdm_worker_add(r.w, &req2, &err), 0);
        assert_int_equal(tdm_worker_add(r.w, &req, &err), 0);
        plp_drain(&r, seq_of(0), plp, &first, &cached);
        assert_int_equal(cached, 0);
        tdm_worker_req_t again = warm; /* without prompt logprobs the cache is hit */
        again.seq_id = seq_of(3);
        assert_int_equal(tdm_worker_add(r.w, &again, &err), 0);
        plp_drain(&r, seq_of(3), NULL, &alone, &cached);
        assert_true(cached > 0);
        rig_close(&r);

        tdm_sampling_params_t ref = sp;
        ref.n_logprobs = TDM_SAMPLING_MAX_LOGPROBS;
        for (uint32_t i = 1; i < PLP_N; i++) {
            rig_t a;
            rig_open(fx, &a, TDM_WORKER_MODE_DECODE, 64, 256, 1);
            tdm_worker_req_t q = {
                .seq_id = seq_of(0), .prompt = prompt, .n_prompt = i, .sampling = &ref};
            assert_int_equal(tdm_worker_add(a.w, &q, &err), 0);
            plp_drain(&a, seq_of(0), NULL, &alone, &cached);
            rig_close(&a);
            assert_int_equal(plp[i].token, prompt[i]);
            assert_int_equal(plp[i].n_top, PLP_TOP);
            assert_memory_equal(plp[i].top, alone.top, PLP_TOP * sizeof *alone.top);
            for (uint32_t j = 0; j < alone.n_top; j++)
                if (alone.top[j].token == prompt[i]) {
                    assert_memory_equal(&plp[i].logprob, &alone.top[j].logprob, sizeof(float));
                    assert_true(plp[i].rank >= j + 1);
                }
            assert_true(plp[i].rank >= 1 && plp[i].rank <= fx->f.n_vocab);
            assert_true(plp[i].logprob <= 0.0f);
        }
        /* the first output token is the one the whole prompt alone gives */
        rig_t a;
        rig_open(fx, &a, TDM_WORKER_MODE_DECODE, 64, 256, 1);
        tdm_worker_req_t q = {
            .seq_id = seq_of(0), .prompt = prompt, .n_prompt = PLP_N, .sampling = &sp};
        assert_int_equal(tdm_worker_add(a.w, &q, &err), 0);
        plp_drain(&a, seq_of(0), NULL, &alone, &cached);
        rig_close(&a);
        assert_int_equal(first.token, alone.token);
    }
}

/* Steps r until idle, releasing PREFILLED tables; no sequence fails. */
static void plp_run(rig_t *r)
{
    for (int steps = 0; tdm_worker_busy(r->w); steps++) {
        assert_true(steps < 10000);
        const tdm_worker_event_t *ev;
        uint32_t n;
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_step(r->w, &ev, &n, &err), 0);
        for (uint32_t i = 0; i < n; i++) {
            assert_int_not_equal(ev[i].kind, TDM_WORKER_EVENT_FAILED);
            if (ev[i].kind == TDM_WORKER_EVENT_PREFILLED) {
                tdm_kv_seq_t seq = ev[i].seq;
                tdm_kv_seq_release(r->pool, &seq);
            }
        }
    }
}

/* Prompt logprobs take tdm_worker_plp_bytes of the worker's reserve from add until their
 * event is released: a request that would overflow it waits (TDM_ERESOURCE) while another
 * holds it and is admitted after; one larger than the whole reserve is refused
 * (TDM_EINVALID); the default reserve is one whole context at the most alternatives. */
static void test_prompt_logprobs_reserve(void **state)
{
    fixture_t *fx = *state;
    assert_int_equal(tdm_worker_plp_bytes(10, 0), 10 * sizeof(tdm_prompt_logprob_t));
    assert_int_equal(tdm_worker_plp_bytes(10, 20),
                     10 * (sizeof(tdm_prompt_logprob_t) + 20 * sizeof(tdm_token_logprob_t)));
    assert_int_equal(tdm_worker_plp_reserve(512), tdm_worker_plp_bytes(511, 20));
    enum { N_BIG = 500 };
    static int32_t big[N_BIG];
    int32_t small[PLP_N];
    make_prompt(big, N_BIG, fx->f.n_vocab, 91);
    make_prompt(small, PLP_N, fx->f.n_vocab, 92);
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = 0.0f;
    sp.max_tokens = 1;
    tdm_error_t err = {0};
    for (int mode = 0; mode < 2; mode++) {
        rig_t r; /* n_ctx 512: the default reserve is 511 x 184 bytes */
        rig_open(fx, &r, mode ? TDM_WORKER_MODE_PREFILL : TDM_WORKER_MODE_DECODE, 128, 64, 32);
        tdm_worker_req_t a = {.seq_id = seq_of(0),
                              .prompt = big,
                              .n_prompt = N_BIG,
                              .sampling = &sp,
                              .prompt_logprobs = true,
                              .prompt_logprobs_top = 20};
        tdm_worker_req_t b = a;
        b.seq_id = seq_of(1);
        b.prompt = small;
        b.n_prompt = PLP_N;
        assert_int_equal(tdm_worker_add(r.w, &a, &err), 0);
        /* 500 x 184 + 30 x 184 > 511 x 184: b waits for a's to go */
        assert_int_equal(tdm_worker_add(r.w, &b, &err), TDM_ERESOURCE);
        assert_non_null(strstr(err.msg, "reserve"));
        b.prompt_logprobs_top = 0; /* 30 x 24 bytes fit beside a's */
        assert_int_equal(tdm_worker_add(r.w, &b, &err), 0);
        plp_run(&r);
        b.seq_id = seq_of(2);
        b.prompt_logprobs_top = 20;
        assert_int_equal(tdm_worker_add(r.w, &b, &err), 0); /* a's were released */
        plp_run(&r);
        /* b's are held by the last step's event until the caller is done with it */
        assert_int_equal(tdm_worker_add(r.w, &a, &err), TDM_ERESOURCE);
        tdm_worker_events_done(r.w);
        /* a cancelled sequence gives its bytes back too */
        assert_int_equal(tdm_worker_add(r.w, &a, &err), 0);
        assert_int_equal(tdm_worker_cancel(r.w, a.seq_id), 0);
        assert_int_equal(tdm_worker_add(r.w, &a, &err), 0);
        plp_run(&r);
        rig_close(&r);
    }
    g_plp_reserve = tdm_worker_plp_bytes(PLP_N, 20) - 1;
    rig_t r;
    rig_open(fx, &r, TDM_WORKER_MODE_DECODE, 64, 64, 4);
    g_plp_reserve = 0;
    tdm_worker_req_t c = {.seq_id = seq_of(0),
                          .prompt = small,
                          .n_prompt = PLP_N,
                          .sampling = &sp,
                          .prompt_logprobs = true,
                          .prompt_logprobs_top = 20};
    assert_int_equal(tdm_worker_add(r.w, &c, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "prompt_logprobs"));
    c.prompt_logprobs_top = 19;
    assert_int_equal(tdm_worker_add(r.w, &c, &err), 0);
    plp_run(&r);
    rig_close(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_batched_equals_alone),
        cmocka_unit_test(test_prompt_logprobs),
        cmocka_unit_test(test_prompt_logprobs_reserve),
        cmocka_unit_test(test_preemption_keeps_outputs),
        cmocka_unit_test(test_prefill_chunk_limit),
        cmocka_unit_test(test_decode_step_stats),
        cmocka_unit_test(test_prefill_then_decode),
        cmocka_unit_test(test_prefilled_finishes_at_once),
        cmocka_unit_test(test_cancel_and_errors),
        cmocka_unit_test(test_step_allocates_nothing),
        cmocka_unit_test(test_prefill_step_allocates_nothing),
        cmocka_unit_test(test_embed_in_batch_under_preemption),
        cmocka_unit_test(test_oom_is_not_pool_exhaustion),
        cmocka_unit_test(test_prefill_stall_preempts),
        cmocka_unit_test(test_events_carry_user),
        cmocka_unit_test(test_resume_equals_undisturbed),
        cmocka_unit_test(test_resume_errors),
        cmocka_unit_test(test_constrained_in_batch),
        cmocka_unit_test(test_constrained_handoff),
        cmocka_unit_test(test_constrained_resume),
        cmocka_unit_test(test_constrained_ignore_eos),
        cmocka_unit_test(test_fork_shares_prompt_blocks),
    };
    return cmocka_run_group_tests(tests, tdm_test_tok_engine_setup, tdm_test_tok_engine_teardown);
}
