/* test_kv_groups_engine.c - the CPU engine over a pool with layer groups (tdm_kv_pool_new_grouped)
 * gives the logits of the plain pool bit for bit: a gemma3-tiny made by `tandem model synth`
 * (6 layers, one full-attention, window 32) over prompts far past the window, prefilled in
 * uneven chunks then decoded greedily, with the window groups giving back their blocks as the
 * sequence grows; a prefix hit under the window rule; two sequences batched together; and the
 * engine's refusals (a given-back block a row would read, groups with the wrong windows). */
#include "tdm_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/gguf.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tiny_model.h"

enum { BS = 4, N_PROMPT = 150, N_GEN = 24, MAX_ROWS = 128, N_BLOCKS = 512 };

typedef struct fx {
    char dir[64], path[128];
    tdm_model_t *model;
    const tdm_llama_hparams_t *hp;
    tdm_kv_groups_t groups;
    tdm_kv_pool_t *plain, *grouped;
    tdm_engine_t *e_plain, *e_grouped;
    float *logits; /* [MAX_ROWS][n_vocab] */
} fx_t;

static fx_t F;

static tdm_engine_t *engine_ok(tdm_kv_pool_t *pool)
{
    tdm_engine_params_t p;
    tdm_engine_params_default(&p);
    p.max_batch_tokens = MAX_ROWS;
    p.max_logits = MAX_ROWS;
    p.n_ctx = 512;
    p.n_threads = 2;
    tdm_error_t err = {0};
    tdm_engine_t *e = tdm_engine_new(F.model, pool, &p, &err);
    if (!e)
        fail_msg("engine: %s", err.msg);
    return e;
}

static int setup(void **state)
{
    (void)state;
    snprintf(F.dir, sizeof F.dir, "/tmp/tdm-kvg-XXXXXX");
    tdm_error_t err = {0};
    if (tdm_test_synth_gemma3_tiny(TDM_CLI_PATH, F.dir, F.path, sizeof F.path, &err) != TDM_OK)
        fail_msg("gemma3-tiny: %s", err.msg);
    F.model = tdm_model_load(F.path, &err);
    if (!F.model)
        fail_msg("load: %s", err.msg);
    F.hp = tdm_model_hparams(F.model);
    assert_int_equal(F.hp->n_swa, 32);
    uint32_t windows[TDM_KV_MAX_LAYERS];
    for (uint32_t l = 0; l < F.hp->n_layers; l++)
        windows[l] = tdm_llama_layer_window(F.hp, l);
    assert_int_equal(tdm_kv_groups_init(&F.groups, F.hp->n_layers, windows, &err), TDM_OK);
    assert_int_equal(F.groups.n_groups, 6); /* 1 full + 5 window groups of one layer */
    tdm_kv_layout_t kl = {F.hp->n_layers, F.hp->n_kv_heads, F.hp->head_dim, BS, TDM_KV_F16};
    F.plain = tdm_kv_pool_new(&kl, N_BLOCKS, &err);
    F.grouped = tdm_kv_pool_new_grouped(&kl, &F.groups, N_BLOCKS, &err);
    assert_non_null(F.plain);
    assert_non_null(F.grouped);
    assert_non_null(tdm_kv_pool_groups(F.grouped));
    assert_int_equal(tdm_kv_pool_block_bytes(F.grouped) * 6, tdm_kv_pool_block_bytes(F.plain));
    F.e_plain = engine_ok(F.plain);
    F.e_grouped = engine_ok(F.grouped);
    F.logits = malloc((size_t)MAX_ROWS * F.hp->n_vocab * sizeof(float));
    assert_non_null(F.logits);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    free(F.logits);
    tdm_engine_destroy(&F.e_plain);
    tdm_engine_destroy(&F.e_grouped);
    tdm_kv_pool_destroy(&F.plain);
    tdm_kv_pool_destroy(&F.grouped);
    tdm_model_destroy(&F.model);
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", F.dir);
    return system(cmd) == 0 ? 0 : -1;
}

