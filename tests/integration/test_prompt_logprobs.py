"""vLLM's prompt_logprobs through a real cluster with the default model, disaggregated (a
prefill node computes them in its prefill pass) and colocated (the decode node prefills; also
with 2 logit rows a pass, so the prompt goes in chunks of 2 tokens): one entry per prompt
token, the first null, then {token id: {logprob, rank, decoded_token}} for the token and the k
most likely; each prompt token's logprob equals the one greedy decoding reports when the
prompt's prefix is generated from; a request asking for them takes no prefix-cache hit; the
limits are 400s naming the field. docs/api.md, docs/sampling.md.
"""
import json

import pytest

from conftest import http_cluster
from test_http import request

PROMPT = ("The capital of France is Paris. The capital of Italy is Rome. The capital of Spain "
          "is Madrid. The capital of Germany is Berlin. The capital of Portugal is")


# chunked: a decode node prefilling with 2 logit rows a pass (max_running 2, no draft rows), so
# a prompt asking for its logprobs goes in chunks of 2 tokens
CHUNKED = "    max_running: 2\n    speculative:\n      max_draft: 0\n"


@pytest.fixture(scope="module", params=["disaggregated", "colocated", "colocated-chunked"])
def cluster(request, tmp_path_factory):
    n_prefill = 1 if request.param == "disaggregated" else 0
    extra = CHUNKED if request.param == "colocated-chunked" else ""
    yield from http_cluster(tmp_path_factory, "plp_" + request.param, n_prefill=n_prefill,
                            extra_decode=extra)


def post(cluster, path, body):
    status, _, raw = request(cluster.port, "POST", path, body)
    return status, json.loads(raw)


def prompt_ids(cluster):
    status, v = post(cluster, "/tokenize", {"prompt": PROMPT})
    assert status == 200, v
    return v["tokens"]


def completion_plp(cluster, k, prompt=PROMPT):
    status, r = post(cluster, "/v1/completions", {"prompt": prompt, "max_tokens": 1,
                                                  "temperature": 0, "prompt_logprobs": k})
    assert status == 200, r
    return r


