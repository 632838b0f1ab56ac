/* cpu_matmul.c - the CPU backend's matmul driver: activations quantized once per call, the
 * weights' rows split among the threads, tokens taken in tiles.
 *
 * Matmuls with Q4_0, Q4_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K weights (and Q5_0, rewritten as
 * Q8_0 at load) quantize each activation row to 8 bits in blocks of 32 (scale d = max|x| / 127 kept
 * at f16 precision, as ggml's Q8_0/Q8_1 activations) once per call and run a q8a GEMM. The SIMD
 * sets repack each weight once, at load, into groups of 8 interleaved rows, and a
 * micro-kernel keeps 8 rows x up to 8 tokens of accumulators in registers across the K loop;
 * the scalar set reads the GGUF rows in place. The other weight types (F32, F16, BF16, Q5_1;
 * K-quants too under TANDEM_CPU_KERNELS=f32k) take the f32 path: dequantized a row at a time
 * into per-thread scratch and dotted in f32 (dot_f32). Threads split the rows into chunks of
 * 16; each chunk goes over the tokens in tiles of 64 so its weights stay in L1: batched decode
 * costs little more weight traffic than one token.
 *
 * Batch invariance and same bits on every CPU: cpu.c. */
#include <omp.h>
#include <stdint.h>

#include "model/cpu_internal.h"

#define TOKEN_TILE 64 /* tokens per pass over a weight row tile */

/* AVX-512: rows [r0, r1) of wk against tokens [t0, t1) from the prepared activations. */
static void matmul_rows_zdot(cpu_be_t *be, const cpu_wkernel_t *wk, uint64_t r0, uint64_t r1,
                             uint32_t t0, uint32_t t1, float *o)
{
#ifdef TDM_X86
    size_t nb = wk->m.nb, zs = tdm_cpu_zact_stride(nb);
    const tdm_weight_t *W = wk->w;
    uint8_t *prep = be->zprep + (size_t)omp_get_thread_num() * tdm_cpu_zprep_stride(nb);
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *wr = wk->m.data + r * W->row_bytes;
        if (t1 - t0 == 1 && nb <= TDM_ZMAX_BLOCKS) {
            o[(size_t)t0 * W->n_out + r] =
                tdm_cpu_zdot_fused1(W->type, wr, nb, be->zact + (size_t)t0 * zs);
            continue;
        }
        tdm_cpu_zrow_prep(W->type, wr, nb, prep);
        for (uint32_t t = t0; t < t1; t += 8) {
            int nt = t1 - t < 8 ? (int)(t1 - t) : 8;
            const uint8_t *tok[8];
            float y[8];
            for (int j = 0; j < nt; j++)
                tok[j] = be->zact + (size_t)(t + (uint32_t)j) * zs;
            tdm_cpu_zdot(prep, nb, tok, y, nt);
            for (int j = 0; j < nt; j++)
                o[(size_t)(t + (uint32_t)j) * W->n_out + r] = y[j];
        }
    }
#else
    (void)be, (void)wk, (void)r0, (void)r1, (void)t0, (void)t1, (void)o;
#endif
}

/* Other types: rows [r0, r1) dequantized to f32 one at a time, dotted with tokens [t0, t1). */
static int matmul_rows_f32(cpu_be_t *be, const tdm_weight_t *W, const float *x, uint64_t r0,
                           uint64_t r1, uint32_t t0, uint32_t t1, float *o)
{
    size_t K = W->n_in;
    float *wrow = be->wrow + (size_t)omp_get_thread_num() * be->max_in;
    for (uint64_t r = r0; r < r1; r++) {
        const uint8_t *wr = (const uint8_t *)W->data + r * W->row_bytes;
        if (tdm_ggml_dequantize_row(W->type, wr, wrow, (int64_t)K) != TDM_OK)
            return TDM_EINVALID;
        for (uint32_t t = t0; t < t1; t++)
            o[(size_t)t * W->n_out + r] = dot_f32(be, wrow, x + (size_t)t * K, K);
    }
    return TDM_OK;
}

