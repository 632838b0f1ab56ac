/* sock.c - Tandem sockets: ROUTER (bound) and DEALER (connected) with their options, sending a
 * framed message (zero-copy data frames), receiving with validation (tdm_net_parse) and the
 * END replies / drops it calls for, the reply shorthands and the blocking unary call.
 *
 * Assumptions: a socket is used by one thread at a time. Received parts are kept in a
 * per-socket scratch array of zmq_msg_t (grown on demand, never beyond TDM_NET_MAX_PARTS);
 * an accepted message's body and data parts move into the tdm_frame_t, so nothing is copied.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"

#define SOCK_ENDPOINT_MAX 256
#define SCRATCH_KEEP 64 /* scratch parts kept between messages; more is freed after use */

static const uint8_t sock_empty_bytes[1] = {0};

struct tdm_sock {
    tdm_net_t *net;
    void *zs;
    bool router;
    int sndhwm;
    char endpoint[SOCK_ENDPOINT_MAX];
    char zap_domain[TDM_NET_ZAP_DOMAIN_MAX]; /* "" when not a CURVE server */
    const tdm_logger_t *log;
    uint64_t instance_id; /* stamped into every header sent */
    tdm_sock_stats_t stats;
    char errmsg[TDM_ERRMSG_MAX];
    zmq_msg_t *scratch;    /* [scratch_cap] parts of the message being received */
    tdm_net_part_t *views; /* [scratch_cap] their bytes, for tdm_net_parse */
    size_t scratch_cap;
    void *monitor;        /* watch_handshake: PAIR receiving the socket's handshake events */
    bool hs_failed;       /* the last handshake event was a failure */
    char hs_why[160];     /* what it said */
    uint64_t disconnects; /* established connections the monitor saw drop */
    uint64_t handshakes;  /* handshakes the monitor saw succeed */
};

static void set_errmsg(tdm_sock_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_errmsg(tdm_sock_t *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->errmsg, sizeof s->errmsg, fmt, ap);
    va_end(ap);
}

/* Printable form of a routing id: the text when it is printable ASCII, else hex. */
static const char *peer_str(const uint8_t *peer, size_t len, char *buf, size_t cap)
{
    bool text = len > 0;
    for (size_t i = 0; i < len; i++)
        if (peer[i] < 0x21 || peer[i] > 0x7e || peer[i] == '"' || peer[i] == '=')
            text = false;
    size_t o = 0;
    if (text) {
        o = len < cap - 1 ? len : cap - 1;
        memcpy(buf, peer, o);
    } else {
        for (size_t i = 0; i < len && o + 3 < cap; i++)
            o += (size_t)snprintf(buf + o, cap - o, "%02x", peer[i]);
    }
    buf[o] = '\0';
    return buf;
}

/* ---- options and sockets ---- */

static bool curve_none(const tdm_curve_keys_t *k)
{
    return !k || (!k->server_public && !k->server_secret && !k->client_public &&
                  !k->client_secret && k->n_clients == 0);
}

/* The ZAP table of a CURVE server's admitted clients: k->clients, or client_public named
 * "tandem" when there are none (neither: nobody is admitted). Returns a malloc'ed array of *n
 * entries (caller frees) or NULL with *err set (TDM_EINVALID naming the bad key or name,
 * TDM_ERESOURCE). */
static tdm_net_zap_key_t *server_clients(const tdm_curve_keys_t *k, size_t *n, tdm_error_t *err)
{
    static const char *const legacy_name = "tandem";
    tdm_curve_peer_t legacy = {k->client_public, legacy_name};
    const tdm_curve_peer_t *list = k->n_clients ? k->clients : &legacy;
    size_t count = k->n_clients ? k->n_clients : k->client_public ? 1 : 0;
    if (k->n_clients && !k->clients) {
        tdm_error_set(err, TDM_EINVALID, "curve.clients: NULL with n_clients %zu", k->n_clients);
        return NULL;
    }
    tdm_net_zap_key_t *out = calloc(count ? count : 1, sizeof *out);
    if (!out) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < count; i++) {
        char what[64];
        if (k->n_clients)
            snprintf(what, sizeof what, "curve.clients[%zu]", i);
        else
            snprintf(what, sizeof what, "curve.client_public");
        const char *name = list[i].name;
        if (tdm_net_curve_key_check(list[i].public_key, what, err))
            goto out_free;
        if (!name || !*name || strlen(name) >= TDM_NET_USER_ID_MAX) {
            tdm_error_set(err, TDM_EINVALID, "%s: the name must be 1..%u bytes", what,
                          TDM_NET_USER_ID_MAX - 1);
            goto out_free;
        }
        zmq_z85_decode(out[i].key, list[i].public_key);
        memcpy(out[i].name, name, strlen(name) + 1);
        for (size_t j = 0; j < i; j++)
            if (memcmp(out[j].key, out[i].key, 32) == 0) {
                tdm_error_set(err, TDM_EINVALID, "%s: the same public key as curve.clients[%zu]",
                              what, j);
                goto out_free;
            }
    }
    *n = count;
    return out;
