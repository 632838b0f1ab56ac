/* test_cpu_kernels.c - the CPU backend's kernel sets (common/src/model/cpu_kernels.h): every
 * SIMD set this CPU runs gives bitwise the scalar reference's results, for the activation
 * quantizer and for the quantized GEMM of every weight type (Q4_0, Q4_1, Q8_0, Q2_K, Q3_K, Q4_K,
 * Q5_K, Q6_K) on
 * random weights, any number of
 * tokens (1..70) and rows that do not fill the last 8-row group; the reference itself agrees
 * with a double-precision dot product of the dequantized operands. The f32 ops (attention's
 * dots and axpys, grouped-query scores and PV over f16 and q8 cache rows, f16 stores, softmax's
 * exp and sum, SwiGLU) are bitwise equal across sets too, and the shared exp is within 2 ulp of
 * the exact value. */
#include "tdm_test.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "../../common/src/model/cpu_kernels.h"
#include "tandem/base.h"
#include "tandem/gguf.h"

/* splitmix64, for test data */
static uint64_t next_u64(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static float uniform(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * (float)(next_u64(s) >> 40) / (float)(1ull << 24);
}

static bool is_kquant(tdm_ggml_type_t type)
{
    return type == TDM_GGML_TYPE_Q2_K || type == TDM_GGML_TYPE_Q3_K || type == TDM_GGML_TYPE_Q4_K ||
           type == TDM_GGML_TYPE_Q5_K || type == TDM_GGML_TYPE_Q6_K;
}

/* GGUF bytes of a row of nb 32-value blocks (K-quants: nb / 8 super-blocks) */
static size_t row_bytes(tdm_ggml_type_t type, size_t nb)
{
    switch (type) {
    case TDM_GGML_TYPE_Q4_0: return nb * 18;
    case TDM_GGML_TYPE_Q4_1: return nb * 20;
    case TDM_GGML_TYPE_Q4_K: return nb / 8 * 144;
    case TDM_GGML_TYPE_Q5_K: return nb / 8 * 176;
    case TDM_GGML_TYPE_Q6_K: return nb / 8 * 210;
    case TDM_GGML_TYPE_Q2_K: return nb / 8 * 84;
    case TDM_GGML_TYPE_Q3_K: return nb / 8 * 110;
    default: return nb * 34;
    }
}

/* One random K-quant super-block: every byte random but the f16 scales (d in [0.001, 0.05],
 * Q2_K's, Q4_K's and Q5_K's dmin in [0, 0.05]); Q6_K's int8 scales include -128. */
static void random_kquant(tdm_ggml_type_t type, uint8_t *p, uint64_t *seed)
{
    size_t bsz = row_bytes(type, 8);
    for (size_t j = 0; j < bsz; j++)
        p[j] = (uint8_t)next_u64(seed);
    uint16_t d = tdm_fp32_to_fp16(uniform(seed, 0.001f, 0.05f));
    uint16_t m = tdm_fp32_to_fp16(uniform(seed, 0.0f, 0.05f));
    if (type == TDM_GGML_TYPE_Q2_K) {
        memcpy(p + 80, &d, 2);
        memcpy(p + 82, &m, 2);
    } else if (type == TDM_GGML_TYPE_Q3_K) {
        memcpy(p + 108, &d, 2);
    } else if (type != TDM_GGML_TYPE_Q6_K) {
        memcpy(p, &d, 2);
        memcpy(p + 2, &m, 2);
    } else {
        p[192] = 0x80;
        memcpy(p + 208, &d, 2);
    }
}

/* n_out random GGUF rows of nb blocks: scales in [0.001, 0.05], mins in [-0.1, 0.1], every
 * quant byte random (Q8_0 includes -128, the sign trick's edge). Caller frees. */
static uint8_t *random_rows(tdm_ggml_type_t type, uint64_t n_out, size_t nb, uint64_t *seed)
{
    uint8_t *w = malloc(n_out * row_bytes(type, nb));
    assert_non_null(w);
    if (is_kquant(type)) {
        size_t sbsz = row_bytes(type, 8);
        for (size_t b = 0; b < n_out * nb / 8; b++)
            random_kquant(type, w + b * sbsz, seed);
        return w;
    }
    size_t bsz = row_bytes(type, 1);
    for (size_t b = 0; b < n_out * nb; b++) {
        uint8_t *p = w + b * bsz;
        uint16_t d = tdm_fp32_to_fp16(uniform(seed, 0.001f, 0.05f));
        uint16_t m = tdm_fp32_to_fp16(uniform(seed, -0.1f, 0.1f));
        memcpy(p, &d, 2);
        size_t head = 2;
        if (type == TDM_GGML_TYPE_Q4_1) {
            memcpy(p + 2, &m, 2);
            head = 4;
        }
        for (size_t j = head; j < bsz; j++)
            p[j] = (uint8_t)next_u64(seed);
    }
    return w;
}

/* nt tokens of K random activations (some blocks all zero), quantized by the reference. */
static q8a_block_t *random_act(uint32_t nt, size_t K, uint64_t *seed, float *x)
{
    q8a_block_t *a = malloc((size_t)nt * (K / TDM_CPU_QK) * sizeof *a);
    assert_non_null(a);
    for (size_t i = 0; i < (size_t)nt * K; i++)
        x[i] = (i / TDM_CPU_QK) % 7 == 3 ? 0.0f : uniform(seed, -2.0f, 2.0f);
    for (uint32_t t = 0; t < nt; t++)
        tdm_cpu_isa_scalar()->quantize_act(x + (size_t)t * K, K, a + (size_t)t * (K / 32));
    return a;
}

/* The GEMM of isa over w (packed when the set wants it) into out ([nt][n_out]). */
static void run_gemm(const tdm_cpu_isa_t *isa, tdm_ggml_type_t type, const uint8_t *w,
                     uint64_t n_out, size_t nb, const q8a_block_t *a, uint32_t nt, float *out)
{
    tdm_cpu_qmat_t m = {w, row_bytes(type, nb), 8 * row_bytes(type, nb), n_out, nb, false};
    uint8_t *packed = NULL;
    if (isa->packed) {
        packed = malloc(tdm_cpu_pack_bytes(type, n_out, nb));
        assert_non_null(packed);
        tdm_cpu_pack(type, w, n_out, nb, packed);
        m.data = packed;
        m.group_bytes = tdm_cpu_pack_bytes(type, 8, nb);
        m.packed = true;
    }
    /* two calls over the groups, as threads would split them */
    size_t groups = (size_t)(n_out + 7) / 8, half = groups / 2;
    isa->gemm[tdm_cpu_qtype_of(type)](&m, 0, half, a, nt, out, n_out);
    isa->gemm[tdm_cpu_qtype_of(type)](&m, half, groups, a, nt, out, n_out);
    free(packed);
}

/* The reference's output against a double-precision dot of the dequantized operands. */
static void check_reference_close(tdm_ggml_type_t type, const uint8_t *w, uint64_t n_out, size_t nb,
                                  const q8a_block_t *a, uint32_t nt, const float *out)
{
    size_t K = nb * 32;
    float *row = malloc(K * sizeof *row);
    assert_non_null(row);
    for (uint64_t r = 0; r < n_out; r++) {
        assert_int_equal(
            tdm_ggml_dequantize_row(type, w + r * row_bytes(type, nb), row, (int64_t)K), TDM_OK);
        for (uint32_t t = 0; t < nt; t++) {
            double ref = 0.0, mag = 0.0;
            for (size_t i = 0; i < K; i++) {
                const q8a_block_t *ab = &a[(size_t)t * nb + i / 32];
                double av = (double)ab->d * ab->q[i % 32];
                ref += (double)row[i] * av;
                mag += fabs((double)row[i] * av);
            }
            /* tolerance: the f32 accumulation over K and, for Q4_1 / Q4_K, the min term's
             * s = d * sum(q) rounded to f16 (relative 2^-11 of that term) */
            double got = out[(size_t)t * n_out + r];
            assert_true(fabs(got - ref) <= 2e-3 * mag + 1e-6);
        }
    }
    free(row);
}

static void check_type(tdm_ggml_type_t type, const tdm_cpu_isa_t *isa, uint64_t *seed)
{
    static const size_t nbs[] = {1, 3, 18, 48}, knbs[] = {8, 24, 48, 48};
    /* rows: one group (the 8-row path only); 5 groups (16-row pairs and an odd last group);
     * 4 groups whose second 16-row pair has 13 rows (a partial high half) */
    static const uint64_t n_outs[] = {8, 37, 29};
    for (size_t i = 0; i < sizeof nbs / sizeof nbs[0]; i++) {
        size_t nb = is_kquant(type) ? knbs[i] : nbs[i], K = nb * 32;
        for (size_t j = 0; j < sizeof n_outs / sizeof n_outs[0]; j++) {
            uint64_t n_out = n_outs[j];
            uint8_t *w = random_rows(type, n_out, nb, seed);
            float *x = malloc(70 * K * sizeof *x);
            float *ref = malloc(70 * n_out * sizeof *ref), *got = malloc(70 * n_out * sizeof *got);
            float *all = malloc(70 * n_out * sizeof *all);
            assert_true(x && ref && got && all);
            q8a_block_t *a = random_act(70, K, seed, x);
            run_gemm(isa, type, w, n_out, nb, a, 70, all);
            for (uint32_t nt = 1; nt <= 70; nt += nt < 20 ? 1 : 7) {
                run_gemm(tdm_cpu_isa_scalar(), type, w, n_out, nb, a, nt, ref);
                run_gemm(isa, type, w, n_out, nb, a, nt, got);
                assert_memory_equal(got, ref, (size_t)nt * n_out * sizeof *ref);
                /* batch invariance: the first nt tokens' results do not depend on nt */
                assert_memory_equal(got, all, (size_t)nt * n_out * sizeof *ref);
            }
            check_reference_close(type, w, n_out, nb, a, 3, ref);
            free(a);
            free(x);
            free(ref);
            free(got);
            free(all);
            free(w);
        }
    }
}

/* The f32 ops of attention against the scalar reference, bit for bit: dot_f32 and
 * dot_f32_f16 (lengths 1..130: tails past the 8-lane chunks), axpy_f16/axpy_f32, store_f16,
 * and the grouped kernels (scores_f16, pv_f16) against per-pair dot_f32_f16 / axpy_f16 calls
 * for 1..9 heads, 1..21 rows (the 8- and 4-key tiles whose folds put the keys across the lanes,
 * and every ragged tail after them) and head sizes 8..256 (36: a tail). */
static void check_f32_ops(const tdm_cpu_isa_t *isa, uint64_t *seed)
{
    const tdm_cpu_isa_t *ref = tdm_cpu_isa_scalar();
    enum { N = 21 * 256 };
    float *x = malloc(N * sizeof *x), *y = malloc(N * sizeof *y);
    float *o1 = malloc(N * sizeof *o1), *o2 = malloc(N * sizeof *o2);
    uint16_t *h = malloc(N * sizeof *h), *h2 = malloc(N * sizeof *h2);
    assert_true(x && y && o1 && o2 && h && h2);
    for (size_t i = 0; i < N; i++) {
        x[i] = uniform(seed, -2.0f, 2.0f);
        y[i] = uniform(seed, -2.0f, 2.0f);
        h[i] = tdm_fp32_to_fp16(uniform(seed, -3.0f, 3.0f));
    }
    for (size_t n = 1; n <= 130; n++) {
        float a = ref->dot_f32(x, y, n), b = isa->dot_f32(x, y, n);
        assert_memory_equal(&a, &b, sizeof a);
        a = ref->dot_f32_f16(x + 3, h + 1, n);
        b = isa->dot_f32_f16(x + 3, h + 1, n);
        assert_memory_equal(&a, &b, sizeof a);
        memcpy(o1, y, n * sizeof *o1);
        memcpy(o2, y, n * sizeof *o2);
        ref->axpy_f16(o1, 0.3f, h, n);
        isa->axpy_f16(o2, 0.3f, h, n);
        ref->axpy_f32(o1, -1.7f, x, n);
        isa->axpy_f32(o2, -1.7f, x, n);
        assert_memory_equal(o1, o2, n * sizeof *o1);
        ref->store_f16(h2, x, n);
        isa->store_f16(h2 + n, x, n);
        assert_memory_equal(h2, h2 + n, n * sizeof *h2);
    }
    static const size_t dims[] = {8, 16, 36, 64, 128, 256};
    enum { NK = 21 };
    float sc[9 * NK], want[9 * NK];
    for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
        size_t d = dims[di];
        for (uint32_t nh = 1; nh <= 9; nh++) {
            for (uint32_t nk = 1; nk <= NK; nk++) {
                isa->scores_f16(x, nh, h, nk, d, sc, NK);
                for (uint32_t hh = 0; hh < nh; hh++)
                    for (uint32_t j = 0; j < nk; j++)
                        want[hh * NK + j] = ref->dot_f32_f16(x + hh * d, h + j * d, d);
                for (uint32_t hh = 0; hh < nh; hh++)
                    assert_memory_equal(sc + hh * NK, want + hh * NK, nk * sizeof *sc);
                memcpy(o1, y, nh * d * sizeof *o1);
                memcpy(o2, y, nh * d * sizeof *o2);
                isa->pv_f16(o1, nh, x, NK + 2, h, nk, d);
                for (uint32_t hh = 0; hh < nh; hh++)
                    for (uint32_t j = 0; j < nk; j++)
                        ref->axpy_f16(o2 + hh * d, x[hh * (NK + 2) + j], h + j * d, d);
                assert_memory_equal(o1, o2, nh * d * sizeof *o1);
            }
        }
    }
    free(x);
    free(y);
    free(o1);
    free(o2);
    free(h);
    free(h2);
}

