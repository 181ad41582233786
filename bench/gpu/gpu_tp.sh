#!/usr/bin/env bash
# Tensor parallelism on two GPUs (device tool, nvidia-h200-x2; issue 15). Needs .whl (gguf).
# `check`: how the GPUs are linked, the GPU TP tests (TP=2 equals one GPU, one-shot all-reduce
# equals NCCL, no decode launch syncs), and one all-reduce's latency (symm vs NCCL).
# `bench ARCH...`: decode step time of random weights of each shape at batch 1 and 64, TP=1 vs
# TP=2 (symmetric-memory all-reduce, then NCCL's), with the profiled collective time per step;
# then TP=2 at batch 1 profiled with PDL off (kernel spans then hold no waiting); a table last.
# `generate`: `pdserve generate --tp 2` against --tp 1 on tiny, whole outputs compared.
# `mtp ARCH`: k = 3 beside k = 0 at batch 1, TP=1 and TP=2. Needs pydantic's wheels for `generate`.
# Usage: bash bench/gpu/gpu_tp.sh check | bench llama-1b llama-8b | mtp llama-8b | generate | check+generate
#        | mtp+generate llama-8b | all ARCH...
set -uo pipefail
. "$(dirname "$0")/../../deploy/require.sh"; need_gpu_machine; require_done
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=${1:-all}; shift || true
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"

if [[ $stage == check* || $stage == all ]]; then
  nvidia-smi topo -m | head -3
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_tp.py 2>&1 | tee "$OUT/tests.log" | tail -8
  python3 bench/gpu/gpu_allreduce.py 2>&1 | tee "$OUT/allreduce.txt"
fi

bench() {  # one engine bench, JSON lines appended to tp.jsonl
  python3 -m deploy.cli bench engine --device cuda --max-tokens 64 --profile "$@" \
    2>&1 | grep -v -i "warn" | tee -a "$OUT/tp.jsonl" | cut -c1-300
}
if [[ $stage == bench || $stage == all ]]; then
  for arch in "${@:-llama-1b}"; do
    bench --arch "$arch" --tp 1 --spec-tokens 0 --batches 1,64
    PDSERVE_TP_ALLREDUCE=symm bench --arch "$arch" --tp 2 --spec-tokens 0 --batches 1,64
    PDSERVE_TP_ALLREDUCE=nccl bench --arch "$arch" --tp 2 --spec-tokens 0 --batches 1,64
    PDSERVE_PDL=0 bench --arch "$arch" --tp 2 --spec-tokens 0 --batch 1
  done
  python3 bench/gpu/bench_table.py "$OUT/tp.jsonl"
fi

if [[ $stage == mtp* ]]; then  # MTP (k = 3) beside k = 0 at batch 1, TP=1 and TP=2 (timed, not profiled)
  for tp in 1 2; do
    python3 -m deploy.cli bench engine --device cuda --max-tokens 64 --arch "${1:-llama-8b}" --tp $tp --spec-tokens 3 \
      --batch 1 2>&1 | grep -v -i "warn" | tee -a "$OUT/mtp.jsonl" | cut -c1-300
  done
  python3 bench/gpu/bench_table.py "$OUT/mtp.jsonl"
fi

if [[ $stage == *generate || $stage == all ]]; then
  for tp in 1 2; do
    for k in 0 3; do
      python3 -m deploy.cli generate --model tiny --device cuda --dtype float32 --tp $tp --spec-tokens $k \
        --max-tokens 48 --logprobs 2 --json "The first prompt" "A second, longer prompt for the model" \
        > "$OUT/gen_tp${tp}_k$k.json" 2> "$OUT/gen_tp${tp}_k$k.err"
    done
  done
  python3 - "$OUT" <<'PY'
import json, sys
for k in (0, 3):
    one, two = ([json.loads(l) for l in open(f"{sys.argv[1]}/gen_tp{t}_k{k}.json")] for t in (1, 2))
    same = len(one) == len(two) == 2 and all(a["token_ids"] == b["token_ids"] for a, b in zip(one, two))
    diff = max((abs(x["logprob"] - y["logprob"]) for a, b in zip(one, two)
                for x, y in zip(a["logprobs"], b["logprobs"])), default=None)
    print(f"generate k={k}: --tp 2 tokens equal --tp 1: {same} "
          f"({[len(a['token_ids']) for a in two]} tokens); max logprob difference {diff}")
PY
  cat "$OUT"/gen_tp2_k*.err
fi
