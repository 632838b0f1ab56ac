/* cmd_bench.c - `tandem bench`: a load generator through the router.
 *
 * Open loop (--rate R: Poisson arrivals, exponential gaps with mean 1/R, scheduled from the
 * previous arrival and not from the previous answer, so a slow server does not slow the
 * load down) or closed loop (--concurrency N: N requests always in flight); both together cap
 * the open loop at N in flight. All requests are driven from this one thread with the async
 * client API (tdm_client_generate_start / tdm_client_poll).
 *
 * Latencies are measured here, from sending the request: TTFT to the first chunk with a token,
 * TPOT = (last token - first token) / (output tokens - 1) over requests with at least two
 * tokens, end-to-end to the end of the call. Percentiles interpolate linearly between order
 * statistics (numpy's default), as vLLM's benchmark_serving reports them. Goodput is the share
 * of requests that succeeded and met both SLOs (DistServe, Zhong et al., OSDI 2024).
 *
 * Prompts are random words (drawn with the counter-based tdm_sampling_uniform from --seed, so
 * a run is reproducible) or lines of --prompt-file; a common English word is about one token
 * in the models Tandem serves, and the report gives the prompt tokens the router counted.
 * --ignore-eos is on by default so the output lengths are the ones asked for.
 */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <jansson.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/client.h"

#define CMD "tandem bench"

/* Longest prompt, in words, and output, in tokens. */
#define BENCH_MAX_LEN 1000000L

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem bench [--rate R | --concurrency N] [--requests N | --duration S]\n"
            "                    [options]\n"
            "\n"
            "Sends generated requests to the router and reports TTFT, TPOT and end-to-end\n"
            "latency percentiles, throughput, goodput against SLOs and errors by status.\n"
            "\n"
            "load:\n"
            "      --rate R              open loop: Poisson arrivals, R requests/s\n"
            "      --concurrency N       closed loop: N requests in flight (default 1); with\n"
            "                            --rate, the most in flight\n"
            "      --requests N          requests to send (default 100)\n"
            "      --duration S          send for S seconds instead (then wait for the answers)\n"
            "workload:\n"
            "      --prompt-len L|A:B    prompt length in words: fixed, or uniform in [A, B]\n"
            "                            (default 128)\n"
            "      --output-len L|A:B    max_tokens per request, fixed or uniform (default 128)\n"
            "      --prompt-file FILE    prompts, one per line, picked at random\n"
            "      --no-ignore-eos       stop at end-of-generation tokens (default: ignore them,\n"
            "                            so outputs have the asked length)\n"
            "      --temperature T       sampling temperature (default 0, greedy)\n"
            "      --seed S              seed of the workload and the requests (default 0)\n"
            "report:\n"
            "      --slo-ttft-ms X       TTFT objective for goodput\n"
            "      --slo-tpot-ms Y       TPOT objective for goodput\n"
            "      --json FILE           also write the results as JSON\n"
            "connection:\n"
            "      --router EP[,EP...]   router client endpoint (default $TANDEM_ROUTER or\n"
            "                            " TDM_CLIENT_DEFAULT_ENDPOINT "); several: each request\n"
            "                            goes to the next in turn, and to the one after when its\n"
            "                            router fails before the first token\n"
            "      --api-key KEY         API key (default $TANDEM_API_KEY)\n"
            "      --timeout SECONDS     deadline of each request (default 600)\n"
            "  -h, --help                this help\n");
}

/* Common English words, about one token each (with the leading space). */
static const char *const bench_words[] = {
    "the",    "of",   "and",   "to",   "in",    "is",    "it",     "that",  "was",  "for",
    "on",     "are",  "with",  "as",   "his",   "they",  "be",     "at",    "one",  "have",
    "this",   "from", "or",    "had",  "by",    "word",  "but",    "what",  "some", "we",
    "can",    "out",  "other", "were", "all",   "there", "when",   "up",    "use",  "your",
    "how",    "said", "an",    "each", "she",   "which", "do",     "their", "time", "if",
    "will",   "way",  "about", "many", "then",  "them",  "write",  "would", "like", "so",
    "these",  "her",  "long",  "make", "thing", "see",   "him",    "two",   "has",  "look",
    "more",   "day",  "could", "go",   "come",  "did",   "number", "sound", "no",   "most",
    "people", "my",   "over",  "know", "water", "than",  "call",   "first", "who",  "may",
    "down",   "side", "been",  "now",  "find",  "any",   "new",    "work",  "part", "take",
};
#define BENCH_N_WORDS (sizeof bench_words / sizeof bench_words[0])

