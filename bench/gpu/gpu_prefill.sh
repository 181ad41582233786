#!/usr/bin/env bash
# Prefill and TTFT on one GPU (device tool, H100 or H200). Needs .whl (gguf) carried.
#   check:   the prefill kernels' tests and the engine's GPU tests (prefill graphs, no sync)
#   bench:   `pdserve bench prefill` on SmolLM2- and Llama-3.2-1B-shaped random weights, k = 0
#            and 3, with HF forward and the floor from the same processes (the issue's table)
#   fused:   the fused prefill kernels (SwiGLU in the gate/up GEMM, rotary + K/V write in the
#            q/k/v GEMM) off and on in turn, k = 0; Llama-1B k = 3 with FR-Spec draft vocabularies;
#            the two kernels' sweeps (bench/gpu/gpu_glu.py, bench/gpu/gpu_qkv_rope.py) with `sweep`
#   profile: the same cases with --profile (kernels, GPU busy, host ms per layer), prefill
#            graphs off (--enforce-eager) beside them, and --deterministic's prefill cost
#   fold:    the layers' norms folded into the q/k/v and gate/up GEMMs (PDSERVE_FOLD_NORM 0, then
#            1, twice): prefill at 1 x 128 and 1 x 512 and the decode step at batch 1, k = 0, then
#            the GPU tests of the kernels and the engine with the fold on
#   early:   the first tokens read before the MTP drafts and constrained prompts in prefill graphs
#            (branch wip/next): the GPU tests of prefill graphs, decode and grammars, then TTFT and
#            the step with its drafts at k = 0 and 3 (SmolLM2, Llama-1B; 1 x 128, 1 x 512)
# Usage: bash bench/gpu/gpu_prefill.sh check|bench|fused|sweep|profile|fold|early|all
set -uo pipefail
. "$(dirname "$0")/../../deploy/require.sh"; need_gpu_machine; require_done
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton, inspect; print('torch', torch.__version__, 'triton', triton.__version__)
from torch.nn.attention.varlen import varlen_attn; print('varlen_attn', inspect.signature(varlen_attn))"

if [[ $stage == check || $stage == all ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_prefill_meta.py tests/kernels/test_rotary.py \
    tests/kernels/test_flash_varlen.py tests/kernels/test_flash_prefill.py tests/kernels/test_paged_attention.py tests/kernels/test_gemm_glu.py tests/kernels/test_qkv_rope.py \
    tests/kernels/test_engine_path.py tests/engine/test_gpu_prefill.py \
    tests/engine/test_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -25
fi

prefill() {  # one bench, JSON lines appended to prefill.jsonl
  python3 -m deploy.cli bench prefill --device cuda "$@" 2>&1 | tee -a "$OUT/prefill.jsonl" | grep -v '^|'
}
if [[ $stage == bench || $stage == all ]]; then
  prefill --arch smollm2 --cases 1x128,1x512,1x2048,16x512,4x4096 --spec-tokens 3 --hf
  prefill --arch llama-1b --cases 1x128,1x512,1x2048,16x512,4x4096 --spec-tokens 3 --hf
fi
if [[ $stage == sweep ]]; then
  python3 bench/gpu/gpu_glu.py 2>&1 | tail -14
  python3 bench/gpu/gpu_qkv_rope.py 2>&1 | tail -13
fi
if [[ $stage == fused || $stage == all ]]; then
  for on in 0 1; do
    export PDSERVE_PREFILL_GLU=$on PDSERVE_PREFILL_QKV_ROPE=$on
    prefill --arch smollm2 --cases 1x128,1x512,1x2048,16x512,4x4096 --spec-tokens 0
    prefill --arch llama-1b --cases 1x128,1x512,1x2048,16x512,4x4096 --spec-tokens 0
  done
  unset PDSERVE_PREFILL_GLU PDSERVE_PREFILL_QKV_ROPE
  for m in 128 512; do  # the decode path's Triton GEMMs (PDL-chained) up to m rows, where cuBLAS ran
    PDSERVE_FUSED_MAX_M=$m prefill --arch smollm2 --cases 1x128,1x512 --spec-tokens 0
    PDSERVE_FUSED_MAX_M=$m prefill --arch llama-1b --cases 1x128,1x512 --spec-tokens 0
  done
  for n in 32768 16384; do prefill --arch llama-1b --cases 1x512 --spec-tokens 3 --draft-vocab $n; done
fi
if [[ $stage == fold ]]; then
  for fold in 0 1 0 1; do
    export PDSERVE_FOLD_NORM=$fold
    for arch in smollm2 llama-1b; do
      prefill --arch $arch --cases 1x128,1x512 --spec-tokens 0 --iters 30
      python3 -m deploy.cli bench engine --device cuda --arch $arch --batch 1 --max-tokens 64 --spec-tokens 0 2>&1 \
        | grep '"ms_per_step"' | sed "s/^/fold=$fold /" | tee -a "$OUT/decode.txt"
    done
  done
  unset PDSERVE_FOLD_NORM
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py tests/kernels/test_gemm_glu.py \
    tests/kernels/test_qkv_rope.py tests/kernels/test_norm.py tests/engine/test_gpu_prefill.py tests/engine/test_gpu.py \
    2>&1 | tee "$OUT/tests.log" | tail -8
fi
if [[ $stage == early ]]; then
  PDSERVE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu_prefill.py \
    tests/engine/test_gpu.py tests/engine/test_first_token.py tests/engine/test_grammar.py 2>&1 | tee "$OUT/tests.log" | tail -6
  prefill --arch smollm2 --cases 1x128,1x512 --spec-tokens 3 --iters 30
  prefill --arch llama-1b --cases 1x128,1x512 --spec-tokens 3 --iters 30
fi
if [[ $stage == profile || $stage == all ]]; then
  prefill --arch smollm2 --cases 1x128,1x2048 --spec-tokens 3 --profile
  prefill --arch smollm2 --cases 1x128,1x2048 --spec-tokens 0 --profile --enforce-eager
  prefill --arch llama-1b --cases 1x512,16x512 --spec-tokens 0 --profile
  prefill --arch llama-1b --cases 1x512,16x512 --spec-tokens 0 --deterministic
fi
python3 - "$OUT/prefill.jsonl" <<'PY' 2>/dev/null
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print("| model | BxN | k | draft vocab | fused | eager | det | TTFT ms | with drafts ms | HF ms | floor ms | x floor | kernels | busy | host ms/layer |")
for r in rows:
    f = r.get("floor_ms")
    print(f"| {r['model']} | {r['batch']}x{r['prompt']} | {r['spec_tokens']} | {r.get('draft_vocab') or '-'} | {r.get('fused', '-')} | {not r['graphs']} | {r['deterministic']} | "
          f"{r['ttft_ms']} | {r.get('step_ms','-')} | {r.get('hf_ms','-')} | {f or '-'} | {(r['ttft_ms']/f) if f else 0:.2f} | "
          f"{r.get('kernels_per_step','-')} | {r.get('gpu_busy','-')} | {r.get('host_ms_per_layer','-')} |")
PY
