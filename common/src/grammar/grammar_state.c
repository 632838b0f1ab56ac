/* grammar_state.c - the matcher's state space: hash-consed parse stacks, hash-consed states
 * (a sorted set of stacks plus a partial UTF-8 character) and memoised byte transitions, so
 * the grammar runs as a DFA built lazily as bytes arrive.
 *
 * A step on a complete code point advances every stack whose top class holds it and expands
 * the results until each top is a class again (llama.cpp's advance_stack): a reference pushes
 * its continuation, unless the reference ends its alternative (a tail call, so `R ::= x R |`
 * repeats without growing the stack), and an alternative's end pops. Each expansion visits a
 * (position, parent) node at most once (a generation stamp), which makes the result a set and
 * stops tail-call cycles. A byte inside a multi-byte character keeps the stacks whose top
 * class meets the range of code points that can still follow.
 *
 * Bounds: a state holds at most TDM_GRAMMAR_MAX_STACKS stacks (more is reported as
 * too_ambiguous and the step treated as leaving the grammar); the tables hold at most
 * GRAM_MAX_NODES / STATES / TRANS / POOL entries; when one is full the operation reports
 * full and the owner rebuilds them from its current state (tdm_gram_space_save/load).
 */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

static uint32_t mix(uint32_t h, uint32_t v)
{
    h ^= v + 0x9E3779B9u + (h << 6) + (h >> 2);
    return h;
}

static uint32_t fmix(uint32_t h)
{
    h ^= h >> 16;
    h *= 0x85EBCA6Bu;
    h ^= h >> 13;
    h *= 0xC2B2AE35u;
    h ^= h >> 16;
    return h;
}

void tdm_gram_space_clear(gram_space_t *sp)
{
    sp->n_nodes = 1; /* node 0: the empty stack */
    sp->nodes[0].pos = UINT32_MAX;
    sp->nodes[0].parent = 0;
    memset(sp->node_hash, 0, (size_t)sp->node_hash_cap * sizeof *sp->node_hash);
    sp->n_states = 0;
    memset(sp->state_hash, 0, (size_t)sp->state_hash_cap * sizeof *sp->state_hash);
    sp->n_pool = 0;
    sp->n_trans = 0;
    sp->n_rows = sp->next_row = 0;
    memset(sp->trans, 0, (size_t)sp->trans_cap * sizeof *sp->trans);
    sp->full = sp->too_ambiguous = sp->oom = false;
}

int tdm_gram_space_init(gram_space_t *sp, const tdm_grammar_t *g)
{
    memset(sp, 0, sizeof *sp);
    sp->g = g;
    sp->node_hash_cap = 1024;
    sp->state_hash_cap = 256;
    sp->trans_cap = 1024;
    sp->node_hash = calloc(sp->node_hash_cap, sizeof *sp->node_hash);
    sp->state_hash = calloc(sp->state_hash_cap, sizeof *sp->state_hash);
    sp->trans = calloc(sp->trans_cap, sizeof *sp->trans);
    if (!sp->node_hash || !sp->state_hash || !sp->trans ||
        !tdm_gram_grow((void **)&sp->nodes, &sp->cap_nodes, 256, sizeof *sp->nodes) ||
        !(sp->stamp = calloc(sp->cap_nodes, sizeof *sp->stamp))) {
        tdm_gram_space_free(sp);
        return TDM_ERESOURCE;
    }
    tdm_gram_space_clear(sp);
    return TDM_OK;
}

void tdm_gram_space_free(gram_space_t *sp)
{
    free(sp->nodes);
    free(sp->stamp);
    free(sp->node_hash);
    free(sp->states);
    free(sp->state_hash);
    free(sp->set_pool);
    free(sp->trans);
    free(sp->rows);
    free(sp->row_owner);
    free(sp->work);
    free(sp->out);
    memset(sp, 0, sizeof *sp);
}

/* ---- nodes ---- */

static uint32_t node_slot_hash(uint32_t pos, uint32_t parent)
{
    return fmix(mix(pos * 0x9E3779B1u, parent));
}

