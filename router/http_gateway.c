/* http_gateway.c - the HTTP gateway's link to the router: one thread that owns a DEALER
 * connected to the router's client endpoint and multiplexes every HTTP request over it.
 *
 * HTTP threads start calls (gw_call_start) and wait for their events (gw_call_next); the
 * gateway thread sends the REQUEST and CANCEL frames, files each STREAM and END frame it
 * receives under its call id into that call's queue and wakes the waiting thread through the
 * call's eventfd. A call is reference-counted: the HTTP thread holds one reference, the gateway
 * thread one while the call is in its table. One mutex guards the queues and flags of every
 * call (the critical sections are a few pointer moves). ZMQ sockets never leave this thread.
 */
#define _GNU_SOURCE /* POLLRDHUP */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <zmq.h>

#include "http_internal.h"
#include "tandem/log.h"

#define GW_POLL_MS 100 /* longest wait of the gateway thread (deadline checks) */
#define GW_DEADLINE_GRACE_MS 1000
#define GW_MAX_FRAMES_PER_WAKE 512

struct gw_call {
    gw_t *gw;
    int refs; /* under gw->mu */
    uint64_t call_id;
    int method;
    const ProtobufCMessage *req;
    void (*req_free)(void *);
    void *req_owner;
    char api_key[TDM_NET_API_KEY_MAX];
    uint64_t deadline_ms; /* absolute, unix ms; 0 = none */
    int efd;              /* eventfd: written when an event is queued */
    /* under gw->mu: */
    bool sent;             /* the REQUEST went out */
    bool ended;            /* the END event is queued */
    bool cancel_requested; /* an HTTP thread asked for CANCEL */
    gw_event_t *head, *tail;
    gw_call_t *next_pending; /* submission queue */
    /* gateway thread only: */
    gw_call_t *next_active;
    bool final_cancel; /* shutting down: CANCEL still to send */
};

struct gw {
    tdm_net_t *net;
    tdm_logger_t log;
    char endpoint[256];
    tdm_sock_t *sock; /* gateway thread only */
    int wake_fd;      /* eventfd: new calls, cancels, shutdown */
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu;
    /* under mu: */
    bool stopping;
    uint64_t next_call_id;
    gw_call_t *pending_head, *pending_tail;
    /* gateway thread only: */
    gw_call_t *active;
};

/* ---- buffers and events ---- */

int http_buf_append(http_buf_t *b, const void *data, size_t n)
{
    size_t need;
    if (!tdm_add_size(b->len, n, &need) || !tdm_add_size(need, 1, &need))
        return TDM_ERESOURCE;
    if (need > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < need)
            cap *= 2;
        char *p = realloc(b->data, cap);
        if (!p)
            return TDM_ERESOURCE;
        b->data = p;
        b->cap = cap;
    }
    if (n)
        memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = '\0';
    return TDM_OK;
}

int http_buf_printf(http_buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char small[512];
    int n = vsnprintf(small, sizeof small, fmt, ap);
    va_end(ap);
    if (n < 0)
        return TDM_EINTERNAL;
    if ((size_t)n < sizeof small)
        return http_buf_append(b, small, (size_t)n);
    char *big = malloc((size_t)n + 1);
    if (!big)
        return TDM_ERESOURCE;
    va_start(ap, fmt);
    vsnprintf(big, (size_t)n + 1, fmt, ap);
    va_end(ap);
    int rc = http_buf_append(b, big, (size_t)n);
    free(big);
    return rc;
}

static int buf_dump_cb(const char *data, size_t size, void *user)
{
    return http_buf_append(user, data, size) == TDM_OK ? 0 : -1;
}

int http_buf_json(http_buf_t *b, const json_t *v)
{
    return json_dump_callback(v, buf_dump_cb, b, JSON_COMPACT) == 0 ? TDM_OK : TDM_ERESOURCE;
}

void http_buf_free(http_buf_t *b)
{
    if (!b)
        return;
    free(b->data);
    memset(b, 0, sizeof *b);
}

void gw_event_free(gw_event_t *ev)
{
    if (!ev)
        return;
    free(ev->message);
    free(ev->body);
    free(ev);
}

