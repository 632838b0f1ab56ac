/* cpu.c - the CPU backend: OpenMP threads, AVX2/FMA/F16C kernels chosen at run time with a
 * portable scalar fallback, quantized weights used in place.
 *
 * Matmuls with Q4_0, Q4_1 and Q8_0 weights quantize each activation row to 8 bits in blocks
 * of 32 (scale d = max|x| / 127, as ggml's Q8_0/Q8_1 activations) and take integer dot
 * products per block; other weight types are dequantized a row at a time into per-thread
 * scratch and dotted in f32. Each weight row is read once per tile of up to 64 tokens and
 * kept in L1 while every token of the tile uses it: batched decode costs little more
 * weight traffic than one token.
 *
 * Batch invariance: every output element (a row of W against one token's activations) is
 * reduced by the same code in the same order whatever the batch holds, threads split work by
 * output rows only, and attention reduces over positions 0..pos in order. So a sequence's
 * logits do not depend on its neighbours in the batch or on how its prompt was chunked.
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/backend.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define TDM_X86 1
#endif

#define QK 32         /* activation block size */
#define TOKEN_TILE 64 /* tokens per pass over a weight row tile */

/* An activation block: 32 int8 values x ≈ d * q, and s = d * sum(q) (for the Q4_1 min term). */
typedef struct q8a_block {
    float d;
    float s;
    int8_t q[QK];
} q8a_block_t;

/* y[t] = W_row · a[t] for the kernel's number of tokens (1..4); see TDM_GEN_DOTS. */
typedef void (*dot_q8a_fn)(const void *w, const q8a_block_t *const *a, size_t nb, float *y);

/* The kernels of one weight type, indexed by the number of tokens - 1. */
typedef struct dot_q8a_set {
    dot_q8a_fn k[4];
} dot_q8a_set_t;

typedef struct cpu_be {
    const tdm_model_t *model;
    const tdm_llama_hparams_t *hp;
    tdm_kv_pool_t *pool;
    tdm_kv_layout_t kl;
    uint64_t block_bytes, rec_bytes;
    int n_threads;
    uint32_t max_rows, n_ctx;
    bool avx2;   /* AVX2 + FMA + F16C kernels */
    bool vnni;   /* AVX-VNNI dot products on top of AVX2 */
    bool avx512; /* AVX-512 F/BW/VL + VNNI kernels for Q4_0/Q4_1/Q8_0 (supersede the above) */
    char name[32];
    dot_q8a_set_t dot_q4_0, dot_q4_1, dot_q8_0;
    void **allocs; /* every buffer from cpu_alloc, freed at destroy */
    size_t n_allocs, cap_allocs;
    size_t max_in;    /* widest matmul input (elements) */
    q8a_block_t *act; /* [max_rows][max_in / 32] quantized activations */
    uint8_t *zact;    /* [max_rows][zact stride] activations in the AVX-512 layout */
    uint8_t *zprep;   /* [n_threads][zprep stride] one weight row prepared for AVX-512 */
    float *wrow;      /* [n_threads][max_in] dequantized weight rows */
    float *scores;    /* [n_threads][n_ctx] attention scores */
    float *kvrow;     /* [n_threads][2 * head_dim] converted K/V rows */
    float *rope_cs;   /* [max_rows][rope_dim] cos, sin pairs */
} cpu_be_t;

/* ---- scalar kernels (portable reference) ---- */

static float dot_q4_1_scalar(const void *w, const q8a_block_t *a, size_t nb)
{
    const uint8_t *p = w;
    float acc = 0.0f;
    for (size_t b = 0; b < nb; b++, p += 20) {
        uint16_t hd, hm;
        memcpy(&hd, p, 2);
        memcpy(&hm, p + 2, 2);
        const uint8_t *qs = p + 4;
        int sumi = 0;
        for (int j = 0; j < 16; j++)
            sumi += (qs[j] & 15) * a[b].q[j] + (qs[j] >> 4) * a[b].q[j + 16];
        acc += tdm_fp16_to_fp32(hd) * a[b].d * (float)sumi + tdm_fp16_to_fp32(hm) * a[b].s;
    }
    return acc;
}

static float dot_q4_0_scalar(const void *w, const q8a_block_t *a, size_t nb)
{
    const uint8_t *p = w;
    float acc = 0.0f;
    for (size_t b = 0; b < nb; b++, p += 18) {
        uint16_t hd;
        memcpy(&hd, p, 2);
        const uint8_t *qs = p + 2;
        int sumi = 0;
        for (int j = 0; j < 16; j++)
            sumi += ((qs[j] & 15) - 8) * a[b].q[j] + ((qs[j] >> 4) - 8) * a[b].q[j + 16];
        acc += tdm_fp16_to_fp32(hd) * a[b].d * (float)sumi;
    }
    return acc;
}

static float dot_q8_0_scalar(const void *w, const q8a_block_t *a, size_t nb)
{
    const uint8_t *p = w;
    float acc = 0.0f;
    for (size_t b = 0; b < nb; b++, p += 34) {
        uint16_t hd;
        memcpy(&hd, p, 2);
        const int8_t *qs = (const int8_t *)(p + 2);
        int sumi = 0;
        for (int j = 0; j < 32; j++)
            sumi += qs[j] * a[b].q[j];
        acc += tdm_fp16_to_fp32(hd) * a[b].d * (float)sumi;
    }
    return acc;
}

static float dot_f32_scalar(const float *x, const float *y, size_t n)
{
    float acc = 0.0f;
    for (size_t i = 0; i < n; i++)
        acc += x[i] * y[i];
    return acc;
}

