/* hparams.c - Llama-family hyperparameters from GGUF metadata, validated against the tensors.
 *
 * Keys follow llama.cpp's naming (`<arch>.block_count`, `<arch>.attention.head_count`, …);
 * tensor names and shapes follow llama.cpp's converter (ne[0] is the input dimension of a
 * projection: attn_q.weight has ne = [n_embd, n_heads * head_dim]).
 */
#include "tandem/gguf.h"

#include "gguf/hparams_internal.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

typedef struct arch_info {
    const char *name;
    tdm_rope_type_t rope_type;
    bool qk_norm;    /* RMSNorm of each head of q and k before RoPE (Qwen3, Gemma 3) */
    bool gemma;      /* the Gemma 3 block (llama.cpp's src/models/gemma3.cpp): embeddings scaled by
                        sqrt(n_embd), post-norms, GeGLU, q scaled before attention, sliding-window
                        layers */
    bool rope_freqs; /* may carry rope_freqs.weight (Llama 3.x; llama.cpp's models/llama.cpp) */
    bool phi3;       /* the Phi-3 block (llama.cpp's src/models/phi3.cpp): fused QKV (or separate
                        q/k/v) and fused gate/up projections, q scaled by 1 / sqrt(head_dim)
                        after RoPE, rope_factors_long/short, the sliding window ignored */
} arch_info_t;

/* Architectures that share the Llama block (pre-norm, GQA attention with RoPE, gated FFN).
 * Rope type per llama.cpp's llama_model_rope_type(); qwen3 is qwen2's block with QK-norm and
 * (in the released models) no q/k/v biases (llama.cpp's src/models/qwen3.cpp). */
static const arch_info_t supported_archs[] = {
    {"llama", TDM_ROPE_NORMAL, false, false, true, false},
    {"mistral", TDM_ROPE_NORMAL, false, false, true, false},
    {"qwen2", TDM_ROPE_NEOX, false, false, false, false},
    {"qwen3", TDM_ROPE_NEOX, true, false, false, false},
    {"qwen3moe", TDM_ROPE_NEOX, true, false, false, false}, /* qwen3 with experts (hparams_moe.c) */
    {"gemma3", TDM_ROPE_NEOX, true, true, false, false},
    {"phi3", TDM_ROPE_NEOX, false, false, false, true},
};
#define SUPPORTED_ARCH_NAMES "llama, mistral, qwen2, qwen3, qwen3moe, gemma3, phi3"

/* Whether architecture arch may carry RoPE frequency factors. */
static bool arch_has_rope_freqs(const char *arch)
{
    for (size_t i = 0; i < sizeof supported_archs / sizeof supported_archs[0]; i++)
        if (strcmp(arch, supported_archs[i].name) == 0)
            return supported_archs[i].rope_freqs;
    return false;
}

void tdm_llama_layer_rope(const tdm_llama_hparams_t *hp, uint32_t l, float *freq_base,
                          float *freq_scale)
{
    bool swa = hp->n_swa > 0 && l < TDM_GGUF_MAX_LAYERS && hp->swa_layers[l];
    *freq_base = swa ? hp->rope_freq_base_swa : hp->rope_freq_base;
    *freq_scale = swa ? 1.0f : hp->rope_freq_scale;
}

const float *tdm_llama_rope_factors(const tdm_llama_hparams_t *hp, uint32_t n_ctx)
{
    if (hp->n_rope_freq_factors)
        return hp->rope_freq_factors;
    if (hp->n_rope_long_short)
        return n_ctx > hp->n_ctx_orig ? hp->rope_factors_long : hp->rope_factors_short;
    return NULL;
}

uint32_t tdm_llama_layer_first_key(const tdm_llama_hparams_t *hp, uint32_t l, uint32_t pos)
{
    if (hp->n_swa == 0 || l >= TDM_GGUF_MAX_LAYERS || !hp->swa_layers[l] || pos < hp->n_swa)
        return 0;
    return pos + 1 - hp->n_swa;
}

uint32_t tdm_llama_layer_window(const tdm_llama_hparams_t *hp, uint32_t l)
{
    return hp->n_swa != 0 && l < TDM_GGUF_MAX_LAYERS && hp->swa_layers[l] ? hp->n_swa : 0;
}

