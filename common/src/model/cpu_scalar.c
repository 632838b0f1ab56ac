/* cpu_scalar.c - the CPU backend's portable kernels: the reference every SIMD set matches. */
#include <math.h>
#include <string.h>

#include "model/cpu_kernels.h"
#include "tandem/base.h"

#define QK TDM_CPU_QK

int tdm_cpu_qtype_of(tdm_ggml_type_t type)
{
    switch (type) {
    case TDM_GGML_TYPE_Q4_0: return TDM_CPU_Q4_0;
    case TDM_GGML_TYPE_Q4_1: return TDM_CPU_Q4_1;
    case TDM_GGML_TYPE_Q8_0: return TDM_CPU_Q8_0;
    case TDM_GGML_TYPE_Q4_K: return TDM_CPU_Q4_K;
    case TDM_GGML_TYPE_Q5_K: return TDM_CPU_Q5_K;
    case TDM_GGML_TYPE_Q6_K: return TDM_CPU_Q6_K;
    case TDM_GGML_TYPE_Q2_K: return TDM_CPU_Q2_K;
    case TDM_GGML_TYPE_Q3_K: return TDM_CPU_Q3_K;
    default: return -1;
    }
}

float tdm_cpu_round_fp16(float x)
{
    return tdm_fp16_to_fp32(tdm_fp32_to_fp16(x));
}

/* The canonical block reduction (cpu_kernels.h): acc = fma(dw * da, isum, acc). */
static float dot_q4_1_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    float acc = 0.0f;
    for (size_t b = 0; b < nb; b++, p += 20) {
        uint16_t hd, hm;
        memcpy(&hd, p, 2);
        memcpy(&hm, p + 2, 2);
        const uint8_t *qs = p + 4;
        int32_t isum = 0;
        for (int j = 0; j < 16; j++)
            isum += (qs[j] & 15) * a[b].q[j] + (qs[j] >> 4) * a[b].q[j + 16];
        acc = fmaf(tdm_fp16_to_fp32(hd) * a[b].d, (float)isum, acc);
        acc = fmaf(tdm_fp16_to_fp32(hm), a[b].s, acc);
    }
    return acc;
}

static float dot_q4_0_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    float acc = 0.0f;
    for (size_t b = 0; b < nb; b++, p += 18) {
        uint16_t hd;
        memcpy(&hd, p, 2);
        const uint8_t *qs = p + 2;
        int32_t isum = 0;
        for (int j = 0; j < 16; j++)
            isum += ((qs[j] & 15) - 8) * a[b].q[j] + ((qs[j] >> 4) - 8) * a[b].q[j + 16];
        acc = fmaf(tdm_fp16_to_fp32(hd) * a[b].d, (float)isum, acc);
    }
    return acc;
}

static float dot_q8_0_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    float acc = 0.0f;
    for (size_t b = 0; b < nb; b++, p += 34) {
        uint16_t hd;
        memcpy(&hd, p, 2);
        const int8_t *qs = (const int8_t *)(p + 2);
        int32_t isum = 0;
        for (int j = 0; j < 32; j++)
            isum += qs[j] * a[b].q[j];
        acc = fmaf(tdm_fp16_to_fp32(hd) * a[b].d, (float)isum, acc);
    }
    return acc;
}

/* ---- K-quants, one 32-value sub-block at a time (cpu_kernels.h) ---- */

#define QK_K 256

static float kq_half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, 2);
    return tdm_fp16_to_fp32(h);
}

/* The 6-bit scale and min of sub-block j of a Q4_K / Q5_K super-block (quant.c's
 * scale_min_k4), as dw = d * sc and mw = -(dmin * m). */
