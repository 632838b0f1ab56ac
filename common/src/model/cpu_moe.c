/* cpu_moe.c - the CPU backend's mixture-of-experts FFN: route, group the rows by expert, one
 * batched GEMM per expert, scatter back weighted.
 *
 * The computation is llama.cpp's build_moe_ffn for qwen3moe and Mixtral (src/llama-graph.cpp:
 * softmax gating, top n_expert_used, the chosen probabilities renormalised with the sum clamped
 * to 2^-14, each expert's SwiGLU output multiplied by its weight, the k products added in
 * top-k order); backend.h's moe_ffn states it. Routing is per row on the calling thread; the
 * experts' matrices go through the same matmul driver as the dense projections (cpu_matmul.c:
 * quantized activations, repacked weights), each over only the rows routed to it.
 *
 * Batch invariance: a row's router logits, its expert choice and weights depend on that row
 * alone; each expert GEMM computes an output row from its input row only, by the same code
 * whatever the other rows (cpu.c), so gathering a row next to other tokens' rows does not
 * change its bits; and a row's k expert outputs are summed in its top-k order. So the result
 * does not depend on what else is in the batch.
 */
#include <math.h>
#include <omp.h>
#include <string.h>

#include "model/cpu_internal.h"

/* The experts' scratch; R = max_rows, k = n_expert_used, X = n_expert, E = n_embd,
 * F = n_ff_exp. */
typedef struct cpu_moe_scratch {
    float *probs;    /* [R][X] router logits, then probabilities */
    float *weight;   /* [R][k] the chosen experts' weights */
    uint32_t *sel;   /* [R][k] the chosen experts, in top-k order */
    uint32_t *slot;  /* [R][k] the row of (t, j) in the grouped buffers */
    uint32_t *start; /* [X + 1] first grouped row of each expert */
    uint32_t *fill;  /* [X] rows placed so far */
    float *xg;       /* [R k][E] input rows grouped by expert, in row order */
    float *gate;     /* [R k][F] */
    float *up;       /* [R k][F] */
    float *y;        /* [R k][E] each (row, expert) pair's output, unweighted: xg's memory
                        (every expert's gate and up GEMMs have read xg before the first down
                        GEMM writes y) */
} cpu_moe_scratch_t;

int tdm_cpu_moe_scratch_new(cpu_be_t *be, tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = be->hp;
    if (hp->n_expert == 0)
        return TDM_OK;
    size_t R = be->max_rows, K = hp->n_expert_used, X = hp->n_expert, E = hp->n_embd,
           F = hp->n_ff_exp, f = sizeof(float);
    cpu_moe_scratch_t *s =
        (cpu_moe_scratch_t *)tdm_model_backend_cpu.alloc(be, (sizeof *s + f) / f);
    if (!s)
        goto out_of_memory;
    /* the index arrays are as many u32 as floats: one cpu_alloc size fits both */
    if (!(s->probs = tdm_model_backend_cpu.alloc(be, R * X)) ||
        !(s->weight = tdm_model_backend_cpu.alloc(be, R * K)) ||
        !(s->sel = (uint32_t *)tdm_model_backend_cpu.alloc(be, R * K)) ||
        !(s->slot = (uint32_t *)tdm_model_backend_cpu.alloc(be, R * K)) ||
        !(s->start = (uint32_t *)tdm_model_backend_cpu.alloc(be, X + 1)) ||
        !(s->fill = (uint32_t *)tdm_model_backend_cpu.alloc(be, X)) ||
        !(s->xg = tdm_model_backend_cpu.alloc(be, R * K * E)) ||
        !(s->gate = tdm_model_backend_cpu.alloc(be, R * K * F)) ||
        !(s->up = tdm_model_backend_cpu.alloc(be, R * K * F)))
        goto out_of_memory;
    s->y = s->xg;
    be->moe = s;
    return TDM_OK;
out_of_memory: /* cpu_destroy frees what was allocated */
    return tdm_error_set(err, TDM_ERESOURCE,
                         "out of memory allocating the experts' scratch (%zu rows x %zu experts)",
                         R, K);
}

/* Row t's routing from its router logits p[0..X) (overwritten by the probabilities):
 * ggml_soft_max's f32 softmax (max subtracted, expf, the sum in double, scaled by its
 * reciprocal), the k largest in descending order (ties to the lower index), their
 * probabilities divided by their sum clamped to 2^-14 (ggml_sum_rows, ggml_clamp, ggml_div). */
static void moe_route_row(float *p, uint32_t X, uint32_t k, uint32_t *sel, float *weight)
{
    float max = p[0];
    for (uint32_t i = 1; i < X; i++)
        max = p[i] > max ? p[i] : max;
    double sum = 0.0;
    for (uint32_t i = 0; i < X; i++) {
        p[i] = expf(p[i] - max);
        sum += (double)p[i];
    }
    const float inv = (float)(1.0 / sum);
    for (uint32_t i = 0; i < X; i++)
        p[i] *= inv;
    for (uint32_t j = 0; j < k; j++) { /* selection: k is small */
        uint32_t best = UINT32_MAX;
        for (uint32_t i = 0; i < X; i++) {
            bool taken = false;
            for (uint32_t q = 0; q < j && !taken; q++)
                taken = sel[q] == i;
            if (!taken && (best == UINT32_MAX || p[i] > p[best]))
                best = i;
        }
        sel[j] = best;
    }
    double wsum = 0.0;
    for (uint32_t j = 0; j < k; j++)
        wsum += (double)p[sel[j]];
    float div = (float)wsum < 6.103515625e-5f ? 6.103515625e-5f : (float)wsum;
    for (uint32_t j = 0; j < k; j++)
        weight[j] = p[sel[j]] / div;
}

