"""Admission control under a burst (issue 13, case 3): 200 requests within a moment against one
decode node, each with a deadline of at least 3x what the router's admission estimate
(router/admit.c) gives for it on the idle cluster. Every request ends OK or
RESOURCE_EXHAUSTED, none DEADLINE_EXCEEDED, and every refusal was made before dispatch
(tandem_requests_shed_total counts them all; no node saw the refused requests).
"""
import time

from conftest import Cluster
from tandem_client import Result, prompt_request
from test_metrics import native

PROMPT = "The capital of France is"
N = 200
MAX_TOKENS = 32


def wait_step_time(cluster, nid, timeout_s=60):
    end = time.time() + timeout_s
    while time.time() < end:
        n = cluster.nodes()[nid]
        if n.step_time_s > 0:
            return n
        time.sleep(0.1)
    raise AssertionError(f"{nid} reports no step time")


def test_burst_is_shed_not_timed_out(tmp_path):
    # no speculative decoding: its draft rows make a batch-1 pass look like a bigger batch,
    # which is not what this test is about
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=1, threads=2,
                extra_decode="    speculative:\n      max_draft: 0\n")
    c.start()
    try:
        cl = c.client()
        # a measured step time: the estimate admits everything until the node has one
        for _ in range(2):
            assert cl.generate(prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS,
                                              temperature=0.0)).status == "OK"
        node = wait_step_time(c, "decode-0")
        # and passes of more than one sequence, so the router's step-time line has a measured
        # slope rather than its prior (admit.c)
        warm = {cl.start(prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                        ignore_eos=True)): Result() for _ in range(8)}
        cl.collect(warm, 300)
        assert all(r.status == "OK" for r in warm.values()), [r.status for r in warm.values()]
        # the estimate for one request on the idle cluster: one prefill pass and MAX_TOKENS
        # decode passes at the node's step time, starting at once (admit.h)
        estimate_s = (1 + MAX_TOKENS) * node.step_time_s
        deadline_s = max(3 * estimate_s, 3.0)
        before = native(c)
        results = {}
        for _ in range(N):
            req = prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                 ignore_eos=True)
            call = cl.start(req, deadline_ms=int((time.time() + deadline_s) * 1000))
            results[call] = Result()
        cl.collect(results, 300)
        cl.close()
        after = native(c)
        statuses = {}
        for r in results.values():
            statuses[r.status] = statuses.get(r.status, 0) + 1
        assert set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, (statuses, [
            r.message for r in results.values() if r.status not in ("OK", "RESOURCE_EXHAUSTED")
        ][:5])
        assert statuses.get("OK", 0) >= 1, statuses
        shed = after.get("tandem_requests_shed_total", 0) - before.get(
            "tandem_requests_shed_total", 0)
        assert shed == statuses.get("RESOURCE_EXHAUSTED", 0), (shed, statuses)
        c.wait_idle(5.0)
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])
