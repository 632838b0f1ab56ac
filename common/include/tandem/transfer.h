/* transfer.h - KV transport: ships a request's KV-cache blocks from a prefill node's pool to
 * the blocks a decode node reserved for it, with a header (layout, model fingerprint,
 * per-block XXH3-64 checksums), an acknowledgement, a timeout and cancellation.
 *
 * Backends (chosen per channel, see docs/protocol.md "KV transfer"):
 *   tcp       ZeroMQ multipart over TCP from host memory; the sender's block frames point at
 *             pool memory (zmq_msg_init_data, zero-copy), the receiver verifies the checksums
 *             and copies each frame into its reserved block.
 *   nccl      ncclSend/ncclRecv between device pools; one communicator per sender-receiver
 *             pair, its unique id exchanged over the ZMQ channel (KvHello), created lazily and
 *             destroyed when the peer is lost. CUDA builds only.
 *   cuda_ipc  same host: the receiver opens the sender's pool through a cudaIpcMemHandle_t and
 *             copies the blocks device-to-device. CUDA builds only.
 * Every backend carries one XXH3-64 checksum per block: tcp's computed and verified on the
 * CPU; nccl's and cuda_ipc's computed on the sender's GPU and verified on the receiver's after
 * the blocks land (tdm_kv_device_checksums: the same value the CPU computes). A tcp transfer
 * into a device pool is verified on the host, then again on the device after the copy.
 *
 * Sequence (tcp): sender -> REQUEST KV_TRANSFER [KvTransfer header][block 0]...[block n-1];
 * receiver -> END OK (acknowledged: the blocks now hold the KV) or END with the rejection
 * status and reason. The sender holds a reference on every block it sends from the moment
 * tdm_kv_sender_send returns until the acknowledgement, rejection, timeout or cancel has been
 * reported by tdm_kv_sender_poll AND ZeroMQ has released the zero-copy frames, so the caller
 * may release its own references right after sending.
 *
 * Threads: a sender or receiver belongs to the thread that owns its KV pool (the engine
 * thread); the zero-copy release callbacks run on ZMQ I/O threads and only touch atomics.
 */
#ifndef TANDEM_TRANSFER_H
#define TANDEM_TRANSFER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/kv.h"
#include "tandem/log.h"
#include "tandem/net.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_kv_backend {
    TDM_KV_BACKEND_TCP = 0,
    TDM_KV_BACKEND_NCCL = 1,
    TDM_KV_BACKEND_CUDA_IPC = 2,
} tdm_kv_backend_t;

/* "tcp", "nccl", "cuda_ipc"; "?" otherwise. */
const char *tdm_kv_backend_name(tdm_kv_backend_t b);
/* Parses a backend name; TDM_EINVALID listing the accepted names otherwise. */
int tdm_kv_backend_parse(const char *name, tdm_kv_backend_t *out, tdm_error_t *err);
/* Whether this build can use the backend (nccl and cuda_ipc need a CUDA build). */
bool tdm_kv_backend_built(tdm_kv_backend_t b);

/* Where a pool's blocks live. Host pools use tdm_kv_pool_base(); a CUDA pool (issue: CUDA
 * backend) passes its device base pointer and device ordinal. */
typedef struct tdm_kv_memory {
    void *device_base; /* NULL: host memory at tdm_kv_pool_base(pool) */
    int device;        /* CUDA ordinal when device_base is set */
} tdm_kv_memory_t;

/* ---- sender (prefill node) ---- */

typedef struct tdm_kv_sender_opts {
    const char *node_id;           /* sender's node id (logs, KvTransfer.sender_node_id) */
    uint64_t model_fingerprint;    /* tdm_model_fingerprint of the served model */
    tdm_kv_backend_t backend;      /* tcp unless both ends have device pools */
    tdm_kv_memory_t memory;        /* zeroed: host pool */
    const tdm_curve_keys_t *curve; /* NULL: plain TCP (the keys are copied). CURVE: the
                                      sender's own pair (client_public, client_secret) and
                                      optionally a default receiver key (server_public) for
                                      sends that give no server_key */
    int timeout_ms;                /* acknowledgement timeout per transfer; 0 = 10000 */
    int threads;                   /* OpenMP threads that checksum a large transfer: the node's
                                      compute threads (no more, or their idle team spins under
                                      OMP_WAIT_POLICY=active); 0 = one per core */
    const tdm_logger_t *log;       /* copied; NULL = stderr */
} tdm_kv_sender_opts_t;

typedef struct tdm_kv_sender tdm_kv_sender_t;

/* Makes a sender over pool (which must outlive it). Channels to receivers are opened on first
 * use, one DEALER per endpoint. Returns NULL with *err set (TDM_EINVALID for an unbuilt
 * backend or bad options, TDM_ERESOURCE). */
