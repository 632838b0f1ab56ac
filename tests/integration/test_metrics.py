"""Metrics integration tests: the router's metrics (router/metrics.c) read as data through the
native METHOD_METRICS and as Prometheus text through the HTTP gateway's GET /metrics (the
only renderer, tdm_proto_metrics_text), scraped by a real
Prometheus server (Debian's `prometheus`, on loopback with a generated config and a temporary
storage dir) and read back through its HTTP query API; `promtool` checks the text and the
deploy/ files, and every metric the Grafana dashboard uses must exist in the text.

Figures are compared as differences before/after the test's own requests, so the tests do not
depend on each other's order.
"""
import datetime
import json
import math
import os
import re
import shutil
import signal
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from conftest import Cluster, free_port
from tandem_client import SOURCE_DIR, Result, pb, prompt_request

# KV bytes of one block of SmolLM2-135M with the default kv config (f16, 16 tokens):
# 2 (K, V) * 30 layers * 3 KV heads * 64 head_dim * 16 tokens * 2 bytes
BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 2
BLOCK_SIZE = 16
PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "def fibonacci(n):",
    "List three colors of the rainbow:",
    "Water boils at a temperature of",
]
# long enough for several full KV blocks: the second time, the prefill node's cache hits
SHARED = ("You are a careful assistant. Answer briefly and precisely, in plain English, "
          "without lists or markup, and never invent facts you are not sure about. " * 3)
DASHBOARD = os.path.join(SOURCE_DIR, "deploy", "grafana", "tandem.json")
SCRAPE_CONFIG = os.path.join(SOURCE_DIR, "deploy", "prometheus", "prometheus.yml")
SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})? (\S+)$')


def tool(name):
    path = shutil.which(name)
    if not path and os.path.exists(f"/usr/bin/{name}"):
        path = f"/usr/bin/{name}"
    if not path:
        pytest.fail(f"{name} is not installed (Debian package prometheus; run scripts/setup)")
    return path


