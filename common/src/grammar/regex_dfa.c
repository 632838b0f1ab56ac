/* regex_dfa.c - regexes (regex.c's subset, JSON Schema's search semantics) as deterministic
 * automata over code points, and those automata written back as GBNF over JSON string
 * content: what patternProperties needs (which patterns a key matches, the keys matching none)
 * and what a length bound beside a pattern needs (the automaton times a counter).
 *
 * Thompson's construction (one NFA for all the patterns and names, each final state tagged with
 * its pattern's bit), then the subset construction over the elementary intervals of code points
 * that the NFA's classes cut [0, 0x10FFFF] into. A {m,n} repetition copies its atom by reading
 * it again. Bounds: NFA_MAX_STATES NFA states and DFA_MAX_STATES DFA states; past them the
 * pattern is refused ("automaton too large"), never weakened.
 */
#include <stdlib.h>
#include <string.h>

#include "regex_internal.h"

#define NFA_MAX_STATES 60000u
#define DFA_MAX_STATES 20000u
_Static_assert(NFA_MAX_STATES <= 65536u, "sort_u32 sorts NFA state numbers as 16 bits");
#define PROD_MAX_STATES (1u << 20) /* automaton states times counter values */
#define EMIT_MAX_RULES 20000u      /* rules js_dfa_emit writes for one string */

typedef struct nfa {
    uint32_t n, cap;
    uint32_t *tag;             /* [n] accept bits */
    int32_t *chr_to;           /* [n] target of the character edge, -1: none */
    uint32_t *set_off, *set_n; /* [n] the edge's ranges in rng */
    uint32_t (*eps)[3];        /* [n_eps] epsilon edges (from, to) */
    uint32_t n_eps, cap_eps;
    uint32_t (*rng)[2]; /* [n_rng] code point ranges (lo, hi) */
    uint32_t n_rng, cap_rng;
    bool oom, big;
} nfa_t;

typedef struct frag {
    uint32_t s, e; /* start and end states */
} frag_t;

struct js_dfa {
    uint32_t n;      /* states; state 0 is the start */
    uint32_t m;      /* elementary intervals */
    uint32_t *lo;    /* [m] first code point of each interval */
    uint32_t *trans; /* [n][m] next state */
    uint32_t *tag;   /* [n] accept bits */
    bool kept;       /* owned by a compile's memo (js_dfa_get), not by its caller */
};

/* ---- the NFA ---- */

static bool grow(void **p, uint32_t *cap, uint32_t need, size_t elem)
{
    if (need <= *cap)
        return true;
    uint32_t nc = *cap ? *cap * 2 : 64;
    while (nc < need)
        nc *= 2;
    void *q = realloc(*p, (size_t)nc * elem);
    if (!q)
        return false;
    *p = q;
    *cap = nc;
    return true;
}

static uint32_t nfa_state(nfa_t *a)
{
    if (a->n >= NFA_MAX_STATES) {
        a->big = true;
        return 0;
    }
    if (a->n == a->cap) {
        uint32_t nc = a->cap ? a->cap * 2 : 256;
        uint32_t *t = realloc(a->tag, nc * sizeof *t);
        a->tag = t ? t : a->tag;
        int32_t *c = t ? realloc(a->chr_to, nc * sizeof *c) : NULL;
        a->chr_to = c ? c : a->chr_to;
        uint32_t *o = c ? realloc(a->set_off, nc * sizeof *o) : NULL;
        a->set_off = o ? o : a->set_off;
        uint32_t *k = o ? realloc(a->set_n, nc * sizeof *k) : NULL;
        a->set_n = k ? k : a->set_n;
        if (!k) {
            a->oom = true;
            return 0;
        }
        a->cap = nc;
    }
    a->tag[a->n] = 0;
    a->chr_to[a->n] = -1;
    a->set_off[a->n] = a->set_n[a->n] = 0;
    return a->n++;
}

/* Epsilon edges: plain, or asserting the start (^) or the end ($) of the text. */
enum { EPS_PLAIN = 0, EPS_BEGIN = 1, EPS_END = 2 };

static void nfa_eps_if(nfa_t *a, uint32_t from, uint32_t to, uint32_t cond)
{
    if (a->oom || a->big)
        return;
    if (!grow((void **)&a->eps, &a->cap_eps, a->n_eps + 1, sizeof *a->eps)) {
        a->oom = true;
        return;
    }
    a->eps[a->n_eps][0] = from;
    a->eps[a->n_eps][1] = to;
    a->eps[a->n_eps][2] = cond;
    a->n_eps++;
}

static void nfa_eps(nfa_t *a, uint32_t from, uint32_t to)
{
    nfa_eps_if(a, from, to, EPS_PLAIN);
}

/* A fragment s --set--> e. */
static frag_t nfa_chr(nfa_t *a, const cpset_t *set)
{
    frag_t f = {nfa_state(a), nfa_state(a)};
    if (a->oom || a->big)
        return f;
    if (!grow((void **)&a->rng, &a->cap_rng, a->n_rng + (uint32_t)set->n, sizeof *a->rng)) {
        a->oom = true;
        return f;
    }
    a->chr_to[f.s] = (int32_t)f.e;
    a->set_off[f.s] = a->n_rng;
    a->set_n[f.s] = (uint32_t)set->n;
    for (size_t i = 0; i < set->n; i++) {
        a->rng[a->n_rng][0] = set->lo[i];
        a->rng[a->n_rng][1] = set->hi[i];
        a->n_rng++;
    }
    return f;
}

static frag_t nfa_any_loop(nfa_t *a)
{
    cpset_t all;
    all.n = 1;
    all.lo[0] = 0;
    all.hi[0] = CP_MAX;
    frag_t f = nfa_chr(a, &all);
    nfa_eps(a, f.e, f.s);
    f.e = f.s;
    return f;
}

/* ---- reading the regex into the NFA ---- */

#define B_STOP 1 /* a bound of the NFA was hit (a->big / a->oom say which) */

typedef struct build {
    rx_t *r;
    nfa_t *a;
} build_t;

static int b_alt(build_t *b, frag_t *f, bool top);

static int b_group(build_t *b, frag_t *f)
{
    rx_t *r = b->r;
    int rc0 = js_rx_group_open(r);
    if (rc0 != 0)
        return rc0;
    int rc = b_alt(b, f, false);
    r->depth--;
    if (rc != 0)
        return rc;
    if (js_rx_peek(r) != ')')
        return js_rx_fail(r, "missing )");
    r->i++;
    return 0;
}

