/* scheduler.c - where requests run (scheduler.h): the queue, decode node by free KV blocks,
 * prefill node by policy, the dispatch of a request (DecodeReserve, then PrefillTask), the
 * reservation's answer and re-dispatch. Nothing else writes a request's state.
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
 * node). Otherwise the node is chosen by rendezvous (highest random weight) hashing of
 * (key, node id) with XXH3 among the prefill nodes up, so requests that share a long system
 * prompt land on the same node without any history. Either choice falls back to least_loaded
 * when that node's queue exceeds twice the average of the other prefill nodes plus one
 * max_batch_tokens.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "embed.h"
#include "lifecycle.h"
#include "nodes.h"
#include "request.h"
#include "scheduler.h"
#include "stats.h"
#include "stream.h"

#define PREFIX_MAX_BLOCKS 1024u
#define PREFIX_TABLE_SIZE 65536u /* power of two */

int rt_sched_init(tdm_router_t *r)
{
    tdm_list_init(&r->queue);
    r->n_queued = 0;
    r->next_call = 1;
    r->prefix_keys = calloc(PREFIX_TABLE_SIZE, sizeof *r->prefix_keys);
    r->prefix_nodes = calloc(PREFIX_TABLE_SIZE, sizeof *r->prefix_nodes);
    if (!r->prefix_keys || !r->prefix_nodes)
        return TDM_ERESOURCE;
    r->prefix_mask = PREFIX_TABLE_SIZE - 1;
    return TDM_OK;
}

void rt_sched_fini(tdm_router_t *r)
{
    free(r->prefix_keys);
    free(r->prefix_nodes);
    r->prefix_keys = NULL;
    r->prefix_nodes = NULL;
}

/* ---- the queue ---- */

void rt_queue_push(tdm_router_t *r, rt_req_t *q, bool front)
{
    q->state = RT_QUEUED;
    if (front)
        tdm_list_push_front(&r->queue, &q->queue_link);
    else
        tdm_list_push_back(&r->queue, &q->queue_link);
    r->n_queued++;
}

void rt_queue_remove(tdm_router_t *r, rt_req_t *q)
{
    if (!tdm_list_is_linked(&q->queue_link))
        return;
    tdm_list_remove(&q->queue_link);
    r->n_queued--;
}

rt_req_t *rt_queue_first(const tdm_router_t *r)
{
    tdm_list_t *l = tdm_list_first(&r->queue);
    return l ? TDM_LIST_ENTRY(l, rt_req_t, queue_link) : NULL;
}

bool rt_queue_has_model(const tdm_router_t *r, const rt_model_t *m)
{
    for (tdm_list_t *l = tdm_list_first(&r->queue); l; l = tdm_list_next(&r->queue, l))
        if (TDM_LIST_ENTRY(l, rt_req_t, queue_link)->model == m)
            return true;
    return false;
}

/* ---- small helpers ---- */

/* A new dispatch attempt id (never 0, never repeated by this router instance). */
static uint64_t next_attempt(tdm_router_t *r)
{
    uint64_t a = r->next_attempt++;
    if (a == 0)
        a = r->next_attempt++;
    return a;
}

uint64_t rt_sched_next_attempt(tdm_router_t *r)
{
    return next_attempt(r);
}

/* Decode blocks the router believes free on n (heartbeat free + cached - reservations). */
static int64_t decode_room(const rt_node_t *n)
{
    return (int64_t)n->load.kv_blocks_free + n->load.kv_blocks_cached - n->reserved_pending -
           n->reserved_acked;
}

static uint64_t prefill_load(const rt_node_t *n)
{
    return n->load.queued_prefill_tokens + n->tokens_since_hb;
}

/* A prefill node of model m new work may go to (up and not suspect). */
static bool is_prefill_up(const rt_node_t *n, const rt_model_t *m)
{
    return rt_node_dispatchable(n) && n->cfg->role == TDM_NODE_ROLE_PREFILL && n->model == m;
}

static bool any_prefill_up(const tdm_router_t *r, const rt_model_t *m)
{
    for (size_t i = 0; i < r->n_nodes; i++)
        if (is_prefill_up(&r->nodes[i], m))
            return true;
    return false;
}

static bool any_decode_up(const tdm_router_t *r, const rt_model_t *m)
{
    for (size_t i = 0; i < r->n_nodes; i++)
        if (r->nodes[i].up && r->nodes[i].cfg->role == TDM_NODE_ROLE_DECODE &&
            r->nodes[i].model == m)
            return true;
    return false;
}

void rt_node_detach(rt_node_t *n, rt_req_t *q)
{
    for (size_t i = 0; i < n->n_pending; i++)
        if (n->pending[i].req == q)
            n->pending[i].req = NULL;
}

/* ---- NodeCancel, and the attempts nodes may still hold ---- */

static void send_cancel(tdm_router_t *r, rt_node_t *n, const char *id, uint64_t attempt, int status)
{
    Tandem__V1__NodeCancel c = TANDEM__V1__NODE_CANCEL__INIT;
    c.request_id = (char *)(uintptr_t)id;
    c.attempt_id = attempt;
    c.status = tdm_proto_status_to_wire(status);
    rt_node_notify(r, n, TANDEM__V1__METHOD__METHOD_NODE_CANCEL, &c.base);
}

