/* test_quant.c - tensor types: geometry, half/bfloat16 conversions, dequantization of
 * hand-built blocks of every supported type, and quantize/dequantize round trips. */
#include "tdm_test.h"

#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/gguf.h"

/* ---- helpers ---- */

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float float_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static void put16(uint8_t *p, uint16_t v)
{
    memcpy(p, &v, sizeof v);
}

/* splitmix64, for test data */
static uint64_t next_u64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float next_uniform(uint64_t *s) /* [-1, 1) */
{
    return (float)(next_u64(s) >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

/* Dequantizes one block from a copy placed at an odd address (checks any-alignment reads) and
 * asserts every element equals expect[] bit for bit. */
static void check_block(tdm_ggml_type_t type, const uint8_t *block, const float *expect)
{
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(type);
    assert_non_null(ti);
    uint8_t *buf = malloc(ti->type_size + 1);
    float *out = malloc(ti->block_size * sizeof *out);
    assert_non_null(buf);
    assert_non_null(out);
    memcpy(buf + 1, block, ti->type_size);
    assert_int_equal(tdm_ggml_dequantize_row(type, buf + 1, out, ti->block_size), TDM_OK);
    for (uint32_t i = 0; i < ti->block_size; i++) {
        if (bits_of(out[i]) != bits_of(expect[i]))
            fail_msg("%s element %u: got %.9g, expected %.9g", ti->name, i, (double)out[i],
                     (double)expect[i]);
    }
    free(out);
    free(buf);
}

/* ---- geometry ---- */

static void test_type_table(void **state)
{
    (void)state;
    static const struct {
        uint32_t type;
        const char *name;
        uint32_t block_size, type_size;
        bool supported;
    } want[] = {
        {TDM_GGML_TYPE_F32, "F32", 1, 4, true},
        {TDM_GGML_TYPE_F16, "F16", 1, 2, true},
        {TDM_GGML_TYPE_Q4_0, "Q4_0", 32, 18, true},
        {TDM_GGML_TYPE_Q4_1, "Q4_1", 32, 20, true},
        {TDM_GGML_TYPE_Q5_0, "Q5_0", 32, 22, true},
        {TDM_GGML_TYPE_Q5_1, "Q5_1", 32, 24, true},
        {TDM_GGML_TYPE_Q8_0, "Q8_0", 32, 34, true},
        {TDM_GGML_TYPE_Q8_1, "Q8_1", 32, 36, false},
        {TDM_GGML_TYPE_Q2_K, "Q2_K", 256, 84, true},
        {TDM_GGML_TYPE_Q3_K, "Q3_K", 256, 110, true},
        {TDM_GGML_TYPE_Q4_K, "Q4_K", 256, 144, true},
        {TDM_GGML_TYPE_Q5_K, "Q5_K", 256, 176, true},
        {TDM_GGML_TYPE_Q6_K, "Q6_K", 256, 210, true},
        {TDM_GGML_TYPE_Q8_K, "Q8_K", 256, 292, false},
        {TDM_GGML_TYPE_BF16, "BF16", 1, 2, true},
        {23, "IQ4_XS", 256, 136, false},
        {20, "IQ4_NL", 32, 18, false},
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(want[i].type);
        assert_non_null(ti);
        assert_string_equal(ti->name, want[i].name);
        assert_int_equal(ti->block_size, want[i].block_size);
        assert_int_equal(ti->type_size, want[i].type_size);
        assert_int_equal(ti->supported, want[i].supported);
    }
    /* retired or never-assigned numbers */
    static const uint32_t unknown[] = {4, 5, 31, 32, 33, 36, 37, 38, 40, 41, 1000, UINT32_MAX};
    for (size_t i = 0; i < sizeof unknown / sizeof unknown[0]; i++)
        assert_null(tdm_ggml_type_get(unknown[i]));
    /* every known type has a sane geometry (the reader divides by block_size) */
    for (uint32_t t = 0; t < TDM_GGML_TYPE_COUNT; t++) {
        const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(t);
        if (ti) {
            assert_true(ti->block_size > 0);
            assert_true(ti->type_size > 0);
        }
    }
}

static void test_row_size(void **state)
{
    (void)state;
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_F32, 10), 40);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_F16, 7), 14);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_BF16, 4096), 8192);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q4_0, 64), 36);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q4_1, 32), 20);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q5_0, 4096), 128 * 22);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q5_1, 96), 72);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q8_0, 576), 18 * 34);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q4_K, 512), 288);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q5_K, 256), 176);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q6_K, 1536), 6 * 210);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q4_0, 0), 0);
    /* not a multiple of the block size, unknown type, overflow */
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q4_0, 33), 0);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_Q6_K, 128), 0);
    assert_int_equal(tdm_ggml_row_size((tdm_ggml_type_t)4, 32), 0);
    assert_int_equal(tdm_ggml_row_size((tdm_ggml_type_t)99, 32), 0);
    assert_int_equal(tdm_ggml_row_size(TDM_GGML_TYPE_F32, UINT64_MAX / 2), 0);
}

/* ---- half and bfloat16 ---- */

