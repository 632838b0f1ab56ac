/* prefill.c - the prefill node: takes PrefillTasks from the router, packs prompts into
 * forward passes (chunked under max_batch_tokens), reports each first token at once, ships
 * the KV pages to the decode node the task names, and reports failures so the router can
 * re-dispatch. Runs on one thread (the engine thread); the router link has its own. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <zmq.h>

#include "tandem/daemon.h"
#include "tandem/node.h"
#include "tandem/proto.h"
#include "tandem/transfer.h"

typedef struct ptask {
    bool used;
    bool shipping;          /* KV handed to the sender */
    tdm_node_attempt_t att; /* att.key: the worker's id for it */
    char decode_ep[256];
    char decode_id[TDM_NODE_ID_MAX + 1];
    uint64_t deadline_ms;
    double prefill_s;
} ptask_t;

struct tdm_prefill {
    const tdm_config_t *cfg;
    const tdm_node_config_t *node;
    tdm_logger_t log;
    tdm_net_t *net;
    tdm_node_runtime_t rt;
    tdm_kv_sender_t *sender;
    tdm_node_link_t *link;
    ptask_t *tasks; /* [n_tasks] */
    uint32_t n_tasks;
    double last_load, last_deadline_check;
};

/* The task of worker id (attempt key) key. */
static ptask_t *task_find(tdm_prefill_t *p, const char *key)
{
    for (uint32_t i = 0; i < p->n_tasks; i++)
        if (p->tasks[i].used && strcmp(p->tasks[i].att.key, key) == 0)
            return &p->tasks[i];
    return NULL;
}

static ptask_t *task_find_attempt(tdm_prefill_t *p, uint64_t attempt_id)
{
    for (uint32_t i = 0; i < p->n_tasks; i++)
        if (p->tasks[i].used && p->tasks[i].att.attempt_id == attempt_id)
            return &p->tasks[i];
    return NULL;
}

static ptask_t *task_alloc(tdm_prefill_t *p)
{
    for (uint32_t i = 0; i < p->n_tasks; i++)
        if (!p->tasks[i].used)
            return &p->tasks[i];
    return NULL;
}

void tdm_prefill_destroy(tdm_prefill_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_prefill_t *p = *self_p;
    tdm_node_link_destroy(&p->link);
    tdm_kv_sender_destroy(&p->sender);
    tdm_node_runtime_close(&p->rt);
    free(p->tasks);
    free(p);
    *self_p = NULL;
}

tdm_node_link_t *tdm_prefill_link(tdm_prefill_t *p)
{
    return p->link;
}

tdm_prefill_t *tdm_prefill_new(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                               const tdm_logger_t *log, tdm_error_t *err)
{
    const tdm_node_config_t *node = tdm_node_pick(cfg, node_id, TDM_NODE_ROLE_PREFILL, err);
    if (!node)
        return NULL;
    tdm_prefill_t *p = calloc(1, sizeof *p);
    if (!p) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    p->cfg = cfg;
    p->node = node;
    p->net = net;
    if (log)
        p->log = *log;
    else
        tdm_log_init(&p->log, node->id);
    p->n_tasks = (uint32_t)node->max_running + TDM_NODE_MAX_WAITING;
    p->tasks = calloc(p->n_tasks, sizeof *p->tasks);
    if (!p->tasks) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out_destroy;
    }
    if (tdm_node_runtime_open(&p->rt, cfg, node, TDM_WORKER_MODE_PREFILL, err) != TDM_OK)
        goto out_destroy;
    tdm_curve_keys_t curve;
    const tdm_curve_keys_t *cp = tdm_node_curve_kv(&p->rt.keys, &curve);
    tdm_kv_sender_opts_t so = {0};
    so.node_id = node->id;
    so.model_fingerprint = p->rt.fingerprint;
    so.backend = TDM_KV_BACKEND_TCP;
    so.curve = cp;
    /* Generous: the decode node acknowledges between forward passes, which can be long on a
     * busy CPU; a dead decode node is noticed by the router's heartbeats much sooner and its
     * requests cancelled here. */
    so.timeout_ms = 60000;
    so.log = &p->log;
    p->sender = tdm_kv_sender_new(net, p->rt.pool, &so, err);
    if (!p->sender)
        goto out_destroy;
    p->link = tdm_node_link_start(net, cfg, node, &p->rt, NULL, &p->log, err);
    if (!p->link)
        goto out_destroy;
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(p->rt.pool, &ks);
    TDM_LOG_INFOF(
        &p->log, NULL,
        "prefill node ready backend=%s kv_blocks=%u kv_mib=%.1f n_ctx=%u router=%s curve=%s",
        tdm_engine_backend_name(p->rt.engine), ks.n_blocks, (double)p->rt.kv_bytes / 1048576.0,
        p->rt.n_ctx, tdm_config_router_advertise(cfg), tdm_config_curve_on(cfg) ? "on" : "off");
    return p;