/* Scalar kernels for any number of tokens: one token at a time (same arithmetic for each). */
#define TDM_GEN_SCALAR_DOTS(name)                                                                  \
    static void name##_multi(const void *w, const q8a_block_t *const *a, size_t nb, float *y,      \
                             int nt)                                                               \
    {                                                                                              \
        for (int t = 0; t < nt; t++)                                                               \
            y[t] = name(w, a[t], nb);                                                              \
    }                                                                                              \
    static void name##_1(const void *w, const q8a_block_t *const *a, size_t nb, float *y)          \
    {                                                                                              \
        name##_multi(w, a, nb, y, 1);                                                              \
    }                                                                                              \
    static void name##_2(const void *w, const q8a_block_t *const *a, size_t nb, float *y)          \
    {                                                                                              \
        name##_multi(w, a, nb, y, 2);                                                              \
    }                                                                                              \
    static void name##_3(const void *w, const q8a_block_t *const *a, size_t nb, float *y)          \
    {                                                                                              \
        name##_multi(w, a, nb, y, 3);                                                              \
    }                                                                                              \
    static void name##_4(const void *w, const q8a_block_t *const *a, size_t nb, float *y)          \
    {                                                                                              \
        name##_multi(w, a, nb, y, 4);                                                              \
    }
TDM_GEN_SCALAR_DOTS(dot_q4_0_scalar)
TDM_GEN_SCALAR_DOTS(dot_q4_1_scalar)
TDM_GEN_SCALAR_DOTS(dot_q8_0_scalar)

/* The scales of activation blocks are kept at f16 precision, as ggml's block_q8_0 / block_q8_1
 * store them (d and s = d * sum(q) in f16): the engine then multiplies the same numbers as
 * llama.cpp does, which keeps its logits closest to the reference's. */
static inline float round_fp16(float x)
{
    return tdm_fp16_to_fp32(tdm_fp32_to_fp16(x));
}

/* Quantizes n values (a multiple of 32) into n/32 activation blocks, rounding half to even. */
static void quantize_act_scalar(const float *x, size_t n, q8a_block_t *out)
{
    for (size_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++)
            amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(xb[j] * id);
            out[b].q[j] = (int8_t)q;
            sum += q;
        }
        out[b].d = round_fp16(d);
        out[b].s = round_fp16(d * (float)sum);
    }
}

/* ---- AVX2 / FMA / F16C kernels ---- */
#ifdef TDM_X86
#define TDM_AVX2 __attribute__((target("avx2,fma,f16c")))

TDM_AVX2 static inline float hsum_ps(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* 32 4-bit values of a Q4 block as bytes: low nibbles then high nibbles. */
TDM_AVX2 static inline __m256i unpack_nibbles(const uint8_t *qs)
{
    __m128i raw = _mm_loadu_si128((const __m128i *)qs);
    __m128i lo = _mm_and_si128(raw, _mm_set1_epi8(15));
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
    return _mm256_set_m128i(hi, lo);
}

/* sum over 32 lanes of u[i] * s[i] (u unsigned 0..255, s signed) as 8 int32 lanes as floats */
TDM_AVX2 static inline __m256 mul_sum_us8(__m256i u, __m256i s)
{
    __m256i p16 = _mm256_maddubs_epi16(u, s);
    __m256i p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
    return _mm256_cvtepi32_ps(p32);
}

/* The same with AVX-VNNI: one vpdpbusd instead of vpmaddubsw + vpmaddwd. */
#define TDM_AVXVNNI __attribute__((target("avx2,fma,f16c,avxvnni")))
TDM_AVXVNNI static inline __m256 mul_sum_us8_vnni(__m256i u, __m256i s)
{
    return _mm256_cvtepi32_ps(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s));
}

