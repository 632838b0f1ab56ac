/* bpe.c - byte-level BPE (tokenizer.ggml.model = "gpt2"): the regex pre-tokenizers named by
 * tokenizer.ggml.pre, GPT-2's bytes_to_unicode mapping, and merging by rank.
 *
 * Sources: the pre-tokenizer regexes are those of the Hugging Face tokenizer.json files as
 * llama.cpp lists them (llama-vocab.cpp, llm_tokenizer_bpe); the merge loop is the usual
 * linked list of symbols plus a priority queue of candidate pairs ordered by (rank, position),
 * which is what Hugging Face tokenizers' BPE::merge_word does: O(n log n) per pre-token.
 *
 * Regexes run under PCRE2 with UTF + UCP (+ MATCH_INVALID_UTF, so invalid UTF-8 in the input
 * is never matched and ends up in the unmatched spans, which are kept as pieces). `\s` is
 * written [\s\x{85}] because PCRE2's UCP \s leaves out U+0085, which the Unicode White_Space
 * property (and Oniguruma, used by the reference tokenizers) includes.
 */
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "tokenizer_internal.h"

/* ---- pre-tokenizer regexes ---- */

#define WS "\\s\\x{85}"
#define RE_GPT2                                                                                    \
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^" WS "\\p{L}\\p{N}]+|[" WS "]+(?![^" WS       \
    "])|[" WS "]+"
#define RE_LLAMA3_HEAD                                                                             \
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|"
#define RE_LLAMA3_TAIL                                                                             \
    "| ?[^" WS "\\p{L}\\p{N}]+[\\r\\n]*|[" WS "]*[\\r\\n]+|[" WS "]+(?![^" WS "])|[" WS "]+"

/* deepseek-llm: letters and punctuation as explicit ranges (its tokenizer.json's Split
 * patterns, as llama.cpp lists them), not \p{L} / \p{P}. */
#define RE_DEEPSEEK_LLM_LETTERS                                                                    \
    "A-Za-z\\x{B5}\\x{C0}-\\x{D6}\\x{D8}-\\x{F6}\\x{F8}-\\x{1BA}\\x{1BC}-\\x{1BF}\\x{1C4}-"        \
    "\\x{293}\\x{295}-\\x{2AF}\\x{370}-\\x{373}\\x{376}\\x{377}\\x{37B}-\\x{37D}\\x{37F}"          \
    "\\x{386}\\x{388}-\\x{38A}\\x{38C}\\x{38E}-\\x{3A1}\\x{3A3}-\\x{3F5}\\x{3F7}-\\x{481}"         \
    "\\x{48A}-\\x{52F}\\x{531}-\\x{556}\\x{10A0}-\\x{10C5}\\x{13A0}-\\x{13F5}\\x{13F8}-"           \
    "\\x{13FD}\\x{1C90}-\\x{1CBA}\\x{1CBD}-\\x{1CBF}\\x{1D00}-\\x{1D2B}\\x{1D6B}-\\x{1D77}"        \
    "\\x{1D79}-\\x{1D9A}\\x{1E00}-\\x{1F15}\\x{1F18}-\\x{1F1D}\\x{1F20}-\\x{1F45}\\x{1F48}-"       \
    "\\x{1F4D}\\x{1F50}-\\x{1F57}\\x{1F59}\\x{1F5B}\\x{1F5D}\\x{1F5F}-\\x{1F7D}\\x{1F80}-"         \
    "\\x{1FB4}\\x{1FB6}-\\x{1FBC}\\x{1FBE}\\x{1FC2}-\\x{1FC4}\\x{1FC6}-\\x{1FCC}\\x{1FD0}-"        \
    "\\x{1FD3}\\x{1FD6}-\\x{1FDB}\\x{1FE0}-\\x{1FEC}\\x{1FF2}-\\x{1FF4}\\x{1FF6}-\\x{1FFC}"        \
    "\\x{2102}\\x{2107}\\x{210A}-\\x{2113}\\x{2115}\\x{2119}-\\x{211D}\\x{2124}\\x{2126}"          \
    "\\x{2128}\\x{212A}-\\x{212D}\\x{212F}-\\x{2134}\\x{2139}\\x{213C}-\\x{213F}\\x{2145}-"        \
    "\\x{2149}\\x{214E}\\x{2183}\\x{2184}\\x{2C00}-\\x{2C7B}\\x{2C7E}-\\x{2CE4}\\x{2CEB}-"         \
    "\\x{2CEE}\\x{2CF2}\\x{2CF3}\\x{A640}-\\x{A66D}\\x{A680}-\\x{A69B}\\x{A722}-\\x{A76F}"         \
    "\\x{A771}-\\x{A787}\\x{A78B}-\\x{A78E}\\x{AB70}-\\x{ABBF}\\x{FB00}-\\x{FB06}\\x{FB13}-"       \
    "\\x{FB17}\\x{FF21}-\\x{FF3A}\\x{FF41}-\\x{FF5A}\\x{10400}-\\x{1044F}\\x{104B0}-"              \
    "\\x{104D3}\\x{104D8}-\\x{104FB}\\x{10C80}-\\x{10CB2}\\x{10CC0}-\\x{10CF2}\\x{118A0}-"         \
    "\\x{118DF}\\x{1E900}-\\x{1E943}"
