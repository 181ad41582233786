#!/usr/bin/env bash
# GPU-to-GPU KV transfer between two processes (cuda:0 -> cuda:1) on a 2-GPU host.
#
# Expects: torch with CUDA, msgpack, numpy, and ucxx-cu13 / libucxx-cu13 / libucx-cu13
# installed to /tmp/site with PYTHONPATH including it (ray/pydantic not needed).
# Run from the repository root:  bash bench/gpu/kv.sh
# Prints, per shape: our GB/s, ucx_perftest (-m cuda) GB/s, the torch cuda:0->cuda:1
# copy ceiling and both ratios; then the same as JSON lines for BENCHMARKS.md.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
. deploy/require.sh
need "$PY" "apt-get install python3, or set PYTHON"
need nvidia-smi "the NVIDIA driver's utilities, nvidia-utils-VERSION, on a machine with NVIDIA GPUs"
require_done
export PYTHONPATH="${PYTHONPATH:-/tmp/site}:$(pwd)"
export UCX_WARN_UNUSED_ENV_VARS=n

echo "== environment"
nvidia-smi --query-gpu=index,name,memory.total --format=csv || true
nvidia-smi topo -m || true
"$PY" - <<'PY'
import torch, ucxx
print("torch", torch.__version__, "cuda", torch.version.cuda, "gpus", torch.cuda.device_count())
print("ucxx", ucxx.__version__, "ucx", ucxx.get_ucx_version())
print("peer access 0<->1:", torch.cuda.device_count() > 1 and torch.cuda.can_device_access_peer(0, 1))
try:
    import cuda.core  # noqa: F401  (ucxx's progress thread sets the CUDA context with it)
    print("cuda.core present")
except ImportError:
    print("WARNING: cuda.core missing; if transfers hang, rerun with UCXPY_PROGRESS_MODE=polling")
PY
LIBUCX=$("$PY" -c 'import libucx, os; print(os.path.dirname(libucx.__file__))')
echo "== UCX transports seen by ucx_info"
LD_LIBRARY_PATH="$LIBUCX/lib" "$LIBUCX/bin/ucx_info" -d | grep -E "Transport|Device" | sort -u | head -40 || true

echo "== correctness on GPU (two processes, tcp and ucx; bytes verified: intact)"
for backend in ucx tcp; do
  "$PY" -m bench.kv --backend "$backend" --device cuda --layers 4 --blocks 64 \
      --block-bytes 4096 --iters 1 --json
done

echo "== bandwidth"
for shape in "32 256 65536" "32 1024 65536" "61 256 36864"; do
  set -- $shape
  # 32 x 256 x 64 KiB = 512 MiB; 32 x 1024 x 64 KiB = 2 GiB;
  # 61 layers x 256 blocks x 36 KiB: a 4k-token request of a DeepSeek-V3-like MLA cache.
  "$PY" -m bench.kv --backend ucx --device cuda --layers "$1" --blocks "$2" \
      --block-bytes "$3" --iters 10
  "$PY" -m bench.kv --backend ucx --device cuda --layers "$1" --blocks "$2" \
      --block-bytes "$3" --iters 10 --json | tee -a /tmp/kv_gpu_bench.jsonl
done
echo "== JSON lines in /tmp/kv_gpu_bench.jsonl"
