/* cmd_kvcalc.c - `tandem kvcalc`: how much memory the KV cache needs for a model, a context
 * length and a number of users, and how many blocks a memory budget buys.
 *
 * Every figure comes from tdm_kv_plan (tandem/kv.h), built on the nodes' own sizing functions and
 * shared with the dashboard's /api/capacity, so the plan and the running system agree to the
 * byte: a sequence of C tokens takes ceil(C / block_size) blocks of tdm_kv_block_bytes() each,
 * or with -m on a model with sliding-window layers (unless --all-layers) the per-layer-group
 * formula (tdm_kv_groups_blocks_per_seq) in blocks of one group's layers, as a colocated CPU
 * decode node allocates (tdm_node_kv_groups).
 * docs/capacity.md explains the formula with worked examples. */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/config.h"
#include "tandem/gguf.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#include "tandem/node_runtime.h"
#include "tandem/worker.h"

#define MAX_DIM 65536        /* layers, heads, head_dim */
#define MAX_CONTEXT 16777216 /* tokens (2^24) */
#define MAX_USERS 1048576

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem kvcalc -m MODEL.gguf [options]\n"
            "       tandem kvcalc --layers N --kv-heads N --head-dim N [--heads N] [options]\n"
            "\n"
            "Sizes the paged KV cache: bytes per token, per sequence and for all users, and\n"
            "with --memory how many blocks the budget holds after the weights and whether\n"
            "everything fits. Same arithmetic as the nodes' KV pools.\n"
            "\n"
            "model (a GGUF file, or its shape given explicitly):\n"
            "  -m, --model FILE      read layers, heads, head_dim and context, and measure the\n"
            "                        weights and engine scratch as a CPU node holds them\n"
            "  --layers N            transformer blocks (1..%d)\n"
            "  --kv-heads N          KV heads (1..%d)\n"
            "  --head-dim N          values per head (4..%d, a multiple of 4)\n"
            "  --heads N             query heads, to show the GQA saving (a multiple of\n"
            "                        --kv-heads; default: --kv-heads)\n"
            "  --weights-bytes SIZE  weight bytes (default: the model's tensors, else 0)\n"
            "\n"
            "options:\n"
            "  --dtype f32|f16|q8    KV dtype (default f16)\n"
            "  --block-size N        tokens per block, a power of two in 1..256 (default 16)\n"
            "  --context N           tokens per sequence, 1..%d (default: the context a\n"
            "                        cluster serves the model with, else 4096)\n"
            "  --users N             concurrent full-context sequences, 1..%d (default 1)\n"
            "  --memory SIZE         memory for weights + KV: 80GiB, 512MiB, 1.5GB or bytes\n"
            "  --threads N           -m: the engine threads of the node measured (default:\n"
            "                        the node default, 0 = all cores)\n"
            "  --all-layers          -m: every block holds every layer, as prefill nodes, decode\n"
            "                        nodes of a cluster with prefill nodes and CUDA nodes\n"
            "                        allocate; default for a model with sliding-window layers:\n"
            "                        per layer group, as a CPU decode node of a cluster without\n"
            "                        prefill nodes does (windows keep only their blocks)\n"
            "  --json                print JSON instead of a table\n"
            "  -h, --help            this help\n",
            MAX_DIM, MAX_DIM, MAX_DIM, MAX_CONTEXT, MAX_USERS);
}

/* Everything the report shows: the question (tdm_kv_plan's input) and its plan. */
typedef struct kvcalc {
    const char *model;             /* path, or NULL for an explicit shape */
    uint64_t file_weight_bytes;    /* -m: the file's tensor bytes (in.weight_bytes: resident) */
    const tdm_node_config_t *node; /* -m: the default decode node whose engine was measured */
    char arch[32];                 /* the model's architecture, "" for explicit */
    tdm_kv_plan_in_t in;           /* layout, n_heads, n_ctx, n_users, weight_bytes, memory,
                                      groups (&groups or NULL) */
    tdm_kv_groups_t groups;        /* -m: the model's layer groups (tdm_model_kv_groups) */
    bool have_groups;              /* the model has sliding-window layers */
    tdm_kv_plan_t plan;            /* every derived figure */
} kvcalc_t;

/* Prints "tandem kvcalc: <message>" and returns 2 (bad usage). */
static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tandem kvcalc: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see tandem kvcalc --help)\n");
    va_end(ap);
    return 2;
}

