/* cmd_cluster_up.c - `tandem cluster up`: the options, the plan of daemons from the config, the
 * checks before starting (model path, host, free endpoints, a live pid file), waiting until the
 * router's Status shows every node up, and supervising the daemons until a signal or one of
 * them exits. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "cli_common.h"
#include "cmd_cluster.h"
#include "commands.h"
#include "tandem/client.h"
#include "tandem/config.h"
#include "tandem/gguf.h"
#include "tandem/node_keys.h"

static void client_endpoint_for(const char *bound, char *buf, size_t cap)
{
    const char *star = strstr(bound, "://*:");
    const char *any = strstr(bound, "://0.0.0.0:");
    if (star)
        snprintf(buf, cap, "%.*s://127.0.0.1:%s", (int)(star - bound), bound, star + 5);
    else if (any)
        snprintf(buf, cap, "%.*s://127.0.0.1:%s", (int)(any - bound), bound, any + 11);
    else
        snprintf(buf, cap, "%s", bound);
}

/* The text of b ("" before the first append or after running out of memory at once). */
static const char *buf_text(const tdm_buf_t *b)
{
    return b->data ? b->data : "";
}

/* Writes "prefill-0 up, decode-0 down" for the configured nodes into out (emptied first);
 * returns how many are up. */
static size_t describe_nodes(const tdm_config_t *cfg, const tdm_client_cluster_status_t *st,
                             tdm_buf_t *out)
{
    size_t up = 0;
    tdm_buf_clear(out);
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        const tdm_client_node_status_t *ns =
            st ? tdm_client_status_find_node(st, cfg->nodes[i].id) : NULL;
        bool is_up = ns && ns->up;
        up += is_up;
        tdm_buf_printf(out, "%s%s %s", i ? ", " : "", cfg->nodes[i].id,
                       is_up ? "up"
                       : ns  ? "down"
                             : "not registered");
    }
    return up;
}

typedef struct up_opts {
    const char *config_path, *bin_dir, *log_dir, *pid_file, *api_key, *model;
    bool detach;
    double timeout_s, stop_timeout_s;
} up_opts_t;

/* Whether a log line says why a daemon failed: a structured line of level error or fatal, or
 * a daemon's own stderr line ("tandem-router: ..."), which is how a start-up error is told. */
static bool log_line_is_error(const char *line)
{
    return strstr(line, "level=error") || strstr(line, "level=fatal") ||
           strncmp(line, "tandem-", 7) == 0;
}

/* With --log-dir, where the reason of a daemon's exit is: its log's path and its last error
 * line (the shutdown lines logged after an error would hide it), else its last line. */
static void print_log_tail(const char *log_dir, const char *label)
{
    char path[PATH_MAX], line[1024], last[1024] = "", last_error[1024] = "";
    snprintf(path, sizeof path, "%s/%s.log", log_dir, label);
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '\n')
            continue;
        snprintf(last, sizeof last, "%s", line);
        if (log_line_is_error(line))
            snprintf(last_error, sizeof last_error, "%s", line);
    }
    fclose(f);
    const char *shown = last_error[0] ? last_error : last;
    fprintf(stderr, "tandem cluster: its log %s %s: %.*s\n", path, last_error[0] ? "says" : "ends",
            (int)strcspn(shown, "\n"), shown[0] ? shown : "(empty)");
}

/* When a daemon has exited (`when`: "before the cluster was ready", "unexpectedly"), says so
 * (with the last line of its log under --log-dir) and returns true. */
static bool daemon_gone(cluster_t *cl, const char *when)
{
    daemon_proc_t *gone = tdm_cluster_reap(cl);
    if (!gone)
        return false;
    char why[96];
    tdm_cluster_describe_wstatus(gone->wstatus, why, sizeof why);
    fprintf(stderr, "tandem cluster: %s (%s, pid %d) %s %s; stopping the others\n", gone->binary,
            gone->label, (int)-gone->pid, why, when);
    if (cl->log_dir)
        print_log_tail(cl->log_dir, gone->label);
    return true;
}

/* One look at the router's Status (waiting at most `left` seconds, within [0.05, 1]): returns
 * 1 when every configured node is up, 0 to keep waiting (desc says what is missing), -1 to
 * give up (*status set; message printed unless interrupted). */
