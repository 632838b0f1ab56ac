/* kv.h - the paged KV cache: block layout and sizing, a pool of fixed-size blocks with
 * reference counts, per-sequence block tables, and prefix caching by chained block hashes.
 *
 * Layout (DESIGN.md "Paged KV cache"): a pool is an array of blocks of block_size token slots;
 * one block is one contiguous region laid out [layer][K|V][kv_head] records, each record
 * holding [slot][head_dim] values (f32 or f16), or for q8 a float scale followed by
 * [slot][head_dim] int8 values (one scale per block per layer per K|V per head). A block is
 * therefore self-contained and ships between nodes as one unit.
 *
 * Sizing (one function for the pools, `tandem kvcalc` and the dashboard, via tdm_kv_plan):
 *   KV bytes per token = 2 * n_layers * n_kv_heads * head_dim * bytes_per_value
 *   (+ for q8, 2 * n_layers * n_kv_heads * 4 bytes of scales per block).
 *   Source: the standard KV-cache size formula, e.g. vLLM's cache engine
 *   (CacheEngine.get_cache_block_size) and DESIGN.md.
 *
 * Prefix caching: every full block of a sequence gets hash = XXH3_64(parent hash, its
 * block_size token ids) (the first block's parent is a seed). Blocks with the same hash hold
 * the same KV (same model, same prefix), so a new sequence reuses the longest run of cached
 * blocks at the start of its prompt. A block whose reference count drops to 0 keeps its hash
 * and stays reusable until it is evicted, least recently freed first, when the free list is
 * empty.
 *
 * A pool is used by one thread (the node's engine thread); it is not thread-safe.
 */
#ifndef TANDEM_KV_H
#define TANDEM_KV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_kv_dtype {
    TDM_KV_F32 = 0,
    TDM_KV_F16 = 1, /* default */
    TDM_KV_Q8 = 2,  /* int8 with one f32 scale per block per layer per K|V per head */
} tdm_kv_dtype_t;

/* "f32", "f16", "q8"; "?" for a value outside the enum. Cannot fail. */
const char *tdm_kv_dtype_name(tdm_kv_dtype_t dtype);
/* Parses a dtype name; TDM_EINVALID naming the accepted values otherwise. */
int tdm_kv_dtype_parse(const char *name, tdm_kv_dtype_t *out, tdm_error_t *err);

typedef struct tdm_kv_layout {
    uint32_t n_layers;   /* transformer blocks */
    uint32_t n_kv_heads; /* KV heads (GQA: fewer than query heads) */
    uint32_t head_dim;   /* values per head */
    uint32_t block_size; /* token slots per block (default 16) */
    tdm_kv_dtype_t dtype;
} tdm_kv_layout_t;

/* The first field in which layout `got` differs from `want`, in the order n_layers,
 * n_kv_heads, head_dim, block_size, dtype ("n_layers", ..., "dtype"), with both values in
 * *got_v / *want_v (dtype: its enum value, tdm_kv_dtype_name names it); NULL when they are
 * equal. The one check the router (registration) and the KV receiver (every transfer) use,
 * each wording its own message. Cannot fail. */
const char *tdm_kv_layout_mismatch(const tdm_kv_layout_t *got, const tdm_kv_layout_t *want,
                                   uint32_t *got_v, uint32_t *want_v);

/* Checks a layout: every field positive, block_size a power of two <= 256, head_dim a
 * multiple of 4, the block size in bytes fits in 32 bits. TDM_EINVALID naming the field. */
int tdm_kv_layout_check(const tdm_kv_layout_t *l, tdm_error_t *err);

/* Bytes of one value: 4, 2 or 1. */
uint32_t tdm_kv_bytes_per_value(tdm_kv_dtype_t dtype);

/* KV bytes per token without q8 scales: 2 * n_layers * n_kv_heads * head_dim * bytes/value.
 * Llama-2-7B at f16 (32, 32, 128): 524,288. SmolLM2-135M at f16 (30, 3, 64): 23,040. */
