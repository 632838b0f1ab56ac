/* test_kv.c - the paged KV cache: sizing against known models, layout checks, the block pool
 * (allocation, exhaustion, reference counts, LRU eviction), prefix caching across sequences,
 * and a seeded random stress that checks the pool's invariants after every operation. */
#include "tdm_test.h"

#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include "tandem/kv.h"

/* Llama-2-7B: 32 layers, 32 KV heads (no GQA), head_dim 128. */
static const tdm_kv_layout_t llama2_7b = {32, 32, 128, 16, TDM_KV_F16};
/* SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64. */
static const tdm_kv_layout_t smollm2 = {30, 3, 64, 16, TDM_KV_F16};

/* Checks the counters add up and the pool's lists and index agree with them. */
static void check_pool(const tdm_kv_pool_t *pool)
{
    tdm_kv_stats_t s;
    tdm_kv_pool_stats(pool, &s);
    assert_int_equal((uint64_t)s.n_used + s.n_cached + s.n_free, s.n_blocks);
    assert_int_equal(tdm_kv_pool_available(pool), s.n_free + s.n_cached);
    assert_true(s.prefix_hits <= s.prefix_queries);
    tdm_error_t err = {0};
    if (tdm_kv_pool_check(pool, &err) != TDM_OK)
        fail_msg("pool inconsistent: %s", err.msg);
}

static tdm_kv_stats_t stats_of(const tdm_kv_pool_t *pool)
{
    tdm_kv_stats_t s;
    tdm_kv_pool_stats(pool, &s);
    return s;
}

static tdm_kv_pool_t *pool_new_ok(tdm_kv_layout_t l, uint32_t n_blocks)
{
    tdm_error_t err = {0};
    tdm_kv_pool_t *pool = tdm_kv_pool_new(&l, n_blocks, &err);
    if (!pool)
        fail_msg("tdm_kv_pool_new: %s", err.msg);
    check_pool(pool);
    return pool;
}

/* ---- sizing ---- */

/* The one layout check: the first differing field in a fixed order, with both values. */
static void test_layout_mismatch(void **state)
{
    (void)state;
    const tdm_kv_layout_t want = {30, 3, 64, 16, TDM_KV_F16};
    tdm_kv_layout_t got = want;
    uint32_t g = 7, w = 7;
    assert_null(tdm_kv_layout_mismatch(&got, &want, &g, &w));
    assert_int_equal(g, 7); /* untouched when equal */
    got.dtype = TDM_KV_Q8;
    assert_string_equal(tdm_kv_layout_mismatch(&got, &want, &g, &w), "dtype");
    assert_int_equal(g, TDM_KV_Q8);
    assert_int_equal(w, TDM_KV_F16);
    got.block_size = 32;
    assert_string_equal(tdm_kv_layout_mismatch(&got, &want, &g, &w), "block_size");
    assert_int_equal(g, 32);
    assert_int_equal(w, 16);
    got.n_kv_heads = 2;
    got.head_dim = 128;
    assert_string_equal(tdm_kv_layout_mismatch(&got, &want, &g, &w), "n_kv_heads");
    got.n_layers = 12;
    assert_string_equal(tdm_kv_layout_mismatch(&got, &want, &g, &w), "n_layers");
    assert_int_equal(g, 12);
    assert_int_equal(w, 30);
}

static void test_sizing_llama2(void **state)
{
    (void)state;
    const tdm_kv_layout_t *l = &llama2_7b;
    assert_int_equal(tdm_kv_bytes_per_value(TDM_KV_F16), 2);
    assert_int_equal(tdm_kv_bytes_per_token(l), 524288);
    assert_int_equal(tdm_kv_bytes_per_token(l) * 4096, 2147483648ull);
    assert_int_equal(tdm_kv_bytes_per_token(l) * 4096 * 32, 68719476736ull);
    assert_int_equal(tdm_kv_record_bytes(l), 16 * 128 * 2);
    assert_int_equal(tdm_kv_block_bytes(l), 16 * 524288);
    assert_int_equal(tdm_kv_blocks_for_tokens(l, 4096), 256);
    assert_int_equal(tdm_kv_blocks_for_tokens(l, 4096) * tdm_kv_block_bytes(l), 2147483648ull);
    assert_int_equal(tdm_kv_blocks_for_tokens(l, 0), 0);
    assert_int_equal(tdm_kv_blocks_for_tokens(l, 1), 1);
    assert_int_equal(tdm_kv_blocks_for_tokens(l, 16), 1);
    assert_int_equal(tdm_kv_blocks_for_tokens(l, 17), 2);
    assert_int_equal(tdm_kv_layout_check(l, NULL), TDM_OK);
}

static void test_sizing_smollm2(void **state)
{
    (void)state;
    assert_int_equal(tdm_kv_bytes_per_token(&smollm2), 23040);
    assert_int_equal(tdm_kv_block_bytes(&smollm2), 16 * 23040);
    assert_int_equal(tdm_kv_layout_check(&smollm2, NULL), TDM_OK);
}

