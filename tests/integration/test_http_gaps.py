"""The HTTP gateway's answers to requests that libmicrohttpd alone would answer badly or not at
all: long chunk extensions, a keep-alive connection's second request arriving slowly, header
lines with blanks in odd places, a NUL in the path, a body that never comes, invisible Unicode
format characters in names. Raw sockets throughout; every assertion is on the bytes received
(one answer, each header once, an OpenAI error object naming the field or limit), never on a
duration.
"""
import json
import socket

import pytest

from conftest import http_cluster
from rawhttp import raw_all, read_all
from test_http import request

HEADER_S = 2  # router.http_header_timeout_s in this cluster
BODY = b'{"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "hi", "max_tokens": 1}'


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a long idle timeout, so that only the header deadline and the body rate can close
    yield from http_cluster(tmp_path_factory, "http_gaps", n_prefill=0,
                            extra_router="  http_connection_timeout_s: 600\n"
                                         f"  http_header_timeout_s: {HEADER_S}\n"
                                         "  http_min_body_rate: 1000\n")


def read_one(s):
    """One whole response with a Content-Length from s: (head bytes, body bytes)."""
    buf = b""
    while True:
        head, sep, body = buf.partition(b"\r\n\r\n")
        if sep:
            lens = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
            assert lens, head
            if len(body) >= int(lens[0].split(b":")[1]):
                return head, body
        b = s.recv(65536)
        assert b, buf
        buf += b


def answers(buf):
    """The final (non-1xx) responses in buf: [(status, [header lines], body bytes)]; asserts
    each is whole and says Content-Length."""
    out = []
    while buf:
        head, sep, rest = buf.partition(b"\r\n\r\n")
        assert sep and head.startswith(b"HTTP/1.1 "), buf[:400]
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ")[1])
        if 100 <= status < 200:
            buf = rest
            continue
        lens = [ln for ln in lines[1:] if ln.lower().startswith(b"content-length:")]
        assert len(lens) == 1, head
        n = int(lens[0].split(b":")[1])
        assert len(rest) >= n, (head, rest)
        out.append((status, lines[1:], rest[:n]))
        buf = rest[n:]
    return out


def one_error(buf):
    """(status, the OpenAI error object) of the one answer in buf; asserts that no header line
    appears twice and that the body is strict UTF-8 JSON."""
    got = answers(buf)
    assert len(got) == 1, buf
    status, lines, body = got[0]
    names = [ln.split(b":")[0].lower() for ln in lines]
    assert len(names) == len(set(names)), lines
    return status, json.loads(body.decode("utf-8", errors="strict"))["error"]


def test_long_chunk_extension_is_a_json_error(cluster):
    # 60 KB of chunk extension: libmicrohttpd's buffer overflows and it answered its own HTML 500
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\n\r\n" + b"%x;ext=" % len(BODY) + b"e" * 60000 +
           b"\r\n" + BODY + b"\r\n0\r\n\r\n")
    st, err = one_error(raw_all(cluster.port, raw))
    assert st in (400, 413) and err["code"] == "bad_framing", err
    assert "chunk extension" in err["message"] and "4096 bytes" in err["message"], err
    # a short extension is fine (RFC 9112 7.1.1: unrecognised extensions are ignored)
    raw = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n" + b"%x;a=b" % len(BODY) +
           b"\r\n" + BODY + b"\r\n0\r\n\r\n")
    got = answers(raw_all(cluster.port, raw))
    assert len(got) == 1 and got[0][0] == 200, got


CHUNKED = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n")