static void test_fp16_to_fp32(void **state)
{
    (void)state;
    assert_true(tdm_fp16_to_fp32(0x3c00) == 1.0f);
    assert_true(tdm_fp16_to_fp32(0xc000) == -2.0f);
    assert_true(tdm_fp16_to_fp32(0x3555) == 0x1.554p-2f);
    assert_true(tdm_fp16_to_fp32(0x7bff) == 65504.0f);
    assert_true(tdm_fp16_to_fp32(0x0400) == 0x1p-14f);        /* smallest normal */
    assert_true(tdm_fp16_to_fp32(0x0001) == 0x1p-24f);        /* smallest subnormal */
    assert_true(tdm_fp16_to_fp32(0x03ff) == 1023 * 0x1p-24f); /* largest subnormal */
    assert_true(tdm_fp16_to_fp32(0x8001) == -0x1p-24f);
    assert_int_equal(bits_of(tdm_fp16_to_fp32(0x0000)), 0x00000000u);
    assert_int_equal(bits_of(tdm_fp16_to_fp32(0x8000)), 0x80000000u); /* -0 keeps its sign */
    assert_int_equal(bits_of(tdm_fp16_to_fp32(0x7c00)), 0x7f800000u);
    assert_int_equal(bits_of(tdm_fp16_to_fp32(0xfc00)), 0xff800000u);
    assert_true(isnan(tdm_fp16_to_fp32(0x7e00)));
    assert_true(isnan(tdm_fp16_to_fp32(0x7c01))); /* signalling NaN stays NaN */
    assert_true(isnan(tdm_fp16_to_fp32(0xffff)));
    /* every half: value = (-1)^s 2^(e-15) (1 + m/1024), or m 2^-24 when e = 0 */
    for (uint32_t h = 0; h < 0x10000; h++) {
        const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
        if (e == 0x1f)
            continue;
        const double mag = e == 0 ? m * 0x1p-24 : ldexp(1.0 + m / 1024.0, (int)e - 15);
        const double want = (h & 0x8000) ? -mag : mag;
        const float got = tdm_fp16_to_fp32((uint16_t)h);
        if ((double)got != want || !!signbit(got) != !!(h & 0x8000))
            fail_msg("half 0x%04x: got %a, want %a", h, (double)got, want);
    }
}

/* Reference conversion: the nearest half (ties to the even mantissa), found by search over
 * the exact values of all finite halves of the right sign. */
static uint16_t ref_fp32_to_fp16(float f)
{
    if (isnan(f))
        return 0x7e00;
    const uint16_t sign = signbit(f) ? 0x8000 : 0;
    const double a = fabs((double)f);
    if (a >= 65520.0) /* halfway between 65504 and 2^16: ties go to the even one, inf */
        return sign | 0x7c00;
    uint32_t lo = 0, hi = 0x7bff; /* largest half <= a by binary search over ordered bits */
    while (lo < hi) {
        const uint32_t mid = (lo + hi + 1) / 2;
        if ((double)tdm_fp16_to_fp32((uint16_t)mid) <= a)
            lo = mid;
        else
            hi = mid - 1;
    }
    if (lo == 0x7bff)
        return sign | 0x7bff;
    const double below = tdm_fp16_to_fp32((uint16_t)lo);
    const double above = tdm_fp16_to_fp32((uint16_t)(lo + 1));
    uint16_t r;
    if (a - below < above - a)
        r = (uint16_t)lo;
    else if (a - below > above - a)
        r = (uint16_t)(lo + 1);
    else
        r = (uint16_t)((lo & 1) ? lo + 1 : lo);
    return sign | r;
}