static void test_sizing_dtypes(void **state)
{
    (void)state;
    tdm_kv_layout_t l = llama2_7b;
    l.dtype = TDM_KV_F32;
    assert_int_equal(tdm_kv_bytes_per_value(TDM_KV_F32), 4);
    assert_int_equal(tdm_kv_bytes_per_token(&l), 1048576);
    assert_int_equal(tdm_kv_record_bytes(&l), 16 * 128 * 4);
    assert_int_equal(tdm_kv_block_bytes(&l), 16 * 1048576);

    l.dtype = TDM_KV_Q8;
    assert_int_equal(tdm_kv_bytes_per_value(TDM_KV_Q8), 1);
    assert_int_equal(tdm_kv_bytes_per_token(&l), 262144); /* without scales */
    assert_int_equal(tdm_kv_record_bytes(&l), 4 + 16 * 128);
    /* 2 * 32 * 32 records, each 4 bytes of scale + 2048 int8 */
    assert_int_equal(tdm_kv_block_bytes(&l), 2 * 32 * 32 * (4 + 2048));
    assert_int_equal(tdm_kv_block_bytes(&l), 16 * 262144 + 2 * 32 * 32 * 4);

    /* SmolLM2 at q8, block_size 32: 180 records of 4 + 32 * 64 bytes. */
    tdm_kv_layout_t s = smollm2;
    s.dtype = TDM_KV_Q8;
    s.block_size = 32;
    assert_int_equal(tdm_kv_block_bytes(&s), 180 * (4 + 2048));

    /* Record offsets follow [layer][K|V][kv_head]. */
    uint64_t rb = tdm_kv_record_bytes(&llama2_7b);
    assert_int_equal(tdm_kv_record_offset(&llama2_7b, rb, 0, 0, 0), 0);
    assert_int_equal(tdm_kv_record_offset(&llama2_7b, rb, 0, 0, 1), rb);
    assert_int_equal(tdm_kv_record_offset(&llama2_7b, rb, 0, 1, 0), 32 * rb);
    assert_int_equal(tdm_kv_record_offset(&llama2_7b, rb, 1, 0, 0), 64 * rb);
    assert_int_equal(tdm_kv_record_offset(&llama2_7b, rb, 31, 1, 31) + rb,
                     tdm_kv_block_bytes(&llama2_7b));
}

/* tdm_kv_plan, SmolLM2-135M: 8 users of 8192 tokens with 9 query heads, 100 MB of weights,
 * 1 GiB of memory. 23,040 B/token (DESIGN.md); 16 tokens per block. */
static void test_plan_smollm2(void **state)
{
    (void)state;
    tdm_kv_plan_in_t in = {.layout = smollm2,
                           .n_heads = 9,
                           .n_ctx = 8192,
                           .n_users = 8,
                           .weight_bytes = 100000000,
                           .have_memory = true,
                           .memory_bytes = 1073741824};
    tdm_kv_plan_t p;
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_OK);
    assert_int_equal(p.bytes_per_token, 23040);
    assert_int_equal(p.block_bytes, 368640);        /* 16 * 23,040 */
    assert_int_equal(p.blocks_per_seq, 512);        /* 8192 / 16 */
    assert_int_equal(p.bytes_per_seq, 188743680);   /* 512 * 368,640 */
    assert_int_equal(p.blocks_total, 4096);         /* 8 * 512 */
    assert_int_equal(p.bytes_total, 1509949440);    /* 8 * 188,743,680 */
    assert_int_equal(p.need_bytes, 1609949440);     /* + 100,000,000 of weights */
    assert_int_equal(p.mha_bytes_per_token, 69120); /* 9 heads: 3 * 23,040 */
    assert_true(p.gqa_factor == 3.0);
    assert_int_equal(p.pool_budget_bytes, 973741824); /* 2^30 - 10^8 */
    assert_int_equal(p.pool_blocks, 2641);            /* floor(973,741,824 / 368,640) */
    assert_int_equal(p.pool_tokens, 2641 * 16);
    assert_int_equal(p.max_seqs, 5); /* floor(2641 / 512) */
    assert_false(p.fits);
    assert_int_equal(p.spare_bytes, 0);
    assert_int_equal(p.short_bytes, 536207616); /* 1,609,949,440 - 2^30 */

    /* no memory: the pool figures are 0; n_heads 0 means no GQA */
    in.have_memory = false;
    in.n_heads = 0;
    in.n_ctx = 4096;
    in.n_users = 1;
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_OK);
    assert_int_equal(p.bytes_per_seq, 94371840); /* 256 blocks of 368,640 */
    assert_int_equal(p.mha_bytes_per_token, 23040);
    assert_true(p.gqa_factor == 1.0);
    assert_int_equal(p.pool_blocks, 0);
    assert_int_equal(p.max_seqs, 0);
    assert_false(p.fits);
}

/* tdm_kv_plan, Llama-2-7B at f16: 32 users of 4096 tokens in 80 GiB with 13,476,839,424 bytes
 * of weights; then with 1 GiB of engine scratch, sized as the node sizes its pool. */
static void test_plan_llama2(void **state)
{
    (void)state;
    const uint64_t gib = 1073741824;
    tdm_kv_plan_in_t in = {.layout = llama2_7b,
                           .n_ctx = 4096,
                           .n_users = 32,
                           .weight_bytes = 13476839424ull,
                           .have_memory = true,
                           .memory_bytes = 80 * gib};
    tdm_kv_plan_t p;
    assert_int_equal(tdm_kv_plan(&in, &p, NULL), TDM_OK);
    assert_int_equal(p.bytes_per_token, 524288);
    assert_int_equal(p.block_bytes, 8388608);
    assert_int_equal(p.blocks_per_seq, 256);
    assert_int_equal(p.bytes_per_seq, 2 * gib);
    assert_int_equal(p.blocks_total, 8192);
    assert_int_equal(p.bytes_total, 64 * gib);
    assert_int_equal(p.need_bytes, 64 * gib + 13476839424ull);
    assert_true(p.gqa_factor == 1.0);
    assert_int_equal(p.pool_blocks, 8633); /* floor((80 GiB - weights) / 8 MiB) */
    assert_int_equal(p.max_seqs, 33);
    assert_true(p.fits);
    assert_int_equal(p.spare_bytes, 16 * gib - 13476839424ull);
    assert_int_equal(p.short_bytes, 0);

    in.scratch_bytes = gib;
    assert_int_equal(tdm_kv_plan(&in, &p, NULL), TDM_OK);
    assert_int_equal(p.need_bytes, 65 * gib + 13476839424ull);
    assert_int_equal(p.pool_budget_bytes, 79 * gib - 13476839424ull);
    assert_int_equal(p.pool_blocks, 8505);

    /* the budget for a pool of pool_blocks blocks plans back to that pool, to the byte */
    uint64_t budget = 0;
    assert_int_equal(
        tdm_kv_plan_budget(&llama2_7b, p.pool_blocks, in.weight_bytes + gib, &budget, NULL),
        TDM_OK);
    assert_int_equal(budget, 8505 * 8388608ull + 13476839424ull + gib);
    in.memory_bytes = budget;
    assert_int_equal(tdm_kv_plan(&in, &p, NULL), TDM_OK);
    assert_int_equal(p.pool_blocks, 8505);
    in.memory_bytes = budget - 1;
    assert_int_equal(tdm_kv_plan(&in, &p, NULL), TDM_OK);
    assert_int_equal(p.pool_blocks, 8504);

    /* weights larger than the memory: no pool at all */
    in.memory_bytes = gib;
    assert_int_equal(tdm_kv_plan(&in, &p, NULL), TDM_OK);
    assert_int_equal(p.pool_budget_bytes, 0);
    assert_int_equal(p.pool_blocks, 0);
    assert_int_equal(p.max_seqs, 0);
    assert_false(p.fits);
}

