/* prefill.c - the prefill node: takes PrefillTasks from the router, packs prompts into
 * forward passes (chunked under max_batch_tokens), reports each first token at once, ships
 * the KV pages to the decode node the task names, reports the sender's measured transfer time
 * when the decode node acknowledged them, and reports failures so the router can re-dispatch.
 * EmbedTasks (common/src/node/embed.c) share the same forward passes and keep no KV.
 * A handler of the node serve loop (common/src/node/serve.c), which runs it on one thread
 * (the engine thread); the router link has its own. */
#include "prefill.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/proto.h"
#include "tandem/transfer.h"

/* One task: the serve loop's entry, then what the prefill node adds. */
typedef struct ptask {
    tdm_node_req_t base; /* base.att.attempt_id: the worker's id for it */
    bool in_worker;      /* the worker holds its sequence (until PREFILLED or FAILED) */
    bool shipping;       /* KV handed to the sender */
    char decode_ep[256]; /* the decode node's KV endpoint */
    char decode_id[TDM_NODE_ID_MAX + 1];
    tdm_kv_backend_t backend; /* the router's choice for this pair (PrefillTask.kv_transport) */
} ptask_t;

struct tdm_prefill {
    const tdm_config_t *cfg;
    tdm_node_t *node;
    tdm_node_runtime_t *rt; /* the node's */
    const tdm_logger_t *log;
    tdm_net_t *net;
    /* one sender per KV transport the router chose for some task (index tdm_kv_backend_t);
     * opened on first use, tcp at start on a host pool */
    tdm_kv_sender_t *senders[TDM_KV_BACKEND_CUDA_IPC + 1];
};

static tdm_kv_sender_t *open_sender(tdm_prefill_t *p, tdm_kv_backend_t backend, tdm_error_t *err);

/* ---- hooks ---- */

static void drop(void *h, tdm_node_req_t *r)
{
    tdm_prefill_t *p = h;
    ptask_t *t = (ptask_t *)r;
    if (t->in_worker)
        tdm_worker_cancel(p->rt->worker, r->att.attempt_id);
    if (t->shipping && p->senders[t->backend])
        tdm_kv_sender_cancel(p->senders[t->backend], r->att.attempt_id);
}

/* The PrefillTask's fields a node checks before taking it (its spec: tdm_node_spec_check):
 * TDM_EINVALID with the message. */
static int check_task(tdm_prefill_t *p, const Tandem__V1__PrefillTask *m, tdm_sampling_params_t *sp,
                      tdm_error_t *err)
{
    if (!m->decode_kv_endpoint || !m->decode_kv_endpoint[0] ||
        strlen(m->decode_kv_endpoint) >= sizeof(((ptask_t *)0)->decode_ep))
        return tdm_error_set(err, TDM_EINVALID, "decode_kv_endpoint: missing or too long");
    tdm_kv_backend_t b;
    if (m->kv_transport && m->kv_transport[0] &&
        tdm_kv_backend_parse(m->kv_transport, &b, err) != TDM_OK)
        return TDM_EINVALID;
    return tdm_node_spec_check(m->spec, p->rt->n_ctx, p->rt->n_vocab, sp, err);
}

/* Takes a checked task: an entry, and its prompt into the worker. */
static void start_task(tdm_prefill_t *p, const Tandem__V1__PrefillTask *m,
                       const tdm_node_attempt_t *att, const tdm_sampling_params_t *sp)
{
    ptask_t *t = (ptask_t *)tdm_node_req_new(p->node, att);
    if (!t) {
        tdm_node_fail(p->node, att, TDM_ERESOURCE, true, "prefill node task table full");
        return;
    }
    tdm_error_t err = {0};
    const Tandem__V1__SequenceSpec *spec = m->spec;
    if (tdm_node_constraint(p->rt->grammars, spec->constraint, &t->base.grammar, &err) != TDM_OK) {
        tdm_node_req_fail(p->node, &t->base, err.code, false, err.msg);
        return;
    }
    /* a migrated request resumes after output_tokens: the worker prefills them with the prompt
     * and samples the next output index */
    tdm_worker_req_t req = {.seq_id = att->attempt_id,
                            .prompt = spec->prompt_tokens,
                            .n_prompt = (uint32_t)spec->n_prompt_tokens,
                            .sampling = sp,
                            .user = t,
                            .output = spec->output_tokens,
                            .n_output = (uint32_t)spec->n_output_tokens,
                            .grammar = t->base.grammar,
                            .prompt_logprobs = spec->prompt_logprobs != NULL,
                            .prompt_logprobs_top =
                                spec->prompt_logprobs ? spec->prompt_logprobs->top : 0};
    int rc = tdm_worker_add(p->rt->worker, &req, &err);
    if (rc != TDM_OK) {
        tdm_node_req_fail(p->node, &t->base, rc, rc == TDM_ERESOURCE, err.msg);
        return;
    }
    t->in_worker = true;
    snprintf(t->decode_ep, sizeof t->decode_ep, "%s", m->decode_kv_endpoint);
    snprintf(t->decode_id, sizeof t->decode_id, "%s", m->decode_node_id ? m->decode_node_id : "");
    t->backend = TDM_KV_BACKEND_TCP; /* "" means tcp; check_task parsed the rest */
    if (m->kv_transport && m->kv_transport[0])
        tdm_kv_backend_parse(m->kv_transport, &t->backend, NULL);
    t->base.deadline_ms = spec->deadline_unix_ms;
    TDM_LOG_DEBUGF(p->log, att->label,
                   "prefill task attempt=%s prompt_tokens=%zu output_tokens=%zu decode=%s",
                   att->key, spec->n_prompt_tokens, spec->n_output_tokens, t->decode_id);
}

