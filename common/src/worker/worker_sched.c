/* worker_sched.c - scheduling one step of the worker: decode rows first (oldest first; an empty
 * pool preempts the newest running sequence), then prefill chunks of running sequences, then
 * waiting sequences admitted FIFO (prefix cache first) while the token budget, max_running and
 * the pool allow (worker.h states the rules). */
#include "worker_internal.h"

#include <stdio.h>
#include <string.h>

/* Clears the newest running sequence's blocks (its table stays) and puts it at the front of
 * the queue: it is recomputed from scratch when readmitted. */
static void preempt_newest(tdm_worker_t *w)
{
    TDM_ASSERT(w->n_running > 0);
    uint32_t slot = w->running[--w->n_running];
    wseq_t *s = &w->seqs[slot];
    tdm_worker_kv_clear(w, s);
    s->n_computed = 0;
    if (s->emb_acc) /* its rows are computed (and pooled) again */
        memset(s->emb_acc, 0, w->n_embd * sizeof *s->emb_acc);
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
bool tdm_worker_reserve(tdm_worker_t *w, wseq_t *s, uint32_t n_tokens)
{
    TDM_ASSERT(n_tokens <= s->cap);
    if (w->groups)
        return tdm_kv_hseq_reserve(w->pool, &s->hkv, n_tokens) == TDM_OK;
    return tdm_kv_seq_reserve(w->pool, &s->kv, n_tokens) == TDM_OK;
}

/* Adds a chunk of `chunk` rows of slot to the batch being built, then n_draft draft rows
 * (the drafts lie in tokens[n_tokens..]; the last real row and every draft row ask for
 * logits). */
static void add_rows(tdm_worker_t *w, uint32_t slot, uint32_t chunk, uint32_t n_draft)
{
    wseq_t *s = &w->seqs[slot];
    uint32_t k = w->n_bseq++;
    bool logits = !s->embed && s->n_computed + chunk == s->n_tokens;
    w->b_hidden |= s->embed;
    bool plp = tdm_worker_plp_active(s); /* every prompt row asks (prompt logprobs) */
    for (uint32_t i = 0; i < chunk + n_draft; i++) {
        uint32_t r = w->n_rows++;
        w->b_tokens[r] = s->tokens[s->n_computed + i];
        w->b_pos[r] = s->n_computed + i;
        w->b_seq[r] = k;
        w->b_want[r] = (logits && i + 1 >= chunk) || (plp && i < chunk);
        w->want_left -= w->b_want[r];
    }
    w->b_slot[k] = slot;
    w->b_chunk[k] = chunk;
    w->b_draft[k] = n_draft;
    w->b_logits[k] = logits;
    w->budget -= chunk + n_draft;
    if (!s->admitted_once || s->t_first_sched == 0)
        s->t_first_sched = tdm_time_now();
}

/* Rows the prompt chunk of s gets this step: under the token budget and max_prefill_chunk,
 * and within the logit rows the batch has left (a sequence owing prompt logprobs asks for
 * every row's; a chunk that ends the prompt asks for its last row's). 0: none this step. */
static uint32_t prefill_chunk(const tdm_worker_t *w, const wseq_t *s)
{
    uint32_t remaining = s->n_tokens - s->n_computed;
    uint32_t chunk = remaining < w->budget ? remaining : w->budget;
    if (w->o.max_prefill_chunk && chunk > w->o.max_prefill_chunk && w->n_running > 0)
        chunk = w->o.max_prefill_chunk;
    if (tdm_worker_plp_active(s))
        return chunk < w->want_left ? chunk : w->want_left;
    if (chunk == remaining && w->want_left == 0 && !s->embed)
        chunk--; /* stop one row short: the last one, asking for logits, waits a step */
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
            tdm_worker_seq_finish(w, slot, w->seqs[slot].pending_finish);
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
    while (!tdm_worker_reserve(w, s, s->n_computed + 1)) {
        if (w->running[w->n_running - 1] == slot) {
            if (w->n_running == 1)
                tdm_worker_seq_fail(
                    w, slot, TDM_ERESOURCE,
                    "KV pool exhausted: the sequence alone needs more blocks than the pool has");
            else
                preempt_newest(w);
            return false;
        }
        preempt_newest(w);
    }
    return true;
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
        add_rows(w, slot, 1, tdm_worker_spec_drafts(w, s, i));
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
        uint32_t chunk = prefill_chunk(w, s);
        if (chunk == 0)
            continue;
        if (!tdm_worker_reserve(w, s, s->n_computed + chunk)) {
            w->starved = true; /* waits for blocks; decode rows free them as sequences end */
            continue;
        }
        add_rows(w, slot, chunk, 0);
    }
}