/* Remembers that n may still hold `attempt` of request id although the router left it:
 * NodeCancel goes now when n is up (and again if n is marked down before it can have read
 * it), else when n is back (orphans_flush). The oldest entry goes when the list is full. */
static void orphan_add(tdm_router_t *r, rt_node_t *n, const char *id, uint64_t attempt)
{
    if (attempt == 0)
        return;
    if (n->n_orphans == RT_ORPHANS_MAX) {
        tdm_log_write(&r->log, TDM_LOG_WARN, n->orphans[0].id, NULL,
                      "node %s: forgetting attempt %016" PRIx64 " owed a NodeCancel (list full)",
                      n->cfg->id, n->orphans[0].attempt_id);
        memmove(&n->orphans[0], &n->orphans[1], (RT_ORPHANS_MAX - 1) * sizeof n->orphans[0]);
        n->n_orphans--;
    }
    rt_orphan_t *o = &n->orphans[n->n_orphans++];
    o->attempt_id = attempt;
    o->at = tdm_time_now();
    o->sent_epoch = RT_ORPHAN_UNSENT;
    snprintf(o->id, sizeof o->id, "%s", id);
    if (n->up) {
        send_cancel(r, n, o->id, attempt, TDM_ECANCELLED);
        o->sent_epoch = n->failures;
    }
}

/* Sends the NodeCancels owed to nodes that are up: those never sent (the node was down) and
 * those sent before the node was last marked down (lost with its connection). One that was
 * sent while the node stayed up for two heartbeat timeouts since has been read: forgotten. */
static void orphans_flush(tdm_router_t *r, double now)
{
    double keep_s = 2.0 * (double)r->hb_timeout_ms / 1000.0;
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        size_t kept = 0;
        for (size_t j = 0; n->up && j < n->n_orphans; j++) {
            rt_orphan_t o = n->orphans[j];
            if (o.sent_epoch != n->failures) {
                tdm_log_write(&r->log, TDM_LOG_INFO, o.id, NULL,
                              "NodeCancel of attempt %016" PRIx64 " to %s, back up", o.attempt_id,
                              n->cfg->id);
                send_cancel(r, n, o.id, o.attempt_id, TDM_ECANCELLED);
                o.sent_epoch = n->failures;
                o.at = now;
            } else if (now - o.at > keep_s) {
                continue;
            }
            n->orphans[kept++] = o;
        }
        if (n->up)
            n->n_orphans = kept;
    }
}

/* NodeCancel of q's attempt to n, or, n being down, owed until it is back. */
static void cancel_on(tdm_router_t *r, rt_node_t *n, const rt_req_t *q, int status)
{
    if (n->up)
        send_cancel(r, n, q->id, q->attempt_id, status);
    else
        orphan_add(r, n, q->id, q->attempt_id);
}

void rt_release_nodes(tdm_router_t *r, rt_req_t *q, int status)
{
    if (q->prefill)
        cancel_on(r, q->prefill, q, status);
    if (q->decode) {
        cancel_on(r, q->decode, q, status);
        rt_node_detach(q->decode, q);
    }
    q->prefill = q->decode = NULL;
    q->attempt_id = 0; /* over: anything still in flight for it is stale */
}

/* ---- prefill policies ---- */

static rt_node_t *pick_round_robin(tdm_router_t *r, const rt_model_t *m)
{
    for (size_t k = 0; k < r->n_nodes; k++) {
        size_t i = (r->rr_next + k) % r->n_nodes;
        rt_node_t *n = &r->nodes[i];
        if (is_prefill_up(n, m)) {
            r->rr_next = i + 1;
            return n;
        }
    }
    return NULL;
}

static rt_node_t *pick_least_loaded(tdm_router_t *r, const rt_model_t *m)
{
    rt_node_t *best = NULL;
    size_t best_k = 0;
    /* ties go to the first node after the round robin cursor, so equal nodes share work */
    for (size_t k = 0; k < r->n_nodes; k++) {
        rt_node_t *n = &r->nodes[(r->rr_next + k) % r->n_nodes];
        if (!is_prefill_up(n, m))
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
        if (m != n && is_prefill_up(m, n->model)) {
            sum += prefill_load(m);
            cnt++;
        }
    }
    uint64_t mbt = n->max_batch_tokens ? n->max_batch_tokens : (uint64_t)n->cfg->max_batch_tokens;
    return cnt > 0 && prefill_load(n) * cnt > 2 * sum + mbt * cnt;
}

/* The prefill node up that last got the deepest of hashes[key_blocks - 1 .. nb - 1], or NULL. */
static rt_node_t *prefix_known(tdm_router_t *r, const rt_model_t *m, const uint64_t *hashes,
                               uint32_t nb, uint32_t key_blocks)
{
    for (uint32_t i = nb; i-- > key_blocks - 1;) {
        size_t slot = (size_t)hashes[i] & r->prefix_mask;
        if (r->prefix_keys[slot] == hashes[i] && r->prefix_nodes[slot]) {
            rt_node_t *n = &r->nodes[r->prefix_nodes[slot] - 1];
            if (is_prefill_up(n, m))
                return n;
        }
    }
    return NULL;
}

/* Rendezvous hashing: the prefill node up with the highest XXH3(node id, seed key), or NULL. */
static rt_node_t *prefix_rendezvous(tdm_router_t *r, const rt_model_t *m, uint64_t key)
{
    rt_node_t *pick = NULL;
    uint64_t best_w = 0;
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        if (!is_prefill_up(n, m))
            continue;
        uint64_t w = XXH3_64bits_withSeed(n->cfg->id, strlen(n->cfg->id), key);
        if (!pick || w > best_w) {
            pick = n;
            best_w = w;
        }
    }
    return pick;
}

