"""Two routers sharing one prefill and one decode node (router.node_endpoints): both serve the
whole pool; kill -9 of one under load leaves the other's requests untouched, closes the dead
router's HTTP streams at once, and the nodes free the dead router's requests once they take it
for gone (twice the heartbeat timeout of silence, the connection down: 5 s), with no KV block
leaked. The native client (libtandem-client through `tandem generate --router A,B`) sends a
request whose router went before its first token to the next router. Two routers reserving
at once never over-commit the decode node's KV pool.

Events, not sleeps: every wait is on an outcome (a chunk read, a process ended, a socket
closed, a node's figures) with a generous deadline for a busy 2-core CI box.
"""
import http.client
import json
import os
import re
import signal
import subprocess
import threading
import time

import zmq

from conftest import BINARIES, MODEL, free_port
from tandem_client import Client, Result, pb, prompt_request


class Routers:
    """Routers A and B (each its own config: client, node and HTTP endpoints) and one prefill
    and one decode node that register with both (router.node_endpoints in every config)."""

    def __init__(self, tmp_dir, decode_budget="768MiB"):
        self.dir = tmp_dir
        self.procs, self.logs = {}, {}
        self.killed = set()  # what the test killed on purpose
        self.client_ep = {r: f"tcp://127.0.0.1:{free_port()}" for r in "AB"}
        self.node_ep = {r: f"tcp://127.0.0.1:{free_port()}" for r in "AB"}
        self.http = {r: free_port() for r in "AB"}
        kv = f"tcp://127.0.0.1:{free_port()}"
        self.config = {}
        for r in "AB":
            self.config[r] = os.path.join(tmp_dir, f"router-{r}.yaml")
            with open(self.config[r], "w") as f:
                f.write(f"model:\n  path: {MODEL}\n"
                        f"router:\n  client_endpoint: {self.client_ep[r]}\n"
                        f"  node_endpoint: {self.node_ep[r]}\n"
                        f"  node_endpoints: [{self.node_ep['A']}, {self.node_ep['B']}]\n"
                        f"  http_port: {self.http[r]}\n"
                        "nodes:\n"
                        "  - id: prefill-0\n    role: prefill\n    threads: 1\n"
                        "    memory_budget: 768MiB\n"
                        "  - id: decode-0\n    role: decode\n    threads: 1\n"
                        f"    memory_budget: {decode_budget}\n    kv_endpoint: {kv}\n")

    def spawn(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.logs[name] = log.name

    def start(self):
        for r in "AB":
            self.spawn(f"router-{r}", [BINARIES["router"], "--config", self.config[r]])
        self.spawn("prefill-0", [BINARIES["prefill"], "--config", self.config["A"],
                                 "--node-id", "prefill-0"])
        self.spawn("decode-0", [BINARIES["decode"], "--config", self.config["A"],
                                "--node-id", "decode-0"])
        for r in "AB":
            self.wait_nodes(r, lambda n: all(n.get(i) and n[i].up
                                             for i in ("prefill-0", "decode-0")), 120)
        return self

    def nodes(self, r):
        c = Client(self.client_ep[r])
        try:
            return {n.node_id: n for n in c.status().nodes}
        finally:
            c.close()

    def wait_nodes(self, r, pred, timeout_s):
        """Polls router r's node table until pred(table) holds; returns the table."""
        end = time.time() + timeout_s
        last = None
        while time.time() < end:
            for name, p in self.procs.items():
                if p.poll() is not None and name not in self.killed:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.tail(name)}")
            try:
                last = self.nodes(r)
                if pred(last):
                    return last
            except TimeoutError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"router {r}: condition not met within {timeout_s} s: "
                             f"{ {k: (v.up, v.load.kv_blocks_used, v.load.running) for k, v in (last or {}).items()} }\n"
                             + "\n".join(self.tail(n) for n in self.procs))

    def tail(self, name, n=30):
        try:
            with open(self.logs[name]) as f:
                return f"--- {name} ---\n" + "".join(f.readlines()[-n:])
        except OSError:
            return f"--- {name} --- (no log)\n"

    def log_text(self, name):
        with open(self.logs[name]) as f:
            return f.read()

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs.values():
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {name: p.returncode for name, p in self.procs.items()}


def idle(nodes):
    """No KV block in use (the prefix cache aside) and nothing running or waiting on either
    node."""
    return all(n.up and n.load.kv_blocks_used == 0 and n.load.running == 0
               and n.load.waiting == 0 for n in nodes.values())


