/* transfer.c - the KV transport (tandem/transfer.h): backend names, the sender (channels,
 * transfer records, acknowledgements, timeouts, cancellation), the receiver (header checks,
 * checksums, copy into the reserved blocks, reply) and the tcp backend. The nccl and
 * cuda_ipc backends are in device.c (CUDA builds only).
 *
 * Block lifetime on the sender: tdm_kv_sender_send takes a pool reference on every block and
 * hands ZeroMQ one zero-copy frame per block whose release callback decrements the record's
 * `pending` counter (on a ZMQ I/O thread: atomics and a pipe write only). The references are
 * dropped on the pool's thread, in tdm_kv_sender_poll, once the outcome is known and pending
 * is 0. Frames ZMQ cannot deliver (receiver gone) are released by closing the channel's
 * socket (linger 0), which is what a timeout does.
 */
#include "transfer/transfer_internal.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <xxhash.h>
#include <zmq.h>
#if defined(__x86_64__) && defined(__has_include)
#if __has_include(<xxh_x86dispatch.h>)
/* libxxhash's run-time dispatch (AVX-512 / AVX2 / SSE2): the same XXH3 values, about 30%
 * faster than the SSE2 baseline on the AVX2/AVX-512 hosts Tandem runs on. */
#define XXH_DISPATCH_DISABLE_REPLACE 1
#include <xxh_x86dispatch.h>
#define TDM_XXH3_64 XXH3_64bits_dispatch
#endif
#endif
#ifndef TDM_XXH3_64
#define TDM_XXH3_64 XXH3_64bits
#endif

#define TDM_KV_DEFAULT_TIMEOUT_MS 10000
/* Messages a receiver's socket queues (ZMQ_RCVHWM = ZMQ_SNDHWM in common/net). */
#define TDM_KV_RECEIVER_HWM 64
/* Transfers of at least this many blocks checksum and copy with OpenMP threads. */
#define TDM_KV_PARALLEL_BLOCKS 8u
/* A transfer whose connection was lost is sent again on a new one at most this many times
 * (tcp backend), within its timeout, and only when the new connection's handshake succeeds
 * within TDM_KV_RESEND_CONNECT_S: a receiver that does not answer that fast is taken to be
 * gone or cut off, and the transfer fails as before (the router re-dispatches it). */
#define TDM_KV_MAX_RESENDS 2u
#define TDM_KV_RESEND_CONNECT_S 2.0
#define TDM_KV_RESEND_CONNECT_TEXT "2 s"

/* ---- backends, checksums ---- */

static const char *const backend_names[] = {"tcp", "nccl", "cuda_ipc"};

const char *tdm_kv_backend_name(tdm_kv_backend_t b)
{
    if ((unsigned)b < sizeof backend_names / sizeof backend_names[0])
        return backend_names[b];
    return "?";
}

int tdm_kv_backend_parse(const char *name, tdm_kv_backend_t *out, tdm_error_t *err)
{
    for (unsigned i = 0; name && i < sizeof backend_names / sizeof backend_names[0]; i++) {
        if (strcmp(name, backend_names[i]) == 0) {
            *out = (tdm_kv_backend_t)i;
            return 0;
        }
    }
    return tdm_error_set(err, TDM_EINVALID, "KV backend \"%s\" unknown: use tcp, nccl or cuda_ipc",
                         name ? name : "(null)");
}

bool tdm_kv_backend_built(tdm_kv_backend_t b)
{
    switch (b) {
    case TDM_KV_BACKEND_TCP: return true;
    case TDM_KV_BACKEND_NCCL:
    case TDM_KV_BACKEND_CUDA_IPC:
#ifdef TANDEM_HAVE_CUDA
        return true;
#else
        return false;
#endif
    }
    return false;
}

uint64_t tdm_kv_block_checksum(const void *block, uint64_t block_bytes)
{
    return TDM_XXH3_64(block, (size_t)block_bytes);
}

/* Canonical encoding for tdm_kv_header_checksum: fixed-width little-endian integers and
 * length-prefixed strings, so the value does not depend on how protobuf encoded the header. */
typedef struct canon {
    uint8_t buf[1024];
    size_t n;
    uint64_t h; /* chained value of what did not fit in buf */
    bool chained;
} canon_t;

static void canon_flush(canon_t *c)
{
    c->h = c->chained ? XXH3_64bits_withSeed(c->buf, c->n, c->h) : XXH3_64bits(c->buf, c->n);
    c->chained = true;
    c->n = 0;
}

static void canon_bytes(canon_t *c, const void *p, size_t len)
{
    const uint8_t *b = p;
    while (len > 0) {
        if (c->n == sizeof c->buf)
            canon_flush(c);
        size_t k = sizeof c->buf - c->n < len ? sizeof c->buf - c->n : len;
        memcpy(c->buf + c->n, b, k);
        c->n += k;
        b += k;
        len -= k;
    }
}

static void canon_u64(canon_t *c, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    canon_bytes(c, b, sizeof b);
}

static void canon_str(canon_t *c, const char *s)
{
    size_t len = s ? strlen(s) : 0;
    canon_u64(c, len);
    canon_bytes(c, s, len);
}

uint64_t tdm_kv_header_checksum(const Tandem__V1__KvTransfer *h)
{
    canon_t c;
    c.n = 0;
    c.h = 0;
    c.chained = false;
    canon_bytes(&c, "tandem.kv.v1", 12);
    canon_str(&c, h->request_id);
    canon_u64(&c, h->attempt_id);
    canon_u64(&c, h->transfer_id);
    canon_u64(&c, h->n_tokens);
    canon_u64(&c, (uint64_t)(uint32_t)h->first_token);
    const Tandem__V1__KvLayout *l = h->layout;
    canon_u64(&c, l ? 1 : 0);
    if (l) {
        canon_u64(&c, l->n_layers);
        canon_u64(&c, l->n_kv_heads);
        canon_u64(&c, l->head_dim);
        canon_u64(&c, l->block_size);
        canon_u64(&c, (uint64_t)(uint32_t)l->dtype);
    }
    canon_u64(&c, h->model_fingerprint);
    canon_u64(&c, h->n_blocks);
    canon_u64(&c, h->block_bytes);
    canon_u64(&c, (uint64_t)(uint32_t)h->checksum_kind);
    canon_str(&c, h->backend);
    canon_str(&c, h->sender_node_id);
    uint64_t prefill_bits;
    memcpy(&prefill_bits, &h->prefill_s, sizeof prefill_bits);
    canon_u64(&c, prefill_bits);
    canon_u64(&c, h->n_ipc_handles);
    for (size_t i = 0; i < h->n_ipc_handles; i++) {
        canon_u64(&c, h->ipc_handles[i].len);
        canon_bytes(&c, h->ipc_handles[i].data, h->ipc_handles[i].len);
    }
    canon_u64(&c, h->n_checksums);
    canon_u64(&c, h->n_block_offsets);
    canon_flush(&c);
    /* the chain: each block checksum (which covers that block's bytes), then each offset */
    for (size_t i = 0; i < h->n_checksums; i++)
        canon_u64(&c, h->checksums[i]);
    for (size_t i = 0; i < h->n_block_offsets; i++)
        canon_u64(&c, h->block_offsets[i]);
    if (c.n)
        canon_flush(&c);
    return c.h;
}

