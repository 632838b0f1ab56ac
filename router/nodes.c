/* nodes.c - the router's side of the node protocol: registration, heartbeats and liveness,
 * node failure, scheduling (decode node by free KV blocks, prefill node by policy), the
 * dispatch of a request (DecodeReserve, then PrefillTask) and the events nodes send back.
 *
 * KV accounting: a decode node's room is its last heartbeat's free + cached blocks minus the
 * blocks of reservations the router sent that the node's figures do not show yet (awaiting a
 * reply, or acknowledged since the last heartbeat: a heartbeat that arrives after the ack was
 * sent after it on the same connection, so it counts the blocks).
 *
 * prefix_aware: prompts are cut into full blocks and chained with tdm_kv_block_hash, as the
 * nodes' prefix caches do. The key is the hash of the last of a prompt's first
 * TDM_ROUTER_PREFIX_KEY_BLOCKS full blocks (fewer when it has fewer). The router remembers, in
 * a direct-mapped table, which prefill node it last sent each block hash to; a request goes
 * to the node holding its deepest known block when that block is at least as deep as the key
 * (a shared first block, such as a chat template's header, does not pull all traffic to one
 * node). Otherwise the node is chosen by rendezvous
 * (highest random weight) hashing of (key, node id) among the prefill nodes up, so requests
 * that share a long system prompt land on the same node without any history. Either choice
 * falls back to least_loaded when that node's queue exceeds twice the average of the other
 * prefill nodes plus one max_batch_tokens.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router_internal.h"

#define PREFIX_MAX_BLOCKS 1024u

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

uint64_t rt_next_attempt(tdm_router_t *r)
{
    uint64_t a = r->next_attempt++;
    if (a == 0)
        a = r->next_attempt++;
    return a;
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

int64_t rt_node_avail(const rt_node_t *n)
{
    return (int64_t)n->kv_free + n->kv_cached - n->reserved_pending - n->reserved_acked;
}

static uint64_t prefill_load(const rt_node_t *n)
{
    return n->queued_prefill_tokens + n->tokens_since_hb;
}

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull; /* SplitMix64's finaliser */
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static uint64_t str_hash(const char *s)
{
    uint64_t h = 1469598103934665603ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 1099511628211ull;
    return mix64(h);
}

static const char *role_name(const rt_node_t *n)
{
    return tdm_config_node_role_name(n->cfg->role);
}

/* ---- scheduling ---- */

static rt_node_t *pick_round_robin(tdm_router_t *r)
{
    for (size_t k = 0; k < r->n_nodes; k++) {
        size_t i = (r->rr_next + k) % r->n_nodes;
        rt_node_t *n = &r->nodes[i];
        if (n->up && n->cfg->role == TDM_NODE_ROLE_PREFILL) {
            r->rr_next = i + 1;
            return n;
        }
    }
    return NULL;
}

static rt_node_t *pick_least_loaded(tdm_router_t *r)
{
    rt_node_t *best = NULL;
    size_t best_k = 0;
    /* ties go to the first node after the round robin cursor, so equal nodes share work */
    for (size_t k = 0; k < r->n_nodes; k++) {
        rt_node_t *n = &r->nodes[(r->rr_next + k) % r->n_nodes];
        if (!n->up || n->cfg->role != TDM_NODE_ROLE_PREFILL)
            continue;
        if (!best || prefill_load(n) < prefill_load(best)) {
            best = n;
            best_k = k;
        }
    }
    if (best)
        r->rr_next = (r->rr_next + best_k + 1) % r->n_nodes;
    return best;
}

/* True when n's queue is over the load bound of prefix_aware routing: more than twice the
 * average of the other prefill nodes up, plus one max_batch_tokens (a node alone is never
 * over it: there is nowhere else to go). */
static bool overloaded(const tdm_router_t *r, const rt_node_t *n)
{
    uint64_t sum = 0, cnt = 0;
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *m = &r->nodes[i];
        if (m != n && m->up && m->cfg->role == TDM_NODE_ROLE_PREFILL) {
            sum += prefill_load(m);
            cnt++;
        }
    }
    uint64_t mbt = n->max_batch_tokens ? n->max_batch_tokens : (uint64_t)n->cfg->max_batch_tokens;
    return cnt > 0 && prefill_load(n) * cnt > 2 * sum + mbt * cnt;
}

