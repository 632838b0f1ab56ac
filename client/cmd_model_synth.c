/* cmd_model_synth.c - random weights of a real architecture's shape, for `tandem model synth`.
 *
 * Scaling (so that the residual stream's RMS stays near 1 in every layer, and no op sees
 * values that push a kernel onto a slow path): the embedding rows have RMS 1; every matrix
 * that reads a normalised input (Q, K, V, gate, up) has standard deviation 1/sqrt(n_in), so
 * its outputs have RMS ~1 and the attention scores q.k/sqrt(head_dim) have RMS ~1 (no
 * saturated softmax); the two matrices that write into the residual stream (attn_output,
 * ffn_down) are scaled so that each adds RMS ~alpha = 1/sqrt(2 n_layers), so after all layers
 * the RMS is ~sqrt(2) (silu(g) * u has RMS ~0.6 for g, u ~ N(0, 1)); the logits have standard
 * deviation ~2 (output_norm's weight 2/sqrt(n_embd) on the tied embedding, or an output matrix
 * of std 2/sqrt(n_embd)), so the softmax over the vocabulary is neither flat nor one-hot and
 * exp() underflows into denormals for no more tokens than in a trained model.
 * Gemma 3 (the gemma3 shapes) multiplies the embeddings by sqrt(n_embd) and RMS-normalises
 * q and k per head and each block's output before adding it to the residual stream
 * (post_attention_norm, post_ffw_norm; llama.cpp's converter stores Gemma's norm weights with
 * the +1 already added, so a weight is the factor applied). So: embedding rows of standard
 * deviation 1/sqrt(n_embd) (RMS 1 after the multiply), Q/K norms of weight 1 (scores of RMS ~1
 * after the 1/sqrt(head_dim) scale), post-norm weights alpha = 1/sqrt(2 n_layers) (each block
 * adds RMS alpha, whatever its matrices' scale: they keep std 1/sqrt(n_in)), and output_norm's
 * weight 2 (tied logits of std ~2). Tied embeddings echo: the residual stream still holds the
 * input token's embedding, so that token's own logit stands out (~2 sqrt(n_embd / 2)).
 * tests/unit/test_synth.c checks the RMS of every layer's hidden state.
 *
 * Values are uniform on [-a, a] (a = std * sqrt 3) from splitmix64 seeded per (seed, tensor,
 * row), so rows are generated in parallel (OpenMP) and the file does not depend on the thread
 * count. Uniform rather than normal: no tails to clip, two values per 64-bit draw.
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmd_model.h"

/* Shapes from each model's config.json on the Hugging Face hub. */
static const tdm_synth_shape_t shapes[] = {
    {"smollm2-135m", "llama", 49152, 8192, 576, 1536, 30, 9, 3, 64, 100000.0f, true, 0, false, 0, 0,
     0, 0},
    {"smollm2-360m", "llama", 49152, 8192, 960, 2560, 32, 15, 5, 64, 100000.0f, true, 0, false, 0,
     0, 0, 0},
    {"llama-3.2-1b", "llama", 128256, 131072, 2048, 8192, 16, 32, 8, 64, 500000.0f, true, 0, true,
     0, 0, 0, 0},
    {"llama-3.1-8b", "llama", 128256, 131072, 4096, 14336, 32, 32, 8, 128, 500000.0f, false, 0,
     true, 0, 0, 0, 0},
    /* a miniature of Llama 3.2 for tests (its RoPE frequency factors, SmolLM2's vocabulary) */
    {"llama3-tiny", "llama", 49152, 2048, 128, 256, 4, 4, 2, 32, 500000.0f, true, 0, true, 0, 0, 0,
     0},
    {"qwen3-0.6b", "qwen3", 151936, 40960, 1024, 3072, 28, 16, 8, 128, 1e6f, true, 0, false, 0, 0,
     0, 0},
    {"qwen3-tiny", "qwen3", 49152, 2048, 128, 256, 4, 4, 2, 64, 1e6f, true, 0, false, 0, 0, 0, 0},
    /* Gemma 3 270M; local layers' rope theta 10000 (llama.cpp's default, not in the file) */
    {"gemma3-270m", "gemma3", 262144, 32768, 640, 2048, 18, 4, 1, 256, 1e6f, true, 512, false, 0, 0,
     0, 0},
    /* a miniature for tests: layers 0-4 local with a 32-token window, layer 5 global */
    {"gemma3-tiny", "gemma3", 262144, 2048, 128, 256, 6, 2, 1, 64, 1e6f, true, 32, false, 0, 0, 0,
     0},
    /* Phi-3-mini-128k-instruct (its sliding window, 262144, is written and ignored) */
    {"phi3-mini", "phi3", 32064, 131072, 3072, 8192, 32, 32, 32, 96, 10000.0f, false, 262144, false,
     4096, 0, 0, 0},
    /* a miniature for tests: its 1024-token original context is shorter than the 2048 the
     * golden tests run at, so llama.cpp and Tandem take the long RoPE factors; a 64-token
     * window that both must ignore */
    {"phi3-tiny", "phi3", 49152, 8192, 128, 256, 4, 4, 2, 32, 10000.0f, false, 64, false, 1024, 0,
     0, 0},
    /* Qwen3-30B-A3B (128 experts, 8 per token, moe_intermediate_size 768) and a miniature */
    {"qwen3-30b-a3b", "qwen3moe", 151936, 40960, 2048, 6144, 48, 32, 4, 128, 1e6f, false, 0, false,
     0, 128, 8, 768},
    {"qwen3moe-tiny", "qwen3moe", 49152, 2048, 128, 256, 4, 4, 2, 64, 1e6f, true, 0, false, 0, 8, 2,
     128},
    /* Mixtral 8x7B (llama.cpp's `llama` with experts) and a miniature */
    {"mixtral-8x7b", "llama", 32000, 32768, 4096, 14336, 32, 32, 8, 128, 1e6f, false, 0, false, 0,
     8, 2, 14336},
    {"mixtral-tiny", "llama", 49152, 2048, 128, 256, 4, 4, 2, 32, 1e6f, false, 0, false, 0, 8, 2,
     256},
};
#define N_SHAPES (sizeof shapes / sizeof shapes[0])

