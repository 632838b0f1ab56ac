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

#define TDM_DOTS(name)                                                                             \
    {                                                                                              \
        {                                                                                          \
            name##_1, name##_2, name##_3, name##_4                                                 \
        }                                                                                          \
    }

static const tdm_cpu_isa_t isa_scalar = {
    .name = "scalar",
    .quantize_act = quantize_act_scalar,
    .dot_f32 = dot_f32_scalar,
    .axpy_f32 = axpy_f32_scalar,
    .store_f16 = store_f16_scalar,
    .dot = {TDM_DOTS(dot_q4_0_scalar), TDM_DOTS(dot_q4_1_scalar), TDM_DOTS(dot_q8_0_scalar)},
};

const tdm_cpu_isa_t *tdm_cpu_isa_scalar(void)
{
    return &isa_scalar;
}
