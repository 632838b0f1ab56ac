/* decode.c - the decode node: reserves KV blocks when the router announces a request,
 * receives the prompt's KV pages from a prefill node into them, adds the sequence to the
 * running batch and steps all running sequences together (continuous batching), emitting a
 * TokenEvent per token and Finished at the end. Without a prefill node the router asks it to
 * prefill locally. A handler of the node serve loop (common/src/node/serve.c), which runs it
 * on one thread (the engine thread); the router link has its own. */
#include "decode.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tandem/proto.h"
#include "tandem/transfer.h"

/* A reservation without a deadline waits this long for its KV pages before it is dropped (a
 * guard against lost messages; requests from the router always carry a deadline, and a long
 * prompt on a busy prefill node may legitimately take minutes). */
#define RESERVATION_TTL_S 600.0

/* One request: the serve loop's entry, then what the decode node adds. */
typedef struct dres {
    tdm_node_req_t base; /* base.att.attempt_id: the worker's id for it */
    bool local;          /* local prefill: the sequence is in the worker already */
    bool in_worker;      /* KV arrived (or local): the worker owns the sequence */
    bool embed;          /* an EmbedTask: no reservation, so none to record as decided */
    tdm_kv_seq_t seq;    /* reserved blocks until the KV arrives */
    tdm_kv_hseq_t hseq;  /* the same over a pool with layer groups: one table per group, the
                            blocks of a KV transfer (tdm_kv_hseq_reserve_handover) */
    uint32_t *live;      /* [n_live] hseq's blocks in the transfer's order (the lookup's) */
    uint32_t n_live;
    int32_t *prompt; /* [n_prompt + n_output] until the KV arrives: the prompt, then the
                        output a migrated request resumes after (DecodeReserve) */
    uint32_t n_prompt;
    uint32_t n_output; /* output tokens delivered before this attempt (0: a new request) */
    tdm_sampling_params_t sp;
    bool no_speculation; /* DecodeReserve.speculative OFF */
    double t_reserved;
    double kv_transfer_s;       /* estimate: reserved until received, minus the prefill time */
    uint64_t kv_transfer_bytes; /* block bytes received (tdm_kv_received_t.bytes) */
    uint64_t fork_of;           /* n > 1: the attempt whose prompt KV this sibling shares
                                   (DecodeReserve.fork_of); 0: none. Until the fork is made
                                   (in_worker), r is on tdm_decode_t.forks and keeps prompt */
} dres_t;

/* Attempts whose reservation this node decided (refused, or held and dropped since) that it
 * remembers, so that a KV transfer for one is refused at once instead of held as an early
 * transfer (its DecodeReserve not read yet) until kv.early_transfer_s. */
#define DECIDED_MAX 1024

struct tdm_decode {
    tdm_node_t *node;
    tdm_node_runtime_t *rt; /* the node's */
    const tdm_logger_t *log;
    tdm_kv_receiver_t *receiver;
    dres_t **forks; /* [n_forks] reservations waiting for their parent's prompt KV */
    uint32_t n_forks, cap_forks;
    uint64_t decided[DECIDED_MAX]; /* ring of attempts decided and gone (0: empty slot) */
    uint32_t decided_next;
};

/* ---- attempts decided ---- */

static void decided_add(tdm_decode_t *d, uint64_t attempt_id)
{
    if (attempt_id == 0)
        return;
    d->decided[d->decided_next] = attempt_id;
    d->decided_next = (d->decided_next + 1) % DECIDED_MAX;
}

static bool decided_has(const tdm_decode_t *d, uint64_t attempt_id)
{
    for (uint32_t i = 0; i < DECIDED_MAX; i++)
        if (d->decided[i] == attempt_id)
            return true;
    return false;
}

/* ---- DECODE_RESERVE ---- */

static void forks_remove(tdm_decode_t *d, const dres_t *r)
{
    for (uint32_t i = 0; i < d->n_forks; i++)
        if (d->forks[i] == r) {
            d->forks[i] = d->forks[--d->n_forks];
            return;
        }
}

