"""Several models behind one router: SmolLM2-135M (49k vocabulary) and Gemma 3 270M (262k
vocabulary), each with its own prefill and decode node, and a third configured model with no
node at all. Requests for both models at once, through the native client and the HTTP API,
each answer equal to `tandem generate -m` of its own model byte for byte; /v1/models and the
native MODELS call list every model with its context length and state; an unknown model is 404
model_not_found; a node started with a model the router does not list is refused, with the
reason in `tandem status --json`; `tandem config check` refuses a served name two models share.

`scripts/setup --model gemma3-270m` installs Gemma (scripts/test does); without it these tests
skip, saying so.
"""
import concurrent.futures
import http.client
import json
import os
import subprocess
import time

import pytest

from conftest import BINARIES, MODEL, Cluster, free_port, reference
from tandem_client import Result, pb, prompt_request

CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache")
GEMMA = os.environ.get("TANDEM_GEMMA3_MODEL") or os.path.join(
    CACHE, "tandem", "models", "gemma-3-270m-q4_k_m.gguf")

REQUESTS = [
    ("smol", dict(prompt="The capital of France is", max_tokens=16)),
    ("gemma3", dict(prompt="The capital of France is", max_tokens=16)),
    ("smol-2", dict(chat="Name three rivers in Europe.", max_tokens=16)),  # an alias of smol
    ("gemma3", dict(prompt="def fibonacci(n):", max_tokens=16, temperature=0.8, seed=7)),
    ("smol", dict(prompt="Once upon a time,", max_tokens=16, temperature=0.8, seed=7)),
    ("g3", dict(chat="Write a haiku about snow.", max_tokens=12)),  # an alias of gemma3
]
PATHS = {"smol": MODEL, "smol-2": MODEL, "gemma3": GEMMA, "g3": GEMMA}


def node(nid, role, model, budget):
    text = (f"  - id: {nid}\n    role: {role}\n    model: {model}\n    threads: 1\n"
            f"    memory_budget: {budget}\n")
    if role == "decode":
        text += f"    kv_endpoint: tcp://127.0.0.1:{free_port()}\n"
    return text


def config_text(c, models, nodes):
    return (models +
            f"router:\n  client_endpoint: {c.client_ep}\n  node_endpoint: {c.node_ep}\n"
            f"  http_port: {c.port}\n  prefill_policy: prefix_aware\n" + "nodes:\n" +
            "".join(nodes))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not os.path.exists(GEMMA):
        pytest.skip(f"{GEMMA} is missing: run scripts/setup --model gemma3-270m")
    tmp = str(tmp_path_factory.mktemp("models-multi"))
    c = Cluster(tmp, n_prefill=0, n_decode=0)
    c.port = free_port()
    models = (f"models:\n"
              f"  - path: {MODEL}\n    name: smol\n    aliases: [smol-2]\n"
              f"    defaults: {{temperature: 0, max_tokens: 6}}\n"
              f"  - path: {GEMMA}\n    name: gemma3\n    aliases: [g3]\n"
              f"  - path: {MODEL}\n    name: idle\n")
    # decode-x is configured for smol but started below with a config of its own whose model
    # the router does not serve
    nodes = [node("prefill-0", "prefill", "smol", "768MiB"),
             node("decode-0", "decode", "smol", "768MiB"),
             node("prefill-1", "prefill", "g3", "1GiB"),
             node("decode-1", "decode", "gemma3", "1GiB"),
             node("decode-x", "decode", "smol", "512MiB")]
    with open(c.config, "w") as f:
        f.write(config_text(c, models, nodes))
    c.prefill_ids = ["prefill-0", "prefill-1"]
    c.decode_ids = ["decode-0", "decode-1"]
    c.start(timeout_s=240)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def to_request(model, r):
    sp = {"temperature": r.get("temperature", 0.0)}
    if r.get("seed") is not None:
        sp["seed"] = r["seed"]
    if "chat" in r:
        req = prompt_request(chat=[("user", r["chat"])], max_tokens=r["max_tokens"], **sp)
    else:
        req = prompt_request(prompt=r["prompt"], max_tokens=r["max_tokens"], **sp)
    req.model = model
    return req