#define RE_DEEPSEEK_LLM_PUNCT                                                                      \
    "!-/:-~\\x{FF01}-\\x{FF0F}\\x{FF1A}-\\x{FF5E}\\x{2018}-\\x{201F}\\x{3000}-\\x{3002}"

typedef struct bpe_pre {
    const char *names[6];                 /* tokenizer.ggml.pre values (NULL-terminated) */
    const char *regex[TDM_TOK_MAX_REGEX]; /* applied in order (NULL-terminated) */
    bool ignore_merges;
} bpe_pre_t;

static const bpe_pre_t bpe_pres[] = {
    {{"gpt-2", "mpt", NULL}, {RE_GPT2, NULL}, false},
    {{"smollm", "starcoder", "refact", "command-r", NULL}, {"\\p{N}", RE_GPT2, NULL}, false},
    {{"llama3", "llama-bpe", NULL}, {RE_LLAMA3_HEAD "\\p{N}{1,3}" RE_LLAMA3_TAIL, NULL}, true},
    {{"qwen2", NULL}, {RE_LLAMA3_HEAD "\\p{N}" RE_LLAMA3_TAIL, NULL}, false},
    {{"deepseek-coder", NULL},
     {"[\\r\\n]", "[" WS "]?\\p{L}+", "[" WS "]?\\p{P}+",
      "[\\x{4E00}-\\x{9FA5}\\x{0800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+", "\\p{N}", NULL},
     false},
    {{"deepseek-llm", NULL},
     {"[\\r\\n]", "[" WS "]?[" RE_DEEPSEEK_LLM_LETTERS "]+",
      "[" WS "]?[" RE_DEEPSEEK_LLM_PUNCT "]+", "[" WS "]+$",
      "[\\x{4E00}-\\x{9FA5}\\x{800}-\\x{4E00}\\x{AC00}-\\x{D7FF}]+", "\\p{N}+"},
     false},
    {{"falcon", NULL}, {"[\\p{P}\\$\\+<=>\\^~\\|`]+", RE_GPT2, "[0-9][0-9][0-9]", NULL}, false},
    {{"default", NULL},
     {"[\\p{P}\\$\\+<=>\\^~\\|]+", RE_GPT2, "\\p{N}+", "[0-9][0-9][0-9]", NULL},
     false},
};
#define SUPPORTED_PRES                                                                             \
    "gpt-2, mpt, smollm, starcoder, refact, command-r, llama3, llama-bpe, qwen2, deepseek-coder, " \
    "deepseek-llm, falcon, default"

