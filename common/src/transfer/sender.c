/* sender.c - the KV sender (tandem/transfer.h, the prefill node's side): transfer records,
 * tdm_kv_sender_send, cancellation, the receivers' answers, deadlines and
 * tdm_kv_sender_poll, which reports each transfer once. Its channels are in channel.c, the
 * header it writes in header.c, the tcp frames in tcp.c, the device backends in device.c.
 *
 * Block lifetime: tdm_kv_sender_send takes a pool reference on every block; with tcp it hands
 * ZeroMQ one zero-copy frame per block whose release callback decrements the record's
 * `pending` counter (on a ZMQ I/O thread: atomics and a pipe write only). The references are
 * dropped on the pool's thread, in tdm_kv_sender_poll, once the outcome is known and pending
 * is 0. Frames ZMQ cannot deliver (receiver gone) are released by closing the channel's
 * socket (linger 0), which is what a timeout does.
 */
#include "transfer/transfer_internal.h"

#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

/* Whether something may still read x's blocks: ZeroMQ holds frames of it, or NCCL sends them
 * or was told to (go). */
static bool xfer_busy(const tdm_kv_xfer_t *x)
{
    return atomic_load(&x->pending) > 0 || x->go || (x->ch && x->ch->launched == x);
}

void tdm_kv_xfer_finish(tdm_kv_xfer_t *x, int status, const char *fmt, ...)
{
    if (x->finished)
        return;
    x->finished = true;
    x->status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->message, sizeof x->message, fmt, ap);
    va_end(ap);
    x->seconds = tdm_time_now() - x->t_start;
}

/* The options a sender cannot work with: a backend not built in, a pool in the wrong memory
 * for the backend, a negative timeout or thread count. Returns 0 or TDM_EINVALID. */
static int sender_opts_check(const tdm_kv_sender_opts_t *opts, tdm_error_t *err)
{
    if (!tdm_kv_backend_built(opts->backend))
        return tdm_error_set(err, TDM_EINVALID,
                             "KV backend %s is not built into this binary (configure with "
                             "-DTANDEM_CUDA=ON)",
                             tdm_kv_backend_name(opts->backend));
    bool device_pool = opts->memory.device_base != NULL;
    if (opts->backend == TDM_KV_BACKEND_TCP && device_pool) {
        return tdm_error_set(err, TDM_EINVALID,
                             "KV backend tcp sends from host memory; a device pool needs nccl or "
                             "cuda_ipc");
    }
    if (opts->backend != TDM_KV_BACKEND_TCP && !device_pool)
        return tdm_error_set(err, TDM_EINVALID,
                             "KV backend %s needs a device pool (memory.device_base)",
                             tdm_kv_backend_name(opts->backend));
    if (opts->timeout_ms < 0) {
        return tdm_error_set(err, TDM_EINVALID, "KV sender timeout_ms is %d; must be >= 0",
                             opts->timeout_ms);
    }
    if (opts->threads < 0)
        return tdm_error_set(err, TDM_EINVALID, "KV sender threads is %d; must be >= 0",
                             opts->threads);
    return 0;
}

/* Copies the CURVE keys the sender's channels use. Returns 0 or TDM_ERESOURCE (the caller
 * destroys the sender, which frees what was copied). */
static int sender_curve_copy(tdm_kv_sender_t *s, const tdm_curve_keys_t *c)
{
    s->has_curve = true;
    const char *src[4] = {c->server_public, c->server_secret, c->client_public, c->client_secret};
    const char **dst[4] = {&s->curve.server_public, &s->curve.server_secret,
                           &s->curve.client_public, &s->curve.client_secret};
    for (int i = 0; i < 4; i++) {
        if (src[i] && !(*dst[i] = tdm_strdup(src[i])))
            return TDM_ERESOURCE;
    }
    return 0;
}

