#!/usr/bin/env bash
# How engine/mtp_heads/smollm2.safetensors was made, on one H100 (device tool), 2026-11-21:
#   stage 1 (7.8 min): 669,703 tokens (2,540 sequences) sampled with the LLMEngine (256 rows,
#            2.8k tok/s), then 800 steps of 16k tokens from the warm start (loss 8.03 -> 0.96);
#   stage 2 (3.0 min): 422k more tokens from the dense sampler (1024 rows, 7.4k tok/s), then 150
#            steps from the stage-1 head on both stages' data (1.29M tokens, 4,588 sequences).
# Loss curves: smollm2.loss.png (stage 1), smollm2.stage2.loss.png; numbers in smollm2.loss.json.
# The GGUF (98 MB) is over the tool's 64 MiB carry limit: an earlier call leaves its first half
# in /tmp/g/part_00 and this call carries the second half (and stage 1's data) in .gguf_split/b/.
# Usage there: bash engine/mtp_heads/train_smollm2.sh 1|2
set -euo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
GGUF=/tmp/g/SmolLM2-135M-Instruct.Q4_1.gguf
cat /tmp/g/part_00 .gguf_split/b/part_01 > "$GGUF"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $GGUF" | sha256sum -c -
mkdir -p /tmp/run "$OUT"
COMMON=(--model "$GGUF" --out /tmp/run/smollm2.safetensors --device cuda --max-new-tokens 320
        --package-texts 2000 --batch-tokens 16384 --max-len 768 --levels 3 --steps 2000)
if [ "${1:-1}" = 1 ]; then
  ARGS=(--sampler engine --max-num-seqs 256 --tokens 1500000 --gen-seconds 210 --train-seconds 230 --lr 1e-3)
else  # stage 2: --init is the stage-1 head, which was at that path then
  ARGS=(--sampler dense --max-num-seqs 1024 --tokens 3000000 --gen-seconds 30 --train-seconds 80 --lr 5e-4
        --init engine/mtp_heads/smollm2.safetensors --extra-data .gguf_split/b/stage1.data.safetensors --seed 1)
fi
python3 -m engine.mtp_train "${COMMON[@]}" "${ARGS[@]}" 2>&1 | tr '\r' '\n' | tee "$OUT/train.log" | grep -v "it/s\]$" | tail -25
cp /tmp/run/smollm2.safetensors /tmp/run/smollm2.loss.png /tmp/run/smollm2.loss.json \
   /tmp/run/smollm2.data.safetensors "$OUT/"
ls -la "$OUT"
