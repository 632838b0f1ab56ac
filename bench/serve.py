#!/usr/bin/env python3
"""bench/serve.py - serving throughput: Tandem colocated, Tandem disaggregated and llama.cpp's
llama-server under the same closed-loop load, in one run.

C client threads each send one streaming `/v1/completions` request at a time (a new one as soon
as the last finished) until N requests are done: distinct prompts of ~P tokens (random common
words, a different first word for each, so no prefix cache helps), `ignore_eos`, exactly O
output tokens, greedy. Per request: TTFT = first streamed token - send; TPOT = (last token -
first token) / (O - 1). Output tokens/s = all output tokens / wall time of the run.

Configurations (each started, warmed up with 4 requests whose prompts no run uses, loaded,
stopped):
  colocated     one decode node with all THREADS threads that prefills its own prompts
                (no prefill node: the router sends local_prefill reservations)
  disagg        one prefill node and one decode node, THREADS/2 threads each, with keys by
                default (the config sets no keys: CURVE on the node and KV channels, pairs
                from $XDG_STATE_HOME/tandem/keys)
  disagg-nokeys the same with security.default_keys: false (no CURVE: plain ZMTP), to measure
                what keys by default cost
  llama-server  llama.cpp's server, `-np C -t THREADS` (continuous batching is its default),
                `-c C * (P + O + 64)` so every slot holds a request (bench/llama-cpp.sh builds it)

Prints a table and the ratios to llama-server, writes JSON to bench/results/serve-DATE.json.
Only the standard library (http.client in threads: aiohttp is not in the tests' venv).

usage: bench/serve.py [--build build] [--model FILE] [-c 32] [-n 64] [--prompt-tokens 130]
                      [--output-tokens 64] [--threads 2] [--configs colocated,disagg,disagg-nokeys,llama-server]
                      [--time-limit 900] [--llama-args "..."] [--llama-wait-policy default]
                      [--json FILE] [--scrape PREFIX,...]
"""
import argparse
import datetime
import http.client
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import (check_inputs, config_list, cpu_name, doc_paragraph, free_port,
                       int_at_least, positive_float)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tandem")
