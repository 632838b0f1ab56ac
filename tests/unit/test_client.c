/* test_client.c - libtandem-client against a fake router: a thread with a ROUTER socket
 * (tdm_sock_bind on tcp://127.0.0.1:*) that answers Generate with scripted chunks, errors and
 * slow streams, and Health/Models/Status with fixed answers, and records what it received
 * (requests, CANCELs, API keys, deadlines, sampling masks).
 *
 * Scripts, chosen by the prompt: "hello" (4 chunks "Hel" "lo" " wor" "ld", then END OK; with
 * stream=false one END carrying everything), "error" (one chunk, then END INVALID_ARGUMENT),
 * "toolong" (END INVALID_ARGUMENT with an ErrorDetail: max_tokens, 100 + 28 of 128 tokens),
 * "slow" (a chunk every 20 ms until CANCEL), "tag:K:N" (N chunks "K.i " every 5 ms, interleaved
 * with every other running stream; "tag:K:N:G" sends none before G such streams have arrived, so
 * that they all run at once however the threads are scheduled), "silent" (never answers); any
 * other prompt gets max_tokens
 * (default 16) chunks "wI " 1 ms apart, with the prompt's word count as prompt tokens. A chat
 * gets "you said: LAST (N messages)"; token ids get "ok".
 *
 * `test_client --serve ENDPOINT` runs the same fake router as a process (printing the bound
 * endpoint on stdout; Status then shows both nodes up) until SIGTERM or SIGINT;
 * tests/cli/test_cli_client.sh drives the `tandem` commands against it, and uses it as the
 * router of `tandem cluster up`.
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <unistd.h>

#include "tdm_test.h"

#include "tandem/client.h"
#include "tandem/net.h"
#include "tandem/proto.h"

#define FAKE_MAX_STREAMS 64
#define FAKE_MAX_CANCELS 64
/* How long a test waits for something that must happen. Generous: CI runs on a busy 2-core
 * machine, and the waits end as soon as it happens. */
#define WAIT_S 30.0

typedef struct fake_stream {
    bool active;
    uint8_t peer[TDM_NET_PEER_MAX];
    size_t peer_len;
    uint64_t call_id;
    int tag; /* "tag:K:N": K; slow: -1; words: -2 */
    uint32_t prompt_tokens;
    int total; /* chunks to send; 0 = until cancelled */
    int sent;
    double interval; /* seconds between chunks */
    double next_t;
    int gate; /* "tag:K:N:G": G; 0 = none */
} fake_stream_t;

typedef struct fake_router {
    tdm_net_t *net;
    tdm_sock_t *sock;
    char endpoint[256];
    pthread_t thread;
    atomic_bool stop;
    pthread_mutex_t mu;
    /* what it saw (under mu) */
    int n_requests;
    int n_cancels;
    uint64_t cancelled[FAKE_MAX_CANCELS];
    char last_api_key[TDM_NET_API_KEY_MAX];
    uint64_t last_deadline_ms;
    int last_input_case;
    size_t last_n_messages;
    char last_message_role[16];
    size_t last_n_token_ids;
    uint32_t last_set_mask;
    bool last_has_seed;
    float last_temperature;
    int32_t last_max_tokens;
    size_t last_n_stop;
    char last_stop0[64];
    char last_request_id[64];
    fake_stream_t streams[FAKE_MAX_STREAMS];
    int n_gated;         /* "tag:K:N:G" streams that arrived (the fake's thread only) */
    atomic_int n_errors; /* failures inside the fake (cmocka asserts are for the test thread) */
    bool all_up;         /* Status reports every node up (--serve), else decode-0 down */
} fake_router_t;

