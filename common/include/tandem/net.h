/* net.h - gRPC-like calls over ZeroMQ: framing, unary and server-streaming calls, deadlines,
 * cancellation, CURVE security and limits, for the router, the nodes and the client library.
 *
 * Wire format (docs/protocol.md): every ZeroMQ multipart message is
 *     [peer identity (ROUTER side only)] [FrameHeader] [body]? [data]*
 * FrameHeader and body are protobuf (proto/tandem.proto, package tandem.v1); the header
 * carries the protocol version, the frame kind (REQUEST, STREAM, END, CANCEL, NOTIFY), the
 * method, the caller's call id, and on END a gRPC status code and message. `data` frames are
 * raw bytes (KV blocks), announced by FrameHeader.n_data_frames.
 *
 * Sockets are ZMQ ROUTER (bound: router endpoints, decode KV endpoints) and DEALER
 * (connected: clients, nodes, KV senders). A tdm_sock_t belongs to one thread, like the ZMQ
 * socket inside it. Nothing here is global: each process (or test) makes a tdm_net_t that
 * holds the ZMQ context.
 *
 * Robustness: tdm_sock_recv never crashes or blocks on what it receives. A frame that is too
 * big, has too many parts, fails to decode, has another major version or an unknown kind
 * gets an END reply with the status and a message when a reply is possible (the header
 * decoded and names a REQUEST), and is otherwise dropped with a log line; either way it is
 * counted in tdm_sock_stats and tdm_sock_recv goes on to the next message.
 *
 * The layer does not judge methods: a REQUEST or NOTIFY with a method number this build does
 * not know is handed to the caller like any other (a newer minor version may add methods),
 * and a server answers an unknown method with END INVALID_ARGUMENT ("unknown method N").
 * Nor does it judge deadlines: a server checks tdm_frame_expired itself.
 */
#ifndef TANDEM_NET_H
#define TANDEM_NET_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <protobuf-c/protobuf-c.h>

#include "tandem/base.h"
#include "tandem/log.h"
#include "tandem/proto.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Protocol version carried in every FrameHeader. A peer with another major version is
 * refused (FAILED_PRECONDITION, "protocol version 1.9 not supported; this node speaks 2.x").
 * docs/protocol.md "Versioning": a change older peers can ignore bumps the minor version, any
 * other the major. */
#define TDM_PROTOCOL_MAJOR 2u
#define TDM_PROTOCOL_MINOR 9u

/* Hard limits on what a socket accepts (larger input is rejected, never allocated). */
#define TDM_NET_MAX_HEADER_BYTES 4096u      /* FrameHeader frame */
#define TDM_NET_MAX_BODY_BYTES (16u << 20)  /* body frame (a 1M-token prompt fits) */
#define TDM_NET_MAX_DATA_BYTES (256u << 20) /* one data frame (one KV block) */
#define TDM_NET_MAX_DATA_FRAMES 65536u      /* data frames per message */
#define TDM_NET_PEER_MAX 256u               /* bytes of a ROUTER peer identity */
#define TDM_NET_API_KEY_MAX 256u            /* bytes of an API key */
#define TDM_NET_USER_ID_MAX 64u             /* bytes of an authenticated name, NUL included */

/* One per process (or per test): the ZMQ context. */
typedef struct tdm_net tdm_net_t;

/* Makes a ZMQ context with io_threads I/O threads (1..64; KV senders want 2+).
 * Returns NULL with *err set (TDM_ERESOURCE, TDM_EINTERNAL) on failure. */
tdm_net_t *tdm_net_new(int io_threads, tdm_error_t *err);

/* Terminates the context; every socket made from it must be destroyed first. NULL-safe,
 * nulls *self_p. */
void tdm_net_destroy(tdm_net_t **self_p);

/* The raw void* ZMQ context, for inproc sockets made outside this module. */
void *tdm_net_zctx(tdm_net_t *net);

/* A number this context never returned before (thread-safe), for inproc endpoint names that
 * must not collide with one still being torn down (a freed object's address can be reused
 * before libzmq has unbound its endpoint). Cannot fail. */
uint64_t tdm_net_unique(tdm_net_t *net);

/* One client key a CURVE server admits, and the name its connections are authenticated as:
 * every message received from such a connection carries the name in tdm_frame_t.user_id. */
