/* cmd_tokenizer.c - `tandem tokenizer export MODEL.gguf DIR`: writes a Hugging Face tokenizer
 * folder (tokenizer.json, tokenizer_config.json, special_tokens_map.json) equivalent to
 * Tandem's own tokenizer for the GGUF's vocabulary, for tools that need one (guidellm,
 * aiperf, transformers.AutoTokenizer).
 *
 * Byte-level BPE vocabularies only (tokenizer.ggml.model = gpt2); SentencePiece-style ones are
 * refused. The tokenizer.json holds, in the `tokenizers` 0.23 format: the GGUF's tokens as the
 * BPE vocabulary and tokenizer.ggml.merges as its merges; the pre-tokenizer as a Sequence of
 * Split (behaviour Isolated) over the regexes Tandem itself applies (tdm_tokenizer_pre_regex:
 * one list, so the two cannot drift; PCRE2 and Oniguruma read them alike), then ByteLevel
 * without its own regex; a ByteLevel decoder; control and unknown tokens as special added
 * tokens and user-defined ones as non-special added tokens (matched in text, as Tandem does).
 * When the vocabulary adds BOS, a TemplateProcessing post-processor prepends it.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>

#include <jansson.h>

#include "commands.h"
#include "tandem/gguf.h"
#include "tandem/tokenizer.h"

#define EXPORT_SYNOPSIS "usage: tandem tokenizer export MODEL.gguf DIR\n"

static void usage(FILE *out)
{
    fprintf(out, EXPORT_SYNOPSIS
            "\n"
            "Writes DIR/tokenizer.json, DIR/tokenizer_config.json (special tokens, the GGUF's\n"
            "chat template, model_max_length) and DIR/special_tokens_map.json: a Hugging Face\n"
            "tokenizer that gives the same token ids as Tandem's for MODEL's vocabulary (a\n"
            "model or a vocabulary-only GGUF). DIR is created if needed; files in it are\n"
            "replaced. Byte-level BPE vocabularies only (tokenizer.ggml.model gpt2).\n"
            "\n"
            "exit status: 0 success, 1 error (model, unsupported vocabulary, writing), 2 bad "
            "usage\n");
}

/* A token's vocabulary string as a JSON string; NULL when it is not valid UTF-8 (message
 * printed) or on out of memory. Caller owns the reference. */
static json_t *piece_json(const tdm_tokenizer_t *tok, tdm_token_t id)
{
    size_t len;
    const char *p = tdm_tokenizer_piece(tok, id, &len);
    json_t *s = p ? json_stringn(p, len) : NULL;
    if (!s)
        fprintf(stderr, "tandem tokenizer export: token %d is not valid UTF-8\n", (int)id);
    return s;
}

/* {piece: id} over the whole vocabulary; a piece that several tokens share maps to the id
 * Tandem's own lookup gives (tdm_tokenizer_find), so merges agree too. NULL on
 * failure (message printed). Caller owns the reference. */
static json_t *vocab_json(const tdm_tokenizer_t *tok)
{
    json_t *vocab = json_object();
    int bad = !vocab;
    uint32_t n = tdm_tokenizer_n_vocab(tok);
    for (uint32_t i = 0; i < n && !bad; i++) {
        size_t len;
        const char *p = tdm_tokenizer_piece(tok, (tdm_token_t)i, &len);
        json_t *s = piece_json(tok, (tdm_token_t)i);
        bad = !s;
        if (s && tdm_tokenizer_find(tok, p, len) == (tdm_token_t)i)
            bad = json_object_setn_new(vocab, p, len, json_integer(i)) != 0;
        json_decref(s);
    }
    if (bad) {
        json_decref(vocab);
        return NULL;
    }
    return vocab;
}

/* tokenizer.ggml.merges as [[left, right]], each "left right" split at the first space after
 * its first byte (as tokenizer.c reads them). NULL on failure (message printed). */
static json_t *merges_json(const tdm_gguf_t *g)
{
    tdm_error_t err;
    const tdm_gguf_kv_t *kv;
    if (tdm_gguf_get_arr(g, "tokenizer.ggml.merges", TDM_GGUF_VTYPE_STRING, &kv, &err) != TDM_OK) {
        fprintf(stderr, "tandem tokenizer export: %s\n", err.msg);
        return NULL;
    }
    json_t *merges = json_array();
    int bad = !merges;
    for (uint64_t i = 0; !bad && i < kv->arr_n; i++) {
        const tdm_gguf_str_t *m = &kv->arr_strs[i];
        const char *sp = m->len > 1 ? memchr(m->data + 1, ' ', m->len - 1) : NULL;
        size_t l = sp ? (size_t)(sp - m->data) : 0;
        json_t *pair = sp ? json_pack("[s%s%]", m->data, l, sp + 1, (size_t)m->len - l - 1) : NULL;
        if (!pair)
            fprintf(stderr, "tandem tokenizer export: tokenizer.ggml.merges[%llu] is malformed\n",
                    (unsigned long long)i);
        bad = !pair || json_array_append_new(merges, pair) != 0;
    }
    if (bad) {
        json_decref(merges);
        return NULL;
    }
    return merges;
}