const tdm_synth_shape_t *tdm_synth_shape_find(const char *name)
{
    for (size_t i = 0; name && i < N_SHAPES; i++)
        if (strcmp(shapes[i].name, name) == 0)
            return &shapes[i];
    return NULL;
}

const char *tdm_synth_shape_names(void)
{
    return "smollm2-135m|smollm2-360m|llama-3.2-1b|llama-3.1-8b|llama3-tiny|qwen3-0.6b|"
           "qwen3-tiny|gemma3-270m|gemma3-tiny|phi3-mini|phi3-tiny|qwen3-30b-a3b|qwen3moe-tiny|"
           "mixtral-8x7b|mixtral-tiny";
}

const tdm_synth_shape_t *tdm_synth_arch_find(const char *arch)
{
    static const char *const archs[][2] = {
        {"llama3", "llama3-tiny"},   {"qwen3", "qwen3-tiny"},   {"qwen3moe", "qwen3moe-tiny"},
        {"mixtral", "mixtral-tiny"}, {"gemma3", "gemma3-tiny"}, {"phi3", "phi3-tiny"},
    };
    for (size_t i = 0; arch && i < sizeof archs / sizeof archs[0]; i++)
        if (strcmp(archs[i][0], arch) == 0)
            return tdm_synth_shape_find(archs[i][1]);
    return NULL;
}

const char *tdm_synth_arch_names(void)
{
    return "llama3|qwen3|qwen3moe|mixtral|gemma3|phi3";
}

/* splitmix64 (Steele, Lea, Flood 2014; S. Vigna's public-domain reference). */
static uint64_t splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Row i of a tensor: n uniform values on [-a, a] (mean 0, std a / sqrt 3), plus mean. */
static void fill_row(float *row, uint64_t n, uint64_t stream, uint64_t i, float a, float mean)
{
    uint64_t state = stream ^ (i * 0xd1b54a32d192ed03ull);
    splitmix64(&state);
    const float scale = a / 2147483648.0f; /* int32 -> [-a, a) */
    for (uint64_t j = 0; j + 1 < n; j += 2) {
        const uint64_t r = splitmix64(&state);
        row[j] = mean + (float)(int32_t)(uint32_t)r * scale;
        row[j + 1] = mean + (float)(int32_t)(uint32_t)(r >> 32) * scale;
    }
    if (n % 2)
        row[n - 1] = mean + (float)(int32_t)(uint32_t)splitmix64(&state) * scale;
}