uint64_t tdm_kv_bytes_per_token(const tdm_kv_layout_t *l);

/* Bytes of one record ([slot][head_dim] values, plus the 4-byte scale first for q8). */
uint64_t tdm_kv_record_bytes(const tdm_kv_layout_t *l);

/* Bytes of one block: 2 * n_layers * n_kv_heads * record bytes
 * (= block_size * bytes per token, + q8 scales). */
uint64_t tdm_kv_block_bytes(const tdm_kv_layout_t *l);

/* Blocks needed for n_tokens: ceil(n_tokens / block_size). */
uint64_t tdm_kv_blocks_for_tokens(const tdm_kv_layout_t *l, uint64_t n_tokens);

/* ---- capacity planning ---- */

/* What a capacity plan is asked: a model's KV shape, a context, a number of users and
 * optionally a memory budget. */
typedef struct tdm_kv_plan_in {
    tdm_kv_layout_t layout; /* n_layers, n_kv_heads, head_dim, block_size, dtype */
    uint32_t n_heads;       /* query heads, for the GQA comparison: a multiple of n_kv_heads;
                               0 means n_kv_heads (no GQA) */
    uint64_t n_ctx;         /* tokens per sequence, >= 1 */
    uint64_t n_users;       /* concurrent full-context sequences, >= 1 */
    uint64_t weight_bytes;  /* model weights, bytes */
    uint64_t scratch_bytes; /* engine scratch, bytes (tdm_engine_scratch_bytes); 0 if unknown */
    bool have_memory;       /* memory_bytes is given: size a pool */
    uint64_t memory_bytes;  /* budget for weights + scratch + KV, bytes */
    const struct tdm_kv_groups *groups; /* layer groups (hybrid allocation, "layer groups"
                                           below); NULL: one full-attention group */
} tdm_kv_plan_in_t;

/* Every figure of a capacity plan. Bytes unless said otherwise. */
typedef struct tdm_kv_plan_result {
    uint64_t bytes_per_token;     /* tdm_kv_bytes_per_token (q8 scales not included) */
    uint64_t block_bytes;         /* tdm_kv_block_bytes (q8 scales included); with groups, of
                                     tdm_kv_group_layout (one group's layers) */
    uint64_t blocks_per_seq;      /* ceil(n_ctx / block_size), blocks; with groups
                                     tdm_kv_groups_blocks_per_seq */
    uint64_t bytes_per_seq;       /* blocks_per_seq * block_bytes */
    uint64_t blocks_total;        /* n_users * blocks_per_seq, blocks */
    uint64_t bytes_total;         /* n_users * bytes_per_seq: KV for every user */
    uint64_t need_bytes;          /* weight_bytes + scratch_bytes + bytes_total */
    uint64_t mha_bytes_per_token; /* bytes_per_token as if n_kv_heads were n_heads */
    double gqa_factor;            /* n_heads / n_kv_heads (1.0 without GQA) */
    /* with have_memory only; 0 and false otherwise: */
    uint64_t pool_budget_bytes; /* memory - weights - scratch, 0 when they do not fit */
    uint64_t pool_blocks;       /* pool_budget_bytes / block_bytes, blocks */
    uint64_t pool_tokens;       /* pool_blocks * block_size, tokens (with groups: of every
                                   layer, floor(pool_blocks / n_groups) * block_size) */
    uint64_t max_seqs;          /* pool_blocks / blocks_per_seq: full-context sequences at once */
    bool fits;                  /* need_bytes <= memory_bytes */
    uint64_t spare_bytes;       /* memory_bytes - need_bytes when it fits, else 0 */
    uint64_t short_bytes;       /* need_bytes - memory_bytes when it does not, else 0 */
} tdm_kv_plan_t;

