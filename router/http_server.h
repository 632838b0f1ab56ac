/* http_server.h - what the HTTP gateway's server (http_server.c), generation
 * (http_generate.c) and other endpoints (http_endpoints.c) share: the gateway object, a
 * request's state, the replies and the checks every endpoint makes.
 */
#ifndef TANDEM_ROUTER_HTTP_SERVER_H
#define TANDEM_ROUTER_HTTP_SERVER_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include <microhttpd.h>

#include "http_accept.h"
#include "http_gateway.h"
#include "http_openai.h"
#include "http_json.h"
#include "http_metrics.h"
#include "dashboard.h"
#include "http.h"
#include "responses_store.h"
#include "tandem/limits.h"

/* Longest wait of a unary call to the router (MODELS, HEALTH, METRICS), s. */
#define HTTP_UNARY_TIMEOUT_S 5.0

struct tdm_http {
    const tdm_config_t *cfg;
    tdm_net_t *net; /* the router's; the gateway's client uses it (inproc://) */
    tdm_logger_t log;
    gw_t *gw;
    dash_t *dash;
    struct MHD_Daemon *mhd;
    http_acc_t *acc; /* the front door: listening socket, limits, deadlines */
    uint16_t port;
    char host[128];
    const char *internal_key; /* the first configured API key, for the gateway's own calls */
    long long started;        /* unix seconds ("created" of /v1/models) */
    char mhd_error[256];      /* last message libmicrohttpd logged */
    pthread_mutex_t mu;
    pthread_cond_t idle; /* signalled when n_calls drops to 0 */
    size_t n_calls;      /* under mu: connections holding a generate call */
    size_t n_requests;   /* under mu: HTTP requests begun and not completed */
    uint64_t body_bytes; /* under mu: request body bytes read, plus HTTP_TRIM_CONN_BYTES per
                            closed connection, since the heap was last trimmed */
    bool have_model;     /* under mu */
    http_model_t model;
    /* per served model (cfg->models order): its tokenizer (/tokenize; tok NULL: none) and its
     * template's family (http_family.c) */
    tdm_http_vocab_t vocabs[TDM_CONFIG_MAX_MODELS];
    oai_family_ctx_t families[TDM_CONFIG_MAX_MODELS];
    size_t n_models;
    http_counters_t *counters; /* responses by code, the gateway's own refusals */
    resp_store_t *responses; /* /v1/responses answers with store true (router.responses_store_*) */
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
    bool cancelled;         /* this side cancelled the call (client gone) */
    bool counted;           /* in h->n_requests */
    struct resp_call *resp; /* a /v1/responses request (http_responses.c), else NULL */
    struct emb_call *emb;   /* a /v1/embeddings request's call (http_embeddings.c), else NULL */
    /* X-Request-Id of every reply: the client's own when valid, else the router's (the
     * generate call's id, or a new one made when a reply needs it) */
    char rid[TDM_REQUEST_ID_MAX + 1];
} http_req_t;

/* Replies with body (copied) and status. A 401 challenges Bearer and Basic; a 429 or 503
 * carries Retry-After: 1. Every reply has X-Request-Id and, for an allowed Origin, the CORS
 * headers. Returns libmicrohttpd's result. */
enum MHD_Result http_reply(struct MHD_Connection *c, unsigned status, const char *ctype,
                           const void *body, size_t len);

/* Replies with v as JSON (consumed; NULL: a 500 "out of memory"); a 429 or 503 says
 * Retry-After: retry_after_s (at least 1). */
enum MHD_Result http_reply_json_retry(struct MHD_Connection *c, unsigned status, json_t *v,
                                      uint32_t retry_after_s);
enum MHD_Result http_reply_json(struct MHD_Connection *c, unsigned status, json_t *v);

/* Replies with OpenAI's error body for status (a tdm status) under the HTTP status of its row
 * of the status table; code (NULL: the row's) and param (NULL: none) as given. */
enum MHD_Result http_reply_error(struct MHD_Connection *c, int status, const char *code,
                                 const char *param, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));

/* Replies to a refusal of the HTTP request itself (wrong method: 405, too large: 413) with
 * INVALID_ARGUMENT's error body under http_status and code. */