/* The rows the next waiting sequence gets, with its blocks reserved (prefix cache first);
 * 0 when the pool cannot hold them (its blocks are cleared again). */
static uint32_t admit_reserve(tdm_worker_t *w, wseq_t *s)
{
    /* no prefix-cache hit for a sequence owing prompt logprobs: its rows must be computed */
    if (s->n_computed == 0 && tdm_worker_kv_held(w, s) == 0 && w->o.prefix_caching && !s->plp &&
        !s->embed) {
        uint32_t matched = tdm_worker_kv_match_prefix(w, s);
        s->n_computed = matched;
        if (!s->admitted_once)
            s->cached_prompt_tokens = matched < s->n_prompt ? matched : s->n_prompt;
    }
    uint32_t chunk = prefill_chunk(w, s);
    return chunk > 0 && tdm_worker_reserve(w, s, s->n_computed + chunk) ? chunk : 0;
}

/* The largest of chunk, chunk / 2, chunk / 4, ... rows of s whose blocks the pool can give
 * now (reserved), or 0. For a sequence that nothing else running could free blocks for: the
 * engine is batch-invariant however a prompt is chunked, so a smaller chunk changes nothing
 * but the number of steps. */
static uint32_t reserve_shrinking(tdm_worker_t *w, wseq_t *s, uint32_t chunk)
{
    while (chunk > 0 && !tdm_worker_reserve(w, s, s->n_computed + chunk))
        chunk /= 2;
    return chunk;
}

/* 3. Admits waiting sequences, FIFO, while the budget, max_running and the pool allow. While
 * a running sequence waits for blocks for its prompt chunk, none is admitted that would take
 * blocks for a prompt of its own (a prefilled one, holding its KV, still is). */
static void schedule_admit(tdm_worker_t *w)
{
    while (w->n_waiting > 0 && w->n_running < w->o.max_running && w->budget > 0) {
        uint32_t slot = w->waiting[0];
        wseq_t *s = &w->seqs[slot];
        if (w->starved && tdm_worker_kv_held(w, s) == 0)
            break;
        uint32_t chunk = admit_reserve(w, s);
        if (chunk == 0 && w->n_running == 0 && w->n_bseq == 0)
            chunk = reserve_shrinking(w, s, prefill_chunk(w, s));
        if (chunk == 0) {
            if (w->n_running == 0 && w->n_bseq == 0) {
                /* Nothing runs that could free blocks: this sequence can never fit. */
                char msg[160];
                snprintf(msg, sizeof msg,
                         "KV pool exhausted: %u tokens need more blocks than the %u available",
                         s->n_computed + prefill_chunk(w, s),
                         tdm_kv_pool_available(w->pool) + tdm_worker_kv_held(w, s));
                tdm_worker_seq_fail(w, slot, TDM_ERESOURCE, msg);
                continue;
            }
            tdm_worker_kv_clear(w, s);
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

/* 4. A batch without rows although sequences run: each of them waits for blocks for its prompt
 * chunk, and none will come, since only running sequences free blocks. The oldest goes on
 * alone: the others are preempted (recomputed later, LIFO as in decode_reserve) and its chunk
 * shrinks to what the pool can give; when not even one row fits, it fails (tdm_worker_add
 * refuses a sequence the pool can never hold, so only blocks held by queued prefilled
 * sequences can leave it short). */
static void schedule_unstall(tdm_worker_t *w)
{
    if (w->n_rows > 0 || w->n_running == 0)
        return;
    while (w->n_running > 1)
        preempt_newest(w);
    uint32_t slot = w->running[0];
    wseq_t *s = &w->seqs[slot];
    uint32_t chunk = prefill_chunk(w, s);
    uint32_t got = reserve_shrinking(w, s, chunk);
    if (got > 0) {
        add_rows(w, slot, got, 0);
        return;
    }
    char msg[256];
    snprintf(msg, sizeof msg,
             "KV pool exhausted: the sequence needs blocks for %u more prompt tokens (%u "
             "computed) and holds %u blocks; %u blocks are free",
             chunk > 0 ? chunk : 1, s->n_computed, tdm_worker_kv_held(w, s),
             tdm_kv_pool_available(w->pool));
    tdm_worker_seq_fail(w, slot, TDM_ERESOURCE, msg);
}

/* The batch of a step, from an empty one. */
void tdm_worker_schedule(tdm_worker_t *w)
{
    finish_pending(w);
    w->budget = w->o.max_batch_tokens;
    w->draft_left = w->logit_rows - w->o.max_running;
    w->want_left = w->logit_rows;
    w->n_rows = w->n_bseq = 0;
    w->starved = false;
    w->b_hidden = false;
    schedule_decode(w);
    schedule_prefill(w);
    schedule_admit(w);
    schedule_unstall(w);
}