def test_shape_and_values(cluster):
    ids = prompt_ids(cluster)
    r = completion_plp(cluster, 3)
    plp = r["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) == r["usage"]["prompt_tokens"]
    assert plp[0] is None
    for i in range(1, len(ids)):
        d = plp[i]
        assert str(ids[i]) in d, (i, d)
        assert 3 <= len(d) <= 4, d
        ranks = sorted(e["rank"] for k, e in d.items() if k != str(ids[i]) or len(d) == 3)
        assert ranks[:3] == [1, 2, 3], d
        for e in d.values():
            assert e["logprob"] <= 0 and isinstance(e["decoded_token"], str)
        own = d[str(ids[i])]
        assert own["rank"] >= 1
        best = max(e["logprob"] for e in d.values())
        assert own["logprob"] <= best
        # the tokens ranked above it are exactly those with a higher logprob shown here
        assert own["rank"] >= 1 + sum(e["logprob"] > own["logprob"] for e in d.values())


def test_equal_to_greedy_decoding_of_each_prefix(cluster):
    """Batch invariance: the prompt row's logits are the last row's of the prefix alone, so the
    logprobs are bitwise those a request for the prefix reports for its first token."""
    ids = prompt_ids(cluster)
    plp = completion_plp(cluster, 5)["choices"][0]["prompt_logprobs"]
    for i in range(1, len(ids)):
        status, r = post(cluster, "/v1/completions", {"prompt": ids[:i], "max_tokens": 1,
                                                      "temperature": 0, "logprobs": 5})
        assert status == 200, r
        lp = r["choices"][0]["logprobs"]
        top1 = [e for e in plp[i].values() if e["rank"] == 1]
        assert top1 and top1[0]["logprob"] == lp["token_logprobs"][0], (i, plp[i], lp)
        # every entry among the five most likely is one of the reference's five (keyed by text)
        ref = list(lp["top_logprobs"][0].values())
        for e in plp[i].values():
            if e["rank"] <= 5:
                assert e["logprob"] in ref, (i, e, ref)


def test_no_prefix_cache_hit_and_same_values(cluster):
    first = completion_plp(cluster, 2)
    plain = {"prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    status, r = post(cluster, "/v1/completions", plain)
    assert status == 200, r
    assert r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the prompt is cached
    again = completion_plp(cluster, 2)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert again["choices"][0]["prompt_logprobs"] == first["choices"][0]["prompt_logprobs"]
    assert again["choices"][0]["text"] == r["choices"][0]["text"]


def test_chat_and_n(cluster):
    body = {"messages": [{"role": "user", "content": "Name a color."}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 0}
    status, r = post(cluster, "/v1/chat/completions", body)
    assert status == 200, r
    plp = r["prompt_logprobs"]
    assert len(plp) == r["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(d) == 1 and list(d.values())[0]["rank"] >= 1 for d in plp[1:])
    status, r2 = post(cluster, "/v1/chat/completions", dict(body, n=2))
    assert status == 200, r2
    assert r2["prompt_logprobs"] == plp
    status, c = post(cluster, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "n": 2,
                                                  "temperature": 0, "prompt_logprobs": 1})
    assert status == 200, c
    assert c["choices"][0]["prompt_logprobs"] == c["choices"][1]["prompt_logprobs"]
    assert len(c["choices"][0]["prompt_logprobs"]) == c["usage"]["prompt_tokens"]


@pytest.mark.parametrize("value,fragment", [(21, "0..20"), (-1, "0..20"), ("2", "integer")])
def test_limits(cluster, value, fragment):
    status, e = post(cluster, "/v1/completions",
                     {"prompt": "Hi", "max_tokens": 1, "prompt_logprobs": value})
    assert status == 400, e
    assert e["error"]["param"] == "prompt_logprobs" and fragment in e["error"]["message"], e


def test_stream(cluster):
    body = {"prompt": "Hi", "max_tokens": 1, "stream": True, "prompt_logprobs": 1}
    status, _, raw = request(cluster.port, "POST", "/v1/completions", body)
    assert status == 400 and json.loads(raw)["error"]["param"] == "prompt_logprobs"
    status, _, raw = request(cluster.port, "POST", "/v1/completions", dict(body, prompt_logprobs=0))
    assert status == 200, raw


def test_echo_with_logprobs(cluster):
    """vLLM: with echo, the prompt's tokens head the completion's logprobs (the first null)."""
    ids = prompt_ids(cluster)
    plp = completion_plp(cluster, 2)["choices"][0]["prompt_logprobs"]
    body = {"prompt": PROMPT, "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0}
    status, r = post(cluster, "/v1/completions", body)
    assert status == 200, r
    c = r["choices"][0]
    assert "prompt_logprobs" not in c  # not asked for
    lp = c["logprobs"]
    n = len(ids)
    assert len(lp["tokens"]) == n + 3 == len(lp["token_logprobs"]) == len(lp["top_logprobs"])
    assert "".join(lp["tokens"]) == c["text"] and c["text"].startswith(PROMPT)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    for i in range(1, n):
        assert lp["token_logprobs"][i] == plp[i][str(ids[i])]["logprob"], i
        want = sorted(e["logprob"] for e in plp[i].values() if e["rank"] <= 2)
        got = sorted(lp["top_logprobs"][i].values())  # keyed by text: equal texts collapse
        assert got == want or (len(got) < 2 and set(got) <= set(want)), (i, got, want)
    offs = lp["text_offset"]
    assert offs[0] == 0 and offs == sorted(offs) and offs[n] == len(PROMPT)
    status, e = post(cluster, "/v1/completions", dict(body, stream=True))
    assert status == 400 and e["error"]["param"] == "echo", e
