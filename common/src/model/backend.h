/* backend.h - the compute backend interface the model code drives (internal to libtandem).
 *
 * model.c runs the transformer as a sequence of ops on backend buffers; a backend (cpu.c,
 * cuda/) implements the ops. Buffers are the backend's (host memory for the CPU,
 * device memory for a GPU): model code only passes the pointers back. Every buffer comes from
 * ops->alloc while the engine is created, so a forward pass allocates nothing.
 *
 * Shapes: activations are row-major [n rows][dim] f32. A weight is a GGUF matrix with ne[0] =
 * n_in (contiguous) and ne[1] = n_out; matmul computes y[t][o] = sum_i x[t][i] * W[o][i].
 *
 * Host arrays that describe the rows (tokens, positions, block tables, the rows asking for
 * logits) are passed to every op that needs them. A device backend copies them to the device
 * once per forward pass in `begin` and then requires the ops of that pass to be called with
 * the same host arrays. Ops may run asynchronously: `read` and `sync` wait for them, and the
 * error of an asynchronous op may surface there.
 */
#ifndef TANDEM_MODEL_BACKEND_H
#define TANDEM_MODEL_BACKEND_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/gguf.h"
#include "tandem/kv.h"
#include "tandem/model.h"

/* A weight tensor as the backends see it. */
typedef struct tdm_weight {
    const char *name;
    tdm_ggml_type_t type;
    uint64_t n_in;    /* ne[0]: input features (elements per row) */
    uint64_t n_out;   /* ne[1]: output features (rows); 1 for vectors */
    size_t row_bytes; /* bytes per row in the quantized layout */
    const void *data; /* host copy (the mmap'd file) */
    void *dev;        /* the backend's own copy (GPU), NULL when it uses data */
} tdm_weight_t;

/* A layer's weights. With hparams.fused_qkv, wq, wk and wv are views of row ranges of the one
 * attn_qkv matrix (their data point into it, name is attn_qkv's); with fused_gate_up, w_gate
 * and w_up of ffn_up's two halves (model.c's bind_fused). */
typedef struct tdm_layer_weights {
    tdm_weight_t attn_norm, wq, wk, wv, wo;
    tdm_weight_t bq, bk, bv;                     /* present when hparams.has_qkv_bias */
    tdm_weight_t q_norm, k_norm;                 /* [head_dim], present when hparams.qk_norm */
    tdm_weight_t post_attn_norm, post_ffn_norm;  /* [n_embd], present when hparams.post_norms */
    tdm_weight_t ffn_norm, w_gate, w_up, w_down; /* w_*: dense FFN only (hparams.n_expert 0) */
    /* mixture of experts (hparams.n_expert > 0): the router, [n_embd] in, [n_expert] out, and
     * each expert's three matrices as 2-D slices of the file's 3-D ffn_*_exps tensors:
     * exps[3 e + 0] gate, [3 e + 1] up ([n_embd] in, [n_ff_exp] out), [3 e + 2] down */
    tdm_weight_t gate_inp;
    const tdm_weight_t *exps; /* [3 * n_expert], owned by the model */
} tdm_layer_weights_t;

/* What attention and the KV store need to know about the rows of one forward pass. */
typedef struct tdm_fwd_rows {
    uint32_t n;                  /* rows */
    const uint32_t *pos;         /* [n] positions */
    const uint32_t *seq;         /* [n] sequence index */
    const tdm_batch_seq_t *seqs; /* block tables */
} tdm_fwd_rows_t;