/* One tensor to generate: [ne0] x ne1 rows of type, std (0: constant mean). */
typedef struct synth_tensor {
    const char *name;
    tdm_ggml_type_t type;
    uint64_t ne0, ne1;
    float std, mean;
} synth_tensor_t;

/* Generates t's rows (ne1 * n_mat of them: n_mat matrices stacked, the experts of a 3-D
 * tensor) in parallel into data. scratch: [threads][ne0] f32. */
static void fill_tensor(const synth_tensor_t *t, uint64_t n_mat, uint64_t stream, uint8_t *data,
                        float *scratch)
{
    const size_t row_bytes = tdm_ggml_row_size(t->type, t->ne0);
    const float a = t->std * 1.7320508f;
#pragma omp parallel
    {
        float *row = scratch + (size_t)omp_get_thread_num() * t->ne0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < (int64_t)(t->ne1 * n_mat); i++) {
            fill_row(row, t->ne0, stream, (uint64_t)i, a, t->mean);
            tdm_ggml_quantize_row(t->type, row, data + (size_t)i * row_bytes, (int64_t)t->ne0);
        }
    }
}

/* Adds tensor t, the index-th of the file, to w: n_mat > 1 stacks that many [ne0, ne1]
 * matrices into a 3-D [ne0, ne1, n_mat] tensor (the experts of a layer). */
static int add_tensor_n(tdm_gguf_writer_t *w, const synth_tensor_t *t, uint64_t n_mat,
                        uint64_t seed, uint64_t index, float *scratch, tdm_error_t *err)
{
    const size_t row_bytes = tdm_ggml_row_size(t->type, t->ne0);
    if (row_bytes == 0)
        return tdm_error_set(err, TDM_EINVALID, "%s: %llu is not a multiple of %s's block size",
                             t->name, (unsigned long long)t->ne0,
                             tdm_ggml_type_get((uint32_t)t->type)->name);
    uint8_t *data = malloc(row_bytes * t->ne1 * n_mat);
    if (!data)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for %s", t->name);
    uint64_t stream = seed ^ (index * 0x9e3779b97f4a7c15ull);
    splitmix64(&stream);
    fill_tensor(t, n_mat, stream, data, scratch);
    const uint64_t ne[3] = {t->ne0, t->ne1, n_mat};
    const uint32_t n_dims = n_mat > 1 ? 3 : t->ne1 == 1 ? 1 : 2;
    int rc = tdm_gguf_writer_add_tensor(w, t->name, t->type, n_dims, ne, data);
    free(data);
    if (rc != TDM_OK)
        return tdm_error_set(err, rc, "cannot add %s", t->name);
    return TDM_OK;
}

static int add_tensor(tdm_gguf_writer_t *w, const synth_tensor_t *t, uint64_t seed, uint64_t index,
                      float *scratch, tdm_error_t *err)
{
    return add_tensor_n(w, t, 1, seed, index, scratch, err);
}

/* llama.cpp's llama_ftype for projections of type t (general.file_type). */
static uint32_t file_type_of(tdm_ggml_type_t t)
{
    switch (t) {
    case TDM_GGML_TYPE_F16: return 1;   /* MOSTLY_F16 */
    case TDM_GGML_TYPE_Q4_0: return 2;  /* MOSTLY_Q4_0 */
    case TDM_GGML_TYPE_Q4_1: return 3;  /* MOSTLY_Q4_1 */
    case TDM_GGML_TYPE_Q8_0: return 7;  /* MOSTLY_Q8_0 */
    case TDM_GGML_TYPE_Q5_0: return 8;  /* MOSTLY_Q5_0 */
    case TDM_GGML_TYPE_Q5_1: return 9;  /* MOSTLY_Q5_1 */
    case TDM_GGML_TYPE_Q2_K: return 10; /* MOSTLY_Q2_K */
    case TDM_GGML_TYPE_Q3_K: return 12; /* MOSTLY_Q3_K_M */
    case TDM_GGML_TYPE_Q4_K: return 15; /* MOSTLY_Q4_K_M */
    case TDM_GGML_TYPE_Q5_K: return 17; /* MOSTLY_Q5_K_M */
    case TDM_GGML_TYPE_Q6_K: return 18; /* MOSTLY_Q6_K */
    case TDM_GGML_TYPE_BF16: return 32; /* MOSTLY_BF16 */
    default: return 0;                  /* ALL_F32 */
    }
}

