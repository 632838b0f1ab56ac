/* bench_engine.c - engine throughput on one model: prefill tokens/s at 128 and 512 tokens,
 * decode tokens/s at batch 1, 8, 32, 64 (aggregate and per sequence), peak RSS, and a memcpy
 * bandwidth figure so batch-1 decode can be compared with its memory bound
 * (weight bytes / bandwidth). Prints a table to stderr and JSON to stdout (or --json FILE).
 * Timings are wall-clock medians over repetitions; compare ratios, not absolute figures, on
 * shared machines.
 *
 * With --backend cuda (CUDA builds): prefill at 512 and 4096 tokens, decode at batch 1, 32 and
 * 128 with every sequence at 1,024 tokens of context, the memory bound from the bytes of the
 * device weight copies (bf16 matrices, f32 vectors) over the device-to-device copy bandwidth,
 * and the bf16 GEMM peak (a cuBLAS 8192^3 GEMM) against which prefill's FLOP rate (2 FLOP per
 * matrix weight per token) is reported, all measured in the same run (bench_hbm.c).
 *
 * With --peak (CPU): the int8 dot-product peak of each instruction family (bench_peak.c), then
 * per kernel family prefill 128 / 512 and decode batch 1 / 32 with the engine's per-op times
 * (tdm_engine_op_timing): the weight GEMMs' int8 rate against the family's peak, attention,
 * norms and the rest apart (docs/performance.md, "Prefill against the int8 peak"). */
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
#include "bench_peak.h"
#ifdef TANDEM_HAVE_CUDA
#include "bench_hbm.h"
#endif

#define MAX_BATCH 128
#define DECODE_CTX_CPU 128   /* prompt tokens each decoding sequence starts from (CPU) */
#define DECODE_CTX_CUDA 1024 /* the same on the GPU (the GPU issue: 1,024 tokens of context) */
#define DEPTH_MAX 4          /* context lengths one --depth run takes */
#define DEPTH_BATCH 8        /* the larger decode batch at depth (batch 1 and 8) */

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
    uint32_t decode_ctx;     /* DECODE_CTX_CPU or DECODE_CTX_CUDA */
    tdm_kv_dtype_t kv_dtype; /* the pool's value type (--kv) */
    float *logits;
} bench_t;

