/* receiver.c - the KV receiver (tandem/transfer.h, the decode node's side): the bound ROUTER
 * socket, tdm_kv_receiver_recv (one transfer per call; KV_HELLO and CANCEL frames on the way),
 * the checks of a transfer in order (header.c's, the sender's identity, the header checksum,
 * the reserved blocks from the node's lookup, the block checksums), the write into the
 * reserved blocks (tcp.c, device.c) and the reply, which names what was wrong; and the early
 * transfers, which came before the node decided their reservation (the router starts the
 * prefill with the reservation): held unanswered in their ZMQ messages, within a bound in
 * bytes and in time, until the node resumes or refuses them.
 */
#include "transfer/transfer_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Messages a receiver's socket queues (ZMQ_RCVHWM = ZMQ_SNDHWM in common/net). */
#define TDM_KV_RECEIVER_HWM 64

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

/* The options a receiver cannot work with: a device pool without CUDA, a negative timeout or
 * thread count. Returns 0 or TDM_EINVALID. */
static int receiver_opts_check(const tdm_kv_receiver_opts_t *opts, tdm_error_t *err)
{
#ifndef TANDEM_HAVE_CUDA
    if (opts->memory.device_base)
        return tdm_error_set(err, TDM_EINVALID,
                             "KV receiver: a device pool needs a CUDA build (-DTANDEM_CUDA=ON)");
#endif
    if (opts->timeout_ms < 0 || opts->threads < 0 || opts->hold_ms < 0)
        return tdm_error_set(err, TDM_EINVALID, "KV receiver %s is %d; must be >= 0",
                             opts->timeout_ms < 0 ? "timeout_ms"
                             : opts->threads < 0  ? "threads"
                                                  : "hold_ms",
                             opts->timeout_ms < 0 ? opts->timeout_ms
                             : opts->threads < 0  ? opts->threads
                                                  : opts->hold_ms);
    return 0;
}

