#!/usr/bin/env bash
# bench/synth-check.sh - is a `tandem model synth` file a fair benchmark? Runs llama.cpp's
# llama-bench decode (tg) on it and compares the tokens/s with the memory bound measured in the
# same run: bound tokens/s = memcpy bandwidth / weight bytes, the memcpy figure measured as
# bench_engine.c does (single thread, 256 MiB, bytes read + written, best of 5). A fair file
# decodes at >= 0.7x the bound (random N(0, 0.02) weights once gave 0.8 tokens/s on 684 MB:
# an artefact of the values, not of the shape). Writes the 1B file first when it is absent.
# Then the same decode on the default model (SmolLM2-135M, Q4_1) and on a synth file of its
# shape and types: a value artefact shows as a ratio far from 1 there whatever the machine.
#
# usage: bench/synth-check.sh [BUILD_DIR] [MODEL]   (default build/, a llama-3.2-1b Q4_1 file
#        in $CACHE/models/synth-llama-3.2-1b-Q4_1.gguf); env THREADS=2, TG=64, MIN_RATIO=0.7
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/tandem
model=${2:-$cache/models/synth-llama-3.2-1b-Q4_1.gguf}
threads=${THREADS:-2}
tg=${TG:-64}
min_ratio=${MIN_RATIO:-0.7}
bin=$(bench/llama-cpp.sh --print)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

if [ ! -f "$model" ]; then
    "$build/client/tandem" model synth --shape llama-3.2-1b --type Q4_1 -o "$model.part"
    mv "$model.part" "$model"
fi

cat >"$work/memcpy.c" <<'C'
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(void) {
    size_t n = (size_t)256 << 20; char *a = malloc(n), *b = malloc(n); double best = 1e30;
    if (!a || !b) return 1;
    memset(a, 1, n); memset(b, 2, n);
    for (int r = 0; r < 5; r++) { double t0 = now(); memcpy(r % 2 ? a : b, r % 2 ? b : a, n); double dt = now() - t0; if (dt < best) best = dt; }
    printf("%.0f\n", 2.0 * (double)n / best); return 0;
}
C
cc -O2 -o "$work/memcpy" "$work/memcpy.c"
bw_before=$("$work/memcpy")
"$bin/llama-bench" -m "$model" -t "$threads" -p 0 -n "$tg" -r 3 -o json >"$work/tg.json" 2>/dev/null
bw_after=$("$work/memcpy")
real=$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf
if [ -f "$real" ]; then
    "$build/client/tandem" model synth --shape smollm2-135m --type Q4_1 --vocab "$real" \
        -o "$work/s135.gguf" >/dev/null
    for i in 1 2; do # interleaved, so load from other processes hits both alike
        "$bin/llama-bench" -m "$real" -t "$threads" -p 0 -n "$tg" -r 3 -o json >"$work/real$i.json" 2>/dev/null
        "$bin/llama-bench" -m "$work/s135.gguf" -t "$threads" -p 0 -n "$tg" -r 3 -o json >"$work/synth$i.json" 2>/dev/null
    done
fi
python3 - "$work/tg.json" "$bw_before" "$bw_after" "$min_ratio" "$model" <<'PY'
import json, sys
runs = json.load(open(sys.argv[1]))
bw = max(float(sys.argv[2]), float(sys.argv[3]))
r = runs[0]
tps, size = r["avg_ts"], r["model_size"]
bound = bw / size
ratio = tps / bound
print(f"model {sys.argv[5]}: {size / 2**20:.0f} MiB weights, {r['model_type']}")
print(f"memcpy bandwidth {bw / 1e9:.2f} GB/s (read + write): bound {bound:.1f} tokens/s")
print(f"llama-bench tg{r['n_gen']} -t {r['n_threads']}: {tps:.2f} tokens/s = {ratio:.2f}x the bound")
import glob, os
d = os.path.dirname(sys.argv[1])
real = [json.load(open(f))[0]["avg_ts"] for f in sorted(glob.glob(d + "/real*.json"))]
synth = [json.load(open(f))[0]["avg_ts"] for f in sorted(glob.glob(d + "/synth*.json"))]
if real and synth:
    print(f"SmolLM2-135M Q4_1 tg{r['n_gen']}: real weights {max(real):.1f} tokens/s, synth "
          f"{max(synth):.1f} tokens/s: synth / real = {max(synth) / max(real):.2f}")
sys.exit(0 if ratio >= float(sys.argv[4]) else 1)
PY