static void kq_scale_min(const uint8_t *sb, int j, float *dw, float *mw)
{
    const uint8_t *s = sb + 4;
    int isc, im;
    if (j < 4) {
        isc = s[j] & 63;
        im = s[j + 4] & 63;
    } else {
        isc = (s[j + 4] & 0x0f) | ((s[j - 4] >> 6) << 4);
        im = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    *dw = kq_half(sb) * (float)isc;
    *mw = -(kq_half(sb + 2) * (float)im);
}

/* Sub-block j (0..7) of a Q4_K super-block: values 0..15, dw = d * sc, mw = -(dmin * m). */
static void kq_q4_k(const uint8_t *sb, int j, int8_t *v, float *sc, float *mw)
{
    const uint8_t *q = sb + 16 + 32 * (j / 2);
    for (int l = 0; l < 32; l++)
        v[l] = (int8_t)(j % 2 ? q[l] >> 4 : q[l] & 15);
    kq_scale_min(sb, j, &sc[0], mw);
    sc[1] = sc[0];
}

/* Sub-block j (0..7) of a Q5_K super-block: the 5-bit values taken signed, q - 16, so that
 * they run as Q8_0's int8 values; the offset moves into the min: mw = 16 * dw - dmin * m
 * (rounded to f32 once, here, for every kernel). */
static void kq_q5_k(const uint8_t *sb, int j, int8_t *v, float *sc, float *mw)
{
    const uint8_t *qh = sb + 16, *ql = sb + 48 + 32 * (j / 2);
    for (int l = 0; l < 32; l++) {
        int lo = j % 2 ? ql[l] >> 4 : ql[l] & 15;
        v[l] = (int8_t)(lo + ((qh[l] >> j) & 1) * 16 - 16);
    }
    kq_scale_min(sb, j, &sc[0], mw);
    sc[1] = sc[0];
    *mw += 16.0f * sc[0];
}

/* Sub-block j (0..7) of a Q6_K super-block: values q - 32, dlo / dhi = d * scale of each half. */
static void kq_q6_k(const uint8_t *sb, int j, int8_t *v, float *sc, float *mw)
{
    int half = j / 4, quarter = j % 4;
    const uint8_t *ql = sb + 64 * half + (quarter % 2 ? 32 : 0), *qh = sb + 128 + 32 * half;
    const int8_t *scales = (const int8_t *)(sb + 192) + 8 * half + 2 * quarter;
    for (int l = 0; l < 32; l++) {
        int lo = quarter < 2 ? ql[l] & 15 : ql[l] >> 4;
        v[l] = (int8_t)((lo | (((qh[l] >> (2 * quarter)) & 3) << 4)) - 32);
    }
    float d = kq_half(sb + 208);
    sc[0] = d * (float)scales[0];
    sc[1] = d * (float)scales[1];
    *mw = 0.0f;
}

/* Sub-block j (0..7) of a Q2_K super-block (ggml's block_q2_K: scales[16], qs[64], f16 d, dmin;
 * dequantize_row_q2_K): values 0..3 from bits 2 (j % 4) of qs[32 (j / 4) + l]; per half h
 * (scales[2j + h]) dw = d * (sc & 15) and mw = -(dmin * (sc >> 4)), all exact in f32. */
static void kq_q2_k(const uint8_t *sb, int j, int8_t *v, float *sc, float *mw)
{
    const uint8_t *q = sb + 16 + 32 * (j / 4);
    for (int l = 0; l < 32; l++)
        v[l] = (int8_t)((q[l] >> (2 * (j % 4))) & 3);
    float d = kq_half(sb + 80), dmin = kq_half(sb + 82);
    for (int h = 0; h < 2; h++) {
        sc[h] = d * (float)(sb[2 * j + h] & 15);
        mw[h] = -(dmin * (float)(sb[2 * j + h] >> 4));
    }
}

/* Sub-block j (0..7) of a Q3_K super-block (block_q3_K: hmask[32], qs[64], scales[12], f16 d;
 * dequantize_row_q3_K): values (2 bits of qs as Q2_K) - 4 unless bit j of hmask[l] is set, in
 * -4..3; dlo / dhi = d * (scale - 32) of scales 2j and 2j + 1 (6 bits: the low nibble of
 * scales[s % 8], low for s < 8, high after; the top 2 bits of scales[8 + s % 4] at 2 (s / 4)). */
static void kq_q3_k(const uint8_t *sb, int j, int8_t *v, float *sc, float *mw)
{
    const uint8_t *q = sb + 32 + 32 * (j / 4), *scales = sb + 96;
    for (int l = 0; l < 32; l++)
        v[l] = (int8_t)(((q[l] >> (2 * (j % 4))) & 3) - ((sb[l] >> j) & 1 ? 0 : 4));
    float d = kq_half(sb + 108);
    for (int h = 0; h < 2; h++) {
        int s = 2 * j + h;
        int lo = s < 8 ? scales[s] & 15 : scales[s - 8] >> 4;
        int hi = (scales[8 + s % 4] >> (2 * (s / 4))) & 3;
        sc[h] = d * (float)((lo | (hi << 4)) - 32);
    }
    mw[0] = mw[1] = 0.0f;
}

/* GGUF bytes of a K-quant super-block */
static size_t kq_bytes(tdm_ggml_type_t type)
{
    switch (type) {
    case TDM_GGML_TYPE_Q2_K: return 84;
    case TDM_GGML_TYPE_Q3_K: return 110;
    case TDM_GGML_TYPE_Q4_K: return 144;
    case TDM_GGML_TYPE_Q5_K: return 176;
    default: return 210;
    }
}

/* 32-value block b of a K-quant row: values v, scales of its halves, min terms (mw[1]: Q2_K's
 * second half's min; the others have one min per block, in mw[0]). */
static void kq_block(tdm_ggml_type_t type, const uint8_t *row, size_t b, int8_t *v, float *sc,
                     float *mw)
{
    const uint8_t *sb = row + (b / 8) * kq_bytes(type);
    int j = (int)(b % 8);
    if (type == TDM_GGML_TYPE_Q4_K)
        kq_q4_k(sb, j, v, sc, mw);
    else if (type == TDM_GGML_TYPE_Q5_K)
        kq_q5_k(sb, j, v, sc, mw);
    else if (type == TDM_GGML_TYPE_Q2_K)
        kq_q2_k(sb, j, v, sc, mw);
    else if (type == TDM_GGML_TYPE_Q3_K)
        kq_q3_k(sb, j, v, sc, mw);
    else
        kq_q6_k(sb, j, v, sc, mw);
}

/* The types whose 32-value blocks carry a scale per half (dlo, dhi) */
static bool kq_halves(tdm_ggml_type_t type)
{
    return type == TDM_GGML_TYPE_Q6_K || type == TDM_GGML_TYPE_Q3_K || type == TDM_GGML_TYPE_Q2_K;
}

/* The canonical K-quant reduction over one row in place. */
static float dot_kq_scalar(tdm_ggml_type_t type, const uint8_t *row, const q8a_block_t *a,
                           size_t nb)
{
    float acc = 0.0f;
    for (size_t b = 0; b < nb; b++) {
        int8_t v[32];
        float sc[2], mw[2];
        kq_block(type, row, b, v, sc, mw);
        int32_t lo = 0, hi = 0;
        for (int j = 0; j < 16; j++) {
            lo += v[j] * a[b].q[j];
            hi += v[j + 16] * a[b].q[j + 16];
        }
        if (!kq_halves(type)) {
            acc = fmaf(sc[0] * a[b].d, (float)(lo + hi), acc);
            acc = fmaf(mw[0], a[b].s, acc);
        } else {
            acc = fmaf(sc[0] * a[b].d, (float)lo, acc);
            acc = fmaf(sc[1] * a[b].d, (float)hi, acc);
        }
        if (type == TDM_GGML_TYPE_Q2_K) {
            acc = fmaf(mw[0], a[b].d * (float)a[b].isum_lo, acc);
            acc = fmaf(mw[1], a[b].d * (float)(a[b].isum - a[b].isum_lo), acc);
        }
    }
    return acc;
}

static float dot_q4_k_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    return dot_kq_scalar(TDM_GGML_TYPE_Q4_K, p, a, nb);
}

