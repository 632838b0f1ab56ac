/* bench_peak.c - the CPU's int8 dot-product peak per instruction family, for
 * tandem-bench-engine --peak: the rate against which prefill's GEMMs are reported.
 *
 * Each family runs the instruction sequence Tandem's kernels of that family use, on operands in
 * registers (AMX: in tiles), with enough independent accumulators to cover the latency, so the
 * figure is the execution units' throughput:
 *   avx2:   vpmaddubsw + vpmaddwd + vpaddd (ymm): 32 u8 x s8 multiply-adds per sequence
 *   vnni:   vpdpbusd ymm (AVX-VNNI): 32 per instruction
 *   avx512: vpdpbusd zmm (AVX-512 VNNI): 64 per instruction
 *   amx:    tdpbusd on full tiles (16 x 64 bytes by 16 x 64 bytes): 16 x 16 x 64 = 16,384
 * One multiply-add counts as 2 ops. Every thread runs the same loop; the rate is the total
 * work over the wall-clock time of the parallel region (best of a few), on 1 thread and on the
 * run's thread count. A family the CPU lacks is reported as unavailable. */
#define _GNU_SOURCE /* syscall */
#include "bench_peak.h"

#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023 /* Linux: asm/prctl.h */
#define XFEATURE_XTILEDATA 18
#endif

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#if defined(__x86_64__)

/* Each loop runs `iters` iterations in inline assembly (so the compiler can neither merge the
 * identical products of the chains nor spill the accumulators) and returns 0. */

#define AVX2_ACC 6 /* accumulators ymm0-5, products ymm6-11, operands ymm13-15 */
#define AVX2_SEQ(acc, t)                                                                           \
    "vpmaddubsw %%ymm15, %%ymm14, %%ymm" #t "\n\t"                                                 \
    "vpmaddwd %%ymm13, %%ymm" #t ", %%ymm" #t "\n\t"                                               \
    "vpaddd %%ymm" #t ", %%ymm" #acc ", %%ymm" #acc "\n\t"
__attribute__((target("avx2"))) static int loop_avx2(long iters)
{
    __asm__ volatile("vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
                     "vpxor %%xmm1, %%xmm1, %%xmm1\n\t"
                     "vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
                     "vpxor %%xmm3, %%xmm3, %%xmm3\n\t"
                     "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
                     "vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
                     "vpcmpeqb %%ymm14, %%ymm14, %%ymm14\n\t"
                     "vpabsb %%ymm14, %%ymm15\n\t"
                     "vpabsw %%ymm14, %%ymm13\n\t"
                     "1:\n\t" AVX2_SEQ(0, 6) AVX2_SEQ(1, 7) AVX2_SEQ(2, 8) AVX2_SEQ(3, 9)
                         AVX2_SEQ(4, 10) AVX2_SEQ(5, 11) "dec %0\n\t"
                                                         "jnz 1b\n\t"
                     : "+r"(iters)
                     :
                     : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
                       "xmm9", "xmm10", "xmm11", "xmm13", "xmm14", "xmm15");
    return 0;
}

#define VNNI_ACC 12 /* accumulators ymm0-11, operands ymm14-15 */
#define VNNI_DP(acc) "%{vex%} vpdpbusd %%ymm15, %%ymm14, %%ymm" #acc "\n\t"
__attribute__((target("avx2,avxvnni"))) static int loop_vnni(long iters)
{
    __asm__ volatile("vpxor %%xmm0, %%xmm0, %%xmm0\n\t"
                     "vpxor %%xmm1, %%xmm1, %%xmm1\n\t"
                     "vpxor %%xmm2, %%xmm2, %%xmm2\n\t"
                     "vpxor %%xmm3, %%xmm3, %%xmm3\n\t"
                     "vpxor %%xmm4, %%xmm4, %%xmm4\n\t"
                     "vpxor %%xmm5, %%xmm5, %%xmm5\n\t"
                     "vpxor %%xmm6, %%xmm6, %%xmm6\n\t"
                     "vpxor %%xmm7, %%xmm7, %%xmm7\n\t"
                     "vpxor %%xmm8, %%xmm8, %%xmm8\n\t"
                     "vpxor %%xmm9, %%xmm9, %%xmm9\n\t"
                     "vpxor %%xmm10, %%xmm10, %%xmm10\n\t"
                     "vpxor %%xmm11, %%xmm11, %%xmm11\n\t"
                     "vpcmpeqb %%ymm14, %%ymm14, %%ymm14\n\t"
                     "vpabsb %%ymm14, %%ymm15\n\t"
                     "1:\n\t" VNNI_DP(0) VNNI_DP(1) VNNI_DP(2) VNNI_DP(3) VNNI_DP(4) VNNI_DP(5)
                         VNNI_DP(6) VNNI_DP(7) VNNI_DP(8) VNNI_DP(9) VNNI_DP(10)
                             VNNI_DP(11) "dec %0\n\t"
                                         "jnz 1b\n\t"
                     : "+r"(iters)
                     :
                     : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8",
                       "xmm9", "xmm10", "xmm11", "xmm14", "xmm15");
    return 0;
}

