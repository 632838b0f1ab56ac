"""Trust on the wire (docs/protocol.md "Identities"): instance identity, per-attempt request
identity, the KV header checksum chain and refusals that say why. Each test reproduces a way
the cluster could be made to return wrong text with status OK, hand work to a stranger, hang,
or keep working for a router that is gone, and asserts outcomes, never timings: every wait is
for an event, with a generous deadline.
"""
import json
import os
import random
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request

import zmq

from conftest import BINARIES, Cluster, free_port, reference
from tandem_client import PROTOCOL_MAJOR, PROTOCOL_MINOR, pb, prompt_request

PROMPT_A = "The capital of France is"
PROMPT_B = "Name three rivers:"
LONG_A = " ".join(["The capital of France is Paris, and the capital of Italy is Rome."] * 20)


def wait_for(pred, timeout_s, what):
    end = time.time() + timeout_s
    while time.time() < end:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def wait_tokens(client, call, n, timeout_s=120):
    """Receives the stream of call until it has n tokens (or it ended); returns the count."""
    end = time.time() + timeout_s
    count = 0
    while count < n and time.time() < end:
        got = client.recv(end - time.time())
        if got is None:
            break
        h, body = got
        if h.call_id != call:
            continue
        if body:
            ch = pb.GenerateChunk()
            ch.ParseFromString(body)
            count += len(ch.token_ids)
        if h.kind == pb.FRAME_KIND_END:
            break
    return count


def log_has(cluster, name, pattern):
    with open(cluster.logs[name]) as f:
        return re.search(pattern, f.read()) is not None


def models(cluster):
    c = cluster.client()
    try:
        st, msg, resp = c.unary(pb.METHOD_MODELS, pb.ModelsRequest(), pb.ModelsResponse)
        assert st == "OK", (st, msg)
        return resp.models[0]
    finally:
        c.close()


class RawBody:
    """Bytes sent as a message body as they are."""

    def __init__(self, raw):
        self.raw = raw

    def SerializeToString(self):
        return self.raw


class FakeNode:
    """A stranger on the node endpoint speaking the node protocol well enough to register."""

    def __init__(self, endpoint, identity):
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.sock.connect(endpoint)
        self.instance = random.getrandbits(64) | 1
        self.call = 1
        self.work = []  # DecodeReserve / PrefillTask frames the router sent us

    def send(self, kind, method, body):
        h = pb.FrameHeader(version_major=PROTOCOL_MAJOR, version_minor=PROTOCOL_MINOR, kind=kind,
                           method=method, call_id=self.call, instance_id=self.instance)
        self.call += 1
        self.sock.send_multipart([h.SerializeToString(), body.SerializeToString()])

    def register(self, node_id, model, role=pb.NODE_ROLE_DECODE, patch=None):
        """patch (old, new): byte strings of equal length replaced in the serialized body (a
        node_id that is not UTF-8, which the protobuf library would not serialize)."""
        reg = pb.RegisterRequest(node_id=node_id, role=role, version="0.1.0",
                                 model_fingerprint=model.fingerprint, kv_blocks_total=1000000,
                                 kv_endpoint="tcp://127.0.0.1:9", device="cpu", max_running=64,
                                 max_batch_tokens=2048, n_ctx=model.n_ctx,
                                 instance_id=self.instance)
        reg.kv_layout.n_layers = model.n_layers
        reg.kv_layout.n_kv_heads = model.n_kv_heads
        reg.kv_layout.head_dim = model.head_dim
        reg.kv_layout.block_size = model.kv_block_size
        reg.kv_layout.dtype = model.kv_dtype
        if patch:
            raw = reg.SerializeToString()
            assert len(patch[0]) == len(patch[1]) and patch[0] in raw
            reg = RawBody(raw.replace(patch[0], patch[1]))
        self.send(pb.FRAME_KIND_REQUEST, pb.METHOD_REGISTER, reg)
        return self.wait_end(pb.METHOD_REGISTER, 30)

    def heartbeat(self, node_id):
        hb = pb.Heartbeat(node_id=node_id, instance_id=self.instance,
                          load=pb.NodeLoad(kv_blocks_free=1000000))
        self.send(pb.FRAME_KIND_NOTIFY, pb.METHOD_HEARTBEAT, hb)

    def drain(self, timeout_s=0.0):
        """Receives what is waiting; returns END headers, keeps work frames in self.work."""
        ends = []
        while self.sock.poll(int(timeout_s * 1000)):
            parts = self.sock.recv_multipart()
            h = pb.FrameHeader()
            h.ParseFromString(parts[0])
            if h.kind == pb.FRAME_KIND_END:
                ends.append(h)
            else:
                self.work.append(h)
            timeout_s = 0
        return ends

    def wait_end(self, method, timeout_s):
        end = time.time() + timeout_s
        while time.time() < end:
            for h in self.drain(0.1):
                if h.method == method:
                    return h
        raise AssertionError(f"no END for method {method} in {timeout_s} s")

    def close(self):
        self.sock.close(linger=0)