tdm_kv_sender_t *tdm_kv_sender_new(tdm_net_t *net, tdm_kv_pool_t *pool,
                                   const tdm_kv_sender_opts_t *opts, tdm_error_t *err);

/* Cancels every transfer in flight, waits (at most 1 s) for ZeroMQ to release the frames,
 * drops the block references and closes the channels. NULL-safe, nulls *self_p. */
void tdm_kv_sender_destroy(tdm_kv_sender_t **self_p);

/* One transfer to start. */
typedef struct tdm_kv_send_req {
    const char *request_id; /* <= TDM_REQUEST_ID_MAX bytes: the client's id, a label */
    uint64_t attempt_id;    /* the router's dispatch attempt (KvTransfer.attempt_id): the
                               key under which the decode node reserved the blocks */
    const char *endpoint;   /* the decode node's KV endpoint */
    const uint32_t *blocks; /* [n_blocks] pool block ids holding the KV, in token order; over
                               a pool with layer groups group by group, each group's live
                               blocks (tdm_kv_transfer_blocks) */
    uint32_t n_blocks;      /* tdm_kv_transfer_blocks(pool, n_tokens) */
    uint32_t n_tokens;      /* tokens whose KV the blocks hold */
    int32_t first_token;    /* the token sampled at output index 0 */
    double prefill_s;       /* prefill compute time, reported to the decode node */
    const char *server_key; /* CURVE: the decode node's public key (Z85), which the channel to
                               endpoint authenticates; NULL: the sender's curve.server_public */
} tdm_kv_send_req_t;

/* Starts a transfer: references the blocks, computes their checksums, queues the message.
 * Over a pool with layer groups the header carries the groups (KvLayout.layers_per_group,
 * group_windows) and each group's first entry (KvTransfer.group_first_block, protocol 2.9).
 * Returns 0 with *transfer_id set; TDM_EINVALID (n_blocks is not tdm_kv_transfer_blocks, n_tokens
 * 0, a block id out of range or not in use, a malformed endpoint), TDM_EUNAVAILABLE (the
 * channel cannot be opened or its queue is full), TDM_ERESOURCE (out of memory); on error no
 * reference is kept and nothing is reported by tdm_kv_sender_poll. nccl: the first transfer
 * to an endpoint also sends KV_HELLO and starts creating the communicator (non-blocking). */
int tdm_kv_sender_send(tdm_kv_sender_t *s, const tdm_kv_send_req_t *req, uint64_t *transfer_id,
                       tdm_error_t *err);

/* Cancels the transfers of dispatch attempt attempt_id (a CANCEL goes to the receiver, which
 * drops the transfer if it has not acknowledged it). Each is then reported by
 * tdm_kv_sender_poll with TDM_ECANCELLED. Returns the number of transfers cancelled (0 when
 * none). */
int tdm_kv_sender_cancel(tdm_kv_sender_t *s, uint64_t attempt_id);

/* The outcome of one transfer. */
typedef struct tdm_kv_send_done {
    char request_id[TDM_REQUEST_ID_MAX + 1];
    uint64_t attempt_id;
    uint64_t transfer_id;
    int status;                   /* 0 = acknowledged; else the receiver's rejection status,
                                     TDM_EDEADLINE (no acknowledgement in time: receiver gone),
                                     TDM_ECANCELLED, TDM_EUNAVAILABLE (the channel was reset
                                     under it: another transfer to the same endpoint timed
                                     out, a receive failed, or NCCL set-up failed) */
    char message[TDM_ERRMSG_MAX]; /* the reason, "" on success */
    uint64_t bytes;               /* block bytes sent */
    double seconds;               /* send until acknowledgement */
} tdm_kv_send_done_t;

/* Processes acknowledgements and timeouts, waiting up to timeout_ms (0 = no wait) for the
 * first event, and writes up to cap finished transfers to out[]. A transfer is reported once,
 * after its block references were dropped. Returns the number written (>= 0), or
 * TDM_EINTERNAL. Call it regularly from the pool's thread. */
int tdm_kv_sender_poll(tdm_kv_sender_t *s, int timeout_ms, tdm_kv_send_done_t *out, int cap);

/* Transfers started and not yet reported. */
uint32_t tdm_kv_sender_in_flight(const tdm_kv_sender_t *s);

/* ---- receiver (decode node) ---- */