/* The BPE model object. NULL on failure (message printed). Caller owns the reference. */
static json_t *bpe_model_json(const tdm_tokenizer_t *tok, const tdm_gguf_t *g)
{
    tdm_token_t unk_id = tdm_tokenizer_unk(tok);
    json_t *vocab = vocab_json(tok), *merges = merges_json(g);
    json_t *unk = unk_id >= 0 ? piece_json(tok, unk_id) : json_null();
    if (!vocab || !merges || !unk) {
        json_decref(vocab);
        json_decref(merges);
        json_decref(unk);
        return NULL;
    }
    return json_pack("{s:s, s:n, s:o, s:n, s:n, s:b, s:b, s:b, s:o, s:o}", "type", "BPE", "dropout",
                     "unk_token", unk, "continuing_subword_prefix", "end_of_word_suffix",
                     "fuse_unk", 0, "byte_fallback", 0, "ignore_merges",
                     tdm_tokenizer_ignore_merges(tok), "vocab", vocab, "merges", merges);
}

/* The pre-tokenizer: Split(regex, Isolated) for each of Tandem's regexes, then ByteLevel
 * without its regex. NULL on out of memory. */
static json_t *pre_tokenizer_json(const tdm_tokenizer_t *tok)
{
    json_t *seq = json_array();
    const char *re;
    for (size_t i = 0; seq && (re = tdm_tokenizer_pre_regex(tok, i)) != NULL; i++)
        json_array_append_new(seq, json_pack("{s:s, s:{s:s}, s:s, s:b}", "type", "Split", "pattern",
                                             "Regex", re, "behavior", "Isolated", "invert", 0));
    json_array_append_new(seq, json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel",
                                         "add_prefix_space", 0, "trim_offsets", 1, "use_regex", 0));
    return json_pack("{s:s, s:o}", "type", "Sequence", "pretokenizers", seq);
}

/* TemplateProcessing that prepends BOS when the vocabulary adds one, else ByteLevel (what
 * GPT-2-style tokenizer.json files carry). NULL on out of memory. */
static json_t *post_processor_json(const tdm_tokenizer_t *tok)
{
    tdm_token_t bos = tdm_tokenizer_bos(tok);
    if (!tdm_tokenizer_add_bos(tok) || bos < 0)
        return json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1,
                         "trim_offsets", 0, "use_regex", 1);
    json_t *b = piece_json(tok, bos);
    if (!b)
        return NULL;
    const char *bs = json_string_value(b);
    json_t *pp = json_pack(
        "{s:s, s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:[{s:{s:s, s:i}}, {s:{s:s, s:i}}, "
        "{s:{s:s, s:i}}, {s:{s:s, s:i}}], s:{s:{s:s, s:[i], s:[s]}}}",
        "type", "TemplateProcessing", "single", "SpecialToken", "id", bs, "type_id", 0, "Sequence",
        "id", "A", "type_id", 0, "pair", "SpecialToken", "id", bs, "type_id", 0, "Sequence", "id",
        "A", "type_id", 0, "SpecialToken", "id", bs, "type_id", 1, "Sequence", "id", "B", "type_id",
        1, "special_tokens", bs, "id", bs, "ids", (int)bos, "tokens", bs);
    /* json_pack consumed nothing on failure; b is ours either way */
    json_decref(b);
    return pp;
}

/* True for the tokens that become added tokens: control, unknown and user-defined ones with a
 * non-empty text. */
static bool is_added(const tdm_tokenizer_t *tok, tdm_token_t id)
{
    tdm_token_attr_t a = tdm_tokenizer_attr(tok, id);
    size_t len;
    tdm_tokenizer_piece(tok, id, &len);
    return len > 0 &&
           (a == TDM_TOKEN_CONTROL || a == TDM_TOKEN_UNKNOWN || a == TDM_TOKEN_USER_DEFINED);
}

/* The added tokens twice: tokenizer.json's list (with ids) into *list and tokenizer_config.json's
 * added_tokens_decoder (keyed by id) into *decoder. All normalized = false, so Hugging Face
 * matches them in one leftmost-longest pass as Tandem does. Returns 0 or -1 (message printed). */
