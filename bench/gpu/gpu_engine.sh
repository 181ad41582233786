#!/usr/bin/env bash
# Engine on one GPU (device tool): the engine test suite in fp32 on CUDA, the no-sync checks,
# `pdserve generate --model tiny` in bf16, and engine throughput on tiny and SmolLM2-shaped
# random weights. Needs .whl (gguf) carried. Usage: bash bench/gpu/gpu_engine.sh
set -uo pipefail
. "$(dirname "$0")/../../deploy/require.sh"; need_gpu_machine; require_done
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
PDSERVE_TEST_DEVICE=cuda python3 -m pytest -q -p no:cacheprovider tests/engine -m "not smollm2" \
  --deselect tests/engine/test_weights.py --deselect tests/engine/test_tokenizer.py 2>&1 | tee "$OUT/tests.log" | tail -15
python3 -m deploy.cli generate --model tiny --device cuda --spec-tokens 2 --max-tokens 48 --json \
  "hello" "the quick brown fox" | cut -c1-200
for args in "--model tiny --batch 8 --max-tokens 128" "--arch smollm2 --batch 1 --max-tokens 64" \
            "--arch smollm2 --batch 32 --max-tokens 64"; do
  python3 -m deploy.cli bench engine --device cuda --spec-tokens 3 $args | tee -a "$OUT/bench.jsonl"
done
