/* worker.h - the continuous-batching loop shared by prefill and decode nodes: admits
 * sequences, packs prefill chunks and decode rows into one forward pass under a token budget,
 * samples, detects the end of each sequence, and preempts the newest sequence when the KV
 * pool runs out of blocks.
 *
 * One rule covers prefill, decode and recompute: a sequence holds tokens[0..n_tokens)
 * (prompt, then output) of which the first n_computed have their KV in the pool. Each step
 * gives it rows tokens[n_computed..] (at most the step's remaining budget); when a chunk
 * reaches n_tokens the last row asks for logits and the next output token is sampled. A
 * decoding sequence therefore takes one row per step, a new prompt is prefilled in chunks,
 * and a preempted sequence (blocks freed, n_computed reset to 0) is recomputed the same way
 * later: the engine is batch-invariant, so recomputed KV and logits are bitwise identical
 * and the output does not change (as vLLM v1's scheduler, which also treats the two phases
 * alike: https://docs.vllm.ai/en/latest/design/v1/ ).
 *
 * Order within a step: decode rows of running sequences first (oldest first), then prefill
 * chunks of running sequences, then waiting sequences are admitted (FIFO) while the budget,
 * max_running and the pool allow. A decode row that needs a new block when the pool is empty
 * preempts the newest running sequence (LIFO, like vLLM's recompute preemption). A prompt chunk
 * that finds no blocks waits while decode rows run (they free blocks as sequences end), and
 * then no sequence is admitted that would take blocks for a prompt of its own; when every
 * running sequence waits so and nothing is in the batch, the oldest goes on alone (the others
 * preempted) with its chunk shrunk to what the pool holds. Only an empty pool preempts: running
 * out of memory is an error (TDM_ERESOURCE naming memory) of tdm_worker_add, the one place a
 * sequence's memory is allocated, and so is a sequence the pool could never hold even alone
 * (TDM_ERESOURCE naming its tokens, its peak blocks and the pool's).
 *
 * Speculative decoding (prompt lookup, no draft model): in DECODE mode with opts.max_draft > 0,
 * a decoding sequence whose last n-gram (3, then 2 tokens) occurred earlier in its own context
 * proposes the tokens that followed it there as drafts, and gets 1 + k rows (its last token,
 * then the k drafts), all asking for logits. The tokens are then drawn one by one exactly as
 * plain decoding draws them (the (seed, index) draw, penalties over the same window, the
 * grammar's mask, the matcher advanced on each drawn token only); a draft counts only if it
 * equals the token drawn at its index, and the first mismatch ends the run with the drawn
 * token. The engine is batch-invariant, so every accepted row's logits are bitwise plain
 * decoding's: outputs are identical with speculation on or off. The KV written for rejected
 * drafts lies beyond n_computed and is overwritten later; blocks taken for it are returned
 * after the step. Off for q8 KV (a rejected draft's write would change a block's scale), on the
 * CUDA engine (not batch-invariant: its logits would differ in the last bits), for requests with
 * no_speculation, and while more than TDM_WORKER_SPEC_SEQS sequences run. How
 * many drafts pay is decided per step from the sequence's acceptance rate so far and the cost of
 * a row (fitted from the worker's step times, or opts.spec_row_cost); a sequence whose drafts do
 * not pay waits a growing number of steps before it tries again, so text the context does not
 * predict costs (nearly) nothing.
 *
 * Modes: PREFILL (prefill node) ends a sequence right after its first token and hands its
 * block table to the caller to ship; DECODE (decode node) runs sequences to EOS, a stop
 * token, max_tokens or the context limit.
 *
 * Layer groups: over a pool with layer groups (tdm_kv_pool_new_grouped, a model with
 * sliding-window layers) each sequence has one block table per group (tdm_kv_hseq_*), whose
 * window groups give back the blocks no later query reads as its KV is committed; admission,
 * preemption and recompute, prefix caching (under the window rule of tandem/kv.h), speculative
 * decoding and forks all follow the groups, and outputs are bitwise those of a plain pool. The
 * KV hand-over follows them too: a PREFILL worker's PREFILLED event carries one table per group
 * holding only the live blocks (tdm_kv_group_first_needed: a window group the blocks the next
 * query reads), and a DECODE worker takes such tables (tdm_worker_req_t.prefilled_groups);
 * one table of every layer (prefilled) is refused over a grouped pool and the other way round.
 *
 * A worker belongs to one thread (the engine thread) together with its pool and engine.
 * Memory: every table is allocated by tdm_worker_new; tdm_worker_add allocates the
 * sequence's token array and its KV block table, both sized for the longest the sequence can
 * get (prompt + min(max_tokens, n_ctx - prompt) tokens); tdm_worker_step allocates nothing
 * (preemption clears a block table and keeps it, tdm_kv_seq_clear). Sequences are keyed by the
 * caller's 64-bit id (nodes: the router's attempt id), found through a hash index; each carries
 * the caller's pointer (tdm_worker_req_t.user) into its events, so a caller needs no table of
 * its own to find its state for an event.
 */