/* general.* and <arch>.* keys (llama, qwen3), in the order convert_hf_to_gguf.py writes them. */
static int add_metadata(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s, uint32_t n_vocab,
                        tdm_ggml_type_t type)
{
    char name[96];
    snprintf(name, sizeof name, "synth %s %s", s->name, tdm_ggml_type_get((uint32_t)type)->name);
    const bool qwen = strncmp(s->arch, "qwen3", 5) == 0;
    int rc = tdm_gguf_writer_set_str(w, "general.architecture", s->arch);
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.type", "model");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.name", name);
    const struct {
        const char *suffix;
        uint32_t u;
        float f; /* used when u is 0 */
    } keys[] = {
        {"block_count", s->n_layers, 0},
        {"context_length", s->n_ctx, 0},
        {"embedding_length", s->n_embd, 0},
        {"feed_forward_length", s->n_ff, 0},
        {"attention.head_count", s->n_heads, 0},
        {"attention.head_count_kv", s->n_kv_heads, 0},
        {"rope.freq_base", 0, s->rope_theta},
        {"attention.layer_norm_rms_epsilon", 0, qwen ? 1e-6f : 1e-5f},
        {"attention.key_length", s->head_dim, 0},
        {"attention.value_length", s->head_dim, 0},
        {"vocab_size", qwen ? 0 : n_vocab, 0}, /* Qwen's converter writes none */
        {"rope.dimension_count", qwen ? 0 : s->head_dim, 0},
        {"expert_count", s->n_expert, 0},
        {"expert_used_count", s->n_expert_used, 0},
        {"expert_feed_forward_length", qwen ? s->n_ff_exp : 0, 0},
    };
    for (size_t i = 0; i < sizeof keys / sizeof keys[0] && rc == TDM_OK; i++) {
        char key[96];
        snprintf(key, sizeof key, "%s.%s", s->arch, keys[i].suffix);
        if (keys[i].u)
            rc = tdm_gguf_writer_set_u32(w, key, keys[i].u);
        else if (keys[i].f != 0.0f)
            rc = tdm_gguf_writer_set_f32(w, key, keys[i].f);
    }
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.file_type", file_type_of(type));
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.quantization_version", 2);
    return rc;
}

/* general.* and gemma3.* keys, in the order convert_hf_to_gguf.py writes them for Gemma 3 (the
 * sliding-window pattern and the local layers' rope theta are llama.cpp's defaults: every 6th
 * layer global, 10000). */
static int add_metadata_gemma3(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s,
                               tdm_ggml_type_t type)
{
    char name[96];
    snprintf(name, sizeof name, "synth %s %s", s->name, tdm_ggml_type_get((uint32_t)type)->name);
    int rc = tdm_gguf_writer_set_str(w, "general.architecture", "gemma3");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.type", "model");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.name", name);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.context_length", s->n_ctx);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.embedding_length", s->n_embd);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.block_count", s->n_layers);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.feed_forward_length", s->n_ff);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.attention.head_count", s->n_heads);
    rc = rc ? rc : tdm_gguf_writer_set_f32(w, "gemma3.attention.layer_norm_rms_epsilon", 1e-6f);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.attention.key_length", s->head_dim);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.attention.value_length", s->head_dim);
    rc = rc ? rc : tdm_gguf_writer_set_f32(w, "gemma3.rope.freq_base", s->rope_theta);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.attention.sliding_window", s->n_swa);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "gemma3.attention.head_count_kv", s->n_kv_heads);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.file_type", file_type_of(type));
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.quantization_version", 2);
    return rc;
}

