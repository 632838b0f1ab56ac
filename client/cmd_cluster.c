/* cmd_cluster.c - `tandem cluster up|down`: start and stop a whole cluster on this host.
 *
 * `up` starts tandem-router and one tandem-prefill / tandem-decode per node of the config
 * (the default single-host cluster without --config; --model PATH serves another GGUF by
 * handing the daemons $TANDEM_MODEL, the default model path), waits until the router's Status shows
 * every configured node up, prints "cluster ready: ..." and then supervises: Ctrl-C or SIGTERM
 * stops the daemons (SIGTERM, then SIGKILL after the stop timeout), and a daemon that exits on
 * its own stops the others and makes `up` exit 1 naming it. With --detach it writes the pids to
 * a file once the cluster is ready and returns; `down` stops the daemons that file lists.
 *
 * Assumptions: Linux (/proc/self/exe to find the daemons next to this binary, /proc/PID/cmdline
 * to check a pid file still names our daemons, PR_SET_PDEATHSIG so foreground daemons die with
 * this process). Children are started with fork + exec before any ZMQ context exists, and a
 * close-on-exec pipe reports an exec failure back to the parent.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli_common.h"
#include "commands.h"
#include "tandem/client.h"
#include "tandem/config.h"
#include "tandem/gguf.h"

#define CMD_UP "tandem cluster up"
#define CMD_DOWN "tandem cluster down"

#define CLUSTER_DEFAULT_READY_TIMEOUT_S 120.0
#define CLUSTER_DEFAULT_STOP_TIMEOUT_S 10.0
#define CLUSTER_PID_FILE_NAME "tandem-cluster.pids"

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem cluster up [options]\n"
            "       tandem cluster down [--pid-file FILE] [--stop-timeout S]\n"
            "\n"
            "`up` starts tandem-router and a tandem-prefill or tandem-decode per node of the\n"
            "config (without --config: the default single-host cluster, prefill-0 and\n"
            "decode-0), waits until the router reports every node up, prints \"cluster ready\",\n"
            "and stops them all on Ctrl-C or SIGTERM. `down` stops a cluster started with\n"
            "--detach.\n"
            "\n"
            "up:\n"
            "      --config FILE         cluster config (YAML; see docs/operations.md)\n"
            "      --model PATH          serve this GGUF file (default: the config's model.path,\n"
            "                            else $TANDEM_MODEL or the cached SmolLM2); with\n"
            "                            --config only when the config sets no model.path\n"
            "      --bin-dir DIR         where the daemons are (default: next to this binary,\n"
            "                            its build tree's router/, prefill-node/, decode-node/,\n"
            "                            then $PATH)\n"
            "      --log-dir DIR         one log file per daemon (DIR/router.log,\n"
            "                            DIR/NODE-ID.log) instead of stderr\n"
            "      --detach              return once ready, leaving the daemons running\n"
            "      --pid-file FILE       where --detach writes the pids (default\n"
            "                            $XDG_RUNTIME_DIR/" CLUSTER_PID_FILE_NAME
            ", else /tmp/" CLUSTER_PID_FILE_NAME ")\n"
            "      --timeout SECONDS     how long to wait for the cluster to be ready "
            "(default 120)\n"
            "      --stop-timeout S      SIGTERM to SIGKILL grace when stopping (default 10)\n"
            "      --api-key KEY         API key for the router's Status (default: the config's\n"
            "                            first router.api_keys entry, else $TANDEM_API_KEY)\n"
            "down:\n"
            "      --pid-file FILE       the file `up --detach` wrote\n"
            "      --stop-timeout S      SIGTERM to SIGKILL grace (default 10)\n"
            "  -h, --help                this help\n");
}

/* One daemon to run. */
typedef struct daemon_proc {
    const char *binary; /* "tandem-router", "tandem-prefill", "tandem-decode" */
    const char *subdir; /* its folder in a build tree */
    const char *label;  /* "router" or the node id (config-owned) */
    char path[PATH_MAX];
    char *argv[8];
    pid_t pid;   /* 0 = not running */
    int wstatus; /* waitpid status once it has exited */
} daemon_proc_t;

