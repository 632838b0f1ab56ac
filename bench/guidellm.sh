#!/usr/bin/env bash
# bench/guidellm.sh - guidellm (PyPI `guidellm`, vLLM's benchmark tool) against a local Tandem
# cluster, offline: 1 prefill + 1 decode node on loopback started with `tandem cluster up`, the
# Hugging Face tokenizer that `tandem tokenizer export` writes from the served GGUF, synthetic
# prompts (guidellm's synthetic_text data), a concurrency profile of a few levels with a fixed
# duration each, and guidellm's own summary table on stdout.
#
# guidellm is installed into a venv under ~/.cache/tandem/ (not the repository) on first use
# (GUIDELLM_VERSION, default 0.8.1). Nothing reaches a hub: HF_HUB_OFFLINE=1 and
# TRANSFORMERS_OFFLINE=1, the tokenizer is a local folder, the data synthetic.
#
# usage: bench/guidellm.sh [BUILD_DIR] (default build/); env MODEL (default the scripts/setup
#        model), STREAMS="1 2 4" (concurrency levels), SECONDS_PER_LEVEL=40, PROMPT_TOKENS=128,
#        OUTPUT_TOKENS=64, THREADS=nproc/2 (per node), OUT=FILE.json (also write guidellm's full
#        JSON report there; about 0.5 MB).
set -euo pipefail
cd "$(dirname "$0")/.."

build=${1:-build}
tandem=$build/client/tandem
cache=${XDG_CACHE_HOME:-$HOME/.cache}/tandem
model=${MODEL:-$cache/models/SmolLM2-135M-Instruct.Q4_1.gguf}
streams=${STREAMS:-1 2 4}
per_level=${SECONDS_PER_LEVEL:-40}
prompt_tokens=${PROMPT_TOKENS:-128}
output_tokens=${OUTPUT_TOKENS:-64}
cores=$(nproc)
threads=${THREADS:-$(((cores + 1) / 2))}
version=${GUIDELLM_VERSION:-0.8.1}
venv=$cache/guidellm-venv
out=${OUT:-}

[ -x "$tandem" ] || { echo "guidellm.sh: $tandem not found (build first)" >&2; exit 1; }
[ -f "$model" ] || { echo "guidellm.sh: model $model not found (run scripts/setup)" >&2; exit 1; }
if ! "$venv/bin/guidellm" --version 2>/dev/null | grep -q "$version"; then
    echo "guidellm.sh: installing guidellm $version into $venv" >&2
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q "guidellm==$version"
fi

work=$(mktemp -d)
trap '[ -e "$work/cluster.pids" ] && "$tandem" cluster down --pid-file "$work/cluster.pids" >/dev/null 2>&1; rm -rf "$work"' EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
http_port=$(port)
cat >"$work/cluster.yaml" <<EOF
model:
  path: $model
router:
  client_endpoint: tcp://127.0.0.1:$(port)
  node_endpoint: tcp://127.0.0.1:$(port)
  http_port: $http_port
nodes:
  - {id: prefill-0, role: prefill, threads: $threads, memory_budget: 1GiB}
  - {id: decode-0, role: decode, threads: $threads, memory_budget: 1GiB, kv_endpoint: tcp://127.0.0.1:$(port)}
EOF

"$tandem" tokenizer export "$model" "$work/tokenizer" >/dev/null
"$tandem" cluster up --config "$work/cluster.yaml" --detach --pid-file "$work/cluster.pids" \
    --log-dir "$work/logs" >/dev/null
target=http://127.0.0.1:$http_port
served=$(curl -fsS "$target/v1/models" | python3 -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')

echo "guidellm $version -> Tandem at $target (model $served), CPU: $(sed -n 's/^model name\s*: //p' /proc/cpuinfo | head -1), $threads threads per node"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL=ERROR
outputs=(--output kind=console)
[ -n "$out" ] && outputs+=(--output "kind=json,path=$out")
"$venv/bin/guidellm" run \
    --backend "kind=openai_http,target=$target,model=$served" \
    --tokenizer "kind=huggingface_auto,model=$work/tokenizer" \
    --data "kind=synthetic_text,prompt_tokens=$prompt_tokens,output_tokens=$output_tokens" \
    --profile "kind=concurrent,streams=${streams%% *}" --override profile.streams "${streams// /,}" \
    --constraint "kind=max_duration,seconds=$per_level" \
    "${outputs[@]}" --disable-console-interactive
[ -z "$out" ] || echo "wrote $out"
