/* quant.c - ggml tensor types: block geometry, IEEE half/bfloat16 conversions, and scalar
 * dequantization and reference quantization of one row (see tandem/gguf.h).
 *
 * Block layouts and dequantization formulas follow ggml (ggml/src/ggml-common.h and
 * ggml-quants.c, dequantize_row_*); the quantizers are plain round-to-nearest per block like
 * ggml's quantize_row_*_ref (the K-quant ones pick covering scales and then try their
 * neighbours, a much smaller search than ggml's make_qkx2_quants, for the same layout; Q2_K and
 * Q3_K take covering scales per 16 values and round, without a search). Blocks are
 * read and written byte by byte (memcpy for the multi-byte fields), so rows may sit at any
 * alignment. Assumes a little-endian host, as the rest of the GGUF code does.
 */
#include "tandem/gguf.h"

#include <math.h>
#include <string.h>

#define QK 32    /* elements per block of the Q*_0 / Q*_1 types */
#define QK_K 256 /* elements per super-block of the K-quants */

/* Byte sizes of ggml's blocks (static_asserts in ggml-common.h). */
#define Q4_0_BYTES 18  /* half d; uint8 qs[16] */
#define Q4_1_BYTES 20  /* half d, m; uint8 qs[16] */
#define Q5_0_BYTES 22  /* half d; uint8 qh[4]; uint8 qs[16] */
#define Q5_1_BYTES 24  /* half d, m; uint8 qh[4]; uint8 qs[16] */
#define Q8_0_BYTES 34  /* half d; int8 qs[32] */
#define Q4_K_BYTES 144 /* half d, dmin; uint8 scales[12]; uint8 qs[128] */
#define Q5_K_BYTES 176 /* half d, dmin; uint8 scales[12]; uint8 qh[32]; uint8 qs[128] */
#define Q6_K_BYTES 210 /* uint8 ql[128]; uint8 qh[64]; int8 scales[16]; half d */
#define Q2_K_BYTES 84  /* uint8 scales[16]; uint8 qs[64]; half d, dmin */
#define Q3_K_BYTES 110 /* uint8 hmask[32]; uint8 qs[64]; uint8 scales[12]; half d */

/* ggml's type_traits table (ggml.c): name, block size, block bytes. The numbers that ggml
 * has retired (4, 5, 31-33, 36-38) have no entry. Types beyond tdm_ggml_type_t's names are
 * listed so that files using them can be read and reported, but only `supported` ones can be
 * dequantized. */
static const tdm_ggml_type_info_t type_table[TDM_GGML_TYPE_COUNT] = {
    [0] = {"F32", 1, 4, true},
    [1] = {"F16", 1, 2, true},
    [2] = {"Q4_0", QK, Q4_0_BYTES, true},
    [3] = {"Q4_1", QK, Q4_1_BYTES, true},
    [6] = {"Q5_0", QK, Q5_0_BYTES, true},
    [7] = {"Q5_1", QK, Q5_1_BYTES, true},
    [8] = {"Q8_0", QK, Q8_0_BYTES, true},
    [9] = {"Q8_1", QK, 36, false},
    [10] = {"Q2_K", QK_K, Q2_K_BYTES, true},
    [11] = {"Q3_K", QK_K, Q3_K_BYTES, true},
    [12] = {"Q4_K", QK_K, Q4_K_BYTES, true},
    [13] = {"Q5_K", QK_K, Q5_K_BYTES, true},
    [14] = {"Q6_K", QK_K, Q6_K_BYTES, true},
    [15] = {"Q8_K", QK_K, 292, false},
    [16] = {"IQ2_XXS", QK_K, 66, false},
    [17] = {"IQ2_XS", QK_K, 74, false},
    [18] = {"IQ3_XXS", QK_K, 98, false},
    [19] = {"IQ1_S", QK_K, 50, false},
    [20] = {"IQ4_NL", QK, 18, false},
    [21] = {"IQ3_S", QK_K, 110, false},
    [22] = {"IQ2_S", QK_K, 82, false},
    [23] = {"IQ4_XS", QK_K, 136, false},
    [24] = {"I8", 1, 1, false},
    [25] = {"I16", 1, 2, false},
    [26] = {"I32", 1, 4, false},
    [27] = {"I64", 1, 8, false},
    [28] = {"F64", 1, 8, false},
    [29] = {"IQ1_M", QK_K, 56, false},
    [30] = {"BF16", 1, 2, true},
    [34] = {"TQ1_0", QK_K, 54, false},
    [35] = {"TQ2_0", QK_K, 66, false},
    [39] = {"MXFP4", QK, 17, false},
};

const tdm_ggml_type_info_t *tdm_ggml_type_get(uint32_t type)
{
    if (type >= TDM_GGML_TYPE_COUNT || !type_table[type].name)
        return NULL;
    return &type_table[type];
}

size_t tdm_ggml_row_size(tdm_ggml_type_t type, uint64_t n)
{
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get((uint32_t)type);
    uint64_t bytes;
    if (!ti || n % ti->block_size != 0 || !tdm_mul_u64(n / ti->block_size, ti->type_size, &bytes) ||
        bytes > SIZE_MAX)
        return 0;
    return (size_t)bytes;
}