/* Counts and prints a failed call in the fake router's thread; fake_stop fails the test. */
#define FAKE_OK(fr, expr)                                                                          \
    do {                                                                                           \
        int fake_rc_ = (expr);                                                                     \
        if (fake_rc_ != TDM_OK) {                                                                  \
            fprintf(stderr, "fake router: %s -> %d at line %d\n", #expr, fake_rc_, __LINE__);      \
            atomic_fetch_add(&(fr)->n_errors, 1);                                                  \
        }                                                                                          \
    } while (0)

static double now_s(void)
{
    return tdm_time_now();
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Sends one chunk (STREAM) or the END of a stream to the peer of st. */
static void fake_send_chunk(fake_router_t *fr, const uint8_t *peer, size_t peer_len,
                            uint64_t call_id, int kind, const Tandem__V1__GenerateChunk *chunk)
{
    tdm_send_t m = {0};
    m.peer = peer;
    m.peer_len = peer_len;
    m.kind = kind;
    m.method = TANDEM__V1__METHOD__METHOD_GENERATE;
    m.call_id = call_id;
    m.body = chunk ? &chunk->base : NULL;
    FAKE_OK(fr, tdm_sock_send(fr->sock, &m));
}

static void fake_final_fields(Tandem__V1__GenerateChunk *c, Tandem__V1__Usage *u,
                              Tandem__V1__Timings *t, Tandem__V1__FinishReason reason,
                              uint32_t prompt, uint32_t completion, uint32_t cached)
{
    tandem__v1__usage__init(u);
    tandem__v1__timings__init(t);
    u->prompt_tokens = prompt;
    u->completion_tokens = completion;
    u->cached_prompt_tokens = cached;
    t->queue_s = 0.001;
    t->ttft_s = 0.010;
    t->decode_s = 0.030;
    t->prefill_s = 0.005;
    t->kv_transfer_s = 0.002;
    t->e2e_s = 0.040;
    t->tpot_s = 0.010;
    c->finish_reason = reason;
    c->usage = u;
    c->timings = t;
}

/* "hello": four chunks (the first with logprobs and top logprobs) then END OK, or one END with
 * everything when stream is false. */
static void fake_hello(fake_router_t *fr, const tdm_frame_t *f, bool stream)
{
    static const char *texts[4] = {"Hel", "lo", " wor", "ld"};
    Tandem__V1__Usage u;
    Tandem__V1__Timings t;
    if (!stream) {
        Tandem__V1__GenerateChunk c = TANDEM__V1__GENERATE_CHUNK__INIT;
        int32_t ids[4] = {1, 2, 3, 4};
        c.request_id = "req-hello";
        c.n_token_ids = 4;
        c.token_ids = ids;
        c.text = "Hello world";
        fake_final_fields(&c, &u, &t, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, 5, 4, 2);
        FAKE_OK(fr, tdm_sock_reply(fr->sock, f, &c.base));
        return;
    }
    for (int i = 0; i < 4; i++) {
        Tandem__V1__GenerateChunk c = TANDEM__V1__GENERATE_CHUNK__INIT;
        int32_t id = i + 1;
        float lp = -0.5f * (float)(i + 1);
        Tandem__V1__TopLogprob e0 = TANDEM__V1__TOP_LOGPROB__INIT,
                               e1 = TANDEM__V1__TOP_LOGPROB__INIT;
        Tandem__V1__TopLogprob *ents[2] = {&e0, &e1};
        Tandem__V1__TopLogprobs tl = TANDEM__V1__TOP_LOGPROBS__INIT;
        Tandem__V1__TopLogprobs *tls[1] = {&tl};
        c.request_id = "req-hello";
        c.index = (uint32_t)i;
        c.n_token_ids = 1;
        c.token_ids = &id;
        c.text = (char *)(uintptr_t)texts[i];
        c.n_logprobs = 1;
        c.logprobs = &lp;
        if (i == 0) {
            e0.token_id = 1;
            e0.logprob = -0.5f;
            e0.text = "Hel";
            e1.token_id = 9;
            e1.logprob = -1.5f;
            e1.text = "He";
            tl.n_entries = 2;
            tl.entries = ents;
            c.n_top_logprobs = 1;
            c.top_logprobs = tls;
        }
        if (i == 3) {
            fake_final_fields(&c, &u, &t, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, 5, 4, 2);
            c.stop_reason = "!";
        }
        FAKE_OK(fr, tdm_sock_stream(fr->sock, f, &c.base));
    }
    fake_send_chunk(fr, f->peer, f->peer_len, f->call_id, TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
                    NULL);
}

static bool fake_add_stream(fake_router_t *fr, const tdm_frame_t *f, int tag, int total,
                            double interval, uint32_t prompt_tokens, int gate)
{
    for (int i = 0; i < FAKE_MAX_STREAMS; i++) {
        fake_stream_t *st = &fr->streams[i];
        if (st->active)
            continue;
        memset(st, 0, sizeof *st);
        st->active = true;
        memcpy(st->peer, f->peer, f->peer_len);
        st->peer_len = f->peer_len;
        st->call_id = f->call_id;
        st->tag = tag;
        st->total = total;
        st->interval = interval;
        st->next_t = now_s();
        st->prompt_tokens = prompt_tokens;
        st->gate = gate;
        fr->n_gated += gate > 0;
        return true;
    }
    return false;
}

/* Sends the next chunk of every stream that is due. */
static void fake_tick(fake_router_t *fr)
{
    double now = now_s();
    for (int i = 0; i < FAKE_MAX_STREAMS; i++) {
        fake_stream_t *st = &fr->streams[i];
        if (!st->active || st->next_t > now || fr->n_gated < st->gate)
            continue;
        Tandem__V1__GenerateChunk c = TANDEM__V1__GENERATE_CHUNK__INIT;
        Tandem__V1__Usage u;
        Tandem__V1__Timings t;
        char text[32];
        int32_t id = 100 + st->sent;
        if (st->tag >= 0)
            snprintf(text, sizeof text, "%d.%d ", st->tag, st->sent);
        else if (st->tag == -2)
            snprintf(text, sizeof text, "w%d ", st->sent);
        else
            snprintf(text, sizeof text, "s%d ", st->sent);
        c.request_id = "req-stream";
        c.index = (uint32_t)st->sent;
        c.n_token_ids = 1;
        c.token_ids = &id;
        c.text = text;
        bool last = st->total > 0 && st->sent + 1 == st->total;
        if (last)
            fake_final_fields(&c, &u, &t, TANDEM__V1__FINISH_REASON__FINISH_REASON_LENGTH,
                              st->prompt_tokens, (uint32_t)st->total, 0);
        fake_send_chunk(fr, st->peer, st->peer_len, st->call_id,
                        TANDEM__V1__FRAME_KIND__FRAME_KIND_STREAM, &c);
        st->sent++;
        st->next_t = now + st->interval;
        if (last) {
            fake_send_chunk(fr, st->peer, st->peer_len, st->call_id,
                            TANDEM__V1__FRAME_KIND__FRAME_KIND_END, NULL);
            st->active = false;
        }
    }
}

static void fake_generate(fake_router_t *fr, const tdm_frame_t *f)
{
    Tandem__V1__GenerateRequest *req = (Tandem__V1__GenerateRequest *)tdm_frame_unpack(
        f, &tandem__v1__generate_request__descriptor);
    if (!req) {
        FAKE_OK(fr, TDM_EINTERNAL);
        return;
    }
    pthread_mutex_lock(&fr->mu);
    fr->n_requests++;
    snprintf(fr->last_api_key, sizeof fr->last_api_key, "%s", f->api_key);
    fr->last_deadline_ms = f->deadline_unix_ms;
    fr->last_input_case = (int)req->input_case;
    fr->last_n_messages =
        req->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT ? req->chat->n_messages : 0;
    if (fr->last_n_messages)
        snprintf(fr->last_message_role, sizeof fr->last_message_role, "%s",
                 req->chat->messages[0]->role);
    fr->last_n_token_ids =
        req->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS ? req->tokens->n_ids : 0;
    fr->last_set_mask = req->sampling ? req->sampling->set_mask : 0;
    fr->last_has_seed = req->sampling ? req->sampling->has_seed : false;
    fr->last_temperature = req->sampling ? req->sampling->temperature : -1.0f;
    fr->last_max_tokens = req->max_tokens;
    fr->last_n_stop = req->n_stop;
    snprintf(fr->last_stop0, sizeof fr->last_stop0, "%s", req->n_stop ? req->stop[0] : "");
    snprintf(fr->last_request_id, sizeof fr->last_request_id, "%s", req->request_id);
    pthread_mutex_unlock(&fr->mu);

    int tag = 0, total = 0, gate = 0;
    bool added = true;
    if (req->input_case != TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT) {
        Tandem__V1__GenerateChunk c = TANDEM__V1__GENERATE_CHUNK__INIT;
        Tandem__V1__Usage u;
        Tandem__V1__Timings t;
        int32_t ids[2] = {42, 43};
        char echo[512];
        if (req->input_case == TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT) {
            const Tandem__V1__ChatList *cl = req->chat;
            snprintf(echo, sizeof echo, "you said: %s (%zu messages)",
                     cl->n_messages ? cl->messages[cl->n_messages - 1]->content : "",
                     cl->n_messages);
            c.n_token_ids = 1;
            c.token_ids = &ids[0];
            c.text = "you said: ";
            FAKE_OK(fr, tdm_sock_stream(fr->sock, f, &c.base));
            c.token_ids = &ids[1];
            c.index = 1;
            c.text = echo + strlen("you said: ");
        } else {
            c.n_token_ids = 1;
            c.token_ids = &ids[0];
            c.text = "ok";
        }
        fake_final_fields(&c, &u, &t, TANDEM__V1__FINISH_REASON__FINISH_REASON_STOP, 7, c.index + 1,
                          0);
        FAKE_OK(fr, tdm_sock_stream(fr->sock, f, &c.base));
        fake_send_chunk(fr, f->peer, f->peer_len, f->call_id,
                        TANDEM__V1__FRAME_KIND__FRAME_KIND_END, NULL);
    } else if (strcmp(req->prompt, "hello") == 0) {
        fake_hello(fr, f, req->stream);
    } else if (strcmp(req->prompt, "error") == 0) {
        Tandem__V1__GenerateChunk c = TANDEM__V1__GENERATE_CHUNK__INIT;
        int32_t id = 7;
        c.n_token_ids = 1;
        c.token_ids = &id;
        c.text = "partial";
        FAKE_OK(fr, tdm_sock_stream(fr->sock, f, &c.base));
        FAKE_OK(fr,
                tdm_sock_reply_error(fr->sock, f, TDM_EINVALID, "prompt: too long (fake, %d)", 42));
    } else if (strcmp(req->prompt, "toolong") == 0) {
        Tandem__V1__ErrorDetail d = TANDEM__V1__ERROR_DETAIL__INIT;
        d.field = "max_tokens";
        d.prompt_tokens = 100;
        d.n_ctx = 128;
        d.max_tokens_fit = 28;
        d.retry_after_s = 7;
        tdm_send_t m = {.peer = f->peer,
                        .peer_len = f->peer_len,
                        .kind = TANDEM__V1__FRAME_KIND__FRAME_KIND_END,
                        .method = f->method,
                        .call_id = f->call_id,
                        .status = TDM_EINVALID,
                        .message = "max_tokens: too many (fake)",
                        .body = &d.base};
        FAKE_OK(fr, tdm_sock_send(fr->sock, &m));
    } else if (strcmp(req->prompt, "slow") == 0) {
        added = fake_add_stream(fr, f, -1, 0, 0.020, 3, 0);
    } else if (sscanf(req->prompt, "tag:%d:%d:%d", &tag, &total, &gate) >= 2) {
        added = fake_add_stream(fr, f, tag, total, 0.005, 3, gate);
    } else if (strcmp(req->prompt, "silent") == 0) {
        /* never answers */
    } else {
        uint32_t words = 0;
        for (const char *p = req->prompt; *p; p++)
            words += (p == req->prompt || p[-1] == ' ') && *p != ' ';
        added =
            fake_add_stream(fr, f, -2, req->max_tokens > 0 ? req->max_tokens : 16, 0.001, words, 0);
    }
    if (!added)
        FAKE_OK(fr, tdm_sock_reply_error(fr->sock, f, TDM_ERESOURCE, "fake router: busy"));
    protobuf_c_message_free_unpacked(&req->base, NULL);
}

static void fake_unary(fake_router_t *fr, const tdm_frame_t *f)
{
    pthread_mutex_lock(&fr->mu);
    snprintf(fr->last_api_key, sizeof fr->last_api_key, "%s", f->api_key);
    pthread_mutex_unlock(&fr->mu);
    if (f->method == TANDEM__V1__METHOD__METHOD_HEALTH) {
        Tandem__V1__HealthResponse h = TANDEM__V1__HEALTH_RESPONSE__INIT;
        h.live = true;
        h.ready = true;
        h.version = "9.9.9-fake";
        FAKE_OK(fr, tdm_sock_reply(fr->sock, f, &h.base));
    } else if (f->method == TANDEM__V1__METHOD__METHOD_MODELS) {
        Tandem__V1__ModelInfo mi = TANDEM__V1__MODEL_INFO__INIT;
        Tandem__V1__ModelInfo *mis[1] = {&mi};
        Tandem__V1__ModelsResponse r = TANDEM__V1__MODELS_RESPONSE__INIT;
        mi.name = "smol";
        mi.fingerprint = 0xabcdef;
        mi.n_ctx = 8192;
        mi.n_vocab = 49152;
        mi.chat_template = "chatml";
        mi.state = "ready";
        mi.decode_nodes_up = 2;
        mi.prefill_nodes_up = 1;
        mi.requests_running = 4;
        mi.requests_queued = 3;
        r.n_models = 1;
        r.models = mis;
        FAKE_OK(fr, tdm_sock_reply(fr->sock, f, &r.base));
    } else if (f->method == TANDEM__V1__METHOD__METHOD_STATUS) {
        Tandem__V1__NodeStatus a = TANDEM__V1__NODE_STATUS__INIT;
        Tandem__V1__NodeStatus b = TANDEM__V1__NODE_STATUS__INIT;
        Tandem__V1__NodeStatus *nodes[2] = {&a, &b};
        Tandem__V1__NodeLoad la = TANDEM__V1__NODE_LOAD__INIT, lb = TANDEM__V1__NODE_LOAD__INIT;
        a.load = &la;
        b.load = &lb;
        Tandem__V1__ClusterStatus s = TANDEM__V1__CLUSTER_STATUS__INIT;
        a.node_id = "prefill-0";
        a.role = "prefill";
        a.up = true;
        a.device = "cpu";
        a.kv_blocks_total = 1000;
        la.kv_blocks_used = 250;
        la.queued_prefill_tokens = 4096;
        la.step_s = 0.125;
        a.last_heartbeat_age_s = 0.5;
        b.node_id = "decode-0";
        b.role = "decode";
        b.up = fr->all_up;
        b.device = "cuda:1";
        b.kv_blocks_total = 2000;
        lb.kv_blocks_used = 1500;
        lb.kv_blocks_cached = 100;
        lb.running = 12;
        lb.waiting = 3;
        lb.prefix_queries = 80;
        lb.prefix_hits = 20;
        lb.batch_size = 12;
        b.reserved_blocks = 7;
        s.version = "9.9.9-fake";
        s.model = "smol";
        s.n_nodes = 2;
        s.nodes = nodes;
        s.requests_running = 12;
        s.requests_queued = 3;
        s.requests_total = 12345;
        FAKE_OK(fr, tdm_sock_reply(fr->sock, f, &s.base));
    } else {
        FAKE_OK(fr, tdm_sock_reply_error(fr->sock, f, TDM_EINVALID, "bad method"));
    }
}

static void fake_cancel(fake_router_t *fr, const tdm_frame_t *f)
{
    pthread_mutex_lock(&fr->mu);
    if (fr->n_cancels < FAKE_MAX_CANCELS)
        fr->cancelled[fr->n_cancels] = f->call_id;
    fr->n_cancels++;
    pthread_mutex_unlock(&fr->mu);
    for (int i = 0; i < FAKE_MAX_STREAMS; i++)
        if (fr->streams[i].active && fr->streams[i].call_id == f->call_id)
            fr->streams[i].active = false; /* and sends nothing more */
}

static void *fake_main(void *arg)
{
    fake_router_t *fr = arg;
    tdm_frame_t f;
    tdm_frame_init(&f);
    while (!atomic_load(&fr->stop)) {
        int rc = tdm_sock_recv(fr->sock, &f, 2);
        if (rc == TDM_OK) {
            if (f.kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_CANCEL)
                fake_cancel(fr, &f);
            else if (f.kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST &&
                     f.method == TANDEM__V1__METHOD__METHOD_GENERATE)
                fake_generate(fr, &f);
            else if (f.kind == TANDEM__V1__FRAME_KIND__FRAME_KIND_REQUEST)
                fake_unary(fr, &f);
        }
        fake_tick(fr);
    }
    tdm_frame_clear(&f);
    return NULL;
}

/* Binds the fake router on endpoint and starts its thread. The socket is made here and
 * handed to the thread (pthread_create is the full barrier ZMQ asks for). */
static fake_router_t *fake_start_at(const char *endpoint)
{
    fake_router_t *fr = calloc(1, sizeof *fr);
    assert_non_null(fr);
    tdm_error_t err = {0};
    fr->net = tdm_net_new(1, &err);
    assert_non_null(fr->net);
    tdm_sock_opts_t so = {0};
    fr->sock = tdm_sock_bind(fr->net, endpoint, &so, &err);
    if (!fr->sock)
        fail_msg("bind: %s", err.msg);
    snprintf(fr->endpoint, sizeof fr->endpoint, "%s", tdm_sock_endpoint(fr->sock));
    assert_non_null(strstr(fr->endpoint, "tcp://127.0.0.1:"));
    pthread_mutex_init(&fr->mu, NULL);
    atomic_init(&fr->stop, false);
    atomic_init(&fr->n_errors, 0);
    assert_int_equal(pthread_create(&fr->thread, NULL, fake_main, fr), 0);
    return fr;
}

/* The fake router on a free port. */
static fake_router_t *fake_start(void)
{
    return fake_start_at("tcp://127.0.0.1:*");
}

static void fake_stop(fake_router_t **fr_p)
{
    fake_router_t *fr = *fr_p;
    atomic_store(&fr->stop, true);
    pthread_join(fr->thread, NULL);
    assert_int_equal(atomic_load(&fr->n_errors), 0);
    tdm_sock_destroy(&fr->sock);
    tdm_net_destroy(&fr->net);
    pthread_mutex_destroy(&fr->mu);
    free(fr);
    *fr_p = NULL;
}

/* Waits up to WAIT_S for the fake router to have seen a CANCEL of call_id. */
static bool fake_saw_cancel(fake_router_t *fr, uint64_t call_id)
{
    for (double until = now_s() + WAIT_S; now_s() < until;) {
        pthread_mutex_lock(&fr->mu);
        bool seen = false;
        for (int i = 0; i < fr->n_cancels && i < FAKE_MAX_CANCELS; i++)
            seen |= fr->cancelled[i] == call_id;
        pthread_mutex_unlock(&fr->mu);
        if (seen)
            return true;
        sleep_ms(5);
    }
    return false;
}

static int fake_n_cancels(fake_router_t *fr)
{
    pthread_mutex_lock(&fr->mu);
    int n = fr->n_cancels;
    pthread_mutex_unlock(&fr->mu);
    return n;
}

/* ---- fixtures ---- */

typedef struct fixture {
    fake_router_t *fr;
    tdm_client_t *c;
} fixture_t;

static int setup(void **state)
{
    fixture_t *fx = calloc(1, sizeof *fx);
    fx->fr = fake_start();
    tdm_client_opts_t o = {0};
    o.api_key = "sekret-key";
    o.timeout_s = 10;
    tdm_error_t err = {0};
    fx->c = tdm_client_new(fx->fr->endpoint, &o, &err);
    if (!fx->c)
        fail_msg("client: %s", err.msg);
    *state = fx;
    return 0;
}

static int teardown(void **state)
{
    fixture_t *fx = *state;
    tdm_client_destroy(&fx->c);
    assert_null(fx->c);
    fake_stop(&fx->fr);
    free(fx);
    return 0;
}

/* ---- chunk recorder ---- */

typedef struct recorder {
    int n_chunks;
    char text[1024];
    uint32_t indices[64];
    int32_t tokens[64];
    float logprobs[64];
    int n_top_first; /* entries of the first chunk's first token top list */
    int32_t top_ids[4];
    float top_lps[4];
    char top_texts[4][8];
    bool saw_last;
    tdm_client_finish_t last_finish;
    uint32_t last_completion;
    double last_ttft;
    char last_stop_reason[16];
    int cancel_after; /* return nonzero at this chunk count; 0 = never */
} recorder_t;

static int record_chunk(void *user, const tdm_client_chunk_t *ch)
{
    recorder_t *r = user;
    if (r->n_chunks < 64) {
        r->indices[r->n_chunks] = ch->index;
        r->tokens[r->n_chunks] = ch->n_tokens ? ch->token_ids[0] : -1;
        r->logprobs[r->n_chunks] = ch->n_logprobs ? ch->logprobs[0] : 0.0f;
    }
    if (r->n_chunks == 0 && ch->n_top_logprobs > 0) {
        r->n_top_first = (int)ch->top_logprobs[0].n_entries;
        for (size_t i = 0; i < ch->top_logprobs[0].n_entries && i < 4; i++) {
            r->top_ids[i] = ch->top_logprobs[0].entries[i].token_id;
            r->top_lps[i] = ch->top_logprobs[0].entries[i].logprob;
            snprintf(r->top_texts[i], sizeof r->top_texts[i], "%s",
                     ch->top_logprobs[0].entries[i].text);
        }
    }
    assert_int_equal(strlen(ch->text), ch->text_len);
    strncat(r->text, ch->text, sizeof r->text - strlen(r->text) - 1);
    r->n_chunks++;
    if (ch->last) {
        r->saw_last = true;
        r->last_finish = ch->finish_reason;
        assert_non_null(ch->usage);
        assert_non_null(ch->timings);
        r->last_completion = ch->usage->completion_tokens;
        r->last_ttft = ch->timings->ttft_s;
        snprintf(r->last_stop_reason, sizeof r->last_stop_reason, "%s", ch->stop_reason);
    } else {
        assert_null(ch->usage);
        assert_null(ch->timings);
        assert_int_equal(ch->finish_reason, TDM_CLIENT_FINISH_NONE);
    }
    return r->cancel_after > 0 && r->n_chunks >= r->cancel_after;
}

/* ---- tests ---- */

static void test_stream_order_and_text(void **state)
{
    fixture_t *fx = *state;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "hello";
    req.request_id = "my-req-1";
    req.max_tokens = 4;
    const char *stops[2] = {"!", "\n\n"};
    req.stop = stops;
    req.n_stop = 2;
    recorder_t rec = {0};
    tdm_client_result_t res;
    uint64_t start_ms = tdm_net_now_ms();
    assert_int_equal(tdm_client_generate(fx->c, &req, record_chunk, &rec, &res), TDM_OK);
    uint64_t end_ms = tdm_net_now_ms();
    assert_int_equal(res.status, TDM_OK);
    assert_string_equal(res.message, "");
    /* callback order and the text put back together */
    assert_int_equal(rec.n_chunks, 4);
    for (uint32_t i = 0; i < 4; i++) {
        assert_int_equal(rec.indices[i], i);
        assert_int_equal(rec.tokens[i], (int32_t)i + 1);
        assert_float_equal(rec.logprobs[i], -0.5f * (float)(i + 1), 1e-6);
    }
    assert_string_equal(rec.text, "Hello world");
    assert_true(rec.saw_last);
    assert_int_equal(rec.last_finish, TDM_CLIENT_FINISH_STOP);
    assert_int_equal(rec.last_completion, 4);
    assert_float_equal(rec.last_ttft, 0.010, 1e-12);
    assert_string_equal(rec.last_stop_reason, "!");
    /* top logprobs of the first token, most likely first */
    assert_int_equal(rec.n_top_first, 2);
    assert_int_equal(rec.top_ids[0], 1);
    assert_int_equal(rec.top_ids[1], 9);
    assert_float_equal(rec.top_lps[1], -1.5f, 1e-6);
    assert_string_equal(rec.top_texts[0], "Hel");
    assert_string_equal(rec.top_texts[1], "He");
    /* the result */
    assert_string_equal(res.text, "Hello world");
    assert_int_equal(res.text_len, 11);
    assert_int_equal(res.n_tokens, 4);
    assert_int_equal(res.token_ids[0], 1);
    assert_int_equal(res.token_ids[3], 4);
    assert_int_equal(res.n_chunks, 4);
    assert_string_equal(res.request_id, "req-hello");
    assert_string_equal(res.stop_reason, "!");
    assert_int_equal(res.finish_reason, TDM_CLIENT_FINISH_STOP);
    assert_int_equal(res.usage.prompt_tokens, 5);
    assert_int_equal(res.usage.completion_tokens, 4);
    assert_int_equal(res.usage.cached_prompt_tokens, 2);
    assert_float_equal(res.timings.queue_s, 0.001, 1e-12);
    assert_float_equal(res.timings.ttft_s, 0.010, 1e-12);
    assert_float_equal(res.timings.tpot_s, 0.010, 1e-12);
    assert_float_equal(res.timings.decode_s, 0.030, 1e-12);
    assert_float_equal(res.timings.prefill_s, 0.005, 1e-12);
    assert_float_equal(res.timings.kv_transfer_s, 0.002, 1e-12);
    assert_float_equal(res.timings.e2e_s, 0.040, 1e-12);
    /* client-side timings: ordered and plausible */
    assert_true(res.client_timings.ttft_s > 0);
    assert_true(res.client_timings.ttft_s <= res.client_timings.e2e_s);
    assert_true(res.client_timings.decode_s >= 0);
    assert_float_equal(res.client_timings.tpot_s, res.client_timings.decode_s / 3, 1e-12);
    assert_true(res.client_timings.e2e_s < 10); /* within the call's deadline */
    tdm_client_result_clear(&res);
    assert_null(res.text);
    /* what the router saw: API key, request id, stop strings, max_tokens, a deadline 10 s
     * after the send (which came between start_ms and end_ms), no sampling field set */
    fake_router_t *fr = fx->fr;
    pthread_mutex_lock(&fr->mu);
    assert_string_equal(fr->last_api_key, "sekret-key");
    assert_string_equal(fr->last_request_id, "my-req-1");
    assert_int_equal(fr->last_n_stop, 2);
    assert_string_equal(fr->last_stop0, "!");
    assert_int_equal(fr->last_max_tokens, 4);
    assert_int_equal(fr->last_set_mask, 0);
    assert_false(fr->last_has_seed);
    assert_int_equal(fr->last_input_case, TANDEM__V1__GENERATE_REQUEST__INPUT_PROMPT);
    assert_true(fr->last_deadline_ms >= start_ms + 10000);
    assert_true(fr->last_deadline_ms <= end_ms + 10000);
    pthread_mutex_unlock(&fr->mu);
    assert_int_equal(tdm_client_pending(fx->c), 0);
    assert_int_equal(fake_n_cancels(fr), 0); /* a call that ends normally sends no CANCEL */
}

static void test_no_stream(void **state)
{
    fixture_t *fx = *state;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "hello";
    req.stream = false;
    recorder_t rec = {0};
    tdm_client_result_t res;
    assert_int_equal(tdm_client_generate(fx->c, &req, record_chunk, &rec, &res), TDM_OK);
    assert_int_equal(rec.n_chunks, 1); /* once, with everything */
    assert_true(rec.saw_last);
    assert_string_equal(rec.text, "Hello world");
    assert_string_equal(res.text, "Hello world");
    assert_int_equal(res.n_tokens, 4);
    assert_int_equal(res.n_chunks, 1);
    assert_int_equal(res.finish_reason, TDM_CLIENT_FINISH_STOP);
    assert_int_equal(res.usage.completion_tokens, 4);
    assert_float_equal(res.client_timings.tpot_s, 0.0, 0); /* all tokens in one chunk */
    tdm_client_result_clear(&res);
}

static void test_error_end(void **state)
{
    fixture_t *fx = *state;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "error";
    recorder_t rec = {0};
    tdm_client_result_t res;
    assert_int_equal(tdm_client_generate(fx->c, &req, record_chunk, &rec, &res), TDM_EINVALID);
    assert_int_equal(res.status, TDM_EINVALID);
    assert_string_equal(res.message, "prompt: too long (fake, 42)");
    assert_string_equal(tdm_client_errmsg(fx->c), "prompt: too long (fake, 42)");
    assert_int_equal(res.finish_reason, TDM_CLIENT_FINISH_ERROR);
    assert_string_equal(res.text, "partial"); /* what came before the error is kept */
    assert_int_equal(rec.n_chunks, 1);
    tdm_client_result_clear(&res);
}

/* A refusal's ErrorDetail reaches the result as fields; other errors leave them empty. */
static void test_error_detail(void **state)
{
    fixture_t *fx = *state;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "toolong";
    req.max_tokens = 50;
    tdm_client_result_t res;
    assert_int_equal(tdm_client_generate(fx->c, &req, NULL, NULL, &res), TDM_EINVALID);
    assert_string_equal(res.message, "max_tokens: too many (fake)");
    assert_string_equal(res.error.field, "max_tokens");
    assert_int_equal(res.error.prompt_tokens, 100);
    assert_int_equal(res.error.n_ctx, 128);
    assert_int_equal(res.error.max_tokens_fit, 28);
    assert_int_equal(res.error.retry_after_s, 7);
    tdm_client_result_clear(&res);
    req.prompt = "error";
    assert_int_equal(tdm_client_generate(fx->c, &req, NULL, NULL, &res), TDM_EINVALID);
    assert_string_equal(res.error.field, "");
    assert_int_equal(res.error.n_ctx, 0);
    tdm_client_result_clear(&res);
}

static void test_deadline(void **state)
{
    fixture_t *fx = *state;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "slow";
    /* Long enough for a busy machine to deliver a few of the chunks sent every 20 ms, which
     * must not keep the call alive; well short of the client's default (10 s). */
    req.timeout_s = 1.0;
    recorder_t rec = {0};
    tdm_client_result_t res;
    double t0 = now_s();
    assert_int_equal(tdm_client_generate(fx->c, &req, record_chunk, &rec, &res), TDM_EDEADLINE);
    double took = now_s() - t0;
    assert_true(took >= 1.0 && took < 10.0);
    assert_int_equal(res.finish_reason, TDM_CLIENT_FINISH_CANCELLED);
    assert_non_null(strstr(res.message, "deadline exceeded"));
    assert_true(rec.n_chunks >= 2); /* chunks arrived meanwhile */
    assert_true(fake_saw_cancel(fx->fr, res.call_id));
    /* the REQUEST carried the deadline */
    pthread_mutex_lock(&fx->fr->mu);
    uint64_t dl = fx->fr->last_deadline_ms;
    pthread_mutex_unlock(&fx->fr->mu);
    assert_true(dl > 0 && dl <= tdm_net_now_ms());
    tdm_client_result_clear(&res);

    /* late frames of the dead call are dropped; the next call works */
    req.prompt = "hello";
    req.timeout_s = 0;
    assert_int_equal(tdm_client_generate(fx->c, &req, NULL, NULL, &res), TDM_OK);
    assert_string_equal(res.text, "Hello world");
    tdm_client_result_clear(&res);

    /* a call the router never answers ends at its deadline too */
    req.prompt = "silent";
    req.timeout_s = 0.1;
    assert_int_equal(tdm_client_generate(fx->c, &req, NULL, NULL, &res), TDM_EDEADLINE);
    assert_int_equal(res.n_chunks, 0);
    assert_string_equal(res.text, "");
    assert_true(fake_saw_cancel(fx->fr, res.call_id));
    tdm_client_result_clear(&res);
}

static void test_callback_cancel(void **state)
{
    fixture_t *fx = *state;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "slow";
    recorder_t rec = {0};
    rec.cancel_after = 3;
    tdm_client_result_t res;
    assert_int_equal(tdm_client_generate(fx->c, &req, record_chunk, &rec, &res), TDM_ECANCELLED);
    assert_int_equal(rec.n_chunks, 3);
    assert_string_equal(res.text, "s0 s1 s2 ");
    assert_int_equal(res.n_tokens, 3);
    assert_int_equal(res.finish_reason, TDM_CLIENT_FINISH_CANCELLED);
    assert_string_equal(res.message, "cancelled by the caller");
    assert_true(fake_saw_cancel(fx->fr, res.call_id));
    tdm_client_result_clear(&res);
}

static void test_cancel_flag(void **state)
{
    fixture_t *fx = *state;
    volatile sig_atomic_t flag = 1;
    tdm_client_opts_t o = {0};
    o.cancel_flag = &flag;
    tdm_error_t err = {0};
    tdm_client_t *c = tdm_client_new(fx->fr->endpoint, &o, &err);
    assert_non_null(c);
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "slow";
    tdm_client_result_t res;
    assert_int_equal(tdm_client_generate(c, &req, NULL, NULL, &res), TDM_ECANCELLED);
    assert_int_equal(res.finish_reason, TDM_CLIENT_FINISH_CANCELLED);
    assert_true(fake_saw_cancel(fx->fr, res.call_id));
    tdm_client_result_clear(&res);
    tdm_client_destroy(&c);
}

/* ---- async ---- */

typedef struct async_call {
    uint64_t id;
    int tag, total;
    int n_done;
    int status;
    char text[256];
    size_t n_tokens;
    tdm_client_finish_t finish;
    char message[512];   /* the result's message */
    uint32_t next_index; /* chunks must come in index order */
    bool order_ok;
} async_call_t;

typedef struct async_state {
    async_call_t calls[8];
    uint64_t seen[512]; /* call id of each chunk in arrival order */
    int n_seen;
} async_state_t;

typedef struct async_ctx {
    async_state_t *st;
    async_call_t *call;
} async_ctx_t;

static int async_chunk(void *user, const tdm_client_chunk_t *ch)
{
    async_ctx_t *ctx = user;
    if (ch->index != ctx->call->next_index)
        ctx->call->order_ok = false;
    ctx->call->next_index = ch->index + (uint32_t)ch->n_tokens;
    if (ctx->st->n_seen < 512)
        ctx->st->seen[ctx->st->n_seen++] = ch->call_id;
    return 0;
}

static void async_done(void *user, const tdm_client_result_t *r)
{
    async_ctx_t *ctx = user;
    ctx->call->n_done++;
    ctx->call->status = r->status;
    snprintf(ctx->call->text, sizeof ctx->call->text, "%s", r->text);
    ctx->call->n_tokens = r->n_tokens;
    ctx->call->finish = r->finish_reason;
    snprintf(ctx->call->message, sizeof ctx->call->message, "%s", r->message);
    assert_int_equal(r->call_id, ctx->call->id);
}

static void test_async_concurrent(void **state)
{
    fixture_t *fx = *state;
    async_state_t st = {0};
    async_ctx_t ctx[8];
    char prompts[8][32];
    for (int k = 0; k < 8; k++) {
        async_call_t *ac = &st.calls[k];
        ac->tag = k;
        ac->total = 5 + k;
        ac->order_ok = true;
        ctx[k] = (async_ctx_t){&st, ac};
        /* gated: the fake starts no stream before all 8 arrived, so they interleave */
        snprintf(prompts[k], sizeof prompts[k], "tag:%d:%d:8", k, ac->total);
        tdm_client_request_t req;
        tdm_client_request_init(&req);
        req.prompt = prompts[k];
        assert_int_equal(
            tdm_client_generate_start(fx->c, &req, async_chunk, async_done, &ctx[k], &ac->id),
            TDM_OK);
        assert_true(ac->id > 0);
        if (k > 0)
            assert_true(ac->id > st.calls[k - 1].id);
    }
    assert_int_equal(tdm_client_pending(fx->c), 8);
    int ended = 0;
    double t0 = now_s();
    while (ended < 8 && now_s() - t0 < WAIT_S) {
        int rc = tdm_client_poll(fx->c, 100);
        assert_true(rc >= 0);
        ended += rc;
    }
    assert_int_equal(ended, 8);
    assert_int_equal(tdm_client_pending(fx->c), 0);
    int total_chunks = 0;
    for (int k = 0; k < 8; k++) {
        async_call_t *ac = &st.calls[k];
        char want[256] = "";
        for (int i = 0; i < ac->total; i++) {
            char piece[16];
            snprintf(piece, sizeof piece, "%d.%d ", k, i);
            strcat(want, piece);
        }
        assert_int_equal(ac->n_done, 1);
        assert_int_equal(ac->status, TDM_OK);
        assert_string_equal(ac->text, want);
        assert_int_equal(ac->n_tokens, (size_t)ac->total);
        assert_int_equal(ac->finish, TDM_CLIENT_FINISH_LENGTH);
        assert_true(ac->order_ok);
        total_chunks += ac->total;
    }
    assert_int_equal(st.n_seen, total_chunks);
    /* the streams were interleaved: some chunk of another call came between the first and
     * the last chunk of call 0 */
    int first = -1, last = -1;
    bool other_between = false;
    for (int i = 0; i < st.n_seen; i++)
        if (st.seen[i] == st.calls[0].id) {
            if (first < 0)
                first = i;
            last = i;
        }
    for (int i = first; i <= last; i++)
        other_between |= st.seen[i] != st.calls[0].id;
    assert_true(other_between);
}

static void test_async_cancel_and_destroy(void **state)
{
    fixture_t *fx = *state;
    async_state_t st = {0};
    async_ctx_t ctx[2] = {{&st, &st.calls[0]}, {&st, &st.calls[1]}};
    st.calls[0].order_ok = st.calls[1].order_ok = true;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "slow";
    assert_int_equal(
        tdm_client_generate_start(fx->c, &req, async_chunk, async_done, &ctx[0], &st.calls[0].id),
        TDM_OK);
    assert_int_equal(
        tdm_client_generate_start(fx->c, &req, async_chunk, async_done, &ctx[1], &st.calls[1].id),
        TDM_OK);
    for (int i = 0; i < 5; i++)
        assert_true(tdm_client_poll(fx->c, 10) >= 0);
    assert_int_equal(tdm_client_generate_cancel(fx->c, st.calls[0].id), TDM_OK);
    assert_int_equal(st.calls[0].n_done, 1); /* on_done ran inside cancel */
    assert_int_equal(st.calls[0].status, TDM_ECANCELLED);
    assert_int_equal(st.calls[0].finish, TDM_CLIENT_FINISH_CANCELLED);
    assert_true(fake_saw_cancel(fx->fr, st.calls[0].id));
    assert_int_equal(tdm_client_generate_cancel(fx->c, st.calls[0].id), TDM_ENOTFOUND);
    assert_int_equal(tdm_client_pending(fx->c), 1);
    /* destroying the client ends the other call (on_done, CANCEL) */
    tdm_client_destroy(&fx->c);
    assert_int_equal(st.calls[1].n_done, 1);
    assert_int_equal(st.calls[1].status, TDM_ECANCELLED);
    assert_true(fake_saw_cancel(fx->fr, st.calls[1].id));
    assert_int_equal(st.calls[0].n_done, 1);
}

static void test_inputs_and_sampling(void **state)
{
    fixture_t *fx = *state;
    tdm_chat_message_t msgs[2] = {{.role = "system", .content = "be brief"},
                                  {.role = "user", .content = "hi"}};
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.messages = msgs;
    req.n_messages = 2;
    req.sampling.temperature = 0.25f;
    req.sampling_set = TDM_PROTO_SET_TEMPERATURE;
    tdm_client_result_t res;
    assert_int_equal(tdm_client_generate(fx->c, &req, NULL, NULL, &res), TDM_OK);
    assert_string_equal(res.text, "you said: hi (2 messages)");
    assert_int_equal(res.n_tokens, 2);
    tdm_client_result_clear(&res);
    pthread_mutex_lock(&fx->fr->mu);
    assert_int_equal(fx->fr->last_input_case, TANDEM__V1__GENERATE_REQUEST__INPUT_CHAT);
    assert_int_equal(fx->fr->last_n_messages, 2);
    assert_string_equal(fx->fr->last_message_role, "system");
    assert_int_equal(fx->fr->last_set_mask, TDM_PROTO_SET_TEMPERATURE);
    assert_false(fx->fr->last_has_seed);
    assert_float_equal(fx->fr->last_temperature, 0.25f, 0);
    pthread_mutex_unlock(&fx->fr->mu);

    int32_t ids[3] = {1, 2, 3};
    tdm_client_request_init(&req);
    req.token_ids = ids;
    req.n_token_ids = 3;
    req.sampling.seed = 7;
    req.sampling_set = TDM_CLIENT_SAMPLING_ALL;
    assert_int_equal(tdm_client_generate(fx->c, &req, NULL, NULL, &res), TDM_OK);
    tdm_client_result_clear(&res);
    pthread_mutex_lock(&fx->fr->mu);
    assert_int_equal(fx->fr->last_input_case, TANDEM__V1__GENERATE_REQUEST__INPUT_TOKENS);
    assert_int_equal(fx->fr->last_n_token_ids, 3);
    assert_int_equal(fx->fr->last_set_mask, TDM_CLIENT_SAMPLING_ALL);
    assert_true(fx->fr->last_has_seed);
    pthread_mutex_unlock(&fx->fr->mu);
}

static int never_chunk(void *user, const tdm_client_chunk_t *ch)
{
    fail_msg("on_chunk ran for a call that failed to start");
    return 0;
}

static void never_done(void *user, const tdm_client_result_t *r)
{
    fail_msg("on_done ran for a call that failed to start");
}

static void test_bad_requests(void **state)
{
    fixture_t *fx = *state;
    tdm_client_request_t req;
    tdm_client_result_t res;
    tdm_client_request_init(&req);
    /* no input */
    assert_int_equal(tdm_client_generate(fx->c, &req, never_chunk, NULL, &res), TDM_EINVALID);
    assert_non_null(strstr(res.message, "exactly one of prompt, messages and token_ids"));
    assert_string_equal(res.text, "");
    tdm_client_result_clear(&res);
    /* two inputs */
    int32_t ids[1] = {5};
    req.prompt = "x";
    req.token_ids = ids;
    req.n_token_ids = 1;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, never_chunk, never_done, NULL, NULL),
                     TDM_EINVALID);
    assert_non_null(strstr(tdm_client_errmsg(fx->c), "(2 given)"));
    /* too many and empty stop strings, negative max_tokens */
    tdm_client_request_init(&req);
    req.prompt = "x";
    const char *stops[17];
    for (int i = 0; i < 17; i++)
        stops[i] = "s";
    req.stop = stops;
    req.n_stop = 17;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, never_chunk, never_done, NULL, NULL),
                     TDM_EINVALID);
    assert_non_null(strstr(tdm_client_errmsg(fx->c), "stop: 17 strings given, at most 16 allowed"));
    stops[0] = "";
    req.n_stop = 1;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, never_chunk, never_done, NULL, NULL),
                     TDM_EINVALID);
    assert_non_null(strstr(tdm_client_errmsg(fx->c), "stop[0] must have 1..256 bytes"));
    req.n_stop = 0;
    req.max_tokens = -1;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, never_chunk, never_done, NULL, NULL),
                     TDM_EINVALID);
    assert_non_null(strstr(tdm_client_errmsg(fx->c), "max_tokens"));
    assert_int_equal(tdm_client_pending(fx->c), 0);
    pthread_mutex_lock(&fx->fr->mu);
    assert_int_equal(fx->fr->n_requests, 0); /* nothing was sent */
    pthread_mutex_unlock(&fx->fr->mu);
}

