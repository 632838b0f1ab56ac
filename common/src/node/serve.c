/* serve.c - the one serve loop of the node daemons, and their one request table.
 *
 * A prefill and a decode node differ only in their handler (tdm_node_ops_t): what a task
 * frame does, what a worker event does, the KV side's I/O. Everything else is here: the poll
 * loop, the router link, NODE_CANCEL / NODE_STATUS, deadlines, the router-restart check, the
 * load published for heartbeats and the shutdown that fails what is in flight.
 *
 * The request table: a fixed array of ops->req_size-byte entries (each a handler struct that
 * starts with tdm_node_req_t), a free list, and buckets by XXH3 of the attempt id chained
 * through the entries. Nothing is allocated after tdm_node_new.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>
#include <zmq.h>

#include "tandem/node.h"
#include "tandem/proto.h"

#define NO_ENTRY UINT32_MAX
#define TIMER_PERIOD_S 0.05   /* expiry checks and load publishing */
#define SHUTDOWN_FLUSH_MS 300 /* how long the last messages get to reach the router */

struct tdm_node {
    const tdm_config_t *cfg;
    const tdm_node_config_t *node;
    const tdm_node_ops_t *ops;
    void *h; /* the handler, first argument of every hook */
    tdm_logger_t log;
    tdm_net_t *net;
    tdm_node_runtime_t rt;
    tdm_node_link_t *links[TDM_CONFIG_MAX_ROUTERS]; /* one per router (router.node_endpoints) */
    size_t n_links;

    unsigned char *reqs; /* [n_reqs][ops->req_size] entries */
    uint32_t n_reqs;
    uint32_t *buckets;   /* [n_buckets] first entry of each hash bucket, NO_ENTRY when empty */
    uint32_t n_buckets;  /* a power of two >= 2 * n_reqs */
    uint32_t *free_list; /* [n_reqs] stack of unused entries */
    uint32_t n_free;
    double last_timers;
};

/* ---- the request table ---- */

static tdm_node_req_t *entry(const tdm_node_t *n, uint32_t i)
{
    return (tdm_node_req_t *)(void *)(n->reqs + (size_t)i * n->ops->req_size);
}

static uint32_t entry_index(const tdm_node_t *n, const tdm_node_req_t *r)
{
    return (uint32_t)(((const unsigned char *)r - n->reqs) / n->ops->req_size);
}

static uint32_t *bucket_of(const tdm_node_t *n, uint64_t attempt_id)
{
    uint64_t h = XXH3_64bits(&attempt_id, sizeof attempt_id);
    return &n->buckets[h & (n->n_buckets - 1)];
}

static int table_open(tdm_node_t *n, uint32_t n_reqs, tdm_error_t *err)
{
    n->n_reqs = n_reqs;
    n->n_buckets = 1;
    while (n->n_buckets < 2 * n_reqs)
        n->n_buckets *= 2;
    n->reqs = calloc(n_reqs, n->ops->req_size);
    n->buckets = malloc(n->n_buckets * sizeof *n->buckets);
    n->free_list = malloc(n_reqs * sizeof *n->free_list);
    if (!n->reqs || !n->buckets || !n->free_list)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for the request table");
    for (uint32_t i = 0; i < n->n_buckets; i++)
        n->buckets[i] = NO_ENTRY;
    for (uint32_t i = 0; i < n_reqs; i++)
        n->free_list[i] = n_reqs - 1 - i;
    n->n_free = n_reqs;
    return TDM_OK;
}

tdm_node_req_t *tdm_node_req_new(tdm_node_t *n, const tdm_node_attempt_t *a)
{
    if (n->n_free == 0)
        return NULL;
    uint32_t i = n->free_list[--n->n_free];
    tdm_node_req_t *r = entry(n, i);
    memset(r, 0, n->ops->req_size);
    r->att = *a;
    r->used = true;
    uint32_t *b = bucket_of(n, a->attempt_id);
    r->next = *b;
    *b = i;
    return r;
}

tdm_node_req_t *tdm_node_req_find(tdm_node_t *n, uint64_t attempt_id)
{
    for (uint32_t i = *bucket_of(n, attempt_id); i != NO_ENTRY; i = entry(n, i)->next)
        if (entry(n, i)->att.attempt_id == attempt_id)
            return entry(n, i);
    return NULL;
}

