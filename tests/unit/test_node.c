/* test_node.c - the node side against a fake router: tdm_node_link_flush returns once what
 * the engine sent has reached the router (not after a fixed sleep) and reports a router that
 * does not answer within its bound; a prefill node in-process (the serve loop with the prefill
 * handler) streams a task's first token, honours NODE_CANCEL by attempt, fails a task whose
 * deadline passed, and at shutdown reports what is in flight before it returns; a task's spec
 * is checked by one function (tdm_node_spec_check) and its constraint is taken through the
 * grammar cache (tdm_node_constraint); a load crosses the wire as one NodeLoad. */
#include "prefill.h"
#include "tdm_test.h"
#include "tiny_model.h"

#include "tandem/node.h"
#include "tandem/proto.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>
#include <zmq.h>

#define ROUTER_INSTANCE UINT64_C(0x1234)
#define N_NOTIFY 200
#define FLOOD_FRAMES 100

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A router that registers any node, answers heartbeats (unless muted) and counts TOKEN_EVENT
 * notifications. */
#define MAX_LOG 64

/* What the fake router heard from a node, in order (guarded by mu). */
typedef struct heard {
    int method;          /* TOKEN_EVENT or TASK_FAILED */
    uint64_t attempt_id; /* of the message */
    uint32_t index;      /* TOKEN_EVENT: the output index */
    int32_t token;       /* TOKEN_EVENT: the token */
    int status;          /* TASK_FAILED: the wire (gRPC) code */
    bool retryable;
    char message[128];
    uint32_t n_embd;        /* EMBEDDING: the vector's length */
    uint32_t prompt_tokens; /* EMBEDDING */
    double norm;            /* EMBEDDING: the vector's L2 norm */
} heard_t;

typedef struct fake_router {
    tdm_sock_t *sock;
    pthread_t thread;
    atomic_bool stop, mute;
    atomic_bool flood;         /* each heartbeat is answered with FLOOD_FRAMES NodeCancels too */
    atomic_int hb_interval_ms; /* what RegisterAck says (0: 60000, no periodic beats) */
    atomic_int tokens;
    atomic_int heartbeats;
    pthread_mutex_t mu;
    heard_t log[MAX_LOG];
    int n_log;
    uint8_t peer[TDM_NET_PEER_MAX]; /* the node's routing id (from its REGISTER) */
    size_t peer_len;
    /* A ZeroMQ socket belongs to one thread: the test's own messages to the node are handed to
     * the router's thread, which sends them (fr_send waits until it has). */
    const ProtobufCMessage *outbox; /* under mu; NULL: nothing to send */
    int outbox_method;
    int outbox_rc;
    /* the node's last NodeStatus answer (under mu) */
    bool status_seen;
    char status_node[64], status_model[256];
} fake_router_t;

static void hear(fake_router_t *fr, const tdm_frame_t *f)
{
    heard_t h = {f->method, 0, 0, 0, 0, false, "", 0, 0, 0.0};
    if (f->method == TANDEM__V1__METHOD__METHOD_EMBEDDING) {
        Tandem__V1__EmbeddingResult *er = (Tandem__V1__EmbeddingResult *)tdm_frame_unpack(
            f, &tandem__v1__embedding_result__descriptor);
        assert_non_null(er);
        h.attempt_id = er->attempt_id;
        h.n_embd = (uint32_t)er->n_embedding;
        h.prompt_tokens = er->prompt_tokens;
        for (size_t i = 0; i < er->n_embedding; i++)
            h.norm += (double)er->embedding[i] * er->embedding[i];
        h.norm = sqrt(h.norm);
        tandem__v1__embedding_result__free_unpacked(er, NULL);
    } else if (f->method == TANDEM__V1__METHOD__METHOD_TOKEN_EVENT) {
        Tandem__V1__TokenEvent *te =
            (Tandem__V1__TokenEvent *)tdm_frame_unpack(f, &tandem__v1__token_event__descriptor);
        assert_non_null(te);
        h.attempt_id = te->attempt_id;
        h.index = te->index;
        h.token = te->token_id;
        tandem__v1__token_event__free_unpacked(te, NULL);
    } else {
        Tandem__V1__TaskFailed *tf =
            (Tandem__V1__TaskFailed *)tdm_frame_unpack(f, &tandem__v1__task_failed__descriptor);
        assert_non_null(tf);
        h.attempt_id = tf->attempt_id;
        h.status = tf->status;
        h.retryable = tf->retryable;
        snprintf(h.message, sizeof h.message, "%s", tf->message ? tf->message : "");
        tandem__v1__task_failed__free_unpacked(tf, NULL);
    }
    pthread_mutex_lock(&fr->mu);
    if (fr->n_log < MAX_LOG)
        fr->log[fr->n_log++] = h;
    pthread_mutex_unlock(&fr->mu);
}

/* Messages of `method` heard for attempt so far. */
static int count_heard(fake_router_t *fr, int method, uint64_t attempt)
{
    int n = 0;
    pthread_mutex_lock(&fr->mu);
    for (int k = 0; k < fr->n_log; k++)
        n += fr->log[k].method == method && fr->log[k].attempt_id == attempt;
    pthread_mutex_unlock(&fr->mu);
    return n;
}

/* The first message of `method` heard for attempt (copied into *out), waiting up to 60 s when
 * wait is set. */
static bool heard_of(fake_router_t *fr, int method, uint64_t attempt, bool wait, heard_t *out)
{
    for (int i = 0; i < (wait ? 60000 : 1); i++) {
        pthread_mutex_lock(&fr->mu);
        for (int k = 0; k < fr->n_log; k++)
            if (fr->log[k].method == method && fr->log[k].attempt_id == attempt) {
                if (out)
                    *out = fr->log[k];
                pthread_mutex_unlock(&fr->mu);
                return true;
            }
        pthread_mutex_unlock(&fr->mu);
        if (wait) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
        }
    }
    return false;
}

