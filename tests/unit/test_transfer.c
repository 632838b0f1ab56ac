/* test_transfer.c - the KV transport's tcp backend between two pools in one process (a sender
 * pool and a receiver pool with the SmolLM2-135M f16 layout, a receiver on
 * tcp://127.0.0.1:*): the happy path at several block counts, every rejection (corrupted
 * block, truncated transfer, wrong frame size, wrong fingerprint, wrong layout, receiver out
 * of blocks, unknown request), a receiver gone mid-transfer, cancellation, and send-side
 * validation. Every case ends with a status checked on both sides, both pools back to zero
 * used blocks and tdm_kv_pool_check passing. */
#include "tdm_test.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <time.h>
#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "tandem/device.h"
#include "tandem/kv.h"
#include "tandem/net.h"
#include "tandem/proto.h"
#include "tandem/transfer.h"

#include "../../common/src/transfer/xxh3_lanes.h"

/* SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, 16-token blocks, f16: 368,640 B/block. */
static const tdm_kv_layout_t smollm2 = {30, 3, 64, 16, TDM_KV_F16};
#define FINGERPRINT UINT64_C(0x5eed5eed12345678)
#define POOL_BLOCKS 80u
/* How long a test waits for an event that must come (a transfer, a report). Generous: CI
 * runs on a busy 2-core machine, and waits end as soon as the event arrives. */
#define WAIT_MS 30000

typedef struct ctx {
    tdm_net_t *net;
    tdm_kv_pool_t *spool; /* sender's */
    tdm_kv_pool_t *rpool; /* receiver's */
    tdm_logger_t log;     /* quiet: warnings of expected rejections are not test output */
    bool clean;           /* the test reached its end: every socket is closed */
} ctx_t;

/* What the receiver's lookup callback answers. */
typedef struct reservation {
    const char *request_id;
    const uint32_t *blocks;
    uint32_t n_blocks;
    int status; /* != 0: answer this with msg */
    const char *msg;
    int calls;
} reservation_t;

/* The attempt id the tests give a request id's transfers (any fixed mapping would do). */
static uint64_t attempt_of(const char *request_id)
{
    uint64_t h = 1469598103934665603ull;
    for (const char *c = request_id; *c; c++)
        h = (h ^ (unsigned char)*c) * 1099511628211ull;
    return h | 1;
}

static int lookup_cb(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                     const uint32_t **blocks, uint32_t *n_blocks, tdm_error_t *err)
{
    (void)n_tokens;
    reservation_t *r = user;
    r->calls++;
    if (r->status != 0)
        return tdm_error_set(err, r->status, "%s", r->msg);
    if (!r->request_id || strcmp(request_id, r->request_id) != 0 ||
        attempt_id != attempt_of(r->request_id))
        return tdm_error_set(err, TDM_ENOTFOUND, "request %s unknown or cancelled", request_id);
    *blocks = r->blocks;
    *n_blocks = r->n_blocks;
    return 0;
}

static int setup(void **state)
{
    ctx_t *c = calloc(1, sizeof *c);
    tdm_error_t err = {0};
    c->net = tdm_net_new(2, &err);
    if (!c->net)
        fail_msg("tdm_net_new: %s", err.msg);
    c->spool = tdm_kv_pool_new(&smollm2, POOL_BLOCKS, &err);
    c->rpool = tdm_kv_pool_new(&smollm2, POOL_BLOCKS, &err);
    assert_non_null(c->spool);
    assert_non_null(c->rpool);
    assert_int_equal(tdm_kv_pool_block_bytes(c->spool), 368640);
    tdm_log_init(&c->log, "test");
    c->log.level = TDM_LOG_OFF;
    *state = c;
    return 0;
}

static int teardown(void **state)
{
    ctx_t *c = *state;
    /* A failed test leaves sockets open, and terminating the context would wait for them
     * forever: leak the context then (the run fails anyway). */
    if (c->clean)
        tdm_net_destroy(&c->net);
    tdm_kv_pool_destroy(&c->spool);
    tdm_kv_pool_destroy(&c->rpool);
    free(c);
    return 0;
}

static void check_pool_empty(const tdm_kv_pool_t *pool)
{
    tdm_kv_stats_t s;
    tdm_kv_pool_stats(pool, &s);
    assert_int_equal(s.n_used, 0);
    tdm_error_t err = {0};
    if (tdm_kv_pool_check(pool, &err) != 0)
        fail_msg("pool inconsistent: %s", err.msg);
}

static uint32_t n_used(const tdm_kv_pool_t *pool)
{
    tdm_kv_stats_t s;
    tdm_kv_pool_stats(pool, &s);
    return s.n_used;
}

/* Fills the sequence's blocks with bytes drawn from seed. */
static void fill_seq(tdm_kv_pool_t *pool, const tdm_kv_seq_t *seq, uint64_t seed)
{
    uint8_t *base = tdm_kv_pool_base(pool);
    uint64_t bb = tdm_kv_pool_block_bytes(pool);
    for (uint32_t i = 0; i < seq->n_blocks; i++) {
        uint64_t *p = (uint64_t *)(base + (uint64_t)seq->blocks[i] * bb);
        for (uint64_t w = 0; w < bb / 8; w++) {
            seed += UINT64_C(0x9e3779b97f4a7c15);
            uint64_t z = seed;
            z = (z ^ (z >> 30)) * UINT64_C(0xbf58476d1ce4e5b9);
            z = (z ^ (z >> 27)) * UINT64_C(0x94d049bb133111eb);
            p[w] = z ^ (z >> 31);
        }
    }
}

static uint8_t *block_ptr(tdm_kv_pool_t *pool, uint32_t b)
{
    return (uint8_t *)tdm_kv_pool_base(pool) + (uint64_t)b * tdm_kv_pool_block_bytes(pool);
}

/* XXH3 over a sequence's blocks, in order: a fingerprint of their contents. */
static uint64_t seq_digest(tdm_kv_pool_t *pool, const tdm_kv_seq_t *seq)
{
    uint64_t h = 0;
    for (uint32_t i = 0; i < seq->n_blocks; i++)
        h = XXH3_64bits_withSeed(block_ptr(pool, seq->blocks[i]), tdm_kv_pool_block_bytes(pool), h);
    return h;
}

static void reserve(tdm_kv_pool_t *pool, tdm_kv_seq_t *seq, uint32_t n_tokens)
{
    tdm_kv_seq_init(seq);
    assert_int_equal(tdm_kv_seq_reserve(pool, seq, n_tokens), 0);
    seq->n_tokens = n_tokens;
}

static tdm_kv_receiver_t *receiver_new(ctx_t *c, uint64_t fingerprint)
{
    tdm_kv_receiver_opts_t o;
    memset(&o, 0, sizeof o);
    o.endpoint = "tcp://127.0.0.1:*";
    o.node_id = "decode-0";
    o.model_fingerprint = fingerprint;
    o.log = &c->log;
    tdm_error_t err = {0};
    tdm_kv_receiver_t *r = tdm_kv_receiver_new(c->net, c->rpool, &o, &err);
    if (!r)
        fail_msg("tdm_kv_receiver_new: %s", err.msg);
    assert_non_null(strstr(tdm_kv_receiver_endpoint(r), "tcp://127.0.0.1:"));
    assert_null(strstr(tdm_kv_receiver_endpoint(r), "*"));
    assert_non_null(tdm_kv_receiver_zsock(r));
    return r;
}

static tdm_kv_sender_t *sender_new(ctx_t *c, tdm_kv_pool_t *pool, uint64_t fingerprint,
                                   int timeout_ms)
{
    tdm_kv_sender_opts_t o;
    memset(&o, 0, sizeof o);
    o.node_id = "prefill-0";
    o.model_fingerprint = fingerprint;
    o.backend = TDM_KV_BACKEND_TCP;
    o.timeout_ms = timeout_ms;
    o.log = &c->log;
    tdm_error_t err = {0};
    tdm_kv_sender_t *s = tdm_kv_sender_new(c->net, pool, &o, &err);
    if (!s)
        fail_msg("tdm_kv_sender_new: %s", err.msg);
    return s;
}

static uint64_t send_seq(tdm_kv_sender_t *s, const char *endpoint, const char *request_id,
                         const tdm_kv_seq_t *seq)
{
    tdm_kv_send_req_t req = {
        .request_id = request_id,
        .attempt_id = attempt_of(request_id),
        .endpoint = endpoint,
        .blocks = seq->blocks,
        .n_blocks = seq->n_blocks,
        .n_tokens = seq->n_tokens,
        .first_token = 4242,
        .prefill_s = 0.125,
    };
    uint64_t id = 0;
    tdm_error_t err = {0};
    int rc = tdm_kv_sender_send(s, &req, &id, &err);
    if (rc != 0)
        fail_msg("tdm_kv_sender_send: %s", err.msg);
    assert_true(id > 0);
    return id;
}

/* Waits for the sender to report exactly one finished transfer. */
static tdm_kv_send_done_t wait_done(tdm_kv_sender_t *s)
{
    tdm_kv_send_done_t d[4];
    memset(d, 0, sizeof d);
    double until = tdm_time_now() + WAIT_MS / 1e3;
    int n = 0;
    while (n == 0 && tdm_time_now() < until) {
        n = tdm_kv_sender_poll(s, 100, d, 4);
        assert_true(n >= 0);
    }
    if (n != 1)
        fail_msg("sender reported %d transfers, expected 1", n);
    return d[0];
}

static tdm_kv_received_t recv_one(tdm_kv_receiver_t *r, reservation_t *res)
{
    tdm_kv_received_t got;
    int n = tdm_kv_receiver_recv(r, WAIT_MS, lookup_cb, res, &got);
    if (n != 1)
        fail_msg("tdm_kv_receiver_recv returned %d, expected 1", n);
    return got;
}

/* ---- names, checksums ---- */