static rt_node_t *pick_prefix_aware(tdm_router_t *r, const rt_req_t *q)
{
    uint32_t bs = r->block_size;
    uint32_t nb = q->n_prompt / bs;
    if (nb > PREFIX_MAX_BLOCKS)
        nb = PREFIX_MAX_BLOCKS;
    if (nb == 0)
        return pick_least_loaded(r);
    uint64_t hashes[PREFIX_MAX_BLOCKS];
    uint64_t parent = TDM_KV_HASH_SEED;
    for (uint32_t i = 0; i < nb; i++)
        parent = hashes[i] = tdm_kv_block_hash(parent, q->prompt + (size_t)i * bs, bs);
    /* a shared first block or two (a chat template's header) says little: history counts
     * only when it matches at least the key's blocks */
    uint32_t key_blocks = nb < TDM_ROUTER_PREFIX_KEY_BLOCKS ? nb : TDM_ROUTER_PREFIX_KEY_BLOCKS;
    rt_node_t *pick = NULL;
    for (uint32_t i = nb; i-- > key_blocks - 1 && !pick;) {
        size_t slot = (size_t)hashes[i] & r->prefix_mask;
        if (r->prefix_keys[slot] == hashes[i] && r->prefix_nodes[slot]) {
            rt_node_t *n = &r->nodes[r->prefix_nodes[slot] - 1];
            if (n->up && n->cfg->role == TDM_NODE_ROLE_PREFILL)
                pick = n;
        }
    }
    if (!pick) {
        uint64_t key = hashes[key_blocks - 1];
        uint64_t best_w = 0;
        for (size_t i = 0; i < r->n_nodes; i++) {
            rt_node_t *n = &r->nodes[i];
            if (!n->up || n->cfg->role != TDM_NODE_ROLE_PREFILL)
                continue;
            uint64_t w = mix64(key ^ str_hash(n->cfg->id));
            if (!pick || w > best_w) {
                pick = n;
                best_w = w;
            }
        }
    }
    if (pick && overloaded(r, pick)) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL,
                      "prefix_aware: node %s is over the load bound; least_loaded instead",
                      pick->cfg->id);
        pick = pick_least_loaded(r);
    }
    if (pick)
        for (uint32_t i = 0; i < nb; i++) {
            size_t slot = (size_t)hashes[i] & r->prefix_mask;
            r->prefix_keys[slot] = hashes[i];
            r->prefix_nodes[slot] = (uint32_t)pick->index + 1;
        }
    return pick;
}

static rt_node_t *pick_prefill(tdm_router_t *r, const rt_req_t *q)
{
    switch (r->cfg->router.prefill_policy) {
    case TDM_PREFILL_POLICY_LEAST_LOADED: return pick_least_loaded(r);
    case TDM_PREFILL_POLICY_PREFIX_AWARE: return pick_prefix_aware(r, q);
    case TDM_PREFILL_POLICY_ROUND_ROBIN:
    default: return pick_round_robin(r);
    }
}

static bool any_prefill_up(const tdm_router_t *r)
{
    for (size_t i = 0; i < r->n_nodes; i++)
        if (r->nodes[i].up && r->nodes[i].cfg->role == TDM_NODE_ROLE_PREFILL)
            return true;
    return false;
}

