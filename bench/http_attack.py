#!/usr/bin/env python3
"""bench/http_attack.py - the router's HTTP front under attack (issue 32): probe latency while
a slowloris holds the connection table, and the cost of holding 10,000 connections.

A local cluster (one prefill node, one decode node, the default model) is started twice:

  cluster A  the router's HTTP defaults (http_max_connections 1000, 64 per address, headers
             within 10 s, idle keep-alive 30 s)
     baseline   N probes (GET /health) and M one-token completions (POST /v1/completions,
                max_tokens 1, temperature 0), one after the other, each on a fresh connection
                from 127.0.0.1; latency p50/p90/p99
     slowloris  S connections (default 1,000) from 200 source addresses (127.0.0.2 ..
                127.0.0.201; the client socket is bound to its source address), each sending a
                partial request header one byte at a time, a byte every few seconds; one the
                router answers (408 at the header deadline, or when evicted for a newer
                connection) or closes is counted and opened again at once, so S stay pressing
                all the time. While they are held the baseline probes run again: ratios
                attack / baseline of p50 and p99, and the probes that failed (must be 0)
  cluster B  http_max_connections 10000, http_header_timeout_s and http_connection_timeout_s
             600 (so that held connections are not timed out during the measurement)
     hold       H connections (default 10,000) from 200 addresses, held idle, twice: first
                with no header sent ("headerless": the router's own accept loop holds them),
                then each after one whole keep-alive request (GET /health, answered; idle in
                libmicrohttpd). Per kind: router RSS (VmRSS) and open fds before, while held and
                after release, bytes and fds per held connection, probe latencies while held
                against the baseline of cluster B taken just before

The router raises its RLIMIT_NOFILE to 2 x http_max_connections + 256 = 20,256 for cluster B
and refuses to start without it; this process raises its own soft limit to 32,768 (the hard one
too where allowed: CAP_SYS_RESOURCE), which the daemons inherit. Under a lower hard limit the
hold is the most the router takes: (hard - 256) / 2 connections (9,872 under 20,000).

Prints a table; writes JSON to bench/results/http-attack-DATE.json with the machine (CPU model,
avx2 / avx512_vnni / amx flags) beside every figure. Only the standard library. Every process
started is stopped by its pid (`tandem cluster down --pid-file`), on failure too.

usage: bench/http_attack.py [--build build] [--model FILE] [--probes 200] [--completions 40]
                            [--slow 1000] [--hold 10000] [--addresses 200] [--json FILE]
"""
import argparse
import datetime
import http.client
import json
import os
import resource
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")
DEFAULT_MODEL = os.path.join(CACHE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
PROMPT = "The capital of France is"
NOFILE = 32768


def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def machine():
    name, flags = "?", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == "?":
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = [x for x in ("avx2", "avx512_vnni", "amx_tile", "amx_int8") if x in flags]
    return {"cpu": name, "cpus": os.cpu_count(), "isa": isa,
            "label": f"{name}, {os.cpu_count()} CPUs, " + "/".join(isa or ["no avx2"])}


def raise_nofile():
    """Soft limit up to NOFILE, the hard one too where allowed (root with CAP_SYS_RESOURCE)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, NOFILE), max(hard, NOFILE)))
    except (ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, NOFILE)), hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)


def addresses(n):
    return [f"127.0.0.{2 + i}" for i in range(n)]


# --- the cluster --------------------------------------------------------------------------

class Cluster:
    """`tandem cluster up --detach`: one prefill, one decode node; stop() by the pid file."""

    def __init__(self, args, work, name, router_extra):
        self.tandem = os.path.join(args.build, "client", "tandem")
        self.port = free_port()
        budget = 2 * os.path.getsize(args.model) + (1 << 30)
        conf = os.path.join(work, name + ".yaml")
        with open(conf, "w") as f:
            f.write(f"model:\n  path: {args.model}\n  name: bench\n")
            f.write(f"router:\n  client_endpoint: tcp://127.0.0.1:{free_port()}\n")
            f.write(f"  node_endpoint: tcp://127.0.0.1:{free_port()}\n  http_port: {self.port}\n")
            f.write(router_extra)
            f.write("nodes:\n")
            f.write(f"  - {{id: prefill-0, role: prefill, threads: 1, memory_budget: {budget}}}\n")
            f.write(f"  - {{id: decode-0, role: decode, threads: 1, memory_budget: {budget}, "
                    f"kv_endpoint: tcp://127.0.0.1:{free_port()}}}\n")
        self.pids = os.path.join(work, name + ".pids")
        self.logs = os.path.join(work, "logs-" + name)
        self.stopped = False
        up = subprocess.run([self.tandem, "cluster", "up", "--config", conf, "--detach",
                             "--pid-file", self.pids, "--log-dir", self.logs],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if up.returncode != 0:
            self.stopped = True
            raise RuntimeError(f"tandem cluster up: {up.stderr.strip()[-600:]}")
        self.router_pid = None
        with open(self.pids) as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3 and "router" in parts[1]:
                    self.router_pid = int(parts[0])
        try:
            wait_ready(self.port, 180)
        except Exception:
            self.stop()
            raise

    def stop(self):
        if self.stopped:
            return
        self.stopped = True
        subprocess.run([self.tandem, "cluster", "down", "--pid-file", self.pids],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def rss(self):
        with open(f"/proc/{self.router_pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def fds(self):
        return len(os.listdir(f"/proc/{self.router_pid}/fd"))


def wait_ready(port, timeout_s):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if probe(port, "GET", "/v1/models")[0] == 200:
                # a completion too: both nodes registered
                if probe(port, "POST", "/v1/completions", completion_body())[0] == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"cluster on :{port} not serving within {timeout_s} s")


def completion_body():
    return json.dumps({"model": "bench", "prompt": PROMPT, "max_tokens": 1, "temperature": 0})


def probe(port, method, path, body=None, timeout=60):
    """One request on a fresh connection from 127.0.0.1. Returns (status, seconds)."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout,
                                   source_address=("127.0.0.1", 0))
    t0 = time.monotonic()
    try:
        c.request(method, path, body, {"Content-Type": "application/json"} if body else {})
        r = c.getresponse()
        r.read()
        return r.status, time.monotonic() - t0
    finally:
        c.close()