typedef struct tdm_curve_peer {
    const char *public_key; /* Z85, 40 characters */
    const char *name;       /* 1..TDM_NET_USER_ID_MAX - 1 bytes (a node id) */
} tdm_curve_peer_t;

/* ZeroMQ CURVE keys, Z85 text (40 characters each). A server (ROUTER) uses server_public +
 * server_secret and admits only the client keys in clients[0 .. n_clients) (or, when
 * n_clients is 0, only client_public, named "tandem"), checked through a ZAP handler owned by
 * the tdm_net_t. A client (DEALER) uses client_public + client_secret and server_public. All
 * NULL (and n_clients 0) = plain TCP. The strings are read during the bind or connect only. */
typedef struct tdm_curve_keys {
    const char *server_public;
    const char *server_secret;
    const char *client_public;
    const char *client_secret;
    const tdm_curve_peer_t *clients; /* server: [n_clients] admitted keys; distinct keys */
    size_t n_clients;
} tdm_curve_keys_t;

/* Options for tdm_sock_bind / tdm_sock_connect. Zero-initialise, then set what you need. */
typedef struct tdm_sock_opts {
    const tdm_curve_keys_t *curve; /* NULL or all-NULL keys: no CURVE */
    const char *identity;          /* DEALER: routing id shown to the ROUTER peer (<= 255
                                      bytes); NULL: ZMQ picks one */
    int sndhwm;                    /* messages queued per peer before send fails; 0 = 10000 */
    int heartbeat_ms;              /* ZMTP heartbeat interval (dead TCP peers are
                                      disconnected after 3 intervals); 0 = 1000, <0 = off */
    int reconnect_ms;              /* DEALER: first reconnect delay, doubling up to
                                      reconnect_max_ms (backoff); 0 = 100 */
    int reconnect_max_ms;          /* 0 = 5000 */
    const tdm_logger_t *log;       /* where dropped frames are logged; NULL = stderr */
    uint64_t instance_id;          /* stamped into every FrameHeader this socket sends (the
                                      sending daemon's instance, docs/protocol.md
                                      "Identities"); 0 = none */
    bool watch_handshake;          /* DEALER: follow the outcome of each connection's
                                      handshake (tdm_sock_handshake). ROUTER with CURVE: count
                                      the handshakes that fail before ZAP is asked (a client
                                      without the server's key, or without CURVE) in
                                      tdm_sock_curve_refusals */
    bool immediate;                /* DEALER: queue messages only on completed connections
                                      (ZMQ_IMMEDIATE): with no connection up, a send fails at
                                      once (TDM_EUNAVAILABLE) instead of waiting for one; the
                                      multi-router client tries its next router then */
    bool no_handover;              /* ROUTER: a second connection with a routing id in use
                                      does not take it over (node endpoint: a peer cannot
                                      steal a registered node's connection) */
} tdm_sock_opts_t;

typedef struct tdm_sock tdm_sock_t;

/* Counters of one socket (monotonic). */
typedef struct tdm_sock_stats {
    uint64_t frames_in;     /* messages received and handed to the caller */
    uint64_t frames_out;    /* messages sent */
    uint64_t rejected;      /* malformed / oversized / wrong version: answered with END */
    uint64_t dropped;       /* malformed with no way to reply: dropped and logged */
    uint64_t send_failures; /* sends that failed (peer gone, queue full) */
    uint64_t bytes_in, bytes_out;
} tdm_sock_stats_t;

/* Binds a ROUTER socket at endpoint ("tcp://127.0.0.1:7600", "inproc://x"). The socket
 * reports unroutable peers on send (ZMQ_ROUTER_MANDATORY), so sending to a gone peer fails
 * with TDM_EUNAVAILABLE instead of vanishing; a peer that reconnects with the routing id of a
 * dead connection takes it over (ZMQ_ROUTER_HANDOVER), unless opts->no_handover. "localhost"
 * binds 127.0.0.1; an IPv6 literal ("tcp://[::1]:7601") works. A part larger than
 * TDM_NET_MAX_DATA_BYTES makes ZMQ drop the connection (ZMQ_MAXMSGSIZE), on both socket
 * kinds. CURVE applies to tcp:// and ipc:// endpoints (inproc:// has no handshake). Returns
 * NULL with *err set: TDM_EINVALID (bad endpoint or keys), TDM_EUNAVAILABLE (address in use),
 * TDM_EPRECONDITION (libzmq without CURVE, or another ZAP handler in this context). */
