/* tokenizer_internal.h - the tokenizer's private state, shared by tokenizer.c (loading,
 * decoding), special.c (finding special tokens in text), bpe.c (byte-level BPE and its regex
 * pre-tokenizers) and spm.c (SentencePiece-style BPE).
 *
 * Token ids are int32 (tdm_token_t) throughout; a vocabulary has at most INT32_MAX tokens.
 * Every structure here is filled once by tdm_tokenizer_new and read-only afterwards, so
 * encoders keep their scratch state in locals allocated per call (threads may share a
 * tokenizer).
 */
#ifndef TANDEM_TOKENIZER_INTERNAL_H
#define TANDEM_TOKENIZER_INTERNAL_H

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include "tandem/tokenizer.h"

/* Most regexes in one pre-tokenizer sequence (llama.cpp's longest list has 6). */
#define TDM_TOK_MAX_REGEX 6
/* Most end-of-generation tokens remembered. */
#define TDM_TOK_MAX_EOG 16

/* Open-addressing map from a byte string (a token's text) to its id. */
typedef struct tdm_tok_strmap {
    int32_t *ids;   /* [cap] token id, -1 for an empty slot */
    uint32_t *hash; /* [cap] low 32 bits of the key's XXH3 hash, to skip most memcmp */
    uint64_t mask;  /* cap - 1; cap is a power of two >= 2 * n_vocab */
} tdm_tok_strmap_t;

/* One BPE merge rule: the pair (left id, right id) becomes id `result` at priority `rank`
 * (its index in tokenizer.ggml.merges; lower merges first). */
typedef struct tdm_tok_merge {
    uint64_t key; /* (uint64_t)left << 32 | right; UINT64_MAX for an empty slot */
    int32_t rank;
    int32_t result;
} tdm_tok_merge_t;

/* A node of the special tokens' byte trie (special.c). */
typedef struct tdm_tok_trie_node {
    int32_t first_child; /* index of the first child node, -1 for none */
    int32_t next;        /* index of the next sibling, -1 for none */
    tdm_token_t id;      /* the special token whose text ends here, -1 for none */
    uint8_t byte;        /* the byte that leads here from the parent */
} tdm_tok_trie_node_t;

typedef struct tdm_tok_pairmap {
    tdm_tok_merge_t *slots; /* [mask + 1] */
    uint64_t mask;
} tdm_tok_pairmap_t;

struct tdm_tokenizer {
    tdm_tokenizer_kind_t kind;
    char pre[32]; /* tokenizer.ggml.pre as read ("default" when absent) */
    uint32_t n_vocab;

    char *text;       /* every token's vocabulary string, each NUL-terminated */
    size_t *text_off; /* [n_vocab + 1] offsets into text; length = off[i+1] - off[i] - 1 */
    uint8_t *attr;    /* [n_vocab] tdm_token_attr_t */
    float *scores;    /* [n_vocab] SPM merge scores (0 when the file has none); NULL for BPE */
    char *dec;        /* decoded bytes of every token when not rendering specials */
    size_t *dec_off;  /* [n_vocab + 1] offsets into dec */
    tdm_tok_strmap_t vocab;

    /* BPE: merge rules, the token of each byte's GPT-2 unicode character (-1 if absent),
     * and the pre-tokenizer regexes applied in sequence. SPM: byte_id is the <0xXX> token. */
    tdm_tok_pairmap_t merges;
    tdm_token_t byte_id[256];
    pcre2_code *re[TDM_TOK_MAX_REGEX];
    size_t n_re;
    const char *const *re_src; /* [n_re] the regexes' source (PCRE2); NULL for SPM */
    bool ignore_merges;        /* llama3: a pre-token found whole in the vocab is not merged */

    /* Special tokens (control, unknown, user-defined) with a non-empty text, as a byte trie
     * of their texts (node 0 is the root). */
    tdm_tok_trie_node_t *trie; /* [n_trie] */
    size_t n_trie;
    uint64_t first_any[4];  /* bitmap of first bytes of all special tokens */
    uint64_t first_user[4]; /* ... of user-defined tokens (matched even without parse_special) */

    tdm_token_t bos, eos, eot, unk;
    bool add_bos;
    bool add_space_prefix; /* SPM */
    bool spm_word_split;   /* SPM: no mergeable token has U+2581 after a non-U+2581 byte, so
                              words can be merged independently (an optimisation) */
    tdm_token_t eog[TDM_TOK_MAX_EOG];
    size_t n_eog;
};

/* A growable array of token ids (the encoder's output). */
typedef struct tdm_tok_ids {
    tdm_token_t *v;
    size_t n, cap;
} tdm_tok_ids_t;

/* Appends one id; returns TDM_OK or TDM_ERESOURCE. */
int tdm_tok_ids_push(tdm_tok_ids_t *ids, tdm_token_t id);

