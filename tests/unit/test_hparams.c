/* test_hparams.c - a model whose metadata or tensors ask for what the engine does not compute
 * is refused at load, naming the key or tensor (common/src/gguf/hparams_refuse.c); what Tandem
 * implements (linear RoPE scaling, harmless keys, the RoPE attention factor, Phi-3's fused
 * projections and factors) loads and changes the output as it should.
 *
 * Each case builds a tiny Llama GGUF in memory (tests/support/tiny_model.h), adds one key or
 * tensor, and loads it from a file as a node would.
 */
#include "tdm_test.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem/gguf.h"
#include "tandem/model.h"
#include "tiny_model.h"

/* A tiny model with one change applied by edit(w); returns the loaded model or NULL with
 * *err. */
typedef int (*edit_fn)(tdm_gguf_writer_t *w);

static tdm_model_t *load_edited_spec(const tdm_tiny_llama_spec_t *spec_in, edit_fn edit,
                                     tdm_error_t *err)
{
    tdm_gguf_writer_t *w = NULL;
    tdm_tiny_llama_spec_t spec = *spec_in;
    assert_int_equal(tdm_test_tiny_llama_build(&spec, &w, err), TDM_OK);
    if (edit)
        assert_int_equal(edit(w), TDM_OK);
    char path[] = "/tmp/tandem-test-hparams-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(tdm_gguf_writer_write_file(w, path, err), TDM_OK);
    tdm_gguf_writer_destroy(&w);
    tdm_model_t *m = tdm_model_load(path, err);
    unlink(path);
    return m;
}

static tdm_model_t *load_edited(edit_fn edit, tdm_error_t *err)
{
    const tdm_tiny_llama_spec_t spec = {.n_layers = 2, .tied_embeddings = true};
    return load_edited_spec(&spec, edit, err);
}

/* The load of spec's model edited by edit fails with code and a message holding want1 and
 * want2 (when not NULL). */
static void expect_error_spec(const tdm_tiny_llama_spec_t *spec, edit_fn edit, int code,
                              const char *want1, const char *want2)
{
    tdm_error_t err = {0};
    tdm_model_t *m = load_edited_spec(spec, edit, &err);
    if (m) {
        tdm_model_destroy(&m);
        fail_msg("the model loaded; expected an error naming '%s'", want1);
    }
    assert_int_equal(err.code, code);
    if (!strstr(err.msg, want1) || (want2 && !strstr(err.msg, want2)))
        fail_msg("message \"%s\" lacks '%s'%s%s", err.msg, want1, want2 ? " or " : "",
                 want2 ? want2 : "");
}

/* The load fails with TDM_EINVALID and a message holding every string of want. */
static void expect_refused(edit_fn edit, const char *want1, const char *want2)
{
    tdm_error_t err = {0};
    tdm_model_t *m = load_edited(edit, &err);
    if (m) {
        tdm_model_destroy(&m);
        fail_msg("the model loaded; expected a refusal naming '%s'", want1);
    }
    assert_int_equal(err.code, TDM_EINVALID);
    if (!strstr(err.msg, want1) || (want2 && !strstr(err.msg, want2)))
        fail_msg("message \"%s\" lacks '%s'%s%s", err.msg, want1, want2 ? " or " : "",
                 want2 ? want2 : "");
}

static int add_vector(tdm_gguf_writer_t *w, const char *name, uint64_t n)
{
    float *v = calloc(n, sizeof *v);
    if (!v)
        return TDM_ERESOURCE;
    uint64_t ne[1] = {n};
    int rc = tdm_gguf_writer_add_tensor(w, name, TDM_GGML_TYPE_F32, 1, ne, v);
    free(v);
    return rc;
}

static int add_matrix(tdm_gguf_writer_t *w, const char *name, uint64_t n_in, uint64_t n_out)
{
    float *v = calloc(n_in * n_out, sizeof *v);
    if (!v)
        return TDM_ERESOURCE;
    uint64_t ne[2] = {n_in, n_out};
    int rc = tdm_gguf_writer_add_tensor(w, name, TDM_GGML_TYPE_F32, 2, ne, v);
    free(v);
    return rc;
}

