/* cpu_avx2.c - the CPU backend's AVX2 + FMA + F16C kernels (x86-64; chosen at run time). */
#include "model/cpu_kernels.h"

#include <math.h>

#if defined(__x86_64__) || defined(__i386__)
#include "model/cpu_x86.inc"

/* The exact integer block dots of cpu_gemm.inc, one 4-value chunk (8 rows x 4 bytes) at a time.
 * Q4: vpmaddubsw of the nibbles u (0..15) against the activation bytes q, summed in int16: each
 * lane is at most 2 * 15 * 127 and eight of them at most 30480, so every partial int16 sum is
 * exact, in any order; q4_fin widens the 16 lanes pairwise (vpmaddwd) to one int32 per row. */
TDM_AVX2 static inline __m256i q4_step_avx2(__m256i s, __m256i u, __m256i q)
{
    return _mm256_add_epi16(s, _mm256_maddubs_epi16(u, q));
}

TDM_AVX2 static inline __m256i q4_fin_avx2(__m256i s)
{
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
}

/* Q8: |w| times q carrying w's sign (each vpmaddubsw lane at most 2 * 128 * 127: no
 * saturation), widened to int32 every chunk. */
TDM_AVX2 static inline __m256i q8_step_avx2(__m256i s, __m256i w, __m256i wabs, __m256i q)
{
    __m256i p16 = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(q, w));
    return _mm256_add_epi32(s, _mm256_madd_epi16(p16, _mm256_set1_epi16(1)));
}

#define TDM_KTARGET TDM_AVX2
#define TDM_KNAME(x) x##_avx2
#include "model/cpu_gemm.inc"
#undef TDM_KTARGET
#undef TDM_KNAME

TDM_AVX2 static float dot_f32_avx2(const float *x, const float *y, size_t n)
{
    __m256 acc = _mm256_setzero_ps();
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i), acc);
    float s = hsum_ps(acc);
    for (; i < n; i++)
        s = fmaf(x[i], y[i], s);
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
        float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
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
        int isum = _mm_cvtsi128_si32(s4);
        __m128i s2 = _mm_add_epi32(_mm256_castsi256_si128(qi[0]), _mm256_castsi256_si128(qi[1]));
        s2 = _mm_add_epi32(s2, _mm256_extracti128_si256(qi[0], 1));
        s2 = _mm_add_epi32(s2, _mm256_extracti128_si256(qi[1], 1));
        s2 = _mm_hadd_epi32(s2, s2);
        s2 = _mm_hadd_epi32(s2, s2);
        out[b].isum_lo = _mm_cvtsi128_si32(s2); /* values 0..15: qi[0] and qi[1] */
        out[b].d = tdm_cpu_round_fp16(d);
        out[b].s = tdm_cpu_round_fp16(d * (float)isum);
        out[b].isum = isum;
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
        s = fmaf(q[i], _cvtsh_ss(k[i]), s);
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
        out[i] = fmaf(p, _cvtsh_ss(v[i]), out[i]);
}

TDM_AVX2 static void axpy_f32_avx2(float *out, float p, const float *v, size_t n)
{
    __m256 vp = _mm256_set1_ps(p);
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i,
                         _mm256_fmadd_ps(vp, _mm256_loadu_ps(v + i), _mm256_loadu_ps(out + i)));
    for (; i < n; i++)
        out[i] = fmaf(p, v[i], out[i]);
}

/* q . k with k a q8 cache row, each value dequantized as (float)k * scale, in dot_f32's order */
TDM_AVX2 static float dot_q8_avx2(const float *q, const int8_t *k, float scale, size_t n)
{
    __m256 acc = _mm256_setzero_ps(), vs = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i k32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(k + i)));
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_mul_ps(_mm256_cvtepi32_ps(k32), vs),
                              acc);
    }
    float s = hsum_ps(acc);
    for (; i < n; i++)
        s = fmaf(q[i], (float)k[i] * scale, s);
    return s;
}