static void wake(int fd)
{
    uint64_t one = 1;
    ssize_t n;
    do
        n = write(fd, &one, sizeof one);
    while (n < 0 && errno == EINTR);
    /* EAGAIN: the counter is already non-zero, the reader wakes anyway */
}

static void drain_fd(int fd)
{
    uint64_t v;
    while (read(fd, &v, sizeof v) > 0) {
    }
}

/* Queues an event on c (gw->mu held) and wakes its reader. An END marks the call ended. */
static void push_event_locked(gw_call_t *c, gw_event_t *ev)
{
    if (c->ended) {
        gw_event_free(ev);
        return;
    }
    ev->next = NULL;
    if (c->tail)
        c->tail->next = ev;
    else
        c->head = ev;
    c->tail = ev;
    if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END)
        c->ended = true;
    wake(c->efd);
}

/* Ends c with status and message (gw->mu held) unless it has ended. On out of memory the
 * call is still marked ended and its reader woken: gw_call_next then reports an INTERNAL END
 * it makes itself. */
static void end_locked(gw_call_t *c, int status, const char *message)
{
    if (c->ended)
        return;
    gw_event_t *ev = calloc(1, sizeof *ev);
    if (ev) {
        ev->kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
        ev->status = status;
        ev->message = tdm_strdup(message ? message : "");
        push_event_locked(c, ev);
    } else {
        c->ended = true;
        wake(c->efd);
    }
}

static void call_free(gw_call_t *c)
{
    gw_event_t *ev = c->head;
    while (ev) {
        gw_event_t *next = ev->next;
        gw_event_free(ev);
        ev = next;
    }
    if (c->req_free)
        c->req_free(c->req_owner);
    if (c->efd >= 0)
        close(c->efd);
    free(c);
}

/* Drops one reference (gw->mu held); returns the call when it must be freed (outside the
 * lock), else NULL. */
static gw_call_t *unref_locked(gw_call_t *c)
{
    return --c->refs == 0 ? c : NULL;
}

/* ---- the gateway thread ---- */

static void send_cancel(gw_t *gw, gw_call_t *c)
{
    tdm_send_t m = {0};
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL;
    m.method = c->method;
    m.call_id = c->call_id;
    if (tdm_sock_send(gw->sock, &m) != TDM_OK)
        tdm_log_write(&gw->log, TDM_LOG_DEBUG, NULL, NULL,
                      "http gateway: CANCEL of call %" PRIu64 " not sent: %s", c->call_id,
                      tdm_sock_errmsg(gw->sock));
}

/* Removes c from the active list and drops the thread's reference. */
static void retire(gw_t *gw, gw_call_t **link)
{
    gw_call_t *c = *link;
    *link = c->next_active;
    pthread_mutex_lock(&gw->mu);
    gw_call_t *dead = unref_locked(c);
    pthread_mutex_unlock(&gw->mu);
    if (dead)
        call_free(dead);
}

/* Sends the REQUEST of every newly submitted call and adds them to the active list. */
static void take_pending(gw_t *gw)
{
    pthread_mutex_lock(&gw->mu);
    gw_call_t *list = gw->pending_head;
    gw->pending_head = gw->pending_tail = NULL;
    pthread_mutex_unlock(&gw->mu);
    while (list) {
        gw_call_t *c = list;
        list = c->next_pending;
        c->next_pending = NULL;
        pthread_mutex_lock(&gw->mu);
        bool skip = c->cancel_requested || c->ended;
        pthread_mutex_unlock(&gw->mu);
        c->next_active = gw->active;
        gw->active = c;
        if (skip)
            continue; /* the sweep below retires it */
        tdm_send_t m = {0};
        m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
        m.method = c->method;
        m.call_id = c->call_id;
        m.deadline_unix_ms = c->deadline_ms;
        m.api_key = c->api_key[0] ? c->api_key : NULL;
        m.body = c->req;
        int rc = tdm_sock_send(gw->sock, &m);
        pthread_mutex_lock(&gw->mu);
        if (rc == TDM_OK) {
            c->sent = true;
        } else {
            char msg[TDM_ERRMSG_MAX];
            snprintf(msg, sizeof msg, "cannot send the request to the router at %s: %s",
                     gw->endpoint, tdm_sock_errmsg(gw->sock));
            end_locked(c, rc == TDM_EINVALID ? TDM_EINTERNAL : TDM_EUNAVAILABLE, msg);
        }
        pthread_mutex_unlock(&gw->mu);
    }
}

