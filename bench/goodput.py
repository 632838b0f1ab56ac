#!/usr/bin/env python3
"""bench/goodput.py - goodput under latency SLOs: the highest Poisson request rate at which at
least 90 % of requests meet both their TTFT and their TPOT SLO, for Tandem colocated, Tandem
disaggregated 1P:1D and llama.cpp's llama-server, in one run.

Workload: a seeded length mix (--seed): prompt lengths log-uniform in [--prompt-min,
--prompt-max] tokens (as many short chat turns as long RAG/agent prompts per octave), outputs
log-uniform in [--output-min, --output-max], prompt + output <= --context (the prompt is
shortened where the sum is over). The defaults, 128..2048 and 32..256 within 4,096, keep a
3-configuration run near 30 minutes on 2 cores; issue 40's full size is --prompt-max 6144
--output-max 512 --context 8192. --context is the Tandem clusters' `model.max_context` (at most
the model's trained context) and sizes llama-server's slots.
Request i has the same lengths, prompt text and (at every rate, as unit exponential gaps scaled
by 1/rate) the same place in the arrival order in every configuration. Prompts are random common
words, each one token with its leading space in a byte-level BPE vocabulary (serve.py's WORDS),
so P words make a P-token prompt and no two prompts share a prefix block (no prefix cache
helps); streaming `/v1/completions`, `ignore_eos`, `max_tokens` = the drawn output, greedy.

Per request (open loop: each request is sent at its arrival time whatever is in flight):
TTFT = first streamed token - send; TPOT = (last token - first token) / (n - 1). SLO: TTFT <=
--slo-ttft-base + prompt_tokens / --slo-prefill-tps (0.5 s + P / 2000 tok/s) and TPOT <=
--slo-tpot (0.1 s); a failed or cut request misses it. Per rate: attainment (% of the point's
requests meeting both), TTFT and TPOT p50/p90/p99 of the finished requests, achieved request
and output-token throughput, the 1-minute load average before and after.

Method, per configuration: first a "rate -> 0" check: --isolated requests of the mix (its longest
prompt and its longest output among them) sent one at a time, so nothing queues; it reports the
attainment with no load (a configuration below --attainment there has no goodput under this
SLO, whatever the rate). Then a coarse sweep over the --rates from the highest one <= what
sequential service sustains (isolated requests / their wall time; --sweep-from-lowest: from the
lowest), up while rates pass and down while they fail, then geometric bisection between the
last passing and the first failing rate, until
--max-points points in all or the two are within --tolerance of each other. The goodput is the
highest passing rate (none, and no sweep, where the rate -> 0 check misses). Each point runs
on a freshly started server (a warm-up of two short requests first), so no queue or cache
carries over; a point stops --drain seconds after its last arrival (its unfinished requests
miss), or as soon as it has decided to fail (more misses than the attainment allows, every
request sent: the rest are cut) unless --no-early-stop.

--slo-prefill-tps auto: where a 2-core CPU cannot prefill 2,000 tok/s, no configuration meets
the 0.5 s + P/2000 TTFT SLO with no load; auto runs every configuration's isolated check first
and sets the rate to --auto-headroom (0.8) x the slowest configuration's isolated prefill speed
(min over its requests of P / (TTFT - base)), rounded down to 50 tok/s, so that at rate -> 0
every configuration meets it; each point's attainment under the nominal 2,000 tok/s is kept too.

Configurations: colocated (one decode node with --threads threads prefilling its own prompts),
disagg (one prefill and one decode node, --threads/2 each), disagg-nokeys (the same without
CURVE keys, as in serve.py), llama-server (`-np --slots -c
slots * longest -t --threads`, longest = the mix's longest prompt + output + 64, so every slot
holds the longest request; continuous batching is its default; bench/llama-cpp.sh builds it).
llama-server runs without the caller's OMP_WAIT_POLICY (--llama-wait-policy; serve.py's
llama_env says why). Its `-fa auto` turns flash attention on for the CPU, which decodes
2.4-2.6x slower at depth 1,000-4,000 on SmolLM2 (llama-bench, Xeon, 2026-12-06): compare with
--llama-args "-fa off" too and report llama-server's better run.

Prints a table per configuration and a summary, writes JSON to
bench/results/goodput-DATE-<cpu>.json (--json FILE), after every point ("complete": false until
the run ends, so a run cut short keeps what it measured). Only the standard library.

usage: bench/goodput.py [--build build] [--model FILE] [--configs colocated,disagg,llama-server]
                        [--rates 0.025,0.05,0.1,0.2,0.4,0.8] [--requests 12] [--max-points 4]
                        [--seed 1] [--isolated 6] [--prompt-min 128] [--prompt-max 2048]
                        [--output-min 32] [--output-max 256] [--context 4096] [--slo-ttft-base 0.5]
                        [--slo-prefill-tps 2000|auto] [--slo-tpot 0.1] [--attainment 0.9]
                        [--slots 8] [--threads 2] [--drain 90] [--llama-args "--no-repack"]
                        [--llama-wait-policy default|active|passive|inherit] [--json FILE]

On an AMX Xeon llama.cpp's AMX repacked kernels stop with SIGILL in this VM: pass
--llama-args=--no-repack there (as for bench/serve.py).
"""
import datetime
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time

