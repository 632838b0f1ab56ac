/* cpu_avx512.c - the CPU backend's AVX-512 VNNI kernels (x86-64; chosen at run time): the
 * row-at-a-time dots for Q4_0, Q4_1 and Q8_0, the packed GEMM for every q8a weight type (below)
 * and grouped-query attention over f16 rows.
 *
 * Two 32-value blocks fill one 512-bit register, so one vpdpbusd does 64 multiply-adds. Every
 * weight type is brought to one form per block: unsigned bytes u, scale dw and offset mw with
 * w = dw * u + mw (Q4_1: u = nibble, mw = m; Q4_0: mw = -8 dw; Q8_0: u = q + 128,
 * mw = -128 dw). With activations a = da * qa (qa int8, s = da * sum(qa)) a block contributes
 * dw * da * sum(u * qa) + mw * s: an exact integer dot product, then float work. A weight row
 * is prepared once per tile of tokens (u bytes, dw broadcast per block half, mw as floats) and
 * then serves up to 8 tokens per pass; each token's result comes from the same operations
 * whatever the number of tokens, so batching changes no bit of any result. */
#include "model/cpu_kernels.h"

#include <pthread.h>

/* Layout of one token's activations (AVX-512): q[npairs * 64] int8 (zero padded), then
 * dexp[npairs * 16] floats (block b's da repeated 8 times), then s[nb] floats. */

size_t tdm_cpu_zact_stride(size_t nb)
{
    size_t npairs = (nb + 1) / 2;
    return npairs * 64 + npairs * 64 + (nb + 15) / 16 * 64;
}

/* Layout of one prepared weight row: u[npairs * 64] bytes, dw[npairs * 16] floats, then
 * mw[nb] floats. */
size_t tdm_cpu_zprep_stride(size_t nb)
{
    return tdm_cpu_zact_stride(nb);
}

#if defined(__x86_64__) || defined(__i386__)
#include "model/cpu_x86.inc"

#define TDM_AVX512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))

bool tdm_cpu_has_avx512vnni(void)
{
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

/* Rewrites one token's q8a blocks into the AVX-512 layout. */
TDM_AVX512 void tdm_cpu_zact_fill(const q8a_block_t *a, size_t nb, uint8_t *dst)
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
TDM_AVX512 void tdm_cpu_zrow_prep(tdm_ggml_type_t type, const uint8_t *wr, size_t nb, uint8_t *dst)
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
TDM_AVX512 float tdm_cpu_zdot_fused1(tdm_ggml_type_t type, const uint8_t *wr, size_t nb,
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
TDM_AVX512 void tdm_cpu_zdot(const uint8_t *prep, size_t nb, const uint8_t *const *tok, float *y,
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
bool tdm_cpu_has_avx512vnni(void)
{
    return false;
}
#endif

/* ---- the packed GEMM on 512-bit registers (cpu_kernels.h's layout and reduction) ----
 *
 * Groups go two at a time through the 16-row layout below (zwide_*: every weight type); a
 * group left alone (an odd count in a thread's range, or the last group) takes the pair layout:
 * a register holds the 8 rows of a group for two tokens (low half token t, high half t + 1):
 * the packed chunks are broadcast to both halves, each half gets its own token's activation
 * bytes, scales and sums. vpdpbusd needs unsigned weights: Q4 nibbles are; Q8_0 is taken as
 * w + 128 and 128 * sum(a) subtracted, the same integer as sum(w * a). Every lane then does the
 * canonical float operations, so the results are the scalar reference's bits. */
#if defined(__x86_64__) || defined(__i386__)
#define TDM_ZNT 4 /* token pairs per micro-tile */

/* a for the low half, b for the high half */
TDM_AVX512 static inline __m512i zpair_epi32(int32_t a, int32_t b)
{
    return _mm512_mask_set1_epi32(_mm512_set1_epi32(a), (__mmask16)0xFF00, b);
}

TDM_AVX512 static inline __m512 zpair_ps(float a, float b)
{
    return _mm512_mask_mov_ps(_mm512_set1_ps(a), (__mmask16)0xFF00, _mm512_set1_ps(b));
}

TDM_AVX512 static inline int32_t zq4(const int8_t *q)
{
    int32_t v;
    memcpy(&v, q, 4);
    return v;
}

/* 8 f16 values as f32, in both halves */
TDM_AVX512 static inline __m512 zdup_ph(const uint8_t *p)
{
    __m256 v = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)));
}

/* 32 bytes in both halves */
TDM_AVX512 static inline __m512i zdup_si256(const uint8_t *p)
{
    return _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)p));
}

/* 8 f32 values in both halves */
TDM_AVX512 static inline __m512 zdup_ps(const uint8_t *p)
{
    __m256 v = _mm256_loadu_ps((const float *)(const void *)p);
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(v)));
}

/* The block's scales (d8, and m8: the min for Q4_1 / Q4_K, the second half's scale for Q6_K)
 * and its unsigned weight bytes u (Q6_K: |w|, with neg the lanes where w < 0). */
