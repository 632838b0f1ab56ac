/* kv.c - the paged KV cache: layout and sizing, the block pool (free list, reference counts,
 * LRU of cached blocks, hash index) and per-sequence block tables (see tandem/kv.h).
 *
 * Every block is in exactly one of three states:
 *   free    refcount 0, no hash: on the free list (a LIFO stack linked through next[]);
 *   cached  refcount 0, hash registered in the index: on the LRU list (doubly linked through
 *           prev[]/next[]; freed blocks join at the tail, evictions take the head);
 *   used    refcount > 0, with or without a registered hash: on no list.
 * A block is "registered" when the index maps its hash to it; at most one block per hash is
 * registered (a sequence that computes a block whose hash is already registered keeps its own
 * copy unregistered, and that copy goes back to the free list when released).
 *
 * The hash index is open addressing with linear probing over a power-of-two table of block
 * ids, at least twice the number of blocks (load factor <= 1/2), with backward-shift deletion
 * (no tombstones). The key of a slot is hash[block], so the table is 4 bytes per slot.
 *
 * Two different prefixes with the same 64-bit hash would share KV wrongly; with XXH3 the
 * chance is about n^2 / 2^65 for n registered blocks, which we accept (vLLM does the same).
 *
 * Assumes a little-endian host for the token bytes hashed (as the GGUF reader does), with a
 * portable path for big-endian hosts.
 */
#define _DEFAULT_SOURCE /* MAP_ANONYMOUS */
#include "tandem/kv.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <xxhash.h>

/* TDM_KV_NO_BLOCK marks "no block" in the index and in the list links. */

struct tdm_kv_pool {
    tdm_kv_layout_t layout;
    uint64_t block_bytes; /* bytes of one block */
    uint32_t n_blocks;
    uint8_t *base;     /* [n_blocks][block_bytes], page-aligned anonymous mapping */
    size_t base_bytes; /* length of the mapping */

    uint32_t *refcount; /* [n_blocks] */
    uint64_t *hash;     /* [n_blocks] chained hash; meaningful when registered[b] */
    bool *registered;   /* [n_blocks] hash[b] is in the index and points to b */
    uint32_t *next;     /* [n_blocks] free list / LRU links */
    uint32_t *prev;     /* [n_blocks] LRU links */

    uint32_t free_head; /* top of the free stack */
    uint32_t lru_head;  /* least recently freed cached block (evicted first) */
    uint32_t lru_tail;  /* most recently freed cached block */

    uint32_t *index;     /* [index_cap] block ids or TDM_KV_NO_BLOCK */
    uint64_t index_mask; /* index_cap - 1 */
    uint32_t n_indexed;  /* registered blocks */

    tdm_kv_stats_t stats;
    tdm_kv_groups_t *groups; /* tdm_kv_pool_new_grouped with windows or several groups; NULL
                                otherwise */
};

/* ---- dtypes, layout and sizing ---- */

static const char *const dtype_names[] = {"f32", "f16", "q8"};

const char *tdm_kv_layout_mismatch(const tdm_kv_layout_t *got, const tdm_kv_layout_t *want,
                                   uint32_t *got_v, uint32_t *want_v)
{
    const struct {
        const char *name;
        uint32_t g, w;
    } f[] = {
        {"n_layers", got->n_layers, want->n_layers},
        {"n_kv_heads", got->n_kv_heads, want->n_kv_heads},
        {"head_dim", got->head_dim, want->head_dim},
        {"block_size", got->block_size, want->block_size},
        {"dtype", (uint32_t)got->dtype, (uint32_t)want->dtype},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].g != f[i].w) {
            *got_v = f[i].g;
            *want_v = f[i].w;
            return f[i].name;
        }
    return NULL;
}

const char *tdm_kv_dtype_name(tdm_kv_dtype_t dtype)
{
    return (unsigned)dtype < sizeof dtype_names / sizeof dtype_names[0] ? dtype_names[dtype] : "?";
}

int tdm_kv_dtype_parse(const char *name, tdm_kv_dtype_t *out, tdm_error_t *err)
{
    for (unsigned i = 0; name && i < sizeof dtype_names / sizeof dtype_names[0]; i++) {
        if (strcmp(name, dtype_names[i]) == 0) {
            *out = (tdm_kv_dtype_t)i;
            return TDM_OK;
        }
    }
    return tdm_error_set(err, TDM_EINVALID, "unknown KV dtype '%s' (expected f32, f16 or q8)",
                         name ? name : "(null)");
}