enum MHD_Result http_reply_bad_http(struct MHD_Connection *c, unsigned http_status,
                                    const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* The API key check of the OpenAI endpoints (router.api_keys; none configured: true). Returns
 * true, or false with a 401 queued and *ret its result. */
bool http_check_key(tdm_http_t *h, struct MHD_Connection *c, enum MHD_Result *ret);

/* The parker that suspends connection c while its call has no event (MHD_suspend_connection)
 * and resumes it when one comes (gw_call_take). */
gw_parker_t http_parker(struct MHD_Connection *c);

/* Whether the client's socket fd says it hung up (or failed); does not wait. false for fd < 0. */
bool http_client_gone(int fd);

/* Whether a request may see the cluster's state: no key is needed (router.api_keys unset or
 * router.public_metrics), or it carries one that passes tdm_config_api_key_ok, as "Authorization:
 * Bearer KEY" or as the password of HTTP Basic. *missing (may be NULL) tells a request with no
 * key. */
bool http_state_key_ok(const tdm_http_t *h, struct MHD_Connection *c, bool *missing);

/* The same for the state pages (/, /metrics, /api/...), unless router.public_metrics; the
 * dashboard's Basic password counts as the key. */
bool http_check_state_key(tdm_http_t *h, struct MHD_Connection *c, enum MHD_Result *ret);

/* The served model into *m, asked of the router (MODELS) the first time and kept. Returns 0
 * or the call's status with *err set. */
int http_model_get(tdm_http_t *h, http_model_t *m, tdm_error_t *err);

/* Every served model, in the router's order, into out[0..cap) and *n. Returns 0 or the MODELS
 * call's status. */
int http_models_all(tdm_http_t *h, http_model_t *out, size_t cap, size_t *n, tdm_error_t *err);

/* The served model named (name or alias) into *m, from a MODELS call. Returns 0, TDM_ENOTFOUND
 * (*err: "model 'X' is not served here", field "model") or the call's status. */
int http_model_named(tdm_http_t *h, const char *name, http_model_t *m, tdm_error_t *err);

/* The name of the model node id serves (the router's STATUS) into buf (cap bytes). Returns 0,
 * TDM_ENOTFOUND (no such node, field "node") or the call's status. */
int http_node_model(tdm_http_t *h, const char *id, char *buf, size_t cap, tdm_error_t *err);

/* Answers a request on the generation endpoints (http_generate.c): kind from the URL; r->body
 * holds the whole body. */
enum MHD_Result http_generate(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r,
                              oai_kind_t kind);

/* POST /v1/embeddings (http_embeddings.c): r->body holds the whole body. Starts the EMBED call
 * (r->emb) and parks the connection until it ends: no HTTP thread waits on the nodes. */
enum MHD_Result http_embeddings(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r);

/* A parked /v1/embeddings request resumed (r->emb set): its answer once the call ended, else
 * parked again. */
enum MHD_Result http_embeddings_resume(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r);

/* The request completed (toe: libmicrohttpd's termination code): the EMBED call cancelled
 * when it has not ended (the client left), released; r->emb NULL. */
void http_embeddings_end(tdm_http_t *h, http_req_t *r, int toe);

/* Continues r's generate request when its parked connection is resumed: the calls' next
 * events (http_generate.c). */
enum MHD_Result http_generate_resume(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r);

/* Ends r's generate request when its connection is done with it (termination toe, for the
 * log): calls still running are cancelled (the request counts as CANCELLED), every call is
 * released and h's count of connections holding calls drops (http_generate.c). */
void http_generate_end(tdm_http_t *h, http_req_t *r, int toe);

/* Adds X-Request-Id (made now when c's request has none yet) and the CORS headers to resp. */
void http_add_conv_headers(struct MHD_Connection *c, struct MHD_Response *resp);

/* The client's socket of c, or -1. */
int http_client_fd(struct MHD_Connection *c);

/* Routes a request (http_endpoints.c): url and method as libmicrohttpd gives them; answers 404
 * for an unknown path, 405 for a wrong method, 413 for a body over TDM_HTTP_MAX_BODY_BYTES. */
enum MHD_Result http_route(tdm_http_t *h, struct MHD_Connection *c, http_req_t *r, const char *url,
                           const char *method);

#endif /* TANDEM_ROUTER_HTTP_SERVER_H */
