/* worker.c - the continuous-batching worker's sequences (worker.h has the rules): life cycle,
 * the id index, admission, forks, cancel, events and stats. A step is built in worker_sched.c
 * and worker_spec.c and run in worker_step.c.
 *
 * Memory: tdm_worker_new allocates every table of the worker; tdm_worker_add allocates one
 * sequence's token array and block table, both sized for the sequence's longest possible
 * length (prompt + max_new tokens), so a step never allocates: preemption clears a block
 * table (or a grouped pool's tables, worker_kv.c) and keeps it for the recompute. Sequences are
 * found by their u64 id through a hash index (XXH3 of the id, chained through the slots), never by
 * a scan.
 */
#include "worker_internal.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

/* ---- the id index ---- */

static uint32_t *bucket_of(const tdm_worker_t *w, uint64_t id)
{
    uint64_t h = XXH3_64bits(&id, sizeof id);
    return &w->buckets[h & (w->n_buckets - 1)];
}

static int find_slot(const tdm_worker_t *w, uint64_t id)
{
    for (uint32_t i = *bucket_of(w, id); i != NO_SLOT; i = w->seqs[i].next)
        if (w->seqs[i].id == id)
            return (int)i;
    return -1;
}

static void index_remove(tdm_worker_t *w, uint32_t slot)
{
    uint32_t *p = bucket_of(w, w->seqs[slot].id);
    while (*p != slot)
        p = &w->seqs[*p].next;
    *p = w->seqs[slot].next;
}

/* Frees a sequence's memory and returns its slot (it must be unlinked from running/waiting). */
void tdm_worker_seq_free(tdm_worker_t *w, uint32_t slot)
{
    wseq_t *s = &w->seqs[slot];
    index_remove(w, slot);
    tdm_worker_kv_release(w, s);
    tdm_grammar_matcher_destroy(&s->matcher);
    free(s->tokens);
    free(s->plp);
    free(s->emb_acc);
    w->plp_held -= s->plp_bytes;
    memset(s, 0, sizeof *s);
    w->free_slots[w->n_free++] = slot;
}

/* ---- life cycle ---- */

static int check_opts(const tdm_engine_t *engine, const tdm_kv_pool_t *pool,
                      const tdm_tokenizer_t *tok, uint32_t n_vocab, const tdm_worker_opts_t *opts,
                      tdm_error_t *err)
{
    if (!engine || !pool || !tok || n_vocab == 0 || !opts)
        return tdm_error_set(err, TDM_EINVALID,
                             "worker: engine, pool, tokenizer and options required");
    if (opts->max_batch_tokens == 0 || opts->max_running == 0 || opts->n_ctx < 2 ||
        opts->max_running > 65536 || opts->max_waiting > 1000000 ||
        opts->max_draft > TDM_WORKER_MAX_DRAFT || !(opts->spec_row_cost >= 0) ||
        opts->spec_row_cost > 10)
        return tdm_error_set(err, TDM_EINVALID,
                             "worker: max_batch_tokens (%u) and max_running (%u, <= 65536) must "
                             "be >= 1, n_ctx (%u) >= 2, max_waiting (%u) <= 1000000, max_draft "
                             "(%u) <= %u, spec_row_cost (%g) in [0, 10]",
                             opts->max_batch_tokens, opts->max_running, opts->n_ctx,
                             opts->max_waiting, opts->max_draft, TDM_WORKER_MAX_DRAFT,
                             opts->spec_row_cost);
    if (opts->grammar_vocab && tdm_grammar_vocab_n_vocab(opts->grammar_vocab) > n_vocab)
        return tdm_error_set(err, TDM_EINVALID,
                             "worker: the grammar vocabulary has %u tokens, the model %u",
                             tdm_grammar_vocab_n_vocab(opts->grammar_vocab), n_vocab);
    return TDM_OK;
}

