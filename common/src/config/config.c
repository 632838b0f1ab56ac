/* config.c - the cluster configuration: defaults, a strict YAML loader and a dumper.
 *
 * The file is read with libyaml's document API (yaml_parser_load), which keeps each node's
 * start mark, so every error names the file, the line and the dotted key. The walk follows
 * the fixed shape of the schema (top level -> section -> value, nodes -> entry -> value), never
 * the document's own nesting, so aliases and deep nesting cannot make it loop or recurse.
 * Loading starts from the defaults, applies the file, then fills what depends on other keys
 * (the model name from the path, decode nodes' KV endpoints, memory budgets by device).
 */
#include "tandem/config.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <arpa/inet.h>
#include <yaml.h>

#include "tandem/constraint.h"

#define DEFAULT_CLIENT_ENDPOINT "tcp://127.0.0.1:7600"
#define DEFAULT_NODE_ENDPOINT "tcp://127.0.0.1:7601"
#define DEFAULT_HTTP_ADDRESS "127.0.0.1"
#define DEFAULT_HTTP_PORT 8000
#define DEFAULT_HTTP_THREADS 4
#define DEFAULT_HTTP_CONNECTION_TIMEOUT_S 30
#define DEFAULT_HTTP_MAX_CONNECTIONS 1000
#define DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT 64
#define DEFAULT_KV_HOST "tcp://127.0.0.1"
#define DEFAULT_KV_PORT 7610
#define DEFAULT_MAX_QUEUE 1024
#define DEFAULT_REQUEST_TIMEOUT_S 600.0
#define MAX_REQUEST_TIMEOUT_S 86400.0
#define DEFAULT_KV_TRANSFER_TIMEOUT_S 10.0
#define MAX_KV_TRANSFER_TIMEOUT_S 3600.0
#define DEFAULT_BLOCK_SIZE 16
#define MAX_BLOCK_SIZE 256
#define DEFAULT_CPU_MEMORY_BUDGET (2ull << 30)
#define MIN_MEMORY_BUDGET (1ull << 20)
#define DEFAULT_GPU_MEMORY_UTILIZATION 0.9
#define DEFAULT_MAX_BATCH_TOKENS 2048
#define DEFAULT_MAX_RUNNING 64
#define DEFAULT_GRAMMAR_CACHE_BYTES ((uint64_t)TDM_GRAMMAR_CACHE_DEFAULT_BYTES)
#define MAX_GRAMMAR_CACHE_BYTES (16ull << 30)
#define MAX_CUDA_DEVICES 64
#define CURVE_KEY_LEN 40 /* a 32-byte key in Z85 text (zmq_z85_encode) */

/* ---- enum names ---- */

static const char *const role_names[] = {"prefill", "decode"};
static const char *const policy_names[] = {"round_robin", "least_loaded", "prefix_aware"};
#define N_OF(a) (sizeof(a) / sizeof((a)[0]))

const char *tdm_config_node_role_name(tdm_node_role_t role)
{
    return (unsigned)role < N_OF(role_names) ? role_names[role] : "?";
}

const char *tdm_config_prefill_policy_name(tdm_prefill_policy_t policy)
{
    return (unsigned)policy < N_OF(policy_names) ? policy_names[policy] : "?";
}

int tdm_config_device_format(tdm_node_device_t device, char *buf, size_t cap)
{
    if (device.kind == TDM_NODE_DEVICE_CUDA)
        return snprintf(buf, cap, "cuda:%d", device.index);
    return snprintf(buf, cap, "cpu");
}

int tdm_config_device_parse(const char *text, tdm_node_device_t *device)
{
    if (strcmp(text, "cpu") == 0) {
        *device = (tdm_node_device_t){TDM_NODE_DEVICE_CPU, 0};
        return TDM_OK;
    }
    if (strcmp(text, "cuda") == 0) {
        *device = (tdm_node_device_t){TDM_NODE_DEVICE_CUDA, 0};
        return TDM_OK;
    }
    if (strncmp(text, "cuda:", 5) != 0)
        return TDM_EINVALID;
    const char *p = text + 5;
    int index = 0;
    if (!isdigit((unsigned char)*p) || (p[0] == '0' && p[1] != '\0'))
        return TDM_EINVALID;
    for (; isdigit((unsigned char)*p); p++) {
        index = index * 10 + (*p - '0');
        if (index >= MAX_CUDA_DEVICES)
            return TDM_EINVALID;
    }
    if (*p != '\0')
        return TDM_EINVALID;
    *device = (tdm_node_device_t){TDM_NODE_DEVICE_CUDA, index};
    return TDM_OK;
}

/* ---- byte sizes ---- */

typedef struct byte_unit {
    const char *name; /* lower case */
    uint64_t mult;
} byte_unit_t;

static const byte_unit_t byte_units[] = {
    {"", 1},
    {"b", 1},
    {"k", 1000ull},
    {"kb", 1000ull},
    {"m", 1000000ull},
    {"mb", 1000000ull},
    {"g", 1000000000ull},
    {"gb", 1000000000ull},
    {"t", 1000000000000ull},
    {"tb", 1000000000000ull},
    {"ki", 1ull << 10},
    {"kib", 1ull << 10},
    {"mi", 1ull << 20},
    {"mib", 1ull << 20},
    {"gi", 1ull << 30},
    {"gib", 1ull << 30},
    {"ti", 1ull << 40},
    {"tib", 1ull << 40},
};

int tdm_config_parse_bytes(const char *text, uint64_t *bytes)
{
    if (!text)
        return TDM_EINVALID;
    const char *p = text;
    uint64_t whole = 0;
    int n_whole = 0;
    for (; isdigit((unsigned char)*p); p++, n_whole++)
        if (!tdm_mul_u64(whole, 10, &whole) || !tdm_add_u64(whole, (uint64_t)(*p - '0'), &whole))
            return TDM_EINVALID;
    /* The fraction is kept exactly as frac / scale; digits past the 18th cannot change the
     * result by a whole byte below 2^63 bytes, so they are read and dropped. */
    uint64_t frac = 0, scale = 1;
    if (*p == '.') {
        p++;
        if (!isdigit((unsigned char)*p))
            return TDM_EINVALID;
        for (int n = 0; isdigit((unsigned char)*p); p++, n++) {
            if (n < 18) {
                frac = frac * 10 + (uint64_t)(*p - '0');
                scale *= 10;
            }
        }
    } else if (n_whole == 0) {
        return TDM_EINVALID;
    }
    while (*p == ' ')
        p++;
    char unit[4] = {0};
    size_t n_unit = strlen(p);
    if (n_unit >= sizeof unit)
        return TDM_EINVALID;
    for (size_t i = 0; i < n_unit; i++)
        unit[i] = (char)tolower((unsigned char)p[i]);
    uint64_t mult = 0;
    for (size_t i = 0; i < N_OF(byte_units); i++)
        if (strcmp(unit, byte_units[i].name) == 0)
            mult = byte_units[i].mult;
    if (mult == 0)
        return TDM_EINVALID;
    if (scale > 1 && mult == 1 && frac != 0)
        return TDM_EINVALID; /* "1.5" bytes: a fraction needs a unit (1.5GiB) */
    uint64_t total;
    if (!tdm_mul_u64(whole, mult, &total))
        return TDM_EINVALID;
    unsigned __int128 part = (unsigned __int128)frac * mult / scale;
    if (!tdm_add_u64(total, (uint64_t)part, &total) || total > (uint64_t)INT64_MAX)
        return TDM_EINVALID;
    *bytes = total;
    return TDM_OK;
}

int tdm_config_format_bytes(uint64_t bytes, char *buf, size_t cap)
{
    static const byte_unit_t units[] = {
        {"TiB", 1ull << 40}, {"GiB", 1ull << 30}, {"MiB", 1ull << 20}, {"KiB", 1ull << 10}};
    for (size_t i = 0; i < N_OF(units); i++)
        if (bytes != 0 && bytes % units[i].mult == 0)
            return snprintf(buf, cap, "%llu%s", (unsigned long long)(bytes / units[i].mult),
                            units[i].name);
    return snprintf(buf, cap, "%llu", (unsigned long long)bytes);
}

/* ---- the default model path ---- */

int tdm_model_cache_path(const char *file, char *buf, size_t cap)
{
    if (cap > 0)
        buf[0] = '\0';
    const char *xdg = getenv("XDG_CACHE_HOME");
    const char *home = getenv("HOME");
    int n;
    if (xdg && *xdg)
        n = snprintf(buf, cap, "%s/tandem/models/%s", xdg, file);
    else if (home && *home)
        n = snprintf(buf, cap, "%s/.cache/tandem/models/%s", home, file);
    else
        return TDM_ENOTFOUND;
    if (n < 0 || (size_t)n >= cap) {
        if (cap > 0)
            buf[0] = '\0';
        return TDM_ERESOURCE;
    }
    return TDM_OK;
}

int tdm_model_default_path(char *buf, size_t cap)
{
    if (cap > 0)
        buf[0] = '\0';
    const char *env = getenv("TANDEM_MODEL");
    if (!env || !*env)
        return tdm_model_cache_path(TDM_DEFAULT_MODEL_FILE, buf, cap);
    int n = snprintf(buf, cap, "%s", env);
    if (n < 0 || (size_t)n >= cap) {
        if (cap > 0)
            buf[0] = '\0';
        return TDM_ERESOURCE;
    }
    return TDM_OK;
}

/* ---- defaults ---- */

static void node_free(tdm_node_config_t *node)
{
    free(node->id);
    free(node->endpoint);
    free(node->kv_endpoint);
    free(node->kv_advertise);
    free(node->curve_public_key);
    free(node->curve_secret_key_file);
    memset(node, 0, sizeof *node);
}

