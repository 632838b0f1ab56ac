"""The router killed under a client of libtandem-client (`tandem generate`): a stream in flight
ends with UNAVAILABLE "router connection lost" instead of silence until its deadline, and a
router started again on the same config serves new calls once the nodes are back.

Outcomes only: the deadline is a generous 60 s, and the test asserts the status the stream
ended with (UNAVAILABLE, not DEADLINE_EXCEEDED), not how fast it came.
"""
import select
import signal
import subprocess

from conftest import BINARIES, Cluster


def generate_cli(c, max_tokens, timeout_s):
    return [BINARIES["tandem"], "generate", "--router", c.client_ep, "--timeout", str(timeout_s),
            "-n", str(max_tokens), "--ignore-eos",
            "-p", "Count from one to one thousand: one, two, three,"]


def wait_output(p, timeout_s):
    """The first bytes p writes to stdout, or b"" when it wrote none within timeout_s."""
    ready, _, _ = select.select([p.stdout], [], [], timeout_s)
    return p.stdout.read1(64) if ready else b""


def test_router_killed_mid_stream_ends_it_with_unavailable(tmp_path):
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=1)
    c.start()
    p = None
    try:
        p = subprocess.Popen(generate_cli(c, 2000, 60), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
        assert wait_output(p, 60), "the stream did not start: " + p.stderr.read().decode()
        c.kill("router")  # SIGKILL: nothing is sent to the client
        try:
            _, err = p.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError("tandem generate still running after the router was killed")
        err = err.decode()
        assert p.returncode != 0, err
        assert "(UNAVAILABLE)" in err, err
        assert "router connection lost" in err, err
        assert "DEADLINE_EXCEEDED" not in err, err

        # the same config again: the nodes register with the new router and it serves
        c._spawn("router", [BINARIES["router"], "--config", c.config])
        c.wait_up(c.prefill_ids + c.decode_ids, 90)
        done = subprocess.run(generate_cli(c, 8, 60), capture_output=True, timeout=120)
        assert done.returncode == 0, done.stderr.decode()
        assert done.stdout.strip(), done.stderr.decode()
    finally:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()
        c.stop()