int rt_dispatch(tdm_router_t *r, rt_req_t *q)
{
    uint32_t need = (q->n_prompt + 1 + r->block_size - 1) / r->block_size;
    for (;;) {
        rt_node_t *best = NULL;
        bool any_up = false;
        uint32_t max_total = 0;
        for (size_t i = 0; i < r->n_nodes; i++) {
            rt_node_t *n = &r->nodes[i];
            if (!n->up || n->cfg->role != TDM_NODE_ROLE_DECODE)
                continue;
            any_up = true;
            if (n->kv_blocks_total > max_total)
                max_total = n->kv_blocks_total;
            if (q->tried[i] || rt_node_avail(n) < (int64_t)need)
                continue;
            if (!best || rt_node_avail(n) > rt_node_avail(best))
                best = n;
        }
        if (!best) {
            if (any_up && need > max_total)
                return tdm_error_set(&r->err, TDM_ERESOURCE,
                                     "the prompt needs %" PRIu32
                                     " KV blocks; the largest decode node up has %" PRIu32,
                                     need, max_total);
            return 1;
        }
        bool local = !any_prefill_up(r);
        Tandem__V1__SamplingParams sp;
        tdm_proto_sampling_to(&q->sp, &sp);
        uint64_t attempt = rt_next_attempt(r);
        Tandem__V1__DecodeReserve m = TANDEM__V1__DECODE_RESERVE__INIT;
        m.request_id = q->id;
        m.attempt_id = attempt;
        m.n_prompt_tokens = q->n_prompt;
        m.prompt_tokens = q->prompt;
        m.sampling = &sp;
        m.max_tokens = q->sp.max_tokens;
        m.local_prefill = local;
        m.deadline_unix_ms = q->deadline_ms;
        if (best->n_pending == best->cap_pending) {
            size_t cap = best->cap_pending ? best->cap_pending * 2 : 16;
            rt_pending_t *p = realloc(best->pending, cap * sizeof *p);
            if (!p)
                return tdm_error_set(&r->err, TDM_ERESOURCE, "router out of memory");
            best->pending = p;
            best->cap_pending = cap;
        }
        uint64_t call = r->next_call++;
        tdm_send_t s = {0};
        s.peer = best->peer;
        s.peer_len = best->peer_len;
        s.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
        s.method = TANDEM__V1__METHOD__METHOD_DECODE_RESERVE;
        s.call_id = call;
        s.deadline_unix_ms = q->deadline_ms;
        s.body = &m.base;
        int rc = tdm_sock_send(r->nodesock, &s);
        if (rc != TDM_OK) {
            tdm_log_write(&r->log, TDM_LOG_WARN, q->id, NULL,
                          "DecodeReserve to %s could not be sent (%s); trying another node",
                          best->cfg->id, tdm_strerror(rc));
            q->tried[best->index] = true;
            continue;
        }
        best->pending[best->n_pending++] = (rt_pending_t){call, need, q};
        best->reserved_pending += need;
        q->attempt_id = attempt;
        q->decode = best;
        q->prefill = NULL;
        q->state = RT_RESERVING;
        q->local_prefill = local;
        q->n_blocks = need;
        q->reserve_call = call;
        char kv[160];
        snprintf(kv, sizeof kv, "decode=%s blocks=%" PRIu32 " local_prefill=%s attempt=%016" PRIx64,
                 best->cfg->id, need, local ? "true" : "false", attempt);
        tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, kv, "reserve sent");
        return 0;
    }
}

void rt_drain_queue(tdm_router_t *r)
{
    while (r->qhead) {
        rt_req_t *q = r->qhead;
        rt_queue_remove(r, q);
        memset(q->tried, 0, r->n_nodes * sizeof *q->tried);
        int rc = rt_dispatch(r, q);
        if (rc == 1) {
            rt_queue_push(r, q, true);
            return;
        }
        if (rc < 0)
            rt_req_fail(r, q, rc, false, "%s", r->err.msg);
    }
}

bool rt_redispatch(tdm_router_t *r, rt_req_t *q, bool count, int status, const char *why)
{
    if (count) {
        if (q->redispatches >= TDM_ROUTER_MAX_REDISPATCH) {
            rt_req_fail(r, q, status, true, "%s (gave up after %d re-dispatches)", why,
                        TDM_ROUTER_MAX_REDISPATCH);
            return true;
        }
        q->redispatches++;
    }
    r->metrics.redispatches++;
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL, "re-dispatching: %s", why);
    rt_req_release_nodes(r, q, TDM_ECANCELLED);
    q->n_buf = 0;
    q->finished = false;
    q->decode_started = false;
    q->prefilled = false;
    q->state = RT_QUEUED;
    memset(q->tried, 0, r->n_nodes * sizeof *q->tried);
    int rc = rt_dispatch(r, q);
    if (rc == 1) {
        rt_queue_push(r, q, true); /* it was admitted before: no queue limit */
        return false;
    }
    if (rc < 0) {
        rt_req_fail(r, q, rc, false, "%s", r->err.msg);
        return true;
    }
    return false;
}

