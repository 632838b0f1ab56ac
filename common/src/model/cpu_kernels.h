/* cpu_kernels.h - the CPU backend's kernel table: one set of kernels per instruction set
 * (cpu_scalar.c, cpu_avx2.c, cpu_vnni.c, cpu_avx512.c, cpu_amx.c), chosen once when the backend is
 * created (cpu.c). Internal to libtandem.
 *
 * Every set gives the scalar reference's bits on every op (the quantized GEMMs, the activation
 * quantizer, the f32 dots and axpys of attention and of the f32 matmul path, f16 rounding,
 * softmax's exp and sum, SwiGLU), so nodes on different CPUs compute identical logits.
 *
 * Quantized matmuls (Q4_0, Q4_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K weights) run on activations
 * quantized to 8 bits in blocks of 32 (q8a_block_t); every other op works in f32. The scalar set is
 * the reference: every field of it is set but the q8 attention tiles (below). A SIMD set leaves
 * NULL what it does not speed up, and cpu.c falls back to the scalar kernel there.
 */
#ifndef TANDEM_MODEL_CPU_KERNELS_H
#define TANDEM_MODEL_CPU_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/gguf.h"

#define TDM_CPU_QK 32 /* activation (and weight) block size */

/* exp(x) in f32 as every kernel set computes it (softmax, SwiGLU), one fixed sequence of IEEE
 * operations so that the SIMD sets give the scalar bits: x = n ln2 + r with n = rint(x log2 e)
 * (the 1.5 * 2^23 shift trick) and r from a two-constant Cody-Waite reduction, e^r = 1 + r +
 * r^2 P(r) with Cephes expf's degree-5 minimax P (Moshier, Cephes Math Library, expf.c; under
 * 2 ulp of the exact value on [-87, 88.3]), then times 2^n built in the exponent bits.
 * x < -87 gives 0 (the exact value is below 1.7e-38), x > 88.3 gives +inf (libm's result
 * overflows from 88.72), NaN gives NaN. Every step is an explicit fmaf or a single operation
 * (the model sources build with -ffp-contract=off). */
#define TDM_EXP_LO (-87.0f)
#define TDM_EXP_HI 88.3f
#define TDM_EXP_LOG2E 1.44269504088896341f
#define TDM_EXP_SHIFT 12582912.0f /* 1.5 * 2^23 */
#define TDM_EXP_C1 0.693359375f   /* ln 2 = C1 - C2, C1 exact in 9 bits */
#define TDM_EXP_C2 (-2.12194440e-4f)
#define TDM_EXP_P0 1.9875691500e-4f
#define TDM_EXP_P1 1.3981999507e-3f
#define TDM_EXP_P2 8.3334519073e-3f
#define TDM_EXP_P3 4.1665795894e-2f
#define TDM_EXP_P4 1.6666665459e-1f
#define TDM_EXP_P5 5.0000001201e-1f

static inline float tdm_cpu_expf(float x)
{
    if (x != x)
        return x;
    if (x < TDM_EXP_LO)
        return 0.0f;
    if (x > TDM_EXP_HI)
        return __builtin_inff();
    float n = __builtin_fmaf(x, TDM_EXP_LOG2E, TDM_EXP_SHIFT) - TDM_EXP_SHIFT;
    float r = __builtin_fmaf(n, -TDM_EXP_C1, x);
    r = __builtin_fmaf(n, -TDM_EXP_C2, r);
    float p = __builtin_fmaf(TDM_EXP_P0, r, TDM_EXP_P1);
    p = __builtin_fmaf(p, r, TDM_EXP_P2);
    p = __builtin_fmaf(p, r, TDM_EXP_P3);
    p = __builtin_fmaf(p, r, TDM_EXP_P4);
    p = __builtin_fmaf(p, r, TDM_EXP_P5);
    float y = __builtin_fmaf(p, r * r, r) + 1.0f;
    union {
        uint32_t u;
        float f;
    } two_n = {.u = (uint32_t)((int32_t)n + 127) << 23};
    return y * two_n.f;
}

/* The softmax sum's canonical order: TDM_EXP_LANES double lanes, lane l summing elements
 * TDM_EXP_LANES c + l from c = 0 up, then halves folded pairwise (lane l += lane l + w for
 * w = 8, 4, 2, 1). Folds lanes in place; returns the sum. */
