/* decode.h - the decode node object that tandem-decode runs (decode-node/decode.c): a handler
 * of the node serve loop (tandem/node.h, tdm_node_serve) that reserves KV blocks, receives
 * prompts' KV from prefill nodes (or prefills locally) and decodes the running batch.
 *
 * The object owns its node (runtime, router link, request table) and its KV receiver; nothing
 * is global, so tests can run several nodes in one process (each on its own thread).
 */
#ifndef TANDEM_DECODE_H
#define TANDEM_DECODE_H

#include <signal.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/node.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_decode tdm_decode_t;

/* Opens the decode node `node_id` of cfg: runtime (worker in DECODE mode), the KV receiver
 * bound at the node's kv_endpoint, the router link. Errors as tdm_prefill_new, plus
 * TDM_EUNAVAILABLE when the KV endpoint cannot be bound. */
tdm_decode_t *tdm_decode_new(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                             const tdm_logger_t *log, tdm_error_t *err);

/* Serves until *stop; on stop, running sequences and reservations are failed (UNAVAILABLE)
 * and freed. */
int tdm_decode_run(tdm_decode_t *d, volatile sig_atomic_t *stop, tdm_error_t *err);

/* Frees the node. NULL-safe, nulls *self_p. */
void tdm_decode_destroy(tdm_decode_t **self_p);

/* The node's link to router i of tdm_config_router_endpoints (owned by the node; valid until
 * tdm_decode_destroy); NULL past the last. Cannot fail. */
tdm_node_link_t *tdm_decode_link(tdm_decode_t *d, size_t i);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_DECODE_H */