/* Plans KV capacity with the nodes' own sizing functions, so that the plan and the running
 * system agree to the byte; `tandem kvcalc` and the dashboard's /api/capacity both print
 * its figures. Block-granular: a sequence of C tokens takes ceil(C / block_size) blocks of
 * tdm_kv_block_bytes() each, whatever it holds.
 *   KV bytes per sequence = ceil(n_ctx / block_size) * block_bytes
 *   pool blocks           = floor((memory - weights - scratch) / block_bytes)
 *   max sequences         = floor(pool blocks / blocks per sequence)
 * Source: the standard KV-cache size formula (vLLM's CacheEngine.get_cache_block_size) and
 * the node's pool sizing (tandem/node_runtime.h, tdm_node_runtime_open; DESIGN.md "Paged KV cache";
 * docs/capacity.md). Worked numbers: SmolLM2-135M at f16 (30 layers, 3 KV heads, head_dim 64)
 * is 23,040 B/token, 368,640 B per 16-token block and 94,371,840 B for a 4096-token sequence;
 * Llama-2-7B at f16 (32, 32, 128) is 524,288 B/token and 2 GiB for 4096 tokens.
 * With in->groups (hybrid allocation), blocks are tdm_kv_group_layout's and a sequence takes
 * tdm_kv_groups_blocks_per_seq of them: Gemma 3 270M at f16, 8,192 tokens: 677 blocks of
 * 49,152 B (33,275,904 B) instead of 512 of 294,912 B (150,994,944 B).
 * pool_blocks is not capped at the pool's 2^32 - 1 blocks a node can address.
 * Errors (*out zeroed, message in *err): TDM_EINVALID for a bad layout (tdm_kv_layout_check's
 * message), n_ctx or n_users 0, or n_heads not a multiple of n_kv_heads; TDM_ERESOURCE when
 * n_users x n_ctx needs more than 2^64 bytes. Keeps no pointer to in. */
int tdm_kv_plan(const tdm_kv_plan_in_t *in, tdm_kv_plan_t *out, tdm_error_t *err);

/* The memory budget a node must have had for a pool of n_blocks blocks of layout l after
 * fixed_bytes (weights + engine scratch): fixed_bytes + n_blocks * tdm_kv_block_bytes(l),
 * bytes, into *out. The inverse of tdm_kv_plan's pool_blocks (tdm_kv_plan with that budget
 * gives back n_blocks). TDM_ERESOURCE when it exceeds 2^64 - 1 bytes (*out unchanged). */
int tdm_kv_plan_budget(const tdm_kv_layout_t *l, uint64_t n_blocks, uint64_t fixed_bytes,
                       uint64_t *out, tdm_error_t *err);

/* Parent hash of a sequence's first block (h_-1 in the chain h_i = XXH3_64(h_i-1, block i)):
 * the bytes "tdm-kv-1" read as a little-endian integer. Changing it (or the hashing) makes
 * every node's prefix cache incompatible with older ones: change the "-1". */
#define TDM_KV_HASH_SEED UINT64_C(0x312d766b2d6d6474)

/* The chained hash of one full block: XXH3_64bits_withSeed over its block_size token ids as
 * int32 little-endian (block_size * 4 bytes), seeded with the parent's hash (the previous
 * block's, or TDM_KV_HASH_SEED for the first block). The router computes the same hashes for
 * prefix-aware routing. Cannot fail. */
uint64_t tdm_kv_block_hash(uint64_t parent, const int32_t *tokens, uint32_t block_size);

/* Offset in bytes, inside a block, of the record of (layer, kv = 0 for K / 1 for V, head). */
static inline uint64_t tdm_kv_record_offset(const tdm_kv_layout_t *l, uint64_t record_bytes,
                                            uint32_t layer, uint32_t kv, uint32_t head)
{
    return (((uint64_t)layer * 2 + kv) * l->n_kv_heads + head) * record_bytes;
}