void tdm_config_free(tdm_config_t *cfg)
{
    if (!cfg)
        return;
    free(cfg->model.path);
    free(cfg->model.name);
    free(cfg->router.client_endpoint);
    free(cfg->router.node_endpoint);
    free(cfg->router.node_advertise);
    free(cfg->router.http_address);
    for (size_t i = 0; i < cfg->router.n_api_keys; i++)
        free(cfg->router.api_keys[i]);
    free(cfg->router.api_keys);
    for (size_t i = 0; i < cfg->router.n_cors_origins; i++)
        free(cfg->router.cors_origins[i]);
    free(cfg->router.cors_origins);
    free(cfg->router.curve_public_key);
    free(cfg->router.curve_secret_key_file);
    for (size_t i = 0; i < cfg->n_nodes; i++)
        node_free(&cfg->nodes[i]);
    free(cfg->nodes);
    memset(cfg, 0, sizeof *cfg);
}

/* A node with every optional field at its default; the id is set by the caller. */
static tdm_node_config_t node_defaults(void)
{
    return (tdm_node_config_t){
        .role = TDM_NODE_ROLE_PREFILL,
        .device = {TDM_NODE_DEVICE_CPU, 0},
        .max_batch_tokens = DEFAULT_MAX_BATCH_TOKENS,
        .max_running = DEFAULT_MAX_RUNNING,
        .grammar_cache_bytes = DEFAULT_GRAMMAR_CACHE_BYTES,
        .spec_max_draft = TDM_CONFIG_DEFAULT_SPEC_MAX_DRAFT,
    };
}

/* Everything that does not depend on other keys; strings that must be set are allocated.
 * Model path and name, nodes and KV endpoints are left to config_finish. */
static int config_init(tdm_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    cfg->router.client_endpoint = tdm_strdup(DEFAULT_CLIENT_ENDPOINT);
    cfg->router.node_endpoint = tdm_strdup(DEFAULT_NODE_ENDPOINT);
    cfg->router.http_address = tdm_strdup(DEFAULT_HTTP_ADDRESS);
    cfg->router.http_port = DEFAULT_HTTP_PORT;
    cfg->router.http_threads = DEFAULT_HTTP_THREADS;
    cfg->router.http_connection_timeout_s = DEFAULT_HTTP_CONNECTION_TIMEOUT_S;
    cfg->router.http_max_connections = DEFAULT_HTTP_MAX_CONNECTIONS;
    cfg->router.http_max_connections_per_client = DEFAULT_HTTP_MAX_CONNECTIONS_PER_CLIENT;
    cfg->router.prefill_policy = TDM_PREFILL_POLICY_ROUND_ROBIN;
    cfg->router.max_queue = DEFAULT_MAX_QUEUE;
    cfg->router.admission_control = true;
    cfg->router.metrics_compat_vllm = true;
    cfg->router.request_timeout_s = DEFAULT_REQUEST_TIMEOUT_S;
    cfg->kv.block_size = DEFAULT_BLOCK_SIZE;
    cfg->kv.dtype = TDM_KV_F16;
    cfg->kv.prefix_caching = true;
    cfg->kv.transfer_timeout_s = DEFAULT_KV_TRANSFER_TIMEOUT_S;
    cfg->log.level = TDM_LOG_INFO;
    if (!cfg->router.client_endpoint || !cfg->router.node_endpoint || !cfg->router.http_address) {
        tdm_config_free(cfg);
        return TDM_ERESOURCE;
    }
    return TDM_OK;
}

/* "dir/SmolLM2.Q4_1.gguf" -> "SmolLM2.Q4_1"; NULL on out of memory. */
static char *model_name_from_path(const char *path)
{
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    size_t n = strlen(base);
    if (n > 5 && strcmp(base + n - 5, ".gguf") == 0)
        n -= 5;
    if (n == 0) {
        base = path;
        n = strlen(path);
    }
    char *name = malloc(n + 1);
    if (name) {
        memcpy(name, base, n);
        name[n] = '\0';
    }
    return name;
}

/* Fills what the file left out and what depends on other keys: the model path and name,
 * the default nodes (when nodes_given is false), decode nodes' KV endpoints and each node's
 * memory budget. Errors: TDM_ERESOURCE, TDM_ENOTFOUND (no default model path). */
static int config_finish(tdm_config_t *cfg, bool nodes_given)
{
    if (!cfg->model.path) {
        char path[4096];
        int rc = tdm_model_default_path(path, sizeof path);
        if (rc != TDM_OK)
            return rc;
        if (!(cfg->model.path = tdm_strdup(path)))
            return TDM_ERESOURCE;
    }
    if (!cfg->model.name && !(cfg->model.name = model_name_from_path(cfg->model.path)))
        return TDM_ERESOURCE;
    if (!nodes_given) {
        cfg->nodes = calloc(2, sizeof *cfg->nodes);
        if (!cfg->nodes)
            return TDM_ERESOURCE;
        cfg->n_nodes = 2;
        cfg->nodes[0] = node_defaults();
        cfg->nodes[1] = node_defaults();
        cfg->nodes[1].role = TDM_NODE_ROLE_DECODE;
        cfg->nodes[0].id = tdm_strdup("prefill-0");
        cfg->nodes[1].id = tdm_strdup("decode-0");
        if (!cfg->nodes[0].id || !cfg->nodes[1].id)
            return TDM_ERESOURCE;
    }
    int n_decode = 0;
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        tdm_node_config_t *node = &cfg->nodes[i];
        if (node->role == TDM_NODE_ROLE_DECODE) {
            if (!node->kv_endpoint) {
                char ep[64];
                snprintf(ep, sizeof ep, "%s:%d", DEFAULT_KV_HOST, DEFAULT_KV_PORT + n_decode);
                if (!(node->kv_endpoint = tdm_strdup(ep)))
                    return TDM_ERESOURCE;
            }
            n_decode++;
        }
        if (node->memory_budget == 0 && node->gpu_memory_utilization == 0.0) {
            if (node->device.kind == TDM_NODE_DEVICE_CUDA)
                node->gpu_memory_utilization = DEFAULT_GPU_MEMORY_UTILIZATION;
            else
                node->memory_budget = DEFAULT_CPU_MEMORY_BUDGET;
        }
    }
    return TDM_OK;
}

int tdm_config_defaults(tdm_config_t *cfg)
{
    int rc = config_init(cfg);
    if (rc != TDM_OK)
        return rc;
    rc = config_finish(cfg, false);
    if (rc != TDM_OK)
        tdm_config_free(cfg);
    return rc;
}

const tdm_node_config_t *tdm_config_find_node(const tdm_config_t *cfg, const char *id)
{
    if (!cfg || !id)
        return NULL;
    for (size_t i = 0; i < cfg->n_nodes; i++)
        if (cfg->nodes[i].id && strcmp(cfg->nodes[i].id, id) == 0)
            return &cfg->nodes[i];
    return NULL;
}

/* Constant-time comparison of a presented key with a configured one (length aside). */
static bool api_key_equal(const char *a, const char *b)
{
    size_t la = strlen(a), lb = strlen(b);
    unsigned char diff = (unsigned char)(la != lb);
    for (size_t i = 0; i < la; i++)
        diff |= (unsigned char)(a[i] ^ b[i % (lb ? lb : 1)]);
    return diff == 0 && lb > 0;
}

bool tdm_config_api_key_ok(const tdm_router_config_t *router, const char *key)
{
    if (router->n_api_keys == 0)
        return true;
    bool ok = false;
    for (size_t i = 0; key && i < router->n_api_keys; i++)
        ok |= api_key_equal(key, router->api_keys[i]);
    return ok;
}

const char *tdm_config_router_advertise(const tdm_config_t *cfg)
{
    return cfg->router.node_advertise ? cfg->router.node_advertise : cfg->router.node_endpoint;
}

const char *tdm_config_kv_advertise(const tdm_node_config_t *node)
{
    if (node->role != TDM_NODE_ROLE_DECODE)
        return NULL;
    return node->kv_advertise ? node->kv_advertise : node->kv_endpoint;
}

bool tdm_config_curve_on(const tdm_config_t *cfg)
{
    return cfg && cfg->router.curve_public_key != NULL;
}

bool tdm_config_address_is_loopback(const char *address)
{
    if (!address)
        return false;
    if (strncmp(address, "inproc://", 9) == 0 || strncmp(address, "ipc://", 6) == 0)
        return true;
    char host[256];
    const char *h = address;
    size_t n = strlen(address);
    if (strncmp(address, "tcp://", 6) == 0) {
        h = address + 6;
        const char *colon = strrchr(h, ':');
        if (!colon)
            return false;
        n = (size_t)(colon - h);
        if (memchr(h, ';', n)) /* "tcp://src;dst" names a source address: not a bind */
            return false;
    }
    if (n >= 2 && h[0] == '[' && h[n - 1] == ']') {
        h++;
        n -= 2;
    }
    if (n == 0 || n >= sizeof host)
        return false;
    memcpy(host, h, n);
    host[n] = '\0';
    if (strcasecmp(host, "localhost") == 0)
        return true;
    struct in_addr v4;
    struct in6_addr v6;
    if (inet_pton(AF_INET, host, &v4) == 1)
        return (ntohl(v4.s_addr) >> 24) == 127;
    if (inet_pton(AF_INET6, host, &v6) == 1)
        return memcmp(&v6, &in6addr_loopback, sizeof v6) == 0;
    return false;
}

int tdm_config_bind_check(const tdm_config_t *cfg, const char *key, const char *address,
                          tdm_bind_guard_t guard, tdm_error_t *err)
{
    if (tdm_config_address_is_loopback(address) || cfg->security.insecure)
        return TDM_OK;
    if (guard == TDM_BIND_GUARD_CURVE && !tdm_config_curve_on(cfg))
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "%s %s is not a loopback address and CURVE is off, so anyone who "
                             "can reach it could pose as a node: give the router and every node "
                             "its key pair (router.curve_public_key / curve_secret_key_file, "
                             "nodes[].curve_public_key / curve_secret_key_file; tandem keys "
                             "generate writes them), bind a loopback address, or set "
                             "security.insecure: true on a network you trust",
                             key, address ? address : "(none)");
    if (guard == TDM_BIND_GUARD_API_KEYS && cfg->router.n_api_keys == 0)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "%s %s is not a loopback address and router.api_keys is empty, so "
                             "anyone who can reach it could use the cluster: set "
                             "router.api_keys, bind a loopback address, or set "
                             "security.insecure: true on a network you trust",
                             key, address ? address : "(none)");
    return TDM_OK;
}

