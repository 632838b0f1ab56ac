/* kv_hybrid.c - KV allocation per layer group (tandem/kv.h "layer groups"): the partition of
 * the layers into equal-size groups of one attention kind, the per-group block formula, and
 * sequences with one block table per group over one pool, whose sliding-window groups give
 * back the blocks no later query reads. Built on the pool's public calls only.
 *
 * Source: vLLM's hybrid KV-cache manager (one block table per KV-cache group, equal page size
 * for every group, sliding-window blocks outside the window freed as the sequence grows) and
 * llama.cpp's SWA mask (a query at p reads keys p + 1 - W .. p).
 */
#include "tandem/kv.h"

#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

static uint32_t gcd_u32(uint32_t a, uint32_t b)
{
    while (b) {
        uint32_t t = a % b;
        a = b;
        b = t;
    }
    return a;
}

/* The smallest window of windows[0..n) (NULL: all 0) above `above` into *next, any window
 * when first (full attention, 0, is the smallest); false when there is none. */
static bool next_kind(const uint32_t *windows, uint32_t n, bool first, uint32_t above,
                      uint32_t *next)
{
    bool found = false;
    for (uint32_t l = 0; l < n; l++) {
        uint32_t w = windows ? windows[l] : 0;
        if ((first || w > above) && (!found || w < *next)) {
            *next = w;
            found = true;
        }
    }
    return found;
}

static uint32_t kind_count(const uint32_t *windows, uint32_t n, uint32_t w)
{
    uint32_t c = 0;
    for (uint32_t l = 0; l < n; l++)
        c += (windows ? windows[l] : 0) == w;
    return c;
}

int tdm_kv_groups_init(tdm_kv_groups_t *g, uint32_t n_layers, const uint32_t *windows,
                       tdm_error_t *err)
{
    memset(g, 0, sizeof *g);
    if (n_layers == 0 || n_layers > TDM_KV_MAX_LAYERS)
        return tdm_error_set(err, TDM_EINVALID, "kv groups: n_layers must be in 1..%u, got %u",
                             (unsigned)TDM_KV_MAX_LAYERS, (unsigned)n_layers);
    uint32_t k = 0, w = 0;
    for (bool first = true; next_kind(windows, n_layers, first, w, &w); first = false)
        k = gcd_u32(kind_count(windows, n_layers, w), k);
    g->n_layers = n_layers;
    g->layers_per_group = k;
    g->n_groups = n_layers / k;
    uint32_t base = 0;
    for (bool first = true; next_kind(windows, n_layers, first, w, &w); first = false) {
        uint32_t idx = 0;
        for (uint32_t l = 0; l < n_layers; l++) {
            if ((windows ? windows[l] : 0) != w)
                continue;
            g->group_of[l] = (uint16_t)(base + idx / k);
            g->slot_of[l] = (uint16_t)(idx % k);
            g->window[base + idx / k] = w;
            idx++;
        }
        if (w == 0)
            g->n_full = idx / k;
        base += idx / k;
    }
    return TDM_OK;
}

tdm_kv_layout_t tdm_kv_group_layout(const tdm_kv_layout_t *l, const tdm_kv_groups_t *g)
{
    tdm_kv_layout_t out = *l;
    out.n_layers = g->layers_per_group;
    return out;
}

uint64_t tdm_kv_group_hash(uint64_t h, uint32_t gi)
{
    if (gi == 0)
        return h;
    uint8_t le[4] = {(uint8_t)gi, (uint8_t)(gi >> 8), (uint8_t)(gi >> 16), (uint8_t)(gi >> 24)};
    return XXH3_64bits_withSeed(le, sizeof le, h);
}

/* First table entry a window-W group still needs once n tokens are computed: the block of
 * the oldest key the next query (position n) reads. 0 for full attention. */
static uint64_t first_needed(uint32_t window, uint32_t block_size, uint64_t n)
{
    return window == 0 || n + 1 <= window ? 0 : (n + 1 - window) / block_size;
}

