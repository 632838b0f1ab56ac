/* router.c - the router object (router.h): model and tokenizer, sockets, the event loop and
 * timers, and the small client calls (HEALTH, MODELS, STATUS).
 *
 * The loop is single-threaded: zmq_poll over the client and node sockets, every waiting
 * message handled in arrival order, then the timers (heartbeat timeouts, deadlines) at most
 * every TIMER_PERIOD_S. GENERATE intake and the request table live in request.c, where
 * requests run in scheduler.c, their output in stream.c, the node protocol in nodes.c
 * (router_internal.h has the map).
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include <zmq.h>

#include "embed.h"
#include "metrics.h"
#include "lifecycle.h"
#include "nodes.h"
#include "request.h"
#include "router_internal.h"
#include "scheduler.h"
#include "stats.h"
#include "tandem/node_runtime.h"
#include "tandem/serve.h"

#define TIMER_PERIOD_S 0.01
#define MAX_MESSAGES_PER_POLL 256
/* Batches of MAX_MESSAGES_PER_POLL the timers drain from the node socket at most before the
 * liveness check (a bound, so a flood cannot hold the deadlines back for good). */
#define NODE_DRAIN_ROUNDS 16

/* ---- construction ---- */

/* Opens model m (cfg->models[m->index]): tokenizer, figures, chat template. */
static int load_model(tdm_router_t *r, rt_model_t *m, tdm_error_t *err)
{
    const tdm_config_t *cfg = r->cfg;
    /* the same loader as the nodes': context, vocabulary, fingerprint and layout agree */
    tdm_served_model_t sm;
    int rc = tdm_served_model_open_at(&sm, cfg, m->index, err);
    if (rc != TDM_OK)
        return rc;
    m->cfg = &cfg->models[m->index];
    m->model = sm.model; /* the router owns them from here (tdm_router_destroy) */
    m->tok = sm.tok;
    m->n_vocab = sm.n_vocab;
    m->n_ctx = sm.n_ctx;
    m->max_token_bytes = 1;
    for (uint32_t id = 0; id < m->n_vocab; id++) {
        char piece[8];
        int n = tdm_tokenizer_token_bytes(m->tok, (tdm_token_t)id, true, piece, sizeof piece);
        if (n > 0 && (uint32_t)n > m->max_token_bytes)
            m->max_token_bytes = (uint32_t)n;
    }
    m->fingerprint = sm.fingerprint;
    m->layout = sm.layout;
    const tdm_llama_hparams_t *hp = tdm_model_hparams(m->model);
    m->have_kv_groups = tdm_model_kv_groups(hp, &m->kv_groups);
    if (m->have_kv_groups) {
        m->n_layer_windows = hp->n_layers < TDM_KV_MAX_LAYERS ? hp->n_layers : TDM_KV_MAX_LAYERS;
        for (uint32_t l = 0; l < m->n_layer_windows; l++)
            m->layer_windows[l] = tdm_llama_layer_window(hp, l);
    }
    /* The template: the config's override, else the model's tokenizer.chat_template compiled
     * once here (tdm_chat_template_pick, the rule `tandem generate -m` and `tandem tokenize`
     * share). A model template that does not compile refuses the model; one without a template
     * Tandem can use only fails chat requests. */
    tdm_error_t terr = {0};
    rc = tdm_chat_template_pick(tdm_model_gguf(m->model), m->tok, m->cfg->chat_template, &m->chat,
                                &terr);
    if (rc == TDM_OK) {
        m->have_template = true;
    } else if (terr.field[0] || rc != TDM_EINVALID) {
        if (err)
            *err = terr;
        return rc;
    } else {
        snprintf(m->template_error, sizeof m->template_error, "%s", terr.msg);
        tdm_log_write(&r->log, TDM_LOG_WARN, NULL, NULL,
                      "model %s has no chat template: its chat requests will fail: %s",
                      m->cfg->name, terr.msg);
    }
    return TDM_OK;
}