uint32_t tdm_kv_bytes_per_value(tdm_kv_dtype_t dtype)
{
    switch (dtype) {
    case TDM_KV_F32: return 4;
    case TDM_KV_F16: return 2;
    case TDM_KV_Q8: return 1;
    }
    return 0;
}

/* a * b, saturating at UINT64_MAX, so that sizes of absurd layouts compare as "too big"
 * instead of wrapping to small numbers. */
static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    return tdm_mul_u64(a, b, &r) ? r : UINT64_MAX;
}

uint64_t tdm_kv_bytes_per_token(const tdm_kv_layout_t *l)
{
    uint64_t n = mul_sat(2, l->n_layers);
    n = mul_sat(n, l->n_kv_heads);
    n = mul_sat(n, l->head_dim);
    return mul_sat(n, tdm_kv_bytes_per_value(l->dtype));
}

uint64_t tdm_kv_record_bytes(const tdm_kv_layout_t *l)
{
    uint64_t values =
        mul_sat(mul_sat(l->block_size, l->head_dim), tdm_kv_bytes_per_value(l->dtype));
    if (l->dtype == TDM_KV_Q8 && values != UINT64_MAX)
        values += sizeof(float); /* the record's scale, stored first */
    return values;
}

uint64_t tdm_kv_block_bytes(const tdm_kv_layout_t *l)
{
    uint64_t records = mul_sat(mul_sat(2, l->n_layers), l->n_kv_heads);
    return mul_sat(records, tdm_kv_record_bytes(l));
}

uint64_t tdm_kv_blocks_for_tokens(const tdm_kv_layout_t *l, uint64_t n_tokens)
{
    return n_tokens / l->block_size + (n_tokens % l->block_size != 0);
}

int tdm_kv_layout_check(const tdm_kv_layout_t *l, tdm_error_t *err)
{
    if (l->n_layers == 0)
        return tdm_error_set(err, TDM_EINVALID, "kv layout: n_layers must be positive, got 0");
    if (l->n_kv_heads == 0)
        return tdm_error_set(err, TDM_EINVALID, "kv layout: n_kv_heads must be positive, got 0");
    if (l->head_dim == 0 || l->head_dim % 4 != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "kv layout: head_dim must be a positive multiple of 4, got %u",
                             (unsigned)l->head_dim);
    if (l->block_size == 0 || l->block_size > 256 || (l->block_size & (l->block_size - 1)) != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "kv layout: block_size must be a power of two in 1..256, got %u",
                             (unsigned)l->block_size);
    if ((unsigned)l->dtype >= sizeof dtype_names / sizeof dtype_names[0])
        return tdm_error_set(err, TDM_EINVALID, "kv layout: dtype must be f32, f16 or q8, got %d",
                             (int)l->dtype);
    uint64_t block_bytes = tdm_kv_block_bytes(l);
    if (block_bytes > UINT32_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "kv layout: block_bytes must fit in 32 bits, got %llu%s (2 * "
                             "n_layers %u * n_kv_heads %u records of block_size %u * head_dim "
                             "%u %s values)",
                             (unsigned long long)block_bytes,
                             block_bytes == UINT64_MAX ? " or more" : "", (unsigned)l->n_layers,
                             (unsigned)l->n_kv_heads, (unsigned)l->block_size,
                             (unsigned)l->head_dim, dtype_names[l->dtype]);
    return TDM_OK;
}

/* The KV side of a plan: per token, block, sequence and for every user. Returns false when
 * n_users x n_ctx passes 2^64 bytes. */
static bool plan_kv(const tdm_kv_plan_in_t *in, tdm_kv_plan_t *out)
{
    const tdm_kv_layout_t *l = &in->layout;
    out->bytes_per_token = tdm_kv_bytes_per_token(l);
    if (in->groups) {
        tdm_kv_layout_t gl = tdm_kv_group_layout(l, in->groups);
        out->block_bytes = tdm_kv_block_bytes(&gl);
        out->blocks_per_seq = tdm_kv_groups_blocks_per_seq(in->groups, l->block_size, in->n_ctx);
    } else {
        out->block_bytes = tdm_kv_block_bytes(l);
        out->blocks_per_seq = tdm_kv_blocks_for_tokens(l, in->n_ctx);
    }
    tdm_kv_layout_t mha = *l;
    mha.n_kv_heads = in->n_heads ? in->n_heads : l->n_kv_heads;
    out->mha_bytes_per_token = tdm_kv_bytes_per_token(&mha);
    out->gqa_factor = (double)mha.n_kv_heads / (double)l->n_kv_heads;
    uint64_t fixed;
    return tdm_mul_u64(out->blocks_per_seq, out->block_bytes, &out->bytes_per_seq) &&
           tdm_mul_u64(out->blocks_per_seq, in->n_users, &out->blocks_total) &&
           tdm_mul_u64(out->bytes_per_seq, in->n_users, &out->bytes_total) &&
           tdm_add_u64(in->weight_bytes, in->scratch_bytes, &fixed) &&
           tdm_add_u64(out->bytes_total, fixed, &out->need_bytes);
}

