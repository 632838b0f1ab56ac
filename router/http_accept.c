/* http_accept.c - the HTTP gateway's front door: its own listening socket and one accept thread
 * that holds each new connection until its request headers are complete, then hands it to
 * libmicrohttpd (MHD_add_connection; the daemon runs with MHD_USE_NO_LISTEN_SOCKET).
 *
 * Why its own accept loop: libmicrohttpd 0.9.75 closes a connection over its per-address or
 * global limit without a word, has no public way to close one connection (so none to evict
 * the slowest when the table is full), times out only on inactivity (a byte every few seconds
 * keeps a slowloris alive for ever) and answers some malformed headers itself before the
 * handler runs (a Content-Length of "abc" got its status line and headers twice). Here:
 *
 * - a connection waits in this thread, costing a socket and a table slot, until its header
 *   block is complete, read with MSG_PEEK so that libmicrohttpd reads the same bytes later; a
 *   header block that frames its body ambiguously (RFC 9112 6.3) or has no method gets one 400
 *   and is closed, before libmicrohttpd sees it;
 * - headers must be complete within router.http_header_timeout_s (else 408 and close); a
 *   connection over its address's cap (router.http_max_connections_per_client) gets
 *   ACC_OVER_GRACE_S, and then or once its headers are in, a 429 with Retry-After, except for
 *   /health and /ready, which are always served;
 * - when router.http_max_connections are open, a new one takes the place of the connection that
 *   has sent least for longest: the oldest still sending its headers here, else the one idle
 *   longest between two requests in libmicrohttpd; a connection with a request in progress is
 *   never chosen. With no such connection, up to ACC_PROBE_RESERVE more are taken for /health
 *   and /ready only (anything else on them, and any connection past those, gets 503 with
 *   Retry-After);
 * - in libmicrohttpd, a connection idle between requests longer than
 *   router.http_connection_timeout_s, or whose request body arrives slower than
 *   router.http_min_body_rate (averaged from the headers' end, after a grace of
 *   router.http_header_timeout_s), is shut down from here (shutdown(2): libmicrohttpd sees the
 *   end of the stream and closes it as usual).
 *
 * The table is an array indexed by file descriptor (untouched pages cost nothing), guarded by
 * one mutex that libmicrohttpd's threads take to report what a connection does. A slot's
 * generation tells a report about a reused fd from one about the current connection; a socket
 * in libmicrohttpd is only shut down while its slot is live and its inode is the one accepted.
 */
#define _GNU_SOURCE /* accept4, memmem */
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <jansson.h>

#include "http.h"
#include "http_accept.h"
#include "http_conv.h"
#include "http_json.h"

#define ACC_HEADER_MAX 16384  /* bytes of request line and headers, at most */
#define ACC_OVER_GRACE_S 2.0  /* over its address's cap: time to send its headers, s */
#define ACC_SWEEP_MS 250      /* deadlines are checked this often */
#define ACC_ACCEPT_BURST 64   /* connections accepted per wake-up */
#define ACC_FILES_RESERVE 256 /* open files of the router besides the connections' */
#define ACC_PROBE_RESERVE 16  /* connections taken past the limit, for /health and /ready */
#define ACC_LINGER_MAX 256    /* answered connections whose rest is read before closing */
#define ACC_LINGER_S 2.0      /* how long that rest is read, s */
#define ACC_LINGER_BYTES (64u << 20)

enum { SLOT_FREE, SLOT_PENDING, SLOT_MHD };

/* What a pending connection may do once its headers are in. */
enum {
    ADMIT_ANY,  /* any request */
    ADMIT_OVER, /* over its address's cap: /health and /ready, else 429 */
    ADMIT_BUSY, /* taken past a full table (ACC_PROBE_RESERVE): /health and /ready, else 503 */
};

/* One client address and its open connections. */
typedef struct acc_addr {
    struct acc_addr *next;
    uint8_t key[16]; /* IPv6, or IPv4 mapped into it */
    uint32_t count;
} acc_addr_t;

typedef struct acc_slot {
    uint8_t state; /* SLOT_* */
    uint8_t phase; /* SLOT_MHD: http_acc_phase_t */
    uint8_t admit; /* SLOT_PENDING: ADMIT_* */
    bool evicting; /* SLOT_MHD: shut down from here, its close not reported yet */
    uint32_t gen;  /* bumped when the slot is freed */
    ino_t ino;     /* the socket's inode */
    acc_addr_t *addr;
    double t_open;  /* accepted, s (tdm_time_now) */
    double t_phase; /* SLOT_MHD: entered its phase, s */
    uint64_t bytes; /* SLOT_PENDING: header bytes seen; SLOT_MHD, BODY: body bytes */
    int prev, next; /* its list (pending or mhd); -1 ends */
    struct sockaddr_storage sa;
    socklen_t sa_len;
} acc_slot_t;

typedef struct acc_list {
    int head, tail;
} acc_list_t;

/* A connection answered by the front door whose request is still arriving: what arrives is
 * read and dropped until the client closes, so that closing does not reset the connection
 * (and lose the answer) under a client still sending its body. */
typedef struct acc_linger {
    int fd; /* -1: free */
    double until;
    uint64_t bytes;
} acc_linger_t;

struct http_acc {
    const tdm_router_config_t *rc;
    http_counters_t *counters;
    tdm_logger_t log;
    int lfd, ep, wake_fd;
    bool lfd_watched; /* accept thread only: lfd is in ep (not while out of files) */
    acc_linger_t linger[ACC_LINGER_MAX]; /* accept thread only */
    uint16_t port;
    struct MHD_Daemon *mhd;
    pthread_t thread;
    bool started;
    pthread_mutex_t mu;
    /* under mu: */
    bool stopping;
    acc_slot_t *slots; /* [n_slots] by fd */
    size_t n_slots;
    acc_addr_t **buckets; /* [n_buckets] */
    size_t n_buckets;
    acc_list_t pending, in_mhd;
    size_t n_open, n_evicting;
    size_t n_busy; /* pending ADMIT_BUSY */
};

/* ---- the table (a->mu held) ---- */

static void list_add(acc_slot_t *s, acc_list_t *l, int i)
{
    s[i].prev = l->tail;
    s[i].next = -1;
    if (l->tail >= 0)
        s[l->tail].next = i;
    else
        l->head = i;
    l->tail = i;
}