uint32_t tdm_tok_byte_to_cp(uint8_t b)
{
    /* bytes_to_unicode: '!'..'~', U+00A1..U+00AC and U+00AE..U+00FF stand for themselves;
     * the other 68 bytes get 256, 257, ... in increasing byte order. */
    if ((b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE)
        return b;
    uint32_t n = 0;
    for (uint32_t c = 0; c < b; c++) {
        if (!((c >= 0x21 && c <= 0x7E) || (c >= 0xA1 && c <= 0xAC) || c >= 0xAE))
            n++;
    }
    return 256 + n;
}

/* UTF-8 of a code point below 0x800 (all bytes_to_unicode outputs are); returns its length. */
static size_t utf8_put_small(uint32_t cp, char *out)
{
    if (cp < 0x80) {
        out[0] = (char)cp;
        return 1;
    }
    out[0] = (char)(0xC0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3F));
    return 2;
}

static uint64_t pair_key(tdm_token_t l, tdm_token_t r)
{
    return (uint64_t)(uint32_t)l << 32 | (uint32_t)r;
}

/* MurmurHash3's fmix64 finaliser: every key bit reaches every low bit used as the index. */
static uint64_t pair_hash(uint64_t key)
{
    key ^= key >> 33;
    key *= 0xFF51AFD7ED558CCDULL;
    key ^= key >> 33;
    key *= 0xC4CEB9FE1A85EC53ULL;
    return key ^ (key >> 33);
}

/* Inserts a merge unless the pair is already there (the earlier, lower rank wins). */
static void pairmap_put(tdm_tok_pairmap_t *m, uint64_t key, int32_t rank, int32_t result)
{
    for (uint64_t i = pair_hash(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key)
            return;
        if (m->slots[i].key == UINT64_MAX) {
            m->slots[i].key = key;
            m->slots[i].rank = rank;
            m->slots[i].result = result;
            return;
        }
    }
}

static const tdm_tok_merge_t *pairmap_get(const tdm_tok_pairmap_t *m, uint64_t key)
{
    for (uint64_t i = pair_hash(key) & m->mask;; i = (i + 1) & m->mask) {
        if (m->slots[i].key == key)
            return &m->slots[i];
        if (m->slots[i].key == UINT64_MAX)
            return NULL;
    }
}

static int compile_regexes(tdm_tokenizer_t *tok, const bpe_pre_t *pre, tdm_error_t *err)
{
    uint32_t opts = PCRE2_UTF | PCRE2_UCP;
#ifdef PCRE2_MATCH_INVALID_UTF
    opts |= PCRE2_MATCH_INVALID_UTF;
#endif
    for (size_t i = 0; i < TDM_TOK_MAX_REGEX && pre->regex[i]; i++) {
        int ecode = 0;
        PCRE2_SIZE eoff = 0;
        pcre2_code *re = pcre2_compile((PCRE2_SPTR)pre->regex[i], PCRE2_ZERO_TERMINATED, opts,
                                       &ecode, &eoff, NULL);
        if (!re) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(ecode, msg, sizeof msg);
            return tdm_error_set(err, TDM_EINTERNAL,
                                 "tokenizer: pre-tokenizer '%s' regex %zu: PCRE2 error at %zu: %s",
                                 tok->pre, i, (size_t)eoff, (const char *)msg);
        }
        /* JIT is an optimisation only: without it pcre2_match interprets. */
        (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE);
        tok->re[tok->n_re++] = re;
    }
    return TDM_OK;
}

/* The merge rules (tokenizer.ggml.merges, "left right", in priority order) into the pair
 * map tok->merges: (left id, right id) -> (rank, merged id). */
