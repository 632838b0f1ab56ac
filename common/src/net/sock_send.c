/* sock_send.c - sending on a Tandem socket: the checks on a message, its FrameHeader and body
 * packed, zero-copy data frames, and the reply / stream / notify shorthands. A send never
 * blocks (ZMQ_DONTWAIT): a full queue is an error, not a wait. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "net/net_internal.h"

/* Maps a failed zmq send's errno to a status, with the message in s->errmsg. */
static int send_error(tdm_sock_t *s, int e, const tdm_send_t *m)
{
    char peer[2 * TDM_NET_PEER_MAX + 1] = "-";
    if (s->router)
        tdm_sock_peer_str(m->peer, m->peer_len, peer, sizeof peer);
    s->stats.send_failures++;
    switch (e) {
    case EHOSTUNREACH:
        tdm_sock_set_errmsg(s, "peer %s is unknown or gone", peer);
        return TDM_EUNAVAILABLE;
    case EAGAIN:
        tdm_sock_set_errmsg(s, "send queue full (%d messages) for peer %s", s->sndhwm, peer);
        return TDM_EUNAVAILABLE;
    case ENOMEM: tdm_sock_set_errmsg(s, "out of memory"); return TDM_ERESOURCE;
    case ETERM: tdm_sock_set_errmsg(s, "the ZMQ context is shutting down"); return TDM_EUNAVAILABLE;
    default: tdm_sock_set_errmsg(s, "send: %s", zmq_strerror(e)); return TDM_EUNAVAILABLE;
    }
}

/* Runs the free callbacks of data[from ..) (data whose ownership never reached ZMQ). */
static void release_data(const tdm_send_t *m, uint32_t from)
{
    for (uint32_t i = from; i < m->n_data; i++)
        if (m->data[i].free_fn)
            m->data[i].free_fn((void *)(uintptr_t)m->data[i].ptr, m->data[i].hint);
}

/* Sends one part; the message is closed whatever happens (after a successful send ZMQ has
 * emptied it, so the close does nothing; after a failure it releases the data, running a
 * zero-copy free callback). Returns 0 or the errno. */
static int send_part(tdm_sock_t *s, zmq_msg_t *msg, bool more)
{
    int rc = zmq_msg_send(msg, s->zs, ZMQ_DONTWAIT | (more ? ZMQ_SNDMORE : 0));
    int e = rc < 0 ? errno : 0;
    zmq_msg_close(msg);
    return e;
}

static int send_bytes(tdm_sock_t *s, const void *p, size_t n, bool more)
{
    return zmq_send(s->zs, p, n, ZMQ_DONTWAIT | (more ? ZMQ_SNDMORE : 0)) < 0 ? errno : 0;
}

static int check_send(tdm_sock_t *s, const tdm_send_t *m)
{
    if (s->router && (!m->peer || m->peer_len == 0 || m->peer_len > TDM_NET_PEER_MAX)) {
        tdm_sock_set_errmsg(s, "a ROUTER send needs a peer routing id of 1..%u bytes",
                            TDM_NET_PEER_MAX);
        return TDM_EINVALID;
    }
    if (m->kind < TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST ||
        m->kind > TANDEM__V1__FRAME_KIND__FRAME_KIND_NOTIFY) {
        tdm_sock_set_errmsg(s, "unknown frame kind %d", m->kind);
        return TDM_EINVALID;
    }
    if (m->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END && m->status > 0) {
        tdm_sock_set_errmsg(s, "END status must be 0 or negative, got %d", m->status);
        return TDM_EINVALID;
    }
    if (m->api_key && strlen(m->api_key) >= TDM_NET_API_KEY_MAX) {
        tdm_sock_set_errmsg(s, "api_key of %zu bytes exceeds the limit of %u bytes",
                            strlen(m->api_key), TDM_NET_API_KEY_MAX - 1);
        return TDM_EINVALID;
    }
    if (m->n_data > TDM_NET_MAX_DATA_FRAMES || (m->n_data && !m->data)) {
        tdm_sock_set_errmsg(s, "%u data frames (at most %u)", m->n_data, TDM_NET_MAX_DATA_FRAMES);
        return TDM_EINVALID;
    }
    for (uint32_t i = 0; i < m->n_data; i++)
        if (m->data[i].len > TDM_NET_MAX_DATA_BYTES || (m->data[i].len && !m->data[i].ptr)) {
            tdm_sock_set_errmsg(s, "data frame %u of %zu bytes (at most %u, and not NULL)", i,
                                m->data[i].len, TDM_NET_MAX_DATA_BYTES);
            return TDM_EINVALID;
        }
    return 0;
}

