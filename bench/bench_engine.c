/* bench_engine.c - engine throughput on one model: prefill tokens/s at 128 and 512 tokens,
 * decode tokens/s at batch 1, 8, 32, 64 (aggregate and per sequence), peak RSS, and a memcpy
 * bandwidth figure so batch-1 decode can be compared with its memory bound
 * (weight bytes / bandwidth). Prints a table to stderr and JSON to stdout (or --json FILE).
 * Timings are wall-clock medians over repetitions; compare ratios, not absolute figures, on
 * shared machines.
 *
 * With --backend cuda (CUDA builds): prefill at 512 and 4096 tokens, decode at batch 1, 32 and
 * 128, and the memory bound from the bytes of the device weight copies (bf16 matrices, f32
 * vectors) over the device-to-device copy bandwidth measured in the same run (bench_hbm.c). */
#include <getopt.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/kv.h"
#include "tandem/model.h"
#ifdef TANDEM_HAVE_CUDA
#include "bench_hbm.h"
#endif

#define MAX_BATCH 128
#define DECODE_CTX 128 /* prompt tokens each decoding sequence starts from */

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

static void random_tokens(int32_t *t, uint32_t n, uint32_t n_vocab, uint64_t seed)
{
    for (uint32_t i = 0; i < n; i++) {
        seed = seed * 6364136223846793005ull + 1442695040888963407ull;
        t[i] = (int32_t)(1000 + (seed >> 33) % (n_vocab - 2000));
    }
}

/* Bytes per second of a single-threaded memcpy of a 256 MiB buffer, counting the bytes read
 * and the bytes written (the traffic a copy makes), best of 5. */
static double memcpy_bandwidth(void)
{
    size_t n = (size_t)256 << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b) {
        free(a);
        free(b);
        return 0;
    }
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 1e30;
    for (int r = 0; r < 5; r++) {
        double t0 = tdm_time_now();
        memcpy(r % 2 ? a : b, r % 2 ? b : a, n);
        double dt = tdm_time_now() - t0;
        best = dt < best ? dt : best;
    }
    free(a);
    free(b);
    return 2.0 * (double)n / best;
}

typedef struct bench {
    tdm_model_t *model;
    tdm_kv_pool_t *pool;
    tdm_engine_t *engine;
    uint32_t n_vocab;
    float *logits;
} bench_t;

static int forward_seqs(bench_t *b, tdm_kv_seq_t *seqs, uint32_t n_seqs, const int32_t *tokens,
                        const uint32_t *pos, const uint32_t *seq, uint32_t n, const bool *want)
{
    tdm_batch_seq_t bs[MAX_BATCH];
    for (uint32_t i = 0; i < n_seqs; i++)
        bs[i] = (tdm_batch_seq_t){seqs[i].blocks, seqs[i].n_blocks};
    tdm_batch_t batch = {n, tokens, pos, seq, want, n_seqs, bs};
    tdm_error_t err = {0};
    int rc = tdm_engine_forward(b->engine, &batch, b->logits, &err);
    if (rc != TDM_OK)
        fprintf(stderr, "forward: %s\n", err.msg);
    return rc;
}

/* Median seconds to prefill n tokens in one pass (logits for the last one), after `warm`
 * untimed passes. */
static double bench_prefill(bench_t *b, uint32_t n, int reps, int warm)
{
    int32_t *tok = malloc(n * sizeof *tok);
    uint32_t *pos = malloc(n * sizeof *pos), *seq = calloc(n, sizeof *seq);
    bool *want = calloc(n, sizeof *want);
    double *t = malloc((size_t)reps * sizeof *t);
    random_tokens(tok, n, b->n_vocab, n);
    for (uint32_t i = 0; i < n; i++)
        pos[i] = i;
    want[n - 1] = true;
    for (int r = -warm; r < reps; r++) {
        tdm_kv_seq_t s;
        tdm_kv_seq_init(&s);
        if (tdm_kv_seq_reserve(b->pool, &s, n) != TDM_OK)
            exit(1);
        double t0 = tdm_time_now();
        if (forward_seqs(b, &s, 1, tok, pos, seq, n, want) != TDM_OK)
            exit(1);
        if (r >= 0)
            t[r] = tdm_time_now() - t0;
        tdm_kv_seq_release(b->pool, &s);
    }
    double m = median(t, reps);
    free(tok), free(pos), free(seq), free(want), free(t);
    return m;
}

