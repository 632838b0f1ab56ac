/* spm.c - SentencePiece-style BPE (tokenizer.ggml.model = "llama"): spaces become U+2581,
 * adjacent symbols are merged highest score first, and what is left that is not a token falls
 * back to <0xXX> byte tokens.
 *
 * Source: SentencePiece's bpe_model.cc as llama.cpp reimplements it (llm_tokenizer_spm):
 * start from UTF-8 characters, keep a priority queue of adjacent pairs whose concatenation is
 * a token, ordered by that token's score (ties: leftmost first), merge until none is left.
 * Every symbol is a contiguous range of the escaped text, so a candidate's text is looked up
 * in place without copying. Only normal and user-defined tokens are formed by merging (as in
 * SentencePiece: control, unknown and byte pieces are never produced from text).
 */
#include <stdlib.h>
#include <string.h>

#include "tokenizer_internal.h"

#define SPACE_MARK "\xe2\x96\x81" /* U+2581 */

typedef struct sym {
    size_t off; /* start in the escaped text */
    size_t n;   /* bytes; 0 once merged into its left neighbour */
    int32_t prev, next;
} sym_t;

typedef struct spm_bigram {
    float score;
    int32_t left, right;
    size_t size; /* bytes of the merged text, to detect stale entries */
} spm_bigram_t;

typedef struct spm_work {
    const char *text;
    sym_t *sym;
    spm_bigram_t *heap; /* max-heap by score, then min left */
    size_t n_heap;
} spm_work_t;

static bool bigram_before(const spm_bigram_t *a, const spm_bigram_t *b)
{
    return a->score > b->score || (a->score == b->score && a->left < b->left);
}

TDM_DEFINE_BIGRAM_HEAP(spm_work_t, spm_bigram_t, bigram_before)

static bool mergeable(const tdm_tokenizer_t *tok, tdm_token_t id)
{
    return id >= 0 &&
           (tok->attr[id] == TDM_TOKEN_NORMAL || tok->attr[id] == TDM_TOKEN_USER_DEFINED);
}

static void try_add(const tdm_tokenizer_t *tok, spm_work_t *w, int32_t l, int32_t r)
{
    if (l < 0 || r < 0)
        return;
    size_t size = w->sym[l].n + w->sym[r].n;
    tdm_token_t id = tdm_tok_lookup(tok, w->text + w->sym[l].off, size);
    if (!mergeable(tok, id))
        return;
    heap_push(w, (spm_bigram_t){tok->scores[id], l, r, size});
}

/* Bytes of the character at s (n > 0 bytes left): the length of a valid UTF-8 sequence, else
 * 1, so an invalid byte never swallows the bytes after it (llama.cpp trusts the lead byte; the
 * two agree on valid UTF-8). */
static size_t char_len(const unsigned char *s, size_t n)
{
    unsigned char c = s[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3;
        lo = c == 0xE0 ? 0xA0 : 0x80;
        hi = c == 0xED ? 0x9F : 0xBF;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4;
        lo = c == 0xF0 ? 0x90 : 0x80;
        hi = c == 0xF4 ? 0x8F : 0xBF;
    } else {
        return 1;
    }
    if (len > n || s[1] < lo || s[1] > hi)
        return 1;
    for (size_t i = 2; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 1;
    }
    return len;
}

/* Appends the tokens of one final symbol: itself when it is a token, else its bytes. */
static int emit_symbol(const tdm_tokenizer_t *tok, const char *s, size_t n, tdm_tok_ids_t *out)
{
    tdm_token_t id = tdm_tok_lookup(tok, s, n);
    if (id >= 0 && tok->attr[id] != TDM_TOKEN_CONTROL && tok->attr[id] != TDM_TOKEN_BYTE)
        return tdm_tok_ids_push(out, id);
    for (size_t i = 0; i < n; i++) {
        tdm_token_t b = tok->byte_id[(uint8_t)s[i]];
        if (b < 0)
            b = tok->unk;
        if (b >= 0 && tdm_tok_ids_push(out, b) != TDM_OK)
            return TDM_ERESOURCE;
    }
    return TDM_OK;
}