typedef struct cluster {
    daemon_proc_t *d; /* [n]: the router first */
    size_t n;
    size_t n_prefill, n_decode;
    const char *log_dir; /* --log-dir, or NULL (the daemons write to this stderr) */
} cluster_t;

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL); /* a signal cuts it short, which is what the loops want */
}

/* True when snprintf's result n means the text fitted in cap bytes. */
static bool fits(int n, size_t cap)
{
    return n >= 0 && (size_t)n < cap;
}

static bool is_executable(const char *path)
{
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode) && access(path, X_OK) == 0;
}

/* Finds binary: in bin_dir only when given; else next to this executable, in the build tree's
 * ../subdir, then in $PATH. Returns false when not found. */
static bool find_binary(const char *bin_dir, const char *binary, const char *subdir, char *out,
                        size_t cap)
{
    if (bin_dir)
        return fits(snprintf(out, cap, "%s/%s", bin_dir, binary), cap) && is_executable(out);
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (slash) {
            *slash = '\0';
            if (fits(snprintf(out, cap, "%s/%s", self, binary), cap) && is_executable(out))
                return true;
            if (fits(snprintf(out, cap, "%s/../%s/%s", self, subdir, binary), cap) &&
                is_executable(out))
                return true;
        }
    }
    const char *path = getenv("PATH");
    while (path && *path) {
        const char *colon = strchr(path, ':');
        size_t len = colon ? (size_t)(colon - path) : strlen(path);
        if (len > 0 && fits(snprintf(out, cap, "%.*s/%s", (int)len, path, binary), cap) &&
            is_executable(out))
            return true;
        path = colon ? colon + 1 : NULL;
    }
    return false;
}

/* "exited with status 3" / "was killed by signal 9 (Killed)". */
static void describe_wstatus(int ws, char *buf, size_t cap)
{
    if (WIFEXITED(ws))
        snprintf(buf, cap, "exited with status %d", WEXITSTATUS(ws));
    else if (WIFSIGNALED(ws))
        snprintf(buf, cap, "was killed by signal %d (%s)", WTERMSIG(ws), strsignal(WTERMSIG(ws)));
    else
        snprintf(buf, cap, "stopped (wait status %d)", ws);
}

/* Opens DIR/label.log for appending; -1 after printing why. */
static int open_log(const char *log_dir, const char *label)
{
    char path[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s.log", log_dir, label);
    int fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0)
        fprintf(stderr, CMD_UP ": --log-dir: cannot open %s: %s\n", path, strerror(errno));
    return fd;
}

/* In the child after fork: detaches from `up` (--detach) or arranges to die with it, points
 * stdin at /dev/null and stdout/stderr at the log, restores the default signal handlers and
 * execs d; an exec failure's errno goes to pipe_w. Async-signal-safe calls only. */
__attribute__((noreturn)) static void exec_child(const daemon_proc_t *d, int log_fd, int pipe_w,
                                                 bool detach, pid_t parent)
{
    if (detach) {
        setsid(); /* no terminal signals; survives this process */
    } else {
        setpgid(0, 0); /* Ctrl-C reaches `up` only, which stops the daemons in order */
        prctl(PR_SET_PDEATHSIG, SIGTERM);
        if (getppid() != parent)
            _exit(127); /* `up` died before prctl */
    }
    int devnull = open("/dev/null", O_RDONLY);
    if (devnull >= 0) {
        dup2(devnull, STDIN_FILENO);
        close(devnull);
    }
    int out = log_fd >= 0 ? log_fd : STDERR_FILENO;
    dup2(out, STDOUT_FILENO); /* daemons' stdout is log too: keep `up`'s stdout clean */
    dup2(out, STDERR_FILENO);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    execv(d->path, d->argv);
    int e = errno;
    ssize_t w = write(pipe_w, &e, sizeof e);
    (void)w;
    _exit(127);
}

/* In the parent: waits for the close-on-exec pipe to close (exec succeeded) or to carry the
 * child's errno (exec failed; the child is reaped). Returns 0, or 1 after printing why. */
