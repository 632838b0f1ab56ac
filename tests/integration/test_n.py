"""Several choices of one prompt (`n`, `best_of`) and lists of prompts on the OpenAI API.

`n > 1` is one prefill: choice 0 runs as any request, the others fork its sequence on the
decode node (their prompt KV blocks shared by reference) and sample with seed + i. The
checks: greedy choices are identical, seeded ones are each the single request with seed + i,
the prefill node saw the prompt once, the decode node's KV blocks are all free afterwards,
streams carry every choice's index and finish, best_of keeps the most likely candidate, a
prompt list answers choice p * n + j, and the limits are refused naming the field.
"""
import http.client
import json
import socket
import subprocess
import time

import pytest

from conftest import BINARIES, http_cluster
import tandem_client as tc

# Two full KV blocks and a bit (the tiny default model's blocks are 16 tokens): the forks share
# the full ones.
PROMPT = ("Tandem serves language models across prefill and decode nodes; the prompt is "
          "prefilled once and every choice decodes on its own: ")


def request(port, body, timeout=120):
    """POST /v1/completions (or chat when body has messages); returns (status, json or text)."""
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, body=json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        if body.get("stream") and r.status == 200:
            return r.status, raw.decode("utf-8")
        return r.status, json.loads(raw)
    finally:
        conn.close()


def sse(text):
    """The JSON events of an SSE body, without [DONE] (which must end it)."""
    events = [ev[len("data: "):] for ev in text.strip().split("\n\n")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "n")


def node(cluster, name):
    return cluster.nodes()[name]


def wait_kv_free(cluster):
    """The decode node's heartbeats report every block free again (none used)."""
    end = time.time() + 30
    while node(cluster, "decode-0").load.kv_blocks_used != 0:
        assert time.time() < end, node(cluster, "decode-0")
        time.sleep(0.1)


def settled_prefix(cluster):
    """The prefill node's (prefix queries, hits) once two reads a heartbeat apart agree."""
    last = None
    end = time.time() + 30
    while True:
        st = node(cluster, "prefill-0")
        cur = (st.load.prefix_queries, st.load.prefix_hits)
        if cur == last:
            return cur
        assert time.time() < end
        last = cur
        time.sleep(0.6)


def texts(body):
    assert [c["index"] for c in body["choices"]] == list(range(len(body["choices"])))
    return [c["text"] for c in body["choices"]]


def test_greedy_choices_are_identical(cluster):
    st, body = request(cluster.port, {"prompt": PROMPT + "greedy", "max_tokens": 12, "n": 3,
                                      "temperature": 0})
    assert st == 200, body
    t = texts(body)
    assert len(t) == 3 and t[0] == t[1] == t[2] and t[0]
    st, one = request(cluster.port, {"prompt": PROMPT + "greedy", "max_tokens": 12,
                                     "temperature": 0})
    assert one["choices"][0]["text"] == t[0]
    u = body["usage"]
    assert u["prompt_tokens"] == one["usage"]["prompt_tokens"]  # the prompt counted once
    assert u["completion_tokens"] == 3 * one["usage"]["completion_tokens"]
    wait_kv_free(cluster)


def test_seeded_choices_are_seed_plus_i_and_prefilled_once(cluster):
    # prompts no request had before (their first block differs): the prefix cache has none
    q0, h0 = settled_prefix(cluster)
    st, one = request(cluster.port, {"prompt": "Alpha. " + PROMPT, "max_tokens": 10,
                                     "temperature": 1.0, "seed": 900})
    assert st == 200, one
    q1, h1 = settled_prefix(cluster)
    st, body = request(cluster.port, {"prompt": "Omega. " + PROMPT, "max_tokens": 10,
                                      "temperature": 1.0, "seed": 7, "n": 3})
    assert st == 200, body
    q2, h2 = settled_prefix(cluster)
    # n = 3 looked the prompt up once, as n = 1 did, and found nothing: a second prefill of
    # it would have hit the first one's blocks
    assert h1 == h0 and h2 == h1, (h0, h1, h2)
    assert q2 - q1 == q1 - q0 > 0, (q0, q1, q2)
    t = texts(body)
    assert len(set(t)) == 3, t
    for i in range(3):
        st, ref = request(cluster.port, {"prompt": "Omega. " + PROMPT, "max_tokens": 10,
                                         "temperature": 1.0, "seed": 7 + i})
        assert ref["choices"][0]["text"] == t[i], i
    wait_kv_free(cluster)