static bool node_rehash(gram_space_t *sp, uint32_t cap)
{
    uint32_t *h = calloc(cap, sizeof *h);
    if (!h)
        return false;
    for (uint32_t id = 1; id < sp->n_nodes; id++) {
        uint32_t i = node_slot_hash(sp->nodes[id].pos, sp->nodes[id].parent) & (cap - 1);
        while (h[i])
            i = (i + 1) & (cap - 1);
        h[i] = id + 1;
    }
    free(sp->node_hash);
    sp->node_hash = h;
    sp->node_hash_cap = cap;
    return true;
}

/* The id of stack (pos, parent), added when new; UINT32_MAX when full or out of memory. */
static uint32_t node_intern(gram_space_t *sp, uint32_t pos, uint32_t parent)
{
    uint32_t mask = sp->node_hash_cap - 1;
    uint32_t i = node_slot_hash(pos, parent) & mask;
    for (uint32_t v; (v = sp->node_hash[i]) != 0; i = (i + 1) & mask)
        if (sp->nodes[v - 1].pos == pos && sp->nodes[v - 1].parent == parent)
            return v - 1;
    if (sp->n_nodes >= GRAM_MAX_NODES) {
        sp->full = true;
        return UINT32_MAX;
    }
    uint32_t old_cap = sp->cap_nodes;
    if (!tdm_gram_grow((void **)&sp->nodes, &sp->cap_nodes, sp->n_nodes + 1, sizeof *sp->nodes))
        goto out_oom;
    if (sp->cap_nodes != old_cap) {
        uint32_t *st = realloc(sp->stamp, (size_t)sp->cap_nodes * sizeof *st);
        if (!st)
            goto out_oom;
        memset(st + old_cap, 0, (size_t)(sp->cap_nodes - old_cap) * sizeof *st);
        sp->stamp = st;
    }
    uint32_t id = sp->n_nodes++;
    sp->nodes[id].pos = pos;
    sp->nodes[id].parent = parent;
    sp->stamp[id] = 0;
    sp->node_hash[i] = id + 1;
    if (2 * sp->n_nodes > sp->node_hash_cap && !node_rehash(sp, 2 * sp->node_hash_cap))
        goto out_oom;
    return id;
out_oom:
    sp->oom = true;
    return UINT32_MAX;
}

/* ---- states ---- */

static uint32_t set_hash(const uint32_t *ids, uint32_t n, uint32_t utf8)
{
    uint32_t h = utf8 * 0x9E3779B1u + n;
    for (uint32_t i = 0; i < n; i++)
        h = mix(h, ids[i]);
    return fmix(h);
}

static bool state_rehash(gram_space_t *sp, uint32_t cap)
{
    uint32_t *h = calloc(cap, sizeof *h);
    if (!h)
        return false;
    for (uint32_t s = 0; s < sp->n_states; s++) {
        uint32_t i = sp->states[s].hash & (cap - 1);
        while (h[i])
            i = (i + 1) & (cap - 1);
        h[i] = s + 1;
    }
    free(sp->state_hash);
    sp->state_hash = h;
    sp->state_hash_cap = cap;
    return true;
}

