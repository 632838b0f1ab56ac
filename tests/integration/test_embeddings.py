"""/v1/embeddings (issue 38) against a real cluster, with the official `openai` client and
LangChain's OpenAIEmbeddings: vectors within cosine 0.999 of llama.cpp's on the same GGUF
(Gemma 3: twice llama.cpp's own spread, 0.994)
(tests/golden/embed_golden.json, pooling last and mean), bitwise equal whatever else shares the
request or which node computes them (a prefill node, or a decode node in a pool without prefill
nodes), base64 equal to float, usage, and every refusal naming its param.
"""
import base64
import json
import math
import os
import struct
import subprocess

import pytest

from conftest import http_cluster, openai_client
from test_http import request

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "embed_golden.json")
MIN_COSINE = 0.999


def golden_model(model):
    with open(GOLDEN) as f:
        doc = json.load(f)
    return next(m for m in doc["models"] if m["name"] == model)


def golden_cases(model="smollm2"):
    return golden_model(model)["cases"]


def min_cosine(model):
    """0.999, or twice llama.cpp's own distance between two of its attention kernels where
    that is larger (tests/unit/test_embed.c): Gemma 3's bound is 0.994."""
    return min(MIN_COSINE, 1.0 - 2.0 * (1.0 - golden_model(model)["llama_cpp_self_min"]))


def cosine(a, b):
    ab = sum(x * y for x, y in zip(a, b))
    return ab / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "embed")


@pytest.fixture(scope="module")
def oai(cluster):
    yield from openai_client(cluster, timeout=300)


@pytest.fixture(scope="module")
def model(oai):
    return oai.models.list().data[0].id


def embed(oai, model, inputs, pooling="last", **kw):
    return oai.embeddings.create(model=model, input=inputs, extra_body={"pooling": pooling}, **kw)


def test_golden_cosine(oai, model):
    """Token inputs (llama.cpp's own ids) against llama.cpp's vectors, both poolings."""
    for pooling in ("last", "mean"):
        cases = [c for c in golden_cases() if c["pooling"] == pooling]
        r = embed(oai, model, [c["tokens"] for c in cases], pooling)
        assert r.object == "list" and r.model == model
        assert [d.index for d in r.data] == list(range(len(cases)))
        assert r.usage.prompt_tokens == sum(len(c["tokens"]) for c in cases)
        assert r.usage.total_tokens == r.usage.prompt_tokens
        for c, d in zip(cases, r.data):
            assert d.object == "embedding"
            assert len(d.embedding) == len(c["embedding"]) == 576
            assert abs(math.sqrt(sum(x * x for x in d.embedding)) - 1.0) < 1e-5
            cs = cosine(d.embedding, c["embedding"])
            assert cs >= min_cosine("smollm2") == MIN_COSINE, (c["name"], pooling, cs)


def test_text_equals_tokens_and_batch_invariant(oai, model):
    """A text is tokenized as a raw prompt (SmolLM2: no BOS), so "Hello world" is llama.cpp's
    ids; each vector is bitwise the same alone or in a batch of inputs of other lengths."""
    cases = [c for c in golden_cases() if c["pooling"] == "mean"]
    together = embed(oai, model, [c["text"] for c in cases], "mean").data
    for c, d in zip(cases, together):
        alone = embed(oai, model, c["text"], "mean").data[0].embedding
        assert alone == d.embedding, c["name"]
        if c["name"] == "short":
            by_ids = embed(oai, model, [c["tokens"]], "mean").data[0].embedding
            assert by_ids == alone
    # a single token array is one input
    one = embed(oai, model, cases[1]["tokens"], "mean")
    assert len(one.data) == 1 and one.data[0].embedding == together[1].embedding


def test_base64_equals_float(cluster, model):
    body = {"model": model, "input": ["The quick brown fox", "jumps"]}
    st, _, raw = request(cluster.port, "POST", "/v1/embeddings", body)
    assert st == 200, raw
    floats = json.loads(raw)
    st, _, raw = request(cluster.port, "POST", "/v1/embeddings",
                         dict(body, encoding_format="base64", user="someone"))
    assert st == 200, raw
    b64 = json.loads(raw)
    assert b64["usage"] == floats["usage"] and b64["usage"]["prompt_tokens"] > 0
    for f, b in zip(floats["data"], b64["data"]):
        data = base64.b64decode(b["embedding"])
        assert len(data) == 4 * len(f["embedding"])
        assert list(struct.unpack(f"<{len(data) // 4}f", data)) == f["embedding"]


