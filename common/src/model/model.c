/* model.c - loading a Llama-family GGUF model and running its forward pass through a backend.
 *
 * The layer loop lives here once; backends (cpu.c, cuda/) implement the ops in
 * backend.h. The order inside a layer is fixed: K and V of every row are written to the paged
 * cache before any row attends, and attention reads only from the cache, so a row sees the
 * same (possibly f16-rounded) keys whether they were computed in this pass or an earlier one.
 * That is what makes chunked prefill bitwise equal to whole-prompt prefill.
 */
#include "tandem/model.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <xxhash.h>

#include "model/backend.h"
#ifdef TANDEM_HAVE_CUDA
#include "model/cuda/cuda_backend.h"
#endif

struct tdm_model {
    tdm_gguf_t *gguf;
    tdm_llama_hparams_t hp;
    tdm_weight_t token_embd;
    tdm_weight_t output; /* = token_embd when tied */
    tdm_weight_t output_norm;
    tdm_layer_weights_t *layers; /* [n_layers] */
    tdm_weight_t *experts;       /* [n_layers][n_expert][3] expert slices (gate, up, down); NULL
                                    for a dense model */
    uint64_t weight_bytes;
    uint64_t fingerprint;
};

struct tdm_engine {
    const tdm_model_t *model;
    tdm_kv_pool_t *pool;
    tdm_engine_params_t params;
    const tdm_backend_ops_t *ops;
    void *be;
    char name[64];
    uint64_t scratch_bytes;
    uint64_t released_bytes; /* tdm_engine_released_weight_bytes */
    /* backend buffers, row-major; B = max_batch_tokens, L = max_logits */
    float *x;      /* [B][n_embd] residual stream */
    float *xn;     /* [B][n_embd] normalised input of a sub-layer */
    float *q;      /* [B][n_heads * head_dim] */
    float *k;      /* [B][n_kv_heads * head_dim] */
    float *v;      /* [B][n_kv_heads * head_dim] */
    float *attn;   /* [B][n_heads * head_dim] attention output */
    float *proj;   /* [B][n_embd] output of W_o or W_down */
    float *gate;   /* [B][n_ff] */
    float *up;     /* [B][n_ff] */
    float *sel;    /* [L][n_embd] final hidden states of the rows asking for logits */
    float *seln;   /* [L][n_embd] the same, normalised */
    float *logits; /* [L][n_vocab]; NULL on a host-memory backend (the caller's array) */
    /* host scratch */
    uint32_t *logit_rows; /* [L] */
    uint32_t *last_pos;   /* [B] per sequence: last position seen + 1 (0 = none yet) */
    uint32_t *first_pos;  /* [B] per sequence: position of its first row */
    bool timing;          /* tdm_engine_op_timing */
    tdm_op_times_t times;
};

/* ---- model ---- */

static int bind_weight(const tdm_gguf_t *g, const char *name, tdm_weight_t *w, tdm_error_t *err)
{
    const tdm_gguf_tensor_t *t = tdm_gguf_find_tensor(g, name);
    if (!t)
        return tdm_error_set(err, TDM_ENOTFOUND, "tensor '%s' is missing", name);
    w->name = t->name;
    w->type = t->type;
    w->n_in = t->ne[0];
    w->n_out = t->ne[1];
    w->row_bytes = tdm_ggml_row_size(t->type, t->ne[0]);
    w->data = t->data;
    w->dev = NULL;
    if (!w->data || w->row_bytes == 0)
        return tdm_error_set(err, TDM_EINVALID, "tensor '%s' has no data", name);
    return TDM_OK;
}

/* Rows [r0, r0 + n) of w as a weight of their own (a view: same data, no copy). */
static tdm_weight_t weight_rows(const tdm_weight_t *w, uint64_t r0, uint64_t n)
{
    tdm_weight_t v = *w;
    v.data = (const uint8_t *)w->data + r0 * w->row_bytes;
    v.n_out = n;
    return v;
}

/* Phi-3's fused projections as the separate weights the forward pass multiplies: attn_qkv's
 * rows are q's, then k's, then v's; ffn_up's (fused) the gate's, then up's (ggml_swiglu's
 * halves: silu of the first times the second). */
static int bind_fused(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp, uint32_t l,
                      tdm_layer_weights_t *lw, tdm_error_t *err)
{
    char name[96];
    tdm_weight_t w;
    int rc;
    if (hp->fused_qkv) {
        uint64_t q_dim = (uint64_t)hp->n_heads * hp->head_dim;
        uint64_t kv_dim = (uint64_t)hp->n_kv_heads * hp->head_dim;
        snprintf(name, sizeof name, "blk.%" PRIu32 ".attn_qkv.weight", l);
        if ((rc = bind_weight(g, name, &w, err)))
            return rc;
        lw->wq = weight_rows(&w, 0, q_dim);
        lw->wk = weight_rows(&w, q_dim, kv_dim);
        lw->wv = weight_rows(&w, q_dim + kv_dim, kv_dim);
    }
    if (hp->fused_gate_up) {
        snprintf(name, sizeof name, "blk.%" PRIu32 ".ffn_up.weight", l);
        if ((rc = bind_weight(g, name, &w, err)))
            return rc;
        lw->w_gate = weight_rows(&w, 0, hp->n_ff);
        lw->w_up = weight_rows(&w, hp->n_ff, hp->n_ff);
    }
    return TDM_OK;
}