def probes(port, n_health, n_completions, until=None):
    """n_health GET /health, then n_completions one-token completions, one at a time; rounds
    of both again until the monotonic time `until` has passed."""
    out, acc = {}, {}
    while True:
        for name, method, path, body, n in (("health", "GET", "/health", None, n_health),
                                            ("completion", "POST", "/v1/completions",
                                             completion_body(), n_completions)):
            lat, statuses = acc.setdefault(name, ([], {}))
            for _ in range(n):
                try:
                    st, dt = probe(port, method, path, body)
                except OSError as e:
                    st, dt = type(e).__name__, None
                statuses[str(st)] = statuses.get(str(st), 0) + 1
                if st == 200:
                    lat.append(dt * 1000)
        if until is None or time.monotonic() >= until:
            break
    for name, (lat, statuses) in acc.items():
        n = sum(statuses.values())
        failed = n - statuses.get("200", 0)
        out[name] = {"n": n, "failed": failed, "statuses": statuses,
                     "ms": {"p50": pct(lat, 50), "p90": pct(lat, 90), "p99": pct(lat, 99),
                            "max": max(lat) if lat else float("nan")}}
    return out


def ratios(attack, base):
    return {k: {p: attack[k]["ms"][p] / base[k]["ms"][p] for p in ("p50", "p99")}
            for k in ("health", "completion")}


# --- slowloris ----------------------------------------------------------------------------

SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: "


