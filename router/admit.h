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
    double step_time_s;        /* the node's mean forward pass (heartbeat), at a batch of
                                  step_batch sequences; <= 0: none yet */
    uint32_t max_running;      /* its batch slots (0 counts as 1) */
    uint32_t max_batch_tokens; /* prompt tokens one pass takes (0: a whole prompt) */
    uint32_t n_ahead;          /* requests on it or bound for it: reserving, running, queued */
    uint64_t tokens_ahead;     /* their output tokens still to come (at most max_tokens each) */
    double step_per_seq_s;     /* what one more sequence in the batch adds to a pass (0: a pass
                                  takes step_time_s whatever the batch) */
    double step_batch;         /* the batch size step_time_s was measured at (<= 1 counts as 1) */
} rt_admit_load_t;

/* When a new request could start and finish on a node, seconds from now. */
typedef struct rt_admit_estimate {
    bool measured;   /* false: the node reports no step time yet; all 0 */
    double start_s;  /* earliest start: a batch slot is free */
    double finish_s; /* start + prefill + decode */
    double drain_s;  /* until every request ahead is done: ceil(A / S) waves of their mean
                        remaining tokens at t(min(A, S)); 0 when none is ahead */
    double alone_s;  /* prefill + decode alone on the idle node, at t(1) */
} rt_admit_estimate_t;

/* The estimate for a request of n_prompt prompt tokens and max_tokens output tokens on a node
 * with load l. Pure. With S = max(max_running, 1), A = n_ahead, W = tokens_ahead,
 * B = max_batch_tokens (n_prompt when 0) and the pass time at a batch of b sequences
 * t(b) = max(step_time_s + step_per_seq_s * (b - step_batch), step_time_s / 4):
 *   start_s  = floor(A / S) * (W / A) * t(S)  (the requests ahead run in waves of S, each as
 *                                              long as their mean remaining tokens; 0 if A < S)
 *   b        = S when A >= S, else A + 1      (the batch the request joins)
 *   prefill  = ceil(n_prompt / B) * t(b)      (one pass per max_batch_tokens of prompt)
 *   decode   = max_tokens * t(b)              (one pass per output token)
 *   finish_s = start_s + prefill + decode
 * drain_s and alone_s (above) tell a refused client when to retry, and whether that can help.
 * A node without a step time (step_time_s <= 0 or not finite) is not measured: admit (all 0). */
rt_admit_estimate_t rt_admit_estimate(const rt_admit_load_t *l, uint32_t n_prompt,
                                      uint32_t max_tokens);

/* Adds a heartbeat's sample to a node's step-time fit: the mean step time step_s (seconds) of
 * passes over batch sequences. Older samples weigh less (x0.98 each: about the last 50, 12 s of
 * heartbeats). A sample with no batch or no step time is ignored. */
void rt_admit_observe(rt_step_fit_t *f, uint32_t batch, double step_s);

/* Reads f as the step-time model of rt_admit_load_t: *step_s at *batch sequences (the samples'
 * weighted means) and *per_seq_s, the least-squares slope when the samples' batch sizes spread
 * (variance >= 1), else step_s / batch (a pass taken to cost in proportion to its batch until
 * batches of other sizes were seen: the cautious reading of a node only ever seen idle or
 * full). Returns false (outputs untouched) when f has no sample. */
bool rt_admit_step_model(const rt_step_fit_t *f, double *step_s, double *batch, double *per_seq_s);

/* Whether some decode node up could finish q (not yet queued or dispatched) before its
 * deadline (now_ms: unix ms); when none can, *best is the estimate of the node that would
 * finish it soonest. True as well when no decode node is up (q waits in the queue) or none
 * reports a step time yet. */
bool rt_admit_ok(const tdm_router_t *r, const rt_req_t *q, uint64_t now_ms,
                 rt_admit_estimate_t *best);

#endif /* TANDEM_ROUTER_ADMIT_H */