/* ---- the pool ---- */

typedef struct tdm_kv_pool tdm_kv_pool_t;

/* Pool counters. */
typedef struct tdm_kv_stats {
    uint32_t n_blocks;       /* total */
    uint32_t n_used;         /* reference count > 0 */
    uint32_t n_cached;       /* reference count 0 but holding a reusable hashed prefix */
    uint32_t n_free;         /* neither (n_used + n_cached + n_free = n_blocks) */
    uint64_t prefix_queries; /* blocks looked up by tdm_kv_seq_match_prefix */
    uint64_t prefix_hits;    /* of which found in the cache */
    uint64_t evictions;      /* cached blocks reused for other data */
} tdm_kv_stats_t;

/* Allocates a pool of n_blocks blocks in host memory (page-aligned, zeroed, committed lazily) with
 * an index for prefix hashes. Returns NULL with *err: TDM_EINVALID (bad layout, n_blocks 0),
 * TDM_ERESOURCE (out of memory; message has the bytes asked). Caller frees with
 * tdm_kv_pool_destroy. */
tdm_kv_pool_t *tdm_kv_pool_new(const tdm_kv_layout_t *layout, uint32_t n_blocks, tdm_error_t *err);
void tdm_kv_pool_destroy(tdm_kv_pool_t **self_p);

const tdm_kv_layout_t *tdm_kv_pool_layout(const tdm_kv_pool_t *pool);
/* Start of the pool's memory: block b starts at base + b * block_bytes. */
void *tdm_kv_pool_base(tdm_kv_pool_t *pool);
uint64_t tdm_kv_pool_block_bytes(const tdm_kv_pool_t *pool);
void tdm_kv_pool_stats(const tdm_kv_pool_t *pool, tdm_kv_stats_t *out);
/* Blocks that an allocation could get now: free + cached (cached ones are evicted). */
uint32_t tdm_kv_pool_available(const tdm_kv_pool_t *pool);

/* "No block": what tdm_kv_pool_find returns when a hash is not in the index. */
#define TDM_KV_NO_BLOCK UINT32_MAX

/* Reference count of a block (0 for free and cached blocks). Block must be < n_blocks. */
uint32_t tdm_kv_pool_refcount(const tdm_kv_pool_t *pool, uint32_t block);

/* The block registered for a chained hash (used or cached), or TDM_KV_NO_BLOCK. Takes no
 * reference. */
uint32_t tdm_kv_pool_find(const tdm_kv_pool_t *pool, uint64_t hash);

/* Walks every list and the index (O(n_blocks + index slots)) and checks them against the
 * counters: used + cached + free = n_blocks, free blocks unhashed, cached ones hashed and in
 * LRU order, every registered block found by its hash. For tests and debugging; returns 0 or
 * TDM_EINTERNAL with a message saying what is inconsistent. */
int tdm_kv_pool_check(const tdm_kv_pool_t *pool, tdm_error_t *err);

/* Allocates n blocks (reference count 1, no hash), taking free blocks first and then
 * evicting cached ones least recently used first. All or nothing: TDM_ERESOURCE when fewer
 * than n are available (nothing is taken). */
int tdm_kv_pool_alloc(tdm_kv_pool_t *pool, uint32_t n, uint32_t *blocks_out);

/* Adds a reference to a used block. */
void tdm_kv_pool_ref(tdm_kv_pool_t *pool, uint32_t block);

/* Takes a reference to a block found by tdm_kv_pool_find: revives a cached block (it leaves
 * the LRU and is used again) or adds a reference to a used one. */
void tdm_kv_pool_acquire(tdm_kv_pool_t *pool, uint32_t block);

/* Adds to the prefix counters (prefix_queries, prefix_hits) a lookup of `queried` prefix
 * blocks of which `hit` (<= queried) were reused: for matchers outside this file
 * (tdm_kv_hseq_match_prefix). */
