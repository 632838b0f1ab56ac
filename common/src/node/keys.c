/* keys.c - a node daemon's CURVE keys: loaded from its config entry and key file, handed to
 * the router link and the KV side as tdm_curve_keys_t, wiped on close. And keys by default:
 * the per-user key directory every daemon of a one-host cluster without configured keys takes
 * its pair from (tdm_keydir_apply). */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zmq.h>

#include "tandem/node_keys.h"

int tdm_node_keys_open(tdm_node_keys_t *k, const tdm_config_t *cfg, const tdm_node_config_t *node,
                       tdm_error_t *err)
{
    memset(k, 0, sizeof *k);
    size_t index = (size_t)(node - cfg->nodes);
    char key[96];
    if (node->role == TDM_NODE_ROLE_DECODE) {
        snprintf(key, sizeof key, "nodes[%zu].kv_endpoint", index);
        int rc = tdm_config_bind_check(cfg, key, node->kv_endpoint, TDM_BIND_GUARD_CURVE, err);
        if (rc != TDM_OK)
            return rc;
    }
    if (!tdm_config_curve_on(cfg))
        return TDM_OK;
    /* the loader guarantees both keys of every node once CURVE is on */
    snprintf(key, sizeof key, "nodes[%zu].curve_secret_key_file", index);
    int rc = tdm_net_curve_secret_read(node->curve_secret_key_file, node->curve_public_key, key,
                                       k->secret_key, err);
    if (rc != TDM_OK)
        return rc;
    snprintf(k->public_key, sizeof k->public_key, "%s", node->curve_public_key);
    snprintf(k->router_key, sizeof k->router_key, "%s", cfg->router.curve_public_key);
    if (node->role == TDM_NODE_ROLE_DECODE) {
        k->peers = calloc(cfg->n_nodes, sizeof *k->peers);
        if (!k->peers) {
            tdm_node_keys_close(k);
            return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        }
        for (size_t i = 0; i < cfg->n_nodes; i++)
            if (cfg->nodes[i].role == TDM_NODE_ROLE_PREFILL)
                k->peers[k->n_peers++] =
                    (tdm_curve_peer_t){cfg->nodes[i].curve_public_key, cfg->nodes[i].id};
    }
    k->role = node->role;
    k->on = true;
    return TDM_OK;
}

void tdm_node_keys_close(tdm_node_keys_t *k)
{
    if (!k)
        return;
    free(k->peers);
    tdm_net_curve_wipe(k->secret_key, sizeof k->secret_key);
    memset(k, 0, sizeof *k);
}

const tdm_curve_keys_t *tdm_node_curve_router(const tdm_node_keys_t *k, tdm_curve_keys_t *out)
{
    if (!k->on)
        return NULL;
    *out = (tdm_curve_keys_t){.server_public = k->router_key,
                              .client_public = k->public_key,
                              .client_secret = k->secret_key};
    return out;
}

const tdm_curve_keys_t *tdm_node_curve_kv(const tdm_node_keys_t *k, tdm_curve_keys_t *out)
{
    if (!k->on)
        return NULL;
    if (k->role == TDM_NODE_ROLE_DECODE) /* the KV receiver's server side */
        *out = (tdm_curve_keys_t){.server_public = k->public_key,
                                  .server_secret = k->secret_key,
                                  .clients = k->peers,
                                  .n_clients = k->n_peers};
    else
        *out = (tdm_curve_keys_t){.client_public = k->public_key, .client_secret = k->secret_key};
    return out;
}

/* ---- keys by default ---- */

#define KEYDIR_ROUTER "router" /* the router's file stem, as tandem keys generate names it */

