#!/usr/bin/env bash
# bench/moe.sh - the engine on a mixture-of-experts model against llama.cpp on the same file:
# a `tandem model synth` Qwen3-30B-A3B (128 experts, 8 per token, expert hidden size 768,
# n_embd 2048, its 151,936-token vocabulary) cut to LAYERS layers, then bench/engine.py
# (prefill 128/512, decode at batch 1/8/32/64; llama.cpp through llama-cpp-python, prefill and
# batch-1 decode, same threads, ratios from one run). Writes the file once into $CACHE/models.
# A few layers keep the file near 1.4 GB (2 layers, Q4_0: the untied 151,936 x 2048 embedding
# and output matrices are most of it), so the measure leans on the output matrix more than the
# full model would; per layer, a token reads 8 of the 128 experts.
#
# usage: bench/moe.sh [BUILD_DIR] [JSON_OUT]   env LAYERS=2, TYPE=Q4_0, THREADS=2, STEPS=8,
#        PYTHON (one with llama-cpp-python; default the golden venv, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
out=${2:-}
cache=${XDG_CACHE_HOME:-$HOME/.cache}/tandem
layers=${LAYERS:-2}
type=${TYPE:-Q4_0}
model=$cache/models/synth-qwen3-30b-a3b-${layers}l-$type.gguf
python=${PYTHON:-$cache/golden-venv/bin/python}
[ -x "$python" ] || python=python3

if [ ! -f "$model" ]; then
    "$build/client/tandem" model synth --shape qwen3-30b-a3b --layers "$layers" --type "$type" \
        -o "$model.part"
    mv "$model.part" "$model"
fi
args=(--model "$model" --threads "${THREADS:-2}" --steps "${STEPS:-8}"
      --bench-bin "$build/bench/tandem-bench-engine")
[ -n "$out" ] && args+=(--json "$out")
exec "$python" bench/engine.py "${args[@]}"