/* rope_freqs.weight (Llama 3.x's frequency factors): g_rope_half values of g_rope_factor (the
 * tiny model's rope_dim / 2, read from it first), or a shape that does not fit. */
static uint64_t g_rope_half = 8;
static float g_rope_factor;

static int edit_rope_freqs(tdm_gguf_writer_t *w)
{
    float v[TDM_GGUF_MAX_ROPE_FREQS];
    for (uint64_t i = 0; i < g_rope_half; i++)
        v[i] = g_rope_factor;
    uint64_t ne[1] = {g_rope_half};
    return tdm_gguf_writer_add_tensor(w, "rope_freqs.weight", TDM_GGML_TYPE_F32, 1, ne, v);
}

static int edit_rope_freqs_short(tdm_gguf_writer_t *w)
{
    return add_vector(w, "rope_freqs.weight", g_rope_half - 1);
}

static int edit_yarn(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_str(w, "llama.rope.scaling.type", "yarn") ||
           tdm_gguf_writer_set_f32(w, "llama.rope.scaling.factor", 4.0f);
}

static int edit_yarn_key(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_f32(w, "llama.rope.scaling.yarn_beta_fast", 32.0f);
}

static int edit_attn_factor(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_f32(w, "llama.rope.scaling.attn_factor", 1.5f);
}

static int edit_attn_factor_zero(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_f32(w, "llama.rope.scaling.attn_factor", 0.0f);
}

static int edit_phi3_factors_on_llama(tdm_gguf_writer_t *w)
{
    return add_vector(w, "rope_factors_long.weight", 8);
}

static int edit_sliding_window(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.attention.sliding_window", 64);
}

static int edit_attn_softcap(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_f32(w, "llama.attn_logit_softcapping", 50.0f);
}

static int edit_final_softcap(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_f32(w, "llama.final_logit_softcapping", 30.0f);
}

static int edit_experts(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.expert_count", 8) ||
           tdm_gguf_writer_set_u32(w, "llama.expert_used_count", 2);
}

static int edit_expert_tensor(tdm_gguf_writer_t *w)
{
    return add_matrix(w, "blk.0.ffn_gate_inp.weight", 64, 8);
}

static int add_experts3(tdm_gguf_writer_t *w, const char *name, uint64_t n_in, uint64_t n_out,
                        uint64_t n_expert)
{
    float *v = calloc(n_in * n_out * n_expert, sizeof *v);
    if (!v)
        return TDM_ERESOURCE;
    uint64_t ne[3] = {n_in, n_out, n_expert};
    int rc = tdm_gguf_writer_add_tensor(w, name, TDM_GGML_TYPE_F32, 3, ne, v);
    free(v);
    return rc;
}

static int edit_expert_used_0(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.expert_used_count", 0);
}

static int edit_expert_used_9(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.expert_used_count", 9);
}

static int edit_expert_count_600(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.expert_count", 600);
}

static int edit_expert_used_only(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.expert_used_count", 2);
}

/* experts declared, the router right, the gate experts stacked 4 deep instead of 8 */
static int edit_experts_bad_shape(tdm_gguf_writer_t *w)
{
    return edit_experts(w) || add_matrix(w, "blk.0.ffn_gate_inp.weight", 64, 8) ||
           add_experts3(w, "blk.0.ffn_gate_exps.weight", 64, 128, 4);
}

static int edit_moe_ffn_feed_key(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.expert_feed_forward_length", 64);
}

/* A tiny Mixtral-style llama turned into a qwen3moe file: the qwen3moe.* keys (the llama.*
 * ones stay and are ignored, as llama.cpp ignores another architecture's keys) and the
 * QK-norms; expert counts as the edit after it sets them. */