/* ---- half and bfloat16 ---- */

static inline uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Exact: every half is a float. Branch-free, after fp16_ieee_to_fp32_value in M. Dukhan's FP16
 * library: a normal half is its bits shifted into float position with the exponent rebiased by
 * a multiply by 2^-112 (exact; also turns the all-ones exponent into inf/NaN); a subnormal half
 * m 2^-24 is made exactly by subtracting 0.5 from the float 0.5 + m 2^-24. */
float tdm_fp16_to_fp32(uint16_t h)
{
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w; /* drops the sign */
    const float normal = f32_from_bits((two_w >> 4) + (0xe0u << 23)) * 0x1p-112f;
    const float subnormal = f32_from_bits((two_w >> 17) | (126u << 23)) - 0.5f;
    const uint32_t is_sub = 0u - (uint32_t)(two_w < (1u << 27)); /* all ones or zero */
    const uint32_t mag = (f32_bits(subnormal) & is_sub) | (f32_bits(normal) & ~is_sub);
    return f32_from_bits(sign | mag);
}

/* Round-to-nearest-even. Values from 65520 up become inf; NaNs stay NaN (quiet, top payload
 * bits kept); results below 2^-14 are rounded to a subnormal half by one float addition of
 * 0.5, whose ulp (2^-24) is the subnormal half's ulp, so the FPU does the rounding. After
 * F. Giesen, "float_to_half_fast3_rtne". */
uint16_t tdm_fp32_to_fp16(float f)
{
    uint32_t x = f32_bits(f);
    const uint32_t sign = x & 0x80000000u;
    x ^= sign;
    uint32_t o;
    if (x >= (uint32_t)(127 + 16) << 23) { /* >= 65536, inf or NaN */
        o = x > 0x7f800000u ? 0x7e00u | ((x >> 13) & 0x3ffu) : 0x7c00u;
    } else if (x < (uint32_t)(127 - 14) << 23) {          /* below 2^-14: subnormal half or zero */
        const uint32_t magic = (uint32_t)(127 - 1) << 23; /* 0.5f */
        o = f32_bits(f32_from_bits(x) + f32_from_bits(magic)) - magic;
    } else {
        const uint32_t mant_odd = (x >> 13) & 1u;
        x -= (uint32_t)(127 - 15) << 23; /* rebias */
        x += 0xfffu + mant_odd;          /* round half to even; may carry into inf */
        o = x >> 13;
    }
    return (uint16_t)(o | (sign >> 16));
}

float tdm_bf16_to_fp32(uint16_t h)
{
    return f32_from_bits((uint32_t)h << 16);
}

/* Round-to-nearest-even on the top 16 bits; NaN is kept NaN (quieted), never rounded to inf.
 * Subnormals are rounded, not flushed. */
uint16_t tdm_fp32_to_bf16(float f)
{
    uint32_t x = f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* ---- dequantization ---- */

static inline float rd_half(const uint8_t *p)
{
    uint16_t h;
    memcpy(&h, p, sizeof h);
    return tdm_fp16_to_fp32(h);
}

static void dequant_f16(const uint8_t *restrict src, float *restrict dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++)
        dst[i] = rd_half(src + 2 * i);
}

static void dequant_bf16(const uint8_t *restrict src, float *restrict dst, int64_t n)
{
    for (int64_t i = 0; i < n; i++) {
        uint16_t h;
        memcpy(&h, src + 2 * i, sizeof h);
        dst[i] = tdm_bf16_to_fp32(h);
    }
}

/* x = (q - 8) d; byte j holds element j (low nibble) and j + 16 (high nibble). */
static void dequant_q4_0(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q4_0_BYTES, dst += QK) {
        const float d = rd_half(src);
        const uint8_t *qs = src + 2;
        for (int j = 0; j < QK / 2; j++) {
            dst[j] = (float)((int)(qs[j] & 0x0f) - 8) * d;
            dst[j + QK / 2] = (float)((int)(qs[j] >> 4) - 8) * d;
        }
    }
}

/* x = q d + m. */
static void dequant_q4_1(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q4_1_BYTES, dst += QK) {
        const float d = rd_half(src);
        const float m = rd_half(src + 2);
        const uint8_t *qs = src + 4;
        for (int j = 0; j < QK / 2; j++) {
            dst[j] = (float)(qs[j] & 0x0f) * d + m;
            dst[j + QK / 2] = (float)(qs[j] >> 4) * d + m;
        }
    }
}

/* x = (q - 16) d; bit j of the little-endian u32 qh is the 5th bit of element j. */
static void dequant_q5_0(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q5_0_BYTES, dst += QK) {
        const float d = rd_half(src);
        uint32_t qh;
        memcpy(&qh, src + 2, sizeof qh);
        const uint8_t *qs = src + 6;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = (int)((qh >> j) << 4) & 0x10;
            const int h1 = (int)(qh >> (j + 12)) & 0x10;
            dst[j] = (float)(((qs[j] & 0x0f) | h0) - 16) * d;
            dst[j + QK / 2] = (float)(((qs[j] >> 4) | h1) - 16) * d;
        }
    }
}