/* Wrappers for NT = 1..4 around a kernel body name##_n, for one instruction set. */
#define TDM_GEN_DOTS_FOR(name)                                                                     \
    TDM_KTARGET static void TDM_KNAME(name##_1)(const void *w, const q8a_block_t *const *a,        \
                                                size_t nb, float *y)                               \
    {                                                                                              \
        TDM_KNAME(name##_n)(w, a, nb, y, 1);                                                       \
    }                                                                                              \
    TDM_KTARGET static void TDM_KNAME(name##_2)(const void *w, const q8a_block_t *const *a,        \
                                                size_t nb, float *y)                               \
    {                                                                                              \
        TDM_KNAME(name##_n)(w, a, nb, y, 2);                                                       \
    }                                                                                              \
    TDM_KTARGET static void TDM_KNAME(name##_3)(const void *w, const q8a_block_t *const *a,        \
                                                size_t nb, float *y)                               \
    {                                                                                              \
        TDM_KNAME(name##_n)(w, a, nb, y, 3);                                                       \
    }                                                                                              \
    TDM_KTARGET static void TDM_KNAME(name##_4)(const void *w, const q8a_block_t *const *a,        \
                                                size_t nb, float *y)                               \
    {                                                                                              \
        TDM_KNAME(name##_n)(w, a, nb, y, 4);                                                       \
    }

#define TDM_KTARGET TDM_AVX2
#define TDM_KNAME(x) x##_avx2
#define TDM_KMULSUM mul_sum_us8
#include "model/cpu_dots.inc"
#undef TDM_KTARGET
#undef TDM_KNAME
#undef TDM_KMULSUM

#define TDM_KTARGET TDM_AVXVNNI
#define TDM_KNAME(x) x##_vnni
#define TDM_KMULSUM mul_sum_us8_vnni
#include "model/cpu_dots.inc"
#undef TDM_KTARGET
#undef TDM_KNAME
#undef TDM_KMULSUM

TDM_AVX2 static float dot_f32_avx2(const float *x, const float *y, size_t n)
{
    __m256 acc = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
    float s = hsum_ps(acc);
    for (; i < n; i++)
        s += x[i] * y[i];
    return s;
}

TDM_AVX2 static void quantize_act_avx2(const float *x, size_t n, q8a_block_t *out)
{
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (size_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        __m256 v[4];
        __m256 mx = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_ps(xb + 8 * k);
            mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[k]));
        }
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        float amax = _mm_cvtss_f32(m4);
        float d = amax / 127.0f, id = d != 0.0f ? 1.0f / d : 0.0f;
        __m256 vid = _mm256_set1_ps(id);
        __m256i qi[4];
        for (int k = 0; k < 4; k++)
            qi[k] = _mm256_cvtps_epi32(_mm256_round_ps(
                _mm256_mul_ps(v[k], vid), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i sum =
            _mm256_add_epi32(_mm256_add_epi32(qi[0], qi[1]), _mm256_add_epi32(qi[2], qi[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_hadd_epi32(s4, s4);
        s4 = _mm_hadd_epi32(s4, s4);
        /* pack 32 int32 to int8 in order: packs interleave 128-bit lanes, permute fixes it */
        __m256i p01 = _mm256_packs_epi32(qi[0], qi[1]);
        __m256i p23 = _mm256_packs_epi32(qi[2], qi[3]);
        __m256i p = _mm256_packs_epi16(p01, p23);
        p = _mm256_permutevar8x32_epi32(p, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[b].q, p);
        out[b].d = round_fp16(d);
        out[b].s = round_fp16(d * (float)_mm_cvtsi128_si32(s4));
    }
}

/* dot of a query (f32) with a K row stored as f16 */
TDM_AVX2 static float dot_f32_f16_avx2(const float *q, const uint16_t *k, size_t n)
{
    __m256 acc = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i),
                              _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(k + i))), acc);
    float s = hsum_ps(acc);
    for (; i < n; i++)
        s += q[i] * _cvtsh_ss(k[i]);
    return s;
}

/* out += p * v (v f16) */
TDM_AVX2 static void axpy_f16_avx2(float *out, float p, const uint16_t *v, size_t n)
{
    __m256 vp = _mm256_set1_ps(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(
            out + i, _mm256_fmadd_ps(vp, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(v + i))),
                                     _mm256_loadu_ps(out + i)));
    for (; i < n; i++)
        out[i] += p * _cvtsh_ss(v[i]);
}

TDM_AVX2 static void axpy_f32_avx2(float *out, float p, const float *v, size_t n)
{
    __m256 vp = _mm256_set1_ps(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < n; i++)
        out[i] += p * v[i];
}

TDM_AVX2 static void store_f16_avx2(uint16_t *dst, const float *src, size_t n)
{
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm_storeu_si128((__m128i *)(dst + i),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
    for (; i < n; i++)
        dst[i] = tdm_fp32_to_fp16(src[i]);
}

static bool cpu_has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

static bool cpu_has_avxvnni(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avxvnni");
}
#else
static bool cpu_has_avx2(void)
{
    return false;
}

static bool cpu_has_avxvnni(void)
{
    return false;
}
#endif

/* ---- AVX-512 VNNI kernels (Q4_0, Q4_1, Q8_0) ----
 *
 * Two 32-value blocks fill one 512-bit register, so one vpdpbusd does 64 multiply-adds. Every
 * weight type is brought to one form per block: unsigned bytes u, scale dw and offset mw with
 * w = dw * u + mw (Q4_1: u = nibble, mw = m; Q4_0: mw = -8 dw; Q8_0: u = q + 128,
 * mw = -128 dw). With activations a = da * qa (qa int8, s = da * sum(qa)) a block contributes
 * dw * da * sum(u * qa) + mw * s: an exact integer dot product, then float work. A weight row
 * is prepared once per tile of tokens (u bytes, dw broadcast per block half, mw as floats) and
 * then serves up to 8 tokens per pass; each token's result comes from the same operations
 * whatever the number of tokens, so batching changes no bit of any result. */

/* Layout of one token's activations (AVX-512): q[npairs * 64] int8 (zero padded), then
 * dexp[npairs * 16] floats (block b's da repeated 8 times), then s[nb] floats. */
/* The widest matmul input the fused kernel's stack array takes: 16384 elements. */
#define TDM_ZMAX_BLOCKS 512

static size_t zact_stride(size_t nb)
{
    size_t npairs = (nb + 1) / 2;
    return npairs * 64 + npairs * 64 + (nb + 15) / 16 * 64;
}

/* Layout of one prepared weight row: u[npairs * 64] bytes, dw[npairs * 16] floats, then
 * mw[nb] floats. */
static size_t zprep_stride(size_t nb)
{
    return zact_stride(nb);
}

#ifdef TDM_X86
#define TDM_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

static bool cpu_has_avx512vnni(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* Rewrites one token's q8a blocks into the AVX-512 layout. */
TDM_AVX512 static void zact_fill(const q8a_block_t *a, size_t nb, uint8_t *dst)
{
    size_t npairs = (nb + 1) / 2;
    int8_t *q = (int8_t *)dst;
    float *dexp = (float *)(dst + npairs * 64), *sv = (float *)(dst + npairs * 128);
    for (size_t b = 0; b < 2 * npairs; b++) {
        if (b < nb) {
            memcpy(q + b * QK, a[b].q, QK);
            _mm256_storeu_ps(dexp + b * 8, _mm256_set1_ps(a[b].d));
            sv[b] = a[b].s;
        } else {
            memset(q + b * QK, 0, QK);
            _mm256_storeu_ps(dexp + b * 8, _mm256_setzero_ps());
        }
    }
}

/* Prepares one weight row (type Q4_0, Q4_1 or Q8_0; nb blocks) into dst. */
TDM_AVX512 static void zrow_prep(tdm_ggml_type_t type, const uint8_t *wr, size_t nb, uint8_t *dst)
{
    size_t npairs = (nb + 1) / 2;
    uint8_t *u = dst;
    float *dw = (float *)(dst + npairs * 64), *mw = (float *)(dst + npairs * 128);
    size_t bsz = type == TDM_GGML_TYPE_Q4_1 ? 20 : type == TDM_GGML_TYPE_Q4_0 ? 18 : 34;
    for (size_t b = 0; b < 2 * npairs; b++) {
        if (b >= nb) {
            memset(u + b * QK, 0, QK);
            _mm256_storeu_ps(dw + b * 8, _mm256_setzero_ps());
            continue;
        }
        const uint8_t *blk = wr + b * bsz;
        uint16_t hd;
        memcpy(&hd, blk, 2);
        float d = _cvtsh_ss(hd), m;
        __m256i ub;
        if (type == TDM_GGML_TYPE_Q8_0) {
            ub = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                  _mm256_set1_epi8((char)0x80));
            m = -128.0f * d;
        } else if (type == TDM_GGML_TYPE_Q4_0) {
            ub = unpack_nibbles(blk + 2);
            m = -8.0f * d;
        } else {
            uint16_t hm;
            memcpy(&hm, blk + 2, 2);
            ub = unpack_nibbles(blk + 4);
            m = _cvtsh_ss(hm);
        }
        _mm256_storeu_si256((__m256i *)(u + b * QK), ub);
        _mm256_storeu_ps(dw + b * 8, _mm256_set1_ps(d));
        mw[b] = m;
    }
}

TDM_AVX512 static inline __attribute__((always_inline)) void
zdot_n(const uint8_t *prep, size_t nb, const uint8_t *const *tok, float *y, const int nt)
{
    size_t npairs = (nb + 1) / 2;
    const uint8_t *u = prep;
    const float *dw = (const float *)(prep + npairs * 64),
                *mw = (const float *)(prep + npairs * 128);
    __m512 acc[8];
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t p = 0; p < npairs; p++) {
        __m512i uv = _mm512_loadu_si512(u + p * 64);
        __m512 dwv = _mm512_loadu_ps(dw + p * 16);
#pragma GCC unroll 8
        for (int t = 0; t < nt; t++) {
            __m512i qa = _mm512_loadu_si512(tok[t] + p * 64);
            __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), uv, qa));
            const float *dexp = (const float *)(tok[t] + npairs * 64);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(f, dwv), _mm512_loadu_ps(dexp + p * 16), acc[t]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < nt; t++) {
        const float *sv = (const float *)(tok[t] + npairs * 128);
        __m512 am = _mm512_setzero_ps();
        for (size_t b = 0; b < nb; b += 16) {
            __mmask16 k = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
            am = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mw + b), _mm512_maskz_loadu_ps(k, sv + b),
                                 am);
        }
        y[t] = _mm512_reduce_add_ps(acc[t]) + _mm512_reduce_add_ps(am);
    }
}