#ifndef TANDEM_WORKER_H
#define TANDEM_WORKER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/grammar.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/sampling.h"
#include "tandem/tokenizer.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_worker_mode {
    TDM_WORKER_MODE_PREFILL = 0, /* stop after the first token, hand the KV to the caller */
    TDM_WORKER_MODE_DECODE = 1,  /* generate to the end */
} tdm_worker_mode_t;

typedef struct tdm_worker_opts {
    tdm_worker_mode_t mode;
    uint32_t max_batch_tokens;  /* rows per forward pass; <= the engine's */
    uint32_t max_running;       /* sequences in the running batch */
    uint32_t max_waiting;       /* sequences queued behind them; add fails beyond */
    uint32_t n_ctx;             /* longest sequence, tokens (the engine's n_ctx) */
    bool prefix_caching;        /* reuse cached prompt blocks (tdm_kv_seq_match_prefix) */
    uint32_t max_prefill_chunk; /* most prompt rows one sequence gets per step; 0 = no limit
                                   beyond max_batch_tokens. Decode nodes set it low, so a
                                   local prefill does not stall the running batch (results
                                   do not depend on it: the engine is batch-invariant) */
    const tdm_grammar_vocab_t *grammar_vocab; /* the vocabulary constrained sequences are masked
                                                 over (tandem/grammar.h; at most n_vocab tokens;
                                                 must outlive the worker); NULL: a sequence with
                                                 a grammar is refused */
    uint32_t max_draft;         /* DECODE mode: most draft tokens per sequence and step (speculative
                                   decoding, at most TDM_WORKER_MAX_DRAFT); 0 = off. The engine
                                   must take tdm_worker_logit_rows(opts) logit rows */
    double spec_row_cost;       /* a draft row's cost relative to a decode step, [0, 10]; 0 = fitted
                                   from the worker's own step times (nodes). A fixed value makes the
                                   draft lengths a function of the outputs alone (tests) */
    uint64_t plp_reserve_bytes; /* bytes the prompt logprobs of all sequences may hold at once
                                   (tdm_worker_plp_bytes each); 0 = tdm_worker_plp_reserve(n_ctx),
                                   the figure nodes count in their memory budget */
} tdm_worker_opts_t;

/* One prompt token's logprobs (tdm_worker_event_t.prompt_logprobs): the logprob of the token
 * given its prefix, its rank and its n_top most likely alternatives. */
typedef struct tdm_prompt_logprob {
    int32_t token;            /* the prompt token */
    float logprob;            /* its logprob: the log-softmax of the raw logits */
    uint32_t rank;            /* 1 + the tokens more likely than it (ties count) */
    uint32_t n_top;           /* entries of top[] (the request's prompt_logprobs_top) */
    tdm_token_logprob_t *top; /* [n_top] most likely first, ties by id; in the same
                                 allocation as the entries */
} tdm_prompt_logprob_t;

/* Bytes the prompt logprobs of a prompt of n_prompt tokens with top alternatives each take:
 * n_prompt x (sizeof(tdm_prompt_logprob_t) + top x sizeof(tdm_token_logprob_t)), 24 + 8 x top
 * bytes a token on LP64 (top 0: 24 B, top 20: 184 B). The one formula for the allocation, the
 * worker's reserve and the node's memory budget. Cannot fail. */
uint64_t tdm_worker_plp_bytes(uint32_t n_prompt, uint32_t top);

/* The default prompt-logprobs reserve of a worker with context n_ctx: one prompt of the whole
 * context (n_ctx - 1 tokens) at the most alternatives (TDM_SAMPLING_MAX_LOGPROBS), so any one
 * request fits alone; 754 KB at n_ctx 4096, 23 MiB at 128k. A node counts it in its engine
 * scratch (tdm_node_measure_engine), so it comes out of the KV pool's share of the budget.
 * Cannot fail. */