int tdm_keydir_path(char *out, size_t cap, tdm_error_t *err)
{
    const char *state = getenv("XDG_STATE_HOME");
    const char *home = getenv("HOME");
    int n;
    if (state && state[0] == '/') /* the XDG spec: a relative path is invalid, ignore it */
        n = snprintf(out, cap, "%s/tandem/keys", state);
    else if (home && home[0] == '/')
        n = snprintf(out, cap, "%s/.local/state/tandem/keys", home);
    else
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "keys by default: neither XDG_STATE_HOME nor HOME is an absolute "
                             "path, so there is no key directory (set one, configure keys with "
                             "tandem keys generate, or set security.default_keys: false)");
    if (n < 0 || (size_t)n >= cap)
        return tdm_error_set(err, TDM_EINVALID,
                             "keys by default: the key directory path is "
                             "longer than %zu bytes",
                             cap - 1);
    return TDM_OK;
}

static bool one_host(const char *address)
{
    return !address || tdm_config_address_is_loopback(address);
}

bool tdm_keydir_applies(const tdm_config_t *cfg)
{
    if (!cfg || !cfg->security.default_keys || tdm_config_curve_on(cfg))
        return false;
    if (!one_host(cfg->router.node_endpoint) || !one_host(tdm_config_router_advertise(cfg)))
        return false;
    size_t n_routers;
    const char *const *routers = tdm_config_router_endpoints(cfg, &n_routers);
    for (size_t i = 0; i < n_routers; i++)
        if (!one_host(routers[i]))
            return false;
    for (size_t i = 0; i < cfg->n_nodes; i++) {
        const tdm_node_config_t *n = &cfg->nodes[i];
        if (n->role == TDM_NODE_ROLE_DECODE &&
            (!one_host(n->kv_endpoint) || !one_host(tdm_config_kv_advertise(n))))
            return false;
    }
    return true;
}

/* mkdir -p path with mode 0700 for what it creates (an existing component is kept). */
static int make_dirs(char *path, tdm_error_t *err)
{
    for (char *p = path + 1;; p++) {
        if (*p != '/' && *p != '\0')
            continue;
        char c = *p;
        *p = '\0';
        int rc = mkdir(path, 0700);
        int e = errno;
        *p = c;
        if (rc != 0 && e != EEXIST)
            return tdm_error_set(err, TDM_EUNAVAILABLE, "keys by default: cannot create %.*s: %s",
                                 (int)(p - path), path, strerror(e));
        if (c == '\0')
            return TDM_OK;
    }
}

/* The directory is this user's, a real directory, and closed to group and others. */
static int check_dir(const char *dir, tdm_error_t *err)
{
    struct stat st;
    if (lstat(dir, &st) != 0)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "keys by default: %s: %s", dir,
                             strerror(errno));
    if (S_ISLNK(st.st_mode) || !S_ISDIR(st.st_mode))
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "keys by default: %s is not a directory (%s); remove it, or set "
                             "XDG_STATE_HOME elsewhere",
                             dir, S_ISLNK(st.st_mode) ? "a symbolic link" : "another file type");
    if (st.st_uid != geteuid())
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "keys by default: the key directory %s belongs to uid %u, not to "
                             "this user (uid %u): another user could read or replace the keys; "
                             "remove it or set XDG_STATE_HOME to a directory of your own",
                             dir, (unsigned)st.st_uid, (unsigned)geteuid());
    if (st.st_mode & 077)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "keys by default: the key directory %s has mode %04o, open to "
                             "group or others; it must be 0700 (chmod 700 %s, and make new "
                             "keys: rm %s/*.key)",
                             dir, (unsigned)(st.st_mode & 07777), dir, dir);
    return TDM_OK;
}

/* The directory holding the key directory ($XDG_STATE_HOME/tandem) is this user's, a real
 * directory (not a symbolic link: in a shared sticky directory such as /tmp another user's
 * link could point at a directory of ours, then elsewhere), and nobody else may write it:
 * whoever can rename entries there can swap the key directory. */
