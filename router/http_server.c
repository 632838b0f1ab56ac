/* http_server.c - the HTTP gateway's server: libmicrohttpd with a bounded thread pool,
 * framing checks, API keys, replies (OpenAI-shaped errors from the status table), the
 * per-request state's life, construction and shutdown. Routing and the endpoints are
 * http_endpoints.c's, generation http_generate.c's; CORS and request ids come from http_conv.c.
 *
 * A pool of router.http_threads threads serves every connection (epoll) that the front door
 * (http_accept.c, which enforces the connection limits and deadlines) hands over once its
 * headers are in, tells the front door what each connection does (request body, answer, idle)
 * and trims the heap when no request is in flight after large bodies. So no handler
 * blocks on the router: a generate request whose next event has not come (its first, which
 * decides the HTTP status: a refused request is a 4xx JSON error, not a 200 stream; the END
 * after a stream=false answer; a stream's next chunk) parks its connection
 * (MHD_suspend_connection, through gw_call_take) and the gateway thread resumes it when the
 * event is queued. A client that hangs up while parked is resumed too (the gateway thread
 * watches parked sockets) and gets its request cancelled at once (CANCEL to the router, which
 * frees its KV blocks); the completion callback cancels whatever is still running when a
 * connection ends any other way. Only the short unary calls (MODELS, HEALTH, METRICS) wait on
 * a pool thread, for at most HTTP_UNARY_TIMEOUT_S.
 * Structure is never re-parsed: a refused request's OpenAI `param` comes from the END's
 * ErrorDetail (http_generate.c), and /metrics renders the METRICS message
 * (tdm_proto_metrics_text).
 */
#define _GNU_SOURCE /* strcasestr-free: strncasecmp, getaddrinfo flags */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <netdb.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>

#include <microhttpd.h>

#include "http_gateway.h"
#include "http_openai.h"
#include "http_json.h"
#include "http_conv.h"
#include "dashboard.h"
#include "http_metrics.h"
#include "http_server.h"
#include "http_responses.h"
#include "tandem/limits.h"

#define HTTP_DISCARD_MAX (64u << 20) /* bytes of an oversized body read before closing */

/* Request body bytes read after which the heap is trimmed when no request is in flight: the
 * buffers of a burst of large bodies go back to the system (malloc_trim) instead of staying
 * in the allocator's arenas, one per pool thread. Small (1 MiB), because a trim in a pause of
 * a burst (every client between two requests) starts the count again: the bodies after it must
 * reach the mark for the trim at the burst's end, and one token-array body of under 1 MiB
 * parses into ~15 MB of JSON values, while 8 MiB of them left ~40 MB per arena untrimmed. */
#define HTTP_TRIM_BYTES (1u << 20)

/* What a closed connection counts toward HTTP_TRIM_BYTES: libmicrohttpd's per-connection memory
 * pool (its default, 32 KiB), so that the memory of thousands of keep-alive connections that
 * closed without sending a body (bench/http_attack.py: 33 KB each) is given back too. */
#define HTTP_TRIM_CONN_BYTES (32u << 10)

/* Longest wait at shutdown for connections to write the answers of their ended calls, s. */
#define HTTP_DRAIN_S 5

/* Per connection (MHD's socket context): the request it serves now, so that every reply finds
 * its request id from the connection alone. Requests on a connection come one at a time. */
typedef struct http_conn {
    tdm_http_t *h;
    http_req_t *req;
    int fd;       /* its socket, as the front door (http_accept.c) knows it */
    uint32_t gen; /* the front door's generation of it */
} http_conn_t;

/* The connection's socket context; NULL only when its allocation failed. */
static http_conn_t *conn_ctx(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    return ci ? ci->socket_context : NULL;
}

/* Tells the front door what c does now (its deadlines and eviction depend on it). */
static void conn_phase(struct MHD_Connection *c, http_acc_phase_t phase)
{
    http_conn_t *hc = conn_ctx(c);
    if (hc)
        http_acc_phase(hc->h->acc, hc->fd, hc->gen, phase);
}

/* The request c serves now, or NULL. */
static http_req_t *conn_req(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    http_conn_t *hc = ci ? ci->socket_context : NULL;
    return hc ? hc->req : NULL;
}

/* Adds X-Request-Id (made now when the request has none yet) and the CORS headers. */
void http_add_conv_headers(struct MHD_Connection *c, struct MHD_Response *resp)
{
    http_req_t *r = conn_req(c);
    if (!r)
        return;
    if (!r->rid[0])
        http_request_id_new(r->rid, sizeof r->rid);
    http_conv_headers(r->h->cfg, c, resp, r->rid);
}