static void answer(fake_router_t *fr, const tdm_frame_t *f)
{
    if (f->method == TANDEM__V1__METHOD__METHOD_REGISTER) {
        pthread_mutex_lock(&fr->mu);
        memcpy(fr->peer, f->peer, f->peer_len);
        fr->peer_len = f->peer_len;
        pthread_mutex_unlock(&fr->mu);
        Tandem__V1__RegisterAck ack = TANDEM__V1__REGISTER_ACK__INIT;
        int ivl = atomic_load(&fr->hb_interval_ms);
        ack.heartbeat_interval_ms = ivl ? (uint32_t)ivl : 60000; /* 60 s: only the flush's */
        ack.heartbeat_timeout_ms = 600000;
        ack.router_instance_id = ROUTER_INSTANCE;
        tdm_sock_reply(fr->sock, f, &ack.base);
    } else if (f->method == TANDEM__V1__METHOD__METHOD_HEARTBEAT) {
        atomic_fetch_add(&fr->heartbeats, 1);
        if (!atomic_load(&fr->mute))
            tdm_sock_reply(fr->sock, f, NULL);
        for (int i = 0; atomic_load(&fr->flood) && i < FLOOD_FRAMES; i++) {
            Tandem__V1__NodeCancel c = TANDEM__V1__NODE_CANCEL__INIT;
            c.request_id = (char *)"flood";
            c.attempt_id = 1;
            tdm_sock_notify(fr->sock, f->peer, f->peer_len, TANDEM__V1__METHOD__METHOD_NODE_CANCEL,
                            &c.base);
        }
    } else if (f->method == TANDEM__V1__METHOD__METHOD_TOKEN_EVENT) {
        atomic_fetch_add(&fr->tokens, 1);
        hear(fr, f);
    } else if (f->method == TANDEM__V1__METHOD__METHOD_TASK_FAILED ||
               f->method == TANDEM__V1__METHOD__METHOD_EMBEDDING) {
        hear(fr, f);
    } else if (f->method == TANDEM__V1__METHOD__METHOD_NODE_STATUS) {
        Tandem__V1__NodeStatus *ns =
            (Tandem__V1__NodeStatus *)tdm_frame_unpack(f, &tandem__v1__node_status__descriptor);
        assert_non_null(ns);
        pthread_mutex_lock(&fr->mu);
        snprintf(fr->status_node, sizeof fr->status_node, "%s", ns->node_id);
        snprintf(fr->status_model, sizeof fr->status_model, "%s", ns->model);
        fr->status_seen = true;
        pthread_mutex_unlock(&fr->mu);
        tandem__v1__node_status__free_unpacked(ns, NULL);
    }
}

/* The router thread: sends what the test handed over (fr_send). */
static void send_outbox(fake_router_t *fr)
{
    pthread_mutex_lock(&fr->mu);
    if (fr->outbox) {
        fr->outbox_rc =
            tdm_sock_notify(fr->sock, fr->peer, fr->peer_len, fr->outbox_method, fr->outbox);
        fr->outbox = NULL;
    }
    pthread_mutex_unlock(&fr->mu);
}

/* The test's thread: has the router's thread send msg to the node, waiting up to 60 s for it
 * to be sent; the send's return code. */
