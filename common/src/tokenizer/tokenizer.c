/* tokenizer.c - building a tokenizer from GGUF metadata, special tokens, encode dispatch,
 * decoding and the incremental detokenizer.
 *
 * Special tokens: user-defined tokens (type 4) are always split out of the text before
 * pre-tokenization, as the reference tokenizers do with added tokens (deepseek-coder's test
 * vectors depend on it); control and unknown tokens (types 3, 2) only when parse_special is
 * set. Matching is leftmost-longest (Hugging Face's added-vocabulary matcher; special.c). As in
 * llama.cpp, a token whose text is one of its end-of-generation, end-of-message or
 * fill-in-the-middle texts is a control token whatever the file says (control_texts).
 * Decoding follows llama.cpp's token_to_piece: byte-level pieces go back through GPT-2's
 * bytes_to_unicode table, SPM pieces get U+2581 -> ' ', <0xXX> pieces give their byte,
 * user-defined tokens their raw text, control/unknown/unused tokens nothing (or their text
 * when rendering specials).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <xxhash.h>

#include "tokenizer_internal.h"

#define SPACE_MARK "\xe2\x96\x81" /* U+2581, SentencePiece's escaped space */

/* ---- the id array ---- */

int tdm_tok_ids_push(tdm_tok_ids_t *ids, tdm_token_t id)
{
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? 2 * ids->cap : 64;
        tdm_token_t *v = realloc(ids->v, cap * sizeof *v);
        if (!v)
            return TDM_ERESOURCE;
        ids->v = v;
        ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return TDM_OK;
}

/* ---- vocabulary map ---- */

tdm_token_t tdm_tok_lookup(const tdm_tokenizer_t *tok, const char *s, size_t len)
{
    const tdm_tok_strmap_t *m = &tok->vocab;
    uint64_t h = XXH3_64bits(s, len);
    uint32_t h32 = (uint32_t)h;
    for (uint64_t i = (h >> 32) & m->mask;; i = (i + 1) & m->mask) {
        int32_t id = m->ids[i];
        if (id < 0)
            return -1;
        if (m->hash[i] == h32) {
            size_t n;
            const char *t = tdm_tok_text(tok, id, &n);
            if (n == len && memcmp(t, s, len) == 0)
                return id;
        }
    }
}

/* Builds the map; a string that appears twice keeps the later id (as llama.cpp does). */
static int vocab_map_build(tdm_tokenizer_t *tok)
{
    tdm_tok_strmap_t *m = &tok->vocab;
    uint64_t cap = 16;
    while (cap < 2 * (uint64_t)tok->n_vocab)
        cap <<= 1;
    m->ids = malloc(cap * sizeof *m->ids);
    m->hash = malloc(cap * sizeof *m->hash);
    if (!m->ids || !m->hash)
        return TDM_ERESOURCE;
    m->mask = cap - 1;
    memset(m->ids, 0xFF, cap * sizeof *m->ids);
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        size_t n;
        const char *t = tdm_tok_text(tok, (tdm_token_t)id, &n);
        uint64_t h = XXH3_64bits(t, n);
        for (uint64_t i = (h >> 32) & m->mask;; i = (i + 1) & m->mask) {
            if (m->ids[i] < 0) {
                m->ids[i] = (int32_t)id;
                m->hash[i] = (uint32_t)h;
                break;
            }
            size_t n2;
            const char *t2 = tdm_tok_text(tok, m->ids[i], &n2);
            if (m->hash[i] == (uint32_t)h && n2 == n && memcmp(t, t2, n) == 0) {
                m->ids[i] = (int32_t)id;
                break;
            }
        }
    }
    return TDM_OK;
}

/* ---- metadata helpers ---- */

/* Reads an optional token id key: *id keeps its default when the key is absent; a negative
 * value means "none". Errors: TDM_EINVALID (wrong type, or an id >= n_vocab). */
static int read_id(const tdm_tokenizer_t *tok, const tdm_gguf_t *g, const char *key,
                   tdm_token_t *id, tdm_error_t *err)
{
    int64_t v;
    tdm_error_t e;
    int rc = tdm_gguf_get_i64(g, key, &v, &e);
    if (rc == TDM_ENOTFOUND)
        return TDM_OK;
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "tokenizer: %s", e.msg);
    if (v >= (int64_t)tok->n_vocab)
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer: %s = %lld is outside the vocabulary (%u tokens)", key,
                             (long long)v, tok->n_vocab);
    *id = v < 0 ? -1 : (tdm_token_t)v;
    return TDM_OK;
}

static int read_bool(const tdm_gguf_t *g, const char *key, bool *out, tdm_error_t *err)
{
    tdm_error_t e;
    int rc = tdm_gguf_get_bool(g, key, out, &e);
    if (rc == TDM_ENOTFOUND)
        return TDM_OK;
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "tokenizer: %s", e.msg);
    return TDM_OK;
}