def test_openai_client_base64(oai, model):
    """The openai client asks for base64 by default when it can decode it; either way the
    values it returns equal the float answer's."""
    a = oai.embeddings.create(model=model, input="Paris", encoding_format="float")
    b = oai.embeddings.create(model=model, input="Paris")
    assert a.data[0].embedding == b.data[0].embedding


@pytest.mark.parametrize("body,param,what", [
    ({"input": []}, "input", "1..2048"),
    ({"input": ""}, "input", "empty string"),
    ({"input": ["ok", ""]}, "input[1]", "empty string"),
    ({"input": ["x"] * 2049}, "input", "1..2048"),
    ({"input": [[1, 2], [3, 99999999]]}, "input[1][1]", "outside the vocabulary"),
    ({"input": [[1, 2], "text"]}, "input[1]", "array of token ids"),
    ({"input": [[]]}, "input[0]", "1..4096 tokens"),
    ({"input": [list(range(3, 4100))]}, "input[0]", "1..4096 tokens"),
    ({"input": "x", "encoding_format": "hex"}, "encoding_format", "'float', 'base64'"),
    ({"input": "x", "dimensions": 64}, "dimensions", "does not support"),
    ({"input": "x", "pooling": "cls"}, "pooling", "'last', 'mean'"),
    ({"input": "x", "user": 5}, "user", "string"),
    ({}, "input", "required"),
])
def test_refusals(cluster, model, body, param, what):
    st, _, raw = request(cluster.port, "POST", "/v1/embeddings", dict({"model": model}, **body))
    err = json.loads(raw)["error"]
    assert st == 400, raw
    assert err["param"] == param, err
    assert what in err["message"], err
    assert err["type"] == "invalid_request_error"


def test_unknown_model(cluster):
    st, _, raw = request(cluster.port, "POST", "/v1/embeddings", {"model": "nope", "input": "x"})
    err = json.loads(raw)["error"]
    assert (st, err["param"], err["code"]) == (404, "model", "model_not_found")


def test_langchain(cluster, model, oai):
    from langchain_openai import OpenAIEmbeddings
    lc = OpenAIEmbeddings(model=model, base_url=f"http://127.0.0.1:{cluster.port}/v1",
                          api_key="unused", check_embedding_ctx_length=False, max_retries=0)
    docs = ["Tandem serves embeddings.", "Le chat dort."]
    vecs = lc.embed_documents(docs)
    query = lc.embed_query("Tandem serves embeddings.")
    ref = embed(oai, model, docs).data
    assert [v for v in vecs] == [d.embedding for d in ref]
    assert query == ref[0].embedding


def test_metrics_count_embeddings(cluster, oai, model):
    embed(oai, model, ["one", "two three"])
    st, _, raw = request(cluster.port, "GET", "/metrics")
    text = raw.decode()
    ok = [l for l in text.splitlines() if l.startswith("tandem_embedding_requests_total")]
    assert any('status="OK"' in l and float(l.split()[-1]) >= 1 for l in ok), ok
    tok = [l for l in text.splitlines() if l.startswith("tandem_embedding_prompt_tokens_total")]
    assert tok and float(tok[0].split()[-1]) >= 3, tok


@pytest.fixture(scope="module")
def decode_only(tmp_path_factory):
    yield from http_cluster(tmp_path_factory, "embed-decode", n_prefill=0, n_decode=1)


def test_decode_only_pool_same_bits(cluster, decode_only, oai, model):
    """Without a prefill node the decode node computes the embeddings: the same bits."""
    cases = [c for c in golden_cases() if c["pooling"] == "last"]
    want = embed(oai, model, [c["tokens"] for c in cases]).data
    import openai
    with openai.OpenAI(base_url=f"http://127.0.0.1:{decode_only.port}/v1", api_key="unused",
                       max_retries=0, timeout=300) as other:
        got = embed(other, model, [c["tokens"] for c in cases]).data
    assert [d.embedding for d in got] == [d.embedding for d in want]


