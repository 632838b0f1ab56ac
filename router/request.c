/* request.c - GENERATE requests in the router: intake (validation is validate.c's), the
 * request table (every request, by id, by client call, by deadline), admission and how a
 * request ends other than completing (failed, dropped, cancelled, client gone, deadline,
 * shutdown). The output (reorder buffer, detokenization, stop strings, chunks, completion) is
 * stream.c's; where a request runs is scheduler.c's.
 */
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "admit.h"
#include "embed.h"
#include "nodes.h"
#include "request.h"
#include "scheduler.h"
#include "stats.h"
#include "lifecycle.h"
#include "stream.h"
#include "validate.h"

/* ---- the request table ---- */

int rt_req_table_init(tdm_router_t *r)
{
    tdm_list_init(&r->requests);
    rt_heap_init(&r->deadlines);
    r->n_reqs = 0;
    if (rt_index_init(&r->by_id, 256) != TDM_OK || rt_index_init(&r->by_call, 256) != TDM_OK)
        return TDM_ERESOURCE;
    return TDM_OK;
}

void rt_req_table_fini(tdm_router_t *r)
{
    rt_index_fini(&r->by_id);
    rt_index_fini(&r->by_call);
    rt_heap_fini(&r->deadlines);
}

static uint64_t id_key(const char *id)
{
    return rt_index_hash(id, strlen(id), 0);
}

/* The key of a client call: its connection's routing id and its call id. */
static uint64_t call_key(const uint8_t *peer, size_t peer_len, uint64_t call_id)
{
    return rt_index_hash(peer, peer_len, call_id);
}

static rt_req_t *by_id_entry(const rt_index_entry_t *e)
{
    return TDM_CONTAINER_OF(e, rt_req_t, by_id);
}

rt_req_t *rt_req_find(tdm_router_t *r, const char *id)
{
    for (rt_index_entry_t *e = rt_index_first(&r->by_id, id_key(id)); e; e = rt_index_next(e))
        if (strcmp(by_id_entry(e)->id, id) == 0)
            return by_id_entry(e);
    return NULL;
}

rt_req_t *rt_req_find_attempt(tdm_router_t *r, const char *id, uint64_t attempt, bool *id_known)
{
    *id_known = false;
    for (rt_index_entry_t *e = rt_index_first(&r->by_id, id_key(id)); e; e = rt_index_next(e)) {
        rt_req_t *q = by_id_entry(e);
        if (strcmp(q->id, id) == 0) {
            *id_known = true;
            if (q->attempt_id == attempt && attempt != 0)
                return q;
        }
    }
    return NULL;
}

rt_req_t *rt_req_find_for_peer(tdm_router_t *r, const char *id, const uint8_t *peer,
                               size_t peer_len)
{
    for (rt_index_entry_t *e = rt_index_first(&r->by_id, id_key(id)); e; e = rt_index_next(e)) {
        rt_req_t *q = by_id_entry(e);
        if (strcmp(q->id, id) == 0 && q->peer_len == peer_len &&
            memcmp(q->peer, peer, peer_len) == 0)
            return q;
    }
    return NULL;
}

rt_req_t *rt_req_find_call(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id)
{
    rt_index_entry_t *e = rt_index_first(&r->by_call, call_key(peer, peer_len, call_id));
    for (; e; e = rt_index_next(e)) {
        rt_req_t *q = TDM_CONTAINER_OF(e, rt_req_t, by_call);
        if (q->call_id == call_id && q->peer_len == peer_len &&
            memcmp(q->peer, peer, peer_len) == 0)
            return q;
    }
    return NULL;
}

/* Enters q (validated, its id, peer, call and deadline set) into the table: every link of q
 * starts here. Returns false on out of memory (q is then in nothing). */
static bool hash_insert(tdm_router_t *r, rt_req_t *q)
{
    tdm_list_init(&q->queue_link);
    rt_heap_entry_init(&q->by_deadline);
    if (q->deadline_ms && rt_heap_push(&r->deadlines, &q->by_deadline, q->deadline_ms) != TDM_OK)
        return false;
    tdm_list_push_front(&r->requests, &q->all_link);
    rt_index_insert(&r->by_id, &q->by_id, id_key(q->id));
    rt_index_insert(&r->by_call, &q->by_call, call_key(q->peer, q->peer_len, q->call_id));
    r->n_reqs++;
    return true;
}

static void hash_remove(tdm_router_t *r, rt_req_t *q)
{
    rt_heap_remove(&r->deadlines, &q->by_deadline);
    tdm_list_remove(&q->all_link);
    rt_index_remove(&r->by_id, &q->by_id);
    rt_index_remove(&r->by_call, &q->by_call);
    r->n_reqs--;
}