tdm_kv_sender_t *tdm_kv_sender_new(tdm_net_t *net, tdm_kv_pool_t *pool,
                                   const tdm_kv_sender_opts_t *opts, tdm_error_t *err)
{
    if (!net || !pool || !opts) {
        tdm_error_set(err, TDM_EINVALID, "KV sender: net, pool and opts are required");
        return NULL;
    }
    if (sender_opts_check(opts, err) != 0)
        return NULL;
    const tdm_curve_keys_t *c = opts->curve;
    bool has_curve =
        c && (c->server_public || c->server_secret || c->client_public || c->client_secret);

    tdm_kv_sender_t *s = calloc(1, sizeof *s);
    if (!s)
        goto out_oom;
    s->net = net;
    s->pool = pool;
    s->layout = *tdm_kv_pool_layout(pool);
    s->groups = tdm_kv_pool_groups(pool);
    s->block_bytes = tdm_kv_pool_block_bytes(pool);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    s->pool_blocks = st.n_blocks;
    tdm_kv_copy_str(s->node_id, sizeof s->node_id, opts->node_id);
    s->model_fingerprint = opts->model_fingerprint;
    s->backend = opts->backend;
    s->memory = opts->memory;
    s->timeout_ms = opts->timeout_ms ? opts->timeout_ms : TDM_KV_DEFAULT_TIMEOUT_MS;
    s->threads = tdm_kv_threads(opts->threads);
    if (opts->log) {
        s->log_store = *opts->log;
        s->log = &s->log_store;
    }
    s->next_id = 1;
    tdm_frame_init(&s->frame);
    if (has_curve && sender_curve_copy(s, c) != 0)
        goto out_free;
    s->notify = tdm_kv_notify_new();
    if (!s->notify)
        goto out_free;
#ifdef TANDEM_HAVE_CUDA
    if (tdm_kv_dev_sender_init(s, err) != 0) {
        tdm_kv_sender_destroy(&s);
        return NULL;
    }
#endif
    return s;

out_free:
    tdm_kv_sender_destroy(&s);
out_oom:
    tdm_error_set(err, TDM_ERESOURCE, "out of memory for a KV sender");
    return NULL;
}

static void xfer_free(tdm_kv_sender_t *s, tdm_kv_xfer_t *x)
{
    for (uint32_t i = 0; i < x->n_blocks; i++)
        tdm_kv_pool_unref(s->pool, x->blocks[i]);
    free(x->blocks);
    free(x);
}

static void xfer_append(tdm_kv_sender_t *s, tdm_kv_xfer_t *x)
{
    if (s->xfers_tail)
        s->xfers_tail->next = x;
    else
        s->xfers = x;
    s->xfers_tail = x;
}

/* Sends a CANCEL for x (best effort: the receiver drops the transfer if it has not handled
 * it yet). */
static void xfer_send_cancel(tdm_kv_sender_t *s, tdm_kv_xfer_t *x)
{
    if (!x->ch || !x->ch->sock)
        return;
    tdm_send_t m;
    memset(&m, 0, sizeof m);
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL;
    m.method = TANDEM__V1__METHOD__METHOD_KV_TRANSFER;
    m.call_id = x->id;
    if (tdm_sock_send(x->ch->sock, &m) != 0)
        TDM_LOG_DEBUGF(s->log, x->request_id, "KV cancel to %s not sent: %s", x->ch->endpoint,
                       tdm_sock_errmsg(x->ch->sock));
}

/* Waits up to timeout_s for ZeroMQ to release every block frame it still holds (the sockets
 * are closed, so it drops them); the release callbacks write to s->notify. */
static void sender_wait_released(tdm_kv_sender_t *s, double timeout_s)
{
    double until = tdm_time_now() + timeout_s;
    for (;;) {
        bool pending = false;
        for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
            pending = pending || atomic_load(&x->pending) > 0;
        double left = until - tdm_time_now();
        if (!pending || left <= 0)
            return;
        struct pollfd p = {.fd = s->notify->fds[0], .events = POLLIN};
        poll(&p, 1, (int)(left * 1e3) + 1);
        tdm_kv_notify_drain(s->notify);
    }
}

