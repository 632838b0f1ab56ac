"""The router's OpenAI-compatible HTTP gateway, driven by the official `openai` client, curl and
raw sockets, against a real cluster (router + prefill + decode processes).

Greedy and seeded outputs must equal `tandem generate -m MODEL` byte for byte (the engine is
batch-invariant). Needs the `openai` package: scripts/setup installs it into the venv
${XDG_CACHE_HOME:-~/.cache}/tandem/venv, whose python ctest uses.
"""
import base64
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import threading
import time

import pytest

from conftest import BINARIES, Cluster, http_cluster, http_port, openai_client, reference
import tandem_client as tc

try:
    import openai
except ImportError:  # pragma: no cover - a setup problem, reported as a failure
    pytest.fail("the `openai` package is missing: run scripts/setup (it installs it into "
                "~/.cache/tandem/venv, the python ctest uses)", pytrace=False)

PROMPT = "The capital of France is"
CHAT = "What is 2 + 2?"


def request(port, method, path, body=None, headers=None, timeout=60):
    """One HTTP request; returns (status, headers, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        if isinstance(body, (dict, list)):
            body = json.dumps(body)
        conn.request(method, path, body=body,
                     headers=dict({"Content-Type": "application/json"}, **(headers or {})))
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


def sse_events(raw):
    """The data: payloads of an SSE body, in order; asserts the framing."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), text[-200:]
    events = text[:-2].split("\n\n")
    out = []
    for ev in events:
        assert ev.startswith("data: "), ev
        assert "\n" not in ev, ev
        out.append(ev[len("data: "):])
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "http")


@pytest.fixture(scope="module")
def oai(cluster):
    yield from openai_client(cluster, timeout=120)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def test_health_ready_models(cluster, oai):
    st, hd, body = request(cluster.port, "GET", "/health")
    assert (st, json.loads(body)) == (200, {"status": "ok"})
    assert hd["Content-Type"] == "application/json"
    st, _, body = request(cluster.port, "GET", "/ready")
    assert st == 200 and json.loads(body)["ready"] is True, body
    models = oai.models.list().data
    assert [m.id for m in models] == ["SmolLM2-135M-Instruct.Q4_1"]
    assert models[0].object == "model" and models[0].owned_by == "tandem"
    assert oai.models.retrieve(models[0].id).id == models[0].id
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("no-such-model")
    st, _, body = request(cluster.port, "GET", "/v1/models")
    assert st == 200 and json.loads(body)["object"] == "list"


def test_completions_match_the_single_process_output(oai, model):
    for prompt, n in [(PROMPT, 16), ("def fibonacci(n):", 24)]:
        ref = reference(prompt=prompt, max_tokens=n)
        r = oai.completions.create(model=model, prompt=prompt, max_tokens=n, temperature=0)
        assert r.object == "text_completion" and r.id.startswith("cmpl-")
        assert r.model == model and r.created > 1.7e9
        assert r.choices[0].text == ref
        assert r.choices[0].index == 0
        assert r.choices[0].finish_reason in ("stop", "length")
        u = r.usage
        assert u.completion_tokens <= n and u.prompt_tokens > 0
        assert u.total_tokens == u.prompt_tokens + u.completion_tokens
        if r.choices[0].finish_reason == "length":
            assert u.completion_tokens == n
    # the prompt as an array of one string is the same request
    r = oai.completions.create(model=model, prompt=[PROMPT], max_tokens=16, temperature=0)
    assert r.choices[0].text == reference(prompt=PROMPT, max_tokens=16)


