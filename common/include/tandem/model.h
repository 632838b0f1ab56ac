/* model.h - a Llama-family model loaded from GGUF, and the engine that runs its forward pass
 * over the paged KV cache for any mix of prefill chunks and decode tokens.
 *
 * The transformer (Llama 2/3, SmolLM2, Mistral, Qwen2-style with QKV biases):
 *   x = token_embd[token]
 *   per layer: h = x + W_o · attn(RoPE(W_q · rmsnorm(x)), RoPE(W_k · …), W_v · …)
 *              x = h + W_down · (silu(W_gate · rmsnorm(h)) ⊙ (W_up · rmsnorm(h)))
 *   logits = W_out · rmsnorm(x)       (W_out = token_embd when tied)
 * Gemma 3 (llama.cpp's src/models/gemma3.cpp) on the same skeleton: x is scaled by
 * sqrt(n_embd); q and k get a per-head RMSNorm before RoPE and q is scaled by 1/sqrt(head_dim)
 * after it; each sub-layer's output is RMS-normed before its residual add; the FFN is GeGLU
 * (tanh GELU); five of every six layers attend to the last attention.sliding_window positions
 * only, with their own RoPE base; the logits may be soft-capped (c · tanh(logits / c)).
 * Mixture of experts (qwen3moe; Mixtral as llama with experts; llama.cpp's build_moe_ffn): the
 * FFN becomes sum over the top n_expert_used experts of softmax(W_gate_inp · h), weights
 * renormalised, of w_e · W_down,e · (silu(W_gate,e · h) ⊙ (W_up,e · h)) (docs/models.md).
 * Sources: Touvron et al. 2023 (Llama 2), Zhang & Sennrich 2019 (RMSNorm), Su et al. 2021
 * (RoPE), Shazeer 2020 (SwiGLU, GeGLU), Ainslie et al. 2023 (GQA), Gemma Team 2025 (Gemma 3);
 * tensor names and RoPE modes as in llama.cpp's GGUF conversion.
 *
 * On the CPU backend weights stay in the mmap'd file in their quantized types (no f32 copy of
 * the model); the CUDA backend dequantizes them once, when the engine is created, to bf16 (or
 * f16) copies in device memory. All scratch memory is allocated when the engine is created; a
 * forward pass allocates nothing. On the CPU backend a sequence's logits are bitwise identical
 * whatever else is in the batch and however its prompt was chunked (each output is reduced in one
 * fixed order).
 */
#ifndef TANDEM_MODEL_H
#define TANDEM_MODEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/gguf.h"
#include "tandem/kv.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_model tdm_model_t;

/* Opens a GGUF model and checks it can be run (hyperparameters, every tensor present with
 * its shape and a supported type). Returns NULL with *err: TDM_ENOTFOUND (no file or
 * tensor), TDM_EINVALID (malformed or unsupported; the message names the key or tensor),
 * TDM_ERESOURCE. The model is immutable and may be shared by engines on several threads.
 * Caller frees with tdm_model_destroy (after every engine using it). */
tdm_model_t *tdm_model_load(const char *path, tdm_error_t *err);
void tdm_model_destroy(tdm_model_t **self_p);

const tdm_llama_hparams_t *tdm_model_hparams(const tdm_model_t *m);

/* The context a cluster serves a model with when its config sets no `max_context` (tokens):
 * min(this, the model's trained context), as llama.cpp's default n_ctx. */
#define TDM_MODEL_MAX_SERVE_CTX 4096u

/* The context length (tokens) the router and every node use for a model with hparams hp:
 * max_context (the model's config key; 1..hp->n_ctx_train, checked by the caller) when
 * nonzero, else min(TDM_MODEL_MAX_SERVE_CTX, hp->n_ctx_train). One function, so the router's
 * validation and the nodes' engines agree; a node registering with less is refused. A
 * max_context past the trained context is clamped to it. Cannot fail. */
uint32_t tdm_model_serve_n_ctx(const tdm_llama_hparams_t *hp, uint32_t max_context);