static void list_del(acc_slot_t *s, acc_list_t *l, int i)
{
    if (s[i].prev >= 0)
        s[s[i].prev].next = s[i].next;
    else
        l->head = s[i].next;
    if (s[i].next >= 0)
        s[s[i].next].prev = s[i].prev;
    else
        l->tail = s[i].prev;
    s[i].prev = s[i].next = -1;
}

static void addr_key(const struct sockaddr_storage *sa, uint8_t key[16])
{
    memset(key, 0, 16);
    if (sa->ss_family == AF_INET) {
        key[10] = key[11] = 0xff;
        memcpy(key + 12, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    } else if (sa->ss_family == AF_INET6) {
        memcpy(key, &((const struct sockaddr_in6 *)sa)->sin6_addr, 16);
    }
}

/* The address's entry, made with count 0 when new; NULL on out of memory. */
static acc_addr_t *addr_get(http_acc_t *a, const uint8_t key[16])
{
    uint64_t hv = 1469598103934665603ull; /* FNV-1a */
    for (int i = 0; i < 16; i++)
        hv = (hv ^ key[i]) * 1099511628211ull;
    acc_addr_t **b = &a->buckets[hv % a->n_buckets];
    for (acc_addr_t *e = *b; e; e = e->next)
        if (memcmp(e->key, key, 16) == 0)
            return e;
    acc_addr_t *e = calloc(1, sizeof *e);
    if (!e)
        return NULL;
    memcpy(e->key, key, 16);
    e->next = *b;
    *b = e;
    return e;
}

static void addr_put(http_acc_t *a, acc_addr_t *e)
{
    if (!e || --e->count > 0)
        return;
    uint64_t hv = 1469598103934665603ull;
    for (int i = 0; i < 16; i++)
        hv = (hv ^ e->key[i]) * 1099511628211ull;
    for (acc_addr_t **p = &a->buckets[hv % a->n_buckets]; *p; p = &(*p)->next)
        if (*p == e) {
            *p = e->next;
            free(e);
            return;
        }
}

/* Frees slot fd: off its list, its address's count and the open count down. */
static void slot_free(http_acc_t *a, int fd)
{
    acc_slot_t *s = &a->slots[fd];
    list_del(a->slots, s->state == SLOT_PENDING ? &a->pending : &a->in_mhd, fd);
    addr_put(a, s->addr);
    if (s->admit == ADMIT_BUSY)
        a->n_busy--;
    if (s->evicting)
        a->n_evicting--;
    a->n_open--;
    uint32_t gen = s->gen + 1;
    memset(s, 0, sizeof *s);
    s->gen = gen;
    s->prev = s->next = -1;
}

/* The connection to close for a new one when the table is full: the oldest still sending its
 * headers (over-cap ones first; never one taken for a probe), else, in libmicrohttpd, the one
 * idle longest between requests or waiting longest for a later request's headers. -1: none. */
static int pick_victim(http_acc_t *a)
{
    int oldest = -1;
    for (int i = a->pending.head; i >= 0; i = a->slots[i].next) {
        if (a->slots[i].admit == ADMIT_OVER)
            return i;
        if (oldest < 0 && a->slots[i].admit == ADMIT_ANY)
            oldest = i;
    }
    if (oldest >= 0)
        return oldest;
    int best = -1;
    for (int i = a->in_mhd.head; i >= 0; i = a->slots[i].next) {
        const acc_slot_t *s = &a->slots[i];
        if (!s->evicting && (s->phase == HTTP_ACC_IDLE || s->phase == HTTP_ACC_HEADERS) &&
            (best < 0 || s->t_phase < a->slots[best].t_phase))
            best = i;
    }
    return best;
}

/* ---- answers of the front door ---- */

static const char *reason_phrase(unsigned code)
{
    switch (code) {
    case 400: return "Bad Request";
    case 408: return "Request Timeout";
    case 413: return "Content Too Large";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 505: return "HTTP Version Not Supported";
    default: return "Service Unavailable";
    }
}

/* Writes one answer (OpenAI's error body for status with msg, Connection: close, Retry-After: 1
 * on a 429 or 503) to socket fd without blocking; what does not fit the socket's buffer is
 * lost (an error answer is far smaller). */
static void answer_send(http_acc_t *a, int fd, unsigned http_status, int status, const char *code,
                        const char *msg)
{
    tdm_buf_t body = TDM_BUF_INIT;
    json_t *v = http_error_json(status, code, NULL, msg);
    bool ok = v && http_json_append(&body, v) == TDM_OK && tdm_buf_append(&body, "\n", 1) == 0;
    json_decref(v);
    char rid[TDM_REQUEST_ID_MAX + 1], head[512], date[64] = "";
    http_request_id_new(rid, sizeof rid);
    time_t t = time(NULL);
    struct tm tm;
    if (gmtime_r(&t, &tm)) /* RFC 9110 5.6.7 IMF-fixdate */
        strftime(date, sizeof date, "%a, %d %b %Y %H:%M:%S GMT", &tm);
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.1 %u %s\r\nDate: %s\r\nContent-Type: application/json\r\n"
                      "Cache-Control: no-store\r\nConnection: close\r\nX-Request-Id: %s\r\n"
                      "%sContent-Length: %zu\r\n\r\n",
                      http_status, reason_phrase(http_status), date, rid,
                      http_status == 429 || http_status == 503 ? "Retry-After: 1\r\n" : "",
                      ok ? body.len : 0);
    if (hn > 0 && (size_t)hn < sizeof head) {
        struct iovec iov[2] = {{head, (size_t)hn}, {body.data, ok ? body.len : 0}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
        if (sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT) > 0)
            http_counters_response(a->counters, http_status);
    }
    tdm_buf_free(&body);
}

/* Writes one answer (answer_send) to a socket of the front door, reads what has arrived (so
 * that closing does not reset the connection under the answer) and closes it. */
