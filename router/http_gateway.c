/* http_gateway.c - the HTTP gateway's link to the router: one thread that owns a client of
 * the client library (client/lib/client.c) connected to the router's inproc:// endpoint on
 * the router's own ZMQ context, and runs every HTTP request as one of its calls.
 *
 * HTTP threads start calls (gw_generate_start, gw_unary_start, gw_unary) and take their events:
 * gw_unary waits for its end (gw_call_next), a generate call or one of gw_unary_start (EMBED) is
 * taken without waiting (gw_call_take),
 * its connection parked (suspended in libmicrohttpd) while nothing is queued. The gateway
 * thread hands the calls to the client library, whose callbacks file each chunk and the end
 * under the call into that call's queue, wake a waiting thread through the call's eventfd and
 * unpark a parked connection. The sockets of parked connections are watched from the gateway
 * thread too (epoll: the same set as its wake eventfd), so a client that hangs up while its
 * connection is parked is unparked at once and its request cancelled. The library does the rest:
 * call ids, deadlines (sent to the router and enforced here), CANCEL, "on_done exactly once". A
 * call is reference-counted: the HTTP thread holds one reference, the gateway thread one while the
 * call is in its list. One mutex guards the queues and flags of every call (the critical sections
 * are a few pointer moves). The client and its socket never leave the gateway thread.
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
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "http_gateway.h"
#include "tandem/log.h"

#define GW_POLL_MS 100 /* longest wait of the gateway thread (cancel requests, shutdown) */

struct gw_call {
    gw_t *gw;
    int refs; /* under gw->mu */
    int method;
    const tdm_client_request_t *greq;            /* GENERATE: points into req_owner */
    const ProtobufCMessage *req;                 /* unary: the request message */
    const ProtobufCMessageDescriptor *resp_desc; /* unary: the response type */
    double timeout_s;                            /* unary: > 0, the deadline */
    void (*req_free)(void *);
    void *req_owner;
    int efd; /* eventfd: written when an event is queued */
    /* under gw->mu: */
    bool ended;            /* the END event is queued */
    bool cancel_requested; /* an HTTP thread asked for CANCEL */
    gw_event_t *head, *tail;
    gw_call_t *next_pending;   /* submission queue */
    void (*unpark)(void *arg); /* parked by gw_call_take: how to unpark it; else NULL */
    void *park_arg;
    int watch_fd;         /* the parked connection's socket in gw->ep, or -1 */
    gw_call_t *end_watch; /* a sibling parked by gw_call_take_watch: unparked when this call
                             ends with an error (cleared by gw_call_unwatch) */
    /* gateway thread only: */
    gw_call_t *next_active;
    uint64_t call_id; /* the client library's, while it runs the call */
    bool running;     /* started in the library and its on_done has not run yet */
};

struct gw {
    tdm_client_t *client; /* gateway thread only (made before it starts) */
    tdm_logger_t log;
    char endpoint[256];
    int wake_fd; /* eventfd: new calls, cancels, shutdown */
    int ep;      /* epoll: wake_fd (data NULL) and the sockets of parked calls (data: the call) */
    pthread_t thread;
    bool thread_started;
    pthread_mutex_t mu;
    /* under mu: */
    bool stopping;
    gw_call_t *pending_head, *pending_tail;
    /* gateway thread only: */
    gw_call_t *active;
};

/* ---- buffers and events ---- */

/* A chunk owned by its event: the library's chunk is valid only during on_chunk. */
struct gw_chunk {
    tdm_client_chunk_t view; /* points into the fields below */
    int32_t *token_ids;
    char *text;
    float *logprobs;
    tdm_client_token_top_t *tops;
    tdm_client_top_logprob_t *entries;
    char **strings; /* [n_strings]: top texts, token texts, stop reason */
    size_t n_strings;
    char **token_texts;
    tdm_client_prompt_logprob_t *plps;     /* [view.n_prompt_logprobs] */
    tdm_client_top_logprob_t *plp_entries; /* their top entries */
    tdm_client_usage_t usage;
    tdm_client_timings_t timings;
};

