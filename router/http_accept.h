/* http_accept.h - the HTTP gateway's front door (http_accept.c): its own listening socket and
 * accept thread, which hold every new connection until its request headers are complete, check
 * their framing, enforce the connection limits with an answer (429, 503) instead of a silent
 * close, and only then hand the connection to libmicrohttpd (MHD_add_connection). It also
 * keeps the deadlines libmicrohttpd 0.9.75 has no option for: headers within
 * router.http_header_timeout_s, a body at router.http_min_body_rate at least, and eviction of
 * the slowest connection when the table is full.
 */
#ifndef TANDEM_ROUTER_HTTP_ACCEPT_H
#define TANDEM_ROUTER_HTTP_ACCEPT_H

#include <stdbool.h>
#include <stdint.h>
#include <sys/socket.h>

#include <microhttpd.h>

#include "http_metrics.h"
#include "tandem/base.h"
#include "tandem/config.h"
#include "tandem/log.h"

typedef struct http_acc http_acc_t;

/* What a connection handed to libmicrohttpd is doing: waiting for its next request
 * (keep-alive), receiving the headers of one whose request line has arrived, receiving a
 * request body, or being answered (handler running, parked or streaming). Only the first three
 * are ever closed by the front door; the second and third with a 408 that says why. */
typedef enum http_acc_phase {
    HTTP_ACC_IDLE,
    HTTP_ACC_HEADERS,
    HTTP_ACC_BODY,
    HTTP_ACC_BUSY,
} http_acc_phase_t;

/* The framing of a request as its header block states it (http_acc_frame_read). */
typedef struct http_acc_frame {
    char path[64]; /* the target's path, cut at '?' (only /health and /ready matter) */
    unsigned http_status;
    const char *code; /* OpenAI's error code of the refusal (static) */
    char why[256];    /* the refusal's message; "" when the request may go on */
    bool need_more;   /* a chunked body's first chunk line is not whole yet: wait for it */
} http_acc_frame_t;

/* Longest chunk line (hex size, then chunk extensions) the front door lets through, bytes. */
#define HTTP_ACC_CHUNK_LINE_MAX 4096

/* Offset just past the blank line (CRLF CRLF, or LF LF) that ends the header block in b[0..n),
 * or 0 while it is incomplete. Cannot fail. */
size_t http_acc_header_end(const char *b, size_t n);

/* Reads the request line and the framing headers of the header block b[0..hlen) (hlen from
 * http_acc_header_end, followed by n - hlen more bytes already received) into *fr: refused
 * (fr->why set, fr->http_status 400 or 413) without a method, with a NUL (raw or %00) in the
 * path, a header line with a blank before its colon, beginning with a blank (obs-fold) or
 * without a colon, an HTTP/1.1 request without exactly one Host line, two Content-Length or
 * two Transfer-Encoding lines, both, a Content-Length that is not 1..19 digits (or is followed
 * by blanks), a Transfer-Encoding other than chunked, a chunk line received over
 * HTTP_ACC_CHUNK_LINE_MAX bytes or a first chunk over TDM_HTTP_MAX_BODY_BYTES. fr->need_more
 * when the first chunk line has not all arrived (and no "Expect: 100-continue"). Cannot
 * fail. */
void http_acc_frame_read(const char *b, size_t hlen, size_t n, http_acc_frame_t *fr);

/* Open files the gateway needs for router.http_max_connections connections: a socket and a
 * call's eventfd each, plus 256 for the router's own (ZMQ, logs, models). */
uint64_t http_acc_files_needed(int max_connections);

/* Raises RLIMIT_NOFILE's soft limit to http_acc_files_needed(max_connections) when it is lower.
 * TDM_ERESOURCE when the hard limit is lower, naming both numbers. */
int http_acc_raise_nofile(int max_connections, tdm_error_t *err);

/* Binds and listens on sa (len bytes) with the limits of cfg->router (borrowed; outlives the
 * front door); counters and log are borrowed too. Returns NULL with *err set: TDM_EUNAVAILABLE
 * (the address cannot be bound; the message names host and port), TDM_ERESOURCE. Free with
 * http_acc_destroy. */
http_acc_t *http_acc_new(const tdm_config_t *cfg, const struct sockaddr *sa, socklen_t len,
                         const char *host, http_counters_t *counters, const tdm_logger_t *log,
                         tdm_error_t *err);

/* The port it listens on. */
uint16_t http_acc_port(const http_acc_t *a);

/* Starts the accept thread, which hands complete requests to mhd (started with
 * MHD_USE_NO_LISTEN_SOCKET | MHD_USE_ITC). TDM_ERESOURCE when no thread can start. */
int http_acc_start(http_acc_t *a, struct MHD_Daemon *mhd, tdm_error_t *err);

/* Stops and joins the accept thread and closes the connections it still holds (not those of
 * libmicrohttpd). Call before MHD_stop_daemon. Idempotent; NULL-safe. */
void http_acc_stop(http_acc_t *a);

/* http_acc_stop, then closes the listening socket and frees. Call after MHD_stop_daemon (its
 * closing connections report here). NULL-safe, nulls *a_p. */
void http_acc_destroy(http_acc_t **a_p);

/* libmicrohttpd's side, from its threads. fd is the connection's socket; gen the number
 * http_acc_started returned for it (a stale report, of a connection whose fd was reused since,
 * is ignored). */

/* A connection handed over has started; returns its generation. */
uint32_t http_acc_started(http_acc_t *a, int fd);
/* It has closed: its slot and its address's count are freed. */
void http_acc_closed(http_acc_t *a, int fd, uint32_t gen);
/* It entered phase (HEADERS: a request line was read; BODY: a request's headers were read;
 * BUSY: it is being answered, reported before any answer is queued; IDLE: the answer is
 * done). */
void http_acc_phase(http_acc_t *a, int fd, uint32_t gen, http_acc_phase_t phase);
/* n more body bytes arrived. */
void http_acc_body(http_acc_t *a, int fd, uint32_t gen, uint64_t n);

#endif /* TANDEM_ROUTER_HTTP_ACCEPT_H */