static int fr_send(fake_router_t *fr, int method, const ProtobufCMessage *msg)
{
    pthread_mutex_lock(&fr->mu);
    fr->outbox_method = method;
    fr->outbox_rc = -1;
    fr->outbox = msg;
    pthread_mutex_unlock(&fr->mu);
    for (int i = 0; i < 60000; i++) {
        pthread_mutex_lock(&fr->mu);
        bool sent = fr->outbox == NULL;
        int rc = fr->outbox_rc;
        pthread_mutex_unlock(&fr->mu);
        if (sent)
            return rc;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    return -1;
}

static void *router_main(void *arg)
{
    fake_router_t *fr = arg;
    tdm_frame_t f;
    tdm_frame_init(&f);
    while (!atomic_load(&fr->stop) && (send_outbox(fr), true))
        if (tdm_sock_recv(fr->sock, &f, 5) == 0) {
            answer(fr, &f);
            tdm_frame_clear(&f);
        }
    tdm_frame_clear(&f);
    return NULL;
}

typedef struct rig {
    tdm_net_t *net;
    fake_router_t fr;
    tdm_node_link_t *link;
} rig_t;

/* Starts the fake router on a port of its own. */
static void router_open(rig_t *r)
{
    tdm_error_t err = {0};
    memset(r, 0, sizeof *r);
    pthread_mutex_init(&r->fr.mu, NULL);
    r->net = tdm_net_new(1, &err);
    assert_non_null(r->net);
    tdm_sock_opts_t so = {0};
    so.instance_id = ROUTER_INSTANCE;
    r->fr.sock = tdm_sock_bind(r->net, "tcp://127.0.0.1:*", &so, &err);
    assert_non_null(r->fr.sock);
    assert_int_equal(pthread_create(&r->fr.thread, NULL, router_main, &r->fr), 0);
}

static void wait_registered(tdm_node_link_t *l)
{
    for (int i = 0; i < 30000 && tdm_node_link_state(l, NULL, 0) != TDM_NODE_LINK_REGISTERED; i++)
        sleep_ms(1);
    assert_int_equal(tdm_node_link_state(l, NULL, 0), TDM_NODE_LINK_REGISTERED);
}

static void router_close(rig_t *r)
{
    atomic_store(&r->fr.stop, true);
    pthread_join(r->fr.thread, NULL);
    tdm_sock_destroy(&r->fr.sock);
    tdm_net_destroy(&r->net);
    pthread_mutex_destroy(&r->fr.mu);
}

static void rig_open(rig_t *r)
{
    tdm_error_t err = {0};
    router_open(r);
    Tandem__V1__RegisterRequest reg = TANDEM__V1__REGISTER_REQUEST__INIT;
    reg.node_id = (char *)"p0";
    reg.instance_id = 77;
    tdm_node_link_opts_t lo = {tdm_sock_endpoint(r->fr.sock), NULL, &reg, NULL, NULL};
    r->link = tdm_node_link_new(r->net, &lo, &err);
    if (!r->link)
        fail_msg("%s", err.msg);
    wait_registered(r->link); /* the engine's frames of this router instance now flow */
}

static void rig_close(rig_t *r)
{
    tdm_node_link_destroy(&r->link);
    router_close(r);
}

static void send_tokens(rig_t *r, int n)
{
    for (int i = 0; i < n; i++) {
        Tandem__V1__TokenEvent te = TANDEM__V1__TOKEN_EVENT__INIT;
        te.request_id = (char *)"req";
        te.attempt_id = 1;
        te.index = (uint32_t)i;
        assert_int_equal(tdm_sock_notify(tdm_node_link_sock(r->link), NULL, 0,
                                         TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, &te.base),
                         0);
    }
}

/* flush returns 0 once the router has everything sent before it: all N_NOTIFY tokens are
 * counted at the moment it returns, and it returned before its 60 s bound. */
static void test_flush_waits_for_the_router(void **state)
{
    (void)state;
    rig_t r;
    rig_open(&r);
    send_tokens(&r, N_NOTIFY);
    assert_int_equal(tdm_node_link_flush(r.link, 60000), 0);
    assert_int_equal(atomic_load(&r.fr.tokens), N_NOTIFY);
    /* again: each flush waits for its own answer */
    send_tokens(&r, 10);
    assert_int_equal(tdm_node_link_flush(r.link, 60000), 0);
    assert_int_equal(atomic_load(&r.fr.tokens), N_NOTIFY + 10);
    rig_close(&r);
}

/* A router that does not answer: flush gives up after its bound with TDM_EDEADLINE. */
static void test_flush_bounded(void **state)
{
    (void)state;
    rig_t r;
    rig_open(&r);
    atomic_store(&r.fr.mute, true);
    int beats = atomic_load(&r.fr.heartbeats);
    send_tokens(&r, 5);
    double t0 = tdm_time_now();
    assert_int_equal(tdm_node_link_flush(r.link, 200), TDM_EDEADLINE);
    assert_true(tdm_time_now() - t0 >= 0.19);
    /* the flush's heartbeat did reach the router; it was only not answered */
    for (int i = 0; i < 30000 && atomic_load(&r.fr.heartbeats) == beats; i++)
        sleep_ms(1);
    assert_true(atomic_load(&r.fr.heartbeats) > beats);
    assert_int_equal(atomic_load(&r.fr.tokens), 5);
    rig_close(&r);
}

/* ---- a prefill node in-process ---- */

typedef struct prefill_rig {
    rig_t r;
    char model[64];
    tdm_config_t cfg;
    void *sink; /* a "decode node" KV endpoint that takes transfers, never acks */
    char sink_ep[128];
    tdm_prefill_t *p;
    pthread_t thread;
    volatile sig_atomic_t stop;
    int rc;
} prefill_rig_t;

static void *prefill_main(void *arg)
{
    prefill_rig_t *pr = arg;
    tdm_error_t err = {0};
    pr->rc = tdm_prefill_run(pr->p, &pr->stop, &err);
    return NULL;
}

static void prefill_open(prefill_rig_t *pr)
{
    memset(pr, 0, sizeof *pr);
    router_open(&pr->r);
    snprintf(pr->model, sizeof pr->model, "/tmp/tdm_test_node_%d.gguf", (int)getpid());
    tdm_tiny_llama_spec_t spec = {0};
    tdm_error_t err = {0};
    assert_int_equal(tdm_test_write_tiny_llama(pr->model, &spec, &err), 0);
    pr->sink = zmq_socket(tdm_net_zctx(pr->r.net), ZMQ_ROUTER);
    assert_int_equal(zmq_bind(pr->sink, "tcp://127.0.0.1:*"), 0);
    size_t len = sizeof pr->sink_ep;
    assert_int_equal(zmq_getsockopt(pr->sink, ZMQ_LAST_ENDPOINT, pr->sink_ep, &len), 0);
    char yaml[1024];
    snprintf(yaml, sizeof yaml,
             "model: {path: '%s'}\n"
             "router: {node_endpoint: '%s'}\n"
             "nodes:\n"
             "  - {id: p0, role: prefill, threads: 1, max_running: 4, memory_budget: 64MiB}\n"
             "  - {id: d0, role: decode, kv_endpoint: '%s'}\n",
             pr->model, tdm_sock_endpoint(pr->r.fr.sock), pr->sink_ep);
    if (tdm_config_load_string(yaml, strlen(yaml), "node.yaml", &pr->cfg, &err) != 0)
        fail_msg("%s", err.msg);
    pr->p = tdm_prefill_new(&pr->cfg, "p0", pr->r.net, NULL, &err);
    if (!pr->p)
        fail_msg("%s", err.msg);
    wait_registered(tdm_prefill_link(pr->p, 0));
    assert_int_equal(pthread_create(&pr->thread, NULL, prefill_main, pr), 0);
}

static void prefill_stop(prefill_rig_t *pr)
{
    pr->stop = 1;
    pthread_join(pr->thread, NULL);
    assert_int_equal(pr->rc, 0);
}

static void prefill_close(prefill_rig_t *pr)
{
    tdm_prefill_destroy(&pr->p);
    zmq_close(pr->sink);
    router_close(&pr->r);
    tdm_config_free(&pr->cfg);
    remove(pr->model);
}

/* The router's side: a PrefillTask (deadline in unix ms, 0: an hour; a migrated request's
 * output[n_output] delivered already) or a NodeCancel. */
static void send_task_resumed(prefill_rig_t *pr, uint64_t attempt, uint64_t deadline_ms,
                              int32_t *output, size_t n_output)
{
    static int32_t prompt[24];
    for (int i = 0; i < 24; i++)
        prompt[i] = 3 + i;
    Tandem__V1__SequenceSpec spec = TANDEM__V1__SEQUENCE_SPEC__INIT;
    spec.request_id = (char *)"req";
    spec.attempt_id = attempt;
    spec.prompt_tokens = prompt;
    spec.n_prompt_tokens = 24;
    spec.max_tokens = 4;
    spec.deadline_unix_ms = deadline_ms ? deadline_ms : tdm_net_now_ms() + 3600 * 1000;
    spec.output_tokens = output;
    spec.n_output_tokens = n_output;
    Tandem__V1__PrefillTask t = TANDEM__V1__PREFILL_TASK__INIT;
    t.spec = &spec;
    t.decode_node_id = (char *)"d0";
    t.decode_kv_endpoint = pr->sink_ep;
    fake_router_t *fr = &pr->r.fr;
    assert_int_equal(fr_send(fr, TANDEM__V1__METHOD__METHOD_PREFILL_TASK, &t.base), 0);
}

static void send_task(prefill_rig_t *pr, uint64_t attempt, uint64_t deadline_ms)
{
    send_task_resumed(pr, attempt, deadline_ms, NULL, 0);
}

/* The header of the next KV transfer the sink receives (within 60 s); caller frees. */
static Tandem__V1__KvTransfer *sink_transfer(prefill_rig_t *pr)
{
    zmq_pollitem_t it = {pr->sink, 0, ZMQ_POLLIN, 0};
    assert_int_equal(zmq_poll(&it, 1, 60000), 1);
    Tandem__V1__KvTransfer *kv = NULL;
    int more = 1;
    for (int part = 0; more; part++) {
        zmq_msg_t m;
        zmq_msg_init(&m);
        assert_true(zmq_msg_recv(&m, pr->sink, 0) >= 0);
        if (part == 2) /* [routing id][FrameHeader][KvTransfer][blocks...] */
            kv = tandem__v1__kv_transfer__unpack(NULL, zmq_msg_size(&m), zmq_msg_data(&m));
        more = zmq_msg_more(&m);
        zmq_msg_close(&m);
    }
    assert_non_null(kv);
    return kv;
}

static void send_cancel(prefill_rig_t *pr, uint64_t attempt)
{
    Tandem__V1__NodeCancel c = TANDEM__V1__NODE_CANCEL__INIT;
    c.request_id = (char *)"req";
    c.attempt_id = attempt;
    fake_router_t *fr = &pr->r.fr;
    assert_int_equal(fr_send(fr, TANDEM__V1__METHOD__METHOD_NODE_CANCEL, &c.base), 0);
}

/* The serve loop with the prefill handler: tasks found by attempt, worker events reach their
 * task, cancel, deadline and shutdown. */
static void test_prefill_node_serves(void **state)
{
    (void)state;
    prefill_rig_t pr;
    prefill_open(&pr);
    /* a task's first token comes back under its attempt */
    send_task(&pr, 11, 0);
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, 11, true, NULL));
    /* the task now waits for the KV acknowledgement; a duplicate of it is dropped, a cancel
     * ends it (so shutdown has nothing to report for it), another task runs */
    send_task(&pr, 11, 0);
    send_cancel(&pr, 11);
    send_task(&pr, 13, 0);
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, 13, true, NULL));
    assert_int_equal(count_heard(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, 11), 1);
    /* a deadline that passes: DEADLINE_EXCEEDED, not retryable */
    heard_t h;
    send_task(&pr, 12, tdm_net_now_ms() - 1);
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TASK_FAILED, 12, true, &h));
    assert_int_equal(h.status, 4);
    assert_false(h.retryable);
    assert_string_equal(h.message, "deadline passed during prefill");
    /* shutdown: what is in flight (attempt 13, still unacknowledged) is reported, and the
     * report has reached the router when the loop returns (the link was flushed) */
    prefill_stop(&pr);
    assert_false(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TASK_FAILED, 11, false, NULL));
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TASK_FAILED, 13, false, &h));
    assert_int_equal(h.status, 14);
    assert_true(h.retryable);
    assert_string_equal(h.message, "prefill node shutting down");
    prefill_close(&pr);
}