static int b_atom(build_t *b, frag_t *f)
{
    rx_t *r = b->r;
    uint32_t ch = js_rx_peek(r);
    cpset_t s;
    s.n = 0;
    if (ch == '(') {
        r->i++;
        return b_group(b, f);
    }
    if (ch == '*' || ch == '+' || ch == '?' || ch == '{')
        return js_rx_fail(r, "nothing to repeat");
    r->i++;
    if (ch == '^' || ch == '$') { /* an assertion: passable only at the start / the end */
        f->s = nfa_state(b->a);
        f->e = nfa_state(b->a);
        nfa_eps_if(b->a, f->s, f->e, ch == '^' ? EPS_BEGIN : EPS_END);
        return 0;
    }
    if (ch == '[') {
        int rc = js_rx_class(r, &s);
        if (rc != 0)
            return rc;
    } else if (ch == '.') {
        js_cpset_add(&s, 0, CP_MAX);
        js_cpset_remove(&s, '\n', '\n');
    } else {
        uint32_t cp = ch;
        bool is_class = false;
        int rc =
            ch == '\\' ? js_rx_escape(r, false, &cp, &s, &is_class) : (r->i--, js_rx_char(r, &cp));
        if (rc != 0)
            return rc;
        if (!is_class)
            js_cpset_add(&s, cp, cp);
        js_cpset_normalize(&s);
    }
    *f = nfa_chr(b->a, &s);
    return 0;
}

static int b_quant(rx_t *r, size_t *lo, size_t *hi)
{
    uint32_t ch = js_rx_peek(r);
    *lo = *hi = 1;
    if (ch == '*' || ch == '+' || ch == '?') {
        r->i++;
        *lo = ch == '+';
        *hi = ch == '?' ? 1 : JS_LEN_INF;
    } else if (ch == '{') {
        r->i++;
        if (!js_rx_number(r, lo))
            return js_rx_fail(r, "bad {m,n} quantifier");
        *hi = *lo;
        if (js_rx_peek(r) == ',') {
            r->i++;
            *hi = js_rx_number(r, hi) ? *hi : JS_LEN_INF;
        }
        if (js_rx_peek(r) != '}' || *hi < *lo)
            return js_rx_fail(r, "bad {m,n} quantifier");
        r->i++;
    } else {
        return 0;
    }
    if (js_rx_peek(r) == '?')
        r->i++; /* lazy: same strings */
    else if (js_rx_peek(r) == '+')
        return js_rx_fail(r, "possessive quantifiers not supported");
    if (js_rx_peek(r) == '*' || js_rx_peek(r) == '+' || js_rx_peek(r) == '?' ||
        js_rx_peek(r) == '{')
        return js_rx_fail(r, "nothing to repeat");
    return 0;
}

/* A copy of the atom at offset at (read again), appended to *f (f->e the end so far). */
static int b_again(build_t *b, size_t at, frag_t *f, bool optional)
{
    size_t save = b->r->i;
    b->r->i = at;
    frag_t g;
    int rc = b_atom(b, &g);
    b->r->i = save;
    if (rc != 0)
        return rc;
    nfa_eps(b->a, f->e, g.s);
    if (optional)
        nfa_eps(b->a, f->e, g.e);
    f->e = g.e;
    return b->a->big || b->a->oom ? B_STOP : 0;
}

/* An atom and its quantifier: lo copies, then hi - lo optional ones or a loop. */
static int b_piece(build_t *b, frag_t *f)
{
    rx_t *r = b->r;
    size_t at = r->i, lo, hi;
    frag_t g;
    int rc = b_atom(b, &g);
    rc = rc ? rc : b_quant(r, &lo, &hi);
    if (rc != 0)
        return rc;
    f->s = f->e = nfa_state(b->a);
    if (lo == 1 && hi == 1) {
        nfa_eps(b->a, f->e, g.s);
        f->e = g.e;
        return 0;
    }
    for (size_t k = 0; k < lo && rc == 0; k++)
        rc = b_again(b, at, f, false);
    if (rc == 0 && hi == JS_LEN_INF) {
        uint32_t loop = f->e;
        rc = b_again(b, at, f, false);
        nfa_eps(b->a, f->e, loop);
        f->e = loop;
    }
    for (size_t k = lo; hi != JS_LEN_INF && k < hi && rc == 0; k++)
        rc = b_again(b, at, f, true);
    return rc == B_STOP ? 0 : rc; /* the caller sees a->big */
}

/* A sequence up to '|', ')' or the end; at the top, anchors at its ends and, where there is
 * none, any text there (search semantics). */
static int b_seq(build_t *b, frag_t *f, bool top)
{
    rx_t *r = b->r;
    bool at_start = false, at_end = false;
    if (top && js_rx_peek(r) == '^') {
        r->i++;
        at_start = true;
    }
    f->s = f->e = nfa_state(b->a);
    if (top && !at_start) {
        frag_t any = nfa_any_loop(b->a);
        nfa_eps(b->a, f->e, any.s);
        f->e = any.e;
    }
    while (!js_rx_eof(r) && js_rx_peek(r) != '|' && js_rx_peek(r) != ')') {
        if (top && js_rx_peek(r) == '$' && (r->i + 1 == r->n || r->s[r->i + 1] == '|')) {
            r->i++;
            at_end = true;
            break;
        }
        frag_t g;
        int rc = b_piece(b, &g);
        if (rc != 0)
            return rc;
        if (b->a->big || b->a->oom)
            return 0;
        nfa_eps(b->a, f->e, g.s);
        f->e = g.e;
    }
    if (top && !at_end) {
        frag_t any = nfa_any_loop(b->a);
        nfa_eps(b->a, f->e, any.s);
        f->e = any.e;
    }
    return 0;
}

static int b_alt(build_t *b, frag_t *f, bool top)
{
    rx_t *r = b->r;
    f->s = nfa_state(b->a);
    f->e = nfa_state(b->a);
    for (;;) {
        frag_t g;
        int rc = b_seq(b, &g, top);
        if (rc != 0)
            return rc;
        nfa_eps(b->a, f->s, g.s);
        nfa_eps(b->a, g.e, f->e);
        if (b->a->big || b->a->oom || js_rx_peek(r) != '|')
            return 0;
        r->i++;
    }
}

