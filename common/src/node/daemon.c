/* daemon.c - command line, config, signals and lifetime of tandem-prefill / tandem-decode. */
#include <getopt.h>
#include <malloc.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tandem/daemon.h"
#include "tandem/net.h"
#include "tandem/node.h"
#include "tandem/notify.h"

static volatile sig_atomic_t g_stop; /* set by the signal handler only */

static void on_signal(int sig)
{
    (void)sig;
    g_stop = 1;
}

static void usage(FILE *out, const char *prog, tdm_node_role_t role)
{
    fprintf(out,
            "usage: %s [--config FILE] [--node-id ID] [--log-level LEVEL]\n"
            "\n"
            "Runs a Tandem %s node: it loads the model, sizes its KV cache from the node's\n"
            "memory budget, registers with the router (router.node_endpoint) and serves until\n"
            "SIGTERM or SIGINT, then fails what is in flight with UNAVAILABLE and exits 0.\n"
            "\n"
            "  -c, --config FILE      cluster config (YAML); default: the built-in single-host\n"
            "                         cluster (docs/operations.md)\n"
            "  -n, --node-id ID       which node of the config to run (default: the first %s\n"
            "                         node)\n"
            "  -l, --log-level LEVEL  debug, info, warn, error (default: the config's log.level)\n"
            "  -h, --help             this help\n"
            "  -V, --version          print the version\n",
            prog, tdm_config_node_role_name(role), tdm_config_node_role_name(role));
}

/* Readiness for the service manager (tandem/notify.h). The engine thread stays in ops->run
 * until shutdown, so a small thread watches the node's link to the router instead: READY=1
 * once the router acknowledged the registration, STATUS= whenever the link state changes. */
typedef struct ready_watch {
    tdm_node_link_t *link;
    const char *router; /* endpoint the node connects to, for STATUS= */
    const tdm_logger_t *log;
    atomic_bool done; /* set by the main thread once ops->run returned */
    pthread_t thread;
} ready_watch_t;

#define READY_WATCH_PERIOD_NS (50 * 1000 * 1000)

static void watch_notify(const ready_watch_t *w, bool *warned, const char *state)
{
    if (tdm_notify_send(state) != TDM_OK && !*warned) {
        *warned = true;
        TDM_LOG_WARNF(w->log, NULL, "cannot notify the service manager ($NOTIFY_SOCKET)");
    }
}

static void *ready_watch_main(void *arg)
{
    ready_watch_t *w = arg;
    bool ready = false, warned = false;
    int last = -1;
    char msg[TDM_ERRMSG_MAX + 128];
    for (;;) {
        /* one more look after ops->run returned, so a refusal that ended it is reported */
        bool last_round = atomic_load(&w->done);
        char why[TDM_ERRMSG_MAX];
        tdm_node_link_state_t st = tdm_node_link_state(w->link, why, sizeof why);
        if ((int)st != last) {
            last = (int)st;
            switch (st) {
            case TDM_NODE_LINK_REGISTERED:
                snprintf(msg, sizeof msg, "%sSTATUS=serving, registered with the router at %s",
                         ready ? "" : "READY=1\n", w->router);
                ready = true;
                break;
            case TDM_NODE_LINK_REJECTED:
                snprintf(msg, sizeof msg, "STATUS=refused by the router: %s", why);
                break;
            default:
                snprintf(msg, sizeof msg, "STATUS=%s the router at %s",
                         ready ? "lost; registering again with" : "registering with", w->router);
                break;
            }
            watch_notify(w, &warned, msg);
        }
        if (last_round)
            break;
        struct timespec ts = {0, READY_WATCH_PERIOD_NS};
        nanosleep(&ts, NULL);
    }
    return NULL;
}

