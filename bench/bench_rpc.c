/* bench_rpc.c - throughput of the messaging layer (common/net) over TCP loopback, against raw
 * ZeroMQ moving the same bytes in the same run:
 *   unary    small request/response round trips per second (tdm_sock_call: HealthRequest ->
 *            HealthResponse, one client, server in a thread), with p50/p99 latency;
 *   stream   server-streamed events per second (one GenerateChunk per STREAM frame, each
 *            packed by the server and decoded by the client);
 * and the same patterns as a plain DEALER/ROUTER exchange of the identical pre-packed frames
 * (no validation, no protobuf work). Prints a table to stderr and one JSON line to stdout
 * (or --json FILE). The two variants alternate for a few rounds and each reports its best
 * round, so a busy neighbour on a shared machine skews the ratio less; still, compare ratios,
 * not absolute numbers. */
#include <errno.h>
#include <getopt.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "tandem/net.h"

#define K_REQUEST TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST
#define K_STREAM TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM
#define K_END TANDEM__V1__FRAME_KIND__FRAME_KIND_END
#define M_HEALTH TANDEM__V1__METHOD__METHOD_HEALTH
#define M_GENERATE TANDEM__V1__METHOD__METHOD_GENERATE

typedef struct bench_opts {
    double seconds; /* per unary measurement */
    long events;    /* per stream measurement */
    int rounds;     /* raw and tandem alternate this many times; the best round counts */
    const char *json;
} bench_opts_t;

typedef struct result {
    double unary_per_s, unary_p50_us, unary_p99_us;
    double stream_per_s;
} result_t;

/* The frames both variants move, packed once (the raw baseline sends these bytes as they are;
 * the framing layer builds equal ones itself). */
typedef struct wire {
    uint8_t unary_req_hdr[64], unary_resp_hdr[64], unary_resp_body[64];
    size_t unary_req_hdr_len, unary_resp_hdr_len, unary_resp_body_len;
    uint8_t stream_req_hdr[64], stream_req_body[64], event_hdr[64], event_body[64], end_hdr[64];
    size_t stream_req_hdr_len, stream_req_body_len, event_hdr_len, event_body_len, end_hdr_len;
} wire_t;

static void fill_health(Tandem__V1__HealthResponse *r)
{
    tandem__v1__health_response__init(r);
    r->live = true;
    r->ready = true;
    r->version = "0.1.0";
}

static void fill_chunk(Tandem__V1__GenerateChunk *c, int32_t *tok, uint32_t index)
{
    tandem__v1__generate_chunk__init(c);
    c->request_id = "bench-1";
    c->index = index;
    *tok = 12345;
    c->n_token_ids = 1;
    c->token_ids = tok;
    c->text = " token";
}

static void fill_generate(Tandem__V1__GenerateRequest *g)
{
    tandem__v1__generate_request__init(g);
    g->request_id = "bench-1";
    g->input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
    g->prompt = "Hello";
    g->stream = true;
}

static size_t pack_hdr(int kind, int method, uint64_t call_id, uint8_t *buf)
{
    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = TDM_PROTOCOL_MAJOR;
    h.version_minor = TDM_PROTOCOL_MINOR;
    h.kind = (Tandem__V1__FrameKind)kind;
    h.method = (Tandem__V1__Method)method;
    h.call_id = call_id;
    if (kind == K_REQUEST)
        h.deadline_unix_ms = tdm_net_now_ms() + 5000;
    return tandem__v1__frame_header__pack(&h, buf);
}

