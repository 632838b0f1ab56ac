/* client.c - libtandem-client: the client object (its DEALER socket, connection monitor and
 * options), the table of its calls, and how a call ends. Starting Generate calls is in
 * client_start.c, receiving and dispatching frames in client_poll.c, the blocking and unary
 * calls in client_unary.c (client.h is the API).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "client_internal.h"

/* How long tdm_client_destroy waits for CANCEL frames sent just before it to leave: the socket
 * closes with linger 0, which drops what is still queued. */
#define CLIENT_CANCEL_GRACE_S 0.05

/* ---- small helpers ---- */

const char *tdm_client_finish_name(tdm_client_finish_t f)
{
    return tdm_proto_finish_name((int)f); /* the enums share their values */
}

void tdm_client_request_init(tdm_client_request_t *req)
{
    memset(req, 0, sizeof *req);
    tdm_sampling_params_default(&req->sampling);
    req->stream = true;
}

void tdm_client_result_init(tdm_client_result_t *r)
{
    memset(r, 0, sizeof *r);
}

void tdm_client_result_clear(tdm_client_result_t *r)
{
    if (!r)
        return;
    free(r->request_id);
    free(r->stop_reason);
    free(r->text);
    free(r->token_ids);
    tdm_client_result_init(r);
}

const char *tdm_client_errmsg(const tdm_client_t *c)
{
    return c->err.msg;
}

const char *tdm_client_errfield(const tdm_client_t *c)
{
    return c->err_field;
}

uint64_t tdm_client_retried(const tdm_client_t *c)
{
    return c->n_retried;
}

size_t tdm_client_pending(const tdm_client_t *c)
{
    return c->n_calls;
}

/* Sleeps for s seconds (restarted after signals only up to the original end). */
static void sleep_s(double s)
{
    if (s <= 0)
        return;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ---- construction ---- */

/* Stops router's monitor and closes its socket. NULL-safe. */
static void monitor_close(client_router_t *r)
{
    if (r->sock)
        zmq_socket_monitor(tdm_sock_zsock(r->sock), NULL, 0);
    if (r->monitor)
        zmq_close(r->monitor);
    r->monitor = NULL;
}

/* Watches the DEALER's connection (zmq_socket_monitor(3)): a DISCONNECTED event means the
 * router went away (killed, restarted, its host gone: ZMQ's heartbeat notices that) with
 * whatever it had of the calls in flight, so they end at once instead of at their deadlines
 * (connection_lost). An inproc endpoint (the HTTP gateway inside the router) cannot lose its
 * peer without the process and is not watched. Returns 0 or TDM_EINTERNAL. */
static int monitor_new(tdm_client_t *c, client_router_t *r, tdm_error_t *err)
{
    if (strncmp(r->endpoint, "inproc://", 9) == 0)
        return TDM_OK;
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://tdm-client-monitor-%llu",
             (unsigned long long)tdm_net_unique(c->net));
    int zero = 0;
    int events = ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                 ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                 ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
    /* the first handshake may be over before the monitor is attached: count it as done */
    r->connected = true;
    if (zmq_socket_monitor(tdm_sock_zsock(r->sock), ep, events) != 0 ||
        !(r->monitor = zmq_socket(tdm_net_zctx(c->net), ZMQ_PAIR)) ||
        zmq_setsockopt(r->monitor, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_connect(r->monitor, ep) != 0) {
        tdm_error_set(err, TDM_EINTERNAL, "client: monitor of %s: %s", r->endpoint,
                      zmq_strerror(errno));
        monitor_close(r);
        return TDM_EINTERNAL;
    }
    return TDM_OK;
}

/* Reads the connection events waiting on the monitor. Returns how many established
 * connections dropped: a DISCONNECTED not preceded by a failed handshake (libzmq reports a
 * failed handshake, a CURVE key mismatch say, as HANDSHAKE_FAILED_* and then DISCONNECTED; no
 * call went out over that connection, and they keep waiting for one that works). */
int tdm_client_monitor_read(tdm_client_t *c, size_t router)
{
    client_router_t *r = &c->routers[router];
    int lost = 0;
    while (r->monitor) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, r->monitor, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&ev);
            break;
        }
        /* an event is two frames: 6 bytes (uint16 event, uint32 value), then the endpoint */
        uint16_t event = 0;
        if (zmq_msg_size(&ev) >= 6)
            memcpy(&event, zmq_msg_data(&ev), 2);
        bool more = zmq_msg_more(&ev);
        zmq_msg_close(&ev);
        if (more) {
            zmq_msg_init(&ev);
            zmq_msg_recv(&ev, r->monitor, ZMQ_DONTWAIT);
            zmq_msg_close(&ev);
        }
        if (event == ZMQ_EVENT_DISCONNECTED && r->connected) {
            r->connected = false;
            lost++;
        } else if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            r->connected = true;
            if (c->n_lost)
                TDM_LOG_DEBUGF(c->log, NULL, "client: connected to %s again", r->endpoint);
        } else if (event != ZMQ_EVENT_DISCONNECTED) {
            r->connected = false; /* a handshake failed: its DISCONNECTED loses nothing */
        }
    }
    return lost;
}

