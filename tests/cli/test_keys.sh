#!/usr/bin/env bash
# test_keys.sh - `tandem keys generate` and the daemons' key checks: the key files (modes, no
# overwrite without --force), the printed YAML pasted into a config that `tandem config check`
# accepts, a daemon refusing a secret key file others can read (the path in the message), and
# the refusal of a non-loopback bind without CURVE or API keys unless security.insecure. The
# daemons fail before they load a model, so no model is needed.
# Usage: bash test_keys.sh /path/to/tandem. Prints "N passed, M failed"; exits 1 on failure.
set -u

tandem=${1:?usage: test_keys.sh /path/to/tandem}
bin=$(cd "$(dirname "$tandem")/.." && pwd)
router=$bin/router/tandem-router
decode=$bin/decode-node/tandem-decode
prefill=$bin/prefill-node/tandem-prefill
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# keys by default: the daemons started below with loopback configs without keys make their
# pairs here, not in the user's ~/.local/state
export XDG_STATE_HOME=$tmp/state
pass=0
fail=0

# run CMD ARGS...: stdout in $tmp/out, stderr in $tmp/err, status in $rc (20 s at most).
run() {
    args=("$@")
    timeout 20 "$@" </dev/null >"$tmp/out" 2>"$tmp/err"
    rc=$?
}
ok() { pass=$((pass + 1)); }
bad() {
    fail=$((fail + 1))
    echo "FAIL: $1"
    echo "  args: ${args[*]}"
    echo "  rc=$rc stdout:"; sed 's/^/    /' "$tmp/out" | head -20
    echo "  stderr:"; sed 's/^/    /' "$tmp/err" | head -20
}
# expect NAME RC TEXT CMD...: exit RC and stderr contains TEXT (fixed string; "" = any).
expect() {
    local name=$1 want=$2 text=$3
    shift 3
    run "$@"
    if [ "$rc" -ne "$want" ]; then bad "$name: expected exit $want, got $rc"; return; fi
    if [ -n "$text" ] && ! grep -qF -- "$text" "$tmp/err"; then
        bad "$name: stderr lacks '$text'"; return
    fi
    ok
}
# expect_fail NAME TEXT CMD...: a non-zero exit and stderr contains TEXT.
expect_fail() {
    local name=$1 text=$2
    shift 2
    run "$@"
    if [ "$rc" -eq 0 ]; then bad "$name: expected a failure"; return; fi
    if ! grep -qF -- "$text" "$tmp/err"; then bad "$name: stderr lacks '$text'"; return; fi
    ok
}
check() {
    local name=$1
    shift
    if "$@"; then ok; else bad "$name"; fi
}

cat >"$tmp/plain.yaml" <<EOF
model: {path: $tmp/no-model.gguf}
nodes:
  - {id: prefill-0, role: prefill}
  - {id: decode-0, role: decode}
  - {id: decode-1, role: decode}
EOF
keys=$tmp/keys

# ---- usage ----
expect "help" 0 "" "$tandem" keys --help
check "help text" grep -qF "tandem keys generate --config FILE --out DIR" "$tmp/out"
expect "no action" 2 "usage: tandem keys" "$tandem" keys
expect "unknown action" 2 "unknown action 'make'" "$tandem" keys make
expect "no config" 2 "--config FILE is required" "$tandem" keys generate --out "$keys"
# ---- keys by default ----
expect "default takes no --out" 2 "--out applies to generate only" "$tandem" keys default --out x
expect "default of the default cluster" 0 "" "$tandem" keys default
check "default names the key directory" grep -qxF "key directory: $tmp/state/tandem/keys" "$tmp/out"
check "default lists the router and the default nodes" \
    test "$(awk 'NR > 1 {print $1}' "$tmp/out" | tr '\n' ' ')" = "router prefill-0 decode-0 "
check "default key files are 0600" \
    test "$(stat -c %a "$tmp/state/tandem/keys/router.key")" = 600