/* Pattern re as a fragment from start whose end is tagged bit. */
static int nfa_pattern(nfa_t *a, uint32_t start, const char *re, uint32_t bit, tdm_error_t *err)
{
    rx_t r = {re, strlen(re), 0, true, NULL, err, 0, 0, JS_LEN_INF};
    build_t b = {&r, a};
    frag_t f;
    int rc = b_alt(&b, &f, true);
    if (rc == 0 && !a->big && !a->oom && !js_rx_eof(&r))
        rc = js_rx_fail(&r, "unmatched )");
    if (rc != 0)
        return rc;
    if (a->oom)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    if (a->big)
        return tdm_error_set(err, TDM_EINVALID, "automaton too large (over %u states)",
                             NFA_MAX_STATES);
    nfa_eps(a, start, f.s);
    a->tag[f.e] |= bit;
    return 0;
}

static void nfa_name(nfa_t *a, uint32_t start, const char *s, uint32_t bit)
{
    uint32_t at = nfa_state(a);
    nfa_eps(a, start, at);
    for (size_t i = 0, n = strlen(s); i < n && !a->oom && !a->big;) {
        cpset_t one;
        uint32_t cp;
        size_t k = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (k == 0)
            k = 1, cp = (unsigned char)s[i];
        one.n = 1;
        one.lo[0] = one.hi[0] = cp;
        frag_t f = nfa_chr(a, &one);
        nfa_eps(a, at, f.s);
        at = f.e;
        i += k;
    }
    if (!a->oom && !a->big)
        a->tag[at] |= bit;
}

static void nfa_free(nfa_t *a)
{
    free(a->tag);
    free(a->chr_to);
    free(a->set_off);
    free(a->set_n);
    free(a->eps);
    free(a->rng);
}

/* ---- the subset construction ---- */

#define SEED_MEMO_MAX 40000u /* seed lists remembered */

/* An open-addressing hash table of entry numbers + 1 (0: empty), grown as it fills. */
typedef struct htab {
    uint32_t *slot;
    uint32_t cap; /* a power of two, or 0 */
} htab_t;

typedef struct seed_memo {
    uint32_t off, len; /* the sorted seed list in subset_t.seeds */
    uint32_t state;    /* the DFA state of its closure */
} seed_memo_t;

typedef struct subset {
    const nfa_t *a;
    uint32_t *eoff, *eto;  /* epsilon edges by source: eto[eoff[x] .. eoff[x + 1]) */
    uint8_t *econd;        /* their EPS_* conditions */
    uint32_t *tbuf;        /* [a->n] scratch of the end closures */
    uint32_t *mark, gen;   /* [a->n] closure marks */
    uint32_t *stack, *buf; /* [a->n] scratch */
    uint32_t *pool;        /* the DFA states' NFA state lists, one after another */
    size_t n_pool, cap_pool;
    uint32_t *off, *len;  /* [cap_states] each state's list in pool */
    uint32_t cap_states;  /* room in off, len and the DFA's tag */
    htab_t ht;            /* hash of the lists: state + 1, 0 empty */
    uint32_t (*pairs)[2]; /* (interval, NFA target [| EV_END]) events of one state's edges */
    size_t n_pairs, cap_pairs;
    uint32_t *cnt;         /* [a->n] edges covering the interval the sweep is at, by target */
    uint32_t *act, n_act;  /* [a->n] the targets with cnt > 0 (and some just dropped to 0) */
    uint8_t *in_act;       /* [a->n] in act */
    uint32_t (*sorted)[2]; /* scratch of sort_events */
    size_t cap_sorted;
    uint32_t *kpos;  /* [intervals + 2] scratch of sort_events */
    uint32_t *rtmp;  /* [a->n] scratch of sort_u32 */
    uint32_t *seeds; /* the remembered seed lists, one after another */
    size_t n_seeds, cap_seeds;
    seed_memo_t *memo;
    uint32_t n_memo, cap_memo;
    htab_t memo_ht;    /* hash of the seed lists: memo index + 1, 0 empty */
    uint32_t (*rk)[2]; /* [a->n_rng] each range's first interval and one past its last */
} subset_t;

#define EV_END 0x80000000u /* an event that ends an edge's cover */

/* Sorts v[n] (numbers under 2^bits, bits <= 24) ascending, tmp[n] scratch: nothing when
 * sorted, insertion sort when short, else a byte radix sort (one pass per 8 bits). */
static void sort_u32(uint32_t *v, uint32_t n, uint32_t *tmp, int bits)
{
    uint32_t run = 1;
    while (run < n && v[run - 1] <= v[run])
        run++;
    if (run >= n) /* already sorted (seed lists often are) */
        return;
    if (n <= 32) {
        for (uint32_t i = 1; i < n; i++) {
            uint32_t x = v[i], j = i;
            for (; j > 0 && v[j - 1] > x; j--)
                v[j] = v[j - 1];
            v[j] = x;
        }
        return;
    }
    for (int shift = 0; shift < bits; shift += 8) {
        uint32_t pos[257] = {0};
        for (uint32_t i = 0; i < n; i++)
            pos[(v[i] >> shift & 0xffu) + 1]++;
        for (int b = 0; b < 256; b++)
            pos[b + 1] += pos[b];
        for (uint32_t i = 0; i < n; i++)
            tmp[pos[v[i] >> shift & 0xffu]++] = v[i];
        memcpy(v, tmp, n * sizeof *v);
    }
}

/* The epsilon closure of seeds[n] into out (seeds may be out), in no order; returns its size.
 * Plain edges are followed always, EPS_BEGIN ones when mode has EPS_BEGIN (the start of the
 * text), EPS_END ones when it has EPS_END (the end). */
static uint32_t closure(subset_t *ss, const uint32_t *seeds, uint32_t n, uint32_t mode,
                        uint32_t *out)
{
    uint32_t sp = 0, k = 0;
    ss->gen++;
    for (uint32_t i = 0; i < n; i++) {
        if (ss->mark[seeds[i]] != ss->gen) {
            ss->mark[seeds[i]] = ss->gen;
            ss->stack[sp++] = seeds[i];
        }
    }
    while (sp > 0) {
        uint32_t x = ss->stack[--sp];
        out[k++] = x;
        for (uint32_t e = ss->eoff[x]; e < ss->eoff[x + 1]; e++) {
            uint32_t y = ss->eto[e], cond = ss->econd[e];
            if (ss->mark[y] != ss->gen && (cond == EPS_PLAIN || (mode & cond))) {
                ss->mark[y] = ss->gen;
                ss->stack[sp++] = y;
            }
        }
    }
    return k;
}