static void test_backend_names(void **state)
{
    (void)state;
    tdm_kv_backend_t b;
    tdm_error_t err = {0};
    assert_string_equal(tdm_kv_backend_name(TDM_KV_BACKEND_TCP), "tcp");
    assert_string_equal(tdm_kv_backend_name(TDM_KV_BACKEND_NCCL), "nccl");
    assert_string_equal(tdm_kv_backend_name(TDM_KV_BACKEND_CUDA_IPC), "cuda_ipc");
    assert_string_equal(tdm_kv_backend_name((tdm_kv_backend_t)7), "?");
    assert_int_equal(tdm_kv_backend_parse("cuda_ipc", &b, &err), 0);
    assert_int_equal(b, TDM_KV_BACKEND_CUDA_IPC);
    assert_int_equal(tdm_kv_backend_parse("rdma", &b, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "tcp, nccl or cuda_ipc"));
    assert_true(tdm_kv_backend_built(TDM_KV_BACKEND_TCP));
#ifdef TANDEM_HAVE_CUDA
    assert_true(tdm_kv_backend_built(TDM_KV_BACKEND_NCCL));
    assert_true(tdm_kv_backend_built(TDM_KV_BACKEND_CUDA_IPC));
#else
    assert_false(tdm_kv_backend_built(TDM_KV_BACKEND_NCCL));
    assert_false(tdm_kv_backend_built(TDM_KV_BACKEND_CUDA_IPC));
#endif
    uint8_t block[256];
    for (int i = 0; i < 256; i++)
        block[i] = (uint8_t)i;
    assert_int_equal(tdm_kv_block_checksum(block, sizeof block), XXH3_64bits(block, sizeof block));
    assert_int_not_equal(tdm_kv_block_checksum(block, 255), tdm_kv_block_checksum(block, 256));
}

static void test_sender_options(void **state)
{
    ctx_t *c = *state;
    tdm_kv_sender_opts_t o;
    memset(&o, 0, sizeof o);
    o.backend = TDM_KV_BACKEND_NCCL;
    o.log = &c->log;
    tdm_error_t err = {0};
    assert_null(tdm_kv_sender_new(c->net, c->spool, &o, &err));
    assert_int_equal(err.code, TDM_EINVALID);
#ifndef TANDEM_HAVE_CUDA
    assert_non_null(strstr(err.msg, "not built"));
#endif
    o.backend = TDM_KV_BACKEND_TCP;
    o.timeout_ms = -1;
    assert_null(tdm_kv_sender_new(c->net, c->spool, &o, &err));
    assert_non_null(strstr(err.msg, "timeout_ms"));
    o.timeout_ms = 0;
    o.threads = -2;
    assert_null(tdm_kv_sender_new(c->net, c->spool, &o, &err));
    assert_non_null(strstr(err.msg, "threads is -2"));
    tdm_kv_receiver_opts_t ro;
    memset(&ro, 0, sizeof ro);
    ro.endpoint = "tcp://127.0.0.1:*";
    ro.threads = -1;
    ro.log = &c->log;
    assert_null(tdm_kv_receiver_new(c->net, c->rpool, &ro, &err));
    assert_non_null(strstr(err.msg, "threads is -1"));
    tdm_kv_sender_destroy(NULL);
    tdm_kv_receiver_destroy(NULL);
    c->clean = true;
}

/* ---- happy path ---- */

