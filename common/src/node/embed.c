/* embed.c - the embedding tasks (EmbedTask, protocol 2.8) any node with an engine serves: the
 * checks, the worker's embedding sequence, and the EmbeddingResult back to the router. The
 * handlers (prefill.c, decode.c) route the frame and the worker's events here. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "tandem/node.h"
#include "tandem/proto.h"

/* The EmbedTask's fields beyond the spec's identity: TDM_EINVALID naming the field. */
static int check_embed_task(const Tandem__V1__EmbedTask *m, uint32_t n_ctx, uint32_t n_vocab,
                            tdm_error_t *err)
{
    const Tandem__V1__SequenceSpec *spec = m->spec;
    if (spec->n_prompt_tokens == 0 || spec->n_prompt_tokens > n_ctx)
        return tdm_error_set(err, TDM_EINVALID,
                             "prompt_tokens: %zu tokens; 1..%u fit the context of %u tokens",
                             spec->n_prompt_tokens, n_ctx, n_ctx);
    for (size_t i = 0; i < spec->n_prompt_tokens; i++)
        if (spec->prompt_tokens[i] < 0 || (uint32_t)spec->prompt_tokens[i] >= n_vocab)
            return tdm_error_set(err, TDM_EINVALID,
                                 "prompt_tokens[%zu]: token id %d is outside the vocabulary "
                                 "[0, %u)",
                                 i, spec->prompt_tokens[i], n_vocab);
    if (m->pooling != TANDEM__V1__POOLING__POOLING_LAST &&
        m->pooling != TANDEM__V1__POOLING__POOLING_MEAN)
        return tdm_error_set(err, TDM_EINVALID, "pooling: %d is not LAST (0) or MEAN (1)",
                             (int)m->pooling);
    if (spec->n_output_tokens || spec->constraint || spec->prompt_logprobs)
        return tdm_error_set(err, TDM_EINVALID,
                             "spec: an embedding takes no output_tokens, constraint or "
                             "prompt_logprobs");
    return TDM_OK;
}

/* Starts a decoded, identified task: its entry and its sequence in the worker. */
static tdm_node_req_t *embed_start(tdm_node_t *n, const Tandem__V1__EmbedTask *m,
                                   const tdm_node_attempt_t *att)
{
    tdm_node_runtime_t *rt = tdm_node_rt(n);
    tdm_error_t err = {0};
    if (check_embed_task(m, rt->n_ctx, rt->n_vocab, &err) != TDM_OK) {
        tdm_node_fail(n, att, err.code, false, err.msg);
        return NULL;
    }
    tdm_node_req_t *r = tdm_node_req_new(n, att);
    if (!r) {
        tdm_node_fail(n, att, TDM_ERESOURCE, true, "node task table full");
        return NULL;
    }
    tdm_worker_req_t req = {.seq_id = att->attempt_id,
                            .prompt = m->spec->prompt_tokens,
                            .n_prompt = (uint32_t)m->spec->n_prompt_tokens,
                            .user = r,
                            .embed = true,
                            .pooling = m->pooling == TANDEM__V1__POOLING__POOLING_MEAN
                                           ? TDM_POOLING_MEAN
                                           : TDM_POOLING_LAST};
    int rc = tdm_worker_add(rt->worker, &req, &err);
    if (rc != TDM_OK) {
        tdm_node_req_fail(n, r, rc, rc == TDM_ERESOURCE, err.msg);
        return NULL;
    }
    r->deadline_ms = m->spec->deadline_unix_ms;
    TDM_LOG_DEBUGF(tdm_node_log(n), att->label,
                   "embed task attempt=%s prompt_tokens=%zu pooling=%s", att->key,
                   m->spec->n_prompt_tokens, tdm_pooling_name(req.pooling));
    return r;
}

tdm_node_req_t *tdm_node_embed_start(tdm_node_t *n, const tdm_frame_t *f)
{
    const tdm_logger_t *log = tdm_node_log(n);
    Tandem__V1__EmbedTask *m =
        (Tandem__V1__EmbedTask *)tdm_frame_unpack(f, &tandem__v1__embed_task__descriptor);
    if (!m) {
        TDM_LOG_WARNF(log, NULL, "dropped an EmbedTask that does not decode");
        return NULL;
    }
    tdm_node_req_t *r = NULL;
    tdm_error_t err = {0};
    tdm_node_attempt_t att;
    if (tdm_node_spec_attempt(m->spec, f->instance_id, &att, &err) != 0)
        TDM_LOG_WARNF(log, NULL, "dropped an EmbedTask: %s", err.msg);
    else if (tdm_node_req_find(n, att.attempt_id))
        TDM_LOG_WARNF(log, att.label, "dropped a second EmbedTask for attempt %s", att.key);
    else
        r = embed_start(n, m, &att);
    tandem__v1__embed_task__free_unpacked(m, NULL);
    return r;
}

int tdm_node_send_embedding(tdm_sock_t *s, const tdm_node_attempt_t *a,
                            const tdm_worker_event_t *ev)
{
    if (!s)
        return TDM_EUNAVAILABLE;
    Tandem__V1__EmbeddingResult er = TANDEM__V1__EMBEDDING_RESULT__INIT;
    er.request_id = (char *)(uintptr_t)a->label;
    er.attempt_id = a->attempt_id;
    er.embedding = (float *)(uintptr_t)ev->embedding;
    er.n_embedding = ev->n_embd;
    er.prompt_tokens = ev->n_tokens;
    er.prefill_s = ev->prefill_s;
    return tdm_sock_notify(s, NULL, 0, TANDEM__V1__METHOD__METHOD_EMBEDDING, &er.base);
}