/* The id of the state (ids[n] sorted, utf8), added when new; GRAM_DEAD when full or OOM. */
static uint32_t state_intern(gram_space_t *sp, const uint32_t *ids, uint32_t n, uint32_t utf8)
{
    uint32_t h = set_hash(ids, n, utf8), mask = sp->state_hash_cap - 1;
    uint32_t i = h & mask;
    for (uint32_t v; (v = sp->state_hash[i]) != 0; i = (i + 1) & mask) {
        const gram_state_t *s = &sp->states[v - 1];
        if (s->hash == h && s->utf8 == utf8 && s->set_len == n &&
            memcmp(sp->set_pool + s->set_off, ids, n * sizeof *ids) == 0)
            return v - 1;
    }
    if (sp->n_states >= GRAM_MAX_STATES || sp->n_pool + n > GRAM_MAX_POOL) {
        sp->full = true;
        return GRAM_DEAD;
    }
    if (!tdm_gram_grow((void **)&sp->states, &sp->cap_states, sp->n_states + 1,
                       sizeof *sp->states) ||
        !tdm_gram_grow((void **)&sp->set_pool, &sp->cap_pool, sp->n_pool + n,
                       sizeof *sp->set_pool)) {
        sp->oom = true;
        return GRAM_DEAD;
    }
    uint32_t id = sp->n_states++;
    gram_state_t *s = &sp->states[id];
    memset(s, 0, sizeof *s);
    s->set_off = sp->n_pool;
    s->set_len = n;
    s->utf8 = utf8;
    s->hash = h;
    s->mask_slot = UINT32_MAX;
    s->row = UINT32_MAX;
    memcpy(sp->set_pool + sp->n_pool, ids, n * sizeof *ids);
    sp->n_pool += n;
    sp->state_hash[i] = id + 1;
    if (2 * sp->n_states > sp->state_hash_cap && !state_rehash(sp, 2 * sp->state_hash_cap)) {
        sp->oom = true;
        return GRAM_DEAD;
    }
    return id;
}

/* ---- expansion ---- */

static bool push(uint32_t **arr, uint32_t *n, uint32_t *cap, uint32_t v)
{
    if (!tdm_gram_grow((void **)arr, cap, *n + 1, sizeof **arr))
        return false;
    (*arr)[(*n)++] = v;
    return true;
}

static void next_generation(gram_space_t *sp)
{
    if (++sp->gen == 0) {
        memset(sp->stamp, 0, (size_t)sp->cap_nodes * sizeof *sp->stamp);
        sp->gen = 1;
    }
    sp->n_work = sp->n_out = 0;
}

/* Pushes the stacks for every alternative of rule r, continuing with cont. */
static bool push_alternatives(gram_space_t *sp, uint32_t r, uint32_t cont)
{
    const tdm_grammar_t *g = sp->g;
    for (uint32_t k = g->alt_off[r]; k < g->alt_off[r + 1]; k++) {
        uint32_t id = node_intern(sp, g->alts[k], cont);
        if (id == UINT32_MAX || !push(&sp->work, &sp->n_work, &sp->cap_work, id))
            return false;
    }
    return true;
}

/* Expands the work list until every stack's top is a class (or the stack is empty); the
 * results go to sp->out, each once. False when a table is full or memory ran out. */
static bool expand(gram_space_t *sp)
{
    const uint32_t *e = sp->g->elems;
    while (sp->n_work > 0) {
        uint32_t id = sp->work[--sp->n_work];
        if (sp->stamp[id] == sp->gen)
            continue;
        sp->stamp[id] = sp->gen;
        if (id == 0) {
            if (!push(&sp->out, &sp->n_out, &sp->cap_out, 0))
                return false;
            continue;
        }
        gram_node_t nd = sp->nodes[id];
        uint32_t el = e[nd.pos];
        if (GRAM_TYPE(el) == GRAM_CLASS) {
            if (!push(&sp->out, &sp->n_out, &sp->cap_out, id))
                return false;
        } else if (GRAM_IS_STOP(el)) {
            if (!push(&sp->work, &sp->n_work, &sp->cap_work, nd.parent))
                return false;
        } else {
            uint32_t cont =
                GRAM_IS_STOP(e[nd.pos + 1]) ? nd.parent : node_intern(sp, nd.pos + 1, nd.parent);
            if (cont == UINT32_MAX || !push_alternatives(sp, GRAM_VALUE(el), cont))
                return false;
        }
    }
    return true;
}

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* Interns sp->out (sorted here) as a state with partial character utf8. */
static uint32_t finish(gram_space_t *sp, uint32_t utf8)
{
    if (sp->n_out == 0)
        return GRAM_DEAD;
    if (sp->n_out > TDM_GRAMMAR_MAX_STACKS) {
        sp->too_ambiguous = true;
        return GRAM_DEAD;
    }
    uint32_t *o = sp->out, n = sp->n_out;
    if (n <= 16) {
        for (uint32_t i = 1; i < n; i++)
            for (uint32_t j = i; j > 0 && o[j - 1] > o[j]; j--) {
                uint32_t t = o[j];
                o[j] = o[j - 1];
                o[j - 1] = t;
            }
    } else {
        qsort(o, n, sizeof *o, cmp_u32);
    }
    return state_intern(sp, o, n, utf8);
}