static void on_done_noop(void *user, const tdm_client_result_t *r)
{
    (void)user;
    (void)r;
}

typedef struct unary_seen {
    int n_done, status;
    ProtobufCMessage *resp; /* taken from the callback */
} unary_seen_t;

static void on_unary(void *user, int status, const char *message, ProtobufCMessage **resp)
{
    (void)message;
    unary_seen_t *u = user;
    u->n_done++;
    u->status = status;
    u->resp = *resp;
    *resp = NULL;
}

/* Async unary calls end through their callback exactly once, cancelled ones too; poll_fd
 * returns for a written fd; a refused start names the field (tdm_client_errfield). */
static void test_async_unary_and_wake_fd(void **state)
{
    fixture_t *fx = *state;
    Tandem__V1__HealthRequest hr = TANDEM__V1__HEALTH_REQUEST__INIT;
    unary_seen_t u = {0};
    uint64_t id = 0;
    assert_int_equal(tdm_client_call_start(fx->c, TANDEM__V1__METHOD__METHOD_HEALTH, &hr.base,
                                           &tandem__v1__health_response__descriptor, WAIT_S,
                                           on_unary, &u, &id),
                     TDM_OK);
    assert_true(id > 0);
    while (u.n_done == 0)
        assert_true(tdm_client_poll(fx->c, 1000) >= 0);
    assert_int_equal(u.n_done, 1);
    assert_int_equal(u.status, TDM_OK);
    assert_non_null(u.resp);
    assert_true(((Tandem__V1__HealthResponse *)u.resp)->live);
    protobuf_c_message_free_unpacked(u.resp, NULL);
    /* cancelled before the answer: on_done once, CANCELLED, no response */
    unary_seen_t cu = {0};
    assert_int_equal(tdm_client_call_start(fx->c, TANDEM__V1__METHOD__METHOD_HEALTH, &hr.base,
                                           &tandem__v1__health_response__descriptor, WAIT_S,
                                           on_unary, &cu, &id),
                     TDM_OK);
    assert_int_equal(tdm_client_cancel(fx->c, id), TDM_OK);
    assert_int_equal(cu.n_done, 1);
    assert_int_equal(cu.status, TDM_ECANCELLED);
    assert_null(cu.resp);
    assert_int_equal(tdm_client_poll(fx->c, 100), 0); /* its late answer is dropped */
    assert_int_equal(cu.n_done, 1);
    assert_int_equal(tdm_client_call_start(fx->c, TANDEM__V1__METHOD__METHOD_GENERATE, &hr.base,
                                           &tandem__v1__health_response__descriptor, WAIT_S,
                                           on_unary, &cu, &id),
                     TDM_EINVALID);

    int efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    assert_true(efd >= 0);
    uint64_t one = 1;
    assert_int_equal(write(efd, &one, sizeof one), sizeof one);
    double t0 = now_s();
    assert_int_equal(tdm_client_poll_fd(fx->c, 60000, efd), 0);
    assert_true(now_s() - t0 < 30); /* woken by the fd, not the minute */
    close(efd);

    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "hello";
    const char *stops[2] = {"ok", ""};
    req.stop = stops;
    req.n_stop = 2;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, NULL, on_done_noop, NULL, NULL),
                     TDM_EINVALID);
    assert_string_equal(tdm_client_errfield(fx->c), "stop[1]");
    req.n_stop = 0;
    /* bad words: 1..256 bytes each, at most 128 */
    char big[300];
    memset(big, 'w', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    const char *words[129];
    for (int i = 0; i < 129; i++)
        words[i] = "w";
    words[1] = big;
    req.bad_words = words;
    req.n_bad_words = 2;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, NULL, on_done_noop, NULL, NULL),
                     TDM_EINVALID);
    assert_string_equal(tdm_client_errfield(fx->c), "sampling.bad_words[1]");
    words[1] = "w";
    req.n_bad_words = 129;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, NULL, on_done_noop, NULL, NULL),
                     TDM_EINVALID);
    assert_string_equal(tdm_client_errfield(fx->c), "sampling.bad_words");
    req.n_bad_words = 0;
    uint64_t gid;
    assert_int_equal(tdm_client_generate_start(fx->c, &req, NULL, on_done_noop, NULL, &gid),
                     TDM_OK);
    assert_string_equal(tdm_client_errfield(fx->c), "");
    assert_int_equal(tdm_client_cancel(fx->c, gid), TDM_OK);
}

