/* test_worker_groups.c - the continuous-batching worker over a KV pool with layer groups
 * (tdm_kv_pool_new_grouped) gives bitwise the outputs of a plain pool: a gemma3-tiny made by
 * `tandem model synth` (6 layers, one of full attention, window 32, 4-token blocks) with prompts
 * far past the window, greedy and seeded, batched with chunked prefill, speculative decoding,
 * prefix-cache hits under the window rule, forks (n > 1), a resumed (migrated) request and,
 * in a pool too small for the batch, preemption and recompute. After every step each running
 * sequence holds exactly the blocks of the per-group formula (tdm_kv_group_live), no step
 * allocates, and the peak pool memory is below the plain pool's. Then the refusals: PREFILL mode
 * and prefilled KV over a grouped pool. */
#include "tdm_test.h"

#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../../common/src/worker/worker_internal.h" /* the sequences' tables, for the formula */
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/tokenizer.h"
#include "engine_runner.h"
#include "tiny_model.h"

/* Allocation counting, as in test_worker.c: tests/CMakeLists.txt links this test with
 * -Wl,--wrap for the allocator, so that a step can be checked to allocate nothing (the
 * linker's names, __wrap_x and __real_x, break the house rule on "__" unavoidably). */
static atomic_int g_alloc_watch, g_allocs;
void *__real_malloc(size_t n);
void *__real_calloc(size_t k, size_t n);
void *__real_realloc(void *p, size_t n);
void *__wrap_malloc(size_t n);
void *__wrap_calloc(size_t k, size_t n);
void *__wrap_realloc(void *p, size_t n);

static void alloc_seen(void)
{
    if (atomic_load(&g_alloc_watch))
        atomic_fetch_add(&g_allocs, 1);
}

void *__wrap_malloc(size_t n)
{
    alloc_seen();
    return __real_malloc(n);
}

void *__wrap_calloc(size_t k, size_t n)
{
    alloc_seen();
    return __real_calloc(k, n);
}

void *__wrap_realloc(void *p, size_t n)
{
    alloc_seen();
    return __real_realloc(p, n);
}

enum { BS = 4, N_CTX = 512, MAX_BATCH = 64, MAX_RUNNING = 4, CHUNK = 48, MAX_DRAFT = 4 };
enum { N_REQ = 9, N_LONG = 4, N_RESUMED = N_REQ + N_LONG, N_ALL = N_RESUMED + 1 };
enum { MAX_PROMPT = 200, MAX_OUT = 128, N_DELIVERED = 60 };

typedef struct fx {
    char dir[64], path[128];
    tdm_model_t *model;
    const tdm_llama_hparams_t *hp;
    tdm_tokenizer_t *tok;
    uint32_t n_vocab;
    tdm_kv_groups_t groups;
} fx_t;

static fx_t F;

static int setup(void **state)
{
    (void)state;
    snprintf(F.dir, sizeof F.dir, "/tmp/tdm-wg-XXXXXX");
    tdm_error_t err = {0};
    if (tdm_test_synth_gemma3_tiny(TDM_CLI_PATH, F.dir, F.path, sizeof F.path, &err) != TDM_OK)
        fail_msg("gemma3-tiny: %s", err.msg);
    F.model = tdm_model_load(F.path, &err);
    if (!F.model)
        fail_msg("load: %s", err.msg);
    F.hp = tdm_model_hparams(F.model);
    assert_int_equal(F.hp->n_swa, 32);
    F.tok = tdm_tokenizer_new(tdm_model_gguf(F.model), &err);
    if (!F.tok)
        fail_msg("tokenizer: %s", err.msg);
    F.n_vocab = F.hp->n_vocab;
    uint32_t windows[TDM_KV_MAX_LAYERS];
    for (uint32_t l = 0; l < F.hp->n_layers; l++)
        windows[l] = tdm_llama_layer_window(F.hp, l);
    assert_int_equal(tdm_kv_groups_init(&F.groups, F.hp->n_layers, windows, &err), TDM_OK);
    assert_int_equal(F.groups.n_groups, 6); /* 1 full + 5 window groups of one layer */
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    tdm_tokenizer_destroy(&F.tok);
    tdm_model_destroy(&F.model);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", F.dir);
    return system(cmd) == 0 ? 0 : -1;
}