static void wire_init(wire_t *w)
{
    Tandem__V1__HealthResponse hr;
    Tandem__V1__GenerateChunk ch;
    Tandem__V1__GenerateRequest g;
    int32_t tok;
    fill_health(&hr);
    fill_chunk(&ch, &tok, 1);
    fill_generate(&g);
    w->unary_req_hdr_len = pack_hdr(K_REQUEST, M_HEALTH, 1, w->unary_req_hdr);
    w->unary_resp_hdr_len = pack_hdr(K_END, M_HEALTH, 1, w->unary_resp_hdr);
    w->unary_resp_body_len = tandem__v1__health_response__pack(&hr, w->unary_resp_body);
    w->stream_req_hdr_len = pack_hdr(K_REQUEST, M_GENERATE, 2, w->stream_req_hdr);
    w->stream_req_body_len = tandem__v1__generate_request__pack(&g, w->stream_req_body);
    w->event_hdr_len = pack_hdr(K_STREAM, M_GENERATE, 2, w->event_hdr);
    w->event_body_len = tandem__v1__generate_chunk__pack(&ch, w->event_body);
    w->end_hdr_len = pack_hdr(K_END, M_GENERATE, 2, w->end_hdr);
}

static void die(const char *what, const char *detail)
{
    fprintf(stderr, "bench-rpc: %s: %s\n", what, detail);
    exit(1);
}

