"""Faults on the prefill-to-decode KV link (issue 13), through the fault-injecting proxy
(faultproxy.py) on loopback: decode-0 advertises the proxy's port as its KV endpoint, so every
transfer crosses it. Plain ZMTP (security.default_keys: false), so a corrupted byte reaches the
receiver's checksums instead of failing a CURVE box.

Cases: one byte of a block corrupted in flight (refused by the checksum and retried; never a
client error); the connection cut in the middle of a transfer (the prefill node sends it again
on the new connection at once, without a re-dispatch by the router).
"""
import os
import re

import pytest

from conftest import Cluster, free_port, reference
from faultproxy import FaultProxy
from tandem_client import prompt_request
from test_metrics import native

PROMPT = "The capital of France is"
MAX_TOKENS = 8
# past the ZMTP greeting and the transfer's header, inside the first block's data (one block
# of the default model is 16 tokens x 23,040 bytes = 368,640 bytes)
OFFSET = 200_000


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("kv_faults"))
    c = Cluster(tmp, n_prefill=1, n_decode=1, default_keys=False)
    proxy_port = free_port()
    with open(c.config) as f:
        text = f.read()
    kv = re.search(r"    kv_endpoint: tcp://127\.0\.0\.1:(\d+)\n", text)
    text = text.replace(kv.group(0),
                        kv.group(0) + f"    kv_advertise: tcp://127.0.0.1:{proxy_port}\n")
    with open(c.config, "w") as f:
        f.write(text)
    c.proxy = FaultProxy(f"127.0.0.1:{proxy_port}", f"127.0.0.1:{kv.group(1)}",
                         os.path.join(tmp, "proxy.ctl"), log_path=os.path.join(tmp, "proxy.log"))
    try:
        c.start()
        yield c
    finally:
        codes = c.stop()
        c.proxy.close()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def counter(cluster, name):
    return sum(v for k, v in native(cluster).items() if k == name or k.startswith(name + "{"))


def generate(cluster):
    cl = cluster.client()
    try:
        return cl.generate(prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0))
    finally:
        cl.close()


def test_corrupted_byte_is_refused_and_retried(cluster):
    ref = reference(prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert generate(cluster).text == ref  # the channel is connected, the proxy sees traffic
    failures = counter(cluster, "tandem_kv_transfer_failures_total")
    cluster.proxy.command(f"corrupt {cluster.proxy.stats()['bytes_up'] + OFFSET}")
    r = generate(cluster)
    assert cluster.proxy.stats()["corrupted"] == 1
    # a server fault, retried: never INVALID_ARGUMENT (HTTP 400)
    assert r.status == "OK", (r.status, r.message, cluster.tail("router"))
    assert r.text == ref
    with open(cluster.logs["decode-0"]) as f:
        assert "checksum mismatch" in f.read(), cluster.tail("decode-0")
    assert counter(cluster, "tandem_kv_transfer_failures_total") == failures + 1
    cluster.wait_idle(5.0)


def test_cut_mid_transfer_is_resent(cluster):
    ref = reference(prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert generate(cluster).text == ref
    redispatched = counter(cluster, "tandem_requests_redispatched_total")
    cuts = cluster.proxy.stats()["cut"]
    # a new connection's stream starts at 0: cut the current one first, so that the next
    # transfer opens a fresh one, and arm the cut inside that transfer's first block
    cluster.proxy.command("cut")
    cluster.proxy.command(f"cut_after {OFFSET}")
    r = generate(cluster)
    assert cluster.proxy.stats()["cut"] >= cuts + 1, cluster.proxy.stats()
    assert r.status == "OK", (r.status, r.message, cluster.tail("router"))
    assert r.text == ref
    with open(cluster.logs["prefill-0"]) as f:
        assert "resending" in f.read(), cluster.tail("prefill-0")
    # the prefill node sent it again itself: the router did not have to re-dispatch
    assert counter(cluster, "tandem_requests_redispatched_total") == redispatched
    cluster.wait_idle(5.0)
