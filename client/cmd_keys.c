/* cmd_keys.c - `tandem keys generate`: one CURVE key pair for the router and for every node of a
 * cluster config, written as DIR/<id>.key (the Z85 secret, mode 0600) and DIR/<id>.pub (the
 * public key), with the YAML lines that put them into the config. And `tandem keys default`:
 * the keys by default of a one-host config without keys (tdm_keydir_apply), made when missing
 * and listed.
 *
 * Each daemon reads only its own secret key file (DESIGN.md "Security and identity"), so the
 * files can be handed out one per host. Nothing is written unless every file can be: existing
 * files are an error without --force, checked before the first write.
 */
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "commands.h"
#include "tandem/config.h"
#include "tandem/net.h"
#include "tandem/node_keys.h"

#define ROUTER_ID "router" /* file name stem of the router's pair */

static void usage(FILE *out)
{
    fprintf(out,
            "usage: tandem keys generate --config FILE --out DIR [--force]\n"
            "       tandem keys default [--config FILE]\n"
            "\n"
            "default: the keys by default of FILE (without --config, the default cluster):\n"
            "when FILE sets no CURVE keys, security.default_keys is true and every node and\n"
            "KV endpoint is on this host, each daemon takes its pair from the user's key\n"
            "directory ($XDG_STATE_HOME/tandem/keys, else ~/.local/state/tandem/keys, mode\n"
            "0700). This makes the missing pairs, as the daemons would at their first start,\n"
            "and prints the directory and each id's public key; otherwise it says why no keys\n"
            "by default apply.\n"
            "\n"
            "generate:\n"
            "Makes a CURVE key pair for the router and for each node of the cluster config FILE\n"
            "and writes, for each id (\"" ROUTER_ID "\" for the router):\n"
            "  DIR/<id>.key   the secret key (40 Z85 characters), mode 0600: give it to that\n"
            "                 daemon only; it refuses a key file group or others can read\n"
            "  DIR/<id>.pub   the public key\n"
            "DIR is created with mode 0700 when missing. Then it prints the YAML to paste into\n"
            "FILE: router.curve_public_key / curve_secret_key_file, and per node\n"
            "curve_public_key / curve_secret_key_file (the paths as written here; adjust them\n"
            "where the files are installed elsewhere). With the router's key set, CURVE is on\n"
            "for the node and KV channels and every node must have its own pair.\n"
            "\n"
            "options:\n"
            "  -c, --config FILE  the cluster config (see docs/operations.md)\n"
            "  -o, --out DIR      where the key files go\n"
            "  -f, --force        overwrite existing key files\n"
            "  -h, --help         this help\n");
}

static int bad_usage(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int bad_usage(const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "tandem keys: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (see tandem keys --help)\n");
    va_end(ap);
    return 2;
}

/* dir as an absolute path (relative ones joined to the working directory) in out (cap bytes).
 * Returns 0 or prints why and -1. */
static int absolute_dir(const char *dir, char *out, size_t cap)
{
    char cwd[PATH_MAX];
    int n;
    if (dir[0] == '/') {
        n = snprintf(out, cap, "%s", dir);
    } else if (!getcwd(cwd, sizeof cwd)) {
        fprintf(stderr, "tandem keys: cannot tell the working directory: %s\n", strerror(errno));
        return -1;
    } else {
        n = snprintf(out, cap, "%s/%s", cwd, dir);
    }
    if (n < 0 || (size_t)n >= cap) {
        fprintf(stderr, "tandem keys: the path %s is too long\n", dir);
        return -1;
    }
    while (n > 1 && out[n - 1] == '/') /* "keys/" -> "keys" */
        out[--n] = '\0';
    return 0;
}

/* One pair to make: the id names the files. */
typedef struct key_job {
    const char *id;
    char pub_path[PATH_MAX], key_path[PATH_MAX];
    char public_key[41], secret_key[41];
} key_job_t;

/* Makes dir (mode 0700) unless it exists as a directory. Returns 0 or prints why and -1. */
static int make_dir(const char *dir)
{
    struct stat st;
    if (stat(dir, &st) == 0) {
        if (S_ISDIR(st.st_mode))
            return 0;
        fprintf(stderr, "tandem keys: %s exists and is not a directory\n", dir);
        return -1;
    }
    if (mkdir(dir, 0700) != 0) {
        fprintf(stderr, "tandem keys: cannot create %s: %s\n", dir, strerror(errno));
        return -1;
    }
    return 0;
}

