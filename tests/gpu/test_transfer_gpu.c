/* test_transfer_gpu.c - the KV transport's device paths on a real GPU, each between two
 * processes (a sender and a receiver, this binary re-executed with --child), as the nodes
 * run them: cuda_ipc (device to device through an IPC handle), nccl (ncclSend/ncclRecv over a
 * two-rank communicator made through KV_HELLO), and tcp from a host pool into a device pool.
 * Each sender fills its device blocks with a pattern; each receiver checks, after the
 * acknowledgement, that its reserved device blocks hold exactly that pattern and that both
 * pools are back to zero used blocks.
 *
 * With one GPU the nccl case runs both ranks on it with a different NCCL_HOSTID per process
 * (NCCL refuses two ranks on one GPU of one host: "Duplicate GPU detected"); whether NCCL
 * then talks through its socket transport over loopback is what this case finds out.
 * Skips (exit 77) with the reason when the build has no CUDA or no GPU is present.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tdm_test.h"
#include "tandem/device.h"
#include "tandem/kv.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/transfer.h"

#ifdef TANDEM_HAVE_CUDA
#include <cuda_runtime_api.h>

static const tdm_kv_layout_t smollm2 = {30, 3, 64, 16, TDM_KV_F16};
#define FINGERPRINT UINT64_C(0x6a6a6a6a01020304)
#define POOL_BLOCKS 64u
#define N_TOKENS 300u /* 19 blocks, the last one partial */
#define CHILD_TIMEOUT_S 120

/* Byte j of the i-th block of the transfer. */
static uint8_t pattern(uint32_t i, uint64_t j)
{
    uint64_t z = (i + 1) * UINT64_C(0x9e3779b97f4a7c15) ^ (j * UINT64_C(0xbf58476d1ce4e5b9));
    return (uint8_t)(z >> 29);
}

#define CHILD_CHECK(cond, ...)                                                                     \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "child %s: ", role);                                                   \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fprintf(stderr, " (%s:%d)\n", __FILE__, __LINE__);                                     \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* A pool's bookkeeping in host memory plus its KV in device memory. */
typedef struct dev_pool {
    tdm_kv_pool_t *pool;
    void *dbase;
    uint64_t bb;
} dev_pool_t;

static int dev_pool_new(dev_pool_t *p, int device, bool on_device, const char *role)
{
    tdm_error_t err = {0};
    p->pool = tdm_kv_pool_new(&smollm2, POOL_BLOCKS, &err);
    CHILD_CHECK(p->pool, "tdm_kv_pool_new: %s", err.msg);
    p->bb = tdm_kv_pool_block_bytes(p->pool);
    p->dbase = NULL;
    if (on_device) {
        cudaError_t e = cudaSetDevice(device);
        CHILD_CHECK(e == cudaSuccess, "cudaSetDevice(%d): %s", device, cudaGetErrorString(e));
        e = cudaMalloc(&p->dbase, POOL_BLOCKS * p->bb);
        CHILD_CHECK(e == cudaSuccess, "cudaMalloc: %s", cudaGetErrorString(e));
        e = cudaMemset(p->dbase, 0, POOL_BLOCKS * p->bb);
        CHILD_CHECK(e == cudaSuccess, "cudaMemset: %s", cudaGetErrorString(e));
    }
    return 0;
}

static int pool_idle(tdm_kv_pool_t *pool, const char *role)
{
    tdm_kv_stats_t st;
    tdm_kv_pool_stats(pool, &st);
    tdm_error_t err = {0};
    CHILD_CHECK(st.n_used == 0, "%u blocks still used", st.n_used);
    CHILD_CHECK(tdm_kv_pool_check(pool, &err) == 0, "pool check: %s", err.msg);
    return 0;
}