static void nap_us(long us)
{
    struct timespec ts = {0, us * 1000};
    nanosleep(&ts, NULL);
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* ---- the framing layer ---- */

typedef struct tdm_server {
    tdm_sock_t *sock;
    long events;
    atomic_bool stop;
} tdm_server_t;

/* Sends with backpressure: a full queue is retried (the bench outruns its reader). */
static void send_retry(tdm_sock_t *s, const tdm_frame_t *to, int kind, const ProtobufCMessage *b)
{
    for (;;) {
        int rc = kind == K_STREAM ? tdm_sock_stream(s, to, b) : tdm_sock_reply(s, to, b);
        if (rc == 0)
            return;
        if (rc != TDM_EUNAVAILABLE)
            die("send", tdm_sock_errmsg(s));
        nap_us(20);
    }
}

static void *tdm_server_main(void *arg)
{
    tdm_server_t *sv = arg;
    tdm_frame_t f;
    tdm_frame_init(&f);
    while (!atomic_load(&sv->stop)) {
        int rc = tdm_sock_recv(sv->sock, &f, 20);
        if (rc == TDM_EDEADLINE)
            continue;
        if (rc)
            die("server recv", tdm_sock_errmsg(sv->sock));
        if (f.kind != K_REQUEST)
            continue;
        if (f.method == M_HEALTH) {
            ProtobufCMessage *req = tdm_frame_unpack(&f, &tandem__v1__health_request__descriptor);
            if (!req)
                die("server", "HealthRequest does not decode");
            protobuf_c_message_free_unpacked(req, NULL);
            Tandem__V1__HealthResponse r;
            fill_health(&r);
            send_retry(sv->sock, &f, K_END, &r.base);
        } else if (f.method == M_GENERATE) {
            ProtobufCMessage *req = tdm_frame_unpack(&f, &tandem__v1__generate_request__descriptor);
            if (!req)
                die("server", "GenerateRequest does not decode");
            protobuf_c_message_free_unpacked(req, NULL);
            for (long i = 0; i < sv->events; i++) {
                Tandem__V1__GenerateChunk c;
                int32_t tok;
                fill_chunk(&c, &tok, (uint32_t)i);
                send_retry(sv->sock, &f, K_STREAM, &c.base);
            }
            send_retry(sv->sock, &f, K_END, NULL);
        }
    }
    tdm_frame_clear(&f);
    return NULL;
}

/* Sorts lat[0..n) and stores the rate over `wall` seconds and the p50/p99 latencies. */
static void unary_figures(double *lat, size_t n, double wall, result_t *res)
{
    res->unary_per_s = (double)n / wall;
    qsort(lat, n, sizeof *lat, cmp_double);
    res->unary_p50_us = lat[n / 2] * 1e6;
    res->unary_p99_us = lat[n * 99 / 100] * 1e6;
}

/* One tdm_sock_call Health round trip; dies on failure. */
static void tdm_health_call(tdm_sock_t *c, uint64_t call)
{
    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp;
    tdm_error_t err = {0};
    if (tdm_sock_call(c, M_HEALTH, call, NULL, &req.base, &tandem__v1__health_response__descriptor,
                      5000, &resp, &err))
        die("unary call", err.msg);
    protobuf_c_message_free_unpacked(resp, NULL);
}

/* Unary round trips for o->seconds after 1000 warm-up calls; *call is the next call id. */
static void tdm_unary(tdm_sock_t *c, const bench_opts_t *o, double *lat, size_t lat_cap,
                      uint64_t *call, result_t *res)
{
    size_t n = 0;
    for (int warm = 0; warm < 1000; warm++)
        tdm_health_call(c, (*call)++);
    double t0 = tdm_time_now(), t = t0;
    while (t - t0 < o->seconds && n < lat_cap) {
        tdm_health_call(c, (*call)++);
        double t1 = tdm_time_now();
        lat[n++] = t1 - t;
        t = t1;
    }
    unary_figures(lat, n, t - t0, res);
}

/* One Generate call whose o->events chunks are each decoded and checked. */
static void tdm_stream(tdm_sock_t *c, const bench_opts_t *o, uint64_t call, result_t *res)
{
    Tandem__V1__GenerateRequest g;
    fill_generate(&g);
    tdm_send_t m = {.kind = K_REQUEST, .method = M_GENERATE, .call_id = call, .body = &g.base};
    double t0 = tdm_time_now();
    if (tdm_sock_send(c, &m))
        die("stream request", tdm_sock_errmsg(c));
    tdm_frame_t f;
    tdm_frame_init(&f);
    long got = 0;
    for (;;) {
        if (tdm_sock_recv(c, &f, 10000))
            die("stream recv", tdm_sock_errmsg(c));
        if (f.kind == K_END)
            break;
        Tandem__V1__GenerateChunk *ch = (Tandem__V1__GenerateChunk *)tdm_frame_unpack(
            &f, &tandem__v1__generate_chunk__descriptor);
        if (!ch || ch->n_token_ids != 1 || ch->index != (uint32_t)got)
            die("stream", "bad chunk");
        protobuf_c_message_free_unpacked(&ch->base, NULL);
        got++;
    }
    res->stream_per_s = (double)got / (tdm_time_now() - t0);
    tdm_frame_clear(&f);
    if (got != o->events)
        die("stream", "events lost");
}

static void bench_tdm(tdm_net_t *net, const bench_opts_t *o, double *lat, size_t lat_cap,
                      result_t *res)
{
    tdm_error_t err = {0};
    tdm_server_t sv = {.events = o->events};
    sv.sock = tdm_sock_bind(net, "tcp://127.0.0.1:*", NULL, &err);
    if (!sv.sock)
        die("bind", err.msg);
    tdm_sock_t *c = tdm_sock_connect(net, tdm_sock_endpoint(sv.sock), NULL, &err);
    if (!c)
        die("connect", err.msg);
    pthread_t th;
    pthread_create(&th, NULL, tdm_server_main, &sv);
    uint64_t call = 1;
    tdm_unary(c, o, lat, lat_cap, &call, res);
    tdm_stream(c, o, call, res);
    atomic_store(&sv.stop, true);
    pthread_join(th, NULL);
    tdm_sock_destroy(&c);
    tdm_sock_destroy(&sv.sock);
}

/* ---- raw ZeroMQ baseline: the same frames, no framing layer ---- */

typedef struct raw_server {
    void *sock;
    const wire_t *w;
    long events;
    atomic_bool stop;
} raw_server_t;

static void raw_send(void *s, const void *p, size_t n, int flags)
{
    while (zmq_send(s, p, n, flags | ZMQ_DONTWAIT) < 0) {
        if (zmq_errno() != EAGAIN)
            die("raw send", zmq_strerror(zmq_errno()));
        nap_us(20);
    }
}

/* Receives a multipart message into parts[] (at most 4 kept); returns the part count, 0 on
 * timeout. Like tdm_sock_recv, it takes a queued message before it polls. */
static int raw_recv(void *s, zmq_msg_t *parts, int timeout_ms)
{
    int n = 0;
    bool more = true;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        if (zmq_msg_recv(&m, s, ZMQ_DONTWAIT) < 0) {
            zmq_msg_close(&m);
            if (zmq_errno() != EAGAIN)
                die("raw recv", zmq_strerror(zmq_errno()));
            if (n == 0) {
                zmq_pollitem_t it = {.socket = s, .events = ZMQ_POLLIN};
                if (zmq_poll(&it, 1, timeout_ms) <= 0)
                    return 0;
            }
            continue;
        }
        more = zmq_msg_more(&m);
        if (n < 4) {
            zmq_msg_init(&parts[n]);
            zmq_msg_move(&parts[n], &m);
        }
        zmq_msg_close(&m);
        n++;
    }
    return n;
}

