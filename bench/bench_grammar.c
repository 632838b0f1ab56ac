/* bench_grammar.c - structured output over MaskBench files: for each file of a directory
 * (each: "schema" and "tests" with "data" and "valid"), compile the schema
 * (tdm_json_schema_to_gbnf + tdm_grammar_parse), then feed each test instance's tokens one by
 * one, checking each token is in the mask (tdm_grammar_matcher_fill_mask) and that the
 * end-of-sequence token is allowed at the end exactly when the instance is valid. Reports
 * schemas compiled / refused (by keyword), passing schemas (compiled, every instance judged
 * right), validation errors (valid instances rejected; those listing properties out of
 * definition order on their own line), invalidation errors (invalid instances accepted),
 * compile time p50 / p90 / p95 / p99 and per-token mask time p50 / p75 / p95 / p99 / max. Table to
 * stderr, JSON to stdout or --json FILE.
 *
 * The instances' texts are never re-serialized here: bench/grammar_setup.py writes each one
 * once, exactly as Python's json.dumps(data, separators=(",", ":"), ensure_ascii=False), to
 * CACHE/<stem>.<i>.json, with CACHE/index.json (validity, out-of-order flags).
 * --dump-vocab FILE writes the vocabulary's token bytes and every instance's token ids, so
 * bench/grammar_llg.py runs llguidance on the same tokens; --peer FILE (its JSON) prints the
 * ratios. --check exits 1 on any invalidation error or a passing rate under --min-pass (a
 * schema whose only misses are valid instances flagged out of definition order counts as
 * passing there: the documented departure). --files LIST keeps only the names LIST holds (one
 * a line: a subset such as the Github files, for the peer too through --dump-vocab);
 * --mask-digest FILE writes, per compiled schema, an XXH3 of every mask (count and bits) in
 * order with its GBNF size, mask times and compile time, so two builds can be shown to give
 * identical masks (and per-schema compile times compared).
 * One thread; times are wall-clock on a shared machine: compare ratios measured in one run.
 */
#include <dirent.h>
#include <getopt.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <xxhash.h>

#include "bench_util.h"
#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/gguf.h"
#include "tandem/grammar.h"
#include "tandem/json_schema.h"
#include "tandem/tokenizer.h"

#define MAX_KEYWORDS 128

typedef struct cfg {
    char model_path[1024];
    const char *dir, *cache, *json_path, *vocab_path, *peer_path;
    const char *files_path;  /* --files: only the names listed there (one a line) */
    const char *digest_path; /* --mask-digest: one line per file, the hash of its masks */
    int every;               /* take every N-th file (sorted by name) */
    int limit;               /* at most this many files; 0: all */
    bool check;              /* exit 1 on invalidation errors or passing below min_pass */
    bool verbose;            /* print every refusal and every instance judged wrong */
    double min_pass;         /* fraction of compiled schemas that must pass */
} cfg_t;

typedef struct dvec {
    double *v;
    size_t n, cap;
} dvec_t;

typedef struct kwcount {
    char kw[64];
    int n;
} kwcount_t;

typedef struct stats {
    int files, compiled, refused, passing;
    int passing_but_order; /* compiled, every miss a valid instance flagged out of order */
    int instances, right, validation_err, invalidation_err, ooo_rejected, ooo_total;
    size_t tokens;
    dvec_t compile_s, mask_s;
    kwcount_t kw[MAX_KEYWORDS];
    int n_kw;
} stats_t;

typedef struct bench {
    tdm_gguf_t *gguf;
    tdm_tokenizer_t *tok;
    tdm_grammar_vocab_t *vocab;
    uint32_t n_vocab;
    tdm_token_t eos;
    uint32_t *mask;    /* [(n_vocab + 31) / 32] */
    json_t *index;     /* CACHE/index.json */
    FILE *dump;        /* --dump-vocab */
    FILE *digest;      /* --mask-digest */
    XXH3_state_t *xxh; /* the current file's masks, in order */
    int n_dumped;
    char cpu[128];
} bench_t;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool dvec_push(dvec_t *d, double x)
{
    if (d->n == d->cap) {
        size_t cap = d->cap ? 2 * d->cap : 4096;
        double *v = realloc(d->v, cap * sizeof *v);
        if (!v)
            return false;
        d->v = v;
        d->cap = cap;
    }
    d->v[d->n++] = x;
    return true;
}