/* tdm_kv_plan's q8 blocks carry their scales; bad input is TDM_EINVALID, a product past 2^64
 * TDM_ERESOURCE, both with *out zeroed. */
static void test_plan_errors(void **state)
{
    (void)state;
    tdm_kv_plan_in_t in = {.layout = llama2_7b, .n_ctx = 1000, .n_users = 1};
    in.layout.dtype = TDM_KV_Q8;
    tdm_kv_plan_t p;
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_OK);
    assert_int_equal(p.bytes_per_token, 262144);
    assert_int_equal(p.block_bytes, 4202496); /* 16 * 262,144 + 2 * 32 * 32 * 4 */
    assert_int_equal(p.blocks_per_seq, 63);   /* ceil(1000 / 16) */
    assert_int_equal(p.bytes_per_seq, 63 * 4202496ull);

    in.layout.block_size = 3;
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "block_size"));
    assert_int_equal(p.block_bytes, 0);
    in.layout.block_size = 16;
    in.n_ctx = 0;
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_ctx"));
    in.n_ctx = 1000;
    in.n_users = 0;
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_users"));
    in.n_users = 1;
    in.n_heads = 48;
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_heads"));

    /* 2^20 users of 2^24 tokens at f32, 2^24-byte blocks of 16 tokens: 2^64 bytes */
    in.layout.dtype = TDM_KV_F32;
    in.n_heads = 0;
    in.n_ctx = 16777216;
    in.n_users = 1048576;
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "2^64"));
    assert_int_equal(p.bytes_per_token, 0);
    /* weights + KV past 2^64 */
    in.n_ctx = 16;
    in.n_users = 1;
    in.weight_bytes = UINT64_MAX;
    assert_int_equal(tdm_kv_plan(&in, &p, &err), TDM_ERESOURCE);

    uint64_t budget = 7;
    assert_int_equal(tdm_kv_plan_budget(&llama2_7b, UINT64_MAX / 4, 0, &budget, &err),
                     TDM_ERESOURCE);
    assert_int_equal(budget, 7);
    assert_int_equal(tdm_kv_plan_budget(&llama2_7b, 0, 5, &budget, &err), TDM_OK);
    assert_int_equal(budget, 5);
}

static void test_dtype_names(void **state)
{
    (void)state;
    assert_string_equal(tdm_kv_dtype_name(TDM_KV_F32), "f32");
    assert_string_equal(tdm_kv_dtype_name(TDM_KV_F16), "f16");
    assert_string_equal(tdm_kv_dtype_name(TDM_KV_Q8), "q8");
    assert_string_equal(tdm_kv_dtype_name((tdm_kv_dtype_t)7), "?");
    tdm_kv_dtype_t d = TDM_KV_F32;
    assert_int_equal(tdm_kv_dtype_parse("q8", &d, NULL), TDM_OK);
    assert_int_equal(d, TDM_KV_Q8);
    assert_int_equal(tdm_kv_dtype_parse("f16", &d, NULL), TDM_OK);
    assert_int_equal(d, TDM_KV_F16);
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_dtype_parse("bf16", &d, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "unknown KV dtype 'bf16' (expected f32, f16 or q8)");
    assert_int_equal(d, TDM_KV_F16);
}

/* Expects the layout check to fail with a message naming field. */
static void layout_fails(tdm_kv_layout_t l, const char *field)
{
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_layout_check(&l, &err), TDM_EINVALID);
    assert_int_equal(err.code, TDM_EINVALID);
    if (!strstr(err.msg, field))
        fail_msg("expected '%s' in: %s", field, err.msg);
    /* a pool refuses the same layout with the same message */
    tdm_error_t err2 = {0};
    assert_null(tdm_kv_pool_new(&l, 4, &err2));
    assert_int_equal(err2.code, TDM_EINVALID);
    assert_string_equal(err2.msg, err.msg);
}