def parse(text):
    """{series: value} and {family: type} of an exposition text."""
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            assert name not in types, f"family {name} announced twice"
            types[name] = kind
        elif line.startswith("#") or not line:
            continue
        else:
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            samples[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return samples, types


TYPES = {pb.METRIC_TYPE_COUNTER: "counter", pb.METRIC_TYPE_GAUGE: "gauge",
         pb.METRIC_TYPE_HISTOGRAM: "histogram"}


def native_message(cluster):
    """The native METRICS answer: data (families of samples), no text."""
    c = cluster.client()
    try:
        st, msg, resp = c.unary(pb.METHOD_METRICS, pb.MetricsRequest(), pb.MetricsResponse)
    finally:
        c.close()
    assert st == "OK", (st, msg)
    assert resp.text == "" and resp.families
    return resp


def from_message(resp):
    """The METRICS message read as parse() reads the text: ({series: value}, {family: type})."""
    samples, types = {}, {}
    for fam in resp.families:
        types[fam.name] = TYPES[fam.type]
        if fam.type == pb.METRIC_TYPE_HISTOGRAM:
            h, cum = fam.histogram, 0
            hl = "".join(f'{lb.name}="{lb.value}",' for lb in fam.histogram_labels)
            for le, n in zip(h.bounds, h.counts):
                cum += n
                samples[f'{fam.name}_bucket{{{hl}le="{le:.15g}"}}'] = float(cum)
            samples[f'{fam.name}_bucket{{{hl}le="+Inf"}}'] = float(h.count)
            tail = f"{{{hl[:-1]}}}" if hl else ""
            samples[fam.name + "_sum" + tail] = h.sum
            samples[fam.name + "_count" + tail] = float(h.count)
            continue
        for smp in fam.samples:
            labels = ",".join(f'{lb.name}="{lb.value}"' for lb in smp.labels)
            key = fam.name + (f"{{{labels}}}" if labels else "")
            samples[key] = float(getattr(smp, smp.WhichOneof("value") or "int_value"))
    return samples, types


def native(cluster):
    return from_message(native_message(cluster))[0]


def metrics_text(cluster):
    """GET /metrics: the one place the metrics become text."""
    st, _, body = http_get(f"http://127.0.0.1:{http_port(cluster)}/metrics")
    assert st == 200 and body.endswith("\n")
    return body


def http_port(cluster):
    with open(cluster.config) as f:
        m = re.search(r"^\s*http_port:\s*(\d+)\s*$", f.read(), re.M)
    assert m, "the cluster config has no router.http_port"
    return int(m.group(1))


def http_get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.headers.get("Content-Type", ""), r.read().decode("utf-8")


def run_requests(cluster, prompts, max_tokens=8, stream=True):
    """Runs the prompts concurrently (greedy); returns the final chunks."""
    cl = cluster.client()
    try:
        results = {}
        for p in prompts:
            results[cl.start(prompt_request(prompt=p, max_tokens=max_tokens, stream=stream,
                                            temperature=0.0))] = Result()
        cl.collect(results, timeout_s=300)
    finally:
        cl.close()
    finals = []
    for res in results.values():
        assert res.status == "OK", res
        assert res.final is not None
        finals.append(res.final)
    return finals


def delta(after, before, series):
    return after.get(series, 0.0) - before.get(series, 0.0)


def dashboard_metrics():
    """Metric families the dashboard's queries use (histogram series reduced to the family)."""
    with open(DASHBOARD) as f:
        dash = json.load(f)
    exprs = []

    def walk(x):
        if isinstance(x, dict):
            for k, v in x.items():
                if k in ("expr", "query") and isinstance(v, str):
                    exprs.append(v)
                else:
                    walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(dash)
    names = set()
    for e in exprs:
        names.update(re.findall(r"\btandem_[a-z0-9_]+", e))
    return dash, exprs, names


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("metrics")), n_prefill=1, n_decode=1)
    c.start()
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_native_metrics_count_the_requests(cluster):
    before = native(cluster)
    finals = run_requests(cluster, PROMPTS, stream=True)
    finals += run_requests(cluster, PROMPTS[:2], stream=False)
    n = len(finals)
    # a refused request: counted with its status, no latency figures
    cl = cluster.client()
    res = cl.generate(prompt_request(prompt="x", max_tokens=-1))
    cl.close()
    assert res.status == "INVALID_ARGUMENT", res
    # node gauges come with the heartbeats: wait for one sent after the requests ended (no
    # blocks in use any more) rather than sleeping and hoping one came
    used = 'tandem_node_kv_blocks_used{node="decode-0",role="decode"}'
    end = time.time() + 30
    while native(cluster).get(used) != 0:
        assert time.time() < end, "decode-0 still reports KV blocks in use after 30 s"
        time.sleep(0.1)
    after, types = from_message(native_message(cluster))
    text = metrics_text(cluster)
    # the text says what the message says (nothing ran in between but heartbeats, which only
    # move node gauges, the router loop and process, whose own figures change with every
    # iteration); the gateway's counters are the text's alone
    text_samples, text_types = parse(text)
    text_types = {k: v for k, v in text_types.items() if not k.startswith("tandem_http_")}
    text_samples = {k: v for k, v in text_samples.items() if not k.startswith("tandem_http_")}
    assert text_types == types
    assert set(text_samples) == set(after)
    for k, v in after.items():
        if not k.startswith(("tandem_node_", "tandem_router_loop", "process_",
                             "vllm:kv_cache_usage_perc", "vllm:prefix_cache_")):
            assert text_samples[k] == v, k

    ok = sum(delta(after, before, f'tandem_requests_total{{status="OK",finish_reason="{r}"}}')
             for r in ("stop", "length"))
    assert ok == n
    assert delta(after, before,
                 'tandem_requests_total{status="INVALID_ARGUMENT",finish_reason="none"}') == 1
    assert delta(after, before, "tandem_requests_received_total") == n + 1
    assert delta(after, before, "tandem_prompt_tokens_total") == \
        sum(f.usage.prompt_tokens for f in finals)
    assert delta(after, before, "tandem_generation_tokens_total") == \
        sum(f.usage.completion_tokens for f in finals)
    # every request's prompt travelled as whole blocks from the prefill to the decode node
    assert delta(after, before, "tandem_kv_transfer_bytes_total") == \
        sum(math.ceil(f.usage.prompt_tokens / BLOCK_SIZE) for f in finals) * BLOCK_BYTES
    assert delta(after, before, "tandem_kv_transfer_failures_total") == 0
    for h in ("tandem_time_to_first_token_seconds", "tandem_e2e_request_latency_seconds",
              "tandem_request_queue_time_seconds", "tandem_request_prefill_time_seconds",
              "tandem_kv_transfer_time_seconds"):
        assert types[h] == "histogram"
        assert delta(after, before, h + "_count") == n, h
        assert delta(after, before, h + '_bucket{le="+Inf"}') == n, h
    ttft_sum = delta(after, before, "tandem_time_to_first_token_seconds_sum")
    assert 0 < ttft_sum <= sum(f.timings.e2e_s for f in finals) + 1e-6
    gaps = sum(max(f.usage.completion_tokens - 1, 0) for f in finals)
    assert delta(after, before, "tandem_inter_token_latency_seconds_count") == gaps
    assert after["tandem_requests_running"] == 0
    assert after["tandem_requests_queued"] == 0
    for node, role in (("prefill-0", "prefill"), ("decode-0", "decode")):
        labels = f'{{node="{node}",role="{role}"}}'
        assert after["tandem_node_up" + labels] == 1
        assert after["tandem_node_failures_total" + labels] == 0
    status = cluster.nodes()
    assert after['tandem_node_kv_blocks_capacity{node="decode-0",role="decode"}'] == \
        status["decode-0"].kv_blocks_total > 0
    assert after['tandem_node_kv_blocks_used{node="decode-0",role="decode"}'] == 0
    version = [k for k in after if k.startswith("tandem_build_info{")]
    assert len(version) == 1 and after[version[0]] == 1

    # promtool accepts the text as is, but for vLLM's names: their ':' is reserved for
    # recording rules by promtool's lint (vLLM's own output draws the same remark)
    lint = "".join(ln + "\n" for ln in text.splitlines()
                   if not ln.startswith(("vllm:", "# HELP vllm:", "# TYPE vllm:")))
    out = subprocess.run([tool("promtool"), "check", "metrics"], input=lint.encode(),
                         capture_output=True)
    assert out.returncode == 0 and not out.stdout and not out.stderr, out