/* Parses a decimal integer in [lo, hi]; false for anything else. */
static bool parse_uint(const char *text, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (!text || *text < '0' || *text > '9')
        return false;
    errno = 0;
    char *end;
    unsigned long long v = strtoull(text, &end, 10);
    if (errno != 0 || *end != '\0' || v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

/* An integer option in [lo, hi] into *out; on failure prints the option and range and returns
 * false. */
static bool opt_uint(const char *name, const char *text, uint64_t lo, uint64_t hi, uint64_t *out)
{
    if (parse_uint(text, lo, hi, out))
        return true;
    bad_usage("--%s must be an integer in %" PRIu64 "..%" PRIu64 ", got '%s'", name, lo, hi, text);
    return false;
}

/* Writes n with thousands separators ("524,288") into buf (32 bytes suffice); returns buf. */
static char *fmt_count(uint64_t n, char *buf)
{
    char digits[24];
    int len = snprintf(digits, sizeof digits, "%" PRIu64, n);
    int out = 0;
    for (int i = 0; i < len; i++) {
        if (i > 0 && (len - i) % 3 == 0)
            buf[out++] = ',';
        buf[out++] = digits[i];
    }
    buf[out] = '\0';
    return buf;
}

/* Writes bytes in the largest binary unit below it ("2.00 GiB") into buf (32 bytes). */
static char *fmt_human(uint64_t bytes, char *buf)
{
    static const char *const units[] = {"KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
    if (bytes < 1024) {
        snprintf(buf, 32, "%" PRIu64 " B", bytes);
        return buf;
    }
    double v = (double)bytes;
    int u = -1;
    while (v >= 1024.0 && u < 5) {
        v /= 1024.0;
        u++;
    }
    snprintf(buf, 32, "%.2f %s", v, units[u]);
    return buf;
}

/* Reads the shape, context and weight bytes of a GGUF model. Returns 0, or 1 after printing
 * why the file cannot be used. */
static int load_model(kvcalc_t *k, uint64_t *n_ctx)
{
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(k->model, &err);
    if (!g) {
        fprintf(stderr, "tandem kvcalc: %s\n", err.msg);
        return 1;
    }
    tdm_llama_hparams_t hp;
    if (tdm_gguf_llama_hparams(g, &hp, &err) != TDM_OK) {
        fprintf(stderr, "tandem kvcalc: %s: %s\n", k->model, err.msg);
        tdm_gguf_destroy(&g);
        return 1;
    }
    snprintf(k->arch, sizeof k->arch, "%s", hp.arch);
    k->in.layout.n_layers = hp.n_layers;
    k->in.layout.n_kv_heads = hp.n_kv_heads;
    k->in.layout.head_dim = hp.head_dim;
    k->in.n_heads = hp.n_heads;
    k->have_groups = tdm_model_kv_groups(&hp, &k->groups);
    k->in.weight_bytes = tdm_gguf_tensor_bytes(g);
    *n_ctx = tdm_model_serve_n_ctx(&hp, 0); /* the context a cluster serves the model with */
    tdm_gguf_destroy(&g);
    return 0;
}

/* The explicit shape (--layers, --kv-heads, --head-dim, --heads; NULL when not given) into
 * k->in. Returns 0, or 2 after printing which option is wrong. */
static int parse_shape(kvcalc_t *k, const char *layers, const char *kv_heads, const char *head_dim,
                       const char *heads)
{
    uint64_t v;
    if (!layers || !kv_heads || !head_dim)
        return bad_usage("give -m MODEL, or all of --layers, --kv-heads and --head-dim");
    if (!opt_uint("layers", layers, 1, MAX_DIM, &v))
        return 2;
    k->in.layout.n_layers = (uint32_t)v;
    if (!opt_uint("kv-heads", kv_heads, 1, MAX_DIM, &v))
        return 2;
    k->in.layout.n_kv_heads = (uint32_t)v;
    if (!parse_uint(head_dim, 4, MAX_DIM, &v) || v % 4 != 0)
        return bad_usage("--head-dim must be a multiple of 4 in 4..%d, got '%s'", MAX_DIM,
                         head_dim);
    k->in.layout.head_dim = (uint32_t)v;
    k->in.n_heads = k->in.layout.n_kv_heads;
    if (heads) {
        if (!opt_uint("heads", heads, 1, MAX_DIM, &v))
            return 2;
        if (v % k->in.layout.n_kv_heads != 0)
            return bad_usage("--heads must be a multiple of --kv-heads (%" PRIu32 "), got %" PRIu64,
                             k->in.layout.n_kv_heads, v);
        k->in.n_heads = (uint32_t)v;
    }
    return 0;
}

/* Fills in k->plan (tdm_kv_plan). Returns 0, or 2 after printing what is wrong: a block over
 * 4 GiB, or a product over 2^64. */
static int compute(kvcalc_t *k)
{
    tdm_error_t err = {0};
    int rc = tdm_kv_plan(&k->in, &k->plan, &err);
    if (rc == TDM_ERESOURCE)
        return bad_usage("--users %" PRIu64 " x --context %" PRIu64 " needs more than 2^64 bytes",
                         k->in.n_users, k->in.n_ctx);
    if (rc != TDM_OK) {
        /* every option is in range by now; what is left to fail is a block over 4 GiB */
        char n[32];
        return bad_usage("one KV block would take %s bytes, more than a block may (4 GiB); "
                         "use a smaller --block-size",
                         fmt_count(tdm_kv_block_bytes(&k->in.layout), n));
    }
    return 0;
}

/* -m without --weights-bytes: the memory a node's engine takes for the model, measured the way
 * the node measures it before sizing its pool (tdm_node_measure_engine: the CPU engine repacks
 * quantized matrices, K-quants among them, into copies that may be larger than the file's
 * bytes), with the engine settings of the default config's decode node (cfg, loaded by the
 * caller), its threads replaced by threads when >= 0 (--threads). Returns 0, or 1 after printing
 * why the model cannot be measured. */
static int measure(kvcalc_t *k, tdm_config_t *cfg, long threads)
{
    tdm_node_config_t *node = NULL;
    for (size_t i = 0; i < cfg->n_nodes && !node; i++)
        if (cfg->nodes[i].role == TDM_NODE_ROLE_DECODE)
            node = &cfg->nodes[i];
    tdm_error_t err = {0};
    tdm_model_t *m = node ? tdm_model_load(k->model, &err) : NULL;
    if (!m) {
        fprintf(stderr, "tandem kvcalc: %s: %s\n", k->model,
                node ? err.msg : "the default config has no decode node");
        return 1;
    }
    if (threads >= 0)
        node->threads = (int)threads;
    tdm_worker_opts_t rows = {.mode = TDM_WORKER_MODE_DECODE,
                              .max_running = (uint32_t)node->max_running,
                              .max_draft = (uint32_t)node->spec_max_draft};
    tdm_engine_params_t ep; /* as tdm_node_runtime_open sets them */
    tdm_engine_params_default(&ep);
    ep.n_threads = node->threads;
    /* a node's at this context (its model.max_context; the prompt-logprobs reserve in the
     * scratch grows with it), at most the trained context, as the node's */
    ep.n_ctx = tdm_model_serve_n_ctx(tdm_model_hparams(m), (uint32_t)k->in.n_ctx);
    ep.max_batch_tokens = (uint32_t)node->max_batch_tokens;
    ep.max_logits = tdm_worker_logit_rows(&rows);
    k->file_weight_bytes = k->in.weight_bytes;
    int rc = tdm_node_measure_engine(m, &k->in.layout, &ep, false, &k->in.weight_bytes,
                                     &k->in.scratch_bytes, &err);
    tdm_model_destroy(&m);
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem kvcalc: %s: %s\n", k->model, err.msg);
        return 1;
    }
    k->node = node;
    return 0;
}

/* The table's lines on how a CPU node holds the weights (-m) and on layer groups. */
static void print_node_and_groups(const kvcalc_t *k)
{
    char a[32], b[32], c[32];
    if (k->node) {
        printf("  as a CPU node holds them: the file's tensors are %s bytes; the engine's "
               "repacked copies are in its scratch\n",
               fmt_count(k->file_weight_bytes, a));
        char threads[24] = "all cores";
        if (k->node->threads > 0)
            snprintf(threads, sizeof threads, "%d", k->node->threads);
        printf("engine scratch:           %s bytes (%s; node defaults: threads %s, "
               "max_batch_tokens %d, max_running %d)\n",
               fmt_count(k->in.scratch_bytes, b), fmt_human(k->in.scratch_bytes, c), threads,
               k->node->max_batch_tokens, k->node->max_running);
    }
    if (k->in.groups) {
        const tdm_kv_groups_t *g = k->in.groups;
        printf("layer groups:             %" PRIu32 " of %" PRIu32 " layers (%" PRIu32
               " full attention, %" PRIu32 " sliding window of %" PRIu32
               " tokens); a block holds one group's layers (as a CPU node whose model has no "
               "CUDA node in the config allocates; --all-layers for the others)\n",
               g->n_groups, g->layers_per_group, g->n_full, g->n_groups - g->n_full,
               g->window[g->n_groups - 1]);
    } else if (k->have_groups) {
        printf("layer groups:             none (--all-layers: every block holds every layer)\n");
    }
}

static void print_table(const kvcalc_t *k)
{
    char a[32], b[32], c[32], d[32];
    const tdm_kv_layout_t *l = &k->in.layout;
    if (k->model)
        printf("model:                    %s (%s)\n", k->model, k->arch);
    printf("layout:                   %" PRIu32 " layers, %" PRIu32 " KV heads, head_dim %" PRIu32
           ", %s, block_size %" PRIu32 "\n",
           l->n_layers, l->n_kv_heads, l->head_dim, tdm_kv_dtype_name(l->dtype), l->block_size);
    printf("weights:                  %s bytes (%s)\n", fmt_count(k->in.weight_bytes, a),
           fmt_human(k->in.weight_bytes, b));
    print_node_and_groups(k);
    printf("KV per token:             %s bytes (%s)%s\n", fmt_count(k->plan.bytes_per_token, a),
           fmt_human(k->plan.bytes_per_token, b), l->dtype == TDM_KV_Q8 ? ", plus q8 scales" : "");
    printf("KV per block:             %s bytes (%" PRIu32 " tokens%s)\n",
           fmt_count(k->plan.block_bytes, a), l->block_size,
           l->dtype == TDM_KV_Q8 ? ", scales included" : "");
    printf("KV per sequence:          %s bytes (%s tokens, %s blocks, %s)\n",
           fmt_count(k->plan.bytes_per_seq, a), fmt_count(k->in.n_ctx, b),
           fmt_count(k->plan.blocks_per_seq, c), fmt_human(k->plan.bytes_per_seq, d));
    char label[64];
    snprintf(label, sizeof label, "KV for %s user%s:", fmt_count(k->in.n_users, d),
             k->in.n_users == 1 ? "" : "s");
    printf("%-25s %s bytes (%s blocks, %s)\n", label, fmt_count(k->plan.bytes_total, a),
           fmt_count(k->plan.blocks_total, b), fmt_human(k->plan.bytes_total, c));
    printf("%-25s %s bytes (%s)\n",
           k->in.scratch_bytes ? "weights + scratch + KV:" : "weights + KV:",
           fmt_count(k->plan.need_bytes, a), fmt_human(k->plan.need_bytes, b));
    if (k->in.n_heads > l->n_kv_heads)
        printf("GQA:                      %" PRIu32 " KV heads vs %" PRIu32
               " heads → %.1f× less KV (full MHA: %s bytes per token)\n",
               l->n_kv_heads, k->in.n_heads, k->plan.gqa_factor,
               fmt_count(k->plan.mha_bytes_per_token, a));
    if (!k->in.have_memory) {
        printf("memory:                   not given (--memory SIZE sizes a pool)\n");
        return;
    }
    printf("memory budget:            %s bytes (%s)\n", fmt_count(k->in.memory_bytes, a),
           fmt_human(k->in.memory_bytes, b));
    printf("pool blocks for budget:   %s (%s bytes of budget after the weights%s)\n",
           fmt_count(k->plan.pool_blocks, a), fmt_count(k->plan.pool_budget_bytes, b),
           k->in.scratch_bytes ? " and scratch" : "");
    if (k->plan.fits)
        printf("fits:                     yes (%s bytes to spare)\n",
               fmt_count(k->plan.spare_bytes, a));
    else
        printf("fits:                     no (needs %s bytes more)\n",
               fmt_count(k->plan.short_bytes, a));
    printf("max concurrent sequences: %s at %s tokens%s\n", fmt_count(k->plan.max_seqs, a),
           fmt_count(k->in.n_ctx, b),
           k->plan.max_seqs == 0 ? " (a node refuses to start with this budget)" : "");
}

/* Writes s as a JSON string literal. */
static void print_json_string(const char *s)
{
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\')
            printf("\\%c", *p);
        else if (*p < 0x20)
            printf("\\u%04x", *p);
        else
            putchar(*p);
    }
    putchar('"');
}

static void print_json(const kvcalc_t *k)
{
    const tdm_kv_layout_t *l = &k->in.layout;
    printf("{\n  \"model\": ");
    if (k->model)
        print_json_string(k->model);
    else
        printf("null");
    printf(",\n  \"n_layers\": %" PRIu32 ",\n  \"n_kv_heads\": %" PRIu32
           ",\n  \"n_heads\": %" PRIu32 ",\n  \"head_dim\": %" PRIu32
           ",\n  \"dtype\": \"%s\",\n  \"block_size\": %" PRIu32 ",\n",
           l->n_layers, l->n_kv_heads, k->in.n_heads, l->head_dim, tdm_kv_dtype_name(l->dtype),
           l->block_size);
    printf("  \"layer_groups\": %" PRIu32 ",\n", k->in.groups ? k->in.groups->n_groups : 1);
    printf("  \"context\": %" PRIu64 ",\n  \"users\": %" PRIu64 ",\n  \"weights_bytes\": %" PRIu64
           ",\n  \"scratch_bytes\": %" PRIu64 ",\n",
           k->in.n_ctx, k->in.n_users, k->in.weight_bytes, k->in.scratch_bytes);
    printf("  \"kv_bytes_per_token\": %" PRIu64 ",\n  \"block_bytes\": %" PRIu64
           ",\n  \"blocks_per_sequence\": %" PRIu64 ",\n  \"kv_bytes_per_sequence\": %" PRIu64
           ",\n  \"kv_blocks_total\": %" PRIu64 ",\n  \"kv_bytes_total\": %" PRIu64
           ",\n  \"weights_plus_kv_bytes\": %" PRIu64 ",\n",
           k->plan.bytes_per_token, k->plan.block_bytes, k->plan.blocks_per_seq,
           k->plan.bytes_per_seq, k->plan.blocks_total, k->plan.bytes_total, k->plan.need_bytes);
    printf("  \"mha_kv_bytes_per_token\": %" PRIu64 ",\n  \"gqa_factor\": %.1f,\n",
           k->plan.mha_bytes_per_token, k->plan.gqa_factor);
    if (k->in.have_memory)
        printf("  \"memory_bytes\": %" PRIu64 ",\n  \"pool_blocks\": %" PRIu64
               ",\n  \"fits\": %s,\n  \"max_sequences\": %" PRIu64 "\n}\n",
               k->in.memory_bytes, k->plan.pool_blocks, k->plan.fits ? "true" : "false",
               k->plan.max_seqs);
    else
        printf("  \"memory_bytes\": null,\n  \"pool_blocks\": null,\n  \"fits\": null,\n"
               "  \"max_sequences\": null\n}\n");
}

/* The options whose values are checked once all are read (the shape against -m). */
typedef struct kvcalc_args {
    const char *layers, *kv_heads, *head_dim, *heads, *weights, *context;
    bool json;
    bool all_layers; /* --all-layers: plan without layer groups */
    long threads;    /* -m: the engine's threads (-1: the default node's) */
} kvcalc_args_t;

/* --dtype into the tdm_kv_dtype_t at target. */
static bool opt_dtype(const char *cmd, const char *value, void *target)
{
    (void)cmd;
    if (tdm_kv_dtype_parse(value, target, NULL) == TDM_OK)
        return true;
    bad_usage("--dtype must be f32, f16 or q8, got '%s'", value);
    return false;
}

/* --block-size into the uint32_t at target: a power of two in 1..256. */
static bool opt_block_size(const char *cmd, const char *value, void *target)
{
    (void)cmd;
    uint64_t v;
    if (!parse_uint(value, 1, 256, &v) || (v & (v - 1)) != 0) {
        bad_usage("--block-size must be a power of two in 1..256, got '%s'", value);
        return false;
    }
    *(uint32_t *)target = (uint32_t)v;
    return true;
}

/* --users into the uint64_t at target. */
static bool opt_users(const char *cmd, const char *value, void *target)
{
    (void)cmd;
    return opt_uint("users", value, 1, MAX_USERS, target);
}

/* --memory into the tdm_kv_plan_in_t at target (memory_bytes, have_memory). */
static bool opt_memory(const char *cmd, const char *value, void *target)
{
    (void)cmd;
    tdm_kv_plan_in_t *in = target;
    if (tdm_config_parse_bytes(value, &in->memory_bytes) != TDM_OK || in->memory_bytes == 0) {
        bad_usage("--memory must be a positive byte size such as 80GiB, 512MiB, 1.5GB or 4096, "
                  "got '%s'",
                  value);
        return false;
    }
    in->have_memory = true;
    return true;
}

/* Parses the options into *k and *a. Returns 0 to go on, or the exit status with *done set. */
static int parse_args(int argc, char **argv, kvcalc_t *k, kvcalc_args_t *a, bool *done)
{
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("model", 'm', &k->model),
        TDM_CLI_OPT_STR("layers", 0, &a->layers),
        TDM_CLI_OPT_STR("kv-heads", 0, &a->kv_heads),
        TDM_CLI_OPT_STR("head-dim", 0, &a->head_dim),
        TDM_CLI_OPT_STR("heads", 0, &a->heads),
        TDM_CLI_OPT_STR("weights-bytes", 0, &a->weights),
        TDM_CLI_OPT_FN("dtype", 0, opt_dtype, &k->in.layout.dtype),
        TDM_CLI_OPT_FN("block-size", 0, opt_block_size, &k->in.layout.block_size),
        TDM_CLI_OPT_STR("context", 0, &a->context),
        TDM_CLI_OPT_FN("users", 0, opt_users, &k->in.n_users),
        TDM_CLI_OPT_FN("memory", 0, opt_memory, &k->in),
        TDM_CLI_OPT_TRUE("json", 0, &a->json),
        TDM_CLI_OPT_TRUE("all-layers", 0, &a->all_layers),
        TDM_CLI_OPT_LONG("threads", 0, &a->threads, 0, 1024),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {"tandem kvcalc", usage, NULL, opts};
    int status = tdm_cli_parse(&spec, argc, argv, done);
    if (!*done && optind < argc) {
        *done = true;
        return bad_usage("unexpected argument '%s'", argv[optind]);
    }
    return status;
}

/* The question from the options: the shape (from -m or given), the weights, the context.
 * Returns 0, or the exit status after printing why. */
static int resolve(kvcalc_t *k, const kvcalc_args_t *a)
{
    uint64_t model_ctx = 0;
    if (k->model && (a->layers || a->kv_heads || a->head_dim || a->heads))
        return bad_usage("give either -m MODEL or --layers/--kv-heads/--head-dim/--heads, "
                         "not both");
    int rc = k->model ? load_model(k, &model_ctx)
                      : parse_shape(k, a->layers, a->kv_heads, a->head_dim, a->heads);
    if (rc != 0)
        return rc;
    if (a->weights && (tdm_config_parse_bytes(a->weights, &k->in.weight_bytes) != TDM_OK))
        return bad_usage("--weights-bytes must be a byte size such as 13GiB, 270MB or 4096, "
                         "got '%s'",
                         a->weights);
    k->in.n_ctx = model_ctx ? model_ctx : 4096;
    if (k->have_groups && !a->all_layers) /* the node's rule: tdm_node_kv_groups */
        k->in.groups = &k->groups;
    if (a->context && !opt_uint("context", a->context, 1, MAX_CONTEXT, &k->in.n_ctx))
        return 2;
    return 0;
}

int tdm_cmd_kvcalc(int argc, char **argv)
{
    kvcalc_t k = {.in = {.layout = {.block_size = 16, .dtype = TDM_KV_F16}, .n_users = 1}};
    kvcalc_args_t a = {.threads = -1};
    bool done;
    int rc = parse_args(argc, argv, &k, &a, &done);
    if (done)
        return rc;
    rc = resolve(&k, &a);
    tdm_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    bool have_cfg = false;
    if (rc == 0 && k.model && !a.weights) { /* the resident weights and scratch, as a node's */
        have_cfg = tdm_config_defaults(&cfg) == TDM_OK;
        rc = have_cfg ? measure(&k, &cfg, a.threads) : 1;
        if (!have_cfg)
            fprintf(stderr, "tandem kvcalc: out of memory\n");
    }
    if (rc == 0)
        rc = compute(&k);
    if (rc == 0 && a.json)
        print_json(&k);
    else if (rc == 0)
        print_table(&k);
    if (have_cfg)
        tdm_config_free(&cfg);
    return rc;
}
