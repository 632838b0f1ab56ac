/* client_internal.h - what libtandem-client's files share: the client and call records, the
 * call table and the steps of a call's life (start, end, wait). Private to client/lib/.
 *
 * Every call, blocking or not, is a client_call_t in the client's table (sorted by call id,
 * since ids only grow, so lookups are a binary search). tdm_client_poll receives frames and
 * dispatches them; a blocking call is a call marked `sync` that the caller's loop keeps polling
 * until it has ended, then takes its result out of the table. */
#ifndef TDM_CLIENT_INTERNAL_H
#define TDM_CLIENT_INTERNAL_H

#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/client.h"
#include "tandem/proto.h"

typedef enum call_kind {
    CALL_GENERATE = 0,
    CALL_UNARY = 1,
} call_kind_t;

typedef struct client_call {
    uint64_t id;
    int method;
    call_kind_t kind;
    bool sync;        /* a blocking call waits for it: keep it when it ends */
    bool stream;      /* Generate: chunks are streamed (else one chunk in the END) */
    uint32_t n;       /* Generate: choices (n > 1: every answer comes as a STREAM chunk) */
    uint32_t n_final; /* Generate: choices whose last chunk came */
    bool ended;       /* sync calls only: it has ended and left the table */
    bool in_chunk_cb; /* its on_chunk is running */
    double t_start;   /* monotonic seconds when the REQUEST was sent */
    double deadline;  /* monotonic seconds; 0 = none */
    double t_first;   /* first chunk with a token; 0 = none yet */
    double t_last;    /* last chunk with a token */
    tdm_client_chunk_fn on_chunk;
    tdm_client_done_fn on_done;
    tdm_client_unary_fn on_unary; /* async unary calls */
    void *user;
    tdm_client_result_t result;                  /* status and message for unary calls too */
    size_t text_cap;                             /* bytes allocated for result.text */
    size_t tokens_cap;                           /* entries allocated for result.token_ids */
    const ProtobufCMessageDescriptor *resp_desc; /* unary: the response type */
    ProtobufCMessage *resp;                      /* unary: the decoded response (owned) */
    /* several routers (tdm_client_t.n_routers > 1): where the call went and what to resend */
    size_t router;  /* index of the router that has the call; NO_ROUTER: none yet */
    uint32_t tries; /* routers it was sent to */
    bool delivered; /* a chunk reached the caller: never sent again */
    uint8_t *body;  /* packed request body, kept to send it again (owned) */
    const ProtobufCMessageDescriptor *req_desc; /* the body's type */
    size_t body_len;
    uint64_t deadline_ms; /* the REQUEST's deadline (unix ms; 0 = none) */
} client_call_t;

#define NO_ROUTER ((size_t)-1)

/* One router of a client: its DEALER and the monitor of its connection. */
typedef struct client_router {
    tdm_sock_t *sock;
    char *endpoint;
    void *monitor;  /* PAIR receiving the DEALER's connection events (NULL: inproc) */
    bool connected; /* a handshake succeeded and its connection has not dropped since */
} client_router_t;

struct tdm_client {
    tdm_net_t *net;
    bool own_net;
    client_router_t routers[TDM_CLIENT_MAX_ROUTERS]; /* [n_routers] */
    size_t n_routers;
    size_t next_router; /* round robin over the routers for new calls */
    char *endpoint;     /* as given: every router's endpoint, comma-separated */
    char api_key[TDM_NET_API_KEY_MAX];
    double timeout_s; /* default deadline; < 0 = none */
    const volatile sig_atomic_t *cancel_flag;
    const tdm_logger_t *log;
    uint64_t next_id;
    client_call_t **calls; /* [n_calls] running calls, sorted by id */
    size_t n_calls, cap_calls;
    uint64_t n_ended;     /* calls ended so far (tdm_client_poll's return value) */
    int depth;            /* > 0 while a callback runs */
    double last_cancel_t; /* when the last CANCEL was sent (monotonic); 0 = never */
    uint64_t n_lost;      /* connections to a router lost so far */
    uint64_t n_retried;   /* calls sent again to another router */
    tdm_frame_t frame;    /* receive buffer */
    tdm_error_t err;
    char err_field[64]; /* the request field the last refused start named; "" if none */
};