static int forward_seqs(bench_t *b, tdm_kv_seq_t *seqs, uint32_t n_seqs, const int32_t *tokens,
                        const uint32_t *pos, const uint32_t *seq, uint32_t n, const bool *want)
{
    tdm_batch_seq_t bs[MAX_BATCH];
    for (uint32_t i = 0; i < n_seqs; i++)
        bs[i] = (tdm_batch_seq_t){seqs[i].blocks, seqs[i].n_blocks, NULL};
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

/* Median seconds per decode step with `batch` sequences of b->decode_ctx tokens each (their
 * prompts prefilled first, or with `prefill` false left as the pool's zeros: the same work per
 * step, for profiles of decode alone). */
static double bench_decode_ctx(bench_t *b, uint32_t batch, int steps, bool prefill, bool time_ops)
{
    tdm_kv_seq_t seqs[MAX_BATCH];
    const uint32_t ctx = b->decode_ctx;
    static int32_t prompt[DECODE_CTX_CUDA];
    static uint32_t pos[DECODE_CTX_CUDA], seq[DECODE_CTX_CUDA];
    static bool want[DECODE_CTX_CUDA];
    int32_t tok[MAX_BATCH];
    for (uint32_t s = 0; s < batch; s++) {
        tdm_kv_seq_init(&seqs[s]);
        if (tdm_kv_seq_reserve(b->pool, &seqs[s], ctx + (uint32_t)steps) != TDM_OK) {
            fprintf(stderr, "KV pool too small for batch %u\n", batch);
            exit(1);
        }
        if (!prefill)
            continue;
        random_tokens(prompt, ctx, b->n_vocab, 100 + s);
        for (uint32_t i = 0; i < ctx; i++)
            pos[i] = i, seq[i] = 0, want[i] = i == ctx - 1;
        if (forward_seqs(b, &seqs[s], 1, prompt, pos, seq, ctx, want) != TDM_OK)
            exit(1);
    }
    double *t = malloc((size_t)steps * sizeof *t);
    if (time_ops) /* the steps only, not the prompts' prefill */
        tdm_engine_op_timing(b->engine, true);
    for (int st = 0; st < steps; st++) {
        for (uint32_t s = 0; s < batch; s++) {
            random_tokens(&tok[s], 1, b->n_vocab, (uint64_t)st * 977 + s);
            pos[s] = ctx + (uint32_t)st;
            seq[s] = s;
            want[s] = true;
        }
        double t0 = tdm_time_now();
        if (forward_seqs(b, seqs, batch, tok, pos, seq, batch, want) != TDM_OK)
            exit(1);
        t[st] = tdm_time_now() - t0;
    }
    if (time_ops)
        tdm_engine_op_timing(b->engine, false);
    for (uint32_t s = 0; s < batch; s++)
        tdm_kv_seq_release(b->pool, &seqs[s]);
    double m = median(t, steps);
    free(t);
    return m;
}

static double bench_decode(bench_t *b, uint32_t batch, int steps)
{
    return bench_decode_ctx(b, batch, steps, true, false);
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

/* The run's settings: the command line and what the backend implies. */
typedef struct bench_cfg {
    char model_path[1024];
    const char *json_path, *backend;
    int threads, steps;
    bool cuda;
    uint32_t n_small, n_large; /* the two prefill lengths, tokens */
    const uint32_t *batches;   /* [n_batches] decode batch sizes */
    int n_batches;
    uint32_t max_batch;
    uint32_t n_ctx;            /* the engine's context, tokens */
    const char *kernels;       /* --kernels: comma-separated TANDEM_CPU_KERNELS values to compare */
    int rounds;                /* --rounds: interleaved rounds of the comparison (best kept) */
    uint32_t decode_only;      /* --decode-only B: only decode steps at batch B (for profilers) */
    uint32_t depth[DEPTH_MAX]; /* --depth: context lengths for the long-context measures */
    int n_depth;
    uint32_t ubatch;     /* --ubatch: tokens per prefill pass at depth (llama.cpp's n_ubatch) */
    int reps;            /* --reps: repetitions of each long prefill (median kept) */
    const char *kv_name; /* --kv f16|q8: the KV cache's type */
    bool peak;           /* --peak: int8 peak, prefill against it, per-op profiles */
} bench_cfg_t;

/* What was measured. */
typedef struct bench_result {
    double p_small, p_large; /* median prefill seconds at n_small / n_large tokens */
    double step[4];          /* [n_batches] median decode step seconds */
    uint64_t rss;            /* peak RSS before the bandwidth test, bytes */
    uint64_t wbytes;         /* weight bytes the memory bound reads */
    uint64_t pool_bytes;     /* the KV pool, bytes */
    double bw, bound;        /* bytes/s; seconds */
    double gemm_flops;       /* CUDA: the bf16 GEMM peak, FLOP/s (0 on the CPU) */
    uint64_t matrix_params;  /* weights of every 2-D tensor but token_embd (a prefill token
                                multiplies each once: 2 FLOP) */
    const char *bw_name;
} bench_result_t;

/* Prefills `n` tokens (random ids from `seed`) of the reserved sequence s in passes of at most
 * `ubatch` tokens (chunked prefill, as a server runs a long prompt and as llama.cpp runs one in
 * n_ubatch pieces), logits for the last token only. Returns the seconds it took; exits after
 * printing why when a pass fails. */
static double prefill_chunked(bench_t *b, tdm_kv_seq_t *s, uint32_t n, uint32_t ubatch,
                              uint64_t seed)
{
    int32_t *tok = malloc(n * sizeof *tok);
    uint32_t *pos = malloc(ubatch * sizeof *pos), *seq = calloc(ubatch, sizeof *seq);
    bool *want = calloc(ubatch, sizeof *want);
    if (!tok || !pos || !seq || !want) {
        fprintf(stderr, "bench: out of memory for a %u-token prefill\n", n);
        exit(1);
    }
    random_tokens(tok, n, b->n_vocab, seed);
    double t0 = tdm_time_now();
    for (uint32_t c0 = 0; c0 < n; c0 += ubatch) {
        uint32_t m = n - c0 < ubatch ? n - c0 : ubatch;
        for (uint32_t i = 0; i < m; i++)
            pos[i] = c0 + i, want[i] = c0 + i == n - 1;
        if (forward_seqs(b, s, 1, tok + c0, pos, seq, m, want) != TDM_OK)
            exit(1);
    }
    double dt = tdm_time_now() - t0;
    free(tok), free(pos), free(seq), free(want);
    return dt;
}

/* Median seconds per decode step of `batch` sequences (seqs[0 .. batch - 1], each holding
 * `depth` tokens of context) over `steps` steps at positions depth - steps .. depth - 1: each
 * step rewrites one slot of the context's tail and attends to everything before it, so the
 * step at position p reads p + 1 keys (the mean context is depth - steps / 2; llama-bench's
 * -d D -n N runs at D .. D + N - 1, 0.2% deeper at D = 8192, N = 16, and past a model's trained
 * context where the engine refuses to go). */
static double decode_at_depth(bench_t *b, tdm_kv_seq_t *seqs, uint32_t batch, uint32_t depth,
                              int steps)
{
    int32_t tok[MAX_BATCH];
    uint32_t pos[MAX_BATCH], seq[MAX_BATCH];
    bool want[MAX_BATCH];
    double *t = malloc((size_t)steps * sizeof *t);
    for (int st = 0; st < steps; st++) {
        for (uint32_t s = 0; s < batch; s++) {
            random_tokens(&tok[s], 1, b->n_vocab, (uint64_t)st * 977 + s);
            pos[s] = depth - (uint32_t)steps + (uint32_t)st;
            seq[s] = s;
            want[s] = true;
        }
        double t0 = tdm_time_now();
        if (forward_seqs(b, seqs, batch, tok, pos, seq, batch, want) != TDM_OK)
            exit(1);
        t[st] = tdm_time_now() - t0;
    }
    double m = median(t, steps);
    free(t);
    return m;
}

/* Makes sequences 1..DEPTH_BATCH-1 share sequence 0's blocks before the first block the decode
 * steps write (positions depth - steps on), a reference each, as prefix caching shares a
 * common prompt; the blocks from there on stay their own copies. */
static void depth_share_prompt(tdm_kv_pool_t *pool, tdm_kv_seq_t *seqs, uint32_t depth, int steps,
                               uint32_t block_size)
{
    uint32_t shared = (depth - (uint32_t)steps) / block_size;
    for (int s = 1; s < DEPTH_BATCH; s++)
        for (uint32_t k = 0; k < shared && k < seqs[s].n_blocks; k++) {
            tdm_kv_pool_unref(pool, seqs[s].blocks[k]);
            tdm_kv_pool_ref(pool, seqs[0].blocks[k]);
            seqs[s].blocks[k] = seqs[0].blocks[k];
        }
}

/* The long-context measures at each --depth D: a chunked prefill of D tokens (median of
 * --reps), then decode at depth D with batch 1 (that sequence), batch DEPTH_BATCH over
 * distinct caches (its KV blocks copied into DEPTH_BATCH - 1 more sequences: the same work per
 * step as distinct prompts of that length, without DEPTH_BATCH long prefills) and batch
 * DEPTH_BATCH over one shared prompt (the blocks shared, as prefix caching shares them and as
 * llama-batched-bench -pps runs). Prints a table to stderr and JSON to stdout (or --json
 * FILE). Returns 0, or 1 after printing why. */
static int run_depth(bench_t *b, const bench_cfg_t *c)
{
    tdm_kv_seq_t seqs[DEPTH_BATCH];
    double pre[DEPTH_MAX], step1[DEPTH_MAX], step8[DEPTH_MAX], step8s[DEPTH_MAX];
    const tdm_llama_hparams_t *hp = tdm_model_hparams(b->model);
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, b->kv_dtype};
    uint64_t block_bytes = tdm_kv_block_bytes(&kl);
    uint8_t *base = tdm_kv_pool_base(b->pool);
    for (int i = 0; i < c->n_depth; i++) {
        uint32_t depth = c->depth[i];
        for (int s = 0; s < DEPTH_BATCH; s++) {
            tdm_kv_seq_init(&seqs[s]);
            if (tdm_kv_seq_reserve(b->pool, &seqs[s], depth) != TDM_OK) {
                fprintf(stderr, "bench: KV pool too small for %d x %u tokens\n", DEPTH_BATCH,
                        depth);
                return 1;
            }
        }
        double *t = malloc((size_t)c->reps * sizeof *t);
        for (int r = 0; r < c->reps; r++)
            t[r] = prefill_chunked(b, &seqs[0], depth, c->ubatch, depth + (uint64_t)r);
        pre[i] = median(t, c->reps);
        free(t);
        for (int s = 1; s < DEPTH_BATCH; s++)
            for (uint32_t k = 0; k < seqs[0].n_blocks; k++)
                memcpy(base + (uint64_t)seqs[s].blocks[k] * block_bytes,
                       base + (uint64_t)seqs[0].blocks[k] * block_bytes, block_bytes);
        step1[i] = decode_at_depth(b, seqs, 1, depth, c->steps);
        step8[i] = decode_at_depth(b, seqs, DEPTH_BATCH, depth, c->steps);
        depth_share_prompt(b->pool, seqs, depth, c->steps, kl.block_size);
        step8s[i] = decode_at_depth(b, seqs, DEPTH_BATCH, depth, c->steps);
        for (int s = 0; s < DEPTH_BATCH; s++)
            tdm_kv_seq_release(b->pool, &seqs[s]);
        fprintf(stderr,
                "depth %5u: prefill %8.1f tokens/s (%.2f s), decode batch 1 %7.2f tokens/s"
                " (%.2f ms/step), batch %d %7.2f tokens/s (%.2f ms/step), shared prompt"
                " %7.2f tokens/s (%.2f ms/step)\n",
                depth, depth / pre[i], pre[i], 1.0 / step1[i], step1[i] * 1e3, DEPTH_BATCH,
                DEPTH_BATCH / step8[i], step8[i] * 1e3, DEPTH_BATCH / step8s[i], step8s[i] * 1e3);
    }
    FILE *out = c->json_path ? fopen(c->json_path, "w") : stdout;
    if (!out) {
        fprintf(stderr, "bench: cannot write %s\n", c->json_path);
        return 1;
    }
    fprintf(out,
            "{\"backend\": \"%s\", \"threads\": %d, \"ubatch\": %u, \"kv\": \"%s\", "
            "\"steps\": %d, \"depth\": {",
            tdm_engine_backend_name(b->engine), c->threads, c->ubatch, c->kv_name, c->steps);
    for (int i = 0; i < c->n_depth; i++)
        fprintf(out,
                "%s\n  \"%u\": {\"prefill_tokens_per_s\": %.2f, \"decode_step_s\": {\"1\": "
                "%.6f, \"%d\": %.6f, \"%d_shared_prompt\": %.6f}}",
                i ? "," : "", c->depth[i], c->depth[i] / pre[i], step1[i], DEPTH_BATCH, step8[i],
                DEPTH_BATCH, step8s[i]);
    fprintf(out, "}}\n");
    if (c->json_path)
        fclose(out);
    return 0;
}

static void print_usage(void)
{
    printf("usage: tandem-bench-engine [-m MODEL] [-t THREADS] [--steps N] [--json FILE]\n"
           "                           [--backend cpu|cuda|cuda:N]\n"
           "                           [--kernels scalar,avx2,...] [--rounds N]\n"
           "                           [--depth D1,D2,... [--ubatch N] [--reps N] [--kv f16|q8]]\n"
           "                           [--peak] [--decode-only B]\n"
           "--kernels compares CPU kernel families (TANDEM_CPU_KERNELS values) in one\n"
           "process: --rounds interleaved rounds, best time of each kept; prefill 128\n"
           "and 512, decode batch 1, 8 and 32.\n"
           "--decode-only B runs only --steps decode steps at batch B over 128-token\n"
           "contexts (not prefilled), for a profiler.\n"
           "--depth D1,D2,... runs only the long-context measures: at each depth D a\n"
           "prefill of D tokens in passes of --ubatch tokens (default 512; median of\n"
           "--reps, default 1), then decode at batch 1 and 8 with D tokens of context\n"
           "(--steps steps): batch 8 over 8 distinct caches and over one shared prompt\n"
           "(as llama-batched-bench -pps); --kv f16|q8 picks the KV cache type (default\n"
           "f16).\n"
           "--peak measures the int8 dot-product peak of each instruction family (1 and\n"
           "-t threads), then per family (--kernels, default the best) prefill 128 and\n"
           "512 and decode batch 1 and 32 with per-op times: the weight GEMMs' int8 rate\n"
           "against the family's peak, attention, norms and the rest apart (--rounds\n"
           "interleaved rounds, fastest pass of each kept).\n");
}

/* --depth's comma-separated list into c->depth (at most DEPTH_MAX values, each in
 * 1..1048576 tokens). Returns 0, or -1 after printing what is wrong. */
static int parse_depths(const char *arg, bench_cfg_t *c)
{
    char list[256];
    snprintf(list, sizeof list, "%s", arg);
    c->n_depth = 0;
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *end;
        unsigned long v = strtoul(tok, &end, 10);
        if (*end || v < 1 || v > 1048576 || c->n_depth == DEPTH_MAX) {
            fprintf(stderr,
                    "bench: --depth takes at most %d lengths in 1..1048576 tokens (got %s)\n",
                    DEPTH_MAX, arg);
            return -1;
        }
        c->depth[c->n_depth++] = (uint32_t)v;
    }
    return c->n_depth ? 0 : -1;
}

