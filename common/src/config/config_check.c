/* config_check.c - the checks that involve several keys: a node entry's required and
 * decode-only keys and its memory pair, distinct ZeroMQ endpoints, CURVE keys all or nothing,
 * and which binds a daemon may make (loopback, or guarded by CURVE or API keys).
 *
 * Single keys are checked as they are read (config_value.c, by their table rows); these run
 * once the keys they compare are all read, and report at the value written last in the file.
 */
#include "config_internal.h"

#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <arpa/inet.h>

/* Where key name of nodes[i] was written; NULL for the default nodes or a key not written. */
static const yaml_node_t *node_mark(const tdm_config_loader_t *ld, size_t i, const char *name)
{
    if (!ld->node_marks)
        return NULL;
    return tdm_config_mark(ld->node_marks + i * ld->n_keys, TDM_CONFIG_SECTION_NODE, name);
}

/* "is required", with the values of an enum: "is required (prefill or decode)". */
static int fail_required(tdm_config_loader_t *ld, const yaml_node_t *map, const char *key,
                         const tdm_config_key_t *k)
{
    char values[128] = "";
    for (int i = 0; k->values && i < k->values->n_values; i++) {
        size_t len = strlen(values);
        snprintf(values + len, sizeof values - len, "%s%s", i ? " or " : " (", k->values->name(i));
    }
    return tdm_config_fail(ld, map, key, "is required%s%s", values, k->values ? ")" : "");
}

/* The rows of a node entry that the entry must have, and those only a decode node may. */
static int check_node_rows(tdm_config_loader_t *ld, const yaml_node_t *map, size_t index,
                           const tdm_node_config_t *node)
{
    char path[TDM_CONFIG_KEY_MAX], key[TDM_CONFIG_KEY_MAX];
    size_t n_keys;
    const tdm_config_key_t *keys = tdm_config_keys(&n_keys);
    snprintf(path, sizeof path, "nodes[%zu]", index);
    for (size_t i = 0; i < n_keys; i++) {
        const tdm_config_key_t *k = &keys[i];
        if (k->section != TDM_CONFIG_SECTION_NODE)
            continue;
        tdm_config_key_join(key, path, k->name);
        const yaml_node_t *at = node_mark(ld, index, k->name);
        if ((k->flags & TDM_CONFIG_REQUIRED) && !at)
            return fail_required(ld, map, key, k);
        /* decode-only rows are endpoints: set means a non-NULL string */
        if ((k->flags & TDM_CONFIG_DECODE_ONLY) && node->role != TDM_NODE_ROLE_DECODE &&
            *(char *const *)((const char *)node + k->offset))
            return tdm_config_fail(ld, at, key, "only decode nodes receive KV pages");
    }
    return TDM_OK;
}

int tdm_config_check_node(tdm_config_loader_t *ld, const yaml_node_t *map, size_t index,
                          const tdm_node_config_t *node)
{
    char key[TDM_CONFIG_KEY_MAX];
    int rc = check_node_rows(ld, map, index, node);
    if (rc != TDM_OK)
        return rc;
    const yaml_node_t *budget = node_mark(ld, index, "memory_budget");
    const yaml_node_t *util = node_mark(ld, index, "gpu_memory_utilization");
    if (budget && util) {
        bool budget_later = tdm_config_line(budget) > tdm_config_line(util);
        snprintf(key, sizeof key, "nodes[%zu].%s", index,
                 budget_later ? "memory_budget" : "gpu_memory_utilization");
        return tdm_config_fail(ld, budget_later ? budget : util, key,
                               "set memory_budget or gpu_memory_utilization, not both");
    }
    if (util && node->device.kind != TDM_NODE_DEVICE_CUDA) {
        snprintf(key, sizeof key, "nodes[%zu].gpu_memory_utilization", index);
        return tdm_config_fail(ld, util, key,
                               "only for cuda devices (this node's device is cpu); use "
                               "memory_budget");
    }
    return TDM_OK;
}

/* ---- endpoints ---- */

