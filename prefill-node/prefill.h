/* prefill.h - the prefill node object that tandem-prefill runs (prefill-node/prefill.c): a
 * handler of the node serve loop (tandem/node.h, tdm_node_serve) that prefills PrefillTasks
 * and ships their KV to the decode node each task names.
 *
 * The object owns its node (runtime, router link, request table) and its KV sender; nothing
 * is global, so tests can run several nodes in one process (each on its own thread).
 */
#ifndef TANDEM_PREFILL_H
#define TANDEM_PREFILL_H

#include <signal.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/node.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_prefill tdm_prefill_t;

/* Opens the prefill node `node_id` of cfg (which must outlive it): runtime (model, KV pool
 * from the node's memory budget, engine, worker in PREFILL mode), KV sender, and the link to
 * the router (registration starts at once). Returns NULL with *err set (see
 * tdm_node_runtime_open; TDM_ENOTFOUND / TDM_EINVALID for an unknown id or a node of another
 * role). */
tdm_prefill_t *tdm_prefill_new(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                               const tdm_logger_t *log, tdm_error_t *err);

/* Serves until *stop becomes nonzero (or the router refuses the node: TDM_EPRECONDITION with
 * the reason in *err). On stop, tasks in flight are reported to the router as failed
 * (UNAVAILABLE, retryable) and every block is freed. Returns 0 after a requested stop. */
int tdm_prefill_run(tdm_prefill_t *p, volatile sig_atomic_t *stop, tdm_error_t *err);

/* Frees the node. NULL-safe, nulls *self_p. */
void tdm_prefill_destroy(tdm_prefill_t **self_p);

/* The node's link to router i of tdm_config_router_endpoints (owned by the node; valid until
 * tdm_prefill_destroy), e.g. to watch its registration state (tdm_node_link_state) from
 * another thread; NULL past the last. Cannot fail. */
tdm_node_link_t *tdm_prefill_link(tdm_prefill_t *p, size_t i);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_PREFILL_H */