def http_call(port, method, path, body=None, timeout=300):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=json.dumps(body) if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def http_request(port, model, r):
    body = {"model": model, "max_tokens": r["max_tokens"],
            "temperature": r.get("temperature", 0.0)}
    if r.get("seed") is not None:
        body["seed"] = r["seed"]
    if "chat" in r:
        body["messages"] = [{"role": "user", "content": r["chat"]}]
        st, out = http_call(port, "POST", "/v1/chat/completions", body)
        assert st == 200, out
        return out["model"], out["choices"][0]["message"]["content"]
    body["prompt"] = r["prompt"]
    st, out = http_call(port, "POST", "/v1/completions", body)
    assert st == 200, out
    return out["model"], out["choices"][0]["text"]


def test_both_models_at_once_match_single_process(cluster):
    refs = [reference(prompt=r.get("prompt"), chat=r.get("chat"), max_tokens=r["max_tokens"],
                      temperature=r.get("temperature", 0.0), seed=r.get("seed"),
                      model=PATHS[m])
            for m, r in REQUESTS]
    # native calls and HTTP calls for both models, all in flight together
    cl = cluster.client()
    calls = {cl.start(to_request(m, r)): Result() for m, r in REQUESTS}
    with concurrent.futures.ThreadPoolExecutor(len(REQUESTS)) as ex:
        futures = [ex.submit(http_request, cluster.port, m, r) for m, r in REQUESTS]
        cl.collect(calls, timeout_s=600)
        answers = [f.result(timeout=600) for f in futures]
    cl.close()
    for (m, r), res, ref in zip(REQUESTS, calls.values(), refs):
        assert res.status == "OK", (m, r, res)
        assert res.text == ref, (m, r, res.text, ref)
    for (m, r), (model, text), ref in zip(REQUESTS, answers, refs):
        assert model == m
        assert text == ref, (m, r, text, ref)
    # the work went to each model's own nodes only
    nodes = cluster.wait_idle(2.0)
    assert nodes["decode-0"].model == "smol" and nodes["prefill-1"].model == "gemma3"


def scrape(port):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode()
    finally:
        conn.close()


