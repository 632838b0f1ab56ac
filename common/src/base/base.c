/* base.c - status codes, error messages, checked helpers (see tandem/base.h). */
#include "tandem/base.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* One row per gRPC code (grpc/status.h), indexed by minus the code (the codes Tandem never
 * returns are here too: a peer's frame may carry one, and it reads as an internal error). HTTP
 * statuses after DESIGN.md "Status codes"; OpenAI's error types and codes as its API returns them
 * (CANCELLED and DEADLINE_EXCEEDED have none there: Tandem's own "cancelled" and "timeout"). */
static const tdm_status_row_t status_table[] = {
    {TDM_OK, "OK", "ok", 200, "", "", false, false},
    {TDM_ECANCELLED, "CANCELLED", "cancelled", 499, "cancelled", "cancelled", false, true},
    {-2, "UNKNOWN", "unknown error", 500, "server_error", "internal", false, false},
    {TDM_EINVALID, "INVALID_ARGUMENT", "invalid argument", 400, "invalid_request_error",
     "invalid_argument", false, false},
    {TDM_EDEADLINE, "DEADLINE_EXCEEDED", "deadline exceeded", 408, "timeout", "deadline_exceeded",
     true, true},
    {TDM_ENOTFOUND, "NOT_FOUND", "not found", 404, "not_found_error", "not_found", false, false},
    {-6, "ALREADY_EXISTS", "already exists", 500, "server_error", "internal", false, false},
    {-7, "PERMISSION_DENIED", "permission denied", 500, "server_error", "internal", false, false},
    {TDM_ERESOURCE, "RESOURCE_EXHAUSTED", "resource exhausted", 429, "rate_limit_error",
     "resource_exhausted", true, true},
    {TDM_EPRECONDITION, "FAILED_PRECONDITION", "failed precondition", 400, "invalid_request_error",
     "invalid_argument", false, false},
    {-10, "ABORTED", "aborted", 500, "server_error", "internal", false, false},
    {-11, "OUT_OF_RANGE", "out of range", 500, "server_error", "internal", false, false},
    {-12, "UNIMPLEMENTED", "unimplemented", 500, "server_error", "internal", false, false},
    {TDM_EINTERNAL, "INTERNAL", "internal error", 500, "server_error", "internal", false, true},
    {TDM_EUNAVAILABLE, "UNAVAILABLE", "unavailable", 503, "server_error", "unavailable", true,
     true},
    {-15, "DATA_LOSS", "data loss", 500, "server_error", "internal", false, false},
    {TDM_EUNAUTHENTICATED, "UNAUTHENTICATED", "unauthenticated", 401, "authentication_error",
     "invalid_api_key", false, false},
};

const tdm_status_row_t *tdm_status_info(int code)
{
    if (code > 0 || -(long)code >= (long)(sizeof status_table / sizeof status_table[0]))
        return &status_table[2]; /* UNKNOWN */
    return &status_table[-code];
}

const char *tdm_strerror(int code)
{
    return tdm_status_info(code)->text;
}

const char *tdm_status_name(int code)
{
    return tdm_status_info(code)->name;
}

int tdm_error_set(tdm_error_t *err, int code, const char *fmt, ...)
{
    if (!err)
        return code;
    err->code = code;
    err->field[0] = '\0';
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->msg, sizeof err->msg, fmt, ap);
    va_end(ap);
    return code;
}

int tdm_error_set_field(tdm_error_t *err, int code, const char *field, const char *fmt, ...)
{
    if (!err)
        return code;
    char msg[TDM_ERRMSG_MAX]; /* the arguments may be err->msg itself ("%s", err->msg) */
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    err->code = code;
    snprintf(err->field, sizeof err->field, "%s", field);
    memcpy(err->msg, msg, sizeof msg);
    return code;
}

int tdm_error_field(tdm_error_t *err, const char *fmt, ...)
{
    if (!err)
        return TDM_EINVALID;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->field, sizeof err->field, fmt, ap);
    va_end(ap);
    return err->code;
}

/* err->msg = prefix + sep + err->msg, built by hand: cut at TDM_ERRMSG_MAX by design. */
static void msg_prepend(tdm_error_t *err, const char *prefix, const char *sep)
{
    char old[TDM_ERRMSG_MAX];
    memcpy(old, err->msg, sizeof old);
    const char *parts[] = {prefix, sep, old};
    size_t pos = 0;
    for (size_t i = 0; i < sizeof parts / sizeof parts[0]; i++) {
        size_t l = strnlen(parts[i], sizeof err->msg - 1 - pos);
        memcpy(err->msg + pos, parts[i], l);
        pos += l;
    }
    err->msg[pos] = '\0';
}