/* One token against one weight row without the prepared-row buffer: u and dw are built in
 * registers, mw on the stack. The operations on the token's side are those of zdot_n, so the
 * result is bit-identical to zdot with a prepared row; this saves the prepare pass when a
 * matmul has a single token (batch-1 decode). */
TDM_AVX512 static float zdot_fused1(tdm_ggml_type_t type, const uint8_t *wr, size_t nb,
                                    const uint8_t *tok)
{
    size_t npairs = (nb + 1) / 2;
    size_t bsz = type == TDM_GGML_TYPE_Q4_1 ? 20 : type == TDM_GGML_TYPE_Q4_0 ? 18 : 34;
    float mw[TDM_ZMAX_BLOCKS];
    const float *dexp = (const float *)(tok + npairs * 64),
                *sv = (const float *)(tok + npairs * 128);
    __m512 acc = _mm512_setzero_ps();
    for (size_t p = 0; p < npairs; p++) {
        __m256i ub[2];
        float d[2];
        for (int h = 0; h < 2; h++) {
            size_t b = 2 * p + (size_t)h;
            if (b >= nb) {
                ub[h] = _mm256_setzero_si256();
                d[h] = 0.0f;
                continue;
            }
            const uint8_t *blk = wr + b * bsz;
            uint16_t hd;
            memcpy(&hd, blk, 2);
            d[h] = _cvtsh_ss(hd);
            if (type == TDM_GGML_TYPE_Q8_0) {
                ub[h] = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(blk + 2)),
                                         _mm256_set1_epi8((char)0x80));
                mw[b] = -128.0f * d[h];
            } else if (type == TDM_GGML_TYPE_Q4_0) {
                ub[h] = unpack_nibbles(blk + 2);
                mw[b] = -8.0f * d[h];
            } else {
                uint16_t hm;
                memcpy(&hm, blk + 2, 2);
                ub[h] = unpack_nibbles(blk + 4);
                mw[b] = _cvtsh_ss(hm);
            }
        }
        __m512i uv = _mm512_inserti64x4(_mm512_castsi256_si512(ub[0]), ub[1], 1);
        __m512 dwv = _mm512_castpd_ps(
            _mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(_mm256_set1_ps(d[0]))),
                               _mm256_castps_pd(_mm256_set1_ps(d[1])), 1));
        __m512i qa = _mm512_loadu_si512(tok + p * 64);
        __m512 f = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), uv, qa));
        acc = _mm512_fmadd_ps(_mm512_mul_ps(f, dwv), _mm512_loadu_ps(dexp + p * 16), acc);
    }
    __m512 am = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b += 16) {
        __mmask16 k = nb - b >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (nb - b)) - 1);
        am =
            _mm512_fmadd_ps(_mm512_maskz_loadu_ps(k, mw + b), _mm512_maskz_loadu_ps(k, sv + b), am);
    }
    return _mm512_reduce_add_ps(acc) + _mm512_reduce_add_ps(am);
}

/* y[t] for nt (1..8) tokens; every nt runs the same per-token operations. */
TDM_AVX512 static void zdot(const uint8_t *prep, size_t nb, const uint8_t *const *tok, float *y,
                            int nt)
{
    switch (nt) {
    case 1: zdot_n(prep, nb, tok, y, 1); break;
    case 2: zdot_n(prep, nb, tok, y, 2); break;
    case 3: zdot_n(prep, nb, tok, y, 3); break;
    case 4: zdot_n(prep, nb, tok, y, 4); break;
    case 5: zdot_n(prep, nb, tok, y, 5); break;
    case 6: zdot_n(prep, nb, tok, y, 6); break;
    case 7: zdot_n(prep, nb, tok, y, 7); break;
    default: zdot_n(prep, nb, tok, y, 8); break;
    }
}
#else
static bool cpu_has_avx512vnni(void)
{
    return false;
}
#endif

/* ---- dispatch helpers ---- */

static float dot_f32(const cpu_be_t *be, const float *x, const float *y, size_t n)
{
#ifdef TDM_X86
    if (be->avx2)
        return dot_f32_avx2(x, y, n);
#endif
    return dot_f32_scalar(x, y, n);
}

static void quantize_act(const cpu_be_t *be, const float *x, size_t n, q8a_block_t *out)
{
#ifdef TDM_X86
    if (be->avx2) {
        quantize_act_avx2(x, n, out);
        return;
    }
#endif
    quantize_act_scalar(x, n, out);
}