/* A length: fixed (lo == hi) or uniform in [lo, hi]. */
typedef struct bench_range {
    long lo, hi;
} bench_range_t;

typedef struct bench_opts {
    double rate;      /* requests/s; 0 = closed loop */
    long concurrency; /* most in flight; 0 = no cap (only with --rate) */
    long requests;    /* 0 = until duration */
    double duration;  /* seconds; 0 = until requests */
    bench_range_t prompt_len, output_len;
    const char *prompt_file;
    bool ignore_eos;
    float temperature;
    uint64_t seed;
    double slo_ttft_ms, slo_tpot_ms; /* 0 = none */
    const char *json_path;
    const char *router, *api_key;
    double timeout_s;
} bench_opts_t;

/* One request's outcome. */
typedef struct bench_rec {
    struct bench_run *run;
    bool done;
    int status;
    double ttft_s, tpot_s, e2e_s;
    uint32_t prompt_tokens, cached_tokens, output_tokens;
    bool has_tpot; /* at least two output tokens */
} bench_rec_t;

typedef struct bench_run {
    const bench_opts_t *o;
    tdm_client_t *client;
    bench_rec_t **recs; /* [n_recs], each allocated on its own: callbacks hold pointers */
    size_t n_recs, cap_recs;
    size_t n_done;
    char **prompts; /* --prompt-file lines */
    size_t n_prompts;
    char *file_text;
    uint64_t rng;         /* counter of tdm_sampling_uniform draws */
    tdm_buf_t prompt_buf; /* the current random-word prompt */
    double t_first_sent, t_last_done;
} bench_run_t;

static double bench_uniform(bench_run_t *b)
{
    return tdm_sampling_uniform(b->o->seed, b->rng++);
}

static long bench_draw(bench_run_t *b, bench_range_t r)
{
    if (r.lo == r.hi)
        return r.lo;
    long span = r.hi - r.lo + 1;
    long v = r.lo + (long)(bench_uniform(b) * (double)span);
    return v > r.hi ? r.hi : v;
}

/* Parses "L" or "A:B" (1 <= A <= B <= BENCH_MAX_LEN). */
static bool parse_range(const char *opt, const char *s, bench_range_t *r)
{
    const char *colon = strchr(s, ':');
    if (!colon) {
        if (!tdm_cli_parse_long(CMD, opt, s, 1, BENCH_MAX_LEN, &r->lo))
            return false;
        r->hi = r->lo;
        return true;
    }
    char lo[32];
    size_t n = (size_t)(colon - s);
    if (n == 0 || n >= sizeof lo) {
        fprintf(stderr, CMD ": %s must be L or A:B, got '%s'\n", opt, s);
        return false;
    }
    memcpy(lo, s, n);
    lo[n] = '\0';
    if (!tdm_cli_parse_long(CMD, opt, lo, 1, BENCH_MAX_LEN, &r->lo) ||
        !tdm_cli_parse_long(CMD, opt, colon + 1, 1, BENCH_MAX_LEN, &r->hi))
        return false;
    if (r->lo > r->hi) {
        fprintf(stderr, CMD ": %s: A must not exceed B, got '%s'\n", opt, s);
        return false;
    }
    return true;
}

/* Splits the prompt file into non-empty lines (pointers into b->file_text). */
static int load_prompts(bench_run_t *b, const char *path)
{
    size_t len;
    tdm_error_t err = {0};
    if (tdm_read_file(path, (size_t)1 << 30, &b->file_text, &len, &err) != TDM_OK) {
        fprintf(stderr, CMD ": --prompt-file: %s\n", err.msg);
        return 1;
    }
    size_t cap = 0;
    for (char *p = b->file_text; *p;) {
        char *nl = strchr(p, '\n');
        char *next = nl ? nl + 1 : p + strlen(p);
        if (nl)
            *nl = '\0';
        if (nl && nl > p && nl[-1] == '\r')
            nl[-1] = '\0';
        if (*p) {
            if (b->n_prompts == cap) {
                cap = cap ? cap * 2 : 256;
                char **np = realloc(b->prompts, cap * sizeof *np);
                if (!np) {
                    fprintf(stderr, CMD ": out of memory\n");
                    return 1;
                }
                b->prompts = np;
            }
            b->prompts[b->n_prompts++] = p;
        }
        p = next;
    }
    if (b->n_prompts == 0) {
        fprintf(stderr, CMD ": --prompt-file %s has no non-empty line\n", path);
        return 2;
    }
    return 0;
}