static rt_node_t *pick_prefix_aware(tdm_router_t *r, const rt_req_t *q)
{
    uint32_t bs = r->block_size;
    uint32_t nb = q->n_prompt / bs;
    if (nb > PREFIX_MAX_BLOCKS)
        nb = PREFIX_MAX_BLOCKS;
    if (nb == 0)
        return pick_least_loaded(r, q->model);
    uint64_t hashes[PREFIX_MAX_BLOCKS];
    /* per model: the same token ids of two models are different prompts (their table
     * entries never match the other model's) */
    uint64_t parent = TDM_KV_HASH_SEED ^ (uint64_t)q->model->index;
    for (uint32_t i = 0; i < nb; i++)
        parent = hashes[i] = tdm_kv_block_hash(parent, q->prompt + (size_t)i * bs, bs);
    /* a shared first block or two (a chat template's header) says little: history counts
     * only when it matches at least the key's blocks */
    uint32_t key_blocks = nb < TDM_ROUTER_PREFIX_KEY_BLOCKS ? nb : TDM_ROUTER_PREFIX_KEY_BLOCKS;
    rt_node_t *pick = prefix_known(r, q->model, hashes, nb, key_blocks);
    if (!pick)
        pick = prefix_rendezvous(r, q->model, hashes[key_blocks - 1]);
    if (pick && overloaded(r, pick)) {
        tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, NULL,
                      "prefix_aware: node %s is over the load bound; least_loaded instead",
                      pick->cfg->id);
        pick = pick_least_loaded(r, q->model);
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
    case TDM_PREFILL_POLICY_LEAST_LOADED: return pick_least_loaded(r, q->model);
    case TDM_PREFILL_POLICY_PREFIX_AWARE: return pick_prefix_aware(r, q);
    case TDM_PREFILL_POLICY_ROUND_ROBIN:
    default: return pick_round_robin(r, q->model);
    }
}

/* ---- dispatch ---- */

/* Whether q is to stay off n, which did not answer one of its reservations in time: while
 * another decode node takes work (up, not suspect) that has not done so, a stalled node is
 * not chosen again, so that it cannot use up q's re-dispatches. */
static bool avoided(const tdm_router_t *r, const rt_req_t *q, const rt_node_t *n)
{
    if (!q->timed_out[n->index])
        return false;
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *o = &r->nodes[i];
        if (o->cfg->role == TDM_NODE_ROLE_DECODE && o->model == q->model && !q->timed_out[i] &&
            rt_node_dispatchable(o))
            return true;
    }
    return false;
}

/* The decode node up, not suspect, not avoided, with room for need blocks and the most of it
 * that q has not tried this round, or NULL. *any_up: some decode node is up (suspect ones
 * too: q waits for them); *max_total: the largest one's blocks. */
/* Blocks a sequence of n_tokens tokens takes on decode node n: ceil(n_tokens / block_size), or
 * on a node that allocates per layer group the groups' most at once while it decodes
 * (tdm_kv_groups_blocks_per_seq, in blocks of one group's layers). */
static uint32_t node_blocks(const tdm_router_t *r, const rt_node_t *n, uint32_t n_tokens)
{
    if (n->kv_grouped)
        return (uint32_t)tdm_kv_groups_blocks_per_seq(&n->model->kv_groups, r->block_size,
                                                      n_tokens);
    return (n_tokens + r->block_size - 1) / r->block_size;
}

/* The decode node with the most room for n_tokens tokens; *any_up: a decode node is up; *need,
 * *max_total: the blocks they take on the largest node up and its kv_blocks_total (0: none
 * up). */
static rt_node_t *pick_decode(tdm_router_t *r, const rt_req_t *q, uint32_t n_tokens, bool *any_up,
                              uint32_t *need, uint32_t *max_total)
{
    rt_node_t *best = NULL;
    *any_up = false;
    *max_total = *need = 0;
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        if (!n->up || n->cfg->role != TDM_NODE_ROLE_DECODE || n->model != q->model)
            continue;
        *any_up = true;
        uint32_t nn = node_blocks(r, n, n_tokens);
        if (n->kv_blocks_total > *max_total || (n->kv_blocks_total == *max_total && nn < *need)) {
            *max_total = n->kv_blocks_total;
            *need = nn;
        }
        if (q->tried[i] || !rt_node_dispatchable(n) || decode_room(n) < (int64_t)nn ||
            avoided(r, q, n))
            continue;
        if (!best || decode_room(n) > decode_room(best))
            best = n;
    }
    return best;
}

/* Room for one more pending reservation on n. Returns false on out of memory. */
static bool pending_room(rt_node_t *n)
{
    if (n->n_pending < n->cap_pending)
        return true;
    size_t cap = n->cap_pending ? n->cap_pending * 2 : 16;
    rt_pending_t *p = realloc(n->pending, cap * sizeof *p);
    if (!p)
        return false;
    n->pending = p;
    n->cap_pending = cap;
    return true;
}

/* The router's wait for n's answer to a DecodeReserve, in ms: the heartbeat timeout (a node
 * silent that long is down anyway) plus two of its forward passes as its heartbeats report
 * them (the engine thread answers between passes, so a node busy with long ones is not taken
 * for a stalled one). */