static int bind_layer(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp, uint32_t l,
                      tdm_layer_weights_t *lw, tdm_error_t *err)
{
    static const struct {
        const char *suffix;
        size_t offset;
        bool bias, qk_norm, post_norm; /* present only with that feature */
    } names[] = {
        /* attn_q/k/v and ffn_gate/up first: bind_fused replaces them when fused */
        {"attn_q.weight", offsetof(tdm_layer_weights_t, wq), false, false, false},
        {"attn_k.weight", offsetof(tdm_layer_weights_t, wk), false, false, false},
        {"attn_v.weight", offsetof(tdm_layer_weights_t, wv), false, false, false},
        {"ffn_gate.weight", offsetof(tdm_layer_weights_t, w_gate), false, false, false},
        {"ffn_up.weight", offsetof(tdm_layer_weights_t, w_up), false, false, false},
        {"attn_norm.weight", offsetof(tdm_layer_weights_t, attn_norm), false, false, false},
        {"attn_output.weight", offsetof(tdm_layer_weights_t, wo), false, false, false},
        {"attn_q.bias", offsetof(tdm_layer_weights_t, bq), true, false, false},
        {"attn_k.bias", offsetof(tdm_layer_weights_t, bk), true, false, false},
        {"attn_v.bias", offsetof(tdm_layer_weights_t, bv), true, false, false},
        {"attn_q_norm.weight", offsetof(tdm_layer_weights_t, q_norm), false, true, false},
        {"attn_k_norm.weight", offsetof(tdm_layer_weights_t, k_norm), false, true, false},
        {"post_attention_norm.weight", offsetof(tdm_layer_weights_t, post_attn_norm), false, false,
         true},
        {"post_ffw_norm.weight", offsetof(tdm_layer_weights_t, post_ffn_norm), false, false, true},
        {"ffn_norm.weight", offsetof(tdm_layer_weights_t, ffn_norm), false, false, false},
        {"ffn_down.weight", offsetof(tdm_layer_weights_t, w_down), false, false, false},
    };
    const size_t n_names = sizeof names / sizeof names[0];
    for (size_t i = 0; i < n_names; i++) {
        bool dense_ffn = i == 3 || i == 4 || i == n_names - 1; /* ffn_gate, ffn_up, ffn_down */
        if ((i < 3 && hp->fused_qkv) || ((i == 3 || i == 4) && hp->fused_gate_up) ||
            (dense_ffn && hp->n_expert > 0))
            continue;
        if (names[i].bias && !hp->has_qkv_bias)
            continue;
        if ((names[i].qk_norm && !hp->qk_norm) || (names[i].post_norm && !hp->post_norms))
            continue;
        char name[96];
        snprintf(name, sizeof name, "blk.%" PRIu32 ".%s", l, names[i].suffix);
        int rc = bind_weight(g, name, (tdm_weight_t *)((char *)lw + names[i].offset), err);
        if (rc != TDM_OK)
            return rc;
    }
    return bind_fused(g, hp, l, lw, err);
}

/* Layer l's router and expert slices (hparams.c checked the shapes): expert e of a 3-D tensor
 * [n_in, n_out, n_expert] is the n_out rows starting at e * n_out. out: [n_expert][3]. */
static int bind_experts(const tdm_gguf_t *g, const tdm_llama_hparams_t *hp, uint32_t l,
                        tdm_layer_weights_t *lw, tdm_weight_t *out, tdm_error_t *err)
{
    static const char *const suffix[3] = {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"};
    char name[96];
    snprintf(name, sizeof name, "blk.%" PRIu32 ".ffn_gate_inp.weight", l);
    int rc = bind_weight(g, name, &lw->gate_inp, err);
    for (int k = 0; k < 3 && rc == TDM_OK; k++) {
        snprintf(name, sizeof name, "blk.%" PRIu32 ".%s.weight", l, suffix[k]);
        tdm_weight_t whole;
        if ((rc = bind_weight(g, name, &whole, err)) != TDM_OK)
            break;
        for (uint32_t e = 0; e < hp->n_expert; e++) {
            tdm_weight_t *w = &out[(size_t)e * 3 + (size_t)k];
            *w = whole;
            w->data = (const uint8_t *)whole.data + (size_t)e * whole.n_out * whole.row_bytes;
        }
    }
    lw->exps = out;
    return rc;
}

/* XXH3 over the hyperparameters, the tensor table and a sample of each tensor's bytes. */
static uint64_t model_fingerprint(const tdm_model_t *m)
{
    XXH3_state_t *st = XXH3_createState();
    if (!st)
        return 0;
    XXH3_64bits_reset(st);
    const tdm_llama_hparams_t *hp = &m->hp;
    uint32_t dims[] = {hp->n_vocab,    hp->n_embd,   hp->n_layers, hp->n_heads,
                       hp->n_kv_heads, hp->head_dim, hp->n_ff,     hp->rope_dim};
    XXH3_64bits_update(st, dims, sizeof dims);
    XXH3_64bits_update(st, hp->arch, strlen(hp->arch));
    /* the architecture features, only where they differ from the plain Llama block (so the
     * fingerprints of models without them stay what earlier versions computed) */
    float feat[] = {hp->rope_freq_scale, hp->rope_freq_base_swa,  (float)hp->n_swa,
                    hp->attn_q_scale,    hp->final_logit_softcap, hp->embd_scale,
                    (float)hp->qk_norm,  (float)hp->post_norms,   (float)hp->ffn_act};
    if (hp->rope_freq_scale != 1.0f || hp->n_swa || hp->attn_q_scale != 0.0f ||
        hp->final_logit_softcap != 0.0f || hp->embd_scale != 1.0f || hp->qk_norm ||
        hp->post_norms || hp->ffn_act != TDM_FFN_SILU) {
        XXH3_64bits_update(st, feat, sizeof feat);
        XXH3_64bits_update(st, hp->swa_layers,
                           hp->n_layers < TDM_GGUF_MAX_LAYERS ? hp->n_layers : TDM_GGUF_MAX_LAYERS);
    }
    if (hp->n_rope_freq_factors) /* rope_freqs.weight is in the tensor table below too */
        XXH3_64bits_update(st, hp->rope_freq_factors,
                           hp->n_rope_freq_factors * sizeof hp->rope_freq_factors[0]);
    /* Phi-3's features (its factors are in the tensor table) */
    float phi3[] = {(float)hp->fused_qkv, (float)hp->fused_gate_up, hp->rope_attn_factor,
                    (float)hp->n_ctx_orig};
    if (hp->fused_qkv || hp->fused_gate_up || hp->rope_attn_factor != 1.0f || hp->n_rope_long_short)
        XXH3_64bits_update(st, phi3, sizeof phi3);
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(m->gguf); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(m->gguf, i);
        XXH3_64bits_update(st, t->name, strlen(t->name));
        XXH3_64bits_update(st, t->ne, sizeof t->ne);
        uint32_t type = (uint32_t)t->type;
        XXH3_64bits_update(st, &type, sizeof type);
        size_t sample = t->n_bytes < 4096 ? t->n_bytes : 4096;
        XXH3_64bits_update(st, t->data, sample);
        XXH3_64bits_update(st, (const char *)t->data + t->n_bytes - sample, sample);
    }
    uint64_t h = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    return h;
}