/* Merges the symbols of esc[start, end) and appends their tokens. Errors: TDM_ERESOURCE. */
static int merge_segment(const tdm_tokenizer_t *tok, spm_work_t *w, size_t start, size_t end,
                         tdm_tok_ids_t *out)
{
    /* Symbols: one per UTF-8 character or invalid byte. */
    int32_t n_sym = 0;
    for (size_t off = start; off < end; n_sym++) {
        size_t cl = char_len((const unsigned char *)w->text + off, end - off);
        w->sym[n_sym] = (sym_t){off, cl, n_sym - 1, off + cl < end ? n_sym + 1 : -1};
        off += cl;
    }
    w->n_heap = 0;
    for (int32_t i = 0; i + 1 < n_sym; i++)
        try_add(tok, w, i, i + 1);
    while (w->n_heap > 0) {
        spm_bigram_t b = heap_pop(w);
        sym_t *l = &w->sym[b.left], *r = &w->sym[b.right];
        /* Stale if either side was merged away or grew since the pair was pushed. */
        if (l->n == 0 || r->n == 0 || l->n + r->n != b.size || l->next != b.right)
            continue;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            w->sym[r->next].prev = b.left;
        try_add(tok, w, l->prev, b.left);
        try_add(tok, w, b.left, l->next);
    }
    for (int32_t i = 0; i >= 0 && n_sym > 0; i = w->sym[i].next) {
        if (emit_symbol(tok, w->text + w->sym[i].off, w->sym[i].n, out) != TDM_OK)
            return TDM_ERESOURCE;
    }
    return TDM_OK;
}

int tdm_tok_spm_encode(const tdm_tokenizer_t *tok, const char *text, size_t len, bool space_prefix,
                       tdm_tok_ids_t *out, tdm_error_t *err)
{
    if (len == 0)
        return TDM_OK;
    int rc = TDM_OK;
    spm_work_t w = {0};
    char *esc = NULL;
    /* Escaped text: optional U+2581 prefix, every ' ' (1 byte) replaced by U+2581 (3). */
    size_t cap;
    if (!tdm_mul_size(len, 3, &cap) || !tdm_add_size(cap, 3, &cap) || cap > INT32_MAX)
        return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: text too long (%zu bytes)", len);
    esc = malloc(cap);
    if (!esc)
        return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
    size_t n = 0;
    if (space_prefix) {
        memcpy(esc, SPACE_MARK, 3);
        n = 3;
    }
    for (size_t i = 0; i < len; i++) {
        if (text[i] == ' ') {
            memcpy(esc + n, SPACE_MARK, 3);
            n += 3;
        } else {
            esc[n++] = text[i];
        }
    }

    w.text = esc;
    w.sym = malloc(n * sizeof *w.sym);
    w.heap = malloc(3 * n * sizeof *w.heap);
    if (!w.sym || !w.heap) {
        rc = tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
        goto out_free;
    }
    /* With spm_word_split, words (a non-U+2581 character followed by U+2581 starts a new one)
     * are merged independently: no token spans their boundary, so no candidate pair does,
     * and the merges inside each word happen in the same order as over the whole text. */
    size_t seg = 0;
    for (size_t p = 1; p + 3 <= n && tok->spm_word_split; p++) {
        if (memcmp(esc + p, SPACE_MARK, 3) == 0 &&
            !(p >= 3 && memcmp(esc + p - 3, SPACE_MARK, 3) == 0)) {
            if (merge_segment(tok, &w, seg, p, out) != TDM_OK)
                goto out_oom;
            seg = p;
        }
    }
    if (merge_segment(tok, &w, seg, n, out) != TDM_OK)
        goto out_oom;
    goto out_free;

out_oom:
    rc = tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
out_free:
    free(w.heap);
    free(w.sym);
    free(esc);
    return rc;
}