int tdm_error_prefix(tdm_error_t *err, int code, const char *fmt, ...)
{
    if (!err)
        return code;
    char prefix[TDM_ERRMSG_MAX];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(prefix, sizeof prefix, fmt, ap);
    va_end(ap);
    /* The separator ": ", unless the context already ends with one. */
    size_t pl = strlen(prefix);
    bool has_sep = pl >= 2 && prefix[pl - 2] == ':' && prefix[pl - 1] == ' ';
    msg_prepend(err, prefix, has_sep ? "" : ": ");
    if (err->code == TDM_OK)
        err->code = code;
    return err->code;
}

int tdm_error_nest(tdm_error_t *err, const char *parent)
{
    if (!err)
        return TDM_EINVALID;
    size_t n = strlen(err->field);
    bool leads = n > 0 && strncmp(err->msg, err->field, n) == 0;
    char old[TDM_ERRFIELD_MAX];
    memcpy(old, err->field, sizeof old);
    snprintf(err->field, sizeof err->field, "%s%s%s", parent, n ? "." : "", old);
    msg_prepend(err, parent, leads ? "." : ": "); /* "sampling." + "top_p must be ..." */
    return err->code;
}

void tdm_error_clear(tdm_error_t *err)
{
    if (!err)
        return;
    err->code = TDM_OK;
    err->field[0] = '\0';
    err->msg[0] = '\0';
}

void tdm_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "tandem: assertion failed: %s (%s:%d)\n", expr, file, line);
    abort();
}

double tdm_time_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

