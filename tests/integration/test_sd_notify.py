"""sd_notify readiness of the daemons (the Type=notify units in deploy/systemd): the router
reports READY=1 once its sockets are bound, a node only once the router acknowledged its
registration, and each STOPPING=1 on SIGTERM. A datagram socket stands in for systemd's
$NOTIFY_SOCKET.

Daemons built without libsystemd (cmake/TandemDeps.cmake: optional) cannot notify; the test
checks that they are such a build (no libsystemd in `ldd`) and reports itself skipped.
"""
import os
import signal
import socket
import subprocess
import time

import pytest

from conftest import BINARIES, Cluster


def links_libsystemd(binary):
    out = subprocess.run(["ldd", binary], capture_output=True, text=True, check=True).stdout
    return "libsystemd.so" in out


class Listener:
    """A $NOTIFY_SOCKET: collects the messages one daemon sends."""

    def __init__(self, path):
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.messages = []

    def poll(self, timeout_s):
        """Receives for timeout_s seconds; returns the messages so far."""
        end = time.time() + timeout_s
        while True:
            left = end - time.time()
            if left <= 0:
                return self.messages
            self.sock.settimeout(left)
            try:
                self.messages.append(self.sock.recv(4096).decode())
            except socket.timeout:
                return self.messages

    def drain(self):
        """Receives whatever is queued, without waiting; returns the messages so far. Once
        the daemon has exited, every message it sent is queued."""
        self.sock.setblocking(False)
        try:
            while True:
                self.messages.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)
        return self.messages

    def wait_last(self, line, timeout_s):
        """Waits until the last message received ends with `line`; returns the messages."""
        end = time.time() + timeout_s
        while not (self.messages and self.messages[-1].split("\n")[-1] == line):
            assert time.time() < end, f"last message not {line} after {timeout_s} s: " \
                                      f"{self.messages}"
            self.poll(0.1)
        return self.messages

    def wait_for(self, line, timeout_s):
        """Waits until a message holds `line` (one VAR=value line); returns that message."""
        end = time.time() + timeout_s
        while time.time() < end:
            for m in self.messages:
                if line in m.split("\n"):
                    return m
            self.poll(0.1)
        raise AssertionError(f"no {line} within {timeout_s} s; got {self.messages}")

    def close(self):
        self.sock.close()


@pytest.fixture
def cluster(tmp_path):
    if not links_libsystemd(BINARIES["router"]):
        pytest.skip("daemons built without libsystemd (libsystemd-dev missing): no sd_notify")
    c = Cluster(str(tmp_path))
    yield c
    c.stop()


def spawn(cluster, name, argv, listener):
    log = open(os.path.join(cluster.dir, f"{name}.log"), "w")
    env = dict(os.environ, OMP_WAIT_POLICY="passive", NOTIFY_SOCKET=listener.path)
    cluster.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    cluster.logs[name] = log.name