uint64_t tdm_worker_plp_reserve(uint32_t n_ctx);

#define TDM_WORKER_MAX_DRAFT 16u
/* Sequences per step that may carry drafts: speculation pays at small batches, where a step
 * is bound by reading the weights, not by arithmetic. */
#define TDM_WORKER_SPEC_SEQS 8u

/* Rows per forward pass that may ask for logits under opts: max_running, plus max_draft for
 * each of at most TDM_WORKER_SPEC_SEQS sequences in DECODE mode with max_draft > 0. The value
 * for the engine's max_logits (tdm_engine_params_t). Cannot fail. */
uint32_t tdm_worker_logit_rows(const tdm_worker_opts_t *opts);

typedef struct tdm_worker tdm_worker_t;

/* Makes a worker over an engine, its pool and the model's tokenizer (for end-of-generation
 * tokens); all must outlive it. Returns NULL with *err: TDM_EINVALID (an option out of range,
 * max_batch_tokens above what the engine takes is not checked here: the forward pass names
 * it), TDM_ERESOURCE. */
tdm_worker_t *tdm_worker_new(tdm_engine_t *engine, tdm_kv_pool_t *pool, const tdm_tokenizer_t *tok,
                             uint32_t n_vocab, const tdm_worker_opts_t *opts, tdm_error_t *err);

/* Releases every sequence's blocks and the worker. NULL-safe, nulls *self_p. */
void tdm_worker_destroy(tdm_worker_t **self_p);

/* A sequence to add. */
typedef struct tdm_worker_req {
    uint64_t seq_id;       /* the caller's id of the sequence, not 0, unique in the worker
                              (nodes: the router's attempt id, tdm_node_attempt_t) */
    const int32_t *prompt; /* [n_prompt] token ids, n_prompt >= 1 */
    uint32_t n_prompt;
    const tdm_sampling_params_t *sampling; /* validated by the caller; max_tokens >= 1 */
    /* DECODE mode, KV received from a prefill node: the block table holding the KV of the
     * prompt and the output below (n_prompt + n_output tokens), taken over by the worker
     * (*prefilled is emptied), and the token the prefill node sampled at output index
     * n_output. NULL: the worker prefills the prompt (and output) itself. */
    tdm_kv_seq_t *prefilled;
    /* The same over a pool with layer groups (prefilled must then be NULL): one table per group
     * of the pool's groups, each with ceil(n / block_size) entries for the n = n_prompt +
     * n_output tokens and holding every entry from tdm_kv_group_first_needed(n) on
     * (tdm_kv_hseq_check_handover); taken over (*prefilled_groups is zeroed). */
    tdm_kv_hseq_t *prefilled_groups;
    int32_t first_token;
    void *user; /* the caller's state for this sequence, returned in each of its events
                   (tdm_worker_event_t.user); not touched by the worker */
    /* A resumed (migrated) request: [n_output] the output tokens already delivered (output
     * indices 0..n_output-1), copied. They follow the prompt as context (their KV is computed
     * with it, or is in *prefilled) but count as output: the next token sampled is output
     * index n_output (so a seeded draw is the undisturbed run's), they are in the penalty
     * window as the tokens after the prompt, and max_tokens counts them. NULL / 0: a new
     * request. Kept apart from the prompt so output-only state (a grammar) can replay them. */
    const int32_t *output;
    uint32_t n_output;
    /* Structured output: the grammar the output must match, NULL for free text. Borrowed: the
     * caller keeps it alive until the sequence's FINISHED or FAILED event or its cancel. The
     * worker gives the sequence its own matcher; before each token it fills the matcher's mask
     * and samples under it (tdm_sampler_sample_masked), after it the matcher accepts the
     * token. The output so far (first_token of a prefilled sequence) is replayed into the
     * matcher at tdm_worker_add; preemption keeps the matcher, whose state is the output's,
     * so recompute needs no replay. The sequence finishes with STOP when the matcher is done
     * (no further byte allowed) or an end-of-generation token is sampled (allowed only where
     * the grammar accepts), LENGTH at max_tokens or the context limit. */
    const tdm_grammar_t *grammar;
    bool no_speculation; /* true: never draft for this sequence (GenerateRequest.speculative
                            OFF); false: as the worker's max_draft says */
    /* Prompt logprobs (vLLM's prompt_logprobs): when prompt_logprobs is set, the logprob of
     * every prompt token after the first given its prefix, with its rank and the
     * prompt_logprobs_top (<= TDM_SAMPLING_MAX_LOGPROBS) most likely tokens, from the prompt's own
     * forward pass (every prompt row asks for logits, so a chunk takes at most the logit rows the
     * batch has left, and the prefix cache is not looked up for the sequence). They come with the
     * TOKEN event of output index 0. Ignored (none) for a resumed or prefilled sequence. Their
     * tdm_worker_plp_bytes are held from tdm_worker_add until the event is released, within
     * opts.plp_reserve_bytes: tdm_worker_add refuses with TDM_ERESOURCE (retry later) while
     * the reserve has too little room left, and with TDM_EINVALID when the whole reserve is too
     * small. */
    bool prompt_logprobs;
    uint32_t prompt_logprobs_top;
    /* Embedding (/v1/embeddings): the sequence samples nothing. Its prompt is computed like
     * any prefill (chunked, batched with other sequences' rows, preempted and recomputed
     * alike; never matched against the prefix cache, so every row's hidden state is computed),
     * its rows' final hidden states are pooled by `pooling` and L2-normalised (model.h), and
     * one EMBEDDING event carries the vector; its blocks are freed then (blocks of full,
     * hashed prompt blocks stay in the prefix cache as any freed block). The prompt may fill
     * the context (n_prompt <= n_ctx). sampling may be NULL (ignored); prefilled, output,
     * grammar and prompt_logprobs must be unset. The vector is bitwise the same whatever else
     * shares the steps and however the prompt is chunked (on the CPU engine). */
    bool embed;
    tdm_pooling_t pooling;
} tdm_worker_req_t;