static float dot_q5_k_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    return dot_kq_scalar(TDM_GGML_TYPE_Q5_K, p, a, nb);
}

static float dot_q6_k_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    return dot_kq_scalar(TDM_GGML_TYPE_Q6_K, p, a, nb);
}

static float dot_q2_k_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    return dot_kq_scalar(TDM_GGML_TYPE_Q2_K, p, a, nb);
}

static float dot_q3_k_scalar(const uint8_t *p, const q8a_block_t *a, size_t nb)
{
    return dot_kq_scalar(TDM_GGML_TYPE_Q3_K, p, a, nb);
}

/* GEMM over GGUF rows in place: one (row, token) dot at a time. */
#define TDM_GEN_SCALAR_GEMM(name)                                                                  \
    static void name##_gemm(const tdm_cpu_qmat_t *w, size_t g0, size_t g1, const q8a_block_t *act, \
                            uint32_t nt, float *out, size_t ldo)                                   \
    {                                                                                              \
        uint64_t r1 = 8 * (uint64_t)g1 < w->n_out ? 8 * (uint64_t)g1 : w->n_out;                   \
        for (uint64_t r = 8 * (uint64_t)g0; r < r1; r++)                                           \
            for (uint32_t t = 0; t < nt; t++)                                                      \
                out[(size_t)t * ldo + r] =                                                         \
                    name(w->data + r * w->row_bytes, act + (size_t)t * w->nb, w->nb);              \
    }
