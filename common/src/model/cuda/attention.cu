// attention.cu - causal scaled dot-product attention (Vaswani et al. 2017) over the paged KV
// pool, with GQA (query head h reads KV head h / (n_heads / n_kv_heads), Ainslie et al. 2023)
// and an online softmax (Milakov & Gimelshein 2018, as in FlashAttention) so that no score
// buffer is needed.
//
// One thread block of ATTN_WARPS warps per (row, query head). Warp w takes the tiles of 32
// positions w, w + ATTN_WARPS, ... of 0..pos[t]: each lane scores one position (its K row
// dotted with the query, read through the sequence's block table), the warp updates its
// running max, sum and output (each lane owns head_dim / 32 output values), and at the end the
// warps' partial results are merged in shared memory. With an f16 cache the query is rounded
// to f16 first, as the CPU backend does.
#include "model/cuda/cuda_internal.cuh"

#define ATTN_WARPS 4
#define ATTN_THREADS (ATTN_WARPS * 32)
#define ATTN_CHUNKS (TDM_CUDA_MAX_HEAD_DIM / 32) // output values per lane, at most

enum { AT_F32 = TDM_KV_F32, AT_F16 = TDM_KV_F16, AT_Q8 = TDM_KV_Q8 };

typedef struct attn_args {
    const uint8_t *kv;
    const float *q;
    float *out;
    const uint32_t *pos, *tab_off, *table;
    uint32_t n_heads, head_dim, group, bs_shift, bs_mask;
    uint64_t block_bytes, k_off, v_off; // k_off, v_off: the layer's K / V record of KV head 0
    uint64_t rec_bytes;
    float scale;
} attn_args_t;

// q · K[slot] of one record (D a multiple of 4; rows are 16-byte (f32), 8-byte (f16) or 4-byte
// (q8) aligned).
template <int DT>
static __device__ __forceinline__ float k_dot(const uint8_t *rec, uint32_t slot, const float *qs,
                                              uint32_t D)
{
    float s = 0.0f;
    if (DT == AT_F32) {
        const float4 *kr = (const float4 *)(rec + (size_t)slot * D * sizeof(float));
        for (uint32_t i = 0; i < D / 4; i++) {
            float4 k4 = kr[i];
            s += qs[4 * i] * k4.x + qs[4 * i + 1] * k4.y + qs[4 * i + 2] * k4.z +
                 qs[4 * i + 3] * k4.w;
        }
    } else if (DT == AT_F16) {
        const __half2 *kr = (const __half2 *)(rec + (size_t)slot * D * sizeof(__half));
        for (uint32_t i = 0; i < D / 2; i++) {
            float2 k2 = __half22float2(kr[i]);
            s += qs[2 * i] * k2.x + qs[2 * i + 1] * k2.y;
        }
    } else {
        const float ks = *(const float *)rec;
        const char4 *kr = (const char4 *)(rec + sizeof(float) + (size_t)slot * D);
        for (uint32_t i = 0; i < D / 4; i++) {
            char4 k4 = kr[i];
            s += qs[4 * i] * (float)k4.x + qs[4 * i + 1] * (float)k4.y +
                 qs[4 * i + 2] * (float)k4.z + qs[4 * i + 3] * (float)k4.w;
        }
        s *= ks;
    }
    return s;
}

// Value i of V[slot] of one record, as f32.
template <int DT>
static __device__ __forceinline__ float v_at(const uint8_t *rec, uint32_t slot, uint32_t D,
                                             uint32_t i)
{
    if (DT == AT_F32)
        return ((const float *)rec)[(size_t)slot * D + i];
    if (DT == AT_F16)
        return __half2float(((const __half *)rec)[(size_t)slot * D + i]);
    return (float)((const int8_t *)(rec + sizeof(float)))[(size_t)slot * D + i] *
           *(const float *)rec;
}

