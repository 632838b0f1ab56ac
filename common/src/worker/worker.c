/* worker.c - continuous batching over the paged KV cache (see worker.h for the rules).
 *
 * Memory: tdm_worker_new allocates every table of the worker; tdm_worker_add allocates one
 * sequence's token array and block table, both sized for the sequence's longest possible
 * length (prompt + max_new tokens), so a step never allocates: preemption clears a block
 * table (tdm_kv_seq_clear) and keeps it for the recompute. Sequences are found by id through
 * a hash index (XXH3 of the id, chained through the slots), never by a scan.
 */
#include "tandem/worker.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#define WORKER_MAX_EOG 16    /* end-of-generation tokens the constrained ignore_eos masks */
#define SPEC_RATE_PRIOR 0.5f /* a new sequence's acceptance estimate */
#define NO_SLOT UINT32_MAX

typedef struct wseq {
    bool used;
    bool running;
    bool finish_pending; /* a prefilled sequence whose first token already ends it */
    tdm_worker_finish_t pending_finish;
    char id[(TDM_REQUEST_ID_MAX + 1)];
    void *user;      /* tdm_worker_req_t.user, copied into each event */
    uint32_t next;   /* next slot in this id's hash bucket, NO_SLOT at the end */
    int32_t *tokens; /* [cap]: prompt then output */
    uint32_t cap;    /* n_prompt + max_new: allocated at admission, never grown */
    uint32_t n_tokens;
    uint32_t n_prompt;
    uint32_t n_computed; /* tokens whose KV is in kv's blocks */
    uint32_t max_new;    /* output tokens at most: min(max_tokens, n_ctx - n_prompt) */
    tdm_sampling_params_t sp;
    tdm_kv_seq_t kv; /* table prepared for cap tokens at admission (tdm_kv_seq_prepare) */
    bool admitted_once;
    uint32_t cached_prompt_tokens;
    double t_first_sched;
    uint32_t preemptions;
    tdm_grammar_matcher_t *matcher; /* structured output: the output's state in the grammar;
                                       NULL for free text */
    bool no_spec;                   /* never draft (tdm_worker_req_t.no_speculation) */
    float spec_rate;    /* estimated chance that a draft token is accepted (moving average) */
    uint32_t spec_miss; /* decisions in a row not to draft (the wait doubles with each) */
    uint32_t spec_wait; /* steps left without drafting */
} wseq_t;

struct tdm_worker {
    tdm_engine_t *engine;
    tdm_kv_pool_t *pool;
    const tdm_tokenizer_t *tok;
    uint32_t n_vocab;
    tdm_worker_opts_t o;
    tdm_sampler_t *sampler;

    wseq_t *seqs; /* [n_slots] */
    uint32_t n_slots;
    uint32_t *buckets;    /* [n_buckets] first slot of each id hash bucket, NO_SLOT when empty */
    uint32_t n_buckets;   /* a power of two >= 2 * n_slots */
    uint32_t *free_slots; /* [n_slots] stack of unused slot ids */
    uint32_t n_free;
    uint32_t *running; /* [max_running] slot ids, oldest admission first */
    uint32_t n_running;
    uint32_t *waiting; /* [n_slots] slot ids, FIFO (index 0 is next) */
    uint32_t n_waiting;

    /* one forward pass */
    int32_t *b_tokens;           /* [max_batch_tokens] */
    uint32_t *b_pos;             /* [max_batch_tokens] */
    uint32_t *b_seq;             /* [max_batch_tokens] */
    bool *b_want;                /* [max_batch_tokens] */
    tdm_batch_seq_t *b_seqs;     /* [max_running] */
    uint32_t *b_slot;            /* [max_running] slot of batch sequence k */
    uint32_t *b_chunk;           /* [max_running] rows of batch sequence k */
    uint32_t *b_draft;           /* [max_running] draft rows of batch sequence k, after its
                                    b_chunk rows (each asks for logits) */
    bool *b_logits;              /* [max_running] batch sequence k asks for logits */
    float *logits;               /* [logit_rows][n_vocab] */
    uint32_t logit_rows;         /* tdm_worker_logit_rows(&o) */
    bool spec;                   /* speculative decoding on (DECODE, max_draft > 0, not q8) */
    uint32_t draft_left;         /* draft rows the batch being built may still take */
    double fit[5];               /* decode-only passes: decayed sums of 1, rows, rows^2, seconds,
                                    rows * seconds (a least-squares line: seconds = a + b * rows) */
    uint32_t *mask;              /* [(n_vocab + 31) / 32] allowed tokens of the sequence
                                    being sampled (constrained sequences only) */
    int32_t eog[WORKER_MAX_EOG]; /* the vocabulary's end-of-generation tokens (the first
                                    WORKER_MAX_EOG), masked for ignore_eos */
    uint32_t n_eog;
    uint32_t n_rows, n_bseq, budget; /* the batch being built: rows, sequences, rows left */

    tdm_worker_event_t *events; /* [cap_events] */
    uint32_t n_events;
    uint32_t cap_events; /* 2 * n_slots + max_running * max_draft: a token for each draft */
    tdm_worker_stats_t stats;
};

