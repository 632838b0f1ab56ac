/* transfer_cuda.h - the CUDA runtime and NCCL calls of the KV transport's device backends
 * (cuda_ipc, nccl, and host-to-device copies for tcp into a device pool), implemented in
 * cuda/transfer_cuda.cu and linked only in CUDA builds (TANDEM_HAVE_CUDA).
 *
 * Every CUDA and NCCL call is checked; a failure returns TDM_EUNAVAILABLE (or TDM_EINVALID
 * for bad arguments) with the failing statement, the library's error text, file and line in
 * *err. Compiles as C11 and as CUDA C++ (extern "C").
 */
#ifndef TANDEM_TRANSFER_CUDA_H
#define TANDEM_TRANSFER_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TDM_XFER_IPC_HANDLE_BYTES 64u /* sizeof(cudaIpcMemHandle_t) */
#define TDM_XFER_NCCL_ID_BYTES 128u   /* sizeof(ncclUniqueId) */

/* The IPC handle of the allocation that starts at device_base (which must be the pointer
 * cudaMalloc returned: a handle always names a whole allocation) on CUDA device `device`. */
int tdm_transfer_cuda_ipc_handle(int device, void *device_base,
                                 uint8_t handle[TDM_XFER_IPC_HANDLE_BYTES], tdm_error_t *err);

/* Maps another process's allocation into this one on `device` (peer access enabled lazily);
 * *base is the mapped start. Close with tdm_transfer_cuda_ipc_close. Fails in the process that
 * made the handle (CUDA refuses to open its own handles). */
int tdm_transfer_cuda_ipc_open(int device, const uint8_t handle[TDM_XFER_IPC_HANDLE_BYTES],
                               void **base, tdm_error_t *err);
int tdm_transfer_cuda_ipc_close(int device, void *base, tdm_error_t *err);

/* Copies n blocks of block_bytes, device to device, dst_base + dst_blocks[i] * block_bytes
 * <- src_base + src_offsets[i], on a private stream of `device`, and waits for the copies. */
int tdm_transfer_cuda_copy_d2d(int device, void *dst_base, const uint32_t *dst_blocks,
                               const void *src_base, const uint64_t *src_offsets, uint32_t n,
                               uint64_t block_bytes, tdm_error_t *err);

/* Copies n host buffers of block_bytes (src[i]) into the device blocks dst_base +
 * dst_blocks[i] * block_bytes, and waits for the copies. */
int tdm_transfer_cuda_copy_h2d(int device, void *dst_base, const uint32_t *dst_blocks,
                               const uint8_t *const *src, uint32_t n, uint64_t block_bytes,
                               tdm_error_t *err);

/* XXH3-64 (tdm_kv_block_checksum's value) of n device blocks of block_bytes at base +
 * offsets[i] (offsets in host memory) on `device`, computed on the device (cuda/xxh3.cu, one
 * thread block per KV block) with XXH3's default secret (secret[192]: what
 * XXH3_generateSecret_fromSeed gives for seed 0), into out[n] (host memory); waits for them.
 * TDM_EINVALID for block_bytes < 241 (XXH3's short-input paths are not implemented there). */
int tdm_transfer_cuda_checksums(int device, const void *base, const uint64_t *offsets, uint32_t n,
                                uint64_t block_bytes, const uint8_t secret[192], uint64_t *out,
                                tdm_error_t *err);

/* ---- NCCL: one two-rank communicator per (sender, receiver) pair ---- */

typedef struct tdm_transfer_nccl tdm_transfer_nccl_t;

/* A fresh ncclUniqueId (made by the sender, rank 0, and carried to the receiver in KvHello). */
int tdm_transfer_nccl_unique_id(uint8_t id[TDM_XFER_NCCL_ID_BYTES], tdm_error_t *err);

/* Starts creating the communicator of rank `rank` (0 = sender, 1 = receiver) of 2 on
 * `device`, non-blocking (NCCL finishes it in the background; poll tdm_transfer_nccl_ready).
 * Returns NULL with *err set. Caller destroys with tdm_transfer_nccl_destroy. */
tdm_transfer_nccl_t *tdm_transfer_nccl_new(int device, const uint8_t id[TDM_XFER_NCCL_ID_BYTES],
                                           int rank, tdm_error_t *err);

/* 1 when the communicator is usable, 0 while it is still being created, or an error. */
int tdm_transfer_nccl_ready(tdm_transfer_nccl_t *c, tdm_error_t *err);

/* Enqueues one grouped transfer of n blocks (base + blocks[i] * block_bytes) to the peer:
 * ncclSend from rank 0, ncclRecv on rank 1. One transfer at a time per communicator: call it
 * again only after tdm_transfer_nccl_poll returned 1. Returns 0 or an error. */
int tdm_transfer_nccl_start(tdm_transfer_nccl_t *c, void *base, const uint32_t *blocks, uint32_t n,
                            uint64_t block_bytes, tdm_error_t *err);

/* Progress of the transfer started last: 1 when it completed on the device (or none is
 * running), 0 while it runs, or an error (the communicator is then unusable: destroy it). */
int tdm_transfer_nccl_poll(tdm_transfer_nccl_t *c, tdm_error_t *err);

/* Aborts the communicator (ncclCommAbort: does not wait for the peer, unblocks a transfer
 * the peer will never complete) and frees it. NULL-safe, nulls *c_p. */
void tdm_transfer_nccl_destroy(tdm_transfer_nccl_t **c_p);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_TRANSFER_CUDA_H */