static int read_tokens(tdm_tokenizer_t *tok, const tdm_gguf_t *g, tdm_error_t *err)
{
    const tdm_gguf_kv_t *kv = NULL;
    int rc = tdm_gguf_get_arr(g, "tokenizer.ggml.tokens", TDM_GGUF_VTYPE_STRING, &kv, err);
    if (rc != TDM_OK)
        return tdm_error_prefix(err, rc == TDM_ENOTFOUND ? TDM_EINVALID : rc, "tokenizer: ");
    if (kv->arr_n == 0 || kv->arr_n > INT32_MAX)
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer: tokenizer.ggml.tokens has %llu entries (1..%d expected)",
                             (unsigned long long)kv->arr_n, INT32_MAX);
    tok->n_vocab = (uint32_t)kv->arr_n;
    size_t total = 0;
    for (uint32_t i = 0; i < tok->n_vocab; i++) {
        if (!tdm_add_size(total, (size_t)kv->arr_strs[i].len + 1, &total))
            return tdm_error_set(err, TDM_EINVALID, "tokenizer: token texts too large");
    }
    tok->text = malloc(total);
    tok->text_off = malloc(((size_t)tok->n_vocab + 1) * sizeof *tok->text_off);
    tok->attr = malloc(tok->n_vocab);
    if (!tok->text || !tok->text_off || !tok->attr)
        return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory (vocabulary)");
    size_t off = 0;
    for (uint32_t i = 0; i < tok->n_vocab; i++) {
        tok->text_off[i] = off;
        memcpy(tok->text + off, kv->arr_strs[i].data, (size_t)kv->arr_strs[i].len);
        off += (size_t)kv->arr_strs[i].len;
        tok->text[off++] = '\0';
    }
    tok->text_off[tok->n_vocab] = off;

    memset(tok->attr, TDM_TOKEN_NORMAL, tok->n_vocab);
    rc = tdm_gguf_get_arr(g, "tokenizer.ggml.token_type", TDM_GGUF_VTYPE_COUNT, &kv, err);
    if (rc == TDM_OK) {
        if (kv->arr_n != tok->n_vocab || kv->arr_type == TDM_GGUF_VTYPE_STRING)
            return tdm_error_set(err, TDM_EINVALID,
                                 "tokenizer: tokenizer.ggml.token_type has %llu %s entries, "
                                 "expected %u integers",
                                 (unsigned long long)kv->arr_n, tdm_gguf_vtype_name(kv->arr_type),
                                 tok->n_vocab);
        for (uint32_t i = 0; i < tok->n_vocab; i++) {
            int64_t t = tdm_gguf_arr_int(kv, i);
            if (t < 0 || t > TDM_TOKEN_BYTE)
                return tdm_error_set(err, TDM_EINVALID,
                                     "tokenizer: tokenizer.ggml.token_type[%u] = %lld (1..6)", i,
                                     (long long)t);
            tok->attr[i] = (uint8_t)(t == 0 ? TDM_TOKEN_NORMAL : t); /* 0: undefined */
        }
    } else if (rc != TDM_ENOTFOUND) {
        return tdm_error_prefix(err, rc, "tokenizer: ");
    }
    tdm_error_clear(err);
    return TDM_OK;
}

static int read_scores(tdm_tokenizer_t *tok, const tdm_gguf_t *g, tdm_error_t *err)
{
    tok->scores = calloc(tok->n_vocab, sizeof *tok->scores);
    if (!tok->scores)
        return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory (scores)");
    const tdm_gguf_kv_t *kv = NULL;
    int rc = tdm_gguf_get_arr(g, "tokenizer.ggml.scores", TDM_GGUF_VTYPE_COUNT, &kv, err);
    if (rc == TDM_ENOTFOUND) {
        tdm_error_clear(err);
        return TDM_OK;
    }
    if (rc != TDM_OK)
        return tdm_error_prefix(err, rc, "tokenizer: ");
    if (kv->arr_n != tok->n_vocab || kv->arr_type == TDM_GGUF_VTYPE_STRING)
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer: tokenizer.ggml.scores has %llu %s entries, expected %u "
                             "numbers",
                             (unsigned long long)kv->arr_n, tdm_gguf_vtype_name(kv->arr_type),
                             tok->n_vocab);
    for (uint32_t i = 0; i < tok->n_vocab; i++)
        tok->scores[i] = (float)tdm_gguf_arr_float(kv, i);
    return TDM_OK;
}