/* Writes text + "\n" to path with mode (exactly, whatever the umask or a file overwritten had).
 * Returns 0 or prints why and -1. */
static int write_file(const char *path, const char *text, mode_t mode, bool force)
{
    int fd =
        open(path, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW | (force ? O_TRUNC : O_EXCL), mode);
    if (fd < 0) {
        fprintf(stderr, "tandem keys: cannot write %s: %s\n", path, strerror(errno));
        return -1;
    }
    size_t n = strlen(text);
    bool ok = fchmod(fd, mode) == 0 && write(fd, text, n) == (ssize_t)n && write(fd, "\n", 1) == 1;
    int e = errno;
    if (close(fd) != 0 && ok) {
        ok = false;
        e = errno;
    }
    if (!ok) {
        fprintf(stderr, "tandem keys: writing %s failed: %s\n", path, strerror(e));
        return -1;
    }
    return 0;
}

/* Fills the jobs' paths (router first, then cfg's nodes) and checks that none exists (unless
 * force) and no node is named like the router's files. Returns 0 or prints why and 1. */
static int plan(const tdm_config_t *cfg, const char *dir, bool force, key_job_t *jobs)
{
    for (size_t i = 0; i <= cfg->n_nodes; i++) {
        key_job_t *j = &jobs[i];
        j->id = i == 0 ? ROUTER_ID : cfg->nodes[i - 1].id;
        if (i > 0 && strcmp(j->id, ROUTER_ID) == 0) {
            fprintf(stderr,
                    "tandem keys: node id '%s' would share the router's key files; rename the "
                    "node\n",
                    j->id);
            return 1;
        }
        int a = snprintf(j->key_path, sizeof j->key_path, "%s/%s.key", dir, j->id);
        int b = snprintf(j->pub_path, sizeof j->pub_path, "%s/%s.pub", dir, j->id);
        if (a < 0 || b < 0 || (size_t)a >= sizeof j->key_path || (size_t)b >= sizeof j->pub_path) {
            fprintf(stderr, "tandem keys: the path %s/%s.key is too long\n", dir, j->id);
            return 1;
        }
        const char *paths[] = {j->key_path, j->pub_path};
        for (size_t k = 0; k < 2; k++) {
            struct stat st;
            if (lstat(paths[k], &st) != 0)
                continue;
            if (!force) {
                fprintf(stderr,
                        "tandem keys: %s exists; not overwriting key files (--force replaces "
                        "them, and every daemon then needs its new key)\n",
                        paths[k]);
                return 1;
            }
            /* checked for every file before the first write: never a half-replaced set */
            if (!S_ISREG(st.st_mode)) {
                fprintf(stderr,
                        "tandem keys: %s is not a regular file (a symbolic link?); remove it "
                        "first: key files are never written through one\n",
                        paths[k]);
                return 1;
            }
        }
    }
    return 0;
}

/* Prints the YAML that puts the keys into the config. */
static void print_yaml(const char *config, const tdm_config_t *cfg, const key_job_t *jobs)
{
    printf("# CURVE keys for %s: paste into its router: section and into each node's entry.\n"
           "router:\n"
           "  curve_public_key: \"%s\"\n"
           "  curve_secret_key_file: %s\n"
           "nodes:\n",
           config, jobs[0].public_key, jobs[0].key_path);
    for (size_t i = 0; i < cfg->n_nodes; i++)
        printf("  - id: %s\n"
               "    curve_public_key: \"%s\"\n"
               "    curve_secret_key_file: %s\n",
               jobs[i + 1].id, jobs[i + 1].public_key, jobs[i + 1].key_path);
}