tdm_model_t *tdm_model_load(const char *path, tdm_error_t *err)
{
    tdm_model_t *m = calloc(1, sizeof *m);
    if (!m) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    m->gguf = tdm_gguf_open(path, err);
    if (!m->gguf)
        goto out_free_model;
    if (tdm_gguf_llama_hparams(m->gguf, &m->hp, err) != TDM_OK) {
        tdm_error_prefix(err, TDM_EINVALID, "%s", path);
        goto out_close_gguf;
    }
    m->layers = calloc(m->hp.n_layers, sizeof *m->layers);
    if (!m->layers) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out_close_gguf;
    }
    const tdm_gguf_t *g = m->gguf;
    size_t n_exp_w = (size_t)m->hp.n_layers * m->hp.n_expert * 3;
    if (n_exp_w && !(m->experts = calloc(n_exp_w, sizeof *m->experts))) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out_free_layers;
    }
    if (bind_weight(g, "token_embd.weight", &m->token_embd, err) ||
        bind_weight(g, "output_norm.weight", &m->output_norm, err) ||
        (m->hp.tied_embeddings ? (m->output = m->token_embd, 0)
                               : bind_weight(g, "output.weight", &m->output, err)))
        goto out_free_layers;
    for (uint32_t l = 0; l < m->hp.n_layers; l++) {
        if (bind_layer(g, &m->hp, l, &m->layers[l], err) != TDM_OK)
            goto out_free_layers;
        if (m->hp.n_expert > 0 &&
            bind_experts(g, &m->hp, l, &m->layers[l], m->experts + (size_t)l * m->hp.n_expert * 3,
                         err) != TDM_OK)
            goto out_free_layers;
    }
    m->weight_bytes = tdm_gguf_tensor_bytes(g);
    m->fingerprint = model_fingerprint(m);
    return m;

out_free_layers:
    free(m->experts);
    free(m->layers);
out_close_gguf:
    tdm_gguf_destroy(&m->gguf);
out_free_model:
    free(m);
    return NULL;
}

void tdm_model_destroy(tdm_model_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_model_t *m = *self_p;
    free(m->experts);
    free(m->layers);
    tdm_gguf_destroy(&m->gguf);
    free(m);
    *self_p = NULL;
}

const tdm_llama_hparams_t *tdm_model_hparams(const tdm_model_t *m)
{
    return &m->hp;
}

uint32_t tdm_model_serve_n_ctx(const tdm_llama_hparams_t *hp, uint32_t max_context)
{
    uint32_t want = max_context ? max_context : TDM_MODEL_MAX_SERVE_CTX;
    return hp->n_ctx_train < want ? hp->n_ctx_train : want;
}

const tdm_gguf_t *tdm_model_gguf(const tdm_model_t *m)
{
    return m->gguf;
}

uint64_t tdm_model_weight_bytes(const tdm_model_t *m)
{
    return m->weight_bytes;
}

uint64_t tdm_model_fingerprint(const tdm_model_t *m)
{
    return m->fingerprint;
}

const tdm_weight_t *tdm_model_token_embd(const tdm_model_t *m)
{
    return &m->token_embd;
}

const tdm_weight_t *tdm_model_output(const tdm_model_t *m)
{
    return &m->output;
}

const tdm_weight_t *tdm_model_output_norm(const tdm_model_t *m)
{
    return &m->output_norm;
}

const tdm_layer_weights_t *tdm_model_layer(const tdm_model_t *m, uint32_t layer)
{
    return &m->layers[layer];
}

const tdm_weight_t *tdm_model_experts(const tdm_model_t *m, size_t *n)
{
    *n = m->experts ? (size_t)m->hp.n_layers * m->hp.n_expert * 3 : 0;
    return m->experts;
}

/* ---- engine ---- */

void tdm_engine_params_default(tdm_engine_params_t *p)
{
    p->backend = "cpu";
    p->device = 0;
    p->n_threads = 0;
    p->max_batch_tokens = 512;
    p->max_logits = 64;
    p->n_ctx = 4096;
}

/* Finds the backend named by p->backend: "cpu", and in CUDA builds "cuda" (device p->device)
 * or "cuda:N" (sets p->device to N). TDM_ENOTFOUND naming the available ones otherwise. */
static int engine_pick_backend(tdm_engine_params_t *p, const tdm_backend_ops_t **ops,
                               tdm_error_t *err)
{
    if (strcmp(p->backend, "cpu") == 0) {
        *ops = &tdm_model_backend_cpu;
        return TDM_OK;
    }
#ifdef TANDEM_HAVE_CUDA
    if (strncmp(p->backend, "cuda", 4) == 0) {
        const char *s = p->backend + 4;
        if (*s == ':') {
            char *end = NULL;
            long dev = s[1] >= '0' && s[1] <= '9' ? strtol(s + 1, &end, 10) : -1;
            if (dev < 0 || dev > 1023 || !end || *end != '\0')
                return tdm_error_set(err, TDM_ENOTFOUND,
                                     "engine backend '%s' is not available (available: cpu, "
                                     "cuda, cuda:N with N a device ordinal)",
                                     p->backend);
            p->device = (int)dev;
            s = end;
        }
        if (*s == '\0') {
            if (p->device < 0 || p->device > 1023)
                return tdm_error_set(err, TDM_EINVALID, "device must be in 0..1023, got %d",
                                     p->device);
            *ops = &tdm_model_backend_cuda;
            return TDM_OK;
        }
    }
    return tdm_error_set(err, TDM_ENOTFOUND,
                         "engine backend '%s' is not available (available: cpu, cuda, cuda:N)",
                         p->backend);
#else
    return tdm_error_set(err, TDM_ENOTFOUND,
                         "engine backend '%s' is not available (available: cpu; this build has "
                         "no CUDA: configure with -DTANDEM_CUDA=ON for cuda)",
                         p->backend);
#endif
}

