/* config.c - the cluster configuration as a value: its defaults (from the key table and, for
 * what depends on other keys, config_finish), freeing it, and the small parsers and queries
 * the daemons use (devices, byte sizes, the model path, API keys, advertised endpoints).
 *
 * The key table (config_keys.c) decides every key; config_load.c reads a file over the
 * defaults, config_check.c holds the checks across keys, config_dump.c writes a config and
 * the docs' key tables.
 */
#include "config_internal.h"

#include <ctype.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_KV_HOST "tcp://127.0.0.1"
#define DEFAULT_KV_PORT 7610
#define DEFAULT_CPU_MEMORY_BUDGET (2ull << 30)
#define DEFAULT_GPU_MEMORY_UTILIZATION 0.9

/* ---- devices ---- */

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
        if (index >= TDM_CONFIG_MAX_CUDA_DEVICES)
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
    for (size_t i = 0; i < TDM_CONFIG_N_OF(byte_units); i++)
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
    for (size_t i = 0; i < TDM_CONFIG_N_OF(units); i++)
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

/* Frees the strings and lists of section's rows in base (a tdm_config_t or tdm_node_config_t). */
static void section_free(tdm_config_section_t section, char *base)
{
    size_t n_keys;
    const tdm_config_key_t *keys = tdm_config_keys(&n_keys);
    for (size_t i = 0; i < n_keys; i++) {
        const tdm_config_key_t *k = &keys[i];
        if (k->section != section)
            continue;
        switch (k->type) {
        case TDM_CONFIG_TYPE_STRING:
        case TDM_CONFIG_TYPE_PATH:
        case TDM_CONFIG_TYPE_ENDPOINT:
        case TDM_CONFIG_TYPE_CURVE_KEY: free(*(char **)(base + k->offset)); break;
        case TDM_CONFIG_TYPE_LIST: {
            char **items = *(char ***)(base + k->offset);
            size_t n = *(size_t *)(base + k->aux_offset);
            for (size_t j = 0; j < n; j++)
                free(items[j]);
            free(items);
            break;
        }
        case TDM_CONFIG_TYPE_MAPPING: section_free(k->sub, base); break;
        default: break;
        }
    }
}

void tdm_config_model_free(tdm_model_config_t *m)
{
    if (!m)
        return;
    tdm_config_t one; /* the model rows are fields of a tdm_config_t's model */
    memset(&one, 0, sizeof one);
    one.model = *m;
    section_free(TDM_CONFIG_SECTION_MODEL, (char *)&one);
    memset(m, 0, sizeof *m);
}

int tdm_config_model_copy(tdm_model_config_t *dst, const tdm_model_config_t *src)
{
    *dst = *src;
    dst->path = dst->chat_template = dst->name = NULL;
    dst->aliases = NULL;
    dst->n_aliases = 0;
    if ((src->path && !(dst->path = tdm_strdup(src->path))) ||
        (src->chat_template && !(dst->chat_template = tdm_strdup(src->chat_template))) ||
        (src->name && !(dst->name = tdm_strdup(src->name))))
        return TDM_ERESOURCE;
    if (src->n_aliases) {
        if (!(dst->aliases = calloc(src->n_aliases, sizeof *dst->aliases)))
            return TDM_ERESOURCE;
        for (size_t i = 0; i < src->n_aliases; i++) {
            dst->n_aliases = i + 1;
            if (!(dst->aliases[i] = tdm_strdup(src->aliases[i])))
                return TDM_ERESOURCE;
        }
    }
    return TDM_OK;
}

void tdm_config_free(tdm_config_t *cfg)
{
    if (!cfg)
        return;
    for (size_t i = 0; i < cfg->n_models; i++)
        tdm_config_model_free(&cfg->models[i]);
    free(cfg->models);
    section_free(TDM_CONFIG_SECTION_TOP, (char *)cfg);
    for (size_t i = 0; i < cfg->n_nodes; i++)
        section_free(TDM_CONFIG_SECTION_NODE, (char *)&cfg->nodes[i]);
    free(cfg->nodes);
    memset(cfg, 0, sizeof *cfg);
}

int tdm_config_node_defaults(tdm_node_config_t *node)
{
    memset(node, 0, sizeof *node);
    return tdm_config_section_defaults(TDM_CONFIG_SECTION_NODE, node);
}