static int load_merges(tdm_tokenizer_t *tok, const tdm_gguf_t *g, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = NULL;
    int rc = tdm_gguf_get_arr(g, "tokenizer.ggml.merges", TDM_GGUF_VTYPE_STRING, &kv, err);
    if (rc != TDM_OK)
        return tdm_error_prefix(err, rc == TDM_ENOTFOUND ? TDM_EINVALID : rc,
                                "tokenizer: byte-level BPE needs tokenizer.ggml.merges: ");
    if (kv->arr_n > INT32_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer: tokenizer.ggml.merges has %llu "
                             "entries (at most %d)",
                             (unsigned long long)kv->arr_n, INT32_MAX);
    uint64_t cap = 16;
    while (cap < 2 * kv->arr_n + 16)
        cap <<= 1;
    tok->merges.slots = malloc(cap * sizeof *tok->merges.slots);
    if (!tok->merges.slots)
        return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory (merges)");
    tok->merges.mask = cap - 1;
    for (uint64_t i = 0; i < cap; i++)
        tok->merges.slots[i].key = UINT64_MAX;

    tdm_buf_t joined = TDM_BUF_INIT; /* left + right, the merged token's text */
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        const char *s = kv->arr_strs[i].data;
        size_t n = (size_t)kv->arr_strs[i].len;
        /* "left right": the separator is the first space after the first byte. */
        const char *sp = n > 1 ? memchr(s + 1, ' ', n - 1) : NULL;
        if (!sp) {
            tdm_buf_free(&joined);
            return tdm_error_set(err, TDM_EINVALID,
                                 "tokenizer: tokenizer.ggml.merges[%llu] '%.*s' is not "
                                 "\"left right\"",
                                 (unsigned long long)i, (int)(n > 64 ? 64 : n), s);
        }
        size_t nl = (size_t)(sp - s), nr = n - nl - 1;
        tdm_buf_clear(&joined);
        if (tdm_buf_append(&joined, s, nl) != 0 || tdm_buf_append(&joined, sp + 1, nr) != 0) {
            tdm_buf_free(&joined);
            return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory (merges)");
        }
        tdm_token_t l = tdm_tok_lookup(tok, s, nl);
        tdm_token_t r = tdm_tok_lookup(tok, sp + 1, nr);
        tdm_token_t res = tdm_tok_lookup(tok, joined.data, joined.len);
        /* A rule whose parts or result are not tokens can never apply: skip it. */
        if (l >= 0 && r >= 0 && res >= 0)
            pairmap_put(&tok->merges, pair_key(l, r), (int32_t)i, res);
    }
    tdm_buf_free(&joined);
    return TDM_OK;
}

int tdm_tok_bpe_init(tdm_tokenizer_t *tok, const tdm_gguf_t *g, tdm_error_t *err)
{
    const bpe_pre_t *pre = NULL;
    for (size_t i = 0; i < sizeof bpe_pres / sizeof bpe_pres[0] && !pre; i++) {
        for (size_t j = 0; bpe_pres[i].names[j]; j++) {
            if (strcmp(bpe_pres[i].names[j], tok->pre) == 0)
                pre = &bpe_pres[i];
        }
    }
    if (!pre)
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer: unsupported tokenizer.ggml.pre '%s' (supported: %s)",
                             tok->pre, SUPPORTED_PRES);
    tok->ignore_merges = pre->ignore_merges;
    tok->re_src = pre->regex;

    for (int b = 0; b < 256; b++) {
        char s[2];
        size_t n = utf8_put_small(tdm_tok_byte_to_cp((uint8_t)b), s);
        tok->byte_id[b] = tdm_tok_lookup(tok, s, n);
    }
    int rc = load_merges(tok, g, err);
    if (rc != TDM_OK)
        return rc;
    return compile_regexes(tok, pre, err);
}

void tdm_tok_bpe_free(tdm_tokenizer_t *tok)
{
    free(tok->merges.slots);
    tok->merges.slots = NULL;
    for (size_t i = 0; i < tok->n_re; i++)
        pcre2_code_free(tok->re[i]);
    tok->n_re = 0;
}

/* ---- encoding ---- */

