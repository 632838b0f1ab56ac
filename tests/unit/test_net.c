/* test_net.c - the messaging layer over ZeroMQ: unary and streaming calls over inproc:// and
 * tcp://, error ENDs, version mismatch, every refusal of the framing layer (crafted with raw
 * ZMQ sockets), deadlines and CANCEL, gone peers, zero-copy release, reconnection, CURVE. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "tdm_test.h"
#include "tandem/net.h"
#include "../../common/src/net/net_internal.h"

#define K_REQUEST TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST
#define K_STREAM TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM
#define K_END TANDEM__V1__FRAME_KIND__FRAME_KIND_END
#define K_CANCEL TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL
#define K_NOTIFY TANDEM__V1__FRAME_KIND__FRAME_KIND_NOTIFY
#define M_GENERATE TANDEM__V1__METHOD__METHOD_GENERATE
#define M_HEALTH TANDEM__V1__METHOD__METHOD_HEALTH
#define M_STATUS TANDEM__V1__METHOD__METHOD_STATUS
#define M_HEARTBEAT TANDEM__V1__METHOD__METHOD_HEARTBEAT
#define M_KV_TRANSFER TANDEM__V1__METHOD__METHOD_KV_TRANSFER

/* How long a test waits for an event that must come. Generous: CI runs on a busy 2-core
 * machine, and the waits end as soon as the event arrives. */
#define WAIT_MS 30000

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A logger that keeps its lines in a temporary file, so tests can read what was logged. */
static void quiet_logger(tdm_logger_t *lg)
{
    tdm_log_init(lg, "test");
    lg->out = tmpfile();
    assert_non_null(lg->out);
}

static char *logger_text(tdm_logger_t *lg)
{
    static char buf[1 << 16];
    fflush(lg->out);
    rewind(lg->out);
    size_t n = fread(buf, 1, sizeof buf - 1, lg->out);
    buf[n] = '\0';
    return buf;
}

/* Waits up to WAIT_MS for a line containing text to be logged (by another thread: the ZAP
 * handler); whether it was. */
static bool wait_logged(tdm_logger_t *lg, const char *text)
{
    double until = tdm_time_now() + WAIT_MS / 1e3;
    while (!strstr(logger_text(lg), text)) {
        if (tdm_time_now() >= until)
            return false;
        sleep_ms(10);
    }
    return true;
}

/* ---- a server thread: HEALTH answers, STATUS fails, GENERATE streams, others unknown ---- */

typedef struct server {
    tdm_sock_t *sock;
    char endpoint[256];
    pthread_t thread;
    atomic_bool stop;
    atomic_int requests; /* REQUEST frames received */
    atomic_int cancels;  /* CANCEL frames received */
    int stream_n;        /* chunks per GENERATE */
} server_t;

static void serve_one(server_t *sv, tdm_frame_t *f)
{
    if (f->kind == K_CANCEL) {
        atomic_fetch_add(&sv->cancels, 1);
        return;
    }
    if (f->kind != K_REQUEST)
        return;
    atomic_fetch_add(&sv->requests, 1);
    if (f->method == M_HEALTH) {
        ProtobufCMessage *req = tdm_frame_unpack(f, &tandem__v1__health_request__descriptor);
        if (!req) {
            tdm_sock_reply_error(sv->sock, f, TDM_EINVALID, "body does not decode");
            return;
        }
        protobuf_c_message_free_unpacked(req, NULL);
        Tandem__V1__HealthResponse r = TANDEM__V1__HEALTH_RESPONSE__INIT;
        r.live = true;
        r.ready = true;
        r.version = "test-1.0";
        assert_int_equal(tdm_sock_reply(sv->sock, f, &r.base), 0);
    } else if (f->method == M_STATUS) {
        tdm_sock_reply_error(sv->sock, f, TDM_ENOTFOUND, "no node named %s", "x");
    } else if (f->method == M_GENERATE) {
        Tandem__V1__GenerateRequest *req = (Tandem__V1__GenerateRequest *)tdm_frame_unpack(
            f, &tandem__v1__generate_request__descriptor);
        if (!req) {
            tdm_sock_reply_error(sv->sock, f, TDM_EINVALID, "body does not decode as %s",
                                 tandem__v1__generate_request__descriptor.name);
            return;
        }
        for (int i = 0; i < sv->stream_n; i++) {
            Tandem__V1__GenerateChunk c = TANDEM__V1__GENERATE_CHUNK__INIT;
            int32_t tok = 100 + i;
            c.request_id = req->request_id;
            c.index = (uint32_t)i;
            c.n_token_ids = 1;
            c.token_ids = &tok;
            assert_int_equal(tdm_sock_stream(sv->sock, f, &c.base), 0);
        }
        protobuf_c_message_free_unpacked(&req->base, NULL);
        assert_int_equal(tdm_sock_reply(sv->sock, f, NULL), 0);
    } else {
        tdm_sock_reply_error(sv->sock, f, TDM_EINVALID, "unknown method %d", f->method);
    }
}

static void *server_main(void *arg)
{
    server_t *sv = arg;
    tdm_frame_t f;
    tdm_frame_init(&f);
    while (!atomic_load(&sv->stop)) {
        int rc = tdm_sock_recv(sv->sock, &f, 20);
        if (rc == TDM_EDEADLINE)
            continue;
        if (rc)
            break;
        serve_one(sv, &f);
        tdm_frame_clear(&f);
    }
    tdm_frame_clear(&f);
    return NULL;
}

static void server_start(server_t *sv, tdm_net_t *net, const char *endpoint,
                         const tdm_sock_opts_t *opts)
{
    memset(sv, 0, sizeof *sv);
    tdm_error_t err = {0};
    sv->sock = tdm_sock_bind(net, endpoint, opts, &err);
    assert_non_null(sv->sock);
    snprintf(sv->endpoint, sizeof sv->endpoint, "%s", tdm_sock_endpoint(sv->sock));
    sv->stream_n = 5;
    assert_int_equal(pthread_create(&sv->thread, NULL, server_main, sv), 0);
}

static void server_stop(server_t *sv)
{
    atomic_store(&sv->stop, true);
    pthread_join(sv->thread, NULL);
    tdm_sock_destroy(&sv->sock);
}

/* ---- raw ZMQ helpers ---- */

static size_t pack_header(const Tandem__V1__FrameHeader *h, uint8_t *buf)
{
    size_t n = tandem__v1__frame_header__get_packed_size(h);
    assert_true(n <= 4096);
    tandem__v1__frame_header__pack(h, buf);
    return n;
}

static void raw_sendv(void *zs, const tdm_net_part_t *parts, size_t n)
{
    for (size_t i = 0; i < n; i++)
        assert_int_equal(zmq_send(zs, parts[i].ptr, parts[i].len, i + 1 < n ? ZMQ_SNDMORE : 0),
                         (int)parts[i].len);
}

/* Receives one message on a raw socket (WAIT_MS at most) and decodes its header part (after the
 * identity on a ROUTER). Returns the header (caller frees) and the part count. */
static Tandem__V1__FrameHeader *raw_recv_header(void *zs, bool router, size_t *n_parts)
{
    int tmo = WAIT_MS;
    zmq_setsockopt(zs, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    Tandem__V1__FrameHeader *h = NULL;
    size_t n = 0;
    bool more = true;
    while (more) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        assert_true(zmq_msg_recv(&m, zs, 0) >= 0);
        more = zmq_msg_more(&m);
        if (n == (router ? 1u : 0u))
            h = tandem__v1__frame_header__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
        zmq_msg_close(&m);
        n++;
    }
    assert_non_null(h);
    if (n_parts)
        *n_parts = n;
    return h;
}

static void *raw_socket(tdm_net_t *net, int type)
{
    void *zs = zmq_socket(tdm_net_zctx(net), type);
    assert_non_null(zs);
    int linger = 0;
    zmq_setsockopt(zs, ZMQ_LINGER, &linger, sizeof linger);
    return zs;
}

/* ---- tests ---- */

static void test_names_and_deadlines(void **state)
{
    (void)state;
    assert_string_equal(tdm_net_method_name(M_GENERATE), "GENERATE");
    assert_string_equal(tdm_net_method_name(TANDEM__V1__METHOD__METHOD_KV_HELLO), "KV_HELLO");
    assert_string_equal(tdm_net_method_name(99), "?");
    assert_string_equal(tdm_net_kind_name(K_END), "END");
    assert_string_equal(tdm_net_kind_name(0), "UNSPECIFIED");
    assert_string_equal(tdm_net_kind_name(42), "?");

    uint64_t now = tdm_net_now_ms();
    assert_true(now > UINT64_C(1700000000000)); /* after Nov 2023: the epoch, in ms */
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_false(tdm_frame_expired(&f, now)); /* no deadline: never expires */
    f.deadline_unix_ms = now + 1000;
    assert_false(tdm_frame_expired(&f, now));
    assert_true(tdm_frame_expired(&f, now + 1000));
    assert_true(tdm_frame_expired(&f, now + 5000));

    /* a missing body decodes as the empty message; garbage does not decode */
    ProtobufCMessage *m = tdm_frame_unpack(&f, &tandem__v1__health_request__descriptor);
    assert_non_null(m);
    protobuf_c_message_free_unpacked(m, NULL);
    static const uint8_t garbage[] = {0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f};
    f.body = garbage;
    f.body_len = sizeof garbage;
    assert_null(tdm_frame_unpack(&f, &tandem__v1__generate_request__descriptor));
    size_t len = 7;
    assert_null(tdm_frame_data(&f, 0, &len));
    assert_int_equal(len, 0);
    tdm_frame_clear(&f);
    tdm_frame_clear(NULL);
}