static void on_prefill_task(tdm_prefill_t *p, const tdm_frame_t *f)
{
    Tandem__V1__PrefillTask *m =
        (Tandem__V1__PrefillTask *)tdm_frame_unpack(f, &tandem__v1__prefill_task__descriptor);
    if (!m) {
        TDM_LOG_WARNF(p->log, NULL, "dropped a PrefillTask that does not decode");
        return;
    }
    tdm_error_t err = {0};
    tdm_node_attempt_t att;
    tdm_sampling_params_t sp;
    if (tdm_node_spec_attempt(m->spec, f->instance_id, &att, &err) != 0)
        TDM_LOG_WARNF(p->log, NULL, "dropped a PrefillTask: %s", err.msg);
    else if (tdm_node_req_find(p->node, att.attempt_id))
        /* the router never sends one attempt twice: a duplicate is dropped, the first runs */
        TDM_LOG_WARNF(p->log, att.label, "dropped a second PrefillTask for attempt %s", att.key);
    else if (check_task(p, m, &sp, &err) != TDM_OK)
        tdm_node_fail(p->node, &att, err.code, false, err.msg);
    else
        start_task(p, m, &att, &sp);
    tandem__v1__prefill_task__free_unpacked(m, NULL);
}

static bool on_frame(void *h, const tdm_frame_t *f)
{
    tdm_prefill_t *p = h;
    if (f->method == TANDEM__V1__METHOD__METHOD_EMBED_TASK) {
        ptask_t *t = (ptask_t *)tdm_node_embed_start(p->node, f);
        if (t)
            t->in_worker = true; /* until its EMBEDDING or FAILED event */
        return true;
    }
    if (f->method != TANDEM__V1__METHOD__METHOD_PREFILL_TASK)
        return false;
    on_prefill_task(h, f);
    return true;
}

/* PREFILLED: the prompt's KV goes to the decode node the task names. */
static void ship(tdm_prefill_t *p, ptask_t *t, const tdm_worker_event_t *ev)
{
    tdm_kv_seq_t seq = ev->seq;
    tdm_kv_hseq_t hseq = ev->hseq; /* a pool with layer groups: one table per group */
    t->in_worker = false;          /* the worker handed the sequence over */
    tdm_kv_send_req_t sr = {0};
    sr.request_id = t->base.att.label;
    sr.attempt_id = t->base.att.attempt_id;
    sr.endpoint = t->decode_ep;
    sr.blocks = seq.blocks;
    sr.n_blocks = seq.n_blocks;
    uint32_t *live = NULL; /* layer groups: each group's live blocks, group by group */
    if (hseq.tab) {
        live = malloc((size_t)tdm_kv_hseq_held(&hseq) * sizeof *live + 1);
        if (!live) {
            tdm_kv_hseq_release(p->rt->pool, &hseq);
            tdm_node_req_fail(p->node, &t->base, TDM_ERESOURCE, true,
                              "out of memory for the block list of a KV transfer");
            return;
        }
        sr.blocks = live;
        sr.n_blocks = tdm_kv_hseq_live(&hseq, live);
    }
    sr.n_tokens = ev->n_tokens;
    sr.first_token = ev->first_token;
    sr.prefill_s = ev->prefill_s;
    /* CURVE: the channel authenticates the decode node the router named by its own key */
    const tdm_node_config_t *dn = tdm_config_find_node(p->cfg, t->decode_id);
    sr.server_key = dn ? dn->curve_public_key : NULL;
    uint64_t xid;
    tdm_error_t err = {0};
    tdm_kv_sender_t *sender = p->senders[t->backend];
    if (!sender)
        sender = p->senders[t->backend] = open_sender(p, t->backend, &err);
    int rc = sender ? tdm_kv_sender_send(sender, &sr, &xid, &err) : err.code;
    /* The sender holds its own references; ours go now (into the prefix cache). */
    tdm_kv_seq_release(p->rt->pool, &seq);
    tdm_kv_hseq_release(p->rt->pool, &hseq);
    free(live);
    if (rc != TDM_OK)
        tdm_node_req_fail(p->node, &t->base, rc, true, err.msg);
    else
        t->shipping = true;
}

