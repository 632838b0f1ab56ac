#!/usr/bin/env bash
# test_grammar.sh - `tandem grammar check`: a valid grammar's size line, an invalid one's
# error with line, column and rule (exit 1), an instance accepted / rejected at a byte offset /
# incomplete, the token walk through the mask with the default model (when it is installed),
# and usage errors (exit 2).
# Usage: bash test_grammar.sh /path/to/tandem. Prints "N passed, M failed"; exits 1 on failure.
set -u

tandem=${1:?usage: test_grammar.sh /path/to/tandem}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

# expect WANT_RC NAME PATTERN ARGS...: `tandem grammar ARGS` exits WANT_RC and its stdout or
# stderr holds PATTERN (fixed string).
expect() {
    local want=$1 name=$2 pattern=$3
    shift 3
    "$tandem" grammar "$@" >"$tmp/out" 2>&1
    local rc=$?
    if [ "$rc" -ne "$want" ] || ! grep -qF -- "$pattern" "$tmp/out"; then
        fail=$((fail + 1))
        echo "FAIL: $name (rc $rc, want $want; pattern '$pattern')"
        sed 's/^/    /' "$tmp/out"
    else
        pass=$((pass + 1))
    fi
}

cat >"$tmp/num.gbnf" <<'G'
# a list of numbers
root ::= "[" num ("," num)* "]"
num  ::= "-"? [0-9]+
G
printf '[1,-22,3]' >"$tmp/ok.txt"
printf '[1,x]' >"$tmp/bad.txt"
printf '[1,2' >"$tmp/part.txt"
printf 'root ::= "a"\nx ::= y\n' >"$tmp/undef.gbnf"

expect 0 "valid grammar" "grammar: 6 rules" check --grammar "$tmp/num.gbnf"
expect 1 "undefined rule" "undef.gbnf: line 2, column 7 (rule x): undefined rule 'y'" \
    check --grammar "$tmp/undef.gbnf"
expect 0 "accepted" "instance: accepted (9 bytes)" check -g "$tmp/num.gbnf" -i "$tmp/ok.txt"
expect 1 "rejected" "instance: rejected at byte offset 3" check -g "$tmp/num.gbnf" -i "$tmp/bad.txt"
expect 1 "incomplete" "instance: incomplete (4 bytes" check -g "$tmp/num.gbnf" -i "$tmp/part.txt"
expect 1 "other root" "no rule named 'list'" check -g "$tmp/num.gbnf" --root list
expect 1 "missing file" "$tmp/none.gbnf" check -g "$tmp/none.gbnf"
expect 2 "no subcommand" "expecting the subcommand 'check'" --grammar "$tmp/num.gbnf"
expect 2 "no grammar" "--grammar or --schema is required" check
expect 2 "both" "--grammar and --schema exclude each other" check -g "$tmp/num.gbnf" -s "$tmp/num.gbnf"

printf '{"type":"object","properties":{"name":{"type":"string","maxLength":10},"age":{"type":"integer","minimum":0,"maximum":150}},"required":["name","age"]}' >"$tmp/person.json"
printf '{"name":"Bob","age":42}' >"$tmp/bob.json"
printf '{"name":"Bob","age":420}' >"$tmp/old.json"
printf '{"type":"object","propertyNames":{"maxLength":3}}' >"$tmp/pattern.json"
expect 0 "schema accepted" "instance: accepted (23 bytes)" check --schema "$tmp/person.json" -i "$tmp/bob.json"
expect 1 "schema bound" "instance: rejected at byte offset 22" check -s "$tmp/person.json" -i "$tmp/old.json"
expect 1 "schema refused" "pattern.json: /propertyNames: not supported" check -s "$tmp/pattern.json"
expect 0 "schema print" 'root ::= ' check -s "$tmp/person.json" --print
expect 0 "help" "usage: tandem grammar check" --help

model=${TANDEM_MODEL:-${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf}
if [ -f "$model" ]; then
    expect 0 "tokens accepted" "end of output allowed (accepted)" \
        check -g "$tmp/num.gbnf" -i "$tmp/ok.txt" -m "$model" --time
    expect 0 "mask times" "mask time over" check -g "$tmp/num.gbnf" -i "$tmp/ok.txt" -m "$model" --time
    expect 1 "token refused" "is not in the mask" check -g "$tmp/num.gbnf" -i "$tmp/bad.txt" -m "$model"
else
    echo "note: $model is missing: the --model cases did not run"
fi

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