class Slowloris:
    """n connections from the given addresses, each sending SLOW_HEAD then 'a's, one byte per
    `interval` s; one answered or closed by the router is counted and reopened."""

    def __init__(self, port, n, addrs, interval):
        self.port, self.n, self.addrs, self.interval = port, n, addrs, interval
        self.ep = select.epoll()
        self.conns = {}  # fd -> [sock, addr, bytes sent, next send time, buffer]
        self.answers = {}  # status -> count
        self.closed_unanswered = 0
        self.reopened = 0
        self.connect_errors = 0
        self.bytes_sent = 0
        self.stop_ev = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def open_one(self, addr, stagger):
        s = socket.socket()
        try:
            s.bind((addr, 0))
            s.settimeout(10)
            s.connect(("127.0.0.1", self.port))
        except OSError:
            s.close()
            self.connect_errors += 1
            return
        s.setblocking(False)
        self.conns[s.fileno()] = [s, addr, 0, time.monotonic() + stagger, b""]
        self.ep.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)

    def start(self):
        for i in range(self.n):
            self.open_one(self.addrs[i % len(self.addrs)], self.interval * i / self.n)
        self.thread.start()

    def held(self):
        with self.lock:
            return len(self.conns)

    def finish(self, fd):
        s, addr, _, _, buf = self.conns.pop(fd)
        self.ep.unregister(fd)
        if buf.startswith(b"HTTP/1."):
            st = buf.split(b" ")[1].decode()
            self.answers[st] = self.answers.get(st, 0) + 1
        else:
            self.closed_unanswered += 1
        s.close()
        return addr

    def loop(self):
        while not self.stop_ev.is_set():
            events = self.ep.poll(0.05)
            with self.lock:
                reopen = []
                for fd, ev in events:
                    c = self.conns.get(fd)
                    if c is None:
                        continue
                    try:
                        b = c[0].recv(65536)
                    except BlockingIOError:
                        continue
                    except OSError:
                        b = b""
                    if b:
                        c[4] += b
                        continue  # read until the router closes (lingering close)
                    reopen.append(self.finish(fd))
                now = time.monotonic()
                for fd, c in list(self.conns.items()):
                    if now < c[3]:
                        continue
                    byte = SLOW_HEAD[c[2]:c[2] + 1] or b"a"
                    try:
                        c[0].send(byte)
                        c[2] += 1
                        self.bytes_sent += 1
                    except OSError:
                        pass
                    c[3] = now + self.interval
                for addr in reopen:
                    self.open_one(addr, 0)
                    self.reopened += 1

    def stop(self):
        self.stop_ev.set()
        if self.thread.is_alive():
            self.thread.join()
        for c in self.conns.values():
            c[0].close()
        self.conns.clear()
        self.ep.close()


# --- hold ---------------------------------------------------------------------------------

def open_hold(port, n, addrs, keepalive):
    """n connections from addrs (round robin); with keepalive each sends one GET /health and
    reads its answer, leaving the connection idle. Returns (sockets, failures)."""
    socks, failed = [], 0
    req = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    for i in range(n):
        s = socket.socket()
        try:
            s.bind((addrs[i % len(addrs)], 0))
            s.settimeout(30)
            s.connect(("127.0.0.1", port))
            if keepalive:
                s.sendall(req)
                buf = b""
                while b"\r\n\r\n" not in buf:
                    b = s.recv(4096)
                    if not b:
                        raise ConnectionError("closed")
                    buf += b
                head, _, body = buf.partition(b"\r\n\r\n")
                if not head.startswith(b"HTTP/1.1 200"):
                    raise ConnectionError(head[:40])
                cl = [ln for ln in head.split(b"\r\n") if ln.lower().startswith(b"content-length:")]
                want = int(cl[0].split(b":")[1]) if cl else 0
                while len(body) < want:
                    body += s.recv(4096)
            socks.append(s)
        except OSError:
            s.close()
            failed += 1
    return socks, failed


def still_open(socks):
    """How many of socks the router has not closed or answered."""
    p = select.epoll()
    for s in socks:
        p.register(s.fileno(), select.EPOLLIN | select.EPOLLRDHUP)
    gone = len(p.poll(0.5, maxevents=len(socks) + 1))
    p.close()
    return len(socks) - gone


def settle(cl, seconds=3):
    time.sleep(seconds)
    return cl.rss(), cl.fds()


