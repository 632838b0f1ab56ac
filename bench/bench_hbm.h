/* bench_hbm.h - device memory bandwidth for the engine benchmark (CUDA builds only). */
#ifndef TANDEM_BENCH_HBM_H
#define TANDEM_BENCH_HBM_H

#include <stddef.h>

/* Bytes per second of a device-to-device cudaMemcpy of a 1 GiB buffer on CUDA device
 * `device`, counting the bytes read and the bytes written (the traffic a copy makes, as the
 * CPU benchmark's memcpy figure does), best of 10 copies timed with CUDA events after one
 * untimed copy. Returns 0 with *bytes_per_s set, or -1 with the failing CUDA call, its error,
 * file and line in msg[cap]. Frees what it allocates. */
int tdm_bench_hbm_d2d(int device, double *bytes_per_s, char *msg, size_t cap);

/* FLOP/s of a cuBLAS bf16 GEMM (8192 x 8192 x 8192, bf16 inputs and output, f32 accumulation:
 * cublasGemmEx with CUBLAS_COMPUTE_32F) on device `device`, 2 FLOP per multiply-add, best of
 * 10 after two untimed GEMMs, timed with CUDA events: the peak prefill is compared with.
 * Returns 0 with *flops set, or -1 with the failing call in msg[cap]. Frees what it allocates. */
int tdm_bench_gemm_peak(int device, double *flops, char *msg, size_t cap);

#endif