static void test_fp32_to_fp16(void **state)
{
    (void)state;
    assert_int_equal(tdm_fp32_to_fp16(1.0f), 0x3c00);
    assert_int_equal(tdm_fp32_to_fp16(-2.0f), 0xc000);
    assert_int_equal(tdm_fp32_to_fp16(0.0f), 0x0000);
    assert_int_equal(tdm_fp32_to_fp16(-0.0f), 0x8000);
    assert_int_equal(tdm_fp32_to_fp16(65504.0f), 0x7bff);
    assert_int_equal(tdm_fp32_to_fp16(65519.996f), 0x7bff); /* just below the tie */
    assert_int_equal(tdm_fp32_to_fp16(65520.0f), 0x7c00);   /* tie rounds to even: inf */
    assert_int_equal(tdm_fp32_to_fp16(1e9f), 0x7c00);
    assert_int_equal(tdm_fp32_to_fp16(-1e9f), 0xfc00);
    assert_int_equal(tdm_fp32_to_fp16(INFINITY), 0x7c00);
    assert_int_equal(tdm_fp32_to_fp16(-INFINITY), 0xfc00);
    /* ties to even in the normal range: 1 + 2^-11 lies halfway between 0x3c00 and 0x3c01 */
    assert_int_equal(tdm_fp32_to_fp16(1.0f + 0x1p-11f), 0x3c00);
    assert_int_equal(tdm_fp32_to_fp16(1.0f + 3 * 0x1p-11f), 0x3c02);
    assert_int_equal(tdm_fp32_to_fp16(1.0f + 0x1p-11f + 0x1p-20f), 0x3c01);
    /* subnormals: 2^-24 is the unit */
    assert_int_equal(tdm_fp32_to_fp16(0x1p-24f), 0x0001);
    assert_int_equal(tdm_fp32_to_fp16(0x1p-25f), 0x0000);        /* tie: to even (0) */
    assert_int_equal(tdm_fp32_to_fp16(0x1.8p-24f), 0x0002);      /* tie: to even (2) */
    assert_int_equal(tdm_fp32_to_fp16(0x1.000002p-25f), 0x0001); /* just above the tie */
    assert_int_equal(tdm_fp32_to_fp16(1023 * 0x1p-24f), 0x03ff);
    assert_int_equal(tdm_fp32_to_fp16(1023.5f * 0x1p-24f), 0x0400); /* rounds up to normal */
    assert_int_equal(tdm_fp32_to_fp16(-0x1p-24f), 0x8001);
    assert_int_equal(tdm_fp32_to_fp16(1e-10f), 0x0000);
    assert_int_equal(tdm_fp32_to_fp16(-1e-10f), 0x8000);
    assert_int_equal(tdm_fp32_to_fp16(0x1p-149f), 0x0000); /* float subnormal */
    /* NaN stays NaN, whatever its payload */
    const uint16_t n1 = tdm_fp32_to_fp16(NAN);
    const uint16_t n2 = tdm_fp32_to_fp16(float_of(0x7f800001u)); /* payload below bit 13 */
    const uint16_t n3 = tdm_fp32_to_fp16(float_of(0xffc00000u));
    assert_true((n1 & 0x7c00) == 0x7c00 && (n1 & 0x3ff) != 0);
    assert_true((n2 & 0x7c00) == 0x7c00 && (n2 & 0x3ff) != 0);
    assert_true((n3 & 0x7c00) == 0x7c00 && (n3 & 0x3ff) != 0 && (n3 & 0x8000));

    /* every half converts back to itself */
    for (uint32_t h = 0; h < 0x10000; h++) {
        const float f = tdm_fp16_to_fp32((uint16_t)h);
        if (isnan(f))
            continue;
        assert_int_equal(tdm_fp32_to_fp16(f), h);
    }
    /* every midpoint between adjacent positive halves rounds to the even one, and the floats
     * just either side of it to the nearer one */
    for (uint32_t h = 0; h < 0x7bff; h++) {
        const float lo = tdm_fp16_to_fp32((uint16_t)h), hi = tdm_fp16_to_fp32((uint16_t)(h + 1));
        const float mid = (float)(((double)lo + (double)hi) / 2); /* exact in float */
        assert_int_equal(tdm_fp32_to_fp16(mid), (h & 1) ? h + 1 : h);
        assert_int_equal(tdm_fp32_to_fp16(nextafterf(mid, 0.0f)), h);
        assert_int_equal(tdm_fp32_to_fp16(nextafterf(mid, INFINITY)), h + 1);
    }
    /* random floats against the reference (all exponents, many near the half range) */
    uint64_t s = 7;
    for (int i = 0; i < 200000; i++) {
        uint32_t u = (uint32_t)next_u64(&s);
        if (i & 1) /* bias toward exponents 100..150 where the half range is */
            u = (u & 0x807fffffu) | ((100u + (u >> 23) % 50u) << 23);
        const float f = float_of(u);
        if (isnan(f))
            continue;
        const uint16_t got = tdm_fp32_to_fp16(f), want = ref_fp32_to_fp16(f);
        if (got != want)
            fail_msg("fp32 %a (0x%08x): got 0x%04x, want 0x%04x", (double)f, u, got, want);
    }
}

static void test_bf16(void **state)
{
    (void)state;
    assert_true(tdm_bf16_to_fp32(0x3f80) == 1.0f);
    assert_true(tdm_bf16_to_fp32(0xc040) == -3.0f);
    assert_int_equal(bits_of(tdm_bf16_to_fp32(0x8000)), 0x80000000u);
    assert_int_equal(bits_of(tdm_bf16_to_fp32(0x7f80)), 0x7f800000u);
    assert_int_equal(bits_of(tdm_bf16_to_fp32(0x0001)), 0x00010000u); /* subnormal */
    assert_true(isnan(tdm_bf16_to_fp32(0x7fc1)));

    assert_int_equal(tdm_fp32_to_bf16(1.0f), 0x3f80);
    assert_int_equal(tdm_fp32_to_bf16(-0.0f), 0x8000);
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x3f808000u)), 0x3f80); /* tie: to even */
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x3f818000u)), 0x3f82); /* tie: to even */
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x3f808001u)), 0x3f81);
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x3f807fffu)), 0x3f80);
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x7f7fffffu)), 0x7f80); /* FLT_MAX: inf */
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x7f7f7fffu)), 0x7f7f);
    assert_int_equal(tdm_fp32_to_bf16(INFINITY), 0x7f80);
    assert_int_equal(tdm_fp32_to_bf16(-INFINITY), 0xff80);
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x00008000u)), 0x0000); /* subnormal tie */
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x00018000u)), 0x0002);
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x00008001u)), 0x0001);
    assert_int_equal(tdm_fp32_to_bf16(float_of(0x807fffffu)), 0x8080); /* up to -2^-126 */
    /* NaN never becomes inf, even when only low payload bits are set */
    const uint16_t n = tdm_fp32_to_bf16(float_of(0x7f800001u));
    assert_true((n & 0x7f80) == 0x7f80 && (n & 0x7f) != 0);
    assert_true(isnan(tdm_bf16_to_fp32(tdm_fp32_to_bf16(float_of(0xffffffffu)))));
    /* every bfloat16 converts back to itself */
    for (uint32_t h = 0; h < 0x10000; h++) {
        const float f = tdm_bf16_to_fp32((uint16_t)h);
        if (!isnan(f))
            assert_int_equal(tdm_fp32_to_bf16(f), h);
    }
}

/* ---- hand-built blocks ---- */

