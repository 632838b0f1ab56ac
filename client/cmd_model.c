/* cmd_model.c - `tandem model synth` (`tandem model cut` is cmd_model_cut.c): writes a
 * random-weight GGUF with a published architecture's shape (for benchmarks at scales the default
 * model does not reach, and small Gemma 3 files for tests against llama.cpp), or, with
 * --vocab-only, a vocabulary-only GGUF of a model's tokenizer to give it.
 *
 * The weights (cmd_model_synth.c) mean nothing; what they keep real is every cost: tensor
 * shapes and types, bytes per token, KV sizes, the tokenizer and the vocabulary's size. */
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "cli_common.h"
#include "cmd_model.h"
#include "commands.h"
#include "tandem/config.h"

typedef struct synth_opts {
    const char *shape, *arch, *type, *vocab, *model, *out;
    uint64_t seed;
    long layers, experts, experts_used;
    bool vocab_only;
} synth_opts_t;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem model synth --shape SHAPE | --arch ARCH --type TYPE [--vocab FILE]\n"
            "                          [--seed N] [--layers N] [--experts N --experts-used K]\n"
            "                          -o FILE\n"
            "       tandem model synth --vocab-only [-m MODEL] -o FILE\n"
            "\n"
            "Writes a random-weight GGUF of the shape's architecture (llama, qwen3, qwen3moe,\n"
            "gemma3 or phi3; the mixtral shapes are llama with experts)\n"
            "with SHAPE's real dimensions (embedding, FFN, layers, heads, KV heads, head_dim,\n"
            "rope theta, sliding window, Llama 3 RoPE factors, vocabulary size, context; the\n"
            "-tiny shapes are miniatures for tests) and the tokenizer of FILE (a vocabulary-only\n"
            "GGUF or any model; the token arrays are padded with unused tokens up to the\n"
            "shape's vocabulary size).\n"
            "Weights are scaled so every layer's hidden state has RMS ~1. For benchmarks and\n"
            "tests: the output is noise.\n"
            "\n"
            "  --shape SHAPE   %s\n"
            "  --arch ARCH     the miniature (-tiny) shape of ARCH: %s\n"
            "  --type TYPE     projection type: Q4_0, Q4_1, Q8_0, F16 (Q2_K, Q3_K, Q4_K, Q5_K,\n"
            "                  Q6_K where the dims are multiples of 256); embeddings are Q8_0\n"
            "                  (F16 for F16)\n"
            "  --vocab FILE    tokenizer source (default: the default model, %s)\n"
            "  --seed N        random seed (default 0); same seed, same bytes\n"
            "  --layers N      keep only the first N layers (quick runs, tests)\n"
            "  --experts N     experts per layer (shapes with experts only: qwen3moe, mixtral)\n"
            "  --experts-used K  experts per token, 1..N\n"
            "  --vocab-only    write only -m MODEL's tokenizer (about 2 MB for SmolLM2)\n"
            "  -m, --model F   the model --vocab-only reads (default: the default model)\n"
            "  -o, --output F  the file to write\n"
            "\n"
            "exit status: 0 success, 1 error (reading, writing, out of memory), 2 bad usage\n",
            tdm_synth_shape_names(), tdm_synth_arch_names(), TDM_DEFAULT_MODEL_FILE);
}