/* Allocates every table of w (sizes from w->o); false on out of memory. */
static bool alloc_tables(tdm_worker_t *w)
{
    size_t bt = w->o.max_batch_tokens, mr = w->o.max_running;
    w->n_slots = w->o.max_running + w->o.max_waiting;
    w->n_buckets = 1;
    while (w->n_buckets < 2 * w->n_slots)
        w->n_buckets *= 2;
    w->seqs = calloc(w->n_slots, sizeof *w->seqs);
    w->buckets = malloc(w->n_buckets * sizeof *w->buckets);
    w->free_slots = malloc(w->n_slots * sizeof *w->free_slots);
    w->running = calloc(mr, sizeof *w->running);
    w->waiting = calloc(w->n_slots, sizeof *w->waiting);
    w->b_tokens = calloc(bt, sizeof *w->b_tokens);
    w->b_pos = calloc(bt, sizeof *w->b_pos);
    w->b_seq = calloc(bt, sizeof *w->b_seq);
    w->b_want = calloc(bt, sizeof *w->b_want);
    w->b_seqs = calloc(mr, sizeof *w->b_seqs);
    w->b_slot = calloc(mr, sizeof *w->b_slot);
    w->b_chunk = calloc(mr, sizeof *w->b_chunk);
    w->b_draft = calloc(mr, sizeof *w->b_draft);
    w->b_logits = calloc(mr, sizeof *w->b_logits);
    w->logit_rows = tdm_worker_logit_rows(&w->o);
    w->logits = malloc((size_t)w->logit_rows * w->n_vocab * sizeof *w->logits);
    w->mask = calloc(((size_t)w->n_vocab + 31) / 32, sizeof *w->mask);
    w->cap_events = 2 * w->n_slots + w->o.max_running * w->o.max_draft;
    w->events = calloc(w->cap_events, sizeof *w->events);
    if (w->groups && (!(w->b_gb = calloc(mr * w->groups->n_groups, sizeof *w->b_gb)) ||
                      !(w->match_scratch = malloc(tdm_kv_hseq_match_scratch_bytes(
                            tdm_kv_pool_layout(w->pool)->block_size, w->o.n_ctx)))))
        return false;
    if (!w->seqs || !w->buckets || !w->free_slots || !w->running || !w->waiting || !w->b_tokens ||
        !w->b_pos || !w->b_seq || !w->b_want || !w->b_seqs || !w->b_slot || !w->b_chunk ||
        !w->b_draft || !w->b_logits || !w->logits || !w->mask || !w->events)
        return false;
    for (uint32_t i = 0; i < w->n_buckets; i++)
        w->buckets[i] = NO_SLOT;
    for (uint32_t i = 0; i < w->n_slots; i++)
        w->free_slots[i] = w->n_slots - 1 - i; /* slot 0 is taken first */
    w->n_free = w->n_slots;
    return true;
}

tdm_worker_t *tdm_worker_new(tdm_engine_t *engine, tdm_kv_pool_t *pool, const tdm_tokenizer_t *tok,
                             uint32_t n_vocab, const tdm_worker_opts_t *opts, tdm_error_t *err)
{
    if (check_opts(engine, pool, tok, n_vocab, opts, err) != TDM_OK)
        return NULL;
    tdm_worker_t *w = calloc(1, sizeof *w);
    if (!w)
        goto out_oom;
    w->engine = engine;
    w->pool = pool;
    w->groups = tdm_kv_pool_groups(pool);
    w->tok = tok;
    w->n_vocab = n_vocab;
    w->n_embd = tdm_engine_n_embd(engine);
    w->o = *opts;
    if (w->o.plp_reserve_bytes == 0)
        w->o.plp_reserve_bytes = tdm_worker_plp_reserve(w->o.n_ctx);
    if (w->o.mode != TDM_WORKER_MODE_DECODE)
        w->o.max_draft = 0;
    /* exact only where a row's logits do not depend on the batch: the CPU engine (whose KV is
     * the host pool's, no device copy) */
    w->spec = w->o.max_draft > 0 && tdm_kv_pool_layout(pool)->dtype != TDM_KV_Q8 &&
              tdm_engine_kv_device_base(engine) == NULL;
    if (!alloc_tables(w))
        goto out_free;
    for (uint32_t t = 0; t < n_vocab && w->n_eog < WORKER_MAX_EOG; t++)
        if (tdm_tokenizer_is_eog(tok, (int32_t)t))
            w->eog[w->n_eog++] = (int32_t)t;
    w->sampler = tdm_sampler_new(n_vocab, err);
    if (!w->sampler) {
        tdm_worker_destroy(&w);
        return NULL;
    }
    return w;
out_free:
    tdm_worker_destroy(&w);
out_oom:
    tdm_error_set(err, TDM_ERESOURCE, "worker: out of memory");
    return NULL;
}

void tdm_worker_destroy(tdm_worker_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_worker_t *w = *self_p;
    if (w->seqs && w->buckets && w->free_slots)
        for (uint32_t i = 0; i < w->n_slots; i++)
            if (w->seqs[i].used)
                tdm_worker_seq_free(w, i);
    tdm_worker_events_release(w);
    tdm_sampler_destroy(&w->sampler);
    free(w->seqs);
    free(w->buckets);
    free(w->free_slots);
    free(w->running);
    free(w->waiting);
    free(w->b_tokens);
    free(w->b_pos);
    free(w->b_seq);
    free(w->b_want);
    free(w->b_seqs);
    free(w->b_slot);
    free(w->b_chunk);
    free(w->b_draft);
    free(w->b_logits);
    free(w->logits);
    free(w->mask);
    free(w->events);
    free(w->b_gb);
    free(w->match_scratch);
    free(w->hidden);
    free(w->emb_out);
    free(w);
    *self_p = NULL;
}