/* The memory side of a plan: the pool the budget buys (as a node sizes it) and the fit. */
static void plan_memory(const tdm_kv_plan_in_t *in, tdm_kv_plan_t *out)
{
    uint64_t m = in->memory_bytes;
    uint64_t fixed = in->weight_bytes + in->scratch_bytes; /* <= need_bytes: no overflow */
    out->pool_budget_bytes = m > fixed ? m - fixed : 0;
    out->pool_blocks = out->pool_budget_bytes / out->block_bytes;
    out->pool_tokens = out->pool_blocks / (in->groups ? in->groups->n_groups : 1) *
                       in->layout.block_size; /* block_bytes >= 8 * block_size */
    out->max_seqs = out->pool_blocks / out->blocks_per_seq;
    out->fits = out->need_bytes <= m;
    out->spare_bytes = out->fits ? m - out->need_bytes : 0;
    out->short_bytes = out->fits ? 0 : out->need_bytes - m;
}

int tdm_kv_plan(const tdm_kv_plan_in_t *in, tdm_kv_plan_t *out, tdm_error_t *err)
{
    memset(out, 0, sizeof *out);
    const tdm_kv_layout_t *l = &in->layout;
    int rc = tdm_kv_layout_check(l, err);
    if (rc != TDM_OK)
        return rc;
    if (in->n_ctx == 0 || in->n_users == 0)
        return tdm_error_set(err, TDM_EINVALID, "kv plan: %s must be positive, got 0",
                             in->n_ctx == 0 ? "n_ctx" : "n_users");
    if (in->groups && in->groups->n_layers != l->n_layers)
        return tdm_error_set(err, TDM_EINVALID,
                             "kv plan: groups cover %u layers, the layout has n_layers %u",
                             (unsigned)in->groups->n_layers, (unsigned)l->n_layers);
    if (in->n_heads % l->n_kv_heads != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "kv plan: n_heads must be a multiple of n_kv_heads (%u), got %u",
                             (unsigned)l->n_kv_heads, (unsigned)in->n_heads);
    if (!plan_kv(in, out)) {
        memset(out, 0, sizeof *out);
        return tdm_error_set(err, TDM_ERESOURCE,
                             "kv plan: %llu users x %llu tokens need more than 2^64 bytes",
                             (unsigned long long)in->n_users, (unsigned long long)in->n_ctx);
    }
    if (in->have_memory)
        plan_memory(in, out);
    return TDM_OK;
}

int tdm_kv_plan_budget(const tdm_kv_layout_t *l, uint64_t n_blocks, uint64_t fixed_bytes,
                       uint64_t *out, tdm_error_t *err)
{
    uint64_t kv, total;
    if (!tdm_mul_u64(n_blocks, tdm_kv_block_bytes(l), &kv) || !tdm_add_u64(kv, fixed_bytes, &total))
        return tdm_error_set(
            err, TDM_ERESOURCE, "kv plan: %llu blocks of %llu bytes and %llu bytes more pass 2^64",
            (unsigned long long)n_blocks, (unsigned long long)tdm_kv_block_bytes(l),
            (unsigned long long)fixed_bytes);
    *out = total;
    return TDM_OK;
}

/* ---- block hashes ---- */

uint64_t tdm_kv_block_hash(uint64_t parent, const int32_t *tokens, uint32_t block_size)
{
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
    return XXH3_64bits_withSeed(tokens, (size_t)block_size * sizeof(int32_t), parent);
#else
    /* Big-endian host: feed the same little-endian bytes through the streaming API, so that
     * every node computes the same hash for the same tokens. */
    XXH3_state_t st;
    XXH3_64bits_reset_withSeed(&st, parent);
    for (uint32_t i = 0; i < block_size; i++) {
        uint32_t v = (uint32_t)tokens[i];
        unsigned char le[4] = {(unsigned char)v, (unsigned char)(v >> 8), (unsigned char)(v >> 16),
                               (unsigned char)(v >> 24)};
        XXH3_64bits_update(&st, le, sizeof le);
    }
    return XXH3_64bits_digest(&st);
#endif
}