void tdm_kv_pool_count_prefix(tdm_kv_pool_t *pool, uint64_t queried, uint64_t hit);

/* Registers a used, unregistered block under hash (its chained prefix key) unless another
 * block is registered under it: true when registered, false when the hash was taken (the
 * block stays unregistered and goes back to the free list when released). */
bool tdm_kv_pool_register(tdm_kv_pool_t *pool, uint32_t block, uint64_t hash);

/* Drops a reference; at 0 the block becomes cached (if it has a hash) or free. */
void tdm_kv_pool_unref(tdm_kv_pool_t *pool, uint32_t block);

/* ---- sequences: block tables ---- */

/* A sequence's block table. Plain value; init with tdm_kv_seq_init, release with
 * tdm_kv_seq_release (which returns its blocks and frees the table). */
typedef struct tdm_kv_seq {
    uint32_t *blocks; /* [n_blocks] pool block ids, in token order */
    uint32_t n_blocks;
    uint32_t cap;       /* allocated entries of blocks */
    uint32_t n_tokens;  /* tokens whose KV is in the blocks (computed or reused) */
    uint32_t n_hashed;  /* leading full blocks whose hash is registered */
    uint64_t last_hash; /* hash of block n_hashed - 1 (the chain's parent) */
    uint32_t n_dropped; /* leading entries given back (window groups, tdm_kv_hseq_*):
                           blocks[0..n_dropped) are TDM_KV_NO_BLOCK; 0 otherwise */
} tdm_kv_seq_t;

void tdm_kv_seq_init(tdm_kv_seq_t *seq);

/* Sizes the table for max_tokens tokens up front, so that reserve and match_prefix up to
 * max_tokens never allocate (the worker calls it at admission: a step allocates nothing). Takes
 * no blocks. Returns 0, or TDM_ERESOURCE when the table cannot be allocated (out of memory; the
 * table is unchanged). */
int tdm_kv_seq_prepare(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, uint32_t max_tokens);

/* Makes the block table cover n_tokens tokens (allocating blocks as needed; the table itself
 * only when it was not prepared for n_tokens). All or nothing: TDM_ERESOURCE when the pool
 * lacks blocks, or when a table that was not prepared cannot grow (the table is unchanged). */
int tdm_kv_seq_reserve(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, uint32_t n_tokens);

/* For a new (empty) sequence: reuses the longest run of cached full blocks that match the
 * start of tokens[0..n), never the whole prompt (at least one token is left to compute, so
 * the forward pass produces logits). Returns the number of tokens covered (a multiple of
 * block_size) and sets seq->n_tokens to it; 0 when prefix caching finds nothing. */
uint32_t tdm_kv_seq_match_prefix(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, const int32_t *tokens,
                                 uint32_t n);

/* After the forward pass has written KV for tokens[0..n_tokens): records n_tokens and
 * registers the hash of every newly full block so later sequences can reuse it. tokens are
 * the sequence's tokens from position 0. */
void tdm_kv_seq_commit(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, const int32_t *tokens,
                       uint32_t n_tokens);

/* Drops the sequence's references to its blocks but keeps its table (and its capacity): the
 * sequence is empty afterwards and takes blocks again without allocating (preemption). */
void tdm_kv_seq_clear(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq);

/* Drops the sequence's references to its blocks and frees its table; the sequence is empty
 * afterwards (it may be reused). */
void tdm_kv_seq_release(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq);