/* Groups [ga, gb) (rows 8 ga .. 8 gb - 1) of wk against tokens [t0, t1). */
static int matmul_groups(cpu_be_t *be, const cpu_wkernel_t *wk, const float *x, uint64_t ga,
                         uint64_t gb, uint32_t t0, uint32_t t1, float *o)
{
    const tdm_weight_t *W = wk->w;
    uint64_t r0 = 8 * ga, r1 = 8 * gb < W->n_out ? 8 * gb : W->n_out;
    if (wk->gemm) {
        size_t nb = wk->m.nb;
        /* an odd token to the narrow set, unless the tiles take any count (AMX) */
        uint32_t n = t1 - t0;
        bool split = wk->gemm1 && (n & 1) && !(be->amx && n >= TDM_AMX_MIN_TOKENS);
        uint32_t n_wide = split ? n - 1 : n;
        if (n_wide)
            wk->gemm(&wk->m, ga, gb, be->act + (size_t)t0 * nb, n_wide, o + (size_t)t0 * W->n_out,
                     W->n_out);
        if (n_wide < n)
            wk->gemm1(&wk->m, ga, gb, be->act + (size_t)(t1 - 1) * nb, 1,
                      o + (size_t)(t1 - 1) * W->n_out, W->n_out);
        return TDM_OK;
    }
    if (wk->zdot) {
        matmul_rows_zdot(be, wk, r0, r1, t0, t1, o);
        return TDM_OK;
    }
    return matmul_rows_f32(be, W, x, r0, r1, t0, t1, o);
}

/* Quantizes the n activation rows for the q8a kernels (and AVX-512's layout). */
static void matmul_quantize(cpu_be_t *be, const float *x, uint32_t n, size_t K)
{
    size_t nb = K / QK;
#pragma omp parallel for schedule(static)                                                          \
    num_threads(be->n_threads) if (n > 1 && n * K >= be->par_min)
    for (uint32_t t = 0; t < n; t++) {
        quantize_act(be, x + t * K, K, be->act + t * nb);
#ifdef TDM_X86
        if (be->avx512)
            tdm_cpu_zact_fill(be->act + t * nb, nb, be->zact + t * tdm_cpu_zact_stride(nb));
#endif
    }
}

#define TDM_MATMUL_MAX_W 4 /* weights one matmul call may share an input across */
#define TDM_CHUNK_GROUPS 2 /* 8-row groups per thread work unit (16 rows) */

/* The groups of all weights form one index space, split among threads in chunks; each chunk
 * goes over the tokens in tiles of TOKEN_TILE, so its weights stay in L1 and the tile's
 * activations in L2. An output element's value does not depend on the split. */
int tdm_cpu_matmul(void *vbe, const float *x, uint32_t n, uint32_t n_w,
                   const tdm_weight_t *const *w, float *const *out)
{
    cpu_be_t *be = vbe;
    size_t K = w[0]->n_in;
    cpu_wkernel_t tmp[TDM_MATMUL_MAX_W];
    const cpu_wkernel_t *wk[TDM_MATMUL_MAX_W];
    uint64_t gstart[TDM_MATMUL_MAX_W + 1] = {0};
    bool need_q8 = false;
    if (n_w > TDM_MATMUL_MAX_W)
        return TDM_EINTERNAL;
    for (uint32_t k = 0; k < n_w; k++) {
        if (w[k]->n_in != K || K > be->max_in)
            return TDM_EINTERNAL;
        wk[k] = tdm_cpu_wkernel_for(be, w[k], &tmp[k]);
        need_q8 |= wk[k]->gemm || wk[k]->zdot;
        gstart[k + 1] = gstart[k] + (w[k]->n_out + 7) / 8;
    }
    if (need_q8)
        matmul_quantize(be, x, n, K);
    int64_t n_chunks = (int64_t)((gstart[n_w] + TDM_CHUNK_GROUPS - 1) / TDM_CHUNK_GROUPS);
    int rc = TDM_OK;
#pragma omp parallel for schedule(static) num_threads(be->n_threads)
    for (int64_t c = 0; c < n_chunks; c++) {
        uint64_t g0 = (uint64_t)c * TDM_CHUNK_GROUPS;
        uint64_t g1 = g0 + TDM_CHUNK_GROUPS < gstart[n_w] ? g0 + TDM_CHUNK_GROUPS : gstart[n_w];
        for (uint32_t t0 = 0; t0 < n; t0 += TOKEN_TILE) {
            uint32_t t1 = t0 + TOKEN_TILE < n ? t0 + TOKEN_TILE : n;
            /* the chunk's groups, one call per weight they belong to */
            for (uint64_t g = g0; g < g1;) {
                uint32_t k = 0;
                while (g >= gstart[k + 1])
                    k++;
                uint64_t ge = g1 < gstart[k + 1] ? g1 : gstart[k + 1];
                if (matmul_groups(be, wk[k], x, g - gstart[k], ge - gstart[k], t0, t1, out[k]) !=
                    TDM_OK) {
#pragma omp atomic write
                    rc = TDM_EINVALID;
                }
                g = ge;
            }
        }
    }
    return rc;
}