/* A node's own NODE_STATUS answer names the model it serves, as its REGISTER did. */
static void test_node_status_names_model(void **state)
{
    (void)state;
    prefill_rig_t pr;
    prefill_open(&pr);
    Tandem__V1__StatusRequest req = TANDEM__V1__STATUS_REQUEST__INIT;
    assert_int_equal(fr_send(&pr.r.fr, TANDEM__V1__METHOD__METHOD_NODE_STATUS, &req.base), 0);
    bool seen = false;
    for (int i = 0; i < 60000 && !seen; i++) {
        pthread_mutex_lock(&pr.r.fr.mu);
        seen = pr.r.fr.status_seen;
        pthread_mutex_unlock(&pr.r.fr.mu);
        if (!seen)
            sleep_ms(1);
    }
    assert_true(seen);
    const char *want = tdm_config_node_model(&pr.cfg, &pr.cfg.nodes[0])->name;
    assert_true(want && want[0]);
    assert_string_equal(pr.r.fr.status_node, "p0");
    assert_string_equal(pr.r.fr.status_model, want);
    prefill_stop(&pr);
    prefill_close(&pr);
}

/* A migrated request's task (the output delivered before, output_tokens): the prefill node
 * prefills prompt + output, its token is the next output index, and the KV it ships covers
 * both; a task with as many output tokens as max_tokens is refused, naming the field. */
static void test_prefill_node_resumes(void **state)
{
    (void)state;
    prefill_rig_t pr;
    prefill_open(&pr);
    int32_t out[4] = {7, 8, 9, 10};
    send_task_resumed(&pr, 21, 0, out, 3);
    heard_t h;
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, 21, true, &h));
    assert_int_equal(h.index, 3);
    Tandem__V1__KvTransfer *kv = sink_transfer(&pr);
    assert_int_equal(kv->attempt_id, 21);
    assert_int_equal(kv->n_tokens, 24 + 3);
    assert_int_equal(kv->first_token, h.token);
    tandem__v1__kv_transfer__free_unpacked(kv, NULL);
    send_task_resumed(&pr, 22, 0, out, 4); /* max_tokens 4: nothing left to generate */
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TASK_FAILED, 22, true, &h));
    assert_int_equal(h.status, 3);
    assert_false(h.retryable);
    assert_non_null(strstr(h.message, "output_tokens: 4 tokens after a prompt of 24"));
    assert_int_equal(count_heard(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, 22), 0);
    prefill_stop(&pr);
    prefill_close(&pr);
}

/* The router's side of an embedding: an EmbedTask of n tokens (3, 4, ...; token bad_at, when
 * below n, is out of the vocabulary). */
static void send_embed(prefill_rig_t *pr, uint64_t attempt, uint32_t n, uint32_t bad_at,
                       Tandem__V1__Pooling pooling)
{
    static int32_t prompt[64];
    assert_true(n <= 64);
    for (uint32_t i = 0; i < n; i++)
        prompt[i] = i == bad_at ? 1000000 : (int32_t)(3 + i);
    Tandem__V1__SequenceSpec spec = TANDEM__V1__SEQUENCE_SPEC__INIT;
    spec.request_id = (char *)"emb";
    spec.attempt_id = attempt;
    spec.prompt_tokens = prompt;
    spec.n_prompt_tokens = n;
    spec.deadline_unix_ms = tdm_net_now_ms() + 3600 * 1000;
    Tandem__V1__EmbedTask t = TANDEM__V1__EMBED_TASK__INIT;
    t.spec = &spec;
    t.pooling = pooling;
    assert_int_equal(fr_send(&pr->r.fr, TANDEM__V1__METHOD__METHOD_EMBED_TASK, &t.base), 0);
}