DEFAULT_MODEL = os.path.join(CACHE, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
CONFIGS = ("colocated", "disagg", "disagg-nokeys", "llama-server")
# The context a Tandem cluster serves when its config sets no model.max_context:
# min(TDM_MODEL_MAX_SERVE_CTX, the trained context) (common/include/tandem/model.h), so a
# prompt + output over it is refused by every Tandem configuration.
SERVE_CTX = 4096

# Common English words: with a byte-level BPE vocabulary (SmolLM2's, Llama 3's) each one with
# its leading space is one token, so P words make a ~P-token prompt.
WORDS = """time year people way day man thing woman life child world school state family
student group country problem hand part place case week company system program question work
government number night point home water room mother area money story fact month lot right
study book eye job word business issue side kind head house service friend father power hour
game line end member law car city community name president team minute idea kid body
information back parent face others level office door health person art war history party
result change morning reason research girl guy moment air teacher force education""".split()


def make_prompts(n, n_words, seed):
    """n distinct prompts; prompt i starts with word i % len(WORDS) and a number."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        words = [WORDS[i % len(WORDS)], str(i)] + [rng.choice(WORDS) for _ in range(n_words - 2)]
        out.append(" ".join(words))
    return out


def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    k = (len(v) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def one_request(port, model_name, prompt, out_tokens):
    """Sends one streaming completion; returns (ttft_s, tpot_s, n_out, n_prompt) or raises."""
    body = json.dumps({"model": model_name, "prompt": prompt, "max_tokens": out_tokens,
                       "n_predict": out_tokens, "ignore_eos": True, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    t0 = time.monotonic()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"HTTP {resp.status}: {resp.read()[:400]!r}")
    first = last = None
    chunks = 0
    usage = None
    while True:
        line = resp.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("choices"):
            now = time.monotonic()
            first = first if first is not None else now
            last = now
            chunks += 1
    conn.close()
    if first is None:
        raise RuntimeError("no token streamed")
    n_out = (usage or {}).get("completion_tokens") or chunks
    n_prompt = (usage or {}).get("prompt_tokens") or 0
    tpot = (last - first) / (n_out - 1) if n_out > 1 else 0.0
    return first - t0, tpot, n_out, n_prompt


def run_load(port, model_name, prompts, concurrency, out_tokens, limit_s=None, on_limit=None):
    """Closed loop: `concurrency` threads, each sending the next prompt when its last is done.
    After limit_s seconds no new request starts and on_limit() runs (it stops the server, so
    the requests in flight fail and are counted as cut)."""
    results, errors = [], []
    lock = threading.Lock()
    todo = list(enumerate(prompts))
    timer = threading.Timer(limit_s, lambda: (todo.clear(), on_limit and on_limit())) \
        if limit_s else None

    def worker():
        while True:
            with lock:
                if not todo:
                    return
                _, p = todo.pop(0)
            try:
                r = one_request(port, model_name, p, out_tokens)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported, counted as failed
                with lock:
                    errors.append(str(e))

    t0 = time.monotonic()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    if timer:
        timer.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    if timer:
        timer.cancel()
    ttft = [r[0] * 1000 for r in results]
    tpot = [r[1] * 1000 for r in results]
    n_out = sum(r[2] for r in results)
    return {
        "requests": len(results), "failed": len(errors), "errors": errors[:3],
        "short": sum(1 for r in results if r[2] < out_tokens),  # ended early (cut at the limit)
        "wall_s": wall, "output_tokens": n_out, "cut_at_limit": bool(limit_s and wall >= limit_s),
        "output_tokens_per_s": n_out / wall if wall > 0 else 0,
        "mean_prompt_tokens": statistics.mean([r[3] for r in results if r[3]] or [0]),
        "mean_output_tokens": n_out / len(results) if results else 0,
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "tpot_ms": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
    }


def wait_http(port, path, timeout_s, proc=None):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
            c.request("GET", path)
            ok = c.getresponse().status == 200
            c.close()
            if ok:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no answer on :{port}{path} within {timeout_s} s")


class TandemCluster:
    """`tandem cluster up --detach` with one config; stop() brings it down."""

    def __init__(self, args, work, name, disagg):
        self.tandem = os.path.join(args.build, "client", "tandem")
        self.work, self.name = work, name
        self.port = free_port()
        half = max(1, args.threads // 2)
        # the weights, the CPU engine's packed copy of them (cpu.c repacks the quantized
        # matrices: about the file's size again) and 1 GiB (args.kv_gib when set) for scratch
        # and KV
        budget = 2 * os.path.getsize(args.model) + int(getattr(args, "kv_gib", 1) * (1 << 30))
        conf = os.path.join(work, name + ".yaml")
        with open(conf, "w") as f:
            f.write(f"model:\n  path: {args.model}\n  name: bench\n")
            if getattr(args, "context", None):  # goodput.py: the context served (max_context)
                f.write(f"  max_context: {args.context}\n")
            f.write(f"router:\n  client_endpoint: tcp://127.0.0.1:{free_port()}\n")
            f.write(f"  node_endpoint: tcp://127.0.0.1:{free_port()}\n  http_port: {self.port}\n")
            f.write("  http_threads: 8\n  http_max_connections_per_client: 0\n")
            if name.endswith("-nokeys"):
                f.write("security:\n  default_keys: false\n")
            f.write("nodes:\n")
            if disagg:
                f.write(f"  - {{id: prefill-0, role: prefill, threads: {half}, "
                        f"memory_budget: {budget}}}\n")
            f.write(f"  - {{id: decode-0, role: decode, threads: {half if disagg else args.threads}, "
                    f"memory_budget: {budget}, kv_endpoint: tcp://127.0.0.1:{free_port()}}}\n")
        self.pids = os.path.join(work, name + ".pids")
        self.stopped = False
        up = subprocess.run([self.tandem, "cluster", "up", "--config", conf, "--detach",
                             "--pid-file", self.pids, "--log-dir", os.path.join(work, "logs-" + name)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if up.returncode != 0:
            raise RuntimeError(f"tandem cluster up: {up.stderr.strip()[-600:]}")
        wait_http(self.port, "/v1/models", 120)

    def stop(self):
        if self.stopped:
            return
        self.stopped = True
        subprocess.run([self.tandem, "cluster", "down", "--pid-file", self.pids],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


LLAMA_WAIT_POLICIES = ("default", "active", "passive", "inherit")


def llama_env(args):
    """llama-server's environment. Its OpenMP build syncs the threads at every graph node with an
    OpenMP barrier, so the OMP_WAIT_POLICY=passive this repository's tools run Tandem under
    makes each of them a futex sleep (2026-12-06, Xeon, SmolLM2 at depth 4,000: 52 against
    26 ms a token): by default ("default") the variable is removed and llama.cpp runs as its
    users run it; "active"/"passive" set it, "inherit" passes the caller's."""
    env = dict(os.environ)
    policy = getattr(args, "llama_wait_policy", "default")
    if policy == "default":
        env.pop("OMP_WAIT_POLICY", None)
    elif policy != "inherit":
        env["OMP_WAIT_POLICY"] = policy
    return env


def llama_wait_policy_used(args):
    """The OMP_WAIT_POLICY llama-server ran under, for the JSON ("unset": libgomp's default)."""
    return llama_env(args).get("OMP_WAIT_POLICY", "unset")


class LlamaServer:
    """llama-server with `slots` slots (-np; default args.concurrency) and a context of `ctx`
    tokens in all (-c; default slots * (args.prompt_tokens + args.output_tokens + 64), so each
    slot holds one request); stop() ends it."""

    def __init__(self, args, work, slots=None, ctx=None):
        binary = os.path.join(CACHE, "llama.cpp", "build", "bin", "llama-server")
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"{binary} is not built: run bench/llama-cpp.sh")
        self.port = free_port()
        slots = slots or args.concurrency
        ctx = ctx or slots * (args.prompt_tokens + args.output_tokens + 64)
        self.log = open(os.path.join(work, "llama-server.log"), "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [binary, "-m", args.model, "-np", str(slots), "-t", str(args.threads),
             "-c", str(ctx), "--host", "127.0.0.1", "--port", str(self.port)]
            + args.llama_args.split(),
            stdout=self.log, stderr=subprocess.STDOUT, env=llama_env(args))
        wait_http(self.port, "/health", 300, self.proc)

    def stop(self):
        if self.proc.poll() is not None:
            return
        self.proc.terminate()  # llama-server finishes its running slots first: kill after 5 s
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def run_config(args, work, name, seed):
    """Starts configuration `name`, warms it up, runs the load, stops it: run_load's dict with
    loadavg_1m (and metrics with --scrape). Raises RuntimeError or OSError when the server does
    not start."""
    if name == "llama-server":
        server = LlamaServer(args, work)
    else:
        server = TandemCluster(args, work, name, disagg=name.startswith("disagg"))
    try:
        warm = make_prompts(4, args.prompt_tokens, 10_000 + seed)
        run_load(server.port, "bench", [f"warm-up {p}" for p in warm], 2, 8)
        # the same prompts for every configuration: the one difference is the server
        prompts = make_prompts(args.requests, args.prompt_tokens, 1)
        load_before = os.getloadavg()[0]
        r = run_load(server.port, "bench", prompts, args.concurrency, args.output_tokens,
                     args.time_limit, server.stop)
        # the machine's 1-minute load average around the run: other processes' share of it
        r["loadavg_1m"] = [load_before, os.getloadavg()[0]]
        if args.scrape and name != "llama-server":
            r["metrics"] = scrape(server.port, args.scrape.split(","))
        return r
    finally:
        server.stop()


