/* util.c - small helpers the prefill and decode nodes share: picking the node from the
 * config, CURVE keys, the registration message, task sampling parameters, token events. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "tandem/node.h"
#include "tandem/proto.h"

const tdm_node_config_t *tdm_node_pick(const tdm_config_t *cfg, const char *node_id,
                                       tdm_node_role_t role, tdm_error_t *err)
{
    const tdm_node_config_t *n = NULL;
    if (node_id) {
        n = tdm_config_find_node(cfg, node_id);
    } else {
        for (size_t i = 0; i < cfg->n_nodes && !n; i++)
            if (cfg->nodes[i].role == role)
                n = &cfg->nodes[i];
    }
    if (!n) {
        char ids[512] = "";
        size_t len = 0;
        for (size_t i = 0; i < cfg->n_nodes; i++)
            if (cfg->nodes[i].role == role && len + strlen(cfg->nodes[i].id) + 3 < sizeof ids)
                len += (size_t)snprintf(ids + len, sizeof ids - len, "%s%s", len ? ", " : "",
                                        cfg->nodes[i].id);
        tdm_error_set(err, TDM_ENOTFOUND, "no %s node %s%s%s in the config (its %s nodes: %s)",
                      tdm_config_node_role_name(role), node_id ? "'" : "", node_id ? node_id : "",
                      node_id ? "'" : "", tdm_config_node_role_name(role), len ? ids : "none");
        return NULL;
    }
    if (n->role != role) {
        tdm_error_set(err, TDM_EINVALID, "node '%s' is a %s node in the config, not a %s node",
                      n->id, tdm_config_node_role_name(n->role), tdm_config_node_role_name(role));
        return NULL;
    }
    return n;
}

int tdm_node_keys_open(tdm_node_keys_t *k, const tdm_config_t *cfg, const tdm_node_config_t *node,
                       tdm_error_t *err)
{
    memset(k, 0, sizeof *k);
    size_t index = (size_t)(node - cfg->nodes);
    char key[96];
    if (node->role == TDM_NODE_ROLE_DECODE) {
        snprintf(key, sizeof key, "nodes[%zu].kv_endpoint", index);
        int rc = tdm_config_bind_check(cfg, key, node->kv_endpoint, TDM_BIND_GUARD_CURVE, err);
        if (rc != TDM_OK)
            return rc;
    }
    if (!tdm_config_curve_on(cfg))
        return TDM_OK;
    /* the loader guarantees both keys of every node once CURVE is on */
    snprintf(key, sizeof key, "nodes[%zu].curve_secret_key_file", index);
    int rc = tdm_net_curve_secret_read(node->curve_secret_key_file, node->curve_public_key, key,
                                       k->secret_key, err);
    if (rc != TDM_OK)
        return rc;
    snprintf(k->public_key, sizeof k->public_key, "%s", node->curve_public_key);
    snprintf(k->router_key, sizeof k->router_key, "%s", cfg->router.curve_public_key);
    if (node->role == TDM_NODE_ROLE_DECODE) {
        k->peers = calloc(cfg->n_nodes, sizeof *k->peers);
        if (!k->peers) {
            tdm_node_keys_close(k);
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        }
        for (size_t i = 0; i < cfg->n_nodes; i++)
            if (cfg->nodes[i].role == TDM_NODE_ROLE_PREFILL)
                k->peers[k->n_peers++] =
                    (tdm_curve_peer_t){cfg->nodes[i].curve_public_key, cfg->nodes[i].id};
    }
    k->role = node->role;
    k->on = true;
    return TDM_OK;
}

void tdm_node_keys_close(tdm_node_keys_t *k)
{
    if (!k)
        return;
    free(k->peers);
    tdm_net_curve_wipe(k->secret_key, sizeof k->secret_key);
    memset(k, 0, sizeof *k);
}

const tdm_curve_keys_t *tdm_node_curve_router(const tdm_node_keys_t *k, tdm_curve_keys_t *out)
{
    if (!k->on)
        return NULL;
    *out = (tdm_curve_keys_t){.server_public = k->router_key,
                              .client_public = k->public_key,
                              .client_secret = k->secret_key};
    return out;
}

const tdm_curve_keys_t *tdm_node_curve_kv(const tdm_node_keys_t *k, tdm_curve_keys_t *out)
{
    if (!k->on)
        return NULL;
    if (k->role == TDM_NODE_ROLE_DECODE) /* the KV receiver's server side */
        *out = (tdm_curve_keys_t){.server_public = k->public_key,
                                  .server_secret = k->secret_key,
                                  .clients = k->peers,
                                  .n_clients = k->n_peers};
    else
        *out = (tdm_curve_keys_t){.client_public = k->public_key, .client_secret = k->secret_key};
    return out;
}

void tdm_node_host_id(char *buf, size_t cap)
{
    if (cap == 0)
        return;
    buf[0] = '\0';
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f)
        return;
    if (!fgets(buf, (int)(cap < 4096 ? cap : 4096), f))
        buf[0] = '\0';
    fclose(f);
    buf[strcspn(buf, "\r\n")] = '\0';
}

