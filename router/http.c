/* http.c - the HTTP gateway's server: libmicrohttpd with a bounded thread pool, routing,
 * framing checks, API keys, OpenAI-shaped errors, and the handlers (generate, models, health,
 * ready, metrics, dashboard, tokenize, version); CORS and request ids come from http_conv.c.
 *
 * A pool of router.http_threads threads serves every connection (epoll), within
 * router.http_max_connections in all and router.http_max_connections_per_client from one
 * address, and closes a connection idle for router.http_connection_timeout_s. So no handler
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
 * ErrorDetail (param_of), and /metrics renders the METRICS message (tdm_proto_metrics_text).
 */
#define _GNU_SOURCE /* strcasestr-free: strncasecmp, getaddrinfo flags */
#include <arpa/inet.h>
#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
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

#include "http_internal.h"
#include "http_metrics.h"
#include "tandem/limits.h"

#define HTTP_DISCARD_MAX (64u << 20) /* bytes of an oversized body read before closing */
#define HTTP_UNARY_TIMEOUT_S 5.0
/* Room for a refusal's message in OpenAI's terms: the router's, translated, and a prompt's name. */
/* Kernel send buffer of a streaming response (Linux doubles it). Autotuning would let a client
 * that stops reading park up to net.ipv4.tcp_wmem's maximum (4 MiB) in the kernel per stream;
 * with the cap the backlog waits in the call's queue, and a stream needs little: 64 KiB per
 * round trip is 320 KB/s at 200 ms. */
#define HTTP_STREAM_SNDBUF (64 << 10)

/* Longest wait at shutdown for connections to write the answers of their ended calls, s. */
#define HTTP_DRAIN_S 5

struct tdm_http {
    const tdm_config_t *cfg;
    tdm_net_t *net; /* the router's; the gateway's client uses it (inproc://) */
    tdm_logger_t log;
    gw_t *gw;
    dash_t *dash;
    struct MHD_Daemon *mhd;
    uint16_t port;
    char host[128];
    const char *internal_key; /* the first configured API key, for the gateway's own calls */
    long long started;        /* unix seconds ("created" of /v1/models) */
    char mhd_error[256];      /* last message libmicrohttpd logged */
    pthread_mutex_t mu;
    pthread_cond_t idle; /* signalled when n_calls drops to 0 */
    size_t n_calls;      /* under mu: connections holding a generate call */
    bool have_model;     /* under mu */
    http_model_t model;
    tdm_http_vocab_t vocab; /* the router's tokenizer (/tokenize); tok NULL: none */
};

/* Per request (MHD's con_cls). */
typedef struct http_req {
    tdm_http_t *h;
    tdm_buf_t body;
    bool too_large;
    uint64_t discarded;
    int fd; /* the client's socket */
    struct MHD_Connection *conn;
    /* a generate request */
    oai_req_t *q;      /* owned by the calls */
    gw_call_t *call;   /* the call whose events are read now: calls[cur] */
    gw_call_t **calls; /* [n_calls] one per prompt (a completions prompt list), in order */
    size_t n_calls, cur;
    gw_event_t *whole;   /* stream=false: the one chunk, held until the END after it */
    oai_out_t out;       /* the answer's (multi: the sum over the choices, oai_usage_sum) */
    bool multi;          /* several choices or prompts: per-choice writers, one answer */
    oai_out_t *outs;     /* [oai_candidates(q)] multi: each choice's writer */
    gw_event_t **wholes; /* [q_candidates] multi, stream=false: each choice's chunk */
    size_t q_candidates; /* oai_candidates(q), kept for the cleanup (q may be gone then) */
    bool streaming;
    bool recorded;
    tdm_buf_t sse;
    size_t sse_off;
    bool sse_done;
    bool cancelled; /* this side cancelled the call (client gone) */
    /* X-Request-Id of every reply: the client's own when valid, else the router's (the
     * generate call's id, or a new one made when a reply needs it) */
    char rid[TDM_REQUEST_ID_MAX + 1];
} http_req_t;

/* Per connection (MHD's socket context): the request it serves now, so that every reply finds
 * its request id from the connection alone. Requests on a connection come one at a time. */
typedef struct http_conn {
    http_req_t *req;
} http_conn_t;

/* The request c serves now, or NULL. */
static http_req_t *conn_req(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    http_conn_t *hc = ci ? ci->socket_context : NULL;
    return hc ? hc->req : NULL;
}

/* Adds X-Request-Id (made now when the request has none yet) and the CORS headers. */
static void add_conv_headers(struct MHD_Connection *c, struct MHD_Response *resp)
{
    http_req_t *r = conn_req(c);
    if (!r)
        return;
    if (!r->rid[0])
        http_request_id_new(r->rid, sizeof r->rid);
    http_conv_headers(r->h->cfg, c, resp, r->rid);
}

/* ---- errors and responses ---- */

json_t *http_json_text(const char *s, size_t n)
{
    if (!s)
        return json_string("");
    size_t i = 0;
    uint32_t cp;
    while (i < n) {
        size_t l = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (l == 0 || cp == 0)
            break;
        i += l;
    }
    if (i == n)
        return json_stringn(s, n);
    tdm_buf_t b = TDM_BUF_INIT;
    tdm_buf_append(&b, s, i);
    while (i < n) {
        size_t l = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (l == 0 || cp == 0) {
            tdm_buf_append(&b, "\xef\xbf\xbd", 3); /* U+FFFD for the byte */
            i++;
        } else {
            tdm_buf_append(&b, s + i, l);
            i += l;
        }
    }
    json_t *v = b.data && !b.oom ? json_stringn(b.data, b.len) : NULL;
    tdm_buf_free(&b);
    return v;
}

json_t *http_json_str(const char *s)
{
    return http_json_text(s, s ? strlen(s) : 0);
}

json_t *http_error_json(int status, const char *code, const char *param, const char *message)
{
    const tdm_status_info_t *row = tdm_status_info(status);
    /* the message may quote client input (a URL, a JSON parser's excerpt, a model name) */
    json_t *e = json_object();
    if (!e)
        return NULL;
    json_object_set_new(e, "message", http_json_str(message ? message : ""));
    json_object_set_new(e, "type", json_string(row->oai_type));
    json_object_set_new(e, "param", param && param[0] ? http_json_str(param) : json_null());
    json_object_set_new(e, "code", http_json_str(code ? code : row->oai_code));
    if (json_object_size(e) != 4) { /* out of memory */
        json_decref(e);
        return NULL;
    }
    return json_pack("{s:o}", "error", e);
}