static void answer_close(http_acc_t *a, int fd, unsigned http_status, int status, const char *code,
                         const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void answer_close(http_acc_t *a, int fd, unsigned http_status, int status, const char *code,
                         const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    answer_send(a, fd, http_status, status, code, msg);
    shutdown(fd, SHUT_WR);
    /* read the rest of the request before closing (a lingering close), while there is room */
    for (int i = 0; i < ACC_LINGER_MAX; i++)
        if (a->linger[i].fd < 0) {
            struct epoll_event ee = {.events = EPOLLIN | EPOLLRDHUP, .data = {.fd = fd}};
            if (epoll_ctl(a->ep, EPOLL_CTL_ADD, fd, &ee) != 0 && errno != EEXIST)
                break;
            a->linger[i] = (acc_linger_t){fd, tdm_time_now() + ACC_LINGER_S, 0};
            return;
        }
    close(fd);
}

/* Shuts down the socket of in_mhd slot fd when it is still the one accepted (libmicrohttpd
 * then closes it and reports), first writing a 408 that says why (msg) when msg is not NULL.
 * Only a connection waiting for its headers or body gets an answer: nothing has been written
 * on it since its last answer, and a handler about to answer it reports HTTP_ACC_BUSY under
 * a->mu first, which is held here, so the two never both write (a->mu held). */
static void slot_evict(http_acc_t *a, int fd, const char *msg)
{
    acc_slot_t *s = &a->slots[fd];
    struct stat st;
    if (fstat(fd, &st) == 0 && st.st_ino == s->ino) {
        if (msg)
            answer_send(a, fd, 408, TDM_EDEADLINE, "request_timeout", msg);
        shutdown(fd, SHUT_RDWR);
    }
    s->evicting = true;
    a->n_evicting++;
}

/* Reads and drops what arrived on lingering connection i; closes it at the client's end, past
 * ACC_LINGER_BYTES or at its deadline (expired). */
static void linger_read(http_acc_t *a, int i, bool expired)
{
    acc_linger_t *l = &a->linger[i];
    char junk[16384];
    ssize_t n = 0;
    while (!expired && l->bytes < ACC_LINGER_BYTES &&
           (n = recv(l->fd, junk, sizeof junk, MSG_DONTWAIT)) > 0)
        l->bytes += (uint64_t)n;
    bool wait = !expired && l->bytes < ACC_LINGER_BYTES && n < 0 &&
                (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR);
    if (wait)
        return;
    close(l->fd); /* also leaves ep */
    l->fd = -1;
}

/* True when fd is a lingering connection (its event handled). */
static bool linger_event(http_acc_t *a, int fd)
{
    for (int i = 0; i < ACC_LINGER_MAX; i++)
        if (a->linger[i].fd == fd) {
            linger_read(a, i, false);
            return true;
        }
    return false;
}

/* ---- the header block ---- */

size_t http_acc_header_end(const char *b, size_t n)
{
    const char *crlf = memmem(b, n, "\r\n\r\n", 4);
    const char *lf = memmem(b, n, "\n\n", 2);
    if (crlf && (!lf || crlf < lf))
        return (size_t)(crlf - b) + 4;
    return lf ? (size_t)(lf - b) + 2 : 0;
}

static void frame_refuse(http_acc_frame_t *fr, unsigned http_status, const char *code,
                         const char *fmt, ...) __attribute__((format(printf, 4, 5)));
static void frame_refuse(http_acc_frame_t *fr, unsigned http_status, const char *code,
                         const char *fmt, ...)
{
    if (fr->why[0])
        return; /* the first refusal stands */
    fr->http_status = http_status;
    fr->code = code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(fr->why, sizeof fr->why, fmt, ap);
    va_end(ap);
}

/* A header line's value, its surrounding blanks dropped, into out. */
static void header_value(const char *v, const char *end, char *out, size_t cap)
{
    while (v < end && (*v == ' ' || *v == '\t'))
        v++;
    while (end > v && (end[-1] == ' ' || end[-1] == '\t' || end[-1] == '\r'))
        end--;
    size_t n = (size_t)(end - v) < cap - 1 ? (size_t)(end - v) : cap - 1;
    memcpy(out, v, n);
    out[n] = '\0';
}

/* Whether the whole chunk line p[0..line) (its '\n' excluded) whose first `digits` bytes are hex
 * digits is a size then, optionally, a ';' extension (RFC 9112 7.1 and 7.1.1), as
 * libmicrohttpd reads it: it answers any other line (blanks before the ';' too) with its own
 * HTML 400. */
static bool chunk_line_ok(const char *p, size_t digits, size_t line)
{
    if (line > 0 && p[line - 1] == '\r')
        line--;
    return digits > 0 && (digits == line || p[digits] == ';');
}

/* Checks the trailer lines in p[0..end) (after the last chunk's line) that are whole: each a
 * header field, NAME ":" value, up to the blank line that ends the body; libmicrohttpd answers
 * any other line with its own HTML 400. */
static void check_trailers(http_acc_frame_t *fr, const char *p, const char *end)
{
    for (unsigned no = 1; p < end; no++) {
        const char *lf = memchr(p, '\n', (size_t)(end - p));
        if (!lf)
            return;
        const char *le = lf > p && lf[-1] == '\r' ? lf - 1 : lf;
        if (le == p)
            return; /* the blank line that ends the body */
        const char *colon = memchr(p, ':', (size_t)(le - p));
        if (!colon || colon == p || *p == ' ' || *p == '\t') {
            frame_refuse(fr, 400, "bad_framing",
                         "trailer line %u after the last chunk is not a header field (NAME: "
                         "value)",
                         no);
            return;
        }
        p = lf + 1;
    }
}

/* Checks the chunk lines (size, then extensions) of a chunked body in p[0..end), the part of it
 * that arrived with the headers: a first chunk larger than the body limit is refused now
 * (libmicrohttpd would wait for all of it), and so is a chunk line longer than
 * HTTP_ACC_CHUNK_LINE_MAX (libmicrohttpd answers one longer than its buffer with its own HTML
 * 500; RFC 9112 7.1.1 lets a server limit extensions). fr->need_more when the first chunk line
 * is still incomplete and the client is not waiting for "100 Continue" (expect). */
static void check_chunks(http_acc_frame_t *fr, const char *p, const char *end, bool expect)
{
    unsigned n_line = 0;
    for (bool first = true; p < end; first = false) {
        const char *lf = memchr(p, '\n', (size_t)(end - p));
        n_line++;
        size_t line = (size_t)((lf ? lf : end) - p);
        if (line > HTTP_ACC_CHUNK_LINE_MAX) {
            frame_refuse(fr, 400, "bad_framing",
                         "a chunk line (size and chunk extension) is longer than %d bytes",
                         HTTP_ACC_CHUNK_LINE_MAX);
            return;
        }
        uint64_t size = 0;
        int digits = 0;
        for (const char *q = p; q < p + line; q++, digits++) {
            int d = *q >= '0' && *q <= '9'   ? *q - '0'
                    : *q >= 'a' && *q <= 'f' ? *q - 'a' + 10
                    : *q >= 'A' && *q <= 'F' ? *q - 'A' + 10
                                             : -1;
            if (d < 0)
                break;
            if (digits >= 15 || size > TDM_HTTP_MAX_BODY_BYTES) {
                frame_refuse(fr, 413, "request_too_large",
                             "a chunk of more than %u bytes: the request body is limited to %u "
                             "bytes",
                             TDM_HTTP_MAX_BODY_BYTES, TDM_HTTP_MAX_BODY_BYTES);
                return;
            }
            size = size * 16 + (uint64_t)d;
        }
        if (size > TDM_HTTP_MAX_BODY_BYTES) {
            frame_refuse(fr, 413, "request_too_large",
                         "a chunk of %" PRIu64 " bytes: the request body is limited to %u bytes",
                         size, TDM_HTTP_MAX_BODY_BYTES);
            return;
        }
        if (!lf) {
            fr->need_more = first && !expect;
            return;
        }
        if (!chunk_line_ok(p, (size_t)digits, line)) {
            frame_refuse(fr, 400, "bad_framing",
                         "chunk line %u is not a chunk size in hexadecimal (then optionally "
                         "';' and a chunk extension)",
                         n_line);
            return;
        }
        if (size == 0) {
            check_trailers(fr, lf + 1, end);
            return;
        }
        if (size + 1 > (uint64_t)(end - (lf + 1)))
            return;                        /* a chunk not all here yet */
        const char *after = lf + 1 + size; /* the chunk's data ends with CRLF */
        if (*after != '\n' && (*after != '\r' || (after + 1 < end && after[1] != '\n'))) {
            frame_refuse(fr, 400, "bad_framing",
                         "a chunk of %" PRIu64 " bytes is not followed by CRLF: the chunk size "
                         "must be the length of the data after its line",
                         size);
            return;
        }
        if (*after == '\r' && after + 1 == end)
            return; /* its '\n' is not here yet */
        p = after + (*after == '\r' ? 2 : 1);
    }
}

/* Checks header line [line, le) (le at its '\n') of the block: RFC 9112 5.1 and 5.2 refuse
 * blanks before the colon and a line folded onto the previous one (obs-fold); a line without a
 * colon is no field at all. Returns whether it is the Host line. */
static bool check_field_line(http_acc_frame_t *fr, unsigned no, const char *line, const char *le)
{
    if (le > line && le[-1] == '\r')
        le--;
    if (le == line)
        return false; /* the blank line that ends the block */
    const char *colon = memchr(line, ':', (size_t)(le - line));
    if (*line == ' ' || *line == '\t')
        frame_refuse(fr, 400, "bad_request",
                     "header line %u begins with a blank (obs-fold, RFC 9112 5.2): send each "
                     "header field on one line",
                     no);
    else if (!colon)
        frame_refuse(fr, 400, "bad_request", "header line %u has no colon: '%.*s'", no,
                     (int)(le - line < 60 ? le - line : 60), line);
    else if (colon == line)
        frame_refuse(fr, 400, "bad_request",
                     "header line %u has no header name before its colon (RFC 9112 5.1)", no);
    else if (colon[-1] == ' ' || colon[-1] == '\t')
        frame_refuse(fr, 400, "bad_request",
                     "header line %u has a blank between the header name and the colon "
                     "(RFC 9112 5.1): '%.*s'",
                     no, (int)(colon - line < 60 ? colon - line + 1 : 60), line);
    else if (memchr(line, '\0', (size_t)(le - line)))
        frame_refuse(fr, 400, "bad_request", "header line %u has a NUL byte", no);
    return colon && colon - line == 4 && strncasecmp(line, "host", 4) == 0;
}

/* Checks the request target t[0..n) (raw bytes up to the version): no NUL, raw or as %00, in
 * its path. */
static void check_target(http_acc_frame_t *fr, const char *t, size_t n)
{
    const char *nul = memchr(t, '\0', n);
    const char *q = memchr(t, '?', n);
    size_t pn = q ? (size_t)(q - t) : n;
    for (size_t i = 0; !nul && i + 2 < pn; i++)
        if (t[i] == '%' && t[i + 1] == '0' && t[i + 2] == '0')
            nul = t + i;
    if (nul)
        frame_refuse(fr, 400, "bad_request",
                     "the request path has a NUL byte (%s) at byte %zu; paths may not contain NUL",
                     *nul ? "%00" : "raw", (size_t)(nul - t));
}

/* Checks the request line's HTTP version, the text after its last space up to eol (RFC 9112
 * 2.3: "HTTP/" DIGIT "." DIGIT): libmicrohttpd answers a missing or malformed one, and a major
 * version other than 1, with its own HTML page. Major version 1 passes (libmicrohttpd serves
 * HTTP/1.2 as 1.1). */
static void check_version(http_acc_frame_t *fr, const char *t, const char *eol)
{
    const char *v = eol;
    while (v > t && v[-1] != ' ')
        v--;
    size_t n = (size_t)(eol - v);
    if (n > 0 && v[n - 1] == '\r')
        n--;
    if (v == t) {
        frame_refuse(fr, 400, "bad_request",
                     "the request line has no HTTP version: send METHOD PATH HTTP/1.1");
        return;
    }
    bool form = n == 8 && memcmp(v, "HTTP/", 5) == 0 && v[5] >= '0' && v[5] <= '9' && v[6] == '.' &&
                v[7] >= '0' && v[7] <= '9';
    if (!form)
        frame_refuse(fr, 400, "bad_request",
                     "the request line's HTTP version is malformed: send HTTP/1.1 (or "
                     "HTTP/1.0) after the path");
    else if (v[5] != '1')
        frame_refuse(fr, 505, "http_version_not_supported",
                     "HTTP/%c.%c is not supported here: send HTTP/1.1 (or HTTP/1.0)", v[5], v[7]);
}

/* Reads the request line and the framing headers of b[0..hlen) into *fr (fr->why set for a
 * request to refuse): a method, one Content-Length of 1..19 digits or one Transfer-Encoding
 * "chunked", not both (RFC 9112 6.3: whatever two parties could read differently is how
 * requests are smuggled), header lines as RFC 9112 5 has them, a Host line in an HTTP/1.1
 * request (RFC 9112 3.2), no NUL in the path. */
void http_acc_frame_read(const char *b, size_t hlen, size_t n, http_acc_frame_t *fr)
{
    memset(fr, 0, sizeof *fr);
    const char *end = b + hlen, *eol = memchr(b, '\n', hlen);
    const char *sp = memchr(b, ' ', (size_t)(eol - b));
    if (!sp || sp == b) {
        frame_refuse(fr, 400, "bad_request", "the request line has no method");
        return;
    }
    const char *t = sp + 1, *q = t;
    while (q < eol && *q != ' ' && *q != '?' && *q != '\r')
        q++;
    size_t pl = (size_t)(q - t) < sizeof fr->path - 1 ? (size_t)(q - t) : sizeof fr->path - 1;
    memcpy(fr->path, t, pl);
    const char *tend = memchr(t, ' ', (size_t)(eol - t));
    check_target(fr, t, (size_t)((tend ? tend : eol) - t));
    check_version(fr, t, eol);
    bool http11 = tend && (size_t)(eol - tend) >= 9 && memcmp(tend + 1, "HTTP/1.1", 8) == 0;
    unsigned n_cl = 0, n_te = 0, n_host = 0, no = 1;
    char cl[128] = "", te[128] = "", expect[32] = "";
    bool cl_blank = false;
    for (const char *line = eol + 1; line < end; no++) {
        const char *le = memchr(line, '\n', (size_t)(end - line));
        if (!le)
            le = end;
        n_host += check_field_line(fr, no, line, le);
        const char *colon = memchr(line, ':', (size_t)(le - line));
        if (colon && (size_t)(colon - line) == 14 && strncasecmp(line, "content-length", 14) == 0) {
            n_cl++, header_value(colon + 1, le, cl, sizeof cl);
            /* libmicrohttpd 0.9.75 cannot read a length followed by blanks and would answer
             * with its own page */
            const char *v = le > colon && le[-1] == '\r' ? le - 1 : le;
            cl_blank = cl_blank || (v > colon + 1 && (v[-1] == ' ' || v[-1] == '\t'));
        }
        if (colon && (size_t)(colon - line) == 17 &&
            strncasecmp(line, "transfer-encoding", 17) == 0)
            n_te++, header_value(colon + 1, le, te, sizeof te);
        if (colon && (size_t)(colon - line) == 6 && strncasecmp(line, "expect", 6) == 0)
            header_value(colon + 1, le, expect, sizeof expect);
        line = le + 1;
    }
    if (n_cl > 1 || n_te > 1)
        frame_refuse(fr, 400, "bad_framing", "the request has %u %s headers; send exactly one",
                     n_cl > 1 ? n_cl : n_te, n_cl > 1 ? "Content-Length" : "Transfer-Encoding");
    if (n_cl && n_te)
        frame_refuse(fr, 400, "bad_framing",
                     "a request with both Transfer-Encoding and Content-Length is refused");
    size_t cl_len = strlen(cl);
    if (n_cl && (!cl_len || cl_len > 19 || strspn(cl, "0123456789") != cl_len))
        frame_refuse(fr, 400, "bad_framing", "Content-Length '%.100s' is not a decimal byte count",
                     cl);
    if (n_cl && cl_blank)
        frame_refuse(fr, 400, "bad_framing",
                     "Content-Length '%.100s ' ends with a blank; send the digits alone", cl);
    if (n_te && strcasecmp(te, "chunked") != 0)
        frame_refuse(fr, 400, "bad_framing",
                     "Transfer-Encoding '%.100s' is not supported: send 'chunked' or a "
                     "Content-Length",
                     te);
    if (http11 && n_host == 0)
        frame_refuse(fr, 400, "bad_request",
                     "the request has no Host header; HTTP/1.1 requires one (RFC 9112 3.2)");
    if (n_host > 1)
        frame_refuse(fr, 400, "bad_request", "the request has %u Host headers; send exactly one",
                     n_host);
    if (n_te && !fr->why[0])
        check_chunks(fr, end, b + n, strcasecmp(expect, "100-continue") == 0);
}

/* ---- the accept thread ---- */

/* Forgets pending fd (the caller closes it). */
static void pending_drop(http_acc_t *a, int fd)
{
    pthread_mutex_lock(&a->mu);
    if ((size_t)fd < a->n_slots && a->slots[fd].state == SLOT_PENDING)
        slot_free(a, fd);
    pthread_mutex_unlock(&a->mu);
}

/* Hands pending fd, its headers complete and checked, to libmicrohttpd. */
static void hand_over(http_acc_t *a, int fd)
{
    epoll_ctl(a->ep, EPOLL_CTL_DEL, fd, NULL);
    pthread_mutex_lock(&a->mu);
    acc_slot_t *s = &a->slots[fd];
    list_del(a->slots, &a->pending, fd);
    if (s->admit == ADMIT_BUSY)
        a->n_busy--;
    s->admit = ADMIT_ANY;
    s->state = SLOT_MHD;
    s->phase = HTTP_ACC_IDLE;
    s->t_phase = tdm_time_now();
    s->bytes = 0;
    list_add(a->slots, &a->in_mhd, fd);
    uint32_t gen = s->gen;
    struct sockaddr_storage sa = s->sa;
    socklen_t len = s->sa_len;
    pthread_mutex_unlock(&a->mu);
    if (MHD_add_connection(a->mhd, fd, (const struct sockaddr *)&sa, len) == MHD_YES)
        return;
    /* libmicrohttpd closed the socket: the slot goes unless a report freed it already */
    pthread_mutex_lock(&a->mu);
    if (a->slots[fd].state == SLOT_MHD && a->slots[fd].gen == gen)
        slot_free(a, fd);
    pthread_mutex_unlock(&a->mu);
}

/* The answer to a request that is not a probe on a connection taken over a limit. */
static void answer_limit(http_acc_t *a, int fd, int admit)
{
    if (admit == ADMIT_OVER)
        answer_close(a, fd, 429, TDM_ERESOURCE, "too_many_connections",
                     "too many connections from this address: at most %d at once "
                     "(router.http_max_connections_per_client); retry when one has closed",
                     a->rc->http_max_connections_per_client);
    else
        answer_close(a, fd, 503, TDM_EUNAVAILABLE, "server_busy",
                     "the server has %d connections open (router.http_max_connections), all of "
                     "them busy; retry later",
                     a->rc->http_max_connections);
}

/* New bytes on pending fd (or its end: hup): once its header block is complete, refuse it or
 * hand it over; a client that has stopped sending before that is forgotten. */
static void gate_read(http_acc_t *a, int fd, bool hup)
{
    static __thread char buf[ACC_HEADER_MAX];
    ssize_t n = recv(fd, buf, sizeof buf, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    pthread_mutex_lock(&a->mu);
    bool mine = (size_t)fd < a->n_slots && a->slots[fd].state == SLOT_PENDING;
    int admit = mine ? a->slots[fd].admit : ADMIT_ANY;
    if (mine && n > 0)
        a->slots[fd].bytes = (uint64_t)n;
    pthread_mutex_unlock(&a->mu);
    if (!mine)
        return;
    if (n <= 0) { /* the client went away, or the socket failed */
        pending_drop(a, fd);
        close(fd);
        return;
    }
    size_t hlen = http_acc_header_end(buf, (size_t)n);
    if (!hlen && hup) { /* half a request, and no more can come */
        pending_drop(a, fd);
        close(fd);
        return;
    }
    if (!hlen) {
        if ((size_t)n >= sizeof buf) {
            pending_drop(a, fd);
            answer_close(a, fd, 431, TDM_EINVALID, "request_header_too_large",
                         "the request line and headers are larger than %d bytes", ACC_HEADER_MAX);
        }
        return;
    }
    http_acc_frame_t fr;
    http_acc_frame_read(buf, hlen, (size_t)n, &fr);
    if (!fr.why[0] && fr.need_more && !hup && (size_t)n < sizeof buf)
        return; /* the first chunk line is on its way: checked when whole */
    if (fr.why[0]) {
        pending_drop(a, fd);
        answer_close(a, fd, fr.http_status, TDM_EINVALID, fr.code, "%s", fr.why);
        return;
    }
    bool probe = strcmp(fr.path, "/health") == 0 || strcmp(fr.path, "/ready") == 0;
    if (admit != ADMIT_ANY && !probe) {
        pending_drop(a, fd);
        answer_limit(a, fd, admit);
        return;
    }
    hand_over(a, fd);
}

/* Takes a new connection into the table (closing another to make room when it is full), or
 * answers 503 and closes it. */
static void admit(http_acc_t *a, int fd, const struct sockaddr_storage *sa, socklen_t len)
{
    struct stat st;
    uint8_t key[16];
    addr_key(sa, key);
    double now = tdm_time_now();
    int victim = -1, admit = ADMIT_ANY;
    bool full = fstat(fd, &st) != 0;
    pthread_mutex_lock(&a->mu);
    full = full || (size_t)fd >= a->n_slots;
    if (!full && a->n_open - a->n_evicting >= (size_t)a->rc->http_max_connections) {
        victim = pick_victim(a);
        /* none to close: a few more are taken, for probes (/health, /ready) only */
        full = victim < 0 && a->n_busy >= ACC_PROBE_RESERVE;
        if (victim < 0 && !full)
            admit = ADMIT_BUSY;
        if (victim >= 0 && a->slots[victim].state == SLOT_MHD) {
            /* counted until libmicrohttpd reports its close; one sending headers is told why */
            slot_evict(a, victim,
                       a->slots[victim].phase == HTTP_ACC_HEADERS
                           ? "the request headers were not complete when the server needed the "
                             "connection for another client"
                           : NULL);
            victim = -1;
        } else if (victim >= 0) {
            slot_free(a, victim); /* pending: ours to close below */
        }
    }
    acc_addr_t *e = full ? NULL : addr_get(a, key);
    if (e) {
        acc_slot_t *s = &a->slots[fd];
        e->count++;
        a->n_open++;
        s->state = SLOT_PENDING;
        s->addr = e;
        s->ino = st.st_ino;
        s->t_open = now;
        if (admit == ADMIT_ANY && a->rc->http_max_connections_per_client > 0 &&
            e->count > (uint32_t)a->rc->http_max_connections_per_client)
            admit = ADMIT_OVER;
        s->admit = (uint8_t)admit;
        a->n_busy += admit == ADMIT_BUSY;
        s->sa = *sa;
        s->sa_len = len;
        list_add(a->slots, &a->pending, fd);
    }
    pthread_mutex_unlock(&a->mu);
    if (victim >= 0)
        answer_close(a, victim, 408, TDM_EDEADLINE, "request_timeout",
                     "the request headers were not complete when the server needed the "
                     "connection for another client");
    if (!e) {
        answer_limit(a, fd, ADMIT_BUSY);
        return;
    }
    struct epoll_event ee = {.events = EPOLLIN | EPOLLRDHUP | EPOLLET, .data = {.fd = fd}};
    if (epoll_ctl(a->ep, EPOLL_CTL_ADD, fd, &ee) != 0) {
        pending_drop(a, fd);
        close(fd);
    }
}

static void accept_burst(http_acc_t *a)
{
    for (int k = 0; k < ACC_ACCEPT_BURST; k++) {
        struct sockaddr_storage sa;
        socklen_t len = sizeof sa;
        int fd = accept4(a->lfd, (struct sockaddr *)&sa, &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd >= 0) {
            admit(a, fd, &sa, len);
            continue;
        }
        if (errno == EMFILE || errno == ENFILE) {
            /* out of files: stop watching the socket until the next sweep, or this loop spins */
            epoll_ctl(a->ep, EPOLL_CTL_DEL, a->lfd, NULL);
            a->lfd_watched = false;
            tdm_log_write(&a->log, TDM_LOG_WARN, NULL, NULL,
                          "http: out of open files accepting a connection (%s)", strerror(errno));
        }
        return;
    }
}

/* What the sweep closes outside the lock. */
typedef struct acc_expired {
    int fd;
    int admit;
} acc_expired_t;

/* Enforces the deadlines: pending headers, idle keep-alive, body rate. */
static void sweep(http_acc_t *a, double now)
{
    const tdm_router_config_t *rc = a->rc;
    acc_expired_t exp[256];
    size_t n_exp = 0;
    pthread_mutex_lock(&a->mu);
    for (int i = a->pending.head, next; i >= 0 && n_exp < 256; i = next) {
        next = a->slots[i].next;
        int admit = a->slots[i].admit;
        double limit = admit != ADMIT_ANY ? ACC_OVER_GRACE_S : (double)rc->http_header_timeout_s;
        if (now - a->slots[i].t_open < limit)
            continue;
        exp[n_exp++] = (acc_expired_t){i, admit};
        slot_free(a, i);
    }
    for (int i = a->in_mhd.head; i >= 0; i = a->slots[i].next) {
        acc_slot_t *s = &a->slots[i];
        double t = now - s->t_phase;
        bool idle_out = s->phase == HTTP_ACC_IDLE && t > (double)rc->http_connection_timeout_s;
        bool late_headers = s->phase == HTTP_ACC_HEADERS && t > (double)rc->http_header_timeout_s;
        bool slow_body = s->phase == HTTP_ACC_BODY && rc->http_min_body_rate > 0 &&
                         t > (double)rc->http_header_timeout_s &&
                         (double)s->bytes < (double)rc->http_min_body_rate * t;
        char msg[256];
        if (late_headers)
            snprintf(msg, sizeof msg,
                     "the request headers did not arrive within %d s "
                     "(router.http_header_timeout_s)",
                     rc->http_header_timeout_s);
        if (slow_body)
            snprintf(msg, sizeof msg,
                     "the request body arrived at %.0f bytes/s on average, below "
                     "router.http_min_body_rate (%d bytes/s)",
                     (double)s->bytes / t, rc->http_min_body_rate);
        if (!s->evicting && (idle_out || late_headers || slow_body))
            slot_evict(a, i, idle_out ? NULL : msg);
    }
    pthread_mutex_unlock(&a->mu);
    for (size_t k = 0; k < n_exp; k++) {
        if (exp[k].admit != ADMIT_ANY)
            answer_limit(a, exp[k].fd, exp[k].admit);
        else
            answer_close(a, exp[k].fd, 408, TDM_EDEADLINE, "request_timeout",
                         "the request headers did not arrive within %d s "
                         "(router.http_header_timeout_s)",
                         rc->http_header_timeout_s);
    }
    for (int i = 0; i < ACC_LINGER_MAX; i++)
        if (a->linger[i].fd >= 0 && now >= a->linger[i].until)
            linger_read(a, i, true);
    if (!a->lfd_watched) {
        struct epoll_event ee = {.events = EPOLLIN, .data = {.fd = a->lfd}};
        a->lfd_watched = epoll_ctl(a->ep, EPOLL_CTL_ADD, a->lfd, &ee) == 0;
    }
}

static void *acc_main(void *arg)
{
    http_acc_t *a = arg;
    struct epoll_event evs[64];
    double next_sweep = tdm_time_now();
    for (;;) {
        int n = epoll_wait(a->ep, evs, 64, ACC_SWEEP_MS);
        pthread_mutex_lock(&a->mu);
        bool stopping = a->stopping;
        pthread_mutex_unlock(&a->mu);
        if (stopping)
            break;
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == a->wake_fd) {
                uint64_t v;
                if (read(fd, &v, sizeof v) < 0) { /* nothing to drain */
                }
            } else if (fd == a->lfd) {
                accept_burst(a);
            } else if (!linger_event(a, fd)) {
                gate_read(a, fd, evs[i].events & (EPOLLRDHUP | EPOLLHUP | EPOLLERR));
            }
        }
        double now = tdm_time_now();
        if (now >= next_sweep) {
            sweep(a, now);
            next_sweep = now + ACC_SWEEP_MS / 1000.0;
        }
    }
    return NULL;
}