/* Threads in this process (/proc/self/task). */
static int n_tasks(void)
{
    DIR *d = opendir("/proc/self/task");
    assert_non_null(d);
    int n = 0;
    for (struct dirent *e; (e = readdir(d));)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

/* A sender and a receiver of one thread each (a node with `threads: 1`) checksum and copy a
 * transfer of more than TDM_KV_PARALLEL_BLOCKS blocks without starting OpenMP threads: an
 * idle OpenMP team beside a one-thread engine spins under OMP_WAIT_POLICY=active and halved
 * a disaggregated cluster's throughput on two cores. Runs before any other test of this file
 * starts OpenMP threads. */
static void test_one_thread_no_team(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_opts_t ro;
    memset(&ro, 0, sizeof ro);
    ro.endpoint = "tcp://127.0.0.1:*";
    ro.node_id = "decode-0";
    ro.model_fingerprint = FINGERPRINT;
    ro.threads = 1;
    ro.log = &c->log;
    tdm_error_t err = {0};
    tdm_kv_receiver_t *r = tdm_kv_receiver_new(c->net, c->rpool, &ro, &err);
    assert_non_null(r);
    tdm_kv_sender_opts_t so;
    memset(&so, 0, sizeof so);
    so.node_id = "prefill-0";
    so.model_fingerprint = FINGERPRINT;
    so.backend = TDM_KV_BACKEND_TCP;
    so.threads = 1;
    so.log = &c->log;
    tdm_kv_sender_t *s = tdm_kv_sender_new(c->net, c->spool, &so, &err);
    assert_non_null(s);
    tdm_kv_seq_t sseq, rseq;
    reserve(c->spool, &sseq, 160);
    reserve(c->rpool, &rseq, 160);
    assert_true(sseq.n_blocks >= 8);
    fill_seq(c->spool, &sseq, 77);
    uint64_t want = seq_digest(c->spool, &sseq);
    int before = n_tasks();
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-one-thread", &sseq);
    reservation_t res = {
        .request_id = "req-one-thread", .blocks = rseq.blocks, .n_blocks = rseq.n_blocks};
    assert_int_equal(recv_one(r, &res).status, 0);
    assert_int_equal(wait_done(s).status, 0);
    assert_int_equal(seq_digest(c->rpool, &rseq), want);
    assert_int_equal(n_tasks(), before);
    tdm_kv_seq_release(c->spool, &sseq);
    tdm_kv_seq_release(c->rpool, &rseq);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

static void test_happy_path(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    const char *ep = tdm_kv_receiver_endpoint(r);
    /* 1 token, one full block, a partial last block, several, and many blocks. */
    const uint32_t tokens[] = {1, 16, 17, 40, 160, 1000};
    for (size_t t = 0; t < sizeof tokens / sizeof tokens[0]; t++) {
        tdm_kv_seq_t sseq, rseq;
        reserve(c->spool, &sseq, tokens[t]);
        reserve(c->rpool, &rseq, tokens[t]);
        assert_int_equal(sseq.n_blocks, (tokens[t] + 15) / 16);
        fill_seq(c->spool, &sseq, 1000 + t);
        uint64_t want = seq_digest(c->spool, &sseq);
        assert_int_not_equal(seq_digest(c->rpool, &rseq), want);

        char rid[32];
        snprintf(rid, sizeof rid, "req-happy-%zu", t);
        uint64_t id = send_seq(s, ep, rid, &sseq);
        assert_int_equal(tdm_kv_sender_in_flight(s), 1);
        /* The caller may drop its references at once: the transfer holds its own. */
        uint32_t nb = sseq.n_blocks;
        tdm_kv_seq_release(c->spool, &sseq);
        assert_int_equal(n_used(c->spool), nb);

        reservation_t res = {.request_id = rid, .blocks = rseq.blocks, .n_blocks = rseq.n_blocks};
        tdm_kv_received_t got = recv_one(r, &res);
        assert_int_equal(got.status, 0);
        assert_string_equal(got.message, "");
        assert_string_equal(got.request_id, rid);
        assert_int_equal(got.transfer_id, id);
        assert_int_equal(got.n_tokens, tokens[t]);
        assert_int_equal(got.first_token, 4242);
        assert_int_equal(got.n_blocks, nb);
        assert_int_equal(got.bytes, (uint64_t)nb * 368640);
        assert_true(got.prefill_s == 0.125);
        assert_string_equal(got.sender_node_id, "prefill-0");
        assert_int_equal(res.calls, 1);
        assert_int_equal(seq_digest(c->rpool, &rseq), want);

        tdm_kv_send_done_t d = wait_done(s);
        assert_int_equal(d.status, 0);
        assert_string_equal(d.message, "");
        assert_string_equal(d.request_id, rid);
        assert_int_equal(d.transfer_id, id);
        assert_int_equal(d.bytes, (uint64_t)nb * 368640);
        assert_true(d.seconds > 0 && d.seconds < WAIT_MS / 1e3);
        assert_int_equal(tdm_kv_sender_in_flight(s), 0);
        check_pool_empty(c->spool);
        tdm_kv_seq_release(c->rpool, &rseq);
        check_pool_empty(c->rpool);
    }
    /* Nothing left: a poll reports nothing and returns after its timeout. */
    tdm_kv_send_done_t d;
    assert_int_equal(tdm_kv_sender_poll(s, 10, &d, 1), 0);
    tdm_kv_sender_destroy(&s);
    assert_null(s);
    tdm_kv_receiver_destroy(&r);
    assert_null(r);
    c->clean = true;
}

/* Several transfers in flight to one receiver at once, acknowledged in order. */
static void test_pipelined(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    enum { N = 4 };
    tdm_kv_seq_t sseq[N], rseq[N];
    uint64_t want[N], ids[N];
    char rid[N][16];
    for (int i = 0; i < N; i++) {
        reserve(c->spool, &sseq[i], 33 + 16 * (uint32_t)i);
        reserve(c->rpool, &rseq[i], 33 + 16 * (uint32_t)i);
        fill_seq(c->spool, &sseq[i], 77 + (uint64_t)i);
        want[i] = seq_digest(c->spool, &sseq[i]);
        snprintf(rid[i], sizeof rid[i], "req-pipe-%d", i);
        ids[i] = send_seq(s, tdm_kv_receiver_endpoint(r), rid[i], &sseq[i]);
        tdm_kv_seq_release(c->spool, &sseq[i]);
    }
    assert_int_equal(tdm_kv_sender_in_flight(s), N);
    for (int i = 0; i < N; i++) {
        reservation_t res = {
            .request_id = rid[i], .blocks = rseq[i].blocks, .n_blocks = rseq[i].n_blocks};
        tdm_kv_received_t got = recv_one(r, &res);
        assert_int_equal(got.status, 0);
        assert_int_equal(got.transfer_id, ids[i]);
        assert_int_equal(seq_digest(c->rpool, &rseq[i]), want[i]);
    }
    tdm_kv_send_done_t d[N];
    int got = 0;
    double until = tdm_time_now() + WAIT_MS / 1e3;
    while (got < N && tdm_time_now() < until) {
        int n = tdm_kv_sender_poll(s, 100, d + got, N - got);
        assert_true(n >= 0);
        got += n;
    }
    assert_int_equal(got, N);
    for (int i = 0; i < N; i++) {
        assert_int_equal(d[i].status, 0);
        assert_int_equal(d[i].transfer_id, ids[i]);
    }
    /* Cancelling a request whose transfer was acknowledged does nothing. */
    assert_int_equal(tdm_kv_sender_cancel(s, attempt_of(rid[0])), 0);
    check_pool_empty(c->spool);
    for (int i = 0; i < N; i++)
        tdm_kv_seq_release(c->rpool, &rseq[i]);
    check_pool_empty(c->rpool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* ---- rejections through a real sender ---- */

/* Sends 40 tokens (3 blocks) and expects a rejection on both sides, with the receiver's
 * blocks untouched and both pools empty afterwards. */
static void expect_rejected(ctx_t *c, tdm_kv_pool_t *spool, uint64_t s_fp, reservation_t *res,
                            int want_status, const char *want_msg)
{
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_kv_sender_t *s = sender_new(c, spool, s_fp, WAIT_MS);
    tdm_kv_seq_t sseq, rseq;
    reserve(spool, &sseq, 40);
    reserve(c->rpool, &rseq, 40);
    fill_seq(spool, &sseq, 5);
    fill_seq(c->rpool, &rseq, 6);
    uint64_t before = seq_digest(c->rpool, &rseq);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-rej", &sseq);
    tdm_kv_seq_release(spool, &sseq);
    if (!res->status && res->request_id) {
        res->blocks = rseq.blocks;
        res->n_blocks = rseq.n_blocks;
    }
    tdm_kv_received_t got = recv_one(r, res);
    assert_int_equal(got.status, want_status);
    if (!strstr(got.message, want_msg))
        fail_msg("receiver message \"%s\" does not contain \"%s\"", got.message, want_msg);
    assert_string_equal(got.request_id, "req-rej");
    assert_int_equal(seq_digest(c->rpool, &rseq), before);

    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, want_status);
    if (!strstr(d.message, want_msg))
        fail_msg("sender message \"%s\" does not contain \"%s\"", d.message, want_msg);
    assert_string_equal(d.message, got.message);
    check_pool_empty(spool);
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->rpool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
}

static void test_wrong_fingerprint(void **state)
{
    ctx_t *c = *state;
    reservation_t res = {.request_id = "req-rej"};
    expect_rejected(c, c->spool, FINGERPRINT ^ 1, &res, TDM_EPRECONDITION,
                    "model fingerprint mismatch: transfer 0x5eed5eed12345679, this node serves "
                    "0x5eed5eed12345678");
    assert_int_equal(res.calls, 0); /* rejected before the blocks were asked for */
    c->clean = true;
}

static void test_wrong_layout(void **state)
{
    ctx_t *c = *state;
    tdm_error_t err = {0};
    tdm_kv_layout_t l = smollm2;
    l.n_kv_heads = 2;
    tdm_kv_pool_t *other = tdm_kv_pool_new(&l, 8, &err);
    assert_non_null(other);
    reservation_t res = {.request_id = "req-rej"};
    expect_rejected(c, other, FINGERPRINT, &res, TDM_EPRECONDITION,
                    "KV layout mismatch: n_kv_heads is 2 in the transfer, 3 on this node");
    tdm_kv_pool_destroy(&other);

    l = smollm2;
    l.dtype = TDM_KV_F32;
    other = tdm_kv_pool_new(&l, 8, &err);
    assert_non_null(other);
    expect_rejected(c, other, FINGERPRINT, &res, TDM_EPRECONDITION,
                    "dtype is f32 in the transfer, f16 on this node");
    tdm_kv_pool_destroy(&other);
    assert_int_equal(res.calls, 0);
    c->clean = true;
}

/* ---- layer groups (2.9) ---- */

/* A Gemma-3-shaped layout: 6 layers, layer 5 full attention, the others a window of W tokens
 * (6 groups of one layer: the full one first), 1 KV head of 256, blocks of 4 tokens: a block of
 * one group's layer is 2 * 4 * 256 * 2 = 4,096 B. */
static const tdm_kv_layout_t gemma_like = {6, 1, 256, 4, TDM_KV_F16};

static tdm_kv_pool_t *grouped_pool(tdm_kv_groups_t *g, uint32_t window, uint32_t n_blocks)
{
    uint32_t windows[6] = {window, window, window, window, window, 0};
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_groups_init(g, 6, windows, &err), TDM_OK);
    tdm_kv_pool_t *pool = tdm_kv_pool_new_grouped(&gemma_like, g, n_blocks, &err);
    if (!pool)
        fail_msg("%s", err.msg);
    return pool;
}

static tdm_kv_receiver_t *receiver_on(ctx_t *c, tdm_kv_pool_t *pool)
{
    tdm_kv_receiver_opts_t o;
    memset(&o, 0, sizeof o);
    o.endpoint = "tcp://127.0.0.1:*";
    o.node_id = "decode-0";
    o.model_fingerprint = FINGERPRINT;
    o.log = &c->log;
    tdm_error_t err = {0};
    tdm_kv_receiver_t *r = tdm_kv_receiver_new(c->net, pool, &o, &err);
    if (!r)
        fail_msg("tdm_kv_receiver_new: %s", err.msg);
    return r;
}

/* The KV of n tokens in pool: a grouped sequence whose window groups gave back what the next
 * query does not read, or a plain one; its live blocks group by group into flat[] (returned:
 * how many), filled from seed. */
static uint32_t kv_of(tdm_kv_pool_t *pool, const tdm_kv_groups_t *g, uint32_t n, uint64_t seed,
                      tdm_kv_hseq_t *hs, tdm_kv_seq_t *seq, uint32_t *flat)
{
    uint32_t k = 0;
    if (!g) {
        reserve(pool, seq, n);
        fill_seq(pool, seq, seed);
        memcpy(flat, seq->blocks, seq->n_blocks * sizeof *flat);
        return seq->n_blocks;
    }
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_hseq_init(hs, g, &err), TDM_OK);
    assert_int_equal(tdm_kv_hseq_reserve(pool, hs, n), TDM_OK);
    tdm_kv_hseq_commit(pool, hs, NULL, n);
    for (uint32_t gi = 0; gi < g->n_groups; gi++)
        for (uint32_t b = hs->tab[gi].n_dropped; b < hs->tab[gi].n_blocks; b++)
            flat[k++] = hs->tab[gi].blocks[b];
    tdm_kv_seq_t view = {.blocks = flat, .n_blocks = k};
    fill_seq(pool, &view, seed);
    return k;
}

static uint64_t flat_digest(tdm_kv_pool_t *pool, const uint32_t *flat, uint32_t n)
{
    tdm_kv_seq_t view = {.blocks = (uint32_t *)flat, .n_blocks = n};
    return seq_digest(pool, &view);
}

/* A pool with layer groups ships each group's live blocks only: for 97 tokens in blocks of 4
 * the full group's 25 and each window group's last 9 (entries 16..24: the next query, at 97,
 * reads keys 66..97), 70 blocks of 4,096 B; they land bit for bit in the receiver's blocks.
 * Then the layout rule: group blocks into a plain pool, plain blocks into a grouped pool and
 * other windows are refused naming both sides; a sender given every entry is refused. */
static void test_grouped(void **state)
{
    ctx_t *c = *state;
    tdm_kv_groups_t g, g64;
    tdm_kv_pool_t *sp = grouped_pool(&g, 32, 600), *rp = grouped_pool(&g, 32, 600);
    assert_int_equal(tdm_kv_pool_block_bytes(sp), 4096);
    assert_int_equal(g.n_groups, 6);
    const uint32_t n = 97;
    uint32_t first[6];
    assert_int_equal(tdm_kv_transfer_blocks(sp, n, first), 25 + 5 * 9);
    assert_int_equal(first[0], 0);
    for (int i = 1; i < 6; i++)
        assert_int_equal(first[i], 16);
    assert_int_equal(tdm_kv_transfer_blocks(sp, 31, NULL), 6 * 8); /* nothing given back yet */
    assert_int_equal(tdm_kv_transfer_blocks(sp, 32, NULL), 8 + 5 * 8);

    tdm_kv_receiver_t *r = receiver_on(c, rp);
    tdm_kv_sender_t *s = sender_new(c, sp, FINGERPRINT, WAIT_MS);
    const char *ep = tdm_kv_receiver_endpoint(r);
    static uint32_t sflat[600], rflat[600];
    tdm_kv_hseq_t shs, rhs;
    tdm_kv_seq_t unused;
    uint32_t ns = kv_of(sp, &g, n, 77, &shs, &unused, sflat);
    uint32_t nr = kv_of(rp, &g, n, 78, &rhs, &unused, rflat);
    assert_int_equal(ns, 70);
    assert_int_equal(nr, 70);
    uint64_t want = flat_digest(sp, sflat, ns);
    tdm_kv_seq_t view = {.blocks = sflat, .n_blocks = ns, .n_tokens = n};
    /* every entry of every group is refused: only the live blocks travel */
    tdm_kv_send_req_t bad = {.request_id = "req-g",
                             .attempt_id = attempt_of("req-g"),
                             .endpoint = ep,
                             .blocks = sflat,
                             .n_blocks = 6 * 25,
                             .n_tokens = n};
    uint64_t id = 0;
    tdm_error_t err = {0};
    assert_int_equal(tdm_kv_sender_send(s, &bad, &id, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "KV transfer req-g: n_blocks is 150 but 97 tokens need 70 "
                                 "blocks of 4 (the live blocks of every layer group)");
    id = send_seq(s, ep, "req-g", &view);
    tdm_kv_hseq_release(sp, &shs);
    reservation_t res = {.request_id = "req-g", .blocks = rflat, .n_blocks = nr};
    tdm_kv_received_t got = recv_one(r, &res);
    if (got.status != 0)
        fail_msg("%s", got.message);
    assert_int_equal(got.n_blocks, 70);
    assert_int_equal(got.bytes, 70 * 4096); /* every layer in every block: 25 * 24,576 B */
    assert_int_equal(flat_digest(rp, rflat, nr), want);
    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, 0);
    assert_int_equal(d.bytes, 70 * 4096);
    tdm_kv_hseq_release(rp, &rhs);
    check_pool_empty(sp);
    check_pool_empty(rp);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);

    /* the layout rule, each way */
    tdm_kv_pool_t *plain = tdm_kv_pool_new(&gemma_like, 200, &err);
    tdm_kv_pool_t *other = grouped_pool(&g64, 64, 600);
    struct {
        tdm_kv_pool_t *from, *to;
        const tdm_kv_groups_t *gf, *gt;
        const char *msg;
    } cases[] = {
        {sp, plain, &g, NULL,
         "KV layout mismatch: the transfer's blocks hold one layer group's layers; this node's "
         "hold every layer (docs/capacity.md: a model's nodes allocate alike)"},
        {plain, rp, NULL, &g,
         "KV layout mismatch: the transfer's blocks hold every layer; this node's hold one layer "
         "group's layers (docs/capacity.md: a model's nodes allocate alike)"},
        {sp, other, &g, &g64,
         "KV layout mismatch: group 1's window is 32 tokens in the transfer, 64 on this node"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        r = receiver_on(c, cases[i].to);
        s = sender_new(c, cases[i].from, FINGERPRINT, WAIT_MS);
        tdm_kv_seq_t sseq, rseq;
        ns = kv_of(cases[i].from, cases[i].gf, n, 5, &shs, &sseq, sflat);
        nr = kv_of(cases[i].to, cases[i].gt, n, 6, &rhs, &rseq, rflat);
        view = (tdm_kv_seq_t){.blocks = sflat, .n_blocks = ns, .n_tokens = n};
        send_seq(s, tdm_kv_receiver_endpoint(r), "req-g", &view);
        res = (reservation_t){.request_id = "req-g", .blocks = rflat, .n_blocks = nr};
        got = recv_one(r, &res);
        assert_int_equal(got.status, TDM_EPRECONDITION);
        assert_string_equal(got.message, cases[i].msg);
        assert_int_equal(res.calls, 0);
        d = wait_done(s);
        assert_int_equal(d.status, TDM_EPRECONDITION);
        if (cases[i].gf)
            tdm_kv_hseq_release(cases[i].from, &shs);
        else
            tdm_kv_seq_release(cases[i].from, &sseq);
        if (cases[i].gt)
            tdm_kv_hseq_release(cases[i].to, &rhs);
        else
            tdm_kv_seq_release(cases[i].to, &rseq);
        check_pool_empty(cases[i].from);
        check_pool_empty(cases[i].to);
        tdm_kv_sender_destroy(&s);
        tdm_kv_receiver_destroy(&r);
    }
    tdm_kv_pool_destroy(&plain);
    tdm_kv_pool_destroy(&other);
    tdm_kv_pool_destroy(&sp);
    tdm_kv_pool_destroy(&rp);
    c->clean = true;
}

/* The header checksum covers the group layout and group_first_block (2.9), and a header
 * without groups hashes as it did before them. */
static void test_grouped_header_checksum(void **state)
{
    (void)state;
    Tandem__V1__KvTransfer h = TANDEM__V1__KV_TRANSFER__INIT;
    Tandem__V1__KvLayout l = TANDEM__V1__KV_LAYOUT__INIT;
    tdm_proto_layout_to(&gemma_like, &l);
    h.request_id = "req-h";
    h.backend = "tcp";
    h.sender_node_id = "prefill-0";
    h.layout = &l;
    h.n_tokens = 97;
    uint64_t plain = tdm_kv_header_checksum(&h);
    uint32_t windows[6] = {0, 32, 32, 32, 32, 32}, first[6] = {0, 16, 16, 16, 16, 16};
    l.layers_per_group = 1;
    l.n_group_windows = 6;
    l.group_windows = windows;
    h.n_group_first_block = 6;
    h.group_first_block = first;
    uint64_t grouped = tdm_kv_header_checksum(&h);
    assert_int_not_equal(grouped, plain);
    first[3] = 15;
    assert_int_not_equal(tdm_kv_header_checksum(&h), grouped);
    first[3] = 16;
    windows[2] = 64;
    assert_int_not_equal(tdm_kv_header_checksum(&h), grouped);
    windows[2] = 32;
    assert_int_equal(tdm_kv_header_checksum(&h), grouped);
    l.layers_per_group = 0;
    l.n_group_windows = 0;
    h.n_group_first_block = 0;
    assert_int_equal(tdm_kv_header_checksum(&h), plain);
}

static void test_out_of_blocks(void **state)
{
    ctx_t *c = *state;
    reservation_t res = {.request_id = "req-rej",
                         .status = TDM_ERESOURCE,
                         .msg = "no free KV blocks for request req-rej (0 of 80 free)"};
    expect_rejected(c, c->spool, FINGERPRINT, &res, TDM_ERESOURCE,
                    "no free KV blocks for request req-rej (0 of 80 free)");
    assert_int_equal(res.calls, 1);
    c->clean = true;
}

static void test_unknown_request(void **state)
{
    ctx_t *c = *state;
    reservation_t res = {.request_id = "some-other-request"};
    expect_rejected(c, c->spool, FINGERPRINT, &res, TDM_ENOTFOUND,
                    "request req-rej unknown or cancelled");
    assert_int_equal(res.calls, 1);
    c->clean = true;
}

/* Fewer blocks reserved than the transfer carries. */
static void test_too_few_reserved(void **state)
{
    ctx_t *c = *state;
    tdm_kv_seq_t small;
    reserve(c->rpool, &small, 20); /* 2 blocks for a 3-block transfer */
    reservation_t res = {.request_id = "req-rej", .blocks = small.blocks, .n_blocks = 2};
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    tdm_kv_seq_t sseq;
    reserve(c->spool, &sseq, 40);
    fill_seq(c->spool, &sseq, 9);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-rej", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    tdm_kv_received_t got = recv_one(r, &res);
    assert_int_equal(got.status, TDM_EINVALID);
    assert_non_null(strstr(got.message, "request req-rej has 2 blocks reserved; the transfer "
                                        "carries 3"));
    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, TDM_EINVALID);
    check_pool_empty(c->spool);
    tdm_kv_seq_release(c->rpool, &small);
    check_pool_empty(c->rpool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* ---- crafted messages: corruption, truncation ---- */

typedef struct crafted {
    uint32_t n_tokens;    /* header */
    uint32_t n_blocks;    /* header */
    uint32_t n_frames;    /* data frames actually sent */
    int corrupt_block;    /* flip one byte of this frame after checksumming; -1 none */
    int short_block;      /* this frame is 100 bytes short; -1 none */
    uint32_t n_checksums; /* checksums in the header */
    int tamper;           /* after the header checksum: 1 first_token, 2 attempt_id, 3 a block
                             checksum; 0 none */
    bool shared;          /* the reserved blocks are shared (an extra pool reference each) */
    bool no_body;         /* the KvTransfer header frame left out */
} crafted_t;

/* What a crafted transfer's verdict left in the reserved blocks rseq (their digest before
 * was `before`; bufs holds what was sent) and how often the lookup ran. */
static void check_crafted_blocks(ctx_t *c, const crafted_t *cr, const tdm_kv_seq_t *rseq,
                                 const reservation_t *res, int want_status, uint64_t before,
                                 const uint8_t *bufs)
{
    uint64_t bb = tdm_kv_pool_block_bytes(c->rpool);
    if (want_status != 0 && cr->corrupt_block >= 0) {
        /* A corrupted block is found after the lookup. Into blocks the attempt holds alone it
         * is found while copying (what arrived may be in them: the node frees them with the
         * reservation); shared blocks are not written. The reservation is left as it was. */
        assert_int_equal(res->calls, 1);
        if (cr->shared)
            assert_int_equal(seq_digest(c->rpool, rseq), before);
        for (uint32_t i = 0; i < rseq->n_blocks; i++)
            assert_int_equal(tdm_kv_pool_refcount(c->rpool, rseq->blocks[i]), cr->shared ? 2 : 1);
    } else if (want_status != 0) {
        /* A transfer rejected by its header never reaches the lookup or the blocks. */
        assert_int_equal(seq_digest(c->rpool, rseq), before);
        assert_int_equal(res->calls, 0);
    } else {
        for (uint32_t i = 0; i < cr->n_blocks; i++)
            assert_memory_equal(block_ptr(c->rpool, rseq->blocks[i]), bufs + i * bb, bb);
    }
}

/* Sends a hand-made KV_TRANSFER over a raw DEALER and returns the receiver's verdict on both
 * sides: what recv reported and the END the DEALER got. */
static void send_crafted(ctx_t *c, const crafted_t *cr, int want_status, const char *want_msg)
{
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_kv_seq_t rseq;
    reserve(c->rpool, &rseq, 48);
    fill_seq(c->rpool, &rseq, 11);
    uint64_t before = seq_digest(c->rpool, &rseq);
    for (uint32_t i = 0; cr->shared && i < rseq.n_blocks; i++)
        tdm_kv_pool_ref(c->rpool, rseq.blocks[i]);

    uint64_t bb = tdm_kv_pool_block_bytes(c->spool);
    uint8_t *bufs = malloc(8 * bb);
    assert_non_null(bufs);
    for (uint64_t i = 0; i < 8 * bb; i++)
        bufs[i] = (uint8_t)(i * 131 + 7);
    uint64_t sums[8];
    tdm_net_data_t data[8];
    for (uint32_t i = 0; i < 8; i++) {
        sums[i] = tdm_kv_block_checksum(bufs + i * bb, bb);
        data[i].ptr = bufs + i * bb;
        data[i].len = (size_t)bb - ((int)i == cr->short_block ? 100 : 0);
        data[i].free_fn = NULL; /* copied */
        data[i].hint = NULL;
    }
    if (cr->corrupt_block >= 0)
        bufs[(uint64_t)cr->corrupt_block * bb + 12345] ^= 0x40;

    Tandem__V1__KvTransfer h = TANDEM__V1__KV_TRANSFER__INIT;
    Tandem__V1__KvLayout lay;
    tdm_proto_layout_to(&smollm2, &lay);
    h.request_id = "req-crafted";
    h.attempt_id = attempt_of("req-crafted");
    h.transfer_id = 99;
    h.n_tokens = cr->n_tokens;
    h.first_token = 1;
    h.layout = &lay;
    h.model_fingerprint = FINGERPRINT;
    h.n_blocks = cr->n_blocks;
    h.block_bytes = bb;
    h.n_checksums = cr->n_checksums;
    h.checksums = sums;
    h.backend = "tcp";
    h.sender_node_id = "crafter";
    h.header_checksum = tdm_kv_header_checksum(&h);
    if (cr->tamper == 1)
        h.first_token = 2; /* rewritten in flight: the chain no longer matches */
    else if (cr->tamper == 2)
        h.attempt_id ^= 4; /* another attempt's header */
    else if (cr->tamper == 3 && cr->n_checksums > 0)
        sums[0] ^= 1; /* a block checksum swapped together with its block would pass alone */

    tdm_error_t err = {0};
    tdm_sock_opts_t so;
    memset(&so, 0, sizeof so);
    so.log = &c->log;
    tdm_sock_t *d = tdm_sock_connect(c->net, tdm_kv_receiver_endpoint(r), &so, &err);
    assert_non_null(d);
    tdm_send_t m;
    memset(&m, 0, sizeof m);
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = TANDEM__V1__METHOD__METHOD_KV_TRANSFER;
    m.call_id = 99;
    m.body = cr->no_body ? NULL : &h.base;
    m.data = data;
    m.n_data = cr->n_frames;
    assert_int_equal(tdm_sock_send(d, &m), 0);

    reservation_t res = {
        .request_id = "req-crafted", .blocks = rseq.blocks, .n_blocks = rseq.n_blocks};
    tdm_kv_received_t got = recv_one(r, &res);
    assert_int_equal(got.status, want_status);
    if (!strstr(got.message, want_msg))
        fail_msg("receiver message \"%s\" does not contain \"%s\"", got.message, want_msg);
    assert_string_equal(got.request_id, cr->no_body ? "" : "req-crafted"); /* no header: unknown */
    assert_string_equal(got.sender_node_id, cr->no_body ? "" : "crafter");
    check_crafted_blocks(c, cr, &rseq, &res, want_status, before, bufs);

    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(d, &f, WAIT_MS), 0);
    assert_int_equal(f.kind, TANDEM__V1__FRAME_KIND__FRAME_KIND_END);
    assert_int_equal(f.call_id, 99);
    assert_int_equal(f.status, want_status);
    assert_string_equal(f.message, got.message);
    tdm_frame_clear(&f);

    tdm_sock_destroy(&d);
    free(bufs);
    for (uint32_t i = 0; cr->shared && i < rseq.n_blocks; i++)
        tdm_kv_pool_unref(c->rpool, rseq.blocks[i]);
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->rpool);
    tdm_kv_receiver_destroy(&r);
}

