/* tiny_model.h - writes tiny random-weight Llama models in GGUF, laid out and described the way
 * llama.cpp's convert_hf_to_gguf.py writes a SmolLM2-style Llama (GPT-2 byte-level BPE
 * vocabulary, ChatML template), for tests that need a real model file without a download.
 *
 * Vocabulary (n_vocab tokens): ids 0..255 are the 256 byte tokens in GPT-2's order (the order
 * of bytes_to_unicode's list: printable bytes 33..126, 161..172, 174..255, then the other 68
 * bytes ascending; so "!" is 0 and "Ġ" (the space byte) is 220, as in GPT-2); then
 * n_vocab - 259 merged tokens, one per entry of tokenizer.ggml.merges and in the same order
 * (a fixed list of common English merges such as "Ġ t", "h e", "Ġt he", then generated ones
 * over lowercase letters); then the special tokens "<|endoftext|>" (n_vocab - 3),
 * "<|im_start|>" (n_vocab - 2, also BOS) and "<|im_end|>" (n_vocab - 1, also EOS).
 */
#ifndef TANDEM_TEST_TINY_MODEL_H
#define TANDEM_TEST_TINY_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/gguf.h"

/* Number of byte tokens, and the fewest tokens a tiny vocabulary can have (bytes + specials). */
#define TDM_TINY_N_BYTE_TOKENS 256
#define TDM_TINY_MIN_VOCAB 259

/* What to build. A zero field takes the default given in its comment, so
 * `(tdm_tiny_llama_spec_t){.n_layers = 1}` is a complete spec. */
typedef struct tdm_tiny_llama_spec {
    const char *name;            /* general.name; NULL: "tiny-llama" */
    uint32_t n_vocab;            /* tokens, >= TDM_TINY_MIN_VOCAB and at most ~36000; 0: 512 */
    uint32_t n_embd;             /* d_model; 0: 64 */
    uint32_t n_layers;           /* 0: 2 */
    uint32_t n_heads;            /* must divide n_embd; 0: 4 (head_dim = n_embd / n_heads) */
    uint32_t n_kv_heads;         /* must divide n_heads; 0: n_heads / 2 (or 1) */
    uint32_t n_ff;               /* FFN hidden size; 0: 2 * n_embd */
    uint32_t n_ctx;              /* llama.context_length; 0: 256 */
    tdm_ggml_type_t weight_type; /* attn_q/k/v/output and ffn_gate/up/down; 0 is F32. Every
                                    such tensor's ne[0] (n_embd, n_heads * head_dim or n_ff)
                                    must be a multiple of the type's block size */
    tdm_ggml_type_t embd_type;   /* token_embd.weight and output.weight; 0 is F32 */
    bool tied_embeddings;        /* no output.weight (the output matrix is token_embd) */
    uint64_t seed;               /* splitmix64 seed for the weights (any value, 0 included) */
    float rope_freq_base;        /* llama.rope.freq_base; 0: 10000 */
    float rms_norm_eps;          /* llama.attention.layer_norm_rms_epsilon; 0: 1e-5 */
    float weight_std;            /* standard deviation of the projection and embedding
                                    weights; norms are 1 + N(0, std); 0: 0.02 */
    uint32_t n_expert;           /* > 0: a Mixtral-style llama with experts (llama.expert_count;
                                    ffn_gate_inp F32 and 3-D ffn_*_exps of weight_type, each
                                    expert of hidden size n_ff); 0: the dense FFN */
    uint32_t n_expert_used;      /* llama.expert_used_count with experts; 0: 2 (or n_expert) */
} tdm_tiny_llama_spec_t;

/* Builds the model into a new writer (*out; caller frees with tdm_gguf_writer_destroy), so a
 * test can overwrite metadata or add tensors before serialising. spec NULL means all defaults.
 * Errors: TDM_EINVALID (inconsistent spec: the message says which field), TDM_ERESOURCE. */
int tdm_test_tiny_llama_build(const tdm_tiny_llama_spec_t *spec, tdm_gguf_writer_t **out,
                              tdm_error_t *err);

/* Writes the model to path. Same output for the same spec (byte for byte). Errors as
 * tdm_test_tiny_llama_build, and TDM_EUNAVAILABLE when the file cannot be written. */
int tdm_test_write_tiny_llama(const char *path, const tdm_tiny_llama_spec_t *spec,
                              tdm_error_t *err);

/* Makes gemma3-tiny (6 layers, one full-attention, sliding window 32; Q8_0) with `tandem model
 * synth` over the tiny llama's vocabulary, in a new directory made from dir_template (mkdtemp,
 * ending in XXXXXX; rewritten in place), as dir_template/gemma3tiny.gguf written to path[cap].
 * cli: the tandem binary. TDM_OK, or TDM_EUNAVAILABLE naming the step that failed. */
int tdm_test_synth_gemma3_tiny(const char *cli, char *dir_template, char *path, size_t cap,
                               tdm_error_t *err);

/* Serialises the model to a heap buffer (*data, *size bytes; caller frees *data with free()).
 * Errors as tdm_test_tiny_llama_build (without the message). */
int tdm_test_tiny_llama_to_memory(const tdm_tiny_llama_spec_t *spec, void **data, size_t *size);

/* GPT-2's bytes_to_unicode: writes the UTF-8 text (1 or 2 bytes and a NUL) of the character
 * that stands for byte b in byte-level BPE tokens ("Ġ" for ' ', "Ċ" for '\n', "a" for 'a')
 * into out and returns its length. Cannot fail. */
size_t tdm_test_gpt2_byte_char(uint8_t b, char out[3]);

/* Token id of byte b's token in the tiny vocabulary (its rank in GPT-2's byte order). */
uint32_t tdm_test_tiny_byte_token(uint8_t b);

#endif /* TANDEM_TEST_TINY_MODEL_H */