static int added_tokens_json(const tdm_tokenizer_t *tok, json_t **list, json_t **decoder)
{
    *list = json_array();
    *decoder = json_object();
    int bad = !*list || !*decoder;
    uint32_t n = tdm_tokenizer_n_vocab(tok);
    for (uint32_t i = 0; i < n && !bad; i++) {
        if (!is_added(tok, (tdm_token_t)i))
            continue;
        json_t *s = piece_json(tok, (tdm_token_t)i);
        bool special = tdm_tokenizer_attr(tok, (tdm_token_t)i) != TDM_TOKEN_USER_DEFINED;
        const char *fmt = "{s:O, s:b, s:b, s:b, s:b, s:b}";
        json_t *t = s ? json_pack(fmt, "content", s, "lstrip", 0, "normalized", 0, "rstrip", 0,
                                  "single_word", 0, "special", special)
                      : NULL;
        json_t *with_id = s ? json_pack("{s:i, s:O, s:b, s:b, s:b, s:b, s:b}", "id", (int)i,
                                        "content", s, "single_word", 0, "lstrip", 0, "rstrip", 0,
                                        "normalized", 0, "special", special)
                            : NULL;
        char key[16];
        snprintf(key, sizeof key, "%u", i);
        if (!t || !with_id) {
            json_decref(t);
            json_decref(with_id);
            bad = 1;
        } else {
            bad = json_object_set_new(*decoder, key, t) != 0 ||
                  json_array_append_new(*list, with_id) != 0;
        }
        json_decref(s);
    }
    if (bad) {
        json_decref(*list);
        json_decref(*decoder);
        *list = *decoder = NULL;
        fprintf(stderr, "tandem tokenizer export: cannot list the added tokens\n");
        return -1;
    }
    return 0;
}

/* The whole tokenizer.json. NULL on failure (message printed). Caller owns the reference. */
static json_t *tokenizer_json(const tdm_tokenizer_t *tok, const tdm_gguf_t *g, json_t *added)
{
    json_t *model = bpe_model_json(tok, g);
    json_t *pre = pre_tokenizer_json(tok), *post = post_processor_json(tok);
    json_t *dec = json_pack("{s:s, s:b, s:b, s:b}", "type", "ByteLevel", "add_prefix_space", 1,
                            "trim_offsets", 1, "use_regex", 1);
    if (!model || !pre || !post || !dec) {
        json_decref(model);
        json_decref(pre);
        json_decref(post);
        json_decref(dec);
        return NULL;
    }
    return json_pack("{s:s, s:n, s:n, s:O, s:n, s:o, s:o, s:o, s:o}", "version", "1.0",
                     "truncation", "padding", "added_tokens", added, "normalizer", "pre_tokenizer",
                     pre, "post_processor", post, "decoder", dec, "model", model);
}

/* Sets obj[key] = the text of token id when id >= 0; 0 or -1. */
static int set_token(json_t *obj, const char *key, const tdm_tokenizer_t *tok, tdm_token_t id)
{
    if (id < 0)
        return 0;
    json_t *s = piece_json(tok, id);
    return s ? json_object_set_new(obj, key, s) : -1;
}

/* bos/eos/unk/pad tokens (pad: tokenizer.ggml.padding_token_id) into obj; 0 or -1. */
static int set_special_tokens(json_t *obj, const tdm_tokenizer_t *tok, const tdm_gguf_t *g)
{
    tdm_error_t err;
    uint32_t pad;
    int rc = set_token(obj, "bos_token", tok, tdm_tokenizer_bos(tok)) |
             set_token(obj, "eos_token", tok, tdm_tokenizer_eos(tok)) |
             set_token(obj, "unk_token", tok, tdm_tokenizer_unk(tok));
    if (tdm_gguf_get_u32(g, "tokenizer.ggml.padding_token_id", &pad, &err) == TDM_OK &&
        pad < tdm_tokenizer_n_vocab(tok))
        rc |= set_token(obj, "pad_token", tok, (tdm_token_t)pad);
    return rc ? -1 : 0;
}

/* tokenizer_config.json: the special tokens, the chat template (tokenizer.chat_template) and
 * model_max_length (<general.architecture>.context_length), each when the GGUF has it. NULL on
 * failure. Caller owns the reference. */
