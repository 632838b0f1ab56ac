/* lifecycle.c - the ways a GENERATE request ends other than completing (stream.c's
 * complete): failed (an END with the status and message to the client, NodeCancel to its
 * nodes), dropped (cancelled by the client or the client gone: no END), past its deadline,
 * router shutdown; and how the other choices of a call (n > 1) end with one of them. Every end
 * counts the request once and frees it (rt_req_free).
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "lifecycle.h"
#include "nodes.h"
#include "request.h"
#include "scheduler.h"
#include "stats.h"
#include "stream.h"

/* Ends every sibling of q (not q): NodeCancel to their nodes, for a failure (fail) the error
 * chunk a stream gets, counted with status, freed; the caller ends q and sends the call's one
 * END. With release_q, q's NodeCancels go too (without a group, only they do). The forks go
 * before choice 0, whose prompt KV they share: a decode node that loses choice 0 first fails
 * every fork still waiting for it ("the sibling it shares the prompt with ended", one warning
 * each), where a cancelled fork just goes. */
static void group_end_siblings(tdm_router_t *r, rt_req_t *q, int status, bool fail, bool release_q)
{
    rt_group_t *g = q->group;
    if (!g && release_q)
        rt_release_nodes(r, q, status);
    for (uint32_t i = g ? g->n : 0; i-- > 0;) {
        rt_req_t *s = g->kids[i];
        if (s == q && release_q)
            rt_release_nodes(r, q, status);
        if (!s || s == q)
            continue;
        rt_release_nodes(r, s, status);
        if (fail)
            rt_stream_fail(r, s);
        rt_count_end(r, s->model, status,
                     fail ? TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR
                          : TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
        rt_req_free(r, s);
        r->sibling_frees++;
    }
}

int rt_send_end(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id, int status,
                const char *message, const ProtobufCMessage *body)
{
    tdm_send_t m = {0};
    m.peer = peer;
    m.peer_len = peer_len;
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END;
    m.method = TANDEM__V1__METHOD__METHOD_GENERATE;
    m.call_id = call_id;
    m.status = status;
    m.message = message;
    m.body = body;
    return tdm_sock_send(r->client, &m);
}

void rt_req_fail_body(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes,
                      const ProtobufCMessage *body, const char *msg)
{
    char kv[96];
    snprintf(kv, sizeof kv, "status=%s", tdm_status_name(status));
    tdm_log_write(&r->log, TDM_LOG_WARN, q->id, kv, "request failed: %s", msg);
    group_end_siblings(r, q, status, true, cancel_nodes);
    rt_stream_fail(r, q);
    rt_send_end(r, q->peer, q->peer_len, q->call_id, status, msg, body);
    rt_count_end(r, q->model, status, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
    double e2e = tdm_time_now() - q->t_arrival;
    rt_hist_observe(&r->metrics.e2e, e2e);
    rt_hist_observe(&q->model->metrics.e2e, e2e);
    rt_req_free(r, q);
}

void rt_req_fail(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes, const char *fmt, ...)
{
    char msg[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    rt_req_fail_body(r, q, status, cancel_nodes, NULL, msg);
}

void rt_req_drop(tdm_router_t *r, rt_req_t *q, const char *why)
{
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL, "request dropped: %s", why);
    group_end_siblings(r, q, TDM_ECANCELLED, false, true);
    rt_count_end(r, q->model, TDM_ECANCELLED, TANDEM__V1__FINISH_REASON__FINISH_REASON_CANCELLED);
    rt_req_free(r, q);
}

void rt_client_cancel(tdm_router_t *r, const tdm_frame_t *f)
{
    rt_req_t *q = rt_req_find_call(r, f->peer, f->peer_len, f->call_id);
    if (q) {
        rt_req_drop(r, q, "cancelled by the client");
        return;
    }
    tdm_log_write(&r->log, TDM_LOG_DEBUG, NULL, NULL,
                  "CANCEL for call %" PRIu64 " that is not in flight", f->call_id);
}

static const char *state_name(rt_state_t s)
{
    switch (s) {
    case RT_QUEUED: return "queued, waiting for a decode node";
    case RT_RESERVING: return "reserving KV blocks on a decode node";
    case RT_RUNNING: return "running";
    }
    return "?";
}

void rt_req_check_deadlines(tdm_router_t *r, uint64_t now_ms)
{
    rt_sched_check_reserves(r, tdm_time_now());
    rt_heap_entry_t *e;
    while ((e = rt_heap_top(&r->deadlines)) && now_ms >= e->key) {
        rt_req_t *q = TDM_CONTAINER_OF(e, rt_req_t, by_deadline);
        char note[TDM_ERRMSG_MAX] = "";
        if (q->state == RT_QUEUED)
            rt_refused_decode_note(r, note, sizeof note);
        rt_req_fail(r, q, TDM_EDEADLINE, true,
                    "deadline exceeded after %.3f s (%s, %" PRIu32 " tokens out)%s%s",
                    tdm_time_now() - q->t_arrival, state_name(q->state), q->next_index,
                    note[0] ? "; " : "", note);
    }
}

void rt_req_shutdown_all(tdm_router_t *r)
{
    tdm_list_t *l;
    while ((l = tdm_list_first(&r->requests))) {
        rt_req_t *q = TDM_LIST_ENTRY(l, rt_req_t, all_link);
        group_end_siblings(r, q, TDM_EUNAVAILABLE, true, true);
        rt_stream_fail(r, q);
        rt_send_end(r, q->peer, q->peer_len, q->call_id, TDM_EUNAVAILABLE, "router shutting down",
                    NULL);
        rt_count_end(r, q->model, TDM_EUNAVAILABLE, TANDEM__V1__FINISH_REASON__FINISH_REASON_ERROR);
        rt_req_free(r, q);
    }
}