def sample_value(text, name, **labels):
    want = [f'{k}="{v}"' for k, v in labels.items()]
    for line in text.splitlines():
        if (line.startswith(name + "{") and all(w in line for w in want)) or \
                (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{{{want}}}")


def test_metrics_per_model_name(cluster):
    # after test_both_models_at_once_match_single_process: 4 calls of each model answered
    text = scrape(cluster.port)
    for family in ("vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
                   "vllm:request_success_total"):
        assert text.count(f"# TYPE {family} ") == 1, family  # one family, a series per model
    for m in ("smol", "gemma3"):
        assert sample_value(text, "vllm:generation_tokens_total", model_name=m) > 0
        assert sample_value(text, "vllm:time_to_first_token_seconds_count", model_name=m) >= 6
        assert sample_value(text, "vllm:prompt_tokens_total", model_name=m) > 0
    assert sample_value(text, "vllm:generation_tokens_total", model_name="idle") == 0
    assert sample_value(text, "vllm:kv_cache_usage_perc", model_name="gemma3",
                        engine="decode-1") >= 0
    assert sample_value(text, "vllm:kv_cache_usage_perc", model_name="smol",
                        engine="decode-0") >= 0
    # the tandem_ request families are per model too (several models), with the same figures
    # as the vllm: ones of the same scrape; a node's series carry its model
    for m in ("smol", "gemma3", "idle"):
        for tandem, vllm in (("tandem_generation_tokens_total", "vllm:generation_tokens_total"),
                             ("tandem_prompt_tokens_total", "vllm:prompt_tokens_total"),
                             ("tandem_time_to_first_token_seconds_count",
                              "vllm:time_to_first_token_seconds_count"),
                             ("tandem_e2e_request_latency_seconds_sum",
                              "vllm:e2e_request_latency_seconds_sum")):
            assert sample_value(text, tandem, model_name=m) == \
                sample_value(text, vllm, model_name=m), (tandem, m)
        assert sample_value(text, "tandem_requests_queued", model_name=m) == 0
    assert text.count("# TYPE tandem_time_to_first_token_seconds ") == 1
    assert sample_value(text, "tandem_node_up", node="decode-1", model_name="gemma3") == 1
    assert sample_value(text, "tandem_node_kv_blocks_capacity", node="decode-0",
                        model_name="smol") > 0
    assert sample_value(text, "tandem_time_to_first_token_seconds_count", model_name="smol") >= 6
    assert sample_value(text, "tandem_time_to_first_token_seconds_count", model_name="idle") == 0
    assert not any(line.startswith("tandem_generation_tokens_total ")
                   for line in text.splitlines())  # no unlabelled series beside the models'
    # a request for a model not served ends before its model is known: counted without
    # model_name (only there), so the families still sum to the cluster's figures
    st, body = http_call(cluster.port, "POST", "/v1/completions",
                         {"model": "not-a-model", "prompt": "hi", "max_tokens": 2})
    assert st == 404, body
    # and one the HTTP gateway refuses itself (a field of the wrong type), merged into the
    # router's series without model_name on GET /metrics
    st, body = http_call(cluster.port, "POST", "/v1/completions",
                         {"model": "smol", "prompt": "hi", "max_tokens": "two"})
    assert st == 400 and body["error"]["param"] == "max_tokens", body
    text = scrape(cluster.port)
    for status in ("NOT_FOUND", "INVALID_ARGUMENT"):
        refused = [line for line in text.splitlines()
                   if line.startswith("tandem_requests_total{") and f'status="{status}"' in line]
        assert len(refused) == 1 and "model_name" not in refused[0], refused
        assert float(refused[0].rsplit(" ", 1)[1]) >= 1
    ok = sum(sample_value(text, "tandem_requests_total", model_name=m, status="OK",
                          finish_reason=f) for m in ("smol", "gemma3") for f in ("stop", "length"))
    assert ok == sum(sample_value(text, "vllm:request_success_total", model_name=m,
                                  finished_reason=f)
                     for m in ("smol", "gemma3") for f in ("stop", "length"))


def test_status_lists_each_model(cluster):
    # `tandem status`: the default model in the header, then a line per model with its state,
    # nodes up, context and requests (MODELS, protocol 2.7)
    cl = cluster.client()
    waiting = cl.start(to_request("idle", dict(prompt="hi", max_tokens=2)),
                       deadline_ms=int(time.time() * 1000) + 120000)
    try:
        end = time.time() + 60
        while True:
            out = subprocess.run([BINARIES["tandem"], "status", "--json", "--router",
                                  cluster.client_ep], capture_output=True, check=True)
            doc = json.loads(out.stdout)
            models = {m["name"]: m for m in doc["models"]}
            if models["idle"]["requests_queued"] == 1 or time.time() > end:
                break
            time.sleep(0.2)
        assert doc["model"] == "smol"
        assert list(models) == ["smol", "gemma3", "idle"]
        assert models["idle"]["requests_queued"] == 1, models
        assert models["idle"]["state"] == "unavailable" and models["idle"]["decode_nodes_up"] == 0
        for m in ("smol", "gemma3"):
            assert models[m]["state"] == "ready", models
            assert (models[m]["prefill_nodes_up"], models[m]["decode_nodes_up"]) == (1, 1)
            assert models[m]["max_model_len"] > 0 and models[m]["requests_queued"] == 0
        table = subprocess.run([BINARIES["tandem"], "status", "--router", cluster.client_ep],
                               capture_output=True, check=True, text=True).stdout.splitlines()
        assert table[0].endswith(", 3 models (default smol)"), table[0]
        rows = {line.split()[0]: line.split() for line in table if line.split()}
        assert rows["MODEL"] == ["MODEL", "STATE", "PREFILL", "UP", "DECODE", "UP", "CONTEXT",
                                 "RUNNING", "QUEUED"]
        assert rows["idle"][1:4] == ["unavailable", "0", "0"] and rows["idle"][-1] == "1"
        assert rows["gemma3"][1:4] == ["ready", "1", "1"]
        assert rows["gemma3"][4] == str(models["gemma3"]["max_model_len"])
    finally:
        cl.cancel(waiting)
        cl.close()


def test_models_listed_with_max_model_len_and_state(cluster):
    cl = cluster.client()
    st, msg, resp = cl.unary(pb.METHOD_MODELS, pb.ModelsRequest(), pb.ModelsResponse)
    cl.close()
    assert st == "OK", msg
    native = {m.name: m for m in resp.models}
    assert list(native) == ["smol", "gemma3", "idle"]
    assert list(native["smol"].aliases) == ["smol-2"]
    assert list(native["gemma3"].aliases) == ["g3"]
    assert native["smol"].n_vocab == 49152 and native["gemma3"].n_vocab == 262144
    assert native["smol"].n_ctx == native["idle"].n_ctx
    assert native["smol"].state == "ready" and native["gemma3"].state == "ready"
    assert (native["smol"].prefill_nodes_up, native["smol"].decode_nodes_up) == (1, 1)
    assert (native["gemma3"].prefill_nodes_up, native["gemma3"].decode_nodes_up) == (1, 1)
    assert native["idle"].state == "unavailable" and native["idle"].decode_nodes_up == 0
    st, body = http_call(cluster.port, "GET", "/v1/models")
    assert st == 200 and body["object"] == "list"
    listed = {m["id"]: m for m in body["data"]}
    assert list(listed) == ["smol", "gemma3", "idle"]
    for name, m in listed.items():
        assert m["max_model_len"] == native[name].n_ctx
        assert m["state"] == native[name].state
    assert listed["gemma3"]["aliases"] == ["g3"]
    # one model by name or alias
    st, one = http_call(cluster.port, "GET", "/v1/models/g3")
    assert st == 200 and one["id"] == "gemma3"


def cli_ids(path, *args):
    out = subprocess.run([BINARIES["tandem"], "tokenize", "-m", path, *args],
                         capture_output=True, check=True, text=True)
    return [int(x) for x in out.stdout.split()]


def test_tokenize_per_model(cluster):
    # /tokenize with each model's own tokenizer and chat template, by name or alias
    for name, path in (("smol", MODEL), ("g3", GEMMA)):
        st, out = http_call(cluster.port, "POST", "/tokenize",
                            {"model": name, "messages": [{"role": "user", "content": "Hi there"}]})
        assert st == 200, out
        assert out["tokens"] == cli_ids(path, "--chat", "Hi there"), (name, out)
    st, out = http_call(cluster.port, "POST", "/tokenize", {"model": "nope", "prompt": "x"})
    assert st == 404, out


def test_capacity_per_model(cluster):
    cl = cluster.client()
    st, msg, resp = cl.unary(pb.METHOD_MODELS, pb.ModelsRequest(), pb.ModelsResponse)
    cl.close()
    assert st == "OK", msg
    native = {m.name: m for m in resp.models}
    for query, name in (("model=g3", "gemma3"), ("model=smol", "smol"), ("", "smol"),
                        ("node=decode-1", "gemma3"), ("node=decode-0", "smol")):
        st, plan = http_call(cluster.port, "GET", "/api/capacity?" + query)
        assert st == 200, (query, plan)
        assert plan["model"] == name, (query, plan)
        m = native[name]
        assert (plan["n_layers"], plan["n_kv_heads"], plan["head_dim"]) == \
            (m.n_layers, m.n_kv_heads, m.head_dim), (query, plan)
    st, body = http_call(cluster.port, "GET", "/api/capacity?model=nope")
    assert st == 404 and body["error"]["code"] == "model_not_found", body
    # a node with its own model (or an alias of it) is fine; with another model it is a 400:
    # the node's pool would be planned with a shape it does not hold
    st, plan = http_call(cluster.port, "GET", "/api/capacity?node=decode-1&model=g3")
    assert st == 200 and plan["model"] == "gemma3", plan
    st, body = http_call(cluster.port, "GET", "/api/capacity?node=decode-1&model=smol")
    assert st == 400 and body["error"]["param"] == "model", body
    assert "node decode-1 serves gemma3, not smol" in body["error"]["message"], body


def test_dashboard_status_per_model(cluster):
    st, body = http_call(cluster.port, "GET", "/api/status")
    assert st == 200, body
    assert [m["name"] for m in body["models"]] == ["smol", "gemma3", "idle"]
    assert body["model_info"]["name"] == "smol"
    nodes = {n["node_id"]: n for n in body["nodes"]}
    assert nodes["decode-1"]["model"] == "gemma3" and nodes["decode-0"]["model"] == "smol"
    # each node's pool as its own model's plan sees it (the same figures /api/capacity gives)
    for nid in ("decode-0", "decode-1"):
        st, plan = http_call(cluster.port, "GET", f"/api/capacity?node={nid}")
        assert st == 200, plan
        assert nodes[nid]["pool"]["block_bytes"] == plan["block_bytes"], (nid, plan)
        assert nodes[nid]["pool"]["context"] == plan["context"], (nid, plan)
    assert nodes["decode-0"]["pool"]["block_bytes"] != nodes["decode-1"]["pool"]["block_bytes"]
    # the charts read the tandem_ series of every model summed (the cluster's figures): a
    # request of each model shows in the output tokens/s and TTFT
    for m in ("gemma3", "smol"):
        st, out = http_call(cluster.port, "POST", "/v1/completions",
                            {"model": m, "prompt": "Tell me a story.", "max_tokens": 8})
        assert st == 200, out
    end = time.time() + 120
    while True:
        st, body = http_call(cluster.port, "GET", "/api/status")
        h = body["history"]
        if (any(v for v in h["tokens_per_s"] if v) and any(h["ttft_n"])) or time.time() > end:
            break
        time.sleep(0.5)
    assert any(v for v in h["tokens_per_s"] if v), h
    assert sum(n for n in h["ttft_n"] if n) >= 1, h


def test_dashboard_kv_use_weighs_block_bytes(cluster):
    """The dashboard's KV used % weighs each decode node's blocks by its block bytes (2.9): Gemma's
    node allocates per layer group (blocks of one group's 3 layers, 49,152 B) and SmolLM2's
    blocks hold 30 layers (368,640 B); while a Gemma stream runs, the history's last figure is
    the used bytes over the pools' bytes of the same sample's nodes."""
    cl = cluster.client()
    req = prompt_request(prompt="Count to one thousand: one, two,", max_tokens=400,
                         temperature=0.0, ignore_eos=True)
    req.model = "gemma3"
    call = cl.start(req)
    try:
        end = time.time() + 300
        while True:
            st, body = http_call(cluster.port, "GET", "/api/status")
            assert st == 200, body
            nodes = {n["node_id"]: n for n in body["nodes"]}
            if nodes["decode-1"]["kv_blocks_used"] > 0 or time.time() > end:
                break
            time.sleep(0.1)
        assert nodes["decode-1"]["kv_blocks_used"] > 0, nodes["decode-1"]
        assert nodes["decode-1"]["kv_layer_groups"] == 6, nodes["decode-1"]
        assert nodes["decode-1"]["kv_block_bytes"] == 49152, nodes["decode-1"]
        assert nodes["decode-0"]["kv_block_bytes"] == 368640, nodes["decode-0"]
        dec = [n for n in body["nodes"] if n["role"] == "decode" and n["up"]]
        used = sum(n["kv_block_bytes"] * n["kv_blocks_used"] for n in dec)
        total = sum(n["kv_block_bytes"] * n["kv_blocks_total"] for n in dec)
        assert abs(body["history"]["kv_used_pct"][-1] - 100.0 * used / total) < 1e-9, \
            (body["history"]["kv_used_pct"][-1], used, total)
    finally:
        cl.cancel(call)
        cl.close()


def test_cli_generate_by_served_model(cluster):
    # `tandem generate` through the router names the model with --served-model
    for name, path in (("g3", GEMMA), ("smol-2", MODEL)):
        out = subprocess.run([BINARIES["tandem"], "generate", "--router", cluster.client_ep,
                              "--served-model", name, "-p", "The capital of France is", "-n",
                              "8", "--temperature", "0"],
                             capture_output=True, check=True, text=True)
        assert out.stdout[:-1] == reference(prompt="The capital of France is", max_tokens=8,
                                            model=path), (name, out.stdout, out.stderr)
    # and `tandem chat` the same way: the answer is the chat reference of that model
    out = subprocess.run([BINARIES["tandem"], "chat", "--router", cluster.client_ep,
                          "--served-model", "g3", "-n", "6", "--temperature", "0"],
                         input="Hi\n", capture_output=True, check=True, text=True)
    ref = reference(chat="Hi", max_tokens=6, model=GEMMA)
    assert ref.strip() and ref in out.stdout, (ref, out.stdout, out.stderr)
    out = subprocess.run([BINARIES["tandem"], "generate", "--router", cluster.client_ep,
                          "--served-model", "nope", "-p", "x", "-n", "2"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "model 'nope' is not served here" in out.stderr, out.stderr


def test_model_defaults(cluster):
    # smol's defaults (greedy, 6 tokens) fill what a request leaves unset; gemma3 keeps
    # Tandem's (max_tokens: what fits, at most 1024; here its EOS or a stop comes first)
    cl = cluster.client()
    req = prompt_request(prompt="The capital of France is", max_tokens=0)
    req.model = "smol"
    res = cl.generate(req, 300)
    assert res.status == "OK", res
    assert res.final.usage.completion_tokens == 6
    assert res.text == reference(prompt="The capital of France is", max_tokens=6)
    # a field the request sets wins over the model's default
    req = prompt_request(prompt="The capital of France is", max_tokens=3)
    req.model = "smol"
    res = cl.generate(req, 300)
    cl.close()
    assert res.status == "OK" and res.final.usage.completion_tokens == 3, res
    st, out = http_call(cluster.port, "POST", "/v1/chat/completions",
                        {"model": "smol", "messages": [{"role": "user", "content": "Hi"}]})
    assert st == 200, out
    assert out["usage"]["completion_tokens"] <= 6
    assert out["choices"][0]["message"]["content"] == reference(chat="Hi", max_tokens=6)


def test_unknown_model_is_404(cluster):
    st, body = http_call(cluster.port, "POST", "/v1/completions",
                    {"model": "no-such-model", "prompt": "hi", "max_tokens": 2})
    assert st == 404, body
    assert body["error"]["code"] == "model_not_found"
    assert "'no-such-model'" in body["error"]["message"]
    assert "'smol', 'gemma3', 'idle'" in body["error"]["message"]
    cl = cluster.client()
    res = cl.generate(to_request("no-such-model", dict(prompt="hi", max_tokens=2)), 60)
    cl.close()
    assert res.status == "NOT_FOUND", res


def test_model_without_nodes_waits_like_a_missing_decode_node(cluster):
    # no node serves "idle": its request waits in the queue until its deadline, as any
    # request does while no decode node is up; the other models are not held up behind it
    cl = cluster.client()
    idle = cl.start(to_request("idle", dict(prompt="hi", max_tokens=2)),
                    deadline_ms=int(time.time() * 1000) + 4000)
    busy = cl.start(to_request("smol", dict(prompt="The capital of France is", max_tokens=4)))
    results = cl.collect({idle: Result(), busy: Result()}, timeout_s=300)
    cl.close()
    assert results[busy].status == "OK", results[busy]
    assert results[busy].text == reference(prompt="The capital of France is", max_tokens=4)
    assert results[idle].status == "DEADLINE_EXCEEDED", results[idle]


def test_node_with_unlisted_model_is_refused(cluster, tmp_path):
    # decode-x's own config names a model this router does not serve
    other = os.path.join(str(tmp_path), "other.yaml")
    with open(other, "w") as f:
        f.write(config_text(cluster,
                            f"models:\n  - path: {MODEL}\n    name: other-model\n",
                            [node("decode-x", "decode", "other-model", "512MiB")]))
    log = open(os.path.join(str(tmp_path), "decode-x.log"), "w")
    p = subprocess.Popen([BINARIES["decode"], "--config", other, "--node-id", "decode-x"],
                         stdout=log, stderr=subprocess.STDOUT,
                         env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    try:
        end = time.time() + 180
        reason = ""
        while time.time() < end and not reason:
            out = subprocess.run([BINARIES["tandem"], "status", "--json", "--router",
                                  cluster.client_ep], capture_output=True, check=True)
            nodes = {n["node_id"]: n for n in json.loads(out.stdout)["nodes"]}
            reason = nodes["decode-x"]["refused_reason"]
            time.sleep(0.2)
        assert reason == ("model 'other-model' is not served by this router (its models: "
                          "'smol', 'gemma3', 'idle')"), reason
        assert not nodes["decode-x"]["up"]
        assert nodes["decode-x"]["model"] == "smol"
        assert nodes["decode-1"]["model"] == "gemma3"
    finally:
        p.terminate()
        p.wait(timeout=60)
        log.close()


def test_config_check_refuses_duplicate_served_names(tmp_path):
    path = os.path.join(str(tmp_path), "dup.yaml")
    with open(path, "w") as f:
        f.write(f"models:\n  - path: {MODEL}\n    name: chat\n"
                f"  - path: {GEMMA}\n    name: gemma3\n    aliases: [chat]\n")
    out = subprocess.run([BINARIES["tandem"], "config", "check", path], capture_output=True,
                         text=True)
    assert out.returncode != 0
    assert ("key 'models[1].aliases': duplicate served model name 'chat': models[1].aliases "
            f"(path {GEMMA}) and models[0].name (path {MODEL}) both serve it") in out.stderr, \
        out.stderr