/* Parses "<0xXX>" (SentencePiece's byte pieces); -1 when s is not one. */
static int parse_byte_piece(const char *s, size_t n)
{
    if (n != 6 || memcmp(s, "<0x", 3) != 0 || s[5] != '>')
        return -1;
    int v = 0;
    for (int i = 3; i < 5; i++) {
        char c = s[i];
        int d = c >= '0' && c <= '9'   ? c - '0'
                : c >= 'A' && c <= 'F' ? c - 'A' + 10
                : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                       : -1;
        if (d < 0)
            return -1;
        v = v * 16 + d;
    }
    return v;
}

/* Fills tok->dec: what each token decodes to when specials are not rendered. Each decoded
 * form is at most as long as the token's text, so dec needs no more room than text. */
static int build_decoded(tdm_tokenizer_t *tok)
{
    int16_t cp_to_byte[324]; /* bytes_to_unicode's image is U+0021..U+0143 */
    for (size_t i = 0; i < sizeof cp_to_byte / sizeof cp_to_byte[0]; i++)
        cp_to_byte[i] = -1;
    for (int b = 0; b < 256; b++)
        cp_to_byte[tdm_tok_byte_to_cp((uint8_t)b)] = (int16_t)b;

    tok->dec = malloc(tok->text_off[tok->n_vocab] + 1);
    tok->dec_off = malloc(((size_t)tok->n_vocab + 1) * sizeof *tok->dec_off);
    if (!tok->dec || !tok->dec_off)
        return TDM_ERESOURCE;
    size_t k = 0;
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        tok->dec_off[id] = k;
        size_t n;
        const char *s = tdm_tok_text(tok, (tdm_token_t)id, &n);
        /* A "byte" token that is not <0xXX> decodes as a normal one. */
        int byte = tok->attr[id] == TDM_TOKEN_BYTE ? parse_byte_piece(s, n) : -1;
        switch (byte >= 0 ? TDM_TOKEN_BYTE : tok->attr[id]) {
        case TDM_TOKEN_CONTROL:
        case TDM_TOKEN_UNKNOWN:
        case TDM_TOKEN_UNUSED: break;
        case TDM_TOKEN_USER_DEFINED:
            memcpy(tok->dec + k, s, n);
            k += n;
            break;
        case TDM_TOKEN_BYTE: tok->dec[k++] = (char)byte; break;
        default:
            if (tok->kind == TDM_TOKENIZER_SPM) {
                for (size_t i = 0; i < n;) {
                    if (n - i >= 3 && memcmp(s + i, SPACE_MARK, 3) == 0) {
                        tok->dec[k++] = ' ';
                        i += 3;
                    } else {
                        tok->dec[k++] = s[i++];
                    }
                }
            } else {
                for (size_t i = 0; i < n;) {
                    uint32_t cp = 0;
                    size_t cl = tdm_utf8_decode((const unsigned char *)s + i, n - i, &cp);
                    if (cl > 0 && cp < 324 && cp_to_byte[cp] >= 0) {
                        tok->dec[k++] = (char)cp_to_byte[cp];
                        i += cl;
                    } else {
                        /* Not a byte-level character: keep the text's bytes as they are. */
                        size_t m = cl > 0 ? cl : 1;
                        memcpy(tok->dec + k, s + i, m);
                        k += m;
                        i += m;
                    }
                }
            }
        }
    }
    tok->dec_off[tok->n_vocab] = k;
    return TDM_OK;
}

/* End-of-turn and end-of-generation tokens found by their text (llama.cpp's lists; the
 * end-of-generation list as of the llama.cpp that llama-cpp-python 0.3.36 vendors, which also
 * ends generation at "</s>": paddleocr's end, an HTML tag in Gemma's vocabulary). */
static const char *const eot_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|EOT|>", "<EOT>", "<|end_of_turn|>"};
static const char *const eog_texts[] = {"<|eot_id|>",
                                        "<|im_end|>",
                                        "<|end|>",
                                        "<end_of_turn>",
                                        "<|EOT|>",
                                        "<EOT>",
                                        "_<EOT>",
                                        "<|end_of_turn|>",
                                        "<|endoftext|>",
                                        "<|end_of_text|>",
                                        "</s>",
                                        "<|eom_id|>",
                                        "<end_of_utterance>",
                                        "<|return|>",
                                        "<|call|>",
                                        "<|flush|>",
                                        "<|calls|>",
                                        "[EOT]",
                                        "[EOS]",
                                        "<eos>",
                                        "<turn|>",
                                        "<|tool_response>",
                                        "[e~[",
                                        "<\xef\xbd\x9c"
                                        "end" SPACE_MARK "of" SPACE_MARK "sentence\xef\xbd\x9c>"};

