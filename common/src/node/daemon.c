/* daemon.c - command line, config, signals and lifetime of tandem-prefill / tandem-decode. */
#include <getopt.h>
#include <limits.h>
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
#include "tandem/node_keys.h"
#include "tandem/node_link.h"
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
 * until shutdown, so a small thread watches the node's links to the routers instead: READY=1
 * once a router acknowledged the registration, STATUS= whenever the links' states change. */
typedef struct ready_watch {
    tdm_node_link_t *links[TDM_CONFIG_MAX_ROUTERS];
    size_t n_links;
    const char *router; /* the first endpoint the node connects to, for STATUS= */
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

/* The links' states together: REJECTED when one router refused the node (why gets its
 * reason), REGISTERED when one or more serve it (*n_registered of them), else CONNECTING. */
static tdm_node_link_state_t watch_state(const ready_watch_t *w, char *why, size_t cap,
                                         size_t *n_registered)
{
    bool rejected = false;
    *n_registered = 0;
    for (size_t i = 0; i < w->n_links; i++) {
        char msg[TDM_ERRMSG_MAX];
        tdm_node_link_state_t st = tdm_node_link_state(w->links[i], msg, sizeof msg);
        if (st == TDM_NODE_LINK_REJECTED && !rejected) {
            rejected = true;
            snprintf(why, cap, "%s", msg);
        }
        *n_registered += st == TDM_NODE_LINK_REGISTERED;
    }
    if (rejected)
        return TDM_NODE_LINK_REJECTED;
    return *n_registered ? TDM_NODE_LINK_REGISTERED : TDM_NODE_LINK_CONNECTING;
}

static void *ready_watch_main(void *arg)
{
    ready_watch_t *w = arg;
    bool ready = false, warned = false;
    int last = -1;
    size_t last_n = 0;
    char msg[TDM_ERRMSG_MAX + 128];
    for (;;) {
        /* one more look after ops->run returned, so a refusal that ended it is reported */
        bool last_round = atomic_load(&w->done);
        char why[TDM_ERRMSG_MAX] = "";
        size_t n_reg;
        tdm_node_link_state_t st = watch_state(w, why, sizeof why, &n_reg);
        if ((int)st != last || n_reg != last_n) {
            last = (int)st;
            last_n = n_reg;
            switch (st) {
            case TDM_NODE_LINK_REGISTERED:
                if (w->n_links > 1)
                    snprintf(msg, sizeof msg,
                             "%sSTATUS=serving, registered with %zu of %zu routers",
                             ready ? "" : "READY=1\n", n_reg, w->n_links);
                else
                    snprintf(msg, sizeof msg, "%sSTATUS=serving, registered with the router at %s",
                             ready ? "" : "READY=1\n", w->router);
                ready = true;
                break;
            case TDM_NODE_LINK_REJECTED:
                snprintf(msg, sizeof msg, "STATUS=refused by the router: %s", why);
                break;
            default:
                snprintf(msg, sizeof msg, "STATUS=%s the router at %s%s",
                         ready ? "lost; registering again with" : "registering with", w->router,
                         w->n_links > 1 ? " and the others" : "");
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

/* The command line. */
typedef struct daemon_args {
    const char *prog;
    const char *config_path, *node_id, *level; /* NULL when not given */
} daemon_args_t;

/* Parses argv into *a. Returns -1 to go on, else the exit status (0 after --help /
 * --version, 2 on a usage error). */
static int parse_args(int argc, char **argv, tdm_node_role_t role, daemon_args_t *a)
{
    static const struct option longopts[] = {
        {"config", required_argument, NULL, 'c'},    {"node-id", required_argument, NULL, 'n'},
        {"log-level", required_argument, NULL, 'l'}, {"help", no_argument, NULL, 'h'},
        {"version", no_argument, NULL, 'V'},         {NULL, 0, NULL, 0},
    };
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "c:n:l:hV", longopts, NULL)) != -1) {
        switch (c) {
        case 'c': a->config_path = optarg; break;
        case 'n': a->node_id = optarg; break;
        case 'l': a->level = optarg; break;
        case 'h': usage(stdout, a->prog, role); return 0;
        case 'V': printf("%s %s\n", a->prog, TANDEM_VERSION); return 0;
        default:
            fprintf(stderr, "%s: unknown option or missing argument '%s' (see --help)\n", a->prog,
                    argv[optind - 1]);
            return 2;
        }
    }
    if (optind != argc) {
        fprintf(stderr, "%s: unexpected argument '%s' (see --help)\n", a->prog, argv[optind]);
        return 2;
    }
    return -1;
}

/* Loads the config (defaults without --config), picks the node and sets up its logger.
 * Returns 0, or 2 (usage or config error, reported; nothing to free). */
static int load_node(const daemon_args_t *a, tdm_node_role_t role, tdm_config_t *cfg,
                     const tdm_node_config_t **node, tdm_logger_t *log)
{
    tdm_error_t err = {0};
    int rc =
        a->config_path ? tdm_config_load_file(a->config_path, cfg, &err) : tdm_config_defaults(cfg);
    if (rc != TDM_OK) {
        fprintf(stderr, "%s: config: %s\n", a->prog, err.msg[0] ? err.msg : tdm_strerror(rc));
        return 2;
    }
    *node = tdm_node_pick(cfg, a->node_id, role, &err);
    if (!*node) {
        fprintf(stderr, "%s: %s\n", a->prog, err.msg);
        tdm_config_free(cfg);
        return 2;
    }
    tdm_log_init(log, (*node)->id);
    log->level = cfg->log.level;
    if (a->level) {
        int lv = tdm_log_level_parse(a->level);
        if (lv < 0) {
            fprintf(stderr, "%s: --log-level: unknown level '%s' (debug, info, warn, error)\n",
                    a->prog, a->level);
            tdm_config_free(cfg);
            return 2;
        }
        log->level = (tdm_log_level_t)lv;
    }
    /* before tdm_node_runtime_open reads the node's keys: a one-host config without keys
     * takes them from the user's key directory */
    char keydir[PATH_MAX];
    if (tdm_keydir_apply(cfg, keydir, sizeof keydir, &err) != TDM_OK) {
        fprintf(stderr, "%s: %s\n", a->prog, err.msg);
        tdm_config_free(cfg);
        return 2;
    }
    if (keydir[0])
        tdm_log_write(log, TDM_LOG_INFO, NULL, NULL, "keys by default: CURVE keys from %s", keydir);
    return 0;
}

/* Process-wide settings of a node daemon: the allocator, SIGTERM/SIGINT, SIGPIPE. */
static void setup_process(void)
{
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
}

/* Runs node obj until a signal, with the readiness watch when a service manager listens.
 * Returns ops->run's status (*err set on failure). */
static int run_watched(const tdm_daemon_ops_t *ops, void *obj, const tdm_config_t *cfg,
                       const tdm_logger_t *log, tdm_error_t *err)
{
    size_t n_eps;
    ready_watch_t watch = {.router = tdm_config_router_endpoints(cfg, &n_eps)[0], .log = log};
    atomic_init(&watch.done, false);
    bool watching = false;
    if (ops->link && tdm_notify_enabled()) {
        while (watch.n_links < TDM_CONFIG_MAX_ROUTERS &&
               (watch.links[watch.n_links] = ops->link(obj, watch.n_links)) != NULL)
            watch.n_links++;
        watching = pthread_create(&watch.thread, NULL, ready_watch_main, &watch) == 0;
        if (!watching)
            TDM_LOG_WARNF(log, NULL, "cannot start the readiness thread: no sd_notify READY=1");
    }
    int rc = ops->run(obj, &g_stop, err);
    if (watching) {
        atomic_store(&watch.done, true);
        pthread_join(watch.thread, NULL);
    }
    tdm_notify_send("STOPPING=1\nSTATUS=stopping");
    return rc;
}

int tdm_daemon_main(int argc, char **argv, const tdm_daemon_ops_t *ops)
{
    daemon_args_t a = {0};
    a.prog = ops->role == TDM_NODE_ROLE_PREFILL ? "tandem-prefill" : "tandem-decode";
    int status = parse_args(argc, argv, ops->role, &a);
    if (status >= 0)
        return status;
    tdm_config_t cfg;
    const tdm_node_config_t *node;
    tdm_logger_t log;
    if ((status = load_node(&a, ops->role, &cfg, &node, &log)) != 0)
        return status;
    setup_process();
    tdm_log_fatal_signals(&log, a.prog);
    status = 1;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(2, &err);
    if (!net) {
        fprintf(stderr, "%s: %s\n", a.prog, err.msg);
        goto out_config;
    }
    tdm_notify_sendf("STATUS=loading the model %s", tdm_config_node_model(&cfg, node)->path);
    void *obj = ops->create(&cfg, node->id, net, &log, &err);
    if (!obj) {
        TDM_LOG_ERRORF(&log, NULL, "cannot start: %s", err.msg);
        fprintf(stderr, "%s: %s\n", a.prog, err.msg);
        status = err.code == TDM_EINVALID || err.code == TDM_ENOTFOUND ? 2 : 1;
        goto out_net;
    }
    if (run_watched(ops, obj, &cfg, &log, &err) != TDM_OK) {
        TDM_LOG_ERRORF(&log, NULL, "stopped: %s", err.msg);
        fprintf(stderr, "%s: %s\n", a.prog, err.msg);
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