typedef struct tdm_kv_receiver_opts {
    const char *endpoint; /* ROUTER bind address, e.g. "tcp://127.0.0.1:7610" */
    const char *node_id;
    uint64_t model_fingerprint;    /* a transfer with another fingerprint is rejected */
    tdm_kv_memory_t memory;        /* zeroed: host pool */
    const tdm_curve_keys_t *curve; /* NULL: plain TCP. CURVE: the decode node's own pair
                                      (server_public, server_secret) and the senders it admits
                                      (clients[]: each prefill node's key, named by its id) */
    int timeout_ms;                /* nccl: how long recv waits for the blocks after saying
                                      go, and for a communicator to form; 0 = 10000 */
    int threads;                   /* OpenMP threads that copy and checksum a large transfer
                                      (as the sender's); 0 = one per core */
    uint64_t hold_bytes;           /* early transfers (the lookup said TDM_KV_LOOKUP_WAIT) held
                                      in all, bytes of their messages; 0: none held */
    int hold_ms;                   /* how long one is held before it is refused NOT_FOUND;
                                      0 = 5000 */
    const tdm_logger_t *log;
} tdm_kv_receiver_opts_t;

typedef struct tdm_kv_receiver tdm_kv_receiver_t;

/* Binds the receiver's endpoint. Returns NULL with *err set (TDM_EUNAVAILABLE: address in
 * use, TDM_EINVALID). pool must outlive the receiver. */
tdm_kv_receiver_t *tdm_kv_receiver_new(tdm_net_t *net, tdm_kv_pool_t *pool,
                                       const tdm_kv_receiver_opts_t *opts, tdm_error_t *err);
void tdm_kv_receiver_destroy(tdm_kv_receiver_t **self_p);

/* The socket to poll for ZMQ_POLLIN. */
void *tdm_kv_receiver_zsock(tdm_kv_receiver_t *r);
/* The bound endpoint (with the real port for "tcp://…:*"). */
const char *tdm_kv_receiver_endpoint(const tdm_kv_receiver_t *r);

/* Asked by the receiver for the blocks reserved for dispatch attempt attempt_id (request_id
 * is the client's id, for messages; n_tokens the tokens the transfer carries): sets *blocks
 * (owned by the callee, valid until tdm_kv_receiver_recv returns) and *n_blocks and returns 0,
 * or returns a status to reject with (TDM_ENOTFOUND for an unknown or cancelled attempt,
 * TDM_EINVALID for a token count the reservation does not match, TDM_ERESOURCE when no blocks
 * can be had) and says why in *err (tdm_error_set; never NULL). The returned status is the
 * one the transfer is rejected with; when *err has no message, the reason is that status's
 * text. Called only for a transfer whose header and header checksum verified (a tcp transfer's
 * block checksums are verified after it, or while its blocks are copied).
 * TDM_KV_LOOKUP_WAIT (positive) says the attempt's reservation is not decided yet (its
 * DecodeReserve may come after the transfer): the receiver holds the transfer, unanswered,
 * within opts' hold_bytes and hold_ms, until the node calls tdm_kv_receiver_resume or
 * tdm_kv_receiver_refuse for the attempt; over those bounds it is refused TDM_ENOTFOUND. */
#define TDM_KV_LOOKUP_WAIT 1
typedef int (*tdm_kv_lookup_fn)(void *user, const char *request_id, uint64_t attempt_id,
                                uint32_t n_tokens, const uint32_t **blocks, uint32_t *n_blocks,
                                tdm_error_t *err);

/* A processed transfer. */
typedef struct tdm_kv_received {
    char request_id[TDM_REQUEST_ID_MAX + 1];
    uint64_t attempt_id;
    uint64_t transfer_id;
    int status;                   /* 0 = accepted: the reserved blocks hold the KV */
    char message[TDM_ERRMSG_MAX]; /* why it was rejected */
    uint32_t n_tokens;
    int32_t first_token;
    uint32_t n_blocks;
    uint64_t bytes;
    double prefill_s;
    char sender_node_id[64];
} tdm_kv_received_t;

/* Receives and processes at most one transfer (waiting up to timeout_ms; 0 = no wait):
 * checks the header (layout equal to the pool's, layer groups included: a transfer whose blocks
 * hold every layer is refused by a pool with groups and the other way round, FAILED_PRECONDITION
 * naming both; fingerprint; block count against tdm_kv_transfer_blocks and against the reserved
 * blocks, each group's group_first_block against the formula; block sizes), verifies every
 * checksum, copies the blocks into the reserved ones, and acknowledges or rejects with a
 * reason naming what was wrong. Returns 1 with *out filled when a transfer was processed
 * (accepted or rejected: see out->status; on rejection the caller frees the request's
 * blocks), 0 when none arrived (CANCEL frames are consumed: a later transfer for that
 * request is rejected by the lookup), or TDM_EINTERNAL. Never crashes on what it receives.
 * A transfer whose CANCEL is already waiting right behind it is dropped unread: 1 with
 * out->status TDM_ECANCELLED and no reply (the lookup is not called).
 * Early transfers: one the lookup answers TDM_KV_LOOKUP_WAIT for is held (no reply, no
 * outcome: the call goes on with the next message) within opts' hold_bytes, else rejected
 * TDM_ENOTFOUND; each call first refuses (TDM_ENOTFOUND, unreported) those held longer than
 * hold_ms, and a CANCEL of a held transfer drops it unanswered.
 * Rejections leave the reserved blocks untouched, except with a device pool, whose data lands
 * in the blocks before the device checksums are verified, and nccl, where a failure while
 * receiving (timeout_ms passed, NCCL error) leaves them partly written. KV_HELLO requests
 * (nccl set-up) are answered inside this call, which then blocks until the communicator
 * forms (at most timeout_ms), as it does while an nccl transfer's blocks arrive. */