/* The reservation was acknowledged: start the prefill (or the decode node does it). */
static void reserve_acked(tdm_router_t *r, rt_req_t *q)
{
    double now = tdm_time_now();
    q->state = RT_RUNNING;
    if (!q->local_prefill) {
        rt_node_t *p = pick_prefill(r, q);
        if (!p) {
            rt_redispatch(r, q, false, TDM_EUNAVAILABLE,
                          "no prefill node up any more; the decode node prefills locally");
            return;
        }
        Tandem__V1__SamplingParams sp;
        tdm_proto_sampling_to(&q->sp, &sp);
        Tandem__V1__PrefillTask t = TANDEM__V1__PREFILL_TASK__INIT;
        t.request_id = q->id;
        t.attempt_id = q->attempt_id;
        t.n_prompt_tokens = q->n_prompt;
        t.prompt_tokens = q->prompt;
        t.sampling = &sp;
        t.max_tokens = q->sp.max_tokens;
        t.decode_node_id = (char *)q->decode->cfg->id;
        t.decode_kv_endpoint = q->decode->kv_endpoint ? q->decode->kv_endpoint : (char *)"";
        t.deadline_unix_ms = q->deadline_ms;
        rt_node_notify(r, p, TANDEM__V1__METHOD__METHOD_PREFILL_TASK, &t.base);
        q->prefill = p;
        p->tokens_since_hb += q->n_prompt;
    }
    if (q->t_dispatch == 0)
        rt_hist_observe(&r->metrics.queue, now - q->t_arrival);
    q->t_dispatch = now;
    char kv[200];
    snprintf(kv, sizeof kv, "decode=%s prefill=%s", q->decode->cfg->id,
             q->prefill ? q->prefill->cfg->id : "local");
    tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, kv, "dispatched");
}

/* END for a DecodeReserve. */
static void reserve_reply(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    size_t i = 0;
    while (i < n->n_pending && n->pending[i].call_id != f->call_id)
        i++;
    if (i == n->n_pending) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL,
                      "reserve reply for unknown call %" PRIu64 " from %s", f->call_id, n->cfg->id);
        return;
    }
    rt_pending_t p = n->pending[i];
    n->pending[i] = n->pending[--n->n_pending];
    n->reserved_pending -= p.n_blocks < n->reserved_pending ? p.n_blocks : n->reserved_pending;
    rt_req_t *q = p.req;
    if (f->status == TDM_OK) {
        uint32_t blocks = p.n_blocks;
        Tandem__V1__ReserveAck *ack =
            (Tandem__V1__ReserveAck *)tdm_frame_unpack(f, &tandem__v1__reserve_ack__descriptor);
        bool stale = false;
        if (ack) {
            if (ack->n_blocks)
                blocks = ack->n_blocks;
            stale = q && ack->attempt_id != q->attempt_id;
            protobuf_c_message_free_unpacked(&ack->base, NULL);
        }
        n->reserved_acked += blocks;
        if (stale) {
            /* cannot happen with call ids unique per router; counted, never applied */
            r->metrics.stale_attempt_messages++;
            rt_redispatch(r, q, false, TDM_EUNAVAILABLE,
                          "the reservation answer names another attempt");
            return;
        }
        if (q)
            reserve_acked(r, q);
        return;
    }
    if (!q)
        return;
    q->decode = NULL;
    q->state = RT_QUEUED;
    if (f->status == TDM_ERESOURCE || f->status == TDM_EUNAVAILABLE) {
        if (f->status == TDM_ERESOURCE) {
            r->metrics.reserve_rejects++;
            n->kv_free = n->kv_cached = 0; /* until its next heartbeat says otherwise */
        }
        tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                      "decode node %s refused the reservation (%s: %s); trying another", n->cfg->id,
                      tdm_status_name(f->status), f->message);
        q->tried[n->index] = true;
        int rc = rt_dispatch(r, q);
        if (rc == 1) {
            memset(q->tried, 0, r->n_nodes * sizeof *q->tried);
            rt_queue_push(r, q, true);
            tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                          "queued: no decode node has room (%zu waiting)", r->n_queued);
        } else if (rc < 0) {
            rt_req_fail(r, q, rc, false, "%s", r->err.msg);
        }
        return;
    }
    rt_req_fail(r, q, f->status ? f->status : TDM_EINTERNAL, true,
                "decode node '%s' refused the request: %s", n->cfg->id, f->message);
}

/* ---- registration, heartbeats, failures ---- */