static int edit_qwen3moe_base(tdm_gguf_writer_t *w)
{
    const struct {
        const char *key;
        uint32_t v;
    } keys[] = {{"qwen3moe.context_length", 256},     {"qwen3moe.embedding_length", 64},
                {"qwen3moe.block_count", 2},          {"qwen3moe.feed_forward_length", 512},
                {"qwen3moe.attention.head_count", 4}, {"qwen3moe.attention.head_count_kv", 2}};
    int rc = tdm_gguf_writer_set_str(w, "general.architecture", "qwen3moe") ||
             tdm_gguf_writer_set_f32(w, "qwen3moe.attention.layer_norm_rms_epsilon", 1e-6f);
    for (size_t i = 0; i < sizeof keys / sizeof keys[0] && rc == TDM_OK; i++)
        rc = tdm_gguf_writer_set_u32(w, keys[i].key, keys[i].v);
    for (int l = 0; l < 2 && rc == TDM_OK; l++) {
        char name[64];
        snprintf(name, sizeof name, "blk.%d.attn_q_norm.weight", l);
        rc = add_vector(w, name, 16);
        snprintf(name, sizeof name, "blk.%d.attn_k_norm.weight", l);
        rc = rc ? rc : add_vector(w, name, 16);
    }
    return rc;
}

static int edit_qwen3moe_ok(tdm_gguf_writer_t *w)
{
    /* n_ff_exp from feed_forward_length / expert_used_count = 512 / 4 = 128 (llama.cpp's
     * default when expert_feed_forward_length is absent) */
    return edit_qwen3moe_base(w) || tdm_gguf_writer_set_u32(w, "qwen3moe.expert_count", 8) ||
           tdm_gguf_writer_set_u32(w, "qwen3moe.expert_used_count", 4);
}

static int edit_qwen3moe_ffn_key(tdm_gguf_writer_t *w)
{
    return edit_qwen3moe_ok(w) ||
           tdm_gguf_writer_set_u32(w, "qwen3moe.expert_feed_forward_length", 128);
}

static int edit_qwen3moe_ffn_key_bad(tdm_gguf_writer_t *w)
{
    return edit_qwen3moe_ok(w) ||
           tdm_gguf_writer_set_u32(w, "qwen3moe.expert_feed_forward_length", 96);
}

static int edit_qwen3moe_no_count(tdm_gguf_writer_t *w)
{
    return edit_qwen3moe_base(w) || tdm_gguf_writer_set_u32(w, "qwen3moe.expert_used_count", 2);
}

static int edit_qwen3moe_count_0(tdm_gguf_writer_t *w)
{
    return edit_qwen3moe_no_count(w) || tdm_gguf_writer_set_u32(w, "qwen3moe.expert_count", 0);
}

static int edit_qwen3moe_no_used(tdm_gguf_writer_t *w)
{
    return edit_qwen3moe_base(w) || tdm_gguf_writer_set_u32(w, "qwen3moe.expert_count", 8);
}

/* qwen3moe: loads with its defaults; without experts, or without expert_used_count, it fails
 * naming the key; an expert hidden size the tensors do not have fails naming the tensor. */
static void test_qwen3moe_errors(void **state)
{
    (void)state;
    const tdm_tiny_llama_spec_t moe = {.n_layers = 2, .n_expert = 8, .n_expert_used = 2};
    tdm_error_t err = {0};
    edit_fn ok[] = {edit_qwen3moe_ok, edit_qwen3moe_ffn_key};
    for (size_t i = 0; i < 2; i++) {
        tdm_model_t *m = load_edited_spec(&moe, ok[i], &err);
        if (!m)
            fail_msg("qwen3moe case %zu: %s", i, err.msg);
        const tdm_llama_hparams_t *hp = tdm_model_hparams(m);
        assert_string_equal(hp->arch, "qwen3moe");
        assert_true(hp->qk_norm);
        assert_int_equal(hp->n_expert, 8);
        assert_int_equal(hp->n_expert_used, 4);
        assert_int_equal(hp->n_ff_exp, 128);
        tdm_model_destroy(&m);
    }
    expect_error_spec(&moe, edit_qwen3moe_no_count, TDM_ENOTFOUND, "'qwen3moe.expert_count'",
                      "is missing: a qwen3moe model needs experts");
    expect_error_spec(&moe, edit_qwen3moe_count_0, TDM_EINVALID, "'qwen3moe.expert_count'", "is 0");
    expect_error_spec(&moe, edit_qwen3moe_no_used, TDM_ENOTFOUND, "'qwen3moe.expert_used_count'",
                      "is missing");
    expect_error_spec(&moe, edit_qwen3moe_ffn_key_bad, TDM_EINVALID, "'blk.0.ffn_gate_exps.weight'",
                      "expected [64, 96, 8]");
}