out_destroy:
    tdm_prefill_destroy(&p);
    return NULL;
}

/* Tells the router a task failed. */
static void report_failed(tdm_prefill_t *p, const tdm_node_attempt_t *a, int status, bool retryable,
                          const char *msg)
{
    tdm_node_report_failed(tdm_node_link_sock(p->link), &p->log, a, status, retryable, msg);
}

static void drop_task(tdm_prefill_t *p, ptask_t *t)
{
    tdm_worker_cancel(p->rt.worker, t->att.key);
    if (t->shipping)
        tdm_kv_sender_cancel(p->sender, t->att.attempt_id);
    memset(t, 0, sizeof *t);
}

static void on_prefill_task(tdm_prefill_t *p, const tdm_frame_t *f)
{
    Tandem__V1__PrefillTask *m =
        (Tandem__V1__PrefillTask *)tdm_frame_unpack(f, &tandem__v1__prefill_task__descriptor);
    if (!m) {
        TDM_LOG_WARNF(&p->log, NULL, "dropped a PrefillTask that does not decode");
        return;
    }
    tdm_error_t err = {0};
    tdm_node_attempt_t att;
    if (tdm_node_attempt_init(&att, m->request_id, m->attempt_id, f->instance_id, &err) != 0) {
        TDM_LOG_WARNF(&p->log, NULL, "dropped a PrefillTask: %s", err.msg);
        goto out_free;
    }
    const char *id = att.label;
    if (task_find_attempt(p, att.attempt_id)) {
        /* the router never sends one attempt twice: a duplicate is dropped, the first runs */
        TDM_LOG_WARNF(&p->log, id, "dropped a second PrefillTask for attempt %s", att.key);
        goto out_free;
    }
    if (!m->decode_kv_endpoint || !m->decode_kv_endpoint[0] ||
        strlen(m->decode_kv_endpoint) >= sizeof(((ptask_t *)0)->decode_ep)) {
        report_failed(p, &att, TDM_EINVALID, false, "decode_kv_endpoint: missing or too long");
        goto out_free;
    }
    tdm_sampling_params_t sp;
    if (tdm_node_sampling(m->sampling, m->max_tokens, p->rt.n_vocab, &sp, &err) != TDM_OK) {
        report_failed(p, &att, err.code, false, err.msg);
        goto out_free;
    }
    ptask_t *t = task_alloc(p);
    if (!t) {
        report_failed(p, &att, TDM_ERESOURCE, true, "prefill node task table full");
        goto out_free;
    }
    tdm_worker_req_t req = {att.key, m->prompt_tokens, (uint32_t)m->n_prompt_tokens, &sp, NULL, 0};
    if (m->n_prompt_tokens > UINT32_MAX || tdm_worker_add(p->rt.worker, &req, &err) != TDM_OK) {
        report_failed(p, &att, err.code ? err.code : TDM_EINVALID, err.code == TDM_ERESOURCE,
                      err.msg[0] ? err.msg : "prompt too long");
        goto out_free;
    }
    t->used = true;
    t->att = att;
    snprintf(t->decode_ep, sizeof t->decode_ep, "%s", m->decode_kv_endpoint);
    snprintf(t->decode_id, sizeof t->decode_id, "%s", m->decode_node_id ? m->decode_node_id : "");
    t->deadline_ms = m->deadline_unix_ms;
    TDM_LOG_DEBUGF(&p->log, id, "prefill task attempt=%s prompt_tokens=%zu decode=%s", att.key,
                   m->n_prompt_tokens, t->decode_id);
out_free:
    tandem__v1__prefill_task__free_unpacked(m, NULL);
}

