#!/usr/bin/env bash
# `pdserve up` to ready on this machine, two source trees alternated N times: the wall time from
# the command's start to its "router listening" line, and the "ready in" line it prints.
#   bash bench/cpu/up_ready.sh N BEFORE_TREE AFTER_TREE -- UP_ARGS...
# e.g. (main's tree unpacked by `git archive main | tar -x -C /tmp/main`):
#   bash bench/cpu/up_ready.sh 6 /tmp/main . -- --model tiny
# Each run holds /tmp/cpu-bench.lock (a shared machine's timing runs take turns), then waits for
# its cluster's processes to end and GAP seconds (default 3) before the next one starts.
set -euo pipefail
PY=${PYTHON:-python3}
. "$(dirname "$0")/../../deploy/require.sh"
need "$PY" "apt-get install python3, or set PYTHON to the venv's"
need bc "apt-get install bc"
need flock "apt-get install util-linux"
need pgrep "apt-get install procps"
require_done
n=$1
trees=("$(realpath "$2")" "$(realpath "$3")")
shift 3
[ "${1:-}" = "--" ] && shift

once() {  # TREE UP_ARGS...: one start, timed; prints "TREE wall S s; ready in ..."
  local tree=$1 log pid start wall
  shift
  log=$(mktemp /tmp/up-ready.XXXXXX)
  start=$(date +%s.%N)
  (cd "$tree" && PYTHONPATH="$tree" exec "$PY" -m deploy.cli up "$@") >"$log" 2>&1 &
  pid=$!
  until grep -q "router listening" "$log"; do
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; return 1; }
    sleep 0.05
  done
  wall=$(echo "$(date +%s.%N) - $start" | bc)
  kill -INT "$pid"
  wait "$pid" || true
  for _ in $(seq 100); do pgrep -f pdserve-ray- >/dev/null || break; sleep 0.1; done
  sleep "${GAP:-3}"
  echo "$tree wall ${wall} s; $(grep 'ready in' "$log")"
  rm -f "$log"
}

exec 9>/tmp/cpu-bench.lock
for _ in $(seq "$n"); do
  for tree in "${trees[@]}"; do
    flock 9
    once "$tree" "$@"
    flock -u 9
  done
done
