/* grammar_vocab.c - the vocabulary as the mask sees it: every token's decoded bytes, and a
 * trie of them laid out in depth-first preorder (children sorted by byte) so that the mask
 * walks it as one array and skips a subtree by jumping to its end.
 */
#include <stdlib.h>
#include <string.h>

#include "grammar/grammar_internal.h"

void tdm_grammar_vocab_destroy(tdm_grammar_vocab_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_grammar_vocab_t *v = *self_p;
    free(v->kind);
    free(v->bytes_off);
    free(v->blob);
    free(v->nodes);
    free(v->node_ascii);
    free(v->tok_ids);
    free(v->eog);
    free(v->trie_bits);
    free(v);
    *self_p = NULL;
}

uint32_t tdm_grammar_vocab_n_vocab(const tdm_grammar_vocab_t *v)
{
    return v->n_vocab;
}

/* Which tokens the mask may allow: normal, user-defined and byte tokens with bytes; the
 * end-of-generation ones as the end of the output; nothing else. */
static uint8_t token_kind(const tdm_tokenizer_t *tok, tdm_token_t t, int n_bytes)
{
    if (tdm_tokenizer_is_eog(tok, t))
        return GRAM_TOK_EOG;
    tdm_token_attr_t a = tdm_tokenizer_attr(tok, t);
    if (n_bytes > 0 &&
        (a == TDM_TOKEN_NORMAL || a == TDM_TOKEN_USER_DEFINED || a == TDM_TOKEN_BYTE))
        return GRAM_TOK_BYTES;
    return GRAM_TOK_NEVER;
}

/* Reads every token's bytes into v->blob / bytes_off and its kind. */
static int read_tokens(tdm_grammar_vocab_t *v, const tdm_tokenizer_t *tok)
{
    size_t cap = (size_t)v->n_vocab * 8 + 64, len = 0;
    v->blob = malloc(cap);
    if (!v->blob)
        return TDM_ERESOURCE;
    for (uint32_t t = 0; t < v->n_vocab; t++) {
        v->bytes_off[t] = (uint32_t)len;
        char probe[1]; /* cap 0: only the length (a buffer, as memcpy wants one) */
        int n = tdm_tokenizer_token_bytes(tok, (tdm_token_t)t, false, probe, 0);
        if (n < 0)
            n = 0;
        v->kind[t] = token_kind(tok, (tdm_token_t)t, n);
        if (v->kind[t] != GRAM_TOK_BYTES)
            continue;
        if (len + (size_t)n > cap) {
            while (len + (size_t)n > cap)
                cap *= 2;
            char *b = realloc(v->blob, cap);
            if (!b)
                return TDM_ERESOURCE;
            v->blob = b;
        }
        tdm_tokenizer_token_bytes(tok, (tdm_token_t)t, false, v->blob + len, (size_t)n);
        len += (size_t)n;
    }
    v->bytes_off[v->n_vocab] = (uint32_t)len;
    return TDM_OK;
}

/* A token's bytes, for sorting. */
typedef struct sort_key {
    const char *p;
    uint32_t len, id;
} sort_key_t;

static int cmp_tokens(const void *a, const void *b)
{
    const sort_key_t *x = a, *y = b;
    int c = memcmp(x->p, y->p, x->len < y->len ? x->len : y->len);
    if (c != 0)
        return c;
    if (x->len != y->len)
        return x->len < y->len ? -1 : 1;
    return x->id < y->id ? -1 : x->id > y->id;
}

/* Sorts tok_ids[0..n) by bytes (then id). */
static int sort_tokens(tdm_grammar_vocab_t *v, uint32_t n)
{
    sort_key_t *k = malloc(((size_t)n + 1) * sizeof *k);
    if (!k)
        return TDM_ERESOURCE;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t = v->tok_ids[i];
        k[i] = (sort_key_t){v->blob + v->bytes_off[t], v->bytes_off[t + 1] - v->bytes_off[t], t};
    }
    qsort(k, n, sizeof *k, cmp_tokens);
    for (uint32_t i = 0; i < n; i++)
        v->tok_ids[i] = k[i].id;
    free(k);
    return TDM_OK;
}

/* Adds the nodes for the path of sorted token tok_ids[k] below the common prefix (lcp bytes)
 * it shares with the previous token; open[d] is the node at depth d on the current path. */
static void add_path(tdm_grammar_vocab_t *v, uint32_t k, uint32_t lcp, uint32_t *open)
{
    uint32_t t = v->tok_ids[k];
    const uint8_t *b = (const uint8_t *)v->blob + v->bytes_off[t];
    uint32_t len = v->bytes_off[t + 1] - v->bytes_off[t];
    for (uint32_t d = lcp; d < len; d++) {
        gram_trie_node_t *n = &v->nodes[v->n_nodes];
        memset(n, 0, sizeof *n);
        n->byte = b[d];
        n->depth = (uint16_t)d;
        n->tok_begin = n->tok_end = k;
        open[d] = v->n_nodes++;
    }
    v->nodes[open[len - 1]].tok_end = k + 1;
    for (uint32_t d = 0; d < len; d++)
        v->nodes[open[d]].sub_tok_end = k + 1;
}