/* out += p * v (v a q8 cache row dequantized as (float)v * scale), axpy_f32's bits */
TDM_AVX2 static void axpy_q8_avx2(float *out, float p, const int8_t *v, float scale, size_t n)
{
    __m256 vp = _mm256_set1_ps(p), vs = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256i v32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(v + i)));
        __m256 vf = _mm256_mul_ps(_mm256_cvtepi32_ps(v32), vs);
        _mm256_storeu_ps(out + i, _mm256_fmadd_ps(vp, vf, _mm256_loadu_ps(out + i)));
    }
    for (; i < n; i++)
        out[i] = fmaf(p, (float)v[i] * scale, out[i]);
}

/* The grouped tiles below read K / V rows of either cache: f16 (q8 false) or int8 with the
 * record's scale (q8 true). Every caller passes q8 as a constant, so each tile compiles to one
 * kernel per row type. */

/* Row element idx of a K or V block: its address */
TDM_AVX2 static inline __attribute__((always_inline)) const void *row_at(const void *r, size_t idx,
                                                                         const bool q8)
{
    return (const char *)r + idx * (q8 ? 1 : 2);
}

/* 8 values of a K or V row as f32: f16 converted (exact), or int8 dequantized as the reference
 * does, (float)q * scale (vs: the scale in every lane) */
TDM_AVX2 static inline __attribute__((always_inline)) __m256 row8_avx2(const void *r, const bool q8,
                                                                       __m256 vs)
{
    if (q8)
        return _mm256_mul_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)r))), vs);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)r));
}

/* Scores of nh (1..4) query heads against np (1..2) K rows, d a multiple of 8: one fma chain
 * per pair over the 8-value chunks in order, then hsum_ps, exactly as dot_f32_f16_avx2
 * (dot_q8_avx2). */
