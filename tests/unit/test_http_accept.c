/* test_http_accept.c - the HTTP front door's reading of a request's header block
 * (router/http_accept.c): where it ends, and which framings are refused before libmicrohttpd
 * reads them (RFC 9112 6.3). The connection limits and deadlines are exercised against a
 * running router in tests/integration/test_http_limits.py.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "http_accept.h"

/* Reads the whole of raw (header block and what follows) into *fr. */
static void read_frame(const char *raw, http_acc_frame_t *fr)
{
    size_t n = strlen(raw), hlen = http_acc_header_end(raw, n);
    assert_true(hlen > 0);
    http_acc_frame_read(raw, hlen, n, fr);
}

static void test_header_end(void **state)
{
    (void)state;
    const char *a = "GET / HTTP/1.1\r\nHost: x\r\n\r\nBODY";
    assert_int_equal(http_acc_header_end(a, strlen(a)), strlen(a) - 4);
    const char *b = "GET / HTTP/1.1\nHost: x\n\nBODY"; /* bare LF, as RFC 9112 2.2 allows */
    assert_int_equal(http_acc_header_end(b, strlen(b)), strlen(b) - 4);
    const char *c = "GET / HTTP/1.1\r\nHost: x\r\n"; /* not complete yet */
    assert_int_equal(http_acc_header_end(c, strlen(c)), 0);
}

static void test_frame_ok(void **state)
{
    (void)state;
    http_acc_frame_t fr;
    read_frame("GET /health?x=1 HTTP/1.1\r\nHost: x\r\n\r\n", &fr);
    assert_string_equal(fr.why, "");
    assert_string_equal(fr.path, "/health");
    read_frame("POST /v1/completions HTTP/1.1\r\nHost: x\r\ncontent-length:  72\r\n\r\n{", &fr);
    assert_string_equal(fr.why, "");
    assert_string_equal(fr.path, "/v1/completions");
    read_frame(
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n400000\r\n",
        &fr); /* exactly the 4 MiB limit */
    assert_string_equal(fr.why, "");
    /* a short chunk extension passes; a first chunk line not all here yet is waited for */
    read_frame("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2;a=b\r\n{}\r\n"
               "3;c\r\nabc\r\n0\r\n\r\n",
               &fr);
    assert_string_equal(fr.why, "");
    assert_false(fr.need_more);
    read_frame("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n2;a=", &fr);
    assert_string_equal(fr.why, "");
    assert_true(fr.need_more);
    /* ... except by a client waiting for "100 Continue" before it sends anything */
    read_frame("POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
               "Expect: 100-continue\r\n\r\n",
               &fr);
    assert_false(fr.need_more);
    /* HTTP/1.0 needs no Host; a NUL after '?' is the query's business */
    read_frame("GET /health?a=%00 HTTP/1.0\r\n\r\n", &fr);
    assert_string_equal(fr.why, "");
}

/* A chunk line of n bytes of extension after "5;" (static buffer; not reentrant). */
static const char *long_extension(size_t n)
{
    static char raw[8192];
    int k = snprintf(raw, sizeof raw,
                     "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n5;");
    memset(raw + k, 'e', n);
    raw[(size_t)k + n] = '\0';
    return raw;
}