/* Parses the command line into *c. Returns 0 to go on, or the exit status with *done set. */
static int parse_args(int argc, char **argv, bench_cfg_t *c, bool *done)
{
    static const struct option opts[] = {{"model", required_argument, NULL, 'm'},
                                         {"threads", required_argument, NULL, 't'},
                                         {"json", required_argument, NULL, 'j'},
                                         {"steps", required_argument, NULL, 's'},
                                         {"backend", required_argument, NULL, 'b'},
                                         {"kernels", required_argument, NULL, 'k'},
                                         {"rounds", required_argument, NULL, 'r'},
                                         {"decode-only", required_argument, NULL, 'd'},
                                         {"depth", required_argument, NULL, 'D'},
                                         {"ubatch", required_argument, NULL, 'u'},
                                         {"reps", required_argument, NULL, 'R'},
                                         {"kv", required_argument, NULL, 'K'},
                                         {"peak", no_argument, NULL, 'P'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    c->backend = "cpu";
    c->steps = 16;
    c->rounds = 3;
    c->ubatch = 512;
    c->reps = 1;
    c->kv_name = "f16";
    *done = true;
    int ch;
    while ((ch = getopt_long(argc, argv, "m:t:j:s:b:k:r:d:D:u:R:K:Ph", opts, NULL)) != -1) {
        switch (ch) {
        case 'm': snprintf(c->model_path, sizeof c->model_path, "%s", optarg); break;
        case 't': c->threads = atoi(optarg); break;
        case 'j': c->json_path = optarg; break;
        case 's': c->steps = atoi(optarg); break;
        case 'b': c->backend = optarg; break;
        case 'k': c->kernels = optarg; break;
        case 'r': c->rounds = atoi(optarg); break;
        case 'd': c->decode_only = (uint32_t)atoi(optarg); break;
        case 'D':
            if (parse_depths(optarg, c) != 0)
                return 2;
            break;
        case 'u': c->ubatch = (uint32_t)atoi(optarg); break;
        case 'R': c->reps = atoi(optarg); break;
        case 'K': c->kv_name = optarg; break;
        case 'P': c->peak = true; break;
        case 'h': print_usage(); return 0;
        default: return 2;
        }
    }
    if (!c->model_path[0])
        tdm_model_default_path(c->model_path, sizeof c->model_path);
    if (c->threads < 0 || c->steps < 1 || c->rounds < 1 || c->reps < 1) {
        fprintf(stderr, "bench: --threads must be >= 0, --steps, --rounds and --reps >= 1\n");
        return 2;
    }
    if (c->ubatch < 1 || c->ubatch > 8192) {
        fprintf(stderr, "bench: --ubatch must be in 1..8192 tokens (got %u)\n", c->ubatch);
        return 2;
    }
    for (int i = 0; i < c->n_depth; i++)
        if (c->depth[i] <= (uint32_t)c->steps) {
            fprintf(stderr, "bench: each --depth must exceed --steps (%d): got %u\n", c->steps,
                    c->depth[i]);
            return 2;
        }
    c->cuda = strncmp(c->backend, "cuda", 4) == 0;
#ifndef TANDEM_HAVE_CUDA
    if (c->cuda) {
        fprintf(stderr,
                "bench: this build has no CUDA backend (configure with -DTANDEM_CUDA=ON)\n");
        return 2;
    }
#endif
    /* what is measured: the CPU figures as before; on the GPU, longer prompts and larger
     * batches */
    static const uint32_t cpu_batches[] = {1, 8, 32, 64}, gpu_batches[] = {1, 32, 128};
    c->n_small = c->cuda ? 512 : 128;
    c->n_large = c->cuda ? 4096 : 512;
    c->batches = c->cuda ? gpu_batches : cpu_batches;
    c->n_batches = c->cuda ? 3 : 4;
    c->max_batch = c->cuda ? 128 : 64;
    c->n_ctx = c->cuda ? 4096 : 1024;
    for (int i = 0; i < c->n_depth; i++)
        c->n_ctx = c->depth[i] > c->n_ctx ? c->depth[i] : c->n_ctx;
    *done = false;
    return 0;
}

/* An engine for the model and pool with the run's settings; NULL with *err on failure. */
static tdm_engine_t *bench_engine_new(bench_t *b, const bench_cfg_t *c, tdm_error_t *err)
{
    tdm_engine_params_t ep;
    tdm_engine_params_default(&ep);
    ep.backend = c->backend;
    ep.n_threads = c->threads;
    ep.max_batch_tokens = c->n_depth && c->ubatch > c->n_large ? c->ubatch : c->n_large;
    ep.max_logits = c->max_batch;
    ep.n_ctx = c->n_ctx;
    return tdm_engine_new(b->model, b->pool, &ep, err);
}

/* Rebuilds b's engine with the CPU kernel family name (TANDEM_CPU_KERNELS), for the
 * --kernels and --peak comparisons in one process. Returns 0, or 1 after printing why. */
static int use_family(bench_t *b, const bench_cfg_t *c, const char *name)
{
    tdm_error_t err = {0};
    setenv("TANDEM_CPU_KERNELS", name, 1);
    tdm_engine_destroy(&b->engine);
    if (!(b->engine = bench_engine_new(b, c, &err))) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }
    return 0;
}

/* Loads the model and makes a KV pool for the longest prefill plus max_batch decoding
 * sequences, the engine and the logits buffer. Returns 0, or 1 after printing why; the caller
 * releases b with bench_close either way. */
static int bench_open(bench_t *b, const bench_cfg_t *c, uint64_t *pool_bytes)
{
    tdm_error_t err = {0};
    b->model = tdm_model_load(c->model_path, &err);
    if (!b->model) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }
    const tdm_llama_hparams_t *hp = tdm_model_hparams(b->model);
    b->n_vocab = hp->n_vocab;
    if (c->cuda && hp->n_ctx_train < c->n_ctx) {
        fprintf(stderr, "bench: the model's context (%u) is shorter than the 4096-token prefill\n",
                hp->n_ctx_train);
        return 1;
    }
    if (tdm_kv_dtype_parse(c->kv_name, &b->kv_dtype, &err) != TDM_OK) {
        fprintf(stderr, "bench: --kv: %s\n", err.msg);
        return 1;
    }
    tdm_kv_layout_t kl = {hp->n_layers, hp->n_kv_heads, hp->head_dim, 16, b->kv_dtype};
    b->decode_ctx = c->cuda ? DECODE_CTX_CUDA : DECODE_CTX_CPU;
    uint32_t decode_ctx = b->decode_ctx + (c->cuda ? (uint32_t)c->steps : 64) + 16;
    uint32_t n_blocks = (uint32_t)tdm_kv_blocks_for_tokens(&kl, c->n_large) +
                        c->max_batch * (uint32_t)tdm_kv_blocks_for_tokens(&kl, decode_ctx);
    if (c->n_depth) /* the depth measures run alone: DEPTH_BATCH sequences of the longest */
        n_blocks = DEPTH_BATCH * (uint32_t)tdm_kv_blocks_for_tokens(&kl, c->n_ctx);
    *pool_bytes = (uint64_t)n_blocks * tdm_kv_block_bytes(&kl);
    b->pool = tdm_kv_pool_new(&kl, n_blocks, &err);
    b->engine = b->pool ? bench_engine_new(b, c, &err) : NULL;
    b->logits = malloc((size_t)c->max_batch * b->n_vocab * sizeof(float));
    if (!b->engine || !b->logits) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }
    return 0;
}