/* ---- the hash index ---- */

/* The home slot of a hash. XXH3 output is uniform, so its low bits do. */
static uint64_t index_home(const tdm_kv_pool_t *pool, uint64_t h)
{
    return h & pool->index_mask;
}

/* The block registered for h, or TDM_KV_NO_BLOCK. */
static uint32_t index_find(const tdm_kv_pool_t *pool, uint64_t h)
{
    for (uint64_t i = index_home(pool, h);; i = (i + 1) & pool->index_mask) {
        uint32_t b = pool->index[i];
        if (b == TDM_KV_NO_BLOCK)
            return TDM_KV_NO_BLOCK;
        if (pool->hash[b] == h)
            return b;
    }
}

/* Registers block b (whose hash[b] is set) in the index; its hash must not be there yet.
 * The table has at least 2 * n_blocks slots, so an empty slot always exists. */
static void index_insert(tdm_kv_pool_t *pool, uint32_t b)
{
    uint64_t i = index_home(pool, pool->hash[b]);
    while (pool->index[i] != TDM_KV_NO_BLOCK)
        i = (i + 1) & pool->index_mask;
    pool->index[i] = b;
    pool->registered[b] = true;
    pool->n_indexed++;
}

/* Removes registered block b from the index by backward-shift deletion: entries after the
 * hole that could live in it (their home is not strictly between the hole and them, in probe
 * order) move back, so lookups never need tombstones (Knuth 6.4, algorithm R). */
static void index_remove(tdm_kv_pool_t *pool, uint32_t b)
{
    uint64_t i = index_home(pool, pool->hash[b]);
    while (pool->index[i] != b)
        i = (i + 1) & pool->index_mask;
    uint64_t hole = i;
    for (uint64_t j = (hole + 1) & pool->index_mask; pool->index[j] != TDM_KV_NO_BLOCK;
         j = (j + 1) & pool->index_mask) {
        uint64_t home = index_home(pool, pool->hash[pool->index[j]]);
        /* distance from home to j and from hole to j, in probe order */
        uint64_t d_home = (j - home) & pool->index_mask;
        uint64_t d_hole = (j - hole) & pool->index_mask;
        if (d_home >= d_hole) {
            pool->index[hole] = pool->index[j];
            hole = j;
        }
    }
    pool->index[hole] = TDM_KV_NO_BLOCK;
    pool->registered[b] = false;
    pool->n_indexed--;
}

/* ---- lists ---- */

static void free_push(tdm_kv_pool_t *pool, uint32_t b)
{
    pool->next[b] = pool->free_head;
    pool->free_head = b;
    pool->stats.n_free++;
}

static uint32_t free_pop(tdm_kv_pool_t *pool)
{
    uint32_t b = pool->free_head;
    pool->free_head = pool->next[b];
    pool->stats.n_free--;
    return b;
}

/* Appends b at the most recently used end of the LRU list. */
static void lru_push(tdm_kv_pool_t *pool, uint32_t b)
{
    pool->prev[b] = pool->lru_tail;
    pool->next[b] = TDM_KV_NO_BLOCK;
    if (pool->lru_tail != TDM_KV_NO_BLOCK)
        pool->next[pool->lru_tail] = b;
    else
        pool->lru_head = b;
    pool->lru_tail = b;
    pool->stats.n_cached++;
}

static void lru_remove(tdm_kv_pool_t *pool, uint32_t b)
{
    if (pool->prev[b] != TDM_KV_NO_BLOCK)
        pool->next[pool->prev[b]] = pool->next[b];
    else
        pool->lru_head = pool->next[b];
    if (pool->next[b] != TDM_KV_NO_BLOCK)
        pool->prev[pool->next[b]] = pool->prev[b];
    else
        pool->lru_tail = pool->prev[b];
    pool->prev[b] = pool->next[b] = TDM_KV_NO_BLOCK;
    pool->stats.n_cached--;
}

/* ---- the pool ---- */

/* The per-block tables and the hash index of a pool whose layout and n_blocks are set; every
 * block starts on the free list. Returns TDM_OK or TDM_ERESOURCE (the caller destroys the
 * pool, which frees what was allocated). */
