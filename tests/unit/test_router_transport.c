/* test_router_transport.c - the router's KV transport choice per (prefill, decode) pair
 * (router/transport.c) over the cases: same host with the decode node's GPU visible, same
 * host without, different hosts, a CPU node on either side, unknown hosts, transports a side
 * did not list; and what a registration fills in. */
#include <string.h>

#include "tdm_test.h"
#include "transport.h"

#define GPU_A "GPU-aaaaaaaa-aaaa-aaaa-aaaa-aaaaaaaaaaaa"
#define GPU_B "GPU-bbbbbbbb-bbbb-bbbb-bbbb-bbbbbbbbbbbb"

/* A node on host `host` computing on `gpu` ("" = CPU) and seeing the GPUs of `seen`
 * (n of them), listing every transport. */
static rt_place_t place(const char *host, const char *gpu, const char *const *seen, uint32_t n)
{
    rt_place_t p;
    memset(&p, 0, sizeof p);
    strcpy(p.host_id, host);
    strcpy(p.gpu_uuid, gpu);
    for (uint32_t i = 0; i < n; i++)
        strcpy(p.gpu_uuids[i], seen[i]);
    p.n_gpu_uuids = n;
    p.transports = gpu[0] ? 7u : 1u; /* tcp, nccl, cuda_ipc; a CPU node tcp only */
    return p;
}

static void test_choose(void **state)
{
    (void)state;
    const char *ab[] = {GPU_A, GPU_B}, *a[] = {GPU_A}, *b[] = {GPU_B};
    rt_place_t p_ab = place("h1", GPU_A, ab, 2), p_a = place("h1", GPU_A, a, 1);
    rt_place_t d_b = place("h1", GPU_B, b, 1), d_b_h2 = place("h2", GPU_B, b, 1);
    rt_place_t cpu_h1 = place("h1", "", NULL, 0);
    /* same host, the decode node's GPU visible to the prefill node: cuda_ipc */
    assert_int_equal(rt_transport_choose(&p_ab, &d_b), TDM_KV_BACKEND_CUDA_IPC);
    /* same host, not visible (CUDA_VISIBLE_DEVICES hides it): nccl */
    assert_int_equal(rt_transport_choose(&p_a, &d_b), TDM_KV_BACKEND_NCCL);
    /* different hosts: nccl */
    assert_int_equal(rt_transport_choose(&p_ab, &d_b_h2), TDM_KV_BACKEND_NCCL);
    /* a CPU node on either side: tcp */
    assert_int_equal(rt_transport_choose(&cpu_h1, &d_b), TDM_KV_BACKEND_TCP);
    assert_int_equal(rt_transport_choose(&p_ab, &cpu_h1), TDM_KV_BACKEND_TCP);
    assert_int_equal(rt_transport_choose(&cpu_h1, &cpu_h1), TDM_KV_BACKEND_TCP);
    /* an unknown host ("") is never the same host */
    rt_place_t p_nohost = place("", GPU_A, ab, 2), d_nohost = place("", GPU_B, b, 1);
    assert_int_equal(rt_transport_choose(&p_nohost, &d_nohost), TDM_KV_BACKEND_NCCL);
    /* a transport one side did not list falls back: cuda_ipc -> nccl -> tcp */
    rt_place_t d_no_ipc = d_b;
    d_no_ipc.transports = 3u;
    assert_int_equal(rt_transport_choose(&p_ab, &d_no_ipc), TDM_KV_BACKEND_NCCL);
    d_no_ipc.transports = 1u;
    assert_int_equal(rt_transport_choose(&p_ab, &d_no_ipc), TDM_KV_BACKEND_TCP);
}

static void test_place_from(void **state)
{
    (void)state;
    Tandem__V1__RegisterRequest m = TANDEM__V1__REGISTER_REQUEST__INIT;
    char *uuids[] = {(char *)GPU_A, (char *)GPU_B};
    char *tr[] = {(char *)"tcp", (char *)"cuda_ipc", (char *)"carrier-pigeon"};
    m.host_id = (char *)"0b9c0a7e-2f64-4f4c-9d2e-6f1d2c3b4a59";
    m.gpu_uuid = (char *)GPU_B;
    m.n_gpu_uuids = 2;
    m.gpu_uuids = uuids;
    m.n_transports = 3;
    m.transports = tr;
    rt_place_t p;
    rt_place_from(&p, &m);
    assert_string_equal(p.host_id, "0b9c0a7e-2f64-4f4c-9d2e-6f1d2c3b4a59");
    assert_string_equal(p.gpu_uuid, GPU_B);
    assert_int_equal(p.n_gpu_uuids, 2);
    assert_string_equal(p.gpu_uuids[1], GPU_B);
    assert_int_equal(p.transports, (1u << TDM_KV_BACKEND_TCP) | (1u << TDM_KV_BACKEND_CUDA_IPC));
    /* an older node: no fields, tcp only by what it listed */
    Tandem__V1__RegisterRequest old = TANDEM__V1__REGISTER_REQUEST__INIT;
    rt_place_from(&p, &old);
    assert_string_equal(p.host_id, "");
    assert_string_equal(p.gpu_uuid, "");
    assert_int_equal(p.n_gpu_uuids, 0);
    assert_int_equal(p.transports, 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_choose),
        cmocka_unit_test(test_place_from),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
