/* sock_recv.c - receiving on a Tandem socket: the parts of a message into the socket's scratch,
 * validated (tdm_net_parse), accepted into a tdm_frame_t without copying or answered / dropped;
 * and the blocking unary call (send, then wait for its END).
 *
 * Received parts are kept in a per-socket scratch array of zmq_msg_t (grown on demand, never
 * beyond TDM_NET_MAX_PARTS); an accepted message's body and data parts move into the
 * tdm_frame_t, so nothing is copied. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"

#define SCRATCH_KEEP 64 /* scratch parts kept between messages; more is freed after use */

static const uint8_t sock_empty_bytes[1] = {0};

/* Makes room for at least n parts in the scratch arrays (moving the open messages). */
static bool scratch_reserve(tdm_sock_t *s, size_t n)
{
    if (n <= s->scratch_cap)
        return true;
    size_t cap = s->scratch_cap ? s->scratch_cap : 8;
    while (cap < n)
        cap *= 2;
    if (cap > TDM_NET_MAX_PARTS)
        cap = TDM_NET_MAX_PARTS;
    zmq_msg_t *m = malloc(cap * sizeof *m);
    tdm_net_part_t *v = malloc(cap * sizeof *v);
    if (!m || !v) {
        free(m);
        free(v);
        return false;
    }
    for (size_t i = 0; i < s->scratch_cap; i++) {
        zmq_msg_init(&m[i]);
        zmq_msg_move(&m[i], &s->scratch[i]);
        zmq_msg_close(&s->scratch[i]);
    }
    free(s->scratch);
    free(s->views);
    s->scratch = m;
    s->views = v;
    s->scratch_cap = cap;
    return true;
}

/* Closes the n kept parts and frees a scratch array grown by a big message. */
static void scratch_release(tdm_sock_t *s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        zmq_msg_close(&s->scratch[i]);
    if (s->scratch_cap > SCRATCH_KEEP) {
        free(s->scratch);
        free(s->views);
        s->scratch = NULL;
        s->views = NULL;
        s->scratch_cap = 0;
    }
}

/* Receives every part of the next message without waiting: keeps the first ones in the
 * scratch array (at most TDM_NET_MAX_PARTS; fewer when memory runs out) and drains the rest.
 * Returns 0 with *n_kept / *n_total set, EAGAIN when no message is there, or another errno. */
static int recv_parts(tdm_sock_t *s, size_t *n_kept, size_t *n_total)
{
    size_t kept = 0, total = 0;
    bool more = true, keep = true;
    while (more) {
        zmq_msg_t drain, *msg = &drain;
        if (keep && kept < TDM_NET_MAX_PARTS && scratch_reserve(s, kept + 1))
            msg = &s->scratch[kept];
        else
            keep = false; /* from here on, count and drop */
        zmq_msg_init(msg);
        if (zmq_msg_recv(msg, s->zs, ZMQ_DONTWAIT) < 0) {
            int e = errno;
            zmq_msg_close(msg);
            if (total > 0 && (e == EINTR || e == EAGAIN))
                continue; /* the rest of a message is always there: try again */
            for (size_t i = 0; i < kept; i++)
                zmq_msg_close(&s->scratch[i]);
            return e;
        }
        more = zmq_msg_more(msg);
        s->stats.bytes_in += zmq_msg_size(msg);
        total++;
        if (msg == &drain)
            zmq_msg_close(&drain);
        else
            kept++;
    }
    *n_kept = kept;
    *n_total = total;
    return 0;
}

/* Moves the accepted message's body and data parts into f. Returns false on out of memory. */
static bool frame_take(tdm_sock_t *s, size_t n, const tdm_net_layout_t *lay, tdm_frame_t *f)
{
    size_t start = lay->header + 1, count = n - start;
    if (count == 0)
        return true;
    tdm_net_frame_impl_t *impl = malloc(sizeof *impl + count * sizeof(zmq_msg_t));
    if (!impl)
        return false;
    impl->n_msgs = count;
    impl->first_data = lay->first_data - start;
    for (size_t i = 0; i < count; i++) {
        zmq_msg_init(&impl->msgs[i]);
        zmq_msg_move(&impl->msgs[i], &s->scratch[start + i]);
    }
    if (lay->body != SIZE_MAX) {
        /* small messages live inside the zmq_msg_t: take the pointer after the move */
        const uint8_t *p = zmq_msg_data(&impl->msgs[0]);
        f->body = p ? p : sock_empty_bytes;
    }
    f->impl = impl;
    f->impl_cap = count;
    return true;
}

