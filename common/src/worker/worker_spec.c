/* worker_spec.c - speculative decoding by prompt lookup (worker.h): proposing drafts from the
 * sequence's own context, deciding how many pay from its acceptance rate and the fitted cost of
 * a row, reserving their blocks without ever making plain decoding preempt, and verifying them
 * against the tokens drawn exactly as plain decoding draws them. */
#include "worker_internal.h"

#include <string.h>

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
void tdm_worker_spec_fit_add(tdm_worker_t *w, uint32_t rows, double s)
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
    uint32_t more = tdm_worker_kv_cost(w, s, s->n_computed + 1 + k);
    uint32_t per_seq = w->groups ? w->groups->n_groups : 1; /* a decode row's new entry */
    if (more > 0 && tdm_kv_pool_available(w->pool) < more + (w->n_running - i - 1) * per_seq)
        return false;
    return tdm_worker_reserve(w, s, s->n_computed + 1 + k);
}

/* Drafts for running sequence i (slot s), written after its tokens, with blocks reserved for
 * their rows (never preempting for them: with the pool short they shrink to what the blocks
 * held cover). 0 when it does not speculate this step: no match, or drafts that would not pay
 * at its acceptance rate and this machine's cost of a row; then it waits a number of steps that
 * doubles each time (at most SPEC_MAX_WAIT) and tries one draft, so its estimate can recover. */
uint32_t tdm_worker_spec_drafts(tdm_worker_t *w, wseq_t *s, uint32_t i)
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
        uint32_t covered = tdm_worker_kv_entries(w, s) * tdm_kv_pool_layout(w->pool)->block_size;
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
    tdm_worker_kv_trim(w, s, keep);
}

/* 5. Verifies the n_draft drafts of slot against logits rows [1 + n_draft] (the decode row's,
 * then one per draft): draws the tokens in order exactly as plain decoding would, each under
 * the history and grammar state its predecessors left; a draft equal to the token drawn at its
 * index is accepted (its row's KV is that token's, so n_computed covers it) and the next row's
 * token is drawn, the first mismatch or the end of the sequence stops. Then the blocks taken
 * for rejected rows go back. */
void tdm_worker_spec_verify(tdm_worker_t *w, uint32_t slot, uint32_t n_draft, const float *rows,
                            double t_end)
{
    wseq_t *s = &w->seqs[slot];
    uint32_t accepted = 0;
    for (uint32_t j = 0;; j++) {
        int32_t draft = j < n_draft ? s->tokens[s->n_tokens] : -1;
        if (!tdm_worker_sample_next(w, slot, rows + (size_t)j * w->n_vocab, t_end))
            break; /* ended: the slot is free */
        if (j == n_draft || s->tokens[s->n_tokens - 1] != draft) {
            spec_adapt(s, accepted, n_draft);
            spec_trim(w, s);
            break;
        }
        accepted++;
        s->n_computed++;
        tdm_worker_commit_kv(w, s);
    }
    w->stats.spec_drafts++;
    w->stats.spec_draft_tokens += n_draft;
    w->stats.spec_accepted_tokens += accepted;
}