/* Opens every model of the config (r->models). */
static int load_models(tdm_router_t *r, tdm_error_t *err)
{
    r->block_size = (uint32_t)r->cfg->kv.block_size;
    r->models = calloc(r->cfg->n_models, sizeof *r->models);
    if (!r->models)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    for (size_t i = 0; i < r->cfg->n_models; i++) {
        r->models[i].index = i;
        r->n_models = i + 1;
        int rc = load_model(r, &r->models[i], err);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

static void free_models(tdm_router_t *r)
{
    for (size_t i = 0; i < r->n_models; i++) {
        rt_model_t *m = &r->models[i];
        rt_template_cache_fini(&m->templates);
        if (m->have_template)
            tdm_chat_pick_release(&m->chat);
        tdm_tokenizer_destroy(&m->tok);
        tdm_model_destroy(&m->model);
    }
    free(r->models);
    r->models = NULL;
    r->n_models = 0;
}

rt_model_t *rt_model_find(tdm_router_t *r, const char *served)
{
    int i = tdm_config_model_index(r->cfg, served);
    return i < 0 ? NULL : &r->models[i];
}

/* The router's tables: nodes, scheduler, requests. */
static int make_tables(tdm_router_t *r, tdm_error_t *err)
{
    if (rt_nodes_init(r) != TDM_OK || rt_sched_init(r) != TDM_OK ||
        rt_req_table_init(r) != TDM_OK || rt_embed_init(r) != TDM_OK)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    return TDM_OK;
}

/* Refuses what the router must not do (bind the client or node endpoint where anyone may
 * reach it unprotected: tdm_config_bind_check) and reads the router's CURVE secret key into
 * secret ("" when CURVE is off). Runs before the model loads, so a bad key file fails at once.
 * Logs a warning when security.insecure is true. */
static int check_security(tdm_router_t *r, char secret[41], tdm_error_t *err)
{
    const tdm_config_t *cfg = r->cfg;
    secret[0] = '\0';
    int rc = tdm_config_bind_check(cfg, "router.client_endpoint", cfg->router.client_endpoint,
                                   TDM_BIND_GUARD_API_KEYS, err);
    if (rc == TDM_OK)
        rc = tdm_config_bind_check(cfg, "router.node_endpoint", cfg->router.node_endpoint,
                                   TDM_BIND_GUARD_CURVE, err);
    if (rc == TDM_OK && tdm_config_curve_on(cfg))
        rc = tdm_net_curve_secret_read(cfg->router.curve_secret_key_file,
                                       cfg->router.curve_public_key, "router.curve_secret_key_file",
                                       secret, err);
    if (rc == TDM_OK && cfg->security.insecure)
        TDM_LOG_WARNF(&r->log, NULL, "%s", TDM_CONFIG_INSECURE_WARNING);
    return rc;
}

/* Binds the client endpoint and the node endpoint, the latter over CURVE with the router's
 * pair (secret) admitting every node's key under its node id when CURVE is on. */
/* Several routers (router.node_endpoints): warns when no listed endpoint can be this router's,
 * i.e. none has the port of the node endpoint it binds (tcp://; the host may differ, a bind
 * being a wildcard or an address where the list has names) nor is it (ipc://): the nodes
 * would register with the others but not here. Only a warning: a port mapping (a container's
 * published port) may make another port reach this one. */
static void check_listed(tdm_router_t *r, const tdm_config_t *cfg)
{
    const tdm_router_config_t *rc = &cfg->router;
    if (rc->n_node_endpoints == 0)
        return;
    const char *bind = rc->node_endpoint;
    const char *port = strncmp(bind, "tcp://", 6) == 0 ? strrchr(bind, ':') : NULL;
    for (size_t i = 0; i < rc->n_node_endpoints; i++) {
        const char *ep = rc->node_endpoints[i];
        if (strcmp(ep, bind) == 0 ||
            (port && strncmp(ep, "tcp://", 6) == 0 && strcmp(strrchr(ep, ':'), port) == 0))
            return;
    }
    TDM_LOG_WARNF(&r->log, NULL,
                  "router.node_endpoints lists no endpoint on this router's node endpoint %s "
                  "(its port): the nodes register with the routers listed, perhaps not this one",
                  bind);
}

static int bind_sockets(tdm_router_t *r, const char *secret, tdm_error_t *err)
{
    const tdm_config_t *cfg = r->cfg;
    tdm_sock_opts_t copts = {0};
    copts.log = &r->log;
    r->client = tdm_sock_bind(r->net, cfg->router.client_endpoint, &copts, err);
    if (!r->client)
        return tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE,
                                "client endpoint %s: ", cfg->router.client_endpoint);
    tdm_curve_peer_t *peers = NULL;
    tdm_curve_keys_t keys = {0};
    if (tdm_config_curve_on(cfg)) {
        if (!(peers = calloc(cfg->n_nodes, sizeof *peers)))
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        for (size_t i = 0; i < cfg->n_nodes; i++)
            peers[i] = (tdm_curve_peer_t){cfg->nodes[i].curve_public_key, cfg->nodes[i].id};
        keys = (tdm_curve_keys_t){.server_public = cfg->router.curve_public_key,
                                  .server_secret = secret,
                                  .clients = peers,
                                  .n_clients = cfg->n_nodes};
    }
    tdm_sock_opts_t nopts = {0};
    nopts.log = &r->log;
    nopts.instance_id = r->instance_id; /* in every frame to nodes: they drop other routers' */
    nopts.no_handover = true;           /* a registered node's connection is never taken over */
    nopts.curve = peers ? &keys : NULL;
    nopts.watch_handshake = peers != NULL; /* failed CURVE handshakes, for Status */
    r->nodesock = tdm_sock_bind(r->net, cfg->router.node_endpoint, &nopts, err);
    free(peers);
    if (!r->nodesock)
        return tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE,
                                "node endpoint %s: ", cfg->router.node_endpoint);
    snprintf(r->client_ep, sizeof r->client_ep, "%s", tdm_sock_endpoint(r->client));
    snprintf(r->node_ep, sizeof r->node_ep, "%s", tdm_sock_endpoint(r->nodesock));
    check_listed(r, r->cfg);
    /* the in-process HTTP gateway's way in: the same socket, named by this instance */
    snprintf(r->inproc_ep, sizeof r->inproc_ep, "inproc://tandem-router-%016" PRIx64,
             r->instance_id);
    if (zmq_bind(tdm_sock_zsock(r->client), r->inproc_ep) != 0)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "client endpoint %s: %s", r->inproc_ep,
                             zmq_strerror(zmq_errno()));
    return TDM_OK;
}