static int check_ready(tdm_client_t *client, const tdm_config_t *cfg, const char *endpoint,
                       double left, tdm_buf_t *desc, int *status)
{
    tdm_client_cluster_status_t st;
    int rc = tdm_client_status(client, left < 1.0 ? (left > 0.05 ? left : 0.05) : 1.0, &st);
    if (rc == TDM_OK) {
        size_t up = describe_nodes(cfg, &st, desc);
        tdm_client_cluster_status_clear(&st);
        if (up < cfg->n_nodes)
            return 0;
        *status = 0;
        return 1;
    }
    if (rc == TDM_EDEADLINE) {
        tdm_buf_clear(desc);
        tdm_buf_printf(desc, "waiting for the router at %s", endpoint);
        return 0;
    }
    if (rc == TDM_ECANCELLED) {
        *status = 128 + tdm_cli_interrupt_signal();
        return -1;
    }
    fprintf(stderr, CMD_UP ": router status: %s (%s)%s\n", tdm_client_errmsg(client),
            tdm_status_name(rc), rc == TDM_EUNAUTHENTICATED ? "; give the key with --api-key" : "");
    *status = 1;
    return -1;
}

/* Waits until the router reports every configured node up. Returns 0 when ready, 1 on
 * failure or timeout (message printed), 128 + the signal when interrupted (130: SIGINT,
 * 143: SIGTERM). */
static int wait_ready(cluster_t *cl, const tdm_config_t *cfg, const char *endpoint,
                      const char *api_key, double timeout_s)
{
    tdm_client_opts_t co = {0};
    co.api_key = api_key;
    co.cancel_flag = tdm_cli_interrupt_flag();
    tdm_error_t err = {0};
    tdm_client_t *client = tdm_client_new(endpoint, &co, &err);
    if (!client) {
        fprintf(stderr, CMD_UP ": router.client_endpoint %s: %s\n", endpoint, err.msg);
        return 1;
    }
    int status = 1;
    double start = tdm_time_now(), next_note = start + 10;
    tdm_buf_t last = TDM_BUF_INIT, desc = TDM_BUF_INIT; /* what was said, what is now */
    while (!daemon_gone(cl, "before the cluster was ready")) {
        if (*tdm_cli_interrupt_flag()) {
            status = 128 + tdm_cli_interrupt_signal();
            break;
        }
        double left = start + timeout_s - tdm_time_now();
        if (check_ready(client, cfg, endpoint, left, &desc, &status) != 0)
            break;
        double t = tdm_time_now();
        if (strcmp(buf_text(&desc), buf_text(&last)) != 0 || t >= next_note) {
            fprintf(stderr, "tandem cluster: waiting for the nodes: %s (%.0f s)\n", buf_text(&desc),
                    t - start);
            tdm_buf_clear(&last);
            tdm_buf_puts(&last, buf_text(&desc));
            next_note = t + 10;
        }
        if (t - start >= timeout_s) {
            fprintf(stderr, CMD_UP ": the cluster was not ready within %g s: %s\n", timeout_s,
                    buf_text(&desc));
            break;
        }
        tdm_cluster_sleep_ms(250);
    }
    tdm_buf_free(&last);
    tdm_buf_free(&desc);
    tdm_client_destroy(&client);
    return status;
}

/* Builds the daemon list from the config. Returns 0, or 1 after printing what is missing. */
static int plan(cluster_t *cl, const tdm_config_t *cfg, const up_opts_t *o)
{
    cl->d = calloc(cfg->n_nodes + 1, sizeof *cl->d);
    if (!cl->d) {
        fprintf(stderr, CMD_UP ": out of memory\n");
        return 1;
    }
    daemon_proc_t *r = &cl->d[cl->n++];
    r->binary = "tandem-router";
    r->subdir = "router";
    r->label = "router";
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        daemon_proc_t *d = &cl->d[cl->n++];
        bool prefill = cfg->nodes[i].role == TDM_NODE_ROLE_PREFILL;
        d->binary = prefill ? "tandem-prefill" : "tandem-decode";
        d->subdir = prefill ? "prefill-node" : "decode-node";
        d->label = cfg->nodes[i].id;
        cl->n_prefill += prefill;
        cl->n_decode += !prefill;
    }
    for (size_t i = 0; i < cl->n; i++) {
        daemon_proc_t *d = &cl->d[i];
        if (!tdm_cluster_find_binary(o->bin_dir, d->binary, d->subdir, d->path, sizeof d->path)) {
            if (o->bin_dir)
                fprintf(stderr, CMD_UP ": %s not found in --bin-dir %s\n", d->binary, o->bin_dir);
            else
                fprintf(stderr,
                        CMD_UP ": %s not found next to this tandem binary, in its build tree "
                               "(../%s) or in $PATH; build it or give --bin-dir\n",
                        d->binary, d->subdir);
            return 1;
        }
        size_t k = 0;
        d->argv[k++] = d->path;
        if (o->config_path) {
            d->argv[k++] = "--config";
            d->argv[k++] = (char *)(uintptr_t)o->config_path;
        }
        if (i > 0) {
            d->argv[k++] = "--node-id";
            d->argv[k++] = (char *)(uintptr_t)d->label;
        }
        d->argv[k] = NULL;
    }
    return 0;
}

