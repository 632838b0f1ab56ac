/* grammar_mask.c - the allowed-token mask: a depth-first walk of the vocabulary trie that
 * advances the state byte by byte (memoised transitions) and skips a subtree as soon as the
 * state dies, with the finished mask cached per state (most steps inside a JSON string or
 * number come back to the same state).
 *
 * Shortcut: a subtree whose bytes are all ASCII bytes of B(s) and whose height is within
 * cover(s) (tdm_gram_space_cover: inside a string, or under a counted repetition of
 * characters) is allowed whole: the walk sets its tokens' bits without stepping. A state's
 * cover is computed once the walk has taken GRAM_HITS_FOR_COVER live steps from it, so
 * states with few continuations (inside a literal) never pay for it.
 */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_matcher_internal.h"

void tdm_gram_mask_cache_clear(tdm_grammar_matcher_t *m)
{
    for (uint32_t i = 0; i < TDM_GRAMMAR_MASK_CACHE; i++)
        m->cache[i].state = UINT32_MAX;
    m->next_victim = 0;
}

#define GRAM_HITS_FOR_COVER 24u

/* True when the subtree at node i can be allowed whole from state st (see above). */
static bool subtree_covered(const tdm_grammar_vocab_t *v, uint32_t i, const gram_state_t *st)
{
    const gram_trie_node_t *nd = &v->nodes[i];
    const uint32_t *a = v->node_ascii[i];
    return st->cover_ok && st->cover >= nd->height && !nd->nonascii && !(a[0] & ~st->uni[0]) &&
           !(a[1] & ~st->uni[1]) && !(a[2] & ~st->uni[2]) && !(a[3] & ~st->uni[3]);
}

static uint32_t set_tokens(const tdm_grammar_vocab_t *v, uint32_t begin, uint32_t end,
                           uint32_t *mask)
{
    for (uint32_t k = begin; k < end; k++) {
        uint32_t t = v->tok_ids[k];
        mask[t >> 5] |= 1u << (t & 31);
    }
    return end - begin;
}

/* Deny mode: once most of the tokens walked so far are allowed (a string's content, where
 * nearly the whole vocabulary is), the walk stops setting allowed tokens one by one and
 * records the denied ones instead; the mask is then the trie's tokens less those. The switch
 * can happen at any node, as the tokens before a node in preorder are all decided there; it
 * is checked every GRAM_DENY_CHECK tokens, once GRAM_DENY_MIN are decided, and taken when at
 * least half of them were allowed. Either mode gives the same mask. */
#define GRAM_DENY_MIN 1024u
#define GRAM_DENY_CHECK 1024u

static void deny_tokens(const tdm_grammar_vocab_t *v, uint32_t begin, uint32_t end, uint32_t *deny)
{
    for (uint32_t k = begin; k < end; k++) {
        uint32_t t = v->tok_ids[k];
        deny[t >> 5] |= 1u << (t & 31);
    }
}

/* Enters deny mode at sorted position p: the tokens before p that mask does not allow are
 * denied. */
static void deny_begin(const tdm_grammar_matcher_t *m, const uint32_t *mask, uint32_t p)
{
    const tdm_grammar_vocab_t *v = m->v;
    memset(m->deny, 0, (size_t)m->n_words * sizeof *m->deny);
    for (uint32_t k = 0; k < p; k++) {
        uint32_t t = v->tok_ids[k];
        if (!(mask[t >> 5] >> (t & 31) & 1u))
            m->deny[t >> 5] |= 1u << (t & 31);
    }
}

/* The set bits of x (portable: the build targets no popcnt instruction). */
static uint32_t bits_set(uint32_t x)
{
    x = x - ((x >> 1) & 0x55555555u);
    x = (x & 0x33333333u) + ((x >> 2) & 0x33333333u);
    return (((x + (x >> 4)) & 0x0F0F0F0Fu) * 0x01010101u) >> 24;
}

/* Leaves deny mode: mask = the trie's tokens not denied; returns their number. */
static uint32_t deny_end(const tdm_grammar_matcher_t *m, uint32_t *mask)
{
    const uint32_t *all = m->v->trie_bits, *deny = m->deny;
    uint32_t count = 0;
    for (uint32_t w = 0; w < m->n_words; w++) {
        mask[w] = all[w] & ~deny[w];
        count += bits_set(mask[w]);
    }
    return count;
}

/* Walks the trie from state s0, setting the bits of the tokens whose bytes stay inside the
 * grammar; returns their number. */
