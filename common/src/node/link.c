/* link.c - a node's I/O thread: registers with the router, sends heartbeats, and relays frames
 * between the router's TCP socket and the engine thread's inproc socket.
 *
 * Frames are relayed as raw ZeroMQ parts (no decode/encode): the engine side validates them
 * with tdm_sock_recv like any other input. Only END frames answering the link's own calls
 * (REGISTER, HEARTBEAT; call ids with TDM_LINK_CALL_BIT set) are consumed here.
 *
 * Liveness: heartbeats are sent and answered here, never on the engine thread, and nothing on
 * this thread waits for the engine thread: l->mu is held by either side only to copy the load
 * figures or the state, a flush waits on its condition with the mutex released, and relaying to
 * the engine never blocks (the inproc ROUTER queues up to its high-water marks, ~11,000 frames,
 * and drops past them). So a long forward pass or tokenizer work delays no heartbeat
 * (tests/unit/test_node.c: test_heartbeats_while_engine_busy).
 */
#include "tandem/node_link.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#include "tandem/proto.h"

#define TDM_LINK_CALL_BIT (UINT64_C(1) << 63)
#define ENGINE_IDENTITY "engine"
#define REGISTER_RETRY_S 1.0
#define MAX_PARTS 8 /* of one message on the link; KV data never travels here */
/* tdm_node_link_flush's request to the I/O thread: this magic, then the flush's sequence number
 * (uint64_t, host order), as one raw part from the engine socket. A FrameHeader never starts
 * like this (0x54 is no valid protobuf tag of it). */
#define FLUSH_MAGIC "TDMFLUSH"
#define FLUSH_MAGIC_LEN 8

struct tdm_node_link {
    tdm_net_t *net;
    const tdm_logger_t *log;
    tdm_sock_t *up;     /* DEALER to the router (I/O thread) */
    void *inproc;       /* raw ROUTER bound at inproc_ep (I/O thread) */
    tdm_sock_t *engine; /* DEALER connected to inproc_ep (engine thread) */
    char inproc_ep[64];
    uint8_t *reg; /* packed RegisterRequest */
    size_t reg_len;
    char node_id[TDM_NODE_ID_MAX + 1];
    char identity[TDM_NODE_ID_MAX + 18]; /* DEALER routing id: "<node id>.<instance hex>" */
    uint64_t instance;                   /* this node's instance id */
    _Atomic uint64_t router_instance;    /* the registered router's instance; 0 = none yet */
    _Atomic uint64_t stale_frames;       /* frames of another router instance, dropped */

    pthread_t thread;
    bool thread_started;
    atomic_bool stop;

    pthread_mutex_t mu; /* guards load, state, reject_msg, flush_done */
    tdm_node_load_t load;
    tdm_node_link_state_t state;
    char reject_msg[TDM_ERRMSG_MAX];
    pthread_cond_t flushed; /* flush_done advanced (CLOCK_MONOTONIC) */
    uint64_t flush_done;    /* the last flush whose heartbeat the router answered */
    uint64_t flush_asked;   /* engine thread only: the last flush requested */

    /* I/O thread only */
    uint64_t next_call;
    uint64_t register_call; /* outstanding REGISTER call id, 0 when none */
    double last_register;
    double last_heartbeat, last_router_reply;
    uint32_t hb_interval_ms, hb_timeout_ms;
    bool router_lost_logged;
    uint64_t flush_call; /* call id of the heartbeat that proves a flush, 0 when none */
    uint64_t flush_seq;  /* the flush it proves */
    char router_ep[256];
    double last_quiet_log;     /* when "still no answer" / handshake failures were last logged */
    double disconnected_since; /* when the connection to the router dropped; 0: it is up */
    bool curve;                /* the link uses CURVE */
};

static void set_state(tdm_node_link_t *l, tdm_node_link_state_t st, const char *msg)
{
    pthread_mutex_lock(&l->mu);
    l->state = st;
    if (msg)
        snprintf(l->reject_msg, sizeof l->reject_msg, "%s", msg);
    pthread_mutex_unlock(&l->mu);
}