def test_hijack_of_a_live_node_id_is_refused(tmp_path):
    """A stranger that registers with a live decode node's id (and heartbeats as it, as the
    real node's heartbeats once kept a fake registration alive) is refused; it never gets a
    prompt, and the real node goes on serving the reference text."""
    c = Cluster(str(tmp_path), default_keys=False).start()
    try:
        ref = reference(prompt=PROMPT_A, max_tokens=16)
        model = models(c)
        fake = FakeNode(c.node_ep, b"decode-0")  # even its routing id is the node id
        fake2 = FakeNode(c.node_ep, b"decode-0.impostor")
        try:
            for f in (fake, fake2):
                end = f.register("decode-0", model)
                # refused while the real instance is up (or its routing id ignored entirely)
                assert end is None or end.status != 0
            client = c.client()
            try:
                for i in range(6):
                    for f in (fake, fake2):
                        f.heartbeat("decode-0")
                    r = client.generate(prompt_request(PROMPT_A, max_tokens=16, temperature=0.0), timeout_s=120)
                    assert r.status == "OK", (r.status, r.message)
                    assert r.text == ref
            finally:
                client.close()
            for f in (fake, fake2):
                f.drain(0.2)
                assert [w for w in f.work if w.method in
                        (pb.METHOD_DECODE_RESERVE, pb.METHOD_PREFILL_TASK)] == []
            nodes = c.nodes()
            assert nodes["decode-0"].up
            assert "registered by a live instance" in nodes["decode-0"].refused_reason
        finally:
            fake.close()
            fake2.close()
    except AssertionError:
        print(c.tail("router"))
        raise
    finally:
        c.stop()


def test_unknown_node_id_refusal_is_reported(tmp_path):
    """A registration for an id the config does not have is refused and listed with its
    reason in Status (tandem status --json) and /ready."""
    c = Cluster(str(tmp_path), default_keys=False).start()
    try:
        model = models(c)
        fake = FakeNode(c.node_ep, b"intruder.1")
        try:
            end = fake.register("decode-9", model)
            assert end.status == 9  # FAILED_PRECONDITION
            assert "not in the cluster config" in end.message
        finally:
            fake.close()
        out = subprocess.run([BINARIES["tandem"], "status", "--json", "--router", c.client_ep],
                             capture_output=True, check=True, text=True).stdout
        doc = json.loads(out)
        assert any(r["node_id"] == "decode-9" and "not in the cluster config" in r["reason"]
                   for r in doc["refused"]), doc
        # a client request id with a NUL or a control byte is refused, never cut short
        client = c.client()
        try:
            for bad_id in ("ab\x00cd", "ab\x01cd", "tab\there"):
                req = prompt_request(PROMPT_A, max_tokens=2, temperature=0.0)
                req.request_id = bad_id
                r = client.generate(req, timeout_s=60)
                assert r.status == "INVALID_ARGUMENT", (bad_id, r.status, r.message)
                assert "request_id" in r.message
        finally:
            client.close()
    finally:
        c.stop()


