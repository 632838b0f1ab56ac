// embed.cu - row copies between the GEMM type and f32: the embedding lookup, the gather of the
// rows that ask for logits, and the conversion of activations (and, at create, of weights) to
// the GEMM type (bf16 or f16, round to nearest even).
#include "model/cuda/cuda_internal.cuh"

static __device__ __forceinline__ float gemm_to_f32(__nv_bfloat16 v)
{
    return __bfloat162float(v);
}

static __device__ __forceinline__ float gemm_to_f32(__half v)
{
    return __half2float(v);
}

static __device__ __forceinline__ void f32_to_gemm(float v, __nv_bfloat16 *dst)
{
    *dst = __float2bfloat16_rn(v);
}

static __device__ __forceinline__ void f32_to_gemm(float v, __half *dst)
{
    *dst = __float2half_rn(v);
}

// One block per row: x[t] = table[tokens[t]].
template <typename T>
static __global__ void embed_kernel(const T *table, const int32_t *tokens, uint32_t dim, float *x)
{
    const uint32_t t = blockIdx.x;
    const T *row = table + (size_t)tokens[t] * dim;
    float *o = x + (size_t)t * dim;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        o[i] = gemm_to_f32(row[i]);
}

// One block per gathered row: dst[k] = src[rows[k]].
static __global__ void gather_kernel(const float *src, const uint32_t *rows, uint32_t dim,
                                     float *dst)
{
    const uint32_t k = blockIdx.x;
    const float *s = src + (size_t)rows[k] * dim;
    float *d = dst + (size_t)k * dim;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        d[i] = s[i];
}

template <typename T> static __global__ void to_gemm_kernel(const float *src, size_t count, T *dst)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (size_t)gridDim.x * blockDim.x)
        f32_to_gemm(src[i], dst + i);
}

int tdm_cuda_op_embed(cuda_be_t *be, const void *table, uint32_t n, uint32_t dim, float *x)
{
    if (n == 0)
        return TDM_OK;
    if (be->gemm_type == CUDA_R_16BF)
        embed_kernel<<<n, 256, 0, be->stream>>>((const __nv_bfloat16 *)table, be->pass.tokens, dim,
                                                x);
    else
        embed_kernel<<<n, 256, 0, be->stream>>>((const __half *)table, be->pass.tokens, dim, x);
    TDM_CUDA_CHECK_LAUNCH(be, "embed_kernel");
    return TDM_OK;
}

int tdm_cuda_op_gather(cuda_be_t *be, const float *src, uint32_t n, uint32_t dim, float *dst)
{
    if (n == 0)
        return TDM_OK;
    gather_kernel<<<n, 256, 0, be->stream>>>(src, be->pass.logit_rows, dim, dst);
    TDM_CUDA_CHECK_LAUNCH(be, "gather_kernel");
    return TDM_OK;
}

int tdm_cuda_op_to_gemm(cuda_be_t *be, const float *src, size_t count, void *dst)
{
    if (count == 0)
        return TDM_OK;
    unsigned blocks = tdm_cuda_blocks(count, 256);
    if (be->gemm_type == CUDA_R_16BF)
        to_gemm_kernel<<<blocks, 256, 0, be->stream>>>(src, count, (__nv_bfloat16 *)dst);
    else
        to_gemm_kernel<<<blocks, 256, 0, be->stream>>>(src, count, (__half *)dst);
    TDM_CUDA_CHECK_LAUNCH(be, "to_gemm_kernel");
    return TDM_OK;
}