#define TDM_EXP_LANES 16
static inline double tdm_cpu_fold_lanes(double *lane)
{
    for (int w = TDM_EXP_LANES / 2; w > 0; w /= 2)
        for (int l = 0; l < w; l++)
            lane[l] += lane[l + w];
    return lane[0];
}

/* An activation block: 32 int8 values x ≈ d * q, s = d * sum(q) (for the Q4_1 min term),
 * isum = sum(q) (for Q4_0's offset of 8, exact in int32) and isum_lo = the sum of q[0..15]
 * (Q2_K's per-16 mins: d * isum_lo and d * (isum - isum_lo) are exact in f32, d having f16's
 * 11 significant bits and the sums at most 11). */
typedef struct q8a_block {
    float d;
    float s;
    int32_t isum;
    int8_t q[TDM_CPU_QK];
    int32_t isum_lo;
} q8a_block_t;

/* The weight types with q8a kernels, as indices into tdm_cpu_isa_t.gemm. */
typedef enum tdm_cpu_qtype {
    TDM_CPU_Q4_0,
    TDM_CPU_Q4_1,
    TDM_CPU_Q8_0,
    TDM_CPU_Q4_K,
    TDM_CPU_Q5_K,
    TDM_CPU_Q6_K,
    TDM_CPU_Q2_K,
    TDM_CPU_Q3_K,
    TDM_CPU_N_QTYPES
} tdm_cpu_qtype_t;

/* The index of a GGML type in tdm_cpu_isa_t.gemm, or -1 when the type takes the f32 path. */
int tdm_cpu_qtype_of(tdm_ggml_type_t type);

/* A quantized matrix as a GEMM kernel reads it: either the GGUF rows in place (packed false:
 * row r at data + r * row_bytes) or repacked in groups of 8 rows (packed true, see
 * tdm_cpu_pack). */
typedef struct tdm_cpu_qmat {
    const uint8_t *data;
    size_t row_bytes;   /* GGUF bytes per row (nb blocks) */
    size_t group_bytes; /* packed: bytes per group of 8 rows (tdm_cpu_pack_bytes(type, 8, nb)) */
    uint64_t n_out;     /* rows */
    size_t nb;          /* 32-value blocks per row */
    bool packed;
} tdm_cpu_qmat_t;

/* out[t * ldo + r] = W_r · act[t] for the rows r of groups [g0, g1) (rows 8 g0 .. 8 g1 - 1,
 * clipped to n_out) and tokens t < nt; act holds nt tokens' blocks ([nt][nb]).
 *
 * The canonical reduction, which every kernel performs bit for bit: per block b the integer
 * dot product (Q4_0: sum (u - 8) a, Q4_1: sum u a, Q8_0: sum w a; exact in int32), then
 * acc = fma(dw * da, (float)isum, acc) and, for Q4_1, acc = fma(mw, s, acc), blocks in order
 * from acc = 0. The K-quants run per 32-value sub-block with the scales taken to f32 exactly
 * (d * sc and dmin * m have at most 17 significant bits): Q4_K as Q4_1 with dw = d * sc and
 * mw = -(dmin * m); Q5_K likewise with the values taken signed (q - 16) and
 * mw = 16 * dw - dmin * m (rounded to f32 once, at load); Q6_K (values q - 32, an int8 scale
 * per 16) as two half-block integer dots, acc = fma(dlo * da, isum_lo, acc) then
 * acc = fma(dhi * da, isum_hi, acc); Q3_K (values q in -4..3, a 6-bit scale per 16) exactly as
 * Q6_K with dlo / dhi = d * (scale - 32); Q2_K (values 0..3, per 16 a 4-bit scale and a 4-bit
 * min) as Q6_K with dlo / dhi = d * sc, then its two mins: acc = fma(mlo, da * asum_lo, acc),
 * acc = fma(mhi, da * asum_hi, acc) with mlo / mhi = -(dmin * m) and asum_lo / asum_hi the
 * activation block's isum_lo and isum - isum_lo. Tokens and rows never
 * share an accumulator, so no result depends on the batch, and the scalar reference and the SIMD
 * kernels give identical bits. */
typedef void (*tdm_cpu_gemm_fn)(const tdm_cpu_qmat_t *w, size_t g0, size_t g1,
                                const q8a_block_t *act, uint32_t nt, float *out, size_t ldo);