static void test_dequant_float_rows(void **state)
{
    (void)state;
    uint8_t buf[1 + 3 * 4];
    const float in[3] = {1.5f, -0.0f, 3.0e-42f};
    memcpy(buf + 1, in, sizeof in);
    float out[3];
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_F32, buf + 1, out, 3), TDM_OK);
    assert_memory_equal(out, in, sizeof in);

    put16(buf + 1, 0x3c00);
    put16(buf + 3, 0x8001);
    put16(buf + 5, 0xfc00);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_F16, buf + 1, out, 3), TDM_OK);
    assert_true(out[0] == 1.0f && out[1] == -0x1p-24f && isinf(out[2]) && out[2] < 0);

    put16(buf + 1, 0x3f80);
    put16(buf + 3, 0xc2f7);
    put16(buf + 5, 0x0001);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_BF16, buf + 1, out, 3), TDM_OK);
    assert_true(out[0] == 1.0f && out[1] == -123.5f);
    assert_int_equal(bits_of(out[2]), 0x00010000u);
}

static void test_dequant_q4_0(void **state)
{
    (void)state;
    uint8_t b[18];
    float want[32];
    put16(b, 0x3800); /* d = 0.5 */
    for (int j = 0; j < 16; j++) {
        b[2 + j] = (uint8_t)(j | ((15 - j) << 4)); /* low nibble: element j; high: j + 16 */
        want[j] = (float)(j - 8) * 0.5f;
        want[j + 16] = (float)(7 - j) * 0.5f;
    }
    check_block(TDM_GGML_TYPE_Q4_0, b, want);
    /* spot values written out: element 0 = (0-8)/2, 15 = 3.5, 16 = 3.5, 31 = -4 */
    assert_true(want[0] == -4.0f && want[15] == 3.5f && want[16] == 3.5f && want[31] == -4.0f);
}

static void test_dequant_q4_1(void **state)
{
    (void)state;
    uint8_t b[20];
    float want[32];
    put16(b, 0x3400);     /* d = 0.25 */
    put16(b + 2, 0xbc00); /* m = -1 */
    for (int j = 0; j < 16; j++) {
        const int lo = (j * 5) & 15, hi = (j * 3 + 1) & 15;
        b[4 + j] = (uint8_t)(lo | (hi << 4));
        want[j] = (float)lo * 0.25f - 1.0f;
        want[j + 16] = (float)hi * 0.25f - 1.0f;
    }
    check_block(TDM_GGML_TYPE_Q4_1, b, want);
}

/* Q5_0 / Q5_1: bit i of the little-endian u32 qh is the 5th bit of element i. */
static void test_dequant_q5(void **state)
{
    (void)state;
    const uint8_t qh[4] = {0x0f, 0xf0, 0xa5, 0x5a}; /* u32 0x5aa5f00f */
    const uint32_t qh32 = 0x5aa5f00fu;
    uint8_t b0[22], b1[24];
    float want0[32], want1[32];
    put16(b0, 0x4000);     /* Q5_0 d = 2 */
    put16(b1, 0x3800);     /* Q5_1 d = 0.5 */
    put16(b1 + 2, 0x4200); /* Q5_1 m = 3 */
    memcpy(b0 + 2, qh, 4);
    memcpy(b1 + 4, qh, 4);
    for (int j = 0; j < 16; j++) {
        const int lo = (j * 7 + 2) & 15, hi = (15 - j) & 15;
        b0[6 + j] = b1[8 + j] = (uint8_t)(lo | (hi << 4));
        const int q_lo = lo | (int)((qh32 >> j) & 1) << 4;
        const int q_hi = hi | (int)((qh32 >> (j + 16)) & 1) << 4;
        want0[j] = (float)(q_lo - 16) * 2.0f;
        want0[j + 16] = (float)(q_hi - 16) * 2.0f;
        want1[j] = (float)q_lo * 0.5f + 3.0f;
        want1[j + 16] = (float)q_hi * 0.5f + 3.0f;
    }
    check_block(TDM_GGML_TYPE_Q5_0, b0, want0);
    check_block(TDM_GGML_TYPE_Q5_1, b1, want1);
    /* written out: element 0 has lo nibble 2 and qh bit 0 = 1 -> q 18 -> (18-16)*2 = 4 */
    assert_true(want0[0] == 4.0f);
    /* element 16: hi nibble 15, qh bit 16 = 1 (0xa5 bit 0) -> q 31 -> 30 */
    assert_true(want0[16] == 30.0f);
}

static void test_dequant_q8_0(void **state)
{
    (void)state;
    uint8_t b[34];
    float want[32];
    put16(b, 0x3000); /* d = 0.125 */
    for (int j = 0; j < 32; j++) {
        const int8_t q = (int8_t)(j * 8 - 128); /* -128 .. 120 */
        memcpy(b + 2 + j, &q, 1);
        want[j] = (float)q * 0.125f;
    }
    check_block(TDM_GGML_TYPE_Q8_0, b, want);
    assert_true(want[0] == -16.0f && want[31] == 15.0f);
}

/* Packs 6-bit scales ls[8] and mins lm[8] into the 12 bytes of Q4_K/Q5_K (ggml-common.h):
 * bytes 0-3: ls[0..3] | (ls[4..7] >> 4) << 6; bytes 4-7: lm[0..3] | (lm[4..7] >> 4) << 6;
 * bytes 8-11: (ls[4..7] & 15) | (lm[4..7] & 15) << 4. */