int tdm_daemon_main(int argc, char **argv, const tdm_daemon_ops_t *ops)
{
    const char *prog = ops->role == TDM_NODE_ROLE_PREFILL ? "tandem-prefill" : "tandem-decode";
    const char *config_path = NULL, *node_id = NULL, *level = NULL;
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},    {"node-id", required_argument, NULL, 'n'},
        {"log-level", required_argument, NULL, 'l'}, {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},         {NULL, 0, NULL, 0},
    };
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "c:n:l:hV", longopts, NULL)) != -1) {
        switch (c) {
        case 'c': config_path = optarg; break;
        case 'n': node_id = optarg; break;
        case 'l': level = optarg; break;
        case 'h': usage(stdout, prog, ops->role); return 0;
        case 'V': printf("%s %s\n", prog, TANDEM_VERSION); return 0;
        default:
            fprintf(stderr, "%s: unknown option or missing argument '%s' (see --help)\n", prog,
                    argv[optind - 1]);
            return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", prog, argv[optind]);
        return 2;
    }
    tdm_config_t cfg;
    tdm_error_t err = {0};
    int rc =
        config_path ? tdm_config_load_file(config_path, &cfg, &err) : tdm_config_defaults(&cfg);
    if (rc != TDM_OK) {
        fprintf(stderr, "%s: config: %s\n", prog, err.msg[0] ? err.msg : tdm_strerror(rc));
        return 2;
    }
    const tdm_node_config_t *node = tdm_node_pick(&cfg, node_id, ops->role, &err);
    if (!node) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        tdm_config_free(&cfg);
        return 2;
    }
    tdm_logger_t log;
    tdm_log_init(&log, node->id);
    log.level = cfg.log.level;
    if (level) {
        int lv = tdm_log_level_parse(level);
        if (lv < 0) {
            fprintf(stderr, "%s: --log-level: unknown level '%s' (debug, info, warn, error)\n",
                    prog, level);
            tdm_config_free(&cfg);
            return 2;
        }
        log.level = (tdm_log_level_t)lv;
    }

    /* ZeroMQ receives each KV block into a fresh malloc buffer of block_bytes; with glibc's
     * defaults those pages go back to the kernel after every transfer and are faulted in again
     * for the next (measured: 2-3x slower transfers, bench/bench_kv_transfer.c). Keep them. */
    mallopt(M_MMAP_THRESHOLD, 32 << 20);
    mallopt(M_TRIM_THRESHOLD, 1 << 30);
    mallopt(M_ARENA_MAX, 1);

    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    int status = 1;
    tdm_net_t *net = tdm_net_new(2, &err);
    if (!net) {
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        goto out_config;
    }
    tdm_notify_sendf("STATUS=loading the model %s", cfg.model.path);
    void *obj = ops->create(&cfg, node->id, net, &log, &err);
    if (!obj) {
        TDM_LOG_ERRORF(&log, NULL, "cannot start: %s", err.msg);
        fprintf(stderr, "%s: %s\n", prog, err.msg);
        status = err.code == TDM_EINVALID || err.code == TDM_ENOTFOUND ? 2 : 1;
        goto out_net;
    }
    ready_watch_t watch = {.router = tdm_config_router_advertise(&cfg), .log = &log};
    atomic_init(&watch.done, false);
    bool watching = false;
    if (ops->link && tdm_notify_enabled()) {
        watch.link = ops->link(obj);
        watching = pthread_create(&watch.thread, NULL, ready_watch_main, &watch) == 0;
        if (!watching)
            TDM_LOG_WARNF(&log, NULL, "cannot start the readiness thread: no sd_notify READY=1");
    }
    rc = ops->run(obj, &g_stop, &err);
    if (watching) {
        atomic_store(&watch.done, true);
        pthread_join(watch.thread, NULL);
    }
    tdm_notify_send("STOPPING=1\nSTATUS=stopping");
    if (rc != TDM_OK) {
        TDM_LOG_ERRORF(&log, NULL, "stopped: %s", err.msg);
        fprintf(stderr, "%s: %s\n", prog, err.msg);
    } else {
        status = 0;
    }
    ops->destroy(obj);
out_net:
    tdm_net_destroy(&net);
out_config:
    tdm_config_free(&cfg);
    return status;
}