static int check_parent(const char *dir, tdm_error_t *err)
{
    char parent[PATH_MAX];
    snprintf(parent, sizeof parent, "%s", dir);
    char *slash = strrchr(parent, '/');
    if (!slash || slash == parent)
        return TDM_OK;
    *slash = '\0';
    struct stat st;
    if (lstat(parent, &st) != 0)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "keys by default: %s: %s", parent,
                             strerror(errno));
    if (S_ISLNK(st.st_mode) || !S_ISDIR(st.st_mode))
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "keys by default: %s, which holds the key directory, is %s; use a "
                             "directory of your own (XDG_STATE_HOME) with mode 0700",
                             parent, S_ISLNK(st.st_mode) ? "a symbolic link" : "not a directory");
    if (st.st_uid != geteuid() || (st.st_mode & 022))
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "keys by default: %s, which holds the key directory, %s: another "
                             "user could swap the keys; use a directory of your own "
                             "(XDG_STATE_HOME) with mode 0700",
                             parent,
                             st.st_uid != geteuid() ? "belongs to another user"
                                                    : "is writable by group or others");
    return TDM_OK;
}

/* Reads the secret key at path (the whole file, one trailing newline allowed) and derives
 * its public key. TDM_ENOTFOUND when the file does not exist. */
static int read_pair(const char *path, char public_key[41], char secret_key[41], tdm_error_t *err)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
    if (fd < 0) {
        int e = errno;
        return tdm_error_set(err, e == ENOENT ? TDM_ENOTFOUND : TDM_EUNAVAILABLE,
                             "keys by default: cannot read %s: %s", path, strerror(e));
    }
    char buf[64];
    ssize_t n = read(fd, buf, sizeof buf);
    close(fd);
    if (n > 0 && buf[n - 1] == '\n')
        n--;
    int rc = TDM_OK;
    if (n != 40) {
        rc = tdm_error_set(err, TDM_EINVALID,
                           "keys by default: %s does not hold a 40-character Z85 secret key "
                           "(remove it and a new pair is made at the next start)",
                           path);
    } else {
        memcpy(secret_key, buf, 40);
        secret_key[40] = '\0';
        if (zmq_curve_public(public_key, secret_key) != 0)
            rc = tdm_error_set(err, TDM_EINVALID,
                               "keys by default: %s does not hold a Z85 secret key (remove it "
                               "and a new pair is made at the next start)",
                               path);
    }
    tdm_net_curve_wipe(buf, sizeof buf);
    return rc;
}

/* Makes the pair at path unless it exists: written whole to a temporary file (mode 0600) that
 * link() puts in place only when no file is there yet, so concurrent first starts agree on
 * one pair (the losers drop theirs). */
static int create_pair(const char *path, tdm_error_t *err)
{
    char tmp[PATH_MAX + 16];
    snprintf(tmp, sizeof tmp, "%s.XXXXXX", path);
    char public_key[41], secret_key[41];
    if (tdm_net_curve_keypair(public_key, secret_key) != TDM_OK)
        return tdm_error_set(err, TDM_EPRECONDITION,
                             "keys by default: libzmq was built without CURVE");
    int fd = mkstemp(tmp); /* mode 0600 */
    if (fd < 0) {
        tdm_net_curve_wipe(secret_key, sizeof secret_key);
        return tdm_error_set(err, TDM_EUNAVAILABLE, "keys by default: cannot create %s: %s", tmp,
                             strerror(errno));
    }
    secret_key[40] = '\n';
    bool ok = fchmod(fd, 0600) == 0 && write(fd, secret_key, 41) == 41 && fsync(fd) == 0;
    int e = errno;
    tdm_net_curve_wipe(secret_key, sizeof secret_key);
    if (close(fd) != 0 && ok) {
        ok = false;
        e = errno;
    }
    int rc = TDM_OK;
    if (!ok)
        rc = tdm_error_set(err, TDM_EUNAVAILABLE, "keys by default: writing %s failed: %s", tmp,
                           strerror(e));
    else if (link(tmp, path) != 0 && errno != EEXIST)
        rc = tdm_error_set(err, TDM_EUNAVAILABLE, "keys by default: cannot create %s: %s", path,
                           strerror(errno));
    unlink(tmp);
    return rc;
}