/* Frees every transfer record and gives its blocks back to the pool. */
static void sender_free_xfers(tdm_kv_sender_t *s)
{
    tdm_kv_xfer_t *x = s->xfers;
    while (x) {
        tdm_kv_xfer_t *next = x->next;
        if (atomic_load(&x->pending) > 0) {
            /* ZMQ still holds frames of it after 1 s: keep the record (its release callbacks
             * will touch it) but give the blocks back; the sockets are closed, so nothing
             * will be sent from them. */
            TDM_LOG_ERRORF(s->log, x->request_id,
                           "KV transfer %" PRIu64 ": ZeroMQ kept %u block frames after 1 s", x->id,
                           atomic_load(&x->pending));
            for (uint32_t i = 0; i < x->n_blocks; i++)
                tdm_kv_pool_unref(s->pool, x->blocks[i]);
        } else {
            xfer_free(s, x);
        }
        x = next;
    }
    s->xfers = s->xfers_tail = NULL;
}

void tdm_kv_sender_destroy(tdm_kv_sender_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_kv_sender_t *s = *self_p;
    *self_p = NULL;

    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next) {
        if (!x->finished && !x->silent) {
            xfer_send_cancel(s, x);
            tdm_kv_xfer_finish(x, TDM_ECANCELLED, "sender destroyed");
        }
        x->go = false;
    }
    /* Closing the sockets makes ZMQ drop what it still holds and release the frames. */
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        tdm_sock_destroy(&ch->sock);
        tdm_kv_channel_drop_comm(s, ch);
    }
    sender_wait_released(s, 1.0);
    sender_free_xfers(s);
    tdm_kv_channels_free(s);
    tdm_kv_notify_unref(s->notify);
    tdm_frame_clear(&s->frame);
    free(s->poll_items);
    free((char *)s->curve.server_public);
    free((char *)s->curve.server_secret);
    free((char *)s->curve.client_public);
    free((char *)s->curve.client_secret);
    free(s);
}

static int check_send_req(tdm_kv_sender_t *s, const tdm_kv_send_req_t *req, tdm_error_t *err)
{
    if (!req->request_id || !req->request_id[0])
        return tdm_error_set(err, TDM_EINVALID, "KV transfer: request_id is empty");
    size_t id_len = strlen(req->request_id);
    if (id_len > TDM_REQUEST_ID_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "KV transfer: request_id is %zu bytes; at most %u allowed", id_len,
                             TDM_REQUEST_ID_MAX);
    if (!req->endpoint || !req->endpoint[0])
        return tdm_error_set(err, TDM_EINVALID, "KV transfer %s: endpoint is empty",
                             req->request_id);
    if (req->n_tokens == 0)
        return tdm_error_set(err, TDM_EINVALID, "KV transfer %s: n_tokens is 0", req->request_id);
    uint64_t want = tdm_kv_transfer_blocks(s->pool, req->n_tokens, NULL);
    if (req->n_blocks != want)
        return tdm_error_set(
            err, TDM_EINVALID,
            "KV transfer %s: n_blocks is %u but %u tokens need %" PRIu64 " blocks of %u%s",
            req->request_id, req->n_blocks, req->n_tokens, want, s->layout.block_size,
            s->groups ? " (the live blocks of every layer group)" : "");
    if (s->groups && s->backend != TDM_KV_BACKEND_TCP)
        return tdm_error_set(err, TDM_EINVALID,
                             "KV transfer %s: a pool with layer groups ships over tcp only",
                             req->request_id);
    if (!req->blocks)
        return tdm_error_set(err, TDM_EINVALID, "KV transfer %s: blocks is NULL", req->request_id);
    if (s->backend == TDM_KV_BACKEND_TCP && req->n_blocks > TDM_NET_MAX_DATA_FRAMES)
        return tdm_error_set(err, TDM_EINVALID,
                             "KV transfer %s: %u blocks; tcp carries at most %u per transfer",
                             req->request_id, req->n_blocks, TDM_NET_MAX_DATA_FRAMES);
    for (uint32_t i = 0; i < req->n_blocks; i++) {
        uint32_t b = req->blocks[i];
        if (b >= s->pool_blocks)
            return tdm_error_set(err, TDM_EINVALID,
                                 "KV transfer %s: block %u (index %u) out of range (pool of %u)",
                                 req->request_id, b, i, s->pool_blocks);
        if (tdm_kv_pool_refcount(s->pool, b) == 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "KV transfer %s: block %u (index %u) is not in use",
                                 req->request_id, b, i);
    }
    return 0;
}