/* A sequence on one of the two pools: its tokens, and the logits of the last row of every
 * pass ([n_pass][n_vocab]). */
typedef struct run {
    bool grouped;
    tdm_kv_seq_t kv;   /* plain */
    tdm_kv_hseq_t hkv; /* grouped */
    const uint32_t *gb[TDM_KV_MAX_LAYERS];
    int32_t tokens[N_PROMPT + N_GEN + 1];
    uint32_t n_tokens, n_done;
    float *out;
    uint32_t n_out;
    uint64_t max_held; /* most blocks the sequence held after a commit */
} run_t;

static void run_init(run_t *r, bool grouped, const int32_t *prompt, uint32_t n)
{
    memset(r, 0, sizeof *r);
    r->grouped = grouped;
    tdm_kv_seq_init(&r->kv);
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_hseq_init(&r->hkv, &F.groups, &err), TDM_OK);
    memcpy(r->tokens, prompt, n * sizeof *prompt);
    r->n_tokens = n;
    r->out = calloc((size_t)64 * F.hp->n_vocab, sizeof(float));
    assert_non_null(r->out);
}

static void run_free(run_t *r)
{
    tdm_kv_seq_release(F.plain, &r->kv);
    tdm_kv_hseq_release(F.grouped, &r->hkv);
    free(r->out);
}

static tdm_batch_seq_t run_view(run_t *r)
{
    if (!r->grouped)
        return (tdm_batch_seq_t){r->kv.blocks, r->kv.n_blocks, NULL};
    for (uint32_t g = 0; g < F.groups.n_groups; g++)
        r->gb[g] = r->hkv.tab[g].blocks;
    return (tdm_batch_seq_t){NULL, r->hkv.tab[0].n_blocks, r->gb};
}

static void run_reserve(run_t *r, uint32_t m)
{
    int rc = r->grouped ? tdm_kv_hseq_reserve(F.grouped, &r->hkv, m)
                        : tdm_kv_seq_reserve(F.plain, &r->kv, m);
    assert_int_equal(rc, TDM_OK);
}

static void run_commit(run_t *r, uint32_t m)
{
    if (r->grouped) {
        tdm_kv_hseq_commit(F.grouped, &r->hkv, r->tokens, m);
        uint64_t held = tdm_kv_hseq_held(&r->hkv);
        r->max_held = held > r->max_held ? held : r->max_held;
    } else {
        tdm_kv_seq_commit(F.plain, &r->kv, r->tokens, m);
    }
    r->n_done = m;
}

/* One pass over the runs together: rows n_done .. n_done + chunk[i] - 1 of each (clipped to
 * its tokens), the last row of each asking for logits, kept in its out. */
static void pass(run_t **runs, uint32_t n_runs, const uint32_t *chunk)
{
    int32_t tok[MAX_ROWS];
    uint32_t pos[MAX_ROWS], seq[MAX_ROWS];
    bool want[MAX_ROWS];
    tdm_batch_seq_t views[4];
    uint32_t n = 0, ends[4];
    tdm_engine_t *e = runs[0]->grouped ? F.e_grouped : F.e_plain;
    for (uint32_t i = 0; i < n_runs; i++) {
        run_t *r = runs[i];
        uint32_t m = r->n_done + chunk[i] < r->n_tokens ? r->n_done + chunk[i] : r->n_tokens;
        run_reserve(r, m);
        views[i] = run_view(r);
        for (uint32_t p = r->n_done; p < m; p++, n++) {
            tok[n] = r->tokens[p];
            pos[n] = p;
            seq[n] = i;
            want[n] = p + 1 == m;
        }
        ends[i] = m;
    }
    tdm_batch_t b = {n, tok, pos, seq, want, n_runs, views};
    tdm_error_t err = {0};
    if (tdm_engine_forward(e, &b, F.logits, &err) != TDM_OK)
        fail_msg("forward: %s", err.msg);
    for (uint32_t i = 0, k = 0; i < n_runs; i++) {
        run_t *r = runs[i];
        if (ends[i] == r->n_done)
            continue; /* no rows this pass */
        assert_true(r->n_out < 64);
        memcpy(r->out + (size_t)r->n_out++ * F.hp->n_vocab, F.logits + (size_t)k++ * F.hp->n_vocab,
               F.hp->n_vocab * sizeof(float));
        run_commit(r, ends[i]);
    }
}

