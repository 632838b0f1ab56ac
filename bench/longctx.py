#!/usr/bin/env python3
"""Long-context benchmark: Tandem vs llama.cpp at depth, alternated in one run.

Per round, in this order: tandem-bench-engine --depth (chunked prefill of D tokens in 512-token
passes, then decode at batch 1 and 8 with D tokens of context), llama-bench prefill (-p D -n 0)
and decode at depth (-p 0 -n STEPS -d D), flash attention off and on, and llama-batched-bench
at batch 8 (-npp D -ntg STEPS -npl 8 -pps: one shared D-token prompt, 8 sequences decoding),
flash attention off and on. llama.cpp's best of the two flash-attention settings is the
baseline; the best of the rounds of each side is kept. Prints the table (tokens/s and
Tandem / llama.cpp) with the CPU model, its ISA flags and the load average before and after,
and writes everything raw to --json.

    cmake --build build --target tandem-bench-engine && bench/llama-cpp.sh
    python3 bench/longctx.py --depth 2048,8192 --rounds 2 --json OUT.json

--tandem-base PATH adds a second tandem-bench-engine (another build, e.g. the main branch) to
each round, for an A/B of kernel changes against the same llama.cpp figures. --pp-fa and --tg-fa
restrict llama.cpp's prefill and decode measures to the flash-attention settings listed (default
both, "0,1"): at 16k-32k every llama.cpp measure starts with a prefill of D tokens (minutes on
2 cores), so a long run may keep the setting that won each measure at 8k (performance.md says
which). The JSON is rewritten after every measure, so a run cut short keeps what it measured. llama.cpp runs
with --repack 0 / --no-repack (its AMX repacked path crashes on the Xeon VMs, performance.md).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def default_model():
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(cache, "tandem", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def cpu_info():
    model, flags = "?", set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name") and model == "?":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    isa = [x for x in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_int8") if x in flags]
    return model, isa


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def run(cmd, env=None, fatal=True):
    """stdout and stderr of cmd; exits when it fails, or with fatal False warns and returns
    empty output (a llama.cpp tool failing leaves its cells blank, the rest still runs)."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    t0 = time.time()
    p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    if p.returncode != 0:
        msg = f"longctx: {cmd[0]} failed ({p.returncode}):\n{p.stderr[-2000:]}"
        if fatal:
            sys.exit(msg)
        print(msg, file=sys.stderr, flush=True)
        return "", p.stderr
    print(f"  ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    return p.stdout, p.stderr


def tandem(binary, model, threads, depths, steps, kv):
    env = dict(os.environ, OMP_WAIT_POLICY=os.environ.get("OMP_WAIT_POLICY", "passive"))
    with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
        run([binary, "-m", model, "-t", str(threads), "--depth", ",".join(map(str, depths)),
             "--steps", str(steps), "--kv", kv, "--json", tmp.name], env)
        doc = json.load(open(tmp.name))
    out = {}
    for d, r in doc["depth"].items():
        out[f"pp{d}"] = r["prefill_tokens_per_s"]
        out[f"tg{d}b1"] = 1.0 / r["decode_step_s"]["1"]
        out[f"tg{d}b8"] = 8.0 / r["decode_step_s"]["8"]
        if "8_shared_prompt" in r["decode_step_s"]:  # as llama-batched-bench -pps
            out[f"tg{d}b8s"] = 8.0 / r["decode_step_s"]["8_shared_prompt"]
    return out, doc["backend"]


def llama(bindir, model, threads, depths, steps, kv, pp_fa, tg_fa, out, save):
    """llama.cpp's figures into out (saved by save() after each tool run)."""
    dl = ",".join(map(str, depths))
    # the same KV type as Tandem's: q8 -> llama.cpp's q8_0 K and V cache (a quantized V cache
    # needs flash attention there, so its flash-off cells stay blank)
    ctk = ["-ctk", "q8_0", "-ctv", "q8_0"] if kv == "q8" else []
    common = ["-m", model, "-t", str(threads), "--repack", "0", "-r", "1", "-o", "json"] + ctk
    js, _ = run([f"{bindir}/llama-bench", "-p", dl, "-n", "0", "-fa", pp_fa] + common,
                fatal=False)
    for r in json.loads(js or "[]"):
        k = f"pp{r['n_prompt']}"
        out[k] = max(out.get(k, 0), r["avg_ts"])
        out[k + "_fa" + str(int(bool(r.get("flash_attn"))))] = r["avg_ts"]
    save()
    js, _ = run([f"{bindir}/llama-bench", "-p", "0", "-n", str(steps), "-d", dl, "-fa", tg_fa]
                + common, fatal=False)
    for r in json.loads(js or "[]"):
        k = f"tg{r['n_depth']}b1"
        out[k] = max(out.get(k, 0), r["avg_ts"])
        out[k + "_fa" + str(int(bool(r.get("flash_attn"))))] = r["avg_ts"]
    save()
    bb = f"{bindir}/llama-batched-bench"
    if os.access(bb, os.X_OK):
        for d in depths:
            for fa in ("on" if x == "1" else "off" for x in tg_fa.split(",")):
                txt, _ = run([bb, "-m", model, "-t", str(threads), "-c", str(8 * (d + steps) + 64),
                              "-b", "2048", "-ub", "512", "-npp", str(d), "-ntg", str(steps),
                              "-npl", "8", "-pps", "-fa", fa, "--no-repack", *ctk,
                              "--output-format", "jsonl"], fatal=False)
                for line in txt.splitlines():
                    if line.startswith("{"):
                        r = json.loads(line)
                        k = f"tg{d}b8"
                        out[k] = max(out.get(k, 0), r["speed_tg"])
                        out[f"{k}_fa{int(fa == 'on')}"] = r["speed_tg"]
                save()
    return out


def fa_cell(figures, key):
    """A flash-attention column's cell: the figure, or "-" for a setting not run."""
    return f"{figures[key]:.1f}" if key in figures else "-"


def fa_list(text):
    """A --pp-fa / --tg-fa value: "0", "1" or "0,1"."""
    vals = text.split(",")
    if not vals or any(v not in ("0", "1") for v in vals) or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"'{text}': expected 0, 1 or 0,1")
    return text


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=default_model(), help="GGUF file both sides run")
    ap.add_argument("--threads", type=int, default=2, help="threads of both sides (default 2)")
    ap.add_argument("--depth", default="2048,8192",
                    help="comma-separated context depths D, tokens (default 2048,8192)")
    ap.add_argument("--steps", type=int, default=16,
                    help="decode steps measured at each depth (default 16)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternated rounds; the best of them is kept (default 1)")
    ap.add_argument("--kv", default="f16", choices=("f16", "q8"),
                    help="KV cache type of both sides (llama.cpp: q8_0 K and V)")
    ap.add_argument("--tandem", default=str(ROOT / "build/bench/tandem-bench-engine"),
                    help="the tandem-bench-engine binary (default build/bench/...)")
    ap.add_argument("--tandem-base", default=None,
                    help="a second tandem-bench-engine (another build) run each round, for an A/B")
    ap.add_argument("--llama-bin", default=None,
                    help="llama.cpp's bin folder (default: what bench/llama-cpp.sh --print says)")
    ap.add_argument("--pp-fa", type=fa_list, default="0,1",
                    help="llama.cpp prefill's flash-attention settings (0,1)")
    ap.add_argument("--tg-fa", type=fa_list, default="0,1",
                    help="llama.cpp decode's flash-attention settings (0,1)")
    ap.add_argument("--json", default=None,
                    help="file the raw results are written to, after every measure")
    a = ap.parse_args()
    depths = [int(x) for x in a.depth.split(",")]
    bindir = a.llama_bin or run([str(ROOT / "bench/llama-cpp.sh"), "--print"])[0].strip()
    model_name, isa = cpu_info()
    doc = {"cpu": model_name, "isa": isa, "threads": a.threads, "model": a.model,
           "depths": depths, "steps": a.steps, "kv": a.kv, "pp_fa": a.pp_fa, "tg_fa": a.tg_fa,
           "load_before": loadavg(), "rounds": []}

    def save():
        if a.json:
            with open(a.json, "w") as f:
                json.dump(doc, f, indent=1)

    best = {"tandem": {}, "base": {}, "llama": {}}
    for r in range(a.rounds):
        rd = {}
        doc["rounds"].append(rd)
        rd["tandem"], doc["backend"] = tandem(a.tandem, a.model, a.threads, depths, a.steps, a.kv)
        save()
        if a.tandem_base:
            rd["base"], _ = tandem(a.tandem_base, a.model, a.threads, depths, a.steps, a.kv)
            save()
        rd["llama"] = {}
        llama(bindir, a.model, a.threads, depths, a.steps, a.kv, a.pp_fa, a.tg_fa, rd["llama"],
              save)
        rd["load"] = loadavg()
        for side in ("tandem", "base", "llama"):
            for k, v in rd.get(side, {}).items():
                best[side][k] = max(best[side].get(k, 0), v)
    doc["load_after"] = loadavg()
    doc["best"] = best
    print(f"CPU {model_name} ({', '.join(isa)}), {a.threads} threads, Tandem {doc['backend']}, "
          f"KV {a.kv}; load average {doc['load_before']} before, {doc['load_after']} after; "
          f"best of {a.rounds} round(s)")
    cols = "measure", "Tandem", "llama.cpp", "ratio", "fa off", "fa on"
    if a.tandem_base:
        cols += ("base", "new/base")
    print("| " + " | ".join(cols) + " |")
    print("|" + " --- |" * len(cols))
    for d in depths:
        for k, label in ((f"pp{d}", f"prefill {d} tok/s"), (f"tg{d}b1", f"decode b1 @ {d}"),
                         (f"tg{d}b8", f"decode b8 @ {d}, 8 caches"),
                         (f"tg{d}b8s", f"decode b8 @ {d}, shared prompt")):
            # llama-batched-bench -pps runs 8 sequences over one shared prompt: its figure is
            # the shared-prompt row's baseline, and the 8-cache row's (which it does not run)
            lk = k[:-1] if k.endswith("b8s") else k
            t, l = best["tandem"].get(k), best["llama"].get(lk)
            row = [label, f"{t:.1f}" if t else "-", f"{l:.1f}" if l else "-",
                   f"{t / l:.2f}x" if t and l else "-",
                   fa_cell(best["llama"], lk + "_fa0"), fa_cell(best["llama"], lk + "_fa1")]
            if a.tandem_base:
                b = best["base"].get(k)
                row += [f"{b:.1f}" if b else "-", f"{t / b:.2f}x" if t and b else "-"]
            print("| " + " | ".join(row) + " |")
    save()


if __name__ == "__main__":
    main()