/* ---- errors and responses ---- */

/* Replies with body. A 401 challenges Bearer (RFC 6750, for API clients) and Basic, so that a
 * browser opening the dashboard asks for a user name and password and then sends them (the
 * API key as the password, see http_state_key_ok) on the page's own fetches too. A 429 or 503
 * carries Retry-After: retry_after_s (the router's ErrorDetail.retry_after_s), at least 1.
 * Every reply has X-Request-Id and, for an allowed Origin, the CORS headers. */
static enum MHD_Result reply_retry(struct MHD_Connection *c, unsigned status, const char *ctype,
                                   const void *body, size_t len, uint32_t retry_after_s)
{
    struct MHD_Response *resp =
        MHD_create_response_from_buffer(len, (void *)body, MHD_RESPMEM_MUST_COPY);
    if (!resp)
        return MHD_NO;
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, ctype);
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (status == 405)
        MHD_add_response_header(resp, MHD_HTTP_HEADER_ALLOW, "GET, POST, OPTIONS");
    if (status == 401) {
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer realm=\"tandem\"");
        MHD_add_response_header(resp, MHD_HTTP_HEADER_WWW_AUTHENTICATE,
                                "Basic realm=\"tandem\", charset=\"UTF-8\"");
    }
    if (status == 429 || status == 503) {
        char secs[16];
        snprintf(secs, sizeof secs, "%" PRIu32, retry_after_s ? retry_after_s : 1);
        MHD_add_response_header(resp, MHD_HTTP_HEADER_RETRY_AFTER, secs);
    }
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    const http_conn_t *hc = ci ? ci->socket_context : NULL;
    if (hc) /* none only when its allocation failed */
        http_counters_response(hc->h->counters, status);
    conn_phase(c, HTTP_ACC_BUSY); /* before the answer: the front door no longer writes one */
    http_add_conv_headers(c, resp);
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

enum MHD_Result http_reply(struct MHD_Connection *c, unsigned status, const char *ctype,
                           const void *body, size_t len)
{
    return reply_retry(c, status, ctype, body, len, 0);
}

/* Replies with v as JSON (consumed); a 429 or 503 says Retry-After: retry_after_s (at least
 * 1). */
enum MHD_Result http_reply_json_retry(struct MHD_Connection *c, unsigned status, json_t *v,
                                      uint32_t retry_after_s)
{
    static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                              "\"server_error\",\"param\":null,\"code\":\"internal\"}}\n";
    if (!v)
        return http_reply(c, 500, "application/json", oom, sizeof oom - 1);
    tdm_buf_t b = TDM_BUF_INIT;
    int rc = http_json_append(&b, v);
    json_decref(v);
    if (rc == TDM_OK)
        rc = tdm_buf_append(&b, "\n", 1);
    enum MHD_Result ret =
        rc == TDM_OK ? reply_retry(c, status, "application/json", b.data, b.len, retry_after_s)
                     : MHD_NO;
    tdm_buf_free(&b);
    return ret;
}

enum MHD_Result http_reply_json(struct MHD_Connection *c, unsigned status, json_t *v)
{
    return http_reply_json_retry(c, status, v, 0);
}

/* Replies with OpenAI's error body for status (a tdm status) under the HTTP status the status
 * table gives it (a refusal of the HTTP request itself, wrong method or too large, under
 * http_status: 405, 413); code (NULL: the table's) and param (NULL: none) as given. */
static enum MHD_Result reply_error_as(struct MHD_Connection *c, unsigned http_status, int status,
                                      const char *code, const char *param, const char *fmt,
                                      va_list ap) __attribute__((format(printf, 6, 0)));
static enum MHD_Result reply_error_as(struct MHD_Connection *c, unsigned http_status, int status,
                                      const char *code, const char *param, const char *fmt,
                                      va_list ap)
{
    char msg[TDM_ERRMSG_MAX + 64];
    vsnprintf(msg, sizeof msg, fmt, ap);
    return http_reply_json(c, http_status ? http_status : tdm_status_info(status)->http_status,
                           http_error_json(status, code, param, msg));
}

