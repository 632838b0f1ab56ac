/* test_router.c - the router against fake prefill/decode nodes and a fake client, all in one
 * thread: the test drives tdm_router_poll while it waits for messages on its own DEALER
 * sockets (tcp://127.0.0.1 with ports the OS picks), so every interleaving is the test's.
 * The model is a tiny random-weight GGUF (tests/support/tiny_model.h): the router needs only
 * its tokenizer and metadata. Token ids the fake nodes "generate" are byte tokens, so the
 * expected text is known. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "admit.h"
#include "embed.h"
#include "heap.h"
#include "index.h"
#include "metrics.h"
#include "router.h"
#include "template_cache.h"
#include "tandem/list.h"
#include "tandem/config.h"
#include "tandem/constraint.h"
#include "tandem/model.h"
#include "tandem/net.h"
#include "tandem/prompt.h"
#include "tandem/tokenizer.h"
#include "tdm_test.h"
#include "tiny_model.h"

#define K_REQUEST TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST
#define K_STREAM TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM
#define K_END TANDEM__V1__FRAME_KIND__FRAME_KIND_END
#define K_CANCEL TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL
#define K_NOTIFY TANDEM__V1__FRAME_KIND__FRAME_KIND_NOTIFY
#define M(x) TANDEM__V1__METHOD__METHOD_##x
#define FIN(x) TANDEM__V1__FINISH_REASON__FINISH_REASON_##x

/* How long a test waits for something that must happen. Generous: CI runs on a busy 2-core
 * machine, and the waits end as soon as it happens. */
#define WAIT_MS 30000
#define N_CTX 256 /* the tiny model's context length */

/* ---- the environment: tiny model, config, router, client ---- */

typedef struct fake {
    const char *id;
    tdm_sock_t *s;
    const tdm_curve_keys_t *curve; /* NULL: plain TCP */
    uint64_t instance;             /* 0: FAKE_INSTANCE */
} fake_t;

#define FAKE_INSTANCE 42u

/* The attempt id the router gave each request id last (DecodeReserve, PrefillTask): fake
 * nodes answer with it, as real ones do. */
static struct {
    char id[TDM_REQUEST_ID_MAX + 1];
    uint64_t attempt;
} attempts[128];
static size_t n_attempts;

static void attempt_note(const char *id, uint64_t attempt)
{
    assert_true(attempt != 0);
    for (size_t i = 0; i < n_attempts; i++)
        if (strcmp(attempts[i].id, id) == 0) {
            attempts[i].attempt = attempt;
            return;
        }
    assert_true(n_attempts < sizeof attempts / sizeof attempts[0]);
    snprintf(attempts[n_attempts].id, sizeof attempts[0].id, "%s", id);
    attempts[n_attempts++].attempt = attempt;
}

static uint64_t attempt_for(const char *id)
{
    for (size_t i = 0; i < n_attempts; i++)
        if (strcmp(attempts[i].id, id) == 0)
            return attempts[i].attempt;
    return 0;
}

typedef struct env {
    char dir[64];
    char model_path[128];
    tdm_config_t cfg;
    tdm_net_t *net;
    tdm_logger_t log;
    tdm_router_t *r;
    tdm_sock_t *client;
    uint64_t next_call;
    uint32_t hb_timeout_ms; /* what RegisterAck must say */
    tdm_model_t *model;
    tdm_tokenizer_t *tok;
    fake_t p0, p1, d0, d1;
} env_t;

/* The nodes: list of the next env_new_with when set (test_curve gives them keys). */
static const char *env_nodes_yaml;
/* When set, the next env_new_with serves this model file (the test writes and removes it)
 * instead of writing the default tiny model, with env_model_yaml under model:. */
static const char *env_model_file;
static const char *env_model_yaml;
/* When set, the next env_new_with serves a models: list: the tiny model (name tiny), then
 * these entries. */
static const char *env_more_models;

/* A router over the tiny model with four configured nodes; router_yaml goes under router:,
 * extra_yaml at the top level. */
static env_t *env_new_with(const char *router_yaml, const char *extra_yaml)
{
    env_t *e = calloc(1, sizeof *e);
    assert_non_null(e);
    snprintf(e->dir, sizeof e->dir, "/tmp/tdm_router_XXXXXX");
    assert_non_null(mkdtemp(e->dir));
    snprintf(e->model_path, sizeof e->model_path, "%s/tiny.gguf", e->dir);
    tdm_error_t err = {0};
    tdm_tiny_llama_spec_t spec = {.n_vocab = 512, .n_ctx = N_CTX, .seed = 7};
    if (env_model_file)
        snprintf(e->model_path, sizeof e->model_path, "%s", env_model_file);
    else
        assert_int_equal(tdm_test_write_tiny_llama(e->model_path, &spec, &err), 0);
    char yaml[4096], models[1024];
    if (env_more_models)
        snprintf(models, sizeof models, "models:\n  - path: %s\n    name: tiny\n%s", e->model_path,
                 env_more_models);
    else
        snprintf(models, sizeof models, "model:\n  path: %s\n  name: tiny\n%s", e->model_path,
                 env_model_yaml ? env_model_yaml : "");
    snprintf(yaml, sizeof yaml,
             "%s"
             "router:\n%s"
             "%s"
             "kv:\n  block_size: 16\n"
             "nodes:\n%s",
             models, router_yaml ? router_yaml : "  max_queue: 16\n", extra_yaml ? extra_yaml : "",
             env_nodes_yaml ? env_nodes_yaml
                            : "  - {id: prefill-0, role: prefill}\n"
                              "  - {id: prefill-1, role: prefill}\n"
                              "  - {id: decode-0, role: decode}\n"
                              "  - {id: decode-1, role: decode}\n");
    int rc = tdm_config_load_string(yaml, strlen(yaml), "test.yaml", &e->cfg, &err);
    if (rc != 0)
        fail_msg("config: %s", err.msg);
    /* the OS picks the ports */
    free(e->cfg.router.client_endpoint);
    free(e->cfg.router.node_endpoint);
    e->cfg.router.client_endpoint = tdm_strdup("tcp://127.0.0.1:*");
    e->cfg.router.node_endpoint = tdm_strdup("tcp://127.0.0.1:*");
    tdm_log_init(&e->log, "router");
    const char *lv = getenv("TDM_TEST_LOG");
    e->log.level = lv ? (tdm_log_level_t)tdm_log_level_parse(lv) : TDM_LOG_OFF;
    e->net = tdm_net_new(1, &err);
    assert_non_null(e->net);
    e->r = tdm_router_new(&e->cfg, e->net, &e->log, &err);
    if (!e->r)
        fail_msg("router: %s", err.msg);
    e->hb_timeout_ms = 60000; /* fake nodes heartbeat only when a test says */
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    tdm_sock_opts_t o = {0};
    o.log = &e->log;
    e->client = tdm_sock_connect(e->net, tdm_router_client_endpoint(e->r), &o, &err);
    assert_non_null(e->client);
    e->model = tdm_model_load(e->model_path, &err);
    assert_non_null(e->model);
    e->tok = tdm_tokenizer_new(tdm_model_gguf(e->model), &err);
    assert_non_null(e->tok);
    e->next_call = 100;
    e->p0.id = "prefill-0";
    e->p1.id = "prefill-1";
    e->d0.id = "decode-0";
    e->d1.id = "decode-1";
    return e;
}

static env_t *env_new(const char *router_yaml)
{
    return env_new_with(router_yaml, NULL);
}

static void env_free(env_t *e)
{
    fake_t *fakes[] = {&e->p0, &e->p1, &e->d0, &e->d1};
    for (size_t i = 0; i < 4; i++)
        tdm_sock_destroy(&fakes[i]->s);
    tdm_sock_destroy(&e->client);
    tdm_router_destroy(&e->r);
    tdm_net_destroy(&e->net);
    tdm_tokenizer_destroy(&e->tok);
    tdm_model_destroy(&e->model);
    tdm_config_free(&e->cfg);
    if (strncmp(e->model_path, e->dir, strlen(e->dir)) == 0)
        unlink(e->model_path); /* the default model env_new_with wrote */
    rmdir(e->dir);
    free(e);
}

/* Runs the router for about ms milliseconds. */
static void pump(env_t *e, int ms)
{
    double end = tdm_time_now() + ms / 1000.0;
    while (tdm_time_now() < end)
        tdm_router_poll(e->r, 2);
}

/* Runs the router until s has a message; false after ms milliseconds. */
static bool recv_on(env_t *e, tdm_sock_t *s, tdm_frame_t *f, int ms)
{
    double end = tdm_time_now() + ms / 1000.0;
    for (;;) {
        if (tdm_sock_recv(s, f, 0) == TDM_OK)
            return true;
        if (tdm_time_now() > end)
            return false;
        tdm_router_poll(e->r, 2);
    }
}

/* Asserts nothing arrives on s for ms milliseconds (the router runs meanwhile). */
static void expect_none(env_t *e, tdm_sock_t *s, int ms)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (recv_on(e, s, &f, ms))
        fail_msg("unexpected %s %s frame", tdm_net_kind_name(f.kind),
                 tdm_net_method_name(f.method));
    tdm_frame_clear(&f);
}

/* Runs the router until it has n requests queued (they were received and wait for a node);
 * fails after WAIT_MS. */
static void pump_until_queued(env_t *e, size_t n)
{
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    while (tdm_router_n_queued(e->r) != n) {
        if (tdm_time_now() > end)
            fail_msg("%zu requests queued, expected %zu", tdm_router_n_queued(e->r), n);
        tdm_router_poll(e->r, 2);
    }
}

/* Runs the router until node id is down (its heartbeats stopped); fails after WAIT_MS. */
static void pump_until_down(env_t *e, const char *id)
{
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    while (tdm_router_node_up(e->r, id)) {
        if (tdm_time_now() > end)
            fail_msg("node %s still up", id);
        tdm_router_poll(e->r, 2);
    }
}

/* ---- fake nodes ---- */

static void fake_connect(env_t *e, fake_t *n)
{
    tdm_error_t err = {0};
    tdm_sock_opts_t o = {0};
    char identity[96];
    /* an instance of its own has a routing id of its own, as real nodes do */
    snprintf(identity, sizeof identity, "%s.%" PRIu64, n->id, n->instance ? n->instance : 0);
    o.identity = identity;
    o.log = &e->log;
    o.curve = n->curve;
    o.instance_id = n->instance ? n->instance : FAKE_INSTANCE;
    n->s = tdm_sock_connect(e->net, tdm_router_node_endpoint(e->r), &o, &err);
    assert_non_null(n->s);
}

typedef struct reg {
    Tandem__V1__RegisterRequest m;
    Tandem__V1__KvLayout layout;
} reg_t;

static void reg_default(env_t *e, const fake_t *n, reg_t *g)
{
    const tdm_llama_hparams_t *hp = tdm_model_hparams(e->model);
    tandem__v1__register_request__init(&g->m);
    tandem__v1__kv_layout__init(&g->layout);
    g->layout.n_layers = hp->n_layers;
    g->layout.n_kv_heads = hp->n_kv_heads;
    g->layout.head_dim = hp->head_dim;
    g->layout.block_size = 16;
    g->layout.dtype = TANDEM__V1__KV_DTYPE__KV_DTYPE_F16;
    g->m.node_id = (char *)n->id;
    g->m.role = strncmp(n->id, "decode", 6) == 0 ? TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE
                                                 : TANDEM__V1__NODE_ROLE__NODE_ROLE_PREFILL;
    g->m.version = (char *)TANDEM_VERSION;
    g->m.model_fingerprint = tdm_router_fingerprint(e->r);
    g->m.kv_layout = &g->layout;
    g->m.kv_blocks_total = 100;
    g->m.kv_endpoint = g->m.role == TANDEM__V1__NODE_ROLE__NODE_ROLE_DECODE
                           ? (char *)"tcp://127.0.0.1:9999"
                           : (char *)"";
    g->m.device = (char *)"cpu";
    g->m.max_running = 8;
    g->m.max_batch_tokens = 512;
    g->m.n_ctx = 4096;
    g->m.instance_id = n->instance ? n->instance : FAKE_INSTANCE;
}

/* Sends the registration; returns the END status and copies its message. */
static int fake_register_with(env_t *e, fake_t *n, reg_t *g, char *msg, size_t cap)
{
    if (!n->s)
        fake_connect(e, n);
    uint64_t call = e->next_call++;
    tdm_send_t s = {0};
    s.kind = K_REQUEST;
    s.method = M(REGISTER);
    s.call_id = call;
    s.body = &g->m.base;
    assert_int_equal(tdm_sock_send(n->s, &s), 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, n->s, &f, WAIT_MS));
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.call_id, call);
    int st = f.status;
    if (msg)
        snprintf(msg, cap, "%s", f.message);
    if (st == 0) {
        Tandem__V1__RegisterAck *ack =
            (Tandem__V1__RegisterAck *)tdm_frame_unpack(&f, &tandem__v1__register_ack__descriptor);
        assert_non_null(ack);
        assert_int_equal(ack->heartbeat_interval_ms, 250);
        assert_int_equal(ack->heartbeat_timeout_ms, e->hb_timeout_ms);
        protobuf_c_message_free_unpacked(&ack->base, NULL);
    }
    tdm_frame_clear(&f);
    return st;
}

static void fake_register(env_t *e, fake_t *n)
{
    reg_t g;
    reg_default(e, n, &g);
    char msg[512];
    int st = fake_register_with(e, n, &g, msg, sizeof msg);
    if (st != 0)
        fail_msg("register %s: %s", n->id, msg);
    assert_true(tdm_router_node_up(e->r, n->id));
}

/* A heartbeat as a NOTIFY (no reply, so the fake's socket carries only the router's own
 * messages); the REQUEST form is tested on its own. */
static void fake_heartbeat(env_t *e, fake_t *n, uint32_t free_blocks, uint64_t queued)
{
    Tandem__V1__Heartbeat h = TANDEM__V1__HEARTBEAT__INIT;
    Tandem__V1__NodeLoad ld = TANDEM__V1__NODE_LOAD__INIT;
    h.load = &ld;
    h.node_id = (char *)n->id;
    ld.kv_blocks_free = free_blocks;
    ld.kv_blocks_used = 100 - free_blocks;
    ld.queued_prefill_tokens = queued;
    ld.running = 1;
    h.instance_id = n->instance ? n->instance : FAKE_INSTANCE;
    ld.step_s = 0.02;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(HEARTBEAT), &h.base), 0);
}

/* Waits until the router has handled everything n sent so far: a request it answers (one the
 * node endpoint does not serve), behind them on the same connection, is answered. Nothing
 * else may arrive for n meanwhile. */
static void fake_sync(env_t *e, fake_t *n)
{
    uint64_t call = e->next_call++;
    tdm_send_t s = {0};
    s.kind = K_REQUEST;
    s.method = M(HEALTH);
    s.call_id = call;
    assert_int_equal(tdm_sock_send(n->s, &s), 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (!recv_on(e, n->s, &f, WAIT_MS))
        fail_msg("%s: the router did not answer within %d ms", n->id, WAIT_MS);
    if (f.kind != K_END || f.call_id != call)
        fail_msg("%s: unexpected %s %s frame", n->id, tdm_net_kind_name(f.kind),
                 tdm_net_method_name(f.method));
    tdm_frame_clear(&f);
}

static void fake_token(fake_t *n, const char *req, uint32_t index, int32_t token)
{
    Tandem__V1__TokenEvent ev = TANDEM__V1__TOKEN_EVENT__INIT;
    ev.request_id = (char *)req;
    ev.attempt_id = attempt_for(req);
    ev.index = index;
    ev.token_id = token;
    ev.logprob = -0.5f - (float)index;
    Tandem__V1__TopLogprob t0 = TANDEM__V1__TOP_LOGPROB__INIT, t1 = TANDEM__V1__TOP_LOGPROB__INIT;
    t0.token_id = token;
    t0.logprob = ev.logprob;
    t1.token_id = (int32_t)tdm_test_tiny_byte_token('z');
    t1.logprob = -3.0f;
    Tandem__V1__TopLogprob *top[2] = {&t0, &t1};
    ev.n_top = 2;
    ev.top = top;
    if (index == 0) {
        ev.cached_prompt_tokens = 3;
        ev.prefill_s = 0.0125;
    }
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(TOKEN_EVENT), &ev.base), 0);
}

static void fake_finished(fake_t *n, const char *req, int reason, uint32_t completion)
{
    Tandem__V1__Finished fin = TANDEM__V1__FINISHED__INIT;
    fin.request_id = (char *)req;
    fin.attempt_id = attempt_for(req);
    fin.reason = (Tandem__V1__FinishReason)reason;
    fin.completion_tokens = completion;
    fin.kv_transfer_s = 0.0025;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(FINISHED), &fin.base), 0);
}

static void fake_task_failed(fake_t *n, const char *req, int code, const char *msg, bool retryable)
{
    Tandem__V1__TaskFailed tf = TANDEM__V1__TASK_FAILED__INIT;
    tf.request_id = (char *)req;
    tf.attempt_id = attempt_for(req);
    tf.status = code;
    tf.message = (char *)msg;
    tf.retryable = retryable;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(TASK_FAILED), &tf.base), 0);
}

/* Waits for a DecodeReserve on n; *f keeps the frame for the reply. Caller frees the result
 * and clears f. */
static Tandem__V1__DecodeReserve *expect_reserve(env_t *e, fake_t *n, tdm_frame_t *f)
{
    if (!recv_on(e, n->s, f, WAIT_MS))
        fail_msg("%s: no DecodeReserve", n->id);
    assert_int_equal(f->kind, K_REQUEST);
    assert_int_equal(f->method, M(DECODE_RESERVE));
    Tandem__V1__DecodeReserve *m =
        (Tandem__V1__DecodeReserve *)tdm_frame_unpack(f, &tandem__v1__decode_reserve__descriptor);
    assert_non_null(m);
    assert_int_equal(f->instance_id, tdm_router_instance(e->r));
    attempt_note(m->spec->request_id, m->spec->attempt_id);
    return m;
}

/* expect_reserve for request req: reservations of other requests on n are left unanswered. */
static Tandem__V1__DecodeReserve *expect_reserve_for(env_t *e, fake_t *n, tdm_frame_t *f,
                                                     const char *req)
{
    for (;;) {
        Tandem__V1__DecodeReserve *m = expect_reserve(e, n, f);
        if (strcmp(m->spec->request_id, req) == 0)
            return m;
        protobuf_c_message_free_unpacked(&m->base, NULL);
        tdm_frame_clear(f);
    }
}

static void reply_ack(fake_t *n, const tdm_frame_t *f, const char *req, uint32_t blocks)
{
    Tandem__V1__ReserveAck ack = TANDEM__V1__RESERVE_ACK__INIT;
    ack.request_id = (char *)req;
    ack.attempt_id = attempt_for(req);
    ack.n_blocks = blocks;
    assert_int_equal(tdm_sock_reply(n->s, f, &ack.base), 0);
}

/* Reserve on d acknowledged; returns the reserve (caller frees). */
static Tandem__V1__DecodeReserve *reserve_and_ack(env_t *e, fake_t *d)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *m = expect_reserve(e, d, &f);
    reply_ack(d, &f, m->spec->request_id, 1);
    tdm_frame_clear(&f);
    /* the PrefillTask went with the reservation: the ack is handled before what the test
     * sends next from another node (the router reads its peers in no set order) */
    fake_sync(e, d);
    return m;
}

/* The next PrefillTask on p of the attempt its request's last DecodeReserve noted. The
 * PrefillTask goes with the DecodeReserve, so a reservation that was refused or timed out
 * left p a task of its attempt and that attempt's NodeCancel: skipped (*n_withdrawn counts
 * the tasks skipped, when not NULL). */
static Tandem__V1__PrefillTask *expect_current_task(env_t *e, fake_t *p, int *n_withdrawn)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    for (;;) {
        if (!recv_on(e, p->s, &f, WAIT_MS))
            fail_msg("%s: no PrefillTask", p->id);
        assert_int_equal(f.kind, K_NOTIFY);
        if (f.method == M(NODE_CANCEL)) {
            tdm_frame_clear(&f);
            continue;
        }
        assert_int_equal(f.method, M(PREFILL_TASK));
        Tandem__V1__PrefillTask *t =
            (Tandem__V1__PrefillTask *)tdm_frame_unpack(&f, &tandem__v1__prefill_task__descriptor);
        assert_non_null(t);
        tdm_frame_clear(&f);
        uint64_t want = attempt_for(t->spec->request_id);
        if (want == 0 || t->spec->attempt_id == want) {
            attempt_note(t->spec->request_id, t->spec->attempt_id);
            return t;
        }
        if (n_withdrawn)
            (*n_withdrawn)++;
        protobuf_c_message_free_unpacked(&t->base, NULL);
    }
}

static Tandem__V1__PrefillTask *expect_task(env_t *e, fake_t *p)
{
    return expect_current_task(e, p, NULL);
}

/* Which of a or b receives the next PrefillTask (the other gets nothing). */
static fake_t *expect_task_on_one(env_t *e, fake_t *a, fake_t *b, const char *req)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    fake_t *got = NULL;
    while (!got && tdm_time_now() < end) {
        if (tdm_sock_recv(a->s, &f, 0) == TDM_OK)
            got = a;
        else if (tdm_sock_recv(b->s, &f, 0) == TDM_OK)
            got = b;
        else
            tdm_router_poll(e->r, 2);
    }
    assert_non_null(got);
    assert_int_equal(f.method, M(PREFILL_TASK));
    Tandem__V1__PrefillTask *t =
        (Tandem__V1__PrefillTask *)tdm_frame_unpack(&f, &tandem__v1__prefill_task__descriptor);
    assert_non_null(t);
    assert_string_equal(t->spec->request_id, req);
    attempt_note(t->spec->request_id, t->spec->attempt_id);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_frame_clear(&f);
    return got;
}

static void expect_cancel(env_t *e, fake_t *n, const char *req, int code)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (!recv_on(e, n->s, &f, WAIT_MS))
        fail_msg("%s: no NodeCancel for %s", n->id, req);
    assert_int_equal(f.kind, K_NOTIFY);
    assert_int_equal(f.method, M(NODE_CANCEL));
    Tandem__V1__NodeCancel *c =
        (Tandem__V1__NodeCancel *)tdm_frame_unpack(&f, &tandem__v1__node_cancel__descriptor);
    assert_non_null(c);
    assert_string_equal(c->request_id, req);
    assert_int_equal(c->status, code);
    protobuf_c_message_free_unpacked(&c->base, NULL);
    tdm_frame_clear(&f);
}

/* ---- the fake client ---- */

static uint64_t send_req(env_t *e, int method, const ProtobufCMessage *body, const char *key,
                         uint64_t deadline_ms)
{
    uint64_t call = e->next_call++;
    tdm_send_t s = {0};
    s.kind = K_REQUEST;
    s.method = method;
    s.call_id = call;
    s.api_key = key;
    s.deadline_unix_ms = deadline_ms;
    s.body = body;
    assert_int_equal(tdm_sock_send(e->client, &s), 0);
    return call;
}

static uint64_t generate(env_t *e, Tandem__V1__GenerateRequest *g)
{
    return send_req(e, M(GENERATE), &g->base, NULL, 0);
}

static void prompt_req(Tandem__V1__GenerateRequest *g, const char *id, const char *prompt,
                       int max_tokens, bool stream)
{
    tandem__v1__generate_request__init(g);
    g->request_id = (char *)id;
    g->input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT;
    g->prompt = (char *)prompt;
    g->max_tokens = max_tokens;
    g->stream = stream;
}

/* Waits for END of call with status; checks its message contains `has`. */
static void expect_end(env_t *e, uint64_t call, int status, const char *has)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (!recv_on(e, e->client, &f, WAIT_MS))
        fail_msg("no END for call %" PRIu64 " (want %s '%s')", call, tdm_status_name(status), has);
    if (f.kind != K_END || f.call_id != call || f.status != status ||
        (has && !strstr(f.message, has)))
        fail_msg("got %s call %" PRIu64 " status %s '%s'; want END call %" PRIu64
                 " status %s containing '%s'",
                 tdm_net_kind_name(f.kind), f.call_id, tdm_status_name(f.status), f.message, call,
                 tdm_status_name(status), has ? has : "");
    tdm_frame_clear(&f);
}

/* What a GENERATE call produced. */
typedef struct result {
    int status;
    char message[512];
    int n_chunks;       /* STREAM frames (stream) or 1 (END body) */
    uint32_t first_n;   /* tokens in the first chunk */
    uint32_t index[64]; /* each chunk's index */
    int32_t ids[512];
    size_t n_ids;
    char text[4096];
    char token_texts[4096]; /* echo_token_text joined with '|' */
    float logprobs[512];
    size_t n_logprobs;
    size_t n_top_first; /* top logprobs of the first token */
    char top_text_first[64];
    int finish;
    char stop_reason[300];
    Tandem__V1__Usage usage;
    Tandem__V1__Timings timings;
} result_t;

static void add_chunk(result_t *res, const Tandem__V1__GenerateChunk *c)
{
    if (res->n_chunks < 64)
        res->index[res->n_chunks] = c->index;
    if (res->n_chunks == 0)
        res->first_n = (uint32_t)c->n_token_ids;
    res->n_chunks++;
    for (size_t i = 0; i < c->n_token_ids && res->n_ids < 512; i++)
        res->ids[res->n_ids++] = c->token_ids[i];
    strncat(res->text, c->text, sizeof res->text - strlen(res->text) - 1);
    for (size_t i = 0; i < c->n_token_texts; i++) {
        strncat(res->token_texts, c->token_texts[i],
                sizeof res->token_texts - strlen(res->token_texts) - 1);
        strncat(res->token_texts, "|", sizeof res->token_texts - strlen(res->token_texts) - 1);
    }
    for (size_t i = 0; i < c->n_logprobs && res->n_logprobs < 512; i++)
        res->logprobs[res->n_logprobs++] = c->logprobs[i];
    if (c->n_top_logprobs && res->n_top_first == 0) {
        res->n_top_first = c->top_logprobs[0]->n_entries;
        snprintf(res->top_text_first, sizeof res->top_text_first, "%s",
                 c->top_logprobs[0]->entries[1]->text);
    }
    if (c->finish_reason) {
        res->finish = c->finish_reason;
        snprintf(res->stop_reason, sizeof res->stop_reason, "%s", c->stop_reason);
        if (c->usage)
            res->usage = *c->usage;
        if (c->timings)
            res->timings = *c->timings;
    }
}

/* Collects STREAM chunks of call until its END (the router runs meanwhile). */
static void collect(env_t *e, uint64_t call, result_t *res)
{
    memset(res, 0, sizeof *res);
    tdm_frame_t f;
    tdm_frame_init(&f);
    for (;;) {
        if (!recv_on(e, e->client, &f, WAIT_MS))
            fail_msg("call %" PRIu64 ": no END", call);
        assert_int_equal(f.call_id, call);
        if (f.kind == K_STREAM || (f.kind == K_END && f.body_len > 0)) {
            Tandem__V1__GenerateChunk *c = (Tandem__V1__GenerateChunk *)tdm_frame_unpack(
                &f, &tandem__v1__generate_chunk__descriptor);
            assert_non_null(c);
            add_chunk(res, c);
            protobuf_c_message_free_unpacked(&c->base, NULL);
        }
        if (f.kind == K_END) {
            res->status = f.status;
            snprintf(res->message, sizeof res->message, "%s", f.message);
            break;
        }
        assert_int_equal(f.kind, K_STREAM);
    }
    tdm_frame_clear(&f);
}

/* Receives exactly one STREAM chunk of call. */
static void one_chunk(env_t *e, uint64_t call, result_t *res)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.kind, K_STREAM);
    Tandem__V1__GenerateChunk *c =
        (Tandem__V1__GenerateChunk *)tdm_frame_unpack(&f, &tandem__v1__generate_chunk__descriptor);
    assert_non_null(c);
    add_chunk(res, c);
    protobuf_c_message_free_unpacked(&c->base, NULL);
    tdm_frame_clear(&f);
}

static int32_t B(char c)
{
    return (int32_t)tdm_test_tiny_byte_token((uint8_t)c);
}
static int32_t eos(void)
{
    return 511;
} /* <|im_end|> of the 512-token tiny vocabulary */

/* ---- tests ---- */

/* Index 1 arrives before index 0 and duplicates arrive: the client sees each token once, in
 * order; Finished ends the stream with usage and timings. */
