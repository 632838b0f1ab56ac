"""Fixtures for the cluster integration tests: a Cluster runs tandem-router and the node
daemons as separate processes on loopback, from a generated config, and stops them at the end.

Environment: TDM_BUILD_DIR (the CMake build tree; ctest sets it), TDM_SOURCE_DIR, and the
default model from scripts/setup (or $TANDEM_MODEL).
"""
import atexit
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from tandem_client import Client

BUILD_DIR = os.environ.get(
    "TDM_BUILD_DIR", os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", "build"))
)
BINARIES = {
    "router": os.path.join(BUILD_DIR, "router", "tandem-router"),
    "prefill": os.path.join(BUILD_DIR, "prefill-node", "tandem-prefill"),
    "decode": os.path.join(BUILD_DIR, "decode-node", "tandem-decode"),
    "tandem": os.path.join(BUILD_DIR, "client", "tandem"),
}


def default_model():
    if os.environ.get("TANDEM_MODEL"):
        return os.environ["TANDEM_MODEL"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ["HOME"], ".cache")
    return os.path.join(cache, "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


MODEL = default_model()

# Keys by default (docs/operations.md): every daemon of a config without CURVE keys takes its
# pair from $XDG_STATE_HOME/tandem/keys, making the missing ones at first start. The tests get
# a key directory of their own (so they neither read nor write the user's), shared by every
# cluster of the session: each cluster's daemons start at once and agree on one pair per id.
STATE_HOME = tempfile.mkdtemp(prefix="tandem-test-state-")
os.environ["XDG_STATE_HOME"] = STATE_HOME
atexit.register(shutil.rmtree, STATE_HOME, True)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Cluster:
    """1 router + n_prefill prefill nodes + n_decode decode nodes, each its own process.
    default_keys: CURVE with keys by default, as a user's cluster runs (the node and KV
    channels encrypted); False writes security.default_keys: false, for the tests that speak
    ZMTP to the router as a node themselves or change KV bytes in flight (test_trust.py,
    test_kv_faults.py): CURVE would refuse or drop those before the checks they test."""

    def __init__(self, tmp_dir, n_prefill=1, n_decode=1, policy="round_robin",
                 memory_budget="768MiB", extra_router="", threads=1, extra_decode="",
                 model=None, chat_template=None, default_keys=True, extra_model=""):
        self.dir = tmp_dir
        os.makedirs(tmp_dir, exist_ok=True)
        self.client_ep = f"tcp://127.0.0.1:{free_port()}"
        self.node_ep = f"tcp://127.0.0.1:{free_port()}"
        self.procs = {}
        self.logs = {}
        self.prefill_ids = [f"prefill-{i}" for i in range(n_prefill)]
        self.decode_ids = [f"decode-{i}" for i in range(n_decode)]
        nodes = []
        for nid in self.prefill_ids:
            nodes.append(f"  - id: {nid}\n    role: prefill\n    threads: {threads}\n"
                         f"    memory_budget: {memory_budget}\n")
        for nid in self.decode_ids:
            nodes.append(f"  - id: {nid}\n    role: decode\n    threads: {threads}\n"
                         f"    memory_budget: {memory_budget}\n"
                         f"    kv_endpoint: tcp://127.0.0.1:{free_port()}\n{extra_decode}")
        self.config = os.path.join(tmp_dir, "cluster.yaml")
        with open(self.config, "w") as f:
            f.write(f"model:\n  path: {model or MODEL}\n"
                    + (f"  chat_template: {chat_template}\n" if chat_template else "")
                    + extra_model +
                    f"router:\n  client_endpoint: {self.client_ep}\n"
                    f"  node_endpoint: {self.node_ep}\n"
                    f"  http_port: {free_port()}\n"
                    f"  prefill_policy: {policy}\n{extra_router}"
                    + ("" if default_keys else "security:\n  default_keys: false\n") +
                    "nodes:\n" + "".join(nodes))

    def _spawn(self, name, argv):
        log = open(os.path.join(self.dir, f"{name}.log"), "w")
        env = dict(os.environ, OMP_WAIT_POLICY="passive")
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        self.logs[name] = log.name

    def start(self, timeout_s=90):
        self._spawn("router", [BINARIES["router"], "--config", self.config])
        for nid in self.prefill_ids:
            self._spawn(nid, [BINARIES["prefill"], "--config", self.config, "--node-id", nid])
        for nid in self.decode_ids:
            self._spawn(nid, [BINARIES["decode"], "--config", self.config, "--node-id", nid])
        self.wait_up(self.prefill_ids + self.decode_ids, timeout_s)
        return self

    def start_node(self, nid, timeout_s=60):
        binary = BINARIES["prefill" if nid.startswith("prefill") else "decode"]
        self._spawn(nid, [binary, "--config", self.config, "--node-id", nid])
        self.wait_up([nid], timeout_s)

    def client(self, **kw):
        return Client(self.client_ep, **kw)

    def nodes(self):
        c = self.client()
        try:
            return {n.node_id: n for n in c.status().nodes}
        finally:
            c.close()

    def wait_up(self, ids, timeout_s):
        end = time.time() + timeout_s
        last = None
        while time.time() < end:
            for name, p in self.procs.items():
                if p.poll() is not None and name in ids + ["router"]:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.tail(name)}")
            try:
                nodes = self.nodes()
                last = {k: v.up for k, v in nodes.items()}
                if all(i in nodes and nodes[i].up for i in ids):
                    return
            except TimeoutError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"cluster not up after {timeout_s} s: {last}\n" +
                           "\n".join(self.tail(n) for n in self.procs))

    def wait_idle(self, timeout_s=1.0):
        """Waits until no node up has KV blocks in use (the prefix cache does not count) or
        sequences running or waiting, as its heartbeats report them; returns the node table,
        or fails with the last one seen. The figures lag the nodes by a heartbeat (250 ms),
        so the wait is at least 30 s whatever timeout_s says: a busy machine delays them."""
        wait_s = max(timeout_s, 30.0)
        end = time.time() + wait_s
        used = None
        while True:
            try:
                nodes = self.nodes()
            except TimeoutError:  # a Status call that a busy router answered late: ask again
                nodes = None
            if nodes is not None:
                used = {k: (v.load.kv_blocks_used, v.load.running, v.load.waiting)
                        for k, v in nodes.items() if v.up}
                if all(u == (0, 0, 0) for u in used.values()):
                    return nodes
            if time.time() > end:
                raise AssertionError(f"KV blocks still in use after {wait_s} s "
                                     f"(kv_blocks_used, running, waiting): {used}")
            time.sleep(0.05)

    def kill(self, name, sig=signal.SIGKILL):
        p = self.procs[name]
        p.send_signal(sig)
        p.wait(timeout=60)  # SIGTERM: a graceful stop may be slow on a busy machine

    def tail(self, name, n=30):
        try:
            with open(self.logs[name]) as f:
                lines = f.readlines()[-n:]
        except OSError:
            lines = []
        return f"--- {name} ---\n" + "".join(lines)

    def stop(self):
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for name, p in self.procs.items():
            try:
                # a graceful stop, however slow a busy machine makes it: a daemon killed
                # here exits non-zero and fails the test that checks the exit codes
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return {name: p.returncode for name, p in self.procs.items()}


