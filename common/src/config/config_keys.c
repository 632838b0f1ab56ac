/* config_keys.c - the key table: one row per config key (section, name, type, bounds, default,
 * doc line), from which the loader, the defaults, the dumper and the docs table all work.
 *
 * Adding a key is adding a row here and its field in tandem/config.h; docs/operations.md's
 * tables are `tandem config keys` output, which tests/cli/test_config_keys.sh compares with
 * the committed docs. A row's doc is Markdown: it goes into that table after the range.
 */
#include "config_internal.h"

#include <ctype.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/chat.h"
#include "tandem/constraint.h"

#define CURVE_KEY_LEN 40 /* a 32-byte key in Z85 text (zmq_z85_encode) */

/* .offset and .size of a field of tdm_config_t (CFG) or tdm_node_config_t (NODE). */
#define CFG(field)                                                                                 \
    .offset = offsetof(tdm_config_t, field), .size = sizeof(((tdm_config_t *)0)->field)
#define NODE(field)                                                                                \
    .offset = offsetof(tdm_node_config_t, field), .size = sizeof(((tdm_node_config_t *)0)->field)

/* ---- enums ---- */

static const char *const role_names[] = {"prefill", "decode"};
static const char *const policy_names[] = {"round_robin", "least_loaded", "prefix_aware"};
static const char *const compat_names[] = {"none", "vllm"};

const char *tdm_config_node_role_name(tdm_node_role_t role)
{
    return (unsigned)role < TDM_CONFIG_N_OF(role_names) ? role_names[role] : "?";
}

const char *tdm_config_prefill_policy_name(tdm_prefill_policy_t policy)
{
    return (unsigned)policy < TDM_CONFIG_N_OF(policy_names) ? policy_names[policy] : "?";
}

static const char *role_name(int v)
{
    return tdm_config_node_role_name((tdm_node_role_t)v);
}

static const char *policy_name(int v)
{
    return tdm_config_prefill_policy_name((tdm_prefill_policy_t)v);
}

static const char *compat_name(int v)
{
    return (unsigned)v < TDM_CONFIG_N_OF(compat_names) ? compat_names[v] : "?";
}

static const char *kv_dtype_name(int v)
{
    return tdm_kv_dtype_name((tdm_kv_dtype_t)v);
}

static const char *log_level_name(int v)
{
    return tdm_log_level_name((tdm_log_level_t)v);
}

static const char *reasoning_parser_name(int v)
{
    static const char *const names[] = {"auto", "none", "deepseek_r1", "qwen3"};
    return (unsigned)v < TDM_CONFIG_N_OF(names) ? names[v] : "?";
}

static const char *tool_call_parser_name(int v)
{
    static const char *const names[] = {"auto", "hermes", "llama3_json", "mistral"};
    return (unsigned)v < TDM_CONFIG_N_OF(names) ? names[v] : "?";
}

static const tdm_config_enum_t reasoning_parsers = {reasoning_parser_name, 4, NULL, NULL};
static const tdm_config_enum_t tool_call_parsers = {tool_call_parser_name, 4, NULL, NULL};
static const tdm_config_enum_t roles = {role_name, 2, NULL, NULL};
static const tdm_config_enum_t policies = {policy_name, 3, NULL, NULL};
static const tdm_config_enum_t compat = {compat_name, 2, NULL, NULL};
static const tdm_config_enum_t kv_dtypes = {kv_dtype_name, TDM_KV_Q8 + 1, NULL, NULL};
static const tdm_config_enum_t log_levels = {log_level_name, TDM_LOG_OFF + 1, tdm_log_level_parse,
                                             "(`warning` = `warn`)"};

/* ---- string checks ---- */

bool tdm_config_endpoint_valid(const char *s)
{
    if (strncmp(s, "ipc://", 6) == 0)
        return s[6] != '\0';
    if (strncmp(s, "inproc://", 9) == 0)
        return s[9] != '\0';
    if (strncmp(s, "tcp://", 6) != 0)
        return false;
    const char *colon = strrchr(s + 6, ':');
    if (!colon || colon == s + 6 || colon[1] == '\0')
        return false;
    long port = 0;
    for (const char *p = colon + 1; *p; p++) {
        if (!isdigit((unsigned char)*p) || (port = port * 10 + (*p - '0')) > 65535)
            return false;
    }
    for (const char *p = s + 6; p < colon; p++)
        if (isspace((unsigned char)*p) || *p == '/')
            return false;
    return port >= 1;
}

/* An endpoint other hosts connect to (router.node_advertise, nodes[].kv_advertise): a tcp://
 * one must name a host, not a wildcard that only a bind takes. */