/* x = q d + m, 5-bit q as in Q5_0. */
static void dequant_q5_1(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q5_1_BYTES, dst += QK) {
        const float d = rd_half(src);
        const float m = rd_half(src + 2);
        uint32_t qh;
        memcpy(&qh, src + 4, sizeof qh);
        const uint8_t *qs = src + 8;
        for (int j = 0; j < QK / 2; j++) {
            const int h0 = (int)((qh >> j) << 4) & 0x10;
            const int h1 = (int)(qh >> (j + 12)) & 0x10;
            dst[j] = (float)((qs[j] & 0x0f) | h0) * d + m;
            dst[j + QK / 2] = (float)((qs[j] >> 4) | h1) * d + m;
        }
    }
}

/* x = q d, q signed 8-bit. */
static void dequant_q8_0(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q8_0_BYTES, dst += QK) {
        const float d = rd_half(src);
        const int8_t *qs = (const int8_t *)(src + 2);
        for (int j = 0; j < QK; j++)
            dst[j] = (float)qs[j] * d;
    }
}

/* The 6-bit scale and min of sub-block j (0..7) from the 12 packed bytes of a Q4_K/Q5_K block
 * (ggml's get_scale_min_k4): bytes 0-3 hold scales 0-3 in their low 6 bits, bytes 4-7 mins
 * 0-3; bytes 8-11 hold the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble),
 * whose top 2 bits sit in the top 2 bits of bytes 0-3 (scales) and 4-7 (mins). */
static inline void scale_min_k4(int j, const uint8_t *q, uint8_t *sc, uint8_t *m)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0x0f) | ((q[j - 4] >> 6) << 4));
        *m = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Eight sub-blocks of 32: x = d sc_j q - dmin m_j; each 32-byte run of qs holds two
 * sub-blocks (low nibbles the first, high nibbles the second). */
static void dequant_q4_k(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q4_K_BYTES) {
        const float d = rd_half(src);
        const float dmin = rd_half(src + 2);
        const uint8_t *scales = src + 4;
        const uint8_t *q = src + 16;
        for (int is = 0; is < 8; is += 2, q += 32, dst += 64) {
            uint8_t sc, m;
            scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) {
                dst[l] = d1 * (float)(q[l] & 0x0f) - m1;
                dst[l + 32] = d2 * (float)(q[l] >> 4) - m2;
            }
        }
    }
}

/* As Q4_K with a 5th bit per element: for the sub-block pair k (0..3), bit 2k of qh[l] belongs
 * to element l of the first sub-block, bit 2k+1 to element l of the second. */
