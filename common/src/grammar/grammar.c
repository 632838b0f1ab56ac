/* grammar.c - tdm_grammar_t: parse (grammar_parse.c), check and lay out (grammar_check.c). */
#include <stdlib.h>

#include "grammar/grammar_internal.h"

tdm_grammar_t *tdm_grammar_parse(const char *text, size_t len, const char *root_rule,
                                 tdm_error_t *err)
{
    if (len > TDM_GRAMMAR_MAX_TEXT_BYTES) {
        tdm_error_set(err, TDM_EINVALID,
                      "line 1, column 1: grammar of %zu bytes is over the limit of %u "
                      "(TDM_GRAMMAR_MAX_TEXT_BYTES)",
                      len, TDM_GRAMMAR_MAX_TEXT_BYTES);
        return NULL;
    }
    gram_ir_t ir = {0};
    tdm_grammar_t *g = NULL;
    if (tdm_gram_parse_ir(&ir, text, len, err) == TDM_OK)
        g = tdm_gram_compile(&ir, root_rule, err);
    tdm_gram_ir_free(&ir);
    return g;
}

void tdm_grammar_destroy(tdm_grammar_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_grammar_t *g = *self_p;
    free(g->elems);
    free(g->alts);
    free(g->alt_off);
    free(g->class_off);
    free(g->ranges);
    free(g->class_ascii);
    free(g);
    *self_p = NULL;
}

size_t tdm_grammar_size_bytes(const tdm_grammar_t *g)
{
    return g->size_bytes;
}

uint32_t tdm_grammar_n_rules(const tdm_grammar_t *g)
{
    return g->n_rules;
}