TDM_AVX512 static inline __attribute__((always_inline)) void
zgemm_unpack(const uint8_t *p, const int kind, __m512 *d8, __m512 *m8, __m512i *u, __mmask64 *neg)
{
    const size_t qoff = kind == 6 ? 128 : kind >= 3 ? 64 : kind == 1 ? 32 : 16;
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    *d8 = kind >= 3 ? zdup_ps(p) : zdup_ph(p);
    *m8 = kind >= 3 ? zdup_ps(p + 32) : kind == 1 ? zdup_ph(p + 16) : _mm512_setzero_ps();
    if (kind == 2 || kind >= 4) {
#pragma GCC unroll 8
        for (int k = 0; k < 8; k++) {
            __m512i w = zdup_si256(p + qoff + 32 * (size_t)k);
            if (kind == 2) {
                u[k] = _mm512_xor_si512(w, flip);
            } else if (kind == 6) {
                u[k] = w; /* Q2_K's values 0..3 are unsigned already */
            } else {
                u[k] = _mm512_abs_epi8(w);
                neg[k] = _mm512_movepi8_mask(w);
            }
        }
        return;
    }
#pragma GCC unroll 4
    for (int k = 0; k < 4; k++) {
        __m512i raw = zdup_si256(p + qoff + 32 * (size_t)k);
        u[k] = _mm512_and_si512(raw, low);
        u[k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
    }
}

/* Chunks k0 .. k0 + nk - 1 of one token pair's integer dot (Q6_K, Q5_K: activations negated where
 * the weight is negative, so |w| * (-a) = w * a; a is never -128). */
TDM_AVX512 static inline __attribute__((always_inline)) __m512i
zgemm_isum(const __m512i *u, const __mmask64 *neg, const bool q6k, const q8a_block_t *x0,
           const q8a_block_t *x1, const int k0, const int nk)
{
    __m512i isum = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int k = k0; k < k0 + nk; k++) {
        __m512i a = zpair_epi32(zq4(x0->q + 4 * k), zq4(x1->q + 4 * k));
        if (q6k)
            a = _mm512_mask_sub_epi8(a, neg[k], _mm512_setzero_si512(), a);
        isum = _mm512_dpbusd_epi32(isum, u[k], a);
    }
    return isum;
}

/* kind 0 Q4_0, 1 Q4_1, 2 Q8_0, 3 Q4_K, 4 Q6_K (and Q3_K), 5 Q5_K, 6 Q2_K (Q6_K's two half
 * scales on unsigned values, then the two half mins): one group's nb packed blocks against np
 * token pairs (a0[j], a1[j] the two tokens' blocks; equal when the pair has one token). */
TDM_AVX512 static inline __attribute__((always_inline)) void
zgemm_tile(const uint8_t *p, size_t nb, const int kind, const q8a_block_t *const *a0,
           const q8a_block_t *const *a1, __m512 *acc, const int np)
{
    static const size_t pbsz[7] = {144, 160, 272, 192, 320, 320, 384};
#pragma GCC unroll 4
    for (int j = 0; j < np; j++)
        acc[j] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++, p += pbsz[kind]) {
        __m512 d8, m8;
        __m512i u[8];
        __mmask64 neg[8];
        zgemm_unpack(p, kind, &d8, &m8, u, neg);
#pragma GCC unroll 4
        for (int j = 0; j < np; j++) {
            const q8a_block_t *x0 = a0[j] + b, *x1 = a1[j] + b;
            __m512 da = zpair_ps(x0->d, x1->d);
            if (kind == 4 || kind == 6) {
                __m512i lo = zgemm_isum(u, neg, kind == 4, x0, x1, 0, 4);
                __m512i hi = zgemm_isum(u, neg, kind == 4, x0, x1, 4, 4);
                acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(d8, da), _mm512_cvtepi32_ps(lo), acc[j]);
                acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(m8, da), _mm512_cvtepi32_ps(hi), acc[j]);
                if (kind == 6) {
                    __m512 slo = zpair_ps(x0->d * (float)x0->isum_lo, x1->d * (float)x1->isum_lo);
                    __m512 shi = zpair_ps(x0->d * (float)(x0->isum - x0->isum_lo),
                                          x1->d * (float)(x1->isum - x1->isum_lo));
                    acc[j] = _mm512_fmadd_ps(zdup_ps(p + 64), slo, acc[j]);
                    acc[j] = _mm512_fmadd_ps(zdup_ps(p + 96), shi, acc[j]);
                }
                continue;
            }
            __m512i isum = zgemm_isum(u, neg, kind == 5, x0, x1, 0, 8);
            if (kind == 0 || kind == 2) {
                int32_t off = kind == 0 ? 8 : 128;
                isum = _mm512_sub_epi32(isum, zpair_epi32(off * x0->isum, off * x1->isum));
            }
            acc[j] = _mm512_fmadd_ps(_mm512_mul_ps(d8, da), _mm512_cvtepi32_ps(isum), acc[j]);
            if (kind == 1 || kind == 3 || kind == 5)
                acc[j] = _mm512_fmadd_ps(m8, zpair_ps(x0->s, x1->s), acc[j]);
        }
    }
}

/* Stores np pairs' accumulators (nt tokens in all) for rows r0 .. r0 + nr - 1. */
TDM_AVX512 static void zgemm_store(const __m512 *acc, uint32_t nt, float *out, size_t ldo,
                                   uint64_t r0, int nr)
{
    for (uint32_t t = 0; t < nt; t++) {
        float y[16];
        _mm512_storeu_ps(y, acc[t / 2]);
        memcpy(out + (size_t)t * ldo + r0, y + 8 * (t % 2), (size_t)nr * sizeof(float));
    }
}