static void on_event(void *h, tdm_node_req_t *r, const tdm_worker_event_t *ev)
{
    tdm_prefill_t *p = h;
    switch (ev->kind) {
    case TDM_WORKER_EVENT_TOKEN:
        tdm_node_send_token(tdm_node_sock(p->node, r->att.router_instance), &r->att, ev);
        break;
    case TDM_WORKER_EVENT_PREFILLED: ship(p, (ptask_t *)r, ev); break;
    case TDM_WORKER_EVENT_EMBEDDING: /* the worker freed its blocks: the task is done */
        ((ptask_t *)r)->in_worker = false;
        tdm_node_send_embedding(tdm_node_sock(p->node, r->att.router_instance), &r->att, ev);
        tdm_node_req_drop(p->node, r);
        break;
    case TDM_WORKER_EVENT_FAILED:
        ((ptask_t *)r)->in_worker = false; /* the worker freed it already */
        tdm_node_req_fail_event(p->node, r, ev);
        break;
    default: break;
    }
}

/* The decode node acknowledged the KV: the prefill node's part is done. The router gets the
 * sender's measured time (send until acknowledgement) for its KV-transfer histogram, in a
 * KvShipped of this attempt (docs/protocol.md). */
static void report_shipped(tdm_prefill_t *p, const ptask_t *t, const tdm_kv_send_done_t *d)
{
    TDM_LOG_DEBUGF(p->log, d->request_id, "KV shipped bytes=%" PRIu64 " seconds=%.4f", d->bytes,
                   d->seconds);
    Tandem__V1__KvShipped ks = TANDEM__V1__KV_SHIPPED__INIT;
    ks.request_id = (char *)(uintptr_t)t->base.att.label;
    ks.attempt_id = t->base.att.attempt_id;
    ks.kv_transfer_s = d->seconds;
    ks.kv_transfer_bytes = d->bytes;
    tdm_sock_t *s = tdm_node_sock(p->node, t->base.att.router_instance);
    if (s) /* else its router is gone */
        tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_KV_SHIPPED, &ks.base);
}

static void on_sent(tdm_prefill_t *p, const tdm_kv_send_done_t *d)
{
    ptask_t *t = (ptask_t *)tdm_node_req_find(p->node, d->attempt_id);
    if (!t) /* cancelled meanwhile: the router no longer waits for it */
        return;
    t->shipping = false; /* the sender is done with it */
    if (d->status == TDM_ECANCELLED) {
        tdm_node_req_drop(p->node, &t->base);
    } else if (d->status != 0) {
        char msg[TDM_ERRMSG_MAX + 64];
        snprintf(msg, sizeof msg, "KV transfer to %s failed (%s): %s", t->decode_id,
                 tdm_status_name(d->status), d->message);
        /* Whatever the receiver said (a checksum mismatch is INVALID_ARGUMENT, a key mismatch
         * UNAUTHENTICATED, no ack DEADLINE_EXCEEDED), a transfer between two nodes failing is
         * the cluster's fault, never the client's: UNAVAILABLE, retryable. The prefill node is
         * the one side that reports it; the decode node frees its reservation silently. */
        tdm_node_req_fail(p->node, &t->base, TDM_EUNAVAILABLE, true, msg);
    } else {
        report_shipped(p, t, d);
        tdm_node_req_drop(p->node, &t->base);
    }
}

static void tick(void *h)
{
    tdm_prefill_t *p = h;
    tdm_kv_send_done_t done[16];
    int nd;
    for (size_t b = 0; b <= TDM_KV_BACKEND_CUDA_IPC; b++)
        while (p->senders[b] && (nd = tdm_kv_sender_poll(p->senders[b], 0, done, 16)) > 0)
            for (int i = 0; i < nd; i++)
                on_sent(p, &done[i]);
}

static int wait_ms(void *h, void **zsock)
{
    tdm_prefill_t *p = h;
    *zsock = NULL;
    uint32_t in_flight = 0;
    for (size_t b = 0; b <= TDM_KV_BACKEND_CUDA_IPC; b++)
        in_flight += p->senders[b] ? tdm_kv_sender_in_flight(p->senders[b]) : 0;
    return in_flight ? 2 : 20; /* acknowledgements come by polling */
}