static void chunk_free(gw_chunk_t *k)
{
    if (!k)
        return;
    for (size_t i = 0; i < k->n_strings; i++)
        free(k->strings[i]);
    free(k->strings);
    free(k->token_ids);
    free(k->text);
    free(k->logprobs);
    free(k->tops);
    free(k->entries);
    free(k->token_texts);
    free(k->plps);
    free(k->plp_entries);
    free(k);
}

/* A copy of s kept in k->strings; NULL on out of memory. */
static const char *chunk_str(gw_chunk_t *k, const char *s)
{
    char *d = tdm_strdup(s ? s : "");
    if (!d)
        return NULL;
    k->strings[k->n_strings++] = d;
    return d;
}

static void *dup_array(const void *p, size_t n, size_t size)
{
    void *d = malloc(n ? n * size : 1);
    if (d && n)
        memcpy(d, p, n * size);
    return d;
}

/* Copies the top logprobs of ch into k. False on out of memory. */
static bool chunk_copy_tops(gw_chunk_t *k, const tdm_client_chunk_t *ch)
{
    size_t n_entries = 0;
    for (size_t i = 0; i < ch->n_top_logprobs; i++)
        n_entries += ch->top_logprobs[i].n_entries;
    k->tops = calloc(ch->n_top_logprobs ? ch->n_top_logprobs : 1, sizeof *k->tops);
    k->entries = calloc(n_entries ? n_entries : 1, sizeof *k->entries);
    if (!k->tops || !k->entries)
        return false;
    size_t e = 0;
    for (size_t i = 0; i < ch->n_top_logprobs; i++) {
        k->tops[i].entries = k->entries + e;
        k->tops[i].n_entries = ch->top_logprobs[i].n_entries;
        for (size_t j = 0; j < ch->top_logprobs[i].n_entries; j++, e++) {
            k->entries[e] = ch->top_logprobs[i].entries[j];
            if (!(k->entries[e].text = chunk_str(k, ch->top_logprobs[i].entries[j].text)))
                return false;
        }
    }
    return true;
}

/* The number of strings the prompt logprobs of ch hold (each token's text and its tops'). */
static size_t plp_strings(const tdm_client_chunk_t *ch)
{
    size_t n = ch->n_prompt_logprobs;
    for (size_t i = 0; i < ch->n_prompt_logprobs; i++)
        n += ch->prompt_logprobs[i].top.n_entries;
    return n;
}

/* Copies the prompt logprobs of ch into k. False on out of memory. */
static bool chunk_copy_plps(gw_chunk_t *k, const tdm_client_chunk_t *ch)
{
    size_t n = ch->n_prompt_logprobs, n_entries = plp_strings(ch) - n;
    k->plps = calloc(n ? n : 1, sizeof *k->plps);
    k->plp_entries = calloc(n_entries ? n_entries : 1, sizeof *k->plp_entries);
    if (!k->plps || !k->plp_entries)
        return false;
    size_t e = 0;
    for (size_t i = 0; i < n; i++) {
        const tdm_client_prompt_logprob_t *p = &ch->prompt_logprobs[i];
        k->plps[i] = *p;
        if (!(k->plps[i].text = chunk_str(k, p->text)))
            return false;
        k->plps[i].top.entries = k->plp_entries + e;
        for (size_t j = 0; j < p->top.n_entries; j++, e++) {
            k->plp_entries[e] = p->top.entries[j];
            if (!(k->plp_entries[e].text = chunk_str(k, p->top.entries[j].text)))
                return false;
        }
    }
    return true;
}