static int child_send(const char *backend_name, int device, const char *endpoint)
{
    const char *role = "sender";
    tdm_kv_backend_t backend;
    tdm_error_t err = {0};
    CHILD_CHECK(tdm_kv_backend_parse(backend_name, &backend, &err) == 0, "%s", err.msg);
    bool on_device = backend != TDM_KV_BACKEND_TCP;
    dev_pool_t p;
    if (dev_pool_new(&p, device, on_device, role) != 0)
        return 1;
    tdm_kv_seq_t seq;
    tdm_kv_seq_init(&seq);
    CHILD_CHECK(tdm_kv_seq_reserve(p.pool, &seq, N_TOKENS) == 0, "reserve");
    uint8_t *host = malloc(p.bb);
    CHILD_CHECK(host, "out of memory");
    for (uint32_t i = 0; i < seq.n_blocks; i++) {
        for (uint64_t j = 0; j < p.bb; j++)
            host[j] = pattern(i, j);
        uint64_t off = (uint64_t)seq.blocks[i] * p.bb;
        if (on_device) {
            cudaError_t e = cudaMemcpy((char *)p.dbase + off, host, p.bb, cudaMemcpyHostToDevice);
            CHILD_CHECK(e == cudaSuccess, "cudaMemcpy: %s", cudaGetErrorString(e));
        } else {
            memcpy((char *)tdm_kv_pool_base(p.pool) + off, host, p.bb);
        }
    }
    free(host);

    tdm_net_t *net = tdm_net_new(2, &err);
    CHILD_CHECK(net, "tdm_net_new: %s", err.msg);
    tdm_logger_t log;
    tdm_log_init(&log, "gpu-sender");
    tdm_kv_sender_opts_t so = {.node_id = "gpu-sender",
                               .model_fingerprint = FINGERPRINT,
                               .backend = backend,
                               .memory = {.device_base = p.dbase, .device = device},
                               .timeout_ms = 60000,
                               .log = &log};
    tdm_kv_sender_t *s = tdm_kv_sender_new(net, p.pool, &so, &err);
    CHILD_CHECK(s, "tdm_kv_sender_new: %s", err.msg);
    tdm_kv_send_req_t req = {.request_id = "gpu-req",
                             .attempt_id = 7,
                             .endpoint = endpoint,
                             .blocks = seq.blocks,
                             .n_blocks = seq.n_blocks,
                             .n_tokens = N_TOKENS,
                             .first_token = 7};
    uint64_t id;
    double t0 = tdm_time_now();
    CHILD_CHECK(tdm_kv_sender_send(s, &req, &id, &err) == 0, "send: %s", err.msg);
    tdm_kv_seq_release(p.pool, &seq);
    tdm_kv_send_done_t d;
    int n = 0;
    while (n == 0 && tdm_time_now() - t0 < CHILD_TIMEOUT_S)
        n = tdm_kv_sender_poll(s, 100, &d, 1);
    CHILD_CHECK(n == 1, "no outcome reported (%d)", n);
    CHILD_CHECK(d.status == 0, "transfer failed: %s %s", tdm_status_name(d.status), d.message);
    fprintf(stderr, "child sender: %s transfer of %u blocks (%llu bytes) acknowledged in %.3f s\n",
            backend_name, req.n_blocks, (unsigned long long)d.bytes, d.seconds);
    tdm_kv_sender_destroy(&s);
    if (pool_idle(p.pool, role) != 0)
        return 1;
    tdm_net_destroy(&net);
    if (p.dbase)
        cudaFree(p.dbase);
    tdm_kv_pool_destroy(&p.pool);
    return 0;
}

typedef struct reserved {
    const tdm_kv_seq_t *seq;
} reserved_t;

static int lookup(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                  const uint32_t **blocks, uint32_t *n_blocks, tdm_error_t *err)
{
    reserved_t *r = user;
    if (strcmp(request_id, "gpu-req") != 0 || attempt_id != 7 || n_tokens != N_TOKENS)
        return tdm_error_set(err, TDM_ENOTFOUND, "unexpected request %s (%u tokens)", request_id,
                             n_tokens);
    *blocks = r->seq->blocks;
    *n_blocks = r->seq->n_blocks;
    return 0;
}

