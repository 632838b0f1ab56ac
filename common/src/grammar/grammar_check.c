/* grammar_check.c - from the parser's rules to the compiled grammar: undefined rules, rules
 * with no finite string (their alternatives are dropped; a start rule with none is refused),
 * left recursion (refused: the matcher would grow stacks without end), then the flat layout.
 *
 * Left recursion: rule A "can begin with" B when some alternative of A reaches a reference
 * to B past only nullable items. A cycle of such edges makes the matcher's expansion loop,
 * except when every reference on the cycle is the last item of its alternative (a tail call
 * pushes nothing, so the expansion revisits the same stack and stops): `R ::= x? R |`, which
 * `(x?)*` becomes, is allowed; `a ::= a "x" | "y"` is refused.
 */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

bool tdm_gram_class_has(const tdm_grammar_t *g, uint32_t c, uint32_t cp)
{
    const uint32_t *r = g->ranges;
    uint32_t lo = g->class_off[c], hi = g->class_off[c + 1];
    while (lo < hi) { /* first range whose end is >= cp */
        uint32_t mid = lo + (hi - lo) / 2;
        if (r[2 * mid + 1] < cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < g->class_off[c + 1] && r[2 * lo] <= cp;
}

bool tdm_gram_class_covers(const tdm_grammar_t *g, uint32_t c, uint32_t lo_cp, uint32_t hi_cp)
{
    const uint32_t *r = g->ranges;
    uint32_t lo = g->class_off[c], hi = g->class_off[c + 1];
    while (lo < hi) { /* the first range ending at or after lo_cp must hold all of it */
        uint32_t mid = lo + (hi - lo) / 2;
        if (r[2 * mid + 1] < lo_cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < g->class_off[c + 1] && r[2 * lo] <= lo_cp && r[2 * lo + 1] >= hi_cp;
}

bool tdm_gram_class_meets(const tdm_grammar_t *g, uint32_t c, uint32_t lo_cp, uint32_t hi_cp)
{
    const uint32_t *r = g->ranges;
    uint32_t lo = g->class_off[c], hi = g->class_off[c + 1];
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (r[2 * mid + 1] < lo_cp)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < g->class_off[c + 1] && r[2 * lo] <= hi_cp;
}

/* Analysis scratch: per rule flags and the "can begin with" edges (CSR). */
typedef struct check {
    gram_ir_t *ir;
    bool *productive, *nullable;
    uint32_t *edge_off, *edge_to; /* edges of rule r: edge_to[edge_off[r]..edge_off[r+1]) */
    bool *edge_tail;
    tdm_error_t *err;
} check_t;

static bool class_empty(const gram_ir_t *ir, uint32_t c)
{
    return ir->class_off[c] == ir->class_off[c + 1];
}

/* True when the alternative at elems[i..] (up to a stop) has only productive items; *end
 * gets the index of its stop. */
static bool alt_productive(const check_t *ck, const uint32_t *e, uint32_t i, uint32_t *end)
{
    bool ok = true;
    for (; !GRAM_IS_STOP(e[i]); i++) {
        uint32_t v = GRAM_VALUE(e[i]);
        if (GRAM_TYPE(e[i]) == GRAM_CLASS ? class_empty(ck->ir, v) : !ck->productive[v])
            ok = false;
    }
    *end = i;
    return ok;
}

/* The alternatives of every rule and, for each rule, the alternatives that reference it
 * (once per reference): what the fixpoints below propagate along. */
typedef struct alt_index {
    uint32_t n_alts;
    uint32_t *rule, *start, *left; /* [n_alts] owner, first element, items still unresolved */
    uint32_t *occ_off, *occ;       /* alternatives referencing rule r: occ[occ_off[r]..) */
    uint32_t *queue;               /* [n_rules] rules whose flag was just set */
} alt_index_t;

static void alt_index_free(alt_index_t *x)
{
    free(x->rule);
    free(x->start);
    free(x->left);
    free(x->occ_off);
    free(x->occ);
    free(x->queue);
}

static int alt_index_build(const gram_ir_t *ir, alt_index_t *x)
{
    size_t n = 1;
    for (uint32_t r = 0; r < ir->n_rules; r++)
        n += ir->rules[r].n_elems;
    x->rule = malloc(n * sizeof *x->rule);
    x->start = malloc(n * sizeof *x->start);
    x->left = malloc(n * sizeof *x->left);
    x->occ = malloc(n * sizeof *x->occ);
    x->occ_off = calloc((size_t)ir->n_rules + 2, sizeof *x->occ_off);
    x->queue = malloc(((size_t)ir->n_rules + 1) * sizeof *x->queue);
    if (!x->rule || !x->start || !x->left || !x->occ || !x->occ_off || !x->queue)
        return TDM_ERESOURCE;
    for (int fill = 0; fill < 2; fill++) { /* count the references, then place them */
        x->n_alts = 0;
        for (uint32_t r = 0; r < ir->n_rules; r++) {
            const uint32_t *e = ir->rules[r].elems;
            for (uint32_t i = 0; i < ir->rules[r].n_elems; i++) {
                if (i == 0 || GRAM_IS_STOP(e[i - 1])) {
                    x->rule[x->n_alts] = r;
                    x->start[x->n_alts++] = i;
                }
                if (GRAM_TYPE(e[i]) == GRAM_REF && fill == 0)
                    x->occ_off[GRAM_VALUE(e[i]) + 2]++;
                else if (GRAM_TYPE(e[i]) == GRAM_REF)
                    x->occ[x->occ_off[GRAM_VALUE(e[i]) + 1]++] = x->n_alts - 1;
            }
        }
        for (uint32_t r = 0; fill == 0 && r < ir->n_rules; r++)
            x->occ_off[r + 2] += x->occ_off[r + 1];
    }
    return TDM_OK;
}

/* One fixpoint over the alternatives: flag[r] once some alternative of r has all its items
 * resolved. Productive: a reference resolves when its rule is productive, a class when it is
 * not empty. Nullable (over productive alternatives): a reference when its rule is nullable,
 * a class never. Linear in the grammar's size (a worklist, not repeated passes). */
static void fixpoint(check_t *ck, alt_index_t *x, bool nullable)
{
    const gram_ir_t *ir = ck->ir;
    bool *flag = nullable ? ck->nullable : ck->productive;
    uint32_t nq = 0;
    for (uint32_t a = 0; a < x->n_alts; a++) {
        const uint32_t *e = ir->rules[x->rule[a]].elems;
        uint32_t left = 0, end;
        bool blocked = nullable && !alt_productive(ck, e, x->start[a], &end);
        for (uint32_t i = x->start[a]; !GRAM_IS_STOP(e[i]); i++) {
            if (GRAM_TYPE(e[i]) == GRAM_REF)
                left++;
            else if (nullable || class_empty(ir, GRAM_VALUE(e[i])))
                blocked = true;
        }
        x->left[a] = blocked ? UINT32_MAX : left;
        if (left == 0 && !blocked && !flag[x->rule[a]]) {
            flag[x->rule[a]] = true;
            x->queue[nq++] = x->rule[a];
        }
    }
    while (nq > 0) {
        uint32_t r = x->queue[--nq];
        for (uint32_t k = x->occ_off[r]; k < x->occ_off[r + 1]; k++) {
            uint32_t a = x->occ[k];
            if (x->left[a] == UINT32_MAX || --x->left[a] != 0 || flag[x->rule[a]])
                continue;
            flag[x->rule[a]] = true;
            x->queue[nq++] = x->rule[a];
        }
    }
}

/* Productive (has a finite string), then nullable (has the empty string). */
static int find_productive_nullable(check_t *ck)
{
    alt_index_t x = {0};
    int rc = alt_index_build(ck->ir, &x);
    if (rc == TDM_OK) {
        fixpoint(ck, &x, false);
        fixpoint(ck, &x, true);
    } else {
        tdm_error_set(ck->err, TDM_ERESOURCE, "out of memory compiling the grammar");
    }
    alt_index_free(&x);
    return rc;
}

/* Collects the "can begin with" edges of every productive alternative. */
static int find_edges(check_t *ck)
{
    gram_ir_t *ir = ck->ir;
    size_t n = 0;
    for (uint32_t r = 0; r < ir->n_rules; r++)
        n += ir->rules[r].n_elems;
    ck->edge_off = calloc(ir->n_rules + 1, sizeof *ck->edge_off);
    ck->edge_to = malloc((n + 1) * sizeof *ck->edge_to);
    ck->edge_tail = malloc((n + 1) * sizeof *ck->edge_tail);
    if (!ck->edge_off || !ck->edge_to || !ck->edge_tail)
        return tdm_error_set(ck->err, TDM_ERESOURCE, "out of memory compiling the grammar");
    uint32_t k = 0;
    for (uint32_t r = 0; r < ir->n_rules; r++) {
        const uint32_t *e = ir->rules[r].elems;
        ck->edge_off[r] = k;
        for (uint32_t i = 0, end; i < ir->rules[r].n_elems; i = end + 1) {
            if (!alt_productive(ck, e, i, &end))
                continue;
            for (uint32_t j = i; j < end && GRAM_TYPE(e[j]) == GRAM_REF; j++) {
                ck->edge_to[k] = GRAM_VALUE(e[j]);
                ck->edge_tail[k++] = j + 1 == end;
                if (!ck->nullable[GRAM_VALUE(e[j])])
                    break;
            }
        }
    }
    ck->edge_off[ir->n_rules] = k;
    return TDM_OK;
}

/* Tarjan's strongly connected components, iterative; comp[r] gets r's component. */
static int find_components(const check_t *ck, uint32_t *comp)
{
    uint32_t n = ck->ir->n_rules, next = 0, sp = 0, cs = 0, n_comp = 0;
    uint32_t *idx = malloc(n * sizeof *idx), *low = malloc(n * sizeof *low);
    uint32_t *stack = malloc(n * sizeof *stack), *call = malloc(n * sizeof *call);
    uint32_t *it = malloc(n * sizeof *it);
    bool *on = calloc(n, sizeof *on);
    int rc = TDM_OK;
    if (!idx || !low || !stack || !call || !it || !on) {
        rc = tdm_error_set(ck->err, TDM_ERESOURCE, "out of memory compiling the grammar");
        goto out_free;
    }
    memset(idx, 0xFF, n * sizeof *idx);
    for (uint32_t root = 0; root < n; root++) {
        if (idx[root] != UINT32_MAX)
            continue;
        call[cs++] = root;
        idx[root] = low[root] = next++;
        it[root] = ck->edge_off[root];
        stack[sp++] = root;
        on[root] = true;
        while (cs > 0) {
            uint32_t v = call[cs - 1];
            if (it[v] < ck->edge_off[v + 1]) {
                uint32_t w = ck->edge_to[it[v]++];
                if (idx[w] == UINT32_MAX) {
                    idx[w] = low[w] = next++;
                    it[w] = ck->edge_off[w];
                    stack[sp++] = w;
                    on[w] = true;
                    call[cs++] = w;
                } else if (on[w] && idx[w] < low[v]) {
                    low[v] = idx[w];
                }
                continue;
            }
            if (low[v] == idx[v]) {
                uint32_t w;
                do {
                    w = stack[--sp];
                    on[w] = false;
                    comp[w] = n_comp;
                } while (w != v);
                n_comp++;
            }
            if (--cs > 0 && low[v] < low[call[cs - 1]])
                low[call[cs - 1]] = low[v];
        }
    }
out_free:
    free(idx);
    free(low);
    free(stack);
    free(call);
    free(it);
    free(on);
    return rc;
}

/* The rule to name for a cycle in component c: the first user rule in it (generated rules'
 * names hold '_'), else r. */
static uint32_t cycle_rule(const check_t *ck, const uint32_t *comp, uint32_t c, uint32_t r)
{
    for (uint32_t u = 0; u < ck->ir->n_rules; u++)
        if (comp[u] == c && !strchr(ck->ir->rules[u].name, '_'))
            return u;
    return r;
}

/* Refuses a cycle of "can begin with" edges that holds a reference not in tail position. */
static int check_left_recursion(check_t *ck)
{
    uint32_t n = ck->ir->n_rules;
    uint32_t *comp = malloc((n ? n : 1) * sizeof *comp);
    if (!comp)
        return tdm_error_set(ck->err, TDM_ERESOURCE, "out of memory compiling the grammar");
    int rc = find_components(ck, comp);
    for (uint32_t r = 0; rc == TDM_OK && r < n; r++) {
        for (uint32_t k = ck->edge_off[r]; k < ck->edge_off[r + 1]; k++) {
            if (ck->edge_tail[k] || comp[ck->edge_to[k]] != comp[r])
                continue;
            uint32_t u = cycle_rule(ck, comp, comp[r], r);
            rc = tdm_gram_error_at(ck->ir, ck->ir->rules[u].def_at, u, ck->err,
                                   "left recursion: '%s' can begin with itself",
                                   ck->ir->rules[u].name);
            break;
        }
    }
    free(comp);
    return rc;
}

static int check_defined(const gram_ir_t *ir, tdm_error_t *err)
{
    for (uint32_t r = 0; r < ir->n_rules; r++) {
        const gram_rule_t *x = &ir->rules[r];
        if (!x->defined)
            return tdm_gram_error_at(ir, x->ref_at ? x->ref_at - 1 : 0, x->ref_from, err,
                                     "undefined rule '%s'", x->name);
    }
    return TDM_OK;
}

/* Fills g->class_ascii from the ranges. */
static void fill_class_ascii(tdm_grammar_t *g)
{
    for (uint32_t c = 0; c < g->n_classes; c++) {
        uint32_t *a = g->class_ascii[c];
        memset(a, 0, 4 * sizeof *a);
        for (uint32_t k = g->class_off[c]; k < g->class_off[c + 1] && g->ranges[2 * k] < 128; k++)
            for (uint32_t b = g->ranges[2 * k]; b <= g->ranges[2 * k + 1] && b < 128; b++)
                a[b >> 5] |= 1u << (b & 31);
    }
}

/* Lays the rules out in one array (productive alternatives listed in alts). */
static tdm_grammar_t *build(const check_t *ck, uint32_t root)
{
    const gram_ir_t *ir = ck->ir;
    tdm_grammar_t *g = calloc(1, sizeof *g);
    if (!g)
        return NULL;
    size_t n = 0;
    for (uint32_t r = 0; r < ir->n_rules; r++)
        n += ir->rules[r].n_elems;
    g->n_elems = (uint32_t)n;
    g->n_rules = ir->n_rules;
    g->n_classes = ir->n_classes;
    g->root = root;
    g->elems = malloc((n + 1) * sizeof *g->elems);
    g->alts = malloc((n + 1) * sizeof *g->alts);
    g->alt_off = malloc(((size_t)ir->n_rules + 1) * sizeof *g->alt_off);
    g->class_off = malloc(((size_t)ir->n_classes + 1) * sizeof *g->class_off);
    g->ranges = malloc(((size_t)2 * ir->n_ranges + 1) * sizeof *g->ranges);
    g->class_ascii = malloc(((size_t)ir->n_classes + 1) * sizeof *g->class_ascii);
    if (!g->elems || !g->alts || !g->alt_off || !g->class_off || !g->ranges || !g->class_ascii) {
        tdm_grammar_destroy(&g);
        return NULL;
    }
    memcpy(g->class_off, ir->class_off, ((size_t)ir->n_classes + (ir->n_classes > 0)) * 4);
    if (ir->n_classes == 0)
        g->class_off[0] = 0;
    memcpy(g->ranges, ir->ranges, (size_t)2 * ir->n_ranges * sizeof *g->ranges);
    uint32_t at = 0, k = 0;
    for (uint32_t r = 0; r < ir->n_rules; r++) {
        const uint32_t *e = ir->rules[r].elems;
        g->alt_off[r] = k;
        for (uint32_t i = 0, end; i < ir->rules[r].n_elems; i = end + 1)
            if (alt_productive(ck, e, i, &end))
                g->alts[k++] = at + i;
        memcpy(g->elems + at, e, ir->rules[r].n_elems * sizeof *e);
        at += ir->rules[r].n_elems;
    }
    g->alt_off[ir->n_rules] = k;
    fill_class_ascii(g);
    g->size_bytes = sizeof *g + (n * 2 + ir->n_rules + 5 * ir->n_classes + 2 * ir->n_ranges) * 4;
    return g;
}

tdm_grammar_t *tdm_gram_compile(gram_ir_t *ir, const char *root_rule, tdm_error_t *err)
{
    check_t ck = {.ir = ir, .err = err};
    tdm_grammar_t *g = NULL;
    const char *root_name = root_rule ? root_rule : "root";
    uint32_t root = UINT32_MAX;
    if (check_defined(ir, err) != TDM_OK)
        return NULL;
    for (uint32_t r = 0; r < ir->n_rules; r++)
        if (strcmp(ir->rules[r].name, root_name) == 0)
            root = r;
    if (root == UINT32_MAX) {
        tdm_error_set(err, TDM_EINVALID, "line 1, column 1 (rule %s): no rule named '%s'",
                      root_name, root_name);
        return NULL;
    }
    ck.productive = calloc(ir->n_rules, sizeof *ck.productive);
    ck.nullable = calloc(ir->n_rules, sizeof *ck.nullable);
    if (!ck.productive || !ck.nullable) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory compiling the grammar");
        goto out_free;
    }
    if (find_productive_nullable(&ck) != TDM_OK)
        goto out_free;
    if (!ck.productive[root]) {
        tdm_gram_error_at(ir, ir->rules[root].def_at, root, err,
                          "no finite string matches the start rule");
        goto out_free;
    }
    if (find_edges(&ck) != TDM_OK || check_left_recursion(&ck) != TDM_OK)
        goto out_free;
    g = build(&ck, root);
    if (!g)
        tdm_error_set(err, TDM_ERESOURCE, "out of memory compiling the grammar");
out_free:
    free(ck.productive);
    free(ck.nullable);
    free(ck.edge_off);
    free(ck.edge_to);
    free(ck.edge_tail);
    return g;
}