from benchutil import (check_inputs, config_list, cpu_name, fraction, int_at_least,
                       nonnegative_float, positive_float, positive_floats,
                       positive_floats_or_none)
from serve import (CONFIGS, WORDS, LlamaServer, TandemCluster, add_llama_args, bench_parser,
                   llama_wait_policy_used, one_request, pct)

HERE = os.path.dirname(os.path.abspath(__file__))


def log_uniform(rng, lo, hi):
    """An int drawn log-uniformly in [lo, hi]."""
    return min(hi, max(lo, int(round(math.exp(rng.uniform(math.log(lo), math.log(hi)))))))


def make_mix(n, seed, prompt_min, prompt_max, output_min, output_max, context):
    """n requests as dicts {i, prompt_tokens, output_tokens, prompt, gap}: lengths log-uniform
    in the bounds (prompt shortened to context - output where the sum is over), a prompt of
    prompt_tokens random WORDS (one token each), and gap a unit exponential (the arrival gap at
    rate 1 req/s; divide by the rate). The same seed gives the same mix."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = log_uniform(rng, prompt_min, prompt_max)
        o = log_uniform(rng, output_min, output_max)
        p = min(p, context - o)
        words = [rng.choice(WORDS) for _ in range(p)]
        out.append({"i": i, "prompt_tokens": p, "output_tokens": o, "prompt": " ".join(words),
                    "gap": rng.expovariate(1.0)})
    return out


def meets_slo(r, slo):
    """Whether one request's result {ok, ttft_s, tpot_s, prompt_tokens} meets the SLO
    {ttft_base_s, prefill_tps, tpot_s}."""
    if not r.get("ok"):
        return False
    return (r["ttft_s"] <= slo["ttft_base_s"] + r["prompt_tokens"] / slo["prefill_tps"]
            and r["tpot_s"] <= slo["tpot_s"])


def attainment(results, n, slo):
    """The fraction of the point's n requests (results: those that finished or failed; the
    rest were cut) that met the SLO."""
    return sum(1 for r in results if meets_slo(r, slo)) / n if n else float("nan")


def search(rates, max_points, tolerance, passes, start=None):
    """Goodput search. passes(rate) -> bool measures one point. A coarse sweep over the sorted
    rates from the highest one <= start (default the lowest): up while they pass, down while
    they fail (halving below the lowest), then geometric bisection between the last passing
    and the first failing rate until max_points points in all or first_fail / last_pass <= 1
    + tolerance. Returns (last_pass, first_fail, order): last_pass the goodput (None: no rate
    passed), first_fail None when every rate passed, order the rates measured, in order."""
    rates = sorted(rates)
    k = 0
    if start is not None:
        k = max([j for j, r in enumerate(rates) if r <= start] or [0])
    order = []
    last_pass = first_fail = None
    rate = rates[k]
    while len(order) < max_points:
        order.append(rate)
        if passes(rate):
            last_pass = rate
            if first_fail is not None or k + 1 >= len(rates):
                break
            k += 1
            rate = rates[k]
        else:
            first_fail = rate
            if last_pass is not None:
                break
            k -= 1
            rate = rates[k] if k >= 0 else float(f"{rate / 2:.3g}")
    while first_fail is not None and last_pass is not None and len(order) < max_points:
        if first_fail / last_pass <= 1 + tolerance:
            break
        mid = float(f"{math.sqrt(last_pass * first_fail):.3g}")
        if mid in order:
            break
        order.append(mid)
        if passes(mid):
            last_pass = mid
        else:
            first_fail = mid
    return last_pass, first_fail, order


def summarize(results, n, slo, slo_nominal, wall, also_tps=()):
    """Per-point figures from the per-request results; attainment_by_prefill_tps: the
    attainment with the TTFT SLO's prefill speed set to each of also_tps instead."""
    done = [r for r in results if r.get("ok")]
    ttft = [r["ttft_s"] * 1000 for r in done]
    tpot = [r["tpot_s"] * 1000 for r in done if r["n_out"] > 1]
    n_out = sum(r["n_out"] for r in done)
    return {
        "requests": n, "finished": len(done), "failed": sum(1 for r in results if not r.get("ok")),
        "cut": n - len(results), "errors": [r["error"] for r in results if "error" in r][:3],
        "attainment": attainment(results, n, slo),
        "attainment_nominal_slo": attainment(results, n, slo_nominal),
        "attainment_by_prefill_tps": {str(t): attainment(results, n, dict(slo, prefill_tps=t))
                                      for t in also_tps},
        "ttft_ok": sum(1 for r in done if r["ttft_s"] <= slo["ttft_base_s"]
                       + r["prompt_tokens"] / slo["prefill_tps"]),
        "tpot_ok": sum(1 for r in done if r["tpot_s"] <= slo["tpot_s"]),
        "ttft_ms": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
        "tpot_ms": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
        "wall_s": wall, "achieved_req_per_s": len(done) / wall if wall > 0 else 0,
        "output_tokens_per_s": n_out / wall if wall > 0 else 0,
        # the server's usage.prompt_tokens - the drawn length: [0] when the prompts are
        # token-exact ([1] where a BOS is added)
        "reported_prompt_tokens_minus_drawn": sorted(
            {r["reported_prompt_tokens"] - r["prompt_tokens"]
             for r in done if r["reported_prompt_tokens"]}),
    }