/* Queues a sequence. A prefilled sequence whose first token already ends it (EOS, a stop
 * token, max_tokens reached, a grammar it completes) finishes at the next step without a
 * forward pass. Returns 0; TDM_EINVALID (seq_id 0 or already in the worker, empty prompt, prompt +
 * output + 1 > n_ctx, n_output >= max_tokens, token out of the vocabulary, prefilled table not
 * covering n_prompt + n_output tokens or given to a worker over a pool with layer groups,
 * prefilled_groups over a plain pool or not what tdm_kv_hseq_check_handover wants, prefilled KV
 * given to a PREFILL worker, a grammar without opts.grammar_vocab, output or a first
 * token the grammar does not allow; prompt logprobs larger than opts.plp_reserve_bytes),
 * TDM_ERESOURCE (max_waiting reached: the message says so; the prompt-logprobs reserve has too
 * little room left now: the message says "reserve";
 * out of memory for the sequence's token array or block table: the message says "out of memory";
 * or a pool that could never hold the sequence even alone: "KV pool too small", naming the
 * tokens whose KV it holds at its peak (DECODE: prompt + min(max_tokens, n_ctx - n_prompt) - 1,
 * the last token sampled is never computed; PREFILL: prompt + output), those blocks
 * (ceil(tokens / block_size), or tdm_kv_groups_blocks_per_seq of them over layer groups) and
 * the pool's total. Nodes never see it: their pool holds a full-context sequence).
 * On error a prefilled table (or prefilled_groups) is left with the caller (its table may have
 * been grown, its blocks and contents are unchanged). */
int tdm_worker_add(tdm_worker_t *w, const tdm_worker_req_t *req, tdm_error_t *err);

/* Forks sequence parent_id for one more choice of the same prompt (OpenAI's n > 1): adds a
 * new sequence req->seq_id (req->sampling, user, grammar; req->prompt must be the
 * parent's prompt) whose block table shares, by reference (tdm_kv_pool_ref), each block of the
 * parent's prompt KV that holds no position from n_prompt - 1 on: k = (n_prompt - 1) /
 * block_size full blocks. The fork recomputes the rest of the prompt itself (1..block_size
 * rows, in a fresh block of its own, so no block is ever written by two sequences and no
 * device copy is needed) and samples its first token from its own seed; the engine is
 * batch-invariant, so those rows and logits are bitwise the parent's. The parent is
 * unchanged and either may finish first: a shared block is freed with its last reference.
 * Over a pool with layer groups a window group shares only the blocks the fork's first query
 * reads; when the parent already gave back one of those (it decoded past the window), nothing
 * is shared and the fork computes its prompt (or finds it in the prefix cache).
 * Like any sequence, a fork preempted later recomputes its whole prompt. req->prefilled and
 * req->output must be NULL / 0. Returns 0; TDM_ENOTFOUND (no sequence parent_id);
 * TDM_EPRECONDITION (the parent's prompt KV is not computed yet, or it was preempted: retry
 * after a step); TDM_EINVALID (a prompt that is not the parent's, prefilled or output set)
 * and tdm_worker_add's errors. */