int tdm_kv_reject_msg(char *out, size_t cap, int status, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out, cap, fmt, ap);
    va_end(ap);
    return status;
}

static void copy_str(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

/* ---- release notification (ZMQ I/O threads -> sender) ---- */

static tdm_kv_notify_t *notify_new(void)
{
    tdm_kv_notify_t *n = calloc(1, sizeof *n);
    if (!n)
        return NULL;
    if (pipe(n->fds) != 0) {
        free(n);
        return NULL;
    }
    for (int i = 0; i < 2; i++) {
        int fl = fcntl(n->fds[i], F_GETFL);
        fcntl(n->fds[i], F_SETFL, fl | O_NONBLOCK);
        fcntl(n->fds[i], F_SETFD, FD_CLOEXEC);
    }
    atomic_init(&n->refs, 1);
    return n;
}

static void notify_unref(tdm_kv_notify_t *n)
{
    if (n && atomic_fetch_sub(&n->refs, 1) == 1) {
        close(n->fds[0]);
        close(n->fds[1]);
        free(n);
    }
}

static void notify_drain(tdm_kv_notify_t *n)
{
    char buf[64];
    while (read(n->fds[0], buf, sizeof buf) > 0)
        ;
}

/* Release callback of one zero-copy block frame; runs on a ZMQ I/O thread. The record may be
 * freed by the sender as soon as pending reaches 0, so it is not touched after that. */
static void frame_released(void *ptr, void *hint)
{
    (void)ptr;
    tdm_kv_xfer_t *x = hint;
    tdm_kv_notify_t *n = x->notify;
    if (atomic_fetch_sub(&x->pending, 1) == 1) {
        char c = 1;
        if (write(n->fds[1], &c, 1) < 0) {
            /* pipe full: the sender has wake-ups pending anyway */
        }
        notify_unref(n);
    }
}

/* ---- sender ---- */

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

void tdm_kv_channel_drop_comm(tdm_kv_sender_t *s, tdm_kv_channel_t *ch)
{
#ifdef TANDEM_HAVE_CUDA
    tdm_kv_dev_channel_drop_comm(ch);
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
        if (x->ch == ch)
            x->go = false; /* the receiver's side of the communicator is gone as well */
#else
    (void)s;
    (void)ch;
#endif
}

/* Closes ch's socket (linger 0: ZMQ drops what is queued and releases the zero-copy frames)
 * and its communicator; the transfers still waiting on ch fail with TDM_EUNAVAILABLE. The
 * next send to the endpoint opens a new socket. */
static void channel_reset(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, const char *why)
{
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
        if (x->ch == ch && !x->finished)
            tdm_kv_xfer_finish(x, TDM_EUNAVAILABLE, "channel to %s reset: %s", ch->endpoint, why);
    TDM_LOG_WARNF(s->log, NULL, "KV channel to %s reset: %s", ch->endpoint, why);
    tdm_sock_destroy(&ch->sock);
    ch->generation++;
    ch->resend_by = 0;
    tdm_kv_channel_drop_comm(s, ch);
}

static int channel_open(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, tdm_error_t *err)
{
    tdm_sock_opts_t o;
    memset(&o, 0, sizeof o);
    /* CURVE: the sender's own pair, and the receiver's key given with the transfer (each
     * decode node has its own pair), else the one the sender was made with */
    tdm_curve_keys_t curve = s->curve;
    if (ch->server_key[0])
        curve.server_public = ch->server_key;
    o.curve = s->has_curve ? &curve : NULL;
    /* the monitor makes a key mismatch, and a connection lost (peer gone, cut, or silent past
     * the ZMTP heartbeat timeout), fail the transfers at once instead of at their timeout */
    o.watch_handshake = true;
    o.log = s->log;
    ch->disconnects = 0;
    ch->resend_by = 0;
    ch->sock = tdm_sock_connect(s->net, ch->endpoint, &o, err);
    if (!ch->sock)
        return tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE,
                                "opening the KV channel to %s: ", ch->endpoint);
    return 0;
}

/* The channel to endpoint, made (and its socket opened) when needed, authenticating the
 * receiver by server_key (CURVE; NULL: the sender's curve.server_public). A channel whose
 * receiver key changed is reset and reopened with the new one. NULL with *err set. */
static tdm_kv_channel_t *channel_get(tdm_kv_sender_t *s, const char *endpoint,
                                     const char *server_key, tdm_error_t *err)
{
    tdm_kv_channel_t *ch = s->channels;
    while (ch && strcmp(ch->endpoint, endpoint) != 0)
        ch = ch->next;
    if (!ch) {
        if (s->n_channels + 2 > s->poll_cap) {
            uint32_t cap = s->poll_cap ? s->poll_cap * 2 : 8;
            void *items = realloc(s->poll_items, cap * sizeof(zmq_pollitem_t));
            if (!items) {
                tdm_error_set(err, TDM_ERESOURCE, "out of memory for KV channel poll items");
                return NULL;
            }
            s->poll_items = items;
            s->poll_cap = cap;
        }
        ch = calloc(1, sizeof *ch);
        if (ch)
            ch->endpoint = tdm_strdup(endpoint);
        if (!ch || !ch->endpoint) {
            free(ch);
            tdm_error_set(err, TDM_ERESOURCE, "out of memory for a KV channel");
            return NULL;
        }
        ch->next = s->channels;
        s->channels = ch;
        s->n_channels++;
    }
    if (!server_key)
        server_key = "";
    if (strlen(server_key) >= sizeof ch->server_key) {
        tdm_error_set(err, TDM_EINVALID,
                      "KV channel to %s: the receiver's CURVE key is %zu "
                      "characters, not 40",
                      endpoint, strlen(server_key));
        return NULL;
    }
    if (strcmp(ch->server_key, server_key) != 0) {
        if (ch->sock)
            channel_reset(s, ch, "the receiver's CURVE key changed");
        snprintf(ch->server_key, sizeof ch->server_key, "%s", server_key);
    }
    if (!ch->sock && channel_open(s, ch, err) != 0)
        return NULL;
    return ch;
}

/* The options a sender cannot work with: a backend not built in, a pool in the wrong memory
 * for the backend, a negative timeout. Returns 0 or TDM_EINVALID. */