def send(port, req, t_send):
    """One request of the mix; its result dict (ok, ttft_s, tpot_s, n_out, ...)."""
    r = {"i": req["i"], "prompt_tokens": req["prompt_tokens"], "sent_s": t_send}
    try:
        ttft, tpot, n_out, n_prompt = one_request(port, "bench", req["prompt"],
                                                  req["output_tokens"])
        r.update(ok=n_out == req["output_tokens"], ttft_s=ttft, tpot_s=tpot, n_out=n_out,
                 reported_prompt_tokens=n_prompt)
        if n_out != req["output_tokens"]:
            r["error"] = f"{n_out} of {req['output_tokens']} output tokens"
    except Exception as e:  # noqa: BLE001 - a failed request misses the SLO, reported
        r.update(ok=False, error=str(e)[:200])
    return r


class Bench:
    def __init__(self, args, work):
        self.args, self.work = args, work
        self.mix = make_mix(args.requests, args.seed, args.prompt_min, args.prompt_max,
                            args.output_min, args.output_max, args.context)
        iso_mix = make_mix(max(64, args.isolated), args.seed + 1, args.prompt_min,
                           args.prompt_max, args.output_min, args.output_max, args.context)
        # the rate -> 0 check: the longest prompt and the longest output of a 64-request draw
        # of the same distribution, then its first requests
        longest_p = max(iso_mix, key=lambda r: r["prompt_tokens"])
        longest_o = max(iso_mix, key=lambda r: r["output_tokens"])
        pick = [longest_p] + ([longest_o] if longest_o is not longest_p else [])
        pick += [r for r in iso_mix if r is not longest_p and r is not longest_o]
        self.iso = pick[:args.isolated]
        self.longest = max(r["prompt_tokens"] + r["output_tokens"] for r in self.mix + self.iso)

    def server(self, name):
        a = self.args
        if name == "llama-server":
            return LlamaServer(a, self.work, slots=a.slots, ctx=a.slots * (self.longest + 64))
        return TandemCluster(a, self.work, name, disagg=name.startswith("disagg"))

    def warm(self, port):
        for k in range(2):
            one_request(port, "bench", f"warm up {k} " + " ".join(WORDS[:64]), 8)

    def isolated(self, name):
        """The rate -> 0 check: the isolated requests one at a time on a fresh server."""
        srv = self.server(name)
        try:
            self.warm(srv.port)
            t0 = time.monotonic()
            results = [send(srv.port, req, time.monotonic() - t0) for req in self.iso]
            return results, time.monotonic() - t0
        finally:
            srv.stop()

    def point(self, name, rate, slo):
        """One open-loop point at `rate` req/s on a fresh server: (results, n, wall, early)."""
        a = self.args
        srv = self.server(name)
        results, lock = [], threading.Lock()
        n = len(self.mix)
        allowed_misses = math.floor(n * (1 - a.attainment) + 1e-9)
        decided = threading.Event()
        sent_all = threading.Event()

        def worker(req, t_send):
            r = send(srv.port, req, t_send)
            with lock:
                if not srv_stopped[0]:
                    results.append(r)
                misses = sum(1 for x in results if not meets_slo(x, slo))
            if not a.no_early_stop and sent_all.is_set() and misses > allowed_misses:
                decided.set()

        srv_stopped = [False]
        threads = []
        try:
            self.warm(srv.port)
            t0 = time.monotonic()
            at = 0.0
            for req in self.mix:
                at += req["gap"] / rate
                delay = t0 + at - time.monotonic()
                if delay > 0:
                    time.sleep(delay)
                t = threading.Thread(target=worker, args=(req, time.monotonic() - t0), daemon=True)
                t.start()
                threads.append(t)
            sent_all.set()
            with lock:
                if not a.no_early_stop and \
                        sum(1 for x in results if not meets_slo(x, slo)) > allowed_misses:
                    decided.set()
            deadline = time.monotonic() + a.drain
            while any(t.is_alive() for t in threads) and time.monotonic() < deadline \
                    and not decided.is_set():
                time.sleep(0.2)
            early = decided.is_set() and any(t.is_alive() for t in threads)
            wall = time.monotonic() - t0
            with lock:
                srv_stopped[0] = True  # what is in flight now is cut: it misses
                kept = list(results)
        finally:
            srv.stop()
        for t in threads:
            t.join(30)
        return kept, n, wall, early