static bool advertise_refused(const char *s, const char *got, char *why, size_t cap)
{
    static const char *const wildcards[] = {"*", "0.0.0.0", "[::]", "::", "[*]"};
    (void)got;
    if (strncmp(s, "tcp://", 6) != 0)
        return false;
    const char *host = s + 6;
    size_t n = (size_t)(strrchr(host, ':') - host);
    for (size_t i = 0; i < TDM_CONFIG_N_OF(wildcards); i++) {
        if (strlen(wildcards[i]) == n && strncmp(host, wildcards[i], n) == 0) {
            snprintf(why, cap,
                     "must name a host the other nodes can reach, not the wildcard address '%s' "
                     "(a wildcard belongs in the endpoint that is bound)",
                     wildcards[i]);
            return true;
        }
    }
    return false;
}

/* An item of router.node_endpoints: a ZeroMQ endpoint the nodes connect to, so a tcp:// one
 * names a host (advertise_refused). */
static bool router_endpoint_refused(const char *s, const char *got, char *why, size_t cap)
{
    if (!tdm_config_endpoint_valid(s)) {
        snprintf(why, cap,
                 "must be a ZeroMQ endpoint tcp://HOST:PORT, ipc://PATH or inproc://NAME, got %s",
                 got);
        return true;
    }
    return advertise_refused(s, got, why, cap);
}

static bool curve_key_refused(const char *s, const char *got, char *why, size_t cap)
{
    static const char z85[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                              ".-:+=^!/*?&<>()[]{}@%$#";
    (void)got;
    if (strlen(s) == CURVE_KEY_LEN && strspn(s, z85) == CURVE_KEY_LEN)
        return false;
    snprintf(why, cap,
             "must be a %d-character Z85 CURVE public key (tandem keys generate writes one), got "
             "%zu characters",
             CURVE_KEY_LEN, strlen(s));
    return true;
}

bool tdm_config_node_id_ok(const char *id)
{
    size_t n = strlen(id);
    bool ok = n > 0 && n <= TDM_NODE_ID_MAX;
    for (const char *c = id; ok && *c; c++)
        ok = isalnum((unsigned char)*c) || *c == '.' || *c == '_' || *c == '-';
    return ok;
}

static bool node_id_refused(const char *id, const char *got, char *why, size_t cap)
{
    bool ok = tdm_config_node_id_ok(id);
    if (!ok)
        snprintf(why, cap, "must be 1 to %d characters of A-Z a-z 0-9 . _ -, got %s",
                 TDM_NODE_ID_MAX, got);
    return !ok;
}

static bool api_key_refused(const char *k, const char *got, char *why, size_t cap)
{
    (void)got;
    for (const char *c = k; *c; c++) {
        if (isspace((unsigned char)*c) || iscntrl((unsigned char)*c)) {
            snprintf(why, cap, "must not contain spaces or control characters");
            return true;
        }
    }
    return false;
}

/* model.chat_template: a built-in name, or a template file that exists, is readable, fits
 * the limit and compiles (tdm_chat_template_check). A leading "~/" is expanded as the loader
 * will. */
static bool chat_template_refused(const char *s, const char *got, char *why, size_t cap)
{
    (void)got;
    char path[4096];
    const char *home = getenv("HOME");
    if (strncmp(s, "~/", 2) == 0 && home)
        snprintf(path, sizeof path, "%s/%s", home, s + 2);
    else
        snprintf(path, sizeof path, "%s", s);
    tdm_error_t err = {0};
    if (tdm_chat_template_check(path, &err) == TDM_OK)
        return false;
    snprintf(why, cap, "%s", err.msg);
    return true;
}

/* An Origin as browsers send it: "*", or scheme://host[:port] without a path. */
static bool cors_origin_refused(const char *o, const char *got, char *why, size_t cap)
{
    (void)got;
    if (strcmp(o, "*") == 0)
        return false;
    const char *host = strstr(o, "://");
    const char *msg = NULL;
    if (!host || host == o || !host[3])
        msg = "must be \"*\" or an origin such as \"https://app.example.com:8443\"";
    for (const char *c = o; !msg && *c; c++)
        if (isspace((unsigned char)*c) || iscntrl((unsigned char)*c) || *c == ',')
            msg = "must not contain spaces, commas or control characters";
    if (!msg && strchr(host + 3, '/'))
        msg = "an origin has no path (no '/' after the host)";
    if (msg)
        snprintf(why, cap, "%s", msg);
    return msg != NULL;
}

/* ---- the table ---- */

/* One row per key, Redis standardConfig style: section (TDM_CONFIG_SECTION_…), name, the
 * field (CFG or NODE), flags, then the type's own columns, then the doc line. */
#define ROW(sec, nm, ty, fl)                                                                       \
    .section = TDM_CONFIG_SECTION_##sec, .name = nm, .type = ty, .flags = fl
#define BOOL_KEY(sec, nm, at, dflt, text)                                                          \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_BOOL, 0), at, .def = dflt, .doc = text                        \
    }