/* The p-quantile (0..1) of a sorted vector; 0 when empty. */
static double quantile(const dvec_t *d, double p)
{
    return d->n ? d->v[(size_t)(p * (double)(d->n - 1) + 0.5)] : 0;
}

/* The mean of d; 0 when empty. */
static double mean(const dvec_t *d)
{
    double sum = 0;
    for (size_t i = 0; i < d->n; i++)
        sum += d->v[i];
    return d->n ? sum / (double)d->n : 0;
}

/* The keyword a refusal names: the last token of its JSON pointer ("/properties/a/
 * patternProperties: not supported" -> "patternProperties"; an allOf branch index -> the
 * keyword before it). */
static void refusal_keyword(const char *msg, char *kw, size_t cap)
{
    const char *end = strstr(msg, ": ");
    if (msg[0] != '/' || !end) {
        snprintf(kw, cap, "%s",
                 strncmp(msg, "line ", 5) == 0          ? "(grammar engine)"
                 : strstr(msg, "too ambiguous") != NULL ? "(too ambiguous)"
                 : strstr(msg, "jansson") != NULL       ? "(JSON unreadable)"
                                                        : "(other)");
        return;
    }
    const char *p = end;
    while (p > msg && p[-1] != '/')
        p--;
    if (p == end) {
        snprintf(kw, cap, "(root)");
        return;
    }
    if (p[0] >= '0' && p[0] <= '9' && p - 1 > msg) {
        end = p - 1;
        for (p = end; p > msg && p[-1] != '/'; p--)
            ;
    }
    snprintf(kw, cap, "%.*s", (int)(end - p), p);
}

static void count_refusal(stats_t *st, const char *msg)
{
    char kw[64];
    refusal_keyword(msg, kw, sizeof kw);
    st->refused++;
    for (int i = 0; i < st->n_kw; i++) {
        if (strcmp(st->kw[i].kw, kw) == 0) {
            st->kw[i].n++;
            return;
        }
    }
    if (st->n_kw < MAX_KEYWORDS) {
        snprintf(st->kw[st->n_kw].kw, sizeof st->kw[0].kw, "%s", kw);
        st->kw[st->n_kw++].n = 1;
    }
}

/* ---- setup ---- */

/* Loads the tokenizer, the mask vocabulary and CACHE/index.json. Returns 0, 1 (printed), or 77
 * (skip) in --check mode when the model file is missing. */
static int bench_open(bench_t *b, const cfg_t *c)
{
    tdm_error_t err;
    bench_cpu_model(b->cpu, sizeof b->cpu);
    struct stat sb;
    if (c->check && stat(c->model_path, &sb) != 0) {
        printf("skip: model file %s is missing: run scripts/setup (or set TANDEM_MODEL)\n",
               c->model_path);
        return 77;
    }
    b->gguf = tdm_gguf_open(c->model_path, &err);
    b->tok = b->gguf ? tdm_tokenizer_new(b->gguf, &err) : NULL;
    b->vocab = b->tok ? tdm_grammar_vocab_new(b->tok, &err) : NULL;
    if (!b->vocab) {
        fprintf(stderr, "bench: %s: %s\n", c->model_path, err.msg);
        return 1;
    }
    b->n_vocab = tdm_grammar_vocab_n_vocab(b->vocab);
    b->eos = tdm_tokenizer_eos(b->tok) >= 0 ? tdm_tokenizer_eos(b->tok) : tdm_tokenizer_eot(b->tok);
    b->mask = calloc((b->n_vocab + 31) / 32, sizeof *b->mask);
    char path[2048];
    snprintf(path, sizeof path, "%s/index.json", c->cache);
    json_error_t je;
    b->index = json_load_file(path, 0, &je);
    if (!b->mask || !b->index) {
        fprintf(stderr, "bench: %s: %s (run bench/grammar_setup.py %s %s first)\n", path,
                b->index ? "out of memory" : je.text, c->dir, c->cache);
        return 1;
    }
    return 0;
}

static void bench_close(bench_t *b)
{
    free(b->mask);
    json_decref(b->index);
    tdm_grammar_vocab_destroy(&b->vocab);
    tdm_tokenizer_destroy(&b->tok);
    tdm_gguf_destroy(&b->gguf);
    if (b->dump)
        fclose(b->dump);
    if (b->digest)
        fclose(b->digest);
    XXH3_freeState(b->xxh);
}

