/* decode.c - the decode node: reserves KV blocks when the router announces a request,
 * receives the prompt's KV pages from a prefill node into them, adds the sequence to the
 * running batch and steps all running sequences together (continuous batching), emitting a
 * TokenEvent per token and Finished at the end. Without a prefill node the router asks it to
 * prefill locally. Runs on one thread (the engine thread); the router link has its own. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "tandem/daemon.h"
#include "tandem/node.h"
#include "tandem/proto.h"
#include "tandem/transfer.h"

/* A reservation without a deadline waits this long for its KV pages before it is dropped (a
 * guard against lost messages; requests from the router always carry a deadline, and a long
 * prompt on a busy prefill node may legitimately take minutes). */
#define RESERVATION_TTL_S 600.0

typedef struct dres {
    bool used;
    bool local;             /* local prefill: the sequence is in the worker already */
    bool in_worker;         /* KV arrived (or local): the worker owns the sequence */
    tdm_node_attempt_t att; /* att.key: the worker's id for it */
    tdm_kv_seq_t seq;       /* reserved blocks until the KV arrives */
    int32_t *prompt;        /* [n_prompt] */
    uint32_t n_prompt;
    tdm_sampling_params_t sp;
    uint64_t deadline_ms;
    double t_reserved;
    double kv_transfer_s;
    uint64_t kv_transfer_bytes; /* block bytes received (tdm_kv_received_t.bytes) */
} dres_t;

struct tdm_decode {
    const tdm_config_t *cfg;
    const tdm_node_config_t *node;
    tdm_logger_t log;
    tdm_net_t *net;
    tdm_node_runtime_t rt;
    tdm_kv_receiver_t *receiver;
    tdm_node_link_t *link;
    dres_t *res; /* [n_res]: every request this node holds */
    uint32_t n_res;
    double last_load, last_expiry_check;
};

/* The reservation of worker id (attempt key) key. */
static dres_t *res_find(tdm_decode_t *d, const char *key)
{
    for (uint32_t i = 0; i < d->n_res; i++)
        if (d->res[i].used && strcmp(d->res[i].att.key, key) == 0)
            return &d->res[i];
    return NULL;
}

static dres_t *res_find_attempt(tdm_decode_t *d, uint64_t attempt_id)
{
    for (uint32_t i = 0; i < d->n_res; i++)
        if (d->res[i].used && d->res[i].att.attempt_id == attempt_id)
            return &d->res[i];
    return NULL;
}

static void res_drop(tdm_decode_t *d, dres_t *r)
{
    if (r->in_worker)
        tdm_worker_cancel(d->rt.worker, r->att.key);
    tdm_kv_seq_release(d->rt.pool, &r->seq);
    free(r->prompt);
    memset(r, 0, sizeof *r);
}

void tdm_decode_destroy(tdm_decode_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_decode_t *d = *self_p;
    tdm_node_link_destroy(&d->link);
    tdm_kv_receiver_destroy(&d->receiver);
    if (d->res)
        for (uint32_t i = 0; i < d->n_res; i++)
            if (d->res[i].used)
                res_drop(d, &d->res[i]);
    tdm_node_runtime_close(&d->rt);
    free(d->res);
    free(d);
    *self_p = NULL;
}

tdm_node_link_t *tdm_decode_link(tdm_decode_t *d)
{
    return d->link;
}

