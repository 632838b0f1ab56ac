/* admit.c - admission control (admit.h): the per-node estimate and the check request.c makes
 * before a new request is queued or dispatched.
 *
 * A node's load is what the router itself gave it: its requests reserving or running there
 * (their output tokens still to come: max_tokens - tokens delivered), plus a share of the
 * router's queue (every queued request, divided among the decode nodes up, rounded up: the
 * queue is FIFO and drains to whichever node has room). The heartbeat's running + waiting
 * count is used instead when larger (requests the router no longer tracks, such as ones it
 * gave up on, still take slots there); those extra requests are taken to have as many tokens
 * to go as the mean of the tracked ones, or as the new request's max_tokens when none is
 * tracked.
 */
#include <math.h>

#include "admit.h"

rt_admit_estimate_t rt_admit_estimate(const rt_admit_load_t *l, uint32_t n_prompt,
                                      uint32_t max_tokens)
{
    rt_admit_estimate_t e = {false, 0, 0};
    double t = l->step_time_s;
    if (!(t > 0) || !isfinite(t))
        return e;
    e.measured = true;
    uint32_t slots = l->max_running ? l->max_running : 1;
    if (l->n_ahead >= slots) {
        double waves = (double)(l->n_ahead / slots);
        double mean_tokens = (double)l->tokens_ahead / (double)l->n_ahead;
        e.start_s = waves * mean_tokens * t;
    }
    uint32_t per_pass = l->max_batch_tokens ? l->max_batch_tokens : (n_prompt ? n_prompt : 1);
    double prefill = (double)((n_prompt + per_pass - 1) / per_pass) * t;
    e.finish_s = e.start_s + prefill + (double)max_tokens * t;
    return e;
}

static bool is_decode_up(const rt_node_t *n)
{
    return n->up && n->cfg->role == TDM_NODE_ROLE_DECODE;
}

/* Output tokens q may still produce. */
static uint64_t tokens_left(const rt_req_t *q)
{
    uint32_t max = q->sp.max_tokens > 0 ? (uint32_t)q->sp.max_tokens : 0;
    return max > q->next_index ? max - q->next_index : 0;
}

/* n's load (see the comment at the top) for the new request self, which is not counted.
 * n_up: decode nodes up (>= 1). */
static rt_admit_load_t node_load(const tdm_router_t *r, const rt_node_t *n, size_t n_up,
                                 const rt_req_t *self)
{
    rt_admit_load_t l = {n->step_time_s, n->max_running, n->max_batch_tokens, 0, 0};
    uint32_t n_queued = 0;
    uint64_t queued_tokens = 0;
    for (tdm_list_t *e = tdm_list_first(&r->requests); e; e = tdm_list_next(&r->requests, e)) {
        const rt_req_t *q = TDM_LIST_ENTRY(e, rt_req_t, all_link);
        if (q == self)
            continue;
        if (q->state == RT_QUEUED) {
            n_queued++;
            queued_tokens += tokens_left(q);
        } else if (q->decode == n) {
            l.n_ahead++;
            l.tokens_ahead += tokens_left(q);
        }
    }
    uint32_t share = (uint32_t)((n_queued + n_up - 1) / n_up);
    if (share) {
        l.n_ahead += share;
        l.tokens_ahead += queued_tokens / n_queued * share;
    }
    uint32_t reported = n->running + n->waiting;
    if (reported > l.n_ahead) {
        uint64_t mean = l.n_ahead ? l.tokens_ahead / l.n_ahead : tokens_left(self);
        l.tokens_ahead += (reported - l.n_ahead) * mean;
        l.n_ahead = reported;
    }
    return l;
}

bool rt_admit_ok(const tdm_router_t *r, const rt_req_t *q, uint64_t now_ms,
                 rt_admit_estimate_t *best)
{
    size_t n_up = 0;
    for (size_t i = 0; i < r->n_nodes; i++)
        n_up += is_decode_up(&r->nodes[i]);
    if (!n_up)
        return true;
    double left_s = q->deadline_ms > now_ms ? (double)(q->deadline_ms - now_ms) / 1000.0 : 0;
    uint32_t max_tokens = q->sp.max_tokens > 0 ? (uint32_t)q->sp.max_tokens : 0;
    bool have = false;
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *n = &r->nodes[i];
        if (!is_decode_up(n))
            continue;
        rt_admit_load_t l = node_load(r, n, n_up, q);
        rt_admit_estimate_t e = rt_admit_estimate(&l, q->n_prompt, max_tokens);
        if (!e.measured || e.finish_s <= left_s)
            return true;
        if (!have || e.finish_s < best->finish_s)
            *best = e;
        have = true;
    }
    return false;
}
