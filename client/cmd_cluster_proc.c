/* cmd_cluster_proc.c - the daemons of `tandem cluster`: finding their binaries, starting them
 * (fork + exec, logs, exec failures reported through a close-on-exec pipe), reaping and
 * stopping them (SIGTERM, then SIGKILL after the stop timeout), and the pid file `up --detach`
 * writes and `down` reads.
 *
 * Assumptions: Linux (/proc/self/exe to find the daemons next to this binary, /proc/PID/cmdline
 * to check a pid file still names our daemons, PR_SET_PDEATHSIG so foreground daemons die with
 * this process). Children are started with fork + exec before any ZMQ context exists, and a
 * close-on-exec pipe reports an exec failure back to the parent.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli_common.h"
#include "cmd_cluster.h"
#include "commands.h"

void tdm_cluster_sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL); /* a signal cuts it short, which is what the loops want */
}

/* True when snprintf's result n means the text fitted in cap bytes. */
bool tdm_cluster_fits(int n, size_t cap)
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
bool tdm_cluster_find_binary(const char *bin_dir, const char *binary, const char *subdir, char *out,
                             size_t cap)
{
    if (bin_dir)
        return tdm_cluster_fits(snprintf(out, cap, "%s/%s", bin_dir, binary), cap) &&
               is_executable(out);
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = '\0';
        char *slash = strrchr(self, '/');
        if (slash) {
            *slash = '\0';
            if (tdm_cluster_fits(snprintf(out, cap, "%s/%s", self, binary), cap) &&
                is_executable(out))
                return true;
            if (tdm_cluster_fits(snprintf(out, cap, "%s/../%s/%s", self, subdir, binary), cap) &&
                is_executable(out))
                return true;
        }
    }
    const char *path = getenv("PATH");
    while (path && *path) {
        const char *colon = strchr(path, ':');
        size_t len = colon ? (size_t)(colon - path) : strlen(path);
        if (len > 0 &&
            tdm_cluster_fits(snprintf(out, cap, "%.*s/%s", (int)len, path, binary), cap) &&
            is_executable(out))
            return true;
        path = colon ? colon + 1 : NULL;
    }
    return false;
}

/* "exited with status 3" / "was killed by signal 9 (Killed)". */
void tdm_cluster_describe_wstatus(int ws, char *buf, size_t cap)
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
int tdm_cluster_spawn(daemon_proc_t *d, const char *log_dir, bool detach)
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
daemon_proc_t *tdm_cluster_reap(cluster_t *cl)
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
int tdm_cluster_stop_all(cluster_t *cl, double stop_timeout_s)
{
    for (size_t i = 0; i < cl->n; i++)
        if (cl->d[i].pid > 0)
            kill(cl->d[i].pid, SIGTERM);
    double end = tdm_time_now() + stop_timeout_s;
    for (;;) {
        tdm_cluster_reap(cl);
        size_t running = 0;
        for (size_t i = 0; i < cl->n; i++)
            running += cl->d[i].pid > 0;
        if (running == 0)
            return 0;
        if (tdm_time_now() >= end)
            break;
        tdm_cluster_sleep_ms(50);
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
void tdm_cluster_default_pid_file(char *buf, size_t cap)
{
    const char *dir = getenv("XDG_RUNTIME_DIR");
    snprintf(buf, cap, "%s/%s", dir && dir[0] ? dir : "/tmp", CLUSTER_PID_FILE_NAME);
}

/* True when pid is alive (not a zombie) and its argv[0] or argv[1] (an interpreter's script)
 * has the file name `binary`: a pid file's entry still names our daemon, not a reused pid. */
bool tdm_cluster_pid_is_daemon(pid_t pid, const char *binary)
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

/* Reads the pid file into *out (caller frees). Returns 0, 1 when it does not exist, 2 when it
 * is malformed (message printed). */
int tdm_cluster_read_pid_file(const char *cmd, const char *path, pid_entry_t **out, size_t *n_out)
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
int tdm_cluster_write_pid_file(const char *path, const cluster_t *cl)
{
    char tmp[PATH_MAX];
    if (!tdm_cluster_fits(snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid()),
                          sizeof tmp)) {
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
bool tdm_cluster_pid_file_live(const char *path)
{
    pid_entry_t *v;
    size_t n;
    if (tdm_cluster_read_pid_file(CMD_UP, path, &v, &n) != 0)
        return false;
    bool live = false;
    for (size_t i = 0; i < n; i++)
        live |= tdm_cluster_pid_is_daemon(v[i].pid, v[i].binary);
    free(v);
    return live;
}

/* The endpoint a client connects to for a bound endpoint: "*" and 0.0.0.0 become 127.0.0.1. */
