"""vLLM's request fields min_tokens, bad_words, allowed_token_ids and truncate_prompt_tokens end
to end against a real cluster (router + prefill + decode processes), through the HTTP gateway
and the native API, and the context-overflow error in OpenAI's shape (code
context_length_exceeded, vLLM's wording) that litellm turns into ContextWindowExceededError.

Each field is checked against the greedy answer without it: min_tokens makes an answer that
stopped early go on, a banned word that the greedy answer held is gone, every token drawn under
allowed_token_ids is in the set (token ids from the native API), and usage.prompt_tokens is the
truncated count. Bad values are refused with 400 naming the field and the limit.
"""
import json
import os

import pytest

# litellm reads its model cost map at import: the local copy, never the network
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm  # noqa: E402  pinned by scripts/setup; missing, the module fails (never skips)

from conftest import http_cluster, reference
import tandem_client as tc
from test_http import request

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Say hello."}]
N_CTX = 4096
N_VOCAB = 49152


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "fields")


@pytest.fixture(scope="module")
def native(cluster):
    c = tc.Client(cluster.client_ep)
    yield c
    c.close()


def post(cluster, path, body):
    status, _, raw = request(cluster.port, "POST", path, body)
    return status, json.loads(raw)


def completion(cluster, **kw):
    body = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=8, temperature=0)
    body.update(kw)
    status, v = post(cluster, "/v1/completions", body)
    assert status == 200, v
    return v


def chat(cluster, **kw):
    body = dict(model=MODEL_NAME, messages=CHAT, max_tokens=200, temperature=0)
    body.update(kw)
    status, v = post(cluster, "/v1/chat/completions", body)
    assert status == 200, v
    return v


def refused(cluster, path, body, param, words):
    body = dict(model=MODEL_NAME, temperature=0, **body)
    if path.endswith("completions") and "chat" not in path and "prompt" not in body:
        body["prompt"] = PROMPT
    status, v = post(cluster, path, body)
    assert status == 400, v
    assert v["error"]["param"] == param, v
    for w in words:
        assert w in v["error"]["message"], v
    return v


# ---- min_tokens ----

def test_min_tokens_goes_past_the_end(cluster):
    plain = chat(cluster)
    n = plain["usage"]["completion_tokens"]
    assert plain["choices"][0]["finish_reason"] == "stop" and n < 150, plain
    more = chat(cluster, min_tokens=n + 20)
    assert more["usage"]["completion_tokens"] >= n + 20, more
    # the first n tokens are the greedy answer's: the end token was masked, nothing before it
    assert more["choices"][0]["message"]["content"].startswith(
        plain["choices"][0]["message"]["content"]), (plain, more)
    # streamed: the same text
    status, _, raw = request(cluster.port, "POST", "/v1/chat/completions",
                             dict(model=MODEL_NAME, messages=CHAT, max_tokens=200, temperature=0,
                                  min_tokens=n + 20, stream=True))
    assert status == 200
    text = ""
    for line in raw.decode().splitlines():
        if line.startswith("data: {"):
            for ch in json.loads(line[6:])["choices"]:
                text += ch["delta"].get("content") or ""
    assert text == more["choices"][0]["message"]["content"]


def test_min_tokens_holds_back_stop_strings_and_ids(cluster, native):
    plain = completion(cluster, max_tokens=12)
    text = plain["choices"][0]["text"]
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=12, temperature=0.0))
    assert r.text == text and len(r.token_ids) == 12, r
    # a stop string the answer holds early ends it there without min_tokens ...
    stop = text.strip().split()[0]
    cut = completion(cluster, max_tokens=12, stop=[stop])
    assert cut["choices"][0]["finish_reason"] == "stop", cut
    assert cut["usage"]["completion_tokens"] < 12, cut
    # ... and is not matched before min_tokens tokens exist
    held = completion(cluster, max_tokens=12, stop=[stop], min_tokens=12)
    assert held["usage"]["completion_tokens"] == 12, held
    assert held["choices"][0]["finish_reason"] == "length", held
    assert held["choices"][0]["text"] == text
    # a stop token id (the second greedy token) is masked until min_tokens
    second = r.token_ids[1]
    ids = completion(cluster, max_tokens=12, stop_token_ids=[second])
    assert ids["usage"]["completion_tokens"] == 2, ids
    masked = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=12, temperature=0.0,
                                               stop_token_ids=[second], min_tokens=4))
    assert masked.status == "OK", masked
    assert second not in masked.token_ids[:4] and len(masked.token_ids) >= 4, masked