/* Texts whose token llama.cpp makes a control token whatever tokenizer.ggml.token_type says
 * ("control-looking token ... its type will be overridden", llama-vocab.cpp of the llama.cpp
 * that llama-cpp-python 0.3.36 vendors): its end-of-generation texts and its candidates for
 * end of message and fill-in-the-middle (its end-of-turn candidates are among the first). The
 * type decides whether text matches the token without parse_special: Gemma 3's "</s>" is
 * user-defined in the file, a control token to llama.cpp. */
static const char *const control_texts[] = {"<|eot_id|>",
                                            "<|im_end|>",
                                            "<|end|>",
                                            "<|return|>",
                                            "<|call|>",
                                            "<|flush|>",
                                            "<|calls|>",
                                            "<end_of_turn>",
                                            "<|endoftext|>",
                                            "</s>",
                                            "<|eom_id|>",
                                            "<EOT>",
                                            "_<EOT>",
                                            "[EOT]",
                                            "[EOS]",
                                            "<|end_of_text|>",
                                            "<end_of_utterance>",
                                            "<eos>",
                                            "<turn|>",
                                            "<|tool_response>",
                                            "[e~[",
                                            "<\xef\xbd\x9c"
                                            "end" SPACE_MARK "of" SPACE_MARK
                                            "sentence\xef\xbd\x9c>",
                                            "<|fim_prefix|>",
                                            "<fim-prefix>",
                                            "<fim_prefix>",
                                            "<PRE>",
                                            SPACE_MARK "<PRE>",
                                            "<|code_prefix|>",
                                            "<|prefix|>",
                                            "<|fim_suffix|>",
                                            "<fim-suffix>",
                                            "<fim_suffix>",
                                            "<SUF>",
                                            SPACE_MARK "<SUF>",
                                            "<|code_suffix|>",
                                            "<|suffix|>",
                                            "<|fim_middle|>",
                                            "<fim-middle>",
                                            "<fim_middle>",
                                            "<MID>",
                                            SPACE_MARK "<MID>",
                                            "<|code_middle|>",
                                            "<|middle|>",
                                            "<|fim_pad|>",
                                            "<fim-pad>",
                                            "<fim_pad>",
                                            "<PAD>",
                                            "[PAD]",
                                            "<|fim_repo|>",
                                            "<|repo_name|>",
                                            "<fim-repo>",
                                            "<REPO>",
                                            "<reponame>",
                                            "<|file_sep|>"};

/* Applies llama.cpp's control-looking rule (control_texts) to tok->attr. */
static void force_control(tdm_tokenizer_t *tok)
{
    for (size_t i = 0; i < sizeof control_texts / sizeof control_texts[0]; i++) {
        tdm_token_t id = tdm_tok_lookup(tok, control_texts[i], strlen(control_texts[i]));
        if (id >= 0)
            tok->attr[id] = TDM_TOKEN_CONTROL;
    }
}

static void add_eog(tdm_tokenizer_t *tok, tdm_token_t id)
{
    if (id < 0 || tok->n_eog == TDM_TOK_MAX_EOG)
        return;
    for (size_t i = 0; i < tok->n_eog; i++) {
        if (tok->eog[i] == id)
            return;
    }
    tok->eog[tok->n_eog++] = id;
}

static int read_special_ids(tdm_tokenizer_t *tok, const tdm_gguf_t *g, tdm_error_t *err)
{
    bool spm = tok->kind == TDM_TOKENIZER_SPM;
    tok->bos = spm ? tdm_tok_lookup(tok, "<s>", 3) : -1;
    tok->eos = spm ? tdm_tok_lookup(tok, "</s>", 4) : -1;
    tok->unk = spm ? tdm_tok_lookup(tok, "<unk>", 5) : -1;
    tok->eot = -1;
    tdm_token_t eom = -1;
    tok->add_bos = spm || strcmp(tok->pre, "llama3") == 0 || strcmp(tok->pre, "llama-bpe") == 0;
    tok->add_space_prefix = spm;
    int rc;
    if ((rc = read_id(tok, g, "tokenizer.ggml.bos_token_id", &tok->bos, err)) != TDM_OK ||
        (rc = read_id(tok, g, "tokenizer.ggml.eos_token_id", &tok->eos, err)) != TDM_OK ||
        (rc = read_id(tok, g, "tokenizer.ggml.unknown_token_id", &tok->unk, err)) != TDM_OK ||
        (rc = read_id(tok, g, "tokenizer.ggml.eot_token_id", &tok->eot, err)) != TDM_OK ||
        (rc = read_id(tok, g, "tokenizer.ggml.eom_token_id", &eom, err)) != TDM_OK ||
        (rc = read_bool(g, "tokenizer.ggml.add_bos_token", &tok->add_bos, err)) != TDM_OK ||
        (rc = read_bool(g, "tokenizer.ggml.add_space_prefix", &tok->add_space_prefix, err)) !=
            TDM_OK)
        return rc;
    if (!spm)
        tok->add_space_prefix = false; /* byte-level BPE encodes spaces itself */
    for (size_t i = 0; i < sizeof eot_texts / sizeof eot_texts[0] && tok->eot < 0; i++)
        tok->eot = tdm_tok_lookup(tok, eot_texts[i], strlen(eot_texts[i]));
    add_eog(tok, tok->eos);
    add_eog(tok, tok->eot);
    add_eog(tok, eom);
    for (size_t i = 0; i < sizeof eog_texts / sizeof eog_texts[0]; i++)
        add_eog(tok, tdm_tok_lookup(tok, eog_texts[i], strlen(eog_texts[i])));
    return TDM_OK;
}