def test_completions_stream_with_usage(oai, model):
    ref = reference(prompt=PROMPT, max_tokens=20)
    chunks = list(oai.completions.create(model=model, prompt=PROMPT, max_tokens=20,
                                         temperature=0, stream=True,
                                         stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref
    assert len({c.id for c in chunks}) == 1
    assert all(c.object == "text_completion" for c in chunks)
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    # the last chunk has empty choices and the usage; the others usage null
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_matches_the_single_process_output(oai, model):
    ref = reference(chat=CHAT, max_tokens=24)
    msgs = [{"role": "user", "content": CHAT}]
    r = oai.chat.completions.create(model=model, messages=msgs, max_tokens=24, temperature=0)
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref
    assert r.usage.completion_tokens > 0
    # max_completion_tokens is the newer name; content as parts is the same message
    r2 = oai.chat.completions.create(
        model=model, max_completion_tokens=24, temperature=0,
        messages=[{"role": "user", "content": [{"type": "text", "text": CHAT}]}])
    assert r2.choices[0].message.content == ref
    chunks = list(oai.chat.completions.create(model=model, messages=msgs, max_tokens=24,
                                              temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref
    assert chunks[-1].choices[0].finish_reason == r.choices[0].finish_reason


def test_chat_default_max_tokens_fits_the_context(oai, model):
    # no max_tokens: up to min(context left, 1024) tokens; the answer ends with EOS
    msgs = [{"role": "user", "content": CHAT}]
    r = oai.chat.completions.create(model=model, messages=msgs, temperature=0)
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == reference(chat=CHAT, max_tokens=1024)


def test_chat_default_max_tokens_shrinks_to_the_context_left(tmp_path):
    # a prompt that leaves fewer than 1024 tokens of the 4096-token context: the gateway sends
    # no max_tokens and the router gives what fits, at once (no refusal, no retry). The
    # ~3100-token prefill is slow on a loaded CPU (minutes under ASan), so the cluster has no
    # prefill node: the decode node prefills locally, without a KV-transfer timeout. The stop
    # string keeps the answer short.
    c = Cluster(str(tmp_path / "long"), n_prefill=0, n_decode=1)
    c.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port(c)}/v1", api_key="x",
                               max_retries=0, timeout=1200)
        long = "Repeat this. " + "The quick brown fox jumps over the lazy dog. " * 307
        r = client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", temperature=0,
                                           stop=["."],
                                           messages=[{"role": "user", "content": long}])
        client.close()
        u = r.usage
        assert 3072 < u.prompt_tokens < 4096 - 16, u
        assert u.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
        with open(c.logs["router"]) as f:
            log = f.readlines()
        # the gateway reaches the router in-process, not over TCP loopback
        assert any("http gateway ready" in ln and "router=inproc://tandem-router-" in ln
                   for ln in log), log[:20]
        lines = [ln for ln in log if r.id in ln]
        assert not any("request refused" in ln for ln in lines), lines
        # nor counted as refused (by the router or the gateway)
        st, _, body = request(http_port(c), "GET", "/metrics")
        text = body.decode()
        assert st == 200
        assert 'status="INVALID_ARGUMENT"' not in text
        assert "tandem_http_requests_refused_total{" not in text
        assert any("request accepted" in ln and f"max_tokens={4096 - u.prompt_tokens}" in ln
                   for ln in lines), lines
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_sampling_fields_and_stop(oai, model):
    ref = reference(prompt=PROMPT, max_tokens=16, temperature=0.8, seed=42)
    kw = dict(model=model, prompt=PROMPT, max_tokens=16, temperature=0.8, seed=42)
    a = oai.completions.create(**kw).choices[0].text
    b = oai.completions.create(**kw, stream=True)
    assert a == ref == "".join(c.choices[0].text for c in b)
    # every documented field is accepted (vLLM's extensions through extra_body); unknown ones
    # are ignored
    r = oai.completions.create(
        model=model, prompt=PROMPT, max_tokens=8, temperature=0.7, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, seed=7, n=1, user="someone",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
                    "no_such_field": {"x": 1}})
    assert r.usage.completion_tokens >= 1
    # stop strings end the text before them
    full = reference(prompt=PROMPT, max_tokens=16)
    assert "." in full
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                               stop=".")
    assert r.choices[0].text == full[:full.index(".")]
    assert r.choices[0].finish_reason == "stop"
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0,
                               stop=["\n", "."])
    assert r.choices[0].text == full[:full.index(".")]


def test_logprobs(oai, model):
    r = oai.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0,
                               logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    for tok, l, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert l <= 0 and 1 <= len(top) <= 3
        assert max(top.values()) == pytest.approx(l)  # greedy: the sampled token is the best
    r = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": CHAT}],
                                    max_tokens=3, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert "".join(c.token for c in content) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob == pytest.approx(c.logprob)
        assert bytes(c.bytes).decode("utf-8") == c.token