/* Retires ended calls, sends CANCEL for cancelled ones and ends those past their deadline. */
static void sweep(gw_t *gw, uint64_t now_ms)
{
    gw_call_t **link = &gw->active;
    while (*link) {
        gw_call_t *c = *link;
        pthread_mutex_lock(&gw->mu);
        bool cancel = c->cancel_requested && !c->ended;
        bool expired =
            !c->ended && c->deadline_ms && now_ms > c->deadline_ms + GW_DEADLINE_GRACE_MS;
        if (cancel)
            end_locked(c, TDM_ECANCELLED, "cancelled by the HTTP client");
        if (expired)
            end_locked(c, TDM_EDEADLINE, "no answer from the router before the deadline");
        bool done = c->ended;
        bool sent = c->sent;
        pthread_mutex_unlock(&gw->mu);
        if ((cancel || expired) && sent)
            send_cancel(gw, c);
        if (done)
            retire(gw, link);
        else
            link = &c->next_active;
    }
}

/* Files one received frame under its call. */
static void deliver(gw_t *gw, const tdm_frame_t *f)
{
    gw_call_t *c = gw->active;
    while (c && c->call_id != f->call_id)
        c = c->next_active;
    if (!c || (f->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM &&
               f->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_END)) {
        tdm_log_write(&gw->log, TDM_LOG_DEBUG, NULL, NULL,
                      "http gateway: dropping a %s frame for call %" PRIu64 " (not running)",
                      tdm_net_kind_name(f->kind), f->call_id);
        return;
    }
    gw_event_t *ev = calloc(1, sizeof *ev);
    if (ev) {
        ev->kind = f->kind;
        ev->status = f->status;
        ev->message = tdm_strdup(f->message);
        if (f->body_len) {
            ev->body = malloc(f->body_len);
            if (ev->body) {
                memcpy(ev->body, f->body, f->body_len);
                ev->body_len = f->body_len;
            }
        }
    }
    pthread_mutex_lock(&gw->mu);
    if (!ev || !ev->message || (f->body_len && !ev->body)) {
        gw_event_free(ev);
        end_locked(c, TDM_ERESOURCE, "the HTTP gateway is out of memory");
    } else {
        push_event_locked(c, ev);
    }
    bool ended = c->ended;
    pthread_mutex_unlock(&gw->mu);
    if (ended && f->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_END)
        send_cancel(gw, c); /* out of memory mid-stream: the router must stop too */
}

static void *gw_main(void *arg)
{
    gw_t *gw = arg;
    tdm_frame_t f;
    tdm_frame_init(&f);
    for (;;) {
        pthread_mutex_lock(&gw->mu);
        bool stopping = gw->stopping;
        pthread_mutex_unlock(&gw->mu);
        if (stopping)
            break;
        zmq_pollitem_t items[2] = {
            {tdm_sock_zsock(gw->sock), 0, ZMQ_POLLIN, 0},
            {NULL, gw->wake_fd, ZMQ_POLLIN, 0},
        };
        int n = zmq_poll(items, 2, GW_POLL_MS);
        if (n < 0 && errno != EINTR) {
            tdm_log_write(&gw->log, TDM_LOG_ERROR, NULL, NULL, "http gateway: zmq_poll: %s",
                          zmq_strerror(errno));
            break;
        }
        if (n > 0 && (items[1].revents & ZMQ_POLLIN))
            drain_fd(gw->wake_fd);
        take_pending(gw);
        for (int i = 0; i < GW_MAX_FRAMES_PER_WAKE; i++) {
            int rc = tdm_sock_recv(gw->sock, &f, 0);
            if (rc != TDM_OK)
                break;
            deliver(gw, &f);
        }
        sweep(gw, tdm_net_now_ms());
    }
    tdm_frame_clear(&f);
    /* shutting down (or the socket failed): refuse new calls first, so that none is left in
     * the queue, then end and retire everything (CANCEL for what the router still runs) */
    pthread_mutex_lock(&gw->mu);
    gw->stopping = true;
    pthread_mutex_unlock(&gw->mu);
    take_pending(gw);
    pthread_mutex_lock(&gw->mu);
    for (gw_call_t *c = gw->active; c; c = c->next_active) {
        c->final_cancel = !c->ended && c->sent;
        end_locked(c, TDM_EUNAVAILABLE, "the HTTP gateway is shutting down");
    }
    pthread_mutex_unlock(&gw->mu);
    while (gw->active) {
        if (gw->active->final_cancel)
            send_cancel(gw, gw->active);
        retire(gw, &gw->active);
    }
    return NULL;
}