expect "default of a config with keys by default" 0 "" "$tandem" keys default --config "$tmp/plain.yaml"
check "default lists decode-1 too" grep -q "^decode-1 " "$tmp/out"
expect "no out" 2 "--out DIR is required" "$tandem" keys generate --config "$tmp/plain.yaml"
expect "bad config" 1 "no-such.yaml" "$tandem" keys generate --config "$tmp/no-such.yaml" --out "$keys"

# ---- generate ----
expect "generate" 0 "wrote 4 key pairs" "$tandem" keys generate --config "$tmp/plain.yaml" --out "$keys"
cp "$tmp/out" "$tmp/yaml"
check "dir mode 700" [ "$(stat -c %a "$keys")" = 700 ]
for id in router prefill-0 decode-0 decode-1; do
    check "$id.key mode 600" [ "$(stat -c %a "$keys/$id.key")" = 600 ]
    check "$id.key is 40 characters" [ "$(tr -d '\n' <"$keys/$id.key" | wc -c)" = 40 ]
    check "$id.pub is 40 characters" [ "$(tr -d '\n' <"$keys/$id.pub" | wc -c)" = 40 ]
    check "yaml names $id.key" grep -qF "curve_secret_key_file: $keys/$id.key" "$tmp/yaml"
    check "yaml has $id's key" grep -qF "curve_public_key: \"$(cat "$keys/$id.pub")\"" "$tmp/yaml"
done
check "distinct keys" [ "$(cat "$keys"/*.pub | sort -u | wc -l)" = 4 ]
old=$(cat "$keys/router.pub")
expect "no overwrite" 1 "$keys/router.key exists" "$tandem" keys generate --config "$tmp/plain.yaml" --out "$keys"
check "unchanged" [ "$(cat "$keys/router.pub")" = "$old" ]
chmod 644 "$keys/decode-1.key"
expect "force" 0 "" "$tandem" keys generate --config "$tmp/plain.yaml" --out "$keys" --force
cp "$tmp/out" "$tmp/yaml"
check "force made new keys" [ "$(cat "$keys/router.pub")" != "$old" ]
check "force resets the mode" [ "$(stat -c %a "$keys/decode-1.key")" = 600 ]

# ---- paste the printed YAML into the config ----
# the router: lines go under router:, each node's two key lines into that node's entry
{
    echo "model: {path: $tmp/no-model.gguf}"
    sed -n '/^router:/,/^nodes:/p' "$tmp/yaml" | grep -v '^nodes:'
    echo "nodes:"
    for id in prefill-0 decode-0 decode-1; do
        role=${id%-*}
        echo "  - id: $id"
        echo "    role: $role"
        grep -A2 -- "- id: $id\$" "$tmp/yaml" | tail -n 2
    done
} >"$tmp/curve.yaml"
expect "config check accepts the keys" 0 "" "$tandem" config check "$tmp/curve.yaml"
check "resolved config shows the router key" \
    grep -qF "curve_public_key: \"$(cat "$keys/router.pub")\"" "$tmp/out"
check "resolved config shows decode-1's file" \
    grep -qF "curve_secret_key_file: \"$keys/decode-1.key\"" "$tmp/out"

# ---- daemons refuse key files others can read, naming the path ----
chmod 644 "$keys/decode-0.key"
expect_fail "decode refuses a 0644 key" "$keys/decode-0.key: mode 0644" \
    "$decode" --config "$tmp/curve.yaml" --node-id decode-0
check "the message says how to fix it" grep -qF "chmod 600 $keys/decode-0.key" "$tmp/err"
chmod 600 "$keys/decode-0.key"
# a key that belongs to another node's public key
cp "$keys/decode-1.key" "$tmp/stolen.key"
chmod 600 "$tmp/stolen.key"
sed "s|$keys/decode-0.key|$tmp/stolen.key|" "$tmp/curve.yaml" >"$tmp/stolen.yaml"
expect_fail "decode refuses another node's secret" "not to the configured" \
    "$decode" --config "$tmp/stolen.yaml" --node-id decode-0