/* A prefill node serves EmbedTasks next to PrefillTasks: each answers one EmbeddingResult of
 * the model's width, unit norm, with its prompt's token count, and frees its blocks (no KV
 * transfer); a token outside the vocabulary is INVALID_ARGUMENT naming prompt_tokens[i]. */
static void test_prefill_node_embeds(void **state)
{
    (void)state;
    prefill_rig_t pr;
    prefill_open(&pr);
    send_task(&pr, 41, 0);
    send_embed(&pr, 42, 40, UINT32_MAX, TANDEM__V1__POOLING__POOLING_MEAN);
    send_embed(&pr, 43, 5, UINT32_MAX, TANDEM__V1__POOLING__POOLING_LAST);
    send_embed(&pr, 44, 8, 2, TANDEM__V1__POOLING__POOLING_LAST);
    heard_t h;
    for (uint64_t a = 42; a <= 43; a++) {
        assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_EMBEDDING, a, true, &h));
        assert_int_equal(h.n_embd, 64); /* the tiny model's default width */
        assert_int_equal(h.prompt_tokens, a == 42 ? 40 : 5);
        assert_true(fabs(h.norm - 1.0) < 1e-5);
    }
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TASK_FAILED, 44, true, &h));
    assert_int_equal(h.status, 3);
    assert_false(h.retryable);
    assert_non_null(strstr(h.message, "prompt_tokens[2]: token id 1000000 is outside"));
    assert_true(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TOKEN_EVENT, 41, true, NULL));
    Tandem__V1__KvTransfer *kv = sink_transfer(&pr); /* the PrefillTask's, the only one */
    assert_int_equal(kv->attempt_id, 41);
    tandem__v1__kv_transfer__free_unpacked(kv, NULL);
    send_cancel(&pr, 41);
    prefill_stop(&pr);
    assert_int_equal(count_heard(&pr.r.fr, TANDEM__V1__METHOD__METHOD_EMBEDDING, 42), 1);
    assert_false(heard_of(&pr.r.fr, TANDEM__V1__METHOD__METHOD_TASK_FAILED, 42, false, NULL));
    prefill_close(&pr);
}

/* Heartbeats come from the link's I/O thread: an engine thread that reads nothing (a long
 * forward pass) while the router floods it with frames does not hold them back; the link stays
 * registered, and the engine finds the relayed frames once it reads. */
static void test_heartbeats_while_engine_busy(void **state)
{
    (void)state;
    rig_t r;
    tdm_error_t err = {0};
    router_open(&r);
    atomic_store(&r.fr.hb_interval_ms, 20);
    atomic_store(&r.fr.flood, true);
    Tandem__V1__RegisterRequest reg = TANDEM__V1__REGISTER_REQUEST__INIT;
    reg.node_id = (char *)"p0";
    reg.instance_id = 78;
    tdm_node_link_opts_t lo = {tdm_sock_endpoint(r.fr.sock), NULL, &reg, NULL, NULL};
    r.link = tdm_node_link_new(r.net, &lo, &err);
    if (!r.link)
        fail_msg("%s", err.msg);
    wait_registered(r.link);
    /* 30 beats, 3,000 frames for the engine, which reads none of them meanwhile */
    for (int i = 0; i < 60000 && atomic_load(&r.fr.heartbeats) < 30; i++)
        sleep_ms(1);
    assert_true(atomic_load(&r.fr.heartbeats) >= 30);
    assert_int_equal(tdm_node_link_state(r.link, NULL, 0), TDM_NODE_LINK_REGISTERED);
    atomic_store(&r.fr.flood, false);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_int_equal(tdm_sock_recv(tdm_node_link_sock(r.link), &f, 60000), 0);
    assert_int_equal(f.method, TANDEM__V1__METHOD__METHOD_NODE_CANCEL);
    tdm_frame_clear(&f);
    rig_close(&r);
}

/* A task's spec (tdm_node_spec_attempt, tdm_node_spec_check): the one check of both node roles
 * names the field at fault and its limit; a good spec gives the attempt and the sampling
 * parameters (max_tokens included). */
