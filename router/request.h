/* request.h - the router's request table and a request's beginning and end: GENERATE intake
 * (validation: validate.h; admission), lookups by id, by client call and by deadline, and
 * every way a request ends other than completing (stream.h): failed, dropped, cancelled by
 * the client, past its deadline, router shutdown.
 */
#ifndef TANDEM_ROUTER_REQUEST_H
#define TANDEM_ROUTER_REQUEST_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "router_internal.h"

/* Sets up the empty request table. Returns 0 or TDM_ERESOURCE (rt_req_table_fini still frees
 * what was made). */
int rt_req_table_init(tdm_router_t *r);
/* Frees the table's own memory (not the requests: tdm_router_shutdown ended them). */
void rt_req_table_fini(tdm_router_t *r);

/* Handles a GENERATE REQUEST frame (validation, tokenization, dispatch). */
void rt_generate(tdm_router_t *r, const tdm_frame_t *f);
/* Client CANCEL for (peer, call id). */
void rt_client_cancel(tdm_router_t *r, const tdm_frame_t *f);

/* Sends END(status, message) for a client call; returns tdm_sock_send's code. body may be
 * NULL; borrowed. */
int rt_send_end(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id, int status,
                const char *message, const ProtobufCMessage *body);

/* The request in flight with this id from this client connection, or NULL. Two clients may
 * use the same id at once (it is their label); one client may not, or it could not tell its
 * own replies apart. */
rt_req_t *rt_req_find_for_peer(tdm_router_t *r, const char *id, const uint8_t *peer,
                               size_t peer_len);
/* The newest request in flight with this id, or NULL. */
rt_req_t *rt_req_find(tdm_router_t *r, const char *id);
/* The request with this id whose current attempt is `attempt`, or NULL; *id_known tells
 * whether any request in flight has the id (so NULL means a stale attempt, not an unknown
 * request). Client ids may repeat across clients: node messages are matched by attempt. */
rt_req_t *rt_req_find_attempt(tdm_router_t *r, const char *id, uint64_t attempt, bool *id_known);
/* The request a node message names by (request id, attempt) when that attempt is current and
 * n is its prefill node (from_prefill) or decode node (from_decode) that may send it; else
 * NULL after a debug line naming `what`, and a message of an attempt that is not current is
 * counted as stale. */
rt_req_t *rt_req_for_event(tdm_router_t *r, const rt_node_t *n, const char *id, uint64_t attempt,
                           bool from_prefill, bool from_decode, const char *what);

/* Ends a request with an error: END status to the client, NodeCancel to its nodes (when
 * cancel_nodes), metrics, freed. */
void rt_req_fail(tdm_router_t *r, rt_req_t *q, int status, bool cancel_nodes, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
/* Drops a request without telling the client (cancel / client gone): NodeCancel, freed. */
void rt_req_drop(tdm_router_t *r, rt_req_t *q, const char *why);
/* Frees the request and takes it out of the table, the queue and its decode node's pending
 * reservations (no messages). NULL-safe. */
void rt_req_free(tdm_router_t *r, rt_req_t *q);

/* Fails every request whose deadline (unix ms) is at or before now_ms, earliest first; first
 * gives up on reservations whose answer is overdue (rt_sched_check_reserves). */
void rt_req_check_deadlines(tdm_router_t *r, uint64_t now_ms);
/* Frees every request with END UNAVAILABLE "router shutting down". */
void rt_req_shutdown_all(tdm_router_t *r);

#endif /* TANDEM_ROUTER_REQUEST_H */