def http_port(cluster):
    """The router.http_port this file wrote into the cluster's config."""
    with open(cluster.config) as f:
        m = re.search(r"^\s*http_port:\s*(\d+)\s*$", f.read(), re.M)
    assert m, "no http_port in the cluster config"
    return int(m.group(1))


def http_cluster(tmp_path_factory, name, **kw):
    """A started Cluster (1 prefill + 1 decode unless kw says otherwise) with .port set to its
    HTTP port, for a module-scoped fixture to yield from; every daemon must exit 0 at the end."""
    kw.setdefault("n_prefill", 1)
    kw.setdefault("n_decode", 1)
    c = Cluster(str(tmp_path_factory.mktemp(name)), **kw)
    c.start()
    c.port = http_port(c)
    yield c
    codes = c.stop()
    assert all(rc == 0 for rc in codes.values()), (codes, [c.tail(n) for n in codes])


def openai_client(cluster, timeout):
    """An `openai` package client of cluster's HTTP gateway (cluster.port, as http_cluster sets
    it) that never retries and gives up after timeout seconds per request, for a module-scoped
    fixture to yield from; closed at the end."""
    import openai  # only the tests that use the client need the package
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{cluster.port}/v1", api_key="unused",
                           max_retries=0, timeout=timeout)
    yield client
    client.close()


def reference(prompt=None, chat=None, max_tokens=16, temperature=0.0, seed=None, extra=(),
              model=None):
    """The in-process output of `tandem generate -m MODEL` for the same request (stdout)."""
    argv = [BINARIES["tandem"], "generate", "-m", model or MODEL, "-n", str(max_tokens), "-t", "1",
            "--temperature", str(temperature)]
    if seed is not None:
        argv += ["--seed", str(seed)]
    if prompt is not None:
        argv += ["-p", prompt]
    else:
        argv += ["--chat", chat]
    argv += list(extra)
    out = subprocess.run(argv, capture_output=True, check=True,
                         env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    text = out.stdout.decode("utf-8")
    assert text.endswith("\n")
    return text[:-1]


@pytest.fixture(scope="session", autouse=True)
def _check_environment():
    for name, path in BINARIES.items():
        if not os.path.exists(path):
            pytest.fail(f"{name} binary missing: {path} (build first; TDM_BUILD_DIR={BUILD_DIR})")
    if not os.path.exists(MODEL):
        pytest.fail(f"default model missing: {MODEL} (run scripts/setup)")