static uint64_t reserve_timeout_ms(const tdm_router_t *r, const rt_node_t *n)
{
    double step_ms = n->load.step_s > 0 && n->load.step_s < 600 ? n->load.step_s * 1000.0 : 0;
    return r->hb_timeout_ms + (uint64_t)(2.0 * step_ms);
}

/* q's constraint as the nodes get it in *c (kind GRAMMAR, the compiled text, its hash), or
 * NULL for free text. c's strings point into q. */
static Tandem__V1__Constraint *constraint_of(const rt_req_t *q, Tandem__V1__Constraint *c)
{
    if (!q->gbnf)
        return NULL;
    tandem__v1__constraint__init(c);
    c->kind = TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_GRAMMAR;
    c->text = q->gbnf;
    c->hash = q->gbnf_hash;
    return c;
}

/* Attempt `attempt` of q as the nodes get it in *spec: the one SequenceSpec its DecodeReserve
 * and its PrefillTask both carry (the same fields from the same function, so the two nodes
 * see one request). n_output: the output tokens the attempt resumes after (q->next_index when
 * it is reserved, which stays its q->resume_index). spec's pointers point into q, *sp and *c,
 * filled here. Cannot fail. */
static void spec_of(const rt_req_t *q, uint64_t attempt, uint32_t n_output,
                    tdm_proto_sampling_t *sp, Tandem__V1__Constraint *c,
                    Tandem__V1__SequenceSpec *spec)
{
    tdm_proto_sampling_to(&q->sp, sp);
    tandem__v1__sequence_spec__init(spec);
    spec->request_id = (char *)q->id;
    spec->attempt_id = attempt;
    spec->n_prompt_tokens = q->n_prompt;
    spec->prompt_tokens = q->prompt;
    spec->n_output_tokens = n_output; /* a migrated request resumes after them */
    spec->output_tokens = n_output ? q->output : NULL;
    spec->sampling = &sp->m;
    spec->max_tokens = q->sp.max_tokens;
    spec->constraint = constraint_of(q, c);
    spec->deadline_unix_ms = q->deadline_ms;
    if (q->want_plp && n_output == 0 && !q->plp_sent) /* once, from the prefill pass */
        spec->prompt_logprobs = (Tandem__V1__PromptLogprobsAsk *)&q->plp_ask;
}

static void send_prefill_task(tdm_router_t *r, rt_req_t *q, rt_node_t *p);

/* q is RESERVING on n under attempt (DecodeReserve call `call`, need blocks). */
static void attempt_begin(rt_req_t *q, rt_node_t *n, uint64_t attempt, uint64_t call, uint32_t need,
                          bool local, uint64_t fork_of)
{
    q->attempt_id = attempt;
    q->resume_index = q->next_index;
    q->kv_transfer_s = 0; /* measured again for this attempt */
    q->decode = n;
    q->prefill = NULL;
    q->state = RT_RESERVING;
    q->local_prefill = local;
    q->fork = fork_of != 0;
    q->n_blocks = need;
    q->reserve_call = call;
}

/* Sends DecodeReserve for q (need blocks) to n under a new attempt; fork_of: the attempt of
 * choice 0 whose sequence on n q forks (no prefill: the decode node makes q's first token, as
 * for a local prefill), 0 for none. Returns RT_DISPATCH_SENT (q is RESERVING on n),
 * RT_DISPATCH_WAIT when it could not be sent (try another node), RT_DISPATCH_FAILED with *err
 * on out of memory. */
static rt_dispatch_result_t reserve_on(tdm_router_t *r, rt_req_t *q, rt_node_t *n, uint32_t need,
                                       uint64_t fork_of, tdm_error_t *err)
{
    bool local = fork_of || !any_prefill_up(r, q->model);
    uint64_t attempt = next_attempt(r);
    tdm_proto_sampling_t sp;
    Tandem__V1__Constraint c;
    Tandem__V1__SequenceSpec spec;
    spec_of(q, attempt, q->next_index, &sp, &c, &spec);
    Tandem__V1__DecodeReserve m = TANDEM__V1__DECODE_RESERVE__INIT;
    m.spec = &spec;
    m.local_prefill = local && !fork_of;
    m.fork_of = fork_of;
    m.speculative = q->no_speculation ? TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF
                                      : TANDEM__V1__SPECULATIVE__SPECULATIVE_AUTO;
    if (!pending_room(n)) {
        tdm_error_set(err, TDM_ERESOURCE, "router out of memory");
        return RT_DISPATCH_FAILED;
    }
    uint64_t call = r->next_call++;
    tdm_send_t s = {0};
    s.peer = n->peer;
    s.peer_len = n->peer_len;
    s.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    s.method = TANDEM__V1__METHOD__METHOD_DECODE_RESERVE;
    s.call_id = call;
    /* The request's deadline, not the router's shorter wait for the answer: the frame's deadline
     * is wall-clock time judged on the node, and a node whose clock runs a few seconds ahead
     * would refuse every reservation. A reservation the router gave up on is freed by the
     * NodeCancel its late answer (or the node's next registration) brings instead. */
    s.deadline_unix_ms = q->deadline_ms;
    s.body = &m.base;
    int rc = tdm_sock_send(r->nodesock, &s);
    if (rc != TDM_OK) {
        tdm_log_write(&r->log, TDM_LOG_WARN, q->id, NULL,
                      "DecodeReserve to %s could not be sent (%s); trying another node", n->cfg->id,
                      tdm_strerror(rc));
        return RT_DISPATCH_WAIT;
    }
    n->pending[n->n_pending++] = (rt_pending_t){call, need, q, attempt, tdm_time_now()};
    n->reserved_pending += need;
    attempt_begin(q, n, attempt, call, need, local, fork_of);
    /* The prefill starts now, not after the reservation's answer: the decode node needs
     * nothing from it before the KV transfer, which it holds while the reservation is
     * undecided (docs/protocol.md "Reserve"). A refused reservation cancels it
     * (rt_sched_reserve_end). With no prefill node to pick, the answer's handler tries again. */
    rt_node_t *p = local ? NULL : pick_prefill(r, q);
    if (p)
        send_prefill_task(r, q, p);
    char kv[200];
    snprintf(kv, sizeof kv,
             "decode=%s prefill=%s blocks=%" PRIu32 " local_prefill=%s attempt=%016" PRIx64
             " fork_of=%016" PRIx64,
             n->cfg->id, p ? p->cfg->id : "-", need, local ? "true" : "false", attempt, fork_of);
    tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, kv, "reserve sent");
    return RT_DISPATCH_SENT;
}

