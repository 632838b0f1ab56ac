/* cpu_internal.h - what the CPU backend's files share: the backend record (cpu_be_t), the
 * kernel record of a weight (cpu_wkernel_t) and the ops each file gives the vtable in cpu.c.
 * Private to common/src/model/cpu*.c. */
#ifndef TDM_MODEL_CPU_INTERNAL_H
#define TDM_MODEL_CPU_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/backend.h"
#include "model/cpu_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#define TDM_X86 1
#endif

#define QK TDM_CPU_QK

typedef struct cpu_be {
    const tdm_model_t *model;
    const tdm_llama_hparams_t *hp;
    tdm_kv_pool_t *pool;
    tdm_kv_layout_t kl;            /* the pool's: with layer groups, one group's layers a block */
    const tdm_kv_groups_t *groups; /* the pool's layer groups (tdm_kv_pool_groups), or NULL */
    uint64_t block_bytes, rec_bytes;
    int n_threads;
    uint32_t max_rows, n_ctx;
    const tdm_cpu_isa_t *isa;    /* the kernels (cpu_kernels.h) */
    const tdm_cpu_isa_t *scalar; /* the reference, for what isa leaves NULL */
    const tdm_cpu_isa_t *narrow; /* 256-bit set over the same packed layout for a lone token
                                    (isa's 512-bit tile holds two tokens per register), or NULL */
    bool avx512;     /* AVX-512 F/BW/VL + VNNI kernels for Q4_0/Q4_1/Q8_0 (supersede isa's dots) */
    bool amx;        /* isa is the AMX set (cpu_amx.c) */
    bool kquant_f32; /* K-quants on the f32 path (TANDEM_CPU_KERNELS=f32k, for comparison) */
    char name[32];
    struct cpu_wkernel *wk; /* [n_wk] the kernel of each quantized matrix, chosen at load */
    size_t n_wk;
    uint64_t own_bytes; /* bytes of every buffer from cpu_alloc (scratch, packed weights) */
    uint64_t released;  /* model file bytes released after repacking (tdm_gguf_release) */
    void **allocs;      /* every buffer from cpu_alloc, freed at destroy */
    size_t n_allocs, cap_allocs;
    size_t par_min;   /* fewest values an op splits among threads (TDM_PAR_MIN_*) */
    size_t max_in;    /* widest matmul input (elements) */
    q8a_block_t *act; /* [max_rows][max_in / 32] quantized activations */
    uint8_t *zact;    /* [max_rows][zact stride] activations in the AVX-512 layout */
    uint8_t *zprep;   /* [n_threads][zprep stride] one weight row prepared for AVX-512 */
    float *wrow;      /* [n_threads][max_in] dequantized weight rows */
    float *scores;    /* [n_threads][TDM_ATTN_QTILE * heads per KV head][sc_ld] attention
                         scores */
    uint32_t sc_ld;   /* keys one scores call covers at most: min(n_ctx, TDM_ATTN_SPAN +
                         TDM_ATTN_QTILE - 1), a run of short rows' keys or one span's; long rows
                         go span by span, so the scratch does not grow with the context */
    float *kvrow;     /* [n_threads][3 * TDM_ATTN_QTILE * heads per KV head + 2][head_dim]
                         K/V rows, queries, outputs, span outputs */
    /* a long row's attention in spans (cpu_attention.c); S = TDM_ATTN_SPAN, G = heads per KV
       head, P = split_rows, N = max_spans */
    uint32_t max_spans;     /* most spans one row's keys cover: n_ctx / S + 2 */
    uint32_t split_rows;    /* P: most decode rows a pass splits over threads (their partials
                               fit span_o; <= TDM_ATTN_SPLIT_ROWS, 0: never split) */
    float *span_o;          /* [P][n_kv_heads][N][G][head_dim] span partial outputs */
    double *span_ml;        /* [P][n_kv_heads][N][G][2] span partial max and sum */
    atomic_uint *span_left; /* [P][n_kv_heads] spans of a split row not yet done */
    double *run_ml;         /* [n_threads][4 * TDM_ATTN_QTILE * G] a run's span max and sum, and
                               its running max and sum */
    float *rope_cs;         /* [max_rows][rope_dim] cos, sin pairs */
    float kq_scale;         /* attention scores' scale: 1 / sqrt(head_dim), or 1 when the model
                               scales q itself (hparams.attn_q_scale) */
    /* mixture of experts (cpu_moe.c); R = max_rows, k = n_expert_used, X = n_expert */
    const tdm_weight_t *exp_w;   /* the model's expert slices (tdm_model_experts) */
    size_t n_exp_w;              /* their count, n_layers * X * 3 */
    struct cpu_wkernel *exp_wk;  /* [n_exp_w] their kernel records, same order */
    struct cpu_moe_scratch *moe; /* NULL for a dense model */
} cpu_be_t;

