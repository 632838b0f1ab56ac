/* hparams_refuse.c - refusing a GGUF model whose metadata or tensors ask for a computation the
 * engine does not do, rather than running it and answering slightly wrong.
 *
 * llama.cpp reads a key or tensor when its architecture's code asks for it and ignores the rest;
 * so a file converted for a feature Tandem lacks (rope_freqs.weight on Qwen, YaRN, experts,
 * Gemma 2's attention soft-capping) would load and run as the plain block. Here every
 * `<arch>.` key must be in the table below and every tensor must be one the forward pass binds.
 * The table lists the keys Tandem reads (hparams.c) and those that do not change the forward
 * pass (vocab_size, which hparams.c checks; the original context of RoPE scaling; an expert
 * count of 0 outside the architectures with experts, hparams_moe.c).
 */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "gguf/hparams_internal.h"

typedef struct known_key {
    const char *suffix; /* after "<arch>." */
    bool gemma_only;    /* read only for Gemma 3 */
    bool zero_only;     /* allowed only with the value 0 (a count of absent features), except
                           on an architecture with experts (tdm_gguf_arch_has_experts) */
    bool qwen3moe_only; /* read only for qwen3moe */
} known_key_t;

static const known_key_t known_keys[] = {
    {"context_length", false, false, false},
    {"embedding_length", false, false, false},
    {"block_count", false, false, false},
    {"feed_forward_length", false, false, false},
    {"vocab_size", false, false, false},
    {"attention.head_count", false, false, false},
    {"attention.head_count_kv", false, false, false},
    {"attention.layer_norm_rms_epsilon", false, false, false},
    {"attention.key_length", false, false, false},
    {"attention.value_length", false, false, false},
    {"rope.freq_base", false, false, false},
    {"rope.dimension_count", false, false, false},
    {"rope.scaling.type", false, false, false},
    {"rope.scaling.factor", false, false, false},
    {"rope.scale_linear", false, false, false},
    {"rope.scaling.attn_factor", false, false, false},
    {"rope.scaling.original_context_length", false, false, false},
    {"rope.scaling.finetuned", false, false, false},
    {"expert_count", false, true, false},
    {"expert_used_count", false, true, false},
    {"expert_feed_forward_length", false, false, true},
    {"attention.sliding_window", true, false, false},
    {"attention.sliding_window_pattern", true, false, false},
    {"rope.freq_base_swa", true, false, false},
    {"final_logit_softcapping", true, false, false},
};

/* What a refused key or tensor would need, for the message ("" when nothing specific). */
static const char *feature_hint(const char *name)
{
    static const struct {
        const char *part, *hint;
    } hints[] = {
        {"expert", "mixture-of-experts layers: llama or qwen3moe with expert_count > 0"},
        {"_exps", "mixture-of-experts layers: llama or qwen3moe with expert_count > 0"},
        {"ffn_gate_inp", "mixture-of-experts routing: llama or qwen3moe with expert_count > 0"},
        {"rope_freqs", "RoPE frequency factors (implemented for llama and mistral only)"},
        {"rope.scaling", "this kind of RoPE scaling"},
        {"sliding_window", "sliding-window attention (implemented for gemma3 only)"},
        {"softcapping", "logit soft-capping"},
        {"attn_qkv.bias", "a fused QKV bias"},
        {"attn_qkv", "a fused QKV projection (implemented for phi3 only)"},
        {"rope_factors_", "Phi-3's long/short RoPE factors (implemented for phi3 only)"},
        {"layer_norm_epsilon", "LayerNorm (Tandem implements RMSNorm)"},
    };
    for (size_t i = 0; i < sizeof hints / sizeof hints[0]; i++)
        if (strstr(name, hints[i].part))
            return hints[i].hint;
    return "";
}

static int refuse(tdm_error_t *err, const tdm_llama_hparams_t *hp, const char *what,
                  const char *name)
{
    const char *hint = feature_hint(name);
    return tdm_error_set(err, TDM_EINVALID,
                         "%s '%s' is not implemented by Tandem's %s forward pass%s%s%s: the model "
                         "is refused rather than run wrong (docs/models.md lists what is "
                         "supported)",
                         what, name, hp->arch, hint[0] ? " (it needs " : "", hint,
                         hint[0] ? ")" : "");
}

/* A known key's value is acceptable (zero_only keys must hold 0). */
static bool key_value_ok(const tdm_gguf_t *g, const known_key_t *k, const char *key,
                         const char *hp_arch)
{
    if (!k->zero_only || tdm_gguf_arch_has_experts(hp_arch))
        return true;
    uint64_t v = 1;
    return tdm_gguf_get_u64(g, key, &v, NULL) == TDM_OK && v == 0;
}