/* Parses `up`'s options into *o (--pid-file needs --detach). Returns 0 to go on, or the exit
 * status with *done set (0 after --help, 2 for bad usage, message printed). */
static int parse_up(int argc, char **argv, up_opts_t *o, bool *done)
{
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("config", 'c', &o->config_path),
        TDM_CLI_OPT_STR("model", 0, &o->model),
        TDM_CLI_OPT_STR("bin-dir", 0, &o->bin_dir),
        TDM_CLI_OPT_STR("log-dir", 0, &o->log_dir),
        TDM_CLI_OPT_TRUE("detach", 0, &o->detach),
        TDM_CLI_OPT_STR("pid-file", 0, &o->pid_file),
        TDM_CLI_OPT_DOUBLE("timeout", 0, &o->timeout_s, 0.1, 86400),
        TDM_CLI_OPT_DOUBLE("stop-timeout", 0, &o->stop_timeout_s, 0, 3600),
        TDM_CLI_OPT_STR("api-key", 0, &o->api_key),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {CMD_UP, tdm_cluster_usage, NULL, opts};
    o->timeout_s = CLUSTER_DEFAULT_READY_TIMEOUT_S;
    o->stop_timeout_s = CLUSTER_DEFAULT_STOP_TIMEOUT_S;
    int status = tdm_cli_parse(&spec, argc, argv, done);
    if (*done)
        return status;
    *done = true;
    if (optind != argc) {
        fprintf(stderr, CMD_UP ": unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    if (o->pid_file && !o->detach) {
        fprintf(stderr, CMD_UP ": --pid-file needs --detach\n");
        return 2;
    }
    *done = false;
    return 0;
}

/* Checks the host before starting anything: no detached cluster still running from pid_file,
 * --bin-dir is a folder, --log-dir exists or is made. Returns 0, or the exit status after
 * printing why. */
static int check_host(const up_opts_t *o, const char *pid_file)
{
    if (tdm_cluster_pid_file_live(pid_file)) {
        fprintf(stderr,
                CMD_UP ": a detached cluster is running (pids in %s); stop it with "
                       "`tandem cluster down%s%s` first\n",
                pid_file, o->pid_file ? " --pid-file " : "", o->pid_file ? o->pid_file : "");
        return 1;
    }
    struct stat st;
    if (o->bin_dir && (stat(o->bin_dir, &st) != 0 || !S_ISDIR(st.st_mode))) {
        fprintf(stderr, CMD_UP ": --bin-dir %s is not a directory\n", o->bin_dir);
        return 2;
    }
    if (o->log_dir && mkdir(o->log_dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, CMD_UP ": --log-dir: cannot create %s: %s\n", o->log_dir, strerror(errno));
        return 1;
    }
    return 0;
}

/* Loads --config (or the defaults) into *cfg. Returns 0, or the exit status after printing
 * why (2 for a bad config file). */
static int load_config(const up_opts_t *o, tdm_config_t *cfg)
{
    tdm_error_t err = {0};
    int rc =
        o->config_path ? tdm_config_load_file(o->config_path, cfg, &err) : tdm_config_defaults(cfg);
    if (rc != TDM_OK) {
        fprintf(stderr, CMD_UP ": %s\n",
                err.msg[0] ? err.msg : "cannot form the default config (is $HOME set?)");
        return o->config_path ? 2 : 1;
    }
    /* keys by default: make the pairs before the daemons start (each would make the missing
     * ones too, safely at once), so a key directory with the wrong owner or mode fails here */
    char keydir[PATH_MAX];
    if (tdm_keydir_apply(cfg, keydir, sizeof keydir, &err) != TDM_OK) {
        fprintf(stderr, CMD_UP ": %s\n", err.msg);
        tdm_config_free(cfg);
        return 1;
    }
    if (keydir[0])
        fprintf(stderr, "tandem cluster: keys by default: CURVE keys in %s\n", keydir);
    return 0;
}

/* Starts the daemons in order, the router first. Returns 0, or the exit status (1, or 128 +
 * the signal when interrupted) after printing why; the caller stops those that started. */
static int start_all(cluster_t *cl, const up_opts_t *o)
{
    for (size_t i = 0; i < cl->n; i++) {
        if (*tdm_cli_interrupt_flag())
            return 128 + tdm_cli_interrupt_signal();
        if (tdm_cluster_spawn(&cl->d[i], o->log_dir, o->detach) != 0)
            return 1;
        fprintf(stderr, "tandem cluster: started %s (%s, pid %d)\n", cl->d[i].binary,
                cl->d[i].label, (int)cl->d[i].pid);
    }
    return 0;
}

/* Supervises the running cluster until a signal (returns 0) or a daemon exits (returns 1). */
static int supervise(cluster_t *cl)
{
    for (;;) {
        if (daemon_gone(cl, "unexpectedly"))
            return 1;
        if (*tdm_cli_interrupt_flag()) {
            fprintf(stderr, "tandem cluster: %s: stopping the cluster\n",
                    strsignal(tdm_cli_interrupt_signal()));
            return 0;
        }
        tdm_cluster_sleep_ms(200);
    }
}

/* Whether something on this machine already accepts connections at ep, a tcp://HOST:PORT
 * endpoint of this machine (HOST 127.0.0.1, localhost, * or 0.0.0.0; other hosts are not
 * probed): another cluster's router would then answer the readiness check for this one. */
static bool local_endpoint_in_use(const char *ep)
{
    char host[64];
    unsigned port = 0;
    if (!ep || sscanf(ep, "tcp://%63[^:]:%u", host, &port) != 2 || port == 0 || port > 65535)
        return false;
    if (strcmp(host, "127.0.0.1") != 0 && strcmp(host, "localhost") != 0 &&
        strcmp(host, "*") != 0 && strcmp(host, "0.0.0.0") != 0)
        return false;
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return false;
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool in_use = connect(fd, (struct sockaddr *)&a, sizeof a) == 0;
    close(fd);
    return in_use;
}

/* Refuses to start when the router's endpoints are taken on this machine. Returns 0 or 1
 * (message printed). */
static int check_endpoints_free(const tdm_config_t *cfg)
{
    const char *eps[] = {cfg->router.client_endpoint, cfg->router.node_endpoint};
    const char *names[] = {"router.client_endpoint", "router.node_endpoint"};
    for (size_t i = 0; i < 2; i++)
        if (local_endpoint_in_use(eps[i])) {
            fprintf(stderr,
                    CMD_UP ": %s %s is already in use on this machine (another cluster? "
                           "`tandem cluster down`, or give this one other ports)\n",
                    names[i], eps[i]);
            return 1;
        }
    return 0;
}

/* Starts the cluster of cfg, waits until it is ready, then detaches (writing the pid file) or
 * supervises it and stops it. Returns the exit status. */
static int run_cluster(const up_opts_t *o, const tdm_config_t *cfg, const char *pid_file)
{
    const char *api_key = o->api_key               ? o->api_key
                          : cfg->router.n_api_keys ? cfg->router.api_keys[0]
                                                   : tdm_cli_api_key(NULL);
    char endpoint[512];
    client_endpoint_for(cfg->router.client_endpoint, endpoint, sizeof endpoint);
    cluster_t cl = {0};
    cl.log_dir = o->log_dir;
    int status = check_endpoints_free(cfg);
    if (status == 0)
        status = plan(&cl, cfg, o);
    if (status != 0)
        goto out_free;
    tdm_cli_catch_interrupt(true);
    status = start_all(&cl, o);
    if (status == 0)
        status = wait_ready(&cl, cfg, endpoint, api_key, o->timeout_s);
    if (status != 0)
        goto out_stop;
    printf("cluster ready: router %s, %zu prefill, %zu decode nodes\n", endpoint, cl.n_prefill,
           cl.n_decode);
    fflush(stdout);
    if (!o->detach) {
        status = supervise(&cl);
        goto out_stop;
    }
    status = tdm_cluster_write_pid_file(pid_file, &cl);
    if (status != 0)
        goto out_stop;
    fprintf(stderr,
            "tandem cluster: detached; pids in %s (`tandem cluster down%s%s` stops "
            "them)\n",
            pid_file, o->pid_file ? " --pid-file " : "", o->pid_file ? o->pid_file : "");
    goto out_free;
out_stop:
    tdm_cluster_stop_all(&cl, o->stop_timeout_s);
    if (status != 0 || !o->detach)
        fprintf(stderr, "tandem cluster: stopped\n");
out_free:
    free(cl.d);
    return status;
}

/* --model PATH: checks PATH is a GGUF file and makes its absolute path (abs, PATH_MAX bytes)
 * the default model of this process and of the daemons it starts, through $TANDEM_MODEL:
 * tdm_model_default_path reads it wherever a config leaves model.path out, so every process
 * resolves the same file by the rule it already uses. Returns 0, or the exit status after
 * printing why (2: a bad PATH). */
static int use_model(const char *path, char *abs)
{
    char cwd[PATH_MAX];
    if (path[0] != '/' && !getcwd(cwd, sizeof cwd)) {
        fprintf(stderr, CMD_UP ": --model: cannot get the working directory: %s\n",
                strerror(errno));
        return 1;
    }
    if (!tdm_cluster_fits(path[0] == '/' ? snprintf(abs, PATH_MAX, "%s", path)
                                         : snprintf(abs, PATH_MAX, "%s/%s", cwd, path),
                          PATH_MAX)) {
        fprintf(stderr, CMD_UP ": --model: the path is too long\n");
        return 2;
    }
    tdm_error_t err = {0};
    tdm_gguf_t *g = tdm_gguf_open(abs, &err);
    if (!g) {
        /* "--model PATH: why", the path once (the reader's message may start with it) */
        size_t al = strlen(abs);
        const char *why = strncmp(err.msg, abs, al) == 0 && strncmp(err.msg + al, ": ", 2) == 0
                              ? err.msg + al + 2
                              : err.msg;
        fprintf(stderr, CMD_UP ": --model %s: %s\n", path, why);
        return 2;
    }
    tdm_gguf_destroy(&g);
    if (setenv("TANDEM_MODEL", abs, 1) != 0) {
        fprintf(stderr, CMD_UP ": cannot set TANDEM_MODEL: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}

/* With --model and --config: the config's model path must be --model's file, i.e. the config
 * left model.path out (or names the same file). A config of several models (models:, each
 * with its own path) has no default for --model to fill, so it is refused whatever the file.
 * Returns 0, or 2 after printing the conflict. */
static int check_model_path(const up_opts_t *o, const tdm_config_t *cfg, const char *abs)
{
    if (cfg->n_models > 1) {
        fprintf(stderr,
                CMD_UP ": --model %s: %s serves %zu models (models:), each from its own path:",
                o->model, o->config_path, cfg->n_models);
        for (size_t i = 0; i < cfg->n_models; i++)
            fprintf(stderr, "%s %s (%s)", i ? "," : "", cfg->models[i].name, cfg->models[i].path);
        fprintf(stderr, "; drop --model and change models[].path in the config instead\n");
        return 2;
    }
    struct stat a, b;
    if (strcmp(cfg->model.path, abs) == 0 ||
        (stat(cfg->model.path, &a) == 0 && stat(abs, &b) == 0 && a.st_dev == b.st_dev &&
         a.st_ino == b.st_ino))
        return 0;
    fprintf(stderr,
            CMD_UP ": --model %s conflicts with model.path %s in %s; remove model.path from the "
                   "config or drop --model\n",
            o->model, cfg->model.path, o->config_path);
    return 2;
}

int tdm_cluster_up(int argc, char **argv)
{
    up_opts_t o = {0};
    bool done;
    int status = parse_up(argc, argv, &o, &done);
    if (done)
        return status;
    char pid_file[PATH_MAX];
    if (o.pid_file)
        snprintf(pid_file, sizeof pid_file, "%s", o.pid_file);
    else
        tdm_cluster_default_pid_file(pid_file, sizeof pid_file);
    status = check_host(&o, pid_file);
    char model[PATH_MAX];
    if (status == 0 && o.model)
        status = use_model(o.model, model);
    if (status != 0)
        return status;
    tdm_config_t cfg;
    status = load_config(&o, &cfg);
    if (status != 0)
        return status;
    if (o.model)
        status = check_model_path(&o, &cfg, model);
    if (status == 0)
        status = run_cluster(&o, &cfg, pid_file);
    tdm_config_free(&cfg);
    return status;
}

/* Sends SIGTERM to every daemon of the pid file that still runs, marking them in live[].
 * Returns how many were signalled. */
