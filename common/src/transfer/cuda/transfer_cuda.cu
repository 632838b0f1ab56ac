// transfer_cuda.cu - the CUDA runtime and NCCL calls of the KV transport's device backends
// (see transfer/transfer_cuda.h); every call checked, failures returned with the statement,
// the library's error text, file and line.
//
// NCCL communicators are created non-blocking (ncclConfig_t.blocking = 0) so that neither a
// node's engine thread nor its receiver waits forever on a peer that is gone: creation and
// grouped send/receive return ncclInProgress and are polled through ncclCommGetAsyncError;
// a CUDA event recorded after the group tells when the device finished. NCCL's rule for
// non-blocking communicators: after ncclInProgress, poll until ncclSuccess before any other
// call on that communicator or stream; after an error, only ncclCommAbort.
#include <cuda_runtime.h>
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "transfer/transfer_cuda.h"

static_assert(sizeof(cudaIpcMemHandle_t) == TDM_XFER_IPC_HANDLE_BYTES, "cudaIpcMemHandle_t size");
static_assert(sizeof(ncclUniqueId) == TDM_XFER_NCCL_ID_BYTES, "ncclUniqueId size");

// A failed CUDA call: TDM_EUNAVAILABLE naming the statement, file and line; jumps to `out`
// with rc set so that the function releases what it made.
#define XFER_CUDA(stmt)                                                                            \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            rc = tdm_error_set(err, TDM_EUNAVAILABLE, "%s: %s (%s:%d)", #stmt,                     \
                               cudaGetErrorString(e_), __FILE__, __LINE__);                        \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

// The same for NCCL calls; ncclInProgress (non-blocking communicators) is not a failure.
#define XFER_NCCL(stmt)                                                                            \
    do {                                                                                           \
        ncclResult_t r_ = (stmt);                                                                  \
        if (r_ != ncclSuccess && r_ != ncclInProgress) {                                           \
            rc =                                                                                   \
                tdm_error_set(err, TDM_EUNAVAILABLE, "%s: %s: %s (%s:%d)", #stmt,                  \
                              ncclGetErrorString(r_), ncclGetLastError(NULL), __FILE__, __LINE__); \
            goto out;                                                                              \
        }                                                                                          \
    } while (0)

extern "C" int tdm_transfer_cuda_ipc_handle(int device, void *device_base,
                                            uint8_t handle[TDM_XFER_IPC_HANDLE_BYTES],
                                            tdm_error_t *err)
{
    int rc = 0;
    cudaIpcMemHandle_t h;
    XFER_CUDA(cudaSetDevice(device));
    XFER_CUDA(cudaIpcGetMemHandle(&h, device_base));
    memcpy(handle, &h, sizeof h);
out:
    return rc;
}

extern "C" int tdm_transfer_cuda_ipc_open(int device,
                                          const uint8_t handle[TDM_XFER_IPC_HANDLE_BYTES],
                                          void **base, tdm_error_t *err)
{
    int rc = 0;
    cudaIpcMemHandle_t h;
    memcpy(&h, handle, sizeof h);
    *base = NULL;
    XFER_CUDA(cudaSetDevice(device));
    XFER_CUDA(cudaIpcOpenMemHandle(base, h, cudaIpcMemLazyEnablePeerAccess));
out:
    return rc;
}

extern "C" int tdm_transfer_cuda_ipc_close(int device, void *base, tdm_error_t *err)
{
    int rc = 0;
    XFER_CUDA(cudaSetDevice(device));
    XFER_CUDA(cudaIpcCloseMemHandle(base));
out:
    return rc;
}

extern "C" int tdm_transfer_cuda_copy_d2d(int device, void *dst_base, const uint32_t *dst_blocks,
                                          const void *src_base, const uint64_t *src_offsets,
                                          uint32_t n, uint64_t block_bytes, tdm_error_t *err)
{
    int rc = 0;
    cudaStream_t st = NULL;
    XFER_CUDA(cudaSetDevice(device));
    XFER_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (uint32_t i = 0; i < n; i++) {
        char *dst = (char *)dst_base + (uint64_t)dst_blocks[i] * block_bytes;
        const char *src = (const char *)src_base + src_offsets[i];
        // cudaMemcpyDefault: the source may be another device's memory mapped through IPC
        XFER_CUDA(cudaMemcpyAsync(dst, src, (size_t)block_bytes, cudaMemcpyDefault, st));
    }
    XFER_CUDA(cudaStreamSynchronize(st));
out:
    if (st)
        cudaStreamDestroy(st);
    return rc;
}

extern "C" int tdm_transfer_cuda_copy_h2d(int device, void *dst_base, const uint32_t *dst_blocks,
                                          const uint8_t *const *src, uint32_t n,
                                          uint64_t block_bytes, tdm_error_t *err)
{
    int rc = 0;
    cudaStream_t st = NULL;
    XFER_CUDA(cudaSetDevice(device));
    XFER_CUDA(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    for (uint32_t i = 0; i < n; i++) {
        char *dst = (char *)dst_base + (uint64_t)dst_blocks[i] * block_bytes;
        XFER_CUDA(cudaMemcpyAsync(dst, src[i], (size_t)block_bytes, cudaMemcpyHostToDevice, st));
    }
    XFER_CUDA(cudaStreamSynchronize(st));
out:
    if (st)
        cudaStreamDestroy(st);
    return rc;
}

// ---- NCCL ----

enum xfer_state {
    XFER_IDLE = 0,      // no transfer, or the last one completed
    XFER_ENQUEUING = 1, // ncclGroupEnd returned ncclInProgress: poll the communicator
    XFER_RUNNING = 2,   // enqueued; `done` recorded after it on the stream
};

struct tdm_transfer_nccl {
    int device;
    int rank; // 0 sends, 1 receives
    ncclComm_t comm;
    cudaStream_t stream;
    cudaEvent_t done;
    bool ready;
    int state;
};

extern "C" int tdm_transfer_nccl_unique_id(uint8_t id[TDM_XFER_NCCL_ID_BYTES], tdm_error_t *err)
{
    int rc = 0;
    ncclUniqueId uid;
    XFER_NCCL(ncclGetUniqueId(&uid));
    memcpy(id, &uid, sizeof uid);
out:
    return rc;
}

extern "C" void tdm_transfer_nccl_destroy(tdm_transfer_nccl_t **c_p)
{
    if (!c_p || !*c_p)
        return;
    tdm_transfer_nccl_t *c = *c_p;
    *c_p = NULL;
    cudaSetDevice(c->device);
    if (c->comm)
        ncclCommAbort(c->comm); // never waits for the peer; ends kernels the peer abandoned
    if (c->done)
        cudaEventDestroy(c->done);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c);
}