static void test_curve_keys(void **state)
{
    (void)state;
    char pub[41], sec[41];
    assert_int_equal(tdm_net_curve_keypair(pub, sec), 0);
    assert_int_equal(strlen(pub), 40);
    assert_int_equal(strlen(sec), 40);
    assert_string_not_equal(pub, sec);
    tdm_error_t err = {0};
    assert_int_equal(tdm_net_curve_key_check(pub, "curve.x", &err), 0);
    assert_int_equal(tdm_net_curve_key_check(sec, "curve.x", &err), 0);
    assert_int_equal(tdm_net_curve_key_check("abc", "curve.server_public", &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "curve.server_public"));
    assert_non_null(strstr(err.msg, "got 3 characters"));
    assert_int_equal(tdm_net_curve_key_check(NULL, "curve.client_secret", &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "curve.client_secret: missing"));
    char bad[41];
    memcpy(bad, pub, 41);
    bad[7] = '~';
    assert_int_equal(tdm_net_curve_key_check(bad, "k", &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "character 8 ('~')"));
    /* "#####" is 85^5 - 1, more than 32 bits: not a Z85 encoding */
    memcpy(bad, "#####", 5);
    memcpy(bad + 5, pub + 5, 36);
    assert_int_equal(tdm_net_curve_key_check(bad, "k", &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "characters 1..5"));
}

/* Unary calls: OK, an error END, an unknown method, a body that does not decode. */
static void unary_calls(const char *endpoint)
{
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    assert_non_null(net);
    server_t sv;
    server_start(&sv, net, endpoint, NULL);
    tdm_sock_t *c = tdm_sock_connect(net, sv.endpoint, NULL, &err);
    assert_non_null(c);

    Tandem__V1__HealthRequest hreq = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    assert_int_equal(tdm_sock_call(c, M_HEALTH, 1, "key-1", &hreq.base,
                                   &tandem__v1__health_response__descriptor, WAIT_MS, &resp, &err),
                     0);
    Tandem__V1__HealthResponse *hr = (Tandem__V1__HealthResponse *)resp;
    assert_true(hr->live);
    assert_true(hr->ready);
    assert_string_equal(hr->version, "test-1.0");
    protobuf_c_message_free_unpacked(resp, NULL);

    /* error END: status and message reach the caller */
    Tandem__V1__StatusRequest sreq = TANDEM__V1__STATUS_REQUEST__INIT;
    assert_int_equal(tdm_sock_call(c, M_STATUS, 2, NULL, &sreq.base,
                                   &tandem__v1__cluster_status__descriptor, WAIT_MS, &resp, &err),
                     TDM_ENOTFOUND);
    assert_null(resp);
    assert_int_equal(err.code, TDM_ENOTFOUND);
    assert_string_equal(err.msg, "no node named x");

    /* unknown method: the layer hands it over, the server answers INVALID_ARGUMENT */
    assert_int_equal(tdm_sock_call(c, 77, 3, NULL, &sreq.base,
                                   &tandem__v1__cluster_status__descriptor, WAIT_MS, &resp, &err),
                     TDM_EINVALID);
    assert_string_equal(err.msg, "unknown method 77");

    /* a body of the wrong type (field 1 is a varint where GenerateRequest has a string) */
    Tandem__V1__HealthResponse wrong = TANDEM__V1__HEALTH_RESPONSE__INIT;
    wrong.live = true;
    assert_int_equal(tdm_sock_call(c, M_GENERATE, 4, NULL, &wrong.base, NULL, WAIT_MS, NULL, &err),
                     TDM_EINVALID);
    assert_string_equal(err.msg, "body does not decode as tandem.v1.GenerateRequest");

    /* a response that does not decode as the expected type -> TDM_EINTERNAL */
    assert_int_equal(tdm_sock_call(c, M_HEALTH, 5, NULL, &hreq.base,
                                   &tandem__v1__generate_request__descriptor, WAIT_MS, &resp, &err),
                     TDM_EINTERNAL);
    assert_null(resp);
    assert_non_null(strstr(err.msg, "does not decode as tandem.v1.GenerateRequest"));

    tdm_sock_stats_t st;
    tdm_sock_stats(c, &st);
    assert_int_equal(st.frames_out, 5);
    assert_int_equal(st.frames_in, 5);
    assert_int_equal(st.rejected + st.dropped + st.send_failures, 0);
    assert_true(st.bytes_in > 0 && st.bytes_out > 0);
    tdm_sock_destroy(&c);
    assert_null(c);
    server_stop(&sv);
    assert_int_equal(atomic_load(&sv.requests), 5);
    tdm_net_destroy(&net);
    assert_null(net);
    tdm_net_destroy(&net); /* NULL-safe */
}

static void test_unary_inproc(void **state)
{
    (void)state;
    unary_calls("inproc://unary");
}

static void test_unary_tcp(void **state)
{
    (void)state;
    unary_calls("tcp://127.0.0.1:*");
    /* the other loopback spellings the bind checks accept bind too */
    unary_calls("tcp://localhost:*");
    unary_calls("tcp://[::1]:*");
}

/* Server streaming: REQUEST, N STREAM frames in order, END OK; then a CANCEL mid-stream. */
static void stream_and_cancel(const char *endpoint)
{
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_sock_t *srv = tdm_sock_bind(net, endpoint, NULL, &err);
    assert_non_null(srv);
    tdm_sock_opts_t co = {.identity = "client-7"};
    tdm_sock_t *c = tdm_sock_connect(net, tdm_sock_endpoint(srv), &co, &err);
    assert_non_null(c);

    Tandem__V1__GenerateRequest g = TANDEM__V1__GENERATE_REQUEST__INIT;
    g.request_id = "req-1";
    g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
    g.prompt = "Hello";
    g.stream = true;
    tdm_send_t m = {.kind = K_REQUEST, .method = M_GENERATE, .call_id = 9, .body = &g.base};
    assert_int_equal(tdm_sock_send(c, &m), 0);

    tdm_frame_t f, r;
    tdm_frame_init(&f);
    tdm_frame_init(&r);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, K_REQUEST);
    assert_int_equal(f.method, M_GENERATE);
    assert_int_equal(f.call_id, 9);
    assert_int_equal(f.version_major, TDM_PROTOCOL_MAJOR);
    assert_int_equal(f.peer_len, 8);
    assert_memory_equal(f.peer, "client-7", 8);
    Tandem__V1__GenerateRequest *got = (Tandem__V1__GenerateRequest *)tdm_frame_unpack(
        &f, &tandem__v1__generate_request__descriptor);
    assert_non_null(got);
    assert_string_equal(got->prompt, "Hello");
    assert_true(got->stream);
    protobuf_c_message_free_unpacked(&got->base, NULL);

    const int n = 4;
    for (int i = 0; i < n; i++) {
        Tandem__V1__GenerateChunk ch = TANDEM__V1__GENERATE_CHUNK__INIT;
        int32_t tok = 1000 + i;
        ch.request_id = "req-1";
        ch.index = (uint32_t)i;
        ch.n_token_ids = 1;
        ch.token_ids = &tok;
        assert_int_equal(tdm_sock_stream(srv, &f, &ch.base), 0);
    }
    assert_int_equal(tdm_sock_reply(srv, &f, NULL), 0);
    for (int i = 0; i < n; i++) {
        assert_int_equal(tdm_sock_recv(c, &r, WAIT_MS), 0);
        assert_int_equal(r.kind, K_STREAM);
        assert_int_equal(r.call_id, 9);
        assert_int_equal(r.peer_len, 0);
        Tandem__V1__GenerateChunk *ch = (Tandem__V1__GenerateChunk *)tdm_frame_unpack(
            &r, &tandem__v1__generate_chunk__descriptor);
        assert_non_null(ch);
        assert_int_equal(ch->index, i);
        assert_int_equal(ch->n_token_ids, 1);
        assert_int_equal(ch->token_ids[0], 1000 + i);
        protobuf_c_message_free_unpacked(&ch->base, NULL);
    }
    assert_int_equal(tdm_sock_recv(c, &r, WAIT_MS), 0);
    assert_int_equal(r.kind, K_END);
    assert_int_equal(r.status, 0);
    assert_null(r.body);
    assert_string_equal(r.message, "");

    /* cancellation during a stream: two chunks, then the client gives up */
    m.call_id = 10;
    assert_int_equal(tdm_sock_send(c, &m), 0);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(f.call_id, 10);
    for (int i = 0; i < 2; i++) {
        Tandem__V1__GenerateChunk ch = TANDEM__V1__GENERATE_CHUNK__INIT;
        ch.index = (uint32_t)i;
        assert_int_equal(tdm_sock_stream(srv, &f, &ch.base), 0);
        assert_int_equal(tdm_sock_recv(c, &r, WAIT_MS), 0);
        assert_int_equal(r.kind, K_STREAM);
        assert_int_equal(r.call_id, 10);
    }
    tdm_send_t cancel = {.kind = K_CANCEL, .method = M_GENERATE, .call_id = 10};
    assert_int_equal(tdm_sock_send(c, &cancel), 0);
    tdm_frame_t x;
    tdm_frame_init(&x);
    assert_int_equal(tdm_sock_recv(srv, &x, WAIT_MS), 0);
    assert_int_equal(x.kind, K_CANCEL);
    assert_int_equal(x.call_id, 10);
    assert_int_equal(x.method, M_GENERATE);
    assert_int_equal(x.peer_len, f.peer_len);
    assert_memory_equal(x.peer, f.peer, f.peer_len);
    assert_null(x.body);

    tdm_frame_clear(&x);
    tdm_frame_clear(&f);
    tdm_frame_clear(&r);
    tdm_sock_destroy(&c);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
}