/* Where one ZMQ endpoint came from, for the duplicate check. */
typedef struct endpoint_ref {
    const char *value;
    char key[TDM_CONFIG_KEY_MAX];
    const yaml_node_t *at; /* NULL when the value is a default */
} endpoint_ref_t;

/* The endpoints that must be distinct into eps (room for 3 + 2 * n_nodes); returns how many.
 * Where an endpoint has an advertised form (router.node_advertise, nodes[].kv_advertise), that
 * form is taken; a decode node's kv_endpoint is then only a bind address (the same
 * tcp://0.0.0.0:7610 on every host of a container deployment) and is left out. */
static size_t endpoints_list(const tdm_config_loader_t *ld, const tdm_config_t *cfg,
                             endpoint_ref_t *eps)
{
    static const char *const router_keys[] = {"client_endpoint", "node_endpoint", "node_advertise"};
    const char *router_values[] = {cfg->router.client_endpoint, cfg->router.node_endpoint,
                                   cfg->router.node_advertise};
    size_t n = 0;
    for (size_t i = 0; i < 3; i++) {
        if (!router_values[i] || (i == 2 && strcmp(router_values[2], router_values[1]) == 0))
            continue;
        eps[n].value = router_values[i];
        eps[n].at = tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_ROUTER, router_keys[i]);
        snprintf(eps[n++].key, TDM_CONFIG_KEY_MAX, "router.%s", router_keys[i]);
    }
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        const tdm_node_config_t *node = &cfg->nodes[i];
        const char *kv = node->kv_advertise ? "kv_advertise" : "kv_endpoint";
        const char *names[] = {"endpoint", kv};
        const char *values[] = {node->endpoint,
                                node->kv_advertise ? node->kv_advertise : node->kv_endpoint};
        for (size_t j = 0; j < 2; j++) {
            if (!values[j])
                continue;
            eps[n].value = values[j];
            eps[n].at = node_mark(ld, i, names[j]);
            snprintf(eps[n++].key, TDM_CONFIG_KEY_MAX, "nodes[%zu].%s", i, names[j]);
        }
    }
    return n;
}

/* No two ZMQ endpoints (router's, nodes' control and KV) may be the same string. */
static int check_endpoints(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    endpoint_ref_t *eps = calloc(3 + 2 * cfg->n_nodes, sizeof *eps);
    if (!eps)
        return tdm_config_fail_memory(ld);
    size_t n = endpoints_list(ld, cfg, eps);
    int rc = TDM_OK;
    for (size_t i = 1; i < n && rc == TDM_OK; i++) {
        for (size_t j = 0; j < i && rc == TDM_OK; j++) {
            if (strcmp(eps[i].value, eps[j].value) != 0)
                continue;
            /* Report at a value written in the file: the later one when both are. */
            const endpoint_ref_t *at = eps[i].at ? &eps[i] : &eps[j];
            const endpoint_ref_t *other = at == &eps[i] ? &eps[j] : &eps[i];
            if (at->at) /* two defaults never collide */
                rc = tdm_config_fail(ld, at->at, at->key, "endpoint %s is also used by %s%s",
                                     at->value, other->key, other->at ? "" : " (its default)");
        }
    }
    free(eps);
    return rc;
}

/* A wildcard bind host: every address of the host. */
static bool host_is_wildcard(const char *h, size_t n)
{
    return (n == 1 && h[0] == '*') || (n == 7 && memcmp(h, "0.0.0.0", 7) == 0) ||
           (n == 2 && memcmp(h, "::", 2) == 0) || (n == 4 && memcmp(h, "[::]", 4) == 0);
}

/* Whether ZMQ endpoint ep ("tcp://HOST:PORT") binds the HTTP API's address and port: the same
 * port, and the same host or either one a wildcard. */
static bool endpoint_takes_http(const char *ep, const char *http_address, long http_port)
{
    if (strncmp(ep, "tcp://", 6) != 0)
        return false;
    const char *h = ep + 6, *colon = strrchr(h, ':');
    if (!colon)
        return false;
    char *end = NULL;
    long port = strtol(colon + 1, &end, 10);
    if (end == colon + 1 || *end != '\0' || port != http_port)
        return false;
    size_t n = (size_t)(colon - h), an = strlen(http_address);
    return host_is_wildcard(h, n) || host_is_wildcard(http_address, an) ||
           (n == an && memcmp(h, http_address, n) == 0);
}