#define Z_ACC 16 /* accumulators zmm0-15, operands zmm30-31 */
#define Z_DP(acc) "vpdpbusd %%zmm31, %%zmm30, %%zmm" #acc "\n\t"
__attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni"))) static int loop_avx512(long iters)
{
    __asm__ volatile(
        "vpxord %%zmm0, %%zmm0, %%zmm0\n\t"
        "vpxord %%zmm1, %%zmm1, %%zmm1\n\t"
        "vpxord %%zmm2, %%zmm2, %%zmm2\n\t"
        "vpxord %%zmm3, %%zmm3, %%zmm3\n\t"
        "vpxord %%zmm4, %%zmm4, %%zmm4\n\t"
        "vpxord %%zmm5, %%zmm5, %%zmm5\n\t"
        "vpxord %%zmm6, %%zmm6, %%zmm6\n\t"
        "vpxord %%zmm7, %%zmm7, %%zmm7\n\t"
        "vpxord %%zmm8, %%zmm8, %%zmm8\n\t"
        "vpxord %%zmm9, %%zmm9, %%zmm9\n\t"
        "vpxord %%zmm10, %%zmm10, %%zmm10\n\t"
        "vpxord %%zmm11, %%zmm11, %%zmm11\n\t"
        "vpxord %%zmm12, %%zmm12, %%zmm12\n\t"
        "vpxord %%zmm13, %%zmm13, %%zmm13\n\t"
        "vpxord %%zmm14, %%zmm14, %%zmm14\n\t"
        "vpxord %%zmm15, %%zmm15, %%zmm15\n\t"
        "vpternlogd $0xff, %%zmm30, %%zmm30, %%zmm30\n\t"
        "vpabsb %%zmm30, %%zmm31\n\t"
        "1:\n\t" Z_DP(0) Z_DP(1) Z_DP(2) Z_DP(3) Z_DP(4) Z_DP(5) Z_DP(6) Z_DP(7) Z_DP(8) Z_DP(9)
            Z_DP(10) Z_DP(11) Z_DP(12) Z_DP(13) Z_DP(14) Z_DP(15) "dec %0\n\t"
                                                                  "jnz 1b\n\t"
        : "+r"(iters)
        :
        : "cc", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
          "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15", "xmm30", "xmm31");
    return 0;
}

/* The LDTILECFG operand (palette 1). */
typedef struct peak_tilecfg {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} peak_tilecfg_t;

/* Tiles 0-3: int32 results (16 x 16); 4, 5: A (16 rows x 64 u8); 6, 7: B (16 rows of 4-byte
 * groups x 16 columns). Four independent multiplies an iteration, each 16 x 16 x 64. */
__attribute__((target("amx-tile,amx-int8"))) static int loop_amx(long iters)
{
    static __thread uint8_t src[16 * 64] __attribute__((aligned(64)));
    static __thread int32_t dst[16 * 16] __attribute__((aligned(64)));
    memset(src, 1, sizeof src);
    peak_tilecfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 8; t++) {
        c.rows[t] = 16;
        c.colsb[t] = 64;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(c));
    __asm__ volatile("tilezero %%tmm0\n\ttilezero %%tmm1\n\ttilezero %%tmm2\n\ttilezero %%tmm3" ::);
    __asm__ volatile("tileloadd (%1,%2,1), %%tmm4\n\t"
                     "tileloadd (%1,%2,1), %%tmm5\n\t"
                     "tileloadd (%1,%2,1), %%tmm6\n\t"
                     "tileloadd (%1,%2,1), %%tmm7" ::"m"(src),
                     "r"((const void *)src), "r"(64L));
    for (long it = 0; it < iters; it++)
        __asm__ volatile("tdpbusd %%tmm6, %%tmm4, %%tmm0\n\t"
                         "tdpbusd %%tmm7, %%tmm4, %%tmm1\n\t"
                         "tdpbusd %%tmm6, %%tmm5, %%tmm2\n\t"
                         "tdpbusd %%tmm7, %%tmm5, %%tmm3" ::);
    __asm__ volatile("tilestored %%tmm0, (%1,%2,1)" : "+m"(dst) : "r"((void *)dst), "r"(64L));
    __asm__ volatile("tilerelease" ::);
    return dst[0];
}