static int get_u32_key(const tdm_gguf_t *g, const char *arch, const char *suffix, bool required,
                       uint32_t dflt, uint32_t *out, tdm_error_t *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = tdm_gguf_get_u32(g, key, out, err);
    if (rc == TDM_ENOTFOUND && !required) {
        *out = dflt;
        tdm_error_clear(err);
        return TDM_OK;
    }
    if (rc == TDM_OK && *out == 0)
        return tdm_error_set(err, TDM_EINVALID, "metadata '%s' must be positive, got 0", key);
    return rc;
}

static int get_f32_key(const tdm_gguf_t *g, const char *arch, const char *suffix, bool required,
                       float dflt, float *out, tdm_error_t *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.%s", arch, suffix);
    int rc = tdm_gguf_get_f32(g, key, out, err);
    if (rc == TDM_ENOTFOUND && !required) {
        *out = dflt;
        tdm_error_clear(err);
        return TDM_OK;
    }
    if (rc == TDM_OK && !(*out > 0.0f))
        return tdm_error_set(err, TDM_EINVALID, "metadata '%s' must be positive, got %g", key,
                             (double)*out);
    return rc;
}

/* Checks that tensor `name` exists (unless optional), has the given 1-D or 2-D shape
 * (ne1 = 0 for 1-D) and a supported type. *found tells whether it exists. */
static int check_tensor(const tdm_gguf_t *g, const char *name, uint64_t ne0, uint64_t ne1,
                        bool optional, bool *found, tdm_error_t *err)
{
    const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(g, name);
    if (found)
        *found = t != NULL;
    if (!t) {
        if (optional)
            return TDM_OK;
        return tdm_error_set(err, TDM_ENOTFOUND, "tensor '%s' is missing", name);
    }
    uint32_t want_dims = ne1 ? 2 : 1;
    bool ok = t->ne[0] == ne0 && (ne1 ? t->ne[1] == ne1 : t->ne[1] == 1) && t->ne[2] == 1 &&
              t->ne[3] == 1;
    if (!ok)
        return tdm_error_set(err, TDM_EINVALID,
                             "tensor '%s' has shape [%" PRIu64 ", %" PRIu64 ", %" PRIu64
                             ", %" PRIu64 "], expected %s[%" PRIu64 ", %" PRIu64 "]",
                             name, t->ne[0], t->ne[1], t->ne[2], t->ne[3],
                             want_dims == 1 ? "1-D " : "", ne0, ne1 ? ne1 : 1);
    const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(t->type);
    if (!ti || !ti->supported)
        return tdm_error_set(
            err, TDM_EINVALID,
            "tensor '%s' has type %s, which Tandem cannot compute with "
            "(supported: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q2_K Q3_K Q4_K Q5_K "
            "Q6_K)",
            name, ti ? ti->name : "?");
    return TDM_OK;
}

/* Norm weights, biases and RoPE frequency factors are used as f32 vectors by the engine. */
static int require_f32(const tdm_gguf_t *g, const char *name, tdm_error_t *err)
{
    const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(g, name);
    if (t && t->type != TDM_GGML_TYPE_F32)
        return tdm_error_set(err, TDM_EINVALID,
                             "tensor '%s' has type %s; norm weights, biases and RoPE frequency "
                             "factors must be F32",
                             name, tdm_ggml_type_get(t->type)->name);
    return TDM_OK;
}

/* general.architecture: sets hp->arch and hp->rope_type. */
static int hparams_arch(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    tdm_gguf_str_t arch_s;
    int rc = tdm_gguf_get_str(g, "general.architecture", &arch_s, err);
    if (rc != TDM_OK)
        return rc;
    const arch_info_t *arch = NULL;
    for (size_t i = 0; i < sizeof supported_archs / sizeof supported_archs[0]; i++)
        if (arch_s.len == strlen(supported_archs[i].name) &&
            memcmp(arch_s.data, supported_archs[i].name, arch_s.len) == 0)
            arch = &supported_archs[i];
    if (!arch)
        return tdm_error_set(err, TDM_EINVALID,
                             "general.architecture '%.*s' is not supported "
                             "(supported: " SUPPORTED_ARCH_NAMES ")",
                             (int)(arch_s.len > 64 ? 64 : arch_s.len), arch_s.data);
    snprintf(hp->arch, sizeof hp->arch, "%s", arch->name);
    hp->rope_type = arch->rope_type;
    hp->rope_freq_scale = 1.0f;
    hp->rope_freq_base_swa = 10000.0f;
    hp->embd_scale = 1.0f;
    hp->ffn_act = TDM_FFN_SILU;
    hp->qk_norm = arch->qk_norm;
    if (arch->gemma) {
        hp->post_norms = true;
        hp->ffn_act = TDM_FFN_GELU_TANH;
    }
    hp->fused_gate_up = arch->phi3;
    return TDM_OK;
}