/* Checks the endpoint and the options. Returns 0 or TDM_EINVALID with *err set. */
static int opts_check(const char *endpoint, const tdm_client_opts_t *opts, tdm_error_t *err)
{
    if (!endpoint || !endpoint[0])
        return tdm_error_set(err, TDM_EINVALID, "client: the router endpoint is empty");
    if (opts->api_key && strlen(opts->api_key) >= TDM_NET_API_KEY_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "client: the API key has %zu bytes, at most %u allowed",
                             strlen(opts->api_key), TDM_NET_API_KEY_MAX - 1);
    if (isnan(opts->timeout_s))
        return tdm_error_set(err, TDM_EINVALID, "client: timeout_s is NaN");
    return TDM_OK;
}

/* Closes every router's monitor and socket and frees its endpoint. */
static void routers_close(tdm_client_t *c)
{
    for (size_t i = 0; i < c->n_routers; i++) {
        monitor_close(&c->routers[i]);
        tdm_sock_destroy(&c->routers[i].sock);
        free(c->routers[i].endpoint);
    }
    c->n_routers = 0;
}

/* Splits c->endpoint at commas and connects a DEALER (and its monitor) to each router; several
 * routers' sockets queue only on connections that are up (so a call goes to a router that
 * can take it). Returns 0, or TDM_EINVALID (an empty item, a repeat, more than
 * TDM_CLIENT_MAX_ROUTERS, inproc:// among several, or tdm_sock_connect's refusal),
 * TDM_ERESOURCE, TDM_EINTERNAL with *err set; what was opened is closed by routers_close. */
static int routers_open(tdm_client_t *c, tdm_sock_opts_t *so, tdm_error_t *err)
{
    size_t n = 1;
    for (const char *p = c->endpoint; *p; p++)
        n += *p == ',';
    if (n > TDM_CLIENT_MAX_ROUTERS)
        return tdm_error_set(err, TDM_EINVALID, "client: %zu router endpoints; at most %d", n,
                             TDM_CLIENT_MAX_ROUTERS);
    so->immediate = n > 1;
    const char *p = c->endpoint;
    for (size_t i = 0; i < n; i++) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        client_router_t *r = &c->routers[c->n_routers];
        if (len == 0)
            return tdm_error_set(err, TDM_EINVALID, "client: router endpoint %zu of '%s' is empty",
                                 i + 1, c->endpoint);
        if (!(r->endpoint = malloc(len + 1)))
            return tdm_error_set(err, TDM_ERESOURCE, "client: out of memory");
        memcpy(r->endpoint, p, len);
        r->endpoint[len] = '\0';
        c->n_routers++;
        for (size_t j = 0; j < i; j++)
            if (strcmp(c->routers[j].endpoint, r->endpoint) == 0)
                return tdm_error_set(err, TDM_EINVALID,
                                     "client: router endpoint %s is listed twice", r->endpoint);
        if (n > 1 && strncmp(r->endpoint, "inproc://", 9) == 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "client: %s: an inproc:// router cannot be one of several",
                                 r->endpoint);
        if (!(r->sock = tdm_sock_connect(c->net, r->endpoint, so, err)))
            return err && err->code ? err->code : TDM_EINVALID;
        if (monitor_new(c, r, err) != TDM_OK)
            return TDM_EINTERNAL;
        p = end ? end + 1 : p + len;
    }
    return TDM_OK;
}

