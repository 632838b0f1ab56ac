/* worker_step.c - one step of the worker: the forward pass over the scheduled batch, then, in
 * batch order, the KV committed and the next token sampled (under a grammar's mask) for each
 * sequence that asked, ending sequences and handing prefilled KV over (PREFILL mode). */
#include "worker_internal.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* True when the batch built holds decode rows (and drafts) only, no prefill chunk. */
static bool decode_only(const tdm_worker_t *w)
{
    for (uint32_t k = 0; k < w->n_bseq; k++)
        if (w->b_chunk[k] != 1)
            return false;
    return true;
}

/* 4. The forward pass over the batch built; on failure every sequence of it fails. */
static int forward(tdm_worker_t *w, double *t_end, tdm_error_t *err)
{
    for (uint32_t k = 0; k < w->n_bseq; k++) {
        const wseq_t *s = &w->seqs[w->b_slot[k]];
        w->b_seqs[k] = tdm_worker_kv_view(w, s, k);
    }
    tdm_batch_t batch = {w->n_rows, w->b_tokens, w->b_pos, w->b_seq,
                         w->b_want, w->n_bseq,   w->b_seqs};
    double t0 = tdm_time_now();
    int rc = tdm_engine_forward_hidden(w->engine, &batch, w->logits, w->b_hidden ? w->hidden : NULL,
                                       err);
    *t_end = tdm_time_now();
    w->stats.last_step_s = *t_end - t0;
    w->stats.batch_size = w->n_bseq;
    w->stats.batch_tokens = w->n_rows;
    w->stats.steps++;
    w->stats.iteration_counts[tdm_worker_iteration_bucket(w->n_rows)]++;
    w->stats.iteration_tokens += w->n_rows;
    if (rc == TDM_OK && decode_only(w)) {
        w->stats.decode_step_s = w->stats.last_step_s;
        w->stats.decode_batch_size = w->n_bseq;
        if (w->spec)
            tdm_worker_spec_fit_add(w, w->n_rows, w->stats.last_step_s);
    }
    if (rc != TDM_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "forward pass failed: %.220s", err ? err->msg : tdm_strerror(rc));
        for (uint32_t k = 0; k < w->n_bseq; k++)
            tdm_worker_seq_fail(w, w->b_slot[k], rc, msg);
    }
    return rc;
}

/* PREFILL mode: hands the prompt's KV of slot to the caller and ends the sequence. */
static void hand_over(tdm_worker_t *w, uint32_t slot, int32_t token, double t_end)
{
    wseq_t *s = &w->seqs[slot];
    tdm_worker_event_t *pe = tdm_worker_push_event(w, TDM_WORKER_EVENT_PREFILLED, s);
    if (w->groups) { /* the live blocks of each group: the window groups gave back the rest */
        pe->hseq = s->hkv;
        memset(&s->hkv, 0, sizeof s->hkv);
    } else {
        pe->seq = s->kv;
        tdm_kv_seq_init(&s->kv);
    }
    pe->n_tokens = s->n_computed; /* the prompt and any resumed output */
    pe->first_token = token;
    pe->cached_prompt_tokens = s->cached_prompt_tokens;
    pe->prefill_s = t_end - s->t_first_sched;
    tdm_worker_unlink(w, slot);
    tdm_worker_seq_free(w, slot);
}

/* The grammar's mask of s's next token in w->mask (tokens past the grammar's vocabulary stay
 * masked). With ignore_eos, end-of-generation tokens are masked too while the grammar allows
 * anything else (when it allows nothing else, the output is complete and may only end). */
static void grammar_mask(tdm_worker_t *w, wseq_t *s)
{
    memset(w->mask, 0, ((size_t)w->n_vocab + 31) / 32 * sizeof *w->mask);
    uint32_t n_allowed = tdm_grammar_matcher_fill_mask(s->matcher, w->mask);
    if (!s->sp.ignore_eos)
        return;
    uint32_t n_eog = 0;
    for (uint32_t i = 0; i < w->n_eog; i++)
        n_eog += (w->mask[w->eog[i] / 32] >> (w->eog[i] % 32)) & 1u;
    if (n_eog < n_allowed)
        for (uint32_t i = 0; i < w->n_eog; i++)
            w->mask[w->eog[i] / 32] &= ~(1u << (w->eog[i] % 32));
}

