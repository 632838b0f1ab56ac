/* bench_util.h - small helpers the benchmarks share (bench_util.c). */
#ifndef TANDEM_BENCH_UTIL_H
#define TANDEM_BENCH_UTIL_H

#include <stddef.h>

/* The CPU's model name from /proc/cpuinfo ("model name") into out[cap], or "unknown". */
void bench_cpu_model(char *out, size_t cap);

#endif
