/* main.c - `tandem-router`: the router daemon (client API, node registry, scheduler).
 *
 * Reads the cluster config (--config FILE, or the defaults), binds the client and node
 * endpoints and serves until SIGTERM or SIGINT; then every request in flight ends with
 * UNAVAILABLE "router shutting down", its nodes get NodeCancel, and the process exits 0.
 */
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "router.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/node_keys.h"
#include "tandem/notify.h"

static void usage(FILE *out)
{
    fprintf(out, "usage: tandem-router [--config FILE] [--log-level LEVEL]\n"
                 "\n"
                 "Runs Tandem's router: the client API (router.client_endpoint), the endpoint the\n"
                 "prefill and decode nodes connect to (router.node_endpoint), scheduling, the\n"
                 "tokenizer and stop strings. Without --config it uses the defaults (one prefill\n"
                 "and one decode node on this host, the default model); see docs/operations.md.\n"
                 "SIGTERM or SIGINT stops it: requests in flight end with UNAVAILABLE.\n"
                 "\n"
                 "options:\n"
                 "  -c, --config FILE      cluster config (YAML)\n"
                 "  -l, --log-level LEVEL  debug, info, warn, error or off (default: the config's\n"
                 "                         log.level)\n"
                 "  -h, --help             this help\n"
                 "  -V, --version          print the version\n");
}

static volatile sig_atomic_t stop_flag;

static void on_signal(int sig)
{
    (void)sig;
    stop_flag = 1;
}

/* Parses the command line into *config_path and *level (-1: the config's). Returns -1 to go
 * on, or the exit status (0 after --help or --version, 2 for a usage error). */
static int parse_args(int argc, char **argv, const char **config_path, int *level)
{
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"log-level", required_argument, NULL, 'l'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    const char *level_name = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "c:l:hV", opts, NULL)) != -1) {
        switch (c) {
        case 'c': *config_path = optarg; break;
        case 'l': level_name = optarg; break;
        case 'h': usage(stdout); return 0;
        case 'V': printf("tandem-router %s\n", TANDEM_VERSION); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "tandem-router: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    *level = -1;
    if (level_name && (*level = tdm_log_level_parse(level_name)) < 0) {
        fprintf(stderr,
                "tandem-router: --log-level must be debug, info, warn, error or off, got '%s'\n",
                level_name);
        return 2;
    }
    return -1;
}

/* Logs and prints why the router cannot start. */
static void start_failed(const tdm_logger_t *log, const char *what, const char *msg)
{
    tdm_log_write(log, TDM_LOG_ERROR, NULL, NULL, "%s failed to start: %s", what, msg);
    fprintf(stderr, "tandem-router: %s\n", msg);
}

/* Makes the router and its HTTP gateway (a client of the router's own client endpoint,
 * router/http.h). Returns false after start_failed, with nothing left to free. */
static bool start(const tdm_config_t *cfg, tdm_net_t *net, const tdm_logger_t *log,
                  tdm_router_t **r, tdm_http_t **http)
{
    tdm_error_t err = {0};
    /* the HTTP gateway binds no non-loopback address without API keys (security.insecure
     * aside); the router checks its own endpoints the same way */
    if (tdm_config_bind_check(cfg, "router.http_address",
                              cfg->router.http_address ? cfg->router.http_address : "127.0.0.1",
                              TDM_BIND_GUARD_API_KEYS, &err) != TDM_OK) {
        start_failed(log, "router", err.msg);
        return false;
    }
    if (!(*r = tdm_router_new(cfg, net, log, &err))) {
        start_failed(log, "router", err.msg);
        return false;
    }
    tdm_http_vocab_t vocabs[TDM_CONFIG_MAX_MODELS];
    for (size_t i = 0; i < cfg->n_models; i++)
        tdm_router_model_vocab(*r, i, &vocabs[i].tok, &vocabs[i].pick, &vocabs[i].n_ctx);
    if (!(*http = tdm_http_new(cfg, tdm_router_inproc_endpoint(*r), vocabs, cfg->n_models, net, log,
                               &err))) {
        start_failed(log, "http gateway", err.msg);
        tdm_router_destroy(r);
        return false;
    }
    return true;
}

/* SIGTERM and SIGINT set stop_flag; SIGPIPE is ignored. */
static void install_signals(void)
{
    /* no SA_RESTART: the signal interrupts zmq_poll so the loop sees the flag at once */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

/* Serves until a signal stops the loop. Returns the exit status. */
static int serve(const tdm_config_t *cfg, tdm_router_t *r, const tdm_logger_t *log)
{
    /* Every listening socket is bound by now: tell systemd (Type=notify units) we serve. */
    if (tdm_notify_sendf("READY=1\nSTATUS=serving clients at %s, nodes at %s, HTTP at %s:%d",
                         cfg->router.client_endpoint, cfg->router.node_endpoint,
                         cfg->router.http_address, cfg->router.http_port) != TDM_OK)
        tdm_log_write(log, TDM_LOG_WARN, NULL, NULL,
                      "cannot notify the service manager ($NOTIFY_SOCKET)");
    int rc = tdm_router_run(r, &stop_flag);
    tdm_notify_send("STOPPING=1\nSTATUS=stopping");
    if (rc != TDM_OK) {
        tdm_log_write(log, TDM_LOG_ERROR, NULL, NULL, "router loop failed: %s",
                      tdm_router_errmsg(r));
        return 1;
    }
    tdm_log_write(log, TDM_LOG_INFO, NULL, NULL, "router stopped");
    return 0;
}

int main(int argc, char **argv)
{
    const char *config_path = NULL;
    int level;
    int status = parse_args(argc, argv, &config_path, &level);
    if (status >= 0)
        return status;
    tdm_config_t cfg;
    tdm_error_t err = {0};
    int rc =
        config_path ? tdm_config_load_file(config_path, &cfg, &err) : tdm_config_defaults(&cfg);
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem-router: %s\n",
                err.msg[0] ? err.msg : "cannot form the default config (is $HOME set?)");
        return 1;
    }
    tdm_logger_t log;
    tdm_log_init(&log, "router");
    log.level = level >= 0 ? (tdm_log_level_t)level : cfg.log.level;
    tdm_log_fatal_signals(&log, "tandem-router");

    status = 1;
    char keydir[PATH_MAX];
    if (tdm_keydir_apply(&cfg, keydir, sizeof keydir, &err) != TDM_OK) {
        fprintf(stderr, "tandem-router: %s\n", err.msg);
        goto out_config;
    }
    if (keydir[0])
        tdm_log_write(&log, TDM_LOG_INFO, NULL, NULL,
                      "keys by default: CURVE keys of the router and every node in %s", keydir);
    tdm_net_t *net = tdm_net_new(1, &err);
    if (!net) {
        fprintf(stderr, "tandem-router: %s\n", err.msg);
        goto out_config;
    }
    tdm_router_t *r = NULL;
    tdm_http_t *http = NULL;
    if (!start(&cfg, net, &log, &r, &http))
        goto out_net;
    install_signals();
    status = serve(&cfg, r, &log);
    tdm_http_destroy(&http);
    tdm_router_destroy(&r);
out_net:
    tdm_net_destroy(&net);
out_config:
    tdm_config_free(&cfg);
    return status;
}
