// xxh3.cu - XXH3-64 of KV blocks in device memory, one CUDA thread block per KV block: the
// lane arithmetic of transfer/xxh3_lanes.h with its 16 stripes x 8 lanes of each 1 KiB input
// block computed by 128 threads at once, summed per lane (mod 2^64, order free), then
// scrambled by 8 threads; the value equals libxxhash's XXH3_64bits of the same bytes
// (tests/gpu/test_xxh3_gpu.c checks it; tests/unit/test_transfer.c checks the arithmetic on
// the host).
#include <cuda_runtime.h>
#include <stdio.h>

#include "transfer/transfer_cuda.h"
#include "transfer/xxh3_lanes.h"

#define XXH3_THREADS (TDM_XXH3_STRIPES_PER_BLOCK * 8u)

// The secret travels by value in the kernel's parameters (192 bytes).
typedef struct xxh3_secret {
    uint8_t b[TDM_XXH3_SECRET_BYTES];
} xxh3_secret_t;

__global__ void xxh3_blocks_kernel(const uint8_t *base, const uint64_t *offsets,
                                   uint64_t block_bytes, xxh3_secret_t secret, uint64_t *out)
{
    __shared__ uint8_t sec[TDM_XXH3_SECRET_BYTES];
    __shared__ uint64_t part[TDM_XXH3_STRIPES_PER_BLOCK][8];
    __shared__ uint64_t acc[8];
    const unsigned t = threadIdx.x, s = t / 8u, lane = t % 8u;
    const uint8_t *in = base + offsets[blockIdx.x];
    const uint64_t len = block_bytes;
    for (unsigned i = t; i < TDM_XXH3_SECRET_BYTES; i += XXH3_THREADS)
        sec[i] = secret.b[i];
    if (t < 8)
        acc[t] = tdm_xxh3_acc_init(t);
    __syncthreads();
    const uint64_t nb = tdm_xxh3_n_blocks(len);
    for (uint64_t n = 0; n < nb; n++) {
        part[s][lane] =
            tdm_xxh3_stripe_lane(in + n * TDM_XXH3_BLOCK + s * TDM_XXH3_STRIPE, sec + 8 * s, lane);
        __syncthreads();
        if (t < 8) {
            uint64_t sum = acc[t];
            for (unsigned k = 0; k < TDM_XXH3_STRIPES_PER_BLOCK; k++)
                sum += part[k][t];
            acc[t] = tdm_xxh3_scramble_lane(sum, sec, t);
        }
        __syncthreads();
    }
    const unsigned last = tdm_xxh3_last_stripes(len);
    part[s][lane] = s < last ? tdm_xxh3_stripe_lane(in + nb * TDM_XXH3_BLOCK + s * TDM_XXH3_STRIPE,
                                                    sec + 8 * s, lane)
                             : 0;
    __syncthreads();
    if (t < 8) {
        uint64_t sum = acc[t];
        for (unsigned k = 0; k < TDM_XXH3_STRIPES_PER_BLOCK; k++)
            sum += part[k][t];
        acc[t] =
            sum + tdm_xxh3_stripe_lane(in + len - TDM_XXH3_STRIPE, sec + TDM_XXH3_LAST_SECRET, t);
    }
    __syncthreads();
    if (t == 0)
        out[blockIdx.x] = tdm_xxh3_merge(acc, sec, len);
}

#define XFER_CUDA(stmt)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            rc = tdm_error_set(err, TDM_EUNAVAILABLE, "%s: %s (%s:%d)", #stmt,                     \
                               cudaGetErrorString(e_), __FILE__, __LINE__);                        \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

extern "C" int tdm_transfer_cuda_checksums(int device, const void *base, const uint64_t *offsets,
                                           uint32_t n, uint64_t block_bytes,
                                           const uint8_t secret[TDM_XXH3_SECRET_BYTES],
                                           uint64_t *out, tdm_error_t *err)
{
    int rc = 0;
    cudaStream_t st = NULL;
    uint64_t *d_offsets = NULL, *d_out = NULL;
    xxh3_secret_t sec;
    if (n == 0)
        return 0;
    if (block_bytes < TDM_XXH3_MIN_LONG)
        return tdm_error_set(err, TDM_EINVALID,
                             "device checksums need blocks of at least %u bytes, got %llu",
                             TDM_XXH3_MIN_LONG, (unsigned long long)block_bytes);
    memcpy(sec.b, secret, sizeof sec.b);
    XFER_CUDA(cudaSetDevice(device));
    XFER_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    XFER_CUDA(cudaMallocAsync((void **)&d_offsets, (size_t)n * sizeof(uint64_t), st));
    XFER_CUDA(cudaMallocAsync((void **)&d_out, (size_t)n * sizeof(uint64_t), st));
    XFER_CUDA(cudaMemcpyAsync(d_offsets, offsets, (size_t)n * sizeof(uint64_t),
                              cudaMemcpyHostToDevice, st));
    xxh3_blocks_kernel<<<n, XXH3_THREADS, 0, st>>>((const uint8_t *)base, d_offsets, block_bytes,
                                                   sec, d_out);
    XFER_CUDA(cudaGetLastError());
    XFER_CUDA(
        cudaMemcpyAsync(out, d_out, (size_t)n * sizeof(uint64_t), cudaMemcpyDeviceToHost, st));
    XFER_CUDA(cudaStreamSynchronize(st));
out:
    if (d_offsets)
        cudaFreeAsync(d_offsets, st);
    if (d_out)
        cudaFreeAsync(d_out, st);
    if (st) {
        cudaStreamSynchronize(st);
        cudaStreamDestroy(st);
    }
    return rc;
}