static void *raw_server_main(void *arg)
{
    raw_server_t *sv = arg;
    const wire_t *w = sv->w;
    zmq_msg_t p[4];
    while (!atomic_load(&sv->stop)) {
        int n = raw_recv(sv->sock, p, 20);
        if (n == 0)
            continue;
        const void *id = zmq_msg_data(&p[0]);
        size_t idlen = zmq_msg_size(&p[0]);
        bool stream = zmq_msg_size(&p[1]) == w->stream_req_hdr_len &&
                      memcmp(zmq_msg_data(&p[1]), w->stream_req_hdr, w->stream_req_hdr_len) == 0;
        if (!stream) {
            raw_send(sv->sock, id, idlen, ZMQ_SNDMORE);
            raw_send(sv->sock, w->unary_resp_hdr, w->unary_resp_hdr_len, ZMQ_SNDMORE);
            raw_send(sv->sock, w->unary_resp_body, w->unary_resp_body_len, 0);
        } else {
            for (long i = 0; i < sv->events; i++) {
                raw_send(sv->sock, id, idlen, ZMQ_SNDMORE);
                raw_send(sv->sock, w->event_hdr, w->event_hdr_len, ZMQ_SNDMORE);
                raw_send(sv->sock, w->event_body, w->event_body_len, 0);
            }
            raw_send(sv->sock, id, idlen, ZMQ_SNDMORE);
            raw_send(sv->sock, w->end_hdr, w->end_hdr_len, 0);
        }
        for (int i = 0; i < n && i < 4; i++)
            zmq_msg_close(&p[i]);
    }
    return NULL;
}

static void *raw_socket(tdm_net_t *net, int type)
{
    void *s = zmq_socket(tdm_net_zctx(net), type);
    int linger = 0, hwm = 10000;
    zmq_setsockopt(s, ZMQ_LINGER, &linger, sizeof linger);
    zmq_setsockopt(s, ZMQ_SNDHWM, &hwm, sizeof hwm);
    zmq_setsockopt(s, ZMQ_RCVHWM, &hwm, sizeof hwm);
    return s;
}

/* Unary exchanges of the pre-packed Health frames for o->seconds after 1000 warm-up ones. */
static void raw_unary(void *c, const bench_opts_t *o, const wire_t *w, double *lat, size_t lat_cap,
                      result_t *res)
{
    zmq_msg_t p[4];
    size_t n = 0;
    double t0 = 0, t = 0;
    for (long i = -1000; n < lat_cap; i++) {
        if (i == 0)
            t0 = t = tdm_time_now();
        raw_send(c, w->unary_req_hdr, w->unary_req_hdr_len, ZMQ_SNDMORE);
        raw_send(c, "", 0, 0); /* the empty HealthRequest body */
        int k = raw_recv(c, p, 5000);
        if (k != 2)
            die("raw unary", "no answer");
        for (int j = 0; j < k; j++)
            zmq_msg_close(&p[j]);
        if (i >= 0) {
            double t1 = tdm_time_now();
            lat[n++] = t1 - t;
            t = t1;
            if (t - t0 >= o->seconds)
                break;
        }
    }
    unary_figures(lat, n, t - t0, res);
}