static int await_exec(const daemon_proc_t *d, pid_t pid, int pipe_r)
{
    int child_errno = 0;
    ssize_t got;
    do
        got = read(pipe_r, &child_errno, sizeof child_errno);
    while (got < 0 && errno == EINTR);
    close(pipe_r);
    if (got == (ssize_t)sizeof child_errno) {
        waitpid(pid, NULL, 0);
        fprintf(stderr, CMD_UP ": cannot run %s: %s\n", d->path, strerror(child_errno));
        return 1;
    }
    return 0;
}

/* Starts d: fork, then in the child redirect stdio and exec. Returns 0, or 1 after printing
 * why (exec failures come back through a close-on-exec pipe). */
static int spawn(daemon_proc_t *d, const char *log_dir, bool detach)
{
    int log_fd = -1;
    if (log_dir && (log_fd = open_log(log_dir, d->label)) < 0)
        return 1;
    int status = 1;
    int pipefd[2];
    if (pipe(pipefd) != 0 || fcntl(pipefd[0], F_SETFD, FD_CLOEXEC) != 0 ||
        fcntl(pipefd[1], F_SETFD, FD_CLOEXEC) != 0) {
        fprintf(stderr, CMD_UP ": pipe: %s\n", strerror(errno));
        goto out_close_log;
    }
    pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        fprintf(stderr, CMD_UP ": fork: %s\n", strerror(errno));
        close(pipefd[0]);
        close(pipefd[1]);
        goto out_close_log;
    }
    if (pid == 0)
        exec_child(d, log_fd, pipefd[1], detach, parent);
    close(pipefd[1]);
    status = await_exec(d, pid, pipefd[0]);
    if (status == 0)
        d->pid = pid;
out_close_log:
    if (log_fd >= 0)
        close(log_fd);
    return status;
}

/* Reaps children that exited; returns the first daemon that did (NULL if none). */
static daemon_proc_t *reap(cluster_t *cl)
{
    daemon_proc_t *first = NULL;
    for (size_t i = 0; i < cl->n; i++) {
        daemon_proc_t *d = &cl->d[i];
        if (d->pid <= 0)
            continue;
        int ws;
        pid_t r = waitpid(d->pid, &ws, WNOHANG);
        if (r == d->pid) {
            d->wstatus = ws;
            d->pid = -d->pid; /* keep the number for messages */
            if (!first)
                first = d;
        }
    }
    return first;
}

/* SIGTERM to every running daemon, wait up to stop_timeout_s, then SIGKILL. Returns the number
 * of daemons that had to be killed. */
static int stop_all(cluster_t *cl, double stop_timeout_s)
{
    for (size_t i = 0; i < cl->n; i++)
        if (cl->d[i].pid > 0)
            kill(cl->d[i].pid, SIGTERM);
    double end = tdm_time_now() + stop_timeout_s;
    for (;;) {
        reap(cl);
        size_t running = 0;
        for (size_t i = 0; i < cl->n; i++)
            running += cl->d[i].pid > 0;
        if (running == 0)
            return 0;
        if (tdm_time_now() >= end)
            break;
        sleep_ms(50);
    }
    int killed = 0;
    for (size_t i = 0; i < cl->n; i++) {
        daemon_proc_t *d = &cl->d[i];
        if (d->pid <= 0)
            continue;
        fprintf(stderr, "tandem cluster: %s (%s, pid %d) did not stop within %g s: SIGKILL\n",
                d->binary, d->label, (int)d->pid, stop_timeout_s);
        kill(d->pid, SIGKILL);
        int ws;
        while (waitpid(d->pid, &ws, 0) < 0 && errno == EINTR)
            ;
        d->wstatus = ws;
        d->pid = -d->pid;
        killed++;
    }
    return killed;
}

/* The default pid file: $XDG_RUNTIME_DIR/tandem-cluster.pids, else /tmp/. */
static void default_pid_file(char *buf, size_t cap)
{
    const char *dir = getenv("XDG_RUNTIME_DIR");
    snprintf(buf, cap, "%s/%s", dir && dir[0] ? dir : "/tmp", CLUSTER_PID_FILE_NAME);
}