/* The q8 cache's grouped kernels (scores_q8, pv_q8) against the reference path they replace:
 * each row dequantized as (float)q * scale, then the scalar set's dot_f32 per (head, key) and
 * axpy_f32 per key in order, bit for bit, for 1..9 heads, 1..21 rows and head sizes 8..256 (36
 * a tail), int8 values over the full range -128..127 (-128 never stored, but the kernels take
 * it) and scales from tiny to large. A set without them (the scalar one) runs the reference
 * path itself: nothing to compare. */
static void check_q8_attn(const tdm_cpu_isa_t *isa, uint64_t *seed)
{
    const tdm_cpu_isa_t *ref = tdm_cpu_isa_scalar();
    if (!isa->scores_q8 && !isa->pv_q8)
        return;
    assert_non_null(isa->scores_q8);
    assert_non_null(isa->pv_q8);
    enum { NK = 21, DMAX = 256, NH = 9 };
    float *q = malloc((NH * DMAX + 8) * sizeof *q), *p = malloc(NH * (NK + 2) * sizeof *p);
    float *o1 = malloc(NH * DMAX * sizeof *o1), *o2 = malloc(NH * DMAX * sizeof *o2);
    float *kd = malloc(NK * DMAX * sizeof *kd);
    int8_t *k = malloc(NK * DMAX);
    assert_true(q && p && o1 && o2 && kd && k);
    for (size_t i = 0; i < NH * DMAX + 8; i++)
        q[i] = uniform(seed, -2.0f, 2.0f);
    for (size_t i = 0; i < NH * (NK + 2); i++)
        p[i] = uniform(seed, 0.0f, 1.0f);
    for (size_t i = 0; i < NK * DMAX; i++)
        k[i] = (int8_t)(next_u64(seed) & 0xff);
    static const size_t dims[] = {8, 16, 36, 64, 128, 256};
    static const float scales[] = {0.0173f, 3.1e-5f, 0.0f, 1.9f};
    float sc[NH * NK], want[NH * NK];
    for (size_t si = 0; si < sizeof scales / sizeof scales[0]; si++) {
        float scale = scales[si];
        for (size_t di = 0; di < sizeof dims / sizeof dims[0]; di++) {
            size_t d = dims[di];
            for (size_t i = 0; i < NK * d; i++)
                kd[i] = (float)k[i] * scale; /* kv_get's dequantization */
            for (uint32_t nh = 1; nh <= NH; nh++) {
                for (uint32_t nk = 1; nk <= NK; nk++) {
                    isa->scores_q8(q, nh, k, scale, nk, d, sc, NK);
                    for (uint32_t hh = 0; hh < nh; hh++)
                        for (uint32_t j = 0; j < nk; j++)
                            want[hh * NK + j] = ref->dot_f32(q + hh * d, kd + j * d, d);
                    for (uint32_t hh = 0; hh < nh; hh++)
                        assert_memory_equal(sc + hh * NK, want + hh * NK, nk * sizeof *sc);
                    memcpy(o1, q + 5, nh * d * sizeof *o1);
                    memcpy(o2, q + 5, nh * d * sizeof *o2);
                    isa->pv_q8(o1, nh, p, NK + 2, k, scale, nk, d);
                    for (uint32_t hh = 0; hh < nh; hh++)
                        for (uint32_t j = 0; j < nk; j++)
                            ref->axpy_f32(o2 + hh * d, p[hh * (NK + 2) + j], kd + j * d, d);
                    assert_memory_equal(o1, o2, nh * d * sizeof *o1);
                }
            }
        }
    }
    free(q);
    free(p);
    free(o1);
    free(o2);
    free(kd);
    free(k);
}