static void test_stream_in_order(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-order", "hello world", 8, true);
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    sp.n_logprobs = 2;
    sp.set_mask = 1u << 12;
    g.sampling = &sp;
    g.echo_token_text = true;
    uint64_t call = generate(e, &g);

    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    assert_string_equal(rs->spec->request_id, "r-order");
    int32_t *ids = NULL;
    size_t n = 0;
    assert_int_equal(tdm_tokenizer_encode(e->tok, "hello world", 11, false, true, &ids, &n, NULL),
                     0);
    assert_int_equal(rs->spec->n_prompt_tokens, n);
    assert_memory_equal(rs->spec->prompt_tokens, ids, n * sizeof *ids);
    free(ids);
    assert_false(rs->local_prefill);
    assert_int_equal(rs->spec->max_tokens, 8);
    assert_true(rs->spec->sampling->has_seed); /* the router drew one */
    assert_int_equal(rs->spec->sampling->set_mask, 0xffffffffu);
    assert_float_equal(rs->spec->sampling->temperature, 1.0, 1e-6);
    assert_int_equal(rs->spec->sampling->n_logprobs, 2);
    assert_true(rs->spec->deadline_unix_ms > tdm_net_now_ms());
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_string_equal(t->spec->request_id, "r-order");
    assert_string_equal(t->decode_node_id, "decode-0");
    assert_string_equal(t->decode_kv_endpoint, "tcp://127.0.0.1:9999");
    assert_int_equal(t->spec->sampling->seed, rs->spec->sampling->seed);
    assert_int_equal(t->spec->n_prompt_tokens, rs->spec->n_prompt_tokens);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    protobuf_c_message_free_unpacked(&rs->base, NULL);

    fake_token(&e->d0, "r-order", 1, B('i'));
    expect_none(e, e->client, 100); /* index 1 waits for index 0 */
    fake_token(&e->p0, "r-order", 0, B('H'));
    result_t res;
    memset(&res, 0, sizeof res);
    one_chunk(e, call, &res);
    assert_int_equal(res.first_n, 2); /* one chunk with 0 and 1 */
    assert_int_equal(res.index[0], 0);
    assert_string_equal(res.text, "Hi");
    fake_token(&e->d0, "r-order", 1, B('i')); /* duplicates */
    fake_token(&e->p0, "r-order", 0, B('H'));
    expect_none(e, e->client, 100); /* both dropped */
    fake_token(&e->d0, "r-order", 2, B('!'));
    fake_token(&e->d0, "r-order", 3, eos());
    fake_finished(&e->d0, "r-order", FIN(STOP), 4);
    result_t rest;
    collect(e, call, &rest);
    assert_int_equal(rest.status, 0);
    assert_int_equal(rest.index[0], 2);
    assert_string_equal(rest.text, "!"); /* EOS renders as nothing */
    assert_int_equal(rest.n_ids, 2);
    assert_int_equal(rest.ids[0], B('!'));
    assert_int_equal(rest.ids[1], eos());
    assert_int_equal(rest.finish, FIN(STOP));
    assert_int_equal(rest.usage.prompt_tokens, n);
    assert_int_equal(rest.usage.completion_tokens, 4);
    assert_int_equal(rest.usage.cached_prompt_tokens, 3);
    assert_float_equal(rest.timings.prefill_s, 0.0125, 1e-9);
    assert_float_equal(rest.timings.kv_transfer_s, 0.0025, 1e-9);
    assert_true(rest.timings.ttft_s > 0);
    assert_true(rest.timings.e2e_s >= rest.timings.ttft_s);
    assert_true(rest.timings.queue_s >= 0 && rest.timings.queue_s <= rest.timings.ttft_s);
    assert_float_equal(rest.timings.tpot_s, rest.timings.decode_s / 3, 1e-9);
    /* logprobs and token texts came with the tokens */
    assert_int_equal(res.n_logprobs, 2);
    assert_float_equal(res.logprobs[0], -0.5, 1e-6);
    assert_float_equal(res.logprobs[1], -1.5, 1e-6);
    assert_int_equal(res.n_top_first, 2);
    assert_string_equal(res.top_text_first, "z");
    assert_string_equal(res.token_texts, "H|i|");
    assert_string_equal(rest.token_texts, "!|<|im_end|>|");
    const tdm_router_metrics_t *mt = tdm_router_metrics(e->r);
    assert_int_equal(mt->duplicate_events, 2);
    assert_int_equal(mt->requests_by_status[0], 1);
    assert_int_equal(mt->requests_by_finish[FIN(STOP)], 1);
    assert_int_equal(mt->generation_tokens, 4);
    assert_int_equal(mt->ttft.count, 1);
    assert_int_equal(mt->itl.count, 3);
    assert_int_equal(tdm_router_n_running(e->r), 0);
    env_free(e);
}

/* stream=false: one END OK whose body holds everything. */
static void test_no_stream(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-unary", "abc", 3, false);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-unary", 0, B('o'));
    fake_token(&e->d0, "r-unary", 1, B('k'));
    expect_none(e, e->client, 50); /* nothing until the end */
    fake_token(&e->d0, "r-unary", 2, B('.'));
    fake_finished(&e->d0, "r-unary", FIN(LENGTH), 3);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_int_equal(res.n_chunks, 1);
    assert_string_equal(res.text, "ok.");
    assert_int_equal(res.n_ids, 3);
    assert_int_equal(res.finish, FIN(LENGTH));
    assert_int_equal(res.usage.completion_tokens, 3);
    assert_int_equal(res.n_logprobs, 0); /* not asked for */
    env_free(e);
}

/* A stop string: text held back while it could be one, cut on the match, NodeCancel sent. */
static void run_stop(bool include)
{
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-stop", "say hello", 20, true);
    char *stops[2] = {(char *)"lo w", (char *)"never"};
    g.n_stop = 2;
    g.stop = stops;
    g.include_stop_str = include;
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    const char *out = "Hello world";
    result_t res;
    memset(&res, 0, sizeof res);
    fake_token(&e->p0, "r-stop", 0, B(out[0]));
    one_chunk(e, call, &res);
    assert_string_equal(res.text, "H");
    for (uint32_t i = 1; i < 4; i++) { /* "ell": the second 'l' may start "lo w" */
        fake_token(&e->d0, "r-stop", i, B(out[i]));
        one_chunk(e, call, &res);
    }
    assert_string_equal(res.text, "Hel");
    fake_token(&e->d0, "r-stop", 4, B('o')); /* "lo" held */
    one_chunk(e, call, &res);
    assert_string_equal(res.text, "Hel");
    fake_token(&e->d0, "r-stop", 5, B(' ')); /* "lo " held */
    one_chunk(e, call, &res);
    assert_string_equal(res.text, "Hel");
    fake_token(&e->d0, "r-stop", 6, B('w')); /* match */
    fake_token(&e->d0, "r-stop", 7, B('o')); /* ignored afterwards */
    result_t fin;
    collect(e, call, &fin);
    assert_int_equal(fin.status, 0);
    assert_int_equal(fin.finish, FIN(STOP));
    assert_string_equal(fin.stop_reason, "lo w");
    strcat(res.text, fin.text);
    assert_string_equal(res.text, include ? "Hello w" : "Hel");
    assert_int_equal(fin.usage.completion_tokens, 7);
    expect_cancel(e, &e->d0, "r-stop", 1);
    expect_cancel(e, &e->p0, "r-stop", 1);
    expect_none(e, e->client, 50);
    env_free(e);
}

static void test_stop_string(void **state)
{
    (void)state;
    run_stop(false);
    run_stop(true);
}

/* Client CANCEL: NodeCancel to both nodes, nothing more to the client. */
static void test_cancel(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-cancel", "abc", 10, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_send_t c = {0};
    c.kind = K_CANCEL;
    c.method = M(GENERATE);
    c.call_id = call;
    assert_int_equal(tdm_sock_send(e->client, &c), 0);
    expect_cancel(e, &e->p0, "r-cancel", 1);
    expect_cancel(e, &e->d0, "r-cancel", 1);
    fake_token(&e->p0, "r-cancel", 0, B('x')); /* late event: dropped */
    expect_none(e, e->client, 100);
    assert_int_equal(tdm_router_n_running(e->r), 0);
    assert_int_equal(tdm_router_metrics(e->r)->requests_by_status[1], 1);
    env_free(e);
}

/* A cancel between the reservation and the KV transfer: the prefill runs (its task went with
 * the DecodeReserve) and the reservation is unanswered. Both nodes get NodeCancel; the late
 * ReserveAck changes nothing (no new NodeCancel is owed: the request's went already), and the
 * router's room accounting counts the acknowledged blocks until the node's next heartbeat. */
static void test_cancel_while_reserving(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-cancel-rsv", "abc", 10, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_send_t c = {0};
    c.kind = K_CANCEL;
    c.method = M(GENERATE);
    c.call_id = call;
    assert_int_equal(tdm_sock_send(e->client, &c), 0);
    expect_cancel(e, &e->p0, "r-cancel-rsv", 1);
    expect_cancel(e, &e->d0, "r-cancel-rsv", 1);
    reply_ack(&e->d0, &f, "r-cancel-rsv", 1); /* the answer comes after all */
    tdm_frame_clear(&f);
    fake_token(&e->p0, "r-cancel-rsv", 0, B('x')); /* late event: dropped */
    fake_sync(e, &e->d0);
    fake_sync(e, &e->p0);
    expect_none(e, e->client, 100);
    expect_none(e, e->d0.s, 100);
    assert_int_equal(tdm_router_n_running(e->r), 0);
    assert_int_equal(tdm_router_metrics(e->r)->requests_by_status[1], 1);
    env_free(e);
}

/* The deadline passes while the request runs: DEADLINE_EXCEEDED and NodeCancel. */
static void test_deadline(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-late", "abc", 10, true);
    uint64_t call = send_req(e, M(GENERATE), &g.base, NULL, tdm_net_now_ms() + 300);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    assert_true(rs->spec->deadline_unix_ms > 0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    expect_end(e, call, TDM_EDEADLINE, "deadline exceeded");
    expect_cancel(e, &e->p0, "r-late", 4);
    expect_cancel(e, &e->d0, "r-late", 4);
    /* and one queued when it expires (no decode node) */
    env_free(e);
    e = env_new(NULL);
    prompt_req(&g, "r-late2", "abc", 10, true);
    /* long enough for a busy machine to receive it before it expires */
    call = send_req(e, M(GENERATE), &g.base, NULL, tdm_net_now_ms() + 1000);
    pump_until_queued(e, 1);
    expect_end(e, call, TDM_EDEADLINE, "queued");
    assert_int_equal(tdm_router_n_queued(e->r), 0);
    env_free(e);
}

static void bad(env_t *e, Tandem__V1__GenerateRequest *g, int status, const char *has)
{
    uint64_t call = generate(e, g);
    expect_end(e, call, status, has);
}

/* Every invalid field gets INVALID_ARGUMENT (or NOT_FOUND) naming it, and the router keeps
 * serving. */
static void test_validation(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    Tandem__V1__GenerateRequest g;
    tandem__v1__generate_request__init(&g);
    g.max_tokens = 4;
    bad(e, &g, TDM_EINVALID, "input");
    prompt_req(&g, NULL, "", 4, true);
    g.request_id = (char *)"";
    bad(e, &g, TDM_EINVALID, "prompt is empty");
    char longp[2200] = "";
    for (int i = 0; i < 300; i++)
        strcat(longp, "q ");
    prompt_req(&g, "", longp, 4, true);
    bad(e, &g, TDM_EINVALID, "; the context is 256 tokens (prompt + max_tokens must fit)");
    prompt_req(&g, "", "hello", -1, true);
    bad(e, &g, TDM_EINVALID, "max_tokens must be >= 1");
    prompt_req(&g, "", "hello", -5, true);
    bad(e, &g, TDM_EINVALID, "max_tokens must be >= 1 (or 0: what fits), got -5");
    prompt_req(&g, "", "hello", 1000, true);
    bad(e, &g, TDM_EINVALID, "max_tokens: prompt (");
    prompt_req(&g, "", "\xff\xfe", 4, true);
    bad(e, &g, TDM_EINVALID, "prompt is not valid UTF-8");

    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    prompt_req(&g, "", "hello", 4, true);
    g.sampling = &sp;
    sp.temperature = -1;
    sp.set_mask = 1u << 0;
    bad(e, &g, TDM_EINVALID, "temperature");
    sp.top_p = 1.5f;
    sp.set_mask = 1u << 2;
    bad(e, &g, TDM_EINVALID, "top_p");
    sp.top_k = -1;
    sp.set_mask = 1u << 1;
    bad(e, &g, TDM_EINVALID, "top_k");
    sp.n_logprobs = 21;
    sp.set_mask = 1u << 12;
    bad(e, &g, TDM_EINVALID, "n_logprobs");
    int32_t stop_ids[1] = {9999};
    sp.n_stop_token_ids = 1;
    sp.stop_token_ids = stop_ids;
    sp.set_mask = 1u << 10;
    bad(e, &g, TDM_EINVALID, "stop_token_ids");
    g.sampling = NULL;

    char *s17[17];
    for (int i = 0; i < 17; i++)
        s17[i] = (char *)"x";
    g.n_stop = 17;
    g.stop = s17;
    bad(e, &g, TDM_EINVALID, "stop: 17 strings given, at most 16");
    char *s_empty[1] = {(char *)""};
    g.n_stop = 1;
    g.stop = s_empty;
    bad(e, &g, TDM_EINVALID, "stop[0] is empty");
    char big[300];
    memset(big, 'a', 299);
    big[299] = '\0';
    char *s_big[2] = {(char *)"ok", big};
    g.n_stop = 2;
    g.stop = s_big;
    bad(e, &g, TDM_EINVALID, "stop[1] is 299 bytes long, at most 256");
    char *s_utf[1] = {(char *)"a\xc3"};
    g.n_stop = 1;
    g.stop = s_utf;
    bad(e, &g, TDM_EINVALID, "stop[0] is not valid UTF-8");
    g.n_stop = 0;
    g.stop = NULL;

    g.model = (char *)"other-model";
    bad(e, &g, TDM_ENOTFOUND, "model 'other-model' is not served here; this router serves 'tiny'");
    g.model = (char *)"tiny";
    g.request_id = (char *)"has space";
    bad(e, &g, TDM_EINVALID, "request_id");
    g.request_id = (char *)"";

    /* chat */
    Tandem__V1__ChatMessage m0 = TANDEM__V1__CHAT_MESSAGE__INIT,
                            m1 = TANDEM__V1__CHAT_MESSAGE__INIT;
    Tandem__V1__ChatMessage *msgs[2] = {&m0, &m1};
    Tandem__V1__ChatList chat = TANDEM__V1__CHAT_LIST__INIT;
    chat.messages = msgs;
    tandem__v1__generate_request__init(&g);
    g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    g.chat = &chat;
    g.max_tokens = 4;
    bad(e, &g, TDM_EINVALID, "chat.messages is empty");
    chat.n_messages = 1;
    m0.role = (char *)"robot";
    m0.content = (char *)"hi";
    bad(e, &g, TDM_EINVALID, "robot");
    /* (a system message after the first is the template's business with a Jinja template, as
     * in transformers; test_chat.c checks the built-in templates refuse it) */
    m0.role = (char *)"user";
    m0.content = (char *)"bad \xe2\x82";
    bad(e, &g, TDM_EINVALID, "chat.messages[0].content is not valid UTF-8");

    /* token ids */
    int32_t tk[3] = {1, 600, 2};
    Tandem__V1__TokenList tl = TANDEM__V1__TOKEN_LIST__INIT;
    tl.ids = tk;
    tl.n_ids = 3;
    tandem__v1__generate_request__init(&g);
    g.max_tokens = 4;
    g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS;
    g.tokens = &tl;
    bad(e, &g, TDM_EINVALID, "tokens.ids[1] = 600 is out of the vocabulary (0..511)");
    tl.n_ids = 0;
    bad(e, &g, TDM_EINVALID, "tokens.ids is empty");

    /* a duplicate id of a request in flight (queued: no node is up) */
    prompt_req(&g, "dup-1", "hello", 4, true);
    uint64_t first = generate(e, &g);
    pump_until_queued(e, 1);
    bad(e, &g, TDM_EINVALID, "request_id 'dup-1' is already in flight");

    /* still serving */
    Tandem__V1__HealthRequest hr = TANDEM__V1__HEALTH_REQUEST__INIT;
    uint64_t hc = send_req(e, M(HEALTH), &hr.base, NULL, 0);
    expect_end(e, hc, 0, "not ready");
    const tdm_router_metrics_t *mt = tdm_router_metrics(e->r);
    assert_int_equal(mt->requests_by_status[3], 23);
    assert_int_equal(mt->requests_by_status[5], 1);
    tdm_router_shutdown(e->r);
    expect_end(e, first, TDM_EUNAVAILABLE, "router shutting down");
    env_free(e);
}

/* A full queue refuses with RESOURCE_EXHAUSTED; a decode node registering drains it, with
 * local prefill since no prefill node is up. */
static void test_queue_and_local_prefill(void **state)
{
    (void)state;
    env_t *e = env_new("  max_queue: 2\n");
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "q-1", "one", 2, true);
    uint64_t c1 = generate(e, &g);
    prompt_req(&g, "q-2", "two", 2, true);
    generate(e, &g);
    pump_until_queued(e, 2);
    prompt_req(&g, "q-3", "three", 2, true);
    bad(e, &g, TDM_ERESOURCE, "queue full (2 requests waiting)");
    assert_int_equal(tdm_router_metrics(e->r)->queue_full, 1);

    fake_register(e, &e->d0);
    tdm_frame_t f1, f2;
    tdm_frame_init(&f1);
    tdm_frame_init(&f2);
    Tandem__V1__DecodeReserve *r1 = expect_reserve(e, &e->d0, &f1);
    Tandem__V1__DecodeReserve *r2 = expect_reserve(e, &e->d0, &f2);
    assert_string_equal(r1->spec->request_id, "q-1"); /* FIFO */
    assert_string_equal(r2->spec->request_id, "q-2");
    assert_true(r1->local_prefill);
    assert_true(r2->local_prefill);
    assert_int_equal(tdm_router_n_queued(e->r), 0);
    reply_ack(&e->d0, &f1, "q-1", 1);
    /* the decode node prefills itself and sends index 0 */
    fake_token(&e->d0, "q-1", 0, B('A'));
    fake_token(&e->d0, "q-1", 1, B('B'));
    fake_finished(&e->d0, "q-1", FIN(LENGTH), 2);
    result_t res;
    collect(e, c1, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "AB");
    assert_int_equal(res.usage.cached_prompt_tokens, 3);
    protobuf_c_message_free_unpacked(&r1->base, NULL);
    protobuf_c_message_free_unpacked(&r2->base, NULL);
    tdm_frame_clear(&f1);
    tdm_frame_clear(&f2);
    env_free(e);
}

/* The decode node with the most room is asked first; when it refuses, the other one. */
static void test_reserve_rejected(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    fake_heartbeat(e, &e->d0, 90, 0);
    fake_heartbeat(e, &e->d1, 50, 0);
    fake_sync(e, &e->d0);
    fake_sync(e, &e->d1);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-rej", "abc", 4, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f);
    assert_int_equal(tdm_sock_reply_error(e->d0.s, &f, TDM_ERESOURCE, "need 1 blocks, 0 free"), 0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    rs = reserve_and_ack(e, &e->d1);
    assert_string_equal(rs->spec->request_id, "r-rej");
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_string_equal(t->decode_node_id, "decode-1");
    protobuf_c_message_free_unpacked(&t->base, NULL);
    assert_int_equal(tdm_router_metrics(e->r)->reserve_rejects, 1);
    /* a node refusing what the router validated is the cluster's fault: INTERNAL, never the
     * client's INVALID_ARGUMENT */
    prompt_req(&g, "r-bad", "abc", 4, true);
    uint64_t c2 = generate(e, &g);
    tdm_frame_init(&f);
    /* d0 has 0 free until its next heartbeat, so d1 is asked */
    rs = expect_reserve(e, &e->d1, &f);
    assert_int_equal(tdm_sock_reply_error(e->d1.s, &f, TDM_EINVALID, "sampling.top_k too big"), 0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    expect_end(e, c2, TDM_EINTERNAL,
               "decode node 'decode-1' refused the request (INVALID_ARGUMENT): sampling.top_k "
               "too big");
    (void)call;
    env_free(e);
}

/* The PrefillTask goes with the DecodeReserve: the prefill runs, and its first token reaches
 * the client, while the reservation waits. A refusal then cancels the prefill (NodeCancel of
 * that attempt to the prefill node) and the request is dispatched again resuming after the
 * token delivered (output_tokens), which the client sees once; the withdrawn attempt's late
 * messages are stale. A refusal is flow control: no re-dispatch is counted. When the token
 * delivered already ends the request (max_tokens 1), it completes without another attempt. */
static void test_reserve_refused_after_prefill(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    fake_heartbeat(e, &e->d0, 90, 0);
    fake_heartbeat(e, &e->d1, 50, 0);
    fake_sync(e, &e->d0);
    fake_sync(e, &e->d1);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-early", "abc", 4, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f);
    uint64_t a1 = rs->spec->attempt_id;
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0); /* before any answer */
    assert_int_equal(t->spec->attempt_id, a1);
    assert_string_equal(t->decode_node_id, "decode-0");
    assert_int_equal(t->spec->n_output_tokens, 0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-early", 0, B('h'));
    result_t first;
    memset(&first, 0, sizeof first);
    one_chunk(e, call, &first); /* the reservation is still unanswered */
    assert_string_equal(first.text, "h");
    assert_int_equal(tdm_sock_reply_error(e->d0.s, &f, TDM_ERESOURCE, "need 1 blocks, 0 free"), 0);
    tdm_frame_clear(&f);
    expect_cancel(e, &e->p0, "r-early", 1); /* the prefill of the refused attempt */
    rs = expect_reserve(e, &e->d1, &f);
    assert_true(rs->spec->attempt_id != a1);
    assert_int_equal(rs->spec->n_output_tokens, 1); /* resumes after the token delivered */
    assert_int_equal(rs->spec->output_tokens[0], B('h'));
    reply_ack(&e->d1, &f, "r-early", 1);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    fake_sync(e, &e->d1);
    t = expect_task(e, &e->p0);
    assert_string_equal(t->decode_node_id, "decode-1");
    assert_int_equal(t->spec->n_output_tokens, 1);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    uint64_t stale = tdm_router_metrics(e->r)->stale_attempt_messages;
    uint64_t a2 = attempt_for("r-early");
    attempt_note("r-early", a1); /* the withdrawn attempt's token, late */
    fake_token(&e->p0, "r-early", 0, B('x'));
    fake_sync(e, &e->p0);
    assert_int_equal(tdm_router_metrics(e->r)->stale_attempt_messages, stale + 1);
    attempt_note("r-early", a2);
    fake_token(&e->p0, "r-early", 1, B('i'));
    fake_token(&e->d1, "r-early", 2, B('j'));
    fake_finished(&e->d1, "r-early", FIN(LENGTH), 3);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "ij");
    assert_int_equal(res.usage.completion_tokens, 3); /* h, i, j: each once */
    assert_int_equal(tdm_router_metrics(e->r)->reserve_rejects, 1);
    assert_int_equal(tdm_router_metrics(e->r)->redispatches, 0);

    /* max_tokens 1: the first token delivered is the whole answer */
    fake_heartbeat(e, &e->d0, 90, 0);
    fake_sync(e, &e->d0);
    prompt_req(&g, "r-early-1", "abc", 1, true);
    call = generate(e, &g);
    rs = expect_reserve(e, &e->d0, &f);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-early-1", 0, B('k'));
    fake_sync(e, &e->p0);
    assert_int_equal(tdm_sock_reply_error(e->d0.s, &f, TDM_ERESOURCE, "need 1 blocks, 0 free"), 0);
    tdm_frame_clear(&f);
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "k");
    assert_int_equal(res.finish, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH);
    expect_cancel(e, &e->p0, "r-early-1", 1);
    expect_none(e, e->d1.s, 100);                                   /* no other attempt */
    assert_int_equal(tdm_router_metrics(e->r)->reserve_rejects, 2); /* counted all the same */
    env_free(e);
}

/* round_robin alternates between the prefill nodes. */
static void test_round_robin(void **state)
{
    (void)state;
    env_t *e = env_new("  prefill_policy: round_robin\n");
    fake_register(e, &e->p0);
    fake_register(e, &e->p1);
    fake_register(e, &e->d0);
    fake_t *prev = NULL;
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof id, "rr-%d", i);
        Tandem__V1__GenerateRequest g;
        prompt_req(&g, id, "same prompt", 4, true);
        generate(e, &g);
        Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
        protobuf_c_message_free_unpacked(&rs->base, NULL);
        fake_t *got = expect_task_on_one(e, &e->p0, &e->p1, id);
        if (prev)
            assert_ptr_not_equal(got, prev);
        prev = got;
    }
    env_free(e);
}

/* The long system prompt number s (about 7 rules; well over TDM_ROUTER_PREFIX_KEY_BLOCKS). */
static void make_system(int s, char *sys, size_t cap)
{
    sys[0] = '\0';
    for (int k = 0; k < 7; k++) {
        char part[64];
        snprintf(part, sizeof part, "Rule %d of system %d: answer with care. ", k, s);
        strncat(sys, part, cap - strlen(sys) - 1);
    }
}

/* Sends a chat request (system + user) and returns which of p0/p1 got its prefill task. */
static fake_t *chat_on(env_t *e, const char *id, const char *sys, const char *user)
{
    Tandem__V1__ChatMessage m0 = TANDEM__V1__CHAT_MESSAGE__INIT,
                            m1 = TANDEM__V1__CHAT_MESSAGE__INIT;
    m0.role = (char *)"system";
    m0.content = (char *)sys;
    m1.role = (char *)"user";
    m1.content = (char *)user;
    Tandem__V1__ChatMessage *msgs[2] = {&m0, &m1};
    Tandem__V1__ChatList chat = TANDEM__V1__CHAT_LIST__INIT;
    chat.n_messages = 2;
    chat.messages = msgs;
    Tandem__V1__GenerateRequest g = TANDEM__V1__GENERATE_REQUEST__INIT;
    g.request_id = (char *)id;
    g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    g.chat = &chat;
    g.max_tokens = 4;
    g.stream = true;
    generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    assert_true(rs->spec->n_prompt_tokens > 80); /* more than TDM_ROUTER_PREFIX_KEY_BLOCKS blocks */
    assert_true(rs->spec->n_prompt_tokens < N_CTX - 4);
    /* the chat template was applied: the prompt starts with <|im_start|> (id 510) */
    assert_int_equal(rs->spec->prompt_tokens[0], 510);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    return expect_task_on_one(e, &e->p0, &e->p1, id);
}

/* prefix_aware: chats that share a long system prompt go to one prefill node; different
 * system prompts spread over both; an overloaded node is passed over. */
static void test_prefix_aware(void **state)
{
    (void)state;
    env_t *e = env_new("  prefill_policy: prefix_aware\n");
    fake_register(e, &e->p0);
    fake_register(e, &e->p1);
    fake_register(e, &e->d0);
    int used[2] = {0, 0};
    fake_t *home0 = NULL;
    char sys[512];
    for (int s = 0; s < 6; s++) {
        make_system(s, sys, sizeof sys);
        char id[32];
        snprintf(id, sizeof id, "px-%d-a", s);
        fake_t *first = chat_on(e, id, sys, "Tell me a story.");
        snprintf(id, sizeof id, "px-%d-b", s);
        assert_ptr_equal(chat_on(e, id, sys, "What is two plus two?"), first);
        used[first == &e->p1]++;
        if (s == 0)
            home0 = first;
        /* the nodes ran the prompts: their queues are empty again */
        fake_heartbeat(e, &e->p0, 100, 0);
        fake_heartbeat(e, &e->p1, 100, 0);
        fake_sync(e, &e->p0);
        fake_sync(e, &e->p1);
    }
    assert_true(used[0] > 0 && used[1] > 0);
    /* system prompt 0's node reports a long queue: the next such chat goes elsewhere */
    fake_t *other = home0 == &e->p0 ? &e->p1 : &e->p0;
    fake_heartbeat(e, home0, 100, 100000);
    fake_heartbeat(e, other, 100, 0);
    fake_sync(e, home0);
    fake_sync(e, other);
    make_system(0, sys, sizeof sys);
    assert_ptr_equal(chat_on(e, "px-0-c", sys, "Another question?"), other);
    env_free(e);
}

