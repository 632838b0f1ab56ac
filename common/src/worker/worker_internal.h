/* worker_internal.h - what the worker's files share: a sequence's record (wseq_t), the worker's,
 * and the steps each file gives the others: sequences and events (worker.c), scheduling a step
 * (worker_sched.c), speculative decoding (worker_spec.c), the forward pass and sampling
 * (worker_step.c). Private to common/src/worker/. */
#ifndef TDM_WORKER_INTERNAL_H
#define TDM_WORKER_INTERNAL_H

#include "tandem/worker.h"

#define WORKER_MAX_EOG 16    /* end-of-generation tokens the constrained ignore_eos masks */
#define SPEC_RATE_PRIOR 0.5f /* a new sequence's acceptance estimate */
#define NO_SLOT UINT32_MAX

typedef struct wseq {
    bool used;
    bool running;
    bool finish_pending; /* a prefilled sequence whose first token already ends it */
    tdm_worker_finish_t pending_finish;
    uint64_t id;     /* tdm_worker_req_t.seq_id */
    void *user;      /* tdm_worker_req_t.user, copied into each event */
    uint32_t next;   /* next slot in this id's hash bucket, NO_SLOT at the end */
    int32_t *tokens; /* [cap]: prompt then output */
    uint32_t cap;    /* n_prompt + max_new: allocated at admission, never grown */
    uint32_t n_tokens;
    uint32_t n_prompt;
    uint32_t n_computed; /* tokens whose KV is in kv's blocks */
    uint32_t max_new;    /* output tokens at most: min(max_tokens, n_ctx - n_prompt) */
    tdm_sampling_params_t sp;
    tdm_kv_seq_t kv;   /* table prepared for cap tokens at admission (tdm_kv_seq_prepare);
                          unused over a pool with layer groups */
    tdm_kv_hseq_t hkv; /* over a pool with layer groups (w->groups): one table per group,
                          prepared likewise; kv is then empty. Reach either through the
                          tdm_worker_kv_* calls below */
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
    tdm_prompt_logprob_t *plp; /* [n_prompt] prompt logprobs being computed (prompt_logprobs >=
                                  0, until the first token's event takes them), else NULL;
                                  their top[] follow in the same allocation */
    uint32_t plp_top;          /* alternatives per prompt token (prompt_logprobs) */
    uint64_t plp_bytes;        /* tdm_worker_plp_bytes of plp, held of plp_reserve_bytes */
    bool embed;                /* an embedding sequence (tdm_worker_req_t.embed) */
    tdm_pooling_t pooling;
    double *emb_acc; /* [n_embd] pooling accumulator of an embedding sequence, else NULL */
} wseq_t;

struct tdm_worker {
    tdm_engine_t *engine;
    tdm_kv_pool_t *pool;
    const tdm_kv_groups_t *groups; /* the pool's layer groups (tdm_kv_pool_groups), NULL for a
                                      plain pool */
    const uint32_t **b_gb;         /* [max_running][n_groups] group tables of batch
                                      sequence k (grouped pools only) */
    void *match_scratch;           /* prefix matching's scratch for n_ctx tokens
                                      (tdm_kv_hseq_match_scratch_bytes; grouped pools only) */
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
    uint32_t want_left;              /* ... and the logit rows it has left */
    bool starved; /* a running sequence's prompt chunk found no blocks in this batch */

    /* embeddings (allocated with the first embedding sequence) */
    uint32_t n_embd; /* tdm_engine_n_embd */
    float *hidden;   /* [max_batch_tokens][n_embd] final hidden states of a step's rows */
    float *emb_out;  /* [max_running][n_embd] the vectors of a step's EMBEDDING events */
    uint32_t n_emb_out;
    bool b_hidden; /* the batch being built holds rows of an embedding sequence */

    tdm_worker_event_t *events; /* [cap_events] */
    uint32_t n_events;
    uint32_t cap_events; /* 2 * n_slots + max_running * max_draft: a token for each draft */
    uint64_t plp_held;   /* bytes of prompt logprobs allocated (sequences' and events'), at
                            most o.plp_reserve_bytes */
    tdm_worker_stats_t stats;
};

/* ---- sequences and events (worker.c) ---- */

/* Frees a sequence's memory and returns its slot (it must be unlinked from running/waiting). */
void tdm_worker_seq_free(tdm_worker_t *w, uint32_t slot);

/* Removes slot from the running list (keeping order) or the waiting queue. */
void tdm_worker_unlink(tdm_worker_t *w, uint32_t slot);

/* Whether token ends generation for the sequence's parameters. */
bool tdm_worker_is_stop(const tdm_worker_t *w, const tdm_sampling_params_t *sp, int32_t token);

/* Appends an event of kind for s (its id and user filled, the rest cleared). Cannot fail: the
 * event array holds every event a step can produce. */
tdm_worker_event_t *tdm_worker_push_event(tdm_worker_t *w, tdm_worker_event_kind_t kind,
                                          const wseq_t *s);

/* Ends slot with a FINISHED event (why) and frees it. */
void tdm_worker_seq_finish(tdm_worker_t *w, uint32_t slot, tdm_worker_finish_t why);

/* Ends slot with a FAILED event (status, msg), frees it and returns the event (valid until the
 * next step), whose other fields the caller may still set. */
tdm_worker_event_t *tdm_worker_seq_fail(tdm_worker_t *w, uint32_t slot, int status,
                                        const char *msg);

/* ---- scheduling (worker_sched.c) ---- */