/* ---- reports from libmicrohttpd's threads ---- */

/* The slot of fd when gen is its generation and it is in libmicrohttpd (a->mu held). */
static acc_slot_t *mhd_slot(http_acc_t *a, int fd, uint32_t gen)
{
    if (fd < 0 || (size_t)fd >= a->n_slots)
        return NULL;
    acc_slot_t *s = &a->slots[fd];
    return s->state == SLOT_MHD && s->gen == gen ? s : NULL;
}

uint32_t http_acc_started(http_acc_t *a, int fd)
{
    pthread_mutex_lock(&a->mu);
    uint32_t gen = fd >= 0 && (size_t)fd < a->n_slots ? a->slots[fd].gen : 0;
    pthread_mutex_unlock(&a->mu);
    return gen;
}

void http_acc_closed(http_acc_t *a, int fd, uint32_t gen)
{
    pthread_mutex_lock(&a->mu);
    if (mhd_slot(a, fd, gen))
        slot_free(a, fd);
    pthread_mutex_unlock(&a->mu);
}

void http_acc_phase(http_acc_t *a, int fd, uint32_t gen, http_acc_phase_t phase)
{
    pthread_mutex_lock(&a->mu);
    acc_slot_t *s = mhd_slot(a, fd, gen);
    if (s && s->phase != (uint8_t)phase) {
        s->phase = (uint8_t)phase;
        s->t_phase = tdm_time_now();
        s->bytes = 0;
    }
    pthread_mutex_unlock(&a->mu);
}

