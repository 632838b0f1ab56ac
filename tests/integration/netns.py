"""netns.py - a multi-host harness for the integration tests (issue 13): each daemon of a
cluster in its own Linux network namespace, with its own address, so that every node and KV
link crosses a real (virtual) network instead of loopback.

Topology, for namespaces named ROLE (router, prefill-0, decode-0, ...):

    tdm<pid>-hub      a bridge br0; one veth port per namespace, one for the host
    tdm<pid>-ROLE     eth0 = 10.213.X.i/24 (i = 1, 2, ...), lo up
    host (this test)  tdm<pid>h = 10.213.X.254/24, so the test reaches every daemon

The bridge sits in a namespace of its own (not the host's), so the host's bridge netfilter
settings do not apply to it. Everything is removed by close(), which the fixtures call even
when a test fails; namespaces left behind by a run that was killed (their creator's pid is
gone) are removed by the next one. Needs root and iproute2 (`ip`, scripts/setup installs it);
available() says why not, for the skip.
"""
import os
import re
import shutil
import subprocess

from conftest import BINARIES, MODEL, Cluster, free_port
from tandem_client import Client

PREFIX = "tdm"


def ip(*args, check=True):
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def available():
    """None when namespaces can be made here, else why not (the skip reason)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    if not shutil.which("ip"):
        return "no `ip` command (iproute2; scripts/setup installs it)"
    name = f"{PREFIX}{os.getpid()}-probe"
    r = ip("netns", "add", name, check=False)
    if r.returncode != 0:
        return f"cannot create a network namespace: {r.stderr.strip()}"
    ip("netns", "del", name, check=False)
    return None


def remove_stale():
    """Deletes namespaces and host links of earlier runs whose process is gone."""
    r = ip("netns", "list", check=False)
    for line in r.stdout.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            ip("netns", "del", m.group(1), check=False)
    for m in re.finditer(rf"^\d+: ({PREFIX}(\d+)h)[@:]", ip("-o", "link", check=False).stdout,
                         re.M):
        if not os.path.exists(f"/proc/{m.group(2)}"):
            ip("link", "del", m.group(1), check=False)


def pick_subnet():
    """A 10.213.X.0/24 no route of this host uses (X from the pid, then the next free one)."""
    used = ip("-4", "route", "show", "table", "all", check=False).stdout
    for k in range(250):
        x = (os.getpid() + k) % 250
        if f"10.213.{x}." not in used:
            return f"10.213.{x}"
    raise RuntimeError("no free 10.213.X.0/24 subnet")


class Netns:
    """Namespaces for roles (list of names), one address each; host_addr is the host's."""

    def __init__(self, roles):
        remove_stale()
        self.tag = f"{PREFIX}{os.getpid()}"
        self.hub = f"{self.tag}-hub"
        self.host_link = f"{self.tag}h"
        self.made = []
        self.subnet = pick_subnet()
        self.host_addr = f"{self.subnet}.254"
        self.addr = {}
        try:
            self._make_hub()
            for i, role in enumerate(roles, start=1):
                self._make_ns(role, f"{self.subnet}.{i}", i)
        except Exception:
            self.close()
            raise

    def ns(self, role):
        return f"{self.tag}-{role}"

    def _make_hub(self):
        ip("netns", "add", self.hub)
        self.made.append(self.hub)
        ip("-n", self.hub, "link", "set", "lo", "up")
        ip("-n", self.hub, "link", "add", "br0", "type", "bridge")
        ip("-n", self.hub, "link", "set", "br0", "up")
        ip("link", "add", self.host_link, "type", "veth", "peer", "name", "host",
           "netns", self.hub)
        ip("-n", self.hub, "link", "set", "host", "master", "br0", "up")
        ip("addr", "add", f"{self.host_addr}/24", "dev", self.host_link)
        ip("link", "set", self.host_link, "up")

    def _make_ns(self, role, addr, i):
        name = self.ns(role)
        ip("netns", "add", name)
        self.made.append(name)
        ip("link", "add", f"port{i}", "netns", self.hub, "type", "veth", "peer", "name", "eth0",
           "netns", name)
        ip("-n", self.hub, "link", "set", f"port{i}", "master", "br0", "up")
        ip("-n", name, "addr", "add", f"{addr}/24", "dev", "eth0")
        ip("-n", name, "link", "set", "eth0", "up")
        ip("-n", name, "link", "set", "lo", "up")
        self.addr[role] = addr

    def exec_argv(self, role, argv):
        """argv run inside role's namespace."""
        return ["ip", "netns", "exec", self.ns(role)] + list(argv)

    def close(self):
        """Removes the host link and every namespace (their veths go with them); idempotent.
        Processes still running in them must be stopped first (a namespace with a process in
        it only disappears from the list)."""
        ip("link", "del", self.host_link, check=False)
        for name in reversed(self.made):
            ip("netns", "del", name, check=False)
        self.made = []