static void bench_close(bench_t *b)
{
    tdm_engine_destroy(&b->engine);
    tdm_kv_pool_destroy(&b->pool);
    tdm_model_destroy(&b->model);
    free(b->logits);
    b->logits = NULL;
}

/* The copy bandwidth (host memcpy, or device-to-device on CUDA) and the weight bytes a
 * batch-1 step reads. Returns 0, or 1 after printing why. */
static int measure_bandwidth(const bench_t *b, const bench_cfg_t *c, bench_result_t *r)
{
    r->wbytes = tdm_model_weight_bytes(b->model);
    r->bw_name = "memcpy bandwidth";
    if (!c->cuda) {
        r->bw = memcpy_bandwidth();
        return 0;
    }
#ifdef TANDEM_HAVE_CUDA
    char msg[256];
    int device = strncmp(c->backend, "cuda:", 5) == 0 ? atoi(c->backend + 5) : 0;
    if (tdm_bench_hbm_d2d(device, &r->bw, msg, sizeof msg) != 0) {
        fprintf(stderr, "bench: %s\n", msg);
        return 1;
    }
    if (tdm_bench_gemm_peak(device, &r->gemm_flops, msg, sizeof msg) != 0) {
        fprintf(stderr, "bench: %s\n", msg);
        return 1;
    }
#endif
    r->wbytes = cuda_weight_bytes(b->model);
    r->bw_name = "HBM copy bandwidth";
    return 0;
}