def test_min_tokens_with_n_and_seed_is_deterministic(cluster):
    body = dict(messages=CHAT, temperature=0.8, seed=11, n=3, min_tokens=30, max_tokens=60)
    a = chat(cluster, **body)
    b = chat(cluster, **body)
    assert [c["message"]["content"] for c in a["choices"]] == \
        [c["message"]["content"] for c in b["choices"]]
    for c in a["choices"]:
        assert c["finish_reason"] in ("stop", "length")
    assert a["usage"]["completion_tokens"] >= 3 * 30, a


def test_min_tokens_under_a_constraint(cluster):
    # a complete constraint ends the output even before min_tokens (min_tokens yields to the
    # grammar rather than leave no token); before that, the end is masked as usual
    v = completion(cluster, prompt="Is the sky blue? Answer:", max_tokens=10, min_tokens=5,
                   guided_choice=["yes", "no"])
    assert v["choices"][0]["text"] in ("yes", "no"), v
    assert v["choices"][0]["finish_reason"] == "stop", v
    v = chat(cluster, max_tokens=60, min_tokens=20, response_format={"type": "json_object"})
    assert v["usage"]["completion_tokens"] >= 1, v
    if v["choices"][0]["finish_reason"] == "stop":
        json.loads(v["choices"][0]["message"]["content"])


# ---- bad_words ----

def test_bad_words_bans_a_word_the_answer_had(cluster):
    text = completion(cluster)["choices"][0]["text"]
    word = text.strip().split()[0].strip(".,")
    assert word, text
    banned = completion(cluster, bad_words=[word])["choices"][0]["text"]
    assert word not in banned.split(), (word, text, banned)
    assert banned != text
    # chat: the same
    ct = chat(cluster, max_tokens=20)["choices"][0]["message"]["content"]
    w = ct.split()[0].strip(".,!")
    cb = chat(cluster, max_tokens=20, bad_words=[w])["choices"][0]["message"]["content"]
    assert not cb.startswith(w), (w, ct, cb)


def test_bad_words_native_sequences(cluster, native):
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=8, temperature=0.0))
    seq = list(r.token_ids[2:4])  # a two-token sequence of the greedy answer
    b = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=8, temperature=0.0,
                                          bad_words=[seq]))
    assert b.status == "OK", b
    assert b.token_ids[:3] == r.token_ids[:3]  # the prefix is allowed ...
    assert b.token_ids[3] != r.token_ids[3]    # ... its last token after it is not


def test_cli_in_process_equals_the_cluster(cluster):
    """`tandem generate -m` tokenizes bad words by the router's rule (tdm_prompt_bad_word) and
    masks in the same worker: the same text as the cluster for the same request."""
    body = dict(max_tokens=10, bad_words=["Paris", "capital"], min_tokens=10,
                allowed_token_ids=list(range(200, 1200)))
    want = completion(cluster, **body)["choices"][0]["text"]
    got = reference(prompt=PROMPT, max_tokens=10,
                    extra=["--bad-word", "Paris", "--bad-word", "capital", "--min-tokens", "10",
                           "--allowed-token-ids", ",".join(str(i) for i in range(200, 1200))])
    assert got == want
    assert "Paris" not in got and "capital" not in got


# ---- allowed_token_ids ----

