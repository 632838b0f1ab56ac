"""logit_bias end to end against a real cluster (router + prefill + decode processes): through
the HTTP gateway (/v1/completions and /v1/chat/completions), the native API and
`tandem generate --logit-bias`.

Greedy outputs are compared by token id through the native client and by text through HTTP;
-100 bans a token (the greedy answer changes and never holds it), +100 forces one (every output
token is it). Bad keys, values and counts are refused with 400 naming logit_bias["<key>"], the
limit and the value given.
"""
import json
import re
import subprocess

import pytest

from conftest import BINARIES, MODEL, http_cluster
import tandem_client as tc
from test_http import request

PROMPT = "The capital of France is"
CHAT = "What is 2 + 2?"
N = 8  # output tokens per request
SET_LOGIT_BIAS = 1 << 14  # SamplingParams.set_mask bit of logit_bias (field 15)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "bias")


@pytest.fixture(scope="module")
def native(cluster):
    c = tc.Client(cluster.client_ep)
    yield c
    c.close()


def native_greedy(native, bias=None, prompt=PROMPT, chat=None, max_tokens=N, ignore_eos=False):
    """Greedy output (Result) of the native API with bias {token id: value}."""
    req = tc.prompt_request(prompt=None if chat else prompt, chat=chat, max_tokens=max_tokens,
                            temperature=0.0, ignore_eos=ignore_eos)
    for tok, b in (bias or {}).items():
        e = req.sampling.logit_bias.add()
        e.token_id, e.bias = tok, b
    if bias is not None:
        req.sampling.set_mask |= SET_LOGIT_BIAS
    r = native.generate(req)
    assert r.status == "OK", r
    return r


def post(cluster, path, body):
    status, _, raw = request(cluster.port, "POST", path, body)
    return status, json.loads(raw)


def completion(cluster, bias, prompt=PROMPT, max_tokens=N, **kw):
    status, v = post(cluster, "/v1/completions", dict(
        prompt=prompt, max_tokens=max_tokens, temperature=0, logit_bias=bias, **kw))
    assert status == 200, v
    return v["choices"][0]["text"]


def test_ban_the_top_token(cluster, native):
    plain = native_greedy(native)
    top = plain.token_ids[0]
    banned = native_greedy(native, {top: -100.0})
    assert top not in banned.token_ids
    assert banned.token_ids != plain.token_ids
    # the gateway sends the same request: the same text, token for token
    assert completion(cluster, {str(top): -100}) == banned.text
    assert completion(cluster, {}) == plain.text  # an empty object is no bias
    # every greedy top token banned in turn: never produced
    ban = {}
    for _ in range(3):
        r = native_greedy(native, ban)
        ban[r.token_ids[0]] = -100.0
        r = native_greedy(native, ban)
        assert not set(ban) & set(r.token_ids), (ban, r.token_ids)


def test_chat_ban(cluster, native):
    chat = [("user", CHAT)]
    plain = native_greedy(native, chat=chat)
    top = plain.token_ids[0]
    banned = native_greedy(native, {top: -100.0}, chat=chat)
    assert top not in banned.token_ids and banned.token_ids != plain.token_ids
    status, v = post(cluster, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": CHAT}], "max_tokens": N, "temperature": 0,
        "logit_bias": {str(top): -100}})
    assert status == 200, v
    assert v["choices"][0]["message"]["content"] == banned.text


def test_force_a_token(cluster, native):
    plain = native_greedy(native)
    forced = plain.token_ids[1] if plain.token_ids[1] != plain.token_ids[0] else plain.token_ids[2]
    r = native_greedy(native, {forced: 100.0}, ignore_eos=True)
    assert r.token_ids == [forced] * N
    # also when sampling: +100 leaves the other tokens no mass
    req = tc.prompt_request(prompt=PROMPT, max_tokens=N, temperature=1.0, seed=5, ignore_eos=True)
    e = req.sampling.logit_bias.add()
    e.token_id, e.bias = forced, 100.0
    req.sampling.set_mask |= SET_LOGIT_BIAS
    s = native.generate(req)
    assert s.status == "OK" and s.token_ids == [forced] * N
    assert completion(cluster, {str(forced): 100}, ignore_eos=True) == r.text