static void drop(void *h, tdm_node_req_t *base)
{
    tdm_decode_t *d = h;
    dres_t *r = (dres_t *)base;
    if (r->fork_of && !r->in_worker)
        forks_remove(d, r);
    if (r->in_worker)
        tdm_worker_cancel(d->rt->worker, base->att.attempt_id);
    tdm_kv_seq_release(d->rt->pool, &r->seq);
    tdm_kv_hseq_release(d->rt->pool, &r->hseq);
    free(r->live);
    free(r->prompt);
    if (r->embed)
        return; /* no KV transfer ever comes for it: keep decided[] for reservations */
    decided_add(d, base->att.attempt_id);
    /* an early transfer still held for it (the reservation failed before it was decided) */
    tdm_kv_receiver_refuse(d->receiver, base->att.attempt_id, TDM_ENOTFOUND,
                           "the request was dropped on the decode node");
}

/* The DecodeReserve's attempt and spec, checked (tdm_node_spec_check): TDM_EINVALID
 * (TDM_EINTERNAL for an attempt held already) with the message in *err. */
static int check_reserve(tdm_decode_t *d, const tdm_frame_t *f, const Tandem__V1__DecodeReserve *m,
                         tdm_node_attempt_t *att, tdm_sampling_params_t *sp, tdm_error_t *err)
{
    if (tdm_node_spec_attempt(m->spec, f->instance_id, att, err) != TDM_OK)
        return TDM_EINVALID;
    if (tdm_node_req_find(d->node, att->attempt_id))
        return tdm_error_set(err, TDM_EINTERNAL,
                             "attempt %s of request '%s' is already on this node", att->key,
                             att->label);
    return tdm_node_spec_check(m->spec, d->rt->n_ctx, d->rt->n_vocab, sp, err);
}

/* Pool blocks a sequence of n_tokens holds at most: ceil(n_tokens / block_size), or over a
 * pool with layer groups the per-group peak of decoding to n_tokens
 * (tdm_kv_groups_blocks_per_seq). */
static uint32_t blocks_for(const tdm_decode_t *d, uint32_t n_tokens)
{
    if (d->rt->kv_grouped)
        return (uint32_t)tdm_kv_groups_blocks_per_seq(&d->rt->groups, d->rt->layout.block_size,
                                                      n_tokens);
    return (uint32_t)tdm_kv_blocks_for_tokens(&d->rt->layout, n_tokens);
}

/* Local prefill: the prompt goes into the worker at once, if its blocks are free now. */
static int reserve_local(tdm_decode_t *d, dres_t *r, const Tandem__V1__DecodeReserve *m,
                         tdm_error_t *err)
{
    uint32_t need = blocks_for(d, r->n_prompt + r->n_output + 1);
    if (need > tdm_kv_pool_available(d->rt->pool))
        return tdm_error_set(err, TDM_ERESOURCE, "need %u KV blocks, %u free", need,
                             tdm_kv_pool_available(d->rt->pool));
    tdm_worker_req_t req = {.seq_id = r->base.att.attempt_id,
                            .prompt = m->spec->prompt_tokens,
                            .n_prompt = r->n_prompt,
                            .sampling = &r->sp,
                            .user = r,
                            .output = m->spec->output_tokens,
                            .n_output = r->n_output,
                            .grammar = r->base.grammar,
                            .no_speculation = r->no_speculation,
                            .prompt_logprobs = m->spec->prompt_logprobs != NULL,
                            .prompt_logprobs_top =
                                m->spec->prompt_logprobs ? m->spec->prompt_logprobs->top : 0};
    int rc = tdm_worker_add(d->rt->worker, &req, err);
    if (rc != TDM_OK)
        return rc;
    r->local = r->in_worker = true;
    return TDM_OK;
}

/* The prompt and the output a migrated request resumes after, kept until the KV comes. */
static int keep_tokens(dres_t *r, const Tandem__V1__DecodeReserve *m, tdm_error_t *err)
{
    uint32_t n = r->n_prompt + r->n_output;
    r->prompt = malloc((size_t)n * sizeof *r->prompt);
    if (!r->prompt)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for a reservation of %u tokens", n);
    memcpy(r->prompt, m->spec->prompt_tokens, (size_t)r->n_prompt * sizeof *r->prompt);
    if (r->n_output)
        memcpy(r->prompt + r->n_prompt, m->spec->output_tokens,
               (size_t)r->n_output * sizeof *r->prompt);
    return TDM_OK;
}