static void pack_k_scales(uint8_t *q, const uint8_t *ls, const uint8_t *lm)
{
    for (int j = 0; j < 4; j++) {
        q[j] = (uint8_t)(ls[j] | ((ls[j + 4] >> 4) << 6));
        q[j + 4] = (uint8_t)(lm[j] | ((lm[j + 4] >> 4) << 6));
        q[j + 8] = (uint8_t)((ls[j + 4] & 15) | ((lm[j + 4] & 15) << 4));
    }
}

static const uint8_t k_ls[8] = {1, 10, 63, 5, 33, 17, 48, 62};
static const uint8_t k_lm[8] = {0, 7, 12, 63, 40, 3, 21, 16};

static void test_dequant_q4_k(void **state)
{
    (void)state;
    uint8_t b[144];
    float want[256];
    put16(b, 0x3800);     /* d = 0.5 */
    put16(b + 2, 0x3400); /* dmin = 0.25 */
    pack_k_scales(b + 4, k_ls, k_lm);
    /* sub-blocks 2k and 2k+1 share qs[32k .. 32k+31]: low nibbles the first, high the second */
    int q[256];
    for (int e = 0; e < 256; e++)
        q[e] = (e * 11 + e / 32) & 15;
    for (int k = 0; k < 4; k++)
        for (int l = 0; l < 32; l++)
            b[16 + 32 * k + l] = (uint8_t)(q[64 * k + l] | (q[64 * k + 32 + l] << 4));
    for (int e = 0; e < 256; e++)
        want[e] = (float)(0.5 * k_ls[e / 32] * q[e] - 0.25 * k_lm[e / 32]);
    check_block(TDM_GGML_TYPE_Q4_K, b, want);
    /* written out: element 0: q 0, scale 1, min 0 -> 0; element 255: sub-block 7 (scale 62,
     * min 16), q = (255*11 + 7) & 15 = 12 -> 0.5*62*12 - 0.25*16 = 368 */
    assert_true(want[0] == 0.0f && want[255] == 368.0f);
}

static void test_dequant_q5_k(void **state)
{
    (void)state;
    uint8_t b[176];
    float want[256];
    put16(b, 0x3c00);     /* d = 1 */
    put16(b + 2, 0x3800); /* dmin = 0.5 */
    pack_k_scales(b + 4, k_ls, k_lm);
    int q[256];
    for (int e = 0; e < 256; e++)
        q[e] = (e * 13 + 5) & 31;
    memset(b + 16, 0, 32);
    /* element 64k + l (first of pair k) has its 5th bit in bit 2k of qh[l]; 64k + 32 + l in
     * bit 2k+1; low 4 bits as in Q4_K */
    for (int k = 0; k < 4; k++) {
        for (int l = 0; l < 32; l++) {
            const int a = q[64 * k + l], c = q[64 * k + 32 + l];
            b[16 + l] |= (uint8_t)(((a >> 4) << (2 * k)) | ((c >> 4) << (2 * k + 1)));
            b[48 + 32 * k + l] = (uint8_t)((a & 15) | ((c & 15) << 4));
        }
    }
    for (int e = 0; e < 256; e++)
        want[e] = (float)(1.0 * k_ls[e / 32] * q[e] - 0.5 * k_lm[e / 32]);
    check_block(TDM_GGML_TYPE_Q5_K, b, want);
}

static void test_dequant_q6_k(void **state)
{
    (void)state;
    uint8_t b[210];
    float want[256];
    const int8_t sc[16] = {1, -1, 2, -2, 3, 7, -8, 16, 127, -128, 64, -64, 0, 5, 9, -3};
    int q[256];
    for (int e = 0; e < 256; e++)
        q[e] = (e * 37 + 11) & 63;
    memset(b, 0, sizeof b);
    /* element e: half h = e / 128, quarter t = (e % 128) / 32, l = e % 32. Low 4 bits in
     * ql[64h + l + 32 (t & 1)] (low nibble for t < 2, high for t >= 2); top 2 bits in bits
     * 2t, 2t+1 of qh[32h + l]; scale sc[e / 16]; x = d sc (q - 32). */
    for (int e = 0; e < 256; e++) {
        const int h = e / 128, t = (e % 128) / 32, l = e % 32;
        uint8_t *ql = &b[64 * h + l + 32 * (t & 1)];
        *ql |= (uint8_t)((q[e] & 15) << (t >= 2 ? 4 : 0));
        b[128 + 32 * h + l] |= (uint8_t)((q[e] >> 4) << (2 * t));
    }
    memcpy(b + 192, sc, 16);
    put16(b + 208, 0x3800); /* d = 0.5 */
    for (int e = 0; e < 256; e++)
        want[e] = (float)(0.5 * sc[e / 16] * (q[e] - 32));
    check_block(TDM_GGML_TYPE_Q6_K, b, want);
    /* written out: element 0: q 11, scale 1 -> 0.5 * (11 - 32) = -10.5 */
    assert_true(want[0] == -10.5f);
}

/* Bytes from a hex string of exactly 2 n digits; false when it is not one. */
static bool unhex(const char *h, uint8_t *out, size_t n)
{
    if (!h || strlen(h) != 2 * n)
        return false;
    for (size_t i = 0; i < n; i++) {
        unsigned v;
        if (sscanf(h + 2 * i, "%2x", &v) != 1)
            return false;
        out[i] = (uint8_t)v;
    }
    return true;
}

/* Q2_K and Q3_K against llama.cpp's own dequantize_row_q2_K / q3_K, bit for bit: 16 blocks of
 * each (8 of random bytes, 8 from quantize_row_q*_K_ref) in tests/golden/kquant_dequant.json
 * (tests/golden/make_kquant_golden.py). Tandem's quantizer's blocks of the same data also come
 * back within their error bound (test_round_trip). */