typedef struct rig {
    bool grouped;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *w;
    uint64_t peak_bytes; /* most pool bytes in use (or cached-and-reused) after a step */
    uint64_t steps;
} rig_t;

static tdm_worker_opts_t rig_opts(tdm_worker_mode_t mode)
{
    return (tdm_worker_opts_t){.mode = mode,
                               .max_batch_tokens = MAX_BATCH,
                               .max_running = MAX_RUNNING,
                               .max_waiting = 64,
                               .n_ctx = N_CTX,
                               .prefix_caching = true,
                               .max_prefill_chunk = CHUNK,
                               .max_draft = MAX_DRAFT,
                               .spec_row_cost = 0.05};
}

/* A worker in mode over a plain pool of n_blocks blocks of every layer, or a grouped pool of
 * n_blocks * n_groups blocks of one group's layers (the same bytes). */
static void rig_open_mode(rig_t *r, bool grouped, uint32_t n_blocks, tdm_worker_mode_t mode)
{
    memset(r, 0, sizeof *r);
    r->grouped = grouped;
    tdm_error_t err = {0};
    tdm_kv_layout_t kl = {F.hp->n_layers, F.hp->n_kv_heads, F.hp->head_dim, BS, TDM_KV_F16};
    r->pool = grouped ? tdm_kv_pool_new_grouped(&kl, &F.groups, n_blocks * F.groups.n_groups, &err)
                      : tdm_kv_pool_new(&kl, n_blocks, &err);
    assert_non_null(r->pool);
    tdm_worker_opts_t o = rig_opts(mode);
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.n_ctx = N_CTX;
    ep.max_batch_tokens = MAX_BATCH;
    ep.max_logits = tdm_worker_logit_rows(&o);
    ep.n_threads = 1;
    r->engine = tdm_engine_new(F.model, r->pool, &ep, &err);
    if (!r->engine)
        fail_msg("engine: %s", err.msg);
    r->w = tdm_worker_new(r->engine, r->pool, F.tok, F.n_vocab, &o, &err);
    if (!r->w)
        fail_msg("worker: %s", err.msg);
}

static void rig_open(rig_t *r, bool grouped, uint32_t n_blocks)
{
    rig_open_mode(r, grouped, n_blocks, TDM_WORKER_MODE_DECODE);
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
    uint32_t cached; /* cached_prompt_tokens of the first token's event */
} out_t;

/* Every running sequence of r holds exactly the formula's blocks: for n tokens computed and
 * its tables covering e entries, full group e, window group W e - floor(max(0, n + 1 - W) /
 * block_size) (tdm_kv_group_live with m = e * block_size); others hold nothing. */
static void check_formula(const rig_t *r)
{
    const tdm_worker_t *w = r->w;
    for (uint32_t i = 0; i < w->n_slots; i++) {
        const wseq_t *s = &w->seqs[i];
        if (!s->used)
            continue;
        uint32_t held = tdm_worker_kv_held(w, s);
        if (s->n_computed == 0) { /* waiting, or preempted */
            assert_int_equal(held, 0);
            continue;
        } /* running, or queued with KV handed over (prefilled_groups) */
        uint32_t e = tdm_worker_kv_entries(w, s);
        uint64_t want = 0;
        for (uint32_t gi = 0; gi < F.groups.n_groups; gi++) {
            uint64_t live = tdm_kv_group_live(&F.groups, gi, BS, s->n_computed, (uint64_t)e * BS);
            want += live;
            assert_int_equal(s->hkv.tab[gi].n_blocks - s->hkv.tab[gi].n_dropped, live);
        }
        assert_int_equal(held, want);
    }
}