/* The OpenMP threads of a transfer's checksums and copies for opts' threads (0: one per core). */
static int kv_threads(int threads)
{
    if (threads > 0)
        return threads;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n > 0 && n < 1024 ? (int)n : 1;
}

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
    s->block_bytes = tdm_kv_pool_block_bytes(pool);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    s->pool_blocks = st.n_blocks;
    copy_str(s->node_id, sizeof s->node_id, opts->node_id);
    s->model_fingerprint = opts->model_fingerprint;
    s->backend = opts->backend;
    s->memory = opts->memory;
    s->timeout_ms = opts->timeout_ms ? opts->timeout_ms : TDM_KV_DEFAULT_TIMEOUT_MS;
    s->threads = kv_threads(opts->threads);
    if (opts->log) {
        s->log_store = *opts->log;
        s->log = &s->log_store;
    }
    s->next_id = 1;
    tdm_frame_init(&s->frame);
    if (has_curve && sender_curve_copy(s, c) != 0)
        goto out_free;
    s->notify = notify_new();
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
        notify_drain(s->notify);
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
    tdm_kv_channel_t *ch = s->channels;
    while (ch) {
        tdm_kv_channel_t *next = ch->next;
        free(ch->endpoint);
        free(ch);
        ch = next;
    }
    notify_unref(s->notify);
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
    uint64_t want = tdm_kv_blocks_for_tokens(&s->layout, req->n_tokens);
    if (req->n_blocks != want)
        return tdm_error_set(
            err, TDM_EINVALID,
            "KV transfer %s: n_blocks is %u but %u tokens need %" PRIu64 " blocks of %u",
            req->request_id, req->n_blocks, req->n_tokens, want, s->layout.block_size);
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
    copy_str(x->request_id, sizeof x->request_id, req->request_id);
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

/* words[i] = block i's offset in the pool; with tcp, data[i] = its zero-copy frame and
 * words[i] then its checksum. */
static void xfer_frames(tdm_kv_sender_t *s, tdm_kv_xfer_t *x, uint64_t *words, tdm_net_data_t *data)
{
    uint32_t n = x->n_blocks;
    bool tcp = s->backend == TDM_KV_BACKEND_TCP;
    uint8_t *base = tdm_kv_pool_base(s->pool);
    for (uint32_t i = 0; i < n; i++) {
        uint64_t off = (uint64_t)x->blocks[i] * s->block_bytes;
        words[i] = off;
        if (tcp) {
            data[i].ptr = base + off;
            data[i].len = (size_t)s->block_bytes;
            data[i].free_fn = frame_released;
            data[i].hint = x;
        }
    }
    if (tcp) {
        /* Checksums are memory-bound: spread large transfers over the engine's threads. */
        const uint64_t bb = s->block_bytes;
#pragma omp parallel for schedule(static)                                                          \
    num_threads(s->threads) if (n >= TDM_KV_PARALLEL_BLOCKS && s->threads > 1)
        for (uint32_t i = 0; i < n; i++)
            words[i] = tdm_kv_block_checksum(base + words[i], bb);
    }
}

/* Device backends: sums[i] = block i's checksum, computed on the GPU over the device pool
 * (the same XXH3-64 value as tcp's, tdm_kv_device_checksums), so the receiver can verify
 * what lands in its device blocks. TDM_EUNAVAILABLE (logged with the CUDA message). */
static int xfer_device_sums(tdm_kv_sender_t *s, const tdm_kv_xfer_t *x, uint64_t *sums)
{
    tdm_error_t e = {0};
    int rc = tdm_kv_device_checksums(s->memory.device, s->memory.device_base, x->blocks,
                                     x->n_blocks, s->block_bytes, sums, &e);
    if (rc != 0)
        TDM_LOG_WARNF(s->log, x->request_id, "KV transfer %" PRIu64 ": device checksums: %s", x->id,
                      e.msg);
    return rc == 0 ? 0 : TDM_EUNAVAILABLE;
}

/* The KvTransfer header of x into *h; it points at lay, handle, words and sums (device
 * backends' checksums), which the caller keeps until the header is sent. */
static void xfer_header(tdm_kv_sender_t *s, const tdm_kv_xfer_t *x, uint64_t *words, uint64_t *sums,
                        Tandem__V1__KvTransfer *h, Tandem__V1__KvLayout *lay,
                        ProtobufCBinaryData *handle)
{
    tandem__v1__kv_transfer__init(h);
    tdm_proto_layout_to(&s->layout, lay);
    h->request_id = (char *)x->request_id;
    h->attempt_id = x->attempt_id;
    h->transfer_id = x->id;
    h->n_tokens = x->n_tokens;
    h->first_token = x->first_token;
    h->layout = lay;
    h->model_fingerprint = s->model_fingerprint;
    h->n_blocks = x->n_blocks;
    h->block_bytes = s->block_bytes;
    h->checksum_kind = TANDEM__V1__CHECKSUM_KIND__CHECKSUM_KIND_XXH3_64;
    h->backend = (char *)tdm_kv_backend_name(s->backend);
    h->sender_node_id = s->node_id;
    h->prefill_s = x->prefill_s;
    *handle = (ProtobufCBinaryData){sizeof s->ipc_handle, s->ipc_handle};
    if (s->backend == TDM_KV_BACKEND_TCP) {
        h->n_checksums = x->n_blocks;
        h->checksums = words;
    } else {
        h->n_checksums = x->n_blocks;
        h->checksums = sums;
    }
    if (s->backend == TDM_KV_BACKEND_CUDA_IPC) {
        h->n_ipc_handles = 1;
        h->ipc_handles = handle;
        h->n_block_offsets = x->n_blocks;
        h->block_offsets = words;
    }
    h->header_checksum = tdm_kv_header_checksum(h);
}

/* Sends x's header and (tcp) its blocks on x->ch's socket, as call x->id: the first time, or
 * again after the connection was lost. Returns tdm_sock_send's result, or TDM_ERESOURCE (out
 * of memory for the header's scratch, nothing sent). */
static int xfer_transmit(tdm_kv_sender_t *s, tdm_kv_xfer_t *x)
{
    uint32_t n = x->n_blocks;
    size_t scratch_bytes = (size_t)n * (2 * sizeof(uint64_t) + sizeof(tdm_net_data_t));
    void *scratch = malloc(scratch_bytes ? scratch_bytes : 1);
    if (!scratch)
        return TDM_ERESOURCE;
    uint64_t *words = scratch;  /* checksums (tcp) or block offsets (cuda_ipc) */
    uint64_t *sums = words + n; /* device backends: checksums computed on the GPU */
    tdm_net_data_t *data = (tdm_net_data_t *)(sums + n);
    xfer_frames(s, x, words, data);
    if (s->backend != TDM_KV_BACKEND_TCP && n > 0 && xfer_device_sums(s, x, sums) != 0) {
        free(scratch);
        return TDM_EUNAVAILABLE;
    }
    Tandem__V1__KvTransfer h;
    Tandem__V1__KvLayout lay;
    ProtobufCBinaryData handle;
    xfer_header(s, x, words, sums, &h, &lay, &handle);

    tdm_send_t m;
    memset(&m, 0, sizeof m);
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = TANDEM__V1__METHOD__METHOD_KV_TRANSFER;
    m.call_id = x->id;
    double left_s = x->deadline - tdm_time_now();
    m.deadline_unix_ms = tdm_net_now_ms() + (uint64_t)(left_s > 0 ? left_s * 1e3 : 0);
    m.body = &h.base;
    if (s->backend == TDM_KV_BACKEND_TCP && n > 0) {
        m.data = data;
        m.n_data = n;
        /* the notify reference is held while any frame of x is in ZMQ's hands (frames of a
         * lost connection may still be on their way to release) */
        if (atomic_fetch_add(&x->pending, n) == 0)
            atomic_fetch_add(&s->notify->refs, 1); /* dropped by the last frame's release */
    }
    int rc = tdm_sock_send(x->ch->sock, &m);
    free(scratch);
    return rc;
}

