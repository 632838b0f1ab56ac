/* client.c - libtandem-client: Generate, Health, Models and Status calls over one DEALER
 * socket, many calls in flight at once, responses routed to their call by call id (client.h).
 *
 * Every call, blocking or not, is a client_call_t in the client's table (sorted by call id,
 * since ids only grow, so lookups are a binary search). tdm_client_poll receives frames and
 * dispatches them; a blocking call is a call marked `sync` that the caller's loop keeps polling
 * until it has ended, then takes its result out of the table.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "tandem/client.h"
#include "tandem/proto.h"

/* Frames handled per tdm_client_poll at most, so deadlines are looked at under a flood. */
#define CLIENT_MAX_FRAMES_PER_POLL 4096

/* How long tdm_client_destroy waits for CANCEL frames sent just before it to leave: the socket
 * closes with linger 0, which drops what is still queued. */
#define CLIENT_CANCEL_GRACE_S 0.05

typedef enum call_kind {
    CALL_GENERATE = 0,
    CALL_UNARY = 1,
} call_kind_t;

typedef struct client_call {
    uint64_t id;
    int method;
    call_kind_t kind;
    bool sync;        /* a blocking call waits for it: keep it when it ends */
    bool stream;      /* Generate: chunks are streamed (else one chunk in the END) */
    uint32_t n;       /* Generate: choices (n > 1: every answer comes as a STREAM chunk) */
    uint32_t n_final; /* Generate: choices whose last chunk came */
    bool ended;       /* sync calls only: it has ended and left the table */
    bool in_chunk_cb; /* its on_chunk is running */
    double t_start;   /* monotonic seconds when the REQUEST was sent */
    double deadline;  /* monotonic seconds; 0 = none */
    double t_first;   /* first chunk with a token; 0 = none yet */
    double t_last;    /* last chunk with a token */
    tdm_client_chunk_fn on_chunk;
    tdm_client_done_fn on_done;
    tdm_client_unary_fn on_unary; /* async unary calls */
    void *user;
    tdm_client_result_t result;                  /* status and message for unary calls too */
    size_t text_cap;                             /* bytes allocated for result.text */
    size_t tokens_cap;                           /* entries allocated for result.token_ids */
    const ProtobufCMessageDescriptor *resp_desc; /* unary: the response type */
    ProtobufCMessage *resp;                      /* unary: the decoded response (owned) */
} client_call_t;

struct tdm_client {
    tdm_net_t *net;
    bool own_net;
    tdm_sock_t *sock;
    char *endpoint;
    char api_key[TDM_NET_API_KEY_MAX];
    double timeout_s; /* default deadline; < 0 = none */
    const volatile sig_atomic_t *cancel_flag;
    const tdm_logger_t *log;
    uint64_t next_id;
    client_call_t **calls; /* [n_calls] running calls, sorted by id */
    size_t n_calls, cap_calls;
    uint64_t n_ended;     /* calls ended so far (tdm_client_poll's return value) */
    int depth;            /* > 0 while a callback runs */
    double last_cancel_t; /* when the last CANCEL was sent (monotonic); 0 = never */
    void *monitor;        /* PAIR receiving the DEALER's connection events (NULL: inproc) */
    bool connected;       /* a handshake succeeded and its connection has not dropped since */
    uint64_t n_lost;      /* connections to the router lost so far */
    tdm_frame_t frame;    /* receive buffer */
    tdm_error_t err;
    char err_field[64]; /* the request field the last refused start named; "" if none */
};

/* ---- small helpers ---- */

static const char *str_or_empty(const char *s)
{
    return s ? s : "";
}

const char *tdm_client_finish_name(tdm_client_finish_t f)
{
    return tdm_proto_finish_name((int)f); /* the enums share their values */
}

static tdm_client_finish_t finish_from_proto(Tandem__V1__FinishReason r)
{
    switch (r) {
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP: return TDM_CLIENT_FINISH_STOP;
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH: return TDM_CLIENT_FINISH_LENGTH;
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED: return TDM_CLIENT_FINISH_CANCELLED;
    case TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR: return TDM_CLIENT_FINISH_ERROR;
    default: return TDM_CLIENT_FINISH_NONE;
    }
}

static void timings_from_proto(const Tandem__V1__Timings *m, tdm_client_timings_t *t)
{
    t->queue_s = m->queue_s;
    t->ttft_s = m->ttft_s;
    t->tpot_s = m->tpot_s;
    t->decode_s = m->decode_s;
    t->prefill_s = m->prefill_s;
    t->kv_transfer_s = m->kv_transfer_s;
    t->e2e_s = m->e2e_s;
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

/* Stops the monitor and closes its socket. NULL-safe. */
static void monitor_close(tdm_client_t *c)
{
    zmq_socket_monitor(tdm_sock_zsock(c->sock), NULL, 0);
    if (c->monitor)
        zmq_close(c->monitor);
    c->monitor = NULL;
}

/* Watches the DEALER's connection (zmq_socket_monitor(3)): a DISCONNECTED event means the
 * router went away (killed, restarted, its host gone: ZMQ's heartbeat notices that) with
 * whatever it had of the calls in flight, so they end at once instead of at their deadlines
 * (connection_lost). An inproc endpoint (the HTTP gateway inside the router) cannot lose its
 * peer without the process and is not watched. Returns 0 or TDM_EINTERNAL. */
static int monitor_new(tdm_client_t *c, tdm_error_t *err)
{
    if (strncmp(c->endpoint, "inproc://", 9) == 0)
        return TDM_OK;
    char ep[64];
    snprintf(ep, sizeof ep, "inproc://tdm-client-monitor-%llu",
             (unsigned long long)tdm_net_unique(c->net));
    int zero = 0;
    int events = ZMQ_EVENT_DISCONNECTED | ZMQ_EVENT_HANDSHAKE_SUCCEEDED |
                 ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                 ZMQ_EVENT_HANDSHAKE_FAILED_AUTH;
    /* the first handshake may be over before the monitor is attached: count it as done */
    c->connected = true;
    if (zmq_socket_monitor(tdm_sock_zsock(c->sock), ep, events) != 0 ||
        !(c->monitor = zmq_socket(tdm_net_zctx(c->net), ZMQ_PAIR)) ||
        zmq_setsockopt(c->monitor, ZMQ_LINGER, &zero, sizeof zero) != 0 ||
        zmq_connect(c->monitor, ep) != 0) {
        tdm_error_set(err, TDM_EINTERNAL, "client: monitor of %s: %s", c->endpoint,
                      zmq_strerror(errno));
        monitor_close(c);
        return TDM_EINTERNAL;
    }
    return TDM_OK;
}

/* Reads the connection events waiting on the monitor. Returns how many established
 * connections dropped: a DISCONNECTED not preceded by a failed handshake (libzmq reports a
 * failed handshake, a CURVE key mismatch say, as HANDSHAKE_FAILED_* and then DISCONNECTED; no
 * call went out over that connection, and they keep waiting for one that works). */
static int monitor_read(tdm_client_t *c)
{
    int lost = 0;
    while (c->monitor) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, c->monitor, ZMQ_DONTWAIT) < 0) {
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
            zmq_msg_recv(&ev, c->monitor, ZMQ_DONTWAIT);
            zmq_msg_close(&ev);
        }
        if (event == ZMQ_EVENT_DISCONNECTED && c->connected) {
            c->connected = false;
            lost++;
        } else if (event == ZMQ_EVENT_HANDSHAKE_SUCCEEDED) {
            c->connected = true;
            if (c->n_lost)
                TDM_LOG_DEBUGF(c->log, NULL, "client: connected to %s again", c->endpoint);
        } else if (event != ZMQ_EVENT_DISCONNECTED) {
            c->connected = false; /* a handshake failed: its DISCONNECTED loses nothing */
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
    c->sock = tdm_sock_connect(c->net, endpoint, &so, err);
    if (!c->sock)
        goto out_net;
    if (monitor_new(c, err) != TDM_OK)
        goto out_sock;
    return c;

out_sock:
    tdm_sock_destroy(&c->sock);
out_net:
    if (c->own_net)
        tdm_net_destroy(&c->net);
out_endpoint:
    free(c->endpoint);
out_free:
    free(c);
    return NULL;
}