char *tdm_strdup(const char *s)
{
    if (!s)
        return NULL;
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

int tdm_read_file(const char *path, size_t max_bytes, char **data, size_t *len, tdm_error_t *err)
{
    *data = NULL;
    *len = 0;
    FILE *f = fopen(path, "rb");
    if (!f)
        return tdm_error_set(err, errno == ENOENT ? TDM_ENOTFOUND : TDM_EUNAVAILABLE, "%s: %s",
                             path, strerror(errno));
    tdm_buf_t b = TDM_BUF_INIT;
    int rc;
    for (;;) {
        if (b.len > max_bytes)
            goto out_too_large;
        if (tdm_buf_reserve(&b, 4096) != 0) {
            rc = tdm_error_set(err, TDM_ERESOURCE, "%s: out of memory", path);
            goto out_close;
        }
        /* read straight into the buffer: it doubles, so the file is copied once */
        size_t got = fread(b.data + b.len, 1, b.cap - b.len - 1, f);
        if (got == 0)
            break;
        b.len += got;
    }
    b.data[b.len] = '\0';
    if (ferror(f)) {
        /* fopen opens a directory; reading it fails with EISDIR */
        int e = errno;
        rc = e == EISDIR ? tdm_error_set(err, TDM_EINVALID, "%s: is a directory, not a file", path)
                         : tdm_error_set(err, TDM_EUNAVAILABLE, "%s: read error: %s", path,
                                         e ? strerror(e) : "unknown");
        goto out_close;
    }
    if (b.len > max_bytes)
        goto out_too_large;
    fclose(f);
    *len = b.len;
    *data = tdm_buf_take(&b);
    return TDM_OK;

out_too_large:
    rc = tdm_error_set(err, TDM_ERESOURCE, "%s: larger than the limit of %zu bytes", path,
                       max_bytes);
out_close:
    tdm_buf_free(&b);
    fclose(f);
    return rc;
}

bool tdm_unicode_is_format(uint32_t cp)
{
    /* General category Cf, Unicode 15.1 (UCD extracted/DerivedGeneralCategory.txt) */
    static const uint32_t ranges[][2] = {
        {0x00AD, 0x00AD},   {0x0600, 0x0605},   {0x061C, 0x061C},   {0x06DD, 0x06DD},
        {0x070F, 0x070F},   {0x0890, 0x0891},   {0x08E2, 0x08E2},   {0x180E, 0x180E},
        {0x200B, 0x200F},   {0x202A, 0x202E},   {0x2060, 0x2064},   {0x2066, 0x206F},
        {0xFEFF, 0xFEFF},   {0xFFF9, 0xFFFB},   {0x110BD, 0x110BD}, {0x110CD, 0x110CD},
        {0x13430, 0x1343F}, {0x1BCA0, 0x1BCA3}, {0x1D173, 0x1D17A}, {0xE0001, 0xE0001},
        {0xE0020, 0xE007F},
    };
    for (size_t i = 0; i < sizeof ranges / sizeof ranges[0] && cp >= ranges[i][0]; i++)
        if (cp <= ranges[i][1])
            return true;
    return false;
}

bool tdm_text_printable(const char *s, size_t max_bytes, size_t *bad_at)
{
    size_t at = 0, n = s ? strlen(s) : 0;
    bool ok = n > 0;
    while (ok && at < n) {
        uint32_t cp = 0;
        size_t len =
            at < max_bytes ? tdm_utf8_decode((const unsigned char *)s + at, n - at, &cp) : 0;
        ok = len > 0 && at + len <= max_bytes && cp >= 0x20 && cp != 0x7f &&
             !(cp >= 0x80 && cp < 0xa0) && !tdm_unicode_is_format(cp);
        if (ok)
            at += len;
    }
    if (!ok && bad_at)
        *bad_at = at < max_bytes ? at : max_bytes;
    return ok;
}

size_t tdm_utf8_decode(const unsigned char *s, size_t n, uint32_t *cp)
{
    if (n == 0)
        return 0;
    unsigned char c = s[0];
    if (c < 0x80) {
        *cp = c;
        return 1;
    }
    size_t len;
    uint32_t v, min;
    if (c >= 0xC2 && c <= 0xDF) {
        len = 2, v = c & 0x1Fu, min = 0x80;
    } else if (c >= 0xE0 && c <= 0xEF) {
        len = 3, v = c & 0x0Fu, min = 0x800;
    } else if (c >= 0xF0 && c <= 0xF4) {
        len = 4, v = c & 0x07u, min = 0x10000;
    } else {
        return 0;
    }
    if (len > n)
        return 0;
    for (size_t i = 1; i < len; i++) {
        if ((s[i] & 0xC0) != 0x80)
            return 0;
        v = (v << 6) | (s[i] & 0x3Fu);
    }
    if (v < min || v > 0x10FFFF || (v >= 0xD800 && v <= 0xDFFF))
        return 0;
    *cp = v;
    return len;
}

int tdm_buf_reserve(tdm_buf_t *b, size_t more)
{
    if (b->oom)
        return TDM_ERESOURCE;
    size_t need;
    if (!tdm_add_size(b->len, more, &need) || !tdm_add_size(need, 1, &need))
        goto out_oom;
    if (need <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < need) {
        if (!tdm_mul_size(cap, 2, &cap))
            goto out_oom;
    }
    char *d = realloc(b->data, cap);
    if (!d)
        goto out_oom;
    if (!b->data)
        d[0] = '\0';
    b->data = d;
    b->cap = cap;
    return 0;
out_oom:
    b->oom = true;
    return TDM_ERESOURCE;
}

int tdm_buf_append(tdm_buf_t *b, const void *p, size_t n)
{
    int rc = tdm_buf_reserve(b, n);
    if (rc)
        return rc;
    if (n)
        memcpy(b->data + b->len, p, n);
    b->len += n;
    b->data[b->len] = '\0';
    return 0;
}

int tdm_buf_puts(tdm_buf_t *b, const char *s)
{
    return tdm_buf_append(b, s, strlen(s));
}

int tdm_buf_vprintf(tdm_buf_t *b, const char *fmt, va_list ap)
{
    if (b->oom)
        return TDM_ERESOURCE;
    va_list ap2;
    va_copy(ap2, ap);
    char small[256];
    int n = vsnprintf(small, sizeof small, fmt, ap2);
    va_end(ap2);
    if (n < 0)
        return tdm_buf_append(b, "", 0); /* an encoding error: append nothing */
    if ((size_t)n < sizeof small)
        return tdm_buf_append(b, small, (size_t)n);
    int rc = tdm_buf_reserve(b, (size_t)n);
    if (rc)
        return rc;
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    b->len += (size_t)n;
    return 0;
}

int tdm_buf_printf(tdm_buf_t *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int rc = tdm_buf_vprintf(b, fmt, ap);
    va_end(ap);
    return rc;
}

void tdm_buf_clear(tdm_buf_t *b)
{
    b->len = 0;
    b->oom = false;
    if (b->data)
        b->data[0] = '\0';
}

char *tdm_buf_take(tdm_buf_t *b)
{
    if (!b->oom && !b->data)
        tdm_buf_reserve(b, 0);
    char *d = b->oom ? NULL : b->data;
    if (b->oom)
        free(b->data);
    *b = (tdm_buf_t)TDM_BUF_INIT;
    return d;
}

void tdm_buf_free(tdm_buf_t *b)
{
    if (!b)
        return;
    free(b->data);
    *b = (tdm_buf_t)TDM_BUF_INIT;
}