uint64_t tdm_worker_plp_bytes(uint32_t n_prompt, uint32_t top)
{
    return (uint64_t)n_prompt *
           (sizeof(tdm_prompt_logprob_t) + (uint64_t)top * sizeof(tdm_token_logprob_t));
}

uint64_t tdm_worker_plp_reserve(uint32_t n_ctx)
{
    return tdm_worker_plp_bytes(n_ctx > 0 ? n_ctx - 1 : 0, TDM_SAMPLING_MAX_LOGPROBS);
}

uint32_t tdm_worker_logit_rows(const tdm_worker_opts_t *opts)
{
    if (opts->mode != TDM_WORKER_MODE_DECODE || opts->max_draft == 0)
        return opts->max_running;
    uint32_t seqs =
        opts->max_running < TDM_WORKER_SPEC_SEQS ? opts->max_running : TDM_WORKER_SPEC_SEQS;
    return opts->max_running + seqs * opts->max_draft;
}

bool tdm_worker_token_ends(const tdm_tokenizer_t *tok, const tdm_sampling_params_t *sp,
                           int32_t token)
{
    return tdm_sampling_is_stop(sp, token) || (!sp->ignore_eos && tdm_tokenizer_is_eog(tok, token));
}

/* Whether token ends generation for the sequence's parameters. */
bool tdm_worker_is_stop(const tdm_worker_t *w, const tdm_sampling_params_t *sp, int32_t token)
{
    return tdm_worker_token_ends(w->tok, sp, token);
}

/* ---- admission ---- */

/* TDM_EINVALID naming what[i] when a token of ids[n] is outside the vocabulary, else 0. */
static int check_vocab(const tdm_worker_t *w, const char *what, const int32_t *ids, uint32_t n,
                       tdm_error_t *err)
{
    for (uint32_t i = 0; i < n; i++)
        if (ids[i] < 0 || (uint32_t)ids[i] >= w->n_vocab)
            return tdm_error_set(err, TDM_EINVALID,
                                 "%s[%u]: token id %d is outside the vocabulary [0, %u)", what, i,
                                 ids[i], w->n_vocab);
    return TDM_OK;
}

/* The checks of a resumed request's output tokens (and the prefilled table that holds them
 * with the prompt): TDM_EINVALID naming the field. */
static int check_resume(const tdm_worker_t *w, const tdm_worker_req_t *req, tdm_error_t *err)
{
    uint32_t n_ctx_tokens = req->n_prompt + req->n_output;
    if (req->n_output > 0 && !req->output)
        return tdm_error_set(err, TDM_EINVALID, "output: %u tokens but no array", req->n_output);
    if (req->n_output >= w->o.n_ctx || n_ctx_tokens + 1 > w->o.n_ctx)
        return tdm_error_set(err, TDM_EINVALID,
                             "output: %u tokens after a prompt of %u; at most %u fit the "
                             "context of %u tokens",
                             req->n_output, req->n_prompt, w->o.n_ctx - 1, w->o.n_ctx);
    if (req->n_output >= (uint32_t)req->sampling->max_tokens)
        return tdm_error_set(err, TDM_EINVALID,
                             "output: %u tokens delivered already; max_tokens is %d", req->n_output,
                             req->sampling->max_tokens);
    const tdm_kv_seq_t *pre = req->prefilled;
    if (pre &&
        (pre->n_tokens < n_ctx_tokens ||
         tdm_kv_blocks_for_tokens(tdm_kv_pool_layout(w->pool), n_ctx_tokens) > pre->n_blocks))
        return tdm_error_set(err, TDM_EINVALID,
                             "prefilled KV covers %u tokens in %u blocks; the prompt and output "
                             "have %u",
                             pre->n_tokens, pre->n_blocks, n_ctx_tokens);
    return check_vocab(w, "output", req->output, req->n_output, err);
}

/* The checks of an embedding sequence (after check_req's common ones): TDM_EINVALID naming the
 * field. */
static int check_embed(const tdm_worker_t *w, const tdm_worker_req_t *req, tdm_error_t *err)
{
    if (req->n_prompt > w->o.n_ctx)
        return tdm_error_set(err, TDM_EINVALID,
                             "prompt: %u tokens; at most %u fit the context of %u tokens",
                             req->n_prompt, w->o.n_ctx, w->o.n_ctx);
    if (req->pooling != TDM_POOLING_LAST && req->pooling != TDM_POOLING_MEAN)
        return tdm_error_set(err, TDM_EINVALID, "pooling: %d is not last (0) or mean (1)",
                             (int)req->pooling);
    if (req->prefilled || req->prefilled_groups || req->output || req->n_output || req->grammar ||
        req->prompt_logprobs)
        return tdm_error_set(err, TDM_EINVALID,
                             "embed: an embedding sequence takes no prefilled KV, output, "
                             "grammar or prompt_logprobs");
    return check_vocab(w, "prompt", req->prompt, req->n_prompt, err);
}

