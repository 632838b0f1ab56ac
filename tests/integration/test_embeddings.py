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
import re
import socket
import struct
import subprocess
import threading

import pytest

from conftest import BINARIES, http_cluster, openai_client
from test_http import request, wait_for

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
    ({"input": [2**40]}, "input[0]", "outside the vocabulary"),  # an integer past int32
    ({"input": [[1, 2.5]]}, "input[0][1]", "must be an integer, got a number"),
    ({"input": [True]}, "input[0]", "got a boolean"),
    ({"input": "x", "model": 4}, "model", "must be a string"),  # 400, as the chat path's
    ({"input": ["a", "b\u0000c"]}, None, "NUL"),
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
    # the client library reads the router's ErrorDetail for EMBED too: the CLI names the field
    assert r.stderr.rstrip().endswith(b"(field: token_inputs[0].ids[2])"), r.stderr
    r = subprocess.run([BINARIES["tandem"], "embed", "--router", cluster.client_ep,
                        "--served-model", "no-such-model", "hello"], capture_output=True)
    assert r.returncode != 0, r
    assert b"no-such-model" in r.stderr and r.stderr.rstrip().endswith(b"(field: model)"), r.stderr


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


class HoldingPrefillNode:
    """A prefill node of the cluster's config played over ZMTP by the test (test_trust.py's
    FakeNode, registered with max_running inputs of room): it heartbeats from its own thread and
    keeps every EmbedTask the router sends it unanswered, so those calls stay outstanding until
    it leaves (close: the router then takes it for down and sends its inputs elsewhere)."""

    def __init__(self, cluster, node_id, model, max_running):
        from test_trust import FakeNode
        from tandem_client import pb
        self.pb = pb
        self.node = FakeNode(cluster.node_ep, node_id.encode())
        reg = pb.RegisterRequest(node_id=node_id, role=pb.NODE_ROLE_PREFILL, version="0.1.0",
                                 model_fingerprint=model.fingerprint, kv_blocks_total=100000,
                                 kv_endpoint="tcp://127.0.0.1:9", device="cpu",
                                 max_running=max_running, max_batch_tokens=2048,
                                 n_ctx=model.n_ctx, instance_id=self.node.instance)
        for k in ("n_layers", "n_kv_heads", "head_dim"):
            setattr(reg.kv_layout, k, getattr(model, k))
        reg.kv_layout.block_size = model.kv_block_size
        reg.kv_layout.dtype = model.kv_dtype
        self.node.send(pb.FRAME_KIND_REQUEST, pb.METHOD_REGISTER, reg)
        end = self.node.wait_end(pb.METHOD_REGISTER, 60)
        assert end.status == 0, end
        self.node_id = node_id
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        while not self.stop.is_set():
            with self.lock:
                self.node.heartbeat(self.node_id)
                self.node.drain(0.05)
            self.stop.wait(0.1)

    def tasks(self, method=None):
        with self.lock:
            m = method or self.pb.METHOD_EMBED_TASK
            return sum(1 for h in self.node.work if h.method == m)

    def close(self):
        self.stop.set()
        self.thread.join()
        self.node.close()


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """A cluster of 2 HTTP threads and a queue of 2, whose prefill node is a HoldingPrefillNode
    (started by the test) and whose decode node is real."""
    from conftest import Cluster
    from test_http import http_port
    c = Cluster(str(tmp_path_factory.mktemp("embed_held")), n_prefill=1, n_decode=1,
                default_keys=False, extra_router="  http_threads: 2\n  max_queue: 2\n")
    c._spawn("router", [BINARIES["router"], "--config", c.config])
    c._spawn("decode-0", [BINARIES["decode"], "--config", c.config, "--node-id", "decode-0"])
    c.wait_up(["decode-0"], 90)
    c.port = http_port(c)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def native_status(cluster):
    """(ClusterStatus, the first ModelInfo) from the native API."""
    from tandem_client import pb
    cl = cluster.client()
    try:
        st, msg, models = cl.unary(pb.METHOD_MODELS, pb.ModelsRequest(), pb.ModelsResponse)
        assert st == "OK", (st, msg)
        return cl.status(), models.models[0]
    finally:
        cl.close()


