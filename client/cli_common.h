/* cli_common.h - what the subcommands share: the table-driven option parser (tdm_cli_parse)
 * and number parsing with messages that name the option, reading stdin, and, for the
 * router-facing ones (generate without -m, chat, status, bench, cluster), sampling options,
 * the router endpoint and API key from options or the environment, connecting with a quick
 * health probe, SIGINT handling, and exit statuses. */
#ifndef TANDEM_CLIENT_CLI_COMMON_H
#define TANDEM_CLIENT_CLI_COMMON_H

#include <getopt.h> /* optind: the first operand after tdm_cli_parse */
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "tandem/client.h"
#include "tandem/sampling.h"

/* Exit status after Ctrl-C (128 + SIGINT), as shells report it. */
#define TDM_CLI_EXIT_INTERRUPTED 130

/* Parse a whole-string number in [lo, hi]; on failure print "CMD: OPT must be ..., got 'S'"
 * to stderr and return false. */
bool tdm_cli_parse_long(const char *cmd, const char *opt, const char *s, long lo, long hi,
                        long *out);
bool tdm_cli_parse_double(const char *cmd, const char *opt, const char *s, double lo, double hi,
                          double *out);
bool tdm_cli_parse_float(const char *cmd, const char *opt, const char *s, float *out);
bool tdm_cli_parse_u64(const char *cmd, const char *opt, const char *s, uint64_t *out);

/* Sampling options as given on the command line: which were set, and their values. */
typedef struct tdm_cli_sampling {
    const char *preset;
    float temperature, top_p, min_p, rep, presence, frequency;
    long top_k;
    uint64_t seed;
    bool has_temperature, has_top_p, has_min_p, has_rep, has_presence, has_frequency, has_top_k;
    bool ignore_eos;
} tdm_cli_sampling_t;

/* A table-driven option parser over getopt_long: one table per command lists every option,
 * what it takes and where its value goes, so a command's parse is its table plus the checks
 * that relate options to each other. Values are checked with the tdm_cli_parse_* functions
 * above (their messages name the option as "--NAME"). */
typedef enum tdm_cli_arg {
    TDM_CLI_ARG_TRUE,   /* no value: *(bool *)target = true */
    TDM_CLI_ARG_FALSE,  /* no value: *(bool *)target = false */
    TDM_CLI_ARG_STR,    /* *(const char **)target = the value (argv-owned) */
    TDM_CLI_ARG_LONG,   /* *(long *)target: an integer in [lo, hi] */
    TDM_CLI_ARG_DOUBLE, /* *(double *)target: a number in [lo, hi] */
    TDM_CLI_ARG_FLOAT,  /* *(float *)target: a finite number */
    TDM_CLI_ARG_U64,    /* *(uint64_t *)target: an unsigned integer */
    TDM_CLI_ARG_FN,     /* fn(cmd, value, target) checks and stores the value */
} tdm_cli_arg_t;

typedef struct tdm_cli_opt {
    const char *name; /* the long name without "--"; NULL ends a table */
    char short_name;  /* the one-letter form (-n), or 0 for none */
    tdm_cli_arg_t arg;
    void *target;      /* where the value goes (the type the arg kind names) */
    double lo, hi;     /* the range of LONG and DOUBLE values */
    bool *given;       /* set to true once the option was given with a good value; may be NULL */
    const char **mark; /* when set: *mark = label the first time, if *mark is still NULL */
    const char *label; /* the option's name in the message about *mark ("-t/--threads") */
    /* FN: stores value into target, or prints why it is bad (prefixed by cmd) and returns
     * false */
    bool (*fn)(const char *cmd, const char *value, void *target);
} tdm_cli_opt_t;

/* Table entries by kind: long name, letter (0: none), target, then the range where the kind
 * has one; optional designators (.given, .mark, .label) may follow. */
#define TDM_CLI_OPT_TRUE(n, s, t, ...)                                                             \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_TRUE, .target = (t), __VA_ARGS__        \
    }
#define TDM_CLI_OPT_FALSE(n, s, t, ...)                                                            \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_FALSE, .target = (t), __VA_ARGS__       \
    }
#define TDM_CLI_OPT_STR(n, s, t, ...)                                                              \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_STR, .target = (t), __VA_ARGS__         \
    }
#define TDM_CLI_OPT_LONG(n, s, t, l, h, ...)                                                       \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_LONG, .target = (t), .lo = (l),         \
        .hi = (h), __VA_ARGS__                                                                     \
    }
#define TDM_CLI_OPT_DOUBLE(n, s, t, l, h, ...)                                                     \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_DOUBLE, .target = (t), .lo = (l),       \
        .hi = (h), __VA_ARGS__                                                                     \
    }
#define TDM_CLI_OPT_FLOAT(n, s, t, ...)                                                            \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_FLOAT, .target = (t), __VA_ARGS__       \
    }
#define TDM_CLI_OPT_U64(n, s, t, ...)                                                              \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_U64, .target = (t), __VA_ARGS__         \
    }
#define TDM_CLI_OPT_FN(n, s, f, t, ...)                                                            \
    {                                                                                              \
        .name = (n), .short_name = (s), .arg = TDM_CLI_ARG_FN, .fn = (f), .target = (t),           \
        __VA_ARGS__                                                                                \
    }
#define TDM_CLI_OPT_END                                                                            \
    {                                                                                              \
        .name = NULL                                                                               \
    }

