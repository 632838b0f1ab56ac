/* admit.h - admission control: an estimate, per decode node, of when a new request could
 * start and finish there, from the node's measured step time and the work the router has
 * already given it; a request no decode node up can finish by its deadline is refused before
 * dispatch (request.c) with RESOURCE_EXHAUSTED and ErrorDetail.retry_after_s.
 */
#ifndef TANDEM_ROUTER_ADMIT_H
#define TANDEM_ROUTER_ADMIT_H

#include <stdbool.h>
#include <stdint.h>

#include "router_internal.h"

/* What a decode node already has, as the estimate sees it. */
typedef struct rt_admit_load {
    double step_time_s;        /* the node's mean forward pass (heartbeat); <= 0: none yet */
    uint32_t max_running;      /* its batch slots (0 counts as 1) */
    uint32_t max_batch_tokens; /* prompt tokens one pass takes (0: a whole prompt) */
    uint32_t n_ahead;          /* requests on it or bound for it: reserving, running, queued */
    uint64_t tokens_ahead;     /* their output tokens still to come (at most max_tokens each) */
} rt_admit_load_t;

/* When a new request could start and finish on a node, seconds from now. */
typedef struct rt_admit_estimate {
    bool measured;   /* false: the node reports no step time yet; start_s = finish_s = 0 */
    double start_s;  /* earliest start: a batch slot is free */
    double finish_s; /* start + prefill + decode */
} rt_admit_estimate_t;

/* The estimate for a request of n_prompt prompt tokens and max_tokens output tokens on a node
 * with load l. Pure. With t = step_time_s, S = max(max_running, 1), A = n_ahead,
 * W = tokens_ahead, B = max_batch_tokens (n_prompt when 0):
 *   start_s  = floor(A / S) * (W / A) * t   (the requests ahead run in waves of S, each as
 *                                            long as their mean remaining tokens; 0 when A < S)
 *   prefill  = ceil(n_prompt / B) * t        (one pass per max_batch_tokens of prompt)
 *   decode   = max_tokens * t                (one pass per output token at the current batch)
 *   finish_s = start_s + prefill + decode
 * A node without a step time (t <= 0 or not finite) is not measured: admit (all 0). */
rt_admit_estimate_t rt_admit_estimate(const rt_admit_load_t *l, uint32_t n_prompt,
                                      uint32_t max_tokens);

/* Whether some decode node up could finish q (not yet queued or dispatched) before its
 * deadline (now_ms: unix ms); when none can, *best is the estimate of the node that would
 * finish it soonest. True as well when no decode node is up (q waits in the queue) or none
 * reports a step time yet. */
bool rt_admit_ok(const tdm_router_t *r, const rt_req_t *q, uint64_t now_ms,
                 rt_admit_estimate_t *best);

#endif /* TANDEM_ROUTER_ADMIT_H */