def test_allowed_token_ids_only(cluster, native):
    allowed = [28, 29, 30, 198, 314]
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5,
                                          ignore_eos=True, allowed_token_ids=allowed))
    assert r.status == "OK", r
    assert len(r.token_ids) == 16 and set(r.token_ids) <= set(allowed), r.token_ids
    # the gateway sends the same request: the same text
    v = completion(cluster, max_tokens=16, temperature=1.0, seed=5, ignore_eos=True,
                   allowed_token_ids=allowed)
    assert v["choices"][0]["text"] == r.text
    # greedy over one allowed token: every token is it
    one = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=5, temperature=0.0,
                                            ignore_eos=True, allowed_token_ids=[314]))
    assert one.token_ids == [314] * 5, one


# ---- truncate_prompt_tokens ----

def test_truncate_prompt_tokens(cluster):
    long_prompt = " ".join(["word"] * 60) + " " + PROMPT
    full = completion(cluster, prompt=long_prompt)["usage"]["prompt_tokens"]
    assert full > 60
    v = completion(cluster, prompt=long_prompt, truncate_prompt_tokens=7)
    assert v["usage"]["prompt_tokens"] == 7, v
    # the last 7 tokens: as if they were the prompt
    tail = completion(cluster, prompt=long_prompt, truncate_prompt_tokens=7, max_tokens=6)
    assert v["usage"]["prompt_tokens"] == tail["usage"]["prompt_tokens"]
    # a longer k than the prompt keeps it whole; -1 = the context length
    assert completion(cluster, prompt=long_prompt,
                      truncate_prompt_tokens=1000)["usage"]["prompt_tokens"] == full
    assert completion(cluster, prompt=long_prompt,
                      truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == full
    # chat: of the rendered prompt
    c = chat(cluster, max_tokens=4, truncate_prompt_tokens=5)
    assert c["usage"]["prompt_tokens"] == 5, c
    # a prompt longer than the context, truncated to fit, is served
    huge = "x " * 6000
    v = completion(cluster, prompt=huge, truncate_prompt_tokens=100, max_tokens=2)
    assert v["usage"]["prompt_tokens"] == 100, v


def test_truncated_prompt_is_bounded_in_bytes(cluster):
    """A prompt to be truncated is still tokenized whole on the router's loop, so it gets the
    byte bound a prompt that fits has (the context times the longest token's bytes): a 4 MiB
    one is refused at once naming the field and the limit, and one of exactly the limit is
    served with the same tokens as the whole prompt cut to its last k."""
    v = refused(cluster, "/v1/completions",
                {"prompt": "x " * (3 << 19), "truncate_prompt_tokens": 10},
                "prompt", ["with truncate_prompt_tokens it may be at most", f"{N_CTX} tokens"])
    limit = int(v["error"]["message"].split("at most ")[1].split(" ")[0])
    assert 2 * N_CTX <= limit < (4 << 20), v
    # a tail that starts mid-word and mid-character ("é" is 2 bytes): the limit is in bytes
    unit = "héllo wörld, "
    text = (unit * (limit // len(unit.encode()) + 1)).encode()[:limit].decode("utf-8", "ignore")
    text = text + "x" * (limit - len(text.encode()))
    assert len(text.encode()) == limit
    status, tok = post(cluster, "/tokenize", {"model": MODEL_NAME, "prompt": text})
    assert status == 200, tok
    ids = tok["tokens"]
    assert len(ids) > N_CTX
    v = completion(cluster, prompt=text, truncate_prompt_tokens=9, max_tokens=6,
                   ignore_eos=True)
    assert v["usage"]["prompt_tokens"] == 9, v
    # the same answer as the whole prompt's last 9 token ids given as the prompt
    cut = completion(cluster, prompt=ids[-9:], max_tokens=6, ignore_eos=True)
    assert cut["usage"]["prompt_tokens"] == 9, cut
    assert v["choices"][0]["text"] == cut["choices"][0]["text"], (v, cut)
    status, v = post(cluster, "/v1/completions",
                     dict(model=MODEL_NAME, prompt=text + "x", truncate_prompt_tokens=9,
                          max_tokens=1))
    assert status == 400 and v["error"]["param"] == "prompt", v


# ---- refusals ----

@pytest.mark.parametrize("path,body,param,words", [
    ("/v1/completions", {"min_tokens": 20, "max_tokens": 8}, "min_tokens",
     ["min_tokens must be at most max_tokens (8), got 20"]),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 9, "max_tokens": 3}, "min_tokens",
     ["max_tokens (3)"]),
    ("/v1/completions", {"min_tokens": -1}, "min_tokens", ["min_tokens"]),
    ("/v1/completions", {"allowed_token_ids": [1, 2, 3, 99999]}, "allowed_token_ids[3]",
     ["allowed_token_ids[3]: 99999 is not below the vocabulary size 49152"]),
    ("/v1/completions", {"allowed_token_ids": []}, "allowed_token_ids", ["non-empty"]),
    ("/v1/completions", {"allowed_token_ids": [5, 3000000000]}, "allowed_token_ids[1]",
     ["allowed_token_ids[1]: 3000000000 is not a token id (above 2147483647)"]),
    ("/v1/completions", {"allowed_token_ids": list(range(1025))}, "allowed_token_ids",
     ["at most 1024"]),
    # every allowed token ruled out at the first step: 400 at the router, not a node's 500
    # "no token satisfies the request's constraints" (0 and 2 are SmolLM2's <|endoftext|> and <|im_end|>)
    ("/v1/completions", {"allowed_token_ids": [0, 2], "min_tokens": 2}, "allowed_token_ids",
     ["none of the 2 listed tokens can be the first token", "min_tokens (2)"]),
    ("/v1/chat/completions", {"messages": CHAT, "allowed_token_ids": [5], "stop_token_ids": [5],
                              "min_tokens": 1}, "allowed_token_ids",
     ["none of the 1 listed tokens can be the first token"]),
    ("/v1/completions", {"allowed_token_ids": [504], "bad_words": ["The"]}, "allowed_token_ids",
     ["none of the 1 listed tokens can be sampled: each is a one-token bad_words entry"]),
    ("/v1/completions", {"bad_words": ["w"] * 129}, "bad_words", ["at most 128"]),
    ("/v1/completions", {"bad_words": ["ok", "x" * 257]}, "bad_words[1]", ["1..256 bytes"]),
    ("/v1/completions", {"bad_words": ["ok", "   "]}, "bad_words[1]", ["besides leading spaces"]),
    ("/v1/completions", {"bad_words": [3]}, "bad_words[0]", ["must be a string"]),
    ("/v1/chat/completions", {"messages": CHAT, "user": 7}, "user", ["user must be a string"]),
    ("/v1/completions", {"user": ["u"]}, "user", ["user must be a string"]),
    ("/v1/completions", {"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ["-1", ">= 1"]),
    ("/v1/completions", {"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", ["got -2"]),
    ("/v1/completions", {"truncate_prompt_tokens": N_CTX + 1}, "truncate_prompt_tokens",
     [f"[1, {N_CTX}]", f"got {N_CTX + 1}"]),
    ("/v1/chat/completions", {"messages": CHAT, "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens", ["-1"]),
    ("/v1/completions", {"truncate_prompt_tokens": 3, "echo": True}, "echo",
     ["echo with truncate_prompt_tokens is not supported"]),
])
def test_refused_with_the_field_and_limit(cluster, path, body, param, words):
    refused(cluster, path, body, param, words)


def test_constraints_leaving_no_token_later_are_the_clients_error(cluster):
    """allowed_token_ids = ["{"] with a JSON grammar: the first token passes (the router's
    first-token check cannot refuse it), the second has none left. The node fails the request
    with TaskFailed.request_fault, so it is a 400 naming the step, never a 500."""
    status, v = post(cluster, "/tokenize", {"model": MODEL_NAME, "prompt": "{",
                                            "add_special_tokens": False})
    assert status == 200 and len(v["tokens"]) == 1, v
    brace = v["tokens"][0]
    status, v = post(cluster, "/v1/chat/completions",
                     dict(model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0,
                          allowed_token_ids=[brace], response_format={"type": "json_object"}))
    assert status == 400, v
    assert v["error"]["type"] == "invalid_request_error", v
    assert "no token satisfies the request's constraints at output token 1" in \
        v["error"]["message"], v
    # the cluster goes on serving
    assert completion(cluster)["choices"][0]["text"]


def test_allowed_token_ids_left_by_the_other_masks_are_served(cluster, native):
    # ignore_eos keeps the end-of-generation ids under min_tokens; one id not banned is enough
    v = completion(cluster, max_tokens=3, allowed_token_ids=[0, 2], min_tokens=2, ignore_eos=True)
    assert v["usage"]["completion_tokens"] == 3, v
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=3, temperature=0.0,
                                          min_tokens=3, stop_token_ids=[5],
                                          allowed_token_ids=[5, 314]))
    assert r.status == "OK" and r.token_ids == [314] * 3, r
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=3, min_tokens=3,
                                          stop_token_ids=[5], allowed_token_ids=[5]))
    assert r.status == "INVALID_ARGUMENT", r
    assert r.message.startswith("sampling.allowed_token_ids: none of the 1 listed tokens"), r


def test_native_refusals_name_the_field(native):
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=4, min_tokens=5))
    assert r.status == "INVALID_ARGUMENT", r
    assert r.message == "sampling.min_tokens must be at most max_tokens (4), got 5", r
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=4, min_tokens=-1))
    assert r.message == "sampling.min_tokens must be >= 0 (0 = off), got -1", r
    r = native.generate(tc.prompt_request(prompt=PROMPT, max_tokens=4,
                                          allowed_token_ids=[5, N_VOCAB]))
    assert r.status == "INVALID_ARGUMENT", r
    assert "allowed_token_ids[1]: 49152 is not below the vocabulary size 49152" in r.message, r