/* One streaming request answered by o->events pre-packed event frames and an END frame. */
static void raw_stream(void *c, const bench_opts_t *o, const wire_t *w, result_t *res)
{
    zmq_msg_t p[4];
    double t0 = tdm_time_now();
    raw_send(c, w->stream_req_hdr, w->stream_req_hdr_len, ZMQ_SNDMORE);
    raw_send(c, w->stream_req_body, w->stream_req_body_len, 0);
    long got = 0;
    for (;;) {
        int k = raw_recv(c, p, 10000);
        if (k == 0)
            die("raw stream", "timeout");
        bool end = k == 1;
        for (int j = 0; j < k; j++)
            zmq_msg_close(&p[j]);
        if (end)
            break;
        got++;
    }
    res->stream_per_s = (double)got / (tdm_time_now() - t0);
    if (got != o->events)
        die("raw stream", "events lost");
}

static void bench_raw(tdm_net_t *net, const bench_opts_t *o, const wire_t *w, double *lat,
                      size_t lat_cap, result_t *res)
{
    raw_server_t sv = {.w = w, .events = o->events};
    sv.sock = raw_socket(net, ZMQ_ROUTER);
    int mandatory = 1; /* report a full queue (EAGAIN) instead of dropping, as tdm does */
    zmq_setsockopt(sv.sock, ZMQ_ROUTER_MANDATORY, &mandatory, sizeof mandatory);
    if (zmq_bind(sv.sock, "tcp://127.0.0.1:*") != 0)
        die("raw bind", zmq_strerror(zmq_errno()));
    char ep[256];
    size_t eplen = sizeof ep;
    zmq_getsockopt(sv.sock, ZMQ_LAST_ENDPOINT, ep, &eplen);
    void *c = raw_socket(net, ZMQ_DEALER);
    if (zmq_connect(c, ep) != 0)
        die("raw connect", zmq_strerror(zmq_errno()));
    pthread_t th;
    pthread_create(&th, NULL, raw_server_main, &sv);
    raw_unary(c, o, w, lat, lat_cap, res);
    raw_stream(c, o, w, res);
    atomic_store(&sv.stop, true);
    pthread_join(th, NULL);
    zmq_close(c);
    zmq_close(sv.sock);
}

/* Keeps the best figures of a round (highest rates, lowest latencies). */
static void best_of(result_t *best, const result_t *r, bool first)
{
    if (first || r->unary_per_s > best->unary_per_s) {
        best->unary_per_s = r->unary_per_s;
        best->unary_p50_us = r->unary_p50_us;
        best->unary_p99_us = r->unary_p99_us;
    }
    if (first || r->stream_per_s > best->stream_per_s)
        best->stream_per_s = r->stream_per_s;
}

static void usage(FILE *f)
{
    fprintf(f, "usage: tandem-bench-rpc [--seconds S] [--events N] [--rounds R] [--json FILE]\n"
               "  --seconds S  duration of each unary measurement (default 1)\n"
               "  --rounds R   alternating rounds of both variants; best counts (default 3)\n"
               "  --events N   events per streaming measurement (default 200000)\n"
               "  --json FILE  write the JSON result there instead of stdout\n");
}

/* Parses the command line into *o. Returns 0 to go on, or the exit status with *done set. */
static int parse_args(int argc, char **argv, bench_opts_t *o, bool *done)
{
    static const struct option longopts[] = {
        {"seconds", required_argument, NULL, 's'}, {"events", required_argument, NULL, 'e'},
        {"rounds", required_argument, NULL, 'r'},  {"json", required_argument, NULL, 'j'},
        {"help", no_argument, NULL, 'h'},          {NULL, 0, NULL, 0},
    };
    *done = true;
    int ch;
    while ((ch = getopt_long(argc, argv, "s:e:r:j:h", longopts, NULL)) != -1) {
        switch (ch) {
        case 's': o->seconds = atof(optarg); break;
        case 'e': o->events = atol(optarg); break;
        case 'r': o->rounds = atoi(optarg); break;
        case 'j': o->json = optarg; break;
        case 'h': usage(stdout); return 0;
        default: usage(stderr); return 2;
        }
    }
    if (o->seconds <= 0 || o->seconds > 600 || o->events < 1 || o->events > 100000000 ||
        o->rounds < 1 || o->rounds > 100) {
        usage(stderr);
        return 2;
    }
    *done = false;
    return 0;
}