static bool has_amx(void)
{
    unsigned a, b, c, d;
    return __get_cpuid_count(7, 0, &a, &b, &c, &d) && (d >> 24 & 1) && (d >> 25 & 1) &&
           syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

typedef int (*peak_loop_fn)(long iters);

static volatile int peak_sink; /* the loops' results land here */

/* Int8 ops/s of `loop` on `threads` threads: macs multiply-adds an iteration, best of 3 runs
 * of `iters` iterations on each thread, after one warm-up run (which also lets the clock
 * settle at the frequency this instruction mix runs at). */
static double peak_rate(peak_loop_fn loop, double macs, long iters, int threads)
{
    double best = 0;
    for (int r = 0; r < 4; r++) {
        double t0 = now_s();
#pragma omp parallel num_threads(threads)
        {
            int v = loop(iters);
#pragma omp atomic
            peak_sink += v;
        }
        double dt = now_s() - t0, rate = 2.0 * macs * (double)iters * threads / dt;
        if (r > 0 && rate > best)
            best = rate;
    }
    return best;
}
#endif /* __x86_64__ */

int tdm_bench_peak(int threads, tdm_peak_t out[TDM_PEAK_FAMILIES])
{
    static const char *const names[TDM_PEAK_FAMILIES] = {"avx2", "vnni", "avx512", "amx"};
    static const char *const insns[TDM_PEAK_FAMILIES] = {
        "vpmaddubsw+vpmaddwd+vpaddd ymm", "vpdpbusd ymm (AVX-VNNI)", "vpdpbusd zmm (AVX-512 VNNI)",
        "tdpbusd (AMX-INT8)"};
    memset(out, 0, sizeof(tdm_peak_t) * TDM_PEAK_FAMILIES);
    for (int f = 0; f < TDM_PEAK_FAMILIES; f++) {
        out[f].family = names[f];
        out[f].insn = insns[f];
        out[f].threads = threads;
    }
#if defined(__x86_64__)
    __builtin_cpu_init();
    bool have[TDM_PEAK_FAMILIES] = {
        __builtin_cpu_supports("avx2"), __builtin_cpu_supports("avxvnni"),
        __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
            __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni"),
        has_amx()};
    static const peak_loop_fn loops[TDM_PEAK_FAMILIES] = {loop_avx2, loop_vnni, loop_avx512,
                                                          loop_amx};
    /* multiply-adds an iteration; iterations per run (about 0.1 s at a few GHz) */
    static const double macs[TDM_PEAK_FAMILIES] = {32.0 * AVX2_ACC, 32.0 * VNNI_ACC, 64.0 * Z_ACC,
                                                   4.0 * 16384};
    static const long iters[TDM_PEAK_FAMILIES] = {20000000, 20000000, 10000000, 1000000};
    for (int f = 0; f < TDM_PEAK_FAMILIES; f++) {
        out[f].available = have[f];
        if (!have[f])
            continue;
        out[f].ops_1t = peak_rate(loops[f], macs[f], iters[f], 1);
        out[f].ops = threads > 1 ? peak_rate(loops[f], macs[f], iters[f], threads) : out[f].ops_1t;
    }
    return 0;
#else
    return -1;
#endif
}

int tdm_bench_default_threads(void)
{
    return omp_get_max_threads();
}

void tdm_bench_smt(char *buf, size_t size)
{
    /* the first line of each online CPU's thread_siblings_list, joined with ';' */
    size_t len = 0;
    buf[0] = 0;
    int threads_per_core = 1;
    for (int cpu = 0; cpu < 1024; cpu++) {
        char path[96], line[64];
        snprintf(path, sizeof path, "/sys/devices/system/cpu/cpu%d/topology/thread_siblings_list",
                 cpu);
        FILE *f = fopen(path, "r");
        if (!f)
            break;
        if (!fgets(line, sizeof line, f))
            line[0] = 0;
        fclose(f);
        line[strcspn(line, "\n")] = 0;
        int n = 1;
        for (const char *p = line; *p; p++)
            n += *p == ',' || *p == '-'; /* "0,1" or "0-1": two threads */
        threads_per_core = n > threads_per_core ? n : threads_per_core;
        int w = snprintf(buf + len, size - len, "%scpu%d:%s", cpu ? " " : "", cpu, line);
        if (w < 0 || (size_t)w >= size - len)
            break;
        len += (size_t)w;
    }
    size_t w =
        (size_t)snprintf(buf + len, size - len, " (threads per core: %d, %s)", threads_per_core,
                         threads_per_core > 1 ? "SMT siblings share a core"
                                              : "no SMT siblings: each vCPU its own core");
    (void)w;
}