/* The next prompt: a random line of the file, or n random words. NULL on out of memory. */
static const char *next_prompt(bench_run_t *b)
{
    if (b->n_prompts > 0) {
        size_t i = (size_t)(bench_uniform(b) * (double)b->n_prompts);
        return b->prompts[i < b->n_prompts ? i : b->n_prompts - 1];
    }
    long n = bench_draw(b, b->o->prompt_len);
    tdm_buf_clear(&b->prompt_buf);
    for (long i = 0; i < n; i++) {
        size_t w = (size_t)(bench_uniform(b) * (double)BENCH_N_WORDS);
        const char *word = bench_words[w < BENCH_N_WORDS ? w : BENCH_N_WORDS - 1];
        if (i > 0)
            tdm_buf_append(&b->prompt_buf, " ", 1);
        tdm_buf_puts(&b->prompt_buf, word);
    }
    if (tdm_buf_puts(&b->prompt_buf, "") != TDM_OK) /* also makes an empty prompt "" */
        return NULL;
    return b->prompt_buf.data;
}

static void bench_done(void *user, const tdm_client_result_t *r)
{
    bench_rec_t *rec = user;
    bench_run_t *b = rec->run;
    rec->done = true;
    rec->status = r->status;
    rec->ttft_s = r->client_timings.ttft_s;
    rec->tpot_s = r->client_timings.tpot_s;
    rec->e2e_s = r->client_timings.e2e_s;
    rec->prompt_tokens = r->usage.prompt_tokens;
    rec->cached_tokens = r->usage.cached_prompt_tokens;
    rec->output_tokens =
        r->usage.completion_tokens ? r->usage.completion_tokens : (uint32_t)r->n_tokens;
    rec->has_tpot = r->n_tokens > 1;
    b->n_done++;
    b->t_last_done = tdm_time_now();
}

/* Starts one request. Returns 0, or 1 on out of memory. A request that fails to start is
 * recorded as done with its status. */
