#!/usr/bin/env python3
"""bench/router_throughput.py - the router's own ceiling: requests/s one router (or several,
load-balanced round-robin) sustains when the nodes answer at once, so that what limits the
rate is the router's work per request: the HTTP front (parse, JSON, response), tokenization,
admission, scheduling and dispatch, the node-channel messages.

Nodes that answer at once: real node daemons serving a one-layer miniature model
(`tandem model synth --arch llama3 --layers 1`, the default model's 49,152-token tokenizer, so
the router tokenizes exactly as for SmolLM2) with max_tokens 1: each request still takes the
whole path a real one takes (reservation on the decode node, prefill, KV transfer, first
token, end) but the model costs microseconds. A fake node speaking the node protocol would
skip the KV path and the nodes' real replies, and in Python would be slower than the router.

Load: closed loop, C requests in flight from P client processes (asyncio, one keep-alive
connection per slot and router), non-streamed POST /v1/completions with a distinct prompt of
W words each (no prefix-cache hits), max_tokens 1, temperature 0; request k of a slot goes to
router (slot + k) mod R: round-robin over the routers given. Counts only HTTP 200 answers with
a choice; anything else is an error (by status).

Figures: requests/s over the measured window; latency p50/p99; and, when the routers' PIDs
are known (its own cluster, or --router-pid), the routers' CPU seconds per request from
/proc/PID/stat, with ceiling = 1 / (CPU s per request): what one router would sustain with a
core to itself; and its busiest thread's CPU seconds per request (per router: its share of
the requests), whose inverse bounds one router however many cores it has (the router's loop
is one thread). These do not depend on how busy the machine is (the client processes and the
nodes share its cores), unlike requests/s.

Without --router it starts its own cluster (`tandem cluster up --detach`: one router, one
prefill node and one decode node, or --colocated: one decode node that prefills) in a
temporary directory and stops it at the end.

usage: bench/router_throughput.py [--build build] [--router URL[,URL...]] [--router-pid PID,...]
           [--model-name NAME] [-c 64] [-p 2] [--duration 10] [--warmup 2] [--prompt-words 32]
           [--colocated] [--json FILE]
Prints a table and writes JSON (default bench/results/router-throughput-DATE.json).
"""
import argparse
import asyncio
import datetime
import json
import multiprocessing
import os
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

from benchutil import cpu_name, free_port

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
WORDS = ("time people year way day man thing woman life child world school state family "
         "student group country problem hand part place case week company system program "
         "question work government number night point home water room mother area money "
         "story fact month lot right study book eye job word business issue side kind head "
         "house service friend father power hour game line end member law car city").split()


def cpu_seconds(pid):
    """utime + stime of pid (all its threads), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_seconds(pid):
    """{thread id: (name, utime + stime seconds)} of every thread of pid."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[tid] = (name, (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"))
    return out


def cpu_isa():
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "?"
    for isa in ("amx_int8", "avx512_vnni", "avx512f", "avx2"):
        if isa in flags:
            return isa
    return "other"


# ---- the load (one client process) ----

async def slot(routers, model, slot_id, words, state, lat, errors, stop_at):
    """One request in flight at a time, on one keep-alive connection per router."""
    conns = [None] * len(routers)
    k = 0
    while time.time() < stop_at:
        ri = (slot_id + k) % len(routers)
        host, port = routers[ri]
        k += 1
        prompt = f"{slot_id}.{k} " + " ".join(WORDS[(slot_id * 7 + k * 13 + i) % len(WORDS)]
                                            for i in range(words))
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 1,
                           "temperature": 0}).encode()
        req = (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
               f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
               ).encode() + body
        t0 = time.time()
        try:
            if conns[ri] is None:
                conns[ri] = await asyncio.open_connection(host, port)
            reader, writer = conns[ri]
            writer.write(req)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            close = False
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
                elif name.strip().lower() == b"connection" and b"close" in value.lower():
                    close = True
            data = await reader.readexactly(length)
            if close:
                writer.close()
                conns[ri] = None
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError) as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            if conns[ri]:
                conns[ri][1].close()
            conns[ri] = None
            await asyncio.sleep(0.01)
            continue
        t1 = time.time()
        if status == 200 and b'"choices"' in data:
            if t0 >= state["measure_from"]:
                lat.append(t1 - t0)
        elif t0 >= state["measure_from"]:
            errors[str(status)] = errors.get(str(status), 0) + 1
    for c in conns:
        if c:
            c[1].close()


def client_main(routers, model, slots, first_slot, words, measure_from, stop_at, out):
    async def run():
        lat, errors = [], {}
        state = {"measure_from": measure_from}
        await asyncio.gather(*(slot(routers, model, first_slot + i, words, state, lat, errors,
                                    stop_at) for i in range(slots)))
        return lat, errors
    out.put(asyncio.run(run()))


# ---- its own cluster ----

