/* cmd_grammar.c - `tandem grammar check`: compiles a GBNF grammar and reports its size or the
 * error (line, column, rule); with --instance, feeds a file's bytes through a matcher (and,
 * with --model, the file's tokens through the token mask, as constrained decoding does).
 *
 * The checks take GBNF text (check_gbnf), so any front end that produces GBNF (a JSON Schema
 * compiler) is one more option that converts and calls it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/gguf.h"
#include "tandem/grammar.h"
#include "tandem/tokenizer.h"

#define GRAMMAR_MAX_INSTANCE (64u << 20) /* largest --instance file, bytes */

#define GRAMMAR_SYNOPSIS                                                                           \
    "usage: tandem grammar check --grammar G.gbnf [--root RULE] [--instance FILE]\n"               \
    "                            [--model M.gguf] [--time]\n"

typedef struct grammar_opts {
    const char *grammar;  /* GBNF file */
    const char *root;     /* start rule; NULL: root */
    const char *instance; /* file to feed; NULL: none */
    const char *model;    /* GGUF whose tokenizer splits the instance; NULL: bytes only */
    bool time;            /* print mask time percentiles */
} grammar_opts_t;

static void usage_hint(void)
{
    fprintf(stderr, GRAMMAR_SYNOPSIS "run 'tandem grammar --help' for the options\n");
}

static void usage(FILE *out)
{
    fprintf(out, GRAMMAR_SYNOPSIS
            "\n"
            "Compiles a GBNF grammar (llama.cpp's syntax) and prints its rule count and size,\n"
            "or the error with its line, column and rule.\n"
            "\n"
            "options:\n"
            "  -g, --grammar FILE   the GBNF grammar\n"
            "      --root RULE      the start rule (default: root)\n"
            "  -i, --instance FILE  feed FILE's bytes: prints accepted, rejected at byte offset\n"
            "                       N, or incomplete\n"
            "  -m, --model PATH     also tokenize the instance with this GGUF's tokenizer and\n"
            "                       feed the tokens one by one through the token mask; prints\n"
            "                       the first token the mask does not allow\n"
            "      --time           with --model: the mask's time per token (p50, p99, max)\n"
            "  -h, --help           this help\n"
            "\n"
            "exit status: 0 grammar valid (and instance accepted), 1 invalid grammar or\n"
            "instance not accepted, or a file error; 2 bad usage\n");
}