#define INT_KEY(sec, nm, at, fl, lo, hi, dflt, un, text)                                           \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_INT, fl), at, .min = lo, .max = hi, .def = dflt, .unit = un,  \
                                                   .doc = text                                     \
    }
#define NUMBER_KEY(sec, nm, at, fl, lo, hi, dflt, dtext, un, text)                                 \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_NUMBER, fl), at, .min = lo, .max = hi, .def = dflt,           \
                                                      .def_text = dtext, .unit = un, .doc = text   \
    }
#define BYTES_KEY(sec, nm, at, fl, lo, hi, dflt, dtext, text)                                      \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_BYTES, fl), at, .min = lo, .max = hi, .def = dflt,            \
                                                     .def_text = dtext, .doc = text                \
    }
#define ENUM_KEY(sec, nm, at, fl, set_at, vals, dflt, text)                                        \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_ENUM, fl), at, .aux_offset = set_at, .values = vals,          \
                                                    .def = dflt, .doc = text                       \
    }
#define TEXT_KEY(sec, nm, ty, at, fl, dtext, check, text)                                          \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_##ty, fl), at, .def_text = dtext, .refuse = check,            \
                                                    .doc = text                                    \
    }
#define LIST_KEY(sec, nm, at, count_at, what, check, text)                                         \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_LIST, 0), at, .aux_offset = count_at, .item = what,           \
                                                   .refuse = check, .doc = text                    \
    }
#define DEVICE_KEY(sec, nm, at, text)                                                              \
    {                                                                                              \
        ROW(sec, nm, TDM_CONFIG_TYPE_DEVICE, 0), at, .doc = text                                   \
    }
#define MAPPING_KEY(sec, nm, subsec, text)                                                         \
    {                                                                                              \
        .section = TDM_CONFIG_SECTION_##sec, .name = nm, .type = TDM_CONFIG_TYPE_MAPPING,          \
        .sub = TDM_CONFIG_SECTION_##subsec, .doc = text                                            \
    }
#define NODES_KEY(sec, nm, text)                                                                   \
    {                                                                                              \
        .section = TDM_CONFIG_SECTION_##sec, .name = nm, .type = TDM_CONFIG_TYPE_NODES,            \
        .doc = text                                                                                \
    }
#define MODELS_KEY(sec, nm, text)                                                                  \
    {                                                                                              \
        .section = TDM_CONFIG_SECTION_##sec, .name = nm, .type = TDM_CONFIG_TYPE_MODELS,           \
        .sub = TDM_CONFIG_SECTION_MODEL, .doc = text                                               \
    }
#define REMOVED_KEY(sec, nm, text)                                                                 \
    {                                                                                              \
        .section = TDM_CONFIG_SECTION_##sec, .name = nm, .type = TDM_CONFIG_TYPE_REMOVED,          \
        .doc = text                                                                                \
    }

#define SHARED_KEYS_REMOVED                                                                        \
    "give the router its own pair in router.curve_public_key / router.curve_secret_key_file and "  \
    "each node its own in nodes[].curve_public_key / nodes[].curve_secret_key_file (tandem keys "  \
    "generate writes them)"