def nominal(args):
    return {"ttft_base_s": args.slo_ttft_base, "prefill_tps": 2000.0, "tpot_s": args.slo_tpot}


def needed_prefill_tps(results, base):
    """The slowest prefill speed the isolated results show: min over requests of P / (TTFT -
    base) (inf when every TTFT is within the base), None when a request failed."""
    if not results or not all(r.get("ok") for r in results):
        return None
    return min((r["prompt_tokens"] / (r["ttft_s"] - base) if r["ttft_s"] > base else math.inf)
               for r in results)


def fmt_row(label, s):
    return (f"{label:>10} {s['finished']:>3}/{s['requests']:<3} {100 * s['attainment']:>5.0f}% "
            f"{100 * s['attainment_nominal_slo']:>5.0f}% "
            f"{s['ttft_ms']['p50']:>8.0f} {s['ttft_ms']['p90']:>8.0f} {s['ttft_ms']['p99']:>8.0f} "
            f"{s['tpot_ms']['p50']:>6.1f} {s['tpot_ms']['p90']:>6.1f} {s['tpot_ms']['p99']:>6.1f} "
            f"{s['achieved_req_per_s']:>6.3f} {s['output_tokens_per_s']:>7.1f} "
            f"{s['loadavg_1m'][0]:>4.1f}-{s['loadavg_1m'][1]:<4.1f}"
            + (" decided early" if s.get("decided_early") else ""))


HEADER = (f"{'rate':>10} {'fin':>7} {'SLO':>6} {'nomSLO':>6} {'TTFT p50':>8} {'p90':>8} {'p99':>8} "
          f"{'TPOT50':>6} {'p90':>6} {'p99':>6} {'req/s':>6} {'out t/s':>7} {'load':>9}")