static void test_health_models_status(void **state)
{
    fixture_t *fx = *state;
    tdm_client_health_t h;
    assert_int_equal(tdm_client_health(fx->c, WAIT_S, &h), TDM_OK);
    assert_true(h.live);
    assert_true(h.ready);
    assert_string_equal(h.version, "9.9.9-fake");
    pthread_mutex_lock(&fx->fr->mu);
    assert_string_equal(fx->fr->last_api_key, "sekret-key");
    pthread_mutex_unlock(&fx->fr->mu);

    tdm_client_models_t m;
    assert_int_equal(tdm_client_models(fx->c, WAIT_S, &m), TDM_OK);
    assert_int_equal(m.n_models, 1);
    assert_string_equal(m.models[0].name, "smol");
    assert_int_equal(m.models[0].fingerprint, 0xabcdef);
    assert_int_equal(m.models[0].n_ctx, 8192);
    assert_int_equal(m.models[0].n_vocab, 49152);
    assert_string_equal(m.models[0].chat_template, "chatml");
    assert_string_equal(m.models[0].state, "ready");
    assert_int_equal(m.models[0].decode_nodes_up, 2);
    assert_int_equal(m.models[0].prefill_nodes_up, 1);
    assert_int_equal(m.models[0].requests_running, 4);
    assert_int_equal(m.models[0].requests_queued, 3);
    tdm_client_models_clear(&m);
    assert_null(m.models);

    tdm_client_cluster_status_t s;
    assert_int_equal(tdm_client_status(fx->c, WAIT_S, &s), TDM_OK);
    assert_string_equal(s.version, "9.9.9-fake");
    assert_string_equal(s.model, "smol");
    assert_int_equal(s.requests_running, 12);
    assert_int_equal(s.requests_queued, 3);
    assert_int_equal(s.requests_total, 12345);
    assert_int_equal(s.n_nodes, 2);
    assert_string_equal(s.nodes[0].node_id, "prefill-0");
    assert_string_equal(s.nodes[0].role, "prefill");
    assert_true(s.nodes[0].up);
    assert_int_equal(s.nodes[0].kv_blocks_used, 250);
    assert_int_equal(s.nodes[0].queued_prefill_tokens, 4096);
    assert_float_equal(s.nodes[0].step_time_s, 0.125, 0);
    const tdm_client_node_status_t *d = tdm_client_status_find_node(&s, "decode-0");
    assert_ptr_equal(d, &s.nodes[1]);
    assert_false(d->up);
    assert_string_equal(d->device, "cuda:1");
    assert_int_equal(d->kv_blocks_total, 2000);
    assert_int_equal(d->kv_blocks_used, 1500);
    assert_int_equal(d->kv_blocks_cached, 100);
    assert_int_equal(d->running, 12);
    assert_int_equal(d->waiting, 3);
    assert_int_equal(d->prefix_queries, 80);
    assert_int_equal(d->prefix_hits, 20);
    assert_int_equal(d->batch_size, 12);
    assert_int_equal(d->reserved_blocks, 7);
    assert_null(tdm_client_status_find_node(&s, "nope"));
    tdm_client_cluster_status_clear(&s);
    assert_int_equal(s.n_nodes, 0);

    /* a unary call while an async stream runs: both get their frames */
    async_state_t st = {0};
    async_ctx_t ctx = {&st, &st.calls[0]};
    st.calls[0].order_ok = true;
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "tag:3:20";
    assert_int_equal(
        tdm_client_generate_start(fx->c, &req, async_chunk, async_done, &ctx, &st.calls[0].id),
        TDM_OK);
    /* the stream runs: its first chunk came (the other 19 follow 5 ms apart) */
    for (double until = now_s() + WAIT_S; st.n_seen == 0 && now_s() < until;)
        assert_true(tdm_client_poll(fx->c, 100) >= 0);
    assert_true(st.n_seen > 0);
    assert_int_equal(tdm_client_health(fx->c, WAIT_S, &h), TDM_OK);
    while (tdm_client_pending(fx->c) > 0)
        assert_true(tdm_client_poll(fx->c, 100) >= 0);
    assert_int_equal(st.calls[0].n_done, 1);
    assert_int_equal(st.calls[0].n_tokens, 20);
    assert_true(st.calls[0].order_ok);
}