def scrape(port, prefixes):
    """The router's /metrics samples whose names start with one of prefixes, by series."""
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", "/metrics")
    text = c.getresponse().read().decode()
    c.close()
    out = {}
    for line in text.splitlines():
        if line.startswith("#") or not any(line.startswith(p) for p in prefixes):
            continue
        series, _, value = line.rpartition(" ")
        out[series] = float(value)
    return out


def ms(value, width, digits):
    """A latency cell: value ms in width characters, or "-" where no request finished (nan)."""
    return f"{value:>{width - 2}.{digits}f}ms" if value == value else f"{'-':>{width}}"


def print_table(runs):
    base = runs.get("llama-server")
    print(f"{'config':<13} {'req':>4} {'cut':>4} {'out tok/s':>9} {'TTFT p50':>9} "
          f"{'TTFT p90':>9} {'TPOT p50':>9} {'TPOT p90':>9} {'x llama-server':>14} {'load':>9}")
    for name, r in runs.items():
        ratio = (f"{r['output_tokens_per_s'] / base['output_tokens_per_s']:.2f}"
                 if base and base["output_tokens_per_s"] else "-")
        failed = r["failed"] + r.get("short", 0)
        print(f"{name:<13} {r['requests']:>4} {failed:>4} {r['output_tokens_per_s']:>9.1f} "
              f"{ms(r['ttft_ms']['p50'], 9, 0)} {ms(r['ttft_ms']['p90'], 9, 0)} "
              f"{ms(r['tpot_ms']['p50'], 9, 1)} {ms(r['tpot_ms']['p90'], 9, 1)} {ratio:>14} "
              f"{r['loadavg_1m'][0]:>4.1f}-{r['loadavg_1m'][1]:<4.1f}"
              + (" cut at --time-limit" if r.get("cut_at_limit") else ""))


def bench_parser(doc, workload, configs_heading):
    """The argument parser of a serving benchmark (this script, goodput.py): doc's first
    paragraph and the workload line as its description, doc's paragraph starting with
    configs_heading as its epilog, and the options every one has: --build, --model."""
    ap = argparse.ArgumentParser(
        description=doc.split("\n\n")[0] + "\n\nWorkload: " + workload,
        epilog=doc_paragraph(doc, configs_heading),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--build", default=os.path.join(ROOT, "build"),
                    help="Tandem's build folder (default: build)")
    ap.add_argument("--model", default=DEFAULT_MODEL, help="GGUF file (default: SmolLM2-135M)")
    return ap