/* The open GGUF file (for the tokenizer and metadata); owned by the model. */
const tdm_gguf_t *tdm_model_gguf(const tdm_model_t *m);
/* Bytes of all weight tensors as stored (quantized). */
uint64_t tdm_model_weight_bytes(const tdm_model_t *m);
/* A fingerprint of the weights and hyperparameters (XXH3 of the tensor table, the
 * hyperparameters and the first and last bytes of each tensor), so nodes can check that
 * they serve the same model. Cannot fail. */
uint64_t tdm_model_fingerprint(const tdm_model_t *m);

/* ---- engine ---- */

typedef struct tdm_engine_params {
    const char *backend;       /* "cpu" (default when NULL); "cuda" (device `device`) or
                                  "cuda:N" (device N) in builds with CUDA */
    int device;                /* CUDA device ordinal for backend "cuda"; default 0 */
    int n_threads;             /* CPU threads; 0 = all available (OpenMP default) */
    uint32_t max_batch_tokens; /* rows per forward pass (prefill chunk + decode tokens), >= 1 */
    uint32_t max_logits;       /* rows per forward pass that may ask for logits, >= 1 */
    uint32_t n_ctx;            /* longest sequence (tokens), <= the model's context length */
} tdm_engine_params_t;

/* Defaults: cpu, device 0, all threads, 512 batch tokens, 64 logit rows, n_ctx 4096 (or the
 * model's trained context if smaller). */
void tdm_engine_params_default(tdm_engine_params_t *p);

typedef struct tdm_engine tdm_engine_t;

/* Creates an engine for model m writing KV into pool (whose layout must match the model:
 * n_layers, n_kv_heads, head_dim). Allocates every scratch buffer for max_batch_tokens rows
 * and n_ctx positions. Returns NULL with *err: TDM_EINVALID (bad parameter or layout
 * mismatch, named), TDM_ENOTFOUND (unknown backend, or "cuda" in a build without CUDA: the
 * message names the available backends), TDM_ERESOURCE (out of memory, host or device, with
 * the bytes), TDM_EUNAVAILABLE (no usable CUDA device or driver, with the CUDA error).
 *
 * With backend "cuda" the engine uploads the weights (dequantized to bf16; f16 when the
 * environment sets TANDEM_CUDA_GEMM=f16) and allocates a device copy of the KV pool of the
 * same layout and size: KV then lives on the device (tdm_engine_kv_device_base) and the host
 * pool keeps only the block bookkeeping. The engine is used by one thread at a time; the model
 * and pool must outlive it. */
tdm_engine_t *tdm_engine_new(const tdm_model_t *m, tdm_kv_pool_t *pool,
                             const tdm_engine_params_t *params, tdm_error_t *err);
void tdm_engine_destroy(tdm_engine_t **self_p);

/* Name of the engine's backend and of the kernels it chose ("cpu/avx2", "cpu/scalar",
 * "cuda:0/bf16 NVIDIA H200"). */
const char *tdm_engine_backend_name(const tdm_engine_t *e);
/* Width of the model's hidden state (hparams n_embd): the length of a hidden row of
 * tdm_engine_forward_hidden and of an embedding. Cannot fail. */
uint32_t tdm_engine_n_embd(const tdm_engine_t *e);
/* Size of the scratch memory the engine allocated, bytes (device memory for CUDA). */
uint64_t tdm_engine_scratch_bytes(const tdm_engine_t *e);
/* Bytes of the model file's weights the engine no longer keeps in memory: the CPU backend
 * repacks the quantized matrices into its own copy (counted in tdm_engine_scratch_bytes) and
 * releases the file's pages of them (tdm_gguf_release; only for a model opened from a file).
 * A node's resident weights are tdm_model_weight_bytes minus this. 0 for CUDA. */
uint64_t tdm_engine_released_weight_bytes(const tdm_engine_t *e);