static const tdm_config_key_t keys[] = {
    MAPPING_KEY(TOP, "model", MODEL, "the model served"),
    MODELS_KEY(TOP, "models",
               "several models served: a list of `model` sections (not with `model`)"),
    MAPPING_KEY(TOP, "router", ROUTER, "the router's endpoints and scheduler"),
    MAPPING_KEY(TOP, "kv", KV, "the paged KV cache, the same on every node"),
    MAPPING_KEY(TOP, "log", LOG, "logging"),
    MAPPING_KEY(TOP, "security", SECURITY, "what the daemons may do unprotected"),
    NODES_KEY(TOP, "nodes", "the nodes"),

    TEXT_KEY(MODEL, "path", PATH, CFG(model.path), TDM_CONFIG_DERIVED,
             "`$TANDEM_MODEL`, else "
             "`${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/" TDM_DEFAULT_MODEL_FILE "`",
             NULL,
             "the GGUF file served; a leading `~/` is expanded, a relative path is taken from the "
             "working directory"),
    TEXT_KEY(MODEL, "chat_template", PATH, CFG(model.chat_template), TDM_CONFIG_OPTIONAL, NULL,
             chat_template_refused,
             "the chat template: a built-in name (`chatml`, `llama3`, `llama2`, `gemma`) or a "
             "Jinja template file (at most 256 KiB; it must compile); `null` uses the model's "
             "`tokenizer.chat_template` (a built-in family for a file without one: "
             "docs/models.md)"),
    TEXT_KEY(MODEL, "name", STRING, CFG(model.name), TDM_CONFIG_DERIVED,
             "the file name of `path` without `.gguf`", NULL,
             "the model name clients use (`/v1/models`)"),
    LIST_KEY(MODEL, "aliases", CFG(model.aliases), offsetof(tdm_config_t, model.n_aliases),
             "model name", NULL,
             "more names clients may use for this model (the `model` field of a request); names "
             "and aliases are distinct across `models`"),
    ENUM_KEY(MODEL, "reasoning_parser", CFG(model.reasoning_parser), 0, 0, &reasoning_parsers,
             TDM_REASONING_PARSER_AUTO,
             "how chat output is split into `reasoning_content` and `content`: `auto` from the "
             "chat template (docs/models.md, \"Reasoning and tool-call formats\"); `none`; "
             "`deepseek_r1` (output begins inside `<think>`); `qwen3` (a leading `<think>` opens "
             "the reasoning)"),
    ENUM_KEY(MODEL, "tool_call_parser", CFG(model.tool_call_parser), 0, 0, &tool_call_parsers,
             TDM_TOOL_CALL_PARSER_AUTO,
             "the format tool calls are parsed from and constrained to: `auto` from the chat "
             "template (docs/models.md); `hermes` (`<tool_call>`); `llama3_json`; `mistral` "
             "(`[TOOL_CALLS]`)"),
    INT_KEY(MODEL, "max_context", CFG(model.max_context), 0, 0, 16777216, 0, "tokens",
            "the context the cluster serves (vLLM's `max_model_len`): prompt + output tokens of "
            "one sequence; 0: the model's trained context, at most 4,096 (llama.cpp's default); "
            "else 2 up to the trained context, checked when the model is opened (the router and "
            "nodes exit naming it; `tandem config check` too). Every node's KV pool must hold one "
            "sequence of it "
            "(docs/capacity.md)"),
    MAPPING_KEY(MODEL, "defaults", MODEL_DEFAULTS,
                "the sampling this model's requests get for the fields they leave unset (as "
                "vLLM's per-model generation config); the defaults are Tandem's own"),
    NUMBER_KEY(MODEL_DEFAULTS, "temperature", CFG(model.defaults.temperature), 0, 0, 5, 1, NULL,
               NULL, "a request's `temperature` when it sets none"),
    NUMBER_KEY(MODEL_DEFAULTS, "top_p", CFG(model.defaults.top_p), TDM_CONFIG_MIN_OPEN, 0, 1, 1,
               NULL, NULL, "a request's `top_p` when it sets none"),
    INT_KEY(MODEL_DEFAULTS, "top_k", CFG(model.defaults.top_k), 0, 0, 1048576, 0, "tokens",
            "a request's `top_k` when it sets none (0: off; more than the vocabulary fails the "
            "request)"),
    NUMBER_KEY(MODEL_DEFAULTS, "repetition_penalty", CFG(model.defaults.repetition_penalty),
               TDM_CONFIG_MIN_OPEN, 0, 10, 1, NULL, NULL,
               "a request's `repetition_penalty` when it sets none"),
    INT_KEY(MODEL_DEFAULTS, "max_tokens", CFG(model.defaults.max_tokens), 0, 0, 1048576, 0,
            "tokens",
            "output tokens of a request that sets none (native `max_tokens` 0, "
            "`/v1/chat/completions` without it; `/v1/completions` keeps OpenAI's 16), at most "
            "what the context leaves; 0: what the context leaves, at most 1,024"),

    TEXT_KEY(ROUTER, "client_endpoint", ENDPOINT, CFG(router.client_endpoint), 0,
             "tcp://127.0.0.1:7600", NULL, "client API (ZeroMQ, protobuf)"),
    TEXT_KEY(ROUTER, "node_endpoint", ENDPOINT, CFG(router.node_endpoint), 0,
             "tcp://127.0.0.1:7601", NULL,
             "what the router binds for the prefill and decode nodes"),
    TEXT_KEY(
        ROUTER, "node_advertise", ENDPOINT, CFG(router.node_advertise), TDM_CONFIG_OPTIONAL, NULL,
        advertise_refused,
        "what the nodes connect to when it is not `node_endpoint`: e.g. bind `tcp://0.0.0.0:7601`, "
        "advertise `tcp://router:7601`; not a wildcard address (\"Deployment\")"),
    LIST_KEY(ROUTER, "node_endpoints", CFG(router.node_endpoints),
             offsetof(tdm_config_t, router.n_node_endpoints), "router endpoint",
             router_endpoint_refused,
             "several routers sharing the node pools: the node endpoint of each router process "
             "(as the nodes reach it), at most 16, no repeats; every node registers with each "
             "and every router serves the whole pool (\"Several routers\"); not with "
             "`node_advertise`. Empty: the nodes register with the one router at `node_advertise` "
             "or `node_endpoint`"),
    TEXT_KEY(ROUTER, "http_address", STRING, CFG(router.http_address), 0, "127.0.0.1", NULL,
             "bind address of the HTTP API (OpenAI-compatible, `/metrics`, `/health`)"),
    INT_KEY(ROUTER, "http_port", CFG(router.http_port), 0, 1, 65535, 8000, NULL,
            "the HTTP API's TCP port; not also the port of a ZMQ endpoint bound on the same "
            "address of the router's host (`config check`)"),
    INT_KEY(ROUTER, "http_threads", CFG(router.http_threads), 0, 1, 256, 4, "threads",
            "the HTTP gateway's pool (epoll); requests waiting for the router hold no thread "
            "(\"HTTP limits\")"),
    INT_KEY(ROUTER, "http_connection_timeout_s", CFG(router.http_connection_timeout_s), 0, 1, 3600,
            30, "seconds",
            "an HTTP connection on which nothing arrives this long (headers, body, keep-alive) is "
            "closed"),
    INT_KEY(ROUTER, "http_max_connections", CFG(router.http_max_connections), 0, 1, 100000, 1000,
            "connections",
            "open at once; when full, a new one takes the place of the one that has sent least for "
            "longest, else it is answered 503 (\"HTTP limits\")"),
    INT_KEY(ROUTER, "http_max_connections_per_client", CFG(router.http_max_connections_per_client),
            0, 0, 100000, 64, "connections",
            "open from one client address (0: no limit); more are answered 429 with Retry-After "
            "(`/health` and `/ready` are still served)"),
    INT_KEY(ROUTER, "http_header_timeout_s", CFG(router.http_header_timeout_s), 0, 1, 3600, 10,
            "seconds",
            "a connection's request headers must be complete this long after it opened (a "
            "keep-alive connection's later request: after its request line), else 408 and close "
            "(\"HTTP limits\")"),
    INT_KEY(ROUTER, "http_min_body_rate", CFG(router.http_min_body_rate), 0, 0, 1000000000, 1024,
            "bytes/s",
            "a request body slower than this on average (after the first "
            "`http_header_timeout_s`) is answered 408 and its connection closed (0: no minimum)"),
    ENUM_KEY(ROUTER, "prefill_policy", CFG(router.prefill_policy), 0, 0, &policies,
             TDM_PREFILL_POLICY_ROUND_ROBIN,
             "how a prefill node is chosen: in turn; fewest queued prompt tokens; most cached "
             "prompt blocks within a load bound"),
    INT_KEY(ROUTER, "max_queue", CFG(router.max_queue), 0, 1, 1000000, 1024, "requests",
            "waiting for a node at most; beyond it requests get `RESOURCE_EXHAUSTED`"),
    NUMBER_KEY(ROUTER, "request_timeout_s", CFG(router.request_timeout_s), TDM_CONFIG_MIN_OPEN, 0,
               86400, 600, NULL, "seconds", "the deadline of a request that sets none"),
    LIST_KEY(ROUTER, "api_keys", CFG(router.api_keys), offsetof(tdm_config_t, router.n_api_keys),
             "API key", api_key_refused,
             "accepted API keys (no spaces or control characters, no repeats); empty: no "
             "authentication"),
    BOOL_KEY(ROUTER, "public_metrics", CFG(router.public_metrics), false,
             "with `api_keys` set: `true` leaves `/metrics`, `/api/status`, the dashboard and the "
             "native `STATUS`/`METRICS` open; `false`: they need a key too (\"Metrics\")"),
    TEXT_KEY(ROUTER, "curve_public_key", CURVE_KEY, CFG(router.curve_public_key),
             TDM_CONFIG_OPTIONAL, NULL, curve_key_refused,
             "the router's CURVE public key; set, CURVE is on for the node and KV channels and "
             "every node needs its own pair (\"Keys\")"),
    TEXT_KEY(ROUTER, "curve_secret_key_file", PATH, CFG(router.curve_secret_key_file),
             TDM_CONFIG_OPTIONAL, NULL, NULL,
             "required with `curve_public_key`: the file holding the router's secret key, read "
             "only by the router; a leading `~/` is expanded"),
    BOOL_KEY(ROUTER, "admission_control", CFG(router.admission_control), true,
             "refuse at once (`RESOURCE_EXHAUSTED`, HTTP 429 with `Retry-After`) a new request no "
             "decode node up can finish before its deadline by the router's estimate (see "
             "\"Admission control\"); `false` queues and dispatches it anyway, to end "
             "`DEADLINE_EXCEEDED` if it runs out of time"),
    ENUM_KEY(ROUTER, "metrics_compat", CFG(router.metrics_compat_vllm), 0, 0, &compat, 1,
             "`vllm`: `/metrics` also serves vLLM's `vllm:` series (names, types and labels of "
             "vLLM 0.33.0) beside the `tandem_` ones, so vLLM dashboards and autoscaler queries "
             "work unchanged (\"vLLM-compatible series\"); `none`: `tandem_`, `process_` and the "
             "gateway's series only"),
    LIST_KEY(ROUTER, "cors_origins", CFG(router.cors_origins),
             offsetof(tdm_config_t, router.n_cors_origins), "origin", cors_origin_refused,
             "origins whose browser pages may call the HTTP API (`https://app.example.com:8443`: "
             "scheme, host and port, no path; `\"*\"`: any); a listed `Origin` gets "
             "`Access-Control-Allow-Origin` and its `OPTIONS` preflight is answered (docs/api.md "
             "\"CORS\"); empty: no CORS headers"),
    INT_KEY(ROUTER, "responses_store_max", CFG(router.responses_store_max), 0, 0, 1000000, 1000,
            "responses",
            "`/v1/responses` answers (with `store` true) kept in this router's memory for "
            "`previous_response_id` and `GET /v1/responses/{id}`; past it the least recently "
            "used go first (\"Responses store\"); `0` keeps none"),
    BYTES_KEY(ROUTER, "responses_store_bytes", CFG(router.responses_store_bytes), 0, 1ull << 20,
              64ull << 30, 64ull << 20, NULL,
              "the bytes of the stored `/v1/responses` answers and their conversations in all; "
              "past it the least recently used go first (\"Responses store\")"),

    INT_KEY(KV, "block_size", CFG(kv.block_size), TDM_CONFIG_POW2, 1, 256, 16, "tokens",
            "per KV block"),
    ENUM_KEY(KV, "dtype", CFG(kv.dtype), 0, 0, &kv_dtypes, TDM_KV_F16,
             "value type of the KV cache; `q8` is int8 with a per-block-per-head scale"),
    BOOL_KEY(KV, "prefix_caching", CFG(kv.prefix_caching), true,
             "share the blocks of identical prompt prefixes"),
    NUMBER_KEY(KV, "transfer_timeout_s", CFG(kv.transfer_timeout_s), TDM_CONFIG_MIN_OPEN, 0, 3600,
               10, NULL, "seconds",
               "a KV transfer the decode node has not acknowledged within it fails (the prefill "
               "node reports it, the router retries the request; \"Timeouts and retries\")"),
    BYTES_KEY(KV, "early_transfer_bytes", CFG(kv.early_transfer_bytes), 0, 0, 64ull << 30,
              256ull << 20, NULL,
              "a decode node holds KV transfers that arrive before it has decided their "
              "reservation (the prefill starts with the reservation), up to this many bytes in "
              "all, and installs or refuses each once the reservation is decided; a transfer "
              "over it is refused as one without a reservation (`NOT_FOUND`); `0` holds none"),
    NUMBER_KEY(KV, "early_transfer_s", CFG(kv.early_transfer_s), TDM_CONFIG_MIN_OPEN, 0, 3600, 5,
               NULL, "seconds",
               "a held early KV transfer whose reservation is still undecided after it is "
               "refused (`NOT_FOUND`; the prefill node reports it, the router retries)"),

    ENUM_KEY(LOG, "level", CFG(log.level), 0, 0, &log_levels, TDM_LOG_INFO, "lowest level logged"),

    BOOL_KEY(SECURITY, "insecure", CFG(security.insecure), false,
             "`true` lets the daemons bind non-loopback addresses without protection: the node and "
             "KV endpoints without CURVE, the client endpoint and HTTP without `router.api_keys`. "
             "Every daemon then logs a warning at every start. Only for a network on which every "
             "host is trusted"),
    BOOL_KEY(SECURITY, "default_keys", CFG(security.default_keys), true,
             "with no CURVE keys in the config and the node and KV endpoints all on this host "
             "(loopback or `ipc://`): every daemon takes its CURVE pair from the user's key "
             "directory (`$XDG_STATE_HOME/tandem/keys`, else `~/.local/state/tandem/keys`), "
             "making the missing pairs on first start, so CURVE is on and only this user's "
             "processes can register as nodes or send KV (\"Keys by default\"). `false`: such a "
             "cluster runs without CURVE, and any local user can pose as a node"),
    REMOVED_KEY(SECURITY, "curve_server_public_key", SHARED_KEYS_REMOVED),
    REMOVED_KEY(SECURITY, "curve_server_secret_key", SHARED_KEYS_REMOVED),
    REMOVED_KEY(SECURITY, "curve_client_public_key", SHARED_KEYS_REMOVED),
    REMOVED_KEY(SECURITY, "curve_client_secret_key", SHARED_KEYS_REMOVED),

    TEXT_KEY(NODE, "id", STRING, NODE(id), TDM_CONFIG_REQUIRED, NULL, node_id_refused,
             "1–63 characters of `A-Z a-z 0-9 . _ -`, unique in the file"),
    ENUM_KEY(NODE, "role", NODE(role), TDM_CONFIG_REQUIRED, 0, &roles, TDM_NODE_ROLE_PREFILL,
             "`prefill` runs prompts and ships their KV pages to a decode node; `decode` receives "
             "them and runs the continuous-batching loop (and can prefill locally)"),
    TEXT_KEY(NODE, "endpoint", ENDPOINT, NODE(endpoint), TDM_CONFIG_OPTIONAL, NULL, NULL,
             "optional endpoint the node binds for direct control connections; unset, the node is "
             "reached only through `router.node_endpoint`"),
    TEXT_KEY(NODE, "kv_endpoint", ENDPOINT, NODE(kv_endpoint),
             TDM_CONFIG_OPTIONAL | TDM_CONFIG_DECODE_ONLY | TDM_CONFIG_DERIVED,
             "`tcp://127.0.0.1:(7610 + n)` for the n-th decode node, counting from 0", NULL,
             "what the node binds to receive KV pages"),
    TEXT_KEY(NODE, "kv_advertise", ENDPOINT, NODE(kv_advertise),
             TDM_CONFIG_OPTIONAL | TDM_CONFIG_DECODE_ONLY, NULL, advertise_refused,
             "the KV endpoint the node registers with the router, which prefill nodes connect to, "
             "when it is not `kv_endpoint` (bind `tcp://0.0.0.0:7610`, advertise "
             "`tcp://decode-0:7610`); not a wildcard address. With it set, the duplicate check "
             "takes this endpoint instead of `kv_endpoint`"),
    DEVICE_KEY(NODE, "device", NODE(device), "N is 0–63; `cuda` means `cuda:0`"),
    INT_KEY(NODE, "threads", NODE(threads), 0, 0, 1024, 0, "threads",
            "for the CPU compute; 0 is one per core"),
    BYTES_KEY(NODE, "memory_budget", NODE(memory_budget),
              TDM_CONFIG_DERIVED | TDM_CONFIG_DUMP_NONZERO, 1 << 20, (double)INT64_MAX, 0,
              "`2GiB` on `cpu`",
              "for weights + KV cache on this node; a `cpu` node refuses to start with more than "
              "its host's memory (or cgroup limit)"),
    NUMBER_KEY(NODE, "gpu_memory_utilization", NODE(gpu_memory_utilization),
               TDM_CONFIG_MIN_OPEN | TDM_CONFIG_DERIVED | TDM_CONFIG_DUMP_NONZERO, 0, 1, 0,
               "`0.9` on `cuda`", NULL,
               "the fraction of the GPU's memory for weights + scratch + KV; `cuda` devices only; "
               "set it or `memory_budget`, not both (GPU nodes below)"),
    INT_KEY(NODE, "max_batch_tokens", NODE(max_batch_tokens), 0, 1, 1048576, 2048, "tokens",
            "in one forward pass (longer prompts are chunked)"),
    INT_KEY(NODE, "max_running", NODE(max_running), 0, 1, 65536, 64, "sequences",
            "in the running batch"),
    BYTES_KEY(NODE, "grammar_cache_bytes", NODE(grammar_cache_bytes), 0, 0, 16ull << 30,
              TDM_GRAMMAR_CACHE_DEFAULT_BYTES, NULL,
              "compiled grammars (structured output) the node keeps for reuse, by hash, least "
              "recently used evicted first; grammars of running sequences are never evicted (so "
              "the bound may be passed while they run); `0` keeps none once released. Each node "
              "also holds one vocabulary trie for token masks, built at start"),
    MAPPING_KEY(NODE, "speculative", SPECULATIVE,
                "decode nodes (a prefill node ignores it): prompt-lookup speculative decoding, "
                "docs/performance.md \"Speculative decoding\". Outputs are the same either way; it "
                "is off by itself for `kv.dtype: q8`, on `cuda` devices (the CUDA engine is not "
                "batch-invariant), for requests with `speculative: off`, and while more than 8 "
                "sequences run on the node. Per request: `speculative: \"auto\"` (default) or "
                "`\"off\"` on `/v1/completions` and `/v1/chat/completions`, "
                "`GenerateRequest.speculative`, the client library's `no_speculation`"),
    TEXT_KEY(NODE, "model", STRING, NODE(model), TDM_CONFIG_OPTIONAL | TDM_CONFIG_DERIVED,
             "the first model", NULL,
             "the model this node serves: a `name` or alias of one of `models` (\"Several "
             "models\"); a node serves one model and exchanges KV only with nodes of that model"),
    TEXT_KEY(NODE, "curve_public_key", CURVE_KEY, NODE(curve_public_key), TDM_CONFIG_OPTIONAL, NULL,
             curve_key_refused,
             "this node's CURVE public key: required, and distinct from every other key, when "
             "CURVE is on (`router.curve_public_key` set); not allowed otherwise"),
    TEXT_KEY(NODE, "curve_secret_key_file", PATH, NODE(curve_secret_key_file), TDM_CONFIG_OPTIONAL,
             NULL, NULL,
             "required with `curve_public_key`: the file holding this node's secret key, mode "
             "0600, read only by this node's daemon; a leading `~/` is expanded"),

    INT_KEY(SPECULATIVE, "max_draft", NODE(spec_max_draft), 0, 0, TDM_CONFIG_MAX_SPEC_MAX_DRAFT,
            TDM_CONFIG_DEFAULT_SPEC_MAX_DRAFT, "tokens",
            "drafted per sequence and step, `0` turns it off. Each draft row asks for logits, so "
            "the worker's and the engine's logit rows grow by `max_draft` × min(`max_running`, 8) "
            "(`n_vocab` × 4 bytes each: 192 KiB on a 49k vocabulary, 12 MiB for the default 8 × 8 "
            "in each)"),
    NUMBER_KEY(SPECULATIVE, "row_cost", NODE(spec_row_cost), 0, 0, 10, 0, NULL, NULL,
               "a draft row's cost relative to a decode step in the drafter's gain estimate; `0` "
               "(default) fits it from the node's own step times, a fixed value makes how much it "
               "drafts independent of the machine's load (the tests use 0.1)"),
};

