/* util.c - small helpers the prefill and decode nodes share: picking the node from the
 * config, the host id, the registration message, reports to the router (task failures, token
 * events, NODE_STATUS answers). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>
#include <unistd.h>

#include "tandem/node.h"
#include "tandem/node_load.h"
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

uint64_t tdm_node_host_memory(void)
{
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t total = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    /* cgroup v2: "max" or a byte count; a container's limit is what the node may use */
    FILE *f = fopen("/sys/fs/cgroup/memory.max", "r");
    if (f) {
        char line[64];
        if (fgets(line, sizeof line, f)) {
            char *end = NULL;
            unsigned long long lim = strtoull(line, &end, 10);
            if (end != line && (*end == '\n' || *end == '\0') && lim > 0 &&
                (total == 0 || lim < total))
                total = (uint64_t)lim;
        }
        fclose(f);
    }
    return total;
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

uint64_t tdm_node_instance_new(void)
{
    uint64_t instance = 0;
    if (getrandom(&instance, sizeof instance, 0) != (ssize_t)sizeof instance)
        instance = (uint64_t)time(NULL) ^ (uint64_t)(uintptr_t)&instance;
    return instance ? instance : 1; /* 0 means "none" on the wire */
}

tdm_node_link_t *tdm_node_link_start(tdm_net_t *net, const tdm_config_t *cfg,
                                     const tdm_node_config_t *node, const tdm_node_runtime_t *rt,
                                     const char *kv_endpoint, const char *router_endpoint,
                                     uint64_t instance, const tdm_logger_t *log, tdm_error_t *err)
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
    reg.node_id = node->id;
    reg.role = node->role == TDM_NODE_ROLE_PREFILL ? TANDEM__V1__NODE_ROLE__NODE_ROLE_PREFILL
                                                   : TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE;
    reg.version = (char *)TANDEM_VERSION;
    reg.model_fingerprint = rt->fingerprint;
    reg.model = tdm_config_node_model(cfg, node)->name;
    uint32_t windows[TDM_KV_MAX_LAYERS];
    if (rt->kv_grouped) { /* (2.6) its pool's layer groups */
        for (uint32_t g = 0; g < rt->groups.n_groups; g++)
            windows[g] = rt->groups.window[g];
        layout.layers_per_group = rt->groups.layers_per_group;
        layout.n_group_windows = rt->groups.n_groups;
        layout.group_windows = windows;
    }
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
    tdm_node_link_opts_t lo = {router_endpoint, tdm_node_curve_router(&rt->keys, &keys), &reg, log,
                               &load};
    return tdm_node_link_new(net, &lo, err);
}

void tdm_node_report_failed(tdm_sock_t *s, const tdm_logger_t *log, const tdm_node_attempt_t *a,
                            int status, bool retryable, const char *msg)
{
    tdm_node_report_failed_ex(s, log, a, status, retryable, false, msg);
}

void tdm_node_report_failed_ex(tdm_sock_t *s, const tdm_logger_t *log, const tdm_node_attempt_t *a,
                               int status, bool retryable, bool request_fault, const char *msg)
{
    Tandem__V1__TaskFailed tf = TANDEM__V1__TASK_FAILED__INIT;
    tf.request_fault = request_fault;
    tf.request_id = (char *)(uintptr_t)a->label;
    tf.attempt_id = a->attempt_id;
    tf.status = tdm_proto_status_to_wire(status);
    tf.message = (char *)(uintptr_t)msg;
    tf.retryable = retryable;
    if (s)
        tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_TASK_FAILED, &tf.base);
    TDM_LOG_WARNF(log, a->label, "request failed attempt=%s status=%s retryable=%d: %s", a->key,
                  tdm_status_name(status), retryable, msg);
}

/* Sends te with ev's prompt logprobs (entries 1..n-1: entry 0 has no prefix); their messages
 * are allocated and freed here. Out of memory sends te without them (the token still goes:
 * the answer lacks only the prompt logprobs). Returns as tdm_sock_notify. */
static int send_token_plp(tdm_sock_t *s, Tandem__V1__TokenEvent *te, const tdm_worker_event_t *ev)
{
    size_t n = ev->n_prompt_logprobs - 1, n_top = 0;
    for (size_t i = 1; i <= n; i++)
        n_top += ev->prompt_logprobs[i].n_top;
    Tandem__V1__PromptLogprob *m = calloc(n, sizeof *m);
    Tandem__V1__PromptLogprob **mp = calloc(n, sizeof *mp);
    Tandem__V1__TopLogprob *tops = calloc(n_top ? n_top : 1, sizeof *tops);
    Tandem__V1__TopLogprob **topp = calloc(n_top ? n_top : 1, sizeof *topp);
    int rc;
    if (!m || !mp || !tops || !topp) {
        rc = tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, &te->base);
        goto out_free;
    }
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        const tdm_prompt_logprob_t *e = &ev->prompt_logprobs[i + 1];
        tandem__v1__prompt_logprob__init(&m[i]);
        m[i].token_id = e->token;
        m[i].logprob = e->logprob;
        m[i].rank = e->rank;
        m[i].n_top = e->n_top;
        m[i].top = topp + k;
        for (uint32_t j = 0; j < e->n_top; j++, k++) {
            tandem__v1__top_logprob__init(&tops[k]);
            tops[k].token_id = e->top[j].token;
            tops[k].logprob = e->top[j].logprob;
            topp[k] = &tops[k];
        }
        mp[i] = &m[i];
    }
    te->n_prompt_logprobs = n;
    te->prompt_logprobs = mp;
    rc = tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, &te->base);
out_free:
    free(m);
    free(mp);
    free(tops);
    free(topp);
    return rc;
}

int tdm_node_send_token(tdm_sock_t *s, const tdm_node_attempt_t *a, const tdm_worker_event_t *ev)
{
    if (!s)
        return TDM_EUNAVAILABLE;
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
    if (ev->n_prompt_logprobs <= 1)
        return tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, &te.base);
    return send_token_plp(s, &te, ev);
}

int tdm_node_reply_status(tdm_sock_t *s, const tdm_frame_t *f, const tdm_config_t *cfg,
                          const tdm_node_config_t *node, const tdm_node_runtime_t *rt,
                          tdm_node_link_t *link)
{
    tdm_node_load_t ld;
    tdm_node_load_collect(rt->worker, rt->pool, &ld);
    tdm_node_load_process(&ld);
    ld.stale_router_frames = link ? tdm_node_link_stale_frames(link) : 0;
    Tandem__V1__NodeLoad load;
    tdm_node_load_to_proto(&ld, &load);
    Tandem__V1__NodeStatus ns = TANDEM__V1__NODE_STATUS__INIT;
    char device[32];
    tdm_config_device_format(node->device, device, sizeof device);
    ns.node_id = node->id;
    ns.role = (char *)(uintptr_t)tdm_config_node_role_name(node->role);
    ns.up = true;
    ns.kv_blocks_total = ld.kv_blocks_free + ld.kv_blocks_used + ld.kv_blocks_cached;
    ns.kv_layer_groups = rt->kv_grouped ? rt->groups.n_groups : 1;
    ns.device = device;
    ns.load = &load;
    ns.model = tdm_config_node_model(cfg, node)->name; /* the name it registered with */
    return tdm_sock_reply(s, f, &ns.base);
}
