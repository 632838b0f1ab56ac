#!/usr/bin/env bash
# test_generate.sh - `tandem generate`: a real chat answer from the default model, greedy output
# identical across runs, thread counts and prefill chunk sizes, stdout carrying only the text
# and the usage figures on stderr, seeded sampling reproducible, and usage errors (exit 2
# naming the option). Usage: bash test_generate.sh /path/to/tandem. Prints "N passed, M failed".
set -u

tandem=${1:?usage: test_generate.sh /path/to/tandem}
model=${TANDEM_MODEL:-${XDG_CACHE_HOME:-$HOME/.cache}/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

if [ ! -f "$model" ]; then
    echo "FAIL: default model $model is missing: run scripts/setup"
    echo "0 passed, 1 failed"
    exit 1
fi

gen() {
    "$tandem" generate "$@" >"$tmp/out" 2>"$tmp/err"
    rc=$?
}
check() { # check NAME CONDITION-RESULT(0/1)
    if [ "$2" -eq 0 ]; then pass=$((pass + 1)); else
        fail=$((fail + 1))
        echo "FAIL: $1 (rc=$rc)"
        sed 's/^/  out: /' "$tmp/out" | head -5
        sed 's/^/  err: /' "$tmp/err" | head -5
    fi
}

# a real answer, greedy
gen -m "$model" --chat "What is the capital of France? Answer in one sentence." -n 32 -t 1
check "chat answer mentions Paris" $([ $rc -eq 0 ] && grep -q "Paris" "$tmp/out"; echo $?)
check "stderr has usage figures" $(grep -q "TTFT:" "$tmp/err" && grep -q "prompt tokens:" "$tmp/err"; echo $?)
check "stdout has no usage figures" $(! grep -q "TTFT" "$tmp/out"; echo $?)
cp "$tmp/out" "$tmp/ref"

# same greedy text with 2 threads and with a prefill chunk of 7 tokens (batch invariance)
gen -m "$model" --chat "What is the capital of France? Answer in one sentence." -n 32 -t 2 --batch 7
check "greedy output independent of threads and chunking" $(cmp -s "$tmp/out" "$tmp/ref"; echo $?)

# max tokens: finish reason length
gen -m "$model" -p "Once upon a time" -n 5 --ignore-eos
check "-n 5 stops at 5 tokens" $(grep -q "generated tokens: 5, finish: length" "$tmp/err"; echo $?)

# seeded sampling is reproducible, and different seeds differ
gen -m "$model" -p "List three colors:" -n 24 --temperature 1.0 --seed 42 --ignore-eos
cp "$tmp/out" "$tmp/s42"
gen -m "$model" -p "List three colors:" -n 24 --temperature 1.0 --seed 42 --ignore-eos
check "same seed, same text" $(cmp -s "$tmp/out" "$tmp/s42"; echo $?)
gen -m "$model" -p "List three colors:" -n 24 --temperature 1.0 --seed 7 --ignore-eos
check "different seed, different text" $(! cmp -s "$tmp/out" "$tmp/s42"; echo $?)

# q8 and f32 KV caches run
gen -m "$model" -p "The capital of France is" -n 4 --kv-dtype q8
check "--kv-dtype q8 runs" $rc
gen -m "$model" -p "The capital of France is" -n 4 --kv-dtype f32
check "--kv-dtype f32 runs" $rc
gen -m "$model" -p "The capital of France is" -n 4 -t 1 --device cpu
check "--device cpu runs" $([ $rc -eq 0 ] && grep -q "backend cpu" "$tmp/err"; echo $?)

# structured output in one process: the output matches the constraint and ends with stop
printf '{"type":"object","properties":{"city":{"type":"string","maxLength":20}},"required":["city"],"additionalProperties":false}' >"$tmp/city.json"
gen -m "$model" --chat "Which city is the capital of France? Answer in JSON." -n 64 -t 1 --json-schema "$tmp/city.json"
check "--json-schema output is the schema's JSON" $([ $rc -eq 0 ] && python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); assert list(d)==["city"] and isinstance(d["city"],str)' "$tmp/out" && grep -q "finish: stop" "$tmp/err"; echo $?)
gen -m "$model" --chat "Is water wet?" -n 8 -t 1 --temperature 1 --seed 3 --choice "yes,no"
check "--choice output is one of the choices" $([ $rc -eq 0 ] && grep -qx -e yes -e no "$tmp/out"; echo $?)
gen -m "$model" --chat "Give a number." -n 8 -t 1 --regex "[0-9]{2}"
check "--regex output matches" $([ $rc -eq 0 ] && grep -qxE "[0-9]{2}" "$tmp/out"; echo $?)
printf 'root ::= ("yes" | "no")' >"$tmp/yn.gbnf"
gen -m "$model" --chat "Is fire hot?" -n 8 -t 1 --grammar "$tmp/yn.gbnf"
check "--grammar output matches" $([ $rc -eq 0 ] && grep -qx -e yes -e no "$tmp/out"; echo $?)
gen -m "$model" --chat "A JSON object, please." -n 2 -t 1 --json-object
check "--json-object cut at -n 2 ends with length" $([ $rc -eq 0 ] && grep -q "finish: length" "$tmp/err"; echo $?)

# errors: exit 2 and the message names the option or the limit
expect_err() { # expect_err NAME PATTERN ARGS...
    local name=$1 pat=$2
    shift 2
    gen "$@"
    check "$name" $([ $rc -eq 2 ] && grep -q -- "$pat" "$tmp/err"; echo $?)
}
expect_err "engine option without -m" "-t" -t 2 -p hi
expect_err "no input" "exactly one of" -m "$model"
expect_err "two inputs" "exactly one of" -m "$model" -p hi --chat hi
expect_err "bad top-p" "top_p must be in (0, 1]" -m "$model" -p hi --top-p 1.5
expect_err "non-numeric temperature" "--temperature must be a number" -m "$model" -p hi --temperature abc
expect_err "unknown preset" "precise" -m "$model" -p hi --preset wild
expect_err "bad kv dtype" "--kv-dtype" -m "$model" -p hi --kv-dtype f8
gen -m "$model" -p hi --device tpu
check "unknown device" $([ $rc -eq 1 ] && grep -q "engine backend 'tpu' is not available" "$tmp/err"; echo $?)
expect_err "prompt longer than the context" "raise it with --ctx" -m "$model" --ctx 16 -p "$(printf 'word %.0s' $(seq 1 40))"
expect_err "ctx beyond the model" "exceeds the model's context length" -m "$model" --ctx 100000 -p hi
expect_err "two constraints" "at most one of" -m "$model" -p hi --regex a --choice b
printf 'root ::= (' >"$tmp/bad.gbnf"
expect_err "bad grammar" "line 1" -m "$model" -p hi --grammar "$tmp/bad.gbnf"
printf '{"type":"object","propertyNames":{"maxLength":3}}' >"$tmp/bad.json"
expect_err "unsupported schema keyword" "propertyNames" -m "$model" -p hi --json-schema "$tmp/bad.json"
TANDEM_CPU_KERNELS=bogus gen -m "$model" -p hi -n 1
check "unknown TANDEM_CPU_KERNELS refused, naming the values" $([ $rc -ne 0 ] && grep -q "TANDEM_CPU_KERNELS='bogus' is not one of auto, scalar, avx2" "$tmp/err"; echo $?)
gen -m /nonexistent.gguf -p hi
check "missing model file: exit 1 with the path" $([ $rc -eq 1 ] && grep -q "/nonexistent.gguf" "$tmp/err"; echo $?)

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
