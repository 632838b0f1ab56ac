/* test_keydir.c - keys by default (tdm_keydir_apply, common/src/node/keys.c): when they apply,
 * the key directory and files they make and their modes, the keys they put in the config,
 * the refusals (loose mode, symbolic link, a file that is not a key), concurrent first
 * starts (forked processes at once) agreeing on one pair per id, and the CURVE handshakes a
 * server socket refused, which the router lists in Status (tdm_sock_curve_refusals). */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tdm_test.h"
#include "tandem/config.h"
#include "tandem/net.h"
#include "tandem/node_keys.h"

static char g_root[64];

/* A fresh XDG_STATE_HOME under the test's temporary root; its key directory in dir. */
static void fresh_state(const char *name, char *dir, size_t cap)
{
    char state[256];
    snprintf(state, sizeof state, "%s/%s", g_root, name);
    assert_int_equal(setenv("XDG_STATE_HOME", state, 1), 0);
    snprintf(dir, cap, "%s/tandem/keys", state);
}

static int mode_of(const char *path)
{
    struct stat st;
    assert_int_equal(lstat(path, &st), 0);
    return (int)(st.st_mode & 07777);
}

static void test_applies(void **state)
{
    (void)state;
    tdm_config_t cfg;
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_true(tdm_keydir_applies(&cfg));
    cfg.security.default_keys = false;
    assert_false(tdm_keydir_applies(&cfg));
    cfg.security.default_keys = true;
    /* one address off this host: a multi-host cluster is given its keys */
    char *saved = cfg.router.node_endpoint;
    cfg.router.node_endpoint = (char *)"tcp://10.0.0.1:7601";
    assert_false(tdm_keydir_applies(&cfg));
    cfg.router.node_endpoint = (char *)"ipc:///tmp/tandem-nodes";
    assert_true(tdm_keydir_applies(&cfg));
    cfg.router.node_endpoint = saved;
    for (size_t i = 0; i < cfg.n_nodes; i++)
        if (cfg.nodes[i].role == TDM_NODE_ROLE_DECODE) {
            saved = cfg.nodes[i].kv_endpoint;
            cfg.nodes[i].kv_endpoint = (char *)"tcp://0.0.0.0:7610";
            assert_false(tdm_keydir_applies(&cfg));
            cfg.nodes[i].kv_endpoint = saved;
        }
    assert_true(tdm_keydir_applies(&cfg));
    tdm_config_free(&cfg);
}

static void test_apply_makes_and_reads_back(void **state)
{
    (void)state;
    char dir[PATH_MAX], got[PATH_MAX], path[PATH_MAX + 32];
    fresh_state("s1", dir, sizeof dir);
    tdm_config_t a, b;
    tdm_error_t err = {0};
    assert_int_equal(tdm_config_defaults(&a), TDM_OK);
    assert_false(tdm_config_curve_on(&a));
    assert_int_equal(tdm_keydir_apply(&a, got, sizeof got, &err), TDM_OK);
    assert_string_equal(got, dir);
    assert_true(tdm_config_curve_on(&a));
    assert_int_equal(mode_of(dir), 0700);
    snprintf(path, sizeof path, "%s/router.key", dir);
    assert_int_equal(mode_of(path), 0600);
    assert_string_equal(a.router.curve_secret_key_file, path);
    assert_int_equal((int)strlen(a.router.curve_public_key), 40);
    for (size_t i = 0; i < a.n_nodes; i++) {
        snprintf(path, sizeof path, "%s/%s.key", dir, a.nodes[i].id);
        assert_int_equal(mode_of(path), 0600);
        assert_string_equal(a.nodes[i].curve_secret_key_file, path);
        assert_string_not_equal(a.nodes[i].curve_public_key, a.router.curve_public_key);
        /* each daemon's own read of its secret accepts the file and the derived key */
        char secret[41];
        assert_int_equal(
            tdm_net_curve_secret_read(path, a.nodes[i].curve_public_key, "k", secret, &err),
            TDM_OK);
        tdm_net_curve_wipe(secret, sizeof secret);
    }
    /* a second start reads the same pairs */
    assert_int_equal(tdm_config_defaults(&b), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&b, NULL, 0, &err), TDM_OK);
    assert_string_equal(a.router.curve_public_key, b.router.curve_public_key);
    for (size_t i = 0; i < a.n_nodes; i++)
        assert_string_equal(a.nodes[i].curve_public_key, b.nodes[i].curve_public_key);
    tdm_config_free(&a);
    tdm_config_free(&b);

    /* not applying: the config is left as it was, nothing is made */
    fresh_state("s-off", dir, sizeof dir);
    assert_int_equal(tdm_config_defaults(&a), TDM_OK);
    a.security.default_keys = false;
    assert_int_equal(tdm_keydir_apply(&a, got, sizeof got, &err), TDM_OK);
    assert_string_equal(got, "");
    assert_false(tdm_config_curve_on(&a));
    assert_int_not_equal(access(dir, F_OK), 0);
    tdm_config_free(&a);
}