/* The registration's device fields: host id, the GPUs the node sees and its own, and the
 * transports it can use (a device pool adds nccl and cuda_ipc). The strings stay rt's and
 * the caller's (host, uuids[TDM_NODE_MAX_GPUS], transports[3]). */
static void reg_devices(Tandem__V1__RegisterRequest *reg, const tdm_node_runtime_t *rt, char *host,
                        size_t host_cap, char **uuids, char **transports)
{
    tdm_node_host_id(host, host_cap);
    reg->host_id = host;
    transports[0] = (char *)"tcp";
    reg->n_transports = 1;
    if (rt->kv_device_base) {
        transports[reg->n_transports++] = (char *)"nccl";
        transports[reg->n_transports++] = (char *)"cuda_ipc";
    }
    reg->transports = transports;
    for (uint32_t i = 0; i < rt->n_gpu_uuids; i++)
        uuids[i] = (char *)(uintptr_t)rt->gpu_uuids[i];
    reg->n_gpu_uuids = rt->n_gpu_uuids;
    reg->gpu_uuids = uuids;
    reg->gpu_uuid = (char *)(uintptr_t)rt->gpu_uuid;
}

tdm_node_link_t *tdm_node_link_start(tdm_net_t *net, const tdm_config_t *cfg,
                                     const tdm_node_config_t *node, const tdm_node_runtime_t *rt,
                                     const char *kv_endpoint, const tdm_logger_t *log,
                                     tdm_error_t *err)
{
    Tandem__V1__RegisterRequest reg = TANDEM__V1__REGISTER_REQUEST__INIT;
    Tandem__V1__KvLayout layout;
    tdm_proto_layout_to(&rt->layout, &layout);
    char *transports[3], *uuids[TDM_NODE_MAX_GPUS], host[64];
    reg_devices(&reg, rt, host, sizeof host, uuids, transports);
    char device[32];
    tdm_config_device_format(node->device, device, sizeof device);
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(rt->pool, &ks);
    uint64_t instance = 0;
    if (getrandom(&instance, sizeof instance, 0) != (ssize_t)sizeof instance)
        instance = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)rt;
    if (instance == 0) /* 0 means "none" on the wire */
        instance = 1;
    reg.node_id = node->id;
    reg.role = node->role == TDM_NODE_ROLE_PREFILL ? TANDEM__V1__NODE_ROLE__NODE_ROLE_PREFILL
                                                   : TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE;
    reg.version = (char *)TANDEM_VERSION;
    reg.model_fingerprint = rt->fingerprint;
    reg.kv_layout = &layout;
    reg.kv_blocks_total = ks.n_blocks;
    reg.kv_endpoint = (char *)(uintptr_t)(kv_endpoint ? kv_endpoint : "");
    reg.device = device;
    reg.max_running = (uint32_t)node->max_running;
    reg.max_batch_tokens = (uint32_t)node->max_batch_tokens;
    reg.n_ctx = rt->n_ctx;
    reg.instance_id = instance;
    tdm_curve_keys_t keys;
    tdm_node_load_t load;
    tdm_node_load_collect(rt->worker, rt->pool, &load);
    if (cfg->security.insecure)
        TDM_LOG_WARNF(log, NULL, "%s", TDM_CONFIG_INSECURE_WARNING);
    tdm_node_link_opts_t lo = {tdm_config_router_advertise(cfg),
                               tdm_node_curve_router(&rt->keys, &keys), &reg, log, &load};
    return tdm_node_link_new(net, &lo, err);
}

int tdm_node_sampling(const Tandem__V1__SamplingParams *m, int32_t max_tokens, uint32_t n_vocab,
                      tdm_sampling_params_t *out, tdm_error_t *err)
{
    tdm_sampling_params_default(out);
    if (m && tdm_proto_sampling_from(m, out, err) != TDM_OK)
        return TDM_EINVALID;
    if (max_tokens < 1)
        return tdm_error_set(err, TDM_EINVALID, "max_tokens must be >= 1, got %d", max_tokens);
    out->max_tokens = max_tokens;
    return tdm_sampling_params_validate(out, n_vocab, err);
}

int tdm_node_constraint(tdm_grammar_cache_t *cache, const Tandem__V1__Constraint *c,
                        const tdm_grammar_t **g, tdm_error_t *err)
{
    *g = NULL;
    if (!c || c->kind == TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_NONE)
        return TDM_OK;
    if (c->kind != TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_GRAMMAR)
        return tdm_error_set(err, TDM_EINVALID,
                             "constraint: kind %d; the router sends nodes GRAMMAR only", c->kind);
    size_t len = c->text ? strlen(c->text) : 0;
    if (len == 0 || len > TDM_GRAMMAR_MAX_TEXT_BYTES)
        return tdm_error_set(err, TDM_EINVALID, "constraint: the grammar has %zu bytes; 1..%u", len,
                             TDM_GRAMMAR_MAX_TEXT_BYTES);
    int rc = tdm_grammar_cache_get(cache, c->text, len, c->hash, g, err);
    if (rc != TDM_OK && err && strncmp(err->msg, "constraint", 10) != 0)
        tdm_error_prefix(err, rc, "constraint: ");
    return rc;
}