static void test_stream_inproc(void **state)
{
    (void)state;
    stream_and_cancel("inproc://stream");
}

static void test_stream_tcp(void **state)
{
    (void)state;
    stream_and_cancel("tcp://127.0.0.1:*");
}

/* The threaded server streams to a blocking reader too (the common client pattern). */
static void test_stream_threaded(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    server_t sv;
    server_start(&sv, net, "tcp://127.0.0.1:*", NULL);
    tdm_sock_t *c = tdm_sock_connect(net, sv.endpoint, NULL, &err);
    Tandem__V1__GenerateRequest g = TANDEM__V1__GENERATE_REQUEST__INIT;
    g.request_id = "r";
    tdm_send_t m = {.kind = K_REQUEST, .method = M_GENERATE, .call_id = 1, .body = &g.base};
    assert_int_equal(tdm_sock_send(c, &m), 0);
    tdm_frame_t r;
    tdm_frame_init(&r);
    for (int i = 0; i < sv.stream_n; i++) {
        assert_int_equal(tdm_sock_recv(c, &r, WAIT_MS), 0);
        assert_int_equal(r.kind, K_STREAM);
        Tandem__V1__GenerateChunk *ch = (Tandem__V1__GenerateChunk *)tdm_frame_unpack(
            &r, &tandem__v1__generate_chunk__descriptor);
        assert_non_null(ch);
        assert_string_equal(ch->request_id, "r");
        assert_int_equal(ch->token_ids[0], 100 + i);
        protobuf_c_message_free_unpacked(&ch->base, NULL);
    }
    assert_int_equal(tdm_sock_recv(c, &r, WAIT_MS), 0);
    assert_int_equal(r.kind, K_END);
    assert_int_equal(r.status, 0);
    tdm_frame_clear(&r);
    tdm_sock_destroy(&c);
    server_stop(&sv);
    tdm_net_destroy(&net);
}

static void test_version_mismatch(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_logger_t lg;
    quiet_logger(&lg);
    tdm_sock_opts_t so = {.log = &lg};
    tdm_sock_t *srv = tdm_sock_bind(net, "inproc://version", &so, &err);
    assert_non_null(srv);
    void *raw = raw_socket(net, ZMQ_DEALER);
    assert_int_equal(zmq_connect(raw, "inproc://version"), 0);

    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = 1; /* the protocol before 2.0 */
    h.version_minor = 9;
    h.kind = K_REQUEST;
    h.method = M_HEALTH;
    h.call_id = 42;
    uint8_t buf[4096];
    tdm_net_part_t p[2] = {{buf, pack_header(&h, buf)}, {(const uint8_t *)"", 0}};
    raw_sendv(raw, p, 2);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(srv, &f, 300), TDM_EDEADLINE);
    tdm_sock_stats_t st;
    tdm_sock_stats(srv, &st);
    assert_int_equal(st.rejected, 1);
    assert_int_equal(st.frames_in, 0);
    size_t n;
    Tandem__V1__FrameHeader *r = raw_recv_header(raw, false, &n);
    assert_int_equal(n, 1); /* END without a body */
    assert_int_equal(r->kind, K_END);
    assert_int_equal(r->call_id, 42);
    assert_int_equal(r->method, M_HEALTH);
    assert_int_equal(r->status, 9); /* FAILED_PRECONDITION on the wire */
    assert_int_equal(r->version_major, TDM_PROTOCOL_MAJOR);
    assert_string_equal(r->message, "protocol version 1.9 not supported; this node speaks 2.x");
    tandem__v1__frame_header__free_unpacked(r, NULL);
    assert_non_null(strstr(logger_text(&lg), "refused a request"));
    assert_non_null(strstr(logger_text(&lg), "status=FAILED_PRECONDITION"));

    /* the same with a NOTIFY: nobody to answer, dropped */
    h.kind = K_NOTIFY;
    p[0].len = pack_header(&h, buf);
    raw_sendv(raw, p, 2);
    assert_int_equal(tdm_sock_recv(srv, &f, 300), TDM_EDEADLINE);
    tdm_sock_stats(srv, &st);
    assert_int_equal(st.rejected, 1);
    assert_int_equal(st.dropped, 1);
    assert_int_equal(st.frames_in, 0);

    zmq_close(raw);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
    fclose(lg.out);
}

/* One malformed message for test_framing_errors. */
typedef struct bad_case {
    const char *name;
    int expect;           /* 0: accepted; 1: rejected (END); 2: dropped */
    int status;           /* wire status of the END when rejected */
    const char *msg_part; /* substring of the END message */
} bad_case_t;

/* Sends case i's parts on the raw DEALER. */
static void send_bad(void *raw, int i, uint64_t call_id)
{
    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = TDM_PROTOCOL_MAJOR;
    h.kind = K_REQUEST;
    h.method = M_HEALTH;
    h.call_id = call_id;
    static uint8_t hbuf[8192];
    uint8_t *big = NULL;
    tdm_net_part_t p[4];
    switch (i) {
    case 0: /* garbage header bytes */
        p[0] = (tdm_net_part_t){(const uint8_t *)"\xff\xff\xff\xff", 4};
        raw_sendv(raw, p, 1);
        break;
    case 1: /* empty header part: decodes as version 0, kind UNSPECIFIED */
        p[0] = (tdm_net_part_t){(const uint8_t *)"", 0};
        raw_sendv(raw, p, 1);
        break;
    case 2: /* oversized header */
        memset(hbuf, 0, TDM_NET_MAX_HEADER_BYTES + 1);
        p[0] = (tdm_net_part_t){hbuf, TDM_NET_MAX_HEADER_BYTES + 1};
        raw_sendv(raw, p, 1);
        break;
    case 3: /* oversized body */
        big = calloc(1, TDM_NET_MAX_BODY_BYTES + 1);
        assert_non_null(big);
        p[0] = (tdm_net_part_t){hbuf, pack_header(&h, hbuf)};
        p[1] = (tdm_net_part_t){big, TDM_NET_MAX_BODY_BYTES + 1};
        raw_sendv(raw, p, 2);
        free(big);
        break;
    case 4: /* too many data frames announced */
        h.n_data_frames = TDM_NET_MAX_DATA_FRAMES + 1;
        p[0] = (tdm_net_part_t){hbuf, pack_header(&h, hbuf)};
        raw_sendv(raw, p, 1);
        break;
    case 5: { /* too many parts: header + body + MAX+1 data frames */
        h.n_data_frames = TDM_NET_MAX_DATA_FRAMES;
        size_t hl = pack_header(&h, hbuf);
        assert_int_equal(zmq_send(raw, hbuf, hl, ZMQ_SNDMORE), (int)hl);
        assert_int_equal(zmq_send(raw, "", 0, ZMQ_SNDMORE), 0);
        for (uint32_t k = 0; k <= TDM_NET_MAX_DATA_FRAMES; k++)
            assert_int_equal(zmq_send(raw, "d", 1, k < TDM_NET_MAX_DATA_FRAMES ? ZMQ_SNDMORE : 0),
                             1);
        break;
    }
    case 6: /* n_data_frames does not match: 2 announced, 1 part follows */
        h.n_data_frames = 2;
        p[0] = (tdm_net_part_t){hbuf, pack_header(&h, hbuf)};
        p[1] = (tdm_net_part_t){(const uint8_t *)"x", 1};
        raw_sendv(raw, p, 2);
        break;
    case 7: /* unknown kind */
        h.kind = 9;
        p[0] = (tdm_net_part_t){hbuf, pack_header(&h, hbuf)};
        raw_sendv(raw, p, 1);
        break;
    case 8: /* END with a negative status */
        h.kind = K_END;
        h.status = -3;
        p[0] = (tdm_net_part_t){hbuf, pack_header(&h, hbuf)};
        raw_sendv(raw, p, 1);
        break;
    case 9: { /* api key too long */
        char key[300];
        memset(key, 'k', sizeof key - 1);
        key[sizeof key - 1] = '\0';
        h.api_key = key;
        p[0] = (tdm_net_part_t){hbuf, pack_header(&h, hbuf)};
        raw_sendv(raw, p, 1);
        break;
    }
    case 10: /* unknown method on a REQUEST: handed to the caller */
        h.method = 77;
        p[0] = (tdm_net_part_t){hbuf, pack_header(&h, hbuf)};
        raw_sendv(raw, p, 1);
        break;
    case 11: /* a header that is not a FrameHeader at all (wire type clash) */
        p[0] = (tdm_net_part_t){(const uint8_t *)"\x1a\x03"
                                                 "abc",
                                5};
        raw_sendv(raw, p, 1);
        break;
    default: fail();
    }
}