/* True when name is a line of the --files list (or there is none). */
static bool listed(const char *list, const char *name)
{
    if (!list)
        return true;
    size_t len = strlen(name);
    for (const char *p = strstr(list, name); p; p = strstr(p + 1, name))
        if ((p == list || p[-1] == '\n') && (p[len] == '\n' || p[len] == '\0'))
            return true;
    return false;
}

/* The sorted *.json names of dir (those --files lists, then every N-th, at most limit);
 * caller frees each and *names. */
static int list_files(const cfg_t *c, char ***names, size_t *n)
{
    char *list = NULL;
    size_t list_len;
    tdm_error_t err;
    if (c->files_path &&
        tdm_read_file(c->files_path, (size_t)1 << 24, &list, &list_len, &err) != 0) {
        fprintf(stderr, "bench: --files %s: %s\n", c->files_path, err.msg);
        return 1;
    }
    DIR *d = opendir(c->dir);
    if (!d) {
        fprintf(stderr, "bench: cannot open %s\n", c->dir);
        return 1;
    }
    size_t cap = 0, k = 0;
    char **v = NULL;
    struct dirent *e;
    while ((e = readdir(d))) {
        size_t len = strlen(e->d_name);
        if (len < 6 || strcmp(e->d_name + len - 5, ".json") != 0 || !listed(list, e->d_name))
            continue;
        if (k == cap) {
            cap = cap ? 2 * cap : 1024;
            char **w = realloc(v, cap * sizeof *v);
            if (!w)
                break;
            v = w;
        }
        v[k++] = tdm_strdup(e->d_name);
    }
    closedir(d);
    free(list);
    qsort(v, k, sizeof *v, cmp_str);
    size_t m = 0;
    for (size_t i = 0; i < k; i++) {
        bool take = i % (size_t)c->every == 0 && (c->limit == 0 || m < (size_t)c->limit);
        if (take)
            v[m++] = v[i];
        else
            free(v[i]);
    }
    *names = v;
    *n = m;
    return 0;
}

/* ---- --dump-vocab ---- */

/* "key": [hex of each string of the GGUF string array gguf_key] (nothing when absent). */
static void dump_strings(FILE *f, const tdm_gguf_t *g, const char *key, const char *gguf_key)
{
    const tdm_gguf_kv_t *kv = tdm_gguf_find_kv(g, gguf_key);
    if (!kv || kv->type != TDM_GGUF_VTYPE_ARRAY || kv->arr_type != TDM_GGUF_VTYPE_STRING)
        return;
    fprintf(f, ",\n \"%s\": [", key);
    for (uint64_t i = 0; i < kv->arr_n; i++) {
        fprintf(f, "%s\"", i ? ", " : "");
        for (uint64_t k = 0; k < kv->arr_strs[i].len; k++)
            fprintf(f, "%02x", (unsigned char)kv->arr_strs[i].data[k]);
        fprintf(f, "\"");
    }
    fprintf(f, "]");
}

/* Writes the vocabulary: {"n_vocab", "eos", "files": [the sample], "eog": [...], "special":
 * [...], "tokens": [hex of each token's bytes], "pre", "pieces" and "merges" (hex of the
 * GGUF's strings), "instances": [ (then dump_instance appends) */
static int dump_open(bench_t *b, const char *path, char **names, size_t n_names)
{
    b->dump = fopen(path, "w");
    if (!b->dump) {
        fprintf(stderr, "bench: cannot write %s\n", path);
        return 1;
    }
    FILE *f = b->dump;
    fprintf(f, "{\"n_vocab\": %u, \"eos\": %d, \"files\": [", b->n_vocab, (int)b->eos);
    for (size_t i = 0; i < n_names; i++)
        fprintf(f, "%s\"%s\"", i ? ", " : "", names[i]);
    fprintf(f, "],\n \"eog\": [");
    for (uint32_t t = 0, k = 0; t < b->n_vocab; t++)
        if (tdm_tokenizer_is_eog(b->tok, (tdm_token_t)t))
            fprintf(f, "%s%u", k++ ? ", " : "", t);
    fprintf(f, "],\n \"special\": [");
    for (uint32_t t = 0, k = 0; t < b->n_vocab; t++) {
        tdm_token_attr_t a = tdm_tokenizer_attr(b->tok, (tdm_token_t)t);
        if (a == TDM_TOKEN_CONTROL || a == TDM_TOKEN_UNKNOWN || a == TDM_TOKEN_UNUSED)
            fprintf(f, "%s%u", k++ ? ", " : "", t);
    }
    fprintf(f, "],\n \"tokens\": [");
    for (uint32_t t = 0; t < b->n_vocab; t++) {
        unsigned char buf[512];
        int n = tdm_tokenizer_token_bytes(b->tok, (tdm_token_t)t, true, (char *)buf, sizeof buf);
        fprintf(f, "%s\"", t ? ", " : "");
        for (int i = 0; i < n && i < (int)sizeof buf; i++)
            fprintf(f, "%02x", buf[i]);
        fprintf(f, "\"");
    }
    fprintf(f, "],\n \"pre\": \"%s\"", tdm_tokenizer_pre(b->tok));
    /* the GGUF's own arrays, so the peer can rebuild the exact tokenizer (llguidance allows
     * only the canonical tokenization of forced text) */
    dump_strings(f, b->gguf, "pieces", "tokenizer.ggml.tokens");
    dump_strings(f, b->gguf, "merges", "tokenizer.ggml.merges");
    fprintf(f, ",\n \"instances\": [\n");
    return 0;
}