/* ---- the id index ---- */

static uint32_t *bucket_of(const tdm_worker_t *w, const char *id)
{
    uint64_t h = XXH3_64bits(id, strlen(id));
    return &w->buckets[h & (w->n_buckets - 1)];
}

static int find_slot(const tdm_worker_t *w, const char *id)
{
    for (uint32_t i = *bucket_of(w, id); i != NO_SLOT; i = w->seqs[i].next)
        if (strcmp(w->seqs[i].id, id) == 0)
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
static void seq_free(tdm_worker_t *w, uint32_t slot)
{
    wseq_t *s = &w->seqs[slot];
    index_remove(w, slot);
    tdm_kv_seq_release(w->pool, &s->kv);
    tdm_grammar_matcher_destroy(&s->matcher);
    free(s->tokens);
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
    w->tok = tok;
    w->n_vocab = n_vocab;
    w->o = *opts;
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
                seq_free(w, i);
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
    free(w);
    *self_p = NULL;
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
static bool is_stop(const tdm_worker_t *w, const tdm_sampling_params_t *sp, int32_t token)
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

/* The checks of tdm_worker_add that need no allocation; TDM_EINVALID naming the field. */
static int check_req(const tdm_worker_t *w, const tdm_worker_req_t *req, tdm_error_t *err)
{
    if (!req->request_id || strlen(req->request_id) >= (TDM_REQUEST_ID_MAX + 1))
        return tdm_error_set(err, TDM_EINVALID, "request_id: missing or longer than %u bytes",
                             (TDM_REQUEST_ID_MAX + 1) - 1);
    if (find_slot(w, req->request_id) >= 0)
        return tdm_error_set(err, TDM_EINVALID, "request_id '%s' is already in the worker",
                             req->request_id);
    if (req->n_prompt == 0 || !req->prompt)
        return tdm_error_set(err, TDM_EINVALID, "prompt: empty (at least 1 token is needed)");
    if (req->n_prompt + 1 > w->o.n_ctx)
        return tdm_error_set(err, TDM_EINVALID,
                             "prompt: %u tokens; at most %u fit the context of %u tokens",
                             req->n_prompt, w->o.n_ctx - 1, w->o.n_ctx);
    if (check_vocab(w, "prompt", req->prompt, req->n_prompt, err) != TDM_OK)
        return TDM_EINVALID;
    if (req->sampling->max_tokens < 1)
        return tdm_error_set(err, TDM_EINVALID, "max_tokens must be >= 1, got %d",
                             req->sampling->max_tokens);
    if (check_resume(w, req, err) != TDM_OK)
        return TDM_EINVALID;
    const tdm_kv_seq_t *pre = req->prefilled;
    if (req->grammar && !w->o.grammar_vocab)
        return tdm_error_set(err, TDM_EINVALID,
                             "constraint: this worker has no grammar vocabulary");
    if (pre && (req->first_token < 0 || (uint32_t)req->first_token >= w->n_vocab))
        return tdm_error_set(err, TDM_EINVALID, "first_token %d is outside the vocabulary [0, %u)",
                             req->first_token, w->n_vocab);
    return TDM_OK;
}

/* Takes over a prefilled table (its KV and the first token) into s. */
static void take_prefilled(tdm_worker_t *w, wseq_t *s, const tdm_worker_req_t *req)
{
    s->kv = *req->prefilled;
    tdm_kv_seq_init(req->prefilled);
    s->kv.n_tokens = s->n_tokens; /* the prompt and the resumed output */
    s->n_computed = s->n_tokens;
    s->tokens[s->n_tokens++] = req->first_token;
    s->admitted_once = true;
    if (is_stop(w, &s->sp, req->first_token) ||
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
        (req->prefilled && matcher_replay(m, &req->first_token, 1, req->n_output, err) != TDM_OK)) {
        tdm_grammar_matcher_destroy(&m);
        return TDM_EINVALID;
    }
    *out = m;
    return TDM_OK;
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
    tdm_grammar_matcher_t *matcher = NULL;
    if (req->grammar && (rc = matcher_open(w, req, &matcher, err)) != TDM_OK)
        return rc;
    uint32_t max_new = (uint32_t)req->sampling->max_tokens;
    if (max_new > w->o.n_ctx - req->n_prompt)
        max_new = w->o.n_ctx - req->n_prompt;
    uint32_t cap = req->n_prompt + max_new;
    /* Everything the sequence will ever hold, now: the step path never allocates. */
    tdm_kv_seq_t kv;
    tdm_kv_seq_init(&kv);
    int32_t *tokens = malloc((size_t)cap * sizeof *tokens);
    tdm_kv_seq_t *table = req->prefilled ? req->prefilled : &kv;
    if (!tokens || tdm_kv_seq_prepare(w->pool, table, cap) != TDM_OK) {
        free(tokens);
        tdm_grammar_matcher_destroy(&matcher);
        return tdm_error_set(err, TDM_ERESOURCE,
                             "worker: out of memory for a sequence of %u tokens", cap);
    }
    uint32_t slot = w->free_slots[--w->n_free];
    wseq_t *s = &w->seqs[slot];
    memset(s, 0, sizeof *s);
    s->used = true;
    snprintf(s->id, sizeof s->id, "%s", req->request_id);
    uint32_t *bucket = bucket_of(w, s->id);
    s->next = *bucket;
    *bucket = slot;
    s->user = req->user;
    s->tokens = tokens;
    s->cap = cap;
    memcpy(tokens, req->prompt, (size_t)req->n_prompt * sizeof *tokens);
    if (req->n_output)
        memcpy(tokens + req->n_prompt, req->output, (size_t)req->n_output * sizeof *tokens);
    s->n_prompt = req->n_prompt;
    s->n_tokens = req->n_prompt + req->n_output;
    s->max_new = max_new;
    s->sp = *req->sampling;
    s->kv = kv;
    s->matcher = matcher;
    s->no_spec = req->no_speculation;
    s->spec_rate = SPEC_RATE_PRIOR;
    if (req->prefilled)
        take_prefilled(w, s, req);
    w->waiting[w->n_waiting++] = slot;
    return 0;
}

/* ---- forks (n > 1) ---- */

/* The checks of tdm_worker_fork against the parent p: TDM_EINVALID or TDM_EPRECONDITION. */
static int fork_check(const wseq_t *p, const tdm_worker_req_t *req, uint32_t k, tdm_error_t *err)
{
    if (req->prefilled || req->n_output)
        return tdm_error_set(err, TDM_EINVALID, "fork: prefilled KV or output given");
    if (req->n_prompt != p->n_prompt || !req->prompt ||
        memcmp(req->prompt, p->tokens, (size_t)p->n_prompt * sizeof *p->tokens) != 0)
        return tdm_error_set(err, TDM_EINVALID, "fork: the prompt is not the parent '%s''s", p->id);
    if (p->n_computed < p->n_prompt || p->kv.n_blocks < k)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "fork: the parent '%s' has %u of its %u prompt tokens computed", p->id,
                             p->n_computed, p->n_prompt);
    return TDM_OK;
}

int tdm_worker_fork(tdm_worker_t *w, const char *parent_id, const tdm_worker_req_t *req,
                    tdm_error_t *err)
{
    int ps = find_slot(w, parent_id);
    if (ps < 0)
        return tdm_error_set(err, TDM_ENOTFOUND, "fork: no sequence '%s'", parent_id);
    const uint32_t bs = tdm_kv_pool_layout(w->pool)->block_size;
    const wseq_t *p = &w->seqs[ps];
    uint32_t k = (p->n_prompt - 1) / bs; /* blocks holding only positions < n_prompt - 1 */
    int rc = fork_check(p, req, k, err);
    if (rc == TDM_OK)
        rc = tdm_worker_add(w, req, err);
    if (rc != TDM_OK)
        return rc;
    wseq_t *s = &w->seqs[find_slot(w, req->request_id)];
    p = &w->seqs[ps];
    uint64_t h = TDM_KV_HASH_SEED;
    for (uint32_t i = 0; i < k; i++) {
        s->kv.blocks[i] = p->kv.blocks[i];
        tdm_kv_pool_ref(w->pool, p->kv.blocks[i]);
        h = tdm_kv_block_hash(h, p->tokens + (size_t)i * bs, bs);
    }
    /* The shared blocks count as hashed for the fork: registering is the parent's business
     * (tdm_kv_seq_commit registers only blocks past n_hashed). */
    s->kv.n_blocks = s->kv.n_hashed = k;
    s->kv.last_hash = k > 0 ? h : 0;
    s->kv.n_tokens = s->n_computed = s->cached_prompt_tokens = k * bs;
    return TDM_OK;
}

/* Removes slot from the running list (keeping order) or the waiting queue. */
static void unlink_slot(tdm_worker_t *w, uint32_t slot)
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

int tdm_worker_cancel(tdm_worker_t *w, const char *request_id)
{
    int slot = find_slot(w, request_id);
    if (slot < 0)
        return TDM_ENOTFOUND;
    unlink_slot(w, (uint32_t)slot);
    seq_free(w, (uint32_t)slot);
    return 0;
}

bool tdm_worker_has(const tdm_worker_t *w, const char *request_id)
{
    return find_slot(w, request_id) >= 0;
}

bool tdm_worker_busy(const tdm_worker_t *w)
{
    return w->n_running > 0 || w->n_waiting > 0;
}

/* ---- events ---- */

static tdm_worker_event_t *push_event(tdm_worker_t *w, tdm_worker_event_kind_t kind,
                                      const wseq_t *s)
{
    TDM_ASSERT(w->n_events < w->cap_events);
    tdm_worker_event_t *ev = &w->events[w->n_events++];
    memset(ev, 0, offsetof(tdm_worker_event_t, sample));
    ev->kind = kind;
    snprintf(ev->request_id, sizeof ev->request_id, "%s", s->id);
    ev->user = s->user;
    ev->status = 0;
    ev->message[0] = '\0';
    tdm_kv_seq_init(&ev->seq);
    return ev;
}

static void finish(tdm_worker_t *w, uint32_t slot, tdm_worker_finish_t why)
{
    wseq_t *s = &w->seqs[slot];
    tdm_worker_event_t *ev = push_event(w, TDM_WORKER_EVENT_FINISHED, s);
    ev->finish = why;
    ev->completion_tokens = s->n_tokens - s->n_prompt;
    ev->preemptions = s->preemptions;
    unlink_slot(w, slot);
    seq_free(w, slot);
}

static void fail(tdm_worker_t *w, uint32_t slot, int status, const char *msg)
{
    wseq_t *s = &w->seqs[slot];
    tdm_worker_event_t *ev = push_event(w, TDM_WORKER_EVENT_FAILED, s);
    ev->status = status;
    snprintf(ev->message, sizeof ev->message, "%s", msg);
    unlink_slot(w, slot);
    seq_free(w, slot);
}

/* ---- scheduling one step ---- */

/* Clears the newest running sequence's blocks (its table stays) and puts it at the front of
 * the queue: it is recomputed from scratch when readmitted. */
static void preempt_newest(tdm_worker_t *w)
{
    TDM_ASSERT(w->n_running > 0);
    uint32_t slot = w->running[--w->n_running];
    wseq_t *s = &w->seqs[slot];
    tdm_kv_seq_clear(w->pool, &s->kv);
    s->n_computed = 0;
    s->running = false;
    s->preemptions++;
    w->stats.preemptions++;
    memmove(&w->waiting[1], &w->waiting[0], w->n_waiting * sizeof *w->waiting);
    w->waiting[0] = slot;
    w->n_waiting++;
}

/* Takes blocks for tokens[0..n_tokens) of s. The table was prepared at admission for every
 * token the sequence can hold, so a failure here means the pool is short of blocks, never
 * that memory ran out. */
static bool reserve(tdm_worker_t *w, wseq_t *s, uint32_t n_tokens)
{
    TDM_ASSERT(n_tokens <= s->cap);
    return tdm_kv_seq_reserve(w->pool, &s->kv, n_tokens) == TDM_OK;
}

/* Adds a chunk of `chunk` rows of slot to the batch being built, then n_draft draft rows
 * (the drafts lie in tokens[n_tokens..]; the last real row and every draft row ask for
 * logits). */
static void add_rows(tdm_worker_t *w, uint32_t slot, uint32_t chunk, uint32_t n_draft)
{
    wseq_t *s = &w->seqs[slot];
    uint32_t k = w->n_bseq++;
    bool logits = s->n_computed + chunk == s->n_tokens;
    for (uint32_t i = 0; i < chunk + n_draft; i++) {
        uint32_t r = w->n_rows++;
        w->b_tokens[r] = s->tokens[s->n_computed + i];
        w->b_pos[r] = s->n_computed + i;
        w->b_seq[r] = k;
        w->b_want[r] = logits && i + 1 >= chunk;
    }
    w->b_slot[k] = slot;
    w->b_chunk[k] = chunk;
    w->b_draft[k] = n_draft;
    w->b_logits[k] = logits;
    w->budget -= chunk + n_draft;
    if (!s->admitted_once || s->t_first_sched == 0)
        s->t_first_sched = tdm_time_now();
}

/* Rows a sequence with `remaining` rows to compute gets this step. */
static uint32_t prefill_chunk(const tdm_worker_t *w, uint32_t remaining)
{
    uint32_t chunk = remaining < w->budget ? remaining : w->budget;
    if (w->o.max_prefill_chunk && chunk > w->o.max_prefill_chunk && w->n_running > 0)
        chunk = w->o.max_prefill_chunk;
    return chunk;
}

static bool in_batch(const tdm_worker_t *w, uint32_t slot)
{
    for (uint32_t k = 0; k < w->n_bseq; k++)
        if (w->b_slot[k] == slot)
            return true;
    return false;
}

/* 0. Prefilled sequences that ended with their first token finish without a forward pass. */
static void finish_pending(tdm_worker_t *w)
{
    for (uint32_t i = 0; i < w->n_waiting;) {
        uint32_t slot = w->waiting[i];
        if (w->seqs[slot].finish_pending)
            finish(w, slot, w->seqs[slot].pending_finish);
        else
            i++;
    }
}

/* Makes room for one more token of running sequence slot, preempting the newest sequences
 * while the pool is empty. false when slot itself was preempted (or failed: alone, it needs
 * more blocks than the pool has). */
static bool decode_reserve(tdm_worker_t *w, uint32_t slot)
{
    wseq_t *s = &w->seqs[slot];
    while (!reserve(w, s, s->n_computed + 1)) {
        if (w->running[w->n_running - 1] == slot) {
            if (w->n_running == 1)
                fail(w, slot, TDM_ERESOURCE,
                     "KV pool exhausted: the sequence alone needs more blocks than the pool has");
            else
                preempt_newest(w);
            return false;
        }
        preempt_newest(w);
    }
    return true;
}

/* ---- speculative decoding (prompt lookup) ---- */

#define SPEC_NGRAM_MAX 3u   /* longest n-gram looked up first */
#define SPEC_NGRAM_MIN 2u   /* shortest: single tokens repeat too often to predict */
#define SPEC_MAX_WAIT 16u   /* most steps a sequence skips drafting before it tries again */
#define SPEC_PRIOR_COST 0.3 /* a draft row's cost relative to a step, until passes are timed */
#define SPEC_MIN_GAIN 1.03  /* expected tokens per unit of step time drafting must beat */
#define SPEC_FIT_DECAY 0.98 /* weight of the older passes in the step-time line, per pass */

/* Prompt lookup (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ngram proposer): the most
 * recent earlier occurrence of the last n tokens of s (n = SPEC_NGRAM_MAX down to
 * SPEC_NGRAM_MIN), and up to k_max of the tokens that followed it, written at
 * tokens[n_tokens..]. Returns how many (0: no match). Cannot fail; O(n_tokens * n). */
static uint32_t draft_propose(wseq_t *s, uint32_t k_max)
{
    int32_t *t = s->tokens;
    uint32_t n = s->n_tokens;
    for (uint32_t g = SPEC_NGRAM_MAX; g >= SPEC_NGRAM_MIN; g--) {
        if (n <= g)
            continue;
        const int32_t *pat = t + n - g;
        for (uint32_t p = n - g; p-- > 0;) {
            if (t[p] != pat[0] || memcmp(t + p, pat, g * sizeof *t) != 0)
                continue;
            uint32_t m = n - (p + g); /* followers in the context, >= 1 */
            if (m > k_max)
                m = k_max;
            for (uint32_t i = 0; i < m; i++)
                t[n + i] = t[p + g + i];
            return m;
        }
    }
    return 0;
}

/* The most drafts running sequence i (slot s, its decode row reserved) may carry this step:
 * max_draft, what can still be drawn after the decode row's token, the draft rows left and the
 * budget left after one row for each later running sequence. */
static uint32_t spec_room(const tdm_worker_t *w, const wseq_t *s, uint32_t i)
{
    uint32_t k = w->o.max_draft;
    uint32_t left = s->max_new - (s->n_tokens - s->n_prompt) - 1;
    uint32_t need = w->n_running - i; /* this row and one for each later sequence */
    uint32_t spare = w->budget > need ? w->budget - need : 0;
    if (k > left)
        k = left;
    if (k > w->draft_left)
        k = w->draft_left;
    return k < spare ? k : spare;
}

/* Records a pass of decode rows only (rows rows, seconds s) in the step-time line. */
static void spec_fit_add(tdm_worker_t *w, uint32_t rows, double s)
{
    double r = rows, x[5] = {1, r, r * r, s, r * s};
    for (int i = 0; i < 5; i++)
        w->fit[i] = w->fit[i] * SPEC_FIT_DECAY + x[i];
}

/* The cost of one more row in a pass of `rows` decode rows, relative to that pass: the fixed
 * opts.spec_row_cost, or from the step-time line (least squares over the timed passes, older ones
 * decayed); SPEC_PRIOR_COST until passes of different sizes were timed. */
static double spec_row_cost(const tdm_worker_t *w, uint32_t rows)
{
    if (w->o.spec_row_cost > 0)
        return w->o.spec_row_cost;
    const double *f = w->fit;
    double var = f[0] > 0 ? f[2] / f[0] - (f[1] / f[0]) * (f[1] / f[0]) : 0;
    if (var < 0.25)
        return SPEC_PRIOR_COST;
    double b = (f[0] * f[4] - f[1] * f[3]) / (f[0] * f[2] - f[1] * f[1]);
    double a = (f[3] - b * f[1]) / f[0];
    double base = a + b * rows;
    if (b <= 0 || base <= 0)
        return b <= 0 ? 0.01 : 2.0;
    return b / base;
}

/* How many of m proposed drafts pay: the k in [0, m] that maximises the expected tokens of the
 * pass, 1 + rate + ... + rate^k (a draft counts only after every earlier one was accepted), per
 * unit of its cost, 1 + k * cost; 0 when no k beats plain decoding by SPEC_MIN_GAIN. */
static uint32_t spec_best_k(double rate, double cost, uint32_t m)
{
    double tokens = 1, p = 1, best = SPEC_MIN_GAIN;
    uint32_t best_k = 0;
    for (uint32_t k = 1; k <= m; k++) {
        p *= rate;
        tokens += p;
        double gain = tokens / (1 + k * cost);
        if (gain > best) {
            best = gain;
            best_k = k;
        }
    }
    return best_k;
}

/* Takes the blocks k draft rows of running sequence i need beyond its decode row's, unless that
 * would leave fewer blocks than one for each later running sequence: drafts never make plain
 * decoding preempt. false when not taken. */
static bool spec_reserve(tdm_worker_t *w, wseq_t *s, uint32_t i, uint32_t k)
{
    uint32_t need =
        (uint32_t)tdm_kv_blocks_for_tokens(tdm_kv_pool_layout(w->pool), s->n_computed + 1 + k);
    uint32_t more = need > s->kv.n_blocks ? need - s->kv.n_blocks : 0;
    if (more > 0 && tdm_kv_pool_available(w->pool) < more + (w->n_running - i - 1))
        return false;
    return reserve(w, s, s->n_computed + 1 + k);
}

/* Drafts for running sequence i (slot s), written after its tokens, with blocks reserved for
 * their rows (never preempting for them: with the pool short they shrink to what the blocks
 * held cover). 0 when it does not speculate this step: no match, or drafts that would not pay
 * at its acceptance rate and this machine's cost of a row; then it waits a number of steps that
 * doubles each time (at most SPEC_MAX_WAIT) and tries one draft, so its estimate can recover. */
static uint32_t spec_drafts(tdm_worker_t *w, wseq_t *s, uint32_t i)
{
    if (!w->spec || s->no_spec || w->n_running > TDM_WORKER_SPEC_SEQS)
        return 0; /* at larger batches a step is bound by arithmetic: draft rows would cost */
    bool probe = s->spec_wait == 1;
    if (s->spec_wait > 0 && --s->spec_wait > 0)
        return 0;
    uint32_t k = spec_room(w, s, i);
    if (k == 0 || (k = draft_propose(s, k)) == 0)
        return 0;
    uint32_t best = spec_best_k(s->spec_rate, spec_row_cost(w, w->n_running), k);
    if (best == 0 && !probe) {
        s->spec_miss = s->spec_miss < 5 ? s->spec_miss + 1 : 5;
        uint32_t wait = 1u << s->spec_miss;
        s->spec_wait = wait < SPEC_MAX_WAIT ? wait : SPEC_MAX_WAIT;
        return 0;
    }
    k = best > 0 ? best : 1;
    if (best > 0)
        s->spec_miss = 0;
    if (!spec_reserve(w, s, i, k)) {
        uint32_t covered = s->kv.n_blocks * tdm_kv_pool_layout(w->pool)->block_size;
        k = covered - (s->n_computed + 1) < k ? covered - (s->n_computed + 1) : k;
    }
    w->draft_left -= k;
    return k;
}

/* Updates s's acceptance estimate after a verification (accepted of n_draft): the
 * per-token estimate of this pass is accepted / (accepted + 1 rejection, if any), since
 * drafts are tried in order until the first miss. */
static void spec_adapt(wseq_t *s, uint32_t accepted, uint32_t n_draft)
{
    float x = (float)accepted / (float)(accepted + (accepted < n_draft ? 1 : 0));
    s->spec_rate += 0.3f * (x - s->spec_rate);
}

/* Returns the blocks of s beyond those its computed tokens need (taken for draft rows that
 * were rejected): they hold no committed token, so no hash, and go back to the free list. */
static void spec_trim(tdm_worker_t *w, wseq_t *s)
{
    uint32_t keep = (uint32_t)tdm_kv_blocks_for_tokens(tdm_kv_pool_layout(w->pool), s->n_computed);
    while (s->kv.n_blocks > keep)
        tdm_kv_pool_unref(w->pool, s->kv.blocks[--s->kv.n_blocks]);
}

/* 1. Decode rows, oldest first; an empty pool preempts the newest sequence. */
static void schedule_decode(tdm_worker_t *w)
{
    for (uint32_t i = 0; i < w->n_running && w->budget > 0; i++) {
        uint32_t slot = w->running[i];
        wseq_t *s = &w->seqs[slot];
        if (s->n_tokens - s->n_computed != 1)
            continue;
        if (!decode_reserve(w, slot)) {
            i--; /* the running list shrank at this index or after it */
            continue;
        }
        add_rows(w, slot, 1, spec_drafts(w, s, i));
    }
}

/* 2. Prefill chunks of running sequences. */
static void schedule_prefill(tdm_worker_t *w)
{
    for (uint32_t i = 0; i < w->n_running && w->budget > 0; i++) {
        uint32_t slot = w->running[i];
        wseq_t *s = &w->seqs[slot];
        uint32_t remaining = s->n_tokens - s->n_computed;
        if (remaining <= 1 || in_batch(w, slot))
            continue;
        uint32_t chunk = prefill_chunk(w, remaining);
        if (!reserve(w, s, s->n_computed + chunk))
            continue; /* waits for blocks; decode rows free them as sequences finish */
        add_rows(w, slot, chunk, 0);
    }
}

/* The rows the next waiting sequence gets, with its blocks reserved (prefix cache first);
 * 0 when the pool cannot hold them (its blocks are cleared again). */
static uint32_t admit_reserve(tdm_worker_t *w, wseq_t *s)
{
    if (s->n_computed == 0 && s->kv.n_blocks == 0 && w->o.prefix_caching) {
        uint32_t matched = tdm_kv_seq_match_prefix(w->pool, &s->kv, s->tokens, s->n_tokens);
        s->n_computed = matched;
        if (!s->admitted_once)
            s->cached_prompt_tokens = matched < s->n_prompt ? matched : s->n_prompt;
    }
    uint32_t chunk = prefill_chunk(w, s->n_tokens - s->n_computed);
    return reserve(w, s, s->n_computed + chunk) ? chunk : 0;
}

/* 3. Admits waiting sequences, FIFO, while the budget, max_running and the pool allow. */
static void schedule_admit(tdm_worker_t *w)
{
    while (w->n_waiting > 0 && w->n_running < w->o.max_running && w->budget > 0) {
        uint32_t slot = w->waiting[0];
        wseq_t *s = &w->seqs[slot];
        uint32_t chunk = admit_reserve(w, s);
        if (chunk == 0) {
            if (w->n_running == 0 && w->n_bseq == 0) {
                /* Nothing runs that could free blocks: this sequence can never fit. */
                char msg[160];
                snprintf(msg, sizeof msg,
                         "KV pool exhausted: %u tokens need more blocks than the %u available",
                         s->n_computed + prefill_chunk(w, s->n_tokens - s->n_computed),
                         tdm_kv_pool_available(w->pool) + s->kv.n_blocks);
                fail(w, slot, TDM_ERESOURCE, msg);
                continue;
            }
            tdm_kv_seq_clear(w->pool, &s->kv);
            s->n_computed = 0;
            break;
        }
        memmove(&w->waiting[0], &w->waiting[1], (w->n_waiting - 1) * sizeof *w->waiting);
        w->n_waiting--;
        w->running[w->n_running++] = slot;
        s->running = true;
        if (!s->admitted_once) {
            s->admitted_once = true;
            s->t_first_sched = tdm_time_now();
        }
        add_rows(w, slot, chunk, 0);
    }
}

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
        w->b_seqs[k] = (tdm_batch_seq_t){s->kv.blocks, s->kv.n_blocks};
    }
    tdm_batch_t batch = {w->n_rows, w->b_tokens, w->b_pos, w->b_seq,
                         w->b_want, w->n_bseq,   w->b_seqs};
    double t0 = tdm_time_now();
    int rc = tdm_engine_forward(w->engine, &batch, w->logits, err);
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
            spec_fit_add(w, w->n_rows, w->stats.last_step_s);
    }
    if (rc != TDM_OK) {
        char msg[256];
        snprintf(msg, sizeof msg, "forward pass failed: %.220s", err ? err->msg : tdm_strerror(rc));
        for (uint32_t k = 0; k < w->n_bseq; k++)
            fail(w, w->b_slot[k], rc, msg);
    }
    return rc;
}