static void test_layout_check(void **state)
{
    (void)state;
    tdm_kv_layout_t l = llama2_7b;
    l.n_layers = 0;
    layout_fails(l, "n_layers");
    l = llama2_7b, l.n_kv_heads = 0;
    layout_fails(l, "n_kv_heads");
    l = llama2_7b, l.head_dim = 0;
    layout_fails(l, "head_dim");
    l = llama2_7b, l.head_dim = 6;
    layout_fails(l, "head_dim must be a positive multiple of 4, got 6");
    l = llama2_7b, l.block_size = 0;
    layout_fails(l, "block_size");
    l = llama2_7b, l.block_size = 24;
    layout_fails(l, "block_size must be a power of two in 1..256, got 24");
    l = llama2_7b, l.block_size = 512;
    layout_fails(l, "block_size");
    l = llama2_7b, l.dtype = (tdm_kv_dtype_t)3;
    layout_fails(l, "dtype");
    /* 8 MiB blocks at 16 tokens; 256 tokens at f32 with 64x the heads is 8 GiB: too big */
    l = llama2_7b, l.block_size = 256, l.dtype = TDM_KV_F32, l.n_kv_heads = 2048;
    layout_fails(l, "block_bytes must fit in 32 bits");
    /* absurd sizes saturate instead of wrapping around to small numbers */
    l = (tdm_kv_layout_t){UINT32_MAX, UINT32_MAX, 0xfffffffc, 256, TDM_KV_F32};
    assert_int_equal(tdm_kv_block_bytes(&l), UINT64_MAX);
    layout_fails(l, "block_bytes");
    /* the edges that are allowed */
    l = (tdm_kv_layout_t){1, 1, 4, 1, TDM_KV_Q8};
    assert_int_equal(tdm_kv_layout_check(&l, NULL), TDM_OK);
    assert_int_equal(tdm_kv_block_bytes(&l), 2 * (4 + 4));
    l = llama2_7b, l.block_size = 256;
    assert_int_equal(tdm_kv_layout_check(&l, NULL), TDM_OK);
}

static void test_pool_new(void **state)
{
    (void)state;
    tdm_kv_layout_t l = {2, 2, 8, 4, TDM_KV_F16};
    tdm_error_t err = {0};
    assert_null(tdm_kv_pool_new(&l, 0, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_blocks"));

    tdm_kv_pool_t *pool = pool_new_ok(l, 10);
    assert_int_equal(tdm_kv_pool_block_bytes(pool), 2 * 2 * 2 * 4 * 8 * 2);
    assert_memory_equal(tdm_kv_pool_layout(pool), &l, sizeof l);
    unsigned char *base = tdm_kv_pool_base(pool);
    assert_int_equal((uintptr_t)base % 64, 0);
    for (size_t i = 0; i < 10 * tdm_kv_pool_block_bytes(pool); i++)
        assert_int_equal(base[i], 0);
    tdm_kv_stats_t s = stats_of(pool);
    assert_int_equal(s.n_blocks, 10);
    assert_int_equal(s.n_free, 10);
    assert_int_equal(s.n_used + s.n_cached + s.prefix_queries + s.evictions, 0);
    tdm_kv_pool_destroy(&pool);
    assert_null(pool);
    tdm_kv_pool_destroy(&pool); /* accepts NULL */
    tdm_kv_pool_destroy(NULL);

#ifndef __SANITIZE_ADDRESS__ /* ASan aborts on huge requests instead of returning NULL */
    /* 2 GiB blocks: two million of them is 4 PiB, more than any address space. */
    l = (tdm_kv_layout_t){64, 256, 128, 256, TDM_KV_F16};
    assert_int_equal(tdm_kv_block_bytes(&l), 2147483648ull);
    assert_null(tdm_kv_pool_new(&l, 1u << 21, &err));
    assert_int_equal(err.code, TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "cannot allocate 4503599627370496 bytes"));
#endif
}

/* ---- the pool ---- */

static void test_alloc_exhaustion(void **state)
{
    (void)state;
    tdm_kv_pool_t *pool = pool_new_ok((tdm_kv_layout_t){1, 1, 4, 4, TDM_KV_F32}, 8);
    uint32_t a[8], b[8], c[8];
    assert_int_equal(tdm_kv_pool_alloc(pool, 3, a), TDM_OK);
    check_pool(pool);
    /* block 0 first, then in order */
    assert_int_equal(a[0], 0);
    assert_int_equal(a[1], 1);
    assert_int_equal(a[2], 2);
    assert_int_equal(tdm_kv_pool_alloc(pool, 3, b), TDM_OK);
    check_pool(pool);
    assert_int_equal(tdm_kv_pool_available(pool), 2);

    /* all or nothing: asking 3 of 2 takes none */
    memset(c, 0xee, sizeof c);
    assert_int_equal(tdm_kv_pool_alloc(pool, 3, c), TDM_ERESOURCE);
    check_pool(pool);
    assert_int_equal(c[0], 0xeeeeeeee);
    tdm_kv_stats_t s = stats_of(pool);
    assert_int_equal(s.n_used, 6);
    assert_int_equal(s.n_free, 2);

    assert_int_equal(tdm_kv_pool_alloc(pool, 0, c), TDM_OK);
    assert_int_equal(tdm_kv_pool_alloc(pool, 2, c), TDM_OK);
    check_pool(pool);
    assert_int_equal(tdm_kv_pool_available(pool), 0);
    assert_int_equal(tdm_kv_pool_alloc(pool, 1, c + 2), TDM_ERESOURCE);
    check_pool(pool);

    /* every block handed out exactly once */
    int seen[8] = {0};
    for (int i = 0; i < 3; i++)
        seen[a[i]]++, seen[b[i]]++;
    seen[c[0]]++, seen[c[1]]++;
    for (int i = 0; i < 8; i++)
        assert_int_equal(seen[i], 1);

    /* an unhashed block goes back to the free list and is handed out again (LIFO) */
    tdm_kv_pool_unref(pool, b[1]);
    check_pool(pool);
    assert_int_equal(stats_of(pool).n_free, 1);
    assert_int_equal(stats_of(pool).n_cached, 0);
    assert_int_equal(tdm_kv_pool_alloc(pool, 1, c + 2), TDM_OK);
    assert_int_equal(c[2], b[1]);
    check_pool(pool);
    tdm_kv_pool_destroy(&pool);
}

static void test_refcounts(void **state)
{
    (void)state;
    tdm_kv_pool_t *pool = pool_new_ok((tdm_kv_layout_t){1, 1, 4, 4, TDM_KV_F16}, 4);
    uint32_t b;
    assert_int_equal(tdm_kv_pool_alloc(pool, 1, &b), TDM_OK);
    assert_int_equal(tdm_kv_pool_refcount(pool, b), 1);
    tdm_kv_pool_ref(pool, b);
    tdm_kv_pool_ref(pool, b);
    check_pool(pool);
    assert_int_equal(tdm_kv_pool_refcount(pool, b), 3);
    assert_int_equal(stats_of(pool).n_used, 1);
    tdm_kv_pool_unref(pool, b);
    tdm_kv_pool_unref(pool, b);
    check_pool(pool);
    assert_int_equal(tdm_kv_pool_refcount(pool, b), 1);
    assert_int_equal(stats_of(pool).n_used, 1);
    tdm_kv_pool_unref(pool, b);
    check_pool(pool);
    assert_int_equal(tdm_kv_pool_refcount(pool, b), 0);
    assert_int_equal(stats_of(pool).n_used, 0);
    assert_int_equal(stats_of(pool).n_free, 4);
    tdm_kv_pool_destroy(&pool);
}

/* Runs fn(pool) in a child process and expects it to abort (a TDM_ASSERT). */
static void expect_abort(void (*fn)(tdm_kv_pool_t *pool))
{
    fflush(NULL);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        /* keep the expected "assertion failed" line out of the test log */
        if (!freopen("/dev/null", "w", stderr))
            _exit(3);
        tdm_kv_pool_t *pool = pool_new_ok((tdm_kv_layout_t){1, 1, 4, 4, TDM_KV_F16}, 4);
        fn(pool);
        _exit(0); /* no abort: the parent fails */
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFSIGNALED(status));
    assert_int_equal(WTERMSIG(status), SIGABRT);
}