/* True when pid is alive (not a zombie) and its argv[0] or argv[1] (an interpreter's script)
 * has the file name `binary`: a pid file's entry still names our daemon, not a reused pid. */
static bool pid_is_daemon(pid_t pid, const char *binary)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f)
        return false;
    char stat[512];
    size_t n = fread(stat, 1, sizeof stat - 1, f);
    fclose(f);
    stat[n] = '\0';
    const char *rp = strrchr(stat, ')'); /* "pid (comm) S ..." */
    if (!rp || rp[1] != ' ' || rp[2] == 'Z' || rp[2] == 'X')
        return false;
    snprintf(path, sizeof path, "/proc/%d/cmdline", (int)pid);
    f = fopen(path, "r");
    if (!f)
        return false;
    char cmdline[4096];
    n = fread(cmdline, 1, sizeof cmdline - 1, f);
    fclose(f);
    cmdline[n] = '\0';
    const char *arg = cmdline;
    for (int i = 0; i < 2 && arg < cmdline + n; i++) {
        const char *base = strrchr(arg, '/');
        base = base ? base + 1 : arg;
        if (strcmp(base, binary) == 0)
            return true;
        arg += strlen(arg) + 1;
    }
    return false;
}

/* One line of a pid file: "PID BINARY LABEL". */
typedef struct pid_entry {
    pid_t pid;
    char binary[64];
    char label[TDM_NODE_ID_MAX + 1];
} pid_entry_t;

/* Reads the pid file into *out (caller frees). Returns 0, 1 when it does not exist, 2 when it
 * is malformed (message printed). */
static int read_pid_file(const char *cmd, const char *path, pid_entry_t **out, size_t *n_out)
{
    *out = NULL;
    *n_out = 0;
    FILE *f = fopen(path, "r");
    if (!f)
        return 1;
    pid_entry_t *v = NULL;
    size_t n = 0, cap = 0;
    char line[256];
    int lineno = 0, rc = 0;
    while (fgets(line, sizeof line, f)) {
        lineno++;
        if (line[0] == '#' || line[0] == '\n')
            continue;
        pid_entry_t e = {0};
        int pid;
        if (sscanf(line, "%d %63s %63s", &pid, e.binary, e.label) != 3 || pid <= 1) {
            fprintf(stderr, "%s: %s:%d: expected \"PID BINARY LABEL\"\n", cmd, path, lineno);
            rc = 2;
            break;
        }
        e.pid = pid;
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            pid_entry_t *nv = realloc(v, cap * sizeof *nv);
            if (!nv) {
                rc = 2;
                fprintf(stderr, "%s: out of memory\n", cmd);
                break;
            }
            v = nv;
        }
        v[n++] = e;
    }
    fclose(f);
    if (rc != 0) {
        free(v);
        return rc;
    }
    *out = v;
    *n_out = n;
    return 0;
}

/* Writes the pid file atomically (a temporary file renamed over it). */
static int write_pid_file(const char *path, const cluster_t *cl)
{
    char tmp[PATH_MAX];
    if (!fits(snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()), sizeof tmp)) {
        fprintf(stderr, CMD_UP ": --pid-file: the path is too long\n");
        return 1;
    }
    FILE *f = fopen(tmp, "w");
    if (!f) {
        fprintf(stderr, CMD_UP ": --pid-file: cannot write %s: %s\n", tmp, strerror(errno));
        return 1;
    }
    fprintf(f, "# tandem cluster up --detach: PID BINARY LABEL\n");
    for (size_t i = 0; i < cl->n; i++)
        fprintf(f, "%d %s %s\n", (int)cl->d[i].pid, cl->d[i].binary, cl->d[i].label);
    if (fclose(f) != 0 || rename(tmp, path) != 0) {
        fprintf(stderr, CMD_UP ": --pid-file: cannot write %s: %s\n", path, strerror(errno));
        unlink(tmp);
        return 1;
    }
    return 0;
}

