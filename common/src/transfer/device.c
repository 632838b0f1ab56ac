/* device.c - the device backends of the KV transport (nccl, cuda_ipc) on the protocol side:
 * KV_HELLO and per-pair NCCL communicators, the go/receive handshake of nccl transfers, the
 * CUDA IPC mappings of sender pools. The CUDA and NCCL calls themselves are in
 * cuda/transfer_cuda.cu. Compiled only into CUDA builds (TANDEM_HAVE_CUDA).
 *
 * nccl sequence (docs/protocol.md "KV transfer"): the sender's first transfer to an endpoint
 * sends REQUEST KV_HELLO {ncclUniqueId} and starts creating its communicator (rank 0,
 * non-blocking); the receiver creates rank 1 while answering the hello. Each transfer's
 * header then travels over ZMQ with no data frames; the receiver checks it, asks for the
 * reserved blocks, posts its ncclRecv group and answers STREAM (go); the sender, on go,
 * posts the matching ncclSend group; the receiver waits for its receives and answers END.
 * A rejection before go leaves the communicator usable; any failure after go destroys it on
 * both sides (the sender re-hellos on its next transfer).
 *
 * Integrity, as for tcp: the sender computes every block's XXH3-64 on its GPU
 * (tdm_kv_device_checksums, cuda/xxh3.cu: only the 8-byte results cross to the host) into the
 * header's checksums, which the header checksum covers; after the blocks land (and after a
 * tcp transfer's host-to-device copy) the receiver hashes its device blocks the same way and
 * rejects the transfer on any difference (tdm_kv_dev_verify).
 */
#ifdef TANDEM_HAVE_CUDA

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "transfer/transfer_cuda.h"
#include "transfer/transfer_internal.h"

static void sleep_us(long us)
{
    struct timespec ts = {.tv_sec = 0, .tv_nsec = us * 1000};
    nanosleep(&ts, NULL);
}

/* ---- sender ---- */

int tdm_kv_dev_sender_init(tdm_kv_sender_t *s, tdm_error_t *err)
{
    if (s->backend != TDM_KV_BACKEND_CUDA_IPC)
        return 0;
    int rc =
        tdm_transfer_cuda_ipc_handle(s->memory.device, s->memory.device_base, s->ipc_handle, err);
    if (rc != 0)
        tdm_error_prefix(err, rc, "KV sender (cuda_ipc): ");
    return rc;
}

void tdm_kv_dev_channel_drop_comm(tdm_kv_channel_t *ch)
{
    tdm_transfer_nccl_destroy(&ch->comm);
    ch->comm_ready = false;
    ch->hello_call_id = 0;
    ch->launched = NULL;
}

int tdm_kv_dev_sender_prepare(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, tdm_error_t *err)
{
    if (ch->comm)
        return 0;
    uint8_t id[TDM_XFER_NCCL_ID_BYTES];
    int rc = tdm_transfer_nccl_unique_id(id, err);
    if (rc != 0)
        return tdm_error_prefix(err, rc, "KV hello to %s: ", ch->endpoint);
    ch->comm = tdm_transfer_nccl_new(s->memory.device, id, 0, err);
    if (!ch->comm)
        return tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE,
                                "KV hello to %s: ", ch->endpoint);
    Tandem__V1__KvHello hello = TANDEM__V1__KV_HELLO__INIT;
    hello.sender_node_id = s->node_id;
    hello.backend = "nccl";
    hello.nccl_unique_id.len = sizeof id;
    hello.nccl_unique_id.data = id;
    tdm_send_t m;
    memset(&m, 0, sizeof m);
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = TANDEM__V1__METHOD__METHOD_KV_HELLO;
    m.call_id = s->next_id++;
    m.deadline_unix_ms = tdm_net_now_ms() + (uint64_t)s->timeout_ms;
    m.body = &hello.base;
    if (tdm_sock_send(ch->sock, &m) != 0) {
        tdm_kv_dev_channel_drop_comm(ch);
        return tdm_error_set(err, TDM_EUNAVAILABLE, "KV hello to %s: %s", ch->endpoint,
                             tdm_sock_errmsg(ch->sock));
    }
    ch->hello_call_id = m.call_id;
    ch->comm_ready = false;
    TDM_LOG_DEBUGF(s->log, NULL, "KV hello (nccl) sent to %s", ch->endpoint);
    return 0;
}