/* A choice > 0 of n > 1 that has not run yet: a fork of choice 0's sequence on choice 0's
 * decode node while choice 0 holds its first attempt there (reserving or running). Returns
 * reserve_on's result, RT_DISPATCH_WAIT when q cannot fork (dispatched on its own then). */
static rt_dispatch_result_t dispatch_fork(tdm_router_t *r, rt_req_t *q, tdm_error_t *err)
{
    const rt_req_t *p = q->group->kids[0];
    if (q->no_fork || q->next_index > 0 || !p || !p->decode || p->state == RT_QUEUED ||
        p->resume_index > 0 || p->redispatches > 0 || p->fork || !rt_node_dispatchable(p->decode) ||
        q->tried[p->decode->index])
        return RT_DISPATCH_WAIT;
    /* its own blocks: the one holding the last prompt position, and the output after it (a
     * node allocating per layer group: a sequence's, since a window group may share none) */
    uint32_t need = p->decode->kv_grouped ? node_blocks(r, p->decode, q->n_prompt + 1)
                                          : (q->n_prompt + 1 + r->block_size - 1) / r->block_size -
                                                (q->n_prompt - 1) / r->block_size;
    rt_dispatch_result_t res = reserve_on(r, q, p->decode, need, p->attempt_id, err);
    if (res == RT_DISPATCH_WAIT)
        q->no_fork = true;
    return res;
}

rt_dispatch_result_t rt_dispatch(tdm_router_t *r, rt_req_t *q, tdm_error_t *err)
{
    if (q->group && q->choice > 0) {
        rt_dispatch_result_t res = dispatch_fork(r, q, err);
        if (res != RT_DISPATCH_WAIT)
            return res;
    }
    /* the prompt, the output delivered (a migrated request resumes after it) and the next
     * output token */
    uint32_t n_tokens = q->n_prompt + q->next_index + 1;
    for (;;) {
        bool any_up;
        uint32_t need, max_total;
        rt_node_t *best = pick_decode(r, q, n_tokens, &any_up, &need, &max_total);
        if (!best) {
            if (!any_up || need <= max_total)
                return RT_DISPATCH_WAIT;
            tdm_error_set(err, TDM_ERESOURCE,
                          "the prompt%s needs %" PRIu32
                          " KV blocks; the largest decode node up has %" PRIu32,
                          q->next_index ? " and the output delivered" : "", need, max_total);
            return RT_DISPATCH_FAILED;
        }
        rt_dispatch_result_t res = reserve_on(r, q, best, node_blocks(r, best, n_tokens), 0, err);
        if (res != RT_DISPATCH_WAIT)
            return res;
        q->tried[best->index] = true;
    }
}

rt_dispatch_result_t rt_dispatch_or_queue(tdm_router_t *r, rt_req_t *q, bool requeued)
{
    tdm_error_t err = {0};
    rt_dispatch_result_t res = rt_dispatch(r, q, &err);
    if (res == RT_DISPATCH_WAIT) {
        if (requeued)
            memset(q->tried, 0, r->n_nodes * sizeof *q->tried);
        rt_queue_push(r, q, requeued);
    } else if (res == RT_DISPATCH_FAILED) {
        rt_req_fail(r, q, err.code, false, "%s", err.msg);
    }
    return res;
}

void rt_drain_queue(tdm_router_t *r)
{
    orphans_flush(r, tdm_time_now());
    /* FIFO per model: the first request of a model that must wait holds back that model's
     * later ones (it went back to the front), not those of the other models */
    bool blocked[TDM_CONFIG_MAX_MODELS] = {false};
    size_t n_blocked = 0;
    tdm_list_t *pos, *tmp;
restart:
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->queue)
    {
        if (n_blocked == r->n_models)
            return;
        rt_req_t *q = TDM_LIST_ENTRY(pos, rt_req_t, queue_link);
        if (blocked[q->model->index])
            continue;
        uint64_t frees = r->sibling_frees;
        rt_queue_remove(r, q);
        memset(q->tried, 0, r->n_nodes * sizeof *q->tried);
        if (rt_dispatch_or_queue(r, q, true) == RT_DISPATCH_WAIT) {
            blocked[q->model->index] = true;
            n_blocked++;
        }
        if (r->sibling_frees != frees)
            goto restart; /* siblings went with it: tmp may be gone */
    }
}

