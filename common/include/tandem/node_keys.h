/* node_keys.h - a node daemon's CURVE keys: its own pair, and the keys of the router and (decode
 * nodes) of the prefill nodes it admits on its KV endpoint. */
#ifndef TANDEM_NODE_KEYS_H
#define TANDEM_NODE_KEYS_H

#include <stdbool.h>
#include <stddef.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/net.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A node daemon's CURVE material (DESIGN.md "Security and identity"): its own pair, the
 * secret read from its curve_secret_key_file (and no other node's), and the keys it trusts. */
typedef struct tdm_node_keys {
    bool on;                 /* CURVE is on (tdm_config_curve_on); everything below is empty
                                when it is off */
    char public_key[41];     /* this node's key, nodes[].curve_public_key */
    char secret_key[41];     /* from nodes[].curve_secret_key_file (tdm_net_curve_secret_read) */
    char router_key[41];     /* router.curve_public_key: the server key of the router link */
    tdm_node_role_t role;    /* the node's role: a decode node's KV side is a server */
    tdm_curve_peer_t *peers; /* decode nodes: [n_peers] the prefill nodes admitted on the KV
                                endpoint, named by node id (strings borrowed from the config);
                                NULL for prefill nodes */
    size_t n_peers;
} tdm_node_keys_t;

/* Loads node `node`'s keys into *k (previous contents ignored) when CURVE is on, and checks
 * that a decode node may bind its kv_endpoint (tdm_config_bind_check, guard CURVE). The
 * strings of cfg must outlive *k. Returns 0; with *err set: what tdm_net_curve_secret_read
 * returns for the node's secret key file (the message names nodes[i].curve_secret_key_file
 * and the path), TDM_EPRECONDITION (insecure bind), TDM_ERESOURCE. On error *k holds nothing
 * to close; on success release it with tdm_node_keys_close. */
int tdm_node_keys_open(tdm_node_keys_t *k, const tdm_config_t *cfg, const tdm_node_config_t *node,
                       tdm_error_t *err);

/* Wipes the secret and frees the peer list; zeroes *k. NULL-safe. */
void tdm_node_keys_close(tdm_node_keys_t *k);

/* The keys of the link to the router (client: the node's pair; server: the router's key) in
 * *out, or NULL when CURVE is off. *out points into k. Cannot fail. */
const tdm_curve_keys_t *tdm_node_curve_router(const tdm_node_keys_t *k, tdm_curve_keys_t *out);

/* The keys of the node's KV side in *out, or NULL when CURVE is off: a decode node's receiver
 * (server: its own pair; clients: every prefill node's key), a prefill node's sender (client:
 * its own pair; the receiver's key comes with each transfer, tdm_kv_send_req_t.server_key).
 * *out points into k. Cannot fail. */
const tdm_curve_keys_t *tdm_node_curve_kv(const tdm_node_keys_t *k, tdm_curve_keys_t *out);

/* ---- keys by default (docs/operations.md "Keys by default") ---- */

/* The per-user key directory in out (cap bytes): $XDG_STATE_HOME/tandem/keys when
 * XDG_STATE_HOME is an absolute path, else $HOME/.local/state/tandem/keys. Returns 0;
 * TDM_EPRECONDITION (neither variable usable), TDM_EINVALID (the path is longer than cap). */
int tdm_keydir_path(char *out, size_t cap, tdm_error_t *err);

/* True when cfg takes its CURVE keys from the key directory: security.default_keys is true,
 * the config sets no CURVE key (router.curve_public_key unset), and every address a node or
 * KV endpoint is bound or reached at (router.node_endpoint and its advertised address, every
 * endpoint of router.node_endpoints, each decode node's kv_endpoint and kv_advertise) is
 * loopback or ipc:// - one host. */
bool tdm_keydir_applies(const tdm_config_t *cfg);

/* When tdm_keydir_applies(cfg): makes the key directory (mode 0700, parents too) unless it
 * exists, refuses one that is not a directory, is a symbolic link, belongs to another user or
 * has any group/other permission bit, or whose parent belongs to another user or is writable by
 * group or others; makes the missing pairs of the router ("router.key")
 * and every node ("<id>.key": the 40-character Z85 secret, mode 0600; the public key is
 * derived from it), each created whole under a temporary name and linked into place, so
 * daemons starting at once all end up reading the one pair that won; then sets
 * router.curve_public_key / curve_secret_key_file and every node's pair in cfg, which turns
 * CURVE on (tdm_config_curve_on). dir (cap bytes, may be NULL) receives the directory, ""
 * when the keys do not apply. Returns 0 (also when they do not apply: cfg unchanged);
 * TDM_EPRECONDITION (no usable directory, wrong owner or mode: the message names the path
 * and the fix), TDM_EUNAVAILABLE (a file cannot be created or read), TDM_EINVALID (a key
 * file that does not hold a Z85 secret key: the message names it), TDM_ERESOURCE. */
int tdm_keydir_apply(tdm_config_t *cfg, char *dir, size_t cap, tdm_error_t *err);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NODE_KEYS_H */