/* Copies src into dst (cap bytes with the NUL) as valid UTF-8: each byte that does not start
 * a well-formed character becomes U+FFFD, and the copy ends before the first character that
 * does not fit whole. FrameHeader.message is a protobuf string, which strict clients refuse
 * to parse unless it is UTF-8, and messages quote what peers sent (ids, names). */
static void utf8_fit(char *dst, size_t cap, const char *src)
{
    static const char replacement[] = "\xef\xbf\xbd";
    size_t n = strlen(src), o = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t len = tdm_utf8_decode((const unsigned char *)src + i, n - i, &cp);
        const char *from = len ? src + i : replacement;
        size_t out = len ? len : 3;
        if (o + out >= cap)
            break;
        memcpy(dst + o, from, out);
        o += out;
        i += len ? len : 1;
    }
    dst[o] = '\0';
}

/* Packs m's FrameHeader into hbuf (TDM_NET_MAX_HEADER_BYTES), *hlen bytes. Returns 0 or
 * TDM_EINVALID with s->errmsg set. */
static int pack_header(tdm_sock_t *s, const tdm_send_t *m, uint8_t *hbuf, size_t *hlen)
{
    char message[TDM_ERRMSG_MAX];
    utf8_fit(message, sizeof message, m->message ? m->message : "");

    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = TDM_PROTOCOL_MAJOR;
    h.version_minor = TDM_PROTOCOL_MINOR;
    h.kind = (Tandem__V1__FrameKind)m->kind;
    h.method = (Tandem__V1__Method)m->method;
    h.call_id = m->call_id;
    if (m->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
        h.status = tdm_proto_status_to_wire(m->status);
        h.message = message;
    }
    h.deadline_unix_ms = m->deadline_unix_ms;
    h.api_key = (char *)(uintptr_t)(m->api_key ? m->api_key : "");
    h.n_data_frames = m->n_data;
    h.instance_id = m->anonymous ? 0 : s->instance_id;
    *hlen = tandem__v1__frame_header__get_packed_size(&h);
    if (*hlen >
        TDM_NET_MAX_HEADER_BYTES) { /* cannot happen with the limits; checked all the same */
        tdm_sock_set_errmsg(s, "FrameHeader of %zu bytes exceeds %u", *hlen,
                            TDM_NET_MAX_HEADER_BYTES);
        return TDM_EINVALID;
    }
    tandem__v1__frame_header__pack(&h, hbuf);
    return 0;
}

/* Packs m->body into a new ZMQ message. Returns 0, TDM_EINVALID (too large) or
 * TDM_ERESOURCE, with s->errmsg set; on success the caller sends or closes *body. */
static int pack_body(tdm_sock_t *s, const tdm_send_t *m, zmq_msg_t *body, size_t *blen)
{
    *blen = protobuf_c_message_get_packed_size(m->body);
    if (*blen > TDM_NET_MAX_BODY_BYTES) {
        tdm_sock_set_errmsg(s, "body of %zu bytes exceeds the limit of %u bytes", *blen,
                            TDM_NET_MAX_BODY_BYTES);
        return TDM_EINVALID;
    }
    if (zmq_msg_init_size(body, *blen) != 0) {
        tdm_sock_set_errmsg(s, "out of memory for a body of %zu bytes", *blen);
        return TDM_ERESOURCE;
    }
    protobuf_c_message_pack(m->body, zmq_msg_data(body));
    return 0;
}

/* A ZMQ message for data frame d: zero-copy when it has a free_fn (ZMQ then owns the data),
 * else a copy. Returns 0 (d is then released or owned by *dm) or ENOMEM (d is untouched). */
static int data_part_init(const tdm_net_data_t *d, zmq_msg_t *dm)
{
    void *p = (void *)(uintptr_t)d->ptr;
    if (d->free_fn && d->len > 0)
        return zmq_msg_init_data(dm, p, d->len, d->free_fn, d->hint) != 0 ? ENOMEM : 0;
    if (zmq_msg_init_size(dm, d->len) != 0)
        return ENOMEM;
    if (d->len)
        memcpy(zmq_msg_data(dm), d->ptr, d->len);
    if (d->free_fn) /* an empty zero-copy frame: nothing for ZMQ to hold */
        d->free_fn(p, d->hint);
    return 0;
}

