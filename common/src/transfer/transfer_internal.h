/* transfer_internal.h - the state and functions the KV transport's files share (the one header
 * they include; each declaration below names the file that defines it):
 *
 *   header.c    backend names and the KvTransfer header: what the sender writes, what the
 *               receiver checks before it looks at the blocks
 *   checksum.c  block checksums (CPU and GPU), the header checksum, their comparison
 *   sender.c    the sender: transfer records, send, cancel, answers, deadlines, poll
 *   channel.c   the sender's channels to receivers: open, reset, connection loss, CURVE
 *   receiver.c  the receiver: bind, recv, the reserved blocks (lookup), the reply
 *   tcp.c       the tcp backend: zero-copy frames and their release, checksum verification
 *               and the copies into a host pool
 *   device.c    the nccl and cuda_ipc backends (CUDA builds only)
 *
 * A sender keeps one channel per receiver endpoint (a DEALER socket, plus an NCCL
 * communicator for the nccl backend) and one record per transfer, in send order. A record
 * lives from tdm_kv_sender_send until tdm_kv_sender_poll reports it, which it does only when
 * the outcome is known (`finished`) and nothing may still read the blocks (`busy` false:
 * every zero-copy frame released, no NCCL send running).
 *
 * Errors: every function that can reject or fail sets a tdm_error_t (never NULL inside the
 * module) and returns its code.
 */
#ifndef TANDEM_TRANSFER_INTERNAL_H
#define TANDEM_TRANSFER_INTERNAL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <unistd.h>

#include "tandem/transfer.h"

/* Wakes tdm_kv_sender_poll when the last zero-copy frame of a transfer is released. Shared
 * between the sender and the ZMQ I/O threads, so reference-counted: the sender holds one
 * reference, and each transfer with frames in ZMQ's hands holds one, dropped by the release
 * callback of its last frame after it wrote to the pipe. */
typedef struct tdm_kv_notify {
    atomic_uint refs;
    int fds[2]; /* pipe: [0] polled by the sender, [1] written by release callbacks */
} tdm_kv_notify_t;

struct tdm_transfer_nccl;
struct tdm_kv_xfer;

/* One receiver endpoint. */
typedef struct tdm_kv_channel {
    struct tdm_kv_channel *next;
    char *endpoint;
    char server_key[41];            /* CURVE: the receiver's public key the socket was opened
                                       with; "" = the sender's curve.server_public */
    tdm_sock_t *sock;               /* NULL after a reset, until the next send reopens it */
    uint32_t generation;            /* incremented by every reset */
    uint64_t disconnects;           /* tdm_sock_disconnects(sock) last seen */
    double resend_by;               /* transfers were sent again on a new socket after the
                                       connection was lost: its handshake must succeed by
                                       then (tdm_time_now() clock); 0 = nothing waits */
    struct tdm_transfer_nccl *comm; /* nccl: communicator with the receiver (rank 0), or NULL */
    bool comm_ready;                /* nccl: the communicator finished initialising */
    uint64_t hello_call_id;         /* nccl: the KV_HELLO call of comm, 0 = answered */
    struct tdm_kv_xfer *launched;   /* nccl: the transfer whose ncclSend runs, or NULL */
} tdm_kv_channel_t;

/* One transfer on the sender. */
typedef struct tdm_kv_xfer {
    struct tdm_kv_xfer *next;
    uint64_t id; /* transfer id = call id of the KV_TRANSFER request */
    char request_id[TDM_REQUEST_ID_MAX + 1];
    uint64_t attempt_id;
    tdm_kv_channel_t *ch;
    uint32_t generation; /* ch->generation when sent: that socket holds its frames */
    uint32_t *blocks;    /* [n_blocks] referenced pool blocks */
    uint32_t n_blocks;
    uint64_t bytes;
    uint32_t n_tokens; /* header fields, kept to send the transfer again */
    int32_t first_token;
    double prefill_s;
    uint32_t resends;        /* times sent again after its connection was lost */
    atomic_uint pending;     /* zero-copy frames ZMQ has not released yet */
    tdm_kv_notify_t *notify; /* referenced while pending > 0 */
    double t_start;          /* tdm_time_now() at send */
    double deadline;         /* t_start + timeout */
    bool finished;           /* outcome known (status, message, seconds) */
    bool silent;             /* failed inside tdm_kv_sender_send: never reported */
    bool go;                 /* nccl: the receiver accepted the header and posted its receives */
    int status;
    char message[TDM_ERRMSG_MAX];
    double seconds;
} tdm_kv_xfer_t;