/* Copies the ZAP User-Id of the message's connection into f->user_id ("" without one: no
 * CURVE). The header part came from the peer, so it carries the connection's metadata. */
static void frame_user_id(tdm_sock_t *s, const tdm_net_layout_t *lay, tdm_frame_t *f)
{
    f->user_id[0] = '\0';
    if (!s->zap_domain[0])
        return;
    const char *uid = zmq_msg_gets(&s->scratch[lay->header], "User-Id");
    if (uid) {
        size_t n = tdm_net_text_fit(uid, sizeof f->user_id);
        memcpy(f->user_id, uid, n);
        f->user_id[n] = '\0';
    }
}

/* Answers or drops a refused message and logs it. */
static void refuse(tdm_sock_t *s, tdm_frame_t *f, tdm_net_verdict_t v, const tdm_error_t *why)
{
    char peer[2 * TDM_NET_PEER_MAX + 1] = "-", kv[768] = "";
    if (f->peer_len)
        tdm_sock_peer_str(f->peer, f->peer_len, peer, sizeof peer);
    char call[24];
    snprintf(call, sizeof call, "%llu", (unsigned long long)f->call_id);
    tdm_log_kv_append(kv, sizeof kv, "endpoint", s->endpoint);
    tdm_log_kv_append(kv, sizeof kv, "peer", peer);
    tdm_log_kv_append(kv, sizeof kv, "status", tdm_status_name(why->code));
    if (v == TDM_NET_REJECT) {
        tdm_log_kv_append(kv, sizeof kv, "method", tdm_net_method_name(f->method));
        tdm_log_kv_append(kv, sizeof kv, "call_id", call);
        s->stats.rejected++;
        tdm_log_write(s->log, TDM_LOG_WARN, NULL, kv, "refused a request: %s", why->msg);
        tdm_sock_reply_error(s, f, why->code, "%s", why->msg);
    } else {
        s->stats.dropped++;
        tdm_log_write(s->log, TDM_LOG_WARN, NULL, kv, "dropped a message: %s", why->msg);
    }
    tdm_sock_set_errmsg(s, "%s", why->msg);
}

/* Waits until the socket has input: 0, TDM_EDEADLINE when the monotonic time end passes
 * (timeout_ms >= 0), TDM_ECANCELLED (EINTR, ETERM) or TDM_EINTERNAL. */
static int wait_input(tdm_sock_t *s, int timeout_ms, double end)
{
    for (;;) {
        long wait = -1;
        if (timeout_ms >= 0) {
            double left = end - tdm_time_now();
            wait = left > 0 ? (long)(left * 1000.0 + 0.999) : 0;
        }
        zmq_pollitem_t item = {.socket = s->zs, .events = ZMQ_POLLIN};
        int rc = zmq_poll(&item, 1, wait);
        if (rc < 0) {
            int e = errno;
            tdm_sock_set_errmsg(s, "poll: %s", zmq_strerror(e));
            return e == EINTR || e == ETERM ? TDM_ECANCELLED : TDM_EINTERNAL;
        }
        if (rc > 0)
            return 0;
        if (timeout_ms == 0 || (timeout_ms > 0 && tdm_time_now() >= end))
            return TDM_EDEADLINE;
    }
}