/* x was not sent (tdm_sock_send returned rc): the record is dropped, or kept unreported
 * while ZMQ still holds frames of it. Returns the error to report. */
static int xfer_send_failed(tdm_kv_sender_t *s, tdm_kv_xfer_t *x, int rc, tdm_error_t *err)
{
    tdm_error_set(err, rc, "KV transfer %s to %s: %s", x->request_id, x->ch->endpoint,
                  rc == TDM_ERESOURCE ? "out of memory" : tdm_sock_errmsg(x->ch->sock));
    /* net.h: every release callback runs once even on failure; normally they already ran
     * (nothing was queued). If ZMQ kept some, the record stays, unreported, until they are
     * released. */
    x->silent = true;
    x->finished = true;
    if (atomic_load(&x->pending) == 0)
        xfer_free(s, x);
    else
        xfer_append(s, x);
    return rc == TDM_EINVALID || rc == TDM_ERESOURCE ? rc : TDM_EUNAVAILABLE;
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
    tdm_kv_channel_t *ch = channel_get(s, req->endpoint, req->server_key, err);
    if (!ch)
        return err ? err->code : TDM_EUNAVAILABLE;
#ifdef TANDEM_HAVE_CUDA
    if (s->backend == TDM_KV_BACKEND_NCCL && (rc = tdm_kv_dev_sender_prepare(s, ch, err)) != 0)
        return rc;
#endif

    tdm_kv_xfer_t *x = xfer_new(s, req, ch, err);
    if (!x)
        return TDM_ERESOURCE;
    rc = xfer_transmit(s, x);
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
                channel_reset(s, ch, why);
                break;
            }
            sender_handle(s, ch, &s->frame);
            tdm_frame_clear(&s->frame);
        }
    }
}

/* CURVE: a channel whose handshake failed never delivers; its transfers fail now, with the
 * reason, instead of at their timeout. */
static void sender_check_handshakes(tdm_kv_sender_t *s)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        char why[200];
        if (!ch->sock || tdm_sock_handshake(ch->sock, why, sizeof why) == TDM_OK)
            continue;
        bool any = false;
        for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next)
            if (x->ch == ch && !x->finished) {
                tdm_kv_xfer_finish(x, TDM_EUNAUTHENTICATED,
                                   "cannot authenticate the decode node's KV endpoint %s: %s",
                                   ch->endpoint, why);
                any = true;
            }
        if (any)
            channel_reset(s, ch, why);
    }
}

/* ch's connection was lost with transfers waiting on it (tcp backend): ZeroMQ does not resend
 * a message cut off mid-way, so each one is sent again, at once, on a new socket, when it has
 * resends and time left (else it fails, UNAVAILABLE, as before); the new connection must
 * complete its handshake within TDM_KV_RESEND_CONNECT_S (sender_check_resends). A transfer
 * whose END was lost on the way back is refused by the receiver the second time (its
 * reservation is in use), which fails it like the connection loss would have. */
static void channel_resend(tdm_kv_sender_t *s, tdm_kv_channel_t *ch, double now)
{
    tdm_sock_destroy(&ch->sock); /* releases the frames the lost connection still held */
    ch->generation++;
    tdm_error_t err = {0};
    if (channel_open(s, ch, &err) != 0) {
        channel_reset(s, ch, err.msg);
        return;
    }
    ch->resend_by = now + TDM_KV_RESEND_CONNECT_S;
    for (tdm_kv_xfer_t *x = s->xfers; x; x = x->next) {
        if (x->ch != ch || x->finished)
            continue;
        if (x->resends >= TDM_KV_MAX_RESENDS || now >= x->deadline) {
            tdm_kv_xfer_finish(x, TDM_EUNAVAILABLE,
                               "the connection to %s was lost (the transfer was sent %u times)",
                               ch->endpoint, x->resends + 1);
            continue;
        }
        x->resends++;
        x->generation = ch->generation;
        int rc = xfer_transmit(s, x);
        if (rc != 0)
            tdm_kv_xfer_finish(x, TDM_EUNAVAILABLE,
                               "resending to %s after the connection was "
                               "lost: %s",
                               ch->endpoint, tdm_strerror(rc));
        else
            TDM_LOG_WARNF(s->log, x->request_id,
                          "KV transfer %" PRIu64 ": the connection to %s was lost; resending "
                          "it (%u of %u)",
                          x->id, ch->endpoint, x->resends, TDM_KV_MAX_RESENDS);
    }
}

/* A channel that sent transfers again after losing its connection: once the new connection's
 * handshake succeeded, nothing more to watch; a receiver that has not completed one by
 * resend_by is gone or cut off, and the transfers fail now instead of at their timeout. */
static void sender_check_resends(tdm_kv_sender_t *s, double now)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        if (!ch->sock || ch->resend_by <= 0)
            continue;
        if (tdm_sock_handshakes(ch->sock) > 0)
            ch->resend_by = 0;
        else if (now >= ch->resend_by)
            channel_reset(s, ch,
                          "the connection to the receiver was lost and no new one "
                          "completed its handshake within " TDM_KV_RESEND_CONNECT_TEXT);
    }
}

/* A channel whose connection dropped while transfers were waiting on it: what was in flight
 * may be lost with it (ZeroMQ does not resend a message cut off mid-way, nor an END that was
 * on the way back). tcp: they are sent again at once on a new connection (channel_resend);
 * the device backends fail them now, UNAVAILABLE, and the router retries them at once
 * instead of after the transfer timeout. */
