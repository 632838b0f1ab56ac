"""Fault tests of one cluster on loopback (issue 13, "one failure, one retry" and
"partitions"): a decode node paused while the router waits for its reservation, and the KV
transfer timeout from the config.

Outcomes are asserted, never timings: a fault lasts a given time (the pause), and every wait
for its consequences is an event with a generous deadline.
"""
import os
import re
import signal
import threading
import time

from conftest import Cluster, reference
from tandem_client import Result, prompt_request

PROMPT = "The capital of France is"
MAX_TOKENS = 8


def wait_heard_since(cluster, nid, since, timeout_s=60.0):
    """The node table once the router has heard from node nid (a heartbeat: the node is idle)
    after the wall-clock time `since`, so its figures are the node's own, not the ones a
    registration starts with."""
    end = time.time() + timeout_s
    last = None
    while time.time() < end:
        try:
            nodes = cluster.nodes()
        except TimeoutError:
            nodes = None
        if nodes is not None:
            n = nodes[nid]
            last = (n.up, n.last_heartbeat_age_s)
            if n.up and n.last_heartbeat_age_s >= 0 and \
                    time.time() - n.last_heartbeat_age_s > since:
                return nodes
        time.sleep(0.05)
    raise AssertionError(f"{nid} not heard from since {since}: (up, age) {last}")


def wait_freed(cluster, nid, timeout_s=60.0):
    """Waits until node nid reports, in a heartbeat, no KV blocks in use (the prefix cache does
    not count) and nothing running or waiting."""
    end = time.time() + timeout_s
    figures = None
    while time.time() < end:
        nodes = wait_heard_since(cluster, nid, time.time(), timeout_s=max(end - time.time(), 1))
        n = nodes[nid]
        figures = (n.load.kv_blocks_used, n.load.running, n.load.waiting)
        if figures == (0, 0, 0):
            return
    raise AssertionError(f"{nid} still holds (kv_blocks_used, running, waiting) {figures}")


def test_decode_node_paused_during_reservation(tmp_path):
    """SIGSTOP of a decode node for 4 s while the router waits for its reservation answers
    (heartbeat timeout 2.5 s): every request completes on the other decode node, none fails
    (no 400 "already on this node"), and once resumed the paused node holds no block."""
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=2)
    c.start()
    try:
        ref = reference(prompt=PROMPT, max_tokens=MAX_TOKENS)
        victim = "decode-0"
        cl = c.client()
        results = {}
        os.kill(c.procs[victim].pid, signal.SIGSTOP)
        try:
            # Both decode nodes have the same room: the router alternates between them, so
            # some of these reservations go to the paused one.
            for _ in range(4):
                req = prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0)
                results[cl.start(req)] = Result()
            done = threading.Thread(target=cl.collect, args=(results, 300))
            done.start()
            time.sleep(4.0)  # the fault: a 4 s pause
        finally:
            os.kill(c.procs[victim].pid, signal.SIGCONT)
        done.join(320)
        assert not done.is_alive(), "requests did not end"
        cl.close()
        for call, r in results.items():
            assert r.status == "OK", (call, r.status, r.message, c.tail("router"))
            assert r.text == ref, (call, r.text, ref)
            assert r.final is not None and r.final.finish_reason != 4  # not ERROR
        with open(c.logs["router"]) as f:
            router_log = f.read()
        # the case happened: a reservation on the paused node was given up and retried
        assert "re-dispatching: decode node 'decode-0'" in router_log, c.tail("router", 60)
        assert "already on this node" not in router_log
        # the paused node comes back (it registers again) and holds nothing
        c.wait_up([victim], 120)
        wait_freed(c, victim, timeout_s=120)
        wait_freed(c, "decode-1", timeout_s=120)
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def test_transfer_timeout_from_config(tmp_path):
    """kv.transfer_timeout_s is what the prefill node's KV sender uses (10 s when unset, as
    docs/protocol.md says), and a cluster with it serves requests as before."""
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=1)
    with open(c.config, "a") as f:
        f.write("kv:\n  transfer_timeout_s: 3.5\n")
    c.start()
    try:
        cl = c.client()
        r = cl.generate(prompt_request(prompt=PROMPT, max_tokens=4, temperature=0.0))
        cl.close()
        assert r.status == "OK", (r.status, r.message)
        assert r.text == reference(prompt=PROMPT, max_tokens=4)
        with open(c.logs["prefill-0"]) as f:
            log = f.read()
        assert "kv_transfer_timeout_s=3.5" in log, c.tail("prefill-0")
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])
    # and the default
    d = Cluster(str(tmp_path / "default"), n_prefill=1, n_decode=1)
    d.start()
    try:
        with open(d.logs["prefill-0"]) as f:
            assert re.search(r"kv_transfer_timeout_s=10\b", f.read()), d.tail("prefill-0")
    finally:
        codes = d.stop()
    assert all(rc == 0 for rc in codes.values()), codes