/* The attention shape (<arch>.* keys): n_ctx_train, n_embd, n_layers, heads, head_dim,
 * rope_dim, norm epsilon and rope base, each checked against the others. */
static int hparams_attention(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    const char *a = hp->arch;
    int rc;
    if ((rc = get_u32_key(g, a, "context_length", true, 0, &hp->n_ctx_train, err)) ||
        (rc = get_u32_key(g, a, "embedding_length", true, 0, &hp->n_embd, err)) ||
        (rc = get_u32_key(g, a, "block_count", true, 0, &hp->n_layers, err)) ||
        (rc = get_u32_key(g, a, "attention.head_count", true, 0, &hp->n_heads, err)) ||
        (rc = get_u32_key(g, a, "attention.head_count_kv", false, hp->n_heads, &hp->n_kv_heads,
                          err)) ||
        (rc = get_f32_key(g, a, "attention.layer_norm_rms_epsilon", true, 0, &hp->rms_norm_eps,
                          err)) ||
        (rc = get_f32_key(g, a, "rope.freq_base", false, 10000.0f, &hp->rope_freq_base, err)))
        return rc;
    if (!isfinite(hp->rms_norm_eps) || !isfinite(hp->rope_freq_base))
        return tdm_error_set(err, TDM_EINVALID,
                             "%s.attention.layer_norm_rms_epsilon (%g) and %s.rope.freq_base (%g) "
                             "must be finite",
                             a, (double)hp->rms_norm_eps, a, (double)hp->rope_freq_base);
    if (hp->n_heads % hp->n_kv_heads != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "%s.attention.head_count (%" PRIu32
                             ") is not a multiple of head_count_kv (%" PRIu32 ")",
                             a, hp->n_heads, hp->n_kv_heads);
    uint32_t dflt_head_dim = hp->n_embd % hp->n_heads == 0 ? hp->n_embd / hp->n_heads : 0;
    if ((rc = get_u32_key(g, a, "attention.key_length", false, dflt_head_dim, &hp->head_dim, err)))
        return rc;
    if (hp->head_dim == 0 || hp->head_dim % 2 != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "head_dim (%s.attention.key_length, or embedding_length / "
                             "head_count = %" PRIu32 " / %" PRIu32 ") must be a positive even "
                             "integer",
                             a, hp->n_embd, hp->n_heads);
    uint32_t value_len;
    if ((rc = get_u32_key(g, a, "attention.value_length", false, hp->head_dim, &value_len, err)))
        return rc;
    if (value_len != hp->head_dim)
        return tdm_error_set(err, TDM_EINVALID,
                             "%s.attention.value_length (%" PRIu32
                             ") differs from key_length (%" PRIu32 "): not supported",
                             a, value_len, hp->head_dim);
    if ((rc = get_u32_key(g, a, "rope.dimension_count", false, hp->head_dim, &hp->rope_dim, err)))
        return rc;
    if (hp->rope_dim > hp->head_dim || hp->rope_dim % 2 != 0)
        return tdm_error_set(err, TDM_EINVALID,
                             "%s.rope.dimension_count (%" PRIu32
                             ") must be even and at most head_dim (%" PRIu32 ")",
                             a, hp->rope_dim, hp->head_dim);
    return TDM_OK;
}