size_t tdm_config_bind_problems(const tdm_config_t *cfg, tdm_error_t *errs, size_t cap)
{
    size_t n = 0;
    const tdm_router_config_t *r = &cfg->router;
    if (n < cap && tdm_config_bind_check(cfg, "router.client_endpoint", r->client_endpoint,
                                         TDM_BIND_GUARD_API_KEYS, &errs[n]) != TDM_OK)
        n++;
    if (n < cap && tdm_config_bind_check(cfg, "router.node_endpoint", r->node_endpoint,
                                         TDM_BIND_GUARD_CURVE, &errs[n]) != TDM_OK)
        n++;
    if (n < cap && tdm_config_bind_check(cfg, "router.http_address",
                                         r->http_address ? r->http_address : "127.0.0.1",
                                         TDM_BIND_GUARD_API_KEYS, &errs[n]) != TDM_OK)
        n++;
    for (size_t i = 0; i < cfg->n_nodes && n < cap; i++) {
        const tdm_node_config_t *node = &cfg->nodes[i];
        char key[64];
        snprintf(key, sizeof key, "nodes[%zu].kv_endpoint", i);
        if (node->kv_endpoint && tdm_config_bind_check(cfg, key, node->kv_endpoint,
                                                       TDM_BIND_GUARD_CURVE, &errs[n]) != TDM_OK)
            n++;
    }
    return n;
}

/* ---- the loader ---- */

/* Longest dotted key path built ("nodes[1023].gpu_memory_utilization" fits). */
#define KEY_MAX 96

typedef struct loader {
    const char *name; /* file name for messages */
    yaml_document_t *doc;
    tdm_error_t *err;
} loader_t;

/* Where one ZMQ endpoint came from, for the duplicate check. */
typedef struct endpoint_ref {
    const char *value;
    char key[KEY_MAX];
    const yaml_node_t *at; /* NULL when the value is a default */
} endpoint_ref_t;

/* Per-node marks kept while loading, for checks that need the whole entry or all entries. */
typedef struct node_marks {
    const yaml_node_t *id, *role, *endpoint, *kv_endpoint, *kv_advertise;
    const yaml_node_t *memory_budget, *gpu_memory_utilization;
    const yaml_node_t *curve_public_key, *curve_secret_key_file;
} node_marks_t;

/* Where the router's CURVE keys were written, for the checks across sections. */
typedef struct curve_marks {
    const yaml_node_t *public_key, *secret_key_file;
} curve_marks_t;

static size_t line_of(const yaml_node_t *n)
{
    return n->start_mark.line + 1;
}

/* Sets the error "NAME:LINE: key 'KEY': MESSAGE" ("NAME:LINE: MESSAGE" for key "") and
 * returns TDM_EINVALID. */
static int fail(loader_t *ld, const yaml_node_t *at, const char *key, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail(loader_t *ld, const yaml_node_t *at, const char *key, const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (!key[0]) /* a problem with the top level itself */
        return tdm_error_set(ld->err, TDM_EINVALID, "%s:%zu: %s", ld->name, line_of(at), msg);
    return tdm_error_set(ld->err, TDM_EINVALID, "%s:%zu: key '%s': %s", ld->name, line_of(at), key,
                         msg);
}

static yaml_node_t *node_at(loader_t *ld, int index)
{
    return yaml_document_get_node(ld->doc, index);
}

static const char *scalar_text(const yaml_node_t *n)
{
    return (const char *)n->data.scalar.value;
}

/* A plain scalar that YAML reads as null: empty, "~", "null", "Null", "NULL". */
static bool is_null(const yaml_node_t *n)
{
    if (n->type != YAML_SCALAR_NODE || n->data.scalar.style != YAML_PLAIN_SCALAR_STYLE)
        return false;
    const char *s = scalar_text(n);
    return n->data.scalar.length == 0 || strcmp(s, "~") == 0 || strcmp(s, "null") == 0 ||
           strcmp(s, "Null") == 0 || strcmp(s, "NULL") == 0;
}

/* Describes a value for "got ..." in messages; writes into buf. */
static const char *describe(const yaml_node_t *n, char *buf, size_t cap)
{
    if (n->type == YAML_MAPPING_NODE)
        return "a mapping";
    if (n->type == YAML_SEQUENCE_NODE)
        return "a list";
    if (is_null(n))
        return "nothing (null)";
    const char *s = scalar_text(n);
    int width = n->data.scalar.length > 60 ? 60 : (int)n->data.scalar.length;
    const char *more = n->data.scalar.length > 60 ? "..." : "";
    if (n->data.scalar.style == YAML_PLAIN_SCALAR_STYLE)
        snprintf(buf, cap, "'%.*s%s'", width, s, more);
    else
        snprintf(buf, cap, "the quoted string '%.*s%s'", width, s, more);
    return buf;
}

/* out = "path.name" (or "name" at the top level), cut to KEY_MAX - 1 bytes: unknown keys in
 * messages can be long, the known ones always fit. */
static void key_join(char *out, const char *path, const char *name)
{
    int n = snprintf(out, KEY_MAX, "%s%s%s", path, path[0] ? "." : "", name);
    if (n < 0)
        out[0] = '\0';
}

/* The names of known[] (NULL-ended), comma-separated, into out (cap bytes): whole names only;
 * when they do not all fit, the last ones are counted instead ("…, and 4 more: `tandem config
 * defaults` lists them"), so that a long list is never cut in the middle of a name. */
static void known_list(char *out, size_t cap, const char *const *known)
{
    static const char more_fmt[] = ", and %zu more: `tandem config defaults` lists them";
    size_t n = 0, len = 0;
    while (known[n])
        n++;
    out[0] = '\0';
    for (size_t i = 0; i < n; i++) {
        size_t need = strlen(known[i]) + (i ? 2 : 0);
        /* room for this name, and for the count of the rest unless it is the last one */
        size_t tail = i + 1 < n ? sizeof more_fmt + 8 : 0;
        if (len + need + tail >= cap) {
            snprintf(out + len, cap - len, more_fmt, n - i);
            return;
        }
        len += (size_t)snprintf(out + len, cap - len, "%s%s", i ? ", " : "", known[i]);
    }
}

/* Checks that map is a mapping whose keys are all plain names from known[] (NULL-ended), none
 * repeated. null counts as an empty mapping. */
static int check_mapping(loader_t *ld, const yaml_node_t *map, const char *path,
                         const char *const *known)
{
    char got[96];
    if (is_null(map))
        return TDM_OK;
    if (map->type != YAML_MAPPING_NODE)
        return fail(ld, map, path, "must be a mapping, got %s", describe(map, got, sizeof got));
    for (yaml_node_pair_t *p = map->data.mapping.pairs.start; p < map->data.mapping.pairs.top;
         p++) {
        const yaml_node_t *k = node_at(ld, p->key);
        if (k->type != YAML_SCALAR_NODE)
            return fail(ld, k, path, "keys must be names, got %s", describe(k, got, sizeof got));
        char key[KEY_MAX];
        key_join(key, path, scalar_text(k));
        bool ok = false;
        for (size_t i = 0; known[i]; i++)
            ok = ok || strcmp(known[i], scalar_text(k)) == 0;
        if (!ok) {
            char list[TDM_ERRMSG_MAX];
            /* what the message has room for after "FILE:LINE: key 'KEY': unknown key (...)" */
            size_t used = strlen(ld->name) + strlen(key) + 64;
            known_list(list, used < sizeof list / 2 ? sizeof list - used : sizeof list / 2, known);
            return fail(ld, k, key, "unknown key (expected one of: %s)", list);
        }
        for (yaml_node_pair_t *q = map->data.mapping.pairs.start; q < p; q++) {
            const yaml_node_t *prev = node_at(ld, q->key);
            if (strcmp(scalar_text(prev), scalar_text(k)) == 0)
                return fail(ld, k, key, "duplicate key (first at line %zu)", line_of(prev));
        }
    }
    return TDM_OK;
}

/* Iteration over a checked mapping (nothing to iterate when it is null). */
#define FOR_EACH_PAIR(ld, map, p)                                                                  \
    for (yaml_node_pair_t *p = (map)->type == YAML_MAPPING_NODE ? (map)->data.mapping.pairs.start  \
                                                                : NULL;                            \
         p && p < (map)->data.mapping.pairs.top; p++)

/* Reads a string value into *out (freeing the old one). optional: null or "" give NULL;
 * otherwise they are an error. */
static int get_string(loader_t *ld, const yaml_node_t *v, const char *key, bool optional,
                      char **out)
{
    char got[96];
    if (v->type != YAML_SCALAR_NODE)
        return fail(ld, v, key, "must be a string, got %s", describe(v, got, sizeof got));
    if (is_null(v) || v->data.scalar.length == 0) {
        if (!optional)
            return fail(ld, v, key, "must not be empty");
        free(*out);
        *out = NULL;
        return TDM_OK;
    }
    if (strlen(scalar_text(v)) != v->data.scalar.length)
        return fail(ld, v, key, "must not contain a NUL character");
    char *s = tdm_strdup(scalar_text(v));
    if (!s)
        return tdm_error_set(ld->err, TDM_ERESOURCE, "%s: out of memory", ld->name);
    free(*out);
    *out = s;
    return TDM_OK;
}

/* A plain scalar, the only kind a number or a boolean may be; fails with "must be WHAT". */
static int need_plain(loader_t *ld, const yaml_node_t *v, const char *key, const char *what)
{
    char got[96];
    if (v->type != YAML_SCALAR_NODE || v->data.scalar.style != YAML_PLAIN_SCALAR_STYLE ||
        is_null(v))
        return fail(ld, v, key, "must be %s, got %s", what, describe(v, got, sizeof got));
    return TDM_OK;
}

/* Reads a decimal integer (any value a long long holds). */
static int get_ll(loader_t *ld, const yaml_node_t *v, const char *key, long long *out)
{
    char got[96];
    int rc = need_plain(ld, v, key, "an integer");
    if (rc != TDM_OK)
        return rc;
    const char *s = scalar_text(v);
    char *end;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || isspace((unsigned char)*s) || errno == ERANGE)
        return fail(ld, v, key, "must be an integer, got %s", describe(v, got, sizeof got));
    *out = x;
    return TDM_OK;
}