static uint32_t hash_list(const uint32_t *v, uint32_t n)
{
    uint32_t h = 2166136261u ^ n;
    for (uint32_t i = 0; i < n; i++)
        h = (h ^ v[i]) * 16777619u;
    return h;
}

/* The key of entry i of a table: its list of numbers, *n long. */
typedef const uint32_t *(*ht_key_fn)(const subset_t *ss, uint32_t i, uint32_t *n);

static const uint32_t *state_key(const subset_t *ss, uint32_t i, uint32_t *n)
{
    *n = ss->len[i];
    return ss->pool + ss->off[i];
}

static const uint32_t *memo_key(const subset_t *ss, uint32_t i, uint32_t *n)
{
    *n = ss->memo[i].len;
    return ss->seeds + ss->memo[i].off;
}

/* Makes room in t (count entries) for one more: past half full the table doubles and its
 * entries are placed again by their keys. 0, or TDM_ERESOURCE. */
static int ht_room(const subset_t *ss, htab_t *t, uint32_t count, ht_key_fn key)
{
    if (((size_t)count + 1) * 2 <= t->cap)
        return 0;
    uint32_t nc = t->cap ? t->cap * 2 : 1024, *slot = calloc(nc, sizeof *slot);
    if (!slot)
        return TDM_ERESOURCE;
    for (uint32_t i = 0; i < count; i++) {
        uint32_t n;
        const uint32_t *k = key(ss, i, &n);
        uint32_t h = hash_list(k, n) & (nc - 1);
        while (slot[h])
            h = (h + 1) & (nc - 1);
        slot[h] = i + 1;
    }
    free(t->slot);
    t->slot = slot;
    t->cap = nc;
    return 0;
}

/* Doubles the room for DFA states (ss->off, ss->len, d->tag). 0, or TDM_ERESOURCE. */
static int grow_states(subset_t *ss, js_dfa_t *d)
{
    size_t nc = ss->cap_states ? (size_t)ss->cap_states * 2 : 64;
    uint32_t *o = realloc(ss->off, nc * sizeof *o);
    ss->off = o ? o : ss->off;
    uint32_t *l = o ? realloc(ss->len, nc * sizeof *l) : NULL;
    ss->len = l ? l : ss->len;
    uint32_t *t = l ? realloc(d->tag, nc * sizeof *t) : NULL;
    d->tag = t ? t : d->tag;
    if (!t)
        return TDM_ERESOURCE;
    ss->cap_states = (uint32_t)nc;
    return 0;
}

/* The DFA state of the list ss->buf[n], added when new. Returns its index, or UINT32_MAX
 * (too many states) / UINT32_MAX - 1 (out of memory). */
static uint32_t intern(subset_t *ss, js_dfa_t *d, uint32_t n)
{
    if (ht_room(ss, &ss->ht, d->n, state_key) != 0)
        return UINT32_MAX - 1;
    uint32_t mask = ss->ht.cap - 1;
    for (uint32_t h = hash_list(ss->buf, n) & mask;; h = (h + 1) & mask) {
        uint32_t st = ss->ht.slot[h];
        if (st == 0) {
            if (d->n >= DFA_MAX_STATES)
                return UINT32_MAX;
            if (d->n == ss->cap_states && grow_states(ss, d) != 0)
                return UINT32_MAX - 1;
            if (ss->n_pool + n > ss->cap_pool) {
                size_t nc = (ss->n_pool + n) * 2 + 1024;
                uint32_t *p = realloc(ss->pool, nc * sizeof *p);
                if (!p)
                    return UINT32_MAX - 1;
                ss->pool = p;
                ss->cap_pool = nc;
            }
            memcpy(ss->pool + ss->n_pool, ss->buf, n * sizeof *ss->buf);
            ss->off[d->n] = (uint32_t)ss->n_pool;
            ss->len[d->n] = n;
            ss->n_pool += n;
            uint32_t tag = 0, m = closure(ss, ss->buf, n, EPS_END | (d->n == 0 ? EPS_BEGIN : 0),
                                          ss->tbuf); /* accepted if the text ends here */
            for (uint32_t i = 0; i < m; i++)
                tag |= ss->a->tag[ss->tbuf[i]];
            d->tag[d->n] = tag;
            ss->ht.slot[h] = d->n + 1;
            return d->n++;
        }
        st--;
        if (ss->len[st] == n && memcmp(ss->pool + ss->off[st], ss->buf, n * sizeof *ss->buf) == 0)
            return st;
    }
}