tdm_decode_t *tdm_decode_new(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                             const tdm_logger_t *log, tdm_error_t *err)
{
    const tdm_node_config_t *node = tdm_node_pick(cfg, node_id, TDM_NODE_ROLE_DECODE, err);
    if (!node)
        return NULL;
    tdm_decode_t *d = calloc(1, sizeof *d);
    if (!d) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    d->cfg = cfg;
    d->node = node;
    d->net = net;
    if (log)
        d->log = *log;
    else
        tdm_log_init(&d->log, node->id);
    d->n_res = (uint32_t)node->max_running + TDM_NODE_MAX_WAITING;
    d->res = calloc(d->n_res, sizeof *d->res);
    if (!d->res) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out_destroy;
    }
    if (tdm_node_runtime_open(&d->rt, cfg, node, TDM_WORKER_MODE_DECODE, err) != TDM_OK)
        goto out_destroy;
    tdm_curve_keys_t curve;
    tdm_kv_receiver_opts_t ro = {0};
    ro.endpoint = node->kv_endpoint;
    ro.node_id = node->id;
    ro.model_fingerprint = d->rt.fingerprint;
    ro.curve = tdm_node_curve_kv(&d->rt.keys, &curve);
    ro.log = &d->log;
    d->receiver = tdm_kv_receiver_new(net, d->rt.pool, &ro, err);
    if (!d->receiver) {
        tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE,
                         "KV endpoint %s: ", node->kv_endpoint);
        goto out_destroy;
    }
    /* Prefill nodes connect to what is registered: kv_advertise when the bound endpoint is
     * not reachable as written (tcp://0.0.0.0:7610 in a container), else the bound one. */
    const char *kv_ep =
        node->kv_advertise ? node->kv_advertise : tdm_kv_receiver_endpoint(d->receiver);
    d->link = tdm_node_link_start(net, cfg, node, &d->rt, kv_ep, &d->log, err);
    if (!d->link)
        goto out_destroy;
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(d->rt.pool, &ks);
    TDM_LOG_INFOF(&d->log, NULL,
                  "decode node ready backend=%s kv_blocks=%u kv_mib=%.1f n_ctx=%u kv=%s router=%s "
                  "curve=%s",
                  tdm_engine_backend_name(d->rt.engine), ks.n_blocks,
                  (double)d->rt.kv_bytes / 1048576.0, d->rt.n_ctx, kv_ep,
                  tdm_config_router_advertise(cfg), tdm_config_curve_on(cfg) ? "on" : "off");
    return d;
out_destroy:
    tdm_decode_destroy(&d);
    return NULL;
}

static void report_failed(tdm_decode_t *d, const tdm_node_attempt_t *a, int status, bool retryable,
                          const char *msg)
{
    tdm_node_report_failed(tdm_node_link_sock(d->link), &d->log, a, status, retryable, msg);
}

