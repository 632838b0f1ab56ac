/* bench_hbm.c - device-to-device copy bandwidth and the bf16 GEMM peak of a CUDA device (see
 * bench_hbm.h), through the CUDA runtime's and cuBLAS's C APIs; every call checked. */
#include "bench_hbm.h"

#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <stdio.h>

#define HBM_BYTES ((size_t)1 << 30)
#define HBM_REPS 10

/* On a failed CUDA call: the message, then cleanup. */
#define HBM_TRY(stmt)                                                                              \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            snprintf(msg, cap, "%s: %s (%s:%d)", #stmt, cudaGetErrorString(e_), __FILE__,          \
                     __LINE__);                                                                    \
            goto out_free;                                                                         \
        }                                                                                          \
    } while (0)

int tdm_bench_hbm_d2d(int device, double *bytes_per_s, char *msg, size_t cap)
{
    void *a = NULL, *b = NULL;
    cudaEvent_t start = NULL, stop = NULL;
    int rc = -1;
    float best_ms = 1e30f;
    HBM_TRY(cudaSetDevice(device));
    HBM_TRY(cudaMalloc(&a, HBM_BYTES));
    HBM_TRY(cudaMalloc(&b, HBM_BYTES));
    HBM_TRY(cudaMemset(a, 1, HBM_BYTES));
    HBM_TRY(cudaMemset(b, 2, HBM_BYTES));
    HBM_TRY(cudaEventCreate(&start));
    HBM_TRY(cudaEventCreate(&stop));
    HBM_TRY(cudaMemcpy(b, a, HBM_BYTES, cudaMemcpyDeviceToDevice));
    for (int r = 0; r < HBM_REPS; r++) {
        float ms = 0.0f;
        HBM_TRY(cudaEventRecord(start, 0));
        HBM_TRY(cudaMemcpy(r % 2 ? a : b, r % 2 ? b : a, HBM_BYTES, cudaMemcpyDeviceToDevice));
        HBM_TRY(cudaEventRecord(stop, 0));
        HBM_TRY(cudaEventSynchronize(stop));
        HBM_TRY(cudaEventElapsedTime(&ms, start, stop));
        best_ms = ms < best_ms ? ms : best_ms;
    }
    *bytes_per_s = 2.0 * (double)HBM_BYTES / ((double)best_ms * 1e-3);
    rc = 0;
out_free: /* freeing cannot usefully fail */
    if (stop)
        (void)cudaEventDestroy(stop);
    if (start)
        (void)cudaEventDestroy(start);
    (void)cudaFree(b);
    (void)cudaFree(a);
    return rc;
}

#define GEMM_N 8192
#define GEMM_REPS 10

/* On a failed cuBLAS call: its status, then cleanup. */
#define BLAS_TRY(stmt)                                                                             \
    do {                                                                                           \
        cublasStatus_t s_ = (stmt);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            snprintf(msg, cap, "%s: cuBLAS status %d (%s:%d)", #stmt, (int)s_, __FILE__,           \
                     __LINE__);                                                                    \
            goto out_free;                                                                         \
        }                                                                                          \
    } while (0)

int tdm_bench_gemm_peak(int device, double *flops, char *msg, size_t cap)
{
    const size_t bytes = (size_t)GEMM_N * GEMM_N * 2; /* bf16 */
    void *a = NULL, *b = NULL, *c = NULL;
    cudaEvent_t start = NULL, stop = NULL;
    cublasHandle_t h = NULL;
    int rc = -1;
    float best_ms = 1e30f;
    const float one = 1.0f, zero = 0.0f;
    HBM_TRY(cudaSetDevice(device));
    HBM_TRY(cudaMalloc(&a, bytes));
    HBM_TRY(cudaMalloc(&b, bytes));
    HBM_TRY(cudaMalloc(&c, bytes));
    HBM_TRY(cudaMemset(a, 0x3c, bytes)); /* bf16 0x3c3c: about 0.0115, finite */
    HBM_TRY(cudaMemset(b, 0x3c, bytes));
    HBM_TRY(cudaEventCreate(&start));
    HBM_TRY(cudaEventCreate(&stop));
    BLAS_TRY(cublasCreate(&h));
    for (int r = -2; r < GEMM_REPS; r++) {
        float ms = 0.0f;
        HBM_TRY(cudaEventRecord(start, 0));
        BLAS_TRY(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, GEMM_N, GEMM_N, GEMM_N, &one, a,
                              CUDA_R_16BF, GEMM_N, b, CUDA_R_16BF, GEMM_N, &zero, c, CUDA_R_16BF,
                              GEMM_N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        HBM_TRY(cudaEventRecord(stop, 0));
        HBM_TRY(cudaEventSynchronize(stop));
        HBM_TRY(cudaEventElapsedTime(&ms, start, stop));
        if (r >= 0 && ms < best_ms)
            best_ms = ms;
    }
    *flops = 2.0 * GEMM_N * (double)GEMM_N * GEMM_N / ((double)best_ms * 1e-3);
    rc = 0;
out_free:
    if (h)
        (void)cublasDestroy(h);
    if (stop)
        (void)cudaEventDestroy(stop);
    if (start)
        (void)cudaEventDestroy(start);
    (void)cudaFree(c);
    (void)cudaFree(b);
    (void)cudaFree(a);
    return rc;
}