static int pool_tables_new(tdm_kv_pool_t *pool)
{
    uint32_t n_blocks = pool->n_blocks;
    /* Index slots: the smallest power of two >= 2 * n_blocks (n_blocks < 2^32, so <= 2^33). */
    uint64_t index_cap = 1;
    while (index_cap < 2 * (uint64_t)n_blocks)
        index_cap <<= 1;
    pool->refcount = calloc(n_blocks, sizeof *pool->refcount);
    pool->hash = calloc(n_blocks, sizeof *pool->hash);
    pool->registered = calloc(n_blocks, sizeof *pool->registered);
    pool->next = malloc((size_t)n_blocks * sizeof *pool->next);
    pool->prev = malloc((size_t)n_blocks * sizeof *pool->prev);
    pool->index = malloc((size_t)index_cap * sizeof *pool->index);
    if (!pool->refcount || !pool->hash || !pool->registered || !pool->next || !pool->prev ||
        !pool->index)
        return TDM_ERESOURCE;
    memset(pool->index, 0xff, (size_t)index_cap * sizeof *pool->index); /* all TDM_KV_NO_BLOCK */
    pool->index_mask = index_cap - 1;

    pool->free_head = pool->lru_head = pool->lru_tail = TDM_KV_NO_BLOCK;
    for (uint32_t b = n_blocks; b-- > 0;) { /* so block 0 is allocated first */
        pool->prev[b] = TDM_KV_NO_BLOCK;
        free_push(pool, b);
    }
    return TDM_OK;
}

tdm_kv_pool_t *tdm_kv_pool_new(const tdm_kv_layout_t *layout, uint32_t n_blocks, tdm_error_t *err)
{
    if (tdm_kv_layout_check(layout, err) != TDM_OK)
        return NULL;
    if (n_blocks == 0 || n_blocks == TDM_KV_NO_BLOCK) {
        tdm_error_set(err, TDM_EINVALID, "kv pool: n_blocks must be in 1..%u, got %u",
                      (unsigned)(TDM_KV_NO_BLOCK - 1), (unsigned)n_blocks);
        return NULL;
    }
    uint64_t block_bytes = tdm_kv_block_bytes(layout);
    /* The pool's bytes, rounded up to the alignment as aligned_alloc requires. */
    size_t pool_bytes;
    if (!tdm_mul_size((size_t)block_bytes, n_blocks, &pool_bytes) ||
        !tdm_add_size(pool_bytes, 63, &pool_bytes)) {
        tdm_error_set(err, TDM_ERESOURCE,
                      "kv pool: %u blocks of %llu bytes do not fit in the address space",
                      (unsigned)n_blocks, (unsigned long long)block_bytes);
        return NULL;
    }
    pool_bytes &= ~(size_t)63;

    tdm_kv_pool_t *pool = calloc(1, sizeof *pool);
    if (!pool)
        goto out_oom;
    pool->layout = *layout;
    pool->block_bytes = block_bytes;
    pool->n_blocks = n_blocks;
    /* The big region first: a budget too large for the machine fails before the tables. */
    /* Anonymous mmap: page-aligned and zero, and pages are committed only when first
     * written, so a large budget costs memory only for the blocks actually used. */
    void *base = mmap(NULL, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
        tdm_error_set(err, TDM_ERESOURCE,
                      "kv pool: cannot allocate %zu bytes (%u blocks of %llu bytes)", pool_bytes,
                      (unsigned)n_blocks, (unsigned long long)block_bytes);
        tdm_kv_pool_destroy(&pool);
        return NULL;
    }
    pool->base = base;
    pool->base_bytes = pool_bytes;
    if (pool_tables_new(pool) != TDM_OK)
        goto out_free_pool;
    pool->stats.n_blocks = n_blocks;
    return pool;

out_free_pool:
    tdm_kv_pool_destroy(&pool);
out_oom:
    tdm_error_set(err, TDM_ERESOURCE, "kv pool: out of memory for the tables of %u blocks",
                  (unsigned)n_blocks);
    return NULL;
}