static void test_node_spec_check(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_node_attempt_t att;
    tdm_sampling_params_t sp;
    assert_int_equal(tdm_node_spec_attempt(NULL, 1, &att, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "spec: missing");
    assert_int_equal(tdm_node_spec_check(NULL, 64, 100, &sp, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "spec: missing");
    int32_t prompt[8] = {1, 2, 3, 4, 5, 6, 7, 8}, output[2] = {9, 10};
    Tandem__V1__SequenceSpec spec = TANDEM__V1__SEQUENCE_SPEC__INIT;
    spec.request_id = (char *)"req";
    assert_int_equal(tdm_node_spec_attempt(&spec, 1, &att, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "attempt_id is 0");
    spec.attempt_id = 0x2a;
    assert_int_equal(tdm_node_spec_attempt(&spec, 7, &att, &err), 0);
    assert_string_equal(att.key, "000000000000002a");
    assert_string_equal(att.label, "req");
    assert_int_equal(att.router_instance, 7);
    spec.max_tokens = 4;
    assert_int_equal(tdm_node_spec_check(&spec, 8, 100, &sp, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "prompt_tokens: 0 tokens; 1..7 fit the context of 8 tokens");
    spec.prompt_tokens = prompt;
    spec.n_prompt_tokens = 8;
    assert_int_equal(tdm_node_spec_check(&spec, 8, 100, &sp, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "prompt_tokens: 8 tokens; 1..7 fit the context of 8 tokens");
    spec.n_prompt_tokens = 4;
    prompt[2] = 100;
    assert_int_equal(tdm_node_spec_check(&spec, 8, 100, &sp, &err), TDM_EINVALID);
    assert_string_equal(err.msg,
                        "prompt_tokens[2]: token id 100 is outside the vocabulary [0, 100)");
    prompt[2] = 3;
    spec.max_tokens = 0;
    assert_int_equal(tdm_node_spec_check(&spec, 8, 100, &sp, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "max_tokens must be >= 1, got 0");
    spec.max_tokens = 2;
    spec.output_tokens = output;
    spec.n_output_tokens = 2;
    assert_int_equal(tdm_node_spec_check(&spec, 8, 100, &sp, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "output_tokens: 2 tokens after a prompt of 4; the context holds 8 "
                                 "and max_tokens is 2");
    spec.max_tokens = 3;
    assert_int_equal(tdm_node_spec_check(&spec, 6, 100, &sp, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "output_tokens: 2 tokens after a prompt of 4"));
    output[1] = -1;
    assert_int_equal(tdm_node_spec_check(&spec, 8, 100, &sp, &err), TDM_EINVALID);
    assert_string_equal(err.msg,
                        "output_tokens[1]: token id -1 is outside the vocabulary [0, 100)");
    output[1] = 10;
    assert_int_equal(tdm_node_spec_check(&spec, 8, 100, &sp, &err), 0);
    assert_int_equal(sp.max_tokens, 3);
}

/* A load crosses the wire as one NodeLoad: every figure the node fills comes back as it was;
 * a message without a load reads as zeros. */
static void test_node_load_proto(void **state)
{
    (void)state;
    tdm_node_load_t in, out;
    memset(&in, 0, sizeof in);
    in.kv_blocks_free = 1;
    in.kv_blocks_used = 2;
    in.kv_blocks_cached = 3;
    in.running = 4;
    in.waiting = 5;
    in.queued_prefill_tokens = 6;
    in.step_s = 0.25;
    in.batch_size = 7;
    in.decode_step_s = 0.125;
    in.decode_batch_size = 8;
    in.prefix_queries = 9;
    in.prefix_hits = 10;
    for (size_t i = 0; i < TDM_WORKER_ITERATION_BUCKETS; i++)
        in.iteration_counts[i] = 100 + i;
    in.iteration_tokens = 11;
    in.spec_drafts = 12;
    in.spec_draft_tokens = 13;
    in.spec_accepted_tokens = 14;
    in.process_resident_bytes = 15;
    in.process_cpu_seconds = 1.5;
    in.process_open_fds = 16;
    in.stale_router_frames = 17;
    Tandem__V1__NodeLoad m;
    tdm_node_load_to_proto(&in, &m);
    uint8_t buf[1024];
    size_t n = tandem__v1__node_load__pack(&m, buf);
    Tandem__V1__NodeLoad *back = tandem__v1__node_load__unpack(NULL, n, buf);
    assert_non_null(back);
    tdm_node_load_from_proto(back, &out);
    tandem__v1__node_load__free_unpacked(back, NULL);
    assert_memory_equal(&in, &out, sizeof in);
    tdm_node_load_from_proto(NULL, &out);
    assert_int_equal(out.kv_blocks_free, 0);
    assert_int_equal(out.iteration_counts[0], 0);
}

/* A task's constraint (tdm_node_constraint): none for no message or kind NONE; only GRAMMAR
 * text whose hash matches is taken, compiled once through the cache; anything else is refused
 * naming "constraint". */
static void test_node_constraint(void **state)
{
    (void)state;
    tdm_error_t err = {0};
    tdm_grammar_cache_t *cache = tdm_grammar_cache_new(1 << 20, &err);
    assert_non_null(cache);
    const tdm_grammar_t *g = (const tdm_grammar_t *)&err; /* must be reset */
    assert_int_equal(tdm_node_constraint(cache, NULL, &g, &err), 0);
    assert_null(g);
    Tandem__V1__Constraint c = TANDEM__V1__CONSTRAINT__INIT;
    assert_int_equal(tdm_node_constraint(cache, &c, &g, &err), 0);
    assert_null(g);
    const char *text = "root ::= \"on\" | \"off\"\n";
    c.kind = TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_JSON_SCHEMA;
    c.text = (char *)text;
    c.hash = tdm_constraint_hash(text, strlen(text));
    assert_int_equal(tdm_node_constraint(cache, &c, &g, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "GRAMMAR"));
    c.kind = TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_GRAMMAR;
    c.hash ^= 1;
    assert_int_equal(tdm_node_constraint(cache, &c, &g, &err), TDM_EINVALID);
    assert_non_null(strstr(err.msg, "constraint: the hash"));
    c.hash ^= 1;
    const tdm_grammar_t *g1 = NULL, *g2 = NULL;
    assert_int_equal(tdm_node_constraint(cache, &c, &g1, &err), 0);
    assert_int_equal(tdm_node_constraint(cache, &c, &g2, &err), 0);
    assert_non_null(g1);
    assert_ptr_equal(g1, g2);
    c.text = (char *)"root ::= (";
    c.hash = tdm_constraint_hash(c.text, strlen(c.text));
    assert_int_equal(tdm_node_constraint(cache, &c, &g, &err), TDM_EINVALID);
    assert_true(strncmp(err.msg, "constraint: ", 12) == 0);
    c.text = (char *)"";
    assert_int_equal(tdm_node_constraint(cache, &c, &g, &err), TDM_EINVALID);
    tdm_grammar_cache_stats_t st;
    tdm_grammar_cache_stats(cache, &st);
    assert_int_equal(st.hits, 1);
    tdm_grammar_cache_release(cache, g1);
    tdm_grammar_cache_release(cache, g2);
    tdm_grammar_cache_destroy(&cache);
}

/* ---- pool sizing (tdm_node_size_pool), with the device figures given ---- */

#define GIB UINT64_C(1073741824)

/* A Llama-3.1-8B-shaped device node: 32 layers, 8 KV heads, head_dim 128, f16, 16-token
 * blocks (2 MiB each; 256 blocks = 512 MiB for 4096 tokens), 16 GiB of weights and 1 GiB of
 * scratch on a 100 GiB device with 99 GiB free, gpu_memory_utilization 0.4. */
static tdm_node_sizing_t sizing_8b(void)
{
    tdm_node_sizing_t in;
    memset(&in, 0, sizeof in);
    in.node_id = "d0";
    in.layout = (tdm_kv_layout_t){32, 8, 128, 16, TDM_KV_F16};
    in.n_ctx = 4096;
    in.weight_bytes = 16 * GIB;
    in.scratch_bytes = 1 * GIB;
    in.on_device = true;
    in.device_index = 0;
    in.gpu_memory_utilization = 0.4;
    in.device_total_bytes = 100 * GIB;
    in.device_free_bytes = 99 * GIB;
    return in;
}

static void test_size_pool_device(void **state)
{
    (void)state;
    tdm_node_sizing_t in = sizing_8b();
    tdm_node_pool_size_t ps;
    tdm_error_t err = {0};
    /* budget floor(0.4 x 100 GiB) = 42,949,672,960; minus 17 GiB = 24,696,061,952 bytes =
     * 11,776 blocks of 2,097,152 */
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_OK);
    assert_int_equal(ps.budget_bytes, UINT64_C(42949672960));
    assert_int_equal(ps.block_bytes, UINT64_C(2097152));
    assert_int_equal(ps.n_blocks, 11776);

    /* a second node on the same GPU: the first holds its 40 GiB, 0.4 still fits */
    in.device_free_bytes = 99 * GIB - ps.budget_bytes;
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_OK);
    assert_int_equal(ps.n_blocks, 11776);
    /* a third does not: 40 GiB asked, 19 GiB free, refused with the figures */
    in.device_free_bytes -= ps.budget_bytes;
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_ERESOURCE);
    assert_int_equal(ps.n_blocks, 0);
    assert_non_null(strstr(err.msg, "cuda:0"));
    assert_non_null(strstr(err.msg, "42949672960 bytes"));
    assert_non_null(strstr(err.msg, "107374182400 bytes total"));
    assert_non_null(strstr(err.msg, "20401094656 bytes"));
    assert_non_null(strstr(err.msg, "at most 0.190"));

    /* memory_budget on a device node: that many bytes, still checked against free */
    in = sizing_8b();
    in.memory_budget = 18 * GIB;
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_OK);
    assert_int_equal(ps.budget_bytes, 18 * GIB);
    assert_int_equal(ps.n_blocks, 512);
}

static void test_size_pool_refuses(void **state)
{
    (void)state;
    tdm_node_sizing_t in = sizing_8b();
    tdm_node_pool_size_t ps;
    tdm_error_t err = {0};
    /* 40 GiB budget, 39.75 GiB of weights and scratch: 128 blocks, a sequence needs 256 */
    in.weight_bytes = 38 * GIB + 3 * GIB / 4;
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "node 'd0': cuda:0"));
    assert_non_null(strstr(err.msg, "total 107374182400, free 106300440576"));
    assert_non_null(strstr(err.msg, "41607495680 bytes on the device"));
    assert_non_null(strstr(err.msg, "scratch (1073741824 bytes)"));
    assert_non_null(strstr(err.msg, "leaves 128 KV blocks of 2097152 bytes"));
    assert_non_null(strstr(err.msg, "needs 256 blocks (536870912 bytes)"));
    assert_non_null(strstr(err.msg, "at least 43218108416 bytes"));
    /* exactly one sequence fits */
    in.weight_bytes = 38 * GIB + GIB / 2;
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_OK);
    assert_int_equal(ps.n_blocks, 256);

    /* the CPU: memory_budget only, the device figures ignored */
    tdm_node_sizing_t cpu = sizing_8b();
    cpu.on_device = false;
    cpu.device_total_bytes = cpu.device_free_bytes = 0;
    cpu.memory_budget = 17 * GIB + 255 * UINT64_C(2097152);
    assert_int_equal(tdm_node_size_pool(&cpu, &ps, &err), TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "raise memory_budget"));
    cpu.memory_budget += UINT64_C(2097152);
    assert_int_equal(tdm_node_size_pool(&cpu, &ps, &err), TDM_OK);
    assert_int_equal(ps.n_blocks, 256);

    /* a cpu budget past the host's memory (or cgroup limit) is refused with both figures;
     * exactly the host's memory is taken; 0 (unknown) is not checked */
    cpu.host_memory_bytes = cpu.memory_budget - 1;
    assert_int_equal(tdm_node_size_pool(&cpu, &ps, &err), TDM_ERESOURCE);
    assert_int_equal(ps.n_blocks, 0);
    assert_string_equal(err.field, "memory_budget");
    assert_non_null(strstr(err.msg, "memory_budget 18790481920 bytes"));
    assert_non_null(strstr(err.msg, "host's memory, 18790481919 bytes"));
    cpu.host_memory_bytes = cpu.memory_budget;
    assert_int_equal(tdm_node_size_pool(&cpu, &ps, &err), TDM_OK);
    assert_int_equal(ps.n_blocks, 256);
    assert_true(tdm_node_host_memory() > 0);
}