def test_stream_carries_every_index_and_finish(cluster):
    st, raw = request(cluster.port, {"prompt": PROMPT + "stream", "max_tokens": 8, "n": 2,
                                     "temperature": 1.0, "seed": 3, "stream": True,
                                     "stream_options": {"include_usage": True}})
    assert st == 200, raw
    events = sse(raw)
    text = {0: "", 1: ""}
    finishes = {}
    for ev in events[:-1]:
        for c in ev["choices"]:
            text[c["index"]] += c["text"]
            if c["finish_reason"]:
                assert c["index"] not in finishes
                finishes[c["index"]] = c["finish_reason"]
    assert sorted(finishes) == [0, 1]
    usage = events[-1]["usage"]
    assert events[-1]["choices"] == [] and usage["completion_tokens"] > 0
    st, whole = request(cluster.port, {"prompt": PROMPT + "stream", "max_tokens": 8, "n": 2,
                                       "temperature": 1.0, "seed": 3})
    assert texts(whole) == [text[0], text[1]]
    assert whole["usage"] == usage


def test_chat_n(cluster):
    st, body = request(cluster.port, {"messages": [{"role": "user", "content": "Hi there"}],
                                      "max_tokens": 6, "n": 2, "temperature": 1.0, "seed": 11})
    assert st == 200, body
    assert [c["index"] for c in body["choices"]] == [0, 1]
    for i, c in enumerate(body["choices"]):
        st, ref = request(cluster.port, {"messages": [{"role": "user", "content": "Hi there"}],
                                         "max_tokens": 6, "temperature": 1.0, "seed": 11 + i})
        assert ref["choices"][0]["message"]["content"] == c["message"]["content"]


def test_best_of_returns_the_most_likely(cluster):
    base = {"prompt": PROMPT + "best", "max_tokens": 6, "temperature": 1.0, "seed": 40}
    st, cands = request(cluster.port, dict(base, n=3, logprobs=0))
    assert st == 200, cands
    scores = [sum(c["logprobs"]["token_logprobs"]) for c in cands["choices"]]
    st, best = request(cluster.port, dict(base, n=1, best_of=3))
    assert st == 200, best
    assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
    assert best["choices"][0]["text"] == cands["choices"][scores.index(max(scores))]["text"]
    st, two = request(cluster.port, dict(base, n=2, best_of=3, logprobs=0))
    order = sorted(range(3), key=lambda k: -scores[k])[:2]
    assert texts(two) == [cands["choices"][k]["text"] for k in order]


def test_prompt_list_gives_prompt_times_n_choices(cluster):
    prompts = [PROMPT + "first", [1, 450, 4996, 310]]  # a text and a token-id prompt
    st, body = request(cluster.port, {"prompt": prompts, "max_tokens": 5, "n": 2,
                                      "temperature": 1.0, "seed": 5})
    assert st == 200, body
    t = texts(body)
    assert len(t) == 4
    usage = 0
    for p, pr in enumerate(prompts):
        st, ref = request(cluster.port, {"prompt": pr, "max_tokens": 5, "n": 2,
                                         "temperature": 1.0, "seed": 5})
        assert texts(ref) == t[2 * p:2 * p + 2], p
        usage += ref["usage"]["prompt_tokens"]
    assert body["usage"]["prompt_tokens"] == usage
    st, raw = request(cluster.port, {"prompt": prompts, "max_tokens": 5, "n": 2,
                                     "temperature": 1.0, "seed": 5, "stream": True})
    assert st == 200, raw
    streamed = {}
    for ev in sse(raw):
        for c in ev["choices"]:
            streamed[c["index"]] = streamed.get(c["index"], "") + c["text"]
    assert [streamed[i] for i in range(4)] == t
    wait_kv_free(cluster)


@pytest.mark.parametrize("body,param,words", [
    ({"n": 17}, "n", "n must be from 1 to 16, got 17"),
    ({"n": 0}, "n", "n must be from 1 to 16, got 0"),
    ({"n": 3, "best_of": 2}, "best_of", "best_of must be from n (3) to 16, got 2"),
    ({"best_of": 17}, "best_of", "best_of must be from n (1) to 16, got 17"),
    ({"best_of": 0}, "best_of", "best_of must be from n (1) to 16, got 0"),
    ({"n": 1, "best_of": 2, "stream": True}, "best_of", "stream"),
    ({"prompt": []}, "prompt", "empty"),
    ({"prompt": ["a"] * 65}, "prompt", "at most 64"),
    ({"prompt": ["a", 3]}, "prompt[1]", "prompt[1] must be a string"),
    ({"prompt": [[1, 2], [1, -1]]}, "prompt[1][1]", "prompt[1][1] must be a token id"),
    ({"prompt": [[1, 2], []]}, "prompt[1]", "prompt[1] is an empty array"),
])
def test_refused_with_the_field_named(cluster, body, param, words):
    st, err = request(cluster.port, dict({"prompt": PROMPT, "max_tokens": 2}, **body))
    assert st == 400, err
    assert err["error"]["param"] == param and words in err["error"]["message"], err