/* Vocabulary size from the embedding table, which metadata must agree with. */
static int hparams_vocab(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    const char *a = hp->arch;
    int rc;
    const tdm_gguf_tensor_t *emb = tdm_gguf_find_tensor(g, "token_embd.weight");
    if (!emb)
        return tdm_error_set(err, TDM_ENOTFOUND, "tensor 'token_embd.weight' is missing");
    if (emb->ne[1] > UINT32_MAX)
        return tdm_error_set(err, TDM_EINVALID, "token_embd.weight: vocabulary too large");
    hp->n_vocab = (uint32_t)emb->ne[1];
    if ((rc = check_tensor(g, "token_embd.weight", hp->n_embd, hp->n_vocab, false, NULL, err)))
        return rc;
    char vkey[96];
    snprintf(vkey, sizeof vkey, "%s.vocab_size", a);
    uint32_t meta_vocab;
    if (tdm_gguf_get_u32(g, vkey, &meta_vocab, NULL) == TDM_OK && meta_vocab != hp->n_vocab)
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata '%s' is %" PRIu32 " but token_embd.weight has %" PRIu32
                             " rows",
                             vkey, meta_vocab, hp->n_vocab);
    const tdm_gguf_kv_t *tokens = tdm_gguf_find_kv(g, "tokenizer.ggml.tokens");
    if (tokens && tokens->type == TDM_GGUF_VTYPE_ARRAY && tokens->arr_n != hp->n_vocab)
        return tdm_error_set(err, TDM_EINVALID,
                             "tokenizer.ggml.tokens has %" PRIu64
                             " entries but token_embd.weight has %" PRIu32 " rows",
                             tokens->arr_n, hp->n_vocab);
    return TDM_OK;
}

/* The tensors of layer l: shapes and types; layer 0 decides whether q/k/v have biases. */
static int check_layer(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, uint32_t l, tdm_error_t *err)
{
    uint64_t q_dim = (uint64_t)hp->n_heads * hp->head_dim;
    uint64_t kv_dim = (uint64_t)hp->n_kv_heads * hp->head_dim;
    int rc;
    char name[96];
    bool found;
#define TDM_CHECK_LAYER(suffix, ne0, ne1, optional)                                                \
    do {                                                                                           \
        snprintf(name, sizeof name, "blk.%" PRIu32 ".%s", l, suffix);                              \
        if ((rc = check_tensor(g, name, ne0, ne1, optional, &found, err)))                         \
            return rc;                                                                             \
    } while (0)
    TDM_CHECK_LAYER("attn_norm.weight", hp->n_embd, 0, false);
    if (strcmp(hp->arch, "phi3") == 0) { /* Phi-3: fused QKV, or separate q/k/v (layer 0 says) */
        TDM_CHECK_LAYER("attn_qkv.weight", hp->n_embd, q_dim + 2 * kv_dim, true);
        if (l == 0)
            hp->fused_qkv = found;
        else if (found != hp->fused_qkv)
            return tdm_error_set(err, TDM_EINVALID,
                                 "tensor '%s' is %s but blk.0.attn_qkv.weight is %s", name,
                                 found ? "present" : "missing", found ? "missing" : "present");
    }
    if (!hp->fused_qkv) {
        TDM_CHECK_LAYER("attn_q.weight", hp->n_embd, q_dim, false);
        TDM_CHECK_LAYER("attn_k.weight", hp->n_embd, kv_dim, false);
        TDM_CHECK_LAYER("attn_v.weight", hp->n_embd, kv_dim, false);
    }
    TDM_CHECK_LAYER("attn_output.weight", q_dim, hp->n_embd, false);
    TDM_CHECK_LAYER("ffn_norm.weight", hp->n_embd, 0, false);
    if (hp->n_expert > 0) {
        if ((rc = tdm_gguf_check_moe_layer(g, hp, l, err)))
            return rc;
    } else {
        if (!hp->fused_gate_up)
            TDM_CHECK_LAYER("ffn_gate.weight", hp->n_embd, hp->n_ff, false);
        TDM_CHECK_LAYER("ffn_up.weight", hp->n_embd, (hp->fused_gate_up ? 2ull : 1ull) * hp->n_ff,
                        false);
        TDM_CHECK_LAYER("ffn_down.weight", hp->n_ff, hp->n_embd, false);
    }
    TDM_CHECK_LAYER("attn_q.bias", q_dim, 0, true);
    if (l == 0)
        hp->has_qkv_bias = found;
    else if (found != hp->has_qkv_bias)
        return tdm_error_set(err, TDM_EINVALID, "tensor '%s' is %s but blk.0.attn_q.bias is %s",
                             name, found ? "present" : "missing", found ? "missing" : "present");
    if (hp->has_qkv_bias) {
        TDM_CHECK_LAYER("attn_k.bias", kv_dim, 0, false);
        TDM_CHECK_LAYER("attn_v.bias", kv_dim, 0, false);
    }
    /* the feature norms: [head_dim] QK-norms, [n_embd] post-norms, F32 like every norm */
    const struct {
        bool on;
        const char *suffix;
        uint64_t dim;
    } norms[] = {
        {hp->qk_norm, "attn_q_norm.weight", hp->head_dim},
        {hp->qk_norm, "attn_k_norm.weight", hp->head_dim},
        {hp->post_norms, "post_attention_norm.weight", hp->n_embd},
        {hp->post_norms, "post_ffw_norm.weight", hp->n_embd},
    };
    for (size_t i = 0; i < sizeof norms / sizeof norms[0]; i++) {
        if (!norms[i].on)
            continue;
        TDM_CHECK_LAYER(norms[i].suffix, norms[i].dim, 0, false);
        if ((rc = require_f32(g, name, err)))
            return rc;
    }
#undef TDM_CHECK_LAYER
    return TDM_OK;
}