static void node_failed(tdm_router_t *r, rt_node_t *n, const char *reason)
{
    n->up = false;
    snprintf(n->down_reason, sizeof n->down_reason, "%s", reason);
    r->metrics.node_failures++;
    n->failures++;
    char kv[256] = "";
    tdm_log_kv_append(kv, sizeof kv, "node_id", n->cfg->id);
    tdm_log_kv_append(kv, sizeof kv, "role", role_name(n));
    tdm_log_kv_append(kv, sizeof kv, "reason", reason);
    tdm_log_write(&r->log, TDM_LOG_WARN, NULL, kv, "node down");
    n->n_pending = 0;
    n->reserved_pending = n->reserved_acked = 0;
    n->tokens_since_hb = 0;
    /* A down node holds nothing: its last heartbeat's load figures no longer mean anything
     * (its process is gone or stopping), so Status and /metrics must not show them. */
    n->kv_free = n->kv_used = n->kv_cached = n->running = n->waiting = n->batch_size = 0;
    n->queued_prefill_tokens = 0;
    for (rt_req_t *q = r->head, *nx; q; q = nx) {
        nx = q->next;
        if (q->decode == n) {
            if (q->state == RT_RESERVING) {
                char why[256];
                snprintf(why, sizeof why, "decode node '%s' is down (%s) while reserving",
                         n->cfg->id, reason);
                rt_redispatch(r, q, false, TDM_EUNAVAILABLE, why);
            } else {
                rt_req_fail(r, q, TDM_EUNAVAILABLE, true, "decode node '%s' is down (%s)",
                            n->cfg->id, reason);
            }
        } else if (q->prefill == n && !q->decode_started) {
            /* its decode node never got the KV (no token from it yet): start over */
            char why[256];
            snprintf(why, sizeof why, "prefill node '%s' is down (%s)", n->cfg->id, reason);
            rt_redispatch(r, q, true, TDM_EUNAVAILABLE, why);
        } else if (q->prefill == n) {
            q->prefill = NULL; /* the KV already reached the decode node */
        }
    }
}

void rt_check_heartbeats(tdm_router_t *r, double now)
{
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        double age = now - n->last_seen;
        if (n->up && age * 1000.0 > (double)r->hb_timeout_ms) {
            char reason[96];
            snprintf(reason, sizeof reason, "no heartbeat for %.0f ms", age * 1000.0);
            node_failed(r, n, reason);
        }
    }
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
    size_t k = 0;
    for (const char *c = id; *c && k < sizeof shown - 1; c++)
        shown[k++] = (*c > 0x20 && *c < 0x7f) ? *c : '?';
    shown[k] = '\0';
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
    char kv[128] = "";
    tdm_log_kv_append(kv, sizeof kv, "node_id", id);
    tdm_log_write(&r->log, again ? TDM_LOG_DEBUG : TDM_LOG_WARN, NULL, kv,
                  "registration refused: %s", msg);
    tdm_sock_reply_error(r->nodesock, f, status, "%s", msg);
}

#define refuse(r, f, id, ...) refuse_status(r, f, id, TDM_EPRECONDITION, __VA_ARGS__)

static int check_layout(tdm_router_t *r, const tdm_frame_t *f, const char *id,
                        const Tandem__V1__KvLayout *l)
{
    if (!l) {
        refuse(r, f, id, "kv_layout is missing from the registration");
        return TDM_EPRECONDITION;
    }
    tdm_kv_layout_t theirs = {l->n_layers, l->n_kv_heads, l->head_dim, l->block_size,
                              (tdm_kv_dtype_t)l->dtype};
    uint32_t got = 0, want = 0;
    const char *field = tdm_kv_layout_mismatch(&theirs, &r->layout, &got, &want);
    if (field && strcmp(field, "dtype") == 0) {
        refuse(r, f, id, "kv_layout.dtype is %s; the cluster config's kv.dtype is %s",
               tdm_kv_dtype_name((tdm_kv_dtype_t)got), tdm_kv_dtype_name((tdm_kv_dtype_t)want));
        return TDM_EPRECONDITION;
    }
    if (field) {
        refuse(r, f, id,
               "kv_layout.%s is %" PRIu32 "; the router expects %" PRIu32
               " (model %s, config kv.block_size)",
               field, got, want, r->cfg->model.path);
        return TDM_EPRECONDITION;
    }
    return TDM_OK;
}