/* rt_redispatch, not on `avoid` (NULL: any node) in its first round. */
static bool redispatch_avoiding(tdm_router_t *r, rt_req_t *q, bool count, int status,
                                const char *why, const rt_node_t *avoid)
{
    if (rt_stream_end_delivered(r, q))
        return true; /* its node was lost after its last token: nothing is left to run */
    if (count) {
        if (q->redispatches >= TDM_ROUTER_MAX_REDISPATCH) {
            rt_req_fail(r, q, status, true, "%s (gave up after %d re-dispatches)", why,
                        TDM_ROUTER_MAX_REDISPATCH);
            return true;
        }
        q->redispatches++;
    }
    r->metrics.redispatches++;
    if (q->next_index > 0) {
        /* migration: the next attempt prefills prompt + the output delivered and resumes at
         * output index next_index (the seed's draw for that index is the undisturbed run's) */
        r->metrics.migrations++;
        tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                      "re-dispatching: %s; resuming at output index %" PRIu32, why, q->next_index);
    } else {
        tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL, "re-dispatching: %s", why);
    }
    rt_release_nodes(r, q, TDM_ECANCELLED);
    if (q->fork) { /* its sibling is gone or could not be forked: it runs on its own now */
        q->fork = false;
        q->no_fork = true;
    }
    q->n_buf = 0;
    q->finished = false;
    q->decode_started = false;
    q->prefilled = false;
    q->state = RT_QUEUED;
    memset(q->tried, 0, r->n_nodes * sizeof *q->tried);
    if (avoid)
        q->tried[avoid->index] = true;
    tdm_error_t err = {0};
    rt_dispatch_result_t res = rt_dispatch(r, q, &err);
    if (res == RT_DISPATCH_WAIT && q->t_dispatch > 0 && !any_decode_up(r, q->model)) {
        /* it ran and lost its node, and none is left to run it again: the queue is for
         * waiting for room, not for a cluster without decode nodes */
        rt_req_fail(r, q, TDM_EUNAVAILABLE, false, "%s; no decode node is up to run it again", why);
        return true;
    }
    if (res == RT_DISPATCH_WAIT) {
        memset(q->tried, 0, r->n_nodes * sizeof *q->tried);
        rt_queue_push(r, q, true); /* it was admitted before: no queue limit */
        return false;
    }
    if (res == RT_DISPATCH_FAILED) {
        rt_req_fail(r, q, err.code, false, "%s", err.msg);
        return true;
    }
    return false;
}

bool rt_redispatch(tdm_router_t *r, rt_req_t *q, bool count, int status, const char *why)
{
    return redispatch_avoiding(r, q, count, status, why, NULL);
}

/* ---- the reservation's answer ---- */

/* Sends q's PrefillTask to p. */
static void send_prefill_task(tdm_router_t *r, rt_req_t *q, rt_node_t *p)
{
    tdm_proto_sampling_t sp;
    Tandem__V1__Constraint c;
    Tandem__V1__SequenceSpec spec;
    spec_of(q, q->attempt_id, q->resume_index, &sp, &c, &spec);
    Tandem__V1__PrefillTask t = TANDEM__V1__PREFILL_TASK__INIT;
    t.spec = &spec;
    t.decode_node_id = (char *)q->decode->cfg->id;
    t.decode_kv_endpoint = q->decode->kv_endpoint ? q->decode->kv_endpoint : (char *)"";
    t.kv_transport = (char *)tdm_kv_backend_name(rt_transport_choose(&p->place, &q->decode->place));
    rt_node_notify(r, p, TANDEM__V1__METHOD__METHOD_PREFILL_TASK, &t.base);
    q->prefill = p;
    p->tokens_since_hb += q->n_prompt + q->resume_index;
}

/* The reservation was acknowledged: the prefill sent with the reservation goes on (or the
 * decode node prefills locally); one that could not be sent then is sent now. */
static void reserve_acked(tdm_router_t *r, rt_req_t *q)
{
    double now = tdm_time_now();
    q->state = RT_RUNNING;
    if (!q->local_prefill && !q->prefill) {
        rt_node_t *p = pick_prefill(r, q);
        if (!p) {
            rt_redispatch(r, q, false, TDM_EUNAVAILABLE,
                          "no prefill node up any more; the decode node prefills locally");
            return;
        }
        send_prefill_task(r, q, p);
    }
    if (q->t_dispatch == 0) {
        rt_hist_observe(&r->metrics.queue, now - q->t_arrival);
        rt_hist_observe(&q->model->metrics.queue, now - q->t_arrival);
    }
    q->t_dispatch = now;
    char kv[200];
    snprintf(kv, sizeof kv, "decode=%s prefill=%s", q->decode->cfg->id,
             q->prefill ? q->prefill->cfg->id : "local");
    tdm_log_write(&r->log, TDM_LOG_DEBUG, q->id, kv, "dispatched");
}

/* Takes the pending reservation of call_id off n into *p (its blocks no longer pending).
 * Returns false when n has none with that call id. */