static uint32_t walk(tdm_grammar_matcher_t *m, uint32_t s0, uint32_t *mask)
{
    const tdm_grammar_vocab_t *v = m->v;
    const gram_trie_node_t *nodes = v->nodes;
    gram_space_t *sp = &m->sp;
    uint32_t *st = m->walk_state, count = 0, check = GRAM_DENY_MIN;
    bool deny = false;
    st[0] = s0;
    for (uint32_t i = 0; i < v->n_nodes;) {
        const gram_trie_node_t *nd = &nodes[i];
        if (!deny && nd->tok_begin >= check) {
            check = nd->tok_begin + GRAM_DENY_CHECK;
            if (2 * count >= nd->tok_begin) {
                deny_begin(m, mask, nd->tok_begin);
                deny = true;
            }
        }
        uint32_t s = st[nd->depth];
        if (subtree_covered(v, i, &sp->states[s])) {
            if (!deny)
                count += set_tokens(v, nd->tok_begin, nd->sub_tok_end, mask);
            i = nd->end;
            continue;
        }
        uint32_t ns = tdm_gram_space_step_fast(sp, s, nd->byte);
        if (ns == GRAM_DEAD) {
            if (deny)
                deny_tokens(v, nd->tok_begin, nd->sub_tok_end, m->deny);
            i = nd->end;
            continue;
        }
        if (++sp->states[s].hits == GRAM_HITS_FOR_COVER)
            tdm_gram_space_cover(sp, s);
        if (!deny)
            count += set_tokens(v, nd->tok_begin, nd->tok_end, mask);
        st[nd->depth + 1] = ns;
        i++;
    }
    return deny ? deny_end(m, mask) : count;
}

/* The end-of-generation tokens, allowed when state s accepts. */
static uint32_t set_eog(const tdm_grammar_matcher_t *m, uint32_t s, uint32_t *mask)
{
    if (!tdm_gram_space_accepting(&m->sp, s))
        return 0;
    for (uint32_t i = 0; i < m->v->n_eog; i++)
        mask[m->v->eog[i] >> 5] |= 1u << (m->v->eog[i] & 31);
    return m->v->n_eog;
}

/* Computes the mask of the current state into mask (cleared here). */
static uint32_t compute(tdm_grammar_matcher_t *m, uint32_t *mask)
{
    size_t bytes = (size_t)m->n_words * sizeof *mask;
    memset(mask, 0, bytes);
    m->sp.full = m->sp.oom = m->sp.too_ambiguous = false;
    uint32_t n = walk(m, m->cur, mask);
    if (m->sp.full && tdm_gram_matcher_rebuild(m) == TDM_OK) {
        memset(mask, 0, bytes);
        n = walk(m, m->cur, mask);
    }
    tdm_gram_matcher_note_bounds(m);
    return n + set_eog(m, m->cur, mask);
}

/* A cache slot for the current state's mask (evicting round-robin); NULL when no memory. */
static gram_mask_slot_t *slot_take(tdm_grammar_matcher_t *m)
{
    gram_mask_slot_t *sl = &m->cache[m->next_victim];
    m->next_victim = (m->next_victim + 1) % TDM_GRAMMAR_MASK_CACHE;
    if (!sl->bits && !(sl->bits = malloc((size_t)m->n_words * sizeof *sl->bits)))
        return NULL;
    if (sl->state != UINT32_MAX && sl->state < m->sp.n_states)
        m->sp.states[sl->state].mask_slot = UINT32_MAX;
    sl->state = UINT32_MAX;
    return sl;
}

uint32_t tdm_grammar_matcher_fill_mask(tdm_grammar_matcher_t *m, uint32_t *mask)
{
    size_t bytes = (size_t)m->n_words * sizeof *mask;
    if (m->ended || !m->v) {
        memset(mask, 0, bytes);
        return 0;
    }
    tdm_gram_matcher_maybe_rebuild(m);
    uint32_t slot = m->sp.states[m->cur].mask_slot;
    if (slot != UINT32_MAX) {
        memcpy(mask, m->cache[slot].bits, bytes);
        return m->cache[slot].count;
    }
    uint32_t n = compute(m, mask);
    bool bounded = m->sp.full || m->sp.oom; /* an incomplete walk: do not keep it */
    gram_mask_slot_t *sl = bounded ? NULL : slot_take(m);
    if (sl) {
        memcpy(sl->bits, mask, bytes);
        sl->count = n;
        sl->state = m->cur;
        m->sp.states[m->cur].mask_slot = (uint32_t)(sl - m->cache);
    }
    return n;
}