/* reserve_remote over a pool with layer groups: each group's blocks of the transfer only (a
 * window group those the first decode step reads: tdm_kv_hseq_reserve_handover). */
static int reserve_remote_groups(tdm_decode_t *d, dres_t *r, const Tandem__V1__DecodeReserve *m,
                                 tdm_error_t *err)
{
    uint32_t n = r->n_prompt + r->n_output;
    uint32_t need = (uint32_t)tdm_kv_transfer_blocks(d->rt->pool, n, NULL);
    if (keep_tokens(r, m, err) != TDM_OK)
        return TDM_ERESOURCE;
    r->live = malloc((size_t)need * sizeof *r->live + 1);
    if (!r->live || tdm_kv_hseq_init(&r->hseq, tdm_kv_pool_groups(d->rt->pool), err) != TDM_OK)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for a reservation of %u tokens", n);
    if (tdm_kv_hseq_reserve_handover(d->rt->pool, &r->hseq, n) != TDM_OK)
        return tdm_error_set(err, TDM_ERESOURCE, "need %u KV blocks, %u free", need,
                             tdm_kv_pool_available(d->rt->pool));
    r->n_live = tdm_kv_hseq_live(&r->hseq, r->live);
    if (!r->base.deadline_ms)
        r->base.wait_until = r->t_reserved + RESERVATION_TTL_S;
    return TDM_OK;
}

/* KV from a prefill node: the prompt (and the output a migrated request resumes after) is kept
 * and its blocks reserved until the pages come. */
static int reserve_remote(tdm_decode_t *d, dres_t *r, const Tandem__V1__DecodeReserve *m,
                          tdm_error_t *err)
{
    uint32_t n = r->n_prompt + r->n_output;
    if (d->rt->kv_grouped)
        return reserve_remote_groups(d, r, m, err);
    r->prompt = malloc((size_t)n * sizeof *r->prompt);
    if (!r->prompt || tdm_kv_seq_prepare(d->rt->pool, &r->seq, n) != TDM_OK)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for a reservation of %u tokens", n);
    memcpy(r->prompt, m->spec->prompt_tokens, (size_t)r->n_prompt * sizeof *r->prompt);
    if (r->n_output)
        memcpy(r->prompt + r->n_prompt, m->spec->output_tokens,
               (size_t)r->n_output * sizeof *r->prompt);
    if (tdm_kv_seq_reserve(d->rt->pool, &r->seq, n) != TDM_OK)
        return tdm_error_set(err, TDM_ERESOURCE, "need %u KV blocks, %u free",
                             (uint32_t)tdm_kv_blocks_for_tokens(&d->rt->layout, n),
                             tdm_kv_pool_available(d->rt->pool));
    if (!r->base.deadline_ms)
        r->base.wait_until = r->t_reserved + RESERVATION_TTL_S;
    return TDM_OK;
}

/* n > 1: a sibling of attempt m->fork_of, which must be on this node. It waits (on d->forks)
 * until the parent's prompt KV is there (fork_ready) and takes no blocks before: it needs
 * only those of its last prompt block and its output, which the worker takes as it runs.
 * TDM_EUNAVAILABLE (retryable: the router dispatches the sibling on its own) when the parent
 * is not here or the pool could not hold the fork's own blocks now. */