static bool take_pending(rt_node_t *n, uint64_t call_id, rt_pending_t *p)
{
    size_t i = 0;
    while (i < n->n_pending && n->pending[i].call_id != call_id)
        i++;
    if (i == n->n_pending)
        return false;
    *p = n->pending[i];
    n->pending[i] = n->pending[--n->n_pending];
    n->reserved_pending -= p->n_blocks < n->reserved_pending ? p->n_blocks : n->reserved_pending;
    return true;
}

/* DecodeReserve answered OK for p (its request may be gone: p->req NULL). */
static void reserve_ok(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f, const rt_pending_t *p)
{
    rt_req_t *q = p->req;
    uint32_t blocks = p->n_blocks;
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
}

/* n refused q's reservation for room (RESOURCE_EXHAUSTED) or for now (UNAVAILABLE): another
 * decode node, else the queue's front. */
static void reserve_refused(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f, rt_req_t *q)
{
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                  "decode node %s refused the reservation (%s: %s); trying another", n->cfg->id,
                  tdm_status_name(f->status), f->message);
    q->tried[n->index] = true;
    if (rt_dispatch_or_queue(r, q, true) == RT_DISPATCH_WAIT)
        tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                      "queued: no decode node has room (%zu waiting)", r->n_queued);
}

/* An answer to a reservation the router gave up on (rt_sched_check_reserves): blocks granted
 * for that attempt are released. */
static void reserve_late(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL,
                  "reserve reply for unknown call %" PRIu64 " from %s", f->call_id, n->cfg->id);
    if (f->status != TDM_OK)
        return;
    Tandem__V1__ReserveAck *ack =
        (Tandem__V1__ReserveAck *)tdm_frame_unpack(f, &tandem__v1__reserve_ack__descriptor);
    if (!ack)
        return;
    if (ack->attempt_id) {
        tdm_log_write(&r->log, TDM_LOG_INFO, ack->request_id, NULL,
                      "late reservation of attempt %016" PRIx64 " on %s released", ack->attempt_id,
                      n->cfg->id);
        send_cancel(r, n, ack->request_id, ack->attempt_id, TDM_ECANCELLED);
    }
    protobuf_c_message_free_unpacked(&ack->base, NULL);
}

/* The status a request fails with when a node reported `status` for it: the router validated
 * the request, so a node refusing it (INVALID_ARGUMENT, NOT_FOUND, FAILED_PRECONDITION,
 * UNAUTHENTICATED, ...) is the cluster's fault (INTERNAL, HTTP 500), never the client's;
 * the statuses the status table marks server_fault (UNAVAILABLE, RESOURCE_EXHAUSTED,
 * DEADLINE_EXCEEDED, CANCELLED, INTERNAL) stay. */
static int server_fault(int status)
{
    return tdm_status_info(status)->server_fault ? status : TDM_EINTERNAL;
}

/* q's reservation was refused while its prefill ran (the PrefillTask goes with the
 * DecodeReserve): the prefill node gets NodeCancel of the attempt (it drops the task, or
 * withdraws its KV transfer, which the decode node also drops when it refused the
 * reservation first), and the attempt's progress is reset. A first token the prefill node
 * sent meanwhile was delivered and stays so: the next attempt resumes after it, as a
 * migration does. Returns true when the output delivered already ends q (completed and
 * freed, rt_stream_end_delivered). */
static bool refused_prefill_withdraw(tdm_router_t *r, rt_req_t *q)
{
    if (q->prefill)
        cancel_on(r, q->prefill, q, TDM_ECANCELLED);
    q->prefill = NULL;
    q->attempt_id = 0; /* over: its first token or TaskFailed, if still in flight, is stale */
    q->n_buf = 0;
    q->finished = false;
    q->decode_started = false;
    q->prefilled = false;
    return q->next_index > 0 && rt_stream_end_delivered(r, q);
}

void rt_sched_reserve_end(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    rt_pending_t p;
    if (!take_pending(n, f->call_id, &p)) {
        reserve_late(r, n, f);
        return;
    }
    rt_hist_observe(&r->metrics.reserve, tdm_time_now() - p.sent_at);
    if (f->status == TDM_OK) {
        reserve_ok(r, n, f, &p);
        return;
    }
    rt_req_t *q = p.req;
    if (!q)
        return;
    q->decode = NULL;
    q->state = RT_QUEUED;
    if (!q->fork && f->status == TDM_ERESOURCE) {
        r->metrics.reserve_rejects++;
        n->load.kv_blocks_free = n->load.kv_blocks_cached =
            0; /* until its next heartbeat says otherwise */
    }
    if (refused_prefill_withdraw(r, q))
        return;
    if (q->fork) { /* the decode node could not fork it: it runs on its own */
        q->fork = false;
        q->no_fork = true;
        q->tried[n->index] = false; /* which does not rule n out */
        rt_dispatch_or_queue(r, q, true);
        return;
    }
    if (tdm_status_info(f->status)->retryable)
        reserve_refused(r, n, f, q);
    else
        rt_req_fail(r, q, server_fault(f->status), true,
                    "decode node '%s' refused the request (%s): %s", n->cfg->id,
                    tdm_status_name(f->status), f->message);
}

/* n did not answer p's reservation within the reservation timeout (paused, cut off, or the
 * answer was lost): its blocks are owed a NodeCancel, and the request retries under a new
 * attempt, on another decode node when one has room. */