void http_acc_body(http_acc_t *a, int fd, uint32_t gen, uint64_t n)
{
    pthread_mutex_lock(&a->mu);
    acc_slot_t *s = mhd_slot(a, fd, gen);
    if (s)
        s->bytes += n;
    pthread_mutex_unlock(&a->mu);
}

/* ---- construction ---- */

uint64_t http_acc_files_needed(int max_connections)
{
    return 2u * (uint64_t)(max_connections > 0 ? max_connections : 0) + ACC_FILES_RESERVE;
}

int http_acc_raise_nofile(int max_connections, tdm_error_t *err)
{
    uint64_t need = http_acc_files_needed(max_connections);
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "getrlimit(RLIMIT_NOFILE): %s", strerror(errno));
    if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur >= need)
        return TDM_OK;
    if (rl.rlim_cur == RLIM_INFINITY)
        return TDM_OK;
    if (rl.rlim_max != RLIM_INFINITY && rl.rlim_max < need)
        return tdm_error_set_field(
            err, TDM_ERESOURCE, "router.http_max_connections",
            "router.http_max_connections %d needs %" PRIu64 " open files; RLIMIT_NOFILE allows "
            "%" PRIu64 " (hard limit): raise it (ulimit -Hn, LimitNOFILE=) or lower "
            "router.http_max_connections",
            max_connections, need, (uint64_t)rl.rlim_max);
    rl.rlim_cur = need;
    if (setrlimit(RLIMIT_NOFILE, &rl) != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "setrlimit(RLIMIT_NOFILE, %" PRIu64 "): %s", need,
                             strerror(errno));
    return TDM_OK;
}