/* least_loaded: fewest queued prompt tokens (last heartbeat plus what the router sent since). */
static void test_least_loaded(void **state)
{
    (void)state;
    env_t *e = env_new("  prefill_policy: least_loaded\n");
    fake_register(e, &e->p0);
    fake_register(e, &e->p1);
    fake_register(e, &e->d0);
    fake_heartbeat(e, &e->p0, 100, 1000);
    fake_heartbeat(e, &e->p1, 100, 0);
    fake_sync(e, &e->p0);
    fake_sync(e, &e->p1);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "ll-1", "first", 4, true);
    generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    assert_ptr_equal(expect_task_on_one(e, &e->p0, &e->p1, "ll-1"), &e->p1);
    fake_heartbeat(e, &e->p1, 100, 5000);
    fake_sync(e, &e->p1);
    for (int i = 2; i <= 3; i++) {
        char id[16];
        snprintf(id, sizeof id, "ll-%d", i);
        prompt_req(&g, id, "next", 4, true);
        generate(e, &g);
        rs = reserve_and_ack(e, &e->d0);
        protobuf_c_message_free_unpacked(&rs->base, NULL);
        assert_ptr_equal(expect_task_on_one(e, &e->p0, &e->p1, id), &e->p0);
    }
    env_free(e);
}

/* Refused by the only decode node: the request waits in the queue until that node's next
 * heartbeat reports room. */
static void test_rejected_then_queued(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-wait", "abc", 4, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f);
    assert_int_equal(tdm_sock_reply_error(e->d0.s, &f, TDM_ERESOURCE, "need 1 blocks, 0 free"), 0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    expect_none(e, e->d0.s, 100);
    assert_int_equal(tdm_router_n_queued(e->r), 1);
    fake_heartbeat(e, &e->p0, 100, 0); /* another node's heartbeat changes nothing */
    expect_none(e, e->d0.s, 50);
    fake_heartbeat(e, &e->d0, 80, 0);
    rs = reserve_and_ack(e, &e->d0);
    assert_string_equal(rs->spec->request_id, "r-wait");
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    assert_int_equal(tdm_router_n_queued(e->r), 0);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-wait", 0, B('k'));
    fake_finished(&e->d0, "r-wait", FIN(STOP), 1);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "k");
    assert_true(res.timings.queue_s >= 0.1);
    env_free(e);
}

/* CURVE on the node endpoint: every node has its own key, admitted under its own id only. */
static void test_curve(void **state)
{
    (void)state;
    static const char *const ids[] = {"prefill-0", "prefill-1", "decode-0", "decode-1"};
    char rp[41], rs[41], np[4][41], ns[4][41];
    assert_int_equal(tdm_net_curve_keypair(rp, rs), 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(tdm_net_curve_keypair(np[i], ns[i]), 0);
    char dir[] = "/tmp/tdm_router_keys_XXXXXX", key_file[64];
    assert_non_null(mkdtemp(dir));
    snprintf(key_file, sizeof key_file, "%s/router.key", dir);
    FILE *kf = fopen(key_file, "w");
    assert_non_null(kf);
    fprintf(kf, "%s\n", rs);
    fclose(kf);
    assert_int_equal(chmod(key_file, 0600), 0);
    char router_yaml[256], nodes[1024] = "";
    snprintf(router_yaml, sizeof router_yaml,
             "  max_queue: 16\n  curve_public_key: '%s'\n  curve_secret_key_file: %s\n", rp,
             key_file);
    for (int i = 0; i < 4; i++) /* the router never reads the nodes' secret key files */
        snprintf(nodes + strlen(nodes), sizeof nodes - strlen(nodes),
                 "  - {id: %s, role: %s, curve_public_key: '%s', curve_secret_key_file: "
                 "/nonexistent/%s.key}\n",
                 ids[i], i < 2 ? "prefill" : "decode", np[i], ids[i]);
    env_nodes_yaml = nodes;
    env_t *e = env_new_with(router_yaml, NULL);
    env_nodes_yaml = NULL;
    /* without keys: no handshake, no answer, not registered */
    fake_connect(e, &e->d1);
    reg_t g;
    reg_default(e, &e->d1, &g);
    tdm_send_t s = {0};
    s.kind = K_REQUEST;
    s.method = M(REGISTER);
    s.call_id = 1;
    s.body = &g.m.base;
    assert_int_equal(tdm_sock_send(e->d1.s, &s), 0);
    expect_none(e, e->d1.s, 300);
    assert_false(tdm_router_node_up(e->r, "decode-1"));
    tdm_sock_destroy(&e->d1.s);
    /* with a key no node has: refused by the ZAP handler */
    char wp[41], ws[41];
    assert_int_equal(tdm_net_curve_keypair(wp, ws), 0);
    tdm_curve_keys_t wrong = {.server_public = rp, .client_public = wp, .client_secret = ws};
    e->p0.curve = &wrong;
    fake_connect(e, &e->p0);
    reg_default(e, &e->p0, &g);
    s.body = &g.m.base;
    assert_int_equal(tdm_sock_send(e->p0.s, &s), 0);
    expect_none(e, e->p0.s, 300);
    assert_false(tdm_router_node_up(e->r, "prefill-0"));
    /* decode-0's key registering as decode-1: admitted by ZAP, refused by the router */
    tdm_curve_keys_t d0_keys = {
        .server_public = rp, .client_public = np[2], .client_secret = ns[2]};
    e->d1.curve = &d0_keys;
    reg_default(e, &e->d1, &g);
    char msg[256];
    assert_int_equal(fake_register_with(e, &e->d1, &g, msg, sizeof msg), TDM_EUNAUTHENTICATED);
    assert_string_equal(msg, "node key of 'decode-0' cannot register as 'decode-1'");
    assert_false(tdm_router_node_up(e->r, "decode-1"));
    /* each node with its own key */
    e->d0.curve = &d0_keys;
    fake_register(e, &e->d0);
    tdm_curve_keys_t p1_keys = {
        .server_public = rp, .client_public = np[1], .client_secret = ns[1]};
    e->p1.curve = &p1_keys;
    fake_register(e, &e->p1);
    env_free(e);
    unlink(key_file);
    rmdir(dir);
}

/* A decode node that stops heartbeating is marked down; its running request fails with
 * UNAVAILABLE and its prefill node is told to cancel. */
static void test_decode_down(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    e->hb_timeout_ms = 400;
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-dd", "abc", 8, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-dd", 0, B('a'));
    result_t res;
    memset(&res, 0, sizeof res);
    one_chunk(e, call, &res);
    /* p0 keeps heartbeating, d0 falls silent */
    tdm_frame_t f;
    tdm_frame_init(&f);
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    bool got = false;
    while (!got && tdm_time_now() < end) {
        fake_heartbeat(e, &e->p0, 100, 0);
        got = recv_on(e, e->client, &f, 50);
    }
    assert_true(got);
    /* a stream that breaks after tokens says so in its last chunk, then the END's status */
    assert_int_equal(f.kind, K_STREAM);
    Tandem__V1__GenerateChunk *last =
        (Tandem__V1__GenerateChunk *)tdm_frame_unpack(&f, &tandem__v1__generate_chunk__descriptor);
    assert_non_null(last);
    assert_int_equal(last->finish_reason, FIN(ERROR));
    assert_int_equal(last->n_token_ids, 0);
    assert_non_null(last->usage);
    assert_int_equal(last->usage->completion_tokens, 1);
    protobuf_c_message_free_unpacked(&last->base, NULL);
    tdm_frame_clear(&f);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.status, TDM_EUNAVAILABLE);
    assert_non_null(strstr(f.message, "decode node 'decode-0' is down (no heartbeat for "));
    assert_non_null(strstr(f.message, " ms)"));
    /* migration was tried: no other decode node is there to resume on */
    assert_non_null(strstr(f.message, "no decode node is up to run it again"));
    tdm_frame_clear(&f);
    expect_cancel(e, &e->p0, "r-dd", 1);
    assert_false(tdm_router_node_up(e->r, "decode-0"));
    assert_true(tdm_router_node_up(e->r, "prefill-0"));
    /* a heartbeat from the node now gets NOT_FOUND (register again) */
    Tandem__V1__Heartbeat h = TANDEM__V1__HEARTBEAT__INIT;
    Tandem__V1__NodeLoad ld = TANDEM__V1__NODE_LOAD__INIT;
    h.load = &ld;
    h.node_id = (char *)"decode-0";
    tdm_send_t s = {0};
    s.kind = K_REQUEST;
    s.method = M(HEARTBEAT);
    s.call_id = 7;
    s.body = &h.base;
    assert_int_equal(tdm_sock_send(e->d0.s, &s), 0);
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->d0.s, &f, WAIT_MS));
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.status, TDM_ENOTFOUND);
    tdm_frame_clear(&f);
    env_free(e);
}

/* A prefill node that stops heartbeating: its request is dispatched again (NodeCancel to the
 * decode node first) and the client gets each output index once. */
static void test_prefill_down(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    e->hb_timeout_ms = 400;
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_register(e, &e->p0);
    fake_register(e, &e->p1);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-pd", "abc", 8, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    uint64_t seed = rs->spec->sampling->seed;
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    fake_t *dead = expect_task_on_one(e, &e->p0, &e->p1, "r-pd");
    fake_t *alive = dead == &e->p0 ? &e->p1 : &e->p0;
    fake_token(dead, "r-pd", 0, B('x'));
    result_t res;
    memset(&res, 0, sizeof res);
    one_chunk(e, call, &res);
    assert_string_equal(res.text, "x");
    /* the dead one falls silent; the others heartbeat until the decode node hears a cancel */
    tdm_frame_t f;
    tdm_frame_init(&f);
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    bool got = false;
    while (!got && tdm_time_now() < end) {
        fake_heartbeat(e, alive, 100, 0);
        fake_heartbeat(e, &e->d0, 100, 0);
        got = recv_on(e, e->d0.s, &f, 50);
    }
    assert_true(got);
    assert_int_equal(f.method, M(NODE_CANCEL));
    tdm_frame_clear(&f);
    assert_false(tdm_router_node_up(e->r, dead->id));
    rs = reserve_and_ack(e, &e->d0); /* dispatched again, same seed */
    assert_string_equal(rs->spec->request_id, "r-pd");
    assert_int_equal(rs->spec->sampling->seed, seed);
    assert_false(rs->local_prefill);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, alive);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(alive, "r-pd", 0, B('x')); /* the same token again: not sent twice */
    fake_token(&e->d0, "r-pd", 1, B('y'));
    fake_finished(&e->d0, "r-pd", FIN(LENGTH), 2);
    result_t rest;
    collect(e, call, &rest);
    assert_int_equal(rest.status, 0);
    assert_string_equal(rest.text, "y");
    assert_int_equal(rest.index[0], 1);
    assert_int_equal(rest.usage.completion_tokens, 2);
    assert_int_equal(tdm_router_metrics(e->r)->redispatches, 1);
    env_free(e);
}

/* TaskFailed: retryable ones are dispatched again (at most 3 times), others fail. */
static void test_task_failed(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-tf", "abc", 4, true);
    uint64_t call = generate(e, &g);
    for (int i = 0; i <= 3; i++) {
        Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
        protobuf_c_message_free_unpacked(&rs->base, NULL);
        Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
        protobuf_c_message_free_unpacked(&t->base, NULL);
        fake_task_failed(&e->p0, "r-tf", 14, "KV transfer to decode-0 timed out", true);
        expect_cancel(e, &e->p0, "r-tf", i < 3 ? 1 : 14);
        expect_cancel(e, &e->d0, "r-tf", i < 3 ? 1 : 14);
    }
    expect_end(e, call, TDM_EUNAVAILABLE,
               "prefill node 'prefill-0' failed: KV transfer to decode-0 timed out (gave up "
               "after 3 re-dispatches)");
    prompt_req(&g, "r-tf2", "abc", 4, true);
    call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_task_failed(&e->d0, "r-tf2", 3, "bad sampling", false);
    /* INVALID_ARGUMENT from a node (the router validated the request): a server fault */
    expect_end(e, call, TDM_EINTERNAL, "decode node 'decode-0' failed: bad sampling");
    env_free(e);
}

/* TaskFailed of a given attempt (attempt_for gives the current one). */
static void fake_task_failed_of(fake_t *n, const char *req, uint64_t attempt, int code,
                                const char *msg)
{
    Tandem__V1__TaskFailed tf = TANDEM__V1__TASK_FAILED__INIT;
    tf.request_id = (char *)req;
    tf.attempt_id = attempt;
    tf.status = code;
    tf.message = (char *)msg;
    tf.retryable = true;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(TASK_FAILED), &tf.base), 0);
}

/* Runs the router, heartbeating the `alive` fakes (NULL-terminated), until n has a
 * NodeCancel of `attempt` (other frames on n are dropped); fails after WAIT_MS. */
static void expect_cancel_of(env_t *e, fake_t *n, uint64_t attempt, fake_t **alive)
{
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    tdm_frame_t f;
    tdm_frame_init(&f);
    while (tdm_time_now() < end) {
        for (size_t i = 0; alive && alive[i]; i++)
            fake_heartbeat(e, alive[i], 90, 0);
        if (!recv_on(e, n->s, &f, 50))
            continue;
        bool hit = false;
        if (f.method == M(NODE_CANCEL)) {
            Tandem__V1__NodeCancel *c = (Tandem__V1__NodeCancel *)tdm_frame_unpack(
                &f, &tandem__v1__node_cancel__descriptor);
            assert_non_null(c);
            hit = c->attempt_id == attempt;
            protobuf_c_message_free_unpacked(&c->base, NULL);
        }
        tdm_frame_clear(&f);
        if (hit)
            return;
    }
    fail_msg("%s: no NodeCancel of attempt %016" PRIx64, n->id, attempt);
}

/* Runs the router, heartbeating the `alive` fakes, until n has a DecodeReserve; *f keeps it. */
static Tandem__V1__DecodeReserve *expect_reserve_alive(env_t *e, fake_t *n, tdm_frame_t *f,
                                                       fake_t **alive)
{
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    bool got = false;
    while (!got && tdm_time_now() < end) {
        for (size_t i = 0; alive[i]; i++)
            fake_heartbeat(e, alive[i], 90, 0);
        got = recv_on(e, n->s, f, 50);
    }
    if (!got)
        fail_msg("%s: no DecodeReserve", n->id);
    assert_int_equal(f->method, M(DECODE_RESERVE));
    Tandem__V1__DecodeReserve *m =
        (Tandem__V1__DecodeReserve *)tdm_frame_unpack(f, &tandem__v1__decode_reserve__descriptor);
    assert_non_null(m);
    attempt_note(m->spec->request_id, m->spec->attempt_id);
    return m;
}

/* One failed KV transfer, reported by both of its nodes (an older decode node still reports
 * its side), is one re-dispatch: the second report names an attempt that is over. */
static void test_one_failure_one_retry(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-one", "abc", 4, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    uint64_t first = rs->spec->attempt_id;
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-one", 0, B('o'));
    /* the receiver rejected the transfer: the sender reports it */
    fake_task_failed_of(&e->p0, "r-one", first, 14,
                        "KV transfer to decode-0 failed (INVALID_ARGUMENT): header checksum "
                        "mismatch");
    expect_cancel(e, &e->p0, "r-one", 1);
    expect_cancel(e, &e->d0, "r-one", 1);
    tdm_frame_t f;
    tdm_frame_init(&f);
    rs = expect_reserve(e, &e->d0, &f);
    uint64_t second = rs->spec->attempt_id;
    assert_true(second != first);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    /* ... and the decode node's report of the same failure changes nothing */
    uint64_t stale = tdm_router_metrics(e->r)->stale_attempt_messages;
    fake_task_failed_of(&e->d0, "r-one", first, 3, "KV transfer rejected: header checksum");
    reply_ack(&e->d0, &f, "r-one", 1);
    tdm_frame_clear(&f);
    t = expect_task(e, &e->p0);
    assert_int_equal(t->spec->attempt_id, second);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_sync(e, &e->d0); /* nothing else came to d0: no second NodeCancel, no reserve */
    assert_int_equal(tdm_router_metrics(e->r)->stale_attempt_messages, stale + 1);
    assert_int_equal(tdm_router_metrics(e->r)->redispatches, 1);
    assert_int_equal(tdm_router_metrics(e->r)->kv_transfer_failures, 1);
    fake_token(&e->p0, "r-one", 0, B('o'));
    fake_token(&e->d0, "r-one", 1, B('k'));
    fake_finished(&e->d0, "r-one", FIN(LENGTH), 2);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "ok");
    env_free(e);
}

/* Every kind of retry of one request draws on one budget of TDM_ROUTER_MAX_REDISPATCH: here a
 * reservation that is not answered, then transfers that fail; the last failure, which a node
 * reported as INVALID_ARGUMENT, reaches the client as a server fault (INTERNAL). */
static void test_retry_budget_shared(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    e->hb_timeout_ms = 400;
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_t *alive[] = {&e->p0, &e->d0, NULL};
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-bud", "abc", 4, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve_alive(e, &e->d0, &f, alive);
    uint64_t lost = rs->spec->attempt_id; /* never answered */
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    expect_cancel_of(e, &e->d0, lost, alive);
    for (int i = 0; i < 3; i++) {
        rs = expect_reserve_alive(e, &e->d0, &f, alive); /* the only decode node: again */
        assert_true(rs->spec->attempt_id != lost);
        reply_ack(&e->d0, &f, "r-bud", 1);
        protobuf_c_message_free_unpacked(&rs->base, NULL);
        tdm_frame_clear(&f);
        Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
        protobuf_c_message_free_unpacked(&t->base, NULL);
        fake_task_failed(&e->p0, "r-bud", i < 2 ? 14 : 3, "KV transfer to decode-0 failed", true);
        if (i < 2) {
            expect_cancel(e, &e->p0, "r-bud", 1);
            expect_cancel_of(e, &e->d0, attempt_for("r-bud"), alive);
        }
    }
    expect_end(e, call, TDM_EINTERNAL,
               "prefill node 'prefill-0' failed: KV transfer to decode-0 failed (gave up after "
               "3 re-dispatches)");
    assert_int_equal(tdm_router_metrics(e->r)->redispatches, 3);
    env_free(e);
}

/* A decode node that does not answer a reservation within the reservation timeout (its
 * heartbeats go on: the answer was lost): the request retries on the other decode node under
 * a new attempt, the old attempt gets NodeCancel, and a late answer to it is cancelled too. */
static void test_reserve_timeout(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    e->hb_timeout_ms = 400;
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    fake_heartbeat(e, &e->d0, 95, 0);
    fake_heartbeat(e, &e->d1, 50, 0);
    fake_sync(e, &e->d0);
    fake_sync(e, &e->d1);
    fake_t *alive[] = {&e->p0, &e->d1, NULL};
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-rto", "abc", 4, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t late;
    tdm_frame_init(&late);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &late); /* most room */
    uint64_t old = rs->spec->attempt_id;
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    /* d0 stays up (it heartbeats) but its answer never comes */
    fake_t *all[] = {&e->p0, &e->d0, &e->d1, NULL};
    tdm_frame_t f;
    tdm_frame_init(&f);
    rs = expect_reserve_alive(e, &e->d1, &f, all);
    assert_string_equal(rs->spec->request_id, "r-rto");
    assert_true(rs->spec->attempt_id != old);
    reply_ack(&e->d1, &f, "r-rto", 1);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    expect_cancel_of(e, &e->d0, old, all);
    assert_true(tdm_router_node_up(e->r, "decode-0"));
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_string_equal(t->decode_node_id, "decode-1");
    protobuf_c_message_free_unpacked(&t->base, NULL);
    /* the answer comes after all: what it reserved is released at once */
    Tandem__V1__ReserveAck ack = TANDEM__V1__RESERVE_ACK__INIT;
    ack.request_id = (char *)"r-rto";
    ack.attempt_id = old;
    ack.n_blocks = 1;
    assert_int_equal(tdm_sock_reply(e->d0.s, &late, &ack.base), 0);
    tdm_frame_clear(&late);
    expect_cancel_of(e, &e->d0, old, all);
    fake_token(&e->p0, "r-rto", 0, B('h'));
    fake_token(&e->d1, "r-rto", 1, B('i'));
    fake_finished(&e->d1, "r-rto", FIN(LENGTH), 2);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "hi");
    assert_int_equal(tdm_router_metrics(e->r)->redispatches, 1);
    (void)alive;
    env_free(e);
}

/* Heartbeats in which d0 has the most room, until d1 gets a DecodeReserve (into *f; caller
 * frees the result and clears f); fails if d0 gets one. */
static Tandem__V1__DecodeReserve *expect_reserve_not_stalled(env_t *e, tdm_frame_t *f)
{
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    bool got = false;
    while (!got && tdm_time_now() < end) {
        fake_heartbeat(e, &e->p0, 90, 0);
        fake_heartbeat(e, &e->d0, 100, 0);
        fake_heartbeat(e, &e->d1, 60, 0);
        got = recv_on(e, e->d1.s, f, 50);
        tdm_frame_t other;
        tdm_frame_init(&other);
        if (recv_on(e, e->d0.s, &other, 0) && other.method == M(DECODE_RESERVE))
            fail_msg("the reservation went to the stalled decode-0 again");
        tdm_frame_clear(&other);
    }
    assert_true(got);
    assert_int_equal(f->method, M(DECODE_RESERVE));
    Tandem__V1__DecodeReserve *rs =
        (Tandem__V1__DecodeReserve *)tdm_frame_unpack(f, &tandem__v1__decode_reserve__descriptor);
    assert_non_null(rs);
    attempt_note(rs->spec->request_id, rs->spec->attempt_id);
    return rs;
}

/* A decode node that timed out a reservation is not chosen again for that request while
 * another decode node takes work: here the other one refuses it for room first, the request
 * waits in the queue, and once room is back it goes to the other one again, not to the
 * stalled node (which has as much room and comes first), so a stalled node cannot use up the
 * request's re-dispatches. */
static void test_reserve_timeout_avoids_node(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    e->hb_timeout_ms = 400;
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    fake_heartbeat(e, &e->d0, 95, 0);
    fake_heartbeat(e, &e->d1, 50, 0);
    fake_sync(e, &e->d0);
    fake_sync(e, &e->d1);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-avoid", "abc", 4, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f); /* never answered */
    uint64_t old = rs->spec->attempt_id;
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    fake_t *all[] = {&e->p0, &e->d0, &e->d1, NULL};
    rs = expect_reserve_alive(e, &e->d1, &f, all);
    assert_int_equal(tdm_sock_reply_error(e->d1.s, &f, TDM_ERESOURCE, "need 1 blocks, 0 free"), 0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    /* the heartbeats give both nodes room again, d0 the most: d1 is asked, not d0 */
    rs = expect_reserve_not_stalled(e, &f);
    assert_string_equal(rs->spec->request_id, "r-avoid");
    reply_ack(&e->d1, &f, "r-avoid", 1);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_string_equal(t->decode_node_id, "decode-1");
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-avoid", 0, B('h'));
    fake_token(&e->d1, "r-avoid", 1, B('i'));
    fake_finished(&e->d1, "r-avoid", FIN(LENGTH), 2);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "hi");
    assert_int_equal(tdm_router_metrics(e->r)->redispatches, 1); /* the timeout's, once */
    (void)old; /* its NodeCancel is test_reserve_timeout's */
    env_free(e);
}

/* A decode node paused while a reservation waits (its heartbeats stop): the request completes
 * on the other decode node, and when the paused node is back (it registers again) it gets
 * NodeCancel of the attempt it may still hold. The DecodeReserve's frame deadline stays the
 * request's (a node's clock may run ahead of the router's by more than the answer wait). */
static void test_reserve_node_paused(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    e->hb_timeout_ms = 400;
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    fake_heartbeat(e, &e->d0, 95, 0);
    fake_heartbeat(e, &e->d1, 50, 0);
    fake_sync(e, &e->d0);
    fake_sync(e, &e->d1);
    fake_t *alive[] = {&e->p0, &e->d1, NULL};
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-pause", "abc", 4, true);
    uint64_t call = generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    uint64_t before_ms = tdm_net_now_ms();
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f);
    uint64_t old = rs->spec->attempt_id;
    /* the frame carries the request's deadline (the router's request timeout), far beyond the
     * router's wait for the answer (the heartbeat timeout plus two forward passes) */
    assert_true(f.deadline_unix_ms == 0 || f.deadline_unix_ms > before_ms + 10 * e->hb_timeout_ms);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    /* d0 is silent from now on */
    rs = expect_reserve_alive(e, &e->d1, &f, alive);
    assert_true(rs->spec->attempt_id != old);
    reply_ack(&e->d1, &f, "r-pause", 1);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "r-pause", 0, B('o'));
    fake_token(&e->d1, "r-pause", 1, B('k'));
    fake_finished(&e->d1, "r-pause", FIN(LENGTH), 2);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "ok");
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    while (tdm_router_node_up(e->r, "decode-0") && tdm_time_now() < end) {
        fake_heartbeat(e, &e->p0, 90, 0);
        fake_heartbeat(e, &e->d1, 90, 0);
        pump(e, 20);
    }
    assert_false(tdm_router_node_up(e->r, "decode-0"));
    while (tdm_sock_recv(e->d0.s, &f, 0) == TDM_OK) /* what reached it before it was down */
        tdm_frame_clear(&f);
    /* back: same instance, registers again; the old attempt is cancelled */
    fake_register(e, &e->d0);
    fake_t *now_alive[] = {&e->p0, &e->d0, &e->d1, NULL};
    expect_cancel_of(e, &e->d0, old, now_alive);
    env_free(e);
}

/* The only decode node dies while the request's KV is on its way: the prefill node's report
 * of the lost transfer comes before the heartbeat timeout, and the request, which ran once,
 * fails UNAVAILABLE once no decode node is left to run it again (it does not wait in the
 * queue until its deadline). */
static void test_rerun_without_decode_node(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    e->hb_timeout_ms = 400;
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-gone", "abc", 8, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_sock_destroy(&e->d0.s); /* killed */
    fake_task_failed(&e->p0, "r-gone", 14,
                     "KV transfer to decode-0 failed (UNAVAILABLE): the connection to the "
                     "receiver was lost",
                     true);
    tdm_frame_t f;
    tdm_frame_init(&f);
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    bool got = false;
    while (!got && tdm_time_now() < end) {
        fake_heartbeat(e, &e->p0, 100, 0);
        got = recv_on(e, e->client, &f, 50) && f.kind == K_END;
        if (!got)
            tdm_frame_clear(&f);
    }
    assert_true(got);
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, TDM_EUNAVAILABLE);
    assert_non_null(strstr(f.message, "decode-0"));
    assert_non_null(strstr(f.message, "no decode node is up to run"));
    tdm_frame_clear(&f);
    assert_int_equal(tdm_router_n_queued(e->r), 0);
    env_free(e);
}