static int reserve_fork(tdm_decode_t *d, dres_t *r, const Tandem__V1__DecodeReserve *m,
                        tdm_error_t *err)
{
    const uint32_t bs = d->rt->layout.block_size;
    uint32_t need = d->rt->kv_grouped
                        ? blocks_for(d, r->n_prompt + 1)
                        : (uint32_t)tdm_kv_blocks_for_tokens(&d->rt->layout, r->n_prompt + 1) -
                              (r->n_prompt - 1) / bs;
    dres_t *p = (dres_t *)tdm_node_req_find(d->node, m->fork_of);
    if (!p || p->fork_of || p->n_prompt != r->n_prompt || r->n_output || p->n_output)
        return tdm_error_set(err, TDM_EUNAVAILABLE,
                             "fork_of: attempt %016" PRIx64 " is not a sequence of this prompt "
                             "on this node",
                             m->fork_of);
    if (need > tdm_kv_pool_available(d->rt->pool))
        return tdm_error_set(err, TDM_EUNAVAILABLE, "fork: need %u KV blocks, %u free", need,
                             tdm_kv_pool_available(d->rt->pool));
    if (d->n_forks == d->cap_forks) {
        uint32_t cap = d->cap_forks ? 2 * d->cap_forks : 16;
        dres_t **f = realloc(d->forks, cap * sizeof *f);
        if (!f)
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory for a fork");
        d->forks = f;
        d->cap_forks = cap;
    }
    r->prompt = malloc((size_t)r->n_prompt * sizeof *r->prompt);
    if (!r->prompt)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for a fork");
    memcpy(r->prompt, m->spec->prompt_tokens, (size_t)r->n_prompt * sizeof *r->prompt);
    r->fork_of = m->fork_of;
    d->forks[d->n_forks++] = r;
    if (!r->base.deadline_ms)
        r->base.wait_until = r->t_reserved + RESERVATION_TTL_S;
    return TDM_OK;
}

/* Makes the fork r once its parent's prompt KV is in the worker. Returns true when r is no
 * longer waiting (forked, or failed: retryable when the parent is gone or cannot be forked,
 * so the router dispatches the sibling on its own). */
static bool fork_ready(tdm_decode_t *d, dres_t *r)
{
    dres_t *p = (dres_t *)tdm_node_req_find(d->node, r->fork_of);
    tdm_error_t err = {0};
    int rc = TDM_ENOTFOUND;
    if (p && !p->in_worker)
        return false; /* its KV pages are on their way */
    if (p) {
        tdm_worker_req_t req = {.seq_id = r->base.att.attempt_id,
                                .prompt = r->prompt,
                                .n_prompt = r->n_prompt,
                                .sampling = &r->sp,
                                .user = r,
                                .grammar = r->base.grammar};
        rc = tdm_worker_fork(d->rt->worker, p->base.att.attempt_id, &req, &err);
        if (rc == TDM_EPRECONDITION)
            return false; /* its local prefill has not reached the end of the prompt */
    }
    if (rc != TDM_OK) {
        tdm_node_req_fail(d->node, &r->base, TDM_EUNAVAILABLE, true,
                          p ? err.msg : "fork: the sibling it shares the prompt with ended");
        return true;
    }
    r->in_worker = true;
    r->base.wait_until = 0;
    free(r->prompt);
    r->prompt = NULL;
    TDM_LOG_DEBUGF(d->log, r->base.att.label, "forked from attempt %016" PRIx64, r->fork_of);
    return true;
}

/* Every fork whose parent's prompt KV is there now is made. */
static void forks_tick(tdm_decode_t *d)
{
    for (uint32_t i = 0; i < d->n_forks;) {
        dres_t *r = d->forks[i];
        if (!fork_ready(d, r))
            i++;
        else if (i < d->n_forks && d->forks[i] == r)
            d->forks[i] = d->forks[--d->n_forks]; /* forked: still listed */
    }
}

/* The reservation m asks for: a fork of a sibling, a local prefill or KV from a prefill node. */
static int reserve_kind(tdm_decode_t *d, dres_t *r, const Tandem__V1__DecodeReserve *m,
                        tdm_error_t *err)
{
    if (m->fork_of)
        return reserve_fork(d, r, m, err);
    return m->local_prefill ? reserve_local(d, r, m, err) : reserve_remote(d, r, m, err);
}

/* The reservation of attempt_id was refused with status and why (already answered to the
 * router): an early KV transfer held for it is refused with the same reason, and one that
 * comes later is refused at once. */
static void reserve_refused(tdm_decode_t *d, uint64_t attempt_id, int status, const char *why)
{
    decided_add(d, attempt_id);
    tdm_kv_receiver_refuse(d->receiver, attempt_id, status, why);
}

