/* cmd_inspect.c - `tandem inspect MODEL.gguf`: what a GGUF file holds and what serving it costs.
 * Prints the file summary, the Llama hyperparameters (or why the file is not a servable
 * model), the tokenizer summary, tensor types, the tensor table, total weight bytes and the
 * KV-cache bytes per token at f16. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/gguf.h"
#include "tandem/kv.h"
#include "tandem/tokenizer.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: tandem inspect [options] MODEL.gguf\n"
                 "\n"
                 "Shows a GGUF model: architecture, hyperparameters, tokenizer, tensor table with\n"
                 "types and sizes, total weight bytes and KV-cache bytes per token (f16).\n"
                 "\n"
                 "options:\n"
                 "  --metadata   also print every metadata key and value\n"
                 "  --brief      omit the per-tensor table\n"
                 "  -h, --help   this help\n");
}

static void print_bytes(const char *label, uint64_t bytes)
{
    printf("%-26s %" PRIu64 " bytes (%.2f MiB)\n", label, bytes, (double)bytes / (1024.0 * 1024.0));
}

/* The architecture's features beyond the Llama block (Gemma 3's sliding-window layers, Llama 3's
 * RoPE frequency factors, QK-norm, post-norms, GeGLU, scales, soft-cap), one line each, only
 * those the model has. */
static void print_arch_features(const tdm_llama_hparams_t *hp)
{
    if (hp->n_swa) {
        uint32_t n_local = 0;
        for (uint32_t l = 0; l < hp->n_layers && l < TDM_GGUF_MAX_LAYERS; l++)
            n_local += hp->swa_layers[l];
        printf("sliding window:            %" PRIu32 " tokens in %" PRIu32 " of %" PRIu32
               " layers (theta %g there; the others global)\n",
               hp->n_swa, n_local, hp->n_layers, (double)hp->rope_freq_base_swa);
    }
    if (hp->n_rope_freq_factors)
        printf("RoPE frequency factors:    %" PRIu32 " (rope_freqs.weight, %g to %g)\n",
               hp->n_rope_freq_factors, (double)hp->rope_freq_factors[0],
               (double)hp->rope_freq_factors[hp->n_rope_freq_factors - 1]);
    if (hp->n_rope_long_short)
        printf("RoPE long/short factors:   %" PRIu32 " each (rope_factors_long / _short.weight); "
               "long above %" PRIu32 " tokens of context\n",
               hp->n_rope_long_short, hp->n_ctx_orig);
    if (hp->rope_attn_factor != 1.0f)
        printf("RoPE attention factor:     %g\n", (double)hp->rope_attn_factor);
    if (hp->fused_qkv || hp->fused_gate_up)
        printf("fused projections:         %s%s%s\n", hp->fused_qkv ? "attn_qkv" : "",
               hp->fused_qkv && hp->fused_gate_up ? ", " : "",
               hp->fused_gate_up ? "ffn_up (gate and up)" : "");
    if (hp->qk_norm || hp->post_norms)
        printf("norms:                     %s%s%s\n", hp->qk_norm ? "QK-norm" : "",
               hp->qk_norm && hp->post_norms ? ", " : "", hp->post_norms ? "post-norms" : "");
    printf("ffn:                       %s\n",
           hp->ffn_act == TDM_FFN_GELU_TANH ? "GeGLU (tanh GELU)" : "SwiGLU");
    if (hp->n_expert > 0)
        printf("experts:                   %" PRIu32 " per layer, %" PRIu32
               " per token, hidden %" PRIu32 " (softmax gating, weights renormalised)\n",
               hp->n_expert, hp->n_expert_used, hp->n_ff_exp);
    if (hp->embd_scale != 1.0f || hp->attn_q_scale > 0.0f)
        printf("scales:                    embeddings x %g, q x %g\n", (double)hp->embd_scale,
               (double)(hp->attn_q_scale > 0.0f ? hp->attn_q_scale : 1.0f));
    if (hp->final_logit_softcap > 0.0f)
        printf("logit soft-cap:            %g\n", (double)hp->final_logit_softcap);
}
static void print_hparams(const tdm_gguf_t *g)
{
    tdm_llama_hparams_t hp;
    tdm_error_t err = {0};
    if (tdm_gguf_llama_hparams(g, &hp, &err) != TDM_OK) {
        printf("model:                     not servable: %s\n", err.msg);
        return;
    }
    printf("architecture:              %s\n", hp.arch);
    printf("layers:                    %" PRIu32 "\n", hp.n_layers);
    printf("embedding (d_model):       %" PRIu32 "\n", hp.n_embd);
    printf("heads:                     %" PRIu32 "\n", hp.n_heads);
    printf("kv heads:                  %" PRIu32 "%s\n", hp.n_kv_heads,
           hp.n_kv_heads < hp.n_heads ? " (GQA)" : "");
    printf("head_dim:                  %" PRIu32 "\n", hp.head_dim);
    printf("ffn hidden:                %" PRIu32 "\n", hp.n_ff);
    printf("vocab:                     %" PRIu32 "\n", hp.n_vocab);
    printf("context (trained):         %" PRIu32 "\n", hp.n_ctx_train);
    printf("rms_norm_eps:              %g\n", (double)hp.rms_norm_eps);
    printf("rope:                      %s, theta %g, %" PRIu32 " dims\n",
           hp.rope_type == TDM_ROPE_NEOX ? "neox" : "normal", (double)hp.rope_freq_base,
           hp.rope_dim);
    if (hp.rope_freq_scale != 1.0f)
        printf("rope scaling:              linear, positions x %g\n", (double)hp.rope_freq_scale);
    print_arch_features(&hp);
    printf("output matrix:             %s\n",
           hp.tied_embeddings ? "tied to token_embd.weight" : "output.weight");
    printf("qkv bias:                  %s\n", hp.has_qkv_bias ? "yes" : "no");
    /* the sizing function the KV pools and `tandem kvcalc` use (tandem/kv.h) */
    tdm_kv_layout_t kl = {hp.n_layers, hp.n_kv_heads, hp.head_dim, 16, TDM_KV_F16};
    uint64_t kv_tok = tdm_kv_bytes_per_token(&kl);
    printf("kv cache per token (f16):  %" PRIu64 " bytes\n", kv_tok);
    printf("kv cache per full context: %" PRIu64 " bytes (%.2f MiB at %" PRIu32 " tokens)\n",
           kv_tok * hp.n_ctx_train, (double)(kv_tok * hp.n_ctx_train) / (1024.0 * 1024.0),
           hp.n_ctx_train);
}