/* Mixture-of-experts models (a tiny Mixtral-style llama, 8 experts, 2 used) with bad expert
 * metadata or tensors fail naming the key or tensor; expert keys or tensors a dense model
 * cannot use are refused (test_refusals). */
static void test_expert_errors(void **state)
{
    (void)state;
    const tdm_tiny_llama_spec_t moe = {.n_layers = 2, .n_expert = 8, .n_expert_used = 2};
    const tdm_tiny_llama_spec_t dense = {.n_layers = 2, .tied_embeddings = true};
    tdm_error_t err = {0};
    tdm_model_t *m = load_edited_spec(&moe, NULL, &err);
    assert_non_null(m);
    assert_int_equal(tdm_model_hparams(m)->n_expert, 8);
    assert_int_equal(tdm_model_hparams(m)->n_expert_used, 2);
    assert_int_equal(tdm_model_hparams(m)->n_ff_exp, 128);
    tdm_model_destroy(&m);
    expect_error_spec(&moe, edit_expert_used_0, TDM_EINVALID, "'llama.expert_used_count'",
                      "1..llama.expert_count (8), got 0");
    expect_error_spec(&moe, edit_expert_used_9, TDM_EINVALID, "'llama.expert_used_count'", "got 9");
    expect_error_spec(&moe, edit_expert_count_600, TDM_EINVALID, "'llama.expert_count'",
                      "more than 512");
    expect_error_spec(&moe, edit_moe_ffn_feed_key, TDM_EINVALID, "llama.expert_feed_forward_length",
                      "refused rather than run wrong");
    /* a dense file declaring experts: the router is missing */
    expect_error_spec(&dense, edit_experts, TDM_ENOTFOUND, "'blk.0.ffn_gate_inp.weight'",
                      "missing");
    expect_error_spec(&dense, edit_experts_bad_shape, TDM_EINVALID, "'blk.0.ffn_gate_exps.weight'",
                      "expected [64, 128, 8]");
    expect_error_spec(&dense, edit_expert_used_only, TDM_EINVALID, "'llama.expert_used_count'",
                      "expert_count is 0 or missing");
}

static int edit_unknown_key(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_f32(w, "llama.residual_scale", 0.5f);
}

static int edit_fused_qkv(tdm_gguf_writer_t *w)
{
    return add_matrix(w, "blk.1.attn_qkv.weight", 64, 192);
}

static int edit_layer_past_end(tdm_gguf_writer_t *w)
{
    return add_vector(w, "blk.2.attn_norm.weight", 64); /* the model has blocks 0 and 1 */
}

static int edit_qk_norm_on_llama(tdm_gguf_writer_t *w)
{
    return add_vector(w, "blk.0.attn_q_norm.weight", 16);
}

static void test_refusals(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_model_t *plain = load_edited(NULL, &err);
    assert_non_null(plain);
    g_rope_half = tdm_model_hparams(plain)->rope_dim / 2;
    tdm_model_destroy(&plain);
    g_rope_factor = 0.0f;
    expect_refused(edit_rope_freqs, "tensor 'rope_freqs.weight'", "factor 0 is 0");
    g_rope_factor = NAN;
    expect_refused(edit_rope_freqs, "tensor 'rope_freqs.weight'", "finite");
    expect_refused(edit_rope_freqs_short, "rope_freqs.weight", NULL);
    expect_refused(edit_yarn, "llama.rope.scaling.type", "'yarn'");
    expect_refused(edit_yarn_key, "llama.rope.scaling.yarn_beta_fast", "RoPE scaling");
    expect_refused(edit_attn_factor_zero, "llama.rope.scaling.attn_factor", "positive");
    expect_refused(edit_phi3_factors_on_llama, "rope_factors_long.weight", "phi3 only");
    expect_refused(edit_sliding_window, "llama.attention.sliding_window", "gemma3 only");
    expect_refused(edit_attn_softcap, "llama.attn_logit_softcapping", "soft-capping");
    expect_refused(edit_final_softcap, "llama.final_logit_softcapping", "soft-capping");
    expect_refused(edit_expert_tensor, "blk.0.ffn_gate_inp.weight",
                   "mixture-of-experts routing: llama or qwen3moe with expert_count > 0");
    expect_refused(edit_unknown_key, "llama.residual_scale", "refused rather than run wrong");
    expect_refused(edit_fused_qkv, "blk.1.attn_qkv.weight",
                   "fused QKV projection (implemented "
                   "for phi3 only)");
    expect_refused(edit_layer_past_end, "blk.2.attn_norm.weight", NULL);
    expect_refused(edit_qk_norm_on_llama, "blk.0.attn_q_norm.weight", NULL);
}

