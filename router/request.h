/* request.h - the router's request table and a request's beginning: GENERATE intake
 * (validation: validate.h; admission), lookups by id, by client call and by deadline, and
 * freeing. How a request ends is lifecycle.h's (completing: stream.h).
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

/* The request of this client call, or NULL. */
rt_req_t *rt_req_find_call(tdm_router_t *r, const uint8_t *peer, size_t peer_len, uint64_t call_id);
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

/* Frees the request and takes it out of the table, the queue and its decode node's pending
 * reservations (no messages). NULL-safe. */
void rt_req_free(tdm_router_t *r, rt_req_t *q);

#endif /* TANDEM_ROUTER_REQUEST_H */