static void usage_hint(void)
{
    fprintf(stderr, "see tandem model synth --help\n");
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* The projection type called name, NULL with a message when synth cannot write it. */
static const tdm_ggml_type_info_t *parse_type(const char *name, tdm_ggml_type_t *type)
{
    for (uint32_t t = 0; t < TDM_GGML_TYPE_COUNT; t++) {
        const tdm_ggml_type_info_t *ti = tdm_ggml_type_get(t);
        if (ti && ti->supported && t != TDM_GGML_TYPE_F32 && strcmp(ti->name, name) == 0) {
            *type = (tdm_ggml_type_t)t;
            return ti;
        }
    }
    fprintf(stderr,
            "tandem model synth: --type %s is not one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
            "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, F16, BF16\n",
            name);
    return NULL;
}

/* Opens the tokenizer source: path, else the default model. NULL after a message. */
static tdm_gguf_t *open_vocab(const char *path)
{
    char def[1024];
    if (!path) {
        if (tdm_model_default_path(def, sizeof def) != TDM_OK) {
            fprintf(stderr, "tandem model synth: no default model path; pass --vocab FILE\n");
            return NULL;
        }
        path = def;
    }
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(path, &err);
    if (!g)
        fprintf(stderr, "tandem model synth: %s: %s%s\n", path, err.msg,
                err.code == TDM_ENOTFOUND ? " (pass --vocab FILE, or run scripts/setup)" : "");
    return g;
}

/* Writes w to path, printing the outcome. Returns the exit status. */
static int write_out(const tdm_gguf_writer_t *w, const char *path, double t0, const char *what)
{
    tdm_error_t err = {0};
    double t1 = now_s();
    if (tdm_gguf_writer_write_file(w, path, &err) != TDM_OK) {
        fprintf(stderr, "tandem model synth: %s\n", err.msg);
        return 1;
    }
    printf("wrote %s: %s (generate %.1f s, write %.1f s)\n", path, what, t1 - t0, now_s() - t1);
    return 0;
}

/* --vocab-only: general.architecture/name and the tokenizer of o->model. */
static int run_vocab_only(const synth_opts_t *o)
{
    tdm_gguf_t *g = open_vocab(o->model);
    tdm_gguf_writer_t *w = g ? tdm_gguf_writer_new() : NULL;
    tdm_error_t err = {0};
    uint32_t n = 0;
    int status = 1;
    if (!w)
        goto out;
    tdm_gguf_str_t name = {"vocab", 5};
    tdm_gguf_get_str(g, "general.name", &name, NULL);
    char buf[160];
    snprintf(buf, sizeof buf, "%.*s", (int)(name.len < 120 ? name.len : 120), name.data);
    if (tdm_gguf_writer_set_str(w, "general.architecture", "llama") != TDM_OK ||
        tdm_gguf_writer_set_str(w, "general.type", "vocab") != TDM_OK ||
        tdm_gguf_writer_set_str(w, "general.name", buf) != TDM_OK ||
        tdm_synth_copy_vocab(w, g, 0, &n, &err) != TDM_OK) {
        fprintf(stderr, "tandem model synth: %s\n", err.code ? err.msg : "out of memory");
        goto out;
    }
    snprintf(buf, sizeof buf, "vocabulary of %u tokens", n);
    status = write_out(w, o->out, now_s(), buf);
out:
    tdm_gguf_writer_destroy(&w);
    tdm_gguf_destroy(&g);
    return status;
}

/* The model: o->shape with o->type projections and o->vocab's tokenizer. */
static int run_synth(const synth_opts_t *o, tdm_synth_shape_t s, tdm_ggml_type_t type)
{
    tdm_gguf_t *g = open_vocab(o->vocab);
    tdm_gguf_writer_t *w = g ? tdm_gguf_writer_new() : NULL;
    tdm_error_t err = {0};
    int status = 1;
    if (!w)
        goto out;
    const double t0 = now_s();
    const uint32_t n_tok = tdm_synth_vocab_size(g);
    const uint32_t n_vocab = n_tok > s.n_vocab ? n_tok : s.n_vocab;
    uint32_t n = 0;
    int rc = tdm_synth_add_weights(w, &s, n_vocab, type, o->seed, &err);
    if (rc == TDM_EINVALID) { /* the type does not fit the shape: bad usage */
        fprintf(stderr,
                "tandem model synth: --type %s does not fit %s: %s (%u values per block); "
                "choose a type or a shape that fits\n",
                tdm_ggml_type_get((uint32_t)type)->name, s.name, err.msg,
                tdm_ggml_type_get((uint32_t)type)->block_size);
        usage_hint();
        status = 2;
        goto out;
    }
    if (rc != TDM_OK || tdm_synth_copy_vocab(w, g, n_vocab, &n, &err) != TDM_OK) {
        fprintf(stderr, "tandem model synth: %s\n", err.msg);
        goto out;
    }
    char what[160];
    snprintf(what, sizeof what, "%s, %u layers, %s, vocabulary %u (%u from the tokenizer)", s.name,
             s.n_layers, tdm_ggml_type_get((uint32_t)type)->name, n_vocab, n);
    status = write_out(w, o->out, t0, what);
out:
    tdm_gguf_writer_destroy(&w);
    tdm_gguf_destroy(&g);
    return status;
}

/* Parses and checks the options; returns the exit status, *done when the command stops. */
static int parse_synth(int argc, char **argv, synth_opts_t *o, bool *done)
{
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("shape", 0, &o->shape),
        TDM_CLI_OPT_STR("arch", 0, &o->arch),
        TDM_CLI_OPT_LONG("experts", 0, &o->experts, 1, TDM_GGUF_MAX_EXPERTS),
        TDM_CLI_OPT_LONG("experts-used", 0, &o->experts_used, 1, TDM_GGUF_MAX_EXPERTS),
        TDM_CLI_OPT_STR("type", 0, &o->type),
        TDM_CLI_OPT_STR("vocab", 0, &o->vocab),
        TDM_CLI_OPT_STR("model", 'm', &o->model),
        TDM_CLI_OPT_STR("output", 'o', &o->out),
        TDM_CLI_OPT_U64("seed", 0, &o->seed),
        TDM_CLI_OPT_LONG("layers", 0, &o->layers, 1, 4096),
        TDM_CLI_OPT_TRUE("vocab-only", 0, &o->vocab_only),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {"tandem model synth", usage, usage_hint, opts};
    int status = tdm_cli_parse(&spec, argc, argv, done);
    if (*done)
        return status;
    const char *bad = NULL;
    if (optind < argc)
        bad = "unexpected operand";
    else if (!o->out)
        bad = "-o FILE is required";
    else if (o->vocab_only && (o->shape || o->arch || o->type || o->vocab))
        bad = "--vocab-only takes only -m MODEL and -o FILE";
    else if (o->shape && o->arch)
        bad = "--shape and --arch exclude each other (--arch ARCH is the shape ARCH-tiny)";
    else if (!o->vocab_only && ((!o->shape && !o->arch) || !o->type))
        bad = "--shape (or --arch) and --type are required";
    else if (!o->vocab_only && o->model)
        bad = "-m goes with --vocab-only (the tokenizer of a synthetic model is --vocab)";
    *done = bad != NULL;
    if (bad) {
        fprintf(stderr, "tandem model synth: %s\n", bad);
        usage_hint();
        return 2;
    }
    return 0;
}

/* Applies --experts / --experts-used to shape; 0, or 2 after a message naming the flag that
 * does not apply (a dense shape) or is out of range. */
static int synth_experts(const synth_opts_t *o, tdm_synth_shape_t *shape)
{
    const char *flag = o->experts > 0 ? "--experts" : o->experts_used > 0 ? "--experts-used" : NULL;
    if (!flag)
        return 0;
    if (shape->n_expert == 0) {
        fprintf(stderr,
                "tandem model synth: %s does not apply to %s (a dense %s shape; shapes with "
                "experts: qwen3-30b-a3b, qwen3moe-tiny, mixtral-8x7b, mixtral-tiny)\n",
                flag, shape->name, shape->arch);
        return 2;
    }
    if (o->experts > 0)
        shape->n_expert = (uint32_t)o->experts;
    if (o->experts_used > 0)
        shape->n_expert_used = (uint32_t)o->experts_used;
    if (shape->n_expert_used > shape->n_expert) {
        fprintf(stderr, "tandem model synth: --experts-used %u exceeds --experts %u\n",
                shape->n_expert_used, shape->n_expert);
        return 2;
    }
    return 0;
}

static int cmd_synth(int argc, char **argv)
{
    synth_opts_t o = {0};
    bool done = false;
    int status = parse_synth(argc, argv, &o, &done);
    if (done)
        return status;
    if (o.vocab_only)
        return run_vocab_only(&o);
    const tdm_synth_shape_t *s =
        o.arch ? tdm_synth_arch_find(o.arch) : tdm_synth_shape_find(o.shape);
    tdm_ggml_type_t type;
    if (!s) {
        fprintf(stderr, "tandem model synth: unknown --%s %s (known: %s)\n",
                o.arch ? "arch" : "shape", o.arch ? o.arch : o.shape,
                o.arch ? tdm_synth_arch_names() : tdm_synth_shape_names());
        return 2;
    }
    if (!parse_type(o.type, &type))
        return 2;
    tdm_synth_shape_t shape = *s;
    if (o.layers > 0 && (uint32_t)o.layers > shape.n_layers) {
        fprintf(stderr, "tandem model synth: --layers %ld: %s has %u layers\n", o.layers,
                shape.name, shape.n_layers);
        return 2;
    }
    if (o.layers > 0)
        shape.n_layers = (uint32_t)o.layers;
    if (synth_experts(&o, &shape) != 0)
        return 2;
    return run_synth(&o, shape, type);
}

int tdm_cmd_model(int argc, char **argv)
{
    if (argc >= 2 && strcmp(argv[1], "synth") == 0) {
        char name[] = "tandem model synth";
        argv[1] = name;
        return cmd_synth(argc - 1, argv + 1);
    }
    if (argc >= 2 && strcmp(argv[1], "cut") == 0) {
        char name[] = "tandem model cut";
        argv[1] = name;
        return tdm_cmd_model_cut(argc - 1, argv + 1);
    }
    FILE *out = argc >= 2 && (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0)
                    ? stdout
                    : stderr;
    fprintf(out, "usage: tandem model synth [options]   (tandem model synth --help)\n"
                 "       tandem model cut [options]     (tandem model cut --help)\n");
    return out == stdout ? 0 : 2;
}