/* A deep copy of ch; NULL on out of memory. */
static gw_chunk_t *chunk_copy(const tdm_client_chunk_t *ch)
{
    gw_chunk_t *k = calloc(1, sizeof *k);
    if (!k)
        return NULL;
    size_t n_entries = 0;
    for (size_t i = 0; i < ch->n_top_logprobs; i++)
        n_entries += ch->top_logprobs[i].n_entries;
    k->strings = calloc(n_entries + ch->n_token_texts + plp_strings(ch) + 2, sizeof *k->strings);
    k->token_ids = dup_array(ch->token_ids, ch->n_tokens, sizeof *ch->token_ids);
    k->text = malloc(ch->text_len + 1);
    k->logprobs = dup_array(ch->logprobs, ch->n_logprobs, sizeof *ch->logprobs);
    k->token_texts = calloc(ch->n_token_texts ? ch->n_token_texts : 1, sizeof *k->token_texts);
    bool ok = k->strings && k->token_ids && k->text && k->logprobs && k->token_texts &&
              chunk_copy_tops(k, ch) && chunk_copy_plps(k, ch);
    for (size_t i = 0; ok && i < ch->n_token_texts; i++)
        ok = (k->token_texts[i] = (char *)chunk_str(k, ch->token_texts[i])) != NULL;
    const char *stop = ok ? chunk_str(k, ch->stop_reason) : NULL;
    if (!stop) {
        chunk_free(k);
        return NULL;
    }
    memcpy(k->text, ch->text, ch->text_len);
    k->text[ch->text_len] = '\0';
    k->view = *ch;
    k->view.request_id = "";
    k->view.token_ids = k->token_ids;
    k->view.text = k->text;
    k->view.logprobs = k->logprobs;
    k->view.top_logprobs = k->tops;
    k->view.token_texts = (const char *const *)k->token_texts;
    k->view.stop_reason = stop;
    k->view.prompt_logprobs = ch->n_prompt_logprobs ? k->plps : NULL;
    if (ch->usage)
        k->usage = *ch->usage;
    if (ch->timings)
        k->timings = *ch->timings;
    k->view.usage = ch->usage ? &k->usage : NULL;
    k->view.timings = ch->timings ? &k->timings : NULL;
    return k;
}

const tdm_client_chunk_t *gw_event_chunk(const gw_event_t *ev)
{
    return &ev->chunk->view;
}

