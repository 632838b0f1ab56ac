/* http_gateway.h - the HTTP gateway thread (http_gateway.c): the router's calls through the
 * client library, their events, parking a connection while one is missing.
 */
#ifndef TANDEM_ROUTER_HTTP_GATEWAY_H
#define TANDEM_ROUTER_HTTP_GATEWAY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/client.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/proto.h"

typedef struct gw gw_t;
typedef struct gw_call gw_call_t;
typedef struct gw_chunk gw_chunk_t;

/* What happened to a call: a streamed chunk or the END. */
typedef struct gw_event {
    struct gw_event *next;
    int kind;                         /* TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM or _END */
    gw_chunk_t *chunk;                /* STREAM: owned; see gw_event_chunk */
    int status;                       /* END: 0 or a negative tdm status */
    char *message;                    /* END: the router's (or the gateway's) message; owned */
    tdm_client_error_detail_t detail; /* END of a refused GENERATE: the field at fault, ... */
    ProtobufCMessage *resp;           /* END OK of a unary call: the response; owned */
} gw_event_t;

/* Frees an event. NULL-safe. */
void gw_event_free(gw_event_t *ev);

/* The chunk of a STREAM event (valid as long as the event). */
const tdm_client_chunk_t *gw_event_chunk(const gw_event_t *ev);

/* Starts the gateway thread with a client (tandem/client.h) connected to endpoint, the router's
 * inproc:// endpoint on net, the router's context (any endpoint a client reaches works). Every
 * call sends api_key (NULL: none): the gateway checks its HTTP clients' keys itself. net and
 * log are borrowed. Returns NULL with *err set (TDM_EINVALID bad endpoint, TDM_ERESOURCE out of
 * memory or no thread). Free with gw_destroy. */
gw_t *gw_new(tdm_net_t *net, const char *endpoint, const char *api_key, const tdm_logger_t *log,
             tdm_error_t *err);

/* Ends every call with UNAVAILABLE "the HTTP gateway is shutting down" (CANCEL sent to the
 * router), makes new calls fail, stops and joins the thread. The object stays valid for the
 * calls still referenced (gw_call_next returns their END, gw_call_release frees them).
 * Idempotent. */
void gw_shutdown(gw_t *gw);

/* gw_shutdown, then frees everything. Every call must have been released. NULL-safe. */
void gw_destroy(gw_t **gw_p);

/* Starts a GENERATE call with req (its timeout_s is the deadline the client library sends
 * and enforces). The call takes ownership of req_owner and frees it with req_free(req_owner)
 * when the call is freed (req points into it). Returns a call holding one reference for the
 * caller (gw_call_release), or NULL with *err set: TDM_EUNAVAILABLE (the gateway is shutting
 * down), TDM_ERESOURCE; req_owner is then freed already. A request the client library refuses
 * ends at once with its status, message and detail.field. May be called from any thread. */
gw_call_t *gw_generate_start(gw_t *gw, const tdm_client_request_t *req, void (*req_free)(void *),
                             void *req_owner, tdm_error_t *err);

/* Takes the call's next event, waiting up to timeout_ms (< 0: without limit) for one. While
 * waiting it watches client_fd (>= 0: the HTTP client's socket) for a hang-up. Returns 0 with
 * *ev set (caller frees with gw_event_free; after the END event nothing more comes) or NULL
 * when nothing arrived in time; TDM_ECANCELLED when the client hung up (the caller cancels the
 * call), TDM_ERESOURCE when the call ended and its END could not be made (out of memory),
 * TDM_EINTERNAL when waiting failed. */
int gw_call_next(gw_call_t *c, int client_fd, int timeout_ms, gw_event_t **ev);

/* How gw_call_take parks its caller's connection while the call has no event: park runs at
 * once (suspend the connection), unpark later, once, from the gateway thread (resume it). Both
 * run with the gateway's lock held, so they must not call gw_* functions. */
typedef struct gw_parker {
    void (*park)(void *arg);
    void (*unpark)(void *arg);
    void *arg;
} gw_parker_t;

/* Takes the call's next event without waiting. Returns 0 with *ev set (caller frees with
 * gw_event_free; after the END event nothing more comes), or 0 with *ev NULL when none is
 * queued: then pk->park has run and pk->unpark will run once, when an event is queued, the
 * call ends, or client_fd (>= 0: the HTTP client's socket, watched while parked) hangs up; the
 * caller takes again then and checks the socket itself. TDM_ERESOURCE: out of memory (the call
 * has ended). */
int gw_call_take(gw_call_t *c, int client_fd, const gw_parker_t *pk, gw_event_t **ev);

/* gw_call_take for one call of a group (the prompts of one HTTP request, which fails as a
 * whole): does not park when one of siblings[0..n) (c itself and NULLs skipped) has ended with
 * an error (*sibling_failed true, *ev NULL, the caller answers with that error), and while c is
 * parked an error END of a sibling unparks it too. Before the group's calls are released, every
 * one must be passed to gw_call_unwatch. */
int gw_call_take_watch(gw_call_t *c, gw_call_t *const *siblings, size_t n, int client_fd,
                       const gw_parker_t *pk, gw_event_t **ev, bool *sibling_failed);

/* Forgets the sibling c unparks on an error END (gw_call_take_watch). NULL-safe. */
void gw_call_unwatch(gw_call_t *c);

/* Cancels the call if it has not ended: CANCEL goes to the router (which frees the request's
 * KV blocks) and the call ends with CANCELLED. Any thread; idempotent. */
void gw_call_cancel(gw_call_t *c);

/* True when the call's END has been queued (it may not have been taken yet). */
bool gw_call_ended(gw_call_t *c);

/* True when the call's END has been queued with an error status and not taken yet. */
bool gw_call_failed(gw_call_t *c);

/* Drops the caller's reference (and its parking, if any); the call is freed with the last
 * one. NULL-safe, nulls *c_p. */
void gw_call_release(gw_call_t **c_p);

/* Starts a unary call (EMBED: one that may wait long on the nodes) with req, read by the
 * gateway thread when it starts the call: the call takes ownership of req_owner (req points
 * into it; NULL req_free: the caller keeps it alive until the call is released) and frees it
 * with req_free(req_owner) when the call is freed. Its events are taken as a generate call's
 * (gw_call_take: the END, with the response in ev->resp when OK); timeout_s > 0 is its
 * deadline. Returns a call holding one reference for the caller (gw_call_release), or NULL with
 * *err set as gw_generate_start (req_owner freed already). Any thread. */
gw_call_t *gw_unary_start(gw_t *gw, int method, const ProtobufCMessage *req,
                          const ProtobufCMessageDescriptor *resp_desc, double timeout_s,
                          void (*req_free)(void *), void *req_owner, tdm_error_t *err);

/* A unary call (HEALTH, MODELS, STATUS, METRICS): runs it with req (only read while the call
 * runs), waits for its end and hands over the response in *resp (of type resp_desc; caller
 * frees with protobuf_c_message_free_unpacked). timeout_s > 0 is its deadline. Returns 0, or
 * the call's status with the message in *err. Any thread but the gateway's. */
int gw_unary(gw_t *gw, int method, const ProtobufCMessage *req,
             const ProtobufCMessageDescriptor *resp_desc, double timeout_s, ProtobufCMessage **resp,
             tdm_error_t *err);

#endif /* TANDEM_ROUTER_HTTP_GATEWAY_H */
