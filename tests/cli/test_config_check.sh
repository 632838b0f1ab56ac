#!/usr/bin/env bash
# test_config_check.sh - `tandem config check` opens each model file that exists as the daemons
# do at start: a max_context past the trained context (SmolLM2: 8,192) and a file that is not a
# GGUF are errors naming the key or the file (exit 1), the trained context itself is accepted,
# a model file that is not there yet is only a note (exit 0), and a node's memory_budget that
# cannot hold the weights, scratch and one full-context sequence is an error (exit 1). Needs the default model (exit
# 77, skipped, without it).
# Usage: bash test_config_check.sh /path/to/tandem. Prints "N passed, M failed"; exits 1 on
# failure.
set -u

tandem=${1:?usage: test_config_check.sh /path/to/tandem}
model=${TANDEM_MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ ! -f "$model" ]; then
    echo "SKIP: no model at $model (scripts/setup installs it)"
    exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

# check NAME RC TEXT YAML: `tandem config check` of a config whose model section is YAML exits
# RC and its stderr holds TEXT (fixed string; "" = anything).
check() {
    local name=$1 want=$2 text=$3
    printf 'model:\n%s\n' "$4" >"$tmp/c.yaml"
    TANDEM_MODEL=$model "$tandem" config check "$tmp/c.yaml" >"$tmp/out" 2>"$tmp/err"
    local rc=$?
    if [ "$rc" -ne "$want" ] || { [ -n "$text" ] && ! grep -qF -- "$text" "$tmp/err"; }; then
        fail=$((fail + 1))
        echo "FAIL: $name: rc=$rc (want $want), stderr lacks '$text'?"
        sed 's/^/    /' "$tmp/err"
        return
    fi
    pass=$((pass + 1))
}

check "max_context past the trained context" 1 \
    "max_context 9000 is past the model's trained context of 8192 tokens" \
    "  path: \"$model\"
  max_context: 9000"
check "max_context at the trained context" 0 "" \
    "  path: \"$model\"
  max_context: 8192"
check "the default context" 0 "" "  path: \"$model\""
printf 'not a gguf file\n' >"$tmp/junk.gguf"
check "a file that is not a GGUF" 1 "model $tmp/junk.gguf:" "  path: \"$tmp/junk.gguf\""
check "a model not there yet is a note" 0 "does not exist" "  path: \"$tmp/absent.gguf\""

# A node's memory_budget is sized as the node sizes it at start (weights + engine scratch + one
# full-context sequence of KV): 1 MiB is refused naming memory_budget and the bytes it needs.
check "a memory_budget the node would refuse" 1 "raise memory_budget to at least" \
    "  path: \"$model\"
nodes:
  - id: prefill-0
    role: prefill
    memory_budget: 1MiB
  - id: decode-0
    role: decode
    memory_budget: 2GiB"
check "memory budgets that hold the model" 0 "" \
    "  path: \"$model\"
nodes:
  - id: prefill-0
    role: prefill
    memory_budget: 1GiB
  - id: decode-0
    role: decode
    memory_budget: 1GiB"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
