/* daemon.h - the command line, signals and lifetime shared by tandem-prefill and
 * tandem-decode (`--config FILE --node-id ID`, `--help`, `--version`, sd_notify readiness,
 * clean shutdown on SIGTERM/SIGINT). The node objects they run are declared beside their code:
 * prefill-node/prefill.h (library tandem_prefill) and decode-node/decode.h (tandem_decode).
 */
#ifndef TANDEM_DAEMON_H
#define TANDEM_DAEMON_H

#include <signal.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/node_link.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the daemons' main ---- */

/* How tdm_daemon_main creates, runs and destroys a node (the prefill or decode object). */
typedef struct tdm_daemon_ops {
    tdm_node_role_t role;
    void *(*create)(const tdm_config_t *cfg, const char *node_id, tdm_net_t *net,
                    const tdm_logger_t *log, tdm_error_t *err);
    int (*run)(void *node, volatile sig_atomic_t *stop, tdm_error_t *err);
    void (*destroy)(void *node);
    /* Optional (NULL: the daemon never reports READY=1): the node's link to router i (of
     * tdm_config_router_endpoints), NULL past the last. With it and a service manager
     * listening ($NOTIFY_SOCKET, tandem/notify.h), tdm_daemon_main reports READY=1 once a link
     * is REGISTERED (one router serves the node), STATUS= on each change and STOPPING=1 at the
     * end. */
    tdm_node_link_t *(*link)(void *node, size_t i);
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