tdm_node_link_state_t tdm_node_link_state(tdm_node_link_t *l, char *msg, size_t cap)
{
    pthread_mutex_lock(&l->mu);
    tdm_node_link_state_t st = l->state;
    if (msg && cap)
        snprintf(msg, cap, "%s", l->reject_msg);
    pthread_mutex_unlock(&l->mu);
    return st;
}

void tdm_node_link_set_load(tdm_node_link_t *l, const tdm_node_load_t *load)
{
    pthread_mutex_lock(&l->mu);
    l->load = *load;
    pthread_mutex_unlock(&l->mu);
}

tdm_sock_t *tdm_node_link_sock(tdm_node_link_t *l)
{
    return l->engine;
}

uint64_t tdm_node_link_router_instance(tdm_node_link_t *l)
{
    return atomic_load(&l->router_instance);
}

uint64_t tdm_node_link_stale_frames(tdm_node_link_t *l)
{
    return atomic_load(&l->stale_frames);
}

/* Sends a REQUEST with a pre-packed body (the registration). */
static int send_register(tdm_node_link_t *l)
{
    Tandem__V1__RegisterRequest *reg =
        tandem__v1__register_request__unpack(NULL, l->reg_len, l->reg);
    if (!reg)
        return TDM_EINTERNAL;
    l->register_call = TDM_LINK_CALL_BIT | ++l->next_call;
    tdm_send_t m = {0};
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = TANDEM__V1__METHOD__METHOD_REGISTER;
    m.call_id = l->register_call;
    m.body = &reg->base;
    int rc = tdm_sock_send(l->up, &m);
    tandem__v1__register_request__free_unpacked(reg, NULL);
    l->last_register = tdm_time_now();
    return rc;
}

/* Sends a heartbeat with the published load under call id call. */
static void send_heartbeat_call(tdm_node_link_t *l, uint64_t call)
{
    tdm_node_load_t ld;
    pthread_mutex_lock(&l->mu);
    ld = l->load;
    pthread_mutex_unlock(&l->mu);
    tdm_node_load_process(&ld);
    ld.stale_router_frames = tdm_node_link_stale_frames(l);
    Tandem__V1__NodeLoad load;
    tdm_node_load_to_proto(&ld, &load);
    Tandem__V1__Heartbeat hb = TANDEM__V1__HEARTBEAT__INIT;
    hb.node_id = l->node_id;
    hb.instance_id = l->instance;
    hb.load = &load;
    tdm_send_t m = {0};
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = TANDEM__V1__METHOD__METHOD_HEARTBEAT;
    m.call_id = call;
    m.body = &hb.base;
    (void)tdm_sock_send(l->up, &m); /* a full queue just skips a beat */
    l->last_heartbeat = tdm_time_now();
}

static void send_heartbeat(tdm_node_link_t *l)
{
    send_heartbeat_call(l, TDM_LINK_CALL_BIT | ++l->next_call);
}

/* The END of a REGISTER call: registered (heartbeat figures and router instance from the
 * RegisterAck), refused (REJECTED, for good), or UNAVAILABLE (retried). */
