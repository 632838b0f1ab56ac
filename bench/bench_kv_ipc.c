/* bench_kv_ipc.c - the KV transport's cuda_ipc speed (CUDA builds only; scripts/gpu-check's
 * xfer stage): a sender and a receiver process on one GPU (this binary re-executed with
 * --child-recv), both with a device pool of a Llama-3.1-8B-shaped layout (32 layers, 8 KV
 * heads, head_dim 128, 16-token blocks, f16: 2 MiB a block), move --blocks blocks (default
 * 256: 512 MiB) over cuda_ipc again and again for --seconds; each transfer is timed from the
 * send to the acknowledgement (the transfer's own `seconds`). Reported against the payload rate
 * of a device-to-device cudaMemcpy measured in the same run (tdm_bench_hbm_d2d's traffic / 2:
 * the bytes a copy delivers per second). Target (docs/performance.md): >= 80 %.
 *
 * usage: tandem-bench-kv-ipc [--blocks N] [--seconds S] [--json FILE]; exit 77 without a GPU.
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bench_hbm.h"
#include "tandem/device.h"
#include "tandem/kv.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/transfer.h"

static const tdm_kv_layout_t shape8b = {32, 8, 128, 16, TDM_KV_F16};
#define FINGERPRINT UINT64_C(0x6b76697063000001)
#define MAX_BLOCKS 1024u

typedef struct ipc_pool {
    tdm_kv_pool_t *pool;
    void *dbase;
    tdm_kv_seq_t seq;
} ipc_pool_t;

/* A pool of n + 1 blocks whose KV lives on device 0, with n of them reserved in p->seq. */
static int ipc_pool_open(ipc_pool_t *p, uint32_t n)
{
    tdm_error_t err = {0};
    memset(p, 0, sizeof *p);
    p->pool = tdm_kv_pool_new(&shape8b, n + 1, &err);
    if (!p->pool) {
        fprintf(stderr, "bench: tdm_kv_pool_new: %s\n", err.msg);
        return 1;
    }
    uint64_t bytes = (uint64_t)(n + 1) * tdm_kv_pool_block_bytes(p->pool);
    cudaError_t e = cudaSetDevice(0);
    if (e == cudaSuccess)
        e = cudaMalloc(&p->dbase, bytes);
    if (e == cudaSuccess)
        e = cudaMemset(p->dbase, 0x5a, bytes);
    if (e != cudaSuccess) {
        fprintf(stderr, "bench: %llu bytes on cuda:0: %s\n", (unsigned long long)bytes,
                cudaGetErrorString(e));
        return 1;
    }
    tdm_kv_seq_init(&p->seq);
    if (tdm_kv_seq_reserve(p->pool, &p->seq, n * shape8b.block_size) != 0) {
        fprintf(stderr, "bench: cannot reserve %u blocks\n", n);
        return 1;
    }
    return 0;
}

static int rx_lookup(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                     const uint32_t **blocks, uint32_t *n_blocks, tdm_error_t *err)
{
    const tdm_kv_seq_t *seq = user;
    (void)request_id;
    (void)attempt_id;
    if (n_tokens != seq->n_blocks * shape8b.block_size)
        return tdm_error_set(err, TDM_ENOTFOUND, "expected %u tokens, got %u",
                             seq->n_blocks * shape8b.block_size, n_tokens);
    *blocks = seq->blocks;
    *n_blocks = seq->n_blocks;
    return 0;
}

