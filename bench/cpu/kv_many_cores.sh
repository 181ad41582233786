#!/usr/bin/env bash
# The CPU KV transfer bench (ucx backend, two processes, host memory) on a many-core host,
# to compare with BENCHMARKS.md's 2-vCPU figures. Installs ucxx-cu13 / libucxx-cu13 /
# libucx-cu13 (Python 3.12) from the wheels in $WHEELS (default .whl13/) into $SITE (/tmp/site)
# with pip --target, offline. Needs torch, numpy and msgpack in $PYTHON; a C compiler
# (cc) for perftest's resident-memory floor. Run from anywhere:
#   bash bench/cpu/kv_many_cores.sh
# Prints the machine, then one JSON line per bench run (also appended to /tmp/kv_cpu_bench.jsonl).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
. deploy/require.sh
need "$PY" "apt-get install python3, or set PYTHON"
require_done
WHEELS=${WHEELS:-.whl13}
SITE=${SITE:-/tmp/site}
if ! "$PY" -c 'import ucxx' 2>/dev/null && [ ! -d "$SITE/ucxx" ]; then
  need_files "$WHEELS/*.whl" "the ucxx-cu13, libucxx-cu13 and libucx-cu13 wheels (or set WHEELS)"
  require_done
  "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS"/*.whl
fi
export PYTHONPATH="$SITE:$(pwd)${PYTHONPATH:+:$PYTHONPATH}" UCX_WARN_UNUSED_ENV_VARS=n
"$PY" -c 'import msgpack, numpy, torch' || { echo "need msgpack, numpy and torch in $PY" >&2; exit 1; }

echo "== machine: $(nproc) CPUs, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-)"
echo "   THP $(cat /sys/kernel/mm/transparent_hugepage/enabled), C compiler: $(command -v cc || echo none)"
"$PY" -c 'import ucxx, torch; print("   ucxx", ucxx.__version__, "ucx", ucxx.get_ucx_version(), "torch", torch.__version__)'

run() {  # each: our 64 MiB transfer (32 x 2 MiB) interleaved with the three perftest floors
  "$PY" -m bench.kv --backend ucx --device cpu --rounds 3 --iters 9 --json "$@" \
    | tail -1 | tee -a /tmp/kv_cpu_bench.jsonl
}
for rep in 1 2; do
  run
  run --inflight 4
done
run --no-thp
echo "== keys: gbps (ours), raw_transfer_gbps (perftest -s 64 MiB), raw_resident_gbps (the same,"
echo "   buffers written once), ratio_transfer / ratio_resident; per round under \"rounds\""