/* ---- layer groups: KV allocation that follows the architecture ----
 *
 * In a model with sliding-window layers (Gemma 3: five of every six layers attend to the last
 * 512 positions only), a query at position p of a window-W layer reads keys
 * max(0, p + 1 - W) .. p. Keeping every token's KV in those layers wastes most of the pool on
 * long sequences. Hybrid allocation (vLLM's hybrid KV-cache manager) splits the layers into
 * groups of equal size, each of one attention kind (full, or one window W), gives every group
 * its own block table over one shared pool of equal-size blocks (a block holds one group's
 * layers for block_size tokens), and gives back a window group's blocks wholly before the
 * oldest key the next query can read.
 *
 * Partition (tdm_kv_groups_init): layers_per_group = gcd of the layer counts of every kind, so
 * no block has a padding layer; groups are numbered full-attention kind first, then windows
 * ascending, each kind's layers in increasing order. Gemma 3 270M (18 layers, full layers 5,
 * 11, 17, window 512): 3 layers per group, group 0 full {5, 11, 17}, groups 1..5 window 512
 * {0, 1, 2}, {3, 4, 6}, ... A model without windows (or with one window on every layer) is one
 * group of all its layers: the pool, its blocks and its block tables are exactly the
 * single-group ones (tdm_kv_seq_*), byte for byte.
 *
 * Blocks a sequence holds (the formula the allocator follows exactly, tdm_kv_group_live): once
 * its first n tokens are computed (committed) and its table reserved for m >= n tokens,
 *   full group:     ceil(m / block_size)
 *   window group W: max(0, ceil(m / block_size) - floor(max(0, n + 1 - W) / block_size))
 * Peak over a sequence decoding one token a step to a context of C tokens
 * (tdm_kv_group_peak): full ceil(C / block_size); window W at most
 * min(ceil(C / block_size), ceil((W - 1) / block_size) + 1). A prefill chunk of P rows holds up
 * to ceil((W + P - 2) / block_size) + 1 blocks of a window group while it runs.
 *
 * Prefix caching: every group registers its full blocks under the same chained hash as the
 * single-group cache (tdm_kv_block_hash), salted by the group (tdm_kv_group_hash; group 0
 * unsalted, so the router's prefix hashes keep naming group 0). A cached prefix of k blocks is
 * reusable only where every full-attention group still has blocks 0..k-1 cached and every
 * window group W still has the blocks that the first query after the prefix (position
 * k * block_size) reads: floor(max(0, k * block_size + 1 - W) / block_size) .. k - 1. Blocks a
 * window group gave back as a sequence grew are cached like any other, so a later prompt
 * ending its shared prefix inside a window still held (or still cached) hits.
 */

/* Most layers (as TDM_GGUF_MAX_LAYERS) and so most groups (one layer each). */
#define TDM_KV_MAX_LAYERS 512

typedef struct tdm_kv_groups {
    uint32_t n_layers;                    /* layers of the model */
    uint32_t n_groups;                    /* 1 .. n_layers */
    uint32_t layers_per_group;            /* layers whose KV one block holds */
    uint32_t n_full;                      /* groups 0 .. n_full - 1 attend to every key */
    uint32_t window[TDM_KV_MAX_LAYERS];   /* [n_groups] keys a query reads, tokens; 0 = all */
    uint16_t group_of[TDM_KV_MAX_LAYERS]; /* [n_layers] the layer's group */
    uint16_t slot_of[TDM_KV_MAX_LAYERS];  /* [n_layers] its layer slot inside a group block */
} tdm_kv_groups_t;

/* Splits n_layers layers by their windows (windows[l]: tokens a query of layer l reads, the
 * key at p + 1 - W being the oldest, 0 for full attention; windows NULL: all full) into
 * groups as above. TDM_EINVALID naming the field when n_layers is 0 or over
 * TDM_KV_MAX_LAYERS. */
int tdm_kv_groups_init(tdm_kv_groups_t *g, uint32_t n_layers, const uint32_t *windows,
                       tdm_error_t *err);

/* The layout of one block of a group: l with n_layers = layers_per_group (the pool's layout;
 * records inside it are addressed by slot_of[layer]). l itself when there is one group. */
tdm_kv_layout_t tdm_kv_group_layout(const tdm_kv_layout_t *l, const tdm_kv_groups_t *g);