/* The receiver: writes its endpoint to fd, then accepts transfers until it is killed. */
static int child_recv(uint32_t n, int fd)
{
    ipc_pool_t p;
    tdm_error_t err = {0};
    if (ipc_pool_open(&p, n) != 0)
        return 1;
    tdm_net_t *net = tdm_net_new(2, &err);
    tdm_logger_t log;
    tdm_log_init(&log, "bench-kv-ipc-rx");
    tdm_kv_receiver_opts_t ro = {.endpoint = "tcp://127.0.0.1:*",
                                 .node_id = "bench-rx",
                                 .model_fingerprint = FINGERPRINT,
                                 .memory = {.device_base = p.dbase, .device = 0},
                                 .timeout_ms = 60000,
                                 .log = &log};
    tdm_kv_receiver_t *r = net ? tdm_kv_receiver_new(net, p.pool, &ro, &err) : NULL;
    if (!r) {
        fprintf(stderr, "bench: receiver: %s\n", err.msg);
        return 1;
    }
    dprintf(fd, "%s\n", tdm_kv_receiver_endpoint(r));
    close(fd);
    for (;;) {
        tdm_kv_received_t got;
        if (tdm_kv_receiver_recv(r, 200, rx_lookup, &p.seq, &got) == 1 && got.status != 0)
            fprintf(stderr, "bench: receiver: %s %s\n", tdm_status_name(got.status), got.message);
    }
}