tdm_kv_pool_t *tdm_kv_pool_new_grouped(const tdm_kv_layout_t *layout, const tdm_kv_groups_t *groups,
                                       uint32_t n_blocks, tdm_error_t *err)
{
    if (groups->n_layers != layout->n_layers) {
        tdm_error_set(err, TDM_EINVALID,
                      "kv pool: the layer groups cover %u layers, the layout has n_layers %u",
                      (unsigned)groups->n_layers, (unsigned)layout->n_layers);
        return NULL;
    }
    tdm_kv_layout_t gl = tdm_kv_group_layout(layout, groups);
    tdm_kv_pool_t *pool = tdm_kv_pool_new(&gl, n_blocks, err);
    if (!pool || (groups->n_groups == 1 && groups->window[0] == 0))
        return pool; /* one full-attention group: the plain pool */
    pool->groups = malloc(sizeof *pool->groups);
    if (!pool->groups) {
        tdm_kv_pool_destroy(&pool);
        tdm_error_set(err, TDM_ERESOURCE, "kv pool: out of memory for the layer groups");
        return NULL;
    }
    *pool->groups = *groups;
    return pool;
}

const tdm_kv_groups_t *tdm_kv_pool_groups(const tdm_kv_pool_t *pool)
{
    return pool->groups;
}

void tdm_kv_pool_destroy(tdm_kv_pool_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_kv_pool_t *pool = *self_p;
    if (pool->base)
        munmap(pool->base, pool->base_bytes);
    free(pool->index);
    free(pool->prev);
    free(pool->next);
    free(pool->registered);
    free(pool->hash);
    free(pool->refcount);
    free(pool->groups);
    free(pool);
    *self_p = NULL;
}

const tdm_kv_layout_t *tdm_kv_pool_layout(const tdm_kv_pool_t *pool)
{
    return &pool->layout;
}

void *tdm_kv_pool_base(tdm_kv_pool_t *pool)
{
    return pool->base;
}

uint64_t tdm_kv_pool_block_bytes(const tdm_kv_pool_t *pool)
{
    return pool->block_bytes;
}

void tdm_kv_pool_stats(const tdm_kv_pool_t *pool, tdm_kv_stats_t *out)
{
    *out = pool->stats;
}

uint32_t tdm_kv_pool_available(const tdm_kv_pool_t *pool)
{
    return pool->stats.n_free + pool->stats.n_cached;
}

uint32_t tdm_kv_pool_refcount(const tdm_kv_pool_t *pool, uint32_t block)
{
    TDM_ASSERT(block < pool->n_blocks);
    return pool->refcount[block];
}

uint32_t tdm_kv_pool_find(const tdm_kv_pool_t *pool, uint64_t hash)
{
    return index_find(pool, hash);
}

int tdm_kv_pool_alloc(tdm_kv_pool_t *pool, uint32_t n, uint32_t *blocks_out)
{
    if (n > tdm_kv_pool_available(pool))
        return TDM_ERESOURCE;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t b;
        if (pool->free_head != TDM_KV_NO_BLOCK) {
            b = free_pop(pool);
        } else {
            /* Evict the least recently freed cached block: it forgets its prefix. */
            b = pool->lru_head;
            lru_remove(pool, b);
            index_remove(pool, b);
            pool->stats.evictions++;
        }
        pool->refcount[b] = 1;
        pool->stats.n_used++;
        blocks_out[i] = b;
    }
    return TDM_OK;
}

void tdm_kv_pool_ref(tdm_kv_pool_t *pool, uint32_t block)
{
    TDM_ASSERT(block < pool->n_blocks);
    TDM_ASSERT(pool->refcount[block] > 0); /* only used blocks are shared this way */
    TDM_ASSERT(pool->refcount[block] < UINT32_MAX);
    pool->refcount[block]++;
}

void tdm_kv_pool_unref(tdm_kv_pool_t *pool, uint32_t block)
{
    TDM_ASSERT(block < pool->n_blocks);
    TDM_ASSERT(pool->refcount[block] > 0); /* unref of a free or cached block */
    if (--pool->refcount[block] > 0)
        return;
    pool->stats.n_used--;
    if (pool->registered[block])
        lru_push(pool, block);
    else
        free_push(pool, block);
}

/* Takes a reference to a block found in the index: revives a cached block out of the LRU, or
 * adds a reference to a used one. */
static void pool_ref_found(tdm_kv_pool_t *pool, uint32_t b)
{
    if (pool->refcount[b] == 0) {
        lru_remove(pool, b);
        pool->stats.n_used++;
    }
    pool->refcount[b]++;
}

void tdm_kv_pool_acquire(tdm_kv_pool_t *pool, uint32_t block)
{
    TDM_ASSERT(block < pool->n_blocks);
    TDM_ASSERT(pool->registered[block] || pool->refcount[block] > 0);
    TDM_ASSERT(pool->refcount[block] < UINT32_MAX);
    pool_ref_found(pool, block);
}

