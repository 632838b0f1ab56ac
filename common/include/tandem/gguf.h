/* gguf.h - GGUF v2/v3 model files: a bounds-checked reader over mmap, tensor types and their
 * dequantization, Llama-family hyperparameters, and a writer (used by tests and tools).
 *
 * Format source: the GGUF specification (ggml/docs/gguf.md in the ggml repository) and ggml's
 * block layouts (ggml/src/ggml-common.h). All multi-byte values are little-endian; this code
 * assumes a little-endian host. Every count, length and offset read from a file is checked
 * against the file size (with overflow checks) before use: a truncated or corrupted file gives
 * TDM_EINVALID with a message naming what is wrong, never a crash.
 */
#ifndef TANDEM_GGUF_H
#define TANDEM_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- tensor types (numbering is ggml's enum ggml_type) ---- */

typedef enum tdm_ggml_type {
    TDM_GGML_TYPE_F32 = 0,
    TDM_GGML_TYPE_F16 = 1,
    TDM_GGML_TYPE_Q4_0 = 2,
    TDM_GGML_TYPE_Q4_1 = 3,
    TDM_GGML_TYPE_Q5_0 = 6,
    TDM_GGML_TYPE_Q5_1 = 7,
    TDM_GGML_TYPE_Q8_0 = 8,
    TDM_GGML_TYPE_Q8_1 = 9,
    TDM_GGML_TYPE_Q2_K = 10,
    TDM_GGML_TYPE_Q3_K = 11,
    TDM_GGML_TYPE_Q4_K = 12,
    TDM_GGML_TYPE_Q5_K = 13,
    TDM_GGML_TYPE_Q6_K = 14,
    TDM_GGML_TYPE_Q8_K = 15,
    TDM_GGML_TYPE_BF16 = 30,
    TDM_GGML_TYPE_COUNT = 40, /* upper bound of the numbering, not a type */
} tdm_ggml_type_t;

/* Block geometry of one tensor type. */
typedef struct tdm_ggml_type_info {
    const char *name;    /* "Q4_1" */
    uint32_t block_size; /* elements per block (1 for F32/F16/BF16, 32 for Q*_0/1, 256 for K) */
    uint32_t type_size;  /* bytes per block */
    bool supported;      /* dequantization (and so the engine) handles it */
} tdm_ggml_type_info_t;

/* Geometry of a type; NULL for a number that is not a known ggml type. Cannot fail. */
const tdm_ggml_type_info_t *tdm_ggml_type_get(uint32_t type);

/* Bytes of a row of n elements of the given type: n / block_size * type_size. Returns 0 when
 * the type is unknown or n is not a multiple of the block size. */
size_t tdm_ggml_row_size(tdm_ggml_type_t type, uint64_t n);

/* Dequantizes one row: n elements (a multiple of the type's block size) from src (in ggml's
 * block layout, any alignment) to dst[n] f32. Errors: TDM_EINVALID for an unsupported type or
 * a bad n. Source of the layouts and formulas: ggml-common.h / ggml-quants.c
 * (dequantize_row_*). */
int tdm_ggml_dequantize_row(tdm_ggml_type_t type, const void *src, float *dst, int64_t n);

/* Quantizes one row of n f32 values into dst (tdm_ggml_row_size(type, n) bytes) with plain
 * round-to-nearest per block (ggml's *_ref quantizers; no importance matrix). Used by the
 * writer to make test models and by tests. Errors: TDM_EINVALID as above. */
int tdm_ggml_quantize_row(tdm_ggml_type_t type, const float *src, void *dst, int64_t n);

/* IEEE half and bfloat16 conversions (round-to-nearest-even on the way down). */
float tdm_fp16_to_fp32(uint16_t h);
uint16_t tdm_fp32_to_fp16(float f);
float tdm_bf16_to_fp32(uint16_t h);
uint16_t tdm_fp32_to_bf16(float f);

/* ---- metadata ---- */