/* Elements of every 2-D weight but the token embedding (a lookup, not a product). */
static uint64_t matrix_params(const tdm_model_t *m)
{
    const tdm_gguf_t *g = tdm_model_gguf(m);
    uint64_t n = 0;
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        if (t->n_dims == 2 && strcmp(t->name, "token_embd.weight") != 0)
            n += t->n_elements;
    }
    if (!tdm_gguf_find_tensor(g, "output.weight")) /* tied: the output reuses the embedding */
        n += tdm_gguf_find_tensor(g, "token_embd.weight")->n_elements;
    return n;
}

/* Runs every measurement into *r. Returns 0, or 1 after printing why. */
static int bench_measure(bench_t *b, const bench_cfg_t *c, bench_result_t *r)
{
    int warm = c->cuda ? 1 : 0; /* the GPU's first passes load kernels and pick GEMM algorithms */
    r->p_small = bench_prefill(b, c->n_small, 3, warm);
    r->p_large = bench_prefill(b, c->n_large, 3, warm);
    for (int i = 0; i < c->n_batches; i++)
        r->step[i] = bench_decode(b, c->batches[i], c->steps);
    /* peak RSS of the engine work, read before the bandwidth test's 512 MiB of buffers */
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    r->rss = (uint64_t)ru.ru_maxrss * 1024;
    if (measure_bandwidth(b, c, r) != 0)
        return 1;
    r->bound = (double)r->wbytes / r->bw;
    r->matrix_params = matrix_params(b->model);
    return 0;
}

/* The table, to stderr. */
static void print_table(const bench_t *b, const bench_cfg_t *c, const bench_result_t *r)
{
    fprintf(stderr, "model %s, backend %s, threads %d\n", c->model_path,
            tdm_engine_backend_name(b->engine), c->threads);
    fprintf(stderr, "%-28s %12s\n", "measure", "value");
    char label[64];
    snprintf(label, sizeof label, "prefill %u tokens/s", c->n_small);
    fprintf(stderr, "%-28s %12.1f\n", label, c->n_small / r->p_small);
    snprintf(label, sizeof label, "prefill %u tokens/s", c->n_large);
    fprintf(stderr, "%-28s %12.1f\n", label, c->n_large / r->p_large);
    for (int i = 0; i < c->n_batches; i++) {
        snprintf(label, sizeof label, "decode batch %u tokens/s", c->batches[i]);
        fprintf(stderr, "%-28s %12.1f  (%.1f per sequence, %.2f ms/step)\n", label,
                c->batches[i] / r->step[i], 1.0 / r->step[i], r->step[i] * 1e3);
    }
    fprintf(stderr, "%-28s %12.2f\n", "batch 32 / batch 1",
            (32 / r->step[c->cuda ? 1 : 2]) / (1 / r->step[0]));
    fprintf(stderr, "%-28s %12.2f GB/s\n", r->bw_name, r->bw / 1e9);
    fprintf(stderr, "%-28s %12.3f ms (weights %.1f MB%s)\n", "batch-1 memory bound", r->bound * 1e3,
            (double)r->wbytes / 1e6, c->cuda ? " on the device" : "");
    fprintf(stderr, "%-28s %12.2f\n", "batch-1 time / bound", r->step[0] / r->bound);
    if (r->gemm_flops > 0) {
        double pf = 2.0 * (double)r->matrix_params * c->n_large / r->p_large;
        fprintf(stderr, "%-28s %12.1f TFLOP/s\n", "bf16 GEMM peak (cuBLAS)", r->gemm_flops / 1e12);
        fprintf(stderr, "%-28s %12.1f TFLOP/s (%.0f%% of the peak)\n", "prefill FLOP rate",
                pf / 1e12, 100.0 * pf / r->gemm_flops);
    }
    fprintf(stderr, "%-28s %12.1f MiB (model %.1f + KV pool %.1f + scratch %.1f MiB)\n", "peak RSS",
            (double)r->rss / 1048576.0, (double)tdm_model_weight_bytes(b->model) / 1048576.0,
            (double)r->pool_bytes / 1048576.0,
            (double)tdm_engine_scratch_bytes(b->engine) / 1048576.0);
}

/* The JSON document, to stdout or --json FILE. Returns 0, or 1 when the file cannot be
 * written. */
