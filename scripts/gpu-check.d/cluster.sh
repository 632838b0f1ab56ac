#!/usr/bin/env bash
# scripts/gpu-check.d/cluster.sh - gpu-check's cluster stage: a prefill node and a decode node
# on one GPU (device: cuda:0 both, gpu_memory_utilization 0.4 each) and a router, started from
# the packed daemons on the truncated model; one greedy request through the router must give
# the text `tandem generate -m MODEL --device cuda:0` gives in one process, `tandem status
# --json` must route prefill-0 -> decode-0 over cuda_ipc, and the same prompt inside a batch
# of 32 concurrent requests is compared with it alone (INFO, not FAIL, when they differ: the
# CUDA engine is documented as not batch-invariant).
#
# gpu-check sources this file and calls stage_cluster. Run directly, it checks the same logic
# on this machine: GPU_CHECK_DEVICE=cpu (device: cpu both, tcp routes expected, memory_budget
# instead of the GPU share), binaries from BUILD_DIR (default build), model MODEL (default the
# truncated one in gpu-pack/models/, else the default SmolLM2):
#
#   GPU_CHECK_DEVICE=cpu BUILD_DIR=build scripts/gpu-check.d/cluster.sh
#
# Environment: GPU_CHECK_DEVICE (cuda, the default, or cpu), CLUSTER_TOKENS (default 24),
# CLUSTER_BATCH (default 32).

# The smaller of $1 seconds and what is left of gpu-check's budget.
cluster_limit() {
    local l
    l=$(left_s)
    echo $((l < $1 ? l : $1))
}

# A free TCP port on 127.0.0.1 (python3 when present, else a random high one).
cluster_port() {
    python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])' \
        2>/dev/null || echo $((20000 + RANDOM % 20000))
}

# cluster_config FILE MODEL DEVICE: the config of the two nodes and the router.
cluster_config() {
    local place
    if [ "$3" = cpu ]; then
        place="device: cpu, threads: 1, memory_budget: 512MiB"
    else
        place="device: $3, threads: 4, gpu_memory_utilization: 0.4"
    fi
    {
        echo "model: {path: $2}"
        echo "router:"
        echo "  client_endpoint: tcp://127.0.0.1:$(cluster_port)"
        echo "  node_endpoint: tcp://127.0.0.1:$(cluster_port)"
        echo "  http_port: $(cluster_port)"
        echo "nodes:"
        echo "  - {id: prefill-0, role: prefill, $place}"
        echo "  - {id: decode-0, role: decode, $place, kv_endpoint: \"tcp://127.0.0.1:$(cluster_port)\"}"
    } >"$1"
}