static inline const char *str_or_empty(const char *s)
{
    return s ? s : "";
}

/* ---- the call table (client.c) ---- */

/* The running call with id, or NULL. Cannot fail. */
client_call_t *tdm_client_call_find(const tdm_client_t *c, uint64_t id);

/* The running call with the smallest id above id (0: the first call), or NULL. A walk over the
 * calls that may end calls (whose callbacks may start and cancel others) steps with it from the
 * last id it saw, so no call is skipped or visited twice whatever the callbacks did; it stops
 * past the largest id it set out with, so calls started during the walk are left alone.
 * Cannot fail. */
client_call_t *tdm_client_call_after(const tdm_client_t *c, uint64_t id);

/* Appends call (its id is larger than every id in the table). Returns 0 or TDM_ERESOURCE. */
int tdm_client_call_add(tdm_client_t *c, client_call_t *call);

/* Takes call out of the table (does not free it). Cannot fail. */
void tdm_client_call_remove(tdm_client_t *c, const client_call_t *call);

/* Frees call and everything it owns. NULL-safe. */
void tdm_client_call_free(client_call_t *call);

/* Sends a CANCEL for call (best effort: a failure only means the router learns from the
 * deadline instead). */
void tdm_client_send_cancel(tdm_client_t *c, const client_call_t *call);

/* Ends a call: fills the final fields, takes it out of the table and either hands it to its
 * blocking caller (sync) or runs on_done and frees it. status/message override what the call
 * has when status != 0 and the call has no error yet. */
void tdm_client_call_end(tdm_client_t *c, client_call_t *call, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Ends every running call with status (sending CANCEL for each). */
void tdm_client_end_all(tdm_client_t *c, int status, const char *why);

/* True when the caller's cancel flag (tdm_client_opts_t.cancel_flag) is set. */
bool tdm_client_cancel_requested(const tdm_client_t *c);

/* Reads the connection events waiting on the monitor. Returns how many established
 * connections dropped: a DISCONNECTED not preceded by a failed handshake (libzmq reports a
 * failed handshake, a CURVE key mismatch say, as HANDSHAKE_FAILED_* and then DISCONNECTED; no
 * call went out over that connection, and they keep waiting for one that works). */
int tdm_client_monitor_read(tdm_client_t *c, size_t router);

/* Sends call (already in the table, its body kept) to the next router that takes it, after
 * the one it is on (several routers). Returns 0, or TDM_EUNAVAILABLE when no router has a
 * connection up now: the call stays in the table unsent (router NO_ROUTER) and the poll loop
 * tries again (tdm_client_resend_waiting) until its deadline. */
int tdm_client_call_resend(tdm_client_t *c, client_call_t *call);

/* Tries again to send every call that no router took yet. Cannot fail. */
void tdm_client_resend_waiting(tdm_client_t *c);

/* ---- starting calls (client_start.c) ---- */

/* A new call of method and kind with the next call id and an empty result. Returns NULL on
 * out of memory; caller frees with tdm_client_call_free (or hands it to tdm_client_call_send). */
client_call_t *tdm_client_call_new(tdm_client_t *c, int method, call_kind_t kind);

/* Sends the REQUEST of call with body and registers it. On failure the call is freed and the
 * error is in c->err. */
int tdm_client_call_send(tdm_client_t *c, client_call_t *call, const ProtobufCMessage *body,
                         double timeout_s);

/* Checks req and starts a Generate call with it (sync: for a blocking caller, which gets the
 * call in *out and takes it out with tdm_client_call_free once it has ended). Returns 0, or
 * TDM_EINVALID (c->err_field names the field), TDM_ERESOURCE, or what the send returned, with
 * c->err set; no callback runs for a call whose start failed. */
int tdm_client_generate_begin(tdm_client_t *c, const tdm_client_request_t *req,
                              tdm_client_chunk_fn on_chunk, tdm_client_done_fn on_done, void *user,
                              bool sync, client_call_t **out);

/* ---- receiving (client_poll.c) ---- */

/* tdm_client_poll with fd (-1: none) polled as well. */
int tdm_client_poll_impl(tdm_client_t *c, int timeout_ms, int fd);

/* Polls until the sync call has ended. */
void tdm_client_call_wait(tdm_client_t *c, client_call_t *call);

#endif
