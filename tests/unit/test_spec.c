/* test_spec.c - speculative decoding (prompt lookup) in the worker: outputs are bitwise those of
 * plain decoding (greedy, seeded with penalties, grammar-constrained, batched with preemption,
 * stop tokens and max_tokens), drafts are accepted on a prompt that repeats, the blocks taken
 * for rejected drafts go back after every step, and q8 KV or a request's no_speculation turn
 * it off. */
#include "engine_runner.h"
#include "tdm_test.h"

#include "tandem/worker.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MAX_OUT 96
#define N_SEQ 6
#define PROMPT_CAP 128

typedef tdm_test_tok_engine_t fixture_t; /* engine_runner.h */

/* A worker with its own pool and engine. */
typedef struct rig {
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    tdm_worker_t *w;
} rig_t;

typedef struct rig_opts {
    uint32_t max_draft, n_blocks, max_running;
    tdm_kv_dtype_t dtype;
    bool prefix_caching;
    const tdm_grammar_vocab_t *gv;
} rig_opts_t;

static void rig_open(fixture_t *fx, rig_t *r, const rig_opts_t *ro)
{
    tdm_error_t err = {0};
    const tdm_llama_hparams_t *hp = tdm_model_hparams(fx->f.model);
    tdm_kv_layout_t l = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, ro->dtype};
    r->pool = tdm_kv_pool_new(&l, ro->n_blocks, &err);
    assert_non_null(r->pool);
    tdm_worker_opts_t o = {.mode = TDM_WORKER_MODE_DECODE,
                           .max_batch_tokens = 256,
                           .max_running = ro->max_running,
                           .max_waiting = 64,
                           .n_ctx = 512,
                           .prefix_caching = ro->prefix_caching,
                           .grammar_vocab = ro->gv,
                           .max_draft = ro->max_draft,
                           /* fixed: the draft lengths depend on the outputs, not on timing */
                           .spec_row_cost = 0.1};
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.n_ctx = 512;
    ep.max_batch_tokens = 256;
    ep.max_logits = tdm_worker_logit_rows(&o);
    ep.n_threads = 1;
    r->engine = tdm_engine_new(fx->f.model, r->pool, &ep, &err);
    assert_non_null(r->engine);
    r->w = tdm_worker_new(r->engine, r->pool, fx->tok, fx->f.n_vocab, &o, &err);
    if (!r->w)
        fail_msg("%s", err.msg);
}

/* Closes r after checking every block came back and the pool's lists are consistent. */
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
    float logprobs[MAX_OUT];
    uint32_t n;
    bool finished;
    tdm_worker_finish_t why;
    uint32_t completion;
} out_t;

/* One request of a run. */
typedef struct req {
    int32_t prompt[PROMPT_CAP];
    uint32_t n_prompt;
    tdm_sampling_params_t sp;
    const tdm_grammar_t *grammar;
    bool no_spec;
} req_t;

/* The tokens of one step's events into outs[] (request k has id k + 1). */
static void record(const tdm_worker_event_t *ev, uint32_t n, out_t *outs)
{
    for (uint32_t i = 0; i < n; i++) {
        out_t *o = &outs[ev[i].seq_id - 1];
        switch (ev[i].kind) {
        case TDM_WORKER_EVENT_TOKEN:
            assert_int_equal(ev[i].index, o->n);
            assert_true(o->n < MAX_OUT);
            o->logprobs[o->n] = ev[i].sample.logprob;
            o->tokens[o->n++] = ev[i].sample.token;
            break;
        case TDM_WORKER_EVENT_FINISHED:
            o->finished = true;
            o->why = ev[i].finish;
            o->completion = ev[i].completion_tokens;
            break;
        default: fail_msg("unexpected event kind %d: %s", ev[i].kind, ev[i].message);
        }
    }
}

/* Adds reqs[0..n) to r and steps until idle; with one request and no prefix cache, checks
 * after every step that the pool holds exactly the blocks of the tokens computed (prompt +
 * output - 1): none stays taken for a rejected draft. */