/* The q8a dot kernels for a weight type, or NULL when the type takes the f32 path. */
static const dot_q8a_set_t *q8a_kernel(const cpu_be_t *be, tdm_ggml_type_t type, uint64_t n_in)
{
    if (n_in % QK != 0)
        return NULL;
    switch (type) {
    case TDM_GGML_TYPE_Q4_0: return &be->dot_q4_0;
    case TDM_GGML_TYPE_Q4_1: return &be->dot_q4_1;
    case TDM_GGML_TYPE_Q8_0: return &be->dot_q8_0;
    default: return NULL;
    }
}

/* ---- ops ---- */

static float *cpu_alloc(void *vbe, size_t n)
{
    cpu_be_t *be = vbe;
    if (be->n_allocs == be->cap_allocs) {
        size_t cap = be->cap_allocs ? be->cap_allocs * 2 : 16;
        void **a = realloc(be->allocs, cap * sizeof *a);
        if (!a)
            return NULL;
        be->allocs = a;
        be->cap_allocs = cap;
    }
    size_t bytes = (n * sizeof(float) + 63) / 64 * 64;
    float *p = aligned_alloc(64, bytes ? bytes : 64);
    if (!p)
        return NULL;
    memset(p, 0, bytes ? bytes : 64);
    be->allocs[be->n_allocs++] = p;
    return p;
}

static void cpu_destroy(void *vbe)
{
    cpu_be_t *be = vbe;
    if (!be)
        return;
    for (size_t i = 0; i < be->n_allocs; i++)
        free(be->allocs[i]);
    free(be->allocs);
    free(be);
}

/* Picks the dot kernels: the best the CPU has, capped by TANDEM_CPU_KERNELS; names them. */
static void cpu_pick_kernels(cpu_be_t *be)
{
    /* TANDEM_CPU_KERNELS=scalar|avx2 caps the kernels (tests compare them; "auto" is best) */
    const char *cap = getenv("TANDEM_CPU_KERNELS");
    bool scalar_only = cap && strcmp(cap, "scalar") == 0;
    be->avx2 = cpu_has_avx2() && !scalar_only;
    bool avx2_cap = cap && (strcmp(cap, "avx2") == 0 || strcmp(cap, "vnni") == 0);
    be->vnni = be->avx2 && cpu_has_avxvnni() && !(cap && strcmp(cap, "avx2") == 0);
    be->avx512 = be->avx2 && cpu_has_avx512vnni() && !avx2_cap;
#define TDM_SET_DOTS(field, name)                                                                  \
    be->field = (dot_q8a_set_t)                                                                    \
    {                                                                                              \
        {                                                                                          \
            name##_1, name##_2, name##_3, name##_4                                                 \
        }                                                                                          \
    }
    TDM_SET_DOTS(dot_q4_0, dot_q4_0_scalar);
    TDM_SET_DOTS(dot_q4_1, dot_q4_1_scalar);
    TDM_SET_DOTS(dot_q8_0, dot_q8_0_scalar);
#ifdef TDM_X86
#define TDM_SET_SIMD_DOTS(field, isa)                                                              \
    be->field = (dot_q8a_set_t)                                                                    \
    {                                                                                              \
        {                                                                                          \
            field##_1_##isa, field##_2_##isa, field##_3_##isa, field##_4_##isa                     \
        }                                                                                          \
    }
    if (be->avx2 && be->vnni) {
        TDM_SET_SIMD_DOTS(dot_q4_0, vnni);
        TDM_SET_SIMD_DOTS(dot_q4_1, vnni);
        TDM_SET_SIMD_DOTS(dot_q8_0, vnni);
    } else if (be->avx2) {
        TDM_SET_SIMD_DOTS(dot_q4_0, avx2);
        TDM_SET_SIMD_DOTS(dot_q4_1, avx2);
        TDM_SET_SIMD_DOTS(dot_q8_0, avx2);
    }
#undef TDM_SET_SIMD_DOTS
#endif
#undef TDM_SET_DOTS
    snprintf(be->name, sizeof be->name, "cpu/%s",
             be->avx512 ? "avx512-vnni"
             : be->vnni ? "avx2+vnni"
             : be->avx2 ? "avx2"
                        : "scalar");
}

/* The per-thread and per-row scratch, sized for the largest matmul input (max_in). */
static int cpu_scratch_new(cpu_be_t *be, tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = be->hp;
    size_t max_in = hp->n_embd;
    if (hp->n_ff > max_in)
        max_in = hp->n_ff;
    if ((size_t)hp->n_heads * hp->head_dim > max_in)
        max_in = (size_t)hp->n_heads * hp->head_dim;
    be->max_in = max_in;
    size_t nt = (size_t)be->n_threads;
    size_t act_blocks = (size_t)be->max_rows * ((max_in + QK - 1) / QK);
    be->act = (q8a_block_t *)cpu_alloc(be, act_blocks * sizeof(q8a_block_t) / sizeof(float));
    be->wrow = cpu_alloc(be, nt * max_in);
    be->scores = cpu_alloc(be, nt * be->n_ctx);
    be->kvrow = cpu_alloc(be, nt * 2 * hp->head_dim);
    be->rope_cs = cpu_alloc(be, (size_t)be->max_rows * hp->rope_dim);
    size_t znb = (max_in + QK - 1) / QK;
    be->zact = (uint8_t *)cpu_alloc(be, (size_t)be->max_rows * zact_stride(znb) / sizeof(float));
    be->zprep = (uint8_t *)cpu_alloc(be, nt * zprep_stride(znb) / sizeof(float));
    if (!be->act || !be->wrow || !be->scores || !be->kvrow || !be->rope_cs || !be->zact ||
        !be->zprep) {
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory allocating CPU backend scratch");
    }
    return TDM_OK;
}