/* Median seconds per decode step with `batch` sequences of DECODE_CTX tokens each. */
static double bench_decode(bench_t *b, uint32_t batch, int steps)
{
    tdm_kv_seq_t seqs[MAX_BATCH];
    int32_t tok[MAX_BATCH], prompt[DECODE_CTX];
    uint32_t pos[DECODE_CTX > MAX_BATCH ? DECODE_CTX : MAX_BATCH] = {0};
    uint32_t seq[DECODE_CTX > MAX_BATCH ? DECODE_CTX : MAX_BATCH] = {0};
    bool want[DECODE_CTX > MAX_BATCH ? DECODE_CTX : MAX_BATCH] = {0};
    for (uint32_t s = 0; s < batch; s++) {
        tdm_kv_seq_init(&seqs[s]);
        if (tdm_kv_seq_reserve(b->pool, &seqs[s], DECODE_CTX + (uint32_t)steps) != TDM_OK) {
            fprintf(stderr, "KV pool too small for batch %u\n", batch);
            exit(1);
        }
        random_tokens(prompt, DECODE_CTX, b->n_vocab, 100 + s);
        for (uint32_t i = 0; i < DECODE_CTX; i++)
            pos[i] = i, seq[i] = 0, want[i] = i == DECODE_CTX - 1;
        if (forward_seqs(b, &seqs[s], 1, prompt, pos, seq, DECODE_CTX, want) != TDM_OK)
            exit(1);
    }
    double *t = malloc((size_t)steps * sizeof *t);
    for (int st = 0; st < steps; st++) {
        for (uint32_t s = 0; s < batch; s++) {
            random_tokens(&tok[s], 1, b->n_vocab, (uint64_t)st * 977 + s);
            pos[s] = DECODE_CTX + (uint32_t)st;
            seq[s] = s;
            want[s] = true;
        }
        double t0 = tdm_time_now();
        if (forward_seqs(b, seqs, batch, tok, pos, seq, batch, want) != TDM_OK)
            exit(1);
        t[st] = tdm_time_now() - t0;
    }
    for (uint32_t s = 0; s < batch; s++)
        tdm_kv_seq_release(b->pool, &seqs[s]);
    double m = median(t, steps);
    free(t);
    return m;
}

/* Bytes the CUDA backend keeps on the device for the weights: every matrix in bf16 (2 bytes a
 * value) and every vector in f32, as backend_cuda.cu uploads them; a decode step reads all of
 * them once. */
static uint64_t cuda_weight_bytes(const tdm_model_t *m)
{
    const tdm_gguf_t *g = tdm_model_gguf(m);
    uint64_t total = 0;
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        total += t->n_elements * (t->ne[1] > 1 ? 2 : 4);
    }
    return total;
}