/* Registration checks: unknown id, role, fingerprint, layout, n_ctx; restart detection. */
static void test_register(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    reg_t g;
    char msg[512];
    reg_default(e, &e->d0, &g);
    g.m.model_fingerprint ^= 1;
    assert_int_equal(fake_register_with(e, &e->d0, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_non_null(strstr(msg, "model fingerprint 0x"));
    assert_non_null(strstr(msg, "differs from the router's 0x"));
    assert_non_null(strstr(msg, e->model_path));
    reg_default(e, &e->d0, &g);
    g.layout.block_size = 32;
    assert_int_equal(fake_register_with(e, &e->d0, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_non_null(strstr(msg, "kv_layout.block_size is 32; the router expects 16"));
    reg_default(e, &e->d0, &g);
    g.layout.dtype = TANDEM__V1__KV_DTYPE__KV_DTYPE_F32;
    assert_int_equal(fake_register_with(e, &e->d0, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_non_null(strstr(msg, "kv_layout.dtype is f32"));
    reg_default(e, &e->d0, &g);
    g.m.n_ctx = 128;
    assert_int_equal(fake_register_with(e, &e->d0, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_non_null(strstr(msg, "n_ctx 128 is smaller than the router's context of 256"));
    reg_default(e, &e->d0, &g);
    g.m.role = TANDEM__V1__NODE_ROLE__NODE_ROLE_PREFILL;
    assert_int_equal(fake_register_with(e, &e->d0, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_non_null(strstr(msg, "is a decode node in the cluster config"));
    fake_t stranger = {"stranger", NULL, NULL, 0};
    reg_default(e, &stranger, &g);
    assert_int_equal(fake_register_with(e, &stranger, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_string_equal(msg, "node 'stranger' is not in the cluster config");
    tdm_sock_destroy(&stranger.s);
    assert_false(tdm_router_node_up(e->r, "decode-0"));

    /* a heartbeat REQUEST is answered END OK once registered */
    fake_register(e, &e->d0);
    Tandem__V1__Heartbeat h = TANDEM__V1__HEARTBEAT__INIT;
    Tandem__V1__NodeLoad ld = TANDEM__V1__NODE_LOAD__INIT;
    h.load = &ld;
    h.node_id = (char *)"decode-0";
    ld.kv_blocks_free = 77;
    h.instance_id = 42;
    tdm_send_t s = {0};
    s.kind = K_REQUEST;
    s.method = M(HEARTBEAT);
    s.call_id = 9;
    s.body = &h.base;
    assert_int_equal(tdm_sock_send(e->d0.s, &s), 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->d0.s, &f, WAIT_MS));
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.status, 0);
    assert_int_equal(f.call_id, 9);
    tdm_frame_clear(&f);

    /* A second instance of a live node id (an impostor, or a restart the router has not
     * seen the old instance of go yet) is refused, retryably, and takes nothing over: the
     * running request stays with the registered instance, and the impostor's events for it
     * are dropped and counted. */
    Tandem__V1__GenerateRequest gr;
    prompt_req(&gr, "r-restart", "abc", 4, true);
    uint64_t call = generate(e, &gr);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    fake_token(&e->d0, "r-restart", 0, B('a')); /* local prefill: no prefill node up */
    result_t res;
    memset(&res, 0, sizeof res);
    one_chunk(e, call, &res);
    fake_t impostor = {"decode-0", NULL, NULL, 43};
    fake_connect(e, &impostor);
    reg_default(e, &impostor, &g);
    assert_int_equal(fake_register_with(e, &impostor, &g, msg, sizeof msg), TDM_EUNAVAILABLE);
    assert_non_null(strstr(msg, "node 'decode-0' is registered by a live instance"));
    uint64_t stale = tdm_router_metrics(e->r)->stale_instance_messages;
    fake_token(&impostor, "r-restart", 1, B('X'));
    fake_finished(&impostor, "r-restart", TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, 2);
    fake_token(&e->d0, "r-restart", 1, B('b'));
    fake_finished(&e->d0, "r-restart", TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, 2);
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_non_null(strstr(res.text, "b"));
    assert_null(strstr(res.text, "X"));
    assert_true(tdm_router_metrics(e->r)->stale_instance_messages >= stale + 2);
    assert_true(tdm_router_node_up(e->r, "decode-0"));
    tdm_sock_destroy(&impostor.s);
    env_free(e);
}

/* A request id reused right after its request was cancelled: the old attempt's events (a late
 * token, Finished, TaskFailed) never reach the new request, which gets its own text. */
static void test_request_id_reuse(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest gr;
    prompt_req(&gr, "r-reuse", "abc", 4, true);
    uint64_t call = generate(e, &gr);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    uint64_t old_attempt = rs->spec->attempt_id;
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_send_t c = {0};
    c.kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL;
    c.call_id = call;
    assert_int_equal(tdm_sock_send(e->client, &c), 0);
    expect_cancel(e, &e->d0, "r-reuse", tdm_proto_status_to_wire(TDM_ECANCELLED));
    /* the same id at once */
    uint64_t call2 = generate(e, &gr);
    rs = reserve_and_ack(e, &e->d0);
    assert_true(rs->spec->attempt_id != old_attempt);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    uint64_t new_attempt = attempt_for("r-reuse");
    uint64_t stale = tdm_router_metrics(e->r)->stale_attempt_messages;
    attempt_note("r-reuse", old_attempt); /* the old attempt's late events */
    fake_token(&e->d0, "r-reuse", 0, B('X'));
    fake_task_failed(&e->d0, "r-reuse", tdm_proto_status_to_wire(TDM_EINTERNAL), "old", true);
    fake_finished(&e->d0, "r-reuse", TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, 1);
    attempt_note("r-reuse", new_attempt);
    fake_token(&e->d0, "r-reuse", 0, B('n'));
    fake_token(&e->d0, "r-reuse", 1, B('w'));
    fake_finished(&e->d0, "r-reuse", TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, 2);
    result_t res;
    memset(&res, 0, sizeof res);
    collect(e, call2, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "nw");
    assert_int_equal(tdm_router_metrics(e->r)->stale_attempt_messages, stale + 3);
    env_free(e);
}

/* API keys: requests without a listed key get UNAUTHENTICATED. */
static void test_api_keys(void **state)
{
    (void)state;
    env_t *e = env_new("  api_keys: [key-one, key-two]\n");
    /* HEALTH is open, like /health (liveness probes carry no key) */
    Tandem__V1__HealthRequest hr = TANDEM__V1__HEALTH_REQUEST__INIT;
    uint64_t c = send_req(e, M(HEALTH), &hr.base, NULL, 0);
    expect_end(e, c, 0, "ready");
    Tandem__V1__StatusRequest sr = TANDEM__V1__STATUS_REQUEST__INIT;
    c = send_req(e, M(STATUS), &sr.base, NULL, 0);
    expect_end(e, c, TDM_EUNAUTHENTICATED, "an API key is required");
    c = send_req(e, M(STATUS), &sr.base, "key-three", 0);
    expect_end(e, c, TDM_EUNAUTHENTICATED, "not accepted");
    c = send_req(e, M(STATUS), &sr.base, "key-on", 0);
    expect_end(e, c, TDM_EUNAUTHENTICATED, "not accepted");
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "k-1", "abc", 4, true);
    c = send_req(e, M(GENERATE), &g.base, "key-one!", 0);
    expect_end(e, c, TDM_EUNAUTHENTICATED, NULL);
    c = send_req(e, M(HEALTH), &hr.base, "key-two", 0);
    expect_end(e, c, 0, "ready");
    c = send_req(e, M(GENERATE), &g.base, "key-one", 0);
    pump_until_queued(e, 1); /* accepted, waiting for a node */
    (void)c;
    env_free(e);
}

/* STATUS lists every configured node; HEALTH and MODELS describe the cluster and model. */
static void test_status_health_models(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    Tandem__V1__HealthRequest hr = TANDEM__V1__HEALTH_REQUEST__INIT;
    uint64_t c = send_req(e, M(HEALTH), &hr.base, NULL, 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    Tandem__V1__HealthResponse *h = (Tandem__V1__HealthResponse *)tdm_frame_unpack(
        &f, &tandem__v1__health_response__descriptor);
    assert_non_null(h);
    assert_true(h->live);
    assert_false(h->ready);
    protobuf_c_message_free_unpacked(&h->base, NULL);
    fake_register(e, &e->d0);
    c = send_req(e, M(HEALTH), &hr.base, NULL, 0);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.call_id, c);
    assert_non_null(strstr(f.message, "decode nodes prefill locally"));
    h = (Tandem__V1__HealthResponse *)tdm_frame_unpack(&f,
                                                       &tandem__v1__health_response__descriptor);
    assert_true(h->ready);
    assert_string_equal(h->version, TANDEM_VERSION);
    protobuf_c_message_free_unpacked(&h->base, NULL);

    Tandem__V1__ModelsRequest mr = TANDEM__V1__MODELS_REQUEST__INIT;
    send_req(e, M(MODELS), &mr.base, NULL, 0);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    Tandem__V1__ModelsResponse *mo = (Tandem__V1__ModelsResponse *)tdm_frame_unpack(
        &f, &tandem__v1__models_response__descriptor);
    assert_non_null(mo);
    assert_int_equal(mo->n_models, 1);
    assert_string_equal(mo->models[0]->name, "tiny");
    assert_int_equal(mo->models[0]->n_ctx, 256);
    assert_int_equal(mo->models[0]->n_vocab, 512);
    assert_int_equal(mo->models[0]->fingerprint, tdm_router_fingerprint(e->r));
    assert_string_equal(mo->models[0]->chat_template, "gguf"); /* the model's own, compiled */
    assert_int_equal(mo->models[0]->n_aliases, 0);
    assert_string_equal(mo->models[0]->state, "ready"); /* decode-0 is up */
    assert_int_equal(mo->models[0]->decode_nodes_up, 1);
    protobuf_c_message_free_unpacked(&mo->base, NULL);

    fake_heartbeat(e, &e->d0, 60, 0);
    fake_sync(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "st-1", "abc", 4, true);
    generate(e, &g);
    tdm_frame_t rf;
    tdm_frame_init(&rf);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &rf); /* not answered yet */
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__StatusRequest sr = TANDEM__V1__STATUS_REQUEST__INIT;
    send_req(e, M(STATUS), &sr.base, NULL, 0);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    Tandem__V1__ClusterStatus *cs =
        (Tandem__V1__ClusterStatus *)tdm_frame_unpack(&f, &tandem__v1__cluster_status__descriptor);
    assert_non_null(cs);
    assert_string_equal(cs->model, "tiny");
    assert_int_equal(cs->n_nodes, 4);
    assert_string_equal(cs->nodes[0]->node_id, "prefill-0");
    assert_string_equal(cs->nodes[0]->role, "prefill");
    assert_false(cs->nodes[0]->up);
    assert_float_equal(cs->nodes[0]->last_heartbeat_age_s, -1.0, 1e-9);
    const Tandem__V1__NodeStatus *d = cs->nodes[2];
    assert_string_equal(d->node_id, "decode-0");
    assert_true(d->up);
    assert_int_equal(d->kv_blocks_total, 100);
    assert_non_null(d->load);
    assert_int_equal(d->load->kv_blocks_used, 40);
    assert_int_equal(d->load->running, 1);
    assert_int_equal(d->reserved_blocks, 1);
    assert_float_equal(d->load->step_s, 0.02, 1e-9);
    assert_string_equal(d->device, "cpu");
    assert_true(d->last_heartbeat_age_s >= 0 && d->last_heartbeat_age_s < 5);
    assert_false(cs->nodes[3]->up);
    assert_int_equal(cs->requests_running, 1);
    assert_int_equal(cs->requests_queued, 0);
    assert_int_equal(cs->requests_total, 1);
    protobuf_c_message_free_unpacked(&cs->base, NULL);
    tdm_frame_clear(&rf);
    tdm_frame_clear(&f);
    env_free(e);
}

/* A GPU node's registration: host id, the GPU it computes on, the GPUs it sees, and the device
 * transports. */
static void reg_gpu(env_t *e, const fake_t *n, reg_t *g, const char *host, char **uuids,
                    size_t n_uuids, char **transports)
{
    reg_default(e, n, g);
    g->m.device = (char *)"cuda:0";
    g->m.host_id = (char *)host;
    g->m.gpu_uuid = uuids[0];
    g->m.n_gpu_uuids = n_uuids;
    g->m.gpu_uuids = uuids;
    g->m.n_transports = 3;
    g->m.transports = transports;
}

static Tandem__V1__ClusterStatus *get_status(env_t *e, tdm_frame_t *f)
{
    Tandem__V1__StatusRequest sr = TANDEM__V1__STATUS_REQUEST__INIT;
    send_req(e, M(STATUS), &sr.base, NULL, 0);
    assert_true(recv_on(e, e->client, f, WAIT_MS));
    Tandem__V1__ClusterStatus *cs =
        (Tandem__V1__ClusterStatus *)tdm_frame_unpack(f, &tandem__v1__cluster_status__descriptor);
    assert_non_null(cs);
    return cs;
}

/* Registrations with host ids and GPU UUIDs: status shows them and the KV transport of every
 * up pair (cuda_ipc on one host where the prefill node sees the decode node's GPU, nccl to
 * another host, tcp to a CPU node), and the PrefillTask carries the pair's choice. */
static void test_status_kv_transport(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    char *tr[] = {(char *)"tcp", (char *)"nccl", (char *)"cuda_ipc"};
    char *p0_gpus[] = {(char *)"GPU-00000000-0000-0000-0000-000000000000",
                       (char *)"GPU-11111111-1111-1111-1111-111111111111"};
    char *d0_gpus[] = {(char *)"GPU-11111111-1111-1111-1111-111111111111"};
    char *d1_gpus[] = {(char *)"GPU-22222222-2222-2222-2222-222222222222"};
    reg_t g;
    char msg[512];
    reg_gpu(e, &e->p0, &g, "host-a", p0_gpus, 2, tr);
    assert_int_equal(fake_register_with(e, &e->p0, &g, msg, sizeof msg), 0);
    reg_gpu(e, &e->d0, &g, "host-a", d0_gpus, 1, tr);
    assert_int_equal(fake_register_with(e, &e->d0, &g, msg, sizeof msg), 0);
    reg_gpu(e, &e->d1, &g, "host-b", d1_gpus, 1, tr);
    assert_int_equal(fake_register_with(e, &e->d1, &g, msg, sizeof msg), 0);
    fake_register(e, &e->p1); /* a CPU node */

    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__ClusterStatus *cs = get_status(e, &f);
    assert_int_equal(cs->n_nodes, 4);
    assert_string_equal(cs->nodes[0]->host_id, "host-a");
    assert_string_equal(cs->nodes[0]->gpu_uuid, p0_gpus[0]);
    assert_string_equal(cs->nodes[2]->gpu_uuid, d0_gpus[0]);
    assert_string_equal(cs->nodes[3]->host_id, "host-b");
    assert_string_equal(cs->nodes[1]->gpu_uuid, "");
    const char *want[4][3] = {{"prefill-0", "decode-0", "cuda_ipc"},
                              {"prefill-0", "decode-1", "nccl"},
                              {"prefill-1", "decode-0", "tcp"},
                              {"prefill-1", "decode-1", "tcp"}};
    assert_int_equal(cs->n_kv_routes, 4);
    for (size_t i = 0; i < 4; i++) {
        assert_string_equal(cs->kv_routes[i]->prefill_node_id, want[i][0]);
        assert_string_equal(cs->kv_routes[i]->decode_node_id, want[i][1]);
        assert_string_equal(cs->kv_routes[i]->transport, want[i][2]);
    }
    protobuf_c_message_free_unpacked(&cs->base, NULL);
    tdm_frame_clear(&f);

    env_free(e);

    /* the choice travels with the task (one pair up) */
    e = env_new(NULL);
    reg_gpu(e, &e->p0, &g, "host-a", p0_gpus, 2, tr);
    assert_int_equal(fake_register_with(e, &e->p0, &g, msg, sizeof msg), 0);
    reg_gpu(e, &e->d0, &g, "host-a", d0_gpus, 1, tr);
    assert_int_equal(fake_register_with(e, &e->d0, &g, msg, sizeof msg), 0);
    Tandem__V1__GenerateRequest gr;
    prompt_req(&gr, "kv-1", "abc", 4, true);
    generate(e, &gr);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_string_equal(t->decode_node_id, "decode-0");
    assert_string_equal(t->kv_transport, "cuda_ipc");
    protobuf_c_message_free_unpacked(&t->base, NULL);
    env_free(e);
}

/* The client goes away: the next send to it fails and the nodes are told to cancel. */
static void test_client_gone(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-gone", "abc", 8, true);
    generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_sock_destroy(&e->client);
    pump(e, 200); /* the router's socket notices the disconnect */
    fake_token(&e->p0, "r-gone", 0, B('a'));
    expect_cancel(e, &e->p0, "r-gone", 1);
    expect_cancel(e, &e->d0, "r-gone", 1);
    assert_int_equal(tdm_router_n_running(e->r), 0);
    env_free(e);
}

/* Shutdown: requests in flight end with UNAVAILABLE and their nodes get NodeCancel. */
static void test_shutdown(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-shut", "abc", 8, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_router_shutdown(e->r);
    assert_int_equal(tdm_router_poll(e->r, 0), TDM_EPRECONDITION);
    tdm_frame_t f;
    tdm_frame_init(&f);
    double end = tdm_time_now() + WAIT_MS / 1000.0;
    while (tdm_sock_recv(e->client, &f, 10) != TDM_OK && tdm_time_now() < end)
        ;
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.status, TDM_EUNAVAILABLE);
    assert_string_equal(f.message, "router shutting down");
    fake_t *nodes[2] = {&e->p0, &e->d0};
    for (int i = 0; i < 2; i++) {
        end = tdm_time_now() + WAIT_MS / 1000.0;
        int rc;
        while ((rc = tdm_sock_recv(nodes[i]->s, &f, 10)) != TDM_OK && tdm_time_now() < end)
            ;
        assert_int_equal(rc, 0);
        assert_int_equal(f.method, M(NODE_CANCEL));
    }
    tdm_frame_clear(&f);
    env_free(e);
}

/* ---- metrics (router/metrics.h): Prometheus text through METHOD_METRICS ---- */

/* The value of one sample line "SERIES VALUE" in text; fails when the series is missing. */
static double sample_of(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, series, n) == 0 && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    fail_msg("metrics: no sample %s", series);
    return -1;
}

static bool has_series(const char *text, const char *series)
{
    size_t n = strlen(series);
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL)
        if (strncmp(p, series, n) == 0 && p[n] == ' ')
            return true;
    return false;
}

/* text with the router loop's own series and the process figures cut out (in place): they
 * change with every poll. */
static char *without_loop_series(char *text)
{
    char *w = text;
    for (char *p = text; *p;) {
        char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) + 1 : strlen(p);
        if (strncmp(p, "tandem_router_loop", 18) != 0 && strncmp(p, "process_", 8) != 0) {
            memmove(w, p, n);
            w += n;
        }
        p += n;
    }
    *w = '\0';
    return text;
}

/* The text of a METRICS call's message as tdm_proto_metrics_text renders it (checked against
 * tdm_router_metrics_text, which must say the same while nothing happens in between, but for
 * the router loop's series, which change with every poll). Caller frees. */
static char *metrics_call(env_t *e)
{
    Tandem__V1__MetricsRequest mr = TANDEM__V1__METRICS_REQUEST__INIT;
    uint64_t call = send_req(e, M(METRICS), &mr.base, NULL, 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, 0);
    Tandem__V1__MetricsResponse *resp = (Tandem__V1__MetricsResponse *)tdm_frame_unpack(
        &f, &tandem__v1__metrics_response__descriptor);
    assert_non_null(resp);
    assert_string_equal(resp->text, ""); /* data only: the text is the renderer's */
    tdm_buf_t b = TDM_BUF_INIT;
    assert_int_equal(tdm_proto_metrics_text(resp, &b), 0);
    char *text = tdm_buf_take(&b);
    assert_non_null(text);
    protobuf_c_message_free_unpacked(&resp->base, NULL);
    tdm_frame_clear(&f);
    char *direct = NULL;
    size_t len = 0;
    assert_int_equal(tdm_router_metrics_text(e->r, &direct, &len), 0);
    assert_int_equal(len, strlen(direct));
    char *text_cut = tdm_strdup(text);
    assert_non_null(text_cut);
    assert_string_equal(without_loop_series(direct), without_loop_series(text_cut));
    free(text_cut);
    free(direct);
    assert_true(strlen(text) > 0 && text[strlen(text) - 1] == '\n');
    return text;
}

/* Every histogram's buckets are cumulative: non-decreasing, and +Inf equals _count. */
static void check_histograms(const char *text)
{
    const char *names[] = {
        "tandem_time_to_first_token_seconds",   "tandem_inter_token_latency_seconds",
        "tandem_time_per_output_token_seconds", "tandem_e2e_request_latency_seconds",
        "tandem_request_queue_time_seconds",    "tandem_request_prefill_time_seconds",
        "tandem_kv_transfer_time_seconds",      "tandem_decode_reserve_seconds"};
    const double *bounds = tdm_router_hist_bounds();
    for (size_t h = 0; h < sizeof names / sizeof names[0]; h++) {
        char series[160];
        double prev = 0;
        for (size_t i = 0; i < 15; i++) {
            snprintf(series, sizeof series, "%s_bucket{le=\"%g\"}", names[h], bounds[i]);
            double v = sample_of(text, series);
            if (v < prev)
                fail_msg("%s: bucket le=%g (%g) below the previous one (%g)", names[h], bounds[i],
                         v, prev);
            prev = v;
        }
        snprintf(series, sizeof series, "%s_bucket{le=\"+Inf\"}", names[h]);
        double inf = sample_of(text, series);
        assert_true(inf >= prev);
        snprintf(series, sizeof series, "%s_count", names[h]);
        assert_float_equal(sample_of(text, series), inf, 0);
        snprintf(series, sizeof series, "%s_sum", names[h]);
        assert_true(sample_of(text, series) >= 0);
    }
}

/* `promtool check metrics` must accept the text without a word (scripts/setup installs the
 * Debian package prometheus; missing is a failure, not a skip). */
static void promtool_check(env_t *e, const char *text)
{
    if (system("command -v promtool >/dev/null 2>&1") != 0)
        fail_msg("promtool is not installed (Debian package prometheus; run scripts/setup)");
    char path[160], cmd[400];
    snprintf(path, sizeof path, "%s/metrics.txt", e->dir);
    FILE *fp = fopen(path, "w");
    assert_non_null(fp);
    /* vLLM's names hold a ':', which promtool's lint reserves for recording rules; they are
     * vLLM's on purpose (dashboards query them), so the lint sees the other families */
    for (const char *p = text; *p;) {
        const char *nl = strchr(p, '\n');
        size_t n = nl ? (size_t)(nl - p) + 1 : strlen(p);
        if (strncmp(p, "vllm:", 5) != 0 && (n < 12 || strncmp(p + 7, "vllm:", 5) != 0))
            assert_int_equal(fwrite(p, 1, n, fp), n);
        p += n;
    }
    assert_int_equal(fclose(fp), 0);
    snprintf(cmd, sizeof cmd, "promtool check metrics < %s 2>&1", path);
    FILE *pp = popen(cmd, "r");
    assert_non_null(pp);
    char out[4096];
    size_t n = fread(out, 1, sizeof out - 1, pp);
    out[n] = '\0';
    int st = pclose(pp);
    unlink(path);
    if (st != 0 || n != 0)
        fail_msg("promtool check metrics (exit status %d): %s", st, out);
}

/* The vLLM-compatible series of test_metrics's traffic: two completed (4 and 3 tokens, the
 * second with "x" once prefilled), one cancelled, one refused. */
static void check_vllm_series(const char *t, uint32_t prompt_tokens)
{
#define V "{model_name=\"tiny\",engine=\"0\""
    assert_float_equal(sample_of(t, "vllm:prompt_tokens_total" V "}"), prompt_tokens, 0);
    assert_float_equal(sample_of(t, "vllm:generation_tokens_total" V "}"), 7, 0);
    assert_float_equal(sample_of(t, "vllm:prompt_tokens_cached_total" V "}"), 6, 0);
    assert_float_equal(sample_of(t, "vllm:request_success_total" V ",finished_reason=\"stop\"}"), 2,
                       0);
    assert_float_equal(sample_of(t, "vllm:request_success_total" V ",finished_reason=\"length\"}"),
                       0, 0);
    assert_float_equal(sample_of(t, "vllm:request_success_total" V ",finished_reason=\"abort\"}"),
                       1, 0);
    assert_float_equal(sample_of(t, "vllm:request_success_total" V ",finished_reason=\"error\"}"),
                       0, 0);
    assert_float_equal(sample_of(t, "vllm:num_requests_running" V "}"), 0, 0);
    assert_float_equal(sample_of(t, "vllm:num_requests_waiting" V "}"), 0, 0);
    assert_float_equal(sample_of(t, "vllm:num_preemptions_total" V "}"), 0, 0);
    assert_float_equal(sample_of(t, "vllm:time_to_first_token_seconds_count" V "}"), 2, 0);
    assert_float_equal(sample_of(t, "vllm:time_to_first_token_seconds_bucket" V ",le=\"+Inf\"}"), 2,
                       0);
    assert_float_equal(sample_of(t, "vllm:e2e_request_latency_seconds_count" V "}"), 2, 0);
    assert_float_equal(sample_of(t, "vllm:request_decode_time_seconds_count" V "}"), 2, 0);
    assert_float_equal(sample_of(t, "vllm:request_inference_time_seconds_count" V "}"), 2, 0);
    assert_float_equal(sample_of(t, "vllm:request_generation_tokens_sum" V "}"), 7, 0);
    /* 4 and 3 output tokens: neither is at most 2, both at most 5 */
    assert_float_equal(sample_of(t, "vllm:request_generation_tokens_bucket" V ",le=\"2\"}"), 0, 0);
    assert_float_equal(sample_of(t, "vllm:request_generation_tokens_bucket" V ",le=\"5\"}"), 2, 0);
    assert_float_equal(sample_of(t, "vllm:request_prompt_tokens_count" V "}"), 2, 0);
    assert_float_equal(sample_of(t, "tandem_request_generation_tokens_sum"), 7, 0);
    assert_float_equal(sample_of(t,
                                 "vllm:kv_cache_usage_perc{model_name=\"tiny\",engine=\"decode-0\","
                                 "role=\"decode\"}"),
                       0.4, 1e-12);
    assert_float_equal(
        sample_of(t, "vllm:prefix_cache_hits_total{model_name=\"tiny\",engine=\"prefill-0\","
                     "role=\"prefill\"}"),
        4, 0);
    assert_float_equal(sample_of(t, "vllm:spec_decode_num_accepted_tokens_total{model_name="
                                    "\"tiny\",engine=\"decode-0\",role=\"decode\"}"),
                       11, 0);
    assert_false(has_series(t, "vllm:spec_decode_num_accepted_tokens_total{model_name=\"tiny\","
                               "engine=\"prefill-0\",role=\"prefill\"}"));
    assert_float_equal(sample_of(t, "vllm:cache_config_info{block_size=\"16\",cache_dtype=\"f16\","
                                    "enable_prefix_caching=\"True\",engine=\"0\"}"),
                       1, 0);
    assert_non_null(strstr(t, "# TYPE vllm:request_prompt_tokens histogram\n"));
    assert_non_null(strstr(t, "# TYPE vllm:num_requests_running gauge\n"));
#undef V
}

/* The router's process figures: a process that runs has memory, a start time and open fds. */
static void check_process_series(const char *t)
{
    assert_true(sample_of(t, "process_resident_memory_bytes") > 1e6);
    assert_true(sample_of(t, "process_cpu_seconds_total") >= 0);
    assert_true(sample_of(t, "process_open_fds") >= 3);
    double start = sample_of(t, "process_start_time_seconds");
    assert_true(start > 1.6e9 && start <= (double)time(NULL) + 1);
}

static void metrics_heartbeat(fake_t *n, uint32_t used, uint64_t queries, uint64_t hits)
{
    Tandem__V1__Heartbeat h = TANDEM__V1__HEARTBEAT__INIT;
    Tandem__V1__NodeLoad ld = TANDEM__V1__NODE_LOAD__INIT;
    h.load = &ld;
    h.node_id = (char *)n->id;
    ld.kv_blocks_free = 100 - used;
    ld.kv_blocks_used = used;
    ld.kv_blocks_cached = 5;
    ld.running = 2;
    ld.waiting = 1;
    ld.batch_size = 3;
    ld.queued_prefill_tokens = 77;
    ld.prefix_queries = queries;
    ld.prefix_hits = hits;
    h.instance_id = n->instance ? n->instance : FAKE_INSTANCE;
    ld.process_resident_bytes = 1000000 + used;
    ld.process_cpu_seconds = 1.5;
    ld.process_open_fds = 12;
    ld.spec_drafts = 3; /* from every node: the router exports them for decode nodes only */
    ld.spec_draft_tokens = 20;
    ld.spec_accepted_tokens = 11;
    ld.stale_router_frames = 4;
    ld.step_s = 0.5;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(HEARTBEAT), &h.base), 0);
}

static void metrics_finished(fake_t *n, const char *req, uint32_t completion, uint64_t bytes)
{
    Tandem__V1__Finished fin = TANDEM__V1__FINISHED__INIT;
    fin.request_id = (char *)req;
    fin.attempt_id = attempt_for(req);
    fin.reason = FIN(STOP);
    fin.completion_tokens = completion;
    fin.kv_transfer_s = 0.0025;
    fin.kv_transfer_bytes = bytes;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(FINISHED), &fin.base), 0);
}

/* Reserve on d0 acknowledged and the prefill task on p0; returns the prompt's token count. */
static uint32_t metrics_dispatch(env_t *e)
{
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    uint32_t n = (uint32_t)rs->spec->n_prompt_tokens;
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    return n;
}