TDM_AVX2 static inline __attribute__((always_inline)) void
scores_tile_avx2(const float *q, const int nh, const void *k, const bool q8, __m256 vs,
                 const int np, size_t d, float *sc, size_t ldsc)
{
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 2
        for (int j = 0; j < np; j++)
            acc[h][j] = _mm256_setzero_ps();
    for (size_t i = 0; i < d; i += 8) {
        __m256 kv[2];
#pragma GCC unroll 2
        for (int j = 0; j < np; j++)
            kv[j] = row8_avx2(row_at(k, (size_t)j * d + i, q8), q8, vs);
#pragma GCC unroll 4
        for (int h = 0; h < nh; h++) {
            __m256 qv = _mm256_loadu_ps(q + (size_t)h * d + i);
#pragma GCC unroll 2
            for (int j = 0; j < np; j++)
                acc[h][j] = _mm256_fmadd_ps(qv, kv[j], acc[h][j]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 2
        for (int j = 0; j < np; j++)
            sc[(size_t)h * ldsc + j] = hsum_ps(acc[h][j]);
}

/* The scores of 4 keys from their lane accumulators a[0..3] (a[k] lane l: key k's fma chain l),
 * the keys across the lanes: each key's ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)),
 * every add with hsum_ps' operands in hsum_ps' order, so each score is bit for bit hsum_ps of
 * its accumulator; 9 shuffles and 5 adds for the 4 keys instead of 12 and 12. */
TDM_AVX2 static inline __m128 fold4_avx2(const __m256 *a)
{
    /* per 128-bit lane i of m01 key i's (l0 + l4, l1 + l5, l2 + l6, l3 + l7); of m23 key 2 + i's */
    __m256 m01 = _mm256_add_ps(_mm256_permute2f128_ps(a[0], a[1], 0x20),
                               _mm256_permute2f128_ps(a[0], a[1], 0x31));
    __m256 m23 = _mm256_add_ps(_mm256_permute2f128_ps(a[2], a[3], 0x20),
                               _mm256_permute2f128_ps(a[2], a[3], 0x31));
    __m256d e01 = _mm256_castps_pd(m01), e23 = _mm256_castps_pd(m23);
    /* lane i: key i's (n0, n1), key 2 + i's (n0, n1); n0 = m0 + m2, n1 = m1 + m3 */
    __m256 n = _mm256_add_ps(_mm256_castpd_ps(_mm256_unpacklo_pd(e01, e23)),
                             _mm256_castpd_ps(_mm256_unpackhi_pd(e01, e23)));
    /* lane i: s_i, s_(2 + i) (twice) */
    __m256 s = _mm256_add_ps(_mm256_shuffle_ps(n, n, 0x88), _mm256_shuffle_ps(n, n, 0xDD));
    return _mm256_castps256_ps128(
        _mm256_permutevar8x32_ps(s, _mm256_setr_epi32(0, 4, 1, 5, 0, 4, 1, 5)));
}

/* Scores of nh (1..3) query heads against 4 K rows, d a multiple of 8: per pair the fma chain
 * over the 8-value chunks in order that dot_f32_f16_avx2 (dot_q8_avx2) forms (q read from
 * memory into each fma: 12 accumulators and one K chunk in the 16 registers), then fold4_avx2. */
TDM_AVX2 static inline __attribute__((always_inline)) void
scores_tile4_avx2(const float *q, const int nh, const void *k, const bool q8, __m256 vs, size_t d,
                  float *sc, size_t ldsc)
{
    __m256 acc[3][4];
#pragma GCC unroll 3
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++)
            acc[h][j] = _mm256_setzero_ps();
    for (size_t i = 0; i < d; i += 8) {
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256 kv = row8_avx2(row_at(k, (size_t)j * d + i, q8), q8, vs);
#pragma GCC unroll 3
            for (int h = 0; h < nh; h++)
                acc[h][j] = _mm256_fmadd_ps(_mm256_loadu_ps(q + (size_t)h * d + i), kv, acc[h][j]);
        }
    }
#pragma GCC unroll 3
    for (int h = 0; h < nh; h++)
        _mm_storeu_ps(sc + (size_t)h * ldsc, fold4_avx2(acc[h]));
}

#define SCORES_TILE(NP)                                                                            \
    switch (th) {                                                                                  \
    case 1: scores_tile_avx2(qh, 1, kj, q8, vs, NP, d, sh + j, ldsc); break;                       \
    case 2: scores_tile_avx2(qh, 2, kj, q8, vs, NP, d, sh + j, ldsc); break;                       \
    default: scores_tile_avx2(qh, 3, kj, q8, vs, NP, d, sh + j, ldsc); break;                      \
    }

/* scores_f16 / scores_q8 (cpu_kernels.h) for d a multiple of 8: heads in tiles of 3, K rows 4
 * at a time (keys across the lanes in the final fold), then a pair, then an odd last row */
TDM_AVX2 static inline __attribute__((always_inline)) void
scores_rows_avx2(const float *q, uint32_t nh, const void *k, const bool q8, float scale,
                 uint32_t nk, size_t d, float *sc, size_t ldsc)
{
    __m256 vs = _mm256_set1_ps(scale);
    for (uint32_t h0 = 0; h0 < nh; h0 += 3) {
        uint32_t th = nh - h0 < 3 ? nh - h0 : 3, j = 0;
        const float *qh = q + (size_t)h0 * d;
        float *sh = sc + (size_t)h0 * ldsc;
        for (; j + 4 <= nk; j += 4) {
            const void *kj = row_at(k, (size_t)j * d, q8);
            switch (th) {
            case 1: scores_tile4_avx2(qh, 1, kj, q8, vs, d, sh + j, ldsc); break;
            case 2: scores_tile4_avx2(qh, 2, kj, q8, vs, d, sh + j, ldsc); break;
            default: scores_tile4_avx2(qh, 3, kj, q8, vs, d, sh + j, ldsc); break;
            }
        }
        if (j + 2 <= nk) {
            const void *kj = row_at(k, (size_t)j * d, q8);
            SCORES_TILE(2)
            j += 2;
        }
        if (j < nk) {
            const void *kj = row_at(k, (size_t)j * d, q8);
            SCORES_TILE(1)
        }
    }
}
#undef SCORES_TILE

/* tdm_cpu_isa_t.scores_f16 */
TDM_AVX2 static void scores_f16_avx2(const float *q, uint32_t nh, const uint16_t *k, uint32_t nk,
                                     size_t d, float *sc, size_t ldsc)
{
    if (d % 8) {
        for (uint32_t h = 0; h < nh; h++)
            for (uint32_t j = 0; j < nk; j++)
                sc[(size_t)h * ldsc + j] =
                    dot_f32_f16_avx2(q + (size_t)h * d, k + (size_t)j * d, d);
        return;
    }
    scores_rows_avx2(q, nh, k, false, 1.0f, nk, d, sc, ldsc);
}

/* tdm_cpu_isa_t.scores_q8 */
TDM_AVX2 static void scores_q8_avx2(const float *q, uint32_t nh, const int8_t *k, float scale,
                                    uint32_t nk, size_t d, float *sc, size_t ldsc)
{
    if (d % 8) {
        for (uint32_t h = 0; h < nh; h++)
            for (uint32_t j = 0; j < nk; j++)
                sc[(size_t)h * ldsc + j] =
                    dot_q8_avx2(q + (size_t)h * d, k + (size_t)j * d, scale, d);
        return;
    }
    scores_rows_avx2(q, nh, k, true, scale, nk, d, sc, ldsc);
}

/* Columns c .. c + 8 nc - 1 (nc 1..2) of nh (1..4) heads' outputs: acc = fma(p, v, acc) over
 * the V rows in order, exactly as axpy_f16_avx2 (axpy_q8_avx2) called row after row. */
TDM_AVX2 static inline __attribute__((always_inline)) void
pv_tile_avx2(float *o, const int nh, const float *p, size_t ldp, const void *v, const bool q8,
             __m256 vs, uint32_t nv, size_t d, const int nc)
{
    __m256 acc[4][2];
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++)
            acc[h][c] = _mm256_loadu_ps(o + (size_t)h * d + 8 * c);
    for (uint32_t j = 0; j < nv; j++) {
        __m256 vv[2];
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++)
            vv[c] = row8_avx2(row_at(v, (size_t)j * d + 8 * c, q8), q8, vs);
#pragma GCC unroll 4
        for (int h = 0; h < nh; h++) {
            __m256 pb = _mm256_broadcast_ss(p + (size_t)h * ldp + j);
#pragma GCC unroll 2
            for (int c = 0; c < nc; c++)
                acc[h][c] = _mm256_fmadd_ps(pb, vv[c], acc[h][c]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 2
        for (int c = 0; c < nc; c++)
            _mm256_storeu_ps(o + (size_t)h * d + 8 * c, acc[h][c]);
}

#define PV_TILE(NC)                                                                                \
    switch (th) {                                                                                  \
    case 1: pv_tile_avx2(oh + c, 1, ph, ldp, row_at(v, c, q8), q8, vs, nv, d, NC); break;          \
    case 2: pv_tile_avx2(oh + c, 2, ph, ldp, row_at(v, c, q8), q8, vs, nv, d, NC); break;          \
    case 3: pv_tile_avx2(oh + c, 3, ph, ldp, row_at(v, c, q8), q8, vs, nv, d, NC); break;          \
    default: pv_tile_avx2(oh + c, 4, ph, ldp, row_at(v, c, q8), q8, vs, nv, d, NC); break;         \
    }

/* pv_f16 / pv_q8 (cpu_kernels.h) for d a multiple of 8: heads in tiles of 4, 16 columns at a
 * time held in registers over all the rows */
TDM_AVX2 static inline __attribute__((always_inline)) void
pv_rows_avx2(float *o, uint32_t nh, const float *p, size_t ldp, const void *v, const bool q8,
             float scale, uint32_t nv, size_t d)
{
    __m256 vs = _mm256_set1_ps(scale);
    for (uint32_t h0 = 0; h0 < nh; h0 += 4) {
        uint32_t th = nh - h0 < 4 ? nh - h0 : 4;
        float *oh = o + (size_t)h0 * d;
        const float *ph = p + (size_t)h0 * ldp;
        size_t c = 0;
        for (; c + 16 <= d; c += 16)
            PV_TILE(2)
        if (c < d)
            PV_TILE(1)
    }
}
#undef PV_TILE

/* tdm_cpu_isa_t.pv_f16 */
TDM_AVX2 static void pv_f16_avx2(float *o, uint32_t nh, const float *p, size_t ldp,
                                 const uint16_t *v, uint32_t nv, size_t d)
{
    if (d % 8) {
        for (uint32_t h = 0; h < nh; h++)
            for (uint32_t j = 0; j < nv; j++)
                axpy_f16_avx2(o + (size_t)h * d, p[(size_t)h * ldp + j], v + (size_t)j * d, d);
        return;
    }
    pv_rows_avx2(o, nh, p, ldp, v, false, 1.0f, nv, d);
}

/* tdm_cpu_isa_t.pv_q8 */
TDM_AVX2 static void pv_q8_avx2(float *o, uint32_t nh, const float *p, size_t ldp, const int8_t *v,
                                float scale, uint32_t nv, size_t d)
{
    if (d % 8) {
        for (uint32_t h = 0; h < nh; h++)
            for (uint32_t j = 0; j < nv; j++)
                axpy_q8_avx2(o + (size_t)h * d, p[(size_t)h * ldp + j], v + (size_t)j * d, scale,
                             d);
        return;
    }
    pv_rows_avx2(o, nh, p, ldp, v, true, scale, nv, d);
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

/* F16C rounds to nearest even, as tdm_fp32_to_fp16 does */
TDM_AVX2 static void round_f16_avx2(float *dst, const float *src, float scale, size_t n)
{
    __m256 vs = _mm256_set1_ps(scale);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m128i h =
            _mm256_cvtps_ph(_mm256_mul_ps(_mm256_loadu_ps(src + i), vs), _MM_FROUND_TO_NEAREST_INT);
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
    for (; i < n; i++)
        dst[i] = tdm_cpu_round_fp16(src[i] * scale);
}

/* tdm_cpu_expf on 8 lanes, the same operations in the same order */
TDM_AVX2 static inline __m256 expf_avx2(__m256 x)
{
    const __m256 lo = _mm256_set1_ps(TDM_EXP_LO), hi = _mm256_set1_ps(TDM_EXP_HI);
    const __m256 shift = _mm256_set1_ps(TDM_EXP_SHIFT);
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    __m256 n = _mm256_sub_ps(_mm256_fmadd_ps(xc, _mm256_set1_ps(TDM_EXP_LOG2E), shift), shift);
    __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-TDM_EXP_C1), xc);
    r = _mm256_fmadd_ps(n, _mm256_set1_ps(-TDM_EXP_C2), r);
    __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(TDM_EXP_P0), r, _mm256_set1_ps(TDM_EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TDM_EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TDM_EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TDM_EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TDM_EXP_P5));
    __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
    __m256 v = _mm256_mul_ps(y, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
    v = _mm256_blendv_ps(v, _mm256_setzero_ps(), _mm256_cmp_ps(x, lo, _CMP_LT_OQ));
    v = _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(x, hi, _CMP_GT_OQ));
    return _mm256_blendv_ps(v, x, _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

TDM_AVX2 static float scale_max_avx2(float *x, size_t n, float scale)
{
    __m256 vs = _mm256_set1_ps(scale), vm = _mm256_set1_ps(-__builtin_inff());
    size_t j = 0;
    for (; j + 8 <= n; j += 8) {
        __m256 v = _mm256_mul_ps(_mm256_loadu_ps(x + j), vs);
        _mm256_storeu_ps(x + j, v);
        vm = _mm256_max_ps(v, vm); /* a NaN v keeps vm, as the scalar compare does */
    }
    float lane[8], mx = -__builtin_inff();
    _mm256_storeu_ps(lane, vm);
    for (int l = 0; l < 8; l++)
        mx = lane[l] > mx ? lane[l] : mx;
    for (; j < n; j++) {
        x[j] *= scale;
        mx = x[j] > mx ? x[j] : mx;
    }
    if (mx == 0.0f) /* the scalar loop keeps the first zero it meets: its sign, in index order */
        for (j = 0; j < n; j++)
            if (x[j] == 0.0f)
                return x[j];
    return mx;
}

/* lanes 0-3, 4-7 of the first 8 elements and 8-11, 12-15 of the next 8 in four registers */
TDM_AVX2 static double exp_sum_avx2(float *x, size_t n, float mx)
{
    __m256 vm = _mm256_set1_ps(mx);
    __m256d a0 = _mm256_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t j = 0;
    for (; j + TDM_EXP_LANES <= n; j += TDM_EXP_LANES) {
        __m256 e0 = expf_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j), vm));
        __m256 e1 = expf_avx2(_mm256_sub_ps(_mm256_loadu_ps(x + j + 8), vm));
        _mm256_storeu_ps(x + j, e0);
        _mm256_storeu_ps(x + j + 8, e1);
        a0 = _mm256_add_pd(a0, _mm256_cvtps_pd(_mm256_castps256_ps128(e0)));
        a1 = _mm256_add_pd(a1, _mm256_cvtps_pd(_mm256_extractf128_ps(e0, 1)));
        a2 = _mm256_add_pd(a2, _mm256_cvtps_pd(_mm256_castps256_ps128(e1)));
        a3 = _mm256_add_pd(a3, _mm256_cvtps_pd(_mm256_extractf128_ps(e1, 1)));
    }
    double lane[TDM_EXP_LANES];
    _mm256_storeu_pd(lane, a0);
    _mm256_storeu_pd(lane + 4, a1);
    _mm256_storeu_pd(lane + 8, a2);
    _mm256_storeu_pd(lane + 12, a3);
    for (; j < n; j++) {
        x[j] = tdm_cpu_expf(x[j] - mx);
        lane[j % TDM_EXP_LANES] += (double)x[j];
    }
    return tdm_cpu_fold_lanes(lane);
}