static void test_refusals(void **state)
{
    (void)state;
    char dir[PATH_MAX], path[PATH_MAX + 32];
    tdm_config_t cfg;
    tdm_error_t err = {0};

    fresh_state("loose", dir, sizeof dir);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_OK); /* makes it */
    tdm_config_free(&cfg);
    assert_int_equal(chmod(dir, 0750), 0);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_EPRECONDITION);
    assert_non_null(strstr(err.msg, "has mode 0750"));
    assert_non_null(strstr(err.msg, "chmod 700"));
    assert_false(tdm_config_curve_on(&cfg)); /* left keyless */
    for (size_t i = 0; i < cfg.n_nodes; i++)
        assert_null(cfg.nodes[i].curve_public_key);
    tdm_config_free(&cfg);

    /* a file that is not a key: named, never replaced */
    assert_int_equal(chmod(dir, 0700), 0);
    snprintf(path, sizeof path, "%s/router.key", dir);
    FILE *f = fopen(path, "w");
    assert_non_null(f);
    fputs("short\n", f);
    fclose(f);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, path));
    tdm_config_free(&cfg);

    /* a parent others may write: they could swap the key directory */
    fresh_state("wide", dir, sizeof dir);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_OK);
    tdm_config_free(&cfg);
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", dir);
    *strrchr(parent, '/') = '\0';
    assert_int_equal(chmod(parent, 0777), 0);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_EPRECONDITION);
    assert_non_null(strstr(err.msg, "is writable by group or others"));
    tdm_config_free(&cfg);
    /* refused before anything is made in it: a fresh key directory under a wide parent */
    char rm[PATH_MAX + 16];
    snprintf(rm, sizeof rm, "rm -r '%s'", dir);
    assert_int_equal(system(rm), 0);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_EPRECONDITION);
    struct stat gone;
    assert_int_not_equal(lstat(dir, &gone), 0);
    tdm_config_free(&cfg);

    /* a symbolic link in place of the directory */
    char tdir[PATH_MAX], target[PATH_MAX + 16];
    snprintf(tdir, sizeof tdir, "%s/linked/tandem", g_root);
    fresh_state("linked", dir, sizeof dir);
    snprintf(target, sizeof target, "%s/real", g_root);
    assert_int_equal(mkdir(target, 0700), 0);
    snprintf(path, sizeof path, "%s/linked", g_root);
    assert_int_equal(mkdir(path, 0700), 0);
    assert_int_equal(mkdir(tdir, 0700), 0);
    assert_int_equal(symlink(target, dir), 0);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_EPRECONDITION);
    assert_non_null(strstr(err.msg, "symbolic link"));
    tdm_config_free(&cfg);

    /* a symbolic link in place of the directory holding it ($XDG_STATE_HOME/tandem), even to a
     * directory of ours with mode 0700 (in /tmp, another user's link could be re-pointed) */
    char ptarget[PATH_MAX + 16], plink[PATH_MAX + 16];
    fresh_state("plinked", dir, sizeof dir);
    snprintf(ptarget, sizeof ptarget, "%s/preal", g_root);
    assert_int_equal(mkdir(ptarget, 0700), 0);
    snprintf(path, sizeof path, "%s/plinked", g_root);
    assert_int_equal(mkdir(path, 0700), 0);
    snprintf(plink, sizeof plink, "%s/plinked/tandem", g_root);
    assert_int_equal(symlink(ptarget, plink), 0);
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK);
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_EPRECONDITION);
    assert_non_null(strstr(err.msg, "which holds the key directory, is a symbolic link"));
    tdm_config_free(&cfg);

    /* no usable directory at all */
    assert_int_equal(tdm_config_defaults(&cfg), TDM_OK); /* its model path needs HOME */
    assert_int_equal(setenv("XDG_STATE_HOME", "relative", 1), 0);
    char *home = getenv("HOME") ? strdup(getenv("HOME")) : NULL;
    unsetenv("HOME");
    assert_int_equal(tdm_keydir_apply(&cfg, NULL, 0, &err), TDM_EPRECONDITION);
    assert_non_null(strstr(err.msg, "XDG_STATE_HOME"));
    tdm_config_free(&cfg);
    if (home) {
        setenv("HOME", home, 1);
        free(home);
    }
}

/* 8 processes apply at once on a fresh directory, each writes the router's public key and
 * every node's to a pipe: all the same. Repeated on several fresh directories. */