static void *cpu_create(const tdm_model_t *m, const tdm_engine_params_t *p, tdm_kv_pool_t *pool,
                        tdm_error_t *err)
{
    cpu_be_t *be = calloc(1, sizeof *be);
    if (!be) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    be->model = m;
    be->hp = tdm_model_hparams(m);
    be->pool = pool;
    be->kl = *tdm_kv_pool_layout(pool);
    be->block_bytes = tdm_kv_block_bytes(&be->kl);
    be->rec_bytes = tdm_kv_record_bytes(&be->kl);
    be->n_threads = p->n_threads > 0 ? p->n_threads : omp_get_max_threads();
    be->max_rows = p->max_batch_tokens;
    be->n_ctx = p->n_ctx;
    cpu_pick_kernels(be);
    if (cpu_scratch_new(be, err) != TDM_OK) {
        cpu_destroy(be);
        return NULL;
    }
    return be;
}

static const char *cpu_kernel_name(const void *vbe)
{
    return ((const cpu_be_t *)vbe)->name;
}

static int cpu_embed(void *vbe, const tdm_weight_t *emb, const int32_t *tokens, uint32_t n,
                     float *x)
{
    cpu_be_t *be = vbe;
    size_t E = emb->n_in;
    int rc = TDM_OK;
#pragma omp parallel for schedule(static) num_threads(be->n_threads)
    for (uint32_t t = 0; t < n; t++) {
        const uint8_t *row = (const uint8_t *)emb->data + (size_t)tokens[t] * emb->row_bytes;
        if (tdm_ggml_dequantize_row(emb->type, row, x + t * E, (int64_t)E) != TDM_OK) {
#pragma omp atomic write
            rc = TDM_EINVALID;
        }
    }
    return rc;
}

static int cpu_rmsnorm(void *vbe, const float *x, const tdm_weight_t *w, uint32_t n, float eps,
                       float *out)
{
    cpu_be_t *be = vbe;
    size_t E = w->n_in;
    if (w->type != TDM_GGML_TYPE_F32)
        return TDM_EINVALID;
    const float *g = w->data;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (n > 4)
    for (uint32_t t = 0; t < n; t++) {
        const float *xr = x + t * E;
        float *o = out + t * E;
        double sum = 0.0;
        for (size_t i = 0; i < E; i++)
            sum += (double)(xr[i] * xr[i]);
        float mean = (float)(sum / (double)E);
        float scale = 1.0f / sqrtf(mean + eps);
        for (size_t i = 0; i < E; i++)
            o[i] = (xr[i] * scale) * g[i];
    }
    return TDM_OK;
}

static int cpu_matmul(void *vbe, const float *x, uint32_t n, uint32_t n_w,
                      const tdm_weight_t *const *w, float *const *out)
{
    cpu_be_t *be = vbe;
    size_t K = w[0]->n_in;
    bool need_q8 = false;
    uint64_t total_rows = 0;
    for (uint32_t k = 0; k < n_w; k++) {
        if (w[k]->n_in != K || K > be->max_in)
            return TDM_EINTERNAL;
        need_q8 |= q8a_kernel(be, w[k]->type, K) != NULL;
        total_rows += w[k]->n_out;
    }
    size_t nb = K / QK;
    if (need_q8) {
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (n > 1)
        for (uint32_t t = 0; t < n; t++) {
            quantize_act(be, x + t * K, K, be->act + t * nb);
#ifdef TDM_X86
            if (be->avx512)
                zact_fill(be->act + t * nb, nb, be->zact + t * zact_stride(nb));
#endif
        }
    }
    /* rows of all weights form one index space split among threads in chunks of 16 */
    int64_t n_chunks = (int64_t)((total_rows + 15) / 16);
    int rc = TDM_OK;
#pragma omp parallel for schedule(static) num_threads(be->n_threads)
    for (int64_t c = 0; c < n_chunks; c++) {
        float *wrow = be->wrow + (size_t)omp_get_thread_num() * be->max_in;
        uint64_t r0 = (uint64_t)c * 16, r1 = r0 + 16 < total_rows ? r0 + 16 : total_rows;
        for (uint32_t t0 = 0; t0 < n; t0 += TOKEN_TILE) {
            uint32_t t1 = t0 + TOKEN_TILE < n ? t0 + TOKEN_TILE : n;
            for (uint64_t gr = r0; gr < r1; gr++) {
                uint32_t k = 0;
                uint64_t r = gr;
                while (r >= w[k]->n_out)
                    r -= w[k]->n_out, k++;
                const tdm_weight_t *W = w[k];
                const uint8_t *wr = (const uint8_t *)W->data + r * W->row_bytes;
                float *o = out[k];
                const dot_q8a_set_t *dots = q8a_kernel(be, W->type, K);
#ifdef TDM_X86
                if (dots && be->avx512 && t1 - t0 == 1 && nb <= TDM_ZMAX_BLOCKS) {
                    o[(size_t)t0 * W->n_out + r] =
                        zdot_fused1(W->type, wr, nb, be->zact + (size_t)t0 * zact_stride(nb));
                    continue;
                }
                if (dots && be->avx512) {
                    uint8_t *prep = be->zprep + (size_t)omp_get_thread_num() * zprep_stride(nb);
                    zrow_prep(W->type, wr, nb, prep);
                    for (uint32_t t = t0; t < t1; t += 8) {
                        int nt = t1 - t < 8 ? (int)(t1 - t) : 8;
                        const uint8_t *tok[8];
                        float y[8];
                        for (int j = 0; j < nt; j++)
                            tok[j] = be->zact + (size_t)(t + (uint32_t)j) * zact_stride(nb);
                        zdot(prep, nb, tok, y, nt);
                        for (int j = 0; j < nt; j++)
                            o[(size_t)(t + (uint32_t)j) * W->n_out + r] = y[j];
                    }
                    continue;
                }
#endif
                if (dots) {
                    for (uint32_t t = t0; t < t1; t += 4) {
                        int nt = t1 - t < 4 ? (int)(t1 - t) : 4;
                        const q8a_block_t *a[4];
                        float y[4];
                        for (int j = 0; j < nt; j++)
                            a[j] = be->act + (size_t)(t + (uint32_t)j) * nb;
                        dots->k[nt - 1](wr, a, nb, y);
                        for (int j = 0; j < nt; j++)
                            o[(size_t)(t + (uint32_t)j) * W->n_out + r] = y[j];
                    }
                } else {
                    if (tdm_ggml_dequantize_row(W->type, wr, wrow, (int64_t)K) != TDM_OK) {
#pragma omp atomic write
                        rc = TDM_EINVALID;
                        continue;
                    }
                    for (uint32_t t = t0; t < t1; t++)
                        o[(size_t)t * W->n_out + r] = dot_f32(be, wrow, x + (size_t)t * K, K);
                }
            }
        }
    }
    return rc;
}