/* Whether w->mask allows any token. */
static bool mask_any(const tdm_worker_t *w)
{
    size_t words = ((size_t)w->n_vocab + 31) / 32;
    for (size_t i = 0; i < words; i++)
        if (w->mask[i])
            return true;
    return false;
}

/* The mask of s's next token in w->mask: its grammar's (grammar_mask) and the request's own
 * masks (min_tokens, bad_words, allowed_token_ids: tdm_sampling_request_mask, over the output
 * so far); NULL when neither restricts this step. A grammar that allows only the end while
 * min_tokens masks it is complete: min_tokens then yields to it rather than leave no token. */
static const uint32_t *next_mask(tdm_worker_t *w, wseq_t *s)
{
    bool own = tdm_sampling_has_request_mask(&s->sp);
    if (!s->matcher && !own)
        return NULL;
    if (s->matcher)
        grammar_mask(w, s);
    else
        memset(w->mask, 0xff, ((size_t)w->n_vocab + 31) / 32 * sizeof *w->mask);
    const int32_t *out = s->tokens + s->n_prompt;
    size_t n_out = s->n_tokens - s->n_prompt;
    bool masked =
        own && tdm_sampling_request_mask(&s->sp, w->n_vocab, w->eog, w->n_eog, out, n_out, w->mask);
    if (masked && s->matcher && (int64_t)n_out < (int64_t)s->sp.min_tokens && !mask_any(w)) {
        grammar_mask(w, s);
        int32_t min_tokens = s->sp.min_tokens;
        s->sp.min_tokens = 0; /* for this step only */
        tdm_sampling_request_mask(&s->sp, w->n_vocab, w->eog, w->n_eog, out, n_out, w->mask);
        s->sp.min_tokens = min_tokens;
    }
    if (!s->matcher && !masked)
        return NULL;
    return w->mask;
}

/* How the token just appended ends the sequence, or 0 when it goes on: a stop token, a grammar
 * that is done (STOP), then max_tokens (LENGTH), so a constraint is never cut and called
 * complete. */
static int end_of(const tdm_worker_t *w, const wseq_t *s, int32_t token)
{
    if (tdm_worker_is_stop(w, &s->sp, token) ||
        (s->matcher && tdm_grammar_matcher_is_done(s->matcher)))
        return TDM_WORKER_FINISH_STOP;
    if (s->n_tokens - s->n_prompt >= s->max_new)
        return TDM_WORKER_FINISH_LENGTH;
    return 0;
}

/* 5. Samples the next token of slot from its logits row (under its grammar's mask when it has
 * one) and ends the sequence when that token ends it. Returns true when the sequence goes on
 * (false: it finished, failed or was handed over, and its slot is free). */