static int child_recv(const char *backend_name, int device, int endpoint_fd)
{
    const char *role = "receiver";
    tdm_error_t err = {0};
    dev_pool_t p;
    if (dev_pool_new(&p, device, true, role) != 0)
        return 1;
    tdm_kv_seq_t seq;
    tdm_kv_seq_init(&seq);
    CHILD_CHECK(tdm_kv_seq_reserve(p.pool, &seq, N_TOKENS) == 0, "reserve");
    tdm_net_t *net = tdm_net_new(2, &err);
    CHILD_CHECK(net, "tdm_net_new: %s", err.msg);
    tdm_logger_t log;
    tdm_log_init(&log, "gpu-receiver");
    tdm_kv_receiver_opts_t ro = {.endpoint = "tcp://127.0.0.1:*",
                                 .node_id = "gpu-receiver",
                                 .model_fingerprint = FINGERPRINT,
                                 .memory = {.device_base = p.dbase, .device = device},
                                 .timeout_ms = 60000,
                                 .log = &log};
    tdm_kv_receiver_t *r = tdm_kv_receiver_new(net, p.pool, &ro, &err);
    CHILD_CHECK(r, "tdm_kv_receiver_new: %s", err.msg);
    char line[300];
    int len = snprintf(line, sizeof line, "%s\n", tdm_kv_receiver_endpoint(r));
    CHILD_CHECK(write(endpoint_fd, line, (size_t)len) == len, "endpoint not written");
    close(endpoint_fd);

    reserved_t res = {&seq};
    tdm_kv_received_t got;
    int n = 0;
    double t0 = tdm_time_now();
    while (n == 0 && tdm_time_now() - t0 < CHILD_TIMEOUT_S)
        n = tdm_kv_receiver_recv(r, 200, lookup, &res, &got);
    CHILD_CHECK(n == 1, "no transfer arrived (%d)", n);
    CHILD_CHECK(got.status == 0, "%s transfer rejected: %s %s", backend_name,
                tdm_status_name(got.status), got.message);
    CHILD_CHECK(got.n_blocks == seq.n_blocks && got.first_token == 7, "header fields");
    uint8_t *host = malloc(p.bb);
    CHILD_CHECK(host, "out of memory");
    for (uint32_t i = 0; i < seq.n_blocks; i++) {
        cudaError_t e = cudaMemcpy(host, (char *)p.dbase + (uint64_t)seq.blocks[i] * p.bb, p.bb,
                                   cudaMemcpyDeviceToHost);
        CHILD_CHECK(e == cudaSuccess, "cudaMemcpy: %s", cudaGetErrorString(e));
        for (uint64_t j = 0; j < p.bb; j++)
            CHILD_CHECK(host[j] == pattern(i, j), "block %u byte %llu is 0x%02x, expected 0x%02x",
                        i, (unsigned long long)j, host[j], pattern(i, j));
    }
    free(host);
    fprintf(stderr, "child receiver: %s: %u device blocks verified\n", backend_name, seq.n_blocks);
    tdm_kv_seq_release(p.pool, &seq);
    if (pool_idle(p.pool, role) != 0)
        return 1;
    /* Give the sender time to read the acknowledgement before this socket closes. */
    tdm_kv_receiver_recv(r, 200, lookup, &res, &got);
    tdm_kv_receiver_destroy(&r);
    tdm_net_destroy(&net);
    cudaFree(p.dbase);
    tdm_kv_pool_destroy(&p.pool);
    return 0;
}

/* ---- parent: runs a receiver and a sender process and waits for both ---- */

static int n_devices;

/* Runs this binary with argv in a new process (exec: CUDA starts fresh there). */
static pid_t spawn(char *const argv[], const char *nccl_hostid)
{
    pid_t pid = fork();
    if (pid == 0) {
        if (nccl_hostid)
            setenv("NCCL_HOSTID", nccl_hostid, 1);
        execv("/proc/self/exe", argv);
        _exit(127);
    }
    return pid;
}