void http_model_from_proto(const Tandem__V1__ModelInfo *mi, http_model_t *m)
{
    memset(m, 0, sizeof *m);
    snprintf(m->name, sizeof m->name, "%s", mi->name ? mi->name : "");
    snprintf(m->chat_template, sizeof m->chat_template, "%s",
             mi->chat_template ? mi->chat_template : "");
    m->fingerprint = mi->fingerprint;
    m->n_ctx = mi->n_ctx;
    m->n_vocab = mi->n_vocab;
    m->n_layers = mi->n_layers;
    m->n_kv_heads = mi->n_kv_heads;
    m->head_dim = mi->head_dim;
    m->n_heads = mi->n_heads;
    m->n_embd = mi->n_embd;
    m->weight_bytes = mi->weight_bytes;
    m->kv_block_size = mi->kv_block_size;
    m->kv_dtype = (int)mi->kv_dtype;
}

/* Replies with body. A 401 challenges Bearer (RFC 6750, for API clients) and Basic, so that a
 * browser opening the dashboard asks for a user name and password and then sends them (the
 * API key as the password, see state_key_ok) on the page's own fetches too. A 429 or 503
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
    tdm_http_count_response(status);
    add_conv_headers(c, resp);
    enum MHD_Result ret = MHD_queue_response(c, status, resp);
    MHD_destroy_response(resp);
    return ret;
}

static enum MHD_Result reply(struct MHD_Connection *c, unsigned status, const char *ctype,
                             const void *body, size_t len)
{
    return reply_retry(c, status, ctype, body, len, 0);
}

/* Replies with v as JSON (consumed); a 429 or 503 says Retry-After: retry_after_s (at least
 * 1). */