tdm_router_t *tdm_router_new(const tdm_config_t *cfg, tdm_net_t *net, const tdm_logger_t *log,
                             tdm_error_t *err)
{
    tdm_router_t *r = calloc(1, sizeof *r);
    if (!r) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    r->cfg = cfg;
    r->net = net;
    if (log)
        r->log = *log;
    else
        tdm_log_init(&r->log, "router");
    r->hb_interval_ms = TDM_HEARTBEAT_INTERVAL_MS;
    r->hb_timeout_ms = TDM_HEARTBEAT_TIMEOUT_MS;
    /* Identities (docs/protocol.md): a random instance per start, so nodes tell this router
     * from the one before it, and attempt ids that start at a random point, so no attempt id
     * of an earlier router instance is ever reused. */
    uint64_t rnd[2] = {0, 0};
    if (getrandom(rnd, sizeof rnd, 0) != (ssize_t)sizeof rnd) {
        rnd[0] ^= (uint64_t)(tdm_time_now() * 1e9) * 0x9e3779b97f4a7c15ull;
        rnd[1] ^= (uint64_t)(uintptr_t)r * 0xbf58476d1ce4e5b9ull;
    }
    r->instance_id = rnd[0] ? rnd[0] : 1;
    r->next_attempt = rnd[1] ? rnd[1] : 1;
    char secret[41];
    int rc = check_security(r, secret, err);
    if (rc == TDM_OK && (load_models(r, err) != TDM_OK || make_tables(r, err) != TDM_OK ||
                         bind_sockets(r, secret, err) != TDM_OK))
        rc = TDM_EINVALID;
    tdm_net_curve_wipe(secret, sizeof secret);
    if (rc != TDM_OK) {
        r->shut = true; /* nothing to shut down: no request exists yet */
        tdm_router_destroy(&r);
        return NULL;
    }
    char kv[1024] = "";
    char num[32];
    tdm_log_kv_append(kv, sizeof kv, "client", r->client_ep);
    tdm_log_kv_append(kv, sizeof kv, "nodes", r->node_ep);
    char names[512] = "";
    for (size_t i = 0, len = 0; i < r->n_models && len < sizeof names; i++)
        len += (size_t)snprintf(names + len, sizeof names - len, "%s%s", i ? "," : "",
                                r->models[i].cfg->name);
    tdm_log_kv_append(kv, sizeof kv, r->n_models > 1 ? "models" : "model", names);
    snprintf(num, sizeof num, "%" PRIu32, r->models[0].n_ctx);
    tdm_log_kv_append(kv, sizeof kv, "n_ctx", num);
    tdm_log_kv_append(kv, sizeof kv, "prefill_policy",
                      tdm_config_prefill_policy_name(cfg->router.prefill_policy));
    tdm_log_kv_append(kv, sizeof kv, "curve", tdm_config_curve_on(cfg) ? "on" : "off");
    tdm_log_kv_append(kv, sizeof kv, "api_keys", cfg->router.n_api_keys ? "on" : "off");
    tdm_log_write(&r->log, TDM_LOG_INFO, NULL, kv, "router ready");
    return r;
}

void tdm_router_destroy(tdm_router_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_router_t *r = *self_p;
    tdm_router_shutdown(r);
    tdm_sock_destroy(&r->client);
    tdm_sock_destroy(&r->nodesock);
    rt_embed_fini(r);
    rt_req_table_fini(r);
    rt_sched_fini(r);
    rt_nodes_fini(r);
    free_models(r);
    free(r);
    *self_p = NULL;
}

void tdm_router_shutdown(tdm_router_t *r)
{
    if (!r || r->shut)
        return;
    r->shut = true;
    size_t n = r->n_reqs;
    rt_req_shutdown_all(r);
    rt_embed_shutdown(r);
    tdm_log_write(&r->log, TDM_LOG_INFO, NULL, NULL,
                  "router shutting down (%zu requests ended with UNAVAILABLE)", n);
}

/* ---- client calls ---- */

