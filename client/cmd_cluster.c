/* cmd_cluster.c - `tandem cluster up|down`: start and stop a whole cluster on this host. This
 * file holds the usage, the dispatch and `down`; `up` is in cmd_cluster_up.c, starting,
 * reaping and stopping the daemons and the pid file in cmd_cluster_proc.c (cmd_cluster.h).
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
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

#include "cli_common.h"
#include "cmd_cluster.h"
#include "commands.h"

void tdm_cluster_usage(FILE *out)
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
            "  -c, --config FILE         cluster config (YAML; see docs/operations.md)\n"
            "      --model PATH          serve this GGUF file (default: the config's model.path,\n"
            "                            else $TANDEM_MODEL or the cached SmolLM2); with\n"
            "                            --config only when the config sets no model.path\n"
            "                            (not with a models: list of several)\n"
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

static size_t signal_daemons(const pid_entry_t *v, size_t n, bool *live)
{
    size_t n_signalled = 0;
    for (size_t i = 0; i < n; i++) {
        if (!tdm_cluster_pid_is_daemon(v[i].pid, v[i].binary)) {
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
                live[i] = tdm_cluster_pid_is_daemon(v[i].pid, v[i].binary);
                running += live[i];
            }
        if (running == 0)
            return killed;
        if (tdm_time_now() >= end)
            break;
        tdm_cluster_sleep_ms(50);
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
    int rc = tdm_cluster_read_pid_file(CMD_DOWN, pid_file, &v, &n);
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
    const tdm_cli_spec_t spec = {CMD_DOWN, tdm_cluster_usage, NULL, opts};
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
        tdm_cluster_default_pid_file(pid_file, sizeof pid_file);
    return stop_detached(pid_file, !pid_file_opt, stop_timeout_s);
}

int tdm_cmd_cluster(int argc, char **argv)
{
    if (argc < 2) {
        tdm_cluster_usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "--help") == 0) {
        tdm_cluster_usage(stdout);
        return 0;
    }
    char name[64];
    if (strcmp(argv[1], "up") == 0 || strcmp(argv[1], "down") == 0) {
        /* getopt names the program by argv[0]: "tandem cluster up: ..." */
        snprintf(name, sizeof name, "tandem cluster %s", argv[1]);
        argv[1] = name;
        return strcmp(name, CMD_UP) == 0 ? tdm_cluster_up(argc - 1, argv + 1)
                                         : cluster_down(argc - 1, argv + 1);
    }
    fprintf(stderr, "tandem cluster: unknown subcommand '%s' (up or down)\n\n", argv[1]);
    tdm_cluster_usage(stderr);
    return 2;
}