/* Looks a byte string up in the vocabulary; -1 when absent. Cannot fail. */
tdm_token_t tdm_tok_lookup(const tdm_tokenizer_t *tok, const char *s, size_t len);

/* Text of token id (in range) and its length in bytes. */
static inline const char *tdm_tok_text(const tdm_tokenizer_t *tok, tdm_token_t id, size_t *len)
{
    *len = tok->text_off[id + 1] - tok->text_off[id] - 1;
    return tok->text + tok->text_off[id];
}

/* ---- special tokens (special.c) ---- */

/* Builds tok->trie and the first-byte bitmaps from the tokens' attributes (which must be final).
 * Errors: TDM_ERESOURCE. */
int tdm_tok_special_init(tdm_tokenizer_t *tok);

/* Frees what tdm_tok_special_init made. */
void tdm_tok_special_free(tdm_tokenizer_t *tok);

/* The special token that matches at the start of text[0..len) (leftmost-longest among
 * user-defined tokens, and control and unknown ones too with parse_special), or -1; *mlen gets
 * its length in bytes. Cannot fail. */
tdm_token_t tdm_tok_special_match(const tdm_tokenizer_t *tok, const char *text, size_t len,
                                  bool parse_special, size_t *mlen);

/* ---- byte-level BPE (bpe.c) ---- */

/* The GPT-2 bytes_to_unicode code point of byte b (printable Latin-1 bytes map to
 * themselves, the others to 256 + n in byte order). Source: openai/gpt-2 encoder.py. */
uint32_t tdm_tok_byte_to_cp(uint8_t b);

/* Fills tok->merges and tok->byte_id from tokenizer.ggml.merges ("left right" strings) and
 * compiles the regexes of tok->pre. Errors: TDM_EINVALID (unknown pre, malformed merge: the
 * message names it), TDM_EINTERNAL (PCRE2 compile error), TDM_ERESOURCE. */
int tdm_tok_bpe_init(tdm_tokenizer_t *tok, const tdm_gguf_t *g, tdm_error_t *err);

/* Frees what tdm_tok_bpe_init made. */
void tdm_tok_bpe_free(tdm_tokenizer_t *tok);

/* Encodes one fragment of plain text (no special tokens) with byte-level BPE, appending ids.
 * Errors: TDM_ERESOURCE, TDM_EINTERNAL (PCRE2 match failure). */
int tdm_tok_bpe_encode(const tdm_tokenizer_t *tok, const char *text, size_t len, tdm_tok_ids_t *out,
                       tdm_error_t *err);

/* ---- SentencePiece-style BPE (spm.c) ---- */

/* Encodes one fragment of plain text, prefixing U+2581 when space_prefix, appending ids.
 * Errors: TDM_ERESOURCE. */
int tdm_tok_spm_encode(const tdm_tokenizer_t *tok, const char *text, size_t len, bool space_prefix,
                       tdm_tok_ids_t *out, tdm_error_t *err);

/* TDM_DEFINE_BIGRAM_HEAP(work_t, elem_t, less): defines static heap_push(work_t *, elem_t) and
 * heap_pop(work_t *) -> elem_t over a binary min-heap in w->heap[0..w->n_heap) ordered by
 * less(const elem_t *, const elem_t *). Capacity is the caller's (the merge loops size the heap
 * up front). Shared by the BPE and SentencePiece merge loops, whose bigram types differ. */
#define TDM_DEFINE_BIGRAM_HEAP(work_t, elem_t, less)                                               \
    static void heap_push(work_t *w, elem_t e)                                                     \
    {                                                                                              \
        size_t i = w->n_heap++;                                                                    \
        while (i > 0) {                                                                            \
            size_t p = (i - 1) / 2;                                                                \
            if (!less(&e, &w->heap[p]))                                                            \
                break;                                                                             \
            w->heap[i] = w->heap[p];                                                               \
            i = p;                                                                                 \
        }                                                                                          \
        w->heap[i] = e;                                                                            \
    }                                                                                              \
    static elem_t heap_pop(work_t *w)                                                              \
    {                                                                                              \
        elem_t top = w->heap[0];                                                                   \
        elem_t last = w->heap[--w->n_heap];                                                        \
        size_t n = w->n_heap, i = 0;                                                               \
        for (;;) {                                                                                 \
            size_t c = 2 * i + 1;                                                                  \
            if (c >= n)                                                                            \
                break;                                                                             \
            if (c + 1 < n && less(&w->heap[c + 1], &w->heap[c]))                                   \
                c++;                                                                               \
            if (!less(&w->heap[c], &last))                                                         \
                break;                                                                             \
            w->heap[i] = w->heap[c];                                                               \
            i = c;                                                                                 \
        }                                                                                          \
        if (n > 0)                                                                                 \
            w->heap[i] = last;                                                                     \
        return top;                                                                                \
    }

#endif /* TANDEM_TOKENIZER_INTERNAL_H */