/* One step of r, its events into outs (request k has seq id k + 1). */
static void step(rig_t *r, out_t *outs)
{
    const tdm_worker_event_t *ev;
    uint32_t n;
    tdm_error_t err = {0};
    atomic_store(&g_allocs, 0);
    atomic_store(&g_alloc_watch, 1);
    int rc = tdm_worker_step(r->w, &ev, &n, &err);
    atomic_store(&g_alloc_watch, 0);
    assert_int_equal(rc, 0);
    assert_int_equal(atomic_load(&g_allocs), 0); /* a step allocates nothing */
    assert_true(++r->steps < 100000);
    for (uint32_t i = 0; i < n; i++) {
        out_t *o = &outs[ev[i].seq_id - 1];
        switch (ev[i].kind) {
        case TDM_WORKER_EVENT_TOKEN:
            assert_int_equal(ev[i].index, o->n);
            assert_true(o->n < MAX_OUT);
            if (o->n == 0)
                o->cached = ev[i].cached_prompt_tokens;
            o->tokens[o->n++] = ev[i].sample.token;
            break;
        case TDM_WORKER_EVENT_FINISHED: o->finished = true; break;
        case TDM_WORKER_EVENT_FAILED: fail_msg("request %d failed: %s", (int)ev[i].seq_id, "");
        default: fail_msg("unexpected event kind %d", ev[i].kind);
        }
    }
    if (r->grouped)
        check_formula(r);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(r->pool, &st);
    uint64_t bytes = (uint64_t)st.n_used * tdm_kv_pool_block_bytes(r->pool);
    r->peak_bytes = bytes > r->peak_bytes ? bytes : r->peak_bytes;
}

static void drain(rig_t *r, out_t *outs)
{
    while (tdm_worker_busy(r->w))
        step(r, outs);
}

/* Request k's prompt (deterministic): random tokens, request 3's a repeated 10-token phrase
 * (speculative drafts match it), request 4 request 0's first 140 tokens and a new tail. */
static uint32_t prompt_of(int k, int32_t *p)
{
    static const uint32_t len[N_REQ] = {150, 97, 130, 120, 160, 57, 57, 60, 60};
    if (k == 3) {
        int32_t phrase[10];
        tdm_test_random_tokens(phrase, 10, F.n_vocab, 77);
        for (uint32_t i = 0; i < len[k]; i++)
            p[i] = phrase[i % 10];
        return len[k];
    }
    if (k == 4) {
        prompt_of(0, p);
        tdm_test_random_tokens(p + 140, len[k] - 140, F.n_vocab, 400);
        return len[k];
    }
    if (k >= N_REQ) { /* the long-decode requests */
        tdm_test_random_tokens(p, 40, F.n_vocab, 500 + (uint64_t)k);
        return 40;
    }
    if (k == 6 || k == 8) /* forks: their parent's prompt */
        return prompt_of(k - 1, p);
    tdm_test_random_tokens(p, len[k], F.n_vocab, 100 + (uint64_t)k);
    return len[k];
}

static tdm_sampling_params_t sampling_of(int k)
{
    tdm_sampling_params_t sp;
    tdm_sampling_params_default(&sp);
    sp.temperature = k % 2 ? 0.9f : 0.0f; /* odd requests seeded, even ones greedy */
    sp.seed = 1234 + (uint64_t)k;
    sp.max_tokens = k >= N_REQ ? 120 : k == 3 ? 30 : 24;
    sp.ignore_eos = true;
    return sp;
}

static void add(rig_t *r, int k)
{
    int32_t p[MAX_PROMPT];
    uint32_t n = prompt_of(k, p);
    tdm_sampling_params_t sp = sampling_of(k);
    tdm_worker_req_t req = {.seq_id = (uint64_t)k + 1, .prompt = p, .n_prompt = n, .sampling = &sp};
    tdm_error_t err = {0};
    if (tdm_worker_add(r->w, &req, &err) != TDM_OK)
        fail_msg("add %d: %s", k, err.msg);
}

/* Adds parent k, steps until its first token, then forks request k + 1 from it. */
static void add_with_fork(rig_t *r, out_t *outs, int k)
{
    add(r, k);
    while (outs[k].n == 0)
        step(r, outs);
    int32_t p[MAX_PROMPT];
    uint32_t n = prompt_of(k + 1, p);
    tdm_sampling_params_t sp = sampling_of(k + 1);
    tdm_worker_req_t req = {.seq_id = (uint64_t)k + 2, .prompt = p, .n_prompt = n, .sampling = &sp};
    tdm_error_t err = {0};
    if (tdm_worker_fork(r->w, (uint64_t)k + 1, &req, &err) != TDM_OK)
        fail_msg("fork %d: %s", k + 1, err.msg);
}