static void framing_errors(const char *endpoint)
{
    static const bad_case_t cases[] = {
        {"garbage header", 2, 0, NULL},
        {"empty header", 2, 0, NULL},
        {"oversized header", 2, 0, NULL},
        {"oversized body", 1, 8, "body of 16777217 bytes exceeds the limit of 16777216 bytes"},
        {"too many data frames", 1, 8, "n_data_frames 65537 exceeds the limit of 65536"},
        {"too many parts", 1, 8, "message of 65540 parts; at most 65539 allowed"},
        {"n_data_frames mismatch", 1, 3, "n_data_frames is 2 but 1 parts follow the FrameHeader"},
        {"unknown kind", 2, 0, NULL},
        {"negative END status", 2, 0, NULL},
        {"api key too long", 1, 3, "api_key of 299 bytes exceeds the limit of 255 bytes"},
        {"unknown method", 0, 0, NULL},
        {"wire type clash", 2, 0, NULL},
    };
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_logger_t lg;
    quiet_logger(&lg);
    tdm_sock_opts_t so = {.log = &lg};
    tdm_sock_t *srv = tdm_sock_bind(net, endpoint, &so, &err);
    assert_non_null(srv);
    void *raw = raw_socket(net, ZMQ_DEALER);
    assert_int_equal(zmq_connect(raw, tdm_sock_endpoint(srv)), 0);
    tdm_frame_t f;
    tdm_frame_init(&f);

    for (int i = 0; i < (int)(sizeof cases / sizeof cases[0]); i++) {
        const bad_case_t *c = &cases[i];
        print_message("case %d: %s\n", i, c->name);
        tdm_sock_stats_t before, after;
        tdm_sock_stats(srv, &before);
        uint64_t bad_id = 100 + (uint64_t)i, good_id = 1000 + (uint64_t)i;
        send_bad(raw, i, bad_id);
        /* then a valid call: it must get through */
        Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
        h.version_major = TDM_PROTOCOL_MAJOR;
        h.version_minor = TDM_PROTOCOL_MINOR + 5; /* a newer minor version is fine */
        h.kind = K_REQUEST;
        h.method = M_HEALTH;
        h.call_id = good_id;
        uint8_t hb[256];
        tdm_net_part_t p[2] = {{hb, pack_header(&h, hb)}, {(const uint8_t *)"", 0}};
        raw_sendv(raw, p, 2);

        assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
        if (c->expect == 0) {
            assert_int_equal(f.call_id, bad_id);
            assert_int_equal(f.method, 77);
            assert_string_equal(tdm_net_method_name(f.method), "?");
            assert_int_equal(
                tdm_sock_reply_error(srv, &f, TDM_EINVALID, "unknown method %d", f.method), 0);
            assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
        }
        assert_int_equal(f.call_id, good_id);
        assert_int_equal(f.version_minor, TDM_PROTOCOL_MINOR + 5);
        assert_non_null(f.body);
        assert_int_equal(f.body_len, 0);
        assert_int_equal(tdm_sock_reply(srv, &f, NULL), 0);
        tdm_sock_stats(srv, &after);
        assert_int_equal(after.rejected - before.rejected, c->expect == 1);
        assert_int_equal(after.dropped - before.dropped, c->expect == 2);
        assert_int_equal(after.frames_in - before.frames_in, c->expect == 0 ? 2 : 1);

        Tandem__V1__FrameHeader *r;
        if (c->expect != 2) {
            r = raw_recv_header(raw, false, NULL);
            assert_int_equal(r->kind, K_END);
            assert_int_equal(r->call_id, bad_id);
            assert_int_equal(r->status, c->expect == 0 ? 3 : c->status);
            if (c->msg_part)
                assert_string_equal(r->message, c->msg_part);
            tandem__v1__frame_header__free_unpacked(r, NULL);
        }
        r = raw_recv_header(raw, false, NULL);
        assert_int_equal(r->kind, K_END);
        assert_int_equal(r->call_id, good_id);
        assert_int_equal(r->status, 0);
        tandem__v1__frame_header__free_unpacked(r, NULL);
    }
    const char *log = logger_text(&lg);
    assert_non_null(strstr(log, "dropped a message"));
    assert_non_null(strstr(log, "FrameHeader does not decode"));
    assert_non_null(strstr(log, "FrameHeader of 4097 bytes exceeds the limit of 4096 bytes"));
    assert_non_null(strstr(log, "unknown frame kind 9"));

    tdm_frame_clear(&f);
    zmq_close(raw);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
    fclose(lg.out);
}

static void test_framing_errors_inproc(void **state)
{
    (void)state;
    framing_errors("inproc://framing");
}

static void test_framing_errors_tcp(void **state)
{
    (void)state;
    framing_errors("tcp://127.0.0.1:*");
}

/* The DEALER side validates too (no identity part there). */
static void test_dealer_side_validation(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_logger_t lg;
    quiet_logger(&lg);
    void *raw = raw_socket(net, ZMQ_ROUTER);
    assert_int_equal(zmq_bind(raw, "inproc://dealer-side"), 0);
    tdm_sock_opts_t co = {.identity = "node-1", .log = &lg};
    tdm_sock_t *c = tdm_sock_connect(net, "inproc://dealer-side", &co, &err);
    assert_non_null(c);
    Tandem__V1__Heartbeat hb = TANDEM__V1__HEARTBEAT__INIT;
    hb.node_id = "node-1";
    hb.instance_id = 12;
    assert_int_equal(tdm_sock_notify(c, NULL, 0, M_HEARTBEAT, &hb.base), 0);
    size_t n;
    Tandem__V1__FrameHeader *r = raw_recv_header(raw, true, &n);
    assert_int_equal(n, 3); /* identity, header, body */
    assert_int_equal(r->kind, K_NOTIFY);
    assert_int_equal(r->method, M_HEARTBEAT);
    assert_int_equal(r->call_id, 0);
    tandem__v1__frame_header__free_unpacked(r, NULL);

    /* garbage, then an END with too many parts announced, then a valid NOTIFY */
    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = TDM_PROTOCOL_MAJOR;
    h.kind = K_END;
    h.call_id = 5;
    h.n_data_frames = 3;
    uint8_t buf[256];
    tdm_net_part_t p[3] = {{(const uint8_t *)"node-1", 6}, {(const uint8_t *)"\x08", 1}};
    raw_sendv(raw, p, 2);
    p[1] = (tdm_net_part_t){buf, pack_header(&h, buf)};
    raw_sendv(raw, p, 2);
    h.kind = K_NOTIFY;
    h.method = TANDEM__V1__METHOD__METHOD_NODE_CANCEL;
    h.n_data_frames = 0;
    Tandem__V1__NodeCancel nc = TANDEM__V1__NODE_CANCEL__INIT;
    nc.request_id = "req-9";
    nc.status = 1;
    uint8_t body[64];
    p[1] = (tdm_net_part_t){buf, pack_header(&h, buf)};
    p[2] = (tdm_net_part_t){body, tandem__v1__node_cancel__pack(&nc, body)};
    raw_sendv(raw, p, 3);

    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(c, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, K_NOTIFY);
    assert_int_equal(f.peer_len, 0);
    Tandem__V1__NodeCancel *got =
        (Tandem__V1__NodeCancel *)tdm_frame_unpack(&f, &tandem__v1__node_cancel__descriptor);
    assert_non_null(got);
    assert_string_equal(got->request_id, "req-9");
    assert_int_equal(got->status, 1);
    protobuf_c_message_free_unpacked(&got->base, NULL);
    tdm_sock_stats_t st;
    tdm_sock_stats(c, &st);
    assert_int_equal(st.dropped, 2);
    assert_int_equal(st.rejected, 0);
    assert_int_equal(st.frames_in, 1);
    assert_non_null(strstr(logger_text(&lg), "n_data_frames is 3 but 0 parts follow"));

    tdm_frame_clear(&f);
    tdm_sock_destroy(&c);
    zmq_close(raw);
    tdm_net_destroy(&net);
    fclose(lg.out);
}

/* tdm_net_parse directly: limits on data frames are checked on lengths alone. */
static void test_parse_limits(void **state)
{
    (void)state;
    Tandem__V1__FrameHeader h = TANDEM__V1__FRAME_HEADER__INIT;
    h.version_major = TDM_PROTOCOL_MAJOR;
    h.kind = K_REQUEST;
    h.method = M_KV_TRANSFER;
    h.call_id = 3;
    h.n_data_frames = 2;
    uint8_t hb[256], small[16] = {0};
    tdm_net_part_t p[5] = {
        {(const uint8_t *)"peer", 4},    {hb, pack_header(&h, hb)},
        {small, TDM_NET_MAX_BODY_BYTES}, /* lengths only: the bytes are never read */
        {small, TDM_NET_MAX_DATA_BYTES}, {small, 0},
    };
    tdm_frame_t f;
    tdm_frame_init(&f);
    tdm_net_layout_t lay;
    tdm_error_t why;
    assert_int_equal(tdm_net_parse(p, 5, 5, true, &f, &lay, &why), TDM_NET_ACCEPT);
    assert_int_equal(lay.header, 1);
    assert_int_equal(lay.body, 2);
    assert_int_equal(lay.first_data, 3);
    assert_int_equal(f.n_data, 2);
    assert_int_equal(f.body_len, TDM_NET_MAX_BODY_BYTES);
    assert_int_equal(f.peer_len, 4);

    p[3].len = (size_t)TDM_NET_MAX_DATA_BYTES + 1;
    assert_int_equal(tdm_net_parse(p, 5, 5, true, &f, &lay, &why), TDM_NET_REJECT);
    assert_int_equal(why.code, TDM_ERESOURCE);
    assert_string_equal(why.msg,
                        "data frame 0 of 268435457 bytes exceeds the limit of 268435456 bytes");
    assert_int_equal(f.call_id, 3);
    p[3].len = 1;
    p[2].len = (size_t)TDM_NET_MAX_BODY_BYTES + 1;
    assert_int_equal(tdm_net_parse(p, 5, 5, true, &f, &lay, &why), TDM_NET_REJECT);
    assert_int_equal(why.code, TDM_ERESOURCE);

    /* without the body: two data frames, no body */
    p[2].len = 0;
    assert_int_equal(tdm_net_parse(p + 1, 3, 3, false, &f, &lay, &why), TDM_NET_ACCEPT);
    assert_int_equal(lay.body, SIZE_MAX);
    assert_null(f.body);
    assert_int_equal(lay.first_data, 1);
    /* kept fewer parts than the message had: refused as too many */
    assert_int_equal(tdm_net_parse(p, 4, 5, true, &f, &lay, &why), TDM_NET_REJECT);
    assert_int_equal(why.code, TDM_ERESOURCE);
    /* identity problems are drops: no way to answer */
    p[0].len = 0;
    assert_int_equal(tdm_net_parse(p, 5, 5, true, &f, &lay, &why), TDM_NET_DROP);
    assert_int_equal(tdm_net_parse(p, 0, 0, true, &f, &lay, &why), TDM_NET_DROP);
    assert_int_equal(tdm_net_parse(p, 0, 0, false, &f, &lay, &why), TDM_NET_DROP);
    assert_string_equal(why.msg, "message without a FrameHeader");
}