def test_prefix_cache_counters_come_from_the_heartbeats(cluster):
    q = 'tandem_prefix_cache_queries_total{node="prefill-0",role="prefill"}'
    h = 'tandem_prefix_cache_hits_total{node="prefill-0",role="prefill"}'
    before = native(cluster)
    run_requests(cluster, [SHARED + "What is the capital of Spain?"], max_tokens=2)
    run_requests(cluster, [SHARED + "What is the capital of Peru?"], max_tokens=2)
    end = time.time() + 30  # the figures come with the next heartbeat (250 ms; a busy machine: later)
    while True:
        after = native(cluster)
        st = cluster.nodes()["prefill-0"]
        if after[h] == st.load.prefix_hits and after[q] == st.load.prefix_queries and \
                delta(after, before, h) > 0:
            break
        assert time.time() < end, (after[q], after[h], st.load.prefix_queries, st.load.prefix_hits)
        time.sleep(0.1)
    assert delta(after, before, q) >= delta(after, before, h) >= 2  # 2+ shared full blocks
    assert delta(after, before, "tandem_prompt_tokens_cached_total") >= 2 * BLOCK_SIZE


def shipped_scrape_config(tmp_path, target):
    """deploy/prometheus/prometheus.yml scraping target, its credentials_file (the compose
    secret metrics-api-key) replaced by tmp_path/metrics-api-key; returns the file's path."""
    text = open(SCRAPE_CONFIG).read()
    cred = "credentials_file: /run/secrets/metrics-api-key"
    assert cred in text and '"localhost:8000"' in text, "the shipped scrape config changed"
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(text.replace(cred, f"credentials_file: {tmp_path / 'metrics-api-key'}")
                   .replace('"localhost:8000"', f'"{target}"')
                   .replace("scrape_interval: 5s", "scrape_interval: 1s")
                   .replace("scrape_timeout: 4s", "scrape_timeout: 1s"))
    return cfg