static void print_tokenizer(const tdm_gguf_t *g)
{
    tdm_error_t err = {0};
    tdm_tokenizer_t *tok = tdm_tokenizer_new(g, &err);
    if (!tok) {
        printf("tokenizer:                 unusable: %s\n", err.msg);
        return;
    }
    printf("tokenizer:                 %s, pre-tokenizer %s, %" PRIu32 " tokens\n",
           tdm_tokenizer_kind(tok) == TDM_TOKENIZER_BPE ? "byte-level BPE (gpt2)"
                                                        : "SentencePiece BPE (llama)",
           tdm_tokenizer_pre(tok), tdm_tokenizer_n_vocab(tok));
    tdm_token_t ids[3] = {tdm_tokenizer_bos(tok), tdm_tokenizer_eos(tok), tdm_tokenizer_eot(tok)};
    const char *names[3] = {"bos", "eos", "eot"};
    for (int i = 0; i < 3; i++) {
        size_t len = 0;
        const char *piece = ids[i] >= 0 ? tdm_tokenizer_piece(tok, ids[i], &len) : NULL;
        if (piece) {
            /* a vocabulary string from the file: printable ASCII as is, other bytes escaped */
            printf("  %s:                     %" PRId32 " ", names[i], ids[i]);
            for (size_t k = 0; k < len && k < 64; k++) {
                unsigned char ch = (unsigned char)piece[k];
                if (ch >= 0x20 && ch < 0x7f && ch != '\\')
                    putchar(ch);
                else
                    printf("\\x%02x", ch);
            }
            putchar('\n');
        } else
            printf("  %s:                     none\n", names[i]);
    }
    printf("  add bos:                 %s\n", tdm_tokenizer_add_bos(tok) ? "yes" : "no");
    tdm_tokenizer_destroy(&tok);
}