def test_node_id_not_utf8_is_refused_and_status_still_parses(tmp_path):
    """A registration whose node_id is not UTF-8 (or has bytes no config id has) is refused
    with a reason naming the byte, and every later STATUS reply still parses as protobuf and
    as JSON (the raw id once reached the refusal list, and no client could read Status)."""
    c = Cluster(str(tmp_path), n_prefill=0, default_keys=False).start()
    try:
        model = models(c)
        fake = FakeNode(c.node_ep, b"intruder.2")
        try:
            end = fake.register("decode-\u00ff\u00fe", model,
                                patch=("decode-\u00ff\u00fe".encode(), b"decode-\xff\xfe\xfd\xfc"))
            assert end.status == 9, (end.status, end.message)  # FAILED_PRECONDITION
            assert "node_id: byte 7 is 0xff" in end.message, end.message
            end = fake.register("decode 0", model)
            assert end.status == 9 and "node_id: byte 6 is 0x20" in end.message, end.message
            end = fake.register("d" * 64, model)
            assert end.status == 9 and "node_id is 64 bytes" in end.message, end.message
        finally:
            fake.close()
        cl = c.client()
        try:
            st, msg, resp = cl.unary(pb.METHOD_STATUS, pb.StatusRequest(), pb.ClusterStatus)
            assert st == "OK", (st, msg)
            assert any(r.node_id == "decode-????" for r in resp.refused), resp
            # a model name gets the same rule before it is quoted back
            req = prompt_request(PROMPT_A, max_tokens=2, temperature=0.0)
            req.model = "smol\x01lm"
            r = cl.generate(req, timeout_s=60)
            assert r.status == "INVALID_ARGUMENT" and "byte 4 is not printable" in r.message, r.message
            # a constraint over its budget in bytes is refused before it is compiled
            req = prompt_request(PROMPT_A, max_tokens=2, temperature=0.0)
            req.constraint.kind = pb.CONSTRAINT_KIND_REGEX
            req.constraint.text = "a" * 20000
            r = cl.generate(req, timeout_s=60)
            assert r.status == "INVALID_ARGUMENT", (r.status, r.message)
            assert "is 20000 bytes; at most 16384" in r.message, r.message
        finally:
            cl.close()
        out = subprocess.run([BINARIES["tandem"], "status", "--json", "--router", c.client_ep],
                             capture_output=True, check=True, text=True).stdout
        doc = json.loads(out)
        assert any(r["node_id"] == "decode-????" and "byte 7 is 0xff" in r["reason"]
                   for r in doc["refused"]), doc
    finally:
        c.stop()


def test_refused_registration_learns_nothing_and_nul_is_refused(tmp_path):
    """A node_id with a NUL inside is refused naming the byte (protobuf-c would have cut it to
    "decode-0", a configured id), and no answer to a connection that has not registered carries
    the router's instance id (FrameHeader.instance_id 0)."""
    c = Cluster(str(tmp_path), n_prefill=0, default_keys=False).start()
    try:
        model = models(c)
        fake = FakeNode(c.node_ep, b"intruder.3")
        try:
            end = fake.register("decode-0Zx", model, patch=(b"decode-0Zx", b"decode-0\x00x"))
            assert end.status == 9, (end.status, end.message)  # FAILED_PRECONDITION
            assert "node_id: byte 8 is 0x00" in end.message, end.message
            assert end.instance_id == 0, end
            end = fake.register("decode-0", model)  # a live id: refused, retryably
            assert end.status == 14 and "registered by a live instance" in end.message, end
            assert end.instance_id == 0 and "%016x" % fake.instance not in end.message, end
            fake.send(pb.FRAME_KIND_REQUEST, pb.METHOD_HEARTBEAT,
                      pb.Heartbeat(node_id="decode-0", instance_id=fake.instance))
            end = fake.wait_end(pb.METHOD_HEARTBEAT, 30)
            assert end.status == 5 and end.instance_id == 0, end  # NOT_FOUND
        finally:
            fake.close()
        # the real decode-0 is untouched by the refusals and still serves
        st = c.client()
        try:
            r = st.generate(prompt_request(PROMPT_A, max_tokens=2, temperature=0.0), timeout_s=120)
            assert r.status == "OK", (r.status, r.message)
        finally:
            st.close()
        out = subprocess.run([BINARIES["tandem"], "status", "--json", "--router", c.client_ep],
                             capture_output=True, check=True, text=True).stdout
        doc = json.loads(out)
        assert any(r["node_id"] == "decode-0?" and "0x00" in r["reason"] for r in doc["refused"]), doc
    finally:
        c.stop()


def test_request_id_unique_per_connection_not_across(tmp_path):
    """docs/api.md: a request id is unique among the requests in flight on one client
    connection; another connection may use the same id at once (the id is a label, and
    refusing it across connections would let one client probe or block another's ids)."""
    c = Cluster(str(tmp_path), n_prefill=0, default_keys=False).start()
    a, b = c.client(), c.client()
    try:
        long = prompt_request(PROMPT_A, max_tokens=3000, temperature=0.0, ignore_eos=True)
        long.request_id = "dup-1"
        first = a.start(long)
        assert wait_tokens(a, first, 1) >= 1  # in flight
        short = prompt_request(PROMPT_A, max_tokens=2, temperature=0.0)
        short.request_id = "dup-1"
        r = b.generate(short, timeout_s=120)
        assert r.status == "OK", (r.status, r.message)
        r = a.generate(short, timeout_s=120)
        assert r.status == "INVALID_ARGUMENT", (r.status, r.message)
        assert "request_id 'dup-1' is already in flight" in r.message, r.message
        a.cancel(first)
    finally:
        a.close()
        b.close()
        c.stop()


