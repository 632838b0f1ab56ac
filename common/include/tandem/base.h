/* base.h - status codes, error messages and small checked helpers used by every module.
 *
 * Status codes mirror gRPC's (and so the wire protocol's): an action function returns 0
 * (TDM_OK) or the negated gRPC code, so `-rc` is the code on the wire. Objects and calls that
 * can fail for reasons worth telling keep a detailed message in a tdm_error_t.
 */
#ifndef TANDEM_BASE_H
#define TANDEM_BASE_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tandem/limits.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Status codes: 0 or minus the gRPC status code (grpc/status.h numbering). */
typedef enum tdm_status {
    TDM_OK = 0,
    TDM_ECANCELLED = -1,        /* the caller cancelled */
    TDM_EINVALID = -3,          /* INVALID_ARGUMENT: bad input (field, file, config) */
    TDM_EDEADLINE = -4,         /* DEADLINE_EXCEEDED */
    TDM_ENOTFOUND = -5,         /* NOT_FOUND: file, key, request id */
    TDM_ERESOURCE = -8,         /* RESOURCE_EXHAUSTED: memory, KV blocks, queue */
    TDM_EPRECONDITION = -9,     /* FAILED_PRECONDITION: wrong state, incompatible peer */
    TDM_EINTERNAL = -13,        /* INTERNAL: a bug or an unexpected system failure */
    TDM_EUNAVAILABLE = -14,     /* UNAVAILABLE: peer down, I/O error; may be retried */
    TDM_EUNAUTHENTICATED = -16, /* UNAUTHENTICATED: missing or wrong API key / CURVE key */
} tdm_status_t;

/* Everything a status means outside the process, one row per gRPC code (DESIGN.md "Status
 * codes"): its wire name, its text, and how the HTTP gateway and the router's retry logic treat
 * it. The one table that maps statuses: nothing else switches on a status to name or place it. */
typedef struct tdm_status_row {
    int code;             /* TDM_OK or minus a gRPC code */
    const char *name;     /* gRPC name: "INVALID_ARGUMENT"; the status label of metrics and logs */
    const char *text;     /* human-readable text: "invalid argument" (tdm_strerror) */
    unsigned http_status; /* the HTTP gateway's reply status: 400 */
    const char *oai_type; /* OpenAI error.type: "invalid_request_error" */
    const char *oai_code; /* OpenAI error.code when the reply names no more precise one */
    bool retryable;       /* a node refusing work with it may take it later; another node may
                           * take it now (the router tries one) */
    bool server_fault;    /* a node reporting it for a request the router validated keeps it;
                           * any other status from a node is the cluster's fault (INTERNAL) */
} tdm_status_row_t;

/* The row of a status code, 0 or minus any gRPC code; codes outside gRPC's get UNKNOWN's row
 * (HTTP 500, server_error). Never NULL, cannot fail. */
const tdm_status_row_t *tdm_status_info(int code);

/* Human-readable text of a status code ("invalid argument"); never NULL, cannot fail. */
const char *tdm_strerror(int code);

/* The wire name of a status code, 0 or minus any gRPC code ("INVALID_ARGUMENT" for
 * TDM_EINVALID, "ABORTED" for -10): the status label of the router's metrics and logs;
 * "UNKNOWN" for codes outside gRPC's. Never NULL, cannot fail. */
const char *tdm_status_name(int code);

/* Maximum length of a detailed error message, including the terminating NUL. */
#define TDM_ERRMSG_MAX 512

/* Maximum length of an error's field path, including the terminating NUL. */
#define TDM_ERRFIELD_MAX 96

/* A status code with a detailed message and, for bad input, the field at fault. Embedded in
 * long-lived objects (their _errmsg()) or passed by callers that want the detail; every
 * function taking one accepts NULL.
 *
 * The field is a neutral path into the input the check read, set where the check happens:
 * "top_p", "sampling.top_p", "stop[1]", "chat.messages[2].content", "logit_bias[\"5\"]". A
 * message that names its field begins with that path, so a front end that calls the field
 * otherwise (OpenAI's "messages" for "chat.messages") swaps the leading path for its own name
 * and never reads the rest of the message. */
typedef struct tdm_error {
    int code;                     /* TDM_OK or a negative tdm_status_t */
    char field[TDM_ERRFIELD_MAX]; /* the path at fault; "" when no one field is */
    char msg[TDM_ERRMSG_MAX];     /* "" when code is TDM_OK */
} tdm_error_t;

/* Sets *err (when not NULL) to code and the printf-formatted message, with no field; returns
 * code, so callers can write `return tdm_error_set(err, TDM_EINVALID, "...")`. Cannot fail
 * (a long message is truncated). */
