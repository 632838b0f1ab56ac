"""What the router answers, whatever it was sent (issue 13, small fixes): replies that strict
protobuf clients parse even when the request carried bytes that are not UTF-8; OpenAI errors
in OpenAI's field names; /ready not counting a suspect node. Outcomes only: statuses, parsed
bodies, names in messages.
"""
import json
import os
import signal
import time

import pytest

from conftest import Cluster
from tandem_client import NAMES, pb, prompt_request
from test_http import http_port, request

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("replies")), n_prefill=0, n_decode=1)
    c.start()
    c.port = http_port(c)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def raw_string_field(number, raw):
    """The wire bytes of string field `number` holding raw (any bytes: a client that does not
    check its strings)."""
    assert len(raw) < 128
    return bytes([(number << 3) | 2, len(raw)]) + raw


@pytest.mark.parametrize("field,raw", [(1, b"id-\xff\xfe"), (2, b"caf\xe9-\xc3")])
def test_garbage_strings_get_parseable_replies(cluster, field, raw):
    # a request whose request_id (1) or model (2) is not UTF-8: refused, and the END's
    # FrameHeader parses (a strict parser refuses a string field that is not UTF-8)
    cl = cluster.client()
    try:
        body = prompt_request(prompt="hi", max_tokens=1).SerializeToString()
        call = 77
        h = cl._header(pb.FRAME_KIND_REQUEST, pb.METHOD_GENERATE, call)
        cl.send_raw([h.SerializeToString(), body + raw_string_field(field, raw)])
        got = cl.recv(60)  # FrameHeader.ParseFromString raises on invalid UTF-8
        assert got is not None, "no answer"
        header, _ = got
        assert header.call_id == call and header.kind == pb.FRAME_KIND_END
        assert NAMES[header.status] in ("INVALID_ARGUMENT", "NOT_FOUND"), header
        header.message.encode("utf-8")
        if field == 2:
            assert "caf\ufffd-\ufffd" in header.message, header.message
    finally:
        cl.close()


def post_chat(cluster, body):
    st, _, raw = request(cluster.port, "POST", "/v1/chat/completions", body=dict(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}, **body))
    return st, json.loads(raw)["error"] if st != 200 else json.loads(raw)


def test_max_completion_tokens_named(cluster):
    st, err = post_chat(cluster, {"max_completion_tokens": 5000})
    assert st == 400, err
    assert err["param"] == "max_completion_tokens", err
    # vLLM's wording (litellm matches it): the field is named by param, the counts by the text
    assert err["code"] == "context_length_exceeded", err
    assert "5000 in the completion" in err["message"], err
    assert "max_tokens" not in err["message"], err
    st, err = post_chat(cluster, {"max_tokens": 5000})
    assert st == 400 and err["param"] == "max_tokens", err
    assert "5000 in the completion" in err["message"], err


def test_internal_names_do_not_leak(cluster):
    st, err = post_chat(cluster, {"top_p": 2})
    assert st == 400 and err["param"] == "top_p", err
    assert not err["message"].startswith("sampling"), err
    assert "top_p" in err["message"], err
    st, err = post_chat(cluster, {"messages": [{"role": "narrator", "content": "hi"}]})
    assert st == 400, err
    assert "chat." not in err["message"] and "messages" in err["message"], err
    assert err["param"].startswith("messages"), err


def test_stop_element_named(cluster):
    st, err = post_chat(cluster, {"stop": ["ok", ""]})
    assert st == 400, err
    assert err["param"] == "stop[1]" and "stop[1]" in err["message"], err


def test_message_without_content(cluster):
    st, err = post_chat(cluster, {"messages": [{"role": "system", "content": "be brief"},
                                               {"role": "user"}]})
    assert st == 400, err
    assert err["param"] == "messages[1].content", err
    assert "messages[1].content" in err["message"], err
    st, err = post_chat(cluster, {"messages": [{"role": "user", "content": None}]})
    assert st == 400 and err["param"] == "messages[0].content", err


def wait_node(cluster, nid, pred, what, timeout_s=60):
    end = time.time() + timeout_s
    while time.time() < end:
        try:
            n = cluster.nodes()[nid]
        except TimeoutError:
            continue
        if pred(n):
            return n
        time.sleep(0.05)
    raise AssertionError(f"{nid}: not {what} after {timeout_s} s")


def test_ready_does_not_count_suspect_nodes(cluster):
    assert request(cluster.port, "GET", "/ready")[0] == 200
    pid = cluster.procs["decode-0"].pid
    os.kill(pid, signal.SIGSTOP)
    try:
        # silent past the heartbeat timeout: suspect (and down after twice that); either way
        # it takes no new work, so the router is not ready
        wait_node(cluster, "decode-0", lambda n: n.suspect or not n.up, "suspect")
        st, _, raw = request(cluster.port, "GET", "/ready")
        assert st == 503, raw
        assert json.loads(raw)["ready"] is False
        # the dashboard (sampled once a second) shows it suspect, not up, while the router
        # has it suspect; a node already down by the next sample shows neither
        end = time.time() + 60
        while time.time() < end:
            st, _, raw = request(cluster.port, "GET", "/api/status")
            node = [n for n in json.loads(raw)["nodes"] if n["node_id"] == "decode-0"][0]
            if node["suspect"] or not node["up"]:
                break
            time.sleep(0.1)
        assert node["up"] is False, node
    finally:
        os.kill(pid, signal.SIGCONT)
    wait_node(cluster, "decode-0", lambda n: n.up and not n.suspect, "up again", 120)
    end = time.time() + 60
    while request(cluster.port, "GET", "/ready")[0] != 200:
        assert time.time() < end, "not ready again"
        time.sleep(0.1)