/* Gemma 3 270M's shape (18 layers, every sixth of full attention, window 512) sized per layer
 * group on a CPU node, and the rule of which nodes do (tdm_node_kv_groups): CPU prefill and
 * decode nodes alike (KV travels between them per group, protocol 2.9), not a CUDA node nor any
 * node of a model that has one (its KV would meet a pool of every layer), not a model without
 * windows. */
static void test_size_pool_layer_groups(void **state)
{
    (void)state;
    tdm_llama_hparams_t hp;
    memset(&hp, 0, sizeof hp);
    hp.n_layers = 18;
    hp.n_swa = 512;
    for (uint32_t l = 0; l < 18; l++)
        hp.swa_layers[l] = l % 6 != 5;
    tdm_node_config_t nodes[2];
    memset(nodes, 0, sizeof nodes);
    nodes[0].id = "d0";
    nodes[0].role = TDM_NODE_ROLE_DECODE;
    nodes[0].device.kind = TDM_NODE_DEVICE_CPU;
    nodes[1] = nodes[0];
    nodes[1].id = "d1";
    tdm_config_t cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.nodes = nodes;
    cfg.n_nodes = 2;
    tdm_kv_groups_t g;
    assert_true(tdm_node_kv_groups(&cfg, &nodes[0], &hp, &g));
    assert_int_equal(g.n_groups, 6);
    assert_int_equal(g.layers_per_group, 3);
    assert_int_equal(g.n_full, 1);

    tdm_node_sizing_t in;
    memset(&in, 0, sizeof in);
    in.node_id = "d0";
    in.layout = (tdm_kv_layout_t){18, 1, 256, 16, TDM_KV_F16};
    in.n_ctx = 8192;
    in.weight_bytes = 178995712;
    in.scratch_bytes = 368475584;
    in.memory_budget = 2 * GIB;
    in.groups = &g;
    tdm_node_pool_size_t ps;
    tdm_error_t err = {0};
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_OK);
    assert_int_equal(ps.block_bytes, 49152);
    assert_int_equal(ps.n_blocks, 32552); /* docs/capacity.md's table */
    in.groups = NULL;
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_OK);
    assert_int_equal(ps.block_bytes, 294912);
    assert_int_equal(ps.n_blocks, 5425);
    /* a grouped budget too small for one 8k sequence: 677 blocks of 49,152 bytes */
    in.groups = &g;
    in.memory_budget = in.weight_bytes + in.scratch_bytes + 676 * UINT64_C(49152);
    assert_int_equal(tdm_node_size_pool(&in, &ps, &err), TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "needs 677 blocks"));

    nodes[1].role = TDM_NODE_ROLE_PREFILL; /* a CPU pair: KV crosses nodes per group */
    assert_true(tdm_node_kv_groups(&cfg, &nodes[0], &hp, &g));
    assert_true(tdm_node_kv_groups(&cfg, &nodes[1], &hp, &g));
    nodes[1].device.kind = TDM_NODE_DEVICE_CUDA; /* a CUDA prefill node: all of its model's */
    assert_false(tdm_node_kv_groups(&cfg, &nodes[0], &hp, &g));
    assert_false(tdm_node_kv_groups(&cfg, &nodes[1], &hp, &g));
    /* several models: only a CUDA node of the node's own model counts */
    tdm_model_config_t models[2];
    memset(models, 0, sizeof models);
    models[0].name = "smol";
    models[1].name = "gemma";
    cfg.models = models;
    cfg.n_models = 2;
    nodes[0].model = "gemma";
    nodes[1].model = "smol";
    assert_true(tdm_node_kv_groups(&cfg, &nodes[0], &hp, &g));
    nodes[1].model = "gemma";
    assert_false(tdm_node_kv_groups(&cfg, &nodes[0], &hp, &g));
    nodes[0].model = nodes[1].model = NULL;
    cfg.models = NULL;
    cfg.n_models = 0;
    nodes[1].role = TDM_NODE_ROLE_DECODE;
    nodes[1].device.kind = TDM_NODE_DEVICE_CPU;
    nodes[0].device.kind = TDM_NODE_DEVICE_CUDA; /* a CUDA decode node beside a CPU one */
    assert_false(tdm_node_kv_groups(&cfg, &nodes[0], &hp, &g));
    assert_false(tdm_node_kv_groups(&cfg, &nodes[1], &hp, &g));
    nodes[0].device.kind = TDM_NODE_DEVICE_CPU;
    assert_true(tdm_node_kv_groups(&cfg, &nodes[1], &hp, &g));
    hp.n_swa = 0; /* no windows */
    assert_false(tdm_node_kv_groups(&cfg, &nodes[1], &hp, &g));
}