/* Fails what waits on ch's communicator and drops it. */
static void channel_comm_failed(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, int status,
                                const char *why)
{
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
        if (x->ch == ch && !x->finished)
            tdm_kv_xfer_finish(x, status, "NCCL channel to %s: %s", ch->endpoint, why);
    TDM_LOG_WARNF(s->log, NULL, "KV NCCL channel to %s dropped: %s", ch->endpoint, why);
    tdm_kv_channel_drop_comm(s, ch);
}

void tdm_kv_dev_sender_hello_end(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, const tdm_frame_t *f)
{
    ch->hello_call_id = 0;
    if (f->status == 0)
        return;
    char why[TDM_ERRMSG_MAX];
    snprintf(why, sizeof why, "hello refused: %.480s", f->message);
    channel_comm_failed(s, ch, f->status, why);
}

void tdm_kv_dev_sender_progress(tdm_kv_sender_t *s)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        if (!ch->comm)
            continue;
        tdm_error_t e = {0};
        int rc;
        if (!ch->comm_ready) {
            rc = tdm_transfer_nccl_ready(ch->comm, &e);
            if (rc < 0) {
                channel_comm_failed(s, ch, TDM_EUNAVAILABLE, e.msg);
                continue;
            }
            if (rc == 0)
                continue;
            ch->comm_ready = true;
        }
        if (ch->launched) {
            rc = tdm_transfer_nccl_poll(ch->comm, &e);
            if (rc < 0) {
                channel_comm_failed(s, ch, TDM_EUNAVAILABLE, e.msg);
                continue;
            }
            if (rc == 0)
                continue;
            ch->launched = NULL;
        }
        /* The receiver handles transfers one at a time, so at most one has go. */
        for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next) {
            if (x->ch != ch || !x->go)
                continue;
            x->go = false;
            rc = tdm_transfer_nccl_start(ch->comm, s->memory.device_base, x->blocks, x->n_blocks,
                                         s->block_bytes, &e);
            if (rc < 0)
                channel_comm_failed(s, ch, TDM_EUNAVAILABLE, e.msg);
            else
                ch->launched = x;
            break;
        }
    }
}

/* ---- receiver ---- */

static void peer_comm_free(tdm_kv_peer_comm_t *p)
{
    tdm_transfer_nccl_destroy(&p->comm);
    free(p);
}

/* Drops the communicators of this peer or of this sender node (an older connection). */
static void drop_peer_comms(tdm_kv_receiver_t *r, const uint8_t *peer, size_t peer_len,
                            const char *node_id)
{
    tdm_kv_peer_comm_t **pp = &r->comms;
    while (*pp) {
        tdm_kv_peer_comm_t *p = *pp;
        bool same_peer = p->peer_len == peer_len && memcmp(p->peer, peer, peer_len) == 0;
        bool same_node = node_id && node_id[0] && strcmp(p->sender_node_id, node_id) == 0;
        if (same_peer || same_node) {
            *pp = p->next;
            peer_comm_free(p);
        } else {
            pp = &p->next;
        }
    }
}

/* The KvHello's fields: an nccl hello, to a node with a device pool, with a whole NCCL
 * unique id. Returns 0 or the status to refuse it with, *err set. */
static int hello_check(const tdm_kv_receiver_t *r, const Tandem__V1__KvHello *h, tdm_error_t *err)
{
    if (!h)
        return tdm_error_set(err, TDM_EINVALID, "KvHello does not decode");
    if (strcmp(h->backend, "nccl") != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "KvHello backend \"%.32s\": only nccl needs a hello", h->backend);
    if (!r->memory.device_base)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "nccl needs a device pool; this node's pool is in host memory");
    if (h->nccl_unique_id.len != TDM_XFER_NCCL_ID_BYTES)
        return tdm_error_set(err, TDM_EINVALID, "nccl_unique_id is %zu bytes; expected %u",
                             h->nccl_unique_id.len, TDM_XFER_NCCL_ID_BYTES);
    return 0;
}

/* Forms the receiving side (rank 1) of the NCCL communicator the hello's sender started,
 * waiting at most the receiver's timeout, and keeps it for the sender's peer. Returns 0 or
 * the status to refuse the hello with (TDM_EUNAVAILABLE, TDM_EDEADLINE, TDM_ERESOURCE), *err
 * set. */