def phase_hold(args, cl, kind, base):
    rss0, fds0 = settle(cl)
    t0 = time.monotonic()
    socks, failed = open_hold(cl.port, args.hold, addresses(args.addresses), kind == "keepalive")
    open_s = time.monotonic() - t0
    try:
        rss1, fds1 = settle(cl)
        n_open = still_open(socks)
        pr = probes(cl.port, args.probes, args.completions)
        n_open_after = still_open(socks)
        rss2, fds2 = cl.rss(), cl.fds()
    finally:
        for s in socks:
            s.close()
    rss3, fds3 = settle(cl, 5)
    held = max(1, n_open)
    return {
        "kind": kind, "opened": len(socks), "failed_to_open": failed, "open_s": open_s,
        "held_at_measure": n_open, "held_after_probes": n_open_after,
        "rss_bytes": {"before": rss0, "held": rss1, "held_after_probes": rss2, "released": rss3},
        "rss_bytes_per_held_connection": (rss1 - rss0) / held,
        "fds": {"before": fds0, "held": fds1, "held_after_probes": fds2, "released": fds3},
        "fds_per_held_connection": (fds1 - fds0) / held,
        "probes": pr, "ratio_to_baseline": ratios(pr, base),
    }


# --- output -------------------------------------------------------------------------------