class OwnCluster:
    """A router and nodes serving a one-layer miniature model, `tandem cluster up --detach`."""

    def __init__(self, build, work, colocated):
        self.tandem = os.path.join(build, "client", "tandem")
        model = os.path.join(work, "tiny.gguf")
        subprocess.run([self.tandem, "model", "synth", "--arch", "llama3", "--type", "Q8_0",
                        "--layers", "1", "-o", model], check=True, stdout=subprocess.DEVNULL)
        self.port = free_port()
        conf = os.path.join(work, "cluster.yaml")
        with open(conf, "w") as f:
            f.write(f"model:\n  path: {model}\n  name: bench\n")
            f.write(f"router:\n  client_endpoint: tcp://127.0.0.1:{free_port()}\n")
            f.write(f"  node_endpoint: tcp://127.0.0.1:{free_port()}\n  http_port: {self.port}\n")
            f.write("  http_max_connections_per_client: 0\nnodes:\n")
            if not colocated:
                f.write("  - {id: prefill-0, role: prefill, threads: 1, memory_budget: 512MiB}\n")
            f.write(f"  - {{id: decode-0, role: decode, threads: 1, memory_budget: 512MiB, "
                    f"kv_endpoint: tcp://127.0.0.1:{free_port()}}}\n")
        self.pids = os.path.join(work, "cluster.pids")
        self.stopped = False
        up = subprocess.run([self.tandem, "cluster", "up", "--config", conf, "--detach",
                             "--pid-file", self.pids, "--log-dir", os.path.join(work, "logs")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if up.returncode != 0:
            raise RuntimeError(f"tandem cluster up: {up.stderr.strip()[-600:]}")
        self.procs = {}
        with open(self.pids) as f:
            for line in f:
                if line.startswith("#") or not line.strip():
                    continue
                pid, binary, label = line.split(None, 2)
                self.procs[label.strip()] = (int(pid), os.path.basename(binary))
        end = time.time() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/ready", timeout=5):
                    break
            except OSError:
                if time.time() > end:
                    raise RuntimeError("the cluster was not ready within 120 s") from None
                time.sleep(0.2)

    def router_pids(self):
        return [pid for pid, binary in self.procs.values() if binary == "tandem-router"]

    def node_pids(self):
        return [pid for pid, binary in self.procs.values() if binary != "tandem-router"]

    def stop(self):
        if not self.stopped:
            self.stopped = True
            subprocess.run([self.tandem, "cluster", "down", "--pid-file", self.pids],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def parse_routers(text):
    out = []
    for url in text.split(","):
        u = urllib.parse.urlsplit(url.strip() if "://" in url else "http://" + url.strip())
        if u.scheme != "http" or not u.hostname or not u.port:
            sys.exit(f"--router: '{url}' is not http://HOST:PORT")
        out.append((u.hostname, u.port))
    if len(set(out)) != len(out):
        sys.exit("--router: a router is named twice")
    return out


def pct(values, p):
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(p / 100 * len(s)))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--router", help="HTTP URLs of running routers, comma-separated "
                    "(round-robin); default: start a cluster of its own")
    ap.add_argument("--router-pid", default="", help="their PIDs, for the CPU figures")
    ap.add_argument("--model-name", default="bench", help="the model name the routers serve")
    ap.add_argument("-c", "--concurrency", type=int, default=64)
    ap.add_argument("-p", "--processes", type=int, default=2, help="client processes")
    ap.add_argument("--duration", type=float, default=10, help="measured seconds")
    ap.add_argument("--warmup", type=float, default=2, help="seconds before measuring")
    ap.add_argument("--prompt-words", type=int, default=32)
    ap.add_argument("--colocated", action="store_true",
                    help="own cluster: one decode node that prefills (no prefill node)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.concurrency < 1 or args.processes < 1 or args.duration <= 0:
        sys.exit("-c, -p and --duration must be positive")
    args.processes = min(args.processes, args.concurrency)

    with tempfile.TemporaryDirectory(prefix="tdm-rtp-") as work:
        cluster = None
        try:
            if args.router:
                routers = parse_routers(args.router)
                rpids = [int(p) for p in args.router_pid.split(",") if p.strip()]
                npids = []
            else:
                cluster = OwnCluster(os.path.abspath(args.build), work, args.colocated)
                routers = [("127.0.0.1", cluster.port)]
                rpids, npids = cluster.router_pids(), cluster.node_pids()
            doc = run(args, routers, rpids, npids)
        finally:
            if cluster:
                cluster.stop()
    doc["nodes"] = ("own: " + ("colocated decode-0" if args.colocated else
                               "prefill-0 + decode-0") + ", one-layer llama3 miniature, "
                    "SmolLM2 tokenizer") if not args.router else "external"
    print_table(doc)
    out = args.json or os.path.join(HERE, "results", "router-throughput-"
                                    f"{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(json.dumps({k: doc[k] for k in ("requests_per_s", "router_cpu_ms_per_request",
                                          "router_ceiling_requests_per_s",
                                          "router_busiest_thread_ms_per_request",
                                          "router_serial_ceiling_requests_per_s", "errors")}))
    print(f"wrote {out}")