static void test_dequant_kquant_llama(void **state)
{
    (void)state;
    json_error_t jerr;
    json_t *root = json_load_file(TDM_SOURCE_DIR "/tests/golden/kquant_dequant.json", 0, &jerr);
    if (!root)
        fail_msg("kquant_dequant.json:%d: %s", jerr.line, jerr.text);
    json_t *types = json_object_get(root, "types"), *ty;
    size_t i, n_types = 0;
    json_array_foreach(types, i, ty)
    {
        const char *name = json_string_value(json_object_get(ty, "type"));
        tdm_ggml_type_t t = strcmp(name, "Q2_K") == 0 ? TDM_GGML_TYPE_Q2_K : TDM_GGML_TYPE_Q3_K;
        size_t bsz = tdm_ggml_type_get(t)->type_size, j, n_cases = 0;
        assert_int_equal(json_integer_value(json_object_get(ty, "block_bytes")), bsz);
        json_t *c;
        json_array_foreach(json_object_get(ty, "cases"), j, c)
        {
            uint8_t blk[128];
            float want[256], got[256];
            assert_true(unhex(json_string_value(json_object_get(c, "block")), blk, bsz));
            assert_true(unhex(json_string_value(json_object_get(c, "values_f32le")),
                              (uint8_t *)want, sizeof want));
            assert_int_equal(tdm_ggml_dequantize_row(t, blk, got, 256), TDM_OK);
            if (memcmp(got, want, sizeof want) != 0)
                for (int e = 0; e < 256; e++)
                    if (memcmp(&got[e], &want[e], sizeof(float)) != 0)
                        fail_msg("%s block %zu element %d: %.9g, llama.cpp %.9g", name, j, e,
                                 (double)got[e], (double)want[e]);
            n_cases++;
        }
        assert_int_equal(n_cases, 16);
        n_types++;
    }
    assert_int_equal(n_types, 2);
    json_decref(root);
}

/* Several blocks in one row, at an odd address: each block is decoded from its own bytes. */
static void test_dequant_multi_block(void **state)
{
    (void)state;
    uint8_t *buf = malloc(1 + 3 * 34);
    float out[96];
    assert_non_null(buf);
    for (int i = 0; i < 3; i++) {
        uint8_t *blk = buf + 1 + 34 * i;
        put16(blk, tdm_fp32_to_fp16((float)(i + 1)));
        for (int j = 0; j < 32; j++)
            blk[2 + j] = (uint8_t)j;
    }
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q8_0, buf + 1, out, 96), TDM_OK);
    for (int i = 0; i < 96; i++)
        assert_true(out[i] == (float)((i / 32 + 1) * (i % 32)));
    free(buf);
}

static void test_unsupported(void **state)
{
    (void)state;
    uint8_t src[512] = {0};
    float dst[256];
    static const int bad_types[] = {
        TDM_GGML_TYPE_Q8_1, TDM_GGML_TYPE_Q8_K, 4, 16, 23, 39, 40, 200, -1};
    for (size_t i = 0; i < sizeof bad_types / sizeof bad_types[0]; i++) {
        const tdm_ggml_type_t t = (tdm_ggml_type_t)bad_types[i];
        assert_int_equal(tdm_ggml_dequantize_row(t, src, dst, 256), TDM_EINVALID);
        assert_int_equal(tdm_ggml_quantize_row(t, dst, src, 256), TDM_EINVALID);
    }
    /* bad n */
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q4_0, src, dst, 31), TDM_EINVALID);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q4_K, src, dst, 32), TDM_EINVALID);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_F32, src, dst, -1), TDM_EINVALID);
    assert_int_equal(tdm_ggml_quantize_row(TDM_GGML_TYPE_Q8_0, dst, src, 48), TDM_EINVALID);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q8_0, NULL, dst, 32), TDM_EINVALID);
    /* an empty row is fine */
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q6_K, src, dst, 0), TDM_OK);
    assert_int_equal(tdm_ggml_quantize_row(TDM_GGML_TYPE_Q6_K, dst, src, 0), TDM_OK);
}

/* ---- round trips ---- */

static const tdm_ggml_type_t supported_types[] = {
    TDM_GGML_TYPE_F32,  TDM_GGML_TYPE_F16,  TDM_GGML_TYPE_BF16, TDM_GGML_TYPE_Q4_0,
    TDM_GGML_TYPE_Q4_1, TDM_GGML_TYPE_Q5_0, TDM_GGML_TYPE_Q5_1, TDM_GGML_TYPE_Q8_0,
    TDM_GGML_TYPE_Q4_K, TDM_GGML_TYPE_Q5_K, TDM_GGML_TYPE_Q6_K, TDM_GGML_TYPE_Q2_K,
    TDM_GGML_TYPE_Q3_K,
};

