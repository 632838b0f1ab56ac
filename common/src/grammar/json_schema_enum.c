/* json_schema_enum.c - the values of enum / const as one GBNF expression: the scalar values
 * (strings, numbers, booleans, null) as a trie of their JSON texts, the objects and arrays as
 * alternatives beside it.
 *
 * Why a trie: the engine keeps one parse stack per live alternative, and a flat alternation of
 * N literals starts N stacks at once (1,554 strings exhaust the 1,024-stack limit). In a trie
 * the alternatives at a node begin with different code points, so at most one survives each
 * character and a node starts as many stacks as it has children. Texts are those js_literal
 * matches (json.dumps's; an integral number in both forms). Branching is by code point, never
 * inside a UTF-8 sequence. Below TRIE_MAX_DEPTH branching levels the rest of a subtree is
 * written as flat alternatives, so neither this code nor the grammar parser recurses without
 * bound on a chain of prefixes ("a", "aa", "aaa", ...).
 */
#include <stdlib.h>
#include <string.h>

#include "json_schema_internal.h"

#define TRIE_MAX_DEPTH 64 /* branching levels written as nested groups */

static int cmp_text(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Whether s[i] is a UTF-8 continuation byte (not the start of a code point). */
static bool continuation(const char *s, size_t i)
{
    return ((unsigned char)s[i] & 0xC0) == 0x80;
}

/* Length of the common prefix of a and b from byte depth on, ending on a code point boundary
 * of both. */
static size_t common_prefix(const char *a, const char *b, size_t depth)
{
    size_t k = depth;
    while (a[k] && a[k] == b[k])
        k++;
    while (k > depth && (continuation(a, k) || continuation(b, k)))
        k--;
    return k - depth;
}

/* Bytes of the code point at s (at least 1). */
static size_t cp_len(const char *s)
{
    size_t k = 1;
    while (s[k] && continuation(s, k))
        k++;
    return k;
}

/* Appends the trie of t[0..n) (sorted, distinct, sharing their first depth bytes) from byte
 * depth on: "( a ... | b ... )", with "?" when t[0] ends at depth. level counts the nesting. */
static void trie(tdm_buf_t *b, char **t, size_t n, size_t depth, int level)
{
    bool end = t[0][depth] == 0; /* sorted and distinct: only the first can end here */
    size_t i = end ? 1 : 0;
    if (i == n)
        return;
    size_t first_len = cp_len(t[i] + depth);
    bool single = !end && strncmp(t[i], t[n - 1], depth + first_len) == 0;
    if (!single)
        tdm_buf_puts(b, "( ");
    for (size_t alts = 0; i < n; alts++) {
        size_t cl = cp_len(t[i] + depth), j = i + 1;
        while (j < n && strncmp(t[j], t[i], depth + cl) == 0)
            j++;
        tdm_buf_puts(b, alts ? " | " : "");
        if (level >= TRIE_MAX_DEPTH) { /* deep enough: the rest as flat alternatives */
            for (size_t k = i; k < j; k++) {
                tdm_buf_puts(b, k > i ? " | " : "");
                js_gbnf_lit(b, t[k] + depth, strlen(t[k] + depth));
            }
            i = j;
            continue;
        }
        size_t lcp = j - i == 1 ? strlen(t[i] + depth) : common_prefix(t[i], t[j - 1], depth);
        js_gbnf_lit(b, t[i] + depth, lcp);
        if (j - i > 1) {
            tdm_buf_puts(b, " ");
            trie(b, t + i, j - i, depth + lcp, level + 1);
        }
        i = j;
    }
    if (!single)
        tdm_buf_puts(b, end ? " )?" : " )");
}

/* Appends the scalar texts of vals[n] to *texts (sorted and distinct on return). Returns 0
 * or TDM_ERESOURCE. */
static int collect_texts(json_t *const *vals, size_t n, char ***texts, size_t *n_texts)
{
    char **t = calloc(2 * n + 1, sizeof *t);
    size_t m = 0;
    int rc = t ? 0 : TDM_ERESOURCE;
    for (size_t i = 0; i < n && rc == 0; i++) {
        tdm_buf_t f[2] = {TDM_BUF_INIT, TDM_BUF_INIT};
        int k = js_scalar_texts(vals[i], f);
        for (int x = 0; x < k; x++)
            if (!(t[m++] = tdm_buf_take(&f[x])))
                rc = TDM_ERESOURCE;
        rc = k < 0 ? k : rc;
        tdm_buf_free(&f[0]);
        tdm_buf_free(&f[1]);
    }
    if (rc == 0 && m > 0) {
        qsort(t, m, sizeof *t, cmp_text);
        size_t u = 1;
        for (size_t i = 1; i < m; i++) {
            if (strcmp(t[i], t[u - 1]) == 0)
                free(t[i]);
            else
                t[u++] = t[i];
        }
        m = u;
    }
    *texts = t;
    *n_texts = m;
    return rc;
}

int js_enum_expr(js_ctx_t *c, json_t *const *vals, size_t n, tdm_buf_t *body)
{
    char **texts = NULL;
    size_t n_texts = 0, alts = 0;
    int rc = collect_texts(vals, n, &texts, &n_texts);
    if (rc == 0 && n_texts > 0) {
        trie(body, texts, n_texts, 0, 0);
        alts++;
    }
    for (size_t i = 0; i < n && rc == 0; i++) {
        if (!json_is_object(vals[i]) && !json_is_array(vals[i]))
            continue;
        tdm_buf_puts(body, alts++ ? " | " : "");
        rc = js_literal(c, vals[i], body);
    }
    for (size_t i = 0; texts && i < n_texts; i++)
        free(texts[i]);
    free(texts);
    if (rc == TDM_ERESOURCE || body->oom)
        return js_oom(c);
    return rc;
}
