/* lifecycle.h - the ways a GENERATE request ends other than completing (lifecycle.c):
 * failed, dropped, cancelled by the client, past its deadline, router shutdown. Completing is
 * stream.h's; a refusal before the request exists is request.c's.
 */
#ifndef TANDEM_ROUTER_LIFECYCLE_H
#define TANDEM_ROUTER_LIFECYCLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "router_internal.h"

/* Sends END(status, message) for a client call; returns tdm_sock_send's code. body may be
 * NULL; borrowed. */
int rt_send_end(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id, int status,
                const char *message, const ProtobufCMessage *body);

/* Ends a request with an error: END status to the client, NodeCancel to its nodes (when
 * cancel_nodes), metrics, freed. */
void rt_req_fail(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* rt_req_fail with the message made, and body (NULL: none; borrowed) as the END's
 * (ErrorDetail: retry_after_s of a request shed at admission). */
void rt_req_fail_body(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes,
                      const ProtobufCMessage *body, const char *msg);
/* Drops a request without telling the client (cancel / client gone): NodeCancel, freed. */
void rt_req_drop(tdm_router_t *r, rt_req_t *q, const char *why);

/* Client CANCEL for (peer, call id). */
void rt_client_cancel(tdm_router_t *r, const tdm_frame_t *f);

/* Fails every request whose deadline (unix ms) is at or before now_ms, earliest first; first
 * gives up on reservations whose answer is overdue (rt_sched_check_reserves). */
void rt_req_check_deadlines(tdm_router_t *r, uint64_t now_ms);
/* Frees every request with END UNAVAILABLE "router shutting down". */
void rt_req_shutdown_all(tdm_router_t *r);

#endif /* TANDEM_ROUTER_LIFECYCLE_H */