static int generate(const char *config, const char *out_dir, bool force)
{
    tdm_config_t cfg;
    tdm_error_t err = {0};
    if (tdm_config_load_file(config, &cfg, &err) != TDM_OK) {
        fprintf(stderr, "%s\n", err.msg);
        return 1;
    }
    int status = 1;
    char dir[PATH_MAX];
    key_job_t *jobs = calloc(cfg.n_nodes + 1, sizeof *jobs);
    if (!jobs) {
        fprintf(stderr, "tandem keys: out of memory\n");
        goto out_config;
    }
    if (make_dir(out_dir) != 0)
        goto out_jobs;
    /* absolute paths, so that the daemons find the files from any working directory */
    if (absolute_dir(out_dir, dir, sizeof dir) != 0)
        goto out_jobs;
    if (plan(&cfg, dir, force, jobs) != 0)
        goto out_jobs;
    struct stat dst;
    if (stat(dir, &dst) == 0 && (dst.st_mode & 022))
        fprintf(stderr,
                "tandem keys: warning: %s is writable by its group or others (mode %04o): "
                "anyone who can write there can replace the key files (chmod 700 %s)\n",
                dir, (unsigned)(dst.st_mode & 07777), dir);
    for (size_t i = 0; i <= cfg.n_nodes; i++) {
        key_job_t *j = &jobs[i];
        if (tdm_net_curve_keypair(j->public_key, j->secret_key) != TDM_OK) {
            fprintf(stderr, "tandem keys: this libzmq was built without CURVE\n");
            goto out_wipe;
        }
        if (write_file(j->key_path, j->secret_key, 0600, force) != 0 ||
            write_file(j->pub_path, j->public_key, 0644, force) != 0)
            goto out_wipe;
    }
    print_yaml(config, &cfg, jobs);
    fprintf(stderr, "tandem keys: wrote %zu key pairs to %s (*.key mode 0600)\n", cfg.n_nodes + 1,
            dir);
    status = 0;
out_wipe:
    for (size_t i = 0; i <= cfg.n_nodes; i++)
        tdm_net_curve_wipe(jobs[i].secret_key, sizeof jobs[i].secret_key);
out_jobs:
    free(jobs);
out_config:
    tdm_config_free(&cfg);
    return status;
}

/* `tandem keys default`: makes the missing pairs of the keys by default and lists them. */
static int show_default(const char *config)
{
    tdm_config_t cfg;
    tdm_error_t err = {0};
    int rc = config ? tdm_config_load_file(config, &cfg, &err) : tdm_config_defaults(&cfg);
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem keys: %s\n",
                err.msg[0] ? err.msg : "cannot form the default config (is $HOME set?)");
        return 1;
    }
    bool configured = tdm_config_curve_on(&cfg);
    char dir[PATH_MAX];
    rc = tdm_keydir_apply(&cfg, dir, sizeof dir, &err);
    int status = 1;
    if (rc != TDM_OK) {
        fprintf(stderr, "tandem keys: %s\n", err.msg);
    } else if (!dir[0]) {
        fprintf(stderr, "tandem keys: no keys by default for %s: %s\n",
                config ? config : "the default cluster",
                configured ? "the config sets CURVE keys (router.curve_public_key)"
                : !cfg.security.default_keys
                    ? "security.default_keys is false (CURVE is off)"
                    : "a node or KV endpoint is not on this host (loopback or ipc://); give "
                      "such a cluster its keys with tandem keys generate");
    } else {
        printf("key directory: %s\n", dir);
        printf("%-20s %s\n", ROUTER_ID, cfg.router.curve_public_key);
        for (size_t i = 0; i < cfg.n_nodes; i++)
            printf("%-20s %s\n", cfg.nodes[i].id, cfg.nodes[i].curve_public_key);
        status = 0;
    }
    tdm_config_free(&cfg);
    return status;
}

int tdm_cmd_keys(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0) {
        usage(stdout);
        return 0;
    }
    bool is_default = strcmp(argv[1], "default") == 0;
    if (strcmp(argv[1], "generate") != 0 && !is_default)
        return bad_usage("unknown action '%s' (generate, default)", argv[1]);
    static const struct option opts[] = {
        {"config", required_argument, NULL, 'c'},
        {"out", required_argument, NULL, 'o'},
        {"force", no_argument, NULL, 'f'},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    const char *config = NULL, *out_dir = NULL;
    bool force = false;
    int c;
    optind = 1;
    while ((c = getopt_long(argc - 1, argv + 1, "c:o:fh", opts, NULL)) != -1) {
        switch (c) {
        case 'c': config = optarg; break;
        case 'o': out_dir = optarg; break;
        case 'f': force = true; break;
        case 'h': usage(stdout); return 0;
        default: return 2; /* getopt printed why */
        }
    }
    if (optind < argc - 1)
        return bad_usage("unexpected argument '%s'", argv[1 + optind]);
    if (is_default) {
        if (out_dir || force)
            return bad_usage("%s applies to generate only", out_dir ? "--out" : "--force");
        return show_default(config);
    }
    if (!config)
        return bad_usage("--config FILE is required");
    if (!out_dir)
        return bad_usage("--out DIR is required");
    return generate(config, out_dir, force);
}
