"""A cluster across hosts (issue 13): router, prefill and decode node each in its own network
namespace with its own address (netns.py), CURVE keys and API keys as for any non-loopback
bind, and the prefill-to-decode KV link through the fault-injecting proxy (faultproxy.py, in
the host namespace). Cases: a request served across the namespaces; a 10 s partition of the
KV link (the proxy stalls it); 1,000 idle HTTP connections from one host (slowloris) while
another namespace probes /health.

Skipped, with the reason, only where network namespaces cannot be made (not root, no `ip`).
Outcomes are asserted; the one duration asserted is the issue's criterion for the partition
(requests complete within the transfer timeout + 10 s after it), with a wide margin.
"""
import os
import select
import socket
import subprocess
import sys
import threading
import time

import pytest

import netns
from conftest import reference
from faultproxy import FaultProxy
from tandem_client import Result, prompt_request

PROMPT = "The capital of France is"
MAX_TOKENS = 8
TRANSFER_TIMEOUT_S = 10  # kv.transfer_timeout_s: the default
PARTITION_S = 10
PROXY_PORT = 7620


@pytest.fixture(scope="module")
def net():
    why = netns.available()
    if why:
        pytest.skip(why)
    n = netns.Netns(["router", "prefill-0", "decode-0", "probe"])
    yield n
    n.close()


@pytest.fixture(scope="module")
def cluster(net, tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("netns"))
    proxy_ep = f"{net.host_addr}:{PROXY_PORT}"
    proxy = FaultProxy(proxy_ep, f"{net.addr['decode-0']}:7610", os.path.join(tmp, "proxy.ctl"),
                       log_path=os.path.join(tmp, "proxy.log"))
    c = netns.NetnsCluster(tmp, net, kv_advertise={"decode-0": f"tcp://{proxy_ep}"})
    c.proxy = proxy
    try:
        c.start()
        yield c
    finally:
        codes = c.stop()
        proxy.close()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def generate_all(cluster, n, timeout_s):
    cl = cluster.client()
    results = {}
    try:
        for _ in range(n):
            req = prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            results[cl.start(req)] = Result()
        cl.collect(results, timeout_s)
    finally:
        cl.close()
    return results


def test_served_across_namespaces(cluster):
    ref = reference(prompt=PROMPT, max_tokens=MAX_TOKENS)
    results = generate_all(cluster, 2, 120)
    for r in results.values():
        assert r.status == "OK", (r.status, r.message, cluster.tail("router"))
        assert r.text == ref
    # the KV pages crossed the proxy on the host, from the prefill node's namespace
    st = cluster.proxy.stats()
    assert st["accepted"] >= 1 and st["bytes_up"] > 100_000, st


def test_kv_partition(cluster):
    """The KV link partitioned for 10 s (nothing passes, nothing is closed by the proxy, new
    connections are held): every request sent during it completes OK, and within the transfer
    timeout + 10 s of the partition's start (docs/protocol.md; before issue 13 the sender's
    60 s timeout held them a minute)."""
    ref = reference(prompt=PROMPT, max_tokens=MAX_TOKENS)
    cluster.proxy.command("stall")
    t0 = time.time()
    results = {}
    cl = cluster.client()
    try:
        for _ in range(3):
            req = prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
            results[cl.start(req)] = Result()
        done = threading.Thread(target=cl.collect, args=(results, 300))
        done.start()
        time.sleep(PARTITION_S)  # the fault: a 10 s partition
    finally:
        cluster.proxy.command("resume")
    done.join(320)
    elapsed = time.time() - t0
    cl.close()
    assert not done.is_alive(), "requests did not end"
    for call, r in results.items():
        assert r.status == "OK", (call, r.status, r.message, cluster.tail("router", 60),
                                  cluster.tail("prefill-0", 60))
        assert r.text == ref
    # the criterion is TRANSFER_TIMEOUT_S + 10 s = 20 s; the margin is for a loaded machine,
    # and still far from the 60 s a request waited before
    assert elapsed < TRANSFER_TIMEOUT_S + 10 + 20, elapsed
    cluster.wait_idle(5.0)


PROBE = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60)
s.sendall(b"GET /health HTTP/1.1\\r\\nHost: x\\r\\nConnection: close\\r\\n\\r\\n")
buf = b""
while True:
    b = s.recv(65536)
    if not b:
        break
    buf += b
sys.stdout.write(buf.decode())
"""


def probe_from_ns(cluster, role):
    out = subprocess.run(cluster.net.exec_argv(role, [sys.executable, "-c", PROBE,
                                                      cluster.http_addr, str(cluster.http_port)]),
                         capture_output=True, text=True, timeout=120)
    return out.stdout


def test_slowloris_from_one_host(cluster):
    """1,000 connections from the host's address that send half a request and then nothing:
    the router keeps its per-client share (router.http_max_connections_per_client, 64) and
    /health still answers a probe from another host (the "probe" namespace)."""
    socks = []
    try:
        for _ in range(1000):
            s = socket.socket()
            s.connect((cluster.http_addr, cluster.http_port))
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            socks.append(s)
        closed = set()
        end = time.time() + 120
        while len(closed) < 1000 - 64 and time.time() < end:
            r, _, _ = select.select([s for s in socks if s not in closed], [], [], 0.2)
            for s in r:
                try:
                    if s.recv(1) == b"":
                        closed.add(s)
                except ConnectionResetError:
                    closed.add(s)
        assert len(closed) == 1000 - 64, len(closed)
        answer = probe_from_ns(cluster, "probe")
        assert answer.startswith("HTTP/1.1 200") and answer.endswith('{"status":"ok"}\n'), answer
    finally:
        for s in socks:
            s.close()