def test_errors_are_openai_exceptions(oai, model):
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=PROMPT, temperature=9)
    assert e.value.status_code == 400 and "temperature" in e.value.message
    assert e.value.body["param"] == "temperature" and e.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.NotFoundError) as e:
        oai.completions.create(model="no-such-model", prompt=PROMPT)
    assert e.value.body["code"] == "model_not_found" and "no-such-model" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=PROMPT, n=17)  # served: 1..16
    assert e.value.body["param"] == "n" and "n must be from 1 to 16" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=PROMPT, max_tokens=5000)
    assert e.value.body["param"] == "max_tokens" and "4096" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=[])
    assert e.value.body["param"] == "messages"
    # fields the router refuses: the END's ErrorDetail names them, no message is parsed
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=model, prompt=PROMPT, stop=["ok", "x" * 300])
    assert e.value.body["param"] == "stop[1]" and "stop[1]" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, max_completion_tokens=5000,
                                    messages=[{"role": "user", "content": CHAT}])
    assert e.value.body["param"] == "max_completion_tokens" and "4096" in e.value.message


def test_malformed_requests_name_the_problem(cluster, model):
    p = cluster.port
    st, hd, body = request(p, "POST", "/v1/completions", body='{"model": "x", "prompt": ')
    err = json.loads(body)["error"]
    assert st == 400 and "not valid JSON" in err["message"], body
    assert set(err) == {"message", "type", "param", "code"}
    st, _, body = request(p, "POST", "/v1/completions",
                          body={"model": model, "prompt": PROMPT, "max_tokens": "ten"})
    err = json.loads(body)["error"]
    assert st == 400 and err["param"] == "max_tokens" and "integer" in err["message"], body
    for mt in (0, -1, 10 ** 12):  # the range the message gives is the one enforced
        st, _, body = request(p, "POST", "/v1/completions",
                              body={"model": model, "prompt": PROMPT, "max_tokens": mt})
        err = json.loads(body)["error"]
        assert st == 400 and err["param"] == "max_tokens", body
        assert f"max_tokens must be in 1..2147483647, got {mt}" in err["message"], body
    st, _, body = request(p, "POST", "/v1/chat/completions",
                          body={"model": model, "messages": [{"role": "user", "content": 5}]})
    err = json.loads(body)["error"]
    assert st == 400 and err["param"] == "messages[0].content", body
    st, _, body = request(p, "POST", "/v1/chat/completions",
                          body='{"model": "x", "messages": [{"role": "user", "content": "a\\u0000b"}]}')
    err = json.loads(body)["error"]
    assert st == 400 and "cannot contain NUL" in err["message"], body
    assert "JSON_ALLOW_NUL" not in err["message"] and "not valid JSON" not in err["message"], body
    st, _, body = request(p, "POST", "/v1/completions", body=[1, 2])
    assert st == 400 and "JSON object" in json.loads(body)["error"]["message"]
    st, _, body = request(p, "POST", "/v1/completions", body={"model": model})
    assert st == 400 and json.loads(body)["error"]["param"] == "prompt"
    st, _, _ = request(p, "GET", "/v1/completions")
    assert st == 405
    st, _, body = request(p, "GET", "/no/such/path")
    assert st == 404 and json.loads(body)["error"]["type"] == "not_found_error"


def test_body_too_large_is_413(cluster, model):
    big = json.dumps({"model": model, "prompt": "a " * (3 << 20)})  # 6 MiB
    st, _, body = request(cluster.port, "POST", "/v1/completions", body=big)
    assert st == 413, body
    assert json.loads(body)["error"]["code"] == "request_too_large"
    # curl announces the size and waits for 100 Continue: the 413 comes before the body
    out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}",
                          "-H", "Content-Type: application/json", "--data-binary", "@-",
                          f"http://127.0.0.1:{cluster.port}/v1/completions"],
                         input=big.encode(), capture_output=True, timeout=60)
    assert out.stdout == b"413", out
    # the gateway still serves
    st, _, _ = request(cluster.port, "GET", "/health")
    assert st == 200