/* The checks of tdm_worker_add that need no allocation; TDM_EINVALID naming the field. */
static int check_req(const tdm_worker_t *w, const tdm_worker_req_t *req, tdm_error_t *err)
{
    if (req->seq_id == 0)
        return tdm_error_set(err, TDM_EINVALID, "seq_id: 0 is not a sequence id");
    if (find_slot(w, req->seq_id) >= 0)
        return tdm_error_set(err, TDM_EINVALID, "seq_id %016" PRIx64 " is already in the worker",
                             req->seq_id);
    if (req->n_prompt == 0 || !req->prompt)
        return tdm_error_set(err, TDM_EINVALID, "prompt: empty (at least 1 token is needed)");
    if (req->embed)
        return check_embed(w, req, err);
    if (req->n_prompt + 1 > w->o.n_ctx)
        return tdm_error_set(err, TDM_EINVALID,
                             "prompt: %u tokens; at most %u fit the context of %u tokens",
                             req->n_prompt, w->o.n_ctx - 1, w->o.n_ctx);
    if (check_vocab(w, "prompt", req->prompt, req->n_prompt, err) != TDM_OK)
        return TDM_EINVALID;
    if (req->prompt_logprobs && (req->prompt_logprobs_top > TDM_SAMPLING_MAX_LOGPROBS ||
                                 req->prompt_logprobs_top > w->n_vocab))
        return tdm_error_set(err, TDM_EINVALID, "prompt_logprobs must be in [0, %d], got %u",
                             TDM_SAMPLING_MAX_LOGPROBS, req->prompt_logprobs_top);
    if (req->sampling->max_tokens < 1)
        return tdm_error_set(err, TDM_EINVALID, "max_tokens must be >= 1, got %d",
                             req->sampling->max_tokens);
    const tdm_kv_seq_t *pre = req->prefilled;
    if (pre && w->groups)
        return tdm_error_set(err, TDM_EINVALID,
                             "prefilled: this worker's KV pool has %u layer groups; prefilled KV "
                             "comes in one table per group (prefilled_groups)",
                             w->groups->n_groups);
    if (req->prefilled_groups && !w->groups)
        return tdm_error_set(err, TDM_EINVALID,
                             "prefilled_groups: this worker's KV pool has no layer groups; "
                             "prefilled KV comes in one table of every layer (prefilled)");
    if (req->prefilled_groups &&
        tdm_kv_hseq_check_handover(req->prefilled_groups, w->groups,
                                   tdm_kv_pool_layout(w->pool)->block_size,
                                   req->n_prompt + req->n_output, err) != TDM_OK)
        return TDM_EINVALID;
    if ((pre || req->prefilled_groups) && w->o.mode == TDM_WORKER_MODE_PREFILL)
        return tdm_error_set(err, TDM_EINVALID, "prefilled: a PREFILL worker computes the KV");
    if (check_resume(w, req, err) != TDM_OK)
        return TDM_EINVALID;
    if (req->grammar && !w->o.grammar_vocab)
        return tdm_error_set(err, TDM_EINVALID,
                             "constraint: this worker has no grammar vocabulary");
    if ((pre || req->prefilled_groups) &&
        (req->first_token < 0 || (uint32_t)req->first_token >= w->n_vocab))
        return tdm_error_set(err, TDM_EINVALID, "first_token %d is outside the vocabulary [0, %u)",
                             req->first_token, w->n_vocab);
    return TDM_OK;
}

/* Refuses a sequence the pool could never hold even alone, before it takes a block: at its
 * peak it holds the KV of cap - 1 tokens (the last token sampled is never computed) in DECODE
 * mode, of its prompt and resumed output in PREFILL mode (what it hands over); that is
 * ceil(tokens / block_size) blocks of a plain pool, or the layer groups' peak
 * (tdm_kv_groups_blocks_per_seq). Admitted, it would compute part of its prompt and then wait
 * for blocks that never come. TDM_ERESOURCE naming the tokens, the blocks and the pool's. */