static int cpu_add_bias(void *vbe, float *x, const tdm_weight_t *b, uint32_t n)
{
    (void)vbe;
    if (b->type != TDM_GGML_TYPE_F32)
        return TDM_EINVALID;
    const float *bias = b->data;
    size_t D = b->n_in;
    for (uint32_t t = 0; t < n; t++)
        for (size_t i = 0; i < D; i++)
            x[t * D + i] += bias[i];
    return TDM_OK;
}

/* RoPE (Su et al. 2021) as llama.cpp computes it: theta_i = pos * base^(-2i/rope_dim), with
 * the power taken iteratively in f32 (ggml_rope's theta_scale), pairs (2i, 2i+1) for the
 * normal mode and (i, i + rope_dim/2) for neox. Dimensions past rope_dim are unchanged. */
static int cpu_rope(void *vbe, float *q, float *k, const tdm_fwd_rows_t *rows)
{
    cpu_be_t *be = vbe;
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t half = hp->rope_dim / 2, D = hp->head_dim;
    float theta_scale = powf(hp->rope_freq_base, -2.0f / (float)hp->rope_dim);
    bool neox = hp->rope_type == TDM_ROPE_NEOX;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (rows->n > 4)
    for (uint32_t t = 0; t < rows->n; t++) {
        float *cs = be->rope_cs + (size_t)t * hp->rope_dim;
        float theta = (float)rows->pos[t];
        for (uint32_t i = 0; i < half; i++) {
            cs[2 * i] = cosf(theta);
            cs[2 * i + 1] = sinf(theta);
            theta *= theta_scale;
        }
        for (int which = 0; which < 2; which++) {
            uint32_t nh = which == 0 ? hp->n_heads : hp->n_kv_heads;
            float *base =
                which == 0 ? q + (size_t)t * hp->n_heads * D : k + (size_t)t * hp->n_kv_heads * D;
            for (uint32_t h = 0; h < nh; h++) {
                float *x = base + (size_t)h * D;
                for (uint32_t i = 0; i < half; i++) {
                    uint32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
                    float x0 = x[i0], x1 = x[i1], c = cs[2 * i], s = cs[2 * i + 1];
                    x[i0] = x0 * c - x1 * s;
                    x[i1] = x0 * s + x1 * c;
                }
            }
        }
    }
    return TDM_OK;
}

/* Address of the record (layer, kv, head) of the block holding position pos of a sequence. */
static uint8_t *kv_record(const cpu_be_t *be, const tdm_batch_seq_t *sq, uint32_t pos,
                          uint32_t layer, uint32_t kv, uint32_t head)
{
    uint8_t *base = tdm_kv_pool_base(be->pool);
    uint32_t block = sq->blocks[pos / be->kl.block_size];
    return base + (uint64_t)block * be->block_bytes +
           tdm_kv_record_offset(&be->kl, be->rec_bytes, layer, kv, head);
}

/* Stores one K or V head vector into its slot. q8 keeps one scale per record (block, layer,
 * K|V, head): the running max|x| / 127 of the slots written so far; when a new slot needs a
 * larger scale the earlier slots are requantized to it. */