static void sender_check_connections(tdm_kv_sender_t *s, double now)
{
    for (tdm_kv_channel_t *ch = s->channels; ch; ch = ch->next) {
        uint64_t d = ch->sock ? tdm_sock_disconnects(ch->sock) : 0;
        if (!ch->sock || d == ch->disconnects)
            continue;
        ch->disconnects = d;
        bool waiting = false;
        for (tdm_kv_xfer_t *x = s->xfers; x && !waiting; x = x->next)
            waiting = x->ch == ch && !x->finished;
        if (waiting && s->backend == TDM_KV_BACKEND_TCP)
            channel_resend(s, ch, now);
        else if (waiting)
            channel_reset(s, ch, "the connection to the receiver was lost");
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
            channel_reset(s, x->ch, why);
        } else if (xfer_busy(x) && x->generation == x->ch->generation) {
            /* Finished (cancelled) but ZMQ or NCCL still holds its blocks at the deadline:
             * the receiver is not taking them, so drop what the channel holds. (After a
             * reset the frames are being released already; a newer socket is left alone.) */
            snprintf(why, sizeof why, "blocks of finished transfer %" PRIu64 " still queued",
                     x->id);
            channel_reset(s, x->ch, why);
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
            copy_str(d->request_id, sizeof d->request_id, x->request_id);
            d->attempt_id = x->attempt_id;
            d->transfer_id = x->id;
            d->status = x->status;
            copy_str(d->message, sizeof d->message, x->message);
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
        notify_drain(s->notify);
        sender_read_all(s);
#ifdef TANDEM_HAVE_CUDA
        if (s->backend == TDM_KV_BACKEND_NCCL)
            tdm_kv_dev_sender_progress(s);
#endif
        double now = tdm_time_now();
        if (s->has_curve)
            sender_check_handshakes(s);
        sender_check_connections(s, now);
        sender_check_resends(s, now);
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

/* ---- receiver ---- */

/* The receiver's bound socket (ROUTER, CURVE server when opts->curve is set). Returns NULL
 * with *err set. */
static tdm_sock_t *receiver_bind(tdm_kv_receiver_t *r, const tdm_kv_receiver_opts_t *opts,
                                 tdm_error_t *err)
{
    tdm_sock_opts_t o;
    memset(&o, 0, sizeof o);
    o.curve = opts->curve;
    o.log = r->log;
    /* Transfers wait in ZMQ's receive queue as whole messages (up to a context's KV each):
     * bound it, so that a burst pushes back on the senders (TCP flow control) instead of
     * growing memory. The node handles one transfer per recv call. */
    o.sndhwm = TDM_KV_RECEIVER_HWM;
    tdm_sock_t *sock = tdm_sock_bind(r->net, opts->endpoint, &o, err);
    if (!sock)
        tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE, "KV receiver: ");
    return sock;
}

tdm_kv_receiver_t *tdm_kv_receiver_new(tdm_net_t *net, tdm_kv_pool_t *pool,
                                       const tdm_kv_receiver_opts_t *opts, tdm_error_t *err)
{
    if (!net || !pool || !opts || !opts->endpoint || !opts->endpoint[0]) {
        tdm_error_set(err, TDM_EINVALID, "KV receiver: net, pool, opts and endpoint are required");
        return NULL;
    }
#ifndef TANDEM_HAVE_CUDA
    if (opts->memory.device_base) {
        tdm_error_set(err, TDM_EINVALID,
                      "KV receiver: a device pool needs a CUDA build (-DTANDEM_CUDA=ON)");
        return NULL;
    }
#endif
    if (opts->timeout_ms < 0 || opts->threads < 0) {
        tdm_error_set(err, TDM_EINVALID, "KV receiver %s is %d; must be >= 0",
                      opts->timeout_ms < 0 ? "timeout_ms" : "threads",
                      opts->timeout_ms < 0 ? opts->timeout_ms : opts->threads);
        return NULL;
    }
    tdm_kv_receiver_t *r = calloc(1, sizeof *r);
    if (!r) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory for a KV receiver");
        return NULL;
    }
    r->net = net;
    r->pool = pool;
    r->layout = *tdm_kv_pool_layout(pool);
    r->block_bytes = tdm_kv_pool_block_bytes(pool);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    r->pool_blocks = st.n_blocks;
    copy_str(r->node_id, sizeof r->node_id, opts->node_id);
    r->model_fingerprint = opts->model_fingerprint;
    r->memory = opts->memory;
    r->timeout_ms = opts->timeout_ms ? opts->timeout_ms : TDM_KV_DEFAULT_TIMEOUT_MS;
    r->threads = kv_threads(opts->threads);
    if (opts->log) {
        r->log_store = *opts->log;
        r->log = &r->log_store;
    }
    tdm_frame_init(&r->frames[0]);
    tdm_frame_init(&r->frames[1]);
    r->sums = calloc(r->pool_blocks, sizeof *r->sums);
    if (opts->memory.device_base)
        r->src = calloc(r->pool_blocks, sizeof *r->src);
    if (!r->sums || (opts->memory.device_base && !r->src)) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory for a KV receiver");
        free(r->sums);
        free(r->src);
        free(r);
        return NULL;
    }
    r->sock = receiver_bind(r, opts, err);
    if (!r->sock) {
        free(r->sums);
        free(r->src);
        free(r);
        return NULL;
    }
    return r;
}

void tdm_kv_receiver_destroy(tdm_kv_receiver_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_kv_receiver_t *r = *self_p;
    *self_p = NULL;
#ifdef TANDEM_HAVE_CUDA
    tdm_kv_dev_receiver_free(r);
#endif
    tdm_frame_clear(&r->frames[0]);
    tdm_frame_clear(&r->frames[1]);
    tdm_sock_destroy(&r->sock);
    free(r->sums);
    free(r->src);
    free(r);
}

void *tdm_kv_receiver_zsock(tdm_kv_receiver_t *r)
{
    return r && r->sock ? tdm_sock_zsock(r->sock) : NULL;
}

const char *tdm_kv_receiver_endpoint(const tdm_kv_receiver_t *r)
{
    return r && r->sock ? tdm_sock_endpoint(r->sock) : "";
}

/* The request id and the backend (known, built in, and one this node's pool can take). */
static int check_header_backend(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                                tdm_kv_backend_t *backend, char *msg, size_t cap)
{
    if (!h->request_id[0])
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "request_id is empty");
    if (strlen(h->request_id) > TDM_REQUEST_ID_MAX)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "request_id is %zu bytes; at most %u",
                                 strlen(h->request_id), TDM_REQUEST_ID_MAX);
    if (tdm_kv_backend_parse(h->backend, backend, NULL) != 0)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                 "backend \"%.64s\" unknown (tcp, nccl, cuda_ipc)", h->backend);
    if (!tdm_kv_backend_built(*backend))
        return tdm_kv_reject_msg(msg, cap, TDM_EPRECONDITION,
                                 "backend %s is not built into this node (no CUDA)", h->backend);
    if (*backend != TDM_KV_BACKEND_TCP && !r->memory.device_base)
        return tdm_kv_reject_msg(msg, cap, TDM_EPRECONDITION,
                                 "backend %s needs a device pool; this node's pool is in host "
                                 "memory",
                                 h->backend);
    return 0;
}

/* What must agree with this node: layout, model, block size, the block count for n_tokens
 * (and against the pool), the checksum kind. */