TDM_AVX512 static inline __attribute__((always_inline)) void
zgemm_group(const uint8_t *p, size_t nb, const int kind, const q8a_block_t *act, uint32_t nt,
            float *out, size_t ldo, uint64_t r0, int nr)
{
    for (uint32_t t = 0; t < nt; t += 2 * TDM_ZNT) {
        uint32_t n = nt - t < 2 * TDM_ZNT ? nt - t : 2 * TDM_ZNT;
        const q8a_block_t *a0[TDM_ZNT], *a1[TDM_ZNT];
        for (uint32_t j = 0; j < (n + 1) / 2; j++) {
            a0[j] = act + (size_t)(t + 2 * j) * nb;
            a1[j] = 2 * j + 1 < n ? a0[j] + nb : a0[j];
        }
        __m512 acc[TDM_ZNT];
        switch ((n + 1) / 2) {
        case 1: zgemm_tile(p, nb, kind, a0, a1, acc, 1); break;
        case 2: zgemm_tile(p, nb, kind, a0, a1, acc, 2); break;
        case 3: zgemm_tile(p, nb, kind, a0, a1, acc, 3); break;
        default: zgemm_tile(p, nb, kind, a0, a1, acc, 4); break;
        }
        zgemm_store(acc, n, out + (size_t)t * ldo, ldo, r0, nr);
    }
}

/* ---- Q4_0 / Q4_1 / Q8_0 on 16 rows x 1 token a register (the K-quants after them) ----
 *
 * Two groups' 8 rows side by side (group g in the low half, g + 1 in the high half) against one
 * token a register: a chunk's weights are loaded once per block for all the tile's tokens, and
 * a token's 4 activation bytes are one broadcast load (no shuffle), so the vector ports do the
 * multiply-adds and the scale work only. Each lane's integer sum is the same exact int32 (the
 * chunks summed in two chains, added: integer addition), and its float operations are the
 * reference's, in the same order: the same bits as zgemm_tile. */
#define TDM_ZWT 8 /* tokens per 16-row micro-tile */

/* Blocks of groups pa (low half) and pb (high half) against the n tokens at x[0 .. n - 1]
 * (token t's blocks at x[t]), accumulated from zero into acc[0 .. n - 1]. */
TDM_AVX512 static inline __attribute__((always_inline)) void
zwide_tile(const uint8_t *pa, const uint8_t *pb, size_t nb, const int kind,
           const q8a_block_t *const *x, __m512 *acc, const int n)
{
    const size_t pbsz = kind == 0 ? 144 : kind == 1 ? 160 : 272;
    const size_t qoff = kind == 1 ? 32 : 16;
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
#pragma GCC unroll 8
    for (int t = 0; t < n; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++, pa += pbsz, pb += pbsz) {
        __m512 d16 = _mm512_cvtph_ps(
            _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)pa)),
                                    _mm_loadu_si128((const __m128i *)pb), 1));
        __m512 m16 = _mm512_setzero_ps();
        if (kind == 1)
            m16 = _mm512_cvtph_ps(_mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(pa + 16))),
                _mm_loadu_si128((const __m128i *)(pb + 16)), 1));
        __m512i u[8];
        if (kind == 2) {
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++)
                u[k] = _mm512_xor_si512(
                    _mm512_inserti64x4(
                        _mm512_castsi256_si512(
                            _mm256_loadu_si256((const __m256i *)(pa + qoff + 32 * (size_t)k))),
                        _mm256_loadu_si256((const __m256i *)(pb + qoff + 32 * (size_t)k)), 1),
                    flip);
        } else {
#pragma GCC unroll 4
            for (int k = 0; k < 4; k++) {
                __m512i raw = _mm512_inserti64x4(
                    _mm512_castsi256_si512(
                        _mm256_loadu_si256((const __m256i *)(pa + qoff + 32 * (size_t)k))),
                    _mm256_loadu_si256((const __m256i *)(pb + qoff + 32 * (size_t)k)), 1);
                u[k] = _mm512_and_si512(raw, low);
                u[k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
            }
        }
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) {
            const q8a_block_t *xb = x[t] + b;
            __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 4
            for (int k = 0; k < 8; k += 2) {
                s0 = _mm512_dpbusd_epi32(s0, u[k], _mm512_set1_epi32(zq4(xb->q + 4 * k)));
                s1 = _mm512_dpbusd_epi32(s1, u[k + 1], _mm512_set1_epi32(zq4(xb->q + 4 * k + 4)));
            }
            __m512i isum = _mm512_add_epi32(s0, s1);
            if (kind == 0 || kind == 2)
                isum = _mm512_sub_epi32(isum, _mm512_set1_epi32((kind == 0 ? 8 : 128) * xb->isum));
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d16, _mm512_set1_ps(xb->d)),
                                     _mm512_cvtepi32_ps(isum), acc[t]);
            if (kind == 1)
                acc[t] = _mm512_fmadd_ps(m16, _mm512_set1_ps(xb->s), acc[t]);
        }
    }
}