def run(args, routers, rpids, npids):
    start = time.time()
    measure_from = start + args.warmup
    stop_at = measure_from + args.duration
    q = multiprocessing.Queue()
    per = [args.concurrency // args.processes + (i < args.concurrency % args.processes)
           for i in range(args.processes)]
    procs, first = [], 0
    for n in per:
        p = multiprocessing.Process(target=client_main, args=(
            routers, args.model_name, n, first, args.prompt_words, measure_from, stop_at, q))
        p.start()
        procs.append(p)
        first += n
    time.sleep(max(0.0, measure_from - time.time()))
    r0 = [cpu_seconds(p) for p in rpids]
    th0 = [thread_cpu_seconds(p) for p in rpids]
    n0 = [cpu_seconds(p) for p in npids]
    t0 = time.time()
    time.sleep(max(0.0, stop_at - time.time()))
    r1 = [cpu_seconds(p) for p in rpids]
    th1 = [thread_cpu_seconds(p) for p in rpids]
    n1 = [cpu_seconds(p) for p in npids]
    t1 = time.time()
    # the busiest thread of each router over the window: a serial part (the router's loop)
    # bounds the rate however many cores the router has
    busiest = []
    for a, b in zip(th0, th1):
        per = sorted(((b[t][1] - a.get(t, (None, 0.0))[1], b[t][0]) for t in b), reverse=True)
        busiest.append({"thread": per[0][1], "cpu_s": per[0][0]} if per else None)
    lat, errors = [], {}
    for _ in procs:
        pl, pe = q.get()
        lat += pl
        for k, v in pe.items():
            errors[k] = errors.get(k, 0) + v
    for p in procs:
        p.join()
    n = len(lat)
    rps = n / (t1 - t0)
    router_cpu = [b - a for a, b in zip(r0, r1)]
    node_cpu = sum(b - a for a, b in zip(n0, n1))
    ms_per_req = 1000 * sum(router_cpu) / n if n and rpids else None
    # per router: its requests are about n / R (round-robin)
    serial_ms = (1000 * max(b["cpu_s"] for b in busiest if b) / (n / len(rpids))
                 if n and rpids and any(busiest) else None)
    return {
        "bench": "router-throughput",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "isa": cpu_isa(),
                    "loadavg_1m": os.getloadavg()[0]},
        "routers": [f"http://{h}:{p}" for h, p in routers],
        "concurrency": args.concurrency, "client_processes": args.processes,
        "prompt_words": args.prompt_words, "max_tokens": 1, "seconds": t1 - t0,
        "requests": n, "requests_per_s": rps,
        "latency_ms": {"p50": 1000 * pct(lat, 50), "p99": 1000 * pct(lat, 99)},
        "errors": errors,
        "router_cpu_s": router_cpu,
        "router_cpu_ms_per_request": ms_per_req,
        "router_ceiling_requests_per_s": 1000 / ms_per_req if ms_per_req else None,
        "router_busiest_thread": busiest,
        "router_busiest_thread_ms_per_request": serial_ms,
        "router_serial_ceiling_requests_per_s": 1000 / serial_ms if serial_ms else None,
        "router_cores_busy": sum(router_cpu) / (t1 - t0) if rpids else None,
        "node_cpu_ms_per_request": 1000 * node_cpu / n if n and npids else None,
    }


def print_table(d):
    def f(v, spec):
        return format(v, spec) if v is not None else "-"
    print(f"router throughput: {', '.join(d['routers'])}; {d['machine']['cpu']} "
          f"({d['machine']['cpus']} CPUs, {d['machine']['isa']}, load {d['machine']['loadavg_1m']:.1f})")
    print(f"{'routers':>8} {'in flight':>9} {'requests/s':>11} {'p50 ms':>8} {'p99 ms':>8} "
          f"{'errors':>7} {'router CPU ms/req':>18} {'ceiling req/s/core':>19} "
          f"{'busiest thread ms/req':>22} {'its ceiling req/s':>18} "
          f"{'router cores':>13} {'node CPU ms/req':>16}")
    print(f"{len(d['routers']):>8} {d['concurrency']:>9} {d['requests_per_s']:>11.0f} "
          f"{d['latency_ms']['p50']:>8.2f} {d['latency_ms']['p99']:>8.2f} "
          f"{sum(d['errors'].values()):>7} {f(d['router_cpu_ms_per_request'], '.3f'):>18} "
          f"{f(d['router_ceiling_requests_per_s'], '.0f'):>19} "
          f"{f(d['router_busiest_thread_ms_per_request'], '.3f'):>22} "
          f"{f(d['router_serial_ceiling_requests_per_s'], '.0f'):>18} "
          f"{f(d['router_cores_busy'], '.2f'):>13} {f(d['node_cpu_ms_per_request'], '.3f'):>16}")


if __name__ == "__main__":
    main()
