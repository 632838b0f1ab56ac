#!/usr/bin/env bash
# test_check_length.sh - scripts/check-length on generated C files: a 100-line function passes
# and a 101-line one fails naming it with its file, line and length; 19 functions of 61 lines
# pass and 20 fail, listed longest first; a function of 60 lines is not counted as long.
# Usage: bash test_check_length.sh [/path/to/tandem] (the argument is not used). Skips (77)
# when lizard is not installed. Prints "N passed, M failed"; exits 1 on failure.
set -u

src=${TDM_SOURCE_DIR:-$(cd "$(dirname "$0")/../.." && pwd)}
script=$src/scripts/check-length
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

venv=${XDG_CACHE_HOME:-${HOME:-/nonexistent}/.cache}/tandem/venv
if [ -z "${LIZARD:-}" ] && ! { [ -x "$venv/bin/python3" ] && "$venv/bin/python3" -c 'import lizard' 2>/dev/null; } &&
    ! command -v lizard >/dev/null; then
    echo "SKIP: lizard is not installed (scripts/setup installs it)"
    exit 77
fi

# func NAME LINES: a C function of exactly LINES lines (lizard's length: first to last line).
func() {
    local name=$1 lines=$2 i
    echo "int $name(int x)"
    echo "{"
    for ((i = 0; i < lines - 4; i++)); do
        echo "    x += $i;"
    done
    echo "    return x;"
    echo "}"
}

# check NAME WANT_RC PATTERN... : runs the script on $tmp/case; exit status WANT_RC and every
# PATTERN (extended regex) in its output.
check() {
    local name=$1 want=$2
    shift 2
    bash "$script" "$tmp/case" >"$tmp/out" 2>&1
    local rc=$?
    if [ "$rc" -ne "$want" ]; then
        fail=$((fail + 1))
        echo "FAIL: $name: exit $rc, expected $want"
        sed 's/^/    /' "$tmp/out"
        return
    fi
    local p
    for p in "$@"; do
        if ! grep -qE -- "$p" "$tmp/out"; then
            fail=$((fail + 1))
            echo "FAIL: $name: no line matching '$p' in:"
            sed 's/^/    /' "$tmp/out"
            return
        fi
    done
    pass=$((pass + 1))
}

# fresh FILE: an empty case folder with one file to write into
fresh() {
    rm -rf "$tmp/case"
    mkdir -p "$tmp/case"
    : >"$tmp/case/$1"
}

fresh a.c
func ok100 100 >>"$tmp/case/a.c"
func short 10 >>"$tmp/case/a.c"
check "a 100-line function passes" 0 "^check-length: 2 functions in 1 files: 0 longer than 100 lines" \
    "1 longer than 60"

fresh a.c
func short 10 >>"$tmp/case/a.c"
func big101 101 >>"$tmp/case/a.c"
check "a 101-line function fails" 1 "1 longer than 100 lines" \
    "^ +101 lines +$tmp/case/a.c:11 big101 +\(over 100\)$"

fresh b.c
for i in $(seq 1 19); do func "long$i" 61 >>"$tmp/case/b.c"; done
func sixty 60 >>"$tmp/case/b.c"
check "19 functions over 60 lines pass" 0 "19 longer than 60 \(allowed: fewer than 20\)"

fresh b.c
for i in $(seq 1 19); do func "long$i" 61 >>"$tmp/case/b.c"; done
func long20 75 >>"$tmp/case/b.c"
check "20 functions over 60 lines fail, longest first" 1 "20 longer than 60" \
    "^ +75 lines +$tmp/case/b.c:[0-9]+ long20$" "^ +61 lines +$tmp/case/b.c:1 long1$"
if [ "$(grep -c ' lines  ' "$tmp/out")" -ne 20 ] || ! sed -n 2p "$tmp/out" | grep -q long20; then
    fail=$((fail + 1))
    echo "FAIL: the listing has 20 lines, long20 first:"
    sed 's/^/    /' "$tmp/out"
else
    pass=$((pass + 1))
fi

fresh c.h
check "no C function at all" 0 "^check-length: 0 functions in 1 files"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