/* Reads a decimal integer in [min, max]. */
static int get_int(loader_t *ld, const yaml_node_t *v, const char *key, int min, int max, int *out)
{
    long long x;
    int rc = get_ll(ld, v, key, &x);
    if (rc != TDM_OK)
        return rc;
    if (x < min || x > max)
        return fail(ld, v, key, "must be between %d and %d, got %lld", min, max, x);
    *out = (int)x;
    return TDM_OK;
}

/* Reads a finite number. */
static int get_double(loader_t *ld, const yaml_node_t *v, const char *key, double *out)
{
    char got[96];
    int rc = need_plain(ld, v, key, "a number");
    if (rc != TDM_OK)
        return rc;
    const char *s = scalar_text(v);
    char *end;
    errno = 0;
    double x = strtod(s, &end);
    if (end == s || *end != '\0' || isspace((unsigned char)*s) || !isfinite(x) || errno == ERANGE)
        return fail(ld, v, key, "must be a number, got %s", describe(v, got, sizeof got));
    *out = x;
    return TDM_OK;
}

static int get_bool(loader_t *ld, const yaml_node_t *v, const char *key, bool *out)
{
    char got[96];
    static const char *const yes[] = {"true", "yes", "on"}, *const no[] = {"false", "no", "off"};
    int rc = need_plain(ld, v, key, "true or false");
    if (rc != TDM_OK)
        return rc;
    for (size_t i = 0; i < N_OF(yes); i++) {
        if (strcasecmp(scalar_text(v), yes[i]) == 0) {
            *out = true;
            return TDM_OK;
        }
        if (strcasecmp(scalar_text(v), no[i]) == 0) {
            *out = false;
            return TDM_OK;
        }
    }
    return fail(ld, v, key, "must be true or false, got %s", describe(v, got, sizeof got));
}

/* Reads one of names[0..n) and stores its index. */
static int get_enum(loader_t *ld, const yaml_node_t *v, const char *key, const char *const *names,
                    size_t n, int *out)
{
    char got[96], list[128] = "";
    if (v->type == YAML_SCALAR_NODE) {
        for (size_t i = 0; i < n; i++) {
            if (strcmp(scalar_text(v), names[i]) == 0) {
                *out = (int)i;
                return TDM_OK;
            }
        }
    }
    for (size_t i = 0; i < n; i++) {
        size_t len = strlen(list);
        snprintf(list + len, sizeof list - len, "%s%s", i ? ", " : "", names[i]);
    }
    return fail(ld, v, key, "must be one of %s; got %s", list, describe(v, got, sizeof got));
}

/* A ZeroMQ endpoint: tcp://HOST:PORT (PORT 1..65535), ipc://PATH or inproc://NAME. */
static bool endpoint_valid(const char *s)
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

static int get_endpoint(loader_t *ld, const yaml_node_t *v, const char *key, bool optional,
                        char **out)
{
    char *s = NULL;
    int rc = get_string(ld, v, key, optional, &s);
    if (rc != TDM_OK)
        return rc;
    if (s && !endpoint_valid(s)) {
        char got[96];
        free(s);
        return fail(ld, v, key,
                    "must be a ZeroMQ endpoint tcp://HOST:PORT, ipc://PATH or inproc://NAME, "
                    "got %s",
                    describe(v, got, sizeof got));
    }
    free(*out);
    *out = s;
    return TDM_OK;
}

/* An endpoint other hosts connect to (router.node_advertise, nodes[].kv_advertise): as
 * get_endpoint, and a tcp:// one must name a host, not a wildcard that only a bind takes. */
static int get_advertise(loader_t *ld, const yaml_node_t *v, const char *key, char **out)
{
    int rc = get_endpoint(ld, v, key, true, out);
    if (rc != TDM_OK || !*out || strncmp(*out, "tcp://", 6) != 0)
        return rc;
    static const char *const wildcards[] = {"*", "0.0.0.0", "[::]", "::", "[*]"};
    const char *host = *out + 6;
    size_t n = (size_t)(strrchr(host, ':') - host);
    for (size_t i = 0; i < N_OF(wildcards); i++) {
        if (strlen(wildcards[i]) == n && strncmp(host, wildcards[i], n) == 0) {
            rc = fail(ld, v, key,
                      "must name a host the other nodes can reach, not the wildcard address "
                      "'%s' (a wildcard belongs in the endpoint that is bound)",
                      wildcards[i]);
            free(*out);
            *out = NULL;
            return rc;
        }
    }
    return TDM_OK;
}

/* Expands a leading "~/" with $HOME in place. */
static int expand_home(loader_t *ld, char **path)
{
    const char *home = getenv("HOME");
    if (!*path || strncmp(*path, "~/", 2) != 0 || !home || !*home)
        return TDM_OK;
    size_t n = strlen(home) + strlen(*path);
    char *full = malloc(n);
    if (!full)
        return tdm_error_set(ld->err, TDM_ERESOURCE, "%s: out of memory", ld->name);
    snprintf(full, n, "%s%s", home, *path + 1);
    free(*path);
    *path = full;
    return TDM_OK;
}

static bool z85_key_valid(const char *s)
{
    static const char z85[] = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                              ".-:+=^!/*?&<>()[]{}@%$#";
    return strlen(s) == CURVE_KEY_LEN && strspn(s, z85) == CURVE_KEY_LEN;
}

/* Reads an optional CURVE public key: null/"" give NULL, else 40 Z85 characters. */
static int get_curve_key(loader_t *ld, const yaml_node_t *v, const char *key, char **out)
{
    int rc = get_string(ld, v, key, true, out);
    if (rc == TDM_OK && *out && !z85_key_valid(*out)) {
        size_t n = strlen(*out);
        free(*out);
        *out = NULL;
        rc = fail(ld, v, key,
                  "must be a %d-character Z85 CURVE public key (tandem keys generate writes "
                  "one), got %zu characters",
                  CURVE_KEY_LEN, n);
    }
    return rc;
}

static int parse_model(loader_t *ld, const yaml_node_t *map, tdm_config_t *cfg)
{
    static const char *const known[] = {"path", "chat_template", "name", NULL};
    int rc = check_mapping(ld, map, "model", known);
    FOR_EACH_PAIR(ld, map, p)
    {
        if (rc != TDM_OK)
            break;
        const char *name = scalar_text(node_at(ld, p->key));
        const yaml_node_t *v = node_at(ld, p->value);
        char key[KEY_MAX];
        key_join(key, "model", name);
        if (strcmp(name, "path") == 0) {
            rc = get_string(ld, v, key, false, &cfg->model.path);
            if (rc == TDM_OK)
                rc = expand_home(ld, &cfg->model.path);
        } else if (strcmp(name, "chat_template") == 0) {
            const char *names[] = {tdm_chat_template_name(TDM_CHAT_TEMPLATE_CHATML),
                                   tdm_chat_template_name(TDM_CHAT_TEMPLATE_LLAMA3),
                                   tdm_chat_template_name(TDM_CHAT_TEMPLATE_LLAMA2),
                                   tdm_chat_template_name(TDM_CHAT_TEMPLATE_GEMMA)};
            int which = 0;
            cfg->model.chat_template_set = false;
            if (!is_null(v) && !(v->type == YAML_SCALAR_NODE && v->data.scalar.length == 0)) {
                rc = get_enum(ld, v, key, names, N_OF(names), &which);
                cfg->model.chat_template = (tdm_chat_template_t)which;
                cfg->model.chat_template_set = rc == TDM_OK;
            }
        } else {
            rc = get_string(ld, v, key, false, &cfg->model.name);
        }
    }
    return rc;
}

/* The list of strings name into *items / *n_items, each checked by ok (NULL, or why the item is
 * refused); a repeated item (a what) is refused. Null or [] leave the list empty. */
static int parse_string_list(loader_t *ld, const yaml_node_t *v, const char *name, const char *what,
                             const char *(*ok)(const char *item), char ***items, size_t *n_items)
{
    char got[96];
    if (is_null(v))
        return TDM_OK;
    if (v->type != YAML_SEQUENCE_NODE)
        return fail(ld, v, name, "must be a list of strings, got %s", describe(v, got, sizeof got));
    size_t n = (size_t)(v->data.sequence.items.top - v->data.sequence.items.start);
    if (n == 0)
        return TDM_OK;
    *items = calloc(n, sizeof **items);
    if (!*items)
        return tdm_error_set(ld->err, TDM_ERESOURCE, "%s: out of memory", ld->name);
    for (size_t i = 0; i < n; i++) {
        const yaml_node_t *item = node_at(ld, v->data.sequence.items.start[i]);
        char key[KEY_MAX];
        snprintf(key, sizeof key, "%s[%zu]", name, i);
        int rc = get_string(ld, item, key, false, &(*items)[*n_items]);
        if (rc != TDM_OK)
            return rc;
        (*n_items)++;
        const char *why = ok((*items)[i]);
        if (why)
            return fail(ld, item, key, "%s", why);
        for (size_t j = 0; j < i; j++)
            if (strcmp((*items)[j], (*items)[i]) == 0)
                return fail(ld, item, key, "duplicate %s (same as %s[%zu])", what, name, j);
    }
    return TDM_OK;
}

static const char *api_key_refused(const char *k)
{
    for (const char *c = k; *c; c++)
        if (isspace((unsigned char)*c) || iscntrl((unsigned char)*c))
            return "must not contain spaces or control characters";
    return NULL;
}

