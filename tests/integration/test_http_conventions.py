"""The HTTP gateway's conventions against a real cluster: /tokenize, /detokenize and /version
(vLLM's shapes), API keys on them, CORS (router.cors_origins), X-Request-Id on every reply
(the client's own honoured) and Retry-After on 503.

The tokenizer ids must equal `tandem tokenize` (the one prompt rule, tdm_prompt_encode).
"""
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest

from conftest import BINARIES, MODEL, http_cluster
from tandem_client import SOURCE_DIR
from test_http import request

try:
    import openai
except ImportError:  # pragma: no cover - a setup problem, reported as a failure
    pytest.fail("the `openai` package is missing: run scripts/setup", pytrace=False)

KEY = "sk-conv"
ORIGIN = "http://app.example:3000"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = "The capital of France is"
CHAT = "What is 2 + 2?"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "conv", extra_router=(
        f"  api_keys: [{KEY}]\n  public_metrics: true\n  cors_origins: ['{ORIGIN}']\n"))


def cli_tokenize(*args):
    out = subprocess.run([BINARIES["tandem"], "tokenize", "-m", MODEL, *args],
                         capture_output=True, check=True)
    return [int(t) for t in out.stdout.split()]


def post(cluster, path, body, headers=AUTH):
    status, hdrs, raw = request(cluster.port, "POST", path, body, headers)
    return status, hdrs, json.loads(raw)


def test_tokenize_round_trip(cluster):
    want = cli_tokenize("--special", PROMPT)
    status, hdrs, v = post(cluster, "/tokenize", {"prompt": PROMPT})
    assert status == 200, v
    assert v["tokens"] == want
    assert v["count"] == len(want)
    _, _, models = request(cluster.port, "GET", "/v1/models", headers=AUTH)
    assert v["max_model_len"] == json.loads(models)["data"][0]["max_model_len"] > 0
    assert v["token_strs"] is None
    status, _, d = post(cluster, "/detokenize", {"tokens": v["tokens"]})
    assert status == 200, d
    assert d == {"prompt": PROMPT}
    status, _, v = post(cluster, "/tokenize",
                        {"prompt": PROMPT, "return_token_strs": True, "add_special_tokens": False})
    assert status == 200 and v["tokens"] == want
    assert v["token_strs"][0] == "The" and v["token_strs"][1] == "Ġcapital"


def test_tokenize_example_in_api_docs(cluster):
    """docs/api.md's /tokenize and /detokenize example is what the default model answers, byte
    for byte (max_model_len: the context the router serves, TDM_MODEL_MAX_SERVE_CTX 4096)."""
    with open(os.path.join(SOURCE_DIR, "docs", "api.md"), encoding="utf-8") as f:
        doc = f.read()
    pairs = re.findall(r"^\$ curl -s localhost:8000(/(?:de)?tokenize) -d '(.*)'\n(.*)$", doc, re.M)
    assert [p for p, _, _ in pairs] == ["/tokenize", "/detokenize"], pairs
    for path, body, want in pairs:
        status, _, raw = request(cluster.port, "POST", path, json.loads(body), AUTH)
        assert status == 200, raw
        assert raw.decode("utf-8") == want + "\n", (path, raw)  # the body ends its line
    assert json.loads(pairs[0][2])["max_model_len"] == 4096


def test_tokenize_chat(cluster):
    want = cli_tokenize("--chat", CHAT)
    msgs = [{"role": "user", "content": CHAT}]
    status, _, v = post(cluster, "/tokenize", {"messages": msgs})
    assert status == 200, v
    assert v["tokens"] == want
    # without the generation prompt the ids end before "<|im_start|>assistant\n"
    status, _, nogen = post(cluster, "/tokenize", {"messages": msgs,
                                                   "add_generation_prompt": False})
    assert status == 200, nogen
    tail = cli_tokenize("--special", "<|im_start|>assistant\n")
    assert nogen["tokens"] + tail == want
    status, _, d = post(cluster, "/detokenize", {"tokens": want})
    assert d["prompt"].endswith(f"<|im_start|>user\n{CHAT}<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("path,body,param", [
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 3}, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": []}, "messages"),
    ("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ("/detokenize", {"tokens": "1 2"}, "tokens"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {}, "tokens"),
])
def test_tokenize_errors(cluster, path, body, param):
    status, hdrs, v = post(cluster, path, body)
    assert status == 400, v
    assert v["error"]["param"] == param
    assert hdrs.get("X-Request-Id")


def test_tokenize_model_and_method(cluster):
    status, _, v = post(cluster, "/tokenize", {"prompt": "a", "model": "other"})
    assert status == 404 and v["error"]["code"] == "model_not_found"
    status, hdrs, _ = request(cluster.port, "GET", "/tokenize", headers=AUTH)
    assert status == 405 and "OPTIONS" in hdrs["Allow"]


def test_version_and_keys(cluster):
    status, hdrs, raw = request(cluster.port, "GET", "/version")
    assert status == 200 and json.loads(raw)["version"] == "0.1.0"
    for path in ("/tokenize", "/detokenize"):
        status, _, v = post(cluster, path, {"prompt": "a", "tokens": [1]}, headers={})
        assert status == 401 and v["error"]["code"] == "invalid_api_key"
    for path in ("/health", "/ready", "/version"):
        status, hdrs, _ = request(cluster.port, "GET", path)
        assert status == 200, path
        assert hdrs.get("X-Request-Id")