enum MHD_Result http_reply_error(struct MHD_Connection *c, int status, const char *code,
                                 const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
enum MHD_Result http_reply_error(struct MHD_Connection *c, int status, const char *code,
                                 const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    enum MHD_Result ret = reply_error_as(c, 0, status, code, param, fmt, ap);
    va_end(ap);
    return ret;
}

enum MHD_Result http_reply_bad_http(struct MHD_Connection *c, unsigned http_status,
                                    const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
enum MHD_Result http_reply_bad_http(struct MHD_Connection *c, unsigned http_status,
                                    const char *code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    enum MHD_Result ret = reply_error_as(c, http_status, TDM_EINVALID, code, NULL, fmt, ap);
    va_end(ap);
    return ret;
}

/* ---- helpers ---- */

/* The API key of "Authorization: Bearer KEY", or NULL. */
static const char *bearer_key(struct MHD_Connection *c)
{
    const char *a = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!a || strncasecmp(a, "Bearer ", 7) != 0)
        return NULL;
    a += 7;
    while (*a == ' ')
        a++;
    return *a ? a : NULL;
}

/* Checks the API key of a /v1 request with tdm_config_api_key_ok, the check the router makes
 * of native calls (the gateway's own calls carry the first configured key). Returns true when
 * the request may go on; otherwise a 401 has been queued and *ret is its result. */
static void park_conn(void *arg)
{
    MHD_suspend_connection(arg);
}

static void unpark_conn(void *arg)
{
    MHD_resume_connection(arg);
}

gw_parker_t http_parker(struct MHD_Connection *c)
{
    gw_parker_t pk = {park_conn, unpark_conn, c};
    return pk;
}

bool http_client_gone(int fd)
{
    if (fd < 0)
        return false;
    struct pollfd p = {fd, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

bool http_check_key(tdm_http_t *h, struct MHD_Connection *c, enum MHD_Result *ret)
{
    if (h->cfg->router.n_api_keys == 0)
        return true; /* no keys: whatever Authorization says (OpenAI clients always send one) */
    const char *key = bearer_key(c);
    if (!key) {
        *ret =
            http_reply_error(c, TDM_EUNAUTHENTICATED, NULL, NULL,
                             "an API key is required: send the header 'Authorization: Bearer KEY'");
        return false;
    }
    /* one longer than any key can be is simply not one of them */
    if (strlen(key) >= TDM_NET_API_KEY_MAX || !tdm_config_api_key_ok(&h->cfg->router, key)) {
        *ret = http_reply_error(c, TDM_EUNAUTHENTICATED, NULL, NULL, "the API key is not accepted");
        return false;
    }
    return true;
}

/* Whether the cluster-state endpoints (/, /api/status, /api/capacity, /metrics) need an API
 * key: router.api_keys is set and router.public_metrics is not. */
static bool state_needs_key(const tdm_http_t *h)
{
    return h->cfg->router.n_api_keys > 0 && !h->cfg->router.public_metrics;
}

/* The password of "Authorization: Basic ..." copied into buf (cap bytes), or NULL when there is
 * none or it does not fit. */
static const char *basic_password(struct MHD_Connection *c, char *buf, size_t cap)
{
    char *pass = NULL;
    /* deprecated from 0.9.77 on for ..._password3, which older releases (Debian 12's 0.9.75)
     * lack; the old call stays in the library */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
    char *user = MHD_basic_auth_get_username_password(c, &pass);
#pragma GCC diagnostic pop
    const char *out = NULL;
    if (pass && strlen(pass) < cap) {
        snprintf(buf, cap, "%s", pass);
        out = buf;
    }
    if (pass)
        MHD_free(pass);
    if (user)
        MHD_free(user);
    return out;
}

/* Whether a request may see the cluster's state: no key is needed (state_needs_key), or it
 * carries one that passes tdm_config_api_key_ok, the check the router applies to /v1 calls,
 * as "Authorization: Bearer KEY" or as the password of HTTP Basic (what a browser sends after
 * asking; the user name is ignored). *missing (may be NULL) tells a request with no key. */
bool http_state_key_ok(const tdm_http_t *h, struct MHD_Connection *c, bool *missing)
{
    if (missing)
        *missing = false;
    if (!state_needs_key(h))
        return true;
    char buf[TDM_NET_API_KEY_MAX];
    const char *key = bearer_key(c);
    if (!key)
        key = basic_password(c, buf, sizeof buf);
    if (!key) {
        if (missing)
            *missing = true;
        return false;
    }
    return strlen(key) < TDM_NET_API_KEY_MAX && tdm_config_api_key_ok(&h->cfg->router, key);
}

/* http_state_key_ok, or a 401 queued with *ret its result (false). */
bool http_check_state_key(tdm_http_t *h, struct MHD_Connection *c, enum MHD_Result *ret)
{
    bool missing;
    if (http_state_key_ok(h, c, &missing))
        return true;
    *ret =
        missing
            ? http_reply_error(c, TDM_EUNAUTHENTICATED, NULL, NULL,
                               "an API key is required: send the header 'Authorization: Bearer "
                               "KEY' (a browser: the key as the password)")
            : http_reply_error(c, TDM_EUNAUTHENTICATED, NULL, NULL, "the API key is not accepted");
    return false;
}

/* The router's MODELS answer into *mr (the caller frees it with
 * protobuf_c_message_free_unpacked). Returns 0 or the call's status. */
static int models_fetch(tdm_http_t *h, Tandem__V1__ModelsResponse **mr, tdm_error_t *err)
{
    Tandem__V1__ModelsRequest req = TANDEM__V1__MODELS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_MODELS, &req.base,
                      &tandem__v1__models_response__descriptor, HTTP_UNARY_TIMEOUT_S, &resp, err);
    *mr = (Tandem__V1__ModelsResponse *)resp;
    return rc;
}

/* The served model (MODELS, cached after the first success). Returns 0 or the call's status. */
int http_model_get(tdm_http_t *h, http_model_t *m, tdm_error_t *err)
{
    pthread_mutex_lock(&h->mu);
    bool have = h->have_model;
    if (have)
        *m = h->model;
    pthread_mutex_unlock(&h->mu);
    if (have)
        return TDM_OK;
    Tandem__V1__ModelsResponse *mr;
    int rc = models_fetch(h, &mr, err);
    if (rc != TDM_OK)
        return rc;
    if (mr->n_models == 0) {
        protobuf_c_message_free_unpacked(&mr->base, NULL);
        return tdm_error_set(err, TDM_EINTERNAL, "the router lists no model");
    }
    http_model_from_proto(mr->models[0], m);
    protobuf_c_message_free_unpacked(&mr->base, NULL);
    pthread_mutex_lock(&h->mu);
    h->model = *m;
    h->have_model = true;
    pthread_mutex_unlock(&h->mu);
    return TDM_OK;
}

int http_models_all(tdm_http_t *h, http_model_t *out, size_t cap, size_t *n, tdm_error_t *err)
{
    *n = 0;
    Tandem__V1__ModelsResponse *mr;
    int rc = models_fetch(h, &mr, err);
    if (rc != TDM_OK)
        return rc;
    for (size_t i = 0; i < mr->n_models && *n < cap; i++)
        http_model_from_proto(mr->models[i], &out[(*n)++]);
    protobuf_c_message_free_unpacked(&mr->base, NULL);
    return TDM_OK;
}

int http_model_named(tdm_http_t *h, const char *name, http_model_t *m, tdm_error_t *err)
{
    Tandem__V1__ModelsResponse *mr;
    int rc = models_fetch(h, &mr, err);
    if (rc != TDM_OK)
        return rc;
    rc =
        tdm_error_set_field(err, TDM_ENOTFOUND, "model", "model '%.256s' is not served here", name);
    for (size_t i = 0; i < mr->n_models && rc != TDM_OK; i++) {
        const Tandem__V1__ModelInfo *mi = mr->models[i];
        bool named = strcmp(mi->name, name) == 0;
        for (size_t j = 0; j < mi->n_aliases && !named; j++)
            named = strcmp(mi->aliases[j], name) == 0;
        if (named) {
            http_model_from_proto(mi, m);
            rc = TDM_OK;
            tdm_error_clear(err);
        }
    }
    protobuf_c_message_free_unpacked(&mr->base, NULL);
    return rc;
}

int http_node_model(tdm_http_t *h, const char *id, char *buf, size_t cap, tdm_error_t *err)
{
    Tandem__V1__StatusRequest req = TANDEM__V1__STATUS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_STATUS, &req.base,
                      &tandem__v1__cluster_status__descriptor, HTTP_UNARY_TIMEOUT_S, &resp, err);
    if (rc != TDM_OK)
        return rc;
    const Tandem__V1__ClusterStatus *cs = (const Tandem__V1__ClusterStatus *)resp;
    rc = tdm_error_set_field(err, TDM_ENOTFOUND, "node", "node '%.64s' is not in the cluster", id);
    for (size_t i = 0; i < cs->n_nodes && rc != TDM_OK; i++)
        if (strcmp(cs->nodes[i]->node_id, id) == 0) {
            snprintf(buf, cap, "%s", cs->nodes[i]->model);
            rc = TDM_OK;
            tdm_error_clear(err);
        }
    protobuf_c_message_free_unpacked(resp, NULL);
    return rc;
}

/* Checks the body's framing before any of it is read (libmicrohttpd reads a body of an
 * unknown Transfer-Encoding until the connection closes): only "chunked" or a decimal
 * Content-Length, not both (RFC 9112 6.1, 6.3: a request with both is how requests are
 * smuggled). Returns true, or false with a 400 queued and *ret its result. */
/* Counts the request's Content-Length and Transfer-Encoding lines (MHD_get_connection_values
 * sees every line; MHD_lookup_connection_value only the first). */
typedef struct framing_count {
    unsigned n_cl, n_te;
} framing_count_t;

static enum MHD_Result count_framing(void *cls, enum MHD_ValueKind kind, const char *key,
                                     const char *value)
{
    (void)kind;
    (void)value;
    framing_count_t *n = cls;
    if (key && strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH) == 0)
        n->n_cl++;
    if (key && strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING) == 0)
        n->n_te++;
    return MHD_YES;
}