/* ---- the K-quants on the same 16-row layout ----
 *
 * The packed K-quant blocks (f32 scales at 0 and 32, Q2_K's mins at 64 and 96, then the
 * chunks) of groups g and g + 1 side by side, one token a register as above. Q4_K's nibbles and
 * Q2_K's values 0..3 are unsigned already. Q5_K's and Q6_K's (and Q3_K's) int8 values w are
 * taken as u = w + 128 (one xor per chunk and block, shared by the tile's tokens) and the
 * integer chain starts at -128 * sum(a) over its chunks (Q6_K: isum_lo for the low half,
 * isum - isum_lo for the high half), so it ends on sum(w * a), the same exact int32 as the
 * pair layout's |w| * (+-a): no per-token, per-chunk sign work. (|w| with a masked subtract of
 * the broadcast activation per chunk and token, the pair layout's way, gives the same bits but
 * measured 1.2-1.4x slower on Q6_K / Q5_K / Q3_K at 8 to 512 tokens: its 8 subtracts per token
 * and block take vector-port slots from the 8 vpdpbusd.) The float operations are the canonical
 * reduction's, in its order. */

/* 32 bytes at pa + off in the low half, at pb + off in the high half */
TDM_AVX512 static inline __m512i zwide_si256(const uint8_t *pa, const uint8_t *pb, size_t off)
{
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(pa + off))),
        _mm256_loadu_si256((const __m256i *)(pb + off)), 1);
}

/* One block's scales sc (kind 3 / 5: dw, mw; 4: dlo, dhi; 6: dlo, dhi, mlo, mhi) and weight
 * bytes u of groups pa (low half) and pb (high half). */
TDM_AVX512 static inline __attribute__((always_inline)) void
zwide_kq_unpack(const uint8_t *pa, const uint8_t *pb, const int kind, __m512 *sc, __m512i *u)
{
    const __m512i low = _mm512_set1_epi8(15), flip = _mm512_set1_epi8((char)0x80);
    sc[0] = _mm512_castsi512_ps(zwide_si256(pa, pb, 0));
    sc[1] = _mm512_castsi512_ps(zwide_si256(pa, pb, 32));
    if (kind == 6) {
        sc[2] = _mm512_castsi512_ps(zwide_si256(pa, pb, 64));
        sc[3] = _mm512_castsi512_ps(zwide_si256(pa, pb, 96));
    }
    if (kind == 3) {
#pragma GCC unroll 4
        for (int k = 0; k < 4; k++) {
            __m512i raw = zwide_si256(pa, pb, 64 + 32 * (size_t)k);
            u[k] = _mm512_and_si512(raw, low);
            u[k + 4] = _mm512_and_si512(_mm512_srli_epi16(raw, 4), low);
        }
        return;
    }
#pragma GCC unroll 8
    for (int k = 0; k < 8; k++) {
        __m512i w = zwide_si256(pa, pb, (kind == 6 ? 128 : 64) + 32 * (size_t)k);
        u[k] = kind == 6 ? w : _mm512_xor_si512(w, flip);
    }
}

/* s plus chunks k0 .. k0 + nk - 1 of token xb's activations against u */
TDM_AVX512 static inline __attribute__((always_inline)) __m512i
zwide_kq_dot(__m512i s, const __m512i *u, const q8a_block_t *xb, const int k0, const int nk)
{
#pragma GCC unroll 8
    for (int k = k0; k < k0 + nk; k++)
        s = _mm512_dpbusd_epi32(s, u[k], _mm512_set1_epi32(zq4(xb->q + 4 * k)));
    return s;
}

/* kind 3 Q4_K, 4 Q6_K (and Q3_K), 5 Q5_K, 6 Q2_K: blocks of groups pa (low half) and pb (high
 * half) against the n tokens at x[0 .. n - 1], accumulated from zero into acc[0 .. n - 1]. */
TDM_AVX512 static inline __attribute__((always_inline)) void
zwide_kq_tile(const uint8_t *pa, const uint8_t *pb, size_t nb, const int kind,
              const q8a_block_t *const *x, __m512 *acc, const int n)
{
    const size_t pbsz = kind == 3 ? 192 : kind == 6 ? 384 : 320;
    const bool off = kind == 4 || kind == 5; /* u = w + 128 */
#pragma GCC unroll 8
    for (int t = 0; t < n; t++)
        acc[t] = _mm512_setzero_ps();
    for (size_t b = 0; b < nb; b++, pa += pbsz, pb += pbsz) {
        __m512 sc[4];
        __m512i u[8];
        zwide_kq_unpack(pa, pb, kind, sc, u);
#pragma GCC unroll 8
        for (int t = 0; t < n; t++) {
            const q8a_block_t *xb = x[t] + b;
            __m512 da = _mm512_set1_ps(xb->d);
            if (kind == 3 || kind == 5) {
                __m512i s0 = off ? _mm512_set1_epi32(-128 * xb->isum) : _mm512_setzero_si512();
                __m512i s1 = zwide_kq_dot(_mm512_setzero_si512(), u, xb, 4, 4);
                s0 = zwide_kq_dot(s0, u, xb, 0, 4);
                acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc[0], da),
                                         _mm512_cvtepi32_ps(_mm512_add_epi32(s0, s1)), acc[t]);
                acc[t] = _mm512_fmadd_ps(sc[1], _mm512_set1_ps(xb->s), acc[t]);
                continue;
            }
            __m512i lo = off ? _mm512_set1_epi32(-128 * xb->isum_lo) : _mm512_setzero_si512();
            __m512i hi =
                off ? _mm512_set1_epi32(-128 * (xb->isum - xb->isum_lo)) : _mm512_setzero_si512();
            lo = zwide_kq_dot(lo, u, xb, 0, 4);
            hi = zwide_kq_dot(hi, u, xb, 4, 4);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc[0], da), _mm512_cvtepi32_ps(lo), acc[t]);
            acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(sc[1], da), _mm512_cvtepi32_ps(hi), acc[t]);
            if (kind == 6) {
                acc[t] = _mm512_fmadd_ps(sc[2], _mm512_set1_ps(xb->d * (float)xb->isum_lo), acc[t]);
                acc[t] = _mm512_fmadd_ps(
                    sc[3], _mm512_set1_ps(xb->d * (float)(xb->isum - xb->isum_lo)), acc[t]);
            }
        }
    }
}

