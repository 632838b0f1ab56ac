"""Per-node CURVE identity (DESIGN.md "Security and identity"): a cluster whose router and nodes
each have their own key pair (`tandem keys generate`) serves a real prompt over CURVE; a fake
node without keys and a fake node holding decode-0's secret key that registers as decode-1 are
both refused (no RegisterAck), never receive a DecodeReserve or a PrefillTask, and the cluster
keeps serving.

The fakes are plain pyzmq DEALERs speaking the wire format of docs/protocol.md; their routing
identity is arbitrary (the router identifies nodes by their CURVE key, not by it).
"""
import os
import re
import subprocess
import time

import pytest
import zmq

from conftest import BINARIES, Cluster, reference
from tandem_client import NAMES, PROTOCOL_MAJOR, PROTOCOL_MINOR, pb, prompt_request


@pytest.fixture(autouse=True)
def _curve_available():
    # not a skip: Tandem's node security needs CURVE, and Debian's libzmq has it
    assert zmq.has("curve"), "pyzmq/libzmq built without CURVE"


PROMPT = "The capital of France is"


def add_keys(cluster):
    """Generates the key pairs of cluster's config and pastes them into it."""
    keys = os.path.join(cluster.dir, "keys")
    out = subprocess.run([BINARIES["tandem"], "keys", "generate", "--config", cluster.config,
                          "--out", keys], capture_output=True, text=True, check=True).stdout
    router = re.search(r"^router:\n((?:  .*\n)+)", out, re.M).group(1)
    per_node = dict(re.findall(r"^  - id: (\S+)\n((?:    .*\n)+)", out, re.M))
    with open(cluster.config) as f:
        text = f.read()
    text = text.replace("router:\n", "router:\n" + router, 1)
    for nid, lines in per_node.items():
        text = text.replace(f"  - id: {nid}\n", f"  - id: {nid}\n{lines}", 1)
    with open(cluster.config, "w") as f:
        f.write(text)
    return keys


def read_key(path):
    with open(path) as f:
        return f.read().strip().encode()


@pytest.fixture
def cluster(tmp_path):
    # decode-1 is in the config (with its own key) but never started: the identity to steal
    c = Cluster(str(tmp_path), n_prefill=1, n_decode=2)
    c.keys = add_keys(c)
    c._spawn("router", [BINARIES["router"], "--config", c.config])
    for nid in ("prefill-0", "decode-0"):
        binary = BINARIES["prefill" if nid.startswith("prefill") else "decode"]
        c._spawn(nid, [binary, "--config", c.config, "--node-id", nid])
    c.wait_up(["prefill-0", "decode-0"], 90)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


class FakeNode:
    """A DEALER on the router's node endpoint that sends a RegisterRequest and records what it
    receives."""

    def __init__(self, endpoint, identity, keys=None):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        if keys:
            public, secret, server = keys
            self.sock.curve_publickey = public
            self.sock.curve_secretkey = secret
            self.sock.curve_serverkey = server
        self.sock.connect(endpoint)
        self.frames = []  # (FrameHeader, body)

    def register(self, node_id, role, call_id=1):
        reg = pb.RegisterRequest()
        reg.node_id = node_id
        reg.role = role
        reg.version = "fake"
        reg.kv_endpoint = "tcp://127.0.0.1:9"
        reg.kv_blocks_total = 100
        reg.max_running = 8
        reg.max_batch_tokens = 512
        reg.n_ctx = 4096
        h = pb.FrameHeader()
        h.version_major, h.version_minor = PROTOCOL_MAJOR, PROTOCOL_MINOR
        h.kind, h.method, h.call_id = pb.FRAME_KIND_REQUEST, pb.METHOD_REGISTER, call_id
        self.sock.send_multipart([h.SerializeToString(), reg.SerializeToString()])

    def drain(self, seconds):
        end = time.time() + seconds
        while True:
            left = end - time.time()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                return self.frames
            parts = self.sock.recv_multipart()
            h = pb.FrameHeader()
            h.ParseFromString(parts[0])
            self.frames.append((h, parts[1] if len(parts) > 1 else None))

    def wait_for(self, pred, seconds, what):
        """Receives until pred(self.frames) holds; fails after seconds."""
        end = time.time() + seconds
        while not pred(self.frames):
            left = end - time.time()
            assert left > 0, f"no {what} after {seconds} s: {self.frames}"
            self.drain(min(left, 0.1))
        return self.frames

    def work_received(self):
        return [h for h, _ in self.frames
                if h.method in (pb.METHOD_DECODE_RESERVE, pb.METHOD_PREFILL_TASK)]

    def close(self):
        self.sock.close(linger=0)


def wait_log(cluster, text, name="router", timeout_s=60):
    """Waits until the daemon's log holds text."""
    end = time.time() + timeout_s
    while True:
        with open(cluster.logs[name]) as f:
            if text in f.read():
                return
        assert time.time() < end, f"no {text!r} in {name}'s log after {timeout_s} s"
        time.sleep(0.05)


