/* bench_peak.h - the CPU's int8 dot-product peak per instruction family (bench_peak.c), for
 * tandem-bench-engine --peak. */
#ifndef TANDEM_BENCH_PEAK_H
#define TANDEM_BENCH_PEAK_H

#include <stdbool.h>
#include <stddef.h>

#define TDM_PEAK_FAMILIES 4 /* avx2, vnni, avx512, amx: TANDEM_CPU_KERNELS's names */

typedef struct tdm_peak {
    const char *family; /* TANDEM_CPU_KERNELS name: "avx2", "vnni", "avx512", "amx" */
    const char *insn;   /* the instructions measured */
    bool available;     /* the CPU (and for AMX the kernel) allows it */
    int threads;        /* the thread count of ops */
    double ops_1t;      /* int8 ops/s on 1 thread (a multiply-add is 2 ops) */
    double ops;         /* int8 ops/s on `threads` threads */
} tdm_peak_t;

/* Measures each family's int8 peak on 1 and `threads` threads (OpenMP) into out[avx2, vnni,
 * avx512, amx] (about 0.5 s a family). Returns 0, or -1 off x86-64 (every family
 * unavailable). */
int tdm_bench_peak(int threads, tdm_peak_t out[TDM_PEAK_FAMILIES]);

/* OpenMP's default thread count (omp_get_max_threads), the engine's with n_threads 0. */
int tdm_bench_default_threads(void);

/* The online CPUs' SMT siblings (sysfs topology/thread_siblings_list) and the threads per
 * core they imply, as one line into buf (truncated to size). Cannot fail. */
void tdm_bench_smt(char *buf, size_t size);

#endif /* TANDEM_BENCH_PEAK_H */