uint32_t tdm_gram_space_start(gram_space_t *sp)
{
    next_generation(sp);
    if (!push_alternatives(sp, sp->g->root, 0) || !expand(sp))
        return GRAM_DEAD;
    return finish(sp, 0);
}

/* Advances state s over the complete code point cp. */
/* Advances state s over the complete code point cp; cp GRAM_ANY_CP advances every stack (a
 * GRAM_UTF8_ANY state keeps only stacks whose classes hold every code point left). */
#define GRAM_ANY_CP UINT32_MAX
static uint32_t advance(gram_space_t *sp, uint32_t s, uint32_t cp)
{
    const tdm_grammar_t *g = sp->g;
    next_generation(sp);
    uint32_t off = sp->states[s].set_off, n = sp->states[s].set_len;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = sp->set_pool[off + i];
        if (id == 0)
            continue;
        gram_node_t nd = sp->nodes[id];
        if (cp != GRAM_ANY_CP && !tdm_gram_class_has(g, GRAM_VALUE(g->elems[nd.pos]), cp))
            continue;
        uint32_t next = node_intern(sp, nd.pos + 1, nd.parent);
        if (next == UINT32_MAX || !push(&sp->work, &sp->n_work, &sp->cap_work, next))
            return GRAM_DEAD;
    }
    if (!expand(sp))
        return GRAM_DEAD;
    return finish(sp, 0);
}

/* True when every continuation byte (80..BF) is valid UTF-8 for the rest of this character:
 * all but the second byte after E0, ED, F0 and F4 (overlongs, surrogates, > U+10FFFF). */
static bool any_continuation(uint32_t val, uint32_t rem, uint32_t full_len)
{
    if (rem != full_len - 1)
        return true;
    if (full_len == 3)
        return val != 0x0 && val != 0xD;
    return full_len != 4 || (val != 0 && val != 4);
}

/* Keeps the stacks of s whose top class meets [lo, hi] (a character still incomplete). When
 * every kept class holds all of [lo, hi] and any continuation is valid, the exact value no
 * longer matters: the state becomes GRAM_UTF8_ANY with rem bytes to go, so the many
 * characters a class like [^"] allows share their partial states. */
static uint32_t narrow(gram_space_t *sp, uint32_t s, uint32_t lo, uint32_t hi, uint32_t val,
                       uint32_t rem, uint32_t len)
{
    const tdm_grammar_t *g = sp->g;
    next_generation(sp);
    uint32_t off = sp->states[s].set_off, n = sp->states[s].set_len;
    bool covered = any_continuation(val, rem, len ? len : 4);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t id = sp->set_pool[off + i];
        if (id == 0)
            continue;
        uint32_t c = GRAM_VALUE(g->elems[sp->nodes[id].pos]);
        if (!tdm_gram_class_meets(g, c, lo, hi))
            continue;
        covered = covered && tdm_gram_class_covers(g, c, lo, hi);
        if (!push(&sp->out, &sp->n_out, &sp->cap_out, id))
            return GRAM_DEAD;
    }
    return finish(sp, covered ? GRAM_UTF8_ANY | rem << 21 : val | rem << 21 | len << 23 | 1u << 25);
}

/* A GRAM_UTF8_ANY state one continuation byte further: the same stacks. */
static uint32_t narrow_any(gram_space_t *sp, uint32_t s, uint32_t rem)
{
    next_generation(sp);
    uint32_t off = sp->states[s].set_off, n = sp->states[s].set_len;
    for (uint32_t i = 0; i < n; i++)
        if (!push(&sp->out, &sp->n_out, &sp->cap_out, sp->set_pool[off + i]))
            return GRAM_DEAD;
    return finish(sp, GRAM_UTF8_ANY | rem << 21);
}