@pytest.mark.parametrize("body,param,message", [
    ({"prompt": ["a", ""]}, "prompt[1]", "prompt[1] is empty"),
    ({"prompt": ["a", [1, 60000]]}, "prompt[1][1]",
     "prompt[1][1] = 60000 is out of the vocabulary (0..49151)"),
    ({"prompt": [[1, 2], [3, 99999999]]}, "prompt[1][1]",
     "prompt[1][1] = 99999999 is out of the vocabulary (0..49151)"),
    ({"prompt": [1, 60000]}, "prompt[1]", "prompt[1] = 60000 is out of the vocabulary (0..49151)"),
    ({"prompt": ["a", "x" * 40000]}, "prompt[1]",
     "prompt[1]: This model's maximum context length is 4096 tokens. However, you requested "
     "10002 tokens (10000 in the messages, 2 in the completion). Please reduce the length of "
     "the messages or completion."),
    ({"prompt": ["a", "x" * 4000], "max_tokens": 3500}, "max_tokens",
     "prompt[1]: This model's maximum context length is 4096 tokens. However, you requested "
     "4500 tokens (1000 in the messages, 3500 in the completion). Please reduce the length of "
     "the messages or completion."),
    ({"prompt": ["a", ""], "stream": True}, "prompt[1]", "prompt[1] is empty"),
    # a field of the whole request is not one prompt's
    ({"prompt": ["a", "b"], "temperature": 9}, "temperature", "temperature must be in [0, 5], got 9"),
])
def test_router_refusal_names_the_prompt_of_a_list(cluster, body, param, message):
    """The router refuses one prompt of a list (or one token of a token-id prompt): the error
    says which, in OpenAI's names (prompt[p], prompt[p][k]; not the native tokens.ids)."""
    st, err = request(cluster.port, dict({"max_tokens": 2}, **body))
    assert st == 400, err
    assert err["error"]["param"] == param and err["error"]["message"] == message, err
    wait_kv_free(cluster)


def _metric(text, name):
    """The value of the unlabelled-by-le series name (summed over its label sets)."""
    return sum(float(ln.split()[-1]) for ln in text.splitlines()
               if ln.startswith(name + "{") or ln.startswith(name + " "))


def test_list_with_a_refused_prompt_fails_whole(cluster):
    """A prompt list whose second prompt is refused (longer than the context) is refused as a
    whole, and the first prompt's work is cancelled (its KV blocks come back)."""
    st, err = request(cluster.port, {"prompt": ["Hello there", "x" * 40000], "max_tokens": 200,
                                     "ignore_eos": True})
    assert st == 400, err
    assert "tokens" in err["error"]["message"], err
    wait_kv_free(cluster)


def test_best_of_on_chat_is_refused(cluster):
    st, err = request(cluster.port, {"messages": [{"role": "user", "content": "Hi"}],
                                     "max_tokens": 2, "best_of": 2})
    assert st == 400, err
    assert err["error"]["param"] == "best_of", err
    assert "/v1/completions" in err["error"]["message"], err