static int edit_harmless(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_u32(w, "llama.expert_count", 0) ||
           tdm_gguf_writer_set_u32(w, "llama.rope.scaling.original_context_length", 128) ||
           tdm_gguf_writer_set_bool(w, "llama.rope.scaling.finetuned", false) ||
           tdm_gguf_writer_set_str(w, "llama.rope.scaling.type", "none");
}

static int edit_linear_x4(tdm_gguf_writer_t *w)
{
    return tdm_gguf_writer_set_str(w, "llama.rope.scaling.type", "linear") ||
           tdm_gguf_writer_set_f32(w, "llama.rope.scaling.factor", 4.0f);
}

/* Logits of tokens 1..n at positions 0..n-1 (one pass) on an engine of n_ctx tokens, into
 * out[n][n_vocab]. */
static void run_ctx(tdm_model_t *m, uint32_t n, float *out, uint32_t n_ctx)
{
    const tdm_llama_hparams_t *hp = tdm_model_hparams(m);
    tdm_error_t err = {0};
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, TDM_KV_F32};
    tdm_kv_pool_t *pool = tdm_kv_pool_new(&kl, 8, &err);
    assert_non_null(pool);
    tdm_engine_params_t p;
    tdm_engine_params_default(&p);
    p.n_ctx = n_ctx;
    p.max_logits = n;
    p.n_threads = 1;
    tdm_engine_t *e = tdm_engine_new(m, pool, &p, &err);
    assert_non_null(e);
    int32_t tokens[16];
    uint32_t pos[16], seq[16], blocks[1] = {0};
    for (uint32_t i = 0; i < n; i++) {
        tokens[i] = (int32_t)(i * 7 + 1);
        pos[i] = i;
        seq[i] = 0;
    }
    tdm_batch_seq_t bs = {blocks, 1, NULL};
    tdm_batch_t b = {n, tokens, pos, seq, NULL, 1, &bs};
    assert_int_equal(tdm_engine_forward(e, &b, out, &err), TDM_OK);
    tdm_engine_destroy(&e);
    tdm_kv_pool_destroy(&pool);
}

static void run(tdm_model_t *m, uint32_t n, float *out)
{
    run_ctx(m, n, out, 128);
}

/* Linear scaling loads, sets rope_freq_scale = 1 / factor and changes the logits of every
 * position but the first (position 0 rotates by 0 either way). Harmless keys load unchanged.
 * RoPE frequency factors all 4 divide every angle by 4, which is what linear scaling by 4 does
 * (multiplies it by 0.25; both exact in binary floating point): the logits are bitwise those of
 * the linear x4 model; factors all 1 change nothing. */