/* zwide_tile (kinds 0..2) or zwide_kq_tile (3..6) */
TDM_AVX512 static inline __attribute__((always_inline)) void
zwide_run(const uint8_t *pa, const uint8_t *pb, size_t nb, const int kind,
          const q8a_block_t *const *x, __m512 *acc, const int n)
{
    if (kind >= 3)
        zwide_kq_tile(pa, pb, nb, kind, x, acc, n);
    else
        zwide_tile(pa, pb, nb, kind, x, acc, n);
}

/* Groups g and g + 1 (rows r0 .. r0 + nr - 1, nr 9..16) against nt tokens. */
TDM_AVX512 static inline __attribute__((always_inline)) void
zwide_groups(const uint8_t *pa, const uint8_t *pb, size_t nb, const int kind,
             const q8a_block_t *act, uint32_t nt, float *out, size_t ldo, uint64_t r0, int nr)
{
    const __mmask16 mask = (__mmask16)((1u << nr) - 1);
    for (uint32_t t = 0; t < nt; t += TDM_ZWT) {
        int n = nt - t < TDM_ZWT ? (int)(nt - t) : TDM_ZWT;
        const q8a_block_t *x[TDM_ZWT];
        for (int j = 0; j < n; j++)
            x[j] = act + (size_t)(t + (uint32_t)j) * nb;
        __m512 acc[TDM_ZWT];
        switch (n) {
        case 1: zwide_run(pa, pb, nb, kind, x, acc, 1); break;
        case 2: zwide_run(pa, pb, nb, kind, x, acc, 2); break;
        case 3: zwide_run(pa, pb, nb, kind, x, acc, 3); break;
        case 4: zwide_run(pa, pb, nb, kind, x, acc, 4); break;
        case 5: zwide_run(pa, pb, nb, kind, x, acc, 5); break;
        case 6: zwide_run(pa, pb, nb, kind, x, acc, 6); break;
        case 7: zwide_run(pa, pb, nb, kind, x, acc, 7); break;
        default: zwide_run(pa, pb, nb, kind, x, acc, 8); break;
        }
        for (int j = 0; j < n; j++)
            _mm512_mask_storeu_ps(out + (size_t)(t + (uint32_t)j) * ldo + r0, mask, acc[j]);
    }
}

#define TDM_GEN_ZGEMM(name, kind)                                                                  \
    TDM_AVX512 static void name(const tdm_cpu_qmat_t *w, size_t g0, size_t g1,                     \
                                const q8a_block_t *act, uint32_t nt, float *out, size_t ldo)       \
    {                                                                                              \
        size_t g = g0;                                                                             \
        for (; g + 2 <= g1 && 8 * (uint64_t)(g + 1) < w->n_out; g += 2) {                          \
            uint64_t r0 = 8 * (uint64_t)g;                                                         \
            int nr = w->n_out - r0 < 16 ? (int)(w->n_out - r0) : 16;                               \
            const uint8_t *pa = w->data + g * w->group_bytes;                                      \
            zwide_groups(pa, pa + w->group_bytes, w->nb, kind, act, nt, out, ldo, r0, nr);         \
        }                                                                                          \
        for (; g < g1; g++) {                                                                      \
            uint64_t r0 = 8 * (uint64_t)g;                                                         \
            int nr = w->n_out - r0 < 8 ? (int)(w->n_out - r0) : 8;                                 \
            zgemm_group(w->data + g * w->group_bytes, w->nb, kind, act, nt, out, ldo, r0, nr);     \
        }                                                                                          \
    }
TDM_GEN_ZGEMM(zgemm_q4_0, 0)
TDM_GEN_ZGEMM(zgemm_q4_1, 1)
TDM_GEN_ZGEMM(zgemm_q8_0, 2)
TDM_GEN_ZGEMM(zgemm_q4_k, 3)
TDM_GEN_ZGEMM(zgemm_q6_k, 4)
TDM_GEN_ZGEMM(zgemm_q5_k, 5)
TDM_GEN_ZGEMM(zgemm_q2_k, 6)

/* ---- grouped-query attention over f16 and q8 rows (cpu_kernels.h: scores_f16, pv_f16,
 * scores_q8, pv_q8) ---- */

