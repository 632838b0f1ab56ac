/* process.h - this process's resource figures from /proc/self (Linux), for the metrics: the
 * router exports its own as process_*, the nodes send theirs in heartbeats (protocol 1.6).
 */
#ifndef TANDEM_PROCESS_H
#define TANDEM_PROCESS_H

#include <stdbool.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tdm_process_stats {
    uint64_t resident_bytes; /* resident set size */
    double cpu_seconds;      /* user + system CPU time */
    double start_time_s;     /* start, seconds since the Unix epoch */
    uint32_t open_fds;       /* open file descriptors */
    uint64_t max_fds;        /* RLIMIT_NOFILE's soft limit (0: unknown) */
} tdm_process_stats_t;

/* Fills *out from /proc/self/stat and /proc/self/fd. Returns false (and *out zeroed) when
 * /proc cannot be read. Thread-safe; a few system calls, not for a hot path. */
bool tdm_process_stats(tdm_process_stats_t *out);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_PROCESS_H */