/* Whether a client call may go on: its key is accepted; or it is HEALTH, open like the HTTP
 * /health and /ready (liveness probes carry no key; it says nothing private without one); or
 * a STATUS or METRICS call that router.public_metrics leaves open. */
static bool api_key_ok(const tdm_router_t *r, const tdm_frame_t *f)
{
    if (f->method == TANDEM__V1__METHOD__METHOD_HEALTH)
        return true;
    if (r->cfg->router.public_metrics && (f->method == TANDEM__V1__METHOD__METHOD_STATUS ||
                                          f->method == TANDEM__V1__METHOD__METHOD_METRICS))
        return true;
    return tdm_config_api_key_ok(&r->cfg->router, f->api_key);
}

#define REFUSED_MAX 16 /* refusals one HEALTH or STATUS answer lists */

#define CURVE_REFUSED_ID "(unknown key)" /* the node id shown for CURVE handshakes refused */

/* Fills ref/refp (REFUSED_MAX entries) with the refused registrations: the CURVE handshakes
 * the node endpoint refused (a key that is no node's: it never reaches a registration, so it
 * has no node id; shown as CURVE_REFUSED_ID with the last one's reason, kept in curve_why),
 * then those of configured ids when with_nodes, then the unknown ids, most recent first.
 * Returns the count; the strings point into r and curve_why. */
static size_t refused_list(tdm_router_t *r, bool with_nodes, Tandem__V1__RefusedRegistration *ref,
                           Tandem__V1__RefusedRegistration **refp, char curve_why[TDM_ERRMSG_MAX])
{
    size_t n_ref = 0;
    double now = tdm_time_now();
    double curve_at;
    uint64_t curve_n =
        r->nodesock ? tdm_sock_curve_refusals(r->nodesock, curve_why, TDM_ERRMSG_MAX, &curve_at)
                    : 0;
    if (curve_n) {
        tandem__v1__refused_registration__init(&ref[n_ref]);
        ref[n_ref].node_id = (char *)CURVE_REFUSED_ID;
        ref[n_ref].reason = curve_why;
        ref[n_ref].age_s = now - curve_at;
        ref[n_ref].count = curve_n;
        refp[n_ref] = &ref[n_ref];
        n_ref++;
    }
    for (size_t i = 0; with_nodes && i < r->n_nodes && n_ref < REFUSED_MAX; i++) {
        const rt_node_t *n = &r->nodes[i];
        if (!n->refused_reason[0])
            continue;
        tandem__v1__refused_registration__init(&ref[n_ref]);
        ref[n_ref].node_id = n->cfg->id;
        ref[n_ref].reason = (char *)n->refused_reason;
        ref[n_ref].age_s = now - n->refused_at;
        ref[n_ref].count = n->refused_count;
        refp[n_ref] = &ref[n_ref];
        n_ref++;
    }
    for (size_t i = 0; i < r->n_refused && n_ref < REFUSED_MAX; i++) {
        tandem__v1__refused_registration__init(&ref[n_ref]);
        ref[n_ref].node_id = (char *)r->refused[i].node_id;
        ref[n_ref].reason = (char *)r->refused[i].reason;
        ref[n_ref].age_s = now - r->refused[i].at;
        ref[n_ref].count = r->refused[i].count;
        refp[n_ref] = &ref[n_ref];
        n_ref++;
    }
    return n_ref;
}

/* Nodes of role that take new work: up and not suspect. suspect (may be NULL) += the nodes
 * of role that are up but suspect. */
static size_t count_up(const tdm_router_t *r, tdm_node_role_t role, size_t *suspect)
{
    size_t n = 0;
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *nd = &r->nodes[i];
        if (!nd->up || nd->cfg->role != role)
            continue;
        if (nd->suspect && suspect)
            (*suspect)++;
        n += !nd->suspect;
    }
    return n;
}

/* HEALTH: live always; ready when a decode node takes new work (up and not suspect: a decode
 * node prefills locally when no prefill node does). The END message says what is up. */