uint64_t tdm_kv_group_first_needed(const tdm_kv_groups_t *g, uint32_t gi, uint32_t block_size,
                                   uint64_t n)
{
    return first_needed(g->window[gi], block_size, n);
}

static uint64_t blocks_for(uint64_t tokens, uint32_t block_size)
{
    return tokens / block_size + (tokens % block_size != 0);
}

uint64_t tdm_kv_group_live(const tdm_kv_groups_t *g, uint32_t gi, uint32_t block_size, uint64_t n,
                           uint64_t m)
{
    uint64_t have = blocks_for(m, block_size);
    uint64_t first = first_needed(g->window[gi], block_size, n);
    return have > first ? have - first : 0;
}

uint64_t tdm_kv_group_peak(const tdm_kv_groups_t *g, uint32_t gi, uint32_t block_size,
                           uint64_t n_ctx)
{
    uint32_t w = g->window[gi];
    if (n_ctx == 0)
        return 0;
    if (w == 0)
        return blocks_for(n_ctx, block_size);
    /* live(n, n + 1) grows with n up to n = W - 1 (nothing is given back yet), then repeats
     * with period block_size: the last W - 1 .. W - 1 + block_size cover every phase. */
    uint64_t last = n_ctx - 1;
    uint64_t n0 = last < w - 1 ? last : w - 1;
    uint64_t peak = tdm_kv_group_live(g, gi, block_size, n0, n0 + 1);
    for (uint64_t n = (uint64_t)w; n <= last && n <= (uint64_t)w + block_size; n++) {
        uint64_t v = tdm_kv_group_live(g, gi, block_size, n, n + 1);
        peak = v > peak ? v : peak;
    }
    return peak;
}

uint64_t tdm_kv_groups_blocks_per_seq(const tdm_kv_groups_t *g, uint32_t block_size, uint64_t n_ctx)
{
    uint64_t sum = 0;
    for (uint32_t gi = 0; gi < g->n_groups; gi++)
        sum += tdm_kv_group_peak(g, gi, block_size, n_ctx);
    return sum;
}

/* ---- sequences ---- */

int tdm_kv_hseq_init(tdm_kv_hseq_t *hs, const tdm_kv_groups_t *groups, tdm_error_t *err)
{
    memset(hs, 0, sizeof *hs);
    hs->tab = calloc(groups->n_groups, sizeof *hs->tab);
    if (!hs->tab)
        return tdm_error_set(err, TDM_ERESOURCE, "kv: out of memory for %u block tables",
                             (unsigned)groups->n_groups);
    hs->groups = groups;
    return TDM_OK;
}

int tdm_kv_hseq_prepare(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, uint32_t max_tokens)
{
    for (uint32_t gi = 0; gi < hs->groups->n_groups; gi++)
        if (tdm_kv_seq_prepare(pool, &hs->tab[gi], max_tokens) != TDM_OK)
            return TDM_ERESOURCE;
    return TDM_OK;
}

int tdm_kv_hseq_reserve(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, uint32_t n_tokens)
{
    const uint32_t bs = tdm_kv_pool_layout(pool)->block_size;
    const uint32_t need = (uint32_t)blocks_for(n_tokens, bs);
    uint64_t more = 0;
    for (uint32_t gi = 0; gi < hs->groups->n_groups; gi++)
        more += need > hs->tab[gi].n_blocks ? need - hs->tab[gi].n_blocks : 0;
    if (more == 0)
        return TDM_OK;
    if (more > tdm_kv_pool_available(pool) || tdm_kv_hseq_prepare(pool, hs, n_tokens) != TDM_OK)
        return TDM_ERESOURCE;
    for (uint32_t gi = 0; gi < hs->groups->n_groups; gi++) {
        tdm_kv_seq_t *t = &hs->tab[gi];
        if (need <= t->n_blocks)
            continue;
        int rc = tdm_kv_pool_alloc(pool, need - t->n_blocks, t->blocks + t->n_blocks);
        TDM_ASSERT(rc == TDM_OK); /* counted available above */
        (void)rc;
        t->n_blocks = need;
    }
    return TDM_OK;
}