/* device: cuda:0 in a build without CUDA is refused naming the build; with CUDA but no
 * usable GPU (this machine), refused with the CUDA runtime's error; neither loads a pool. */
static void test_runtime_cuda_refused(void **state)
{
    (void)state;
    char model[64];
    snprintf(model, sizeof model, "/tmp/tdm_test_node_cuda_%d.gguf", (int)getpid());
    tdm_tiny_llama_spec_t spec = {0};
    tdm_error_t err = {0};
    assert_int_equal(tdm_test_write_tiny_llama(model, &spec, &err), 0);
    char yaml[512];
    snprintf(yaml, sizeof yaml,
             "model: {path: '%s'}\n"
             "nodes:\n"
             "  - {id: p0, role: prefill, device: 'cuda:0', gpu_memory_utilization: 0.4}\n"
             "  - {id: d0, role: decode, kv_endpoint: 'tcp://127.0.0.1:7610'}\n",
             model);
    tdm_config_t cfg;
    if (tdm_config_load_string(yaml, strlen(yaml), "node.yaml", &cfg, &err) != 0)
        fail_msg("%s", err.msg);
    tdm_node_runtime_t rt;
    int n = 0;
    tdm_error_t derr = {0};
    bool have_gpu = tdm_device_cuda_count(&n, &derr) == TDM_OK && n > 0;
    if (!have_gpu) {
        int rc = tdm_node_runtime_open(&rt, &cfg, &cfg.nodes[0], TDM_WORKER_MODE_PREFILL, &err);
        if (!tdm_device_cuda_built()) {
            assert_int_equal(rc, TDM_EPRECONDITION);
            assert_non_null(strstr(err.msg, "this build has no CUDA backend"));
        } else {
            assert_true(rc == TDM_EUNAVAILABLE || rc == TDM_EINVALID);
            assert_non_null(strstr(err.msg, "node 'p0': device cuda:0: "));
        }
        assert_null(rt.pool);
    }
    tdm_config_free(&cfg);
    remove(model);
}

static void test_host_id(void **state)
{
    (void)state;
    char id[64];
    tdm_node_host_id(id, sizeof id);
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (!f) {
        assert_string_equal(id, "");
        return;
    }
    fclose(f);
    assert_int_equal(strlen(id), 36); /* a UUID without its newline */
    assert_int_equal(id[8], '-');
    char again[64];
    tdm_node_host_id(again, sizeof again);
    assert_string_equal(id, again);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flush_waits_for_the_router),
        cmocka_unit_test(test_flush_bounded),
        cmocka_unit_test(test_heartbeats_while_engine_busy),
        cmocka_unit_test(test_prefill_node_serves),
        cmocka_unit_test(test_node_status_names_model),
        cmocka_unit_test(test_prefill_node_resumes),
        cmocka_unit_test(test_prefill_node_embeds),
        cmocka_unit_test(test_node_spec_check),
        cmocka_unit_test(test_node_load_proto),
        cmocka_unit_test(test_node_constraint),
        cmocka_unit_test(test_size_pool_device),
        cmocka_unit_test(test_size_pool_refuses),
        cmocka_unit_test(test_size_pool_layer_groups),
        cmocka_unit_test(test_runtime_cuda_refused),
        cmocka_unit_test(test_host_id),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