static enum MHD_Result reply_json_retry(struct MHD_Connection *c, unsigned status, json_t *v,
                                        uint32_t retry_after_s)
{
    static const char oom[] = "{\"error\":{\"message\":\"out of memory\",\"type\":"
                              "\"server_error\",\"param\":null,\"code\":\"internal\"}}\n";
    if (!v)
        return reply(c, 500, "application/json", oom, sizeof oom - 1);
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

static enum MHD_Result reply_json(struct MHD_Connection *c, unsigned status, json_t *v)
{
    return reply_json_retry(c, status, v, 0);
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
    return reply_json(c, http_status ? http_status : tdm_status_info(status)->http_status,
                      http_error_json(status, code, param, msg));
}

static enum MHD_Result reply_error(struct MHD_Connection *c, int status, const char *code,
                                   const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static enum MHD_Result reply_error(struct MHD_Connection *c, int status, const char *code,
                                   const char *param, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    enum MHD_Result ret = reply_error_as(c, 0, status, code, param, fmt, ap);
    va_end(ap);
    return ret;
}

static enum MHD_Result reply_bad_http(struct MHD_Connection *c, unsigned http_status,
                                      const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static enum MHD_Result reply_bad_http(struct MHD_Connection *c, unsigned http_status,
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
static bool check_key(tdm_http_t *h, struct MHD_Connection *c, enum MHD_Result *ret)
{
    if (h->cfg->router.n_api_keys == 0)
        return true; /* no keys: whatever Authorization says (OpenAI clients always send one) */
    const char *key = bearer_key(c);
    if (!key) {
        *ret = reply_error(c, TDM_EUNAUTHENTICATED, "invalid_api_key", NULL,
                           "an API key is required: send the header 'Authorization: Bearer KEY'");
        return false;
    }
    /* one longer than any key can be is simply not one of them */
    if (strlen(key) >= TDM_NET_API_KEY_MAX || !tdm_config_api_key_ok(&h->cfg->router, key)) {
        *ret = reply_error(c, TDM_EUNAUTHENTICATED, "invalid_api_key", NULL,
                           "the API key is not accepted");
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
static bool state_key_ok(const tdm_http_t *h, struct MHD_Connection *c, bool *missing)
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

/* state_key_ok, or a 401 queued with *ret its result (false). */
static bool check_state_key(tdm_http_t *h, struct MHD_Connection *c, enum MHD_Result *ret)
{
    bool missing;
    if (state_key_ok(h, c, &missing))
        return true;
    *ret = missing ? reply_error(c, TDM_EUNAUTHENTICATED, "invalid_api_key", NULL,
                                 "an API key is required: send the header 'Authorization: Bearer "
                                 "KEY' (a browser: the key as the password)")
                   : reply_error(c, TDM_EUNAUTHENTICATED, "invalid_api_key", NULL,
                                 "the API key is not accepted");
    return false;
}

/* The served model (MODELS, cached after the first success). Returns 0 or the call's status. */
static int get_model(tdm_http_t *h, http_model_t *m, tdm_error_t *err)
{
    pthread_mutex_lock(&h->mu);
    bool have = h->have_model;
    if (have)
        *m = h->model;
    pthread_mutex_unlock(&h->mu);
    if (have)
        return TDM_OK;
    Tandem__V1__ModelsRequest req = TANDEM__V1__MODELS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_MODELS, &req.base,
                      &tandem__v1__models_response__descriptor, HTTP_UNARY_TIMEOUT_S, &resp, err);
    if (rc != TDM_OK)
        return rc;
    Tandem__V1__ModelsResponse *mr = (Tandem__V1__ModelsResponse *)resp;
    if (mr->n_models == 0) {
        protobuf_c_message_free_unpacked(resp, NULL);
        return tdm_error_set(err, TDM_EINTERNAL, "the router lists no model");
    }
    http_model_from_proto(mr->models[0], m);
    protobuf_c_message_free_unpacked(resp, NULL);
    pthread_mutex_lock(&h->mu);
    h->model = *m;
    h->have_model = true;
    pthread_mutex_unlock(&h->mu);
    return TDM_OK;
}

/* Whether q is a chat request that gave its limit as max_completion_tokens. */
static bool uses_max_completion_tokens(const oai_req_t *q)
{
    return q->kind == OAI_CHAT && json_object_get(q->root, "max_completion_tokens");
}

/* OpenAI's error.param for the GenerateRequest field the router named (ErrorDetail.field, a
 * path such as "stop[1]" or "sampling.temperature"): the name of the OpenAI request field it
 * was made from, with the element or member the path goes on to ("stop[1]",
 * "messages[2].content"); "" when none. */
static void param_of(const oai_req_t *q, const char *field, char *param, size_t cap)
{
    static const struct {
        const char *native, *param;
    } map[] = {
        {"prompt", "prompt"}, {"tokens", "prompt"}, {"chat", "messages"},
        {"stop", "stop"},     {"model", "model"},   {"max_tokens", "max_tokens"},
    };
    size_t top = strcspn(field, ".[");
    param[0] = '\0';
    if (strncmp(field, "chat.messages", 13) == 0) {
        snprintf(param, cap, "messages%s", field + 13);
        return;
    }
    if (strncmp(field, "tokens.ids", 10) == 0) { /* the token-id prompt's element: prompt[3] */
        snprintf(param, cap, "prompt%s", field + 10);
        return;
    }
    if (strncmp(field, "constraint", top) == 0 && top == 10) {
        snprintf(param, cap, "%s", q->constraint_param);
        return;
    }
    if (top == 8 && strncmp(field, "sampling", 8) == 0 && field[8] == '.') {
        const char *sub = field + 9;
        if (strcmp(sub, "n_logprobs") == 0)
            sub = q->kind == OAI_CHAT ? "top_logprobs" : "logprobs";
        else if (strcmp(sub, "n_stop_token_ids") == 0)
            sub = "stop_token_ids";
        snprintf(param, cap, "%s", sub);
        return;
    }
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++) {
        if (strlen(map[i].native) != top || strncmp(field, map[i].native, top) != 0)
            continue;
        const char *p = map[i].param;
        if (strcmp(p, "max_tokens") == 0 && uses_max_completion_tokens(q))
            p = "max_completion_tokens";
        snprintf(param, cap, "%s%s", p, field + top);
        return;
    }
}

/* The limit on the output under the name the client gave it. */
static const char *max_tokens_name(const oai_req_t *q)
{
    return uses_max_completion_tokens(q) ? "max_completion_tokens" : "max_tokens";
}

/* The router's message of a refusal in OpenAI's terms, into out (cap bytes). A refusal for
 * length is said from ErrorDetail's numbers, with prompt what the client calls the prompt
 * ("prompt[2]" in a list) and the output limit under its own name; any other message that
 * begins with its field (tdm_error_t's rule) begins with param, OpenAI's name of the field,
 * instead; the rest of the message is never read. */
static void oai_text(const oai_req_t *q, const gw_event_t *ev, const char *prompt,
                     const char *param, char *out, size_t cap)
{
    const char *msg = ev->message[0] ? ev->message : tdm_strerror(ev->status);
    const char *field = ev->detail.field;
    size_t n = strlen(field);
    if (ev->detail.n_ctx > 0 && ev->detail.max_tokens_fit > 0)
        snprintf(out, cap,
                 "%s: prompt (%" PRIu32 " tokens) + %s (%" PRId32
                 ") exceeds the context of %" PRIu32 " tokens; at most %" PRIu32
                 " tokens can be generated for this prompt",
                 max_tokens_name(q), ev->detail.prompt_tokens, max_tokens_name(q), q->g.max_tokens,
                 ev->detail.n_ctx, ev->detail.max_tokens_fit);
    else if (ev->detail.n_ctx > 0)
        snprintf(out, cap,
                 "%s has %" PRIu32 " tokens; the context is %" PRIu32
                 " tokens (prompt + %s must fit)",
                 prompt, ev->detail.prompt_tokens, ev->detail.n_ctx, max_tokens_name(q));
    else if (n > 0 && param[0] && strncmp(msg, field, n) == 0 &&
             !(isalnum((unsigned char)msg[n]) || msg[n] == '_'))
        snprintf(out, cap, "%s%s", param, msg + n);
    else
        snprintf(out, cap, "%s", msg);
}

/* The error END ev of call `call` of r in OpenAI's terms (oai_text, param_of): *out gets its
 * status, message and param (as out->field). A refusal of one prompt of a list for the prompt
 * itself (a field in it, or its length) names which: "prompt[1] is empty", "prompt[1][3] =
 * 60000 is out of the vocabulary ...", "prompt[1]: max_tokens: ...", param "prompt[1]",
 * "prompt[1][3]" (a field outside the prompt keeps its own param). */
static void refusal_error(const http_req_t *r, size_t call, const gw_event_t *ev, tdm_error_t *out)
{
    bool list = r->q->n_prompts > 1;
    char name[32] = "prompt";
    if (list)
        snprintf(name, sizeof name, "prompt[%zu]", call);
    char field[64], param[TDM_ERRFIELD_MAX];
    param_of(r->q, ev->detail.field, field, sizeof field);
    bool in_prompt = strncmp(field, "prompt", 6) == 0 && !isalnum((unsigned char)field[6]);
    snprintf(param, sizeof param, "%s%s", in_prompt ? name : field, in_prompt ? field + 6 : "");
    char text[TDM_ERRMSG_MAX + 64];
    oai_text(r->q, ev, name, param, text, sizeof text);
    size_t n = strlen(name);
    if (!list || !(in_prompt || ev->detail.n_ctx > 0) || strncmp(text, name, n) == 0)
        tdm_error_set_field(out, ev->status, param, "%s", text);
    else if (strncmp(text, "prompt", 6) == 0 &&
             !(isalnum((unsigned char)text[6]) || text[6] == '_' || text[6] == '['))
        tdm_error_set_field(out, ev->status, param, "%s%s", name, text + 6); /* "prompt: ..." */
    else
        tdm_error_set_field(out, ev->status, param, "%s: %s", name, text);
}

static int client_fd(struct MHD_Connection *c)
{
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    return ci ? ci->connect_fd : -1;
}

/* ---- generate ---- */

static void record(http_req_t *r, int status)
{
    if (r->recorded)
        return;
    r->recorded = true;
    dash_record(r->h->dash, status);
}

static void park_conn(void *arg)
{
    MHD_suspend_connection(arg);
}

static void unpark_conn(void *arg)
{
    MHD_resume_connection(arg);
}

/* Whether the client's socket says it hung up (or failed); does not wait. */
static bool client_gone(int fd)
{
    if (fd < 0)
        return false;
    struct pollfd p = {fd, POLLRDHUP, 0};
    return poll(&p, 1, 0) > 0 && (p.revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL));
}

/* The call's next event without blocking the thread: 1 with *ev; 0 when the connection is
 * parked until there is one (the handler returns and libmicrohttpd calls it again then); -1
 * when the client has hung up (the call is cancelled; when tells the log at what point). */
/* Cancels every call of r that has not ended (CANCEL to the router). */
static void calls_cancel(http_req_t *r)
{
    for (size_t i = 0; i < r->n_calls; i++)
        if (r->calls[i] && !gw_call_ended(r->calls[i]))
            gw_call_cancel(r->calls[i]);
}

/* Whether a call of r has not ended. */
static bool calls_running(http_req_t *r)
{
    for (size_t i = 0; i < r->n_calls; i++)
        if (r->calls[i] && !gw_call_ended(r->calls[i]))
            return true;
    return false;
}

static int take_event(http_req_t *r, const char *when, gw_event_t **ev)
{
    int got = -1;
    if (!client_gone(r->fd)) {
        gw_parker_t pk = {park_conn, unpark_conn, r->conn};
        got = gw_call_take(r->call, r->fd, &pk, ev);
    }
    if (got >= 0)
        return got;
    tdm_log_write(&r->h->log, TDM_LOG_INFO, r->q->id, NULL,
                  "http client disconnected %s: request cancelled", when);
    r->cancelled = true;
    calls_cancel(r);
    record(r, TDM_ECANCELLED);
    return -1;
}

/* multi: the writer of the choice ch belongs to (the current call's prompt). */
static size_t choice_slot(const http_req_t *r, const tdm_client_chunk_t *ch)
{
    uint32_t k = ch->choice < r->q->best_of ? ch->choice : r->q->best_of - 1;
    return r->cur * r->q->best_of + k;
}

/* multi: the next prompt's call, once the current one ended OK. */
static bool next_call(http_req_t *r)
{
    if (r->cur + 1 >= r->n_calls)
        return false;
    r->call = r->calls[++r->cur];
    return true;
}

/* Turns one event of a running stream into SSE text in r->sse. */
static void stream_event(http_req_t *r, gw_event_t *ev)
{
    int rc = TDM_OK;
    if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
        const tdm_client_chunk_t *ch = gw_event_chunk(ev);
        rc = oai_sse_chunk(r->q, r->multi ? &r->outs[choice_slot(r, ch)] : &r->out, ch, &r->sse);
        if (rc == TDM_OK)
            return;
        calls_cancel(r);
        oai_sse_end(r->q, &r->out, TDM_EINTERNAL, "the HTTP gateway is out of memory", &r->sse);
        record(r, TDM_EINTERNAL);
        r->sse_done = true;
        return;
    }
    if (r->multi && ev->status == TDM_OK && next_call(r))
        return; /* the next prompt's choices follow */
    if (r->multi && ev->status != TDM_OK)
        calls_cancel(r); /* one failed: the answer failed */
    if (r->multi)
        oai_usage_sum(r->q, r->outs, &r->out);
    tdm_error_t end = {0};
    if (ev->status != TDM_OK && r->q->n_prompts > 1)
        refusal_error(r, r->cur, ev, &end); /* names the prompt */
    else
        tdm_error_set(&end, ev->status, "%s", ev->message);
    oai_sse_end(r->q, &r->out, ev->status, end.msg, &r->sse);
    record(r, ev->status);
    r->sse_done = true;
    if (ev->status != TDM_OK)
        tdm_log_write(&r->h->log, TDM_LOG_INFO, r->q->id, NULL, "http stream ended with %s: %s",
                      tdm_status_name(ev->status), ev->message);
}

/* The content reader of a stream: the SSE text of the events queued so far; with none, it
 * parks the connection and returns 0 (libmicrohttpd calls it again once resumed). */
static ssize_t sse_reader(void *cls, uint64_t pos, char *buf, size_t max)
{
    (void)pos;
    http_req_t *r = cls;
    while (r->sse_off == r->sse.len) {
        if (r->sse_done)
            return MHD_CONTENT_READER_END_OF_STREAM;
        tdm_buf_clear(&r->sse);
        r->sse_off = 0;
        gw_event_t *ev = NULL;
        int got = take_event(r, "mid-stream", &ev);
        if (got < 0)
            return MHD_CONTENT_READER_END_WITH_ERROR;
        if (got == 0)
            return 0;
        stream_event(r, ev);
        gw_event_free(ev);
        if (r->sse_done) /* the rest is ours to send: a client that stops reading times out */
            MHD_set_connection_option(r->conn, MHD_CONNECTION_OPTION_TIMEOUT,
                                      (unsigned)r->h->cfg->router.http_connection_timeout_s);
    }
    size_t n = r->sse.len - r->sse_off;
    if (n > max)
        n = max;
    memcpy(buf, r->sse.data + r->sse_off, n);
    r->sse_off += n;
    return (ssize_t)n;
}

/* The ids of a generate request: without a client id the router's own (q->id, as the body's
 * "id") is the reply's X-Request-Id; a client's id goes to the router with a suffix from q->id,
 * since the router refuses an id already in flight from the gateway and two clients (or one
 * client's retries) may send the same id at once. */
static void request_ids(http_req_t *r, oai_req_t *q)
{
    if (!r->rid[0]) {
        snprintf(r->rid, sizeof r->rid, "%s", q->id);
        return;
    }
    size_t n = strlen(q->id);
    const char *tail = q->id + (n > 8 ? n - 8 : 0);
    snprintf(q->native_id, sizeof q->native_id, "%.*s-%s", (int)(TDM_REQUEST_ID_MAX - 9), r->rid,
             tail);
    q->g.request_id = q->native_id;
    q->creq.request_id = q->native_id;
}

/* The writers (and for stream=false the answers) of a request of several choices. */
static bool multi_alloc(http_req_t *r, const oai_req_t *q)
{
    size_t n = oai_candidates(q);
    r->multi = n > 1;
    r->calls = calloc(q->n_prompts, sizeof *r->calls);
    if (!r->calls)
        return false;
    if (!r->multi)
        return true;
    r->q_candidates = n;
    r->outs = calloc(n, sizeof *r->outs);
    r->wholes = calloc(n, sizeof *r->wholes);
    for (size_t i = 0; r->outs && i < n; i++)
        r->outs[i].index = (uint32_t)(i / q->best_of * q->n + i % q->best_of);
    return r->outs && r->wholes;
}

/* Starts one GENERATE call per prompt of q (r->calls, each holding a reference on q). Returns
 * 0, or the error of the call that could not start: the ones before it are cancelled and
 * released and q is gone. */
static int calls_start(tdm_http_t *h, http_req_t *r, oai_req_t *q, tdm_error_t *err)
{
    size_t n = q->n_prompts;
    q->refs = (int)n;
    for (size_t i = 0; i < n; i++) {
        r->calls[i] = gw_generate_start(h->gw, &q->creqs[i], oai_req_unref, q, err);
        if (r->calls[i])
            continue;
        for (size_t j = i + 1; j < n; j++)
            oai_req_unref(q); /* the calls never made */
        for (size_t j = 0; j < i; j++) {
            gw_call_cancel(r->calls[j]);
            gw_call_release(&r->calls[j]);
        }
        return err->code ? err->code : TDM_EINTERNAL;
    }
    r->n_calls = n;
    r->cur = 0;
    r->call = r->calls[0];
    return TDM_OK;
}

/* Parses the body and starts its GENERATE calls (r->q, r->calls). Returns true, or false with
 * the error reply queued and *ret its result. */
static bool generate_start(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r, oai_kind_t kind,
                           enum MHD_Result *ret)
{
    http_model_t m;
    tdm_error_t err = {0};
    const char *served = h->cfg->model.name ? h->cfg->model.name : "";
    if (get_model(h, &m, &err) == TDM_OK)
        served = m.name;
    oai_req_t *q = malloc(sizeof *q);
    if (!q) {
        *ret = reply_error(c, TDM_EINTERNAL, NULL, NULL, "out of memory");
        return false;
    }
    int rc = oai_parse(kind, r->body.data ? r->body.data : "", r->body.len, served, q, &err);
    if (rc != TDM_OK) {
        free(q);
        tdm_http_count_refusal(err.field, rc);
        *ret = reply_error(c, rc, NULL, err.field, "%s", err.msg);
        return false;
    }
    r->q = q;
    request_ids(r, q);
    q->creq.timeout_s = h->cfg->router.request_timeout_s;
    if (oai_prompt_requests(q) != TDM_OK || !multi_alloc(r, q)) {
        oai_req_destroy(q);
        r->q = NULL;
        *ret = reply_error(c, TDM_EINTERNAL, NULL, NULL, "out of memory");
        return false;
    }
    if (calls_start(h, r, q, &err) != TDM_OK) {
        r->q = NULL;
        *ret = reply_error(c, err.code, NULL, NULL, "%s", err.msg);
        return false;
    }
    pthread_mutex_lock(&h->mu);
    h->n_calls++;
    pthread_mutex_unlock(&h->mu);
    return true;
}

/* Answers call `call` of r, which the router refused (its first event is an error END):
 * OpenAI's error with the param the END's ErrorDetail names (refusal_error). */
static enum MHD_Result reply_refused(http_req_t *r, struct MHD_Connection *c, size_t call,
                                     const gw_event_t *ev)
{
    tdm_error_t e = {0};
    refusal_error(r, call, ev, &e);
    record(r, ev->status);
    const char *code = e.code == TDM_ENOTFOUND && strcmp(e.field, "model") == 0 ? "model_not_found"
                       : e.code == TDM_EUNAUTHENTICATED                         ? "invalid_api_key"
                                                                                : NULL;
    return reply_json_retry(c, tdm_status_info(e.code)->http_status,
                            http_error_json(e.code, code, e.field, e.msg),
                            ev->detail.retry_after_s);
}

/* Answers a stream=false call from its one chunk (r->whole, consumed) and the event after it
 * (end, consumed): the chunk once the END OK has come; an error END is answered as the
 * router's error. */
static enum MHD_Result reply_whole(http_req_t *r, struct MHD_Connection *c, gw_event_t *end)
{
    gw_event_t *ev = r->whole;
    r->whole = NULL;
    enum MHD_Result ret;
    if (end->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END && end->status != TDM_OK) {
        ret = reply_refused(r, c, r->cur, end);
    } else {
        json_t *body = oai_response(r->q, &r->out, gw_event_chunk(ev));
        record(r, TDM_OK);
        ret = reply_json(c, 200, body);
    }
    gw_event_free(end);
    gw_event_free(ev);
    return ret;
}

/* Starts the SSE response of a stream from its first event (consumed): the status is 200
 * from here on, errors become an SSE error event. */
static enum MHD_Result reply_stream(tdm_http_t *h, http_req_t *r, struct MHD_Connection *c,
                                    gw_event_t *ev)
{
    r->streaming = true;
    int sndbuf = HTTP_STREAM_SNDBUF;
    if (r->fd >= 0)
        setsockopt(r->fd, SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof sndbuf);
    dash_streams(h->dash, 1);
    stream_event(r, ev);
    gw_event_free(ev);
    struct MHD_Response *resp =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 16384, sse_reader, r, NULL);
    if (!resp) {
        gw_call_cancel(r->call);
        return MHD_NO;
    }
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream; charset=utf-8");
    MHD_add_response_header(resp, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    MHD_add_response_header(resp, "X-Accel-Buffering", "no");
    add_conv_headers(c, resp);
    tdm_http_count_response(200);
    enum MHD_Result ret = MHD_queue_response(c, 200, resp);
    MHD_destroy_response(resp);
    return ret;
}

/* multi, stream=false: the answer from every choice's chunk, once the last call ended OK. */
static enum MHD_Result reply_gathered(http_req_t *r, struct MHD_Connection *c)
{
    size_t n = oai_candidates(r->q);
    const tdm_client_chunk_t *chs[OAI_MAX_PROMPTS * OAI_MAX_CHOICES];
    for (size_t i = 0; i < n; i++) {
        chs[i] = r->wholes[i] ? gw_event_chunk(r->wholes[i]) : NULL;
        if (!chs[i]) {
            record(r, TDM_EINTERNAL);
            return reply_error(c, TDM_EINTERNAL, NULL, NULL, "the router's answer lacks choice %zu",
                               i);
        }
    }
    json_t *body = oai_response_multi(r->q, r->outs, chs, &r->out);
    record(r, TDM_OK);
    return reply_json(c, 200, body);
}

/* multi, stream=false: takes one event (consumed). Returns true when the answer is queued
 * (*ret its result): every call ended OK, or one failed (the others are cancelled). */
static bool gather_event(http_req_t *r, struct MHD_Connection *c, gw_event_t *ev,
                         enum MHD_Result *ret)
{
    if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
        const tdm_client_chunk_t *ch = gw_event_chunk(ev);
        size_t i = choice_slot(r, ch);
        if (ch->last && !r->wholes[i])
            r->wholes[i] = ev;
        else
            gw_event_free(ev);
        return false;
    }
    if (ev->status != TDM_OK) {
        calls_cancel(r);
        *ret = reply_refused(r, c, r->cur, ev);
        gw_event_free(ev);
        return true;
    }
    gw_event_free(ev);
    if (next_call(r))
        return false;
    *ret = reply_gathered(r, c);
    return true;
}

/* The END of a call of r other than the current one that was refused (a prompt list fails as
 * a whole: another prompt's refusal ends the answer before, or while, the current one runs),
 * with *which its index, or NULL. Takes only queued events. */
static gw_event_t *sibling_refusal(http_req_t *r, size_t *which)
{
    for (size_t i = 0; i < r->n_calls; i++) {
        if (i == r->cur || !r->calls[i] || !gw_call_failed(r->calls[i]))
            continue;
        gw_event_t *ev = NULL;
        while (gw_call_next(r->calls[i], -1, 0, &ev) == 1) {
            if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
                *which = i;
                return ev;
            }
            gw_event_free(ev);
        }
    }
    return NULL;
}