static const uint32_t utf8_min[5] = {0, 0, 0x80, 0x800, 0x10000};

/* The transition, computed: UTF-8 decoding, then advance or narrow. */
static uint32_t compute_step(gram_space_t *sp, uint32_t s, uint8_t b)
{
    uint32_t u = sp->states[s].utf8;
    uint32_t val = u & 0x1FFFFFu, rem = (u >> 21) & 3u, len = (u >> 23) & 3u;
    if (rem == 0) {
        if (b < 0x80)
            return advance(sp, s, b);
        if (b >= 0xC2 && b <= 0xDF)
            val = b & 0x1Fu, rem = 1, len = 2;
        else if (b >= 0xE0 && b <= 0xEF)
            val = b & 0x0Fu, rem = 2, len = 3;
        else if (b >= 0xF0 && b <= 0xF4)
            val = b & 0x07u, rem = 3, len = 0; /* len 4 does not fit 2 bits: 0 stands for 4 */
        else
            return GRAM_DEAD;
    } else {
        if ((b & 0xC0) != 0x80)
            return GRAM_DEAD;
        if (u & GRAM_UTF8_ANY) /* every stack takes whatever character this is */
            return rem == 1 ? advance(sp, s, GRAM_ANY_CP) : narrow_any(sp, s, rem - 1);
        val = val << 6 | (b & 0x3Fu);
        rem--;
    }
    uint32_t full_len = len ? len : 4;
    if (rem == 0) {
        if (val < utf8_min[full_len] || val > GRAM_MAX_CP || (val >= 0xD800 && val <= 0xDFFF))
            return GRAM_DEAD;
        return advance(sp, s, val);
    }
    uint32_t lo = val << (6 * rem), hi = lo | ((1u << (6 * rem)) - 1);
    if (lo < utf8_min[full_len])
        lo = utf8_min[full_len];
    if (hi > GRAM_MAX_CP)
        hi = GRAM_MAX_CP;
    if (lo > hi || (lo >= 0xD800 && hi <= 0xDFFF))
        return GRAM_DEAD;
    return narrow(sp, s, lo, hi, val, rem, len);
}

/* ---- transitions ---- */

static bool trans_rehash(gram_space_t *sp, uint32_t cap)
{
    uint64_t *t = calloc(cap, sizeof *t);
    if (!t)
        return false;
    for (uint32_t i = 0; i < sp->trans_cap; i++) {
        uint64_t v = sp->trans[i];
        if (!v)
            continue;
        uint32_t j = fmix((uint32_t)(v >> 32)) & (cap - 1);
        while (t[j])
            j = (j + 1) & (cap - 1);
        t[j] = v;
    }
    free(sp->trans);
    sp->trans = t;
    sp->trans_cap = cap;
    return true;
}

/* Gives state s a dense row: a new one while fewer than GRAM_MAX_ROWS exist, else the
 * row of the state that took one longest ago (round robin; that state's transitions are
 * recomputed if it comes back). Rows are an accelerator for the states in use now. */
static void row_take(gram_space_t *sp, uint32_t s)
{
    uint32_t r;
    if (sp->n_rows < GRAM_MAX_ROWS) {
        if (!tdm_gram_grow((void **)&sp->rows, &sp->cap_rows, (sp->n_rows + 1) * 256,
                           sizeof *sp->rows) ||
            !tdm_gram_grow((void **)&sp->row_owner, &sp->cap_owner, sp->n_rows + 1,
                           sizeof *sp->row_owner))
            return;
        r = sp->n_rows++;
    } else {
        r = sp->next_row++ % GRAM_MAX_ROWS;
        sp->states[sp->row_owner[r]].row = UINT32_MAX;
    }
    uint32_t *row = sp->rows + (size_t)r * 256;
    for (int i = 0; i < 256; i++)
        row[i] = GRAM_UNKNOWN;
    sp->row_owner[r] = s;
    sp->states[s].row = r;
}