static void test_corrupted_block(void **state)
{
    ctx_t *c = *state;
    crafted_t cr = {.n_tokens = 48,
                    .n_blocks = 3,
                    .n_frames = 3,
                    .corrupt_block = 2,
                    .short_block = -1,
                    .n_checksums = 3};
    char want[128];
    /* the message names the block and both checksums */
    snprintf(want, sizeof want, "block 2 checksum mismatch: got 0x");
    send_crafted(c, &cr, TDM_EINVALID, want);
    cr.corrupt_block = 0;
    send_crafted(c, &cr, TDM_EINVALID, " expected 0x");
    /* shared reserved blocks: verified before they are written, the same verdict */
    cr.shared = true;
    send_crafted(c, &cr, TDM_EINVALID, "block 0 checksum mismatch: got 0x");
    cr.corrupt_block = 1;
    send_crafted(c, &cr, TDM_EINVALID, "block 1 checksum mismatch: got 0x");
    /* The same message uncorrupted is accepted, both ways: the crafting itself is right. */
    cr.corrupt_block = -1;
    send_crafted(c, &cr, 0, "");
    cr.shared = false;
    send_crafted(c, &cr, 0, "");
    c->clean = true;
}

/* Every header field is covered: a rewritten first token, attempt id or block checksum is
 * rejected before anything is written, naming the header checksum. */