bool tdm_worker_sample_next(tdm_worker_t *w, uint32_t slot, const float *row, double t_end)
{
    wseq_t *s = &w->seqs[slot];
    uint32_t index = s->n_tokens - s->n_prompt;
    tdm_worker_event_t *ev = tdm_worker_push_event(w, TDM_WORKER_EVENT_TOKEN, s);
    if (tdm_sampler_sample_masked(w->sampler, &s->sp, row, next_mask(w, s), s->tokens, s->n_tokens,
                                  index, &ev->sample) != TDM_OK) {
        w->n_events--; /* replace the token event by a failure */
        char msg[256];
        snprintf(msg, sizeof msg, "sampling: %.230s", tdm_sampler_errmsg(w->sampler));
        tdm_worker_seq_fail(w, slot, TDM_EINVALID, msg)->request_fault =
            tdm_sampler_masked_out(w->sampler);
        return false;
    }
    ev->index = index;
    if (index == 0) {
        ev->cached_prompt_tokens = s->cached_prompt_tokens;
        ev->prefill_s = t_end - s->t_first_sched;
        if (s->plp) { /* the event owns them now (tdm_worker_events_release) */
            ev->prompt_logprobs = s->plp;
            ev->n_prompt_logprobs = s->n_prompt;
            ev->prompt_logprobs_bytes = s->plp_bytes; /* still held, now by the event */
            s->plp = NULL;
            s->plp_bytes = 0;
        }
    }
    int32_t token = ev->sample.token;
    if (s->matcher && tdm_grammar_matcher_accept_token(s->matcher, token) != TDM_OK) {
        free((void *)(uintptr_t)ev->prompt_logprobs); /* index 0's, the event's now */
        ev->prompt_logprobs = NULL;
        w->plp_held -= ev->prompt_logprobs_bytes;
        ev->prompt_logprobs_bytes = 0;
        w->n_events--; /* the mask allowed a token the matcher refuses: the grammar's bug */
        char msg[256];
        snprintf(msg, sizeof msg, "constraint: the masked token %d was refused: %.190s", token,
                 tdm_grammar_matcher_errmsg(s->matcher));
        tdm_worker_seq_fail(w, slot, TDM_EINTERNAL, msg);
        return false;
    }
    s->tokens[s->n_tokens++] = token;
    int why = end_of(w, s, token);
    if (w->o.mode == TDM_WORKER_MODE_PREFILL)
        hand_over(w, slot, token, t_end);
    else if (why)
        tdm_worker_seq_finish(w, slot, (tdm_worker_finish_t)why);
    return w->o.mode != TDM_WORKER_MODE_PREFILL && !why;
}

/* Records that s's first n_computed tokens have their KV in its blocks. */
void tdm_worker_commit_kv(tdm_worker_t *w, wseq_t *s)
{
    if (w->groups) /* gives back what the window groups no longer read */
        tdm_kv_hseq_commit(w->pool, &s->hkv, w->o.prefix_caching ? s->tokens : NULL, s->n_computed);
    else if (w->o.prefix_caching)
        tdm_kv_seq_commit(w->pool, &s->kv, s->tokens, s->n_computed);
    else
        s->kv.n_tokens = s->n_computed;
}

void tdm_worker_events_done(tdm_worker_t *w)
{
    tdm_worker_events_release(w);
}

void tdm_worker_events_release(tdm_worker_t *w)
{
    for (uint32_t i = 0; i < w->n_events; i++) {
        free((void *)(uintptr_t)w->events[i].prompt_logprobs);
        w->plp_held -= w->events[i].prompt_logprobs_bytes;
        w->events[i].prompt_logprobs = NULL;
        w->events[i].n_prompt_logprobs = 0;
        w->events[i].prompt_logprobs_bytes = 0;
    }
}

/* Prompt logprobs from the rows of a chunk of s that began at position pos0: row j (position
 * pos0 + j) is the distribution of the token at pos0 + j + 1. A failure fails the sequence
 * (false). */
static bool prompt_logprobs(tdm_worker_t *w, uint32_t slot, uint32_t pos0, uint32_t chunk,
                            const float *rows)
{
    wseq_t *s = &w->seqs[slot];
    for (uint32_t j = 0; j < chunk && pos0 + j + 1 < s->n_prompt; j++) {
        uint32_t at = pos0 + j + 1;
        tdm_token_logprobs_t lp; /* the sampler's full-width answer, kept at plp_top wide */
        if (tdm_sampler_token_logprobs(w->sampler, rows + (size_t)j * w->n_vocab, s->tokens[at],
                                       s->plp_top, &lp) == TDM_OK) {
            tdm_prompt_logprob_t *e = &s->plp[at];
            e->token = lp.token;
            e->logprob = lp.logprob;
            e->rank = lp.rank;
            e->n_top = lp.n_top <= s->plp_top ? lp.n_top : s->plp_top;
            memcpy(e->top, lp.top, e->n_top * sizeof *lp.top);
        } else {
            char msg[256];
            snprintf(msg, sizeof msg, "prompt logprobs: %.220s", tdm_sampler_errmsg(w->sampler));
            tdm_worker_seq_fail(w, slot, TDM_EINVALID, msg);
            return false;
        }
    }
    return true;
}