/* Builds the trie over the n sorted tokens in tok_ids. */
static int build_trie(tdm_grammar_vocab_t *v, uint32_t n)
{
    size_t n_bytes = v->bytes_off[v->n_vocab];
    v->nodes = malloc((n_bytes + 1) * sizeof *v->nodes);
    uint32_t *open = malloc(((size_t)v->max_depth + 1) * sizeof *open);
    if (!v->nodes || !open) {
        free(open);
        return TDM_ERESOURCE;
    }
    const char *prev = NULL;
    uint32_t prev_len = 0;
    for (uint32_t k = 0; k < n; k++) {
        uint32_t t = v->tok_ids[k], len = v->bytes_off[t + 1] - v->bytes_off[t];
        const char *b = v->blob + v->bytes_off[t];
        uint32_t lcp = 0;
        while (prev && lcp < len && lcp < prev_len && b[lcp] == prev[lcp])
            lcp++;
        if (lcp == len) { /* the same bytes as the previous token */
            v->nodes[open[len - 1]].tok_end = k + 1;
            for (uint32_t d = 0; d < len; d++)
                v->nodes[open[d]].sub_tok_end = k + 1;
        } else {
            add_path(v, k, lcp, open);
        }
        prev = b;
        prev_len = len;
    }
    free(open);
    /* subtree ends: a node's subtree ends at the next node of the same or a smaller depth */
    uint32_t *stack = malloc(((size_t)v->max_depth + 1) * sizeof *stack), sp = 0;
    if (!stack)
        return TDM_ERESOURCE;
    for (uint32_t i = 0; i <= v->n_nodes; i++) {
        uint32_t d = i < v->n_nodes ? v->nodes[i].depth : 0;
        while (sp > 0 && v->nodes[stack[sp - 1]].depth >= d)
            v->nodes[stack[--sp]].end = i;
        if (i < v->n_nodes)
            stack[sp++] = i;
    }
    free(stack);
    return TDM_OK;
}

/* Each node's subtree byte sets: its own byte and its children's sets (children follow a
 * node in preorder, so a backward pass sees them first). */
static int fill_byte_sets(tdm_grammar_vocab_t *v)
{
    v->node_ascii = calloc((size_t)v->n_nodes + 1, sizeof *v->node_ascii);
    if (!v->node_ascii)
        return TDM_ERESOURCE;
    for (uint32_t i = v->n_nodes; i-- > 0;) {
        gram_trie_node_t *n = &v->nodes[i];
        uint32_t *a = v->node_ascii[i];
        if (n->byte >= 0x80)
            n->nonascii = 1;
        else
            a[n->byte >> 5] |= 1u << (n->byte & 31);
        n->height = 1;
        for (uint32_t c = i + 1; c < n->end; c = v->nodes[c].end) {
            n->nonascii |= v->nodes[c].nonascii;
            if (v->nodes[c].height + 1 > n->height)
                n->height = (uint16_t)(v->nodes[c].height + 1);
            for (int w = 0; w < 4; w++)
                a[w] |= v->node_ascii[c][w];
        }
    }
    return TDM_OK;
}

tdm_grammar_vocab_t *tdm_grammar_vocab_new(const tdm_tokenizer_t *tok, tdm_error_t *err)
{
    tdm_grammar_vocab_t *v = calloc(1, sizeof *v);
    if (!v)
        goto out_oom;
    v->n_vocab = tdm_tokenizer_n_vocab(tok);
    v->kind = calloc(v->n_vocab + 1, 1);
    v->bytes_off = calloc((size_t)v->n_vocab + 1, sizeof *v->bytes_off);
    v->tok_ids = malloc(((size_t)v->n_vocab + 1) * sizeof *v->tok_ids);
    v->eog = malloc(((size_t)v->n_vocab + 1) * sizeof *v->eog);
    v->trie_bits = calloc(((size_t)v->n_vocab + 31) / 32 + 1, sizeof *v->trie_bits);
    if (!v->kind || !v->bytes_off || !v->tok_ids || !v->eog || !v->trie_bits ||
        read_tokens(v, tok) != TDM_OK)
        goto out_oom;
    uint32_t n = 0;
    for (uint32_t t = 0; t < v->n_vocab; t++) {
        uint32_t len = v->bytes_off[t + 1] - v->bytes_off[t];
        if (v->kind[t] == GRAM_TOK_BYTES) {
            v->tok_ids[n++] = t;
            v->trie_bits[t >> 5] |= 1u << (t & 31);
        } else if (v->kind[t] == GRAM_TOK_EOG)
            v->eog[v->n_eog++] = t;
        if (len > v->max_depth)
            v->max_depth = len;
    }
    if (sort_tokens(v, n) != TDM_OK || build_trie(v, n) != TDM_OK || fill_byte_sets(v) != TDM_OK)
        goto out_oom;
    return v;
out_oom:
    tdm_grammar_vocab_destroy(&v);
    tdm_error_set(err, TDM_ERESOURCE, "out of memory building the grammar vocabulary");
    return NULL;
}
