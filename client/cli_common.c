/* cli_common.c - helpers shared by the router-facing subcommands (cli_common.h). */
#include <ctype.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli_common.h"

/* The one piece of process state: a signal handler can only reach a static flag. */
static volatile sig_atomic_t cli_interrupted;
static volatile sig_atomic_t cli_signal;

bool tdm_cli_parse_long(const char *cmd, const char *opt, const char *s, long lo, long hi,
                        long *out)
{
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) {
        fprintf(stderr, "%s: %s must be an integer in %ld..%ld, got '%s'\n", cmd, opt, lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

bool tdm_cli_parse_double(const char *cmd, const char *opt, const char *s, double lo, double hi,
                          double *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v) || v < lo || v > hi) {
        fprintf(stderr, "%s: %s must be a number in [%g, %g], got '%s'\n", cmd, opt, lo, hi, s);
        return false;
    }
    *out = v;
    return true;
}

bool tdm_cli_parse_float(const char *cmd, const char *opt, const char *s, float *out)
{
    char *end;
    errno = 0;
    float v = strtof(s, &end);
    /* ERANGE with a tiny result is an underflow (1e-40 parses as a subnormal): accept it */
    if ((errno && !(errno == ERANGE && fabsf(v) <= 1.0f)) || end == s || *end || !isfinite(v)) {
        fprintf(stderr, "%s: %s must be a number, got '%s'\n", cmd, opt, s);
        return false;
    }
    *out = v;
    return true;
}

bool tdm_cli_parse_u64(const char *cmd, const char *opt, const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-') {
        fprintf(stderr, "%s: %s must be an unsigned integer, got '%s'\n", cmd, opt, s);
        return false;
    }
    *out = v;
    return true;
}

/* The most options a table may have (with -h/--help). */
#define CLI_MAX_OPTS 48

/* The getopt_long code of opts[i]: its letter, or 256 + i for a long-only option. */
static int opt_code(const tdm_cli_opt_t *opt, size_t i)
{
    return opt->short_name ? (unsigned char)opt->short_name : 256 + (int)i;
}

/* Fills getopt_long's table and option string from spec's table; returns the entry count. */
static size_t build_getopt(const tdm_cli_spec_t *spec, struct option *lo, char *shorts)
{
    size_t n = 0, k = 0;
    if (spec->usage_hint)
        shorts[k++] = ':'; /* report a missing value as ':', not '?' */
    for (; spec->opts[n].name; n++) {
        const tdm_cli_opt_t *opt = &spec->opts[n];
        TDM_ASSERT(n + 2 < CLI_MAX_OPTS);
        bool has_arg = opt->arg != TDM_CLI_ARG_TRUE && opt->arg != TDM_CLI_ARG_FALSE;
        lo[n] = (struct option){opt->name, has_arg ? required_argument : no_argument, NULL,
                                opt_code(opt, n)};
        if (opt->short_name) {
            shorts[k++] = opt->short_name;
            if (has_arg)
                shorts[k++] = ':';
        }
    }
    lo[n] = (struct option){"help", no_argument, NULL, 'h'};
    lo[n + 1] = (struct option){NULL, 0, NULL, 0};
    shorts[k++] = 'h';
    shorts[k] = '\0';
    return n;
}

/* Stores value as opt says. Returns false after printing why it is bad. */
static bool opt_store(const char *cmd, const tdm_cli_opt_t *opt, const char *value)
{
    char label[64];
    snprintf(label, sizeof label, "--%s", opt->name);
    switch (opt->arg) {
    case TDM_CLI_ARG_TRUE: *(bool *)opt->target = true; return true;
    case TDM_CLI_ARG_FALSE: *(bool *)opt->target = false; return true;
    case TDM_CLI_ARG_STR: *(const char **)opt->target = value; return true;
    case TDM_CLI_ARG_LONG:
        return tdm_cli_parse_long(cmd, label, value, (long)opt->lo, (long)opt->hi, opt->target);
    case TDM_CLI_ARG_DOUBLE:
        return tdm_cli_parse_double(cmd, label, value, opt->lo, opt->hi, opt->target);
    case TDM_CLI_ARG_FLOAT: return tdm_cli_parse_float(cmd, label, value, opt->target);
    case TDM_CLI_ARG_U64: return tdm_cli_parse_u64(cmd, label, value, opt->target);
    case TDM_CLI_ARG_FN: return opt->fn(cmd, value, opt->target);
    }
    return false;
}

/* Reports what getopt_long found wrong (c is '?' or ':'): getopt's own message and the usage,
 * or, with a usage hint, the command's message and the hint. */
static void report_bad_option(const tdm_cli_spec_t *spec, int c, char **argv)
{
    if (!spec->usage_hint) {
        spec->usage(stderr); /* getopt printed why */
        return;
    }
    if (c == ':')
        fprintf(stderr, "%s: option '%s' needs a value\n", spec->cmd, argv[optind - 1]);
    else if (optopt > 0 && optopt < 128 && isprint(optopt)) /* a letter, not a long option's code */
        fprintf(stderr, "%s: unknown option '-%c'\n", spec->cmd, optopt);
    else
        fprintf(stderr, "%s: unknown option '%s'\n", spec->cmd, argv[optind - 1]);
    spec->usage_hint();
}