static void unref_free_block(tdm_kv_pool_t *pool)
{
    tdm_kv_pool_unref(pool, 2);
}

static void unref_twice(tdm_kv_pool_t *pool)
{
    uint32_t b;
    if (tdm_kv_pool_alloc(pool, 1, &b) == TDM_OK) {
        tdm_kv_pool_unref(pool, b);
        tdm_kv_pool_unref(pool, b);
    }
}

static void unref_bad_id(tdm_kv_pool_t *pool)
{
    tdm_kv_pool_unref(pool, 4);
}

static void ref_free_block(tdm_kv_pool_t *pool)
{
    tdm_kv_pool_ref(pool, 0);
}

static void ref_bad_id(tdm_kv_pool_t *pool)
{
    tdm_kv_pool_ref(pool, TDM_KV_NO_BLOCK);
}

static void test_asserts(void **state)
{
    (void)state;
    expect_abort(unref_free_block);
    expect_abort(unref_twice);
    expect_abort(unref_bad_id);
    expect_abort(ref_free_block);
    expect_abort(ref_bad_id);
}

/* ---- sequences and prefix caching ---- */

/* Tokens of a test prompt: the shared part is the same for every prompt with the same
 * `prefix`, then each prompt has its own tokens. */
static void make_tokens(int32_t *t, uint32_t n, uint32_t n_shared, int32_t prefix, int32_t own)
{
    for (uint32_t i = 0; i < n; i++)
        t[i] = i < n_shared ? prefix * 1000 + (int32_t)i : own * 100000 + (int32_t)i;
}

/* Runs a whole prefill for seq: match the prefix, reserve, commit. Returns tokens reused. */
static uint32_t prefill(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, const int32_t *t, uint32_t n)
{
    tdm_kv_seq_init(seq);
    uint32_t hit = tdm_kv_seq_match_prefix(pool, seq, t, n);
    check_pool(pool);
    assert_int_equal(seq->n_tokens, hit);
    assert_int_equal(tdm_kv_seq_reserve(pool, seq, n), TDM_OK);
    check_pool(pool);
    tdm_kv_seq_commit(pool, seq, t, n);
    check_pool(pool);
    assert_int_equal(seq->n_tokens, n);
    return hit;
}

static void test_block_hash(void **state)
{
    (void)state;
    int32_t t[32];
    make_tokens(t, 32, 32, 1, 0);
    uint64_t h0 = tdm_kv_block_hash(TDM_KV_HASH_SEED, t, 16);
    uint64_t h1 = tdm_kv_block_hash(h0, t + 16, 16);
    assert_int_not_equal(h0, h1);
    assert_int_equal(h0, tdm_kv_block_hash(TDM_KV_HASH_SEED, t, 16));
    /* the same tokens under another parent hash differently: the hash covers the prefix */
    assert_int_not_equal(tdm_kv_block_hash(TDM_KV_HASH_SEED, t + 16, 16), h1);
    /* tokens as int32 little-endian bytes */
    unsigned char le[64];
    for (int i = 0; i < 16; i++)
        for (int k = 0; k < 4; k++)
            le[4 * i + k] = (unsigned char)((uint32_t)t[i] >> (8 * k));
    assert_int_equal(h0, XXH3_64bits_withSeed(le, sizeof le, TDM_KV_HASH_SEED));
}