def isa_name(work):
    """The CPU engine's kernel family a Tandem node of this run logged ("backend=cpu/..."),
    or "?"."""
    for root, _, files in os.walk(work):
        for f in files:
            if f.endswith(".log"):
                try:
                    with open(os.path.join(root, f), errors="replace") as fh:
                        m = re.search(r"backend=(cpu/[A-Za-z0-9_-]+)", fh.read())
                except OSError:
                    continue
                if m:
                    return m.group(1)
    return "?"


def prefill_tps_option(text):
    """A `type=` for --slo-prefill-tps: "auto" or a speed > 0 (tokens/s); returns the text."""
    if text != "auto":
        positive_float(text)
    return text


def parse_args():
    """The command line, checked: argparse exits with status 2 on a bad value, a missing model
    file or a build without the binaries the configurations need."""
    ap = bench_parser(__doc__, "per point, N requests of a seeded log-uniform length mix "
                      "arriving as a\nPoisson process at the rate (open loop); SLO: TTFT <= base "
                      "+ P / prefill-tps and TPOT <= slo-tpot.", "Configurations:")
    ap.add_argument("--configs", type=config_list(CONFIGS), default="colocated,disagg,llama-server",
                    help=f"comma-separated, of: {', '.join(CONFIGS)} "
                    "(default colocated,disagg,llama-server)")
    ap.add_argument("--rates", type=positive_floats, default="0.025,0.05,0.1,0.2,0.4,0.8",
                    help="coarse sweep, req/s, each > 0")
    ap.add_argument("-n", "--requests", type=int_at_least(1), default=12,
                    help="requests per point, >= 1")
    ap.add_argument("--max-points", type=int_at_least(1), default=4,
                    help="sweep + bisection points per configuration (the isolated check aside)")
    ap.add_argument("--tolerance", type=positive_float, default=0.15,
                    help="bisection stops when first failing / last passing <= 1 + this")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--isolated", type=int_at_least(1), default=6,
                    help="requests of the rate -> 0 check, >= 1")
    ap.add_argument("--prompt-min", type=int_at_least(1), default=128)
    ap.add_argument("--prompt-max", type=int_at_least(1), default=2048)
    ap.add_argument("--output-min", type=int_at_least(1), default=32)
    ap.add_argument("--output-max", type=int_at_least(1), default=256)
    ap.add_argument("--context", type=int_at_least(2), default=4096,
                    help="the served context: Tandem's model.max_context (at most the trained "
                         "context)")
    ap.add_argument("--slo-ttft-base", type=positive_float, default=0.5, help="seconds, > 0")
    ap.add_argument("--slo-prefill-tps", type=prefill_tps_option, default="2000",
                    help="tokens/s (> 0), or auto")
    ap.add_argument("--auto-headroom", type=fraction, default=0.8, help="in (0, 1]")
    ap.add_argument("--also-tps", type=positive_floats_or_none, default="2000,1000,500,250",
                    help="prefill speeds of other TTFT SLOs whose attainment each point keeps")
    ap.add_argument("--slo-tpot", type=positive_float, default=0.1, help="seconds, > 0")
    ap.add_argument("--attainment", type=fraction, default=0.9,
                    help="fraction of requests that must meet the SLO, in (0, 1]")
    ap.add_argument("--slots", type=int_at_least(1), default=8, help="llama-server -np, >= 1")
    ap.add_argument("--threads", type=int_at_least(1), default=2)
    ap.add_argument("--kv-gib", type=positive_float, default=2.0,
                    help="GiB per Tandem node beyond the weights, for scratch and KV")
    ap.add_argument("--drain", type=nonnegative_float, default=90,
                    help="seconds a point waits after its last arrival")
    ap.add_argument("--no-early-stop", action="store_true")
    ap.add_argument("--sweep-from-lowest", action="store_true",
                    help="start the coarse sweep at the lowest rate, not at the one sequential "
                    "service would sustain")
    add_llama_args(ap)
    ap.add_argument("--json", help="output file (default bench/results/goodput-DATE-CPU.json)")
    args = ap.parse_args()
    args.model = os.path.abspath(os.path.expanduser(args.model))
    args.build = os.path.abspath(args.build)
    if not (args.prompt_min >= 1 and args.prompt_min <= args.prompt_max
            and 1 <= args.output_min <= args.output_max
            and args.prompt_min + args.output_max <= args.context):
        ap.error("need 1 <= prompt-min <= prompt-max, 1 <= output-min <= output-max and "
                 "prompt-min + output-max <= context")
    check_inputs(ap, args.model, args.build, args.configs.split(","))
    return args


