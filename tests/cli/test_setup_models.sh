#!/usr/bin/env bash
# test_setup_models.sh - scripts/setup --model: an unknown name, or none, is refused before
# anything is installed, listing the known models; the help names them. (Installing is what
# scripts/test's own `scripts/setup --model smollm2 --model gemma3-270m` does.)
# Usage: bash test_setup_models.sh [/path/to/tandem] (the binary is not used). Exits 1 on failure.
set -u

src=${TDM_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
setup="$src/scripts/setup"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
passed=0
failed=0

# expect NAME STATUS PATTERN ARGS...: setup ARGS exits STATUS and prints PATTERN (grep -E).
expect() {
    local name=$1 want=$2 pattern=$3
    shift 3
    XDG_CACHE_HOME="$tmp/cache" bash "$setup" "$@" >"$tmp/out" 2>&1
    local rc=$?
    if [ "$rc" = "$want" ] && grep -Eq -- "$pattern" "$tmp/out"; then
        passed=$((passed + 1))
    else
        failed=$((failed + 1))
        echo "FAIL: $name: rc=$rc (want $want), output lacks /$pattern/:"
        sed 's/^/  /' "$tmp/out"
    fi
}

expect unknown 2 "unknown model 'llama-7b'; known models: smollm2 gemma3-270m" \
    --no-apt --no-venv --no-vocab --model llama-7b
expect unknown-after-known 2 "unknown model 'gemma'" \
    --no-apt --no-venv --no-vocab --model smollm2 --model=gemma
expect missing-name 2 "--model needs a name \(known models: smollm2 gemma3-270m\)" \
    --no-apt --no-venv --no-vocab --model
expect help 0 "gemma3-270m +gemma-3-270m-q4_k_m.gguf" --help
# nothing was installed by the refused runs
if [ -e "$tmp/cache/tandem" ]; then
    failed=$((failed + 1))
    echo "FAIL: a refused run created $tmp/cache/tandem"
else
    passed=$((passed + 1))
fi

echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