/* SPM: whether every normal or user-defined token that holds U+2581 past its first byte is
 * made of U+2581 only (true of Llama's vocabulary): then no token spans the boundary between a
 * non-space character and the U+2581 after it. */
static bool spm_words_independent(const tdm_tokenizer_t *tok)
{
    for (uint32_t id = 0; id < tok->n_vocab; id++) {
        if (tok->attr[id] != TDM_TOKEN_NORMAL && tok->attr[id] != TDM_TOKEN_USER_DEFINED)
            continue;
        size_t n;
        const char *s = tdm_tok_text(tok, (tdm_token_t)id, &n);
        for (size_t i = 1; i + 3 <= n; i++) {
            if (memcmp(s + i, SPACE_MARK, 3) == 0 &&
                (i < 3 || memcmp(s + i - 3, SPACE_MARK, 3) != 0))
                return false;
        }
    }
    return true;
}

/* tokenizer.ggml.model: gpt2 (byte-level BPE) or llama (SentencePiece). */
static int read_kind(const tdm_gguf_t *g, tdm_tokenizer_kind_t *kind, tdm_error_t *err)
{
    tdm_gguf_str_t model;
    int rc = tdm_gguf_get_str(g, "tokenizer.ggml.model", &model, err);
    if (rc != TDM_OK)
        return tdm_error_prefix(err, rc == TDM_ENOTFOUND ? TDM_EINVALID : rc, "tokenizer: ");
    if (model.len == 4 && memcmp(model.data, "gpt2", 4) == 0)
        *kind = TDM_TOKENIZER_BPE;
    else if (model.len == 5 && memcmp(model.data, "llama", 5) == 0)
        *kind = TDM_TOKENIZER_SPM;
    else
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer: unsupported tokenizer.ggml.model '%.*s' (supported: "
                             "gpt2, llama)",
                             (int)(model.len > 64 ? 64 : model.len), model.data);
    return TDM_OK;
}

/* tokenizer.ggml.pre into tok->pre ("default" when absent). */
static int read_pre(tdm_tokenizer_t *tok, const tdm_gguf_t *g, tdm_error_t *err)
{
    tdm_gguf_str_t pre;
    strcpy(tok->pre, "default");
    tdm_error_t e;
    int rc = tdm_gguf_get_str(g, "tokenizer.ggml.pre", &pre, &e);
    if (rc == TDM_ENOTFOUND)
        return TDM_OK;
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "tokenizer: %s", e.msg);
    if (pre.len >= sizeof tok->pre)
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer: unsupported tokenizer.ggml.pre '%.*s' (too long)",
                             (int)(pre.len > 64 ? 64 : pre.len), pre.data);
    memcpy(tok->pre, pre.data, (size_t)pre.len);
    tok->pre[pre.len] = '\0';
    return TDM_OK;
}

/* SentencePiece's byte fallback: the "<0xXX>" piece of each byte, else the byte itself. */
static void spm_byte_ids(tdm_tokenizer_t *tok)
{
    for (int b = 0; b < 256; b++) {
        char s[8];
        snprintf(s, sizeof s, "<0x%02X>", b);
        tok->byte_id[b] = tdm_tok_lookup(tok, s, 6);
        if (tok->byte_id[b] < 0) {
            s[0] = (char)b;
            tok->byte_id[b] = tdm_tok_lookup(tok, s, 1);
        }
    }
}