TDM_AVX2 static void swiglu_avx2(float *out, const float *gate, const float *up, size_t n)
{
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 g = _mm256_loadu_ps(gate + i);
        __m256 e = expf_avx2(_mm256_xor_ps(g, sign));
        __m256 s = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
    }
    for (; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + tdm_cpu_expf(-g)) * up[i];
    }
}

static bool cpu_has_avx2(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
           __builtin_cpu_supports("f16c");
}

static const tdm_cpu_isa_t isa_avx2 = {
    .name = "avx2",
    .quantize_act = quantize_act_avx2,
    .dot_f32 = dot_f32_avx2,
    .dot_f32_f16 = dot_f32_f16_avx2,
    .axpy_f16 = axpy_f16_avx2,
    .axpy_f32 = axpy_f32_avx2,
    .scores_f16 = scores_f16_avx2,
    .pv_f16 = pv_f16_avx2,
    .scores_q8 = scores_q8_avx2,
    .pv_q8 = pv_q8_avx2,
    .store_f16 = store_f16_avx2,
    .round_f16 = round_f16_avx2,
    .scale_max = scale_max_avx2,
    .exp_sum = exp_sum_avx2,
    .swiglu = swiglu_avx2,
    .packed = true,
    .gemm = {gemm_q4_0_avx2, gemm_q4_1_avx2, gemm_q8_0_avx2, gemm_q4_k_avx2, gemm_q5_k_avx2,
             gemm_q6_k_avx2, gemm_q2_k_avx2, gemm_q6_k_avx2 /* Q3_K: packed as Q6_K */},
};

const tdm_cpu_isa_t *tdm_cpu_isa_avx2(void)
{
    return cpu_has_avx2() ? &isa_avx2 : NULL;
}
#else
const tdm_cpu_isa_t *tdm_cpu_isa_avx2(void)
{
    return NULL;
}
#endif
