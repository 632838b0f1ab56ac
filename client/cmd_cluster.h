/* cmd_cluster.h - what `tandem cluster`'s files share: the daemons of a cluster, starting and
 * stopping them (cmd_cluster_proc.c), the pid file of a detached cluster, and `up`
 * (cmd_cluster_up.c). */
#ifndef TANDEM_CLIENT_CMD_CLUSTER_H
#define TANDEM_CLIENT_CMD_CLUSTER_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/types.h>

#include "tandem/config.h"

#define CMD_UP "tandem cluster up"
#define CMD_DOWN "tandem cluster down"

#define CLUSTER_DEFAULT_READY_TIMEOUT_S 120.0
#define CLUSTER_DEFAULT_STOP_TIMEOUT_S 10.0
#define CLUSTER_PID_FILE_NAME "tandem-cluster.pids"

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

/* One line of a pid file: "PID BINARY LABEL". */
typedef struct pid_entry {
    pid_t pid;
    char binary[64];
    char label[TDM_NODE_ID_MAX + 1];
} pid_entry_t;

/* Prints the usage of `tandem cluster` to out. Cannot fail. */
void tdm_cluster_usage(FILE *out);

/* `tandem cluster up` (cmd_cluster_up.c): argv[0] is "up". Returns the exit status. */
int tdm_cluster_up(int argc, char **argv);

/* ---- processes and pid files (cmd_cluster_proc.c) ---- */

/* Sleeps ms milliseconds, or less when a signal comes (which is what the wait loops want). */
void tdm_cluster_sleep_ms(long ms);

/* True when snprintf's result n means the text fitted in cap bytes. */
bool tdm_cluster_fits(int n, size_t cap);

/* Finds binary: in bin_dir only when given; else next to this executable, in the build tree's
 * ../subdir, then in $PATH. Returns false when not found. */
bool tdm_cluster_find_binary(const char *bin_dir, const char *binary, const char *subdir, char *out,
                             size_t cap);

/* "exited with status 3" / "was killed by signal 9 (Killed)". */
void tdm_cluster_describe_wstatus(int ws, char *buf, size_t cap);

/* Starts d: fork, then in the child redirect stdio and exec. Returns 0, or 1 after printing
 * why (exec failures come back through a close-on-exec pipe). */
int tdm_cluster_spawn(daemon_proc_t *d, const char *log_dir, bool detach);

/* Reaps children that exited; returns the first daemon that did (NULL if none). */
daemon_proc_t *tdm_cluster_reap(cluster_t *cl);

/* SIGTERM to every running daemon, wait up to stop_timeout_s, then SIGKILL. Returns the number
 * of daemons that had to be killed. */
int tdm_cluster_stop_all(cluster_t *cl, double stop_timeout_s);

/* The default pid file: $XDG_RUNTIME_DIR/tandem-cluster.pids, else /tmp/. */
void tdm_cluster_default_pid_file(char *buf, size_t cap);

/* True when pid is alive (not a zombie) and its argv[0] or argv[1] (an interpreter's script)
 * has the file name `binary`: a pid file's entry still names our daemon, not a reused pid. */
bool tdm_cluster_pid_is_daemon(pid_t pid, const char *binary);

/* Reads the pid file into *out (caller frees). Returns 0, 1 when it does not exist, 2 when it
 * is malformed (message printed). */
int tdm_cluster_read_pid_file(const char *cmd, const char *path, pid_entry_t **out, size_t *n_out);

/* Writes the pid file atomically (a temporary file renamed over it). */
int tdm_cluster_write_pid_file(const char *path, const cluster_t *cl);

/* True when the pid file lists a daemon that is still running. */
bool tdm_cluster_pid_file_live(const char *path);

#endif