int main(int argc, char **argv)
{
    static const struct option opts[] = {{"model", required_argument, NULL, 'm'},
                                         {"threads", required_argument, NULL, 't'},
                                         {"json", required_argument, NULL, 'j'},
                                         {"steps", required_argument, NULL, 's'},
                                         {"backend", required_argument, NULL, 'b'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    char model_path[1024] = "";
    const char *json_path = NULL, *backend = "cpu";
    int threads = 0, steps = 16, c;
    while ((c = getopt_long(argc, argv, "m:t:j:s:b:h", opts, NULL)) != -1) {
        switch (c) {
        case 'm': snprintf(model_path, sizeof model_path, "%s", optarg); break;
        case 't': threads = atoi(optarg); break;
        case 'j': json_path = optarg; break;
        case 's': steps = atoi(optarg); break;
        case 'b': backend = optarg; break;
        case 'h':
            printf("usage: tandem-bench-engine [-m MODEL] [-t THREADS] [--steps N] [--json FILE]\n"
                   "                           [--backend cpu|cuda|cuda:N]\n");
            return 0;
        default: return 2;
        }
    }
    if (!model_path[0])
        tdm_model_default_path(model_path, sizeof model_path);
    if (threads < 0 || steps < 1) {
        fprintf(stderr, "bench: --threads must be >= 0 and --steps >= 1\n");
        return 2;
    }
    const bool cuda = strncmp(backend, "cuda", 4) == 0;
#ifndef TANDEM_HAVE_CUDA
    if (cuda) {
        fprintf(stderr,
                "bench: this build has no CUDA backend (configure with -DTANDEM_CUDA=ON)\n");
        return 2;
    }
#endif
    /* what is measured: the CPU figures as before; on the GPU, longer prompts and larger
     * batches */
    const uint32_t n_small = cuda ? 512 : 128, n_large = cuda ? 4096 : 512;
    static const uint32_t cpu_batches[] = {1, 8, 32, 64}, gpu_batches[] = {1, 32, 128};
    const uint32_t *batches = cuda ? gpu_batches : cpu_batches;
    const int n_batches = cuda ? 3 : 4;
    const uint32_t max_batch = cuda ? 128 : 64;

    tdm_error_t err = {0};
    bench_t b = {0};
    b.model = tdm_model_load(model_path, &err);
    if (!b.model) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }
    const tdm_llama_hparams_t *hp = tdm_model_hparams(b.model);
    b.n_vocab = hp->n_vocab;
    uint32_t n_ctx = cuda ? 4096 : 1024;
    if (cuda && hp->n_ctx_train < n_ctx) {
        fprintf(stderr, "bench: the model's context (%u) is shorter than the 4096-token prefill\n",
                hp->n_ctx_train);
        return 1;
    }
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, TDM_KV_F16};
    uint32_t decode_ctx = DECODE_CTX + (cuda ? (uint32_t)steps : 64) + 16;
    uint32_t n_blocks = (uint32_t)tdm_kv_blocks_for_tokens(&kl, n_large) +
                        max_batch * (uint32_t)tdm_kv_blocks_for_tokens(&kl, decode_ctx);
    b.pool = tdm_kv_pool_new(&kl, n_blocks, &err);
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.backend = backend;
    ep.n_threads = threads;
    ep.max_batch_tokens = n_large;
    ep.max_logits = max_batch;
    ep.n_ctx = n_ctx;
    b.engine = b.pool ? tdm_engine_new(b.model, b.pool, &ep, &err) : NULL;
    b.logits = malloc((size_t)max_batch * b.n_vocab * sizeof(float));
    if (!b.engine || !b.logits) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }

    int warm = cuda ? 1 : 0; /* the GPU's first passes load kernels and pick GEMM algorithms */
    double p_small = bench_prefill(&b, n_small, 3, warm);
    double p_large = bench_prefill(&b, n_large, 3, warm);
    double step[4];
    for (int i = 0; i < n_batches; i++)
        step[i] = bench_decode(&b, batches[i], steps);
    /* peak RSS of the engine work, read before the bandwidth test's 512 MiB of buffers */
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    uint64_t rss = (uint64_t)ru.ru_maxrss * 1024;
    double bw = 0.0;
    uint64_t wbytes = tdm_model_weight_bytes(b.model);
    const char *bw_name = "memcpy bandwidth";
    if (cuda) {
#ifdef TANDEM_HAVE_CUDA
        char msg[256];
        int device = strncmp(backend, "cuda:", 5) == 0 ? atoi(backend + 5) : 0;
        if (tdm_bench_hbm_d2d(device, &bw, msg, sizeof msg) != 0) {
            fprintf(stderr, "bench: %s\n", msg);
            return 1;
        }
#endif
        wbytes = cuda_weight_bytes(b.model);
        bw_name = "HBM copy bandwidth";
    } else {
        bw = memcpy_bandwidth();
    }
    uint64_t pool_bytes = (uint64_t)n_blocks * tdm_kv_block_bytes(&kl);
    double bound = (double)wbytes / bw;

    fprintf(stderr, "model %s, backend %s, threads %d\n", model_path,
            tdm_engine_backend_name(b.engine), threads);
    fprintf(stderr, "%-28s %12s\n", "measure", "value");
    char label[64];
    snprintf(label, sizeof label, "prefill %u tokens/s", n_small);
    fprintf(stderr, "%-28s %12.1f\n", label, n_small / p_small);
    snprintf(label, sizeof label, "prefill %u tokens/s", n_large);
    fprintf(stderr, "%-28s %12.1f\n", label, n_large / p_large);
    for (int i = 0; i < n_batches; i++) {
        snprintf(label, sizeof label, "decode batch %u tokens/s", batches[i]);
        fprintf(stderr, "%-28s %12.1f  (%.1f per sequence, %.2f ms/step)\n", label,
                batches[i] / step[i], 1.0 / step[i], step[i] * 1e3);
    }
    fprintf(stderr, "%-28s %12.2f\n", "batch 32 / batch 1",
            (32 / step[cuda ? 1 : 2]) / (1 / step[0]));
    fprintf(stderr, "%-28s %12.2f GB/s\n", bw_name, bw / 1e9);
    fprintf(stderr, "%-28s %12.3f ms (weights %.1f MB%s)\n", "batch-1 memory bound", bound * 1e3,
            (double)wbytes / 1e6, cuda ? " on the device" : "");
    fprintf(stderr, "%-28s %12.2f\n", "batch-1 time / bound", step[0] / bound);
    fprintf(stderr, "%-28s %12.1f MiB (model %.1f + KV pool %.1f + scratch %.1f MiB)\n", "peak RSS",
            (double)rss / 1048576.0, (double)tdm_model_weight_bytes(b.model) / 1048576.0,
            (double)pool_bytes / 1048576.0, (double)tdm_engine_scratch_bytes(b.engine) / 1048576.0);

    FILE *out = json_path ? fopen(json_path, "w") : stdout;
    if (!out) {
        fprintf(stderr, "bench: cannot write %s\n", json_path);
        return 1;
    }
    fprintf(out,
            "{\"backend\": \"%s\", \"threads\": %d, \"weight_bytes\": %" PRIu64
            ", \"kv_pool_bytes\": %" PRIu64 ", \"scratch_bytes\": %" PRIu64
            ", \"peak_rss_bytes\": %" PRIu64 ",\n \"prefill_tokens_per_s\": {\"%u\": %.2f, "
            "\"%u\": %.2f},\n \"decode_step_s\": {",
            tdm_engine_backend_name(b.engine), threads, tdm_model_weight_bytes(b.model), pool_bytes,
            tdm_engine_scratch_bytes(b.engine), rss, n_small, n_small / p_small, n_large,
            n_large / p_large);
    for (int i = 0; i < n_batches; i++)
        fprintf(out, "%s\"%u\": %.6f", i ? ", " : "", batches[i], step[i]);
    uint64_t file_bytes = tdm_gguf_file_size(tdm_model_gguf(b.model));
    if (cuda)
        fprintf(out,
                "},\n \"hbm_d2d_bytes_per_s\": %.0f, \"device_weight_bytes\": %" PRIu64
                ", \"batch1_bound_s\": %.6f, \"model_file_bytes\": %" PRIu64 "}\n",
                bw, wbytes, bound, file_bytes);
    else
        fprintf(
            out,
            "},\n \"memcpy_bytes_per_s\": %.0f, \"batch1_bound_s\": %.6f, \"model_file_bytes\": "
            "%" PRIu64 ", \"rss_limit_bytes\": %" PRIu64 "}\n",
            bw, bound, file_bytes, file_bytes + pool_bytes + ((uint64_t)64 << 20));
    if (json_path)
        fclose(out);
    tdm_engine_destroy(&b.engine);
    tdm_kv_pool_destroy(&b.pool);
    tdm_model_destroy(&b.model);
    free(b.logits);
    return 0;
}