static void client_health(tdm_router_t *r, const tdm_frame_t *f)
{
    size_t suspect = 0;
    size_t nd = count_up(r, TDM_NODE_ROLE_DECODE, &suspect);
    size_t np = count_up(r, TDM_NODE_ROLE_PREFILL, &suspect);
    Tandem__V1__HealthResponse h = TANDEM__V1__HEALTH_RESPONSE__INIT;
    h.live = true;
    h.ready = nd > 0;
    h.version = (char *)TANDEM_VERSION;
    char msg[256], extra[64] = "";
    if (suspect)
        snprintf(extra, sizeof extra, "; %zu suspect (silent, given no new work)", suspect);
    snprintf(msg, sizeof msg, "%s: %zu decode and %zu prefill nodes up%s%s",
             nd ? "ready" : "not ready", nd, np,
             nd ? (np ? "" : " (decode nodes prefill locally)")
                : " (at least one decode node must be up and not suspect)",
             extra);
    /* refusals tell an operator why a node is missing; only to a caller allowed Status */
    Tandem__V1__RefusedRegistration ref[REFUSED_MAX], *refp[REFUSED_MAX];
    bool may_see =
        r->cfg->router.public_metrics || tdm_config_api_key_ok(&r->cfg->router, f->api_key);
    char curve_why[TDM_ERRMSG_MAX];
    size_t n_ref = may_see ? refused_list(r, true, ref, refp, curve_why) : 0;
    h.n_refused = n_ref;
    h.refused = n_ref ? refp : NULL;
    tdm_send_t m = {0};
    m.peer = f->peer;
    m.peer_len = f->peer_len;
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
    m.method = f->method;
    m.call_id = f->call_id;
    m.message = msg;
    m.body = &h.base;
    tdm_sock_send(r->client, &m);
}

/* Decode (role decode) or prefill nodes of model m up. */
static uint32_t model_nodes_up(const tdm_router_t *r, const rt_model_t *m, tdm_node_role_t role)
{
    uint32_t n = 0;
    for (size_t i = 0; i < r->n_nodes; i++)
        n += r->nodes[i].up && r->nodes[i].model == m && r->nodes[i].cfg->role == role;
    return n;
}

/* Fills info with model m's figures (strings borrowed from the router). */
static void model_info_fill(const tdm_router_t *r, const rt_model_t *m, Tandem__V1__ModelInfo *info)
{
    tandem__v1__model_info__init(info);
    info->name = m->cfg->name ? m->cfg->name : (char *)"";
    info->n_aliases = m->cfg->n_aliases;
    info->aliases = m->cfg->aliases;
    info->fingerprint = m->fingerprint;
    info->n_ctx = m->n_ctx;
    info->n_vocab = m->n_vocab;
    info->chat_template = m->have_template ? (char *)(uintptr_t)m->chat.origin : (char *)"";
    /* the shape, for capacity planning with the nodes' sizing functions (tandem/kv.h) */
    const tdm_llama_hparams_t *hp = tdm_model_hparams(m->model);
    info->n_layers = m->layout.n_layers;
    info->n_kv_heads = m->layout.n_kv_heads;
    info->head_dim = m->layout.head_dim;
    info->n_heads = hp->n_heads;
    info->n_embd = hp->n_embd;
    info->weight_bytes = tdm_gguf_tensor_bytes(tdm_model_gguf(m->model));
    info->kv_block_size = m->layout.block_size;
    info->kv_dtype = (Tandem__V1__KvDtype)m->layout.dtype;
    info->prefill_nodes_up = model_nodes_up(r, m, TDM_NODE_ROLE_PREFILL);
    info->decode_nodes_up = model_nodes_up(r, m, TDM_NODE_ROLE_DECODE);
    info->state = info->decode_nodes_up ? (char *)"ready" : (char *)"unavailable";
    if (m->have_kv_groups) { /* (2.6) per layer */
        info->n_layer_windows = m->n_layer_windows;
        info->layer_windows = (uint32_t *)m->layer_windows;
    }
    for (tdm_list_t *e = tdm_list_first(&r->requests); e; e = tdm_list_next(&r->requests, e)) {
        const rt_req_t *q = TDM_LIST_ENTRY(e, rt_req_t, all_link);
        if (q->model != m)
            continue;
        if (q->state == RT_QUEUED && tdm_list_is_linked(&q->queue_link))
            info->requests_queued++;
        else
            info->requests_running++;
    }
    size_t er, eq; /* EMBED calls count as requests too (embed.h) */
    rt_embed_count(r, m, &er, &eq);
    info->requests_running += (uint32_t)er;
    info->requests_queued += (uint32_t)eq;
}

static void client_models(tdm_router_t *r, const tdm_frame_t *f)
{
    Tandem__V1__ModelInfo infos[TDM_CONFIG_MAX_MODELS], *list[TDM_CONFIG_MAX_MODELS];
    for (size_t i = 0; i < r->n_models; i++) {
        model_info_fill(r, &r->models[i], &infos[i]);
        list[i] = &infos[i];
    }
    Tandem__V1__ModelsResponse resp = TANDEM__V1__MODELS_RESPONSE__INIT;
    resp.n_models = r->n_models;
    resp.models = list;
    tdm_sock_reply(r->client, f, &resp.base);
}

/* Fills s with n's figures; dev (32 bytes) holds the device name and *load the load s points
 * to. */