def test_cors(cluster):
    pre = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    status, hdrs, raw = request(cluster.port, "OPTIONS", "/v1/chat/completions", headers=pre)
    assert status == 204 and raw == b""
    assert hdrs["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in hdrs["Access-Control-Allow-Methods"]
    assert hdrs["Access-Control-Allow-Headers"] == "authorization, content-type"
    assert int(hdrs["Access-Control-Max-Age"]) > 0
    # another origin, or none: 204 with Allow, no CORS headers (no key needed either way)
    for h in ({"Origin": "http://evil.example"}, {}):
        status, hdrs, _ = request(cluster.port, "OPTIONS", "/tokenize", headers=h)
        assert status == 204
        assert hdrs["Allow"] == "GET, POST, OPTIONS"
        assert "Access-Control-Allow-Origin" not in hdrs
    # the header on answers and errors to an allowed origin only
    status, hdrs, _ = post(cluster, "/tokenize", {"prompt": "a"}, dict(AUTH, Origin=ORIGIN))
    assert status == 200 and hdrs["Access-Control-Allow-Origin"] == ORIGIN
    assert "X-Request-Id" in hdrs["Access-Control-Expose-Headers"]
    status, hdrs, _ = post(cluster, "/tokenize", {}, {"Origin": ORIGIN})
    assert status == 401 and hdrs["Access-Control-Allow-Origin"] == ORIGIN
    status, hdrs, _ = post(cluster, "/tokenize", {"prompt": "a"},
                           dict(AUTH, Origin="http://evil.example"))
    assert status == 200 and "Access-Control-Allow-Origin" not in hdrs


def chat_body(content, max_tokens=8, **kw):
    return dict({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                 "temperature": 0}, **kw)


def test_request_id(cluster):
    # honoured on an answer, a stream and an error
    status, hdrs, v = post(cluster, "/v1/chat/completions", chat_body(CHAT),
                           dict(AUTH, **{"X-Request-Id": "my-id.1"}))
    assert status == 200 and hdrs["X-Request-Id"] == "my-id.1"
    status, hdrs, _ = request(cluster.port, "POST", "/v1/chat/completions",
                              chat_body(CHAT, stream=True), dict(AUTH, **{"X-Request-Id": "s-1"}))
    assert status == 200 and hdrs["X-Request-Id"] == "s-1"
    status, hdrs, v = post(cluster, "/v1/chat/completions", chat_body(CHAT, temperature=9),
                           dict(AUTH, **{"X-Request-Id": "bad-temp"}))
    assert status == 400 and hdrs["X-Request-Id"] == "bad-temp"
    # without one (or an invalid one) the router's own: the completion's id
    status, hdrs, v = post(cluster, "/v1/chat/completions", chat_body(CHAT))
    assert status == 200 and hdrs["X-Request-Id"] == v["id"]
    for bad in ("x" * 128, "has space"):
        status, hdrs, v = post(cluster, "/v1/chat/completions", chat_body(CHAT),
                               dict(AUTH, **{"X-Request-Id": bad}))
        assert status == 200 and hdrs["X-Request-Id"] == v["id"] != bad
    status, hdrs, _ = post(cluster, "/tokenize", {"prompt": "a"},
                           dict(AUTH, **{"X-Request-Id": "x" * 127}))
    assert hdrs["X-Request-Id"] == "x" * 127
    status, hdrs, _ = request(cluster.port, "GET", "/nowhere")
    assert status == 404 and hdrs["X-Request-Id"].startswith("req-")


def test_same_request_id_concurrently(cluster):
    prompts = ["Count from one to ten:", "Name the colours of the rainbow:"]
    want = []
    for p in prompts:
        status, _, v = post(cluster, "/v1/completions",
                            {"prompt": p, "max_tokens": 24, "temperature": 0})
        assert status == 200, v
        want.append(v["choices"][0]["text"])
    assert want[0] != want[1]
    got = [None, None]
    barrier = threading.Barrier(2)

    def run(i):
        barrier.wait()
        got[i] = post(cluster, "/v1/completions",
                      {"prompt": prompts[i], "max_tokens": 24, "temperature": 0},
                      dict(AUTH, **{"X-Request-Id": "same-id"}))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for i in range(2):
        status, hdrs, v = got[i]
        assert status == 200, v
        assert hdrs["X-Request-Id"] == "same-id"
        assert v["choices"][0]["text"] == want[i]


def test_openai_request_id_on_error(cluster):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key=KEY,
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="SmolLM2-135M-Instruct.Q4_1", temperature=9,
                                       messages=[{"role": "user", "content": CHAT}])
    assert e.value.request_id


def test_retry_after_on_503(cluster):
    """Last: stops the decode node, so /ready answers 503 (with Retry-After)."""
    cluster.kill("decode-0", signal.SIGTERM)
    end = time.time() + 60
    while True:
        status, hdrs, _ = request(cluster.port, "GET", "/ready")
        if status == 503 or time.time() > end:
            break
        time.sleep(0.2)
    assert status == 503
    assert int(hdrs["Retry-After"]) >= 1
    assert hdrs.get("X-Request-Id")