/* The interval that holds code point cp. */
static uint32_t interval_of(const js_dfa_t *d, uint32_t cp)
{
    uint32_t lo = 0, hi = d->m - 1;
    while (lo < hi) {
        uint32_t mid = (lo + hi + 1) / 2;
        if (d->lo[mid] <= cp)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* The elementary intervals: every range's ends cut [0, CP_MAX]. */
static int make_intervals(const nfa_t *a, js_dfa_t *d)
{
    d->lo = malloc(((size_t)a->n_rng * 2 + 1) * sizeof *d->lo);
    if (!d->lo)
        return TDM_ERESOURCE;
    uint32_t k = 0;
    d->lo[k++] = 0;
    for (uint32_t i = 0; i < a->n_rng; i++) {
        d->lo[k++] = a->rng[i][0];
        if (a->rng[i][1] < CP_MAX)
            d->lo[k++] = a->rng[i][1] + 1;
    }
    uint32_t *tmp = malloc((size_t)k * sizeof *tmp);
    if (!tmp)
        return TDM_ERESOURCE;
    sort_u32(d->lo, k, tmp, 24); /* code points: under 2^21 */
    free(tmp);
    uint32_t m = 0;
    for (uint32_t i = 0; i < k; i++)
        if (m == 0 || d->lo[i] != d->lo[m - 1])
            d->lo[m++] = d->lo[i];
    d->m = m;
    return 0;
}

/* Sorts ss->pairs by interval (0 .. m - 1; a counting sort, the order within one interval
 * kept). */
static int sort_events(subset_t *ss, uint32_t m)
{
    if (ss->n_pairs > ss->cap_sorted) {
        void *p = realloc(ss->sorted, ss->cap_pairs * sizeof *ss->sorted);
        if (!p)
            return TDM_ERESOURCE;
        ss->sorted = p;
        ss->cap_sorted = ss->cap_pairs;
    }
    memset(ss->kpos, 0, ((size_t)m + 1) * sizeof *ss->kpos);
    for (size_t i = 0; i < ss->n_pairs; i++)
        ss->kpos[ss->pairs[i][0] + 1]++;
    for (uint32_t k = 0; k < m; k++)
        ss->kpos[k + 1] += ss->kpos[k];
    for (size_t i = 0; i < ss->n_pairs; i++) {
        uint32_t at = ss->kpos[ss->pairs[i][0]]++;
        ss->sorted[at][0] = ss->pairs[i][0];
        ss->sorted[at][1] = ss->pairs[i][1];
    }
    uint32_t(*t)[2] = ss->pairs;
    ss->pairs = ss->sorted, ss->sorted = t;
    size_t c = ss->cap_pairs;
    ss->cap_pairs = ss->cap_sorted, ss->cap_sorted = c;
    return 0;
}

/* The events of DFA state st's character edges, sorted by interval: (k0, target) where an edge
 * starts to cover the elementary intervals, (k1 + 1, target | EV_END) past its last one. */
static int state_events(subset_t *ss, const js_dfa_t *d, uint32_t st)
{
    const nfa_t *a = ss->a;
    ss->n_pairs = 0;
    for (uint32_t i = 0; i < ss->len[st]; i++) {
        uint32_t x = ss->pool[ss->off[st] + i];
        if (a->chr_to[x] < 0)
            continue;
        for (uint32_t r = a->set_off[x]; r < a->set_off[x] + a->set_n[x]; r++) {
            if (ss->n_pairs + 2 > ss->cap_pairs) {
                size_t nc = ss->cap_pairs ? ss->cap_pairs * 2 : 256;
                void *p = realloc(ss->pairs, nc * sizeof *ss->pairs);
                if (!p)
                    return TDM_ERESOURCE;
                ss->pairs = p;
                ss->cap_pairs = nc;
            }
            uint32_t to = (uint32_t)a->chr_to[x];
            ss->pairs[ss->n_pairs][0] = ss->rk[r][0];
            ss->pairs[ss->n_pairs++][1] = to;
            ss->pairs[ss->n_pairs][0] = ss->rk[r][1];
            ss->pairs[ss->n_pairs++][1] = to | EV_END;
        }
    }
    return sort_events(ss, d->m + 1);
}

/* The NFA targets the edges cover at the interval the events have reached, into ss->buf;
 * drops those no edge covers any more from ss->act. Returns how many. */
static uint32_t active_targets(subset_t *ss)
{
    uint32_t n = 0, kept = 0;
    for (uint32_t i = 0; i < ss->n_act; i++) {
        uint32_t x = ss->act[i];
        if (ss->cnt[x] > 0)
            ss->act[kept++] = ss->buf[n++] = x;
        else
            ss->in_act[x] = 0;
    }
    ss->n_act = kept;
    return n;
}

/* The DFA state the seeds ss->buf[n] (distinct NFA states) lead to: the state of their
 * closure, remembered by the sorted seeds (seen again, no closure is taken). Returns it, or
 * UINT32_MAX / UINT32_MAX - 1 as intern does. */
static uint32_t target_state(subset_t *ss, js_dfa_t *d, uint32_t n)
{
    sort_u32(ss->buf, n, ss->rtmp, 16);
    if (ht_room(ss, &ss->memo_ht, ss->n_memo, memo_key) != 0)
        return UINT32_MAX - 1;
    uint32_t mask = ss->memo_ht.cap - 1, h;
    for (h = hash_list(ss->buf, n) & mask; ss->memo_ht.slot[h]; h = (h + 1) & mask) {
        const seed_memo_t *e = &ss->memo[ss->memo_ht.slot[h] - 1];
        if (e->len == n && memcmp(ss->seeds + e->off, ss->buf, n * sizeof *ss->buf) == 0)
            return e->state;
    }
    bool keep = ss->n_memo < SEED_MEMO_MAX;
    if (keep && (ss->n_seeds + n > ss->cap_seeds || ss->n_memo == ss->cap_memo)) {
        size_t nc = (ss->n_seeds + n) * 2 + 1024, mc = ss->cap_memo * 2 + 256;
        uint32_t *p = realloc(ss->seeds, nc * sizeof *p);
        ss->seeds = p ? p : ss->seeds;
        seed_memo_t *q = p ? realloc(ss->memo, mc * sizeof *q) : NULL;
        ss->memo = q ? q : ss->memo;
        if (!q)
            return UINT32_MAX - 1;
        ss->cap_seeds = nc;
        ss->cap_memo = mc;
    }
    if (keep)
        memcpy(ss->seeds + ss->n_seeds, ss->buf, n * sizeof *ss->buf);
    uint32_t len = closure(ss, ss->buf, n, 0, ss->buf);
    sort_u32(ss->buf, len, ss->rtmp, 16);
    uint32_t t = intern(ss, d, len);
    if (keep && t < UINT32_MAX - 1) {
        ss->memo[ss->n_memo] = (seed_memo_t){(uint32_t)ss->n_seeds, n, t};
        ss->n_seeds += n;
        ss->memo_ht.slot[h] = (uint32_t)++ss->n_memo;
    }
    return t;
}

/* Fills d->trans for state st: a sweep over the intervals, one closure per run of intervals
 * that the same edges cover (the states come out as one closure per interval would give). */
static int expand_state(subset_t *ss, js_dfa_t *d, uint32_t st)
{
    int rc = state_events(ss, d, st);
    size_t p = 0;
    uint32_t t = 0;
    for (uint32_t k = 0; k < d->m && rc == 0; k++) {
        bool changed = k == 0;
        for (; p < ss->n_pairs && ss->pairs[p][0] == k; p++, changed = true) {
            uint32_t x = ss->pairs[p][1] & ~EV_END;
            if (ss->pairs[p][1] & EV_END) {
                ss->cnt[x]--;
            } else if (ss->cnt[x]++ == 0 && !ss->in_act[x]) {
                ss->in_act[x] = 1;
                ss->act[ss->n_act++] = x;
            }
        }
        if (changed) {
            t = target_state(ss, d, active_targets(ss));
            if (t == UINT32_MAX)
                rc = TDM_EINVALID;
            else if (t == UINT32_MAX - 1)
                rc = TDM_ERESOURCE;
        }
        d->trans[(size_t)st * d->m + k] = t;
    }
    for (uint32_t i = 0; i < ss->n_act; i++)
        ss->cnt[ss->act[i]] = 0, ss->in_act[ss->act[i]] = 0;
    ss->n_act = 0;
    return rc;
}

/* The epsilon edges by source (counting sort). */
static int index_eps(subset_t *ss)
{
    const nfa_t *a = ss->a;
    ss->eoff = calloc((size_t)a->n + 1, sizeof *ss->eoff);
    ss->eto = malloc(((size_t)a->n_eps + 1) * sizeof *ss->eto);
    ss->econd = malloc((size_t)a->n_eps + 1);
    if (!ss->eoff || !ss->eto || !ss->econd)
        return TDM_ERESOURCE;
    for (uint32_t i = 0; i < a->n_eps; i++)
        ss->eoff[a->eps[i][0] + 1]++;
    for (uint32_t x = 0; x < a->n; x++)
        ss->eoff[x + 1] += ss->eoff[x];
    uint32_t *fill = ss->mark; /* free until the first closure */
    memcpy(fill, ss->eoff, (size_t)a->n * sizeof *fill);
    for (uint32_t i = 0; i < a->n_eps; i++) {
        ss->econd[fill[a->eps[i][0]]] = (uint8_t)a->eps[i][2];
        ss->eto[fill[a->eps[i][0]]++] = a->eps[i][1];
    }
    memset(ss->mark, 0, (size_t)a->n * sizeof *ss->mark);
    return 0;
}

static int subset_run(subset_t *ss, js_dfa_t *d, uint32_t start)
{
    const nfa_t *a = ss->a;
    ss->mark = calloc(a->n, sizeof *ss->mark);
    ss->stack = malloc((size_t)a->n * sizeof *ss->stack);
    ss->buf = malloc((size_t)a->n * sizeof *ss->buf);
    ss->tbuf = malloc((size_t)a->n * sizeof *ss->tbuf);
    ss->cnt = calloc(a->n, sizeof *ss->cnt);
    ss->act = malloc((size_t)a->n * sizeof *ss->act);
    ss->in_act = calloc(a->n, 1);
    ss->rtmp = malloc((size_t)a->n * sizeof *ss->rtmp);
    if (!ss->rtmp || !ss->mark || !ss->stack || !ss->buf || !ss->tbuf || !ss->cnt || !ss->act ||
        !ss->in_act)
        return TDM_ERESOURCE;
    int rc = index_eps(ss);
    rc = rc ? rc : make_intervals(a, d);
    if (rc != 0)
        return rc;
    ss->kpos = malloc(((size_t)d->m + 2) * sizeof *ss->kpos);
    ss->rk = malloc(((size_t)a->n_rng + 1) * sizeof *ss->rk);
    if (!ss->kpos || !ss->rk)
        return TDM_ERESOURCE;
    for (uint32_t r = 0; r < a->n_rng; r++) {
        ss->rk[r][0] = interval_of(d, a->rng[r][0]);
        ss->rk[r][1] = interval_of(d, a->rng[r][1]) + 1;
    }
    ss->buf[0] = start;
    uint32_t len = closure(ss, ss->buf, 1, EPS_BEGIN, ss->buf);
    sort_u32(ss->buf, len, ss->rtmp, 16);
    if (intern(ss, d, len) != 0)
        return TDM_ERESOURCE;
    size_t cap = 0;
    for (uint32_t st = 0; st < d->n && rc == 0; st++) {
        if ((size_t)(st + 1) > cap) {
            size_t nc = cap ? cap * 2 : 64;
            uint32_t *t = realloc(d->trans, nc * d->m * sizeof *t);
            if (!t)
                return TDM_ERESOURCE;
            d->trans = t;
            cap = nc;
        }
        rc = expand_state(ss, d, st);
    }
    return rc;
}

static void subset_free(subset_t *ss)
{
    free(ss->eoff);
    free(ss->eto);
    free(ss->econd);
    free(ss->tbuf);
    free(ss->mark);
    free(ss->stack);
    free(ss->buf);
    free(ss->pool);
    free(ss->off);
    free(ss->len);
    free(ss->pairs);
    free(ss->cnt);
    free(ss->act);
    free(ss->in_act);
    free(ss->sorted);
    free(ss->kpos);
    free(ss->rtmp);
    free(ss->seeds);
    free(ss->memo);
    free(ss->rk);
    free(ss->ht.slot);
    free(ss->memo_ht.slot);
}

void js_dfa_free(js_dfa_t **d)
{
    if (!d || !*d)
        return;
    free((*d)->lo);
    free((*d)->trans);
    free((*d)->tag);
    free(*d);
    *d = NULL;
}

int js_dfa_new(const char *const *pats, size_t n_pats, const char *const *names, size_t n_names,
               js_dfa_t **out, size_t *bad, tdm_error_t *err)
{
    nfa_t a;
    memset(&a, 0, sizeof a);
    *out = NULL;
    *bad = n_pats;
    if (n_pats > JS_DFA_MAX_PATTERNS)
        return tdm_error_set(err, TDM_EINVALID, "more than %d patterns not supported",
                             JS_DFA_MAX_PATTERNS);
    uint32_t start = nfa_state(&a);
    int rc = 0;
    for (size_t i = 0; i < n_pats && rc == 0; i++) {
        rc = nfa_pattern(&a, start, pats[i], 1u << i, err);
        if (rc != 0)
            *bad = i;
    }
    for (size_t i = 0; i < n_names && rc == 0; i++)
        nfa_name(&a, start, names[i], 1u << n_pats);
    if (rc == 0 && (a.oom || a.big))
        rc = a.oom ? tdm_error_set(err, TDM_ERESOURCE, "out of memory")
                   : tdm_error_set(err, TDM_EINVALID, "automaton too large");
    js_dfa_t *d = rc == 0 ? calloc(1, sizeof *d) : NULL;
    subset_t *ss = rc == 0 ? calloc(1, sizeof *ss) : NULL;
    if (rc == 0 && (!d || !ss))
        rc = tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    if (rc == 0) {
        ss->a = &a;
        rc = subset_run(ss, d, start);
        if (rc == TDM_EINVALID)
            tdm_error_set(err, rc, "automaton too large (over %u states)", DFA_MAX_STATES);
        else if (rc != 0)
            tdm_error_set(err, rc, "out of memory");
    }
    if (ss)
        subset_free(ss);
    free(ss);
    nfa_free(&a);
    if (rc != 0)
        js_dfa_free(&d);
    *out = d;
    return rc;
}

/* ---- the compile's memo of automata ---- */

#define JS_DFA_MEMO_BYTES ((size_t)64 << 20) /* transitions kept in one compile's memo */
#define JS_DFA_MEMO_MAX 1024u                /* automata kept (each lookup scans them) */

typedef struct dfa_entry {
    char *key; /* the patterns and names, each with its kind ('p' / 'n') and a NUL */
    size_t key_len;
    uint64_t hash;
    js_dfa_t *d;
} dfa_entry_t;

struct js_dfa_memo {
    dfa_entry_t *v;
    size_t n, cap;
    size_t bytes; /* transitions of the automata kept */
};

/* The memo key of the patterns and names into *key (tdm_buf). */
static void memo_key_text(tdm_buf_t *key, const char *const *pats, size_t n_pats,
                          const char *const *names, size_t n_names)
{
    for (size_t i = 0; i < n_pats; i++) {
        tdm_buf_append(key, "p", 1);
        tdm_buf_append(key, pats[i], strlen(pats[i]) + 1);
    }
    for (size_t i = 0; i < n_names; i++) {
        tdm_buf_append(key, "n", 1);
        tdm_buf_append(key, names[i], strlen(names[i]) + 1);
    }
}

static uint64_t memo_hash(const char *s, size_t n)
{
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 1099511628211ull;
    return h;
}

/* Keeps d under key in c's memo; false when it is not kept (out of memory, over budget). */
static bool memo_keep(js_ctx_t *c, tdm_buf_t *key, uint64_t hash, js_dfa_t *d)
{
    size_t bytes = (size_t)d->n * d->m * sizeof *d->trans;
    struct js_dfa_memo *mm = c->dfa_memo;
    if (!mm && !(mm = c->dfa_memo = calloc(1, sizeof *mm)))
        return false;
    if (mm->bytes + bytes > JS_DFA_MEMO_BYTES || mm->n >= JS_DFA_MEMO_MAX)
        return false;
    if (mm->n == mm->cap) {
        size_t nc = mm->cap ? mm->cap * 2 : 16;
        dfa_entry_t *v = realloc(mm->v, nc * sizeof *v);
        if (!v)
            return false;
        mm->v = v;
        mm->cap = nc;
    }
    mm->v[mm->n++] = (dfa_entry_t){key->data, key->len, hash, d};
    mm->bytes += bytes;
    d->kept = true;
    *key = (tdm_buf_t)TDM_BUF_INIT; /* the memo owns the text now */
    return true;
}

int js_dfa_get(js_ctx_t *c, const char *const *pats, size_t n_pats, const char *const *names,
               size_t n_names, js_dfa_t **out, size_t *bad, tdm_error_t *err)
{
    tdm_buf_t key = TDM_BUF_INIT;
    memo_key_text(&key, pats, n_pats, names, n_names);
    uint64_t hash = key.oom ? 0 : memo_hash(key.data, key.len);
    for (size_t i = 0; !key.oom && c->dfa_memo && i < c->dfa_memo->n; i++) {
        const dfa_entry_t *e = &c->dfa_memo->v[i];
        if (e->hash == hash && e->key_len == key.len && memcmp(e->key, key.data, key.len) == 0) {
            tdm_buf_free(&key);
            *bad = n_pats;
            *out = e->d;
            return 0;
        }
    }
    int rc = js_dfa_new(pats, n_pats, names, n_names, out, bad, err);
    if (rc == 0 && !key.oom && key.len > 0)
        memo_keep(c, &key, hash, *out);
    tdm_buf_free(&key);
    return rc;
}

void js_dfa_release(js_ctx_t *c, js_dfa_t **d)
{
    (void)c;
    if (d && *d && (*d)->kept)
        *d = NULL;
    else
        js_dfa_free(d);
}

void js_dfa_memo_free(js_ctx_t *c)
{
    struct js_dfa_memo *mm = c->dfa_memo;
    if (!mm)
        return;
    for (size_t i = 0; i < mm->n; i++) {
        free(mm->v[i].key);
        js_dfa_free(&mm->v[i].d);
    }
    free(mm->v);
    free(mm);
    c->dfa_memo = NULL;
}

uint32_t js_dfa_tag(const js_dfa_t *d, const char *s, size_t n)
{
    uint32_t st = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t k = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
        if (k == 0)
            k = 1, cp = (unsigned char)s[i];
        st = d->trans[(size_t)st * d->m + interval_of(d, cp)];
        i += k;
    }
    return d->tag[st];
}

size_t js_dfa_tags(const js_dfa_t *d, uint32_t *tags, size_t cap)
{
    size_t n = 0;
    for (uint32_t st = 0; st < d->n; st++) { /* every state is reachable (built from 0) */
        bool seen = false;
        for (size_t i = 0; i < n && i < cap && !seen; i++)
            seen = tags[i] == d->tag[st];
        if (!seen) {
            if (n < cap)
                tags[n] = d->tag[st];
            n++;
        }
    }
    return n;
}

/* ---- the automaton times a length counter, written as GBNF ---- */

typedef struct prod {
    const js_dfa_t *d;
    uint32_t want;
    size_t lo, hi, cap; /* the counter runs 0 .. cap (saturating at cap when hi is unbounded) */
    size_t n;           /* states: (cap + 1) * d->n, index l * d->n + q */
    bool *live;         /* [n] an accepted text can still be reached */
    uint32_t *id;       /* [n] rule number + 1 of the states written, 0 others */
} prod_t;

static bool prod_accepts(const prod_t *p, uint32_t q, size_t l)
{
    return p->d->tag[q] == p->want && l >= p->lo && (p->hi == JS_LEN_INF || l <= p->hi);
}

/* The state after one character of interval k from (q, l); SIZE_MAX: past maxLength. */
static size_t prod_next(const prod_t *p, uint32_t q, size_t l, uint32_t k)
{
    size_t l2 = l + 1;
    if (l2 > p->cap) {
        if (p->hi != JS_LEN_INF)
            return SIZE_MAX;
        l2 = p->cap;
    }
    return l2 * p->d->n + p->d->trans[(size_t)q * p->d->m + k];
}

/* live[]: layer by layer from the last; the last layer of an unbounded counter loops on
 * itself, so it is iterated to its fixed point. */
static void prod_live(prod_t *p)
{
    const js_dfa_t *d = p->d;
    for (size_t l = p->cap + 1; l-- > 0;) {
        bool changed = true;
        while (changed) {
            changed = false;
            for (uint32_t q = 0; q < d->n; q++) {
                size_t x = l * d->n + q;
                if (p->live[x])
                    continue;
                bool v = prod_accepts(p, q, l);
                for (uint32_t k = 0; k < d->m && !v; k++) {
                    size_t y = prod_next(p, q, l, k);
                    v = y != SIZE_MAX && p->live[y];
                }
                if (v)
                    p->live[x] = changed = true;
            }
            if (l != p->cap || p->hi != JS_LEN_INF)
                break; /* successors are in the next layer, already final */
        }
    }
}

/* Numbers the live states reachable from the start (breadth first); returns how many, or
 * SIZE_MAX past EMIT_MAX_RULES. */
static size_t prod_number(prod_t *p, size_t *order)
{
    size_t n = 0, head = 0;
    if (!p->live[0])
        return 0;
    p->id[0] = 1;
    order[n++] = 0;
    while (head < n) {
        size_t x = order[head++];
        uint32_t q = (uint32_t)(x % p->d->n);
        size_t l = x / p->d->n;
        for (uint32_t k = 0; k < p->d->m; k++) {
            size_t y = prod_next(p, q, l, k);
            if (y == SIZE_MAX || !p->live[y] || p->id[y])
                continue;
            if (n == EMIT_MAX_RULES)
                return SIZE_MAX;
            p->id[y] = (uint32_t)++n;
            order[n - 1] = y;
        }
    }
    return n;
}

/* The body of state x's rule: one alternative per live successor, its characters as a class. */
static int prod_body(const prod_t *p, size_t x, char (*names)[JS_NAME_MAX], tdm_buf_t *b,
                     uint32_t *tmp)
{
    const js_dfa_t *d = p->d;
    uint32_t q = (uint32_t)(x % d->n), n = 0;
    size_t l = x / d->n;
    for (uint32_t k = 0; k < d->m; k++) {
        size_t y = prod_next(p, q, l, k);
        if (y != SIZE_MAX && p->live[y])
            tmp[n++] = k;
    }
    int alts = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (tmp[i] == UINT32_MAX)
            continue;
        size_t y = prod_next(p, q, l, tmp[i]);
        cpset_t set;
        set.n = 0;
        for (uint32_t j = i; j < n; j++) {
            if (tmp[j] == UINT32_MAX || prod_next(p, q, l, tmp[j]) != y)
                continue;
            uint32_t k = tmp[j];
            if (!js_cpset_add(&set, d->lo[k], k + 1 < d->m ? d->lo[k + 1] - 1 : CP_MAX))
                return TDM_EINVALID;
            tmp[j] = UINT32_MAX;
        }
        js_cpset_normalize(&set);
        tdm_buf_puts(b, alts++ ? " | " : "");
        js_cpset_emit_json(b, &set);
        tdm_buf_puts(b, " ");
        tdm_buf_puts(b, names[p->id[y] - 1]);
    }
    if (prod_accepts(p, q, l))
        tdm_buf_puts(b, alts ? " | \"\"" : "\"\"");
    return 0;
}