/* Chained hashes of tokens' first n_blocks whole blocks into h[0..n_blocks). */
static void chain_hashes(const int32_t *tokens, uint32_t n_blocks, uint32_t bs, uint64_t *h)
{
    uint64_t parent = TDM_KV_HASH_SEED;
    for (uint32_t i = 0; i < n_blocks; i++)
        parent = h[i] = tdm_kv_block_hash(parent, tokens + (size_t)i * bs, bs);
}

/* Leading blocks every full-attention group has cached: the longest k <= n with every
 * (group, block) of blocks 0..k-1 registered. n without full-attention groups. */
static uint32_t full_run(const tdm_kv_pool_t *pool, const tdm_kv_groups_t *g, const uint64_t *h,
                         uint32_t n)
{
    if (g->n_full == 0)
        return n;
    for (uint32_t i = 0; i < n; i++)
        for (uint32_t gi = 0; gi < g->n_full; gi++)
            if (tdm_kv_pool_find(pool, tdm_kv_group_hash(h[i], gi)) == TDM_KV_NO_BLOCK)
                return i;
    return n;
}

/* Clears ok[k] (k in 1..n) where window group gi lacks a block the first query after a
 * k-block prefix reads; run[] is scratch of n entries. */
static void window_rule(const tdm_kv_pool_t *pool, const tdm_kv_groups_t *g, uint32_t gi,
                        uint32_t bs, const uint64_t *h, uint32_t n, uint32_t *run, bool *ok)
{
    for (uint32_t i = 0; i < n; i++) {
        bool reg = tdm_kv_pool_find(pool, tdm_kv_group_hash(h[i], gi)) != TDM_KV_NO_BLOCK;
        run[i] = reg ? (i > 0 ? run[i - 1] : 0) + 1 : 0; /* registered blocks ending at i */
    }
    for (uint32_t k = 1; k <= n; k++) {
        uint64_t first = first_needed(g->window[gi], bs, (uint64_t)k * bs);
        if (run[k - 1] < k - first)
            ok[k] = false;
    }
}

/* Takes the k-block prefix's blocks into every group's table (a window group only from the
 * first block the next query reads; the entries before it are TDM_KV_NO_BLOCK). */
static void take_prefix(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, const uint64_t *h, uint32_t k,
                        uint32_t bs)
{
    const tdm_kv_groups_t *g = hs->groups;
    for (uint32_t gi = 0; gi < g->n_groups; gi++) {
        tdm_kv_seq_t *t = &hs->tab[gi];
        uint32_t first = (uint32_t)first_needed(g->window[gi], bs, (uint64_t)k * bs);
        for (uint32_t i = 0; i < k; i++) {
            uint32_t b = TDM_KV_NO_BLOCK;
            if (i >= first) {
                b = tdm_kv_pool_find(pool, tdm_kv_group_hash(h[i], gi));
                TDM_ASSERT(b != TDM_KV_NO_BLOCK); /* checked by full_run / window_rule */
                tdm_kv_pool_acquire(pool, b);
            }
            t->blocks[i] = b;
        }
        t->n_blocks = k;
        t->n_dropped = first;
    }
    hs->n_tokens = k * bs;
    hs->n_hashed = k;
    hs->last_hash = h[k - 1];
}

size_t tdm_kv_hseq_match_scratch_bytes(uint32_t block_size, uint32_t n)
{
    uint32_t max_blocks = n == 0 ? 0 : (n - 1) / block_size;
    return (size_t)max_blocks * (sizeof(uint64_t) + sizeof(uint32_t) + sizeof(bool)) + sizeof(bool);
}