def http_stream(port, max_tokens):
    """An open streaming /v1/completions response (its socket's timeout 120 s)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    body = json.dumps({"prompt": "Count from one to one thousand: one, two, three,",
                       "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
                       "temperature": 0})
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def read_event(resp):
    """The next SSE data line of resp ("" at EOF)."""
    while True:
        line = resp.fp.readline()
        if not line:
            return ""
        if line.startswith(b"data: "):
            return line[6:].decode().strip()


def test_two_routers_serve_the_pool_and_survive_kill_of_one(tmp_path):
    rs = Routers(str(tmp_path)).start()
    try:
        # both routers serve the one pool: a request through each completes
        for r in "AB":
            c = Client(rs.client_ep[r])
            try:
                res = c.generate(prompt_request("The capital of France is", max_tokens=8,
                                                temperature=0.0), timeout_s=120)
            finally:
                c.close()
            assert res.status == "OK", (r, res)
            assert len(res.token_ids) == 8, (r, res)

        # load through both: long HTTP streams through A (they outlive the kill), shorter
        # native streams through B; each has produced a token before A is killed
        a_streams = [http_stream(rs.http["A"], 4000) for _ in range(2)]
        for _, resp in a_streams:
            assert read_event(resp), "a stream through router A ended before its first token"
        cb = Client(rs.client_ep["B"])
        results = {}
        for i in range(3):
            call = cb.start(prompt_request(f"Story number {i}: once upon a time", max_tokens=48,
                                           ignore_eos=True, temperature=0.0))
            results[call] = Result()
        started = set()

        def on_chunk(call_id, r, ch):
            started.add(call_id)
            if len(started) == len(results) and "router-A" not in rs.killed:
                rs.killed.add("router-A")
                rs.procs["router-A"].send_signal(signal.SIGKILL)  # under load
                rs.procs["router-A"].wait(timeout=60)

        cb.collect(results, timeout_s=300, on_chunk=on_chunk)
        cb.close()
        assert rs.procs["router-A"].poll() == -signal.SIGKILL, "router A was not killed"
        # requests through the other router all complete
        for call, res in results.items():
            assert res.status == "OK", res
            assert len(res.token_ids) == 48, res

        # clients of the killed router: the HTTP stream's socket closes (EOF or reset), long
        # before its 120 s socket timeout and its 4000 tokens
        for conn, resp in a_streams:
            t0 = time.time()
            ended = False
            try:
                while read_event(resp) not in ("", "[DONE]"):
                    pass
                ended = True
            except (ConnectionError, http.client.IncompleteRead):
                ended = True
            assert ended and time.time() - t0 < 100, "router A's stream did not close"
            conn.close()

        # the nodes free router A's requests once they take it for gone (5 s of silence;
        # waited for with a generous deadline): 0 KV blocks in use, nothing running
        nodes = rs.wait_nodes("B", idle, 90)
        assert nodes["decode-0"].load.kv_blocks_used == 0
        assert "taken for gone" in rs.log_text("decode-0"), rs.tail("decode-0")
        assert re.search(r"dropped: dispatched by router instance [0-9a-f]+, which is gone",
                         rs.log_text("decode-0")), rs.tail("decode-0")

        # router B still serves after A's death
        c = Client(rs.client_ep["B"])
        try:
            res = c.generate(prompt_request("Hello", max_tokens=4, temperature=0.0),
                             timeout_s=120)
        finally:
            c.close()
        assert res.status == "OK", res
    finally:
        codes = rs.stop()
    assert all(rc == 0 for n, rc in codes.items() if n != "router-A"), (
        codes, [rs.tail(n) for n in codes])


def test_native_client_sends_a_request_not_yet_started_to_the_next_router(tmp_path):
    """`tandem chat --router B,X` with two turns, where X is a stand-in router that answers the
    health probe and takes the first Generate it gets, then closes its socket without answering
    (what a router killed before the first token looks like to the client): that turn goes to B
    and completes there, and so does the chat. Round robin sends one of the two turns to X
    whichever router the probe went to (each went out once the one before had ended)."""
    rs = Routers(str(tmp_path))
    rs.spawn("router-B", [BINARIES["router"], "--config", rs.config["B"]])
    rs.spawn("prefill-0", [BINARIES["prefill"], "--config", rs.config["B"], "--node-id",
                           "prefill-0"])
    rs.spawn("decode-0", [BINARIES["decode"], "--config", rs.config["B"], "--node-id",
                          "decode-0"])
    ctx = zmq.Context.instance()
    fake = ctx.socket(zmq.ROUTER)
    fake.setsockopt(zmq.LINGER, 0)
    fake_ep = f"tcp://127.0.0.1:{free_port()}"
    fake.bind(fake_ep)
    p = None
    try:
        rs.wait_nodes("B", lambda n: all(n.get(i) and n[i].up
                                         for i in ("prefill-0", "decode-0")), 120)
        lines = os.path.join(str(tmp_path), "chat.txt")
        with open(lines, "w") as f:
            f.write("What is the capital of France?\nAnd of Italy?\n")
        with open(lines) as stdin:
            p = subprocess.Popen([BINARIES["tandem"], "chat", "--router",
                                  f"{rs.client_ep['B']},{fake_ep}", "--timeout", "120", "-n",
                                  "8", "--temperature", "0"],
                                 stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        while True:
            assert fake.poll(120 * 1000), "no Generate reached the second router"
            parts = fake.recv_multipart()  # [identity, header, body]
            h = pb.FrameHeader()
            h.ParseFromString(parts[1])
            if h.method == pb.METHOD_GENERATE:
                break
            # the health probe, had B's connection not been up yet when it went: answered
            assert h.method == pb.METHOD_HEALTH, h
            end = pb.FrameHeader()
            end.version_major, end.version_minor = h.version_major, h.version_minor
            end.kind, end.method, end.call_id = pb.FRAME_KIND_END, h.method, h.call_id
            fake.send_multipart([parts[0], end.SerializeToString(),
                                 pb.HealthResponse(live=True, ready=True).SerializeToString()])
        fake.close(linger=0)  # the connection drops: nothing of that turn was delivered
        out, err = p.communicate(timeout=240)
        assert p.returncode == 0, err.decode()
        answers = [ln for ln in out.decode().splitlines() if ln.strip()]
        assert len(answers) >= 2, (out.decode(), err.decode())
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        if not fake.closed:
            fake.close(linger=0)
        rs.stop()


def metric_sum(port, name):
    """The sum of every sample of counter `name` on the router's /metrics at port."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
    finally:
        conn.close()
    total = 0.0
    for line in text.splitlines():
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", line)
        if m:
            total += float(m.group(2))
    return total


