/* sock.c - Tandem sockets: ROUTER (bound) and DEALER (connected) with their options and CURVE
 * keys, the handshake monitor, the accessors, and the error and peer-name helpers the socket
 * files share. Sending is in sock_send.c, receiving and the blocking unary call in
 * sock_recv.c.
 *
 * Assumptions: a socket is used by one thread at a time.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_internal.h"

static int handshake_monitor_new(tdm_sock_t *s, const char *endpoint, tdm_error_t *err);

void tdm_sock_set_errmsg(tdm_sock_t *s, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(s->errmsg, sizeof s->errmsg, fmt, ap);
    va_end(ap);
}

/* Printable form of a routing id: the text when it is printable ASCII, else hex. */
const char *tdm_sock_peer_str(const uint8_t *peer, size_t len, char *buf, size_t cap)
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
    if (!curve_none(k) && opts->watch_handshake && handshake_monitor_new(s, endpoint, err) != 0)
        goto out_destroy;
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
        setopt_int(s->zs, ZMQ_RECONNECT_IVL_MAX, ivl_max, "reconnect_max_ms", err) ||
        (opts && opts->immediate && setopt_int(s->zs, ZMQ_IMMEDIATE, 1, "immediate", err)))
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
            s->up = true;
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
            s->hs_failures++;
            s->hs_failed_at = tdm_time_now();
            s->hs_failed = true;
            snprintf(s->hs_why, sizeof s->hs_why,
                     "the CURVE handshake failed: the peer's public key is not the one "
                     "configured for it (or it does not speak CURVE)");
            break;
        case ZMQ_EVENT_DISCONNECTED: /* also after a failed handshake: count, but only
                                      * tdm_sock_connected tells whether one is up */
            s->disconnects++;
            s->up = false;
            break;
        default: break;
        }
    }
}

uint64_t tdm_sock_curve_refusals(tdm_sock_t *s, char *why, size_t cap, double *at)
{
    double zap_at = 0;
    uint64_t n = 0;
    if (why && cap)
        why[0] = '\0';
    if (s->zap_domain[0])
        n = tdm_net_zap_refusals(s->net, s->zap_domain, why, cap, &zap_at);
    if (s->zap_domain[0] && s->monitor) {
        monitor_drain(s);
        n += s->hs_failures;
        if (s->hs_failures && s->hs_failed_at > zap_at) {
            zap_at = s->hs_failed_at;
            if (why && cap)
                snprintf(why, cap,
                         "a CURVE handshake failed before the key check: the client does not "
                         "hold this server's public key, or speaks no CURVE (a process without "
                         "the cluster's keys)");
        }
    }
    if (at)
        *at = zap_at;
    return n;
}

uint64_t tdm_sock_disconnects(tdm_sock_t *s)
{
    if (!s || !s->monitor)
        return 0;
    monitor_drain(s);
    return s->disconnects;
}

bool tdm_sock_connected(tdm_sock_t *s)
{
    if (!s || !s->monitor)
        return false;
    monitor_drain(s);
    return s->up;
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