static int check_fits(const tdm_worker_t *w, const tdm_worker_req_t *req, uint32_t cap,
                      tdm_error_t *err)
{
    const tdm_kv_layout_t *l = tdm_kv_pool_layout(w->pool);
    /* a prefill worker computes the prompt and the resumed output, an embedding every prompt
     * token; a decode sequence never computes its last sampled token */
    bool prefill = w->o.mode == TDM_WORKER_MODE_PREFILL || req->embed;
    uint32_t kv_tokens = prefill ? req->n_prompt + req->n_output : cap - 1;
    uint64_t need = w->groups ? tdm_kv_groups_blocks_per_seq(w->groups, l->block_size, kv_tokens)
                              : tdm_kv_blocks_for_tokens(l, kv_tokens);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(w->pool, &st);
    if (need <= st.n_blocks)
        return TDM_OK;
    return tdm_error_set(err, TDM_ERESOURCE,
                         "KV pool too small for the sequence: the prompt (%u tokens) and %s%u "
                         "output tokens need the KV of %u tokens, %" PRIu64
                         " blocks of %u tokens at their peak; the pool has %u blocks",
                         req->n_prompt, prefill ? "" : "up to ",
                         prefill ? req->n_output : cap - req->n_prompt, kv_tokens, need,
                         l->block_size, st.n_blocks);
}

/* Takes over a prefilled table (its KV and the first token) into s. */
static void take_prefilled(tdm_worker_t *w, wseq_t *s, const tdm_worker_req_t *req)
{
    if (req->prefilled_groups) {
        s->hkv = *req->prefilled_groups;
        memset(req->prefilled_groups, 0, sizeof *req->prefilled_groups);
        s->hkv.groups = w->groups;
        s->hkv.n_tokens = s->n_tokens;
        s->hkv.n_hashed = 0; /* registered in this pool from the first commit on */
        s->hkv.last_hash = 0;
    } else {
        s->kv = *req->prefilled;
        tdm_kv_seq_init(req->prefilled);
    }
    s->kv.n_tokens = s->n_tokens; /* the prompt and the resumed output */
    s->n_computed = s->n_tokens;
    s->tokens[s->n_tokens++] = req->first_token;
    s->admitted_once = true;
    if (tdm_worker_is_stop(w, &s->sp, req->first_token) ||
        (s->matcher && tdm_grammar_matcher_is_done(s->matcher))) {
        s->finish_pending = true;
        s->pending_finish = TDM_WORKER_FINISH_STOP;
    } else if (s->n_tokens - s->n_prompt >= s->max_new) {
        s->finish_pending = true;
        s->pending_finish = TDM_WORKER_FINISH_LENGTH;
    }
}

/* Feeds tokens [n] (output indices from first) to m. TDM_EINVALID naming the first token
 * the grammar does not allow. */
static int matcher_replay(tdm_grammar_matcher_t *m, const int32_t *tokens, uint32_t n,
                          uint32_t first, tdm_error_t *err)
{
    for (uint32_t i = 0; i < n; i++)
        if (tdm_grammar_matcher_accept_token(m, tokens[i]) != TDM_OK)
            return tdm_error_set(err, TDM_EINVALID,
                                 "constraint: output token %u (id %d) is not allowed by the "
                                 "grammar: %s",
                                 first + i, tokens[i], tdm_grammar_matcher_errmsg(m));
    return TDM_OK;
}

/* The matcher of a constrained sequence with the output so far replayed into it: a resumed
 * sequence's output, then a prefilled sequence's first token. TDM_EINVALID naming the first
 * token the grammar does not allow, TDM_ERESOURCE on out of memory. */
static int matcher_open(const tdm_worker_t *w, const tdm_worker_req_t *req,
                        tdm_grammar_matcher_t **out, tdm_error_t *err)
{
    tdm_grammar_matcher_t *m = tdm_grammar_matcher_new(req->grammar, w->o.grammar_vocab, err);
    if (!m)
        return err ? err->code : TDM_ERESOURCE;
    if (matcher_replay(m, req->output, req->n_output, 0, err) != TDM_OK ||
        ((req->prefilled || req->prefilled_groups) &&
         matcher_replay(m, &req->first_token, 1, req->n_output, err) != TDM_OK)) {
        tdm_grammar_matcher_destroy(&m);
        return TDM_EINVALID;
    }
    *out = m;
    return TDM_OK;
}

/* Whether n bytes of prompt logprobs fit the worker's reserve: TDM_EINVALID when they never
 * can, TDM_ERESOURCE while other sequences hold too much of it. */
static int plp_admit(const tdm_worker_t *w, const tdm_worker_req_t *req, uint64_t n,
                     tdm_error_t *err)
{
    uint64_t reserve = w->o.plp_reserve_bytes;
    if (n > reserve)
        return tdm_error_set(err, TDM_EINVALID,
                             "prompt_logprobs: %u prompt tokens with %u alternatives take %" PRIu64
                             " bytes; the node's prompt-logprobs reserve is %" PRIu64 " bytes",
                             req->n_prompt, req->prompt_logprobs_top, n, reserve);
    if (n > reserve - w->plp_held)
        return tdm_error_set(
            err, TDM_ERESOURCE,
            "prompt_logprobs: %u prompt tokens with %u alternatives take %" PRIu64
            " bytes; %" PRIu64 " of the node's %" PRIu64 "-byte reserve are free now",
            req->n_prompt, req->prompt_logprobs_top, n, reserve - w->plp_held, reserve);
    return TDM_OK;
}