static int write_json(const bench_t *b, const bench_cfg_t *c, const bench_result_t *r)
{
    FILE *out = c->json_path ? fopen(c->json_path, "w") : stdout;
    if (!out) {
        fprintf(stderr, "bench: cannot write %s\n", c->json_path);
        return 1;
    }
    fprintf(out,
            "{\"backend\": \"%s\", \"threads\": %d, \"weight_bytes\": %" PRIu64
            ", \"kv_pool_bytes\": %" PRIu64 ", \"scratch_bytes\": %" PRIu64
            ", \"peak_rss_bytes\": %" PRIu64 ",\n \"prefill_tokens_per_s\": {\"%u\": %.2f, "
            "\"%u\": %.2f},\n \"decode_step_s\": {",
            tdm_engine_backend_name(b->engine), c->threads, tdm_model_weight_bytes(b->model),
            r->pool_bytes, tdm_engine_scratch_bytes(b->engine), r->rss, c->n_small,
            c->n_small / r->p_small, c->n_large, c->n_large / r->p_large);
    for (int i = 0; i < c->n_batches; i++)
        fprintf(out, "%s\"%u\": %.6f", i ? ", " : "", c->batches[i], r->step[i]);
    uint64_t file_bytes = tdm_gguf_file_size(tdm_model_gguf(b->model));
    if (c->cuda)
        fprintf(out,
                "},\n \"hbm_d2d_bytes_per_s\": %.0f, \"device_weight_bytes\": %" PRIu64
                ", \"batch1_bound_s\": %.6f, \"model_file_bytes\": %" PRIu64
                ", \"decode_context_tokens\": %u, \"gemm_bf16_flops\": %.0f, \"matrix_params\": "
                "%" PRIu64 "}\n",
                r->bw, r->wbytes, r->bound, file_bytes, b->decode_ctx, r->gemm_flops,
                r->matrix_params);
    else
        fprintf(
            out,
            "},\n \"memcpy_bytes_per_s\": %.0f, \"batch1_bound_s\": %.6f, \"model_file_bytes\": "
            "%" PRIu64 ", \"rss_limit_bytes\": %" PRIu64 "}\n",
            r->bw, r->bound, file_bytes, file_bytes + r->pool_bytes + ((uint64_t)64 << 20));
    if (c->json_path)
        fclose(out);
    return 0;
}

#define CMP_MAX 8      /* kernel families one comparison takes */
#define CMP_MEASURES 5 /* prefill 128, 512; decode batch 1, 8, 32 */

/* Seconds of each measure for the engine now in b (prefill passes, decode steps). */
static void compare_once(bench_t *b, const bench_cfg_t *c, double *sec)
{
    static const uint32_t batches[] = {1, 8, 32};
    sec[0] = bench_prefill(b, 128, 1, 1);
    sec[1] = bench_prefill(b, 512, 1, 0);
    for (int i = 0; i < 3; i++)
        sec[2 + i] = bench_decode(b, batches[i], c->steps);
}

/* Prints tokens/s per family and each family's ratio to the first one. */
static void compare_print(char names[][32], int n, double best[][CMP_MEASURES])
{
    static const char *const labels[] = {"prefill 128 tokens/s", "prefill 512 tokens/s",
                                         "decode batch 1 tokens/s", "decode batch 8 tokens/s",
                                         "decode batch 32 tokens/s"};
    static const double tokens[] = {128, 512, 1, 8, 32};
    fprintf(stderr, "%-26s", "measure");
    for (int k = 0; k < n; k++)
        fprintf(stderr, " %14s", names[k]);
    fprintf(stderr, "   ratios to %s\n", names[0]);
    for (int m = 0; m < CMP_MEASURES; m++) {
        fprintf(stderr, "%-26s", labels[m]);
        for (int k = 0; k < n; k++)
            fprintf(stderr, " %14.1f", tokens[m] / best[k][m]);
        fprintf(stderr, "  ");
        for (int k = 1; k < n; k++)
            fprintf(stderr, " %.2f", best[0][m] / best[k][m]);
        fprintf(stderr, "\n");
    }
}

/* --kernels: each round creates one engine per family (TANDEM_CPU_KERNELS) and measures it,
 * so the families share the machine's state; the best of the rounds is kept. */
static int run_compare(bench_t *b, const bench_cfg_t *c)
{
    char names[CMP_MAX][32], list[256];
    int n = 0;
    snprintf(list, sizeof list, "%s", c->kernels);
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok && n < CMP_MAX;
         tok = strtok_r(NULL, ",", &save))
        snprintf(names[n++], sizeof names[0], "%s", tok);
    double best[CMP_MAX][CMP_MEASURES];
    for (int r = 0; r < c->rounds; r++) {
        for (int k = 0; k < n; k++) {
            if (use_family(b, c, names[k]) != 0)
                return 1;
            double sec[CMP_MEASURES];
            compare_once(b, c, sec);
            for (int m = 0; m < CMP_MEASURES; m++)
                best[k][m] = r == 0 || sec[m] < best[k][m] ? sec[m] : best[k][m];
            fprintf(stderr, "round %d %s (%s) done\n", r + 1, names[k],
                    tdm_engine_backend_name(b->engine));
        }
    }
    compare_print(names, n, best);
    return 0;
}

/* ---- --peak: prefill against the int8 peak, per-op profiles ---- */

#define PK_MEASURES 4 /* prefill 128, prefill 512, decode batch 1, decode batch 32 */

/* One measure's fastest pass: seconds per forward pass and per op class. */
typedef struct pk_prof {
    double pass_s;
    double op_s[TDM_OP_N_CLASSES];
} pk_prof_t;

/* Weight-matrix parameters: the layers' 2-D tensors (q, k, v, o, gate, up, down, or their
 * fused forms; experts too) in *layers, the output projection (the tied embedding when the
 * model has no output.weight) in *head. */
static void weight_params(const tdm_model_t *m, uint64_t *layers, uint64_t *head)
{
    const tdm_gguf_t *g = tdm_model_gguf(m);
    *layers = *head = 0;
    for (uint64_t i = 0; i < tdm_gguf_n_tensors(g); i++) {
        const tdm_gguf_tensor_t *t = tdm_gguf_tensor_at(g, i);
        if (t->n_dims >= 2 && strncmp(t->name, "blk.", 4) == 0)
            *layers += t->n_elements;
    }
    const tdm_gguf_tensor_t *o = tdm_gguf_find_tensor(g, "output.weight");
    *head = (o ? o : tdm_gguf_find_tensor(g, "token_embd.weight"))->n_elements;
}

