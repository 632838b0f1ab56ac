/* test_node.c - the node link to the router against a fake router: tdm_node_link_flush
 * returns once what the engine sent has reached the router (not after a fixed sleep), and
 * reports a router that does not answer within its bound. */
#include "tdm_test.h"

#include "tandem/node.h"
#include "tandem/proto.h"

#include <pthread.h>
#include <stdatomic.h>
#include <string.h>
#include <time.h>

#define ROUTER_INSTANCE UINT64_C(0x1234)
#define N_NOTIFY 200

static void sleep_ms(long ms)
{
    struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* A router that registers any node, answers heartbeats (unless muted) and counts TOKEN_EVENT
 * notifications. */
typedef struct fake_router {
    tdm_sock_t *sock;
    pthread_t thread;
    atomic_bool stop, mute;
    atomic_int tokens;
    atomic_int heartbeats;
} fake_router_t;

static void answer(fake_router_t *fr, const tdm_frame_t *f)
{
    if (f->method == TANDEM__V1__METHOD__METHOD_REGISTER) {
        Tandem__V1__RegisterAck ack = TANDEM__V1__REGISTER_ACK__INIT;
        ack.heartbeat_interval_ms = 60000; /* no periodic beats: only the flush's */
        ack.heartbeat_timeout_ms = 600000;
        ack.router_instance_id = ROUTER_INSTANCE;
        tdm_sock_reply(fr->sock, f, &ack.base);
    } else if (f->method == TANDEM__V1__METHOD__METHOD_HEARTBEAT) {
        atomic_fetch_add(&fr->heartbeats, 1);
        if (!atomic_load(&fr->mute))
            tdm_sock_reply(fr->sock, f, NULL);
    } else if (f->method == TANDEM__V1__METHOD__METHOD_TOKEN_EVENT) {
        atomic_fetch_add(&fr->tokens, 1);
    }
}

static void *router_main(void *arg)
{
    fake_router_t *fr = arg;
    tdm_frame_t f;
    tdm_frame_init(&f);
    while (!atomic_load(&fr->stop))
        if (tdm_sock_recv(fr->sock, &f, 20) == 0) {
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

static void rig_open(rig_t *r)
{
    tdm_error_t err = {0};
    memset(r, 0, sizeof *r);
    r->net = tdm_net_new(1, &err);
    assert_non_null(r->net);
    tdm_sock_opts_t so = {0};
    so.instance_id = ROUTER_INSTANCE;
    r->fr.sock = tdm_sock_bind(r->net, "tcp://127.0.0.1:*", &so, &err);
    assert_non_null(r->fr.sock);
    assert_int_equal(pthread_create(&r->fr.thread, NULL, router_main, &r->fr), 0);
    Tandem__V1__RegisterRequest reg = TANDEM__V1__REGISTER_REQUEST__INIT;
    reg.node_id = (char *)"p0";
    reg.instance_id = 77;
    tdm_node_link_opts_t lo = {tdm_sock_endpoint(r->fr.sock), NULL, &reg, NULL, NULL};
    r->link = tdm_node_link_new(r->net, &lo, &err);
    if (!r->link)
        fail_msg("%s", err.msg);
    /* registered: the engine's frames of this router instance now flow */
    for (int i = 0; i < 30000 && tdm_node_link_state(r->link, NULL, 0) != TDM_NODE_LINK_REGISTERED;
         i++)
        sleep_ms(1);
    assert_int_equal(tdm_node_link_state(r->link, NULL, 0), TDM_NODE_LINK_REGISTERED);
}

static void rig_close(rig_t *r)
{
    tdm_node_link_destroy(&r->link);
    atomic_store(&r->fr.stop, true);
    pthread_join(r->fr.thread, NULL);
    tdm_sock_destroy(&r->fr.sock);
    tdm_net_destroy(&r->net);
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

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flush_waits_for_the_router),
        cmocka_unit_test(test_flush_bounded),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