typedef enum tdm_gguf_vtype {
    TDM_GGUF_VTYPE_UINT8 = 0,
    TDM_GGUF_VTYPE_INT8 = 1,
    TDM_GGUF_VTYPE_UINT16 = 2,
    TDM_GGUF_VTYPE_INT16 = 3,
    TDM_GGUF_VTYPE_UINT32 = 4,
    TDM_GGUF_VTYPE_INT32 = 5,
    TDM_GGUF_VTYPE_FLOAT32 = 6,
    TDM_GGUF_VTYPE_BOOL = 7,
    TDM_GGUF_VTYPE_STRING = 8,
    TDM_GGUF_VTYPE_ARRAY = 9,
    TDM_GGUF_VTYPE_UINT64 = 10,
    TDM_GGUF_VTYPE_INT64 = 11,
    TDM_GGUF_VTYPE_FLOAT64 = 12,
    TDM_GGUF_VTYPE_COUNT = 13,
} tdm_gguf_vtype_t;

/* Name of a metadata value type ("uint32", "array"); "?" when unknown. */
const char *tdm_gguf_vtype_name(tdm_gguf_vtype_t t);

/* A string inside the file: NOT NUL-terminated, points into the mapping (valid while the
 * tdm_gguf_t lives). */
typedef struct tdm_gguf_str {
    const char *data;
    uint64_t len; /* bytes */
} tdm_gguf_str_t;

/* One metadata key/value pair. Points into the mapping; valid while the tdm_gguf_t lives. */
typedef struct tdm_gguf_kv {
    char *key; /* NUL-terminated copy of the key */
    tdm_gguf_vtype_t type;
    union {
        uint64_t u64;       /* UINT8/16/32/64 and BOOL (0/1) */
        int64_t i64;        /* INT8/16/32/64 */
        double f64;         /* FLOAT32/64 */
        tdm_gguf_str_t str; /* STRING */
    } value;
    /* ARRAY only: element type, count, and elements. Numeric elements are packed
     * little-endian at arr_data (possibly unaligned: read them with the accessors below);
     * string elements are indexed in arr_strs[arr_n]. Nested arrays are rejected. */
    tdm_gguf_vtype_t arr_type;
    uint64_t arr_n;
    const void *arr_data;
    tdm_gguf_str_t *arr_strs;
} tdm_gguf_kv_t;

/* Element i (< kv->arr_n) of a numeric array, converted: integers to int64 (u64 values above
 * INT64_MAX saturate), floats and bools to double. */
int64_t tdm_gguf_arr_int(const tdm_gguf_kv_t *kv, uint64_t i);
double tdm_gguf_arr_float(const tdm_gguf_kv_t *kv, uint64_t i);

/* ---- tensors ---- */

#define TDM_GGUF_MAX_DIMS 4

typedef struct tdm_gguf_tensor {
    char *name;                     /* NUL-terminated copy */
    uint32_t n_dims;                /* 1..4 */
    uint64_t ne[TDM_GGUF_MAX_DIMS]; /* elements per dim; ne[0] is the contiguous (row) dim;
                                       unused dims are 1 */
    tdm_ggml_type_t type;
    uint64_t n_elements; /* product of ne */
    uint64_t offset;     /* from the start of the data section */
    size_t n_bytes;      /* n_elements / block_size * type_size */
    const void *data;    /* into the mapping; NULL when the file has no data
                            section for it (vocabulary-only files have no tensors) */
} tdm_gguf_tensor_t;

/* ---- reader ---- */

typedef struct tdm_gguf tdm_gguf_t;

/* Opens and validates a GGUF file (v2 or v3) by mmap: header, every metadata value (strings
 * are bounds-checked, arrays of strings indexed), the tensor table (names unique, dims and
 * types valid, offsets aligned to general.alignment, data inside the file, sizes without
 * overflow). Returns NULL on failure with *err set: TDM_ENOTFOUND (no file),
 * TDM_EUNAVAILABLE (I/O), TDM_EINVALID (malformed: the message names the field and offset),
 * TDM_ERESOURCE (out of memory). Caller frees with tdm_gguf_destroy. */
tdm_gguf_t *tdm_gguf_open(const char *path, tdm_error_t *err);