static void test_accepted(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_model_t *plain = load_edited(NULL, &err);
    assert_non_null(plain);
    tdm_model_t *harmless = load_edited(edit_harmless, &err);
    if (!harmless)
        fail_msg("%s", err.msg);
    tdm_model_t *scaled = load_edited(edit_linear_x4, &err);
    if (!scaled)
        fail_msg("%s", err.msg);
    assert_true(tdm_model_hparams(scaled)->rope_freq_scale == 0.25f);
    assert_true(tdm_model_hparams(plain)->rope_freq_scale == 1.0f);
    g_rope_half = tdm_model_hparams(plain)->rope_dim / 2;
    g_rope_factor = 4.0f;
    tdm_model_t *factors4 = load_edited(edit_rope_freqs, &err);
    if (!factors4)
        fail_msg("%s", err.msg);
    assert_int_equal(tdm_model_hparams(factors4)->n_rope_freq_factors, g_rope_half);
    g_rope_factor = 1.0f;
    tdm_model_t *factors1 = load_edited(edit_rope_freqs, &err);
    if (!factors1)
        fail_msg("%s", err.msg);
    tdm_model_t *mscaled = load_edited(edit_attn_factor, &err);
    if (!mscaled)
        fail_msg("%s", err.msg);
    assert_true(tdm_model_hparams(mscaled)->rope_attn_factor == 1.5f);
    assert_true(tdm_model_hparams(plain)->rope_attn_factor == 1.0f);
    uint32_t V = tdm_model_hparams(plain)->n_vocab, n = 6;
    size_t one = (size_t)n * V;
    float *a = malloc(6 * one * sizeof *a);
    assert_non_null(a);
    run(plain, n, a);
    run(harmless, n, a + one);
    run(scaled, n, a + 2 * one);
    run(factors4, n, a + 3 * one);
    run(factors1, n, a + 4 * one);
    run(mscaled, n, a + 5 * one);
    /* the attention factor scales q and k (the scores by its square): position 0 attends to
     * itself only (the same output), every later one sees sharper scores */
    assert_memory_equal(a, a + 5 * one, (size_t)V * sizeof *a);
    for (uint32_t i = 1; i < n; i++)
        assert_memory_not_equal(a + (size_t)i * V, a + 5 * one + (size_t)i * V, V * sizeof *a);
    assert_memory_equal(a, a + one, one * sizeof *a);
    assert_memory_equal(a, a + 2 * one, (size_t)V * sizeof *a); /* position 0 */
    for (uint32_t i = 1; i < n; i++)
        assert_memory_not_equal(a + (size_t)i * V, a + 2 * one + (size_t)i * V, V * sizeof *a);
    assert_memory_equal(a + 2 * one, a + 3 * one, one * sizeof *a);
    assert_memory_equal(a, a + 4 * one, one * sizeof *a);
    free(a);
    tdm_model_destroy(&plain);
    tdm_model_destroy(&harmless);
    tdm_model_destroy(&scaled);
    tdm_model_destroy(&factors4);
    tdm_model_destroy(&factors1);
    tdm_model_destroy(&mscaled);
}

/* The layer helpers: sliding-window layers' first key and RoPE. */
static void test_layer_helpers(void **state)
{
    (void)state;
    tdm_llama_hparams_t hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layers = 6;
    hp.rope_freq_base = 1e6f;
    hp.rope_freq_base_swa = 1e4f;
    hp.rope_freq_scale = 0.125f;
    hp.n_swa = 4;
    for (uint32_t l = 0; l < 6; l++)
        hp.swa_layers[l] = l % 6 < 5;
    assert_int_equal(tdm_llama_layer_first_key(&hp, 0, 0), 0);
    assert_int_equal(tdm_llama_layer_first_key(&hp, 0, 3), 0);
    assert_int_equal(tdm_llama_layer_first_key(&hp, 0, 4), 1); /* keys 1..4: four of them */
    assert_int_equal(tdm_llama_layer_first_key(&hp, 4, 100), 97);
    assert_int_equal(tdm_llama_layer_first_key(&hp, 5, 100), 0); /* the global layer */
    float base, scale;
    tdm_llama_layer_rope(&hp, 0, &base, &scale);
    assert_true(base == 1e4f && scale == 1.0f);
    tdm_llama_layer_rope(&hp, 5, &base, &scale);
    assert_true(base == 1e6f && scale == 0.125f);
    hp.n_swa = 0; /* no window: every layer global */
    assert_int_equal(tdm_llama_layer_first_key(&hp, 0, 100), 0);
    tdm_llama_layer_rope(&hp, 0, &base, &scale);
    assert_true(base == 1e6f);
}

/* ---- Phi-3 ---- */

/* How the small Phi-3 file of phi3_file differs from the plain one. */
typedef enum phi3_variant {
    PHI3_FUSED,         /* attn_qkv and the fused ffn_up: the released files' form */
    PHI3_SPLIT_QKV,     /* the same values as separate attn_q/k/v (llama.cpp accepts both) */
    PHI3_LONG_ONLY,     /* rope_factors_long.weight without the short set */
    PHI3_BAD_QKV_SHAPE, /* attn_qkv one row short */
    PHI3_EXTRA_GATE,    /* an ffn_gate next to the fused ffn_up */
} phi3_variant_t;

#define P3_E 64  /* n_embd */
#define P3_H 4   /* heads of 16 */
#define P3_KV 2  /* KV heads */
#define P3_F 96  /* n_ff */
#define P3_V 256 /* vocabulary */