/* PREFILL mode: hands the prompt's KV of slot to the caller and ends the sequence. */
static void hand_over(tdm_worker_t *w, uint32_t slot, int32_t token, double t_end)
{
    wseq_t *s = &w->seqs[slot];
    tdm_worker_event_t *pe = push_event(w, TDM_WORKER_EVENT_PREFILLED, s);
    pe->seq = s->kv;
    tdm_kv_seq_init(&s->kv);
    pe->n_tokens = s->n_computed; /* the prompt and any resumed output */
    pe->first_token = token;
    pe->cached_prompt_tokens = s->cached_prompt_tokens;
    pe->prefill_s = t_end - s->t_first_sched;
    unlink_slot(w, slot);
    seq_free(w, slot);
}

/* The mask of a constrained sequence's next token in w->mask (tokens past the grammar's
 * vocabulary stay masked); NULL for free text. With ignore_eos, end-of-generation tokens are
 * masked too while the grammar allows anything else (when it allows nothing else, the output
 * is complete and may only end). */
static const uint32_t *next_mask(tdm_worker_t *w, wseq_t *s)
{
    if (!s->matcher)
        return NULL;
    memset(w->mask, 0, ((size_t)w->n_vocab + 31) / 32 * sizeof *w->mask);
    uint32_t n_allowed = tdm_grammar_matcher_fill_mask(s->matcher, w->mask);
    if (!s->sp.ignore_eos)
        return w->mask;
    uint32_t n_eog = 0;
    for (uint32_t i = 0; i < w->n_eog; i++)
        n_eog += (w->mask[w->eog[i] / 32] >> (w->eog[i] % 32)) & 1u;
    if (n_eog < n_allowed)
        for (uint32_t i = 0; i < w->n_eog; i++)
            w->mask[w->eog[i] / 32] &= ~(1u << (w->eog[i] % 32));
    return w->mask;
}