/* Runs a started generate call as far as its queued events allow: called when the request
 * is complete and again each time its parked connection is resumed. The first event decides
 * the answer (a refusal, a stream, or the one chunk of stream=false, which waits for the END
 * after it); returns MHD_YES with the connection parked while an event is missing. */
static enum MHD_Result generate_step(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r)
{
    for (;;) {
        gw_event_t *ev = NULL;
        int got = take_event(r, "before the answer", &ev);
        if (got < 0)
            return MHD_NO;
        if (got == 0)
            return MHD_YES;
        enum MHD_Result ret;
        size_t which = 0;
        gw_event_t *refused = r->n_calls > 1 ? sibling_refusal(r, &which) : NULL;
        if (refused) {
            gw_event_free(ev);
            calls_cancel(r);
            ret = reply_refused(r, c, which, refused);
            gw_event_free(refused);
            return ret;
        }
        if (r->multi && !r->q->stream) {
            if (gather_event(r, c, ev, &ret))
                return ret;
            continue;
        }
        if (r->whole)
            return reply_whole(r, c, ev);
        if (ev->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END && ev->status != TDM_OK) {
            calls_cancel(r);
            ret = reply_refused(r, c, r->cur, ev);
            gw_event_free(ev);
            return ret;
        }
        if (r->q->stream)
            return reply_stream(h, r, c, ev);
        if (ev->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM) {
            gw_event_free(ev);
            gw_call_cancel(r->call);
            record(r, TDM_EINTERNAL);
            return reply_error(c, TDM_EINTERNAL, NULL, NULL,
                               "the router's answer is not one GenerateChunk");
        }
        r->whole = ev; /* stream=false: the answer once the END after it has come */
    }
}