static void handle_register(tdm_router_t *r, const tdm_frame_t *f)
{
    Tandem__V1__RegisterRequest *m = (Tandem__V1__RegisterRequest *)tdm_frame_unpack(
        f, &tandem__v1__register_request__descriptor);
    if (!m) {
        tdm_sock_reply_error(r->nodesock, f, TDM_EINVALID,
                             "the body does not decode as a RegisterRequest");
        return;
    }
    const char *id = m->node_id;
    rt_node_t *n = rt_node_find(r, id, strlen(id));
    tdm_node_role_t role = m->role == TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE
                               ? TDM_NODE_ROLE_DECODE
                               : TDM_NODE_ROLE_PREFILL;
    if (!id[0]) {
        refuse(r, f, id, "node_id is empty");
        goto out;
    }
    /* CURVE: the ZAP handler named the connection after the node whose key it holds */
    if (tdm_config_curve_on(r->cfg) && strcmp(f->user_id, id) != 0) {
        refuse_status(r, f, id, TDM_EUNAUTHENTICATED, "node key of '%s' cannot register as '%s'",
                      f->user_id, id);
        goto out;
    }
    if (!n) {
        refuse(r, f, id, "node '%s' is not in the cluster config", id);
        goto out;
    }
    if (n->cfg->role != role) {
        refuse(r, f, id, "node '%s' is a %s node in the cluster config, not a %s node", id,
               tdm_config_node_role_name(n->cfg->role), tdm_config_node_role_name(role));
        goto out;
    }
    if (m->instance_id == 0 || f->instance_id != m->instance_id) {
        refuse(r, f, id,
               "instance_id is %s: this node speaks protocol %u.%u; the router needs 1.1 or "
               "newer (a random instance id in the registration and every frame header)",
               m->instance_id == 0 ? "0" : "not the frame header's", f->version_major,
               f->version_minor);
        goto out;
    }
    if (n->up && n->instance_id != m->instance_id) {
        /* A live node's id is never taken over: a restarted node waits until the router has
         * seen its old instance go (heartbeat timeout); an impostor waits forever. */
        refuse_status(r, f, id, TDM_EUNAVAILABLE,
                      "node '%s' is registered by a live instance (%016" PRIx64
                      "); another instance is refused until that one is down (no heartbeat "
                      "for %" PRIu32 " ms)",
                      id, n->instance_id, r->hb_timeout_ms);
        goto out;
    }
    if (m->model_fingerprint != r->fingerprint) {
        refuse(r, f, id,
               "model fingerprint 0x%016" PRIx64 " differs from the router's 0x%016" PRIx64
               " (model path %s)",
               m->model_fingerprint, r->fingerprint, r->cfg->model.path);
        goto out;
    }
    if (check_layout(r, f, id, m->kv_layout) != TDM_OK)
        goto out;
    if (m->n_ctx < r->n_ctx) {
        refuse(r, f, id,
               "n_ctx %" PRIu32 " is smaller than the router's context of %" PRIu32
               " tokens; run the node with n_ctx >= %" PRIu32,
               m->n_ctx, r->n_ctx, r->n_ctx);
        goto out;
    }
    if (role == TDM_NODE_ROLE_DECODE && m->kv_blocks_total == 0) {
        refuse(r, f, id, "kv_blocks_total is 0: a decode node needs KV blocks");
        goto out;
    }
    const char *kv_ep = m->kv_endpoint[0] ? m->kv_endpoint : tdm_config_kv_advertise(n->cfg);
    if (role == TDM_NODE_ROLE_DECODE && !kv_ep) {
        refuse(r, f, id, "kv_endpoint is empty and the config names none for '%s'", id);
        goto out;
    }
    char *ep = kv_ep ? tdm_strdup(kv_ep) : NULL;
    if (kv_ep && !ep) {
        tdm_sock_reply_error(r->nodesock, f, TDM_ERESOURCE, "router out of memory");
        goto out;
    }
    bool again = n->up; /* the same instance again (it missed our ack, or the router said
                           NOT_FOUND): keep its load figures and reservations */
    memcpy(n->peer, f->peer, f->peer_len);
    n->peer_len = f->peer_len;
    n->refused_reason[0] = '\0';
    n->refused_count = 0;
    free(n->kv_endpoint);
    n->kv_endpoint = ep;
    n->registered = true;
    n->up = true;
    n->instance_id = m->instance_id;
    n->last_seen = tdm_time_now();
    n->kv_blocks_total = m->kv_blocks_total;
    n->max_running = m->max_running;
    n->max_batch_tokens = m->max_batch_tokens;
    n->n_ctx = m->n_ctx;
    snprintf(n->device, sizeof n->device, "%s", m->device);
    if (!again) {
        n->kv_free = m->kv_blocks_total;
        n->kv_used = n->kv_cached = n->running = n->waiting = n->batch_size = 0;
        n->queued_prefill_tokens = 0;
        n->tokens_since_hb = 0;
        n->reserved_pending = n->reserved_acked = 0;
        n->n_pending = 0;
    }
    Tandem__V1__RegisterAck ack = TANDEM__V1__REGISTER_ACK__INIT;
    ack.heartbeat_interval_ms = r->hb_interval_ms;
    ack.heartbeat_timeout_ms = r->hb_timeout_ms;
    ack.router_instance_id = r->instance_id;
    tdm_sock_reply(r->nodesock, f, &ack.base);
    char kv[512] = "";
    char num[32];
    tdm_log_kv_append(kv, sizeof kv, "node_id", id);
    tdm_log_kv_append(kv, sizeof kv, "role", tdm_config_node_role_name(role));
    tdm_log_kv_append(kv, sizeof kv, "device", m->device);
    snprintf(num, sizeof num, "%" PRIu32, m->kv_blocks_total);
    tdm_log_kv_append(kv, sizeof kv, "kv_blocks", num);
    if (ep)
        tdm_log_kv_append(kv, sizeof kv, "kv_endpoint", ep);
    tdm_log_write(&r->log, TDM_LOG_INFO, NULL, kv, again ? "node registered again" : "node up");
    protobuf_c_message_free_unpacked(&m->base, NULL);
    rt_drain_queue(r);
    return;
out:
    protobuf_c_message_free_unpacked(&m->base, NULL);
}

