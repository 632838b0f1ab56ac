/* log.h - logfmt logging: one line per event, `ts=… level=… node=… req=… msg=… key=value`.
 *
 * A logger is a small value owned by whoever runs a node (no global state), so several nodes
 * in one process log under their own names. Lines go to the logger's stream (stderr by
 * default) with a single fwrite, so lines from different threads never interleave.
 * Format reference: https://brandur.org/logfmt (key=value pairs, values with spaces quoted).
 */
#ifndef TANDEM_LOG_H
#define TANDEM_LOG_H

#include <stdio.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum tdm_log_level {
    TDM_LOG_DEBUG = 0,
    TDM_LOG_INFO = 1,
    TDM_LOG_WARN = 2,
    TDM_LOG_ERROR = 3,
    TDM_LOG_OFF = 4,
} tdm_log_level_t;

typedef struct tdm_logger {
    tdm_log_level_t level; /* lines below this level are dropped */
    char node[64];         /* node id printed as node=…; "" prints node=- */
    FILE *out;             /* NULL means stderr */
} tdm_logger_t;

/* Initialises a logger at level INFO writing to stderr under the given node id (NULL or ""
 * for none). Cannot fail; a node id longer than 63 bytes is truncated. */
void tdm_log_init(tdm_logger_t *lg, const char *node);

/* Parses "debug", "info", "warn"/"warning", "error", "off"; returns the level or -1. */
int tdm_log_level_parse(const char *name);

/* Name of a level ("info"); "?" for an unknown value. */
const char *tdm_log_level_name(tdm_log_level_t level);

/* Writes one line when level >= lg->level. req is the request id (NULL for none). msg is a
 * printf format; the formatted message is quoted and escaped as logfmt requires. `kv`, when
 * not NULL, is appended verbatim after msg and must already be logfmt (`a=1 b="x y"`).
 * lg may be NULL (INFO to stderr, node=-). Cannot fail (a line longer than 4 KiB is cut). */
void tdm_log_write(const tdm_logger_t *lg, tdm_log_level_t level, const char *req, const char *kv,
                   const char *fmt, ...) __attribute__((format(printf, 5, 6)));

#define TDM_LOG_DEBUGF(lg, req, ...) tdm_log_write((lg), TDM_LOG_DEBUG, (req), NULL, __VA_ARGS__)
#define TDM_LOG_INFOF(lg, req, ...) tdm_log_write((lg), TDM_LOG_INFO, (req), NULL, __VA_ARGS__)
#define TDM_LOG_WARNF(lg, req, ...) tdm_log_write((lg), TDM_LOG_WARN, (req), NULL, __VA_ARGS__)
#define TDM_LOG_ERRORF(lg, req, ...) tdm_log_write((lg), TDM_LOG_ERROR, (req), NULL, __VA_ARGS__)

/* Makes a fatal signal (SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT) in this process write one
 * logfmt line to lg's stream before the process dies of it: `level=error node=ID msg="PROCESS
 * died of fatal signal 11 (SIGSEGV); backtrace follows" signal=SIGSEGV pid=N addr=0x...` (the
 * faulting address; `from_pid=P` instead for a signal another process or abort(3) sent), then
 * the backtrace (glibc backtrace_symbols_fd, one frame a line), then the signal's default
 * action (exit status and core dump unchanged). The handler runs on an alternate stack (a
 * stack overflow is logged too) and only async-signal-safe calls. Process-wide: the last call
 * wins; the daemons call it once at start. SIGKILL cannot be caught: an OOM kill leaves only
 * the kernel's log. */
void tdm_log_fatal_signals(const tdm_logger_t *lg, const char *process);

/* Appends `key=value` to buf (of size cap, holding a NUL-terminated string), quoting and
 * escaping value when it contains spaces, quotes, '=' or control bytes. Returns the new
 * length, or -1 when it did not fit (buf is left unchanged). */
int tdm_log_kv_append(char *buf, size_t cap, const char *key, const char *value);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_LOG_H */