TDM_GEN_SCALAR_GEMM(dot_q4_0_scalar)
TDM_GEN_SCALAR_GEMM(dot_q4_1_scalar)
TDM_GEN_SCALAR_GEMM(dot_q8_0_scalar)
TDM_GEN_SCALAR_GEMM(dot_q4_k_scalar)
TDM_GEN_SCALAR_GEMM(dot_q5_k_scalar)
TDM_GEN_SCALAR_GEMM(dot_q6_k_scalar)
TDM_GEN_SCALAR_GEMM(dot_q2_k_scalar)
TDM_GEN_SCALAR_GEMM(dot_q3_k_scalar)

/* ---- the packed layout (cpu_kernels.h) ---- */

static size_t pack_block_bytes(tdm_ggml_type_t type)
{
    switch (type) {
    case TDM_GGML_TYPE_Q4_0: return 144;
    case TDM_GGML_TYPE_Q4_1: return 160;
    case TDM_GGML_TYPE_Q4_K: return 192;
    case TDM_GGML_TYPE_Q5_K:
    case TDM_GGML_TYPE_Q3_K:
    case TDM_GGML_TYPE_Q6_K: return 320;
    case TDM_GGML_TYPE_Q2_K: return 384;
    default: return 272;
    }
}

size_t tdm_cpu_pack_bytes(tdm_ggml_type_t type, uint64_t n_out, size_t nb)
{
    return (size_t)((n_out + 7) / 8) * nb * pack_block_bytes(type);
}

/* One block of 8 rows (rows[r] NULL past n_out) into dst. */
static void pack_block(tdm_ggml_type_t type, const uint8_t *const *rows, uint8_t *dst)
{
    size_t head = type == TDM_GGML_TYPE_Q4_1 ? 4 : 2; /* GGUF bytes before the quants */
    size_t n_scales = head / 2, qbytes = type == TDM_GGML_TYPE_Q8_0 ? 32 : 16;
    uint8_t *q = dst + 16 * n_scales;
    memset(dst, 0, pack_block_bytes(type));
    for (int r = 0; r < 8; r++) {
        if (!rows[r])
            continue;
        for (size_t s = 0; s < n_scales; s++)
            memcpy(dst + 16 * s + 2 * (size_t)r, rows[r] + 2 * s, 2);
        for (size_t k = 0; k < qbytes / 4; k++)
            memcpy(q + 32 * k + 4 * (size_t)r, rows[r] + head + 4 * k, 4);
    }
}

