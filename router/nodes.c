/* nodes.c - the router's side of the node protocol (nodes.h): registration, heartbeats and
 * liveness, node failure, and the routing of node messages to the scheduler (reservation
 * answers, TaskFailed) and the stream (TokenEvent, Finished).
 *
 * A node is its registered connection: the routing id bound at registration (unique per
 * instance), never a name a message claims. A live node's id is never taken over by another
 * instance; a restarted node waits until the router has seen its old instance go.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admit.h"
#include "embed.h"
#include "metrics.h"
#include "nodes.h"
#include "scheduler.h"
#include "stream.h"
#include "validate.h"
#include "tandem/node_runtime.h"

int rt_nodes_init(tdm_router_t *r)
{
    r->n_nodes = r->cfg->n_nodes;
    r->nodes = calloc(r->n_nodes ? r->n_nodes : 1, sizeof *r->nodes);
    if (!r->nodes)
        return TDM_ERESOURCE;
    for (size_t i = 0; i < r->n_nodes; i++) {
        r->nodes[i].cfg = &r->cfg->nodes[i];
        r->nodes[i].index = i;
        r->nodes[i].model = &r->models[tdm_config_node_model_index(r->cfg, &r->cfg->nodes[i])];
    }
    r->live_checked = r->live_clock = tdm_time_now();
    return TDM_OK;
}

void rt_nodes_fini(tdm_router_t *r)
{
    for (size_t i = 0; r->nodes && i < r->n_nodes; i++) {
        free(r->nodes[i].kv_endpoint);
        free(r->nodes[i].pending);
    }
    free(r->nodes);
    r->nodes = NULL;
}

/* ---- lookup and small helpers ---- */

rt_node_t *rt_node_find(tdm_router_t *r, const char *id, size_t len)
{
    for (size_t i = 0; i < r->n_nodes; i++) {
        const char *nid = r->nodes[i].cfg->id;
        if (strlen(nid) == len && memcmp(nid, id, len) == 0)
            return &r->nodes[i];
    }
    return NULL;
}

rt_node_t *rt_node_by_peer(tdm_router_t *r, const uint8_t *peer, size_t len)
{
    if (len == 0)
        return NULL;
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        if (n->registered && n->peer_len == len && memcmp(n->peer, peer, len) == 0)
            return n;
    }
    return NULL;
}

void rt_refused_decode_note(const tdm_router_t *r, char *buf, size_t cap)
{
    size_t o = 0;
    buf[0] = '\0';
    for (size_t i = 0; i < r->n_nodes && o + 1 < cap; i++) {
        const rt_node_t *n = &r->nodes[i];
        if (n->cfg->role != TDM_NODE_ROLE_DECODE || n->up || !n->refused_reason[0])
            continue;
        int w = snprintf(buf + o, cap - o, "%sdecode node '%s' was refused: %s", o ? "; " : "",
                         n->cfg->id, n->refused_reason);
        if (w < 0)
            break;
        o += (size_t)w < cap - o ? (size_t)w : cap - o - 1;
    }
}

double rt_node_age(const rt_node_t *n, double now)
{
    return n->registered ? now - n->last_seen : -1.0;
}

bool rt_node_dispatchable(const rt_node_t *n)
{
    return n->up && !n->suspect;
}

void rt_node_notify(tdm_router_t *r, rt_node_t *n, int method, const ProtobufCMessage *body)
{
    int rc = tdm_sock_notify(r->nodesock, n->peer, n->peer_len, method, body);
    if (rc != TDM_OK)
        tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL, "notify %s to node %s failed: %s",
                      tdm_net_method_name(method), n->cfg->id, tdm_strerror(rc));
}

/* ---- failures ---- */

/* Zeroes the gauges of a load (KV blocks, sequences, queued tokens); its counters and step
 * times stay, as the node's last word. */
static void load_gauges_zero(tdm_node_load_t *l)
{
    l->kv_blocks_free = l->kv_blocks_used = l->kv_blocks_cached = 0;
    l->running = l->waiting = l->batch_size = 0;
    l->queued_prefill_tokens = 0;
}