static int check_keys(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    bool gemma = strcmp(hp->arch, "gemma3") == 0, qwen3moe = strcmp(hp->arch, "qwen3moe") == 0;
    size_t alen = strlen(hp->arch);
    for (uint64_t i = 0; i < tdm_gguf_n_kv(g); i++) {
        const char *key = tdm_gguf_kv_at(g, i)->key;
        if (strncmp(key, hp->arch, alen) != 0 || key[alen] != '.')
            continue;
        const known_key_t *k = NULL;
        for (size_t j = 0; j < sizeof known_keys / sizeof known_keys[0] && !k; j++)
            if (strcmp(key + alen + 1, known_keys[j].suffix) == 0)
                k = &known_keys[j];
        /* Phi-3's converter writes a sliding window that llama.cpp reads and disables */
        bool phi3_swa = strcmp(hp->arch, "phi3") == 0 && k &&
                        strcmp(k->suffix, "attention.sliding_window") == 0;
        if (!k || (k->gemma_only && !gemma && !phi3_swa) || (k->qwen3moe_only && !qwen3moe) ||
            !key_value_ok(g, k, key, hp->arch))
            return refuse(err, hp, "metadata", key);
    }
    return TDM_OK;
}

/* A per-layer tensor suffix the forward pass reads for this model. */
static bool layer_suffix_used(const tdm_llama_hparams_t *hp, const char *suffix)
{
    static const char *const always[] = {
        "attn_norm.weight",
        "attn_output.weight",
        "ffn_norm.weight",
    };
    static const char *const dense[] = {"ffn_gate.weight", "ffn_up.weight", "ffn_down.weight"};
    static const char *const moe[] = {"ffn_gate_inp.weight", "ffn_gate_exps.weight",
                                      "ffn_up_exps.weight", "ffn_down_exps.weight"};
    for (size_t i = 0; i < sizeof always / sizeof always[0]; i++)
        if (strcmp(suffix, always[i]) == 0)
            return true;
    if (hp->fused_qkv
            ? strcmp(suffix, "attn_qkv.weight") == 0
            : (strcmp(suffix, "attn_q.weight") == 0 || strcmp(suffix, "attn_k.weight") == 0 ||
               strcmp(suffix, "attn_v.weight") == 0))
        return true;
    /* Phi-3's fused gate/up: ffn_up holds both halves, no ffn_gate */
    for (size_t i = hp->fused_gate_up ? 1 : 0;
         hp->n_expert == 0 && i < sizeof dense / sizeof dense[0]; i++)
        if (strcmp(suffix, dense[i]) == 0)
            return true;
    for (size_t i = 0; hp->n_expert > 0 && i < sizeof moe / sizeof moe[0]; i++)
        if (strcmp(suffix, moe[i]) == 0)
            return true;
    if (hp->has_qkv_bias &&
        (strcmp(suffix, "attn_q.bias") == 0 || strcmp(suffix, "attn_k.bias") == 0 ||
         strcmp(suffix, "attn_v.bias") == 0))
        return true;
    if (hp->qk_norm &&
        (strcmp(suffix, "attn_q_norm.weight") == 0 || strcmp(suffix, "attn_k_norm.weight") == 0))
        return true;
    return hp->post_norms && (strcmp(suffix, "post_attention_norm.weight") == 0 ||
                              strcmp(suffix, "post_ffw_norm.weight") == 0);
}

static bool tensor_used(const tdm_llama_hparams_t *hp, const char *name)
{
    if (strcmp(name, "token_embd.weight") == 0 || strcmp(name, "output_norm.weight") == 0 ||
        (!hp->tied_embeddings && strcmp(name, "output.weight") == 0) ||
        (hp->n_rope_freq_factors > 0 && strcmp(name, "rope_freqs.weight") == 0) ||
        (hp->n_rope_long_short > 0 && (strcmp(name, "rope_factors_long.weight") == 0 ||
                                       strcmp(name, "rope_factors_short.weight") == 0)))
        return true;
    unsigned layer;
    int used = 0;
    if (sscanf(name, "blk.%u.%n", &layer, &used) != 1 || used == 0 || layer >= hp->n_layers)
        return false;
    char canon[32];
    snprintf(canon, sizeof canon, "blk.%u.", layer);
    if (strncmp(name, canon, strlen(canon)) != 0) /* "blk.01." or "blk.+1.": not ours */
        return false;
    return layer_suffix_used(hp, name + used);
}

int tdm_gguf_refuse_unimplemented(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp,
                                  tdm_error_t *err)
{
    int rc = check_keys(g, hp, err);
    if (rc != TDM_OK)
        return rc;
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const char *name = tdm_gguf_tensor_at(g, i)->name;
        if (!tensor_used(hp, name))
            return refuse(err, hp, "tensor", name);
    }
    return TDM_OK;
}