out_free:
    free(out);
    return NULL;
}

/* Checks that public matches secret (both valid Z85 keys). */
static int check_pair(const char *pub, const char *sec, const char *what, tdm_error_t *err)
{
    char derived[41];
    if (zmq_curve_public(derived, sec) != 0)
        return tdm_error_set(err, TDM_EPRECONDITION, "%s: libzmq was built without CURVE", what);
    if (strcmp(derived, pub) != 0)
        return tdm_error_set(err, TDM_EINVALID, "%s: the public key does not match the secret key",
                             what);
    return 0;
}

static int setopt_int(void *zs, int opt, int v, const char *name, tdm_error_t *err)
{
    if (zmq_setsockopt(zs, opt, &v, sizeof v) != 0)
        return tdm_error_set(err, TDM_EINVALID, "%s=%d: %s", name, v, zmq_strerror(errno));
    return 0;
}

/* The options common to both kinds: linger, high-water marks, IPv6 for an IPv6 literal, the
 * largest message part, ZMTP heartbeats. Returns 0 or TDM_EINVALID. */
static int sock_common_opts(tdm_sock_t *s, const char *endpoint, const tdm_sock_opts_t *opts,
                            tdm_error_t *err)
{
    int hb = opts->heartbeat_ms == 0 ? 1000 : opts->heartbeat_ms;
    int64_t maxmsg = TDM_NET_MAX_DATA_BYTES; /* the largest part we accept */
    /* an IPv6 literal ("tcp://[::1]:7601") needs ZMQ_IPV6; IPv4 endpoints keep v4 only */
    bool ipv6 = strncmp(endpoint, "tcp://[", 7) == 0;
    int rc;
    if ((rc = setopt_int(s->zs, ZMQ_LINGER, 0, "linger", err)) ||
        (rc = setopt_int(s->zs, ZMQ_SNDHWM, s->sndhwm, "sndhwm", err)) ||
        (rc = setopt_int(s->zs, ZMQ_RCVHWM, s->sndhwm, "rcvhwm", err)) ||
        (ipv6 && (rc = setopt_int(s->zs, ZMQ_IPV6, 1, "ipv6", err))))
        return rc;
    if (zmq_setsockopt(s->zs, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg) != 0)
        return tdm_error_set(err, TDM_EINVALID, "maxmsgsize: %s", zmq_strerror(errno));
    if (hb <= 0)
        return 0;
    if (hb > 600000)
        return tdm_error_set(err, TDM_EINVALID, "heartbeat_ms must be at most 600000, got %d", hb);
    if ((rc = setopt_int(s->zs, ZMQ_HEARTBEAT_IVL, hb, "heartbeat_ms", err)) ||
        (rc = setopt_int(s->zs, ZMQ_HEARTBEAT_TIMEOUT, 3 * hb, "heartbeat timeout", err)) ||
        (rc = setopt_int(s->zs, ZMQ_HEARTBEAT_TTL, 3 * hb, "heartbeat ttl", err)))
        return rc;
    return 0;
}

