/* test_kv_hybrid.c - KV allocation per layer group (tandem/kv.h "layer groups"): the layer
 * partition of Gemma 3 shapes, the per-group block formula against a brute force, block
 * tables that hold exactly the formula's blocks through prefill chunks and decode, the prefix
 * rule for window groups, one group being the single-group allocator block for block, and a
 * seeded random stress with the pool's invariants checked after every operation. */
#include "tdm_test.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/kv.h"

static void check_pool(const tdm_kv_pool_t *pool)
{
    tdm_error_t err = {0};
    if (tdm_kv_pool_check(pool, &err) != TDM_OK)
        fail_msg("pool inconsistent: %s", err.msg);
}

static tdm_kv_pool_t *pool_new_ok(tdm_kv_layout_t l, uint32_t n_blocks)
{
    tdm_error_t err = {0};
    tdm_kv_pool_t *pool = tdm_kv_pool_new(&l, n_blocks, &err);
    if (!pool)
        fail_msg("tdm_kv_pool_new: %s", err.msg);
    return pool;
}

static void groups_ok(tdm_kv_groups_t *g, uint32_t n_layers, const uint32_t *windows)
{
    tdm_error_t err = {0};
    if (tdm_kv_groups_init(g, n_layers, windows, &err) != TDM_OK)
        fail_msg("tdm_kv_groups_init: %s", err.msg);
}

/* Gemma 3's pattern: every sixth layer (5, 11, ...) full attention, the others window w. */
static void gemma3_windows(uint32_t *windows, uint32_t n_layers, uint32_t w)
{
    for (uint32_t l = 0; l < n_layers; l++)
        windows[l] = l % 6 == 5 ? 0 : w;
}

static void hseq_init_ok(tdm_kv_hseq_t *hs, const tdm_kv_groups_t *g)
{
    tdm_error_t err = {0};
    if (tdm_kv_hseq_init(hs, g, &err) != TDM_OK)
        fail_msg("tdm_kv_hseq_init: %s", err.msg);
}

/* Every group of hs holds exactly the formula's blocks for its n_tokens and table length. */
static void check_formula(const tdm_kv_hseq_t *hs, uint32_t bs)
{
    const tdm_kv_groups_t *g = hs->groups;
    uint64_t sum = 0;
    for (uint32_t gi = 0; gi < g->n_groups; gi++) {
        const tdm_kv_seq_t *t = &hs->tab[gi];
        uint64_t want = tdm_kv_group_live(g, gi, bs, hs->n_tokens, (uint64_t)t->n_blocks * bs);
        assert_int_equal(t->n_blocks - t->n_dropped, want);
        for (uint32_t i = 0; i < t->n_blocks; i++)
            assert_true((i < t->n_dropped) == (t->blocks[i] == TDM_KV_NO_BLOCK));
        sum += want;
    }
    assert_int_equal(tdm_kv_hseq_held(hs), sum);
}

/* ---- partition ---- */

static void test_groups_gemma3(void **state)
{
    (void)state;
    uint32_t w[26];
    tdm_kv_groups_t g;
    /* Gemma 3 270M: 18 layers, 3 full (5, 11, 17): 3 layers a group, 1 full + 5 window. */
    gemma3_windows(w, 18, 512);
    groups_ok(&g, 18, w);
    assert_int_equal(g.layers_per_group, 3);
    assert_int_equal(g.n_groups, 6);
    assert_int_equal(g.n_full, 1);
    assert_int_equal(g.window[0], 0);
    for (uint32_t gi = 1; gi < 6; gi++)
        assert_int_equal(g.window[gi], 512);
    const uint32_t full[] = {5, 11, 17};
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(g.group_of[full[i]], 0);
        assert_int_equal(g.slot_of[full[i]], i);
    }
    /* window layers in order: 0 1 2 | 3 4 6 | 7 8 9 | 10 12 13 | 14 15 16 */
    assert_int_equal(g.group_of[0], 1);
    assert_int_equal(g.group_of[6], 2);
    assert_int_equal(g.slot_of[6], 2);
    assert_int_equal(g.group_of[12], 4);
    assert_int_equal(g.slot_of[12], 1);
    assert_int_equal(g.group_of[16], 5);
    assert_int_equal(g.slot_of[16], 2);
    /* Gemma 3 1B: 26 layers, 4 full, 22 window: gcd 2, 2 full + 11 window groups. */
    gemma3_windows(w, 26, 512);
    groups_ok(&g, 26, w);
    assert_int_equal(g.layers_per_group, 2);
    assert_int_equal(g.n_groups, 13);
    assert_int_equal(g.n_full, 2);
    assert_int_equal(g.group_of[5], 0);
    assert_int_equal(g.group_of[11], 0);
    assert_int_equal(g.group_of[17], 1);
    assert_int_equal(g.slot_of[23], 1);
    /* Every (group, slot) is one layer's. */
    bool seen[13][2] = {{false}};
    for (uint32_t l = 0; l < 26; l++) {
        assert_false(seen[g.group_of[l]][g.slot_of[l]]);
        seen[g.group_of[l]][g.slot_of[l]] = true;
        assert_int_equal(g.window[g.group_of[l]], w[l]);
    }
}

