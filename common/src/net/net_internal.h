/* net_internal.h - what the net module's files share, and the socket-free validation path
 * that tdm_sock_recv uses (exposed so that tests/fuzz/fuzz_frame.c can drive it directly).
 *
 * A received ZeroMQ message is a list of parts (identity on a ROUTER socket, FrameHeader,
 * optional body, data frames). tdm_net_parse looks only at the parts' lengths before it
 * decodes anything, decodes the FrameHeader (at most TDM_NET_MAX_HEADER_BYTES), and says
 * whether the message is accepted, must be answered with an END carrying a status, or must
 * be dropped. It never allocates more than protobuf-c needs for the bounded header.
 */
#ifndef TANDEM_NET_INTERNAL_H
#define TANDEM_NET_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <zmq.h>

#include "tandem/net.h"

/* Parts a message may have: identity + header + body + data frames. Parts beyond this are
 * drained unread by tdm_sock_recv and the message is refused. */
#define TDM_NET_MAX_PARTS (3u + TDM_NET_MAX_DATA_FRAMES)

/* One received part: bytes and length (ptr may be NULL when len is 0). */
typedef struct tdm_net_part {
    const uint8_t *ptr;
    size_t len;
} tdm_net_part_t;

/* What to do with a message. */
typedef enum tdm_net_verdict {
    TDM_NET_ACCEPT = 0, /* hand it to the caller */
    TDM_NET_REJECT = 1, /* answer END(why->code, why->msg) to f->peer / f->call_id */
    TDM_NET_DROP = 2,   /* no way to answer: drop it and log why->msg */
} tdm_net_verdict_t;

/* Where the body and data frames are in parts[] (valid on TDM_NET_ACCEPT). */
typedef struct tdm_net_layout {
    size_t header;     /* index of the FrameHeader part */
    size_t body;       /* index of the body part; SIZE_MAX when the message has none */
    size_t first_data; /* index of data frame 0 */
} tdm_net_layout_t;

/* Validates and decodes one message. parts[0 .. n_parts) are the parts that were kept;
 * n_total >= n_parts is how many parts the message had (more were drained unread when it had
 * too many). router: the first part is the sender's routing id.
 *
 * On TDM_NET_ACCEPT, f's header fields (peer, version, kind, method, call id, status,
 * message, deadline, api key) are filled, f->body points at the body part's bytes (NULL when
 * none; a zero-length body gives a non-NULL pointer), f->body_len and f->n_data are set, and
 * *layout says where the parts are; f->impl is not touched.
 * On TDM_NET_REJECT, f's header fields are filled as far as decoded (peer, kind REQUEST, method,
 * call id) and *why holds the status and message of the END to send.
 * On TDM_NET_DROP, *why says why (its code is the status the message deserved).
 * Cannot fail otherwise; never reads beyond parts[i].len bytes of any part, and never reads
 * the body or data bytes at all. */
tdm_net_verdict_t tdm_net_parse(const tdm_net_part_t *parts, size_t n_parts, size_t n_total,
                                bool router, tdm_frame_t *f, tdm_net_layout_t *layout,
                                tdm_error_t *why);

/* What a received tdm_frame_t holds (f->impl): the ZMQ messages of its body and data frames,
 * body first when there is one. f->impl_cap is n_msgs. */
typedef struct tdm_net_frame_impl {
    size_t n_msgs;     /* open messages in msgs[] */
    size_t first_data; /* index of data frame 0 in msgs[] (0 or 1) */
    zmq_msg_t msgs[];  /* [n_msgs] */
} tdm_net_frame_impl_t;

/* Clears f's header fields (everything but impl/impl_cap). */
void tdm_net_frame_reset_fields(tdm_frame_t *f);

/* ---- ZAP (net.c) ---- */

#define TDM_NET_ZAP_DOMAIN_MAX 32 /* bytes of a ZAP domain with its NUL */

/* One admitted client key of a CURVE server socket and the User-Id its connections get. */
typedef struct tdm_net_zap_key {
    uint8_t key[32];                /* the client's public key, decoded */
    char name[TDM_NET_USER_ID_MAX]; /* answered as the ZAP User-Id */
} tdm_net_zap_key_t;

/* Registers a CURVE server socket that admits only the clients whose 32-byte public keys are
 * in keys[0 .. n_keys) (copied; none: nobody), starting the context's ZAP handler on first use;
 * writes the ZAP domain the socket must set (ZMQ_ZAP_DOMAIN) to domain. A handshake with
 * keys[i].key is answered 200 with User-Id keys[i].name. Refusals are logged through log (may
 * be NULL; must outlive the registration). Returns 0, TDM_EPRECONDITION (another ZAP handler
 * holds the context's ZAP endpoint), TDM_ERESOURCE. */
int tdm_net_zap_register(tdm_net_t *net, const tdm_net_zap_key_t *keys, size_t n_keys,
                         const tdm_logger_t *log, char domain[TDM_NET_ZAP_DOMAIN_MAX],
                         tdm_error_t *err);

/* Forgets a domain: later handshakes on it are refused. Cannot fail. */
void tdm_net_zap_unregister(tdm_net_t *net, const char *domain);

/* Handshakes refused on domain so far; the last one's reason in why (cap bytes, "" when none;
 * may be NULL) and its tdm_time_now in *at (may be NULL). 0 for an unknown domain. */
uint64_t tdm_net_zap_refusals(tdm_net_t *net, const char *domain, char *why, size_t cap,
                              double *at);

/* Length of the longest prefix of s that fits in a buffer of cap bytes (>= 1) with its NUL
 * without cutting a UTF-8 character. Cannot fail. */
size_t tdm_net_text_fit(const char *s, size_t cap);

/* ---- sockets (sock.c, sock_send.c, sock_recv.c) ---- */

#define SOCK_ENDPOINT_MAX 256

struct tdm_sock {
    tdm_net_t *net;
    void *zs;
    bool router;
    int sndhwm;
    char endpoint[SOCK_ENDPOINT_MAX];
    char zap_domain[TDM_NET_ZAP_DOMAIN_MAX]; /* "" when not a CURVE server */
    const tdm_logger_t *log;
    uint64_t instance_id; /* stamped into every header sent */
    tdm_sock_stats_t stats;
    char errmsg[TDM_ERRMSG_MAX];
    zmq_msg_t *scratch;    /* [scratch_cap] parts of the message being received */
    tdm_net_part_t *views; /* [scratch_cap] their bytes, for tdm_net_parse */
    size_t scratch_cap;
    void *monitor;        /* watch_handshake: PAIR receiving the socket's handshake events */
    bool hs_failed;       /* the last handshake event was a failure */
    char hs_why[160];     /* what it said */
    uint64_t disconnects; /* established connections the monitor saw drop */
    bool up;             /* the last connection event was a handshake success, not a DISCONNECTED */
    uint64_t handshakes; /* handshakes the monitor saw succeed */
    uint64_t hs_failures; /* handshakes the monitor saw fail before ZAP (protocol, no detail) */
    double hs_failed_at;  /* tdm_time_now of the last */
};

/* Formats the socket's last error message (tdm_sock_errmsg). Cannot fail (truncates). */
void tdm_sock_set_errmsg(tdm_sock_t *s, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Printable form of a routing id into buf (cap bytes with the NUL): the text when it is
 * printable ASCII, else hex. Returns buf. Cannot fail (truncates). */
const char *tdm_sock_peer_str(const uint8_t *peer, size_t len, char *buf, size_t cap);

#endif /* TANDEM_NET_INTERNAL_H */