int tdm_sock_send(tdm_sock_t *s, const tdm_send_t *m)
{
    uint32_t owned = 0; /* data frames handed to ZMQ (or released) so far */
    size_t parts_sent = 0, bytes = 0, hlen = 0, blen = 0;
    bool have_body = false;
    zmq_msg_t body;
    uint8_t hbuf[TDM_NET_MAX_HEADER_BYTES];
    int rc = check_send(s, m);
    if (rc || (rc = pack_header(s, m, hbuf, &hlen)))
        goto out_release;
    if (m->body) {
        if ((rc = pack_body(s, m, &body, &blen)))
            goto out_release;
        have_body = true;
        bytes += blen;
    }

    int e = 0;
    if (s->router && (e = send_bytes(s, m->peer, m->peer_len, true)) != 0)
        goto out_failed;
    parts_sent += s->router;
    if ((e = send_bytes(s, hbuf, hlen, have_body || m->n_data > 0)) != 0)
        goto out_failed;
    parts_sent++;
    bytes += hlen;
    if (have_body) {
        have_body = false; /* send_part closes it either way */
        if ((e = send_part(s, &body, m->n_data > 0)) != 0)
            goto out_failed;
        parts_sent++;
    }
    for (uint32_t i = 0; i < m->n_data; i++) {
        zmq_msg_t dm;
        if ((e = data_part_init(&m->data[i], &dm)) != 0)
            goto out_failed; /* ZMQ did not take the data: release it below */
        owned = i + 1;
        if ((e = send_part(s, &dm, i + 1 < m->n_data)) != 0)
            goto out_failed;
        parts_sent++;
        bytes += m->data[i].len;
    }
    s->stats.frames_out++;
    s->stats.bytes_out += bytes;
    return 0;

out_failed:
    rc = send_error(s, e, m);
    if (parts_sent > 0) {
        /* A DEALER that failed mid-message (its peer went away) drops the rest of that
         * message; one last empty part ends it, so the next message is not swallowed. */
        zmq_send(s->zs, "", 0, ZMQ_DONTWAIT);
    }
    if (have_body)
        zmq_msg_close(&body);
out_release:
    release_data(m, owned);
    return rc;
}

/* A message of kind on the call that frame `to` belongs to (its peer, method and call id). */
static tdm_send_t send_to(const tdm_frame_t *to, int kind)
{
    return (tdm_send_t){
        .peer = to->peer,
        .peer_len = to->peer_len,
        .kind = kind,
        .method = to->method,
        .call_id = to->call_id,
    };
}

int tdm_sock_reply(tdm_sock_t *s, const tdm_frame_t *to, const ProtobufCMessage *body)
{
    tdm_send_t m = send_to(to, TANDEM__V1__FRAME_KIND__FRAME_KIND_END);
    m.body = body;
    return tdm_sock_send(s, &m);
}

int tdm_sock_reply_error(tdm_sock_t *s, const tdm_frame_t *to, int status, const char *fmt, ...)
{
    /* twice the limit, so tdm_sock_send sees where a character cut at the limit ends */
    char text[2 * TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    tdm_send_t m = send_to(to, TANDEM__V1__FRAME_KIND__FRAME_KIND_END);
    m.status = status;
    m.message = text;
    return tdm_sock_send(s, &m);
}

int tdm_sock_refuse(tdm_sock_t *s, const tdm_frame_t *to, int status, const char *fmt, ...)
{
    char text[2 * TDM_ERRMSG_MAX]; /* as tdm_sock_reply_error */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(text, sizeof text, fmt, ap);
    va_end(ap);
    tdm_send_t m = send_to(to, TANDEM__V1__FRAME_KIND__FRAME_KIND_END);
    m.status = status;
    m.message = text;
    m.anonymous = true;
    return tdm_sock_send(s, &m);
}

int tdm_sock_stream(tdm_sock_t *s, const tdm_frame_t *to, const ProtobufCMessage *body)
{
    tdm_send_t m = send_to(to, TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM);
    m.body = body;
    return tdm_sock_send(s, &m);
}

int tdm_sock_notify(tdm_sock_t *s, const uint8_t *peer, size_t peer_len, int method,
                    const ProtobufCMessage *body)
{
    tdm_send_t m = {
        .peer = peer,
        .peer_len = peer_len,
        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_NOTIFY,
        .method = method,
        .body = body,
    };
    return tdm_sock_send(s, &m);
}