/* A transfer record for req over ch, holding a reference on each of its blocks. Returns NULL
 * on out of memory, with *err set. */
static tdm_kv_xfer_t *xfer_new(tdm_kv_sender_t *s, const tdm_kv_send_req_t *req,
                               tdm_kv_channel_t *ch, tdm_error_t *err)
{
    uint32_t n = req->n_blocks;
    tdm_kv_xfer_t *x = calloc(1, sizeof *x);
    if (x)
        x->blocks = malloc((size_t)n * sizeof *x->blocks);
    if (!x || !x->blocks) {
        if (x)
            free(x->blocks);
        free(x);
        tdm_error_set(err, TDM_ERESOURCE, "KV transfer %s: out of memory", req->request_id);
        return NULL;
    }
    atomic_init(&x->pending, 0);
    x->id = s->next_id++;
    tdm_kv_copy_str(x->request_id, sizeof x->request_id, req->request_id);
    x->attempt_id = req->attempt_id;
    x->ch = ch;
    x->generation = ch->generation;
    x->n_blocks = n;
    x->bytes = (uint64_t)n * s->block_bytes;
    x->n_tokens = req->n_tokens;
    x->first_token = req->first_token;
    x->prefill_s = req->prefill_s;
    x->notify = s->notify;
    x->t_start = tdm_time_now();
    x->deadline = x->t_start + s->timeout_ms / 1e3;
    memcpy(x->blocks, req->blocks, (size_t)n * sizeof *x->blocks);
    for (uint32_t i = 0; i < n; i++)
        tdm_kv_pool_ref(s->pool, x->blocks[i]);
    return x;
}

/* Device backends: sums[i] = block i's checksum, computed on the GPU over the device pool
 * (the same XXH3-64 value as tcp's, tdm_kv_device_checksums), so the receiver can verify
 * what lands in its device blocks; offsets[i] = its byte offset in the pool (cuda_ipc).
 * Returns 0 or TDM_EUNAVAILABLE with the GPU's reason in *err. */
static int xfer_device_sums(tdm_kv_sender_t *s, const tdm_kv_xfer_t *x, uint64_t *sums,
                            uint64_t *offsets, tdm_error_t *err)
{
    for (uint32_t i = 0; i < x->n_blocks; i++)
        offsets[i] = (uint64_t)x->blocks[i] * s->block_bytes;
    if (x->n_blocks == 0)
        return 0;
    tdm_error_t e = {0};
    if (tdm_kv_device_checksums(s->memory.device, s->memory.device_base, x->blocks, x->n_blocks,
                                s->block_bytes, sums, &e) != 0)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "device checksums: %s", e.msg);
    return 0;
}

int tdm_kv_xfer_transmit(tdm_kv_sender_t *s, tdm_kv_xfer_t *x, tdm_error_t *err)
{
    uint32_t n = x->n_blocks;
    size_t scratch_bytes = (size_t)n * (2 * sizeof(uint64_t) + sizeof(tdm_net_data_t));
    void *scratch = malloc(scratch_bytes ? scratch_bytes : 1);
    if (!scratch)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    uint64_t *sums = scratch;     /* [n] block checksums */
    uint64_t *offsets = sums + n; /* [n] cuda_ipc: the blocks' byte offsets in the pool */
    tdm_net_data_t *data = (tdm_net_data_t *)(offsets + n); /* [n] tcp: the block frames */
    bool tcp = s->backend == TDM_KV_BACKEND_TCP;
    if (tcp) {
        tdm_kv_tcp_frames(s, x, data, sums);
    } else if (xfer_device_sums(s, x, sums, offsets, err) != 0) {
        free(scratch);
        return TDM_EUNAVAILABLE;
    }
    Tandem__V1__KvTransfer h;
    Tandem__V1__KvLayout lay;
    ProtobufCBinaryData handle;
    if (s->groups) /* each group's first entry, for the header */
        (void)tdm_kv_transfer_blocks(s->pool, x->n_tokens, s->first);
    tdm_kv_header_build(s, x, sums, offsets, &h, &lay, &handle);

    tdm_send_t m;
    memset(&m, 0, sizeof m);
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = TANDEM__V1__METHOD__METHOD_KV_TRANSFER;
    m.call_id = x->id;
    double left_s = x->deadline - tdm_time_now();
    m.deadline_unix_ms = tdm_net_now_ms() + (uint64_t)(left_s > 0 ? left_s * 1e3 : 0);
    m.body = &h.base;
    if (tcp && n > 0) {
        m.data = data;
        m.n_data = n;
        /* the notify reference is held while any frame of x is in ZMQ's hands (frames of a
         * lost connection may still be on their way to release) */
        if (atomic_fetch_add(&x->pending, n) == 0)
            atomic_fetch_add(&s->notify->refs, 1); /* dropped by the last frame's release */
    }
    int rc = tdm_sock_send(x->ch->sock, &m);
    free(scratch);
    if (rc != 0 && rc != TDM_EINVALID && rc != TDM_ERESOURCE)
        rc = TDM_EUNAVAILABLE;
    return rc ? tdm_error_set(err, rc, "%s", tdm_sock_errmsg(x->ch->sock)) : 0;
}

