"""Speculative decoding (prompt lookup) through a cluster: the decode node drafts by default
(nodes[].speculative.max_draft 8); a greedy chat completion on a prompt the answer copies from
gives the same text with `speculative: "auto"` and `"off"`, equal to `tandem generate -m MODEL`
(which never drafts), the decode node's heartbeats bring accepted drafts into
tandem_spec_decode_* and vllm:spec_decode_*, and a bad value is refused naming the field.
"""
import http.client
import json
import re
import time
import urllib.request

import pytest

from conftest import http_cluster, reference

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
CHAT = ("Copy the table below and keep only the rows where the status is \"failed\".\n\n"
        "| test name | duration | status |\n"
        "| test_login_valid | 0.12 s | passed |\n"
        "| test_upload_large_file | 4.81 s | failed |\n"
        "| test_download_resume | 2.30 s | passed |\n"
        "| test_session_timeout | 30.02 s | failed |\n"
        "| test_export_csv_unicode | 0.44 s | failed |")
SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # a fixed draft-row cost: how much the decode node drafts must not depend on how loaded
    # the machine is (the fitted cost under load can make drafting never pay)
    yield from http_cluster(tmp_path_factory, "spec",
                            extra_decode="    speculative:\n      max_draft: 8\n"
                                         "      row_cost: 0.1\n")


def post(port, path, body, timeout=120):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def metrics(port):
    """{series: value} of GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode("utf-8")
    out = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and not line.startswith("#"):
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def chat(port, speculative, max_tokens=48, **extra):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": CHAT}],
            "max_tokens": max_tokens, "temperature": 0, **extra}
    if speculative is not None:
        body["speculative"] = speculative
    st, raw = post(port, "/v1/chat/completions", body)
    assert st == 200, raw
    return json.loads(raw)["choices"][0]["message"]["content"]


def series(m, prefix):
    """The value of the one series of family prefix for decode-0."""
    hits = [v for k, v in m.items() if k.startswith(prefix + "{") and "decode-0" in k]
    assert len(hits) == 1, (prefix, [k for k in m if k.startswith(prefix)])
    return hits[0]


def test_same_text_with_speculation_on_and_off(cluster):
    want = reference(chat=CHAT, max_tokens=48)
    assert chat(cluster.port, "off") == want
    assert chat(cluster.port, "auto") == want
    assert chat(cluster.port, None) == want
    end = time.time() + 30  # the counters come with the next heartbeat
    while True:
        m = metrics(cluster.port)
        acc = series(m, "tandem_spec_decode_accepted_tokens_total")
        if acc > 0:
            break
        assert time.time() < end, m
        time.sleep(0.2)
    drafted = series(m, "tandem_spec_decode_draft_tokens_total")
    assert drafted >= acc > 0
    assert series(m, "tandem_spec_decode_drafts_total") > 0
    assert series(m, "vllm:spec_decode_num_accepted_tokens_total") == acc
    assert series(m, "vllm:spec_decode_num_draft_tokens_total") == drafted


def test_same_text_with_request_masks(cluster):
    """min_tokens and bad_words are masks the draft verification applies at each position as
    plain decoding does: the text is the same with speculation on and off, and drafts ran."""
    before = series(metrics(cluster.port), "tandem_spec_decode_draft_tokens_total")
    plain = chat(cluster.port, "off")
    word = plain.split()[2].strip(".,!?")
    extra = {"bad_words": [word], "min_tokens": 40}
    off = chat(cluster.port, "off", **extra)
    assert word not in off.split(), (word, off)
    assert chat(cluster.port, "auto", **extra) == off
    end = time.time() + 30  # the counters come with the next heartbeat
    while series(metrics(cluster.port), "tandem_spec_decode_draft_tokens_total") <= before:
        assert time.time() < end
        time.sleep(0.2)


def heartbeat_after(port, t_wall):
    """Waits for a heartbeat from every up node received after t_wall (time.time())."""
    end = time.time() + 60
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=10) as r:
            nodes = [n for n in json.loads(r.read())["nodes"] if n["up"]]
        now = time.time()
        if nodes and all(now - n["last_heartbeat_age_s"] > t_wall for n in nodes):
            return
        assert time.time() < end, nodes
        time.sleep(0.1)


def test_off_over_http_drafts_nothing(cluster):
    """speculative: "off" on the HTTP API reaches the decode node: its draft counters stay."""
    def drafted():
        # the counters once two readings, each two heartbeats after the last, agree: a
        # heartbeat carries the load the node published up to a timer period before it, so
        # one reading right after a request can still miss its last passes
        last, end = None, time.time() + 60
        while True:
            heartbeat_after(cluster.port, time.time())
            heartbeat_after(cluster.port, time.time())
            v = series(metrics(cluster.port), "tandem_spec_decode_draft_tokens_total")
            if v == last:
                return v
            assert time.time() < end, (last, v)
            last = v
    before = drafted()
    chat(cluster.port, "off")
    assert drafted() == before
    chat(cluster.port, "auto")
    assert drafted() > before


def test_bad_value_is_refused(cluster):
    st, raw = post(cluster.port, "/v1/completions",
                   {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, "speculative": "on"})
    err = json.loads(raw)["error"]
    assert st == 400 and err["param"] == "speculative", raw
    assert 'must be "auto" or "off"' in err["message"], raw