def test_sse_with_curl(cluster, model):
    ref = reference(prompt=PROMPT, max_tokens=12)
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0,
                       "stream": True})
    out = subprocess.run(["curl", "-sN", "-D", "-", "-H", "Content-Type: application/json",
                          "-d", body, f"http://127.0.0.1:{cluster.port}/v1/completions"],
                         capture_output=True, timeout=120, check=True)
    head, _, raw = out.stdout.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"Content-Type: text/event-stream" in head
    assert b"Transfer-Encoding: chunked" in head
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "text_completion" and c["model"] == model for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # chat: the role first, then content deltas, then the finish with an empty delta
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": CHAT}],
                       "max_tokens": 12, "temperature": 0, "stream": True})
    out = subprocess.run(["curl", "-sN", "-H", "Content-Type: application/json", "-d", body,
                          f"http://127.0.0.1:{cluster.port}/v1/chat/completions"],
                         capture_output=True, timeout=120, check=True)
    events = sse_events(out.stdout)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0]["delta"] == {}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == reference(chat=CHAT, max_tokens=12)


def open_stream(port, path, payload, rcvbuf=None):
    """Sends a streaming POST on a raw socket and returns the socket (nothing read)."""
    s = socket.socket()
    if rcvbuf:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.connect(("127.0.0.1", port))
    body = json.dumps(payload).encode()
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
              b"Content-Type: application/json\r\nContent-Length: " +
              str(len(body)).encode() + b"\r\n\r\n" + body)
    return s


def recv_until(s, marker, timeout=60):
    s.settimeout(timeout)
    buf = b""
    while marker not in buf:
        b = s.recv(65536)
        if not b:
            break
        buf += b
    return buf


def status(cluster):
    """The dashboard's JSON (the router's status as of the last second's sample)."""
    st, _, body = request(cluster.port, "GET", "/api/status")
    assert st == 200
    return json.loads(body)


def running(cluster):
    """Requests the router runs now (native Status call)."""
    c = cluster.client()
    try:
        return c.status().requests_running
    finally:
        c.close()


def wait_for(pred, what, timeout_s=60):
    """Polls pred() until it returns a true value (returned), failing after timeout_s."""
    end = time.time() + timeout_s
    while True:
        v = pred()
        if v:
            return v
        assert time.time() < end, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.05)


def wait_running_with_blocks(cluster):
    """Waits until the router runs one request and decode-0 reports KV blocks for it (the
    block figures come with its heartbeats, so they lag by one)."""
    wait_for(lambda: running(cluster) == 1 and cluster.nodes()["decode-0"].load.kv_blocks_used > 0,
             "one running request holding KV blocks on decode-0")


def peek_until(s, marker, timeout_s=60):
    """Waits until marker has arrived on s, without reading anything off it."""
    end = time.time() + timeout_s
    while True:
        s.settimeout(max(0.01, end - time.time()))
        buf = s.recv(1 << 20, socket.MSG_PEEK)
        if marker in buf:
            return
        assert buf and time.time() < end, f"no {marker!r} after {timeout_s} s: {buf[-300:]!r}"
        time.sleep(0.05)