/* Softmax and SwiGLU pieces against the scalar reference, bit for bit: scale_max and exp_sum
 * over lengths 0..200 (the 16-lane chunks and every tail), swiglu over lengths 1..70 with
 * gates from -120 to 120 and the special values (+-0, +-inf, NaN, the exp clamp edges). */
static void check_softmax_ops(const tdm_cpu_isa_t *isa, uint64_t *seed)
{
    const tdm_cpu_isa_t *ref = tdm_cpu_isa_scalar();
    enum { N = 200 };
    float x[N], a[N], b[N], up[N];
    for (size_t i = 0; i < N; i++) {
        x[i] = uniform(seed, -40.0f, 40.0f);
        up[i] = uniform(seed, -3.0f, 3.0f);
    }
    x[17] = NAN; /* never the maximum */
    for (size_t n = 0; n <= N; n++) {
        if (n == N / 2) { /* from here the maximum is a zero: +0 first, then -0 in another lane */
            for (size_t i = 0; i < N; i++)
                x[i] = -fabsf(x[i]) - 1.0f;
            x[17] = NAN;
            x[21] = 0.0f;
            x[40] = -0.0f;
            x[99] = 0.0f;
        }
        memcpy(a, x, sizeof x);
        memcpy(b, x, sizeof x);
        float ma = ref->scale_max(a, n, 0.125f), mb = isa->scale_max(b, n, 0.125f);
        assert_memory_equal(&ma, &mb, sizeof ma);
        assert_memory_equal(a, b, sizeof a);
        a[17] = b[17] = -1.0f; /* softmax inputs are finite */
        double sa = ref->exp_sum(a, n, ma), sb = isa->exp_sum(b, n, mb);
        assert_memory_equal(&sa, &sb, sizeof sa);
        assert_memory_equal(a, b, sizeof a);
    }
    static const float special[] = {0.0f,   -0.0f,  INFINITY, -INFINITY, NAN,    87.0f,  -87.0f,
                                    87.01f, -88.3f, 88.3f,    -88.31f,   88.31f, 1e-30f, -1e-30f};
    float g[N];
    for (size_t i = 0; i < N; i++)
        g[i] = i % 5 == 0 ? special[(i / 5) % (sizeof special / sizeof special[0])]
                          : uniform(seed, -120.0f, 120.0f);
    for (size_t n = 1; n <= 70; n++) {
        ref->swiglu(a, g + 3, up, n);
        isa->swiglu(b, g + 3, up, n);
        assert_memory_equal(a, b, n * sizeof *a);
    }
}

