/* tiny_model.c - tiny random-weight Llama GGUF models for tests (see tiny_model.h).
 *
 * Metadata keys, tensor names and shapes follow what llama.cpp's convert_hf_to_gguf.py writes
 * for a Llama-architecture model with a GPT-2 style BPE tokenizer (SmolLM2): ne[0] of every
 * matrix is its input dimension. Weights come from splitmix64 and an Irwin-Hall approximation
 * of a normal distribution (sum of four uniforms), which uses only exact arithmetic, so a spec
 * gives the same bytes on every machine.
 */
#include "tiny_model.h"

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#define TOKEN_MAX 16 /* bytes per token text, NUL included ("Ġ" + 3 letters is 6) */
#define MERGE_MAX 24 /* bytes per merge rule, NUL included */

/* ---- random numbers ---- */

typedef struct rng {
    uint64_t state;
} rng_t;

/* splitmix64 (Steele, Lea, Flood 2014; the public-domain reference by S. Vigna). */
static uint64_t rng_next(rng_t *r)
{
    uint64_t z = (r->state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [0, 1) with 24 bits. */
static float rng_uniform(rng_t *r)
{
    return (float)(rng_next(r) >> 40) * (1.0f / 16777216.0f);
}

/* Approximately N(0, 1): the sum of four uniforms has mean 2 and variance 1/3. */
static float rng_normal(rng_t *r)
{
    const float s = rng_uniform(r) + rng_uniform(r) + rng_uniform(r) + rng_uniform(r);
    return (s - 2.0f) * 1.7320508f;
}

/* ---- GPT-2 byte-level alphabet ---- */

static bool gpt2_byte_is_printable(unsigned b)
{
    return (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
}

size_t tdm_test_gpt2_byte_char(uint8_t b, char out[3])
{
    unsigned cp = b;
    if (!gpt2_byte_is_printable(b)) {
        cp = 256;
        for (unsigned c = 0; c < b; c++)
            cp += !gpt2_byte_is_printable(c);
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = '\0';
        return 1;
    }
    out[0] = (char)(0xc0 | (cp >> 6));
    out[1] = (char)(0x80 | (cp & 0x3f));
    out[2] = '\0';
    return 2;
}

uint32_t tdm_test_tiny_byte_token(uint8_t b)
{
    uint32_t id = 0;
    const bool printable = gpt2_byte_is_printable(b);
    for (unsigned c = 0; c < 256; c++) {
        if (c == b)
            break;
        if (gpt2_byte_is_printable(c) == printable)
            id++;
    }
    return printable ? id : 188 + id; /* 188 printable bytes come first */
}

/* ---- vocabulary ---- */

/* Common English merges in priority order; each part exists before the rule that uses it. */
static const char *const hand_merges[] = {
    "Ġ t",     "Ġ a",  "h e",   "i n",     "r e",  "o n",    "Ġt he",  "e r",   "Ġ s",
    "a t",     "Ġ w",  "Ġ o",   "e n",     "Ġ c",  "i t",    "i s",    "a n",   "o r",
    "e s",     "Ġ b",  "e d",   "Ġ f",     "in g", "Ġ p",    "o u",    "n d",   "Ġa nd",
    "Ġ m",     "Ġo f", "Ġt o",  "Ġ i",     "Ġ h",  "l l",    "Ġ d",    "l o",   "Ġ l",
    "Ġ n",     "Ġ T",  "Ġ I",   "Ġ H",     "H e",  "ll o",   "He llo", "Ġw or", "l d",
    "Ġwor ld", "e l",  "el lo", "ĠH ello", "Ċ Ċ",  "Ġ Ġ",    "ĠĠ ĠĠ",  "i m",   "Ġ y",
    "Ġy ou",   "Ġ 1",  "e x",   "Ġ ex",    "a m",  "Ġex am", "Ġ .",
};
#define N_HAND_MERGES (sizeof hand_merges / sizeof hand_merges[0])

typedef struct vocab {
    char (*tokens)[TOKEN_MAX]; /* [n_vocab] */
    char (*merges)[MERGE_MAX]; /* [n_merges] */
    uint32_t n_vocab, n_merges, n_done;
} vocab_t;

static bool vocab_has_hand(const vocab_t *v, const char *tok)
{
    /* generated merges have fixed shapes that never repeat each other; only the hand-written
     * ones (the first N_HAND_MERGES merged tokens) can coincide with them */
    for (uint32_t i = 0; i < N_HAND_MERGES && i < v->n_done; i++)
        if (strcmp(v->tokens[TDM_TINY_N_BYTE_TOKENS + i], tok) == 0)
            return true;
    return false;
}

/* Appends merge "a b" -> token ab unless it exists or the vocabulary is full. */
static void vocab_merge(vocab_t *v, const char *a, const char *b)
{
    if (v->n_done == v->n_merges)
        return;
    char tok[TOKEN_MAX];
    snprintf(tok, sizeof tok, "%s%s", a, b);
    if (vocab_has_hand(v, tok))
        return;
    memcpy(v->tokens[TDM_TINY_N_BYTE_TOKENS + v->n_done], tok, sizeof tok);
    snprintf(v->merges[v->n_done], MERGE_MAX, "%s %s", a, b);
    v->n_done++;
}

static int vocab_build(vocab_t *v, uint32_t n_vocab, tdm_error_t *err)
{
    v->n_vocab = n_vocab;
    v->n_merges = n_vocab - TDM_TINY_MIN_VOCAB;
    v->n_done = 0;
    v->tokens = calloc(n_vocab, sizeof *v->tokens);
    v->merges = calloc(v->n_merges ? v->n_merges : 1, sizeof *v->merges);
    if (!v->tokens || !v->merges)
        return tdm_error_set(err, TDM_ERESOURCE, "tiny model: out of memory for the vocabulary");
    for (unsigned b = 0; b < 256; b++)
        tdm_test_gpt2_byte_char((uint8_t)b, v->tokens[tdm_test_tiny_byte_token((uint8_t)b)]);

    for (size_t i = 0; i < N_HAND_MERGES; i++) {
        char a[TOKEN_MAX], b[TOKEN_MAX];
        const char *sp = strchr(hand_merges[i], ' ');
        TDM_ASSERT(sp && (size_t)(sp - hand_merges[i]) < sizeof a);
        snprintf(a, sizeof a, "%.*s", (int)(sp - hand_merges[i]), hand_merges[i]);
        snprintf(b, sizeof b, "%s", sp + 1);
        vocab_merge(v, a, b);
    }
    char x[2] = "a", y[2] = "a", z[2] = "a", gx[TOKEN_MAX], xy[TOKEN_MAX], gxy[TOKEN_MAX];
    for (x[0] = 'a'; x[0] <= 'z'; x[0]++) /* "x y" -> "xy" */
        for (y[0] = 'a'; y[0] <= 'z'; y[0]++)
            vocab_merge(v, x, y);
    for (x[0] = 'a'; x[0] <= 'z'; x[0]++) /* "Ġ x" -> "Ġx" */
        vocab_merge(v, "Ġ", x);
    for (x[0] = 'a'; x[0] <= 'z'; x[0]++) { /* "Ġx y" -> "Ġxy" */
        snprintf(gx, sizeof gx, "Ġ%s", x);
        for (y[0] = 'a'; y[0] <= 'z'; y[0]++)
            vocab_merge(v, gx, y);
    }
    for (x[0] = 'a'; x[0] <= 'z'; x[0]++) /* "xy z" -> "xyz" */
        for (y[0] = 'a'; y[0] <= 'z'; y[0]++) {
            snprintf(xy, sizeof xy, "%s%s", x, y);
            for (z[0] = 'a'; z[0] <= 'z'; z[0]++)
                vocab_merge(v, xy, z);
        }
    for (x[0] = 'a'; x[0] <= 'z'; x[0]++) /* "Ġxy z" -> "Ġxyz" */
        for (y[0] = 'a'; y[0] <= 'z'; y[0]++) {
            snprintf(gxy, sizeof gxy, "Ġ%s%s", x, y);
            for (z[0] = 'a'; z[0] <= 'z'; z[0]++)
                vocab_merge(v, gxy, z);
        }
    if (v->n_done < v->n_merges)
        return tdm_error_set(err, TDM_EINVALID,
                             "tiny model: n_vocab %u is too large (at most %u tokens)", n_vocab,
                             TDM_TINY_MIN_VOCAB + v->n_done);
    snprintf(v->tokens[n_vocab - 3], TOKEN_MAX, "<|endoftext|>");
    snprintf(v->tokens[n_vocab - 2], TOKEN_MAX, "<|im_start|>");
    snprintf(v->tokens[n_vocab - 1], TOKEN_MAX, "<|im_end|>");
    return TDM_OK;
}

static void vocab_free(vocab_t *v)
{
    free(v->tokens);
    free(v->merges);
}

/* ---- the model ---- */

static const char chatml_template[] =
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

/* llama.cpp's llama_ftype for a model whose projections are of type t. */
static uint32_t file_type_of(tdm_ggml_type_t t)
{
    switch (t) {
    case TDM_GGML_TYPE_F32: return 0;   /* LLAMA_FTYPE_ALL_F32 */
    case TDM_GGML_TYPE_F16: return 1;   /* MOSTLY_F16 */
    case TDM_GGML_TYPE_Q4_0: return 2;  /* MOSTLY_Q4_0 */
    case TDM_GGML_TYPE_Q4_1: return 3;  /* MOSTLY_Q4_1 */
    case TDM_GGML_TYPE_Q8_0: return 7;  /* MOSTLY_Q8_0 */
    case TDM_GGML_TYPE_Q5_0: return 8;  /* MOSTLY_Q5_0 */
    case TDM_GGML_TYPE_Q5_1: return 9;  /* MOSTLY_Q5_1 */
    case TDM_GGML_TYPE_Q4_K: return 15; /* MOSTLY_Q4_K_M */
    case TDM_GGML_TYPE_Q5_K: return 17; /* MOSTLY_Q5_K_M */
    case TDM_GGML_TYPE_Q6_K: return 18; /* MOSTLY_Q6_K */
    case TDM_GGML_TYPE_BF16: return 32; /* MOSTLY_BF16 */
    default: return 0;
    }
}

/* Spec with the defaults filled in, checked. */
static int spec_resolve(const tdm_tiny_llama_spec_t *in, tdm_tiny_llama_spec_t *s, tdm_error_t *err)
{
    *s = in ? *in : (tdm_tiny_llama_spec_t){0};
    if (!s->name)
        s->name = "tiny-llama";
    if (!s->n_vocab)
        s->n_vocab = 512;
    if (!s->n_embd)
        s->n_embd = 64;
    if (!s->n_layers)
        s->n_layers = 2;
    if (!s->n_heads)
        s->n_heads = 4;
    if (!s->n_kv_heads)
        s->n_kv_heads = s->n_heads >= 2 ? s->n_heads / 2 : 1;
    if (!s->n_ff)
        s->n_ff = 2 * s->n_embd;
    if (!s->n_ctx)
        s->n_ctx = 256;
    if (s->rope_freq_base == 0.0f)
        s->rope_freq_base = 10000.0f;
    if (s->rms_norm_eps == 0.0f)
        s->rms_norm_eps = 1e-5f;
    if (s->weight_std == 0.0f)
        s->weight_std = 0.02f;
    if (s->n_expert && !s->n_expert_used)
        s->n_expert_used = s->n_expert < 2 ? s->n_expert : 2;
    if (s->n_vocab < TDM_TINY_MIN_VOCAB)
        return tdm_error_set(err, TDM_EINVALID, "tiny model: n_vocab %u < %d", s->n_vocab,
                             TDM_TINY_MIN_VOCAB);
    if (s->n_embd % s->n_heads != 0)
        return tdm_error_set(err, TDM_EINVALID, "tiny model: n_heads %u does not divide n_embd %u",
                             s->n_heads, s->n_embd);
    if (s->n_heads % s->n_kv_heads != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "tiny model: n_kv_heads %u does not divide n_heads %u", s->n_kv_heads,
                             s->n_heads);
    const tdm_ggml_type_info_t *wt = tdm_ggml_type_get((uint32_t)s->weight_type);
    const tdm_ggml_type_info_t *et = tdm_ggml_type_get((uint32_t)s->embd_type);
    if (!wt || !wt->supported || !et || !et->supported)
        return tdm_error_set(err, TDM_EINVALID,
                             "tiny model: weight_type %d or embd_type %d is "
                             "not a supported tensor type",
                             (int)s->weight_type, (int)s->embd_type);
    if (s->n_embd % wt->block_size != 0 || s->n_ff % wt->block_size != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "tiny model: weight_type %s needs n_embd (%u) and "
                             "n_ff (%u) to be multiples of %u",
                             wt->name, s->n_embd, s->n_ff, wt->block_size);
    if (s->n_embd % et->block_size != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "tiny model: embd_type %s needs n_embd (%u) to be a multiple of %u",
                             et->name, s->n_embd, et->block_size);
    return TDM_OK;
}

/* Adds a [ne0, ne1] (ne1 = 1: 1-D; ne2 > 1: 3-D [ne0, ne1, ne2], the experts of a layer)
 * tensor of type t with values mean + std * N(0, 1), drawn row by row from r and converted
 * to t. */
static int add_random3(tdm_gguf_writer_t *w, rng_t *r, const char *name, tdm_ggml_type_t t,
                       uint64_t ne0, uint64_t ne1, uint64_t ne2, float mean, float std,
                       tdm_error_t *err)
{
    const size_t row_bytes = tdm_ggml_row_size(t, ne0);
    float *row = malloc(ne0 * sizeof *row);
    uint8_t *data = malloc(row_bytes * ne1 * ne2);
    int rc = TDM_OK;
    if (!row || !data) {
        rc = tdm_error_set(err, TDM_ERESOURCE, "tiny model: out of memory for %s", name);
        goto out_free;
    }
    for (uint64_t i = 0; i < ne1 * ne2; i++) {
        for (uint64_t j = 0; j < ne0; j++)
            row[j] = mean + std * rng_normal(r);
        rc = tdm_ggml_quantize_row(t, row, data + i * row_bytes, (int64_t)ne0);
        TDM_ASSERT(rc == TDM_OK); /* the spec was checked */
    }
    const uint64_t ne[3] = {ne0, ne1, ne2};
    rc = tdm_gguf_writer_add_tensor(w, name, t, ne2 > 1 ? 3 : ne1 == 1 ? 1 : 2, ne, data);
    if (rc != TDM_OK)
        tdm_error_set(err, rc, "tiny model: cannot add tensor %s", name);
out_free:
    free(data);
    free(row);
    return rc;
}

static int add_random(tdm_gguf_writer_t *w, rng_t *r, const char *name, tdm_ggml_type_t t,
                      uint64_t ne0, uint64_t ne1, float mean, float std, tdm_error_t *err)
{
    return add_random3(w, r, name, t, ne0, ne1, 1, mean, std, err);
}

static int add_metadata(tdm_gguf_writer_t *w, const tdm_tiny_llama_spec_t *s, const vocab_t *v)
{
    const uint32_t head_dim = s->n_embd / s->n_heads;
    const char **tokens = malloc(v->n_vocab * sizeof *tokens);
    const char **merges = malloc((v->n_merges ? v->n_merges : 1) * sizeof *merges);
    int32_t *types = malloc(v->n_vocab * sizeof *types);
    int rc = TDM_ERESOURCE;
    if (!tokens || !merges || !types)
        goto out_free;
    for (uint32_t i = 0; i < v->n_vocab; i++) {
        tokens[i] = v->tokens[i];
        types[i] = i >= v->n_vocab - 3 ? 3 : 1; /* CONTROL for specials, else NORMAL */
    }
    for (uint32_t i = 0; i < v->n_merges; i++)
        merges[i] = v->merges[i];

    /* in the order convert_hf_to_gguf.py writes them */
    rc = tdm_gguf_writer_set_str(w, "general.architecture", "llama");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.type", "model");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.name", s->name);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.block_count", s->n_layers);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.context_length", s->n_ctx);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.embedding_length", s->n_embd);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.feed_forward_length", s->n_ff);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.attention.head_count", s->n_heads);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.attention.head_count_kv", s->n_kv_heads);
    rc = rc ? rc : tdm_gguf_writer_set_f32(w, "llama.rope.freq_base", s->rope_freq_base);
    rc = rc ? rc
            : tdm_gguf_writer_set_f32(w, "llama.attention.layer_norm_rms_epsilon", s->rms_norm_eps);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.file_type", file_type_of(s->weight_type));
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.vocab_size", s->n_vocab);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.rope.dimension_count", head_dim);
    if (s->n_expert > 0) {
        rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.expert_count", s->n_expert);
        rc = rc ? rc : tdm_gguf_writer_set_u32(w, "llama.expert_used_count", s->n_expert_used);
    }
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "tokenizer.ggml.pre", "smollm");
    rc = rc ? rc : tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.tokens", tokens, v->n_vocab);
    rc = rc ? rc : tdm_gguf_writer_set_arr_i32(w, "tokenizer.ggml.token_type", types, v->n_vocab);
    rc = rc ? rc : tdm_gguf_writer_set_arr_str(w, "tokenizer.ggml.merges", merges, v->n_merges);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", v->n_vocab - 2);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", v->n_vocab - 1);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "tokenizer.ggml.unknown_token_id", v->n_vocab - 3);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", v->n_vocab - 1);
    rc = rc ? rc : tdm_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", false);
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "tokenizer.chat_template", chatml_template);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.quantization_version", 2);
out_free:
    free(types);
    free(merges);
    free(tokens);
    return rc;
}

