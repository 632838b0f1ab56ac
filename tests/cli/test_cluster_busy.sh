#!/usr/bin/env bash
# test_cluster_busy.sh - `tandem cluster up` refuses to start, naming the key and the endpoint,
# when something on this machine already listens on router.client_endpoint (another cluster's
# router would otherwise answer its readiness check: "cluster ready" for the wrong cluster).
# Usage: bash test_cluster_busy.sh /path/to/tandem. Exits 1 on failure.
set -u

tandem=${1:?usage: test_cluster_busy.sh /path/to/tandem}
tmp=$(mktemp -d)
trap 'kill "$listener" 2>/dev/null; rm -rf "$tmp"' EXIT
# keys by default: the daemons make their CURVE pairs here, not in ~/.local/state
export XDG_STATE_HOME=$tmp/state

# a listener on a free port, which it writes to $tmp/port once it listens
python3 -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
open(sys.argv[1], "w").write(str(s.getsockname()[1]))
time.sleep(600)' "$tmp/port" &
listener=$!
for _ in $(seq 1 600); do
    [ -s "$tmp/port" ] && break
    sleep 0.1
done
port=$(cat "$tmp/port")
model="$tmp/model.gguf"
: >"$model"
cat >"$tmp/cluster.yaml" <<YAML
model:
  path: $model
router:
  client_endpoint: tcp://127.0.0.1:$port
nodes:
  - id: prefill-0
    role: prefill
  - id: decode-0
    role: decode
YAML
OMP_WAIT_POLICY=passive "$tandem" cluster up --config "$tmp/cluster.yaml" --detach \
    --pid-file "$tmp/pids" --log-dir "$tmp/logs" >"$tmp/out" 2>"$tmp/err"
rc=$?
if [ "$rc" = 1 ] && grep -q "router.client_endpoint tcp://127.0.0.1:$port is already in use" "$tmp/err" &&
    ! grep -q "cluster ready" "$tmp/out" && [ ! -s "$tmp/pids" ]; then
    echo "1 passed, 0 failed"
    exit 0
fi
echo "FAIL: rc=$rc"
sed 's/^/  out: /' "$tmp/out"
sed 's/^/  err: /' "$tmp/err"
exit 1