/* Query rows attention takes together (cpu_attention.c): up to this many consecutive positions
 * of one sequence share each K and V block read */
#define TDM_ATTN_QTILE 4

/* A row with more keys than this (a long context) reduces them in spans of this many keys, at
 * positions aligned to multiples of it: a partial softmax and P.V per span, folded in span order
 * (cpu_attention.c). Part of the arithmetic's definition: changing it changes the bits. */
#define TDM_ATTN_SPAN 256
/* Most rows of a decode pass whose spans run as separate work items (flash-decoding); the
 * partials' buffer is sized for them */
#define TDM_ATTN_SPLIT_ROWS 16
/* Bytes the split partials may take at most (split_rows shrinks to fit) */
#define TDM_ATTN_SPLIT_BYTES (64u << 20)

/* How one weight is multiplied, chosen once when the backend is created: a q8a GEMM over the
 * matrix in place or repacked (cpu_kernels.h), AVX-512's prepared rows, or the f32 path. */
typedef struct cpu_wkernel {
    const tdm_weight_t *w;
    tdm_cpu_qmat_t m;      /* what gemm reads */
    tdm_cpu_gemm_fn gemm;  /* NULL: f32 path (or zdot) */
    tdm_cpu_gemm_fn gemm1; /* for the last token of an odd count (be->narrow's), or NULL */
    bool zdot;             /* the AVX-512 kernels on the rows in place */
} cpu_wkernel_t;

static inline float dot_f32(const cpu_be_t *be, const float *x, const float *y, size_t n)
{
    return be->isa->dot_f32(x, y, n);
}

static inline void quantize_act(const cpu_be_t *be, const float *x, size_t n, q8a_block_t *out)
{
    be->isa->quantize_act(x, n, out);
}

/* The kernel record of w: the one chosen at load, or (for a weight the backend was not
 * created with) one over the rows in place, which gives the same bits. */
const cpu_wkernel_t *tdm_cpu_wkernel_for(const cpu_be_t *be, const tdm_weight_t *w,
                                         cpu_wkernel_t *tmp);

/* The ops, each the tdm_backend_ops_t entry of the same name (model/backend.h states what it
 * computes, its shapes and errors); vbe is the cpu_be_t from cpu.c's create. */

/* cpu_ops.c: the row-wise and element-wise ops. */
int tdm_cpu_embed(void *vbe, const tdm_weight_t *emb, const int32_t *tokens, uint32_t n, float *x);
int tdm_cpu_rmsnorm(void *vbe, const float *x, const tdm_weight_t *w, uint32_t n, float eps,
                    float *out);
int tdm_cpu_add_bias(void *vbe, float *x, const tdm_weight_t *b, uint32_t n);
int tdm_cpu_rope(void *vbe, uint32_t layer, float *q, float *k, const tdm_fwd_rows_t *rows);
int tdm_cpu_swiglu(void *vbe, const float *gate, const float *up, size_t count, float *out);
int tdm_cpu_geglu(void *vbe, const float *gate, const float *up, size_t count, float *out);
int tdm_cpu_scale(void *vbe, float *x, float s, size_t count);
int tdm_cpu_add(void *vbe, float *x, const float *y, size_t count);
int tdm_cpu_gather_rows(void *vbe, const float *src, const uint32_t *rows, uint32_t n, uint32_t dim,
                        float *dst);
int tdm_cpu_read(void *vbe, const float *src, size_t count, float *host_dst);

/* cpu_matmul.c: the matmul driver. */
int tdm_cpu_matmul(void *vbe, const float *x, uint32_t n, uint32_t n_w,
                   const tdm_weight_t *const *w, float *const *out);

/* cpu_moe.c: the mixture-of-experts FFN and its scratch (allocated once, from cpu_alloc). */
int tdm_cpu_moe_ffn(void *vbe, uint32_t layer, const float *x, uint32_t n, float *out);
/* Allocates the experts' scratch for be->max_rows rows when the model has experts; TDM_OK
 * (nothing to do for a dense model) or TDM_ERESOURCE with err set. */
int tdm_cpu_moe_scratch_new(cpu_be_t *be, tdm_error_t *err);

/* cpu_attention.c: the KV cache writes and attention. */
int tdm_cpu_kv_store(void *vbe, uint32_t layer, const float *k, const float *v,
                     const tdm_fwd_rows_t *rows);
int tdm_cpu_attention(void *vbe, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                      float *out);

#endif
