"""vLLM-compatible metrics (router.metrics_compat: vllm, the default): every vLLM 0.33.0
series on tests/vllm_metrics.tsv is either served by GET /metrics with vLLM's type and
labels, or listed as not applicable with the reason; the served ones count what one
OpenAI completion did (compared before/after it), the router's process_* and the nodes'
tandem_node_process_* figures are sane, and metrics_compat: none leaves only Tandem's own.
"""
import json
import os
import re
import time
import urllib.error
import urllib.request

import pytest

from conftest import Cluster
from tandem_client import SOURCE_DIR

LIST = os.path.join(SOURCE_DIR, "tests", "vllm_metrics.tsv")
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})? (\S+)$')
LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def reference():
    """[(name, type, [labels], status)] of the committed list."""
    rows = []
    with open(LIST) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            name, kind, labels, status = line.rstrip("\n").split("\t")
            rows.append((name, kind, labels.split(","), status))
    return rows


def scrape(port):
    """(types {family: type}, samples [(name, {labels}, value)]) of GET /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    types, samples = {}, []
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, line
            samples.append((m.group(1), dict(LABEL.findall(m.group(2) or "")),
                            float(m.group(3))))
    return types, samples


def total(samples, name, **want):
    """Sum of name's samples whose labels include want."""
    return sum(v for n, lab, v in samples if n == name
               and all(lab.get(k) == x for k, x in want.items()))


def port_of(cluster):
    with open(cluster.config) as f:
        return int(re.search(r"^\s*http_port:\s*(\d+)\s*$", f.read(), re.M).group(1))


def complete(port, model, prompt, max_tokens):
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def model_name(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=30) as r:
        return json.loads(r.read())["data"][0]["id"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    # no speculative decoding: the tests count forward passes of one decode row each
    c = Cluster(str(tmp_path_factory.mktemp("vllm-metrics")), n_prefill=1, n_decode=1,
                extra_decode="    speculative:\n      max_draft: 0\n")
    c.start()
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_the_list_covers_loggers_and_says_why():
    rows = reference()
    names = [r[0] for r in rows]
    assert len(names) == len(set(names)), "a name listed twice"
    for name, kind, labels, status in rows:
        assert name.startswith("vllm:"), name
        assert kind in ("counter", "gauge", "histogram"), (name, kind)
        assert status == "served" or (status.startswith("not applicable: ")
                                      and len(status) > len("not applicable: ") + 10), \
            (name, status)
    # the series the issue names are served
    for must in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:request_success_total", "vllm:time_to_first_token_seconds",
                 "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
                 "vllm:request_decode_time_seconds", "vllm:request_inference_time_seconds",
                 "vllm:request_prompt_tokens", "vllm:request_generation_tokens",
                 "vllm:cache_config_info", "vllm:prefix_cache_queries_total",
                 "vllm:prefix_cache_hits_total", "vllm:iteration_tokens_total"):
        assert (must, "served") in [(r[0], r[3]) for r in rows], must


def wait_node_process_figures(port, nodes, timeout_s=60):
    deadline = time.monotonic() + timeout_s
    while True:
        types, samples = scrape(port)
        if all(total(samples, "tandem_node_process_resident_memory_bytes", node=n) > 0
               for n in nodes):
            return types, samples
        assert time.monotonic() < deadline, "no node sent its process figures"
        time.sleep(0.2)