static int prod_emit(js_ctx_t *c, prod_t *p, char *name)
{
    size_t *order = malloc(EMIT_MAX_RULES * sizeof *order);
    uint32_t *tmp = malloc((size_t)p->d->m * sizeof *tmp);
    char(*names)[JS_NAME_MAX] = NULL;
    int rc = order && tmp ? 0 : js_oom(c);
    size_t n = rc ? 0 : prod_number(p, order);
    if (rc == 0 && n == SIZE_MAX)
        rc = TDM_EINVALID;
    if (rc == 0 && n > 0 && !(names = malloc(n * JS_NAME_MAX)))
        rc = js_oom(c);
    for (size_t i = 0; i < n && rc == 0; i++)
        js_new_name(c, names[i]);
    tdm_buf_t b = TDM_BUF_INIT;
    for (size_t i = 0; i < n && rc == 0; i++) {
        tdm_buf_clear(&b);
        rc = prod_body(p, order[i], names, &b, tmp);
        rc = rc ? rc : b.oom ? js_oom(c) : js_emit_rule(c, names[i], b.data);
    }
    name[0] = 0;
    if (rc == 0 && n > 0)
        snprintf(name, JS_NAME_MAX, "%s", names[0]);
    tdm_buf_free(&b);
    free(names);
    free(tmp);
    free(order);
    return rc;
}

int js_dfa_emit(js_ctx_t *c, const js_dfa_t *d, uint32_t want, size_t lo, size_t hi, char *name)
{
    prod_t p = {d, want, lo, hi, hi != JS_LEN_INF ? hi : lo, 0, NULL, NULL};
    name[0] = 0;
    if (lo > hi)
        return 0;
    if (p.cap >= PROD_MAX_STATES / d->n ||
        (p.cap + 1) * d->n * d->m > 64u * PROD_MAX_STATES) /* work units, not time */
        return tdm_error_set(c->err, TDM_EINVALID,
                             "automaton too large (%zu lengths times %u states)", p.cap + 1, d->n);
    p.n = (p.cap + 1) * d->n;
    p.live = calloc(p.n, sizeof *p.live);
    p.id = calloc(p.n, sizeof *p.id);
    int rc = p.live && p.id ? 0 : js_oom(c);
    if (rc == 0) {
        prod_live(&p);
        rc = prod_emit(c, &p, name);
        if (rc == TDM_EINVALID)
            tdm_error_set(c->err, rc, "automaton too large (over %u rules)", EMIT_MAX_RULES);
    }
    free(p.live);
    free(p.id);
    return rc;
}