/* ---- per-op timing (benchmarks and profiles) ----
 *
 * With timing on, every forward pass adds the wall-clock seconds of each backend op to its
 * class (clock_gettime(CLOCK_MONOTONIC) around the call; an asynchronous backend (CUDA) is
 * synchronised after each op so the time is the op's own, which slows it). The ops and their
 * results are the same either way (timing reads the clock, nothing else); with timing off
 * (the default) a pass costs one untaken branch per op. */
typedef enum tdm_op_class {
    TDM_OP_GEMM = 0,  /* the layers' weight matrices: q, k, v, o, gate, up, down */
    TDM_OP_HEAD,      /* the output projection (rows asking for logits only) */
    TDM_OP_MOE,       /* the mixture-of-experts FFN (router and expert GEMMs together) */
    TDM_OP_ATTENTION, /* softmax attention over the KV cache */
    TDM_OP_KV_STORE,  /* writing K and V into the pool */
    TDM_OP_NORM,      /* RMS norms (sub-layer, QK, post and final norms) */
    TDM_OP_ROPE,      /* rotary position embedding of q and k */
    TDM_OP_ACT,       /* SwiGLU / GeGLU */
    TDM_OP_OTHER,     /* embedding lookup, residual adds, biases, scales, row gathers, reads */
    TDM_OP_N_CLASSES
} tdm_op_class_t;

/* Accumulated per-op times since timing was last switched on. */
typedef struct tdm_op_times {
    double seconds[TDM_OP_N_CLASSES]; /* wall-clock seconds per class */
    uint64_t calls[TDM_OP_N_CLASSES]; /* op calls per class */
    double forward_seconds;           /* whole tdm_engine_forward calls, seconds */
    uint64_t forwards;                /* forward passes timed */
} tdm_op_times_t;

/* "gemm", "head", "moe", "attention", "kv_store", "norm", "rope", "act", "other"; "?" out of
 * range. Cannot fail. */
const char *tdm_op_class_name(tdm_op_class_t c);
/* Switches per-op timing on (zeroing the totals) or off (keeping them). Cannot fail. */
void tdm_engine_op_timing(tdm_engine_t *e, bool on);
/* The totals so far into *out (zeros when timing was never on). Cannot fail. */
void tdm_engine_op_times(const tdm_engine_t *e, tdm_op_times_t *out);

/* Device memory the engine holds besides the KV pool's device copy, bytes: the weights'
 * device copies (dequantized, so more than tdm_model_weight_bytes for a quantized model) in
 * *weight_bytes, and scratch (the engine's buffers, the backend's workspaces and staging) in
 * *scratch_bytes. Both 0 for the CPU backend. What a node's device budget subtracts before
 * sizing its pool (tdm_node_size_pool). Cannot fail. */
void tdm_engine_device_bytes(const tdm_engine_t *e, uint64_t *weight_bytes,
                             uint64_t *scratch_bytes);

/* Start of the KV pool's device copy (CUDA device memory from cudaMalloc: block b starts at
 * base + b * tdm_kv_pool_block_bytes(pool)), for the KV transport; NULL for the CPU backend,
 * whose KV is in the host pool. Owned by the engine; valid until it is destroyed. Cannot
 * fail. */
void *tdm_engine_kv_device_base(const tdm_engine_t *e);

/* A sequence's view for one forward pass: its block table in the engine's pool. Over a pool
 * with layer groups (tdm_kv_pool_new_grouped) the tables are per group instead: group_blocks
 * [g] is group g's table of n_blocks entries (a tdm_kv_hseq's tab[g].blocks), whose entries
 * before the block of the oldest key the sequence's first row reads may be TDM_KV_NO_BLOCK
 * (given back), and blocks is unused. */
typedef struct tdm_batch_seq {
    const uint32_t *blocks; /* [n_blocks] pool block ids covering positions 0..max pos */
    uint32_t n_blocks;
    const uint32_t *const *group_blocks; /* [n_groups][n_blocks]; NULL over a plain pool */
} tdm_batch_seq_t;