/* Makes the ZMQ socket and applies the options common to both kinds. */
static tdm_sock_t *sock_new(tdm_net_t *net, int type, const char *endpoint,
                            const tdm_sock_opts_t *opts, tdm_error_t *err)
{
    static const tdm_sock_opts_t no_opts;
    if (!opts)
        opts = &no_opts;
    if (!net || !endpoint || !*endpoint) {
        tdm_error_set(err, TDM_EINVALID, "no endpoint given");
        return NULL;
    }
    if (strlen(endpoint) >= SOCK_ENDPOINT_MAX) {
        tdm_error_set(err, TDM_EINVALID, "endpoint longer than %d bytes", SOCK_ENDPOINT_MAX - 1);
        return NULL;
    }
    tdm_sock_t *s = calloc(1, sizeof *s);
    if (!s) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    s->net = net;
    s->router = type == ZMQ_ROUTER;
    s->log = opts->log;
    s->instance_id = opts->instance_id;
    s->sndhwm = opts->sndhwm > 0 ? opts->sndhwm : 10000;
    snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    s->zs = zmq_socket(tdm_net_zctx(net), type);
    if (!s->zs) {
        tdm_error_set(err, TDM_ERESOURCE, "zmq_socket: %s", zmq_strerror(errno));
        goto out_free;
    }
    if (sock_common_opts(s, endpoint, opts, err) != 0)
        goto out_close;
    return s;

out_close:
    zmq_close(s->zs);
out_free:
    free(s);
    return NULL;
}

/* Makes a ROUTER socket a CURVE server: registers the n_clients allowed client keys with
 * the ZAP handler (under the socket's own domain) and sets the server key. Returns 0 or an
 * error; the caller keeps clients. */
static int curve_server_opts(tdm_sock_t *s, const tdm_curve_keys_t *k,
                             const tdm_net_zap_key_t *clients, size_t n_clients, tdm_error_t *err)
{
    int rc = tdm_net_zap_register(s->net, clients, n_clients, s->log, s->zap_domain, err);
    if (rc != 0)
        return rc;
    if (zmq_setsockopt(s->zs, ZMQ_ZAP_DOMAIN, s->zap_domain, strlen(s->zap_domain)) != 0 ||
        setopt_int(s->zs, ZMQ_CURVE_SERVER, 1, "curve_server", err) ||
        zmq_setsockopt(s->zs, ZMQ_CURVE_SECRETKEY, k->server_secret, 40) != 0)
        return tdm_error_set(err, TDM_EINVALID, "CURVE server options: %s", zmq_strerror(errno));
    return 0;
}

/* Binds s to endpoint ("localhost" as 127.0.0.1) and keeps the endpoint bound (a wildcard
 * port resolved). Returns 0, TDM_EUNAVAILABLE (address in use) or TDM_EINVALID. */
static int sock_bind_endpoint(tdm_sock_t *s, const char *endpoint, tdm_error_t *err)
{
    /* libzmq binds an interface name or an address; "localhost" is neither to it */
    char local[SOCK_ENDPOINT_MAX];
    const char *bind_ep = endpoint;
    if (strncmp(endpoint, "tcp://localhost:", 16) == 0) {
        snprintf(local, sizeof local, "tcp://127.0.0.1:%s", endpoint + 16);
        bind_ep = local;
    }
    if (zmq_bind(s->zs, bind_ep) != 0) {
        int e = errno;
        return tdm_error_set(err, e == EADDRINUSE ? TDM_EUNAVAILABLE : TDM_EINVALID, "bind %s: %s",
                             endpoint, zmq_strerror(e));
    }
    size_t len = sizeof s->endpoint;
    if (zmq_getsockopt(s->zs, ZMQ_LAST_ENDPOINT, s->endpoint, &len) != 0)
        snprintf(s->endpoint, sizeof s->endpoint, "%s", endpoint);
    return 0;
}