static void dequant_q5_k(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q5_K_BYTES) {
        const float d = rd_half(src);
        const float dmin = rd_half(src + 2);
        const uint8_t *scales = src + 4;
        const uint8_t *qh = src + 16;
        const uint8_t *ql = src + 48;
        unsigned u1 = 1, u2 = 2;
        for (int is = 0; is < 8; is += 2, ql += 32, dst += 64, u1 <<= 2, u2 <<= 2) {
            uint8_t sc, m;
            scale_min_k4(is, scales, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            scale_min_k4(is + 1, scales, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (int l = 0; l < 32; l++) {
                dst[l] = d1 * (float)((ql[l] & 0x0f) + (qh[l] & u1 ? 16 : 0)) - m1;
                dst[l + 32] = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
            }
        }
    }
}

/* Sixteen sub-blocks of 16: x = d scale_j (q - 32), q 6-bit. Per half (128 elements) of the
 * block: ql[0..63] and qh[0..31]; element l (0..31) of each quarter takes its low 4 bits from
 * ql[l] / ql[l+32] (low nibble: quarters 0/1, high nibble: quarters 2/3) and its top 2 bits
 * from bits 0-1, 2-3, 4-5, 6-7 of qh[l] for quarters 0, 1, 2, 3. */
static void dequant_q6_k(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q6_K_BYTES) {
        const uint8_t *ql = src;
        const uint8_t *qh = src + 128;
        const int8_t *sc = (const int8_t *)(src + 192);
        const float d = rd_half(src + 208);
        for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32, sc += 8, dst += 128) {
            for (int l = 0; l < 32; l++) {
                const int is = l / 16;
                const int q1 = (int)((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
                dst[l] = d * (float)sc[is] * (float)q1;
                dst[l + 32] = d * (float)sc[is + 2] * (float)q2;
                dst[l + 64] = d * (float)sc[is + 4] * (float)q3;
                dst[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
        }
    }
}

/* Sixteen sub-blocks of 16: x = d (sc_j & 15) q - dmin (sc_j >> 4), q 2-bit. Sub-block pair k
 * (0..7, 32 elements) takes its quants from bits 2 (k % 4) .. 2 (k % 4) + 1 of qs[32 (k / 4) +
 * l], l = 0..31, and scales[2k], scales[2k + 1] for its two halves (dequantize_row_q2_K). */
static void dequant_q2_k(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q2_K_BYTES) {
        const uint8_t *scales = src, *qs = src + 16;
        const float d = rd_half(src + 80), dmin = rd_half(src + 82);
        for (int k = 0; k < 8; k++, dst += 32) {
            const uint8_t *q = qs + 32 * (k / 4);
            const int shift = 2 * (k % 4);
            for (int l = 0; l < 32; l++) {
                const uint8_t sc = scales[2 * k + l / 16];
                const float dl = d * (float)(sc & 0xf), ml = dmin * (float)(sc >> 4);
                dst[l] = dl * (float)((q[l] >> shift) & 3) - ml;
            }
        }
    }
}

/* Scale j (0..15) of a Q3_K block, 6 bits taken signed (- 32): the low 4 bits are the low
 * (j < 8) or high (j >= 8) nibble of scales[j % 8], the top 2 bits bits 2 (j / 4) .. of
 * scales[8 + j % 4] (the aux shuffle of dequantize_row_q3_K). */
static inline int q3_k_scale(const uint8_t *scales, int j)
{
    const int lo = j < 8 ? scales[j] & 0xf : scales[j - 8] >> 4;
    const int hi = (scales[8 + j % 4] >> (2 * (j / 4))) & 3;
    return (lo | (hi << 4)) - 32;
}

/* Sixteen sub-blocks of 16: x = d scale_j q, q in -4..3: the 2 low bits as in Q2_K, and 4
 * subtracted unless bit k of hmask[l] is set (sub-block pair k, element l; dequantize_row_q3_K). */
static void dequant_q3_k(const uint8_t *restrict src, float *restrict dst, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, src += Q3_K_BYTES) {
        const uint8_t *hmask = src, *qs = src + 32, *scales = src + 96;
        const float d = rd_half(src + 108);
        for (int k = 0; k < 8; k++, dst += 32) {
            const uint8_t *q = qs + 32 * (k / 4);
            const int shift = 2 * (k % 4);
            const float dl[2] = {d * (float)q3_k_scale(scales, 2 * k),
                                 d * (float)q3_k_scale(scales, 2 * k + 1)};
            for (int l = 0; l < 32; l++) {
                const int v = ((q[l] >> shift) & 3) - ((hmask[l] >> k) & 1 ? 0 : 4);
                dst[l] = dl[l / 16] * (float)v;
            }
        }
    }
}

/* Checks type and n for a row conversion; returns the number of blocks or a negative code. */
static int64_t row_blocks(tdm_ggml_type_t type, const void *src, const void *dst, int64_t n)
{
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get((uint32_t)type);
    if (!ti || !ti->supported || n < 0 || n % ti->block_size != 0 || (n > 0 && (!src || !dst)))
        return TDM_EINVALID;
    return n / ti->block_size;
}

int tdm_ggml_dequantize_row(tdm_ggml_type_t type, const void *src, float *dst, int64_t n)
{
    const int64_t nb = row_blocks(type, src, dst, n);
    if (nb < 0)
        return (int)nb;
    if (nb == 0)
        return TDM_OK;
    const uint8_t *s = src;
    switch (type) {
    case TDM_GGML_TYPE_F32: memcpy(dst, s, (size_t)n * sizeof(float)); break;
    case TDM_GGML_TYPE_F16: dequant_f16(s, dst, n); break;
    case TDM_GGML_TYPE_BF16: dequant_bf16(s, dst, n); break;
    case TDM_GGML_TYPE_Q4_0: dequant_q4_0(s, dst, nb); break;
    case TDM_GGML_TYPE_Q4_1: dequant_q4_1(s, dst, nb); break;
    case TDM_GGML_TYPE_Q5_0: dequant_q5_0(s, dst, nb); break;
    case TDM_GGML_TYPE_Q5_1: dequant_q5_1(s, dst, nb); break;
    case TDM_GGML_TYPE_Q8_0: dequant_q8_0(s, dst, nb); break;
    case TDM_GGML_TYPE_Q4_K: dequant_q4_k(s, dst, nb); break;
    case TDM_GGML_TYPE_Q5_K: dequant_q5_k(s, dst, nb); break;
    case TDM_GGML_TYPE_Q6_K: dequant_q6_k(s, dst, nb); break;
    case TDM_GGML_TYPE_Q2_K: dequant_q2_k(s, dst, nb); break;
    case TDM_GGML_TYPE_Q3_K: dequant_q3_k(s, dst, nb); break;
    default: return TDM_EINVALID; /* not reached: row_blocks checked `supported` */
    }
    return TDM_OK;
}

/* ---- quantization ---- */

static inline void wr_half(uint8_t *p, float f)
{
    const uint16_t h = tdm_fp32_to_fp16(f);
    memcpy(p, &h, sizeof h);
}

/* Nearest integer (ties to even), clamped to [lo, hi]; NaN gives lo. Safe for any float,
 * unlike a plain cast. */
static inline int clamp_round(float v, int lo, int hi)
{
    if (!(v >= (float)lo))
        return lo;
    if (v >= (float)hi)
        return hi;
    return (int)lrintf(v);
}

/* Truncation toward zero clamped to [lo, hi] (ggml's `(int8_t)(x + 8.5f)` idiom, made safe for
 * out-of-range and NaN input). */
static inline int clamp_trunc(float v, int lo, int hi)
{
    if (!(v >= (float)lo))
        return lo;
    if (v >= (float)hi)
        return hi;
    return (int)v;
}

/* Signed value of largest magnitude (first one on ties) and that magnitude. */
static void abs_max(const float *x, int n, float *max_signed, float *amax)
{
    float m = 0.0f, a = 0.0f;
    for (int j = 0; j < n; j++) {
        const float v = fabsf(x[j]);
        if (a < v) {
            a = v;
            m = x[j];
        }
    }
    *max_signed = m;
    *amax = a;
}

static void min_max(const float *x, int n, float *mn, float *mx)
{
    float lo = x[0], hi = x[0];
    for (int j = 1; j < n; j++) {
        if (x[j] < lo)
            lo = x[j];
        if (x[j] > hi)
            hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

/* quantize_row_q4_0_ref: the signed extreme maps to -8, d = max / -8. */
static void quant_q4_0(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += QK, y += Q4_0_BYTES) {
        float max, amax;
        abs_max(x, QK, &max, &amax);
        const float d = max / -8.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        wr_half(y, d);
        for (int j = 0; j < QK / 2; j++) {
            const int q0 = clamp_trunc(x[j] * id + 8.5f, 0, 15);
            const int q1 = clamp_trunc(x[j + QK / 2] * id + 8.5f, 0, 15);
            y[2 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* quantize_row_q4_1_ref: d = (max - min) / 15, m = min. */
static void quant_q4_1(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += QK, y += Q4_1_BYTES) {
        float mn, mx;
        min_max(x, QK, &mn, &mx);
        const float d = (mx - mn) / 15.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        wr_half(y, d);
        wr_half(y + 2, mn);
        for (int j = 0; j < QK / 2; j++) {
            const int q0 = clamp_trunc((x[j] - mn) * id + 0.5f, 0, 15);
            const int q1 = clamp_trunc((x[j + QK / 2] - mn) * id + 0.5f, 0, 15);
            y[4 + j] = (uint8_t)(q0 | (q1 << 4));
        }
    }
}

/* quantize_row_q5_0_ref: d = max / -16, 5-bit q, 5th bits gathered into qh. */
static void quant_q5_0(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += QK, y += Q5_0_BYTES) {
        float max, amax;
        abs_max(x, QK, &max, &amax);
        const float d = max / -16.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        wr_half(y, d);
        uint32_t qh = 0;
        for (int j = 0; j < QK / 2; j++) {
            const int q0 = clamp_trunc(x[j] * id + 16.5f, 0, 31);
            const int q1 = clamp_trunc(x[j + QK / 2] * id + 16.5f, 0, 31);
            y[6 + j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= ((uint32_t)(q0 & 0x10) >> 4) << j;
            qh |= ((uint32_t)(q1 & 0x10) >> 4) << (j + QK / 2);
        }
        memcpy(y + 2, &qh, sizeof qh);
    }
}

/* quantize_row_q5_1_ref: d = (max - min) / 31, m = min. */
static void quant_q5_1(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += QK, y += Q5_1_BYTES) {
        float mn, mx;
        min_max(x, QK, &mn, &mx);
        const float d = (mx - mn) / 31.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        wr_half(y, d);
        wr_half(y + 2, mn);
        uint32_t qh = 0;
        for (int j = 0; j < QK / 2; j++) {
            const int q0 = clamp_trunc((x[j] - mn) * id + 0.5f, 0, 31);
            const int q1 = clamp_trunc((x[j + QK / 2] - mn) * id + 0.5f, 0, 31);
            y[8 + j] = (uint8_t)((q0 & 0x0f) | ((q1 & 0x0f) << 4));
            qh |= ((uint32_t)(q0 & 0x10) >> 4) << j;
            qh |= ((uint32_t)(q1 & 0x10) >> 4) << (j + QK / 2);
        }
        memcpy(y + 4, &qh, sizeof qh);
    }
}

/* quantize_row_q8_0_ref: d = amax / 127, q = round(x / d) (half away from zero). */
static void quant_q8_0(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += QK, y += Q8_0_BYTES) {
        float max, amax;
        abs_max(x, QK, &max, &amax);
        const float d = amax / 127.0f;
        const float id = d != 0.0f ? 1.0f / d : 0.0f;
        wr_half(y, d);
        for (int j = 0; j < QK; j++) {
            const int8_t q = (int8_t)clamp_trunc(roundf(x[j] * id), -127, 127);
            memcpy(y + 2 + j, &q, 1);
        }
    }
}

/* The smallest half >= v (v >= 0, finite). */
static float half_ceil(float v, uint16_t *h)
{
    uint16_t b = tdm_fp32_to_fp16(v);
    if (tdm_fp16_to_fp32(b) < v && b < 0x7bffu)
        b++;
    *h = b;
    return tdm_fp16_to_fp32(b);
}

/* Packs eight 6-bit scales and mins the way scale_min_k4 unpacks them. */
static void pack_scale_min_k4(uint8_t *q, const uint8_t *ls, const uint8_t *lm)
{
    for (int j = 0; j < 4; j++) {
        q[j] = ls[j];
        q[j + 4] = lm[j];
    }
    for (int j = 4; j < 8; j++) {
        q[j + 4] = (uint8_t)((ls[j] & 0x0f) | ((lm[j] & 0x0f) << 4));
        q[j - 4] |= (uint8_t)((ls[j] >> 4) << 6);
        q[j] |= (uint8_t)((lm[j] >> 4) << 6);
    }
}

/* Quantizes the 32 values x with offset dmin * lm and step d * ls (as dequant_q4_k/q5_k
 * rebuild them) into L[32]; returns the squared error and stores the largest error. */
static float quant_k_sub(const float *x, int nmax, float d, int ls, float dmin, int lm, uint8_t *L,
                         float *max_err)
{
    const float step = d * (float)ls, off = dmin * (float)lm;
    const float istep = step > 0.0f ? 1.0f / step : 0.0f;
    float sse = 0.0f, worst = 0.0f;
    for (int l = 0; l < 32; l++) {
        const int q = clamp_round((x[l] + off) * istep, 0, nmax);
        const float e = fabsf(step * (float)q - off - x[l]);
        L[l] = (uint8_t)q;
        sse += e * e;
        worst = e > worst ? e : worst;
    }
    *max_err = worst;
    return sse;
}

/* Shared by Q4_K (nmax 15) and Q5_K (nmax 31): fills L[256] with quants in 0..nmax, the packed
 * scales and the two super-block halves. First each sub-block of 32 gets an offset
 * m_j >= -min(0, x) (rounded UP to a 6-bit multiple of dmin) and a step s_j rounded UP to a
 * 6-bit multiple of d, so that [-m_j, -m_j + nmax s_j] covers the whole sub-block: nothing is
 * clipped and every element is off by at most s_j / 2 <= (range_j + dmin) / (2 nmax) + d / 2.
 * Then the neighbouring (offset, step) pairs are tried, and the one with the least squared
 * error whose largest error is no worse is kept (a small version of ggml's search). */
static void quant_k_super(const float *x, int nmax, uint8_t *L, uint8_t *scales, uint16_t *d_h,
                          uint16_t *dmin_h)
{
    float mins[8], maxs[8], max_min = 0.0f;
    for (int j = 0; j < 8; j++) {
        min_max(x + 32 * j, 32, &mins[j], &maxs[j]);
        mins[j] = mins[j] < 0.0f ? -mins[j] : 0.0f; /* as ggml: the min offset is never > 0 */
        if (!(mins[j] <= 3.0e38f))
            mins[j] = 0.0f; /* NaN/inf input: give up on the offset rather than poison all */
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    const float dmin = half_ceil(max_min / 63.0f, dmin_h);
    uint8_t lm[8], ls[8];
    float need[8], max_need = 0.0f;
    for (int j = 0; j < 8; j++) {
        lm[j] = (uint8_t)(dmin > 0.0f ? clamp_trunc(ceilf(mins[j] / dmin), 0, 63) : 0);
        need[j] = (maxs[j] + dmin * lm[j]) / (float)nmax;
        if (!(need[j] >= 0.0f && need[j] <= 3.0e38f))
            need[j] = 0.0f;
        if (need[j] > max_need)
            max_need = need[j];
    }
    const float d = half_ceil(max_need / 63.0f, d_h);
    for (int j = 0; j < 8; j++) {
        const float *xj = x + 32 * j;
        uint8_t *Lj = L + 32 * j, cand[32];
        ls[j] = (uint8_t)(d > 0.0f ? clamp_trunc(ceilf(need[j] / d), 0, 63) : 0);
        float limit, err;
        float best = quant_k_sub(xj, nmax, d, ls[j], dmin, lm[j], Lj, &limit);
        const int lm0 = lm[j], ls0 = ls[j];
        for (int m = lm0 > 0 ? lm0 - 1 : 0; m <= lm0; m++) {
            const float nd = (maxs[j] + dmin * (float)m) / (float)nmax;
            const int c = d > 0.0f ? clamp_trunc(ceilf(nd / d), 0, 63) : 0;
            for (int s = c > 0 ? c - 1 : 0; s <= c + 1 && s <= 63; s++) {
                if (m == lm0 && s == ls0)
                    continue;
                const float sse = quant_k_sub(xj, nmax, d, s, dmin, m, cand, &err);
                if (sse < best && err <= limit) {
                    best = sse;
                    lm[j] = (uint8_t)m;
                    ls[j] = (uint8_t)s;
                    memcpy(Lj, cand, sizeof cand);
                }
            }
        }
    }
    memset(scales, 0, 12);
    pack_scale_min_k4(scales, ls, lm);
}

static void quant_q4_k(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += Q4_K_BYTES) {
        uint16_t d, dmin;
        quant_k_super(x, 15, L, y + 4, &d, &dmin);
        memcpy(y, &d, 2);
        memcpy(y + 2, &dmin, 2);
        uint8_t *q = y + 16;
        for (int j = 0; j < QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; l++)
                q[l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 4));
    }
}

static void quant_q5_k(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += Q5_K_BYTES) {
        uint16_t d, dmin;
        quant_k_super(x, 31, L, y + 4, &d, &dmin);
        memcpy(y, &d, 2);
        memcpy(y + 2, &dmin, 2);
        uint8_t *qh = y + 16;
        uint8_t *ql = y + 48;
        memset(qh, 0, 32);
        unsigned m1 = 1, m2 = 2;
        for (int n = 0; n < QK_K; n += 64, ql += 32, m1 <<= 2, m2 <<= 2) {
            for (int j = 0; j < 32; j++) {
                unsigned l1 = L[n + j], l2 = L[n + j + 32];
                if (l1 > 15) {
                    l1 -= 16;
                    qh[j] = (uint8_t)(qh[j] | m1);
                }
                if (l2 > 15) {
                    l2 -= 16;
                    qh[j] = (uint8_t)(qh[j] | m2);
                }
                ql[j] = (uint8_t)(l1 | (l2 << 4));
            }
        }
    }
}

/* Q6_K: each sub-block of 16 gets the signed step s_j = max_j / -32 (its extreme maps to -32,
 * as in ggml's first guess); the steps are stored as int8 multiples of d = max_s / -128 (the
 * largest step maps to -128, as quantize_row_q6_K_ref does); then every element is rounded
 * with its actual step and clamped to -32..31. */
static void quant_q6_k(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    uint8_t L[QK_K];
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += Q6_K_BYTES) {
        float s[16], max_s = 0.0f, max_abs_s = 0.0f;
        for (int j = 0; j < 16; j++) {
            float max, amax;
            abs_max(x + 16 * j, 16, &max, &amax);
            s[j] = max / -32.0f;
            if (!(amax <= 3.0e38f))
                s[j] = 0.0f;
            if (fabsf(s[j]) > max_abs_s) {
                max_abs_s = fabsf(s[j]);
                max_s = s[j];
            }
        }
        uint8_t *ql = y;
        uint8_t *qh = y + 128;
        int8_t sc[16];
        float d = 0.0f;
        if (max_abs_s > 0.0f) {
            const float iscale = -128.0f / max_s;
            d = tdm_fp16_to_fp32(tdm_fp32_to_fp16(1.0f / iscale));
            for (int j = 0; j < 16; j++)
                sc[j] = (int8_t)clamp_round(iscale * s[j], -128, 127);
            wr_half(y + 208, 1.0f / iscale);
        } else {
            memset(sc, 0, sizeof sc);
            wr_half(y + 208, 0.0f);
        }
        memcpy(y + 192, sc, sizeof sc);
        for (int j = 0; j < 16; j++) {
            const float step = d * sc[j];
            const float istep = step != 0.0f ? 1.0f / step : 0.0f;
            for (int l = 0; l < 16; l++)
                L[16 * j + l] = (uint8_t)(clamp_round(x[16 * j + l] * istep, -32, 31) + 32);
        }
        for (int n = 0; n < QK_K; n += 128, ql += 64, qh += 32) {
            for (int l = 0; l < 32; l++) {
                const unsigned q1 = L[n + l], q2 = L[n + l + 32];
                const unsigned q3 = L[n + l + 64], q4 = L[n + l + 96];
                ql[l] = (uint8_t)((q1 & 0x0f) | ((q3 & 0x0f) << 4));
                ql[l + 32] = (uint8_t)((q2 & 0x0f) | ((q4 & 0x0f) << 4));
                qh[l] =
                    (uint8_t)((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6));
            }
        }
    }
}

