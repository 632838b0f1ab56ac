"""The router's dashboard (GET /) rendered by headless Chromium on a live cluster under load:
the page's own JavaScript must fetch /api/status and draw the nodes and the charts from it.

Needs Debian's `chromium` (scripts/setup installs it). The screenshot goes to the test's
temporary folder; with TANDEM_UPDATE_SCREENSHOT=1 it also replaces docs/dashboard.png.
"""
import http.client
import json
import os
import re
import shutil
import subprocess
import threading
import time

import pytest

from conftest import BINARIES, Cluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SOURCE_DIR = os.environ.get(
    "TDM_SOURCE_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


def http_port(cluster):
    """The router.http_port conftest wrote into the cluster's config."""
    with open(cluster.config) as f:
        m = re.search(r"^\s*http_port:\s*(\d+)\s*$", f.read(), re.M)
    assert m, "no http_port in the cluster config"
    return int(m.group(1))


def request(port, method, path, body=None, timeout=60):
    """One HTTP request; returns (status, headers, body bytes)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=None if body is None else json.dumps(body),
                     headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, dict(r.getheaders()), r.read()
    finally:
        conn.close()


CHART_SERIES = ("request_rate", "ttft_ms", "tpot_ms", "tokens_per_s", "running", "kv_used_pct",
                "prompt_tokens_per_s")
# every series of the history (error_pct, cancel_pct: null in a window where no request
# ended; the percentiles: null below their minimum count of observations, ttft_n / tpot_n)
HISTORY_SERIES = CHART_SERIES + ("queued", "error_pct", "cancel_pct", "ttft_p50_ms",
                                 "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "ttft_n", "tpot_n")


def api_status(port):
    st, _, body = request(port, "GET", "/api/status")
    assert st == 200, body
    return json.loads(body)


def wait_status(port, pred, what, timeout_s=120):
    """Polls /api/status (sampled once a second) until pred(doc); returns that doc."""
    end = time.time() + timeout_s
    while True:
        doc = api_status(port)
        if pred(doc):
            return doc
        assert time.time() < end, f"timed out after {timeout_s} s waiting for {what}: {doc}"
        time.sleep(0.2)


def charts_have_points(doc, n=2):
    """True when every chart's series has n or more points (non-null values) in the history."""
    h = doc["history"]
    return all(sum(v is not None for v in h[k]) >= n for k in CHART_SERIES)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = Cluster(str(tmp_path_factory.mktemp("dash")), n_prefill=1, n_decode=2)
    c.start()
    c.port = http_port(c)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


class Traffic:
    """Streaming completions from a few threads until stopped."""

    def __init__(self, port, model, threads=3):
        self.port, self.model, self.stop, self.done, self.errors = port, model, False, 0, []
        self.threads = [threading.Thread(target=self.run, args=(i,)) for i in range(threads)]

    def run(self, i):
        while not self.stop:
            body = {"model": self.model, "prompt": f"Story {i}: once upon a time",
                    "max_tokens": 48, "temperature": 0.7, "seed": self.done, "stream": True}
            st, _, raw = request(self.port, "POST", "/v1/completions", body=body, timeout=120)
            if st != 200 or not raw.endswith(b"data: [DONE]\n\n"):
                self.errors.append((st, raw[-300:]))
            self.done += 1

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop = True
        for t in self.threads:
            t.join(timeout=180)


def chromium(args, out_dir, timeout=180):
    assert CHROMIUM, "chromium is not installed: run scripts/setup (Debian package chromium)"
    argv = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
            "--no-first-run", "--hide-scrollbars", f"--user-data-dir={out_dir}/profile"] + args
    return subprocess.run(argv, capture_output=True, timeout=timeout)