/* x was not sent (tdm_kv_xfer_transmit returned rc, *err says why): the record is dropped,
 * or kept unreported while ZMQ still holds frames of it. Returns rc, *err naming the
 * transfer. */
static int xfer_send_failed(tdm_kv_sender_t *s, tdm_kv_xfer_t *x, int rc, tdm_error_t *err)
{
    tdm_error_prefix(err, rc, "KV transfer %s to %s", x->request_id, x->ch->endpoint);
    /* net.h: every release callback runs once even on failure; normally they already ran
     * (nothing was queued). If ZMQ kept some, the record stays, unreported, until they are
     * released. */
    x->silent = true;
    x->finished = true;
    if (atomic_load(&x->pending) == 0)
        xfer_free(s, x);
    else
        xfer_append(s, x);
    return rc;
}

int tdm_kv_sender_send(tdm_kv_sender_t *s, const tdm_kv_send_req_t *req, uint64_t *transfer_id,
                       tdm_error_t *err)
{
    if (!s || !req || !transfer_id)
        return tdm_error_set(err, TDM_EINVALID,
                             "KV transfer: sender, req and transfer_id "
                             "are required");
    *transfer_id = 0;
    int rc = check_send_req(s, req, err);
    if (rc != 0)
        return rc;
    tdm_kv_channel_t *ch = tdm_kv_channel_get(s, req->endpoint, req->server_key, err);
    if (!ch)
        return err ? err->code : TDM_EUNAVAILABLE;
#ifdef TANDEM_HAVE_CUDA
    if (s->backend == TDM_KV_BACKEND_NCCL && (rc = tdm_kv_dev_sender_prepare(s, ch, err)) != 0)
        return rc;
#endif

    tdm_kv_xfer_t *x = xfer_new(s, req, ch, err);
    if (!x)
        return TDM_ERESOURCE;
    rc = tdm_kv_xfer_transmit(s, x, err);
    if (rc != 0)
        return xfer_send_failed(s, x, rc, err);
    xfer_append(s, x);
    s->n_reportable++;
    *transfer_id = x->id;
    TDM_LOG_DEBUGF(s->log, x->request_id,
                   "KV transfer %" PRIu64 " sent to %s: %u blocks, %" PRIu64 " bytes, %s", x->id,
                   ch->endpoint, x->n_blocks, x->bytes, tdm_kv_backend_name(s->backend));
    return 0;
}

int tdm_kv_sender_cancel(tdm_kv_sender_t *s, uint64_t attempt_id)
{
    if (!s)
        return 0;
    int n = 0;
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next) {
        if (x->finished || x->silent || x->attempt_id != attempt_id)
            continue;
        xfer_send_cancel(s, x);
        tdm_kv_xfer_finish(x, TDM_ECANCELLED, "KV transfer %" PRIu64 " cancelled by the sender",
                           x->id);
        n++;
    }
    return n;
}

uint32_t tdm_kv_sender_in_flight(const tdm_kv_sender_t *s)
{
    return s ? s->n_reportable : 0;
}