/* Sending: limits on the send side, message truncation at a character boundary. */
static void test_send_checks(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_sock_t *srv = tdm_sock_bind(net, "inproc://send-checks", NULL, &err);
    tdm_sock_t *c = tdm_sock_connect(net, "inproc://send-checks", NULL, &err);
    assert_non_null(srv);
    assert_non_null(c);

    tdm_send_t m = {.kind = K_REQUEST, .method = M_HEALTH, .call_id = 1};
    m.peer = NULL;
    assert_int_equal(tdm_sock_send(srv, &m), TDM_EINVALID); /* ROUTER needs a peer */
    assert_non_null(strstr(tdm_sock_errmsg(srv), "needs a peer"));
    m.kind = 0;
    assert_int_equal(tdm_sock_send(c, &m), TDM_EINVALID);
    m.kind = K_END;
    m.status = 3;
    assert_int_equal(tdm_sock_send(c, &m), TDM_EINVALID);
    m.status = 0;
    char key[TDM_NET_API_KEY_MAX + 1];
    memset(key, 'a', sizeof key - 1);
    key[sizeof key - 1] = '\0';
    m.kind = K_REQUEST;
    m.api_key = key;
    assert_int_equal(tdm_sock_send(c, &m), TDM_EINVALID);
    key[TDM_NET_API_KEY_MAX - 1] = '\0'; /* 255 bytes: allowed */
    assert_int_equal(tdm_sock_send(c, &m), 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(strlen(f.api_key), TDM_NET_API_KEY_MAX - 1);
    assert_int_equal(f.deadline_unix_ms, 0);

    /* a long END message is cut below TDM_ERRMSG_MAX at a character boundary */
    char text[2001];
    for (int i = 0; i < 1000; i++)
        memcpy(text + 2 * i, "\xc3\xa9", 2); /* é */
    text[2000] = '\0';
    assert_int_equal(tdm_sock_reply_error(srv, &f, TDM_EINTERNAL, "%s", text), 0);
    tdm_frame_t r;
    tdm_frame_init(&r);
    assert_int_equal(tdm_sock_recv(c, &r, WAIT_MS), 0);
    assert_int_equal(r.status, TDM_EINTERNAL);
    assert_int_equal(strlen(r.message), 510);
    assert_memory_equal(r.message, text, 510);

    tdm_frame_clear(&r);
    tdm_frame_clear(&f);
    /* options */
    tdm_sock_opts_t bad = {.heartbeat_ms = 700000};
    assert_null(tdm_sock_connect(net, "inproc://x", &bad, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    tdm_sock_opts_t off = {.heartbeat_ms = -1};
    tdm_sock_t *c2 = tdm_sock_connect(net, "tcp://127.0.0.1:1", &off, &err);
    assert_non_null(c2);
    tdm_sock_destroy(&c2);
    assert_null(tdm_sock_connect(net, "nonsense://x", NULL, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_null(tdm_sock_bind(net, "tcp://not an address", NULL, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_null(tdm_sock_bind(net, "inproc://send-checks", NULL, &err)); /* taken */
    assert_int_equal(err.code, TDM_EUNAVAILABLE);
    assert_null(tdm_net_new(0, &err));
    assert_int_equal(err.code, TDM_EINVALID);

    tdm_sock_destroy(&c);
    tdm_sock_destroy(&srv);
    tdm_sock_destroy(&srv); /* NULL-safe */
    tdm_net_destroy(&net);
}

static void test_deadline_and_cancel(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_sock_t *srv = tdm_sock_bind(net, "tcp://127.0.0.1:*", NULL, &err);
    tdm_sock_t *c = tdm_sock_connect(net, tdm_sock_endpoint(srv), NULL, &err);
    assert_non_null(c);

    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp = (ProtobufCMessage *)&req; /* must come back NULL */
    uint64_t t0_ms = tdm_net_now_ms();
    double t0 = tdm_time_now();
    assert_int_equal(tdm_sock_call(c, M_HEALTH, 5, NULL, &req.base,
                                   &tandem__v1__health_response__descriptor, 300, &resp, &err),
                     TDM_EDEADLINE);
    double dt = tdm_time_now() - t0;
    uint64_t t1_ms = tdm_net_now_ms();
    assert_null(resp);
    /* at its deadline, not before; the upper bound only says it did not hang (on a busy
     * machine the thread may lose the CPU for a while after the deadline) */
    assert_true(dt >= 0.29);
    assert_true(dt < WAIT_MS / 1e3);
    assert_string_equal(err.msg, "HEALTH call 5: no answer within 300 ms");

    /* the server saw the request with its deadline, then the CANCEL */
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, K_REQUEST);
    assert_int_equal(f.call_id, 5);
    assert_true(f.deadline_unix_ms >= t0_ms + 300); /* 300 ms from the send, which came */
    assert_true(f.deadline_unix_ms <= t1_ms + 300); /* between t0_ms and t1_ms */
    assert_true(tdm_frame_expired(&f, tdm_net_now_ms()));
    assert_false(tdm_frame_expired(&f, f.deadline_unix_ms - 1));
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, K_CANCEL);
    assert_int_equal(f.call_id, 5);
    assert_int_equal(f.method, M_HEALTH);

    /* nothing arrives: recv with timeout 0 returns at once, > 0 after the timeout */
    t0 = tdm_time_now();
    assert_int_equal(tdm_sock_recv(srv, &f, 0), TDM_EDEADLINE);
    assert_int_equal(tdm_sock_recv(srv, &f, 100), TDM_EDEADLINE);
    dt = tdm_time_now() - t0;
    assert_true(dt >= 0.095 && dt < WAIT_MS / 1e3);

    tdm_frame_clear(&f);
    tdm_sock_destroy(&c);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
}

/* A call discards frames of other call ids (the late answer above) and STREAM frames. */
static void test_rpc_discards_other_calls(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    server_t sv;
    server_start(&sv, net, "inproc://discard", NULL);
    tdm_sock_t *c = tdm_sock_connect(net, sv.endpoint, NULL, &err);
    /* a streaming GENERATE (call 1) answered with STREAMs, then a HEALTH call (call 2) */
    Tandem__V1__GenerateRequest g = TANDEM__V1__GENERATE_REQUEST__INIT;
    tdm_send_t m = {.kind = K_REQUEST, .method = M_GENERATE, .call_id = 1, .body = &g.base};
    assert_int_equal(tdm_sock_send(c, &m), 0);
    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    assert_int_equal(tdm_sock_call(c, M_HEALTH, 2, NULL, &req.base,
                                   &tandem__v1__health_response__descriptor, WAIT_MS, &resp, &err),
                     0);
    assert_true(((Tandem__V1__HealthResponse *)resp)->live);
    protobuf_c_message_free_unpacked(resp, NULL);
    /* and a GENERATE through tdm_sock_call skips the STREAMs and ends with the END */
    assert_int_equal(tdm_sock_call(c, M_GENERATE, 3, NULL, &g.base, NULL, WAIT_MS, NULL, &err), 0);
    tdm_sock_stats_t st;
    tdm_sock_stats(c, &st);
    assert_int_equal(st.frames_in, 2 * (5 + 1) + 1);
    tdm_sock_destroy(&c);
    server_stop(&sv);
    tdm_net_destroy(&net);
}

static void test_gone_peer(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_sock_t *srv = tdm_sock_bind(net, "tcp://127.0.0.1:*", NULL, &err);
    assert_int_equal(tdm_sock_notify(srv, (const uint8_t *)"nobody", 6, M_HEARTBEAT, NULL),
                     TDM_EUNAVAILABLE);
    assert_string_equal(tdm_sock_errmsg(srv), "peer nobody is unknown or gone");
    tdm_sock_opts_t co = {.identity = "c1"};
    tdm_sock_t *c = tdm_sock_connect(net, tdm_sock_endpoint(srv), &co, &err);
    assert_int_equal(tdm_sock_notify(c, NULL, 0, M_HEARTBEAT, NULL), 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_memory_equal(f.peer, "c1", 2);
    assert_int_equal(tdm_sock_notify(srv, f.peer, f.peer_len, M_HEARTBEAT, NULL), 0);
    assert_int_equal(tdm_sock_recv(c, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, K_NOTIFY);
    tdm_sock_destroy(&c);
    /* the ROUTER learns of the disconnect in the background: poll until it has */
    int rc = 0;
    double until = tdm_time_now() + WAIT_MS / 1e3;
    while (rc == 0 && tdm_time_now() < until) {
        rc = tdm_sock_notify(srv, (const uint8_t *)"c1", 2, M_HEARTBEAT, NULL);
        if (rc == 0)
            sleep_ms(10);
    }
    assert_int_equal(rc, TDM_EUNAVAILABLE);
    assert_string_equal(tdm_sock_errmsg(srv), "peer c1 is unknown or gone");
    tdm_sock_stats_t st;
    tdm_sock_stats(srv, &st);
    assert_int_equal(st.send_failures, 2);
    tdm_frame_clear(&f);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
}

/* ---- zero-copy ---- */

typedef struct free_count {
    atomic_int n;
} free_count_t;

static void count_free(void *ptr, void *hint)
{
    (void)ptr;
    atomic_fetch_add(&((free_count_t *)hint)->n, 1);
}

/* Waits up to ms for the count to reach want; whether it is exactly want then. */
static bool wait_count(free_count_t *fc, int want, int ms)
{
    double until = tdm_time_now() + ms / 1e3;
    while (atomic_load(&fc->n) < want && tdm_time_now() < until)
        sleep_ms(5);
    return atomic_load(&fc->n) == want;
}

static void test_zero_copy(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(2, &err);
    tdm_sock_t *srv = tdm_sock_bind(net, "tcp://127.0.0.1:*", NULL, &err);
    tdm_sock_t *c = tdm_sock_connect(net, tdm_sock_endpoint(srv), NULL, &err);
    static uint8_t blocks[3][4096];
    for (int b = 0; b < 3; b++)
        for (int i = 0; i < 4096; i++)
            blocks[b][i] = (uint8_t)(b * 31 + i);
    free_count_t fc = {0};
    tdm_net_data_t d[5] = {
        {blocks[0], 4096, count_free, &fc},
        {blocks[1], 4096, count_free, &fc},
        {"copied", 6, NULL, NULL},
        {blocks[2], 0, count_free, &fc}, /* empty zero-copy frame */
        {blocks[2], 1000, count_free, &fc},
    };
    Tandem__V1__KvTransfer kt = TANDEM__V1__KV_TRANSFER__INIT;
    kt.request_id = "req-kv";
    kt.n_blocks = 5;
    tdm_send_t m = {.kind = K_REQUEST,
                    .method = M_KV_TRANSFER,
                    .call_id = 11,
                    .body = &kt.base,
                    .data = d,
                    .n_data = 5};
    assert_int_equal(tdm_sock_send(c, &m), 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(f.n_data, 5);
    size_t len;
    const uint8_t *p = tdm_frame_data(&f, 0, &len);
    assert_int_equal(len, 4096);
    assert_memory_equal(p, blocks[0], 4096);
    p = tdm_frame_data(&f, 1, &len);
    assert_int_equal(len, 4096);
    assert_memory_equal(p, blocks[1], 4096);
    p = tdm_frame_data(&f, 2, &len);
    assert_int_equal(len, 6);
    assert_memory_equal(p, "copied", 6);
    p = tdm_frame_data(&f, 3, &len);
    assert_non_null(p);
    assert_int_equal(len, 0);
    p = tdm_frame_data(&f, 4, &len);
    assert_int_equal(len, 1000);
    assert_memory_equal(p, blocks[2], 1000);
    assert_null(tdm_frame_data(&f, 5, &len));
    Tandem__V1__KvTransfer *got =
        (Tandem__V1__KvTransfer *)tdm_frame_unpack(&f, &tandem__v1__kv_transfer__descriptor);
    assert_string_equal(got->request_id, "req-kv");
    assert_int_equal(got->n_blocks, 5);
    protobuf_c_message_free_unpacked(&got->base, NULL);
    tdm_frame_clear(&f);
    assert_true(wait_count(&fc, 4, WAIT_MS)); /* the four zero-copy frames, once each */
    /* and never again: once a later message's frame is released, ZeroMQ is done with the
     * first message (one pipe, one I/O thread, in order), and the count is still 4 */
    free_count_t marker = {0};
    tdm_net_data_t md = {blocks[0], 16, count_free, &marker};
    tdm_send_t mm = {.kind = K_NOTIFY, .method = M_HEARTBEAT, .data = &md, .n_data = 1};
    assert_int_equal(tdm_sock_send(c, &mm), 0);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, K_NOTIFY);
    tdm_frame_clear(&f);
    assert_true(wait_count(&marker, 1, WAIT_MS));
    assert_int_equal(atomic_load(&fc.n), 4);

    /* failed sends release every frame, exactly once, before returning */
    atomic_store(&fc.n, 0);
    m.peer = (const uint8_t *)"nobody";
    m.peer_len = 6;
    assert_int_equal(tdm_sock_send(srv, &m), TDM_EUNAVAILABLE);
    assert_int_equal(atomic_load(&fc.n), 4);
    atomic_store(&fc.n, 0);
    d[1].len = (size_t)TDM_NET_MAX_DATA_BYTES + 1; /* over the limit: nothing sent */
    assert_int_equal(tdm_sock_send(c, &m), TDM_EINVALID);
    assert_int_equal(atomic_load(&fc.n), 4);
    d[1].len = 4096;
    atomic_store(&fc.n, 0);
    m.kind = 0;
    assert_int_equal(tdm_sock_send(c, &m), TDM_EINVALID);
    assert_int_equal(atomic_load(&fc.n), 4);
    m.kind = K_REQUEST;

    /* a queue that fills up: a DEALER whose peer never comes; frames of refused messages
     * are released at once, those of queued ones when the socket closes (linger 0) */
    atomic_store(&fc.n, 0);
    tdm_sock_opts_t so = {.sndhwm = 4};
    tdm_sock_t *lonely = tdm_sock_connect(net, "tcp://127.0.0.1:1", &so, &err);
    assert_non_null(lonely);
    int sent = 0, rc = 0;
    for (int i = 0; i < 1000 && rc == 0; i++) {
        rc = tdm_sock_send(lonely, &m);
        sent += rc == 0;
    }
    assert_int_equal(rc, TDM_EUNAVAILABLE);
    assert_non_null(strstr(tdm_sock_errmsg(lonely), "send queue full"));
    assert_true(sent >= 1 && sent < 1000);
    /* the refused message's four frames, and the empty frame of each queued message (an
     * empty zero-copy frame is released as soon as it is sent) */
    assert_int_equal(atomic_load(&fc.n), 4 + sent);
    tdm_sock_destroy(&lonely);
    assert_true(wait_count(&fc, 4 * (sent + 1), WAIT_MS));

    tdm_sock_destroy(&c);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
}

/* Waits until nothing listens on 127.0.0.1:port any more (a listener that ZeroMQ closes in
 * the background): Linux refuses to bind a port that a socket listens on. */
static void wait_port_free(int port)
{
    double until = tdm_time_now() + WAIT_MS / 1e3;
    for (;;) {
        int fd = socket(AF_INET, SOCK_STREAM, 0);
        assert_true(fd >= 0);
        int one = 1;
        setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_port = htons((uint16_t)port);
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        int rc = bind(fd, (struct sockaddr *)&a, sizeof a);
        close(fd);
        if (rc == 0)
            return;
        if (tdm_time_now() >= until)
            fail_msg("port %d still in use after %d ms", port, WAIT_MS);
        sleep_ms(10);
    }
}

/* Starts monitoring events of zsock (a socket of this thread) at the inproc endpoint name
 * (one per monitor); returns the PAIR socket to read them from (monitor_stop closes it). */
static void *monitor_start(tdm_net_t *net, void *zsock, const char *name, int events)
{
    assert_int_equal(zmq_socket_monitor(zsock, name, events), 0);
    void *mon = raw_socket(net, ZMQ_PAIR);
    int tmo = WAIT_MS;
    zmq_setsockopt(mon, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
    assert_int_equal(zmq_connect(mon, name), 0);
    return mon;
}

/* Waits up to WAIT_MS per event for n events of kind event. */
static void monitor_wait(void *mon, int event, int n)
{
    for (int seen = 0; seen < n;) {
        zmq_msg_t ev;
        zmq_msg_init(&ev);
        if (zmq_msg_recv(&ev, mon, 0) < 0)
            fail_msg("socket event 0x%x not seen within %d ms", event, WAIT_MS);
        bool more = zmq_msg_more(&ev);
        if (zmq_msg_size(&ev) >= 2) {
            uint16_t id;
            memcpy(&id, zmq_msg_data(&ev), sizeof id);
            seen += id == event;
        }
        zmq_msg_close(&ev);
        while (more) { /* the endpoint part */
            zmq_msg_init(&ev);
            assert_true(zmq_msg_recv(&ev, mon, 0) >= 0);
            more = zmq_msg_more(&ev);
            zmq_msg_close(&ev);
        }
    }
}

static void monitor_stop(void *zsock, void *mon)
{
    zmq_socket_monitor(zsock, NULL, 0);
    zmq_close(mon);
}

static void test_reconnect(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    /* find a free port, then let it go */
    tdm_sock_t *tmp = tdm_sock_bind(net, "tcp://127.0.0.1:*", NULL, &err);
    char ep[256];
    snprintf(ep, sizeof ep, "%s", tdm_sock_endpoint(tmp));
    tdm_sock_destroy(&tmp);
    /* the listener closes in the background: do not connect to it */
    const char *colon = strrchr(ep, ':');
    assert_non_null(colon);
    wait_port_free(atoi(colon + 1));

    tdm_sock_opts_t co = {.reconnect_ms = 20, .reconnect_max_ms = 200};
    tdm_sock_t *c = tdm_sock_connect(net, ep, &co, &err);
    assert_non_null(c);
    assert_string_equal(tdm_sock_endpoint(c), ep);
    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    tdm_send_t m = {.kind = K_REQUEST, .method = M_HEALTH, .call_id = 3, .body = &req.base};
    void *mon = monitor_start(net, tdm_sock_zsock(c), "inproc://test-net-reconnect",
                              ZMQ_EVENT_CONNECT_RETRIED);
    assert_int_equal(tdm_sock_send(c, &m), 0); /* queued */
    /* a few failed connection attempts */
    monitor_wait(mon, ZMQ_EVENT_CONNECT_RETRIED, 2);
    monitor_stop(tdm_sock_zsock(c), mon);
    tdm_sock_t *srv = tdm_sock_bind(net, ep, NULL, &err);
    assert_non_null(srv);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_int_equal(f.call_id, 3);
    assert_int_equal(tdm_sock_reply(srv, &f, NULL), 0);
    assert_int_equal(tdm_sock_recv(c, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.call_id, 3);
    tdm_frame_clear(&f);
    tdm_sock_destroy(&c);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
}

/* tdm_sock_connected follows the connection, not a count: a connection dropped before its
 * handshake (a listener that closes at once: a restarting router) is a DISCONNECTED with no
 * HANDSHAKE_SUCCEEDED, so once a later connection succeeds the socket has seen as many
 * disconnects as handshakes while it is up (the node link once compared the two and took a
 * live router for lost). */
static void test_connected_after_dropped_connection(void **state)
{
    (void)state;
    int lfd = socket(AF_INET, SOCK_STREAM, 0);
    assert_true(lfd >= 0);
    int one = 1;
    setsockopt(lfd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
    assert_int_equal(listen(lfd, 8), 0);
    socklen_t alen = sizeof a;
    assert_int_equal(getsockname(lfd, (struct sockaddr *)&a, &alen), 0);
    char ep[64];
    snprintf(ep, sizeof ep, "tcp://127.0.0.1:%u", (unsigned)ntohs(a.sin_port));

    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_sock_opts_t co = {.watch_handshake = true, .reconnect_ms = 20, .reconnect_max_ms = 100};
    tdm_sock_t *c = tdm_sock_connect(net, ep, &co, &err);
    assert_non_null(c);
    assert_false(tdm_sock_connected(c));
    /* every connection is accepted and closed before a byte of ZMTP */
    double until = tdm_time_now() + WAIT_MS / 1e3;
    while (tdm_sock_disconnects(c) == 0) {
        assert_true(tdm_time_now() < until);
        struct pollfd pfd = {.fd = lfd, .events = POLLIN};
        if (poll(&pfd, 1, 10) == 1) {
            int fd = accept(lfd, NULL, NULL);
            if (fd >= 0)
                close(fd);
        }
    }
    assert_false(tdm_sock_connected(c));
    assert_int_equal(tdm_sock_handshakes(c), 0);
    close(lfd);
    /* a real server on the same port: the socket's next attempt gets through */
    tdm_sock_t *srv = tdm_sock_bind(net, ep, NULL, &err);
    assert_non_null(srv);
    until = tdm_time_now() + WAIT_MS / 1e3;
    while (!tdm_sock_connected(c)) {
        assert_true(tdm_time_now() < until);
        sleep_ms(10);
    }
    assert_true(tdm_sock_handshakes(c) >= 1);
    assert_true(tdm_sock_disconnects(c) >= tdm_sock_handshakes(c)); /* counts cannot tell */
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_send(c, &(tdm_send_t){.kind = K_NOTIFY, .method = M_HEARTBEAT}), 0);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    /* the server goes away: not connected any more */
    tdm_sock_destroy(&srv);
    until = tdm_time_now() + WAIT_MS / 1e3;
    while (tdm_sock_connected(c)) {
        assert_true(tdm_time_now() < until);
        sleep_ms(10);
    }
    tdm_frame_clear(&f);
    tdm_sock_destroy(&c);
    tdm_net_destroy(&net);
}

/* A CURVE server admitting a set of keys, each under a name: every message carries the name of
 * the key its connection authenticated with (tdm_frame_t.user_id); an unknown key is refused;
 * a connection without CURVE has user_id "". */
static void test_curve_identity(void **state)
{
    (void)state;
    char spub[41], ssec[41], apub[41], asec[41], bpub[41], bsec[41], xpub[41], xsec[41];
    assert_int_equal(tdm_net_curve_keypair(spub, ssec), 0);
    assert_int_equal(tdm_net_curve_keypair(apub, asec), 0);
    assert_int_equal(tdm_net_curve_keypair(bpub, bsec), 0);
    assert_int_equal(tdm_net_curve_keypair(xpub, xsec), 0);
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_logger_t lg;
    quiet_logger(&lg);
    /* the set is checked: no duplicate keys, names of 1..63 bytes */
    tdm_curve_peer_t dup[] = {{apub, "node-a"}, {apub, "node-b"}};
    tdm_curve_keys_t bad = {
        .server_public = spub, .server_secret = ssec, .clients = dup, .n_clients = 2};
    tdm_sock_opts_t bo = {.curve = &bad, .log = &lg};
    assert_null(tdm_sock_bind(net, "tcp://127.0.0.1:*", &bo, &err));
    assert_non_null(strstr(err.msg, "curve.clients[1]: the same public key as curve.clients[0]"));
    tdm_curve_peer_t unnamed[] = {{apub, ""}};
    bad.clients = unnamed;
    bad.n_clients = 1;
    assert_null(tdm_sock_bind(net, "tcp://127.0.0.1:*", &bo, &err));
    assert_non_null(strstr(err.msg, "curve.clients[0]: the name must be"));

    tdm_curve_peer_t peers[] = {{apub, "node-a"}, {bpub, "node-b"}};
    tdm_curve_keys_t sk = {
        .server_public = spub, .server_secret = ssec, .clients = peers, .n_clients = 2};
    tdm_sock_opts_t so = {.curve = &sk, .log = &lg};
    tdm_sock_t *srv = tdm_sock_bind(net, "tcp://127.0.0.1:*", &so, &err);
    assert_non_null(srv);
    tdm_frame_t f;
    tdm_frame_init(&f);
    const char *pubs[] = {apub, bpub}, *secs[] = {asec, bsec}, *names[] = {"node-a", "node-b"};
    for (int i = 0; i < 2; i++) {
        tdm_curve_keys_t ck = {
            .server_public = spub, .client_public = pubs[i], .client_secret = secs[i]};
        tdm_sock_opts_t co = {.curve = &ck};
        tdm_sock_t *c = tdm_sock_connect(net, tdm_sock_endpoint(srv), &co, &err);
        assert_non_null(c);
        for (int k = 0; k < 2; k++) { /* every message, not only the first */
            assert_int_equal(
                tdm_sock_send(c, &(tdm_send_t){.kind = K_NOTIFY, .method = M_HEARTBEAT}), 0);
            assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
            assert_string_equal(f.user_id, names[i]);
            /* the reply goes back over the same connection; a DEALER's frame has no name */
            assert_int_equal(tdm_sock_notify(srv, f.peer, f.peer_len, M_HEARTBEAT, NULL), 0);
            assert_int_equal(tdm_sock_recv(c, &f, WAIT_MS), 0);
            assert_string_equal(f.user_id, "");
        }
        tdm_sock_destroy(&c);
    }
    /* a key outside the set: refused at the handshake, nothing arrives */
    tdm_curve_keys_t xk = {.server_public = spub, .client_public = xpub, .client_secret = xsec};
    tdm_sock_opts_t xo = {.curve = &xk};
    tdm_sock_t *c = tdm_sock_connect(net, tdm_sock_endpoint(srv), &xo, &err);
    assert_int_equal(tdm_sock_send(c, &(tdm_send_t){.kind = K_NOTIFY, .method = M_HEARTBEAT}), 0);
    char refused[128];
    snprintf(refused, sizeof refused, "unknown public key %s", xpub);
    assert_true(wait_logged(&lg, refused));
    assert_int_equal(tdm_sock_recv(srv, &f, 200), TDM_EDEADLINE);
    tdm_sock_destroy(&c);
    tdm_sock_destroy(&srv);

    /* plain TCP: no name */
    srv = tdm_sock_bind(net, "tcp://127.0.0.1:*", NULL, &err);
    c = tdm_sock_connect(net, tdm_sock_endpoint(srv), NULL, &err);
    assert_int_equal(tdm_sock_send(c, &(tdm_send_t){.kind = K_NOTIFY, .method = M_HEARTBEAT}), 0);
    assert_int_equal(tdm_sock_recv(srv, &f, WAIT_MS), 0);
    assert_string_equal(f.user_id, "");
    tdm_frame_clear(&f);
    tdm_sock_destroy(&c);
    tdm_sock_destroy(&srv);
    tdm_net_destroy(&net);
}

/* Secret key files: owner-only, one Z85 key (a trailing newline allowed), the configured public
 * key's own secret. */
static void test_curve_secret_read(void **state)
{
    (void)state;
    char pub[41], sec[41], opub[41], osec[41], got[41];
    assert_int_equal(tdm_net_curve_keypair(pub, sec), 0);
    assert_int_equal(tdm_net_curve_keypair(opub, osec), 0);
    char dir[] = "/tmp/tdm_net_keys_XXXXXX", path[64];
    assert_non_null(mkdtemp(dir));
    snprintf(path, sizeof path, "%s/n.key", dir);
    tdm_error_t err = {0};
    const char *what = "nodes[0].curve_secret_key_file";
    struct {
        const char *text;
        int mode, rc;
        const char *msg;
    } cases[] = {
        {"\n", 0600, 0, NULL}, /* text is appended to the key */
        {"", 0400, 0, NULL},
        {"\n", 0640, TDM_EPRECONDITION, "mode 0640 lets group or others read the secret key"},
        {"\n", 0604, TDM_EPRECONDITION, "(chmod 600 "},
        {"x\n", 0600, TDM_EINVALID, "must hold one 40-character Z85 CURVE secret key"},
        {"\n\n", 0600, TDM_EINVALID, "must hold one 40-character Z85 CURVE secret key"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        unlink(path);
        FILE *fp = fopen(path, "w");
        assert_non_null(fp);
        fprintf(fp, "%s%s", sec, cases[i].text);
        fclose(fp);
        assert_int_equal(chmod(path, (mode_t)cases[i].mode), 0);
        int rc = tdm_net_curve_secret_read(path, pub, what, got, &err);
        if (rc != cases[i].rc)
            fail_msg("case %zu: rc %d, want %d (%s)", i, rc, cases[i].rc, err.msg);
        if (rc == 0) {
            assert_string_equal(got, sec);
            continue;
        }
        assert_string_equal(got, "");
        assert_non_null(strstr(err.msg, what));
        assert_non_null(strstr(err.msg, path));
        if (!strstr(err.msg, cases[i].msg))
            fail_msg("case %zu: '%s' lacks '%s'", i, err.msg, cases[i].msg);
    }
    /* the secret of another pair */
    unlink(path);
    FILE *fp = fopen(path, "w");
    fprintf(fp, "%s\n", osec);
    fclose(fp);
    chmod(path, 0600);
    assert_int_equal(tdm_net_curve_secret_read(path, pub, what, got, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "belongs to the public key"));
    assert_non_null(strstr(err.msg, opub));
    unlink(path);
    assert_int_equal(tdm_net_curve_secret_read(path, pub, what, got, &err), TDM_ENOTFOUND);
    assert_non_null(strstr(err.msg, path));
    rmdir(dir);
}

static void test_curve(void **state)
{
    (void)state;
    char spub[41], ssec[41], cpub[41], csec[41], opub[41], osec[41];
    assert_int_equal(tdm_net_curve_keypair(spub, ssec), 0);
    assert_int_equal(tdm_net_curve_keypair(cpub, csec), 0);
    assert_int_equal(tdm_net_curve_keypair(opub, osec), 0);
    tdm_error_t err = {0};
    tdm_net_t *net = tdm_net_new(1, &err);
    tdm_logger_t lg;
    quiet_logger(&lg);

    /* key checks on bind and connect */
    tdm_curve_keys_t bad = {spub, "short", cpub, NULL, NULL, 0};
    tdm_sock_opts_t bo = {.curve = &bad};
    assert_null(tdm_sock_bind(net, "tcp://127.0.0.1:*", &bo, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "curve.server_secret"));
    bad = (tdm_curve_keys_t){opub, ssec, cpub, NULL, NULL, 0};
    assert_null(tdm_sock_bind(net, "tcp://127.0.0.1:*", &bo, &err));
    assert_non_null(strstr(err.msg, "does not match the secret key"));
    bad = (tdm_curve_keys_t){spub, NULL, cpub, NULL, NULL, 0};
    assert_null(tdm_sock_connect(net, "tcp://127.0.0.1:1", &bo, &err));
    assert_non_null(strstr(err.msg, "curve.client_secret: missing"));

    tdm_curve_keys_t sk = {spub, ssec, cpub, NULL, NULL, 0};
    tdm_sock_opts_t so = {.curve = &sk, .log = &lg};
    server_t sv;
    server_start(&sv, net, "tcp://127.0.0.1:*", &so);
    /* a second CURVE server in the same context admits another client key */
    tdm_curve_keys_t sk2 = {spub, ssec, opub, NULL, NULL, 0};
    tdm_sock_opts_t so2 = {.curve = &sk2, .log = &lg};
    tdm_sock_t *srv2 = tdm_sock_bind(net, "tcp://127.0.0.1:*", &so2, &err);
    assert_non_null(srv2);

    Tandem__V1__HealthRequest req = TANDEM__V1__HEALTH_REQUEST__INIT;
    ProtobufCMessage *resp = NULL;
    tdm_curve_keys_t good = {spub, NULL, cpub, csec, NULL, 0};
    tdm_sock_opts_t go = {.curve = &good};
    tdm_sock_t *c = tdm_sock_connect(net, sv.endpoint, &go, &err);
    assert_non_null(c);
    assert_int_equal(tdm_sock_call(c, M_HEALTH, 1, NULL, &req.base,
                                   &tandem__v1__health_response__descriptor, WAIT_MS, &resp, &err),
                     0);
    assert_string_equal(((Tandem__V1__HealthResponse *)resp)->version, "test-1.0");
    protobuf_c_message_free_unpacked(resp, NULL);
    tdm_sock_destroy(&c);

    /* a valid key pair the server does not know: refused (a short call timeout is fine, the
     * server never answers a refused client; the refusal itself is waited for) */
    tdm_curve_keys_t wrong = {spub, NULL, opub, osec, NULL, 0};
    tdm_sock_opts_t wo = {.curve = &wrong};
    c = tdm_sock_connect(net, sv.endpoint, &wo, &err);
    assert_non_null(c);
    assert_int_equal(tdm_sock_call(c, M_HEALTH, 2, NULL, &req.base,
                                   &tandem__v1__health_response__descriptor, 700, &resp, &err),
                     TDM_EDEADLINE);
    assert_true(wait_logged(&lg, "refused a CURVE client with an unknown public key"));
    tdm_sock_destroy(&c);
    /* no CURVE at all */
    c = tdm_sock_connect(net, sv.endpoint, NULL, &err);
    assert_int_equal(tdm_sock_call(c, M_HEALTH, 3, NULL, &req.base,
                                   &tandem__v1__health_response__descriptor, 700, &resp, &err),
                     TDM_EDEADLINE);
    tdm_sock_destroy(&c);
    /* the right client key for server 1 is the wrong one for server 2: wait until server 2
     * has refused the handshake, then nothing got through */
    void *mon = monitor_start(net, tdm_sock_zsock(srv2), "inproc://test-net-curve",
                              ZMQ_EVENT_HANDSHAKE_FAILED_AUTH);
    c = tdm_sock_connect(net, tdm_sock_endpoint(srv2), &go, &err);
    assert_int_equal(tdm_sock_send(c, &(tdm_send_t){.kind = K_NOTIFY, .method = M_HEARTBEAT}), 0);
    monitor_wait(mon, ZMQ_EVENT_HANDSHAKE_FAILED_AUTH, 1);
    monitor_stop(tdm_sock_zsock(srv2), mon);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(srv2, &f, 0), TDM_EDEADLINE);
    tdm_sock_destroy(&c);
    /* and the key server 2 admits gets through */
    c = tdm_sock_connect(net, tdm_sock_endpoint(srv2), &wo, &err);
    assert_int_equal(tdm_sock_send(c, &(tdm_send_t){.kind = K_NOTIFY, .method = M_HEARTBEAT}), 0);
    assert_int_equal(tdm_sock_recv(srv2, &f, WAIT_MS), 0);
    assert_int_equal(f.method, M_HEARTBEAT);
    tdm_frame_clear(&f);
    tdm_sock_destroy(&c);

    tdm_sock_destroy(&srv2);
    server_stop(&sv);
    assert_int_equal(atomic_load(&sv.requests), 1); /* only the admitted client's */
    tdm_net_destroy(&net);
    const char *log = logger_text(&lg);
    assert_non_null(strstr(log, "refused a CURVE client with an unknown public key"));
    fclose(lg.out);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_names_and_deadlines),
        cmocka_unit_test(test_curve_keys),
        cmocka_unit_test(test_unary_inproc),
        cmocka_unit_test(test_unary_tcp),
        cmocka_unit_test(test_stream_inproc),
        cmocka_unit_test(test_stream_tcp),
        cmocka_unit_test(test_stream_threaded),
        cmocka_unit_test(test_version_mismatch),
        cmocka_unit_test(test_framing_errors_inproc),
        cmocka_unit_test(test_framing_errors_tcp),
        cmocka_unit_test(test_dealer_side_validation),
        cmocka_unit_test(test_parse_limits),
        cmocka_unit_test(test_send_checks),
        cmocka_unit_test(test_deadline_and_cancel),
        cmocka_unit_test(test_rpc_discards_other_calls),
        cmocka_unit_test(test_gone_peer),
        cmocka_unit_test(test_zero_copy),
        cmocka_unit_test(test_reconnect),
        cmocka_unit_test(test_connected_after_dropped_connection),
        cmocka_unit_test(test_curve),
        cmocka_unit_test(test_curve_identity),
        cmocka_unit_test(test_curve_secret_read),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
