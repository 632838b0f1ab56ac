// swiglu.cu - the element-wise ops: SwiGLU (Shazeer 2020) out = silu(gate) * up computed as
// cpu_swiglu does (g / (1 + expf(-g)) * up), the residual add and the bias add. Grid-stride
// loops; in place is allowed (out = gate, x += y).
#include "model/cuda/cuda_internal.cuh"

#define EW_THREADS 256

static __global__ void swiglu_kernel(const float *gate, const float *up, size_t count, float *out)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (size_t)gridDim.x * blockDim.x) {
        float g = gate[i];
        out[i] = __fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), up[i]);
    }
}

static __global__ void add_kernel(float *x, const float *y, size_t count)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += y[i];
}

static __global__ void add_bias_kernel(float *x, const float *b, size_t count, uint32_t dim)
{
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < count;
         i += (size_t)gridDim.x * blockDim.x)
        x[i] += b[i % dim];
}

int tdm_cuda_op_swiglu(cuda_be_t *be, const float *gate, const float *up, size_t count, float *out)
{
    if (count == 0)
        return TDM_OK;
    swiglu_kernel<<<tdm_cuda_blocks(count, EW_THREADS), EW_THREADS, 0, be->stream>>>(gate, up,
                                                                                     count, out);
    TDM_CUDA_CHECK_LAUNCH(be, "swiglu_kernel");
    return TDM_OK;
}

int tdm_cuda_op_add(cuda_be_t *be, float *x, const float *y, size_t count)
{
    if (count == 0)
        return TDM_OK;
    add_kernel<<<tdm_cuda_blocks(count, EW_THREADS), EW_THREADS, 0, be->stream>>>(x, y, count);
    TDM_CUDA_CHECK_LAUNCH(be, "add_kernel");
    return TDM_OK;
}

int tdm_cuda_op_add_bias(cuda_be_t *be, float *x, const float *b, uint32_t n, uint32_t dim)
{
    size_t count = (size_t)n * dim;
    if (count == 0)
        return TDM_OK;
    add_bias_kernel<<<tdm_cuda_blocks(count, EW_THREADS), EW_THREADS, 0, be->stream>>>(x, b, count,
                                                                                       dim);
    TDM_CUDA_CHECK_LAUNCH(be, "add_bias_kernel");
    return TDM_OK;
}
