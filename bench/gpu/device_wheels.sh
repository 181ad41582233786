#!/usr/bin/env bash
# The wheels the device scripts (bench/gpu/*.sh) carry as .whl/ (the device tool's `carry`): what the
# GPU machines lack for the engine's benches and GPU tests (Python 3.12, CUDA 13; their torch,
# triton, transformers, numpy and msgpack stay theirs: no dependencies fetched). The service's
# larger set is `gpu_service.sh bundle` (bench/gpu/service_wheels.txt).
# Usage: bash bench/gpu/device_wheels.sh [DIR]   (default .whl, from the repository root)
set -euo pipefail
. "$(dirname "$0")/../../deploy/require.sh"; need python3 "apt-get install python3 python3-pip"; require_done
dir=${1:-.whl}
mkdir -p "$dir"
python3 -m pip download -q -d "$dir" --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 \
  gguf pydantic==2.14.4 pydantic-core==2.50.5 annotated-types typing-inspection 'typing-extensions>=4.16' \
  xgrammar==0.2.8 apache-tvm-ffi
ls "$dir"