static void test_prefix_reuse(void **state)
{
    (void)state;
    tdm_kv_pool_t *pool = pool_new_ok((tdm_kv_layout_t){2, 2, 8, 16, TDM_KV_F16}, 32);
    int32_t ta[80], tb[84];
    make_tokens(ta, 80, 64, 7, 1); /* 64 shared + 16 own: 5 full blocks */
    make_tokens(tb, 84, 64, 7, 2); /* 64 shared + 20 own */

    tdm_kv_seq_t a, b;
    assert_int_equal(prefill(pool, &a, ta, 80), 0);
    tdm_kv_stats_t s = stats_of(pool);
    assert_int_equal(s.prefix_queries, 1); /* the first block missed, and the walk stopped */
    assert_int_equal(s.prefix_hits, 0);
    assert_int_equal(a.n_blocks, 5);
    assert_int_equal(a.n_hashed, 5);
    for (uint32_t i = 0; i < 5; i++)
        assert_int_equal(tdm_kv_pool_refcount(pool, a.blocks[i]), 1);
    /* the chain: every block registered under its hash */
    uint64_t h = TDM_KV_HASH_SEED;
    for (uint32_t i = 0; i < 5; i++) {
        h = tdm_kv_block_hash(h, ta + 16 * i, 16);
        assert_int_equal(tdm_kv_pool_find(pool, h), a.blocks[i]);
    }
    assert_int_equal(a.last_hash, h);

    /* the second sequence gets the 4 shared blocks back */
    assert_int_equal(prefill(pool, &b, tb, 84), 64);
    s = stats_of(pool);
    assert_int_equal(s.prefix_queries, 1 + 5); /* 4 hits, then block 4 differs */
    assert_int_equal(s.prefix_hits, 4);
    assert_int_equal(b.n_blocks, 6);
    assert_int_equal(b.n_hashed, 5);
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(b.blocks[i], a.blocks[i]);
        assert_int_equal(tdm_kv_pool_refcount(pool, a.blocks[i]), 2);
    }
    assert_int_not_equal(b.blocks[4], a.blocks[4]);
    assert_int_equal(s.n_used, 5 + 2);

    /* a prompt that is exactly the cached 64 tokens: one block is left to compute */
    tdm_kv_seq_t c;
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &c, ta, 64), 48);
    assert_int_equal(c.n_blocks, 3);
    assert_int_equal(c.n_hashed, 3);
    check_pool(pool);
    tdm_kv_seq_release(pool, &c);
    check_pool(pool);
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &c, ta, 65), 64);
    tdm_kv_seq_release(pool, &c);
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &c, ta, 16), 0); /* 1 block: keep it */
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &c, ta, 1), 0);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &c, ta, 0), 0);
    assert_int_equal(c.n_blocks, 0);
    tdm_kv_seq_release(pool, &c);
    check_pool(pool);

    /* a token that differs in block 1 stops the match after block 0 */
    int32_t td[80];
    memcpy(td, ta, sizeof td);
    td[20] = -5;
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &c, td, 80), 16);
    tdm_kv_seq_release(pool, &c);
    /* same later blocks but another first block: the chain misses at once */
    td[20] = ta[20];
    td[0] = -1;
    tdm_kv_seq_init(&c);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &c, td, 80), 0);
    tdm_kv_seq_release(pool, &c);
    check_pool(pool);

    /* recomputing the same prefix without matching keeps the registered blocks: the copies
     * stay unregistered and go back to the free list */
    tdm_kv_seq_t e;
    tdm_kv_seq_init(&e);
    assert_int_equal(tdm_kv_seq_reserve(pool, &e, 80), TDM_OK);
    tdm_kv_seq_commit(pool, &e, ta, 80);
    check_pool(pool);
    assert_int_equal(e.n_hashed, 5);
    assert_int_equal(e.last_hash, a.last_hash);
    h = TDM_KV_HASH_SEED;
    for (uint32_t i = 0; i < 5; i++) {
        h = tdm_kv_block_hash(h, ta + 16 * i, 16);
        assert_int_equal(tdm_kv_pool_find(pool, h), a.blocks[i]);
    }
    uint32_t free_before = stats_of(pool).n_free;
    tdm_kv_seq_release(pool, &e);
    check_pool(pool);
    assert_int_equal(stats_of(pool).n_free, free_before + 5);
    assert_int_equal(stats_of(pool).n_cached, 0);

    /* releasing a keeps its blocks 0..3 used by b; block 4 becomes cached */
    uint32_t a4 = a.blocks[4];
    tdm_kv_seq_release(pool, &a);
    check_pool(pool);
    assert_null(a.blocks);
    assert_int_equal(a.n_blocks, 0);
    assert_int_equal(tdm_kv_pool_refcount(pool, b.blocks[0]), 1);
    assert_int_equal(stats_of(pool).n_cached, 1);
    assert_int_equal(tdm_kv_pool_refcount(pool, a4), 0);
    /* releasing b caches its 5 hashed blocks; its partial 6th block is free */
    tdm_kv_seq_release(pool, &b);
    check_pool(pool);
    s = stats_of(pool);
    assert_int_equal(s.n_used, 0);
    assert_int_equal(s.n_cached, 6);
    assert_int_equal(s.n_free, 32 - 6);
    assert_int_equal(s.evictions, 0);
    tdm_kv_pool_destroy(&pool);
}

static void test_commit_incremental(void **state)
{
    (void)state;
    /* Decode: tokens arrive one by one; each block is registered when it fills. */
    tdm_kv_pool_t *pool = pool_new_ok((tdm_kv_layout_t){1, 1, 4, 4, TDM_KV_F16}, 8);
    int32_t t[20];
    make_tokens(t, 20, 0, 0, 3);
    tdm_kv_seq_t s;
    tdm_kv_seq_init(&s);
    for (uint32_t n = 1; n <= 20; n++) {
        assert_int_equal(tdm_kv_seq_reserve(pool, &s, n), TDM_OK);
        assert_int_equal(s.n_blocks, (n + 3) / 4);
        tdm_kv_seq_commit(pool, &s, t, n);
        check_pool(pool);
        assert_int_equal(s.n_tokens, n);
        assert_int_equal(s.n_hashed, n / 4);
    }
    /* reserving less than the table holds changes nothing */
    assert_int_equal(tdm_kv_seq_reserve(pool, &s, 3), TDM_OK);
    assert_int_equal(s.n_blocks, 5);
    /* more than the pool has: the table is unchanged */
    assert_int_equal(tdm_kv_seq_reserve(pool, &s, 37), TDM_ERESOURCE);
    assert_int_equal(s.n_blocks, 5);
    check_pool(pool);
    assert_int_equal(tdm_kv_seq_reserve(pool, &s, 32), TDM_OK);
    assert_int_equal(s.n_blocks, 8);
    check_pool(pool);
    /* same hashes as a one-shot commit */
    tdm_kv_seq_t o;
    tdm_kv_seq_init(&o);
    tdm_kv_seq_release(pool, &s);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &o, t, 20), 16);
    tdm_kv_seq_release(pool, &o);
    check_pool(pool);
    tdm_kv_pool_destroy(&pool);
}