static enum MHD_Result handle_generate(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r,
                                       oai_kind_t kind)
{
    enum MHD_Result ret;
    if (!check_key(h, c, &ret))
        return ret;
    /* a request may wait long (queue, generation) and a stream's reader may be slow: no idle
     * timeout until it completes (a parked connection has none anyway) */
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT, 0u);
    if (!generate_start(h, c, r, kind, &ret))
        return ret;
    return generate_step(h, c, r);
}

/* ---- other endpoints ---- */

static enum MHD_Result handle_models(tdm_http_t *h, struct MHD_Connection *c, const char *id)
{
    enum MHD_Result ret;
    if (!check_key(h, c, &ret))
        return ret;
    Tandem__V1__ModelsRequest req = TANDEM__V1__MODELS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_error_t err = {0};
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_MODELS, &req.base,
                      &tandem__v1__models_response__descriptor, HTTP_UNARY_TIMEOUT_S, &resp, &err);
    if (rc != TDM_OK)
        return reply_error(c, rc, rc == TDM_EUNAUTHENTICATED ? "invalid_api_key" : NULL, NULL, "%s",
                           err.msg);
    Tandem__V1__ModelsResponse *mr = (Tandem__V1__ModelsResponse *)resp;
    json_t *data = json_array();
    json_t *found = NULL;
    for (size_t i = 0; data && i < mr->n_models; i++) {
        const Tandem__V1__ModelInfo *mi = mr->models[i];
        json_t *o =
            json_pack("{s:o, s:s, s:I, s:s, s:o, s:n, s:i}", "id", http_json_str(mi->name),
                      "object", "model", "created", (json_int_t)h->started, "owned_by", "tandem",
                      "root", http_json_str(mi->name), "parent", "max_model_len", (int)mi->n_ctx);
        if (!o)
            continue;
        if (id && strcmp(id, mi->name) == 0)
            found = json_incref(o);
        json_array_append_new(data, o);
    }
    protobuf_c_message_free_unpacked(resp, NULL);
    if (id) {
        json_decref(data);
        if (!found)
            return reply_error(c, TDM_ENOTFOUND, "model_not_found", "model",
                               "The model '%s' does not exist", id);
        return reply_json(c, 200, found);
    }
    return reply_json(c, 200, json_pack("{s:s, s:o}", "object", "list", "data", data));
}

