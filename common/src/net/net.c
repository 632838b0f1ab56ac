/* net.c - the ZeroMQ context of a process (tdm_net_t), its ZAP handler that admits only the
 * configured CURVE client keys on each CURVE server socket, and the CURVE key helpers.
 *
 * ZAP (ZeroMQ RFC 27): libzmq asks the handler bound at inproc://zeromq.zap.01 of the
 * socket's context about every handshake on a socket that has a ZAP domain. Each CURVE
 * ROUTER gets its own domain ("tdm.<n>") registered here with the client public keys it
 * accepts, each with a name; the handler answers 200 with that name as the User-Id when the
 * handshake's mechanism is CURVE and its key is one of them, 400 otherwise (also for a domain
 * no socket holds any more). libzmq attaches the User-Id to every message of the connection
 * (zmq_msg_gets "User-Id"), which is how tdm_sock_recv fills tdm_frame_t.user_id. The handler
 * thread starts with the first CURVE bind and ends in tdm_net_destroy (zmq_ctx_shutdown makes its
 * blocking receive return ETERM).
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "net/net_internal.h"

#define ZAP_ENDPOINT "inproc://zeromq.zap.01"
#define ZAP_PARTS 7 /* version, request id, domain, address, routing id, mechanism, key */

typedef struct zap_entry {
    char domain[TDM_NET_ZAP_DOMAIN_MAX];
    tdm_net_zap_key_t *keys; /* [n_keys] admitted clients (owned) */
    size_t n_keys;
    const tdm_logger_t *log;
    uint64_t refused;      /* handshakes refused (tdm_net_zap_refusals) */
    double refused_at;     /* tdm_time_now of the last */
    char refused_why[160]; /* the last one's reason */
} zap_entry_t;

struct tdm_net {
    void *zctx;
    pthread_mutex_t lock; /* guards everything below */
    bool zap_running;
    pthread_t zap_thread;
    void *zap_sock;   /* REP at ZAP_ENDPOINT; owned by the handler thread once it runs */
    zap_entry_t *zap; /* [n_zap] CURVE server sockets and the key each admits */
    size_t n_zap, cap_zap;
    uint64_t next_domain;
    uint64_t next_unique; /* tdm_net_unique */
};

tdm_net_t *tdm_net_new(int io_threads, tdm_error_t *err)
{
    if (io_threads < 1 || io_threads > 64) {
        tdm_error_set(err, TDM_EINVALID, "io_threads must be in 1..64, got %d", io_threads);
        return NULL;
    }
    tdm_net_t *net = calloc(1, sizeof *net);
    if (!net) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    if (pthread_mutex_init(&net->lock, NULL) != 0) {
        tdm_error_set(err, TDM_EINTERNAL, "pthread_mutex_init failed");
        goto out_free;
    }
    net->zctx = zmq_ctx_new();
    if (!net->zctx) {
        tdm_error_set(err, TDM_ERESOURCE, "zmq_ctx_new: %s", zmq_strerror(errno));
        goto out_mutex;
    }
    /* linger 0 by default, so a forgotten message never blocks zmq_ctx_term */
    if (zmq_ctx_set(net->zctx, ZMQ_IO_THREADS, io_threads) != 0 ||
        zmq_ctx_set(net->zctx, ZMQ_BLOCKY, 0) != 0) {
        tdm_error_set(err, TDM_EINTERNAL, "zmq_ctx_set: %s", zmq_strerror(errno));
        goto out_ctx;
    }
    return net;

out_ctx:
    zmq_ctx_term(net->zctx);
out_mutex:
    pthread_mutex_destroy(&net->lock);
out_free:
    free(net);
    return NULL;
}

void tdm_net_destroy(tdm_net_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_net_t *net = *self_p;
    *self_p = NULL;
    if (net->zap_running) {
        zmq_ctx_shutdown(net->zctx); /* the handler's recv returns ETERM; it closes its socket */
        pthread_join(net->zap_thread, NULL);
    }
    while (zmq_ctx_term(net->zctx) != 0 && errno == EINTR)
        ;
    for (size_t i = 0; i < net->n_zap; i++)
        free(net->zap[i].keys);
    free(net->zap);
    pthread_mutex_destroy(&net->lock);
    free(net);
}

void *tdm_net_zctx(tdm_net_t *net)
{
    return net->zctx;
}

uint64_t tdm_net_unique(tdm_net_t *net)
{
    pthread_mutex_lock(&net->lock);
    uint64_t v = net->next_unique++;
    pthread_mutex_unlock(&net->lock);
    return v;
}

/* ---- ZAP handler ---- */