# cluster_start CONFIG DIR: the router, then the prefill node, then the decode node (one after
# the other: each GPU node checks the device's free memory at its own start), each logging to
# DIR/NAME.log, their pids in cluster_pids; waits until `tandem status --json` shows both nodes
# up and a KV route. Returns 1 (the status or the logs' tails said) when they do not come up.
cluster_start() {
    local conf=$1 dir=$2 ep deadline js
    ep=$(sed -n 's/^  client_endpoint: //p' "$conf")
    cluster_pids=()
    run_bin 600 tandem-router --config "$conf" >"$dir/router.log" 2>&1 &
    cluster_pids+=($!)
    for node in prefill-0:tandem-prefill decode-0:tandem-decode; do
        run_bin 600 "${node#*:}" --config "$conf" --node-id "${node%%:*}" \
            >"$dir/${node%%:*}.log" 2>&1 &
        cluster_pids+=($!)
        deadline=$(($(date +%s) + $(cluster_limit 120)))
        while [ "$(date +%s)" -lt "$deadline" ]; do
            js=$(run_bin 10 tandem status --router "$ep" --json 2>/dev/null) || js=""
            if echo "$js" | tr -d ' \n' | grep -q "\"node_id\":\"${node%%:*}\"[^}]*\"up\":true"; then
                break
            fi
            kill -0 "${cluster_pids[-1]}" 2>/dev/null || break
            sleep 1
        done
    done
    js=$(run_bin 10 tandem status --router "$ep" --json 2>&1) || js=""
    cluster_status_json=$js
    if ! echo "$js" | tr -d ' \n' | grep -q '"kv_routes":\[{'; then
        say "  the nodes did not come up; status: $(echo "$js" | head -c 400)"
        for f in "$dir"/*.log; do
            say "  -- $(basename "$f"):"
            tail -n 8 "$f" | sed 's/^/    /' | tee -a "$report"
        done
        return 1
    fi
}

# Stops the daemons: each pid is the background shell running run_bin; its child is the
# `timeout` that passes SIGTERM on to the daemon.
cluster_stop() {
    local p
    for p in "${cluster_pids[@]}"; do pkill -TERM -P "$p" 2>/dev/null; done
    for p in "${cluster_pids[@]}"; do wait "$p" 2>/dev/null; done
    cluster_pids=()
}

# cluster_batch EP PROMPT N TOKENS DIR: N concurrent greedy requests, the first with PROMPT,
# the others with distinct prompts; PROMPT's text in DIR/batch-0.out. Returns 1 when any failed.
cluster_batch() {
    local ep=$1 prompt=$2 n=$3 tokens=$4 dir=$5 i pids=() bad=0
    for ((i = 0; i < n; i++)); do
        local p=$prompt
        [ "$i" -gt 0 ] && p="Request $i of the batch: write about the number $((i * 37 % 101))."
        run_bin "$(cluster_limit 300)" tandem generate --router "$ep" -p "$p" -n "$tokens" \
            >"$dir/batch-$i.out" 2>"$dir/batch-$i.err" &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i" || bad=1; done
    return $bad
}

# stage_cluster: see the top of this file. Uses gpu-check's say/result/run_bin/left_s and
# TDM_GPU_LOGITS_MODEL (the truncated model).
stage_cluster() {
    local t0 dev=${GPU_CHECK_DEVICE:-cuda} device route dir conf ep want
    local tokens=${CLUSTER_TOKENS:-24} nbatch=${CLUSTER_BATCH:-32}
    local prompt="The capital of France is a city that"
    t0=$(date +%s)
    local model=${TDM_GPU_LOGITS_MODEL:-}
    if [ -z "$model" ] || [ ! -f "$model" ]; then
        result cluster SKIP 0 "no truncated model in the pack"
        return 0
    fi
    if [ "$dev" = cpu ]; then device=cpu route=tcp; else device=cuda:0 route=cuda_ipc; fi
    dir="$work/cluster"
    mkdir -p "$dir"
    conf="$dir/cluster.yaml"
    cluster_config "$conf" "$model" "$device"
    ep=$(sed -n 's/^  client_endpoint: //p' "$conf")

    # the reference: the same model and prompt in one process on the same device
    if ! run_bin "$(cluster_limit 120)" tandem generate -m "$model" --device "$device" -p "$prompt" -n "$tokens" \
        -t 1 >"$dir/single.out" 2>"$dir/single.err"; then
        result cluster FAIL $(($(date +%s) - t0)) "tandem generate --device $device: $(tail -n 2 "$dir/single.err" | tr '\n' ' ')"
        return 1
    fi
    want=$(cat "$dir/single.out")
    say "  single process ($device): $(grep -m1 'backend' "$dir/single.err")"
    say "  text: $(echo "$want" | head -c 200)"
    if ! cluster_start "$conf" "$dir"; then
        cluster_stop
        result cluster FAIL $(($(date +%s) - t0)) "prefill-0 + decode-0 ($device) did not come up (logs above)"
        return 1
    fi
    cluster_check "$ep" "$prompt" "$tokens" "$nbatch" "$dir" "$route" "$want" "$t0"
    cluster_stop
}

# cluster_check EP PROMPT TOKENS NBATCH DIR ROUTE WANT T0: the request, the route and the batch.
cluster_check() {
    local ep=$1 prompt=$2 tokens=$3 nbatch=$4 dir=$5 route=$6 want=$7 t0=$8 got routes batch
    routes=$(echo "$cluster_status_json" | tr -d ' \n' |
        grep -o '"prefill_node_id":"[^"]*","decode_node_id":"[^"]*","transport":"[^"]*"' |
        sed 's/"prefill_node_id":"\([^"]*\)","decode_node_id":"\([^"]*\)","transport":"\([^"]*\)"/\1->\2 \3/')
    say "  kv routes: ${routes:-none}"
    if ! run_bin "$(cluster_limit 120)" tandem generate --router "$ep" -p "$prompt" -n "$tokens" \
        >"$dir/routed.out" 2>"$dir/routed.err"; then
        result cluster FAIL $(($(date +%s) - t0)) "routed request failed: $(tail -n 2 "$dir/routed.err" | tr '\n' ' ')"
        return 1
    fi
    got=$(cat "$dir/routed.out")
    say "  through the router: $(echo "$got" | head -c 200)"
    if cluster_batch "$ep" "$prompt" "$nbatch" "$tokens" "$dir"; then
        if [ "$(cat "$dir/batch-0.out")" = "$want" ]; then
            batch="alone = inside a batch of $nbatch"
        else
            batch="INFO: inside a batch of $nbatch the text differs ($(head -c 80 "$dir/batch-0.out")...): the engine is not batch-invariant on this device (docs/performance.md)"
        fi
    else
        batch="INFO: some of the $nbatch concurrent requests failed: $(cat "$dir"/batch-*.err | grep -m1 -i 'error\|fail')"
    fi
    say "  batch: $batch"
    if [ "$got" != "$want" ]; then
        result cluster FAIL $(($(date +%s) - t0)) "the routed text differs from the single-process text; $batch"
    elif [ "$routes" != "prefill-0->decode-0 $route" ]; then
        result cluster FAIL $(($(date +%s) - t0)) "route is '${routes:-none}', want prefill-0->decode-0 $route; $batch"
    else
        result cluster PASS $(($(date +%s) - t0)) "routed = single-process text, route $route; $batch"
    fi
}

# Run directly: the CPU dry run of the same stage with this machine's build.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    set -uo pipefail
    cd "$(dirname "$0")/../.." || exit 2
    export GPU_CHECK_DEVICE=${GPU_CHECK_DEVICE:-cpu} OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
    build=${BUILD_DIR:-build}
    work=$(mktemp -d /tmp/gpu-check-cluster.XXXXXX)
    report=$work/report.txt
    pack=$work/pack
    mkdir -p "$pack/bin"
    for exe in client/tandem router/tandem-router prefill-node/tandem-prefill decode-node/tandem-decode; do
        ln -s "$PWD/$build/$exe" "$pack/bin/"
    done
    say() { echo "$*" | tee -a "$report"; }
    left_s() { echo 600; }
    result() { say "== stage $1: $2 ($3 s) $4"; [ "$2" != FAIL ]; }
    run_bin() {
        local limit=$1 exe="$pack/bin/$2"
        shift 2
        timeout "$limit" "$exe" "$@"
    }
    default_model=${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf
    cut=$(find gpu-pack/models -name 'smollm2-*l.gguf' -print -quit 2>/dev/null)
    TDM_GPU_LOGITS_MODEL=${MODEL:-${cut:+$PWD/$cut}}
    TDM_GPU_LOGITS_MODEL=${TDM_GPU_LOGITS_MODEL:-$default_model}
    say "cluster stage, device ${GPU_CHECK_DEVICE}, binaries $build/, model $TDM_GPU_LOGITS_MODEL"
    stage_cluster
    rc=$?
    rm -rf "$work"
    exit $rc
fi
