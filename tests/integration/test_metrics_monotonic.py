"""Every counter series of GET /metrics only grows for the life of the router process (issue 37:
`vllm:prompt_tokens_by_source_total{source="local_compute"}` went back under load, which
Prometheus reads as a counter reset).

One cluster (a prefill node, two decode nodes) under concurrent load that hits the prefill
node's prefix cache, with client cancellations (native CANCEL frames and an HTTP client that
hangs up mid-stream), the prefill node killed and started again, then a decode node killed and
started again. /metrics is scraped again and again throughout; every family typed `counter`
and every histogram's _bucket/_count/_sum series must never be lower in a later scrape. The
test waits on events (a batch of requests completed, the node up again, its new process's
heartbeat figures in the router's series, the cancellations counted), never on elapsed time.
"""
import http.client
import json
import re
import threading
import time

from conftest import Cluster
from tandem_client import Result, pb, prompt_request
from test_metrics import SHARED, http_port, metrics_text, parse

COUNTRIES = ["Spain", "Peru", "Chile", "Japan", "Kenya", "Norway"]


def monotonic_violations(scrapes):
    """[(series, earlier, later)] where a counter or histogram series of one scrape is lower
    in the next one that has it (a series may vanish and come back: a node down is not
    listed), and the number of such series checked."""
    bad, last = [], {}
    for samples, types in scrapes:
        for series, value in samples.items():
            name = series.split("{", 1)[0]
            fam = re.sub(r"_(bucket|count|sum)$", "", name)
            kind = types.get(name) or types.get(fam)
            if kind not in ("counter", "histogram"):
                continue
            if series in last and value < last[series]:
                bad.append((series, last[series], value))
            last[series] = value
    return bad, len(last)


def total(samples, family, **labels):
    """The sum of family's series whose labels include labels."""
    n = 0.0
    for series, v in samples.items():
        if series.split("{", 1)[0] != family:
            continue
        if all(f'{k}="{val}"' in series for k, val in labels.items()):
            n += v
    return n


class Load:
    """Batches of concurrent greedy requests sharing a long prefix (so the prefill node's
    prefix cache hits), on a thread of its own, until stopped; batches counts those done."""

    def __init__(self, cluster):
        self.cluster = cluster
        self.stop = threading.Event()
        self.batches = 0
        self.thread = threading.Thread(target=self.run, daemon=True)

    def run(self):
        cl = self.cluster.client()
        try:
            while not self.stop.is_set():
                results = {}
                for q in COUNTRIES:
                    req = prompt_request(prompt=f"{SHARED}What is the capital of {q}?",
                                         max_tokens=6, stream=True, temperature=0.0)
                    results[cl.start(req)] = Result()
                try:
                    cl.collect(results, timeout_s=300)
                except TimeoutError:
                    pass  # a request caught by a node kill may end late: go on
                self.batches += 1
        finally:
            cl.close()


def cancel_mid_stream(cluster):
    """Starts a long request, cancels it (a CANCEL frame) once its first token has come;
    returns True when it was cancelled while running (it had not ended)."""
    cl = cluster.client()
    try:
        call = cl.start(prompt_request(prompt="Count from one to a thousand:", max_tokens=2000,
                                       stream=True, temperature=0.0, ignore_eos=True))
        end = time.time() + 300
        while time.time() < end:
            got = cl.recv(end - time.time())
            if got is None:
                continue
            h, _ = got
            if h.call_id != call:
                continue
            if h.kind == pb.FRAME_KIND_END:
                return False
            if h.kind == pb.FRAME_KIND_STREAM:
                cl.cancel(call)
                return True
        raise AssertionError("no token of the request to cancel in 300 s")
    finally:
        cl.close()


def disconnect_mid_stream(cluster):
    """An HTTP client that hangs up after the first chunk of a long streamed completion."""
    port = http_port(cluster)
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
    conn.request("GET", "/v1/models")
    model = json.loads(conn.getresponse().read())["data"][0]["id"]
    conn.request("POST", "/v1/completions", body=json.dumps({
        "model": model, "prompt": "Count from one to a thousand:", "max_tokens": 2000,
        "stream": True, "ignore_eos": True}), headers={"Content-Type": "application/json"})
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: ")  # the first chunk: the request runs
    conn.sock.close()
    conn.close()