def test_held_node_parks_and_queues(held):
    """Six embedding requests, three times router.http_threads, while the only prefill node holds
    what it gets (max_running 2; first a client that hangs up while parked: its call is
    cancelled, NodeCancel to the node): two inputs go to it, the rest wait in the router (counted in
    requests_running / requests_queued), /health, /v1/models and /metrics still answer while
    all are outstanding, a request past router.max_queue is 429 with Retry-After; once the node
    leaves, every request is answered by the decode node with the vectors it gives alone."""
    texts = [f"embedding request number {i}" for i in range(6)]
    st, _, body = request(held.port, "POST", "/v1/embeddings", {"input": texts}, timeout=300)
    assert st == 200, body
    want = [d["embedding"] for d in json.loads(body)["data"]]  # decode-0 alone
    st, model = native_status(held)
    node = HoldingPrefillNode(held, "prefill-0", model, max_running=2)
    results = {}

    def one(i):
        results[i] = request(held.port, "POST", "/v1/embeddings", {"input": texts[i]},
                             timeout=600)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    try:
        held.wait_up(["prefill-0"], 60)
        # a client that hangs up while its request is parked: the call is cancelled (the node
        # is told to stop) and its room on the node is free again
        s = socket.create_connection(("127.0.0.1", held.port), timeout=60)
        s.sendall(b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 15\r\n\r\n{\"input\": \"hi\"}")
        wait_for(lambda: node.tasks() == 1, "the EmbedTask of the request to hang up", 120)
        s.close()
        wait_for(lambda: node.tasks(node.pb.METHOD_NODE_CANCEL) == 1, "its NodeCancel", 120)
        wait_for(lambda: native_status(held)[0].requests_running == 0, "no call running", 120)
        for t in threads:
            t.start()
        # two calls on the node (its room), two waiting in the router
        wait_for(lambda: node.tasks() == 3, "two more EmbedTasks on the holding node", 120)

        def counts():
            cs, mi = native_status(held)
            return (cs.requests_running, cs.requests_queued,
                    mi.requests_running, mi.requests_queued) == (2, 2, 2, 2)
        wait_for(counts, "2 running and 2 queued embedding requests", 120)
        # more requests than HTTP threads are outstanding, and these still answer
        assert request(held.port, "GET", "/health", timeout=120)[0] == 200
        st, _, body = request(held.port, "GET", "/v1/models", timeout=120)
        assert st == 200 and json.loads(body)["data"][0]["id"] == model.name
        st, _, metrics = request(held.port, "GET", "/metrics", timeout=120)
        assert st == 200
        assert re.search(rb"^tandem_requests_running 2$", metrics, re.M), metrics
        assert re.search(rb"^tandem_requests_queued 2$", metrics, re.M), metrics
        # the queue (2) is full: the next one is refused at once, as a generate request is
        st, hdrs, body = request(held.port, "POST", "/v1/embeddings", {"input": texts[4]},
                                 timeout=120)
        assert st == 429, body
        assert int(hdrs["Retry-After"]) >= 1
        assert "queue full" in json.loads(body)["error"]["message"]
        assert all(t.is_alive() for t in threads) and not results
        assert node.tasks() == 3  # the waiting ones never reached the full node
    finally:
        node.close()  # the router takes it for down: its inputs and the queue go to decode-0
    for t in threads:
        t.join(600)
        assert not t.is_alive()
    for i in range(4):
        st, _, body = results[i]
        assert st == 200, body
        assert json.loads(body)["data"][0]["embedding"] == want[i]
    cs, mi = native_status(held)
    assert (cs.requests_running, cs.requests_queued) == (0, 0)
