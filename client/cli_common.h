/* cli_common.h - what the router-facing subcommands (generate without -m, chat, status, bench,
 * cluster) share: number parsing with messages that name the option, sampling options, the
 * router endpoint and API key from options or the environment, connecting with a quick
 * health probe, SIGINT handling, and exit statuses. */
#ifndef TANDEM_CLIENT_CLI_COMMON_H
#define TANDEM_CLIENT_CLI_COMMON_H

#include <signal.h>
#include <stdbool.h>
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

/* getopt_long codes of the shared options (above every subcommand's own codes). */
enum {
    TDM_CLI_OPT_PRESET = 1000,
    TDM_CLI_OPT_TEMPERATURE,
    TDM_CLI_OPT_TOP_K,
    TDM_CLI_OPT_TOP_P,
    TDM_CLI_OPT_MIN_P,
    TDM_CLI_OPT_REP,
    TDM_CLI_OPT_PRESENCE,
    TDM_CLI_OPT_FREQUENCY,
    TDM_CLI_OPT_SEED,
    TDM_CLI_OPT_IGNORE_EOS,
    TDM_CLI_OPT_ROUTER,
    TDM_CLI_OPT_API_KEY,
    TDM_CLI_OPT_TIMEOUT,
    TDM_CLI_OPT_STOP,
};

/* The struct option entries of the sampling options, for a getopt_long table. */
#define TDM_CLI_SAMPLING_LONG_OPTIONS                                                              \
    {"preset", required_argument, NULL, TDM_CLI_OPT_PRESET},                                       \
        {"temperature", required_argument, NULL, TDM_CLI_OPT_TEMPERATURE},                         \
        {"top-k", required_argument, NULL, TDM_CLI_OPT_TOP_K},                                     \
        {"top-p", required_argument, NULL, TDM_CLI_OPT_TOP_P},                                     \
        {"min-p", required_argument, NULL, TDM_CLI_OPT_MIN_P},                                     \
        {"repetition-penalty", required_argument, NULL, TDM_CLI_OPT_REP},                          \
        {"presence-penalty", required_argument, NULL, TDM_CLI_OPT_PRESENCE},                       \
        {"frequency-penalty", required_argument, NULL, TDM_CLI_OPT_FREQUENCY},                     \
        {"seed", required_argument, NULL, TDM_CLI_OPT_SEED},                                       \
    {                                                                                              \
        "ignore-eos", no_argument, NULL, TDM_CLI_OPT_IGNORE_EOS                                    \
    }

/* Handles getopt code c when it is a sampling option: returns 1 (handled), 0 (not a sampling
 * option) or -1 (bad value; the message is printed). */
int tdm_cli_sampling_option(const char *cmd, int c, const char *arg, tdm_cli_sampling_t *s);

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

/* Reads all of `in` into a NUL-terminated heap buffer (caller frees). Returns 0, or
 * TDM_ERESOURCE on out of memory, TDM_EUNAVAILABLE on a read error. */
int tdm_cli_read_stream(FILE *in, char **text, size_t *len);

#endif