typedef struct tdm_backend_ops {
    const char *name;
    /* Optional (NULL for the CPU): called first in every forward pass with its rows, tokens
     * ([rows->n]) and the rows asking for logits ([n_logits] indices into the rows); the
     * arrays stay unchanged until the pass ends. */
    int (*begin)(void *be, const tdm_fwd_rows_t *rows, const int32_t *tokens,
                 const uint32_t *logit_rows, uint32_t n_logits);
    /* Optional: waits until every op issued so far has finished. Called at the end of a pass
     * that reads no logits, so that the pass's KV writes are complete when forward returns. */
    int (*sync)(void *be);
    /* Optional: the detailed message of the last failed op ("" when none); owned by be. */
    const char *(*errmsg)(const void *be);
    /* Optional: start of the backend's own copy of the KV pool (device memory, the same
     * layout and size as the host pool); NULL when the backend uses the host pool. */
    void *(*kv_device_base)(const void *be);
    /* Optional (NULL: no device memory): device memory the backend allocated outside the
     * scratch it hands out through alloc and outside its KV copy, bytes: *weights for the
     * weights' device copies, *workspace for workspaces and staging. */
    void (*device_bytes)(const void *be, uint64_t *weights, uint64_t *workspace);
    /* Creates the backend state for a model and pool; NULL with *err on failure. */
    void *(*create)(const tdm_model_t *m, const tdm_engine_params_t *p, tdm_kv_pool_t *pool,
                    tdm_error_t *err);
    void (*destroy)(void *be);
    /* "cpu/avx2" etc. */
    const char *(*kernel_name)(const void *be);
    /* Optional: bytes the backend allocated for itself while being created (its scratch, its
     * repacked weight copies), beyond the buffers model code asks for with alloc. */
    uint64_t (*own_bytes)(const void *be);
    /* Optional: bytes of the model file's weights the backend keeps a copy of and released
     * from memory (tdm_gguf_release) while being created. */
    uint64_t (*released_bytes)(const void *be);
    /* Scratch buffer of n floats (only while creating the engine); NULL on out of memory. */
    float *(*alloc)(void *be, size_t n);
    /* x[t] = embedding row tokens[t]. */
    int (*embed)(void *be, const tdm_weight_t *emb, const int32_t *tokens, uint32_t n, float *x);
    /* out[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w  (Zhang & Sennrich 2019), rows of w's
     * width (n_embd, or head_dim for QK-norm over n * heads rows); out may be x. */
    int (*rmsnorm)(void *be, const float *x, const tdm_weight_t *w, uint32_t n, float eps,
                   float *out);
    /* For k in 0..n_w: out[k][t] = x[t] · W_k rows; all W_k share n_in. */
    int (*matmul)(void *be, const float *x, uint32_t n, uint32_t n_w, const tdm_weight_t *const *w,
                  float *const *out);
    /* x[t] += b for each row (b a vector of x's width). */
    int (*add_bias)(void *be, float *x, const tdm_weight_t *b, uint32_t n);
    /* RoPE on q ([n][n_heads*head_dim]) and k ([n][n_kv_heads*head_dim]) at rows' pos, with
     * layer's theta base and position scale (tdm_llama_layer_rope). */
    int (*rope)(void *be, uint32_t layer, float *q, float *k, const tdm_fwd_rows_t *rows);
    /* Writes rows' k and v ([n][n_kv_heads*head_dim]) into the pool at layer. */
    int (*kv_store)(void *be, uint32_t layer, const float *k, const float *v,
                    const tdm_fwd_rows_t *rows);
    /* out[t] = causal softmax attention of q[t] over its sequence's positions
     * tdm_llama_layer_first_key(hp, layer, pos[t]) .. pos[t] (0 .. pos[t] unless the layer
     * has a sliding window); the scores are scaled by 1 / sqrt(head_dim), or by 1 when
     * hparams.attn_q_scale > 0 (q arrives scaled). A backend without arch_features does
     * neither window nor q scale: the engine refuses such models on it. */
    int (*attention)(void *be, uint32_t layer, const float *q, const tdm_fwd_rows_t *rows,
                     float *out);
    /* out[i] = silu(gate[i]) * up[i] for n*dim values (Shazeer 2020). */
    int (*swiglu)(void *be, const float *gate, const float *up, size_t count, float *out);
    /* Optional: out[i] = gelu(gate[i]) * up[i] for count values, GELU's tanh approximation
     * 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (Hendrycks & Gimpel 2016; ggml_gelu). */
    int (*geglu)(void *be, const float *gate, const float *up, size_t count, float *out);
    /* Optional (a model with experts is refused without it): the mixture-of-experts FFN of
     * layer, llama.cpp's build_moe_ffn with softmax gating and normalised weights
     * (src/llama-graph.cpp): for each row t of x ([n][n_embd], already RMS-normed),
     * p = softmax(W_gate_inp · x[t]) over the n_expert experts; the n_expert_used largest
     * (descending, ties to the lower index) e_0, e_1, ... with weights w_j = p[e_j] /
     * max(sum_j p[e_j], 2^-14); out[t] = sum over j in that order of
     * w_j · (W_down,e_j · (silu(W_gate,e_j · x[t]) ⊙ (W_up,e_j · x[t]))). */
    int (*moe_ffn)(void *be, uint32_t layer, const float *x, uint32_t n, float *out);
    /* Optional: x[i] *= s for count values. */
    int (*scale)(void *be, float *x, float s, size_t count);
    /* x[i] += y[i]. */
    int (*add)(void *be, float *x, const float *y, size_t count);
    /* dst[k] = src[rows[k]] for k < n (row width dim). */
    int (*gather_rows)(void *be, const float *src, const uint32_t *rows, uint32_t n, uint32_t dim,
                       float *dst);
    /* Copies count floats of backend memory to host memory. */
    int (*read)(void *be, const float *src, size_t count, float *host_dst);
    /* The backend's buffers are host memory: the engine passes the caller's logits array as the
     * output projection's output, with no read (the CPU backend; 6 MB a step at batch 32 on a
     * 49k vocabulary). */
    bool host_memory;
    /* The backend implements every architecture feature of tdm_llama_hparams_t (sliding
     * windows, the q scale, QK-norm, post-norms, RoPE scaling and frequency factors, per-layer
     * RoPE bases); without
     * it the engine refuses a model that uses one, naming the feature. */
    bool arch_features;
    /* The backend addresses pools with layer groups (tdm_kv_pool_new_grouped: a layer's
     * records in its group's blocks, through tdm_batch_seq_t.group_blocks); without it the
     * engine refuses such a pool. */
    bool kv_groups;
} tdm_backend_ops_t;

/* The CPU backend (cpu.c). */
extern const tdm_backend_ops_t tdm_model_backend_cpu;

/* Model internals the backends read (model.c). */
const tdm_weight_t *tdm_model_token_embd(const tdm_model_t *m);
const tdm_weight_t *tdm_model_output(const tdm_model_t *m);
const tdm_weight_t *tdm_model_output_norm(const tdm_model_t *m);
const tdm_layer_weights_t *tdm_model_layer(const tdm_model_t *m, uint32_t layer);
/* Every layer's expert slices in one array, layer-major ([n_layers][n_expert][3], the
 * tdm_layer_weights_t.exps of each layer); NULL with *n 0 for a dense model. */
const tdm_weight_t *tdm_model_experts(const tdm_model_t *m, size_t *n);

#endif /* TANDEM_MODEL_BACKEND_H */
