/* grammar_matcher.c - tdm_grammar_matcher_t: one sequence's position in a grammar (a state
 * of its own state space, grammar_state.c), fed bytes or tokens; the mask is grammar_mask.c.
 *
 * The state space grows as new states are met and is rebuilt around the current state when a
 * table passes half its bound (between calls, never inside one), so memory stays bounded over
 * a generation of any length.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_matcher_internal.h"

static void set_errmsg(tdm_grammar_matcher_t *m, const char *msg)
{
    snprintf(m->errmsg, sizeof m->errmsg, "%s", msg);
}

/* Notes a bound hit by the last operation in errmsg. */
void tdm_gram_matcher_note_bounds(tdm_grammar_matcher_t *m)
{
    if (m->sp.too_ambiguous)
        snprintf(m->errmsg, sizeof m->errmsg,
                 "the grammar is too ambiguous: a step needs more than %u parse stacks "
                 "(TDM_GRAMMAR_MAX_STACKS); such continuations are refused",
                 TDM_GRAMMAR_MAX_STACKS);
    else if (m->sp.oom)
        set_errmsg(m, "out of memory in the grammar matcher");
    else if (m->sp.full)
        set_errmsg(m, "the grammar's state space exceeds its bounds in one step");
}

/* Past half a bound, and (for nodes) past twice what the current state alone needed at the
 * last rebuild, so that a state with very deep stacks is not rebuilt at every call. */
static bool over_half(const tdm_grammar_matcher_t *m)
{
    const gram_space_t *sp = &m->sp;
    return sp->full || (sp->n_nodes > GRAM_MAX_NODES / 2 && sp->n_nodes > 2 * m->floor_nodes) ||
           sp->n_states > GRAM_MAX_STATES / 2 || sp->n_trans > GRAM_MAX_TRANS / 2 ||
           sp->n_pool > GRAM_MAX_POOL / 2;
}

int tdm_gram_matcher_rebuild(tdm_grammar_matcher_t *m)
{
    if (tdm_gram_space_save(&m->sp, m->cur, &m->saved) != TDM_OK)
        return TDM_ERESOURCE;
    tdm_gram_space_clear(&m->sp);
    tdm_gram_mask_cache_clear(m);
    m->cur = tdm_gram_space_load(&m->sp, &m->saved);
    m->floor_nodes = m->sp.n_nodes;
    return m->cur == GRAM_DEAD ? TDM_ERESOURCE : TDM_OK;
}

void tdm_gram_matcher_maybe_rebuild(tdm_grammar_matcher_t *m)
{
    if (over_half(m) && tdm_gram_matcher_rebuild(m) != TDM_OK)
        set_errmsg(m, "out of memory rebuilding the grammar matcher's tables");
}

tdm_grammar_matcher_t *tdm_grammar_matcher_new(const tdm_grammar_t *g, const tdm_grammar_vocab_t *v,
                                               tdm_error_t *err)
{
    tdm_grammar_matcher_t *m = calloc(1, sizeof *m);
    if (!m || tdm_gram_space_init(&m->sp, g) != TDM_OK)
        goto out_oom;
    m->g = g;
    m->v = v;
    m->n_words = v ? (v->n_vocab + 31) / 32 : 0;
    m->walk_state = malloc(((size_t)(v ? v->max_depth : 0) + 2) * sizeof *m->walk_state);
    m->deny = malloc(((size_t)m->n_words + 1) * sizeof *m->deny);
    if (!m->walk_state || !m->deny)
        goto out_oom;
    tdm_gram_mask_cache_clear(m);
    m->cur = tdm_gram_space_start(&m->sp);
    if (m->cur == GRAM_DEAD) {
        if (m->sp.too_ambiguous) {
            tdm_error_set(err, TDM_EINVALID,
                          "the grammar is too ambiguous: its start needs more than %u parse "
                          "stacks (TDM_GRAMMAR_MAX_STACKS)",
                          TDM_GRAMMAR_MAX_STACKS);
            tdm_grammar_matcher_destroy(&m);
            return NULL;
        }
        goto out_oom;
    }
    return m;
out_oom:
    tdm_grammar_matcher_destroy(&m);
    tdm_error_set(err, TDM_ERESOURCE, "out of memory creating a grammar matcher");
    return NULL;
}

void tdm_grammar_matcher_destroy(tdm_grammar_matcher_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_grammar_matcher_t *m = *self_p;
    tdm_gram_space_free(&m->sp);
    for (uint32_t i = 0; i < TDM_GRAMMAR_MASK_CACHE; i++)
        free(m->cache[i].bits);
    free(m->walk_state);
    free(m->deny);
    free(m->saved.pos);
    free(m->orig.pos);
    free(m);
    *self_p = NULL;
}

void tdm_grammar_matcher_reset(tdm_grammar_matcher_t *m)
{
    m->ended = false;
    m->errmsg[0] = '\0';
    tdm_gram_matcher_maybe_rebuild(m);
    uint32_t s = tdm_gram_space_start(&m->sp);
    if (s == GRAM_DEAD && tdm_gram_matcher_rebuild(m) == TDM_OK)
        s = tdm_gram_space_start(&m->sp);
    if (s != GRAM_DEAD)
        m->cur = s;
    else
        tdm_gram_matcher_note_bounds(m);
}