/* Feeds bytes one at a time; prints the verdict. Returns 0 when accepted. */
static int check_bytes(const tdm_grammar_t *g, const char *data, size_t len)
{
    tdm_error_t err = {0};
    tdm_grammar_matcher_t *m = tdm_grammar_matcher_new(g, NULL, &err);
    if (!m) {
        fprintf(stderr, "tandem grammar: %s\n", err.msg);
        return 1;
    }
    size_t i = 0;
    while (i < len && tdm_grammar_matcher_accept_bytes(m, data + i, 1))
        i++;
    int rc = 1;
    if (i < len) {
        const char *why = tdm_grammar_matcher_errmsg(m);
        printf("instance: rejected at byte offset %zu%s%s\n", i, *why ? ": " : "", why);
    } else if (!tdm_grammar_matcher_is_accepting(m)) {
        printf("instance: incomplete (%zu bytes are a prefix of the grammar's strings)\n", len);
    } else {
        printf("instance: accepted (%zu bytes)\n", len);
        rc = 0;
    }
    tdm_grammar_matcher_destroy(&m);
    return rc;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void print_times(double *us, size_t n)
{
    if (n == 0)
        return;
    qsort(us, n, sizeof *us, cmp_double);
    double sum = 0;
    for (size_t i = 0; i < n; i++)
        sum += us[i];
    printf("mask time over %zu masks: p50 %.1f us, p75 %.1f us, p99 %.1f us, max %.1f us, "
           "mean %.1f us\n",
           n, us[n / 2], us[n * 3 / 4], us[(size_t)((double)(n - 1) * 0.99)], us[n - 1],
           sum / (double)n);
}

/* Walks the tokens through the mask; returns 0 when every token and the end were allowed. */
static int feed_tokens(tdm_grammar_matcher_t *m, const tdm_tokenizer_t *tok, const tdm_token_t *ids,
                       size_t n, uint32_t *mask, double *us)
{
    size_t offset = 0;
    for (size_t i = 0; i <= n; i++) {
        double t0 = now_us();
        tdm_grammar_matcher_fill_mask(m, mask);
        us[i] = now_us() - t0;
        tdm_token_t t = i < n ? ids[i] : tdm_tokenizer_eos(tok);
        bool allowed = t >= 0 && ((mask[t / 32] >> (t % 32)) & 1u);
        if (i == n) {
            printf("tokens: %zu fed; end of output %s\n", n,
                   allowed ? "allowed (accepted)" : "not allowed (incomplete)");
            return allowed ? 0 : 1;
        }
        char piece[64];
        int len = tdm_tokenizer_token_bytes(tok, t, true, piece, sizeof piece);
        if (!allowed) {
            printf("tokens: token %zu (id %d, %d bytes at byte offset %zu) is not in the mask\n", i,
                   (int)t, len, offset);
            return 1;
        }
        if (tdm_grammar_matcher_accept_token(m, t) != TDM_OK) {
            printf("tokens: token %zu (id %d): %s\n", i, (int)t, tdm_grammar_matcher_errmsg(m));
            return 1;
        }
        offset += len > 0 ? (size_t)len : 0;
    }
    return 1;
}

/* Tokenizes the instance with the model's tokenizer and feeds it through the mask. */
static int check_tokens(const tdm_grammar_t *g, const char *data, size_t len,
                        const grammar_opts_t *o)
{
    tdm_error_t err = {0};
    int rc = 1;
    tdm_token_t *ids = NULL;
    size_t n = 0;
    uint32_t *mask = NULL;
    double *us = NULL;
    tdm_grammar_vocab_t *v = NULL;
    tdm_grammar_matcher_t *m = NULL;
    tdm_tokenizer_t *tok = NULL;
    tdm_gguf_t *gguf = tdm_gguf_open(o->model, &err);
    if (!gguf || !(tok = tdm_tokenizer_new(gguf, &err)) ||
        tdm_tokenizer_encode(tok, data, len, false, false, &ids, &n, &err) != TDM_OK ||
        !(v = tdm_grammar_vocab_new(tok, &err)) || !(m = tdm_grammar_matcher_new(g, v, &err))) {
        fprintf(stderr, "tandem grammar: %s: %s\n", o->model, err.msg);
        goto out_free;
    }
    mask = calloc((tdm_grammar_vocab_n_vocab(v) + 31) / 32, sizeof *mask);
    us = calloc(n + 1, sizeof *us);
    if (!mask || !us) {
        fprintf(stderr, "tandem grammar: out of memory\n");
        goto out_free;
    }
    rc = feed_tokens(m, tok, ids, n, mask, us);
    if (o->time)
        print_times(us, n + 1);
out_free:
    free(us);
    free(mask);
    free(ids);
    tdm_grammar_matcher_destroy(&m);
    tdm_grammar_vocab_destroy(&v);
    tdm_tokenizer_destroy(&tok);
    tdm_gguf_destroy(&gguf);
    return rc;
}

/* Compiles GBNF text (from the file named what) and runs the checks the options ask for. */
static int check_gbnf(const char *what, const char *gbnf, size_t len, const grammar_opts_t *o)
{
    tdm_error_t err = {0};
    tdm_grammar_t *g = tdm_grammar_parse(gbnf, len, o->root, &err);
    if (!g) {
        fprintf(stderr, "tandem grammar: %s: %s\n", what, err.msg);
        return 1;
    }
    printf("grammar: %u rules, %zu bytes compiled\n", tdm_grammar_n_rules(g),
           tdm_grammar_size_bytes(g));
    int rc = 0;
    if (o->instance) {
        char *data;
        size_t n;
        if (tdm_read_file(o->instance, GRAMMAR_MAX_INSTANCE, &data, &n, &err) != TDM_OK) {
            fprintf(stderr, "tandem grammar: %s: %s\n", o->instance, err.msg);
            rc = 1;
        } else {
            rc = check_bytes(g, data, n);
            if (o->model) {
                int trc = check_tokens(g, data, n, o);
                rc = rc ? rc : trc;
            }
            free(data);
        }
    }
    tdm_grammar_destroy(&g);
    return rc;
}

int tdm_cmd_grammar(int argc, char **argv)
{
    grammar_opts_t o = {0};
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("grammar", 'g', &o.grammar),   TDM_CLI_OPT_STR("root", 0, &o.root),
        TDM_CLI_OPT_STR("instance", 'i', &o.instance), TDM_CLI_OPT_STR("model", 'm', &o.model),
        TDM_CLI_OPT_TRUE("time", 0, &o.time),          TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {"tandem grammar", usage, usage_hint, opts};
    if (argc < 2 || strcmp(argv[1], "check") != 0) {
        if (argc >= 2 && (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0)) {
            usage(stdout);
            return 0;
        }
        fprintf(stderr, "tandem grammar: expecting the subcommand 'check'\n");
        usage_hint();
        return 2;
    }
    bool done;
    int rc = tdm_cli_parse(&spec, argc - 1, argv + 1, &done);
    if (done)
        return rc;
    if (!o.grammar || optind < argc - 1) {
        fprintf(stderr, "tandem grammar: %s\n",
                o.grammar ? "unexpected operand" : "--grammar is required");
        usage_hint();
        return 2;
    }
    char *text;
    size_t len;
    tdm_error_t err = {0};
    if (tdm_read_file(o.grammar, TDM_GRAMMAR_MAX_TEXT_BYTES + 1, &text, &len, &err) != TDM_OK) {
        fprintf(stderr, "tandem grammar: %s: %s\n", o.grammar, err.msg);
        return 1;
    }
    rc = check_gbnf(o.grammar, text, len, &o);
    free(text);
    return rc;
}