static void on_received(tdm_decode_t *d, const tdm_kv_received_t *in);
static int lookup(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                  const uint32_t **blocks, uint32_t *n_blocks, tdm_error_t *err);

/* The reservation r was made and acknowledged: an early KV transfer held for it is installed
 * now (or rejected by the lookup, as any transfer). */
static void reserve_decided(tdm_decode_t *d, dres_t *r)
{
    tdm_kv_received_t in;
    if (!r->local && !r->fork_of &&
        tdm_kv_receiver_resume(d->receiver, r->base.att.attempt_id, lookup, d, &in) == 1)
        on_received(d, &in);
}

/* DECODE_RESERVE: allocate blocks for the prompt (or start a local prefill) and answer. */
static void on_reserve(tdm_decode_t *d, const tdm_frame_t *f)
{
    tdm_sock_t *s = tdm_node_sock(d->node, f->instance_id);
    if (!s) /* its router went away since the frame was relayed: nobody to reserve for */
        return;
    Tandem__V1__DecodeReserve *m =
        (Tandem__V1__DecodeReserve *)tdm_frame_unpack(f, &tandem__v1__decode_reserve__descriptor);
    if (!m) {
        tdm_sock_reply_error(s, f, TDM_EINVALID, "DecodeReserve does not decode");
        return;
    }
    tdm_node_attempt_t att;
    tdm_sampling_params_t sp;
    tdm_error_t err = {0};
    const char *label = m->spec ? m->spec->request_id : NULL;
    if (tdm_frame_expired(f, tdm_net_now_ms())) {
        /* The request's deadline passed while the reservation sat unread (this node was
         * paused): a reservation made now would hold blocks for nobody. One the router gave up
         * on earlier is freed by the NodeCancel it sends for the late answer. */
        TDM_LOG_INFOF(d->log, label,
                      "reservation of attempt %016" PRIx64
                      " arrived after its deadline; not reserved",
                      m->spec ? m->spec->attempt_id : 0);
        tdm_sock_reply_error(s, f, TDM_EDEADLINE, "the reservation arrived after its deadline");
        reserve_refused(d, m->spec ? m->spec->attempt_id : 0, TDM_EDEADLINE,
                        "the reservation arrived after its deadline");
        goto out_free;
    }
    int rc = check_reserve(d, f, m, &att, &sp, &err);
    if (rc != TDM_OK) {
        tdm_sock_reply_error(s, f, rc, "%s", err.msg);
        if (!m->spec || !tdm_node_req_find(d->node, m->spec->attempt_id))
            reserve_refused(d, m->spec ? m->spec->attempt_id : 0, rc, err.msg);
        goto out_free;
    }
    dres_t *r = (dres_t *)tdm_node_req_new(d->node, &att);
    if (!r) {
        tdm_error_set(&err, TDM_ERESOURCE, "decode node holds %u requests already",
                      (uint32_t)tdm_node_cfg(d->node)->max_running + TDM_NODE_MAX_WAITING);
        tdm_sock_reply_error(s, f, TDM_ERESOURCE, "%s", err.msg);
        reserve_refused(d, att.attempt_id, TDM_ERESOURCE, err.msg);
        goto out_free;
    }
    r->sp = sp;
    r->n_prompt = (uint32_t)m->spec->n_prompt_tokens;
    r->n_output = (uint32_t)m->spec->n_output_tokens;
    r->no_speculation = m->speculative == TANDEM__V1__SPECULATIVE__SPECULATIVE_OFF;
    r->base.deadline_ms = m->spec->deadline_unix_ms;
    r->t_reserved = tdm_time_now();
    rc = tdm_node_constraint(d->rt->grammars, m->spec->constraint, &r->base.grammar, &err);
    if (rc == TDM_OK)
        rc = reserve_kind(d, r, m, &err);
    if (rc != TDM_OK) {
        tdm_sock_reply_error(s, f, rc, "%s", err.msg);
        reserve_refused(d, att.attempt_id, rc, err.msg);
        tdm_node_req_drop(d->node, &r->base);
        goto out_free;
    }
    Tandem__V1__ReserveAck ack = TANDEM__V1__RESERVE_ACK__INIT;
    ack.request_id = r->base.att.label;
    ack.attempt_id = r->base.att.attempt_id;
    ack.n_blocks = r->hseq.tab ? r->n_live : r->seq.n_blocks;
    tdm_sock_reply(s, f, &ack.base);
    TDM_LOG_DEBUGF(d->log, att.label,
                   "reserved attempt=%s prompt_tokens=%u output_tokens=%u blocks=%u local=%d "
                   "fork_of=%016" PRIx64,
                   att.key, r->n_prompt, r->n_output, r->hseq.tab ? r->n_live : r->seq.n_blocks,
                   r->local, r->fork_of);
    reserve_decided(d, r);
out_free:
    tandem__v1__decode_reserve__free_unpacked(m, NULL);
}