/* The most a round trip may move element i of x (a row of n), from the block it is in. */
static float error_bound(tdm_ggml_type_t t, const float *x, int64_t n, int64_t i)
{
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(t);
    const int64_t b0 = i / ti->block_size * ti->block_size;
    float mn = x[b0], mx = x[b0], amax = 0.0f;
    for (int64_t j = b0; j < b0 + ti->block_size && j < n; j++) {
        mn = fminf(mn, x[j]);
        mx = fmaxf(mx, x[j]);
        amax = fmaxf(amax, fabsf(x[j]));
    }
    const float lo0 = fminf(mn, 0.0f);
    const float tiny = 1e-6f * amax + 1e-30f;
    switch (t) {
    case TDM_GGML_TYPE_F32: return 0.0f;
    case TDM_GGML_TYPE_F16: return fabsf(x[i]) * 0x1p-11f + 0x1p-25f;
    case TDM_GGML_TYPE_BF16: return fabsf(x[i]) * 0x1p-8f;
    /* d = max / -8: at most one step (the top value clips from 8 to 7), plus fp16 rounding */
    case TDM_GGML_TYPE_Q4_0: return amax / 8 * 1.01f + tiny;
    case TDM_GGML_TYPE_Q5_0: return amax / 16 * 1.01f + tiny;
    /* d = (max - min) / levels: half a step, plus fp16 rounding of d and m */
    case TDM_GGML_TYPE_Q4_1: return (mx - mn) / 15 * 0.51f + fabsf(mn) * 0x1p-10f + tiny;
    case TDM_GGML_TYPE_Q5_1: return (mx - mn) / 31 * 0.51f + fabsf(mn) * 0x1p-10f + tiny;
    case TDM_GGML_TYPE_Q8_0: return amax / 127 * 0.51f + amax * 0x1p-10f + tiny;
    /* K-quants: half a step, the step covering the sub-block's range plus one min unit
     * (dmin = largest offset / 63); bounded using the super-block's range */
    case TDM_GGML_TYPE_Q4_K: return ((mx - lo0) + -lo0 / 63) / 15 * 0.55f + tiny;
    case TDM_GGML_TYPE_Q5_K: return ((mx - lo0) + -lo0 / 63) / 31 * 0.55f + tiny;
    case TDM_GGML_TYPE_Q6_K: return amax / 32 * 1.2f + tiny;
    /* Q2_K: half a step of 4 levels over the sub-block's range plus a min unit (dmin = largest
     * offset / 15), with room for the 4-bit step's clip; Q3_K: as Q6_K with 8 levels */
    case TDM_GGML_TYPE_Q2_K: return ((mx - lo0) + -lo0 / 15) / 3 * 0.75f + tiny;
    case TDM_GGML_TYPE_Q3_K: return amax / 4 * 1.2f + tiny;
    default: return 0.0f;
    }
}

/* Quantizes rows of several shapes of random data and checks each element's error and the
 * row's relative RMS error. */
static void test_round_trip(void **state)
{
    (void)state;
    enum { N = 1024 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    uint8_t *q = malloc(tdm_ggml_row_size(TDM_GGML_TYPE_F32, N) + 1);
    assert_true(x && y && q);
    uint64_t s = 12345;
    for (size_t ti = 0; ti < sizeof supported_types / sizeof supported_types[0]; ti++) {
        const tdm_ggml_type_t t = supported_types[ti];
        const char *name = tdm_ggml_type_get(t)->name;
        double worst_rel_rms = 0.0;
        for (int shape = 0; shape < 6; shape++) {
            for (int i = 0; i < N; i++) {
                float v = next_uniform(&s);
                switch (shape) {
                case 0: break;                                           /* uniform [-1, 1) */
                case 1: v = v * 0.02f; break;                            /* weight-sized */
                case 2: v = v * 0.5f + 3.0f; break;                      /* all positive */
                case 3: v = v * 0.5f - 3.0f; break;                      /* all negative */
                case 4: v = (i % 97 == 0) ? 8.0f * v : v * 0.01f; break; /* outliers */
                case 5: v = v * (float)(1 << (i / 64 % 8)); break;       /* scale per block */
                }
                x[i] = v;
            }
            assert_int_equal(tdm_ggml_quantize_row(t, x, q + 1, N), TDM_OK);
            assert_int_equal(tdm_ggml_dequantize_row(t, q + 1, y, N), TDM_OK);
            double se = 0.0, sx = 0.0;
            for (int i = 0; i < N; i++) {
                const float err = fabsf(y[i] - x[i]);
                const float bound = error_bound(t, x, N, i);
                if (!(err <= bound))
                    fail_msg("%s shape %d element %d: x %.7g -> %.7g, error %.3g > bound %.3g",
                             name, shape, i, (double)x[i], (double)y[i], (double)err,
                             (double)bound);
                se += (double)err * err;
                sx += (double)x[i] * x[i];
            }
            const double rel = sqrt(se / sx);
            if (rel > worst_rel_rms)
                worst_rel_rms = rel;
        }
        /* relative RMS error over the uniform-ish shapes; loose but catches a wrong layout */
        static const struct {
            tdm_ggml_type_t t;
            double max;
        } rms_max[] = {
            {TDM_GGML_TYPE_F32, 0.0},   {TDM_GGML_TYPE_F16, 1e-3},  {TDM_GGML_TYPE_BF16, 4e-3},
            {TDM_GGML_TYPE_Q8_0, 0.01}, {TDM_GGML_TYPE_Q6_K, 0.02}, {TDM_GGML_TYPE_Q5_0, 0.04},
            {TDM_GGML_TYPE_Q5_1, 0.04}, {TDM_GGML_TYPE_Q5_K, 0.04}, {TDM_GGML_TYPE_Q4_0, 0.08},
            {TDM_GGML_TYPE_Q4_1, 0.08}, {TDM_GGML_TYPE_Q4_K, 0.08}, {TDM_GGML_TYPE_Q3_K, 0.25},
            {TDM_GGML_TYPE_Q2_K, 0.35},
        };
        for (size_t k = 0; k < sizeof rms_max / sizeof rms_max[0]; k++)
            if (rms_max[k].t == t && worst_rel_rms > rms_max[k].max)
                fail_msg("%s: relative RMS error %.4g > %.4g", name, worst_rel_rms, rms_max[k].max);
        print_message("round trip %-5s worst relative RMS error %.5f\n", name, worst_rel_rms);
    }
    free(q);
    free(y);
    free(x);
}

/* Values already on a block's grid come back exactly (the reference quantizers pick the
 * grid the data came from). */
static void test_round_trip_exact(void **state)
{
    (void)state;
    float x[32], y[32];
    uint8_t q[34];
    /* Q8_0: amax 127 * 0.25 gives d = 0.25 */
    for (int j = 0; j < 32; j++)
        x[j] = (float)((j * 37) % 255 - 127) * 0.25f;
    x[5] = -127 * 0.25f;
    assert_int_equal(tdm_ggml_quantize_row(TDM_GGML_TYPE_Q8_0, x, q, 32), TDM_OK);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q8_0, q, y, 32), TDM_OK);
    assert_memory_equal(x, y, sizeof x);
    /* Q4_0: the extreme -8 d gives d exactly */
    for (int j = 0; j < 32; j++)
        x[j] = (float)(j % 16 - 8) * 0.5f;
    assert_int_equal(tdm_ggml_quantize_row(TDM_GGML_TYPE_Q4_0, x, q, 32), TDM_OK);
    assert_int_equal(q[0] | q[1] << 8, 0x3800); /* d = max / -8 = -4 / -8 = 0.5 */
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q4_0, q, y, 32), TDM_OK);
    assert_memory_equal(x, y, sizeof x);
    /* Q4_1: min -1, max 2.75, d 0.25 */
    for (int j = 0; j < 32; j++)
        x[j] = (float)(j % 16) * 0.25f - 1.0f;
    assert_int_equal(tdm_ggml_quantize_row(TDM_GGML_TYPE_Q4_1, x, q, 32), TDM_OK);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q4_1, q, y, 32), TDM_OK);
    assert_memory_equal(x, y, sizeof x);
    /* Q5_0 / Q5_1 */
    for (int j = 0; j < 32; j++)
        x[j] = (float)(j - 16) * 0.125f;
    assert_int_equal(tdm_ggml_quantize_row(TDM_GGML_TYPE_Q5_0, x, q, 32), TDM_OK);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q5_0, q, y, 32), TDM_OK);
    assert_memory_equal(x, y, sizeof x);
    for (int j = 0; j < 32; j++)
        x[j] = (float)((j * 7) % 32) * 0.5f + 1.0f;
    assert_int_equal(tdm_ggml_quantize_row(TDM_GGML_TYPE_Q5_1, x, q, 32), TDM_OK);
    assert_int_equal(tdm_ggml_dequantize_row(TDM_GGML_TYPE_Q5_1, q, y, 32), TDM_OK);
    assert_memory_equal(x, y, sizeof x);
}