/* Q2_K: each sub-block of 16 gets an offset m_j = -min(0, min x) and a step s_j = (max x +
 * m_j) / 3 (so [-m_j, -m_j + 3 s_j] covers it); the offsets are stored as 4-bit multiples of
 * dmin = max m / 15 and the steps of d = max s / 15, both rounded UP (half_ceil, then ceil of
 * each multiple) so nothing is clipped; then every element is rounded with its actual step and
 * offset to 0..3. A plain version of quantize_row_q2_K_ref's layout (no make_qkx2 search). */
static void quant_q2_k(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += Q2_K_BYTES) {
        float mins[16], maxs[16], need[16], max_min = 0.0f, max_need = 0.0f;
        for (int j = 0; j < 16; j++) {
            min_max(x + 16 * j, 16, &mins[j], &maxs[j]);
            mins[j] = mins[j] < 0.0f && mins[j] >= -3.0e38f ? -mins[j] : 0.0f;
            need[j] = (maxs[j] + mins[j]) / 3.0f;
            if (!(need[j] >= 0.0f && need[j] <= 3.0e38f))
                need[j] = 0.0f;
            max_min = mins[j] > max_min ? mins[j] : max_min;
            max_need = need[j] > max_need ? need[j] : max_need;
        }
        uint16_t d_h, dmin_h;
        const float dmin = half_ceil(max_min / 15.0f, &dmin_h);
        const float d = half_ceil(max_need / 15.0f, &d_h);
        memcpy(y + 80, &d_h, 2);
        memcpy(y + 82, &dmin_h, 2);
        uint8_t *qs = y + 16;
        memset(qs, 0, 64);
        for (int j = 0; j < 16; j++) {
            const int lm = dmin > 0.0f ? clamp_trunc(ceilf(mins[j] / dmin), 0, 15) : 0;
            const float off = dmin * (float)lm;
            float nd = (maxs[j] + off) / 3.0f;
            nd = nd >= 0.0f && nd <= 3.0e38f ? nd : 0.0f;
            const int ls = d > 0.0f ? clamp_trunc(ceilf(nd / d), 0, 15) : 0;
            y[j] = (uint8_t)(ls | (lm << 4));
            const float step = d * (float)ls, istep = step > 0.0f ? 1.0f / step : 0.0f;
            for (int l = 0; l < 16; l++) {
                const int e = 16 * j + l, k = e / 32;
                const int q = clamp_round((x[e] + off) * istep, 0, 3);
                qs[32 * (k / 4) + e % 32] |= (uint8_t)(q << (2 * (k % 4)));
            }
        }
    }
}