static int hello_comm_new(tdm_kv_receiver_t *r, const tdm_frame_t *f, const Tandem__V1__KvHello *h,
                          tdm_error_t *err)
{
    tdm_error_t e = {0};
    drop_peer_comms(r, f->peer, f->peer_len, h->sender_node_id);
    tdm_transfer_nccl_t *comm =
        tdm_transfer_nccl_new(r->memory.device, h->nccl_unique_id.data, 1, &e);
    if (!comm)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "%s", e.msg);
    double until = tdm_time_now() + r->timeout_ms / 1e3;
    int rc;
    while ((rc = tdm_transfer_nccl_ready(comm, &e)) == 0 && tdm_time_now() < until)
        sleep_us(1000);
    if (rc != 1) {
        tdm_transfer_nccl_destroy(&comm);
        return rc < 0 ? tdm_error_set(err, TDM_EUNAVAILABLE, "%s", e.msg)
                      : tdm_error_set(err, TDM_EDEADLINE,
                                      "NCCL communicator with %s not formed within %d ms",
                                      h->sender_node_id, r->timeout_ms);
    }
    tdm_kv_peer_comm_t *p = calloc(1, sizeof *p);
    if (!p) {
        tdm_transfer_nccl_destroy(&comm);
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    memcpy(p->peer, f->peer, f->peer_len);
    p->peer_len = f->peer_len;
    snprintf(p->sender_node_id, sizeof p->sender_node_id, "%s", h->sender_node_id);
    p->comm = comm;
    p->next = r->comms;
    r->comms = p;
    return 0;
}

void tdm_kv_dev_hello(tdm_kv_receiver_t *r, const tdm_frame_t *f)
{
    Tandem__V1__KvHello *h =
        (Tandem__V1__KvHello *)tdm_frame_unpack(f, &tandem__v1__kv_hello__descriptor);
    tdm_error_t e = {0};
    int st = hello_check(r, h, &e);
    if (st == 0)
        st = hello_comm_new(r, f, h, &e);
    if (st == 0) {
        Tandem__V1__KvHelloAck ack = TANDEM__V1__KV_HELLO_ACK__INIT;
        ack.backend = "nccl";
        tdm_sock_reply(r->sock, f, &ack.base);
        TDM_LOG_INFOF(r->log, NULL, "KV NCCL communicator with %s formed", h->sender_node_id);
    } else {
        tdm_sock_reply_error(r->sock, f, st, "%s", e.msg);
        TDM_LOG_WARNF(r->log, NULL, "KV hello refused: %s %s", tdm_status_name(st), e.msg);
    }
    if (h)
        protobuf_c_message_free_unpacked(&h->base, NULL);
}

/* The mapping of the pool of sender node_id whose IPC handle is handle: kept from an earlier
 * transfer, or opened now (one of that sender's with another handle is closed: its pool
 * changed). Returns NULL with *err set (TDM_ERESOURCE, TDM_EUNAVAILABLE). */
static tdm_kv_peer_ipc_t *ipc_mapping(tdm_kv_receiver_t *r, const char *node_id,
                                      const uint8_t *handle, tdm_error_t *err)
{
    tdm_kv_peer_ipc_t **pp = &r->ipcs;
    while (*pp) {
        tdm_kv_peer_ipc_t *p = *pp;
        if (strcmp(p->sender_node_id, node_id) == 0) {
            if (memcmp(p->handle, handle, sizeof p->handle) == 0)
                return p;
            /* The sender's pool changed (a restart): unmap the old one. */
            *pp = p->next;
            tdm_transfer_cuda_ipc_close(r->memory.device, p->base, NULL);
            free(p);
            continue;
        }
        pp = &p->next;
    }
    tdm_kv_peer_ipc_t *p = calloc(1, sizeof *p);
    if (!p) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    tdm_error_t e = {0};
    if (tdm_transfer_cuda_ipc_open(r->memory.device, handle, &p->base, &e) != 0) {
        free(p);
        tdm_error_set(err, TDM_EUNAVAILABLE, "cuda_ipc: %s", e.msg);
        return NULL;
    }
    snprintf(p->sender_node_id, sizeof p->sender_node_id, "%s", node_id);
    memcpy(p->handle, handle, sizeof p->handle);
    p->next = r->ipcs;
    r->ipcs = p;
    return p;
}