static float *engine_alloc(tdm_engine_t *e, size_t n, tdm_error_t *err)
{
    float *p = e->ops->alloc(e->be, n);
    if (!p)
        tdm_error_set(err, TDM_ERESOURCE, "out of memory allocating %zu bytes of scratch",
                      n * sizeof(float));
    e->scratch_bytes += n * sizeof(float);
    return p;
}

/* A pool with layer groups against the model: the groups cover its layers, each layer's
 * group has the layer's window (tdm_llama_layer_window), the blocks its KV heads. */
static int pool_groups_check(const tdm_kv_groups_t *g, const tdm_kv_layout_t *kl,
                             const tdm_llama_hparams_t *hp, tdm_error_t *err)
{
    if (g->n_layers != hp->n_layers || kl->n_layers != g->layers_per_group ||
        kl->n_kv_heads != hp->n_kv_heads || kl->head_dim != hp->head_dim)
        return tdm_error_set(err, TDM_EINVALID,
                             "KV pool layout (%" PRIu32 " layers in groups of %" PRIu32 ", %" PRIu32
                             " KV heads, head_dim %" PRIu32 ") does not match the model (%" PRIu32
                             ", %" PRIu32 ", %" PRIu32 ")",
                             g->n_layers, kl->n_layers, kl->n_kv_heads, kl->head_dim, hp->n_layers,
                             hp->n_kv_heads, hp->head_dim);
    for (uint32_t l = 0; l < hp->n_layers; l++)
        if (g->window[g->group_of[l]] != tdm_llama_layer_window(hp, l))
            return tdm_error_set(err, TDM_EINVALID,
                                 "KV pool layer groups: layer %" PRIu32 " is in a group of window "
                                 "%" PRIu32 ", the model's layer attends to %" PRIu32
                                 " keys (0 = all)",
                                 l, g->window[g->group_of[l]], tdm_llama_layer_window(hp, l));
    return TDM_OK;
}

/* Checks the engine parameters against the model and the pool's layout against the model. */
static int engine_params_check(const tdm_engine_params_t *p, const tdm_llama_hparams_t *hp,
                               const tdm_kv_pool_t *pool, tdm_error_t *err)
{
    if (p->max_batch_tokens < 1 || p->max_batch_tokens > 65536)
        return tdm_error_set(err, TDM_EINVALID,
                             "max_batch_tokens must be in 1..65536, got %" PRIu32,
                             p->max_batch_tokens);
    if (p->max_logits < 1 || p->max_logits > p->max_batch_tokens)
        return tdm_error_set(err, TDM_EINVALID,
                             "max_logits must be in 1..max_batch_tokens (%" PRIu32
                             "), got %" PRIu32,
                             p->max_batch_tokens, p->max_logits);
    if (p->n_ctx < 1 || p->n_ctx > hp->n_ctx_train)
        return tdm_error_set(err, TDM_EINVALID,
                             "n_ctx must be in 1..%" PRIu32
                             " (the model's context length), got %" PRIu32,
                             hp->n_ctx_train, p->n_ctx);
    if (p->n_threads < 0 || p->n_threads > 1024)
        return tdm_error_set(err, TDM_EINVALID, "n_threads must be in 0..1024 (0 = all), got %d",
                             p->n_threads);
    const tdm_kv_layout_t *kl = tdm_kv_pool_layout(pool);
    const tdm_kv_groups_t *g = tdm_kv_pool_groups(pool);
    if (g)
        return pool_groups_check(g, kl, hp, err);
    if (kl->n_layers != hp->n_layers || kl->n_kv_heads != hp->n_kv_heads ||
        kl->head_dim != hp->head_dim)
        return tdm_error_set(
            err, TDM_EINVALID,
            "KV pool layout (%" PRIu32 " layers, %" PRIu32 " KV heads, head_dim %" PRIu32
            ") does not match the model (%" PRIu32 ", %" PRIu32 ", %" PRIu32 ")",
            kl->n_layers, kl->n_kv_heads, kl->head_dim, hp->n_layers, hp->n_kv_heads, hp->head_dim);
    return TDM_OK;
}

/* Refuses a model that needs an op or feature the backend does not implement, naming it. */
static int engine_ops_check(const tdm_backend_ops_t *ops, const tdm_llama_hparams_t *hp,
                            tdm_error_t *err)
{
    const char *missing = NULL;
    if (hp->n_expert > 0 && !ops->moe_ffn) /* first: a MoE model may use other features too */
        missing = "mixture-of-experts layers";
    else if (!ops->arch_features) {
        if (hp->fused_qkv || hp->fused_gate_up)
            missing = "fused QKV / gate-up projections";
        else if (hp->rope_attn_factor != 1.0f)
            missing = "the RoPE attention factor";
        else if (hp->n_rope_long_short)
            missing = "long/short RoPE factors";
        else if (hp->n_swa)
            missing = "sliding-window attention";
        else if (hp->attn_q_scale > 0.0f)
            missing = "the query scale before attention";
        else if (hp->qk_norm)
            missing = "QK-norm";
        else if (hp->post_norms)
            missing = "post-norms";
        else if (hp->rope_freq_scale != 1.0f)
            missing = "linear RoPE scaling";
        else if (hp->n_rope_freq_factors)
            missing = "RoPE frequency factors";
    }
    if (!missing && hp->ffn_act == TDM_FFN_GELU_TANH && !ops->geglu)
        missing = "GeGLU";
    if (!missing && (hp->embd_scale != 1.0f || hp->attn_q_scale > 0.0f) && !ops->scale)
        missing = "scaling";
    if (missing)
        return tdm_error_set(err, TDM_EINVALID,
                             "the %s backend does not implement %s, which this %s model needs "
                             "(use the cpu backend)",
                             ops->name, missing, hp->arch);
    return TDM_OK;
}

