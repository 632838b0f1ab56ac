/* node_link.h - a node's link to the router: an I/O thread that registers the node, sends
 * heartbeats and relays messages. A node that shares its pool between several routers
 * (router.node_endpoints) has one link per router, each with its own registration,
 * heartbeats, liveness and router instance (tandem/node.h: tdm_node_sock picks the link of a
 * request's router).
 *
 * Threads (DESIGN.md "Processes and sockets"): the engine thread talks to the router through
 * tdm_node_link_sock(), a DEALER connected over inproc:// to the link's I/O thread; the I/O
 * thread owns the TCP socket to the router, so heartbeats keep flowing while a long forward pass
 * runs. The engine thread publishes its load with tdm_node_link_set_load (a mutex-protected
 * copy). */
#ifndef TANDEM_NODE_LINK_H
#define TANDEM_NODE_LINK_H

#include <stddef.h>
#include <stdint.h>

#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/node_load.h"
#include "tandem/node_runtime.h"
#include "tandem/proto.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_node_link_state {
    TDM_NODE_LINK_CONNECTING = 0, /* registering (the router may not be up yet) */
    TDM_NODE_LINK_REGISTERED = 1,
    TDM_NODE_LINK_REJECTED = 2, /* the router refused the node: see the message */
} tdm_node_link_state_t;

typedef struct tdm_node_link_opts {
    const char *router_endpoint;            /* router.node_endpoint */
    const tdm_curve_keys_t *curve;          /* NULL: plain TCP */
    const Tandem__V1__RegisterRequest *reg; /* packed and kept; the DEALER identity is
                                               "<node_id>.<instance_id as 16 hex digits>" */
    const tdm_logger_t *log;
    const tdm_node_load_t *initial_load; /* what the first heartbeats say until the engine
                                            publishes (NULL: zeros, i.e. no free blocks) */
} tdm_node_link_opts_t;

typedef struct tdm_node_link tdm_node_link_t;

/* Starts the I/O thread, which connects to the router and registers (retrying every second
 * until acknowledged; again whenever the router answers a heartbeat with NOT_FOUND).
 * Returns NULL with *err set (TDM_EINVALID, TDM_ERESOURCE, TDM_EINTERNAL). */
tdm_node_link_t *tdm_node_link_new(tdm_net_t *net, const tdm_node_link_opts_t *opts,
                                   tdm_error_t *err);

/* Stops the I/O thread and closes both sockets (the engine-side one too: call from the
 * engine thread after it stopped using it). NULL-safe, nulls *self_p. */
void tdm_node_link_destroy(tdm_node_link_t **self_p);

/* The engine thread's socket: frames from the router arrive here (tdm_sock_recv), and
 * NOTIFY/END frames sent here go to the router. */
tdm_sock_t *tdm_node_link_sock(tdm_node_link_t *l);

/* Publishes the load for the next heartbeat. Thread-safe. */
void tdm_node_link_set_load(tdm_node_link_t *l, const tdm_node_load_t *load);

/* The registration state; with REJECTED, msg (cap bytes) gets the router's reason. */
tdm_node_link_state_t tdm_node_link_state(tdm_node_link_t *l, char *msg, size_t cap);

/* A registered router silent, with the connection to it down (closed, refused, or silent past
 * the ZMTP heartbeat timeout), this many heartbeat timeouts (RegisterAck.heartbeat_timeout_ms,
 * 2.5 s by default: 5 s) is taken for gone: the same time after which a router marks a silent
 * node down. A router that is only slow to answer (its loop stalled) keeps the connection up
 * and is not given up. */
#define TDM_NODE_LINK_LOST_TIMEOUTS 2

/* The instance id of the router this link is registered with (RegisterAck); 0 before the
 * first registration, and again from when the router was taken for gone
 * (TDM_NODE_LINK_LOST_TIMEOUTS; the link registers again) until it answers a registration.
 * When it changes or becomes 0, work dispatched by the older instance is orphaned and the
 * engine drops it. Thread-safe. */
uint64_t tdm_node_link_router_instance(tdm_node_link_t *l);

/* Frames from the router the link dropped because they came from another router instance
 * than the registered one, since the link started; every heartbeat reports it
 * (NodeLoad.stale_router_frames, the router's tandem_node_stale_router_frames_total).
 * Thread-safe. */
uint64_t tdm_node_link_stale_frames(tdm_node_link_t *l);

/* A random instance id for one start of a node (getrandom; never 0). Cannot fail. */
uint64_t tdm_node_instance_new(void);

/* Builds the node's RegisterRequest (id, role, version, model fingerprint, KV layout and
 * blocks, kv_endpoint (decode nodes; NULL otherwise), transports, device, limits, n_ctx, the
 * node's instance id (tdm_node_instance_new; the same for every router of one start)) and
 * starts the link to router_endpoint (one of tdm_config_router_endpoints), over CURVE with
 * rt->keys when CURVE is on. Logs a warning when security.insecure is true. */
tdm_node_link_t *tdm_node_link_start(tdm_net_t *net, const tdm_config_t *cfg,
                                     const tdm_node_config_t *node, const tdm_node_runtime_t *rt,
                                     const char *kv_endpoint, const char *router_endpoint,
                                     uint64_t instance, const tdm_logger_t *log, tdm_error_t *err);

/* Waits until everything the engine thread sent on tdm_node_link_sock before this call has
 * reached the router, or timeout_ms passed. The I/O thread relays what is queued, then sends
 * a heartbeat and waits for its answer: the router answers in order, so the answer proves the
 * rest arrived. Call from the engine thread (it writes to the engine socket). Returns 0 once
 * drained; TDM_EDEADLINE when timeout_ms passed first (router down or slow), TDM_EUNAVAILABLE
 * when the request cannot be queued. Used before shutdown, since the link's sockets drop what
 * is unsent when they close. */
int tdm_node_link_flush(tdm_node_link_t *l, int timeout_ms);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NODE_LINK_H */