static void check_isa(const tdm_cpu_isa_t *isa)
{
    uint64_t seed0 = 43;
    check_f32_ops(isa, &seed0);
    check_q8_attn(isa, &seed0);
    check_softmax_ops(isa, &seed0);
    uint64_t seed = 42;
    check_type(TDM_GGML_TYPE_Q4_0, isa, &seed);
    check_type(TDM_GGML_TYPE_Q4_1, isa, &seed);
    check_type(TDM_GGML_TYPE_Q8_0, isa, &seed);
    check_type(TDM_GGML_TYPE_Q4_K, isa, &seed);
    check_type(TDM_GGML_TYPE_Q5_K, isa, &seed);
    check_type(TDM_GGML_TYPE_Q6_K, isa, &seed);
    check_type(TDM_GGML_TYPE_Q2_K, isa, &seed);
    check_type(TDM_GGML_TYPE_Q3_K, isa, &seed);
    /* the quantizer: same blocks, bit for bit (isum_lo included) */
    size_t K = 1536;
    float *x = malloc(K * sizeof *x);
    q8a_block_t *ra = malloc(K / 32 * sizeof *ra), *ga = malloc(K / 32 * sizeof *ga);
    assert_true(x && ra && ga);
    for (size_t i = 0; i < K; i++)
        x[i] = i % 97 == 0 ? 0.0f : uniform(&seed, -5.0f, 5.0f);
    memset(ra, 0, K / 32 * sizeof *ra);
    memset(ga, 0, K / 32 * sizeof *ga);
    tdm_cpu_isa_scalar()->quantize_act(x, K, ra);
    isa->quantize_act(x, K, ga);
    assert_memory_equal(ra, ga, K / 32 * sizeof *ra);
    for (size_t b = 0; b < K / 32; b++) {
        int32_t lo = 0;
        for (int j = 0; j < 16; j++)
            lo += ra[b].q[j];
        assert_int_equal(ra[b].isum_lo, lo);
    }
    /* f16 rounding (attention over an f16 cache): magnitudes from subnormal halves to
     * overflow, scaled */
    float *rr = malloc(K * sizeof *rr), *gr = malloc(K * sizeof *gr);
    assert_true(rr && gr);
    for (size_t i = 0; i < K; i++)
        x[i] = uniform(&seed, -1.0f, 1.0f) * ldexpf(1.0f, (int)(i % 48) - 30);
    isa->round_f16(gr, x, 0.37f, K);
    tdm_cpu_isa_scalar()->round_f16(rr, x, 0.37f, K);
    assert_memory_equal(rr, gr, K * sizeof *rr);
    free(rr);
    free(gr);
    free(x);
    free(ra);
    free(ga);
}