static bool part_is(zmq_msg_t *m, const char *s)
{
    size_t n = strlen(s);
    return zmq_msg_size(m) == n && memcmp(zmq_msg_data(m), s, n) == 0;
}

/* Counts a refusal on e and keeps its reason (lock held). */
static void zap_note(zap_entry_t *e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void zap_note(zap_entry_t *e, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->refused_why, sizeof e->refused_why, fmt, ap);
    va_end(ap);
    e->refused++;
    e->refused_at = tdm_time_now();
}

/* Decides one request: true to admit, with the admitted key's name in user (cap
 * TDM_NET_USER_ID_MAX). Logs a refusal through the socket's logger. */
static bool zap_decide(tdm_net_t *net, zmq_msg_t *p, size_t n, const char **why, char *user)
{
    *why = "malformed ZAP request";
    if (n < ZAP_PARTS || !part_is(&p[0], "1.0"))
        return false;
    char domain[TDM_NET_ZAP_DOMAIN_MAX];
    size_t dlen = zmq_msg_size(&p[2]);
    if (dlen == 0 || dlen >= sizeof domain) {
        *why = "no Tandem ZAP domain";
        return false;
    }
    memcpy(domain, zmq_msg_data(&p[2]), dlen);
    domain[dlen] = '\0';
    char addr[64];
    size_t alen = zmq_msg_size(&p[3]) < sizeof addr - 1 ? zmq_msg_size(&p[3]) : sizeof addr - 1;
    memcpy(addr, zmq_msg_data(&p[3]), alen);
    addr[alen] = '\0';

    bool ok = false;
    pthread_mutex_lock(&net->lock);
    zap_entry_t *e = NULL;
    for (size_t i = 0; i < net->n_zap; i++)
        if (strcmp(net->zap[i].domain, domain) == 0)
            e = &net->zap[i];
    if (!e) {
        *why = "socket closed";
    } else if (!part_is(&p[5], "CURVE")) {
        *why = "CURVE required";
        tdm_log_write(e->log, TDM_LOG_WARN, NULL, NULL,
                      "refused a peer without CURVE security from %s", addr);
        zap_note(e, "refused a peer without CURVE security from %s", addr);
    } else {
        const tdm_net_zap_key_t *k = NULL;
        for (size_t i = 0; zmq_msg_size(&p[6]) == 32 && i < e->n_keys && !k; i++)
            if (memcmp(zmq_msg_data(&p[6]), e->keys[i].key, 32) == 0)
                k = &e->keys[i];
        if (!k) {
            char z85[41] = "?";
            if (zmq_msg_size(&p[6]) == 32)
                zmq_z85_encode(z85, zmq_msg_data(&p[6]), 32);
            *why = "client key not allowed";
            tdm_log_write(e->log, TDM_LOG_WARN, NULL, NULL,
                          "refused a CURVE client with an unknown public key %s from %s", z85,
                          addr);
            zap_note(e,
                     "refused a CURVE client from %s: its public key %s is no node's key in "
                     "the cluster config",
                     addr, z85);
        } else {
            ok = true;
            *why = "OK";
            memcpy(user, k->name, TDM_NET_USER_ID_MAX);
        }
    }
    pthread_mutex_unlock(&net->lock);
    return ok;
}

static void *zap_main(void *arg)
{
    tdm_net_t *net = arg;
    void *sock = net->zap_sock;
    zmq_msg_t p[ZAP_PARTS];
    for (;;) {
        size_t n = 0;
        bool more = true, term = false;
        while (more) {
            zmq_msg_t m;
            zmq_msg_init(&m);
            if (zmq_msg_recv(&m, sock, 0) < 0) {
                zmq_msg_close(&m);
                if (errno == EINTR)
                    continue;
                term = true; /* ETERM: the context is shutting down */
                break;
            }
            more = zmq_msg_more(&m);
            if (n < ZAP_PARTS) {
                zmq_msg_init(&p[n]);
                zmq_msg_move(&p[n++], &m);
            }
            zmq_msg_close(&m);
        }
        if (!term) {
            const char *why;
            char user[TDM_NET_USER_ID_MAX] = "";
            bool ok = zap_decide(net, p, n, &why, user);
            const char *code = ok ? "200" : "400";
            /* reply: version, request id, status code, status text, user id, metadata */
            zmq_send(sock, "1.0", 3, ZMQ_SNDMORE);
            if (n > 1)
                zmq_send(sock, zmq_msg_data(&p[1]), zmq_msg_size(&p[1]), ZMQ_SNDMORE);
            else
                zmq_send(sock, "", 0, ZMQ_SNDMORE);
            zmq_send(sock, code, 3, ZMQ_SNDMORE);
            zmq_send(sock, why, strlen(why), ZMQ_SNDMORE);
            zmq_send(sock, user, strlen(user), ZMQ_SNDMORE);
            zmq_send(sock, "", 0, 0);
        }
        for (size_t i = 0; i < n; i++)
            zmq_msg_close(&p[i]);
        if (term)
            break;
    }
    zmq_close(sock);
    return NULL;
}