def test_every_counter_only_grows_across_load_cancellations_and_node_restarts(tmp_path):
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=2)
    c.start()
    load = Load(c)
    scrapes = []

    def last():
        return scrapes[-1][0]

    def scrape_until(pred, what, timeout_s=300):
        end = time.time() + timeout_s
        scrapes.append(parse(metrics_text(c)))
        while not pred():
            assert time.time() < end, f"not seen in {timeout_s} s: {what}"
            time.sleep(0.05)  # the polling interval of the wait, not a wait for an event
            scrapes.append(parse(metrics_text(c)))

    load.thread.start()
    try:
        scrape_until(lambda: True, "a first scrape")
        first = last()
        hits = 'vllm:prompt_tokens_by_source_total{model_name="%s",engine="0",source="%s"}'
        name = re.search(r'model_name="([^"]*)"', next(
            s for s in first if s.startswith("vllm:prompt_tokens_by_source_total"))).group(1)
        local_hit, local_compute = hits % (name, "local_cache_hit"), hits % (name, "local_compute")
        # load with prefix-cache hits
        scrape_until(lambda: load.batches >= 2 and last().get(local_hit, 0) > 0,
                     "two batches and prefix-cache hits")
        # client cancellations: two CANCEL frames and an HTTP client gone mid-stream
        aborts = 'vllm:request_success_total{model_name="%s",engine="0",finished_reason="abort"}'
        aborts %= name
        aborts0 = last().get(aborts, 0)
        cancelled = sum(cancel_mid_stream(c) for _ in range(2))
        disconnect_mid_stream(c)
        scrape_until(lambda: last().get(aborts, 0) >= aborts0 + cancelled + 1,
                     "the cancellations counted as aborts")
        # the prefill node killed and started again: its heartbeat counters restart from 0
        q = 'tandem_prefix_cache_queries_total{node="prefill-0",role="prefill"}'
        scrape_until(lambda: last().get(q, 0) > 0, "prefix queries in a heartbeat")
        before = last()[q]
        c.kill("prefill-0")
        c.start_node("prefill-0")
        seen = load.batches
        scrape_until(lambda: load.batches >= seen + 2, "two batches after the prefill restart")
        scrape_until(lambda: last().get(q, 0) > before,
                     "the restarted prefill node's prefix queries on top of the first process's")
        # a decode node killed and started again (its requests migrate to decode-1's peer)
        cpu = 'tandem_node_process_cpu_seconds_total{node="decode-1",role="decode"}'
        scrape_until(lambda: last().get(cpu, 0) > 0, "decode-1's CPU seconds in a heartbeat")
        before = last()[cpu]
        c.kill("decode-1")
        c.start_node("decode-1")
        seen = load.batches
        scrape_until(lambda: load.batches >= seen + 2, "two batches after the decode restart")
        scrape_until(lambda: last().get(cpu, 0) > before,
                     "the restarted decode node's CPU seconds on top of the first process's")
    finally:
        load.stop.set()
        load.thread.join(timeout=600)
    scrape_until(lambda: True, "a last scrape")
    codes = c.stop()

    bad, checked = monotonic_violations(scrapes)
    assert bad == [], bad
    final, types = scrapes[-1]
    # the families of the issue are among those checked, and many more
    for fam in ("vllm:prompt_tokens_by_source_total", "vllm:request_success_total",
                "vllm:prefix_cache_hits_total", "tandem_requests_total",
                "tandem_prefix_cache_queries_total", "tandem_node_process_cpu_seconds_total",
                "vllm:time_to_first_token_seconds", "tandem_iteration_tokens"):
        assert types.get(fam) in ("counter", "histogram"), fam
    assert checked > 200, checked
    assert len(scrapes) >= 8
    # both sources grew: computed prompt tokens and prefix-cache hits
    assert final[local_compute] > first.get(local_compute, 0)
    assert final[local_hit] > first.get(local_hit, 0)
    # a cancellation is an abort, never an error: every CANCELLED request is counted with the
    # finish reason "cancelled", and vLLM's abort series holds exactly those
    assert total(final, "tandem_requests_total", status="CANCELLED",
                 finish_reason="error") == 0
    assert final[aborts] == total(final, "tandem_requests_total", finish_reason="cancelled")
    assert final[aborts] >= 3 and cancelled >= 1
    assert codes["router"] == 0, (codes, c.tail("router"))