tdm_client_t *tdm_client_new(const char *endpoint, const tdm_client_opts_t *opts, tdm_error_t *err)
{
    tdm_client_opts_t defaults = {0};
    if (!opts)
        opts = &defaults;
    if (opts_check(endpoint, opts, err) != TDM_OK)
        return NULL;
    tdm_client_t *c = calloc(1, sizeof *c);
    if (!c) {
        tdm_error_set(err, TDM_ERESOURCE, "client: out of memory");
        return NULL;
    }
    c->endpoint = tdm_strdup(endpoint);
    if (!c->endpoint) {
        tdm_error_set(err, TDM_ERESOURCE, "client: out of memory");
        goto out_free;
    }
    if (opts->api_key)
        snprintf(c->api_key, sizeof c->api_key, "%s", opts->api_key);
    c->timeout_s = opts->timeout_s == 0 ? TDM_CLIENT_DEFAULT_TIMEOUT_S : opts->timeout_s;
    c->cancel_flag = opts->cancel_flag;
    c->log = opts->log;
    c->next_id = 1;
    tdm_frame_init(&c->frame);
    if (opts->net) {
        c->net = opts->net;
    } else {
        c->net = tdm_net_new(1, err);
        if (!c->net)
            goto out_endpoint;
        c->own_net = true;
    }
    tdm_sock_opts_t so = {0};
    so.curve = opts->curve;
    so.log = opts->log;
    if (routers_open(c, &so, err) != TDM_OK)
        goto out_routers;
    return c;

out_routers:
    routers_close(c);
    if (c->own_net)
        tdm_net_destroy(&c->net);
out_endpoint:
    free(c->endpoint);
out_free:
    free(c);
    return NULL;
}

/* ---- the call table ---- */