static tdm_kv_xfer_t *xfer_find(tdm_kv_sender_t *s, const tdm_kv_channel_t *ch, uint64_t id)
{
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
        if (x->id == id && x->ch == ch && !x->silent)
            return x;
    return NULL;
}

/* One message from the receiver on ch: an END (acknowledgement or rejection of a transfer,
 * or the answer to a KV_HELLO) or a STREAM (nccl: go). */
static void sender_handle(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, const tdm_frame_t *f)
{
#ifdef TANDEM_HAVE_CUDA
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END && ch->hello_call_id &&
        f->call_id == ch->hello_call_id) {
        tdm_kv_dev_sender_hello_end(s, ch, f);
        return;
    }
#endif
    tdm_kv_xfer_t *x = xfer_find(s, ch, f->call_id);
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
        if (!x || x->finished) {
            TDM_LOG_DEBUGF(s->log, x ? x->request_id : NULL,
                           "KV: late answer for call %" PRIu64 " from %s ignored", f->call_id,
                           ch->endpoint);
            return;
        }
        if (f->status == 0)
            tdm_kv_xfer_finish(x, 0, "%s", "");
        else
            tdm_kv_xfer_finish(x, f->status, "%s",
                               f->message[0] ? f->message : tdm_strerror(f->status));
        if (f->status != 0 && (x->go || ch->launched == x))
            tdm_kv_channel_drop_comm(s, ch); /* the receiver gave up on its NCCL receives */
        TDM_LOG_DEBUGF(s->log, x->request_id, "KV transfer %" PRIu64 " answered: %s %s", x->id,
                       tdm_status_name(x->status), x->message);
        return;
    }
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM && s->backend == TDM_KV_BACKEND_NCCL) {
        if (x && x != ch->launched) {
            x->go = true; /* even when cancelled: the receiver waits for these blocks */
        } else if (!x) {
            /* The receiver posted receives for a transfer this sender forgot: the pair's
             * NCCL streams no longer match, so start over with a new communicator. */
            tdm_kv_channel_drop_comm(s, ch);
        }
        return;
    }
    TDM_LOG_DEBUGF(s->log, NULL, "KV: unexpected %s frame from %s ignored",
                   tdm_net_kind_name(f->kind), ch->endpoint);
}

/* Reads everything waiting on every channel, without blocking. */
static void sender_read_all(tdm_kv_sender_t *s)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        while (ch->sock) {
            int rc = tdm_sock_recv(ch->sock, &s->frame, 0);
            if (rc == TDM_EDEADLINE || rc == TDM_ECANCELLED)
                break;
            if (rc != 0) {
                char why[TDM_ERRMSG_MAX];
                snprintf(why, sizeof why, "receive failed: %s", tdm_sock_errmsg(ch->sock));
                tdm_kv_channel_reset(s, ch, why);
                break;
            }
            sender_handle(s, ch, &s->frame);
            tdm_frame_clear(&s->frame);
        }
    }
}

static void sender_check_deadlines(tdm_kv_sender_t *s, double now)
{
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next) {
        if (now < x->deadline || x->ch == NULL)
            continue;
        char why[160];
        if (!x->finished) {
            tdm_kv_xfer_finish(x, TDM_EDEADLINE,
                               "no acknowledgement from %s within %d ms (receiver gone or stalled)",
                               x->ch->endpoint, s->timeout_ms);
            snprintf(why, sizeof why, "transfer %" PRIu64 " timed out", x->id);
            tdm_kv_channel_reset(s, x->ch, why);
        } else if (xfer_busy(x) && x->generation == x->ch->generation) {
            /* Finished (cancelled) but ZMQ or NCCL still holds its blocks at the deadline:
             * the receiver is not taking them, so drop what the channel holds. (After a
             * reset the frames are being released already; a newer socket is left alone.) */
            snprintf(why, sizeof why, "blocks of finished transfer %" PRIu64 " still queued",
                     x->id);
            tdm_kv_channel_reset(s, x->ch, why);
        }
    }
}