static void test_concurrent_first_start(void **state)
{
    (void)state;
    enum { N = 8 };
    for (int round = 0; round < 5; round++) {
        char name[32], dir[PATH_MAX];
        snprintf(name, sizeof name, "race%d", round);
        fresh_state(name, dir, sizeof dir);
        int fds[N][2];
        pid_t pids[N];
        for (int i = 0; i < N; i++) {
            assert_int_equal(pipe(fds[i]), 0);
            pids[i] = fork();
            assert_true(pids[i] >= 0);
            if (pids[i] == 0) {
                tdm_config_t cfg;
                tdm_error_t err = {0};
                char out[512] = "";
                if (tdm_config_defaults(&cfg) != TDM_OK ||
                    tdm_keydir_apply(&cfg, NULL, 0, &err) != TDM_OK)
                    _exit(1);
                snprintf(out, sizeof out, "%s", cfg.router.curve_public_key);
                for (size_t j = 0; j < cfg.n_nodes; j++)
                    snprintf(out + strlen(out), sizeof out - strlen(out), " %s",
                             cfg.nodes[j].curve_public_key);
                ssize_t w = write(fds[i][1], out, strlen(out) + 1);
                _exit(w > 0 ? 0 : 1);
            }
            close(fds[i][1]);
        }
        char first[512] = "";
        for (int i = 0; i < N; i++) {
            char got[512] = "";
            ssize_t r = read(fds[i][0], got, sizeof got - 1);
            close(fds[i][0]);
            int status;
            assert_int_equal(waitpid(pids[i], &status, 0), pids[i]);
            assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
            assert_true(r > 40);
            if (i == 0)
                snprintf(first, sizeof first, "%s", got);
            else
                assert_string_equal(got, first);
        }
        /* exactly the key files: no temporary file left behind */
        char cmd[PATH_MAX + 64];
        snprintf(cmd, sizeof cmd, "test $(ls -A '%s' | wc -l) -eq 3", dir);
        assert_int_equal(system(cmd), 0);
    }
}

/* Waits (10 ms steps, 30 s at most) until s has refused at least n handshakes. */
static uint64_t wait_refusals(tdm_sock_t *s, uint64_t n, char *why, size_t cap)
{
    uint64_t got = 0;
    for (int i = 0; i < 3000 && (got = tdm_sock_curve_refusals(s, why, cap, NULL)) < n; i++)
        nanosleep(&(struct timespec){0, 10000000}, NULL);
    return got;
}

/* The refusals a CURVE server socket counts for Status: none on fresh sockets (several, so
 * that the ZAP table grows), a client key it does not admit (ZAP, the key named), a client
 * without the server's key (the handshake fails before ZAP; counted with watch_handshake). */
static void test_curve_refusals(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    assert_non_null(net);
    char spub[41], ssec[41], apub[41], asec[41], xpub[41], xsec[41];
    assert_int_equal(tdm_net_curve_keypair(spub, ssec), TDM_OK);
    assert_int_equal(tdm_net_curve_keypair(apub, asec), TDM_OK);
    assert_int_equal(tdm_net_curve_keypair(xpub, xsec), TDM_OK);
    tdm_curve_peer_t peer = {apub, "decode-0"};
    tdm_curve_keys_t keys = {
        .server_public = spub, .server_secret = ssec, .clients = &peer, .n_clients = 1};
    tdm_sock_opts_t o = {0};
    o.curve = &keys;
    o.watch_handshake = true;
    tdm_sock_t *srv[6];
    char why[TDM_ERRMSG_MAX];
    for (int i = 0; i < 6; i++) {
        srv[i] = tdm_sock_bind(net, "tcp://127.0.0.1:*", &o, &err);
        assert_non_null(srv[i]);
        assert_int_equal(tdm_sock_curve_refusals(srv[i], why, sizeof why, NULL), 0);
        assert_string_equal(why, "");
    }
    /* a key the server does not admit */
    tdm_curve_keys_t ck = {.server_public = spub, .client_public = xpub, .client_secret = xsec};
    tdm_sock_opts_t co = {0};
    co.curve = &ck;
    tdm_sock_t *c1 = tdm_sock_connect(net, tdm_sock_endpoint(srv[5]), &co, &err);
    assert_non_null(c1);
    assert_true(wait_refusals(srv[5], 1, why, sizeof why) >= 1);
    assert_non_null(strstr(why, xpub));
    assert_non_null(strstr(why, "no node's key"));
    /* a client that does not hold the server's public key */
    tdm_curve_keys_t wk = {.server_public = xpub, .client_public = apub, .client_secret = asec};
    co.curve = &wk;
    tdm_sock_t *c2 = tdm_sock_connect(net, tdm_sock_endpoint(srv[4]), &co, &err);
    assert_non_null(c2);
    assert_true(wait_refusals(srv[4], 1, why, sizeof why) >= 1);
    assert_non_null(strstr(why, "does not hold this server's public key"));
    for (int i = 0; i < 4; i++)
        assert_int_equal(tdm_sock_curve_refusals(srv[i], NULL, 0, NULL), 0);
    tdm_sock_destroy(&c1);
    tdm_sock_destroy(&c2);
    for (int i = 0; i < 6; i++)
        tdm_sock_destroy(&srv[i]);
    tdm_net_destroy(&net);
}

int main(void)
{
    snprintf(g_root, sizeof g_root, "/tmp/tdm-keydir-XXXXXX");
    if (!mkdtemp(g_root))
        return 1;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_applies),        cmocka_unit_test(test_apply_makes_and_reads_back),
        cmocka_unit_test(test_refusals),       cmocka_unit_test(test_concurrent_first_start),
        cmocka_unit_test(test_curve_refusals),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    char cmd[PATH_MAX + 16];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", g_root);
    if (system(cmd) != 0)
        rc = rc ? rc : 1;
    return rc;
}
