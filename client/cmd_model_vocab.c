/* cmd_model_vocab.c - copies a GGUF's tokenizer (every tokenizer.* key) into a writer, for
 * `tandem model synth` and its vocabulary-only files.
 *
 * Values keep their GGUF types where the writer has a setter (strings, u32, i32, u64, f32, bool,
 * arrays of strings, f32 and i32); other integer types are widened to u32/i32, which the readers
 * (Tandem's and llama.cpp's) accept for every tokenizer key. A vocabulary smaller than the
 * model's embedding gets unused padding tokens, as converters do for models whose embedding is
 * rounded up (Llama 3's 128256 rows hold 256 reserved tokens).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd_model.h"

#define PAD_TOKEN_MAX 40 /* "<|synth_pad_N|>" for any 64-bit N, and the NUL */
#define TOKEN_TYPE_UNUSED 5

uint32_t tdm_synth_vocab_size(const tdm_gguf_t *g)
{
    const tdm_gguf_kv_t *kv = tdm_gguf_find_kv(g, "tokenizer.ggml.tokens");
    if (!kv || kv->type != TDM_GGUF_VTYPE_ARRAY || kv->arr_type != TDM_GGUF_VTYPE_STRING ||
        kv->arr_n > UINT32_MAX)
        return 0;
    return (uint32_t)kv->arr_n;
}

/* A string array padded to n entries with "<|synth_pad_I|>" (I = the index). */
static int copy_arr_str(tdm_gguf_writer_t *w, const tdm_gguf_kv_t *kv, uint64_t n)
{
    char **v = calloc(n ? n : 1, sizeof *v);
    int rc = v ? TDM_OK : TDM_ERESOURCE;
    for (uint64_t i = 0; rc == TDM_OK && i < n; i++) {
        if (i < kv->arr_n) {
            v[i] = malloc(kv->arr_strs[i].len + 1);
            if (v[i]) {
                memcpy(v[i], kv->arr_strs[i].data, kv->arr_strs[i].len);
                v[i][kv->arr_strs[i].len] = '\0';
            }
        } else if ((v[i] = malloc(PAD_TOKEN_MAX)) != NULL) {
            snprintf(v[i], PAD_TOKEN_MAX, "<|synth_pad_%llu|>", (unsigned long long)i);
        }
        rc = v[i] ? TDM_OK : TDM_ERESOURCE;
    }
    if (rc == TDM_OK)
        rc = tdm_gguf_writer_set_arr_str(w, kv->key, (const char *const *)v, (size_t)n);
    for (uint64_t i = 0; v && i < n; i++)
        free(v[i]);
    free(v);
    return rc;
}

/* A numeric array as f32 (float elements) or i32 (integers), padded to n entries with pad. */
static int copy_arr_num(tdm_gguf_writer_t *w, const tdm_gguf_kv_t *kv, uint64_t n, double pad)
{
    const bool is_float =
        kv->arr_type == TDM_GGUF_VTYPE_FLOAT32 || kv->arr_type == TDM_GGUF_VTYPE_FLOAT64;
    float *f = is_float ? malloc((n ? n : 1) * sizeof *f) : NULL;
    int32_t *d = is_float ? NULL : malloc((n ? n : 1) * sizeof *d);
    int rc = TDM_ERESOURCE;
    if (f || d) {
        for (uint64_t i = 0; i < n; i++) {
            if (f)
                f[i] = i < kv->arr_n ? (float)tdm_gguf_arr_float(kv, i) : (float)pad;
            else
                d[i] = i < kv->arr_n ? (int32_t)tdm_gguf_arr_int(kv, i) : (int32_t)pad;
        }
        rc = f ? tdm_gguf_writer_set_arr_f32(w, kv->key, f, (size_t)n)
               : tdm_gguf_writer_set_arr_i32(w, kv->key, d, (size_t)n);
    }
    free(f);
    free(d);
    return rc;
}

/* One scalar key. */
static int copy_scalar(tdm_gguf_writer_t *w, const tdm_gguf_kv_t *kv)
{
    switch (kv->type) {
    case TDM_GGUF_VTYPE_STRING: {
        char *s = malloc(kv->value.str.len + 1);
        if (!s)
            return TDM_ERESOURCE;
        memcpy(s, kv->value.str.data, kv->value.str.len);
        s[kv->value.str.len] = '\0';
        int rc = tdm_gguf_writer_set_str(w, kv->key, s);
        free(s);
        return rc;
    }
    case TDM_GGUF_VTYPE_BOOL: return tdm_gguf_writer_set_bool(w, kv->key, kv->value.u64 != 0);
    case TDM_GGUF_VTYPE_FLOAT32:
    case TDM_GGUF_VTYPE_FLOAT64: return tdm_gguf_writer_set_f32(w, kv->key, (float)kv->value.f64);
    case TDM_GGUF_VTYPE_UINT64: return tdm_gguf_writer_set_u64(w, kv->key, kv->value.u64);
    case TDM_GGUF_VTYPE_INT8:
    case TDM_GGUF_VTYPE_INT16:
    case TDM_GGUF_VTYPE_INT32:
    case TDM_GGUF_VTYPE_INT64: return tdm_gguf_writer_set_i32(w, kv->key, (int32_t)kv->value.i64);
    default: return tdm_gguf_writer_set_u32(w, kv->key, (uint32_t)kv->value.u64);
    }
}

int tdm_model_copy_kv(tdm_gguf_writer_t *w, const tdm_gguf_kv_t *kv)
{
    if (kv->type != TDM_GGUF_VTYPE_ARRAY)
        return copy_scalar(w, kv);
    return kv->arr_type == TDM_GGUF_VTYPE_STRING ? copy_arr_str(w, kv, kv->arr_n)
                                                 : copy_arr_num(w, kv, kv->arr_n, 0);
}

/* The per-token arrays (tokens, scores, token_type) are padded; others (merges) are not. */
static bool is_token_array(const char *key)
{
    return strcmp(key, "tokenizer.ggml.tokens") == 0 || strcmp(key, "tokenizer.ggml.scores") == 0 ||
           strcmp(key, "tokenizer.ggml.token_type") == 0;
}

int tdm_synth_copy_vocab(tdm_gguf_writer_t *w, const tdm_gguf_t *g, uint32_t n_vocab,
                         uint32_t *n_tokens, tdm_error_t *err)
{
    *n_tokens = tdm_synth_vocab_size(g);
    if (*n_tokens == 0)
        return tdm_error_set(err, TDM_ENOTFOUND, "no tokenizer.ggml.tokens string array");
    for (uint64_t i = 0; i < tdm_gguf_n_kv(g); i++) {
        const tdm_gguf_kv_t *kv = tdm_gguf_kv_at(g, i);
        if (strncmp(kv->key, "tokenizer.", 10) != 0)
            continue;
        int rc;
        if (kv->type != TDM_GGUF_VTYPE_ARRAY) {
            rc = copy_scalar(w, kv);
        } else {
            const bool pad = is_token_array(kv->key) && kv->arr_n == *n_tokens;
            const uint64_t n = pad && n_vocab > *n_tokens ? n_vocab : kv->arr_n;
            rc = kv->arr_type == TDM_GGUF_VTYPE_STRING
                     ? copy_arr_str(w, kv, n)
                     : copy_arr_num(w, kv, n, strstr(kv->key, "type") ? TOKEN_TYPE_UNUSED : 0);
        }
        if (rc != TDM_OK)
            return tdm_error_set(err, rc, "cannot copy %s: out of memory", kv->key);
    }
    return TDM_OK;
}