# ---- context overflow ----

def test_context_overflow_is_openai_shaped(cluster):
    # prompt + max_tokens over the context
    v = refused(cluster, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "hello " * 2000}], "max_tokens": 3000},
                "max_tokens", [f"This model's maximum context length is {N_CTX} tokens. "
                               "However, you requested",
                               "in the messages, 3000 in the completion). Please reduce the "
                               "length of the messages or completion."])
    assert v["error"]["code"] == "context_length_exceeded", v
    assert v["error"]["type"] == "invalid_request_error", v
    # the prompt alone over it
    v = refused(cluster, "/v1/completions", {"prompt": "x " * 6000, "max_tokens": 5}, "prompt",
                [f"maximum context length is {N_CTX} tokens", "5 in the completion"])
    assert v["error"]["code"] == "context_length_exceeded", v
    v = refused(cluster, "/v1/chat/completions",
                {"messages": [{"role": "user", "content": "x " * 6000}]}, "messages",
                [f"maximum context length is {N_CTX} tokens. However, your request has"])
    assert v["error"]["code"] == "context_length_exceeded", v


def test_litellm_raises_context_window_exceeded(cluster):
    base = f"http://127.0.0.1:{cluster.port}/v1"
    with pytest.raises(litellm.ContextWindowExceededError):
        litellm.completion(model=f"openai/{MODEL_NAME}", api_base=base, api_key="none",
                           messages=[{"role": "user", "content": "hello " * 2000}],
                           max_tokens=3000, num_retries=0)
    # a request that fits is answered
    r = litellm.completion(model=f"openai/{MODEL_NAME}", api_base=base, api_key="none",
                           messages=CHAT, max_tokens=4, temperature=0, num_retries=0)
    assert r.choices[0].message.content