API_KEY = "netns-test-key-0123456789"


class NetnsCluster(Cluster):
    """A Cluster whose router and nodes each run in their own namespace of net (a Netns with
    the roles "router", "prefill-N", "decode-N"), binding their namespace's address. CURVE
    keys for every daemon (`tandem keys generate`) and router.api_keys, as the trust rules
    require for non-loopback binds (docs/operations.md "security"). kv_advertise: per decode
    node, the endpoint the prefill nodes connect to instead of its kv_endpoint (a proxy)."""

    def __init__(self, tmp_dir, net, n_prefill=1, n_decode=1, kv_advertise=None,
                 extra_router="", extra="", memory_budget="768MiB", threads=1):
        self.dir = tmp_dir
        os.makedirs(tmp_dir, exist_ok=True)
        self.net = net
        self.api_key = API_KEY
        r = net.addr["router"]
        self.client_ep = f"tcp://{r}:7600"
        self.node_ep = f"tcp://{r}:7601"
        self.http_addr, self.http_port = r, 8000
        self.procs, self.logs = {}, {}
        self.prefill_ids = [f"prefill-{i}" for i in range(n_prefill)]
        self.decode_ids = [f"decode-{i}" for i in range(n_decode)]
        kv_advertise = kv_advertise or {}
        nodes = []
        for nid in self.prefill_ids:
            nodes.append(f"  - id: {nid}\n    role: prefill\n    threads: {threads}\n"
                         f"    memory_budget: {memory_budget}\n")
        for nid in self.decode_ids:
            adv = f"    kv_advertise: {kv_advertise[nid]}\n" if nid in kv_advertise else ""
            nodes.append(f"  - id: {nid}\n    role: decode\n    threads: {threads}\n"
                         f"    memory_budget: {memory_budget}\n"
                         f"    kv_endpoint: {self.kv_endpoint(nid)}\n{adv}")
        self.config = os.path.join(tmp_dir, "cluster.yaml")
        with open(self.config, "w") as f:
            f.write(f"model:\n  path: {MODEL}\n"
                    f"router:\n  client_endpoint: {self.client_ep}\n"
                    f"  node_endpoint: {self.node_ep}\n"
                    f"  http_address: {r}\n  http_port: {self.http_port}\n"
                    f"  api_keys: [\"{API_KEY}\"]\n{extra_router}"
                    f"{extra}nodes:\n" + "".join(nodes))
        self.keys = add_keys(self)

    def kv_endpoint(self, nid):
        return f"tcp://{self.net.addr[nid]}:7610"

    def _spawn(self, name, argv):
        role = "router" if name == "router" else name
        super()._spawn(name, self.net.exec_argv(role, argv))

    def client(self, **kw):
        kw.setdefault("api_key", self.api_key)
        return Client(self.client_ep, **kw)


def add_keys(cluster):
    """Generates the key pairs of cluster's config (`tandem keys generate`) and pastes the
    YAML it prints into the config. Returns the keys folder."""
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


__all__ = ["Netns", "NetnsCluster", "available", "free_port"]