/* ---- the call table ---- */

static client_call_t *find_call(const tdm_client_t *c, uint64_t id)
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

/* Appends call (its id is larger than every id in the table). */
static int add_call(tdm_client_t *c, client_call_t *call)
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

static void remove_call(tdm_client_t *c, const client_call_t *call)
{
    for (size_t i = 0; i < c->n_calls; i++)
        if (c->calls[i] == call) {
            memmove(&c->calls[i], &c->calls[i + 1], (c->n_calls - i - 1) * sizeof c->calls[0]);
            c->n_calls--;
            return;
        }
}

static void call_free(client_call_t *call)
{
    if (!call)
        return;
    tdm_client_result_clear(&call->result);
    if (call->resp)
        protobuf_c_message_free_unpacked(call->resp, NULL);
    free(call);
}

/* Sends a CANCEL for call (best effort: a failure only means the router learns from the
 * deadline instead). */
static void send_cancel(tdm_client_t *c, const client_call_t *call)
{
    tdm_send_t m = {0};
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL;
    m.method = call->method;
    m.call_id = call->id;
    m.api_key = c->api_key[0] ? c->api_key : NULL;
    if (tdm_sock_send(c->sock, &m) == TDM_OK)
        c->last_cancel_t = tdm_time_now();
    else
        TDM_LOG_DEBUGF(c->log, NULL, "client: CANCEL of call %llu not sent: %s",
                       (unsigned long long)call->id, tdm_sock_errmsg(c->sock));
}

/* Ends a call: fills the final fields, takes it out of the table and either hands it to its
 * blocking caller (sync) or runs on_done and frees it. status/message override what the call
 * has when status != 0 and the call has no error yet. */
static void end_call(tdm_client_t *c, client_call_t *call, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void end_call(tdm_client_t *c, client_call_t *call, int status, const char *fmt, ...)
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
    remove_call(c, call);
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
    call_free(call);
}

/* Ends every running call with status (sending CANCEL for each). */
static void end_all(tdm_client_t *c, int status, const char *why)
{
    while (c->n_calls > 0) {
        client_call_t *call = c->calls[0];
        send_cancel(c, call);
        end_call(c, call, status, "%s", why);
    }
}

static bool cancel_requested(const tdm_client_t *c)
{
    return c->cancel_flag && *c->cancel_flag;
}

void tdm_client_destroy(tdm_client_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_client_t *c = *self_p;
    TDM_ASSERT(c->depth == 0); /* not from a callback */
    end_all(c, TDM_ECANCELLED, "cancelled: the client was destroyed");
    if (c->last_cancel_t > 0) {
        double left = CLIENT_CANCEL_GRACE_S - (tdm_time_now() - c->last_cancel_t);
        sleep_s(left);
    }
    tdm_frame_clear(&c->frame);
    monitor_close(c);
    tdm_sock_destroy(&c->sock);
    if (c->own_net)
        tdm_net_destroy(&c->net);
    free(c->calls);
    free(c->endpoint);
    free(c);
    *self_p = NULL;
}

/* ---- starting calls ---- */

/* The monotonic deadline for a call with timeout_s (0 = the client's default, < 0 = none),
 * and the matching absolute deadline in unix ms for the REQUEST (0 = none). */
static void call_deadline(const tdm_client_t *c, double timeout_s, double now, double *deadline,
                          uint64_t *deadline_unix_ms)
{
    double t = timeout_s == 0 ? c->timeout_s : timeout_s;
    if (t < 0 || isnan(t)) {
        *deadline = 0;
        *deadline_unix_ms = 0;
        return;
    }
    *deadline = now + t;
    *deadline_unix_ms = tdm_net_now_ms() + (uint64_t)llround(t * 1000.0);
}

static client_call_t *call_new(tdm_client_t *c, int method, call_kind_t kind)
{
    client_call_t *call = calloc(1, sizeof *call);
    if (!call)
        return NULL;
    call->id = c->next_id++;
    call->method = method;
    call->kind = kind;
    tdm_client_result_init(&call->result);
    call->result.call_id = call->id;
    return call;
}

/* Sends the REQUEST of call with body and registers it. On failure the call is freed and the
 * error is in c->err. */
static int call_send(tdm_client_t *c, client_call_t *call, const ProtobufCMessage *body,
                     double timeout_s)
{
    double now = tdm_time_now();
    uint64_t deadline_ms;
    call_deadline(c, timeout_s, now, &call->deadline, &deadline_ms);
    int rc = add_call(c, call);
    if (rc != TDM_OK) {
        call_free(call);
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    }
    tdm_send_t m = {0};
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = call->method;
    m.call_id = call->id;
    m.deadline_unix_ms = deadline_ms;
    m.api_key = c->api_key[0] ? c->api_key : NULL;
    m.body = body;
    call->t_start = now;
    rc = tdm_sock_send(c->sock, &m);
    if (rc != TDM_OK) {
        remove_call(c, call);
        call_free(call);
        return tdm_error_set(&c->err, rc, "client: sending the %s request to %s failed: %s",
                             tdm_net_method_name(m.method), c->endpoint, tdm_sock_errmsg(c->sock));
    }
    return TDM_OK;
}

/* Sets c->err to TDM_EINVALID with the message and c->err_field to the request field at fault
 * (a GenerateRequest path, as ErrorDetail.field). Returns TDM_EINVALID. */