/* Zeros, constants, NaN and inf must not crash (UBSan checks the casts); zeros stay zeros. */
static void test_quantize_degenerate(void **state)
{
    (void)state;
    float x[256], y[256];
    uint8_t q[1024];
    for (size_t ti = 0; ti < sizeof supported_types / sizeof supported_types[0]; ti++) {
        const tdm_ggml_type_t t = supported_types[ti];
        memset(x, 0, sizeof x);
        assert_int_equal(tdm_ggml_quantize_row(t, x, q, 256), TDM_OK);
        assert_int_equal(tdm_ggml_dequantize_row(t, q, y, 256), TDM_OK);
        for (int i = 0; i < 256; i++)
            assert_true(y[i] == 0.0f);
        for (int i = 0; i < 256; i++)
            x[i] = 0.75f;
        assert_int_equal(tdm_ggml_quantize_row(t, x, q, 256), TDM_OK);
        assert_int_equal(tdm_ggml_dequantize_row(t, q, y, 256), TDM_OK);
        for (int i = 0; i < 256; i++)
            assert_true(fabsf(y[i] - 0.75f) <= 0.75f / 8);
        for (int i = 0; i < 256; i++)
            x[i] = i % 3 == 0 ? NAN : i % 3 == 1 ? INFINITY : -1e30f;
        assert_int_equal(tdm_ggml_quantize_row(t, x, q, 256), TDM_OK);
        assert_int_equal(tdm_ggml_dequantize_row(t, q, y, 256), TDM_OK);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_type_table),
        cmocka_unit_test(test_row_size),
        cmocka_unit_test(test_fp16_to_fp32),
        cmocka_unit_test(test_fp32_to_fp16),
        cmocka_unit_test(test_bf16),
        cmocka_unit_test(test_dequant_float_rows),
        cmocka_unit_test(test_dequant_q4_0),
        cmocka_unit_test(test_dequant_q4_1),
        cmocka_unit_test(test_dequant_q5),
        cmocka_unit_test(test_dequant_q8_0),
        cmocka_unit_test(test_dequant_q4_k),
        cmocka_unit_test(test_dequant_q5_k),
        cmocka_unit_test(test_dequant_q6_k),
        cmocka_unit_test(test_dequant_kquant_llama),
        cmocka_unit_test(test_dequant_multi_block),
        cmocka_unit_test(test_unsupported),
        cmocka_unit_test(test_round_trip),
        cmocka_unit_test(test_round_trip_exact),
        cmocka_unit_test(test_quantize_degenerate),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