static int check_header_layout(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                               char *msg, size_t cap)
{
    if (!h->layout)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "layout is missing");
    tdm_kv_layout_t l;
    tdm_error_t e;
    if (tdm_proto_layout_from(h->layout, &l, &e) != 0)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "%s", e.msg);
    const tdm_kv_layout_t *mine = &r->layout;
    uint32_t theirs = 0, ours = 0;
    const char *field = tdm_kv_layout_mismatch(&l, mine, &theirs, &ours);
    if (field && strcmp(field, "dtype") == 0)
        return tdm_kv_reject_msg(msg, cap, TDM_EPRECONDITION,
                                 "KV layout mismatch: dtype is %s in the transfer, %s on this node",
                                 tdm_kv_dtype_name((tdm_kv_dtype_t)theirs),
                                 tdm_kv_dtype_name((tdm_kv_dtype_t)ours));
    if (field)
        return tdm_kv_reject_msg(msg, cap, TDM_EPRECONDITION,
                                 "KV layout mismatch: %s is %u in the transfer, %u on this node",
                                 field, theirs, ours);
    if (h->model_fingerprint != r->model_fingerprint)
        return tdm_kv_reject_msg(msg, cap, TDM_EPRECONDITION,
                                 "model fingerprint mismatch: transfer 0x%016" PRIx64
                                 ", this node serves 0x%016" PRIx64,
                                 h->model_fingerprint, r->model_fingerprint);
    if (h->block_bytes != r->block_bytes)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                 "block_bytes is %" PRIu64 "; the layout gives %" PRIu64,
                                 h->block_bytes, r->block_bytes);
    if (h->n_tokens == 0)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "n_tokens is 0");
    uint64_t want = tdm_kv_blocks_for_tokens(mine, h->n_tokens);
    if (h->n_blocks != want)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                 "n_blocks is %u but %u tokens need %" PRIu64 " blocks of %u",
                                 h->n_blocks, h->n_tokens, want, mine->block_size);
    if (h->n_blocks > r->pool_blocks)
        return tdm_kv_reject_msg(msg, cap, TDM_ERESOURCE,
                                 "transfer of %u blocks exceeds this node's pool of %u blocks",
                                 h->n_blocks, r->pool_blocks);
    if (h->checksum_kind != TANDEM__V1__CHECKSUM_KIND__CHECKSUM_KIND_XXH3_64)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "checksum_kind %d unknown",
                                 (int)h->checksum_kind);
    return 0;
}

/* tcp: one data frame of block_bytes per block, one checksum each. */
static int check_header_tcp(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                            const Tandem__V1__KvTransfer *h, char *msg, size_t cap)
{
    if (f->n_data < h->n_blocks)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                 "truncated transfer: %u data frames for %u blocks", f->n_data,
                                 h->n_blocks);
    if (f->n_data > h->n_blocks)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "%u data frames for %u blocks", f->n_data,
                                 h->n_blocks);
    if (h->n_checksums != h->n_blocks)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "%zu checksums for %u blocks",
                                 h->n_checksums, h->n_blocks);
    for (uint32_t i = 0; i < f->n_data; i++) {
        size_t len = 0;
        tdm_frame_data(f, i, &len);
        if (len != r->block_bytes)
            return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                     "block %u is %zu bytes; expected %" PRIu64, i, len,
                                     r->block_bytes);
    }
    return 0;
}

/* nccl, cuda_ipc: no data frames; one checksum per block (computed on the sender's GPU, verified
 * on this node's after the blocks land); cuda_ipc's handle and block offsets. */
static int check_header_device(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                               const Tandem__V1__KvTransfer *h, tdm_kv_backend_t backend, char *msg,
                               size_t cap)
{
    if (f->n_data != 0)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                 "%u data frames with backend %s (the blocks travel over the "
                                 "device channel)",
                                 f->n_data, h->backend);
    if (h->n_checksums != h->n_blocks)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                 "%zu checksums for %u blocks with backend %s (one per block, "
                                 "computed on the sender's device)",
                                 h->n_checksums, h->n_blocks, h->backend);
    if (backend == TDM_KV_BACKEND_CUDA_IPC) {
        if (h->n_ipc_handles != 1 || h->ipc_handles[0].len != 64)
            return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                     "cuda_ipc needs one 64-byte ipc handle; got %zu",
                                     h->n_ipc_handles);
        if (h->n_block_offsets != h->n_blocks)
            return tdm_kv_reject_msg(msg, cap, TDM_EINVALID, "%zu block offsets for %u blocks",
                                     h->n_block_offsets, h->n_blocks);
        for (uint32_t i = 0; i < h->n_blocks; i++)
            if (h->block_offsets[i] % r->block_bytes != 0 ||
                h->block_offsets[i] > UINT64_MAX - r->block_bytes)
                return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                         "block %u offset %" PRIu64 " is not a block boundary", i,
                                         h->block_offsets[i]);
    }
    return 0;
}

/* Checks a KvTransfer header against this receiver (everything but the checksums and the
 * reserved blocks). Returns 0 with *backend set, or the status with msg filled. */
static int check_header(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                        const Tandem__V1__KvTransfer *h, tdm_kv_backend_t *backend, char *msg,
                        size_t cap)
{
    int rc;
    if ((rc = check_header_backend(r, h, backend, msg, cap)) != 0 ||
        (rc = check_header_layout(r, h, msg, cap)) != 0)
        return rc;
    if (*backend == TDM_KV_BACKEND_TCP)
        return check_header_tcp(r, f, h, msg, cap);
    return check_header_device(r, f, h, *backend, msg, cap);
}

/* got[0..n_blocks) against the header's checksums: 0, or TDM_EINVALID naming the first block
 * that differs. */
static int compare_checksums(const uint64_t *got, const Tandem__V1__KvTransfer *h, char *msg,
                             size_t cap)
{
    for (uint32_t i = 0; i < h->n_blocks; i++)
        if (got[i] != h->checksums[i])
            return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                     "block %u checksum mismatch: got 0x%016" PRIx64
                                     " expected 0x%016" PRIx64,
                                     i, got[i], h->checksums[i]);
    return 0;
}

/* Verifies every block's checksum (in parallel for large transfers); the first mismatching
 * block is the one named. */
static int verify_checksums(const tdm_kv_receiver_t *r, const tdm_frame_t *f,
                            const Tandem__V1__KvTransfer *h, char *msg, size_t cap)
{
    uint32_t n = h->n_blocks;
    uint64_t *got = r->sums;
    const uint64_t bb = r->block_bytes;
#pragma omp parallel for schedule(static)                                                          \
    num_threads(r->threads) if (n >= TDM_KV_PARALLEL_BLOCKS && r->threads > 1)
    for (uint32_t i = 0; i < n; i++) {
        size_t len = 0;
        got[i] = tdm_kv_block_checksum(tdm_frame_data(f, i, &len), bb);
    }
    return compare_checksums(got, h, msg, cap);
}