static int32_t argmax(const float *x, uint32_t n)
{
    uint32_t best = 0;
    for (uint32_t i = 1; i < n; i++)
        if (x[i] > x[best])
            best = i;
    return (int32_t)best;
}

/* Prefill in uneven chunks, then greedy decoding: every logit of every pass bit for bit. */
static void generate(run_t **runs, uint32_t n_runs)
{
    static const uint32_t chunks[] = {7, 33, 1, 64, 20, 25};
    for (size_t c = 0;; c++) {
        bool left = false;
        for (uint32_t i = 0; i < n_runs; i++)
            left = left || runs[i]->n_done < runs[i]->n_tokens;
        if (!left)
            break;
        uint32_t ch[4];
        for (uint32_t i = 0; i < n_runs; i++)
            ch[i] = chunks[(c + i) % 6];
        pass(runs, n_runs, ch);
    }
    for (uint32_t t = 0; t < N_GEN; t++) {
        uint32_t ones[4] = {1, 1, 1, 1};
        for (uint32_t i = 0; i < n_runs; i++) {
            run_t *r = runs[i];
            r->tokens[r->n_tokens++] =
                argmax(r->out + (size_t)(r->n_out - 1) * F.hp->n_vocab, F.hp->n_vocab);
        }
        pass(runs, n_runs, ones);
    }
}

static void prompt_of(int32_t *t, uint32_t n, uint64_t seed)
{
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = 10 + (int32_t)((seed >> 33) % 200);
    }
}

static void assert_same_logits(const run_t *a, const run_t *b)
{
    assert_int_equal(a->n_out, b->n_out);
    assert_memory_equal(a->out, b->out, (size_t)a->n_out * F.hp->n_vocab * sizeof(float));
    assert_memory_equal(a->tokens, b->tokens, a->n_tokens * sizeof(int32_t));
}

/* One sequence of 150 + 24 tokens (window 32): the same logits, and the grouped pool held at
 * most the formula's blocks (44 full + 5 x 9 window at 174 tokens) against 6 x 44. */
static void test_single_sequence(void **state)
{
    (void)state;
    int32_t prompt[N_PROMPT];
    prompt_of(prompt, N_PROMPT, 1);
    run_t *a = malloc(sizeof *a), *b = malloc(sizeof *b);
    run_init(a, false, prompt, N_PROMPT);
    run_init(b, true, prompt, N_PROMPT);
    generate(&a, 1);
    generate(&b, 1);
    assert_same_logits(a, b);
    uint32_t n = N_PROMPT + N_GEN;
    assert_int_equal(tdm_kv_hseq_held(&b->hkv), tdm_kv_group_live(&F.groups, 0, BS, n, n) +
                                                    5 * tdm_kv_group_live(&F.groups, 1, BS, n, n));
    assert_int_equal(tdm_kv_hseq_held(&b->hkv), 44 + 5 * 9);
    assert_true(b->max_held < 6 * 44);
    run_free(a);
    run_free(b);
    free(a);
    free(b);
}

/* Two sequences in one batch, then a third sharing the first's prompt: a prefix hit whose
 * window blocks are still held (or cached), the same logits as computing it all. */