def test_ready_after_registration_and_stopping(cluster, tmp_path):
    lr = Listener(str(tmp_path / "router.sock"))
    ld = Listener(str(tmp_path / "decode.sock"))
    lp = Listener(str(tmp_path / "prefill.sock"))
    try:
        # The decode node first: it loads the model and keeps registering, but is not ready
        # while no router answers.
        spawn(cluster, "decode-0", [BINARIES["decode"], "--config", cluster.config,
                                    "--node-id", "decode-0"], ld)
        ld.wait_for(f"STATUS=registering with the router at {cluster.node_ep}", 90)
        # a quiet spell in which a wrong READY=1 would show (it cannot make a correct node
        # fail: the check below is for an absence)
        ld.poll(2.0)
        assert not any("READY=1" in m.split("\n") for m in ld.messages), ld.messages
        assert any(m.startswith("STATUS=loading the model ") for m in ld.messages), ld.messages

        spawn(cluster, "router", [BINARIES["router"], "--config", cluster.config], lr)
        m = lr.wait_for("READY=1", 90)
        assert m.startswith(f"READY=1\nSTATUS=serving clients at {cluster.client_ep}, "
                            f"nodes at {cluster.node_ep}, HTTP at 127.0.0.1:"), m
        m = ld.wait_for("READY=1", 90)
        assert m == f"READY=1\nSTATUS=serving, registered with the router at {cluster.node_ep}"
        # READY=1 means the router has the node: the first Status call shows it up (no
        # waiting: it registered before the router acknowledged)
        assert cluster.nodes()["decode-0"].up

        spawn(cluster, "prefill-0", [BINARIES["prefill"], "--config", cluster.config,
                                     "--node-id", "prefill-0"], lp)
        lp.wait_for("READY=1", 90)
        nodes = cluster.nodes()
        assert nodes["prefill-0"].up and nodes["decode-0"].up, nodes

        # The router restarts: the nodes register again (the new router answers their
        # heartbeats with NOT_FOUND) and stay READY: no second READY=1, and the last STATUS=
        # says they serve.
        cluster.kill("router", signal.SIGTERM)
        assert cluster.procs["router"].returncode == 0
        assert lr.wait_for("STOPPING=1", 30) == "STOPPING=1\nSTATUS=stopping"
        lr2 = Listener(str(tmp_path / "router2.sock"))
        try:
            spawn(cluster, "router", [BINARIES["router"], "--config", cluster.config], lr2)
            lr2.wait_for("READY=1", 90)
            cluster.wait_up(["prefill-0", "decode-0"], 90)
        finally:
            lr2.close()
        # the node notifies once the new router's ack reached it, which can be after the
        # router lists it: wait for its last STATUS= to say it serves again
        serving = f"STATUS=serving, registered with the router at {cluster.node_ep}"
        ld.drain()
        ld.wait_last(serving, 60)
        n_ready = sum("READY=1" in m.split("\n") for m in ld.messages)
        assert n_ready == 1, ld.messages

        for name, lst in (("decode-0", ld), ("prefill-0", lp)):
            cluster.kill(name, signal.SIGTERM)
            assert cluster.procs[name].returncode == 0
            assert lst.wait_for("STOPPING=1", 30) == "STOPPING=1\nSTATUS=stopping"
    finally:
        for lst in (lr, ld, lp):
            lst.close()


def test_rejected_node_reports_why(cluster, tmp_path):
    """A node the router refuses says so in STATUS= and never reports READY=1."""
    lr = Listener(str(tmp_path / "router.sock"))
    ld = Listener(str(tmp_path / "decode.sock"))
    other = os.path.join(cluster.dir, "other.yaml")
    # Without keys by default: with them, the router's CURVE handshake refuses decode-x's key
    # (no node of its config) before any registration, and the node keeps retrying, as with
    # configured keys (test_keys_default.py covers that); this test is about the refused
    # registration.
    with open(cluster.config) as f:
        text = f.read() + "security:\n  default_keys: false\n"
    with open(cluster.config, "w") as f:
        f.write(text)
    # The same cluster with a node id the router does not know.
    with open(other, "w") as f:
        f.write(text.replace("id: decode-0", "id: decode-x"))
    try:
        spawn(cluster, "router", [BINARIES["router"], "--config", cluster.config], lr)
        lr.wait_for("READY=1", 90)
        spawn(cluster, "decode-x", [BINARIES["decode"], "--config", other,
                                    "--node-id", "decode-x"], ld)
        assert cluster.procs["decode-x"].wait(timeout=120) == 1
        ld.drain()  # it exited: all it sent is queued
        assert not any("READY=1" in m.split("\n") for m in ld.messages), ld.messages
        refused = [m for m in ld.messages if m.startswith("STATUS=refused by the router: ")]
        assert refused and "decode-x" in refused[0], ld.messages
        assert ld.messages[-1] == "STOPPING=1\nSTATUS=stopping"
    finally:
        lr.close()
        ld.close()
