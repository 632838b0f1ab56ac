// rmsnorm.cu - RMSNorm (Zhang & Sennrich 2019), one block per row, with the arithmetic of
// cpu_rmsnorm: squares rounded to f32 and summed in double, scale = 1 / sqrtf(mean + eps),
// out = (x * scale) * g. Only the order of the double sum differs from the CPU.
#include "model/cuda/cuda_internal.cuh"

#define RMSNORM_THREADS 256

static __global__ void __launch_bounds__(RMSNORM_THREADS)
    rmsnorm_kernel(const float *x, const float *g, uint32_t dim, float eps, float *out)
{
    __shared__ double partial[RMSNORM_THREADS / 32];
    const uint32_t t = blockIdx.x, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const float *xr = x + (size_t)t * dim;
    double sum = 0.0;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        sum += (double)__fmul_rn(xr[i], xr[i]);
    sum = tdm_warp_sum_d(sum);
    if (lane == 0)
        partial[warp] = sum;
    __syncthreads();
    double total = 0.0;
    for (uint32_t w = 0; w < RMSNORM_THREADS / 32; w++)
        total += partial[w];
    const float mean = (float)(total / (double)dim);
    const float scale = 1.0f / sqrtf(mean + eps);
    float *o = out + (size_t)t * dim;
    for (uint32_t i = threadIdx.x; i < dim; i += blockDim.x)
        o[i] = __fmul_rn(__fmul_rn(xr[i], scale), g[i]);
}

int tdm_cuda_op_rmsnorm(cuda_be_t *be, const float *x, const float *g, uint32_t n, uint32_t dim,
                        float eps, float *out)
{
    if (n == 0)
        return TDM_OK;
    rmsnorm_kernel<<<n, RMSNORM_THREADS, 0, be->stream>>>(x, g, dim, eps, out);
    TDM_CUDA_CHECK_LAUNCH(be, "rmsnorm_kernel");
    return TDM_OK;
}