static const tdm_node_ops_t prefill_ops = {
    .role = TDM_NODE_ROLE_PREFILL,
    .mode = TDM_WORKER_MODE_PREFILL,
    .req_size = sizeof(ptask_t),
    .shutdown_retryable = true,
    .deadline_msg = "deadline passed during prefill",
    .wait_msg = "",
    .frame = on_frame,
    .event = on_event,
    .tick = tick,
    .wait = wait_ms,
    .drop = drop,
};

/* ---- the object ---- */

void tdm_prefill_destroy(tdm_prefill_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_prefill_t *p = *self_p;
    /* the tasks' transfers are cancelled with the sender alive, and the sender drops its
     * block references before the node's pool goes */
    tdm_node_drop_all(p->node);
    for (size_t b = 0; b <= TDM_KV_BACKEND_CUDA_IPC; b++)
        tdm_kv_sender_destroy(&p->senders[b]);
    tdm_node_destroy(&p->node);
    free(p);
    *self_p = NULL;
}

tdm_node_link_t *tdm_prefill_link(tdm_prefill_t *p, size_t i)
{
    return tdm_node_router_at(p->node, i);
}

/* A KV sender over `backend`, a client of each decode node's receiver; from the engine's
 * device copy of the pool on a cuda node (tcp then refuses: the transport does not stage a
 * device pool through host memory). */
static tdm_kv_sender_t *open_sender(tdm_prefill_t *p, tdm_kv_backend_t backend, tdm_error_t *err)
{
    tdm_curve_keys_t curve;
    tdm_kv_sender_opts_t so = {0};
    so.node_id = tdm_node_cfg(p->node)->id;
    so.model_fingerprint = p->rt->fingerprint;
    so.backend = backend;
    so.memory.device_base = p->rt->kv_device_base;
    so.memory.device = p->rt->device_index;
    so.curve = tdm_node_curve_kv(&p->rt->keys, &curve);
    /* kv.transfer_timeout_s (10 s by default, docs/protocol.md): a decode node that does not
     * acknowledge within it is stalled or cut off, and the router retries the request (a lost
     * connection is noticed sooner, by the sender's socket monitor). */
    so.timeout_ms = (int)(p->cfg->kv.transfer_timeout_s * 1000.0 + 0.5);
    so.threads = tdm_node_cfg(p->node)->threads; /* no more OpenMP threads than the engine's */
    so.log = p->log;
    tdm_kv_sender_t *s = tdm_kv_sender_new(p->net, p->rt->pool, &so, err);
    if (!s)
        tdm_error_prefix(err, err ? err->code : TDM_EINVALID,
                         "KV sender (%s): ", tdm_kv_backend_name(backend));
    return s;
}

tdm_prefill_t *tdm_prefill_new(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                               const tdm_logger_t *log, tdm_error_t *err)
{
    tdm_prefill_t *p = calloc(1, sizeof *p);
    if (!p) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    p->cfg = cfg;
    p->node = tdm_node_new(cfg, node_id, &prefill_ops, p, net, log, err);
    if (!p->node)
        goto out_destroy;
    p->rt = tdm_node_rt(p->node);
    p->log = tdm_node_log(p->node);
    p->net = net;
    /* a host pool's tcp sender at start, so that a bad option fails the node at once */
    if (!p->rt->kv_device_base &&
        !(p->senders[TDM_KV_BACKEND_TCP] = open_sender(p, TDM_KV_BACKEND_TCP, err)))
        goto out_destroy;
    if (tdm_node_connect(p->node, NULL, err) != TDM_OK)
        goto out_destroy;
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(p->rt->pool, &ks);
    TDM_LOG_INFOF(
        p->log, NULL,
        "prefill node ready backend=%s kv_blocks=%u kv_mib=%.1f n_ctx=%u router=%s curve=%s "
        "kv_transfer_timeout_s=%g",
        tdm_engine_backend_name(p->rt->engine), ks.n_blocks, (double)p->rt->kv_bytes / 1048576.0,
        p->rt->n_ctx, tdm_config_router_advertise(cfg), tdm_config_curve_on(cfg) ? "on" : "off",
        cfg->kv.transfer_timeout_s);
    return p;
out_destroy:
    tdm_prefill_destroy(&p);
    return NULL;
}

int tdm_prefill_run(tdm_prefill_t *p, volatile sig_atomic_t *stop, tdm_error_t *err)
{
    return tdm_node_serve(p->node, stop, err);
}