def f32(values):
    """values rounded to float32 (what both sides computed), as Python floats."""
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def cli_embed(*args):
    from conftest import BINARIES
    out = subprocess.run([BINARIES["tandem"], "embed", *args], capture_output=True, check=True,
                         env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    return [json.loads(line) for line in out.stdout.decode().splitlines()]


def test_single_process_and_native_api_same_bits(cluster, oai, model):
    """`tandem embed -m MODEL` (this process, no cluster) and `tandem embed` through the
    router's native EMBED call give the bits the HTTP API gives."""
    from conftest import MODEL
    cases = [c for c in golden_cases() if c["name"] in ("short", "para")]
    for pooling in ("last", "mean"):
        want = embed(oai, model, [c["tokens"] for c in cases], pooling).data
        args = ["--pooling", pooling]
        for c in cases:
            args += ["--tokens", ",".join(map(str, c["tokens"]))]
        local = cli_embed("-m", MODEL, "-t", "1", *args)
        routed = cli_embed("--router", cluster.client_ep, *args)
        for w, lo, ro, c in zip(want, local, routed, cases):
            assert lo["prompt_tokens"] == ro["prompt_tokens"] == len(c["tokens"])
            assert f32(lo["embedding"]) == w.embedding, (c["name"], pooling)
            assert f32(ro["embedding"]) == w.embedding, (c["name"], pooling)
    # texts go through the same tokenization on every path
    text = cli_embed("-m", MODEL, "-t", "1", "Hello world")[0]["embedding"]
    assert f32(text) == embed(oai, model, "Hello world").data[0].embedding


def test_native_api_refusal_names_field(cluster):
    from conftest import BINARIES
    r = subprocess.run([BINARIES["tandem"], "embed", "--router", cluster.client_ep, "--tokens",
                        "1,2,999999999"], capture_output=True)
    assert r.returncode == 2, r
    assert b"token_inputs[0].ids[2]: token id 999999999 is outside the vocabulary" in r.stderr


GEMMA = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache"),
                     "tandem", "models", "gemma-3-270m-q4_k_m.gguf")


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    """SmolLM2 on a prefill + decode pair, Gemma 3 (alias g3) on one decode node alone: its
    embeddings run on that decode node, whose pool keeps KV per layer group."""
    if not os.path.exists(GEMMA):
        pytest.skip(f"{GEMMA} is missing: run scripts/setup --model gemma3-270m")
    from conftest import MODEL, Cluster, free_port
    from test_models_multi import config_text, node
    c = Cluster(str(tmp_path_factory.mktemp("embed-models")), n_prefill=0, n_decode=0)
    c.port = free_port()
    models = (f"models:\n  - path: {MODEL}\n    name: smol\n"
              f"  - path: {GEMMA}\n    name: gemma3\n    aliases: [g3]\n")
    nodes = [node("prefill-0", "prefill", "smol", "768MiB"),
             node("decode-0", "decode", "smol", "768MiB"),
             node("decode-1", "decode", "gemma3", "1GiB")]
    with open(c.config, "w") as f:
        f.write(config_text(c, models, nodes))
    c.prefill_ids = ["prefill-0"]
    c.decode_ids = ["decode-0", "decode-1"]
    c.start(timeout_s=240)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_two_models(two_models, oai, model):
    import openai
    with openai.OpenAI(base_url=f"http://127.0.0.1:{two_models.port}/v1", api_key="unused",
                       max_retries=0, timeout=300) as cl:
        for pooling in ("last", "mean"):
            cases = [c for c in golden_cases("gemma3") if c["pooling"] == pooling]
            r = embed(cl, "g3", [c["tokens"] for c in cases], pooling)
            assert r.model == "g3"
            for c, d in zip(cases, r.data):
                assert len(d.embedding) == 640
                assert cosine(d.embedding, c["embedding"]) >= min_cosine("gemma3"), c["name"]
            local = cli_embed("-m", GEMMA, "-t", "1", "--pooling", pooling,
                              *sum((["--tokens", ",".join(map(str, c["tokens"]))]
                                    for c in cases), []))
            assert [f32(x["embedding"]) for x in local] == [d.embedding for d in r.data]
        # the other model's vectors are its own: 576 wide, the first cluster's bits
        smol = embed(cl, "smol", "Hello world").data[0].embedding
        assert smol == embed(oai, model, "Hello world").data[0].embedding