static int bench_start(bench_run_t *b, uint64_t index)
{
    if (b->n_recs == b->cap_recs) {
        size_t cap = b->cap_recs ? b->cap_recs * 2 : 1024;
        bench_rec_t **r = realloc(b->recs, cap * sizeof *r);
        if (!r)
            return 1;
        b->recs = r;
        b->cap_recs = cap;
    }
    bench_rec_t *rec = calloc(1, sizeof *rec);
    const char *prompt = next_prompt(b);
    if (!rec || !prompt) {
        free(rec);
        return 1;
    }
    rec->run = b;
    b->recs[b->n_recs++] = rec;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = prompt;
    req.max_tokens = (int32_t)bench_draw(b, b->o->output_len);
    req.sampling.temperature = b->o->temperature;
    req.sampling.ignore_eos = b->o->ignore_eos;
    req.sampling.seed = b->o->seed + index;
    req.sampling_set = TDM_PROTO_SET_TEMPERATURE | TDM_PROTO_SET_IGNORE_EOS | TDM_PROTO_SET_SEED;
    double now = tdm_time_now();
    if (b->t_first_sent == 0)
        b->t_first_sent = now;
    int rc = tdm_client_generate_start(b->client, &req, NULL, bench_done, rec, NULL);
    if (rc != TDM_OK) {
        rec->done = true;
        rec->status = rc;
        b->n_done++;
        b->t_last_done = now;
    }
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Summary of a sample, milliseconds. */
typedef struct bench_dist {
    size_t n;
    double mean, p50, p90, p99, max;
} bench_dist_t;

/* Percentile q (0..100) of sorted v[n] with linear interpolation. */
static double percentile(const double *v, size_t n, double q)
{
    if (n == 0)
        return 0;
    double pos = q / 100.0 * (double)(n - 1);
    size_t i = (size_t)pos;
    if (i + 1 >= n)
        return v[n - 1];
    double frac = pos - (double)i;
    return v[i] + (v[i + 1] - v[i]) * frac;
}

static bench_dist_t dist_of(double *v, size_t n)
{
    bench_dist_t d = {0};
    d.n = n;
    if (n == 0)
        return d;
    qsort(v, n, sizeof *v, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += v[i];
    d.mean = sum / (double)n;
    d.p50 = percentile(v, n, 50);
    d.p90 = percentile(v, n, 90);
    d.p99 = percentile(v, n, 99);
    d.max = v[n - 1];
    return d;
}

/* Everything the report prints. */
typedef struct bench_report {
    size_t n, n_ok, n_failed, n_good;
    size_t by_status[17]; /* index: gRPC code (-status) */
    double duration_s;
    uint64_t prompt_tokens, cached_tokens, output_tokens;
    bench_dist_t ttft, tpot, e2e;
    double output_tps, total_tps, rps, goodput_share, goodput_rps;
} bench_report_t;

static int bench_summarize(const bench_run_t *b, bench_report_t *rep)
{
    memset(rep, 0, sizeof *rep);
    size_t n = b->n_recs;
    double *ttft = malloc((n ? n : 1) * sizeof *ttft);
    double *tpot = malloc((n ? n : 1) * sizeof *tpot);
    double *e2e = malloc((n ? n : 1) * sizeof *e2e);
    if (!ttft || !tpot || !e2e) {
        free(ttft);
        free(tpot);
        free(e2e);
        return 1;
    }
    size_t n_ttft = 0, n_tpot = 0, n_e2e = 0;
    for (size_t i = 0; i < n; i++) {
        const bench_rec_t *r = b->recs[i];
        if (!r->done)
            continue;
        rep->n++;
        if (r->status != TDM_OK) {
            rep->n_failed++;
            int code = -r->status;
            rep->by_status[code >= 0 && code <= 16 ? code : 2]++; /* 2 = UNKNOWN */
            continue;
        }
        rep->n_ok++;
        rep->prompt_tokens += r->prompt_tokens;
        rep->cached_tokens += r->cached_tokens;
        rep->output_tokens += r->output_tokens;
        if (r->output_tokens > 0)
            ttft[n_ttft++] = r->ttft_s * 1e3;
        if (r->has_tpot)
            tpot[n_tpot++] = r->tpot_s * 1e3;
        e2e[n_e2e++] = r->e2e_s * 1e3;
        bool good =
            (b->o->slo_ttft_ms <= 0 || r->ttft_s * 1e3 <= b->o->slo_ttft_ms) &&
            (b->o->slo_tpot_ms <= 0 || !r->has_tpot || r->tpot_s * 1e3 <= b->o->slo_tpot_ms);
        rep->n_good += good;
    }
    rep->ttft = dist_of(ttft, n_ttft);
    rep->tpot = dist_of(tpot, n_tpot);
    rep->e2e = dist_of(e2e, n_e2e);
    free(ttft);
    free(tpot);
    free(e2e);
    rep->duration_s = b->t_last_done > b->t_first_sent ? b->t_last_done - b->t_first_sent : 0;
    if (rep->duration_s > 0) {
        rep->output_tps = (double)rep->output_tokens / rep->duration_s;
        rep->total_tps = (double)(rep->prompt_tokens + rep->output_tokens) / rep->duration_s;
        rep->rps = (double)rep->n_ok / rep->duration_s;
        rep->goodput_rps = (double)rep->n_good / rep->duration_s;
    }
    rep->goodput_share = rep->n ? (double)rep->n_good / (double)rep->n : 0;
    return 0;
}

static void print_dist(const char *name, const bench_dist_t *d)
{
    if (d->n == 0) {
        printf("%-10s %10s %10s %10s %10s %10s %8s\n", name, "-", "-", "-", "-", "-", "0");
        return;
    }
    printf("%-10s %10.1f %10.1f %10.1f %10.1f %10.1f %8zu\n", name, d->mean, d->p50, d->p90, d->p99,
           d->max, d->n);
}

static void print_report(const bench_opts_t *o, const bench_report_t *r, bool interrupted)
{
    printf("requests:          %zu finished, %zu ok, %zu failed%s\n", r->n, r->n_ok, r->n_failed,
           interrupted ? " (interrupted)" : "");
    if (r->n_failed) {
        printf("errors:           ");
        for (int code = 0; code <= 16; code++)
            if (r->by_status[code])
                printf(" %s %zu", tdm_status_name(-code), r->by_status[code]);
        printf("\n");
    }
    if (o->rate > 0)
        printf("load:              Poisson %.3g requests/s%s", o->rate, o->concurrency ? "" : "\n");
    if (o->rate > 0 && o->concurrency)
        printf(", at most %ld in flight\n", o->concurrency);
    if (o->rate == 0)
        printf("load:              closed loop, %ld in flight\n", o->concurrency);
    printf("duration:          %.2f s\n", r->duration_s);
    if (r->n_ok) {
        printf("prompt tokens:     %.1f mean (%.1f%% from the prefix cache)\n",
               (double)r->prompt_tokens / (double)r->n_ok,
               r->prompt_tokens ? 100.0 * (double)r->cached_tokens / (double)r->prompt_tokens
                                : 0.0);
        printf("output tokens:     %.1f mean\n", (double)r->output_tokens / (double)r->n_ok);
    }
    printf("throughput:        %.1f output tokens/s, %.1f total tokens/s, %.2f requests/s\n",
           r->output_tps, r->total_tps, r->rps);
    if (o->slo_ttft_ms > 0 || o->slo_tpot_ms > 0) {
        char slo[96] = "";
        if (o->slo_ttft_ms > 0)
            snprintf(slo, sizeof slo, "TTFT <= %g ms", o->slo_ttft_ms);
        if (o->slo_tpot_ms > 0)
            snprintf(slo + strlen(slo), sizeof slo - strlen(slo), "%sTPOT <= %g ms",
                     o->slo_ttft_ms > 0 ? " and " : "", o->slo_tpot_ms);
        printf("goodput:           %.1f%% of requests met %s (%.2f requests/s)\n",
               100.0 * r->goodput_share, slo, r->goodput_rps);
    } else {
        printf("goodput:           n/a (give --slo-ttft-ms and/or --slo-tpot-ms)\n");
    }
    printf("\n%-10s %10s %10s %10s %10s %10s %8s\n", "latency ms", "mean", "p50", "p90", "p99",
           "max", "n");
    print_dist("TTFT", &r->ttft);
    print_dist("TPOT", &r->tpot);
    print_dist("E2E", &r->e2e);
}

static json_t *dist_json(const bench_dist_t *d)
{
    return json_pack("{s:I, s:f, s:f, s:f, s:f, s:f}", "n", (json_int_t)d->n, "mean", d->mean,
                     "p50", d->p50, "p90", d->p90, "p99", d->p99, "max", d->max);
}

static int write_json(const bench_opts_t *o, const bench_report_t *r, bool interrupted)
{
    json_t *errors = json_object();
    if (!errors)
        return 1;
    for (int code = 0; code <= 16; code++)
        if (r->by_status[code])
            json_object_set_new(errors, tdm_status_name(-code),
                                json_integer((json_int_t)r->by_status[code]));
    json_t *doc = json_pack(
        "{s:{s:f, s:I, s:I, s:f, s:[I,I], s:[I,I], s:s?, s:b, s:f, s:I, s:f, s:f}, s:I, s:I, "
        "s:I, s:o, s:b, s:f, s:I, s:I, s:I, s:o, s:o, s:o, s:{s:f, s:f, s:f}, s:{s:f, s:f, s:I}}",
        "config", "rate", o->rate, "concurrency", (json_int_t)o->concurrency, "requests",
        (json_int_t)o->requests, "duration_s", o->duration, "prompt_len",
        (json_int_t)o->prompt_len.lo, (json_int_t)o->prompt_len.hi, "output_len",
        (json_int_t)o->output_len.lo, (json_int_t)o->output_len.hi, "prompt_file", o->prompt_file,
        "ignore_eos", o->ignore_eos, "temperature", (double)o->temperature, "seed",
        (json_int_t)o->seed, "slo_ttft_ms", o->slo_ttft_ms, "slo_tpot_ms", o->slo_tpot_ms,
        "finished", (json_int_t)r->n, "ok", (json_int_t)r->n_ok, "failed", (json_int_t)r->n_failed,
        "errors", errors, "interrupted", interrupted, "duration_s", r->duration_s, "prompt_tokens",
        (json_int_t)r->prompt_tokens, "cached_prompt_tokens", (json_int_t)r->cached_tokens,
        "output_tokens", (json_int_t)r->output_tokens, "ttft_ms", dist_json(&r->ttft), "tpot_ms",
        dist_json(&r->tpot), "e2e_ms", dist_json(&r->e2e), "throughput", "output_tokens_per_s",
        r->output_tps, "total_tokens_per_s", r->total_tps, "requests_per_s", r->rps, "goodput",
        "share", r->goodput_share, "requests_per_s", r->goodput_rps, "good", (json_int_t)r->n_good);
    if (!doc) {
        fprintf(stderr, CMD ": --json: building the document failed\n");
        return 1;
    }
    int rc = json_dump_file(doc, o->json_path, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(doc);
    if (rc != 0) {
        fprintf(stderr, CMD ": --json: cannot write %s\n", o->json_path);
        return 1;
    }
    return 0;
}

/* --prompt-len / --output-len: "L" or "A:B" into the bench_range_t at target. */
static bool opt_prompt_len(const char *cmd, const char *value, void *target)
{
    (void)cmd;
    return parse_range("--prompt-len", value, target);
}

static bool opt_output_len(const char *cmd, const char *value, void *target)
{
    (void)cmd;
    return parse_range("--output-len", value, target);
}

/* Returns 0 to go on, or the exit status (0 for --help, with *done set). */
static int parse_args(int argc, char **argv, bench_opts_t *o, bool *done)
{
    bool has_prompt_len = false;
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_DOUBLE("rate", 0, &o->rate, 1e-6, 1e6),
        TDM_CLI_OPT_LONG("concurrency", 0, &o->concurrency, 1, 100000),
        TDM_CLI_OPT_LONG("requests", 0, &o->requests, 1, 100000000),
        TDM_CLI_OPT_DOUBLE("duration", 0, &o->duration, 0.001, 1e7),
        TDM_CLI_OPT_FN("prompt-len", 0, opt_prompt_len, &o->prompt_len, .given = &has_prompt_len),
        TDM_CLI_OPT_FN("output-len", 0, opt_output_len, &o->output_len),
        TDM_CLI_OPT_STR("prompt-file", 0, &o->prompt_file),
        TDM_CLI_OPT_TRUE("ignore-eos", 0, &o->ignore_eos),
        TDM_CLI_OPT_FALSE("no-ignore-eos", 0, &o->ignore_eos),
        TDM_CLI_OPT_FLOAT("temperature", 0, &o->temperature),
        TDM_CLI_OPT_U64("seed", 0, &o->seed),
        TDM_CLI_OPT_DOUBLE("slo-ttft-ms", 0, &o->slo_ttft_ms, 1e-3, 1e9),
        TDM_CLI_OPT_DOUBLE("slo-tpot-ms", 0, &o->slo_tpot_ms, 1e-3, 1e9),
        TDM_CLI_OPT_STR("json", 0, &o->json_path),
        TDM_CLI_ROUTER_OPTS(&o->router, &o->api_key, &o->timeout_s),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {CMD, usage, NULL, opts};
    o->prompt_len = (bench_range_t){128, 128};
    o->output_len = (bench_range_t){128, 128};
    o->ignore_eos = true;
    int status = tdm_cli_parse(&spec, argc, argv, done);
    if (*done)
        return status;
    if (optind != argc) {
        fprintf(stderr, CMD ": unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (has_prompt_len && o->prompt_file) {
        fprintf(stderr, CMD ": --prompt-len and --prompt-file exclude each other\n");
        return 2;
    }
    if (o->temperature < 0 || o->temperature > TDM_SAMPLING_MAX_TEMPERATURE) {
        fprintf(stderr, CMD ": --temperature must be in [0, %g], got %g\n",
                (double)TDM_SAMPLING_MAX_TEMPERATURE, (double)o->temperature);
        return 2;
    }
    if (o->rate == 0 && o->concurrency == 0)
        o->concurrency = 1;
    if (o->requests == 0 && o->duration == 0)
        o->requests = 100;
    return 0;
}

/* Where the load loop stands. */
typedef struct bench_clock {
    double t0, next_arrival, next_progress; /* tdm_time_now seconds */
    uint64_t issued;
    bool issuing;
} bench_clock_t;

/* True when one more request may be in flight now (the --concurrency cap). */
static bool bench_has_room(const bench_run_t *b)
{
    return b->o->concurrency == 0 || tdm_client_pending(b->client) < (size_t)b->o->concurrency;
}

/* Starts every request that is due at `now` (open loop: the arrivals passed; closed loop: as
 * many as the cap allows) and stops issuing once --requests or --duration is reached. Returns
 * 0, or 1 on out of memory (message printed). */
static int bench_issue(bench_run_t *b, bench_clock_t *k, double now)
{
    const bench_opts_t *o = b->o;
    if (k->issuing && ((o->requests && k->issued >= (uint64_t)o->requests) ||
                       (o->duration > 0 && now - k->t0 >= o->duration)))
        k->issuing = false;
    while (k->issuing && bench_has_room(b) && (o->rate == 0 || now >= k->next_arrival)) {
        if (bench_start(b, k->issued) != 0) {
            fprintf(stderr, CMD ": out of memory\n");
            return 1;
        }
        k->issued++;
        if (o->rate > 0) /* exponential gap: -ln(1 - u) / rate */
            k->next_arrival += -log1p(-bench_uniform(b)) / o->rate;
        if (o->requests && k->issued >= (uint64_t)o->requests)
            k->issuing = false;
    }
    return 0;
}

/* Drives the load until every request has ended or *interrupted (Ctrl-C, SIGTERM). Returns
 * TDM_OK, TDM_ERESOURCE (out of memory while issuing: nothing to report) or TDM_EUNAVAILABLE
 * (polling failed: what finished can still be reported); messages printed. */
static int bench_loop(bench_run_t *b, bool *interrupted)
{
    const bench_opts_t *o = b->o;
    bool progress = isatty(STDERR_FILENO);
    bench_clock_t k = {.t0 = tdm_time_now(), .issuing = true};
    k.next_arrival = k.t0;
    k.next_progress = k.t0 + 2;
    for (;;) {
        double now = tdm_time_now();
        if (bench_issue(b, &k, now) != 0)
            return TDM_ERESOURCE;
        if (!k.issuing && tdm_client_pending(b->client) == 0)
            return TDM_OK;
        int wait_ms = 100;
        if (k.issuing && o->rate > 0 && bench_has_room(b)) {
            double ms = ceil((k.next_arrival - now) * 1000.0);
            wait_ms = ms < 0 ? 0 : ms > 100 ? 100 : (int)ms;
        }
        int rc = tdm_client_poll(b->client, wait_ms);
        if (rc == TDM_ECANCELLED) {
            *interrupted = true;
            return TDM_OK;
        }
        if (rc < 0) {
            fprintf(stderr, CMD ": %s\n", tdm_client_errmsg(b->client));
            return TDM_EUNAVAILABLE;
        }
        if (progress && tdm_time_now() >= k.next_progress) {
            fprintf(stderr, "bench: %zu/%" PRIu64 " done, %zu in flight, %.0f s\n", b->n_done,
                    k.issued, tdm_client_pending(b->client), tdm_time_now() - k.t0);
            k.next_progress += 2;
        }
    }
}

/* Prints the report (and writes the JSON) of what finished; status is 1 when the load loop
 * failed. Returns the exit status. */
static int bench_report(bench_run_t *b, bool interrupted, int status)
{
    bench_report_t rep;
    if (bench_summarize(b, &rep) != 0) {
        fprintf(stderr, CMD ": out of memory\n");
        return 1;
    }
    print_report(b->o, &rep, interrupted);
    if (b->o->json_path && write_json(b->o, &rep, interrupted) != 0)
        status = 1;
    if (interrupted)
        return TDM_CLI_EXIT_INTERRUPTED;
    if (status == 0 && rep.n_ok == 0)
        return 1; /* nothing succeeded: the errors above say why */
    return status;
}

int tdm_cmd_bench(int argc, char **argv)
{
    bench_opts_t o = {0};
    bool done;
    int status = parse_args(argc, argv, &o, &done);
    if (status != 0 || done)
        return status;
    bench_run_t b = {0};
    b.o = &o;
    if (o.prompt_file && (status = load_prompts(&b, o.prompt_file)) != 0)
        goto out_prompts;
    tdm_cli_catch_interrupt(true);
    b.client = tdm_cli_connect(CMD, tdm_cli_router_endpoint(o.router), tdm_cli_api_key(o.api_key),
                               o.timeout_s, &status);
    if (!b.client)
        goto out_prompts;
    bool interrupted = false;
    int rc = bench_loop(&b, &interrupted);
    status = rc == TDM_ERESOURCE ? 1 : bench_report(&b, interrupted, rc == TDM_OK ? 0 : 1);
    tdm_client_destroy(&b.client);
    for (size_t i = 0; i < b.n_recs; i++)
        free(b.recs[i]);
    free(b.recs);
    tdm_buf_free(&b.prompt_buf);
out_prompts:
    free(b.prompts);
    free(b.file_text);
    return status;
}
