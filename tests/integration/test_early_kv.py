"""The decode reservation off the first token's path (issue 33): the router sends the
PrefillTask together with the DecodeReserve, so a prefill node's KV transfer may reach the
decode node before its DecodeReserve does. Here decode-0's link to the router goes through the
fault-injecting proxy (faultproxy.py) with a delay: decode-0 reads its own copy of the config,
whose `router.node_advertise` is the proxy, so every DecodeReserve reaches it DELAY_MS late
while the prefill node's KV comes straight to its KV endpoint. The transfer is early every
time (a short prompt's prefill takes far less than the delay).

Cases: the early transfer is held and installed once the reservation is read (the output is
`tandem generate -m`'s, no re-dispatch, no block left on either node); a deadline that passes
between the reservation and the transfer's use (both nodes cancelled, nothing left); with
`kv.early_transfer_bytes: 0` it is refused at once as one without a reservation (NOT_FOUND,
as before holding existed): the prefill node reports it, the router re-dispatches until its
budget is spent, and no block is left.
"""
import os
import re
import time

from conftest import BINARIES, Cluster, free_port, reference
from faultproxy import FaultProxy
from tandem_client import prompt_request
from test_faults import wait_freed
from test_metrics import native

PROMPT = "The capital of France is"
MAX_TOKENS = 6
# each way, once the node is registered: a round trip (2 x 400 ms) stays inside the router's
# wait for a reservation's answer (the heartbeat timeout, 2.5 s, plus two forward passes);
# heartbeats still come every 250 ms, only late. A prompt of a few tokens is prefilled well
# within it, so its KV comes first
DELAY_MS = 400


def counter(cluster, name):
    return sum(v for k, v in native(cluster).items() if k == name or k.startswith(name + "{"))


def delayed_cluster(tmp, decode_extra=""):
    """A started 1 prefill + 1 decode cluster whose decode node reaches the router through a
    proxy delaying DELAY_MS each way; decode_extra: top-level YAML for decode-0's config only."""
    c = Cluster(tmp, n_prefill=1, n_decode=1)
    proxy_port = free_port()
    c.proxy = FaultProxy(f"127.0.0.1:{proxy_port}", c.node_ep.replace("tcp://", ""),
                         os.path.join(tmp, "proxy.ctl"), log_path=os.path.join(tmp, "proxy.log"))
    with open(c.config) as f:
        text = f.read()
    decode_cfg = os.path.join(tmp, "decode.yaml")
    with open(decode_cfg, "w") as f:
        f.write(text.replace("router:\n", f"router:\n  node_advertise: tcp://127.0.0.1:{proxy_port}\n",
                             1) + "log:\n  level: debug\n" + decode_extra)
    c._spawn("router", [BINARIES["router"], "--config", c.config])
    c._spawn("prefill-0", [BINARIES["prefill"], "--config", c.config, "--node-id", "prefill-0"])
    c._spawn("decode-0", [BINARIES["decode"], "--config", decode_cfg, "--node-id", "decode-0"])
    c.wait_up(["prefill-0", "decode-0"], 120)
    # delayed once registered: a registration whose answer takes longer than the node's 1 s
    # between tries is sent again, and the tries can keep overtaking each other
    c.proxy.command(f"delay {DELAY_MS}")
    return c


def stop(c):
    codes = c.stop()
    c.proxy.close()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def generate(c, max_tokens=MAX_TOKENS):
    cl = c.client()
    try:
        return cl.generate(prompt_request(prompt=PROMPT, max_tokens=max_tokens, temperature=0.0))
    finally:
        cl.close()


def test_early_transfer_held_then_installed(tmp_path):
    c = delayed_cluster(str(tmp_path))
    try:
        ref = reference(prompt=PROMPT, max_tokens=MAX_TOKENS)
        redispatched = counter(c, "tandem_requests_redispatched_total")
        reserves = counter(c, "tandem_decode_reserve_seconds_count")
        reserve_s = counter(c, "tandem_decode_reserve_seconds_sum")
        for _ in range(3):
            r = generate(c)
            assert r.status == "OK", (r.status, r.message, c.tail("router"), c.tail("decode-0"))
            assert r.text == ref
        with open(c.logs["decode-0"]) as f:
            log = f.read()
        # the case happened: transfers came before their reservations and were held
        held = re.findall(r"KV transfer \d+ held: attempt [0-9a-f]+ not decided yet", log)
        assert held, c.tail("decode-0", 60)
        assert "KV received" in log
        assert "refused: no reservation decided" not in log
        assert counter(c, "tandem_requests_redispatched_total") == redispatched
        # the reservation's round trip crossed the proxy twice
        assert counter(c, "tandem_decode_reserve_seconds_count") == reserves + 3
        assert counter(c, "tandem_decode_reserve_seconds_sum") - reserve_s >= \
            3 * 2 * DELAY_MS / 1000.0
        wait_freed(c, "decode-0", timeout_s=120)
        wait_freed(c, "prefill-0", timeout_s=120)

        # the deadline passes between the reservation and the transfer's use: the router ends
        # the request and cancels both nodes; the prefill node withdraws its transfer (held, or
        # not sent yet), the DecodeReserve reaches the decode node after its deadline and is
        # refused. Nothing is left on either node, and the cluster serves the next request.
        # The deadline is DELAY_MS - 50 ms away: the DecodeReserve, held DELAY_MS by the
        # proxy, reaches the node after it whatever the machine's speed. One output token, so
        # that admission control (the router's estimate of the node's passes) lets it in; a
        # loaded machine may still make it refuse at once (RESOURCE_EXHAUSTED, nothing
        # dispatched): then again, a few times.
        cl = c.client()
        try:
            for _ in range(5):
                deadline = int(time.time() * 1000) + DELAY_MS - 50
                r = cl.generate(prompt_request(prompt=PROMPT, max_tokens=1, temperature=0.0),
                                deadline_ms=deadline)
                if r.status != "RESOURCE_EXHAUSTED":
                    break
                time.sleep(1.0)
        finally:
            cl.close()
        assert r.status == "DEADLINE_EXCEEDED", (r.status, r.message)
        wait_freed(c, "decode-0", timeout_s=120)
        wait_freed(c, "prefill-0", timeout_s=120)
        r = generate(c)
        assert r.status == "OK" and r.text == ref, (r.status, r.message)
        wait_freed(c, "decode-0", timeout_s=120)
    finally:
        stop(c)


def test_early_transfer_over_the_bound_is_refused(tmp_path):
    c = delayed_cluster(str(tmp_path), "kv:\n  early_transfer_bytes: 0\n")
    try:
        ref = reference(prompt=PROMPT, max_tokens=MAX_TOKENS)
        r = generate(c)
        # every attempt's transfer is early and refused: the budget of re-dispatches is spent.
        # Each attempt's prefill node streamed one token first, each resumed after the last:
        # the client has the reference's first 4 tokens, once each
        assert r.status == "UNAVAILABLE", (r.status, r.message, c.tail("router"))
        assert "gave up after 3 re-dispatches" in r.message, r.message
        assert "no room to hold the transfer" in r.message, r.message
        assert r.text and ref.startswith(r.text), (r.text, ref)
        assert len(r.token_ids) == 4, r.token_ids
        with open(c.logs["decode-0"]) as f:
            log = f.read()
        assert "no room to hold the transfer" in log, c.tail("decode-0", 60)
        assert not re.search(r"KV transfer \d+ held", log)
        wait_freed(c, "decode-0", timeout_s=120)
        wait_freed(c, "prefill-0", timeout_s=120)
    finally:
        stop(c)