static void dump_instance(bench_t *b, const char *file, size_t test, bool valid,
                          const tdm_token_t *ids, size_t n)
{
    FILE *f = b->dump;
    fprintf(f, "%s{\"file\": \"%s\", \"test\": %zu, \"valid\": %s, \"ids\": [",
            b->n_dumped++ ? ",\n" : "", file, test, valid ? "true" : "false");
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%s%d", i ? "," : "", (int)ids[i]);
    fprintf(f, "]}");
}

/* ---- one file ---- */

typedef struct instance {
    tdm_token_t *ids;
    size_t n;
    bool valid, ooo;
} instance_t;

/* Feeds ids through m, each checked against the mask (timed); true when every token was
 * allowed and then the end-of-sequence token is. */
static bool judge(bench_t *b, stats_t *st, tdm_grammar_matcher_t *m, const instance_t *in)
{
    tdm_grammar_matcher_reset(m);
    for (size_t i = 0; i <= in->n; i++) {
        double t0 = tdm_time_now();
        uint32_t count = tdm_grammar_matcher_fill_mask(m, b->mask);
        dvec_push(&st->mask_s, tdm_time_now() - t0);
        if (b->digest) {
            XXH3_64bits_update(b->xxh, &count, sizeof count);
            XXH3_64bits_update(b->xxh, b->mask, (b->n_vocab + 31) / 32 * sizeof *b->mask);
        }
        uint32_t t = i < in->n ? (uint32_t)in->ids[i] : (uint32_t)b->eos;
        bool allowed = t < b->n_vocab && (b->mask[t / 32] >> (t % 32) & 1u);
        if (!allowed || i == in->n)
            return allowed;
        st->tokens++;
        if (tdm_grammar_matcher_accept_token(m, (int32_t)t) != 0)
            return false; /* the mask allowed what the matcher refuses: counted as rejected */
    }
    return false;
}

/* The tests of name: each instance's tokens (from CACHE/<stem>.<i>.json) and flags. */
static int load_instances(bench_t *b, const cfg_t *c, const char *name, instance_t **out, size_t *n)
{
    json_t *tests = json_object_get(json_object_get(b->index, "files"), name);
    if (!json_is_array(tests)) {
        fprintf(stderr, "bench: %s is not in the cache's index.json (rerun grammar_setup.py)\n",
                name);
        return 1;
    }
    *n = json_array_size(tests);
    *out = calloc(*n + 1, sizeof **out);
    if (!*out)
        return 1;
    for (size_t i = 0; i < *n; i++) {
        instance_t *in = &(*out)[i];
        json_t *t = json_array_get(tests, i);
        in->valid = json_is_true(json_object_get(t, "valid"));
        in->ooo = json_is_true(json_object_get(t, "ooo"));
        char path[2048], *text;
        size_t len;
        tdm_error_t err;
        snprintf(path, sizeof path, "%s/%.*s.%zu.json", c->cache, (int)(strlen(name) - 5), name, i);
        if (tdm_read_file(path, (size_t)1 << 26, &text, &len, &err) != 0) {
            fprintf(stderr, "bench: %s: %s\n", path, err.msg);
            return 1;
        }
        int rc = tdm_tokenizer_encode(b->tok, text, len, false, false, &in->ids, &in->n, &err);
        free(text);
        if (rc != 0) {
            fprintf(stderr, "bench: tokenizing %s: %s\n", path, err.msg);
            return 1;
        }
        if (b->dump)
            dump_instance(b, name, i, in->valid, in->ids, in->n);
    }
    return 0;
}