static bool on_frame(void *h, const tdm_frame_t *f)
{
    tdm_decode_t *d = h;
    if (f->method == TANDEM__V1__METHOD__METHOD_EMBED_TASK) {
        /* a pool without prefill nodes: embeddings run here, batched with decode steps */
        dres_t *r = (dres_t *)tdm_node_embed_start(d->node, f);
        if (r) {
            r->in_worker = true; /* until its EMBEDDING or FAILED event */
            r->embed = true;
        }
        return true;
    }
    if (f->method != TANDEM__V1__METHOD__METHOD_DECODE_RESERVE)
        return false;
    on_reserve(h, f);
    return true;
}

/* ---- KV from prefill nodes ---- */

/* The KV receiver asks which blocks were reserved for a request. */
static int lookup(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                  const uint32_t **blocks, uint32_t *n_blocks, tdm_error_t *err)
{
    tdm_decode_t *d = user;
    dres_t *r = (dres_t *)tdm_node_req_find(d->node, attempt_id);
    if (!r && !decided_has(d, attempt_id))
        return TDM_KV_LOOKUP_WAIT; /* an early transfer: its DecodeReserve is not read yet */
    if (!r || r->in_worker)
        return tdm_error_set(err, TDM_ENOTFOUND,
                             "no reservation for attempt %016" PRIx64 " of request '%s' "
                             "(cancelled, superseded or unknown)",
                             attempt_id, request_id);
    if (n_tokens != r->n_prompt + r->n_output)
        return tdm_error_set(err, TDM_EINVALID,
                             "transfer has %u tokens; the reservation is for %u prompt and %u "
                             "output tokens",
                             n_tokens, r->n_prompt, r->n_output);
    *blocks = r->hseq.tab ? r->live : r->seq.blocks;
    *n_blocks = r->hseq.tab ? r->n_live : r->seq.n_blocks;
    return 0;
}

/* The KV of r arrived: the sequence joins the running batch. */
static void start_decoding(tdm_decode_t *d, dres_t *r, const tdm_kv_received_t *in)
{
    r->kv_transfer_s = tdm_time_now() - r->t_reserved - in->prefill_s;
    if (r->kv_transfer_s < 0)
        r->kv_transfer_s = 0;
    r->kv_transfer_bytes = in->bytes;
    r->seq.n_tokens = r->n_prompt + r->n_output;
    tdm_worker_req_t req = {.seq_id = r->base.att.attempt_id,
                            .prompt = r->prompt,
                            .n_prompt = r->n_prompt,
                            .sampling = &r->sp,
                            .prefilled = r->hseq.tab ? NULL : &r->seq,
                            .prefilled_groups = r->hseq.tab ? &r->hseq : NULL,
                            .first_token = in->first_token,
                            .user = r,
                            .output = r->prompt + r->n_prompt,
                            .n_output = r->n_output,
                            .grammar = r->base.grammar,
                            .no_speculation = r->no_speculation};
    tdm_error_t err = {0};
    if (tdm_worker_add(d->rt->worker, &req, &err) != TDM_OK) {
        tdm_node_req_fail(d->node, &r->base, err.code, err.code == TDM_ERESOURCE, err.msg);
        return;
    }
    r->in_worker = true;
    r->base.wait_until = 0;
    free(r->prompt);
    r->prompt = NULL;
    TDM_LOG_DEBUGF(d->log, r->base.att.label, "KV received blocks=%u bytes=%" PRIu64 " from=%s",
                   in->n_blocks, in->bytes, in->sender_node_id);
}