int tdm_config_init(tdm_config_t *cfg)
{
    memset(cfg, 0, sizeof *cfg);
    int rc = tdm_config_section_defaults(TDM_CONFIG_SECTION_TOP, cfg);
    if (rc != TDM_OK)
        tdm_config_free(cfg);
    return rc;
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

/* The two default nodes, prefill-0 and decode-0. Errors: TDM_ERESOURCE. */
static int default_nodes(tdm_config_t *cfg)
{
    static const char *const ids[] = {"prefill-0", "decode-0"};
    cfg->nodes = calloc(2, sizeof *cfg->nodes);
    if (!cfg->nodes)
        return TDM_ERESOURCE;
    for (size_t i = 0; i < 2; i++) {
        cfg->n_nodes = i + 1;
        if (tdm_config_node_defaults(&cfg->nodes[i]) != TDM_OK ||
            !(cfg->nodes[i].id = tdm_strdup(ids[i])))
            return TDM_ERESOURCE;
    }
    cfg->nodes[1].role = TDM_NODE_ROLE_DECODE;
    return TDM_OK;
}

/* The derived defaults of one model: the default path, the name from the path. */
static int model_finish(tdm_model_config_t *m)
{
    if (!m->path) {
        char path[4096];
        int rc = tdm_model_default_path(path, sizeof path);
        if (rc != TDM_OK)
            return rc;
        if (!(m->path = tdm_strdup(path)))
            return TDM_ERESOURCE;
    }
    if (!m->name && !(m->name = model_name_from_path(m->path)))
        return TDM_ERESOURCE;
    return TDM_OK;
}

/* cfg->models and cfg->model made the same: the model: section as a list of one, or the
 * first of the models: list copied into model. Errors: TDM_ERESOURCE, TDM_ENOTFOUND. */
static int models_finish(tdm_config_t *cfg, bool models_given)
{
    int rc;
    if (!models_given) {
        if ((rc = model_finish(&cfg->model)) != TDM_OK)
            return rc;
        if (!(cfg->models = calloc(1, sizeof *cfg->models)))
            return TDM_ERESOURCE;
        cfg->n_models = 1;
        return tdm_config_model_copy(&cfg->models[0], &cfg->model);
    }
    for (size_t i = 0; i < cfg->n_models; i++)
        if ((rc = model_finish(&cfg->models[i])) != TDM_OK)
            return rc;
    tdm_config_model_free(&cfg->model);
    return tdm_config_model_copy(&cfg->model, &cfg->models[0]);
}

int tdm_config_model_index(const tdm_config_t *cfg, const char *served)
{
    if (!cfg || !served || !served[0])
        return -1;
    for (size_t i = 0; i < cfg->n_models; i++) {
        const tdm_model_config_t *m = &cfg->models[i];
        if (m->name && strcmp(m->name, served) == 0)
            return (int)i;
        for (size_t j = 0; j < m->n_aliases; j++)
            if (strcmp(m->aliases[j], served) == 0)
                return (int)i;
    }
    return -1;
}

size_t tdm_config_node_model_index(const tdm_config_t *cfg, const tdm_node_config_t *node)
{
    int i = node ? tdm_config_model_index(cfg, node->model) : -1;
    return i < 0 ? 0 : (size_t)i;
}

const tdm_model_config_t *tdm_config_node_model(const tdm_config_t *cfg,
                                                const tdm_node_config_t *node)
{
    return &cfg->models[tdm_config_node_model_index(cfg, node)];
}

int tdm_config_finish(tdm_config_t *cfg, bool nodes_given, bool models_given)
{
    int rc = models_finish(cfg, models_given);
    if (rc != TDM_OK)
        return rc;
    if (!nodes_given && default_nodes(cfg) != TDM_OK)
        return TDM_ERESOURCE;
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
    int rc = tdm_config_init(cfg);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_config_finish(cfg, false, false);
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

const char *const *tdm_config_router_endpoints(const tdm_config_t *cfg, size_t *n)
{
    if (cfg->router.n_node_endpoints > 0) {
        *n = cfg->router.n_node_endpoints;
        return (const char *const *)cfg->router.node_endpoints;
    }
    *n = 1;
    return cfg->router.node_advertise ? (const char *const *)&cfg->router.node_advertise
                                      : (const char *const *)&cfg->router.node_endpoint;
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