static const tdm_cpu_isa_t *zavx2; /* the 256-bit kernels, for shapes the tiles below skip */

/* 8 f32 values in both halves */
TDM_AVX512 static inline __m512 zdup8_ps(const float *p)
{
    return _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_loadu_pd((const double *)p)));
}

/* The tiles below read K / V rows of either cache: f16 (q8 false) or int8 with the record's
 * scale (q8 true), dequantized as the reference does, (float)q * scale. Every caller passes q8
 * as a constant, so each tile compiles to one kernel per row type. */

/* Row element idx of a K or V block: its address */
TDM_AVX512 static inline __attribute__((always_inline)) const void *
zrow_at(const void *r, size_t idx, const bool q8)
{
    return (const char *)r + idx * (q8 ? 1 : 2);
}

/* Values i .. i + 7 of rows r and r + d as f32, in the low and high halves (vs: the scale) */
TDM_AVX512 static inline __attribute__((always_inline)) __m512
zrow2x8(const void *r, size_t i, size_t d, const bool q8, __m512 vs)
{
    if (q8) {
        const int8_t *k0 = (const int8_t *)r + i;
        __m128i b = _mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i *)k0),
                                       _mm_loadl_epi64((const __m128i *)(k0 + d)));
        return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vs);
    }
    const uint16_t *k0 = (const uint16_t *)r + i;
    __m256i h2 =
        _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)k0)),
                                _mm_loadu_si128((const __m128i *)(k0 + d)), 1);
    return _mm512_cvtph_ps(h2);
}

/* 16 consecutive values of a row as f32 */
TDM_AVX512 static inline __attribute__((always_inline)) __m512 zrow16(const void *r, const bool q8,
                                                                      __m512 vs)
{
    if (q8)
        return _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)r))), vs);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)r));
}

/* Scores of nh (1..4) query heads against 2 np (np 1..2) K rows, d a multiple of 8: rows 2m
 * and 2m + 1 in the two halves of one register, each half the fma chain over the 8-value
 * chunks in order that dot_f32_f16 (dot_f32 of the dequantized row) forms, then hsum_ps per
 * half: the same bits at twice the width. */
TDM_AVX512 static inline __attribute__((always_inline)) void
zscores_tile(const float *q, const int nh, const void *k, const bool q8, __m512 vs, const int np,
             size_t d, float *sc, size_t ldsc)
{
    __m512 acc[4][2];
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 2
        for (int m = 0; m < np; m++)
            acc[h][m] = _mm512_setzero_ps();
    for (size_t i = 0; i < d; i += 8) {
        __m512 kv[2];
#pragma GCC unroll 2
        for (int m = 0; m < np; m++)
            kv[m] = zrow2x8(zrow_at(k, (size_t)(2 * m) * d, q8), i, d, q8, vs);
#pragma GCC unroll 4
        for (int h = 0; h < nh; h++) {
            __m512 qv = zdup8_ps(q + (size_t)h * d + i);
#pragma GCC unroll 2
            for (int m = 0; m < np; m++)
                acc[h][m] = _mm512_fmadd_ps(qv, kv[m], acc[h][m]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 2
        for (int m = 0; m < np; m++) {
            __m512d a = _mm512_castps_pd(acc[h][m]);
            sc[(size_t)h * ldsc + 2 * m] = hsum_ps(_mm256_castpd_ps(_mm512_castpd512_pd256(a)));
            sc[(size_t)h * ldsc + 2 * m + 1] =
                hsum_ps(_mm256_castpd_ps(_mm512_extractf64x4_pd(a, 1)));
        }
}

/* The scores of 8 keys from their lane accumulators a[0..3] (a[m]: key 2m's 8 fma chains in the
 * low half, key 2m + 1's in the high half), the keys across the lanes: each key's
 * ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), every add with hsum_ps' operands in
 * hsum_ps' order, so each score is bit for bit dot_f32_f16's; 9 shuffles and 5 adds for the
 * 8 keys instead of 8 hsum_ps (32 and 24). Stores the 8 scores at sc. */
TDM_AVX512 static inline void zfold8(const __m512 *a, float *sc)
{
    /* 128-bit quarter j of m03: key j's (l0 + l4, l1 + l5, l2 + l6, l3 + l7); of m47 key 4 + j's */
    __m512 m03 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(a[0], a[1], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512 m47 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], _MM_SHUFFLE(2, 0, 2, 0)),
                               _mm512_shuffle_f32x4(a[2], a[3], _MM_SHUFFLE(3, 1, 3, 1)));
    __m512d e03 = _mm512_castps_pd(m03), e47 = _mm512_castps_pd(m47);
    /* quarter j: key j's (n0, n1), key 4 + j's (n0, n1); n0 = m0 + m2, n1 = m1 + m3 */
    __m512 n = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(e03, e47)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(e03, e47)));
    /* quarter j: s_j, s_(4 + j) (twice) */
    __m512 s = _mm512_add_ps(_mm512_shuffle_ps(n, n, 0x88), _mm512_shuffle_ps(n, n, 0xDD));
    __m512i idx = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 0, 4, 8, 12, 1, 5, 9, 13);
    _mm256_storeu_ps(sc, _mm512_castps512_ps256(_mm512_permutexvar_ps(idx, s)));
}