/* The scratch buffers, sized for the engine's max_batch_tokens (B) and max_logits (L) rows
 * (shapes in the struct): from the backend, freed when it is destroyed. */
static int engine_scratch_new(tdm_engine_t *e, tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = &e->model->hp;
    size_t B = e->params.max_batch_tokens, L = e->params.max_logits;
    size_t E = hp->n_embd, QD = (size_t)hp->n_heads * hp->head_dim,
           KD = (size_t)hp->n_kv_heads * hp->head_dim, V = hp->n_vocab;
    size_t F = hp->n_expert ? 1 : hp->n_ff; /* the backend keeps the experts' own scratch */
    if (!(e->x = engine_alloc(e, B * E, err)) || !(e->xn = engine_alloc(e, B * E, err)) ||
        !(e->q = engine_alloc(e, B * QD, err)) || !(e->k = engine_alloc(e, B * KD, err)) ||
        !(e->v = engine_alloc(e, B * KD, err)) || !(e->attn = engine_alloc(e, B * QD, err)) ||
        !(e->proj = engine_alloc(e, B * E, err)) || !(e->gate = engine_alloc(e, B * F, err)) ||
        !(e->up = engine_alloc(e, B * F, err)) || !(e->sel = engine_alloc(e, L * E, err)) ||
        !(e->seln = engine_alloc(e, L * E, err)) ||
        (!e->ops->host_memory && !(e->logits = engine_alloc(e, L * V, err))))
        return TDM_ERESOURCE; /* engine_alloc set err */
    e->logit_rows = calloc(L, sizeof *e->logit_rows);
    e->last_pos = calloc(B, sizeof *e->last_pos);
    e->first_pos = calloc(B, sizeof *e->first_pos);
    if (!e->logit_rows || !e->last_pos || !e->first_pos) {
        free(e->logit_rows);
        free(e->last_pos);
        free(e->first_pos);
        e->logit_rows = NULL;
        e->last_pos = NULL;
        e->first_pos = NULL;
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    }
    return TDM_OK;
}

tdm_engine_t *tdm_engine_new(const tdm_model_t *m, tdm_kv_pool_t *pool,
                             const tdm_engine_params_t *params, tdm_error_t *err)
{
    tdm_engine_params_t p;
    if (params)
        p = *params;
    else
        tdm_engine_params_default(&p);
    const tdm_llama_hparams_t *hp = &m->hp;
    if (!p.backend)
        p.backend = "cpu";
    const tdm_backend_ops_t *ops = NULL;
    if (engine_pick_backend(&p, &ops, err) != TDM_OK)
        return NULL;
    if (engine_params_check(&p, hp, pool, err) != TDM_OK ||
        engine_ops_check(ops, hp, err) != TDM_OK)
        return NULL;
    if (tdm_kv_pool_groups(pool) && !ops->kv_groups) {
        tdm_error_set(err, TDM_EINVALID,
                      "the %s backend does not address KV pools with layer groups", ops->name);
        return NULL;
    }

    tdm_engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    e->model = m;
    e->pool = pool;
    e->params = p;
    e->ops = ops;
    e->be = e->ops->create(m, &p, pool, err);
    if (!e->be)
        goto out_free_engine;
    snprintf(e->name, sizeof e->name, "%s", e->ops->kernel_name(e->be));
    /* the backend's own buffers (repacked weights, per-thread scratch) count as scratch */
    e->scratch_bytes = e->ops->own_bytes ? e->ops->own_bytes(e->be) : 0;
    e->released_bytes = e->ops->released_bytes ? e->ops->released_bytes(e->be) : 0;

    if (engine_scratch_new(e, err) != TDM_OK)
        goto out_destroy_backend;
    return e;

out_destroy_backend:
    e->ops->destroy(e->be);
out_free_engine:
    free(e);
    return NULL;
}

void tdm_engine_destroy(tdm_engine_t **self_p)
{
    if (!self_p || !*self_p)
        return;
    tdm_engine_t *e = *self_p;
    e->ops->destroy(e->be); /* frees every buffer it allocated */
    free(e->logit_rows);
    free(e->last_pos);
    free(e->first_pos);
    free(e);
    *self_p = NULL;
}

const char *tdm_engine_backend_name(const tdm_engine_t *e)
{
    return e->name;
}

uint32_t tdm_engine_n_embd(const tdm_engine_t *e)
{
    return e->model->hp.n_embd;
}

uint64_t tdm_engine_scratch_bytes(const tdm_engine_t *e)
{
    return e->scratch_bytes;
}

uint64_t tdm_engine_released_weight_bytes(const tdm_engine_t *e)
{
    return e->released_bytes;
}

void tdm_engine_device_bytes(const tdm_engine_t *e, uint64_t *weight_bytes, uint64_t *scratch_bytes)
{
    uint64_t weights = 0, workspace = 0;
    if (!e->ops->device_bytes) {
        *weight_bytes = 0;
        *scratch_bytes = 0;
        return;
    }
    e->ops->device_bytes(e->be, &weights, &workspace);
    *weight_bytes = weights;
    *scratch_bytes = e->scratch_bytes + workspace;
}

void *tdm_engine_kv_device_base(const tdm_engine_t *e)
{
    return e->ops->kv_device_base ? e->ops->kv_device_base(e->be) : NULL;
}

/* Checks row i of the batch (token, sequence, position in order and inside the context and
 * the sequence's blocks); records the sequence's next position and, when the row asks for
 * logits, appends it to e->logit_rows (*nl rows so far). */