/* One 32-value block of 8 K-quant rows (rows[r] NULL past n_out) into dst. */
static void pack_kq_block(tdm_ggml_type_t type, const uint8_t *const *rows, size_t b, uint8_t *dst)
{
    bool q4 = type == TDM_GGML_TYPE_Q4_K, q2 = type == TDM_GGML_TYPE_Q2_K;
    float *s0 = (float *)(void *)dst, *s1 = s0 + 8;
    uint8_t *q = dst + (q2 ? 128 : 64);
    memset(dst, 0, pack_block_bytes(type));
    for (int r = 0; r < 8; r++) {
        if (!rows[r])
            continue;
        int8_t v[32];
        float sc[2], mw[2];
        kq_block(type, rows[r], b, v, sc, mw);
        s0[r] = sc[0];
        s1[r] = kq_halves(type) ? sc[1] : mw[0];
        if (q2) {
            s0[16 + r] = mw[0];
            s0[24 + r] = mw[1];
        }
        for (int k = 0; k < (q4 ? 4 : 8); k++)
            for (int i = 0; i < 4; i++)
                q[32 * k + 4 * r + i] =
                    q4 ? (uint8_t)(v[4 * k + i] | (v[16 + 4 * k + i] << 4)) : (uint8_t)v[4 * k + i];
    }
}

static void pack_kq(tdm_ggml_type_t type, const uint8_t *src, uint64_t n_out, size_t nb,
                    uint8_t *dst)
{
    size_t row_bytes = nb / 8 * kq_bytes(type);
    for (uint64_t g = 0; g < (n_out + 7) / 8; g++) {
        const uint8_t *rows[8];
        for (uint64_t r = 0; r < 8; r++)
            rows[r] = 8 * g + r < n_out ? src + (8 * g + r) * row_bytes : NULL;
        for (size_t b = 0; b < nb; b++, dst += pack_block_bytes(type))
            pack_kq_block(type, rows, b, dst);
    }
}

void tdm_cpu_pack(tdm_ggml_type_t type, const uint8_t *src, uint64_t n_out, size_t nb, uint8_t *dst)
{
    if (tdm_cpu_qtype_of(type) >= TDM_CPU_Q4_K) {
        pack_kq(type, src, n_out, nb, dst);
        return;
    }
    size_t row_bytes = nb * (type == TDM_GGML_TYPE_Q4_1   ? 20
                             : type == TDM_GGML_TYPE_Q4_0 ? 18
                                                          : 34);
    size_t bsz = row_bytes / nb;
    for (uint64_t g = 0; g < (n_out + 7) / 8; g++) {
        for (size_t b = 0; b < nb; b++) {
            const uint8_t *rows[8];
            for (uint64_t r = 0; r < 8; r++)
                rows[r] = 8 * g + r < n_out ? src + (8 * g + r) * row_bytes + b * bsz : NULL;
            pack_block(type, rows, dst);
            dst += pack_block_bytes(type);
        }
    }
}

/* The canonical f32 dot product (cpu_kernels.h), the order AVX2 sums in: 8 lanes, lane l an
 * fma chain over elements 8c + l; the lanes summed ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
 * (l3 + l7)); the tail (n % 8 elements) fma'd into that sum in order. */
static float dot_f32_scalar(const float *x, const float *y, size_t n)
{
    float l[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int k = 0; k < 8; k++)
            l[k] = fmaf(x[i + k], y[i + k], l[k]);
    float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for (; i < n; i++)
        s = fmaf(x[i], y[i], s);
    return s;
}

/* q . k with k f16, in dot_f32_scalar's order (f16 to f32 is exact) */
static float dot_f32_f16_scalar(const float *q, const uint16_t *k, size_t n)
{
    float l[8] = {0};
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++)
            l[j] = fmaf(q[i + j], tdm_fp16_to_fp32(k[i + j]), l[j]);
    float s = ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]));
    for (; i < n; i++)
        s = fmaf(q[i], tdm_fp16_to_fp32(k[i]), s);
    return s;
}

static void axpy_f16_scalar(float *out, float p, const uint16_t *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = fmaf(p, tdm_fp16_to_fp32(v[i]), out[i]);
}