static bool is_gemma3(const tdm_synth_shape_t *s)
{
    return strcmp(s->arch, "gemma3") == 0;
}

#define MAX_LAYER_TENSORS 13 /* Gemma 3's */

/* Names ts[0..n) "blk.<l>.<name>.weight", into names. */
static void name_layer(synth_tensor_t *ts, int n, uint32_t l, char names[][64])
{
    for (int i = 0; i < n; i++) {
        snprintf(names[i], 64, "blk.%u.%s.weight", l, ts[i].name);
        ts[i].name = names[i];
    }
}

static bool is_phi3(const tdm_synth_shape_t *s)
{
    return strcmp(s->arch, "phi3") == 0;
}

/* LongRoPE's attention factor as llama.cpp's converter (conversion/phi.py, Phi3MiniModel)
 * computes it: sqrt(1 + ln(scale) / ln(original)) with scale = n_ctx / original; 1 without
 * LongRoPE. */
static float phi3_attn_factor(const tdm_synth_shape_t *s)
{
    if (!s->n_ctx_orig || s->n_ctx <= s->n_ctx_orig)
        return 1.0f;
    const double scale = (double)s->n_ctx / s->n_ctx_orig;
    return (float)sqrt(1.0 + log(scale) / log((double)s->n_ctx_orig));
}

/* general.* and phi3.* keys, in the order conversion/phi.py (Phi3MiniModel) writes them: the
 * original context, the sliding window (which llama.cpp ignores) and, with LongRoPE, the
 * attention factor. */
static int add_metadata_phi3(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s, tdm_ggml_type_t type)
{
    /* not "phi3" or "phi-3" in general.name: llama.cpp's vocabulary loader then gives the
     * special tokens Phi-3's strip attributes and looks up "</s>", which SmolLM2's lacks */
    char name[96];
    snprintf(name, sizeof name, "synth Phi 3 %s %s", s->name + 5,
             tdm_ggml_type_get((uint32_t)type)->name);
    int rc = tdm_gguf_writer_set_str(w, "general.architecture", "phi3");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.type", "model");
    rc = rc ? rc : tdm_gguf_writer_set_str(w, "general.name", name);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.context_length", s->n_ctx);
    rc = rc ? rc
            : tdm_gguf_writer_set_u32(w, "phi3.rope.scaling.original_context_length",
                                      s->n_ctx_orig ? s->n_ctx_orig : s->n_ctx);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.embedding_length", s->n_embd);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.feed_forward_length", s->n_ff);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.block_count", s->n_layers);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.attention.head_count", s->n_heads);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.attention.head_count_kv", s->n_kv_heads);
    rc = rc ? rc : tdm_gguf_writer_set_f32(w, "phi3.attention.layer_norm_rms_epsilon", 1e-5f);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.rope.dimension_count", s->head_dim);
    rc = rc ? rc : tdm_gguf_writer_set_f32(w, "phi3.rope.freq_base", s->rope_theta);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.file_type", file_type_of(type));
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.attention.sliding_window", s->n_swa);
    if (phi3_attn_factor(s) != 1.0f)
        rc = rc ? rc
                : tdm_gguf_writer_set_f32(w, "phi3.rope.scaling.attn_factor", phi3_attn_factor(s));
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "general.quantization_version", 2);
    return rc;
}

/* Phi-3's two sets of LongRoPE factors ([head_dim / 2] F32 each), smooth stand-ins for the
 * released ones: short 1 + i / half (1 .. 2), long 40^(i / half) (1 .. ~40), the high
 * frequencies barely scaled and the low ones most, as in the released models. */
static int add_phi3_rope_factors(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s, tdm_error_t *err)
{
    float lf[TDM_GGUF_MAX_ROPE_FREQS], sf[TDM_GGUF_MAX_ROPE_FREQS];
    const uint32_t half = s->head_dim / 2;
    for (uint32_t i = 0; i < half && i < TDM_GGUF_MAX_ROPE_FREQS; i++) {
        sf[i] = 1.0f + (float)i / (float)half;
        lf[i] = (float)pow(40.0, (double)i / half);
    }
    const uint64_t ne[1] = {half};
    int rc =
        tdm_gguf_writer_add_tensor(w, "rope_factors_long.weight", TDM_GGML_TYPE_F32, 1, ne, lf);
    rc = rc ? rc
            : tdm_gguf_writer_add_tensor(w, "rope_factors_short.weight", TDM_GGML_TYPE_F32, 1, ne,
                                         sf);
    return rc == TDM_OK ? TDM_OK : tdm_error_set(err, rc, "cannot add Phi-3's RoPE factors");
}