/* The op times of the passes run since timing went on, per pass, into *p. */
static void pk_read(const bench_t *b, pk_prof_t *p)
{
    tdm_op_times_t t;
    tdm_engine_op_times(b->engine, &t);
    double n = t.forwards ? (double)t.forwards : 1.0;
    p->pass_s = t.forward_seconds / n;
    for (int k = 0; k < TDM_OP_N_CLASSES; k++)
        p->op_s[k] = t.seconds[k] / n;
}

/* The four measures once for the engine now in b, timed per op. */
static void pk_once(bench_t *b, const bench_cfg_t *c, pk_prof_t *p)
{
    static const uint32_t lens[2] = {128, 512};
    for (int i = 0; i < 2; i++) {
        bench_prefill(b, lens[i], 1, 0); /* untimed warm-up */
        tdm_engine_op_timing(b->engine, true);
        bench_prefill(b, lens[i], 3, 0);
        tdm_engine_op_timing(b->engine, false);
        pk_read(b, &p[i]);
    }
    static const uint32_t batches[2] = {1, 32};
    for (int i = 0; i < 2; i++) {
        bench_decode_ctx(b, batches[i], c->steps, true, true);
        pk_read(b, &p[2 + i]);
    }
}

/* Index into the peak table of the family an engine name ("cpu/amx-int8") ran. */
static int pk_family(const char *name)
{
    if (strstr(name, "amx"))
        return 3;
    if (strstr(name, "avx512"))
        return 2;
    if (strstr(name, "vnni"))
        return 1;
    if (strstr(name, "avx2"))
        return 0;
    return -1; /* scalar: no int8 SIMD peak */
}

static const char *const pk_labels[PK_MEASURES] = {"prefill 128", "prefill 512", "decode b1",
                                                   "decode b32"};
static const double pk_tokens[PK_MEASURES] = {128, 512, 1, 32};

/* One family's table: per measure tokens/s, pass time, the per-op times, and the GEMMs'
 * int8 rate against the family's peak (layer GEMM time alone, and the whole pass). */
static void pk_print(const char *family, const char *engine, const tdm_peak_t *peak,
                     const pk_prof_t *p, uint64_t layer_params)
{
    fprintf(stderr, "\n%s (%s), peak %s: %.3f TOPS on %d threads\n", family, engine,
            peak ? peak->insn : "none (scalar)", peak ? peak->ops / 1e12 : 0.0,
            peak ? peak->threads : 0);
    fprintf(stderr, "%-12s %9s %9s", "measure", "tokens/s", "pass ms");
    for (int k = 0; k < TDM_OP_N_CLASSES; k++)
        if (k != TDM_OP_MOE)
            fprintf(stderr, " %9s", tdm_op_class_name((tdm_op_class_t)k));
    fprintf(stderr, " %8s %8s %8s\n", "GEMM %", "pass %", "TOPS");
    for (int m = 0; m < PK_MEASURES; m++) {
        double ops = 2.0 * (double)layer_params * pk_tokens[m];
        double gemm = p[m].op_s[TDM_OP_GEMM] + p[m].op_s[TDM_OP_MOE];
        fprintf(stderr, "%-12s %9.1f %9.3f", pk_labels[m], pk_tokens[m] / p[m].pass_s,
                p[m].pass_s * 1e3);
        for (int k = 0; k < TDM_OP_N_CLASSES; k++)
            if (k != TDM_OP_MOE)
                fprintf(stderr, " %9.3f", (k == TDM_OP_GEMM ? gemm : p[m].op_s[k]) * 1e3);
        double pk = peak ? peak->ops : 0;
        fprintf(stderr, " %7.1f%% %7.1f%% %8.3f\n", pk > 0 ? 100.0 * ops / (gemm * pk) : 0.0,
                pk > 0 ? 100.0 * ops / (p[m].pass_s * pk) : 0.0, ops / gemm / 1e12);
    }
    fprintf(stderr, "batch 32 / batch 1 (aggregate tokens/s): %.2f\n",
            (32.0 / p[3].pass_s) / (1.0 / p[2].pass_s));
}

/* The JSON document of a --peak run. */
static void pk_json(FILE *out, const bench_cfg_t *c, const char *smt, const tdm_peak_t *peaks,
                    uint64_t layer_params, uint64_t head_params, int n, char names[][32],
                    char engines[][64], pk_prof_t (*best)[PK_MEASURES])
{
    fprintf(out,
            "{\"threads\": %d, \"smt\": \"%s\", \"layer_params\": %" PRIu64
            ", \"head_params\": %" PRIu64 ", \"rounds\": %d, \"steps\": %d,\n \"peak\": {",
            c->threads, smt, layer_params, head_params, c->rounds, c->steps);
    for (int f = 0; f < TDM_PEAK_FAMILIES; f++)
        fprintf(out,
                "%s\"%s\": {\"insn\": \"%s\", \"available\": %s, \"ops_1t\": %.4g, "
                "\"ops\": %.4g}",
                f ? ", " : "", peaks[f].family, peaks[f].insn,
                peaks[f].available ? "true" : "false", peaks[f].ops_1t, peaks[f].ops);
    fprintf(out, "},\n \"families\": {");
    static const char *const keys[PK_MEASURES] = {"prefill_128", "prefill_512", "decode_1",
                                                  "decode_32"};
    for (int k = 0; k < n; k++) {
        int f = pk_family(engines[k]);
        fprintf(out, "%s\n  \"%s\": {\"engine\": \"%s\", \"peak_ops\": %.4g", k ? "," : "",
                names[k], engines[k], f >= 0 ? peaks[f].ops : 0.0);
        for (int m = 0; m < PK_MEASURES; m++) {
            fprintf(out, ", \"%s\": {\"pass_s\": %.6g", keys[m], best[k][m].pass_s);
            for (int o = 0; o < TDM_OP_N_CLASSES; o++)
                fprintf(out, ", \"%s_s\": %.6g", tdm_op_class_name((tdm_op_class_t)o),
                        best[k][m].op_s[o]);
            fprintf(out, "}");
        }
        fprintf(out, "}");
    }
    fprintf(out, "}}\n");
}