int tdm_test_tiny_llama_build(const tdm_tiny_llama_spec_t *spec, tdm_gguf_writer_t **out,
                              tdm_error_t *err)
{
    tdm_tiny_llama_spec_t s;
    vocab_t v = {0};
    *out = NULL;
    int rc = spec_resolve(spec, &s, err);
    if (rc != TDM_OK)
        return rc;
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    if (!w)
        return tdm_error_set(err, TDM_ERESOURCE, "tiny model: out of memory");
    if ((rc = vocab_build(&v, s.n_vocab, err)) != TDM_OK)
        goto out_destroy;
    if ((rc = add_metadata(w, &s, &v)) != TDM_OK) {
        tdm_error_set(err, rc, "tiny model: out of memory for the metadata");
        goto out_destroy;
    }

    rng_t r = {.state = s.seed};
    const uint64_t E = s.n_embd, F = s.n_ff, V = s.n_vocab, X = s.n_expert;
    const uint64_t q_dim = s.n_heads * (uint64_t)(s.n_embd / s.n_heads);
    const uint64_t kv_dim = s.n_kv_heads * (uint64_t)(s.n_embd / s.n_heads);
    const float sd = s.weight_std;
    const tdm_ggml_type_t wt = s.weight_type, f32 = TDM_GGML_TYPE_F32;
    if ((rc = add_random(w, &r, "token_embd.weight", s.embd_type, E, V, 0, sd, err)) != TDM_OK)
        goto out_destroy;
    for (uint32_t l = 0; l < s.n_layers; l++) {
        const struct {
            const char *name;
            tdm_ggml_type_t type;
            uint64_t ne0, ne1;
            float mean;
        } ts[] = {
            {"attn_norm", f32, E, 1, 1.0f},   {"attn_q", wt, E, q_dim, 0.0f},
            {"attn_k", wt, E, kv_dim, 0.0f},  {"attn_v", wt, E, kv_dim, 0.0f},
            {"attn_output", wt, q_dim, E, 0}, {"ffn_norm", f32, E, 1, 1.0f},
            {"ffn_gate", wt, E, F, 0.0f},     {"ffn_up", wt, E, F, 0.0f},
            {"ffn_down", wt, F, E, 0.0f},     {"ffn_gate_inp", f32, E, X, 0.0f},
        };
        for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) {
            const bool ffn = i >= 6 && i <= 8, moe = X > 0;
            if (i == 9 && !moe)
                continue;
            char name[64];
            snprintf(name, sizeof name, "blk.%u.%s%s.weight", l, ts[i].name,
                     ffn && moe ? "_exps" : "");
            /* the router at std 1/sqrt(n_embd): logits of RMS ~1, routes that differ by token */
            float std = i == 9 ? 1.0f / sqrtf((float)E) : sd;
            rc = add_random3(w, &r, name, ts[i].type, ts[i].ne0, ts[i].ne1, ffn && moe ? X : 1,
                             ts[i].mean, std, err);
            if (rc != TDM_OK)
                goto out_destroy;
        }
    }
    if ((rc = add_random(w, &r, "output_norm.weight", f32, E, 1, 1.0f, sd, err)) != TDM_OK)
        goto out_destroy;
    if (!s.tied_embeddings &&
        (rc = add_random(w, &r, "output.weight", s.embd_type, E, V, 0, sd, err)) != TDM_OK)
        goto out_destroy;
    vocab_free(&v);
    *out = w;
    return TDM_OK;