/* The whole scenario on r: four requests batched (chunked prefill, drafts), then a prompt
 * sharing request 0's first 140 tokens (a prefix hit), then two parents each forked once
 * after their prompt: 57 tokens (the window blocks the fork reads are still held: shared) and
 * 60 (the parent gave one back: the fork finds it in the prefix cache). */
static void scenario(rig_t *r, out_t *outs)
{
    memset(outs, 0, N_REQ * sizeof *outs);
    for (int k = 0; k < 4; k++)
        add(r, k);
    drain(r, outs);
    add(r, 4);
    drain(r, outs);
    add_with_fork(r, outs, 5);
    drain(r, outs);
    add_with_fork(r, outs, 7);
    drain(r, outs);
    for (int k = 0; k < N_REQ; k++) {
        tdm_sampling_params_t sp = sampling_of(k);
        assert_true(outs[k].finished);
        assert_int_equal(outs[k].n, (uint32_t)sp.max_tokens);
    }
}

/* Four 40-token prompts decoding 120 tokens each: their full-attention group grows to 40
 * blocks, so a small pool preempts; with them a resumed request (a migrated one: 60 output
 * tokens delivered, recomputed with its prompt past the window, then 60 more). */
static void scenario_long(rig_t *r, out_t *outs)
{
    memset(outs + N_REQ, 0, (N_LONG + 1) * sizeof *outs);
    for (int k = N_REQ; k < N_RESUMED; k++)
        add(r, k);
    int32_t p[MAX_PROMPT];
    uint32_t n = prompt_of(N_RESUMED, p);
    out_t *o = &outs[N_RESUMED];
    tdm_test_random_tokens(o->tokens, N_DELIVERED, F.n_vocab, 900);
    o->n = N_DELIVERED;
    tdm_sampling_params_t sp = sampling_of(N_RESUMED);
    tdm_worker_req_t req = {.seq_id = N_RESUMED + 1,
                            .prompt = p,
                            .n_prompt = n,
                            .sampling = &sp,
                            .output = o->tokens,
                            .n_output = N_DELIVERED};
    tdm_error_t err = {0};
    if (tdm_worker_add(r->w, &req, &err) != TDM_OK)
        fail_msg("add resumed: %s", err.msg);
    drain(r, outs);
    for (int k = N_REQ; k < N_ALL; k++) {
        assert_true(outs[k].finished);
        assert_int_equal(outs[k].n, 120);
    }
}

static void check_equal(const out_t *a, const out_t *b)
{
    for (int k = 0; k < N_ALL; k++) {
        assert_int_equal(a[k].n, b[k].n);
        assert_memory_equal(a[k].tokens, b[k].tokens, a[k].n * sizeof(int32_t));
    }
}

static void test_outputs_equal_plain(void **state)
{
    (void)state;
    static out_t ref[N_ALL], big[N_ALL], small[N_ALL];
    rig_t r;
    rig_open(&r, false, 1024);
    scenario(&r, ref);
    scenario_long(&r, ref);
    uint64_t plain_peak = r.peak_bytes;
    rig_close(&r);

    /* the same memory, grouped */
    rig_open(&r, true, 1024);
    scenario(&r, big);
    scenario_long(&r, big);
    check_equal(ref, big);
    tdm_worker_stats_t ws;
    tdm_worker_stats(r.w, &ws);
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(r.pool, &ks);
    print_message("grouped: peak %llu B of KV vs %llu B plain; prefix hits %llu of %llu "
                  "blocks; drafts %llu accepted of %llu; cached prompt tokens of request 4 "
                  "%u, forks %u and %u\n",
                  (unsigned long long)r.peak_bytes, (unsigned long long)plain_peak,
                  (unsigned long long)ks.prefix_hits, (unsigned long long)ks.prefix_queries,
                  (unsigned long long)ws.spec_accepted_tokens,
                  (unsigned long long)ws.spec_draft_tokens, big[4].cached, big[6].cached,
                  big[8].cached);
    assert_true(r.peak_bytes * 2 < plain_peak);
    assert_true(ws.spec_accepted_tokens > 0);
    assert_int_equal(ws.preemptions, 0);
    assert_int_equal(big[4].cached, 140); /* the 35 shared blocks, window ones cached */
    assert_int_equal(big[6].cached, 56);  /* shared by the fork: 14 blocks */
    assert_int_equal(big[8].cached, 56);  /* from the prefix cache */
    rig_close(&r);

    /* a pool too small for the batch: preemption and recompute */
    uint32_t n_small = 30; /* 180 blocks */
    rig_open(&r, true, n_small);
    scenario(&r, small);
    scenario_long(&r, small);
    check_equal(ref, small);
    tdm_worker_stats(r.w, &ws);
    print_message("grouped, %u blocks: %llu preemptions\n", n_small * F.groups.n_groups,
                  (unsigned long long)ws.preemptions);
    assert_true(ws.preemptions > 0);
    rig_close(&r);
}