static void test_frame_refused_lines(void **state)
{
    (void)state;
    static const struct {
        const char *raw, *why;
    } cases[] = {
        {"GET / HTTP/1.1\r\nHost : x\r\n\r\n",
         "header line 1 has a blank between the header name and the colon (RFC 9112 5.1): "
         "'Host :'"},
        {"GET / HTTP/1.1\r\nHost\t: x\r\n\r\n",
         "header line 1 has a blank between the header name and the colon (RFC 9112 5.1): "
         "'Host\t:'"},
        {"GET / HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
         "header line 2 begins with a blank (obs-fold, RFC 9112 5.2): send each header field "
         "on one line"},
        {"GET / HTTP/1.1\r\nHost: x\r\nnocolon\r\n\r\n", "header line 2 has no colon: 'nocolon'"},
        {"GET / HTTP/1.1\r\n\r\n",
         "the request has no Host header; HTTP/1.1 requires one (RFC 9112 3.2)"},
        {"GET / HTTP/1.1\r\nHost: x\r\nhost: y\r\n\r\n",
         "the request has 2 Host headers; send exactly one"},
        {"GET /v1/models%00x HTTP/1.1\r\nHost: x\r\n\r\n",
         "the request path has a NUL byte (%00) at byte 10; paths may not contain NUL"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 2 \r\n\r\n{}",
         "Content-Length '2 ' ends with a blank; send the digits alone"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        http_acc_frame_t fr;
        read_frame(cases[i].raw, &fr);
        assert_int_equal(fr.http_status, 400);
        assert_string_equal(fr.why, cases[i].why);
    }
    /* a raw NUL (strlen would stop at it) */
    static const char nul[] = "GET /v1/mo\0dels HTTP/1.1\r\nHost: x\r\n\r\n";
    http_acc_frame_t fr;
    http_acc_frame_read(nul, sizeof nul - 1, sizeof nul - 1, &fr);
    assert_string_equal(
        fr.why, "the request path has a NUL byte (raw) at byte 6; paths may not contain NUL");
    /* chunk extensions: up to HTTP_ACC_CHUNK_LINE_MAX bytes of line, whether whole or not */
    const char *raw = long_extension(HTTP_ACC_CHUNK_LINE_MAX - 2);
    http_acc_frame_read(raw, http_acc_header_end(raw, strlen(raw)), strlen(raw), &fr);
    assert_string_equal(fr.why, "");
    assert_true(fr.need_more);
    raw = long_extension(HTTP_ACC_CHUNK_LINE_MAX);
    http_acc_frame_read(raw, http_acc_header_end(raw, strlen(raw)), strlen(raw), &fr);
    assert_int_equal(fr.http_status, 400);
    assert_string_equal(fr.code, "bad_framing");
    assert_string_equal(fr.why,
                        "a chunk line (size and chunk extension) is longer than 4096 bytes");
}

static void test_frame_refused(void **state)
{
    (void)state;
    static const struct {
        const char *raw;
        unsigned status;
        const char *code, *why;
    } cases[] = {
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\n", 400,
         "bad_framing", "the request has 2 Content-Length headers; send exactly one"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nContent-Length: 5\r\n\r\n", 400,
         "bad_framing", "the request has 2 Content-Length headers; send exactly one"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
         "chunked\r\n\r\n",
         400, "bad_framing", "the request has 2 Transfer-Encoding headers; send exactly one"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n",
         400, "bad_framing", "a request with both Transfer-Encoding and Content-Length is refused"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n", 400, "bad_framing",
         "Content-Length 'abc' is not a decimal byte count"},
        {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 12345678901234567890\r\n\r\n", 400,
         "bad_framing", "Content-Length '12345678901234567890' is not a decimal byte count"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n", 400, "bad_framing",
         "Transfer-Encoding 'gzip' is not supported: send 'chunked' or a Content-Length"},
        {" /health HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request",
         "the request line has no method"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nffffffffffffffff\r\nabc",
         413, "request_too_large",
         "a chunk of more than 4194304 bytes: the request body is limited to 4194304 bytes"},
        {"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n400001\r\n", 413,
         "request_too_large",
         "a chunk of 4194305 bytes: the request body is limited to 4194304 bytes"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        http_acc_frame_t fr;
        read_frame(cases[i].raw, &fr);
        assert_int_equal(fr.http_status, cases[i].status);
        assert_string_equal(fr.code, cases[i].code);
        assert_string_equal(fr.why, cases[i].why);
    }
}

static void test_files_needed(void **state)
{
    (void)state;
    assert_int_equal(http_acc_files_needed(1000), 2256);
    assert_int_equal(http_acc_files_needed(100000), 200256);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_header_end),    cmocka_unit_test(test_frame_ok),
        cmocka_unit_test(test_frame_refused), cmocka_unit_test(test_frame_refused_lines),
        cmocka_unit_test(test_files_needed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