/* The prefix key of group gi for chained hash h: h for group 0, h XOR a per-group constant
 * otherwise. Cannot fail. */
uint64_t tdm_kv_group_hash(uint64_t h, uint32_t gi);

/* Blocks group gi holds for a sequence with n tokens computed and its table reserved for m
 * (the formula above; m >= n). */
uint64_t tdm_kv_group_live(const tdm_kv_groups_t *g, uint32_t gi, uint32_t block_size, uint64_t n,
                           uint64_t m);

/* First table entry group gi still needs once n tokens are computed: the block of the oldest
 * key the next query (position n) reads, floor(max(0, n + 1 - W) / block_size) for a window
 * group of W tokens, 0 for full attention. Entries before it are given back (window groups) and
 * a KV hand-over of n tokens (prefill node -> decode node, a PREFILLED worker event) carries
 * entries first .. ceil(n / block_size) - 1 of the group: tdm_kv_group_live(g, gi, bs, n, n)
 * blocks. Cannot fail. */
uint64_t tdm_kv_group_first_needed(const tdm_kv_groups_t *g, uint32_t gi, uint32_t block_size,
                                   uint64_t n);

/* Most blocks group gi holds at once for a sequence decoding one token a step up to n_ctx
 * tokens (the maximum of tdm_kv_group_live(n, n + 1) for n < n_ctx). */
uint64_t tdm_kv_group_peak(const tdm_kv_groups_t *g, uint32_t gi, uint32_t block_size,
                           uint64_t n_ctx);

/* Sum of tdm_kv_group_peak over the groups: blocks of tdm_kv_group_layout size an n_ctx-token
 * sequence needs. With one full group, ceil(n_ctx / block_size). */
uint64_t tdm_kv_groups_blocks_per_seq(const tdm_kv_groups_t *g, uint32_t block_size,
                                      uint64_t n_ctx);

/* A sequence over a grouped pool: one block table per group. The tables' n_tokens, n_hashed
 * and last_hash are unused (the sequence's own fields hold them); a window group's
 * tab[gi].blocks[0 .. tab[gi].n_dropped) are TDM_KV_NO_BLOCK (given back). Init with
 * tdm_kv_hseq_init, release with tdm_kv_hseq_release. */
typedef struct tdm_kv_hseq {
    const tdm_kv_groups_t *groups; /* not owned; outlives the sequence */
    tdm_kv_seq_t *tab;             /* [groups->n_groups] */
    uint32_t n_tokens;             /* tokens whose KV is computed (or reused) */
    uint32_t n_hashed;             /* leading full blocks registered (every group holding them) */
    uint64_t last_hash;            /* chained hash of block n_hashed - 1 */
} tdm_kv_hseq_t;

/* Empty sequence with one table per group. TDM_ERESOURCE when out of memory. */
int tdm_kv_hseq_init(tdm_kv_hseq_t *hs, const tdm_kv_groups_t *groups, tdm_error_t *err);

/* A pool whose blocks hold one group's layers (tdm_kv_group_layout(layout, groups)), for
 * sequences with one table per group (tdm_kv_hseq_*); the pool keeps a copy of groups, which
 * the engine reads to address a layer's record (tdm_kv_pool_groups). One full-attention group
 * gives the plain pool (tdm_kv_pool_new(layout)), byte for byte. Errors as tdm_kv_pool_new,
 * and TDM_EINVALID when groups->n_layers is not layout->n_layers. */
tdm_kv_pool_t *tdm_kv_pool_new_grouped(const tdm_kv_layout_t *layout, const tdm_kv_groups_t *groups,
                                       uint32_t n_blocks, tdm_error_t *err);

/* The pool's layer groups: NULL for a plain pool (every block holds every layer, one table a
 * sequence), else those it was made with (several groups, or one group with a window). */
const tdm_kv_groups_t *tdm_kv_pool_groups(const tdm_kv_pool_t *pool);