/* Q3_K: each sub-block of 16 gets the signed step s_j = max_j / -4 (its extreme maps to -4);
 * the steps are stored as 6-bit signed multiples (-32..31) of d = max_s / -32 (the largest
 * step maps to -32, as quantize_row_q3_K_ref does), then every element is rounded with its
 * actual step and clamped to -4..3. */
static void quant_q3_k(const float *restrict x, uint8_t *restrict y, int64_t nb)
{
    for (int64_t i = 0; i < nb; i++, x += QK_K, y += Q3_K_BYTES) {
        float s[16], max_s = 0.0f, max_abs_s = 0.0f;
        for (int j = 0; j < 16; j++) {
            float max, amax;
            abs_max(x + 16 * j, 16, &max, &amax);
            s[j] = amax <= 3.0e38f ? max / -4.0f : 0.0f;
            if (fabsf(s[j]) > max_abs_s) {
                max_abs_s = fabsf(s[j]);
                max_s = s[j];
            }
        }
        int sc[16] = {0};
        float d = 0.0f;
        if (max_abs_s > 0.0f) {
            const float iscale = -32.0f / max_s;
            d = tdm_fp16_to_fp32(tdm_fp32_to_fp16(1.0f / iscale));
            for (int j = 0; j < 16; j++)
                sc[j] = clamp_round(iscale * s[j], -32, 31);
        }
        wr_half(y + 108, d);
        uint8_t *hmask = y, *qs = y + 32, *scales = y + 96;
        memset(y, 0, 108);
        for (int j = 0; j < 16; j++) {
            const unsigned u = (unsigned)(sc[j] + 32);
            scales[j % 8] |= (uint8_t)((u & 0xf) << (j < 8 ? 0 : 4));
            scales[8 + j % 4] |= (uint8_t)((u >> 4) << (2 * (j / 4)));
            const float step = d * (float)sc[j], istep = step != 0.0f ? 1.0f / step : 0.0f;
            for (int l = 0; l < 16; l++) {
                const int e = 16 * j + l, k = e / 32, q = clamp_round(x[e] * istep, -4, 3) + 4;
                qs[32 * (k / 4) + e % 32] |= (uint8_t)((q & 3) << (2 * (k % 4)));
                hmask[e % 32] |= (uint8_t)((q >> 2) << k);
            }
        }
    }
}