static void test_groups_single_and_errors(void **state)
{
    (void)state;
    tdm_kv_groups_t g;
    groups_ok(&g, 30, NULL); /* SmolLM2: no windows */
    assert_int_equal(g.n_groups, 1);
    assert_int_equal(g.layers_per_group, 30);
    assert_int_equal(g.n_full, 1);
    const tdm_kv_layout_t smol = {30, 3, 64, 16, TDM_KV_F16};
    tdm_kv_layout_t gl = tdm_kv_group_layout(&smol, &g);
    assert_memory_equal(&gl, &smol, sizeof gl); /* one group: the same blocks */
    tdm_error_t perr = {0};
    tdm_kv_pool_t *plain = tdm_kv_pool_new_grouped(&smol, &g, 4, &perr);
    assert_non_null(plain);
    assert_null(tdm_kv_pool_groups(plain)); /* the plain pool */
    assert_int_equal(tdm_kv_pool_block_bytes(plain), tdm_kv_block_bytes(&smol));
    tdm_kv_pool_destroy(&plain);
    const tdm_kv_layout_t other = {12, 3, 64, 16, TDM_KV_F16};
    assert_null(tdm_kv_pool_new_grouped(&other, &g, 4, &perr));
    assert_int_equal(perr.code, TDM_EINVALID);
    assert_non_null(strstr(perr.msg, "n_layers 12"));
    uint32_t all[4] = {4096, 4096, 4096, 4096}; /* one window everywhere (Mistral-style) */
    groups_ok(&g, 4, all);
    assert_int_equal(g.n_groups, 1);
    assert_int_equal(g.n_full, 0);
    assert_int_equal(g.window[0], 4096);
    uint32_t two[6] = {0, 8, 8, 0, 32, 32}; /* two windows: kinds 2/2/2, gcd 2 */
    groups_ok(&g, 6, two);
    assert_int_equal(g.n_groups, 3);
    assert_int_equal(g.window[0], 0);
    assert_int_equal(g.window[1], 8);
    assert_int_equal(g.window[2], 32);
    assert_int_equal(g.group_of[3], 0);
    assert_int_equal(g.slot_of[3], 1);
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_groups_init(&g, 0, NULL, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_layers"));
    assert_int_equal(tdm_kv_groups_init(&g, TDM_KV_MAX_LAYERS + 1, NULL, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "513"));
}

/* Gemma 3 270M at f16 (1 KV head, head_dim 256): 1,024 B per token per layer, so a 16-token
 * block of 3 layers is 49,152 B; an 8,192-token sequence is 512 full-group blocks and 33 per
 * window group, 677 blocks (33,275,904 B) against 18 layers x 8,192 x 1,024 = 150,994,944 B. */
static void test_formula_gemma3(void **state)
{
    (void)state;
    uint32_t w[18];
    gemma3_windows(w, 18, 512);
    tdm_kv_groups_t g;
    groups_ok(&g, 18, w);
    const tdm_kv_layout_t l = {18, 1, 256, 16, TDM_KV_F16};
    tdm_kv_layout_t gl = tdm_kv_group_layout(&l, &g);
    assert_int_equal(tdm_kv_block_bytes(&gl), 49152);
    assert_int_equal(tdm_kv_group_peak(&g, 0, 16, 8192), 512);
    assert_int_equal(tdm_kv_group_peak(&g, 1, 16, 8192), 33);
    assert_int_equal(tdm_kv_groups_blocks_per_seq(&g, 16, 8192), 512 + 5 * 33);
    assert_int_equal(tdm_kv_groups_blocks_per_seq(&g, 16, 32768), 2048 + 5 * 33);
    assert_int_equal(tdm_kv_groups_blocks_per_seq(&g, 16, 100), 6 * 7); /* inside the window */
    assert_int_equal(677 * tdm_kv_block_bytes(&gl), 33275904);
    assert_int_equal(tdm_kv_blocks_for_tokens(&l, 8192) * tdm_kv_block_bytes(&l), 150994944);
    /* live: n computed, m reserved */
    assert_int_equal(tdm_kv_group_live(&g, 1, 16, 511, 512), 32);   /* nothing given back */
    assert_int_equal(tdm_kv_group_live(&g, 1, 16, 512, 513), 33);   /* key 1 .. 512 */
    assert_int_equal(tdm_kv_group_live(&g, 1, 16, 527, 528), 32);   /* key 16 .. 527 */
    assert_int_equal(tdm_kv_group_live(&g, 1, 16, 528, 529), 33);   /* key 17: block 1 on */
    assert_int_equal(tdm_kv_group_live(&g, 1, 16, 1000, 1000), 33); /* blocks 30 .. 62 */
    assert_int_equal(tdm_kv_group_live(&g, 0, 16, 1000, 1001), 63);
}

/* The peak against a brute force over every step, and its closed form once C passes the
 * window: min(ceil(C / bs), ceil((W - 1) / bs) + 1). */
static void test_peak_brute_force(void **state)
{
    (void)state;
    const uint32_t bss[] = {1, 4, 16};
    const uint32_t ws[] = {1, 2, 5, 16, 17, 31, 32, 33, 100};
    for (size_t a = 0; a < 3; a++)
        for (size_t b = 0; b < sizeof ws / sizeof ws[0]; b++) {
            uint32_t win[2] = {0, ws[b]};
            tdm_kv_groups_t g;
            groups_ok(&g, 2, win);
            uint32_t bs = bss[a], w = ws[b];
            uint64_t peak = 0;
            for (uint64_t c = 1; c <= 300; c++) {
                uint64_t v = tdm_kv_group_live(&g, 1, bs, c - 1, c);
                peak = v > peak ? v : peak;
                assert_int_equal(tdm_kv_group_peak(&g, 1, bs, c), peak);
                uint64_t cf = (c + bs - 1) / bs, wf = (w - 1 + bs - 1) / bs + 1;
                if (c >= (uint64_t)w + bs)
                    assert_int_equal(peak, cf < wf ? cf : wf);
            }
        }
}

/* ---- capacity plans ---- */

static tdm_kv_plan_t plan_ok(const tdm_kv_plan_in_t *in)
{
    tdm_kv_plan_t out;
    tdm_error_t err = {0};
    if (tdm_kv_plan(in, &out, &err) != TDM_OK)
        fail_msg("tdm_kv_plan: %s", err.msg);
    return out;
}

/* Gemma 3 270M Q4_K_M as a CPU node measures it (weights 178,995,712 B, scratch 368,475,584 B)
 * in a 2 GiB budget: 10 concurrent 8k sequences with every layer holding every token, 48 with
 * per-group allocation (14 instead of 2 at 32k). One group plans exactly as no groups. */
static void test_plan_groups(void **state)
{
    (void)state;
    uint32_t w[18];
    gemma3_windows(w, 18, 512);
    tdm_kv_groups_t g, one;
    groups_ok(&g, 18, w);
    groups_ok(&one, 18, NULL);
    tdm_kv_plan_in_t in = {.layout = {18, 1, 256, 16, TDM_KV_F16},
                           .n_heads = 4,
                           .n_ctx = 8192,
                           .n_users = 1,
                           .weight_bytes = 178995712,
                           .scratch_bytes = 368475584,
                           .have_memory = true,
                           .memory_bytes = 2147483648u};
    tdm_kv_plan_t before = plan_ok(&in);
    assert_int_equal(before.block_bytes, 294912);
    assert_int_equal(before.blocks_per_seq, 512);
    assert_int_equal(before.pool_blocks, 5425);
    assert_int_equal(before.max_seqs, 10);
    in.groups = &one;
    tdm_kv_plan_t same = plan_ok(&in);
    assert_memory_equal(&same, &before, sizeof same);
    in.groups = &g;
    tdm_kv_plan_t after = plan_ok(&in);
    assert_int_equal(after.bytes_per_token, 18432); /* every layer's, as before */
    assert_int_equal(after.block_bytes, 49152);
    assert_int_equal(after.blocks_per_seq, 677);
    assert_int_equal(after.bytes_per_seq, 33275904);
    assert_int_equal(after.pool_budget_bytes, 1600012352);
    assert_int_equal(after.pool_blocks, 32552);
    assert_int_equal(after.pool_tokens, 32552 / 6 * 16);
    assert_int_equal(after.max_seqs, 48);
    in.n_ctx = 32768;
    after = plan_ok(&in);
    assert_int_equal(after.blocks_per_seq, 2048 + 5 * 33);
    assert_int_equal(after.max_seqs, 14);
    in.groups = NULL;
    assert_int_equal(plan_ok(&in).max_seqs, 2);
    /* the budget a node needs for a pool inverts the plan with the group layout */
    tdm_kv_layout_t gl = tdm_kv_group_layout(&in.layout, &g);
    uint64_t budget;
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_plan_budget(&gl, 32552, 178995712 + 368475584, &budget, &err), TDM_OK);
    assert_true(budget <= 2147483648u && 2147483648u - budget < 49152);
    /* groups of another model are refused */
    groups_ok(&one, 30, NULL);
    in.groups = &one;
    tdm_kv_plan_t bad;
    assert_int_equal(tdm_kv_plan(&in, &bad, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_layers 18"));
}

/* ---- the allocator follows the formula ---- */

/* Prefill in chunks, then decode: after every reserve and every commit each group holds
 * exactly tdm_kv_group_live's blocks; the pool's used blocks are the sequence's. */
static void test_blocks_follow_formula(void **state)
{
    (void)state;
    uint32_t w[18];
    gemma3_windows(w, 18, 32);
    tdm_kv_groups_t g;
    groups_ok(&g, 18, w);
    const tdm_kv_layout_t l = {18, 1, 256, 4, TDM_KV_F16};
    tdm_kv_layout_t gl = tdm_kv_group_layout(&l, &g);
    tdm_kv_pool_t *pool = pool_new_ok(gl, 512);
    int32_t tokens[400];
    for (int i = 0; i < 400; i++)
        tokens[i] = 1000 + i;
    tdm_kv_hseq_t hs;
    hseq_init_ok(&hs, &g);
    assert_int_equal(tdm_kv_hseq_prepare(pool, &hs, 400), TDM_OK);
    const uint32_t chunks[] = {7, 50, 1, 33, 64, 9};
    uint32_t n = 0;
    uint64_t peak = 0;
    for (size_t c = 0; n < 400; c++) {
        uint32_t step = c < 6 ? chunks[c] : 1;
        uint32_t m = n + step;
        assert_int_equal(tdm_kv_hseq_reserve(pool, &hs, m), TDM_OK);
        check_formula(&hs, 4);
        tdm_kv_stats_t s;
        tdm_kv_pool_stats(pool, &s);
        assert_int_equal(s.n_used, tdm_kv_hseq_held(&hs));
        if (c >= 6)
            peak = tdm_kv_hseq_held(&hs) > peak ? tdm_kv_hseq_held(&hs) : peak;
        tdm_kv_hseq_commit(pool, &hs, tokens, m);
        check_formula(&hs, 4);
        check_pool(pool);
        n = m;
    }
    /* decoding to 400: 100 full blocks + 5 groups of ceil(31 / 4) + 1 = 9 */
    assert_int_equal(peak, tdm_kv_groups_blocks_per_seq(&g, 4, 400));
    assert_int_equal(peak, 100 + 5 * 9);
    tdm_kv_hseq_release(pool, &hs);
    tdm_kv_stats_t s;
    tdm_kv_pool_stats(pool, &s);
    assert_int_equal(s.n_used, 0);
    check_pool(pool);
    tdm_kv_pool_destroy(&pool);
}

/* A reserve the pool cannot serve takes nothing; clear (preemption) gives everything back and
 * the recompute finds the prefix again. */
static void test_reserve_all_or_nothing_and_clear(void **state)
{
    (void)state;
    uint32_t w[2] = {0, 8};
    tdm_kv_groups_t g;
    groups_ok(&g, 2, w);
    const tdm_kv_layout_t gl = {1, 1, 4, 4, TDM_KV_F32};
    tdm_kv_pool_t *pool = pool_new_ok(gl, 10);
    int32_t tokens[64];
    for (int i = 0; i < 64; i++)
        tokens[i] = i * 7;
    tdm_kv_hseq_t hs;
    hseq_init_ok(&hs, &g);
    assert_int_equal(tdm_kv_hseq_reserve(pool, &hs, 21), TDM_ERESOURCE); /* 2 x 6 > 10 */
    assert_int_equal(tdm_kv_hseq_held(&hs), 0);
    assert_int_equal(tdm_kv_pool_available(pool), 10);
    assert_int_equal(tdm_kv_hseq_reserve(pool, &hs, 20), TDM_OK); /* 2 x 5 */
    tdm_kv_hseq_commit(pool, &hs, tokens, 20);
    /* next query at 20 reads keys 13..20: window blocks 3, 4 kept, 0..2 given back (cached) */
    assert_int_equal(hs.tab[1].n_dropped, 3);
    assert_int_equal(tdm_kv_hseq_held(&hs), 7);
    assert_int_equal(tdm_kv_hseq_reserve(pool, &hs, 21), TDM_OK); /* 2 more of 3 available */
    tdm_kv_hseq_commit(pool, &hs, tokens, 21);
    check_formula(&hs, 4);
    check_pool(pool);
    tdm_kv_hseq_clear(pool, &hs);
    assert_int_equal(tdm_kv_hseq_held(&hs), 0);
    assert_int_equal(hs.n_tokens, 0);
    check_pool(pool);
    /* recompute: the 5 full blocks are cached in both groups except window blocks 0..2 */
    assert_int_equal(tdm_kv_hseq_match_prefix(pool, &hs, tokens, 21), 20);
    check_formula(&hs, 4);
    tdm_kv_hseq_release(pool, &hs);
    check_pool(pool);
    tdm_kv_pool_destroy(&pool);
}

/* ---- prefix caching ---- */

/* A cached prefix is reused only where every window group still has the blocks the first
 * query after it reads. */
static void test_prefix_window_rule(void **state)
{
    (void)state;
    uint32_t w[2] = {0, 8};
    tdm_kv_groups_t g;
    groups_ok(&g, 2, w);
    const tdm_kv_layout_t gl = {1, 1, 4, 4, TDM_KV_F32};
    tdm_kv_pool_t *pool = pool_new_ok(gl, 20);
    int32_t tokens[41];
    for (int i = 0; i < 41; i++)
        tokens[i] = 5 + 3 * i;
    tdm_kv_hseq_t a, b;
    hseq_init_ok(&a, &g);
    hseq_init_ok(&b, &g);
    assert_int_equal(tdm_kv_hseq_reserve(pool, &a, 40), TDM_OK);
    tdm_kv_hseq_commit(pool, &a, tokens, 40);
    assert_int_equal(a.tab[1].n_dropped, 8); /* keys 33..40: window blocks 8, 9 */
    tdm_kv_stats_t s;
    tdm_kv_pool_stats(pool, &s);
    assert_int_equal(s.n_used, 12);
    assert_int_equal(s.n_cached, 8);
    /* B shares 20 tokens: 5 full blocks live, window blocks 3, 4 cached: a hit of 20 */
    assert_int_equal(tdm_kv_hseq_match_prefix(pool, &b, tokens, 21), 20);
    assert_int_equal(b.tab[1].n_dropped, 3);
    assert_int_equal(b.tab[1].blocks[2], TDM_KV_NO_BLOCK);
    assert_int_equal(tdm_kv_pool_refcount(pool, b.tab[1].blocks[3]), 1); /* revived */
    assert_int_equal(b.tab[0].blocks[4], a.tab[0].blocks[4]);
    check_formula(&b, 4);
    tdm_kv_hseq_release(pool, &b);
    hseq_init_ok(&b, &g);
    /* evict the 8 given-back window blocks (least recently freed first) */
    uint32_t hold[8];
    assert_int_equal(tdm_kv_pool_alloc(pool, 8, hold), TDM_OK);
    tdm_kv_pool_stats(pool, &s);
    assert_int_equal(s.n_cached, 0);
    /* the same 20-token prefix: every full block is there, but no k <= 5 has its window */
    uint64_t q0 = s.prefix_queries, h0 = s.prefix_hits;
    assert_int_equal(tdm_kv_hseq_match_prefix(pool, &b, tokens, 21), 0);
    assert_int_equal(tdm_kv_hseq_held(&b), 0);
    tdm_kv_pool_stats(pool, &s);
    assert_int_equal(s.prefix_queries - q0, 5);
    assert_int_equal(s.prefix_hits - h0, 0);
    /* the whole 40: the window A still holds (blocks 8, 9) serves a 10-block hit */
    assert_int_equal(tdm_kv_hseq_match_prefix(pool, &b, tokens, 41), 40);
    assert_int_equal(b.tab[1].n_dropped, 8);
    assert_int_equal(b.tab[1].blocks[9], a.tab[1].blocks[9]);
    assert_int_equal(tdm_kv_pool_refcount(pool, a.tab[1].blocks[9]), 2);
    check_formula(&b, 4);
    check_pool(pool);
    for (int i = 0; i < 8; i++)
        tdm_kv_pool_unref(pool, hold[i]);
    tdm_kv_hseq_release(pool, &a);
    tdm_kv_hseq_release(pool, &b);
    check_pool(pool);
    tdm_kv_pool_destroy(&pool);
}

/* ---- one group is the single-group allocator ---- */

/* Runs the same operations on a tdm_kv_seq over one pool and a one-group tdm_kv_hseq over
 * another: same blocks, same counters, at every step. */
static void test_one_group_is_single_group(void **state)
{
    (void)state;
    tdm_kv_groups_t g;
    groups_ok(&g, 30, NULL);
    const tdm_kv_layout_t l = {30, 3, 64, 4, TDM_KV_F16};
    tdm_kv_pool_t *p1 = pool_new_ok(l, 24);
    tdm_kv_pool_t *p2 = pool_new_ok(tdm_kv_group_layout(&l, &g), 24);
    assert_int_equal(tdm_kv_pool_block_bytes(p1), tdm_kv_pool_block_bytes(p2));
    uint64_t rng = 12345;
    enum { N = 4 };
    tdm_kv_seq_t s1[N];
    tdm_kv_hseq_t s2[N];
    int32_t tok[N][80];
    uint32_t len[N] = {0};
    for (int i = 0; i < N; i++) {
        tdm_kv_seq_init(&s1[i]);
        hseq_init_ok(&s2[i], &g);
    }
    for (int step = 0; step < 3000; step++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        uint32_t r = (uint32_t)(rng >> 33);
        int i = (int)(r % N);
        if (len[i] == 0) { /* a new prompt sharing a prefix */
            len[i] = 10 + r % 70;
            for (uint32_t t = 0; t < 80; t++)
                tok[i][t] = t < (r >> 8) % 40 ? (int32_t)t : (int32_t)(r + t);
            uint32_t a = tdm_kv_seq_match_prefix(p1, &s1[i], tok[i], len[i]);
            assert_int_equal(tdm_kv_hseq_match_prefix(p2, &s2[i], tok[i], len[i]), a);
        } else if ((r >> 12) % 7 == 0 || s1[i].n_tokens >= len[i]) {
            if ((r >> 16) & 1) {
                tdm_kv_seq_clear(p1, &s1[i]);
                tdm_kv_hseq_clear(p2, &s2[i]);
            } else {
                tdm_kv_seq_release(p1, &s1[i]);
                tdm_kv_hseq_release(p2, &s2[i]);
                hseq_init_ok(&s2[i], &g);
            }
            len[i] = 0;
        } else {
            uint32_t m = s1[i].n_tokens + 1 + (r >> 20) % 9;
            m = m > len[i] ? len[i] : m;
            int rc = tdm_kv_seq_reserve(p1, &s1[i], m);
            assert_int_equal(tdm_kv_hseq_reserve(p2, &s2[i], m), rc);
            if (rc == TDM_OK) {
                tdm_kv_seq_commit(p1, &s1[i], tok[i], m);
                tdm_kv_hseq_commit(p2, &s2[i], tok[i], m);
            }
        }
        assert_int_equal(s2[i].tab[0].n_blocks, s1[i].n_blocks);
        for (uint32_t k = 0; k < s1[i].n_blocks; k++)
            assert_int_equal(s2[i].tab[0].blocks[k], s1[i].blocks[k]);
        assert_int_equal(s2[i].n_tokens, s1[i].n_tokens);
        tdm_kv_stats_t a, b;
        tdm_kv_pool_stats(p1, &a);
        tdm_kv_pool_stats(p2, &b);
        assert_memory_equal(&a, &b, sizeof a);
    }
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(p1, &st);
    assert_true(st.prefix_hits > 500 && st.evictions > 500); /* both paths exercised */
    check_pool(p1);
    check_pool(p2);
    for (int i = 0; i < N; i++) {
        tdm_kv_seq_release(p1, &s1[i]);
        tdm_kv_hseq_release(p2, &s2[i]);
    }
    tdm_kv_pool_destroy(&p1);
    tdm_kv_pool_destroy(&p2);
}

/* ---- stress ---- */

/* Several sequences over a small pool with shared prefixes, chunks, preemption and releases:
 * the pool stays consistent, every sequence holds the formula's blocks, and every block a
 * sequence holds has a reference from it. */
static void test_stress(void **state)
{
    (void)state;
    uint32_t w[12];
    gemma3_windows(w, 12, 10);
    tdm_kv_groups_t g;
    groups_ok(&g, 12, w);
    const tdm_kv_layout_t l = {12, 1, 4, 4, TDM_KV_F32};
    tdm_kv_pool_t *pool = pool_new_ok(tdm_kv_group_layout(&l, &g), 60);
    enum { N = 5 };
    tdm_kv_hseq_t s[N];
    int32_t tok[N][120];
    uint32_t len[N] = {0};
    for (int i = 0; i < N; i++)
        hseq_init_ok(&s[i], &g);
    uint64_t rng = 987654321, hits = 0;
    for (int step = 0; step < 20000; step++) {
        rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
        uint32_t r = (uint32_t)(rng >> 33);
        int i = (int)(r % N);
        if (len[i] == 0) { /* a new prompt */
            len[i] = 2 + r % 118;
            for (uint32_t t = 0; t < 120; t++)
                tok[i][t] = t < (r >> 8) % 100 ? (int32_t)(t * 3) : (int32_t)(r + t);
            hits += tdm_kv_hseq_match_prefix(pool, &s[i], tok[i], len[i]) > 0;
        } else if ((r >> 12) % 11 == 0 || s[i].n_tokens >= len[i]) {
            tdm_kv_hseq_clear(pool, &s[i]); /* finished or preempted */
            len[i] = 0;
        } else {
            uint32_t m = s[i].n_tokens + 1 + (r >> 20) % 12;
            m = m > len[i] ? len[i] : m;
            if (tdm_kv_hseq_reserve(pool, &s[i], m) == TDM_OK)
                tdm_kv_hseq_commit(pool, &s[i], tok[i], m);
        }
        check_formula(&s[i], 4);
        if (step % 16 == 0) {
            check_pool(pool);
            uint64_t held = 0;
            for (int j = 0; j < N; j++)
                held += tdm_kv_hseq_held(&s[j]);
            tdm_kv_stats_t st;
            tdm_kv_pool_stats(pool, &st);
            assert_true(st.n_used <= held); /* shared prefix blocks count once */
        }
    }
    assert_true(hits > 500);
    for (int i = 0; i < N; i++)
        tdm_kv_hseq_release(pool, &s[i]);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    assert_int_equal(st.n_used, 0);
    check_pool(pool);
    tdm_kv_pool_destroy(&pool);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_groups_gemma3),
        cmocka_unit_test(test_groups_single_and_errors),
        cmocka_unit_test(test_formula_gemma3),
        cmocka_unit_test(test_peak_brute_force),
        cmocka_unit_test(test_plan_groups),
        cmocka_unit_test(test_blocks_follow_formula),
        cmocka_unit_test(test_reserve_all_or_nothing_and_clear),
        cmocka_unit_test(test_prefix_window_rule),
        cmocka_unit_test(test_one_group_is_single_group),
        cmocka_unit_test(test_stress),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