/* The packed layout (ggml's repack idea with 4-byte interleave): a group of 8 rows stores,
 * per block in order, the 8 rows' f16 scales d[8], for Q4_1 the f16 mins m[8], then the
 * quants: Q4 blocks as 4 x 32 bytes where byte 4r + i of chunk k is byte 4k + i of row r's
 * nibbles (low nibble: value 4k + i, high: value 16 + 4k + i); Q8_0 as 8 x 32 bytes where
 * byte 4r + i of chunk k is value 4k + i of row r. Rows past n_out are zero. The packed bytes
 * of a group equal the GGUF bytes of its 8 rows: 144, 160 and 272 per block. The K-quants
 * are repacked per 32-value sub-block with f32 scales: Q4_K as dw[8], mw[8] (f32) then the
 * Q4 chunks of its nibbles in Q4_1's order (192 bytes, 4/3 of the GGUF bytes); Q6_K as
 * dlo[8], dhi[8] (f32) then the values q - 32 as Q8_0's chunks (320 bytes, 1.52x); Q5_K as
 * dw[8], mw[8] (f32) then the values q - 16 as Q8_0's chunks (320 bytes, 1.82x); Q3_K exactly
 * as Q6_K (dlo[8], dhi[8], the values q in -4..3: 320 bytes, 2.9x; every Q6_K kernel runs it);
 * Q2_K as dlo[8], dhi[8], mlo[8], mhi[8] (f32) then the values 0..3 as Q8_0's chunks (384
 * bytes, 4.6x: the int8 kernels trade memory for speed on the 2-bit type). */
size_t tdm_cpu_pack_bytes(tdm_ggml_type_t type, uint64_t n_out, size_t nb);
/* Repacks n_out GGUF rows of nb 32-value blocks (src) into dst (tdm_cpu_pack_bytes bytes);
 * cannot fail for the eight types. */
void tdm_cpu_pack(tdm_ggml_type_t type, const uint8_t *src, uint64_t n_out, size_t nb,
                  uint8_t *dst);

/* Rounds to the nearest f16 value (activation scales are kept at f16 precision, as ggml's
 * block_q8_0 / block_q8_1 store them, so the engine multiplies the numbers llama.cpp does). */
float tdm_cpu_round_fp16(float x);

/* The kernels of one instruction set. */
typedef struct tdm_cpu_isa {
    const char *name; /* "scalar", "avx2", "avx2+vnni", "avx512-vnni", "amx-int8" */
    /* Quantizes n values (a multiple of 32) into n/32 blocks, rounding half to even. */
    void (*quantize_act)(const float *x, size_t n, q8a_block_t *out);
    /* The f32 ops give identical bits in every set. dot_f32 sums in one canonical order: 8
     * lanes, lane l an fma chain over elements 8c + l from 0; then ((l0 + l4) + (l2 + l6)) +
     * ((l1 + l5) + (l3 + l7)); then the n % 8 tail elements fma'd into that sum in order. */
    float (*dot_f32)(const float *x, const float *y, size_t n);
    /* q · k with k stored as f16 (attention over an f16 cache), in dot_f32's order */
    float (*dot_f32_f16)(const float *q, const uint16_t *k, size_t n);
    /* out[i] = fma(p, v[i], out[i]) for v f16 / f32 */
    void (*axpy_f16)(float *out, float p, const uint16_t *v, size_t n);
    void (*axpy_f32)(float *out, float p, const float *v, size_t n);
    /* Grouped-query attention over f16 rows, one K/V row conversion for nh query heads (all
     * the heads of one KV head's group). scores_f16: sc[h * ldsc + j] = q_h . k_j for h < nh
     * (q_h = q + h * d, f32) and j < nk (k_j = k + j * d, f16), each bit for bit
     * dot_f32_f16(q_h, k_j, d). pv_f16: o_h += sum_j p[h * ldp + j] * v_j over j = 0 .. nv - 1
     * in order (o_h = o + h * d), bit for bit nv calls of axpy_f16. */
    void (*scores_f16)(const float *q, uint32_t nh, const uint16_t *k, uint32_t nk, size_t d,
                       float *sc, size_t ldsc);
    void (*pv_f16)(float *o, uint32_t nh, const float *p, size_t ldp, const uint16_t *v,
                   uint32_t nv, size_t d);
    /* The same over int8 rows of a q8 cache record (one f32 scale for the record's rows), each
     * value dequantized as the reference does, (float)k * scale (one rounding), before it is
     * used. scores_q8: sc[h * ldsc + j] bit for bit dot_f32(q_h, kd_j, d) with kd_j[i] =
     * (float)k[j * d + i] * scale; pv_q8: bit for bit nv calls of axpy_f32 with the rows so
     * dequantized. NULL in the scalar set: there a q8 cache takes the reference path (each row
     * dequantized, then dot_f32 and axpy_f32 per query head), whose bits these reproduce, so the
     * engine tests that compare the families compare the two paths. */
    void (*scores_q8)(const float *q, uint32_t nh, const int8_t *k, float scale, uint32_t nk,
                      size_t d, float *sc, size_t ldsc);
    void (*pv_q8)(float *o, uint32_t nh, const float *p, size_t ldp, const int8_t *v, float scale,
                  uint32_t nv, size_t d);
    /* dst = src rounded to f16 */
    void (*store_f16)(uint16_t *dst, const float *src, size_t n);
    /* dst[i] = tdm_cpu_round_fp16(src[i] * scale) (dst may be src) */
    void (*round_f16)(float *dst, const float *src, float scale, size_t n);
    /* x[j] *= scale for j < n; returns the largest product (-inf when n is 0; a NaN product is
     * never the maximum) */
    float (*scale_max)(float *x, size_t n, float scale);
    /* x[j] = tdm_cpu_expf(x[j] - mx) for j < n; returns their sum in double, in
     * tdm_cpu_fold_lanes' order (the softmax denominator) */
    double (*exp_sum)(float *x, size_t n, float mx);
    /* out[i] = g / (1 + tdm_cpu_expf(-g)) * up[i] with g = gate[i] (SiLU(gate) * up; out may
     * be gate) */
    void (*swiglu)(float *out, const float *gate, const float *up, size_t n);
    bool packed;                            /* gemm reads packed matrices */
    tdm_cpu_gemm_fn gemm[TDM_CPU_N_QTYPES]; /* [qtype] */
} tdm_cpu_isa_t;