void tdm_node_req_drop(tdm_node_t *n, tdm_node_req_t *r)
{
    TDM_ASSERT(r->used);
    n->ops->drop(n->h, r);
    tdm_grammar_cache_release(n->rt.grammars, r->grammar); /* after the worker let it go */
    uint32_t i = entry_index(n, r);
    uint32_t *p = bucket_of(n, r->att.attempt_id);
    while (*p != i)
        p = &entry(n, *p)->next;
    *p = r->next;
    memset(r, 0, n->ops->req_size);
    n->free_list[n->n_free++] = i;
}

void tdm_node_fail(tdm_node_t *n, const tdm_node_attempt_t *a, int status, bool retryable,
                   const char *msg)
{
    tdm_node_report_failed(tdm_node_sock(n, a->router_instance), &n->log, a, status, retryable,
                           msg);
}

void tdm_node_req_fail(tdm_node_t *n, tdm_node_req_t *r, int status, bool retryable,
                       const char *msg)
{
    tdm_node_fail(n, &r->att, status, retryable, msg);
    tdm_node_req_drop(n, r);
}

void tdm_node_req_fail_event(tdm_node_t *n, tdm_node_req_t *r, const tdm_worker_event_t *ev)
{
    tdm_node_report_failed_ex(tdm_node_sock(n, r->att.router_instance), &n->log, &r->att,
                              ev->status, false, ev->request_fault, ev->message);
    tdm_node_req_drop(n, r);
}

/* ---- life cycle ---- */

tdm_node_t *tdm_node_new(const tdm_config_t *cfg, const char *node_id, const tdm_node_ops_t *ops,
                         void *h, tdm_net_t *net, const tdm_logger_t *log, tdm_error_t *err)
{
    const tdm_node_config_t *node = tdm_node_pick(cfg, node_id, ops->role, err);
    if (!node)
        return NULL;
    TDM_ASSERT(ops->req_size >= sizeof(tdm_node_req_t));
    tdm_node_t *n = calloc(1, sizeof *n);
    if (!n) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    n->cfg = cfg;
    n->node = node;
    n->ops = ops;
    n->h = h;
    n->net = net;
    if (log)
        n->log = *log;
    else
        tdm_log_init(&n->log, node->id);
    if (table_open(n, (uint32_t)node->max_running + TDM_NODE_MAX_WAITING, err) != TDM_OK ||
        tdm_node_runtime_open(&n->rt, cfg, node, ops->mode, err) != TDM_OK) {
        tdm_node_destroy(&n);
        return NULL;
    }
    return n;
}

int tdm_node_connect(tdm_node_t *n, const char *kv_endpoint, tdm_error_t *err)
{
    size_t n_eps;
    const char *const *eps = tdm_config_router_endpoints(n->cfg, &n_eps);
    uint64_t instance = tdm_node_instance_new(); /* one identity towards every router */
    for (size_t i = 0; i < n_eps && i < TDM_CONFIG_MAX_ROUTERS; i++) {
        n->links[i] = tdm_node_link_start(n->net, n->cfg, n->node, &n->rt, kv_endpoint, eps[i],
                                          instance, &n->log, err);
        if (!n->links[i]) {
            while (n->n_links > 0)
                tdm_node_link_destroy(&n->links[--n->n_links]);
            return err && err->code ? err->code : TDM_EINTERNAL;
        }
        n->n_links++;
    }
    if (n->n_links > 1)
        TDM_LOG_INFOF(&n->log, NULL, "registering with %zu routers", n->n_links);
    return TDM_OK;
}

void tdm_node_drop_all(tdm_node_t *n)
{
    if (n && n->reqs && n->buckets && n->free_list)
        for (uint32_t i = 0; i < n->n_reqs; i++)
            if (entry(n, i)->used)
                tdm_node_req_drop(n, entry(n, i));
}

void tdm_node_destroy(tdm_node_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_node_t *n = *self_p;
    tdm_node_drop_all(n);
    for (size_t i = 0; i < n->n_links; i++)
        tdm_node_link_destroy(&n->links[i]);
    tdm_node_runtime_close(&n->rt);
    free(n->reqs);
    free(n->buckets);
    free(n->free_list);
    free(n);
    *self_p = NULL;
}

tdm_node_runtime_t *tdm_node_rt(tdm_node_t *n)
{
    return &n->rt;
}

const tdm_node_config_t *tdm_node_cfg(const tdm_node_t *n)
{
    return n->node;
}