/* [n_prompt] zeroed entries, each top[] pointing at its top alternatives, which follow the
 * entries in the same allocation (tdm_worker_plp_bytes); NULL on out of memory. */
static tdm_prompt_logprob_t *plp_alloc(uint32_t n_prompt, uint32_t top)
{
    tdm_prompt_logprob_t *e = calloc(1, tdm_worker_plp_bytes(n_prompt, top));
    if (!e)
        return NULL;
    tdm_token_logprob_t *alt = (tdm_token_logprob_t *)(e + n_prompt);
    for (uint32_t i = 0; i < n_prompt; i++)
        e[i].top = alt + (size_t)i * top;
    return e;
}

/* The step buffers embedding sequences need (w->hidden, w->emb_out), allocated with the first
 * one so that workers that never embed do not carry them. TDM_ERESOURCE on out of memory. */
static int embed_buffers(tdm_worker_t *w)
{
    if (w->hidden)
        return TDM_OK;
    float *hidden = malloc((size_t)w->o.max_batch_tokens * w->n_embd * sizeof *hidden);
    float *out = malloc((size_t)w->o.max_running * w->n_embd * sizeof *out);
    if (!hidden || !out) {
        free(hidden);
        free(out);
        return TDM_ERESOURCE;
    }
    w->hidden = hidden;
    w->emb_out = out;
    return TDM_OK;
}

/* What a new sequence holds from tdm_worker_add on (the step path never allocates). */
typedef struct {
    wseq_t tables;              /* the new sequence's block table(s) */
    int32_t *tokens;            /* cap tokens */
    tdm_prompt_logprob_t *plps; /* prompt logprobs, or NULL */
    double *acc;                /* an embedding's pooling accumulator (n_embd), or NULL */
} seq_alloc_t;

static void seq_alloc_free(tdm_worker_t *w, seq_alloc_t *a)
{
    tdm_worker_kv_release(w, &a->tables);
    free(a->tokens);
    free(a->plps);
    free(a->acc);
}

/* Allocates everything req's sequence of cap tokens will hold and checks that its peak KV fits
 * the pool (check_fits). TDM_ERESOURCE with nothing held on failure. */
static int seq_alloc(tdm_worker_t *w, const tdm_worker_req_t *req, uint32_t cap, bool plp,
                     seq_alloc_t *a, tdm_error_t *err)
{
    memset(a, 0, sizeof *a);
    a->tokens = malloc((size_t)cap * sizeof *a->tokens);
    a->plps = plp ? plp_alloc(req->n_prompt, req->prompt_logprobs_top) : NULL;
    a->acc = req->embed ? calloc(w->n_embd, sizeof *a->acc) : NULL;
    bool prepared = req->prefilled ? tdm_kv_seq_prepare(w->pool, req->prefilled, cap) == TDM_OK
                    : req->prefilled_groups
                        ? tdm_kv_hseq_prepare(w->pool, req->prefilled_groups, cap) == TDM_OK
                        : tdm_worker_kv_prepare(w, &a->tables, cap);
    int rc;
    if (!a->tokens || (plp && !a->plps) || (req->embed && !a->acc) || !prepared)
        rc = tdm_error_set(err, TDM_ERESOURCE, "worker: out of memory for a sequence of %u tokens",
                           cap);
    else
        rc = check_fits(w, req, cap, err);
    if (rc != TDM_OK)
        seq_alloc_free(w, a);
    return rc;
}