def test_every_listed_series_is_served_and_counts_one_request(cluster):
    port = port_of(cluster)
    model = model_name(port)
    _, before = scrape(port)
    out = complete(port, model, "The capital of France is", 8)
    usage = out["usage"]
    reason = out["choices"][0]["finish_reason"]
    types, after = wait_node_process_figures(port, cluster.prefill_ids + cluster.decode_ids)
    served = [r for r in reference() if r[3] == "served"]
    for name, kind, labels, _ in served:
        assert types.get(name) == kind, f"{name}: type {types.get(name)}, want {kind}"
        series = name + "_count" if kind == "histogram" else name
        got = [lab for n, lab, _ in after if n == series]
        assert got, f"{name}: no sample"
        for lab in got:
            assert set(labels) <= set(lab), f"{name}: labels {sorted(lab)}, want {labels}"
            if "model_name" in labels:
                assert lab["model_name"] == model, (name, lab)

    def d(name, **want):
        return total(after, name, **want) - total(before, name, **want)

    assert d("vllm:request_success_total", finished_reason=reason) == 1
    assert d("vllm:request_success_total") == 1
    assert d("vllm:prompt_tokens_total") == usage["prompt_tokens"]
    assert d("vllm:generation_tokens_total") == usage["completion_tokens"]
    assert d("vllm:prompt_tokens_total") == d("tandem_prompt_tokens_total")
    assert d("vllm:generation_tokens_total") == d("tandem_generation_tokens_total")
    for h in ("time_to_first_token_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prefill_time_seconds",
              "request_decode_time_seconds", "request_inference_time_seconds",
              "request_prompt_tokens", "request_generation_tokens",
              "request_time_per_output_token_seconds", "request_num_preemptions"):
        assert d(f"vllm:{h}_count") == 1, h
        assert d(f"vllm:{h}_bucket", le="+Inf") == 1, h
    # the request's parameters, once per call: n = 1 (bucket le="1"), max_tokens 8
    assert d("vllm:request_params_n_count") == 1
    assert d("vllm:request_params_n_bucket", le="1") == 1
    assert d("vllm:request_params_n_sum") == 1
    assert d("vllm:request_params_max_tokens_count") == 1
    # one call of one choice: its longest choice is its only one
    assert d("vllm:request_max_num_generation_tokens_count") == 1
    assert d("vllm:request_max_num_generation_tokens_sum") == usage["completion_tokens"]
    assert d("vllm:request_params_max_tokens_sum") == 8
    assert d("vllm:request_params_max_tokens_bucket", le="5") == 0
    assert d("vllm:request_params_max_tokens_bucket", le="10") == 1
    assert d("vllm:inter_token_latency_seconds_count") == usage["completion_tokens"] - 1
    assert d("vllm:request_prompt_tokens_sum") == usage["prompt_tokens"]
    assert d("vllm:request_generation_tokens_sum") == usage["completion_tokens"]
    assert 0 < d("vllm:request_decode_time_seconds_sum") <= d("vllm:e2e_request_latency_seconds_sum")
    assert total(after, "vllm:num_requests_running") == 0
    assert total(after, "vllm:num_requests_waiting") == 0
    assert d("vllm:num_preemptions_total") == 0
    for _, lab, v in [s for s in after if s[0] == "vllm:kv_cache_usage_perc"]:
        assert 0 <= v <= 1, lab
    assert total(after, "vllm:cache_config_info", block_size="16",
                 enable_prefix_caching="True") == 1
    src = d("vllm:prompt_tokens_by_source_total")
    assert src == usage["prompt_tokens"]
    # the router's own process and the nodes' (from their heartbeats)
    assert total(after, "process_resident_memory_bytes") > 1 << 20
    assert total(after, "process_open_fds") >= 3
    assert 0 < total(after, "process_start_time_seconds") <= time.time()
    assert total(after, "process_cpu_seconds_total") > 0
    for n in cluster.prefill_ids + cluster.decode_ids:
        assert total(after, "tandem_node_process_resident_memory_bytes", node=n) > 1 << 20
        assert total(after, "tandem_node_process_open_fds", node=n) >= 3
        assert total(after, "tandem_node_process_cpu_seconds_total", node=n) > 0


ITERATION_BOUNDS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]  # vLLM's


def heartbeats_since(port, t_wall):
    """Waits until the router has a heartbeat from every up node sent after t_wall (time.time()):
    node counters the router shows then include everything the nodes did before t_wall. An
    event (the heartbeat), not a sleep; generous deadline."""
    deadline = time.monotonic() + 60
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=30) as r:
            st = json.loads(r.read())
        now = time.time()
        nodes = [n for n in st["nodes"] if n["up"]]
        if nodes and all(now - n["last_heartbeat_age_s"] > t_wall for n in nodes):
            return
        assert time.monotonic() < deadline, st["nodes"]
        time.sleep(0.1)