int tdm_sock_recv(tdm_sock_t *s, tdm_frame_t *f, int timeout_ms)
{
    tdm_frame_clear(f);
    double end = tdm_time_now() + (timeout_ms > 0 ? timeout_ms / 1000.0 : 0);
    for (;;) {
        /* a queued message is taken at once; zmq_poll only when there is none */
        size_t n = 0, total = 0;
        int e = recv_parts(s, &n, &total);
        if (e == EAGAIN) {
            int rc = wait_input(s, timeout_ms, end);
            if (rc)
                return rc;
            continue;
        }
        if (e) {
            tdm_sock_set_errmsg(s, "receive: %s", zmq_strerror(e));
            return e == EINTR || e == ETERM ? TDM_ECANCELLED : TDM_EINTERNAL;
        }
        for (size_t i = 0; i < n; i++) {
            s->views[i].ptr = zmq_msg_data(&s->scratch[i]);
            s->views[i].len = zmq_msg_size(&s->scratch[i]);
        }
        tdm_net_layout_t lay;
        tdm_error_t why;
        tdm_net_verdict_t v = tdm_net_parse(s->views, n, total, s->router, f, &lay, &why);
        if (v == TDM_NET_ACCEPT)
            frame_user_id(s, &lay, f);
        if (v == TDM_NET_ACCEPT && !frame_take(s, n, &lay, f)) {
            tdm_error_set(&why, TDM_ERESOURCE, "out of memory for a message of %zu parts", n);
            v = f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST ? TDM_NET_REJECT
                                                                      : TDM_NET_DROP;
        }
        scratch_release(s, n);
        if (v == TDM_NET_ACCEPT) {
            s->stats.frames_in++;
            return 0;
        }
        refuse(s, f, v, &why);
        tdm_frame_clear(f);
    }
}

/* ---- blocking unary call ---- */

/* Waits for the END of call call_id into *f, discarding frames of other calls; on timeout
 * sends a CANCEL. Returns 0, TDM_EDEADLINE or what tdm_sock_recv returns, with *err set. */
static int rpc_wait_end(tdm_sock_t *s, int method, uint64_t call_id, int timeout_ms, tdm_frame_t *f,
                        tdm_error_t *err)
{
    const char *name = tdm_net_method_name(method);
    double end = tdm_time_now() + timeout_ms / 1000.0;
    for (;;) {
        int wait = -1;
        if (timeout_ms > 0) {
            double left = end - tdm_time_now();
            wait = left > 0 ? (int)(left * 1000.0 + 0.999) : 0;
        }
        int rc = tdm_sock_recv(s, f, wait);
        if (rc == TDM_EDEADLINE) {
            tdm_send_t c = {
                .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL,
                .method = method,
                .call_id = call_id,
            };
            tdm_sock_send(s, &c);
            return tdm_error_set(err, TDM_EDEADLINE, "%s call %llu: no answer within %d ms", name,
                                 (unsigned long long)call_id, timeout_ms);
        }
        if (rc)
            return tdm_error_set(err, rc, "%s call %llu: %s", name, (unsigned long long)call_id,
                                 s->errmsg);
        if (f->call_id == call_id && f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END)
            return 0;
        tdm_frame_clear(f); /* another call's frame, or a STREAM frame of this one */
    }
}

int tdm_sock_call(tdm_sock_t *s, int method, uint64_t call_id, const char *api_key,
                  const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                  int timeout_ms, ProtobufCMessage **resp_out, tdm_error_t *err)
{
    if (resp_out)
        *resp_out = NULL;
    tdm_error_clear(err);
    const char *name = tdm_net_method_name(method);
    tdm_send_t m = {
        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST,
        .method = method,
        .call_id = call_id,
        .deadline_unix_ms = timeout_ms > 0 ? tdm_net_now_ms() + (uint64_t)timeout_ms : 0,
        .api_key = api_key,
        .body = req,
    };
    int rc = tdm_sock_send(s, &m);
    if (rc)
        return tdm_error_set(err, rc, "%s call %llu: %s", name, (unsigned long long)call_id,
                             s->errmsg);
    tdm_frame_t f;
    tdm_frame_init(&f);
    if ((rc = rpc_wait_end(s, method, call_id, timeout_ms, &f, err)) != 0)
        goto out_clear;
    if (f.status != 0) {
        rc = tdm_error_set(err, f.status, "%s", f.message[0] ? f.message : tdm_strerror(f.status));
        goto out_clear;
    }
    if (resp_desc && resp_out) {
        *resp_out = tdm_frame_unpack(&f, resp_desc);
        if (!*resp_out)
            rc = tdm_error_set(err, TDM_EINTERNAL,
                               "%s call %llu: the response does not decode as %s", name,
                               (unsigned long long)call_id, resp_desc->name);
    }
out_clear:
    tdm_frame_clear(&f);
    return rc;
}