/* Puts the new sequence (its allocations a, matcher, limits) in a free slot, waiting. */
static void seq_install(tdm_worker_t *w, const tdm_worker_req_t *req, seq_alloc_t *a,
                        tdm_grammar_matcher_t *matcher, uint32_t max_new, uint64_t plp_bytes)
{
    uint32_t slot = w->free_slots[--w->n_free];
    wseq_t *s = &w->seqs[slot];
    memset(s, 0, sizeof *s);
    s->used = true;
    s->id = req->seq_id;
    uint32_t *bucket = bucket_of(w, s->id);
    s->next = *bucket;
    *bucket = slot;
    s->user = req->user;
    s->tokens = a->tokens;
    s->cap = req->n_prompt + max_new;
    memcpy(s->tokens, req->prompt, (size_t)req->n_prompt * sizeof *s->tokens);
    if (req->n_output)
        memcpy(s->tokens + req->n_prompt, req->output, (size_t)req->n_output * sizeof *s->tokens);
    s->n_prompt = req->n_prompt;
    s->n_tokens = req->n_prompt + req->n_output;
    s->max_new = max_new;
    if (!req->embed)
        s->sp = *req->sampling;
    s->embed = req->embed;
    s->pooling = req->pooling;
    s->emb_acc = a->acc;
    s->kv = a->tables.kv;
    s->hkv = a->tables.hkv;
    s->matcher = matcher;
    s->no_spec = req->no_speculation || req->embed;
    s->spec_rate = SPEC_RATE_PRIOR;
    s->plp = a->plps;
    s->plp_top = a->plps ? req->prompt_logprobs_top : 0;
    s->plp_bytes = plp_bytes;
    w->plp_held += plp_bytes;
    if (req->prefilled || req->prefilled_groups)
        take_prefilled(w, s, req);
    w->waiting[w->n_waiting++] = slot;
}

int tdm_worker_add(tdm_worker_t *w, const tdm_worker_req_t *req, tdm_error_t *err)
{
    int rc = check_req(w, req, err);
    if (rc != TDM_OK)
        return rc;
    if (w->n_waiting >= w->o.max_waiting + (w->o.max_running - w->n_running))
        return tdm_error_set(err, TDM_ERESOURCE, "worker queue full (%u running, %u waiting)",
                             w->n_running, w->n_waiting);
    if (w->n_free == 0)
        return tdm_error_set(err, TDM_ERESOURCE, "worker full (%u sequences)", w->n_slots);
    if (req->embed && embed_buffers(w) != TDM_OK)
        return tdm_error_set(err, TDM_ERESOURCE, "worker: out of memory for embedding buffers");
    uint32_t max_new = req->embed ? 0 : (uint32_t)req->sampling->max_tokens;
    if (max_new > w->o.n_ctx - req->n_prompt)
        max_new = w->o.n_ctx - req->n_prompt;
    bool plp =
        req->prompt_logprobs && !req->prefilled && !req->prefilled_groups && req->n_output == 0;
    uint64_t plp_bytes = plp ? tdm_worker_plp_bytes(req->n_prompt, req->prompt_logprobs_top) : 0;
    if (plp && (rc = plp_admit(w, req, plp_bytes, err)) != TDM_OK)
        return rc;
    tdm_grammar_matcher_t *matcher = NULL;
    if (req->grammar && (rc = matcher_open(w, req, &matcher, err)) != TDM_OK)
        return rc;
    seq_alloc_t a;
    if ((rc = seq_alloc(w, req, req->n_prompt + max_new, plp, &a, err)) != TDM_OK) {
        tdm_grammar_matcher_destroy(&matcher);
        return rc;
    }
    seq_install(w, req, &a, matcher, max_new, plp_bytes);
    return 0;
}

/* ---- forks (n > 1) ---- */

/* The checks of tdm_worker_fork against the parent p: TDM_EINVALID or TDM_EPRECONDITION. */
static int fork_check(const tdm_worker_t *w, const wseq_t *p, const tdm_worker_req_t *req,
                      uint32_t k, tdm_error_t *err)
{
    if (req->prefilled || req->prefilled_groups || req->n_output)
        return tdm_error_set(err, TDM_EINVALID, "fork: prefilled KV or output given");
    if (req->n_prompt != p->n_prompt || !req->prompt ||
        memcmp(req->prompt, p->tokens, (size_t)p->n_prompt * sizeof *p->tokens) != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "fork: the prompt is not the parent %016" PRIx64 "'s", p->id);
    if (p->n_computed < p->n_prompt || tdm_worker_kv_entries(w, p) < k)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "fork: the parent %016" PRIx64
                             " has %u of its %u prompt tokens computed",
                             p->id, p->n_computed, p->n_prompt);
    return TDM_OK;
}

int tdm_worker_fork(tdm_worker_t *w, uint64_t parent_id, const tdm_worker_req_t *req,
                    tdm_error_t *err)
{
    int ps = find_slot(w, parent_id);
    if (ps < 0)
        return tdm_error_set(err, TDM_ENOTFOUND, "fork: no sequence %016" PRIx64, parent_id);
    const uint32_t bs = tdm_kv_pool_layout(w->pool)->block_size;
    const wseq_t *p = &w->seqs[ps];
    uint32_t k = (p->n_prompt - 1) / bs; /* blocks holding only positions < n_prompt - 1 */
    int rc = fork_check(w, p, req, k, err);
    if (rc == TDM_OK)
        rc = tdm_worker_add(w, req, err);
    if (rc != TDM_OK)
        return rc;
    wseq_t *s = &w->seqs[find_slot(w, req->seq_id)];
    p = &w->seqs[ps];
    /* The shared blocks count as hashed for the fork: registering is the parent's business
     * (the commit registers only blocks past n_hashed). */
    s->n_computed = s->cached_prompt_tokens = tdm_worker_kv_share(w, s, p, k);
    return TDM_OK;
}