static void scores_f16_scalar(const float *q, uint32_t nh, const uint16_t *k, uint32_t nk, size_t d,
                              float *sc, size_t ldsc)
{
    for (uint32_t h = 0; h < nh; h++)
        for (uint32_t j = 0; j < nk; j++)
            sc[(size_t)h * ldsc + j] = dot_f32_f16_scalar(q + (size_t)h * d, k + (size_t)j * d, d);
}

static void pv_f16_scalar(float *o, uint32_t nh, const float *p, size_t ldp, const uint16_t *v,
                          uint32_t nv, size_t d)
{
    for (uint32_t h = 0; h < nh; h++)
        for (uint32_t j = 0; j < nv; j++)
            axpy_f16_scalar(o + (size_t)h * d, p[(size_t)h * ldp + j], v + (size_t)j * d, d);
}

static void quantize_act_scalar(const float *x, size_t n, q8a_block_t *out)
{
    for (size_t b = 0; b < n / QK; b++) {
        const float *xb = x + b * QK;
        float amax = 0.0f;
        for (int j = 0; j < QK; j++)
            amax = fmaxf(amax, fabsf(xb[j]));
        float d = amax / 127.0f, id = amax != 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < QK; j++) {
            int q = (int)nearbyintf(xb[j] * id);
            out[b].q[j] = (int8_t)q;
            sum += q;
            if (j == QK / 2 - 1)
                out[b].isum_lo = sum;
        }
        out[b].d = tdm_cpu_round_fp16(d);
        out[b].s = tdm_cpu_round_fp16(d * (float)sum);
        out[b].isum = sum;
    }
}

static void axpy_f32_scalar(float *out, float p, const float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] = fmaf(p, v[i], out[i]);
}

static void store_f16_scalar(uint16_t *dst, const float *src, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = tdm_fp32_to_fp16(src[i]);
}

static void round_f16_scalar(float *dst, const float *src, float scale, size_t n)
{
    for (size_t i = 0; i < n; i++)
        dst[i] = tdm_cpu_round_fp16(src[i] * scale);
}

static float scale_max_scalar(float *x, size_t n, float scale)
{
    float mx = -INFINITY;
    for (size_t j = 0; j < n; j++) {
        x[j] *= scale;
        mx = x[j] > mx ? x[j] : mx;
    }
    return mx;
}

static double exp_sum_scalar(float *x, size_t n, float mx)
{
    double lane[TDM_EXP_LANES] = {0};
    for (size_t j = 0; j < n; j++) {
        x[j] = tdm_cpu_expf(x[j] - mx);
        lane[j % TDM_EXP_LANES] += (double)x[j];
    }
    return tdm_cpu_fold_lanes(lane);
}

static void swiglu_scalar(float *out, const float *gate, const float *up, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float g = gate[i];
        out[i] = g / (1.0f + tdm_cpu_expf(-g)) * up[i];
    }
}

static const tdm_cpu_isa_t isa_scalar = {
    .name = "scalar",
    .quantize_act = quantize_act_scalar,
    .dot_f32 = dot_f32_scalar,
    .dot_f32_f16 = dot_f32_f16_scalar,
    .axpy_f16 = axpy_f16_scalar,
    .axpy_f32 = axpy_f32_scalar,
    .scores_f16 = scores_f16_scalar,
    .pv_f16 = pv_f16_scalar,
    .store_f16 = store_f16_scalar,
    .round_f16 = round_f16_scalar,
    .scale_max = scale_max_scalar,
    .exp_sum = exp_sum_scalar,
    .swiglu = swiglu_scalar,
    .gemm = {dot_q4_0_scalar_gemm, dot_q4_1_scalar_gemm, dot_q8_0_scalar_gemm, dot_q4_k_scalar_gemm,
             dot_q5_k_scalar_gemm, dot_q6_k_scalar_gemm, dot_q2_k_scalar_gemm,
             dot_q3_k_scalar_gemm}, /* tdm_cpu_qtype_t's order */
};

const tdm_cpu_isa_t *tdm_cpu_isa_scalar(void)
{
    return &isa_scalar;
}