tdm_tokenizer_t *tdm_tokenizer_new(const tdm_gguf_t *g, tdm_error_t *err)
{
    tdm_error_clear(err);
    tdm_tokenizer_kind_t kind = TDM_TOKENIZER_BPE;
    if (read_kind(g, &kind, err) != TDM_OK)
        return NULL;
    tdm_tokenizer_t *tok = calloc(1, sizeof *tok);
    if (!tok) {
        tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
        return NULL;
    }
    tok->kind = kind;
    if (read_pre(tok, g, err) != TDM_OK || read_tokens(tok, g, err) != TDM_OK)
        goto out_destroy;
    if (kind == TDM_TOKENIZER_SPM && read_scores(tok, g, err) != TDM_OK)
        goto out_destroy;
    if (vocab_map_build(tok) != TDM_OK) {
        tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
        goto out_destroy;
    }
    force_control(tok);
    if (build_decoded(tok) != TDM_OK || tdm_tok_special_init(tok) != TDM_OK) {
        tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
        goto out_destroy;
    }
    if (read_special_ids(tok, g, err) != TDM_OK)
        goto out_destroy;
    if (kind == TDM_TOKENIZER_BPE) {
        if (tdm_tok_bpe_init(tok, g, err) != TDM_OK)
            goto out_destroy;
    } else {
        tok->spm_word_split = spm_words_independent(tok);
        spm_byte_ids(tok);
    }
    return tok;

out_destroy:
    tdm_tokenizer_destroy(&tok);
    return NULL;
}

void tdm_tokenizer_destroy(tdm_tokenizer_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_tokenizer_t *tok = *self_p;
    tdm_tok_bpe_free(tok);
    tdm_tok_special_free(tok);
    free(tok->dec_off);
    free(tok->dec);
    free(tok->vocab.hash);
    free(tok->vocab.ids);
    free(tok->scores);
    free(tok->attr);
    free(tok->text_off);
    free(tok->text);
    free(tok);
    *self_p = NULL;
}

/* ---- accessors ---- */

tdm_tokenizer_kind_t tdm_tokenizer_kind(const tdm_tokenizer_t *tok)
{
    return tok->kind;
}

const char *tdm_tokenizer_pre(const tdm_tokenizer_t *tok)
{
    return tok->pre;
}

uint32_t tdm_tokenizer_n_vocab(const tdm_tokenizer_t *tok)
{
    return tok->n_vocab;
}

tdm_token_t tdm_tokenizer_bos(const tdm_tokenizer_t *tok)
{
    return tok->bos;
}

tdm_token_t tdm_tokenizer_eos(const tdm_tokenizer_t *tok)
{
    return tok->eos;
}

tdm_token_t tdm_tokenizer_eot(const tdm_tokenizer_t *tok)
{
    return tok->eot;
}

bool tdm_tokenizer_add_bos(const tdm_tokenizer_t *tok)
{
    return tok->add_bos;
}

tdm_token_t tdm_tokenizer_unk(const tdm_tokenizer_t *tok)
{
    return tok->unk;
}

const char *tdm_tokenizer_pre_regex(const tdm_tokenizer_t *tok, size_t i)
{
    return tok->re_src && i < tok->n_re ? tok->re_src[i] : NULL;
}

bool tdm_tokenizer_ignore_merges(const tdm_tokenizer_t *tok)
{
    return tok->ignore_merges;
}

bool tdm_tokenizer_is_eog(const tdm_tokenizer_t *tok, tdm_token_t id)
{
    for (size_t i = 0; i < tok->n_eog; i++) {
        if (tok->eog[i] == id)
            return true;
    }
    return false;
}

tdm_token_attr_t tdm_tokenizer_attr(const tdm_tokenizer_t *tok, tdm_token_t id)
{
    if (id < 0 || (uint32_t)id >= tok->n_vocab)
        return TDM_TOKEN_UNUSED;
    return (tdm_token_attr_t)tok->attr[id];
}

const char *tdm_tokenizer_piece(const tdm_tokenizer_t *tok, tdm_token_t id, size_t *len)
{
    if (id < 0 || (uint32_t)id >= tok->n_vocab) {
        if (len)
            *len = 0;
        return NULL;
    }
    size_t n;
    const char *s = tdm_tok_text(tok, id, &n);
    if (len)
        *len = n;
    return s;
}

tdm_token_t tdm_tokenizer_find(const tdm_tokenizer_t *tok, const char *piece, size_t len)
{
    return tdm_tok_lookup(tok, piece, len);
}

/* ---- encoding ---- */

static int encode_plain(const tdm_tokenizer_t *tok, const char *text, size_t len,
                        bool after_special, tdm_tok_ids_t *out, tdm_error_t *err)
{
    if (len == 0)
        return TDM_OK;
    if (tok->kind == TDM_TOKENIZER_BPE)
        return tdm_tok_bpe_encode(tok, text, len, out, err);
    /* SentencePiece adds the space prefix to the text's start and, as llama.cpp does, after
     * every special token. */
    return tdm_tok_spm_encode(tok, text, len, tok->add_space_prefix && after_special, out, err);
}