/* Opens the listening socket on sa. */
static int listen_on(http_acc_t *a, const struct sockaddr *sa, socklen_t len, const char *host,
                     tdm_error_t *err)
{
    a->lfd = socket(sa->sa_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    int one = 1;
    if (a->lfd >= 0)
        setsockopt(a->lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (a->lfd < 0 || bind(a->lfd, sa, len) != 0 || listen(a->lfd, 1024) != 0)
        return tdm_error_set(err, TDM_EUNAVAILABLE, "cannot serve HTTP on %s port %d: %s", host,
                             a->rc->http_port, strerror(errno));
    struct sockaddr_storage got;
    socklen_t gl = sizeof got;
    if (getsockname(a->lfd, (struct sockaddr *)&got, &gl) == 0)
        a->port = ntohs(got.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&got)->sin6_port
                                                  : ((struct sockaddr_in *)&got)->sin_port);
    return TDM_OK;
}

http_acc_t *http_acc_new(const tdm_config_t *cfg, const struct sockaddr *sa, socklen_t len,
                         const char *host, http_counters_t *counters, const tdm_logger_t *log,
                         tdm_error_t *err)
{
    http_acc_t *a = calloc(1, sizeof *a);
    if (!a) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        return NULL;
    }
    a->rc = &cfg->router;
    a->counters = counters;
    a->log = *log;
    a->lfd = a->ep = a->wake_fd = -1;
    for (int i = 0; i < ACC_LINGER_MAX; i++)
        a->linger[i].fd = -1;
    a->pending = a->in_mhd = (acc_list_t){-1, -1};
    pthread_mutex_init(&a->mu, NULL);
    struct rlimit rl;
    a->n_slots = getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY
                     ? (size_t)rl.rlim_cur
                     : 1u << 20;
    a->n_buckets = 2 * (size_t)a->rc->http_max_connections + 1;
    a->slots = calloc(a->n_slots, sizeof *a->slots); /* pages of unused fds are never touched */
    a->buckets = calloc(a->n_buckets, sizeof *a->buckets);
    if (!a->slots || !a->buckets) {
        tdm_error_set(err, TDM_ERESOURCE, "out of memory");
        goto out_free;
    }
    if (listen_on(a, sa, len, host, err) != TDM_OK)
        goto out_free;
    a->ep = epoll_create1(EPOLL_CLOEXEC);
    a->wake_fd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    struct epoll_event el = {.events = EPOLLIN, .data = {.fd = a->lfd}};
    struct epoll_event ew = {.events = EPOLLIN, .data = {.fd = a->wake_fd}};
    if (a->ep < 0 || a->wake_fd < 0 || epoll_ctl(a->ep, EPOLL_CTL_ADD, a->lfd, &el) != 0 ||
        epoll_ctl(a->ep, EPOLL_CTL_ADD, a->wake_fd, &ew) != 0) {
        tdm_error_set(err, TDM_ERESOURCE, "http: epoll/eventfd: %s", strerror(errno));
        goto out_free;
    }
    a->lfd_watched = true;
    return a;
out_free:
    http_acc_destroy(&a);
    return NULL;
}

