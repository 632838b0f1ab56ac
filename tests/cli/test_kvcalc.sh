#!/usr/bin/env bash
# test_kvcalc.sh - `tandem kvcalc`: exact sizes for Llama-2-7B, the GQA line, --json, fit and
# no-fit against --memory, byte-size parsing, and usage errors (exit 2 naming the option).
# Usage: bash test_kvcalc.sh /path/to/tandem. Prints "N passed, M failed"; exits 1 on failure.
set -u

tandem=${1:?usage: test_kvcalc.sh /path/to/tandem}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

# kvcalc ARGS...: runs `tandem kvcalc ARGS`, keeping stdout in $out, stderr in $err, status in $rc.
kvcalc() {
    "$tandem" kvcalc "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
    out=$(cat "$tmp/out")
    err=$(cat "$tmp/err")
}

ok() { pass=$((pass + 1)); }
bad() {
    fail=$((fail + 1))
    echo "FAIL: $1"
    echo "  args: ${args[*]}"
    echo "  rc=$rc stdout:"; sed 's/^/    /' "$tmp/out"
    echo "  stderr:"; sed 's/^/    /' "$tmp/err"
}

# expect_out "NAME" ARGS... -- LINE...: exit 0 and every LINE present (fixed string) in stdout.
expect_out() {
    local name=$1; shift
    args=()
    while [ "$1" != "--" ]; do args+=("$1"); shift; done
    shift
    kvcalc "${args[@]}"
    if [ "$rc" -ne 0 ]; then bad "$name: exit $rc"; return; fi
    local line
    for line in "$@"; do
        if ! grep -qF -- "$line" "$tmp/out"; then bad "$name: missing '$line'"; return; fi
    done
    ok
}

# expect_usage "NAME" TEXT ARGS...: exit 2, and stderr names TEXT.
expect_usage() {
    local name=$1 text=$2; shift 2
    args=("$@")
    kvcalc "${args[@]}"
    if [ "$rc" -ne 2 ]; then bad "$name: expected exit 2, got $rc"; return; fi
    if ! grep -qF -- "$text" "$tmp/err"; then bad "$name: stderr lacks '$text'"; return; fi
    ok
}

llama=(--layers 32 --kv-heads 32 --head-dim 128)

# Llama-2-7B at f16: 524,288 bytes per token; 4096 tokens; 32 users.
expect_out "llama2 per token" "${llama[@]}" -- \
    "KV per token:             524,288 bytes (512.00 KiB)" \
    "KV per block:             8,388,608 bytes (16 tokens)" \
    "KV per sequence:          2,147,483,648 bytes (4,096 tokens, 256 blocks, 2.00 GiB)" \
    "KV for 1 user:            2,147,483,648 bytes"
expect_out "llama2 32 users" "${llama[@]}" --context 4096 --users 32 -- \
    "KV for 32 users:          68,719,476,736 bytes (8,192 blocks, 64.00 GiB)" \
    "layout:                   32 layers, 32 KV heads, head_dim 128, f16, block_size 16"
args=("${llama[@]}")
kvcalc "${args[@]}"
if grep -q "GQA" "$tmp/out"; then bad "no GQA line without --heads"; else ok; fi

# GQA: 8 KV heads of 32 query heads (Llama-2-70B-style).
expect_out "gqa" --layers 32 --kv-heads 8 --heads 32 --head-dim 128 -- \
    "KV per token:             131,072 bytes" \
    "GQA:                      8 KV heads vs 32 heads → 4.0× less KV (full MHA: 524,288 bytes per token)"

# dtypes: f32 doubles, q8 halves plus one 4-byte scale per record of a block.
expect_out "f32" "${llama[@]}" --dtype f32 -- "KV per token:             1,048,576 bytes"
expect_out "q8" "${llama[@]}" --dtype q8 -- \
    "KV per token:             262,144 bytes (256.00 KiB), plus q8 scales" \
    "KV per block:             4,202,496 bytes (16 tokens, scales included)"
expect_out "block size" "${llama[@]}" --block-size 256 --context 1000 -- \
    "KV per sequence:          536,870,912 bytes (1,000 tokens, 4 blocks, 512.00 MiB)"
# SmolLM2-135M's shape: 30 layers, 3 KV heads of 9, head_dim 64.
expect_out "smollm2 shape" --layers 30 --kv-heads 3 --heads 9 --head-dim 64 -- \
    "KV per token:             23,040 bytes" \
    "GQA:                      3 KV heads vs 9 heads → 3.0× less KV"

# --json: the same numbers.
args=("${llama[@]}" --context 4096 --users 32 --json)
kvcalc "${args[@]}"
json_ok=1
for kv in '"kv_bytes_per_token": 524288' '"kv_bytes_per_sequence": 2147483648' \
    '"kv_bytes_total": 68719476736' '"users": 32' '"dtype": "f16"' '"fits": null' \
    '"model": null' '"block_bytes": 8388608'; do
    grep -qF -- "$kv" "$tmp/out" || { json_ok=0; bad "json lacks $kv"; break; }
done
[ "$json_ok" = 1 ] && ok
if command -v python3 >/dev/null; then
    if python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert d["kv_bytes_total"] == 68719476736' "$tmp/out" 2>/dev/null; then ok; else bad "json does not parse"; fi