/* Removes slot from the running list (keeping order) or the waiting queue. */
void tdm_worker_unlink(tdm_worker_t *w, uint32_t slot)
{
    for (uint32_t i = 0; i < w->n_running; i++)
        if (w->running[i] == slot) {
            memmove(&w->running[i], &w->running[i + 1],
                    (w->n_running - i - 1) * sizeof *w->running);
            w->n_running--;
            return;
        }
    for (uint32_t i = 0; i < w->n_waiting; i++)
        if (w->waiting[i] == slot) {
            memmove(&w->waiting[i], &w->waiting[i + 1],
                    (w->n_waiting - i - 1) * sizeof *w->waiting);
            w->n_waiting--;
            return;
        }
}

int tdm_worker_cancel(tdm_worker_t *w, uint64_t seq_id)
{
    int slot = find_slot(w, seq_id);
    if (slot < 0)
        return TDM_ENOTFOUND;
    tdm_worker_unlink(w, (uint32_t)slot);
    tdm_worker_seq_free(w, (uint32_t)slot);
    return 0;
}

bool tdm_worker_has(const tdm_worker_t *w, uint64_t seq_id)
{
    return find_slot(w, seq_id) >= 0;
}

bool tdm_worker_busy(const tdm_worker_t *w)
{
    return w->n_running > 0 || w->n_waiting > 0;
}

/* ---- events ---- */

tdm_worker_event_t *tdm_worker_push_event(tdm_worker_t *w, tdm_worker_event_kind_t kind,
                                          const wseq_t *s)
{
    TDM_ASSERT(w->n_events < w->cap_events);
    tdm_worker_event_t *ev = &w->events[w->n_events++];
    memset(ev, 0, offsetof(tdm_worker_event_t, sample));
    ev->kind = kind;
    ev->seq_id = s->id;
    ev->user = s->user;
    ev->status = 0;
    ev->message[0] = '\0';
    ev->request_fault = false;
    ev->prompt_logprobs = NULL;
    ev->n_prompt_logprobs = 0;
    ev->prompt_logprobs_bytes = 0;
    tdm_kv_seq_init(&ev->seq);
    memset(&ev->hseq, 0, sizeof ev->hseq); /* a PREFILLED event's tables, copied and released */
    ev->embedding = NULL;
    ev->n_embd = 0;
    return ev;
}

void tdm_worker_seq_finish(tdm_worker_t *w, uint32_t slot, tdm_worker_finish_t why)
{
    wseq_t *s = &w->seqs[slot];
    tdm_worker_event_t *ev = tdm_worker_push_event(w, TDM_WORKER_EVENT_FINISHED, s);
    ev->finish = why;
    ev->completion_tokens = s->n_tokens - s->n_prompt;
    ev->preemptions = s->preemptions;
    tdm_worker_unlink(w, slot);
    tdm_worker_seq_free(w, slot);
}

tdm_worker_event_t *tdm_worker_seq_fail(tdm_worker_t *w, uint32_t slot, int status, const char *msg)
{
    wseq_t *s = &w->seqs[slot];
    tdm_worker_event_t *ev = tdm_worker_push_event(w, TDM_WORKER_EVENT_FAILED, s);
    ev->status = status;
    snprintf(ev->message, sizeof ev->message, "%s", msg);
    tdm_worker_unlink(w, slot);
    tdm_worker_seq_free(w, slot);
    return ev;
}

const double *tdm_worker_iteration_bounds(void)
{
    static const double bounds[TDM_WORKER_ITERATION_BOUNDS] = {
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
    };
    return bounds;
}

uint32_t tdm_worker_iteration_bucket(uint64_t tokens)
{
    const double *b = tdm_worker_iteration_bounds();
    uint32_t i = 0;
    while (i < TDM_WORKER_ITERATION_BOUNDS && (double)tokens > b[i])
        i++;
    return i;
}

void tdm_worker_stats(const tdm_worker_t *w, tdm_worker_stats_t *out)
{
    *out = w->stats;
    out->running = w->n_running;
    out->waiting = w->n_waiting;
    uint64_t q = 0;
    for (uint32_t i = 0; i < w->n_slots; i++) {
        const wseq_t *s = &w->seqs[i];
        if (s->used && s->n_tokens - s->n_computed > 1)
            q += s->n_tokens - s->n_computed;
    }
    out->queued_prefill_tokens = q;
}