static enum MHD_Result handle_ready(tdm_http_t *h, struct MHD_Connection *c)
{
    /* HealthResponse.ready is the router's readiness rule: at least one decode node is up and
     * not suspect (decode nodes prefill locally, so prefill nodes are optional) */
    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_error_t err = {0};
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_HEALTH, &req.base,
                      &tandem__v1__health_response__descriptor, 2.0, &resp, &err);
    if (rc != TDM_OK)
        return reply_json(
            c, 503,
            json_pack("{s:s, s:o}", "status", "unavailable", "message", http_json_str(err.msg)));
    Tandem__V1__HealthResponse *hr = (Tandem__V1__HealthResponse *)resp;
    bool ready = hr->ready;
    json_t *v = json_pack("{s:s, s:b, s:o}", "status", ready ? "ready" : "not ready", "ready",
                          ready, "version", http_json_str(hr->version));
    /* refused registrations with their reason: why an expected node is missing (node ids
     * and model details, so only for a request that may see the cluster's state: /ready
     * itself is open to probes) */
    json_t *refused = v && state_key_ok(h, c, NULL) ? json_array() : NULL;
    for (size_t i = 0; refused && i < hr->n_refused; i++)
        json_array_append_new(refused, json_pack("{s:o, s:o, s:f, s:I}", "node_id",
                                                 http_json_str(hr->refused[i]->node_id), "reason",
                                                 http_json_str(hr->refused[i]->reason), "age_s",
                                                 hr->refused[i]->age_s, "count",
                                                 (json_int_t)hr->refused[i]->count));
    if (refused)
        json_object_set_new(v, "refused", refused);
    protobuf_c_message_free_unpacked(resp, NULL);
    if (v && !ready)
        json_object_set_new(v, "message",
                            json_string("no decode node is up and answering (a suspect node, "
                                        "silent past the heartbeat timeout, does not count; "
                                        "decode nodes serve alone, prefill nodes are optional)"));
    return reply_json(c, ready ? 200 : 503, v);
}

static enum MHD_Result handle_metrics(tdm_http_t *h, struct MHD_Connection *c)
{
    Tandem__V1__MetricsRequest req = TANDEM__V1__METRICS_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_error_t err = {0};
    int rc = gw_unary(h->gw, TANDEM__V1__METHOD__METHOD_METRICS, &req.base,
                      &tandem__v1__metrics_response__descriptor, HTTP_UNARY_TIMEOUT_S, &resp, &err);
    if (rc != TDM_OK) {
        char msg[TDM_ERRMSG_MAX + 32];
        int n = snprintf(msg, sizeof msg, "metrics unavailable: %s\n", err.msg);
        return reply(c, tdm_status_info(rc)->http_status, "text/plain; charset=utf-8", msg,
                     n > 0 && (size_t)n < sizeof msg ? (size_t)n : strlen(msg));
    }
    /* the one place the metrics become text, with the gateway's own counters */
    tdm_buf_t text = TDM_BUF_INIT;
    rc = tdm_http_metrics_append((Tandem__V1__MetricsResponse *)resp);
    if (rc == TDM_OK)
        rc = tdm_proto_metrics_text((const Tandem__V1__MetricsResponse *)resp, &text);
    protobuf_c_message_free_unpacked(resp, NULL);
    enum MHD_Result ret = rc == TDM_OK
                              ? reply(c, 200, "text/plain; version=0.0.4; charset=utf-8",
                                      text.data ? text.data : "", text.len)
                              : reply(c, 500, "text/plain; charset=utf-8", "out of memory\n", 14);
    tdm_buf_free(&text);
    return ret;
}