int tdm_node_attempt_init(tdm_node_attempt_t *a, const char *request_id, uint64_t attempt_id,
                          uint64_t router_instance, tdm_error_t *err)
{
    memset(a, 0, sizeof *a);
    size_t len = request_id ? strlen(request_id) : 0;
    if (len == 0 || len >= sizeof a->label)
        return tdm_error_set(err, TDM_EINVALID, "request_id: missing or longer than %zu bytes",
                             sizeof a->label - 1);
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)request_id[i] < 0x20 || (unsigned char)request_id[i] > 0x7e)
            return tdm_error_set(err, TDM_EINVALID,
                                 "request_id: byte %zu is 0x%02x; printable ASCII only", i,
                                 (unsigned char)request_id[i]);
    if (attempt_id == 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "attempt_id is 0 (the router must be protocol 1.1 or newer)");
    memcpy(a->label, request_id, len + 1);
    a->attempt_id = attempt_id;
    a->router_instance = router_instance;
    snprintf(a->key, sizeof a->key, "%016" PRIx64, attempt_id);
    return TDM_OK;
}

void tdm_node_report_failed(tdm_sock_t *s, const tdm_logger_t *log, const tdm_node_attempt_t *a,
                            int status, bool retryable, const char *msg)
{
    Tandem__V1__TaskFailed tf = TANDEM__V1__TASK_FAILED__INIT;
    tf.request_id = (char *)(uintptr_t)a->label;
    tf.attempt_id = a->attempt_id;
    tf.status = tdm_proto_status_to_wire(status);
    tf.message = (char *)(uintptr_t)msg;
    tf.retryable = retryable;
    tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_TASK_FAILED, &tf.base);
    TDM_LOG_WARNF(log, a->label, "request failed attempt=%s status=%s retryable=%d: %s", a->key,
                  tdm_status_name(status), retryable, msg);
}

int tdm_node_send_token(tdm_sock_t *s, const tdm_node_attempt_t *a, const tdm_worker_event_t *ev)
{
    Tandem__V1__TokenEvent te = TANDEM__V1__TOKEN_EVENT__INIT;
    Tandem__V1__TopLogprob tops[TDM_SAMPLING_MAX_LOGPROBS];
    Tandem__V1__TopLogprob *topp[TDM_SAMPLING_MAX_LOGPROBS];
    te.request_id = (char *)(uintptr_t)a->label;
    te.attempt_id = a->attempt_id;
    te.index = ev->index;
    te.token_id = ev->sample.token;
    te.logprob = ev->sample.logprob;
    uint32_t n_top = ev->sample.n_top <= TDM_SAMPLING_MAX_LOGPROBS ? ev->sample.n_top : 0;
    for (uint32_t i = 0; i < n_top; i++) {
        tandem__v1__top_logprob__init(&tops[i]);
        tops[i].token_id = ev->sample.top[i].token;
        tops[i].logprob = ev->sample.top[i].logprob;
        topp[i] = &tops[i];
    }
    te.n_top = n_top;
    te.top = n_top ? topp : NULL;
    if (ev->index == 0) {
        te.cached_prompt_tokens = ev->cached_prompt_tokens;
        te.prefill_s = ev->prefill_s;
    }
    return tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, &te.base);
}

int tdm_node_reply_status(tdm_sock_t *s, const tdm_frame_t *f, const tdm_node_config_t *node,
                          const tdm_node_runtime_t *rt, tdm_node_link_t *link)
{
    (void)link;
    tdm_node_load_t ld;
    tdm_node_load_collect(rt->worker, rt->pool, &ld);
    Tandem__V1__NodeStatus ns = TANDEM__V1__NODE_STATUS__INIT;
    char device[32];
    tdm_config_device_format(node->device, device, sizeof device);
    ns.node_id = node->id;
    ns.role = (char *)(uintptr_t)tdm_config_node_role_name(node->role);
    ns.up = true;
    ns.kv_blocks_total = ld.kv_blocks_free + ld.kv_blocks_used + ld.kv_blocks_cached;
    ns.kv_blocks_used = ld.kv_blocks_used;
    ns.kv_blocks_cached = ld.kv_blocks_cached;
    ns.running = ld.running;
    ns.waiting = ld.waiting;
    ns.queued_prefill_tokens = ld.queued_prefill_tokens;
    ns.prefix_queries = ld.prefix_queries;
    ns.prefix_hits = ld.prefix_hits;
    ns.step_time_s = ld.step_s;
    ns.device = device;
    ns.batch_size = ld.batch_size;
    return tdm_sock_reply(s, f, &ns.base);
}
