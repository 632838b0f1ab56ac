/* cmd_model_cut.c - `tandem model cut`: a real model truncated to its first N layers, with
 * its own embeddings, final norm, output projection and tokenizer: a model small enough to
 * travel (SmolLM2-135M cut to 12 of 30 layers is about 45 MB) that still runs real weights,
 * for comparing engine backends where the whole model cannot go (scripts/gpu-check's logits
 * stage). Its text is not the model's: the layers it lacks are gone, not skipped.
 *
 * Every metadata key is copied (tdm_model_copy_kv) with `<arch>.block_count` set to N, and
 * every tensor except those of blocks N and above (`blk.I.*`, I >= N), bytes unchanged. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"
#include "cmd_model.h"
#include "commands.h"
#include "tandem/config.h"

typedef struct cut_opts {
    const char *model, *out;
    long layers;
} cut_opts_t;

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem model cut [-m MODEL] --layers N -o FILE\n"
            "\n"
            "Writes MODEL's first N layers with its embeddings, final norm, output projection\n"
            "and tokenizer to FILE (GGUF, tensors copied byte for byte): a smaller model of\n"
            "real weights for comparing backends. Its outputs are not MODEL's.\n"
            "\n"
            "  -m, --model F   the model to cut (default: the default model, %s)\n"
            "  --layers N      layers to keep, 1 .. MODEL's layer count - 1\n"
            "  -o, --output F  the file to write\n"
            "\n"
            "exit status: 0 success, 1 error (reading, writing, out of memory), 2 bad usage\n",
            TDM_DEFAULT_MODEL_FILE);
}

static void usage_hint(void)
{
    fprintf(stderr, "see tandem model cut --help\n");
}

/* The block index of a `blk.I.` tensor name, or -1 for the others. */
static long block_of(const char *name)
{
    if (strncmp(name, "blk.", 4) != 0)
        return -1;
    char *end = NULL;
    long i = strtol(name + 4, &end, 10);
    return end && *end == '.' ? i : -1;
}

/* Copies g's metadata into w with key block_key set to layers. */
static int copy_metadata(tdm_gguf_writer_t *w, const tdm_gguf_t *g, const char *block_key,
                         uint32_t layers, tdm_error_t *err)
{
    for (uint64_t i = 0; i < tdm_gguf_n_kv(g); i++) {
        const tdm_gguf_kv_t *kv = tdm_gguf_kv_at(g, i);
        int rc = strcmp(kv->key, block_key) == 0 ? tdm_gguf_writer_set_u32(w, kv->key, layers)
                                                 : tdm_model_copy_kv(w, kv);
        if (rc != TDM_OK)
            return tdm_error_set(err, rc, "cannot copy %s: out of memory", kv->key);
    }
    return TDM_OK;
}

/* Copies every tensor of g but those of blocks >= layers; *bytes gets their size. */
static int copy_tensors(tdm_gguf_writer_t *w, const tdm_gguf_t *g, uint32_t layers, uint64_t *bytes,
                        tdm_error_t *err)
{
    *bytes = 0;
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        long blk = block_of(t->name);
        if (blk >= (long)layers)
            continue;
        if (!t->data)
            return tdm_error_set(err, TDM_EINVALID, "tensor %s has no data", t->name);
        int rc = tdm_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne, t->data);
        if (rc != TDM_OK)
            return tdm_error_set(err, rc, "cannot add tensor %s", t->name);
        *bytes += t->n_bytes;
    }
    return TDM_OK;
}

/* The cut of g into w: checks N against the model's layer count. */
static int cut(tdm_gguf_writer_t *w, const tdm_gguf_t *g, long layers, uint64_t *bytes,
               tdm_error_t *err)
{
    tdm_gguf_str_t arch;
    if (tdm_gguf_get_str(g, "general.architecture", &arch, err) != TDM_OK)
        return err->code;
    char key[96];
    snprintf(key, sizeof key, "%.*s.block_count", (int)(arch.len < 64 ? arch.len : 64), arch.data);
    uint32_t n_layers = 0;
    if (tdm_gguf_get_u32(g, key, &n_layers, err) != TDM_OK)
        return err->code;
    if (layers >= (long)n_layers)
        return tdm_error_set(err, TDM_EINVALID,
                             "--layers %ld: the model has %u layers; keep 1 to %u", layers,
                             n_layers, n_layers - 1);
    int rc = copy_metadata(w, g, key, (uint32_t)layers, err);
    return rc != TDM_OK ? rc : copy_tensors(w, g, (uint32_t)layers, bytes, err);
}

static int run_cut(const cut_opts_t *o)
{
    char def[1024];
    const char *path = o->model;
    if (!path && tdm_model_default_path(def, sizeof def) == TDM_OK)
        path = def;
    if (!path) {
        fprintf(stderr, "tandem model cut: no default model path; pass -m MODEL\n");
        return 1;
    }
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(path, &err);
    tdm_gguf_writer_t *w = g ? tdm_gguf_writer_new() : NULL;
    uint64_t bytes = 0;
    int status = 1;
    if (!g) {
        fprintf(stderr, "tandem model cut: %s: %s\n", path, err.msg);
    } else if (!w) {
        fprintf(stderr, "tandem model cut: out of memory\n");
    } else if (cut(w, g, o->layers, &bytes, &err) != TDM_OK ||
               tdm_gguf_writer_write_file(w, o->out, &err) != TDM_OK) {
        fprintf(stderr, "tandem model cut: %s\n", err.msg);
        status = err.code == TDM_EINVALID ? 2 : 1;
    } else {
        printf("wrote %s: the first %ld layer%s of %s (%.1f MB of tensors)\n", o->out, o->layers,
               o->layers == 1 ? "" : "s", path, (double)bytes / 1e6);
        status = 0;
    }
    tdm_gguf_writer_destroy(&w);
    tdm_gguf_destroy(&g);
    return status;
}

int tdm_cmd_model_cut(int argc, char **argv)
{
    cut_opts_t o = {0};
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("model", 'm', &o.model),
        TDM_CLI_OPT_STR("output", 'o', &o.out),
        TDM_CLI_OPT_LONG("layers", 0, &o.layers, 1, 4096),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {"tandem model cut", usage, usage_hint, opts};
    bool done = false;
    int status = tdm_cli_parse(&spec, argc, argv, &done);
    if (done)
        return status;
    const char *bad = optind < argc ? "unexpected operand"
                      : !o.out      ? "-o FILE is required"
                      : !o.layers   ? "--layers N is required"
                                    : NULL;
    if (bad) {
        fprintf(stderr, "tandem model cut: %s\n", bad);
        usage_hint();
        return 2;
    }
    return run_cut(&o);
}