static void node_failed(tdm_router_t *r, rt_node_t *n, const char *reason)
{
    n->up = false;
    n->suspect = false;
    snprintf(n->down_reason, sizeof n->down_reason, "%s", reason);
    r->metrics.node_failures++;
    n->failures++;
    char kv[256] = "";
    tdm_log_kv_append(kv, sizeof kv, "node_id", n->cfg->id);
    tdm_log_kv_append(kv, sizeof kv, "role", tdm_config_node_role_name(n->cfg->role));
    tdm_log_kv_append(kv, sizeof kv, "reason", reason);
    tdm_log_write(&r->log, TDM_LOG_WARN, NULL, kv, "node down");
    /* A down node holds nothing: its last heartbeat's load figures no longer mean anything
     * (its process is gone or stopping), so Status and /metrics must not show them. */
    load_gauges_zero(&n->load);
    rt_sched_node_down(r, n, reason);
    rt_embed_node_down(r, n);
    n->embed_tokens = 0;
    n->embed_inputs = 0;
}

/* ---- liveness ----
 * Silence is measured on the liveness clock, not the wall clock: each check advances it by
 * the time since the previous check, but by at most live_step_max. When the router loop was
 * late (starved of CPU, one long iteration), the nodes' heartbeats of that time are still in
 * the sockets (or the kernel's buffers, the ZMQ I/O thread being starved too), so charging
 * the whole gap would declare every node down at once. A loop that is slow for good still
 * advances the clock by a step per check, so a dead node is found, only later. */

/* The largest step of the liveness clock per check, seconds: a heartbeat interval (a longer
 * gap could have hidden a heartbeat), at least 100 ms (the loop wakes every 50 ms anyway). */
static double live_step_max(const tdm_router_t *r)
{
    double s = r->hb_interval_ms / 1000.0;
    return s > 0.1 ? s : 0.1;
}

double rt_live_now(const tdm_router_t *r, double now)
{
    double gap = now - r->live_checked;
    double max = live_step_max(r);
    return r->live_clock + (gap <= 0 ? 0 : gap < max ? gap : max);
}

/* Advances the liveness clock to now, counting a stall when the gap was longer than a step.
 * Returns the clock's new value. */
static double live_advance(tdm_router_t *r, double now)
{
    double gap = now - r->live_checked;
    if (gap <= 0)
        return r->live_clock;
    double max = live_step_max(r);
    if (gap > max) {
        r->metrics.loop_stalls++;
        r->metrics.loop_stall_s += gap - max;
        char kv[96];
        snprintf(kv, sizeof kv, "gap_ms=%.0f charged_ms=%.0f", gap * 1000.0, max * 1000.0);
        tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, kv,
                      "router loop was late: the stall is not counted against the nodes");
    }
    r->live_clock = rt_live_now(r, now);
    r->live_checked = now;
    return r->live_clock;
}

/* Records a message from n: it is alive. Returns true when it was suspect (it is healthy
 * again, so queued work may go to it). */
static bool node_seen(tdm_router_t *r, rt_node_t *n)
{
    n->last_seen = tdm_time_now();
    n->seen_live = rt_live_now(r, n->last_seen);
    if (!n->suspect)
        return false;
    n->suspect = false;
    char kv[128] = "";
    tdm_log_kv_append(kv, sizeof kv, "node_id", n->cfg->id);
    tdm_log_write(&r->log, TDM_LOG_INFO, NULL, kv, "node healthy again");
    return true;
}

static void node_suspect(tdm_router_t *r, rt_node_t *n, double silent_s)
{
    n->suspect = true;
    n->suspicions++;
    char kv[256] = "";
    char ms[32];
    snprintf(ms, sizeof ms, "%.0f", silent_s * 1000.0);
    tdm_log_kv_append(kv, sizeof kv, "node_id", n->cfg->id);
    tdm_log_kv_append(kv, sizeof kv, "role", tdm_config_node_role_name(n->cfg->role));
    tdm_log_kv_append(kv, sizeof kv, "silent_ms", ms);
    tdm_log_write(&r->log, TDM_LOG_WARN, NULL, kv,
                  "node suspect: no new work until it is heard from again");
}