static void handle_heartbeat(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    bool is_req = f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    Tandem__V1__Heartbeat *h =
        (Tandem__V1__Heartbeat *)tdm_frame_unpack(f, &tandem__v1__heartbeat__descriptor);
    if (!h) {
        if (is_req)
            tdm_sock_reply_error(r->nodesock, f, TDM_EINVALID,
                                 "the body does not decode as a Heartbeat");
        return;
    }
    if (!n || !n->up || h->instance_id != n->instance_id || f->instance_id != n->instance_id ||
        strcmp(h->node_id, n->cfg->id) != 0) {
        if (n && n->up)
            r->metrics.stale_instance_messages++;
        tdm_sock_reply_error(r->nodesock, f, TDM_ENOTFOUND,
                             "node '%.*s' is not registered with this router; register again",
                             (int)strnlen(h->node_id, TDM_NODE_ID_MAX), h->node_id);
        protobuf_c_message_free_unpacked(&h->base, NULL);
        return;
    }
    n->last_seen = tdm_time_now();
    n->kv_free = h->kv_blocks_free;
    n->kv_used = h->kv_blocks_used;
    n->kv_cached = h->kv_blocks_cached;
    n->running = h->running;
    n->waiting = h->waiting;
    n->queued_prefill_tokens = h->queued_prefill_tokens;
    n->prefix_queries = h->prefix_queries;
    n->prefix_hits = h->prefix_hits;
    n->batch_size = h->batch_size;
    double sum = 0;
    for (size_t i = 0; i < h->n_recent_step_s; i++)
        sum += h->recent_step_s[i];
    if (h->n_recent_step_s)
        n->step_time_s = sum / (double)h->n_recent_step_s;
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

/* ---- events for requests ---- */

/* The request a node message names by (request id, attempt) when that attempt is current and
 * n is its prefill node (from_prefill) or decode node (from_decode) that may send it; else
 * NULL after a debug line, and a message of an attempt that is not current counted as stale. */
static rt_req_t *event_request(tdm_router_t *r, const rt_node_t *n, const char *id,
                               uint64_t attempt, bool from_prefill, bool from_decode,
                               const char *what)
{
    bool known;
    rt_req_t *q = rt_req_find_attempt(r, id, attempt, &known);
    if (!q && known) {
        r->metrics.stale_attempt_messages++;
        tdm_log_write(&r->log, TDM_LOG_DEBUG, id, NULL,
                      "ignoring %s of attempt %016" PRIx64 " from %s (not a current attempt)", what,
                      attempt, n->cfg->id);
        return NULL;
    }
    if (!q || !((from_prefill && n == q->prefill) || (from_decode && n == q->decode))) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, id, NULL,
                      "ignoring %s from %s (request not running there)", what, n->cfg->id);
        return NULL;
    }
    return q;
}

