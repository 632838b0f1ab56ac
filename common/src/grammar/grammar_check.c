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

/* True when the productive alternative at elems[i..] matches the empty string. */
static bool alt_nullable(const check_t *ck, const uint32_t *e, uint32_t i)
{
    for (; !GRAM_IS_STOP(e[i]); i++)
        if (GRAM_TYPE(e[i]) == GRAM_CLASS || !ck->nullable[GRAM_VALUE(e[i])])
            return false;
    return true;
}

/* Fixpoints: productive (has a finite string), then nullable (has the empty string). */
static void find_productive_nullable(check_t *ck)
{
    gram_ir_t *ir = ck->ir;
    for (int pass = 0; pass < 2; pass++) {
        bool *flag = pass == 0 ? ck->productive : ck->nullable;
        for (bool changed = true; changed;) {
            changed = false;
            for (uint32_t r = 0; r < ir->n_rules; r++) {
                const uint32_t *e = ir->rules[r].elems;
                for (uint32_t i = 0, end; !flag[r] && i < ir->rules[r].n_elems; i = end + 1) {
                    bool prod = alt_productive(ck, e, i, &end);
                    if (prod && (pass == 0 || alt_nullable(ck, e, i)))
                        flag[r] = changed = true;
                }
            }
        }
    }
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
    if (!g->elems || !g->alts || !g->alt_off || !g->class_off || !g->ranges) {
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
    g->size_bytes = sizeof *g + (n * 2 + ir->n_rules + ir->n_classes + 2 * ir->n_ranges) * 4;
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
    find_productive_nullable(&ck);
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