/* A derived kernel set: *out = *base with its name and its q8a GEMMs ([TDM_CPU_N_QTYPES],
 * in tdm_cpu_qtype_t order) replaced; what base has for the other ops is kept. */
static inline void tdm_cpu_isa_derive(tdm_cpu_isa_t *out, const tdm_cpu_isa_t *base,
                                      const char *name, const tdm_cpu_gemm_fn *gemm)
{
    *out = *base;
    out->name = name;
    for (int q = 0; q < TDM_CPU_N_QTYPES; q++)
        out->gemm[q] = gemm[q];
}

/* The kernel sets. Each getter returns NULL when this CPU (or build) lacks the instructions;
 * the scalar one never does. The returned tables are static. */
const tdm_cpu_isa_t *tdm_cpu_isa_scalar(void);
const tdm_cpu_isa_t *tdm_cpu_isa_avx2(void);
const tdm_cpu_isa_t *tdm_cpu_isa_vnni(void);
const tdm_cpu_isa_t *tdm_cpu_isa_avx512(void);
/* AVX-512 VNNI plus AMX-INT8 tile multiplies for batches of TDM_AMX_MIN_TOKENS tokens or more
 * (cpu_amx.c); its GEMMs pass smaller batches to the AVX-512 ones */
#define TDM_AMX_MIN_TOKENS 8
const tdm_cpu_isa_t *tdm_cpu_isa_amx(void);
/* AMX-TILE + AMX-INT8 present, AVX-512 VNNI too, and the kernel granted the tile state */
bool tdm_cpu_has_amx(void);

/* AVX-512 VNNI (cpu_avx512.c): two 32-value blocks per 512-bit register. A weight row is
 * prepared once per tile of tokens into zprep_stride(nb) bytes, each token's activations into
 * zact_stride(nb) bytes; see cpu_avx512.c for the layouts. */
#define TDM_ZMAX_BLOCKS 512 /* widest input zdot_fused1 takes: 16384 elements */
bool tdm_cpu_has_avx512vnni(void);
size_t tdm_cpu_zact_stride(size_t nb);
size_t tdm_cpu_zprep_stride(size_t nb);
void tdm_cpu_zact_fill(const q8a_block_t *a, size_t nb, uint8_t *dst);
void tdm_cpu_zrow_prep(tdm_ggml_type_t type, const uint8_t *wr, size_t nb, uint8_t *dst);
float tdm_cpu_zdot_fused1(tdm_ggml_type_t type, const uint8_t *wr, size_t nb, const uint8_t *tok);
void tdm_cpu_zdot(const uint8_t *prep, size_t nb, const uint8_t *const *tok, float *y, int nt);

#endif /* TANDEM_MODEL_CPU_KERNELS_H */