/* An Origin as browsers send it: "*", or scheme://host[:port] without a path. */
static const char *cors_origin_refused(const char *o)
{
    if (strcmp(o, "*") == 0)
        return NULL;
    const char *host = strstr(o, "://");
    if (!host || host == o || !host[3])
        return "must be \"*\" or an origin such as \"https://app.example.com:8443\"";
    for (const char *c = o; *c; c++)
        if (isspace((unsigned char)*c) || iscntrl((unsigned char)*c) || *c == ',')
            return "must not contain spaces, commas or control characters";
    if (strchr(host + 3, '/'))
        return "an origin has no path (no '/' after the host)";
    return NULL;
}

/* One router.http_* key (check_mapping has refused unknown ones). */
static int parse_router_http_key(loader_t *ld, const char *name, const yaml_node_t *v,
                                 const char *key, tdm_router_config_t *r)
{
    if (strcmp(name, "http_address") == 0)
        return get_string(ld, v, key, false, &r->http_address);
    if (strcmp(name, "http_port") == 0)
        return get_int(ld, v, key, 1, 65535, &r->http_port);
    if (strcmp(name, "http_threads") == 0)
        return get_int(ld, v, key, 1, 256, &r->http_threads);
    if (strcmp(name, "http_connection_timeout_s") == 0)
        return get_int(ld, v, key, 1, 3600, &r->http_connection_timeout_s);
    if (strcmp(name, "http_max_connections") == 0)
        return get_int(ld, v, key, 1, 100000, &r->http_max_connections);
    return get_int(ld, v, key, 0, 100000, &r->http_max_connections_per_client);
}

/* One key of the router section (check_mapping has refused unknown ones); the endpoints
 * and CURVE keys are marked for the checks that involve several keys. */
static int parse_router_key(loader_t *ld, const char *name, const yaml_node_t *v, const char *key,
                            tdm_router_config_t *r, endpoint_ref_t *eps, curve_marks_t *cm)
{
    int rc = TDM_OK;
    if (strcmp(name, "client_endpoint") == 0) {
        rc = get_endpoint(ld, v, key, false, &r->client_endpoint);
        eps[0].at = v;
    } else if (strcmp(name, "node_endpoint") == 0) {
        rc = get_endpoint(ld, v, key, false, &r->node_endpoint);
        eps[1].at = v;
    } else if (strcmp(name, "node_advertise") == 0) {
        rc = get_advertise(ld, v, key, &r->node_advertise);
        eps[2].at = v;
    } else if (strncmp(name, "http_", 5) == 0) {
        rc = parse_router_http_key(ld, name, v, key, r);
    } else if (strcmp(name, "prefill_policy") == 0) {
        int x = 0;
        rc = get_enum(ld, v, key, policy_names, N_OF(policy_names), &x);
        r->prefill_policy = (tdm_prefill_policy_t)x;
    } else if (strcmp(name, "max_queue") == 0) {
        rc = get_int(ld, v, key, 1, 1000000, &r->max_queue);
    } else if (strcmp(name, "request_timeout_s") == 0) {
        rc = get_double(ld, v, key, &r->request_timeout_s);
        if (rc == TDM_OK &&
            !(r->request_timeout_s > 0 && r->request_timeout_s <= MAX_REQUEST_TIMEOUT_S))
            rc = fail(ld, v, key, "must be more than 0 and at most %g seconds, got %s",
                      MAX_REQUEST_TIMEOUT_S, scalar_text(v));
    } else if (strcmp(name, "public_metrics") == 0) {
        rc = get_bool(ld, v, key, &r->public_metrics);
    } else if (strcmp(name, "admission_control") == 0) {
        rc = get_bool(ld, v, key, &r->admission_control);
    } else if (strcmp(name, "metrics_compat") == 0) {
        static const char *const compat_names[] = {"none", "vllm"};
        int x = 0;
        rc = get_enum(ld, v, key, compat_names, N_OF(compat_names), &x);
        r->metrics_compat_vllm = x == 1;
    } else if (strcmp(name, "curve_public_key") == 0) {
        cm->public_key = v;
        rc = get_curve_key(ld, v, key, &r->curve_public_key);
    } else if (strcmp(name, "curve_secret_key_file") == 0) {
        cm->secret_key_file = v;
        rc = get_string(ld, v, key, true, &r->curve_secret_key_file);
        if (rc == TDM_OK)
            rc = expand_home(ld, &r->curve_secret_key_file);
    } else if (strcmp(name, "cors_origins") == 0) {
        rc = parse_string_list(ld, v, "router.cors_origins", "origin", cors_origin_refused,
                               &r->cors_origins, &r->n_cors_origins);
    } else {
        rc = parse_string_list(ld, v, "router.api_keys", "API key", api_key_refused, &r->api_keys,
                               &r->n_api_keys);
    }
    return rc;
}

static int parse_router(loader_t *ld, const yaml_node_t *map, tdm_config_t *cfg,
                        endpoint_ref_t *eps, curve_marks_t *cm)
{
    static const char *const known[] = {"client_endpoint",
                                        "node_endpoint",
                                        "node_advertise",
                                        "http_address",
                                        "http_port",
                                        "http_threads",
                                        "http_connection_timeout_s",
                                        "http_max_connections",
                                        "http_max_connections_per_client",
                                        "prefill_policy",
                                        "max_queue",
                                        "request_timeout_s",
                                        "api_keys",
                                        "public_metrics",
                                        "curve_public_key",
                                        "curve_secret_key_file",
                                        "admission_control",
                                        "metrics_compat",
                                        "cors_origins",
                                        NULL};
    tdm_router_config_t *r = &cfg->router;
    int rc = check_mapping(ld, map, "router", known);
    FOR_EACH_PAIR(ld, map, p)
    {
        if (rc != TDM_OK)
            break;
        const char *name = scalar_text(node_at(ld, p->key));
        char key[KEY_MAX];
        key_join(key, "router", name);
        rc = parse_router_key(ld, name, node_at(ld, p->value), key, r, eps, cm);
    }
    return rc;
}

static int parse_kv(loader_t *ld, const yaml_node_t *map, tdm_config_t *cfg)
{
    static const char *const known[] = {"block_size", "dtype", "prefix_caching",
                                        "transfer_timeout_s", NULL};
    int rc = check_mapping(ld, map, "kv", known);
    FOR_EACH_PAIR(ld, map, p)
    {
        if (rc != TDM_OK)
            break;
        const char *name = scalar_text(node_at(ld, p->key));
        const yaml_node_t *v = node_at(ld, p->value);
        char key[KEY_MAX];
        key_join(key, "kv", name);
        if (strcmp(name, "block_size") == 0) {
            long long x = 0;
            rc = get_ll(ld, v, key, &x);
            if (rc == TDM_OK && (x < 1 || x > MAX_BLOCK_SIZE || (x & (x - 1)) != 0))
                rc = fail(ld, v, key, "must be a power of two between 1 and %d, got %lld",
                          MAX_BLOCK_SIZE, x);
            if (rc == TDM_OK)
                cfg->kv.block_size = (int)x;
        } else if (strcmp(name, "dtype") == 0) {
            int x = 0;
            /* kv.c names the dtypes; listed in enum order, as get_enum requires */
            const char *const dtype_names[] = {tdm_kv_dtype_name(TDM_KV_F32),
                                               tdm_kv_dtype_name(TDM_KV_F16),
                                               tdm_kv_dtype_name(TDM_KV_Q8)};
            rc = get_enum(ld, v, key, dtype_names, N_OF(dtype_names), &x);
            cfg->kv.dtype = (tdm_kv_dtype_t)x;
        } else if (strcmp(name, "transfer_timeout_s") == 0) {
            double x = 0;
            rc = get_double(ld, v, key, &x);
            if (rc == TDM_OK && !(x > 0 && x <= MAX_KV_TRANSFER_TIMEOUT_S))
                rc = fail(ld, v, key, "must be in (0, %g] seconds, got %g",
                          MAX_KV_TRANSFER_TIMEOUT_S, x);
            if (rc == TDM_OK)
                cfg->kv.transfer_timeout_s = x;
        } else {
            rc = get_bool(ld, v, key, &cfg->kv.prefix_caching);
        }
    }
    return rc;
}

static int parse_log(loader_t *ld, const yaml_node_t *map, tdm_config_t *cfg)
{
    static const char *const known[] = {"level", NULL};
    int rc = check_mapping(ld, map, "log", known);
    FOR_EACH_PAIR(ld, map, p)
    {
        if (rc != TDM_OK)
            break;
        const yaml_node_t *v = node_at(ld, p->value);
        char got[96];
        int level = v->type == YAML_SCALAR_NODE ? tdm_log_level_parse(scalar_text(v)) : -1;
        if (level < 0) {
            rc = fail(ld, v, "log.level", "must be one of debug, info, warn, error, off; got %s",
                      describe(v, got, sizeof got));
            break;
        }
        cfg->log.level = (tdm_log_level_t)level;
    }
    return rc;
}

static int parse_security(loader_t *ld, const yaml_node_t *map, tdm_config_t *cfg)
{
    static const char *const known[] = {"insecure", NULL};
    /* The four shared keys of earlier versions: refused with what replaced them. */
    static const char *const removed[] = {"curve_server_public_key", "curve_server_secret_key",
                                          "curve_client_public_key", "curve_client_secret_key"};
    FOR_EACH_PAIR(ld, map, p)
    {
        const yaml_node_t *k = node_at(ld, p->key);
        for (size_t i = 0; k->type == YAML_SCALAR_NODE && i < N_OF(removed); i++) {
            if (strcmp(scalar_text(k), removed[i]) != 0)
                continue;
            char key[KEY_MAX];
            key_join(key, "security", removed[i]);
            return fail(ld, k, key,
                        "was removed: give the router its own pair in router.curve_public_key / "
                        "router.curve_secret_key_file and each node its own in "
                        "nodes[].curve_public_key / nodes[].curve_secret_key_file (tandem keys "
                        "generate writes them)");
        }
    }
    int rc = check_mapping(ld, map, "security", known);
    FOR_EACH_PAIR(ld, map, p)
    {
        if (rc != TDM_OK)
            break;
        rc = get_bool(ld, node_at(ld, p->value), "security.insecure", &cfg->security.insecure);
    }
    return rc;
}