tdm_kv_receiver_t *tdm_kv_receiver_new(tdm_net_t *net, tdm_kv_pool_t *pool,
                                       const tdm_kv_receiver_opts_t *opts, tdm_error_t *err)
{
    if (!net || !pool || !opts || !opts->endpoint || !opts->endpoint[0]) {
        tdm_error_set(err, TDM_EINVALID, "KV receiver: net, pool, opts and endpoint are required");
        return NULL;
    }
    if (receiver_opts_check(opts, err) != 0)
        return NULL;
    tdm_kv_receiver_t *r = calloc(1, sizeof *r);
    if (!r)
        goto out_oom;
    r->net = net;
    r->pool = pool;
    r->layout = *tdm_kv_pool_layout(pool);
    r->groups = tdm_kv_pool_groups(pool);
    r->block_bytes = tdm_kv_pool_block_bytes(pool);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    r->pool_blocks = st.n_blocks;
    tdm_kv_copy_str(r->node_id, sizeof r->node_id, opts->node_id);
    r->model_fingerprint = opts->model_fingerprint;
    r->memory = opts->memory;
    r->timeout_ms = opts->timeout_ms ? opts->timeout_ms : TDM_KV_DEFAULT_TIMEOUT_MS;
    r->hold_bytes = opts->hold_bytes;
    r->hold_ms = opts->hold_ms > 0 ? opts->hold_ms : TDM_KV_DEFAULT_HOLD_MS;
    r->threads = tdm_kv_threads(opts->threads);
    if (opts->log) {
        r->log_store = *opts->log;
        r->log = &r->log_store;
    }
    tdm_frame_init(&r->frames[0]);
    tdm_frame_init(&r->frames[1]);
    r->sums = calloc(r->pool_blocks, sizeof *r->sums);
    if (opts->memory.device_base)
        r->src = calloc(r->pool_blocks, sizeof *r->src);
    if (!r->sums || (opts->memory.device_base && !r->src))
        goto out_free;
    r->sock = receiver_bind(r, opts, err);
    if (!r->sock) {
        tdm_kv_receiver_destroy(&r);
        return NULL;
    }
    return r;

out_free:
    tdm_kv_receiver_destroy(&r);
out_oom:
    tdm_error_set(err, TDM_ERESOURCE, "out of memory for a KV receiver");
    return NULL;
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
    for (uint32_t i = 0; i < r->n_held; i++) /* unanswered: their senders time out */
        tdm_frame_clear(&r->held[i].f);
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

/* Asks the node for the blocks reserved for the request and checks them. */
static int lookup_blocks(const tdm_kv_receiver_t *r, const Tandem__V1__KvTransfer *h,
                         tdm_kv_lookup_fn lookup, void *user, const uint32_t **blocks,
                         tdm_error_t *err)
{
    if (!lookup)
        return tdm_error_set(err, TDM_EINTERNAL, "the receiver has no lookup callback");
    uint32_t n = 0;
    *blocks = NULL;
    tdm_error_clear(err);
    int rc = lookup(user, h->request_id, h->attempt_id, h->n_tokens, blocks, &n, err);
    if (rc == TDM_KV_LOOKUP_WAIT)
        return rc; /* its reservation is not decided yet: the caller may hold it */
    if (rc != 0) {
        /* the returned status is the one the transfer is rejected with */
        if (rc > 0)
            rc = TDM_EINTERNAL;
        if (!err->msg[0])
            return tdm_error_set(err, rc, "request %s: %s", h->request_id, tdm_strerror(rc));
        err->code = rc;
        return rc;
    }
    if (!*blocks || n < h->n_blocks)
        return tdm_error_set(err, TDM_EINVALID,
                             "request %s has %u blocks reserved; the transfer carries %u",
                             h->request_id, *blocks ? n : 0, h->n_blocks);
    for (uint32_t i = 0; i < h->n_blocks; i++) {
        uint32_t b = (*blocks)[i];
        if (b >= r->pool_blocks || tdm_kv_pool_refcount(r->pool, b) == 0)
            return tdm_error_set(err, TDM_EINTERNAL,
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
    tdm_kv_copy_str(out->request_id, sizeof out->request_id, h->request_id);
    out->attempt_id = h->attempt_id;
    tdm_kv_copy_str(out->sender_node_id, sizeof out->sender_node_id, h->sender_node_id);
    out->transfer_id = h->transfer_id;
    out->n_tokens = h->n_tokens;
    out->first_token = h->first_token;
    out->n_blocks = h->n_blocks;
    out->bytes = (uint64_t)h->n_blocks * r->block_bytes;
    out->prefill_s = h->prefill_s;
}

/* Every check of a transfer: the header (tdm_kv_header_check), the sender it claims against
 * the connection's CURVE key, the header checksum, the reserved blocks (lookup, into
 * *blocks), and the blocks' checksums (tcp, unless they are verified while copied:
 * tdm_kv_tcp_fused). Returns 0 with *backend set, or the status to reject with, *err set. */
static int transfer_check(tdm_kv_receiver_t *r, const tdm_frame_t *f,
                          const Tandem__V1__KvTransfer *h, tdm_kv_lookup_fn lookup, void *user,
                          tdm_kv_backend_t *backend, const uint32_t **blocks, tdm_error_t *err)
{
    int st = tdm_kv_header_check(r, f, h, backend, err);
    /* CURVE: the connection's key names the prefill node (ZAP User-Id); the header may not
     * claim another sender */
    if (st == 0 && f->user_id[0] && strcmp(f->user_id, h->sender_node_id) != 0)
        st = tdm_error_set(err, TDM_EUNAUTHENTICATED,
                           "the key of node '%s' sent a transfer claiming sender '%.64s'",
                           f->user_id, h->sender_node_id);
    if (st == 0 && tdm_kv_header_checksum(h) != h->header_checksum)
        st = tdm_error_set(err, TDM_EINVALID,
                           "header checksum mismatch: got 0x%016" PRIx64 " computed 0x%016" PRIx64
                           " (a header field was altered in flight)",
                           h->header_checksum, tdm_kv_header_checksum(h));
    if (st == 0)
        st = lookup_blocks(r, h, lookup, user, blocks, err);
    /* tcp into blocks this attempt holds alone: verified while copied (transfer_write) */
    if (st == 0 && *backend == TDM_KV_BACKEND_TCP && !tdm_kv_tcp_fused(r, h, *blocks))
        st = tdm_kv_tcp_verify(r, f, h, err);
    return st;
}

/* Writes the checked transfer into the reserved blocks: tcp's frames (tcp.c), or through the
 * device backend; with a device pool, what landed is then hashed there and compared with the
 * header's checksums. Returns 0 or the status to reject with, *err set. */
static int transfer_write(tdm_kv_receiver_t *r, const tdm_frame_t *f,
                          const Tandem__V1__KvTransfer *h, tdm_kv_backend_t backend,
                          const uint32_t *blocks, tdm_error_t *err)
{
    int st = 0;
    if (backend == TDM_KV_BACKEND_TCP)
        st = tdm_kv_tcp_write(r, f, h, blocks, err);
#ifdef TANDEM_HAVE_CUDA
    else
        st = tdm_kv_dev_receive(r, f, h, backend, blocks, err);
    if (st == 0 && r->memory.device_base)
        st = tdm_kv_dev_verify(r, h, blocks, err);
#endif
    return st;
}

/* Acknowledges (st 0) or rejects the transfer with status st and the reason why, and logs the
 * outcome; fills out's status and message. */
static void transfer_reply(tdm_kv_receiver_t *r, const tdm_frame_t *f, int st, const char *why,
                           tdm_kv_backend_t backend, tdm_kv_received_t *out)
{
    out->status = st;
    tdm_kv_copy_str(out->message, sizeof out->message, st == 0 ? "" : why);
    int rc = st == 0 ? tdm_sock_reply(r->sock, f, NULL)
                     : tdm_sock_reply_error(r->sock, f, st, "%s", why);
    if (rc != 0)
        TDM_LOG_WARNF(r->log, out->request_id, "KV transfer %" PRIu64 ": reply not sent: %s",
                      out->transfer_id, tdm_sock_errmsg(r->sock));
    if (st != 0)
        TDM_LOG_WARNF(r->log, out->request_id, "KV transfer %" PRIu64 " from %s rejected: %s %s",
                      out->transfer_id, out->sender_node_id[0] ? out->sender_node_id : "?",
                      tdm_status_name(st), why);
    else
        TDM_LOG_DEBUGF(r->log, out->request_id,
                       "KV transfer %" PRIu64 " accepted: %u blocks, %" PRIu64 " bytes, %s",
                       out->transfer_id, out->n_blocks, out->bytes, tdm_kv_backend_name(backend));
}

/* The bytes of f's parts: what holding it keeps in memory. */
static uint64_t frame_bytes(const tdm_frame_t *f)
{
    uint64_t bytes = f->body_len;
    for (uint32_t i = 0; i < f->n_data; i++) {
        size_t len = 0;
        (void)tdm_frame_data(f, i, &len);
        bytes += len;
    }
    return bytes;
}

/* Holds the transfer f (moved in) until its reservation of attempt is decided. Returns 0, or
 * TDM_ENOTFOUND with *err set when the bound in bytes or count leaves no room (f untouched). */
static int hold(tdm_kv_receiver_t *r, tdm_frame_t *f, const Tandem__V1__KvTransfer *h,
                tdm_error_t *err)
{
    uint64_t bytes = frame_bytes(f);
    if (r->n_held == TDM_KV_HELD_MAX || r->held_bytes + bytes > r->hold_bytes)
        return tdm_error_set(err, TDM_ENOTFOUND,
                             "no reservation for attempt %016" PRIx64 " of request '%s' yet, and "
                             "no room to hold the transfer until it is decided (%u transfers, "
                             "%" PRIu64 " + %" PRIu64 " bytes over the bound of %" PRIu64 ")",
                             h->attempt_id, h->request_id, r->n_held, r->held_bytes, bytes,
                             r->hold_bytes);
    tdm_kv_held_t *e = &r->held[r->n_held++];
    tdm_frame_init(&e->f);
    tdm_frame_move(&e->f, f);
    e->attempt_id = h->attempt_id;
    e->bytes = bytes;
    e->until = tdm_time_now() + r->hold_ms / 1e3;
    r->held_bytes += bytes;
    TDM_LOG_DEBUGF(r->log, h->request_id,
                   "KV transfer %" PRIu64 " held: attempt %016" PRIx64 " not decided yet "
                   "(%u held, %" PRIu64 " bytes)",
                   h->transfer_id, h->attempt_id, r->n_held, r->held_bytes);
    return 0;
}

/* Handles the transfer f: checks, lookup, write, reply, into *out. may_hold: a lookup that
 * says TDM_KV_LOOKUP_WAIT holds it (moved out of f) within the bounds; else that answer is
 * NOT_FOUND. Returns true with *out filled, false when it was held (no reply, no outcome). */
static bool handle_transfer(tdm_kv_receiver_t *r, tdm_frame_t *f, tdm_kv_lookup_fn lookup,
                            void *user, bool may_hold, tdm_kv_received_t *out)
{
    tdm_error_t res = {0};
    tdm_kv_backend_t backend = TDM_KV_BACKEND_TCP;
    const uint32_t *blocks = NULL;
    out->transfer_id = f->call_id;
    if (!f->body || f->body_len == 0) {
        /* an empty header would decode as one whose every field is unset ("request_id is
         * empty"), which hides what went wrong */
        int st = tdm_error_set(&res, TDM_EINVALID,
                               "KvTransfer header frame is missing (%u data frames)", f->n_data);
        transfer_reply(r, f, st, res.msg, backend, out);
        return true;
    }
    Tandem__V1__KvTransfer *h =
        (Tandem__V1__KvTransfer *)tdm_frame_unpack(f, &tandem__v1__kv_transfer__descriptor);
    if (!h) {
        int st = tdm_error_set(&res, TDM_EINVALID, "KvTransfer header does not decode (%zu bytes)",
                               f->body_len);
        transfer_reply(r, f, st, res.msg, backend, out);
        return true;
    }
    received_fill(r, h, out);
    bool done = true;
    if (may_hold && cancel_follows(r, f)) {
        out->status = TDM_ECANCELLED;
        snprintf(out->message, sizeof out->message,
                 "cancelled by the sender before it was handled");
    } else {
        /* Every check passed but, for blocks this attempt holds alone, the blocks' checksums,
         * verified while they are copied (tdm_kv_tcp_fused): a rejected transfer's bytes stay
         * in blocks no one reads, freed with the reservation. Shared blocks and device pools
         * are written only after every check passed. */
        int st = transfer_check(r, f, h, lookup, user, &backend, &blocks, &res);
        if (st == TDM_KV_LOOKUP_WAIT && may_hold && hold(r, f, h, &res) == 0)
            done = false;
        else if (st == TDM_KV_LOOKUP_WAIT && !res.msg[0])
            st = tdm_error_set(&res, TDM_ENOTFOUND,
                               "no reservation for attempt %016" PRIx64 " of request '%s' "
                               "(its reservation was not decided)",
                               h->attempt_id, h->request_id);
        else if (st == TDM_KV_LOOKUP_WAIT)
            st = TDM_ENOTFOUND; /* no room to hold it: res says so */
        if (done && st == 0)
            st = transfer_write(r, f, h, backend, blocks, &res);
        if (done)
            transfer_reply(r, f, st, res.msg, backend, out);
    }
    protobuf_c_message_free_unpacked(&h->base, NULL);
    return done;
}

/* Takes held transfer i off the list into *f (moved). */
static void held_take(tdm_kv_receiver_t *r, uint32_t i, tdm_frame_t *f)
{
    tdm_frame_move(f, &r->held[i].f);
    r->held_bytes -= r->held[i].bytes;
    memmove(&r->held[i], &r->held[i + 1], (r->n_held - i - 1) * sizeof r->held[0]);
    r->n_held--;
}

/* Refuses (NOT_FOUND) the held transfers whose time ran out. */
static void held_expire(tdm_kv_receiver_t *r)
{
    double now = tdm_time_now();
    for (uint32_t i = 0; i < r->n_held;) {
        if (now <= r->held[i].until) {
            i++;
            continue;
        }
        uint64_t attempt = r->held[i].attempt_id;
        tdm_frame_t f;
        tdm_frame_init(&f);
        held_take(r, i, &f);
        TDM_LOG_WARNF(r->log, NULL,
                      "KV transfer %" PRIu64 " for attempt %016" PRIx64 " refused: no reservation "
                      "decided within %d ms",
                      f.call_id, attempt, r->hold_ms);
        tdm_sock_reply_error(r->sock, &f, TDM_ENOTFOUND,
                             "no reservation for attempt %016" PRIx64 " within %d ms of the "
                             "transfer's arrival (cancelled, superseded or unknown)",
                             attempt, r->hold_ms);
        tdm_frame_clear(&f);
    }
}

/* A CANCEL of a held transfer (same sender, same call) drops it unanswered. Returns true when
 * c was one. */
static bool held_cancel(tdm_kv_receiver_t *r, const tdm_frame_t *c)
{
    for (uint32_t i = 0; i < r->n_held; i++) {
        const tdm_frame_t *f = &r->held[i].f;
        if (f->call_id != c->call_id || f->peer_len != c->peer_len ||
            memcmp(f->peer, c->peer, c->peer_len) != 0)
            continue;
        tdm_frame_t g;
        tdm_frame_init(&g);
        held_take(r, i, &g);
        TDM_LOG_DEBUGF(r->log, NULL, "KV: held transfer %" PRIu64 " withdrawn by its sender",
                       g.call_id);
        tdm_frame_clear(&g);
        return true;
    }
    return false;
}

/* Index of the transfer held for attempt_id, or n_held. */
static uint32_t held_find(const tdm_kv_receiver_t *r, uint64_t attempt_id)
{
    uint32_t i = 0;
    while (i < r->n_held && r->held[i].attempt_id != attempt_id)
        i++;
    return i;
}

int tdm_kv_receiver_resume(tdm_kv_receiver_t *r, uint64_t attempt_id, tdm_kv_lookup_fn lookup,
                           void *user, tdm_kv_received_t *out)
{
    if (!r || !out)
        return TDM_EINTERNAL;
    memset(out, 0, sizeof *out);
    uint32_t i = held_find(r, attempt_id);
    if (i == r->n_held)
        return 0;
    tdm_frame_t f;
    tdm_frame_init(&f);
    held_take(r, i, &f);
    handle_transfer(r, &f, lookup, user, false, out);
    tdm_frame_clear(&f);
    return 1;
}

int tdm_kv_receiver_refuse(tdm_kv_receiver_t *r, uint64_t attempt_id, int status, const char *why)
{
    uint32_t i = r ? held_find(r, attempt_id) : 0;
    if (!r || i == r->n_held)
        return 0;
    tdm_frame_t f;
    tdm_frame_init(&f);
    held_take(r, i, &f);
    if (status >= 0)
        status = TDM_EINTERNAL;
    TDM_LOG_INFOF(r->log, NULL,
                  "held KV transfer %" PRIu64 " for attempt %016" PRIx64 " refused: %s %s",
                  f.call_id, attempt_id, tdm_status_name(status), why ? why : "");
    tdm_sock_reply_error(r->sock, &f, status, "reservation refused: %s", why ? why : "");
    tdm_frame_clear(&f);
    return 1;
}

uint32_t tdm_kv_receiver_held(const tdm_kv_receiver_t *r, uint64_t *bytes)
{
    if (bytes)
        *bytes = r ? r->held_bytes : 0;
    return r ? r->n_held : 0;
}

int tdm_kv_receiver_recv(tdm_kv_receiver_t *r, int timeout_ms, tdm_kv_lookup_fn lookup, void *user,
                         tdm_kv_received_t *out)
{
    if (!r || !out)
        return TDM_EINTERNAL;
    memset(out, 0, sizeof *out);
    held_expire(r);
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
            bool done = handle_transfer(r, f, lookup, user, true, out);
            tdm_frame_clear(f);
            if (done)
                return 1;
            memset(out, 0, sizeof *out); /* held: no outcome; go on with the next message */
            if (tdm_time_now() >= t_end && !r->has_next)
                return 0;
            continue;
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
            if (!held_cancel(r, f))
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
