/* test_base.c - status codes, error messages, file reading and logfmt logging (the fatal-signal
 * line too). */
#define _GNU_SOURCE /* MAP_ANONYMOUS */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "tdm_test.h"
#include "tandem/base.h"
#include "tandem/log.h"

static void test_status_names(void **state)
{
    (void)state;
    /* the codes are minus gRPC's */
    assert_int_equal(TDM_EINVALID, -3);
    assert_int_equal(TDM_ERESOURCE, -8);
    assert_int_equal(TDM_EUNAUTHENTICATED, -16);
    assert_string_equal(tdm_status_name(TDM_EINVALID), "INVALID_ARGUMENT");
    assert_string_equal(tdm_status_name(TDM_ERESOURCE), "RESOURCE_EXHAUSTED");
    assert_string_equal(tdm_status_name(TDM_OK), "OK");
    assert_string_equal(tdm_status_name(-99), "UNKNOWN");
    /* every gRPC code has its name, also those without a TDM_E* value (the router's
     * metrics label any wire status with it) */
    assert_string_equal(tdm_status_name(-2), "UNKNOWN");
    assert_string_equal(tdm_status_name(-6), "ALREADY_EXISTS");
    assert_string_equal(tdm_status_name(-10), "ABORTED");
    assert_string_equal(tdm_status_name(-15), "DATA_LOSS");
    assert_string_equal(tdm_status_name(TDM_EUNAUTHENTICATED), "UNAUTHENTICATED");
    assert_string_equal(tdm_status_name(-17), "UNKNOWN");
    assert_string_equal(tdm_status_name(1), "UNKNOWN");
    assert_string_equal(tdm_strerror(TDM_EDEADLINE), "deadline exceeded");
    assert_string_equal(tdm_strerror(12345), "unknown error");
}