void tdm_kv_pool_count_prefix(tdm_kv_pool_t *pool, uint64_t queried, uint64_t hit)
{
    TDM_ASSERT(hit <= queried);
    pool->stats.prefix_queries += queried;
    pool->stats.prefix_hits += hit;
}

bool tdm_kv_pool_register(tdm_kv_pool_t *pool, uint32_t block, uint64_t hash)
{
    TDM_ASSERT(block < pool->n_blocks);
    TDM_ASSERT(pool->refcount[block] > 0 && !pool->registered[block]);
    if (index_find(pool, hash) != TDM_KV_NO_BLOCK)
        return false;
    pool->hash[block] = hash;
    index_insert(pool, block);
    return true;
}

int tdm_kv_pool_check(const tdm_kv_pool_t *pool, tdm_error_t *err)
{
    const tdm_kv_stats_t *s = &pool->stats;
    if ((uint64_t)s->n_used + s->n_cached + s->n_free != s->n_blocks ||
        s->n_blocks != pool->n_blocks)
        return tdm_error_set(err, TDM_EINTERNAL, "kv pool: used %u + cached %u + free %u != %u",
                             s->n_used, s->n_cached, s->n_free, s->n_blocks);
    uint32_t used = 0, cached = 0, free_n = 0, registered = 0;
    for (uint32_t b = 0; b < pool->n_blocks; b++) {
        used += pool->refcount[b] > 0;
        if (pool->registered[b]) {
            registered++;
            if (index_find(pool, pool->hash[b]) != b)
                return tdm_error_set(err, TDM_EINTERNAL,
                                     "kv pool: block %u is registered but its hash finds %u", b,
                                     index_find(pool, pool->hash[b]));
        }
    }
    for (uint32_t b = pool->free_head; b != TDM_KV_NO_BLOCK; b = pool->next[b]) {
        if (++free_n > pool->n_blocks || pool->refcount[b] != 0 || pool->registered[b])
            return tdm_error_set(err, TDM_EINTERNAL, "kv pool: bad free list at block %u", b);
    }
    uint32_t prev = TDM_KV_NO_BLOCK;
    for (uint32_t b = pool->lru_head; b != TDM_KV_NO_BLOCK; prev = b, b = pool->next[b]) {
        if (++cached > pool->n_blocks || pool->refcount[b] != 0 || !pool->registered[b] ||
            pool->prev[b] != prev)
            return tdm_error_set(err, TDM_EINTERNAL, "kv pool: bad LRU list at block %u", b);
    }
    if (prev != pool->lru_tail)
        return tdm_error_set(err, TDM_EINTERNAL, "kv pool: LRU tail is %u, list ends at %u",
                             pool->lru_tail, prev);
    uint64_t slots = 0;
    for (uint64_t i = 0; i <= pool->index_mask; i++)
        slots += pool->index[i] != TDM_KV_NO_BLOCK;
    if (used != s->n_used || cached != s->n_cached || free_n != s->n_free ||
        registered != pool->n_indexed || slots != registered)
        return tdm_error_set(err, TDM_EINTERNAL,
                             "kv pool: counted used %u cached %u free %u registered %u slots %llu;"
                             " stats say used %u cached %u free %u registered %u",
                             used, cached, free_n, registered, (unsigned long long)slots, s->n_used,
                             s->n_cached, s->n_free, pool->n_indexed);
    return TDM_OK;
}

/* ---- sequences ---- */

void tdm_kv_seq_init(tdm_kv_seq_t *seq)
{
    memset(seq, 0, sizeof *seq);
}

/* Grows the table to hold at least n entries (doubling). false on out of memory (the table is
 * unchanged). */
static bool seq_grow(tdm_kv_seq_t *seq, uint32_t n)
{
    if (n <= seq->cap)
        return true;
    uint64_t cap = seq->cap ? seq->cap : 8;
    while (cap < n)
        cap *= 2;
    if (cap > UINT32_MAX)
        cap = UINT32_MAX;
    uint32_t *blocks = realloc(seq->blocks, (size_t)cap * sizeof *blocks);
    if (!blocks)
        return false;
    seq->blocks = blocks;
    seq->cap = (uint32_t)cap;
    return true;
}