static void test_header_tampered(void **state)
{
    ctx_t *c = *state;
    crafted_t cr = {.n_tokens = 48,
                    .n_blocks = 3,
                    .n_frames = 3,
                    .corrupt_block = -1,
                    .short_block = -1,
                    .n_checksums = 3,
                    .tamper = 1};
    send_crafted(c, &cr, TDM_EINVALID, "header checksum mismatch");
    cr.tamper = 2;
    send_crafted(c, &cr, TDM_EINVALID, "header checksum mismatch");
    cr.tamper = 3;
    send_crafted(c, &cr, TDM_EINVALID, "header checksum mismatch");
    cr.tamper = 0;
    send_crafted(c, &cr, 0, "");
    c->clean = true;
}

static void test_truncated(void **state)
{
    ctx_t *c = *state;
    crafted_t cr = {.n_tokens = 48,
                    .n_blocks = 3,
                    .n_frames = 2,
                    .corrupt_block = -1,
                    .short_block = -1,
                    .n_checksums = 3};
    send_crafted(c, &cr, TDM_EINVALID, "truncated transfer: 2 data frames for 3 blocks");
    cr.n_frames = 0;
    send_crafted(c, &cr, TDM_EINVALID, "truncated transfer: 0 data frames for 3 blocks");
    cr.n_frames = 4;
    send_crafted(c, &cr, TDM_EINVALID, "4 data frames for 3 blocks");
    cr.n_frames = 3;
    cr.short_block = 1;
    send_crafted(c, &cr, TDM_EINVALID, "block 1 is 368540 bytes; expected 368640");
    cr.short_block = -1;
    cr.n_checksums = 2;
    send_crafted(c, &cr, TDM_EINVALID, "2 checksums for 3 blocks");
    /* n_blocks that does not match n_tokens */
    cr = (crafted_t){.n_tokens = 49,
                     .n_blocks = 3,
                     .n_frames = 3,
                     .corrupt_block = -1,
                     .short_block = -1,
                     .n_checksums = 3};
    send_crafted(c, &cr, TDM_EINVALID, "n_blocks is 3 but 49 tokens need 4 blocks of 16");
    /* the header frame missing: said so, not read as an empty header ("request_id is empty") */
    cr.n_tokens = 48;
    cr.no_body = true;
    send_crafted(c, &cr, TDM_EINVALID, "KvTransfer header frame is missing (3 data frames)");
    c->clean = true;
}

/* A body that is not a KvTransfer, and a method the KV endpoint does not serve. */
static void test_garbage(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_error_t err = {0};
    tdm_sock_opts_t so;
    memset(&so, 0, sizeof so);
    so.log = &c->log;
    tdm_sock_t *d = tdm_sock_connect(c->net, tdm_kv_receiver_endpoint(r), &so, &err);
    assert_non_null(d);

    Tandem__V1__HealthRequest hr = TANDEM__V1__HEALTH_REQUEST__INIT;
    tdm_send_t m;
    memset(&m, 0, sizeof m);
    m.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST;
    m.method = TANDEM__V1__METHOD__METHOD_HEALTH;
    m.call_id = 5;
    m.body = &hr.base;
    assert_int_equal(tdm_sock_send(d, &m), 0);
    /* A KV_TRANSFER whose body is a (non-empty) TaskFailed: decodes to garbage fields or
     * fails; either way it is rejected, never crashes. */
    Tandem__V1__TaskFailed rr = TANDEM__V1__TASK_FAILED__INIT;
    rr.request_id = "x";
    rr.message = "\xff\xff\xff";
    m.method = TANDEM__V1__METHOD__METHOD_KV_TRANSFER;
    m.call_id = 6;
    m.body = &rr.base;
    assert_int_equal(tdm_sock_send(d, &m), 0);

    reservation_t res = {.request_id = "x"};
    tdm_kv_received_t got = recv_one(r, &res);
    assert_int_equal(got.status, TDM_EINVALID);
    assert_int_equal(res.calls, 0);

    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(d, &f, WAIT_MS), 0);
    assert_int_equal(f.call_id, 5);
    assert_int_equal(f.status, TDM_EINVALID);
    assert_non_null(strstr(f.message, "not served on a KV endpoint"));
    assert_int_equal(tdm_sock_recv(d, &f, WAIT_MS), 0);
    assert_int_equal(f.call_id, 6);
    assert_int_equal(f.status, TDM_EINVALID);
    tdm_frame_clear(&f);
    /* Nothing else is waiting. */
    assert_int_equal(tdm_kv_receiver_recv(r, 0, lookup_cb, &res, &got), 0);
    tdm_sock_destroy(&d);
    check_pool_empty(c->rpool);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* ---- receiver gone, cancel ---- */

/* A receiver bound at endpoint (a given port, to stand in for a restarted one), once the
 * port is free again: ZeroMQ closes a socket's listener on its I/O thread, a moment after
 * zmq_close. */
static tdm_kv_receiver_t *receiver_at(ctx_t *c, const char *endpoint)
{
    tdm_kv_receiver_opts_t o;
    memset(&o, 0, sizeof o);
    o.endpoint = endpoint;
    o.node_id = "decode-0";
    o.model_fingerprint = FINGERPRINT;
    o.log = &c->log;
    tdm_error_t err = {0};
    double until = tdm_time_now() + WAIT_MS / 1e3;
    tdm_kv_receiver_t *r;
    struct timespec pause = {0, 10 * 1000 * 1000};
    while (!(r = tdm_kv_receiver_new(c->net, c->rpool, &o, &err)) && tdm_time_now() < until)
        nanosleep(&pause, NULL);
    if (!r)
        fail_msg("tdm_kv_receiver_new %s: %s", endpoint, err.msg);
    return r;
}

/* The connection lost in the middle of a transfer, the receiver's endpoint accepting again at
 * once (the receiver's socket closed and bound anew, as when a connection is cut): the sender
 * sends the transfer again on a new connection and it arrives whole, acknowledged, with no
 * failure reported. */