static bool framing_ok(struct MHD_Connection *c, enum MHD_Result *ret)
{
    /* two lengths (even equal ones) or two codings: which one an intermediary used is how a
     * request is smuggled past it (RFC 9112 6.3), so neither is chosen */
    framing_count_t n = {0, 0};
    MHD_get_connection_values(c, MHD_HEADER_KIND, count_framing, &n);
    if (n.n_cl > 1 || n.n_te > 1) {
        *ret = http_reply_error(
            c, TDM_EINVALID, "bad_framing", NULL, "the request has %u %s headers; send exactly one",
            n.n_cl > 1 ? n.n_cl : n.n_te, n.n_cl > 1 ? "Content-Length" : "Transfer-Encoding");
        return false;
    }
    const char *te =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (te && strcasecmp(te, "chunked") != 0) {
        *ret = http_reply_error(c, TDM_EINVALID, "bad_framing", NULL,
                                "Transfer-Encoding '%.100s' is not supported: send 'chunked' or a "
                                "Content-Length",
                                te);
        return false;
    }
    if (te && cl) {
        *ret =
            http_reply_error(c, TDM_EINVALID, "bad_framing", NULL,
                             "a request with both Transfer-Encoding and Content-Length is refused");
        return false;
    }
    if (cl && (!cl[0] || strspn(cl, "0123456789") != strlen(cl) || strlen(cl) > 19)) {
        *ret = http_reply_error(c, TDM_EINVALID, "bad_framing", NULL,
                                "Content-Length '%.100s' is not a decimal byte count", cl);
        return false;
    }
    return true;
}