@pytest.mark.parametrize("body,words", [
    # libmicrohttpd answered each of these with its own HTML 400 ("Your HTTP chunked encoding
    # was syntactically incorrect")
    (b"zz\r\n" + BODY + b"\r\n0\r\n\r\n", "chunk line 1 is not a chunk size in hexadecimal"),
    (b"%xg\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n", "chunk line 1 is not a chunk size"),
    (b"%x ;a=b\r\n" % len(BODY) + BODY + b"\r\n0\r\n\r\n", "chunk line 1 is not a chunk size"),
    (b"5\r\n" + BODY[:5] + b"\r\nq\r\n" + BODY[5:] + b"\r\n0\r\n\r\n",
     "chunk line 2 is not a chunk size"),
    (b"%x\r\n" % (len(BODY) - 3) + BODY + b"\r\n0\r\n\r\n",
     "a chunk of %d bytes is not followed by CRLF" % (len(BODY) - 3)),
    (b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nbad trailer\r\n\r\n",
     "trailer line 1 after the last chunk is not a header field"),
    (b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nX-A: 1\r\n: x\r\n\r\n",
     "trailer line 2 after the last chunk is not a header field"),
])
def test_malformed_chunks_are_json_errors(cluster, body, words):
    st, err = one_error(raw_all(cluster.port, CHUNKED + body))
    assert st == 400 and err["code"] == "bad_framing", err
    assert words in err["message"], err


@pytest.mark.parametrize("body", [
    b"5\r\n" + BODY[:5] + b"\r\n%X\r\n" % (len(BODY) - 5) + BODY[5:] + b"\r\n0\r\n\r\n",
    b"%x\n" % len(BODY) + BODY + b"\n0\n\n",  # bare LF line ends, as libmicrohttpd reads them
    b"%x\r\n" % len(BODY) + BODY + b"\r\n0\r\nX-A: 1\r\nY: 2\r\n\r\n",  # trailers
])
def test_well_formed_chunks_are_served(cluster, body):
    got = answers(raw_all(cluster.port, CHUNKED + body))
    assert len(got) == 1 and got[0][0] == 200, got


@pytest.mark.parametrize("version,status,code,words", [
    # libmicrohttpd answered each of these with its own HTML page
    (b" HTTP/2.0", 505, "http_version_not_supported", "HTTP/2.0 is not supported here"),
    (b" HTTP/0.9", 505, "http_version_not_supported", "HTTP/0.9 is not supported here"),
    (b" HTTP/3", 400, "bad_request", "HTTP version is malformed"),
    (b" http/1.1", 400, "bad_request", "HTTP version is malformed"),
    (b" HTTP/1.1 extra", 400, "bad_request", "HTTP version is malformed"),
    (b"", 400, "bad_request", "the request line has no HTTP version"),
])
def test_bad_http_versions_are_json_errors(cluster, version, status, code, words):
    raw = b"GET /health" + version + b"\r\nHost: x\r\nConnection: close\r\n\r\n"
    st, err = one_error(raw_all(cluster.port, raw))
    assert st == status and err["code"] == code, err
    assert words in err["message"], err


@pytest.mark.parametrize("line", [b"GET /health HTTP/1.0", b"GET /health HTTP/1.2",
                                  b"GET  /health HTTP/1.1"])
def test_versions_libmicrohttpd_serves_still_pass(cluster, line):
    got = answers(raw_all(cluster.port, line + b"\r\nHost: x\r\nConnection: close\r\n\r\n"))
    assert len(got) == 1 and got[0][0] == 200, got


def test_header_without_a_name_is_one_json_error(cluster):
    # libmicrohttpd answered this request 200 and then a second answer, its HTML 400
    raw = b"GET /health HTTP/1.1\r\nHost: x\r\n: novalue\r\nConnection: close\r\n\r\n"
    st, err = one_error(raw_all(cluster.port, raw))
    assert st == 400 and err["code"] == "bad_request", err
    assert "header line 2 has no header name before its colon" in err["message"], err


def test_header_deadline_applies_to_the_second_request(cluster):
    s = socket.create_connection(("127.0.0.1", cluster.port), timeout=60)
    try:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        head, body = read_one(s)
        assert head.startswith(b"HTTP/1.1 200 "), head
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
        st, err = one_error(read_all(s))
    finally:
        s.close()
    assert st == 408 and err["code"] == "request_timeout", err
    assert "router.http_header_timeout_s" in err["message"], err


