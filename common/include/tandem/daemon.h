/* daemon.h - the command line, signals and run loop shared by tandem-prefill and
 * tandem-decode (`--config FILE --node-id ID`, `--help`, `--version`, clean shutdown on
 * SIGTERM/SIGINT), and the two node objects they run.
 *
 * A node object owns its runtime, router link and KV transport; nothing is global, so tests
 * can run several nodes in one process (each on its own thread). The prefill node is built
 * from prefill-node/ (library tandem_prefill), the decode node from decode-node/
 * (tandem_decode); tdm_daemon_main is in libtandem.
 */
#ifndef TANDEM_DAEMON_H
#define TANDEM_DAEMON_H

#include <signal.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/node.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- prefill node ---- */

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

void tdm_prefill_destroy(tdm_prefill_t **self_p);

/* The node's link to the router (owned by the node; valid until tdm_prefill_destroy), e.g. to
 * watch its registration state (tdm_node_link_state) from another thread. Cannot fail. */
tdm_node_link_t *tdm_prefill_link(tdm_prefill_t *p);

/* ---- decode node ---- */

typedef struct tdm_decode tdm_decode_t;

/* Opens the decode node `node_id` of cfg: runtime (worker in DECODE mode), the KV receiver
 * bound at the node's kv_endpoint, the router link. Errors as tdm_prefill_new, plus
 * TDM_EUNAVAILABLE when the KV endpoint cannot be bound. */
tdm_decode_t *tdm_decode_new(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                             const tdm_logger_t *log, tdm_error_t *err);

/* Serves until *stop; on stop, running sequences and reservations are failed (UNAVAILABLE)
 * and freed. */
int tdm_decode_run(tdm_decode_t *d, volatile sig_atomic_t *stop, tdm_error_t *err);

void tdm_decode_destroy(tdm_decode_t **self_p);

/* The node's link to the router (owned by the node; valid until tdm_decode_destroy). Cannot
 * fail. */
tdm_node_link_t *tdm_decode_link(tdm_decode_t *d);

/* ---- the daemons' main ---- */

/* How tdm_daemon_main creates, runs and destroys a node (the prefill or decode object). */
typedef struct tdm_daemon_ops {
    tdm_node_role_t role;
    void *(*create)(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                    const tdm_logger_t *log, tdm_error_t *err);
    int (*run)(void *node, volatile sig_atomic_t *stop, tdm_error_t *err);
    void (*destroy)(void *node);
    /* Optional (NULL: the daemon never reports READY=1): the node's router link. With it and a
     * service manager listening ($NOTIFY_SOCKET, tandem/notify.h), tdm_daemon_main reports
     * READY=1 once the link is REGISTERED, STATUS= on each change and STOPPING=1 at the end. */
    tdm_node_link_t *(*link)(void *node);
} tdm_daemon_ops_t;

/* Parses the command line of tandem-prefill / tandem-decode, loads the config (defaults when
 * no --config), picks the node (--node-id, or the config's first node of the role), installs
 * SIGTERM/SIGINT handlers and runs the node through ops (with sd_notify readiness when ops->link
 * is set, see tdm_daemon_ops_t). Returns the process exit status:
 * 0 after a signal, 1 on a runtime failure, 2 on a usage or config error. */
int tdm_daemon_main(int argc, char **argv, const tdm_daemon_ops_t *ops);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_DAEMON_H */