/* The table, to stderr. */
static void print_table(const bench_opts_t *o, const wire_t *w, const result_t *tdm,
                        const result_t *raw)
{
    fprintf(stderr,
            "messaging over tcp://127.0.0.1 (1 client, server thread, 1 I/O thread; best of %d "
            "rounds)\n",
            o->rounds);
    fprintf(stderr, "%-26s %14s %14s %8s\n", "", "tandem net", "raw zmq", "ratio");
    fprintf(stderr, "%-26s %14.0f %14.0f %8.2f\n", "unary round trips/s", tdm->unary_per_s,
            raw->unary_per_s, tdm->unary_per_s / raw->unary_per_s);
    fprintf(stderr, "%-26s %14.1f %14.1f %8.2f\n", "unary p50 latency (us)", tdm->unary_p50_us,
            raw->unary_p50_us, tdm->unary_p50_us / raw->unary_p50_us);
    fprintf(stderr, "%-26s %14.1f %14.1f %8.2f\n", "unary p99 latency (us)", tdm->unary_p99_us,
            raw->unary_p99_us, tdm->unary_p99_us / raw->unary_p99_us);
    fprintf(stderr, "%-26s %14.0f %14.0f %8.2f\n", "streamed events/s", tdm->stream_per_s,
            raw->stream_per_s, tdm->stream_per_s / raw->stream_per_s);
    fprintf(stderr, "frame sizes: unary request %zu+0 B, response %zu+%zu B, event %zu+%zu B\n",
            w->unary_req_hdr_len, w->unary_resp_hdr_len, w->unary_resp_body_len, w->event_hdr_len,
            w->event_body_len);
}

/* One JSON line, to stdout or --json FILE; dies when the file cannot be written. */
static void write_json(const bench_opts_t *o, const result_t *tdm, const result_t *raw)
{
    FILE *out = o->json ? fopen(o->json, "w") : stdout;
    if (!out)
        die("cannot write", o->json);
    fprintf(out,
            "{\"bench\":\"rpc\",\"transport\":\"tcp-loopback\",\"seconds\":%.1f,\"events\":%ld,"
            "\"rounds\":%d,"
            "\"tandem\":{\"unary_per_s\":%.0f,\"unary_p50_us\":%.1f,\"unary_p99_us\":%.1f,"
            "\"stream_events_per_s\":%.0f},"
            "\"raw_zmq\":{\"unary_per_s\":%.0f,\"unary_p50_us\":%.1f,\"unary_p99_us\":%.1f,"
            "\"stream_events_per_s\":%.0f},"
            "\"ratio\":{\"unary\":%.3f,\"stream\":%.3f}}\n",
            o->seconds, o->events, o->rounds, tdm->unary_per_s, tdm->unary_p50_us,
            tdm->unary_p99_us, tdm->stream_per_s, raw->unary_per_s, raw->unary_p50_us,
            raw->unary_p99_us, raw->stream_per_s, tdm->unary_per_s / raw->unary_per_s,
            tdm->stream_per_s / raw->stream_per_s);
    if (o->json)
        fclose(out);
}

int main(int argc, char **argv)
{
    bench_opts_t o = {.seconds = 1.0, .events = 200000, .rounds = 3};
    bool done;
    int status = parse_args(argc, argv, &o, &done);
    if (done)
        return status;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    if (!net)
        die("tdm_net_new", err.msg);
    size_t lat_cap = 4000000;
    double *lat = malloc(lat_cap * sizeof *lat);
    if (!lat)
        die("malloc", "out of memory");
    wire_t w;
    wire_init(&w);
    result_t tdm = {0}, raw = {0};
    for (int r = 0; r < o.rounds; r++) {
        result_t a, b;
        bench_raw(net, &o, &w, lat, lat_cap, &a);
        bench_tdm(net, &o, lat, lat_cap, &b);
        best_of(&raw, &a, r == 0);
        best_of(&tdm, &b, r == 0);
    }
    free(lat);
    tdm_net_destroy(&net);
    print_table(&o, &w, &tdm, &raw);
    write_json(&o, &tdm, &raw);
    return 0;
}