/* Blocks a hand-over of n tokens carries, by the formula of docs/capacity.md written out for
 * gemma3-tiny (blocks of 4, one full group, five groups of window 32): every entry of the full
 * group, the entries from floor((n + 1 - 32) / 4) on of each window group. */
static uint64_t handover_blocks(uint32_t n)
{
    uint64_t e = (n + BS - 1) / BS;
    uint64_t first = n + 1 > 32 ? (n + 1 - 32) / BS : 0;
    return e + 5 * (e - first);
}

/* The disaggregated path in one process: a PREFILL worker over a grouped pool hands over each
 * group's live blocks only (the window groups' last blocks, exactly the formula's), they are
 * "shipped" into another grouped pool (a copy per block), and a DECODE worker there goes on
 * from them: the tokens are the plain pool's, greedy and seeded, for prompts past the window
 * and for a resumed request (a migrated one: its prompt and delivered output prefilled). */
static void test_handover_equals_plain(void **state)
{
    (void)state;
    static const int ks[] = {0, 1, 2, 3, 5, N_RESUMED};
    enum { N_KS = sizeof ks / sizeof ks[0] };
    static out_t ref[N_ALL], got[N_ALL];
    int32_t prompts[N_ALL][MAX_PROMPT];
    uint32_t lens[N_ALL];
    int32_t delivered[N_DELIVERED];
    tdm_test_random_tokens(delivered, N_DELIVERED, F.n_vocab, 900);
    tdm_error_t err = {0};
    rig_t p, d, r;
    for (int pass = 0; pass < 2; pass++) { /* 0: the plain pool, single process */
        out_t *outs = pass ? got : ref;
        memset(outs, 0, N_ALL * sizeof *outs);
        tdm_worker_mode_t mode = pass ? TDM_WORKER_MODE_PREFILL : TDM_WORKER_MODE_DECODE;
        rig_open_mode(&r, pass == 1, 1024, mode);
        for (int i = 0; i < N_KS; i++) {
            int k = ks[i];
            lens[k] = prompt_of(k, prompts[k]);
            tdm_sampling_params_t sp = sampling_of(k);
            tdm_worker_req_t req = {.seq_id = (uint64_t)k + 1,
                                    .prompt = prompts[k],
                                    .n_prompt = lens[k],
                                    .sampling = &sp};
            if (k == N_RESUMED) {
                memcpy(outs[k].tokens, delivered, sizeof delivered);
                outs[k].n = N_DELIVERED;
                req.output = delivered;
                req.n_output = N_DELIVERED;
            }
            assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_OK);
        }
        if (pass == 0) {
            drain(&r, outs);
            rig_close(&r);
            continue;
        }
        p = r;
        rig_open(&d, true, 1024);
        const uint64_t bb = tdm_kv_pool_block_bytes(p.pool);
        uint64_t shipped = 0, expect = 0, every_layer = 0;
        int handed = 0;
        while (tdm_worker_busy(p.w)) {
            const tdm_worker_event_t *ev;
            uint32_t n;
            assert_int_equal(tdm_worker_step(p.w, &ev, &n, &err), 0);
            for (uint32_t i = 0; i < n; i++) {
                int k = (int)ev[i].seq_id - 1;
                if (ev[i].kind == TDM_WORKER_EVENT_TOKEN) {
                    assert_int_equal(ev[i].index, outs[k].n);
                    outs[k].tokens[outs[k].n++] = ev[i].sample.token;
                    continue;
                }
                assert_int_equal(ev[i].kind, TDM_WORKER_EVENT_PREFILLED);
                uint32_t nt = ev[i].n_tokens;
                assert_int_equal(nt, lens[k] + (k == N_RESUMED ? N_DELIVERED : 0));
                assert_int_equal(ev[i].seq.n_blocks, 0); /* the tables are per group */
                const tdm_kv_hseq_t *src = &ev[i].hseq;
                assert_int_equal(tdm_kv_hseq_held(src), handover_blocks(nt));
                expect += handover_blocks(nt) * bb;
                every_layer += (nt + BS - 1) / BS * bb * F.groups.n_groups;
                /* "ship" each group's live blocks into the decode pool */
                tdm_kv_hseq_t dst;
                assert_int_equal(tdm_kv_hseq_init(&dst, &F.groups, &err), TDM_OK);
                assert_int_equal(tdm_kv_hseq_prepare(d.pool, &dst, nt), TDM_OK);
                for (uint32_t gi = 0; gi < F.groups.n_groups; gi++) {
                    const tdm_kv_seq_t *st = &src->tab[gi];
                    tdm_kv_seq_t *dt = &dst.tab[gi];
                    assert_int_equal(st->n_blocks, (nt + BS - 1) / BS);
                    assert_int_equal(st->n_dropped,
                                     tdm_kv_group_first_needed(&F.groups, gi, BS, nt));
                    uint32_t live = st->n_blocks - st->n_dropped;
                    assert_int_equal(tdm_kv_pool_alloc(d.pool, live, dt->blocks + st->n_dropped),
                                     0);
                    for (uint32_t b = 0; b < st->n_dropped; b++)
                        dt->blocks[b] = TDM_KV_NO_BLOCK;
                    for (uint32_t b = st->n_dropped; b < st->n_blocks; b++) {
                        memcpy((uint8_t *)tdm_kv_pool_base(d.pool) + dt->blocks[b] * bb,
                               (uint8_t *)tdm_kv_pool_base(p.pool) + st->blocks[b] * bb, bb);
                        shipped += bb;
                    }
                    dt->n_blocks = st->n_blocks;
                    dt->n_dropped = st->n_dropped;
                }
                tdm_kv_hseq_t done = ev[i].hseq;
                tdm_kv_hseq_release(p.pool, &done);
                tdm_sampling_params_t sp = sampling_of(k);
                tdm_worker_req_t req = {.seq_id = ev[i].seq_id,
                                        .prompt = prompts[k],
                                        .n_prompt = lens[k],
                                        .sampling = &sp,
                                        .prefilled_groups = &dst,
                                        .first_token = ev[i].first_token,
                                        .output = k == N_RESUMED ? delivered : NULL,
                                        .n_output = k == N_RESUMED ? N_DELIVERED : 0};
                if (tdm_worker_add(d.w, &req, &err) != TDM_OK)
                    fail_msg("add %d: %s", k, err.msg);
                assert_null(dst.tab); /* taken over */
                handed++;
            }
        }
        assert_int_equal(handed, N_KS);
        assert_int_equal(shipped, expect);
        print_message("hand-over: %llu B of KV shipped for %d requests (every layer in every "
                      "block: %llu B)\n",
                      (unsigned long long)shipped, N_KS, (unsigned long long)every_layer);
        drain(&d, outs);
        rig_close(&p);
        rig_close(&d);
    }
    for (int i = 0; i < N_KS; i++) {
        int k = ks[i];
        tdm_sampling_params_t sp = sampling_of(k);
        assert_true(got[k].finished && ref[k].finished);
        assert_int_equal(got[k].n, (uint32_t)sp.max_tokens);
        assert_int_equal(got[k].n, ref[k].n);
        assert_memory_equal(got[k].tokens, ref[k].tokens, ref[k].n * sizeof(int32_t));
    }
}

