/* nodes.h - the router's nodes: registration (RegisterRequest checked against the cluster
 * config and the served model), heartbeats and liveness, node failure, and the routing of
 * every message on the node endpoint to its handler.
 */
#ifndef TANDEM_ROUTER_NODES_H
#define TANDEM_ROUTER_NODES_H

#include <stddef.h>
#include <stdint.h>

#include "router_internal.h"

/* Makes r->nodes from the config (none registered). Returns 0 or TDM_ERESOURCE. */
int rt_nodes_init(tdm_router_t *r);
/* Frees r->nodes and what each holds. Cannot fail. */
void rt_nodes_fini(tdm_router_t *r);

/* Handles one frame from the node endpoint: REGISTER, HEARTBEAT, the END of a DecodeReserve
 * (scheduler.h), TokenEvent and Finished (stream.h), TaskFailed (scheduler.h). A frame that
 * is not from a registered instance's connection is answered NOT_FOUND or dropped. */
void rt_node_message(tdm_router_t *r, const tdm_frame_t *f);

/* Advances the liveness clock to now (monotonic seconds; a stall of the loop is not charged,
 * see tdm_router_check_liveness) and marks nodes silent on it for r->hb_timeout_ms suspect,
 * for TDM_ROUTER_DOWN_TIMEOUTS of them down. */
void rt_check_heartbeats(tdm_router_t *r, double now);
/* The liveness clock at monotonic time now, without advancing it (seconds). */
double rt_live_now(const tdm_router_t *r, double now);
/* Whether new work may go to n: up and not suspect. */
bool rt_node_dispatchable(const rt_node_t *n);

/* NOTIFY to a node by its registered connection. Failures are logged at debug and ignored. */
void rt_node_notify(tdm_router_t *r, rt_node_t *n, int method, const ProtobufCMessage *body);

/* The configured node with this id (len bytes), or NULL. */
rt_node_t *rt_node_find(tdm_router_t *r, const char *id, size_t len);
/* The node whose registered connection has routing id peer, or NULL. */
rt_node_t *rt_node_by_peer(tdm_router_t *r, const uint8_t *peer, size_t len);
/* Heartbeat-age of a node in seconds (-1 when never heard from). */
double rt_node_age(const rt_node_t *n, double now);
/* Writes to buf (cap bytes) why decode nodes that were refused are not serving ("" when
 * none was refused), for the error of a request that waited for one. */
void rt_refused_decode_note(const tdm_router_t *r, char *buf, size_t cap);

#endif /* TANDEM_ROUTER_NODES_H */
