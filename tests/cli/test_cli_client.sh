#!/usr/bin/env bash
# test_cli_client.sh - the router-facing commands (generate without -m, chat, status, bench,
# cluster up/down): usage errors (exit 2 naming the option), a router that is not running,
# then every command against the fake router of tests/unit/test_client.c (`test_client
# --serve`, found beside this build's tandem binary or through $TDM_TEST_CLIENT), and
# `tandem cluster up/down` supervising fake daemons (shell scripts in a --bin-dir).
# Usage: bash test_cli_client.sh /path/to/tandem. Prints "N passed, M failed"; exits 1 on failure.
set -u

tandem=${1:?usage: test_cli_client.sh /path/to/tandem}
test_client=${TDM_TEST_CLIENT:-$(dirname "$tandem")/../tests/test_client}
tmp=$(mktemp -d)
pids_to_kill=()
cleanup() {
    local p
    for p in "${pids_to_kill[@]}"; do kill -KILL "$p" 2>/dev/null; done
    rm -rf "$tmp"
}
trap cleanup EXIT
pass=0
fail=0

# run ARGS...: runs `tandem ARGS` with stdin from /dev/null, stdout in $tmp/out, stderr in
# $tmp/err, status in $rc.
run() {
    args=("$@")
    "$tandem" "$@" </dev/null >"$tmp/out" 2>"$tmp/err"
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
# expect NAME RC TEXT ARGS...: exit RC and stderr contains TEXT (fixed string; "" = any).
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
# check NAME CONDITION...: the command after NAME must succeed.
check() {
    local name=$1
    shift
    if "$@"; then ok; else bad "$name"; fi
}
quiet() { "$@" >/dev/null 2>&1; }
alive() { kill -0 "$1" 2>/dev/null && ! grep -q '^State:.*Z' "/proc/$1/status" 2>/dev/null; }
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# ---- usage errors: exit 2 and the message names the option ----
expect "generate -t without -m" 2 "-t/--threads only applies with -m" generate -p hi -t 2
expect "generate -c without -m" 2 "-c/--ctx only applies with -m" generate -p hi -c 64
expect "generate --batch without -m" 2 "--batch only applies with -m" generate -p hi --batch 8
expect "generate --kv-dtype without -m" 2 "--kv-dtype only applies with -m" generate -p hi --kv-dtype q8
expect "generate --chat-template without -m" 2 "--chat-template only applies with -m" generate --chat hi --chat-template chatml
expect "generate --stop with -m" 2 "--stop only applies without -m" generate -m x.gguf -p hi --stop x
expect "generate --router with -m" 2 "--router only applies without -m" generate -m x.gguf -p hi --router tcp://127.0.0.1:1
expect "generate no input" 2 "exactly one of" generate
expect "generate bad top-p" 2 "top_p must be in (0, 1]" generate -p hi --top-p 1.5
expect "generate bad timeout" 2 "--timeout must be a number" generate -p hi --timeout soon
expect "generate empty stop" 2 "--stop" generate -p hi --stop ""
expect "generate unknown option" 2 "unrecognized option '--frobnicate'" generate -p hi --frobnicate
expect "chat unknown option" 2 "unrecognized option" chat --frobnicate
expect "chat extra argument" 2 "unexpected argument 'hello'" chat hello
expect "chat bad temperature" 2 "--temperature must be a number" chat --temperature hot
expect "status unknown option" 2 "unrecognized option" status --frobnicate
expect "status bad timeout" 2 "--timeout" status --timeout -1
expect "bench non-numeric rate" 2 "--rate must be a number" bench --rate fast
expect "bench zero rate" 2 "--rate must be a number" bench --rate 0
expect "bench negative rate" 2 "--rate must be a number" bench --rate -3
expect "bench bad concurrency" 2 "--concurrency must be an integer" bench --concurrency 0
expect "bench bad prompt range" 2 "--prompt-len: A must not exceed B" bench --prompt-len 512:64
expect "bench bad output len" 2 "--output-len must be an integer" bench --output-len many
expect "bench prompt-len and prompt-file" 2 "exclude each other" bench --prompt-len 8 --prompt-file /dev/null
expect "bench bad temperature" 2 "--temperature must be in [0, 5]" bench --temperature 9
expect "cluster without subcommand" 2 "usage: tandem cluster up" cluster
expect "cluster unknown subcommand" 2 "unknown subcommand 'sideways'" cluster sideways
expect "cluster up unknown option" 2 "unrecognized option" cluster up --frobnicate
expect "cluster up pid-file without detach" 2 "--pid-file needs --detach" cluster up --pid-file "$tmp/p"
expect "cluster up bin-dir missing" 2 "--bin-dir $tmp/nowhere is not a directory" cluster up --bin-dir "$tmp/nowhere"
expect "cluster up config missing" 2 "$tmp/none.yaml" cluster up --config "$tmp/none.yaml"
printf 'router:\n  http_port: 70000\n' >"$tmp/bad.yaml"
expect "cluster up config invalid" 2 "http_port" cluster up --config "$tmp/bad.yaml"
mkdir -p "$tmp/emptybin"
expect "cluster up daemon not found" 1 "tandem-router not found in --bin-dir $tmp/emptybin" cluster up --bin-dir "$tmp/emptybin"
expect "cluster down without pid file" 1 "no pid file $tmp/none.pids" cluster down --pid-file "$tmp/none.pids"
expect "cluster down bad stop timeout" 2 "--stop-timeout" cluster down --stop-timeout x

# ---- no router: a clear message within the timeout ----
start=$(date +%s)
expect "generate, router not running" 1 "no answer from the router at tcp://127.0.0.1:1 within 0.5 s" generate -p hi --router tcp://127.0.0.1:1 --timeout 0.5
check "router not running: quick" [ $(($(date +%s) - start)) -lt 5 ]
TANDEM_ROUTER=tcp://127.0.0.1:1 expect "status, router from TANDEM_ROUTER" 1 "tcp://127.0.0.1:1" status --timeout 0.3

# ---- against the fake router ----
if [ ! -x "$test_client" ]; then
    fail=$((fail + 1))
    echo "FAIL: the fake router $test_client is missing (build the test_client target)"
    echo "$pass passed, $fail failed"
    exit 1
fi
"$test_client" --serve 'tcp://127.0.0.1:*' >"$tmp/fake.out" 2>"$tmp/fake.err" &
fake=$!
pids_to_kill+=("$fake")
for _ in $(seq 600); do [ -s "$tmp/fake.out" ] && break; sleep 0.05; done
ep=$(head -n 1 "$tmp/fake.out")

run generate --router "$ep" -p hello --api-key k1
check "generate: exit 0" [ "$rc" -eq 0 ]
printf 'Hello world\n' >"$tmp/want"
check "generate: stdout is only the text" cmp -s "$tmp/out" "$tmp/want"
check "generate: usage on stderr" grep -qF "prompt tokens: 5 (cached 2), generated tokens: 4, finish: stop" "$tmp/err"
check "generate: timings on stderr" grep -qF "TTFT: 10.0 ms" "$tmp/err"
check "generate: TPOT on stderr" grep -qF "decode: 100.00 tokens/s (TPOT 10.0 ms)" "$tmp/err"

# several routers: a router that is not running is skipped (nothing is queued for it), a
# repeated one is a usage error naming it
down=tcp://127.0.0.1:$(free_port)
run generate --router "$ep,$down" -p hello --timeout 30
check "generate, two routers, one down: exit 0" [ "$rc" -eq 0 ]
check "generate, two routers, one down: the text" cmp -s "$tmp/out" "$tmp/want"
run generate --router "$down,$ep" -p hello --timeout 30
check "generate, two routers, the first down: the text" cmp -s "$tmp/out" "$tmp/want"
expect "generate, a router listed twice" 2 "router endpoint $ep is listed twice" generate --router "$ep,$ep" -p hello
run generate --router "$ep" -p "one two three" -n 5 --stop zz --seed 3 --temperature 0.5
check "generate -n 5: five streamed tokens" grep -qx "w0 w1 w2 w3 w4 " "$tmp/out"
check "generate -n 5: finish length" grep -qF "prompt tokens: 3 (cached 0), generated tokens: 5, finish: length" "$tmp/err"
printf 'hello' >"$tmp/prompt.txt"
run generate --router "$ep" -f "$tmp/prompt.txt"
check "generate -f FILE" cmp -s "$tmp/out" "$tmp/want"
expect "generate: router error is reported with its status" 2 "prompt: too long (fake, 42) (INVALID_ARGUMENT)" generate --router "$ep" -p error
expect "generate: deadline" 1 "DEADLINE_EXCEEDED" generate --router "$ep" -p silent --timeout 0.3

# Ctrl-C cancels the request and exits 130
"$tandem" generate --router "$ep" -p slow >"$tmp/out" 2>"$tmp/err" &
gen=$!
# interrupt once the stream is under way (two chunks out), not after a guess at how long that takes
for _ in $(seq 600); do grep -q "^s0 s1 " "$tmp/out" && break; sleep 0.05; done
kill -INT "$gen"
wait "$gen"
rc=$?
args=(generate -p slow, SIGINT)
check "generate: Ctrl-C exits 130" [ "$rc" -eq 130 ]
check "generate: Ctrl-C says so" grep -qF "interrupted; the request was cancelled" "$tmp/err"
check "generate: text streamed before Ctrl-C" grep -q "^s0 s1 " "$tmp/out"

# chat keeps the conversation: the second answer sees 4 messages (system, user, assistant, user)
args=(chat --system brief)
printf 'hi there\n\nsecond question\n' | "$tandem" chat --router "$ep" --system brief >"$tmp/out" 2>"$tmp/err"
rc=$?
printf 'you said: hi there (2 messages)\nyou said: second question (4 messages)\n' >"$tmp/want"
check "chat: exit 0" [ "$rc" -eq 0 ]
check "chat: two answers, growing conversation" cmp -s "$tmp/out" "$tmp/want"
printf 'one\n' | "$tandem" chat --router "$ep" >"$tmp/out" 2>"$tmp/err"
check "chat: without --system the first turn has 1 message" grep -qx "you said: one (1 messages)" "$tmp/out"

run status --router "$ep"
check "status: exit 0" [ "$rc" -eq 0 ]
check "status: header" grep -qF "requests: 12 running, 3 queued, 12345 total" "$tmp/out"
check "status: decode row" grep -qE "^decode-0 +decode +yes +cuda:1 +1500/2000 \(75.0%\) +100 +12 +3 +0 " "$tmp/out"
check "status: prefill row" grep -qE "^prefill-0 +prefill +yes +cpu +250/1000 \(25.0%\) +0 +0 +0 +4096 +125.0 +0.5 s" "$tmp/out"
run status --router "$ep" --json
check "status --json" python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
n = {x["node_id"]: x for x in d["nodes"]}
assert d["requests_total"] == 12345 and d["model"] == "smol", d
assert n["decode-0"]["kv_used_pct"] == 75.0 and n["prefill-0"]["queued_prefill_tokens"] == 4096
' "$tmp/out"

run bench --router "$ep" --rate 200 --requests 30 --prompt-len 4:8 --output-len 6 --slo-ttft-ms 1000 --slo-tpot-ms 1000 --json "$tmp/bench.json"
check "bench: exit 0" [ "$rc" -eq 0 ]
check "bench: table" grep -qF "requests:          30 finished, 30 ok, 0 failed" "$tmp/out"
check "bench: latency rows" grep -qE "^TTFT +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +[0-9.]+ +30$" "$tmp/out"
check "bench --json" python3 -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert d["ok"] == 30 and d["failed"] == 0, d
assert d["output_tokens"] == 30 * 6, d["output_tokens"]
assert 30 * 4 <= d["prompt_tokens"] <= 30 * 8, d["prompt_tokens"]
assert d["goodput"]["share"] == 1.0 and d["goodput"]["good"] == 30
t = d["ttft_ms"]
assert t["n"] == 30 and 0 < t["p50"] <= t["p90"] <= t["p99"] <= t["max"]
assert d["tpot_ms"]["n"] == 30 and d["throughput"]["output_tokens_per_s"] > 0
' "$tmp/bench.json"
printf 'error\nhello\n' >"$tmp/prompts"
run bench --router "$ep" --concurrency 2 --requests 20 --prompt-file "$tmp/prompts" --seed 1
check "bench: errors by status" grep -qE "^errors: +INVALID_ARGUMENT [0-9]+" "$tmp/out"
check "bench: mixed results exit 0" [ "$rc" -eq 0 ]
run bench --router "$ep" --concurrency 2 --duration 0.5 --output-len 5
check "bench --duration" grep -qE "^requests: +[0-9]+ finished, [0-9]+ ok, 0 failed" "$tmp/out"

kill -TERM "$fake"
wait "$fake"
rc=$?
args=(fake router)
check "fake router saw no protocol errors (every CANCEL arrived)" [ "$rc" -eq 0 ]

# ---- cluster up/down with fake daemons ----
bin="$tmp/bin"
mkdir -p "$bin"
export FAKE_LOG="$tmp/daemons.log" TEST_CLIENT="$test_client"
# a node that sleeps (or, with FAKE_FAIL=label, exits 3; with FAKE_STUBBORN, ignores SIGTERM)
cat >"$bin/fake-node" <<'EOF'
#!/usr/bin/env bash
label=$(echo "$*" | sed -n 's/.*--node-id \([^ ]*\).*/\1/p')
echo "$$ $(basename "$0") $*" >>"$FAKE_LOG"
echo "hello from $label"
[ "${FAKE_FAIL:-}" = "$label" ] && { sleep 0.3; exit 3; }
[ -n "${FAKE_STUBBORN:-}" ] && trap '' TERM
exec -a "$(basename "$0")" sleep 1000
EOF
cat >"$bin/tandem-router" <<'EOF'
#!/usr/bin/env bash
echo "$$ tandem-router $*" >>"$FAKE_LOG"
[ -n "${FAKE_ROUTER_PORT:-}" ] && exec -a tandem-router "$TEST_CLIENT" --serve "tcp://127.0.0.1:$FAKE_ROUTER_PORT"
exec -a tandem-router sleep 1000
EOF
cp "$bin/fake-node" "$bin/tandem-prefill"
cp "$bin/fake-node" "$bin/tandem-decode"
chmod +x "$bin"/*
port=$(free_port)
cat >"$tmp/cluster.yaml" <<EOF
router:
  client_endpoint: tcp://127.0.0.1:$port
nodes:
  - id: prefill-0
    role: prefill
  - id: decode-0
    role: decode
EOF
# all_dead: every pid in the fake log has exited
all_dead() {
    local p
    for p in $(awk '{print $1}' "$FAKE_LOG"); do alive "$p" && return 1; done
    return 0
}

# a node that exits early: `up` stops the others and names it
: >"$FAKE_LOG"
FAKE_FAIL=prefill-0 expect "cluster up: daemon exits" 1 "tandem-prefill (prefill-0, pid" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --timeout 20
check "cluster up: exit status named" grep -qF "exited with status 3 before the cluster was ready; stopping the others" "$tmp/err"
check "cluster up: the others were stopped" all_dead
check "cluster up: router got --config" grep -qF "tandem-router --config $tmp/cluster.yaml" "$FAKE_LOG"
check "cluster up: decode got --config and --node-id" grep -qF "tandem-decode --config $tmp/cluster.yaml --node-id decode-0" "$FAKE_LOG"
check "cluster up: child output on stderr" grep -qF "hello from decode-0" "$tmp/err"
check "cluster up: stdout stays empty" [ ! -s "$tmp/out" ]

# never ready: timeout, everything stopped; logs in --log-dir
: >"$FAKE_LOG"
expect "cluster up: not ready in time" 1 "the cluster was not ready within 1 s: waiting for the router at tcp://127.0.0.1:$port" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --timeout 1 --log-dir "$tmp/logs"
check "cluster up: stopped after the timeout" all_dead
check "cluster up --log-dir: one file per daemon" grep -qF "hello from decode-0" "$tmp/logs/decode-0.log"
check "cluster up --log-dir: nothing on stderr from daemons" bash -c "! grep -qF 'hello from' '$tmp/err'"

# a daemon that ignores SIGTERM gets SIGKILL after --stop-timeout
: >"$FAKE_LOG"
FAKE_STUBBORN=1 expect "cluster up: SIGKILL after the stop timeout" 1 "did not stop within 0.5 s: SIGKILL" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --timeout 1 --stop-timeout 0.5
check "cluster up: stubborn daemons killed" all_dead

# SIGTERM while waiting: everything stopped, exit 143
: >"$FAKE_LOG"
"$tandem" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --timeout 60 >"$tmp/out" 2>"$tmp/err" &
up=$!
# SIGTERM once all three daemons were started (each logs a line), while it waits for ready
for _ in $(seq 600); do [ "$(wc -l <"$FAKE_LOG")" -ge 3 ] && break; sleep 0.05; done
kill -TERM "$up"
wait "$up"
rc=$?
args=(cluster up, SIGTERM while waiting)
check "cluster up: SIGTERM while waiting exits 143" [ "$rc" -eq 143 ]
check "cluster up: SIGTERM stopped the daemons" all_dead

# ready: the fake router answers Status with both nodes up
export FAKE_ROUTER_PORT=$port
: >"$FAKE_LOG"
"$tandem" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --timeout 30 >"$tmp/out" 2>"$tmp/err" &
up=$!
pids_to_kill+=("$up")
for _ in $(seq 600); do grep -q "cluster ready" "$tmp/out" && break; sleep 0.05; done
args=(cluster up, ready)
check "cluster up: ready line" grep -qx "cluster ready: router tcp://127.0.0.1:$port, 1 prefill, 1 decode nodes" "$tmp/out"
check "cluster up: status works through the cluster's router" quiet "$tandem" status --router "tcp://127.0.0.1:$port"
# a node dies while supervised: `up` stops the rest and exits 1 naming it
decode_pid=$(awk '$2 == "tandem-decode" {print $1}' "$FAKE_LOG")
kill -KILL "$decode_pid"
wait "$up"
rc=$?
check "cluster up: a dead node ends the cluster (exit 1)" [ "$rc" -eq 1 ]
check "cluster up: the dead node is named" grep -qF "tandem-decode (decode-0, pid $decode_pid) was killed by signal 9" "$tmp/err"
check "cluster up: the rest stopped" all_dead

# Ctrl-C after ready: clean stop, exit 0
: >"$FAKE_LOG"
"$tandem" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --timeout 30 >"$tmp/out" 2>"$tmp/err" &
up=$!
pids_to_kill+=("$up")
for _ in $(seq 600); do grep -q "cluster ready" "$tmp/out" && break; sleep 0.05; done
kill -INT "$up"
wait "$up"
rc=$?
args=(cluster up, SIGINT after ready)
check "cluster up: Ctrl-C after ready exits 0" [ "$rc" -eq 0 ]
check "cluster up: Ctrl-C stops every daemon" all_dead

# --detach writes the pid file and returns; a second up refuses; down stops them
: >"$FAKE_LOG"
expect "cluster up --detach" 0 "" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --timeout 30 --detach --pid-file "$tmp/cluster.pids"
for p in $(awk '{print $1}' "$FAKE_LOG"); do pids_to_kill+=("$p"); done
check "cluster up --detach: ready line" grep -qF "cluster ready: router tcp://127.0.0.1:$port" "$tmp/out"
check "cluster up --detach: pid file lists 3 daemons" [ "$(grep -vc '^#' "$tmp/cluster.pids")" -eq 3 ]
check "cluster up --detach: daemons keep running" bash -c "for p in \$(awk '{print \$1}' '$FAKE_LOG'); do kill -0 \$p || exit 1; done"
expect "cluster up: refuses while a detached cluster runs" 1 "a detached cluster is running" cluster up --bin-dir "$bin" --config "$tmp/cluster.yaml" --detach --pid-file "$tmp/cluster.pids"
expect "cluster down" 0 "" cluster down --pid-file "$tmp/cluster.pids"
check "cluster down: summary" grep -qF "cluster stopped: 3 daemons signalled, 0 killed" "$tmp/out"
check "cluster down: daemons gone" all_dead
check "cluster down: pid file removed" [ ! -e "$tmp/cluster.pids" ]

# down skips entries whose pid is gone or is not our daemon
sleep 1000 &
other=$!
pids_to_kill+=("$other")
printf '999999 tandem-router router\n%d tandem-decode decode-0\n' "$other" >"$tmp/stale.pids"
expect "cluster down: stale entries" 0 "is not running" cluster down --pid-file "$tmp/stale.pids"
check "cluster down: a pid that is not our daemon is left alone" alive "$other"
kill "$other"
printf 'garbage\n' >"$tmp/garbage.pids"
expect "cluster down: malformed pid file" 1 "expected \"PID BINARY LABEL\"" cluster down --pid-file "$tmp/garbage.pids"

echo "$pass passed, $fail failed"
[ "$fail" -eq 0 ]