static void test_scalar_reference(void **state)
{
    (void)state;
    check_isa(tdm_cpu_isa_scalar());
}

static void test_avx2_bitwise(void **state)
{
    (void)state;
    const tdm_cpu_isa_t *isa = tdm_cpu_isa_avx2();
    if (!isa)
        skip(); /* this CPU has no AVX2 + FMA + F16C */
    check_isa(isa);
}

static void test_vnni_bitwise(void **state)
{
    (void)state;
    const tdm_cpu_isa_t *isa = tdm_cpu_isa_vnni();
    if (!isa)
        skip(); /* this CPU has no AVX-VNNI */
    check_isa(isa);
}

static void test_avx512_bitwise(void **state)
{
    (void)state;
    const tdm_cpu_isa_t *isa = tdm_cpu_isa_avx512();
    if (!isa)
        skip(); /* this CPU has no AVX-512 F/BW/VL + VNNI */
    check_isa(isa);
}

static void test_amx_bitwise(void **state)
{
    (void)state;
    const tdm_cpu_isa_t *isa = tdm_cpu_isa_amx();
    if (!isa)
        skip(); /* this CPU (or kernel) has no AMX-TILE + AMX-INT8 with AVX-512 VNNI */
    check_isa(isa);
}

/* tdm_cpu_expf against exp in double: within 2 ulp on [-87, 88.3] (a sweep of 2^20 points
 * plus the ends), exactly 1 at 0, and the documented special cases. */