/* Routes the n rows and groups them: s->start per expert, s->slot of each (row, choice), and
 * the input rows copied to s->xg in expert order (within an expert, in row order). */
static void moe_group(cpu_be_t *be, cpu_moe_scratch_t *s, const float *x, uint32_t n)
{
    const uint32_t X = be->hp->n_expert, k = be->hp->n_expert_used;
    const size_t E = be->hp->n_embd;
    memset(s->start, 0, (X + 1) * sizeof *s->start);
    for (uint32_t t = 0; t < n; t++) {
        moe_route_row(s->probs + (size_t)t * X, X, k, s->sel + (size_t)t * k,
                      s->weight + (size_t)t * k);
        for (uint32_t j = 0; j < k; j++)
            s->start[s->sel[(size_t)t * k + j] + 1]++;
    }
    for (uint32_t e = 0; e < X; e++) {
        s->start[e + 1] += s->start[e];
        s->fill[e] = 0;
    }
    for (uint32_t t = 0; t < n; t++)
        for (uint32_t j = 0; j < k; j++) {
            uint32_t e = s->sel[(size_t)t * k + j], r = s->start[e] + s->fill[e]++;
            s->slot[(size_t)t * k + j] = r;
            memcpy(s->xg + (size_t)r * E, x + (size_t)t * E, E * sizeof *x);
        }
}

/* out[t] = sum over j of weight[t][j] * y[slot[t][j]], each product rounded to f32 and added
 * in top-k order (ggml_mul then the chain of ggml_add in build_moe_ffn). */
static void moe_scatter(cpu_be_t *be, const cpu_moe_scratch_t *s, uint32_t n, float *out)
{
    const uint32_t k = be->hp->n_expert_used;
    const size_t E = be->hp->n_embd;
#pragma omp parallel for schedule(static)                                                          \
    num_threads(be->n_threads) if ((size_t)n * k * E >= be->par_min)
    for (uint32_t t = 0; t < n; t++) {
        float *o = out + (size_t)t * E;
        const float *w = s->weight + (size_t)t * k;
        const uint32_t *slot = s->slot + (size_t)t * k;
        const float *y0 = s->y + (size_t)slot[0] * E;
        for (size_t i = 0; i < E; i++)
            o[i] = y0[i] * w[0];
        for (uint32_t j = 1; j < k; j++) {
            const float *yj = s->y + (size_t)slot[j] * E;
            for (size_t i = 0; i < E; i++)
                o[i] = o[i] + yj[i] * w[j];
        }
    }
}

int tdm_cpu_moe_ffn(void *vbe, uint32_t layer, const float *x, uint32_t n, float *out)
{
    cpu_be_t *be = vbe;
    cpu_moe_scratch_t *s = be->moe;
    const tdm_llama_hparams_t *hp = be->hp;
    const tdm_layer_weights_t *lw = tdm_model_layer(be->model, layer);
    const uint32_t X = hp->n_expert, k = hp->n_expert_used;
    const size_t E = hp->n_embd, F = hp->n_ff_exp;
    if (!s || n > be->max_rows)
        return TDM_EINTERNAL;
    const tdm_weight_t *router[1] = {&lw->gate_inp};
    float *probs[1] = {s->probs};
    int rc = tdm_cpu_matmul(be, x, n, 1, router, probs);
    if (rc != TDM_OK)
        return rc;
    moe_group(be, s, x, n);
    for (uint32_t e = 0; e < X && rc == TDM_OK; e++) {
        uint32_t r0 = s->start[e], c = s->start[e + 1] - r0;
        if (c == 0)
            continue;
        const tdm_weight_t *gu[2] = {&lw->exps[3 * (size_t)e], &lw->exps[3 * (size_t)e + 1]};
        float *gu_out[2] = {s->gate + (size_t)r0 * F, s->up + (size_t)r0 * F};
        rc = tdm_cpu_matmul(be, s->xg + (size_t)r0 * E, c, 2, gu, gu_out);
    }
    size_t rows = (size_t)n * k;
    if (rc == TDM_OK)
        rc = tdm_cpu_swiglu(be, s->gate, s->up, rows * F, s->gate);
    for (uint32_t e = 0; e < X && rc == TDM_OK; e++) {
        uint32_t r0 = s->start[e], c = s->start[e + 1] - r0;
        if (c == 0)
            continue;
        const tdm_weight_t *down[1] = {&lw->exps[3 * (size_t)e + 2]};
        float *down_out[1] = {s->y + (size_t)r0 * E};
        rc = tdm_cpu_matmul(be, s->gate + (size_t)r0 * F, c, 1, down, down_out);
    }
    if (rc != TDM_OK)
        return rc;
    moe_scatter(be, s, n, out);
    return TDM_OK;
}