/* Starts the handler (lock held). */
static int zap_start(tdm_net_t *net, tdm_error_t *err)
{
    void *sock = zmq_socket(net->zctx, ZMQ_REP);
    if (!sock)
        return tdm_error_set(err, TDM_EINTERNAL, "ZAP socket: %s", zmq_strerror(errno));
    int linger = 0;
    zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof linger);
    if (zmq_bind(sock, ZAP_ENDPOINT) != 0) {
        int e = errno;
        zmq_close(sock);
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "cannot bind the ZAP handler at %s: %s (another handler in this "
                             "context?)",
                             ZAP_ENDPOINT, zmq_strerror(e));
    }
    net->zap_sock = sock;
    if (pthread_create(&net->zap_thread, NULL, zap_main, net) != 0) {
        zmq_close(sock);
        net->zap_sock = NULL;
        return tdm_error_set(err, TDM_ERESOURCE, "cannot start the ZAP handler thread");
    }
    net->zap_running = true;
    return 0;
}

int tdm_net_zap_register(tdm_net_t *net, const tdm_net_zap_key_t *keys, size_t n_keys,
                         const tdm_logger_t *log, char domain[TDM_NET_ZAP_DOMAIN_MAX],
                         tdm_error_t *err)
{
    int rc = 0;
    tdm_net_zap_key_t *copy = malloc((n_keys ? n_keys : 1) * sizeof *copy);
    if (!copy)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    memcpy(copy, keys, n_keys * sizeof *copy);
    pthread_mutex_lock(&net->lock);
    if (!net->zap_running && (rc = zap_start(net, err)) != 0)
        goto out_unlock;
    if (net->n_zap == net->cap_zap) {
        size_t cap = net->cap_zap ? 2 * net->cap_zap : 4;
        zap_entry_t *z = realloc(net->zap, cap * sizeof *z);
        if (!z) {
            rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
            goto out_unlock;
        }
        net->zap = z;
        net->cap_zap = cap;
    }
    zap_entry_t *e = &net->zap[net->n_zap++];
    memset(e, 0, sizeof *e); /* no refusals yet (realloc'ed memory is not zeroed) */
    snprintf(e->domain, sizeof e->domain, "tdm.%llu", (unsigned long long)net->next_domain++);
    e->keys = copy;
    e->n_keys = n_keys;
    copy = NULL;
    e->log = log;
    memcpy(domain, e->domain, sizeof e->domain);
out_unlock:
    pthread_mutex_unlock(&net->lock);
    free(copy);
    return rc;
}

void tdm_net_zap_unregister(tdm_net_t *net, const char *domain)
{
    pthread_mutex_lock(&net->lock);
    for (size_t i = 0; i < net->n_zap; i++)
        if (strcmp(net->zap[i].domain, domain) == 0) {
            free(net->zap[i].keys);
            net->zap[i] = net->zap[--net->n_zap];
            break;
        }
    pthread_mutex_unlock(&net->lock);
}

/* ---- CURVE keys ---- */

int tdm_net_curve_keypair(char public_key[41], char secret_key[41])
{
    if (!zmq_has("curve") || zmq_curve_keypair(public_key, secret_key) != 0)
        return TDM_EPRECONDITION;
    return 0;
}