static bool node_id_valid(const char *id)
{
    size_t n = strlen(id);
    if (n == 0 || n > TDM_NODE_ID_MAX)
        return false;
    for (const char *c = id; *c; c++)
        if (!isalnum((unsigned char)*c) && *c != '.' && *c != '_' && *c != '-')
            return false;
    return true;
}

/* nodes[i].memory_budget: a byte size of at least MIN_MEMORY_BUDGET. */
static int get_memory_budget(loader_t *ld, const yaml_node_t *v, const char *key,
                             tdm_node_config_t *node)
{
    char got[96];
    if (v->type != YAML_SCALAR_NODE ||
        tdm_config_parse_bytes(scalar_text(v), &node->memory_budget) != TDM_OK)
        return fail(ld, v, key, "must be a byte size such as 512MiB, 2GiB or 1.5GB, got %s",
                    describe(v, got, sizeof got));
    if (node->memory_budget < MIN_MEMORY_BUDGET)
        return fail(ld, v, key, "must be at least 1MiB, got %s (%llu bytes)", scalar_text(v),
                    (unsigned long long)node->memory_budget);
    return TDM_OK;
}

/* nodes[i].grammar_cache_bytes: a byte size up to MAX_GRAMMAR_CACHE_BYTES (0: keep none). */
static int get_grammar_cache_bytes(loader_t *ld, const yaml_node_t *v, const char *key,
                                   tdm_node_config_t *node)
{
    char got[96];
    if (v->type != YAML_SCALAR_NODE ||
        tdm_config_parse_bytes(scalar_text(v), &node->grammar_cache_bytes) != TDM_OK ||
        node->grammar_cache_bytes > MAX_GRAMMAR_CACHE_BYTES)
        return fail(ld, v, key, "must be a byte size from 0 to 16GiB such as 64MiB, got %s",
                    describe(v, got, sizeof got));
    return TDM_OK;
}

/* nodes[i].speculative: a mapping {max_draft: 0..16, row_cost: 0..10} (null: the defaults). */
static int get_speculative(loader_t *ld, const yaml_node_t *map, const char *path,
                           tdm_node_config_t *node)
{
    static const char *const known[] = {"max_draft", "row_cost", NULL};
    char key[KEY_MAX];
    int rc = check_mapping(ld, map, path, known);
    FOR_EACH_PAIR(ld, map, p)
    {
        if (rc != TDM_OK)
            break;
        const char *name = scalar_text(node_at(ld, p->key));
        const yaml_node_t *v = node_at(ld, p->value);
        key_join(key, path, name);
        if (strcmp(name, "max_draft") == 0) {
            rc = get_int(ld, v, key, 0, TDM_CONFIG_MAX_SPEC_MAX_DRAFT, &node->spec_max_draft);
            continue;
        }
        rc = get_double(ld, v, key, &node->spec_row_cost);
        if (rc == TDM_OK && !(node->spec_row_cost >= 0 && node->spec_row_cost <= 10))
            rc =
                fail(ld, v, key, "must be from 0 to 10 (0: measured), got %g", node->spec_row_cost);
    }
    return rc;
}

/* One key of a nodes[] entry (check_mapping has refused unknown ones); marks where the keys
 * that later checks name were set. */
static int parse_node_key(loader_t *ld, const char *name, const yaml_node_t *v, const char *key,
                          tdm_node_config_t *node, node_marks_t *m)
{
    char got[96];
    int rc = TDM_OK;
    if (strcmp(name, "id") == 0) {
        m->id = v;
        rc = get_string(ld, v, key, false, &node->id);
        if (rc == TDM_OK && !node_id_valid(node->id))
            rc = fail(ld, v, key, "must be 1 to %d characters of A-Z a-z 0-9 . _ -, got %s",
                      TDM_NODE_ID_MAX, describe(v, got, sizeof got));
    } else if (strcmp(name, "role") == 0) {
        int x = 0;
        m->role = v;
        rc = get_enum(ld, v, key, role_names, N_OF(role_names), &x);
        node->role = (tdm_node_role_t)x;
    } else if (strcmp(name, "endpoint") == 0) {
        m->endpoint = v;
        rc = get_endpoint(ld, v, key, true, &node->endpoint);
    } else if (strcmp(name, "kv_endpoint") == 0) {
        m->kv_endpoint = v;
        rc = get_endpoint(ld, v, key, true, &node->kv_endpoint);
    } else if (strcmp(name, "kv_advertise") == 0) {
        m->kv_advertise = v;
        rc = get_advertise(ld, v, key, &node->kv_advertise);
    } else if (strcmp(name, "device") == 0) {
        if (v->type != YAML_SCALAR_NODE ||
            tdm_config_device_parse(scalar_text(v), &node->device) != TDM_OK)
            rc = fail(ld, v, key, "must be cpu or cuda:N (N from 0 to %d), got %s",
                      MAX_CUDA_DEVICES - 1, describe(v, got, sizeof got));
    } else if (strcmp(name, "threads") == 0) {
        rc = get_int(ld, v, key, 0, 1024, &node->threads);
    } else if (strcmp(name, "memory_budget") == 0) {
        m->memory_budget = v;
        rc = get_memory_budget(ld, v, key, node);
    } else if (strcmp(name, "gpu_memory_utilization") == 0) {
        m->gpu_memory_utilization = v;
        rc = get_double(ld, v, key, &node->gpu_memory_utilization);
        if (rc == TDM_OK &&
            !(node->gpu_memory_utilization > 0 && node->gpu_memory_utilization <= 1))
            rc = fail(ld, v, key, "must be more than 0 and at most 1, got %s", scalar_text(v));
    } else if (strcmp(name, "grammar_cache_bytes") == 0) {
        rc = get_grammar_cache_bytes(ld, v, key, node);
    } else if (strcmp(name, "speculative") == 0) {
        rc = get_speculative(ld, v, key, node);
    } else if (strcmp(name, "max_batch_tokens") == 0) {
        rc = get_int(ld, v, key, 1, 1048576, &node->max_batch_tokens);
    } else if (strcmp(name, "curve_public_key") == 0) {
        m->curve_public_key = v;
        rc = get_curve_key(ld, v, key, &node->curve_public_key);
    } else if (strcmp(name, "curve_secret_key_file") == 0) {
        m->curve_secret_key_file = v;
        rc = get_string(ld, v, key, true, &node->curve_secret_key_file);
        if (rc == TDM_OK)
            rc = expand_home(ld, &node->curve_secret_key_file);
    } else {
        rc = get_int(ld, v, key, 1, 65536, &node->max_running);
    }
    return rc;
}

/* The checks of a nodes[] entry that involve several of its keys. */
static int check_node(loader_t *ld, const yaml_node_t *map, const char *path,
                      const tdm_node_config_t *node, const node_marks_t *m)
{
    char key[KEY_MAX];
    if (!m->id) {
        key_join(key, path, "id");
        return fail(ld, map, key, "is required");
    }
    if (!m->role) {
        key_join(key, path, "role");
        return fail(ld, map, key, "is required (prefill or decode)");
    }
    if (node->kv_endpoint && node->role != TDM_NODE_ROLE_DECODE) {
        key_join(key, path, "kv_endpoint");
        return fail(ld, m->kv_endpoint, key, "only decode nodes receive KV pages");
    }
    if (node->kv_advertise && node->role != TDM_NODE_ROLE_DECODE) {
        key_join(key, path, "kv_advertise");
        return fail(ld, m->kv_advertise, key, "only decode nodes receive KV pages");
    }
    if (m->memory_budget && m->gpu_memory_utilization) {
        const yaml_node_t *later = line_of(m->memory_budget) > line_of(m->gpu_memory_utilization)
                                       ? m->memory_budget
                                       : m->gpu_memory_utilization;
        key_join(key, path, later == m->memory_budget ? "memory_budget" : "gpu_memory_utilization");
        return fail(ld, later, key, "set memory_budget or gpu_memory_utilization, not both");
    }
    if (m->gpu_memory_utilization && node->device.kind != TDM_NODE_DEVICE_CUDA) {
        key_join(key, path, "gpu_memory_utilization");
        return fail(ld, m->gpu_memory_utilization, key,
                    "only for cuda devices (this node's device is cpu); use memory_budget");
    }
    return TDM_OK;
}

static int parse_node(loader_t *ld, const yaml_node_t *map, size_t index, tdm_node_config_t *node,
                      node_marks_t *m)
{
    static const char *const known[] = {"id",
                                        "role",
                                        "endpoint",
                                        "kv_endpoint",
                                        "kv_advertise",
                                        "device",
                                        "threads",
                                        "memory_budget",
                                        "gpu_memory_utilization",
                                        "max_batch_tokens",
                                        "max_running",
                                        "grammar_cache_bytes",
                                        "speculative",
                                        "curve_public_key",
                                        "curve_secret_key_file",
                                        NULL};
    char path[KEY_MAX], key[KEY_MAX], got[96];
    snprintf(path, sizeof path, "nodes[%zu]", index);
    if (is_null(map) || map->type != YAML_MAPPING_NODE)
        return fail(ld, map, path, "must be a mapping with at least id and role, got %s",
                    describe(map, got, sizeof got));
    int rc = check_mapping(ld, map, path, known);
    FOR_EACH_PAIR(ld, map, p)
    {
        if (rc != TDM_OK)
            break;
        const char *name = scalar_text(node_at(ld, p->key));
        key_join(key, path, name);
        rc = parse_node_key(ld, name, node_at(ld, p->value), key, node, m);
    }
    if (rc != TDM_OK)
        return rc;
    return check_node(ld, map, path, node, m);
}