int tdm_tokenizer_encode(const tdm_tokenizer_t *tok, const char *text, size_t len, bool add_bos,
                         bool parse_special, tdm_token_t **ids, size_t *n_ids, tdm_error_t *err)
{
    *ids = NULL;
    *n_ids = 0;
    tdm_tok_ids_t out = {0};
    int rc = TDM_OK;
    if (add_bos && tok->bos >= 0 && tdm_tok_ids_push(&out, tok->bos) != TDM_OK)
        goto out_oom;
    bool after_special = true;
    size_t start = 0;
    for (size_t i = 0; i < len;) {
        size_t mlen = 0;
        tdm_token_t id = tdm_tok_special_match(tok, text + i, len - i, parse_special, &mlen);
        if (id < 0) {
            i++;
            continue;
        }
        rc = encode_plain(tok, text + start, i - start, after_special, &out, err);
        if (rc != TDM_OK)
            goto out_free;
        if (tdm_tok_ids_push(&out, id) != TDM_OK)
            goto out_oom;
        after_special = true;
        i += mlen;
        start = i;
    }
    rc = encode_plain(tok, text + start, len - start, after_special, &out, err);
    if (rc != TDM_OK)
        goto out_free;
    if (!out.v && !(out.v = malloc(sizeof *out.v)))
        goto out_oom;
    *ids = out.v;
    *n_ids = out.n;
    return TDM_OK;

out_oom:
    rc = tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
out_free:
    free(out.v);
    return rc;
}

/* ---- decoding ---- */

/* The bytes token id stands for (id in range); points into the tokenizer. */
static const char *token_ref(const tdm_tokenizer_t *tok, tdm_token_t id, bool render_special,
                             size_t *len)
{
    uint8_t a = tok->attr[id];
    if (render_special &&
        (a == TDM_TOKEN_CONTROL || a == TDM_TOKEN_UNKNOWN || a == TDM_TOKEN_UNUSED))
        return tdm_tok_text(tok, id, len);
    *len = tok->dec_off[id + 1] - tok->dec_off[id];
    return tok->dec + tok->dec_off[id];
}

int tdm_tokenizer_token_bytes(const tdm_tokenizer_t *tok, tdm_token_t id, bool render_special,
                              char *buf, size_t cap)
{
    if (id < 0 || (uint32_t)id >= tok->n_vocab)
        return TDM_EINVALID;
    size_t n;
    const char *s = token_ref(tok, id, render_special, &n);
    memcpy(buf, s, n < cap ? n : cap);
    return n > INT32_MAX ? INT32_MAX : (int)n;
}

/* SPM: whether the space that encode put before the text should be dropped from piece s. */
static bool drop_prefix_space(const tdm_tokenizer_t *tok, const char *s, size_t n)
{
    return tok->kind == TDM_TOKENIZER_SPM && tok->add_space_prefix && n > 0 && s[0] == ' ';
}

int tdm_tokenizer_decode(const tdm_tokenizer_t *tok, const tdm_token_t *ids, size_t n,
                         bool render_special, char **out, size_t *out_len, tdm_error_t *err)
{
    *out = NULL;
    *out_len = 0;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] < 0 || (uint32_t)ids[i] >= tok->n_vocab)
            return tdm_error_set(err, TDM_EINVALID,
                                 "tokenizer: token %d at index %zu is outside the vocabulary "
                                 "(%u tokens)",
                                 ids[i], i, tok->n_vocab);
        size_t len;
        token_ref(tok, ids[i], render_special, &len);
        total += len;
    }
    char *s = malloc(total + 1);
    if (!s)
        return tdm_error_set(err, TDM_ERESOURCE, "tokenizer: out of memory");
    size_t k = 0;
    bool at_start = true;
    for (size_t i = 0; i < n; i++) {
        size_t len;
        const char *p = token_ref(tok, ids[i], render_special, &len);
        if (at_start && len > 0) {
            if (drop_prefix_space(tok, p, len))
                p++, len--;
            at_start = false;
        }
        memcpy(s + k, p, len);
        k += len;
    }
    s[k] = '\0';
    *out = s;
    *out_len = k;
    return TDM_OK;
}

/* ---- incremental detokenizer ---- */

void tdm_detok_init(tdm_detok_t *d, const tdm_tokenizer_t *tok, bool render_special)
{
    memset(d, 0, sizeof *d);
    d->tok = tok;
    d->render_special = render_special;
    d->at_start = true;
}

/* Byte i of the virtual concatenation a[0..na) b[..]. */
static inline uint8_t cat_at(const unsigned char *a, size_t na, const unsigned char *b, size_t i)
{
    return i < na ? a[i] : b[i - na];
}

typedef enum utf8_seq {
    UTF8_SEQ_VALID,      /* a whole character: need + 1 bytes */
    UTF8_SEQ_INVALID,    /* a maximal invalid subpart ends before byte i + j */
    UTF8_SEQ_INCOMPLETE, /* valid so far, but the bytes end before the character does */
} utf8_seq_t;