/* Sizes every table for max_tokens (as tdm_kv_seq_prepare). 0 or TDM_ERESOURCE. */
int tdm_kv_hseq_prepare(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, uint32_t max_tokens);

/* Makes every group's table cover n_tokens (>= hs->n_tokens) tokens. All or nothing:
 * TDM_ERESOURCE when the pool lacks the blocks (or a table cannot grow); nothing taken. */
int tdm_kv_hseq_reserve(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, uint32_t n_tokens);

/* For a new sequence: reuses the longest cached prefix of whole blocks of tokens[0..n) (never
 * all n) that every group can serve under the rule above. Returns the tokens covered (a
 * multiple of block_size; 0 when nothing matches or on out of memory) and sets hs->n_tokens.
 * Counts the prefix blocks looked up in prefix_queries and those reused in prefix_hits. */
uint32_t tdm_kv_hseq_match_prefix(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, const int32_t *tokens,
                                  uint32_t n);

/* Bytes of scratch tdm_kv_hseq_match_prefix_with needs for a prompt of up to n tokens in blocks
 * of block_size: 13 bytes per whole block before the last token, plus 1. Cannot fail. */
size_t tdm_kv_hseq_match_scratch_bytes(uint32_t block_size, uint32_t n);

/* tdm_kv_hseq_match_prefix with caller-owned scratch of tdm_kv_hseq_match_scratch_bytes(n)
 * bytes (8-byte aligned; NULL: allocated and freed here), so that a caller's step allocates
 * nothing (the worker's). */
uint32_t tdm_kv_hseq_match_prefix_with(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs,
                                       const int32_t *tokens, uint32_t n, void *scratch);

/* After the forward pass wrote KV for tokens[0..n_tokens): records n_tokens, registers every
 * newly full block of every group, then gives back the window groups' blocks wholly before
 * n_tokens + 1 - W (no later query reads them). tokens NULL (prefix caching off): registers
 * nothing, only records n_tokens and gives back. */
void tdm_kv_hseq_commit(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, const int32_t *tokens,
                        uint32_t n_tokens);

/* Checks tables handed over with the KV of n tokens (a PREFILLED worker event's, or a KV
 * transfer's): made over groups, every group's table has ceil(n / block_size) entries and holds
 * every entry from tdm_kv_group_first_needed(n) on (at most those before it given back).
 * TDM_EINVALID naming the group and its counts. */
int tdm_kv_hseq_check_handover(const tdm_kv_hseq_t *hs, const tdm_kv_groups_t *groups,
                               uint32_t block_size, uint32_t n, tdm_error_t *err);

/* For an empty sequence that is to receive the KV of n_tokens tokens (a decode node's
 * reservation for a KV transfer): every group's table gets ceil(n_tokens / block_size) entries,
 * of which those before tdm_kv_group_first_needed(n_tokens) are given back (TDM_KV_NO_BLOCK)
 * and the rest are allocated; hs->n_tokens = n_tokens. All or nothing: TDM_ERESOURCE when the
 * pool lacks the blocks or a table cannot grow (nothing taken). */
int tdm_kv_hseq_reserve_handover(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs, uint32_t n_tokens);

/* The blocks hs holds, group by group in table order (the order of a KV transfer), into
 * out[tdm_kv_hseq_held(hs)]. Returns how many. Cannot fail. */
uint32_t tdm_kv_hseq_live(const tdm_kv_hseq_t *hs, uint32_t *out);

/* Blocks the sequence holds now, over every group. */
uint64_t tdm_kv_hseq_held(const tdm_kv_hseq_t *hs);

/* Drops every reference, keeps the tables (preemption; tdm_kv_seq_clear per group). */
void tdm_kv_hseq_clear(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs);

/* Drops every reference and frees the tables. */
void tdm_kv_hseq_release(tdm_kv_pool_t *pool, tdm_kv_hseq_t *hs);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_KV_H */