static void test_cached_reuse_and_lru(void **state)
{
    (void)state;
    /* 8 blocks of 4 tokens. */
    tdm_kv_pool_t *pool = pool_new_ok((tdm_kv_layout_t){1, 1, 4, 4, TDM_KV_F16}, 8);
    int32_t tx[17], ty[9];
    make_tokens(tx, 17, 0, 0, 1);
    make_tokens(ty, 9, 0, 0, 2);

    tdm_kv_seq_t x, y;
    prefill(pool, &x, tx, 16); /* 4 full blocks */
    uint32_t xb[4];
    memcpy(xb, x.blocks, sizeof xb);
    tdm_kv_seq_release(pool, &x);
    check_pool(pool);
    assert_int_equal(stats_of(pool).n_cached, 4);

    /* reuse after release: the cached blocks are revived, not recomputed */
    assert_int_equal(prefill(pool, &x, tx, 17), 16);
    for (int i = 0; i < 4; i++)
        assert_int_equal(x.blocks[i], xb[i]);
    assert_int_equal(stats_of(pool).n_cached, 0);
    assert_int_equal(stats_of(pool).n_used, 5);
    tdm_kv_seq_release(pool, &x);
    check_pool(pool);
    /* x's 4 hashed blocks are cached (tail first in LRU order), its 5th is free */
    assert_int_equal(stats_of(pool).n_cached, 4);

    prefill(pool, &y, ty, 8); /* 2 full blocks, from the free list */
    tdm_kv_seq_release(pool, &y);
    check_pool(pool);
    assert_int_equal(stats_of(pool).n_cached, 6);
    assert_int_equal(stats_of(pool).n_free, 2);
    assert_int_equal(stats_of(pool).evictions, 0);

    /* Fill the pool: free blocks go first, then the least recently freed cached blocks: x's
     * tail block (released first), then the one before it. */
    uint32_t got[8];
    assert_int_equal(tdm_kv_pool_alloc(pool, 2, got), TDM_OK);
    assert_int_equal(stats_of(pool).evictions, 0);
    assert_int_equal(tdm_kv_pool_alloc(pool, 1, got + 2), TDM_OK);
    check_pool(pool);
    assert_int_equal(got[2], xb[3]);
    assert_int_equal(stats_of(pool).evictions, 1);
    assert_int_equal(tdm_kv_pool_alloc(pool, 1, got + 3), TDM_OK);
    assert_int_equal(got[3], xb[2]);
    assert_int_equal(stats_of(pool).evictions, 2);
    check_pool(pool);

    /* The evicted blocks' hashes are gone: x's prompt now matches 2 blocks; y's still 2. */
    tdm_kv_seq_t m;
    tdm_kv_seq_init(&m);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &m, tx, 17), 8);
    assert_int_equal(m.blocks[0], xb[0]);
    assert_int_equal(m.blocks[1], xb[1]);
    check_pool(pool);
    tdm_kv_seq_release(pool, &m);
    tdm_kv_seq_init(&m);
    assert_int_equal(tdm_kv_seq_match_prefix(pool, &m, ty, 9), 8);
    tdm_kv_seq_release(pool, &m);
    check_pool(pool);

    /* Matching moved y's blocks to the most recent end: x's head goes next. */
    assert_int_equal(tdm_kv_pool_alloc(pool, 2, got + 4), TDM_OK);
    assert_int_equal(got[4], xb[1]);
    assert_int_equal(got[5], xb[0]);
    /* all or nothing with cached blocks counted as available */
    assert_int_equal(tdm_kv_pool_available(pool), 2);
    assert_int_equal(tdm_kv_pool_alloc(pool, 3, got + 6), TDM_ERESOURCE);
    check_pool(pool);
    assert_int_equal(stats_of(pool).n_cached, 2);
    assert_int_equal(tdm_kv_pool_alloc(pool, 2, got + 6), TDM_OK);
    check_pool(pool);
    tdm_kv_stats_t s = stats_of(pool);
    assert_int_equal(s.n_used, 8);
    assert_int_equal(s.evictions, 6);
    for (int i = 0; i < 8; i++)
        tdm_kv_pool_unref(pool, got[i]);
    check_pool(pool);
    assert_int_equal(stats_of(pool).n_free, 8);
    tdm_kv_pool_destroy(&pool);
}

/* ---- randomized stress ---- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t rnd(uint64_t *x, uint32_t n)
{
    return (uint32_t)(splitmix64(x) % n);
}

#define STRESS_SEQS 12
#define STRESS_MAX_TOKENS 96

typedef struct stress_seq {
    bool live;
    tdm_kv_seq_t seq;
    int32_t tokens[STRESS_MAX_TOKENS];
    uint32_t n;
} stress_seq_t;

/* What the "forward pass" writes into a full block: the chain hash of its prefix, so a block
 * reused through the prefix cache can be checked to hold the right prefix. */
static void write_block(tdm_kv_pool_t *pool, uint32_t b, uint64_t chain)
{
    unsigned char *p = (unsigned char *)tdm_kv_pool_base(pool) + b * tdm_kv_pool_block_bytes(pool);
    memcpy(p, &chain, sizeof chain);
}

static uint64_t read_block(tdm_kv_pool_t *pool, uint32_t b)
{
    uint64_t chain;
    const unsigned char *p =
        (unsigned char *)tdm_kv_pool_base(pool) + b * tdm_kv_pool_block_bytes(pool);
    memcpy(&chain, p, sizeof chain);
    return chain;
}

/* Commits ss->n tokens, "computing" the blocks that became full. */
static void stress_commit(tdm_kv_pool_t *pool, stress_seq_t *ss, uint32_t bs)
{
    uint64_t h = ss->seq.n_hashed ? ss->seq.last_hash : TDM_KV_HASH_SEED;
    for (uint32_t i = ss->seq.n_hashed; i < ss->n / bs; i++) {
        h = tdm_kv_block_hash(h, ss->tokens + i * bs, bs);
        write_block(pool, ss->seq.blocks[i], h);
    }
    tdm_kv_seq_commit(pool, &ss->seq, ss->tokens, ss->n);
}