/* An embedding sequence's rows: the chunk's hidden states (batch rows r0..) pooled into its
 * accumulator in position order; when its prompt is complete, its vector goes out in an
 * EMBEDDING event and the sequence ends (blocks freed). */
static void embed_rows(tdm_worker_t *w, uint32_t slot, uint32_t r0, uint32_t chunk, double t_end)
{
    wseq_t *s = &w->seqs[slot];
    for (uint32_t j = 0; j < chunk; j++)
        tdm_embedding_add(s->pooling, s->emb_acc, w->hidden + (size_t)(r0 + j) * w->n_embd,
                          w->n_embd);
    s->n_computed += chunk;
    tdm_worker_commit_kv(w, s);
    if (s->n_computed < s->n_tokens)
        return;
    float *out = w->emb_out + (size_t)w->n_emb_out++ * w->n_embd;
    tdm_embedding_finish(s->pooling, s->emb_acc, s->n_tokens, w->n_embd, out);
    tdm_worker_event_t *ev = tdm_worker_push_event(w, TDM_WORKER_EVENT_EMBEDDING, s);
    ev->embedding = out;
    ev->n_embd = w->n_embd;
    ev->n_tokens = s->n_tokens;
    ev->prefill_s = t_end - s->t_first_sched;
    ev->preemptions = s->preemptions;
    tdm_worker_unlink(w, slot);
    tdm_worker_seq_free(w, slot);
}

/* 5. Results, in batch order: KV committed, then a token for each sequence that asked. */
static void collect(tdm_worker_t *w, double t_end)
{
    uint32_t li = 0, r0 = 0;
    w->n_emb_out = 0;
    for (uint32_t k = 0; k < w->n_bseq; r0 += w->b_chunk[k] + w->b_draft[k], k++) {
        uint32_t slot = w->b_slot[k];
        wseq_t *s = &w->seqs[slot];
        if (s->embed) {
            embed_rows(w, slot, r0, w->b_chunk[k], t_end);
            continue;
        }
        if (tdm_worker_plp_active(s)) { /* every row of the chunk has logits */
            uint32_t pos0 = s->n_computed, chunk = w->b_chunk[k];
            const float *rows = w->logits + (size_t)li * w->n_vocab;
            li += chunk;
            s->n_computed += chunk;
            tdm_worker_commit_kv(w, s);
            if (prompt_logprobs(w, slot, pos0, chunk, rows) && w->b_logits[k])
                tdm_worker_sample_next(w, slot, rows + (size_t)(chunk - 1) * w->n_vocab, t_end);
            continue;
        }
        s->n_computed += w->b_chunk[k];
        tdm_worker_commit_kv(w, s);
        if (w->b_draft[k] > 0) {
            tdm_worker_spec_verify(w, slot, w->b_draft[k], w->logits + (size_t)li * w->n_vocab,
                                   t_end);
            li += 1 + w->b_draft[k];
        } else if (w->b_logits[k]) {
            tdm_worker_sample_next(w, slot, w->logits + (size_t)li++ * w->n_vocab, t_end);
        }
    }
}

int tdm_worker_step(tdm_worker_t *w, const tdm_worker_event_t **events, uint32_t *n_events,
                    tdm_error_t *err)
{
    tdm_worker_events_release(w);
    w->n_events = 0;
    *events = w->events;
    tdm_worker_schedule(w);
    int rc = TDM_OK;
    if (w->n_rows > 0) {
        double t_end;
        rc = forward(w, &t_end, err);
        if (rc == TDM_OK)
            collect(w, t_end);
    }
    *n_events = w->n_events;
    return rc;
}