tdm_sock_t *tdm_sock_bind(tdm_net_t *net, const char *endpoint, const tdm_sock_opts_t *opts,
                          tdm_error_t *err);

/* Connects a DEALER socket to endpoint. ZMQ connects in the background and reconnects with
 * backoff; messages sent before the connection is up are queued (up to sndhwm). Returns
 * NULL with *err set (TDM_EINVALID for a bad endpoint or keys). */
tdm_sock_t *tdm_sock_connect(tdm_net_t *net, const char *endpoint, const tdm_sock_opts_t *opts,
                             tdm_error_t *err);

/* Closes the socket (linger 0: unsent messages are dropped and their zero-copy data released
 * through the free callbacks). NULL-safe, nulls *self_p. */
void tdm_sock_destroy(tdm_sock_t **self_p);

/* Whether the last handshake of a socket made with watch_handshake failed: TDM_OK when it
 * succeeded or none finished yet (or the socket does not watch), TDM_EUNAUTHENTICATED with
 * why (cap bytes) saying how (the peer refused our CURVE key; the peer's key is not the one
 * configured). A failed handshake is never retried into success by ZeroMQ with the same
 * keys, so callers fail what waits on the connection and say why. Reads the socket's monitor
 * without blocking; call from the socket's thread. */
int tdm_sock_handshake(tdm_sock_t *s, char *why, size_t cap);

/* How many established connections of a socket made with watch_handshake dropped (peer
 * closed, reset, or silent past the ZMTP heartbeat timeout), from its monitor; 0 for a socket
 * that does not watch. Monotonic. Reads the monitor without blocking; call from the socket's
 * thread. */
uint64_t tdm_sock_disconnects(tdm_sock_t *s);

/* How many handshakes of a socket made with watch_handshake succeeded (a connection ready to
 * carry messages, whatever the mechanism), from its monitor; 0 for a socket that does not
 * watch. Monotonic. Reads the monitor without blocking; call from the socket's thread. */
uint64_t tdm_sock_handshakes(tdm_sock_t *s);

/* Whether a connecting socket made with watch_handshake (one peer) has a connection up now: its
 * monitor's last connection event was a handshake success, not a DISCONNECTED. (Counting
 * handshakes against disconnects does not tell it: libzmq also reports DISCONNECTED after a
 * failed handshake, so one failure leaves the counts even while a later connection is up.)
 * false for a socket that does not watch. Reads the monitor without blocking; call from the
 * socket's thread. */
bool tdm_sock_connected(tdm_sock_t *s);

/* The ZMQ socket, for zmq_poll (ZMQ_POLLIN). Do not send or receive on it directly. */
void *tdm_sock_zsock(tdm_sock_t *s);

/* The endpoint actually bound or connected (a "tcp://127.0.0.1:*" bind reports its port). */
const char *tdm_sock_endpoint(const tdm_sock_t *s);

void tdm_sock_stats(const tdm_sock_t *s, tdm_sock_stats_t *out);

/* CURVE handshakes a CURVE server socket (tdm_sock_bind with curve keys) refused since it was
 * bound: a client key it does not admit (ZAP: the reason names the key and the address), a
 * peer without CURVE (ZAP), and, when bound with watch_handshake, handshakes that failed
 * before ZAP (the client does not hold this server's public key, or speaks no CURVE). The
 * most recent refusal's reason goes to why (cap bytes, "" when none; may be NULL), its
 * tdm_time_now to *at (may be NULL). 0 for a socket without CURVE. Reads the monitor without
 * blocking; call from the socket's thread. */
uint64_t tdm_sock_curve_refusals(tdm_sock_t *s, char *why, size_t cap, double *at);

/* Last error message of the socket ("" if none). */
const char *tdm_sock_errmsg(const tdm_sock_t *s);

/* A received message. The body and data frames point into ZMQ message buffers owned by the
 * frame until tdm_frame_clear. */
