"""Admission control under a burst (issue 13, case 3): 200 requests within a moment against one
decode node with 4 batch slots. Every request ends OK or RESOURCE_EXHAUSTED, none
DEADLINE_EXCEEDED, and every refusal was made before dispatch (tandem_requests_shed_total counts
them all; no node saw the refused requests).

The deadline does not sit on the edge of what the router's estimate (router/admit.c) admits, so
the test does not hang on the machine running exactly as fast as the estimate says: with 4
slots the burst runs in waves, the estimate for a request in the second wave is about twice
that of the first (it starts when the first ends), and the deadline is 1.56x the time the
first wave takes when measured just before (W): the first wave is admitted while the
estimate is within 1.25x of W (x the router's margin of 1.25), the second is refused while
the estimate is above 0.63x, and a request admitted times out only if the burst runs 1.56x
slower than the same wave did a moment earlier.
"""
import time

from conftest import Cluster
from tandem_client import Result, prompt_request
from test_metrics import native

PROMPT = "The capital of France is"
N = 200
MAX_TOKENS = 32
SLOTS = 4
MARGIN = 1.25  # RT_ADMIT_MARGIN (router/admit.c)


def wait_step_time(cluster, nid, timeout_s=60):
    end = time.time() + timeout_s
    while time.time() < end:
        n = cluster.nodes()[nid]
        if n.load.step_s > 0:
            return n
        time.sleep(0.1)
    raise AssertionError(f"{nid} reports no step time")


def run_wave(cl, n):
    """Runs n concurrent greedy requests; returns the wall time until the last ended."""
    t0 = time.monotonic()
    calls = {cl.start(prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                     ignore_eos=True)): Result() for _ in range(n)}
    cl.collect(calls, 300)
    assert all(r.status == "OK" for r in calls.values()), [r.status for r in calls.values()]
    return time.monotonic() - t0


def test_burst_is_shed_not_timed_out(tmp_path):
    # no speculative decoding: its draft rows make a batch-1 pass look like a bigger batch,
    # which is not what this test is about
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=1, threads=2,
                extra_decode=f"    max_running: {SLOTS}\n"
                             "    speculative:\n      max_draft: 0\n")
    c.start()
    try:
        cl = c.client()
        # a measured step time: the estimate admits everything until the node has one
        for _ in range(2):
            assert cl.generate(prompt_request(prompt=PROMPT, max_tokens=MAX_TOKENS,
                                              temperature=0.0)).status == "OK"
        wait_step_time(c, "decode-0")
        # passes of 1 to SLOTS sequences, so the router's step-time line has a measured slope
        # rather than its prior (admit.c)
        run_wave(cl, 2 * SLOTS)
        # the first wave of the burst, as it runs on this machine now (the slower of two)
        wave_s = max(run_wave(cl, SLOTS), run_wave(cl, SLOTS))
        deadline_s = 1.25 * MARGIN * wave_s
        # the burst starts on an idle node as the router sees it (heartbeats lag the node)
        c.wait_idle(30.0)
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
        shed_msgs = [r.message for r in results.values() if r.status == "RESOURCE_EXHAUSTED"]
        print(f"first wave {wave_s:.3f} s, deadline {deadline_s:.3f} s: {statuses}; "
              f"a refusal: {shed_msgs[:1]}")
        assert set(statuses) <= {"OK", "RESOURCE_EXHAUSTED"}, (statuses, wave_s, deadline_s, [
            r.message for r in results.values() if r.status not in ("OK", "RESOURCE_EXHAUSTED")
        ][:3], shed_msgs[:2])
        assert statuses.get("OK", 0) >= 1, (statuses, wave_s, shed_msgs[:1])
        shed = after.get("tandem_requests_shed_total", 0) - before.get(
            "tandem_requests_shed_total", 0)
        assert shed == statuses.get("RESOURCE_EXHAUSTED", 0), (shed, statuses)
        c.wait_idle(5.0)
    finally:
        codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])