static int bad_request(tdm_client_t *c, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int bad_request(tdm_client_t *c, const char *field, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    char msg[TDM_ERRMSG_MAX];
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    snprintf(c->err_field, sizeof c->err_field, "%s", field);
    return tdm_error_set(&c->err, TDM_EINVALID, "%s", msg);
}

/* Checks the input of a request: exactly one of prompt, messages and token_ids. */
static int input_check(tdm_client_t *c, const tdm_client_request_t *req)
{
    int inputs = (req->prompt != NULL) + (req->n_messages > 0) + (req->n_token_ids > 0);
    if (inputs != 1)
        return bad_request(c, "",
                           "request: give exactly one of prompt, messages and token_ids (%d given)",
                           inputs);
    if (req->n_messages > 0 && !req->messages)
        return bad_request(c, "chat.messages", "request: messages is NULL");
    for (size_t i = 0; i < req->n_messages; i++)
        if (!req->messages[i].role ||
            (!req->messages[i].content &&
             !(req->messages[i].tool_calls && req->messages[i].tool_calls[0])))
            return bad_request(c, "chat.messages",
                               "request: messages[%zu] has a NULL role or content", i);
    if (req->n_token_ids > 0 && !req->token_ids)
        return bad_request(c, "tokens.ids", "request: token_ids is NULL");
    return TDM_OK;
}

/* Checks what this library can check of a request; the router checks the rest. */
static int request_check(tdm_client_t *c, const tdm_client_request_t *req)
{
    int rc = input_check(c, req);
    if (rc != TDM_OK)
        return rc;
    if (req->max_tokens < 0)
        return bad_request(c, "max_tokens",
                           "request: max_tokens must be >= 0 (0 = what the context leaves), got %d",
                           (int)req->max_tokens);
    if (req->n_stop > TDM_MAX_STOP_STRINGS)
        return bad_request(c, "stop", "request: %zu stop strings given, at most %d allowed",
                           req->n_stop, TDM_MAX_STOP_STRINGS);
    for (size_t i = 0; i < req->n_stop; i++) {
        size_t len = req->stop[i] ? strlen(req->stop[i]) : 0;
        if (len < 1 || len > TDM_MAX_STOP_STRING_BYTES) {
            char field[32];
            snprintf(field, sizeof field, "stop[%zu]", i);
            return bad_request(c, field, "request: stop[%zu] must have 1..%d bytes, got %zu", i,
                               TDM_MAX_STOP_STRING_BYTES, len);
        }
    }
    if (req->sampling.n_stop_token_ids > TDM_SAMPLING_MAX_STOP)
        return bad_request(c, "sampling.stop_token_ids",
                           "request: sampling.n_stop_token_ids is %u, at most %d allowed",
                           (unsigned)req->sampling.n_stop_token_ids, TDM_SAMPLING_MAX_STOP);
    if (req->n > 16)
        return bad_request(c, "n", "request: n must be in [1, 16], got %u", (unsigned)req->n);
    if (isnan(req->timeout_s))
        return bad_request(c, "", "request: timeout_s is NaN");
    if ((int)req->constraint_kind < TDM_CLIENT_CONSTRAINT_NONE ||
        (int)req->constraint_kind > TDM_CLIENT_CONSTRAINT_CHOICE)
        return bad_request(c, "constraint", "request: constraint_kind %d is not a constraint kind",
                           (int)req->constraint_kind);
    if (req->constraint_kind != TDM_CLIENT_CONSTRAINT_NONE &&
        req->constraint_kind != TDM_CLIENT_CONSTRAINT_JSON_OBJECT && !req->constraint)
        return bad_request(c, "constraint", "request: constraint_kind %d needs constraint text",
                           (int)req->constraint_kind);
    return TDM_OK;
}

/* m (initialised here) pointing at the strings of cm; NULL strings become "". */
static void chat_message_to_proto(const tdm_chat_message_t *cm, Tandem__V1__ChatMessage *m)
{
    tandem__v1__chat_message__init(m);
    /* protobuf-c message fields are not const; the message is only read while packing */
    m->role = (char *)(uintptr_t)cm->role;
    m->content = (char *)(uintptr_t)str_or_empty(cm->content);
    m->tool_calls = (char *)(uintptr_t)str_or_empty(cm->tool_calls);
    m->tool_call_id = (char *)(uintptr_t)str_or_empty(cm->tool_call_id);
    m->name = (char *)(uintptr_t)str_or_empty(cm->name);
}

/* req's constraint in *c (its text points into req), or NULL for none. */
static Tandem__V1__Constraint *constraint_of(const tdm_client_request_t *req,
                                             Tandem__V1__Constraint *c)
{
    if (req->constraint_kind == TDM_CLIENT_CONSTRAINT_NONE)
        return NULL;
    tandem__v1__constraint__init(c);
    c->kind = (Tandem__V1__ConstraintKind)req->constraint_kind;
    c->text = (char *)(uintptr_t)str_or_empty(req->constraint);
    return c;
}

/* The SamplingParams of req in *out (pointing into req and out): only the fields named in
 * req->sampling_set; the router uses its defaults for the others. */
static Tandem__V1__SamplingParams *sampling_to_proto(const tdm_client_request_t *req,
                                                     tdm_proto_sampling_t *out)
{
    tdm_proto_sampling_to(&req->sampling, out);
    Tandem__V1__SamplingParams *sp = &out->m;
    sp->set_mask = req->sampling_set & TDM_CLIENT_SAMPLING_ALL;
    sp->has_seed = (sp->set_mask & TDM_PROTO_SET_SEED) != 0;
    if (!(sp->set_mask & TDM_PROTO_SET_STOP_TOKEN_IDS))
        sp->n_stop_token_ids = 0;
    if (!(sp->set_mask & TDM_PROTO_SET_LOGIT_BIAS))
        sp->n_logit_bias = 0;
    return sp;
}

/* Builds the GenerateRequest of req and sends it as call. */
static int generate_send(tdm_client_t *c, client_call_t *call, const tdm_client_request_t *req)
{
    Tandem__V1__GenerateRequest m = TANDEM__V1__GENERATE_REQUEST__INIT;
    Tandem__V1__ChatList chat = TANDEM__V1__CHAT_LIST__INIT;
    Tandem__V1__TokenList tokens = TANDEM__V1__TOKEN_LIST__INIT;
    tdm_proto_sampling_t sps;
    Tandem__V1__ChatMessage *msgs = NULL;
    Tandem__V1__ChatMessage **msg_ptrs = NULL;

    /* protobuf-c message fields are not const; the message is only read while packing */
    m.request_id = (char *)(uintptr_t)str_or_empty(req->request_id);
    m.model = (char *)(uintptr_t)str_or_empty(req->model);
    if (req->prompt) {
        m.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
        m.prompt = (char *)(uintptr_t)req->prompt;
    } else if (req->n_messages > 0) {
        msgs = calloc(req->n_messages, sizeof *msgs);
        msg_ptrs = calloc(req->n_messages, sizeof *msg_ptrs);
        if (!msgs || !msg_ptrs) {
            free(msgs);
            free(msg_ptrs);
            call_free(call);
            return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
        }
        for (size_t i = 0; i < req->n_messages; i++) {
            chat_message_to_proto(&req->messages[i], &msgs[i]);
            msg_ptrs[i] = &msgs[i];
        }
        chat.n_messages = req->n_messages;
        chat.messages = msg_ptrs;
        chat.tools = (char *)(uintptr_t)str_or_empty(req->tools);
        m.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
        m.chat = &chat;
    } else {
        tokens.n_ids = req->n_token_ids;
        tokens.ids = (int32_t *)(uintptr_t)req->token_ids;
        m.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS;
        m.tokens = &tokens;
    }
    m.sampling = sampling_to_proto(req, &sps);
    m.max_tokens = req->max_tokens;
    m.n_stop = req->n_stop;
    m.stop = (char **)(uintptr_t)req->stop;
    m.stream = req->stream;
    m.n = req->n;
    m.include_stop_str = req->include_stop_str;
    m.echo_token_text = req->echo_token_text;
    m.speculative = req->no_speculation ? TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF
                                        : TANDEM__V1__SPECULATIVE__SPECULATIVE_AUTO;
    Tandem__V1__Constraint cons;
    m.constraint = constraint_of(req, &cons);

    int rc = call_send(c, call, &m.base, req->timeout_s);
    free(msgs);
    free(msg_ptrs);
    return rc;
}

static int generate_start(tdm_client_t *c, const tdm_client_request_t *req,
                          tdm_client_chunk_fn on_chunk, tdm_client_done_fn on_done, void *user,
                          bool sync, client_call_t **out)
{
    tdm_error_clear(&c->err);
    c->err_field[0] = '\0';
    int rc = request_check(c, req);
    if (rc != TDM_OK)
        return rc;
    client_call_t *call = call_new(c, TANDEM__V1__METHOD__METHOD_GENERATE, CALL_GENERATE);
    if (!call)
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    call->on_chunk = on_chunk;
    call->on_done = on_done;
    call->user = user;
    call->sync = sync;
    call->stream = req->stream;
    call->n = req->n;
    call->text_cap = 64;
    call->result.text = malloc(call->text_cap);
    if (!call->result.text) {
        call_free(call);
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    }
    call->result.text[0] = '\0';
    rc = generate_send(c, call, req);
    if (rc != TDM_OK)
        return rc;
    *out = call;
    return TDM_OK;
}

int tdm_client_generate_start(tdm_client_t *c, const tdm_client_request_t *req,
                              tdm_client_chunk_fn on_chunk, tdm_client_done_fn on_done, void *user,
                              uint64_t *call_id)
{
    if (!on_done)
        return tdm_error_set(&c->err, TDM_EINVALID, "client: on_done is NULL");
    client_call_t *call;
    int rc = generate_start(c, req, on_chunk, on_done, user, false, &call);
    if (rc == TDM_OK && call_id)
        *call_id = call->id;
    return rc;
}

/* ---- receiving ---- */

/* Appends the chunk's tokens and text to the call's result. */
static int result_append(client_call_t *call, const Tandem__V1__GenerateChunk *m, size_t text_len)
{
    tdm_client_result_t *r = &call->result;
    if (m->n_token_ids > 0) {
        size_t need = r->n_tokens + m->n_token_ids;
        if (need > call->tokens_cap) {
            size_t cap = call->tokens_cap ? call->tokens_cap : 64;
            while (cap < need)
                cap *= 2;
            int32_t *ids = realloc(r->token_ids, cap * sizeof *ids);
            if (!ids)
                return TDM_ERESOURCE;
            r->token_ids = ids;
            call->tokens_cap = cap;
        }
        memcpy(r->token_ids + r->n_tokens, m->token_ids, m->n_token_ids * sizeof(int32_t));
        r->n_tokens = need;
    }
    if (text_len > 0) {
        size_t need = r->text_len + text_len + 1;
        if (need > call->text_cap) {
            size_t cap = call->text_cap;
            while (cap < need)
                cap *= 2;
            char *text = realloc(r->text, cap);
            if (!text)
                return TDM_ERESOURCE;
            r->text = text;
            call->text_cap = cap;
        }
        memcpy(r->text + r->text_len, m->text, text_len);
        r->text_len += text_len;
        r->text[r->text_len] = '\0';
    }
    return TDM_OK;
}

/* Takes the final fields (finish reason, usage, timings, stop reason) of the last chunk m into
 * the call's result. TDM_ERESOURCE on out of memory. */
static int result_final(tdm_client_result_t *r, const Tandem__V1__GenerateChunk *m, bool first)
{
    r->finish_reason = finish_from_proto(m->finish_reason);
    if (m->usage) {
        r->usage.prompt_tokens = m->usage->prompt_tokens; /* the choices share the prompt */
        r->usage.completion_tokens =
            (first ? 0 : r->usage.completion_tokens) + m->usage->completion_tokens;
        r->usage.cached_prompt_tokens = m->usage->cached_prompt_tokens;
    }
    if (m->timings)
        timings_from_proto(m->timings, &r->timings);
    free(r->stop_reason);
    r->stop_reason = tdm_strdup(str_or_empty(m->stop_reason));
    return r->stop_reason ? TDM_OK : TDM_ERESOURCE;
}

/* The message's top logprobs (arrays of pointers) as the callback's arrays of structs: *tops
 * [m->n_top_logprobs] pointing into *entries; both NULL when there are none. The caller frees
 * both. TDM_ERESOURCE on out of memory. */
static int tops_from_proto(const Tandem__V1__GenerateChunk *m, tdm_client_token_top_t **tops,
                           tdm_client_top_logprob_t **entries)
{
    *tops = NULL;
    *entries = NULL;
    if (m->n_top_logprobs == 0)
        return TDM_OK;
    size_t n_entries = 0;
    for (size_t i = 0; i < m->n_top_logprobs; i++)
        n_entries += m->top_logprobs[i] ? m->top_logprobs[i]->n_entries : 0;
    *tops = calloc(m->n_top_logprobs, sizeof **tops);
    *entries = calloc(n_entries ? n_entries : 1, sizeof **entries);
    if (!*tops || !*entries) {
        free(*tops);
        free(*entries);
        return TDM_ERESOURCE;
    }
    size_t k = 0;
    for (size_t i = 0; i < m->n_top_logprobs; i++) {
        const Tandem__V1__TopLogprobs *tl = m->top_logprobs[i];
        (*tops)[i].entries = *entries + k;
        (*tops)[i].n_entries = tl ? tl->n_entries : 0;
        for (size_t j = 0; tl && j < tl->n_entries; j++, k++) {
            (*entries)[k].token_id = tl->entries[j]->token_id;
            (*entries)[k].logprob = tl->entries[j]->logprob;
            (*entries)[k].text = str_or_empty(tl->entries[j]->text);
        }
    }
    return TDM_OK;
}

/* Runs the call's on_chunk with m (the final fields from the result when last). Returns 0 to
 * go on, 1 when the callback asked to cancel, TDM_ERESOURCE on out of memory. */
static int run_on_chunk(tdm_client_t *c, client_call_t *call, const Tandem__V1__GenerateChunk *m,
                        const char *text, size_t text_len, bool last)
{
    const tdm_client_result_t *r = &call->result;
    tdm_client_token_top_t *tops;
    tdm_client_top_logprob_t *entries;
    if (tops_from_proto(m, &tops, &entries) != TDM_OK)
        return TDM_ERESOURCE;
    tdm_client_usage_t usage = r->usage;
    if (m->usage) { /* this choice's own (the result sums the choices of n > 1) */
        usage.prompt_tokens = m->usage->prompt_tokens;
        usage.completion_tokens = m->usage->completion_tokens;
        usage.cached_prompt_tokens = m->usage->cached_prompt_tokens;
    }
    tdm_client_timings_t timings = r->timings;
    tdm_client_chunk_t ch = {
        .call_id = call->id,
        .request_id = str_or_empty(m->request_id),
        .choice = m->choice,
        .index = m->index,
        .token_ids = m->token_ids,
        .n_tokens = m->n_token_ids,
        .text = text,
        .text_len = text_len,
        .logprobs = m->logprobs,
        .n_logprobs = m->n_logprobs,
        .top_logprobs = tops,
        .n_top_logprobs = m->n_top_logprobs,
        .token_texts = (const char *const *)m->token_texts,
        .n_token_texts = m->n_token_texts,
        .last = last,
        .finish_reason = last ? r->finish_reason : TDM_CLIENT_FINISH_NONE,
        .stop_reason = last ? r->stop_reason : "",
        .usage = last ? &usage : NULL,
        .timings = last ? &timings : NULL,
    };
    c->depth++;
    call->in_chunk_cb = true;
    int stop = call->on_chunk(call->user, &ch);
    call->in_chunk_cb = false;
    c->depth--;
    free(tops);
    free(entries);
    return stop != 0 ? 1 : 0;
}

/* Records a GenerateChunk into the call and runs on_chunk. Returns 0 to go on, 1 when the
 * callback asked to cancel, or a negative status (the call must end with it). */
static int deliver_chunk(tdm_client_t *c, client_call_t *call, const Tandem__V1__GenerateChunk *m)
{
    tdm_client_result_t *r = &call->result;
    const char *text = str_or_empty(m->text);
    size_t text_len = strlen(text);
    if (result_append(call, m, text_len) != TDM_OK)
        return TDM_ERESOURCE;
    r->n_chunks++;
    if (m->n_token_ids > 0 || text_len > 0) {
        double now = tdm_time_now();
        if (call->t_first == 0)
            call->t_first = now;
        call->t_last = now;
    }
    if (m->request_id && m->request_id[0] && (!r->request_id || !r->request_id[0])) {
        free(r->request_id);
        r->request_id = tdm_strdup(m->request_id);
        if (!r->request_id)
            return TDM_ERESOURCE;
    }
    bool last = m->finish_reason != TANDEM__V1__FINISH_REASON__FINISH_REASON_UNSPECIFIED;
    if (last && result_final(r, m, call->n_final++ == 0) != TDM_OK)
        return TDM_ERESOURCE;
    if (!call->on_chunk)
        return 0;
    return run_on_chunk(c, call, m, text, text_len, last);
}

/* Handles a GenerateChunk body for call: delivers it and ends the call when the callback
 * cancels or something fails. Returns true when the call is still running. */
static bool handle_chunk_body(tdm_client_t *c, client_call_t *call, const tdm_frame_t *f)
{
    Tandem__V1__GenerateChunk *m =
        (Tandem__V1__GenerateChunk *)tdm_frame_unpack(f, &tandem__v1__generate_chunk__descriptor);
    if (!m) {
        send_cancel(c, call);
        end_call(c, call, TDM_EINTERNAL,
                 "client: call %llu: a GenerateChunk from %s does not "
                 "decode",
                 (unsigned long long)call->id, c->endpoint);
        return false;
    }
    int rc = deliver_chunk(c, call, m);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    if (rc == 1) {
        send_cancel(c, call);
        end_call(c, call, TDM_ECANCELLED, "cancelled by the caller");
        return false;
    }
    if (rc < 0) {
        send_cancel(c, call);
        end_call(c, call, rc, "client: out of memory receiving a chunk");
        return false;
    }
    return true;
}

/* Fills *d from the ErrorDetail body of a refused call's END (left zero when it does not
 * decode: the message still tells). */
static void error_detail_read(const tdm_frame_t *f, tdm_client_error_detail_t *d)
{
    Tandem__V1__ErrorDetail *m =
        (Tandem__V1__ErrorDetail *)tdm_frame_unpack(f, &tandem__v1__error_detail__descriptor);
    if (!m)
        return;
    snprintf(d->field, sizeof d->field, "%s", str_or_empty(m->field));
    d->prompt_tokens = m->prompt_tokens;
    d->n_ctx = m->n_ctx;
    d->max_tokens_fit = m->max_tokens_fit;
    d->retry_after_s = m->retry_after_s;
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

/* Handles one received frame. */
static void dispatch(tdm_client_t *c, const tdm_frame_t *f)
{
    client_call_t *call = find_call(c, f->call_id);
    if (!call) {
        /* a call that ended (cancelled, deadline) or a stray frame */
        TDM_LOG_DEBUGF(c->log, NULL, "client: dropped a %s frame of call %llu (not running)",
                       tdm_net_kind_name(f->kind), (unsigned long long)f->call_id);
        return;
    }
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
        if (call->kind != CALL_GENERATE) {
            TDM_LOG_DEBUGF(c->log, NULL, "client: dropped a STREAM frame of unary call %llu",
                           (unsigned long long)f->call_id);
            return;
        }
        handle_chunk_body(c, call, f);
        return;
    }
    if (f->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
        TDM_LOG_DEBUGF(c->log, NULL, "client: dropped a %s frame of call %llu",
                       tdm_net_kind_name(f->kind), (unsigned long long)f->call_id);
        return;
    }
    if (f->status != TDM_OK) {
        if (call->kind == CALL_GENERATE && f->body && f->body_len > 0)
            error_detail_read(f, &call->result.error);
        end_call(c, call, f->status, "%s", f->message[0] ? f->message : tdm_strerror(f->status));
        return;
    }
    if (call->kind == CALL_GENERATE) {
        /* stream=false: the END carries the one chunk; stream=true: no body */
        if (((!call->stream && call->n <= 1) || (f->body && f->body_len > 0)) &&
            !handle_chunk_body(c, call, f))
            return;
        end_call(c, call, TDM_OK, "%s", "");
        return;
    }
    call->resp = tdm_frame_unpack(f, call->resp_desc);
    if (!call->resp) {
        end_call(c, call, TDM_EINTERNAL, "client: the %s response from %s does not decode",
                 tdm_net_method_name(call->method), c->endpoint);
        return;
    }
    end_call(c, call, TDM_OK, "%s", "");
}

/* Ends the calls whose deadline is at or before now. */
static void expire(tdm_client_t *c, double now)
{
    for (size_t i = 0; i < c->n_calls;) {
        client_call_t *call = c->calls[i];
        if (call->deadline > 0 && call->deadline <= now) {
            send_cancel(c, call);
            end_call(c, call, TDM_EDEADLINE,
                     "deadline exceeded: the %s call to %s did not end within %.3g s",
                     tdm_net_method_name(call->method), c->endpoint,
                     call->deadline - call->t_start);
            continue; /* end_call removed it: the same index holds the next call */
        }
        i++;
    }
}

/* Milliseconds until the nearest deadline (>= 0), or -1 when no call has one. */
static long ms_to_nearest_deadline(const tdm_client_t *c, double now)
{
    double nearest = 0;
    for (size_t i = 0; i < c->n_calls; i++) {
        double d = c->calls[i]->deadline;
        if (d > 0 && (nearest == 0 || d < nearest))
            nearest = d;
    }
    if (nearest == 0)
        return -1;
    double ms = ceil((nearest - now) * 1000.0);
    return ms < 0 ? 0 : ms > 1e9 ? 1000000000L : (long)ms;
}

/* Receives and dispatches the frames waiting (CLIENT_MAX_FRAMES_PER_POLL at most). Returns 0,
 * or the receive error after ending every call with it. */
static int receive_frames(tdm_client_t *c)
{
    for (int i = 0; i < CLIENT_MAX_FRAMES_PER_POLL; i++) {
        int rc = tdm_sock_recv(c->sock, &c->frame, 0);
        if (rc == TDM_EDEADLINE || rc == TDM_ECANCELLED)
            break; /* nothing more now; or interrupted (looked at by the caller) */
        if (rc != TDM_OK) {
            tdm_error_set(&c->err, rc, "client: receiving from %s failed: %s", c->endpoint,
                          tdm_sock_errmsg(c->sock));
            tdm_frame_clear(&c->frame);
            end_all(c, rc, c->err.msg);
            return rc;
        }
        dispatch(c, &c->frame);
        tdm_frame_clear(&c->frame);
    }
    return TDM_OK;
}

/* The connection to the router was lost: what the router sent before it went is handled,
 * then every call still running ends with UNAVAILABLE (the router that had them is gone; a
 * restarted one does not know them). Later calls go out over the socket's reconnection: a
 * call id is never reused and the table is empty, so nothing of the old connection remains. */
static void connection_lost(tdm_client_t *c)
{
    c->n_lost++;
    int rc = receive_frames(c);
    if (rc != TDM_OK || c->n_calls == 0)
        return;
    TDM_LOG_DEBUGF(c->log, NULL, "client: connection to %s lost; ending %zu call(s)", c->endpoint,
                   c->n_calls);
    char why[TDM_ERRMSG_MAX];
    snprintf(why, sizeof why,
             "router connection lost: %s closed the connection (router stopped or restarted); "
             "the call may or may not have run",
             c->endpoint);
    end_all(c, TDM_EUNAVAILABLE, why);
}

static int poll_impl(tdm_client_t *c, int timeout_ms, int fd)
{
    uint64_t ended0 = c->n_ended;
    if (cancel_requested(c)) {
        end_all(c, TDM_ECANCELLED, "cancelled (interrupted)");
        return TDM_ECANCELLED;
    }
    long wait = timeout_ms;
    long to_deadline = ms_to_nearest_deadline(c, tdm_time_now());
    if (to_deadline >= 0 && (wait < 0 || to_deadline < wait))
        wait = to_deadline;
    zmq_pollitem_t items[3] = {{tdm_sock_zsock(c->sock), 0, ZMQ_POLLIN, 0}};
    int n_items = 1;
    if (c->monitor)
        items[n_items++] = (zmq_pollitem_t){c->monitor, 0, ZMQ_POLLIN, 0};
    if (fd >= 0)
        items[n_items++] = (zmq_pollitem_t){NULL, fd, ZMQ_POLLIN, 0};
    int n = zmq_poll(items, n_items, wait);
    if (n < 0 && errno != EINTR) {
        int e = errno;
        int status = e == ETERM ? TDM_ECANCELLED : TDM_EINTERNAL;
        tdm_error_set(&c->err, status, "client: waiting on %s failed: %s", c->endpoint,
                      zmq_strerror(e));
        end_all(c, status, c->err.msg);
        return status;
    }
    if (n > 0 && (items[0].revents & ZMQ_POLLIN)) {
        int rc = receive_frames(c);
        if (rc != TDM_OK)
            return rc;
    }
    if (monitor_read(c) > 0)
        connection_lost(c);
    if (cancel_requested(c)) {
        end_all(c, TDM_ECANCELLED, "cancelled (interrupted)");
        return TDM_ECANCELLED;
    }
    expire(c, tdm_time_now());
    return (int)(c->n_ended - ended0);
}

int tdm_client_poll(tdm_client_t *c, int timeout_ms)
{
    return tdm_client_poll_fd(c, timeout_ms, -1);
}

int tdm_client_poll_fd(tdm_client_t *c, int timeout_ms, int fd)
{
    if (c->depth > 0)
        return tdm_error_set(&c->err, TDM_EPRECONDITION,
                             "client: tdm_client_poll called from a callback");
    return poll_impl(c, timeout_ms, fd);
}

int tdm_client_generate_cancel(tdm_client_t *c, uint64_t call_id)
{
    return tdm_client_cancel(c, call_id);
}

int tdm_client_cancel(tdm_client_t *c, uint64_t call_id)
{
    client_call_t *call = find_call(c, call_id);
    if (!call || call->sync)
        return tdm_error_set(&c->err, TDM_ENOTFOUND, "client: no running call %llu",
                             (unsigned long long)call_id);
    if (call->in_chunk_cb)
        return tdm_error_set(&c->err, TDM_EPRECONDITION,
                             "client: call %llu cannot be cancelled from its own on_chunk "
                             "(return nonzero instead)",
                             (unsigned long long)call_id);
    send_cancel(c, call);
    end_call(c, call, TDM_ECANCELLED, "cancelled by the caller");
    return TDM_OK;
}

/* Polls until the sync call has ended. */
static void wait_call(tdm_client_t *c, client_call_t *call)
{
    while (!call->ended) {
        int rc = poll_impl(c, -1, -1);
        if (rc < 0 && !call->ended) /* not expected: a failed poll ends every call */
            end_call(c, call, rc, "%s", c->err.msg);
    }
}

/* ---- blocking calls ---- */

int tdm_client_generate(tdm_client_t *c, const tdm_client_request_t *req,
                        tdm_client_chunk_fn on_chunk, void *user, tdm_client_result_t *result)
{
    tdm_client_result_init(result);
    int rc;
    if (c->depth > 0) {
        rc = tdm_error_set(&c->err, TDM_EPRECONDITION,
                           "client: tdm_client_generate called from a callback");
        goto out_fail;
    }
    client_call_t *call;
    rc = generate_start(c, req, on_chunk, NULL, user, true, &call);
    if (rc != TDM_OK)
        goto out_fail;
    wait_call(c, call);
    *result = call->result; /* moves the owned buffers out */
    tdm_client_result_init(&call->result);
    call_free(call);
    if (result->status != TDM_OK)
        tdm_error_set(&c->err, result->status, "%s", result->message);
    if (!result->text)
        result->text = tdm_strdup("");
    return result->status;

out_fail:
    result->status = rc;
    snprintf(result->message, sizeof result->message, "%s", c->err.msg);
    result->finish_reason = TDM_CLIENT_FINISH_ERROR;
    result->text = tdm_strdup("");
    result->request_id = tdm_strdup("");
    result->stop_reason = tdm_strdup("");
    return rc;
}

int tdm_client_call_start(tdm_client_t *c, int method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, double timeout_s,
                          tdm_client_unary_fn on_done, void *user, uint64_t *call_id)
{
    tdm_error_clear(&c->err);
    if (!on_done || !req || !resp_desc)
        return tdm_error_set(&c->err, TDM_EINVALID, "client: on_done, req or resp_desc is NULL");
    if (method == TANDEM__V1__METHOD__METHOD_GENERATE)
        return tdm_error_set(&c->err, TDM_EINVALID,
                             "client: GENERATE streams; use tdm_client_generate_start");
    if (isnan(timeout_s))
        return tdm_error_set(&c->err, TDM_EINVALID, "client: timeout_s is NaN");
    client_call_t *call = call_new(c, method, CALL_UNARY);
    if (!call)
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    call->resp_desc = resp_desc;
    call->on_unary = on_done;
    call->user = user;
    uint64_t id = call->id;
    int rc = call_send(c, call, req, timeout_s);
    if (rc == TDM_OK && call_id)
        *call_id = id;
    return rc;
}

/* A blocking unary call: *resp (caller frees with protobuf_c_message_free_unpacked) on 0. */
static int unary_call(tdm_client_t *c, int method, const ProtobufCMessage *req,
                      const ProtobufCMessageDescriptor *resp_desc, double timeout_s,
                      ProtobufCMessage **resp)
{
    tdm_error_clear(&c->err);
    *resp = NULL;
    if (c->depth > 0)
        return tdm_error_set(&c->err, TDM_EPRECONDITION,
                             "client: a blocking %s call from a callback",
                             tdm_net_method_name(method));
    if (isnan(timeout_s))
        return tdm_error_set(&c->err, TDM_EINVALID, "client: timeout_s is NaN");
    client_call_t *call = call_new(c, method, CALL_UNARY);
    if (!call)
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    call->sync = true;
    call->resp_desc = resp_desc;
    int rc = call_send(c, call, req, timeout_s);
    if (rc != TDM_OK)
        return rc;
    wait_call(c, call);
    rc = call->result.status;
    if (rc == TDM_OK) {
        *resp = call->resp;
        call->resp = NULL;
    } else {
        tdm_error_set(&c->err, rc, "%s: %s", tdm_net_method_name(method), call->result.message);
    }
    call_free(call);
    return rc;
}

int tdm_client_health(tdm_client_t *c, double timeout_s, tdm_client_health_t *out)
{
    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp;
    int rc = unary_call(c, TANDEM__V1__METHOD__METHOD_HEALTH, &req.base,
                        &tandem__v1__health_response__descriptor, timeout_s, &resp);
    if (rc != TDM_OK)
        return rc;
    const Tandem__V1__HealthResponse *h = (const Tandem__V1__HealthResponse *)resp;
    memset(out, 0, sizeof *out);
    out->live = h->live;
    out->ready = h->ready;
    snprintf(out->version, sizeof out->version, "%s", str_or_empty(h->version));
    protobuf_c_message_free_unpacked(resp, NULL);
    return TDM_OK;
}

void tdm_client_models_clear(tdm_client_models_t *m)
{
    if (!m)
        return;
    for (size_t i = 0; i < m->n_models; i++) {
        free(m->models[i].name);
        free(m->models[i].chat_template);
    }
    free(m->models);
    m->models = NULL;
    m->n_models = 0;
}

int tdm_client_models(tdm_client_t *c, double timeout_s, tdm_client_models_t *out)
{
    memset(out, 0, sizeof *out);
    Tandem__V1__ModelsRequest req = TANDEM__V1__MODELS_REQUEST__INIT;
    ProtobufCMessage *resp;
    int rc = unary_call(c, TANDEM__V1__METHOD__METHOD_MODELS, &req.base,
                        &tandem__v1__models_response__descriptor, timeout_s, &resp);
    if (rc != TDM_OK)
        return rc;
    const Tandem__V1__ModelsResponse *m = (const Tandem__V1__ModelsResponse *)resp;
    if (m->n_models > 0) {
        out->models = calloc(m->n_models, sizeof *out->models);
        if (!out->models)
            goto out_oom;
    }
    for (size_t i = 0; i < m->n_models; i++) {
        const Tandem__V1__ModelInfo *mi = m->models[i];
        tdm_client_model_t *dst = &out->models[i];
        out->n_models = i + 1;
        dst->name = tdm_strdup(str_or_empty(mi->name));
        dst->chat_template = tdm_strdup(str_or_empty(mi->chat_template));
        if (!dst->name || !dst->chat_template)
            goto out_oom;
        dst->fingerprint = mi->fingerprint;
        dst->n_ctx = mi->n_ctx;
        dst->n_vocab = mi->n_vocab;
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    return TDM_OK;

out_oom:
    tdm_client_models_clear(out);
    protobuf_c_message_free_unpacked(resp, NULL);
    return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
}

void tdm_client_cluster_status_clear(tdm_client_cluster_status_t *s)
{
    if (!s)
        return;
    for (size_t i = 0; i < s->n_nodes; i++) {
        free(s->nodes[i].node_id);
        free(s->nodes[i].role);
        free(s->nodes[i].device);
        free(s->nodes[i].refused_reason);
        free(s->nodes[i].host_id);
        free(s->nodes[i].gpu_uuid);
    }
    free(s->nodes);
    for (size_t i = 0; i < s->n_kv_routes; i++) {
        free(s->kv_routes[i].prefill_node_id);
        free(s->kv_routes[i].decode_node_id);
        free(s->kv_routes[i].transport);
    }
    free(s->kv_routes);
    for (size_t i = 0; i < s->n_refused; i++) {
        free(s->refused[i].node_id);
        free(s->refused[i].reason);
    }
    free(s->refused);
    free(s->version);
    free(s->model);
    memset(s, 0, sizeof *s);
}

/* Copies one NodeStatus into *d. TDM_ERESOURCE on out of memory (what was copied stays in *d
 * for tdm_client_cluster_status_clear). */
static int node_status_from_proto(const Tandem__V1__NodeStatus *ns, tdm_client_node_status_t *d)
{
    d->node_id = tdm_strdup(str_or_empty(ns->node_id));
    d->role = tdm_strdup(str_or_empty(ns->role));
    d->device = tdm_strdup(str_or_empty(ns->device));
    d->refused_reason = tdm_strdup(str_or_empty(ns->refused_reason));
    d->host_id = tdm_strdup(str_or_empty(ns->host_id));
    d->gpu_uuid = tdm_strdup(str_or_empty(ns->gpu_uuid));
    if (!d->node_id || !d->role || !d->device || !d->refused_reason || !d->host_id || !d->gpu_uuid)
        return TDM_ERESOURCE;
    d->refused_age_s = ns->refused_age_s;
    d->instance_id = ns->instance_id;
    d->up = ns->up;
    d->suspect = ns->suspect;
    static const Tandem__V1__NodeLoad no_load = TANDEM__V1__NODE_LOAD__INIT;
    const Tandem__V1__NodeLoad *ld = ns->load ? ns->load : &no_load;
    d->kv_blocks_total = ns->kv_blocks_total;
    d->kv_blocks_used = ld->kv_blocks_used;
    d->kv_blocks_cached = ld->kv_blocks_cached;
    d->reserved_blocks = ns->reserved_blocks;
    d->running = ld->running;
    d->waiting = ld->waiting;
    d->batch_size = ld->batch_size;
    d->queued_prefill_tokens = ld->queued_prefill_tokens;
    d->prefix_queries = ld->prefix_queries;
    d->prefix_hits = ld->prefix_hits;
    d->step_time_s = ld->step_s;
    d->last_heartbeat_age_s = ns->last_heartbeat_age_s;
    return TDM_OK;
}

/* Copies the KV routes of m into *out. TDM_ERESOURCE on out of memory (partial). */
static int kv_routes_from_proto(const Tandem__V1__ClusterStatus *m,
                                tdm_client_cluster_status_t *out)
{
    if (m->n_kv_routes > 0 && !(out->kv_routes = calloc(m->n_kv_routes, sizeof *out->kv_routes)))
        return TDM_ERESOURCE;
    for (size_t i = 0; i < m->n_kv_routes; i++) {
        tdm_client_kv_route_t *d = &out->kv_routes[i];
        out->n_kv_routes = i + 1;
        d->prefill_node_id = tdm_strdup(str_or_empty(m->kv_routes[i]->prefill_node_id));
        d->decode_node_id = tdm_strdup(str_or_empty(m->kv_routes[i]->decode_node_id));
        d->transport = tdm_strdup(str_or_empty(m->kv_routes[i]->transport));
        if (!d->prefill_node_id || !d->decode_node_id || !d->transport)
            return TDM_ERESOURCE;
    }
    return TDM_OK;
}

/* Copies the nodes, the refused registrations and the KV routes of m into *out. TDM_ERESOURCE on
 * out of memory (partial; the caller clears). */
static int cluster_lists_from_proto(const Tandem__V1__ClusterStatus *m,
                                    tdm_client_cluster_status_t *out)
{
    if (m->n_nodes > 0 && !(out->nodes = calloc(m->n_nodes, sizeof *out->nodes)))
        return TDM_ERESOURCE;
    for (size_t i = 0; i < m->n_nodes; i++) {
        out->n_nodes = i + 1;
        if (node_status_from_proto(m->nodes[i], &out->nodes[i]) != TDM_OK)
            return TDM_ERESOURCE;
    }
    if (m->n_refused > 0 && !(out->refused = calloc(m->n_refused, sizeof *out->refused)))
        return TDM_ERESOURCE;
    for (size_t i = 0; i < m->n_refused; i++) {
        tdm_client_refused_t *d = &out->refused[i];
        out->n_refused = i + 1;
        d->node_id = tdm_strdup(str_or_empty(m->refused[i]->node_id));
        d->reason = tdm_strdup(str_or_empty(m->refused[i]->reason));
        if (!d->node_id || !d->reason)
            return TDM_ERESOURCE;
        d->age_s = m->refused[i]->age_s;
        d->count = m->refused[i]->count;
    }
    return kv_routes_from_proto(m, out);
}

int tdm_client_status(tdm_client_t *c, double timeout_s, tdm_client_cluster_status_t *out)
{
    memset(out, 0, sizeof *out);
    Tandem__V1__StatusRequest req = TANDEM__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *resp;
    int rc = unary_call(c, TANDEM__V1__METHOD__METHOD_STATUS, &req.base,
                        &tandem__v1__cluster_status__descriptor, timeout_s, &resp);
    if (rc != TDM_OK)
        return rc;
    const Tandem__V1__ClusterStatus *m = (const Tandem__V1__ClusterStatus *)resp;
    out->version = tdm_strdup(str_or_empty(m->version));
    out->model = tdm_strdup(str_or_empty(m->model));
    out->requests_running = m->requests_running;
    out->requests_queued = m->requests_queued;
    out->requests_total = m->requests_total;
    out->router_instance_id = m->router_instance_id;
    rc = out->version && out->model ? cluster_lists_from_proto(m, out) : TDM_ERESOURCE;
    protobuf_c_message_free_unpacked(resp, NULL);
    if (rc != TDM_OK) {
        tdm_client_cluster_status_clear(out);
        return tdm_error_set(&c->err, TDM_ERESOURCE, "client: out of memory");
    }
    return TDM_OK;
}

const tdm_client_node_status_t *tdm_client_status_find_node(const tdm_client_cluster_status_t *s,
                                                            const char *node_id)
{
    for (size_t i = 0; i < s->n_nodes; i++)
        if (strcmp(s->nodes[i].node_id, node_id) == 0)
            return &s->nodes[i];
    return NULL;
}