const tdm_config_key_t *tdm_config_keys(size_t *n)
{
    *n = TDM_CONFIG_N_OF(keys);
    return keys;
}

const tdm_config_key_t *tdm_config_key_find(tdm_config_section_t section, const char *name)
{
    for (size_t i = 0; i < TDM_CONFIG_N_OF(keys); i++)
        if (keys[i].section == section && strcmp(keys[i].name, name) == 0)
            return &keys[i];
    return NULL;
}

size_t tdm_config_key_index(const tdm_config_key_t *key)
{
    return (size_t)(key - keys);
}

bool tdm_config_section_is_node(tdm_config_section_t section)
{
    return section == TDM_CONFIG_SECTION_NODE || section == TDM_CONFIG_SECTION_SPECULATIVE;
}

void tdm_config_enum_store(void *field, size_t size, int v)
{
    if (size == sizeof(bool)) {
        bool b = v != 0;
        memcpy(field, &b, sizeof b);
    } else {
        memcpy(field, &v, sizeof v);
    }
}

int tdm_config_enum_load(const void *field, size_t size)
{
    if (size == sizeof(bool)) {
        bool b;
        memcpy(&b, field, sizeof b);
        return b;
    }
    int v;
    memcpy(&v, field, sizeof v);
    return v;
}