int tdm_grammar_matcher_copy(tdm_grammar_matcher_t *dst, const tdm_grammar_matcher_t *src)
{
    if (dst->g != src->g || dst->v != src->v)
        return TDM_EINVALID;
    if (tdm_gram_space_save(&src->sp, src->cur, &dst->saved) != TDM_OK)
        return TDM_ERESOURCE;
    tdm_gram_matcher_maybe_rebuild(dst);
    uint32_t s = tdm_gram_space_load(&dst->sp, &dst->saved);
    if (s == GRAM_DEAD) {
        tdm_gram_space_clear(&dst->sp);
        tdm_gram_mask_cache_clear(dst);
        s = tdm_gram_space_load(&dst->sp, &dst->saved);
        if (s == GRAM_DEAD)
            return TDM_ERESOURCE;
    }
    dst->cur = s;
    dst->ended = src->ended;
    return TDM_OK;
}

tdm_grammar_matcher_t *tdm_grammar_matcher_clone(const tdm_grammar_matcher_t *m, tdm_error_t *err)
{
    tdm_grammar_matcher_t *c = tdm_grammar_matcher_new(m->g, m->v, err);
    if (c && tdm_grammar_matcher_copy(c, m) != TDM_OK) {
        tdm_grammar_matcher_destroy(&c);
        tdm_error_set(err, TDM_ERESOURCE, "out of memory copying a grammar matcher");
    }
    return c;
}

/* Puts the matcher back in the state saved in m->orig (after a rebuild lost its id). */
static void restore_orig(tdm_grammar_matcher_t *m)
{
    tdm_gram_space_clear(&m->sp);
    tdm_gram_mask_cache_clear(m);
    m->cur = tdm_gram_space_load(&m->sp, &m->orig);
    m->floor_nodes = m->sp.n_nodes;
}

bool tdm_grammar_matcher_accept_bytes(tdm_grammar_matcher_t *m, const char *bytes, size_t n)
{
    if (m->ended)
        return n == 0;
    tdm_gram_matcher_maybe_rebuild(m);
    const uint8_t *b = (const uint8_t *)bytes;
    uint32_t start = m->cur, s = start;
    bool rebuilt = false;
    for (size_t i = 0; i < n; i++) {
        uint32_t next = tdm_gram_space_step(&m->sp, s, b[i]);
        if (next == GRAM_DEAD && m->sp.full) {
            /* rebuild around the state reached so far, keeping the start to roll back to */
            if (!rebuilt && tdm_gram_space_save(&m->sp, start, &m->orig) != TDM_OK) {
                s = GRAM_DEAD;
                break;
            }
            rebuilt = true;
            m->cur = s;
            if (tdm_gram_matcher_rebuild(m) != TDM_OK) {
                s = GRAM_DEAD;
                break;
            }
            s = m->cur;
            next = tdm_gram_space_step(&m->sp, s, b[i]);
        }
        if (next == GRAM_DEAD) {
            s = GRAM_DEAD;
            break;
        }
        s = next;
    }
    if (s == GRAM_DEAD) {
        tdm_gram_matcher_note_bounds(m);
        if (rebuilt)
            restore_orig(m);
        else
            m->cur = start;
        return false;
    }
    m->cur = s;
    return true;
}

int tdm_grammar_matcher_accept_token(tdm_grammar_matcher_t *m, int32_t token)
{
    const tdm_grammar_vocab_t *v = m->v;
    if (!v || token < 0 || (uint32_t)token >= v->n_vocab) {
        snprintf(m->errmsg, sizeof m->errmsg, "token %d is out of range (vocabulary of %u)",
                 (int)token, v ? v->n_vocab : 0);
        return TDM_EINVALID;
    }
    if (m->ended) {
        snprintf(m->errmsg, sizeof m->errmsg, "token %d after the end of the output", (int)token);
        return TDM_EINVALID;
    }
    if (v->kind[token] == GRAM_TOK_EOG) {
        if (!tdm_grammar_matcher_is_accepting(m)) {
            snprintf(m->errmsg, sizeof m->errmsg,
                     "token %d ends the output, which the grammar does not accept yet", (int)token);
            return TDM_EINVALID;
        }
        m->ended = true;
        return TDM_OK;
    }
    if (v->kind[token] == GRAM_TOK_NEVER) {
        snprintf(m->errmsg, sizeof m->errmsg,
                 "token %d is a special token the grammar cannot "
                 "match",
                 (int)token);
        return TDM_EINVALID;
    }
    const char *b = v->blob + v->bytes_off[token];
    size_t n = v->bytes_off[token + 1] - v->bytes_off[token];
    if (!tdm_grammar_matcher_accept_bytes(m, b, n)) {
        snprintf(m->errmsg, sizeof m->errmsg, "token %d (%zu bytes) does not continue the grammar",
                 (int)token, n);
        return TDM_EINVALID;
    }
    return TDM_OK;
}

bool tdm_grammar_matcher_is_accepting(const tdm_grammar_matcher_t *m)
{
    return m->ended || tdm_gram_space_accepting(&m->sp, m->cur);
}

bool tdm_grammar_matcher_is_done(const tdm_grammar_matcher_t *m)
{
    return m->ended || tdm_gram_space_done(&m->sp, m->cur);
}

const char *tdm_grammar_matcher_errmsg(const tdm_grammar_matcher_t *m)
{
    return m->errmsg;
}