/* n pseudo-random values in [-a, a) from seed (a linear congruential generator). */
static float *p3_values(uint64_t n, uint32_t seed, float a)
{
    float *v = malloc(n * sizeof *v);
    assert_non_null(v);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (uint64_t i = 0; i < n; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        v[i] = a * ((float)(x >> 40) / (float)(1 << 23) - 1.0f);
    }
    return v;
}

static void p3_add(tdm_gguf_writer_t *w, const char *name, uint64_t n_in, uint64_t n_out,
                   const float *v)
{
    uint64_t ne[2] = {n_in, n_out};
    assert_int_equal(
        tdm_gguf_writer_add_tensor(w, name, TDM_GGML_TYPE_F32, n_out > 1 ? 2 : 1, ne, v), TDM_OK);
}

/* Writes a one-layer Phi-3 file (F32, LongRoPE factors, an original context of 64 tokens, an
 * attention factor of 1.2, a sliding window of 8 that must be ignored) to a temporary path and
 * loads it; NULL with *err when the load fails. */
static tdm_model_t *phi3_file(phi3_variant_t var, tdm_error_t *err)
{
    const uint64_t D = P3_E / P3_H, Q = P3_E, KV = P3_KV * D;
    tdm_gguf_writer_t *w = tdm_gguf_writer_new();
    assert_non_null(w);
    int rc = tdm_gguf_writer_set_str(w, "general.architecture", "phi3");
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.context_length", 4096);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.rope.scaling.original_context_length", 64);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.embedding_length", P3_E);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.feed_forward_length", P3_F);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.block_count", 1);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.attention.head_count", P3_H);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.attention.head_count_kv", P3_KV);
    rc = rc ? rc : tdm_gguf_writer_set_f32(w, "phi3.attention.layer_norm_rms_epsilon", 1e-5f);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.rope.dimension_count", (uint32_t)D);
    rc = rc ? rc : tdm_gguf_writer_set_u32(w, "phi3.attention.sliding_window", 8);
    rc = rc ? rc : tdm_gguf_writer_set_f32(w, "phi3.rope.scaling.attn_factor", 1.2f);
    assert_int_equal(rc, TDM_OK);
    float lf[8], sf[8];
    for (int i = 0; i < 8; i++) {
        lf[i] = 1.0f + 4.0f * (float)i;
        sf[i] = 1.0f + 0.1f * (float)i;
    }
    p3_add(w, "rope_factors_long.weight", D / 2, 1, lf);
    if (var != PHI3_LONG_ONLY)
        p3_add(w, "rope_factors_short.weight", D / 2, 1, sf);
    float *embd = p3_values(P3_E * P3_V, 1, 1.7f), *ones = p3_values(P3_F * 2, 0, 0.0f);
    float *qkv = p3_values(P3_E * (Q + 2 * KV), 2, 0.2f), *wo = p3_values(Q * P3_E, 3, 0.1f);
    float *up = p3_values(P3_E * 2 * P3_F, 4, 0.2f), *down = p3_values(P3_F * P3_E, 5, 0.1f);
    float *out = p3_values(P3_E * P3_V, 6, 0.2f);
    for (int i = 0; i < P3_F * 2; i++)
        ones[i] = 1.0f;
    p3_add(w, "token_embd.weight", P3_E, P3_V, embd);
    p3_add(w, "blk.0.attn_norm.weight", P3_E, 1, ones);
    if (var == PHI3_SPLIT_QKV) {
        p3_add(w, "blk.0.attn_q.weight", P3_E, Q, qkv);
        p3_add(w, "blk.0.attn_k.weight", P3_E, KV, qkv + P3_E * Q);
        p3_add(w, "blk.0.attn_v.weight", P3_E, KV, qkv + P3_E * (Q + KV));
    } else {
        p3_add(w, "blk.0.attn_qkv.weight", P3_E, Q + 2 * KV - (var == PHI3_BAD_QKV_SHAPE), qkv);
    }
    p3_add(w, "blk.0.attn_output.weight", Q, P3_E, wo);
    p3_add(w, "blk.0.ffn_norm.weight", P3_E, 1, ones);
    p3_add(w, "blk.0.ffn_up.weight", P3_E, 2 * P3_F, up);
    if (var == PHI3_EXTRA_GATE)
        p3_add(w, "blk.0.ffn_gate.weight", P3_E, P3_F, up);
    p3_add(w, "blk.0.ffn_down.weight", P3_F, P3_E, down);
    p3_add(w, "output_norm.weight", P3_E, 1, ones);
    p3_add(w, "output.weight", P3_E, P3_V, out);
    free(embd), free(ones), free(qkv), free(wo), free(up), free(down), free(out);
    char path[] = "/tmp/tandem-test-phi3-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    close(fd);
    assert_int_equal(tdm_gguf_writer_write_file(w, path, err), TDM_OK);
    tdm_gguf_writer_destroy(&w);
    tdm_model_t *m = tdm_model_load(path, err);
    unlink(path);
    return m;
}