typedef struct span {
    size_t off, len; /* bytes, relative to the fragment */
} span_t;

typedef struct spans {
    span_t *v;
    size_t n, cap;
} spans_t;

/* A candidate merge of symbols left and right (adjacent when pushed). */
typedef struct bigram {
    int32_t rank;
    int32_t left, right;
    tdm_token_t lid, rid, result;
} bigram_t;

/* Per-call scratch of the merge loop, grown to the longest pre-token. */
typedef struct bpe_work {
    tdm_token_t *id; /* [cap] token of each symbol; -2 once merged away */
    int32_t *prev, *next;
    bigram_t *heap; /* [3 * cap]: n - 1 initial pairs + at most 2 per merge */
    size_t n_heap;
    char *str; /* [2 * cap] the byte-level string of a pre-token (ignore_merges) */
    size_t cap;
} bpe_work_t;

static int spans_push(spans_t *s, size_t off, size_t len)
{
    if (s->n == s->cap) {
        size_t cap = s->cap ? 2 * s->cap : 64;
        span_t *v = realloc(s->v, cap * sizeof *v);
        if (!v)
            return TDM_ERESOURCE;
        s->v = v;
        s->cap = cap;
    }
    s->v[s->n].off = off;
    s->v[s->n].len = len;
    s->n++;
    return TDM_OK;
}

/* Splits every span of in by re into out: matches and the unmatched text between them are
 * all kept, in order. */
static int split_regex(const pcre2_code *re, pcre2_match_data *md, const char *text,
                       const spans_t *in, spans_t *out, tdm_error_t *err)
{
    out->n = 0;
    for (size_t k = 0; k < in->n; k++) {
        const span_t s = in->v[k];
        const PCRE2_SPTR sub = (PCRE2_SPTR)(text + s.off);
        size_t pos = 0;
        while (pos < s.len) {
            int rc = pcre2_match(re, sub, s.len, pos, 0, md, NULL);
            if (rc == PCRE2_ERROR_NOMATCH)
                break;
            if (rc < 0) {
                PCRE2_UCHAR msg[256];
                pcre2_get_error_message(rc, msg, sizeof msg);
                return tdm_error_set(err, TDM_EINTERNAL, "tokenizer: PCRE2 match failed: %s",
                                     (const char *)msg);
            }
            const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
            size_t ms = ov[0], me = ov[1];
            if (me <= ms) {
                /* None of our regexes can match empty; stop rather than loop. */
                break;
            }
            if ((ms > pos && spans_push(out, s.off + pos, ms - pos) != TDM_OK) ||
                spans_push(out, s.off + ms, me - ms) != TDM_OK)
                return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
            pos = me;
        }
        if (pos < s.len && spans_push(out, s.off + pos, s.len - pos) != TDM_OK)
            return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
    }
    return TDM_OK;
}