void gw_event_free(gw_event_t *ev)
{
    if (!ev)
        return;
    free(ev->message);
    chunk_free(ev->chunk);
    if (ev->resp)
        protobuf_c_message_free_unpacked(ev->resp, NULL);
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

/* Unparks c if it is parked (gw->mu held, so that it cannot be parked and unparked at once):
 * its socket leaves the epoll set and its unpark function runs. */
static void unpark_locked(gw_call_t *c)
{
    void (*fn)(void *) = c->unpark;
    if (!fn)
        return;
    c->unpark = NULL;
    if (c->watch_fd >= 0)
        epoll_ctl(c->gw->ep, EPOLL_CTL_DEL, c->watch_fd, NULL);
    c->watch_fd = -1;
    fn(c->park_arg);
}

/* Wakes whoever waits for c's next event (gw->mu held). */
static void notify_locked(gw_call_t *c)
{
    wake(c->efd);
    unpark_locked(c);
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
    if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
        c->ended = true;
        if (ev->status != 0 && c->end_watch)
            unpark_locked(c->end_watch);
    }
    notify_locked(c);
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
        notify_locked(c);
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

/* Queues an event of kind (STREAM or END) on c; NULL-safe for chunk. On out of memory the
 * call ends with RESOURCE_EXHAUSTED instead. Returns false when the call has ended. */
static bool file_event(gw_t *gw, gw_call_t *c, gw_event_t *ev)
{
    /* read before queueing: once queued, the event belongs to (and may be freed by) its reader */
    bool is_end = ev && ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
    pthread_mutex_lock(&gw->mu);
    if (ev)
        push_event_locked(c, ev);
    else
        end_locked(c, TDM_ERESOURCE, "the HTTP gateway is out of memory");
    bool ended = c->ended;
    pthread_mutex_unlock(&gw->mu);
    return !ended || is_end;
}

static int on_chunk(void *user, const tdm_client_chunk_t *ch)
{
    gw_call_t *c = user;
    gw_event_t *ev = calloc(1, sizeof *ev);
    if (ev && !(ev->chunk = chunk_copy(ch))) {
        free(ev);
        ev = NULL;
    }
    if (ev)
        ev->kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM;
    /* out of memory, or the call ended here (cancelled): the router must stop too */
    return file_event(c->gw, c, ev) ? 0 : 1;
}

/* The END event of a call that ended with status and message. */
/* message with every inproc:// endpoint (the gateway's own link to the router, an internal
 * name no HTTP client should see) replaced by "the router". Heap; NULL on out of memory. */
static char *scrub_endpoints(const char *message)
{
    static const char inproc[] = "inproc://";
    tdm_buf_t b = TDM_BUF_INIT;
    const char *p = message, *at;
    while ((at = strstr(p, inproc)) != NULL) {
        (void)tdm_buf_append(&b, p, (size_t)(at - p));
        (void)tdm_buf_puts(&b, "the router");
        p = at + sizeof inproc - 1;
        p += strspn(p, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-");
    }
    (void)tdm_buf_puts(&b, p);
    return tdm_buf_take(&b);
}

static gw_event_t *end_event(int status, const char *message)
{
    gw_event_t *ev = calloc(1, sizeof *ev);
    if (ev) {
        ev->kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
        ev->status = status;
        ev->message = scrub_endpoints(message ? message : "");
    }
    if (ev && !ev->message) {
        free(ev);
        ev = NULL;
    }
    return ev;
}

static void on_generate_done(void *user, const tdm_client_result_t *r)
{
    gw_call_t *c = user;
    c->running = false;
    gw_event_t *ev = end_event(r->status, r->message);
    if (ev)
        ev->detail = r->error;
    file_event(c->gw, c, ev);
}

static void on_unary_done(void *user, int status, const char *message, ProtobufCMessage **resp)
{
    gw_call_t *c = user;
    c->running = false;
    gw_event_t *ev = end_event(status, message);
    if (ev) {
        ev->resp = *resp; /* the event takes the response */
        *resp = NULL;
    }
    file_event(c->gw, c, ev);
}

/* Hands c to the client library; a start it refuses ends the call with the library's status
 * and message (and the request field it names). */
static void start(gw_t *gw, gw_call_t *c)
{
    int rc;
    if (c->method == TANDEM__V1__METHOD__METHOD_GENERATE)
        rc = tdm_client_generate_start(gw->client, c->greq, on_chunk, on_generate_done, c,
                                       &c->call_id);
    else
        rc = tdm_client_call_start(gw->client, c->method, c->req, c->resp_desc, c->timeout_s,
                                   on_unary_done, c, &c->call_id);
    if (rc == TDM_OK) {
        c->running = true;
        return;
    }
    gw_event_t *ev = end_event(rc, tdm_client_errmsg(gw->client));
    if (ev)
        snprintf(ev->detail.field, sizeof ev->detail.field, "%s", tdm_client_errfield(gw->client));
    file_event(gw, c, ev);
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

/* Starts every newly submitted call and adds them to the active list. */
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
        bool skip = c->cancel_requested || c->ended || gw->stopping;
        if (skip)
            end_locked(c, gw->stopping ? TDM_EUNAVAILABLE : TDM_ECANCELLED,
                       gw->stopping ? "the HTTP gateway is shutting down"
                                    : "cancelled by the HTTP client");
        pthread_mutex_unlock(&gw->mu);
        c->next_active = gw->active;
        gw->active = c;
        if (!skip)
            start(gw, c);
    }
}

/* Cancels what HTTP threads asked to cancel (the library sends CANCEL and ends the call) and
 * retires the calls that have ended. */
static void sweep(gw_t *gw)
{
    gw_call_t **link = &gw->active;
    while (*link) {
        gw_call_t *c = *link;
        pthread_mutex_lock(&gw->mu);
        bool cancel = c->cancel_requested && !c->ended;
        pthread_mutex_unlock(&gw->mu);
        if (cancel && c->running)
            tdm_client_cancel(gw->client, c->call_id); /* on_done files the END */
        pthread_mutex_lock(&gw->mu);
        if (cancel)
            end_locked(c, TDM_ECANCELLED, "cancelled by the HTTP client");
        bool done = c->ended && !c->running;
        pthread_mutex_unlock(&gw->mu);
        if (done)
            retire(gw, link);
        else
            link = &c->next_active;
    }
}

/* Shutting down (or the client failed): refuse new calls first, so that none is left in the
 * queue, end every call, let the library cancel what the router still runs, retire all. */
static void gw_finish(gw_t *gw)
{
    pthread_mutex_lock(&gw->mu);
    gw->stopping = true;
    pthread_mutex_unlock(&gw->mu);
    take_pending(gw);
    pthread_mutex_lock(&gw->mu);
    for (gw_call_t *c = gw->active; c; c = c->next_active)
        end_locked(c, TDM_EUNAVAILABLE, "the HTTP gateway is shutting down");
    pthread_mutex_unlock(&gw->mu);
    tdm_client_destroy(&gw->client); /* every running call's on_done runs (already ended) */
    while (gw->active)
        retire(gw, &gw->active);
}

/* Unparks the calls whose HTTP clients hung up (their sockets in gw->ep are readable with
 * RDHUP/HUP/ERR): the HTTP side sees the hang-up and cancels. Every unpark runs on this
 * thread, so a call reported here is still parked and alive. */
static void watch_sockets(gw_t *gw)
{
    struct epoll_event evs[64];
    int n = epoll_wait(gw->ep, evs, 64, 0);
    pthread_mutex_lock(&gw->mu);
    for (int i = 0; i < n; i++) {
        gw_call_t *c = evs[i].data.ptr;
        if (c)
            unpark_locked(c);
    }
    pthread_mutex_unlock(&gw->mu);
}

static void *gw_main(void *arg)
{
    gw_t *gw = arg;
    for (;;) {
        pthread_mutex_lock(&gw->mu);
        bool stopping = gw->stopping;
        pthread_mutex_unlock(&gw->mu);
        if (stopping)
            break;
        int rc = tdm_client_poll_fd(gw->client, GW_POLL_MS, gw->ep);
        if (rc < 0) { /* the socket or the context failed: every call has ended */
            tdm_log_write(&gw->log, TDM_LOG_ERROR, NULL, NULL, "http gateway: %s",
                          tdm_client_errmsg(gw->client));
            break;
        }
        drain_fd(gw->wake_fd);
        watch_sockets(gw);
        take_pending(gw);
        sweep(gw);
    }
    gw_finish(gw);
    return NULL;
}

/* ---- construction ---- */

gw_t *gw_new(tdm_net_t *net, const char *endpoint, const char *api_key, const tdm_logger_t *log,
             tdm_error_t *err)
{
    gw_t *gw = calloc(1, sizeof *gw);
    if (!gw) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    if (log)
        gw->log = *log;
    else
        tdm_log_init(&gw->log, "router");
    snprintf(gw->endpoint, sizeof gw->endpoint, "%s", endpoint);
    gw->wake_fd = -1;
    gw->ep = -1;
    pthread_mutex_init(&gw->mu, NULL);
    tdm_client_opts_t o = {0};
    o.api_key = api_key;
    o.net = net;
    o.log = &gw->log;
    o.timeout_s = -1; /* each call says its own */
    gw->client = tdm_client_new(endpoint, &o, err);
    if (!gw->client) {
        tdm_error_prefix(err, err ? err->code : TDM_EINVALID,
                         "http gateway: router endpoint %s: ", endpoint);
        goto out_free;
    }
    gw->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    gw->ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ee = {.events = EPOLLIN, .data = {.ptr = NULL}};
    if (gw->wake_fd < 0 || gw->ep < 0 || epoll_ctl(gw->ep, EPOLL_CTL_ADD, gw->wake_fd, &ee) != 0) {
        tdm_error_set(err, TDM_ERESOURCE, "http gateway: eventfd/epoll: %s", strerror(errno));
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
    tdm_client_destroy(&gw->client); /* when the thread never started */
    if (gw->wake_fd >= 0)
        close(gw->wake_fd);
    if (gw->ep >= 0)
        close(gw->ep);
    pthread_mutex_destroy(&gw->mu);
    free(gw);
    *gw_p = NULL;
}

/* ---- calls ---- */

/* Queues c for the gateway thread, or frees it (with *err) when shutting down. */
static gw_call_t *submit(gw_t *gw, gw_call_t *c, tdm_error_t *err)
{
    c->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
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

gw_call_t *gw_generate_start(gw_t *gw, const tdm_client_request_t *req, void (*req_free)(void *),
                             void *req_owner, tdm_error_t *err)
{
    gw_call_t *c = calloc(1, sizeof *c);
    if (!c) {
        if (req_free)
            req_free(req_owner);
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    c->gw = gw;
    c->efd = -1;
    c->watch_fd = -1;
    c->method = TANDEM__V1__METHOD__METHOD_GENERATE;
    c->greq = req;
    c->req_free = req_free;
    c->req_owner = req_owner;
    return submit(gw, c, err);
}

/* Takes c's first queued event (gw->mu held), or NULL. */
static gw_event_t *pop_locked(gw_call_t *c)
{
    gw_event_t *e = c->head;
    if (e) {
        c->head = e->next;
        if (!c->head)
            c->tail = NULL;
        e->next = NULL;
    }
    return e;
}

/* The END of a call that ended without one (out of memory): 1 with *ev, -1 when even that
 * cannot be made. */
static int oom_end(gw_event_t **ev)
{
    gw_event_t *x = end_event(TDM_ERESOURCE, "the HTTP gateway is out of memory");
    *ev = x;
    return x ? TDM_OK : TDM_ERESOURCE;
}

int gw_call_next(gw_call_t *c, int client_fd, int timeout_ms, gw_event_t **ev)
{
    gw_t *gw = c->gw;
    double end = timeout_ms >= 0 ? tdm_time_now() + timeout_ms / 1000.0 : 0;
    *ev = NULL;
    for (;;) {
        pthread_mutex_lock(&gw->mu);
        gw_event_t *e = pop_locked(c);
        bool ended = c->ended;
        pthread_mutex_unlock(&gw->mu);
        if (e) {
            *ev = e;
            return TDM_OK;
        }
        if (ended)
            return oom_end(ev);
        int wait_ms = -1;
        if (timeout_ms >= 0) {
            double left = end - tdm_time_now();
            if (left <= 0)
                return TDM_OK; /* nothing in time: *ev NULL */
            wait_ms = (int)(left * 1000.0) + 1;
        }
        struct pollfd p[2] = {{c->efd, POLLIN, 0}, {client_fd, POLLRDHUP, 0}};
        int n = poll(p, client_fd >= 0 ? 2 : 1, wait_ms);
        if (n < 0 && errno != EINTR)
            return TDM_EINTERNAL;
        if (n > 0 && (p[0].revents & POLLIN))
            drain_fd(c->efd);
        if (n > 0 && client_fd >= 0 && (p[1].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)))
            return TDM_ECANCELLED;
    }
}

/* Whether call s's END has been queued with an error status and not taken (gw->mu held). */
static bool failed_locked(const gw_call_t *s)
{
    return s->ended && s->tail && s->tail->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END &&
           s->tail->status != 0;
}

int gw_call_take_watch(gw_call_t *c, gw_call_t *const *siblings, size_t n, int client_fd,
                       const gw_parker_t *pk, gw_event_t **ev, bool *sibling_failed)
{
    gw_t *gw = c->gw;
    *ev = NULL;
    *sibling_failed = false;
    pthread_mutex_lock(&gw->mu);
    gw_event_t *e = pop_locked(c);
    bool ended = c->ended;
    for (size_t i = 0; i < n && !e && !ended; i++) {
        if (!siblings[i] || siblings[i] == c)
            continue;
        if (failed_locked(siblings[i]))
            *sibling_failed = true;
        siblings[i]->end_watch = c;
    }
    if (!e && !ended && !*sibling_failed) {
        /* park under the lock: the gateway thread cannot unpark before the park is done */
        c->unpark = pk->unpark;
        c->park_arg = pk->arg;
        c->watch_fd = -1;
        struct epoll_event ee = {.events = EPOLLRDHUP, .data = {.ptr = c}};
        if (client_fd >= 0 && epoll_ctl(gw->ep, EPOLL_CTL_ADD, client_fd, &ee) == 0)
            c->watch_fd = client_fd;
        pk->park(pk->arg);
    }
    pthread_mutex_unlock(&gw->mu);
    if (e) {
        *ev = e;
        return TDM_OK;
    }
    return ended ? oom_end(ev) : TDM_OK; /* parked (or a sibling failed): *ev NULL */
}

int gw_call_take(gw_call_t *c, int client_fd, const gw_parker_t *pk, gw_event_t **ev)
{
    bool sibling_failed;
    return gw_call_take_watch(c, NULL, 0, client_fd, pk, ev, &sibling_failed);
}

void gw_call_unwatch(gw_call_t *c)
{
    if (!c)
        return;
    pthread_mutex_lock(&c->gw->mu);
    c->end_watch = NULL;
    pthread_mutex_unlock(&c->gw->mu);
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

bool gw_call_failed(gw_call_t *c)
{
    pthread_mutex_lock(&c->gw->mu);
    bool failed = failed_locked(c);
    pthread_mutex_unlock(&c->gw->mu);
    return failed;
}

void gw_call_release(gw_call_t **c_p)
{
    if (!c_p || !*c_p)
        return;
    gw_call_t *c = *c_p;
    *c_p = NULL;
    pthread_mutex_lock(&c->gw->mu);
    if (c->watch_fd >= 0) /* a caller that leaves while parked: forget its socket */
        epoll_ctl(c->gw->ep, EPOLL_CTL_DEL, c->watch_fd, NULL);
    c->watch_fd = -1;
    c->unpark = NULL;
    gw_call_t *dead = unref_locked(c);
    pthread_mutex_unlock(&c->gw->mu);
    if (dead)
        call_free(dead);
}

gw_call_t *gw_unary_start(gw_t *gw, int method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, double timeout_s,
                          void (*req_free)(void *), void *req_owner, tdm_error_t *err)
{
    gw_call_t *c = calloc(1, sizeof *c);
    if (!c) {
        if (req_free)
            req_free(req_owner);
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    c->gw = gw;
    c->efd = -1;
    c->watch_fd = -1;
    c->method = method;
    c->req = req;
    c->resp_desc = resp_desc;
    c->timeout_s = timeout_s;
    c->req_free = req_free;
    c->req_owner = req_owner;
    return submit(gw, c, err);
}

int gw_unary(gw_t *gw, int method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, double timeout_s, ProtobufCMessage **resp,
             tdm_error_t *err)
{
    *resp = NULL;
    gw_call_t *c = gw_unary_start(gw, method, req, resp_desc, timeout_s, NULL, NULL, err);
    if (!c)
        return err ? err->code : TDM_EUNAVAILABLE;
    int rc = TDM_OK;
    for (;;) {
        gw_event_t *ev = NULL;
        if (gw_call_next(c, -1, -1, &ev) != TDM_OK) {
            rc = tdm_error_set(err, TDM_EINTERNAL, "waiting for the router failed");
            break;
        }
        if (!ev)
            continue;
        if (ev->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
            gw_event_free(ev); /* a unary call has no stream; ignore */
            continue;
        }
        if (ev->status != TDM_OK)
            rc = tdm_error_set(err, ev->status, "%s",
                               ev->message[0] ? ev->message : tdm_strerror(ev->status));
        else if (!(*resp = ev->resp))
            rc = tdm_error_set(err, TDM_EINTERNAL, "the router's %s answer is missing",
                               tdm_net_method_name(method));
        ev->resp = NULL;
        gw_event_free(ev);
        break;
    }
    gw_call_cancel(c);
    gw_call_release(&c);
    return rc;
}