def test_dashboard_uses_only_exposed_metrics(cluster, tmp_path):
    _, types = from_message(native_message(cluster))
    dash, exprs, names = dashboard_metrics()
    assert exprs, "the dashboard has no queries"
    assert "${DS_PROMETHEUS}" in json.dumps(dash)
    missing = []
    for name in sorted(names):
        family = name
        for suffix in ("_bucket", "_sum", "_count"):
            base = name[: -len(suffix)]
            if name.endswith(suffix) and types.get(base) == "histogram":
                family = base
        if family not in types:
            missing.append(name)
    assert not missing, f"tandem.json uses metrics the router does not expose: {missing}"
    # every query parses as PromQL: promtool checks them as the expressions of recording rules
    # (Grafana's variables replaced by what they expand to; its label_values() variable
    # queries are Grafana's, not PromQL)
    rules = ["groups:", "  - name: dashboard", "    rules:"]
    for i, e in enumerate(x for x in exprs if not x.startswith("label_values(")):
        q = e.replace("$__rate_interval", "1m").replace("$instance", ".*")
        rules += [f"      - record: dashboard:query_{i}", f"        expr: {json.dumps(q)}"]
    (tmp_path / "rules.yml").write_text("\n".join(rules) + "\n")
    out = subprocess.run([tool("promtool"), "check", "rules", str(tmp_path / "rules.yml")],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    (tmp_path / "metrics-api-key").write_text("sk-metrics\n")
    out = subprocess.run([tool("promtool"), "check", "config",
                          str(shipped_scrape_config(tmp_path, "localhost:8000"))],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.fixture
def prometheus(cluster, tmp_path):
    """A Prometheus server scraping the router's /metrics every second."""
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: tandem-router\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{http_port(cluster)}']\n")
    yield from run_prometheus(cfg, tmp_path)


def run_prometheus(cfg, tmp_path):
    """Runs Prometheus with the config file cfg; yields its base URL once it is ready."""
    port = free_port()
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen(
        [tool("prometheus"), f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
        stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        end = time.time() + 60
        while True:
            assert proc.poll() is None, open(log.name).read()
            try:
                if http_get(base + "/-/ready", timeout=2)[0] == 200:
                    break
            except (urllib.error.URLError, ConnectionError):
                pass
            assert time.time() < end, "prometheus not ready after 60 s:\n" + open(log.name).read()
            time.sleep(0.2)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def query(base, expr):
    url = base + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    st, _, body = http_get(url)
    assert st == 200
    doc = json.loads(body)
    assert doc["status"] == "success", doc
    return doc["data"]["result"]


def scalar(base, expr):
    """The single value of an instant query, or None when it has no result."""
    res = query(base, expr)
    assert len(res) <= 1, res
    return float(res[0]["value"][1]) if res else None


def wait_value(base, expr, pred, timeout_s=60):
    end = time.time() + timeout_s
    while True:
        v = scalar(base, expr)
        if v is not None and pred(v):
            return v
        assert time.time() < end, f"{expr} = {v} after {timeout_s} s"
        time.sleep(0.25)


def last_scrape(base, job):
    """When Prometheus last began a scrape of job's target (Unix seconds), and its health."""
    st, _, body = http_get(base + "/api/v1/targets?state=active")
    assert st == 200
    doc = json.loads(body)
    assert doc["status"] == "success", doc
    targets = [t for t in doc["data"]["activeTargets"] if t["labels"].get("job") == job]
    assert len(targets) == 1, doc
    # RFC 3339 with up to nanoseconds ("2024-05-01T12:00:00.123456789Z"): keep microseconds
    m = re.match(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(\.\d+)?(Z|[+-]\d\d:\d\d)$",
                 targets[0]["lastScrape"])
    assert m, targets[0]["lastScrape"]
    frac = (m.group(2) or ".0")[:7]
    tz = "+00:00" if m.group(3) == "Z" else m.group(3)
    t = datetime.datetime.fromisoformat(m.group(1) + frac + tz).timestamp()
    return t, targets[0]["health"]


def wait_scrape(base, job, timeout_s=60):
    """Waits until Prometheus has completed a successful scrape of job that began after this
    call (so its sample is newer than anything read before)."""
    since = time.time()
    end = since + timeout_s
    while True:
        t, health = last_scrape(base, job)
        if t > since and health == "up":
            return
        assert time.time() < end, f"no scrape of {job} began in {timeout_s} s ({t}, {health})"
        time.sleep(0.1)


def test_prometheus_scrapes_with_the_metrics_api_key(tmp_path):
    """With router.api_keys set /metrics needs a key: the shipped scrape config sends one
    from its credentials_file, and a scrape without it gets 401."""
    class KeyedCluster(Cluster):
        def client(self, **kw):
            return super().client(api_key="sk-client", **kw)

    c = KeyedCluster(str(tmp_path / "keys"), n_prefill=0, n_decode=1,
                     extra_router="  api_keys: [sk-client, sk-metrics]\n")
    c.start()
    try:
        port = http_port(c)
        with pytest.raises(urllib.error.HTTPError) as e:
            http_get(f"http://127.0.0.1:{port}/metrics")
        assert e.value.code == 401
        (tmp_path / "metrics-api-key").write_text("sk-metrics\n")
        cfg = shipped_scrape_config(tmp_path, f"127.0.0.1:{port}")
        gen = run_prometheus(cfg, tmp_path)
        base = next(gen)
        try:
            # the shipped config also lists router-1:8000 (compose's second router), which
            # does not resolve here: its up series is 0 once Prometheus has tried it
            wait_value(base, f'up{{job="tandem-router",instance="127.0.0.1:{port}"}}',
                       lambda v: v == 1)
            wait_value(base, 'tandem_node_up{job="tandem-router",node="decode-0"}',
                       lambda v: v == 1)
        finally:
            gen.close()
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_http_metrics_endpoint_serves_the_same_text(cluster):
    st, ctype, body = http_get(f"http://127.0.0.1:{http_port(cluster)}/metrics")
    assert st == 200
    assert ctype.startswith("text/plain") and "version=0.0.4" in ctype, ctype
    samples, types = parse(body)
    _, native_types = from_message(native_message(cluster))
    # the gateway's own counters exist only in the text (router/http_metrics.c)
    gateway = {k: v for k, v in types.items() if k.startswith("tandem_http_")}
    assert gateway == {"tandem_http_requests_total": "counter",
                       "tandem_http_requests_refused_total": "counter"}
    assert {k: v for k, v in types.items() if k not in gateway} == native_types
    assert samples['tandem_node_up{node="decode-0",role="decode"}'] == 1


def test_prometheus_scrapes_the_ttft_histogram(cluster, prometheus):
    job = 'job="tandem-router"'
    wait_value(prometheus, f"up{{{job}}}", lambda v: v == 1)
    count = f"tandem_time_to_first_token_seconds_count{{{job}}}"
    c0 = wait_value(prometheus, count, lambda v: v >= 0)
    # one more scrape before the requests (the value c0 came from one that may have begun
    # earlier): the 1-minute window holds two samples from before them, and rate() sees the
    # increase. Wait for the scrape itself, not a time it should take.
    wait_scrape(prometheus, "tandem-router")
    finals = run_requests(cluster, PROMPTS + PROMPTS[:3], max_tokens=6)
    n = len(finals)
    assert n == 8
    c1 = wait_value(prometheus, count, lambda v: v >= c0 + n)
    assert c1 == c0 + n
    # the buckets and a quantile from them, as the dashboard computes it
    inf = scalar(prometheus, f'tandem_time_to_first_token_seconds_bucket{{{job},le="+Inf"}}')
    assert inf == c1
    p50 = wait_value(prometheus,
                     "histogram_quantile(0.5, sum by (le) "
                     f"(rate(tandem_time_to_first_token_seconds_bucket{{{job}}}[1m])))",
                     lambda v: not math.isnan(v))
    # (the 1-minute window may hold other tests' requests too: only its range is known)
    assert 0 < p50 <= 60
    tokens = wait_value(prometheus, f"tandem_generation_tokens_total{{{job}}}",
                        lambda v: v > 0)
    assert tokens >= sum(f.usage.completion_tokens for f in finals)
    up = query(prometheus, "tandem_node_up")
    assert {r["metric"]["node"]: float(r["value"][1]) for r in up} == \
        {"prefill-0": 1.0, "decode-0": 1.0}
