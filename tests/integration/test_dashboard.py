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


CHART_SERIES = ("request_rate", "ttft_ms", "tpot_ms", "tokens_per_s", "running", "kv_used_pct")


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
    for chart in ["rate", "ttft", "tpot", "tokens", "running", "kv"]:
        m = re.search(rf'<svg class="chart" id="chart-{chart}"[^>]*data-points="(\d+)"[^>]*>'
                      rf'.*?<path class="line" data-points="\d+" stroke="[^"]+" d="([^"]*)"',
                      html, re.S)
        assert m, f"chart {chart} not drawn"
        assert int(m.group(1)) >= 2 and m.group(2).startswith("M"), (chart, m.group(1))
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
    assert len(h["t"]) >= 2 and len(h["t"]) == len(h["request_rate"]) == len(h["ttft_ms"])
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
    # bad parameters name themselves
    st, _, body = request(cluster.port, "GET", "/api/capacity?layers=32&kv_heads=0&head_dim=64")
    assert st == 400 and json.loads(body)["error"]["param"] == "kv_heads"
    st, _, body = request(cluster.port, "GET", "/api/capacity?memory=lots")
    assert st == 400 and json.loads(body)["error"]["param"] == "memory"
    st, _, body = request(cluster.port, "GET", "/api/capacity?node=nope")
    assert st == 400 and json.loads(body)["error"]["param"] == "node"
