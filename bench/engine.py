#!/usr/bin/env python3
"""Engine benchmark: Tandem vs llama.cpp on the same model, threads and machine, in one run.

Runs build/bench/tandem-bench-engine (prefill at 128/512 tokens, decode at batch 1/8/32/64,
peak RSS, memcpy bandwidth) and then llama.cpp through llama-cpp-python on the same GGUF with
the same thread count (prefill at 128/512, batch-1 decode), and prints a table of ratios:
absolute times drift on shared machines, ratios measured in the same run do not.

    pip install llama-cpp-python   # builds llama.cpp from source (several minutes)
    python3 bench/engine.py [--threads N] [--json OUT]

Targets (issue "Engine"): batch-1 decode >= 0.8x llama.cpp; aggregate decode at batch 32
>= 6x batch 1; peak RSS <= model file + KV pool + 64 MiB.
"""
import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def default_model():
    if os.environ.get("TANDEM_MODEL"):
        return os.environ["TANDEM_MODEL"]
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def random_tokens(n, seed, n_vocab):
    rng = random.Random(seed)
    return [rng.randrange(1000, n_vocab - 1000) for _ in range(n)]


def disable_extra_buffer_types():
    """llama.cpp picks AMX / repacked weight buffers when the CPU reports AMX; in VMs that do not
    enable AMX tile state those kernels die with SIGILL. The Llama constructor has no switch for
    it, so wrap the default model parameters it starts from (as tests/golden does)."""
    import llama_cpp.llama_cpp as llama_c

    default_params = llama_c.llama_model_default_params

    def model_params():
        p = default_params()
        p.use_extra_bufts = False
        return p

    llama_c.llama_model_default_params = model_params


def bench_llama_cpp(model, threads, steps):
    from llama_cpp import Llama, __version__

    disable_extra_buffer_types()
    llm = Llama(model_path=model, n_ctx=1024, n_batch=512, n_ubatch=512, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    n_vocab = llm.n_vocab()
    out = {"version": __version__, "buffer_types": "plain CPU (use_extra_bufts=False)",
           "prefill_tokens_per_s": {}}
    for n in (128, 512):
        times = []
        toks = random_tokens(n, n, n_vocab)
        for _ in range(3):
            llm.reset()
            t0 = time.perf_counter()
            llm.eval(toks)
            times.append(time.perf_counter() - t0)
        out["prefill_tokens_per_s"][str(n)] = n / statistics.median(times)
    llm.reset()
    llm.eval(random_tokens(128, 100, n_vocab))
    times = []
    for s in range(steps):
        t0 = time.perf_counter()
        llm.eval(random_tokens(1, 977 * s, n_vocab))
        times.append(time.perf_counter() - t0)
    out["decode_step_s"] = {"1": statistics.median(times)}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model())
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--steps", type=int, default=32, help="decode steps per batch size")
    ap.add_argument("--bench-bin", default=str(ROOT / "build" / "bench" / "tandem-bench-engine"))
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--no-llama-cpp", action="store_true", help="skip the baseline")
    args = ap.parse_args()

    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "passive")  # as the tandem tool sets it (client/tandem.c)
    proc = subprocess.run([args.bench_bin, "-m", args.model, "-t", str(args.threads),
                           "--steps", str(args.steps)], capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        sys.exit(f"bench: {args.bench_bin} failed:\n{proc.stderr}")
    tandem = json.loads(proc.stdout)
    base = None
    if not args.no_llama_cpp:
        try:
            base = bench_llama_cpp(args.model, args.threads, args.steps)
        except ImportError:
            sys.exit("bench: llama-cpp-python is not installed (pip install llama-cpp-python), "
                     "or pass --no-llama-cpp")

    rows = []
    def row(name, ours, theirs=None, unit=""):
        ratio = ours / theirs if theirs else None
        rows.append((name, ours, theirs, ratio, unit))

    for n in ("128", "512"):
        row(f"prefill {n} tokens/s", tandem["prefill_tokens_per_s"][n],
            base["prefill_tokens_per_s"][n] if base else None)
    steps = tandem["decode_step_s"]
    for b in ("1", "8", "32", "64"):
        theirs = 1 / base["decode_step_s"]["1"] if base and b == "1" else None
        row(f"decode batch {b} tokens/s", int(b) / steps[b], theirs)
    scaling = (32 / steps["32"]) / (1 / steps["1"])
    bound = tandem["batch1_bound_s"]
    row("batch 32 / batch 1 (target >= 6)", scaling)
    row("batch-1 step / memory bound", steps["1"] / bound)
    row("peak RSS MiB", tandem["peak_rss_bytes"] / 2**20)
    row("RSS limit MiB (file+pool+64)", tandem["rss_limit_bytes"] / 2**20)

    print(f"model {args.model}\nthreads {args.threads}, backend {tandem['backend']}, "
          f"llama.cpp {base['version'] if base else '-'}, {platform.processor() or platform.machine()}")
    print(f"{'measure':36} {'tandem':>10} {'llama.cpp':>10} {'ratio':>7}")
    for name, ours, theirs, ratio, _ in rows:
        t = f"{theirs:10.1f}" if theirs is not None else f"{'':>10}"
        r = f"{ratio:7.2f}" if ratio is not None else f"{'':>7}"
        print(f"{name:36} {ours:10.2f} {t} {r}")
    result = {"model": args.model, "threads": args.threads, "tandem": tandem, "llama_cpp": base,
              "batch32_over_batch1": scaling,
              "decode_batch1_vs_llama_cpp": (1 / steps["1"]) / (1 / base["decode_step_s"]["1"])
              if base else None,
              "rss_within_limit": tandem["peak_rss_bytes"] <= tandem["rss_limit_bytes"]}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