/* Runs the receiver process; its endpoint in ep[cap]. Returns its pid, or -1. */
static pid_t spawn_receiver(uint32_t n, char *ep, size_t cap)
{
    int fds[2];
    if (pipe(fds) != 0)
        return -1;
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        char nb[16], fd[16];
        snprintf(nb, sizeof nb, "%u", n);
        snprintf(fd, sizeof fd, "%d", fds[1]);
        execl("/proc/self/exe", "tandem-bench-kv-ipc", "--child-recv", nb, fd, (char *)NULL);
        _exit(127);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t k;
    while (got < cap - 1 && (k = read(fds[0], ep + got, cap - 1 - got)) > 0)
        got += (size_t)k;
    close(fds[0]);
    ep[got] = '\0';
    char *nl = strchr(ep, '\n');
    if (!nl) {
        fprintf(stderr, "bench: the receiver process reported no endpoint\n");
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    *nl = '\0';
    return pid;
}

typedef struct ipc_result {
    uint32_t transfers;
    uint64_t bytes;     /* payload of one transfer */
    double best_s, sum; /* fastest transfer; seconds of all of them */
} ipc_result_t;

/* Transfers n blocks to ep over cuda_ipc for `seconds` (at least 3 times). */
static int run_sender(uint32_t n, const char *ep, double seconds, ipc_result_t *res)
{
    ipc_pool_t p;
    tdm_error_t err = {0};
    if (ipc_pool_open(&p, n) != 0)
        return 1;
    tdm_net_t *net = tdm_net_new(2, &err);
    tdm_logger_t log;
    tdm_log_init(&log, "bench-kv-ipc-tx");
    tdm_kv_sender_opts_t so = {.node_id = "bench-tx",
                               .model_fingerprint = FINGERPRINT,
                               .backend = TDM_KV_BACKEND_CUDA_IPC,
                               .memory = {.device_base = p.dbase, .device = 0},
                               .timeout_ms = 60000,
                               .log = &log};
    tdm_kv_sender_t *s = net ? tdm_kv_sender_new(net, p.pool, &so, &err) : NULL;
    if (!s) {
        fprintf(stderr, "bench: sender: %s\n", err.msg);
        return 1;
    }
    memset(res, 0, sizeof *res);
    double t_end = tdm_time_now() + seconds;
    int rc = 0;
    for (uint64_t i = 0; rc == 0 && (res->transfers < 3 || tdm_time_now() < t_end); i++) {
        char id[32];
        snprintf(id, sizeof id, "ipc-%llu", (unsigned long long)i);
        tdm_kv_send_req_t req = {.request_id = id,
                                 .attempt_id = 1,
                                 .endpoint = ep,
                                 .blocks = p.seq.blocks,
                                 .n_blocks = n,
                                 .n_tokens = n * shape8b.block_size,
                                 .first_token = 1};
        uint64_t tid;
        tdm_kv_send_done_t d;
        int got = 0;
        if (tdm_kv_sender_send(s, &req, &tid, &err) != 0) {
            fprintf(stderr, "bench: send: %s\n", err.msg);
            rc = 1;
            break;
        }
        while (got == 0)
            got = tdm_kv_sender_poll(s, 1000, &d, 1);
        if (got != 1 || d.status != 0) {
            fprintf(stderr, "bench: transfer failed: %s %s\n", tdm_status_name(d.status),
                    d.message);
            rc = 1;
            break;
        }
        res->transfers++;
        res->bytes = d.bytes;
        res->sum += d.seconds;
        if (res->best_s == 0 || d.seconds < res->best_s)
            res->best_s = d.seconds;
    }
    tdm_kv_sender_destroy(&s);
    tdm_net_destroy(&net);
    return rc;
}

static int report(uint32_t n, const ipc_result_t *r, double d2d_traffic, const char *json)
{
    double copy = d2d_traffic / 2; /* payload bytes a device-to-device copy delivers per s */
    double mean = r->bytes * r->transfers / r->sum, best = r->bytes / r->best_s;
    printf("cuda_ipc: %u blocks (%llu payload bytes) x %u transfers: mean %.2f GB/s, best %.2f "
           "GB/s; device-to-device copy %.2f GB/s payload: %.1f %% (mean), %.1f %% (best); "
           "target >= 80 %%\n",
           n, (unsigned long long)r->bytes, r->transfers, mean / 1e9, best / 1e9, copy / 1e9,
           100 * mean / copy, 100 * best / copy);
    FILE *f = json ? fopen(json, "w") : stdout;
    if (!f)
        return 1;
    fprintf(f,
            "{\"bench\":\"kv_ipc\",\"blocks\":%u,\"payload_bytes\":%llu,\"transfers\":%u,"
            "\"mean_bytes_per_s\":%.0f,\"best_bytes_per_s\":%.0f,\"d2d_payload_bytes_per_s\":%.0f,"
            "\"ratio_mean\":%.4f,\"ratio_best\":%.4f}\n",
            n, (unsigned long long)r->bytes, r->transfers, mean, best, copy, mean / copy,
            best / copy);
    return json ? (fclose(f) == 0 ? 0 : 1) : 0;
}

int main(int argc, char **argv)
{
    if (argc == 4 && strcmp(argv[1], "--child-recv") == 0)
        return child_recv((uint32_t)atoi(argv[2]), atoi(argv[3]));
    uint32_t n = 256;
    double seconds = 3;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--blocks") == 0 && i + 1 < argc)
            n = (uint32_t)atoi(argv[++i]);
        else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--json") == 0 && i + 1 < argc)
            json = argv[++i];
        else {
            fprintf(stderr,
                    "usage: tandem-bench-kv-ipc [--blocks N] [--seconds S] [--json FILE]\n");
            return 2;
        }
    }
    if (n < 1 || n > MAX_BLOCKS) {
        fprintf(stderr, "bench: --blocks 1..%u\n", MAX_BLOCKS);
        return 2;
    }
    int n_dev = 0;
    tdm_error_t err = {0};
    if (tdm_device_cuda_count(&n_dev, &err) != TDM_OK || n_dev == 0) {
        printf("SKIP: no usable CUDA device: %s\n", err.msg[0] ? err.msg : "0 devices");
        return 77;
    }
    char msg[256], ep[300];
    double d2d = 0;
    if (tdm_bench_hbm_d2d(0, &d2d, msg, sizeof msg) != 0) {
        fprintf(stderr, "bench: device-to-device copy: %s\n", msg);
        return 1;
    }
    pid_t rx = spawn_receiver(n, ep, sizeof ep);
    if (rx < 0)
        return 1;
    ipc_result_t r;
    int rc = run_sender(n, ep, seconds, &r);
    kill(rx, SIGKILL);
    waitpid(rx, NULL, 0);
    return rc != 0 ? rc : report(n, &r, d2d, json);
}