template <int DT>
static __global__ void __launch_bounds__(ATTN_THREADS) attention_kernel(attn_args_t a)
{
    __shared__ float qs[TDM_CUDA_MAX_HEAD_DIM];
    __shared__ float wm[ATTN_WARPS], wl[ATTN_WARPS];
    __shared__ float wacc[ATTN_WARPS][TDM_CUDA_MAX_HEAD_DIM];
    const uint32_t t = blockIdx.x, h = blockIdx.y, D = a.head_dim;
    const uint32_t lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const uint32_t g = h / a.group;
    const float *qh = a.q + ((size_t)t * a.n_heads + h) * D;
    for (uint32_t i = threadIdx.x; i < D; i += ATTN_THREADS)
        qs[i] = DT == AT_F16 ? __half2float(__float2half_rn(qh[i])) : qh[i];
    __syncthreads();

    const uint32_t n_pos = a.pos[t] + 1;
    const uint32_t *tab = a.table + a.tab_off[t];
    const uint64_t k_off = a.k_off + g * a.rec_bytes, v_off = a.v_off + g * a.rec_bytes;
    float m = -INFINITY, l = 0.0f, acc[ATTN_CHUNKS];
#pragma unroll
    for (int c = 0; c < ATTN_CHUNKS; c++)
        acc[c] = 0.0f;

    for (uint32_t j0 = warp * 32; j0 < n_pos; j0 += ATTN_WARPS * 32) {
        const uint32_t j = j0 + lane;
        float s = -INFINITY;
        if (j < n_pos) {
            const uint8_t *rec = a.kv + (uint64_t)tab[j >> a.bs_shift] * a.block_bytes + k_off;
            s = k_dot<DT>(rec, j & a.bs_mask, qs, D) * a.scale;
        }
        const float m_new = fmaxf(m, tdm_warp_max(s)); // finite: position j0 is valid
        const float corr = expf(m - m_new);            // 0 on the first tile (m = -inf)
        const float p = j < n_pos ? expf(s - m_new) : 0.0f;
        l = l * corr + tdm_warp_sum(p);
#pragma unroll
        for (int c = 0; c < ATTN_CHUNKS; c++)
            acc[c] *= corr;
        const uint32_t n_valid = n_pos - j0 < 32 ? n_pos - j0 : 32;
        for (uint32_t jj = 0; jj < n_valid; jj++) {
            const float pj = __shfl_sync(0xffffffffu, p, (int)jj);
            const uint32_t jp = j0 + jj;
            const uint8_t *rec = a.kv + (uint64_t)tab[jp >> a.bs_shift] * a.block_bytes + v_off;
#pragma unroll
            for (int c = 0; c < ATTN_CHUNKS; c++) {
                const uint32_t i = lane + 32u * (uint32_t)c;
                if (i < D)
                    acc[c] += pj * v_at<DT>(rec, jp & a.bs_mask, D, i);
            }
        }
        m = m_new;
    }

    if (lane == 0) {
        wm[warp] = m;
        wl[warp] = l;
    }
#pragma unroll
    for (int c = 0; c < ATTN_CHUNKS; c++) {
        const uint32_t i = lane + 32u * (uint32_t)c;
        if (i < D)
            wacc[warp][i] = acc[c];
    }
    __syncthreads();
    // merge: a warp without positions has m = -inf, l = 0 and weighs exp(-inf) = 0
    float M = -INFINITY;
    for (int w = 0; w < ATTN_WARPS; w++)
        M = fmaxf(M, wm[w]);
    float f[ATTN_WARPS], L = 0.0f;
    for (int w = 0; w < ATTN_WARPS; w++) {
        f[w] = expf(wm[w] - M);
        L += wl[w] * f[w];
    }
    float *o = a.out + ((size_t)t * a.n_heads + h) * D;
    for (uint32_t i = threadIdx.x; i < D; i += ATTN_THREADS) {
        float v = 0.0f;
        for (int w = 0; w < ATTN_WARPS; w++)
            v += wacc[w][i] * f[w];
        o[i] = v / L;
    }
}

int tdm_cuda_op_attention(cuda_be_t *be, uint32_t layer, const float *q, float *out)
{
    const cuda_pass_t *ps = &be->pass;
    const tdm_llama_hparams_t *hp = be->hp;
    if (ps->n_rows == 0)
        return TDM_OK;
    attn_args_t a;
    a.kv = be->kv;
    a.q = q;
    a.out = out;
    a.pos = ps->pos;
    a.tab_off = ps->tab_off;
    a.table = ps->table;
    a.n_heads = hp->n_heads;
    a.head_dim = hp->head_dim;
    a.group = hp->n_heads / hp->n_kv_heads;
    a.bs_shift = (uint32_t)__builtin_ctz(be->kl.block_size); // a power of two (kv.h)
    a.bs_mask = be->kl.block_size - 1;
    a.block_bytes = be->block_bytes;
    a.rec_bytes = be->rec_bytes;
    a.k_off = tdm_kv_record_offset(&be->kl, be->rec_bytes, layer, 0, 0);
    a.v_off = tdm_kv_record_offset(&be->kl, be->rec_bytes, layer, 1, 0);
    a.scale = 1.0f / sqrtf((float)hp->head_dim);
    dim3 grid(ps->n_rows, hp->n_heads);
    switch (be->kl.dtype) {
    case TDM_KV_F32: attention_kernel<AT_F32><<<grid, ATTN_THREADS, 0, be->stream>>>(a); break;
    case TDM_KV_F16: attention_kernel<AT_F16><<<grid, ATTN_THREADS, 0, be->stream>>>(a); break;
    case TDM_KV_Q8: attention_kernel<AT_Q8><<<grid, ATTN_THREADS, 0, be->stream>>>(a); break;
    default:
        return tdm_cuda_fail(be, TDM_EINTERNAL, "attention: unknown KV dtype %d",
                             (int)be->kl.dtype);
    }
    TDM_CUDA_CHECK_LAUNCH(be, "attention_kernel");
    return TDM_OK;
}