static void test_resend_after_lost_connection(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    char ep[256];
    snprintf(ep, sizeof ep, "%s", tdm_kv_receiver_endpoint(r));
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    tdm_kv_seq_t sseq, rseq;
    reserve(c->spool, &sseq, 16);
    reserve(c->rpool, &rseq, 16);
    fill_seq(c->spool, &sseq, 2);
    send_seq(s, ep, "req-before", &sseq); /* one that arrives: the connection is up */
    tdm_kv_seq_release(c->spool, &sseq);
    reservation_t res = {.request_id = "req-before", .blocks = rseq.blocks, .n_blocks = 1};
    assert_int_equal(recv_one(r, &res).status, 0);
    assert_int_equal(wait_done(s).status, 0);
    tdm_kv_seq_release(c->rpool, &rseq);

    reserve(c->spool, &sseq, 200); /* 13 blocks, 4.8 MB */
    reserve(c->rpool, &rseq, 200);
    fill_seq(c->spool, &sseq, 5);
    uint64_t want = seq_digest(c->spool, &sseq);
    send_seq(s, ep, "req-again", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    tdm_kv_receiver_destroy(&r); /* what reached it is gone with its socket */
    r = receiver_at(c, ep);
    reservation_t again = {.request_id = "req-again", .blocks = rseq.blocks, .n_blocks = 13};
    tdm_kv_send_done_t d[4];
    int n = 0, got = 0;
    double until = tdm_time_now() + WAIT_MS / 1e3;
    while (n == 0 && tdm_time_now() < until) {
        tdm_kv_received_t in;
        if (tdm_kv_receiver_recv(r, 10, lookup_cb, &again, &in) == 1) {
            assert_int_equal(in.status, 0);
            assert_string_equal(in.request_id, "req-again");
            got++;
        }
        n = tdm_kv_sender_poll(s, 10, d, 4);
        assert_true(n >= 0);
    }
    assert_int_equal(n, 1);
    assert_int_equal(d[0].status, 0);
    assert_string_equal(d[0].request_id, "req-again");
    assert_int_equal(got, 1);
    assert_int_equal(seq_digest(c->rpool, &rseq), want);
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->spool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    check_pool_empty(c->rpool);
    c->clean = true;
}

/* The receiver disappears (its connection closes) with a transfer in flight: the sender's
 * socket monitor sees the connection drop and the transfer fails at once, UNAVAILABLE, long
 * before its timeout (30 s here: a report that is not DEADLINE_EXCEEDED came from the
 * monitor), and the blocks are given back. */
static void test_receiver_gone(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    char ep[256];
    snprintf(ep, sizeof ep, "%s", tdm_kv_receiver_endpoint(r));
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    /* one transfer that arrives, so the connection is up */
    tdm_kv_seq_t sseq, rseq;
    reserve(c->spool, &sseq, 16);
    reserve(c->rpool, &rseq, 16);
    fill_seq(c->spool, &sseq, 2);
    send_seq(s, ep, "req-before", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    reservation_t res = {.request_id = "req-before", .blocks = rseq.blocks, .n_blocks = 1};
    assert_int_equal(recv_one(r, &res).status, 0);
    assert_int_equal(wait_done(s).status, 0);
    tdm_kv_seq_release(c->rpool, &rseq);
    reserve(c->spool, &sseq, 200); /* 13 blocks, 4.8 MB */
    fill_seq(c->spool, &sseq, 3);
    send_seq(s, ep, "req-gone", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    tdm_kv_receiver_destroy(&r);
    assert_int_equal(n_used(c->spool), 13);

    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, TDM_EUNAVAILABLE);
    assert_string_equal(d.request_id, "req-gone");
    assert_non_null(strstr(d.message, "the connection to the receiver was lost"));
    check_pool_empty(c->spool);
    tdm_kv_sender_destroy(&s);

    /* Nobody listens at that endpoint at all (no connection to lose): the frames stay queued
     * in ZMQ until the timeout closes the socket, which releases them. A receiver that is
     * gone never answers, so the timeout comes however slow the machine is; only its lower
     * bound is checked (from the send, as the sender measures it). */
    s = sender_new(c, c->spool, FINGERPRINT, 300);
    reserve(c->spool, &sseq, 64);
    fill_seq(c->spool, &sseq, 4);
    send_seq(s, ep, "req-nobody", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    d = wait_done(s);
    assert_int_equal(d.status, TDM_EDEADLINE);
    assert_string_equal(d.request_id, "req-nobody");
    assert_non_null(strstr(d.message, "no acknowledgement from"));
    assert_non_null(strstr(d.message, "within 300 ms"));
    assert_true(d.seconds >= 0.29);
    check_pool_empty(c->spool);
    tdm_kv_sender_destroy(&s);
    check_pool_empty(c->spool);
    check_pool_empty(c->rpool);
    c->clean = true;
}

/* ---- early transfers: the reservation is not decided when the KV arrives ---- */

/* A lookup whose reservation is undecided until `decided`: TDM_KV_LOOKUP_WAIT before. */
typedef struct early {
    reservation_t res;
    bool decided;
    int waits; /* lookups answered TDM_KV_LOOKUP_WAIT */
} early_t;

static int early_cb(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                    const uint32_t **blocks, uint32_t *n_blocks, tdm_error_t *err)
{
    early_t *e = user;
    if (!e->decided) {
        e->waits++;
        return TDM_KV_LOOKUP_WAIT;
    }
    return lookup_cb(&e->res, request_id, attempt_id, n_tokens, blocks, n_blocks, err);
}

static tdm_kv_receiver_t *receiver_hold(ctx_t *c, uint64_t hold_bytes, int hold_ms)
{
    tdm_kv_receiver_opts_t o;
    memset(&o, 0, sizeof o);
    o.endpoint = "tcp://127.0.0.1:*";
    o.node_id = "decode-0";
    o.model_fingerprint = FINGERPRINT;
    o.hold_bytes = hold_bytes;
    o.hold_ms = hold_ms;
    o.log = &c->log;
    tdm_error_t err = {0};
    tdm_kv_receiver_t *r = tdm_kv_receiver_new(c->net, c->rpool, &o, &err);
    if (!r)
        fail_msg("tdm_kv_receiver_new: %s", err.msg);
    return r;
}

/* Receives until n transfers are held (none may be processed meanwhile); fails after WAIT_MS. */
static void wait_held(tdm_kv_receiver_t *r, early_t *e, uint32_t n)
{
    double until = tdm_time_now() + WAIT_MS / 1e3;
    while (tdm_kv_receiver_held(r, NULL) != n && tdm_time_now() < until) {
        tdm_kv_received_t got;
        assert_int_equal(tdm_kv_receiver_recv(r, 50, early_cb, e, &got), 0);
    }
    assert_int_equal(tdm_kv_receiver_held(r, NULL), n);
}

/* A transfer that arrives before its reservation is decided is held unanswered; decided, it
 * is installed (resume) or refused with the reservation's status (refuse); a CANCEL from its
 * sender drops it while held. Every block goes back on both sides. */
static void test_early_transfer(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_hold(c, 64ull << 20, WAIT_MS);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    const char *ep = tdm_kv_receiver_endpoint(r);
    tdm_kv_seq_t sseq, rseq;

    /* installed once decided */
    reserve(c->spool, &sseq, 40);
    fill_seq(c->spool, &sseq, 31);
    uint64_t want = seq_digest(c->spool, &sseq);
    uint64_t id = send_seq(s, ep, "req-early", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    early_t e = {.res = {.request_id = "req-early"}};
    wait_held(r, &e, 1);
    uint64_t bytes = 0;
    assert_int_equal(tdm_kv_receiver_held(r, &bytes), 1);
    assert_true(bytes >= 3 * 368640ull); /* its three blocks, and the header */
    assert_int_equal(e.waits, 1);
    tdm_kv_send_done_t none;
    assert_int_equal(tdm_kv_sender_poll(s, 0, &none, 1), 0); /* unanswered */
    reserve(c->rpool, &rseq, 40);                            /* the reservation is made now */
    e.decided = true;
    e.res.blocks = rseq.blocks;
    e.res.n_blocks = rseq.n_blocks;
    tdm_kv_received_t got;
    assert_int_equal(tdm_kv_receiver_resume(r, attempt_of("req-other"), early_cb, &e, &got), 0);
    assert_int_equal(tdm_kv_receiver_resume(r, attempt_of("req-early"), early_cb, &e, &got), 1);
    assert_int_equal(got.status, 0);
    assert_int_equal(got.transfer_id, id);
    assert_int_equal(got.first_token, 4242);
    assert_int_equal(seq_digest(c->rpool, &rseq), want);
    assert_int_equal(tdm_kv_receiver_held(r, &bytes), 0);
    assert_int_equal(bytes, 0);
    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, 0);
    assert_int_equal(d.transfer_id, id);
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->spool);
    check_pool_empty(c->rpool);

    /* refused once decided: the sender learns the reservation's status and reason */
    reserve(c->spool, &sseq, 20);
    fill_seq(c->spool, &sseq, 32);
    id = send_seq(s, ep, "req-refused", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    e = (early_t){.res = {.request_id = "req-refused"}};
    wait_held(r, &e, 1);
    assert_int_equal(tdm_kv_receiver_refuse(r, attempt_of("req-other"), TDM_ERESOURCE, "x"), 0);
    assert_int_equal(tdm_kv_receiver_refuse(r, attempt_of("req-refused"), TDM_ERESOURCE,
                                            "need 2 KV blocks, 0 free"),
                     1);
    d = wait_done(s);
    assert_int_equal(d.status, TDM_ERESOURCE);
    assert_int_equal(d.transfer_id, id);
    assert_string_equal(d.message, "reservation refused: need 2 KV blocks, 0 free");
    assert_int_equal(tdm_kv_receiver_held(r, NULL), 0);
    check_pool_empty(c->spool);

    /* withdrawn by its sender while held: dropped unanswered, the lookup not asked again */
    reserve(c->spool, &sseq, 20);
    fill_seq(c->spool, &sseq, 33);
    id = send_seq(s, ep, "req-withdrawn", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    e = (early_t){.res = {.request_id = "req-withdrawn"}};
    wait_held(r, &e, 1);
    assert_int_equal(tdm_kv_sender_cancel(s, attempt_of("req-withdrawn")), 1);
    d = wait_done(s);
    assert_int_equal(d.status, TDM_ECANCELLED);
    assert_int_equal(d.transfer_id, id);
    wait_held(r, &e, 0);
    assert_int_equal(e.waits, 1);
    e.decided = true;
    assert_int_equal(tdm_kv_receiver_resume(r, attempt_of("req-withdrawn"), early_cb, &e, &got), 0);
    check_pool_empty(c->spool);
    check_pool_empty(c->rpool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* Over the bound in bytes an early transfer is refused NOT_FOUND at once, as one without a
 * reservation; held past the bound in time it is refused NOT_FOUND then. A receiver that
 * holds nothing (hold_bytes 0) refuses it at once, as before early transfers. */
static void test_early_transfer_bounds(void **state)
{
    ctx_t *c = *state;
    /* room for two blocks: a three-block transfer does not fit */
    tdm_kv_receiver_t *r = receiver_hold(c, 2 * 368640ull, WAIT_MS);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    tdm_kv_seq_t sseq;
    reserve(c->spool, &sseq, 40);
    fill_seq(c->spool, &sseq, 41);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-big", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    early_t e = {.res = {.request_id = "req-big"}};
    tdm_kv_received_t got;
    assert_int_equal(tdm_kv_receiver_recv(r, WAIT_MS, early_cb, &e, &got), 1);
    assert_int_equal(got.status, TDM_ENOTFOUND);
    assert_non_null(strstr(got.message, "no room to hold the transfer"));
    assert_non_null(strstr(got.message, "bound of 737280"));
    assert_int_equal(tdm_kv_receiver_held(r, NULL), 0);
    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, TDM_ENOTFOUND);
    check_pool_empty(c->spool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);

    /* held 1 ms at most: refused by the next receive after that */
    r = receiver_hold(c, 64ull << 20, 1);
    s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    reserve(c->spool, &sseq, 16);
    fill_seq(c->spool, &sseq, 42);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-late", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    e = (early_t){.res = {.request_id = "req-late"}};
    wait_held(r, &e, 1);
    wait_held(r, &e, 0); /* its time ran out */
    d = wait_done(s);
    assert_int_equal(d.status, TDM_ENOTFOUND);
    assert_non_null(strstr(d.message, "within 1 ms of the transfer's arrival"));
    check_pool_empty(c->spool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);

    /* holds nothing */
    r = receiver_hold(c, 0, 0);
    s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    reserve(c->spool, &sseq, 16);
    fill_seq(c->spool, &sseq, 43);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-none", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    e = (early_t){.res = {.request_id = "req-none"}};
    assert_int_equal(tdm_kv_receiver_recv(r, WAIT_MS, early_cb, &e, &got), 1);
    assert_int_equal(got.status, TDM_ENOTFOUND);
    d = wait_done(s);
    assert_int_equal(d.status, TDM_ENOTFOUND);
    check_pool_empty(c->spool);
    check_pool_empty(c->rpool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

static void test_cancel(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    tdm_kv_seq_t sseq, rseq;
    reserve(c->spool, &sseq, 100);
    reserve(c->rpool, &rseq, 100);
    fill_seq(c->spool, &sseq, 21);
    fill_seq(c->rpool, &rseq, 22);
    uint64_t before = seq_digest(c->rpool, &rseq);
    uint64_t id = send_seq(s, tdm_kv_receiver_endpoint(r), "req-cancel", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    assert_int_equal(tdm_kv_sender_cancel(s, attempt_of("req-other")), 0);
    assert_int_equal(tdm_kv_sender_cancel(s, attempt_of("req-cancel")), 1);
    assert_int_equal(tdm_kv_sender_cancel(s, attempt_of("req-cancel")), 0); /* once */

    /* Reported as soon as ZMQ released the frames (the receiver's ZMQ takes them even before
     * the node reads them), with the blocks given back. */
    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, TDM_ECANCELLED);
    assert_int_equal(d.transfer_id, id);
    assert_non_null(strstr(d.message, "cancelled"));
    check_pool_empty(c->spool);
    assert_int_equal(tdm_kv_sender_in_flight(s), 0);

    /* The receiver sees the transfer. Over TCP the CANCEL, which left the sender right after
     * the blocks, may or may not have reached the receiver's queue by then (that is up to the
     * I/O threads): dropped unread if it has, handled normally if not (the CANCEL is best
     * effort). test_cancel_queued checks the first case without that race. */
    reservation_t res = {
        .request_id = "req-cancel", .blocks = rseq.blocks, .n_blocks = rseq.n_blocks};
    tdm_kv_received_t got = recv_one(r, &res);
    assert_string_equal(got.request_id, "req-cancel");
    assert_int_equal(got.transfer_id, id);
    if (got.status == TDM_ECANCELLED) {
        assert_int_equal(res.calls, 0);
        assert_int_equal(seq_digest(c->rpool, &rseq), before);
    } else {
        assert_int_equal(got.status, 0);
        assert_int_equal(res.calls, 1);
    }
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->rpool);

    /* A late CANCEL (when the receiver handled the transfer first) is consumed quietly, and
     * the channel still works. */
    reserve(c->spool, &sseq, 16);
    reserve(c->rpool, &rseq, 16);
    fill_seq(c->spool, &sseq, 23);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-after", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    res = (reservation_t){
        .request_id = "req-after", .blocks = rseq.blocks, .n_blocks = rseq.n_blocks};
    got = recv_one(r, &res);
    assert_int_equal(got.status, 0);
    d = wait_done(s);
    assert_int_equal(d.status, 0);
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->spool);
    check_pool_empty(c->rpool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* A transfer whose CANCEL is already queued behind it is dropped unread, the lookup never
 * asked. Over inproc:// a message is in the receiver's queue when the send returns (no I/O
 * thread in between), so the transfer and its CANCEL are both there before the receiver
 * looks: no race. The zero-copy frames are released when the receiver drops them, so the
 * sender reports the cancel after the receiver has handled it. */
static void test_cancel_queued(void **state)
{
    ctx_t *c = *state;
    const char *ep = "inproc://test-transfer-cancel";
    tdm_kv_receiver_opts_t o;
    memset(&o, 0, sizeof o);
    o.endpoint = ep;
    o.node_id = "decode-0";
    o.model_fingerprint = FINGERPRINT;
    o.log = &c->log;
    tdm_error_t err = {0};
    tdm_kv_receiver_t *r = tdm_kv_receiver_new(c->net, c->rpool, &o, &err);
    if (!r)
        fail_msg("tdm_kv_receiver_new: %s", err.msg);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    tdm_kv_seq_t sseq, rseq;
    reserve(c->spool, &sseq, 100);
    reserve(c->rpool, &rseq, 100);
    fill_seq(c->spool, &sseq, 24);
    fill_seq(c->rpool, &rseq, 25);
    uint64_t before = seq_digest(c->rpool, &rseq);
    uint64_t id = send_seq(s, ep, "req-cancel", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    assert_int_equal(tdm_kv_sender_cancel(s, attempt_of("req-cancel")), 1);

    reservation_t res = {
        .request_id = "req-cancel", .blocks = rseq.blocks, .n_blocks = rseq.n_blocks};
    tdm_kv_received_t got = recv_one(r, &res);
    assert_int_equal(got.status, TDM_ECANCELLED);
    assert_string_equal(got.request_id, "req-cancel");
    assert_int_equal(got.transfer_id, id);
    assert_int_equal(res.calls, 0);
    assert_int_equal(seq_digest(c->rpool, &rseq), before);
    /* the CANCEL was consumed with the transfer: nothing else is waiting */
    assert_int_equal(tdm_kv_receiver_recv(r, 0, lookup_cb, &res, &got), 0);

    tdm_kv_send_done_t d = wait_done(s);
    assert_int_equal(d.status, TDM_ECANCELLED);
    assert_int_equal(d.transfer_id, id);
    check_pool_empty(c->spool);

    /* A late CANCEL: the receiver handled the transfer before the sender cancelled it (the
     * sender has not read the acknowledgement yet). The receiver consumes the CANCEL quietly
     * and the sender reports the cancel. */
    reserve(c->spool, &sseq, 16);
    fill_seq(c->spool, &sseq, 26);
    uint64_t want = seq_digest(c->spool, &sseq);
    id = send_seq(s, ep, "req-late", &sseq);
    tdm_kv_seq_release(c->spool, &sseq);
    res = (reservation_t){.request_id = "req-late", .blocks = rseq.blocks, .n_blocks = 1};
    got = recv_one(r, &res);
    assert_int_equal(got.status, 0);
    assert_int_equal(res.calls, 1);
    assert_int_equal(XXH3_64bits_withSeed(block_ptr(c->rpool, rseq.blocks[0]),
                                          tdm_kv_pool_block_bytes(c->rpool), 0),
                     want);
    assert_int_equal(tdm_kv_sender_cancel(s, attempt_of("req-late")), 1);
    assert_int_equal(tdm_kv_receiver_recv(r, 0, lookup_cb, &res, &got), 0);
    assert_int_equal(res.calls, 1);
    d = wait_done(s);
    assert_int_equal(d.status, TDM_ECANCELLED);
    assert_int_equal(d.transfer_id, id);
    check_pool_empty(c->spool);
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->rpool);
    tdm_kv_sender_destroy(&s);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* Destroying a sender with transfers in flight gives their blocks back. */
static void test_destroy_in_flight(void **state)
{
    ctx_t *c = *state;
    tdm_kv_receiver_t *r = receiver_new(c, FINGERPRINT);
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    tdm_kv_seq_t sseq;
    reserve(c->spool, &sseq, 300);
    fill_seq(c->spool, &sseq, 1);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-a", &sseq);
    send_seq(s, "tcp://127.0.0.1:1", "req-b", &sseq); /* nobody there: frames stay queued */
    tdm_kv_seq_release(c->spool, &sseq);
    assert_int_equal(tdm_kv_sender_in_flight(s), 2);
    tdm_kv_sender_destroy(&s);
    check_pool_empty(c->spool);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* ---- CURVE ---- */

/* A receiver with CURVE keys accepts a sender holding the cluster's client key, and a sender
 * with another key never gets through (its transfer times out). */
static void test_curve(void **state)
{
    ctx_t *c = *state;
    char spub[41], ssec[41], cpub[41], csec[41], xpub[41], xsec[41];
    assert_int_equal(tdm_net_curve_keypair(spub, ssec), 0);
    assert_int_equal(tdm_net_curve_keypair(cpub, csec), 0);
    assert_int_equal(tdm_net_curve_keypair(xpub, xsec), 0);
    /* the receiver admits one prefill node's key, under its node id */
    tdm_curve_peer_t admitted = {cpub, "prefill-curve"};
    tdm_curve_keys_t server = {
        .server_public = spub, .server_secret = ssec, .clients = &admitted, .n_clients = 1};
    tdm_kv_receiver_opts_t ro;
    memset(&ro, 0, sizeof ro);
    ro.endpoint = "tcp://127.0.0.1:*";
    ro.model_fingerprint = FINGERPRINT;
    ro.curve = &server;
    ro.log = &c->log;
    tdm_error_t err = {0};
    tdm_kv_receiver_t *r = tdm_kv_receiver_new(c->net, c->rpool, &ro, &err);
    if (!r)
        fail_msg("tdm_kv_receiver_new: %s", err.msg);

    /* The sender copies its keys: the buffers may be gone before the channel opens. */
    char kpub[41], ksec[41], kserver[41];
    memcpy(kpub, cpub, sizeof kpub);
    memcpy(ksec, csec, sizeof ksec);
    memcpy(kserver, spub, sizeof kserver);
    tdm_curve_keys_t client = {
        .server_public = kserver, .client_public = kpub, .client_secret = ksec};
    tdm_kv_sender_opts_t so;
    memset(&so, 0, sizeof so);
    so.node_id = "prefill-curve";
    so.model_fingerprint = FINGERPRINT;
    so.curve = &client;
    so.timeout_ms = WAIT_MS; /* the handshake and the transfer take what a busy machine needs */
    so.log = &c->log;
    tdm_kv_sender_t *s = tdm_kv_sender_new(c->net, c->spool, &so, &err);
    assert_non_null(s);
    memset(kpub, 0, sizeof kpub);
    memset(ksec, 0, sizeof ksec);
    memset(kserver, 0, sizeof kserver);

    tdm_kv_seq_t sseq, rseq;
    reserve(c->spool, &sseq, 20);
    reserve(c->rpool, &rseq, 20);
    fill_seq(c->spool, &sseq, 31);
    uint64_t want = seq_digest(c->spool, &sseq);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-curve", &sseq);
    reservation_t res = {
        .request_id = "req-curve", .blocks = rseq.blocks, .n_blocks = rseq.n_blocks};
    tdm_kv_received_t got = recv_one(r, &res);
    assert_int_equal(got.status, 0);
    assert_int_equal(seq_digest(c->rpool, &rseq), want);
    assert_int_equal(wait_done(s).status, 0);
    tdm_kv_sender_destroy(&s);

    /* The admitted key claiming another sender in the header: rejected, blocks untouched. */
    tdm_curve_keys_t same_key = {
        .server_public = spub, .client_public = cpub, .client_secret = csec};
    so.node_id = "prefill-other";
    so.curve = &same_key;
    s = tdm_kv_sender_new(c->net, c->spool, &so, &err);
    assert_non_null(s);
    uint64_t before = seq_digest(c->rpool, &rseq);
    send_seq(s, tdm_kv_receiver_endpoint(r), "req-curve", &sseq);
    got = recv_one(r, &res);
    assert_int_equal(got.status, TDM_EUNAUTHENTICATED);
    assert_non_null(strstr(got.message, "the key of node 'prefill-curve' sent a transfer "
                                        "claiming sender 'prefill-other'"));
    assert_int_equal(seq_digest(c->rpool, &rseq), before);
    assert_int_equal(wait_done(s).status, TDM_EUNAUTHENTICATED);
    tdm_kv_sender_destroy(&s);
    so.node_id = "prefill-curve";

    /* A sender whose client key the receiver does not admit, and one that expects another
     * receiver key: the handshake fails, and the transfer fails with UNAUTHENTICATED saying
     * why (not at its timeout, which is generous here), with nothing reaching the receiver. */
    tdm_curve_keys_t stranger = {
        .server_public = spub, .client_public = xpub, .client_secret = xsec};
    tdm_curve_keys_t wrong_server = {
        .server_public = xpub, .client_public = cpub, .client_secret = csec};
    const tdm_curve_keys_t *bad[2] = {&stranger, &wrong_server};
    const char *want_msg[2] = {"refused this daemon's CURVE key",
                               "the peer's public key is not the one configured"};
    for (int k = 0; k < 2; k++) {
        so.curve = bad[k];
        so.timeout_ms = 60000;
        s = tdm_kv_sender_new(c->net, c->spool, &so, &err);
        assert_non_null(s);
        send_seq(s, tdm_kv_receiver_endpoint(r), "req-stranger", &sseq);
        tdm_kv_send_done_t d = wait_done(s);
        assert_int_equal(d.status, TDM_EUNAUTHENTICATED);
        if (!strstr(d.message, "cannot authenticate the decode node's KV endpoint") ||
            !strstr(d.message, want_msg[k]))
            fail_msg("case %d: unexpected message \"%s\"", k, d.message);
        tdm_kv_sender_destroy(&s);
    }
    tdm_kv_seq_release(c->spool, &sseq);
    assert_int_equal(tdm_kv_receiver_recv(r, 0, lookup_cb, &res, &got), 0);
    assert_int_equal(res.calls, 1);
    check_pool_empty(c->spool);
    tdm_kv_seq_release(c->rpool, &rseq);
    check_pool_empty(c->rpool);
    tdm_kv_receiver_destroy(&r);
    c->clean = true;
}

/* ---- send-side validation ---- */

static void test_send_validation(void **state)
{
    ctx_t *c = *state;
    tdm_kv_sender_t *s = sender_new(c, c->spool, FINGERPRINT, WAIT_MS);
    tdm_kv_seq_t sseq;
    reserve(c->spool, &sseq, 40);
    tdm_kv_send_req_t req = {.request_id = "req-v",
                             .endpoint = "tcp://127.0.0.1:9",
                             .blocks = sseq.blocks,
                             .n_blocks = 3,
                             .n_tokens = 40};
    uint64_t id = 7;
    tdm_error_t err = {0};

    req.n_blocks = 2;
    assert_int_equal(tdm_kv_sender_send(s, &req, &id, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_blocks is 2 but 40 tokens need 3 blocks of 16"));
    assert_int_equal(id, 0);
    req.n_blocks = 3;
    req.n_tokens = 0;
    assert_int_equal(tdm_kv_sender_send(s, &req, &id, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "n_tokens is 0"));
    req.n_tokens = 40;
    uint32_t bad[3] = {sseq.blocks[0], POOL_BLOCKS + 5, sseq.blocks[2]};
    req.blocks = bad;
    assert_int_equal(tdm_kv_sender_send(s, &req, &id, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "out of range"));
    /* a block that is not in use (free) */
    uint32_t freeb = 0;
    while (tdm_kv_pool_refcount(c->spool, freeb) > 0)
        freeb++;
    bad[1] = freeb;
    assert_int_equal(tdm_kv_sender_send(s, &req, &id, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "is not in use"));
    req.blocks = sseq.blocks;
    char longid[TDM_REQUEST_ID_MAX + 2];
    memset(longid, 'x', sizeof longid - 1);
    longid[sizeof longid - 1] = '\0';
    req.request_id = longid;
    assert_int_equal(tdm_kv_sender_send(s, &req, &id, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "request_id is 128 bytes"));
    req.request_id = "";
    assert_int_equal(tdm_kv_sender_send(s, &req, &id, &err), TDM_EINVALID);
    req.request_id = "req-v";
    req.endpoint = "not-an-endpoint";
    assert_true(tdm_kv_sender_send(s, &req, &id, &err) < 0);
    assert_non_null(strstr(err.msg, "not-an-endpoint"));

    /* Nothing was referenced and nothing is reported. */
    assert_int_equal(tdm_kv_sender_in_flight(s), 0);
    assert_int_equal(n_used(c->spool), 3);
    for (uint32_t i = 0; i < 3; i++)
        assert_int_equal(tdm_kv_pool_refcount(c->spool, sseq.blocks[i]), 1);
    tdm_kv_send_done_t d;
    assert_int_equal(tdm_kv_sender_poll(s, 0, &d, 1), 0);
    tdm_kv_seq_release(c->spool, &sseq);
    check_pool_empty(c->spool);
    tdm_kv_sender_destroy(&s);
    c->clean = true;
}

/* The device checksum's lane arithmetic (transfer/xxh3_lanes.h, which cuda/xxh3.cu runs with
 * 128 threads per block) run on the host equals libxxhash's XXH3_64bits, and so
 * tdm_kv_block_checksum, at the lengths around its block and stripe edges and at real KV block
 * sizes (SmolLM2-135M f16: 368,640 bytes; q8 with its scales; Llama-3.1-8B f16: 2 MiB),
 * over random bytes. Without a GPU, tdm_kv_device_checksums says why it cannot run. */
static void test_xxh3_lanes(void **state)
{
    (void)state;
    uint8_t secret[XXH3_SECRET_DEFAULT_SIZE];
    XXH3_generateSecret_fromSeed(secret, 0);
    const uint64_t lens[] = {241,  255,  256,  257,  1023,  1024,   1025,   1087,
                             1088, 1089, 2048, 4097, 65536, 368640, 184440, 2097152};
    size_t cap = 2097152 + 16; /* the longest length, from each start offset below 16 */
    uint8_t *buf = malloc(cap);
    assert_non_null(buf);
    uint64_t z = UINT64_C(0x243f6a8885a308d3);
    for (size_t i = 0; i < cap; i++) {
        z ^= z << 13;
        z ^= z >> 7;
        z ^= z << 17;
        buf[i] = (uint8_t)(z >> 24);
    }
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
        uint64_t want = XXH3_64bits(buf + k, (size_t)lens[k]); /* unaligned starts too */
        assert_int_equal(tdm_xxh3_long_lanes(buf + k, lens[k], secret), want);
        assert_int_equal(tdm_kv_block_checksum(buf + k, lens[k]), want);
    }
    uint64_t sum = 0;
    uint32_t block = 0;
    tdm_error_t err = {0};
    int n_gpus = 0;
    tdm_error_t derr = {0};
    if (tdm_device_cuda_count(&n_gpus, &derr) != TDM_OK || n_gpus == 0) {
        assert_int_equal(tdm_kv_device_checksums(0, buf, &block, 1, 4096, &sum, &err),
                         TDM_EUNAVAILABLE);
        assert_true(err.msg[0] != '\0');
    }
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_backend_names),
        cmocka_unit_test(test_xxh3_lanes),
        cmocka_unit_test_setup_teardown(test_one_thread_no_team, setup, teardown),
        cmocka_unit_test_setup_teardown(test_sender_options, setup, teardown),
        cmocka_unit_test_setup_teardown(test_happy_path, setup, teardown),
        cmocka_unit_test_setup_teardown(test_grouped, setup, teardown),
        cmocka_unit_test(test_grouped_header_checksum),
        cmocka_unit_test_setup_teardown(test_pipelined, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_fingerprint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_wrong_layout, setup, teardown),
        cmocka_unit_test_setup_teardown(test_out_of_blocks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_unknown_request, setup, teardown),
        cmocka_unit_test_setup_teardown(test_too_few_reserved, setup, teardown),
        cmocka_unit_test_setup_teardown(test_corrupted_block, setup, teardown),
        cmocka_unit_test_setup_teardown(test_header_tampered, setup, teardown),
        cmocka_unit_test_setup_teardown(test_truncated, setup, teardown),
        cmocka_unit_test_setup_teardown(test_garbage, setup, teardown),
        cmocka_unit_test_setup_teardown(test_receiver_gone, setup, teardown),
        cmocka_unit_test_setup_teardown(test_resend_after_lost_connection, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_early_transfer, setup, teardown),
        cmocka_unit_test_setup_teardown(test_early_transfer_bounds, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_queued, setup, teardown),
        cmocka_unit_test_setup_teardown(test_destroy_in_flight, setup, teardown),
        cmocka_unit_test_setup_teardown(test_curve, setup, teardown),
        cmocka_unit_test_setup_teardown(test_send_validation, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