/* Same, over a caller-owned buffer that must outlive the returned object (fuzzing, tests). */
tdm_gguf_t *tdm_gguf_open_memory(const void *data, size_t size, tdm_error_t *err);

/* Unmaps and frees; accepts NULL and a NULL *self_p; sets *self_p to NULL. */
void tdm_gguf_destroy(tdm_gguf_t **self_p);

/* Tells the kernel that [p, p + len), inside g's data, will not be read for a while: on a
 * file opened with tdm_gguf_open the whole pages of the range leave the process's memory
 * (madvise MADV_DONTNEED on the read-only private file mapping: a later read faults them in
 * again from the file, same bytes). Returns the bytes released, 0 for a buffer from
 * tdm_gguf_open_memory (nothing is done), a range outside the file or a failed madvise.
 * For weights a backend keeps its own copy of. */
uint64_t tdm_gguf_release(const tdm_gguf_t *g, const void *p, size_t len);

uint32_t tdm_gguf_version(const tdm_gguf_t *g);
size_t tdm_gguf_file_size(const tdm_gguf_t *g);
uint32_t tdm_gguf_alignment(const tdm_gguf_t *g);   /* general.alignment, default 32 */
uint64_t tdm_gguf_data_offset(const tdm_gguf_t *g); /* start of the tensor data section */

uint64_t tdm_gguf_n_kv(const tdm_gguf_t *g);
const tdm_gguf_kv_t *tdm_gguf_kv_at(const tdm_gguf_t *g, uint64_t i); /* NULL if out of range */
const tdm_gguf_kv_t *tdm_gguf_find_kv(const tdm_gguf_t *g, const char *key); /* NULL if absent */

uint64_t tdm_gguf_n_tensors(const tdm_gguf_t *g);
const tdm_gguf_tensor_t *tdm_gguf_tensor_at(const tdm_gguf_t *g, uint64_t i);
const tdm_gguf_tensor_t *tdm_gguf_find_tensor(const tdm_gguf_t *g, const char *name);
uint64_t tdm_gguf_tensor_bytes(const tdm_gguf_t *g); /* sum of all tensors' n_bytes */

/* Typed getters. Each returns TDM_OK and stores the value, TDM_ENOTFOUND when the key is
 * absent, or TDM_EINVALID when it has an incompatible type or the value does not fit (the
 * message names the key, its type and the expected one). Integer getters accept any integer
 * type whose value fits; get_f32 accepts floats and integers. */
int tdm_gguf_get_u32(const tdm_gguf_t *g, const char *key, uint32_t *out, tdm_error_t *err);
int tdm_gguf_get_u64(const tdm_gguf_t *g, const char *key, uint64_t *out, tdm_error_t *err);
int tdm_gguf_get_i64(const tdm_gguf_t *g, const char *key, int64_t *out, tdm_error_t *err);
int tdm_gguf_get_f32(const tdm_gguf_t *g, const char *key, float *out, tdm_error_t *err);
int tdm_gguf_get_bool(const tdm_gguf_t *g, const char *key, bool *out, tdm_error_t *err);
/* *out points into the mapping and is not NUL-terminated. */
int tdm_gguf_get_str(const tdm_gguf_t *g, const char *key, tdm_gguf_str_t *out, tdm_error_t *err);
/* An array of the given element type (any for TDM_GGUF_VTYPE_COUNT). */
int tdm_gguf_get_arr(const tdm_gguf_t *g, const char *key, tdm_gguf_vtype_t elem_type,
                     const tdm_gguf_kv_t **out, tdm_error_t *err);

/* Formats a metadata value for display into buf (cap bytes): scalars as text, strings quoted
 * and cut at ~60 bytes, arrays as "[type x N] first, elements, …". Returns buf. */
char *tdm_gguf_kv_format(const tdm_gguf_kv_t *kv, char *buf, size_t cap);

/* ---- Llama-family hyperparameters ---- */