/* DECODE_RESERVE: allocate blocks for the prompt (or start a local prefill) and answer. */
static void on_reserve(tdm_decode_t *d, const tdm_frame_t *f)
{
    tdm_sock_t *s = tdm_node_link_sock(d->link);
    Tandem__V1__DecodeReserve *m =
        (Tandem__V1__DecodeReserve *)tdm_frame_unpack(f, &tandem__v1__decode_reserve__descriptor);
    if (!m) {
        tdm_sock_reply_error(s, f, TDM_EINVALID, "DecodeReserve does not decode");
        return;
    }
    tdm_error_t err = {0};
    dres_t *r = NULL;
    tdm_node_attempt_t att;
    if (tdm_node_attempt_init(&att, m->request_id, m->attempt_id, f->instance_id, &err) != 0) {
        tdm_sock_reply_error(s, f, TDM_EINVALID, "%s", err.msg);
        goto out_free;
    }
    const char *id = att.label;
    if (res_find_attempt(d, att.attempt_id)) {
        tdm_sock_reply_error(s, f, TDM_EINTERNAL,
                             "attempt %s of request '%s' is already on this node", att.key, id);
        goto out_free;
    }
    uint32_t n_prompt = (uint32_t)m->n_prompt_tokens;
    if (m->n_prompt_tokens == 0 || m->n_prompt_tokens + 1 > d->rt.n_ctx) {
        tdm_sock_reply_error(s, f, TDM_EINVALID,
                             "prompt_tokens: %zu tokens; 1..%u fit the context of %u tokens",
                             m->n_prompt_tokens, d->rt.n_ctx - 1, d->rt.n_ctx);
        goto out_free;
    }
    for (uint32_t i = 0; i < n_prompt; i++)
        if (m->prompt_tokens[i] < 0 || (uint32_t)m->prompt_tokens[i] >= d->rt.n_vocab) {
            tdm_sock_reply_error(s, f, TDM_EINVALID,
                                 "prompt_tokens[%u]: token id %d is outside the vocabulary "
                                 "[0, %u)",
                                 i, m->prompt_tokens[i], d->rt.n_vocab);
            goto out_free;
        }
    tdm_sampling_params_t sp;
    if (tdm_node_sampling(m->sampling, m->max_tokens, d->rt.n_vocab, &sp, &err) != TDM_OK) {
        tdm_sock_reply_error(s, f, TDM_EINVALID, "%s", err.msg);
        goto out_free;
    }
    for (uint32_t i = 0; i < d->n_res && !r; i++)
        if (!d->res[i].used)
            r = &d->res[i];
    if (!r) {
        tdm_sock_reply_error(s, f, TDM_ERESOURCE, "decode node holds %u requests already",
                             d->n_res);
        goto out_free;
    }
    memset(r, 0, sizeof *r);
    tdm_kv_seq_init(&r->seq);
    r->att = att;
    r->sp = sp;
    r->n_prompt = n_prompt;
    r->deadline_ms = m->deadline_unix_ms;
    r->t_reserved = tdm_time_now();
    if (m->local_prefill) {
        tdm_worker_req_t req = {att.key, m->prompt_tokens, n_prompt, &sp, NULL, 0};
        uint32_t need = (uint32_t)tdm_kv_blocks_for_tokens(&d->rt.layout, n_prompt + 1);
        if (need > tdm_kv_pool_available(d->rt.pool)) {
            tdm_sock_reply_error(s, f, TDM_ERESOURCE, "need %u KV blocks, %u free", need,
                                 tdm_kv_pool_available(d->rt.pool));
            goto out_free;
        }
        if (tdm_worker_add(d->rt.worker, &req, &err) != TDM_OK) {
            tdm_sock_reply_error(s, f, err.code, "%s", err.msg);
            goto out_free;
        }
        r->used = r->local = r->in_worker = true;
    } else {
        r->prompt = malloc((size_t)n_prompt * sizeof *r->prompt);
        if (!r->prompt) {
            tdm_sock_reply_error(s, f, TDM_ERESOURCE, "out of memory");
            goto out_free;
        }
        memcpy(r->prompt, m->prompt_tokens, (size_t)n_prompt * sizeof *r->prompt);
        if (tdm_kv_seq_reserve(d->rt.pool, &r->seq, n_prompt) != TDM_OK) {
            uint32_t need = (uint32_t)tdm_kv_blocks_for_tokens(&d->rt.layout, n_prompt);
            tdm_sock_reply_error(s, f, TDM_ERESOURCE, "need %u KV blocks, %u free", need,
                                 tdm_kv_pool_available(d->rt.pool));
            free(r->prompt);
            memset(r, 0, sizeof *r);
            goto out_free;
        }
        r->used = true;
    }
    Tandem__V1__ReserveAck ack = TANDEM__V1__RESERVE_ACK__INIT;
    ack.request_id = r->att.label;
    ack.attempt_id = r->att.attempt_id;
    ack.n_blocks = r->seq.n_blocks;
    tdm_sock_reply(s, f, &ack.base);
    TDM_LOG_DEBUGF(&d->log, id, "reserved attempt=%s prompt_tokens=%u blocks=%u local=%d", att.key,
                   n_prompt, r->seq.n_blocks, r->local);
out_free:
    tandem__v1__decode_reserve__free_unpacked(m, NULL);
}

static void on_cancel(tdm_decode_t *d, const tdm_frame_t *f)
{
    Tandem__V1__NodeCancel *m =
        (Tandem__V1__NodeCancel *)tdm_frame_unpack(f, &tandem__v1__node_cancel__descriptor);
    if (!m)
        return;
    dres_t *r = m->attempt_id ? res_find_attempt(d, m->attempt_id) : NULL;
    if (r && r->att.router_instance != f->instance_id)
        r = NULL; /* only the router that dispatched it may cancel it */
    if (r) {
        TDM_LOG_DEBUGF(&d->log, r->att.label, "cancelled by the router");
        res_drop(d, r);
    }
    tandem__v1__node_cancel__free_unpacked(m, NULL);
}