static void on_cancel(tdm_prefill_t *p, const tdm_frame_t *f)
{
    Tandem__V1__NodeCancel *m =
        (Tandem__V1__NodeCancel *)tdm_frame_unpack(f, &tandem__v1__node_cancel__descriptor);
    if (!m)
        return;
    ptask_t *t = m->attempt_id ? task_find_attempt(p, m->attempt_id) : NULL;
    if (t && t->att.router_instance != f->instance_id)
        t = NULL; /* only the router that dispatched it may cancel it */
    if (t) {
        TDM_LOG_DEBUGF(&p->log, t->att.label, "cancelled by the router");
        drop_task(p, t);
    }
    tandem__v1__node_cancel__free_unpacked(m, NULL);
}

static void on_router_frame(tdm_prefill_t *p, const tdm_frame_t *f)
{
    tdm_sock_t *s = tdm_node_link_sock(p->link);
    switch (f->method) {
    case TANDEM__V1__METHOD__METHOD_PREFILL_TASK: on_prefill_task(p, f); break;
    case TANDEM__V1__METHOD__METHOD_NODE_CANCEL: on_cancel(p, f); break;
    case TANDEM__V1__METHOD__METHOD_NODE_STATUS:
        tdm_node_reply_status(s, f, p->node, &p->rt, p->link);
        break;
    default:
        if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST)
            tdm_sock_reply_error(s, f, TDM_EINVALID, "unknown method %d on a prefill node",
                                 f->method);
    }
}

static void on_event(tdm_prefill_t *p, const tdm_worker_event_t *ev)
{
    ptask_t *t = task_find(p, ev->request_id);
    switch (ev->kind) {
    case TDM_WORKER_EVENT_TOKEN:
        if (t) /* else cancelled in the meantime: nobody waits for it */
            tdm_node_send_token(tdm_node_link_sock(p->link), &t->att, ev);
        break;
    case TDM_WORKER_EVENT_PREFILLED: {
        tdm_kv_seq_t seq = ev->seq;
        if (!t) { /* cancelled in the meantime */
            tdm_kv_seq_release(p->rt.pool, &seq);
            break;
        }
        tdm_kv_send_req_t sr = {0};
        sr.request_id = t->att.label;
        sr.attempt_id = t->att.attempt_id;
        sr.endpoint = t->decode_ep;
        sr.blocks = seq.blocks;
        sr.n_blocks = seq.n_blocks;
        sr.n_tokens = ev->n_tokens;
        sr.first_token = ev->first_token;
        sr.prefill_s = ev->prefill_s;
        /* CURVE: the channel authenticates the decode node the router named by its own key */
        const tdm_node_config_t *dn = tdm_config_find_node(p->cfg, t->decode_id);
        sr.server_key = dn ? dn->curve_public_key : NULL;
        uint64_t xid;
        tdm_error_t err = {0};
        int rc = tdm_kv_sender_send(p->sender, &sr, &xid, &err);
        /* The sender holds its own references; ours go now (into the prefix cache). */
        tdm_kv_seq_release(p->rt.pool, &seq);
        if (rc != TDM_OK) {
            report_failed(p, &t->att, rc, true, err.msg);
            memset(t, 0, sizeof *t);
            break;
        }
        t->shipping = true;
        t->prefill_s = ev->prefill_s;
        break;
    }
    case TDM_WORKER_EVENT_FAILED:
        if (t) {
            report_failed(p, &t->att, ev->status, false, ev->message);
            memset(t, 0, sizeof *t);
        }
        break;
    default: break;
    }
}