int tdm_ggml_quantize_row(tdm_ggml_type_t type, const float *src, void *dst, int64_t n)
{
    const int64_t nb = row_blocks(type, src, dst, n);
    if (nb < 0)
        return (int)nb;
    if (nb == 0)
        return TDM_OK;
    uint8_t *y = dst;
    switch (type) {
    case TDM_GGML_TYPE_F32: memcpy(y, src, (size_t)n * sizeof(float)); break;
    case TDM_GGML_TYPE_F16:
        for (int64_t i = 0; i < n; i++)
            wr_half(y + 2 * i, src[i]);
        break;
    case TDM_GGML_TYPE_BF16:
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = tdm_fp32_to_bf16(src[i]);
            memcpy(y + 2 * i, &h, sizeof h);
        }
        break;
    case TDM_GGML_TYPE_Q4_0: quant_q4_0(src, y, nb); break;
    case TDM_GGML_TYPE_Q4_1: quant_q4_1(src, y, nb); break;
    case TDM_GGML_TYPE_Q5_0: quant_q5_0(src, y, nb); break;
    case TDM_GGML_TYPE_Q5_1: quant_q5_1(src, y, nb); break;
    case TDM_GGML_TYPE_Q8_0: quant_q8_0(src, y, nb); break;
    case TDM_GGML_TYPE_Q4_K: quant_q4_k(src, y, nb); break;
    case TDM_GGML_TYPE_Q5_K: quant_q5_k(src, y, nb); break;
    case TDM_GGML_TYPE_Q6_K: quant_q6_k(src, y, nb); break;
    case TDM_GGML_TYPE_Q2_K: quant_q2_k(src, y, nb); break;
    case TDM_GGML_TYPE_Q3_K: quant_q3_k(src, y, nb); break;
    default: return TDM_EINVALID; /* not reached: row_blocks checked `supported` */
    }
    return TDM_OK;
}
