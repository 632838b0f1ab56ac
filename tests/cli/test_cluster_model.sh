#!/usr/bin/env bash
# test_cluster_model.sh - `tandem cluster up --model PATH`: a missing or non-GGUF PATH is refused
# (exit 2, naming it), so is a config whose model.path names another file; otherwise every
# daemon gets the file's absolute path as $TANDEM_MODEL (the default model path their configs
# fall back on). The daemons are fakes in a --bin-dir that log their environment; the router
# is tests/unit/test_client.c's fake (`test_client --serve`), which reports the nodes up.
# Usage: bash test_cluster_model.sh /path/to/tandem. Prints "N passed, M failed"; exits 1 on
# failure.
set -u

tandem=${1:?usage: test_cluster_model.sh /path/to/tandem}
tandem=$(cd "$(dirname "$tandem")" && pwd)/$(basename "$tandem") # the test changes directory
test_client=${TDM_TEST_CLIENT:-$(dirname "$tandem")/../tests/test_client}
tmp=$(mktemp -d)
# keys by default: the daemons make their CURVE pairs here, not in ~/.local/state
export XDG_STATE_HOME=$tmp/state
cleanup() {
    [ -s "$tmp/cluster.pids" ] && "$tandem" cluster down --pid-file "$tmp/cluster.pids" \
        --stop-timeout 2 >/dev/null 2>&1
    rm -rf "$tmp"
}
trap cleanup EXIT
pass=0
fail=0

# expect NAME RC TEXT ARGS...: `tandem ARGS` exits RC and its stderr contains TEXT.
expect() {
    local name=$1 want=$2 text=$3
    shift 3
    "$tandem" "$@" </dev/null >"$tmp/out" 2>"$tmp/err"
    local rc=$?
    if [ "$rc" -eq "$want" ] && grep -qF -- "$text" "$tmp/err"; then
        pass=$((pass + 1))
    else
        fail=$((fail + 1))
        echo "FAIL: $name: rc=$rc (want $want), stderr lacks '$text'"
        sed 's/^/  out: /' "$tmp/out" | head -20
        sed 's/^/  err: /' "$tmp/err" | head -20
    fi
}
check() {
    local name=$1
    shift
    if "$@"; then pass=$((pass + 1)); else
        fail=$((fail + 1))
        echo "FAIL: $name"
    fi
}
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

if [ ! -x "$test_client" ]; then
    echo "SKIP: no fake router at $test_client (build test_client)"
    exit 77
fi

# the smallest GGUF: header only (version 3, no tensors, no keys)
mkdir -p "$tmp/models"
python3 -c 'import struct, sys; open(sys.argv[1], "wb").write(b"GGUF" + struct.pack("<IQQ", 3, 0, 0))' \
    "$tmp/models/tiny.gguf"
cp "$tmp/models/tiny.gguf" "$tmp/models/other.gguf"
printf "not a model, just some text in a file\\n%.0s" 1 2 3 >"$tmp/models/text.gguf"

bin="$tmp/bin"
mkdir -p "$bin"
export FAKE_LOG="$tmp/daemons.log" TEST_CLIENT="$test_client"
cat >"$bin/fake-node" <<'EOF'
#!/usr/bin/env bash
echo "$$ $(basename "$0") TANDEM_MODEL=${TANDEM_MODEL:-}" >>"$FAKE_LOG"
exec -a "$(basename "$0")" sleep 1000
EOF
cat >"$bin/tandem-router" <<'EOF'
#!/usr/bin/env bash
echo "$$ tandem-router TANDEM_MODEL=${TANDEM_MODEL:-}" >>"$FAKE_LOG"
exec -a tandem-router "$TEST_CLIENT" --serve "tcp://127.0.0.1:$FAKE_ROUTER_PORT"
EOF
cp "$bin/fake-node" "$bin/tandem-prefill"
cp "$bin/fake-node" "$bin/tandem-decode"
chmod +x "$bin"/*
port=$(free_port)
export FAKE_ROUTER_PORT=$port
nodes="router:
  client_endpoint: tcp://127.0.0.1:$port
nodes:
  - {id: prefill-0, role: prefill}
  - {id: decode-0, role: decode}"
printf '%s\n' "$nodes" >"$tmp/cluster.yaml"
printf 'model:\n  path: %s\n%s\n' "$tmp/models/other.gguf" "$nodes" >"$tmp/other.yaml"
printf 'model:\n  path: %s\n%s\n' "$tmp/models/./tiny.gguf" "$nodes" >"$tmp/same.yaml"

expect "missing file" 2 "--model $tmp/models/none.gguf" \
    cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --model "$tmp/models/none.gguf"
expect "not a GGUF" 2 "not a GGUF file" \
    cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --model "$tmp/models/text.gguf"
expect "config names another model" 2 \
    "--model $tmp/models/tiny.gguf conflicts with model.path $tmp/models/other.gguf in $tmp/other.yaml" \
    cluster up --bin-dir "$bin" --config "$tmp/other.yaml" --model "$tmp/models/tiny.gguf"
# a config of several models (models:, each with its own path) has no model for --model to
# replace, even when --model is one of its files; -c is --config
printf 'models:\n  - {path: %s, name: a}\n  - {path: %s, name: b}\n%s\n' \
    "$tmp/models/tiny.gguf" "$tmp/models/other.gguf" "$nodes" >"$tmp/two.yaml"
expect "several models" 2 \
    "--model $tmp/models/tiny.gguf: $tmp/two.yaml serves 2 models (models:), each from its own path: a ($tmp/models/tiny.gguf), b ($tmp/models/other.gguf); drop --model" \
    cluster up --bin-dir "$bin" -c "$tmp/two.yaml" --model "$tmp/models/tiny.gguf"
check "nothing started by the refused runs" [ ! -s "$FAKE_LOG" ]

# a relative --model, with a config that names no model: every daemon gets the absolute path
(cd "$tmp" && "$tandem" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" \
    --model models/tiny.gguf --timeout 30 --detach --pid-file "$tmp/cluster.pids" \
    </dev/null >"$tmp/out" 2>"$tmp/err")
check "cluster up --model: ready" grep -qF "cluster ready: router tcp://127.0.0.1:$port" "$tmp/out"
for d in tandem-router tandem-prefill tandem-decode; do
    check "$d got TANDEM_MODEL" grep -qx "[0-9]* $d TANDEM_MODEL=$tmp/models/tiny.gguf" "$FAKE_LOG"
done
"$tandem" cluster down --pid-file "$tmp/cluster.pids" >/dev/null 2>&1
check "cluster down" [ ! -e "$tmp/cluster.pids" ]

# a config naming the same file (another spelling of its path) is fine
: >"$FAKE_LOG"
"$tandem" cluster up --bin-dir "$bin" --config "$tmp/same.yaml" --model "$tmp/models/tiny.gguf" \
    --timeout 30 --detach --pid-file "$tmp/cluster.pids" </dev/null >"$tmp/out" 2>"$tmp/err"
check "same file: ready" grep -qF "cluster ready" "$tmp/out"
"$tandem" cluster down --pid-file "$tmp/cluster.pids" >/dev/null 2>&1

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