def test_cli_logit_bias(cluster, native):
    plain = native_greedy(native, max_tokens=6)
    top = plain.token_ids[0]
    banned = native_greedy(native, {top: -100.0}, max_tokens=6)
    argv = [BINARIES["tandem"], "generate", "--router", cluster.client_ep, "-p", PROMPT,
            "-n", "6", "--logit-bias", f"{top}:-100", "--logit-bias", "0:0.5"]
    out = subprocess.run(argv, capture_output=True, timeout=120)
    assert out.returncode == 0, out.stderr
    both = native_greedy(native, {top: -100.0, 0: 0.5}, max_tokens=6)
    assert out.stdout.decode() == both.text + "\n"  # the CLI ends its output with a newline
    assert banned.token_ids[0] != top
    # in this process too (-m): the same tokens
    local = subprocess.run([BINARIES["tandem"], "generate", "-m", MODEL, "-t", "1", "-p", PROMPT,
                            "-n", "6", "--logit-bias", f"{top}:-100", "--logit-bias", "0:0.5"],
                           capture_output=True, timeout=300)
    assert local.returncode == 0, local.stderr
    assert local.stdout == out.stdout
    for bad, why in [("12", "expected ID:BIAS"), ("x:1", "expected ID:BIAS"),
                     ("5:101", 'logit_bias["5"] must be in [-100, 100], got 101'),
                     ("5:1:2", "expected ID:BIAS")]:
        r = subprocess.run([BINARIES["tandem"], "generate", "--router", cluster.client_ep,
                            "-p", PROMPT, "--logit-bias", bad], capture_output=True, timeout=60)
        assert r.returncode == 2 and why in r.stderr.decode(), (bad, r.stderr)
    r = subprocess.run([BINARIES["tandem"], "generate", "--router", cluster.client_ep, "-p", PROMPT,
                        "--logit-bias", "7:1", "--logit-bias", "7:2"], capture_output=True,
                       timeout=60)
    assert r.returncode == 2 and (b'--logit-bias: logit_bias["7"]: each token id must appear '
                                  b"once, got 7 twice") in r.stderr, r.stderr


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_refusals_name_the_field(cluster, path):
    base = {"max_tokens": 2}
    if path == "/v1/completions":
        base["prompt"] = PROMPT
    else:
        base["messages"] = [{"role": "user", "content": CHAT}]
    n_vocab = 49152  # SmolLM2's
    key = ('logit_bias["{0}"]: the key must be a token id (a decimal integer in '
           '[0, 2147483647]), got "{0}"')
    shape = ("logit_bias must be an object mapping token ids (as strings) to biases in "
             "[-100, 100], got ")
    number = 'logit_bias["5"] must be a number in [-100, 100], got '

    # the messages read as the other fields' do: the entry, the limit, what was given
    cases = [
        ({"abc": 1}, 'logit_bias["abc"]', key.format("abc")),
        ({"-1": 1}, 'logit_bias["-1"]', key.format("-1")),
        ({"1.5": 1}, 'logit_bias["1.5"]', key.format("1.5")),
        ({"99999999999": 1}, 'logit_bias["99999999999"]', key.format("99999999999")),
        ({"5": "x"}, 'logit_bias["5"]', number + "a string"),
        ({"5": None}, 'logit_bias["5"]', number + "null"),
        ({"5": 100.5}, 'logit_bias["5"]', 'logit_bias["5"] must be in [-100, 100], got 100.5'),
        ({"5": -101}, 'logit_bias["5"]', 'logit_bias["5"] must be in [-100, 100], got -101'),
        ({"5": 1, "05": 2}, 'logit_bias["05"]',
         'logit_bias["05"]: each token id must appear once, got 5 twice'),
        ({str(n_vocab): 1}, f'logit_bias["{n_vocab}"]',  # the router's check
         f'logit_bias["{n_vocab}"]: the token id must be in [0, {n_vocab}), got {n_vocab}'),
        ({str(i): 1 for i in range(301)}, "logit_bias",
         "logit_bias must have at most 300 entries, got 301"),
        ([[5, 1]], "logit_bias", shape + "an array"),
        ("5:1", "logit_bias", shape + "a string"),
    ]
    for bias, param, why in cases:
        status, v = post(cluster, path, dict(base, logit_bias=bias))
        assert status == 400, (bias, v)
        err = v["error"]
        assert err["param"] == param, (bias, err)
        assert err["message"] == why, (bias, err)
        assert err["type"] == "invalid_request_error"
    # the gateway's refusals count under the field, never under a client's key
    _, _, raw = request(cluster.port, "GET", "/metrics")
    refused = r'^tandem_http_requests_refused_total\{reason="((?:[^"\\]|\\.)*)"\} (\d+)'
    reasons = re.findall(refused, raw.decode(), re.M)
    assert reasons and all("[" not in r for r, _ in reasons), reasons
    assert int(dict(reasons)["logit_bias"]) >= len(cases) - 1  # the n_vocab one is the router's
    # the limits themselves are fine: 300 entries, +-100, the last token id
    ok = {str(i): 0 for i in range(299)}
    ok[str(n_vocab - 1)] = -100
    status, v = post(cluster, path, dict(base, logit_bias=ok))
    assert status == 200, v
    status, v = post(cluster, path, dict(base, logit_bias=None))
    assert status == 200, v