typedef enum tdm_rope_type {
    TDM_ROPE_NORMAL = 0, /* rotate pairs (x[2i], x[2i+1]): llama arch in GGUF (llama.cpp
                            LLAMA_ROPE_TYPE_NORM; GGUF converters permute Q/K to it) */
    TDM_ROPE_NEOX = 2,   /* rotate pairs (x[i], x[i + d/2]): qwen2 and others */
} tdm_rope_type_t;

/* Most layers a model may have (llama.cpp's LLAMA_MAX_LAYERS). */
#define TDM_GGUF_MAX_LAYERS 512
/* Most RoPE frequency factors a model may carry (rope_dim / 2: head_dim 256). */
#define TDM_GGUF_MAX_ROPE_FREQS 128
/* Most experts a mixture-of-experts layer may have (llama.cpp's LLAMA_MAX_EXPERTS). */
#define TDM_GGUF_MAX_EXPERTS 512

typedef enum tdm_ffn_act {
    TDM_FFN_SILU = 0,      /* SwiGLU: silu(gate) * up (Shazeer 2020) */
    TDM_FFN_GELU_TANH = 1, /* GeGLU with the tanh approximation of GELU (Hendrycks & Gimpel
                              2016): gelu(gate) * up */
} tdm_ffn_act_t;

typedef struct tdm_llama_hparams {
    char arch[32];        /* general.architecture: "llama", "qwen2", "mistral" … */
    uint32_t n_vocab;     /* token_embd.weight ne[1] (= tokenizer vocab size) */
    uint32_t n_ctx_train; /* <arch>.context_length */
    uint32_t n_embd;      /* <arch>.embedding_length (d_model) */
    uint32_t n_layers;    /* <arch>.block_count */
    uint32_t n_heads;     /* <arch>.attention.head_count */
    uint32_t n_kv_heads;  /* <arch>.attention.head_count_kv; = n_heads when absent (no GQA) */
    uint32_t head_dim;    /* <arch>.attention.key_length, or n_embd / n_heads */
    uint32_t n_ff;        /* <arch>.feed_forward_length (FFN hidden size) */
    float rms_norm_eps;   /* <arch>.attention.layer_norm_rms_epsilon */
    float rope_freq_base; /* <arch>.rope.freq_base (theta), default 10000 */
    uint32_t rope_dim;    /* <arch>.rope.dimension_count, default head_dim */
    tdm_rope_type_t rope_type;
    bool tied_embeddings; /* no output.weight: the output matrix is token_embd.weight */
    bool has_qkv_bias;    /* blk.0.attn_q.bias present (Qwen2-style) */
    /* What sets the architectures apart (llama.cpp's src/models/<arch>.cpp): the plain Llama
     * block has rope_freq_scale 1, n_swa 0, attn_q_scale 0, final_logit_softcap 0,
     * embd_scale 1, no RoPE frequency factors, no QK-norm, no post-norms and SwiGLU. */
    float rope_freq_scale;        /* 1 / <arch>.rope.scaling.factor (linear RoPE scaling: positions
                                     are multiplied by it), 1 when absent */
    uint32_t n_rope_freq_factors; /* rope_dim / 2 when the file has rope_freqs.weight (Llama
                                     3.x), else 0 */
    float rope_freq_factors[TDM_GGUF_MAX_ROPE_FREQS]; /* [n_rope_freq_factors]: pair i's angle
                                     is divided by factor i (ggml_rope_ext's freq_factors) */
    float rope_freq_base_swa; /* <arch>.rope.freq_base_swa: theta of sliding-window layers
                                 (which take no RoPE scaling), default 10000 */
    uint32_t n_swa;           /* <arch>.attention.sliding_window: in a sliding-window layer a
                                 query at position p sees keys at p - n_swa + 1 .. p; 0 = none */
    uint8_t swa_layers[TDM_GGUF_MAX_LAYERS]; /* [n_layers] 1 = sliding-window layer */
    float attn_q_scale;        /* > 0: q is multiplied by this after RoPE and attention scales
                                  the scores by 1 (Gemma 3: 1 / sqrt(key_length)); 0: the scores
                                  are scaled by 1 / sqrt(head_dim) */
    float final_logit_softcap; /* <arch>.final_logit_softcapping: logits = c * tanh(logits / c);
                                  0 = none */
    float embd_scale;          /* token embeddings are multiplied by this (Gemma: sqrt(n_embd)),
                                  1 = none */
    bool qk_norm;              /* blk.N.attn_q_norm / attn_k_norm ([head_dim]): RMSNorm of each
                                  head of q and k before RoPE */
    bool post_norms;           /* blk.N.post_attention_norm / post_ffw_norm: RMSNorm of each
                                  sub-layer's output before its residual add (Gemma 2/3) */
    tdm_ffn_act_t ffn_act;     /* the gated FFN's activation */
    /* Phi-3 (llama.cpp's src/models/phi3.cpp) */
    bool fused_qkv;         /* blk.N.attn_qkv.weight ([n_embd, (n_heads + 2 n_kv_heads) head_dim]:
                               the rows of q, then k, then v) instead of attn_q/k/v */
    bool fused_gate_up;     /* blk.N.ffn_up.weight holds [n_embd, 2 n_ff]: the gate's rows, then
                               the up projection's; no ffn_gate */
    float rope_attn_factor; /* <arch>.rope.scaling.attn_factor: RoPE's cos and sin are multiplied
                               by it (ggml_rope_ext's attn_factor, so the scores by its square);
                               1 when absent */
    uint32_t n_ctx_orig;    /* <arch>.rope.scaling.original_context_length, default n_ctx_train */
    uint32_t n_rope_long_short; /* rope_dim / 2 when the file has rope_factors_long.weight and
                                   rope_factors_short.weight (Phi-3 128k), else 0 */
    float rope_factors_long[TDM_GGUF_MAX_ROPE_FREQS];  /* [n_rope_long_short] */
    float rope_factors_short[TDM_GGUF_MAX_ROPE_FREQS]; /* [n_rope_long_short] */
    /* Mixture of experts (qwen3moe; llama files with experts, as Mixtral's): 0 experts = the
     * dense FFN. With experts every layer's FFN is llama.cpp's build_moe_ffn (softmax gating,
     * top n_expert_used, weights renormalised; docs/models.md). */
    uint32_t n_expert;      /* <arch>.expert_count: experts per layer, 0..TDM_GGUF_MAX_EXPERTS */
    uint32_t n_expert_used; /* <arch>.expert_used_count: experts per token, 1..n_expert */
    uint32_t n_ff_exp;      /* an expert's FFN hidden size: <arch>.expert_feed_forward_length
                               (qwen3moe; default n_ff / n_expert_used as llama.cpp), n_ff for
                               llama */
} tdm_llama_hparams_t;