/* Fake traffic (completed, refused, cancelled, re-dispatched after transfer failures, nodes
 * lost) and the figures METHOD_METRICS reports for it; promtool accepts the text. */
static void test_metrics(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    metrics_heartbeat(&e->d0, 40, 0, 0);
    metrics_heartbeat(&e->p0, 0, 10, 4);
    fake_sync(e, &e->d0);
    fake_sync(e, &e->p0);

    /* a request served in full: 4 tokens, 123456 KV bytes */
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "m-ok", "hello world", 8, true);
    uint64_t call = generate(e, &g);
    uint32_t prompt_tokens = metrics_dispatch(e);
    fake_token(&e->p0, "m-ok", 0, B('a'));
    fake_token(&e->d0, "m-ok", 1, B('b'));
    fake_token(&e->d0, "m-ok", 2, B('c'));
    fake_token(&e->d0, "m-ok", 3, eos());
    metrics_finished(&e->d0, "m-ok", 4, 123456);
    result_t res;
    collect(e, call, &res);
    assert_int_equal(res.status, 0);

    /* refused: max_tokens -1 */
    prompt_req(&g, "m-bad", "x", -1, true);
    call = generate(e, &g);
    expect_end(e, call, TDM_EINVALID, "max_tokens");

    /* cancelled by the client while running; mid-flight the gauges show it running */
    prompt_req(&g, "m-cancel", "abc", 8, true);
    call = generate(e, &g);
    prompt_tokens += metrics_dispatch(e);
    char *mid = metrics_call(e);
    assert_float_equal(sample_of(mid, "tandem_requests_running"), 1, 0);
    assert_float_equal(sample_of(mid, "tandem_requests_queued"), 0, 0);
    free(mid);
    tdm_send_t c = {0};
    c.kind = K_CANCEL;
    c.method = M(GENERATE);
    c.call_id = call;
    assert_int_equal(tdm_sock_send(e->client, &c), 0);
    expect_cancel(e, &e->p0, "m-cancel", 1);
    expect_cancel(e, &e->d0, "m-cancel", 1);

    /* three failed attempts, then served: a prefill failure before its first token (not a
     * transfer failure), one after it (the transfer failed), a transfer the decode node
     * rejected */
    prompt_req(&g, "m-retry", "retry me", 8, true);
    call = generate(e, &g);
    uint32_t retry_tokens = metrics_dispatch(e);
    prompt_tokens += retry_tokens;
    fake_task_failed(&e->p0, "m-retry", 8, "prefill node task table full", true);
    expect_cancel(e, &e->p0, "m-retry", 1);
    expect_cancel(e, &e->d0, "m-retry", 1);
    assert_int_equal(metrics_dispatch(e), retry_tokens);
    fake_token(&e->p0, "m-retry", 0, B('x'));
    fake_task_failed(&e->p0, "m-retry", 4, "KV transfer to decode-0 failed: no acknowledgement",
                     true);
    expect_cancel(e, &e->p0, "m-retry", 1);
    expect_cancel(e, &e->d0, "m-retry", 1);
    assert_int_equal(metrics_dispatch(e), retry_tokens);
    fake_token(&e->p0, "m-retry", 0, B('x')); /* already delivered: a duplicate */
    fake_task_failed(&e->d0, "m-retry", 3, "KV transfer rejected: block 0 checksum mismatch", true);
    expect_cancel(e, &e->p0, "m-retry", 1);
    expect_cancel(e, &e->d0, "m-retry", 1);
    assert_int_equal(metrics_dispatch(e), retry_tokens);
    fake_token(&e->p0, "m-retry", 0, B('x')); /* a duplicate again */
    fake_token(&e->d0, "m-retry", 1, B('y'));
    fake_token(&e->d0, "m-retry", 2, eos());
    metrics_finished(&e->d0, "m-retry", 3, 1000);
    collect(e, call, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "xy");

    char *t = metrics_call(e);
    /* requests */
    assert_float_equal(sample_of(t, "tandem_requests_received_total"), 4, 0);
    assert_float_equal(sample_of(t, "tandem_requests_total{status=\"OK\",finish_reason=\"stop\"}"),
                       2, 0);
    assert_float_equal(
        sample_of(t, "tandem_requests_total{status=\"OK\",finish_reason=\"length\"}"), 0, 0);
    assert_float_equal(
        sample_of(t, "tandem_requests_total{status=\"INVALID_ARGUMENT\",finish_reason=\"none\"}"),
        1, 0);
    assert_float_equal(
        sample_of(t, "tandem_requests_total{status=\"CANCELLED\",finish_reason=\"cancelled\"}"), 1,
        0);
    assert_false(
        has_series(t, "tandem_requests_total{status=\"INTERNAL\",finish_reason=\"error\"}"));
    assert_float_equal(sample_of(t, "tandem_requests_redispatched_total"), 3, 0);
    assert_float_equal(sample_of(t, "tandem_duplicate_token_events_total"), 2, 0);
    assert_float_equal(sample_of(t, "tandem_requests_queue_full_total"), 0, 0);
    assert_float_equal(sample_of(t, "tandem_requests_running"), 0, 0);
    assert_float_equal(sample_of(t, "tandem_requests_queued"), 0, 0);
    /* tokens and KV transfers */
    assert_float_equal(sample_of(t, "tandem_prompt_tokens_total"), prompt_tokens, 0);
    assert_float_equal(sample_of(t, "tandem_generation_tokens_total"), 7, 0);
    assert_float_equal(sample_of(t, "tandem_prompt_tokens_cached_total"), 6, 0);
    assert_float_equal(sample_of(t, "tandem_kv_transfer_bytes_total"), 124456, 0);
    assert_float_equal(sample_of(t, "tandem_kv_transfer_failures_total"), 2, 0);
    /* histograms: counts, sums, bucket placement */
    check_histograms(t);
    assert_float_equal(sample_of(t, "tandem_time_to_first_token_seconds_count"), 2, 0);
    assert_float_equal(sample_of(t, "tandem_inter_token_latency_seconds_count"), 5, 0);
    assert_float_equal(sample_of(t, "tandem_time_per_output_token_seconds_count"), 2, 0);
    assert_float_equal(sample_of(t, "tandem_e2e_request_latency_seconds_count"), 2, 0);
    assert_float_equal(sample_of(t, "tandem_request_queue_time_seconds_count"), 3, 0);
    assert_float_equal(sample_of(t, "tandem_request_prefill_time_seconds_count"), 2, 0);
    assert_float_equal(sample_of(t, "tandem_request_prefill_time_seconds_sum"), 0.025, 1e-12);
    /* prefill_s 0.0125 is above 0.01 and not above 0.025 */
    assert_float_equal(sample_of(t, "tandem_request_prefill_time_seconds_bucket{le=\"0.01\"}"), 0,
                       0);
    assert_float_equal(sample_of(t, "tandem_request_prefill_time_seconds_bucket{le=\"0.025\"}"), 2,
                       0);
    assert_float_equal(sample_of(t, "tandem_kv_transfer_time_seconds_count"), 2, 0);
    assert_float_equal(sample_of(t, "tandem_kv_transfer_time_seconds_sum"), 0.005, 1e-12);
    assert_float_equal(sample_of(t, "tandem_kv_transfer_time_seconds_bucket{le=\"0.001\"}"), 0, 0);
    assert_float_equal(sample_of(t, "tandem_kv_transfer_time_seconds_bucket{le=\"0.0025\"}"), 2, 0);
    /* nodes */
    assert_float_equal(sample_of(t, "tandem_node_up{node=\"decode-0\",role=\"decode\"}"), 1, 0);
    assert_float_equal(sample_of(t, "tandem_node_up{node=\"prefill-0\",role=\"prefill\"}"), 1, 0);
    assert_float_equal(sample_of(t, "tandem_node_up{node=\"prefill-1\",role=\"prefill\"}"), 0, 0);
    assert_float_equal(sample_of(t, "tandem_node_up{node=\"decode-1\",role=\"decode\"}"), 0, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_failures_total{node=\"decode-0\",role=\"decode\"}"), 0, 0);
    assert_float_equal(
        sample_of(t, "tandem_prefix_cache_queries_total{node=\"prefill-0\",role=\"prefill\"}"), 10,
        0);
    assert_float_equal(
        sample_of(t, "tandem_prefix_cache_hits_total{node=\"prefill-0\",role=\"prefill\"}"), 4, 0);
    assert_false(
        has_series(t, "tandem_prefix_cache_hits_total{node=\"prefill-1\",role=\"prefill\"}"));
    assert_float_equal(
        sample_of(t, "tandem_node_kv_blocks_used{node=\"decode-0\",role=\"decode\"}"), 40, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_kv_blocks_capacity{node=\"decode-0\",role=\"decode\"}"), 100, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_kv_blocks_cached{node=\"decode-0\",role=\"decode\"}"), 5, 0);
    assert_float_equal(sample_of(t, "tandem_node_running{node=\"decode-0\",role=\"decode\"}"), 2,
                       0);
    assert_float_equal(sample_of(t, "tandem_node_waiting{node=\"decode-0\",role=\"decode\"}"), 1,
                       0);
    assert_float_equal(sample_of(t, "tandem_node_batch_size{node=\"decode-0\",role=\"decode\"}"), 3,
                       0);
    assert_float_equal(
        sample_of(t, "tandem_node_queued_prefill_tokens{node=\"prefill-0\",role=\"prefill\"}"), 77,
        0);
    assert_float_equal(
        sample_of(t, "tandem_node_step_time_seconds{node=\"prefill-0\",role=\"prefill\"}"), 0.5, 0);
    assert_false(has_series(t, "tandem_node_running{node=\"decode-1\",role=\"decode\"}"));
    /* speculative decoding: decode nodes only (a prefill node never drafts) */
    assert_float_equal(
        sample_of(t, "tandem_spec_decode_drafts_total{node=\"decode-0\",role=\"decode\"}"), 3, 0);
    assert_float_equal(sample_of(t, "tandem_spec_decode_draft_tokens_total{node=\"decode-0\","
                                    "role=\"decode\"}"),
                       20, 0);
    assert_float_equal(sample_of(t, "tandem_spec_decode_accepted_tokens_total{node=\"decode-0\","
                                    "role=\"decode\"}"),
                       11, 0);
    assert_false(
        has_series(t, "tandem_spec_decode_drafts_total{node=\"prefill-0\",role=\"prefill\"}"));
    /* frames of another router instance the nodes dropped (their heartbeats) */
    assert_float_equal(sample_of(t, "tandem_node_stale_router_frames_total{node=\"decode-0\","
                                    "role=\"decode\"}"),
                       4, 0);
    assert_false(has_series(t, "tandem_spec_decode_accepted_tokens_total{node=\"prefill-0\","
                               "role=\"prefill\"}"));
    char info[200];
    snprintf(info, sizeof info, "tandem_build_info{version=\"%s\",model=\"tiny\"}", TANDEM_VERSION);
    assert_float_equal(sample_of(t, info), 1, 0);
    /* every family announced once with HELP and TYPE */
    assert_non_null(strstr(t, "# HELP tandem_time_to_first_token_seconds "));
    assert_non_null(strstr(t, "# TYPE tandem_time_to_first_token_seconds histogram\n"));
    assert_non_null(strstr(t, "# TYPE tandem_requests_total counter\n"));
    assert_non_null(strstr(t, "# TYPE tandem_node_up gauge\n"));
    check_vllm_series(t, prompt_tokens);
    assert_float_equal(sample_of(t, "tandem_node_process_resident_memory_bytes{node=\"decode-0\","
                                    "role=\"decode\"}"),
                       1000040, 0);
    assert_float_equal(sample_of(t, "tandem_node_process_cpu_seconds_total{node=\"prefill-0\","
                                    "role=\"prefill\"}"),
                       1.5, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_process_open_fds{node=\"prefill-0\",role=\"prefill\"}"), 12, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_kv_cache_usage_ratio{node=\"decode-0\",role=\"decode\"}"), 0.4,
        1e-12);
    check_process_series(t);
    promtool_check(e, t);
    free(t);

    /* the nodes go silent: down, counted, their load gauges gone, their counters kept */
    tdm_router_set_heartbeat(e->r, 0, 100);
    pump_until_down(e, "decode-0");
    pump_until_down(e, "prefill-0");
    t = metrics_call(e);
    assert_float_equal(sample_of(t, "tandem_node_up{node=\"decode-0\",role=\"decode\"}"), 0, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_failures_total{node=\"decode-0\",role=\"decode\"}"), 1, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_failures_total{node=\"prefill-0\",role=\"prefill\"}"), 1, 0);
    assert_float_equal(
        sample_of(t, "tandem_node_failures_total{node=\"prefill-1\",role=\"prefill\"}"), 0, 0);
    assert_false(has_series(t, "tandem_node_kv_blocks_used{node=\"decode-0\",role=\"decode\"}"));
    assert_float_equal(
        sample_of(t, "tandem_prefix_cache_queries_total{node=\"prefill-0\",role=\"prefill\"}"), 10,
        0);
    assert_non_null(strstr(t, "# TYPE tandem_node_kv_blocks_used gauge\n"));
    promtool_check(e, t);
    free(t);

    /* prefill-0 restarted (a new instance, its own counters from 0): the router's series add
     * the new process's figures to the old one's, so none goes back (issue 37) */
    tdm_router_set_heartbeat(e->r, 0, e->hb_timeout_ms);
    fake_t p0b = {"prefill-0", NULL, NULL, 43};
    fake_connect(e, &p0b);
    fake_register(e, &p0b);
    metrics_heartbeat(&p0b, 0, 3, 1);
    fake_sync(e, &p0b);
    t = metrics_call(e);
#define P0 "{node=\"prefill-0\",role=\"prefill\"}"
    assert_float_equal(sample_of(t, "tandem_prefix_cache_queries_total" P0), 13, 0);
    assert_float_equal(sample_of(t, "tandem_prefix_cache_hits_total" P0), 5, 0);
    assert_float_equal(sample_of(t, "tandem_node_stale_router_frames_total" P0), 8, 0);
    assert_float_equal(sample_of(t, "tandem_node_process_cpu_seconds_total" P0), 3, 0);
#undef P0
    /* a beat with lower figures than an earlier one of the same process lowers nothing */
    metrics_heartbeat(&p0b, 0, 2, 0);
    fake_sync(e, &p0b);
    char *t2 = metrics_call(e);
    assert_float_equal(
        sample_of(t2, "tandem_prefix_cache_queries_total{node=\"prefill-0\",role=\"prefill\"}"), 13,
        0);
    promtool_check(e, t2);
    free(t2);
    free(t);
    tdm_sock_destroy(&p0b.s);
    env_free(e);
}

/* ---- one prompt rule: the router, `tandem generate -m` and `tandem tokenize --chat` ---- */

#define PROMPT_SYSTEM "You are a tiny test model."
#define PROMPT_USER "Hi there"

/* The tiny model with a ChatML template that has a default system message (as SmolLM2's
 * has) and add_bos_token = true, so both halves of the BOS rule show: ChatML gets BOS
 * (<|im_start|>, id 510) added, Llama-3 and Llama-2 write their own. */
static void write_prompt_model(const char *path)
{
    static const char tpl[] =
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\\n" PROMPT_SYSTEM "<|im_end|>\\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + "
        "'\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
        "{% endif %}";
    tdm_tiny_llama_spec_t spec = {.n_vocab = 512, .n_ctx = N_CTX, .seed = 7};
    tdm_gguf_writer_t *w = NULL;
    tdm_error_t err = {0};
    assert_int_equal(tdm_test_tiny_llama_build(&spec, &w, &err), 0);
    assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.chat_template", tpl), 0);
    assert_int_equal(tdm_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", true), 0);
    assert_int_equal(tdm_gguf_writer_write_file(w, path, &err), 0);
    tdm_gguf_writer_destroy(&w);
}

/* Runs the shell command cmd; returns its stdout (heap, NUL-terminated) and checks it exits 0. */
static char *run_capture(const char *cmd)
{
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    size_t cap = 1 << 16, n = 0, got;
    char *out = malloc(cap);
    assert_non_null(out);
    while ((got = fread(out + n, 1, cap - n - 1, p)) > 0)
        n += got;
    out[n] = '\0';
    int st = pclose(p);
    if (st != 0)
        fail_msg("'%s' failed (status %d): %s", cmd, st, out);
    return out;
}

/* The shell arguments of a chat with optional system message and template name. */
static void chat_args(char *buf, size_t cap, const char *system, const char *tmpl)
{
    snprintf(buf, cap, "--chat '" PROMPT_USER "'%s%s%s%s%s", system ? " --system '" : "",
             system ? system : "", system ? "'" : "", tmpl ? " --chat-template " : "",
             tmpl ? tmpl : "");
}

/* The prompt text the case must render, BOS included (decoded with special tokens). The
 * model's own Jinja template (tmpl NULL) writes "<|im_start|>", the BOS text, first: llama.cpp's
 * rule cuts it and the tokenizer's BOS stands for it, so there is one; the built-in ChatML gets
 * BOS added in front of its own "<|im_start|>". */
static void expected_prompt(char *buf, size_t cap, const char *system, const char *tmpl)
{
    if (!tmpl || strcmp(tmpl, "chatml") == 0)
        snprintf(buf, cap,
                 "%s<|im_start|>system\n%s<|im_end|>\n<|im_start|>user\n" PROMPT_USER
                 "<|im_end|>\n<|im_start|>assistant\n",
                 tmpl ? "<|im_start|>" : "", system ? system : PROMPT_SYSTEM);
    else if (strcmp(tmpl, "llama3") == 0)
        snprintf(buf, cap,
                 "<|begin_of_text|>%s%s%s<|start_header_id|>user<|end_header_id|>\n\n" PROMPT_USER
                 "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n",
                 system ? "<|start_header_id|>system<|end_header_id|>\n\n" : "",
                 system ? system : "", system ? "<|eot_id|>" : "");
    else
        snprintf(buf, cap, "<s>[INST] %s%s%s" PROMPT_USER " [/INST]", system ? "<<SYS>>\n" : "",
                 system ? system : "", system ? "\n<</SYS>>\n\n" : "");
}

/* For one template override (NULL: none) and system message (NULL: none), the router's
 * SequenceSpec.prompt_tokens, tdm_prompt_encode's ids, `tandem tokenize --chat`'s ids and
 * `tandem generate -m`'s prompt token count are the same, and the ids decode to the rendering
 * the template must give. */
static void prompt_case(const char *model, const char *tmpl, const char *system)
{
    char yaml[128] = "";
    if (tmpl)
        snprintf(yaml, sizeof yaml, "  chat_template: %s\n", tmpl);
    env_model_file = model;
    env_model_yaml = yaml;
    env_t *e = env_new(NULL);
    env_model_file = NULL;
    env_model_yaml = NULL;
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);

    /* the router */
    Tandem__V1__ChatMessage m0 = TANDEM__V1__CHAT_MESSAGE__INIT,
                            m1 = TANDEM__V1__CHAT_MESSAGE__INIT;
    m0.role = (char *)"system";
    m0.content = (char *)system;
    m1.role = (char *)"user";
    m1.content = (char *)PROMPT_USER;
    Tandem__V1__ChatMessage *msgs[2] = {&m0, &m1};
    Tandem__V1__ChatList chat = TANDEM__V1__CHAT_LIST__INIT;
    chat.n_messages = system ? 2 : 1;
    chat.messages = system ? msgs : msgs + 1;
    Tandem__V1__GenerateRequest g = TANDEM__V1__GENERATE_REQUEST__INIT;
    g.request_id = (char *)"r-prompt";
    g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    g.chat = &chat;
    g.max_tokens = 1;
    generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    const int32_t *ids = rs->spec->prompt_tokens;
    size_t n = rs->spec->n_prompt_tokens;
    assert_true(n > 8);

    /* real values: the rendering, and BOS added only where the template does not write it */
    char want[1024], *text = NULL;
    expected_prompt(want, sizeof want, system, tmpl);
    size_t text_len = 0;
    assert_int_equal(tdm_tokenizer_decode(e->tok, ids, n, true, &text, &text_len, NULL), 0);
    assert_string_equal(text, want);
    free(text);
    bool chatml = tmpl && strcmp(tmpl, "chatml") == 0;
    assert_int_equal(ids[0] == 510 && ids[1] == 510, chatml);

    /* tdm_prompt_encode with the same pick, system message given explicitly */
    tdm_error_t err = {0};
    tdm_chat_pick_t pick;
    assert_int_equal(tdm_chat_template_pick(tdm_model_gguf(e->model), e->tok, tmpl, &pick, &err),
                     0);
    tdm_chat_message_t user = {.role = "user", .content = PROMPT_USER};
    tdm_prompt_input_t in = {.messages = &user, .n_messages = 1, .system = system};
    int32_t *mine = NULL;
    size_t n_mine = 0;
    assert_int_equal(tdm_prompt_encode(e->tok, &pick, &in, &mine, &n_mine, NULL, &err), 0);
    tdm_chat_pick_release(&pick);
    assert_int_equal(n_mine, n);
    assert_memory_equal(mine, ids, n * sizeof *ids);
    free(mine);

    /* the command-line tools */
    char args[256], cmd[1024];
    chat_args(args, sizeof args, system, tmpl);
    snprintf(cmd, sizeof cmd, "'%s/client/tandem' tokenize -m '%s' %s", TDM_BINARY_DIR, model,
             args);
    char *out = run_capture(cmd);
    char *p = out;
    for (size_t i = 0; i < n; i++) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v != ids[i])
            fail_msg("tokenize --chat: id %zu differs from the router's %d: %s", i, (int)ids[i],
                     out);
        p = end;
    }
    assert_string_equal(p, "\n");
    free(out);
    snprintf(cmd, sizeof cmd, "'%s/client/tandem' generate -m '%s' %s -n 1 -t 1 2>&1 >/dev/null",
             TDM_BINARY_DIR, model, args);
    out = run_capture(cmd);
    p = strstr(out, "prompt tokens: ");
    if (!p)
        fail_msg("generate -m printed no prompt token count: %s", out);
    assert_int_equal(strtoul(p + strlen("prompt tokens: "), NULL, 10), n);
    free(out);

    protobuf_c_message_free_unpacked(&rs->base, NULL);
    env_free(e);
}

/* max_tokens unset (0): the router decides what fits, the context left after the prompt (the
 * tiny model's 256 tokens are under TDM_ROUTER_MAX_TOKENS_DEFAULT), and reserves that. */
static void test_max_tokens_unset(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-fit", "hello world", 0, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    assert_string_equal(rs->spec->request_id, "r-fit");
    assert_true(rs->spec->n_prompt_tokens > 0 && rs->spec->n_prompt_tokens < N_CTX);
    assert_int_equal(rs->spec->max_tokens, N_CTX - rs->spec->n_prompt_tokens);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    (void)call;
    env_free(e);
}

/* Starts a router on model with the model section's extra yaml; returns it (NULL with *err). */
static tdm_router_t *router_on(const char *model, const char *extra, tdm_net_t *net,
                               tdm_logger_t *log, tdm_config_t *cfg, tdm_error_t *err)
{
    char yaml[1024];
    snprintf(yaml, sizeof yaml, "model:\n  path: %s\n%snodes:\n  - {id: d, role: decode}\n", model,
             extra);
    if (tdm_config_load_string(yaml, strlen(yaml), "t.yaml", cfg, err) != 0)
        fail_msg("config: %s", err->msg);
    free(cfg->router.client_endpoint); /* the OS picks the ports */
    free(cfg->router.node_endpoint);
    cfg->router.client_endpoint = tdm_strdup("tcp://127.0.0.1:*");
    cfg->router.node_endpoint = tdm_strdup("tcp://127.0.0.1:*");
    return tdm_router_new(cfg, net, log, err);
}

/* A model whose own template does not compile refuses the router's start, naming
 * tokenizer.chat_template and the line:column; an override (a built-in name or a template file)
 * serves it anyway. */
static void test_broken_model_template(void **state)
{
    (void)state;
    char dir[] = "/tmp/tdm_router_tpl_XXXXXX", model[64], file[64];
    assert_non_null(mkdtemp(dir));
    snprintf(model, sizeof model, "%s/broken.gguf", dir);
    snprintf(file, sizeof file, "%s/t.jinja", dir);
    tdm_tiny_llama_spec_t spec = {.n_vocab = 512, .n_ctx = N_CTX, .seed = 7};
    tdm_gguf_writer_t *w = NULL;
    tdm_error_t err = {0};
    assert_int_equal(tdm_test_tiny_llama_build(&spec, &w, &err), 0);
    assert_int_equal(tdm_gguf_writer_set_str(w, "tokenizer.chat_template", "hi\n{% for %}"), 0);
    assert_int_equal(tdm_gguf_writer_write_file(w, model, &err), 0);
    tdm_gguf_writer_destroy(&w);
    FILE *f = fopen(file, "w");
    assert_non_null(f);
    fputs("{% for m in messages %}{{ m.content }}{% endfor %}", f);
    fclose(f);
    tdm_logger_t log;
    tdm_log_init(&log, "router");
    log.level = TDM_LOG_OFF;
    tdm_net_t *net = tdm_net_new(1, &err);
    assert_non_null(net);
    tdm_config_t cfg;
    tdm_router_t *r = router_on(model, "", net, &log, &cfg, &err);
    assert_null(r);
    assert_int_equal(err.code, TDM_EINVALID);
    assert_string_equal(err.field, "tokenizer.chat_template");
    assert_non_null(strstr(err.msg, "does not compile"));
    assert_non_null(strstr(err.msg, ": 2:"));
    tdm_config_free(&cfg);
    char extra[128];
    const char *const overrides[] = {"chatml", file};
    for (size_t i = 0; i < 2; i++) {
        snprintf(extra, sizeof extra, "  chat_template: %s\n", overrides[i]);
        r = router_on(model, extra, net, &log, &cfg, &err);
        if (!r)
            fail_msg("override %s: %s", overrides[i], err.msg);
        tdm_router_destroy(&r);
        tdm_config_free(&cfg);
    }
    tdm_net_destroy(&net);
    unlink(model);
    unlink(file);
    rmdir(dir);
}

/* A request's own chat_template, with its chat_template_kwargs, renders the prompt instead of
 * the model's (bos_token's text cut and BOS added as for the model's template); a template
 * that does not compile, kwargs that are no object and a raise_exception are refused naming the
 * field, raise_exception with the template's own message. */
static void test_request_chat_template(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__ChatMessage m0 = TANDEM__V1__CHAT_MESSAGE__INIT;
    m0.role = (char *)"user";
    m0.content = (char *)"hi";
    Tandem__V1__ChatMessage *msgs[1] = {&m0};
    Tandem__V1__ChatList chat = TANDEM__V1__CHAT_LIST__INIT;
    chat.n_messages = 1;
    chat.messages = msgs;
    chat.chat_template =
        (char *)"{{ bos_token }}{{ greeting }}{% for m in messages %}{{ m.content }}{% endfor %}";
    chat.chat_template_kwargs = (char *)"{\"greeting\": \"<|im_end|>\"}";
    Tandem__V1__GenerateRequest g = TANDEM__V1__GENERATE_REQUEST__INIT;
    g.request_id = (char *)"r-tpl";
    g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    g.chat = &chat;
    g.max_tokens = 1;
    generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    int32_t *hi = NULL;
    size_t n_hi = 0;
    assert_int_equal(tdm_tokenizer_encode(e->tok, "hi", 2, false, true, &hi, &n_hi, NULL), 0);
    assert_int_equal(rs->spec->n_prompt_tokens, 2 + n_hi); /* BOS once, <|im_end|>, "hi" */
    assert_int_equal(rs->spec->prompt_tokens[0], 510);
    assert_int_equal(rs->spec->prompt_tokens[1], 511);
    assert_memory_equal(rs->spec->prompt_tokens + 2, hi, n_hi * sizeof *hi);
    free(hi);
    protobuf_c_message_free_unpacked(&rs->base, NULL);

    g.request_id = (char *)"r-tpl-bad";
    chat.chat_template = (char *)"{{ x + }}";
    bad(e, &g, TDM_EINVALID, "chat.chat_template: 1:");
    chat.chat_template = (char *)"{{ raise_exception('no ' + messages[0].content) }}";
    bad(e, &g, TDM_EINVALID, "no hi");
    chat.chat_template = (char *)"{% if false %}x{% endif %}";
    bad(e, &g, TDM_EINVALID, "the chat template rendered an empty prompt");
    chat.chat_template = (char *)"{{ messages[0].content }}";
    chat.chat_template_kwargs = (char *)"[1]";
    bad(e, &g, TDM_EINVALID, "chat.chat_template_kwargs must be a JSON object");
    env_free(e);
}