int tdm_worker_fork(tdm_worker_t *w, uint64_t parent_id, const tdm_worker_req_t *req,
                    tdm_error_t *err);

/* Removes sequence seq_id wherever it is (waiting or running) and frees its blocks. Returns 0
 * or TDM_ENOTFOUND. No event is produced for it. O(1) lookup (hash of the id). */
int tdm_worker_cancel(tdm_worker_t *w, uint64_t seq_id);

typedef enum tdm_worker_event_kind {
    TDM_WORKER_EVENT_TOKEN = 0,     /* a token was sampled */
    TDM_WORKER_EVENT_FINISHED = 1,  /* DECODE: the sequence ended; its blocks are freed */
    TDM_WORKER_EVENT_PREFILLED = 2, /* PREFILL: the prompt's KV is ready; seq is the caller's */
    TDM_WORKER_EVENT_FAILED = 3,    /* the sequence failed; its blocks are freed */
    TDM_WORKER_EVENT_EMBEDDING = 4, /* an embedding sequence's vector; its blocks are freed */
} tdm_worker_event_kind_t;

typedef enum tdm_worker_finish {
    TDM_WORKER_FINISH_STOP = 1,   /* EOS / end-of-generation or a stop token */
    TDM_WORKER_FINISH_LENGTH = 2, /* max_tokens or the context limit */
} tdm_worker_finish_t;

typedef struct tdm_worker_event {
    tdm_worker_event_kind_t kind;
    uint64_t seq_id; /* the sequence's tdm_worker_req_t.seq_id */
    void *user;      /* the sequence's tdm_worker_req_t.user */
    /* TOKEN */
    uint32_t index;                /* output index (0 = first generated token) */
    tdm_sample_result_t sample;    /* token, logprob, top logprobs */
    uint32_t cached_prompt_tokens; /* index 0: prompt tokens reused from the prefix cache */
    double prefill_s;              /* index 0: first scheduled until sampled, seconds */
    /* index 0 of a sequence that asked for prompt_logprobs: [n_prompt_logprobs] = n_prompt
     * entries, entry i the logprobs of prompt token i given tokens 0..i-1 (entry 0 unused: the
     * first token has no prefix); owned by the worker, valid until the next tdm_worker_step.
     * NULL / 0 otherwise. */
    const tdm_prompt_logprob_t *prompt_logprobs;
    uint32_t n_prompt_logprobs;
    uint64_t prompt_logprobs_bytes; /* what they hold of the worker's reserve (until released) */
    /* FINISHED */
    tdm_worker_finish_t finish;
    uint32_t completion_tokens; /* output tokens, index 0 included */
    uint32_t preemptions;       /* times the sequence was preempted and recomputed */
    /* PREFILLED: block table with the KV of n_tokens tokens (the prompt and the request's
     * resumed output); the caller releases it with tdm_kv_seq_release when done (after handing
     * the blocks to the KV sender). first_token: output index n_tokens - n_prompt. Over a pool
     * with layer groups seq is empty and hseq holds one table per group, ceil(n_tokens /
     * block_size) entries each, of which a window group holds those from
     * tdm_kv_group_first_needed(n_tokens) on (tdm_kv_group_live(n_tokens, n_tokens) blocks; the
     * others are TDM_KV_NO_BLOCK); released with tdm_kv_hseq_release. */
    tdm_kv_seq_t seq;
    tdm_kv_hseq_t hseq;
    uint32_t n_tokens;
    int32_t first_token;
    /* EMBEDDING: embedding[n_embd] (f32, L2-normalised; owned by the worker, valid until the
     * next tdm_worker_step), n_tokens = the prompt's tokens, prefill_s as for TOKEN,
     * preemptions as for FINISHED */
    const float *embedding;
    uint32_t n_embd;
    /* FAILED */
    int status;
    char message[256];
    bool request_fault; /* the request's own constraints left no token (TaskFailed.request_fault) */
} tdm_worker_event_t;