rt_req_t *rt_req_for_event(tdm_router_t *r, const rt_node_t *n, const char *id, uint64_t attempt,
                           bool from_prefill, bool from_decode, const char *what)
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

/* ---- the choices of one call (n > 1) ---- */

static void group_unref(rt_group_t *g)
{
    if (--g->refs == 0)
        free(g);
}

/* ---- freeing ---- */

void rt_req_free(tdm_router_t *r, rt_req_t *q)
{
    if (!q)
        return;
    rt_queue_remove(r, q);
    hash_remove(r, q);
    if (q->decode)
        rt_node_detach(q->decode, q);
    free(q->prompt);
    free(q->gbnf);
    for (size_t i = 0; i < q->n_stop; i++)
        free(q->stop[i]);
    free(q->stop);
    free(q->tried);
    rt_stream_free(q);
    if (q->group) {
        q->group->kids[q->choice] = NULL;
        q->group->n_live--;
        group_unref(q->group);
    }
    free(q);
}

/* ---- GENERATE ---- */

/* Ends a refused GENERATE call: counted, logged (id: the request's, NULL when it has none
 * yet), END with err's status and message and, when err names a field or why (NULL: none) a
 * length, its ErrorDetail. */
static void reply_refused(tdm_router_t *r, const tdm_frame_t *f, const char *id,
                          const tdm_error_t *err, const rt_refusal_t *why)
{
    char kv[96];
    snprintf(kv, sizeof kv, "status=%s", tdm_status_name(err->code));
    tdm_log_write(&r->log, TDM_LOG_INFO, id, kv, "request refused: %s", err->msg);
    rt_count_end(r, NULL, err->code, -1);
    Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
    d.field = (char *)err->field;
    if (why) {
        d.prompt_tokens = why->prompt_tokens;
        d.n_ctx = why->n_ctx;
        d.max_tokens_fit = why->max_tokens_fit;
    }
    tdm_send_t m = {
        .peer = f->peer,
        .peer_len = f->peer_len,
        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
        .method = f->method,
        .call_id = f->call_id,
        .status = err->code,
        .message = err->msg,
        .body = err->field[0] || d.n_ctx ? &d.base : NULL,
    };
    if (tdm_sock_send(r->client, &m) != TDM_OK)
        tdm_log_write(&r->log, TDM_LOG_DEBUG, id, NULL, "the refusal was not sent: %s",
                      tdm_sock_errmsg(r->client));
}

/* Frees a request that never entered the table. NULL-safe. */
static void req_discard(rt_req_t *q)
{
    if (!q)
        return;
    free(q->prompt);
    free(q->gbnf);
    for (size_t i = 0; i < q->n_stop; i++)
        free(q->stop[i]);
    free(q->stop);
    free(q->tried);
    free(q);
}

/* A new request for the call f from its decoded body g, validated; NULL after the refusal
 * has been sent. */
static rt_req_t *req_from_call(tdm_router_t *r, const tdm_frame_t *f,
                               const Tandem__V1__GenerateRequest *g, double now, uint64_t now_ms)
{
    tdm_error_t err = {0};
    rt_refusal_t why = {0};
    rt_req_t *q = calloc(1, sizeof *q);
    int rc = q ? TDM_OK : tdm_error_set(&err, TDM_ERESOURCE, "out of memory");
    if (q) {
        q->t_arrival = now;
        memcpy(q->peer, f->peer, f->peer_len);
        q->peer_len = f->peer_len;
        q->call_id = f->call_id;
        q->deadline_ms = f->deadline_unix_ms
                             ? f->deadline_unix_ms
                             : now_ms + (uint64_t)(r->cfg->router.request_timeout_s * 1000.0 + 0.5);
        q->model = &r->models[0]; /* rt_req_validate sets the request's own */
        tdm_detok_init(&q->detok, q->model->tok, false);
        rc = rt_req_validate(r, f, g, q, &why, &err);
    }
    /* tried and timed_out share one allocation */
    if (rc == TDM_OK && !(q->tried = calloc(2 * (r->n_nodes ? r->n_nodes : 1), sizeof *q->tried)))
        rc = tdm_error_set(&err, TDM_ERESOURCE, "out of memory");
    if (rc == TDM_OK)
        q->timed_out = q->tried + (r->n_nodes ? r->n_nodes : 1);
    if (rc == TDM_OK)
        return q;
    reply_refused(r, f, q && q->id[0] ? q->id : NULL, &err, &why);
    req_discard(q);
    return NULL;
}

