/* scheduler.h - where the router's requests run: the queue, dispatch to a decode node
 * (DecodeReserve), the reservation's answer, the PrefillTask to a prefill node chosen by
 * policy (round_robin, least_loaded, prefix_aware), re-dispatch after a failure. The only
 * writer of rt_req_t.state and of a request's node assignment (router_internal.h).
 */
#ifndef TANDEM_ROUTER_SCHEDULER_H
#define TANDEM_ROUTER_SCHEDULER_H

#include <stdbool.h>
#include <stdint.h>

#include "router_internal.h"

/* Sets up the queue and the prefix_aware table. Returns 0 or TDM_ERESOURCE (out of memory;
 * rt_sched_fini still frees what was made). */
int rt_sched_init(tdm_router_t *r);
/* Frees the prefix_aware table (the queue holds no memory). Cannot fail. */
void rt_sched_fini(tdm_router_t *r);

/* Puts q (not queued) on the queue, last (a new request) or first (one that was admitted
 * before and goes back), and marks it QUEUED. Cannot fail: the caller checks the queue limit. */
void rt_queue_push(tdm_router_t *r, rt_req_t *q, bool front);
/* Takes q off the queue; does nothing when it is not queued. */
void rt_queue_remove(tdm_router_t *r, rt_req_t *q);
/* The request first in the queue, or NULL when none waits. */
rt_req_t *rt_queue_first(const tdm_router_t *r);
/* Whether a request of model m waits in the queue (a new one of m goes behind it: FIFO per
 * model). Cannot fail. */
bool rt_queue_has_model(const tdm_router_t *r, const rt_model_t *m);

/* What rt_dispatch did with a request. */
typedef enum rt_dispatch_result {
    RT_DISPATCH_SENT,  /* DecodeReserve sent: the request is RESERVING on a decode node */
    RT_DISPATCH_WAIT,  /* no decode node is up or has room now: the caller queues it */
    RT_DISPATCH_FAILED /* it can never be served here (or the router is out of memory): *err
                          holds the status and why; the caller fails it */
} rt_dispatch_result_t;

/* Places q (not queued) on a decode node: sends DecodeReserve to the up decode node with
 * the most room that q has not tried this round. Sets *err only when it returns
 * RT_DISPATCH_FAILED: TDM_ERESOURCE when q needs more KV blocks than the largest decode node
 * up has, or on out of memory. */
rt_dispatch_result_t rt_dispatch(tdm_router_t *r, rt_req_t *q, tdm_error_t *err);

/* rt_dispatch, then what its result asks: RT_DISPATCH_WAIT queues q (requeued: true for a
 * request admitted before, which no queue limit refuses, with its wait restarted),
 * RT_DISPATCH_FAILED fails q with the error (not retryable). Returns the result. */
rt_dispatch_result_t rt_dispatch_or_queue(tdm_router_t *r, rt_req_t *q, bool requeued);
/* Sends the NodeCancels owed to nodes that are back up (attempts the router left while they
 * were down or unreachable), then dispatches queued requests (FIFO) while decode nodes have
 * room. Called on every registration and heartbeat. */
void rt_drain_queue(tdm_router_t *r);
/* Puts q back through dispatch after a failure of its current attempt (NodeCancel to its
 * nodes first; delivered output is kept). count: whether it counts against
 * TDM_ROUTER_MAX_REDISPATCH; past the limit q fails with status and why. Returns true when
 * q was freed. */
bool rt_redispatch(tdm_router_t *r, rt_req_t *q, bool count, int status, const char *why);

/* Sends NodeCancel(status) to the request's prefill and decode nodes (owed until it is back
 * to one that is down) and detaches a pending reservation. Leaves the assignment and the
 * attempt cleared (anything still in flight for that attempt is stale). */
void rt_release_nodes(tdm_router_t *r, rt_req_t *q, int status);
/* Forgets n's pending reservation pointers to q (q is going away). */
void rt_node_detach(rt_node_t *n, rt_req_t *q);

/* The END of a DecodeReserve from node n (its registered connection): on OK the request runs
 * (PrefillTask or local prefill); refused for room, another decode node is tried or the
 * request queues; otherwise the request fails. */
void rt_sched_reserve_end(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f);
/* Gives up on every DecodeReserve not answered within the reservation timeout (the heartbeat
 * timeout plus two of the node's reported forward passes): NodeCancel of its attempt is sent (or
 * owed, the node being down, until it is back), and its request is re-dispatched under a new
 * attempt, on another decode node when one has room (counted against TDM_ROUTER_MAX_REDISPATCH).
 * now: monotonic seconds. */
void rt_sched_check_reserves(tdm_router_t *r, double now);
/* A TaskFailed from node n: re-dispatch when retryable (counted), else the request fails;
 * the status is the node's unless it would blame the client (INVALID_ARGUMENT etc.: the router
 * validated the request), which becomes INTERNAL. */
void rt_sched_task_failed(tdm_router_t *r, rt_node_t *n, const tdm_frame_t *f);
/* n was marked down (reason: why): its requests are re-dispatched (reserving on it, or
 * prefilling there before their decode node started) or fail (decoding on it). */
void rt_sched_node_down(tdm_router_t *r, rt_node_t *n, const char *reason);

/* A new dispatch attempt id (never 0, never repeated by this router instance): GENERATE's and
 * the EmbedTasks' (embed.c) come from one sequence. Cannot fail. */
uint64_t rt_sched_next_attempt(tdm_router_t *r);

#endif /* TANDEM_ROUTER_SCHEDULER_H */