void rt_check_heartbeats(tdm_router_t *r, double now)
{
    double live = live_advance(r, now);
    double suspect_s = r->hb_timeout_ms / 1000.0;
    double down_s = suspect_s * TDM_ROUTER_DOWN_TIMEOUTS;
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        double silent = live - n->seen_live;
        if (!n->up || silent <= suspect_s)
            continue;
        if (silent > down_s) {
            char reason[96];
            snprintf(reason, sizeof reason, "no heartbeat for %.0f ms", silent * 1000.0);
            node_failed(r, n, reason);
        } else if (!n->suspect) {
            node_suspect(r, n, silent);
        }
    }
}

/* ---- registration ---- */

/* Longest kv_endpoint a registration may give, bytes. */
#define RT_KV_ENDPOINT_MAX 255

/* id as it may be shown (a log line, Status): its first cap - 1 bytes, each one that is not
 * printable ASCII as '?' (a refused id may be anything a peer sent). */
static void shown_id(const char *id, char *shown, size_t cap)
{
    size_t k = 0;
    for (const char *c = id; *c && k < cap - 1; c++)
        shown[k++] = (*c > 0x20 && *c < 0x7f) ? *c : '?';
    shown[k] = '\0';
}

/* Keeps a refusal for Status and /ready: on the node when the id is configured (printable
 * ids only), else in the router's short list of unknown ids. Returns true when it repeats the
 * last refusal kept for that id (not worth another log line). */
static bool remember_refusal(tdm_router_t *r, const char *id, const char *msg)
{
    double now = tdm_time_now();
    r->metrics.registrations_refused++;
    rt_node_t *n = rt_node_find(r, id, strlen(id));
    if (n) {
        bool same = strcmp(n->refused_reason, msg) == 0;
        snprintf(n->refused_reason, sizeof n->refused_reason, "%s", msg);
        n->refused_at = now;
        n->refused_count++;
        return same;
    }
    char shown[TDM_NODE_ID_MAX + 1];
    shown_id(id, shown, sizeof shown);
    for (size_t i = 0; i < r->n_refused; i++)
        if (strcmp(r->refused[i].node_id, shown) == 0) {
            bool same = strcmp(r->refused[i].reason, msg) == 0;
            uint64_t count = r->refused[i].count + 1;
            memmove(&r->refused[1], &r->refused[0], i * sizeof r->refused[0]);
            snprintf(r->refused[0].node_id, sizeof r->refused[0].node_id, "%s", shown);
            snprintf(r->refused[0].reason, sizeof r->refused[0].reason, "%s", msg);
            r->refused[0].at = now;
            r->refused[0].count = count;
            return same;
        }
    size_t keep = r->n_refused < 8 ? r->n_refused : 7;
    memmove(&r->refused[1], &r->refused[0], keep * sizeof r->refused[0]);
    snprintf(r->refused[0].node_id, sizeof r->refused[0].node_id, "%s", shown);
    snprintf(r->refused[0].reason, sizeof r->refused[0].reason, "%s", msg);
    r->refused[0].at = now;
    r->refused[0].count = 1;
    r->n_refused = keep + 1;
    return false;
}

/* Refuses a registration with status (FAILED_PRECONDITION: the node stops; UNAVAILABLE: it
 * retries, e.g. while another instance of its id is up). */