const tdm_logger_t *tdm_node_log(const tdm_node_t *n)
{
    return &n->log;
}

tdm_node_link_t *tdm_node_router(tdm_node_t *n)
{
    return n->n_links ? n->links[0] : NULL;
}

tdm_node_link_t *tdm_node_router_at(tdm_node_t *n, size_t i)
{
    return i < n->n_links ? n->links[i] : NULL;
}

size_t tdm_node_n_routers(const tdm_node_t *n)
{
    return n->n_links;
}

/* The link registered with router instance `router`, NULL when none is (gone or 0). */
static tdm_node_link_t *link_of(tdm_node_t *n, uint64_t router)
{
    for (size_t i = 0; router && i < n->n_links; i++)
        if (tdm_node_link_router_instance(n->links[i]) == router)
            return n->links[i];
    return NULL;
}

tdm_sock_t *tdm_node_sock(tdm_node_t *n, uint64_t router_instance)
{
    tdm_node_link_t *l = link_of(n, router_instance);
    return l ? tdm_node_link_sock(l) : NULL;
}

/* ---- the loop ---- */

/* NODE_CANCEL: only the router that dispatched an attempt may cancel it. */
static void on_cancel(tdm_node_t *n, const tdm_frame_t *f)
{
    Tandem__V1__NodeCancel *m =
        (Tandem__V1__NodeCancel *)tdm_frame_unpack(f, &tandem__v1__node_cancel__descriptor);
    if (!m)
        return;
    tdm_node_req_t *r = m->attempt_id ? tdm_node_req_find(n, m->attempt_id) : NULL;
    if (r && r->att.router_instance == f->instance_id) {
        TDM_LOG_DEBUGF(&n->log, r->att.label, "cancelled by the router");
        tdm_node_req_drop(n, r);
    }
    tandem__v1__node_cancel__free_unpacked(m, NULL);
}

/* A frame from the router of link l (its instance is f->instance_id: the link forwards no
 * other); answers go back on the same link. */
static void on_frame(tdm_node_t *n, tdm_node_link_t *l, const tdm_frame_t *f)
{
    tdm_sock_t *s = tdm_node_link_sock(l);
    if (f->method == TANDEM__V1__METHOD__METHOD_NODE_CANCEL)
        on_cancel(n, f);
    else if (f->method == TANDEM__V1__METHOD__METHOD_NODE_STATUS)
        tdm_node_reply_status(s, f, n->cfg, n->node, &n->rt, l);
    else if (!n->ops->frame(n->h, f) && f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST)
        tdm_sock_reply_error(s, f, TDM_EINVALID, "unknown method %d on a %s node", f->method,
                             tdm_config_node_role_name(n->ops->role));
}

/* Waits for input (not at all while the worker has work). false when polling failed. */
static bool wait_input(tdm_node_t *n)
{
    void *extra = NULL;
    int idle_ms = n->ops->wait(n->h, &extra);
    zmq_pollitem_t items[TDM_CONFIG_MAX_ROUTERS + 1];
    int n_items = 0;
    for (size_t i = 0; i < n->n_links; i++)
        items[n_items++] =
            (zmq_pollitem_t){tdm_sock_zsock(tdm_node_link_sock(n->links[i])), 0, ZMQ_POLLIN, 0};
    if (extra)
        items[n_items++] = (zmq_pollitem_t){extra, 0, ZMQ_POLLIN, 0};
    int timeout = tdm_worker_busy(n->rt.worker) ? 0 : idle_ms;
    return zmq_poll(items, n_items, timeout) >= 0 || zmq_errno() == EINTR;
}

/* One forward pass when there is work; its events go to the handler. */
static void step(tdm_node_t *n)
{
    if (!tdm_worker_busy(n->rt.worker))
        return;
    const tdm_worker_event_t *ev;
    uint32_t n_ev;
    tdm_error_t err = {0};
    if (tdm_worker_step(n->rt.worker, &ev, &n_ev, &err) != TDM_OK)
        TDM_LOG_ERRORF(&n->log, NULL, "forward pass failed: %s", err.msg);
    for (uint32_t i = 0; i < n_ev; i++)
        if (ev[i].user) /* every sequence of a node carries its entry */
            n->ops->event(n->h, ev[i].user, &ev[i]);
    tdm_worker_events_done(n->rt.worker); /* their prompt logprobs are sent: free the reserve */
}