/* The six tensors of Phi-3 layer l (fused attn_qkv: q's rows, then k's, then v's; fused ffn_up:
 * the gate's rows, then up's) into ts; returns 6. */
static int layer_tensors_phi3(const tdm_synth_shape_t *s, tdm_ggml_type_t wt, uint32_t l,
                              synth_tensor_t *ts, char names[][64])
{
    const uint64_t E = s->n_embd, F = s->n_ff, Q = (uint64_t)s->n_heads * s->head_dim;
    const uint64_t KV = (uint64_t)s->n_kv_heads * s->head_dim;
    const tdm_ggml_type_t f32 = TDM_GGML_TYPE_F32;
    const float in_e = 1.0f / sqrtf((float)E), alpha = 1.0f / sqrtf(2.0f * (float)s->n_layers);
    const synth_tensor_t t[6] = {
        {"attn_norm", f32, E, 1, 0.0f, 1.0f},
        {"attn_qkv", wt, E, Q + 2 * KV, in_e, 0.0f},
        {"attn_output", wt, Q, E, alpha / sqrtf((float)Q), 0.0f},
        {"ffn_norm", f32, E, 1, 0.0f, 1.0f},
        {"ffn_up", wt, E, 2 * F, in_e, 0.0f},
        {"ffn_down", wt, F, E, alpha / (0.6f * sqrtf((float)F)), 0.0f},
    };
    memcpy(ts, t, sizeof t);
    name_layer(ts, 6, l, names);
    return 6;
}

/* The thirteen tensors of Gemma 3 layer l into ts (names into names); returns 13. */
static int layer_tensors_gemma3(const tdm_synth_shape_t *s, tdm_ggml_type_t wt, uint32_t l,
                                synth_tensor_t *ts, char names[][64])
{
    const uint64_t E = s->n_embd, F = s->n_ff, Q = (uint64_t)s->n_heads * s->head_dim;
    const uint64_t KV = (uint64_t)s->n_kv_heads * s->head_dim, D = s->head_dim;
    const tdm_ggml_type_t f32 = TDM_GGML_TYPE_F32;
    const float in_e = 1.0f / sqrtf((float)E), alpha = 1.0f / sqrtf(2.0f * (float)s->n_layers);
    const synth_tensor_t t[13] = {
        {"attn_norm", f32, E, 1, 0.0f, 1.0f},
        {"attn_q", wt, E, Q, in_e, 0.0f},
        {"attn_k", wt, E, KV, in_e, 0.0f},
        {"attn_v", wt, E, KV, in_e, 0.0f},
        {"attn_q_norm", f32, D, 1, 0.0f, 1.0f},
        {"attn_k_norm", f32, D, 1, 0.0f, 1.0f},
        {"attn_output", wt, Q, E, 1.0f / sqrtf((float)Q), 0.0f},
        {"post_attention_norm", f32, E, 1, 0.0f, alpha},
        {"ffn_norm", f32, E, 1, 0.0f, 1.0f},
        {"ffn_gate", wt, E, F, in_e, 0.0f},
        {"ffn_up", wt, E, F, in_e, 0.0f},
        {"ffn_down", wt, F, E, 1.0f / sqrtf((float)F), 0.0f},
        {"post_ffw_norm", f32, E, 1, 0.0f, alpha},
    };
    memcpy(ts, t, sizeof t);
    name_layer(ts, 13, l, names);
    return 13;
}

/* The tensors of a Llama (nine) or Qwen3 (eleven: the QK-norms, weight 1 so that each head of
 * q and k has RMS 1) layer l into ts (names into names); returns their count. With experts the
 * dense FFN's three are replaced by the router (F32, std 3/sqrt(n_embd): logits of RMS ~3, a
 * softmax that favours a few experts clearly, so that the top-k choice rarely sits at a near-tie
 * an ulp of difference between two implementations flips) and the experts' three, scaled as the
 * dense ones (the renormalised weights sum to 1, so the mixture adds RMS ~alpha or less);
 * add_layers stacks n_expert matrices into each "_exps" tensor. */