client_call_t *tdm_client_call_find(const tdm_client_t *c, uint64_t id)
{
    size_t lo = 0, hi = c->n_calls;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        uint64_t mid_id = c->calls[mid]->id;
        if (mid_id == id)
            return c->calls[mid];
        if (mid_id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

client_call_t *tdm_client_call_after(const tdm_client_t *c, uint64_t id)
{
    size_t lo = 0, hi = c->n_calls; /* the calls are in id order */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c->calls[mid]->id <= id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < c->n_calls ? c->calls[lo] : NULL;
}

/* Appends call (its id is larger than every id in the table). */
int tdm_client_call_add(tdm_client_t *c, client_call_t *call)
{
    if (c->n_calls == c->cap_calls) {
        size_t cap = c->cap_calls ? c->cap_calls * 2 : 16;
        client_call_t **calls = realloc(c->calls, cap * sizeof *calls);
        if (!calls)
            return TDM_ERESOURCE;
        c->calls = calls;
        c->cap_calls = cap;
    }
    c->calls[c->n_calls++] = call;
    return TDM_OK;
}

void tdm_client_call_remove(tdm_client_t *c, const client_call_t *call)
{
    for (size_t i = 0; i < c->n_calls; i++)
        if (c->calls[i] == call) {
            memmove(&c->calls[i], &c->calls[i + 1], (c->n_calls - i - 1) * sizeof c->calls[0]);
            c->n_calls--;
            return;
        }
}

void tdm_client_call_free(client_call_t *call)
{
    if (!call)
        return;
    tdm_client_result_clear(&call->result);
    if (call->resp)
        protobuf_c_message_free_unpacked(call->resp, NULL);
    free(call->body);
    free(call);
}

/* Sends a CANCEL for call (best effort: a failure only means the router learns from the
 * deadline instead). */
void tdm_client_send_cancel(tdm_client_t *c, const client_call_t *call)
{
    tdm_send_t m = {0};
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL;
    m.method = call->method;
    m.call_id = call->id;
    m.api_key = c->api_key[0] ? c->api_key : NULL;
    if (call->router == NO_ROUTER) /* no router has it */
        return;
    tdm_sock_t *s = c->routers[call->router].sock;
    if (tdm_sock_send(s, &m) == TDM_OK)
        c->last_cancel_t = tdm_time_now();
    else
        TDM_LOG_DEBUGF(c->log, NULL, "client: CANCEL of call %llu not sent: %s",
                       (unsigned long long)call->id, tdm_sock_errmsg(s));
}

/* Ends a call: fills the final fields, takes it out of the table and either hands it to its
 * blocking caller (sync) or runs on_done and frees it. status/message override what the call
 * has when status != 0 and the call has no error yet. */
void tdm_client_call_end(tdm_client_t *c, client_call_t *call, int status, const char *fmt, ...)
{
    tdm_client_result_t *r = &call->result;
    if (status != TDM_OK && r->status == TDM_OK) {
        r->status = status;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(r->message, sizeof r->message, fmt, ap);
        va_end(ap);
    }
    if (r->status != TDM_OK)
        r->finish_reason = r->status == TDM_ECANCELLED || r->status == TDM_EDEADLINE
                               ? TDM_CLIENT_FINISH_CANCELLED
                               : TDM_CLIENT_FINISH_ERROR;
    double now = tdm_time_now();
    tdm_client_timings_t *t = &r->client_timings;
    t->e2e_s = now - call->t_start;
    if (call->t_first > 0) {
        t->ttft_s = call->t_first - call->t_start;
        t->decode_s = call->t_last - call->t_first;
        t->tpot_s = r->n_tokens > 1 ? t->decode_s / (double)(r->n_tokens - 1) : 0.0;
    }
    if (!r->request_id)
        r->request_id = tdm_strdup("");
    if (!r->stop_reason)
        r->stop_reason = tdm_strdup("");
    if ((!r->request_id || !r->stop_reason) && r->status == TDM_OK) {
        r->status = TDM_ERESOURCE; /* the strings stay NULL: out of memory */
        snprintf(r->message, sizeof r->message, "client: out of memory");
    }
    tdm_client_call_remove(c, call);
    c->n_ended++;
    if (call->sync) {
        call->ended = true;
        return;
    }
    c->depth++;
    if (call->on_unary)
        call->on_unary(call->user, r->status, r->message, &call->resp);
    else
        call->on_done(call->user, r);
    c->depth--;
    tdm_client_call_free(call);
}

/* Ends every running call with status (sending CANCEL for each). */
void tdm_client_end_all(tdm_client_t *c, int status, const char *why)
{
    while (c->n_calls > 0) {
        client_call_t *call = c->calls[0];
        tdm_client_send_cancel(c, call);
        tdm_client_call_end(c, call, status, "%s", why);
    }
}

bool tdm_client_cancel_requested(const tdm_client_t *c)
{
    return c->cancel_flag && *c->cancel_flag;
}

void tdm_client_destroy(tdm_client_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_client_t *c = *self_p;
    TDM_ASSERT(c->depth == 0); /* not from a callback */
    tdm_client_end_all(c, TDM_ECANCELLED, "cancelled: the client was destroyed");
    if (c->last_cancel_t > 0) {
        double left = CLIENT_CANCEL_GRACE_S - (tdm_time_now() - c->last_cancel_t);
        sleep_s(left);
    }
    tdm_frame_clear(&c->frame);
    routers_close(c);
    if (c->own_net)
        tdm_net_destroy(&c->net);
    free(c->calls);
    free(c->endpoint);
    free(c);
    *self_p = NULL;
}
