/* cli_common.c - helpers shared by the router-facing subcommands (cli_common.h). */
#include <errno.h>
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

int tdm_cli_sampling_option(const char *cmd, int c, const char *arg, tdm_cli_sampling_t *s)
{
    bool ok = true;
    switch (c) {
    case TDM_CLI_OPT_PRESET: s->preset = arg; break;
    case TDM_CLI_OPT_TEMPERATURE:
        ok = s->has_temperature = tdm_cli_parse_float(cmd, "--temperature", arg, &s->temperature);
        break;
    case TDM_CLI_OPT_TOP_P:
        ok = s->has_top_p = tdm_cli_parse_float(cmd, "--top-p", arg, &s->top_p);
        break;
    case TDM_CLI_OPT_MIN_P:
        ok = s->has_min_p = tdm_cli_parse_float(cmd, "--min-p", arg, &s->min_p);
        break;
    case TDM_CLI_OPT_REP:
        ok = s->has_rep = tdm_cli_parse_float(cmd, "--repetition-penalty", arg, &s->rep);
        break;
    case TDM_CLI_OPT_PRESENCE:
        ok = s->has_presence = tdm_cli_parse_float(cmd, "--presence-penalty", arg, &s->presence);
        break;
    case TDM_CLI_OPT_FREQUENCY:
        ok = s->has_frequency = tdm_cli_parse_float(cmd, "--frequency-penalty", arg, &s->frequency);
        break;
    case TDM_CLI_OPT_TOP_K:
        ok = s->has_top_k = tdm_cli_parse_long(cmd, "--top-k", arg, 0, INT32_MAX, &s->top_k);
        break;
    case TDM_CLI_OPT_SEED: ok = tdm_cli_parse_u64(cmd, "--seed", arg, &s->seed); break;
    case TDM_CLI_OPT_IGNORE_EOS: s->ignore_eos = true; break;
    default: return 0;
    }
    return ok ? 1 : -1;
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

int tdm_cli_read_stream(FILE *in, char **text, size_t *len)
{
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    if (!buf)
        return TDM_ERESOURCE;
    for (;;) {
        if (n + 1 == cap) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                return TDM_ERESOURCE;
            }
            buf = nb;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n - 1, in);
        n += got;
        if (got == 0)
            break;
    }
    if (ferror(in)) {
        free(buf);
        return TDM_EUNAVAILABLE;
    }
    buf[n] = '\0';
    *text = buf;
    *len = n;
    return TDM_OK;
}