/* Compiles the schema of dir/name into *g (timed); NULL with the refusal counted. */
static tdm_grammar_t *compile_file(const cfg_t *c, stats_t *st, const char *name, size_t *gbnf_len,
                                   double *compile_s)
{
    char path[2048];
    snprintf(path, sizeof path, "%s/%s", c->dir, name);
    json_error_t je;
    json_t *doc = json_load_file(path, JSON_ALLOW_NUL, &je);
    char *schema = doc ? json_dumps(json_object_get(doc, "schema"),
                                    JSON_COMPACT | JSON_ENCODE_ANY | JSON_REAL_PRECISION(17))
                       : NULL;
    bool loaded = doc != NULL;
    json_decref(doc);
    if (!schema) { /* jansson cannot read it (an integer beyond 64 bits, ...) */
        count_refusal(st, "(file unreadable by jansson)");
        if (c->verbose)
            fprintf(stderr, "bench: %s refused: %s\n", name, loaded ? "out of memory" : je.text);
        return NULL;
    }
    tdm_buf_t gbnf = TDM_BUF_INIT;
    tdm_error_t err;
    tdm_grammar_t *g = NULL;
    double t0 = tdm_time_now();
    if (tdm_json_schema_to_gbnf(schema, strlen(schema), &gbnf, &err) == 0)
        g = tdm_grammar_parse(gbnf.data, gbnf.len, NULL, &err);
    double dt = tdm_time_now() - t0;
    *compile_s = dt;
    if (g)
        dvec_push(&st->compile_s, dt);
    else
        count_refusal(st, err.msg);
    if (!g && c->verbose)
        fprintf(stderr, "bench: %s refused: %s\n", name, err.msg);
    *gbnf_len = gbnf.len;
    tdm_buf_free(&gbnf);
    free(schema);
    return g;
}

static void free_instances(instance_t *v, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(v[i].ids);
    free(v);
}

/* One MaskBench file. Returns 0, or 1 on a setup failure (printed). */
static int run_file(bench_t *b, const cfg_t *c, stats_t *st, const char *name)
{
    instance_t *in = NULL;
    size_t n = 0, gbnf_len = 0, first_mask = st->mask_s.n;
    double compile_s = 0;
    int rc = load_instances(b, c, name, &in, &n);
    st->files++;
    tdm_grammar_t *g = rc == 0 ? compile_file(c, st, name, &gbnf_len, &compile_s) : NULL;
    tdm_error_t err;
    tdm_grammar_matcher_t *m = g ? tdm_grammar_matcher_new(g, b->vocab, &err) : NULL;
    if (g && !m) { /* the engine refused the start state (too ambiguous) */
        count_refusal(st, err.msg);
        st->compile_s.n--;
        if (c->verbose)
            fprintf(stderr, "bench: %s refused: %s\n", name, err.msg);
    }
    bool all_right = m != NULL, only_order = m != NULL; /* only_order: every miss is flagged */
    if (b->digest)
        XXH3_64bits_reset(b->xxh);
    for (size_t i = 0; m && i < n; i++) {
        bool acc = judge(b, st, m, &in[i]);
        st->instances++;
        st->ooo_total += in[i].valid && in[i].ooo;
        if (acc == in[i].valid) {
            st->right++;
            continue;
        }
        all_right = false;
        if (c->verbose)
            fprintf(stderr, "bench: %s test %zu: %s instance %s\n", name, i,
                    in[i].valid ? "valid" : "invalid", acc ? "accepted" : "rejected");
        only_order = only_order && in[i].valid && in[i].ooo;
        if (in[i].valid) {
            st->validation_err++;
            st->ooo_rejected += in[i].ooo;
        } else {
            st->invalidation_err++;
            fprintf(stderr, "bench: %s test %zu: invalid instance accepted\n", name, i);
        }
    }
    if (b->digest && m) {
        double sum = 0, max = 0;
        for (size_t i = first_mask; i < st->mask_s.n; i++)
            sum += st->mask_s.v[i], max = st->mask_s.v[i] > max ? st->mask_s.v[i] : max;
        fprintf(b->digest, "%s %016" PRIx64 " %zu %zu %.1f %.1f %.3f\n", name,
                (uint64_t)XXH3_64bits_digest(b->xxh), gbnf_len, st->mask_s.n - first_mask,
                sum * 1e6, max * 1e6, compile_s * 1e3);
    }
    st->compiled += m != NULL;
    st->passing += all_right;
    st->passing_but_order += !all_right && only_order;
    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_destroy(&g);
    free_instances(in, n);
    return rc;
}