static void test_error_set_and_prefix(void **state)
{
    (void)state;
    tdm_error_t err;
    tdm_error_clear(&err);
    assert_int_equal(err.code, TDM_OK);
    assert_int_equal(tdm_error_set(&err, TDM_EINVALID, "key '%s' must be %d", "x", 3),
                     TDM_EINVALID);
    assert_string_equal(err.msg, "key 'x' must be 3");
    assert_int_equal(tdm_error_prefix(&err, TDM_EINTERNAL, "file %s", "a.yaml"), TDM_EINVALID);
    assert_string_equal(err.msg, "file a.yaml: key 'x' must be 3");
    /* NULL is accepted everywhere and the code still returned */
    assert_int_equal(tdm_error_set(NULL, TDM_ENOTFOUND, "x"), TDM_ENOTFOUND);
    tdm_error_clear(NULL);
    /* a long message is cut, never overflows */
    char big[2 * TDM_ERRMSG_MAX];
    memset(big, 'a', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    tdm_error_set(&err, TDM_EINVALID, "%s", big);
    assert_int_equal(strlen(err.msg), TDM_ERRMSG_MAX - 1);
    tdm_error_prefix(&err, TDM_EINVALID, "%s", big);
    assert_int_equal(strlen(err.msg), TDM_ERRMSG_MAX - 1);
}

/* The field travels with the error: set where the check happens, nested under the member it
 * is in, kept by a prefix, cleared by a plain set. */
static void test_error_field(void **state)
{
    (void)state;
    tdm_error_t err;
    tdm_error_clear(&err);
    assert_string_equal(err.field, "");
    tdm_error_set_field(&err, TDM_EINVALID, "top_p", "top_p must be in (0, 1], got %g", 1.5);
    assert_string_equal(err.field, "top_p");
    assert_int_equal(tdm_error_nest(&err, "sampling"), TDM_EINVALID);
    assert_string_equal(err.field, "sampling.top_p");
    assert_string_equal(err.msg, "sampling.top_p must be in (0, 1], got 1.5");
    /* a message that does not begin with the field gets "parent: " */
    tdm_error_set(&err, TDM_EINVALID, "too many");
    assert_int_equal(tdm_error_field(&err, "stop[%d]", 2), TDM_EINVALID);
    assert_string_equal(err.field, "stop[2]");
    tdm_error_nest(&err, "x");
    assert_string_equal(err.field, "x.stop[2]");
    assert_string_equal(err.msg, "x: too many");
    tdm_error_prefix(&err, TDM_EINVALID, "ctx");
    assert_string_equal(err.field, "x.stop[2]");
    tdm_error_set(&err, TDM_EINVALID, "other");
    assert_string_equal(err.field, "");
    /* the message's own text as an argument */
    tdm_error_set_field(&err, TDM_EINVALID, "f", "%s!", err.msg);
    assert_string_equal(err.msg, "other!");
    assert_int_equal(tdm_error_set_field(NULL, TDM_ENOTFOUND, "f", "x"), TDM_ENOTFOUND);
}

/* One row per status says everything about it outside the process. */
static void test_status_table(void **state)
{
    (void)state;
    const tdm_status_row_t *s = tdm_status_info(TDM_EINVALID);
    assert_int_equal(s->code, TDM_EINVALID);
    assert_int_equal(s->http_status, 400);
    assert_string_equal(s->oai_type, "invalid_request_error");
    assert_string_equal(s->oai_code, "invalid_argument");
    assert_int_equal(tdm_status_info(TDM_ERESOURCE)->http_status, 429);
    assert_true(tdm_status_info(TDM_ERESOURCE)->retryable);
    assert_int_equal(tdm_status_info(TDM_EDEADLINE)->http_status, 408);
    assert_int_equal(tdm_status_info(TDM_ECANCELLED)->http_status, 499);
    assert_false(tdm_status_info(TDM_EINVALID)->server_fault);
    assert_true(tdm_status_info(TDM_EINTERNAL)->server_fault);
    /* the rows sit at minus their code; codes outside gRPC's get UNKNOWN's */
    for (int c = 0; c >= -16; c--)
        assert_int_equal(tdm_status_info(c)->code, c);
    assert_string_equal(tdm_status_info(-99)->name, "UNKNOWN");
    assert_int_equal(tdm_status_info(7)->http_status, 500);
}

static void test_read_file(void **state)
{
    (void)state;
    char path[] = "/tmp/tandem-test-base-XXXXXX";
    int fd = mkstemp(path);
    assert_true(fd >= 0);
    assert_int_equal(write(fd, "hello\n", 6), 6);
    close(fd);
    char *data;
    size_t len;
    tdm_error_t err = {0};
    assert_int_equal(tdm_read_file(path, 1024, &data, &len, &err), TDM_OK);
    assert_int_equal(len, 6);
    assert_string_equal(data, "hello\n");
    free(data);
    assert_int_equal(tdm_read_file(path, 3, &data, &len, &err), TDM_ERESOURCE);
    assert_non_null(strstr(err.msg, "larger than the limit of 3 bytes"));
    unlink(path);
    assert_int_equal(tdm_read_file(path, 1024, &data, &len, &err), TDM_ENOTFOUND);
    assert_non_null(strstr(err.msg, path));
    /* a directory opens, but is no file */
    assert_int_equal(tdm_read_file("/tmp", 1024, &data, &len, &err), TDM_EINVALID);
    assert_string_equal(err.msg, "/tmp: is a directory, not a file");
    assert_null(data);
}

/* Captures what a logger writes. */
static char *log_line(tdm_logger_t *lg, tdm_log_level_t level, const char *req, const char *kv,
                      const char *msg)
{
    static char buf[8192];
    buf[0] = '\0';
    FILE *f = fmemopen(buf, sizeof buf, "w");
    assert_non_null(f);
    lg->out = f;
    tdm_log_write(lg, level, req, kv, "%s", msg);
    fclose(f);
    lg->out = NULL;
    return buf;
}

static void test_logfmt(void **state)
{
    (void)state;
    tdm_logger_t lg;
    tdm_log_init(&lg, "decode-0");
    char *line = log_line(&lg, TDM_LOG_INFO, "req-7", "blocks=4", "ready");
    /* ts=YYYY-MM-DDTHH:MM:SS.mmmZ level=info node=decode-0 req=req-7 msg=ready blocks=4 */
    assert_true(strncmp(line, "ts=", 3) == 0);
    assert_int_equal(line[3 + 4], '-');
    assert_non_null(strstr(line, "Z level=info node=decode-0 req=req-7 msg=ready blocks=4\n"));
    /* quoting and escaping of values with spaces, quotes, '=' and newlines */
    line = log_line(&lg, TDM_LOG_WARN, NULL, NULL, "say \"hi\"\nnow a=b");
    assert_non_null(strstr(line, "level=warn node=decode-0 msg=\"say \\\"hi\\\"\\nnow a=b\"\n"));
    assert_null(strstr(line, "req="));
    /* below the level: nothing */
    line = log_line(&lg, TDM_LOG_DEBUG, NULL, NULL, "hidden");
    assert_string_equal(line, "");
    lg.level = TDM_LOG_DEBUG;
    line = log_line(&lg, TDM_LOG_DEBUG, NULL, NULL, "shown");
    assert_non_null(strstr(line, "level=debug"));
    /* an unnamed node prints node=- */
    tdm_log_init(&lg, NULL);
    line = log_line(&lg, TDM_LOG_ERROR, NULL, NULL, "x");
    assert_non_null(strstr(line, "level=error node=- msg=x"));
}

static void test_log_levels_and_kv(void **state)
{
    (void)state;
    assert_int_equal(tdm_log_level_parse("debug"), TDM_LOG_DEBUG);
    assert_int_equal(tdm_log_level_parse("WARNING"), TDM_LOG_WARN);
    assert_int_equal(tdm_log_level_parse("off"), TDM_LOG_OFF);
    assert_int_equal(tdm_log_level_parse("verbose"), -1);
    assert_int_equal(tdm_log_level_parse(NULL), -1);
    assert_string_equal(tdm_log_level_name(TDM_LOG_ERROR), "error");
    char buf[32] = "";
    assert_true(tdm_log_kv_append(buf, sizeof buf, "a", "1") > 0);
    assert_true(tdm_log_kv_append(buf, sizeof buf, "b", "x y") > 0);
    assert_string_equal(buf, "a=1 b=\"x y\"");
    /* does not fit: unchanged */
    assert_int_equal(tdm_log_kv_append(buf, sizeof buf, "long", "0123456789abcdef"), -1);
    assert_string_equal(buf, "a=1 b=\"x y\"");
    buf[0] = '\0';
    assert_true(tdm_log_kv_append(buf, sizeof buf, "e", "") > 0);
    assert_string_equal(buf, "e=\"\"");
}

static void test_utf8_decode(void **state)
{
    (void)state;
    uint32_t cp = 0;
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"A", 1, &cp), 1);
    assert_int_equal(cp, 0x41);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\xc3\xa9", 2, &cp), 2);
    assert_int_equal(cp, 0xE9);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\xf0\x9f\x98\x80", 4, &cp), 4);
    assert_int_equal(cp, 0x1F600);
    /* truncated, overlong, surrogate, above U+10FFFF, stray continuation, empty */
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\xc3", 1, &cp), 0);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\xc0\x80", 2, &cp), 0);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\xe0\x80\x80", 3, &cp), 0);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\xed\xa0\x80", 3, &cp), 0);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\xf4\x90\x80\x80", 4, &cp), 0);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"\x80", 1, &cp), 0);
    assert_int_equal(tdm_utf8_decode((const unsigned char *)"", 0, &cp), 0);
}