def add_llama_args(ap):
    """llama-server's options (LlamaServer): --llama-args, --llama-wait-policy (llama_env)."""
    ap.add_argument("--llama-args", default="", help="more llama-server options")
    ap.add_argument("--llama-wait-policy", choices=LLAMA_WAIT_POLICIES, default="default",
                    help="OMP_WAIT_POLICY for llama-server (default: unset, llama.cpp's own)")


def parse_args():
    """The command line, checked: argparse exits with status 2 on a bad value, a missing model
    file or a build without the binaries the configurations need."""
    ap = bench_parser(__doc__, "a closed loop of C clients, N requests of ~P prompt tokens "
                      "and\nexactly O output tokens each (ignore_eos, greedy).", "Configurations")
    ap.add_argument("-c", "--concurrency", type=int_at_least(1), default=32,
                    help="client threads, >= 1 (default 32)")
    ap.add_argument("-n", "--requests", type=int_at_least(1), default=64,
                    help="requests per configuration, >= 1 (default 64)")
    ap.add_argument("--prompt-tokens", type=int_at_least(2), default=130,
                    help=f"prompt words (~tokens), >= 2; prompt + output <= {SERVE_CTX} "
                    "(default 130)")
    ap.add_argument("--output-tokens", type=int_at_least(1), default=64,
                    help="output tokens per request, >= 1 (default 64)")
    ap.add_argument("--threads", type=int_at_least(1), default=os.cpu_count() or 2,
                    help="threads per configuration, >= 1 (default: the CPU count)")
    ap.add_argument("--configs", type=config_list(CONFIGS), default="colocated,disagg,llama-server",
                    help=f"comma-separated, of: {', '.join(CONFIGS)} "
                    "(default colocated,disagg,llama-server)")
    ap.add_argument("--time-limit", type=positive_float, default=900,
                    help="seconds per configuration before the run is cut (default 900)")
    add_llama_args(ap)
    ap.add_argument("--json", help="output file (default bench/results/serve-DATE.json)")
    ap.add_argument("--scrape", default="",
                    help="comma-separated metric name prefixes whose samples each Tandem run's "
                    "JSON keeps (its router's /metrics after the load), e.g. "
                    "tandem_decode_reserve_seconds")
    args = ap.parse_args()
    args.model = os.path.abspath(os.path.expanduser(args.model))
    args.build = os.path.abspath(args.build)
    if args.prompt_tokens + args.output_tokens > SERVE_CTX and args.configs != "llama-server":
        ap.error(f"--prompt-tokens {args.prompt_tokens} + --output-tokens {args.output_tokens} "
                 f"is over the {SERVE_CTX}-token context a Tandem cluster serves")
    check_inputs(ap, args.model, args.build, args.configs.split(","))
    return args


def main():
    args = parse_args()
    runs, skipped = {}, {}
    with tempfile.TemporaryDirectory(prefix="tdm-serve-") as work:
        for i, name in enumerate(args.configs.split(",")):
            try:
                runs[name] = run_config(args, work, name, i)
                r = runs[name]
                print(f"{name}: {r['output_tokens_per_s']:.1f} output tokens/s "
                      f"({r['requests']} requests, {r['failed']} failed, "
                      f"{r['mean_prompt_tokens']:.0f} prompt tokens on average)", file=sys.stderr)
                if r["errors"]:
                    print(f"{name}: first error: {r['errors'][0]}", file=sys.stderr)
            except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
                skipped[name] = str(e)
                print(f"{name}: skipped: {e}", file=sys.stderr)
    print_table(runs)
    base = runs.get("llama-server", {}).get("output_tokens_per_s")
    doc = {
        "bench": "serve", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        "machine": {"cpus": os.cpu_count(), "cpu": cpu_name()},
        "model": args.model, "concurrency": args.concurrency, "requests": args.requests,
        "prompt_words": args.prompt_tokens, "output_tokens": args.output_tokens,
        "threads": args.threads, "llama_args": args.llama_args, "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "passive"),
        "llama_omp_wait_policy": llama_wait_policy_used(args),
        "runs": runs, "skipped": skipped,
        "ratio_vs_llama_server": {n: r["output_tokens_per_s"] / base for n, r in runs.items()}
        if base else {},
    }
    out = args.json or os.path.join(HERE, "results",
                                    f"serve-{datetime.date.today().isoformat()}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {out}")
    # nonzero when a configuration could not run or none of its requests finished
    failed = [f"{n}: skipped" for n in skipped]
    failed += [f"{n}: no request finished" for n, r in runs.items() if r["requests"] == 0]
    if failed:
        sys.exit("serve: " + "; ".join(failed) + " (see above)")


if __name__ == "__main__":
    main()