static bool bigram_less(const bigram_t *a, const bigram_t *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

TDM_DEFINE_BIGRAM_HEAP(bpe_work_t, bigram_t, bigram_less)

static void try_add(const tdm_tokenizer_t *tok, bpe_work_t *w, int32_t l, int32_t r)
{
    if (l < 0 || r < 0 || w->id[l] < 0 || w->id[r] < 0)
        return;
    const tdm_tok_merge_t *m = pairmap_get(&tok->merges, pair_key(w->id[l], w->id[r]));
    if (!m)
        return;
    heap_push(w, (bigram_t){m->rank, l, r, w->id[l], w->id[r], m->result});
}

static int work_reserve(bpe_work_t *w, size_t n)
{
    if (n <= w->cap)
        return TDM_OK;
    size_t cap = w->cap ? w->cap : 64;
    while (cap < n)
        cap *= 2;
    free(w->id);
    free(w->prev);
    free(w->next);
    free(w->heap);
    free(w->str);
    w->id = malloc(cap * sizeof *w->id);
    w->prev = malloc(cap * sizeof *w->prev);
    w->next = malloc(cap * sizeof *w->next);
    w->heap = malloc(3 * cap * sizeof *w->heap);
    w->str = malloc(2 * cap);
    w->cap = cap;
    if (!w->id || !w->prev || !w->next || !w->heap || !w->str) {
        w->cap = 0;
        return TDM_ERESOURCE;
    }
    return TDM_OK;
}

static void work_free(bpe_work_t *w)
{
    free(w->id);
    free(w->prev);
    free(w->next);
    free(w->heap);
    free(w->str);
}

/* A byte with no token of its own (an incomplete vocabulary) becomes unk when there is one. */
static int push_byte(const tdm_tokenizer_t *tok, uint8_t b, tdm_tok_ids_t *out)
{
    tdm_token_t id = tok->byte_id[b] >= 0 ? tok->byte_id[b] : tok->unk;
    return id >= 0 ? tdm_tok_ids_push(out, id) : TDM_OK;
}

/* Merges one pre-token (n >= 1 raw bytes) and appends its tokens. */
static int bpe_piece(const tdm_tokenizer_t *tok, const uint8_t *s, size_t n, bpe_work_t *w,
                     tdm_tok_ids_t *out)
{
    if (n == 1)
        return push_byte(tok, s[0], out);
    if (n > INT32_MAX)
        return TDM_ERESOURCE;
    if (work_reserve(w, n) != TDM_OK)
        return TDM_ERESOURCE;
    if (tok->ignore_merges) {
        size_t k = 0;
        for (size_t i = 0; i < n; i++)
            k += utf8_put_small(tdm_tok_byte_to_cp(s[i]), w->str + k);
        tdm_token_t id = tdm_tok_lookup(tok, w->str, k);
        if (id >= 0)
            return tdm_tok_ids_push(out, id);
    }
    for (size_t i = 0; i < n; i++) {
        w->id[i] = tok->byte_id[s[i]];
        w->prev[i] = (int32_t)i - 1;
        w->next[i] = i + 1 < n ? (int32_t)i + 1 : -1;
    }
    w->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++)
        try_add(tok, w, (int32_t)i, (int32_t)i + 1);
    while (w->n_heap > 0) {
        bigram_t b = heap_pop(w);
        /* Stale when either side has changed since the pair was pushed: a symbol's id only
         * ever grows into a longer token, so equal ids and adjacency mean the same pair. */
        if (w->id[b.left] != b.lid || w->id[b.right] != b.rid || w->next[b.left] != b.right)
            continue;
        int32_t l = b.left, r = b.right;
        w->id[l] = b.result;
        w->id[r] = -2;
        w->next[l] = w->next[r];
        if (w->next[r] >= 0)
            w->prev[w->next[r]] = l;
        try_add(tok, w, w->prev[l], l);
        try_add(tok, w, l, w->next[l]);
    }
    for (int32_t i = 0; i >= 0; i = w->next[i]) {
        int rc = w->id[i] >= 0 ? tdm_tok_ids_push(out, w->id[i]) : push_byte(tok, s[i], out);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

/* Per-call cache of encoded pieces: the ids of a piece already encoded in this call are
 * copied from where they were first written in the output. */
#define CACHE_MAX_PIECE 32 /* bytes (and tokens) of a cached piece */
#define CACHE_MAX_SLOTS (1 << 16)

typedef struct piece_slot {
    uint32_t hash;      /* low bits of the piece's XXH3 hash */
    uint32_t piece_off; /* piece bytes: text[piece_off .. piece_off + len) */
    uint32_t len;
    uint32_t ids_off; /* its ids: out->v[ids_off .. ids_off + n_ids); n_ids 0: empty slot */
    uint32_t n_ids;
} piece_slot_t;

typedef struct piece_cache {
    piece_slot_t *slots; /* [mask + 1] */
    size_t mask;
    size_t n_used;
} piece_cache_t;

/* The slot holding piece, or the empty slot where it would go (NULL when the table is full
 * and it is absent). */
static piece_slot_t *cache_find(piece_cache_t *c, const char *text, const uint8_t *piece, size_t n)
{
    uint64_t h = XXH3_64bits(piece, n);
    size_t i = (size_t)(h >> 32) & c->mask;
    for (size_t probes = 0; probes <= c->mask; probes++, i = (i + 1) & c->mask) {
        piece_slot_t *s = &c->slots[i];
        if (s->n_ids == 0) {
            s->hash = (uint32_t)h;
            return s;
        }
        if (s->hash == (uint32_t)h && s->len == n && memcmp(text + s->piece_off, piece, n) == 0)
            return s;
    }
    return NULL;
}

/* Appends the ids of the piece text[off, off + n): copied from the cache when this call
 * already encoded the same piece, else merged (and cached when short). Returns TDM_OK or
 * TDM_ERESOURCE. */
static int encode_piece(const tdm_tokenizer_t *tok, const char *text, size_t off, size_t n,
                        piece_cache_t *cache, bpe_work_t *w, tdm_tok_ids_t *out)
{
    const uint8_t *piece = (const uint8_t *)text + off;
    piece_slot_t *slot =
        cache->slots && n > 1 && n <= CACHE_MAX_PIECE ? cache_find(cache, text, piece, n) : NULL;
    int rc = TDM_OK;
    if (slot && slot->n_ids > 0) {
        for (uint32_t k = 0; k < slot->n_ids && rc == TDM_OK; k++)
            rc = tdm_tok_ids_push(out, out->v[slot->ids_off + k]);
        return rc;
    }
    size_t start = out->n;
    rc = bpe_piece(tok, piece, n, w, out);
    if (slot && rc == TDM_OK && out->n > start && out->n - start <= CACHE_MAX_PIECE &&
        out->n <= UINT32_MAX && off <= UINT32_MAX && cache->n_used < (cache->mask + 1) / 2) {
        slot->piece_off = (uint32_t)off;
        slot->len = (uint32_t)n;
        slot->ids_off = (uint32_t)start;
        slot->n_ids = (uint32_t)(out->n - start);
        cache->n_used++;
    }
    return rc;
}

int tdm_tok_bpe_encode(const tdm_tokenizer_t *tok, const char *text, size_t len, tdm_tok_ids_t *out,
                       tdm_error_t *err)
{
    if (len == 0)
        return TDM_OK;
    int rc = TDM_OK;
    spans_t a = {0}, b = {0};
    bpe_work_t w = {0};
    piece_cache_t cache = {0};
    pcre2_match_data *md = pcre2_match_data_create(4, NULL);
    if (!md || spans_push(&a, 0, len) != TDM_OK) {
        rc = tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
        goto out_free;
    }
    for (size_t i = 0; i < tok->n_re; i++) {
        rc = split_regex(tok->re[i], md, text, &a, &b, err);
        if (rc != TDM_OK)
            goto out_free;
        spans_t t = a;
        a = b;
        b = t;
    }
    /* Words repeat (" the", " of"): a per-call cache of short pieces skips most merge work,
     * whose cost is dominated by cache misses in the merge table. */
    cache.mask = 1;
    while (cache.mask + 1 < 2 * a.n && cache.mask + 1 < CACHE_MAX_SLOTS)
        cache.mask = 2 * cache.mask + 1;
    cache.slots = calloc(cache.mask + 1, sizeof *cache.slots);
    for (size_t i = 0; i < a.n; i++) {
        rc = encode_piece(tok, text, a.v[i].off, a.v[i].len, &cache, &w, out);
        if (rc != TDM_OK) {
            rc = tdm_error_set(err, rc, "tokenizer: out of memory");
            goto out_free;
        }
    }
out_free:
    free(cache.slots);
    work_free(&w);
    free(b.v);
    free(a.v);
    pcre2_match_data_free(md);
    return rc;
}