static void test_text_printable(void **state)
{
    (void)state;
    size_t at = 99;
    assert_true(tdm_text_printable("SmolLM2-135M caf\xc3\xa9 \xf0\x9f\x98\x80", 64, &at));
    assert_int_equal(at, 99); /* untouched when true */
    assert_false(tdm_text_printable("", 64, &at));
    assert_int_equal(at, 0);
    assert_false(tdm_text_printable("ab\xff", 64, &at)); /* not UTF-8 */
    assert_int_equal(at, 2);
    assert_false(tdm_text_printable("ab\x01", 64, &at)); /* C0 control */
    assert_int_equal(at, 2);
    assert_false(tdm_text_printable("a\x7f", 64, &at)); /* DEL */
    assert_int_equal(at, 1);
    assert_false(tdm_text_printable("a\xc2\x85", 64, &at)); /* C1 control (NEL) */
    /* format characters (Cf): invisible, or reordering what follows */
    assert_false(tdm_text_printable("Smol\xe2\x80\xaeLM", 64, &at)); /* U+202E RLO */
    assert_int_equal(at, 4);
    assert_false(tdm_text_printable("a\xe2\x80\x8b", 64, &at)); /* U+200B ZWSP */
    assert_int_equal(at, 1);
    assert_false(tdm_text_printable("\xef\xbb\xbf"
                                    "a",
                                    64, &at)); /* U+FEFF BOM */
    assert_int_equal(at, 0);
    assert_false(tdm_text_printable("a\xf3\xa0\x80\x81", 64, &at)); /* U+E0001 tag */
    assert_true(tdm_unicode_is_format(0x00AD) && tdm_unicode_is_format(0x2066) &&
                tdm_unicode_is_format(0xE007F));
    assert_false(tdm_unicode_is_format('a') || tdm_unicode_is_format(0x200A) ||
                 tdm_unicode_is_format(0x2010) || tdm_unicode_is_format(0xE0080) ||
                 tdm_unicode_is_format(0x00E9));
    assert_int_equal(at, 1);
    assert_true(tdm_text_printable("abcd", 4, &at));
    assert_false(tdm_text_printable("abcde", 4, &at)); /* longer than max_bytes */
    assert_int_equal(at, 4);
    assert_false(tdm_text_printable("abc\xc3\xa9", 4, &at)); /* a character across the limit */
    assert_int_equal(at, 3);
}