int http_client_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* The first call of a request (its headers have arrived): its state, the framing checks, and
 * an early 413 for a body announced too large to a client waiting for "100 Continue". */
static enum MHD_Result request_begin(tdm_http_t *h, struct MHD_Connection *c, void **con_cls)
{
    http_req_t *r = calloc(1, sizeof *r);
    if (!r)
        return MHD_NO;
    r->h = h;
    r->conn = c;
    r->fd = http_client_fd(c);
    *con_cls = r;
    pthread_mutex_lock(&h->mu);
    h->n_requests++;
    r->counted = true;
    pthread_mutex_unlock(&h->mu);
    const char *rid = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id");
    if (http_request_id_ok(rid))
        snprintf(r->rid, sizeof r->rid, "%s", rid);
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (ci && ci->socket_context)
        ((http_conn_t *)ci->socket_context)->req = r;
    conn_phase(c, HTTP_ACC_BODY);
    enum MHD_Result ret;
    if (!framing_ok(c, &ret))
        return ret;
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (cl && strtoull(cl, NULL, 10) > TDM_HTTP_MAX_BODY_BYTES) {
        r->too_large = true;
        /* a client waiting for "100 Continue" gets the 413 without sending the body */
        const char *expect =
            MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_EXPECT);
        if (expect && strcasecmp(expect, "100-continue") == 0)
            return http_reply_bad_http(c, 413, "request_too_large",
                                       "the request body is larger than %u bytes",
                                       TDM_HTTP_MAX_BODY_BYTES);
    }
    return MHD_YES;
}