/* Over a grouped pool one table of every layer is refused as prefilled KV, as are tables per
 * group over a plain pool and tables that lack a block the next query reads. */
static void test_refusals(void **state)
{
    (void)state;
    rig_t r;
    rig_open(&r, true, 64);
    tdm_error_t err = {0};

    int32_t p[MAX_PROMPT];
    uint32_t n = prompt_of(1, p);
    tdm_sampling_params_t sp = sampling_of(1);
    tdm_kv_seq_t pre;
    tdm_kv_seq_init(&pre);
    pre.n_tokens = n;
    tdm_worker_req_t req = {
        .seq_id = 1, .prompt = p, .n_prompt = n, .sampling = &sp, .prefilled = &pre};
    err = (tdm_error_t){0};
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "prefilled"));
    assert_non_null(strstr(err.msg, "layer groups"));
    tdm_kv_seq_release(r.pool, &pre);

    /* n = 97 tokens: 25 entries, a window group needs them from floor(66 / 4) = 16 on */
    tdm_kv_hseq_t hs;
    assert_int_equal(tdm_kv_hseq_init(&hs, &F.groups, &err), TDM_OK);
    assert_int_equal(tdm_kv_hseq_reserve(r.pool, &hs, n), TDM_OK);
    tdm_kv_hseq_commit(r.pool, &hs, NULL, 97 + BS); /* gives back one block too many */
    req.prefilled = NULL;
    req.prefilled_groups = &hs;
    if (tdm_worker_add(r.w, &req, &err) != TDM_EINVALID)
        fail_msg("%s", err.msg);
    assert_string_equal(err.msg, "prefilled KV: group 1 has 25 entries from 17 on; 97 tokens "
                                 "need 25 from 16 on");
    tdm_kv_hseq_clear(r.pool, &hs);
    assert_int_equal(tdm_kv_hseq_reserve(r.pool, &hs, n - BS), TDM_OK);
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "prefilled KV: group 0 has 24 entries from 0 on; 97 tokens "
                                 "need 25 from 0 on");
    tdm_kv_hseq_release(r.pool, &hs);
    rig_close(&r);

    rig_open(&r, false, 64);
    assert_int_equal(tdm_kv_hseq_init(&hs, &F.groups, &err), TDM_OK);
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "prefilled_groups: this worker's KV pool has no layer groups"));
    tdm_kv_hseq_release(r.pool, &hs);
    rig_close(&r);
}