static const char *query_get(void *ctx, const char *name)
{
    return MHD_lookup_connection_value(ctx, MHD_GET_ARGUMENT_KIND, name);
}

/* POST /tokenize and /detokenize (http_tokenize.c), with the router's tokenizer. */
static enum MHD_Result handle_tokenize(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r,
                                       bool detokenize)
{
    enum MHD_Result ret;
    if (!check_key(h, c, &ret))
        return ret;
    if (!h->vocab.tok)
        return reply_error(c, TDM_EUNAVAILABLE, NULL, NULL, "the router has no tokenizer");
    http_model_t m;
    tdm_error_t err = {0};
    const char *served = h->cfg->model.name ? h->cfg->model.name : "";
    if (get_model(h, &m, &err) == TDM_OK)
        served = m.name;
    const char *body = r->body.data ? r->body.data : "";
    unsigned status = 500;
    json_t *v = detokenize ? http_detokenize_json(&h->vocab, served, body, r->body.len, &status)
                           : http_tokenize_json(&h->vocab, served, body, r->body.len, &status);
    return reply_json(c, status, v);
}

/* OPTIONS (any path), /tokenize, /detokenize and /version; false when url is none of them. */
static bool route_conv(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r, const char *url,
                       const char *method, enum MHD_Result *ret)
{
    if (strcmp(method, "OPTIONS") == 0) {
        if (!r->rid[0])
            http_request_id_new(r->rid, sizeof r->rid);
        *ret = (enum MHD_Result)http_options(h->cfg, c, r->rid);
        return true;
    }
    bool tok = strcmp(url, "/tokenize") == 0, detok = strcmp(url, "/detokenize") == 0;
    if (tok || detok) {
        if (strcmp(method, "POST") != 0)
            *ret = reply_bad_http(c, 405, "method_not_allowed", "%s %s: use POST", method, url);
        else if (r->too_large)
            *ret =
                reply_bad_http(c, 413, "request_too_large",
                               "the request body is larger than %u bytes", TDM_HTTP_MAX_BODY_BYTES);
        else
            *ret = handle_tokenize(h, c, r, detok);
        return true;
    }
    if (strcmp(url, "/version") != 0)
        return false;
    if (strcmp(method, "GET") != 0 && strcmp(method, "HEAD") != 0)
        *ret = reply_bad_http(c, 405, "method_not_allowed", "%s %s: use GET", method, url);
    else
        *ret = reply_json(c, 200, json_pack("{s:s}", "version", TANDEM_VERSION));
    return true;
}

/* ---- the access handler ---- */

static enum MHD_Result route(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r,
                             const char *url, const char *method)
{
    bool get = strcmp(method, "GET") == 0 || strcmp(method, "HEAD") == 0;
    bool post = strcmp(method, "POST") == 0;
    enum MHD_Result ret;
    if (route_conv(h, c, r, url, method, &ret))
        return ret;
    if (strcmp(url, "/v1/completions") == 0 || strcmp(url, "/v1/chat/completions") == 0) {
        if (!post)
            return reply_bad_http(c, 405, "method_not_allowed", "%s %s: use POST", method, url);
        if (r->too_large)
            return reply_bad_http(c, 413, "request_too_large",
                                  "the request body is larger than %u bytes",
                                  TDM_HTTP_MAX_BODY_BYTES);
        return handle_generate(h, c, r,
                               strcmp(url, "/v1/completions") == 0 ? OAI_COMPLETION : OAI_CHAT);
    }
    if (r->too_large)
        return reply_bad_http(c, 413, "request_too_large",
                              "the request body is larger than %u bytes", TDM_HTTP_MAX_BODY_BYTES);
    bool known = strcmp(url, "/") == 0 || strcmp(url, "/health") == 0 ||
                 strcmp(url, "/ready") == 0 || strcmp(url, "/metrics") == 0 ||
                 strcmp(url, "/api/status") == 0 || strcmp(url, "/api/capacity") == 0 ||
                 strcmp(url, "/v1/models") == 0 || strncmp(url, "/v1/models/", 11) == 0;
    if (!known)
        return reply_error(c, TDM_ENOTFOUND, "not_found", NULL,
                           "no such endpoint: %s %s (see docs/api.md, HTTP API)", method, url);
    if (!get)
        return reply_bad_http(c, 405, "method_not_allowed", "%s %s: use GET", method, url);
    bool state = strcmp(url, "/") == 0 || strcmp(url, "/metrics") == 0 ||
                 strcmp(url, "/api/status") == 0 || strcmp(url, "/api/capacity") == 0;
    if (state && !check_state_key(h, c, &ret))
        return ret;
    if (strcmp(url, "/") == 0)
        return reply(c, 200, "text/html; charset=utf-8", tdm_dashboard_html,
                     tdm_dashboard_html_len);
    if (strcmp(url, "/health") == 0)
        return reply(c, 200, "application/json", "{\"status\":\"ok\"}\n", 16);
    if (strcmp(url, "/ready") == 0)
        return handle_ready(h, c);
    if (strcmp(url, "/metrics") == 0)
        return handle_metrics(h, c);
    if (strcmp(url, "/v1/models") == 0)
        return handle_models(h, c, NULL);
    if (strncmp(url, "/v1/models/", 11) == 0)
        return handle_models(h, c, url + 11);
    http_model_t m;
    tdm_error_t err = {0};
    bool have = get_model(h, &m, &err) == TDM_OK;
    if (strcmp(url, "/api/status") == 0)
        return reply_json(c, 200, dash_status_json(h->dash, have ? &m : NULL));
    unsigned status = 200;
    json_t *v = dash_capacity_json(h->dash, have ? &m : NULL, query_get, c, &status);
    return reply_json(c, status, v);
}

/* Checks the body's framing before any of it is read (libmicrohttpd reads a body of an
 * unknown Transfer-Encoding until the connection closes): only "chunked" or a decimal
 * Content-Length, not both (RFC 9112 6.1, 6.3: a request with both is how requests are
 * smuggled). Returns true, or false with a 400 queued and *ret its result. */