static int layer_tensors(const tdm_synth_shape_t *s, tdm_ggml_type_t wt, uint32_t l,
                         synth_tensor_t *ts, char names[][64])
{
    if (is_gemma3(s))
        return layer_tensors_gemma3(s, wt, l, ts, names);
    if (is_phi3(s))
        return layer_tensors_phi3(s, wt, l, ts, names);
    const bool moe = s->n_expert > 0;
    const uint64_t E = s->n_embd, F = moe ? s->n_ff_exp : s->n_ff;
    const uint64_t Q = (uint64_t)s->n_heads * s->head_dim;
    const uint64_t KV = (uint64_t)s->n_kv_heads * s->head_dim, D = s->head_dim;
    const tdm_ggml_type_t f32 = TDM_GGML_TYPE_F32;
    const float in_e = 1.0f / sqrtf((float)E), alpha = 1.0f / sqrtf(2.0f * (float)s->n_layers);
    const float down_std = alpha / (0.6f * sqrtf((float)F));
    const synth_tensor_t t[12] = {
        {"attn_norm", f32, E, 1, 0.0f, 1.0f},
        {"attn_q", wt, E, Q, in_e, 0.0f},
        {"attn_k", wt, E, KV, in_e, 0.0f},
        {"attn_v", wt, E, KV, in_e, 0.0f},
        {"attn_output", wt, Q, E, alpha / sqrtf((float)Q), 0.0f},
        {"ffn_norm", f32, E, 1, 0.0f, 1.0f},
        {"ffn_gate", wt, E, F, in_e, 0.0f},
        {"ffn_up", wt, E, F, in_e, 0.0f},
        {"ffn_down", wt, F, E, down_std, 0.0f},
        {"attn_q_norm", f32, D, 1, 0.0f, 1.0f},
        {"attn_k_norm", f32, D, 1, 0.0f, 1.0f},
        {"ffn_gate_inp", f32, E, s->n_expert, 3.0f * in_e, 0.0f},
    };
    const bool qwen = strncmp(s->arch, "qwen3", 5) == 0;
    int n = 0;
    for (int i = 0; i < 12; i++) {
        const bool qk = i == 9 || i == 10, ffn = i >= 6 && i <= 8;
        if ((qk && !qwen) || (i == 11 && !moe))
            continue;
        ts[n] = t[i];
        if (ffn && moe) /* ffn_gate_exps, ffn_up_exps, ffn_down_exps */
            ts[n].name = i == 6 ? "ffn_gate_exps" : i == 7 ? "ffn_up_exps" : "ffn_down_exps";
        n++;
    }
    name_layer(ts, n, l, names);
    return n;
}

/* Llama 3's RoPE frequency factors (rope_freqs.weight, [head_dim / 2] F32) as llama.cpp's
 * converter computes them from rope_scaling (LlamaModel.generate_extra_tensors, after Meta's
 * apply_scaling): wavelength 2 pi / freq_i under original_max_position_embeddings /
 * high_freq_factor keeps factor 1, over original / low_freq_factor takes factor, and between
 * the two the factor is interpolated smoothly. */
static int add_llama3_rope_freqs(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s, tdm_error_t *err)
{
    const double factor = 8.0, low = 1.0, high = 4.0, orig = 8192.0;
    float f[TDM_GGUF_MAX_ROPE_FREQS];
    const uint32_t half = s->head_dim / 2;
    for (uint32_t i = 0; i < half && i < TDM_GGUF_MAX_ROPE_FREQS; i++) {
        const double freq = 1.0 / pow((double)s->rope_theta, 2.0 * i / (double)s->head_dim);
        const double wavelen = 2.0 * 3.14159265358979323846 / freq;
        double ff = 1.0;
        if (wavelen > orig / low)
            ff = factor;
        else if (wavelen >= orig / high) {
            const double smooth = (orig / wavelen - low) / (high - low);
            ff = 1.0 / ((1.0 - smooth) / factor + smooth);
        }
        f[i] = (float)ff;
    }
    const uint64_t ne[1] = {half};
    int rc = tdm_gguf_writer_add_tensor(w, "rope_freqs.weight", TDM_GGML_TYPE_F32, 1, ne, f);
    return rc == TDM_OK ? TDM_OK : tdm_error_set(err, rc, "cannot add rope_freqs.weight");
}