/* ---- report ---- */

static int cmp_kw(const void *a, const void *b)
{
    const kwcount_t *x = a, *y = b;
    return x->n != y->n ? y->n - x->n : strcmp(x->kw, y->kw);
}

static double pct(int a, int b)
{
    return b ? 100.0 * a / b : 0;
}

static void print_table(const bench_t *b, const cfg_t *c, const stats_t *st)
{
    fprintf(stderr, "grammar bench: %d MaskBench files of %s (every %d), %s, 1 thread\n", st->files,
            c->dir, c->every, b->cpu);
    fprintf(stderr, "%-34s %8d (%.1f %%)\n", "schemas compiled", st->compiled,
            pct(st->compiled, st->files));
    fprintf(stderr, "%-34s %8d", "schemas refused", st->refused);
    for (int i = 0; i < st->n_kw && i < 12; i++)
        fprintf(stderr, "%s %s %d", i ? "," : "  (", st->kw[i].kw, st->kw[i].n);
    fprintf(stderr, "%s\n", st->n_kw ? (st->n_kw > 12 ? ", ...)" : ")") : "");
    fprintf(stderr, "%-34s %8d (%.1f %% of all schemas)\n", "schemas passing", st->passing,
            pct(st->passing, st->files));
    fprintf(stderr, "%-34s %8d / %d\n", "instances judged right", st->right, st->instances);
    fprintf(stderr, "%-34s %8d\n", "validation errors (valid rejected)", st->validation_err);
    fprintf(stderr, "%-34s %8d (of %d valid ones out of order)\n",
            "  of them out of definition order", st->ooo_rejected, st->ooo_total);
    fprintf(stderr, "%-34s %8d\n", "invalidation errors (invalid acc.)", st->invalidation_err);
    fprintf(stderr, "%-34s %8.2f / %.2f / %.2f / %.2f ms\n", "compile time p50/p90/p95/p99",
            quantile(&st->compile_s, 0.5) * 1e3, quantile(&st->compile_s, 0.9) * 1e3,
            quantile(&st->compile_s, 0.95) * 1e3, quantile(&st->compile_s, 0.99) * 1e3);
    fprintf(stderr, "%-34s %8.1f / %.1f / %.1f / %.1f / %.1f us  (%zu masks)\n",
            "mask time p50/p75/p95/p99/max", quantile(&st->mask_s, 0.5) * 1e6,
            quantile(&st->mask_s, 0.75) * 1e6, quantile(&st->mask_s, 0.95) * 1e6,
            quantile(&st->mask_s, 0.99) * 1e6, quantile(&st->mask_s, 1.0) * 1e6, st->mask_s.n);
    fprintf(stderr, "%-34s %8.2f us\n", "mask time mean", mean(&st->mask_s) * 1e6);
}

static int write_json(const bench_t *b, const cfg_t *c, const stats_t *st)
{
    FILE *out = c->json_path ? fopen(c->json_path, "w") : stdout;
    if (!out) {
        fprintf(stderr, "bench: cannot write %s\n", c->json_path);
        return 1;
    }
    fprintf(
        out,
        "{\"engine\": \"tandem\", \"cpu\": \"%s\", \"threads\": 1, \"n_vocab\": %u, \"files\": %d, "
        "\"compiled\": %d, \"refused\": %d,\n \"refused_by_keyword\": {",
        b->cpu, b->n_vocab, st->files, st->compiled, st->refused);
    for (int i = 0; i < st->n_kw; i++) { /* keywords can hold any text (a pattern's): escaped */
        json_t *k = json_string(st->kw[i].kw);
        char *q = k ? json_dumps(k, JSON_ENCODE_ANY) : NULL;
        fprintf(out, "%s%s: %d", i ? ", " : "", q ? q : "\"?\"", st->kw[i].n);
        free(q);
        json_decref(k);
    }
    fprintf(
        out,
        "},\n \"passing\": %d, \"passing_pct\": %.2f, \"instances\": %d, \"right\": %d, "
        "\"validation_errors\": %d, \"validation_errors_out_of_order\": %d, "
        "\"valid_out_of_order\": %d, \"invalidation_errors\": %d, \"tokens\": %zu,\n"
        " \"compile_s\": {\"p50\": %.6f, \"p90\": %.6f, \"p95\": %.6f, \"p99\": %.6f},\n"
        " \"mask_s\": {\"p50\": %.7f, \"p75\": %.7f, \"p95\": %.7f, \"p99\": %.7f, \"max\": %.7f, "
        "\"mean\": %.7f, \"n\": %zu}}\n",
        st->passing, pct(st->passing, st->files), st->instances, st->right, st->validation_err,
        st->ooo_rejected, st->ooo_total, st->invalidation_err, st->tokens,
        quantile(&st->compile_s, 0.5), quantile(&st->compile_s, 0.9),
        quantile(&st->compile_s, 0.95), quantile(&st->compile_s, 0.99), quantile(&st->mask_s, 0.5),
        quantile(&st->mask_s, 0.75), quantile(&st->mask_s, 0.95), quantile(&st->mask_s, 0.99),
        quantile(&st->mask_s, 1.0), mean(&st->mask_s), st->mask_s.n);
    if (c->json_path)
        fclose(out);
    return 0;
}