static void run(rig_t *r, const req_t *reqs, uint32_t n, out_t *outs)
{
    for (uint32_t k = 0; k < n; k++) {
        tdm_worker_req_t wr = {.seq_id = (uint64_t)k + 1,
                               .prompt = reqs[k].prompt,
                               .n_prompt = reqs[k].n_prompt,
                               .sampling = &reqs[k].sp,
                               .grammar = reqs[k].grammar,
                               .no_speculation = reqs[k].no_spec};
        tdm_error_t err = {0};
        if (tdm_worker_add(r->w, &wr, &err) != 0)
            fail_msg("%s", err.msg);
    }
    for (uint64_t steps = 0; tdm_worker_busy(r->w); steps++) {
        assert_true(steps < 100000);
        const tdm_worker_event_t *ev;
        uint32_t n_ev;
        tdm_error_t err = {0};
        assert_int_equal(tdm_worker_step(r->w, &ev, &n_ev, &err), 0);
        record(ev, n_ev, outs);
        tdm_kv_stats_t st;
        tdm_kv_pool_stats(r->pool, &st);
        if (n == 1 && st.n_cached == 0 && !outs[0].finished)
            assert_int_equal(st.n_used, (reqs[0].n_prompt + outs[0].n - 1 + 15) / 16);
    }
}

/* The outputs of reqs with speculation at max_draft (0: off); worker stats in *st. */
static void outputs(fixture_t *fx, const rig_opts_t *base, uint32_t max_draft, const req_t *reqs,
                    uint32_t n, out_t *outs, tdm_worker_stats_t *st)
{
    rig_opts_t ro = *base;
    ro.max_draft = max_draft;
    rig_t r;
    rig_open(fx, &r, &ro);
    memset(outs, 0, n * sizeof *outs);
    run(&r, reqs, n, outs);
    tdm_worker_stats(r.w, st);
    rig_close(&r);
}

/* Runs reqs with speculation off and at max_draft 6: the same tokens, logprobs and endings. */
static void check_same(fixture_t *fx, const rig_opts_t *ro, const req_t *reqs, uint32_t n,
                       tdm_worker_stats_t *st_on)
{
    out_t off[N_SEQ + 2], on[N_SEQ + 2];
    tdm_worker_stats_t st_off;
    outputs(fx, ro, 0, reqs, n, off, &st_off);
    outputs(fx, ro, 6, reqs, n, on, st_on);
    assert_int_equal(st_off.spec_drafts, 0);
    for (uint32_t k = 0; k < n; k++) {
        assert_true(off[k].finished && on[k].finished);
        assert_int_equal(on[k].n, off[k].n);
        assert_memory_equal(on[k].tokens, off[k].tokens, off[k].n * sizeof(int32_t));
        assert_memory_equal(on[k].logprobs, off[k].logprobs, off[k].n * sizeof(float));
        assert_int_equal(on[k].why, off[k].why);
        assert_int_equal(on[k].completion, off[k].completion);
    }
    assert_true(st_on->spec_accepted_tokens <= st_on->spec_draft_tokens);
}

/* A prompt of 20 random tokens said four times (seed picks them): the context predicts its
 * continuation. */
static void repeating_prompt(req_t *q, uint32_t n_vocab, uint64_t seed)
{
    tdm_test_random_tokens(q->prompt, 20, n_vocab, seed);
    for (uint32_t i = 20; i < 80; i++)
        q->prompt[i] = q->prompt[i - 20];
    q->n_prompt = 80;
}

static void random_prompt(req_t *q, uint32_t n_vocab, uint32_t n, uint64_t seed)
{
    tdm_test_random_tokens(q->prompt, n, n_vocab, seed);
    q->n_prompt = n;
}

static void params(req_t *q, bool greedy, uint64_t seed, int32_t max_tokens)
{
    tdm_sampling_params_default(&q->sp);
    q->sp.temperature = greedy ? 0.0f : 0.9f;
    q->sp.seed = seed;
    q->sp.max_tokens = max_tokens;
    q->sp.ignore_eos = true;
}

static const rig_opts_t k_plain = {.n_blocks = 128, .max_running = 1, .dtype = TDM_KV_F16};

/* Greedy, one request at a time, repeating and random prompts: identical outputs, drafts
 * accepted on the repeating prompt, and (run's check) no block left over after any step. */