static void on_router_frame(tdm_decode_t *d, const tdm_frame_t *f)
{
    tdm_sock_t *s = tdm_node_link_sock(d->link);
    switch (f->method) {
    case TANDEM__V1__METHOD__METHOD_DECODE_RESERVE: on_reserve(d, f); break;
    case TANDEM__V1__METHOD__METHOD_NODE_CANCEL: on_cancel(d, f); break;
    case TANDEM__V1__METHOD__METHOD_NODE_STATUS:
        tdm_node_reply_status(s, f, d->node, &d->rt, d->link);
        break;
    default:
        if (f->kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST)
            tdm_sock_reply_error(s, f, TDM_EINVALID, "unknown method %d on a decode node",
                                 f->method);
    }
}

/* The KV receiver asks which blocks were reserved for a request. */
static int lookup(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                  const uint32_t **blocks, uint32_t *n_blocks, char *msg, size_t cap)
{
    tdm_decode_t *d = user;
    dres_t *r = res_find_attempt(d, attempt_id);
    if (!r || r->in_worker) {
        snprintf(msg, cap,
                 "no reservation for attempt %016" PRIx64 " of request '%s' (cancelled, "
                 "superseded or unknown)",
                 attempt_id, request_id);
        return TDM_ENOTFOUND;
    }
    if (n_tokens != r->n_prompt) {
        snprintf(msg, cap, "transfer has %u tokens; the reservation is for %u prompt tokens",
                 n_tokens, r->n_prompt);
        return TDM_EINVALID;
    }
    *blocks = r->seq.blocks;
    *n_blocks = r->seq.n_blocks;
    return 0;
}

static void on_received(tdm_decode_t *d, const tdm_kv_received_t *in)
{
    dres_t *r = res_find_attempt(d, in->attempt_id);
    if (!r || r->in_worker)
        return; /* unknown or cancelled: the receiver already rejected or dropped it */
    if (in->status == TDM_ECANCELLED) {
        /* The sender withdrew the transfer (the router cancelled the request, its deadline
         * passed on the prefill node, or the prefill node is stopping): the prefill node
         * reports why, if anything is to be reported. The reservation goes. */
        TDM_LOG_DEBUGF(&d->log, r->att.label, "KV transfer withdrawn by the sender");
        res_drop(d, r);
        return;
    }
    if (in->status != 0) {
        /* A bad transfer: the reservation goes; the router re-dispatches the request. */
        char msg[TDM_ERRMSG_MAX + 32];
        snprintf(msg, sizeof msg, "KV transfer rejected: %s", in->message);
        report_failed(d, &r->att, in->status, true, msg);
        res_drop(d, r);
        return;
    }
    r->kv_transfer_s = tdm_time_now() - r->t_reserved - in->prefill_s;
    if (r->kv_transfer_s < 0)
        r->kv_transfer_s = 0;
    r->kv_transfer_bytes = in->bytes;
    r->seq.n_tokens = r->n_prompt;
    tdm_worker_req_t req = {r->att.key, r->prompt, r->n_prompt, &r->sp, &r->seq, in->first_token};
    tdm_error_t err = {0};
    if (tdm_worker_add(d->rt.worker, &req, &err) != TDM_OK) {
        report_failed(d, &r->att, err.code, err.code == TDM_ERESOURCE, err.msg);
        res_drop(d, r);
        return;
    }
    r->in_worker = true;
    free(r->prompt);
    r->prompt = NULL;
    TDM_LOG_DEBUGF(&d->log, r->att.label, "KV received blocks=%u bytes=%" PRIu64 " from=%s",
                   in->n_blocks, in->bytes, in->sender_node_id);
}

static void on_event(tdm_decode_t *d, const tdm_worker_event_t *ev)
{
    dres_t *r = res_find(d, ev->request_id);
    tdm_sock_t *s = tdm_node_link_sock(d->link);
    if (!r)
        return; /* dropped meanwhile: nobody waits for it */
    switch (ev->kind) {
    case TDM_WORKER_EVENT_TOKEN: tdm_node_send_token(s, &r->att, ev); break;
    case TDM_WORKER_EVENT_FINISHED: {
        Tandem__V1__Finished fin = TANDEM__V1__FINISHED__INIT;
        fin.request_id = r->att.label;
        fin.attempt_id = r->att.attempt_id;
        fin.reason = ev->finish == TDM_WORKER_FINISH_STOP
                         ? TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP
                         : TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH;
        fin.completion_tokens = ev->completion_tokens;
        fin.kv_transfer_s = r->kv_transfer_s;
        fin.kv_transfer_bytes = r->kv_transfer_bytes;
        fin.preemptions = ev->preemptions;
        tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_FINISHED, &fin.base);
        r->in_worker = false; /* the worker freed it already */
        res_drop(d, r);
        break;
    }
    case TDM_WORKER_EVENT_FAILED:
        report_failed(d, &r->att, ev->status, false, ev->message);
        r->in_worker = false;
        res_drop(d, r);
        break;
    default: break;
    }
}