/* The cache compiles a text once, finds it by hash and bytes, evicts the least recently used
 * when full, and passes compile errors through. */
static void test_template_cache(void **state)
{
    (void)state;
    rt_template_cache_t c;
    memset(&c, 0, sizeof c);
    tdm_error_t err = {0};
    const tdm_jinja_t *a = rt_template_cache_get(&c, "A{{ 1 }}", 8, &err);
    assert_non_null(a);
    assert_ptr_equal(rt_template_cache_get(&c, "A{{ 1 }}", 8, &err), a);
    assert_int_equal(c.compiles, 1);
    char src[RT_TEMPLATE_CACHE_SIZE][16];
    for (int i = 0; i < RT_TEMPLATE_CACHE_SIZE - 1; i++) {
        snprintf(src[i], sizeof src[i], "t%d", i);
        assert_non_null(rt_template_cache_get(&c, src[i], strlen(src[i]), &err));
    }
    assert_int_equal(c.compiles, RT_TEMPLATE_CACHE_SIZE);
    assert_ptr_equal(rt_template_cache_get(&c, "A{{ 1 }}", 8, &err), a); /* now the most recent */
    assert_non_null(rt_template_cache_get(&c, "new", 3, &err));          /* evicts "t0" */
    assert_ptr_equal(rt_template_cache_get(&c, "A{{ 1 }}", 8, &err), a);
    assert_int_equal(c.compiles, RT_TEMPLATE_CACHE_SIZE + 1);
    assert_non_null(rt_template_cache_get(&c, "t0", 2, &err));
    assert_int_equal(c.compiles, RT_TEMPLATE_CACHE_SIZE + 2);
    assert_null(rt_template_cache_get(&c, "ok\n{% if %}", 11, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "2:"));
    rt_template_cache_fini(&c);
}

/* Waits for the END of a refused call and checks its ErrorDetail body: the field at fault
 * and, for a length error, the prompt's tokens, the context and what fits. */
static void expect_detail(env_t *e, uint64_t call, int status, const char *field, uint32_t n_ctx,
                          uint32_t *prompt_tokens)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (!recv_on(e, e->client, &f, WAIT_MS))
        fail_msg("no END for call %" PRIu64 " (want field '%s')", call, field);
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, status);
    Tandem__V1__ErrorDetail *d =
        (Tandem__V1__ErrorDetail *)tdm_frame_unpack(&f, &tandem__v1__error_detail__descriptor);
    assert_non_null(d);
    if (strcmp(d->field, field) != 0)
        fail_msg("field '%s', want '%s' (message '%s')", d->field, field, f.message);
    assert_int_equal(d->n_ctx, n_ctx);
    uint32_t fit = d->prompt_tokens < n_ctx ? n_ctx - d->prompt_tokens : 0;
    assert_int_equal(d->max_tokens_fit, fit);
    if (!n_ctx)
        assert_int_equal(d->prompt_tokens, 0);
    if (prompt_tokens)
        *prompt_tokens = d->prompt_tokens;
    protobuf_c_message_free_unpacked(&d->base, NULL);
    tdm_frame_clear(&f);
}

/* A refusal names the field at fault in the END's ErrorDetail, and a request too long for the
 * context says how long the prompt is and what fits. */
static void test_refusal_detail(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "", "hello", -1, true);
    expect_detail(e, generate(e, &g), TDM_EINVALID, "max_tokens", 0, NULL);
    prompt_req(&g, "", "", 4, true);
    expect_detail(e, generate(e, &g), TDM_EINVALID, "prompt", 0, NULL);
    prompt_req(&g, "has space", "hello", 4, true);
    expect_detail(e, generate(e, &g), TDM_EINVALID, "request_id", 0, NULL);
    prompt_req(&g, "", "hello", 4, true);
    g.model = (char *)"other-model";
    expect_detail(e, generate(e, &g), TDM_ENOTFOUND, "model", 0, NULL);
    char *stops[2] = {(char *)"ok", (char *)""};
    prompt_req(&g, "", "hello", 4, true);
    g.n_stop = 2;
    g.stop = stops;
    expect_detail(e, generate(e, &g), TDM_EINVALID, "stop[1]", 0, NULL);

    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    prompt_req(&g, "", "hello", 4, true);
    g.sampling = &sp;
    sp.top_p = 1.5f;
    sp.set_mask = TDM_PROTO_SET_TOP_P;
    expect_detail(e, generate(e, &g), TDM_EINVALID, "sampling.top_p", 0, NULL);
    sp.n_logprobs = 21;
    sp.set_mask = TDM_PROTO_SET_N_LOGPROBS;
    expect_detail(e, generate(e, &g), TDM_EINVALID, "sampling.n_logprobs", 0, NULL);
    int32_t stop_ids[1] = {9999};
    sp.n_stop_token_ids = 1;
    sp.stop_token_ids = stop_ids;
    sp.set_mask = TDM_PROTO_SET_STOP_TOKEN_IDS;
    expect_detail(e, generate(e, &g), TDM_EINVALID, "sampling.stop_token_ids[0]", 0, NULL);

    /* too long: max_tokens over what the prompt leaves of the 256-token context */
    uint32_t n_prompt = 0;
    prompt_req(&g, "", "hello", 1000, true);
    expect_detail(e, generate(e, &g), TDM_EINVALID, "max_tokens", N_CTX, &n_prompt);
    assert_true(n_prompt >= 1 && n_prompt < 16);
    /* the prompt alone fills it: nothing fits */
    char longp[2200] = "";
    for (int i = 0; i < 300; i++)
        strcat(longp, "q ");
    prompt_req(&g, "", longp, 4, true);
    expect_detail(e, generate(e, &g), TDM_EINVALID, "prompt", N_CTX, &n_prompt);
    assert_true(n_prompt >= N_CTX);
    /* chat input: the field is the messages */
    Tandem__V1__ChatMessage m0 = TANDEM__V1__CHAT_MESSAGE__INIT;
    Tandem__V1__ChatMessage *msgs[1] = {&m0};
    Tandem__V1__ChatList chat = TANDEM__V1__CHAT_LIST__INIT;
    m0.role = (char *)"user";
    m0.content = (char *)"a\xff";
    chat.messages = msgs;
    chat.n_messages = 1;
    tandem__v1__generate_request__init(&g);
    g.input_case = TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT;
    g.chat = &chat;
    g.max_tokens = 4;
    expect_detail(e, generate(e, &g), TDM_EINVALID, "chat.messages[0].content", 0, NULL);
    env_free(e);
}

/* Waits for the END of call: INVALID_ARGUMENT, ErrorDetail.field "constraint", a message
 * with `has`. */
static void expect_constraint_refused(env_t *e, uint64_t call, const char *has)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (!recv_on(e, e->client, &f, WAIT_MS))
        fail_msg("no END (want '%s')", has);
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, TDM_EINVALID);
    if (!strstr(f.message, has))
        fail_msg("message '%s' lacks '%s'", f.message, has);
    Tandem__V1__ErrorDetail *d =
        (Tandem__V1__ErrorDetail *)tdm_frame_unpack(&f, &tandem__v1__error_detail__descriptor);
    assert_non_null(d);
    assert_string_equal(d->field, "constraint");
    protobuf_c_message_free_unpacked(&d->base, NULL);
    tdm_frame_clear(&f);
}

/* Structured output: a bad constraint is refused before anything is scheduled, with
 * ErrorDetail.field "constraint" and the compiler's message; a good one is compiled once and
 * reaches both nodes as GRAMMAR text with its XXH3-64 hash. */
static void test_constraint(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    Tandem__V1__Constraint c = TANDEM__V1__CONSTRAINT__INIT;
    const struct {
        int kind;
        const char *text, *has;
    } bad_ones[] = {
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_JSON_SCHEMA, "{\"type\": 3}", "type"},
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_JSON_SCHEMA, "{\"type\": \"object\"",
         "constraint"},
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_JSON_SCHEMA,
         "{\"type\":\"object\",\"propertyNames\":{\"maxLength\":3}}", "propertyNames"},
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_GRAMMAR, "root ::= (", "line 1"},
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_GRAMMAR, "root ::= \"a\" root", "root"},
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_CHOICE, "[]", "choice"},
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_CHOICE, "[1]", "choice"},
        {TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_REGEX, "(a", "regex"},
        {42, "x", "kind"},
    };
    for (size_t i = 0; i < sizeof bad_ones / sizeof bad_ones[0]; i++) {
        prompt_req(&g, "", "hello", 4, true);
        c.kind = (Tandem__V1__ConstraintKind)bad_ones[i].kind;
        c.text = (char *)bad_ones[i].text;
        g.constraint = &c;
        expect_constraint_refused(e, generate(e, &g), bad_ones[i].has);
    }
    expect_none(e, e->d0.s, 50); /* nothing was scheduled */

    prompt_req(&g, "r-json", "hello", 4, true);
    c.kind = TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_JSON_SCHEMA;
    c.text = (char *)"{\"type\":\"object\",\"properties\":{\"a\":{\"type\":\"integer\"}}}";
    g.constraint = &c;
    generate(e, &g);
    tdm_buf_t want = {0};
    uint64_t hash = 0;
    assert_int_equal(tdm_constraint_compile(TDM_CONSTRAINT_JSON_SCHEMA, c.text, strlen(c.text),
                                            &want, &hash, NULL),
                     0);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0);
    assert_non_null(rs->spec->constraint);
    assert_int_equal(rs->spec->constraint->kind,
                     TANDEM__V1__CONSTRAINT_KIND__CONSTRAINT_KIND_GRAMMAR);
    assert_string_equal(rs->spec->constraint->text, want.data);
    assert_true(rs->spec->constraint->hash == hash);
    assert_true(hash == tdm_constraint_hash(want.data, want.len));
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_non_null(t->spec->constraint);
    assert_string_equal(t->spec->constraint->text, want.data);
    assert_true(t->spec->constraint->hash == hash);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_buf_free(&want);
    env_free(e);
}

/* The admission estimate's arithmetic (admit.h) with injected step times. */
static void test_admit_estimate(void **state)
{
    (void)state;
    /* idle node, 0.5 s passes: prefill ceil(1000 / 512) = 2 passes, decode 10 */
    rt_admit_load_t l = {0.5, 8, 512, 0, 0, 0, 1};
    rt_admit_estimate_t e = rt_admit_estimate(&l, 1000, 10);
    assert_true(e.measured);
    assert_float_equal(e.start_s, 0, 1e-9);
    assert_float_equal(e.finish_s, 6.0, 1e-9);
    /* 7 ahead of 8 slots: a slot is free, start now */
    l.n_ahead = 7;
    l.tokens_ahead = 700;
    e = rt_admit_estimate(&l, 1000, 10);
    assert_float_equal(e.start_s, 0, 1e-9);
    /* 20 ahead (mean 50 tokens to go): 2 waves of 50 passes before a slot frees */
    l.n_ahead = 20;
    l.tokens_ahead = 1000;
    e = rt_admit_estimate(&l, 1000, 10);
    assert_float_equal(e.start_s, 50.0, 1e-9);
    assert_float_equal(e.finish_s, 56.0, 1e-9);
    /* max_running 0 counts as one slot; max_batch_tokens 0 prefills in one pass */
    rt_admit_load_t one = {2.0, 0, 0, 3, 30, 0, 1};
    e = rt_admit_estimate(&one, 100, 4);
    assert_float_equal(e.start_s, 60.0, 1e-9);
    assert_float_equal(e.finish_s, 70.0, 1e-9);
    /* no step time measured yet: admit */
    rt_admit_load_t none = {0, 8, 512, 100, 10000, 0, 1};
    e = rt_admit_estimate(&none, 1000, 10);
    assert_false(e.measured);
    assert_float_equal(e.finish_s, 0, 1e-9);
}

/* The batch-aware estimate: a pass of 0.1 s at one sequence plus 0.01 s per extra sequence
 * (an injected step time), and the line rt_admit_observe fits to heartbeats. */
static void test_admission_estimate_batch(void **state)
{
    (void)state;
    /* 3 ahead of 8 slots: the request joins a batch of 4, t(4) = 0.13 s; 1 prefill pass +
     * 10 decode passes = 1.43 s */
    rt_admit_load_t l = {0.1, 8, 512, 3, 30, 0.01, 1};
    rt_admit_estimate_t e = rt_admit_estimate(&l, 100, 10);
    assert_float_equal(e.start_s, 0, 1e-9);
    assert_float_equal(e.finish_s, 11 * 0.13, 1e-9);
    assert_float_equal(e.alone_s, 11 * 0.1, 1e-9);
    assert_float_equal(e.drain_s, 10 * 0.12, 1e-9); /* 1 wave of 10 tokens at t(3) */
    /* 20 ahead, 50 tokens each to go: 2 full waves at t(8) = 0.17 s, then a batch of 8 */
    l.n_ahead = 20;
    l.tokens_ahead = 1000;
    e = rt_admit_estimate(&l, 100, 10);
    assert_float_equal(e.start_s, 2 * 50 * 0.17, 1e-9);
    assert_float_equal(e.finish_s, 2 * 50 * 0.17 + 11 * 0.17, 1e-9);
    assert_float_equal(e.drain_s, 3 * 50 * 0.17, 1e-9); /* ceil(20 / 8) waves */
    /* measured at a batch of 8 (0.17 s): an idle node's pass is read down the line, but never
     * below a quarter of the measured one */
    rt_admit_load_t at8 = {0.17, 8, 512, 0, 0, 0.01, 8};
    e = rt_admit_estimate(&at8, 100, 10);
    assert_float_equal(e.finish_s, 11 * 0.1, 1e-9);
    at8.step_per_seq_s = 1.0;
    e = rt_admit_estimate(&at8, 100, 10);
    assert_float_equal(e.finish_s, 11 * 0.17 / 4, 1e-9);

    /* the fit: heartbeats on the line t(b) = 0.01 + 0.002 b give its slope and a point on it */
    rt_step_fit_t f;
    memset(&f, 0, sizeof f);
    double t, b, per_seq;
    assert_false(rt_admit_step_model(&f, &t, &b, &per_seq));
    rt_admit_observe(&f, 0, 0.5);  /* no batch: ignored */
    rt_admit_observe(&f, 4, -1.0); /* no step time: ignored */
    assert_false(rt_admit_step_model(&f, &t, &b, &per_seq));
    uint32_t batches[] = {1, 8, 32, 64, 16, 1, 48};
    for (size_t i = 0; i < sizeof batches / sizeof batches[0]; i++)
        rt_admit_observe(&f, batches[i], 0.01 + 0.002 * batches[i]);
    assert_true(rt_admit_step_model(&f, &t, &b, &per_seq));
    assert_float_equal(per_seq, 0.002, 1e-9);
    assert_float_equal(t, 0.01 + 0.002 * b, 1e-9);
    /* only ever seen idle: each sequence beyond the batch seen adds 0.35 of its pass */
    memset(&f, 0, sizeof f);
    rt_admit_observe(&f, 1, 0.014);
    rt_admit_observe(&f, 1, 0.014);
    assert_true(rt_admit_step_model(&f, &t, &b, &per_seq));
    assert_float_equal(b, 1, 1e-9);
    assert_float_equal(per_seq, 0.35 * 0.014, 1e-9);
    rt_admit_load_t idle = {t, 64, 2048, 0, 0, per_seq, b};
    e = rt_admit_estimate(&idle, 6, 32);
    assert_float_equal(e.finish_s, 33 * 0.014, 1e-9);
    idle.n_ahead = 63; /* the 64th of a burst joins a batch of 64: 1 + 63 * 0.35 idle passes */
    e = rt_admit_estimate(&idle, 6, 32);
    assert_float_equal(e.finish_s, 33 * 0.014 * (1 + 63 * 0.35), 1e-9);
}

/* A heartbeat of d (NOTIFY): running/waiting requests, its last forward pass (step_s over
 * batch sequences) and its last pass of decode rows only (decode_s over decode_batch; 0: none
 * yet). */
static void node_heartbeat(env_t *e, fake_t *d, uint32_t running, uint32_t waiting, double step_s,
                           uint32_t batch, double decode_s, uint32_t decode_batch)
{
    Tandem__V1__Heartbeat h = TANDEM__V1__HEARTBEAT__INIT;
    Tandem__V1__NodeLoad ld = TANDEM__V1__NODE_LOAD__INIT;
    h.load = &ld;
    h.node_id = (char *)d->id;
    ld.kv_blocks_free = 100;
    ld.running = running;
    ld.waiting = waiting;
    h.instance_id = d->instance ? d->instance : FAKE_INSTANCE;
    ld.step_s = step_s;
    ld.batch_size = batch;
    ld.decode_step_s = decode_s;
    ld.decode_batch_size = decode_batch;
    assert_int_equal(tdm_sock_notify(d->s, NULL, 0, M(HEARTBEAT), &h.base), 0);
    fake_sync(e, d);
}

/* A heartbeat of d reporting step_s per decode pass and running/waiting requests. */
static void slow_heartbeat(env_t *e, fake_t *d, double step_s, uint32_t running, uint32_t waiting)
{
    node_heartbeat(e, d, running, waiting, step_s, 0, step_s, running ? running : 1);
}

/* Waits for the END of call: RESOURCE_EXHAUSTED from admission control, retry_after_s as
 * given (UINT32_MAX: any), the estimate in the message. */
static void expect_shed(env_t *e, uint64_t call, uint32_t retry_after_s, const char *has,
                        const char *has_too)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (!recv_on(e, e->client, &f, WAIT_MS))
        fail_msg("no END for call %" PRIu64, call);
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, TDM_ERESOURCE);
    if (!strstr(f.message, "cannot finish this request before its deadline") ||
        !strstr(f.message, has) || !strstr(f.message, has_too))
        fail_msg("message '%s', want one containing '%s' and '%s'", f.message, has, has_too);
    Tandem__V1__ErrorDetail *d =
        (Tandem__V1__ErrorDetail *)tdm_frame_unpack(&f, &tandem__v1__error_detail__descriptor);
    assert_non_null(d);
    if (retry_after_s != UINT32_MAX)
        assert_int_equal(d->retry_after_s, retry_after_s);
    protobuf_c_message_free_unpacked(&d->base, NULL);
    tdm_frame_clear(&f);
}

/* Admission control: with a decode node whose heartbeat reports 2 s passes, a request that
 * cannot finish by its deadline is refused with RESOURCE_EXHAUSTED and a retry hint before
 * any DecodeReserve is sent; one that can is dispatched. */
static void test_admission(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->d0);
    slow_heartbeat(e, &e->d0, 2.0, 0, 0);
    Tandem__V1__GenerateRequest g;
    /* idle node: 1 prefill pass + 100 decode passes = 202 s > 20 s; a slot is free now */
    prompt_req(&g, "shed-1", "abc", 100, true);
    uint64_t call = send_req(e, M(GENERATE), &g.base, NULL, tdm_net_now_ms() + 20000);
    expect_shed(e, call, 1, "earliest start in ~0.0 s, finish in ~202.0 s",
                "alone on an idle node it would still take longer");
    /* 8 running + 8 waiting on 8 slots, 100 tokens each to go: 2 waves of 100 passes */
    slow_heartbeat(e, &e->d0, 2.0, 8, 8);
    prompt_req(&g, "shed-2", "abc", 100, true);
    call = send_req(e, M(GENERATE), &g.base, NULL, tdm_net_now_ms() + 20000);
    expect_shed(e, call, 400, "earliest start in ~400.0 s", "retry after 400 s");
    /* 2 tokens (start 2 waves * 2 passes * 2 s = 8 s, finish 14 s) within the default 600 s */
    prompt_req(&g, "fits", "abc", 2, true);
    generate(e, &g);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f);
    assert_string_equal(rs->spec->request_id,
                        "fits"); /* the first reserve: none for the shed ones */
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    assert_int_equal(tdm_router_metrics(e->r)->shed, 2);
    assert_int_equal(tdm_router_metrics(e->r)->queue_full, 0);
    env_free(e);
}

/* An idle node's heartbeat with the given last pass and last decode-only pass. */
static void pass_heartbeat(env_t *e, fake_t *d, double step_s, uint32_t batch, double decode_s,
                           uint32_t decode_batch)
{
    node_heartbeat(e, d, 0, 0, step_s, batch, decode_s, decode_batch);
}

/* Admission reads decode passes only: a node that prefills its own prompts (local_prefill)
 * reports passes of whole prompts (here 3 s over 16 sequences) far longer than its decode
 * passes (20 ms); the estimate must not take those for decode passes and refuse requests the
 * node finishes in ~2 s. Until the node has run a decode pass, it is not measured: admitted. */
static void test_admission_decode_passes(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    /* only prompt passes so far: no decode step time, admitted though a pass took 3 s */
    pass_heartbeat(e, &e->d0, 3.0, 16, 0, 0);
    prompt_req(&g, "first", "abc", 100, true);
    send_req(e, M(GENERATE), &g.base, NULL, tdm_net_now_ms() + 20000);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve(e, &e->d0, &f);
    assert_string_equal(rs->spec->request_id, "first");
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    /* decode passes of 20 ms at 1 and 4 sequences beside 3 s prompt passes: 101 passes at
     * ~20-40 ms fit in 20 s */
    for (int i = 0; i < 4; i++) {
        pass_heartbeat(e, &e->d0, 3.0, 16, 0.02, 1);
        pass_heartbeat(e, &e->d0, 3.0, 16, 0.02, 4);
    }
    prompt_req(&g, "second", "abc", 100, true);
    send_req(e, M(GENERATE), &g.base, NULL, tdm_net_now_ms() + 20000);
    rs = expect_reserve(e, &e->d0, &f);
    assert_string_equal(rs->spec->request_id, "second");
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    tdm_frame_clear(&f);
    assert_int_equal(tdm_router_metrics(e->r)->shed, 0);
    /* and a pass of decode rows that slow does refuse it */
    for (int i = 0; i < 60; i++)
        pass_heartbeat(e, &e->d0, 3.0, 16, 3.0, 1);
    prompt_req(&g, "third", "abc", 100, true);
    uint64_t call = send_req(e, M(GENERATE), &g.base, NULL, tdm_net_now_ms() + 20000);
    expect_shed(e, call, UINT32_MAX, "finish in ~", "retry after");
    env_free(e);
}

/* The three ways into a prompt agree under every template override, with and without a system
 * message: an override of the model's own family (chatml here) keeps its default system
 * message, as no override does; the others have none. */
static void test_prompt_agrees(void **state)
{
    (void)state;
    char dir[64] = "/tmp/tdm_prompt_XXXXXX", model[128];
    assert_non_null(mkdtemp(dir));
    snprintf(model, sizeof model, "%s/tiny-chat.gguf", dir);
    write_prompt_model(model);
    const char *tmpls[] = {NULL, "chatml", "llama3", "llama2"};
    for (size_t t = 0; t < 4; t++) {
        prompt_case(model, tmpls[t], NULL);
        prompt_case(model, tmpls[t], "Be short.");
    }
    unlink(model);
    rmdir(dir);
}

/* ---- the router's data structures: the index by key and the deadline heap ---- */

typedef struct keyed {
    char key[16];
    rt_index_entry_t entry;
    rt_heap_entry_t heap;
} keyed_t;

static keyed_t *keyed_of(const rt_index_entry_t *e)
{
    return TDM_CONTAINER_OF(e, keyed_t, entry);
}

/* The entry of ix under key, comparing keys as a caller does, or NULL. */
static keyed_t *index_find(const rt_index_t *ix, const char *key)
{
    uint64_t h = rt_index_hash(key, strlen(key), 0);
    for (rt_index_entry_t *e = rt_index_first(ix, h); e; e = rt_index_next(e))
        if (strcmp(keyed_of(e)->key, key) == 0)
            return keyed_of(e);
    return NULL;
}

static void test_index(void **state)
{
    (void)state;
    /* the hash is XXH3_64bits, seeded */
    assert_true(rt_index_hash("req-1", 5, 0) == XXH3_64bits("req-1", 5));
    assert_true(rt_index_hash("req-1", 5, 42) == XXH3_64bits_withSeed("req-1", 5, 42));
    rt_index_t ix;
    assert_int_equal(rt_index_init(&ix, 1), TDM_OK);
    assert_int_equal(ix.mask, 15); /* at least 16 buckets */
    enum { N = 1000 };
    keyed_t *k = calloc(N, sizeof *k);
    assert_non_null(k);
    for (int i = 0; i < N; i++) {
        snprintf(k[i].key, sizeof k[i].key, "req-%d", i);
        rt_index_insert(&ix, &k[i].entry, rt_index_hash(k[i].key, strlen(k[i].key), 0));
    }
    assert_int_equal(ix.n, N);
    assert_true(ix.mask + 1 >= N); /* it grew: one entry per bucket or fewer */
    for (int i = 0; i < N; i++)
        assert_ptr_equal(index_find(&ix, k[i].key), &k[i]);
    assert_null(index_find(&ix, "req-1000"));
    /* every other one removed: the rest are still found */
    for (int i = 0; i < N; i += 2)
        rt_index_remove(&ix, &k[i].entry);
    assert_int_equal(ix.n, N / 2);
    for (int i = 0; i < N; i++)
        assert_ptr_equal(index_find(&ix, k[i].key), i % 2 ? &k[i] : NULL);
    rt_index_fini(&ix);
    free(k);
}

/* Entries that share a key (or a hash) are all found, newest first; entries of another hash in
 * the same bucket are skipped. */
static void test_index_shared_keys(void **state)
{
    (void)state;
    rt_index_t ix;
    assert_int_equal(rt_index_init(&ix, 16), TDM_OK);
    keyed_t a = {.key = "x"}, b = {.key = "x"}, c = {.key = "y"};
    uint64_t h = 5;
    rt_index_insert(&ix, &a.entry, h);
    rt_index_insert(&ix, &c.entry, h + 16); /* same bucket of 16, another hash */
    rt_index_insert(&ix, &b.entry, h);
    rt_index_entry_t *e = rt_index_first(&ix, h);
    assert_ptr_equal(e, &b.entry);
    e = rt_index_next(e);
    assert_ptr_equal(e, &a.entry);
    assert_null(rt_index_next(e));
    assert_ptr_equal(rt_index_first(&ix, h + 16), &c.entry);
    assert_null(rt_index_first(&ix, h + 32));
    /* growing the buckets keeps the newest-first order of a key's entries */
    enum { MORE = 100 };
    keyed_t more[MORE];
    for (int i = 0; i < MORE; i++)
        rt_index_insert(&ix, &more[i].entry, 1000 + (uint64_t)i);
    assert_true(ix.mask + 1 >= MORE + 3);
    assert_ptr_equal(rt_index_first(&ix, h), &b.entry);
    assert_ptr_equal(rt_index_next(&b.entry), &a.entry);
    assert_ptr_equal(rt_index_first(&ix, h + 16), &c.entry);
    for (int i = 0; i < MORE; i++)
        rt_index_remove(&ix, &more[i].entry);
    rt_index_remove(&ix, &b.entry);
    assert_ptr_equal(rt_index_first(&ix, h), &a.entry);
    rt_index_remove(&ix, &a.entry);
    assert_null(rt_index_first(&ix, h));
    assert_int_equal(ix.n, 1);
    rt_index_fini(&ix);
}

/* Checks the heap property of every parent and child, and the entries' positions. */
static void heap_check(const rt_heap_t *h)
{
    for (size_t i = 0; i < h->n; i++) {
        assert_int_equal(h->v[i]->pos, i);
        if (i > 0)
            assert_true(h->v[(i - 1) / 2]->key <= h->v[i]->key);
    }
}

