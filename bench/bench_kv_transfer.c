/* bench_kv_transfer.c - KV transport throughput and latency over loopback TCP: transfers of
 * 1, 32 and 256 blocks of the SmolLM2-135M f16 layout (368,640 B per block) from a sender pool
 * to a receiver pool served by another thread, one transfer at a time (send -> checksums ->
 * ZeroMQ -> copy into the reserved blocks, verified there -> acknowledgement), next to a raw
 * baseline measured in the same run: the same bytes and the same request/acknowledgement
 * pattern over a plain TCP socket between two threads (send() from the sender pool, recv()
 * straight into the receiver pool's blocks, a one-byte ack). Prints a table to stderr and one
 * JSON line to stdout (or --json FILE) with the ratio tandem/raw per size.
 *
 * By default the process tunes glibc malloc the way a decode node should (M_MMAP_THRESHOLD
 * 32 MiB, M_TRIM_THRESHOLD 1 GiB, M_ARENA_MAX 1): ZeroMQ receives every block into a fresh
 * malloc'd buffer on its I/O thread, and with glibc's defaults those pages go back to the
 * kernel after each transfer (mmap'd chunks, trimmed or deleted per-thread heaps) and fault in
 * again on the next (2-3x slower at 32 and 256 blocks). --no-malloc-tuning measures without.
 *
 * GB/s = block bytes moved / wall time of the sequential transfers (1 GB = 1e9 B); latency is
 * per request, send until acknowledgement (tandem: until tdm_kv_sender_poll reports it, blocks
 * released). Each size runs --rounds rounds (default 5) of raw then tandem, --seconds / rounds
 * each, so both see the same machine load; the ratio reported is the median of the rounds'
 * ratios (all of them in the JSON), the GB/s and latencies those of that round. On a shared
 * machine compare the ratio, not the absolute numbers. --curve runs the KV channel with CURVE
 * (the raw baseline stays plain TCP).
 */
#include <arpa/inet.h>
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
#include <unistd.h>

#include "tandem/base.h"
#include "tandem/kv.h"
#include "tandem/log.h"
#include "tandem/net.h"
#include "tandem/transfer.h"

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

typedef struct result {
    uint32_t blocks;
    int n;       /* transfers timed */
    double gbps; /* GB/s */
    double p50_ms, p99_ms;
    double cpu_s_per_gb;       /* CPU time of the whole process (every thread) per GB moved */
    int n_rounds;              /* tandem: rounds measured */
    double ratios[MAX_ROUNDS]; /* tandem: each round's tandem/raw ratio */
} result_t;

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

/* ---- raw TCP baseline ---- */