def test_request_id_reused_right_after_cancel(tmp_path):
    """A request id reused right after cancelling it gets the new request's own text, 20 times
    out of 20: the old attempt's KV transfer, first token, withdrawal or TaskFailed never reach
    the new one (node state is keyed by attempt, not by the client's id)."""
    c = Cluster(str(tmp_path), default_keys=False).start()
    try:
        ref_b = reference(prompt=PROMPT_B, max_tokens=12)
        client = c.client()
        try:
            for i in range(20):
                rid = f"reuse-{i % 2}"  # two ids, each reused again and again
                # a long prompt: its KV transfer (about 20 blocks) is still in flight when the
                # client cancels after the first token, the window where it used to land in
                # the new request's reservation
                old = prompt_request(LONG_A, max_tokens=64, temperature=0.0)
                old.request_id = rid
                call = client.start(old)
                if i % 2:
                    # cancel once the first token is out (the KV transfer is under way); the
                    # other half are cancelled at once, mid-prefill
                    assert wait_tokens(client, call, 1) >= 1
                client.cancel(call)
                new = prompt_request(PROMPT_B, max_tokens=12, temperature=0.0)
                new.request_id = rid
                r = client.generate(new, timeout_s=120)
                assert r.status == "OK", (i, r.status, r.message)
                assert r.text == ref_b, (i, r.text)
        finally:
            client.close()
        c.wait_idle(timeout_s=30)
    finally:
        c.stop()


class KvTamperProxy:
    """Sits between prefill nodes and a decode node's KV endpoint and rewrites the first
    token of the first `n` KvTransfer headers it forwards (a bit flip on the wire)."""

    def __init__(self, listen_port, target, n=1):
        self.ctx = zmq.Context.instance()
        self.front = self.ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.front.bind(f"tcp://127.0.0.1:{listen_port}")
        self.target = target
        self.left = n
        self.tampered = 0
        self.backs = {}  # sender identity -> DEALER to the decode node
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        while not self.stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.front:
                    parts = self.front.recv_multipart(copy=True)
                    ident, rest = parts[0], parts[1:]
                    back = self.backs.get(ident)
                    if back is None:
                        back = self.ctx.socket(zmq.DEALER)
                        back.setsockopt(zmq.LINGER, 0)
                        back.connect(self.target)
                        self.backs[ident] = back
                        poller.register(back, zmq.POLLIN)
                    h = pb.FrameHeader()
                    h.ParseFromString(rest[0])
                    if (h.kind == pb.FRAME_KIND_REQUEST and h.method == pb.METHOD_KV_TRANSFER
                            and self.left > 0 and len(rest) > 1):
                        kt = pb.KvTransfer()
                        kt.ParseFromString(rest[1])
                        kt.first_token ^= 1
                        rest[1] = kt.SerializeToString()
                        self.left -= 1
                        self.tampered += 1
                    back.send_multipart(rest)
                else:
                    ident = next(i for i, b in self.backs.items() if b is sock)
                    self.front.send_multipart([ident] + sock.recv_multipart())

    def close(self):
        self.stop.set()
        self.thread.join(timeout=10)
        for b in self.backs.values():
            b.close(linger=0)
        self.front.close(linger=0)


def test_first_token_rewritten_in_flight_is_rejected(tmp_path):
    """KvTransfer.first_token is covered by the header checksum chain: rewritten in flight,
    the transfer is rejected (logged with the reason), the request is retried, and the client
    gets the reference text, never another continuation."""
    c = Cluster(str(tmp_path), default_keys=False)
    proxy_port = free_port()
    with open(c.config) as f:
        cfg = f.read()
    kv = re.search(r"kv_endpoint: (tcp://127\.0\.0\.1:\d+)\n", cfg).group(1)
    cfg = cfg.replace(f"kv_endpoint: {kv}\n",
                      f"kv_endpoint: {kv}\n    kv_advertise: tcp://127.0.0.1:{proxy_port}\n")
    with open(c.config, "w") as f:
        f.write(cfg)
    proxy = KvTamperProxy(proxy_port, kv, n=1)
    try:
        c.start()
        ref = reference(prompt=PROMPT_A, max_tokens=16)
        client = c.client()
        try:
            r = client.generate(prompt_request(PROMPT_A, max_tokens=16, temperature=0.0), timeout_s=120)
            assert proxy.tampered == 1
            assert r.status == "OK", (r.status, r.message)
            assert r.text == ref
            # and once more with nothing tampered
            r = client.generate(prompt_request(PROMPT_A, max_tokens=16, temperature=0.0), timeout_s=120)
            assert r.status == "OK" and r.text == ref
        finally:
            client.close()
        assert log_has(c, "decode-0", r"header checksum mismatch")
        c.wait_idle(timeout_s=30)
    finally:
        c.stop()
        proxy.close()