def test_disconnect_mid_stream_frees_blocks(cluster, model):
    for path, payload in [
        ("/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2000,
                             "ignore_eos": True, "stream": True}),
        ("/v1/chat/completions", {"model": model, "stream": True, "max_tokens": 2000,
                                  "ignore_eos": True,
                                  "messages": [{"role": "user", "content": CHAT}]}),
    ]:
        s = open_stream(cluster.port, path, payload)
        got = recv_until(s, b"data: {", 60)
        assert b"200 OK" in got
        wait_running_with_blocks(cluster)
        s.close()
        cluster.wait_idle(5.0)
        assert running(cluster) == 0
    # a non-streaming request whose client leaves before the answer is cancelled too
    s = open_stream(cluster.port, "/v1/completions",
                    {"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True})
    wait_running_with_blocks(cluster)
    s.close()
    cluster.wait_idle(5.0)
    with open(cluster.logs["router"]) as f:
        log = f.read()
    assert log.count("request cancelled") >= 3, log[-3000:]


def test_stalled_client_does_not_block_other_streams(cluster, oai, model):
    # A asks for a large stream (logprobs make each event ~1 KB, ~450 KB in all) and never
    # reads, with a tiny receive buffer: the gateway's writes to it block once the socket
    # buffers are full (the gateway caps a stream's send buffer; see http_generate.c)
    stalled = open_stream(cluster.port, "/v1/chat/completions", {
        "model": model, "stream": True, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
        "logprobs": True, "top_logprobs": 10,
        "messages": [{"role": "user", "content": CHAT}]}, rcvbuf=4096)
    try:
        # A streams: its first events reached the socket (peeking leaves them unread)
        peek_until(stalled, b"data: {")
        # B streams to completion meanwhile, with the exact single-process text (were B held
        # up behind A it would never end: the client's 120 s timeout fails it)
        ref = reference(prompt=PROMPT, max_tokens=24)
        b = oai.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0,
                                   stream=True)
        assert "".join(c.choices[0].text for c in b) == ref
        # A's generation finishes in the router while its HTTP stream is still stuck in
        # unsent data: the stall was real and held nobody else up. (The native Status is
        # live; /api/status's request figures are a sample up to a second old, but its
        # stream count is live.)
        wait_for(lambda: running(cluster) == 0, "A to finish in the router", 300)
        st = status(cluster)
        assert st["http"]["streams"] == 1, st["http"]
        # A then reads everything: nothing was lost
        raw = recv_until(stalled, b"data: [DONE]\n\n", 60)
        body = raw.partition(b"\r\n\r\n")[2]
        events = [json.loads(m) for m in re.findall(rb"data: (\{.*?\})\n\n", body)]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(len((e["choices"][0]["logprobs"] or {}).get("content", []))
                   for e in events) == 400
    finally:
        stalled.close()
    cluster.wait_idle(5.0)


def test_queue_full_is_429_with_retry_after(tmp_path):
    # a router without nodes and room for one queued request: the first waits in the queue,
    # the second is refused RESOURCE_EXHAUSTED "queue full" -> 429 with Retry-After (>= 1)
    c = Cluster(str(tmp_path / "qfull"), n_prefill=0, n_decode=1, extra_router="  max_queue: 1\n")
    c._spawn("router", [BINARIES["router"], "--config", c.config])
    port = http_port(c)
    body = {"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": "Hello", "max_tokens": 2}
    first = {}

    def queued():
        try:
            first["status"] = request(port, "POST", "/v1/completions", body, timeout=120)[0]
        except OSError as e:
            first["error"] = e

    t = None
    try:
        wait_for(lambda: _get_ok(port, "/health"), "the router's HTTP gateway")
        t = threading.Thread(target=queued, daemon=True)
        t.start()
        wait_for(lambda: b"\ntandem_requests_queued 1" in request(port, "GET", "/metrics")[2],
                 "one request in the router's queue")
        st, hd, raw = request(port, "POST", "/v1/completions", body)
        assert st == 429, raw
        assert int(hd["Retry-After"]) >= 1, hd
        err = json.loads(raw)["error"]
        assert err["code"] == "resource_exhausted" and "queue full" in err["message"], err
        metrics = request(port, "GET", "/metrics")[2]
        assert b"\ntandem_requests_queue_full_total 1" in metrics
        assert b"\ntandem_requests_shed_total 0" in metrics
    finally:
        codes = c.stop()
        if t:
            t.join(60)
    assert codes["router"] == 0, c.tail("router")


def _get_ok(port, path):
    try:
        return request(port, "GET", path, timeout=5)[0] == 200
    except OSError:
        return False


def test_metrics_endpoint(cluster):
    st, hd, body = request(cluster.port, "GET", "/metrics")
    assert st == 200, body
    assert hd["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
    assert b"# TYPE " in body


class KeyedCluster(Cluster):
    """A cluster whose router requires API keys; the fixture's own native calls send one."""

    def client(self, **kw):
        kw.setdefault("api_key", "sk-other")
        return super().client(**kw)


def test_api_keys(tmp_path):
    c = KeyedCluster(str(tmp_path / "keys"), n_prefill=0, n_decode=1,
                     extra_router="  api_keys: [sk-right, sk-other]\n")
    c.start()
    try:
        port = http_port(c)
        base = f"http://127.0.0.1:{port}/v1"
        good = openai.OpenAI(base_url=base, api_key="sk-right", max_retries=0)
        bad = openai.OpenAI(base_url=base, api_key="sk-wrong", max_retries=0)
        model = good.models.list().data[0].id
        r = good.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
        assert r.choices[0].text == reference(prompt=PROMPT, max_tokens=8)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.completions.create(model=model, prompt=PROMPT, max_tokens=8)
        assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        with pytest.raises(openai.AuthenticationError):
            list(bad.chat.completions.create(model=model, stream=True, max_tokens=4,
                                             messages=[{"role": "user", "content": CHAT}]))
        st, _, body = request(port, "POST", "/v1/completions",
                              body={"model": model, "prompt": PROMPT})
        assert st == 401 and "Authorization: Bearer" in json.loads(body)["error"]["message"]
        # a token longer than any key can be is a wrong key, for /v1 and the state alike
        for path in ("/v1/models", "/metrics"):
            st, _, body = request(port, "GET", path,
                                  headers={"Authorization": "Bearer sk-right" + "x" * 300})
            assert st == 401 and "not accepted" in json.loads(body)["error"]["message"], body
        # liveness and readiness (a decode node alone is enough) need no key, and readiness
        # tells nothing about the model
        assert request(port, "GET", "/health")[0] == 200
        st, _, body = request(port, "GET", "/ready")
        assert st == 200 and json.loads(body)["ready"] is True
        assert "fingerprint" not in body.decode() and "model" not in json.loads(body)
        assert "refused" not in json.loads(body)  # node ids and reasons: state, needs the key
        # the cluster's state needs one: Bearer, or a browser's Basic with the key as password
        for path in STATE_PATHS:
            st, hd, body = request(port, "GET", path)
            assert st == 401, (path, st, body)
            err = json.loads(body)["error"]
            assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error"
            assert "Basic" in hd.get("WWW-Authenticate", ""), hd
            st, _, body = request(port, "GET", path, headers={"Authorization": "Bearer sk-wrong"})
            assert st == 401 and "not accepted" in json.loads(body)["error"]["message"], path
            st, _, body = request(port, "GET", path, headers={"Authorization": "Bearer sk-right"})
            assert st == 200, (path, st, body)
            st, _, _ = request(port, "GET", path, headers={"Authorization": BASIC_RIGHT})
            assert st == 200, path
        # the native STATUS and METRICS calls alike
        for method, req, resp in NATIVE_STATE:
            anon = tc.Client(c.client_ep)
            try:
                st, msg, _ = anon.unary(method, req, resp)
                assert st == "UNAUTHENTICATED", (method, st, msg)
            finally:
                anon.close()
            keyed = tc.Client(c.client_ep, api_key="sk-right")
            try:
                assert keyed.unary(method, req, resp)[0] == "OK", method
            finally:
                keyed.close()
        # `tandem status` takes the key from --api-key or $TANDEM_API_KEY
        cli = [BINARIES["tandem"], "status", "--router", c.client_ep, "--timeout", "10"]
        env = {k: v for k, v in os.environ.items() if k != "TANDEM_API_KEY"}
        r = subprocess.run(cli, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "UNAUTHENTICATED" in r.stderr, (r.returncode, r.stderr)
        r = subprocess.run(cli + ["--api-key", "sk-right"], env=env, capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0 and "decode-0" in r.stdout, (r.returncode, r.stderr)
        r = subprocess.run(cli, env=dict(env, TANDEM_API_KEY="sk-other"), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, (r.returncode, r.stderr)
        good.close()
        bad.close()
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


STATE_PATHS = ("/metrics", "/api/status", "/", "/api/capacity?users=1")
BASIC_RIGHT = "Basic " + base64.b64encode(b"anyone:sk-right").decode()
NATIVE_STATE = ((tc.pb.METHOD_STATUS, tc.pb.StatusRequest(), tc.pb.ClusterStatus),
                (tc.pb.METHOD_METRICS, tc.pb.MetricsRequest(), tc.pb.MetricsResponse))


def test_public_metrics(tmp_path):
    """router.public_metrics: true leaves the cluster's state open while /v1 keeps its keys."""
    c = KeyedCluster(str(tmp_path / "public"), n_prefill=0, n_decode=1,
                     extra_router="  api_keys: [sk-right, sk-other]\n  public_metrics: true\n")
    c.start()
    try:
        port = http_port(c)
        for path in STATE_PATHS + ("/health", "/ready"):
            st, _, body = request(port, "GET", path)
            assert st == 200, (path, st, body)
        st, _, body = request(port, "GET", "/v1/models")
        assert st == 401, body
        for method, req, resp in NATIVE_STATE:
            anon = tc.Client(c.client_ep)
            try:
                assert anon.unary(method, req, resp)[0] == "OK", method
                st, _, _ = anon.unary(tc.pb.METHOD_MODELS, tc.pb.ModelsRequest(),
                                      tc.pb.ModelsResponse)
                assert st == "UNAUTHENTICATED"
            finally:
                anon.close()
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_ready_is_503_without_a_decode_node(tmp_path):
    # request_timeout_s: 3, so that a request nothing can serve ends within the test
    c = Cluster(str(tmp_path / "nodecode"), n_prefill=1, n_decode=1,
                extra_router="  request_timeout_s: 3\n")
    c.start()
    try:
        port = http_port(c)
        assert request(port, "GET", "/ready")[0] == 200
        c.kill("decode-0")
        end = time.time() + 60  # the heartbeat timeout (2.5 s), however late a busy machine
        st = None
        while time.time() < end:
            st, _, body = request(port, "GET", "/ready")
            if st == 503:
                break
            time.sleep(0.2)
        assert st == 503 and json.loads(body)["ready"] is False, body
        assert request(port, "GET", "/health")[0] == 200  # still live
        # a request waits in the queue for a decode node until its deadline: 408 Request
        # Timeout (DEADLINE_EXCEEDED), as OpenAI-compatible servers (OpenRouter) answer
        st, _, body = request(port, "POST", "/v1/completions",
                              body={"model": "SmolLM2-135M-Instruct.Q4_1", "prompt": PROMPT,
                                    "max_tokens": 4})
        err = json.loads(body)["error"]
        assert st == 408 and err["type"] == "timeout" and err["code"] == "deadline_exceeded", body
    finally:
        c.stop()


def recv_all(s, timeout=120):
    """Everything s receives until the peer closes it."""
    s.settimeout(timeout)
    buf = b""
    while True:
        b = s.recv(65536)
        if not b:
            return buf
        buf += b


def dechunk(b):
    """The payload of an HTTP/1.1 chunked body (which must end with its last chunk)."""
    out = b""
    while True:
        size, _, b = b.partition(b"\r\n")
        n = int(size.split(b";")[0], 16)
        if n == 0:
            return out
        out += b[:n]
        assert b[n:n + 2] == b"\r\n", b[:n + 2][-20:]
        b = b[n + 2:]


def test_router_sigterm_answers_requests_in_flight(tmp_path):
    # SIGTERM ends every request with UNAVAILABLE "router shutting down"; the HTTP gateway
    # must still write that answer (a 503 JSON error; an SSE error event and [DONE]) before
    # it closes its connections
    c = Cluster(str(tmp_path / "sigterm"), n_prefill=1, n_decode=1)
    c.start()
    try:
        port = http_port(c)
        model = "SmolLM2-135M-Instruct.Q4_1"
        stream = open_stream(port, "/v1/completions",
                             {"model": model, "prompt": PROMPT, "max_tokens": 3000,
                              "ignore_eos": True, "stream": True})
        first = recv_until(stream, b"data: {", 60)
        assert b"200 OK" in first, first
        whole = open_stream(port, "/v1/completions",
                            {"model": model, "prompt": PROMPT, "max_tokens": 3000,
                             "ignore_eos": True})
        wait_for(lambda: running(c) == 2, "both requests running")
        c.kill("router", signal.SIGTERM)
        assert c.procs["router"].returncode == 0, c.tail("router")
        raw = recv_all(whole)
        head, _, body = raw.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503"), raw[:300]
        err = json.loads(body)["error"]
        assert err["code"] == "unavailable" and "shutting down" in err["message"], body
        raw = first + recv_all(stream)
        head, _, body = raw.partition(b"\r\n\r\n")
        if b"chunked" in head.lower():
            body = dechunk(body)
        events = sse_events(body)
        assert events[-1] == "[DONE]", events[-3:]
        err = json.loads(events[-2])["error"]
        assert err["code"] == "unavailable" and "shutting down" in err["message"], events[-2]
    finally:
        c.stop()