static void on_register_end(tdm_node_link_t *l, const Tandem__V1__FrameHeader *h,
                            const uint8_t *body, size_t body_len)
{
    if (h->call_id != l->register_call)
        return; /* an answer to an earlier retry */
    l->register_call = 0;
    if (h->status != 0) {
        char msg[TDM_ERRMSG_MAX];
        snprintf(msg, sizeof msg, "%s: %s", tdm_status_name(-(int)h->status),
                 h->message ? h->message : "");
        if (h->status == -TDM_EUNAVAILABLE) {
            TDM_LOG_WARNF(l->log, NULL, "router cannot register us yet: %s; retrying", msg);
            return;
        }
        TDM_LOG_ERRORF(l->log, NULL, "router refused the registration: %s", msg);
        set_state(l, TDM_NODE_LINK_REJECTED, msg);
        return;
    }
    Tandem__V1__RegisterAck *ack = tandem__v1__register_ack__unpack(NULL, body_len, body);
    uint64_t router = h->instance_id;
    if (ack) {
        if (ack->heartbeat_interval_ms >= 10 && ack->heartbeat_interval_ms <= 60000)
            l->hb_interval_ms = ack->heartbeat_interval_ms;
        if (ack->heartbeat_timeout_ms >= l->hb_interval_ms)
            l->hb_timeout_ms = ack->heartbeat_timeout_ms;
        if (ack->router_instance_id)
            router = ack->router_instance_id;
        tandem__v1__register_ack__free_unpacked(ack, NULL);
    }
    uint64_t before = atomic_exchange(&l->router_instance, router);
    if (before && before != router)
        TDM_LOG_WARNF(l->log, NULL,
                      "the router restarted (instance %016" PRIx64 " -> %016" PRIx64
                      "); the old instance's requests are dropped",
                      before, router);
    TDM_LOG_INFOF(l->log, NULL,
                  "registered with the router heartbeat_ms=%u instance=%016" PRIx64
                  " router_instance=%016" PRIx64,
                  l->hb_interval_ms, l->instance, router);
    set_state(l, TDM_NODE_LINK_REGISTERED, "");
    send_heartbeat(l);
}

/* The END of a HEARTBEAT: NOT_FOUND (the router does not know this instance), or an answer
 * from another router instance than the registered one (the router restarted): register
 * again. */
static void on_heartbeat_end(tdm_node_link_t *l, const Tandem__V1__FrameHeader *h)
{
    uint64_t router = atomic_load(&l->router_instance);
    const char *why = NULL;
    if (h->status == -TDM_ENOTFOUND)
        why = "router does not know this node (restarted?)";
    else if (h->status == 0 && h->instance_id && router && h->instance_id != router)
        why = "heartbeat answered by another router instance";
    if (why && tdm_node_link_state(l, NULL, 0) == TDM_NODE_LINK_REGISTERED) {
        TDM_LOG_WARNF(l->log, NULL, "%s; registering again", why);
        set_state(l, TDM_NODE_LINK_CONNECTING, "");
        if (l->register_call == 0)
            send_register(l);
    }
}

/* Handles the END of one of the link's calls (REGISTER, HEARTBEAT, a flush's heartbeat). */
static void on_link_end(tdm_node_link_t *l, const Tandem__V1__FrameHeader *h, const uint8_t *body,
                        size_t body_len)
{
    l->last_router_reply = tdm_time_now();
    if (l->router_lost_logged) {
        TDM_LOG_INFOF(l->log, NULL, "router reachable again");
        l->router_lost_logged = false;
    }
    if (l->flush_call && h->call_id == l->flush_call) {
        /* whatever its status: the router answered, so everything sent before it arrived */
        l->flush_call = 0;
        pthread_mutex_lock(&l->mu);
        l->flush_done = l->flush_seq;
        pthread_cond_broadcast(&l->flushed);
        pthread_mutex_unlock(&l->mu);
    } else if (h->method == TANDEM__V1__METHOD__METHOD_REGISTER) {
        on_register_end(l, h, body, body_len);
    } else {
        on_heartbeat_end(l, h);
    }
}

/* Receives one multipart message from src into parts[] (raw). Returns the number of parts,
 * 0 when there was none, -1 (everything closed) when it had more than MAX_PARTS. */