/* Runs one forward pass over whatever is scheduled (nothing when idle) and returns the events
 * it produced through *events (an array owned by the worker, valid until the next call) and
 * *n_events. Returns 0 (also when idle), or the engine's error status when the forward pass
 * failed: then every sequence of that batch gets a FAILED event and its blocks are freed, and
 * the worker stays usable. Allocates nothing (tests/unit/test_worker.c counts; a constrained
 * sequence's matcher may fill its bounded caches during its first steps, tandem/grammar.h): a
 * sequence that cannot get blocks waits or is preempted, a FAILED event (TDM_ERESOURCE, "KV pool
 * exhausted", naming the tokens and blocks) only when, running alone, it finds not even one
 * row's blocks (queued prefilled sequences hold the rest). */
int tdm_worker_step(tdm_worker_t *w, const tdm_worker_event_t **events, uint32_t *n_events,
                    tdm_error_t *err);

/* The caller is done with the last step's events: the prompt logprobs they carry are freed
 * and given back to the reserve now rather than at the next step (which an idle node may not
 * take for a long time). The events' other fields stay readable until the next step. Cannot
 * fail. */
void tdm_worker_events_done(tdm_worker_t *w);

/* True when a step would do work. */
bool tdm_worker_busy(const tdm_worker_t *w);

/* Tokens per forward pass, as a histogram: the upper bounds (tokens, inclusive) of its buckets
 * are vLLM 0.33.0's ITERATION_TOKENS_BUCKETS (vllm/v1/metrics/buckets.py: 1, 8, 16, ..., 16384,
 * powers of two), and one more bucket (+Inf) follows them. The worker counts; the node sends the
 * counts in its heartbeats and the router sums them into vllm:iteration_tokens_total. */
#define TDM_WORKER_ITERATION_BOUNDS 13
#define TDM_WORKER_ITERATION_BUCKETS (TDM_WORKER_ITERATION_BOUNDS + 1)

/* The bucket bounds, ascending: TDM_WORKER_ITERATION_BOUNDS entries, constant storage. */
const double *tdm_worker_iteration_bounds(void);

/* The bucket of a forward pass of `tokens` rows: the first whose bound is >= tokens, or
 * TDM_WORKER_ITERATION_BOUNDS (+Inf). Cannot fail. */
uint32_t tdm_worker_iteration_bucket(uint64_t tokens);

/* Load figures for heartbeats and status. */
typedef struct tdm_worker_stats {
    uint32_t running;               /* sequences admitted to the batch */
    uint32_t waiting;               /* queued, not yet admitted (or preempted) */
    uint64_t queued_prefill_tokens; /* prompt tokens still to compute, all sequences */
    uint32_t batch_size;            /* sequences in the last forward pass */
    uint32_t batch_tokens;          /* rows in the last forward pass */
    double last_step_s;             /* duration of the last forward pass */
    double decode_step_s;           /* duration of the last pass of decode rows only (no
                                       prompt chunk), seconds; 0 before the first */
    uint32_t decode_batch_size;     /* sequences in that pass */
    uint64_t steps;                 /* forward passes run */
    uint64_t preemptions;           /* total */
    /* forward passes by rows (tokens) since the worker started: counts per bucket, not
     * cumulative (tdm_worker_iteration_bucket), and the rows of them all */
    uint64_t iteration_counts[TDM_WORKER_ITERATION_BUCKETS];
    uint64_t iteration_tokens;
    uint64_t spec_drafts;          /* sequences' verification passes that carried drafts */
    uint64_t spec_draft_tokens;    /* draft tokens proposed (and verified) */
    uint64_t spec_accepted_tokens; /* of which equal to the token drawn at their index */
} tdm_worker_stats_t;

void tdm_worker_stats(const tdm_worker_t *w, tdm_worker_stats_t *out);

/* Whether `token` ends a sequence sampled with sp: one of sp's stop_token_ids, or an
 * end-of-generation token of tok unless sp->ignore_eos. The one rule the worker and the
 * router (which must know whether a request it migrates has ended already) apply. Cannot
 * fail. */
bool tdm_worker_token_ends(const tdm_tokenizer_t *tok, const tdm_sampling_params_t *sp,
                           int32_t token);

/* True when the worker holds sequence seq_id. Cannot fail. */
bool tdm_worker_has(const tdm_worker_t *w, uint64_t seq_id);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_WORKER_H */
