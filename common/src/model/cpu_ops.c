/* cpu_ops.c - the CPU backend's ops written in plain C, one code for every kernel set:
 * embedding, RMSNorm, bias, RoPE, the element-wise ops (SwiGLU, GeGLU, scale, add), row
 * gathers and reads. */
#include <math.h>
#include <pthread.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "model/cpu_internal.h"

int tdm_cpu_embed(void *vbe, const tdm_weight_t *emb, const int32_t *tokens, uint32_t n, float *x)
{
    cpu_be_t *be = vbe;
    size_t E = emb->n_in;
    int rc = TDM_OK;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (n * E >= be->par_min)
    for (uint32_t t = 0; t < n; t++) {
        const uint8_t *row = (const uint8_t *)emb->data + (size_t)tokens[t] * emb->row_bytes;
        if (tdm_ggml_dequantize_row(emb->type, row, x + t * E, (int64_t)E) != TDM_OK) {
#pragma omp atomic write
            rc = TDM_EINVALID;
        }
    }
    return rc;
}

int tdm_cpu_rmsnorm(void *vbe, const float *x, const tdm_weight_t *w, uint32_t n, float eps,
                    float *out)
{
    cpu_be_t *be = vbe;
    size_t E = w->n_in;
    if (w->type != TDM_GGML_TYPE_F32)
        return TDM_EINVALID;
    const float *g = w->data;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (n * E >= be->par_min)
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

int tdm_cpu_add_bias(void *vbe, float *x, const tdm_weight_t *b, uint32_t n)
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
 * the power taken iteratively in f32 (ggml_rope's theta_scale), divided by frequency factor i
 * when the model has them (Llama 3.x; Phi-3's long or short set by the engine's context:
 * tdm_llama_rope_factors), cos and sin times the attention factor (ggml's rope_yarn mscale; 1
 * leaves them as they are), pairs (2i, 2i+1) for the normal mode and (i, i + rope_dim/2) for
 * neox. Dimensions past rope_dim are unchanged. */
int tdm_cpu_rope(void *vbe, uint32_t layer, float *q, float *k, const tdm_fwd_rows_t *rows)
{
    cpu_be_t *be = vbe;
    const tdm_llama_hparams_t *hp = be->hp;
    uint32_t half = hp->rope_dim / 2, D = hp->head_dim;
    float freq_base, freq_scale; /* linear scaling multiplies each angle (ggml's rope_yarn) */
    tdm_llama_layer_rope(hp, layer, &freq_base, &freq_scale);
    float theta_scale = powf(freq_base, -2.0f / (float)hp->rope_dim);
    bool neox = hp->rope_type == TDM_ROPE_NEOX;
    const float *ff = tdm_llama_rope_factors(hp, be->n_ctx);
    const float mscale = hp->rope_attn_factor;
    size_t rope_values = (size_t)rows->n * (hp->n_heads + hp->n_kv_heads) * D;
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (rope_values >= be->par_min)
    for (uint32_t t = 0; t < rows->n; t++) {
        float *cs = be->rope_cs + (size_t)t * hp->rope_dim;
        float theta = (float)rows->pos[t];
        for (uint32_t i = 0; i < half; i++) {
            float th = ff ? theta / ff[i] : theta;
            cs[2 * i] = cosf(th * freq_scale) * mscale;
            cs[2 * i + 1] = sinf(th * freq_scale) * mscale;
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

/* Element-wise ops go to the threads in chunks of this many values, from par_min values on. */
#define TDM_ELEMWISE_CHUNK 4096

/* GELU with the tanh approximation as ggml_gelu_f32 spells it, in f32 with libm's tanhf. */
static float gelu_tanh(float x)
{
    const float sqrt_2_over_pi = 0.79788456080286535587989211986876f, coef_a = 0.044715f;
    return 0.5f * x * (1.0f + tanhf(sqrt_2_over_pi * x * (1.0f + coef_a * x * x)));
}

/* GeGLU rounds like llama.cpp's CPU backend (ggml_vec_geglu_f32 under GGML_GELU_FP16), so that
 * the two engines round alike, as attention does: gelu(x) is looked up by x rounded to f16 in
 * a table of f16-rounded values, x itself for x >= 10 and 0 for x <= -10. One table for every
 * kernel family: the bits do not depend on the set. Built once (65,536 floats). */
static float gelu_f16_table[65536];
static pthread_once_t gelu_f16_once = PTHREAD_ONCE_INIT;

static void gelu_f16_table_init(void)
{
    for (uint32_t i = 0; i < 65536; i++)
        gelu_f16_table[i] =
            tdm_fp16_to_fp32(tdm_fp32_to_fp16(gelu_tanh(tdm_fp16_to_fp32((uint16_t)i))));
}

static inline float gelu_f16(float x)
{
    if (x <= -10.0f)
        return 0.0f;
    if (x >= 10.0f)
        return x;
    return gelu_f16_table[tdm_fp32_to_fp16(x)];
}

typedef enum elem_op { ELEM_SWIGLU, ELEM_GEGLU, ELEM_SCALE, ELEM_ADD } elem_op_t;

/* Values [i, i + m) of an element-wise op: out = act(a) * b (SwiGLU, GeGLU), out = a * s,
 * out = a + b (out may be a). */
static void elem_chunk(const cpu_be_t *be, elem_op_t op, float *out, const float *a, const float *b,
                       float s, size_t i, size_t m)
{
    out += i, a += i, b = b ? b + i : NULL;
    switch (op) {
    case ELEM_SWIGLU: be->isa->swiglu(out, a, b, m); break;
    case ELEM_GEGLU:
        for (size_t j = 0; j < m; j++)
            out[j] = gelu_f16(a[j]) * b[j];
        break;
    case ELEM_SCALE:
        for (size_t j = 0; j < m; j++)
            out[j] = a[j] * s;
        break;
    case ELEM_ADD:
        for (size_t j = 0; j < m; j++)
            out[j] = a[j] + b[j];
        break;
    }
}

/* An element-wise op over count values, split among the threads in chunks of
 * TDM_ELEMWISE_CHUNK from par_min values on (which thread computes a value never changes it). */
static int cpu_elementwise(cpu_be_t *be, elem_op_t op, float *out, const float *a, const float *b,
                           float s, size_t count)
{
    int64_t n_chunks = (int64_t)((count + TDM_ELEMWISE_CHUNK - 1) / TDM_ELEMWISE_CHUNK);
#pragma omp parallel for schedule(static) num_threads(be->n_threads) if (count >= be->par_min)
    for (int64_t c = 0; c < n_chunks; c++) {
        size_t i = (size_t)c * TDM_ELEMWISE_CHUNK;
        elem_chunk(be, op, out, a, b, s, i,
                   count - i < TDM_ELEMWISE_CHUNK ? count - i : TDM_ELEMWISE_CHUNK);
    }
    return TDM_OK;
}

int tdm_cpu_swiglu(void *vbe, const float *gate, const float *up, size_t count, float *out)
{
    return cpu_elementwise(vbe, ELEM_SWIGLU, out, gate, up, 0.0f, count);
}

int tdm_cpu_geglu(void *vbe, const float *gate, const float *up, size_t count, float *out)
{
    pthread_once(&gelu_f16_once, gelu_f16_table_init);
    return cpu_elementwise(vbe, ELEM_GEGLU, out, gate, up, 0.0f, count);
}

int tdm_cpu_scale(void *vbe, float *x, float s, size_t count)
{
    return cpu_elementwise(vbe, ELEM_SCALE, x, x, NULL, s, count);
}

int tdm_cpu_add(void *vbe, float *x, const float *y, size_t count)
{
    return cpu_elementwise(vbe, ELEM_ADD, x, x, y, 0.0f, count);
}

int tdm_cpu_gather_rows(void *vbe, const float *src, const uint32_t *rows, uint32_t n, uint32_t dim,
                        float *dst)
{
    (void)vbe;
    for (uint32_t k = 0; k < n; k++)
        memcpy(dst + (size_t)k * dim, src + (size_t)rows[k] * dim, dim * sizeof(float));
    return TDM_OK;
}

int tdm_cpu_read(void *vbe, const float *src, size_t count, float *host_dst)
{
    (void)vbe;
    memcpy(host_dst, src, count * sizeof(float));
    return TDM_OK;
}