int tdm_kv_receiver_recv(tdm_kv_receiver_t *r, int timeout_ms, tdm_kv_lookup_fn lookup, void *user,
                         tdm_kv_received_t *out);

/* The reservation of attempt_id is decided: a transfer held for it (the lookup answered
 * TDM_KV_LOOKUP_WAIT) is processed now as tdm_kv_receiver_recv would, the lookup deciding
 * (a TDM_KV_LOOKUP_WAIT now is TDM_ENOTFOUND). Returns 1 with *out filled when one was held,
 * 0 when none was, TDM_EINTERNAL on bad arguments. */
int tdm_kv_receiver_resume(tdm_kv_receiver_t *r, uint64_t attempt_id, tdm_kv_lookup_fn lookup,
                           void *user, tdm_kv_received_t *out);

/* The reservation of attempt_id was refused: a transfer held for it is rejected with status
 * (a negative TDM_E code) and why ("reservation refused: " before it), and freed. Returns 1
 * when one was held, else 0. Cannot fail. */
int tdm_kv_receiver_refuse(tdm_kv_receiver_t *r, uint64_t attempt_id, int status, const char *why);

/* Transfers held now, and their bytes (tests, logs). Cannot fail. */
uint32_t tdm_kv_receiver_held(const tdm_kv_receiver_t *r, uint64_t *bytes);

/* Blocks a KV transfer of n_tokens tokens carries for pool: ceil(n_tokens / block_size) of a
 * plain pool; over a pool with layer groups (tdm_kv_pool_groups) the live blocks of each group,
 * group by group, tdm_kv_group_live(n_tokens, n_tokens) of group g from table entry
 * first[g] = tdm_kv_group_first_needed(n_tokens) on (first may be NULL; else it has
 * n_groups entries, untouched for a plain pool). The one count the sender, the receiver and a
 * decode node's reservation use; its bytes are this times tdm_kv_pool_block_bytes. Cannot
 * fail. */
uint64_t tdm_kv_transfer_blocks(const tdm_kv_pool_t *pool, uint32_t n_tokens, uint32_t *first);

/* Checksum of one block as carried in KvTransfer.checksums: XXH3_64bits over block_bytes. */
uint64_t tdm_kv_block_checksum(const void *block, uint64_t block_bytes);

/* tdm_kv_block_checksum of n blocks of a device pool, computed on the GPU (one CUDA thread
 * block per KV block, common/src/transfer/cuda/xxh3.cu): out[i] is XXH3-64 of the
 * block_bytes at device_base + blocks[i] * block_bytes on CUDA device `device`, equal to
 * what the CPU's XXH3_64bits gives for the same bytes. out is host memory; waits for the
 * result. Errors: TDM_EUNAVAILABLE (no CUDA build, a CUDA failure with the statement),
 * TDM_EINVALID (block_bytes < 241: XXH3's short-input paths are not on the device),
 * TDM_ERESOURCE. */
int tdm_kv_device_checksums(int device, const void *device_base, const uint32_t *blocks, uint32_t n,
                            uint64_t block_bytes, uint64_t *out, tdm_error_t *err);

/* KvTransfer.header_checksum of header h (docs/protocol.md "KV transfer integrity"): XXH3-64
 * of a canonical little-endian encoding of every field but header_checksum itself (request
 * and attempt ids, transfer id, token count, first token, layout, model fingerprint, block
 * count and bytes, checksum kind, backend, sender, prefill time, ipc handles), then chained
 * (XXH3_64bits_withSeed, the previous value as seed) over the block checksums and over the
 * block offsets in order. The block checksums cover the bytes, so one value covers the whole
 * transfer. With layer groups (2.9) the layout's layers_per_group and group_windows and the
 * group_first_block values are encoded too (after the ipc handles); a header without groups
 * encodes as before 2.9. Cannot fail. */
uint64_t tdm_kv_header_checksum(const Tandem__V1__KvTransfer *h);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_TRANSFER_H */