static json_t *config_json(const tdm_tokenizer_t *tok, const tdm_gguf_t *g, json_t *decoder)
{
    json_t *c =
        json_pack("{s:b, s:b, s:O, s:b, s:s}", "add_bos_token", tdm_tokenizer_add_bos(tok),
                  "add_eos_token", 0, "added_tokens_decoder", decoder,
                  "clean_up_tokenization_spaces", 0, "tokenizer_class", "PreTrainedTokenizerFast");
    if (!c || set_special_tokens(c, tok, g) != 0) {
        json_decref(c);
        return NULL;
    }
    tdm_error_t err;
    tdm_gguf_str_t s;
    int bad = 0;
    if (tdm_gguf_get_str(g, "tokenizer.chat_template", &s, &err) == TDM_OK)
        bad |= json_object_set_new(c, "chat_template", json_stringn(s.data, (size_t)s.len));
    uint64_t ctx;
    char key[96];
    if (tdm_gguf_get_str(g, "general.architecture", &s, &err) == TDM_OK && s.len < 64) {
        snprintf(key, sizeof key, "%.*s.context_length", (int)s.len, s.data);
        if (tdm_gguf_get_u64(g, key, &ctx, &err) == TDM_OK && ctx <= INT64_MAX)
            bad |= json_object_set_new(c, "model_max_length", json_integer((json_int_t)ctx));
    }
    if (bad) {
        json_decref(c);
        return NULL;
    }
    return c;
}

/* Writes j to DIR/name (2-space indent, UTF-8) and takes the reference; 0 or -1 (message
 * printed). A NULL j (a failed build) is reported as such. */
static int write_json(const char *dir, const char *name, json_t *j)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (!j) {
        fprintf(stderr, "tandem tokenizer export: cannot build %s (out of memory?)\n", name);
        return -1;
    }
    int rc = json_dump_file(j, path, JSON_INDENT(2));
    json_decref(j);
    if (rc != 0)
        fprintf(stderr, "tandem tokenizer export: cannot write %s: %s\n", path, strerror(errno));
    return rc ? -1 : 0;
}

/* Builds and writes the three files; 0 or -1 (message printed). */
static int export_dir(const tdm_tokenizer_t *tok, const tdm_gguf_t *g, const char *dir)
{
    json_t *added, *decoder;
    if (added_tokens_json(tok, &added, &decoder) != 0)
        return -1;
    json_t *special = json_object();
    int rc = 0;
    if (!special || set_special_tokens(special, tok, g) != 0) {
        json_decref(special);
        special = NULL;
    }
    rc |= write_json(dir, "tokenizer.json", tokenizer_json(tok, g, added));
    rc |= write_json(dir, "tokenizer_config.json", config_json(tok, g, decoder));
    rc |= write_json(dir, "special_tokens_map.json", special);
    json_decref(added);
    json_decref(decoder);
    return rc ? -1 : 0;
}

/* Opens MODEL, checks that its vocabulary can be exported, creates DIR and exports. */
static int export_model(const char *model, const char *dir)
{
    tdm_error_t err;
    tdm_gguf_t *g = tdm_gguf_open(model, &err);
    if (!g) {
        fprintf(stderr, "tandem tokenizer export: %s: %s\n", model, err.msg);
        return 1;
    }
    int status = 1;
    tdm_tokenizer_t *tok = tdm_tokenizer_new(g, &err);
    if (!tok) {
        fprintf(stderr, "tandem tokenizer export: %s: %s\n", model, err.msg);
        goto out_close_gguf;
    }
    if (tdm_tokenizer_kind(tok) != TDM_TOKENIZER_BPE) {
        fprintf(stderr,
                "tandem tokenizer export: %s: SentencePiece-style vocabularies "
                "(tokenizer.ggml.model llama) cannot be exported; only byte-level BPE (gpt2)\n",
                model);
        goto out_destroy_tokenizer;
    }
    if (mkdir(dir, 0777) != 0 && errno != EEXIST) {
        fprintf(stderr, "tandem tokenizer export: cannot create %s: %s\n", dir, strerror(errno));
        goto out_destroy_tokenizer;
    }
    status = export_dir(tok, g, dir) == 0 ? 0 : 1;
out_destroy_tokenizer:
    tdm_tokenizer_destroy(&tok);
out_close_gguf:
    tdm_gguf_destroy(&g);
    return status;
}

int tdm_cmd_tokenizer(int argc, char **argv)
{
    if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
        usage(stdout);
        return 0;
    }
    if (argc >= 3 && strcmp(argv[1], "export") == 0 &&
        (strcmp(argv[2], "--help") == 0 || strcmp(argv[2], "-h") == 0)) {
        usage(stdout);
        return 0;
    }
    if (argc != 4 || strcmp(argv[1], "export") != 0) {
        fprintf(stderr, EXPORT_SYNOPSIS "run 'tandem tokenizer --help' for details\n");
        return 2;
    }
    return export_model(argv[2], argv[3]);
}