/* One forward pass: n_tokens rows, each a (sequence, position, token). Rows of one
 * sequence must have consecutive increasing positions, and the KV of that sequence's
 * positions before its first row must already be in its blocks (from earlier passes or the
 * prefix cache). A row may ask for logits (want_logits[i]); the logits of the asking rows
 * are written in row order. */
typedef struct tdm_batch {
    uint32_t n_tokens;
    const int32_t *tokens;   /* [n_tokens] token ids */
    const uint32_t *pos;     /* [n_tokens] position of the row in its sequence */
    const uint32_t *seq;     /* [n_tokens] index into seqs */
    const bool *want_logits; /* [n_tokens]; NULL = logits for every row */
    uint32_t n_seqs;
    const tdm_batch_seq_t *seqs; /* [n_seqs] */
} tdm_batch_t;

/* Runs the batch: writes K and V of every row into its sequence's blocks and, for each row
 * that asks, n_vocab logits (f32) into logits[k * n_vocab ...] for the k-th asking row.
 * Errors (nothing is written to logits): TDM_EINVALID naming the row and field for a token
 * out of the vocabulary, a position >= n_ctx, a position not covered by the sequence's
 * blocks, a block id out of the pool, rows of a sequence out of order, more than
 * max_batch_tokens rows or max_logits asking rows. A backend failure (CUDA; on the CPU a
 * weight type the kernels refuse) returns its code with the failing statement, file and line
 * in the message, and may leave logits partly written (the CPU backend's output projection
 * writes into them directly). Allocates nothing. When it returns
 * TDM_OK, every KV write of the pass is complete (also in device memory). */
int tdm_engine_forward(tdm_engine_t *e, const tdm_batch_t *batch, float *logits, tdm_error_t *err);

/* tdm_engine_forward, and when hidden is not NULL also the final hidden state of every row
 * after the output norm (the LM head's input; what llama.cpp's embeddings pool) into
 * hidden[n_tokens][n_embd] (f32, host memory, row order). On the CPU backend a row's hidden
 * state is bitwise identical whatever else is in the batch and however its prompt was chunked,
 * like its logits. Same errors as tdm_engine_forward (on a backend failure hidden may be partly
 * written). Allocates nothing. */
int tdm_engine_forward_hidden(tdm_engine_t *e, const tdm_batch_t *batch, float *logits,
                              float *hidden, tdm_error_t *err);

/* ---- embeddings: pooling the hidden states of a prompt ----
 *
 * An embedding of a prompt is its final hidden states (tdm_engine_forward_hidden) pooled over
 * its positions and L2-normalised, as llama.cpp's llama-embedding computes it (--pooling last
 * or mean, --embd-normalize 2), so the vectors match within rounding (tests/golden/
 * embed_golden.json: cosine >= 0.999). LAST is the default, as vLLM pools decoder models. The
 * sums run in double in position order, so a prompt's vector does not depend on how it was
 * chunked or batched. */
typedef enum tdm_pooling {
    TDM_POOLING_LAST = 0, /* the last position's hidden state */
    TDM_POOLING_MEAN = 1, /* the average over every position */
} tdm_pooling_t;

/* "last" or "mean". Cannot fail ("?" for a value out of the enum). */
const char *tdm_pooling_name(tdm_pooling_t p);
/* Parses "last" / "mean" into *out. Returns TDM_OK or TDM_EINVALID (*out unchanged). */
int tdm_pooling_parse(const char *name, tdm_pooling_t *out);

/* Adds the hidden state row[n_embd] of the next position of a prompt to its accumulator
 * acc[n_embd] (zeroed before the first position): MEAN sums, LAST keeps the row. Cannot fail. */
void tdm_embedding_add(tdm_pooling_t p, double *acc, const float *row, uint32_t n_embd);

/* The embedding out[n_embd] of a prompt of n_rows positions (>= 1) from its accumulator:
 * pooled (MEAN divides by n_rows), then divided by its L2 norm (a zero vector stays zero).
 * Cannot fail. */
void tdm_embedding_finish(tdm_pooling_t p, const double *acc, uint32_t n_rows, uint32_t n_embd,
                          float *out);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_MODEL_H */