static void reserve_timed_out(tdm_router_t *r, rt_node_t *n, const rt_pending_t *p)
{
    rt_req_t *q = p->req;
    orphan_add(r, n, q ? q->id : "", p->attempt_id);
    if (!q)
        return; /* the request went away meanwhile */
    char why[TDM_ERRMSG_MAX];
    snprintf(why, sizeof why,
             "decode node '%s' did not answer the reservation within %" PRIu64 " ms", n->cfg->id,
             reserve_timeout_ms(r, n));
    q->decode = NULL; /* NodeCancel sent (or owed) above */
    q->timed_out[n->index] = true;
    redispatch_avoiding(r, q, true, TDM_EUNAVAILABLE, why, n);
}

void rt_sched_check_reserves(tdm_router_t *r, double now)
{
    for (size_t i = 0; i < r->n_nodes; i++) {
        rt_node_t *n = &r->nodes[i];
        double timeout_s = (double)reserve_timeout_ms(r, n) / 1000.0;
        size_t j = 0;
        while (j < n->n_pending) {
            rt_pending_t p;
            if (now - n->pending[j].sent_at <= timeout_s ||
                !take_pending(n, n->pending[j].call_id, &p)) {
                j++;
                continue;
            }
            reserve_timed_out(r, n, &p); /* take_pending moved another entry into j */
        }
    }
}

/* ---- failures ---- */

void rt_sched_task_failed(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__TaskFailed *tf =
        (Tandem__V1__TaskFailed *)tdm_frame_unpack(f, &tandem__v1__task_failed__descriptor);
    if (!tf)
        return;
    if (rt_embed_task_failed(r, n, tf)) { /* an embedding's (embed.c) */
        protobuf_c_message_free_unpacked(&tf->base, NULL);
        return;
    }
    rt_req_t *q = rt_req_for_event(r, n, tf->request_id, tf->attempt_id, true, true, "TaskFailed");
    if (q) {
        /* request_fault: the request's own constraints left no token; its INVALID_ARGUMENT is
         * the client's (400), not the cluster's */
        int status = tdm_proto_status_from_wire(tf->status);
        if (!(tf->request_fault && status == TDM_EINVALID))
            status = server_fault(status);
        char why[TDM_ERRMSG_MAX];
        snprintf(why, sizeof why, "%s node '%s' failed: %s",
                 tdm_config_node_role_name(n->cfg->role), n->cfg->id, tf->message);
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

/* The last decode node up of its model, n, is down: requests of that model that ran before and wait
 * in the queue to run again (their transfer failed with n's connection before n was seen down) fail
 * as n's own requests do; requests never dispatched keep waiting for a decode node. */
static void fail_rerun_waiting(tdm_router_t *r, const rt_node_t *n, const char *reason)
{
    tdm_list_t *pos, *tmp;
restart:
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->queue)
    {
        rt_req_t *q = TDM_LIST_ENTRY(pos, rt_req_t, queue_link);
        uint64_t frees = r->sibling_frees;
        if (q->t_dispatch > 0 && q->model == n->model)
            rt_req_fail(r, q, TDM_EUNAVAILABLE, true,
                        "decode node '%s' is down (%s); no decode node is up to run the request "
                        "again",
                        n->cfg->id, reason);
        if (r->sibling_frees != frees)
            goto restart; /* siblings went with it: tmp may be gone (a failed one is) */
    }
}

void rt_sched_node_down(tdm_router_t *r, rt_node_t *n, const char *reason)
{
    char why[256];
    for (size_t i = 0; i < n->n_pending; i++)
        if (!n->pending[i].req) /* gone while reserving: its NodeCancel may not have arrived */
            orphan_add(r, n, "", n->pending[i].attempt_id);
    n->n_pending = 0; /* the answers will not come */
    n->reserved_pending = n->reserved_acked = 0;
    n->tokens_since_hb = 0;
    tdm_list_t *pos, *tmp;
    /* a re-dispatch or a failure frees its own request, and the siblings of a failed choice
     * of n > 1: then the walk starts again (what was handled no longer matches) */
restart:
    TDM_LIST_FOR_EACH_SAFE(pos, tmp, &r->requests)
    {
        rt_req_t *q = TDM_LIST_ENTRY(pos, rt_req_t, all_link);
        uint64_t frees = r->sibling_frees;
        if (q->decode == n && q->state == RT_RESERVING) {
            snprintf(why, sizeof why, "decode node '%s' is down (%s) while reserving", n->cfg->id,
                     reason);
            rt_redispatch(r, q, true, TDM_EUNAVAILABLE, why);
        } else if (q->decode == n) {
            /* migration: prompt + the output delivered go to another pair, and the stream
             * resumes at the next index (UNAVAILABLE when no decode node is left, or past the
             * re-dispatch budget) */
            snprintf(why, sizeof why, "decode node '%s' is down (%s)", n->cfg->id, reason);
            rt_redispatch(r, q, true, TDM_EUNAVAILABLE, why);
        } else if (q->prefill == n && !q->decode_started) {
            /* its decode node never got the KV (no token from it yet): start over */
            snprintf(why, sizeof why, "prefill node '%s' is down (%s)", n->cfg->id, reason);
            rt_redispatch(r, q, true, TDM_EUNAVAILABLE, why);
        } else if (q->prefill == n) {
            q->prefill = NULL; /* the KV already reached the decode node */
        }
        if (r->sibling_frees != frees)
            goto restart;
    }
    if (n->cfg->role == TDM_NODE_ROLE_DECODE && !any_decode_up(r, n->model))
        fail_rerun_waiting(r, n, reason);
}
