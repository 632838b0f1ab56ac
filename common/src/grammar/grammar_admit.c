/* grammar_admit.c - the check a router runs on a compiled grammar before admitting a request
 * that uses it: size and rules against limits, then the grammar's byte automaton explored
 * breadth first from the start for a bounded number of steps, refusing a grammar whose parse
 * state needs more than TDM_GRAMMAR_MAX_STACKS stacks within that exploration (the matcher
 * would refuse a valid continuation there at decode time). Every bound counts work (states,
 * steps), never time, so the verdict is the same on every machine and every run.
 */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"
#include "tandem/grammar.h"

void tdm_grammar_limits_default(tdm_grammar_limits_t *lim)
{
    lim->max_bytes = 64u << 20;
    lim->max_rules = 200000u;
    lim->max_states = 4096u;
    lim->max_steps = 1u << 20;
}

/* Explores from the start: each state's 256 byte successors, breadth first, until the states
 * or steps budget is spent or the space's tables fill. *depth: bytes of the longest prefix
 * explored; *ambiguous: some prefix needed more stacks than the bound. */
static int explore(gram_space_t *sp, const tdm_grammar_limits_t *lim, bool *ambiguous,
                   uint32_t *depth, uint32_t *n_states)
{
    uint32_t cap = lim->max_states < GRAM_MAX_STATES ? lim->max_states : GRAM_MAX_STATES;
    uint32_t *queue = malloc((size_t)cap * sizeof *queue);
    uint32_t *level = malloc((size_t)cap * sizeof *level);
    uint8_t *seen = calloc(GRAM_MAX_STATES, 1);
    int rc = queue && level && seen ? 0 : TDM_ERESOURCE;
    uint32_t head = 0, tail = 0, steps = 0;
    uint32_t s0 = rc == 0 ? tdm_gram_space_start(sp) : GRAM_DEAD;
    *ambiguous = sp->too_ambiguous;
    *depth = 0;
    if (rc == 0 && s0 != GRAM_DEAD && s0 < GRAM_MAX_STATES) {
        seen[s0] = 1;
        queue[tail] = s0;
        level[tail++] = 0;
    }
    while (rc == 0 && head < tail && !*ambiguous && steps < lim->max_steps) {
        uint32_t s = queue[head], d = level[head++];
        *depth = d;
        for (uint32_t b = 0; b < 256 && !*ambiguous; b++, steps++) {
            uint32_t t = tdm_gram_space_step(sp, s, (uint8_t)b);
            *ambiguous = sp->too_ambiguous;
            if (sp->oom)
                rc = TDM_ERESOURCE;
            if (t >= GRAM_MAX_STATES || seen[t] || tail == cap)
                continue;
            seen[t] = 1;
            queue[tail] = t;
            level[tail++] = d + 1;
        }
        if (sp->full)
            break; /* the tables' bound: as far as a matcher would go without a rebuild */
    }
    *n_states = tail;
    free(queue);
    free(level);
    free(seen);
    return rc;
}

int tdm_grammar_check(const tdm_grammar_t *g, const tdm_grammar_limits_t *lim, tdm_error_t *err)
{
    tdm_grammar_limits_t def;
    if (!lim) {
        tdm_grammar_limits_default(&def);
        lim = &def;
    }
    if (g->size_bytes > lim->max_bytes)
        return tdm_error_set_field(err, TDM_EINVALID, "grammar.size",
                                   "grammar.size: %zu bytes compiled, over the limit of %zu",
                                   g->size_bytes, lim->max_bytes);
    if (g->n_rules > lim->max_rules)
        return tdm_error_set_field(err, TDM_EINVALID, "grammar.rules",
                                   "grammar.rules: %u rules, over the limit of %u", g->n_rules,
                                   lim->max_rules);
    gram_space_t sp;
    if (tdm_gram_space_init(&sp, g) != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    bool ambiguous = false;
    uint32_t depth = 0, n_states = 0;
    int rc = explore(&sp, lim, &ambiguous, &depth, &n_states);
    tdm_gram_space_free(&sp);
    if (rc != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    if (ambiguous)
        return tdm_error_set_field(err, TDM_EINVALID, "grammar.stacks",
                                   "grammar.stacks: a prefix of %u bytes needs more than %u parse "
                                   "stacks (the matcher's limit): the grammar is too ambiguous",
                                   depth + 1, TDM_GRAMMAR_MAX_STACKS);
    (void)n_states;
    return 0;
}