/* Stores next as the transition of s on b, and on every ASCII byte that no stack of s tells
 * apart from b: the successor of a complete character depends only on which stacks' top
 * classes hold it, so those bytes share it (one step computed fills a whole group). */
static void row_fill(gram_space_t *sp, uint32_t s, uint32_t r, uint8_t b, uint32_t next)
{
    uint32_t *row = sp->rows + (size_t)r * 256;
    row[b] = next;
    const gram_state_t *st = &sp->states[s];
    if ((st->utf8 & GRAM_UTF8_ANY) && b >= 0x80 && b <= 0xBF) {
        for (uint32_t c = 0x80; c <= 0xBF; c++)
            row[c] = next;
        return;
    }
    if (b >= 0x80 || st->utf8 != 0)
        return;
    const tdm_grammar_t *g = sp->g;
    uint32_t eq[4] = {~0u, ~0u, ~0u, ~0u};
    for (uint32_t i = 0; i < st->set_len; i++) {
        uint32_t id = sp->set_pool[st->set_off + i];
        if (id == 0)
            continue;
        const uint32_t *a = g->class_ascii[GRAM_VALUE(g->elems[sp->nodes[id].pos])];
        bool in = (a[b >> 5] >> (b & 31)) & 1u;
        for (int w = 0; w < 4; w++)
            eq[w] &= in ? a[w] : ~a[w];
    }
    for (uint32_t c = 0; c < 128; c++)
        if ((eq[c >> 5] >> (c & 31)) & 1u)
            row[c] = next;
}

/* Looks up (s, b) in the hash table: the next state, or GRAM_UNKNOWN. */
static uint32_t trans_find(const gram_space_t *sp, uint32_t key)
{
    uint32_t mask = sp->trans_cap - 1, i = fmix(key) & mask;
    for (uint64_t v; (v = sp->trans[i]) != 0; i = (i + 1) & mask)
        if ((uint32_t)(v >> 32) == key)
            return (uint32_t)v;
    return GRAM_UNKNOWN;
}

static void trans_put(gram_space_t *sp, uint32_t key, uint32_t next)
{
    if (sp->n_trans >= GRAM_MAX_TRANS) {
        sp->full = true;
        return;
    }
    uint32_t mask = sp->trans_cap - 1, i = fmix(key) & mask;
    while (sp->trans[i])
        i = (i + 1) & mask;
    sp->trans[i] = (uint64_t)key << 32 | next;
    sp->n_trans++;
    if (2 * sp->n_trans > sp->trans_cap && !trans_rehash(sp, 2 * sp->trans_cap))
        sp->oom = true;
}

uint32_t tdm_gram_space_step(gram_space_t *sp, uint32_t s, uint8_t b)
{
    uint32_t key = (s << 8 | b) + 1;
    if (sp->states[s].row == UINT32_MAX) {
        uint32_t v = trans_find(sp, key);
        if (v != GRAM_UNKNOWN)
            return v;
        row_take(sp, s);
    } else {
        uint32_t v = sp->rows[(size_t)sp->states[s].row * 256 + b];
        if (v != GRAM_UNKNOWN)
            return v;
    }
    bool full = sp->full, oom = sp->oom, amb = sp->too_ambiguous;
    sp->full = sp->oom = sp->too_ambiguous = false;
    uint32_t next = compute_step(sp, s, b);
    bool transient = sp->full || sp->oom || sp->too_ambiguous;
    sp->full |= full;
    sp->oom |= oom;
    sp->too_ambiguous |= amb;
    if (transient)
        return next; /* a bound, not a property of the grammar: do not memoise */
    uint32_t r = sp->states[s].row;
    if (r != UINT32_MAX)
        row_fill(sp, s, r, b, next);
    else
        trans_put(sp, key, next);
    return next;
}

bool tdm_gram_space_accepting(const gram_space_t *sp, uint32_t s)
{
    const gram_state_t *st = &sp->states[s];
    return st->utf8 == 0 && st->set_len > 0 && sp->set_pool[st->set_off] == 0;
}