static void handle_token_event(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__TokenEvent *ev =
        (Tandem__V1__TokenEvent *)tdm_frame_unpack(f, &tandem__v1__token_event__descriptor);
    if (!ev)
        return;
    rt_req_t *q = event_request(r, n, ev->request_id, ev->attempt_id, true, true, "token");
    if (q && q->state != RT_RUNNING) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, ev->request_id, NULL,
                      "ignoring token %" PRIu32 " from %s (request not running yet)", ev->index,
                      n->cfg->id);
    } else if (q) {
        if (n == q->decode && ev->index >= 1)
            q->decode_started = true;
        if (n == q->prefill && ev->index == 0)
            q->prefilled = true;
        rt_req_token_event(r, q, ev);
    }
    protobuf_c_message_free_unpacked(&ev->base, NULL);
}

static void handle_finished(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__Finished *fin =
        (Tandem__V1__Finished *)tdm_frame_unpack(f, &tandem__v1__finished__descriptor);
    if (!fin)
        return;
    rt_req_t *q = event_request(r, n, fin->request_id, fin->attempt_id, false, true, "Finished");
    if (q && q->state != RT_RUNNING)
        tdm_log_write(&r->log, TDM_LOG_DEBUG, fin->request_id, NULL,
                      "ignoring Finished from %s (request not running yet)", n->cfg->id);
    else if (q)
        rt_req_finished(r, q, fin);
    protobuf_c_message_free_unpacked(&fin->base, NULL);
}

static void handle_task_failed(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__TaskFailed *tf =
        (Tandem__V1__TaskFailed *)tdm_frame_unpack(f, &tandem__v1__task_failed__descriptor);
    if (!tf)
        return;
    rt_req_t *q = event_request(r, n, tf->request_id, tf->attempt_id, true, true, "TaskFailed");
    if (q) {
        int status = tdm_proto_status_from_wire(tf->status);
        if (status == TDM_OK)
            status = TDM_EINTERNAL;
        char why[TDM_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s node '%s' failed: %s", role_name(n), n->cfg->id, tf->message);
        /* A prefill node ships the KV after its first token; a decode node fails a request
         * retryably before the KV is in its batch only when the transfer was rejected or
         * never came. */
        if (tf->retryable && !q->local_prefill && !q->decode_started &&
            ((n == q->prefill && q->prefilled) || (n == q->decode && q->state == RT_RUNNING)))
            r->metrics.kv_transfer_failures++;
        if (tf->retryable)
            rt_redispatch(r, q, true, status, why);
        else
            rt_req_fail(r, q, status, true, "%s", why);
    }
    protobuf_c_message_free_unpacked(&tf->base, NULL);
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
            tdm_sock_reply_error(r->nodesock, f, TDM_ENOTFOUND,
                                 "this connection is not a registered node of this router; "
                                 "register again");
        else
            tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL,
                          "ignoring %s %s from a connection that is not a registered node",
                          tdm_net_kind_name(f->kind), tdm_net_method_name(f->method));
        return;
    }
    n->last_seen = tdm_time_now();
    if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_END) {
        if (f->method == TANDEM__V1__METHOD__METHOD_DECODE_RESERVE)
            reserve_reply(r, n, f);
        return;
    }
    switch (f->method) {
    case TANDEM__V1__METHOD__METHOD_TOKEN_EVENT: handle_token_event(r, n, f); break;
    case TANDEM__V1__METHOD__METHOD_FINISHED: handle_finished(r, n, f); break;
    case TANDEM__V1__METHOD__METHOD_TASK_FAILED: handle_task_failed(r, n, f); break;
    default:
        if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST)
            tdm_sock_reply_error(r->nodesock, f, TDM_ENOTFOUND,
                                 "method %s is not served on the node endpoint",
                                 tdm_net_method_name(f->method));
    }
}