static void on_received(tdm_decode_t *d, const tdm_kv_received_t *in)
{
    dres_t *r = (dres_t *)tdm_node_req_find(d->node, in->attempt_id);
    if (!r || r->in_worker)
        return; /* unknown or cancelled: the receiver already rejected or dropped it */
    if (in->status == TDM_ECANCELLED) {
        /* The sender withdrew the transfer (the router cancelled the request, its deadline
         * passed on the prefill node, or the prefill node is stopping): the prefill node
         * reports why, if anything is to be reported. The reservation goes. */
        TDM_LOG_DEBUGF(d->log, r->base.att.label, "KV transfer withdrawn by the sender");
        tdm_node_req_drop(d->node, &r->base);
    } else if (in->status != 0) {
        /* A bad transfer: the reservation goes. The rejection went back to the sender in the
         * transfer's END, and the prefill node is the one side that reports a failed transfer
         * (one failure, one TaskFailed, one re-dispatch): nothing is reported from here. */
        TDM_LOG_DEBUGF(d->log, r->base.att.label, "KV transfer rejected (%s); reservation freed",
                       tdm_status_name(in->status));
        tdm_node_req_drop(d->node, &r->base);
    } else {
        start_decoding(d, r, in);
    }
}

static void tick(void *h)
{
    tdm_decode_t *d = h;
    tdm_kv_received_t in;
    while (tdm_kv_receiver_recv(d->receiver, 0, lookup, d, &in) == 1)
        on_received(d, &in);
    forks_tick(d);
}

static int wait_ms(void *h, void **zsock)
{
    tdm_decode_t *d = h;
    *zsock = tdm_kv_receiver_zsock(d->receiver);
    return 20;
}

/* ---- worker events ---- */

static void send_finished(tdm_decode_t *d, const dres_t *r, const tdm_worker_event_t *ev)
{
    Tandem__V1__Finished fin = TANDEM__V1__FINISHED__INIT;
    fin.request_id = (char *)(uintptr_t)r->base.att.label;
    fin.attempt_id = r->base.att.attempt_id;
    fin.reason = ev->finish == TDM_WORKER_FINISH_STOP
                     ? TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP
                     : TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH;
    fin.completion_tokens = ev->completion_tokens;
    fin.kv_transfer_s = r->kv_transfer_s; /* the router prefers the prefill node's measure */
    fin.kv_transfer_bytes = r->kv_transfer_bytes;
    fin.preemptions = ev->preemptions;
    tdm_sock_t *s = tdm_node_sock(d->node, r->base.att.router_instance);
    if (s) /* else its router is gone */
        tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_FINISHED, &fin.base);
}

static void on_event(void *h, tdm_node_req_t *base, const tdm_worker_event_t *ev)
{
    tdm_decode_t *d = h;
    dres_t *r = (dres_t *)base;
    switch (ev->kind) {
    case TDM_WORKER_EVENT_TOKEN:
        tdm_node_send_token(tdm_node_sock(d->node, base->att.router_instance), &base->att, ev);
        break;
    case TDM_WORKER_EVENT_FINISHED:
        send_finished(d, r, ev);
        r->in_worker = false; /* the worker freed it already */
        tdm_node_req_drop(d->node, base);
        break;
    case TDM_WORKER_EVENT_FAILED:
        r->in_worker = false;
        tdm_node_req_fail_event(d->node, base, ev);
        break;
    case TDM_WORKER_EVENT_EMBEDDING: /* the worker freed its blocks: the task is done */
        r->in_worker = false;
        tdm_node_send_embedding(tdm_node_sock(d->node, base->att.router_instance), &base->att, ev);
        tdm_node_req_drop(d->node, base);
        break;
    default: break;
    }
}

static const tdm_node_ops_t decode_ops = {
    .role = TDM_NODE_ROLE_DECODE,
    .mode = TDM_WORKER_MODE_DECODE,
    .req_size = sizeof(dres_t),
    .shutdown_retryable = false,
    .deadline_msg = "deadline passed",
    .wait_msg = "no KV pages arrived for the reservation within 600 s",
    .frame = on_frame,
    .event = on_event,
    .tick = tick,
    .wait = wait_ms,
    .drop = drop,
};