tdm_sock_t *tdm_sock_bind(tdm_net_t *net, const char *endpoint, const tdm_sock_opts_t *opts,
                          tdm_error_t *err)
{
    const tdm_curve_keys_t *k = opts ? opts->curve : NULL;
    tdm_net_zap_key_t *clients = NULL;
    size_t n_clients = 0;
    if (!curve_none(k)) {
        if (tdm_net_curve_key_check(k->server_secret, "curve.server_secret", err))
            return NULL;
        if (k->server_public &&
            (tdm_net_curve_key_check(k->server_public, "curve.server_public", err) ||
             check_pair(k->server_public, k->server_secret, "curve.server_public", err)))
            return NULL;
        if (!(clients = server_clients(k, &n_clients, err)))
            return NULL;
    }
    tdm_sock_t *s = sock_new(net, ZMQ_ROUTER, endpoint, opts, err);
    if (!s) {
        free(clients);
        return NULL;
    }
    /* unroutable sends fail (EHOSTUNREACH) instead of vanishing; a peer that reconnects with
     * the same routing id takes the id over from its dead connection, unless no_handover (the
     * node endpoint: each node instance has a routing id of its own, and none may be taken) */
    bool handover = !(opts && opts->no_handover);
    if (setopt_int(s->zs, ZMQ_ROUTER_MANDATORY, 1, "router_mandatory", err) ||
        setopt_int(s->zs, ZMQ_ROUTER_HANDOVER, handover ? 1 : 0, "router_handover", err))
        goto out_destroy;
    if (!curve_none(k)) {
        int zrc = curve_server_opts(s, k, clients, n_clients, err);
        free(clients);
        clients = NULL;
        if (zrc != 0)
            goto out_destroy;
    }
    if (sock_bind_endpoint(s, endpoint, err) != 0)
        goto out_destroy;
    return s;

out_destroy:
    free(clients);
    tdm_sock_destroy(&s);
    return NULL;
}

/* Watches s's handshakes: libzmq reports every handshake's outcome to a monitor
 * (zmq_socket_monitor(3)), read by tdm_sock_handshake. Returns 0 or TDM_EINTERNAL. */
static int handshake_monitor_new(tdm_sock_t *s, const char *endpoint, tdm_error_t *err)
{
    char mep[64];
    snprintf(mep, sizeof mep, "inproc://tdm-handshake-%llu",
             (unsigned long long)tdm_net_unique(s->net));
    int events = ZMQ_EVENT_HANDSHAKE_SUCCEEDED | ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL |
                 ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL | ZMQ_EVENT_HANDSHAKE_FAILED_AUTH |
                 ZMQ_EVENT_DISCONNECTED;
    int zero = 0;
    if (zmq_socket_monitor(s->zs, mep, events) != 0 ||
        !(s->monitor = zmq_socket(tdm_net_zctx(s->net), ZMQ_PAIR)) ||
        zmq_setsockopt(s->monitor, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_connect(s->monitor, mep) != 0)
        return tdm_error_set(err, TDM_EINTERNAL, "handshake monitor of %s: %s", endpoint,
                             zmq_strerror(errno));
    return 0;
}

tdm_sock_t *tdm_sock_connect(tdm_net_t *net, const char *endpoint, const tdm_sock_opts_t *opts,
                             tdm_error_t *err)
{
    const tdm_curve_keys_t *k = opts ? opts->curve : NULL;
    if (!curve_none(k)) {
        if (tdm_net_curve_key_check(k->server_public, "curve.server_public", err) ||
            tdm_net_curve_key_check(k->client_public, "curve.client_public", err) ||
            tdm_net_curve_key_check(k->client_secret, "curve.client_secret", err) ||
            check_pair(k->client_public, k->client_secret, "curve.client_public", err))
            return NULL;
    }
    const char *id = opts ? opts->identity : NULL;
    if (id && (strlen(id) == 0 || strlen(id) > 255)) {
        tdm_error_set(err, TDM_EINVALID, "identity must be 1..255 bytes, got %zu", strlen(id));
        return NULL;
    }
    tdm_sock_t *s = sock_new(net, ZMQ_DEALER, endpoint, opts, err);
    if (!s)
        return NULL;
    int ivl = opts && opts->reconnect_ms > 0 ? opts->reconnect_ms : 100;
    int ivl_max = opts && opts->reconnect_max_ms > 0 ? opts->reconnect_max_ms : 5000;
    if (ivl_max < ivl)
        ivl_max = ivl;
    if (setopt_int(s->zs, ZMQ_RECONNECT_IVL, ivl, "reconnect_ms", err) ||
        setopt_int(s->zs, ZMQ_RECONNECT_IVL_MAX, ivl_max, "reconnect_max_ms", err))
        goto out_destroy;
    if (id && zmq_setsockopt(s->zs, ZMQ_ROUTING_ID, id, strlen(id)) != 0) {
        tdm_error_set(err, TDM_EINVALID, "identity '%s': %s", id, zmq_strerror(errno));
        goto out_destroy;
    }
    if (!curve_none(k) && (zmq_setsockopt(s->zs, ZMQ_CURVE_SERVERKEY, k->server_public, 40) != 0 ||
                           zmq_setsockopt(s->zs, ZMQ_CURVE_PUBLICKEY, k->client_public, 40) != 0 ||
                           zmq_setsockopt(s->zs, ZMQ_CURVE_SECRETKEY, k->client_secret, 40) != 0)) {
        tdm_error_set(err, TDM_EINVALID, "CURVE client options: %s", zmq_strerror(errno));
        goto out_destroy;
    }
    if (opts && opts->watch_handshake && handshake_monitor_new(s, endpoint, err) != 0)
        goto out_destroy;
    if (zmq_connect(s->zs, endpoint) != 0) {
        tdm_error_set(err, TDM_EINVALID, "connect %s: %s", endpoint, zmq_strerror(errno));
        goto out_destroy;
    }
    return s;

out_destroy:
    tdm_sock_destroy(&s);
    return NULL;
}

void tdm_sock_destroy(tdm_sock_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_sock_t *s = *self_p;
    *self_p = NULL;
    if (s->monitor) {
        zmq_socket_monitor(s->zs, NULL, 0);
        zmq_close(s->monitor);
    }
    zmq_close(s->zs);
    if (s->zap_domain[0])
        tdm_net_zap_unregister(s->net, s->zap_domain);
    free(s->scratch);
    free(s->views);
    free(s);
}

/* Reads the events waiting on s's monitor into s (handshake outcome, disconnects). */
static void monitor_drain(tdm_sock_t *s)
{
    for (;;) {
        zmq_msg_t ev, ep;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, s->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            break;
        }
        /* an event is two frames: 6 bytes (uint16 event, uint32 value), then the endpoint */
        uint16_t event = 0;
        uint32_t value = 0;
        if (zmq_msg_size(&ev) >= 6) {
            memcpy(&event, zmq_msg_data(&ev), 2);
            memcpy(&value, (const uint8_t *)zmq_msg_data(&ev) + 2, 4);
        }
        bool more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        if (more) {
            zmq_msg_init(&ep);
            zmq_msg_recv(&ep, s->monitor, ZMQ_DONTWAIT);
            zmq_msg_close(&ep);
        }
        switch (event) {
        case ZMQ_EVENT_HANDSHAKE_SUCCEEDED:
            s->hs_failed = false;
            s->handshakes++;
            break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_AUTH:
            s->hs_failed = true;
            snprintf(s->hs_why, sizeof s->hs_why,
                     "the peer refused this daemon's CURVE key (ZAP status %u): it does not admit "
                     "this public key",
                     value);
            break;
        case ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL:
        case ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL:
            s->hs_failed = true;
            snprintf(s->hs_why, sizeof s->hs_why,
                     "the CURVE handshake failed: the peer's public key is not the one "
                     "configured for it (or it does not speak CURVE)");
            break;
        case ZMQ_EVENT_DISCONNECTED: s->disconnects++; break;
        default: break;
        }
    }
}