static int parse_nodes(loader_t *ld, const yaml_node_t *seq, tdm_config_t *cfg,
                       node_marks_t **marks)
{
    char got[96];
    if (seq->type != YAML_SEQUENCE_NODE)
        return fail(ld, seq, "nodes", "must be a list of nodes, got %s",
                    describe(seq, got, sizeof got));
    size_t n = (size_t)(seq->data.sequence.items.top - seq->data.sequence.items.start);
    if (n == 0)
        return fail(ld, seq, "nodes", "must list at least one decode node");
    if (n > TDM_CONFIG_MAX_NODES)
        return fail(ld, seq, "nodes", "lists %zu nodes; at most %d are supported", n,
                    TDM_CONFIG_MAX_NODES);
    cfg->nodes = calloc(n, sizeof *cfg->nodes);
    *marks = calloc(n, sizeof **marks);
    if (!cfg->nodes || !*marks)
        return tdm_error_set(ld->err, TDM_ERESOURCE, "%s: out of memory", ld->name);
    bool have_decode = false;
    for (size_t i = 0; i < n; i++) {
        const yaml_node_t *item = node_at(ld, seq->data.sequence.items.start[i]);
        cfg->nodes[i] = node_defaults();
        cfg->n_nodes = i + 1;
        int rc = parse_node(ld, item, i, &cfg->nodes[i], &(*marks)[i]);
        if (rc != TDM_OK)
            return rc;
        for (size_t j = 0; j < i; j++) {
            if (strcmp(cfg->nodes[j].id, cfg->nodes[i].id) == 0) {
                char key[KEY_MAX];
                snprintf(key, sizeof key, "nodes[%zu].id", i);
                return fail(ld, (*marks)[i].id, key,
                            "duplicate node id '%s' (first at line %zu, nodes[%zu])",
                            cfg->nodes[i].id, line_of((*marks)[j].id), j);
            }
        }
        have_decode = have_decode || cfg->nodes[i].role == TDM_NODE_ROLE_DECODE;
    }
    if (!have_decode)
        return fail(ld, seq, "nodes", "must list at least one decode node (role: decode)");
    return TDM_OK;
}

/* No two ZMQ endpoints (router's, nodes' control and KV) may be the same string. Where an
 * endpoint has an advertised form (router.node_advertise, nodes[].kv_advertise), that form
 * must be unique too; a decode node's kv_endpoint is then only a bind address (the same
 * tcp://0.0.0.0:7610 on every host of a container deployment) and is left out. eps has room
 * for 3 + 2 * n_nodes entries; eps[0..2].at are the router's marks. */
static int check_endpoints(loader_t *ld, tdm_config_t *cfg, endpoint_ref_t *eps,
                           const node_marks_t *marks)
{
    size_t n = 2;
    eps[0].value = cfg->router.client_endpoint;
    snprintf(eps[0].key, KEY_MAX, "router.client_endpoint");
    eps[1].value = cfg->router.node_endpoint;
    snprintf(eps[1].key, KEY_MAX, "router.node_endpoint");
    if (cfg->router.node_advertise &&
        strcmp(cfg->router.node_advertise, cfg->router.node_endpoint) != 0) {
        eps[n].value = cfg->router.node_advertise;
        snprintf(eps[n++].key, KEY_MAX, "router.node_advertise");
    }
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        if (cfg->nodes[i].endpoint) {
            eps[n] = (endpoint_ref_t){.value = cfg->nodes[i].endpoint,
                                      .at = marks ? marks[i].endpoint : NULL};
            snprintf(eps[n++].key, KEY_MAX, "nodes[%zu].endpoint", i);
        }
        if (cfg->nodes[i].kv_advertise) {
            eps[n] = (endpoint_ref_t){.value = cfg->nodes[i].kv_advertise,
                                      .at = marks ? marks[i].kv_advertise : NULL};
            snprintf(eps[n++].key, KEY_MAX, "nodes[%zu].kv_advertise", i);
        } else if (cfg->nodes[i].kv_endpoint) {
            eps[n] = (endpoint_ref_t){.value = cfg->nodes[i].kv_endpoint,
                                      .at = marks ? marks[i].kv_endpoint : NULL};
            snprintf(eps[n++].key, KEY_MAX, "nodes[%zu].kv_endpoint", i);
        }
    }
    for (size_t i = 1; i < n; i++) {
        for (size_t j = 0; j < i; j++) {
            if (strcmp(eps[i].value, eps[j].value) != 0)
                continue;
            /* Report at a value written in the file: the later one when both are. */
            const endpoint_ref_t *at = eps[i].at ? &eps[i] : &eps[j];
            const endpoint_ref_t *other = at == &eps[i] ? &eps[j] : &eps[i];
            if (!at->at)
                continue; /* two defaults never collide */
            return fail(ld, at->at, at->key, "endpoint %s is also used by %s%s", at->value,
                        other->key, other->at ? "" : " (its default)");
        }
    }
    return TDM_OK;
}

/* CURVE is all or nothing: with router.curve_public_key set, the router and every node have a
 * public key and a secret key file, and no two public keys are the same (a shared key would
 * let one node pose as another); without it, no node has keys. marks is NULL for the default
 * nodes, whose errors are reported at router.curve_public_key. */
static int check_curve(loader_t *ld, const tdm_config_t *cfg, const curve_marks_t *cm,
                       const node_marks_t *marks)
{
    char key[KEY_MAX];
    const tdm_router_config_t *r = &cfg->router;
    if (!r->curve_public_key) {
        if (r->curve_secret_key_file)
            return fail(ld, cm->secret_key_file, "router.curve_secret_key_file",
                        "is set but router.curve_public_key is not; set both or neither");
        for (size_t i = 0; marks && i < cfg->n_nodes; i++) {
            const tdm_node_config_t *n = &cfg->nodes[i];
            if (!n->curve_public_key && !n->curve_secret_key_file)
                continue;
            bool pub = n->curve_public_key != NULL;
            snprintf(key, sizeof key, "nodes[%zu].%s", i,
                     pub ? "curve_public_key" : "curve_secret_key_file");
            return fail(ld, pub ? marks[i].curve_public_key : marks[i].curve_secret_key_file, key,
                        "CURVE is off because router.curve_public_key is not set; give the "
                        "router its pair too (tandem keys generate writes all of them)");
        }
        return TDM_OK;
    }
    if (!r->curve_secret_key_file)
        return fail(ld, cm->public_key, "router.curve_secret_key_file",
                    "is required with router.curve_public_key: the file holding the router's "
                    "secret key");
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        const tdm_node_config_t *n = &cfg->nodes[i];
        const yaml_node_t *at = marks ? marks[i].id : cm->public_key;
        if (!n->curve_public_key) {
            snprintf(key, sizeof key, "nodes[%zu].curve_public_key", i);
            return fail(ld, at, key,
                        "node '%s' has no CURVE public key, but CURVE is on "
                        "(router.curve_public_key is set): every node needs its own pair "
                        "(tandem keys generate writes them)",
                        n->id);
        }
        at = marks ? marks[i].curve_public_key : at;
        if (!n->curve_secret_key_file) {
            snprintf(key, sizeof key, "nodes[%zu].curve_secret_key_file", i);
            return fail(ld, at, key,
                        "is required with nodes[%zu].curve_public_key: the file holding node "
                        "'%s''s secret key",
                        i, n->id);
        }
        snprintf(key, sizeof key, "nodes[%zu].curve_public_key", i);
        if (strcmp(n->curve_public_key, r->curve_public_key) == 0)
            return fail(ld, at, key,
                        "node '%s' has the router's public key; every node needs its own pair",
                        n->id);
        for (size_t j = 0; j < i; j++)
            if (strcmp(cfg->nodes[j].curve_public_key, n->curve_public_key) == 0)
                return fail(ld, at, key,
                            "duplicate CURVE public key: node '%s' has the same key as "
                            "nodes[%zu] ('%s'); every node needs its own pair",
                            n->id, j, cfg->nodes[j].id);
    }
    return TDM_OK;
}

/* The checks across sections, once every section is read: endpoints (the router's three
 * first) and CURVE keys. */
static int check_cross(loader_t *ld, tdm_config_t *cfg, const endpoint_ref_t router_eps[3],
                       const curve_marks_t *cm, const node_marks_t *marks)
{
    endpoint_ref_t *eps = calloc(3 + 2 * cfg->n_nodes, sizeof *eps);
    if (!eps)
        return tdm_error_set(ld->err, TDM_ERESOURCE, "%s: out of memory", ld->name);
    eps[0].at = router_eps[0].at;
    eps[1].at = router_eps[1].at;
    eps[2].at = router_eps[2].at;
    int rc = check_endpoints(ld, cfg, eps, marks);
    free(eps);
    if (rc == TDM_OK)
        rc = check_curve(ld, cfg, cm, marks);
    return rc;
}

static int parse_root(loader_t *ld, const yaml_node_t *root, tdm_config_t *cfg)
{
    static const char *const known[] = {"model", "log", "router", "kv", "security", "nodes", NULL};
    char got[96];
    int rc;
    if (!root || is_null(root))
        return config_finish(cfg, false);
    if (root->type != YAML_MAPPING_NODE)
        return tdm_error_set(ld->err, TDM_EINVALID,
                             "%s:%zu: the top level must be a mapping, got %s", ld->name,
                             line_of(root), describe(root, got, sizeof got));
    if ((rc = check_mapping(ld, root, "", known)) != TDM_OK)
        return rc;
    endpoint_ref_t router_eps[3] = {{0}};
    curve_marks_t cm = {0};
    node_marks_t *marks = NULL;
    bool nodes_given = false;
    FOR_EACH_PAIR(ld, root, p)
    {
        const char *name = scalar_text(node_at(ld, p->key));
        const yaml_node_t *v = node_at(ld, p->value);
        if (strcmp(name, "model") == 0) {
            rc = parse_model(ld, v, cfg);
        } else if (strcmp(name, "router") == 0) {
            rc = parse_router(ld, v, cfg, router_eps, &cm);
        } else if (strcmp(name, "kv") == 0) {
            rc = parse_kv(ld, v, cfg);
        } else if (strcmp(name, "log") == 0) {
            rc = parse_log(ld, v, cfg);
        } else if (strcmp(name, "security") == 0) {
            rc = parse_security(ld, v, cfg);
        } else {
            nodes_given = true;
            rc = parse_nodes(ld, v, cfg, &marks);
        }
        if (rc != TDM_OK)
            goto out_free_marks;
    }
    rc = config_finish(cfg, nodes_given);
    if (rc != TDM_OK) {
        tdm_error_set(ld->err, rc, "%s: %s", ld->name,
                      rc == TDM_ENOTFOUND ? "cannot form the default model path: neither "
                                            "XDG_CACHE_HOME nor HOME is set; set model.path"
                                          : "out of memory");
        goto out_free_marks;
    }
    rc = check_cross(ld, cfg, router_eps, &cm, marks);
out_free_marks:
    free(marks);
    return rc;
}