static void test_heap(void **state)
{
    (void)state;
    rt_heap_t h;
    rt_heap_init(&h);
    assert_null(rt_heap_top(&h));
    enum { N = 500 };
    keyed_t *k = calloc(N, sizeof *k);
    assert_non_null(k);
    uint64_t x = 12345;
    for (int i = 0; i < N; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull; /* an LCG: a fixed shuffle */
        rt_heap_entry_init(&k[i].heap);
        assert_false(rt_heap_contains(&k[i].heap));
        assert_int_equal(rt_heap_push(&h, &k[i].heap, (x >> 33) % 1000), TDM_OK);
        assert_true(rt_heap_contains(&k[i].heap));
    }
    heap_check(&h);
    /* a third removed from anywhere in the heap, twice each (the second does nothing) */
    for (int i = 0; i < N; i += 3) {
        rt_heap_remove(&h, &k[i].heap);
        rt_heap_remove(&h, &k[i].heap);
        assert_false(rt_heap_contains(&k[i].heap));
        heap_check(&h);
    }
    size_t left = h.n;
    assert_int_equal(left, N - (N + 2) / 3);
    /* the rest come out in order of their keys */
    uint64_t last = 0;
    size_t popped = 0;
    rt_heap_entry_t *e;
    while ((e = rt_heap_top(&h))) {
        assert_true(e->key >= last);
        last = e->key;
        rt_heap_remove(&h, e);
        popped++;
    }
    assert_int_equal(popped, left);
    assert_int_equal(h.n, 0);
    rt_heap_fini(&h);
    free(k);
}

/* Equal keys: all come out, and the one with the smaller key always first. */
static void test_heap_equal_keys(void **state)
{
    (void)state;
    rt_heap_t h;
    rt_heap_init(&h);
    keyed_t k[5];
    const uint64_t keys[5] = {7, 7, 3, 7, 3};
    for (int i = 0; i < 5; i++) {
        rt_heap_entry_init(&k[i].heap);
        assert_int_equal(rt_heap_push(&h, &k[i].heap, keys[i]), TDM_OK);
    }
    const uint64_t want[5] = {3, 3, 7, 7, 7};
    for (int i = 0; i < 5; i++) {
        rt_heap_entry_t *e = rt_heap_top(&h);
        assert_non_null(e);
        assert_int_equal(e->key, want[i]);
        rt_heap_remove(&h, e);
        heap_check(&h);
    }
    assert_null(rt_heap_top(&h));
    rt_heap_fini(&h);
}

/* ---- liveness: suspect before down, a stalled loop charges nothing ----
 * These tests drive the liveness check with tdm_router_check_liveness and times of their own:
 * a first call far in the future (a stall the loop "had") stops the polls' real clock from
 * advancing liveness, then each step adds 100 ms. So the outcome never depends on how fast
 * the machine runs the test. */

#define LIVE_STEP_S 0.1

/* The nodes in alive[] (NULL-terminated) heartbeat and are handled; the others stay silent. */
static void live_heartbeats(env_t *e, fake_t **alive)
{
    for (fake_t **n = alive; *n; n++) {
        fake_heartbeat(e, *n, (*n)->id[0] == 'd' ? 10 : 100, 0);
        fake_sync(e, *n);
    }
}

/* Steps the liveness clock from *t (LIVE_STEP_S each, alive[] heartbeating before each) until
 * node id is suspect (want_down false) or down; fails after 200 steps. Returns whether it was
 * seen suspect before it went down. */
static bool live_step_until(env_t *e, double *t, fake_t **alive, const char *id, bool want_down)
{
    bool saw_suspect = false;
    for (int k = 0; k < 200; k++) {
        live_heartbeats(e, alive);
        *t += LIVE_STEP_S;
        tdm_router_check_liveness(e->r, *t);
        saw_suspect = saw_suspect || tdm_router_node_suspect(e->r, id);
        for (fake_t **n = alive; *n; n++)
            if (!tdm_router_node_up(e->r, (*n)->id) || tdm_router_node_suspect(e->r, (*n)->id))
                fail_msg("%s heartbeats and is %s", (*n)->id,
                         tdm_router_node_up(e->r, (*n)->id) ? "suspect" : "down");
        if (want_down ? !tdm_router_node_up(e->r, id) : tdm_router_node_suspect(e->r, id))
            return saw_suspect;
    }
    fail_msg("node %s not %s after 200 steps", id, want_down ? "down" : "suspect");
    return false;
}

/* A decode node silent past the heartbeat timeout is suspect: no new work goes to it, its
 * running request goes on (its next token is delivered, and the node is healthy again); silent
 * past twice the timeout it is down and the request fails with UNAVAILABLE. */
/* p0, d0 and d1 registered; request "r-sus" running on p0 -> d0, its first token ('a') in
 * res. Returns its call. */
static uint64_t suspect_setup(env_t *e, result_t *res)
{
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-sus", "abc", 8, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs = reserve_and_ack(e, &e->d0); /* equal room: the first */
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    Tandem__V1__PrefillTask *task = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&task->base, NULL);
    fake_token(&e->p0, "r-sus", 0, B('a'));
    memset(res, 0, sizeof *res);
    one_chunk(e, call, res);
    return call;
}

static void test_node_suspect_then_down(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    result_t res;
    uint64_t call = suspect_setup(e, &res);

    /* 1 s timeout; the first check is a stall: everyone spoke just before it */
    tdm_router_set_heartbeat(e->r, 0, 1000);
    fake_t *all[] = {&e->p0, &e->d0, &e->d1, NULL};
    live_heartbeats(e, all);
    double t = tdm_time_now() + 1000.0;
    tdm_router_check_liveness(e->r, t);
    fake_t *alive[] = {&e->p0, &e->d1, NULL};
    live_step_until(e, &t, alive, "decode-0", false);
    assert_true(tdm_router_node_up(e->r, "decode-0"));
    char *text = metrics_call(e);
    assert_float_equal(sample_of(text, "tandem_node_suspect{node=\"decode-0\",role=\"decode\"}"), 1,
                       0);
    assert_float_equal(sample_of(text, "tandem_node_state{node=\"decode-0\",role=\"decode\"}"), 1,
                       0);
    assert_float_equal(sample_of(text, "tandem_node_state{node=\"decode-1\",role=\"decode\"}"), 2,
                       0);
    promtool_check(e, text);
    free(text);

    /* new work goes to decode-1 although decode-0 has more room (99 blocks against 10) */
    Tandem__V1__GenerateRequest g2;
    prompt_req(&g2, "r-new", "xyz", 8, true);
    generate(e, &g2);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs2 = expect_reserve(e, &e->d1, &f);
    assert_string_equal(rs2->spec->request_id, "r-new");
    protobuf_c_message_free_unpacked(&rs2->base, NULL);
    tdm_frame_clear(&f);
    Tandem__V1__PrefillTask *t2 = expect_task(e, &e->p0); /* sent with the reservation */
    assert_string_equal(t2->decode_node_id, "decode-1");
    protobuf_c_message_free_unpacked(&t2->base, NULL);

    /* the running request goes on; the message makes decode-0 healthy again */
    fake_token(&e->d0, "r-sus", 1, B('b'));
    one_chunk(e, call, &res);
    assert_string_equal(res.text, "ab");
    assert_false(tdm_router_node_suspect(e->r, "decode-0"));
    assert_true(tdm_router_node_up(e->r, "decode-0"));

    /* silent again: suspect first, then down, and its request migrates to decode-1 (the
     * output delivered, "ab", travels in the new reservation) */
    assert_true(live_step_until(e, &t, alive, "decode-0", true));
    (void)call;
    Tandem__V1__DecodeReserve *rs3 = expect_reserve_for(e, &e->d1, &f, "r-sus");
    assert_int_equal(rs3->spec->n_output_tokens, 2);
    assert_int_equal(rs3->spec->output_tokens[0], B('a'));
    assert_int_equal(rs3->spec->output_tokens[1], B('b'));
    protobuf_c_message_free_unpacked(&rs3->base, NULL);
    tdm_frame_clear(&f);
    text = metrics_call(e);
    assert_float_equal(
        sample_of(text, "tandem_node_suspicions_total{node=\"decode-0\",role=\"decode\"}"), 2, 0);
    assert_float_equal(
        sample_of(text, "tandem_node_failures_total{node=\"decode-0\",role=\"decode\"}"), 1, 0);
    assert_float_equal(sample_of(text, "tandem_node_state{node=\"decode-0\",role=\"decode\"}"), 0,
                       0);
    assert_float_equal(sample_of(text, "tandem_node_suspect{node=\"decode-0\",role=\"decode\"}"), 0,
                       0);
    free(text);
    env_free(e);
}

/* ---- migration: a request on a decode node that dies resumes on another pair ---- */

/* p0, d0 and d1 registered, a 1 s heartbeat timeout driven by the liveness clock from *t;
 * request id (prompt "abc", max_tokens, seeded sampling) runs p0 -> d0, and the tokens
 * out[0..n_out) arrive (index 0 from p0, the rest from d0) and reach the client (res).
 * *first: its first reservation (caller frees). Returns its call. */
static uint64_t migrate_setup(env_t *e, double *t, const char *id, int max_tokens,
                              const int32_t *out, uint32_t n_out, result_t *res,
                              Tandem__V1__DecodeReserve **first)
{
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    tdm_router_set_heartbeat(e->r, 0, 1000);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, id, "abc", max_tokens, true);
    Tandem__V1__SamplingParams sp = TANDEM__V1__SAMPLING_PARAMS__INIT;
    sp.temperature = 0.8f;
    sp.seed = 1234;
    sp.has_seed = true;
    sp.set_mask = (1u << 0) | (1u << 8);
    g.sampling = &sp;
    uint64_t call = generate(e, &g);
    *first = reserve_and_ack(e, &e->d0); /* equal room: the first */
    assert_int_equal((*first)->spec->n_output_tokens, 0);
    Tandem__V1__PrefillTask *task = expect_task(e, &e->p0);
    assert_int_equal(task->spec->n_output_tokens, 0);
    protobuf_c_message_free_unpacked(&task->base, NULL);
    memset(res, 0, sizeof *res);
    for (uint32_t i = 0; i < n_out; i++) {
        fake_token(i == 0 ? &e->p0 : &e->d0, id, i, out[i]);
        one_chunk(e, call, res);
    }
    /* d0 falls silent: suspect, then down */
    fake_t *all[] = {&e->p0, &e->d0, &e->d1, NULL};
    live_heartbeats(e, all);
    *t = tdm_time_now() + 1000.0;
    tdm_router_check_liveness(e->r, *t);
    return call;
}

/* The decode node of a running request goes down after two tokens: the request is reserved
 * on the other decode node and prefilled again with prompt + the two tokens delivered as
 * their own field, under a new attempt with the same seed and max_tokens; the stream goes on
 * at index 2 without a gap or a repeat, usage counts each token once, and the migration is
 * counted. */
static void test_migrate_decode_down(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    result_t res;
    double t;
    Tandem__V1__DecodeReserve *rs0;
    const int32_t out[2] = {B('a'), B('b')};
    uint64_t call = migrate_setup(e, &t, "r-mig", 8, out, 2, &res, &rs0);
    uint64_t attempt0 = rs0->spec->attempt_id;
    fake_t *alive[] = {&e->p0, &e->d1, NULL};
    live_step_until(e, &t, alive, "decode-0", true);
    /* the old attempt ends on the prefill node (NodeCancel), the new one is reserved on d1 */
    expect_cancel(e, &e->p0, "r-mig", 1);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve_for(e, &e->d1, &f, "r-mig");
    assert_int_not_equal(rs->spec->attempt_id, attempt0);
    assert_int_equal(rs->spec->n_prompt_tokens, rs0->spec->n_prompt_tokens);
    assert_memory_equal(rs->spec->prompt_tokens, rs0->spec->prompt_tokens,
                        rs0->spec->n_prompt_tokens * sizeof *rs0->spec->prompt_tokens);
    assert_int_equal(rs->spec->n_output_tokens, 2);
    assert_int_equal(rs->spec->output_tokens[0], B('a'));
    assert_int_equal(rs->spec->output_tokens[1], B('b'));
    assert_int_equal(rs->spec->max_tokens, 8); /* max_tokens counts the delivered output too */
    assert_non_null(rs->spec->sampling);
    assert_true(rs->spec->sampling->seed == 1234 && rs->spec->sampling->has_seed);
    assert_float_equal(rs->spec->sampling->temperature, 0.8f, 1e-6);
    assert_false(rs->local_prefill);
    reply_ack(&e->d1, &f, "r-mig", 1);
    tdm_frame_clear(&f);
    Tandem__V1__PrefillTask *task = expect_task(e, &e->p0);
    assert_string_equal(task->decode_node_id, "decode-1");
    assert_int_equal(task->spec->n_prompt_tokens, rs0->spec->n_prompt_tokens);
    assert_int_equal(task->spec->n_output_tokens, 2);
    assert_int_equal(task->spec->output_tokens[0], B('a'));
    assert_int_equal(task->spec->output_tokens[1], B('b'));
    assert_int_equal(task->spec->attempt_id, rs->spec->attempt_id);
    protobuf_c_message_free_unpacked(&task->base, NULL);
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    /* the resumed prefill samples index 2, the new decode node goes on from 3 */
    fake_token(&e->p0, "r-mig", 2, B('c'));
    fake_token(&e->d1, "r-mig", 3, B('d'));
    fake_token(&e->d1, "r-mig", 1, B('x')); /* a repeat of an index delivered: dropped */
    fake_finished(&e->d1, "r-mig", FIN(STOP), 4);
    result_t rest;
    collect(e, call, &rest);
    assert_int_equal(rest.status, TDM_OK);
    assert_int_equal(rest.index[0], 2); /* no gap, no repeat */
    assert_string_equal(rest.text, "cd");
    assert_int_equal(rest.n_ids, 2);
    assert_int_equal(rest.finish, FIN(STOP));
    assert_int_equal(rest.usage.completion_tokens, 4);
    assert_int_equal(rest.usage.prompt_tokens, rs0->spec->n_prompt_tokens);
    assert_true(rest.timings.ttft_s > 0 && rest.timings.ttft_s <= rest.timings.e2e_s);
    assert_string_equal(res.text, "ab");
    char *text = metrics_call(e);
    assert_float_equal(sample_of(text, "tandem_requests_migrated_total"), 1, 0);
    assert_float_equal(sample_of(text, "tandem_requests_redispatched_total"), 1, 0);
    assert_float_equal(sample_of(text, "tandem_generation_tokens_total"), 4, 0);
    free(text);
    protobuf_c_message_free_unpacked(&rs0->base, NULL);
    env_free(e);
}

/* A decode node lost after the last token of a request but before its Finished: the output
 * delivered already ends the request (max_tokens reached; or an end-of-generation token), so
 * it completes at once, OK, without a migration. */
static void test_migrate_output_already_complete(void **state)
{
    (void)state;
    const int32_t eos = 511; /* the tiny model's "<|im_end|>" (tiny_model.h) */
    for (int k = 0; k < 2; k++) {
        env_t *e = env_new(NULL);
        result_t res;
        double t;
        Tandem__V1__DecodeReserve *rs0;
        const int32_t out[2] = {B('a'), k == 0 ? B('b') : eos};
        uint64_t call = migrate_setup(e, &t, "r-end", k == 0 ? 2 : 8, out, 2, &res, &rs0);
        fake_t *alive[] = {&e->p0, &e->d1, NULL};
        live_step_until(e, &t, alive, "decode-0", true);
        result_t rest;
        collect(e, call, &rest);
        assert_int_equal(rest.status, TDM_OK);
        assert_int_equal(rest.finish, k == 0 ? FIN(LENGTH) : FIN(STOP));
        assert_int_equal(rest.usage.completion_tokens, 2);
        assert_int_equal(rest.n_ids, 0);
        expect_cancel(e, &e->p0, "r-end", 1);
        char *text = metrics_call(e);
        assert_float_equal(sample_of(text, "tandem_requests_migrated_total"), 0, 0);
        free(text);
        protobuf_c_message_free_unpacked(&rs0->base, NULL);
        env_free(e);
    }
}

/* No prefill node: the decode node prefilled the request itself, and the one it moves to does
 * too (local_prefill), after the output delivered; its first token is the next index. */
static void test_migrate_local_prefill(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    tdm_router_set_heartbeat(e->r, 0, 1000);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-loc", "abc", 8, true);
    uint64_t call = generate(e, &g);
    Tandem__V1__DecodeReserve *rs0 = reserve_and_ack(e, &e->d0);
    assert_true(rs0->local_prefill);
    protobuf_c_message_free_unpacked(&rs0->base, NULL);
    result_t res;
    memset(&res, 0, sizeof res);
    fake_token(&e->d0, "r-loc", 0, B('a'));
    one_chunk(e, call, &res);
    fake_t *all[] = {&e->d0, &e->d1, NULL};
    live_heartbeats(e, all);
    double t = tdm_time_now() + 1000.0;
    tdm_router_check_liveness(e->r, t);
    fake_t *alive[] = {&e->d1, NULL};
    live_step_until(e, &t, alive, "decode-0", true);
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *rs = expect_reserve_for(e, &e->d1, &f, "r-loc");
    assert_true(rs->local_prefill);
    assert_int_equal(rs->spec->n_output_tokens, 1);
    assert_int_equal(rs->spec->output_tokens[0], B('a'));
    protobuf_c_message_free_unpacked(&rs->base, NULL);
    reply_ack(&e->d1, &f, "r-loc", 1);
    tdm_frame_clear(&f);
    fake_token(&e->d1, "r-loc", 1, B('b'));
    fake_token(&e->d1, "r-loc", 2, B('c'));
    fake_finished(&e->d1, "r-loc", FIN(LENGTH), 3);
    result_t rest;
    collect(e, call, &rest);
    assert_int_equal(rest.status, TDM_OK);
    assert_int_equal(rest.index[0], 1);
    assert_string_equal(rest.text, "bc");
    assert_int_equal(rest.usage.completion_tokens, 3);
    assert_int_equal(rest.finish, FIN(LENGTH));
    env_free(e);
}

/* Every migration counts against the request's re-dispatch budget
 * (TDM_ROUTER_MAX_REDISPATCH): a request whose decode node keeps failing it after tokens
 * (retryable TaskFailed) is resumed that many times, each time after all the output delivered,
 * then fails with UNAVAILABLE. */
static void test_migrate_budget(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    result_t res;
    double t;
    Tandem__V1__DecodeReserve *rs0;
    const int32_t out[1] = {B('a')};
    uint64_t call = migrate_setup(e, &t, "r-bud", 16, out, 1, &res, &rs0);
    protobuf_c_message_free_unpacked(&rs0->base, NULL);
    fake_t *d = &e->d0;
    for (uint32_t k = 0; k < TDM_ROUTER_MAX_REDISPATCH; k++) {
        /* the decode node delivers one more token, then its stream fails */
        fake_token(d, "r-bud", 1 + 2 * k, B((char)('b' + k)));
        one_chunk(e, call, &res);
        fake_task_failed(d, "r-bud", 14, "stream lost", true);
        expect_cancel(e, &e->p0, "r-bud", 1);
        expect_cancel(e, d, "r-bud", 1);
        tdm_frame_t f;
        tdm_frame_init(&f);
        /* either decode node (both are up with the same room) */
        fake_t *next = recv_on(e, e->d0.s, &f, 200) ? &e->d0 : &e->d1;
        if (next == &e->d1)
            assert_true(recv_on(e, e->d1.s, &f, WAIT_MS));
        Tandem__V1__DecodeReserve *rs = (Tandem__V1__DecodeReserve *)tdm_frame_unpack(
            &f, &tandem__v1__decode_reserve__descriptor);
        assert_non_null(rs);
        attempt_note(rs->spec->request_id, rs->spec->attempt_id);
        assert_int_equal(rs->spec->n_output_tokens, 2 + 2 * k);
        assert_int_equal(rs->spec->output_tokens[1 + 2 * k], B((char)('b' + k)));
        protobuf_c_message_free_unpacked(&rs->base, NULL);
        reply_ack(next, &f, "r-bud", 1);
        tdm_frame_clear(&f);
        Tandem__V1__PrefillTask *task = expect_task(e, &e->p0);
        assert_int_equal(task->spec->n_output_tokens, 2 + 2 * k);
        protobuf_c_message_free_unpacked(&task->base, NULL);
        fake_token(&e->p0, "r-bud", 2 + 2 * k, B('-'));
        one_chunk(e, call, &res);
        d = next;
    }
    fake_task_failed(d, "r-bud", 14, "stream lost", true);
    result_t rest;
    collect(e, call, &rest);
    assert_int_equal(rest.status, TDM_EUNAVAILABLE);
    assert_non_null(strstr(rest.message, "gave up after 3 re-dispatches"));
    char *text = metrics_call(e);
    assert_float_equal(sample_of(text, "tandem_requests_migrated_total"), TDM_ROUTER_MAX_REDISPATCH,
                       0);
    free(text);
    env_free(e);
}

/* A router loop that was stalled far longer than the heartbeat timeout does not declare the
 * nodes down (nor suspect): their heartbeats of that time waited in the socket. The stall is
 * counted, and a node that stays silent after the loop runs again is still found. */
static void test_loop_stall_not_charged(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    fake_register(e, &e->d1);
    tdm_router_set_heartbeat(e->r, 0, 1000);
    fake_t *all[] = {&e->p0, &e->d0, &e->d1, NULL};
    live_heartbeats(e, all);
    double t = tdm_time_now() + 30.0; /* a 30 s stall: 30 heartbeat timeouts */
    tdm_router_check_liveness(e->r, t);
    for (fake_t **n = all; *n; n++) {
        assert_true(tdm_router_node_up(e->r, (*n)->id));
        assert_false(tdm_router_node_suspect(e->r, (*n)->id));
    }
    /* the heartbeats the stall held back arrive, the loop checks again: all up */
    live_heartbeats(e, all);
    t += LIVE_STEP_S;
    tdm_router_check_liveness(e->r, t);
    for (fake_t **n = all; *n; n++)
        assert_false(tdm_router_node_suspect(e->r, (*n)->id));
    char *text = metrics_call(e);
    assert_true(sample_of(text, "tandem_router_loop_stalls_total") >= 1);
    assert_true(sample_of(text, "tandem_router_loop_stall_seconds_total") >= 29.0);
    assert_true(sample_of(text, "tandem_router_loop_seconds_count") >= 1);
    assert_true(sample_of(text, "tandem_router_loop_max_seconds") >= 0);
    assert_true(sample_of(text, "tandem_router_loop_max_seconds") <=
                sample_of(text, "tandem_router_loop_seconds_sum"));
    promtool_check(e, text);
    free(text);
    /* a second stall right away: still nobody down */
    t += 30.0;
    tdm_router_check_liveness(e->r, t);
    for (fake_t **n = all; *n; n++)
        assert_true(tdm_router_node_up(e->r, (*n)->id));
    /* decode-1 really went silent: found once the loop runs normally */
    fake_t *alive[] = {&e->p0, &e->d0, NULL};
    assert_true(live_step_until(e, &t, alive, "decode-1", true));
    env_free(e);
}

/* ---- several choices (n > 1) ---- */

/* Two reservations for "r-n" on d (choice 0's, then choice 1's), acknowledged; *a0, *a1 their
 * attempts. Checks that choice 1 forks choice 0 (fork_of, no local prefill, seed + 1). */
static void n_reserve_both(env_t *e, fake_t *d, uint64_t *a0, uint64_t *a1)
{
    tdm_frame_t f0, f1;
    tdm_frame_init(&f0);
    tdm_frame_init(&f1);
    Tandem__V1__DecodeReserve *m0 = expect_reserve(e, d, &f0);
    Tandem__V1__DecodeReserve *m1 = expect_reserve(e, d, &f1);
    assert_int_equal(m0->fork_of, 0);
    assert_int_equal(m1->fork_of, m0->spec->attempt_id);
    assert_false(m1->local_prefill);
    assert_int_equal(m1->spec->sampling->seed, m0->spec->sampling->seed + 1);
    *a0 = m0->spec->attempt_id;
    *a1 = m1->spec->attempt_id;
    attempt_note("r-n", *a0);
    reply_ack(d, &f0, "r-n", 1);
    attempt_note("r-n", *a1);
    reply_ack(d, &f1, "r-n", 1);
    protobuf_c_message_free_unpacked(&m0->base, NULL);
    protobuf_c_message_free_unpacked(&m1->base, NULL);
    tdm_frame_clear(&f0);
    tdm_frame_clear(&f1);
}

/* Receives the call's frames until its END into text[choice] and finals[choice]; returns the
 * END's status (its body must be empty). */
static int n_collect(env_t *e, uint64_t call, char text[2][32], int finals[2])
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    for (;;) {
        if (!recv_on(e, e->client, &f, WAIT_MS))
            fail_msg("call %" PRIu64 ": no END", call);
        assert_int_equal(f.call_id, call);
        if (f.kind == K_END) {
            int st = f.status;
            assert_true(st != TDM_OK || f.body_len == 0);
            tdm_frame_clear(&f);
            return st;
        }
        Tandem__V1__GenerateChunk *c = (Tandem__V1__GenerateChunk *)tdm_frame_unpack(
            &f, &tandem__v1__generate_chunk__descriptor);
        assert_non_null(c);
        assert_true(c->choice < 2);
        strncat(text[c->choice], c->text, 31 - strlen(text[c->choice]));
        finals[c->choice] += c->finish_reason != 0;
        protobuf_c_message_free_unpacked(&c->base, NULL);
        tdm_frame_clear(&f);
    }
}

/* n = 2: choice 1 forks choice 0 on its decode node (no PrefillTask, its first token from the
 * decode node); each choice ends with its own last chunk and the call with one END, after
 * both, without a body (stream=false: each choice's whole answer is one STREAM chunk). */