/* Scores of nh (1..4) query heads against 8 K rows, d a multiple of 8: rows 2m and 2m + 1 in
 * the two halves of one register, each half the fma chain over the 8-value chunks in order that
 * dot_f32_f16 forms (16 accumulators, 4 K registers and a query in the 32), then zfold8. */
TDM_AVX512 static inline __attribute__((always_inline)) void
zscores_tile8(const float *q, const int nh, const void *k, const bool q8, __m512 vs, size_t d,
              float *sc, size_t ldsc)
{
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++)
            acc[h][m] = _mm512_setzero_ps();
    for (size_t i = 0; i < d; i += 8) {
        __m512 kv[4];
#pragma GCC unroll 4
        for (int m = 0; m < 4; m++)
            kv[m] = zrow2x8(zrow_at(k, (size_t)(2 * m) * d, q8), i, d, q8, vs);
#pragma GCC unroll 4
        for (int h = 0; h < nh; h++) {
            __m512 qv = zdup8_ps(q + (size_t)h * d + i);
#pragma GCC unroll 4
            for (int m = 0; m < 4; m++)
                acc[h][m] = _mm512_fmadd_ps(qv, kv[m], acc[h][m]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
        zfold8(acc[h], sc + (size_t)h * ldsc);
}

#define ZSCORES_TILE(NP)                                                                           \
    switch (th) {                                                                                  \
    case 1: zscores_tile(qh, 1, kj, q8, vs, NP, d, sh + j, ldsc); break;                           \
    case 2: zscores_tile(qh, 2, kj, q8, vs, NP, d, sh + j, ldsc); break;                           \
    case 3: zscores_tile(qh, 3, kj, q8, vs, NP, d, sh + j, ldsc); break;                           \
    default: zscores_tile(qh, 4, kj, q8, vs, NP, d, sh + j, ldsc); break;                          \
    }

/* scores_f16 / scores_q8 for d a multiple of 8: heads in tiles of 4, K rows 8 at a time (keys
 * across the lanes in the final fold), then 4, then 2; an odd last row through the 256-bit
 * kernel */
TDM_AVX512 static inline __attribute__((always_inline)) void
zscores_rows(const float *q, uint32_t nh, const void *k, const bool q8, float scale, uint32_t nk,
             size_t d, float *sc, size_t ldsc)
{
    __m512 vs = _mm512_set1_ps(scale);
    for (uint32_t h0 = 0; h0 < nh; h0 += 4) {
        uint32_t th = nh - h0 < 4 ? nh - h0 : 4, j = 0;
        const float *qh = q + (size_t)h0 * d;
        float *sh = sc + (size_t)h0 * ldsc;
        for (; j + 8 <= nk; j += 8) {
            const void *kj = zrow_at(k, (size_t)j * d, q8);
            switch (th) {
            case 1: zscores_tile8(qh, 1, kj, q8, vs, d, sh + j, ldsc); break;
            case 2: zscores_tile8(qh, 2, kj, q8, vs, d, sh + j, ldsc); break;
            case 3: zscores_tile8(qh, 3, kj, q8, vs, d, sh + j, ldsc); break;
            default: zscores_tile8(qh, 4, kj, q8, vs, d, sh + j, ldsc); break;
            }
        }
        if (j + 4 <= nk) {
            const void *kj = zrow_at(k, (size_t)j * d, q8);
            ZSCORES_TILE(2)
            j += 4;
        }
        if (j + 2 <= nk) {
            const void *kj = zrow_at(k, (size_t)j * d, q8);
            ZSCORES_TILE(1)
            j += 2;
        }
        if (j < nk && q8)
            zavx2->scores_q8(qh, th, (const int8_t *)k + (size_t)j * d, scale, nk - j, d, sh + j,
                             ldsc);
        else if (j < nk)
            zavx2->scores_f16(qh, th, (const uint16_t *)k + (size_t)j * d, nk - j, d, sh + j, ldsc);
    }
}
#undef ZSCORES_TILE

/* tdm_cpu_isa_t.scores_f16; d not a multiple of 8 through the 256-bit kernel */
TDM_AVX512 static void zscores_f16(const float *q, uint32_t nh, const uint16_t *k, uint32_t nk,
                                   size_t d, float *sc, size_t ldsc)
{
    if (d % 8)
        zavx2->scores_f16(q, nh, k, nk, d, sc, ldsc);
    else
        zscores_rows(q, nh, k, false, 1.0f, nk, d, sc, ldsc);
}

/* tdm_cpu_isa_t.scores_q8; d not a multiple of 8 through the 256-bit kernel */
TDM_AVX512 static void zscores_q8(const float *q, uint32_t nh, const int8_t *k, float scale,
                                  uint32_t nk, size_t d, float *sc, size_t ldsc)
{
    if (d % 8)
        zavx2->scores_q8(q, nh, k, scale, nk, d, sc, ldsc);
    else
        zscores_rows(q, nh, k, true, scale, nk, d, sc, ldsc);
}

/* Columns c .. c + 16 nc - 1 (nc 1..4) of nh (1..4) heads' outputs: acc = fma(p, v, acc) over
 * the V rows in order, exactly as axpy_f16 (axpy_f32 of the dequantized row) called row after
 * row. */
TDM_AVX512 static inline __attribute__((always_inline)) void
zpv_tile(float *o, const int nh, const float *p, size_t ldp, const void *v, const bool q8,
         __m512 vs, uint32_t nv, size_t d, const int nc)
{
    __m512 acc[4][4];
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 4
        for (int c = 0; c < nc; c++)
            acc[h][c] = _mm512_loadu_ps(o + (size_t)h * d + 16 * c);
    for (uint32_t j = 0; j < nv; j++) {
        __m512 vv[4];
#pragma GCC unroll 4
        for (int c = 0; c < nc; c++)
            vv[c] = zrow16(zrow_at(v, (size_t)j * d + 16 * c, q8), q8, vs);
#pragma GCC unroll 4
        for (int h = 0; h < nh; h++) {
            __m512 pb = _mm512_set1_ps(p[(size_t)h * ldp + j]);
#pragma GCC unroll 4
            for (int c = 0; c < nc; c++)
                acc[h][c] = _mm512_fmadd_ps(pb, vv[c], acc[h][c]);
        }
    }
#pragma GCC unroll 4
    for (int h = 0; h < nh; h++)
#pragma GCC unroll 4
        for (int c = 0; c < nc; c++)
            _mm512_storeu_ps(o + (size_t)h * d + 16 * c, acc[h][c]);
}

#define ZPV_TILE(NC)                                                                               \
    switch (th) {                                                                                  \
    case 1: zpv_tile(oh + c, 1, ph, ldp, zrow_at(v, c, q8), q8, vs, nv, d, NC); break;             \
    case 2: zpv_tile(oh + c, 2, ph, ldp, zrow_at(v, c, q8), q8, vs, nv, d, NC); break;             \
    case 3: zpv_tile(oh + c, 3, ph, ldp, zrow_at(v, c, q8), q8, vs, nv, d, NC); break;             \
    default: zpv_tile(oh + c, 4, ph, ldp, zrow_at(v, c, q8), q8, vs, nv, d, NC); break;            \
    }

/* pv_f16 / pv_q8 for d a multiple of 16: heads in tiles of 4, 64 columns at a time held in
 * registers over all the rows */
TDM_AVX512 static inline __attribute__((always_inline)) void
zpv_rows(float *o, uint32_t nh, const float *p, size_t ldp, const void *v, const bool q8,
         float scale, uint32_t nv, size_t d)
{
    __m512 vs = _mm512_set1_ps(scale);
    for (uint32_t h0 = 0; h0 < nh; h0 += 4) {
        uint32_t th = nh - h0 < 4 ? nh - h0 : 4;
        float *oh = o + (size_t)h0 * d;
        const float *ph = p + (size_t)h0 * ldp;
        size_t c = 0;
        for (; c + 64 <= d; c += 64)
            ZPV_TILE(4)
        for (; c + 16 <= d; c += 16)
            ZPV_TILE(1)
    }
}
#undef ZPV_TILE

/* tdm_cpu_isa_t.pv_f16; d not a multiple of 16 through the 256-bit kernel */
TDM_AVX512 static void zpv_f16(float *o, uint32_t nh, const float *p, size_t ldp, const uint16_t *v,
                               uint32_t nv, size_t d)
{
    if (d % 16)
        zavx2->pv_f16(o, nh, p, ldp, v, nv, d);
    else
        zpv_rows(o, nh, p, ldp, v, false, 1.0f, nv, d);
}

/* tdm_cpu_isa_t.pv_q8; d not a multiple of 16 through the 256-bit kernel */
TDM_AVX512 static void zpv_q8(float *o, uint32_t nh, const float *p, size_t ldp, const int8_t *v,
                              float scale, uint32_t nv, size_t d)
{
    if (d % 16)
        zavx2->pv_q8(o, nh, p, ldp, v, scale, nv, d);
    else
        zpv_rows(o, nh, p, ldp, v, true, scale, nv, d);
}

static tdm_cpu_isa_t isa_z;
static const tdm_cpu_isa_t *isa_z_ptr; /* NULL: not on this CPU */

/* Built once (pthread_once): engines created later read the table while others run. */
static void isa_z_build(void)
{
    const tdm_cpu_isa_t *avx2 = tdm_cpu_isa_avx2();
    if (!avx2 || !tdm_cpu_has_avx512vnni())
        return;
    static const tdm_cpu_gemm_fn gemm[TDM_CPU_N_QTYPES] = {zgemm_q4_0, zgemm_q4_1, zgemm_q8_0,
                                                           zgemm_q4_k, zgemm_q5_k, zgemm_q6_k,
                                                           zgemm_q2_k, zgemm_q6_k /* Q3_K */};
    zavx2 = avx2;
    tdm_cpu_isa_derive(&isa_z, avx2, "avx512-vnni", gemm);
    isa_z.scores_f16 = zscores_f16;
    isa_z.pv_f16 = zpv_f16;
    isa_z.scores_q8 = zscores_q8;
    isa_z.pv_q8 = zpv_q8;
    isa_z_ptr = &isa_z;
}

const tdm_cpu_isa_t *tdm_cpu_isa_avx512(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, isa_z_build);
    return isa_z_ptr;
}
#else
const tdm_cpu_isa_t *tdm_cpu_isa_avx512(void)
{
    return NULL;
}
#endif