/* Linear RoPE scaling (<arch>.rope.scaling.*, read as llama.cpp's llama_model_loader does: the
 * type defaults to linear and the factor, or the older rope.scale_linear, divides positions),
 * the attention factor (multiplies RoPE's cos and sin: llama.cpp's cparams.yarn_attn_factor *=
 * hparams.rope_attn_factor, applied whatever the architecture) and the original context
 * (Phi-3 chooses its RoPE factors by it). YaRN, LongRoPE and other types are refused. */
static int hparams_rope_scaling(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    const char *a = hp->arch;
    char key[128];
    snprintf(key, sizeof key, "%s.rope.scaling.type", a);
    tdm_gguf_str_t type = {"linear", 6};
    int rc = tdm_gguf_get_str(g, key, &type, NULL);
    if (rc != TDM_OK && rc != TDM_ENOTFOUND)
        return tdm_gguf_get_str(g, key, &type, err); /* the type error, named */
    bool linear = type.len == 6 && memcmp(type.data, "linear", 6) == 0;
    bool none = type.len == 4 && memcmp(type.data, "none", 4) == 0;
    if (!linear && !none)
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata '%s' is '%.*s': Tandem implements RoPE scaling 'linear' "
                             "and 'none' only (YaRN, LongRoPE and others are refused rather than "
                             "run wrong)",
                             key, (int)(type.len > 32 ? 32 : type.len), type.data);
    float factor = 0.0f;
    if ((rc = get_f32_key(g, a, "rope.scaling.factor", false, 0.0f, &factor, err)) ||
        (factor == 0.0f &&
         (rc = get_f32_key(g, a, "rope.scale_linear", false, 0.0f, &factor, err))))
        return rc;
    if (factor != 0.0f && none && factor != 1.0f)
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata '%s' is 'none' but %s.rope.scaling.factor is %g", key, a,
                             (double)factor);
    if (!isfinite(factor))
        return tdm_error_set(err, TDM_EINVALID, "metadata '%s.rope.scaling.factor' must be finite",
                             a);
    hp->rope_freq_scale = factor == 0.0f ? 1.0f : 1.0f / factor;
    if ((rc = get_f32_key(g, a, "rope.scaling.attn_factor", false, 1.0f, &hp->rope_attn_factor,
                          err)) ||
        (rc = get_u32_key(g, a, "rope.scaling.original_context_length", false, hp->n_ctx_train,
                          &hp->n_ctx_orig, err)))
        return rc;
    if (!isfinite(hp->rope_attn_factor))
        return tdm_error_set(err, TDM_EINVALID,
                             "metadata '%s.rope.scaling.attn_factor' must be finite", a);
    return TDM_OK;
}

/* The sliding-window layers of a Gemma 3 model: <arch>.attention.sliding_window_pattern is a
 * per-layer bool array or a period P (layer l is local iff l % P < P - 1), default 6
 * (llama.cpp's load_swa_pattern and set_swa_pattern). */
static int hparams_swa_pattern(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window_pattern", hp->arch);
    const tdm_gguf_kv_t *kv = tdm_gguf_find_kv(g, key);
    if (kv && kv->type == TDM_GGUF_VTYPE_ARRAY) {
        if (kv->arr_type != TDM_GGUF_VTYPE_BOOL || kv->arr_n != hp->n_layers)
            return tdm_error_set(err, TDM_EINVALID,
                                 "metadata '%s' must be a bool per layer (%" PRIu32 ") or a period",
                                 key, hp->n_layers);
        for (uint32_t l = 0; l < hp->n_layers; l++)
            hp->swa_layers[l] = tdm_gguf_arr_int(kv, l) != 0;
        return TDM_OK;
    }
    uint32_t period = 6;
    int rc = tdm_gguf_get_u32(g, key, &period, err);
    if (rc == TDM_ENOTFOUND)
        tdm_error_clear(err);
    else if (rc != TDM_OK)
        return rc;
    for (uint32_t l = 0; l < hp->n_layers; l++)
        hp->swa_layers[l] = period == 0 || l % period < period - 1;
    return TDM_OK;
}