def test_iteration_tokens_count_the_passes_of_a_request(cluster):
    """vllm:iteration_tokens_total (and tandem_iteration_tokens): one observation per forward
    pass of any node, its tokens (rows) as the value; vLLM 0.33.0's buckets. A request of P
    prompt tokens and N output tokens takes at least one prefill pass and N - 1 decode passes
    of one row each, P + N - 1 tokens in all (the last token is never fed back)."""
    port = port_of(cluster)
    model = model_name(port)
    # the earlier tests' passes have all been reported: a heartbeat after one received after
    # now (the engine publishes its figures for the link thread after each step)
    heartbeats_since(port, time.time())
    heartbeats_since(port, time.time())
    types, before = scrape(port)
    assert types["vllm:iteration_tokens_total"] == "histogram"
    assert types["tandem_iteration_tokens"] == "histogram"
    les = sorted(float(lab["le"]) for n, lab, _ in before
                 if n == "vllm:iteration_tokens_total_bucket")
    assert les == ITERATION_BOUNDS + [float("inf")]
    for n, lab, _ in before:
        if n.startswith("vllm:iteration_tokens_total"):
            assert lab.get("model_name") == model and lab.get("engine") == "0", (n, lab)
    n_out = 8
    out = complete(port, model, "Iteration tokens, counted once per pass: " + str(time.time()),
                   n_out)
    usage = out["usage"]
    assert usage["completion_tokens"] == n_out
    want_tokens = usage["prompt_tokens"] + n_out - 1

    def d(samples, name, **want):
        return total(samples, name, **want) - total(before, name, **want)

    deadline = time.monotonic() + 60  # the figures arrive with the nodes' heartbeats
    while True:
        _, after = scrape(port)
        if (d(after, "vllm:iteration_tokens_total_count") >= n_out
                and d(after, "vllm:iteration_tokens_total_sum") >= want_tokens):
            break
        assert time.monotonic() < deadline, (d(after, "vllm:iteration_tokens_total_count"),
                                             d(after, "vllm:iteration_tokens_total_sum"))
        time.sleep(0.2)
    passes = d(after, "vllm:iteration_tokens_total_count")
    tokens = d(after, "vllm:iteration_tokens_total_sum")
    assert n_out <= passes <= n_out + 2, passes
    assert want_tokens <= tokens <= want_tokens + usage["prompt_tokens"], tokens
    # the decode steps have one row each: le="1" holds them
    assert d(after, "vllm:iteration_tokens_total_bucket", le="1") >= n_out - 1
    assert d(after, "vllm:iteration_tokens_total_bucket", le="+Inf") == passes
    # Tandem's own family says the same
    assert d(after, "tandem_iteration_tokens_count") == passes
    assert d(after, "tandem_iteration_tokens_sum") == tokens


def test_vllm_dashboard_uses_only_served_series(cluster):
    """deploy/grafana/vllm.json: every series its queries name is served."""
    with open(os.path.join(SOURCE_DIR, "deploy", "grafana", "vllm.json")) as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 12
    types, _ = scrape(port_of(cluster))
    missing = []
    for name in set(re.findall(r"\b(?:vllm:|tandem_|process_)[a-z0-9_]+", " ".join(exprs))):
        family = re.sub(r"_(bucket|sum|count)$", "", name)
        if name not in types and not (family in types and types[family] == "histogram"):
            missing.append(name)
    assert not missing, missing


def test_not_applicable_series_are_not_served(cluster):
    types, _ = scrape(port_of(cluster))
    for name, _, _, status in reference():
        if status != "served":
            assert name not in types, f"{name} is served but listed as {status!r}"


def post_status(port, path, payload):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(payload).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        e.read()
        return e.code


def test_gateway_counts_responses_by_code_and_refusals_by_field(cluster):
    port = port_of(cluster)
    model = model_name(port)
    _, before = scrape(port)
    assert post_status(port, "/v1/completions", {"model": model, "prompt": "Hi",
                                                 "max_tokens": 0}) == 400
    assert post_status(port, "/v1/completions", {"model": model, "prompt": "Hi",
                                                 "max_tokens": 0}) == 400
    assert post_status(port, "/v1/completions", {"model": model, "prompt": "Hi",
                                                 "max_tokens": 2}) == 200
    # refused by the router itself (its range check)
    assert post_status(port, "/v1/completions", {"model": model, "prompt": "Hi",
                                                 "max_tokens": 2, "temperature": 9}) == 400
    assert post_status(port, "/v1/nothing-here", {}) == 404
    types, after = scrape(port)
    assert types["tandem_http_requests_total"] == "counter"
    assert types["tandem_http_requests_refused_total"] == "counter"

    def d(name, **want):
        return total(after, name, **want) - total(before, name, **want)

    assert d("tandem_http_requests_refused_total", reason="max_tokens") == 2
    assert d("tandem_http_requests_refused_total") == 2
    # every refusal is in tandem_requests_total under its status, the gateway's two and the
    # router's one in one series; only the router's was received by it
    refused = {"status": "INVALID_ARGUMENT", "finish_reason": "none"}
    assert d("tandem_requests_total", **refused) == 3
    assert len([1 for n, lab, _ in after if n == "tandem_requests_total"
                and all(lab.get(k) == x for k, x in refused.items())]) == 1
    assert d("tandem_requests_received_total") == 2
    assert d("tandem_http_requests_total", code="400") == 3
    assert d("tandem_http_requests_total", code="404") == 1
    # the 200 of the completion and those of the first scrape (the second is counted after
    # it was rendered)
    assert d("tandem_http_requests_total", code="200") == 2
    # refused by the gateway: the router never saw them
    assert d("vllm:request_success_total") == 1


def test_metrics_compat_none_serves_tandem_series_only(tmp_path):
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=1, extra_router="  metrics_compat: none\n")
    c.start()
    try:
        types, _ = scrape(port_of(c))
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), codes
    assert "tandem_prompt_tokens_total" in types and "process_open_fds" in types
    assert not [n for n in types if n.startswith("vllm:")]
