/* bench_hbm.c - device-to-device copy bandwidth of a CUDA device (see bench_hbm.h), through
 * the CUDA runtime's C API; every call checked. */
#include "bench_hbm.h"

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