static void on_sent(tdm_prefill_t *p, const tdm_kv_send_done_t *d)
{
    ptask_t *t = task_find_attempt(p, d->attempt_id);
    if (d->status == TDM_ECANCELLED) {
        if (t)
            memset(t, 0, sizeof *t);
        return;
    }
    if (d->status != 0) {
        if (t) { /* else cancelled meanwhile: the router no longer waits for it */
            char msg[TDM_ERRMSG_MAX + 64];
            snprintf(msg, sizeof msg, "KV transfer to %s failed: %s", t->decode_id, d->message);
            /* a key mismatch between nodes is the cluster's fault, not the client's: it must
             * not reach the client as UNAUTHENTICATED (HTTP 401) */
            int st = d->status == TDM_EUNAUTHENTICATED ? TDM_EUNAVAILABLE : d->status;
            report_failed(p, &t->att, st, true, msg);
        }
    } else {
        TDM_LOG_DEBUGF(&p->log, d->request_id, "KV shipped bytes=%" PRIu64 " seconds=%.4f",
                       d->bytes, d->seconds);
    }
    if (t)
        memset(t, 0, sizeof *t);
}

int tdm_prefill_run(tdm_prefill_t *p, volatile sig_atomic_t *stop, tdm_error_t *err)
{
    tdm_sock_t *s = tdm_node_link_sock(p->link);
    tdm_frame_t f;
    tdm_frame_init(&f);
    int rc = 0;
    while (!*stop) {
        char why[TDM_ERRMSG_MAX];
        if (tdm_node_link_state(p->link, why, sizeof why) == TDM_NODE_LINK_REJECTED) {
            rc = tdm_error_set(err, TDM_EPRECONDITION, "the router refused this node: %s", why);
            break;
        }
        bool busy = tdm_worker_busy(p->rt.worker);
        int timeout = busy ? 0 : (tdm_kv_sender_in_flight(p->sender) ? 2 : 20);
        zmq_pollitem_t it = {tdm_sock_zsock(s), 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&it, 1, timeout) < 0 && zmq_errno() != EINTR)
            break;
        while (tdm_sock_recv(s, &f, 0) == 0) {
            on_router_frame(p, &f);
            tdm_frame_clear(&f);
        }
        if (busy) {
            const tdm_worker_event_t *ev;
            uint32_t n;
            tdm_error_t serr = {0};
            if (tdm_worker_step(p->rt.worker, &ev, &n, &serr) != TDM_OK)
                TDM_LOG_ERRORF(&p->log, NULL, "forward pass failed: %s", serr.msg);
            for (uint32_t i = 0; i < n; i++)
                on_event(p, &ev[i]);
        }
        tdm_kv_send_done_t done[16];
        int nd;
        while ((nd = tdm_kv_sender_poll(p->sender, 0, done, 16)) > 0)
            for (int i = 0; i < nd; i++)
                on_sent(p, &done[i]);
        double now = tdm_time_now();
        if (now - p->last_deadline_check > 0.05) {
            p->last_deadline_check = now;
            uint64_t now_ms = tdm_net_now_ms();
            uint64_t router = tdm_node_link_router_instance(p->link);
            for (uint32_t i = 0; i < p->n_tasks; i++) {
                ptask_t *t = &p->tasks[i];
                if (t->used && t->deadline_ms && now_ms > t->deadline_ms) {
                    report_failed(p, &t->att, TDM_EDEADLINE, false,
                                  "deadline passed during prefill");
                    drop_task(p, t);
                } else if (t->used && router && t->att.router_instance != router) {
                    TDM_LOG_INFOF(&p->log, t->att.label,
                                  "dropped: dispatched by router instance %016" PRIx64
                                  ", which is gone",
                                  t->att.router_instance);
                    drop_task(p, t);
                }
            }
        }
        if (now - p->last_load > 0.05) {
            p->last_load = now;
            tdm_node_load_t ld;
            tdm_node_load_collect(p->rt.worker, p->rt.pool, &ld);
            tdm_node_link_set_load(p->link, &ld);
        }
    }
    tdm_frame_clear(&f);
    /* Shutdown: fail what is in flight so the router re-dispatches it, free every block. */
    for (uint32_t i = 0; i < p->n_tasks; i++)
        if (p->tasks[i].used) {
            report_failed(p, &p->tasks[i].att, TDM_EUNAVAILABLE, true,
                          "prefill node shutting down");
            drop_task(p, &p->tasks[i]);
        }
    tdm_node_link_flush(p->link);
    TDM_LOG_INFOF(&p->log, NULL, "prefill node stopped");
    return rc;
}