def test_vllm_params_histograms(cluster):
    def scrape():
        conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=30)
        conn.request("GET", "/metrics")
        t = conn.getresponse().read().decode()
        conn.close()
        return t
    before = scrape()
    st, body = request(cluster.port, {"prompt": PROMPT, "max_tokens": 3, "n": 4,
                                      "temperature": 1, "seed": 5})
    assert st == 200
    text = scrape()
    # one observation per call (not per choice): the longest of the four choices
    name = "vllm:request_max_num_generation_tokens"
    assert _metric(text, name + "_count") - _metric(before, name + "_count") == 1
    longest = _metric(text, name + "_sum") - _metric(before, name + "_sum")
    used = body["usage"]["completion_tokens"]  # the four choices' tokens together
    assert -(-used // 4) <= longest <= min(used, 3), (longest, used)
    assert 'vllm:request_params_n_bucket{model_name=' in text
    n_le = [ln for ln in text.splitlines()
            if ln.startswith("vllm:request_params_n_bucket") and 'le="2"' in ln]
    inf = [ln for ln in text.splitlines()
           if ln.startswith("vllm:request_params_n_bucket") and 'le="+Inf"' in ln]
    assert float(inf[0].split()[-1]) > float(n_le[0].split()[-1])  # n = 4 is above 2
    assert "vllm:request_params_max_tokens_count" in text
    wait_kv_free(cluster)


def test_native_api_chunks_carry_their_choice(cluster):
    """GenerateRequest.n on the router's own API: each choice's chunks name it, each choice
    ends with its own final chunk, and the END follows the last; best_of > n is refused there
    naming the field."""
    cl = cluster.client()
    try:
        req = tc.prompt_request(PROMPT + "native", max_tokens=6, temperature=1.0, seed=21)
        req.n = 3
        res = cl.generate(req)
        assert res.status == "OK", res.message
        finals = [c for c in res.chunks if c.finish_reason]
        assert sorted(c.choice for c in finals) == [0, 1, 2]
        by = {i: "".join(c.text for c in res.chunks if c.choice == i) for i in range(3)}
        st, body = request(cluster.port, {"prompt": PROMPT + "native", "max_tokens": 6,
                                          "temperature": 1.0, "seed": 21, "n": 3})
        assert texts(body) == [by[0], by[1], by[2]]
        req.best_of = 4
        res = cl.generate(req)
        assert res.status == "INVALID_ARGUMENT" and "best_of" in res.message, res.message
    finally:
        cl.close()


def test_disconnect_cancels_every_choice(cluster):
    """A stream of n = 3 long choices whose client goes away: every choice is cancelled and
    the decode node's blocks all come back."""
    body = json.dumps({"prompt": PROMPT + "cancel", "max_tokens": 400, "n": 3,
                       "temperature": 1.0, "seed": 1, "ignore_eos": True, "stream": True})
    s = socket.create_connection(("127.0.0.1", cluster.port), timeout=60)
    s.sendall(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n{body}").encode())
    got = b""
    while got.count(b'"index":') < 6:  # a few tokens of the choices have come
        chunk = s.recv(4096)
        assert chunk, got
        got += chunk
    s.close()
    end = time.time() + 60
    while True:
        st = node(cluster, "decode-0")
        if st.load.kv_blocks_used == 0 and st.load.running == 0:
            break
        assert time.time() < end, st
        time.sleep(0.1)


def test_cli_prints_each_choice(cluster):
    out = subprocess.run([BINARIES["tandem"], "generate", "--router", cluster.client_ep, "-p",
                          PROMPT + "cli", "-n", "5", "--temperature", "1", "--seed", "8",
                          "--choices", "2"], capture_output=True, check=True, timeout=120)
    st, body = request(cluster.port, {"prompt": PROMPT + "cli", "max_tokens": 5, "n": 2,
                                      "temperature": 1.0, "seed": 8})
    # each choice is printed when it ends: in any order
    want = [f"--- choice {i} (finish: {c['finish_reason']}) ---\n{c['text']}\n"
            for i, c in enumerate(body["choices"])]
    got = out.stdout.decode()
    assert sorted(want) == sorted(got[got.index(w):got.index(w) + len(w)] for w in want), got
    assert len(got) == sum(map(len, want)), got


@pytest.fixture(scope="module")
def local_cluster(tmp_path_factory):
    """No prefill node: the decode node prefills locally, and forks wait for that."""
    yield from http_cluster(tmp_path_factory, "n-local", n_prefill=0)


def test_local_prefill_forks_wait_for_the_prompt(local_cluster):
    port = local_cluster.port
    st, body = request(port, {"prompt": PROMPT * 3, "max_tokens": 6, "n": 3,
                              "temperature": 1.0, "seed": 60})
    assert st == 200, body
    t = texts(body)
    for i in range(3):
        st, ref = request(port, {"prompt": PROMPT * 3, "max_tokens": 6, "temperature": 1.0,
                                 "seed": 60 + i})
        assert ref["choices"][0]["text"] == t[i], i
    # a first token that ends choice 0 at once: the forks run on their own, same answers
    st, one = request(port, {"prompt": PROMPT, "max_tokens": 1, "n": 2, "temperature": 1.0,
                             "seed": 3})
    assert st == 200, one
    for i in range(2):
        st, ref = request(port, {"prompt": PROMPT, "max_tokens": 1, "temperature": 1.0,
                                 "seed": 3 + i})
        assert ref["choices"][0]["text"] == one["choices"][i]["text"], i
    wait_kv_free(local_cluster)
