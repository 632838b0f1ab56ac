/* fatal.c - a logfmt line and a backtrace when a daemon dies of a fatal signal (log.h:
 * tdm_log_fatal_signals). Everything the handler does is async-signal-safe (POSIX.1-2017
 * 2.4.3): write(2), clock_gettime(2), getpid(2), sigaction(2), raise(3), fixed buffers and
 * integer formatting; glibc's backtrace_symbols_fd writes without allocating once
 * backtrace() has loaded libgcc's unwinder, which the installer does beforehand. */
#define _GNU_SOURCE
#include <execinfo.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tandem/log.h"

static char g_node[64];       /* the logger's node id, "-" for none */
static char g_process[64];    /* "tandem-router", ... */
static int g_fd = 2;          /* the logger's stream's descriptor */
static char g_altstack[65536] /* a stack overflow's SIGSEGV needs a stack of its own */
    __attribute__((aligned(16)));

static const struct {
    int sig;
    const char *name;
} k_fatal[] = {{SIGSEGV, "SIGSEGV"},
               {SIGBUS, "SIGBUS"},
               {SIGILL, "SIGILL"},
               {SIGFPE, "SIGFPE"},
               {SIGABRT, "SIGABRT"}};

/* Appends s to b (cap bytes, *n used); silently stops at cap - 1. */
static void put(char *b, size_t cap, size_t *n, const char *s)
{
    while (*s && *n + 1 < cap)
        b[(*n)++] = *s++;
}

/* Appends v in decimal, zero-padded to width digits. */
static void put_u(char *b, size_t cap, size_t *n, uint64_t v, int width)
{
    char d[24];
    int k = 0;
    do {
        d[k++] = (char)('0' + v % 10);
        v /= 10;
    } while (v && k < 20);
    while (k < width && k < 20)
        d[k++] = '0';
    while (k > 0 && *n + 1 < cap)
        b[(*n)++] = d[--k];
}

/* Appends v as 0x... hexadecimal. */
static void put_x(char *b, size_t cap, size_t *n, uintptr_t v)
{
    char d[2 * sizeof v];
    int k = 0;
    do {
        d[k++] = "0123456789abcdef"[v & 15];
        v >>= 4;
    } while (v && k < (int)sizeof d);
    put(b, cap, n, "0x");
    while (k > 0 && *n + 1 < cap)
        b[(*n)++] = d[--k];
}

/* Appends the UTC time as log.c's ts= value: 2026-12-05T21:30:00.123Z (the civil date from the
 * day count: H. Hinnant, "chrono-Compatible Low-Level Date Algorithms", days_from_civil's
 * inverse). */
static void put_ts(char *b, size_t cap, size_t *n)
{
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    int64_t days = t.tv_sec / 86400, sec = t.tv_sec % 86400;
    int64_t z = days + 719468, era = (z >= 0 ? z : z - 146096) / 146097;
    int64_t doe = z - era * 146097;
    int64_t yoe = (doe - doe / 1460 + doe / 36524 - doe / 146096) / 365;
    int64_t doy = doe - (365 * yoe + yoe / 4 - yoe / 100), mp = (5 * doy + 2) / 153;
    int64_t d = doy - (153 * mp + 2) / 5 + 1, m = mp < 10 ? mp + 3 : mp - 9;
    int64_t y = yoe + era * 400 + (m <= 2);
    put_u(b, cap, n, (uint64_t)y, 4);
    put(b, cap, n, "-");
    put_u(b, cap, n, (uint64_t)m, 2);
    put(b, cap, n, "-");
    put_u(b, cap, n, (uint64_t)d, 2);
    put(b, cap, n, "T");
    put_u(b, cap, n, (uint64_t)(sec / 3600), 2);
    put(b, cap, n, ":");
    put_u(b, cap, n, (uint64_t)(sec / 60 % 60), 2);
    put(b, cap, n, ":");
    put_u(b, cap, n, (uint64_t)(sec % 60), 2);
    put(b, cap, n, ".");
    put_u(b, cap, n, (uint64_t)(t.tv_nsec / 1000000), 3);
    put(b, cap, n, "Z");
}

static void on_fatal(int sig, siginfo_t *si, void *uctx)
{
    (void)uctx;
    const char *name = "?";
    for (size_t i = 0; i < sizeof k_fatal / sizeof k_fatal[0]; i++)
        if (k_fatal[i].sig == sig)
            name = k_fatal[i].name;
    char b[512];
    size_t n = 0;
    put(b, sizeof b, &n, "ts=");
    put_ts(b, sizeof b, &n);
    put(b, sizeof b, &n, " level=error node=");
    put(b, sizeof b, &n, g_node);
    put(b, sizeof b, &n, " msg=\"");
    put(b, sizeof b, &n, g_process);
    put(b, sizeof b, &n, " died of fatal signal ");
    put_u(b, sizeof b, &n, (uint64_t)sig, 1);
    put(b, sizeof b, &n, " (");
    put(b, sizeof b, &n, name);
    put(b, sizeof b, &n, "); backtrace follows\" signal=");
    put(b, sizeof b, &n, name);
    put(b, sizeof b, &n, " pid=");
    put_u(b, sizeof b, &n, (uint64_t)getpid(), 1);
    if (si && si->si_code <= 0) { /* sent (kill, raise, abort): by whom */
        put(b, sizeof b, &n, " from_pid=");
        put_u(b, sizeof b, &n, (uint64_t)si->si_pid, 1);
    } else if (si) { /* the kernel's: the faulting address */
        put(b, sizeof b, &n, " addr=");
        put_x(b, sizeof b, &n, (uintptr_t)si->si_addr);
    }
    put(b, sizeof b, &n, "\n");
    ssize_t w = write(g_fd, b, n);
    void *frames[64];
    int nf = backtrace(frames, 64);
    backtrace_symbols_fd(frames, nf, g_fd);
    (void)w;
    /* SA_RESETHAND put the default action back: dying of sig keeps the exit status and core
     * dump a service manager expects */
    raise(sig);
}

void tdm_log_fatal_signals(const tdm_logger_t *lg, const char *process)
{
    const char *node = lg && lg->node[0] ? lg->node : "-";
    size_t len = strlen(node) < sizeof g_node - 1 ? strlen(node) : sizeof g_node - 1;
    memcpy(g_node, node, len);
    g_node[len] = '\0';
    process = process ? process : "process";
    len = strlen(process) < sizeof g_process - 1 ? strlen(process) : sizeof g_process - 1;
    memcpy(g_process, process, len);
    g_process[len] = '\0';
    g_fd = fileno(lg && lg->out ? lg->out : stderr);
    void *warm[1];
    (void)backtrace(warm, 1); /* loads the unwinder now, not in the handler */
    stack_t ss = {.ss_sp = g_altstack, .ss_size = sizeof g_altstack, .ss_flags = 0};
    sigaltstack(&ss, NULL);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fatal;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK | SA_RESETHAND | SA_NODEFER;
    sigemptyset(&sa.sa_mask);
    for (size_t i = 0; i < sizeof k_fatal / sizeof k_fatal[0]; i++)
        sigaction(k_fatal[i].sig, &sa, NULL);
}