static enum MHD_Result on_request(void *cls, struct MHD_Connection *c, const char *url,
                                  const char *method, const char *version, const char *upload_data,
                                  size_t *upload_data_size, void **con_cls)
{
    (void)version;
    tdm_http_t *h = cls;
    http_req_t *r = *con_cls;
    if (!r)
        return request_begin(h, c, con_cls);
    if (*upload_data_size) {
        size_t n = *upload_data_size;
        *upload_data_size = 0;
        http_conn_t *hc = conn_ctx(c);
        if (hc)
            http_acc_body(h->acc, hc->fd, hc->gen, n);
        pthread_mutex_lock(&h->mu);
        h->body_bytes += n;
        pthread_mutex_unlock(&h->mu);
        if (!r->too_large && r->body.len + n > TDM_HTTP_MAX_BODY_BYTES) {
            r->too_large = true;
            tdm_buf_free(&r->body);
        }
        if (r->too_large) {
            /* read and drop it, so the client sees the 413 instead of a reset connection;
             * past HTTP_DISCARD_MAX the answer goes out at once and the connection closes */
            r->discarded += n;
            if (r->discarded > HTTP_DISCARD_MAX)
                return http_reply_bad_http(c, 413, "request_too_large",
                                           "the request body is larger than %u bytes",
                                           TDM_HTTP_MAX_BODY_BYTES);
            return MHD_YES;
        }
        if (tdm_buf_append(&r->body, upload_data, n) != TDM_OK)
            return MHD_NO;
        return MHD_YES;
    }
    conn_phase(c, HTTP_ACC_BUSY);
    if (r->emb) /* resumed: the embeddings' answer */
        return http_embeddings_resume(h, c, r);
    if (r->call) /* resumed: the call's next events */
        return http_generate_resume(h, c, r);
    return http_route(h, c, r, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    tdm_http_t *h = cls;
    http_req_t *r = *con_cls;
    if (!r)
        return;
    if (r->call)
        http_generate_end(h, r, (int)toe);
    if (r->emb)
        http_embeddings_end(h, r, (int)toe);
    if (r->streaming)
        dash_streams(h->dash, -1);
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (ci && ci->socket_context && ((http_conn_t *)ci->socket_context)->req == r)
        ((http_conn_t *)ci->socket_context)->req = NULL;
    gw_event_free(r->whole);
    for (size_t i = 0; r->multi && r->q_candidates && i < r->q_candidates; i++) {
        gw_event_free(r->wholes ? r->wholes[i] : NULL);
        if (r->outs)
            oai_out_clear(&r->outs[i]);
    }
    free(r->wholes);
    free(r->outs);
    free(r->calls);
    tdm_buf_free(&r->body);
    tdm_buf_free(&r->sse);
    resp_call_free(&r->resp);
    oai_out_clear(&r->out);
    bool trim = false;
    if (r->counted) {
        pthread_mutex_lock(&h->mu);
        trim = --h->n_requests == 0 && h->body_bytes >= HTTP_TRIM_BYTES;
        if (trim)
            h->body_bytes = 0;
        pthread_mutex_unlock(&h->mu);
    }
    free(r);
    *con_cls = NULL;
    if (trim) /* idle after large bodies: give their memory back (every arena) */
        malloc_trim(0);
    conn_phase(c, HTTP_ACC_IDLE);
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                              (unsigned)h->cfg->router.http_connection_timeout_s);
}

/* A request line has arrived on c (MHD_OPTION_URI_LOG_CALLBACK): its headers are due within
 * router.http_header_timeout_s, on a keep-alive connection's later requests too (the front
 * door saw only the first). Returns the request's initial *con_cls: none. */
static void *on_request_line(void *cls, const char *uri, struct MHD_Connection *c)
{
    (void)cls;
    (void)uri;
    conn_phase(c, HTTP_ACC_HEADERS);
    return NULL;
}

/* A connection's socket context (http_conn_t): made when it opens, freed when it closes. */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    tdm_http_t *h = cls;
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    int fd = ci ? ci->connect_fd : -1;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        http_conn_t *hc = calloc(1, sizeof *hc); /* NULL: replies go without ids, uncounted */
        if (hc) {
            hc->h = h;
            hc->fd = fd;
            hc->gen = http_acc_started(h->acc, fd);
        }
        *socket_context = hc;
    } else {
        http_conn_t *hc = *socket_context;
        /* without a context (out of memory) the front door's sweep cannot tell it closed;
         * its slot is found by fd when reused (generation check fails, slot stays) */
        if (hc)
            http_acc_closed(h->acc, hc->fd, hc->gen);
        free(hc);
        *socket_context = NULL;
        pthread_mutex_lock(&h->mu);
        h->body_bytes += HTTP_TRIM_CONN_BYTES;
        bool trim = h->n_requests == 0 && h->body_bytes >= HTTP_TRIM_BYTES;
        if (trim)
            h->body_bytes = 0;
        pthread_mutex_unlock(&h->mu);
        if (trim) /* idle after many connections closed: their pools' memory back */
            malloc_trim(0);
    }
}

static void on_mhd_log(void *cls, const char *fmt, va_list ap)
{
    tdm_http_t *h = cls;
    char msg[256];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = '\0';
    pthread_mutex_lock(&h->mu);
    snprintf(h->mhd_error, sizeof h->mhd_error, "%s", msg);
    pthread_mutex_unlock(&h->mu);
    tdm_log_write(&h->log, TDM_LOG_DEBUG, NULL, NULL, "libmicrohttpd: %s", msg);
}

/* ---- construction ---- */