/* Whether endpoint ref is bound on the router's host: the router's own binds, and a node's
 * loopback endpoint (loopback endpoints are one host's). A node's other endpoints may be
 * another host's. */
static bool endpoint_on_router_host(const endpoint_ref_t *e)
{
    if (strcmp(e->key, "router.client_endpoint") == 0 ||
        strcmp(e->key, "router.node_endpoint") == 0)
        return true;
    return strncmp(e->key, "nodes[", 6) == 0 && tdm_config_address_is_loopback(e->value);
}

/* The HTTP API's port is not also a ZMQ endpoint bound on the same host and address (the
 * second bind would fail at start with "address in use"). */
static int check_http_port(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    endpoint_ref_t *eps = calloc(3 + 2 * cfg->n_nodes, sizeof *eps);
    if (!eps)
        return tdm_config_fail_memory(ld);
    size_t n = endpoints_list(ld, cfg, eps);
    const char *addr = cfg->router.http_address ? cfg->router.http_address : "127.0.0.1";
    const yaml_node_t *port_at = tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_ROUTER, "http_port");
    int rc = TDM_OK;
    for (size_t i = 0; i < n && rc == TDM_OK; i++) {
        if (!endpoint_on_router_host(&eps[i]) ||
            !endpoint_takes_http(eps[i].value, addr, (long)cfg->router.http_port))
            continue;
        if (port_at || !eps[i].at)
            rc = tdm_config_fail(ld, port_at ? port_at : eps[i].at, "router.http_port",
                                 "port %d on %s is also %s (%s)%s", (int)cfg->router.http_port,
                                 addr, eps[i].key, eps[i].value, eps[i].at ? "" : ", its default");
        else
            rc = tdm_config_fail(ld, eps[i].at, eps[i].key,
                                 "endpoint %s takes the HTTP API's port (router.http_port %d on "
                                 "%s, its default)",
                                 eps[i].value, (int)cfg->router.http_port, addr);
    }
    free(eps);
    return rc;
}

/* ---- CURVE ---- */

/* Without router.curve_public_key, neither the router's secret key file nor any node key. */
static int check_curve_off(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    char key[TDM_CONFIG_KEY_MAX];
    if (cfg->router.curve_secret_key_file)
        return tdm_config_fail(
            ld, tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_ROUTER, "curve_secret_key_file"),
            "router.curve_secret_key_file",
            "is set but router.curve_public_key is not; set both or neither");
    for (size_t i = 0; ld->node_marks && i < cfg->n_nodes; i++) {
        const tdm_node_config_t *n = &cfg->nodes[i];
        if (!n->curve_public_key && !n->curve_secret_key_file)
            continue;
        const char *name = n->curve_public_key ? "curve_public_key" : "curve_secret_key_file";
        snprintf(key, sizeof key, "nodes[%zu].%s", i, name);
        return tdm_config_fail(ld, node_mark(ld, i, name), key,
                               "CURVE is off because router.curve_public_key is not set; give "
                               "the router its pair too (tandem keys generate writes all of "
                               "them)");
    }
    return TDM_OK;
}