static int batch_check_row(tdm_engine_t *e, const tdm_batch_t *b, uint32_t i,
                           const tdm_kv_layout_t *kl, uint32_t *nl, tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = &e->model->hp;
    if (b->tokens[i] < 0 || (uint32_t)b->tokens[i] >= hp->n_vocab)
        return tdm_error_set(err, TDM_EINVALID,
                             "row %" PRIu32 ": token %" PRId32 " is outside the vocabulary "
                             "(0..%" PRIu32 ")",
                             i, b->tokens[i], hp->n_vocab - 1);
    if (b->seq[i] >= b->n_seqs)
        return tdm_error_set(err, TDM_EINVALID,
                             "row %" PRIu32 ": seq %" PRIu32 " >= n_seqs %" PRIu32, i, b->seq[i],
                             b->n_seqs);
    uint32_t pos = b->pos[i], s = b->seq[i];
    if (pos >= e->params.n_ctx)
        return tdm_error_set(err, TDM_EINVALID,
                             "row %" PRIu32 ": position %" PRIu32
                             " is beyond the context (n_ctx %" PRIu32 ")",
                             i, pos, e->params.n_ctx);
    if (e->last_pos[s] != 0 && pos != e->last_pos[s])
        return tdm_error_set(err, TDM_EINVALID,
                             "row %" PRIu32 ": position %" PRIu32 " of seq %" PRIu32
                             " does not follow its previous row (%" PRIu32 ")",
                             i, pos, s, e->last_pos[s] - 1);
    if (e->last_pos[s] == 0)
        e->first_pos[s] = pos;
    e->last_pos[s] = pos + 1;
    const tdm_batch_seq_t *sq = &b->seqs[s];
    if (pos / kl->block_size >= sq->n_blocks)
        return tdm_error_set(err, TDM_EINVALID,
                             "row %" PRIu32 ": position %" PRIu32 " of seq %" PRIu32
                             " is not covered by its %" PRIu32 " blocks of %" PRIu32 " tokens",
                             i, pos, s, sq->n_blocks, kl->block_size);
    if (!b->want_logits || b->want_logits[i]) {
        if (*nl == e->params.max_logits)
            return tdm_error_set(err, TDM_EINVALID,
                                 "more than max_logits (%" PRIu32 ") rows ask for logits",
                                 e->params.max_logits);
        e->logit_rows[(*nl)++] = i;
    }
    return TDM_OK;
}

/* Entries j0 .. need - 1 of a block table of seq s are blocks of the pool. */
static int batch_check_table(const uint32_t *blocks, uint32_t s, uint32_t j0, uint32_t need,
                             uint32_t n_blocks, tdm_error_t *err)
{
    for (uint32_t j = j0; j < need; j++)
        if (blocks[j] >= n_blocks)
            return tdm_error_set(err, TDM_EINVALID,
                                 "seq %" PRIu32 ": block %" PRIu32 " (entry %" PRIu32
                                 ") is outside the pool (%" PRIu32 " blocks)",
                                 s, blocks[j], j, n_blocks);
    return TDM_OK;
}

/* Over a pool with layer groups: seq s has its group tables, and each group's entries from
 * the block of the oldest key its first row (position first) reads up to need - 1 are blocks
 * of the pool (earlier entries of a window group may have been given back). */
static int batch_check_groups(const tdm_engine_t *e, const tdm_batch_t *b, uint32_t s,
                              uint32_t first, uint32_t need, uint32_t n_blocks, tdm_error_t *err)
{
    const tdm_kv_groups_t *g = tdm_kv_pool_groups(e->pool);
    const uint32_t bs = tdm_kv_pool_layout(e->pool)->block_size;
    if (!b->seqs[s].group_blocks)
        return tdm_error_set(err, TDM_EINVALID,
                             "seq %" PRIu32 ": the KV pool has %" PRIu32 " layer groups, "
                             "group_blocks is required",
                             s, g->n_groups);
    for (uint32_t gi = 0; gi < g->n_groups; gi++) {
        uint32_t w = g->window[gi];
        uint32_t j0 = w == 0 || first + 1 <= w ? 0 : (first + 1 - w) / bs;
        int rc = batch_check_table(b->seqs[s].group_blocks[gi], s, j0, need, n_blocks, err);
        if (rc != TDM_OK)
            return rc;
    }
    return TDM_OK;
}

/* Checks every row of the batch before anything is computed; fills e->logit_rows. */
static int batch_check(tdm_engine_t *e, const tdm_batch_t *b, uint32_t *n_logits, tdm_error_t *err)
{
    const tdm_kv_layout_t *kl = tdm_kv_pool_layout(e->pool);
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(e->pool, &st);
    if (b->n_tokens == 0 || b->n_tokens > e->params.max_batch_tokens)
        return tdm_error_set(err, TDM_EINVALID,
                             "batch has %" PRIu32 " rows, must be 1..max_batch_tokens (%" PRIu32
                             ")",
                             b->n_tokens, e->params.max_batch_tokens);
    if (b->n_seqs == 0 || b->n_seqs > e->params.max_batch_tokens)
        return tdm_error_set(err, TDM_EINVALID,
                             "batch has %" PRIu32 " sequences, must be 1..%" PRIu32, b->n_seqs,
                             e->params.max_batch_tokens);
    memset(e->last_pos, 0, b->n_seqs * sizeof *e->last_pos);
    uint32_t nl = 0;
    for (uint32_t i = 0; i < b->n_tokens; i++) {
        int rc = batch_check_row(e, b, i, kl, &nl, err);
        if (rc != TDM_OK)
            return rc;
    }
    for (uint32_t s = 0; s < b->n_seqs; s++) {
        if (e->last_pos[s] == 0)
            continue;
        uint32_t need = (e->last_pos[s] - 1) / kl->block_size + 1;
        int rc = tdm_kv_pool_groups(e->pool)
                     ? batch_check_groups(e, b, s, e->first_pos[s], need, st.n_blocks, err)
                     : batch_check_table(b->seqs[s].blocks, s, 0, need, st.n_blocks, err);
        if (rc != TDM_OK)
            return rc;
    }
    *n_logits = nl;
    return TDM_OK;
}

/* The error of a failed op: the call, and the backend's detailed message when it keeps one
 * (CUDA: the failing statement, file and line). Returns rc. */
static int engine_op_failed(const tdm_engine_t *e, int rc, const char *call, tdm_error_t *err)
{
    const char *detail = e->ops->errmsg ? e->ops->errmsg(e->be) : "";
    if (detail[0])
        return tdm_error_set(err, rc, "forward: %s failed: %s", call, detail);
    return tdm_error_set(err, rc, "forward: %s failed", call);
}