/* Gemma 3 (llama.cpp's src/models/gemma3.cpp): embeddings scaled by sqrt(n_embd), q scaled
 * by 1 / sqrt(key_length) (1 / sqrt(n_embd / n_heads) for the 62-layer 27B, as the reference
 * sets f_attention_scale), sliding-window layers when attention.sliding_window > 0, and the
 * optional final logit soft-capping. */
static int hparams_gemma(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    const char *a = hp->arch;
    int rc;
    hp->embd_scale = sqrtf((float)hp->n_embd);
    hp->attn_q_scale = hp->n_layers == 62 ? 1.0f / sqrtf((float)(hp->n_embd / hp->n_heads))
                                          : 1.0f / sqrtf((float)hp->head_dim);
    if ((rc = get_f32_key(g, a, "final_logit_softcapping", false, 0.0f, &hp->final_logit_softcap,
                          err)) ||
        (rc = get_f32_key(g, a, "rope.freq_base_swa", false, 10000.0f, &hp->rope_freq_base_swa,
                          err)))
        return rc;
    char key[128];
    snprintf(key, sizeof key, "%s.attention.sliding_window", a);
    rc = tdm_gguf_get_u32(g, key, &hp->n_swa, err);
    if (rc == TDM_ENOTFOUND) {
        tdm_error_clear(err);
        hp->n_swa = 0;
        return TDM_OK;
    }
    if (rc != TDM_OK || hp->n_swa == 0)
        return rc;
    if (hp->n_layers > TDM_GGUF_MAX_LAYERS)
        return tdm_error_set(err, TDM_EINVALID, "%s.block_count (%" PRIu32 ") exceeds %d", a,
                             hp->n_layers, TDM_GGUF_MAX_LAYERS);
    return hparams_swa_pattern(g, hp, err);
}

/* Llama 3.x's RoPE frequency factors (rope_freqs.weight, [rope_dim / 2] F32, one tensor for
 * every layer as llama.cpp's converter writes it): pair i's angle is divided by factor i
 * (ggml_rope_ext's freq_factors). Absent: n_rope_freq_factors stays 0. Each factor must be
 * finite and positive. */
static int hparams_rope_freqs(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    static const char name[] = "rope_freqs.weight";
    const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(g, name);
    if (!t || !arch_has_rope_freqs(hp->arch))
        return TDM_OK; /* absent, or refused as unread by tdm_gguf_refuse_unimplemented */
    int rc;
    if ((rc = check_tensor(g, name, hp->rope_dim / 2, 0, false, NULL, err)) ||
        (rc = require_f32(g, name, err)))
        return rc;
    if (hp->rope_dim / 2 > TDM_GGUF_MAX_ROPE_FREQS)
        return tdm_error_set(err, TDM_EINVALID, "tensor '%s': %" PRIu32 " factors exceed %d", name,
                             hp->rope_dim / 2, TDM_GGUF_MAX_ROPE_FREQS);
    const float *f = t->data;
    for (uint32_t i = 0; i < hp->rope_dim / 2; i++) {
        if (!isfinite(f[i]) || f[i] <= 0.0f)
            return tdm_error_set(err, TDM_EINVALID,
                                 "tensor '%s': factor %" PRIu32 " is %g (must be finite and > 0)",
                                 name, i, (double)f[i]);
        hp->rope_freq_factors[i] = f[i];
    }
    hp->n_rope_freq_factors = hp->rope_dim / 2;
    return TDM_OK;
}