/* Asks the node for the blocks reserved for the request and checks them. */
static int lookup_blocks(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                         tdm_kv_lookup_fn lookup, void *user, const uint32_t **blocks, char *msg,
                         size_t cap)
{
    if (!lookup)
        return tdm_kv_reject_msg(msg, cap, TDM_EINTERNAL, "the receiver has no lookup callback");
    uint32_t n = 0;
    *blocks = NULL;
    msg[0] = '\0';
    int rc = lookup(user, h->request_id, h->attempt_id, h->n_tokens, blocks, &n, msg, cap);
    if (rc != 0) {
        if (rc > 0)
            rc = TDM_EINTERNAL;
        if (!msg[0])
            snprintf(msg, cap, "request %s: %s", h->request_id, tdm_strerror(rc));
        return rc;
    }
    if (!*blocks || n < h->n_blocks)
        return tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                                 "request %s has %u blocks reserved; the transfer carries %u",
                                 h->request_id, *blocks ? n : 0, h->n_blocks);
    for (uint32_t i = 0; i < h->n_blocks; i++) {
        uint32_t b = (*blocks)[i];
        if (b >= r->pool_blocks || tdm_kv_pool_refcount(r->pool, b) == 0)
            return tdm_kv_reject_msg(msg, cap, TDM_EINTERNAL,
                                     "request %s: reserved block %u (index %u) is not a block in "
                                     "use in this pool",
                                     h->request_id, b, i);
    }
    return 0;
}

/* Reads the next message into frames[cur]: the one read ahead, or from the socket. */
static int receiver_next(tdm_kv_receiver_t *r, int timeout_ms)
{
    if (r->has_next) {
        tdm_frame_clear(&r->frames[r->cur]);
        r->cur ^= 1;
        r->has_next = false;
        return 0;
    }
    return tdm_sock_recv(r->sock, &r->frames[r->cur], timeout_ms);
}

/* Whether the next message, if one is already waiting, cancels f. A message that does not is
 * kept for the next receive. */
static bool cancel_follows(tdm_kv_receiver_t *r, const tdm_frame_t *f)
{
    tdm_frame_t *n = &r->frames[r->cur ^ 1];
    if (r->has_next || tdm_sock_recv(r->sock, n, 0) != 0)
        return false;
    if (n->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL && n->call_id == f->call_id &&
        n->peer_len == f->peer_len && memcmp(n->peer, f->peer, f->peer_len) == 0) {
        tdm_frame_clear(n);
        return true;
    }
    r->has_next = true;
    return false;
}

/* The header's fields the caller is told about, into out. */
static void received_fill(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                          tdm_kv_received_t *out)
{
    copy_str(out->request_id, sizeof out->request_id, h->request_id);
    out->attempt_id = h->attempt_id;
    copy_str(out->sender_node_id, sizeof out->sender_node_id, h->sender_node_id);
    out->transfer_id = h->transfer_id;
    out->n_tokens = h->n_tokens;
    out->first_token = h->first_token;
    out->n_blocks = h->n_blocks;
    out->bytes = (uint64_t)h->n_blocks * r->block_bytes;
    out->prefill_s = h->prefill_s;
}

/* Whether a tcp transfer is verified while it is copied into the reserved blocks (one pass
 * over the data) rather than before (two): a host pool, and every reserved block held by
 * this attempt alone (refcount 1). Such blocks were allocated for the reservation
 * (tdm_kv_seq_reserve) and are in no sequence the engine runs and in no prefix-cache index
 * until the transfer is accepted, so a rejected transfer's bytes in them are never read:
 * the node drops the reservation, which frees them. A block shared with anything else is
 * written only after every checksum matched. */
static bool fused_copy(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                       const uint32_t *blocks)
{
    if (r->memory.device_base)
        return false;
    for (uint32_t i = 0; i < h->n_blocks; i++)
        if (tdm_kv_pool_refcount(r->pool, blocks[i]) != 1)
            return false;
    return true;
}

/* Copies bb bytes from src to dst and returns the XXH3-64 of what dst now holds, hashed
 * right after the copy, while the block (a few hundred KiB) is still in L2. Measured on
 * 368,640-byte blocks against hashing every frame and then copying every block: 1.3x as fast
 * for 32 blocks, 2.9x for 256 (out of cache); copying and hashing 16 or 64 KiB pieces (in
 * L1) was slower than one whole-block memcpy then one hash. */
static uint64_t copy_checksum(uint8_t *dst, const uint8_t *src, uint64_t bb)
{
    memcpy(dst, src, (size_t)bb);
    return tdm_kv_block_checksum(dst, bb);
}

/* The fused tcp write (fused_copy): every block copied into its reserved block and hashed
 * there, then compared with the header's checksums; the first mismatching block is the one
 * named, as verify_checksums does. */
static int copy_verify(tdm_kv_receiver_t *r, const tdm_frame_t *f, const Tandem__V1__KvTransfer *h,
                       const uint32_t *blocks, char *msg, size_t cap)
{
    uint8_t *base = tdm_kv_pool_base(r->pool);
    uint64_t *got = r->sums;
    const uint64_t bb = r->block_bytes;
    const uint32_t n = h->n_blocks;
#pragma omp parallel for schedule(static)                                                          \
    num_threads(r->threads) if (n >= TDM_KV_PARALLEL_BLOCKS && r->threads > 1)
    for (uint32_t i = 0; i < n; i++) {
        size_t len = 0;
        got[i] = copy_checksum(base + (uint64_t)blocks[i] * bb, tdm_frame_data(f, i, &len), bb);
    }
    return compare_checksums(got, h, msg, cap);
}

/* Every check of a transfer: the header (check_header), the sender it claims against the
 * connection's CURVE key, the header checksum, the reserved blocks (lookup, into *blocks),
 * and the blocks' checksums (tcp, unless they are verified while copied: fused_copy).
 * Returns 0 with *backend set, or the status with msg filled. */
static int transfer_check(tdm_kv_receiver_t *r, const tdm_frame_t *f,
                          const Tandem__V1__KvTransfer *h, tdm_kv_lookup_fn lookup, void *user,
                          tdm_kv_backend_t *backend, const uint32_t **blocks, char *msg, size_t cap)
{
    int st = check_header(r, f, h, backend, msg, cap);
    /* CURVE: the connection's key names the prefill node (ZAP User-Id); the header may not
     * claim another sender */
    if (st == 0 && f->user_id[0] && strcmp(f->user_id, h->sender_node_id) != 0)
        st = tdm_kv_reject_msg(msg, cap, TDM_EUNAUTHENTICATED,
                               "the key of node '%s' sent a transfer claiming sender '%.64s'",
                               f->user_id, h->sender_node_id);
    if (st == 0 && tdm_kv_header_checksum(h) != h->header_checksum)
        st = tdm_kv_reject_msg(msg, cap, TDM_EINVALID,
                               "header checksum mismatch: got 0x%016" PRIx64
                               " computed 0x%016" PRIx64 " (a header field was altered in flight)",
                               h->header_checksum, tdm_kv_header_checksum(h));
    if (st == 0)
        st = lookup_blocks(r, h, lookup, user, blocks, msg, cap);
    /* tcp into blocks this attempt holds alone: verified while copied (transfer_write) */
    if (st == 0 && *backend == TDM_KV_BACKEND_TCP && !fused_copy(r, h, *blocks))
        st = verify_checksums(r, f, h, msg, cap);
    return st;
}

/* Writes the checked transfer into the reserved blocks: copied from the frames (host pool;
 * verified on the way when fused_copy), or through the device backend. Returns 0 or the
 * status with msg filled. */