def tps_text(tps):
    """needed_prefill_tps for a person: 1 decimal, "inf", or "none" when a request failed."""
    return "none (a request failed)" if tps is None else f"{tps:.1f}"


def main():
    args = parse_args()
    rates = [float(x) for x in args.rates.split(",")]
    configs = args.configs.split(",")
    started = datetime.datetime.now(datetime.timezone.utc)
    doc = {"bench": "goodput", "date": started.isoformat(),
           "machine": {"cpus": os.cpu_count(), "cpu": cpu_name(), "isa": "?"},
           "model": args.model, "args": {k: v for k, v in vars(args).items()},
           "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "passive"),
           "llama_omp_wait_policy": llama_wait_policy_used(args), "configs": {}}
    auto = args.slo_prefill_tps == "auto"
    cpu = re.sub(r"[^a-z0-9]+", "-", doc["machine"]["cpu"].lower()).strip("-")[:40] or "cpu"
    out = args.json or os.path.join(HERE, "results",
                                    f"goodput-{started.date().isoformat()}-{cpu}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)

    def dump():
        # after every point, so a run cut short keeps what it measured ("complete": false)
        with open(out + ".part", "w") as f:
            json.dump(doc, f, indent=1)
        os.replace(out + ".part", out)

    doc["complete"] = False
    # SIGTERM (a kill, a timeout) unwinds like Ctrl-C, so the running server is stopped
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with tempfile.TemporaryDirectory(prefix="tdm-goodput-") as work:
        bench = Bench(args, work)
        doc["mix"] = {"prompt_tokens": [r["prompt_tokens"] for r in bench.mix],
                      "output_tokens": [r["output_tokens"] for r in bench.mix],
                      "isolated_prompt_tokens": [r["prompt_tokens"] for r in bench.iso],
                      "isolated_output_tokens": [r["output_tokens"] for r in bench.iso],
                      "longest": bench.longest,
                      "llama_server_ctx": args.slots * (bench.longest + 64)}
        print(f"mix: {len(bench.mix)} requests, prompt tokens mean "
              f"{sum(doc['mix']['prompt_tokens']) / len(bench.mix):.0f} (max "
              f"{max(doc['mix']['prompt_tokens'])}), output mean "
              f"{sum(doc['mix']['output_tokens']) / len(bench.mix):.0f}", file=sys.stderr)
        # phase 1: every configuration's rate -> 0 check (auto needs all of them first)
        iso = {}
        for name in configs:
            lb = os.getloadavg()[0]
            try:
                res, wall = bench.isolated(name)
            except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
                doc["configs"][name] = {"skipped": str(e)}
                print(f"{name}: skipped: {e}", file=sys.stderr)
                continue
            iso[name] = {"results": res, "wall": wall, "load": [lb, os.getloadavg()[0]],
                         "needed_prefill_tps": needed_prefill_tps(res, args.slo_ttft_base)}
            print(f"{name}: isolated: prefill speed that meets the TTFT SLO for all "
                  f"{len(res)}: {tps_text(iso[name]['needed_prefill_tps'])}", file=sys.stderr)
        doc["machine"]["isa"] = isa_name(work)
        if auto:
            need = [v["needed_prefill_tps"] for v in iso.values()]
            if not need or any(x is None for x in need):
                sys.exit("goodput: --slo-prefill-tps auto: a configuration's isolated check "
                         "failed (see above); give a number")
            tps = min(min(need), 2000.0) * args.auto_headroom
            tps = max(50.0, math.floor(tps / 50) * 50)
        else:
            tps = float(args.slo_prefill_tps)
        slo = {"ttft_base_s": args.slo_ttft_base, "prefill_tps": tps, "tpot_s": args.slo_tpot}
        doc["slo"] = dict(slo, auto=auto, attainment=args.attainment)
        also = [float(x) for x in args.also_tps.split(",") if x]
        dump()
        print(f"SLO: TTFT <= {slo['ttft_base_s']} s + P / {tps:.0f} tok/s, TPOT <= "
              f"{slo['tpot_s'] * 1000:.0f} ms, >= {100 * args.attainment:.0f} % of requests",
              file=sys.stderr)
        # phase 2: the searches
        for name in configs:
            if name not in iso:
                continue
            s = summarize(iso[name]["results"], len(bench.iso), slo, nominal(args),
                          iso[name]["wall"], also)
            s["loadavg_1m"] = iso[name]["load"]
            s["needed_prefill_tps"] = iso[name]["needed_prefill_tps"]
            entry = {"isolated": s, "points": {}}
            doc["configs"][name] = entry
            if s["attainment"] < args.attainment:
                # no load lowers TTFT or TPOT below the isolated ones: no rate would pass
                print(f"{name}: misses the SLO at rate -> 0 ({100 * s['attainment']:.0f} %): "
                      "goodput 0, no sweep", file=sys.stderr)
                entry.update(goodput_req_per_s=None, first_failing=0.0, order=[],
                             meets_slo_at_rate_0=False)
                continue

            def passes(rate, name=name, entry=entry):
                lb = os.getloadavg()[0]
                try:
                    results, n, wall, early = bench.point(name, rate, slo)
                except (RuntimeError, subprocess.CalledProcessError, OSError) as e:
                    entry["points"][str(rate)] = {"error": str(e)}
                    print(f"{name} @ {rate}: {e}", file=sys.stderr)
                    return False
                p = summarize(results, n, slo, nominal(args), wall, also)
                p["loadavg_1m"] = [lb, os.getloadavg()[0]]
                p["decided_early"] = early
                p["rate"] = rate
                entry["points"][str(rate)] = p
                print(f"{name}: {fmt_row(str(rate), p)}", file=sys.stderr)
                dump()
                return p["attainment"] >= args.attainment

            # start the sweep at the rate one request at a time would sustain (the isolated
            # requests' mean service time): batching sustains more, queueing at it less
            seq = len(bench.iso) / iso[name]["wall"]
            gp, ff, order = search(rates, args.max_points, args.tolerance, passes,
                                   None if args.sweep_from_lowest else seq)
            entry.update(goodput_req_per_s=gp, first_failing=ff, order=order,
                         meets_slo_at_rate_0=s["attainment"] >= args.attainment)
            dump()
    print(f"{doc['machine']['cpu']} ({doc['machine']['isa']}), {os.cpu_count()} CPUs; SLO TTFT "
          f"<= {slo['ttft_base_s']} s + P/{slo['prefill_tps']:.0f} tok/s, TPOT <= "
          f"{slo['tpot_s'] * 1000:.0f} ms\nnomSLO: the attainment with P/2000 tok/s")
    for name, e in doc["configs"].items():
        if "skipped" in e:
            print(f"\n{name}: skipped: {e['skipped']}")
            continue
        gp, ff = e["goodput_req_per_s"], e["first_failing"]
        print(f"\n{name}: goodput {'none' if gp is None else f'{gp} req/s'} (first failing "
              f"{'none' if ff is None else ff})" + ("" if e["meets_slo_at_rate_0"] else
                                          "; misses the SLO at rate -> 0"))
        print(HEADER)
        print(fmt_row("isolated", e["isolated"]))
        for p in sorted((p for p in e["points"].values() if "rate" in p), key=lambda p: p["rate"]):
            print(fmt_row(str(p["rate"]), p))
    ll = doc["configs"].get("llama-server", {}).get("goodput_req_per_s")
    if ll:
        doc["ratio_vs_llama_server"] = {n: (e.get("goodput_req_per_s") or 0) / ll
                                        for n, e in doc["configs"].items() if "skipped" not in e}
        print("\ngoodput x llama-server: " + ", ".join(
            f"{n} {v:.2f}" for n, v in doc["ratio_vs_llama_server"].items()))
    doc["complete"] = True
    dump()
    print(f"wrote {out}")
    skipped = [n for n, e in doc["configs"].items() if "skipped" in e]
    if skipped:
        sys.exit(f"goodput: {', '.join(skipped)}: skipped (see above)")


if __name__ == "__main__":
    main()