/* Refuses q, which no decode node up can finish before its deadline (admission control, e:
 * the soonest node's estimate): RESOURCE_EXHAUSTED before anything is dispatched, with
 * ErrorDetail.retry_after_s (whole seconds, at least 1): when the requests ahead will have
 * drained (the earliest start, or later when the batch they make is what is too slow). When
 * q could not finish in time even alone on an idle node, the message says that retrying as
 * it is cannot help. */
static void req_shed(tdm_router_t *r, rt_req_t *q, const rt_admit_estimate_t *e, uint64_t now_ms)
{
    double left_s = q->deadline_ms > now_ms ? (double)(q->deadline_ms - now_ms) / 1000.0 : 0;
    bool never = e->alone_s > left_s;
    double retry = ceil(e->drain_s > e->start_s ? e->drain_s : e->start_s);
    Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
    d.retry_after_s = retry < 1 ? 1 : retry > 86400 ? 86400 : (uint32_t)retry;
    char msg[TDM_ERRMSG_MAX];
    snprintf(msg, sizeof msg,
             "the cluster cannot finish this request before its deadline: earliest start in "
             "~%.1f s, finish in ~%.1f s, %.1f s left; %s %" PRIu32 " s",
             e->start_s, e->finish_s, left_s,
             never ? "alone on an idle node it would still take longer: send a longer "
                     "deadline or a smaller max_tokens; retry after"
                   : "retry after",
             d.retry_after_s);
    r->metrics.shed++;
    q->model->metrics.shed++;
    rt_req_fail_body(r, q, TDM_ERESOURCE, false, &d.base, msg);
}

/* Hands an accepted request to a decode node, or queues it (FIFO: behind requests already
 * waiting); refuses it when no decode node up could finish it before its deadline. */
static void req_admit(tdm_router_t *r, rt_req_t *q)
{
    rt_admit_estimate_t e;
    uint64_t now_ms = tdm_net_now_ms();
    if (r->cfg->router.admission_control && !rt_admit_ok(r, q, now_ms, &e)) {
        req_shed(r, q, &e, now_ms);
        return;
    }
    tdm_error_t err = {0};
    rt_dispatch_result_t res =
        rt_queue_has_model(r, q->model) ? RT_DISPATCH_WAIT : rt_dispatch(r, q, &err);
    if (res == RT_DISPATCH_WAIT) {
        size_t emb_running, emb_queued; /* EMBED calls waiting count against the bound too */
        rt_embed_count(r, NULL, &emb_running, &emb_queued);
        if (r->n_queued + emb_queued >= (size_t)r->cfg->router.max_queue) {
            r->metrics.queue_full++;
            q->model->metrics.queue_full++;
            rt_req_fail(r, q, TDM_ERESOURCE, false, "queue full (%zu requests waiting)",
                        r->n_queued + emb_queued);
            return;
        }
        rt_queue_push(r, q, false);
        tdm_log_write(&r->log, TDM_LOG_INFO, q->id, NULL,
                      "queued: no decode node up with room (%zu waiting)", r->n_queued);
        rt_drain_queue(r);
    } else if (res == RT_DISPATCH_FAILED) {
        rt_req_fail(r, q, err.code, false, "%s", err.msg);
    }
}

/* A copy of q (validated, in the table) for choice i of its call: seed + i, not in the table.
 * NULL on out of memory. */
static rt_req_t *req_clone(const tdm_router_t *r, const rt_req_t *q, uint32_t i)
{
    rt_req_t *c = calloc(1, sizeof *c);
    if (!c)
        return NULL;
    memcpy(c->id, q->id, sizeof c->id);
    memcpy(c->peer, q->peer, q->peer_len);
    c->peer_len = q->peer_len;
    c->call_id = q->call_id;
    c->stream = q->stream;
    c->include_stop_str = q->include_stop_str;
    c->render_special = q->render_special;
    c->echo = q->echo;
    c->continuous_usage = q->continuous_usage;
    c->sp = q->sp;
    c->sp.seed = q->sp.seed + i;
    c->deadline_ms = q->deadline_ms;
    c->t_arrival = q->t_arrival;
    c->gbnf_hash = q->gbnf_hash;
    c->choice = i;
    c->model = q->model;
    tdm_detok_init(&c->detok, q->model->tok, q->render_special);
    size_t nn = r->n_nodes ? r->n_nodes : 1;
    bool ok = (c->prompt = malloc((size_t)q->n_prompt * sizeof *c->prompt)) != NULL &&
              (!q->gbnf || (c->gbnf = tdm_strdup(q->gbnf)) != NULL) &&
              (!q->n_stop || (c->stop = calloc(q->n_stop, sizeof *c->stop)) != NULL) &&
              (c->tried = calloc(2 * nn, sizeof *c->tried)) != NULL;
    if (ok)
        memcpy(c->prompt, q->prompt, (size_t)q->n_prompt * sizeof *c->prompt);
    c->n_prompt = q->n_prompt;
    for (size_t k = 0; ok && k < q->n_stop; k++, c->n_stop++)
        ok = (c->stop[k] = tdm_strdup(q->stop[k])) != NULL;
    if (!ok) {
        req_discard(c);
        return NULL;
    }
    c->timed_out = c->tried + nn;
    return c;
}