def generate_ok(cluster, prompt=PROMPT):
    cl = cluster.client()
    try:
        res = cl.generate(prompt_request(prompt=prompt, max_tokens=8, temperature=0.0))
    finally:
        cl.close()
    assert res.status == "OK", (res, cluster.tail("router"))
    return res


def test_per_node_keys_serve_and_refuse_impostors(cluster):
    with open(cluster.logs["router"]) as f:
        assert "curve=on" in f.read()
    want = reference(prompt=PROMPT, max_tokens=8)
    assert generate_ok(cluster).text == want

    router_key = read_key(os.path.join(cluster.keys, "router.pub"))
    # 1. no keys at all: the CURVE handshake fails, so the registration never arrives
    plain = FakeNode(cluster.node_ep, b"fake-plain")
    plain.register("decode-1", pb.NODE_ROLE_DECODE)
    # 2. decode-0's own key pair, claiming to be decode-1: admitted by ZAP as decode-0,
    #    refused by the router
    stolen = (read_key(os.path.join(cluster.keys, "decode-0.pub")),
              read_key(os.path.join(cluster.keys, "decode-0.key")), router_key)
    thief = FakeNode(cluster.node_ep, b"fake-thief", keys=stolen)
    thief.register("decode-1", pb.NODE_ROLE_DECODE)
    # 3. a key pair the cluster does not know, claiming decode-1: refused by ZAP
    pub, sec = zmq.curve_keypair()
    stranger = FakeNode(cluster.node_ep, b"fake-stranger", keys=(pub, sec, router_key))
    stranger.register("decode-1", pb.NODE_ROLE_DECODE)
    try:
        # the answer to the thief (after its CURVE handshake and ZAP), however slow
        thief.wait_for(lambda fr: any(h.kind == pb.FRAME_KIND_END and h.call_id == 1
                                      for h, _ in fr), 60, "END for the thief's RegisterRequest")
        ends = [h for h, _ in thief.frames if h.kind == pb.FRAME_KIND_END and h.call_id == 1]
        assert len(ends) == 1, thief.frames
        assert NAMES.get(ends[0].status) == "UNAUTHENTICATED", ends[0]
        assert ends[0].message == "node key of 'decode-0' cannot register as 'decode-1'"
        # ZAP refused the stranger (a marker that its attempt was dealt with); the plain
        # socket's handshake cannot even start. Then a quiet spell, in which anything wrongly
        # sent to them would show (it cannot fail a correct router: the checks are absences)
        wait_log(cluster, "unknown public key")
        plain.drain(1)
        stranger.drain(1)
        assert plain.frames == [], plain.frames
        assert stranger.frames == [], stranger.frames
        assert not cluster.nodes()["decode-1"].up

        # the cluster keeps serving, and no work goes to the impostors meanwhile
        for prompt in ("Once upon a time", PROMPT):
            generate_ok(cluster, prompt)
        for fake in (plain, thief, stranger):
            fake.drain(0.5)
            assert fake.work_received() == [], fake.frames
        assert [h.kind for h, _ in thief.frames] == [pb.FRAME_KIND_END], thief.frames
        nodes = cluster.nodes()
        assert nodes["decode-0"].up and nodes["prefill-0"].up
        assert not nodes["decode-1"].up
    finally:
        for fake in (plain, thief, stranger):
            fake.close()
    with open(cluster.logs["router"]) as f:
        log = f.read()
    assert "node key of 'decode-0' cannot register as 'decode-1'" in log
    assert "unknown public key" in log


def test_wrong_decode_key_fails_fast_and_says_why(cluster):
    """A prefill node whose config has a wrong public key for decode-0 cannot authenticate
    its KV endpoint: the request fails at once (after the router's retries) with a server-side
    status naming the KV endpoint, instead of hanging to its deadline; nothing stays pinned."""
    with open(cluster.config) as f:
        cfg = f.read()
    good = re.search(r"  - id: decode-0\n(?:    .*\n)*?    curve_public_key: \"([^\"]+)\"",
                     cfg).group(1)
    pub, _ = zmq.curve_keypair()
    bad = os.path.join(cluster.dir, "wrong-decode-key.yaml")
    with open(bad, "w") as f:
        f.write(cfg.replace(good, pub.decode()))
    old = cluster.nodes()["prefill-0"].instance_id
    cluster.kill("prefill-0")
    cluster._spawn("prefill-0", [BINARIES["prefill"], "--config", bad, "--node-id", "prefill-0"])
    # the new instance registers once the router has seen the old one go
    end = time.time() + 90
    while time.time() < end:
        n = cluster.nodes()["prefill-0"]
        if n.up and n.instance_id != old:
            break
        time.sleep(0.1)
    else:
        raise AssertionError("the restarted prefill-0 did not register\n" +
                             cluster.tail("prefill-0"))
    cl = cluster.client()
    try:
        res = cl.generate(prompt_request(PROMPT, max_tokens=8, temperature=0.0), timeout_s=120,
                          deadline_ms=int(time.time() * 1000) + 90000)
    finally:
        cl.close()
    assert res.status == "UNAVAILABLE", res
    assert "cannot authenticate the decode node's KV endpoint" in res.message, res.message
    assert "not the one configured" in res.message, res.message
    cluster.wait_idle(30)