/* The peak table of the best of the rounds, to stderr. */
static void pk_print_peaks(const tdm_peak_t *peaks, int rounds, int threads)
{
    fprintf(stderr, "\nint8 peak, best of %d rounds:\n", rounds);
    fprintf(stderr, "%-8s %-32s %12s %12s\n", "family", "instructions", "TOPS 1 thr", "TOPS all");
    for (int f = 0; f < TDM_PEAK_FAMILIES; f++) {
        if (!peaks[f].available)
            fprintf(stderr, "%-8s %-32s %12s %12s\n", peaks[f].family, peaks[f].insn, "n/a", "n/a");
        else
            fprintf(stderr, "%-8s %-32s %12.3f %12.3f  (%d threads)\n", peaks[f].family,
                    peaks[f].insn, peaks[f].ops_1t / 1e12, peaks[f].ops / 1e12, threads);
    }
}

/* The peak measured again, each figure of *peaks raised to the new one where that is higher. */
static void pk_peak_again(int threads, tdm_peak_t *peaks)
{
    tdm_peak_t again[TDM_PEAK_FAMILIES];
    tdm_bench_peak(threads, again);
    for (int f = 0; f < TDM_PEAK_FAMILIES; f++) {
        peaks[f].ops_1t = again[f].ops_1t > peaks[f].ops_1t ? again[f].ops_1t : peaks[f].ops_1t;
        peaks[f].ops = again[f].ops > peaks[f].ops ? again[f].ops : peaks[f].ops;
    }
}

/* --rounds interleaved rounds over the n families (an engine each when --kernels names them),
 * the peak measured again before every round after the first; the fastest pass of each measure
 * into best[k], the engines' names into engines[k]. Returns 0, or 1 after printing why. */
static int pk_rounds(bench_t *b, const bench_cfg_t *c, int threads, tdm_peak_t *peaks, int n,
                     char names[][32], char engines[][64], pk_prof_t (*best)[PK_MEASURES])
{
    for (int r = 0; r < c->rounds; r++) {
        if (r > 0)
            pk_peak_again(threads, peaks);
        for (int k = 0; k < n; k++) {
            if (c->kernels && use_family(b, c, names[k]) != 0)
                return 1;
            snprintf(engines[k], 64, "%s", tdm_engine_backend_name(b->engine));
            pk_prof_t p[PK_MEASURES];
            pk_once(b, c, p);
            for (int m = 0; m < PK_MEASURES; m++)
                if (r == 0 || p[m].pass_s < best[k][m].pass_s)
                    best[k][m] = p[m];
            fprintf(stderr, "round %d %s (%s) done\n", r + 1, names[k], engines[k]);
        }
    }
    return 0;
}

/* --peak: the int8 peaks, then per family (--kernels, or the default one) --rounds
 * interleaved rounds of the four measures with per-op times, the fastest pass of each
 * measure kept. Prints tables to stderr and JSON to stdout (or --json FILE). Returns 0, or 1
 * after printing why. */
static int run_peak(bench_t *b, const bench_cfg_t *c)
{
    char smt[512];
    tdm_bench_smt(smt, sizeof smt);
    int threads = c->threads > 0 ? c->threads : tdm_bench_default_threads();
    tdm_peak_t peaks[TDM_PEAK_FAMILIES];
    tdm_bench_peak(threads, peaks);
    fprintf(stderr, "SMT: %s\n", smt);
    uint64_t layer_params, head_params;
    weight_params(b->model, &layer_params, &head_params);
    fprintf(stderr,
            "weight-matrix params: layers %.2f M (q,k,v,o,gate,up,down), output head %.2f M "
            "(not counted: a prefill pass multiplies it for its last token only)\n",
            layer_params / 1e6, head_params / 1e6);
    char names[CMP_MAX][32], engines[CMP_MAX][64], list[256];
    int n = 0;
    snprintf(list, sizeof list, "%s", c->kernels ? c->kernels : "");
    for (char *save = NULL, *tok = strtok_r(list, ",", &save); tok && n < CMP_MAX;
         tok = strtok_r(NULL, ",", &save))
        snprintf(names[n++], sizeof names[0], "%s", tok);
    if (n == 0)
        snprintf(names[n++], sizeof names[0], "default");
    pk_prof_t(*best)[PK_MEASURES] = calloc((size_t)n, sizeof *best);
    FILE *out = NULL;
    int rc = best ? pk_rounds(b, c, threads, peaks, n, names, engines, best) : 1;
    if (rc == 0) {
        pk_print_peaks(peaks, c->rounds, threads);
        for (int k = 0; k < n; k++) {
            int f = pk_family(engines[k]);
            pk_print(names[k], engines[k], f >= 0 && peaks[f].available ? &peaks[f] : NULL, best[k],
                     layer_params);
        }
        fprintf(stderr,
                "(ms per pass; GEMM %%: 2 x layer weight params x tokens / (gemm time x "
                "peak); pass %%: the same over the whole pass; TOPS: int8 rate of the GEMMs)\n");
        out = c->json_path ? fopen(c->json_path, "w") : stdout;
        if (!out)
            fprintf(stderr, "bench: cannot write %s\n", c->json_path);
        rc = out ? 0 : 1;
    }
    if (out)
        pk_json(out, c, smt, peaks, layer_params, head_params, n, names, engines, best);
    if (out && c->json_path)
        fclose(out);
    free(best);
    return rc;
}

int main(int argc, char **argv)
{
    bench_cfg_t c = {0};
    bool done;
    int status = parse_args(argc, argv, &c, &done);
    if (done)
        return status;
    bench_t b = {0};
    bench_result_t r = {0};
    status = bench_open(&b, &c, &r.pool_bytes);
    if (status == 0 && c.decode_only) {
        double step = bench_decode_ctx(&b, c.decode_only, c.steps, false, false);
        fprintf(stderr, "decode batch %u: %.2f ms/step, %.1f tokens/s\n", c.decode_only, step * 1e3,
                c.decode_only / step);
        bench_close(&b);
        return 0;
    }
    if (status == 0 && c.n_depth) {
        status = run_depth(&b, &c);
        bench_close(&b);
        return status;
    }
    if (status == 0 && c.peak) {
        status = run_peak(&b, &c);
        bench_close(&b);
        return status;
    }
    if (status == 0 && c.kernels) {
        status = run_compare(&b, &c);
        bench_close(&b);
        return status;
    }
    if (status == 0)
        status = bench_measure(&b, &c, &r);
    if (status == 0) {
        print_table(&b, &c, &r);
        status = write_json(&b, &c, &r);
    }
    bench_close(&b);
    return status;
}