static int recv_parts(tdm_node_link_t *l, void *src, zmq_msg_t *parts)
{
    int n = 0;
    bool overflow = false;
    for (;;) {
        zmq_msg_t tmp;
        zmq_msg_t *m = n < MAX_PARTS ? &parts[n] : &tmp;
        zmq_msg_init(m);
        if (zmq_msg_recv(m, src, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(m);
            break;
        }
        int more = zmq_msg_more(m);
        if (n < MAX_PARTS) {
            n++;
        } else {
            overflow = true; /* drop the extra parts */
            zmq_msg_close(m);
        }
        if (!more)
            break;
    }
    if (!overflow)
        return n;
    TDM_LOG_WARNF(l->log, NULL, "dropped a message of more than %d parts on the router link",
                  MAX_PARTS);
    for (int i = 0; i < n; i++)
        zmq_msg_close(&parts[i]);
    return -1;
}

/* A message from the router: consumed when it answers the link's own call, dropped when it
 * comes from another router instance than the registered one, else forwarded to the engine
 * with the engine's identity first. */
static void from_router(tdm_node_link_t *l, zmq_msg_t *parts, int n)
{
    Tandem__V1__FrameHeader *h = tandem__v1__frame_header__unpack(
        NULL, zmq_msg_size(&parts[0]), (const uint8_t *)zmq_msg_data(&parts[0]));
    if (h && h->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END &&
        (h->call_id & TDM_LINK_CALL_BIT)) {
        const uint8_t *body = n > 1 ? (const uint8_t *)zmq_msg_data(&parts[1]) : NULL;
        on_link_end(l, h, body, n > 1 ? zmq_msg_size(&parts[1]) : 0);
        tandem__v1__frame_header__free_unpacked(h, NULL);
        return;
    }
    /* Work of a router instance that is not the registered one (a router that restarted, or
     * a stray peer) never reaches the engine. */
    uint64_t router = atomic_load(&l->router_instance);
    bool stale = h && (router == 0 || h->instance_id != router);
    if (h)
        tandem__v1__frame_header__free_unpacked(h, NULL);
    if (stale) {
        uint64_t n_stale = atomic_fetch_add(&l->stale_frames, 1) + 1;
        if ((n_stale & (n_stale - 1)) == 0) /* 1, 2, 4, 8, ...: no log flood */
            TDM_LOG_WARNF(l->log, NULL,
                          "dropped a frame from router instance other than the registered "
                          "one (%" PRIu64 " so far)",
                          n_stale);
        return;
    }
    l->last_router_reply = tdm_time_now();
    if (zmq_send(l->inproc, ENGINE_IDENTITY, strlen(ENGINE_IDENTITY), ZMQ_SNDMORE) < 0)
        return;
    for (int i = 0; i < n; i++) /* zmq_msg_send takes each part; closing them after is harmless */
        if (zmq_msg_send(&parts[i], l->inproc, i + 1 < n ? ZMQ_SNDMORE : 0) < 0)
            return;
}

/* True for a flush request from the engine (tdm_node_link_flush); *seq gets its number. */
static bool is_flush(const zmq_msg_t *parts, int n, uint64_t *seq)
{
    if (n != 2 || zmq_msg_size((zmq_msg_t *)&parts[1]) != FLUSH_MAGIC_LEN + sizeof *seq)
        return false;
    const unsigned char *d = zmq_msg_data((zmq_msg_t *)&parts[1]);
    if (memcmp(d, FLUSH_MAGIC, FLUSH_MAGIC_LEN) != 0)
        return false;
    memcpy(seq, d + FLUSH_MAGIC_LEN, sizeof *seq);
    return true;
}

/* A message from the engine: its identity dropped, the rest forwarded to the router; a flush
 * request becomes a heartbeat whose answer proves that what was relayed before it arrived. */
static void from_engine(tdm_node_link_t *l, zmq_msg_t *parts, int n)
{
    uint64_t seq;
    if (is_flush(parts, n, &seq)) {
        l->flush_seq = seq;
        l->flush_call = TDM_LINK_CALL_BIT | ++l->next_call;
        send_heartbeat_call(l, l->flush_call);
        return;
    }
    void *up = tdm_sock_zsock(l->up);
    for (int i = 1; i < n; i++)
        if (zmq_msg_send(&parts[i], up, (i + 1 < n ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) < 0) {
            TDM_LOG_WARNF(l->log, NULL, "cannot send to the router: %s", zmq_strerror(errno));
            break;
        }
}

/* Receives one multipart message from src (raw parts) and relays it. */
static void relay(tdm_node_link_t *l, void *src, bool router_side)
{
    zmq_msg_t parts[MAX_PARTS];
    int n = recv_parts(l, src, parts);
    if (n <= 0)
        return;
    if (router_side)
        from_router(l, parts, n);
    else
        from_engine(l, parts, n);
    for (int i = 0; i < n; i++)
        zmq_msg_close(&parts[i]);
}

/* Says why a node that is not registered hears nothing, at once for a CURVE handshake that
 * failed and then every 30 s (a key mismatch never heals by itself), and every 30 s while the
 * router does not answer at all. */
static void log_quiet_router(tdm_node_link_t *l, tdm_node_link_state_t st, double now)
{
    char why[200];
    /* a failed handshake says something only of CURVE keys (the link watches handshakes
     * without CURVE too, for the connection's state) */
    bool failed = l->curve && tdm_sock_handshake(l->up, why, sizeof why) != TDM_OK;
    bool due = l->last_quiet_log == 0 || now - l->last_quiet_log >= 30.0;
    if (failed && due) {
        TDM_LOG_ERRORF(l->log, NULL,
                       "cannot authenticate with the router at %s: %s; check "
                       "router.curve_public_key and this node's curve_public_key / "
                       "curve_secret_key_file (tandem keys generate), or, with keys by "
                       "default, that the router and this node read the same key directory "
                       "(the same user and XDG_STATE_HOME: tandem keys default shows it)",
                       l->router_ep, why);
        l->last_quiet_log = now;
    } else if (!failed && st == TDM_NODE_LINK_CONNECTING && now - l->last_router_reply >= 10.0 &&
               (l->last_quiet_log == 0 || now - l->last_quiet_log >= 30.0)) {
        TDM_LOG_WARNF(l->log, NULL,
                      "no answer from the router at %s for %.0f s; still trying (is it running, "
                      "and is router.node_endpoint (or node_advertise) right?)",
                      l->router_ep, now - l->last_router_reply);
        l->last_quiet_log = now;
    }
}

/* The registered router has been silent, and the connection to it down, for
 * TDM_NODE_LINK_LOST_TIMEOUTS heartbeat timeouts (the time after which a router marks a silent
 * node down): the router is gone (killed, or its host). Its instance is forgotten, so the
 * engine drops the requests it dispatched (tdm_node_link_router_instance is 0 until the next
 * RegisterAck), and the link registers again. A router whose loop stalls keeps the connection
 * up (ZeroMQ's I/O thread answers the ZMTP heartbeats) and is waited for, as it waits for its
 * nodes (its liveness clock leaves its own stalls out): its requests are still its own. */
static void router_lost(tdm_node_link_t *l, double now)
{
    uint64_t gone = atomic_exchange(&l->router_instance, 0);
    TDM_LOG_WARNF(l->log, NULL,
                  "the router at %s (instance %016" PRIx64
                  ") has not answered for %.1f s: it is taken for gone and its requests are "
                  "dropped; registering again",
                  l->router_ep, gone, now - l->last_router_reply);
    set_state(l, TDM_NODE_LINK_CONNECTING, "");
    if (l->register_call == 0)
        send_register(l);
}

static void *io_main(void *arg)
{
    tdm_node_link_t *l = arg;
    l->hb_interval_ms = TDM_HEARTBEAT_INTERVAL_MS;
    l->hb_timeout_ms = TDM_HEARTBEAT_TIMEOUT_MS;
    l->last_router_reply = tdm_time_now();
    send_register(l);
    while (!atomic_load(&l->stop)) {
        zmq_pollitem_t items[2] = {{tdm_sock_zsock(l->up), 0, ZMQ_POLLIN, 0},
                                   {l->inproc, 0, ZMQ_POLLIN, 0}};
        int rc = zmq_poll(items, 2, 20);
        if (rc < 0 && zmq_errno() == ETERM)
            break;
        if (rc > 0) {
            if (items[0].revents & ZMQ_POLLIN)
                for (int i = 0; i < 64; i++) {
                    int ev = 0;
                    size_t sz = sizeof ev;
                    relay(l, tdm_sock_zsock(l->up), true);
                    if (zmq_getsockopt(tdm_sock_zsock(l->up), ZMQ_EVENTS, &ev, &sz) != 0 ||
                        !(ev & ZMQ_POLLIN))
                        break;
                }
            if (items[1].revents & ZMQ_POLLIN)
                for (int i = 0; i < 64; i++) {
                    int ev = 0;
                    size_t sz = sizeof ev;
                    relay(l, l->inproc, false);
                    if (zmq_getsockopt(l->inproc, ZMQ_EVENTS, &ev, &sz) != 0 || !(ev & ZMQ_POLLIN))
                        break;
                }
        }
        double now = tdm_time_now();
        tdm_node_link_state_t st = tdm_node_link_state(l, NULL, 0);
        if (st == TDM_NODE_LINK_CONNECTING && now - l->last_register >= REGISTER_RETRY_S)
            send_register(l);
        if (st == TDM_NODE_LINK_REGISTERED &&
            (now - l->last_heartbeat) * 1000.0 >= (double)l->hb_interval_ms)
            send_heartbeat(l);
        double silent_ms = (now - l->last_router_reply) * 1000.0;
        /* connected: the last connection event was a handshake success */
        bool connected = tdm_sock_connected(l->up);
        if (connected)
            l->disconnected_since = 0;
        else if (l->disconnected_since == 0)
            l->disconnected_since = now;
        double lost_ms = TDM_NODE_LINK_LOST_TIMEOUTS * (double)l->hb_timeout_ms;
        if (st == TDM_NODE_LINK_REGISTERED && !l->router_lost_logged &&
            silent_ms > (double)l->hb_timeout_ms) {
            TDM_LOG_WARNF(l->log, NULL, "no answer from the router at %s for %.1f s; still trying",
                          l->router_ep, now - l->last_router_reply);
            l->router_lost_logged = true;
        }
        if (st == TDM_NODE_LINK_REGISTERED && silent_ms > lost_ms && l->disconnected_since > 0 &&
            (now - l->disconnected_since) * 1000.0 > lost_ms)
            router_lost(l, now);
        log_quiet_router(l, st, now);
    }
    return NULL;
}

/* The link's sockets: the DEALER to the router (its routing id of its own per instance: the
 * router binds it at registration, so another process using this node id, a restart or an
 * impostor, never takes this connection), the inproc ROUTER and the engine's DEALER. */
static int open_sockets(tdm_node_link_t *l, tdm_net_t *net, const tdm_node_link_opts_t *o,
                        tdm_error_t *err)
{
    snprintf(l->identity, sizeof l->identity, "%s.%016" PRIx64, l->node_id, l->instance);
    tdm_sock_opts_t so = {0};
    so.curve = o->curve;
    so.watch_handshake = true; /* a key mismatch is logged, not silent; a lost router is seen */
    l->curve = o->curve != NULL;
    so.identity = l->identity;
    so.log = o->log;
    so.instance_id = l->instance;
    snprintf(l->router_ep, sizeof l->router_ep, "%s", o->router_endpoint);
    l->up = tdm_sock_connect(net, o->router_endpoint, &so, err);
    if (!l->up)
        return err && err->code ? err->code : TDM_EUNAVAILABLE;
    snprintf(l->inproc_ep, sizeof l->inproc_ep, "inproc://tdm-link-%llu",
             (unsigned long long)tdm_net_unique(net));
    l->inproc = zmq_socket(tdm_net_zctx(net), ZMQ_ROUTER);
    int zero = 0;
    if (!l->inproc || zmq_setsockopt(l->inproc, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_bind(l->inproc, l->inproc_ep) != 0)
        return tdm_error_set(err, TDM_EINTERNAL, "node link: inproc socket: %s",
                             zmq_strerror(errno));
    tdm_sock_opts_t eo = {0};
    eo.identity = ENGINE_IDENTITY;
    eo.instance_id = l->instance; /* the engine's frames go to the router as they are */
    eo.heartbeat_ms = -1;
    eo.log = o->log;
    l->engine = tdm_sock_connect(net, l->inproc_ep, &eo, err);
    return l->engine ? TDM_OK : (err && err->code ? err->code : TDM_EINTERNAL);
}

/* The mutex and the flush condition (on the monotonic clock, as tdm_node_link_flush waits). */
static void init_sync(tdm_node_link_t *l)
{
    pthread_mutex_init(&l->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&l->flushed, &ca);
    pthread_condattr_destroy(&ca);
}

tdm_node_link_t *tdm_node_link_new(tdm_net_t *net, const tdm_node_link_opts_t *o, tdm_error_t *err)
{
    if (!o || !o->router_endpoint || !o->reg || !o->reg->node_id || !o->reg->node_id[0] ||
        strlen(o->reg->node_id) > TDM_NODE_ID_MAX) {
        tdm_error_set(err, TDM_EINVALID, "node link: router endpoint and node id required");
        return NULL;
    }
    tdm_node_link_t *l = calloc(1, sizeof *l);
    if (!l) {
        tdm_error_set(err, TDM_ERESOURCE, "node link: out of memory");
        return NULL;
    }
    l->net = net;
    l->log = o->log;
    snprintf(l->node_id, sizeof l->node_id, "%s", o->reg->node_id);
    init_sync(l);
    atomic_init(&l->stop, false);
    if (o->initial_load)
        l->load = *o->initial_load;
    l->reg_len = protobuf_c_message_get_packed_size(&o->reg->base);
    l->reg = malloc(l->reg_len ? l->reg_len : 1);
    if (!l->reg) {
        tdm_error_set(err, TDM_ERESOURCE, "node link: out of memory");
        goto out_free;
    }
    protobuf_c_message_pack(&o->reg->base, l->reg);
    l->instance = o->reg->instance_id;
    atomic_init(&l->router_instance, 0);
    atomic_init(&l->stale_frames, 0);
    if (open_sockets(l, net, o, err) != TDM_OK)
        goto out_free;
    if (pthread_create(&l->thread, NULL, io_main, l) != 0) {
        tdm_error_set(err, TDM_EINTERNAL, "node link: cannot start the I/O thread");
        goto out_free;
    }
    l->thread_started = true;
    return l;
out_free:
    tdm_node_link_destroy(&l);
    return NULL;
}

void tdm_node_link_destroy(tdm_node_link_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_node_link_t *l = *self_p;
    if (l->thread_started) {
        atomic_store(&l->stop, true);
        pthread_join(l->thread, NULL);
    }
    tdm_sock_destroy(&l->engine);
    if (l->inproc)
        zmq_close(l->inproc);
    tdm_sock_destroy(&l->up);
    pthread_cond_destroy(&l->flushed);
    pthread_mutex_destroy(&l->mu);
    free(l->reg);
    free(l);
    *self_p = NULL;
}

int tdm_node_link_flush(tdm_node_link_t *l, int timeout_ms)
{
    uint64_t seq = ++l->flush_asked;
    unsigned char req[FLUSH_MAGIC_LEN + sizeof seq];
    memcpy(req, FLUSH_MAGIC, FLUSH_MAGIC_LEN);
    memcpy(req + FLUSH_MAGIC_LEN, &seq, sizeof seq);
    if (zmq_send(tdm_sock_zsock(l->engine), req, sizeof req, ZMQ_DONTWAIT) < 0)
        return TDM_EUNAVAILABLE;
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    int64_t ns = (int64_t)until.tv_nsec + (int64_t)(timeout_ms > 0 ? timeout_ms : 0) * 1000000;
    until.tv_sec += (time_t)(ns / 1000000000);
    until.tv_nsec = (long)(ns % 1000000000);
    pthread_mutex_lock(&l->mu);
    while (l->flush_done < seq)
        if (pthread_cond_timedwait(&l->flushed, &l->mu, &until) == ETIMEDOUT)
            break;
    bool done = l->flush_done >= seq;
    pthread_mutex_unlock(&l->mu);
    return done ? TDM_OK : TDM_EDEADLINE;
}
