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
 *
 * The step times are the nodes' decode passes (NodeLoad.decode_step_s and
 * decode_batch_size: a pass of decode rows only); a node that prefills its own prompts also
 * runs passes of whole prompts, which are not what its decode tokens cost (taking them for
 * decode passes refused 55 of 64 requests of a 32-client load on a colocated node, each
 * estimated at ~530 s for 64 tokens). A node that has reported no decode pass is not measured.
 *
 * A pass gets longer as the batch grows (on a CPU, nearly in proportion; on a GPU, much less),
 * so the estimate does not take the step time a node reports now for the batch a burst will
 * make: each heartbeat's (batch size, step time) goes into a weighted least-squares line per
 * node (rt_admit_observe), and the estimate reads the pass time at the batch the request
 * would join from it. Until a node has run batches of different sizes, each sequence a pass
 * holds beyond its observed batch is taken to add RT_ADMIT_PRIOR_SLOPE (0.35) of the
 * observed pass time: cautious (with the register-blocked kernels a batch-32 pass on the
 * 2-vCPU machine of issue 16 is ~11x a batch-1 pass, a slope of ~0.31; before them ~0.14),
 * so a first burst on an idle node is shed rather
 * than admitted to time out, yet a loaded machine is not refused work it can finish; the
 * batches it then runs give the line its measured slope.
 */
#include <math.h>

#include "admit.h"

#define RT_ADMIT_PRIOR_SLOPE 0.35 /* per-sequence share of a pass before a slope is measured */
/* A request is admitted when its estimated finish, times this, is within its deadline: the
 * estimate extrapolates recent passes to the batch a burst makes, and on a shared machine
 * passes run 10-20 % slower than the line says at times (a burst admitted to the estimate's
 * last millisecond then times out at 27 of 32 tokens). */
#define RT_ADMIT_MARGIN 1.25

/* The pass time of l's node at a batch of b sequences (admit.h). */
static double step_at(const rt_admit_load_t *l, double b)
{
    double at = l->step_batch > 1 ? l->step_batch : 1;
    double per_seq = l->step_per_seq_s > 0 && isfinite(l->step_per_seq_s) ? l->step_per_seq_s : 0;
    double t = l->step_time_s + per_seq * (b - at);
    return t > l->step_time_s / 4 ? t : l->step_time_s / 4;
}

rt_admit_estimate_t rt_admit_estimate(const rt_admit_load_t *l, uint32_t n_prompt,
                                      uint32_t max_tokens)
{
    rt_admit_estimate_t e = {false, 0, 0, 0, 0};
    if (!(l->step_time_s > 0) || !isfinite(l->step_time_s))
        return e;
    e.measured = true;
    uint32_t slots = l->max_running ? l->max_running : 1;
    double batch = (double)l->n_ahead + 1;
    if (l->n_ahead >= slots) {
        double waves = (double)(l->n_ahead / slots);
        double mean_tokens = (double)l->tokens_ahead / (double)l->n_ahead;
        e.start_s = waves * mean_tokens * step_at(l, slots);
        batch = slots;
    }
    uint32_t per_pass = l->max_batch_tokens ? l->max_batch_tokens : (n_prompt ? n_prompt : 1);
    double passes = (double)((n_prompt + per_pass - 1) / per_pass) + (double)max_tokens;
    e.finish_s = e.start_s + passes * step_at(l, batch);
    e.alone_s = passes * step_at(l, 1);
    if (l->n_ahead) {
        uint32_t waves = (l->n_ahead + slots - 1) / slots;
        double mean_tokens = (double)l->tokens_ahead / (double)l->n_ahead;
        double full = l->n_ahead < slots ? (double)l->n_ahead : (double)slots;
        e.drain_s = (double)waves * mean_tokens * step_at(l, full);
    }
    return e;
}

void rt_admit_observe(rt_step_fit_t *f, uint32_t batch, double step_s)
{
    if (!batch || !(step_s > 0) || !isfinite(step_s))
        return;
    const double keep = 0.98;
    double b = batch;
    f->w = f->w * keep + 1;
    f->sb = f->sb * keep + b;
    f->sbb = f->sbb * keep + b * b;
    f->st = f->st * keep + step_s;
    f->sbt = f->sbt * keep + b * step_s;
}

bool rt_admit_step_model(const rt_step_fit_t *f, double *step_s, double *batch, double *per_seq_s)
{
    if (!(f->w > 0))
        return false;
    double mb = f->sb / f->w, mt = f->st / f->w;
    double var = f->sbb / f->w - mb * mb;
    double cov = f->sbt / f->w - mb * mt;
    *step_s = mt;
    *batch = mb;
    *per_seq_s = var >= 1 ? (cov > 0 ? cov / var : 0) : RT_ADMIT_PRIOR_SLOPE * mt;
    return true;
}

/* A decode node up serving model m. */
static bool is_decode_up(const rt_node_t *n, const rt_model_t *m)
{
    return n->up && n->cfg->role == TDM_NODE_ROLE_DECODE && n->model == m;
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
    /* no decode pass seen yet (step_time_s 0): not measured, admit */
    rt_admit_load_t l = {0, n->max_running, n->max_batch_tokens, 0, 0, 0, 1};
    rt_admit_step_model(&n->step_fit, &l.step_time_s, &l.step_batch, &l.step_per_seq_s);
    uint32_t n_queued = 0;
    uint64_t queued_tokens = 0;
    for (tdm_list_t *e = tdm_list_first(&r->requests); e; e = tdm_list_next(&r->requests, e)) {
        const rt_req_t *q = TDM_LIST_ENTRY(e, rt_req_t, all_link);
        if (q == self || q->model != self->model)
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
    uint32_t reported = n->load.running + n->load.waiting;
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
        n_up += is_decode_up(&r->nodes[i], q->model);
    if (!n_up)
        return true;
    double left_s = q->deadline_ms > now_ms ? (double)(q->deadline_ms - now_ms) / 1000.0 : 0;
    uint32_t max_tokens = q->sp.max_tokens > 0 ? (uint32_t)q->sp.max_tokens : 0;
    bool have = false;
    for (size_t i = 0; i < r->n_nodes; i++) {
        const rt_node_t *n = &r->nodes[i];
        if (!is_decode_up(n, q->model))
            continue;
        rt_admit_load_t l = node_load(r, n, n_up, q);
        rt_admit_estimate_t e = rt_admit_estimate(&l, q->n_prompt, max_tokens);
        if (!e.measured || e.finish_s * RT_ADMIT_MARGIN <= left_s)
            return true;
        if (!have || e.finish_s < best->finish_s)
            *best = e;
        have = true;
    }
    return false;
}