/* A sequence the grouped pool could never hold alone is refused at tdm_worker_add with the
 * groups' peak (tdm_kv_groups_blocks_per_seq); one that just fits runs alone in it to the end,
 * its prompt chunks shrunk to what the pool holds (a window group holds a whole chunk's blocks
 * while it runs), and gives the plain pool's tokens. */
static void test_pool_too_small(void **state)
{
    (void)state;
    int32_t p[MAX_PROMPT];
    uint32_t n = prompt_of(1, p); /* 97 tokens */
    tdm_sampling_params_t sp = sampling_of(1);
    tdm_worker_req_t req = {.seq_id = 1, .prompt = p, .n_prompt = n, .sampling = &sp};
    tdm_error_t err = {0};
    rig_t r;
    /* 96 blocks: KV of K tokens peaks at ceil(K / 4) + 5 * 9 blocks, so K <= 204 fits */
    rig_open(&r, true, 16);
    sp.max_tokens = 109; /* 97 + 109 - 1 = 205 tokens' KV: 52 + 45 = 97 blocks */
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_ERESOURCE);
    assert_string_equal(err.msg, "KV pool too small for the sequence: the prompt (97 tokens) and "
                                 "up to 109 output tokens need the KV of 205 tokens, 97 blocks of "
                                 "4 tokens at their peak; the pool has 96 blocks");
    assert_false(tdm_worker_has(r.w, 1));
    sp.max_tokens = 108;
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_OK);
    out_t got[1] = {0}, ref[1] = {0};
    drain(&r, got);
    assert_true(got[0].finished);
    assert_int_equal(got[0].n, 108);
    rig_close(&r);
    rig_open(&r, false, 1024);
    assert_int_equal(tdm_worker_add(r.w, &req, &err), TDM_OK);
    drain(&r, ref);
    rig_close(&r);
    assert_memory_equal(got[0].tokens, ref[0].tokens, 108 * sizeof(int32_t));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_outputs_equal_plain),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_handover_equals_plain),
        cmocka_unit_test(test_pool_too_small),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