/* With router.curve_public_key: nodes[i] has a key pair, and a key no one else has. */
static int check_curve_node(tdm_config_loader_t *ld, const tdm_config_t *cfg, size_t i,
                            const yaml_node_t *router_key)
{
    char key[TDM_CONFIG_KEY_MAX];
    const tdm_node_config_t *n = &cfg->nodes[i];
    const yaml_node_t *at = ld->node_marks ? node_mark(ld, i, "id") : router_key;
    snprintf(key, sizeof key, "nodes[%zu].curve_public_key", i);
    if (!n->curve_public_key)
        return tdm_config_fail(ld, at, key,
                               "node '%s' has no CURVE public key, but CURVE is on "
                               "(router.curve_public_key is set): every node needs its own pair "
                               "(tandem keys generate writes them)",
                               n->id);
    at = ld->node_marks ? node_mark(ld, i, "curve_public_key") : at;
    if (!n->curve_secret_key_file) {
        snprintf(key, sizeof key, "nodes[%zu].curve_secret_key_file", i);
        return tdm_config_fail(ld, at, key,
                               "is required with nodes[%zu].curve_public_key: the file holding "
                               "node '%s''s secret key",
                               i, n->id);
    }
    if (strcmp(n->curve_public_key, cfg->router.curve_public_key) == 0)
        return tdm_config_fail(ld, at, key,
                               "node '%s' has the router's public key; every node needs its own "
                               "pair",
                               n->id);
    for (size_t j = 0; j < i; j++)
        if (strcmp(cfg->nodes[j].curve_public_key, n->curve_public_key) == 0)
            return tdm_config_fail(ld, at, key,
                                   "duplicate CURVE public key: node '%s' has the same key as "
                                   "nodes[%zu] ('%s'); every node needs its own pair",
                                   n->id, j, cfg->nodes[j].id);
    return TDM_OK;
}

/* CURVE is all or nothing: with router.curve_public_key set, the router and every node have a
 * public key and a secret key file, and no two public keys are the same (a shared key would
 * let one node pose as another); without it, no node has keys. The default nodes' errors are
 * reported at router.curve_public_key. */
static int check_curve(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    if (!cfg->router.curve_public_key)
        return check_curve_off(ld, cfg);
    const yaml_node_t *router_key =
        tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_ROUTER, "curve_public_key");
    if (!cfg->router.curve_secret_key_file)
        return tdm_config_fail(ld, router_key, "router.curve_secret_key_file",
                               "is required with router.curve_public_key: the file holding the "
                               "router's secret key");
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        int rc = check_curve_node(ld, cfg, i, router_key);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

/* router.node_endpoints: at most TDM_CONFIG_MAX_ROUTERS, not beside router.node_advertise
 * (which names the one router nodes connect to), none a node's own endpoint or KV endpoint or
 * the router's client endpoint (each item was checked as an endpoint, and against the others
 * for repeats, as it was read). */
static int check_router_endpoints(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    const tdm_router_config_t *r = &cfg->router;
    const yaml_node_t *at = tdm_config_mark(ld->marks, TDM_CONFIG_SECTION_ROUTER, "node_endpoints");
    if (r->n_node_endpoints == 0)
        return TDM_OK;
    if (r->n_node_endpoints > TDM_CONFIG_MAX_ROUTERS)
        return tdm_config_fail(ld, at, "router.node_endpoints", "lists %zu routers; at most %d",
                               r->n_node_endpoints, TDM_CONFIG_MAX_ROUTERS);
    if (r->node_advertise)
        return tdm_config_fail(ld, at, "router.node_endpoints",
                               "set router.node_endpoints (every router the nodes register with) "
                               "or router.node_advertise (the one router), not both");
    for (size_t i = 0; i < r->n_node_endpoints; i++) {
        const char *ep = r->node_endpoints[i];
        const char *clash = strcmp(ep, r->client_endpoint) == 0 ? "router.client_endpoint" : NULL;
        for (size_t j = 0; !clash && j < cfg->n_nodes; j++) {
            const tdm_node_config_t *node = &cfg->nodes[j];
            if ((node->endpoint && strcmp(ep, node->endpoint) == 0) ||
                (node->kv_endpoint && strcmp(ep, node->kv_endpoint) == 0) ||
                (node->kv_advertise && strcmp(ep, node->kv_advertise) == 0))
                clash = node->id;
        }
        if (clash) {
            char key[TDM_CONFIG_KEY_MAX];
            snprintf(key, sizeof key, "router.node_endpoints[%zu]", i);
            return tdm_config_fail(ld, at, key,
                                   "%s is also the endpoint of %s; a router node endpoint must be "
                                   "one of its own",
                                   ep, clash);
        }
    }
    return TDM_OK;
}