/* The router's endpoint as a client reaches it: a wildcard host becomes 127.0.0.1. */
static void connectable(const char *ep, char *out, size_t cap)
{
    static const char *const wild[] = {"tcp://0.0.0.0:", "tcp://*:", "tcp://[::]:", "tcp://[::0]:"};
    for (size_t i = 0; i < sizeof wild / sizeof wild[0]; i++) {
        size_t n = strlen(wild[i]);
        if (strncmp(ep, wild[i], n) == 0) {
            snprintf(out, cap, "tcp://127.0.0.1:%s", ep + n);
            return;
        }
    }
    snprintf(out, cap, "%s", ep);
}

/* The socket address to serve on, from router.http_address (h->host, brackets removed) and
 * router.http_port. TDM_EINVALID when it does not resolve. */
static int listen_address(tdm_http_t *h, struct sockaddr_storage *sa, bool *v6, tdm_error_t *err)
{
    const tdm_config_t *cfg = h->cfg;
    const char *addr = cfg->router.http_address ? cfg->router.http_address : "127.0.0.1";
    snprintf(h->host, sizeof h->host, "%s", addr);
    /* "[::1]" -> "::1" */
    size_t hl = strlen(h->host);
    if (hl >= 2 && h->host[0] == '[' && h->host[hl - 1] == ']') {
        memmove(h->host, h->host + 1, hl - 2);
        h->host[hl - 2] = '\0';
    }
    struct addrinfo hints = {0}, *ai = NULL;
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE;
    char port_text[16];
    snprintf(port_text, sizeof port_text, "%d", cfg->router.http_port);
    int gai = getaddrinfo(h->host, port_text, &hints, &ai);
    if (gai != 0 || !ai)
        return tdm_error_set(err, TDM_EINVALID, "router.http_address '%s': %s", addr,
                             gai_strerror(gai));
    memset(sa, 0, sizeof *sa);
    memcpy(sa, ai->ai_addr, ai->ai_addrlen <= sizeof *sa ? ai->ai_addrlen : sizeof *sa);
    *v6 = ai->ai_family == AF_INET6;
    freeaddrinfo(ai);
    return TDM_OK;
}

/* Starts the gateway thread, the dashboard sampler and libmicrohttpd, with every signal
 * blocked in their threads (SIGTERM/SIGINT belong to the main thread's zmq_poll). */
static int start_threads(tdm_http_t *h, const char *ep, struct sockaddr_storage *sa, bool v6,
                         tdm_error_t *err)
{
    const tdm_config_t *cfg = h->cfg;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    h->gw = gw_new(h->net, ep, h->internal_key, &h->log, err);
    if (h->gw)
        h->dash = dash_new(h->gw, h->counters, err);
    const tdm_router_config_t *rc = &cfg->router;
    socklen_t sa_len = v6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    if (h->dash && http_acc_raise_nofile(rc->http_max_connections, err) == TDM_OK)
        h->acc =
            http_acc_new(cfg, (struct sockaddr *)sa, sa_len, h->host, h->counters, &h->log, err);
    if (h->acc) {
        /* a pool of threads over epoll, connections parked while they wait for the router; the
         * front door (http_accept.c) accepts, enforces the limits and hands over connections
         * whose headers are in, so libmicrohttpd listens on nothing and limits nothing itself
         * (its limit only leaves room for connections being evicted) */
        unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL | MHD_USE_ITC |
                         MHD_USE_NO_LISTEN_SOCKET | MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG;
        unsigned limit = (unsigned)rc->http_max_connections * 2u + 64u;
        h->mhd = MHD_start_daemon(
            flags, 0, NULL, NULL, on_request, h, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
            MHD_OPTION_NOTIFY_CONNECTION, on_connection, h, MHD_OPTION_URI_LOG_CALLBACK,
            on_request_line, h, MHD_OPTION_THREAD_POOL_SIZE, (unsigned)rc->http_threads,
            MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)rc->http_connection_timeout_s,
            MHD_OPTION_CONNECTION_LIMIT, limit, MHD_OPTION_STRICT_FOR_CLIENT, 1,
            MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log, h, MHD_OPTION_END);
        if (!h->mhd)
            tdm_error_set(err, TDM_EUNAVAILABLE, "cannot serve HTTP on %s port %d: %s", h->host,
                          cfg->router.http_port,
                          h->mhd_error[0] ? h->mhd_error : "libmicrohttpd failed to start");
    }
    if (h->mhd && http_acc_start(h->acc, h->mhd, err) != TDM_OK) {
        MHD_stop_daemon(h->mhd);
        h->mhd = NULL;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return h->mhd ? TDM_OK : (err ? err->code : TDM_EUNAVAILABLE);
}