def test_two_routers_reserving_at_once_never_over_commit_the_decode_pool(tmp_path):
    """Both routers see the whole decode pool free in the heartbeats and dispatch more prompt
    blocks than it holds at once: the decode node refuses what does not fit
    (RESOURCE_EXHAUSTED, counted by the routers), never holds more blocks than it has, and every
    request still completes (the routers queue and retry)."""
    # a pool of one full context and a little more (~600 blocks): few prompts fill it
    rs = Routers(str(tmp_path), decode_budget="340MiB").start()
    try:
        total = rs.nodes("A")["decode-0"].kv_blocks_total
        prompt_tokens = 480  # about: 30 blocks of 16 tokens each
        n = min(64, (3 * total) // (2 * (prompt_tokens // 16 + 2)) + 2)
        clients = {r: Client(rs.client_ep[r]) for r in "AB"}
        results = {r: {} for r in "AB"}
        for i in range(n):
            r = "AB"[i % 2]
            # a distinct first word: no prefix shared between the prompts' blocks
            prompt = f"{i} " + "apple banana cherry " * (prompt_tokens // 3)
            call = clients[r].start(prompt_request(prompt, max_tokens=8, ignore_eos=True,
                                                   temperature=0.0))
            results[r][call] = Result()
        peak = {"used": 0}
        done = {"stop": False}

        def watch():
            while not done["stop"]:
                try:
                    d = rs.nodes("B")["decode-0"]
                    peak["used"] = max(peak["used"], d.load.kv_blocks_used)
                    assert d.load.kv_blocks_used <= d.kv_blocks_total
                except TimeoutError:
                    pass
                time.sleep(0.02)

        t = threading.Thread(target=watch, daemon=True)
        t.start()
        try:
            for r in "AB":
                clients[r].collect(results[r], timeout_s=600)
        finally:
            done["stop"] = True
            t.join(timeout=60)
        for c in clients.values():
            c.close()
        for r in "AB":
            for res in results[r].values():
                assert res.status == "OK", (r, res)
                assert len(res.token_ids) == 8, (r, res)
        assert peak["used"] <= total
        refused = sum(metric_sum(rs.http[r], "tandem_decode_reserve_rejections_total")
                      for r in "AB")
        print(f"pool {total} blocks, {n} requests, peak {peak['used']} blocks in use, "
              f"{refused:.0f} reservations refused")
        assert refused > 0, (f"{n} requests of ~{prompt_tokens} tokens through two routers "
                             f"never filled a pool of {total} blocks")
        rs.wait_nodes("A", idle, 90)
    finally:
        codes = rs.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [rs.tail(n) for n in codes])