static void test_n_choices_fork_and_end_once(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-n", "hello world", 2, false);
    g.n = 2;
    uint64_t call = generate(e, &g);
    uint64_t a0, a1;
    n_reserve_both(e, &e->d0, &a0, &a1);
    attempt_note("r-n", a0); /* choice 0's task (the fork has none) */
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_int_equal(t->spec->attempt_id, a0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    expect_none(e, e->p0.s, 100); /* the fork is not prefilled */
    attempt_note("r-n", a1);
    fake_token(&e->d0, "r-n", 0, B('x'));
    fake_token(&e->d0, "r-n", 1, B('y'));
    fake_finished(&e->d0, "r-n", FIN(LENGTH), 2);
    attempt_note("r-n", a0);
    fake_token(&e->p0, "r-n", 0, B('a'));
    fake_token(&e->d0, "r-n", 1, B('b'));
    fake_finished(&e->d0, "r-n", FIN(LENGTH), 2);
    char text[2][32] = {"", ""};
    int finals[2] = {0, 0};
    assert_int_equal(n_collect(e, call, text, finals), TDM_OK);
    assert_string_equal(text[0], "ab");
    assert_string_equal(text[1], "xy");
    assert_int_equal(finals[0], 1);
    assert_int_equal(finals[1], 1);
    expect_none(e, e->client, 100);
    env_free(e);
}

/* A fork that fails retryably runs on its own (a reservation without fork_of, then its own
 * PrefillTask); a choice failing for good fails the call once and cancels its sibling on
 * both its nodes. */
static void test_n_fork_fallback_and_failure(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-n", "hello world", 4, true);
    g.n = 2;
    uint64_t call = generate(e, &g);
    uint64_t a0, a1;
    n_reserve_both(e, &e->d0, &a0, &a1);
    attempt_note("r-n", a0);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    attempt_note("r-n", a1);
    fake_task_failed(&e->d0, "r-n", TDM_EUNAVAILABLE, "fork: the sibling ended", true);
    expect_cancel(e, &e->d0, "r-n", 1); /* CANCELLED: the failed attempt's, as any */
    tdm_frame_t f;
    tdm_frame_init(&f);
    Tandem__V1__DecodeReserve *m = expect_reserve(e, &e->d0, &f); /* choice 1, on its own */
    assert_int_equal(m->fork_of, 0);
    uint64_t a1b = m->spec->attempt_id;
    assert_true(a1b != a1);
    reply_ack(&e->d0, &f, "r-n", 1);
    protobuf_c_message_free_unpacked(&m->base, NULL);
    tdm_frame_clear(&f);
    t = expect_task(e, &e->p0);
    assert_int_equal(t->spec->attempt_id, a1b);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    attempt_note("r-n", a1b);
    fake_sync(e, &e->d0); /* its ack handled first: d0 and p0 are read in no set order */
    fake_token(&e->p0, "r-n", 0, B('x'));
    fake_sync(e, &e->p0);
    attempt_note("r-n", a0);
    fake_task_failed(&e->d0, "r-n", TDM_EINTERNAL, "engine broke", false);
    char text[2][32] = {"", ""};
    int finals[2] = {0, 0};
    assert_int_equal(n_collect(e, call, text, finals), TDM_EINTERNAL);
    assert_string_equal(text[1], "x");
    assert_int_equal(finals[1], 1); /* its stream's error chunk */
    /* choice 1 (a1b) cancelled on its prefill and decode node; choice 0 on its decode node */
    expect_cancel(e, &e->p0, "r-n", 13); /* INTERNAL */
    expect_cancel(e, &e->d0, "r-n", 13);
    expect_cancel(e, &e->d0, "r-n", 13);
    expect_none(e, e->client, 100);
    env_free(e);
}

/* A client CANCEL of a call of n = 3: choice 0's NodeCancel reaches the decode node after its
 * forks' (a decode node that lost choice 0 first would fail each fork waiting for its prompt
 * KV, with a warning each), and the prefill node's too. */
static void test_n_cancel_forks_first(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    Tandem__V1__GenerateRequest g;
    prompt_req(&g, "r-n", "hello world", 4, true);
    g.n = 3;
    uint64_t call = generate(e, &g);
    tdm_frame_t f[3];
    uint64_t a[3];
    for (int i = 0; i < 3; i++) {
        tdm_frame_init(&f[i]);
        Tandem__V1__DecodeReserve *m = expect_reserve(e, &e->d0, &f[i]);
        a[i] = m->spec->attempt_id;
        assert_int_equal(m->fork_of, i == 0 ? 0 : a[0]);
        protobuf_c_message_free_unpacked(&m->base, NULL);
    }
    for (int i = 0; i < 3; i++) {
        attempt_note("r-n", a[i]);
        reply_ack(&e->d0, &f[i], "r-n", 1);
        tdm_frame_clear(&f[i]);
    }
    attempt_note("r-n", a[0]);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_int_equal(t->spec->attempt_id, a[0]);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    tdm_send_t c = {0};
    c.kind = K_CANCEL;
    c.method = M(GENERATE);
    c.call_id = call;
    assert_int_equal(tdm_sock_send(e->client, &c), 0);
    uint64_t order[3];
    for (int i = 0; i < 3; i++) {
        tdm_frame_t cf;
        tdm_frame_init(&cf);
        if (!recv_on(e, e->d0.s, &cf, WAIT_MS))
            fail_msg("decode-0: NodeCancel %d of 3 missing", i + 1);
        assert_int_equal(cf.method, M(NODE_CANCEL));
        Tandem__V1__NodeCancel *nc =
            (Tandem__V1__NodeCancel *)tdm_frame_unpack(&cf, &tandem__v1__node_cancel__descriptor);
        assert_non_null(nc);
        order[i] = nc->attempt_id;
        protobuf_c_message_free_unpacked(&nc->base, NULL);
        tdm_frame_clear(&cf);
    }
    assert_true(order[0] != a[0] && order[1] != a[0] && order[0] != order[1]);
    assert_int_equal(order[2], a[0]); /* choice 0 last */
    attempt_note("r-n", a[0]);
    expect_cancel(e, &e->p0, "r-n", 1);
    expect_none(e, e->client, 100);
    assert_int_equal(tdm_router_n_running(e->r), 0);
    env_free(e);
}

/* Several models: two tiny models of different weights (fingerprints), each with a prefill
 * and a decode node. A node registers only as the model the router's config gives it (with
 * that model's fingerprint); a request runs on its model's nodes only; a model without a decode
 * node up holds back its own requests, not the other model's. */
static void test_several_models(void **state)
{
    (void)state;
    char other[64];
    snprintf(other, sizeof other, "/tmp/tdm_router_other_%d.gguf", (int)getpid());
    tdm_error_t err = {0};
    tdm_tiny_llama_spec_t spec = {.n_vocab = 512, .n_ctx = N_CTX, .seed = 9};
    assert_int_equal(tdm_test_write_tiny_llama(other, &spec, &err), 0);
    tdm_model_t *om = tdm_model_load(other, &err);
    assert_non_null(om);
    uint64_t other_fp = tdm_model_fingerprint(om);
    tdm_model_destroy(&om);
    char models[512];
    snprintf(models, sizeof models, "  - path: %s\n    name: other\n    aliases: [o2]\n", other);
    env_more_models = models;
    env_nodes_yaml = "  - {id: prefill-0, role: prefill, model: tiny}\n"
                     "  - {id: prefill-1, role: prefill, model: other}\n"
                     "  - {id: decode-0, role: decode, model: tiny}\n"
                     "  - {id: decode-1, role: decode, model: o2}\n";
    env_t *e = env_new("  prefill_policy: round_robin\n");
    env_more_models = NULL;
    env_nodes_yaml = NULL;
    assert_int_not_equal(other_fp, tdm_router_fingerprint(e->r));

    fake_register(e, &e->p0);
    fake_register(e, &e->d0);
    /* decode-1 serves "other": not as tiny, not as a model the router lacks, not with tiny's
     * weights */
    reg_t g;
    char msg[512];
    reg_default(e, &e->d1, &g);
    g.m.model = (char *)"tiny";
    assert_int_equal(fake_register_with(e, &e->d1, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_string_equal(msg, "model 'tiny': the router's config gives node 'decode-1' model "
                             "'other' (nodes[].model)");
    g.m.model = (char *)"oth\x1b[2Jer"; /* a terminal escape never reaches `tandem status` */
    assert_int_equal(fake_register_with(e, &e->d1, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_string_equal(msg, "model: byte 3 is not printable UTF-8 or past 256 bytes");
    g.m.model = (char *)"nope";
    assert_int_equal(fake_register_with(e, &e->d1, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_string_equal(msg,
                        "model 'nope' is not served by this router (its models: 'tiny', 'other')");
    g.m.model = (char *)"other";
    assert_int_equal(fake_register_with(e, &e->d1, &g, msg, sizeof msg), TDM_EPRECONDITION);
    assert_non_null(strstr(msg, "differs from the router's"));
    assert_false(tdm_router_node_up(e->r, "decode-1"));

    /* "other" has no decode node up: its request waits, tiny's runs past it */
    Tandem__V1__GenerateRequest gr;
    prompt_req(&gr, "o-1", "hi", 2, false);
    gr.model = (char *)"o2";
    uint64_t c_other = generate(e, &gr);
    pump_until_queued(e, 1);
    prompt_req(&gr, "t-1", "hi", 2, false);
    gr.model = (char *)"tiny";
    uint64_t c_tiny = generate(e, &gr);
    Tandem__V1__DecodeReserve *rv = reserve_and_ack(e, &e->d0);
    assert_string_equal(rv->spec->request_id, "t-1");
    protobuf_c_message_free_unpacked(&rv->base, NULL);
    Tandem__V1__PrefillTask *t = expect_task(e, &e->p0);
    assert_string_equal(t->spec->request_id, "t-1");
    protobuf_c_message_free_unpacked(&t->base, NULL);
    fake_token(&e->p0, "t-1", 0, B('o'));
    fake_token(&e->d0, "t-1", 1, B('k'));
    fake_finished(&e->d0, "t-1", FIN(LENGTH), 2);
    result_t res;
    collect(e, c_tiny, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "ok");
    assert_int_equal(tdm_router_n_queued(e->r), 1); /* o-1 still waits */
    /* MODELS: each model's state, nodes up and requests (2.6) */
    Tandem__V1__ModelsRequest mr = TANDEM__V1__MODELS_REQUEST__INIT;
    send_req(e, M(MODELS), &mr.base, NULL, 0);
    tdm_frame_t mf;
    tdm_frame_init(&mf);
    assert_true(recv_on(e, e->client, &mf, WAIT_MS));
    Tandem__V1__ModelsResponse *mo = (Tandem__V1__ModelsResponse *)tdm_frame_unpack(
        &mf, &tandem__v1__models_response__descriptor);
    assert_non_null(mo);
    assert_int_equal(mo->n_models, 2);
    assert_string_equal(mo->models[0]->name, "tiny");
    assert_string_equal(mo->models[0]->state, "ready");
    assert_int_equal(mo->models[0]->requests_running, 0);
    assert_int_equal(mo->models[0]->requests_queued, 0);
    assert_string_equal(mo->models[1]->name, "other");
    assert_string_equal(mo->models[1]->state, "unavailable");
    assert_int_equal(mo->models[1]->decode_nodes_up, 0);
    assert_int_equal(mo->models[1]->requests_running, 0);
    assert_int_equal(mo->models[1]->requests_queued, 1);
    protobuf_c_message_free_unpacked(&mo->base, NULL);
    tdm_frame_clear(&mf);

    /* its prefill node and decode node come up (with its fingerprint): o-1 runs there */
    reg_default(e, &e->p1, &g);
    g.m.model_fingerprint = other_fp; /* a 2.3 node: no model field, checked as its config's */
    assert_int_equal(fake_register_with(e, &e->p1, &g, msg, sizeof msg), 0);
    reg_default(e, &e->d1, &g);
    g.m.model = (char *)"other";
    g.m.model_fingerprint = other_fp;
    assert_int_equal(fake_register_with(e, &e->d1, &g, msg, sizeof msg), 0);
    rv = reserve_and_ack(e, &e->d1);
    assert_string_equal(rv->spec->request_id, "o-1");
    protobuf_c_message_free_unpacked(&rv->base, NULL);
    t = expect_task(e, &e->p1);
    assert_string_equal(t->spec->request_id, "o-1");
    protobuf_c_message_free_unpacked(&t->base, NULL);
    expect_none(e, e->p0.s, 50);
    fake_token(&e->p1, "o-1", 0, B('y'));
    fake_token(&e->d1, "o-1", 1, B('o'));
    fake_finished(&e->d1, "o-1", FIN(LENGTH), 2);
    collect(e, c_other, &res);
    assert_int_equal(res.status, 0);
    assert_string_equal(res.text, "yo");

    /* a request for a model not served ends before its model is known */
    prompt_req(&gr, "n-1", "hi", 2, false);
    gr.model = (char *)"nope";
    uint64_t c_nope = generate(e, &gr);
    collect(e, c_nope, &res);
    assert_int_equal(res.status, TDM_ENOTFOUND);

    /* the vLLM series carry each request's model */
    char *text = NULL;
    assert_int_equal(tdm_router_metrics_text(e->r, &text, NULL), 0);
    /* so do the tandem_ request families (several models), the nodes' their node's model; a
     * request refused before its model was known has a series without model_name */
    assert_float_equal(sample_of(text, "tandem_generation_tokens_total{model_name=\"tiny\"}"), 2,
                       0);
    assert_float_equal(sample_of(text, "tandem_generation_tokens_total{model_name=\"other\"}"), 2,
                       0);
    assert_float_equal(sample_of(text, "tandem_requests_total{model_name=\"other\",status=\"OK\","
                                       "finish_reason=\"length\"}"),
                       1, 0);
    assert_float_equal(sample_of(text, "tandem_requests_total{model_name=\"tiny\",status=\"OK\","
                                       "finish_reason=\"length\"}"),
                       1, 0);
    assert_float_equal(
        sample_of(text, "tandem_requests_total{status=\"NOT_FOUND\",finish_reason=\"none\"}"), 1,
        0);
    assert_false(has_series(text, "tandem_requests_total{model_name=\"tiny\",status=\"NOT_FOUND\","
                                  "finish_reason=\"none\"}"));
    assert_float_equal(sample_of(text, "tandem_requests_received_total"), 3, 0);
    assert_float_equal(
        sample_of(text, "tandem_time_to_first_token_seconds_count{model_name=\"other\"}"), 1, 0);
    assert_float_equal(
        sample_of(text, "tandem_time_to_first_token_seconds_count{model_name=\"tiny\"}"), 1, 0);
    assert_float_equal(sample_of(text, "tandem_request_prompt_tokens_bucket{model_name=\"other\","
                                       "le=\"+Inf\"}"),
                       1, 0);
    assert_float_equal(sample_of(text, "tandem_requests_queued{model_name=\"other\"}"), 0, 0);
    assert_float_equal(sample_of(text, "tandem_requests_running{model_name=\"tiny\"}"), 0, 0);
    assert_float_equal(sample_of(text, "tandem_node_up{node=\"decode-1\",role=\"decode\","
                                       "model_name=\"other\"}"),
                       1, 0);
    assert_float_equal(sample_of(text, "tandem_node_up{node=\"prefill-0\",role=\"prefill\","
                                       "model_name=\"tiny\"}"),
                       1, 0);
    const char *t_ttft = "# TYPE tandem_time_to_first_token_seconds histogram";
    assert_non_null(strstr(text, t_ttft));
    assert_null(strstr(strstr(text, t_ttft) + 1, t_ttft));
    assert_non_null(
        strstr(text, "vllm:generation_tokens_total{model_name=\"tiny\",engine=\"0\"} 2"));
    assert_non_null(
        strstr(text, "vllm:generation_tokens_total{model_name=\"other\",engine=\"0\"} 2"));
    const char *ttft = "# TYPE vllm:time_to_first_token_seconds histogram";
    assert_non_null(strstr(text, ttft));
    assert_null(strstr(strstr(text, ttft) + 1, ttft)); /* one family for both models */
    free(text);
    env_free(e);
    unlink(other);
}

/* ---- embeddings (EMBED, embed.c) ---- */

/* Waits for an EmbedTask on n (fails after WAIT_MS, or on another message). Caller frees. */
static Tandem__V1__EmbedTask *expect_embed_task(env_t *e, fake_t *n)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    if (!recv_on(e, n->s, &f, WAIT_MS))
        fail_msg("%s: no EmbedTask", n->id);
    if (f.method != M(EMBED_TASK))
        fail_msg("%s: %s instead of an EmbedTask", n->id, tdm_net_method_name(f.method));
    Tandem__V1__EmbedTask *t =
        (Tandem__V1__EmbedTask *)tdm_frame_unpack(&f, &tandem__v1__embed_task__descriptor);
    assert_non_null(t);
    tdm_frame_clear(&f);
    return t;
}

/* The node's answer to task t: a vector of n_embd values v[i] = first + i / 1000. */
static void fake_embedding(fake_t *n, const Tandem__V1__EmbedTask *t, uint32_t n_embd, float first)
{
    float v[256];
    assert_true(n_embd <= 256);
    for (uint32_t i = 0; i < n_embd; i++)
        v[i] = first + (float)i / 1000.0f;
    Tandem__V1__EmbeddingResult er = TANDEM__V1__EMBEDDING_RESULT__INIT;
    er.request_id = t->spec->request_id;
    er.attempt_id = t->spec->attempt_id;
    er.embedding = v;
    er.n_embedding = n_embd;
    er.prompt_tokens = (uint32_t)t->spec->n_prompt_tokens;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(EMBEDDING), &er.base), 0);
}

static void fake_task_failed_embed(fake_t *n, const Tandem__V1__EmbedTask *t, int code,
                                   bool retryable)
{
    Tandem__V1__TaskFailed tf = TANDEM__V1__TASK_FAILED__INIT;
    tf.request_id = t->spec->request_id;
    tf.attempt_id = t->spec->attempt_id;
    tf.status = code;
    tf.message = (char *)"worker queue full";
    tf.retryable = retryable;
    assert_int_equal(tdm_sock_notify(n->s, NULL, 0, M(TASK_FAILED), &tf.base), 0);
}

/* An EMBED call of n_inputs token lists: input i is ids 3, 4, ..., 3 + i (i + 1 tokens). */
static uint64_t embed_call(env_t *e, const char *id, size_t n_inputs, int32_t bad_id,
                           uint64_t deadline_ms)
{
    static int32_t ids[8][8];
    Tandem__V1__TokenList lists[8], *listp[8];
    assert_true(n_inputs <= 8);
    for (size_t i = 0; i < n_inputs; i++) {
        tandem__v1__token_list__init(&lists[i]);
        for (size_t j = 0; j <= i; j++)
            ids[i][j] = (int32_t)(3 + j);
        lists[i].ids = ids[i];
        lists[i].n_ids = i + 1;
        listp[i] = &lists[i];
    }
    if (bad_id && n_inputs > 1)
        ids[1][1] = bad_id;
    Tandem__V1__EmbedRequest q = TANDEM__V1__EMBED_REQUEST__INIT;
    q.request_id = (char *)id;
    q.token_inputs = listp;
    q.n_token_inputs = n_inputs;
    q.pooling = TANDEM__V1__POOLING__POOLING_MEAN;
    return send_req(e, M(EMBED), &q.base, NULL, deadline_ms);
}

/* Inputs go to the prefill nodes (never the decode node while a prefill node is up), a
 * retryable failure sends the input again on the other prefill node, and the answer has every
 * vector in input order with the prompt tokens. */
static void test_embed_dispatch_retry(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    fake_register(e, &e->p0);
    fake_register(e, &e->p1);
    fake_register(e, &e->d0);
    uint32_t n_embd = tdm_model_hparams(e->model)->n_embd;
    uint64_t call = embed_call(e, "emb-1", 3, 0, 0);
    /* the least loaded prefill node each: 1 token on one, then 2 on the other, then 3 on
     * the first (1 < 2) */
    Tandem__V1__EmbedTask *t0 = expect_embed_task(e, &e->p0);
    Tandem__V1__EmbedTask *t1 = expect_embed_task(e, &e->p1);
    Tandem__V1__EmbedTask *t2 = expect_embed_task(e, &e->p0);
    assert_int_equal(t0->spec->n_prompt_tokens, 1);
    assert_int_equal(t1->spec->n_prompt_tokens, 2);
    assert_int_equal(t2->spec->n_prompt_tokens, 3);
    assert_int_equal(t0->pooling, TANDEM__V1__POOLING__POOLING_MEAN);
    assert_string_equal(t0->spec->request_id, "emb-1");
    assert_true(t0->spec->deadline_unix_ms > 0);
    /* the middle input fails retryably on p1: again, on p0 */
    fake_task_failed_embed(&e->p1, t1, 8, true);
    Tandem__V1__EmbedTask *t1b = expect_embed_task(e, &e->p0);
    assert_int_equal(t1b->spec->n_prompt_tokens, 2);
    assert_true(t1b->spec->attempt_id != t1->spec->attempt_id);
    fake_embedding(&e->p0, t2, n_embd, 2.0f);
    fake_embedding(&e->p1, t1, n_embd, 9.0f); /* the failed attempt's: ignored */
    fake_embedding(&e->p0, t0, n_embd, 0.0f);
    fake_embedding(&e->p0, t1b, n_embd, 1.0f);
    expect_none(e, e->d0.s, 50);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.kind, K_END);
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, 0);
    Tandem__V1__EmbedResponse *r =
        (Tandem__V1__EmbedResponse *)tdm_frame_unpack(&f, &tandem__v1__embed_response__descriptor);
    assert_non_null(r);
    assert_string_equal(r->request_id, "emb-1");
    assert_string_equal(r->model, "tiny");
    assert_int_equal(r->n_data, 3);
    assert_int_equal(r->prompt_tokens, 6);
    for (uint32_t i = 0; i < 3; i++) {
        assert_int_equal(r->data[i]->index, i);
        assert_int_equal(r->data[i]->prompt_tokens, i + 1);
        assert_int_equal(r->data[i]->n_embedding, n_embd);
        assert_float_equal(r->data[i]->embedding[0], (float)i, 0);
    }
    protobuf_c_message_free_unpacked(&r->base, NULL);
    tdm_frame_clear(&f);
    Tandem__V1__EmbedTask *ts[] = {t0, t1, t2, t1b};
    for (size_t i = 0; i < 4; i++)
        protobuf_c_message_free_unpacked(&ts[i]->base, NULL);
    const tdm_router_metrics_t *m = tdm_router_metrics(e->r);
    assert_int_equal(m->embed_requests_by_status[0], 1);
    assert_int_equal(m->embed_prompt_tokens, 6);
    env_free(e);
}

/* Refusals name the field (ErrorDetail); no node of the model: UNAVAILABLE naming it; a
 * decode-only pool computes them; a deadline ends the call and cancels the node's task. */
static void test_embed_refusals_and_ends(void **state)
{
    (void)state;
    env_t *e = env_new(NULL);
    uint64_t call = embed_call(e, "emb-bad", 2, 100000, 0);
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, TDM_EINVALID);
    assert_non_null(strstr(f.message, "token_inputs[1].ids[1]: token id 100000 is outside"));
    Tandem__V1__ErrorDetail *d =
        (Tandem__V1__ErrorDetail *)tdm_frame_unpack(&f, &tandem__v1__error_detail__descriptor);
    assert_non_null(d);
    assert_string_equal(d->field, "token_inputs[1].ids[1]");
    protobuf_c_message_free_unpacked(&d->base, NULL);
    tdm_frame_clear(&f);
    call = embed_call(e, "emb-0", 0, 0, 0);
    expect_end(e, call, TDM_EINVALID, "token_inputs: 0 inputs; a call takes 1..2048");
    call = embed_call(e, "emb-none", 1, 0, 0);
    expect_end(e, call, TDM_EUNAVAILABLE, "no node of model 'tiny' is up");
    /* a decode-only pool */
    fake_register(e, &e->d0);
    uint32_t n_embd = tdm_model_hparams(e->model)->n_embd;
    call = embed_call(e, "emb-d", 1, 0, 0);
    Tandem__V1__EmbedTask *t = expect_embed_task(e, &e->d0);
    fake_embedding(&e->d0, t, n_embd, 0.5f);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, 0);
    tdm_frame_clear(&f);
    /* the deadline passes: DEADLINE_EXCEEDED, and the node is told to stop */
    call = embed_call(e, "emb-late", 1, 0, tdm_net_now_ms() + 300);
    t = expect_embed_task(e, &e->d0);
    protobuf_c_message_free_unpacked(&t->base, NULL);
    expect_end(e, call, TDM_EDEADLINE, "deadline passed while computing embeddings (0 of 1");
    expect_cancel(e, &e->d0, "emb-late", 1);
    const tdm_router_metrics_t *m = tdm_router_metrics(e->r);
    assert_int_equal(m->embed_requests_by_status[3], 2); /* INVALID_ARGUMENT */
    assert_int_equal(m->embed_requests_by_status[14], 1);
    assert_int_equal(m->embed_requests_by_status[4], 1);
    env_free(e);
}

/* Expects call's END OK with n vectors. */
static void expect_embeddings(env_t *e, uint64_t call, size_t n)
{
    tdm_frame_t f;
    tdm_frame_init(&f);
    assert_true(recv_on(e, e->client, &f, WAIT_MS));
    assert_int_equal(f.call_id, call);
    assert_int_equal(f.status, 0);
    Tandem__V1__EmbedResponse *r =
        (Tandem__V1__EmbedResponse *)tdm_frame_unpack(&f, &tandem__v1__embed_response__descriptor);
    assert_non_null(r);
    assert_int_equal(r->n_data, n);
    protobuf_c_message_free_unpacked(&r->base, NULL);
    tdm_frame_clear(&f);
}

/* A node takes at most its max_running embedding inputs: the rest wait in the router, oldest
 * call first (counted as running / queued), a new call that would wait while router.max_queue
 * requests wait is refused RESOURCE_EXHAUSTED "queue full", and each answer makes room for the
 * next input. */
static void test_embed_node_room_and_queue(void **state)
{
    (void)state;
    env_t *e = env_new("  max_queue: 1\n");
    reg_t g;
    reg_default(e, &e->p0, &g);
    g.m.max_running = 2;
    char msg[512];
    assert_int_equal(fake_register_with(e, &e->p0, &g, msg, sizeof msg), 0);
    fake_register(e, &e->d0);
    uint32_t n_embd = tdm_model_hparams(e->model)->n_embd;
    uint64_t a = embed_call(e, "emb-a", 3, 0, 0);
    Tandem__V1__EmbedTask *a0 = expect_embed_task(e, &e->p0);
    Tandem__V1__EmbedTask *a1 = expect_embed_task(e, &e->p0);
    expect_none(e, e->p0.s, 50); /* its third input waits: p0 is full */
    uint64_t b = embed_call(e, "emb-b", 1, 0, 0);
    expect_none(e, e->p0.s, 50);
    expect_none(e, e->d0.s, 0); /* never the decode node while a prefill node is up */
    size_t running, queued;
    rt_embed_count(e->r, NULL, &running, &queued);
    assert_int_equal(running, 1); /* a */
    assert_int_equal(queued, 1);  /* b */
    uint64_t c = embed_call(e, "emb-c", 1, 0, 0);
    expect_end(e, c, TDM_ERESOURCE, "queue full (1 requests waiting)");
    /* an answer makes room: a's third input first (the older call), then b's */
    fake_embedding(&e->p0, a0, n_embd, 0.0f);
    Tandem__V1__EmbedTask *a2 = expect_embed_task(e, &e->p0);
    assert_string_equal(a2->spec->request_id, "emb-a");
    assert_int_equal(a2->spec->n_prompt_tokens, 3);
    fake_embedding(&e->p0, a1, n_embd, 1.0f);
    Tandem__V1__EmbedTask *b0 = expect_embed_task(e, &e->p0);
    assert_string_equal(b0->spec->request_id, "emb-b");
    fake_embedding(&e->p0, a2, n_embd, 2.0f);
    expect_embeddings(e, a, 3);
    fake_embedding(&e->p0, b0, n_embd, 3.0f);
    expect_embeddings(e, b, 1);
    rt_embed_count(e->r, NULL, &running, &queued);
    assert_int_equal(running + queued, 0);
    assert_int_equal(tdm_router_metrics(e->r)->queue_full, 1);
    Tandem__V1__EmbedTask *ts[] = {a0, a1, a2, b0};
    for (size_t i = 0; i < 4; i++)
        protobuf_c_message_free_unpacked(&ts[i]->base, NULL);
    env_free(e);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_stream_in_order),
        cmocka_unit_test(test_n_choices_fork_and_end_once),
        cmocka_unit_test(test_n_fork_fallback_and_failure),
        cmocka_unit_test(test_n_cancel_forks_first),
        cmocka_unit_test(test_no_stream),
        cmocka_unit_test(test_stop_string),
        cmocka_unit_test(test_cancel),
        cmocka_unit_test(test_deadline),
        cmocka_unit_test(test_validation),
        cmocka_unit_test(test_several_models),
        cmocka_unit_test(test_refusal_detail),
        cmocka_unit_test(test_constraint),
        cmocka_unit_test(test_admit_estimate),
        cmocka_unit_test(test_admission_estimate_batch),
        cmocka_unit_test(test_admission),
        cmocka_unit_test(test_admission_decode_passes),
        cmocka_unit_test(test_max_tokens_unset),
        cmocka_unit_test(test_request_chat_template),
        cmocka_unit_test(test_template_cache),
        cmocka_unit_test(test_broken_model_template),
        cmocka_unit_test(test_queue_and_local_prefill),
        cmocka_unit_test(test_reserve_rejected),
        cmocka_unit_test(test_reserve_refused_after_prefill),
        cmocka_unit_test(test_cancel_while_reserving),
        cmocka_unit_test(test_round_robin),
        cmocka_unit_test(test_prefix_aware),
        cmocka_unit_test(test_least_loaded),
        cmocka_unit_test(test_rejected_then_queued),
        cmocka_unit_test(test_curve),
        cmocka_unit_test(test_decode_down),
        cmocka_unit_test(test_prefill_down),
        cmocka_unit_test(test_task_failed),
        cmocka_unit_test(test_embed_dispatch_retry),
        cmocka_unit_test(test_embed_refusals_and_ends),
        cmocka_unit_test(test_embed_node_room_and_queue),
        cmocka_unit_test(test_one_failure_one_retry),
        cmocka_unit_test(test_retry_budget_shared),
        cmocka_unit_test(test_reserve_timeout),
        cmocka_unit_test(test_reserve_timeout_avoids_node),
        cmocka_unit_test(test_reserve_node_paused),
        cmocka_unit_test(test_rerun_without_decode_node),
        cmocka_unit_test(test_register),
        cmocka_unit_test(test_request_id_reuse),
        cmocka_unit_test(test_api_keys),
        cmocka_unit_test(test_status_health_models),
        cmocka_unit_test(test_status_kv_transport),
        cmocka_unit_test(test_client_gone),
        cmocka_unit_test(test_shutdown),
        cmocka_unit_test(test_metrics),
        cmocka_unit_test(test_prompt_agrees),
        cmocka_unit_test(test_index),
        cmocka_unit_test(test_index_shared_keys),
        cmocka_unit_test(test_heap),
        cmocka_unit_test(test_heap_equal_keys),
        cmocka_unit_test(test_node_suspect_then_down),
        cmocka_unit_test(test_migrate_decode_down),
        cmocka_unit_test(test_migrate_output_already_complete),
        cmocka_unit_test(test_migrate_local_prefill),
        cmocka_unit_test(test_migrate_budget),
        cmocka_unit_test(test_loop_stall_not_charged),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