int tdm_error_set(tdm_error_t *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Like tdm_error_set, and names the field at fault (a path, see tdm_error_t; truncated at
 * TDM_ERRFIELD_MAX - 1 bytes). A message that names the field begins with field. Returns code;
 * cannot fail. */
int tdm_error_set_field(tdm_error_t *err, int code, const char *field, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* Names the field at fault of the error already in *err (the printf-formatted path), keeping
 * its code and message. Returns err->code (TDM_EINVALID when err is NULL); cannot fail. */
int tdm_error_field(tdm_error_t *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Places the error in *err inside the input member parent ("sampling"): the field becomes
 * "parent.field" ("parent" when it had none), a message that began with the old field begins
 * with the new path, any other message gets "parent: " in front. Keeps the code and returns it
 * (TDM_EINVALID when err is NULL); cannot fail (a long message is truncated). */
int tdm_error_nest(tdm_error_t *err, const char *parent);

/* Like tdm_error_set but prepends the printf-formatted context to the message already in
 * *err, separated by ": " unless the context ends with it ("loading x.gguf: " + old message);
 * keeps the code and the field. Returns err->code (or code when
 * err is NULL). */
int tdm_error_prefix(tdm_error_t *err, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Clears *err to TDM_OK with an empty message and field; accepts NULL. */
void tdm_error_clear(tdm_error_t *err);

/* Invariant check for programmer bugs only (never for input): prints the expression, file and
 * line and aborts. Input from files, the network or the GPU returns an error instead. */
#define TDM_ASSERT(cond)                                                                           \
    do {                                                                                           \
        if (!(cond))                                                                               \
            tdm_assert_fail(#cond, __FILE__, __LINE__);                                            \
    } while (0)
void tdm_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));

/* Overflow-checked size arithmetic: return true and store the result when it fits in size_t
 * (or uint64_t), false on overflow. */
static inline bool tdm_mul_size(size_t a, size_t b, size_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool tdm_add_size(size_t a, size_t b, size_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}
static inline bool tdm_mul_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_mul_overflow(a, b, out);
}
static inline bool tdm_add_u64(uint64_t a, uint64_t b, uint64_t *out)
{
    return !__builtin_add_overflow(a, b, out);
}

/* Monotonic clock in seconds (CLOCK_MONOTONIC); cannot fail. */
double tdm_time_now(void);

/* Duplicates a string; returns NULL on out of memory or when s is NULL. Caller frees. */
char *tdm_strdup(const char *s);

/* Decodes the UTF-8 character at s (n bytes left): returns its length (1..4) and sets *cp, or
 * returns 0 (n == 0, or the bytes there are not one well-formed character: RFC 3629, no
 * overlong forms, no surrogates, nothing above U+10FFFF). Cannot fail otherwise. */
size_t tdm_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp);

/* Whether code point cp is a Unicode format character (general category Cf: bidi controls
 * such as U+202E RIGHT-TO-LEFT OVERRIDE, zero-width characters such as U+200B, U+FEFF, soft
 * hyphen, tag characters): invisible, or reordering what follows, so a name holding one can
 * pass for another. Source: Unicode 15.1, UCD DerivedGeneralCategory.txt. Cannot fail. */
bool tdm_unicode_is_format(uint32_t cp);

/* Whether s is 1..max_bytes bytes of printable UTF-8: well-formed (tdm_utf8_decode), with no
 * C0 or C1 control character, no DEL and no format character (tdm_unicode_is_format). The rule for
 * an identity string that reaches a table, a log line or a status reply (a model name, a node's
 * device), so that a strict UTF-8 reader (protobuf, JSON) of those never fails. *bad_at (may be
 * NULL) is set when false: the offset of the first byte at fault, max_bytes when s is longer, 0 for
 * an empty s. Cannot fail. */
bool tdm_text_printable(const char *s, size_t max_bytes, size_t *bad_at);

/* Reads a whole file into a NUL-terminated heap buffer (the NUL is not counted in *len).
 * Caller frees *data with free(). Errors: TDM_ENOTFOUND (no such file), TDM_EINVALID (a
 * directory), TDM_EUNAVAILABLE (read error, with strerror), TDM_ERESOURCE (out of memory or
 * larger than max_bytes). */
int tdm_read_file(const char *path, size_t max_bytes, char **data, size_t *len, tdm_error_t *err);

/* A growable byte string (Redis's sds, SQLite's StrAccum): data is NUL-terminated after the
 * first successful append (the NUL is not counted in len). An append that runs out of memory
 * sets oom, leaves the content as it was and makes every later append a no-op, so a caller can
 * append many pieces and check once. Start from TDM_BUF_INIT (all zero); not thread-safe. */
typedef struct tdm_buf {
    char *data; /* NULL until the first append; caller frees with tdm_buf_free or takes it */
    size_t len; /* bytes used, without the NUL */
    size_t cap; /* bytes allocated */
    bool oom;   /* an append failed for lack of memory */
} tdm_buf_t;
#define TDM_BUF_INIT                                                                               \
    {                                                                                              \
        NULL, 0, 0, false                                                                          \
    }

/* Makes room for `more` bytes plus the NUL (capacity doubles from 64 bytes). Returns 0, or
 * TDM_ERESOURCE (out of memory or size overflow; sets oom). */
int tdm_buf_reserve(tdm_buf_t *b, size_t more);

/* Appends n bytes (which may contain NULs) / a C string / printf output. Return 0, or
 * TDM_ERESOURCE when out of memory now or earlier (the content is then unchanged). */
int tdm_buf_append(tdm_buf_t *b, const void *p, size_t n);
int tdm_buf_puts(tdm_buf_t *b, const char *s);
int tdm_buf_printf(tdm_buf_t *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int tdm_buf_vprintf(tdm_buf_t *b, const char *fmt, va_list ap)
    __attribute__((format(printf, 2, 0)));

/* Empties the string but keeps its memory (len 0, data "" when allocated, oom cleared). */
void tdm_buf_clear(tdm_buf_t *b);

/* Hands the string to the caller (who frees it with free()) and resets *b to TDM_BUF_INIT.
 * Returns NULL when an append ran out of memory (the memory is then freed) and "" (allocated)
 * for a string nothing was appended to; NULL also when that allocation fails. */
char *tdm_buf_take(tdm_buf_t *b);

/* Frees the memory and resets *b to TDM_BUF_INIT; accepts NULL. */
void tdm_buf_free(tdm_buf_t *b);

#ifdef __cplusplus
}
#endif

#endif /* TANDEM_BASE_H */
