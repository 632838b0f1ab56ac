/* bench_kv_transfer.c - KV transport throughput and latency over loopback TCP: transfers of
 * 1, 32 and 256 blocks of the SmolLM2-135M f16 layout (368,640 B per block) from a sender pool
 * to a receiver pool served by another thread, one transfer at a time (send -> checksums ->
 * ZeroMQ -> copy into the reserved blocks, verified there -> acknowledgement), next to two
 * baselines measured in the same run over plain TCP sockets between two threads, with the same
 * request/acknowledgement pattern:
 *   raw     send() from the sender pool, recv() straight into the receiver pool's blocks, a
 *           one-byte ack;
 *   hashed  the same, plus the irreducible cost of a checked transfer: the sender XXH3-hashes
 *           each block (tdm_kv_block_checksum, the hash Tandem carries) and sends the 8-byte
 *           hash before the block (one sendmsg); the receiver recv()s the block straight into
 *           the pool, hashes it there and compares; a mismatch is a failure.
 * Two more comparisons, on with --model-chunk-blocks C (default 3, 0 = off), measure sketches
 * of what issue 40's two options could reach on this machine before anyone builds them: a
 * pipelined tcp backend on libzmq alone (zpipe below: a transfer split into messages of C
 * blocks) and a TCP data socket beside a ZeroMQ control path (dsock below: hashed raw with a
 * ZeroMQ request before and acknowledgement after).
 * Prints a table to stderr and one JSON line to stdout (or --json FILE): GB/s of each, the
 * ratios tandem/hashed and tandem/raw, and each side's CPU-seconds per GB.
 *
 * CPU time per side: every thread of the process is read with its own CPU clock (the Linux
 * per-thread clock of /proc/self/task/TID, clock_gettime, ns) before and after each phase and
 * charged to the receiver or the sender. Receiver side: the threads named "kvb-rx..." (the
 * Tandem receiver thread and the baselines' receiver threads; the OpenMP workers a thread
 * starts inherit its name) and the ZeroMQ I/O and reaper threads of the receiver's own ZeroMQ
 * context (the sender and the receiver have one context each, as two nodes do, so their
 * ZeroMQ threads are told apart by when they appeared). Sender side: every other thread (the
 * main thread "kvb-tx", its OpenMP workers, the sender's ZeroMQ threads). The 3 warm-up
 * transfers of each phase are in the CPU time and their bytes in the division.
 *
 * By default the process tunes glibc malloc the way a decode node should (M_MMAP_THRESHOLD
 * 32 MiB, M_TRIM_THRESHOLD 1 GiB, M_ARENA_MAX 1): ZeroMQ receives every block into a fresh
 * malloc'd buffer on its I/O thread, and with glibc's defaults those pages go back to the
 * kernel after each transfer (mmap'd chunks, trimmed or deleted per-thread heaps) and fault in
 * again on the next (2-3x slower at 32 and 256 blocks). --no-malloc-tuning measures without.
 *
 * GB/s = block bytes moved / wall time of the sequential transfers (1 GB = 1e9 B); latency is
 * per request, send until acknowledgement (tandem: until tdm_kv_sender_poll reports it, blocks
 * released). Each size runs --rounds rounds (default 5) of raw, hashed, then tandem,
 * --seconds / rounds each, so all see the same machine load; the ratios reported are those of
 * the round with the median tandem/hashed ratio (every round's in the JSON). On a shared
 * machine compare the ratios, not the absolute numbers. --curve runs the KV channel with
 * CURVE (the baselines stay plain TCP). The CPU model, the ISA extensions and the load
 * average at the start are printed and in the JSON.
 */
#define _GNU_SOURCE /* pthread_setname_np */
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <inttypes.h>
#include <malloc.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "tandem/base.h"
#include "tandem/kv.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/transfer.h"

#include "bench_util.h"

static const tdm_kv_layout_t smollm2 = {30, 3, 64, 16, TDM_KV_F16};
#define POOL_BLOCKS 256u
#define FINGERPRINT UINT64_C(0x00be4c40be4c40be)
#define MAX_SAMPLES 100000
#define MAX_ROUNDS 15

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Percentile p (0..100) of v[0..n), sorting v. */
static double percentile(double *v, int n, double p)
{
    if (n == 0)
        return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)(p / 100.0 * (n - 1) + 0.5);
    return v[i];
}

/* The median of v[0..n) (a copy is sorted). */
static double median_of(const double *v, int n)
{
    double c[MAX_ROUNDS];
    memcpy(c, v, (size_t)n * sizeof *v);
    return percentile(c, n, 50);
}

typedef struct result {
    uint32_t blocks;
    int n;       /* transfers timed */
    double gbps; /* GB/s */
    double p50_ms, p99_ms;
    double cpu_tx_s_per_gb, cpu_rx_s_per_gb; /* CPU seconds per GB moved, each side */
    int n_rounds;                            /* tandem: rounds measured */
    double ratios[MAX_ROUNDS];               /* tandem: each round's tandem/raw ratio */
    double ratios_hashed[MAX_ROUNDS];        /* tandem: each round's tandem/hashed ratio */
    double ratios_model[MAX_ROUNDS]; /* tandem: each round's model/hashed ratio (pipelined) */
    double ratios_dsock[MAX_ROUNDS]; /* tandem: each round's model/hashed ratio (data socket) */
} result_t;

/* ---- CPU time per side: every thread's own CPU clock ---- */

#define MAX_TIDS 512

/* The tids of this process's threads into out[cap]; returns how many. */
static int list_tids(pid_t *out, int cap)
{
    int n = 0;
    DIR *d = opendir("/proc/self/task");
    struct dirent *e;
    while (d && (e = readdir(d)) != NULL && n < cap)
        if (e->d_name[0] >= '0' && e->d_name[0] <= '9')
            out[n++] = (pid_t)atoi(e->d_name);
    if (d)
        closedir(d);
    return n;
}

/* CPU seconds thread tid (of this process) has run, from its per-thread CPU clock (glibc's
 * pthread_getcpuclockid encoding: CPUCLOCK_SCHED | CPUCLOCK_PERTHREAD on ~tid), or -1 when it
 * has exited. */
