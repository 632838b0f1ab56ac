"""Request migration (issue 13, case 6): kill -9 of the decode node that runs a streaming
request, mid-stream. The router re-prefills prompt + the tokens already delivered on the other
decode node (through the prefill node) and the stream resumes at the next output index: the
client sees no gap and no repeat, and the text is byte-identical to the same request on the
undisturbed cluster, greedy and seeded (counter-based sampling: the draw for output index i
depends only on the seed and i). When no decode node is left, the request ends UNAVAILABLE.

Outcomes are asserted, never timings: the node that holds the request is the one the router
says it dispatched it to (its "dispatched" log line, the router logging at debug level), read
as soon as the first tokens arrive; the kill is a SIGKILL, and every wait for its consequences
is an event with a generous deadline.
"""
import http.client
import json
import re
import signal
import time

import pytest

from conftest import Cluster
from tandem_client import Result, pb, prompt_request

PROMPT = "Once upon a time, in a small village by the sea, there lived"
# long enough that the request is still streaming when its decode node is found and killed
MAX_TOKENS = 200
# output tokens delivered before the kill: past the prefill node's first token, so the decode
# node is streaming (a kill during the KV transfer migrates too, through the sender's failure)
FIRST = 5
# A test process stalled past the whole stream (a starved machine) kills the node too late:
# nothing moves, and the case is tried again with a new request, this many times at most.
TRIES = 3


def http_port(cluster):
    """The router.http_port conftest wrote into the cluster's config."""
    with open(cluster.config) as f:
        m = re.search(r"^\s*http_port:\s*(\d+)\s*$", f.read(), re.M)
    assert m, "no http_port in the cluster config"
    return int(m.group(1))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("migration")), n_prefill=1, n_decode=2)
    with open(c.config, "a") as f:
        f.write("log:\n  level: debug\n")
    c.start()
    c.port = http_port(c)
    yield c
    codes = c.stop()
    # the decode nodes this module killed exit with -9; the others stop cleanly
    assert all(rc in (0, -signal.SIGKILL) for rc in codes.values()), codes
    assert codes["router"] == 0 and codes["prefill-0"] == 0, codes


def counter(cluster, name):
    """The value of the router's counter `name` (native METHOD_METRICS)."""
    cl = cluster.client()
    try:
        st, msg, resp = cl.unary(pb.METHOD_METRICS, pb.MetricsRequest(), pb.MetricsResponse,
                                 timeout_s=30)
    finally:
        cl.close()
    assert st == "OK", (st, msg)
    for fam in resp.families:
        if fam.name == name:
            return fam.samples[0].int_value
    raise AssertionError(f"no metric family {name}")


def ensure_decode_up(cluster):
    """Both decode nodes up and idle (a node killed by an earlier test is started again)."""
    for nid in cluster.decode_ids:
        p = cluster.procs.get(nid)
        if p is None or p.poll() is not None:
            cluster.start_node(nid, timeout_s=120)
    cluster.wait_up(cluster.decode_ids, 120)
    cluster.wait_idle()


def log_size(cluster):
    """The router log's length now: dispatched_to looks after it."""
    with open(cluster.logs["router"], "rb") as f:
        return len(f.read())


def dispatched_to(cluster, since, request_id=None, timeout_s=60.0):
    """The decode node the router last dispatched request_id (None: any request) to, after
    byte `since` of its log (the "dispatched" debug line: decode=<node>)."""
    req = r"\breq=" + re.escape(request_id) + " " if request_id else ""
    pat = re.compile(req + r".*\bmsg=dispatched\b.*\bdecode=(\S+)")
    end = time.time() + timeout_s
    while time.time() < end:
        with open(cluster.logs["router"], "rb") as f:
            f.seek(since)
            found = [m.group(1) for m in map(pat.search, f.read().decode("utf-8", "replace")
                                             .splitlines()) if m]
        if found:
            return found[-1]
        time.sleep(0.05)
    raise AssertionError("no dispatch logged\n" + cluster.tail("router", 40))


def resumed_index(cluster, request_id, timeout_s=60.0):
    """The output index at which the router resumed request_id, from its log line."""
    pat = re.compile(r"\breq=" + re.escape(request_id) +
                     r" .*re-dispatching: .*; resuming at output index (\d+)")
    end = time.time() + timeout_s
    while time.time() < end:
        with open(cluster.logs["router"]) as f:
            for line in f:
                m = pat.search(line)
                if m:
                    return int(m.group(1))
        time.sleep(0.05)
    raise AssertionError("no migration logged for " + request_id + "\n" +
                         cluster.tail("router", 60))


def check_stream(res, ref):
    """res is ref exactly: same ids and text, chunk indices contiguous from 0, usage counts
    each token once."""
    assert res.status == "OK", (res, res.message)
    at = 0
    for ch in res.chunks:
        if ch.token_ids:
            assert ch.index == at, ("gap or repeat", ch.index, at)
            at += len(ch.token_ids)
    assert res.token_ids == ref.token_ids
    assert res.text == ref.text
    assert res.final is not None and res.final.finish_reason == ref.final.finish_reason
    assert res.final.usage.completion_tokens == len(ref.token_ids)
    assert res.final.usage.prompt_tokens == ref.final.usage.prompt_tokens
    t = res.final.timings
    assert 0 < t.ttft_s <= t.e2e_s


