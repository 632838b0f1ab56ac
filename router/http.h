/* http.h - the router's HTTP gateway: the OpenAI-compatible API (/v1/completions,
 * /v1/chat/completions with SSE streaming, /v1/responses, /v1/models), /tokenize, /detokenize,
 * /version, /health, /ready, /metrics, the dashboard (/) and its JSON (/api/status,
 * /api/capacity), with X-Request-Id on every reply and CORS for router.cors_origins.
 *
 * The gateway is a client of the router's native API: one gateway thread owns a client of the
 * client library (tandem/client.h) connected to the router's inproc:// endpoint on the router's
 * ZMQ context, and runs every HTTP request as one of its calls; libmicrohttpd serves the
 * connections on a bounded thread pool (router.http_threads; connection, per-client and idle
 * limits from router.http_*), and the two sides meet in per-call event queues: a connection
 * whose next event has not come is suspended, and the gateway thread resumes it. So the
 * router's single-threaded loop is never touched from an HTTP thread, no pool thread waits for
 * tokens, and a slow or stalled HTTP client holds up only its own stream. A front door of its
 * own (http_accept.h) accepts connections and hands one to libmicrohttpd only once its request
 * headers are complete; it enforces the connection limits with 429/503 answers, the header
 * deadline, the body rate and eviction. API keys of HTTP requests are checked here.
 * docs/api.md "HTTP API (OpenAI-compatible)" describes the endpoints.
 */
#ifndef TANDEM_ROUTER_HTTP_H
#define TANDEM_ROUTER_HTTP_H

#include <stdint.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/prompt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest request body accepted, bytes; a larger one is answered with 413. */
#define TDM_HTTP_MAX_BODY_BYTES (4u << 20)

/* Work budgets of one request, checked before it is sent to the router (so before any
 * compilation), in units of work rather than time: tools at most (OpenAI's limit), and the
 * bytes of a constraint: a regular expression; a JSON Schema, a grammar or a choice list; the
 * grammar made of tool_choice "required" or a named function. Over one: 400 naming the field. */
#define TDM_HTTP_MAX_TOOLS 128u
#define TDM_HTTP_MAX_REGEX_BYTES TDM_CONSTRAINT_MAX_REGEX_BYTES
#define TDM_HTTP_MAX_CONSTRAINT_BYTES (256u << 10)
#define TDM_HTTP_MAX_TOOL_GRAMMAR_BYTES TDM_CONSTRAINT_MAX_BYTES

typedef struct tdm_http tdm_http_t;

/* A served model's tokenizer, chat template (NULL: none) and context length, for /tokenize,
 * /detokenize and the chat output parsers (tdm_router_model_vocab). Borrowed: they must outlive
 * the gateway. */
typedef struct tdm_http_vocab {
    const tdm_tokenizer_t *tok; /* NULL: /tokenize and /detokenize answer 503 */
    const tdm_chat_pick_t *pick;
    uint32_t n_ctx; /* tokens */
} tdm_http_vocab_t;

/* Starts the gateway: connects its client to router_endpoint (tdm_router_inproc_endpoint on
 * the router's net; any client endpoint works: a wildcard host such as "tcp://0.0.0.0:7600" or
 * the star host of ZMQ is reached through 127.0.0.1) and serves HTTP on cfg->router.http_address :
 * cfg->router.http_port (an IPv6 literal such as "::1" works too), then logs
 * "http gateway ready url=http://HOST:PORT router=ENDPOINT". API keys (cfg->router.api_keys)
 * are required on /v1/... as "Authorization: Bearer KEY" and checked here with
 * tdm_config_api_key_ok (without keys any Authorization is ignored); every call to the router
 * carries the first configured key. vocabs[n_vocabs]: one per cfg->models entry, in order (NULL,
 * 0: none; models past n_vocabs have none). cfg, vocabs, net and log are borrowed and must
 * outlive the gateway (log NULL: stderr). Returns NULL with *err set: TDM_EINVALID (bad address or
 * endpoint), TDM_EUNAVAILABLE (the port is in use or cannot be bound; the message names address and
 * port), TDM_ERESOURCE (out of memory, no thread). Caller frees with tdm_http_destroy. */
tdm_http_t *tdm_http_new(const tdm_config_t *cfg, const char *router_endpoint,
                         const tdm_http_vocab_t *vocabs, size_t n_vocabs, tdm_net_t *net,
                         const tdm_logger_t *log, tdm_error_t *err);

/* Stops the gateway: calls in flight end (their HTTP clients get 503, or an error event on a
 * stream that has started; the router gets CANCEL for them), the HTTP threads are joined,
 * the gateway's client is closed. Call it before destroying net. NULL-safe, nulls *self_p. */
void tdm_http_destroy(tdm_http_t **self_p);

/* The TCP port the gateway listens on. */
uint16_t tdm_http_port(const tdm_http_t *h);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_ROUTER_HTTP_H */