static void test_batched_and_prefix_hit(void **state)
{
    (void)state;
    int32_t p1[N_PROMPT], p2[N_PROMPT];
    prompt_of(p1, N_PROMPT, 2);
    prompt_of(p2, N_PROMPT, 3);
    run_t *a[2], *b[2];
    for (int i = 0; i < 2; i++) {
        a[i] = malloc(sizeof *a[i]);
        b[i] = malloc(sizeof *b[i]);
        run_init(a[i], false, i ? p2 : p1, N_PROMPT);
        run_init(b[i], true, i ? p2 : p1, N_PROMPT);
    }
    generate(a, 2);
    generate(b, 2);
    assert_same_logits(a[0], b[0]);
    assert_same_logits(a[1], b[1]);
    /* the third: p1 again; prefix caching takes all but the last (partial) block */
    run_t *c = malloc(sizeof *c), *d = malloc(sizeof *d);
    run_init(c, false, p1, N_PROMPT);
    run_init(d, true, p1, N_PROMPT);
    uint32_t hit = tdm_kv_hseq_match_prefix(F.grouped, &d->hkv, d->tokens, N_PROMPT);
    assert_int_equal(hit, (N_PROMPT - 1) / BS * BS);
    assert_int_equal(d->hkv.tab[1].n_dropped, (hit + 1 - 32) / BS);
    d->n_done = hit;
    generate(&c, 1);
    generate(&d, 1);
    /* d skipped the passes over its prefix: its first pass is c's last prefill pass */
    assert_memory_equal(c->out + (size_t)(c->n_out - N_GEN - 1) * F.hp->n_vocab, d->out,
                        (size_t)(N_GEN + 1) * F.hp->n_vocab * sizeof(float));
    assert_memory_equal(c->tokens, d->tokens, c->n_tokens * sizeof(int32_t));
    run_t *all[] = {a[0], a[1], b[0], b[1], c, d};
    for (int i = 0; i < 6; i++) {
        run_free(all[i]);
        free(all[i]);
    }
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_pool_check(F.grouped, &err), TDM_OK);
}

/* A row whose window reads a given-back block, a missing group table, and groups whose windows
 * are not the model's are refused with the field named. */
static void test_refusals(void **state)
{
    (void)state;
    int32_t prompt[80];
    prompt_of(prompt, 80, 4);
    run_t *r = malloc(sizeof *r);
    run_init(r, true, prompt, 80);
    uint32_t one[1] = {80};
    pass(&r, 1, one); /* 80 tokens; window blocks before (81 - 32) / 4 = 12 given back */
    assert_int_equal(r->hkv.tab[1].n_dropped, 12);
    /* recompute position 40 over the same table: its window reads keys 9.. (block 2) */
    int32_t tok = prompt[40];
    uint32_t pos = 40, seq = 0;
    tdm_batch_seq_t v = run_view(r);
    tdm_batch_t b = {1, &tok, &pos, &seq, NULL, 1, &v};
    tdm_error_t err = {0};
    assert_int_equal(tdm_engine_forward(F.e_grouped, &b, F.logits, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "entry 2"));
    v.group_blocks = NULL;
    pos = 79;
    assert_int_equal(tdm_engine_forward(F.e_grouped, &b, F.logits, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "group_blocks is required"));
    run_free(r);
    free(r);
    /* groups of a model whose layers all attend to every key */
    tdm_kv_groups_t wrong;
    uint32_t w[TDM_KV_MAX_LAYERS] = {0};
    w[0] = 16;
    w[1] = 16;
    w[2] = 16;
    assert_int_equal(tdm_kv_groups_init(&wrong, F.hp->n_layers, w, &err), TDM_OK);
    tdm_kv_layout_t kl = {F.hp->n_layers, F.hp->n_kv_heads, F.hp->head_dim, BS, TDM_KV_F16};
    tdm_kv_pool_t *pool = tdm_kv_pool_new_grouped(&kl, &wrong, 8, &err);
    assert_non_null(pool);
    tdm_engine_params_t p;
    tdm_engine_params_default(&p);
    p.n_ctx = 512;
    assert_null(tdm_engine_new(F.model, pool, &p, &err));
    assert_non_null(strstr(err.msg, "layer 0 is in a group of window 16"));
    tdm_kv_pool_destroy(&pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_single_sequence),
        cmocka_unit_test(test_batched_and_prefix_hit),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