#define TDM_TRY(call)                                                                              \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ != TDM_OK)                                                                         \
            return engine_op_failed(e, rc_, #call, err);                                           \
    } while (0)

/* ---- per-op timing ---- */

static double op_clock(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Ends the timing of an op of class c started at t0: waits for an asynchronous backend,
 * then adds the time. Returns the wait's status. */
static int op_timed(tdm_engine_t *e, tdm_op_class_t c, double t0)
{
    int rc = e->ops->sync ? e->ops->sync(e->be) : TDM_OK;
    e->times.seconds[c] += op_clock() - t0;
    e->times.calls[c]++;
    return rc;
}

/* TDM_TRY for an op of class cls, timed when timing is on. */
#define TDM_OP(cls, call)                                                                          \
    do {                                                                                           \
        double t0_ = e->timing ? op_clock() : 0.0;                                                 \
        int rc_ = (call);                                                                          \
        if (rc_ == TDM_OK && e->timing)                                                            \
            rc_ = op_timed(e, cls, t0_);                                                           \
        if (rc_ != TDM_OK)                                                                         \
            return engine_op_failed(e, rc_, #call, err);                                           \
    } while (0)

const char *tdm_op_class_name(tdm_op_class_t c)
{
    static const char *const names[TDM_OP_N_CLASSES] = {
        "gemm", "head", "moe", "attention", "kv_store", "norm", "rope", "act", "other"};
    return (unsigned)c < TDM_OP_N_CLASSES ? names[c] : "?";
}

void tdm_engine_op_timing(tdm_engine_t *e, bool on)
{
    if (on && !e->timing)
        memset(&e->times, 0, sizeof e->times);
    e->timing = on;
}

void tdm_engine_op_times(const tdm_engine_t *e, tdm_op_times_t *out)
{
    *out = e->times;
}

/* x += the sub-layer's output in e->proj ([n][n_embd]), RMS-normed by post_norm first when
 * the model has post-norms (Gemma 3). */
static int forward_residual(tdm_engine_t *e, const tdm_weight_t *post_norm, uint32_t n,
                            tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = &e->model->hp;
    const float *y = e->proj;
    if (hp->post_norms) {
        TDM_OP(TDM_OP_NORM, e->ops->rmsnorm(e->be, e->proj, post_norm, n, hp->rms_norm_eps, e->xn));
        y = e->xn;
    }
    TDM_OP(TDM_OP_OTHER, e->ops->add(e->be, e->x, y, (size_t)n * hp->n_embd));
    return TDM_OK;
}

/* The attention sub-layer of layer l: x += W_o · attn(...) (post-normed when the model has
 * post-norms). */
static int forward_attention(tdm_engine_t *e, uint32_t l, const tdm_fwd_rows_t *rows,
                             tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = &e->model->hp;
    const tdm_layer_weights_t *lw = &e->model->layers[l];
    const tdm_backend_ops_t *ops = e->ops;
    void *be = e->be;
    uint32_t n = rows->n;
    TDM_OP(TDM_OP_NORM, ops->rmsnorm(be, e->x, &lw->attn_norm, n, hp->rms_norm_eps, e->xn));
    const tdm_weight_t *qkv_w[3] = {&lw->wq, &lw->wk, &lw->wv};
    float *qkv_out[3] = {e->q, e->k, e->v};
    TDM_OP(TDM_OP_GEMM, ops->matmul(be, e->xn, n, 3, qkv_w, qkv_out));
    if (hp->has_qkv_bias) {
        TDM_OP(TDM_OP_OTHER, ops->add_bias(be, e->q, &lw->bq, n));
        TDM_OP(TDM_OP_OTHER, ops->add_bias(be, e->k, &lw->bk, n));
        TDM_OP(TDM_OP_OTHER, ops->add_bias(be, e->v, &lw->bv, n));
    }
    if (hp->qk_norm) { /* per head: n * heads rows of head_dim */
        TDM_OP(TDM_OP_NORM,
               ops->rmsnorm(be, e->q, &lw->q_norm, n * hp->n_heads, hp->rms_norm_eps, e->q));
        TDM_OP(TDM_OP_NORM,
               ops->rmsnorm(be, e->k, &lw->k_norm, n * hp->n_kv_heads, hp->rms_norm_eps, e->k));
    }
    TDM_OP(TDM_OP_ROPE, ops->rope(be, l, e->q, e->k, rows));
    if (hp->attn_q_scale > 0.0f)
        TDM_OP(TDM_OP_OTHER,
               ops->scale(be, e->q, hp->attn_q_scale, (size_t)n * hp->n_heads * hp->head_dim));
    TDM_OP(TDM_OP_KV_STORE, ops->kv_store(be, l, e->k, e->v, rows));
    TDM_OP(TDM_OP_ATTENTION, ops->attention(be, l, e->q, rows, e->attn));
    const tdm_weight_t *wo[1] = {&lw->wo};
    float *proj[1] = {e->proj};
    TDM_OP(TDM_OP_GEMM, ops->matmul(be, e->attn, n, 1, wo, proj));
    return forward_residual(e, &lw->post_attn_norm, n, err);
}

/* The feed-forward sub-layer of layer l: x += W_down · (act(W_gate · h) ⊙ (W_up · h)), or
 * with experts x += the backend's moe_ffn of h (backend.h). */
static int forward_ffn(tdm_engine_t *e, uint32_t l, uint32_t n, tdm_error_t *err)
{
    const tdm_llama_hparams_t *hp = &e->model->hp;
    const tdm_layer_weights_t *lw = &e->model->layers[l];
    const tdm_backend_ops_t *ops = e->ops;
    void *be = e->be;
    size_t F = (size_t)n * hp->n_ff;
    TDM_OP(TDM_OP_NORM, ops->rmsnorm(be, e->x, &lw->ffn_norm, n, hp->rms_norm_eps, e->xn));
    if (hp->n_expert > 0) {
        TDM_OP(TDM_OP_MOE, ops->moe_ffn(be, l, e->xn, n, e->proj));
        return forward_residual(e, &lw->post_ffn_norm, n, err);
    }
    const tdm_weight_t *gu_w[2] = {&lw->w_gate, &lw->w_up};
    float *gu_out[2] = {e->gate, e->up};
    TDM_OP(TDM_OP_GEMM, ops->matmul(be, e->xn, n, 2, gu_w, gu_out));
    if (hp->ffn_act == TDM_FFN_GELU_TANH)
        TDM_OP(TDM_OP_ACT, ops->geglu(be, e->gate, e->up, F, e->gate));
    else
        TDM_OP(TDM_OP_ACT, ops->swiglu(be, e->gate, e->up, F, e->gate));
    const tdm_weight_t *wd[1] = {&lw->w_down};
    float *proj[1] = {e->proj};
    TDM_OP(TDM_OP_GEMM, ops->matmul(be, e->gate, n, 1, wd, proj));
    return forward_residual(e, &lw->post_ffn_norm, n, err);
}

/* The logits of the n_logits asking rows into the caller's host array: final norm, output
 * matrix, then the soft-cap c * tanh(logits / c) when the model has one (llama.cpp applies
 * it as scale, tanh, scale). */
static int forward_logits(tdm_engine_t *e, uint32_t n_logits, float *logits, tdm_error_t *err)
{
    const tdm_model_t *m = e->model;
    const tdm_llama_hparams_t *hp = &m->hp;
    const tdm_backend_ops_t *ops = e->ops;
    void *be = e->be;
    TDM_OP(TDM_OP_OTHER, ops->gather_rows(be, e->x, e->logit_rows, n_logits, hp->n_embd, e->sel));
    TDM_OP(TDM_OP_NORM,
           ops->rmsnorm(be, e->sel, &m->output_norm, n_logits, hp->rms_norm_eps, e->seln));
    const tdm_weight_t *wout[1] = {&m->output};
    float *lo[1] = {ops->host_memory ? logits : e->logits};
    TDM_OP(TDM_OP_HEAD, ops->matmul(be, e->seln, n_logits, 1, wout, lo));
    if (!ops->host_memory)
        TDM_OP(TDM_OP_OTHER, ops->read(be, e->logits, (size_t)n_logits * hp->n_vocab, logits));
    float cap = hp->final_logit_softcap;
    if (cap > 0.0f) {
        float inv = 1.0f / cap;
        size_t count = (size_t)n_logits * hp->n_vocab;
        for (size_t i = 0; i < count; i++)
            logits[i] = tanhf(logits[i] * inv) * cap;
    }
    return TDM_OK;
}

/* The final hidden states of all n rows, after the output norm (llama.cpp's result_norm, the
 * input of the LM head), into the caller's host array hidden[n][n_embd]. Uses e->xn, free at
 * this point (the layers are done). */
static int forward_hidden(tdm_engine_t *e, uint32_t n, float *hidden, tdm_error_t *err)
{
    const tdm_model_t *m = e->model;
    const tdm_llama_hparams_t *hp = &m->hp;
    size_t count = (size_t)n * hp->n_embd;
    TDM_OP(TDM_OP_NORM, e->ops->rmsnorm(e->be, e->x, &m->output_norm, n, hp->rms_norm_eps, e->xn));
    if (e->ops->host_memory)
        memcpy(hidden, e->xn, count * sizeof *hidden);
    else
        TDM_OP(TDM_OP_OTHER, e->ops->read(e->be, e->xn, count, hidden));
    return TDM_OK;
}

int tdm_engine_forward(tdm_engine_t *e, const tdm_batch_t *b, float *logits, tdm_error_t *err)
{
    return tdm_engine_forward_hidden(e, b, logits, NULL, err);
}

static int forward_pass(tdm_engine_t *e, const tdm_batch_t *b, float *logits, float *hidden,
                        tdm_error_t *err);

int tdm_engine_forward_hidden(tdm_engine_t *e, const tdm_batch_t *b, float *logits, float *hidden,
                              tdm_error_t *err)
{
    if (!e->timing)
        return forward_pass(e, b, logits, hidden, err);
    double t0 = op_clock();
    int rc = forward_pass(e, b, logits, hidden, err);
    e->times.forward_seconds += op_clock() - t0;
    e->times.forwards++;
    return rc;
}

/* One forward pass (tdm_engine_forward_hidden without the timing of the whole). */
static int forward_pass(tdm_engine_t *e, const tdm_batch_t *b, float *logits, float *hidden,
                        tdm_error_t *err)
{
    uint32_t n_logits = 0;
    int rc = batch_check(e, b, &n_logits, err);
    if (rc != TDM_OK)
        return rc;
    const tdm_model_t *m = e->model;
    const tdm_llama_hparams_t *hp = &m->hp;
    const tdm_backend_ops_t *ops = e->ops;
    void *be = e->be;
    uint32_t n = b->n_tokens;
    tdm_fwd_rows_t rows = {.n = n, .pos = b->pos, .seq = b->seq, .seqs = b->seqs};

    if (ops->begin)
        TDM_OP(TDM_OP_OTHER, ops->begin(be, &rows, b->tokens, e->logit_rows, n_logits));
    TDM_OP(TDM_OP_OTHER, ops->embed(be, &m->token_embd, b->tokens, n, e->x));
    if (hp->embd_scale != 1.0f)
        TDM_OP(TDM_OP_OTHER, ops->scale(be, e->x, hp->embd_scale, (size_t)n * hp->n_embd));
    for (uint32_t l = 0; l < hp->n_layers; l++)
        if ((rc = forward_attention(e, l, &rows, err)) != TDM_OK ||
            (rc = forward_ffn(e, l, n, err)) != TDM_OK)
            return rc;
    if (hidden && (rc = forward_hidden(e, n, hidden, err)) != TDM_OK)
        return rc;
    if (n_logits > 0)
        return forward_logits(e, n_logits, logits, err);
    if (ops->sync)
        TDM_TRY(ops->sync(be));
    return TDM_OK;
}
#undef TDM_TRY
#undef TDM_OP