/* The error of a failed yaml_parser_load: TDM_ERESOURCE, or TDM_EINVALID with "NAME:LINE:
 * YAML syntax error: ...". The line comes from the problem's offset for reader errors (bad
 * UTF-8, control characters) and is never past the text's last line. */
static int syntax_error(loader_t *ld, const yaml_parser_t *parser, const char *text, size_t len)
{
    if (parser->error == YAML_MEMORY_ERROR)
        return tdm_error_set(ld->err, TDM_ERESOURCE, "%s: out of memory", ld->name);
    size_t n_lines = 1, line = parser->problem_mark.line + 1;
    for (size_t i = 0; i + 1 < len; i++)
        n_lines += text[i] == '\n';
    if (parser->error == YAML_READER_ERROR) {
        line = 1;
        for (size_t i = 0; i < parser->problem_offset && i < len; i++)
            line += text[i] == '\n';
    }
    if (line > n_lines)
        line = n_lines;
    return tdm_error_set(ld->err, TDM_EINVALID, "%s:%zu: YAML syntax error: %s%s%s", ld->name, line,
                         parser->problem ? parser->problem : "malformed",
                         parser->context ? " " : "", parser->context ? parser->context : "");
}

int tdm_config_load_string(const char *text, size_t len, const char *name, tdm_config_t *cfg,
                           tdm_error_t *err)
{
    loader_t ld = {.name = name ? name : "<string>", .err = err};
    yaml_parser_t parser;
    yaml_document_t doc;
    int rc = config_init(cfg);
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "%s: out of memory", ld.name);
    if (!yaml_parser_initialize(&parser)) {
        rc = tdm_error_set(err, TDM_ERESOURCE, "%s: out of memory", ld.name);
        goto out_free_config;
    }
    yaml_parser_set_input_string(&parser, (const unsigned char *)text, len);
    if (!yaml_parser_load(&parser, &doc)) {
        rc = syntax_error(&ld, &parser, text, len);
        goto out_delete_parser;
    }
    ld.doc = &doc;
    const yaml_node_t *root = yaml_document_get_root_node(&doc);
    if (root) {
        yaml_document_t next;
        if (!yaml_parser_load(&parser, &next)) {
            rc = syntax_error(&ld, &parser, text, len);
            goto out_delete_doc;
        }
        const yaml_node_t *more = yaml_document_get_root_node(&next);
        size_t more_line = more ? line_of(more) : 0;
        yaml_document_delete(&next);
        if (more) {
            rc = tdm_error_set(err, TDM_EINVALID,
                               "%s:%zu: a second YAML document; a config file holds one", ld.name,
                               more_line);
            goto out_delete_doc;
        }
    }
    rc = parse_root(&ld, root, cfg);
    if (rc == TDM_OK)
        tdm_error_clear(err);
out_delete_doc:
    yaml_document_delete(&doc);
out_delete_parser:
    yaml_parser_delete(&parser);
out_free_config:
    if (rc != TDM_OK)
        tdm_config_free(cfg);
    return rc;
}

int tdm_config_load_file(const char *path, tdm_config_t *cfg, tdm_error_t *err)
{
    char *text;
    size_t len;
    memset(cfg, 0, sizeof *cfg);
    int rc = tdm_read_file(path, TDM_CONFIG_MAX_FILE_BYTES, &text, &len, err);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_config_load_string(text, len, path, cfg, err);
    free(text);
    return rc;
}

/* ---- the dumper ---- */

/* Writes s as a YAML double-quoted scalar, or null. */
static void put_string(FILE *out, const char *s)
{
    if (!s) {
        fputs("null", out);
        return;
    }
    fputc('"', out);
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\')
            fprintf(out, "\\%c", *c);
        else if (*c < 0x20 || *c == 0x7f)
            fprintf(out, "\\x%02x", *c);
        else
            fputc(*c, out);
    }
    fputc('"', out);
}

/* Writes the shortest decimal form of x that reads back as the same double. */
static void put_double(FILE *out, double x)
{
    char buf[32];
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, sizeof buf, "%.*g", prec, x);
        if (strtod(buf, NULL) == x)
            break;
    }
    fputs(buf, out);
}

static void put_key_string(FILE *out, const char *indent, const char *key, const char *s)
{
    fprintf(out, "%s%s: ", indent, key);
    put_string(out, s);
    fputc('\n', out);
}

static void dump_router(const tdm_router_config_t *r, FILE *out)
{
    put_key_string(out, "  ", "client_endpoint", r->client_endpoint);
    put_key_string(out, "  ", "node_endpoint", r->node_endpoint);
    put_key_string(out, "  ", "node_advertise", r->node_advertise);
    put_key_string(out, "  ", "http_address", r->http_address);
    fprintf(out, "  http_port: %d\n", r->http_port);
    fprintf(out, "  http_threads: %d\n", r->http_threads);
    fprintf(out, "  http_connection_timeout_s: %d\n", r->http_connection_timeout_s);
    fprintf(out, "  http_max_connections: %d\n", r->http_max_connections);
    fprintf(out, "  http_max_connections_per_client: %d\n", r->http_max_connections_per_client);
    fprintf(out, "  prefill_policy: %s\n", tdm_config_prefill_policy_name(r->prefill_policy));
    fprintf(out, "  max_queue: %d\n", r->max_queue);
    fprintf(out, "  admission_control: %s\n", r->admission_control ? "true" : "false");
    fprintf(out, "  metrics_compat: %s\n", r->metrics_compat_vllm ? "vllm" : "none");
    fprintf(out, "  request_timeout_s: ");
    put_double(out, r->request_timeout_s);
    fprintf(out, "\n  api_keys:%s\n", r->n_api_keys ? "" : " []");
    for (size_t i = 0; i < r->n_api_keys; i++) {
        fprintf(out, "    - ");
        put_string(out, r->api_keys[i]);
        fputc('\n', out);
    }
    put_key_string(out, "  ", "curve_public_key", r->curve_public_key);
    put_key_string(out, "  ", "curve_secret_key_file", r->curve_secret_key_file);
    fprintf(out, "  public_metrics: %s\n", r->public_metrics ? "true" : "false");
    fprintf(out, "  cors_origins:%s\n", r->n_cors_origins ? "" : " []");
    for (size_t i = 0; i < r->n_cors_origins; i++) {
        fprintf(out, "    - ");
        put_string(out, r->cors_origins[i]);
        fputc('\n', out);
    }
}

static void dump_node(const tdm_node_config_t *node, FILE *out)
{
    char buf[32];
    fprintf(out, "  - id: ");
    put_string(out, node->id);
    fprintf(out, "\n    role: %s\n", tdm_config_node_role_name(node->role));
    put_key_string(out, "    ", "endpoint", node->endpoint);
    if (node->role == TDM_NODE_ROLE_DECODE) {
        put_key_string(out, "    ", "kv_endpoint", node->kv_endpoint);
        put_key_string(out, "    ", "kv_advertise", node->kv_advertise);
    }
    tdm_config_device_format(node->device, buf, sizeof buf);
    fprintf(out, "    device: %s\n", buf);
    fprintf(out, "    threads: %d\n", node->threads);
    if (node->gpu_memory_utilization > 0) {
        fprintf(out, "    gpu_memory_utilization: ");
        put_double(out, node->gpu_memory_utilization);
        fputc('\n', out);
    } else {
        tdm_config_format_bytes(node->memory_budget, buf, sizeof buf);
        fprintf(out, "    memory_budget: %s\n", buf);
    }
    fprintf(out, "    max_batch_tokens: %d\n", node->max_batch_tokens);
    fprintf(out, "    max_running: %d\n", node->max_running);
    tdm_config_format_bytes(node->grammar_cache_bytes, buf, sizeof buf);
    fprintf(out, "    grammar_cache_bytes: %s\n", buf);
    fprintf(out, "    speculative:\n      max_draft: %d\n      row_cost: %g\n",
            node->spec_max_draft, node->spec_row_cost);
    put_key_string(out, "    ", "curve_public_key", node->curve_public_key);
    put_key_string(out, "    ", "curve_secret_key_file", node->curve_secret_key_file);
}

int tdm_config_dump(const tdm_config_t *cfg, FILE *out)
{
    fprintf(out, "# Tandem cluster configuration, resolved (defaults included).\n");
    fprintf(out, "model:\n");
    put_key_string(out, "  ", "path", cfg->model.path);
    fprintf(out, "  chat_template: %s\n",
            cfg->model.chat_template_set ? tdm_chat_template_name(cfg->model.chat_template)
                                         : "null");
    put_key_string(out, "  ", "name", cfg->model.name);
    fprintf(out, "router:\n");
    dump_router(&cfg->router, out);
    fprintf(out, "kv:\n");
    fprintf(out, "  block_size: %d\n", cfg->kv.block_size);
    fprintf(out, "  dtype: %s\n", tdm_kv_dtype_name(cfg->kv.dtype));
    fprintf(out, "  prefix_caching: %s\n", cfg->kv.prefix_caching ? "true" : "false");
    fprintf(out, "  transfer_timeout_s: ");
    put_double(out, cfg->kv.transfer_timeout_s);
    fputc('\n', out);
    fprintf(out, "log:\n");
    fprintf(out, "  level: %s\n", tdm_log_level_name(cfg->log.level));
    fprintf(out, "security:\n");
    fprintf(out, "  insecure: %s\n", cfg->security.insecure ? "true" : "false");
    fprintf(out, "nodes:\n");
    for (size_t i = 0; i < cfg->n_nodes; i++)
        dump_node(&cfg->nodes[i], out);
    if (fflush(out) != 0 || ferror(out))
        return TDM_EUNAVAILABLE;
    return TDM_OK;
}