def test_dashboard_renders_live_data(cluster, tmp_path):
    st, hd, page = request(cluster.port, "GET", "/")
    assert st == 200 and hd["Content-Type"] == "text/html; charset=utf-8"
    # self-contained: no external scripts, styles or images
    assert not re.search(rb"""(src|href)=["']?(https?:)?//""", page)
    model = json.loads(request(cluster.port, "GET", "/v1/models")[2])["data"][0]["id"]
    url = f"http://127.0.0.1:{cluster.port}/"
    update = os.environ.get("TANDEM_UPDATE_SCREENSHOT") == "1"
    with Traffic(cluster.port, model) as traffic:
        # load first, until the history has points on every chart (for the committed
        # screenshot, two minutes more, with a second wave of clients joining half way)
        end = time.time() + 300
        while traffic.done < 6 and not traffic.errors:
            assert time.time() < end, f"{traffic.done} requests done after 300 s"
            time.sleep(0.2)
        wait_status(cluster.port, charts_have_points, "two points on every chart")
        if update:
            time.sleep(60)
            with Traffic(cluster.port, model, threads=3) as wave:
                time.sleep(60)
            assert not wave.errors, wave.errors[:3]
        dom = chromium(["--virtual-time-budget=6000", "--dump-dom", url], tmp_path)
        shot = tmp_path / "dashboard.png"
        png = chromium(["--window-size=1400,1150", "--virtual-time-budget=6000",
                        f"--screenshot={shot}", url], tmp_path)
    assert traffic.done >= 6 and not traffic.errors, traffic.errors[:3]
    html = dom.stdout.decode("utf-8")
    assert dom.returncode == 0 and "</html>" in html, dom.stderr.decode()[-2000:]

    # the page's JavaScript ran and refreshed from /api/status
    updates = int(re.search(r'<body[^>]*data-updates="(\d+)"', html).group(1))
    assert updates >= 2, updates
    assert f'id="model">{model}<' in html
    # every node, with its role and state, from live data
    for nid, role in [("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")]:
        m = re.search(rf'<div class="node" data-node-id="{nid}" data-up="(\w+)">(.*?)</div></div>',
                      html, re.S)
        assert m, f"node {nid} not rendered"
        assert m.group(1) == "true" and f'class="role {role}"' in m.group(2)
        assert re.search(r'KV [\d,]+ / [\d,]+ blocks used', m.group(2))
    # the charts were drawn from the history (points on the rate, TTFT and TPOT lines)
    for chart in ["rate", "errors", "ttft", "tpot", "tokens", "running", "kv"]:
        m = re.search(rf'<svg class="chart" id="chart-{chart}"[^>]*data-points="(\d+)"[^>]*>'
                      rf'.*?<path class="line" data-points="\d+" stroke="[^"]+" d="([^"]*)"'
                      rf'(.*?)</svg>', html, re.S)
        assert m, f"chart {chart} not drawn"
        if chart == "errors":
            continue  # points only in windows where requests ended
        # a line, or dots where a second has no neighbour
        drawn = m.group(2).startswith("M") or "<circle" in m.group(3)
        assert int(m.group(1)) >= 2 and drawn, (chart, m.group(1))
    # the live pools: every node's real KV pool, the decode pool's total
    for nid in ["prefill-0", "decode-0", "decode-1"]:
        assert re.search(rf'<tr data-node-id="{nid}" data-max-sequences="\d+">', html), nid
    assert re.search(r'id="pool-max">[\d,]+<', html)
    assert 'class="kvlegend"' in html
    # the capacity panel computed the served model's numbers through /api/capacity
    m = re.search(r'id="cap-verdict" data-fits="(true|false)">.*?id="cap-max">([\d,]+)<', html,
                  re.S)
    assert m, "capacity panel not computed"
    assert "SmolLM2-135M-Instruct.Q4_1" in html

    assert png.returncode == 0 and shot.exists(), png.stderr.decode()[-2000:]
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 1150)
    if update:
        shutil.copyfile(shot, os.path.join(SOURCE_DIR, "docs", "dashboard.png"))