static double tid_cpu(pid_t tid)
{
    clockid_t c = (clockid_t)((~(unsigned)tid << 3) | 6u);
    struct timespec ts;
    if (clock_gettime(c, &ts) != 0)
        return -1;
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

typedef struct cpu_split {
    double tx, rx; /* CPU seconds so far of the sender's and the receiver's threads */
} cpu_split_t;

typedef struct tidset {
    pid_t tids[MAX_TIDS]; /* the receiver's ZeroMQ threads */
    int n;
} tidset_t;

/* Every thread's CPU seconds so far, split into the receiver's (named "kvb-rx...", or in
 * rx_zmq) and the sender's (the rest). */
static cpu_split_t cpu_sample(const tidset_t *rx_zmq)
{
    cpu_split_t c = {0, 0};
    pid_t tids[MAX_TIDS];
    int n = list_tids(tids, MAX_TIDS);
    for (int i = 0; i < n; i++) {
        double t = tid_cpu(tids[i]);
        if (t < 0)
            continue;
        char path[64], comm[32] = "";
        snprintf(path, sizeof path, "/proc/self/task/%d/comm", (int)tids[i]);
        FILE *f = fopen(path, "r");
        if (f) {
            if (!fgets(comm, sizeof comm, f))
                comm[0] = 0;
            fclose(f);
        }
        bool rx = strncmp(comm, "kvb-rx", 6) == 0;
        for (int k = 0; k < rx_zmq->n && !rx; k++)
            rx = rx_zmq->tids[k] == tids[i];
        if (rx)
            c.rx += t;
        else
            c.tx += t;
    }
    return c;
}

/* The ISA extensions the copies and XXH3 (libxxhash's dispatch) can use, into out[cap]. */
static void cpu_isa(char *out, size_t cap)
{
    __builtin_cpu_init();
    snprintf(out, cap, "%s%s%s%s", __builtin_cpu_supports("avx2") ? "AVX2" : "SSE2",
             __builtin_cpu_supports("avx512f") ? ", AVX-512 F" : "",
             __builtin_cpu_supports("avx512bw") ? "/BW" : "",
             __builtin_cpu_supports("avx512vl") ? "/VL" : "");
}

/* ---- tandem: receiver thread ---- */

typedef struct rx {
    tdm_kv_receiver_t *r;
    tdm_kv_seq_t seq; /* POOL_BLOCKS reserved blocks every transfer lands in */
    atomic_bool stop;
    int failures;
} rx_t;

static int rx_lookup(void *user, const char *request_id, uint64_t attempt_id, uint32_t n_tokens,
                     const uint32_t **blocks, uint32_t *n_blocks, tdm_error_t *err)
{
    (void)request_id;
    (void)attempt_id;
    (void)n_tokens;
    (void)err;
    rx_t *x = user;
    *blocks = x->seq.blocks;
    *n_blocks = x->seq.n_blocks;
    return 0;
}

static void *rx_main(void *arg)
{
    rx_t *x = arg;
    pthread_setname_np(pthread_self(), "kvb-rx"); /* before its OpenMP workers exist */
    while (!atomic_load(&x->stop)) {
        tdm_kv_received_t got;
        int n = tdm_kv_receiver_recv(x->r, 100, rx_lookup, x, &got);
        if (n < 0 || (n == 1 && got.status != 0)) {
            fprintf(stderr, "bench: receiver: %d %s\n", n, n == 1 ? got.message : "");
            x->failures++;
        }
    }
    return NULL;
}

static int run_tandem(tdm_kv_sender_t *s, const char *ep, const uint32_t *blocks, uint32_t n,
                      double seconds, uint64_t block_bytes, double *lat, result_t *res)
{
    tdm_kv_send_req_t req = {.request_id = "bench",
                             .attempt_id = 1,
                             .endpoint = ep,
                             .blocks = blocks,
                             .n_blocks = n,
                             .n_tokens = n * smollm2.block_size};
    int count = 0;
    double t_start = 0;
    for (int i = -3; count < MAX_SAMPLES; i++) { /* 3 warm-up transfers */
        if (i == 0)
            t_start = tdm_time_now();
        double t0 = tdm_time_now();
        uint64_t id;
        tdm_error_t err = {0};
        if (tdm_kv_sender_send(s, &req, &id, &err) != 0) {
            fprintf(stderr, "bench: send: %s\n", err.msg);
            return -1;
        }
        tdm_kv_send_done_t d;
        int got;
        while ((got = tdm_kv_sender_poll(s, 1000, &d, 1)) == 0)
            ;
        if (got < 0 || d.status != 0) {
            fprintf(stderr, "bench: transfer failed: %s\n", got < 0 ? "poll" : d.message);
            return -1;
        }
        if (i >= 0) {
            lat[count++] = tdm_time_now() - t0;
            if (count >= 5 && tdm_time_now() - t_start >= seconds)
                break;
        }
    }
    double wall = tdm_time_now() - t_start;
    res->blocks = n;
    res->n = count;
    res->gbps = (double)count * n * (double)block_bytes / wall / 1e9;
    res->p50_ms = percentile(lat, count, 50) * 1e3;
    res->p99_ms = percentile(lat, count, 99) * 1e3;
    return 0;
}

/* ---- the TCP baselines: raw and hashed ---- */

typedef struct raw {
    int listen_fd, fd;
    uint8_t *dst; /* the receiver pool's memory */
    bool hashed;  /* each block preceded by its XXH3, checked on arrival */
    int failures;
    uint64_t mismatches; /* hashed: blocks whose hash differed */
} raw_t;

static int send_all(int fd, const void *p, size_t n)
{
    const uint8_t *b = p;
    while (n > 0) {
        ssize_t w = send(fd, b, n, 0);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

/* The 8-byte hash h then the n bytes at p, in as few sendmsg calls as the kernel takes. */
static int send_hashed(int fd, uint64_t h, const uint8_t *p, size_t n)
{
    struct iovec iov[2] = {{&h, sizeof h}, {(void *)p, n}};
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2};
    size_t left = sizeof h + n;
    while (left > 0) {
        ssize_t w = sendmsg(fd, &m, 0);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        left -= (size_t)w;
        while (w > 0 && m.msg_iovlen > 0) {
            if ((size_t)w >= m.msg_iov[0].iov_len) {
                w -= (ssize_t)m.msg_iov[0].iov_len;
                m.msg_iov++;
                m.msg_iovlen--;
            } else {
                m.msg_iov[0].iov_base = (uint8_t *)m.msg_iov[0].iov_base + w;
                m.msg_iov[0].iov_len -= (size_t)w;
                w = 0;
            }
        }
    }
    return 0;
}

static int recv_all(int fd, void *p, size_t n)
{
    uint8_t *b = p;
    while (n > 0) {
        ssize_t r = recv(fd, b, n, 0);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return -1;
        b += r;
        n -= (size_t)r;
    }
    return 0;
}

/* Receiver thread: per request a 16-byte header (block count, block bytes), then the blocks
 * straight into the pool (hashed: each after its 8-byte XXH3, hashed in the pool once
 * received and compared), then a one-byte ack. Ends when the sender closes. */
static void *raw_rx_main(void *arg)
{
    raw_t *x = arg;
    pthread_setname_np(pthread_self(), x->hashed ? "kvb-rx-hashed" : "kvb-rx-raw");
    x->fd = accept(x->listen_fd, NULL, NULL);
    if (x->fd < 0) {
        x->failures++;
        return NULL;
    }
    for (;;) {
        uint64_t hdr[2];
        if (recv_all(x->fd, hdr, sizeof hdr) != 0)
            break;
        for (uint64_t i = 0; i < hdr[0]; i++) {
            uint8_t *dst = x->dst + i * hdr[1];
            uint64_t want = 0;
            if ((x->hashed && recv_all(x->fd, &want, sizeof want) != 0) ||
                recv_all(x->fd, dst, (size_t)hdr[1]) != 0) {
                x->failures++;
                return NULL;
            }
            if (x->hashed && tdm_kv_block_checksum(dst, hdr[1]) != want)
                x->mismatches++;
        }
        char ack = 1;
        if (send_all(x->fd, &ack, 1) != 0) {
            x->failures++;
            return NULL;
        }
    }
    close(x->fd);
    return NULL;
}

static int run_raw(int fd, bool hashed, const uint8_t *src, uint32_t n, double seconds,
                   uint64_t block_bytes, double *lat, result_t *res)
{
    int count = 0;
    double t_start = 0;
    for (int i = -3; count < MAX_SAMPLES; i++) {
        if (i == 0)
            t_start = tdm_time_now();
        double t0 = tdm_time_now();
        uint64_t hdr[2] = {n, block_bytes};
        if (send_all(fd, hdr, sizeof hdr) != 0)
            return -1;
        for (uint32_t b = 0; b < n; b++) {
            const uint8_t *p = src + (uint64_t)b * block_bytes;
            if (hashed
                    ? send_hashed(fd, tdm_kv_block_checksum(p, block_bytes), p, (size_t)block_bytes)
                    : send_all(fd, p, (size_t)block_bytes))
                return -1;
        }
        char ack;
        if (recv_all(fd, &ack, 1) != 0)
            return -1;
        if (i >= 0) {
            lat[count++] = tdm_time_now() - t0;
            if (count >= 5 && tdm_time_now() - t_start >= seconds)
                break;
        }
    }
    double wall = tdm_time_now() - t_start;
    res->blocks = n;
    res->n = count;
    res->gbps = (double)count * n * (double)block_bytes / wall / 1e9;
    res->p50_ms = percentile(lat, count, 50) * 1e3;
    res->p99_ms = percentile(lat, count, 99) * 1e3;
    return 0;
}

static int raw_connect(raw_t *x, pthread_t *th)
{
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    x->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    if (x->listen_fd < 0 || bind(x->listen_fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        listen(x->listen_fd, 1) != 0 ||
        getsockname(x->listen_fd, (struct sockaddr *)&a, &alen) != 0)
        return -1;
    if (pthread_create(th, NULL, raw_rx_main, x) != 0)
        return -1;
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a) != 0)
        return -1;
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

/* ---- the pipelined ZeroMQ model: what a transfer split into chunk messages could reach ---- */

/* A sketch of a pipelined tcp backend on libzmq alone (no Tandem header, lookup or reply):
 * the sender hashes chunk k (chunk_blocks whole blocks, one thread) and queues it as one
 * message [count/first/total][checksums][zero-copy blocks...] on a DEALER while ZeroMQ's I/O
 * thread sends chunk k-1; the receiver's thread copies each chunk out of ZeroMQ's buffers into
 * the pool and hashes it there (Tandem's one pass) while the next chunk arrives, and
 * acknowledges after the last. Its own ZeroMQ context per side. */
typedef struct zpipe {
    void *ctx_tx, *ctx_rx, *tx, *rx; /* DEALER (sender), ROUTER (receiver) */
    uint8_t *dst;                    /* the receiver pool's memory */
    uint64_t bb;
    int failures;
    uint64_t mismatches;
} zpipe_t;

static void *zpipe_rx_main(void *arg)
{
    zpipe_t *z = arg;
    pthread_setname_np(pthread_self(), "kvb-rx-zchunk");
    for (;;) {
        zmq_msg_t id, m;
        uint32_t hdr[3] = {0, 0, 0}; /* count, first, total */
        zmq_msg_init(&id);
        if (zmq_msg_recv(&id, z->rx, 0) < 0 || zmq_recv(z->rx, hdr, sizeof hdr, 0) < 0) {
            zmq_msg_close(&id);
            z->failures++;
            return NULL;
        }
        if (hdr[2] == 0) { /* the end */
            zmq_msg_close(&id);
            return NULL;
        }
        uint64_t sums[64];
        int ok = hdr[0] <= 64 && zmq_recv(z->rx, sums, sizeof sums, 0) >= 0;
        for (uint32_t b = 0; ok && b < hdr[0]; b++) {
            zmq_msg_init(&m);
            ok = zmq_msg_recv(&m, z->rx, 0) >= 0 && zmq_msg_size(&m) == z->bb;
            if (ok) {
                uint8_t *dst = z->dst + (uint64_t)(hdr[1] + b) * z->bb;
                memcpy(dst, zmq_msg_data(&m), (size_t)z->bb);
                if (tdm_kv_block_checksum(dst, z->bb) != sums[b])
                    z->mismatches++;
            }
            zmq_msg_close(&m);
        }
        if (!ok) {
            zmq_msg_close(&id);
            z->failures++;
            return NULL;
        }
        char ack = 1;
        if (hdr[1] + hdr[0] == hdr[2] &&
            (zmq_msg_send(&id, z->rx, ZMQ_SNDMORE) < 0 || zmq_send(z->rx, &ack, 1, 0) < 0)) {
            zmq_msg_close(&id);
            z->failures++;
            return NULL;
        }
        zmq_msg_close(&id);
    }
}

/* Sends n blocks from src in chunks of chunk blocks and waits for the acknowledgement. */
static int zpipe_transfer(zpipe_t *z, const uint8_t *src, uint32_t n, uint32_t chunk)
{
    for (uint32_t first = 0; first < n; first += chunk) {
        uint32_t count = n - first < chunk ? n - first : chunk;
        uint32_t hdr[3] = {count, first, n};
        uint64_t sums[64];
        for (uint32_t b = 0; b < count; b++)
            sums[b] = tdm_kv_block_checksum(src + (uint64_t)(first + b) * z->bb, z->bb);
        if (zmq_send(z->tx, hdr, sizeof hdr, ZMQ_SNDMORE) < 0 ||
            zmq_send(z->tx, sums, count * sizeof sums[0], ZMQ_SNDMORE) < 0)
            return -1;
        for (uint32_t b = 0; b < count; b++) {
            zmq_msg_t m; /* zero-copy over the pool, which outlives the transfer */
            zmq_msg_init_data(&m, (void *)(src + (uint64_t)(first + b) * z->bb), (size_t)z->bb,
                              NULL, NULL);
            if (zmq_msg_send(&m, z->tx, b + 1 < count ? ZMQ_SNDMORE : 0) < 0) {
                zmq_msg_close(&m);
                return -1;
            }
        }
    }
    char ack;
    return zmq_recv(z->tx, &ack, 1, 0) == 1 ? 0 : -1;
}

static int run_zpipe(zpipe_t *z, const uint8_t *src, uint32_t n, uint32_t chunk, double seconds,
                     double *lat, result_t *res)
{
    int count = 0;
    double t_start = 0;
    for (int i = -3; count < MAX_SAMPLES; i++) {
        if (i == 0)
            t_start = tdm_time_now();
        double t0 = tdm_time_now();
        if (zpipe_transfer(z, src, n, chunk) != 0)
            return -1;
        if (i >= 0) {
            lat[count++] = tdm_time_now() - t0;
            if (count >= 5 && tdm_time_now() - t_start >= seconds)
                break;
        }
    }
    double wall = tdm_time_now() - t_start;
    res->blocks = n;
    res->n = count;
    res->gbps = (double)count * n * (double)z->bb / wall / 1e9;
    res->p50_ms = percentile(lat, count, 50) * 1e3;
    res->p99_ms = percentile(lat, count, 99) * 1e3;
    return 0;
}

/* The receiver's context and bound ROUTER (their threads noted as the receiver's in rx_zmq,
 * which list_tids before and after tell apart), the receiver thread, then the sender's
 * context and connected DEALER. Returns 0 or -1. */
static int zpipe_open(zpipe_t *z, pthread_t *th, bool *running, pid_t *rx_tids, int *n_rx_tids,
                      int cap)
{
    pid_t before[MAX_TIDS], after[MAX_TIDS];
    int n_before = list_tids(before, MAX_TIDS);
    int hwm = 0, linger = 0;
    char ep[128];
    size_t ep_len = sizeof ep;
    z->ctx_rx = zmq_ctx_new();
    z->rx = z->ctx_rx ? zmq_socket(z->ctx_rx, ZMQ_ROUTER) : NULL;
    if (!z->rx || zmq_setsockopt(z->rx, ZMQ_RCVHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(z->rx, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_bind(z->rx, "tcp://127.0.0.1:*") != 0 ||
        zmq_getsockopt(z->rx, ZMQ_LAST_ENDPOINT, ep, &ep_len) != 0)
        return -1;
    int n_after = list_tids(after, MAX_TIDS);
    for (int i = 0; i < n_after; i++) {
        bool old = false;
        for (int b = 0; b < n_before && !old; b++)
            old = before[b] == after[i];
        if (!old && *n_rx_tids < cap)
            rx_tids[(*n_rx_tids)++] = after[i];
    }
    if (pthread_create(th, NULL, zpipe_rx_main, z) != 0)
        return -1;
    *running = true;
    z->ctx_tx = zmq_ctx_new();
    z->tx = z->ctx_tx ? zmq_socket(z->ctx_tx, ZMQ_DEALER) : NULL;
    if (!z->tx || zmq_setsockopt(z->tx, ZMQ_SNDHWM, &hwm, sizeof hwm) != 0 ||
        zmq_setsockopt(z->tx, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_connect(z->tx, ep) != 0)
        return -1;
    return 0;
}

/* Stops the receiver thread (an end message) and closes both sides. */
static void zpipe_close(zpipe_t *z, pthread_t th, bool running)
{
    if (running) {
        uint32_t end[3] = {0, 0, 0};
        if (!z->tx || zmq_send(z->tx, end, sizeof end, 0) < 0)
            zmq_ctx_shutdown(z->ctx_rx); /* its blocked recv returns ETERM */
        pthread_join(th, NULL);
    }
    if (z->tx)
        zmq_close(z->tx);
    if (z->rx)
        zmq_close(z->rx);
    if (z->ctx_tx)
        zmq_ctx_term(z->ctx_tx);
    if (z->ctx_rx)
        zmq_ctx_term(z->ctx_rx);
}

/* ---- the data-socket model: option (b), a TCP data socket beside the ZeroMQ control path ---- */

/* Hashed raw with a ZeroMQ control message around it: the sender sends a small request on a
 * DEALER (the block count), then each block's XXH3 and the block on a TCP socket of its own;
 * the receiver thread takes the request from its ROUTER, recv()s every block straight into the
 * pool, hashes it there and compares, and acknowledges on the ROUTER. Its sockets live in the
 * pipelined model's two ZeroMQ contexts (their I/O threads are already charged to each side). */
typedef struct dsock {
    void *tx, *rx;     /* DEALER (sender), ROUTER (receiver) */
    int listen_fd, fd; /* the receiver's data socket */
    int tx_fd;         /* the sender's data socket */
    uint8_t *dst;      /* the receiver pool's memory */
    uint64_t bb;
    int failures;
    uint64_t mismatches;
} dsock_t;

static void *dsock_rx_main(void *arg)
{
    dsock_t *d = arg;
    pthread_setname_np(pthread_self(), "kvb-rx-dsock");
    d->fd = accept(d->listen_fd, NULL, NULL);
    if (d->fd < 0) {
        d->failures++;
        return NULL;
    }
    for (;;) {
        zmq_msg_t id;
        uint32_t n = 0;
        zmq_msg_init(&id);
        if (zmq_msg_recv(&id, d->rx, 0) < 0 || zmq_recv(d->rx, &n, sizeof n, 0) < 0) {
            zmq_msg_close(&id);
            d->failures++;
            break;
        }
        if (n == 0) { /* the end */
            zmq_msg_close(&id);
            break;
        }
        int ok = 1;
        for (uint32_t b = 0; ok && b < n; b++) {
            uint8_t *dst = d->dst + (uint64_t)b * d->bb;
            uint64_t want = 0;
            ok = recv_all(d->fd, &want, sizeof want) == 0 && recv_all(d->fd, dst, d->bb) == 0;
            if (ok && tdm_kv_block_checksum(dst, d->bb) != want)
                d->mismatches++;
        }
        char ack = 1;
        if (!ok || zmq_msg_send(&id, d->rx, ZMQ_SNDMORE) < 0 || zmq_send(d->rx, &ack, 1, 0) < 0) {
            zmq_msg_close(&id);
            d->failures++;
            break;
        }
        zmq_msg_close(&id);
    }
    close(d->fd);
    return NULL;
}

static int run_dsock(dsock_t *d, const uint8_t *src, uint32_t n, double seconds, double *lat,
                     result_t *res)
{
    int count = 0;
    double t_start = 0;
    for (int i = -3; count < MAX_SAMPLES; i++) {
        if (i == 0)
            t_start = tdm_time_now();
        double t0 = tdm_time_now();
        if (zmq_send(d->tx, &n, sizeof n, 0) < 0)
            return -1;
        for (uint32_t b = 0; b < n; b++) {
            const uint8_t *p = src + (uint64_t)b * d->bb;
            if (send_hashed(d->tx_fd, tdm_kv_block_checksum(p, d->bb), p, (size_t)d->bb) != 0)
                return -1;
        }
        char ack;
        if (zmq_recv(d->tx, &ack, 1, 0) != 1)
            return -1;
        if (i >= 0) {
            lat[count++] = tdm_time_now() - t0;
            if (count >= 5 && tdm_time_now() - t_start >= seconds)
                break;
        }
    }
    double wall = tdm_time_now() - t_start;
    res->blocks = n;
    res->n = count;
    res->gbps = (double)count * n * (double)d->bb / wall / 1e9;
    res->p50_ms = percentile(lat, count, 50) * 1e3;
    res->p99_ms = percentile(lat, count, 99) * 1e3;
    return 0;
}

/* The control pair in z's contexts, the data socket pair and the receiver thread. Returns 0 or
 * -1. */
static int dsock_open(dsock_t *d, const zpipe_t *z, pthread_t *th, bool *running)
{
    int linger = 0;
    char ep[128];
    size_t ep_len = sizeof ep;
    d->rx = zmq_socket(z->ctx_rx, ZMQ_ROUTER);
    d->tx = zmq_socket(z->ctx_tx, ZMQ_DEALER);
    if (!d->rx || !d->tx || zmq_setsockopt(d->rx, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_setsockopt(d->tx, ZMQ_LINGER, &linger, sizeof linger) != 0 ||
        zmq_bind(d->rx, "tcp://127.0.0.1:*") != 0 ||
        zmq_getsockopt(d->rx, ZMQ_LAST_ENDPOINT, ep, &ep_len) != 0 || zmq_connect(d->tx, ep) != 0)
        return -1;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t alen = sizeof a;
    d->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
    if (d->listen_fd < 0 || bind(d->listen_fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        listen(d->listen_fd, 1) != 0 ||
        getsockname(d->listen_fd, (struct sockaddr *)&a, &alen) != 0)
        return -1;
    if (pthread_create(th, NULL, dsock_rx_main, d) != 0)
        return -1;
    *running = true;
    d->tx_fd = socket(AF_INET, SOCK_STREAM, 0);
    if (d->tx_fd < 0 || connect(d->tx_fd, (struct sockaddr *)&a, sizeof a) != 0)
        return -1;
    int one = 1;
    setsockopt(d->tx_fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return 0;
}

/* Stops the receiver thread (a request of 0 blocks; its data socket shut down first, should it
 * wait in accept or recv) and closes the sockets, before zpipe_close ends the contexts. */
static void dsock_close(dsock_t *d, const zpipe_t *z, pthread_t th, bool running)
{
    if (running) {
        uint32_t end = 0;
        if (d->tx_fd >= 0)
            shutdown(d->tx_fd, SHUT_RDWR);
        if (!d->tx || zmq_send(d->tx, &end, sizeof end, 0) < 0) {
            shutdown(d->listen_fd, SHUT_RDWR); /* out of accept */
            zmq_ctx_shutdown(z->ctx_rx);       /* out of zmq recv: ETERM */
        }
        pthread_join(th, NULL);
    }
    if (d->tx_fd >= 0)
        close(d->tx_fd);
    if (d->listen_fd >= 0)
        close(d->listen_fd);
    if (d->tx)
        zmq_close(d->tx);
    if (d->rx)
        zmq_close(d->rx);
}

/* The command line. */
typedef struct kvb_opts {
    double seconds; /* per size */
    const char *json_path;
    uint32_t only_blocks; /* --blocks N: one size only (profiling); 0 = 1, 32 and 256 */
    int rounds;           /* --rounds R: raw/tandem alternations per size */
    bool malloc_tuning;
    bool curve;           /* --curve: the KV channel with CURVE */
    uint32_t model_chunk; /* --model-chunk-blocks C: the pipelined ZeroMQ model's chunk, 0 = off */
} kvb_opts_t;

/* Everything a run holds; kvb_close releases what was set up, in reverse order. */
typedef struct kvb {
    tdm_net_t *net_rx, *net_tx;   /* one ZeroMQ context per side, as two nodes have */
    tdm_kv_pool_t *spool, *rpool; /* sender's and receiver's pools, POOL_BLOCKS each */
    tdm_kv_seq_t sseq;            /* the sender's POOL_BLOCKS reserved blocks */
    uint64_t bb;                  /* bytes per block */
    double *lat;                  /* [MAX_SAMPLES] latency scratch, seconds */
    tdm_logger_t log;
    rx_t rx;
    tdm_kv_sender_t *s;
    char ep[256];    /* the receiver's endpoint */
    tidset_t rx_zmq; /* the receiver context's ZeroMQ threads (CPU time charged to it) */
    pthread_t rx_th, raw_th[2];
    bool rx_running, raw_running[2];
    raw_t raw[2]; /* [0] raw, [1] hashed */
    zpipe_t zp;   /* the pipelined ZeroMQ model (--model-chunk-blocks) */
    pthread_t zp_th;
    bool zp_running;
    dsock_t ds; /* the data-socket model (with the pipelined one) */
    pthread_t ds_th;
    bool ds_running;
    int raw_fd[2];
    char cpu[128], isa[64];
    double load[3]; /* load average at the start: 1, 5, 15 minutes */
} kvb_t;

/* Parses the command line into *o. Returns 0 to go on, 1 after --help, or 2 after printing the
 * usage. */
static int parse_args(int argc, char **argv, kvb_opts_t *o)
{
    static const struct option longopts[] = {{"seconds", required_argument, NULL, 's'},
                                             {"json", required_argument, NULL, 'j'},
                                             {"blocks", required_argument, NULL, 'b'},
                                             {"no-malloc-tuning", no_argument, NULL, 'n'},
                                             {"rounds", required_argument, NULL, 'r'},
                                             {"curve", no_argument, NULL, 'c'},
                                             {"model-chunk-blocks", required_argument, NULL, 'm'},
                                             {"help", no_argument, NULL, 'h'},
                                             {NULL, 0, NULL, 0}};
    *o = (kvb_opts_t){.seconds = 1.0, .rounds = 5, .malloc_tuning = true, .model_chunk = 3};
    int opt;
    while ((opt = getopt_long(argc, argv, "s:j:b:nr:cm:h", longopts, NULL)) != -1) {
        switch (opt) {
        case 's': o->seconds = atof(optarg); break;
        case 'j': o->json_path = optarg; break;
        case 'b': o->only_blocks = (uint32_t)atoi(optarg); break;
        case 'n': o->malloc_tuning = false; break;
        case 'r': o->rounds = atoi(optarg); break;
        case 'c': o->curve = true; break;
        case 'm': o->model_chunk = (uint32_t)atoi(optarg); break;
        default:
            fprintf(opt == 'h' ? stdout : stderr,
                    "usage: tandem-bench-kv-transfer [--seconds S] [--json FILE] "
                    "[--blocks N] [--rounds R] [--curve] [--no-malloc-tuning] "
                    "[--model-chunk-blocks C]\n"
                    "KV transfers of 1, 32 and 256 blocks (or --blocks N) over loopback TCP: "
                    "Tandem's tcp backend against a raw socket that XXH3-hashes both ends, a "
                    "plain raw socket and (--model-chunk-blocks C, 0 = off) models of a "
                    "pipelined ZeroMQ transfer and a data socket (docs/performance.md).\n");
            return opt == 'h' ? 1 : 2;
        }
    }
    if (o->rounds < 1 || o->rounds > MAX_ROUNDS) {
        fprintf(stderr, "bench: --rounds from 1 to %d\n", MAX_ROUNDS);
        return 2;
    }
    if (o->malloc_tuning) {
        mallopt(M_MMAP_THRESHOLD, 32 << 20);
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
        mallopt(M_ARENA_MAX, 1); /* per-thread arenas unmap whole empty heaps, trim or not */
    }
    if (o->model_chunk > 64) {
        fprintf(stderr, "bench: --model-chunk-blocks from 0 (off) to 64\n");
        return 2;
    }
    if (o->only_blocks > POOL_BLOCKS) {
        fprintf(stderr, "bench: --blocks at most %u\n", POOL_BLOCKS);
        return 2;
    }
    if (o->seconds <= 0)
        o->seconds = 1.0;
    return 0;
}

/* Makes both pools, reserves all their blocks and touches every page (random-ish contents on
 * the sender's side). Returns 0, or 1 after printing why. */
static int kvb_open_pools(kvb_t *k)
{
    tdm_error_t err = {0};
    k->spool = tdm_kv_pool_new(&smollm2, POOL_BLOCKS, &err);
    k->rpool = k->spool ? tdm_kv_pool_new(&smollm2, POOL_BLOCKS, &err) : NULL;
    k->lat = malloc(MAX_SAMPLES * sizeof *k->lat);
    if (!k->rpool || !k->lat) {
        fprintf(stderr, "bench: %s\n", err.msg[0] ? err.msg : "out of memory");
        return 1;
    }
    k->bb = tdm_kv_pool_block_bytes(k->spool);
    if (tdm_kv_seq_reserve(k->spool, &k->sseq, POOL_BLOCKS * smollm2.block_size) != 0 ||
        tdm_kv_seq_reserve(k->rpool, &k->rx.seq, POOL_BLOCKS * smollm2.block_size) != 0) {
        fprintf(stderr, "bench: cannot reserve the pools\n");
        return 1;
    }
    uint64_t *w = tdm_kv_pool_base(k->spool);
    for (uint64_t i = 0; i < POOL_BLOCKS * k->bb / 8; i++)
        w[i] = (i + 1) * UINT64_C(0x9e3779b97f4a7c15);
    memset(tdm_kv_pool_base(k->rpool), 0, POOL_BLOCKS * k->bb);
    return 0;
}

/* Starts the receiver (its own ZeroMQ context, whose threads are noted as the receiver's) on
 * its own thread and the sender (another context), then the two TCP baselines. Returns 0, or
 * 1 after printing why. */
static int kvb_open_links(kvb_t *k, bool curve, uint32_t model_chunk)
{
    tdm_error_t err = {0};
    tdm_log_init(&k->log, "bench");
    k->log.level = TDM_LOG_WARN;
    /* --curve: the receiver admits the sender's key under its node id */
    char spub[41], ssec[41], cpub[41], csec[41];
    if (curve &&
        (tdm_net_curve_keypair(spub, ssec) != 0 || tdm_net_curve_keypair(cpub, csec) != 0)) {
        fprintf(stderr, "bench: no CURVE keys (ZeroMQ built without CURVE?)\n");
        return 1;
    }
    tdm_curve_peer_t admitted = {cpub, "bench-prefill"};
    tdm_curve_keys_t server = {
        .server_public = spub, .server_secret = ssec, .clients = &admitted, .n_clients = 1};
    tdm_curve_keys_t client = {.server_public = spub, .client_public = cpub, .client_secret = csec};
    tdm_kv_receiver_opts_t ro = {.endpoint = "tcp://127.0.0.1:*",
                                 .node_id = "bench-decode",
                                 .model_fingerprint = FINGERPRINT,
                                 .curve = curve ? &server : NULL,
                                 .log = &k->log};
    pid_t before[MAX_TIDS], after[MAX_TIDS];
    int n_before = list_tids(before, MAX_TIDS);
    k->net_rx = tdm_net_new(2, &err);
    k->rx.r = k->net_rx ? tdm_kv_receiver_new(k->net_rx, k->rpool, &ro, &err) : NULL;
    int n_after = list_tids(after, MAX_TIDS);
    for (int i = 0; i < n_after; i++) { /* ZeroMQ starts its threads with the first socket */
        bool old = false;
        for (int b = 0; b < n_before && !old; b++)
            old = before[b] == after[i];
        if (!old && k->rx_zmq.n < MAX_TIDS)
            k->rx_zmq.tids[k->rx_zmq.n++] = after[i];
    }
    tdm_kv_sender_opts_t so = {.node_id = "bench-prefill",
                               .model_fingerprint = FINGERPRINT,
                               .backend = TDM_KV_BACKEND_TCP,
                               .curve = curve ? &client : NULL,
                               .log = &k->log};
    k->net_tx = k->rx.r ? tdm_net_new(2, &err) : NULL;
    k->s = k->net_tx ? tdm_kv_sender_new(k->net_tx, k->spool, &so, &err) : NULL;
    if (!k->s) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }
    snprintf(k->ep, sizeof k->ep, "%s", tdm_kv_receiver_endpoint(k->rx.r));
    atomic_init(&k->rx.stop, false);
    /* the receiver's socket moves to that thread */
    k->rx_running = pthread_create(&k->rx_th, NULL, rx_main, &k->rx) == 0;
    for (int h = 0; h < 2; h++) {
        k->raw[h].dst = tdm_kv_pool_base(k->rpool);
        k->raw[h].hashed = h == 1;
        k->raw_fd[h] = raw_connect(&k->raw[h], &k->raw_th[h]);
        k->raw_running[h] = k->raw_fd[h] >= 0;
        if (k->raw_fd[h] < 0) {
            fprintf(stderr, "bench: TCP baseline set-up failed: %s\n", strerror(errno));
            return 1;
        }
    }
    k->zp.dst = tdm_kv_pool_base(k->rpool);
    k->zp.bb = k->bb;
    if (model_chunk &&
        zpipe_open(&k->zp, &k->zp_th, &k->zp_running, k->rx_zmq.tids, &k->rx_zmq.n, MAX_TIDS)) {
        fprintf(stderr, "bench: ZeroMQ model set-up failed: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    k->ds.dst = tdm_kv_pool_base(k->rpool);
    k->ds.bb = k->bb;
    if (model_chunk && dsock_open(&k->ds, &k->zp, &k->ds_th, &k->ds_running) != 0) {
        fprintf(stderr, "bench: data-socket model set-up failed: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}

static void kvb_close(kvb_t *k)
{
    dsock_close(&k->ds, &k->zp, k->ds_th, k->ds_running);
    zpipe_close(&k->zp, k->zp_th, k->zp_running);
    for (int h = 0; h < 2; h++)
        if (k->raw_running[h]) {
            shutdown(k->raw_fd[h], SHUT_RDWR);
            close(k->raw_fd[h]);
            pthread_join(k->raw_th[h], NULL);
            close(k->raw[h].listen_fd);
        }
    if (k->rx_running) {
        atomic_store(&k->rx.stop, true);
        pthread_join(k->rx_th, NULL);
    }
    tdm_kv_sender_destroy(&k->s);
    tdm_kv_receiver_destroy(&k->rx.r);
    if (k->spool)
        tdm_kv_seq_release(k->spool, &k->sseq);
    if (k->rpool)
        tdm_kv_seq_release(k->rpool, &k->rx.seq);
    tdm_kv_pool_destroy(&k->spool);
    tdm_kv_pool_destroy(&k->rpool);
    tdm_net_destroy(&k->net_tx);
    tdm_net_destroy(&k->net_rx);
    free(k->lat);
}

/* The smallest tandem/hashed ratio at 32 blocks and more (the target's sizes; every size when
 * none is that large). */
static double min_ratio_hashed(const uint32_t *sizes, int n_sizes, const result_t *tandem,
                               const result_t *hashed)
{
    double m = 1e9, all = 1e9;
    for (int i = 0; i < n_sizes; i++) {
        double r = tandem[i].gbps / hashed[i].gbps;
        all = r < all ? r : all;
        if (sizes[i] >= 32 && r < m)
            m = r;
    }
    return m < 1e9 ? m : all;
}

/* The table, to stderr. */
static void print_table(const kvb_t *k, const kvb_opts_t *o, const uint32_t *sizes, int n_sizes,
                        const result_t *tandem, const result_t *hashed, const result_t *rawr,
                        const result_t *model, const result_t *model_b)
{
    fprintf(stderr,
            "KV transfer, SmolLM2-135M f16 layout (%" PRIu64 " B/block), loopback TCP%s, "
            "%.1f s per size in %d rounds (the round with the median tandem/hashed ratio "
            "shown), malloc %s\nCPU: %s (%s); load average %.2f %.2f %.2f\n"
            "GB/s; p50 ms; CPU-s/GB sender+receiver\n",
            k->bb, o->curve ? ", KV channel with CURVE" : "", o->seconds, o->rounds,
            o->malloc_tuning ? "tuned" : "defaults", k->cpu, k->isa, k->load[0], k->load[1],
            k->load[2]);
    fprintf(stderr, "%6s %10s | %-27s | %-27s | %-27s | %8s %8s\n", "blocks", "bytes", "tandem",
            "hashed raw", "plain raw", "t/hashed", "t/raw");
    const result_t *r3[3] = {tandem, hashed, rawr};
    for (int i = 0; i < n_sizes; i++) {
        fprintf(stderr, "%6u %10" PRIu64, sizes[i], (uint64_t)sizes[i] * k->bb);
        for (int w = 0; w < 3; w++)
            fprintf(stderr, " | %5.2f %7.3f %6.3f+%6.3f", r3[w][i].gbps, r3[w][i].p50_ms,
                    r3[w][i].cpu_tx_s_per_gb, r3[w][i].cpu_rx_s_per_gb);
        fprintf(stderr, " | %7.2fx %7.2fx\n", tandem[i].gbps / hashed[i].gbps,
                tandem[i].gbps / rawr[i].gbps);
        fprintf(stderr, "%6s rounds t/hashed:", "");
        for (int r = 0; r < tandem[i].n_rounds; r++)
            fprintf(stderr, " %.2f", tandem[i].ratios_hashed[r]);
        fprintf(stderr, "; t/raw:");
        for (int r = 0; r < tandem[i].n_rounds; r++)
            fprintf(stderr, " %.2f", tandem[i].ratios[r]);
        fprintf(stderr, "\n");
        if (o->model_chunk)
            fprintf(stderr,
                    "%6s model: ZeroMQ pipelined in %u-block chunks %5.2f GB/s %7.3f ms "
                    "%6.3f+%6.3f CPU-s/GB, %.2fx hashed raw (median of the rounds' ratios "
                    "%.2fx)\n",
                    "", o->model_chunk, model[i].gbps, model[i].p50_ms, model[i].cpu_tx_s_per_gb,
                    model[i].cpu_rx_s_per_gb, model[i].gbps / hashed[i].gbps,
                    median_of(tandem[i].ratios_model, tandem[i].n_rounds));
        if (o->model_chunk)
            fprintf(stderr,
                    "%6s model: data socket + ZeroMQ control      %5.2f GB/s %7.3f ms "
                    "%6.3f+%6.3f CPU-s/GB, %.2fx hashed raw (median of the rounds' ratios "
                    "%.2fx)\n",
                    "", model_b[i].gbps, model_b[i].p50_ms, model_b[i].cpu_tx_s_per_gb,
                    model_b[i].cpu_rx_s_per_gb, model_b[i].gbps / hashed[i].gbps,
                    median_of(tandem[i].ratios_dsock, tandem[i].n_rounds));
    }
}

/* One JSON line, to stdout or --json FILE. Returns 0, or 1 when the file cannot be written. */
static int write_json(const kvb_t *k, const kvb_opts_t *o, const uint32_t *sizes, int n_sizes,
                      const result_t *tandem, const result_t *hashed, const result_t *rawr,
                      const result_t *model, const result_t *model_b)
{
    FILE *out = o->json_path ? fopen(o->json_path, "w") : stdout;
    if (!out) {
        fprintf(stderr, "bench: cannot write %s\n", o->json_path);
        return 1;
    }
    fprintf(out,
            "{\"bench\":\"kv_transfer\",\"transport\":\"tcp-loopback\",\"layout\":"
            "\"smollm2-135m-f16\",\"block_bytes\":%" PRIu64 ",\"malloc_tuned\":%s,\"curve\":%s,"
            "\"cpu\":\"%s\",\"isa\":\"%s\",\"loadavg\":[%.2f,%.2f,%.2f],\"rounds\":%d,"
            "\"seconds\":%.2f,\"model_chunk_blocks\":%u,\"results\":[",
            k->bb, o->malloc_tuning ? "true" : "false", o->curve ? "true" : "false", k->cpu, k->isa,
            k->load[0], k->load[1], k->load[2], o->rounds, o->seconds, o->model_chunk);
    double min_ratio = 1e9;
    for (int i = 0; i < n_sizes; i++) {
        double ratio = tandem[i].gbps / rawr[i].gbps;
        min_ratio = ratio < min_ratio ? ratio : min_ratio;
        fprintf(out, "%s{\"blocks\":%u,\"bytes\":%" PRIu64, i ? "," : "", sizes[i],
                (uint64_t)sizes[i] * k->bb);
        const char *pre[5] = {"", "hashed_", "raw_", "model_", "model_dsock_"};
        const result_t *r3[5] = {&tandem[i], &hashed[i], &rawr[i], &model[i], &model_b[i]};
        for (int w = 0; w < (o->model_chunk ? 5 : 3); w++)
            fprintf(out,
                    ",\"%sn\":%d,\"%sgbps\":%.4f,\"%sp50_ms\":%.4f,\"%sp99_ms\":%.4f,"
                    "\"%scpu_s_per_gb\":%.4f,\"%scpu_tx_s_per_gb\":%.4f,"
                    "\"%scpu_rx_s_per_gb\":%.4f",
                    pre[w], r3[w]->n, pre[w], r3[w]->gbps, pre[w], r3[w]->p50_ms, pre[w],
                    r3[w]->p99_ms, pre[w], r3[w]->cpu_tx_s_per_gb + r3[w]->cpu_rx_s_per_gb, pre[w],
                    r3[w]->cpu_tx_s_per_gb, pre[w], r3[w]->cpu_rx_s_per_gb);
        fprintf(out, ",\"ratio\":%.4f,\"ratio_hashed\":%.4f", ratio,
                tandem[i].gbps / hashed[i].gbps);
        for (int r = 0; r < tandem[i].n_rounds; r++)
            fprintf(out, "%s%.4f", r ? "," : ",\"round_ratios\":[", tandem[i].ratios[r]);
        for (int r = 0; r < tandem[i].n_rounds; r++)
            fprintf(out, "%s%.4f", r ? "," : "],\"round_ratios_hashed\":[",
                    tandem[i].ratios_hashed[r]);
        fprintf(out, "]");
        if (o->model_chunk) {
            for (int r = 0; r < tandem[i].n_rounds; r++)
                fprintf(out, "%s%.4f", r ? "," : ",\"round_ratios_model_hashed\":[",
                        tandem[i].ratios_model[r]);
            for (int r = 0; r < tandem[i].n_rounds; r++)
                fprintf(out, "%s%.4f", r ? "," : "],\"round_ratios_model_dsock_hashed\":[",
                        tandem[i].ratios_dsock[r]);
            fprintf(out, "]");
        }
        fprintf(out, "}");
    }
    fprintf(out,
            "],\"min_ratio\":%.4f,\"min_ratio_hashed\":%.4f,\"target_ratio_hashed\":0.9,"
            "\"target_blocks\":[32,256]}\n",
            min_ratio, min_ratio_hashed(sizes, n_sizes, tandem, hashed));
    if (o->json_path)
        fclose(out);
    return 0;
}

/* CPU seconds per GB of each side between two samples, over `transfers` transfers of n blocks
 * (the 3 warm-ups included: they are in the CPU time). */
static void cpu_per_gb(const kvb_t *k, cpu_split_t a, cpu_split_t b, int transfers, uint32_t n,
                       result_t *res)
{
    double gb = (transfers + 3) * (double)n * (double)k->bb / 1e9;
    res->cpu_tx_s_per_gb = (b.tx - a.tx) / gb;
    res->cpu_rx_s_per_gb = (b.rx - a.rx) / gb;
}

/* Measures n blocks in o->rounds rounds of raw, hashed, tandem, then (--model-chunk-blocks)
 * the pipelined ZeroMQ model and the data-socket model; the three results get the
 * round with the median tandem/hashed ratio, tandem->ratios and ->ratios_hashed every round's.
 * Returns 0 or -1. */
static int run_size(kvb_t *k, const kvb_opts_t *o, uint32_t n, result_t *tandem, result_t *hashed,
                    result_t *rawr, result_t *model, result_t *model_b)
{
    result_t t[MAX_ROUNDS], h[MAX_ROUNDS], w[MAX_ROUNDS], z[MAX_ROUNDS], d[MAX_ROUNDS];
    memset(z, 0, sizeof z);
    memset(d, 0, sizeof d);
    double sorted[MAX_ROUNDS];
    double secs = o->seconds / o->rounds;
    const uint8_t *src = tdm_kv_pool_base(k->spool);
    for (int r = 0; r < o->rounds; r++) {
        /* The sender's blocks: the first n of its reservation (contiguous ids in practice). */
        cpu_split_t c0 = cpu_sample(&k->rx_zmq);
        if (run_raw(k->raw_fd[0], false, src, n, secs, k->bb, k->lat, &w[r]) != 0)
            return -1;
        cpu_split_t c1 = cpu_sample(&k->rx_zmq);
        if (run_raw(k->raw_fd[1], true, src, n, secs, k->bb, k->lat, &h[r]) != 0)
            return -1;
        cpu_split_t c2 = cpu_sample(&k->rx_zmq);
        if (run_tandem(k->s, k->ep, k->sseq.blocks, n, secs, k->bb, k->lat, &t[r]) != 0)
            return -1;
        cpu_split_t c3 = cpu_sample(&k->rx_zmq);
        if (o->model_chunk) {
            if (run_zpipe(&k->zp, src, n, o->model_chunk, secs, k->lat, &z[r]) != 0)
                return -1;
            cpu_split_t c4 = cpu_sample(&k->rx_zmq);
            cpu_per_gb(k, c3, c4, z[r].n, n, &z[r]);
            if (run_dsock(&k->ds, src, n, secs, k->lat, &d[r]) != 0)
                return -1;
            cpu_per_gb(k, c4, cpu_sample(&k->rx_zmq), d[r].n, n, &d[r]);
        }
        cpu_per_gb(k, c0, c1, w[r].n, n, &w[r]);
        cpu_per_gb(k, c1, c2, h[r].n, n, &h[r]);
        cpu_per_gb(k, c2, c3, t[r].n, n, &t[r]);
        tandem->ratios[r] = t[r].gbps / w[r].gbps;
        tandem->ratios_model[r] = z[r].gbps / h[r].gbps;
        tandem->ratios_dsock[r] = d[r].gbps / h[r].gbps;
        tandem->ratios_hashed[r] = sorted[r] = t[r].gbps / h[r].gbps;
    }
    double ratios[MAX_ROUNDS], ratios_hashed[MAX_ROUNDS], rm[MAX_ROUNDS], rd[MAX_ROUNDS];
    memcpy(ratios, tandem->ratios, sizeof ratios);
    memcpy(rm, tandem->ratios_model, sizeof rm);
    memcpy(rd, tandem->ratios_dsock, sizeof rd);
    memcpy(ratios_hashed, tandem->ratios_hashed, sizeof ratios_hashed);
    double median = percentile(sorted, o->rounds, 50);
    int m = 0;
    while (m < o->rounds - 1 && ratios_hashed[m] != median)
        m++;
    *tandem = t[m];
    *hashed = h[m];
    *rawr = w[m];
    *model = z[m];
    *model_b = d[m];
    tandem->n_rounds = o->rounds;
    memcpy(tandem->ratios, ratios, sizeof ratios);
    memcpy(tandem->ratios_hashed, ratios_hashed, sizeof ratios_hashed);
    memcpy(tandem->ratios_model, rm, sizeof rm);
    memcpy(tandem->ratios_dsock, rd, sizeof rd);
    return 0;
}

/* Measures every size (run_size) and reports them. Returns the exit status. */
static int kvb_run(kvb_t *k, const kvb_opts_t *o)
{
    uint32_t sizes[] = {1, 32, 256};
    int n_sizes = (int)(sizeof sizes / sizeof sizes[0]);
    if (o->only_blocks) {
        sizes[0] = o->only_blocks;
        n_sizes = 1;
    }
    result_t tandem[3], hashed[3], rawr[3], model[3], model_b[3];
    for (int i = 0; i < n_sizes; i++) {
        if (run_size(k, o, sizes[i], &tandem[i], &hashed[i], &rawr[i], &model[i], &model_b[i]) !=
            0) {
            fprintf(stderr, "bench: run of %u blocks failed\n", sizes[i]);
            return 1;
        }
    }
    print_table(k, o, sizes, n_sizes, tandem, hashed, rawr, model, model_b);
    if (write_json(k, o, sizes, n_sizes, tandem, hashed, rawr, model, model_b) != 0)
        return 1;
    return 0;
}

int main(int argc, char **argv)
{
    kvb_opts_t o;
    int prc = parse_args(argc, argv, &o);
    if (prc != 0)
        return prc == 1 ? 0 : 2; /* 1: --help printed */
    kvb_t k = {.raw_fd = {-1, -1}, .ds = {.listen_fd = -1, .fd = -1, .tx_fd = -1}};
    pthread_setname_np(pthread_self(), "kvb-tx");
    bench_cpu_model(k.cpu, sizeof k.cpu);
    cpu_isa(k.isa, sizeof k.isa);
    if (getloadavg(k.load, 3) != 3)
        k.load[0] = k.load[1] = k.load[2] = -1;
    tdm_kv_seq_init(&k.sseq);
    tdm_kv_seq_init(&k.rx.seq);
    int rc = kvb_open_pools(&k);
    if (rc == 0)
        rc = kvb_open_links(&k, o.curve, o.model_chunk);
    if (rc == 0)
        rc = kvb_run(&k, &o);
    kvb_close(&k);
    if (rc == 0 && (k.rx.failures || k.raw[0].failures || k.raw[1].failures)) {
        fprintf(stderr, "bench: failures: tandem %d, raw %d, hashed %d\n", k.rx.failures,
                k.raw[0].failures, k.raw[1].failures);
        rc = 1;
    }
    if (k.ds.failures || k.ds.mismatches) {
        fprintf(stderr, "bench: data-socket model: %d failures, %" PRIu64 " hashes differed\n",
                k.ds.failures, k.ds.mismatches);
        rc = 1;
    }
    if (k.zp.failures || k.zp.mismatches) {
        fprintf(stderr, "bench: ZeroMQ model: %d failures, %" PRIu64 " hashes differed\n",
                k.zp.failures, k.zp.mismatches);
        rc = 1;
    }
    if (k.raw[1].mismatches) {
        fprintf(stderr, "bench: hashed baseline: %" PRIu64 " blocks' hashes differed\n",
                k.raw[1].mismatches);
        rc = 1;
    }
    return rc;
}