uint32_t tdm_kv_hseq_match_prefix(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, const int32_t *tokens,
                                  uint32_t n)
{
    return tdm_kv_hseq_match_prefix_with(pool, hs, tokens, n, NULL);
}

uint32_t tdm_kv_hseq_match_prefix_with(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs,
                                       const int32_t *tokens, uint32_t n, void *scratch)
{
    TDM_ASSERT(hs->n_tokens == 0 && tdm_kv_hseq_held(hs) == 0); /* a new sequence */
    const tdm_kv_groups_t *g = hs->groups;
    const uint32_t bs = tdm_kv_pool_layout(pool)->block_size;
    uint32_t max_blocks = n == 0 ? 0 : (n - 1) / bs; /* never all n: logits need a row */
    if (max_blocks == 0 || tdm_kv_hseq_prepare(pool, hs, max_blocks * bs) != TDM_OK)
        return 0;
    uint64_t *h = scratch ? scratch : malloc(tdm_kv_hseq_match_scratch_bytes(bs, n));
    if (!h)
        return 0; /* out of memory: compute everything */
    uint32_t *run = (uint32_t *)(h + max_blocks);
    bool *ok = (bool *)(run + max_blocks); /* ok[k], k in 0..max_blocks */
    chain_hashes(tokens, max_blocks, bs, h);
    uint32_t l = full_run(pool, g, h, max_blocks);
    for (uint32_t k = 0; k <= l; k++)
        ok[k] = true;
    for (uint32_t gi = g->n_full; gi < g->n_groups; gi++)
        window_rule(pool, g, gi, bs, h, l, run, ok);
    uint32_t k = l;
    while (k > 0 && !ok[k])
        k--;
    tdm_kv_pool_count_prefix(pool, l < max_blocks ? l + 1 : l, k);
    if (k > 0)
        take_prefix(pool, hs, h, k, bs);
    if (h != scratch)
        free(h);
    return hs->n_tokens;
}

void tdm_kv_hseq_commit(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, const int32_t *tokens,
                        uint32_t n_tokens)
{
    const tdm_kv_groups_t *g = hs->groups;
    const uint32_t bs = tdm_kv_pool_layout(pool)->block_size;
    const uint32_t full = n_tokens / bs;
    TDM_ASSERT(n_tokens >= hs->n_tokens); /* KV is never taken back */
    TDM_ASSERT(!tokens || full >= hs->n_hashed);
    uint64_t h = hs->n_hashed > 0 ? hs->last_hash : TDM_KV_HASH_SEED;
    for (uint32_t i = hs->n_hashed; tokens && i < full; i++) {
        h = tdm_kv_block_hash(h, tokens + (size_t)i * bs, bs);
        for (uint32_t gi = 0; gi < g->n_groups; gi++) {
            TDM_ASSERT(i < hs->tab[gi].n_blocks);
            uint32_t b = hs->tab[gi].blocks[i];
            if (b != TDM_KV_NO_BLOCK)
                (void)tdm_kv_pool_register(pool, b, tdm_kv_group_hash(h, gi));
        }
    }
    if (tokens && full > hs->n_hashed) {
        hs->n_hashed = full;
        hs->last_hash = h;
    }
    hs->n_tokens = n_tokens;
    for (uint32_t gi = g->n_full; gi < g->n_groups; gi++) {
        tdm_kv_seq_t *t = &hs->tab[gi];
        uint64_t first = first_needed(g->window[gi], bs, n_tokens);
        for (; t->n_dropped < first && t->n_dropped < t->n_blocks; t->n_dropped++) {
            tdm_kv_pool_unref(pool, t->blocks[t->n_dropped]);
            t->blocks[t->n_dropped] = TDM_KV_NO_BLOCK;
        }
    }
}