/* The RoPE frequency factors an engine with a context of n_ctx tokens per sequence applies
 * ([rope_dim / 2], pair i's angle divided by factor i), or NULL for none: rope_freqs.weight's
 * when the model has it; else, with Phi-3's two sets, rope_factors_long when n_ctx exceeds
 * n_ctx_orig and rope_factors_short otherwise (llama.cpp's llama_model::get_rope_factors with
 * n_ctx_seq = n_ctx). Cannot fail. */
const float *tdm_llama_rope_factors(const tdm_llama_hparams_t *hp, uint32_t n_ctx);

/* RoPE of layer l: theta base and position scale (sliding-window layers take
 * rope_freq_base_swa and no scaling). Cannot fail. */
void tdm_llama_layer_rope(const tdm_llama_hparams_t *hp, uint32_t l, float *freq_base,
                          float *freq_scale);

/* The first key position (tokens) a query at position pos attends to in layer l: 0 in a
 * full-attention layer, max(0, pos + 1 - n_swa) in a sliding-window one, so the query sees
 * keys first .. pos (llama.cpp's is_masked_swa, LLAMA_SWA_TYPE_STANDARD: a key at p0 is masked
 * for a query at p1 when p1 - p0 >= n_swa). Cannot fail. */
uint32_t tdm_llama_layer_first_key(const tdm_llama_hparams_t *hp, uint32_t l, uint32_t pos);