/* Builds the step's batch: finishes the prefilled sequences that already ended, then takes
 * decode rows (with drafts), prefill chunks and newly admitted sequences under the token
 * budget, max_running and the pool. Cannot fail: a sequence that can never fit fails alone. */
void tdm_worker_schedule(tdm_worker_t *w);

/* Takes blocks for tokens[0..n_tokens) of s. The table was prepared at admission for every
 * token the sequence can hold, so a failure here means the pool is short of blocks, never
 * that memory ran out. */
bool tdm_worker_reserve(tdm_worker_t *w, wseq_t *s, uint32_t n_tokens);

/* ---- a sequence's KV tables (worker_kv.c): one table, or one per layer group ----
 *
 * Over a plain pool a sequence has one block table (s->kv, tdm_kv_seq_*); over a pool with
 * layer groups one per group (s->hkv, tdm_kv_hseq_*), whose window groups give back the blocks
 * no later query reads as the KV is committed. These calls hide which. */

/* Sizes s's table(s) for cap tokens (admission: a step then allocates nothing). false on out
 * of memory (nothing kept). */
bool tdm_worker_kv_prepare(tdm_worker_t *w, wseq_t *s, uint32_t cap);

/* Entries of s's table(s): blocks covering positions 0 .. entries * block_size - 1 (given-back
 * entries of window groups included). */
uint32_t tdm_worker_kv_entries(const tdm_worker_t *w, const wseq_t *s);

/* Blocks s holds now, over every group. */
uint32_t tdm_worker_kv_held(const tdm_worker_t *w, const wseq_t *s);

/* Pool blocks that taking table entries for n_tokens tokens would cost s (one per group and
 * missing entry). */
uint32_t tdm_worker_kv_cost(const tdm_worker_t *w, const wseq_t *s, uint32_t n_tokens);

/* For a sequence holding nothing: reuses the longest cached prefix of its tokens (never all),
 * under the window rule over a grouped pool. Returns the tokens covered. */
uint32_t tdm_worker_kv_match_prefix(tdm_worker_t *w, wseq_t *s);

/* Drops s's references (its tables stay: preemption, or an admission that did not fit). */
void tdm_worker_kv_clear(tdm_worker_t *w, wseq_t *s);

/* Drops s's references and frees its tables. */
void tdm_worker_kv_release(tdm_worker_t *w, wseq_t *s);

/* Gives back the entries of s past the first keep (blocks taken for rejected drafts: no
 * committed token, no hash). */
void tdm_worker_kv_trim(tdm_worker_t *w, wseq_t *s, uint32_t keep);

/* Shares the parent p's first k prompt blocks with s (a fork holding nothing; the shared blocks
 * count as hashed for it, registering is the parent's business). Over a grouped pool a window
 * group shares only the blocks a query at k * block_size reads; when p gave back one of those,
 * nothing is shared (0 returned: the fork computes its prompt, or finds it in the prefix
 * cache). Returns the tokens now covered: k * block_size, or 0. */
uint32_t tdm_worker_kv_share(tdm_worker_t *w, wseq_t *s, const wseq_t *p, uint32_t k);

/* Batch sequence k's view of s's tables for the forward pass. */
tdm_batch_seq_t tdm_worker_kv_view(tdm_worker_t *w, const wseq_t *s, uint32_t k);

/* ---- speculative decoding (worker_spec.c) ---- */

/* Drafts for running sequence i (slot s), written after its tokens, with blocks reserved for
 * their rows (never preempting for them: with the pool short they shrink to what the blocks
 * held cover). 0 when it does not speculate this step: no match, or drafts that would not pay
 * at its acceptance rate and this machine's cost of a row; then it waits a number of steps that
 * doubles each time (at most SPEC_MAX_WAIT) and tries one draft, so its estimate can recover. */
uint32_t tdm_worker_spec_drafts(tdm_worker_t *w, wseq_t *s, uint32_t i);

/* Records a pass of decode rows only (rows rows, seconds s) in the step-time line. */
void tdm_worker_spec_fit_add(tdm_worker_t *w, uint32_t rows, double s);

/* 5. Verifies the n_draft drafts of slot against logits rows [1 + n_draft] (the decode row's,
 * then one per draft): draws the tokens in order exactly as plain decoding would, each under
 * the history and grammar state its predecessors left; a draft equal to the token drawn at its
 * index is accepted (its row's KV is that token's, so n_computed covers it) and the next row's
 * token is drawn, the first mismatch or the end of the sequence stops. Then the blocks taken
 * for rejected rows go back. */
void tdm_worker_spec_verify(tdm_worker_t *w, uint32_t slot, uint32_t n_draft, const float *rows,
                            double t_end);

/* ---- the forward pass and sampling (worker_step.c) ---- */

/* 5. Samples the next token of slot from its logits row (under its grammar's mask when it has
 * one) and ends the sequence when that token ends it. Returns true when the sequence goes on
 * (false: it finished, failed or was handed over, and its slot is free). */
bool tdm_worker_sample_next(tdm_worker_t *w, uint32_t slot, const float *row, double t_end);

/* Records that s's first n_computed tokens have their KV in its blocks. */
void tdm_worker_commit_kv(tdm_worker_t *w, wseq_t *s);

/* Frees what the last step's events own (their prompt logprobs). */
void tdm_worker_events_release(tdm_worker_t *w);

/* Whether the next rows of s still owe prompt logprobs: all its prompt rows ask for logits. */
static inline bool tdm_worker_plp_active(const wseq_t *s)
{
    return s->plp && s->n_computed + 1 < s->n_prompt;
}

#endif