/* --peer: the ratios to llguidance's figures (bench/grammar_llg.py's JSON). */
static void print_ratios(const cfg_t *c, const stats_t *st)
{
    json_error_t je;
    json_t *p = json_load_file(c->peer_path, 0, &je);
    if (!p) {
        fprintf(stderr, "bench: --peer %s: %s\n", c->peer_path, je.text);
        return;
    }
    json_t *pm = json_object_get(p, "mask_s"), *pc = json_object_get(p, "compile_s");
    double mp50 = json_number_value(json_object_get(pm, "p50")),
           mp95 = json_number_value(json_object_get(pm, "p95")),
           mp99 = json_number_value(json_object_get(pm, "p99")),
           mmean = json_number_value(json_object_get(pm, "mean"));
    double cp90 = json_number_value(json_object_get(pc, "p90")),
           cp99 = json_number_value(json_object_get(pc, "p99"));
    double ppass = json_number_value(json_object_get(p, "passing_pct"));
    fprintf(stderr, "vs %s (%s):\n", json_string_value(json_object_get(p, "engine")), c->peer_path);
    fprintf(stderr, "%-34s %+8.1f points (%.1f %% vs %.1f %%; target >= -5)\n", "passing schemas",
            pct(st->passing, st->files) - ppass, pct(st->passing, st->files), ppass);
    fprintf(stderr, "%-34s %8d vs %d\n", "invalidation errors", st->invalidation_err,
            (int)json_integer_value(json_object_get(p, "invalidation_errors")));
    fprintf(stderr, "%-34s %8.2f x (target <= 2)\n", "mask time p50 ratio",
            mp50 > 0 ? quantile(&st->mask_s, 0.5) / mp50 : 0);
    fprintf(stderr, "%-34s %8.2f x (target <= 1)\n", "mask time p95 ratio",
            mp95 > 0 ? quantile(&st->mask_s, 0.95) / mp95 : 0);
    fprintf(stderr, "%-34s %8.2f x (target <= 1)\n", "mask time mean ratio",
            mmean > 0 ? mean(&st->mask_s) / mmean : 0);
    fprintf(stderr, "%-34s %8.2f x (target <= 2)\n", "mask time p99 ratio",
            mp99 > 0 ? quantile(&st->mask_s, 0.99) / mp99 : 0);
    fprintf(stderr, "%-34s %8.2f x (target <= 2)\n", "compile time p90 ratio",
            cp90 > 0 ? quantile(&st->compile_s, 0.9) / cp90 : 0);
    fprintf(stderr, "%-34s %8.2f x\n", "compile time p99 ratio",
            cp99 > 0 ? quantile(&st->compile_s, 0.99) / cp99 : 0);
    json_decref(p);
}

/* ---- main ---- */

static void usage(void)
{
    printf("usage: tandem-bench-grammar --dir MASKBENCH_DIR --cache CACHE [-m MODEL] [--every N]\n"
           "                            [--limit N] [--json FILE] [--dump-vocab FILE]\n"
           "                            [--peer LLG_JSON] [--check [--min-pass FRACTION]] "
           "[--verbose]\n"
           "                            [--files LIST] [--mask-digest FILE]\n"
           "--files LIST: only the file names LIST holds, one a line; --mask-digest FILE: one\n"
           "line per compiled schema: name, XXH3 of every mask computed for it in order (two\n"
           "builds' masks are identical when these agree), GBNF bytes, masks, their total and\n"
           "largest time in us, compile time in ms\n"
           "CACHE comes from: python3 bench/grammar_setup.py MASKBENCH_DIR CACHE\n");
}

