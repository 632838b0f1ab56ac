/* main.c - `tandem-router`: the router daemon (client API, node registry, scheduler).
 *
 * Reads the cluster config (--config FILE, or the defaults), binds the client and node
 * endpoints and serves until SIGTERM or SIGINT; then every request in flight ends with
 * UNAVAILABLE "router shutting down", its nodes get NodeCancel, and the process exits 0.
 */
#include <getopt.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "http.h"
#include "router.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
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

int main(int argc, char **argv)
{
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"log-level", required_argument, NULL, 'l'},
        {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},
        {NULL, 0, NULL, 0},
    };
    const char *config_path = NULL, *level_name = NULL;
    int c;
    while ((c = getopt_long(argc, argv, "c:l:hV", opts, NULL)) != -1) {
        switch (c) {
        case 'c': config_path = optarg; break;
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
    int level = -1;
    if (level_name && (level = tdm_log_level_parse(level_name)) < 0) {
        fprintf(stderr,
                "tandem-router: --log-level must be debug, info, warn, error or off, got '%s'\n",
                level_name);
        return 2;
    }

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

    int status = 1;
    tdm_net_t *net = tdm_net_new(1, &err);
    if (!net) {
        fprintf(stderr, "tandem-router: %s\n", err.msg);
        goto out_config;
    }
    /* the HTTP gateway binds no non-loopback address without API keys (security.insecure
     * aside); the router checks its own endpoints the same way */
    if (tdm_config_bind_check(&cfg, "router.http_address",
                              cfg.router.http_address ? cfg.router.http_address : "127.0.0.1",
                              TDM_BIND_GUARD_API_KEYS, &err) != TDM_OK) {
        tdm_log_write(&log, TDM_LOG_ERROR, NULL, NULL, "router failed to start: %s", err.msg);
        fprintf(stderr, "tandem-router: %s\n", err.msg);
        goto out_net;
    }
    tdm_router_t *r = tdm_router_new(&cfg, net, &log, &err);
    if (!r) {
        tdm_log_write(&log, TDM_LOG_ERROR, NULL, NULL, "router failed to start: %s", err.msg);
        fprintf(stderr, "tandem-router: %s\n", err.msg);
        goto out_net;
    }
    /* the HTTP gateway: a client of the router's own client endpoint (router/http.h) */
    tdm_http_t *http = tdm_http_new(&cfg, tdm_router_inproc_endpoint(r), net, &log, &err);
    if (!http) {
        tdm_log_write(&log, TDM_LOG_ERROR, NULL, NULL, "http gateway failed to start: %s", err.msg);
        fprintf(stderr, "tandem-router: %s\n", err.msg);
        tdm_router_destroy(&r);
        goto out_net;
    }
    /* no SA_RESTART: the signal interrupts zmq_poll so the loop sees the flag at once */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    /* Every listening socket is bound by now: tell systemd (Type=notify units) we serve. */
    if (tdm_notifyf("READY=1\nSTATUS=serving clients at %s, nodes at %s, HTTP at %s:%d",
                    cfg.router.client_endpoint, cfg.router.node_endpoint, cfg.router.http_address,
                    cfg.router.http_port) != TDM_OK)
        tdm_log_write(&log, TDM_LOG_WARN, NULL, NULL,
                      "cannot notify the service manager ($NOTIFY_SOCKET)");
    rc = tdm_router_run(r, &stop_flag);
    tdm_notify("STOPPING=1\nSTATUS=stopping");
    if (rc != TDM_OK) {
        tdm_log_write(&log, TDM_LOG_ERROR, NULL, NULL, "router loop failed: %s",
                      tdm_router_errmsg(r));
    } else {
        tdm_log_write(&log, TDM_LOG_INFO, NULL, NULL, "router stopped");
        status = 0;
    }
    tdm_http_destroy(&http);
    tdm_router_destroy(&r);
out_net:
    tdm_net_destroy(&net);
out_config:
    tdm_config_free(&cfg);
    return status;
}