int tdm_kv_hseq_check_handover(const tdm_kv_hseq_t *hs, const tdm_kv_groups_t *groups,
                               uint32_t block_size, uint32_t n, tdm_error_t *err)
{
    if (!hs->tab || !hs->groups || hs->groups->n_groups != groups->n_groups ||
        hs->groups->layers_per_group != groups->layers_per_group ||
        memcmp(hs->groups->window, groups->window, groups->n_groups * sizeof *groups->window) != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "prefilled KV: its tables are not over this pool's %u layer groups",
                             (unsigned)groups->n_groups);
    uint64_t entries = blocks_for(n, block_size);
    for (uint32_t gi = 0; gi < groups->n_groups; gi++) {
        const tdm_kv_seq_t *t = &hs->tab[gi];
        uint64_t first = first_needed(groups->window[gi], block_size, n);
        if (t->n_blocks != entries || t->n_dropped > first)
            return tdm_error_set(err, TDM_EINVALID,
                                 "prefilled KV: group %u has %u entries from %u on; %u tokens "
                                 "need %llu from %llu on",
                                 (unsigned)gi, (unsigned)t->n_blocks, (unsigned)t->n_dropped,
                                 (unsigned)n, (unsigned long long)entries,
                                 (unsigned long long)first);
    }
    return TDM_OK;
}

int tdm_kv_hseq_reserve_handover(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, uint32_t n_tokens)
{
    TDM_ASSERT(tdm_kv_hseq_held(hs) == 0);
    const tdm_kv_groups_t *g = hs->groups;
    const uint32_t bs = tdm_kv_pool_layout(pool)->block_size;
    const uint32_t entries = (uint32_t)blocks_for(n_tokens, bs);
    uint64_t need = 0;
    for (uint32_t gi = 0; gi < g->n_groups; gi++)
        need += tdm_kv_group_live(g, gi, bs, n_tokens, n_tokens);
    if (need > tdm_kv_pool_available(pool) || tdm_kv_hseq_prepare(pool, hs, n_tokens) != TDM_OK)
        return TDM_ERESOURCE;
    for (uint32_t gi = 0; gi < g->n_groups; gi++) {
        tdm_kv_seq_t *t = &hs->tab[gi];
        uint32_t first = (uint32_t)first_needed(g->window[gi], bs, n_tokens);
        for (uint32_t i = 0; i < first; i++)
            t->blocks[i] = TDM_KV_NO_BLOCK;
        int rc = tdm_kv_pool_alloc(pool, entries - first, t->blocks + first);
        TDM_ASSERT(rc == TDM_OK); /* counted available above */
        (void)rc;
        t->n_blocks = entries;
        t->n_dropped = first;
    }
    hs->n_tokens = n_tokens;
    return TDM_OK;
}

uint32_t tdm_kv_hseq_live(const tdm_kv_hseq_t *hs, uint32_t *out)
{
    uint32_t k = 0;
    for (uint32_t gi = 0; hs->tab && gi < hs->groups->n_groups; gi++)
        for (uint32_t i = hs->tab[gi].n_dropped; i < hs->tab[gi].n_blocks; i++)
            out[k++] = hs->tab[gi].blocks[i];
    return k;
}

uint64_t tdm_kv_hseq_held(const tdm_kv_hseq_t *hs)
{
    uint64_t n = 0;
    for (uint32_t gi = 0; hs->tab && gi < hs->groups->n_groups; gi++)
        n += hs->tab[gi].n_blocks - hs->tab[gi].n_dropped;
    return n;
}

void tdm_kv_hseq_clear(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs)
{
    for (uint32_t gi = 0; hs->tab && gi < hs->groups->n_groups; gi++)
        tdm_kv_seq_clear(pool, &hs->tab[gi]);
    hs->n_tokens = 0;
    hs->n_hashed = 0;
    hs->last_hash = 0;
}

void tdm_kv_hseq_release(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs)
{
    for (uint32_t gi = 0; hs->tab && gi < hs->groups->n_groups; gi++)
        tdm_kv_seq_release(pool, &hs->tab[gi]);
    free(hs->tab);
    memset(hs, 0, sizeof *hs);
}