int tdm_net_curve_key_check(const char *text, const char *what, tdm_error_t *err)
{
    static const char z85[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                              ".-:+=^!/*?&<>()[]{}@%$#";
    if (!what)
        what = "CURVE key";
    if (!text)
        return tdm_error_set(err, TDM_EINVALID, "%s: missing (40 Z85 characters expected)", what);
    size_t n = strlen(text);
    if (n != 40)
        return tdm_error_set(err, TDM_EINVALID,
                             "%s: a CURVE key is 40 Z85 characters, got %zu characters", what, n);
    for (size_t g = 0; g < 40; g += 5) {
        uint64_t v = 0;
        for (size_t i = g; i < g + 5; i++) {
            const char *c = text[i] ? strchr(z85, text[i]) : NULL;
            if (!c)
                return tdm_error_set(err, TDM_EINVALID,
                                     "%s: character %zu ('%c') is not a Z85 character", what, i + 1,
                                     text[i]);
            v = v * 85 + (uint64_t)(c - z85);
        }
        if (v > UINT32_MAX)
            return tdm_error_set(err, TDM_EINVALID,
                                 "%s: characters %zu..%zu do not encode 4 bytes (not Z85)", what,
                                 g + 1, g + 5);
    }
    return 0;
}

void tdm_net_curve_wipe(void *p, size_t n)
{
    volatile unsigned char *b = p; /* volatile stores: the compiler cannot drop them */
    for (size_t i = 0; i < n; i++)
        b[i] = 0;
}

/* Opens a secret key file for reading: a regular file only its owner may read. Returns 0
 * with *fd_out set (the caller closes it), or an error. */
static int secret_file_open(const char *path, const char *what, int *fd_out, tdm_error_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        return tdm_error_set(err, e == ENOENT ? TDM_ENOTFOUND : TDM_EUNAVAILABLE,
                             "%s %s: cannot open: %s", what, path, strerror(e));
    }
    int rc = 0;
    struct stat st;
    if (fstat(fd, &st) != 0)
        rc = tdm_error_set(err, TDM_EUNAVAILABLE, "%s %s: %s", what, path, strerror(errno));
    else if (!S_ISREG(st.st_mode))
        rc = tdm_error_set(err, TDM_EINVALID, "%s %s: not a regular file", what, path);
    else if (st.st_mode & 077)
        rc = tdm_error_set(err, TDM_EPRECONDITION,
                           "%s %s: mode %04o lets group or others read the secret key; only "
                           "its owner may (chmod 600 %s)",
                           what, path, (unsigned)(st.st_mode & 07777), path);
    if (rc != 0) {
        close(fd);
        return rc;
    }
    *fd_out = fd;
    return 0;
}

int tdm_net_curve_secret_read(const char *path, const char *public_key, const char *what,
                              char secret[41], tdm_error_t *err)
{
    secret[0] = '\0';
    if (!what)
        what = "CURVE secret key file";
    if (!path || !*path)
        return tdm_error_set(err, TDM_EINVALID, "%s is not set", what);
    int fd = -1;
    int rc = secret_file_open(path, what, &fd, err);
    if (rc != 0)
        return rc;
    char buf[48];
    ssize_t n;
    do
        n = read(fd, buf, sizeof buf);
    while (n < 0 && errno == EINTR);
    if (n < 0) {
        rc = tdm_error_set(err, TDM_EUNAVAILABLE, "%s %s: %s", what, path, strerror(errno));
        goto out_close;
    }
    size_t len = (size_t)n;
    if (len > 0 && buf[len - 1] == '\n')
        len--;
    if (len > 0 && buf[len - 1] == '\r')
        len--;
    if (len != 40 || memchr(buf, '\0', len)) {
        rc = tdm_error_set(err, TDM_EINVALID,
                           "%s %s: must hold one 40-character Z85 CURVE secret key (tandem "
                           "keys generate writes one)%s",
                           what, path, (size_t)n == sizeof buf ? ", the file is longer" : "");
        goto out_close;
    }
    char key[41], derived[41];
    memcpy(key, buf, 40);
    key[40] = '\0';
    char label[TDM_ERRMSG_MAX / 2];
    snprintf(label, sizeof label, "%s %s", what, path);
    if ((rc = tdm_net_curve_key_check(key, label, err)) != 0)
        goto out_wipe;
    if (zmq_curve_public(derived, key) != 0) {
        rc = tdm_error_set(err, TDM_EPRECONDITION, "%s: libzmq was built without CURVE", what);
        goto out_wipe;
    }
    if (!public_key || strcmp(derived, public_key) != 0) {
        rc = tdm_error_set(err, TDM_EINVALID,
                           "%s %s: this secret key belongs to the public key %s, not to the "
                           "configured %s",
                           what, path, derived, public_key ? public_key : "(none)");
        goto out_wipe;
    }
    memcpy(secret, key, 41);
out_wipe:
    tdm_net_curve_wipe(key, sizeof key);
    tdm_net_curve_wipe(buf, sizeof buf);
out_close:
    close(fd);
    return rc;
}

uint64_t tdm_net_zap_refusals(tdm_net_t *net, const char *domain, char *why, size_t cap, double *at)
{
    uint64_t n = 0;
    if (why && cap)
        why[0] = '\0';
    if (at)
        *at = 0;
    pthread_mutex_lock(&net->lock);
    for (size_t i = 0; i < net->n_zap; i++)
        if (strcmp(net->zap[i].domain, domain) == 0) {
            n = net->zap[i].refused;
            if (why && cap)
                snprintf(why, cap, "%s", net->zap[i].refused_why);
            if (at)
                *at = net->zap[i].refused_at;
        }
    pthread_mutex_unlock(&net->lock);
    return n;
}