/* Ends r when its router is gone (no link is registered with the instance that dispatched
 * it: the router restarted, or was silent TDM_NODE_LINK_LOST_TIMEOUTS heartbeat timeouts; no
 * report: nobody would read it), its deadline passed or the handler's wait for it ran out.
 * routers[n_routers]: the instances the links are registered with now. */
static void expire(tdm_node_t *n, tdm_node_req_t *r, const uint64_t *routers, size_t n_routers,
                   uint64_t now_ms, double now)
{
    bool router_live = false;
    for (size_t i = 0; i < n_routers; i++)
        router_live |= routers[i] == r->att.router_instance;
    if (!router_live) {
        TDM_LOG_INFOF(&n->log, r->att.label,
                      "dropped: dispatched by router instance %016" PRIx64 ", which is gone",
                      r->att.router_instance);
        tdm_node_req_drop(n, r);
    } else if (r->deadline_ms && now_ms > r->deadline_ms) {
        tdm_node_req_fail(n, r, TDM_EDEADLINE, false, n->ops->deadline_msg);
    } else if (r->wait_until > 0 && now > r->wait_until) {
        tdm_node_req_fail(n, r, TDM_EDEADLINE, true, n->ops->wait_msg);
    }
}

/* Every TIMER_PERIOD_S: expiry of every request, and the load for the next heartbeat. */
static void timers(tdm_node_t *n)
{
    double now = tdm_time_now();
    if (now - n->last_timers <= TIMER_PERIOD_S)
        return;
    n->last_timers = now;
    uint64_t now_ms = tdm_net_now_ms();
    uint64_t routers[TDM_CONFIG_MAX_ROUTERS];
    for (size_t i = 0; i < n->n_links; i++)
        routers[i] = tdm_node_link_router_instance(n->links[i]);
    for (uint32_t i = 0; i < n->n_reqs; i++)
        if (entry(n, i)->used)
            expire(n, entry(n, i), routers, n->n_links, now_ms, now);
    tdm_node_load_t ld;
    tdm_node_load_collect(n->rt.worker, n->rt.pool, &ld);
    for (size_t i = 0; i < n->n_links; i++)
        tdm_node_link_set_load(n->links[i], &ld);
}

/* Fails what is in flight so the router re-dispatches it, frees every block, and gives the
 * last messages time to reach the router. */
static void shut_down(tdm_node_t *n)
{
    char msg[64];
    snprintf(msg, sizeof msg, "%s node shutting down", tdm_config_node_role_name(n->ops->role));
    for (uint32_t i = 0; i < n->n_reqs; i++)
        if (entry(n, i)->used)
            tdm_node_req_fail(n, entry(n, i), TDM_EUNAVAILABLE, n->ops->shutdown_retryable, msg);
    for (size_t i = 0; i < n->n_links; i++)
        if (tdm_node_link_flush(n->links[i], SHUTDOWN_FLUSH_MS) != TDM_OK)
            TDM_LOG_DEBUGF(&n->log, NULL,
                           "router %zu did not confirm the last messages within %d ms", i,
                           SHUTDOWN_FLUSH_MS);
    TDM_LOG_INFOF(&n->log, NULL, "%s node stopped", tdm_config_node_role_name(n->ops->role));
}

int tdm_node_serve(tdm_node_t *n, volatile sig_atomic_t *stop, tdm_error_t *err)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    int rc = 0;
    while (!*stop) {
        char why[TDM_ERRMSG_MAX];
        bool rejected = false;
        for (size_t i = 0; !rejected && i < n->n_links; i++)
            rejected = tdm_node_link_state(n->links[i], why, sizeof why) == TDM_NODE_LINK_REJECTED;
        if (rejected) {
            rc = tdm_error_set(err, TDM_EPRECONDITION, "the router refused this node: %s", why);
            break;
        }
        if (!wait_input(n))
            break;
        for (size_t i = 0; i < n->n_links; i++) {
            tdm_sock_t *s = tdm_node_link_sock(n->links[i]);
            while (tdm_sock_recv(s, &f, 0) == 0) {
                on_frame(n, n->links[i], &f);
                tdm_frame_clear(&f);
            }
        }
        n->ops->tick(n->h);
        step(n);
        timers(n);
    }
    tdm_frame_clear(&f);
    shut_down(n);
    return rc;
}
