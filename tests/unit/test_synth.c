/* test_synth.c - `tandem model synth`: a vocabulary-only file from a model, synthetic models
 * with the real shapes (smollm2-135m whole, llama-3.2-1b cut to 2 layers, gemma3-270m cut to 6,
 * and the gemma3-tiny miniature) whose every layer's hidden state has RMS in [0.1, 10] on a
 * fixed prompt, the same bytes for the same seed whatever the thread count, and usage errors.
 *
 * The hidden states come from a plain float forward pass written here (dequantized weights,
 * no batching), checked against the engine's logits, so the engine needs no debug hook. The
 * command runs as a child process: TDM_CLI_PATH is the built `tandem`.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tdm_test.h"
#include "engine_runner.h"
#include "tandem/gguf.h"

#define N_PROMPT 12

static char dir[64];

/* Runs `tandem model synth ARGS` (with env, e.g. "OMP_NUM_THREADS=1", in front); the exit
 * status. */
static int synth(const char *env, const char *args)
{
    char cmd[1024];
    snprintf(cmd, sizeof cmd, "%s '%s' model synth %s >/dev/null", env, TDM_CLI_PATH, args);
    int st = system(cmd);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void path_in(char *buf, size_t cap, const char *name)
{
    snprintf(buf, cap, "%s/%s", dir, name);
}

/* ---- a reference forward pass in float ---- */

typedef struct ref {
    const tdm_gguf_t *g;
    const tdm_llama_hparams_t *hp;
    uint32_t n;       /* tokens */
    float *x;         /* [n][E] residual stream */
    float *xn;        /* [n][E] */
    float *q;         /* [n][Q] */
    float *k, *v;     /* [n][KV] */
    float *att;       /* [n][Q] */
    float *gate, *up; /* [n][F] */
    float *tmp;       /* [n][E] */
    float *row;       /* [max(E, F, Q)] one dequantized weight row */
} ref_t;

/* Layer l's tensor blk.<l>.<what>.weight. */
static const tdm_gguf_tensor_t *tensor(const ref_t *r, const char *what, uint32_t l)
{
    char name[64];
    snprintf(name, sizeof name, "blk.%u.%s.weight", l, what);
    const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(r->g, name);
    if (!t)
        fail_msg("tensor %s missing", name);
    return t;
}

/* out[t][0..rows) = W in[t] for the first `rows` rows of W (all when 0), t < n_tok. */
static void matmul(ref_t *r, const tdm_gguf_tensor_t *w, const float *in, uint32_t n_tok,
                   float *out, uint64_t rows)
{
    const uint64_t n_in = w->ne[0], n_out = rows ? rows : w->ne[1];
    const size_t rb = tdm_ggml_row_size(w->type, n_in);
    for (uint64_t o = 0; o < n_out; o++) {
        tdm_ggml_dequantize_row(w->type, (const uint8_t *)w->data + o * rb, r->row, (int64_t)n_in);
        for (uint32_t t = 0; t < n_tok; t++) {
            double s = 0;
            for (uint64_t i = 0; i < n_in; i++)
                s += (double)r->row[i] * in[t * n_in + i];
            out[t * n_out + o] = (float)s;
        }
    }
}

static void rmsnorm(const ref_t *r, const float *x, const tdm_gguf_tensor_t *w, float *out,
                    uint32_t n_tok)
{
    const uint32_t E = r->hp->n_embd;
    const float *g = w->data;
    for (uint32_t t = 0; t < n_tok; t++) {
        double ss = 0;
        for (uint32_t i = 0; i < E; i++)
            ss += (double)x[t * E + i] * x[t * E + i];
        const float s = (float)(1.0 / sqrt(ss / E + r->hp->rms_norm_eps));
        for (uint32_t i = 0; i < E; i++)
            out[t * E + i] = x[t * E + i] * s * g[i];
    }
}

/* Rotates pairs (2i, 2i + 1) of every head of v[n][n_heads * head_dim] (llama's normal rope). */
static void rope(const ref_t *r, float *v, uint32_t n_heads)
{
    const uint32_t d = r->hp->head_dim;
    for (uint32_t t = 0; t < r->n; t++)
        for (uint32_t h = 0; h < n_heads; h++)
            for (uint32_t i = 0; i < d / 2; i++) {
                const double f = pow(r->hp->rope_freq_base, -2.0 * i / d), a = t * f;
                float *p = v + ((size_t)t * n_heads + h) * d + 2 * i;
                const float x0 = p[0], x1 = p[1];
                p[0] = (float)(x0 * cos(a) - x1 * sin(a));
                p[1] = (float)(x0 * sin(a) + x1 * cos(a));
            }
}

/* Gemma 3 (neox) rope of layer l: rotates pairs (i, i + head_dim / 2) of every head, with the
 * layer's theta (the local layers' own). */
static void rope_neox(const ref_t *r, float *v, uint32_t n_heads, uint32_t l)
{
    const uint32_t d = r->hp->head_dim;
    float base, scale;
    tdm_llama_layer_rope(r->hp, l, &base, &scale);
    for (uint32_t t = 0; t < r->n; t++)
        for (uint32_t h = 0; h < n_heads; h++)
            for (uint32_t i = 0; i < d / 2; i++) {
                const double f = pow(base, -2.0 * i / d), a = t * scale * f;
                float *p = v + ((size_t)t * n_heads + h) * d + i;
                const float x0 = p[0], x1 = p[d / 2];
                p[0] = (float)(x0 * cos(a) - x1 * sin(a));
                p[d / 2] = (float)(x0 * sin(a) + x1 * cos(a));
            }
}

/* Causal attention of every head of q over k, v (grouped-query), into att. */
static void attention(ref_t *r)
{
    const uint32_t d = r->hp->head_dim, H = r->hp->n_heads, KVH = r->hp->n_kv_heads;
    double w[N_PROMPT];
    for (uint32_t t = 0; t < r->n; t++)
        for (uint32_t h = 0; h < H; h++) {
            const float *q = r->q + ((size_t)t * H + h) * d;
            const uint32_t kh = h / (H / KVH);
            double mx = -1e300, sum = 0;
            for (uint32_t s = 0; s <= t; s++) {
                const float *k = r->k + ((size_t)s * KVH + kh) * d;
                double dot = 0;
                for (uint32_t i = 0; i < d; i++)
                    dot += (double)q[i] * k[i];
                w[s] = dot / sqrt(d);
                mx = w[s] > mx ? w[s] : mx;
            }
            for (uint32_t s = 0; s <= t; s++)
                sum += (w[s] = exp(w[s] - mx));
            float *o = r->att + ((size_t)t * H + h) * d;
            for (uint32_t i = 0; i < d; i++) {
                double acc = 0;
                for (uint32_t s = 0; s <= t; s++)
                    acc += w[s] * r->v[((size_t)s * KVH + kh) * d + i];
                o[i] = (float)(acc / sum);
            }
        }
}

/* RMS of the residual stream of token t. */
static double rms_of(const ref_t *r, uint32_t t)
{
    double ss = 0;
    for (uint32_t i = 0; i < r->hp->n_embd; i++)
        ss += (double)r->x[t * r->hp->n_embd + i] * r->x[t * r->hp->n_embd + i];
    return sqrt(ss / r->hp->n_embd);
}

/* Checks every token's hidden-state RMS is in [0.1, 10]; prints the range. */
static void check_rms(const ref_t *r, const char *where)
{
    double lo = 1e30, hi = 0;
    for (uint32_t t = 0; t < r->n; t++) {
        const double v = rms_of(r, t);
        lo = v < lo ? v : lo;
        hi = v > hi ? v : hi;
    }
    printf("  %-10s hidden RMS %.3f .. %.3f\n", where, lo, hi);
    assert_true(lo >= 0.1 && hi <= 10.0);
}

static void ref_layer(ref_t *r, uint32_t l)
{
    const tdm_llama_hparams_t *hp = r->hp;
    const size_t E = hp->n_embd, F = hp->n_ff;
    rmsnorm(r, r->x, tensor(r, "attn_norm", l), r->xn, r->n);
    matmul(r, tensor(r, "attn_q", l), r->xn, r->n, r->q, 0);
    matmul(r, tensor(r, "attn_k", l), r->xn, r->n, r->k, 0);
    matmul(r, tensor(r, "attn_v", l), r->xn, r->n, r->v, 0);
    rope(r, r->q, hp->n_heads);
    rope(r, r->k, hp->n_kv_heads);
    attention(r);
    matmul(r, tensor(r, "attn_output", l), r->att, r->n, r->tmp, 0);
    for (size_t i = 0; i < r->n * E; i++)
        r->x[i] += r->tmp[i];
    rmsnorm(r, r->x, tensor(r, "ffn_norm", l), r->xn, r->n);
    matmul(r, tensor(r, "ffn_gate", l), r->xn, r->n, r->gate, 0);
    matmul(r, tensor(r, "ffn_up", l), r->xn, r->n, r->up, 0);
    for (size_t i = 0; i < r->n * F; i++)
        r->gate[i] = r->gate[i] / (1.0f + expf(-r->gate[i])) * r->up[i];
    matmul(r, tensor(r, "ffn_down", l), r->gate, r->n, r->tmp, 0);
    for (size_t i = 0; i < r->n * E; i++)
        r->x[i] += r->tmp[i];
}

/* Gemma 3's tanh GELU. */
static float gelu(float x)
{
    return 0.5f * x * (1.0f + tanhf(0.7978845608f * (x + 0.044715f * x * x * x)));
}

/* x += rmsnorm(in) * w (Gemma's post-norm of a block's output). */
static void add_post_norm(ref_t *r, const tdm_gguf_tensor_t *w)
{
    const size_t E = r->hp->n_embd;
    rmsnorm(r, r->tmp, w, r->tmp, r->n);
    for (size_t i = 0; i < r->n * E; i++)
        r->x[i] += r->tmp[i];
}

/* A Gemma 3 layer (llama.cpp's src/models/gemma3.cpp): per-head Q/K norms, neox rope with the
 * layer's theta, q scaled by attn_q_scale (1/sqrt(head_dim): attention() already divides by
 * it), post-norms on both blocks' outputs, a GELU-gated FFN. The prompt is shorter than the
 * sliding window, so the local layers see every key. */
static void ref_layer_gemma3(ref_t *r, uint32_t l)
{
    const tdm_llama_hparams_t *hp = r->hp;
    const size_t F = hp->n_ff, d = hp->head_dim;
    assert_true(hp->n_swa == 0 || r->n <= hp->n_swa);
    assert_true(fabsf(hp->attn_q_scale * sqrtf((float)d) - 1.0f) < 1e-6f);
    rmsnorm(r, r->x, tensor(r, "attn_norm", l), r->xn, r->n);
    matmul(r, tensor(r, "attn_q", l), r->xn, r->n, r->q, 0);
    matmul(r, tensor(r, "attn_k", l), r->xn, r->n, r->k, 0);
    matmul(r, tensor(r, "attn_v", l), r->xn, r->n, r->v, 0);
    /* rmsnorm() normalises n_embd values: the heads go through a view of head_dim */
    tdm_llama_hparams_t head = *hp;
    head.n_embd = (uint32_t)d;
    const tdm_llama_hparams_t *saved = r->hp;
    r->hp = &head;
    rmsnorm(r, r->q, tensor(r, "attn_q_norm", l), r->q, r->n * hp->n_heads);
    rmsnorm(r, r->k, tensor(r, "attn_k_norm", l), r->k, r->n * hp->n_kv_heads);
    r->hp = saved;
    rope_neox(r, r->q, hp->n_heads, l);
    rope_neox(r, r->k, hp->n_kv_heads, l);
    attention(r);
    matmul(r, tensor(r, "attn_output", l), r->att, r->n, r->tmp, 0);
    add_post_norm(r, tensor(r, "post_attention_norm", l));
    rmsnorm(r, r->x, tensor(r, "ffn_norm", l), r->xn, r->n);
    matmul(r, tensor(r, "ffn_gate", l), r->xn, r->n, r->gate, 0);
    matmul(r, tensor(r, "ffn_up", l), r->xn, r->n, r->up, 0);
    for (size_t i = 0; i < r->n * F; i++)
        r->gate[i] = gelu(r->gate[i]) * r->up[i];
    matmul(r, tensor(r, "ffn_down", l), r->gate, r->n, r->tmp, 0);
    add_post_norm(r, tensor(r, "post_ffw_norm", l));
}

/* Phi-3's neox rope with LongRoPE: pair i's angle divided by factor ff[i] (the set the engine's
 * context picks), cos and sin times the attention factor m. */
static void rope_phi3(const ref_t *r, float *v, uint32_t n_heads, const float *ff, float m)
{
    const uint32_t d = r->hp->head_dim;
    for (uint32_t t = 0; t < r->n; t++)
        for (uint32_t h = 0; h < n_heads; h++)
            for (uint32_t i = 0; i < d / 2; i++) {
                const double a = t * pow(r->hp->rope_freq_base, -2.0 * i / d) / ff[i];
                float *p = v + ((size_t)t * n_heads + h) * d + i;
                const float x0 = p[0], x1 = p[d / 2];
                p[0] = (float)(m * (x0 * cos(a) - x1 * sin(a)));
                p[d / 2] = (float)(m * (x0 * sin(a) + x1 * cos(a)));
            }
}

/* A Phi-3 layer (llama.cpp's src/models/phi3.cpp) from the fused tensors themselves: attn_qkv's
 * output split into q, k and v; rope_phi3 with the short factors (the engine's 256-token
 * context is under the 1024 original); attention scaled by 1/sqrt(head_dim) (llama.cpp scales
 * q by it: the same product); ffn_up's output split into the gate and up halves. */
static void ref_layer_phi3(ref_t *r, uint32_t l)
{
    const tdm_llama_hparams_t *hp = r->hp;
    const size_t E = hp->n_embd, F = hp->n_ff, Q = (size_t)hp->n_heads * hp->head_dim;
    const size_t KV = (size_t)hp->n_kv_heads * hp->head_dim, W = Q + 2 * KV;
    assert_true(hp->n_ctx_orig >= 256 && hp->n_rope_long_short == hp->head_dim / 2);
    float *qkv = malloc(r->n * (W > 2 * F ? W : 2 * F) * sizeof *qkv);
    assert_non_null(qkv);
    rmsnorm(r, r->x, tensor(r, "attn_norm", l), r->xn, r->n);
    matmul(r, tensor(r, "attn_qkv", l), r->xn, r->n, qkv, 0);
    for (uint32_t t = 0; t < r->n; t++) {
        memcpy(r->q + t * Q, qkv + t * W, Q * sizeof *qkv);
        memcpy(r->k + t * KV, qkv + t * W + Q, KV * sizeof *qkv);
        memcpy(r->v + t * KV, qkv + t * W + Q + KV, KV * sizeof *qkv);
    }
    rope_phi3(r, r->q, hp->n_heads, hp->rope_factors_short, hp->rope_attn_factor);
    rope_phi3(r, r->k, hp->n_kv_heads, hp->rope_factors_short, hp->rope_attn_factor);
    attention(r);
    matmul(r, tensor(r, "attn_output", l), r->att, r->n, r->tmp, 0);
    for (size_t i = 0; i < r->n * E; i++)
        r->x[i] += r->tmp[i];
    rmsnorm(r, r->x, tensor(r, "ffn_norm", l), r->xn, r->n);
    matmul(r, tensor(r, "ffn_up", l), r->xn, r->n, qkv, 0);
    for (uint32_t t = 0; t < r->n; t++)
        for (size_t i = 0; i < F; i++) {
            const float g = qkv[t * 2 * F + i], u = qkv[t * 2 * F + F + i];
            r->gate[t * F + i] = g / (1.0f + expf(-g)) * u;
        }
    matmul(r, tensor(r, "ffn_down", l), r->gate, r->n, r->tmp, 0);
    for (size_t i = 0; i < r->n * E; i++)
        r->x[i] += r->tmp[i];
    free(qkv);
}

static void ref_alloc(ref_t *r, const tdm_model_t *m)
{
    r->g = tdm_model_gguf(m);
    r->hp = tdm_model_hparams(m);
    r->n = N_PROMPT;
    const size_t E = r->hp->n_embd, F = r->hp->n_ff, Q = r->hp->n_heads * r->hp->head_dim;
    const size_t KV = r->hp->n_kv_heads * r->hp->head_dim, n = r->n;
    r->x = malloc(n * E * 4), r->xn = malloc(n * E * 4), r->tmp = malloc(n * E * 4);
    r->q = malloc(n * Q * 4), r->att = malloc(n * Q * 4);
    r->k = malloc(n * KV * 4), r->v = malloc(n * KV * 4);
    r->gate = malloc(n * F * 4), r->up = malloc(n * F * 4);
    r->row = malloc((F > E ? (F > Q ? F : Q) : (E > Q ? E : Q)) * 4);
    assert_true(r->x && r->xn && r->tmp && r->q && r->att && r->k && r->v && r->gate && r->up &&
                r->row);
}

static void ref_free(ref_t *r)
{
    free(r->x), free(r->xn), free(r->tmp), free(r->q), free(r->att);
    free(r->k), free(r->v), free(r->gate), free(r->up), free(r->row);
}

/* Runs the reference over tokens, checking the RMS of the embedding and of every layer's
 * output; writes the last token's logits[n_vocab]. */
static void ref_run(ref_t *r, const int32_t *tokens, float *logits)
{
    const tdm_gguf_tensor_t *embd = tdm_gguf_find_tensor(r->g, "token_embd.weight");
    const size_t E = r->hp->n_embd, rb = tdm_ggml_row_size(embd->type, E);
    for (uint32_t t = 0; t < r->n; t++)
        tdm_ggml_dequantize_row(embd->type, (const uint8_t *)embd->data + tokens[t] * rb,
                                r->x + t * E, (int64_t)E);
    const bool gemma = strcmp(r->hp->arch, "gemma3") == 0;
    for (size_t i = 0; gemma && i < r->n * E; i++)
        r->x[i] *= r->hp->embd_scale;
    check_rms(r, "embedding");
    for (uint32_t l = 0; l < r->hp->n_layers; l++) {
        if (gemma)
            ref_layer_gemma3(r, l);
        else if (strcmp(r->hp->arch, "phi3") == 0)
            ref_layer_phi3(r, l);
        else
            ref_layer(r, l);
        char where[32];
        snprintf(where, sizeof where, "layer %u", l);
        check_rms(r, where);
    }
    const tdm_gguf_tensor_t *out = tdm_gguf_find_tensor(r->g, "output.weight");
    rmsnorm(r, r->x + (r->n - 1) * E, tdm_gguf_find_tensor(r->g, "output_norm.weight"), r->xn, 1);
    matmul(r, out ? out : embd, r->xn, 1, logits, 0);
}

/* ---- the checks ---- */

/* Loads path, checks its shape, runs the reference and the engine on a fixed prompt: every
 * hidden-state RMS in [0.1, 10], the engine's last logits within 10% (RMS) of the
 * reference's, with the logits' spread neither flat nor extreme. */
static void check_model(const char *path, const tdm_llama_hparams_t *want)
{
    tdm_test_engine_t f;
    tdm_test_engine_open(&f, path, TDM_KV_F16, 256);
    const tdm_llama_hparams_t *hp = tdm_model_hparams(f.model);
    assert_int_equal(hp->n_vocab, want->n_vocab);
    assert_int_equal(hp->n_embd, want->n_embd);
    assert_int_equal(hp->n_ff, want->n_ff);
    assert_int_equal(hp->n_layers, want->n_layers);
    assert_int_equal(hp->n_heads, want->n_heads);
    assert_int_equal(hp->n_kv_heads, want->n_kv_heads);
    assert_int_equal(hp->head_dim, want->head_dim);
    assert_int_equal(hp->n_ctx_train, want->n_ctx_train);
    assert_true(hp->rope_freq_base == want->rope_freq_base);
    assert_int_equal(hp->tied_embeddings, want->tied_embeddings);

    int32_t tokens[N_PROMPT];
    tdm_test_random_tokens(tokens, N_PROMPT, 512, 7); /* ids of the tiny vocabulary */
    tdm_test_seq_t s;
    uint32_t n = N_PROMPT;
    tdm_test_seq_start(&f, &s, tokens, n);
    tdm_test_run_together(&f, &s, 1, &n);
    ref_t r;
    ref_alloc(&r, f.model);
    float *logits = malloc((size_t)hp->n_vocab * sizeof *logits);
    assert_non_null(logits);
    ref_run(&r, tokens, logits);
    const float *eng = s.logits + (size_t)(N_PROMPT - 1) * hp->n_vocab;
    double d2 = 0, l2 = 0;
    for (uint32_t i = 0; i < hp->n_vocab; i++) {
        d2 += (double)(eng[i] - logits[i]) * (eng[i] - logits[i]);
        l2 += (double)logits[i] * logits[i];
    }
    const double sd = sqrt(l2 / hp->n_vocab), rel = sqrt(d2 / l2);
    printf("  logits: std %.3f, engine vs reference RMS difference %.4f\n", sd, rel);
    assert_true(rel < 0.1);
    assert_true(sd > 0.5 && sd < 8.0);
    free(logits);
    ref_free(&r);
    tdm_test_seq_end(&f, &s);
    tdm_test_engine_close(&f);
}

/* The tiny model's vocabulary as a vocabulary-only file: dir/vocab.gguf. */
static void test_vocab_only(void **state)
{
    (void)state;
    char tiny[128], vocab[128], args[512];
    path_in(tiny, sizeof tiny, "tiny.gguf");
    path_in(vocab, sizeof vocab, "vocab.gguf");
    tdm_error_t err = {0};
    assert_int_equal(tdm_test_write_tiny_llama(tiny, NULL, &err), TDM_OK);
    snprintf(args, sizeof args, "--vocab-only -m '%s' -o '%s'", tiny, vocab);
    assert_int_equal(synth("", args), 0);
    tdm_gguf_t *g = tdm_gguf_open(vocab, &err), *m = tdm_gguf_open(tiny, &err);
    assert_non_null(g);
    assert_non_null(m);
    assert_int_equal(tdm_gguf_n_tensors(g), 0);
    const tdm_gguf_kv_t *a, *b;
    assert_int_equal(tdm_gguf_get_arr(g, "tokenizer.ggml.merges", TDM_GGUF_VTYPE_STRING, &a, &err),
                     0);
    assert_int_equal(tdm_gguf_get_arr(m, "tokenizer.ggml.merges", TDM_GGUF_VTYPE_STRING, &b, &err),
                     0);
    assert_int_equal(a->arr_n, b->arr_n);
    assert_memory_equal(a->arr_strs[5].data, b->arr_strs[5].data, b->arr_strs[5].len);
    uint32_t eos = 0;
    assert_int_equal(tdm_gguf_get_u32(g, "tokenizer.ggml.eos_token_id", &eos, &err), 0);
    assert_int_equal(eos, 511);
    tdm_gguf_destroy(&g);
    tdm_gguf_destroy(&m);
}

/* SmolLM2-135M's shape, all 30 layers, Q8_0; the vocabulary padded from 512 to 49152. */
static void test_smollm2_135m(void **state)
{
    (void)state;
    char vocab[128], out[128], args[512];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(out, sizeof out, "smollm2.gguf");
    snprintf(args, sizeof args, "--shape smollm2-135m --type Q8_0 --vocab '%s' -o '%s'", vocab,
             out);
    assert_int_equal(synth("", args), 0);
    const tdm_llama_hparams_t want = {.n_vocab = 49152,
                                      .n_ctx_train = 8192,
                                      .n_embd = 576,
                                      .n_layers = 30,
                                      .n_heads = 9,
                                      .n_kv_heads = 3,
                                      .head_dim = 64,
                                      .n_ff = 1536,
                                      .rope_freq_base = 100000.0f,
                                      .tied_embeddings = true};
    check_model(out, &want);

    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(out, &err);
    assert_non_null(g);
    const tdm_gguf_kv_t *toks, *types;
    assert_int_equal(
        tdm_gguf_get_arr(g, "tokenizer.ggml.tokens", TDM_GGUF_VTYPE_STRING, &toks, &err), 0);
    assert_int_equal(
        tdm_gguf_get_arr(g, "tokenizer.ggml.token_type", TDM_GGUF_VTYPE_COUNT, &types, &err), 0);
    assert_int_equal(toks->arr_n, 49152);
    assert_int_equal(types->arr_n, 49152);
    assert_int_equal(toks->arr_strs[600].len, strlen("<|synth_pad_600|>"));
    assert_memory_equal(toks->arr_strs[600].data, "<|synth_pad_600|>", toks->arr_strs[600].len);
    assert_int_equal(tdm_gguf_arr_int(types, 600), 5);
    assert_int_equal(tdm_gguf_find_tensor(g, "blk.3.ffn_up.weight")->type, TDM_GGML_TYPE_Q8_0);
    assert_null(tdm_gguf_find_tensor(g, "output.weight"));
    tdm_gguf_destroy(&g);
    unlink(out);
}

/* Llama 3.2 1B's shape (GQA 4:1, theta 500000, 128256 tokens), 2 of its 16 layers, Q4_1. */
static void test_llama_1b_cut(void **state)
{
    (void)state;
    char vocab[128], out[128], args[512];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(out, sizeof out, "llama1b.gguf");
    snprintf(args, sizeof args, "--shape llama-3.2-1b --type Q4_1 --layers 2 --vocab '%s' -o '%s'",
             vocab, out);
    assert_int_equal(synth("", args), 0);
    const tdm_llama_hparams_t want = {.n_vocab = 128256,
                                      .n_ctx_train = 131072,
                                      .n_embd = 2048,
                                      .n_layers = 2,
                                      .n_heads = 32,
                                      .n_kv_heads = 8,
                                      .head_dim = 64,
                                      .n_ff = 8192,
                                      .rope_freq_base = 500000.0f,
                                      .tied_embeddings = true};
    check_model(out, &want);
    unlink(out);
}

/* Checks path's Gemma 3 metadata and extra tensors: the sliding window (every 6th layer
 * global), the scales, the Q/K norms [head_dim] and post-norms [n_embd] in F32, no output. */
static void check_gemma3_file(const char *path, uint32_t n_swa)
{
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(path, &err);
    assert_non_null(g);
    tdm_llama_hparams_t hp;
    assert_int_equal(tdm_gguf_llama_hparams(g, &hp, &err), TDM_OK);
    assert_string_equal(hp.arch, "gemma3");
    assert_int_equal(hp.n_swa, n_swa);
    for (uint32_t l = 0; l < hp.n_layers; l++)
        assert_int_equal(hp.swa_layers[l], l % 6 != 5);
    assert_true(hp.rope_freq_base_swa == 10000.0f);
    assert_true(fabsf(hp.embd_scale - sqrtf((float)hp.n_embd)) < 1e-4f);
    assert_true(fabsf(hp.rms_norm_eps - 1e-6f) < 1e-12f);
    const char *extra[] = {"attn_q_norm", "attn_k_norm", "post_attention_norm", "post_ffw_norm"};
    for (int i = 0; i < 4; i++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%u.%s.weight", hp.n_layers - 1, extra[i]);
        const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(g, name);
        assert_non_null(t);
        assert_int_equal(t->type, TDM_GGML_TYPE_F32);
        assert_int_equal(t->ne[0], i < 2 ? hp.head_dim : hp.n_embd);
    }
    assert_null(tdm_gguf_find_tensor(g, "output.weight"));
    tdm_gguf_destroy(&g);
}

/* The Gemma 3 miniature the golden tests use (6 layers, one global), Q8_0: hidden-state RMS,
 * the engine against the float reference (embedding scale, Q/K norms, neox rope, GELU,
 * post-norms), the Gemma metadata. */
static void test_gemma3_tiny(void **state)
{
    (void)state;
    char vocab[128], out[128], args[512];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(out, sizeof out, "gemma3tiny.gguf");
    snprintf(args, sizeof args, "--shape gemma3-tiny --type Q8_0 --vocab '%s' -o '%s'", vocab, out);
    assert_int_equal(synth("", args), 0);
    const tdm_llama_hparams_t want = {.n_vocab = 262144,
                                      .n_ctx_train = 2048,
                                      .n_embd = 128,
                                      .n_layers = 6,
                                      .n_heads = 2,
                                      .n_kv_heads = 1,
                                      .head_dim = 64,
                                      .n_ff = 256,
                                      .rope_freq_base = 1e6f,
                                      .tied_embeddings = true};
    check_model(out, &want);
    check_gemma3_file(out, 32);
    unlink(out);
}

/* phi3-tiny: the engine (fused QKV and gate/up as views of the file's rows, LongRoPE's factors
 * and attention factor, q scaled) against the float reference that splits the fused outputs
 * itself; the Phi-3 hyperparameters; the RoPE factor set each context picks (long only past
 * the 1024-token original context, as llama.cpp's get_rope_factors). */
static void test_phi3_tiny(void **state)
{
    (void)state;
    char vocab[128], out[128], args[512];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(out, sizeof out, "phi3tiny.gguf");
    snprintf(args, sizeof args, "--shape phi3-tiny --type Q8_0 --vocab '%s' -o '%s'", vocab, out);
    assert_int_equal(synth("", args), 0);
    const tdm_llama_hparams_t want = {.n_vocab = 49152,
                                      .n_ctx_train = 8192,
                                      .n_embd = 128,
                                      .n_layers = 4,
                                      .n_heads = 4,
                                      .n_kv_heads = 2,
                                      .head_dim = 32,
                                      .n_ff = 256,
                                      .rope_freq_base = 10000.0f,
                                      .tied_embeddings = false};
    check_model(out, &want);
    tdm_error_t err = {0};
    tdm_model_t *m = tdm_model_load(out, &err);
    assert_non_null(m);
    const tdm_llama_hparams_t *hp = tdm_model_hparams(m);
    assert_true(hp->fused_qkv && hp->fused_gate_up);
    assert_int_equal(hp->rope_type, TDM_ROPE_NEOX);
    assert_int_equal(hp->n_ctx_orig, 1024);
    assert_int_equal(hp->n_rope_long_short, 16);
    assert_int_equal(hp->n_swa, 0); /* the file's 64-token window is ignored */
    /* the converter's attention factor: sqrt(1 + ln(8192 / 1024) / ln(1024)) */
    assert_true(fabsf(hp->rope_attn_factor - sqrtf(1.0f + logf(8.0f) / logf(1024.0f))) < 1e-6f);
    assert_true(fabsf(hp->attn_q_scale - 1.0f / sqrtf(32.0f)) < 1e-7f);
    assert_ptr_equal(tdm_llama_rope_factors(hp, 1024), hp->rope_factors_short);
    assert_ptr_equal(tdm_llama_rope_factors(hp, 1025), hp->rope_factors_long);
    assert_true(hp->rope_factors_short[0] == 1.0f && hp->rope_factors_long[15] > 30.0f);
    tdm_model_destroy(&m);
    unlink(out);
}

/* Gemma 3 270M's shape (head_dim 256 > n_embd / n_heads, window 512), 6 of its 18 layers,
 * Q5_0 as the published file's projections. */
static void test_gemma3_270m_cut(void **state)
{
    (void)state;
    char vocab[128], out[128], args[512];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(out, sizeof out, "gemma3.gguf");
    snprintf(args, sizeof args, "--shape gemma3-270m --type Q5_0 --layers 6 --vocab '%s' -o '%s'",
             vocab, out);
    assert_int_equal(synth("", args), 0);
    const tdm_llama_hparams_t want = {.n_vocab = 262144,
                                      .n_ctx_train = 32768,
                                      .n_embd = 640,
                                      .n_layers = 6,
                                      .n_heads = 4,
                                      .n_kv_heads = 1,
                                      .head_dim = 256,
                                      .n_ff = 2048,
                                      .rope_freq_base = 1e6f,
                                      .tied_embeddings = true};
    check_model(out, &want);
    check_gemma3_file(out, 512);
    unlink(out);
}

/* The last prompt token's logits of path's engine with TANDEM_CPU_KERNELS=kernels (NULL:
 * unset) on the fixed prompt; caller frees. */
static float *engine_logits(const char *path, const char *kernels, uint32_t *n_vocab)
{
    const char *old = getenv("TANDEM_CPU_KERNELS");
    char saved[32] = "";
    if (old)
        snprintf(saved, sizeof saved, "%s", old);
    if (kernels)
        setenv("TANDEM_CPU_KERNELS", kernels, 1);
    else
        unsetenv("TANDEM_CPU_KERNELS");
    tdm_test_engine_t f;
    tdm_test_engine_open(&f, path, TDM_KV_F16, 256);
    if (old)
        setenv("TANDEM_CPU_KERNELS", saved, 1);
    else
        unsetenv("TANDEM_CPU_KERNELS");
    *n_vocab = tdm_model_hparams(f.model)->n_vocab;
    int32_t tokens[N_PROMPT];
    tdm_test_random_tokens(tokens, N_PROMPT, 512, 7);
    tdm_test_seq_t s;
    uint32_t n = N_PROMPT;
    tdm_test_seq_start(&f, &s, tokens, n);
    tdm_test_run_together(&f, &s, 1, &n);
    float *logits = malloc((size_t)*n_vocab * sizeof *logits);
    assert_non_null(logits);
    memcpy(logits, s.logits + (size_t)(N_PROMPT - 1) * *n_vocab, (size_t)*n_vocab * sizeof *logits);
    tdm_test_seq_end(&f, &s);
    tdm_test_engine_close(&f);
    return logits;
}

/* Llama 3.2 1B's shape cut to 1 layer with K-quant projections: the engine (the integer
 * K-quant GEMM) against the float reference (check_model), and against the older f32 path
 * (TANDEM_CPU_KERNELS=f32k: rows dequantized, f32 dots). The two engine paths differ only by
 * the 8-bit activation quantization of the K-quant matmuls: logits within 3% (RMS). */
static void check_kquant(const char *type)
{
    char vocab[128], out[128], args[512];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(out, sizeof out, "kquant.gguf");
    snprintf(args, sizeof args, "--shape llama-3.2-1b --type %s --layers 1 --vocab '%s' -o '%s'",
             type, vocab, out);
    assert_int_equal(synth("", args), 0);
    const tdm_llama_hparams_t want = {.n_vocab = 128256,
                                      .n_ctx_train = 131072,
                                      .n_embd = 2048,
                                      .n_layers = 1,
                                      .n_heads = 32,
                                      .n_kv_heads = 8,
                                      .head_dim = 64,
                                      .n_ff = 8192,
                                      .rope_freq_base = 500000.0f,
                                      .tied_embeddings = true};
    check_model(out, &want);
    uint32_t nv, nv2;
    float *q = engine_logits(out, NULL, &nv), *f = engine_logits(out, "f32k", &nv2);
    assert_int_equal(nv, nv2);
    double d2 = 0, l2 = 0;
    for (uint32_t i = 0; i < nv; i++) {
        d2 += (double)(q[i] - f[i]) * (q[i] - f[i]);
        l2 += (double)f[i] * f[i];
    }
    printf("  %s: integer GEMM vs f32 path, logits RMS difference %.4f\n", type, sqrt(d2 / l2));
    assert_true(sqrt(d2 / l2) < 0.03);
    assert_true(d2 > 0); /* the two paths did run different kernels */
    free(q);
    free(f);
    unlink(out);
}

static void test_kquant(void **state)
{
    (void)state;
    check_kquant("Q4_K");
    check_kquant("Q5_K");
    check_kquant("Q6_K");
    check_kquant("Q2_K");
    check_kquant("Q3_K");
}

static bool same_file(const char *a, const char *b)
{
    char cmd[512];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

/* The same seed gives the same bytes with 1 or 2 threads; another seed, other bytes. */
static void test_deterministic(void **state)
{
    (void)state;
    char vocab[128], a[128], b[128], c[128], args[640];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(a, sizeof a, "a.gguf");
    path_in(b, sizeof b, "b.gguf");
    path_in(c, sizeof c, "c.gguf");
#define SMALL "--shape smollm2-360m --type Q4_0 --layers 1 --seed %d --vocab '%s' -o '%s'"
    snprintf(args, sizeof args, SMALL, 5, vocab, a);
    assert_int_equal(synth("OMP_NUM_THREADS=1", args), 0);
    snprintf(args, sizeof args, SMALL, 5, vocab, b);
    assert_int_equal(synth("OMP_NUM_THREADS=2", args), 0);
    snprintf(args, sizeof args, SMALL, 6, vocab, c);
    assert_int_equal(synth("", args), 0);
#undef SMALL
    assert_true(same_file(a, b));
    assert_false(same_file(a, c));
    unlink(a), unlink(b), unlink(c);
}

/* The expert shapes: llama.cpp's tensor names, shapes and keys (qwen3moe with --experts and
 * --experts-used; Mixtral as llama with experts), and the files load with those counts. */
static void test_moe(void **state)
{
    (void)state;
    char vocab[128], out[128], args[512];
    path_in(vocab, sizeof vocab, "vocab.gguf");
    path_in(out, sizeof out, "moe.gguf");
    snprintf(args, sizeof args,
             "--arch qwen3moe --experts 4 --experts-used 3 --type Q8_0 --vocab '%s' -o '%s'", vocab,
             out);
    assert_int_equal(synth("", args), 0);
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(out, &err);
    assert_non_null(g);
    uint32_t v = 0;
    assert_int_equal(tdm_gguf_get_u32(g, "qwen3moe.expert_count", &v, &err), TDM_OK);
    assert_int_equal(v, 4);
    assert_int_equal(tdm_gguf_get_u32(g, "qwen3moe.expert_used_count", &v, &err), TDM_OK);
    assert_int_equal(v, 3);
    assert_int_equal(tdm_gguf_get_u32(g, "qwen3moe.expert_feed_forward_length", &v, &err), TDM_OK);
    assert_int_equal(v, 128);
    const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(g, "blk.3.ffn_gate_inp.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TDM_GGML_TYPE_F32);
    assert_int_equal(t->ne[0], 128);
    assert_int_equal(t->ne[1], 4);
    t = tdm_gguf_find_tensor(g, "blk.3.ffn_down_exps.weight");
    assert_non_null(t);
    assert_int_equal(t->type, TDM_GGML_TYPE_Q8_0);
    assert_int_equal(t->ne[0], 128);
    assert_int_equal(t->ne[1], 128);
    assert_int_equal(t->ne[2], 4);
    assert_non_null(tdm_gguf_find_tensor(g, "blk.0.ffn_up_exps.weight"));
    assert_null(tdm_gguf_find_tensor(g, "blk.0.ffn_gate.weight"));
    tdm_gguf_destroy(&g);
    tdm_model_t *m = tdm_model_load(out, &err);
    assert_non_null(m);
    assert_string_equal(tdm_model_hparams(m)->arch, "qwen3moe");
    assert_int_equal(tdm_model_hparams(m)->n_expert_used, 3);
    assert_int_equal(tdm_model_hparams(m)->n_ff_exp, 128);
    tdm_model_destroy(&m);
    snprintf(args, sizeof args, "--shape mixtral-tiny --type F16 --vocab '%s' -o '%s'", vocab, out);
    assert_int_equal(synth("", args), 0);
    m = tdm_model_load(out, &err);
    assert_non_null(m);
    assert_string_equal(tdm_model_hparams(m)->arch, "llama");
    assert_int_equal(tdm_model_hparams(m)->n_expert, 8);
    assert_int_equal(tdm_model_hparams(m)->n_expert_used, 2);
    assert_int_equal(tdm_model_hparams(m)->n_ff_exp, 256);
    assert_false(tdm_model_hparams(m)->tied_embeddings);
    tdm_model_destroy(&m);
    unlink(out);
    /* flags that do not apply, and counts out of range, are usage errors (exit 2) */
    const char *bad[] = {"--arch qwen3 --experts 4",
                         "--shape llama3-tiny --experts-used 2",
                         "--arch mixtral --experts 4 --experts-used 5",
                         "--arch gpt-5",
                         "--arch qwen3moe --shape qwen3moe-tiny",
                         "--arch qwen3moe --experts 0"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(args, sizeof args, "%s --type F16 --vocab '%s' -o '%s' 2>/dev/null", bad[i], vocab,
                 out);
        if (synth("", args) != 2)
            fail_msg("'%s' was not a usage error", bad[i]);
        assert_int_equal(access(out, F_OK), -1);
    }
    /* a type whose blocks do not fit the shape's rows (K-quants: 256 values) is one too */
    snprintf(args, sizeof args, "--arch qwen3 --type Q2_K --vocab '%s' -o '%s' 2>/dev/null", vocab,
             out);
    assert_int_equal(synth("", args), 2);
    assert_int_equal(access(out, F_OK), -1);
}

static void test_usage(void **state)
{
    (void)state;
    char out[128], args[256];
    path_in(out, sizeof out, "bad.gguf");
    snprintf(args, sizeof args, "--shape gpt-5 --type Q4_1 -o '%s' 2>/dev/null", out);
    assert_int_equal(synth("", args), 2);
    snprintf(args, sizeof args, "--shape smollm2-135m --type Q8_K -o '%s' 2>/dev/null", out);
    assert_int_equal(synth("", args), 2);
    assert_int_equal(synth("", "--shape smollm2-135m --type Q4_1 2>/dev/null"), 2);
    snprintf(args, sizeof args, "--shape smollm2-135m --type Q4_K -o '%s' 2>/dev/null", out);
    assert_int_equal(synth("", args), 2); /* 576 is not a multiple of 256: bad usage */
    snprintf(args, sizeof args,
             "--shape smollm2-135m --type Q4_1 --vocab /nonexistent -o '%s' "
             "2>/dev/null",
             out);
    assert_int_equal(synth("", args), 1);
    assert_int_equal(access(out, F_OK), -1);
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/tdm-synth-XXXXXX");
    return mkdtemp(dir) ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_vocab_only),   cmocka_unit_test(test_smollm2_135m),
        cmocka_unit_test(test_llama_1b_cut), cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_usage),        cmocka_unit_test(test_kquant),
        cmocka_unit_test(test_gemma3_tiny),  cmocka_unit_test(test_gemma3_270m_cut),
        cmocka_unit_test(test_phi3_tiny),    cmocka_unit_test(test_moe),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