static void test_greedy_alone(void **state)
{
    fixture_t *fx = *state;
    tdm_worker_stats_t st;
    req_t q = {0};
    repeating_prompt(&q, fx->f.n_vocab, 11);
    params(&q, true, 1, 90);
    check_same(fx, &k_plain, &q, 1, &st);
    assert_true(st.spec_drafts > 0);
    assert_true(st.spec_accepted_tokens > 0);
    random_prompt(&q, fx->f.n_vocab, 9, 12);
    params(&q, true, 1, 60);
    check_same(fx, &k_plain, &q, 1, &st);
}

/* Seeded sampling with every penalty over a short window, top-k and top-p, and logprobs: the
 * (seed, index) draws and penalty windows are those of plain decoding. */
static void test_seeded_penalties(void **state)
{
    fixture_t *fx = *state;
    for (int k = 0; k < 3; k++) {
        req_t q = {0};
        if (k == 1)
            random_prompt(&q, fx->f.n_vocab, 30, 40);
        else
            repeating_prompt(&q, fx->f.n_vocab, 41 + (uint64_t)k);
        params(&q, false, 900 + (uint64_t)k, 80);
        q.sp.temperature = k == 2 ? 0.3f : 0.8f;
        q.sp.repetition_penalty = k == 2 ? 1.05f : 1.2f;
        q.sp.frequency_penalty = k == 2 ? 0.0f : 0.4f;
        q.sp.presence_penalty = k == 2 ? 0.05f : 0.2f;
        q.sp.penalty_last_n = k == 2 ? 3 : 12;
        q.sp.top_k = k == 2 ? 5 : 20;
        q.sp.top_p = 0.95f;
        q.sp.n_logprobs = 3;
        tdm_worker_stats_t st;
        check_same(fx, &k_plain, &q, 1, &st);
        if (k == 2) /* nearly greedy, a short window: the repeats survive the penalties */
            assert_true(st.spec_accepted_tokens > 0);
    }
}

/* A stop token taken from the plain run's output ends both runs at the same index; a
 * max_tokens inside a draft run cuts both at the same length. */
static void test_stop_and_length(void **state)
{
    fixture_t *fx = *state;
    req_t q = {0};
    repeating_prompt(&q, fx->f.n_vocab, 11);
    params(&q, true, 1, 90);
    out_t ref;
    tdm_worker_stats_t st;
    outputs(fx, &k_plain, 0, &q, 1, &ref, &st);
    q.sp.stop_token_ids[0] = ref.tokens[40];
    q.sp.n_stop_token_ids = 1;
    check_same(fx, &k_plain, &q, 1, &st);
    q.sp.n_stop_token_ids = 0;
    for (int32_t m = 1; m <= 9; m += 4) {
        q.sp.max_tokens = m;
        check_same(fx, &k_plain, &q, 1, &st);
    }
}

/* Six requests (repeating, random, greedy, seeded) batched in a pool small enough to preempt,
 * with the prefix cache on: identical outputs, every block back. */
static void test_batched_preempted(void **state)
{
    fixture_t *fx = *state;
    req_t reqs[N_SEQ] = {0};
    for (int k = 0; k < N_SEQ; k++) {
        if (k % 2 == 0)
            repeating_prompt(&reqs[k], fx->f.n_vocab, 60 + (uint64_t)(k % 4));
        else
            random_prompt(&reqs[k], fx->f.n_vocab, 5 + 11 * (uint32_t)k, 70 + (uint64_t)k);
        params(&reqs[k], k < 3, 300 + (uint64_t)k, 40 + 8 * k);
    }
    rig_opts_t ro = {.n_blocks = 24, .max_running = 4, .dtype = TDM_KV_F16, .prefix_caching = true};
    tdm_worker_stats_t st;
    check_same(fx, &ro, reqs, N_SEQ, &st);
    assert_true(st.preemptions > 0);
    assert_true(st.spec_accepted_tokens > 0);
}

/* A grammar-constrained request (greedy and sampled) with the matcher advanced on drawn
 * tokens only: identical outputs. */