/* Each model's vocabulary (vocabs[i], borrowed; none past n_vocabs) and chat family: the
 * template's reasoning and tool-call formats, or the config's parsers. */
static void models_init(tdm_http_t *h, const tdm_config_t *cfg, const tdm_http_vocab_t *vocabs,
                        size_t n_vocabs)
{
    for (size_t i = 0; i < cfg->n_models; i++) {
        const tdm_model_config_t *mc = &cfg->models[i];
        tdm_http_vocab_t *v = &h->vocabs[i];
        oai_family_ctx_t *fam = &h->families[i];
        if (vocabs && i < n_vocabs)
            *v = vocabs[i];
        fam->pick = v->pick;
        fam->reasoning_cfg = mc->reasoning_parser;
        fam->tools_cfg = mc->tool_call_parser;
        fam->family = oai_family_detect(v->pick ? v->pick->jinja : NULL, mc->reasoning_parser,
                                        mc->tool_call_parser);
        fam->plain_mode =
            oai_family_reasoning(&fam->family, v->pick ? v->pick->jinja : NULL, v->pick, NULL);
    }
}

tdm_http_t *tdm_http_new(const tdm_config_t *cfg, const char *router_endpoint,
                         const tdm_http_vocab_t *vocabs, size_t n_vocabs, tdm_net_t *net,
                         const tdm_logger_t *log, tdm_error_t *err)
{
    tdm_http_t *h = calloc(1, sizeof *h);
    if (!h) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    h->cfg = cfg;
    h->net = net;
    h->n_models = cfg->n_models;
    models_init(h, cfg, vocabs, n_vocabs);
    if (log)
        h->log = *log;
    else
        tdm_log_init(&h->log, "router");
    pthread_mutex_init(&h->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(&h->idle, &ca);
    pthread_condattr_destroy(&ca);
    h->started = (long long)time(NULL);
    h->internal_key = cfg->router.n_api_keys ? cfg->router.api_keys[0] : NULL;
    if (!(h->counters = http_counters_new()) ||
        !(h->responses = resp_store_new((size_t)cfg->router.responses_store_max,
                                        cfg->router.responses_store_bytes))) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out_free;
    }
    struct sockaddr_storage sa;
    bool v6 = false;
    char ep[512];
    connectable(router_endpoint, ep, sizeof ep);
    if (listen_address(h, &sa, &v6, err) != TDM_OK || start_threads(h, ep, &sa, v6, err) != TDM_OK)
        goto out_free;
    h->port = http_acc_port(h->acc);
    char kv[640] = "", url[200];
    snprintf(url, sizeof url, v6 ? "http://[%s]:%u" : "http://%s:%u", h->host, (unsigned)h->port);
    tdm_log_kv_append(kv, sizeof kv, "url", url);
    tdm_log_kv_append(kv, sizeof kv, "router", ep);
    tdm_log_write(&h->log, TDM_LOG_INFO, NULL, kv, "http gateway ready");
    return h;
out_free:
    tdm_http_destroy(&h);
    return NULL;
}

/* Waits, at most HTTP_DRAIN_S seconds, until no connection holds a generate call: at SIGTERM
 * the router has just ended every call (UNAVAILABLE "router shutting down"), and the
 * connections must write that answer (a 503, or the stream's error event and [DONE]) before
 * the daemon stops and closes them. */
static void drain_calls(tdm_http_t *h)
{
    struct timespec until;
    clock_gettime(CLOCK_MONOTONIC, &until);
    until.tv_sec += HTTP_DRAIN_S;
    pthread_mutex_lock(&h->mu);
    while (h->n_calls > 0)
        if (pthread_cond_timedwait(&h->idle, &h->mu, &until) == ETIMEDOUT)
            break;
    pthread_mutex_unlock(&h->mu);
}

void tdm_http_destroy(tdm_http_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_http_t *h = *self_p;
    http_acc_stop(h->acc); /* no new connections */
    if (h->gw && h->mhd)
        drain_calls(h);
    /* end the calls left, so every connection thread finishes, then join them */
    if (h->gw)
        gw_shutdown(h->gw);
    if (h->mhd)
        MHD_stop_daemon(h->mhd);
    http_acc_destroy(&h->acc); /* after the daemon: its closing connections report to it */
    dash_destroy(&h->dash);
    gw_destroy(&h->gw);
    http_counters_destroy(&h->counters);
    resp_store_destroy(&h->responses);
    pthread_cond_destroy(&h->idle);
    pthread_mutex_destroy(&h->mu);
    free(h);
    *self_p = NULL;
}

uint16_t tdm_http_port(const tdm_http_t *h)
{
    return h->port;
}