/* rope_dim / 2 finite, positive F32 factors of tensor name into f. */
static int read_rope_factors(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp, const char *name,
                             float *f, tdm_error_t *err)
{
    int rc;
    if ((rc = check_tensor(g, name, hp->rope_dim / 2, 0, false, NULL, err)) ||
        (rc = require_f32(g, name, err)))
        return rc;
    if (hp->rope_dim / 2 > TDM_GGUF_MAX_ROPE_FREQS)
        return tdm_error_set(err, TDM_EINVALID, "tensor '%s': %" PRIu32 " factors exceed %d", name,
                             hp->rope_dim / 2, TDM_GGUF_MAX_ROPE_FREQS);
    const float *src = tdm_gguf_find_tensor(g, name)->data;
    for (uint32_t i = 0; i < hp->rope_dim / 2; i++) {
        if (!isfinite(src[i]) || src[i] <= 0.0f)
            return tdm_error_set(err, TDM_EINVALID,
                                 "tensor '%s': factor %" PRIu32 " is %g (must be finite and > 0)",
                                 name, i, (double)src[i]);
        f[i] = src[i];
    }
    return TDM_OK;
}

/* Phi-3 (llama.cpp's src/models/phi3.cpp and load_arch_hparams): q multiplied by
 * 1 / sqrt(head_dim) after RoPE (the scores then unscaled), the 128k models' two sets of RoPE
 * factors (rope_factors_long.weight and rope_factors_short.weight, [rope_dim / 2] F32, both or
 * neither; tdm_llama_rope_factors picks one by the context), and
 * <arch>.attention.sliding_window read and ignored, as llama.cpp disables Phi-3's window. */
static int hparams_phi3(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    hp->attn_q_scale = 1.0f / sqrtf((float)hp->head_dim);
    bool has_long = tdm_gguf_find_tensor(g, "rope_factors_long.weight") != NULL;
    bool has_short = tdm_gguf_find_tensor(g, "rope_factors_short.weight") != NULL;
    if (has_long != has_short)
        return tdm_error_set(err, TDM_EINVALID, "tensor '%s' is missing (the other set is present)",
                             has_long ? "rope_factors_short.weight" : "rope_factors_long.weight");
    int rc;
    if (has_long &&
        ((rc = read_rope_factors(g, hp, "rope_factors_long.weight", hp->rope_factors_long, err)) ||
         (rc = read_rope_factors(g, hp, "rope_factors_short.weight", hp->rope_factors_short, err))))
        return rc;
    hp->n_rope_long_short = has_long ? hp->rope_dim / 2 : 0;
    return TDM_OK;
}

int tdm_gguf_llama_hparams(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    memset(hp, 0, sizeof *hp);
    int rc;
    if ((rc = hparams_arch(g, hp, err)) || (rc = hparams_attention(g, hp, err)) ||
        (rc = hparams_vocab(g, hp, err)) || (rc = hparams_rope_scaling(g, hp, err)) ||
        (rc = hparams_rope_freqs(g, hp, err)))
        return rc;
    if (strcmp(hp->arch, "gemma3") == 0 && (rc = hparams_gemma(g, hp, err)))
        return rc;
    if (strcmp(hp->arch, "phi3") == 0 && (rc = hparams_phi3(g, hp, err)))
        return rc;
    const char *a = hp->arch;
    /* FFN size: from metadata, else from the gate projection (Phi-3: half the fused up's rows;
     * a MoE model's experts') */
    const tdm_gguf_tensor_t *gate = tdm_gguf_find_tensor(
        g, hp->fused_gate_up ? "blk.0.ffn_up.weight" : "blk.0.ffn_gate.weight");
    if (!gate)
        gate = tdm_gguf_find_tensor(g, "blk.0.ffn_gate_exps.weight");
    uint32_t dflt_ff = gate && gate->ne[1] <= UINT32_MAX ? (uint32_t)gate->ne[1] : 0;
    if (hp->fused_gate_up)
        dflt_ff /= 2;
    if ((rc = get_u32_key(g, a, "feed_forward_length", dflt_ff == 0, dflt_ff, &hp->n_ff, err)) ||
        (rc = tdm_gguf_hparams_moe(g, hp, err)))
        return rc;

    for (uint32_t l = 0; l < hp->n_layers; l++)
        if ((rc = check_layer(g, hp, l, err)))
            return rc;
    if ((rc = check_tensor(g, "output_norm.weight", hp->n_embd, 0, false, NULL, err)) ||
        (rc = require_f32(g, "output_norm.weight", err)))
        return rc;
    bool has_output;
    if ((rc = check_tensor(g, "output.weight", hp->n_embd, hp->n_vocab, true, &has_output, err)))
        return rc;
    hp->tied_embeddings = !has_output;
    return tdm_gguf_refuse_unimplemented(g, hp, err);
}