/* How the token just appended ends the sequence, or 0 when it goes on: a stop token, a grammar
 * that is done (STOP), then max_tokens (LENGTH), so a constraint is never cut and called
 * complete. */
static int end_of(const tdm_worker_t *w, const wseq_t *s, int32_t token)
{
    if (is_stop(w, &s->sp, token) || (s->matcher && tdm_grammar_matcher_is_done(s->matcher)))
        return TDM_WORKER_FINISH_STOP;
    if (s->n_tokens - s->n_prompt >= s->max_new)
        return TDM_WORKER_FINISH_LENGTH;
    return 0;
}

/* 5. Samples the next token of slot from its logits row (under its grammar's mask when it has
 * one) and ends the sequence when that token ends it. Returns true when the sequence goes on
 * (false: it finished, failed or was handed over, and its slot is free). */
static bool sample_next(tdm_worker_t *w, uint32_t slot, const float *row, double t_end)
{
    wseq_t *s = &w->seqs[slot];
    uint32_t index = s->n_tokens - s->n_prompt;
    tdm_worker_event_t *ev = push_event(w, TDM_WORKER_EVENT_TOKEN, s);
    if (tdm_sampler_sample_masked(w->sampler, &s->sp, row, next_mask(w, s), s->tokens, s->n_tokens,
                                  index, &ev->sample) != TDM_OK) {
        w->n_events--; /* replace the token event by a failure */
        char msg[256];
        snprintf(msg, sizeof msg, "sampling: %.230s", tdm_sampler_errmsg(w->sampler));
        fail(w, slot, TDM_EINVALID, msg);
        return false;
    }
    ev->index = index;
    if (index == 0) {
        ev->cached_prompt_tokens = s->cached_prompt_tokens;
        ev->prefill_s = t_end - s->t_first_sched;
    }
    int32_t token = ev->sample.token;
    if (s->matcher && tdm_grammar_matcher_accept_token(s->matcher, token) != TDM_OK) {
        w->n_events--; /* the mask allowed a token the matcher refuses: the grammar's bug */
        char msg[256];
        snprintf(msg, sizeof msg, "constraint: the masked token %d was refused: %.190s", token,
                 tdm_grammar_matcher_errmsg(s->matcher));
        fail(w, slot, TDM_EINTERNAL, msg);
        return false;
    }
    s->tokens[s->n_tokens++] = token;
    int why = end_of(w, s, token);
    if (w->o.mode == TDM_WORKER_MODE_PREFILL)
        hand_over(w, slot, token, t_end);
    else if (why)
        finish(w, slot, (tdm_worker_finish_t)why);
    return w->o.mode != TDM_WORKER_MODE_PREFILL && !why;
}