def test_status_and_capacity_json(cluster):
    # the dashboard samples the router once a second: wait for two samples with the nodes
    s = wait_status(cluster.port, lambda d: d["ok"] is True and len(d["history"]["t"]) >= 2 and
                    len(d["nodes"]) == 3, "two samples of the three nodes")
    assert {n["node_id"] for n in s["nodes"]} == {"prefill-0", "decode-0", "decode-1"}
    mi = s["model_info"]
    assert (mi["n_layers"], mi["n_kv_heads"], mi["head_dim"], mi["n_heads"]) == (30, 3, 64, 9)
    assert mi["kv_dtype"] == "f16" and mi["kv_block_size"] == 16 and mi["weight_bytes"] > 9e7
    h = s["history"]
    assert len(h["t"]) >= 2 and all(len(h[k]) == len(h["t"]) for k in HISTORY_SERIES)
    # the traffic of the first test: a mean wherever the window holds observations, a
    # percentile only from enough of them (never a p99 of a few requests), in order; prompt
    # tokens counted, and no request failed (every error_pct point 0)
    lo, hi = h["min_p50_samples"], h["min_p99_samples"]
    assert (lo, hi, h["window_samples"]) == (10, 100, 5)
    for kind in ("ttft", "tpot"):
        for m, p50, p99, n in zip(h[f"{kind}_ms"], h[f"{kind}_p50_ms"], h[f"{kind}_p99_ms"],
                                  h[f"{kind}_n"]):
            assert (m is None) == (not n), (kind, m, n)
            assert (p50 is not None) == (n is not None and n >= lo), (kind, p50, n)
            assert (p99 is not None) == (n is not None and n >= hi), (kind, p99, n)
            assert p99 is None or 0 < p50 <= p99
    assert any(n for n in h["ttft_n"] if n) and any(m for m in h["ttft_ms"] if m)
    assert any(v for v in h["prompt_tokens_per_s"] if v is not None)
    assert {v for v in h["error_pct"] if v is not None} <= {0.0}
    assert "error_pct" in h["sources"] and "prompt_tokens_per_s" in h["sources"]
    # each node's live pool: its real blocks, and the sequences of the full context they hold
    for n in s["nodes"]:
        p = n["pool"]
        assert p["kv_blocks"] == n["kv_blocks_total"] and p["block_bytes"] == 16 * 23040
        assert n["kv_block_bytes"] == 16 * 23040, n  # from the router's NodeStatus (2.9)
        assert p["kv_bytes"] == p["kv_blocks"] * p["block_bytes"] and p["context"] == mi["n_ctx"]
        assert p["blocks_per_sequence"] == -(-mi["n_ctx"] // 16)
        assert p["max_sequences"] == p["kv_blocks"] // p["blocks_per_sequence"]
    # the served model: SmolLM2-135M at f16 is 23,040 bytes per token (docs/capacity.md)
    st, _, body = request(cluster.port, "GET", "/api/capacity?users=8&memory=1GiB")
    c = json.loads(body)
    assert st == 200 and c["source"] == "model" and c["kv_bytes_per_token"] == 23040
    assert c["block_bytes"] == 16 * 23040 and c["blocks_per_sequence"] == 256
    assert c["weights_bytes"] == mi["weight_bytes"]
    pool = (1 << 30) - mi["weight_bytes"]
    assert c["pool_blocks"] == pool // c["block_bytes"]
    assert c["max_sequences"] == c["pool_blocks"] // 256 and c["fits"] is True
    # the same numbers as `tandem kvcalc` for an explicit shape
    q = "layers=32&kv_heads=8&head_dim=128&heads=32&dtype=q8&context=8192&users=16&memory=40GiB"
    c = json.loads(request(cluster.port, "GET", "/api/capacity?" + q)[2])
    out = subprocess.run([BINARIES["tandem"], "kvcalc", "--layers", "32", "--kv-heads", "8", "--head-dim", "128",
                          "--heads", "32", "--dtype", "q8", "--context", "8192", "--users", "16",
                          "--memory", "40GiB", "--json"], capture_output=True, check=True)
    ref = json.loads(out.stdout)
    for k in ["kv_bytes_per_token", "block_bytes", "blocks_per_sequence", "kv_bytes_total",
              "pool_blocks", "fits", "max_sequences", "mha_kv_bytes_per_token"]:
        assert c[k] == ref[k], k
    # a node: its real pool
    c = json.loads(request(cluster.port, "GET", "/api/capacity?node=decode-0")[2])
    node = next(n for n in s["nodes"] if n["node_id"] == "decode-0")
    assert c["source"] == "node" and c["pool_blocks"] == node["kv_blocks_total"]
    assert c["max_sequences"] == node["pool"]["max_sequences"]
    # bad parameters name themselves
    st, _, body = request(cluster.port, "GET", "/api/capacity?layers=32&kv_heads=0&head_dim=64")
    assert st == 400 and json.loads(body)["error"]["param"] == "kv_heads"
    st, _, body = request(cluster.port, "GET", "/api/capacity?memory=lots")
    assert st == 400 and json.loads(body)["error"]["param"] == "memory"
    st, _, body = request(cluster.port, "GET", "/api/capacity?node=nope")
    assert st == 400 and json.loads(body)["error"]["param"] == "node"


def test_client_disconnects_are_cancellations_not_errors(cluster):
    """A client that goes away mid-stream ends CANCELLED: the dashboard draws it as a
    cancellation, and the error rate stays 0."""
    model = json.loads(request(cluster.port, "GET", "/v1/models")[2])["data"][0]["id"]
    conn = http.client.HTTPConnection("127.0.0.1", cluster.port, timeout=120)
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": model, "prompt": "Count from one to a thousand:", "max_tokens": 2000,
        "stream": True, "ignore_eos": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # the first chunk (dechunked): the request runs
    conn.sock.close()
    conn.close()
    s = wait_status(cluster.port, lambda d: any(v for v in d["history"]["cancel_pct"] if v),
                    "the disconnect in the cancellation rate")
    assert {v for v in s["history"]["error_pct"] if v is not None} <= {0.0}
    assert s["http"]["requests_cancelled"] >= 1 and s["http"]["requests_failed"] == 0


def static_status(now):
    """An /api/status document as dash_status_json writes it, for a static copy of the page:
    one decode node idle with cached blocks, and sparse traffic: one second with a TTFT and
    TPOT (no neighbour), two adjacent seconds with a request rate."""
    t = [now - 4 + i for i in range(5)]
    one = [None, None, 12.5, None, None]
    two = [None, 0.4, 0.6, None, None]
    pool = {"kv_blocks": 1000, "block_bytes": 368640, "kv_bytes": 368640000, "context": 8192,
            "blocks_per_sequence": 512, "max_sequences": 1}
    node = {"node_id": "decode-0", "role": "decode", "device": "cpu", "up": True,
            "suspect": False, "kv_blocks_total": 1000, "kv_blocks_used": 0,
            "kv_blocks_cached": 130, "reserved_blocks": 0, "kv_used_pct": 0.0, "running": 0,
            "waiting": 0, "batch_size": 0, "queued_prefill_tokens": 0, "prefix_queries": 0,
            "prefix_hits": 0, "step_time_ms": 0.0, "last_heartbeat_age_s": 0.3, "pool": pool}
    hist = {"interval_s": 1.0, "window_samples": 5, "min_p50_samples": 10,
            "min_p99_samples": 100, "t": t, "request_rate": two,
            "error_pct": [None, 0.0, 0.0, None, None], "cancel_pct": [None, 0.0, 50.0, None, None],
            "ttft_n": [None, None, 12, None, None], "tpot_n": [None, None, 12, None, None],
            "ttft_ms": one, "ttft_p50_ms": one, "ttft_p99_ms": [None, None, 20.0, None, None],
            "tpot_ms": one, "tpot_p50_ms": one, "tpot_p99_ms": one, "tokens_per_s": two,
            "prompt_tokens_per_s": two, "running": [0] * 5, "queued": [0] * 5,
            "kv_used_pct": [0.0] * 5, "sources": {}}
    return {"time": now, "ok": True, "http": {"requests_total": 1, "requests_ok": 1,
            "requests_failed": 0, "requests_cancelled": 0, "streams": 0}, "version": "test", "model": "static",
            "requests": {"running": 0, "queued": 0, "total": 2}, "nodes": [node],
            "model_info": None, "history": hist}


def svg_of(html, chart):
    m = re.search(rf'<svg class="chart" id="chart-{chart}"[^>]*>(.*?)</svg>', html, re.S)
    assert m, f"chart {chart} not drawn"
    return m.group(1)


def test_dashboard_draws_a_single_point(tmp_path):
    """A static copy of the page with /api/status answered by injected data (no cluster): a
    series with one value in a second that has no neighbour draws a dot, two adjacent ones a
    line; the KV bar has its legend and the capacity panel shows the live pool."""
    if not CHROMIUM:
        pytest.fail("chromium is not installed: run scripts/setup (Debian package chromium)")
    with open(os.path.join(SOURCE_DIR, "router", "dashboard.html"), encoding="utf-8") as f:
        page = f.read()
    doc = json.dumps(static_status(time.time()))
    stub = ("<script>window.fetch = async (u) => ({status: 200, json: async () => "
            f"(String(u).startsWith('/api/status') ? {doc} : "
            "{error: {message: 'static copy'}})});</script>")
    page = page.replace("<head>", "<head>" + stub, 1)
    path = tmp_path / "dashboard.html"
    path.write_text(page, encoding="utf-8")
    dom = chromium(["--virtual-time-budget=2500", "--dump-dom", path.as_uri()], tmp_path,
                   timeout=60)
    html = dom.stdout.decode("utf-8")
    assert dom.returncode == 0 and "</html>" in html, dom.stderr.decode()[-2000:]
    assert int(re.search(r'<body[^>]*data-updates="(\d+)"', html).group(1)) >= 1

    # one point: a dot at the point, no path of a lone "M"
    for chart in ["ttft", "tpot"]:
        svg = svg_of(html, chart)
        assert re.search(r'<svg class="chart" id="chart-%s"[^>]*data-points="1"' % chart, html)
        dots = re.findall(r'<circle class="pt" cx="([\d.]+)" cy="([\d.]+)" r="[\d.]+"', svg)
        assert len(dots) == 3, (chart, svg)  # mean, p50, p99: one second each
        assert all(float(cx) > 34 for cx, _ in dots)
        assert not re.search(r'd="M[\d. ]+"', svg), svg
    # two adjacent points: a line, no dots
    for chart in ["rate", "errors", "tokens"]:
        svg = svg_of(html, chart)
        assert re.search(r'<path class="line" data-points="2" stroke="[^"]+" d="M[\d.]+ [\d.]+L',
                         svg), (chart, svg)
        assert "<circle" not in svg, (chart, svg)
    # the KV bar's legend, and the free blocks an idle node with cached ones has
    assert re.search(r'class="kvlegend">.*used.*cached.*free', html, re.S)
    assert re.search(r"KV 0 / 1,000 blocks used\s+\(0\.0%\), 130 cached, 870 free", html)
    # the capacity panel's default: the live pool, not a hypothetical memory size
    m = re.search(r'<tr data-node-id="decode-0" data-max-sequences="(\d+)">', html)
    assert m and m.group(1) == "1"
    assert re.search(r'id="pool-max">1<', html)


def static_page(tmp_path, status):
    """Renders a static copy of the page whose /api/status answers status; returns the DOM."""
    with open(os.path.join(SOURCE_DIR, "router", "dashboard.html"), encoding="utf-8") as f:
        page = f.read()
    doc = json.dumps(status)
    stub = ("<script>window.fetch = async (u) => ({status: 200, json: async () => "
            f"(String(u).startsWith('/api/status') ? {doc} : "
            "{error: {message: 'asked ' + String(u)}})});</script>")
    path = tmp_path / "dashboard.html"
    path.write_text(page.replace("<head>", "<head>" + stub, 1), encoding="utf-8")
    dom = chromium(["--virtual-time-budget=2500", "--dump-dom", path.as_uri()], tmp_path,
                   timeout=60)
    html = dom.stdout.decode("utf-8")
    assert dom.returncode == 0 and "</html>" in html, dom.stderr.decode()[-2000:]
    return html


def test_dashboard_capacity_per_model(tmp_path):
    """Two models (a static copy of the page): the header names both, the pools table has a
    model column and one decode pool total per model (KV never moves between models, so the
    pools do not add up), and the capacity planner offers each model's shape."""
    if not CHROMIUM:
        pytest.fail("chromium is not installed: run scripts/setup (Debian package chromium)")
    s = static_status(time.time())
    d0 = s["nodes"][0]
    d0["model"] = "smol"
    d1 = dict(d0, node_id="decode-1", model="gemma3", running=2,
              pool={"kv_blocks": 2000, "block_bytes": 294912, "kv_bytes": 589824000,
                    "context": 2048, "blocks_per_sequence": 128, "max_sequences": 15})
    d2 = dict(d1, node_id="decode-2", up=False)  # not up: not in the pool's total
    s["nodes"] = [d0, d1, d2]
    s["model"] = "smol"
    shape = {"kv_block_size": 16, "kv_dtype": "f16", "n_ctx": 8192}
    s["models"] = [dict(shape, name="smol", n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9,
                        weight_bytes=96576768),
                   dict(shape, name="gemma3", n_layers=18, n_kv_heads=1, head_dim=256, n_heads=4,
                        weight_bytes=246587904, n_ctx=2048),
                   dict(shape, name="idle", n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9,
                        weight_bytes=96576768)]  # no node serves it
    s["model_info"] = s["models"][0]
    html = static_page(tmp_path, s)
    assert re.search(r'id="model-label">models<', html)
    assert re.search(r'id="model">smol, gemma3, idle \(unavailable\)<', html)
    sums = dict(re.findall(r'<tr class="sum" data-model="([^"]+)" data-max-sequences="(\d+)"',
                           html))
    assert sums == {"smol": "1", "gemma3": "15", "idle": "0"}, sums
    assert re.search(r'<td>decode-1</td><td>gemma3</td><td>decode</td>', html)
    assert re.search(r'15 of 2,048 tokens</td><td class="n">2</td>', html)
    opts = re.findall(r'<option value="(model:[^"]+|node:[^"]+)"', html)
    assert opts[:4] == ["model:smol", "model:gemma3", "model:idle", "node:decode-0"], opts
    assert re.search(r'<option value="node:decode-1">node decode-1 \(its KV pool, gemma3\)', html)
    # the first source is the first model: the planner asks for it by name with its shape
    asked = re.search(r'<p class="err">asked (/api/capacity\?[^<]*)</p>', html)
    assert asked and "model=smol" in asked.group(1) and "layers=" not in asked.group(1), asked