static bool framing_ok(struct MHD_Connection *c, enum MHD_Result *ret)
{
    const char *te =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING);
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (te && strcasecmp(te, "chunked") != 0) {
        *ret = reply_error(c, TDM_EINVALID, "bad_framing", NULL,
                           "Transfer-Encoding '%.100s' is not supported: send 'chunked' or a "
                           "Content-Length",
                           te);
        return false;
    }
    if (te && cl) {
        *ret = reply_error(c, TDM_EINVALID, "bad_framing", NULL,
                           "a request with both Transfer-Encoding and Content-Length is refused");
        return false;
    }
    if (cl && (!cl[0] || strspn(cl, "0123456789") != strlen(cl) || strlen(cl) > 19)) {
        *ret = reply_error(c, TDM_EINVALID, "bad_framing", NULL,
                           "Content-Length '%.100s' is not a decimal byte count", cl);
        return false;
    }
    return true;
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
    r->fd = client_fd(c);
    *con_cls = r;
    const char *rid = MHD_lookup_connection_value(c, MHD_HEADER_KIND, "X-Request-Id");
    if (http_request_id_ok(rid))
        snprintf(r->rid, sizeof r->rid, "%s", rid);
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_SOCKET_CONTEXT);
    if (ci && ci->socket_context)
        ((http_conn_t *)ci->socket_context)->req = r;
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
            return reply_bad_http(c, 413, "request_too_large",
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
        if (!r->too_large && r->body.len + n > TDM_HTTP_MAX_BODY_BYTES) {
            r->too_large = true;
            tdm_buf_free(&r->body);
        }
        if (r->too_large) {
            /* read and drop it, so the client sees the 413 instead of a reset connection;
             * past HTTP_DISCARD_MAX the answer goes out at once and the connection closes */
            r->discarded += n;
            if (r->discarded > HTTP_DISCARD_MAX)
                return reply_bad_http(c, 413, "request_too_large",
                                      "the request body is larger than %u bytes",
                                      TDM_HTTP_MAX_BODY_BYTES);
            return MHD_YES;
        }
        if (tdm_buf_append(&r->body, upload_data, n) != TDM_OK)
            return MHD_NO;
        return MHD_YES;
    }
    if (r->call) /* resumed: the call's next events */
        return generate_step(h, c, r);
    return route(h, c, r, url, method);
}

static void on_completed(void *cls, struct MHD_Connection *c, void **con_cls,
                         enum MHD_RequestTerminationCode toe)
{
    tdm_http_t *h = cls;
    http_req_t *r = *con_cls;
    if (!r)
        return;
    if (r->call) {
        if (!r->cancelled && calls_running(r)) {
            tdm_log_write(&h->log, TDM_LOG_INFO, r->q ? r->q->id : NULL, NULL,
                          "http request ended before its answer (termination %d): cancelled",
                          (int)toe);
            calls_cancel(r);
            record(r, TDM_ECANCELLED);
        }
        r->call = NULL;
        for (size_t i = 0; i < r->n_calls; i++)
            gw_call_release(&r->calls[i]);
        pthread_mutex_lock(&h->mu);
        if (--h->n_calls == 0)
            pthread_cond_broadcast(&h->idle);
        pthread_mutex_unlock(&h->mu);
    }
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
    oai_out_clear(&r->out);
    free(r);
    *con_cls = NULL;
    MHD_set_connection_option(c, MHD_CONNECTION_OPTION_TIMEOUT,
                              (unsigned)h->cfg->router.http_connection_timeout_s);
}

/* A connection's socket context (http_conn_t): made when it opens, freed when it closes. */
static void on_connection(void *cls, struct MHD_Connection *c, void **socket_context,
                          enum MHD_ConnectionNotificationCode toe)
{
    (void)cls;
    (void)c;
    if (toe == MHD_CONNECTION_NOTIFY_STARTED) {
        *socket_context = calloc(1, sizeof(http_conn_t)); /* NULL: replies go without ids */
    } else {
        free(*socket_context);
        *socket_context = NULL;
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
        h->dash = dash_new(h->gw, err);
    if (h->dash) {
        /* a pool of threads over epoll, connections parked while they wait for the router */
        unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_EPOLL |
                         MHD_ALLOW_SUSPEND_RESUME | MHD_USE_ERROR_LOG | (v6 ? MHD_USE_IPv6 : 0);
        const tdm_router_config_t *rc = &cfg->router;
        h->mhd = MHD_start_daemon(
            flags, (uint16_t)rc->http_port, NULL, NULL, on_request, h, MHD_OPTION_SOCK_ADDR,
            (struct sockaddr *)sa, MHD_OPTION_NOTIFY_COMPLETED, on_completed, h,
            MHD_OPTION_NOTIFY_CONNECTION, on_connection, h, MHD_OPTION_THREAD_POOL_SIZE,
            (unsigned)rc->http_threads, MHD_OPTION_CONNECTION_TIMEOUT,
            (unsigned)rc->http_connection_timeout_s, MHD_OPTION_CONNECTION_LIMIT,
            (unsigned)rc->http_max_connections, MHD_OPTION_PER_IP_CONNECTION_LIMIT,
            (unsigned)rc->http_max_connections_per_client, MHD_OPTION_EXTERNAL_LOGGER, on_mhd_log,
            h, MHD_OPTION_END);
        if (!h->mhd)
            tdm_error_set(err, TDM_EUNAVAILABLE, "cannot serve HTTP on %s port %d: %s", h->host,
                          cfg->router.http_port,
                          h->mhd_error[0] ? h->mhd_error : "libmicrohttpd failed to start");
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return h->mhd ? TDM_OK : (err ? err->code : TDM_EUNAVAILABLE);
}

tdm_http_t *tdm_http_new(const tdm_config_t *cfg, const char *router_endpoint,
                         const tdm_http_vocab_t *vocab, tdm_net_t *net, const tdm_logger_t *log,
                         tdm_error_t *err)
{
    tdm_http_t *h = calloc(1, sizeof *h);
    if (!h) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    h->cfg = cfg;
    h->net = net;
    if (vocab)
        h->vocab = *vocab;
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
    struct sockaddr_storage sa;
    bool v6 = false;
    char ep[512];
    connectable(router_endpoint, ep, sizeof ep);
    if (listen_address(h, &sa, &v6, err) != TDM_OK || start_threads(h, ep, &sa, v6, err) != TDM_OK)
        goto out_free;
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    h->port = di ? di->port : (uint16_t)cfg->router.http_port;
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
    if (h->gw && h->mhd)
        drain_calls(h);
    /* end the calls left, so every connection thread finishes, then join them */
    if (h->gw)
        gw_shutdown(h->gw);
    if (h->mhd)
        MHD_stop_daemon(h->mhd);
    dash_destroy(&h->dash);
    gw_destroy(&h->gw);
    pthread_cond_destroy(&h->idle);
    pthread_mutex_destroy(&h->mu);
    free(h);
    *self_p = NULL;
}

uint16_t tdm_http_port(const tdm_http_t *h)
{
    return h->port;
}