/* Moves finished, idle records to out[] (dropping their block references). */
static int sender_collect(tdm_kv_sender_t *s, tdm_kv_send_done_t *out, int cap)
{
    int n = 0;
    tdm_kv_xfer_t *prev = NULL;
    tdm_kv_xfer_t *x = s->xfers;
    while (x) {
        tdm_kv_xfer_t *next = x->next;
        bool done = x->finished && !xfer_busy(x);
        if (done && !x->silent && n >= cap)
            done = false;
        if (!done) {
            prev = x;
            x = next;
            continue;
        }
        if (!x->silent) {
            tdm_kv_send_done_t *d = &out[n++];
            memset(d, 0, sizeof *d);
            tdm_kv_copy_str(d->request_id, sizeof d->request_id, x->request_id);
            d->attempt_id = x->attempt_id;
            d->transfer_id = x->id;
            d->status = x->status;
            tdm_kv_copy_str(d->message, sizeof d->message, x->message);
            d->bytes = x->bytes;
            d->seconds = x->seconds;
            s->n_reportable--;
        }
        if (prev)
            prev->next = next;
        else
            s->xfers = next;
        if (s->xfers_tail == x)
            s->xfers_tail = prev;
        xfer_free(s, x);
        x = next;
    }
    return n;
}

/* Milliseconds to wait for the next event: until t_end, the earliest deadline, or 1 ms while
 * NCCL work has to be polled. */
static int sender_wait_ms(const tdm_kv_sender_t *s, double now, double t_end)
{
    double until = t_end;
    bool device_work = false;
    for (const tdm_kv_xfer_t *x = s->xfers; x; x = x->next) {
        /* a finished record past its deadline waits for its release (the notify pipe) */
        bool timed = !x->finished || (xfer_busy(x) && now < x->deadline);
        if (timed && x->deadline < until)
            until = x->deadline;
        device_work = device_work || x->go || (x->ch && x->ch->launched == x);
    }
    for (const tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        device_work = device_work || (ch->comm && !ch->comm_ready);
        if (ch->resend_by > 0 && ch->resend_by < until)
            until = ch->resend_by;
    }
    double ms = (until - now) * 1e3;
    if (ms < 0)
        ms = 0;
    if (device_work && ms > 1)
        ms = 1;
    return (int)ms + 1;
}

int tdm_kv_sender_poll(tdm_kv_sender_t *s, int timeout_ms, tdm_kv_send_done_t *out, int cap)
{
    if (!s)
        return TDM_EINTERNAL;
    if (!out)
        cap = 0;
    double t_end = tdm_time_now() + (timeout_ms > 0 ? timeout_ms / 1e3 : 0);
    for (;;) {
        tdm_kv_notify_drain(s->notify);
        sender_read_all(s);
#ifdef TANDEM_HAVE_CUDA
        if (s->backend == TDM_KV_BACKEND_NCCL)
            tdm_kv_dev_sender_progress(s);
#endif
        double now = tdm_time_now();
        tdm_kv_channels_check(s, now);
        sender_check_deadlines(s, now);
        int n = sender_collect(s, out, cap);
        now = tdm_time_now();
        if (n > 0 || cap <= 0 || now >= t_end)
            return n;
        zmq_pollitem_t *items = s->poll_items;
        int n_items = 0;
        struct pollfd pf = {.fd = s->notify->fds[0], .events = POLLIN};
        for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
            if (!ch->sock)
                continue;
            items[n_items].socket = tdm_sock_zsock(ch->sock);
            items[n_items].fd = 0;
            items[n_items].events = ZMQ_POLLIN;
            items[n_items].revents = 0;
            n_items++;
        }
        int wait_ms = sender_wait_ms(s, now, t_end);
        int rc;
        if (n_items == 0) {
            rc = poll(&pf, 1, wait_ms);
        } else {
            items[n_items].socket = NULL;
            items[n_items].fd = s->notify->fds[0];
            items[n_items].events = ZMQ_POLLIN;
            items[n_items].revents = 0;
            rc = zmq_poll(items, n_items + 1, wait_ms);
        }
        if (rc < 0 && errno != EINTR) {
            TDM_LOG_ERRORF(s->log, NULL, "KV sender poll failed: %s", zmq_strerror(errno));
            return TDM_EINTERNAL;
        }
    }
}