uint16_t http_acc_port(const http_acc_t *a)
{
    return a->port;
}

int http_acc_start(http_acc_t *a, struct MHD_Daemon *mhd, tdm_error_t *err)
{
    a->mhd = mhd;
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, &old);
    int rc = pthread_create(&a->thread, NULL, acc_main, a);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0)
        return tdm_error_set(err, TDM_ERESOURCE, "http: cannot start the accept thread: %s",
                             strerror(rc));
    a->started = true;
    return TDM_OK;
}

void http_acc_stop(http_acc_t *a)
{
    if (!a)
        return;
    pthread_mutex_lock(&a->mu);
    a->stopping = true;
    pthread_mutex_unlock(&a->mu);
    if (a->started) {
        uint64_t one = 1;
        if (write(a->wake_fd, &one, sizeof one) < 0) { /* the thread wakes within a sweep */
        }
        pthread_join(a->thread, NULL);
        a->started = false;
    }
    for (int i = 0; i < ACC_LINGER_MAX; i++)
        if (a->linger[i].fd >= 0) {
            close(a->linger[i].fd);
            a->linger[i].fd = -1;
        }
    pthread_mutex_lock(&a->mu);
    while (a->pending.head >= 0) {
        int fd = a->pending.head;
        slot_free(a, fd);
        close(fd);
    }
    pthread_mutex_unlock(&a->mu);
}

void http_acc_destroy(http_acc_t **a_p)
{
    if (!a_p || !*a_p)
        return;
    http_acc_t *a = *a_p;
    http_acc_stop(a);
    if (a->lfd >= 0)
        close(a->lfd);
    if (a->ep >= 0)
        close(a->ep);
    if (a->wake_fd >= 0)
        close(a->wake_fd);
    for (size_t i = 0; a->buckets && i < a->n_buckets; i++)
        while (a->buckets[i]) {
            acc_addr_t *e = a->buckets[i];
            a->buckets[i] = e->next;
            free(e);
        }
    free(a->buckets);
    free(a->slots);
    pthread_mutex_destroy(&a->mu);
    free(a);
    *a_p = NULL;
}