def run_killing_holder(cluster, req):
    """Streams req; after its first FIRST tokens, kills (SIGKILL) the decode node that runs it and
    collects the rest. Returns (result, the node killed)."""
    cl = cluster.client()
    since = log_size(cluster)
    try:
        call = cl.start(req)
        res = Result()
        results = {call: res}
        end = time.time() + 120
        while len(res.token_ids) < FIRST:  # the decode node streams
            assert time.time() < end, "no first chunk"
            got = cl.recv(1)
            if got is None or got[0].call_id != call:
                continue
            h, body = got
            assert h.kind == pb.FRAME_KIND_STREAM, (h.kind, h.status, h.message)
            ch = pb.GenerateChunk()
            ch.ParseFromString(body)
            res.chunks.append(ch)
            res.token_ids.extend(ch.token_ids)
            res.text += ch.text
        victim = dispatched_to(cluster, since, req.request_id or None)
        cluster.kill(victim)
        cl.collect(results, timeout_s=300)
        return res, victim
    finally:
        cl.close()


@pytest.mark.parametrize("kind", ["greedy", "seeded"])
def test_stream_survives_decode_kill(cluster, kind):
    ensure_decode_up(cluster)
    sp = dict(temperature=0.0) if kind == "greedy" else \
        dict(temperature=0.9, seed=20261202, repetition_penalty=1.15, penalty_last_n=32)
    req = prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True, **sp)
    cl = cluster.client()
    ref = cl.generate(req)  # the undisturbed run
    cl.close()
    assert ref.status == "OK" and len(ref.token_ids) == MAX_TOKENS, ref
    for attempt in range(TRIES):
        ensure_decode_up(cluster)
        migrated = counter(cluster, "tandem_requests_migrated_total")
        req.request_id = f"mig-{kind}-{attempt}"
        res, victim = run_killing_holder(cluster, req)
        check_stream(res, ref)  # moved or not, the same stream
        if counter(cluster, "tandem_requests_migrated_total") == migrated + 1:
            break
    else:
        raise AssertionError(f"the kill never came before the end of the stream ({TRIES} tries)")
    # it moved: resumed after some tokens and before the end, on the decode node left
    at = resumed_index(cluster, req.request_id)
    assert FIRST <= at < MAX_TOKENS, at
    nodes = cluster.nodes()
    assert not nodes[victim].up
    survivor = [d for d in cluster.decode_ids if d != victim][0]
    assert nodes[survivor].up


def sse_stream(port, payload, on_first=None, timeout_s=300):
    """POSTs a streaming /v1/completions and returns its data: payloads, parsed (the [DONE]
    marker excluded); on_first() runs once, after the first FIRST events."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("POST", "/v1/completions", body=json.dumps(payload),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.status == 200, (r.status, r.read())
        events = []
        done = False
        while not done:
            line = r.readline()
            assert line, "the stream ended without [DONE]"
            line = line.decode("utf-8").rstrip("\n")
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                continue
            ev = json.loads(data)
            assert "error" not in ev, ev
            events.append(ev)
            if on_first and len(events) >= FIRST:
                on_first()
                on_first = None
        return events
    finally:
        conn.close()


def test_http_stream_survives_decode_kill(cluster):
    """The same through the HTTP gateway's SSE stream, seeded, with a stop string that only
    matches after the kill: the router's held text carries over the migration."""
    ensure_decode_up(cluster)
    payload = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.9, "seed": 99,
               "ignore_eos": True, "stream": True}
    full = "".join(ev["choices"][0]["text"] for ev in sse_stream(cluster.port, payload)
                   if ev["choices"])
    assert len(full) > 40, full
    # a stop string from the last quarter of the undisturbed text
    words = [w for w in re.findall(r"\w{4,}", full[3 * len(full) // 4:])]
    assert words, full
    stop = words[0]
    payload["stop"] = [stop]
    ref = "".join(ev["choices"][0]["text"] for ev in sse_stream(cluster.port, payload)
                  if ev["choices"])
    assert ref == full[:full.index(stop)], (ref, stop)
    for _ in range(TRIES):
        ensure_decode_up(cluster)
        migrated = counter(cluster, "tandem_requests_migrated_total")
        killed = []
        since = log_size(cluster)

        def kill_holder():
            victim = dispatched_to(cluster, since)
            cluster.kill(victim)
            killed.append(victim)

        events = sse_stream(cluster.port, payload, on_first=kill_holder)
        assert killed, "the stream had no text"
        text = "".join(ev["choices"][0]["text"] for ev in events if ev["choices"])
        assert text == ref
        finals = [ev["choices"][0].get("finish_reason") for ev in events if ev["choices"]]
        assert finals[-1] == "stop", finals
        if counter(cluster, "tandem_requests_migrated_total") == migrated + 1:
            break
    else:
        raise AssertionError(f"the kill never came before the end of the stream ({TRIES} tries)")


def test_no_decode_node_left_is_unavailable(cluster):
    """The last decode node dies mid-stream: nowhere to migrate to, UNAVAILABLE as before."""
    for _ in range(TRIES):
        ensure_decode_up(cluster)
        cluster.kill(cluster.decode_ids[0])
        end = time.time() + 60
        while cluster.nodes()[cluster.decode_ids[0]].up:  # the router saw it go
            assert time.time() < end, "decode-0 still up"
            time.sleep(0.05)
        req = prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                             ignore_eos=True)
        res, victim = run_killing_holder(cluster, req)
        assert victim == cluster.decode_ids[1]
        if res.status != "OK":  # OK: the stream had ended before the kill
            break
    assert res.status == "UNAVAILABLE", res
    assert f"decode node '{victim}' is down" in res.message, res.message
    assert "no decode node is up to run it again" in res.message, res.message
    assert res.final is not None and res.final.finish_reason == pb.FINISH_REASON_ERROR