static void test_router_down(void **state)
{
    (void)state;
    /* nothing listens on port 1 */
    tdm_error_t err = {0};
    tdm_client_t *c = tdm_client_new("tcp://127.0.0.1:1", NULL, &err);
    assert_non_null(c);
    tdm_client_health_t h;
    double t0 = now_s();
    assert_int_equal(tdm_client_health(c, 0.1, &h), TDM_EDEADLINE);
    assert_true(now_s() - t0 < 10.0); /* its own deadline, not the client's default */
    assert_non_null(strstr(tdm_client_errmsg(c), "tcp://127.0.0.1:1"));
    tdm_client_destroy(&c);
    assert_null(tdm_client_new("", NULL, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_null(tdm_client_new("nonsense://x", NULL, &err));
    assert_int_equal(err.code, TDM_EINVALID);
}

/* Starts a "slow" stream (calls[0]) and a "silent" call (calls[1]) and polls until the stream
 * has delivered two chunks. */
static void start_slow_and_silent(tdm_client_t *c, async_state_t *st, async_ctx_t ctx[2])
{
    const char *prompts[2] = {"slow", "silent"};
    for (int k = 0; k < 2; k++) {
        tdm_client_request_t req;
        tdm_client_request_init(&req);
        req.prompt = prompts[k];
        st->calls[k].order_ok = true;
        assert_int_equal(
            tdm_client_generate_start(c, &req, async_chunk, async_done, &ctx[k], &st->calls[k].id),
            TDM_OK);
    }
    for (double until = now_s() + WAIT_S; st->n_seen < 2 && now_s() < until;)
        assert_true(tdm_client_poll(c, 100) >= 0);
    assert_true(st->n_seen >= 2);
}

/* The router goes away with calls in flight (its socket closes, as when it is killed with
 * kill -9): a stream that had started and a call that had no answer yet both end with
 * UNAVAILABLE "router connection lost" long before their 60 s deadline, once; a router
 * started again on the same endpoint then serves the same client. */
static void test_router_lost_and_back(void **state)
{
    (void)state;
    fake_router_t *fr = fake_start();
    char endpoint[256];
    snprintf(endpoint, sizeof endpoint, "%s", fr->endpoint);
    tdm_client_opts_t o = {0};
    o.timeout_s = 60;
    tdm_error_t err = {0};
    tdm_client_t *c = tdm_client_new(endpoint, &o, &err);
    if (!c)
        fail_msg("client: %s", err.msg);
    tdm_client_health_t h;
    assert_int_equal(tdm_client_health(c, WAIT_S, &h), TDM_OK);

    async_state_t st = {0};
    async_ctx_t ctx[2] = {{&st, &st.calls[0]}, {&st, &st.calls[1]}};
    start_slow_and_silent(c, &st, ctx); /* the stream is under way */

    fake_stop(&fr); /* the router is gone */
    int ended = 0;
    for (double until = now_s() + WAIT_S; ended < 2 && now_s() < until;) {
        int rc = tdm_client_poll(c, 100);
        assert_true(rc >= 0);
        ended += rc;
    }
    assert_int_equal(ended, 2);
    assert_int_equal(tdm_client_pending(c), 0);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(st.calls[k].n_done, 1);
        assert_int_equal(st.calls[k].status, TDM_EUNAVAILABLE);
        assert_int_equal(st.calls[k].finish, TDM_CLIENT_FINISH_ERROR);
        assert_non_null(strstr(st.calls[k].message, "router connection lost"));
        assert_true(st.calls[k].order_ok);
    }
    assert_true(st.calls[0].n_tokens >= 2); /* what the stream had delivered is kept */

    /* a router on the same endpoint again: the same client works */
    fr = fake_start_at(endpoint);
    assert_int_equal(tdm_client_health(c, WAIT_S, &h), TDM_OK);
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "hello";
    tdm_client_result_t res;
    assert_int_equal(tdm_client_generate(c, &req, NULL, NULL, &res), TDM_OK);
    assert_string_equal(res.text, "Hello world");
    tdm_client_result_clear(&res);
    tdm_client_destroy(&c);
    fake_stop(&fr);
}

/* fr's request count (every REQUEST it read). */
static int fake_requests(fake_router_t *fr)
{
    pthread_mutex_lock(&fr->mu);
    int n = fr->n_requests;
    pthread_mutex_unlock(&fr->mu);
    return n;
}

/* The state of test_router_lost_callbacks: calls[0..2] the calls the loss ends, calls[3] the
 * one calls[0]'s on_done starts. */
typedef struct lost_state {
    async_state_t st;
    async_ctx_t ctx[4];
    tdm_client_t *c;
    int start_rc, cancel_rc;
} lost_state_t;

/* calls[0]'s on_done: records it, then cancels calls[2] (later in the table) and starts
 * calls[3] (after every call the loss walks). */
static void lost_first_done(void *user, const tdm_client_result_t *r)
{
    lost_state_t *ls = (lost_state_t *)((async_ctx_t *)user)->st;
    async_done(user, r);
    ls->cancel_rc = tdm_client_cancel(ls->c, ls->st.calls[2].id);
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "silent";
    ls->start_rc = tdm_client_generate_start(ls->c, &req, async_chunk, async_done, &ls->ctx[3],
                                             &ls->st.calls[3].id);
}

/* The router goes away and the first lost call's on_done cancels a later call and starts a new
 * one: every call ends exactly once (the cancelled one with CANCELLED, the others with
 * UNAVAILABLE "router connection lost"), and the new call, which went out after the loss, is
 * not ended by it: it runs until it is cancelled. */
static void test_router_lost_callbacks(void **state)
{
    (void)state;
    fake_router_t *fr = fake_start();
    tdm_client_opts_t o = {0};
    o.timeout_s = 60;
    tdm_error_t err = {0};
    lost_state_t ls;
    memset(&ls, 0, sizeof ls);
    ls.c = tdm_client_new(fr->endpoint, &o, &err);
    if (!ls.c)
        fail_msg("client: %s", err.msg);
    tdm_client_health_t h;
    assert_int_equal(tdm_client_health(ls.c, WAIT_S, &h), TDM_OK);
    for (int k = 0; k < 4; k++)
        ls.ctx[k] = (async_ctx_t){&ls.st, &ls.st.calls[k]};
    for (int k = 0; k < 3; k++) {
        tdm_client_request_t req;
        tdm_client_request_init(&req);
        req.prompt = "silent";
        assert_int_equal(tdm_client_generate_start(ls.c, &req, async_chunk,
                                                   k == 0 ? lost_first_done : async_done,
                                                   &ls.ctx[k], &ls.st.calls[k].id),
                         TDM_OK);
    }
    for (double until = now_s() + WAIT_S; fake_requests(fr) < 3 && now_s() < until;)
        assert_true(tdm_client_poll(ls.c, 50) >= 0);
    assert_int_equal(fake_requests(fr), 3);
    fake_stop(&fr);
    for (double until = now_s() + WAIT_S; ls.st.calls[1].n_done == 0 && now_s() < until;)
        assert_true(tdm_client_poll(ls.c, 100) >= 0);
    assert_int_equal(ls.cancel_rc, TDM_OK);
    assert_int_equal(ls.start_rc, TDM_OK);
    for (int k = 0; k < 3; k++)
        assert_int_equal(ls.st.calls[k].n_done, 1);
    assert_int_equal(ls.st.calls[0].status, TDM_EUNAVAILABLE);
    assert_int_equal(ls.st.calls[1].status, TDM_EUNAVAILABLE);
    assert_non_null(strstr(ls.st.calls[1].message, "router connection lost"));
    assert_int_equal(ls.st.calls[2].status, TDM_ECANCELLED);
    /* the new call is not the loss's */
    assert_int_equal(ls.st.calls[3].n_done, 0);
    assert_int_equal(tdm_client_pending(ls.c), 1);
    assert_int_equal(tdm_client_cancel(ls.c, ls.st.calls[3].id), TDM_OK);
    assert_int_equal(ls.st.calls[3].n_done, 1);
    assert_int_equal(ls.st.calls[3].status, TDM_ECANCELLED);
    tdm_client_destroy(&ls.c);
}

/* Two routers: a call that had no answer when its router went is sent to the other one (and
 * waits there: "silent"), counted by tdm_client_retried; a stream that had delivered chunks is
 * never sent again: it ends UNAVAILABLE when its router goes, as does a call that every router
 * has had. Bad lists are refused. */
static void test_two_routers(void **state)
{
    (void)state;
    fake_router_t *fr[2] = {fake_start(), fake_start()};
    char eps[600];
    snprintf(eps, sizeof eps, "%s,%s", fr[0]->endpoint, fr[1]->endpoint);
    tdm_client_opts_t o = {0};
    o.timeout_s = 60;
    tdm_error_t err = {0};
    tdm_client_t *c = tdm_client_new(eps, &o, &err);
    if (!c)
        fail_msg("client: %s", err.msg);
    tdm_client_health_t h;
    assert_int_equal(tdm_client_health(c, WAIT_S, &h), TDM_OK);

    async_state_t st = {0};
    async_ctx_t ctx[2] = {{&st, &st.calls[0]}, {&st, &st.calls[1]}};
    int before[2] = {fake_requests(fr[0]), fake_requests(fr[1])};
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    req.prompt = "silent";
    st.calls[1].order_ok = true;
    assert_int_equal(
        tdm_client_generate_start(c, &req, async_chunk, async_done, &ctx[1], &st.calls[1].id),
        TDM_OK);
    int got = -1; /* the router that has it */
    for (double until = now_s() + WAIT_S; got < 0 && now_s() < until;) {
        assert_true(tdm_client_poll(c, 20) >= 0);
        for (int k = 0; k < 2; k++)
            if (fake_requests(fr[k]) > before[k])
                got = k;
    }
    assert_true(got >= 0);
    int other = 1 - got;
    int other_before = fake_requests(fr[other]);
    fake_stop(&fr[got]); /* its router goes before any answer: the call moves */
    for (double until = now_s() + WAIT_S;
         fake_requests(fr[other]) == other_before && now_s() < until;)
        assert_true(tdm_client_poll(c, 20) >= 0);
    assert_int_equal(fake_requests(fr[other]), other_before + 1);
    assert_int_equal(tdm_client_retried(c), 1);
    assert_int_equal(tdm_client_pending(c), 1);
    assert_int_equal(st.calls[1].n_done, 0);

    /* a stream under way on the router left, then that router goes too */
    req.prompt = "slow";
    st.calls[0].order_ok = true;
    assert_int_equal(
        tdm_client_generate_start(c, &req, async_chunk, async_done, &ctx[0], &st.calls[0].id),
        TDM_OK);
    for (double until = now_s() + WAIT_S; st.n_seen < 2 && now_s() < until;)
        assert_true(tdm_client_poll(c, 100) >= 0);
    assert_true(st.n_seen >= 2);
    fake_stop(&fr[other]);
    int ended = 0;
    for (double until = now_s() + WAIT_S; ended < 2 && now_s() < until;) {
        int rc = tdm_client_poll(c, 100);
        assert_true(rc >= 0);
        ended += rc;
    }
    assert_int_equal(ended, 2);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(st.calls[k].n_done, 1);
        assert_int_equal(st.calls[k].status, TDM_EUNAVAILABLE);
        assert_non_null(strstr(st.calls[k].message, "router connection lost"));
    }
    assert_true(st.calls[0].n_tokens >= 2);
    assert_int_equal(tdm_client_retried(c), 1); /* the stream was not sent again */
    tdm_client_destroy(&c);

    assert_null(tdm_client_new("tcp://127.0.0.1:7,tcp://127.0.0.1:7", NULL, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "listed twice"));
    assert_null(tdm_client_new("tcp://127.0.0.1:7,", NULL, &err));
    assert_int_equal(err.code, TDM_EINVALID);
    assert_non_null(strstr(err.msg, "is empty"));
}