static void kv_put(const cpu_be_t *be, uint8_t *rec, uint32_t slot, const float *src)
{
    uint32_t D = be->kl.head_dim;
    switch (be->kl.dtype) {
    case TDM_KV_F32: memcpy((float *)rec + (size_t)slot * D, src, D * sizeof(float)); break;
    case TDM_KV_F16: {
        uint16_t *dst = (uint16_t *)rec + (size_t)slot * D;
#ifdef TDM_X86
        if (be->avx2) {
            store_f16_avx2(dst, src, D);
            break;
        }
#endif
        for (uint32_t i = 0; i < D; i++)
            dst[i] = tdm_fp32_to_fp16(src[i]);
        break;
    }
    case TDM_KV_Q8: {
        float scale;
        memcpy(&scale, rec, sizeof scale);
        int8_t *qv = (int8_t *)(rec + sizeof(float));
        float amax = 0.0f;
        for (uint32_t i = 0; i < D; i++)
            amax = fmaxf(amax, fabsf(src[i]));
        float need = amax / 127.0f;
        if (slot == 0)
            scale = need;
        else if (need > scale) {
            for (size_t i = 0; i < (size_t)slot * D; i++)
                qv[i] = (int8_t)nearbyintf((float)qv[i] * scale / need);
            scale = need;
        }
        float id = scale != 0.0f ? 1.0f / scale : 0.0f;
        for (uint32_t i = 0; i < D; i++) {
            float v = nearbyintf(src[i] * id);
            qv[(size_t)slot * D + i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
        }
        memcpy(rec, &scale, sizeof scale);
        break;
    }
    }
}

static int cpu_kv_store(void *vbe, uint32_t layer, const float *k, const float *v,
                        const tdm_fwd_rows_t *rows)
{
    cpu_be_t *be = vbe;
    uint32_t H = be->kl.n_kv_heads, D = be->kl.head_dim;
    /* rows in order: q8 requantization depends on slot order within a record */
    for (uint32_t t = 0; t < rows->n; t++) {
        const tdm_batch_seq_t *sq = &rows->seqs[rows->seq[t]];
        uint32_t slot = rows->pos[t] % be->kl.block_size;
        for (uint32_t h = 0; h < H; h++) {
            size_t off = ((size_t)t * H + h) * D;
            kv_put(be, kv_record(be, sq, rows->pos[t], layer, 0, h), slot, k + off);
            kv_put(be, kv_record(be, sq, rows->pos[t], layer, 1, h), slot, v + off);
        }
    }
    return TDM_OK;
}

/* Converts slot `slot` of a K or V record to f32 in dst (f32 and q8 caches). */
static void kv_get(const cpu_be_t *be, const uint8_t *rec, uint32_t slot, float *dst)
{
    uint32_t D = be->kl.head_dim;
    if (be->kl.dtype == TDM_KV_F32) {
        memcpy(dst, (const float *)rec + (size_t)slot * D, D * sizeof(float));
    } else if (be->kl.dtype == TDM_KV_F16) {
        const uint16_t *s = (const uint16_t *)rec + (size_t)slot * D;
        for (uint32_t i = 0; i < D; i++)
            dst[i] = tdm_fp16_to_fp32(s[i]);
    } else {
        float scale;
        memcpy(&scale, rec, sizeof scale);
        const int8_t *qv = (const int8_t *)(rec + sizeof(float)) + (size_t)slot * D;
        for (uint32_t i = 0; i < D; i++)
            dst[i] = (float)qv[i] * scale;
    }
}

/* Causal scaled dot-product attention (Vaswani et al. 2017) with GQA: query head h reads KV
 * head h / (n_heads / n_kv_heads). Scores over positions 0..pos in order, softmax with the
 * max subtracted, then the weighted sum of V rows in order. */
static int cpu_attention(void *vbe, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                         float *out)
{
    cpu_be_t *be = vbe;
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t H = hp->n_heads, D = hp->head_dim, group = hp->n_heads / hp->n_kv_heads;
    uint32_t bs = be->kl.block_size;
    float scale = 1.0f / sqrtf((float)D);
    bool f16_fast = be->avx2 && be->kl.dtype == TDM_KV_F16;
    int64_t n_items = (int64_t)rows->n * H;
#pragma omp parallel for schedule(dynamic, 4) num_threads(be->n_threads)
    for (int64_t it = 0; it < n_items; it++) {
        uint32_t t = (uint32_t)(it / H), h = (uint32_t)(it % H), g = h / group;
        int tid = omp_get_thread_num();
        float *sc = be->scores + (size_t)tid * be->n_ctx;
        float *tmp = be->kvrow + (size_t)tid * 2 * D;
        const float *qh = q + ((size_t)t * H + h) * D;
        float *o = out + ((size_t)t * H + h) * D;
        const tdm_batch_seq_t *sq = &rows->seqs[rows->seq[t]];
        uint32_t n_pos = rows->pos[t] + 1;
        /* With an f16 cache the query and the probabilities are rounded to f16 too, as
         * llama.cpp's f16 mat-muls of KQ and KQV do, so the two engines round alike. */
        bool f16 = be->kl.dtype == TDM_KV_F16;
        float *qr = tmp + D;
        if (f16) {
            for (uint32_t i = 0; i < D; i++)
                qr[i] = round_fp16(qh[i]);
            qh = qr;
        }
        float mx = -INFINITY;
        for (uint32_t j = 0; j < n_pos; j++) {
            const uint8_t *rec = kv_record(be, sq, j, layer, 0, g);
            float s;
#ifdef TDM_X86
            if (f16_fast)
                s = dot_f32_f16_avx2(qh, (const uint16_t *)rec + (size_t)(j % bs) * D, D);
            else
#endif
            {
                kv_get(be, rec, j % bs, tmp);
                s = dot_f32(be, qh, tmp, D);
            }
            s *= scale;
            sc[j] = s;
            mx = fmaxf(mx, s);
        }
        /* softmax with the sum in double, then normalised probabilities (ggml_soft_max) */
        double sum = 0.0;
        for (uint32_t j = 0; j < n_pos; j++) {
            sc[j] = expf(sc[j] - mx);
            sum += (double)sc[j];
        }
        float inv = (float)(1.0 / sum);
        memset(o, 0, D * sizeof(float));
        for (uint32_t j = 0; j < n_pos; j++) {
            const uint8_t *rec = kv_record(be, sq, j, layer, 1, g);
            float pj = f16 ? round_fp16(sc[j] * inv) : sc[j] * inv;
#ifdef TDM_X86
            if (f16_fast) {
                axpy_f16_avx2(o, pj, (const uint16_t *)rec + (size_t)(j % bs) * D, D);
                continue;
            }
#endif
            kv_get(be, rec, j % bs, tmp);
#ifdef TDM_X86
            if (be->avx2) {
                axpy_f32_avx2(o, pj, tmp, D);
                continue;
            }
#endif
            for (uint32_t i = 0; i < D; i++)
                o[i] += pj * tmp[i];
        }
    }
    return TDM_OK;
}

static int cpu_swiglu(void *vbe, const float *gate, const float *up, size_t count, float *out)
{
    cpu_be_t *be = vbe;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (count > 65536)
    for (size_t i = 0; i < count; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
    return TDM_OK;
}

static int cpu_add(void *vbe, float *x, const float *y, size_t count)
{
    (void)vbe;
    for (size_t i = 0; i < count; i++)
        x[i] += y[i];
    return TDM_OK;
}

static int cpu_gather_rows(void *vbe, const float *src, const uint32_t *rows, uint32_t n,
                           uint32_t dim, float *dst)
{
    (void)vbe;
    for (uint32_t k = 0; k < n; k++)
        memcpy(dst + (size_t)k * dim, src + (size_t)rows[k] * dim, dim * sizeof(float));
    return TDM_OK;
}

static int cpu_read(void *vbe, const float *src, size_t count, float *host_dst)
{
    (void)vbe;
    memcpy(host_dst, src, count * sizeof(float));
    return TDM_OK;
}

const tdm_backend_ops_t tdm_model_backend_cpu = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .kernel_name = cpu_kernel_name,
    .alloc = cpu_alloc,
    .embed = cpu_embed,
    .rmsnorm = cpu_rmsnorm,
    .matmul = cpu_matmul,
    .add_bias = cpu_add_bias,
    .rope = cpu_rope,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .swiglu = cpu_swiglu,
    .add = cpu_add,
    .gather_rows = cpu_gather_rows,
    .read = cpu_read,
};