/* Makes q (in the table) choice 0 of n and enters choices 1..n-1 into the table. On out of
 * memory returns TDM_ERESOURCE with the choices made so far in q->group (possibly none). */
static int group_spawn(tdm_router_t *r, rt_req_t *q, uint32_t n)
{
    rt_group_t *g = calloc(1, sizeof *g);
    if (!g)
        return TDM_ERESOURCE;
    g->n = n;
    g->kids[0] = q;
    g->n_live = 1;
    g->refs = 2; /* q, and the intake's hold */
    q->group = g;
    for (uint32_t i = 1; i < n; i++) {
        rt_req_t *c = req_clone(r, q, i);
        if (!c || !hash_insert(r, c)) {
            req_discard(c);
            return TDM_ERESOURCE;
        }
        c->group = g;
        g->kids[i] = c;
        g->n_live++;
        g->refs++;
    }
    return TDM_OK;
}

/* The n choices of q's call, each admitted as a request of its own (choice 0 first, so the
 * others find its decode node to fork on); one refused ends them all. */
static void group_admit(tdm_router_t *r, rt_req_t *q, uint32_t n)
{
    int rc = group_spawn(r, q, n);
    rt_group_t *g = q->group;
    if (rc != TDM_OK) {
        rt_req_fail(r, q, TDM_ERESOURCE, false, "router out of memory");
    } else {
        for (uint32_t i = 0; i < n; i++)
            if (g->kids[i])
                req_admit(r, g->kids[i]);
    }
    if (g)
        group_unref(g);
}

void rt_generate(tdm_router_t *r, const tdm_frame_t *f)
{
    r->metrics.requests_total++;
    double now = tdm_time_now();
    uint64_t now_ms = tdm_net_now_ms();
    tdm_error_t err = {0};
    if (tdm_frame_expired(f, now_ms)) {
        tdm_error_set(&err, TDM_EDEADLINE, "the request's deadline had passed when it arrived");
        reply_refused(r, f, NULL, &err, NULL);
        return;
    }
    Tandem__V1__GenerateRequest *g = (Tandem__V1__GenerateRequest *)tdm_frame_unpack(
        f, &tandem__v1__generate_request__descriptor);
    if (!g) {
        tdm_error_set(&err, TDM_EINVALID, "the body does not decode as a GenerateRequest");
        reply_refused(r, f, NULL, &err, NULL);
        return;
    }
    rt_req_t *q = req_from_call(r, f, g, now, now_ms);
    uint32_t n_choices = g->n > 1 ? g->n : 1;
    protobuf_c_message_free_unpacked(&g->base, NULL);
    if (!q)
        return;
    if (!hash_insert(r, q)) {
        tdm_error_set(&err, TDM_ERESOURCE, "router out of memory");
        reply_refused(r, f, q->id, &err, NULL);
        req_discard(q);
        return;
    }
    q->chunk.index = 0;
    r->metrics.prompt_tokens += q->n_prompt;
    q->model->metrics.prompt_tokens += q->n_prompt;
    char kv[200];
    snprintf(kv, sizeof kv,
             "prompt_tokens=%" PRIu32 " max_tokens=%" PRId32
             " stream=%s stop_strings=%zu n=%" PRIu32,
             q->n_prompt, q->sp.max_tokens, q->stream ? "true" : "false", q->n_stop, n_choices);
    tdm_log_write(&r->log, TDM_LOG_INFO, q->id, kv, "request accepted");
    rt_hist_observe_count(&r->metrics.params_n, n_choices);
    rt_hist_observe_count(&r->metrics.params_max_tokens, (uint32_t)q->sp.max_tokens);
    rt_hist_observe_count(&q->model->metrics.params_n, n_choices);
    rt_hist_observe_count(&q->model->metrics.params_max_tokens, (uint32_t)q->sp.max_tokens);
    if (n_choices > 1)
        group_admit(r, q, n_choices);
    else
        req_admit(r, q);
}
