#!/usr/bin/env bash
# GPU-busy share of the decode loop (device tool): SmolLM2 shape at batch 1 and 32 with
# programmatic dependent launch off and on, the profile's own step time beside the timed one,
# and where the remaining idle time sits (the kernels around each gap). Needs .whl (gguf).
# Usage: bash bench/gpu/gpu_busy.sh
set -uo pipefail
. "$(dirname "$0")/../../deploy/require.sh"; need_gpu_machine; require_done
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
for pdl in 0 1; do
  for args in "--batch 32 --spec-tokens 0" "--batch 1 --spec-tokens 0" "--batch 1 --spec-tokens 3"; do
    PDSERVE_PDL=$pdl python3 -m deploy.cli bench engine --device cuda --arch smollm2 --max-tokens 64 $args --profile \
      2>/dev/null | grep ms_per_step | tee -a "$OUT/busy.jsonl"
  done
done
python3 - "$OUT/busy.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("pdl | batch | k | ms/step | profiled ms/step | kernels | busy | top gap (us/step)")
for d in rows:
    g = d["top_gaps"][0] if d["top_gaps"] else ["", "", 0]
    print(f"{int(d['pdl'])} | {d['batch']} | {d['spec_tokens']} | {d['ms_per_step']} | {d['profiled_ms_per_step']} | "
          f"{d['kernels_per_step']} | {d['gpu_busy']} | {g[0][:28]} -> {g[1][:28]} {g[2]}")
PY