typedef struct raw {
    int listen_fd, fd;
    uint8_t *dst; /* the receiver pool's memory */
    int failures;
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
 * straight into the pool, then a one-byte ack. Ends when the sender closes. */
static void *raw_rx_main(void *arg)
{
    raw_t *x = arg;
    x->fd = accept(x->listen_fd, NULL, NULL);
    if (x->fd < 0) {
        x->failures++;
        return NULL;
    }
    for (;;) {
        uint64_t hdr[2];
        if (recv_all(x->fd, hdr, sizeof hdr) != 0)
            break;
        for (uint64_t i = 0; i < hdr[0]; i++)
            if (recv_all(x->fd, x->dst + i * hdr[1], (size_t)hdr[1]) != 0) {
                x->failures++;
                return NULL;
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

static int run_raw(int fd, const uint8_t *src, uint32_t n, double seconds, uint64_t block_bytes,
                   double *lat, result_t *res)
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
        for (uint32_t b = 0; b < n; b++)
            if (send_all(fd, src + (uint64_t)b * block_bytes, (size_t)block_bytes) != 0)
                return -1;
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

/* The command line. */
typedef struct kvb_opts {
    double seconds; /* per size */
    const char *json_path;
    uint32_t only_blocks; /* --blocks N: one size only (profiling); 0 = 1, 32 and 256 */
    int rounds;           /* --rounds R: raw/tandem alternations per size */
    bool malloc_tuning;
    bool curve; /* --curve: the KV channel with CURVE */
} kvb_opts_t;

/* Everything a run holds; kvb_close releases what was set up, in reverse order. */
typedef struct kvb {
    tdm_net_t *net;
    tdm_kv_pool_t *spool, *rpool; /* sender's and receiver's pools, POOL_BLOCKS each */
    tdm_kv_seq_t sseq;            /* the sender's POOL_BLOCKS reserved blocks */
    uint64_t bb;                  /* bytes per block */
    double *lat;                  /* [MAX_SAMPLES] latency scratch, seconds */
    tdm_logger_t log;
    rx_t rx;
    tdm_kv_sender_t *s;
    char ep[256]; /* the receiver's endpoint */
    pthread_t rx_th, raw_th;
    bool rx_running, raw_running;
    raw_t raw;
    int raw_fd;
} kvb_t;

/* Parses the command line into *o. Returns 0 to go on, or 2 after printing the usage. */
static int parse_args(int argc, char **argv, kvb_opts_t *o)
{
    static const struct option longopts[] = {{"seconds", required_argument, NULL, 's'},
                                             {"json", required_argument, NULL, 'j'},
                                             {"blocks", required_argument, NULL, 'b'},
                                             {"no-malloc-tuning", no_argument, NULL, 'n'},
                                             {"rounds", required_argument, NULL, 'r'},
                                             {"curve", no_argument, NULL, 'c'},
                                             {NULL, 0, NULL, 0}};
    *o = (kvb_opts_t){.seconds = 1.0, .rounds = 5, .malloc_tuning = true};
    int opt;
    while ((opt = getopt_long(argc, argv, "s:j:b:nr:c", longopts, NULL)) != -1) {
        switch (opt) {
        case 's': o->seconds = atof(optarg); break;
        case 'j': o->json_path = optarg; break;
        case 'b': o->only_blocks = (uint32_t)atoi(optarg); break;
        case 'n': o->malloc_tuning = false; break;
        case 'r': o->rounds = atoi(optarg); break;
        case 'c': o->curve = true; break;
        default:
            fprintf(stderr, "usage: tandem-bench-kv-transfer [--seconds S] [--json FILE] "
                            "[--blocks N] [--rounds R] [--curve] [--no-malloc-tuning]\n");
            return 2;
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
    k->net = tdm_net_new(2, &err);
    k->spool = k->net ? tdm_kv_pool_new(&smollm2, POOL_BLOCKS, &err) : NULL;
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

/* Starts the receiver on its own thread and the sender, then the raw TCP pair. Returns 0, or
 * 1 after printing why. */
static int kvb_open_links(kvb_t *k, bool curve)
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
    k->rx.r = tdm_kv_receiver_new(k->net, k->rpool, &ro, &err);
    tdm_kv_sender_opts_t so = {.node_id = "bench-prefill",
                               .model_fingerprint = FINGERPRINT,
                               .backend = TDM_KV_BACKEND_TCP,
                               .curve = curve ? &client : NULL,
                               .log = &k->log};
    k->s = k->rx.r ? tdm_kv_sender_new(k->net, k->spool, &so, &err) : NULL;
    if (!k->s) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 1;
    }
    snprintf(k->ep, sizeof k->ep, "%s", tdm_kv_receiver_endpoint(k->rx.r));
    atomic_init(&k->rx.stop, false);
    /* the receiver's socket moves to that thread */
    k->rx_running = pthread_create(&k->rx_th, NULL, rx_main, &k->rx) == 0;
    k->raw.dst = tdm_kv_pool_base(k->rpool);
    k->raw_fd = raw_connect(&k->raw, &k->raw_th);
    k->raw_running = k->raw_fd >= 0;
    if (k->raw_fd < 0) {
        fprintf(stderr, "bench: raw TCP set-up failed: %s\n", strerror(errno));
        return 1;
    }
    return 0;
}

static void kvb_close(kvb_t *k)
{
    if (k->raw_running) {
        shutdown(k->raw_fd, SHUT_RDWR);
        close(k->raw_fd);
        pthread_join(k->raw_th, NULL);
        close(k->raw.listen_fd);
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
    tdm_net_destroy(&k->net);
    free(k->lat);
}

/* The table, to stderr; returns the smallest tandem/raw ratio. */
static double print_table(const kvb_t *k, const kvb_opts_t *o, const uint32_t *sizes, int n_sizes,
                          const result_t *tandem, const result_t *rawr)
{
    fprintf(stderr,
            "KV transfer, SmolLM2-135M f16 layout (%" PRIu64 " B/block), loopback TCP%s, "
            "%.1f s per size in %d rounds (median round shown), malloc %s\n",
            k->bb, o->curve ? ", KV channel with CURVE" : "", o->seconds, o->rounds,
            o->malloc_tuning ? "tuned" : "defaults");
    fprintf(stderr, "%7s %12s | %9s %9s %9s %7s | %9s %9s %9s %7s | %6s\n", "blocks", "bytes",
            "tdm GB/s", "p50 ms", "p99 ms", "cpu s/GB", "raw GB/s", "p50 ms", "p99 ms", "cpu s/GB",
            "ratio");
    double min_ratio = 1e9;
    for (int i = 0; i < n_sizes; i++) {
        double ratio = tandem[i].gbps / rawr[i].gbps;
        if (ratio < min_ratio)
            min_ratio = ratio;
        fprintf(stderr,
                "%7u %12" PRIu64 " | %9.2f %9.3f %9.3f %8.3f | %9.2f %9.3f %9.3f %8.3f | %5.2fx\n",
                sizes[i], (uint64_t)sizes[i] * k->bb, tandem[i].gbps, tandem[i].p50_ms,
                tandem[i].p99_ms, tandem[i].cpu_s_per_gb, rawr[i].gbps, rawr[i].p50_ms,
                rawr[i].p99_ms, rawr[i].cpu_s_per_gb, ratio);
        fprintf(stderr, "%7s rounds:", "");
        for (int r = 0; r < tandem[i].n_rounds; r++)
            fprintf(stderr, " %.2f", tandem[i].ratios[r]);
        fprintf(stderr, "\n");
    }
    return min_ratio;
}

/* One JSON line, to stdout or --json FILE. Returns 0, or 1 when the file cannot be written. */
static int write_json(const kvb_t *k, const kvb_opts_t *o, const uint32_t *sizes, int n_sizes,
                      const result_t *tandem, const result_t *rawr, double min_ratio)
{
    FILE *out = o->json_path ? fopen(o->json_path, "w") : stdout;
    if (!out) {
        fprintf(stderr, "bench: cannot write %s\n", o->json_path);
        return 1;
    }
    fprintf(out,
            "{\"bench\":\"kv_transfer\",\"transport\":\"tcp-loopback\",\"layout\":"
            "\"smollm2-135m-f16\",\"block_bytes\":%" PRIu64 ",\"malloc_tuned\":%s,\"curve\":%s,"
            "\"results\":[",
            k->bb, o->malloc_tuning ? "true" : "false", o->curve ? "true" : "false");
    for (int i = 0; i < n_sizes; i++) {
        fprintf(
            out,
            "%s{\"blocks\":%u,\"bytes\":%" PRIu64 ",\"n\":%d,\"gbps\":%.4f,\"p50_ms\":%.4f,"
            "\"p99_ms\":%.4f,\"raw_n\":%d,\"raw_gbps\":%.4f,\"raw_p50_ms\":%.4f,"
            "\"raw_p99_ms\":%.4f,\"ratio\":%.4f,\"cpu_s_per_gb\":%.4f,\"raw_cpu_s_per_gb\":%.4f",
            i ? "," : "", sizes[i], (uint64_t)sizes[i] * k->bb, tandem[i].n, tandem[i].gbps,
            tandem[i].p50_ms, tandem[i].p99_ms, rawr[i].n, rawr[i].gbps, rawr[i].p50_ms,
            rawr[i].p99_ms, tandem[i].gbps / rawr[i].gbps, tandem[i].cpu_s_per_gb,
            rawr[i].cpu_s_per_gb);
        for (int r = 0; r < tandem[i].n_rounds; r++)
            fprintf(out, "%s%.4f", r ? "," : ",\"round_ratios\":[", tandem[i].ratios[r]);
        fprintf(out, "]}");
    }
    fprintf(out, "],\"min_ratio\":%.4f,\"target_ratio\":0.9}\n", min_ratio);
    if (o->json_path)
        fclose(out);
    return 0;
}

/* User + system CPU seconds of the whole process so far. */
static double cpu_now(void)
{
    struct rusage u;
    getrusage(RUSAGE_SELF, &u);
    return (double)u.ru_utime.tv_sec + u.ru_utime.tv_usec / 1e6 + (double)u.ru_stime.tv_sec +
           u.ru_stime.tv_usec / 1e6;
}

/* Measures n blocks in o->rounds rounds of raw then tandem; *tandem and *rawr get the round
 * with the median ratio, tandem->ratios every round's. Returns 0 or -1. */
static int run_size(kvb_t *k, const kvb_opts_t *o, uint32_t n, result_t *tandem, result_t *rawr)
{
    result_t t[MAX_ROUNDS], w[MAX_ROUNDS];
    double sorted[MAX_ROUNDS];
    double secs = o->seconds / o->rounds;
    for (int r = 0; r < o->rounds; r++) {
        /* The sender's blocks: the first n of its reservation (contiguous ids in practice). */
        double c0 = cpu_now();
        if (run_raw(k->raw_fd, tdm_kv_pool_base(k->spool), n, secs, k->bb, k->lat, &w[r]) != 0)
            return -1;
        double c1 = cpu_now();
        if (run_tandem(k->s, k->ep, k->sseq.blocks, n, secs, k->bb, k->lat, &t[r]) != 0)
            return -1;
        double c2 = cpu_now();
        /* the 3 warm-up transfers are in the CPU time: count their bytes too */
        w[r].cpu_s_per_gb = (c1 - c0) / ((w[r].n + 3) * (double)n * (double)k->bb / 1e9);
        t[r].cpu_s_per_gb = (c2 - c1) / ((t[r].n + 3) * (double)n * (double)k->bb / 1e9);
        sorted[r] = t[r].gbps / w[r].gbps;
    }
    double ratios[MAX_ROUNDS];
    memcpy(ratios, sorted, sizeof ratios);
    double median = percentile(sorted, o->rounds, 50);
    int m = 0;
    while (m < o->rounds - 1 && ratios[m] != median)
        m++;
    *tandem = t[m];
    *rawr = w[m];
    tandem->n_rounds = o->rounds;
    memcpy(tandem->ratios, ratios, sizeof ratios);
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
    result_t tandem[3], rawr[3];
    for (int i = 0; i < n_sizes; i++) {
        if (run_size(k, o, sizes[i], &tandem[i], &rawr[i]) != 0) {
            fprintf(stderr, "bench: run of %u blocks failed\n", sizes[i]);
            return 1;
        }
    }
    double min_ratio = print_table(k, o, sizes, n_sizes, tandem, rawr);
    if (write_json(k, o, sizes, n_sizes, tandem, rawr, min_ratio) != 0)
        return 1;
    return 0;
}

int main(int argc, char **argv)
{
    kvb_opts_t o;
    if (parse_args(argc, argv, &o) != 0)
        return 2;
    kvb_t k = {.raw_fd = -1};
    tdm_kv_seq_init(&k.sseq);
    tdm_kv_seq_init(&k.rx.seq);
    int rc = kvb_open_pools(&k);
    if (rc == 0)
        rc = kvb_open_links(&k, o.curve);
    if (rc == 0)
        rc = kvb_run(&k, &o);
    kvb_close(&k);
    if (rc == 0 && (k.rx.failures || k.raw.failures))
        rc = 1;
    return rc;
}