/* Embedding and output matrices: Q8_0 under a quantized type (as llama.cpp's quantize keeps
 * them at 8 bits when the rows are not a multiple of 256), else the projections' type. */
static tdm_ggml_type_t embd_type_of(tdm_ggml_type_t wt)
{
    return tdm_ggml_type_get((uint32_t)wt)->block_size > 1 ? TDM_GGML_TYPE_Q8_0 : wt;
}

/* Adds every layer's tensors. */
static int add_layers(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s, tdm_ggml_type_t type,
                      uint64_t seed, uint64_t *index, float *scratch, tdm_error_t *err)
{
    for (uint32_t l = 0; l < s->n_layers; l++) {
        synth_tensor_t ts[MAX_LAYER_TENSORS];
        char names[MAX_LAYER_TENSORS][64];
        const int n = layer_tensors(s, type, l, ts, names);
        for (int i = 0; i < n; i++) {
            const uint64_t n_mat = strstr(ts[i].name, "_exps") ? s->n_expert : 1;
            int rc = add_tensor_n(w, &ts[i], n_mat, seed, (*index)++, scratch, err);
            if (rc != TDM_OK)
                return rc;
        }
    }
    return TDM_OK;
}

int tdm_synth_add_weights(tdm_gguf_writer_t *w, const tdm_synth_shape_t *s, uint32_t n_vocab,
                          tdm_ggml_type_t type, uint64_t seed, tdm_error_t *err)
{
    const bool gemma = is_gemma3(s);
    if ((gemma        ? add_metadata_gemma3(w, s, type)
         : is_phi3(s) ? add_metadata_phi3(w, s, type)
                      : add_metadata(w, s, n_vocab, type)) != TDM_OK)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory for the metadata");
    const uint64_t E = s->n_embd, Q = (uint64_t)s->n_heads * s->head_dim;
    const uint64_t F = s->n_ff > s->n_ff_exp ? s->n_ff : s->n_ff_exp;
    const uint64_t max_in = F > E ? (F > Q ? F : Q) : (E > Q ? E : Q);
    float *scratch = malloc((size_t)omp_get_max_threads() * max_in * sizeof *scratch);
    if (!scratch)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    const tdm_ggml_type_t et = embd_type_of(type), f32 = TDM_GGML_TYPE_F32;
    /* Gemma: embedding std 1/sqrt(E) (x sqrt(E) at the input), so the tied logits' gain is 2 */
    const float logit_gain = gemma ? 2.0f : 2.0f / sqrtf((float)E);
    const float embd_std = gemma ? 1.0f / sqrtf((float)E) : 1.0f;
    const synth_tensor_t embd = {"token_embd.weight", et, E, n_vocab, embd_std, 0.0f};
    const synth_tensor_t out_norm = {"output_norm.weight", f32, E, 1, 0, s->tied ? logit_gain : 1};
    const synth_tensor_t out = {"output.weight", et, E, n_vocab, 2.0f / sqrtf((float)E), 0.0f};
    uint64_t index = 0;
    int rc = s->llama3_rope ? add_llama3_rope_freqs(w, s, err) : TDM_OK;
    if (rc == TDM_OK && is_phi3(s) && phi3_attn_factor(s) != 1.0f)
        rc = add_phi3_rope_factors(w, s, err);
    rc = rc ? rc : add_tensor(w, &embd, seed, index++, scratch, err);
    rc = rc ? rc : add_layers(w, s, type, seed, &index, scratch, err);
    rc = rc ? rc : add_tensor(w, &out_norm, seed, index++, scratch, err);
    if (rc == TDM_OK && !s->tied)
        rc = add_tensor(w, &out, seed, index++, scratch, err);
    free(scratch);
    return rc;
}