/* Classifies the UTF-8 sequence at byte i of pending + p (total bytes; RFC 3629's table of
 * well-formed sequences): *need gets its continuation bytes (SIZE_MAX for a byte that never
 * starts one), *j the index after the last byte looked at. */
static utf8_seq_t utf8_seq_at(const unsigned char *a, size_t na, const unsigned char *p,
                              size_t total, size_t i, size_t *need, size_t *j)
{
    uint8_t c = cat_at(a, na, p, i);
    uint8_t lo = 0x80, hi = 0xBF;
    if (c < 0x80) {
        *need = 0;
    } else if (c >= 0xC2 && c <= 0xDF) {
        *need = 1;
    } else if (c >= 0xE0 && c <= 0xEF) {
        *need = 2;
        lo = c == 0xE0 ? 0xA0 : 0x80;
        hi = c == 0xED ? 0x9F : 0xBF;
    } else if (c >= 0xF0 && c <= 0xF4) {
        *need = 3;
        lo = c == 0xF0 ? 0x90 : 0x80;
        hi = c == 0xF4 ? 0x8F : 0xBF;
    } else {
        *need = SIZE_MAX; /* never valid as a first byte */
        *j = 1;
        return UTF8_SEQ_INVALID;
    }
    for (*j = 1; *j <= *need; (*j)++) {
        if (i + *j >= total)
            return UTF8_SEQ_INCOMPLETE;
        uint8_t cc = cat_at(a, na, p, i + *j);
        if (cc < (*j == 1 ? lo : 0x80) || cc > (*j == 1 ? hi : 0xBF)) {
            (*j)++; /* as the loop it replaces: j counts past the offending byte */
            return UTF8_SEQ_INVALID;
        }
    }
    return UTF8_SEQ_VALID;
}

int tdm_detok_push(tdm_detok_t *d, tdm_token_t id, char *out, size_t cap, size_t *out_len)
{
    const tdm_tokenizer_t *tok = d->tok;
    if (out_len)
        *out_len = 0;
    if (id < 0 || (uint32_t)id >= tok->n_vocab)
        return TDM_EINVALID;
    size_t n;
    const unsigned char *p = (const unsigned char *)token_ref(tok, id, d->render_special, &n);
    bool at_start = d->at_start;
    if (at_start && n > 0) {
        if (drop_prefix_space(tok, (const char *)p, n))
            p++, n--;
        at_start = false;
    }
    /* Walk pending + p: whole valid characters are copied, each maximal invalid subpart
     * becomes U+FFFD, a valid but unfinished sequence at the end is held back. */
    const unsigned char *a = d->pending;
    size_t na = d->n_pending, total = na + n, i = 0, k = 0;
    unsigned char keep[8];
    size_t n_keep = 0;
    while (i < total) {
        size_t need, j;
        utf8_seq_t seq = utf8_seq_at(a, na, p, total, i, &need, &j);
        bool invalid = seq == UTF8_SEQ_INVALID;
        if (seq == UTF8_SEQ_INCOMPLETE) {
            n_keep = total - i;
            for (size_t m = 0; m < n_keep; m++)
                keep[m] = cat_at(a, na, p, i + m);
            break;
        }
        if (invalid) {
            /* bytes i .. i + j - 1 are a maximal subpart (at least one byte) */
            size_t sub = need == SIZE_MAX ? 1 : j - 1;
            if (sub == 0)
                sub = 1;
            if (k + 3 >= cap)
                return TDM_ERESOURCE;
            memcpy(out + k, "\xef\xbf\xbd", 3);
            k += 3;
            i += sub;
            continue;
        }
        if (k + need + 1 >= cap)
            return TDM_ERESOURCE;
        for (size_t m = 0; m <= need; m++)
            out[k++] = (char)cat_at(a, na, p, i + m);
        i += need + 1;
    }
    if (k >= cap)
        return TDM_ERESOURCE;
    out[k] = '\0';
    memcpy(d->pending, keep, n_keep);
    d->n_pending = n_keep;
    d->at_start = at_start;
    if (out_len)
        *out_len = k;
    return TDM_OK;
}

int tdm_detok_flush(tdm_detok_t *d, char *out, size_t cap, size_t *out_len)
{
    if (out_len)
        *out_len = 0;
    /* What is held back is always one valid but unfinished sequence: one U+FFFD. */
    size_t k = d->n_pending > 0 ? 3 : 0;
    if (k + 1 > cap)
        return TDM_ERESOURCE;
    memcpy(out, "\xef\xbf\xbd", k);
    out[k] = '\0';
    tdm_detok_init(d, d->tok, d->render_special);
    if (out_len)
        *out_len = k;
    return TDM_OK;
}