static int transfer_write(tdm_kv_receiver_t *r, const tdm_frame_t *f,
                          const Tandem__V1__KvTransfer *h, tdm_kv_backend_t backend,
                          const uint32_t *blocks, char *msg, size_t cap)
{
    if (backend == TDM_KV_BACKEND_TCP && fused_copy(r, h, blocks))
        return copy_verify(r, f, h, blocks, msg, cap);
    if (backend == TDM_KV_BACKEND_TCP && !r->memory.device_base) {
        uint8_t *base = tdm_kv_pool_base(r->pool);
        const uint64_t bb = r->block_bytes;
        const uint32_t n = h->n_blocks;
#pragma omp parallel for schedule(static)                                                          \
    num_threads(r->threads) if (n >= TDM_KV_PARALLEL_BLOCKS && r->threads > 1)
        for (uint32_t k = 0; k < n; k++) {
            uint32_t i = n - 1 - k; /* the blocks verified last first: still in cache */
            size_t len = 0;
            memcpy(base + (uint64_t)blocks[i] * bb, tdm_frame_data(f, i, &len), (size_t)bb);
        }
        return 0;
    }
    int st = 0;
#ifdef TANDEM_HAVE_CUDA
    if (backend == TDM_KV_BACKEND_TCP) {
        for (uint32_t i = 0; i < h->n_blocks; i++) {
            size_t len = 0;
            r->src[i] = tdm_frame_data(f, i, &len);
        }
        st = tdm_kv_dev_copy_h2d(r, r->src, blocks, h->n_blocks, msg, cap);
    } else {
        st = tdm_kv_dev_receive(r, f, h, backend, blocks, msg, cap);
    }
    /* what landed in the device blocks, hashed there, against the header's checksums */
    if (st == 0)
        st = tdm_kv_dev_verify(r, h, blocks, msg, cap);
#endif
    return st;
}

/* Acknowledges (st 0) or rejects the transfer and logs the outcome; fills out's status. */
static void transfer_reply(tdm_kv_receiver_t *r, const tdm_frame_t *f, int st, const char *msg,
                           tdm_kv_backend_t backend, tdm_kv_received_t *out)
{
    out->status = st;
    copy_str(out->message, sizeof out->message, msg);
    int rc = st == 0 ? tdm_sock_reply(r->sock, f, NULL)
                     : tdm_sock_reply_error(r->sock, f, st, "%s", msg);
    if (rc != 0)
        TDM_LOG_WARNF(r->log, out->request_id, "KV transfer %" PRIu64 ": reply not sent: %s",
                      out->transfer_id, tdm_sock_errmsg(r->sock));
    if (st != 0)
        TDM_LOG_WARNF(r->log, out->request_id, "KV transfer %" PRIu64 " from %s rejected: %s %s",
                      out->transfer_id, out->sender_node_id[0] ? out->sender_node_id : "?",
                      tdm_status_name(st), msg);
    else
        TDM_LOG_DEBUGF(r->log, out->request_id,
                       "KV transfer %" PRIu64 " accepted: %u blocks, %" PRIu64 " bytes, %s",
                       out->transfer_id, out->n_blocks, out->bytes, tdm_kv_backend_name(backend));
}

static void handle_transfer(tdm_kv_receiver_t *r, const tdm_frame_t *f, tdm_kv_lookup_fn lookup,
                            void *user, tdm_kv_received_t *out)
{
    char msg[TDM_ERRMSG_MAX] = "";
    int st = 0;
    tdm_kv_backend_t backend = TDM_KV_BACKEND_TCP;
    const uint32_t *blocks = NULL;
    Tandem__V1__KvTransfer *h =
        (Tandem__V1__KvTransfer *)tdm_frame_unpack(f, &tandem__v1__kv_transfer__descriptor);
    out->transfer_id = f->call_id;
    if (!h) {
        st = tdm_kv_reject_msg(msg, sizeof msg, TDM_EINVALID,
                               "KvTransfer header does not decode (%zu bytes)", f->body_len);
        transfer_reply(r, f, st, msg, backend, out);
        return;
    }
    received_fill(r, h, out);
    if (cancel_follows(r, f)) {
        out->status = TDM_ECANCELLED;
        snprintf(out->message, sizeof out->message,
                 "cancelled by the sender before it was handled");
    } else {
        st = transfer_check(r, f, h, lookup, user, &backend, &blocks, msg, sizeof msg);
        /* Every check passed but, for blocks this attempt holds alone, the blocks' checksums,
         * verified while they are copied (fused_copy): a rejected transfer's bytes stay in
         * blocks no one reads, freed with the reservation. Shared blocks and device pools
         * are written only after every check passed. */
        if (st == 0)
            st = transfer_write(r, f, h, backend, blocks, msg, sizeof msg);
        transfer_reply(r, f, st, msg, backend, out);
    }
    protobuf_c_message_free_unpacked(&h->base, NULL);
}

int tdm_kv_receiver_recv(tdm_kv_receiver_t *r, int timeout_ms, tdm_kv_lookup_fn lookup, void *user,
                         tdm_kv_received_t *out)
{
    if (!r || !out)
        return TDM_EINTERNAL;
    memset(out, 0, sizeof *out);
    double t_end = tdm_time_now() + (timeout_ms > 0 ? timeout_ms / 1e3 : 0);
    for (;;) {
        double left_ms = (t_end - tdm_time_now()) * 1e3;
        int rc = receiver_next(r, left_ms > 0 ? (int)left_ms + 1 : 0);
        if (rc == TDM_EDEADLINE || rc == TDM_ECANCELLED)
            return 0;
        if (rc != 0) {
            TDM_LOG_ERRORF(r->log, NULL, "KV receiver: %s", tdm_sock_errmsg(r->sock));
            return TDM_EINTERNAL;
        }
        tdm_frame_t *f = &r->frames[r->cur];
        bool request = f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
        if (request && f->method == TANDEM__V1__METHOD__METHOD_KV_TRANSFER) {
            handle_transfer(r, f, lookup, user, out);
            tdm_frame_clear(f);
            return 1;
        }
        if (request && f->method == TANDEM__V1__METHOD__METHOD_KV_HELLO) {
#ifdef TANDEM_HAVE_CUDA
            tdm_kv_dev_hello(r, f);
#else
            tdm_sock_reply_error(r->sock, f, TDM_EPRECONDITION,
                                 "this node has no device KV backends (built without CUDA)");
#endif
        } else if (request) {
            tdm_sock_reply_error(r->sock, f, TDM_EINVALID,
                                 "method %s is not served on a KV endpoint",
                                 tdm_net_method_name(f->method));
        } else if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL) {
            TDM_LOG_DEBUGF(r->log, NULL, "KV: cancel of call %" PRIu64 " after it was handled",
                           f->call_id);
        } else {
            TDM_LOG_DEBUGF(r->log, NULL, "KV: %s frame ignored", tdm_net_kind_name(f->kind));
        }
        tdm_frame_clear(f);
        if (tdm_time_now() >= t_end && !r->has_next)
            return 0;
    }
}