/* True when the pid file lists a daemon that is still running. */
static bool pid_file_live(const char *path)
{
    pid_entry_t *v;
    size_t n;
    if (read_pid_file(CMD_UP, path, &v, &n) != 0)
        return false;
    bool live = false;
    for (size_t i = 0; i < n; i++)
        live |= pid_is_daemon(v[i].pid, v[i].binary);
    free(v);
    return live;
}

/* The endpoint a client connects to for a bound endpoint: "*" and 0.0.0.0 become 127.0.0.1. */
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

/* With --log-dir, where the reason of a daemon's exit is: its log's path and last line. */
static void print_log_tail(const char *log_dir, const char *label)
{
    char path[PATH_MAX], line[1024], last[1024] = "";
    snprintf(path, sizeof path, "%s/%s.log", log_dir, label);
    FILE *f = fopen(path, "r");
    if (!f)
        return;
    while (fgets(line, sizeof line, f))
        if (line[0] != '\n')
            snprintf(last, sizeof last, "%s", line);
    fclose(f);
    last[strcspn(last, "\n")] = '\0';
    fprintf(stderr, "tandem cluster: its log %s ends: %s\n", path, last[0] ? last : "(empty)");
}

/* When a daemon has exited (`when`: "before the cluster was ready", "unexpectedly"), says so
 * (with the last line of its log under --log-dir) and returns true. */