int tdm_kv_seq_prepare(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, uint32_t max_tokens)
{
    uint64_t need = tdm_kv_blocks_for_tokens(&pool->layout, max_tokens);
    return need <= UINT32_MAX && seq_grow(seq, (uint32_t)need) ? TDM_OK : TDM_ERESOURCE;
}

int tdm_kv_seq_reserve(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, uint32_t n_tokens)
{
    uint32_t need = (uint32_t)tdm_kv_blocks_for_tokens(&pool->layout, n_tokens);
    if (need <= seq->n_blocks)
        return TDM_OK;
    uint32_t more = need - seq->n_blocks;
    if (more > tdm_kv_pool_available(pool))
        return TDM_ERESOURCE;
    if (!seq_grow(seq, need))
        return TDM_ERESOURCE;
    int rc = tdm_kv_pool_alloc(pool, more, seq->blocks + seq->n_blocks);
    if (rc != TDM_OK)
        return rc;
    seq->n_blocks = need;
    return TDM_OK;
}

uint32_t tdm_kv_seq_match_prefix(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, const int32_t *tokens,
                                 uint32_t n)
{
    TDM_ASSERT(seq->n_blocks == 0 && seq->n_tokens == 0); /* a new sequence */
    const uint32_t bs = pool->layout.block_size;
    /* Full blocks only, and never all n tokens: the last one must be computed for logits. */
    uint32_t max_blocks = n == 0 ? 0 : (n - 1) / bs;
    if (max_blocks == 0 || !seq_grow(seq, max_blocks))
        return 0; /* out of memory for the table: just compute everything */
    uint64_t h = TDM_KV_HASH_SEED;
    uint32_t i = 0;
    for (; i < max_blocks; i++) {
        uint64_t hi = tdm_kv_block_hash(h, tokens + (size_t)i * bs, bs);
        pool->stats.prefix_queries++;
        uint32_t b = index_find(pool, hi);
        if (b == TDM_KV_NO_BLOCK)
            break;
        pool->stats.prefix_hits++;
        pool_ref_found(pool, b);
        seq->blocks[i] = b;
        h = hi;
    }
    seq->n_blocks = i;
    seq->n_hashed = i;
    seq->last_hash = i > 0 ? h : 0;
    seq->n_tokens = i * bs;
    return seq->n_tokens;
}

void tdm_kv_seq_commit(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, const int32_t *tokens,
                       uint32_t n_tokens)
{
    const uint32_t bs = pool->layout.block_size;
    uint32_t full = n_tokens / bs;
    TDM_ASSERT(tdm_kv_blocks_for_tokens(&pool->layout, n_tokens) <= seq->n_blocks);
    TDM_ASSERT(full >= seq->n_hashed); /* KV is never taken back */
    uint64_t h = seq->n_hashed > 0 ? seq->last_hash : TDM_KV_HASH_SEED;
    for (uint32_t i = seq->n_hashed; i < full; i++) {
        h = tdm_kv_block_hash(h, tokens + (size_t)i * bs, bs);
        uint32_t b = seq->blocks[i];
        TDM_ASSERT(!pool->registered[b]); /* only blocks past n_hashed are new */
        /* Keep an existing block with this hash (live or cached): it holds the same KV, and
         * registering a second one would leave one of the two unreachable. */
        if (index_find(pool, h) == TDM_KV_NO_BLOCK) {
            pool->hash[b] = h;
            index_insert(pool, b);
        }
    }
    if (full > seq->n_hashed) {
        seq->n_hashed = full;
        seq->last_hash = h;
    }
    seq->n_tokens = n_tokens;
}

void tdm_kv_seq_clear(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq)
{
    /* Last block first: see tdm_kv_seq_release. Entries before n_dropped were given back. */
    for (uint32_t i = seq->n_blocks; i-- > seq->n_dropped;)
        tdm_kv_pool_unref(pool, seq->blocks[i]);
    uint32_t *blocks = seq->blocks, cap = seq->cap;
    tdm_kv_seq_init(seq);
    seq->blocks = blocks;
    seq->cap = cap;
}

void tdm_kv_seq_release(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq)
{
    /* Last block first (tdm_kv_seq_clear): cached blocks are evicted least recently freed
     * first, so releasing in reverse order queues the tail of the prefix chain for eviction
     * before its head. A chain is only found from its first block (matching stops at the first
     * miss), so evicting the head first would orphan every later block of the chain: still
     * cached, taking space, but unreachable. */
    tdm_kv_seq_clear(pool, seq);
    free(seq->blocks);
    tdm_kv_seq_init(seq);
}