/* Waits for pid at most until `until` (monotonic seconds); kills it then. Its exit status. */
static int wait_child(pid_t pid, double until)
{
    int status = 0;
    for (;;) {
        pid_t w = waitpid(pid, &status, WNOHANG);
        if (w == pid)
            return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
        if (tdm_time_now() > until) {
            kill(pid, SIGKILL);
            waitpid(pid, &status, 0);
            return 124;
        }
        nanosleep(&(struct timespec){.tv_sec = 0, .tv_nsec = 20 * 1000 * 1000}, NULL);
    }
}

static void run_pair(const char *backend, int send_dev, int recv_dev, bool hostids)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    char fdtext[16], sdev[16], rdev[16];
    snprintf(fdtext, sizeof fdtext, "%d", fds[1]);
    snprintf(sdev, sizeof sdev, "%d", send_dev);
    snprintf(rdev, sizeof rdev, "%d", recv_dev);
    char *rargv[] = {"test_transfer_gpu", "--child", "recv", (char *)backend, rdev, fdtext, NULL};
    double until = tdm_time_now() + CHILD_TIMEOUT_S + 30;
    pid_t rpid = spawn(rargv, hostids ? "tandem-gpu-test-receiver" : NULL);
    assert_true(rpid > 0);
    close(fds[1]);
    char ep[300] = "";
    size_t got = 0;
    while (got < sizeof ep - 1) {
        ssize_t n = read(fds[0], ep + got, sizeof ep - 1 - got);
        if (n <= 0)
            break;
        got += (size_t)n;
        if (memchr(ep, '\n', got))
            break;
    }
    close(fds[0]);
    char *nl = strchr(ep, '\n');
    if (!nl) {
        int st = wait_child(rpid, until);
        fail_msg("%s: the receiver process did not report its endpoint (exit %d)", backend, st);
    }
    *nl = '\0';
    char *sargv[] = {"test_transfer_gpu", "--child", "send", (char *)backend, sdev, ep, NULL};
    pid_t spid = spawn(sargv, hostids ? "tandem-gpu-test-sender" : NULL);
    assert_true(spid > 0);
    int s_status = wait_child(spid, until);
    int r_status = wait_child(rpid, until);
    printf("%s: sender cuda:%d exit %d, receiver cuda:%d exit %d%s\n", backend, send_dev, s_status,
           recv_dev, r_status, hostids ? " (one GPU, NCCL_HOSTID per process)" : "");
    assert_int_equal(s_status, 0);
    assert_int_equal(r_status, 0);
}

static void test_cuda_ipc(void **state)
{
    (void)state;
    run_pair("cuda_ipc", 0, n_devices > 1 ? 1 : 0, false);
}

static void test_nccl(void **state)
{
    (void)state;
    /* Two GPUs: one rank on each. One GPU: both on it, told apart by NCCL_HOSTID. */
    run_pair("nccl", 0, n_devices > 1 ? 1 : 0, n_devices == 1);
}

static void test_tcp_into_device_pool(void **state)
{
    (void)state;
    run_pair("tcp", 0, 0, false);
}

static int child_main(int argc, char **argv)
{
    if (argc != 6)
        return 2;
    int device = atoi(argv[4]);
    if (strcmp(argv[2], "send") == 0)
        return child_send(argv[3], device, argv[5]);
    return child_recv(argv[3], device, atoi(argv[5]));
}
#endif /* TANDEM_HAVE_CUDA */

int main(int argc, char **argv)
{
#ifdef TANDEM_HAVE_CUDA
    if (argc > 1 && strcmp(argv[1], "--child") == 0)
        return child_main(argc, argv);
#else
    (void)argc;
    (void)argv;
#endif
    int n = 0;
    tdm_error_t err = {0};
    if (tdm_device_cuda_count(&n, &err) != TDM_OK || n == 0) {
        printf("SKIP: no usable CUDA device: %s\n", n == 0 && !err.msg[0] ? "0 devices" : err.msg);
        return 77;
    }
#ifdef TANDEM_HAVE_CUDA
    n_devices = n;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cuda_ipc),
        cmocka_unit_test(test_tcp_into_device_pool),
        cmocka_unit_test(test_nccl),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
#else
    return 77; /* unreachable: tdm_device_cuda_count fails without CUDA */
#endif
}