/* The default of one row into its field at base + key->offset. */
static int key_default(const tdm_config_key_t *key, char *base)
{
    void *field = base + key->offset;
    switch (key->type) {
    case TDM_CONFIG_TYPE_BOOL: *(bool *)field = key->def != 0; break;
    case TDM_CONFIG_TYPE_INT: *(int *)field = (int)key->def; break;
    case TDM_CONFIG_TYPE_NUMBER: *(double *)field = key->def; break;
    case TDM_CONFIG_TYPE_BYTES: *(uint64_t *)field = (uint64_t)key->def; break;
    case TDM_CONFIG_TYPE_ENUM: tdm_config_enum_store(field, key->size, (int)key->def); break;
    case TDM_CONFIG_TYPE_DEVICE:
        *(tdm_node_device_t *)field = (tdm_node_device_t){TDM_NODE_DEVICE_CPU, 0};
        break;
    case TDM_CONFIG_TYPE_STRING:
    case TDM_CONFIG_TYPE_PATH:
    case TDM_CONFIG_TYPE_ENDPOINT:
        if (key->def_text && !(key->flags & TDM_CONFIG_DERIVED) &&
            !(*(char **)field = tdm_strdup(key->def_text)))
            return TDM_ERESOURCE;
        break;
    case TDM_CONFIG_TYPE_MAPPING: return tdm_config_section_defaults(key->sub, base);
    default: break; /* lists start empty, nodes are config_finish's */
    }
    return TDM_OK;
}

int tdm_config_section_defaults(tdm_config_section_t section, void *base)
{
    for (size_t i = 0; i < TDM_CONFIG_N_OF(keys); i++) {
        if (keys[i].section != section)
            continue;
        int rc = key_default(&keys[i], base);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}