/* ---- construction ---- */

gw_t *gw_new(tdm_net_t *net, const char *endpoint, const tdm_logger_t *log, tdm_error_t *err)
{
    gw_t *gw = calloc(1, sizeof *gw);
    if (!gw) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    gw->net = net;
    if (log)
        gw->log = *log;
    else
        tdm_log_init(&gw->log, "router");
    snprintf(gw->endpoint, sizeof gw->endpoint, "%s", endpoint);
    gw->next_call_id = 1;
    gw->wake_fd = -1;
    pthread_mutex_init(&gw->mu, NULL);
    tdm_sock_opts_t o = {0};
    o.log = &gw->log;
    o.identity = NULL;
    o.reconnect_ms = 100;
    o.reconnect_max_ms = 1000;
    gw->sock = tdm_sock_connect(net, endpoint, &o, err);
    if (!gw->sock) {
        tdm_error_prefix(err, err ? err->code : TDM_EINVALID,
                         "http gateway: router endpoint %s: ", endpoint);
        goto out_free;
    }
    gw->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (gw->wake_fd < 0) {
        tdm_error_set(err, TDM_ERESOURCE, "http gateway: eventfd: %s", strerror(errno));
        goto out_free;
    }
    int rc = pthread_create(&gw->thread, NULL, gw_main, gw);
    if (rc != 0) {
        tdm_error_set(err, TDM_ERESOURCE, "http gateway: cannot start a thread: %s", strerror(rc));
        goto out_free;
    }
    gw->thread_started = true;
    return gw;
out_free:
    gw_destroy(&gw);
    return NULL;
}

void gw_shutdown(gw_t *gw)
{
    if (!gw)
        return;
    pthread_mutex_lock(&gw->mu);
    gw->stopping = true;
    pthread_mutex_unlock(&gw->mu);
    if (gw->thread_started) {
        wake(gw->wake_fd);
        pthread_join(gw->thread, NULL);
        gw->thread_started = false;
    }
}

void gw_destroy(gw_t **gw_p)
{
    if (!gw_p || !*gw_p)
        return;
    gw_t *gw = *gw_p;
    gw_shutdown(gw);
    tdm_sock_destroy(&gw->sock);
    if (gw->wake_fd >= 0)
        close(gw->wake_fd);
    pthread_mutex_destroy(&gw->mu);
    free(gw);
    *gw_p = NULL;
}

/* ---- calls ---- */