/* Records that s's first n_computed tokens have their KV in its blocks. */
static void commit_kv(tdm_worker_t *w, wseq_t *s)
{
    if (w->o.prefix_caching)
        tdm_kv_seq_commit(w->pool, &s->kv, s->tokens, s->n_computed);
    else
        s->kv.n_tokens = s->n_computed;
}

/* 5. Verifies the n_draft drafts of slot against logits rows [1 + n_draft] (the decode row's,
 * then one per draft): draws the tokens in order exactly as plain decoding would, each under
 * the history and grammar state its predecessors left; a draft equal to the token drawn at its
 * index is accepted (its row's KV is that token's, so n_computed covers it) and the next row's
 * token is drawn, the first mismatch or the end of the sequence stops. Then the blocks taken
 * for rejected rows go back. */
static void spec_verify(tdm_worker_t *w, uint32_t slot, uint32_t n_draft, const float *rows,
                        double t_end)
{
    wseq_t *s = &w->seqs[slot];
    uint32_t accepted = 0;
    for (uint32_t j = 0;; j++) {
        int32_t draft = j < n_draft ? s->tokens[s->n_tokens] : -1;
        if (!sample_next(w, slot, rows + (size_t)j * w->n_vocab, t_end))
            break; /* ended: the slot is free */
        if (j == n_draft || s->tokens[s->n_tokens - 1] != draft) {
            spec_adapt(s, accepted, n_draft);
            spec_trim(w, s);
            break;
        }
        accepted++;
        s->n_computed++;
        commit_kv(w, s);
    }
    w->stats.spec_drafts++;
    w->stats.spec_draft_tokens += n_draft;
    w->stats.spec_accepted_tokens += accepted;
}

/* 5. Results, in batch order: KV committed, then a token for each sequence that asked. */
static void collect(tdm_worker_t *w, double t_end)
{
    uint32_t li = 0;
    for (uint32_t k = 0; k < w->n_bseq; k++) {
        uint32_t slot = w->b_slot[k];
        wseq_t *s = &w->seqs[slot];
        s->n_computed += w->b_chunk[k];
        commit_kv(w, s);
        if (w->b_draft[k] > 0) {
            spec_verify(w, slot, w->b_draft[k], w->logits + (size_t)li * w->n_vocab, t_end);
            li += 1 + w->b_draft[k];
        } else if (w->b_logits[k]) {
            sample_next(w, slot, w->logits + (size_t)li++ * w->n_vocab, t_end);
        }
    }
}

int tdm_worker_step(tdm_worker_t *w, const tdm_worker_event_t **events, uint32_t *n_events,
                    tdm_error_t *err)
{
    w->n_events = 0;
    *events = w->events;
    finish_pending(w);
    w->budget = w->o.max_batch_tokens;
    w->draft_left = w->logit_rows - w->o.max_running;
    w->n_rows = w->n_bseq = 0;
    schedule_decode(w);
    schedule_prefill(w);
    schedule_admit(w);
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