static void refuse_status(tdm_router_t *r, const tdm_frame_t *f, const char *id, int status,
                          const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void refuse_status(tdm_router_t *r, const tdm_frame_t *f, const char *id, int status,
                          const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    bool again = remember_refusal(r, id, msg);
    char kv[128] = "", shown[TDM_NODE_ID_MAX + 1];
    shown_id(id, shown, sizeof shown);
    tdm_log_kv_append(kv, sizeof kv, "node_id", shown);
    tdm_log_write(&r->log, again ? TDM_LOG_DEBUG : TDM_LOG_WARN, NULL, kv,
                  "registration refused: %s", msg);
    tdm_sock_refuse(r->nodesock, f, status, "%s", msg);
}

#define refuse(r, f, id, ...) refuse_status(r, f, id, TDM_EPRECONDITION, __VA_ARGS__)

/* The registered group layout (kv_layout.layers_per_group, group_windows) against the one the
 * node's config entry gives it (tdm_node_kv_groups: per layer group for a CPU node whose model
 * has no CUDA node in the config, over the model's windows). Refuses and returns
 * TDM_EPRECONDITION on a mismatch: its KV transfers would meet pools of another group layout
 * (refused by the receiver), and its blocks would be planned wrong. */
static int check_groups(tdm_router_t *r, const tdm_frame_t *f, const char *id, const rt_node_t *n,
                        const rt_model_t *model, const Tandem__V1__KvLayout *l)
{
    tdm_kv_groups_t want;
    bool grouped = n && tdm_node_kv_groups(r->cfg, n->cfg, tdm_model_hparams(model->model), &want);
    uint32_t want_groups = grouped ? want.n_groups : 0;
    bool same = l->n_group_windows == want_groups &&
                (!grouped || l->layers_per_group == want.layers_per_group);
    for (uint32_t g = 0; same && g < want_groups; g++)
        same = l->group_windows[g] == want.window[g];
    if (same)
        return TDM_OK;
    if (grouped)
        refuse(r, f, id,
               "kv_layout: the node allocates KV in %zu layer groups of %" PRIu32
               " layers; the router expects %" PRIu32 " groups of %" PRIu32
               " (a CPU node whose model has no CUDA node in the config allocates per layer group: "
               "docs/capacity.md); start it with the router's config",
               l->n_group_windows, l->layers_per_group, want.n_groups, want.layers_per_group);
    else
        refuse(r, f, id,
               "kv_layout: the node allocates KV in %zu layer groups; the router expects every "
               "layer in every block (%s): start it with the router's config",
               l->n_group_windows,
               !model->have_kv_groups
                   ? "the model has no sliding-window layers"
                   : "only a CPU node whose model has no CUDA node in the config allocates per "
                     "layer group: docs/capacity.md");
    return TDM_EPRECONDITION;
}

static int check_layout(tdm_router_t *r, const tdm_frame_t *f, const char *id, const rt_node_t *n,
                        const rt_model_t *model, const Tandem__V1__KvLayout *l)
{
    if (!l) {
        refuse(r, f, id, "kv_layout is missing from the registration");
        return TDM_EPRECONDITION;
    }
    tdm_kv_layout_t theirs = {l->n_layers, l->n_kv_heads, l->head_dim, l->block_size,
                              (tdm_kv_dtype_t)l->dtype};
    uint32_t got = 0, want = 0;
    const char *field = tdm_kv_layout_mismatch(&theirs, &model->layout, &got, &want);
    if (field && strcmp(field, "dtype") == 0) {
        refuse(r, f, id, "kv_layout.dtype is %s; the cluster config's kv.dtype is %s",
               tdm_kv_dtype_name((tdm_kv_dtype_t)got), tdm_kv_dtype_name((tdm_kv_dtype_t)want));
        return TDM_EPRECONDITION;
    }
    if (field) {
        refuse(r, f, id,
               "kv_layout.%s is %" PRIu32 "; the router expects %" PRIu32
               " (model %s at %s, config kv.block_size)",
               field, got, want, model->cfg->name, model->cfg->path);
        return TDM_EPRECONDITION;
    }
    return check_groups(r, f, id, n, model, l);
}

/* Who may register as n: a non-empty id of the config with its own key (CURVE), the role
 * the config gives it, a protocol with instance ids, and no other live instance of the id.
 * Returns false after refusing the registration. */
static bool register_identity_ok(tdm_router_t *r, const tdm_frame_t *f,
                                 const Tandem__V1__RegisterRequest *m, const rt_node_t *n,
                                 tdm_node_role_t role)
{
    const char *id = m->node_id;
    /* protobuf-c ends strings at a NUL: "decode-0\0x" would pass as "decode-0" */
    size_t wire_len = rt_wire_field_len(f->body, f->body ? f->body_len : 0, 1 /* node_id */);
    if (wire_len > strlen(id)) {
        /* kept as "<id before the NUL>?", never under the configured node it would shorten to */
        char shown[TDM_NODE_ID_MAX + 2];
        snprintf(shown, sizeof shown, "%.*s?", TDM_NODE_ID_MAX, id);
        refuse(r, f, shown,
               "node_id: byte %zu is 0x00; node ids are 1..%d characters of A-Z a-z 0-9 . _ -",
               strlen(id), TDM_NODE_ID_MAX);
        return false;
    }
    if (!tdm_config_node_id_ok(id)) {
        /* before the id reaches a message, a log line or Status, none of which may carry bytes
         * that are not UTF-8 (every STATUS reply would fail to parse) */
        size_t at = strspn(id, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-");
        if (!id[0])
            refuse(r, f, id, "node_id is empty");
        else if (at > TDM_NODE_ID_MAX || !id[at])
            refuse(r, f, id, "node_id is %zu bytes; node ids are 1..%d characters", strlen(id),
                   TDM_NODE_ID_MAX);
        else
            refuse(r, f, id,
                   "node_id: byte %zu is 0x%02x; node ids are 1..%d characters of A-Z a-z 0-9 . "
                   "_ -",
                   at, (unsigned char)id[at], TDM_NODE_ID_MAX);
        return false;
    }
    /* CURVE: the ZAP handler named the connection after the node whose key it holds */
    if (tdm_config_curve_on(r->cfg) && strcmp(f->user_id, id) != 0) {
        refuse_status(r, f, id, TDM_EUNAUTHENTICATED, "node key of '%s' cannot register as '%s'",
                      f->user_id, id);
        return false;
    }
    if (!n) {
        refuse(r, f, id, "node '%s' is not in the cluster config", id);
        return false;
    }
    if (n->cfg->role != role) {
        refuse(r, f, id, "node '%s' is a %s node in the cluster config, not a %s node", id,
               tdm_config_node_role_name(n->cfg->role), tdm_config_node_role_name(role));
        return false;
    }
    if (m->instance_id == 0 || f->instance_id != m->instance_id) {
        refuse(r, f, id,
               "instance_id is %s: this node speaks protocol %u.%u; the router needs 1.1 or "
               "newer (a random instance id in the registration and every frame header)",
               m->instance_id == 0 ? "0" : "not the frame header's", f->version_major,
               f->version_minor);
        return false;
    }
    if (n->up && n->instance_id != m->instance_id) {
        /* A live node's id is never taken over: a restarted node waits until the router has
         * seen its old instance go (heartbeat timeout); an impostor waits forever. */
        refuse_status(r, f, id, TDM_EUNAVAILABLE,
                      "node '%s' is registered by a live instance; another instance is "
                      "refused until that one is down (no heartbeat for %" PRIu32 " ms)",
                      id, r->hb_timeout_ms);
        return false;
    }
    return true;
}

/* Whether the node serves what the router does: the same model, KV layout, a context at
 * least the router's, and (decode) KV blocks and an endpoint for them. *kv_ep: that endpoint
 * (the registration's or the config's; NULL for a prefill node without one). Returns false
 * after refusing the registration. */
static bool register_fit_ok(tdm_router_t *r, const tdm_frame_t *f,
                            const Tandem__V1__RegisterRequest *m, const rt_node_t *n,
                            tdm_node_role_t role, const char **kv_ep)
{
    const char *id = m->node_id;
    const rt_model_t *model = n->model;
    size_t at = 0;
    if (m->model[0] && !tdm_text_printable(m->model, TDM_MODEL_NAME_MAX, &at)) {
        refuse(r, f, id, "model: byte %zu is not printable UTF-8 or past %u bytes", at,
               TDM_MODEL_NAME_MAX);
        return false;
    }
    if (m->model[0]) {
        /* a 2.5 node says which model it serves: one of the router's, and the one the
         * router's config gives this node id (a node started with another config) */
        const rt_model_t *named = rt_model_find(r, m->model);
        if (!named) {
            char names[256] = "";
            for (size_t i = 0, len = 0; i < r->n_models && len < sizeof names; i++)
                len += (size_t)snprintf(names + len, sizeof names - len, "%s'%s'", i ? ", " : "",
                                        r->models[i].cfg->name);
            refuse(r, f, id, "model '%.64s' is not served by this router (its models: %s)",
                   m->model, names);
            return false;
        }
        if (named != model) {
            refuse(r, f, id,
                   "model '%.64s': the router's config gives node '%s' model '%s' "
                   "(nodes[].model)",
                   m->model, id, model->cfg->name);
            return false;
        }
    }
    if (m->model_fingerprint != model->fingerprint) {
        refuse(r, f, id,
               "model fingerprint 0x%016" PRIx64 " differs from the router's 0x%016" PRIx64
               " (model %s, path %s)",
               m->model_fingerprint, model->fingerprint, model->cfg->name, model->cfg->path);
        return false;
    }
    if (check_layout(r, f, id, n, model, m->kv_layout) != TDM_OK)
        return false;
    /* the strings Status shows: printable UTF-8 that fits its field whole */
    size_t dev_max = sizeof n->device - 1;
    if (m->device[0] && !tdm_text_printable(m->device, dev_max, &at)) {
        refuse(r, f, id, "device: byte %zu is not printable UTF-8 or past %zu bytes", at, dev_max);
        return false;
    }
    if (m->kv_endpoint[0] && !tdm_text_printable(m->kv_endpoint, RT_KV_ENDPOINT_MAX, &at)) {
        refuse(r, f, id, "kv_endpoint: byte %zu is not printable UTF-8 or past %d bytes", at,
               RT_KV_ENDPOINT_MAX);
        return false;
    }
    if (m->n_ctx < model->n_ctx) {
        refuse(r, f, id,
               "n_ctx %" PRIu32 " is smaller than the router's context of %" PRIu32
               " tokens for model %s; run the node with n_ctx >= %" PRIu32,
               m->n_ctx, model->n_ctx, model->cfg->name, model->n_ctx);
        return false;
    }
    if (role == TDM_NODE_ROLE_DECODE && m->kv_blocks_total == 0) {
        refuse(r, f, id, "kv_blocks_total is 0: a decode node needs KV blocks");
        return false;
    }
    *kv_ep = m->kv_endpoint[0] ? m->kv_endpoint : tdm_config_kv_advertise(n->cfg);
    if (role == TDM_NODE_ROLE_DECODE && !*kv_ep) {
        refuse(r, f, id, "kv_endpoint is empty and the config names none for '%s'", id);
        return false;
    }
    return true;
}

/* Makes n the registered instance m describes on f's connection (ep: its KV endpoint, taken
 * over). The same instance again (it missed our ack, or the router said NOT_FOUND) keeps its
 * load figures and reservations. Returns whether it was up already. */
static bool register_apply(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f,
                           const Tandem__V1__RegisterRequest *m, char *ep)
{
    bool again = n->up;
    memcpy(n->peer, f->peer, f->peer_len);
    n->peer_len = f->peer_len;
    n->refused_reason[0] = '\0';
    n->refused_count = 0;
    free(n->kv_endpoint);
    n->kv_endpoint = ep;
    n->registered = true;
    n->up = true;
    n->instance_id = m->instance_id;
    node_seen(r, n);
    n->kv_blocks_total = m->kv_blocks_total;
    n->kv_grouped = m->kv_layout->n_group_windows > 0; /* as check_groups expects */
    n->max_running = m->max_running;
    n->max_batch_tokens = m->max_batch_tokens;
    n->n_ctx = m->n_ctx;
    snprintf(n->device, sizeof n->device, "%s", m->device);
    rt_place_from(&n->place, m);
    if (!again) {
        load_gauges_zero(&n->load);
        n->load.kv_blocks_free = m->kv_blocks_total;
        n->tokens_since_hb = 0;
        n->reserved_pending = n->reserved_acked = 0;
        n->n_pending = 0;
        memset(&n->step_fit, 0, sizeof n->step_fit);
    }
    return again;
}

/* Sends RegisterAck and logs the node. */
static void register_ack(tdm_router_t *r, const tdm_frame_t *f,
                         const Tandem__V1__RegisterRequest *m, tdm_node_role_t role, const char *ep,
                         bool again)
{
    Tandem__V1__RegisterAck ack = TANDEM__V1__REGISTER_ACK__INIT;
    ack.heartbeat_interval_ms = r->hb_interval_ms;
    ack.heartbeat_timeout_ms = r->hb_timeout_ms;
    ack.router_instance_id = r->instance_id;
    tdm_sock_reply(r->nodesock, f, &ack.base);
    char kv[512] = "";
    char num[32];
    tdm_log_kv_append(kv, sizeof kv, "node_id", m->node_id);
    tdm_log_kv_append(kv, sizeof kv, "role", tdm_config_node_role_name(role));
    tdm_log_kv_append(kv, sizeof kv, "device", m->device);
    snprintf(num, sizeof num, "%" PRIu32, m->kv_blocks_total);
    tdm_log_kv_append(kv, sizeof kv, "kv_blocks", num);
    if (ep)
        tdm_log_kv_append(kv, sizeof kv, "kv_endpoint", ep);
    tdm_log_write(&r->log, TDM_LOG_INFO, NULL, kv, again ? "node registered again" : "node up");
}

/* A registration m on f's connection: refused, or the node is up and the queue drains. */
static void register_node(tdm_router_t *r, const tdm_frame_t *f,
                          const Tandem__V1__RegisterRequest *m)
{
    rt_node_t *n = rt_node_find(r, m->node_id, strlen(m->node_id));
    tdm_node_role_t role = m->role == TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE
                               ? TDM_NODE_ROLE_DECODE
                               : TDM_NODE_ROLE_PREFILL;
    const char *kv_ep = NULL;
    if (!register_identity_ok(r, f, m, n, role) || !register_fit_ok(r, f, m, n, role, &kv_ep))
        return;
    char *ep = kv_ep ? tdm_strdup(kv_ep) : NULL;
    if (kv_ep && !ep) {
        tdm_sock_refuse(r->nodesock, f, TDM_ERESOURCE, "router out of memory");
        return;
    }
    bool again = register_apply(r, n, f, m, ep);
    register_ack(r, f, m, role, ep, again);
    rt_drain_queue(r);
}

static void handle_register(tdm_router_t *r, const tdm_frame_t *f)
{
    Tandem__V1__RegisterRequest *m = (Tandem__V1__RegisterRequest *)tdm_frame_unpack(
        f, &tandem__v1__register_request__descriptor);
    if (!m) {
        tdm_sock_refuse(r->nodesock, f, TDM_EINVALID,
                        "the body does not decode as a RegisterRequest");
        return;
    }
    register_node(r, f, m);
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

/* ---- heartbeats ---- */

static void handle_heartbeat(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    bool is_req = f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    Tandem__V1__Heartbeat *h =
        (Tandem__V1__Heartbeat *)tdm_frame_unpack(f, &tandem__v1__heartbeat__descriptor);
    if (!h) {
        if (is_req)
            tdm_sock_refuse(r->nodesock, f, TDM_EINVALID,
                            "the body does not decode as a Heartbeat");
        return;
    }
    if (!n || !n->up || h->instance_id != n->instance_id || f->instance_id != n->instance_id ||
        strcmp(h->node_id, n->cfg->id) != 0) {
        if (n && n->up)
            r->metrics.stale_instance_messages++;
        char shown[TDM_NODE_ID_MAX + 1];
        shown_id(h->node_id, shown, sizeof shown);
        tdm_sock_refuse(r->nodesock, f, TDM_ENOTFOUND,
                        "node '%s' is not registered with this router; register again", shown);
        protobuf_c_message_free_unpacked(&h->base, NULL);
        return;
    }
    node_seen(r, n);
    tdm_node_load_from_proto(h->load, &n->load);
    rt_metrics_iterations(r, n, h->instance_id);
    /* admission's step-time line: decode passes only (a local prefill pass is not one) */
    rt_admit_observe(&n->step_fit, n->load.decode_batch_size, n->load.decode_step_s);
    n->tokens_since_hb = 0;
    n->reserved_acked = 0;
    protobuf_c_message_free_unpacked(&h->base, NULL);
    if (is_req) {
        Tandem__V1__HeartbeatAck ack = TANDEM__V1__HEARTBEAT_ACK__INIT;
        ack.router_instance_id = r->instance_id;
        tdm_sock_reply(r->nodesock, f, &ack.base);
    }
    rt_drain_queue(r);
}

/* ---- routing ---- */

/* A frame a registered node sends, and who handles it: an END (the answer to the router's
 * own call) or any other kind (the node's message), by method. REGISTER and HEARTBEAT come
 * before (rt_node_message): they are how a connection becomes and stays a node. */
typedef struct node_route {
    bool end; /* matches END frames, else every other kind */
    int method;
    void (*handle)(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f);
} node_route_t;

static const node_route_t node_routes[] = {
    {true, TANDEM__V1__METHOD__METHOD_DECODE_RESERVE, rt_sched_reserve_end},
    {false, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, rt_stream_on_token},
    {false, TANDEM__V1__METHOD__METHOD_FINISHED, rt_stream_on_finished},
    {false, TANDEM__V1__METHOD__METHOD_KV_SHIPPED, rt_stream_on_kv_shipped},
    {false, TANDEM__V1__METHOD__METHOD_TASK_FAILED, rt_sched_task_failed},
    {false, TANDEM__V1__METHOD__METHOD_EMBEDDING, rt_embed_on_result},
};

/* Handles a frame from n, the registered and current instance of a node: its row of
 * node_routes; a REQUEST of another method is answered NOT_FOUND, anything else ignored. */
static void node_frame(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    bool was_suspect = node_seen(r, n);
    bool end = f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
    const node_route_t *route = NULL;
    for (size_t i = 0; i < sizeof node_routes / sizeof node_routes[0] && !route; i++)
        if (node_routes[i].end == end && node_routes[i].method == f->method)
            route = &node_routes[i];
    if (route)
        route->handle(r, n, f);
    else if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST)
        tdm_sock_reply_error(r->nodesock, f, TDM_ENOTFOUND,
                             "method %s is not served on the node endpoint",
                             tdm_net_method_name(f->method));
    /* healthy again: work that waited for a node may go to it now */
    if (was_suspect && n->up)
        rt_drain_queue(r);
}

void rt_node_message(tdm_router_t *r, const tdm_frame_t *f)
{
    /* A node is its registered connection: the routing id bound at registration (unique per
     * instance), never a name a message claims. */
    rt_node_t *n = rt_node_by_peer(r, f->peer, f->peer_len);
    if (f->method == TANDEM__V1__METHOD__METHOD_REGISTER &&
        f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST) {
        handle_register(r, f);
        return;
    }
    if (n && n->up && f->instance_id != n->instance_id) {
        r->metrics.stale_instance_messages++;
        n = NULL;
    }
    if (f->method == TANDEM__V1__METHOD__METHOD_HEARTBEAT) {
        handle_heartbeat(r, n, f);
        return;
    }
    if (!n || !n->up) {
        if (n || f->instance_id)
            r->metrics.stale_instance_messages++;
        if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST)
            tdm_sock_refuse(r->nodesock, f, TDM_ENOTFOUND,
                            "this connection is not a registered node of this router; "
                            "register again");
        else
            tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL,
                          "ignoring %s %s from a connection that is not a registered node",
                          tdm_net_kind_name(f->kind), tdm_net_method_name(f->method));
        return;
    }
    node_frame(r, n, f);
}
