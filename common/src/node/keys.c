/* keys.c - a node daemon's CURVE keys: loaded from its config entry and key file, handed to
 * the router link and the KV side as tdm_curve_keys_t, wiped on close. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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