/* Every block's reference count equals the number of live tables that hold it. */
static void check_refcounts(const tdm_kv_pool_t *pool, const stress_seq_t *ss, uint32_t n_blocks)
{
    uint32_t count[256] = {0};
    for (int i = 0; i < STRESS_SEQS; i++)
        for (uint32_t k = 0; ss[i].live && k < ss[i].seq.n_blocks; k++)
            count[ss[i].seq.blocks[k]]++;
    for (uint32_t b = 0; b < n_blocks; b++)
        assert_int_equal(tdm_kv_pool_refcount(pool, b), count[b]);
}

static void stress_run(uint64_t seed, uint32_t n_blocks, uint32_t block_size, int n_ops)
{
    tdm_kv_pool_t *pool = pool_new_ok((tdm_kv_layout_t){1, 1, 4, block_size, TDM_KV_F32}, n_blocks);
    stress_seq_t ss[STRESS_SEQS];
    memset(ss, 0, sizeof ss);
    uint64_t rng = seed;
    /* a few system prompts, so that prompts share prefixes of various lengths */
    int32_t system[4][STRESS_MAX_TOKENS];
    for (int p = 0; p < 4; p++)
        for (int i = 0; i < STRESS_MAX_TOKENS; i++)
            system[p][i] = (int32_t)rnd(&rng, 50000);
    uint64_t hits_tokens = 0;

    for (int op = 0; op < n_ops; op++) {
        stress_seq_t *s = &ss[rnd(&rng, STRESS_SEQS)];
        uint32_t what = rnd(&rng, 10);
        if (!s->live) {
            /* new sequence: a system prompt's prefix, then its own tokens */
            uint32_t n = 1 + rnd(&rng, 48);
            uint32_t shared = rnd(&rng, n + 1);
            int32_t *sys = system[rnd(&rng, 4)];
            for (uint32_t i = 0; i < n; i++)
                s->tokens[i] = i < shared ? sys[i] : (int32_t)rnd(&rng, 4); /* collisions */
            s->n = n;
            tdm_kv_seq_init(&s->seq);
            s->live = true;
            uint32_t hit = tdm_kv_seq_match_prefix(pool, &s->seq, s->tokens, n);
            assert_true(hit < n);
            assert_int_equal(hit % block_size, 0);
            hits_tokens += hit;
            /* reused blocks hold the prefix they were found for */
            uint64_t h = TDM_KV_HASH_SEED;
            for (uint32_t i = 0; i < hit / block_size; i++) {
                h = tdm_kv_block_hash(h, s->tokens + i * block_size, block_size);
                assert_int_equal(read_block(pool, s->seq.blocks[i]), h);
            }
            if (tdm_kv_seq_reserve(pool, &s->seq, n) == TDM_OK) {
                stress_commit(pool, s, block_size);
            } else {
                tdm_kv_seq_release(pool, &s->seq); /* rejected: not enough blocks */
                s->live = false;
            }
        } else if (what < 7 && s->n < STRESS_MAX_TOKENS) {
            /* decode some tokens */
            uint32_t k = 1 + rnd(&rng, 6);
            if (s->n + k > STRESS_MAX_TOKENS)
                k = STRESS_MAX_TOKENS - s->n;
            uint32_t before = s->seq.n_blocks;
            if (tdm_kv_seq_reserve(pool, &s->seq, s->n + k) == TDM_OK) {
                for (uint32_t i = 0; i < k; i++)
                    s->tokens[s->n + i] = (int32_t)rnd(&rng, 4);
                s->n += k;
                stress_commit(pool, s, block_size);
            } else {
                assert_int_equal(s->seq.n_blocks, before);
            }
        } else {
            tdm_kv_seq_release(pool, &s->seq);
            assert_null(s->seq.blocks);
            s->live = false;
        }
        check_pool(pool);
        check_refcounts(pool, ss, n_blocks);
    }
    for (int i = 0; i < STRESS_SEQS; i++)
        if (ss[i].live)
            tdm_kv_seq_release(pool, &ss[i].seq);
    check_pool(pool);
    tdm_kv_stats_t st = stats_of(pool);
    assert_int_equal(st.n_used, 0); /* no leaks: every block free or cached */
    assert_int_equal(st.n_free + st.n_cached, n_blocks);
    /* the workload does exercise the cache and eviction */
    assert_true(st.prefix_hits > 0);
    assert_true(hits_tokens > 0);
    assert_true(st.evictions > 0);
    tdm_kv_pool_destroy(&pool);
}

static void test_stress(void **state)
{
    (void)state;
    stress_run(1, 48, 4, 5000);
    stress_run(42, 64, 8, 5000);
    stress_run(7, 200, 1, 3000);
    stress_run(12345, 16, 2, 5000); /* a small pool: constant eviction and rejection */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_layout_mismatch),
        cmocka_unit_test(test_sizing_llama2),
        cmocka_unit_test(test_sizing_smollm2),
        cmocka_unit_test(test_sizing_dtypes),
        cmocka_unit_test(test_plan_smollm2),
        cmocka_unit_test(test_plan_llama2),
        cmocka_unit_test(test_plan_errors),
        cmocka_unit_test(test_dtype_names),
        cmocka_unit_test(test_layout_check),
        cmocka_unit_test(test_pool_new),
        cmocka_unit_test(test_alloc_exhaustion),
        cmocka_unit_test(test_refcounts),
        cmocka_unit_test(test_asserts),
        cmocka_unit_test(test_block_hash),
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_commit_incremental),
        cmocka_unit_test(test_cached_reuse_and_lru),
        cmocka_unit_test(test_stress),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