gw_call_t *gw_call_start(gw_t *gw, int method, const ProtobufCMessage *req,
                         void (*req_free)(void *), void *req_owner, const char *api_key,
                         double timeout_s, tdm_error_t *err)
{
    gw_call_t *c = calloc(1, sizeof *c);
    if (!c) {
        if (req_free)
            req_free(req_owner);
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    c->gw = gw;
    c->method = method;
    c->req = req;
    c->req_free = req_free;
    c->req_owner = req_owner;
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (api_key)
        snprintf(c->api_key, sizeof c->api_key, "%s", api_key);
    if (timeout_s > 0)
        c->deadline_ms = tdm_net_now_ms() + (uint64_t)(timeout_s * 1000.0 + 0.5);
    if (c->efd < 0) {
        tdm_error_set(err, TDM_ERESOURCE, "eventfd: %s", strerror(errno));
        call_free(c);
        return NULL;
    }
    pthread_mutex_lock(&gw->mu);
    if (gw->stopping) {
        pthread_mutex_unlock(&gw->mu);
        tdm_error_set(err, TDM_EUNAVAILABLE, "the HTTP gateway is shutting down");
        call_free(c);
        return NULL;
    }
    c->call_id = gw->next_call_id++;
    c->refs = 2; /* the caller's and the gateway thread's */
    if (gw->pending_tail)
        gw->pending_tail->next_pending = c;
    else
        gw->pending_head = c;
    gw->pending_tail = c;
    pthread_mutex_unlock(&gw->mu);
    wake(gw->wake_fd);
    return c;
}

int gw_call_next(gw_call_t *c, int client_fd, int timeout_ms, gw_event_t **ev)
{
    gw_t *gw = c->gw;
    double end = timeout_ms >= 0 ? tdm_time_now() + timeout_ms / 1000.0 : 0;
    *ev = NULL;
    for (;;) {
        pthread_mutex_lock(&gw->mu);
        gw_event_t *e = c->head;
        if (e) {
            c->head = e->next;
            if (!c->head)
                c->tail = NULL;
            e->next = NULL;
        }
        bool ended = c->ended;
        pthread_mutex_unlock(&gw->mu);
        if (e) {
            *ev = e;
            return 1;
        }
        if (ended) {
            /* ended without an END event (out of memory): make one */
            gw_event_t *x = calloc(1, sizeof *x);
            if (x) {
                x->kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
                x->status = TDM_ERESOURCE;
                x->message = tdm_strdup("the HTTP gateway is out of memory");
            }
            if (!x || !x->message) {
                gw_event_free(x);
                return -1;
            }
            *ev = x;
            return 1;
        }
        int wait_ms = -1;
        if (timeout_ms >= 0) {
            double left = end - tdm_time_now();
            if (left <= 0)
                return 0;
            wait_ms = (int)(left * 1000.0) + 1;
        }
        struct pollfd p[2] = {{c->efd, POLLIN, 0}, {client_fd, POLLRDHUP, 0}};
        int n = poll(p, client_fd >= 0 ? 2 : 1, wait_ms);
        if (n < 0 && errno != EINTR)
            return -1;
        if (n > 0 && (p[0].revents & POLLIN))
            drain_fd(c->efd);
        if (n > 0 && client_fd >= 0 && (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)))
            return -1;
    }
}

void gw_call_cancel(gw_call_t *c)
{
    if (!c)
        return;
    gw_t *gw = c->gw;
    pthread_mutex_lock(&gw->mu);
    bool act = !c->ended && !c->cancel_requested;
    if (act)
        c->cancel_requested = true;
    pthread_mutex_unlock(&gw->mu);
    if (act)
        wake(gw->wake_fd);
}

bool gw_call_ended(gw_call_t *c)
{
    pthread_mutex_lock(&c->gw->mu);
    bool ended = c->ended;
    pthread_mutex_unlock(&c->gw->mu);
    return ended;
}

void gw_call_release(gw_call_t **c_p)
{
    if (!c_p || !*c_p)
        return;
    gw_call_t *c = *c_p;
    *c_p = NULL;
    pthread_mutex_lock(&c->gw->mu);
    gw_call_t *dead = unref_locked(c);
    pthread_mutex_unlock(&c->gw->mu);
    if (dead)
        call_free(dead);
}

int gw_unary(gw_t *gw, int method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, const char *api_key, double timeout_s,
             ProtobufCMessage **resp, tdm_error_t *err)
{
    *resp = NULL;
    gw_call_t *c = gw_call_start(gw, method, req, NULL, NULL, api_key, timeout_s, err);
    if (!c)
        return err ? err->code : TDM_EUNAVAILABLE;
    int rc = TDM_OK;
    for (;;) {
        gw_event_t *ev = NULL;
        int got = gw_call_next(c, -1, -1, &ev);
        if (got < 0) {
            rc = tdm_error_set(err, TDM_EINTERNAL, "waiting for the router failed");
            break;
        }
        if (got == 0)
            continue;
        if (ev->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
            gw_event_free(ev); /* a unary call has no stream; ignore */
            continue;
        }
        if (ev->status != TDM_OK) {
            rc = tdm_error_set(err, ev->status, "%s",
                               ev->message[0] ? ev->message : tdm_strerror(ev->status));
        } else if (resp_desc) {
            *resp = protobuf_c_message_unpack(resp_desc, NULL, ev->body_len, ev->body);
            if (!*resp)
                rc = tdm_error_set(err, TDM_EINTERNAL, "the router's %s answer does not decode",
                                   tdm_net_method_name(method));
        }
        gw_event_free(ev);
        break;
    }
    gw_call_cancel(c);
    gw_call_release(&c);
    return rc;
}