static bool daemon_gone(cluster_t *cl, const char *when)
{
    daemon_proc_t *gone = reap(cl);
    if (!gone)
        return false;
    char why[96];
    describe_wstatus(gone->wstatus, why, sizeof why);
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
        sleep_ms(250);
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
        if (!find_binary(o->bin_dir, d->binary, d->subdir, d->path, sizeof d->path)) {
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
        TDM_CLI_OPT_STR("config", 0, &o->config_path),
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
    const tdm_cli_spec_t spec = {CMD_UP, usage, NULL, opts};
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
    if (pid_file_live(pid_file)) {
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
    if (rc == TDM_OK)
        return 0;
    fprintf(stderr, CMD_UP ": %s\n",
            err.msg[0] ? err.msg : "cannot form the default config (is $HOME set?)");
    return o->config_path ? 2 : 1;
}

/* Starts the daemons in order, the router first. Returns 0, or the exit status (1, or 128 +
 * the signal when interrupted) after printing why; the caller stops those that started. */
static int start_all(cluster_t *cl, const up_opts_t *o)
{
    for (size_t i = 0; i < cl->n; i++) {
        if (*tdm_cli_interrupt_flag())
            return 128 + tdm_cli_interrupt_signal();
        if (spawn(&cl->d[i], o->log_dir, o->detach) != 0)
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
        sleep_ms(200);
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
    status = write_pid_file(pid_file, &cl);
    if (status != 0)
        goto out_stop;
    fprintf(stderr,
            "tandem cluster: detached; pids in %s (`tandem cluster down%s%s` stops "
            "them)\n",
            pid_file, o->pid_file ? " --pid-file " : "", o->pid_file ? o->pid_file : "");
    goto out_free;
out_stop:
    stop_all(&cl, o->stop_timeout_s);
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
    if (!fits(path[0] == '/' ? snprintf(abs, PATH_MAX, "%s", path)
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
 * left model.path out (or names the same file). Returns 0, or 2 after printing the conflict. */
static int check_model_path(const up_opts_t *o, const tdm_config_t *cfg, const char *abs)
{
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

static int cluster_up(int argc, char **argv)
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
        default_pid_file(pid_file, sizeof pid_file);
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
static size_t signal_daemons(const pid_entry_t *v, size_t n, bool *live)
{
    size_t n_signalled = 0;
    for (size_t i = 0; i < n; i++) {
        if (!pid_is_daemon(v[i].pid, v[i].binary)) {
            fprintf(stderr, "tandem cluster: %s (%s, pid %d) is not running\n", v[i].binary,
                    v[i].label, (int)v[i].pid);
            continue;
        }
        if (kill(v[i].pid, SIGTERM) == 0) {
            live[i] = true;
            n_signalled++;
        } else {
            fprintf(stderr, "tandem cluster: cannot signal %s (pid %d): %s\n", v[i].binary,
                    (int)v[i].pid, strerror(errno));
        }
    }
    return n_signalled;
}

/* Waits up to stop_timeout_s for the signalled daemons to end, then SIGKILLs the rest.
 * Returns how many were killed. */
static size_t await_daemons(const pid_entry_t *v, size_t n, bool *live, double stop_timeout_s)
{
    double end = tdm_time_now() + stop_timeout_s;
    size_t killed = 0;
    for (;;) {
        size_t running = 0;
        for (size_t i = 0; i < n; i++)
            if (live[i]) {
                live[i] = pid_is_daemon(v[i].pid, v[i].binary);
                running += live[i];
            }
        if (running == 0)
            return killed;
        if (tdm_time_now() >= end)
            break;
        sleep_ms(50);
    }
    for (size_t i = 0; i < n; i++)
        if (live[i]) {
            fprintf(stderr, "tandem cluster: %s (%s, pid %d) did not stop within %g s: SIGKILL\n",
                    v[i].binary, v[i].label, (int)v[i].pid, stop_timeout_s);
            kill(v[i].pid, SIGKILL);
            killed++;
        }
    return killed;
}

/* Stops the daemons of the pid file and removes it. Returns the exit status. */
static int stop_detached(const char *pid_file, bool default_file, double stop_timeout_s)
{
    pid_entry_t *v;
    size_t n;
    int rc = read_pid_file(CMD_DOWN, pid_file, &v, &n);
    if (rc == 1) {
        fprintf(stderr, CMD_DOWN ": no pid file %s (was the cluster started with --detach%s?)\n",
                pid_file, default_file ? " and the default --pid-file" : "");
        return 1;
    }
    if (rc != 0)
        return 1;
    bool *live = calloc(n ? n : 1, sizeof *live);
    if (!live) {
        free(v);
        fprintf(stderr, CMD_DOWN ": out of memory\n");
        return 1;
    }
    size_t n_signalled = signal_daemons(v, n, live);
    size_t killed = await_daemons(v, n, live, stop_timeout_s);
    int status = 0;
    if (unlink(pid_file) != 0) {
        fprintf(stderr, CMD_DOWN ": cannot remove %s: %s\n", pid_file, strerror(errno));
        status = 1;
    }
    printf("cluster stopped: %zu daemons signalled, %zu killed\n", n_signalled, killed);
    free(live);
    free(v);
    return status;
}

static int cluster_down(int argc, char **argv)
{
    const char *pid_file_opt = NULL;
    double stop_timeout_s = CLUSTER_DEFAULT_STOP_TIMEOUT_S;
    const tdm_cli_opt_t opts[] = {
        TDM_CLI_OPT_STR("pid-file", 0, &pid_file_opt),
        TDM_CLI_OPT_DOUBLE("stop-timeout", 0, &stop_timeout_s, 0, 3600),
        TDM_CLI_OPT_END,
    };
    const tdm_cli_spec_t spec = {CMD_DOWN, usage, NULL, opts};
    bool done;
    int status = tdm_cli_parse(&spec, argc, argv, &done);
    if (done)
        return status;
    if (optind != argc) {
        fprintf(stderr, CMD_DOWN ": unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    char pid_file[PATH_MAX];
    if (pid_file_opt)
        snprintf(pid_file, sizeof pid_file, "%s", pid_file_opt);
    else
        default_pid_file(pid_file, sizeof pid_file);
    return stop_detached(pid_file, !pid_file_opt, stop_timeout_s);
}

int tdm_cmd_cluster(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        usage(stdout);
        return 0;
    }
    char name[64];
    if (strcmp(argv[1], "up") == 0 || strcmp(argv[1], "down") == 0) {
        /* getopt names the program by argv[0]: "tandem cluster up: ..." */
        snprintf(name, sizeof name, "tandem cluster %s", argv[1]);
        argv[1] = name;
        return strcmp(name, CMD_UP) == 0 ? cluster_up(argc - 1, argv + 1)
                                         : cluster_down(argc - 1, argv + 1);
    }
    fprintf(stderr, "tandem cluster: unknown subcommand '%s' (up or down)\n\n", argv[1]);
    usage(stderr);
    return 2;
}