static void node_status_fill(const tdm_router_t *r, const rt_node_t *n, double now,
                             Tandem__V1__NodeStatus *s, char dev[32], Tandem__V1__NodeLoad *load)
{
    tandem__v1__node_status__init(s);
    s->node_id = n->cfg->id;
    s->role = (char *)tdm_config_node_role_name(n->cfg->role);
    s->model = n->model->cfg->name;
    s->up = n->up;
    s->kv_blocks_total = n->kv_blocks_total;
    s->kv_layer_groups = !n->registered ? 0 : n->kv_grouped ? n->model->kv_groups.n_groups : 1;
    if (n->registered) {
        tdm_kv_layout_t bl = n->kv_grouped
                                 ? tdm_kv_group_layout(&n->model->layout, &n->model->kv_groups)
                                 : n->model->layout;
        s->kv_block_bytes = tdm_kv_block_bytes(&bl);
    }
    tdm_node_load_to_proto(&n->load, load);
    s->load = load;
    s->last_heartbeat_age_s = rt_node_age(n, now);
    if (n->device[0])
        snprintf(dev, 32, "%s", n->device);
    else
        tdm_config_device_format(n->cfg->device, dev, 32);
    s->device = dev;
    s->reserved_blocks = n->reserved_pending + n->reserved_acked;
    /* also on a node that is up: another instance tried to take its id */
    if (n->refused_reason[0]) {
        s->refused_reason = (char *)n->refused_reason;
        s->refused_age_s = now - n->refused_at;
    }
    s->instance_id = n->instance_id;
    s->suspect = n->up && n->suspect;
    s->host_id = (char *)n->place.host_id;
    s->gpu_uuid = (char *)n->place.gpu_uuid;
}

/* Every (prefill, decode) pair of nodes that are up, with the KV transport the router chooses
 * for it (transport.c), into routes[] and ptrs[] (room for n_nodes^2). Returns the count. */
static size_t kv_routes_fill(const tdm_router_t *r, Tandem__V1__KvRoute *routes,
                             Tandem__V1__KvRoute **ptrs)
{
    size_t n = 0;
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *p = &r->nodes[i];
        if (!p->up || p->cfg->role != TDM_NODE_ROLE_PREFILL)
            continue;
        for (size_t j = 0; j < r->n_nodes; j++) {
            const rt_node_t *d = &r->nodes[j];
            if (!d->up || d->cfg->role != TDM_NODE_ROLE_DECODE || d->model != p->model)
                continue; /* KV moves only between nodes of one model */
            tandem__v1__kv_route__init(&routes[n]);
            routes[n].prefill_node_id = p->cfg->id;
            routes[n].decode_node_id = d->cfg->id;
            routes[n].transport =
                (char *)tdm_kv_backend_name(rt_transport_choose(&p->place, &d->place));
            ptrs[n] = &routes[n];
            n++;
        }
    }
    return n;
}

static void client_status(tdm_router_t *r, const tdm_frame_t *f)
{
    size_t nn = r->n_nodes;
    Tandem__V1__NodeStatus *st = calloc(nn ? nn : 1, sizeof *st);
    Tandem__V1__NodeStatus **ptrs = calloc(nn ? nn : 1, sizeof *ptrs);
    char(*dev)[32] = calloc(nn ? nn : 1, sizeof *dev);
    Tandem__V1__NodeLoad *loads = calloc(nn ? nn : 1, sizeof *loads);
    Tandem__V1__KvRoute *routes = calloc(nn ? nn * nn : 1, sizeof *routes);
    Tandem__V1__KvRoute **route_ptrs = calloc(nn ? nn * nn : 1, sizeof *route_ptrs);
    if (!st || !ptrs || !dev || !loads || !routes || !route_ptrs) {
        tdm_sock_reply_error(r->client, f, TDM_ERESOURCE, "out of memory");
        goto out_free;
    }
    double now = tdm_time_now();
    for (size_t i = 0; i < nn; i++) {
        node_status_fill(r, &r->nodes[i], now, &st[i], dev[i], &loads[i]);
        ptrs[i] = &st[i];
    }
    Tandem__V1__RefusedRegistration ref[REFUSED_MAX], *refp[REFUSED_MAX];
    char curve_why[TDM_ERRMSG_MAX];
    size_t n_ref = refused_list(r, false, ref, refp, curve_why); /* ids in nodes[] are not */
    Tandem__V1__ClusterStatus cs = TANDEM__V1__CLUSTER_STATUS__INIT;
    cs.version = (char *)TANDEM_VERSION;
    cs.model = r->cfg->model.name ? r->cfg->model.name : (char *)"";
    cs.n_nodes = nn;
    cs.nodes = ptrs;
    size_t er, eq;
    rt_embed_count(r, NULL, &er, &eq);
    cs.requests_running = (uint32_t)(r->n_reqs - r->n_queued + er);
    cs.requests_queued = (uint32_t)(r->n_queued + eq);
    cs.requests_total = r->metrics.requests_total;
    cs.n_refused = n_ref;
    cs.refused = n_ref ? refp : NULL;
    cs.router_instance_id = r->instance_id;
    cs.n_kv_routes = kv_routes_fill(r, routes, route_ptrs);
    cs.kv_routes = route_ptrs;
    tdm_sock_reply(r->client, f, &cs.base);
out_free:
    free(route_ptrs);
    free(routes);
    free(loads);
    free(dev);
    free(ptrs);
    free(st);
}

