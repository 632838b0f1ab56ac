#!/usr/bin/env bash
# bench/cluster.sh - disaggregated vs colocated serving on this machine, through the router:
# (a) 1 prefill + 1 decode node, (b) one decode node that prefills its own prompts (no prefill
# node: the router sends local_prefill reservations). Each configuration is started with
# `tandem cluster up`, loaded by `tandem bench` at each rate (Poisson arrivals), and stopped.
# Prints one table and writes bench/results/cluster-<date>.json.
#
# The machine's cores are split the same way in both: by default each of the two disaggregated
# nodes gets half the cores (threads), the colocated node all of them.
#
# usage: bench/cluster.sh [BUILD_DIR] (default build/); env RATES="0.5 1 2", REQUESTS=24,
#        PROMPT_LEN=96:160, OUTPUT_LEN=32, SLO_TTFT_MS=1000, SLO_TPOT_MS=100,
#        DISAGG_THREADS=nproc/2, COLOC_THREADS=nproc.
set -euo pipefail
cd "$(dirname "$0")/.."

build=${1:-build}
tandem=$build/client/tandem
rates=${RATES:-0.5 1 2}
requests=${REQUESTS:-24}
prompt_len=${PROMPT_LEN:-96:160}
output_len=${OUTPUT_LEN:-32}
slo_ttft=${SLO_TTFT_MS:-1000}
slo_tpot=${SLO_TPOT_MS:-100}
cores=$(nproc)
disagg_threads=${DISAGG_THREADS:-$(((cores + 1) / 2))}
coloc_threads=${COLOC_THREADS:-$cores}
work=$(mktemp -d)
trap 'for p in "$work"/*.pids; do [ -e "$p" ] && "$tandem" cluster down --pid-file "$p" >/dev/null 2>&1; done; rm -rf "$work"' EXIT

port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

write_config() { # name with_prefill threads
    local f=$work/$1.yaml threads=$3
    {
        echo "router:"
        echo "  client_endpoint: tcp://127.0.0.1:$(port)"
        echo "  node_endpoint: tcp://127.0.0.1:$(port)"
        echo "  http_port: $(port)"
        echo "nodes:"
        if [ "$2" = 1 ]; then
            echo "  - {id: prefill-0, role: prefill, threads: $threads, memory_budget: 1GiB}"
        fi
        echo "  - {id: decode-0, role: decode, threads: $threads, memory_budget: 1GiB, kv_endpoint: tcp://127.0.0.1:$(port)}"
    } >"$f"
    echo "$f"
}

results=()
printf '%-12s %6s %9s %9s %9s %9s %9s %9s %8s %8s\n' config rate ttft_p50 ttft_p90 ttft_p99 \
    tpot_p50 tpot_p90 e2e_p50 tok/s goodput
for cfg in disagg colocated; do
    with_prefill=$([ $cfg = disagg ] && echo 1 || echo 0)
    threads=$([ $cfg = disagg ] && echo "$disagg_threads" || echo "$coloc_threads")
    conf=$(write_config $cfg "$with_prefill" "$threads")
    router=$(sed -n 's/^  client_endpoint: //p' "$conf")
    "$tandem" cluster up --config "$conf" --detach --pid-file "$work/$cfg.pids" \
        --log-dir "$work/logs-$cfg" >/dev/null 2>&1
    # Warm-up (page in the weights, touch the KV pools), with prompts no run uses again.
    "$tandem" bench --router "$router" --concurrency 2 --requests 4 --seed 999 \
        --prompt-len "$prompt_len" --output-len 8 >/dev/null
    seed=0
    for rate in $rates; do
        json=$work/$cfg-$rate.json
        seed=$((seed + 1)) # fresh prompts per run: no prefix-cache hits from an earlier run
        "$tandem" bench --router "$router" --rate "$rate" --requests "$requests" --seed "$seed" \
            --prompt-len "$prompt_len" --output-len "$output_len" --slo-ttft-ms "$slo_ttft" \
            --slo-tpot-ms "$slo_tpot" --json "$json" >/dev/null
        python3 - "$cfg" "$rate" "$json" <<'EOF'
import json, sys
cfg, rate, path = sys.argv[1], sys.argv[2], sys.argv[3]
r = json.load(open(path))
def g(*keys):
    v = r
    for k in keys:
        v = v[k]
    return v
print(f"{cfg:<12} {rate:>6} {g('ttft_ms','p50'):9.0f} {g('ttft_ms','p90'):9.0f} "
      f"{g('ttft_ms','p99'):9.0f} {g('tpot_ms','p50'):9.1f} {g('tpot_ms','p90'):9.1f} "
      f"{g('e2e_ms','p50'):9.0f} {g('throughput','output_tokens_per_s'):8.1f} "
      f"{g('goodput','share'):8.2f}")
EOF
        results+=("$json")
    done
    "$tandem" cluster down --pid-file "$work/$cfg.pids" >/dev/null
done
mkdir -p bench/results
out=bench/results/cluster-$(date +%Y-%m-%d).json
python3 - "$out" "${results[@]}" <<'EOF'
import json, os, sys
out, paths = sys.argv[1], sys.argv[2:]
runs = []
for p in paths:
    name = os.path.basename(p)[:-5]
    cfg, rate = name.rsplit("-", 1)
    runs.append({"config": cfg, "rate": float(rate), "result": json.load(open(p))})
json.dump({"bench": "cluster", "runs": runs}, open(out, "w"), indent=1)
print(f"wrote {out}")
EOF