out_destroy:
    vocab_free(&v);
    tdm_gguf_writer_destroy(&w);
    return rc;
}

int tdm_test_write_tiny_llama(const char *path, const tdm_tiny_llama_spec_t *spec, tdm_error_t *err)
{
    tdm_gguf_writer_t *w;
    int rc = tdm_test_tiny_llama_build(spec, &w, err);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_gguf_writer_write_file(w, path, err);
    tdm_gguf_writer_destroy(&w);
    return rc;
}

int tdm_test_tiny_llama_to_memory(const tdm_tiny_llama_spec_t *spec, void **data, size_t *size)
{
    tdm_gguf_writer_t *w;
    int rc = tdm_test_tiny_llama_build(spec, &w, NULL);
    if (rc != TDM_OK)
        return rc;
    rc = tdm_gguf_writer_to_memory(w, data, size);
    tdm_gguf_writer_destroy(&w);
    return rc;
}

/* `cli model synth ARGS`, quiet; whether it exited 0. */
static bool synth_ok(const char *cli, const char *args)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "'%s' model synth %s >/dev/null", cli, args);
    int st = system(cmd);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0;
}

int tdm_test_synth_gemma3_tiny(const char *cli, char *dir_template, char *path, size_t cap,
                               tdm_error_t *err)
{
    if (!mkdtemp(dir_template))
        return tdm_error_set(err, TDM_EUNAVAILABLE, "mkdtemp %s failed", dir_template);
    char tiny[256], vocab[256], args[1024];
    snprintf(tiny, sizeof tiny, "%s/tiny.gguf", dir_template);
    snprintf(vocab, sizeof vocab, "%s/vocab.gguf", dir_template);
    snprintf(path, cap, "%s/gemma3tiny.gguf", dir_template);
    int rc = tdm_test_write_tiny_llama(tiny, NULL, err);
    if (rc != TDM_OK)
        return rc;
    snprintf(args, sizeof args, "--vocab-only -m '%s' -o '%s'", tiny, vocab);
    if (!synth_ok(cli, args))
        return tdm_error_set(err, TDM_EUNAVAILABLE, "tandem model synth --vocab-only failed");
    snprintf(args, sizeof args, "--shape gemma3-tiny --type Q8_0 --vocab '%s' -o '%s'", vocab,
             path);
    if (!synth_ok(cli, args))
        return tdm_error_set(err, TDM_EUNAVAILABLE,
                             "tandem model synth --shape gemma3-tiny failed");
    return TDM_OK;
}