static void client_message(tdm_router_t *r, const tdm_frame_t *f)
{
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL) {
        if (!rt_embed_cancel(r, f))
            rt_client_cancel(r, f);
        return;
    }
    if (f->kind != TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL,
                      "ignoring a %s frame from a client (call %" PRIu64 ")",
                      tdm_net_kind_name(f->kind), f->call_id);
        return;
    }
    if (!api_key_ok(r, f)) {
        if (f->method == TANDEM__V1__METHOD__METHOD_GENERATE) {
            r->metrics.requests_total++;
            rt_count_end(r, NULL, TDM_EUNAUTHENTICATED, -1);
        }
        tdm_log_write(&r->log, TDM_LOG_WARN, NULL, NULL, "%s refused: %s API key",
                      tdm_net_method_name(f->method), f->api_key[0] ? "unknown" : "no");
        tdm_sock_reply_error(r->client, f, TDM_EUNAUTHENTICATED,
                             f->api_key[0] ? "the API key is not accepted"
                                           : "an API key is required (FrameHeader.api_key; the "
                                             "tandem tool: --api-key or $TANDEM_API_KEY)");
        return;
    }
    switch (f->method) {
    case TANDEM__V1__METHOD__METHOD_GENERATE: rt_generate(r, f); break;
    case TANDEM__V1__METHOD__METHOD_HEALTH: client_health(r, f); break;
    case TANDEM__V1__METHOD__METHOD_MODELS: client_models(r, f); break;
    case TANDEM__V1__METHOD__METHOD_STATUS: client_status(r, f); break;
    case TANDEM__V1__METHOD__METHOD_METRICS: rt_client_metrics(r, f); break;
    case TANDEM__V1__METHOD__METHOD_EMBED: rt_embed(r, f); break;
    default:
        tdm_sock_reply_error(r->client, f, TDM_ENOTFOUND,
                             "method %s (%d) is not served on the client endpoint; use GENERATE, "
                             "EMBED, HEALTH, MODELS, STATUS or METRICS",
                             tdm_net_method_name(f->method), f->method);
    }
}

/* ---- the loop ---- */

/* Receives and handles up to MAX_MESSAGES_PER_POLL messages waiting on s; *n_handled: how
 * many (NULL: not wanted). */
static int drain(tdm_router_t *r, tdm_sock_t *s, bool is_client, int *n_handled)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    int rc = TDM_OK;
    int i = 0;
    for (; i < MAX_MESSAGES_PER_POLL && !r->shut; i++) {
        rc = tdm_sock_recv(s, &f, 0);
        if (rc == TDM_EDEADLINE) {
            rc = TDM_OK;
            break;
        }
        if (rc != TDM_OK)
            break;
        if (is_client)
            client_message(r, &f);
        else
            rt_node_message(r, &f);
    }
    tdm_frame_clear(&f);
    if (n_handled)
        *n_handled = i;
    return rc;
}

/* Handles every message waiting on the node socket (up to NODE_DRAIN_ROUNDS batches), so a
 * heartbeat that is there is seen before the liveness check. */
static void drain_nodes(tdm_router_t *r)
{
    for (int round = 0; round < NODE_DRAIN_ROUNDS && !r->shut; round++) {
        int n = 0;
        if (drain(r, r->nodesock, false, &n) != TDM_OK || n < MAX_MESSAGES_PER_POLL)
            return;
    }
}

static void run_timers(tdm_router_t *r)
{
    double now = tdm_time_now();
    if (now < r->next_timers)
        return;
    drain_nodes(r);
    if (r->shut)
        return;
    now = tdm_time_now();
    r->next_timers = now + TIMER_PERIOD_S;
    rt_check_heartbeats(r, now);
    rt_req_check_deadlines(r, tdm_net_now_ms());
    rt_embed_timers(r, tdm_net_now_ms());
}

/* Records how long the iteration that began at r->loop_t0 took (metrics). */
static void loop_done(tdm_router_t *r)
{
    double dt = tdm_time_now() - r->loop_t0;
    rt_hist_observe(&r->metrics.loop, dt);
    if (dt > r->metrics.loop_max_s)
        r->metrics.loop_max_s = dt;
}

/* Handles what one poll found (nodes first: token events free blocks and finish requests),
 * then the timers. Returns 0 or what a receive failed with. */
static int loop_step(tdm_router_t *r, const zmq_pollitem_t items[2])
{
    int rc = TDM_OK;
    if (items[1].revents & ZMQ_POLLIN)
        rc = drain(r, r->nodesock, false, NULL);
    if (rc == TDM_OK && (items[0].revents & ZMQ_POLLIN))
        rc = drain(r, r->client, true, NULL);
    if (!r->shut)
        run_timers(r);
    return rc;
}