static void test_constrained(void **state)
{
    fixture_t *fx = *state;
    static const char gbnf[] = "root ::= \"{\" ([a-c ] [a-c ] \"b\"){3,20} \"}\"\n";
    tdm_error_t err = {0};
    tdm_grammar_vocab_t *gv = tdm_grammar_vocab_new(fx->tok, &err);
    assert_non_null(gv);
    tdm_grammar_t *g = tdm_grammar_parse(gbnf, strlen(gbnf), NULL, &err);
    if (!g)
        fail_msg("%s", err.msg);
    rig_opts_t ro = k_plain;
    ro.gv = gv;
    for (int k = 0; k < 2; k++) {
        req_t q = {0};
        repeating_prompt(&q, fx->f.n_vocab, 80 + (uint64_t)k);
        params(&q, k == 0, 5, 80);
        q.sp.ignore_eos = false;
        q.grammar = g;
        tdm_worker_stats_t st;
        check_same(fx, &ro, &q, 1, &st);
    }
    tdm_grammar_destroy(&g);
    tdm_grammar_vocab_destroy(&gv);
}

/* q8 KV and a request's no_speculation turn drafting off. */
static void test_off(void **state)
{
    fixture_t *fx = *state;
    req_t q = {0};
    repeating_prompt(&q, fx->f.n_vocab, 11);
    params(&q, true, 1, 40);
    rig_opts_t ro = k_plain;
    ro.dtype = TDM_KV_Q8;
    out_t o;
    tdm_worker_stats_t st;
    outputs(fx, &ro, 6, &q, 1, &o, &st);
    assert_int_equal(st.spec_drafts, 0);
    assert_int_equal(o.n, 40);
    q.no_spec = true;
    outputs(fx, &k_plain, 6, &q, 1, &o, &st);
    assert_int_equal(st.spec_drafts, 0);
    q.no_spec = false;
    outputs(fx, &k_plain, 6, &q, 1, &o, &st);
    assert_true(st.spec_drafts > 0);
}

/* The logit rows an engine must take, and max_draft's bound. */
static void test_logit_rows(void **state)
{
    fixture_t *fx = *state;
    tdm_worker_opts_t o = {.mode = TDM_WORKER_MODE_DECODE, .max_running = 32, .max_draft = 4};
    assert_int_equal(tdm_worker_logit_rows(&o), 32 + TDM_WORKER_SPEC_SEQS * 4);
    o.max_running = 2;
    assert_int_equal(tdm_worker_logit_rows(&o), 2 + 2 * 4);
    o.mode = TDM_WORKER_MODE_PREFILL;
    assert_int_equal(tdm_worker_logit_rows(&o), 2);
    o.mode = TDM_WORKER_MODE_DECODE;
    o.max_draft = 0;
    assert_int_equal(tdm_worker_logit_rows(&o), 2);
    rig_t r = {0};
    rig_opts_t ro = k_plain;
    rig_open(fx, &r, &ro);
    tdm_worker_opts_t bad = {.mode = TDM_WORKER_MODE_DECODE,
                             .max_batch_tokens = 16,
                             .max_running = 1,
                             .n_ctx = 512,
                             .max_draft = TDM_WORKER_MAX_DRAFT + 1};
    tdm_error_t err = {0};
    assert_null(tdm_worker_new(r.engine, r.pool, fx->tok, fx->f.n_vocab, &bad, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "max_draft"));
    bad.max_draft = 4;
    bad.spec_row_cost = 11;
    assert_null(tdm_worker_new(r.engine, r.pool, fx->tok, fx->f.n_vocab, &bad, &err));
    assert_non_null(strstr(err.msg, "spec_row_cost (11)"));
    rig_close(&r);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_greedy_alone),    cmocka_unit_test(test_seeded_penalties),
        cmocka_unit_test(test_stop_and_length), cmocka_unit_test(test_batched_preempted),
        cmocka_unit_test(test_constrained),     cmocka_unit_test(test_off),
        cmocka_unit_test(test_logit_rows),
    };
    return cmocka_run_group_tests(tests, tdm_test_tok_engine_setup, tdm_test_tok_engine_teardown);
}