static void test_expf_accuracy(void **state)
{
    (void)state;
    double worst = 0.0;
    const int steps = 1 << 20;
    for (int i = 0; i <= steps; i++) {
        float x = TDM_EXP_LO + (TDM_EXP_HI - TDM_EXP_LO) * (float)i / (float)steps;
        double want = exp((double)x);
        float got = tdm_cpu_expf(x);
        double ulp = (double)nextafterf((float)want, INFINITY) - (double)(float)want;
        double err = fabs((double)got - want) / ulp;
        worst = err > worst ? err : worst;
    }
    assert_true(worst <= 2.0);
    assert_true(tdm_cpu_expf(0.0f) == 1.0f && tdm_cpu_expf(-0.0f) == 1.0f);
    assert_true(tdm_cpu_expf(-INFINITY) == 0.0f && tdm_cpu_expf(-87.5f) == 0.0f);
    assert_true(isinf(tdm_cpu_expf(INFINITY)) && isinf(tdm_cpu_expf(88.5f)));
    assert_true(isnan(tdm_cpu_expf(NAN)));
    assert_true(tdm_cpu_expf(TDM_EXP_HI) < INFINITY && tdm_cpu_expf(TDM_EXP_LO) > 0.0f);
}

static void test_pack_layout(void **state)
{
    (void)state;
    /* one Q4_1 block of 3 rows: row r's bytes tagged with r so the interleave is visible */
    uint8_t rows[3][20];
    for (int r = 0; r < 3; r++)
        for (int j = 0; j < 20; j++)
            rows[r][j] = (uint8_t)(16 * r + j);
    uint8_t packed[160];
    assert_int_equal(tdm_cpu_pack_bytes(TDM_GGML_TYPE_Q4_1, 3, 1), 160);
    tdm_cpu_pack(TDM_GGML_TYPE_Q4_1, &rows[0][0], 3, 1, packed);
    assert_int_equal(packed[2], rows[1][0]);      /* d of row 1 */
    assert_int_equal(packed[16 + 5], rows[2][3]); /* m of row 2, high byte */
    /* chunk 1, row 2, byte 3 = nibble byte 4 + 3 of row 2 (GGUF offset 4 + 7) */
    assert_int_equal(packed[32 + 32 * 1 + 4 * 2 + 3], rows[2][4 + 7]);
    assert_int_equal(packed[32 + 4 * 3], 0); /* row 3 is padding */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_scalar_reference), cmocka_unit_test(test_avx2_bitwise),
        cmocka_unit_test(test_vnni_bitwise),     cmocka_unit_test(test_avx512_bitwise),
        cmocka_unit_test(test_amx_bitwise),      cmocka_unit_test(test_pack_layout),
        cmocka_unit_test(test_expf_accuracy),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