/* Keys a query of layer l reads back (its window, tokens): n_swa in a sliding-window layer,
 * 0 (every key) otherwise; the per-layer windows tdm_kv_groups_init takes. Cannot fail. */
uint32_t tdm_llama_layer_window(const tdm_llama_hparams_t *hp, uint32_t l);

/* Reads and validates the hyperparameters of a Llama-family model (architectures llama,
 * mistral, qwen2, qwen3, qwen3moe, gemma3, phi3; experts for llama and qwen3moe). Checks every
 * required key is present and consistent (n_heads divisible by n_kv_heads, head_dim * n_heads
 * matches the Q projection, every per-layer tensor present with the expected shape). Refuses
 * what Tandem does not implement rather than run a model wrong: a metadata key of the
 * architecture that changes the forward pass and is not implemented (RoPE scaling other than
 * linear, sliding windows outside Gemma 3, logit soft-capping of attention, experts outside
 * llama and qwen3moe, ...; any `<arch>.` key Tandem does not know) and any tensor the forward
 * pass would not read (expert tensors in a dense model, rope_freqs.weight outside
 * llama/mistral, ...). A model with experts needs expert_used_count in 1..expert_count and
 * every layer's ffn_gate_inp and ffn_{gate,up,down}_exps with their shapes. Errors:
 * TDM_EINVALID (or TDM_ENOTFOUND for a missing key/tensor) naming the key or tensor and the
 * expected value. */
int tdm_gguf_llama_hparams(const tdm_gguf_t *g, tdm_llama_hparams_t *hp, tdm_error_t *err);

/* ---- writer ---- */

typedef struct tdm_gguf_writer tdm_gguf_writer_t;

/* A writer that accumulates metadata and tensors in memory and writes a GGUF v3 file.
 * Returns NULL on out of memory. Caller frees with tdm_gguf_writer_destroy. */
tdm_gguf_writer_t *tdm_gguf_writer_new(void);
void tdm_gguf_writer_destroy(tdm_gguf_writer_t **self_p);

/* Metadata setters: each copies key and value; a key set twice keeps the last value.
 * Return TDM_OK or TDM_ERESOURCE (out of memory). */
int tdm_gguf_writer_set_u32(tdm_gguf_writer_t *w, const char *key, uint32_t v);
int tdm_gguf_writer_set_i32(tdm_gguf_writer_t *w, const char *key, int32_t v);
int tdm_gguf_writer_set_u64(tdm_gguf_writer_t *w, const char *key, uint64_t v);
int tdm_gguf_writer_set_f32(tdm_gguf_writer_t *w, const char *key, float v);
int tdm_gguf_writer_set_bool(tdm_gguf_writer_t *w, const char *key, bool v);
int tdm_gguf_writer_set_str(tdm_gguf_writer_t *w, const char *key, const char *v);
int tdm_gguf_writer_set_arr_str(tdm_gguf_writer_t *w, const char *key, const char *const *v,
                                size_t n);
int tdm_gguf_writer_set_arr_f32(tdm_gguf_writer_t *w, const char *key, const float *v, size_t n);
int tdm_gguf_writer_set_arr_i32(tdm_gguf_writer_t *w, const char *key, const int32_t *v, size_t n);

/* Adds a tensor; copies name and data (tdm_ggml_row_size(type, ne[0]) * rows bytes, already
 * in the type's block layout). ne[0] must be a multiple of the type's block size.
 * Errors: TDM_EINVALID (bad dims/type/duplicate name), TDM_ERESOURCE. */
int tdm_gguf_writer_add_tensor(tdm_gguf_writer_t *w, const char *name, tdm_ggml_type_t type,
                               uint32_t n_dims, const uint64_t *ne, const void *data);

/* Serialises to a heap buffer (caller frees *data with free()) or to a file.
 * Errors: TDM_ERESOURCE, TDM_EUNAVAILABLE (cannot write the file, message has the path). */
int tdm_gguf_writer_to_memory(const tdm_gguf_writer_t *w, void **data, size_t *size);
int tdm_gguf_writer_write_file(const tdm_gguf_writer_t *w, const char *path, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_GGUF_H */
