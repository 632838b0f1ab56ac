/* cmd_model.h - what `tandem model`'s files share: the architecture shapes synth knows, the
 * weight generator (cmd_model_synth.c) and the tokenizer copy (cmd_model_vocab.c). */
#ifndef TANDEM_CLIENT_CMD_MODEL_H
#define TANDEM_CLIENT_CMD_MODEL_H

#include <stdbool.h>
#include <stdint.h>

#include "tandem/gguf.h"

/* A published architecture's shape, from its Hugging Face config.json (or, for the "-tiny"
 * shapes, a miniature of one for tests). */
typedef struct tdm_synth_shape {
    const char *name;       /* "llama-3.2-1b" */
    const char *arch;       /* general.architecture: "llama", "qwen3", "qwen3moe", "gemma3" or
                               "phi3" */
    uint32_t n_vocab;       /* tokens (vocab_size) */
    uint32_t n_ctx;         /* max_position_embeddings */
    uint32_t n_embd;        /* hidden_size */
    uint32_t n_ff;          /* intermediate_size */
    uint32_t n_layers;      /* num_hidden_layers */
    uint32_t n_heads;       /* num_attention_heads */
    uint32_t n_kv_heads;    /* num_key_value_heads */
    uint32_t head_dim;      /* hidden_size / num_attention_heads */
    float rope_theta;       /* rope_theta */
    bool tied;              /* tie_word_embeddings: no output.weight */
    uint32_t n_swa;         /* sliding_window of the local layers (gemma3); 0: none */
    bool llama3_rope;       /* rope_scaling {"rope_type": "llama3", factor 8, low_freq_factor 1,
                               high_freq_factor 4, original_max_position_embeddings 8192}: a
                               rope_freqs.weight tensor, as llama.cpp's converter writes it */
    uint32_t n_ctx_orig;    /* phi3: rope_scaling's original_max_position_embeddings; with a
                               longer n_ctx, LongRoPE's long and short factors and attention
                               factor as the converter writes them; 0: none */
    uint32_t n_expert;      /* num_experts / num_local_experts; 0: a dense FFN */
    uint32_t n_expert_used; /* num_experts_per_tok */
    uint32_t n_ff_exp;      /* moe_intermediate_size (qwen3moe); Mixtral's experts use n_ff */
} tdm_synth_shape_t;

/* The shape called name; NULL when synth does not know it. Cannot fail. */
const tdm_synth_shape_t *tdm_synth_shape_find(const char *name);

/* The known shapes' names, "a|b|c", for messages. Cannot fail. */
const char *tdm_synth_shape_names(void);

/* The miniature shape of the architecture family called arch ("llama3", "qwen3", "qwen3moe",
 * "mixtral", "gemma3": its "-tiny" shape), NULL when synth does not know it. Cannot fail. */
const tdm_synth_shape_t *tdm_synth_arch_find(const char *arch);

/* The known --arch names, "a|b|c", for messages. Cannot fail. */
const char *tdm_synth_arch_names(void);

/* Adds the model's metadata (general.*, <arch>.*) and every weight tensor of shape s (n_vocab
 * rows in the embedding) to w: projections of type type, token_embd (and output) Q8_0 for the
 * quantized types, F16 for F16, norms F32 (QK-norms for qwen3 and gemma3, post-norms for gemma3;
 * rope_freqs.weight F32 for the Llama 3 shapes; with experts, per layer an F32 router
 * ffn_gate_inp [n_embd, n_expert] and 3-D ffn_{gate,up,down}_exps of type type, as llama.cpp's
 * converter names and shapes them).
 * Values are uniform random from seed, scaled so the residual stream's RMS stays near 1 through
 * every layer (cmd_model_synth.c says how). Deterministic: the same arguments give the same bytes
 * whatever the thread count. Errors: TDM_ERESOURCE (message in err), TDM_EINVALID (a type the
 * shape's dims do not fit). */
int tdm_synth_add_weights(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s, uint32_t n_vocab,
                          tdm_ggml_type_t type, uint64_t seed, tdm_error_t *err);

/* Copies every tokenizer.* key of g into w, the token arrays padded to n_vocab entries (when
 * n_vocab is larger than g's vocabulary) with unused tokens "<|synth_pad_N|>" (token type 5,
 * score 0). *n_tokens gets g's vocabulary size. Errors: TDM_ENOTFOUND/TDM_EINVALID (no or a
 * malformed tokenizer.ggml.tokens), TDM_ERESOURCE; message in err. */
int tdm_synth_copy_vocab(tdm_gguf_writer_t *w, const tdm_gguf_t *g, uint32_t n_vocab,
                         uint32_t *n_tokens, tdm_error_t *err);

/* Copies one metadata key of a GGUF into w, keeping its type where the writer has a setter
 * (other integer types widen to u32/i32, 64-bit floats narrow to f32). Returns TDM_OK or
 * TDM_ERESOURCE. */
int tdm_model_copy_kv(tdm_gguf_writer_t *w, const tdm_gguf_kv_t *kv);

/* `tandem model cut`: argv[0] is the command's name (cmd_model_cut.c). */
int tdm_cmd_model_cut(int argc, char **argv);

/* Vocabulary size of g (entries of tokenizer.ggml.tokens), 0 when it has none. */
uint32_t tdm_synth_vocab_size(const tdm_gguf_t *g);

#endif