typedef struct tdm_frame {
    uint8_t peer[TDM_NET_PEER_MAX]; /* ROUTER: sender's routing id */
    size_t peer_len;                /* 0 on a DEALER socket */
    uint32_t version_major, version_minor;
    int kind;   /* TANDEM__V1__FRAME_KIND__* */
    int method; /* TANDEM__V1__METHOD__* */
    uint64_t call_id;
    int status;                   /* END: tdm status (0 or negative, -gRPC code) */
    char message[TDM_ERRMSG_MAX]; /* END: error text ("" on success) */
    uint64_t deadline_unix_ms;    /* REQUEST: 0 = none */
    uint64_t instance_id;         /* the sender's instance (FrameHeader.instance_id); 0 = none */
    char api_key[TDM_NET_API_KEY_MAX];
    char user_id[TDM_NET_USER_ID_MAX]; /* CURVE: the name the server admitted the sender's key
                                          as (tdm_curve_peer_t.name, ZAP User-Id); "" on a
                                          connection without CURVE */
    const uint8_t *body;               /* body frame, NULL when none */
    size_t body_len;
    uint32_t n_data; /* data frames */
    void *impl;      /* zmq_msg_t storage; private */
    size_t impl_cap;
} tdm_frame_t;

/* Initialises an empty frame (no allocation). Cannot fail. */
void tdm_frame_init(tdm_frame_t *f);

/* Releases what the frame holds and empties it; the frame may be reused. NULL-safe. */
void tdm_frame_clear(tdm_frame_t *f);

/* Moves src's message into dst (cleared first): body and data stay where they are, owned by
 * dst now; src is left empty. Cannot fail. */
void tdm_frame_move(tdm_frame_t *dst, tdm_frame_t *src);

/* Data frame i (< f->n_data): its bytes and length; valid until tdm_frame_clear. */
const uint8_t *tdm_frame_data(const tdm_frame_t *f, uint32_t i, size_t *len);

/* Receives the next valid message into f (cleared first). timeout_ms: 0 = do not wait,
 * < 0 = wait forever. Malformed input is answered or dropped and counted (see the file
 * comment), and the call goes on waiting within the same timeout. Returns 0 with f filled,
 * TDM_EDEADLINE when nothing arrived in time, TDM_ECANCELLED when the context is shutting
 * down or the call was interrupted (EINTR: a signal), TDM_EINTERNAL on other ZMQ errors. */
int tdm_sock_recv(tdm_sock_t *s, tdm_frame_t *f, int timeout_ms);

/* Data to append as raw frames after the body. With free_fn set the bytes are sent without
 * copying (zmq_msg_init_data) and free_fn(ptr, hint) runs, on a ZMQ I/O thread, once ZMQ no
 * longer needs them: it must be thread-safe and must not call ZMQ. free_fn NULL: copied.
 * tdm_sock_send takes ownership of the data in every case: each free_fn runs exactly once
 * whatever it returns; when the send fails (or a zero-length frame is sent) the callbacks
 * of the frames ZMQ never took run before tdm_sock_send returns, on the calling thread. */
typedef struct tdm_net_data {
    const void *ptr;
    size_t len;
    void (*free_fn)(void *ptr, void *hint);
    void *hint;
} tdm_net_data_t;

/* What to send. Fields not used by the kind are ignored. */
typedef struct tdm_send {
    const uint8_t *peer; /* ROUTER sockets: destination routing id; DEALER: NULL */
    size_t peer_len;
    int kind; /* TANDEM__V1__FRAME_KIND__* */
    int method;
    uint64_t call_id;
    int status;          /* END: tdm status (0 or negative) */
    const char *message; /* END: error text; NULL = "" */
    uint64_t deadline_unix_ms;
    const char *api_key;          /* NULL = none */
    const ProtobufCMessage *body; /* NULL = no body frame */
    const tdm_net_data_t *data;   /* n_data raw frames */
    uint32_t n_data;
    bool anonymous; /* FrameHeader.instance_id 0, not the socket's: for a peer that has not
                       authenticated (registered) and must not learn the sender's instance */
} tdm_send_t;

/* Sends one message without blocking. If sending fails part-way (peer gone, queue full),
 * every zero-copy free_fn still runs exactly once (see tdm_net_data_t). An END message longer
 * than TDM_ERRMSG_MAX - 1 bytes is cut (at a UTF-8 character boundary). Returns 0;
 * TDM_EUNAVAILABLE when the peer is unknown or gone (ROUTER) or the queue is full;
 * TDM_EINVALID when a limit above is exceeded, the kind is unknown, an END status is
 * positive or a ROUTER send has no peer (nothing sent); TDM_ERESOURCE on out of memory.
 * The reason is in tdm_sock_errmsg. */
int tdm_sock_send(tdm_sock_t *s, const tdm_send_t *m);