int tdm_cli_parse(const tdm_cli_spec_t *spec, int argc, char **argv, bool *done)
{
    struct option lo[CLI_MAX_OPTS];
    char shorts[3 * CLI_MAX_OPTS + 2];
    size_t n = build_getopt(spec, lo, shorts);
    *done = true;
    optind = 1;
    opterr = spec->usage_hint ? 0 : 1;
    int c;
    while ((c = getopt_long(argc, argv, shorts, lo, NULL)) != -1) {
        if (c == 'h') {
            spec->usage(stdout);
            return 0;
        }
        size_t i = 0;
        while (i < n && opt_code(&spec->opts[i], i) != c)
            i++;
        if (i == n) {
            report_bad_option(spec, c, argv);
            return 2;
        }
        const tdm_cli_opt_t *opt = &spec->opts[i];
        if (!opt_store(spec->cmd, opt, optarg))
            return 2;
        if (opt->given)
            *opt->given = true;
        if (opt->mark && !*opt->mark)
            *opt->mark = opt->label;
    }
    *done = false;
    return 0;
}

bool tdm_cli_sampling_build(const char *cmd, const tdm_cli_sampling_t *s, long max_tokens,
                            tdm_sampling_params_t *sp)
{
    tdm_sampling_params_default(sp);
    sp->temperature = 0.0f; /* greedy unless asked otherwise */
    tdm_error_t err = {0};
    if (s->preset && tdm_sampling_preset(s->preset, sp, &err) != TDM_OK) {
        fprintf(stderr, "%s: --preset: %s\n", cmd, err.msg);
        return false;
    }
    if (s->has_temperature)
        sp->temperature = s->temperature;
    if (s->has_top_k)
        sp->top_k = (int32_t)s->top_k;
    if (s->has_top_p)
        sp->top_p = s->top_p;
    if (s->has_min_p)
        sp->min_p = s->min_p;
    if (s->has_rep)
        sp->repetition_penalty = s->rep;
    if (s->has_presence)
        sp->presence_penalty = s->presence;
    if (s->has_frequency)
        sp->frequency_penalty = s->frequency;
    sp->seed = s->seed;
    sp->ignore_eos = s->ignore_eos;
    sp->max_tokens = (int32_t)max_tokens;
    return true;
}

const char *tdm_cli_router_endpoint(const char *opt)
{
    if (opt && opt[0])
        return opt;
    const char *env = getenv("TANDEM_ROUTER");
    return env && env[0] ? env : TDM_CLIENT_DEFAULT_ENDPOINT;
}

const char *tdm_cli_api_key(const char *opt)
{
    if (opt && opt[0])
        return opt;
    const char *env = getenv("TANDEM_API_KEY");
    return env && env[0] ? env : NULL;
}

static void on_interrupt(int sig)
{
    cli_interrupted = 1;
    cli_signal = sig;
}

void tdm_cli_catch_interrupt(bool also_term)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0; /* no SA_RESTART: reads and waits return with EINTR */
    sigaction(SIGINT, &sa, NULL);
    if (also_term)
        sigaction(SIGTERM, &sa, NULL);
}

const volatile sig_atomic_t *tdm_cli_interrupt_flag(void)
{
    return &cli_interrupted;
}

int tdm_cli_interrupt_signal(void)
{
    return cli_signal;
}

void tdm_cli_interrupt_reset(void)
{
    cli_interrupted = 0;
    cli_signal = 0;
}

tdm_client_t *tdm_cli_connect(const char *cmd, const char *endpoint, const char *api_key,
                              double timeout_s, int *status)
{
    tdm_client_opts_t o = {0};
    o.api_key = api_key;
    o.timeout_s = timeout_s;
    o.cancel_flag = tdm_cli_interrupt_flag();
    tdm_error_t err = {0};
    tdm_client_t *c = tdm_client_new(endpoint, &o, &err);
    if (!c) {
        fprintf(stderr, "%s: --router %s: %s\n", cmd, endpoint, err.msg);
        *status = err.code == TDM_EINVALID ? 2 : 1;
        return NULL;
    }
    double probe = 5.0;
    if (timeout_s > 0 && timeout_s < probe)
        probe = timeout_s;
    tdm_client_health_t h;
    int rc = tdm_client_health(c, probe, &h);
    if (rc == TDM_OK)
        return c;
    if (rc == TDM_EDEADLINE)
        fprintf(stderr,
                "%s: no answer from the router at %s within %g s: is it running? "
                "(`tandem cluster up` starts a cluster; --router or $TANDEM_ROUTER names "
                "another)\n",
                cmd, endpoint, probe);
    else if (rc != TDM_ECANCELLED)
        fprintf(stderr, "%s: router %s: %s (%s)\n", cmd, endpoint, tdm_client_errmsg(c),
                tdm_status_name(rc));
    *status = tdm_cli_exit_status(rc);
    tdm_client_destroy(&c);
    return NULL;
}

int tdm_cli_exit_status(int rc)
{
    if (rc == TDM_ECANCELLED && cli_interrupted)
        return TDM_CLI_EXIT_INTERRUPTED;
    return rc == TDM_EINVALID ? 2 : 1;
}

int tdm_cli_read_stream(FILE *in, size_t max_bytes, char **text, size_t *len)
{
    tdm_buf_t b = TDM_BUF_INIT;
    for (;;) {
        if (tdm_buf_reserve(&b, 4096) != TDM_OK) {
            tdm_buf_free(&b);
            return TDM_ERESOURCE;
        }
        size_t got = fread(b.data + b.len, 1, b.cap - b.len - 1, in);
        b.len += got;
        if (max_bytes && b.len > max_bytes) {
            tdm_buf_free(&b);
            return TDM_EINVALID;
        }
        if (got == 0)
            break;
    }
    if (ferror(in)) {
        tdm_buf_free(&b);
        return TDM_EUNAVAILABLE;
    }
    b.data[b.len] = '\0';
    *len = b.len;
    *text = tdm_buf_take(&b);
    return TDM_OK;
}