/* Phi-3: the fused file loads with its features (the window ignored, the factors read), gives
 * bitwise the logits of the same values stored as separate attn_q/k/v (the fused matrix's row
 * ranges are the three projections); an engine whose context passes the original 64 tokens
 * takes the long factors (other logits past position 0); a lone factor set, a fused matrix of
 * the wrong shape and an ffn_gate next to the fused ffn_up are refused, naming the tensor. */
static void test_phi3(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_model_t *fused = phi3_file(PHI3_FUSED, &err);
    if (!fused)
        fail_msg("%s", err.msg);
    const tdm_llama_hparams_t *hp = tdm_model_hparams(fused);
    assert_true(hp->fused_qkv && hp->fused_gate_up && hp->n_swa == 0);
    assert_int_equal(hp->n_ff, P3_F);
    assert_int_equal(hp->n_rope_long_short, 8);
    assert_true(hp->rope_attn_factor == 1.2f && hp->n_ctx_orig == 64);
    assert_ptr_equal(tdm_llama_rope_factors(hp, 64), hp->rope_factors_short);
    assert_ptr_equal(tdm_llama_rope_factors(hp, 65), hp->rope_factors_long);
    tdm_model_t *split = phi3_file(PHI3_SPLIT_QKV, &err);
    if (!split)
        fail_msg("%s", err.msg);
    assert_false(tdm_model_hparams(split)->fused_qkv);
    const uint32_t n = 6;
    float *a = malloc(3 * (size_t)n * P3_V * sizeof *a);
    assert_non_null(a);
    run(fused, n, a); /* n_ctx 128 > 64: the long factors */
    run(split, n, a + n * P3_V);
    assert_memory_equal(a, a + n * P3_V, (size_t)n * P3_V * sizeof *a);
    run_ctx(fused, n, a + 2 * n * P3_V, 64);                    /* the short factors */
    assert_memory_equal(a, a + 2 * n * P3_V, P3_V * sizeof *a); /* position 0: angle 0 */
    for (uint32_t i = 1; i < n; i++)
        assert_memory_not_equal(a + (size_t)i * P3_V, a + (2 * n + i) * (size_t)P3_V,
                                P3_V * sizeof *a);
    free(a);
    tdm_model_destroy(&fused);
    tdm_model_destroy(&split);
    static const struct {
        phi3_variant_t var;
        const char *want1, *want2;
    } bad[] = {
        {PHI3_LONG_ONLY, "rope_factors_short.weight", "missing"},
        {PHI3_BAD_QKV_SHAPE, "blk.0.attn_qkv.weight", "expected [64, 128]"},
        {PHI3_EXTRA_GATE, "blk.0.ffn_gate.weight", "not implemented"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        tdm_model_t *m = phi3_file(bad[i].var, &err);
        if (m)
            fail_msg("variant %d loaded", (int)bad[i].var);
        if (!strstr(err.msg, bad[i].want1) || !strstr(err.msg, bad[i].want2))
            fail_msg("variant %d: \"%s\" lacks '%s' or '%s'", (int)bad[i].var, err.msg,
                     bad[i].want1, bad[i].want2);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_refusals),        cmocka_unit_test(test_expert_errors),
        cmocka_unit_test(test_qwen3moe_errors), cmocka_unit_test(test_accepted),
        cmocka_unit_test(test_layer_helpers),   cmocka_unit_test(test_phi3),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