/* Where key name of model i was written: its models: entry, or the model: section. */
static const yaml_node_t *model_mark(const tdm_config_loader_t *ld, size_t i, const char *name)
{
    const yaml_node_t *const *marks =
        ld->model_marks ? ld->model_marks + i * ld->n_keys : (i == 0 ? ld->marks : NULL);
    return tdm_config_mark(marks, TDM_CONFIG_SECTION_MODEL, name);
}

/* Served name j of model m: its name (j 0) or alias j - 1. */
static const char *served_name(const tdm_model_config_t *m, size_t j)
{
    return j == 0 ? m->name : m->aliases[j - 1];
}

/* The key a served name was written under: "models[1].name", "model.aliases". */
static void served_key(const tdm_config_loader_t *ld, size_t i, size_t j, char *key, size_t cap)
{
    if (ld->model_marks)
        snprintf(key, cap, "models[%zu].%s", i, j == 0 ? "name" : "aliases");
    else
        snprintf(key, cap, "model.%s", j == 0 ? "name" : "aliases");
}

/* Every served name (each model's name and aliases) belongs to one model only, once: a request's
 * model field must pick one model. */
static int check_model_names(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    char key[TDM_CONFIG_KEY_MAX], other[TDM_CONFIG_KEY_MAX];
    for (size_t i = 0; i < cfg->n_models; i++) {
        const tdm_model_config_t *m = &cfg->models[i];
        for (size_t j = 0; j <= m->n_aliases; j++) {
            const char *name = served_name(m, j);
            if (!name[0]) {
                served_key(ld, i, j, key, sizeof key);
                return tdm_config_fail(ld, model_mark(ld, i, j ? "aliases" : "name"), key,
                                       "a served model name must not be empty");
            }
            for (size_t a = 0; a <= i; a++) {
                const tdm_model_config_t *o = &cfg->models[a];
                for (size_t b = 0; b <= o->n_aliases && (a < i || b < j); b++) {
                    if (strcmp(served_name(o, b), name) != 0)
                        continue;
                    served_key(ld, i, j, key, sizeof key);
                    served_key(ld, a, b, other, sizeof other);
                    const yaml_node_t *at = model_mark(ld, i, j ? "aliases" : "name");
                    if (!at) /* a name derived from the path */
                        at = model_mark(ld, i, "path");
                    return tdm_config_fail(
                        ld, at, key,
                        "duplicate served model name '%s': %s (path %s) and %s (path %s) both "
                        "serve it; each name and alias must name one model",
                        name, key, m->path, other, o->path);
                }
            }
        }
    }
    return TDM_OK;
}

/* Every node's model: names a listed model. */
static int check_node_models(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    char key[TDM_CONFIG_KEY_MAX], names[256];
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        const tdm_node_config_t *node = &cfg->nodes[i];
        if (!node->model || tdm_config_model_index(cfg, node->model) >= 0)
            continue;
        size_t len = 0;
        names[0] = '\0';
        for (size_t m = 0; m < cfg->n_models && len < sizeof names; m++)
            len += (size_t)snprintf(names + len, sizeof names - len, "%s'%s'", m ? ", " : "",
                                    cfg->models[m].name);
        snprintf(key, sizeof key, "nodes[%zu].model", i);
        return tdm_config_fail(ld, node_mark(ld, i, "model"), key,
                               "'%s' is not a served name of any model (models: %s)", node->model,
                               names);
    }
    return TDM_OK;
}

int tdm_config_check_cross(tdm_config_loader_t *ld, const tdm_config_t *cfg)
{
    int rc = check_model_names(ld, cfg);
    if (rc == TDM_OK)
        rc = check_node_models(ld, cfg);
    if (rc == TDM_OK)
        rc = check_router_endpoints(ld, cfg);
    if (rc == TDM_OK)
        rc = check_endpoints(ld, cfg);
    if (rc == TDM_OK)
        rc = check_http_port(ld, cfg);
    if (rc == TDM_OK)
        rc = check_curve(ld, cfg);
    return rc;
}

/* ---- binds ---- */

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