def test_refused_decode_node_says_why(tmp_path):
    """A decode node refused for a config mismatch shows the reason in tandem status --json,
    and a request waiting for a decode node says in its error that one was refused."""
    c = Cluster(str(tmp_path), default_keys=False)
    bad = os.path.join(str(tmp_path), "bad.yaml")
    with open(c.config) as f:
        cfg = f.read()
    with open(bad, "w") as f:
        f.write(cfg.replace("nodes:\n", "kv:\n  block_size: 32\nnodes:\n"))
    try:
        c._spawn("router", [BINARIES["router"], "--config", c.config])
        c._spawn("prefill-0", [BINARIES["prefill"], "--config", c.config, "--node-id",
                               "prefill-0"])
        c.wait_up(["prefill-0"], 90)
        c._spawn("decode-0", [BINARIES["decode"], "--config", bad, "--node-id", "decode-0"])

        def refused():
            out = subprocess.run([BINARIES["tandem"], "status", "--json", "--router",
                                  c.client_ep], capture_output=True, text=True).stdout
            try:
                doc = json.loads(out)
            except ValueError:
                return None
            n = next(n for n in doc["nodes"] if n["node_id"] == "decode-0")
            return n if n["refused_reason"] else None

        n = wait_for(refused, 90, "decode-0's refusal in tandem status --json")
        assert not n["up"]
        assert "kv_layout.block_size is 32; the router expects 16" in n["refused_reason"]
        table = subprocess.run([BINARIES["tandem"], "status", "--router", c.client_ep],
                               capture_output=True, check=True, text=True).stdout
        assert "refused registrations:" in table and "kv_layout.block_size" in table
        port = re.search(r"http_port: (\d+)", cfg).group(1)
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=30)
            raise AssertionError("/ready answered 200 without a decode node")
        except urllib.error.HTTPError as e:
            assert e.code == 503
            ready = json.loads(e.read())
        assert any(x["node_id"] == "decode-0" and "kv_layout.block_size" in x["reason"]
                   for x in ready["refused"]), ready
        client = c.client()
        try:
            # the deadline only ends the wait for a decode node: far enough ahead that a busy
            # machine cannot make the request arrive after it (refused then with another
            # message, "the request's deadline had passed when it arrived")
            r = client.generate(prompt_request(PROMPT_A, max_tokens=4, temperature=0.0), timeout_s=120,
                                deadline_ms=int(time.time() * 1000) + 10000)
        finally:
            client.close()
        assert r.status == "DEADLINE_EXCEEDED", (r.status, r.message)
        assert "decode node 'decode-0' was refused: kv_layout.block_size is 32" in r.message
    finally:
        c.stop()


def test_router_restart_stops_its_orphans(tmp_path):
    """After the router restarts, the nodes drop the work of the router instance that is gone
    at once, instead of generating its orphaned requests to max_tokens."""
    c = Cluster(str(tmp_path), default_keys=False).start()
    try:
        client = c.client()
        req = prompt_request(PROMPT_A, max_tokens=3000, ignore_eos=True, temperature=0.0)
        call = client.start(req)
        assert wait_tokens(client, call, 4) >= 4
        client.close()
        c.kill("router")
        c._spawn("router", [BINARIES["router"], "--config", c.config])
        c.wait_up(c.prefill_ids + c.decode_ids, 90)
        wait_for(lambda: log_has(c, "decode-0", r"dispatched by router instance [0-9a-f]+, "
                                 r"which is gone"), 60, "decode-0 to drop the orphan")
        nodes = wait_for(lambda: (lambda n: n if n["decode-0"].load.running == 0 and
                                  n["decode-0"].load.kv_blocks_used == 0 else None)(c.nodes()),
                         60, "decode-0 to be idle")
        assert nodes["decode-0"].up
        # the new router serves as before
        client = c.client()
        try:
            r = client.generate(prompt_request(PROMPT_A, max_tokens=8, temperature=0.0), timeout_s=120)
            assert r.status == "OK", (r.status, r.message)
        finally:
            client.close()
    finally:
        c.stop()