int tdm_decode_run(tdm_decode_t *d, volatile sig_atomic_t *stop, tdm_error_t *err)
{
    tdm_sock_t *s = tdm_node_link_sock(d->link);
    tdm_frame_t f;
    tdm_frame_init(&f);
    int rc = 0;
    while (!*stop) {
        char why[TDM_ERRMSG_MAX];
        if (tdm_node_link_state(d->link, why, sizeof why) == TDM_NODE_LINK_REJECTED) {
            rc = tdm_error_set(err, TDM_EPRECONDITION, "the router refused this node: %s", why);
            break;
        }
        bool busy = tdm_worker_busy(d->rt.worker);
        zmq_pollitem_t items[2] = {{tdm_sock_zsock(s), 0, ZMQ_POLLIN, 0},
                                   {tdm_kv_receiver_zsock(d->receiver), 0, ZMQ_POLLIN, 0}};
        if (zmq_poll(items, 2, busy ? 0 : 20) < 0 && zmq_errno() != EINTR)
            break;
        while (tdm_sock_recv(s, &f, 0) == 0) {
            on_router_frame(d, &f);
            tdm_frame_clear(&f);
        }
        tdm_kv_received_t in;
        while (tdm_kv_receiver_recv(d->receiver, 0, lookup, d, &in) == 1)
            on_received(d, &in);
        if (tdm_worker_busy(d->rt.worker)) {
            const tdm_worker_event_t *ev;
            uint32_t n;
            tdm_error_t serr = {0};
            if (tdm_worker_step(d->rt.worker, &ev, &n, &serr) != TDM_OK)
                TDM_LOG_ERRORF(&d->log, NULL, "forward pass failed: %s", serr.msg);
            for (uint32_t i = 0; i < n; i++)
                on_event(d, &ev[i]);
        }
        double now = tdm_time_now();
        if (now - d->last_expiry_check > 0.05) {
            d->last_expiry_check = now;
            uint64_t now_ms = tdm_net_now_ms();
            uint64_t router = tdm_node_link_router_instance(d->link);
            for (uint32_t i = 0; i < d->n_res; i++) {
                dres_t *r = &d->res[i];
                if (!r->used)
                    continue;
                if (router && r->att.router_instance != router) {
                    /* the router that dispatched it restarted: nobody will read its tokens */
                    TDM_LOG_INFOF(&d->log, r->att.label,
                                  "dropped: dispatched by router instance %016" PRIx64
                                  ", which is gone",
                                  r->att.router_instance);
                    res_drop(d, r);
                } else if (r->deadline_ms && now_ms > r->deadline_ms) {
                    report_failed(d, &r->att, TDM_EDEADLINE, false, "deadline passed");
                    res_drop(d, r);
                } else if (!r->in_worker && !r->deadline_ms &&
                           now - r->t_reserved > RESERVATION_TTL_S) {
                    report_failed(d, &r->att, TDM_EDEADLINE, true,
                                  "no KV pages arrived for the reservation within 600 s");
                    res_drop(d, r);
                }
            }
        }
        if (now - d->last_load > 0.05) {
            d->last_load = now;
            tdm_node_load_t ld;
            tdm_node_load_collect(d->rt.worker, d->rt.pool, &ld);
            tdm_node_link_set_load(d->link, &ld);
        }
    }
    tdm_frame_clear(&f);
    for (uint32_t i = 0; i < d->n_res; i++)
        if (d->res[i].used) {
            report_failed(d, &d->res[i].att, TDM_EUNAVAILABLE, false, "decode node shutting down");
            res_drop(d, &d->res[i]);
        }
    tdm_node_link_flush(d->link);
    TDM_LOG_INFOF(&d->log, NULL, "decode node stopped");
    return rc;
}