uint64_t tdm_sock_disconnects(tdm_sock_t *s)
{
    if (!s || !s->monitor)
        return 0;
    monitor_drain(s);
    return s->disconnects;
}

uint64_t tdm_sock_handshakes(tdm_sock_t *s)
{
    if (!s || !s->monitor)
        return 0;
    monitor_drain(s);
    return s->handshakes;
}

int tdm_sock_handshake(tdm_sock_t *s, char *why, size_t cap)
{
    if (!s || !s->monitor)
        return TDM_OK;
    monitor_drain(s);
    if (!s->hs_failed)
        return TDM_OK;
    if (why && cap)
        snprintf(why, cap, "%s", s->hs_why);
    return TDM_EUNAUTHENTICATED;
}

void *tdm_sock_zsock(tdm_sock_t *s)
{
    return s->zs;
}

const char *tdm_sock_endpoint(const tdm_sock_t *s)
{
    return s->endpoint;
}

void tdm_sock_stats(const tdm_sock_t *s, tdm_sock_stats_t *out)
{
    *out = s->stats;
}

const char *tdm_sock_errmsg(const tdm_sock_t *s)
{
    return s->errmsg;
}

/* ---- sending ---- */

/* Maps a failed zmq send's errno to a status, with the message in s->errmsg. */
static int send_error(tdm_sock_t *s, int e, const tdm_send_t *m)
{
    char peer[2 * TDM_NET_PEER_MAX + 1] = "-";
    if (s->router)
        peer_str(m->peer, m->peer_len, peer, sizeof peer);
    s->stats.send_failures++;
    switch (e) {
    case EHOSTUNREACH: set_errmsg(s, "peer %s is unknown or gone", peer); return TDM_EUNAVAILABLE;
    case EAGAIN:
        set_errmsg(s, "send queue full (%d messages) for peer %s", s->sndhwm, peer);
        return TDM_EUNAVAILABLE;
    case ENOMEM: set_errmsg(s, "out of memory"); return TDM_ERESOURCE;
    case ETERM: set_errmsg(s, "the ZMQ context is shutting down"); return TDM_EUNAVAILABLE;
    default: set_errmsg(s, "send: %s", zmq_strerror(e)); return TDM_EUNAVAILABLE;
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
        set_errmsg(s, "a ROUTER send needs a peer routing id of 1..%u bytes", TDM_NET_PEER_MAX);
        return TDM_EINVALID;
    }
    if (m->kind < TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST ||
        m->kind > TANDEM__V1__FRAME_KIND__FRAME_KIND_NOTIFY) {
        set_errmsg(s, "unknown frame kind %d", m->kind);
        return TDM_EINVALID;
    }
    if (m->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END && m->status > 0) {
        set_errmsg(s, "END status must be 0 or negative, got %d", m->status);
        return TDM_EINVALID;
    }
    if (m->api_key && strlen(m->api_key) >= TDM_NET_API_KEY_MAX) {
        set_errmsg(s, "api_key of %zu bytes exceeds the limit of %u bytes", strlen(m->api_key),
                   TDM_NET_API_KEY_MAX - 1);
        return TDM_EINVALID;
    }
    if (m->n_data > TDM_NET_MAX_DATA_FRAMES || (m->n_data && !m->data)) {
        set_errmsg(s, "%u data frames (at most %u)", m->n_data, TDM_NET_MAX_DATA_FRAMES);
        return TDM_EINVALID;
    }
    for (uint32_t i = 0; i < m->n_data; i++)
        if (m->data[i].len > TDM_NET_MAX_DATA_BYTES || (m->data[i].len && !m->data[i].ptr)) {
            set_errmsg(s, "data frame %u of %zu bytes (at most %u, and not NULL)", i,
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
    h.instance_id = s->instance_id;
    *hlen = tandem__v1__frame_header__get_packed_size(&h);
    if (*hlen >
        TDM_NET_MAX_HEADER_BYTES) { /* cannot happen with the limits; checked all the same */
        set_errmsg(s, "FrameHeader of %zu bytes exceeds %u", *hlen, TDM_NET_MAX_HEADER_BYTES);
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
        set_errmsg(s, "body of %zu bytes exceeds the limit of %u bytes", *blen,
                   TDM_NET_MAX_BODY_BYTES);
        return TDM_EINVALID;
    }
    if (zmq_msg_init_size(body, *blen) != 0) {
        set_errmsg(s, "out of memory for a body of %zu bytes", *blen);
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

int tdm_sock_reply(tdm_sock_t *s, const tdm_frame_t *to, const ProtobufCMessage *body)
{
    tdm_send_t m = {
        .peer = to->peer,
        .peer_len = to->peer_len,
        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
        .method = to->method,
        .call_id = to->call_id,
        .body = body,
    };
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
    tdm_send_t m = {
        .peer = to->peer,
        .peer_len = to->peer_len,
        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
        .method = to->method,
        .call_id = to->call_id,
        .status = status,
        .message = text,
    };
    return tdm_sock_send(s, &m);
}

int tdm_sock_stream(tdm_sock_t *s, const tdm_frame_t *to, const ProtobufCMessage *body)
{
    tdm_send_t m = {
        .peer = to->peer,
        .peer_len = to->peer_len,
        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM,
        .method = to->method,
        .call_id = to->call_id,
        .body = body,
    };
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

/* ---- receiving ---- */

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
        peer_str(f->peer, f->peer_len, peer, sizeof peer);
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
    set_errmsg(s, "%s", why->msg);
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
            set_errmsg(s, "poll: %s", zmq_strerror(e));
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
            set_errmsg(s, "receive: %s", zmq_strerror(e));
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