/* Parses the command line into *c. Returns 0 to go on, or the exit status with *done set. */
static int parse_args(int argc, char **argv, cfg_t *c, bool *done)
{
    static const struct option opts[] = {{"model", required_argument, NULL, 'm'},
                                         {"dir", required_argument, NULL, 'd'},
                                         {"cache", required_argument, NULL, 'c'},
                                         {"every", required_argument, NULL, 'e'},
                                         {"limit", required_argument, NULL, 'l'},
                                         {"json", required_argument, NULL, 'j'},
                                         {"dump-vocab", required_argument, NULL, 'v'},
                                         {"peer", required_argument, NULL, 'p'},
                                         {"check", no_argument, NULL, 'k'},
                                         {"min-pass", required_argument, NULL, 'P'},
                                         {"verbose", no_argument, NULL, 'V'},
                                         {"files", required_argument, NULL, 'F'},
                                         {"mask-digest", required_argument, NULL, 'D'},
                                         {"help", no_argument, NULL, 'h'},
                                         {NULL, 0, NULL, 0}};
    c->every = 1;
    *done = true;
    int ch;
    while ((ch = getopt_long(argc, argv, "m:d:c:e:l:j:v:p:kP:VhF:D:", opts, NULL)) != -1) {
        switch (ch) {
        case 'm': snprintf(c->model_path, sizeof c->model_path, "%s", optarg); break;
        case 'd': c->dir = optarg; break;
        case 'c': c->cache = optarg; break;
        case 'e': c->every = atoi(optarg); break;
        case 'l': c->limit = atoi(optarg); break;
        case 'j': c->json_path = optarg; break;
        case 'v': c->vocab_path = optarg; break;
        case 'p': c->peer_path = optarg; break;
        case 'k': c->check = true; break;
        case 'P': c->min_pass = atof(optarg); break;
        case 'V': c->verbose = true; break;
        case 'F': c->files_path = optarg; break;
        case 'D': c->digest_path = optarg; break;
        case 'h': usage(); return 0;
        default: return 2;
        }
    }
    if (!c->model_path[0])
        tdm_model_default_path(c->model_path, sizeof c->model_path);
    if (!c->dir || !c->cache || c->every < 1 || c->limit < 0) {
        usage();
        return 2;
    }
    *done = false;
    return 0;
}

int main(int argc, char **argv)
{
    cfg_t c = {0};
    bool done;
    int status = parse_args(argc, argv, &c, &done);
    if (done)
        return status;
    bench_t b = {0};
    stats_t st = {0};
    char **names = NULL;
    size_t n = 0;
    status = bench_open(&b, &c);
    if (status == 0)
        status = list_files(&c, &names, &n);
    if (status == 0 && c.vocab_path)
        status = dump_open(&b, c.vocab_path, names, n);
    if (status == 0 && c.digest_path &&
        (!(b.digest = fopen(c.digest_path, "w")) || !(b.xxh = XXH3_createState()))) {
        fprintf(stderr, "bench: cannot write %s\n", c.digest_path);
        status = 1;
    }
    for (size_t i = 0; i < n && status == 0; i++)
        status = run_file(&b, &c, &st, names[i]);
    if (b.dump)
        fprintf(b.dump, "\n]}\n");
    if (status == 0) {
        qsort(st.kw, (size_t)st.n_kw, sizeof st.kw[0], cmp_kw);
        qsort(st.compile_s.v, st.compile_s.n, sizeof(double), cmp_double);
        qsort(st.mask_s.v, st.mask_s.n, sizeof(double), cmp_double);
        print_table(&b, &c, &st);
        if (c.peer_path)
            print_ratios(&c, &st);
        status = write_json(&b, &c, &st);
    }
    if (status == 0 && c.check) {
        /* a valid instance out of definition order is the documented departure, not a miss */
        double pass = st.compiled ? (double)(st.passing + st.passing_but_order) / st.compiled : 0;
        if (st.invalidation_err > 0 || pass < c.min_pass) {
            fprintf(stderr,
                    "bench: check failed: %d invalidation errors, %.4f of compiled schemas "
                    "passing (floor %.4f)\n",
                    st.invalidation_err, pass, c.min_pass);
            status = 1;
        }
    }
    for (size_t i = 0; i < n; i++)
        free(names[i]);
    free(names);
    free(st.compile_s.v);
    free(st.mask_s.v);
    bench_close(&b);
    return status;
}