struct tdm_kv_sender {
    tdm_net_t *net;
    tdm_kv_pool_t *pool;
    tdm_kv_layout_t layout;              /* the pool's: with groups, one group's layers */
    const tdm_kv_groups_t *groups;       /* the pool's layer groups, NULL for a plain pool */
    uint32_t windows[TDM_KV_MAX_LAYERS]; /* [groups->n_groups] KvLayout.group_windows */
    uint32_t first[TDM_KV_MAX_LAYERS];   /* [groups->n_groups] the transfer being built's
                                            KvTransfer.group_first_block */
    uint64_t block_bytes;
    uint32_t pool_blocks;
    char node_id[64];
    uint64_t model_fingerprint;
    tdm_kv_backend_t backend;
    tdm_kv_memory_t memory;
    tdm_curve_keys_t curve; /* owned copies of the key strings; all NULL = plain */
    bool has_curve;
    int timeout_ms;
    int threads; /* OpenMP threads for checksums (>= 1) */
    tdm_logger_t log_store;
    const tdm_logger_t *log; /* &log_store or NULL */

    tdm_kv_channel_t *channels;
    uint32_t n_channels;
    tdm_kv_xfer_t *xfers; /* in send order */
    tdm_kv_xfer_t *xfers_tail;
    uint32_t n_reportable; /* records that tdm_kv_sender_poll will report */
    uint64_t next_id;      /* call ids: transfers and KV_HELLO calls */
    tdm_kv_notify_t *notify;
    void *poll_items; /* zmq_pollitem_t[poll_cap] */
    uint32_t poll_cap;
    tdm_frame_t frame;

    uint8_t ipc_handle[64]; /* cuda_ipc: handle of memory.device_base */
};

/* A per-sender NCCL communicator on the receiver side. */
typedef struct tdm_kv_peer_comm {
    struct tdm_kv_peer_comm *next;
    uint8_t peer[TDM_NET_PEER_MAX]; /* the sender's routing id */
    size_t peer_len;
    char sender_node_id[64];
    struct tdm_transfer_nccl *comm;
} tdm_kv_peer_comm_t;

/* A sender pool mapped through CUDA IPC on the receiver side. */
typedef struct tdm_kv_peer_ipc {
    struct tdm_kv_peer_ipc *next;
    char sender_node_id[64];
    uint8_t handle[64];
    void *base;
} tdm_kv_peer_ipc_t;

/* Most early transfers a receiver holds at once (receiver.c; as the socket's queue). */
#define TDM_KV_HELD_MAX 64
#define TDM_KV_DEFAULT_HOLD_MS 5000

/* A transfer that came before its reservation was decided, held unanswered (receiver.c). */
typedef struct tdm_kv_held {
    tdm_frame_t f;       /* its message, in ZMQ's buffers */
    uint64_t attempt_id; /* the reservation it waits for */
    uint64_t bytes;      /* its parts' bytes, against hold_bytes */
    double until;        /* monotonic s; refused NOT_FOUND after it */
} tdm_kv_held_t;

struct tdm_kv_receiver {
    tdm_net_t *net;
    tdm_kv_pool_t *pool;
    tdm_kv_layout_t layout;        /* the pool's: with groups, one group's layers */
    const tdm_kv_groups_t *groups; /* the pool's layer groups, NULL for a plain pool */
    uint64_t block_bytes;
    uint32_t pool_blocks;
    tdm_sock_t *sock;
    char node_id[64];
    uint64_t model_fingerprint;
    tdm_kv_memory_t memory;
    int timeout_ms;
    int threads; /* OpenMP threads for copies and checksums (>= 1) */
    tdm_logger_t log_store;
    const tdm_logger_t *log;
    tdm_frame_t frames[2]; /* frames[cur]: the message being handled; the other one holds */
    int cur;               /* a message read ahead (has_next) while looking for a CANCEL */
    bool has_next;
    uint64_t *sums;      /* [pool_blocks] scratch: checksums computed while verifying */
    const uint8_t **src; /* [pool_blocks] scratch: data frame pointers (tcp into a device pool) */
    tdm_kv_peer_comm_t *comms;
    tdm_kv_peer_ipc_t *ipcs;
    tdm_kv_held_t held[TDM_KV_HELD_MAX]; /* [n_held] early transfers, oldest first */
    uint32_t n_held;
    uint64_t held_bytes, hold_bytes; /* held now; the bound (0: none held) */
    int hold_ms;
};

/* ---- shared constants and helpers ---- */

#define TDM_KV_DEFAULT_TIMEOUT_MS 10000
/* Transfers of at least this many blocks checksum and copy with OpenMP threads. */
#define TDM_KV_PARALLEL_BLOCKS 8u