bool tdm_gram_space_done(const gram_space_t *sp, uint32_t s)
{
    return tdm_gram_space_accepting(sp, s) && sp->states[s].set_len == 1;
}

/* Computes B(s) and next(s) (see grammar_internal.h). */
static void uniform(gram_space_t *sp, uint32_t s)
{
    if (sp->states[s].uni_ok)
        return;
    uint32_t next[128], best = GRAM_DEAD, best_n = 0;
    for (uint32_t b = 0; b < 128; b++)
        next[b] = tdm_gram_space_step(sp, s, (uint8_t)b);
    for (uint32_t b = 0; b < 128; b++) { /* the successor of most bytes (few distinct ones) */
        if (next[b] == GRAM_DEAD || next[b] == best)
            continue;
        uint32_t n = 0;
        for (uint32_t c = b; c < 128; c++)
            n += next[c] == next[b];
        if (n > best_n)
            best = next[b], best_n = n;
        if (best_n >= 64)
            break;
    }
    gram_state_t *st = &sp->states[s];
    memset(st->uni, 0, sizeof st->uni);
    st->uni_next = best_n >= 8 ? best : GRAM_DEAD;
    for (uint32_t b = 0; b < 128 && st->uni_next != GRAM_DEAD; b++)
        if (next[b] == best)
            st->uni[b >> 5] |= 1u << (b & 31);
    st->uni_ok = 1;
}

static bool contains(const uint32_t *a, const uint32_t *b) /* a holds every bit of b */
{
    return !(b[0] & ~a[0]) && !(b[1] & ~a[1]) && !(b[2] & ~a[2]) && !(b[3] & ~a[3]);
}

uint16_t tdm_gram_space_cover(gram_space_t *sp, uint32_t s)
{
    if (sp->states[s].cover_ok)
        return sp->states[s].cover;
    uniform(sp, s);
    uint16_t cover = 0;
    uint32_t t = s, prev = GRAM_DEAD;
    while (cover < GRAM_COVER_SCAN && t != GRAM_DEAD) {
        uniform(sp, t);
        const gram_state_t *ts = &sp->states[t];
        if (ts->uni_next == GRAM_DEAD || !contains(ts->uni, sp->states[s].uni))
            break;
        if (t == prev) { /* a loop whose bytes hold B(s): any length */
            cover = GRAM_COVER_INF;
            break;
        }
        cover++;
        prev = t;
        t = ts->uni_next;
    }
    sp->states[s].cover = cover;
    sp->states[s].cover_ok = 1;
    return cover;
}

/* ---- save and load (rebuilding the tables around one state) ---- */

int tdm_gram_space_save(const gram_space_t *sp, uint32_t s, gram_saved_t *out)
{
    const gram_state_t *st = &sp->states[s];
    out->n = 0;
    out->utf8 = st->utf8;
    for (uint32_t i = 0; i < st->set_len; i++) {
        for (uint32_t id = sp->set_pool[st->set_off + i]; id != 0; id = sp->nodes[id].parent)
            if (!push(&out->pos, &out->n, &out->cap, sp->nodes[id].pos))
                return TDM_ERESOURCE;
        if (!push(&out->pos, &out->n, &out->cap, UINT32_MAX))
            return TDM_ERESOURCE;
    }
    return TDM_OK;
}

uint32_t tdm_gram_space_load(gram_space_t *sp, const gram_saved_t *in)
{
    next_generation(sp);
    for (uint32_t i = 0; i < in->n;) {
        uint32_t end = i;
        while (in->pos[end] != UINT32_MAX)
            end++;
        uint32_t id = 0;
        for (uint32_t k = end; k > i; k--)
            if ((id = node_intern(sp, in->pos[k - 1], id)) == UINT32_MAX)
                return GRAM_DEAD;
        if (!push(&sp->out, &sp->n_out, &sp->cap_out, id))
            return GRAM_DEAD;
        i = end + 1;
    }
    return finish(sp, in->utf8);
}