chmod 640 "$keys/router.key"
expect_fail "router refuses a 0640 key" "router.curve_secret_key_file $keys/router.key: mode 0640" \
    "$router" --config "$tmp/curve.yaml"
chmod 600 "$keys/router.key"
# with sound keys the daemons get as far as the (missing) model
expect_fail "prefill with its key reaches the model" "no-model.gguf" \
    "$prefill" --config "$tmp/curve.yaml" --node-id prefill-0

# ---- non-loopback binds need CURVE (node, KV) or API keys (client, HTTP) ----
wild() { # wild FILE KEY_LINES...: plain.yaml with the given router: lines and decode-0 binding 0.0.0.0
    local f=$1
    shift
    {
        echo "model: {path: $tmp/no-model.gguf}"
        echo "router:"
        printf '%s\n' "$@"
        echo "nodes:"
        echo "  - {id: prefill-0, role: prefill}"
        echo "  - {id: decode-0, role: decode, kv_endpoint: 'tcp://0.0.0.0:17610', kv_advertise: 'tcp://localhost:17610'}"
    } >"$f"
}
wild "$tmp/wild.yaml" "  node_endpoint: tcp://0.0.0.0:17601" "  node_advertise: tcp://localhost:17601"
expect_fail "router refuses a wildcard node endpoint" \
    "router.node_endpoint tcp://0.0.0.0:17601 is not a loopback address and CURVE is off" \
    "$router" --config "$tmp/wild.yaml"
expect_fail "decode refuses a wildcard KV endpoint" \
    "nodes[1].kv_endpoint tcp://0.0.0.0:17610 is not a loopback address and CURVE is off" \
    "$decode" --config "$tmp/wild.yaml" --node-id decode-0
wild "$tmp/wild-client.yaml" "  client_endpoint: tcp://0.0.0.0:17600"
expect_fail "router refuses a wildcard client endpoint" \
    "router.client_endpoint tcp://0.0.0.0:17600 is not a loopback address and router.api_keys is empty" \
    "$router" --config "$tmp/wild-client.yaml"
wild "$tmp/wild-http.yaml" "  http_address: 0.0.0.0"
expect_fail "router refuses a wildcard HTTP address" \
    "router.http_address 0.0.0.0 is not a loopback address and router.api_keys is empty" \
    "$router" --config "$tmp/wild-http.yaml"
wild "$tmp/wild-keys.yaml" "  client_endpoint: tcp://0.0.0.0:17600" "  http_address: 0.0.0.0" \
    "  api_keys: [k1]"
expect_fail "API keys allow the client side" "no-model.gguf" "$router" --config "$tmp/wild-keys.yaml"
# security.insecure: allowed, with a warning at start
wild "$tmp/insecure.yaml" "  node_endpoint: tcp://0.0.0.0:17601" "  node_advertise: tcp://localhost:17601"
printf 'security:\n  insecure: true\n' >>"$tmp/insecure.yaml"
expect_fail "insecure router gets to the model" "no-model.gguf" "$router" --config "$tmp/insecure.yaml"
check "insecure router warns" grep -qF "security.insecure is true" "$tmp/err"
# tandem config check finds every refused bind at once, and accepts them with insecure
expect_fail "config check names the node endpoint" \
    "router.node_endpoint tcp://0.0.0.0:17601 is not a loopback address and CURVE is off" \
    "$tandem" config check "$tmp/wild.yaml"
check "config check names the KV endpoint too" grep -qF \
    "nodes[1].kv_endpoint tcp://0.0.0.0:17610 is not a loopback address" "$tmp/err"
expect "config check accepts insecure binds" 0 "" "$tandem" config check "$tmp/insecure.yaml"
# the removed shared keys are named with their replacement
printf 'security:\n  curve_server_public_key: "%s"\n' "$old" >"$tmp/old.yaml"
expect "old keys are refused" 1 \
    "key 'security.curve_server_public_key': was removed: give the router its own pair" \
    "$tandem" config check "$tmp/old.yaml"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