/* Shorthands over tdm_sock_send. `to` is the frame being answered (its peer and call id). */
int tdm_sock_reply(tdm_sock_t *s, const tdm_frame_t *to, const ProtobufCMessage *body);
int tdm_sock_reply_error(tdm_sock_t *s, const tdm_frame_t *to, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* tdm_sock_reply_error for a peer that has not authenticated (a refused registration, a frame
 * from a connection that is no registered node): the END's header carries instance_id 0, so
 * that only a registered peer learns the sender's instance. Same returns. */
int tdm_sock_refuse(tdm_sock_t *s, const tdm_frame_t *to, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
int tdm_sock_stream(tdm_sock_t *s, const tdm_frame_t *to, const ProtobufCMessage *body);
/* A one-way message to peer (ROUTER; NULL/0 on DEALER). */
int tdm_sock_notify(tdm_sock_t *s, const uint8_t *peer, size_t peer_len, int method,
                    const ProtobufCMessage *body);

/* Decodes f's body as the message type desc (e.g. &tandem__v1__generate_request__descriptor).
 * A missing body decodes as the empty message. Returns the message (caller frees with
 * protobuf_c_message_free_unpacked(msg, NULL)) or NULL when the body does not decode. */
ProtobufCMessage *tdm_frame_unpack(const tdm_frame_t *f, const ProtobufCMessageDescriptor *desc);

/* True when f carries a deadline that has passed at unix time now_ms. */
bool tdm_frame_expired(const tdm_frame_t *f, uint64_t now_ms);

/* Milliseconds since the Unix epoch (CLOCK_REALTIME), for deadlines. */
uint64_t tdm_net_now_ms(void);

/* Name of a method ("GENERATE") / frame kind ("REQUEST"), "?" when unknown. */
const char *tdm_net_method_name(int method);
const char *tdm_net_kind_name(int kind);

/* ---- blocking client calls (CLI, tests, client library) ---- */

/* Unary call on a DEALER socket: sends REQUEST(method, req) with call id call_id and the
 * deadline (timeout_ms from now; <= 0: none), then waits for the END of that call id,
 * discarding frames of other calls. On success *resp_out is the decoded response of type
 * resp_desc (caller frees with protobuf_c_message_free_unpacked). On timeout a CANCEL is
 * sent and TDM_EDEADLINE returned. Errors: the status of the END (message in *err), or
 * TDM_EINTERNAL when the response does not decode, or what tdm_sock_send / tdm_sock_recv
 * return. api_key may be NULL; resp_desc or resp_out NULL: the response body is ignored. */
int tdm_sock_call(tdm_sock_t *s, int method, uint64_t call_id, const char *api_key,
                  const ProtobufCMessage *req, const ProtobufCMessageDescriptor *resp_desc,
                  int timeout_ms, ProtobufCMessage **resp_out, tdm_error_t *err);

/* ---- CURVE keys ---- */

/* Makes a new CURVE key pair (Z85, 41 bytes each with the NUL). Returns 0, or
 * TDM_EPRECONDITION when libzmq was built without CURVE. */
int tdm_net_curve_keypair(char public_key[41], char secret_key[41]);

/* Checks that text is a 40-character Z85 key; TDM_EINVALID naming `what` otherwise. */
int tdm_net_curve_key_check(const char *text, const char *what, tdm_error_t *err);

/* Reads the secret key file at path into secret (40 Z85 characters and a NUL): the file must
 * hold exactly the key (one trailing newline allowed), must not be readable by group or others
 * (mode & 077 == 0), and the key must be the secret of public_key (zmq_curve_public). `what`
 * names the config key that gave the path in messages ("router.curve_secret_key_file").
 * Returns 0; TDM_ENOTFOUND (no such file), TDM_EPRECONDITION (mode & 077 set: the message
 * names the path, the mode and the chmod that fixes it; or libzmq without CURVE),
 * TDM_EUNAVAILABLE (the file cannot be read), TDM_EINVALID (not a regular file, not a Z85
 * key, or not public_key's secret). On error secret holds "". */
int tdm_net_curve_secret_read(const char *path, const char *public_key, const char *what,
                              char secret[41], tdm_error_t *err);

/* Overwrites n bytes at p with zeros, in stores the compiler keeps even when p is not read
 * again: for copies of secret keys. Cannot fail. */
void tdm_net_curve_wipe(void *p, size_t n);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_NET_H */