def print_table(doc):
    m = doc["machine"]["label"]
    print(f"machine: {m}")
    print(f"{'phase':<22} {'health p50':>10} {'p99':>8} {'compl p50':>10} {'p99':>8} "
          f"{'failed':>6}  ratio p50/p99 health, completion")
    rows = [("A baseline", doc["baseline"], None),
            ("A slowloris", doc["slowloris"]["probes"], doc["slowloris"]["ratio_to_baseline"]),
            ("B baseline", doc.get("hold_baseline"), None)]
    for h in doc["hold"]:
        rows.append((f"B hold {h['kind']}", h["probes"], h["ratio_to_baseline"]))
    for name, p, r in rows:
        if p is None:
            continue
        fail = p["health"]["failed"] + p["completion"]["failed"]
        rs = (f"{r['health']['p50']:.2f}/{r['health']['p99']:.2f}, "
              f"{r['completion']['p50']:.2f}/{r['completion']['p99']:.2f}") if r else "-"
        print(f"{name:<22} {p['health']['ms']['p50']:>8.2f}ms {p['health']['ms']['p99']:>6.2f}ms "
              f"{p['completion']['ms']['p50']:>8.1f}ms {p['completion']['ms']['p99']:>6.1f}ms "
              f"{fail:>6}  {rs}")
    s = doc["slowloris"]
    print(f"slowloris: {s['connections']} connections from {s['addresses']} addresses held "
          f"{s['held_during_probes']}, router answers {s['answers']}, closed unanswered "
          f"{s['closed_unanswered']}, reopened {s['reopened']} in {s['duration_s']:.0f} s")
    for h in doc["hold"]:
        r = h["rss_bytes"]
        print(f"hold {h['kind']}: {h['held_at_measure']}/{h['opened']} held "
              f"({h['failed_to_open']} failed to open), RSS {r['before'] / 2**20:.1f} -> "
              f"{r['held'] / 2**20:.1f} MiB ({h['rss_bytes_per_held_connection']:.0f} B per "
              f"connection), released {r['released'] / 2**20:.1f} MiB; fds {h['fds']['before']} "
              f"-> {h['fds']['held']} -> {h['fds']['released']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--probes", type=int, default=200, help="GET /health per measurement")
    ap.add_argument("--completions", type=int, default=40, help="completions per measurement")
    ap.add_argument("--slow", type=int, default=1000, help="slowloris connections")
    ap.add_argument("--slow-interval", type=float, default=3.0,
                    help="seconds between two bytes of one slow connection")
    ap.add_argument("--slow-duration", type=float, default=35.0,
                    help="seconds the slowloris runs; probes repeat until it is over")
    ap.add_argument("--hold", type=int, default=10000, help="connections held in phase hold")
    ap.add_argument("--hold-kinds", default="headerless,keepalive,keepalive",
                    help="keepalive twice: does the second hold reuse the first one's memory")
    ap.add_argument("--no-hold", action="store_true", help="cluster A's phases only")
    ap.add_argument("--addresses", type=int, default=200)
    ap.add_argument("--json")
    args = ap.parse_args()
    args.model = os.path.abspath(os.path.expanduser(args.model))
    args.build = os.path.abspath(args.build)
    nofile = raise_nofile()
    # the router needs 2 x http_max_connections + 256 files and refuses to start with less:
    # under a lower hard limit (a container without CAP_SYS_RESOURCE) the hold is the most
    # connections it can take
    args.hold_requested = args.hold
    if 2 * args.hold + 256 > nofile[1]:
        args.hold = (nofile[1] - 256) // 2
        print(f"RLIMIT_NOFILE hard limit {nofile[1]} < 2 x {args.hold_requested} + 256: "
              f"holding {args.hold} connections (router.http_max_connections {args.hold})",
              file=sys.stderr)
    need = args.hold + args.slow + 512
    if nofile[0] < need:
        sys.exit(f"RLIMIT_NOFILE {nofile[0]} < {need}: raise the limit (ulimit -n)")
    mach = machine()
    doc = {"bench": "http_attack", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
           "machine": mach, "model": args.model, "rlimit_nofile": list(nofile),
           "args": {k: v for k, v in vars(args).items() if k not in ("build", "json")}}
    clusters = []
    with tempfile.TemporaryDirectory(prefix="tdm-http-attack-") as work:
        try:
            # cluster A: the HTTP defaults
            a = Cluster(args, work, "defaults", "")
            clusters.append(a)
            probes(a.port, 20, 4)  # warm-up
            doc["loadavg_1m"] = [os.getloadavg()[0]]
            doc["baseline"] = probes(a.port, args.probes, args.completions)
            print("baseline done", file=sys.stderr)
            slow = Slowloris(a.port, args.slow, addresses(args.addresses), args.slow_interval)
            t0 = time.monotonic()
            try:
                slow.start()
                time.sleep(2)  # every connection open and sending
                held0 = slow.held()
                # rounds of probes for --slow-duration s: through the router's 408 waves at
                # its header deadline (10 s) and the reconnections after them
                pr = probes(a.port, args.probes, args.completions, t0 + args.slow_duration)
                held1 = slow.held()
            finally:
                slow.stop()
            doc["slowloris"] = {
                "connections": args.slow, "addresses": args.addresses,
                "interval_s": args.slow_interval, "duration_s": time.monotonic() - t0,
                "held_during_probes": [held0, held1], "answers": slow.answers,
                "closed_unanswered": slow.closed_unanswered, "reopened": slow.reopened,
                "connect_errors": slow.connect_errors, "bytes_sent": slow.bytes_sent,
                "router_rss_bytes_after": a.rss(), "probes": pr,
                "ratio_to_baseline": ratios(pr, doc["baseline"])}
            print("slowloris done", file=sys.stderr)
            a.stop()
            doc["hold"] = []
            if args.no_hold:
                return finish(args, doc)
            # cluster B: 10,000 connections, no timeouts during the measurement
            b = Cluster(args, work, "hold",
                        f"  http_max_connections: {args.hold}\n"
                        "  http_header_timeout_s: 600\n  http_connection_timeout_s: 600\n")
            clusters.append(b)
            with open(f"/proc/{b.router_pid}/limits") as f:
                doc["router_nofile_hold"] = [ln.split()[3:5] for ln in f
                                             if ln.startswith("Max open files")][0]
            probes(b.port, 20, 4)
            doc["hold_baseline"] = probes(b.port, args.probes, args.completions)
            for kind in args.hold_kinds.split(","):
                doc["hold"].append(phase_hold(args, b, kind, doc["hold_baseline"]))
                print(f"hold {kind} done", file=sys.stderr)
        finally:
            for c in clusters:
                c.stop()
    finish(args, doc)


def finish(args, doc):
    doc["loadavg_1m"].append(os.getloadavg()[0])
    print_table(doc)
    out = args.json or os.path.join(HERE, "results",
                                    f"http-attack-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