fi
args=(--layers 32 --kv-heads 8 --heads 32 --head-dim 128 --memory 80GiB --json)
kvcalc "${args[@]}"
if grep -qF '"gqa_factor": 4.0' "$tmp/out" && grep -qF '"fits": true' "$tmp/out" &&
    grep -qF '"memory_bytes": 85899345920' "$tmp/out" && grep -qF '"pool_blocks": 40960' "$tmp/out"; then
    ok
else
    bad "json with memory"
fi

# Fit and no fit: 32 users of Llama-2-7B need exactly 64 GiB of KV.
expect_out "fits exactly" "${llama[@]}" --users 32 --memory 64GiB -- \
    "memory budget:            68,719,476,736 bytes (64.00 GiB)" \
    "pool blocks for budget:   8,192" \
    "fits:                     yes (0 bytes to spare)" \
    "max concurrent sequences: 32 at 4,096 tokens"
expect_out "no fit with weights" "${llama[@]}" --users 32 --memory 64GiB --weights-bytes 1GiB -- \
    "weights:                  1,073,741,824 bytes (1.00 GiB)" \
    "pool blocks for budget:   8,064" \
    "fits:                     no (needs 1,073,741,824 bytes more)" \
    "max concurrent sequences: 31 at 4,096 tokens"
expect_out "80GiB" "${llama[@]}" --users 32 --memory 80GiB --weights-bytes 13.5GB -- \
    "weights:                  13,500,000,000 bytes" \
    "fits:                     yes" \
    "max concurrent sequences: 33 at 4,096 tokens"
expect_out "budget below weights" "${llama[@]}" --memory 512MiB --weights-bytes 1GiB -- \
    "memory budget:            536,870,912 bytes (512.00 MiB)" \
    "pool blocks for budget:   0" \
    "fits:                     no" \
    "max concurrent sequences: 0 at 4,096 tokens (a node refuses to start with this budget)"
expect_out "1.5GB" "${llama[@]}" --memory 1.5GB -- \
    "memory budget:            1,500,000,000 bytes" "fits:                     no"
expect_out "plain bytes" "${llama[@]}" --memory 2147483648 -- \
    "fits:                     yes (0 bytes to spare)" "max concurrent sequences: 1 at"

# A real model, when the default one is in the cache (SmolLM2-135M: 30 layers, 3/9 heads).
model=${TANDEM_MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -f "$model" ]; then
    expect_out "model" -m "$model" --users 4 -- \
        "layout:                   30 layers, 3 KV heads, head_dim 64, f16, block_size 16" \
        "KV per token:             23,040 bytes (22.50 KiB)" \
        "GQA:                      3 KV heads vs 9 heads → 3.0× less KV"
    expect_usage "model and shape" "not both" -m "$model" --layers 4
else
    fail=$((fail + 1))
    echo "FAIL: default model $model is missing: run scripts/setup"
fi
args=(-m "$tmp/none.gguf")
kvcalc "${args[@]}"
if [ "$rc" -eq 1 ] && grep -qF "none.gguf" "$tmp/err"; then ok; else bad "missing model: exit 1"; fi

# Usage errors: exit 2, naming the option and its range.
expect_usage "nothing" "give -m MODEL, or all of --layers, --kv-heads and --head-dim"
expect_usage "missing head-dim" "--head-dim" --layers 32 --kv-heads 8
expect_usage "layers 0" "--layers must be an integer in 1..65536, got '0'" --layers 0 --kv-heads 8 --head-dim 128
expect_usage "layers text" "--layers must be an integer" --layers many --kv-heads 8 --head-dim 128
expect_usage "kv-heads" "--kv-heads must be an integer in 1..65536" --layers 32 --kv-heads 70000 --head-dim 128
expect_usage "head-dim" "--head-dim must be a multiple of 4 in 4..65536, got '130'" --layers 32 --kv-heads 8 --head-dim 130
expect_usage "heads" "--heads must be a multiple of --kv-heads (8), got 12" --layers 32 --kv-heads 8 --heads 12 --head-dim 128
expect_usage "dtype" "--dtype must be f32, f16 or q8, got 'bf16'" "${llama[@]}" --dtype bf16
expect_usage "block-size" "--block-size must be a power of two in 1..256, got '24'" "${llama[@]}" --block-size 24
expect_usage "context" "--context must be an integer in 1..16777216, got '0'" "${llama[@]}" --context 0
expect_usage "users" "--users must be an integer in 1..1048576, got '-3'" "${llama[@]}" --users -3
expect_usage "memory" "--memory must be a positive byte size" "${llama[@]}" --memory 80XB
expect_usage "weights" "--weights-bytes must be a byte size" "${llama[@]}" --weights-bytes lots
expect_usage "extra arg" "unexpected argument 'extra'" "${llama[@]}" extra
expect_usage "unknown option" "usage: tandem kvcalc" "${llama[@]}" --bogus
expect_usage "huge block" "use a smaller --block-size" --layers 65536 --kv-heads 65536 --head-dim 4096

# --help goes to stdout and succeeds.
expect_out "help" --help -- "usage: tandem kvcalc" "--memory SIZE"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