/* The tensor types: count and bytes per type, then the weights' total. */
static void print_tensor_types(const tdm_gguf_t *g)
{
    uint64_t count[TDM_GGML_TYPE_COUNT] = {0}, bytes[TDM_GGML_TYPE_COUNT] = {0};
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        count[t->type]++;
        bytes[t->type] += t->n_bytes;
    }
    printf("tensor types:\n");
    for (int t = 0; t < TDM_GGML_TYPE_COUNT; t++)
        if (count[t])
            printf("  %-6s %5" PRIu64 " tensors %12" PRIu64 " bytes\n",
                   tdm_ggml_type_get((uint32_t)t)->name, count[t], bytes[t]);
    print_bytes("weights:", tdm_gguf_tensor_bytes(g));
}

/* Every metadata key with its type and value (--metadata). */
static void print_metadata(const tdm_gguf_t *g)
{
    printf("metadata:\n");
    for (uint64_t i = 0; i < tdm_gguf_n_kv(g); i++) {
        char buf[512];
        const tdm_gguf_kv_t *kv = tdm_gguf_kv_at(g, i);
        printf("  %-44s %-8s %s\n", kv->key, tdm_gguf_vtype_name(kv->type),
               tdm_gguf_kv_format(kv, buf, sizeof buf));
    }
}

/* One line per tensor: name, type, shape and bytes. */
static void print_tensors(const tdm_gguf_t *g)
{
    printf("%-34s %-6s %-24s %12s\n", "tensor", "type", "shape", "bytes");
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        char shape[96];
        int n = snprintf(shape, sizeof shape, "[%" PRIu64, t->ne[0]);
        for (uint32_t d = 1; d < t->n_dims && n > 0 && (size_t)n < sizeof shape; d++)
            n += snprintf(shape + n, sizeof shape - (size_t)n, ", %" PRIu64, t->ne[d]);
        if (n > 0 && (size_t)n < sizeof shape)
            snprintf(shape + n, sizeof shape - (size_t)n, "]");
        printf("%-34s %-6s %-24s %12zu\n", t->name, tdm_ggml_type_get(t->type)->name, shape,
               t->n_bytes);
    }
}

/* The file's summary: version, size, counts and the model's name. */
static void print_summary(const char *path, const tdm_gguf_t *g)
{
    printf("file:                      %s\n", path);
    printf("gguf version:              %" PRIu32 "\n", tdm_gguf_version(g));
    print_bytes("file size:", tdm_gguf_file_size(g));
    printf("metadata keys:             %" PRIu64 "\n", tdm_gguf_n_kv(g));
    printf("tensors:                   %" PRIu64 "\n", tdm_gguf_n_tensors(g));
    const tdm_gguf_kv_t *name = tdm_gguf_find_kv(g, "general.name");
    if (name) {
        char buf[512];
        printf("name:                      %s\n", tdm_gguf_kv_format(name, buf, sizeof buf));
    }
}

int tdm_cmd_inspect(int argc, char **argv)
{
    bool show_metadata = false, brief = false, done;
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_TRUE("metadata", 0, &show_metadata),
        TDM_CLI_OPT_TRUE("brief", 0, &brief),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {"tandem inspect", usage, NULL, opts};
    int status = tdm_cli_parse(&spec, argc, argv, &done);
    if (done)
        return status;
    if (optind != argc - 1) {
        fprintf(stderr, "tandem inspect: expected exactly one MODEL.gguf argument\n");
        usage(stderr);
        return 2;
    }
    const char *path = argv[optind];
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(path, &err);
    if (!g) {
        fprintf(stderr, "tandem inspect: %s\n", err.msg);
        return 1;
    }
    bool has_tensors = tdm_gguf_n_tensors(g) > 0;
    print_summary(path, g);
    if (has_tensors)
        print_hparams(g);
    print_tokenizer(g);
    if (has_tensors)
        print_tensor_types(g);
    if (show_metadata)
        print_metadata(g);
    if (!brief && has_tensors)
        print_tensors(g);
    tdm_gguf_destroy(&g);
    return 0;
}