/* Copies src (NULL: "") into dst[cap], cut to fit; cannot fail. */
static inline void tdm_kv_copy_str(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

/* The OpenMP threads of a transfer's checksums and copies for opts' threads (0: one per
 * core, as sysconf reports them; 1 when it cannot tell). */
static inline int tdm_kv_threads(int threads)
{
    if (threads > 0)
        return threads;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 && n < 1024 ? (int)n : 1;
}

/* ---- header.c: the KvTransfer header ---- */

/* The wire layout of a pool (KvLayout): the model's layers (with groups, groups->n_layers, not
 * the pool's layers_per_group) and, with groups, layers_per_group and group_windows pointing at
 * windows[groups->n_groups] (filled here; the caller keeps it while m is used). Cannot fail. */
void tdm_kv_wire_layout(const tdm_kv_layout_t *pool_layout, const tdm_kv_groups_t *groups,
                        uint32_t *windows, Tandem__V1__KvLayout *m);

/* The KvTransfer header of transfer x into *h. sums[x->n_blocks]: the block checksums; with
 * cuda_ipc, offsets[x->n_blocks]: the blocks' byte offsets in the pool. *h points at lay,
 * handle, sums and offsets, which the caller keeps until the header is sent. Cannot fail. */
void tdm_kv_header_build(const tdm_kv_sender_t *s, const tdm_kv_xfer_t *x, uint64_t *sums,
                         uint64_t *offsets, Tandem__V1__KvTransfer *h, Tandem__V1__KvLayout *lay,
                         ProtobufCBinaryData *handle);

/* Checks header h of message f against receiver r: the request id, the backend (known, built
 * in, one r's pool can take), the layout, model fingerprint, block size and count, checksum
 * kind, and the backend's framing (tcp: one data frame of block_bytes per block; nccl,
 * cuda_ipc: none, and cuda_ipc's handle and offsets). Not the checksums' values nor the
 * reserved blocks. Returns 0 with *backend set, or the status to reject with (TDM_EINVALID,
 * TDM_EPRECONDITION, TDM_ERESOURCE) with *err set. */
int tdm_kv_header_check(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                        const Tandem__V1__KvTransfer *h, tdm_kv_backend_t *backend,
                        tdm_error_t *err);

/* ---- checksum.c ---- */

/* got[0..h->n_blocks) against h->checksums: 0, or TDM_EINVALID naming the first block that
 * differs, with *err set. */
int tdm_kv_checksums_compare(const uint64_t *got, const Tandem__V1__KvTransfer *h,
                             tdm_error_t *err);

/* ---- sender.c ---- */

/* Records x's outcome (once: later calls do nothing) and the seconds since it was sent. */
void tdm_kv_xfer_finish(tdm_kv_xfer_t *x, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Sends x's header and (tcp) its blocks on x->ch's socket, as call x->id: the first time, or
 * again after the connection was lost. Returns 0, or with *err set: TDM_EUNAVAILABLE (the
 * socket's queue is full or its peer gone, or the device checksums failed), TDM_EINVALID (a
 * message limit exceeded), TDM_ERESOURCE (out of memory). */
int tdm_kv_xfer_transmit(tdm_kv_sender_t *s, tdm_kv_xfer_t *x, tdm_error_t *err);

/* ---- channel.c ---- */

/* The channel to endpoint, made (and its socket opened) when needed, authenticating the
 * receiver by server_key (CURVE; NULL: the sender's curve.server_public). A channel whose
 * receiver key changed is reset and reopened with the new one. Returns NULL with *err set
 * (TDM_EINVALID: a malformed key or endpoint, TDM_EUNAVAILABLE, TDM_ERESOURCE). */
tdm_kv_channel_t *tdm_kv_channel_get(tdm_kv_sender_t *s, const char *endpoint,
                                     const char *server_key, tdm_error_t *err);

/* Closes ch's socket (linger 0: ZMQ drops what is queued and releases the zero-copy frames)
 * and its communicator; the transfers still waiting on ch fail with TDM_EUNAVAILABLE and why.
 * The next send to the endpoint opens a new socket. */
void tdm_kv_channel_reset(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, const char *why);

/* Drops ch's NCCL communicator (if any) and forgets the go of its transfers: the receiver's
 * side of the communicator is gone too, so their blocks will not be asked for. */
void tdm_kv_channel_drop_comm(tdm_kv_sender_t *s, tdm_kv_channel_t *ch);

/* Watches every channel once per poll: a failed CURVE handshake fails its transfers
 * (TDM_EUNAUTHENTICATED) and resets it; a lost connection sends its transfers again (tcp) or
 * fails them (TDM_EUNAVAILABLE); a new connection that does not complete its handshake in
 * time after a resend resets the channel. */
void tdm_kv_channels_check(tdm_kv_sender_t *s, double now);

/* Frees every channel (their sockets and communicators already closed). */
void tdm_kv_channels_free(tdm_kv_sender_t *s);

/* ---- tcp.c ---- */

/* The release pipe: NULL on out of memory or when the pipe cannot be made. */
tdm_kv_notify_t *tdm_kv_notify_new(void);
/* Drops a reference; the last one closes the pipe and frees it. Accepts NULL. */
void tdm_kv_notify_unref(tdm_kv_notify_t *n);
/* Empties the pipe (the wake-ups were seen). */
void tdm_kv_notify_drain(tdm_kv_notify_t *n);

/* data[i] = a zero-copy frame over block i of x, released through x->pending and x->notify,
 * and sums[i] = its checksum (OpenMP threads for large transfers). Cannot fail. */
void tdm_kv_tcp_frames(tdm_kv_sender_t *s, tdm_kv_xfer_t *x, tdm_net_data_t *data, uint64_t *sums);

/* Receiver: whether the tcp transfer h into blocks is verified while it is copied
 * (tdm_kv_tcp_write) rather than before. */
bool tdm_kv_tcp_fused(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                      const uint32_t *blocks);

/* Receiver: every block's checksum in f's data frames against h's. Returns 0, or
 * TDM_EINVALID naming the first block that differs, with *err set. */
int tdm_kv_tcp_verify(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                      const Tandem__V1__KvTransfer *h, tdm_error_t *err);

/* Receiver: copies f's data frames into the reserved blocks (verifying them on the way when
 * tdm_kv_tcp_fused). A device pool copies host to device (CUDA builds). Returns 0, or the
 * status to reject with (TDM_EINVALID: a checksum differs; TDM_EUNAVAILABLE: the copy to
 * the device failed) with *err set. */
int tdm_kv_tcp_write(tdm_kv_receiver_t *r, const tdm_frame_t *f, const Tandem__V1__KvTransfer *h,
                     const uint32_t *blocks, tdm_error_t *err);

#ifdef TANDEM_HAVE_CUDA
/* ---- device.c: the device backends (CUDA builds only) ---- */

/* Sender set-up: cuda_ipc takes the handle of memory.device_base. */
int tdm_kv_dev_sender_init(tdm_kv_sender_t *s, tdm_error_t *err);

/* Before sending a transfer's header on ch (nccl): makes the communicator and sends KV_HELLO
 * when the channel has none. Returns 0 or TDM_EUNAVAILABLE with *err set. */
int tdm_kv_dev_sender_prepare(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, tdm_error_t *err);

/* Drives NCCL on every channel: communicator creation, starting the sends of transfers the
 * receiver said go to, completion. Failures finish the transfers concerned. */
void tdm_kv_dev_sender_progress(tdm_kv_sender_t *s);

/* An END answering a KV_HELLO call of ch. */
void tdm_kv_dev_sender_hello_end(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, const tdm_frame_t *f);

/* Drops ch's communicator (aborting a running transfer). */
void tdm_kv_dev_channel_drop_comm(tdm_kv_channel_t *ch);

/* Receiver: handles a KV_HELLO request (replies itself). */
void tdm_kv_dev_hello(tdm_kv_receiver_t *r, const tdm_frame_t *f);

/* Receiver: moves an accepted device-backend transfer into the reserved blocks. cuda_ipc
 * copies device to device from the sender's pool; nccl says go (STREAM) and receives.
 * Returns 0 or the status to reject with (TDM_EUNAVAILABLE, TDM_EDEADLINE,
 * TDM_EPRECONDITION: no communicator with the sender, TDM_ERESOURCE) with *err set. */
int tdm_kv_dev_receive(tdm_kv_receiver_t *r, const tdm_frame_t *f, const Tandem__V1__KvTransfer *h,
                       tdm_kv_backend_t backend, const uint32_t *blocks, tdm_error_t *err);

/* Receiver: tcp blocks into a device pool (host to device): src[n] host pointers of
 * block_bytes each. Returns 0 or TDM_EUNAVAILABLE with *err set. */
int tdm_kv_dev_copy_h2d(tdm_kv_receiver_t *r, const uint8_t *const *src, const uint32_t *blocks,
                        uint32_t n, tdm_error_t *err);

/* Device pools: the checksums of the n_blocks blocks now in the reserved device blocks,
 * computed on this node's GPU, against h->checksums (tdm_kv_device_checksums). Returns 0, or
 * TDM_EINVALID naming the first block that differs (the blocks hold what arrived: the caller
 * frees them), or TDM_EUNAVAILABLE when the GPU could not compute them; *err set. */
int tdm_kv_dev_verify(tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h, const uint32_t *blocks,
                      tdm_error_t *err);

/* Receiver: closes IPC mappings and communicators. */
void tdm_kv_dev_receiver_free(tdm_kv_receiver_t *r);
#endif

#endif /* TANDEM_TRANSFER_INTERNAL_H */