int tdm_router_poll(tdm_router_t *r, int timeout_ms)
{
    if (r->shut)
        return TDM_EPRECONDITION;
    zmq_pollitem_t items[2] = {
        {tdm_sock_zsock(r->client), 0, ZMQ_POLLIN, 0},
        {tdm_sock_zsock(r->nodesock), 0, ZMQ_POLLIN, 0},
    };
    /* wake up for the timers even when nothing arrives */
    long wait = timeout_ms;
    long timer_ms = (long)(TIMER_PERIOD_S * 1000) * 5;
    if (wait < 0 || wait > timer_ms)
        wait = timer_ms;
    int n = zmq_poll(items, 2, wait);
    if (n < 0) {
        if (errno == EINTR || errno == ETERM)
            return TDM_ECANCELLED;
        return tdm_error_set(&r->err, TDM_EINTERNAL, "zmq_poll: %s", zmq_strerror(errno));
    }
    r->loop_t0 = tdm_time_now();
    int rc = loop_step(r, items);
    loop_done(r);
    if (r->shut)
        return TDM_OK;
    if (rc == TDM_ECANCELLED)
        return rc;
    if (rc != TDM_OK)
        return tdm_error_set(&r->err, rc, "receive: %s", tdm_strerror(rc));
    return TDM_OK;
}

int tdm_router_run(tdm_router_t *r, volatile sig_atomic_t *stop)
{
    int rc = TDM_OK;
    while (!*stop) {
        rc = tdm_router_poll(r, 100);
        if (rc == TDM_ECANCELLED) {
            rc = TDM_OK;
            continue; /* a signal: the loop condition decides */
        }
        if (rc != TDM_OK)
            break;
    }
    tdm_router_shutdown(r);
    return rc;
}

/* ---- accessors ---- */

const char *tdm_router_client_endpoint(const tdm_router_t *r)
{
    return r->client_ep;
}
const char *tdm_router_inproc_endpoint(const tdm_router_t *r)
{
    return r->inproc_ep;
}
void tdm_router_vocab(const tdm_router_t *r, const tdm_tokenizer_t **tok,
                      const tdm_chat_pick_t **pick, uint32_t *n_ctx)
{
    (void)tdm_router_model_vocab(r, 0, tok, pick, n_ctx);
}
bool tdm_router_model_vocab(const tdm_router_t *r, size_t index, const tdm_tokenizer_t **tok,
                            const tdm_chat_pick_t **pick, uint32_t *n_ctx)
{
    if (index >= r->n_models)
        return false;
    const rt_model_t *m = &r->models[index];
    *tok = m->tok;
    *pick = m->have_template ? &m->chat : NULL;
    *n_ctx = m->n_ctx;
    return true;
}
const char *tdm_router_node_endpoint(const tdm_router_t *r)
{
    return r->node_ep;
}

void tdm_router_set_heartbeat(tdm_router_t *r, uint32_t interval_ms, uint32_t timeout_ms)
{
    if (interval_ms)
        r->hb_interval_ms = interval_ms;
    if (timeout_ms)
        r->hb_timeout_ms = timeout_ms;
}

uint32_t tdm_router_n_ctx(const tdm_router_t *r)
{
    return r->models[0].n_ctx;
}
uint32_t tdm_router_n_vocab(const tdm_router_t *r)
{
    return r->models[0].n_vocab;
}
uint64_t tdm_router_fingerprint(const tdm_router_t *r)
{
    return r->models[0].fingerprint;
}

uint64_t tdm_router_instance(const tdm_router_t *r)
{
    return r->instance_id;
}
size_t tdm_router_n_running(const tdm_router_t *r)
{
    return r->n_reqs - r->n_queued;
}
size_t tdm_router_n_queued(const tdm_router_t *r)
{
    return r->n_queued;
}

bool tdm_router_node_up(const tdm_router_t *r, const char *id)
{
    for (size_t i = 0; i < r->n_nodes; i++)
        if (strcmp(r->nodes[i].cfg->id, id) == 0)
            return r->nodes[i].up;
    return false;
}

bool tdm_router_node_suspect(const tdm_router_t *r, const char *id)
{
    for (size_t i = 0; i < r->n_nodes; i++)
        if (strcmp(r->nodes[i].cfg->id, id) == 0)
            return r->nodes[i].up && r->nodes[i].suspect;
    return false;
}

void tdm_router_check_liveness(tdm_router_t *r, double now)
{
    rt_check_heartbeats(r, now);
}

const tdm_router_metrics_t *tdm_router_metrics(const tdm_router_t *r)
{
    return &r->metrics;
}
const char *tdm_router_errmsg(const tdm_router_t *r)
{
    return r->err.msg;
}