/* Sets *slot to a copy of text (freeing the old value). */
static int set_text(char **slot, const char *text, tdm_error_t *err)
{
    char *copy = strdup(text);
    if (!copy)
        return tdm_error_set(err, TDM_ERESOURCE, "out of memory");
    free(*slot);
    *slot = copy;
    return TDM_OK;
}

/* The pair of id in dir: made when missing, then read back (whoever made it). */
static int keydir_pair(const char *dir, const char *id, char **public_slot, char **path_slot,
                       tdm_error_t *err)
{
    char path[PATH_MAX], public_key[41], secret_key[41];
    int n = snprintf(path, sizeof path, "%s/%s.key", dir, id);
    if (n < 0 || (size_t)n >= sizeof path)
        return tdm_error_set(err, TDM_EINVALID,
                             "keys by default: the path of %s's key in %s "
                             "is too long",
                             id, dir);
    int rc = read_pair(path, public_key, secret_key, err);
    if (rc == TDM_ENOTFOUND) {
        if ((rc = create_pair(path, err)) != TDM_OK)
            return rc;
        rc = read_pair(path, public_key, secret_key, err);
    }
    tdm_net_curve_wipe(secret_key, sizeof secret_key);
    if (rc != TDM_OK)
        return rc;
    if ((rc = set_text(public_slot, public_key, err)) != TDM_OK)
        return rc;
    return set_text(path_slot, path, err);
}

int tdm_keydir_apply(tdm_config_t *cfg, char *dir, size_t cap, tdm_error_t *err)
{
    if (dir && cap)
        dir[0] = '\0';
    if (!tdm_keydir_applies(cfg))
        return TDM_OK;
    for (size_t i = 0; i < cfg->n_nodes; i++)
        if (strcmp(cfg->nodes[i].id, KEYDIR_ROUTER) == 0)
            return tdm_error_set(err, TDM_EINVALID,
                                 "keys by default: nodes[%zu].id '%s' would share the router's "
                                 "key file; rename the node or set security.default_keys: false",
                                 i, KEYDIR_ROUTER);
    char path[PATH_MAX];
    int rc = tdm_keydir_path(path, sizeof path, err);
    /* the parents first, checked before the key directory itself is made in one of them */
    char *slash = rc == TDM_OK ? strrchr(path, '/') : NULL;
    if (slash && slash != path) {
        *slash = '\0';
        rc = make_dirs(path, err);
        *slash = '/';
    }
    if (rc == TDM_OK)
        rc = check_parent(path, err);
    if (rc == TDM_OK)
        rc = make_dirs(path, err);
    if (rc == TDM_OK)
        rc = check_dir(path, err);
    /* the nodes first: router.curve_public_key is what turns CURVE on */
    for (size_t i = 0; rc == TDM_OK && i < cfg->n_nodes; i++)
        rc = keydir_pair(path, cfg->nodes[i].id, &cfg->nodes[i].curve_public_key,
                         &cfg->nodes[i].curve_secret_key_file, err);
    char *router_public = NULL;
    if (rc == TDM_OK)
        rc = keydir_pair(path, KEYDIR_ROUTER, &router_public, &cfg->router.curve_secret_key_file,
                         err);
    if (rc != TDM_OK) { /* leave cfg keyless, as it came */
        free(router_public);
        for (size_t i = 0; i < cfg->n_nodes; i++) {
            free(cfg->nodes[i].curve_public_key);
            free(cfg->nodes[i].curve_secret_key_file);
            cfg->nodes[i].curve_public_key = cfg->nodes[i].curve_secret_key_file = NULL;
        }
        free(cfg->router.curve_secret_key_file);
        cfg->router.curve_secret_key_file = NULL;
        return rc;
    }
    free(cfg->router.curve_public_key);
    cfg->router.curve_public_key = router_public;
    if (dir && cap)
        snprintf(dir, cap, "%s", path);
    return TDM_OK;
}
