// rope.cu - RoPE (Su et al. 2021) on q and k in place, one block per row, as cpu_rope does it:
// theta_i = pos * theta_scale^i with the power taken iteratively in f32 (ggml's theta_scale),
// pairs (2i, 2i+1) in the normal mode and (i, i + rope_dim/2) in neox; dimensions past
// rope_dim are unchanged. The rotation avoids fused multiply-adds so that it rounds as the
// CPU does; cos and sin are taken in double and rounded, which agrees with glibc's cosf/sinf
// to the last bit nearly always.
#include "model/cuda/cuda_internal.cuh"

#define ROPE_THREADS 256

static __global__ void __launch_bounds__(ROPE_THREADS)
    rope_kernel(float *q, float *k, const uint32_t *pos, uint32_t n_heads, uint32_t n_kv_heads,
                uint32_t head_dim, uint32_t rope_dim, float theta_scale, int neox)
{
    __shared__ float cs[TDM_CUDA_MAX_HEAD_DIM]; // cos, sin pairs: rope_dim <= head_dim
    const uint32_t t = blockIdx.x, half = rope_dim / 2;
    for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
        float theta = (float)pos[t];
        for (uint32_t j = 0; j < i; j++)
            theta = __fmul_rn(theta, theta_scale);
        double s, c;
        sincos((double)theta, &s, &c);
        cs[2 * i] = (float)c;
        cs[2 * i + 1] = (float)s;
    }
    __syncthreads();
    const uint32_t n_pairs = (n_heads + n_kv_heads) * half;
    for (uint32_t p = threadIdx.x; p < n_pairs; p += blockDim.x) {
        uint32_t h = p / half, i = p % half;
        float *x = h < n_heads ? q + ((size_t)t * n_heads + h) * head_dim
                               : k + ((size_t)t * n_kv_heads + (h - n_heads)) * head_dim;
        uint32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = x[i0], x1 = x[i1], c = cs[2 * i], s = cs[2 * i + 1];
        x[i0] = __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
        x[i1] = __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
    }
}

int tdm_cuda_op_rope(cuda_be_t *be, float *q, float *k)
{
    const tdm_llama_hparams_t *hp = be->hp;
    if (be->pass.n_rows == 0 || hp->rope_dim == 0)
        return TDM_OK;
    rope_kernel<<<be->pass.n_rows, ROPE_THREADS, 0, be->stream>>>(
        q, k, be->pass.pos, hp->n_heads, hp->n_kv_heads, hp->head_dim, hp->rope_dim,
        be->theta_scale, hp->rope_type == TDM_ROPE_NEOX);
    TDM_CUDA_CHECK_LAUNCH(be, "rope_kernel");
    return TDM_OK;
}
