/* cuda_backend.h - the CUDA engine backend as C code sees it (internal to libtandem): the ops
 * table, and two accessors the GPU tests use. Compiles as C11 and as CUDA C++; the kernels and
 * the backend state live in the .cu files of this folder (STYLE.md rule 13).
 *
 * What the backend does (backend_cuda.cu): every weight is dequantized on the host once, when
 * the engine is created, uploaded and converted on the device to bf16 (f16 when the
 * environment sets TANDEM_CUDA_GEMM=f16); norms and biases stay f32. Matmuls are cuBLAS GEMMs
 * (cublasGemmEx, bf16 inputs, f32 accumulation and output) after a conversion of the f32
 * activations to bf16. The KV pool has a device copy of the same layout and byte size as the
 * host pool (the host pool keeps the block bookkeeping). Everything runs on one stream of the
 * engine's device; a forward pass copies its row descriptions to the device once (begin) and
 * synchronises once (read, or sync when no logits are read). Every CUDA and cuBLAS call is
 * checked: a failure returns a tdm status and keeps "statement: error (file:line)" as the
 * backend's last message.
 *
 * Only built with TANDEM_HAVE_CUDA.
 */
#ifndef TANDEM_MODEL_CUDA_BACKEND_H
#define TANDEM_MODEL_CUDA_BACKEND_H

#ifdef TANDEM_HAVE_CUDA

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* backend.h and the public headers it includes declare C functions; C++ sees them through the
 * enclosing extern "C". */
#include "../backend.h"

/* The CUDA backend's ops (backend_cuda.cu). create() takes the device from
 * tdm_engine_params_t.device and fails with TDM_EUNAVAILABLE when it cannot be used. */
extern const tdm_backend_ops_t tdm_model_backend_cuda;

/* Copies count floats from host memory into backend memory at dst (a buffer from
 * tdm_model_backend_cuda.alloc) and waits for the copy. For tests, which fill device buffers to
 * compare ops with the CPU backend. Returns 0 or the CUDA failure (message in errmsg). */
int tdm_model_cuda_write(void *be, float *dst, const float *host_src, size_t count);

/* Copies bytes of the device KV pool copy, from byte offset, to host_dst and waits. For tests
 * that compare the pool written by kv_store with the CPU backend's host pool. */
int tdm_model_cuda_read_kv(void *be, uint64_t offset, size_t bytes, void *host_dst);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_HAVE_CUDA */

#endif /* TANDEM_MODEL_CUDA_BACKEND_H */