static void test_names(void **state)
{
    (void)state;
    assert_string_equal(tdm_client_finish_name(TDM_CLIENT_FINISH_STOP), "stop");
    assert_string_equal(tdm_client_finish_name(TDM_CLIENT_FINISH_LENGTH), "length");
    assert_string_equal(tdm_client_finish_name(TDM_CLIENT_FINISH_CANCELLED), "cancelled");
    assert_string_equal(tdm_client_finish_name((tdm_client_finish_t)99), "?");
    tdm_client_request_t req;
    tdm_client_request_init(&req);
    assert_true(req.stream);
    assert_int_equal(req.sampling_set, 0);
    assert_float_equal(req.sampling.temperature, 1.0f, 0);
}

/* ---- `test_client --serve ENDPOINT` ---- */

static volatile sig_atomic_t serve_stop;

static void on_serve_signal(int sig)
{
    (void)sig;
    serve_stop = 1;
}

/* Runs the fake router at endpoint until SIGTERM/SIGINT; prints the bound endpoint first.
 * Returns 0, or 1 when binding failed or the fake hit an error. */
static int fake_serve(const char *endpoint)
{
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_serve_signal;
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    fake_router_t *fr = calloc(1, sizeof *fr);
    tdm_error_t err = {0};
    if (!fr || !(fr->net = tdm_net_new(1, &err))) {
        fprintf(stderr, "fake router: %s\n", err.msg);
        free(fr);
        return 1;
    }
    tdm_sock_opts_t so = {0};
    fr->sock = tdm_sock_bind(fr->net, endpoint, &so, &err);
    if (!fr->sock) {
        fprintf(stderr, "fake router: bind %s: %s\n", endpoint, err.msg);
        tdm_net_destroy(&fr->net);
        free(fr);
        return 1;
    }
    printf("%s\n", tdm_sock_endpoint(fr->sock));
    fflush(stdout);
    pthread_mutex_init(&fr->mu, NULL);
    atomic_init(&fr->stop, false);
    atomic_init(&fr->n_errors, 0);
    fr->all_up = true;
    pthread_create(&fr->thread, NULL, fake_main, fr);
    while (!serve_stop)
        sleep_ms(20);
    atomic_store(&fr->stop, true);
    pthread_join(fr->thread, NULL);
    int errors = atomic_load(&fr->n_errors);
    tdm_sock_destroy(&fr->sock);
    tdm_net_destroy(&fr->net);
    pthread_mutex_destroy(&fr->mu);
    free(fr);
    return errors ? 1 : 0;
}

int main(int argc, char **argv)
{
    if (argc == 3 && strcmp(argv[1], "--serve") == 0)
        return fake_serve(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_stream_order_and_text, setup, teardown),
        cmocka_unit_test_setup_teardown(test_no_stream, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_end, setup, teardown),
        cmocka_unit_test_setup_teardown(test_error_detail, setup, teardown),
        cmocka_unit_test_setup_teardown(test_deadline, setup, teardown),
        cmocka_unit_test_setup_teardown(test_callback_cancel, setup, teardown),
        cmocka_unit_test_setup_teardown(test_cancel_flag, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_concurrent, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_cancel_and_destroy, setup, teardown),
        cmocka_unit_test_setup_teardown(test_inputs_and_sampling, setup, teardown),
        cmocka_unit_test_setup_teardown(test_bad_requests, setup, teardown),
        cmocka_unit_test_setup_teardown(test_health_models_status, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_unary_and_wake_fd, setup, teardown),
        cmocka_unit_test(test_router_down),
        cmocka_unit_test(test_router_lost_and_back),
        cmocka_unit_test(test_router_lost_callbacks),
        cmocka_unit_test(test_two_routers),
        cmocka_unit_test(test_names),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