/* The entries of the sampling options, into a tdm_cli_sampling_t *s. */
#define TDM_CLI_SAMPLING_OPTS(s)                                                                   \
    TDM_CLI_OPT_STR("preset", 0, &(s)->preset),                                                    \
        TDM_CLI_OPT_FLOAT("temperature", 0, &(s)->temperature, .given = &(s)->has_temperature),    \
        TDM_CLI_OPT_LONG("top-k", 0, &(s)->top_k, 0, INT32_MAX, .given = &(s)->has_top_k),         \
        TDM_CLI_OPT_FLOAT("top-p", 0, &(s)->top_p, .given = &(s)->has_top_p),                      \
        TDM_CLI_OPT_FLOAT("min-p", 0, &(s)->min_p, .given = &(s)->has_min_p),                      \
        TDM_CLI_OPT_FLOAT("repetition-penalty", 0, &(s)->rep, .given = &(s)->has_rep),             \
        TDM_CLI_OPT_FLOAT("presence-penalty", 0, &(s)->presence, .given = &(s)->has_presence),     \
        TDM_CLI_OPT_FLOAT("frequency-penalty", 0, &(s)->frequency, .given = &(s)->has_frequency),  \
        TDM_CLI_OPT_U64("seed", 0, &(s)->seed),                                                    \
        TDM_CLI_OPT_TRUE("ignore-eos", 0, &(s)->ignore_eos)

/* The entries of the router connection: --router, --api-key and --timeout (seconds, of each
 * call) into a const char *, a const char * and a double. */
#define TDM_CLI_ROUTER_OPTS(router, api_key, timeout_s)                                            \
    TDM_CLI_OPT_STR("router", 0, (router)), TDM_CLI_OPT_STR("api-key", 0, (api_key)),              \
        TDM_CLI_OPT_DOUBLE("timeout", 0, (timeout_s), 0.001, 86400)

/* How a command parses its arguments. */
typedef struct tdm_cli_spec {
    const char *cmd;          /* "tandem generate": the prefix of every message */
    void (*usage)(FILE *out); /* -h/--help prints it to stdout; a usage error to stderr */
    /* When set, a usage error getopt finds (unknown option, missing value) is reported as
     * "CMD: unknown option 'X'" / "CMD: option 'X' needs a value" followed by usage_hint()
     * instead of getopt's message and usage(stderr). */
    void (*usage_hint)(void);
    const tdm_cli_opt_t *opts; /* the table; -h/--help is added to it */
} tdm_cli_spec_t;

/* Parses argv[1..argc) against spec (getopt_long, GNU order: options and operands may mix;
 * "--" ends the options). Returns the exit status; *done says whether the command stops here:
 * 0 with *done after -h/--help, 2 with *done after a bad option or value (message printed), 0
 * without *done to go on, with the operands at argv[optind..argc). */
int tdm_cli_parse(const tdm_cli_spec_t *spec, int argc, char **argv, bool *done);

/* Builds the parameters: defaults, greedy (temperature 0), the preset, then the options, the
 * seed (0 unless given), ignore_eos and max_tokens. Returns false (message printed) for an
 * unknown preset. */
bool tdm_cli_sampling_build(const char *cmd, const tdm_cli_sampling_t *s, long max_tokens,
                            tdm_sampling_params_t *sp);

/* The router endpoint: opt, else $TANDEM_ROUTER, else TDM_CLIENT_DEFAULT_ENDPOINT. */
const char *tdm_cli_router_endpoint(const char *opt);

/* The API key: opt, else $TANDEM_API_KEY, else NULL. */
const char *tdm_cli_api_key(const char *opt);

/* Installs the SIGINT (and, when also_term, SIGTERM) handler that sets the interrupt flag
 * (without SA_RESTART, so blocking reads and waits return early). */
void tdm_cli_catch_interrupt(bool also_term);

/* The flag the handler sets (for tdm_client_opts_t.cancel_flag), and the signal that set it
 * (0 = none). */
const volatile sig_atomic_t *tdm_cli_interrupt_flag(void);
int tdm_cli_interrupt_signal(void);

/* Clears the flag (after an interrupted answer in `tandem chat`). */
void tdm_cli_interrupt_reset(void);

/* Connects to the router (endpoint, api_key may be NULL, timeout_s per call; 0 = default)
 * with the interrupt flag as cancel flag, then asks Health with a short deadline
 * (min(5 s, timeout)) so a router that is not running is reported at once. Returns the
 * client, or NULL after printing why ("CMD: no answer from the router at EP within 5 s ..."),
 * with *status the exit status to use. */
tdm_client_t *tdm_cli_connect(const char *cmd, const char *endpoint, const char *api_key,
                              double timeout_s, int *status);

/* The exit status for a failed call: 130 when interrupted by Ctrl-C, 2 for INVALID_ARGUMENT,
 * 1 otherwise. */
int tdm_cli_exit_status(int rc);

/* Reads all of `in` into a NUL-terminated heap buffer (caller frees; *len excludes the NUL).
 * Returns 0, or TDM_EINVALID when it holds more than max_bytes (0: no limit), TDM_ERESOURCE on
 * out of memory, TDM_EUNAVAILABLE on a read error. */
int tdm_cli_read_stream(FILE *in, size_t max_bytes, char **text, size_t *len);

#endif