extern "C" tdm_transfer_nccl_t *tdm_transfer_nccl_new(int device,
                                                      const uint8_t id[TDM_XFER_NCCL_ID_BYTES],
                                                      int rank, tdm_error_t *err)
{
    int rc = 0;
    ncclUniqueId uid;
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    tdm_transfer_nccl_t *c = (tdm_transfer_nccl_t *)calloc(1, sizeof *c);
    if (!c) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory for an NCCL communicator");
        return NULL;
    }
    c->device = device;
    c->rank = rank;
    memcpy(&uid, id, sizeof uid);
    cfg.blocking = 0;
    XFER_CUDA(cudaSetDevice(device));
    XFER_CUDA(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    XFER_CUDA(cudaEventCreateWithFlags(&c->done, cudaEventDisableTiming));
    XFER_NCCL(ncclCommInitRankConfig(&c->comm, 2, uid, rank, &cfg));
out:
    if (rc != 0)
        tdm_transfer_nccl_destroy(&c);
    return c;
}

// The communicator's asynchronous state: 1 ncclSuccess, 0 ncclInProgress, or an error.
static int comm_state(tdm_transfer_nccl_t *c, tdm_error_t *err)
{
    int rc = 0;
    ncclResult_t st = ncclSuccess;
    XFER_NCCL(ncclCommGetAsyncError(c->comm, &st));
    if (st == ncclInProgress)
        return 0;
    if (st != ncclSuccess)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "NCCL communicator (rank %d): %s: %s", c->rank,
                             ncclGetErrorString(st), ncclGetLastError(c->comm));
    return 1;
out:
    return rc;
}

extern "C" int tdm_transfer_nccl_ready(tdm_transfer_nccl_t *c, tdm_error_t *err)
{
    if (c->ready)
        return 1;
    int rc = comm_state(c, err);
    if (rc == 1)
        c->ready = true;
    return rc;
}

extern "C" int tdm_transfer_nccl_start(tdm_transfer_nccl_t *c, void *base, const uint32_t *blocks,
                                       uint32_t n, uint64_t block_bytes, tdm_error_t *err)
{
    int rc = 0;
    int peer = 1 - c->rank;
    ncclResult_t end;
    if (!c->ready || c->state != XFER_IDLE)
        return tdm_error_set(err, TDM_EINTERNAL,
                             "NCCL transfer started on a busy or unready "
                             "communicator");
    XFER_CUDA(cudaSetDevice(c->device));
    XFER_NCCL(ncclGroupStart());
    for (uint32_t i = 0; i < n && rc == 0; i++) {
        char *p = (char *)base + (uint64_t)blocks[i] * block_bytes;
        ncclResult_t r =
            c->rank == 0 ? ncclSend(p, (size_t)block_bytes, ncclUint8, peer, c->comm, c->stream)
                         : ncclRecv(p, (size_t)block_bytes, ncclUint8, peer, c->comm, c->stream);
        if (r != ncclSuccess && r != ncclInProgress)
            rc = tdm_error_set(err, TDM_EUNAVAILABLE, "%s(block %u): %s: %s (%s:%d)",
                               c->rank == 0 ? "ncclSend" : "ncclRecv", i, ncclGetErrorString(r),
                               ncclGetLastError(c->comm), __FILE__, __LINE__);
    }
    end = ncclGroupEnd(); // always closes the group, even after a failed call inside it
    if (rc != 0)
        goto out;
    if (end == ncclInProgress) {
        c->state = XFER_ENQUEUING;
        return 0;
    }
    XFER_NCCL(end);
    XFER_CUDA(cudaEventRecord(c->done, c->stream));
    c->state = XFER_RUNNING;
out:
    return rc;
}

extern "C" int tdm_transfer_nccl_poll(tdm_transfer_nccl_t *c, tdm_error_t *err)
{
    int rc = 0;
    cudaError_t q;
    if (c->state == XFER_IDLE)
        return 1;
    if (c->state == XFER_ENQUEUING) {
        rc = comm_state(c, err);
        if (rc <= 0)
            return rc;
        rc = 0;
        XFER_CUDA(cudaSetDevice(c->device));
        XFER_CUDA(cudaEventRecord(c->done, c->stream));
        c->state = XFER_RUNNING;
    }
    q = cudaEventQuery(c->done);
    if (q == cudaErrorNotReady) {
        // still running: a peer failure shows up as an asynchronous communicator error
        rc = comm_state(c, err);
        return rc < 0 ? rc : 0;
    }
    if (q != cudaSuccess)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "cudaEventQuery(done): %s (%s:%d)",
                             cudaGetErrorString(q), __FILE__, __LINE__);
    c->state = XFER_IDLE;
    return 1;
out:
    return rc;
}