@pytest.mark.parametrize("raw,what", [
    (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2 \r\n\r\n{}", None),
    (b"GET /v1/models HTTP/1.1\r\n\r\n", b"Host"),
])
def test_error_answers_have_each_header_once(cluster, raw, what):
    buf = raw_all(cluster.port, raw + b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close"
                  b"\r\n\r\n" if what is None else raw)
    got = answers(buf)
    for status, lines, body in got:
        names = [ln.split(b":")[0].lower() for ln in lines]
        assert len(names) == len(set(names)), lines
        json.loads(body)
    if what:
        assert len(got) == 1 and got[0][0] == 400, got
        assert what in got[0][2], got


def test_slow_body_gets_408(cluster):
    s = socket.create_connection(("127.0.0.1", cluster.port), timeout=60)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100000\r\n\r\n{\"model\": ")  # 10 of 100,000 bytes
        st, err = one_error(read_all(s))
    finally:
        s.close()
    assert st == 408 and err["code"] == "request_timeout", err
    assert "router.http_min_body_rate" in err["message"], err


def test_expect_continue_without_a_body_gets_408(cluster):
    s = socket.create_connection(("127.0.0.1", cluster.port), timeout=60)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Expect: 100-continue\r\nContent-Length: 70\r\n\r\n")
        st, err = one_error(read_all(s))
    finally:
        s.close()
    assert st == 408 and err["code"] == "request_timeout", err


@pytest.mark.parametrize("line", [b"Host : x", b"Host\t: x", b" Host: x"])
def test_blank_in_a_header_name_is_400(cluster, line):
    st, err = one_error(raw_all(cluster.port, b"GET /v1/models HTTP/1.1\r\n" + line +
                                b"\r\nConnection: close\r\n\r\n"))
    assert st == 400 and err["code"] == "bad_request", err
    assert "header" in err["message"], err


@pytest.mark.parametrize("path", [b"/v1/models%00x", b"/v1/models/a%00b", b"/v1/mo\x00dels"])
def test_nul_in_the_path_is_400(cluster, path):
    st, err = one_error(raw_all(cluster.port, b"GET " + path + b" HTTP/1.1\r\nHost: x\r\n"
                                b"Connection: close\r\n\r\n"))
    assert st == 400 and "NUL" in err["message"] and "path" in err["message"], err


@pytest.mark.parametrize("name", ["Smol\u202eLM", "Smol\u200bLM", "\ufeffSmolLM", "a\u2066b"])
def test_invisible_format_characters_in_a_model_name_are_400(cluster, name):
    st, _, raw = request(cluster.port, "POST", "/v1/completions",
                         body={"model": name, "prompt": "hi", "max_tokens": 1})
    assert st == 400, raw
    err = json.loads(raw)["error"]
    assert err["param"] == "model" and "U+" in err["message"], err
    st, _, raw = request(cluster.port, "GET",
                         "/v1/models/" + "".join("%%%02X" % b for b in name.encode()))
    assert st == 400, raw
    assert "U+" in json.loads(raw)["error"]["message"], raw


def test_request_id_with_a_format_character_is_not_taken(cluster):
    # request ids are printable ASCII: an X-Request-Id with U+202E is not echoed (the router's
    # own id is used), and a native request_id with one is refused naming the field
    rid = "abc\u202edef"
    st, headers, raw = request(cluster.port, "GET", "/health",
                               headers={"X-Request-Id": rid.encode().decode("latin-1")})
    assert st == 200 and headers["X-Request-Id"].startswith("req-"), headers
    from tandem_client import prompt_request
    cl = cluster.client()
    try:
        req = prompt_request("hi", max_tokens=1, temperature=0.0)
        req.request_id = rid
        r = cl.generate(req, timeout_s=60)
        assert r.status == "INVALID_ARGUMENT" and "request_id: byte 3 is 0xe2" in r.message, r
        req = prompt_request("hi", max_tokens=1, temperature=0.0)
        req.model = "Smol\u202eLM"
        r = cl.generate(req, timeout_s=60)
        assert r.status == "INVALID_ARGUMENT" and "U+202E" in r.message, r
    finally:
        cl.close()