static void test_buf(void **state)
{
    (void)state;
    tdm_buf_t b = TDM_BUF_INIT;
    assert_int_equal(tdm_buf_append(&b, "ab", 2), 0);
    assert_int_equal(tdm_buf_puts(&b, "cd"), 0);
    assert_int_equal(tdm_buf_printf(&b, "-%d-", 42), 0);
    assert_string_equal(b.data, "abcd-42-");
    assert_int_equal(b.len, 8);
    /* a printf longer than the on-stack attempt, and growth past several doublings */
    char big[1000];
    memset(big, 'x', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    assert_int_equal(tdm_buf_printf(&b, "%s|%s", big, big), 0);
    assert_int_equal(b.len, 8 + 2 * 999 + 1);
    assert_int_equal(b.data[b.len], '\0');
    assert_int_equal(b.data[8 + 999], '|');
    /* embedded NUL bytes count */
    assert_int_equal(tdm_buf_append(&b, "\0z", 2), 0);
    assert_int_equal(b.len, 8 + 2 * 999 + 3);
    tdm_buf_clear(&b);
    assert_int_equal(b.len, 0);
    assert_string_equal(b.data, "");
    assert_int_equal(tdm_buf_puts(&b, "q"), 0);
    char *s = tdm_buf_take(&b);
    assert_string_equal(s, "q");
    free(s);
    assert_null(b.data);
    /* take of an empty buffer gives "" */
    s = tdm_buf_take(&b);
    assert_non_null(s);
    assert_string_equal(s, "");
    free(s);
    /* overflow is out of memory, sticky until clear, content unchanged */
    assert_int_equal(tdm_buf_puts(&b, "keep"), 0);
    assert_int_equal(tdm_buf_reserve(&b, SIZE_MAX), TDM_ERESOURCE);
    assert_true(b.oom);
    assert_int_equal(tdm_buf_puts(&b, "more"), TDM_ERESOURCE);
    assert_string_equal(b.data, "keep");
    assert_null(tdm_buf_take(&b));
    assert_null(b.data);
    tdm_buf_free(&b);
    tdm_buf_free(NULL);
}

/* A child that logs through a pipe dies of signal sig (a store into the read-only page *page
 * for SIGSEGV, a fault the sanitizers leave to the kernel; raise for the others) after
 * tdm_log_fatal_signals; its line and backtrace are read into out (cap bytes). Returns the
 * child's wait status. */
static int die_of(int sig, volatile int *page, char *out, size_t cap)
{
    int fds[2];
    assert_int_equal(pipe(fds), 0);
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        tdm_logger_t lg;
        tdm_log_init(&lg, "prefill-7");
        lg.out = fdopen(fds[1], "w");
        tdm_log_fatal_signals(&lg, "tandem-prefill");
        if (sig == SIGSEGV)
            *page = 1;
        raise(sig);
        _exit(0);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t r;
    while (n + 1 < cap && (r = read(fds[0], out + n, cap - 1 - n)) > 0)
        n += (size_t)r;
    out[n] = '\0';
    close(fds[0]);
    int ws = 0;
    assert_int_equal(waitpid(pid, &ws, 0), pid);
    return ws;
}

static void test_fatal_signal_is_logged(void **state)
{
    (void)state;
    static char out[65536];
    char year[8];
    time_t now = time(NULL);
    struct tm tm;
    gmtime_r(&now, &tm);
    strftime(year, sizeof year, "%Y", &tm);

    long pg = sysconf(_SC_PAGESIZE);
    void *page = mmap(NULL, (size_t)pg, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(page != MAP_FAILED);
    char addr[40];
    snprintf(addr, sizeof addr, " addr=%p\n", page);
    int ws = die_of(SIGSEGV, page, out, sizeof out);
    /* the process still dies of the signal (exit status, core dump) */
    assert_true(WIFSIGNALED(ws));
    assert_int_equal(WTERMSIG(ws), SIGSEGV);
    assert_true(strncmp(out, "ts=", 3) == 0);
    assert_true(strncmp(out + 3, year, 4) == 0); /* the UTC year, as log.c writes it */
    assert_int_equal(out[3 + 10], 'T');
    assert_int_equal(out[3 + 23], 'Z');
    assert_non_null(strstr(out, " level=error node=prefill-7 msg=\"tandem-prefill died of fatal "
                                "signal 11 (SIGSEGV); backtrace follows\" signal=SIGSEGV pid="));
    assert_non_null(strstr(out, addr)); /* the faulting address */
    /* the backtrace: at least one frame line after the log line */
    char *nl = strchr(out, '\n');
    assert_non_null(nl);
    assert_true(strlen(nl + 1) > 0);

    ws = die_of(SIGABRT, NULL, out, sizeof out);
    assert_true(WIFSIGNALED(ws));
    assert_int_equal(WTERMSIG(ws), SIGABRT);
    assert_non_null(strstr(out, "died of fatal signal 6 (SIGABRT)"));
    assert_null(strstr(out, "addr="));
    assert_non_null(strstr(out, " from_pid=")); /* abort(3) / raise: sent, not a fault */
    munmap(page, (size_t)pg);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_status_names),
        cmocka_unit_test(test_error_set_and_prefix),
        cmocka_unit_test(test_error_field),
        cmocka_unit_test(test_status_table),
        cmocka_unit_test(test_read_file),
        cmocka_unit_test(test_logfmt),
        cmocka_unit_test(test_log_levels_and_kv),
        cmocka_unit_test(test_utf8_decode),
        cmocka_unit_test(test_text_printable),
        cmocka_unit_test(test_buf),
        cmocka_unit_test(test_fatal_signal_is_logged),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
