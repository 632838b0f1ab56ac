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

/* ---- the packed layout (cpu_kernels.h) ---- */

static size_t pack_block_bytes(tdm_ggml_type_t type)
{
    return type == TDM_GGML_TYPE_Q4_1 ? 160 : type == TDM_GGML_TYPE_Q4_0 ? 144 : 272;
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

void tdm_cpu_pack(tdm_ggml_type_t type, const uint8_t *src, uint64_t n_out, size_t nb, uint8_t *dst)
{
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

static float dot_f32_scalar(const float *x, const float *y, size_t n)
{
    float acc = 0.0f;
    for (size_t i = 0; i < n; i++)
        acc += x[i] * y[i];
    return acc;
}

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
        out[b].d = tdm_cpu_round_fp16(d);
        out[b].s = tdm_cpu_round_fp16(d * (float)sum);
        out[b].isum = sum;
    }
}

static void axpy_f32_scalar(float *out, float p, const float *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        out[i] += p * v[i];
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

static const tdm_cpu_isa_t isa_scalar = {
    .name = "scalar",
    .quantize_act = quantize_act_scalar,
    .dot_f32 = dot_f32_scalar,
    .axpy_f32 = axpy_f32_scalar,
    .store_f16 = store_f16_scalar,
    .round_f16 = round_f16_scalar,
    .gemm = {dot_q4_0_scalar_gemm, dot_q4_1_scalar_gemm, dot_q8_0_scalar_gemm},
};

const tdm_cpu_isa_t *tdm_cpu_isa_scalar(void)
{
    return &isa_scalar;
}
