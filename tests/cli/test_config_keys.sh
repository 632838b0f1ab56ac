#!/usr/bin/env bash
# test_config_keys.sh - docs/operations.md's config key tables are `tandem config keys` output:
# every table under a "<!-- tandem config keys SECTION -->" marker, in order, is what the key
# table prints now (so the docs cannot drift from the code); one section alone; usage errors.
# Usage: bash test_config_keys.sh /path/to/tandem. Prints "N passed, M failed"; exits 1 on
# failure.
set -u

tandem=${1:?usage: test_config_keys.sh /path/to/tandem}
docs=${TDM_SOURCE_DIR:-$(dirname "$0")/../..}/docs/operations.md
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pass=0
fail=0

ok() { pass=$((pass + 1)); }
bad() {
    fail=$((fail + 1))
    echo "FAIL: $1"
}

# The committed tables: each marker line and the table lines after it, a blank line between.
awk '/^<!-- tandem config keys [a-z]+ -->$/ { if (n++) print ""; on = 1; print; next }
     on && /^\|/ { print; next }
     { on = 0 }' "$docs" >"$tmp/docs"

if "$tandem" config keys >"$tmp/keys" 2>"$tmp/err"; then
    if diff -u "$tmp/docs" "$tmp/keys" >"$tmp/diff"; then
        ok
    else
        bad "docs/operations.md's key tables differ from \`tandem config keys\` (- docs, + code);"
        echo "  paste each section's \`tandem config keys SECTION\` under its marker:"
        sed 's/^/    /' "$tmp/diff"
    fi
else
    bad "tandem config keys: exit $?"
    sed 's/^/    /' "$tmp/err"
fi

# every section has a marker in the docs
for section in model router kv log security nodes; do
    if grep -qxF "<!-- tandem config keys $section -->" "$docs"; then ok; else
        bad "docs/operations.md has no table marker for section $section"
    fi
done

# one section alone: its table, no marker
"$tandem" config keys kv >"$tmp/kv" 2>"$tmp/err"
rc=$?
if [ "$rc" -eq 0 ] && head -1 "$tmp/kv" | grep -qF "| key | type | default |" &&
    grep -qF '| `block_size` | int | `16` | a power of two, 1–256 tokens: ' "$tmp/kv" &&
    ! grep -q "<!--" "$tmp/kv"; then
    ok
else
    bad "tandem config keys kv: exit $rc, output:"
    sed 's/^/    /' "$tmp/kv" "$tmp/err"
fi

# usage errors: exit 2, naming the problem
expect_usage() {
    local name=$1 text=$2
    shift 2
    "$tandem" config keys "$@" >"$tmp/out" 2>"$tmp/err"
    local rc=$?
    if [ "$rc" -eq 2 ] && grep -qF -- "$text" "$tmp/err"; then ok; else
        bad "$name: exit $rc, stderr:"
        sed 's/^/    /' "$tmp/err"
    fi
}
expect_usage "unknown section" "unknown section 'nodez'" nodez
expect_usage "two sections" "unexpected argument 'log'" kv log

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