int tdm_kv_dev_receive(tdm_kv_receiver_t *r, const tdm_frame_t *f, const Tandem__V1__KvTransfer *h,
                       tdm_kv_backend_t backend, const uint32_t *blocks, tdm_error_t *err)
{
    tdm_error_t e = {0};
    int st = 0;
    if (backend == TDM_KV_BACKEND_CUDA_IPC) {
        tdm_kv_peer_ipc_t *p = ipc_mapping(r, h->sender_node_id, h->ipc_handles[0].data, err);
        if (!p)
            return err->code;
        if (tdm_transfer_cuda_copy_d2d(r->memory.device, r->memory.device_base, blocks, p->base,
                                       h->block_offsets, h->n_blocks, r->block_bytes, &e) != 0)
            return tdm_error_set(err, TDM_EUNAVAILABLE, "cuda_ipc copy: %s", e.msg);
        return 0;
    }
    /* nccl */
    tdm_kv_peer_comm_t *p = r->comms;
    while (p && !(p->peer_len == f->peer_len && memcmp(p->peer, f->peer, f->peer_len) == 0))
        p = p->next;
    if (!p)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "no NCCL communicator with this sender (KV_HELLO first)");
    if (tdm_transfer_nccl_start(p->comm, r->memory.device_base, blocks, h->n_blocks, r->block_bytes,
                                &e) != 0) {
        st = tdm_error_set(err, TDM_EUNAVAILABLE, "%s", e.msg);
        goto out_drop;
    }
    tdm_send_t go;
    memset(&go, 0, sizeof go);
    go.peer = f->peer;
    go.peer_len = f->peer_len;
    go.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM;
    go.method = TANDEM__V1__METHOD__METHOD_KV_TRANSFER;
    go.call_id = f->call_id;
    if (tdm_sock_send(r->sock, &go) != 0) {
        st = tdm_error_set(err, TDM_EUNAVAILABLE, "go not sent: %s", tdm_sock_errmsg(r->sock));
        goto out_drop;
    }
    double until = tdm_time_now() + r->timeout_ms / 1e3;
    int rc;
    while ((rc = tdm_transfer_nccl_poll(p->comm, &e)) == 0 && tdm_time_now() < until)
        sleep_us(100);
    if (rc == 1)
        return 0;
    st = rc < 0 ? tdm_error_set(err, TDM_EUNAVAILABLE, "%s", e.msg)
                : tdm_error_set(err, TDM_EDEADLINE,
                                "NCCL receive of %u blocks from %s not complete within %d ms",
                                h->n_blocks, h->sender_node_id, r->timeout_ms);
out_drop:
    drop_peer_comms(r, f->peer, f->peer_len, NULL);
    return st;
}

int tdm_kv_dev_copy_h2d(tdm_kv_receiver_t *r, const uint8_t *const *src, const uint32_t *blocks,
                        uint32_t n, tdm_error_t *err)
{
    tdm_error_t e = {0};
    if (tdm_transfer_cuda_copy_h2d(r->memory.device, r->memory.device_base, blocks, src, n,
                                   r->block_bytes, &e) != 0)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "host-to-device copy: %s", e.msg);
    return 0;
}

int tdm_kv_dev_verify(tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h, const uint32_t *blocks,
                      tdm_error_t *err)
{
    tdm_error_t e = {0};
    uint32_t n = h->n_blocks;
    if (n == 0)
        return 0;
    if (tdm_kv_device_checksums(r->memory.device, r->memory.device_base, blocks, n, r->block_bytes,
                                r->sums, &e) != 0)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "device checksums: %s", e.msg);
    for (uint32_t i = 0; i < n; i++)
        if (r->sums[i] != h->checksums[i])
            return tdm_error_set(err, TDM_EINVALID,
                                 "block %u checksum mismatch after the %s transfer: the "
                                 "device holds 0x%016" PRIx64 ", the sender sent 0x%016" PRIx64,
                                 i, h->backend, r->sums[i], h->checksums[i]);
    return 0;
}

void tdm_kv_dev_receiver_free(tdm_kv_receiver_t *r)
{
    while (r->comms) {
        tdm_kv_peer_comm_t *p = r->comms;
        r->comms = p->next;
        peer_comm_free(p);
    }
    while (r->ipcs) {
        tdm_kv_peer_ipc_t *p = r->ipcs;
        r->ipcs = p->next;
        tdm_transfer_cuda_ipc_close(r->memory.device, p->base, NULL);
        free(p);
    }
}

#else
/* Without CUDA the device backends do not exist (tdm_kv_backend_built says so). */
typedef int tdm_kv_no_device_backends_t;
#endif