/* ---- the object ---- */

void tdm_decode_destroy(tdm_decode_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_decode_t *d = *self_p;
    tdm_kv_receiver_destroy(&d->receiver); /* before the pool its transfers write into */
    tdm_node_destroy(&d->node);
    free(d->forks);
    free(d);
    *self_p = NULL;
}

tdm_node_link_t *tdm_decode_link(tdm_decode_t *d, size_t i)
{
    return tdm_node_router_at(d->node, i);
}

/* The KV receiver, bound at the node's kv_endpoint, holding early transfers within cfg's
 * kv.early_transfer_bytes and kv.early_transfer_s. */
static tdm_kv_receiver_t *open_receiver(tdm_decode_t *d, const tdm_config_t *cfg, tdm_net_t *net,
                                        tdm_error_t *err)
{
    const tdm_node_config_t *node = tdm_node_cfg(d->node);
    tdm_curve_keys_t curve;
    tdm_kv_receiver_opts_t ro = {0};
    ro.endpoint = node->kv_endpoint;
    ro.node_id = node->id;
    ro.model_fingerprint = d->rt->fingerprint;
    /* a cuda node's KV is in the engine's device copy of the pool: transfers land there */
    ro.memory.device_base = d->rt->kv_device_base;
    ro.memory.device = d->rt->device_index;
    ro.curve = tdm_node_curve_kv(&d->rt->keys, &curve);
    ro.threads = node->threads; /* no more OpenMP threads than the engine's */
    ro.hold_bytes = cfg->kv.early_transfer_bytes;
    ro.hold_ms = (int)(cfg->kv.early_transfer_s * 1000.0 + 0.5);
    ro.log = d->log;
    tdm_kv_receiver_t *rx = tdm_kv_receiver_new(net, d->rt->pool, &ro, err);
    if (!rx)
        tdm_error_prefix(err, err ? err->code : TDM_EUNAVAILABLE,
                         "KV endpoint %s: ", node->kv_endpoint);
    return rx;
}

tdm_decode_t *tdm_decode_new(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                             const tdm_logger_t *log, tdm_error_t *err)
{
    tdm_decode_t *d = calloc(1, sizeof *d);
    if (!d) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    d->node = tdm_node_new(cfg, node_id, &decode_ops, d, net, log, err);
    if (!d->node)
        goto out_destroy;
    d->rt = tdm_node_rt(d->node);
    d->log = tdm_node_log(d->node);
    d->receiver = open_receiver(d, cfg, net, err);
    if (!d->receiver)
        goto out_destroy;
    /* Prefill nodes connect to what is registered: kv_advertise when the bound endpoint is
     * not reachable as written (tcp://0.0.0.0:7610 in a container), else the bound one. */
    const tdm_node_config_t *node = tdm_node_cfg(d->node);
    const char *kv_ep =
        node->kv_advertise ? node->kv_advertise : tdm_kv_receiver_endpoint(d->receiver);
    if (tdm_node_connect(d->node, kv_ep, err) != TDM_OK)
        goto out_destroy;
    tdm_kv_stats_t ks;
    tdm_kv_pool_stats(d->rt->pool, &ks);
    TDM_LOG_INFOF(d->log, NULL,
                  "decode node ready backend=%s kv_blocks=%u kv_mib=%.1f n_ctx=%u kv=%s router=%s "
                  "curve=%s",
                  tdm_engine_backend_name(d->rt->engine), ks.n_blocks,
                  (double)d->rt->kv_bytes / 1048576.0, d->rt->n_ctx, kv_ep,
                  tdm_config_router_advertise(cfg), tdm_config_curve_on(cfg) ? "on" : "off");
    return d;
out_destroy:
    tdm_decode_destroy(&d);
    return NULL;
}

int tdm_decode_run(tdm_decode_t *d, volatile sig_atomic_t *stop, tdm_error_t *err)
{
    return tdm_node_serve(d->node, stop, err);
}
