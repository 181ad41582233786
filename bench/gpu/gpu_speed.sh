#!/usr/bin/env bash
# GPU speed (device tool, one H100 or H200): `check` runs the kernel tests and the engine's GPU
# tests on CUDA and the kernels against their references at real shapes; `bench` times the
# engine (CUDA graphs + Triton kernels) on SmolLM2- and Llama-3.2-1B-shaped random weights with
# the copy floor and Hugging Face generate from the same processes. Needs .whl carried (bash
# bench/gpu/device_wheels.sh makes it).
# `profile` takes the per-kernel profiles (top kernels) and the cost of --deterministic.
# `pdl` times the key rows with programmatic dependent launch off, then on (PDSERVE_PDL).
# `frspec` (issue 30): first the GPU tests of the decode step (no sync, one output copy per launch,
# fp32 greedy equal to the reference, penalties on the graph path, the step's kernels); then the Llama-1B k=3 / k=0 step ratio at
# batch 1 with the full vocabulary and FR-Spec draft vocabularies of 32k and 16k, SmolLM2 at batch
# 32 (GPU busy, kernels/copies per step), each with --profile, and the draft heads' GEMM sweep.
# `regress`: the batch 64 / 128 rows issue 30 must not lose (Llama-1B b64, SmolLM2 b128), SmolLM2
# b32 GPU busy, Llama-1B k=3 with a 32k draft vocabulary; then the GPU tests of graph capture
# (decode halves, prefill graphs, the grammar on CUDA).
# `ropeattn` (issue 30): rotary and the K/V write inside the attention kernel for decode-sized
# steps (PDSERVE_ROPE_IN_ATTENTION 0 / 1, twice): the kernel and engine GPU tests with it on, then
# batch-1 steps and SmolLM2 b32 k=3.
# `prefetch`: decode GEMMs' weights prefetched into L2 before the PDL wait, off / on twice.
# `final6`: the engine GPU tests and the goal / regress rows with the defaults (Llama-1B b64 since session 7).
# `b1prof`: batch-1 top kernels and idle gaps (SmolLM2, Llama-1B, k=0).
# `hostsplit`: where the host's time per decode step goes (bench/host_split.py) beside the GPU's
# idle gaps, SmolLM2 b1 / b32, and Llama-1B b1 k=0 / k=3 with 32k drafts kernel by kernel.
# `midtiles`: tile_config's 32-column tiles and deeper pipelines for 8-48 MB weights (PDSERVE_MID_TILES
# 0 / 1, twice): Llama-1B b1 k=0 / k=3 with 32k drafts, b64 k=0, SmolLM2 b1 as the control.
# `outkernel`: the step's output copy as a kernel writing pinned memory (PDSERVE_OUTPUT_KERNEL 0 / 1, twice).
# (`syncmode`, the output kernel beside a sleeping read point, ran on commit e5fcb40; its switch is gone.)
# `mtpinput`: the MTP's input gather + norms in one launch and eh_proj's sums of squares
# (PDSERVE_MTP_INPUT_KERNEL 0 / 1, twice): SmolLM2 and Llama-1B (32k drafts) b1 k=0 / 3.
# `gemv`: the register-tile GEMV for one row over small weights (kernels/gemv.py; PDSERVE_GEMV 0 / 1,
# twice): SmolLM2 and Llama-1B (32k drafts) b1 k=0 / 3, SmolLM2 b32 (a control); then the kernel and
# engine GPU tests. (Its first run, commit message of the kernel, also ran bench/gpu/persist_probe.py,
# up to 4 rows, and Llama-1B with PDSERVE_GEMV_MAX_MB=16.)
# `preload`: the split-K kernel's first K block of weights read into registers before the PDL wait
# (PDSERVE_PRELOAD 0 / 1, twice): Llama-1B b1 k=0 / 3 (32k drafts) and b64, SmolLM2 b32.
# `next11` (session 9): decode attention's first key tile read before the PDL wait
# (PDSERVE_ATTN_PRELOAD 0 / 1, twice: Llama-1B b1 k=0 / 3 with 32k drafts, SmolLM2 b32 k=0), then
# Llama-1B b1's kernels per step (k=0 and k=3), and the attention kernel tests on CUDA.
# `embed`: the embedding gather leaving its rows' sums of squares, so the first layer's norm runs in its
# q/k/v GEMM (PDSERVE_EMBED_KERNEL 0 / 1, twice): SmolLM2 b1 k=0 / 3, Llama-1B b1 k=0 / 3 (32k drafts),
# SmolLM2 b32 k=0 with the profiler; then the norm kernel and engine GPU tests.
# `bigbatch`: the batch-64/128 rows with decode attention's first-tile preload off / on
# (PDSERVE_ATTN_PRELOAD, twice), then with the embedding kernel off: Llama-1B b64 and SmolLM2 b128, k=0.
# `b1inc`: what each kernel adds to a batch-1 step under PDL (bench/step_trace.py: its end past the
# latest end before it, grouped by its offset from the layer's attention kernel): Llama-1B k=0 and k=3
# (32k drafts), SmolLM2 k=0.
# `tiles`: Llama-1B b1 k=0 with other tiles for o, down and gate/up inside the real step (PDSERVE_TILES;
# session 7 chose them from isolated chains of one op), twice in alternation.
# `pfetch`: Llama-1B b1 k=0 with the L2 prefetch of o's whole weight (PDSERVE_PREFETCH_MB=8) and of
# q/k/v's (PDSERVE_PREFETCH_MAX_MB=13), twice.
# `attnregs` (session 10): decode attention with the step's keys kept in registers and its last key tile
# read before the PDL wait, against the kernel before it (old_paged_attention.py, put there by hand:
# `git show 9d0193b:kernels/paged_attention.py > old_paged_attention.py`) and against itself with
# PDSERVE_ATTN_PRELOAD_LAST=0: Llama-1B b1 k=0 / 3 (32k drafts), SmolLM2 b1 k=0 / 3 and b32 k=0.
# `attnfinal`: the attention, engine-path and engine GPU tests on CUDA, b1inc's trace for Llama-1B and
# SmolLM2 k=0, SmolLM2 b32 with the profiler, Llama-1B b64 / SmolLM2 b128 with the preload's row limit 32 / 128.
# `preloadmid` (session 11): the split-K kernel's first weight block read before the PDL wait for
# Llama-1B's o (8 MB; PDSERVE_PRELOAD_MAX_MB=9) and q/k/v too (13), against the default 4, twice:
# b1 k=3 with 32k drafts (its k=0 step beside it). With it on for all of Llama-1B's weights (8-525 MB) b1 lost.
# `attnbn` (session 11): decode attention's key tile of 64 or 128 tokens where it preloads
# (PDSERVE_ATTN_PRELOAD_BLOCK_N; the bench's 64-136-token contexts then fit one tile), twice, after
# the attention tests with 128: Llama-1B b1 k=3 with 32k drafts (and its k=0), SmolLM2 b1 k=3 (and k=0), b32 k=0.
# `qkvsplit` (session 11): Llama-1B b1 k=0's per-kernel trace with q/k/v split in K in 2 and 4
# (PDSERVE_TILES; its norm then runs as a kernel of its own and a sum kernel follows): what the GEMM
# itself would gain if decode attention summed the shares.
# `attnq1` (session 11; 64 / 128 kept): the key tile of 128 only for decode attention's launches of one query a row
# (PDSERVE_ATTN_PRELOAD_BLOCK_N_Q1; 64 / 64, 64 / 128 and 128 / 128 for all / one-query launches; the first two twice),
# after the attention tests with it: SmolLM2 b1 k=3 (and k=0), b32 k=0, Llama-1B b1 k=3 with 32k drafts
# (and k=0); then Llama-1B and SmolLM2 b1 k=0 with 2048-token prompts (16-32 tiles of 64).
# `splits` (session 11): decode attention's key splits as a server sizes them: `bench engine` sizes its
# graphs for prompt + max tokens (one split), a server for max_model_len (4096 by default: 16 splits at
# batch 1, most of them empty for short contexts, and a combine launch a layer). Llama-1B and SmolLM2
# b1 k=0 with 64- and 2048-token prompts, --max-model-len 4096, PDSERVE_SPLIT_BLOCKS 16 (the default),
# 64 and 256 (one split); SmolLM2 b32 k=0 and Llama-1B b1 k=3 (32k drafts) at 4096 too.
# `splitinc` (session 11): b1inc's per-kernel trace for Llama-1B b1 k=0 with the bench's graphs, with
# a server's (--max-model-len 4096: 16 splits) at 64- and 2048-token prompts, and with one split
# (PDSERVE_SPLIT_BLOCKS=256); SmolLM2 b32 k=0's top kernels, the bench's graphs against a server's.
# `shortkv` (session 11; kept): decode graphs of two block-table widths (engine/cuda_graphs.py): rows whose
# blocks fit PDSERVE_SHORT_KV_BLOCKS (16) replay graphs with one key split, no combine launch. First the
# engine GPU tests (both widths against eager fp32), the warm-up and first-token tests; then with
# --max-model-len 4096 as a server, PDSERVE_SHORT_KV_BLOCKS=0 (one width, before) against the default,
# twice: Llama-1B b1 k=3 with 32k drafts (and its k=0), SmolLM2 b1 k=3 (and k=0), SmolLM2 b32 k=0, and
# Llama-1B b1 k=0 with a 2048-token prompt (the wide graphs either way).
# `stamps` (session 11): the step stamps' CUDA tests and the constrained GPU tests (xgrammar carried),
# then SmolLM2 b32 k=0 / k=3 with PDSERVE_STEP_STAMPS=1 and --profile (the stamped busy share beside
# the profiler's), and k=0 with the stamps off / on unprofiled (their own cost), twice.
# `final7` (session 11's defaults; run in session 12): the GPU tests session 11 could not see (step stamps, both
# graph widths, the constrained ones, the engine's and the first token's: xgrammar carried), then the
# goal and regress rows sized as a server (--max-model-len 4096), SmolLM2 b32 with the step stamps.
# `final8`: those tests after session 12's padding-row fix, compute-sanitizer's memcheck over the rotary
# attention tests and the constrained prefill test (it then ran `fusedmlp`, the one-launch decode MLP: it lost and
# was removed; BENCHMARKS session 12).
# `warmup`: a decode node's build and warm-up (bench/gpu/warmup_time.py), PDSERVE_SHORT_KV_BLOCKS 0 and 16,
# cold (own Triton cache) then warm, SmolLM2 and Llama-1B at k=3.
# `sanitize` (session 13: 287 passed, 0 errors): tests/kernels on CUDA under compute-sanitizer's memcheck.
# `midctx2` (session 13; won up to 1,280 tokens, lost at 2,048: 17 tiles in 16 splits): b1 at 256-2048-token
# prompts (k=0; k=3 to 640) as a server, the defaults against a split per 8 blocks (one 128-key tile) from 17
# blocks, at most 16 (PDSERVE_SPLIT_BLOCKS=8, ONE_SPLIT_BLOCKS=16, MAX_SPLITS=16) with widths 16,32,64 (tile3)
# or 16,64 (tile2, once); then tile3's warm start-up graphs.
# `final11` (session 13): issue 30's rows as a server with session 13's defaults, then batch 2 and 4 at 400-
# and 900-token prompts, the old splits against the new.
# `final10`: final9's GPU tests in full, with widths 16,32,64,128,192 (the defaults now).
# `final9` (session 13; its tests were cut by their timeout): the GPU tests with midctx3's t4 as the defaults,
# b1 at 2048/2560 tokens old / t4 / t4 with a 192 width (t5, now the default), then t4's start-up
# (SmolLM2, Llama-1B) and t5's (SmolLM2), cold and warm.
# `midctx3` (session 13; t4 plus a 192 width became the defaults): midctx2's knobs without the cap
# (MAX_SPLITS=0), widths 16,32,64 (t3, once) and 16,32,64,128 (t4), 256-3072-token prompts at k=0; then t4's
# start-up, cold and warm.
# `midctx` (session 12): Llama-1B and SmolLM2 b1 k=0 with 256-, 640- and 1280-token prompts as a server
# (--max-model-len 4096), decode graph widths PDSERVE_SHORT_KV_BLOCKS 16 (the default: 1 split up to 16
# blocks, else 16-17), 16,64 (4 splits up to 64 blocks) and 16,32,128 (2 and 8 splits; once), the first
# two twice: does a mid-length context want a third width?
# Usage: bash bench/gpu/gpu_speed.sh check|bench|profile|pdl|frspec|regress|ropeattn|prefetch|final6|b1prof|hostsplit|midtiles|outkernel|mtpinput|gemv|preload|next11|embed|bigbatch|b1inc|tiles|pfetch|attnregs|attnfinal|preloadmid|attnbn|qkvsplit|attnq1|splits|splitinc|shortkv|stamps|final7|final8|warmup|sanitize|midctx2|midctx3|final9|final10|final11|midctx|all
set -uo pipefail
. "$(dirname "$0")/../../deploy/require.sh"; need_gpu_machine; require_done
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
stage=${1:-all}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"

if [[ $stage == check || $stage == all ]]; then
  python3 -m pytest -q -p no:cacheprovider -x tests/kernels tests/engine/test_gpu.py 2>&1 | tee "$OUT/tests.log" | tail -8
  python3 bench/gpu/gpu_kernels.py 2>&1 | tee "$OUT/kernels.txt"
fi

bench() {  # one engine bench, JSON lines appended to bench.jsonl
  python3 -m deploy.cli bench engine --device cuda "$@" 2>&1 | tee -a "$OUT/bench.jsonl"
}
if [[ $stage == bench || $stage == all ]]; then
  bench --arch smollm2 --batch 1 --max-tokens 128 --spec-tokens 3 --profile --hf
  bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 3 --enforce-eager
  bench --arch smollm2 --batch 32 --max-tokens 128 --spec-tokens 3 --profile
  bench --arch smollm2 --batch 128 --max-tokens 128 --spec-tokens 3 --hf
  bench --arch llama-1b --batch 1 --max-tokens 128 --spec-tokens 3 --profile --hf
  bench --arch llama-1b --batch 64 --max-tokens 128 --spec-tokens 3 --hf
  python3 bench/gpu/bench_table.py "$OUT/bench.jsonl"
fi

if [[ $stage == regress ]]; then
  bench --arch smollm2 --batch 128 --max-tokens 128 --spec-tokens 3
  bench --arch llama-1b --batch 64 --max-tokens 128 --spec-tokens 3
  bench --arch smollm2 --batch 32 --max-tokens 128 --spec-tokens 3 --profile
  bench --arch llama-1b --batch 1 --max-tokens 128 --spec-tokens 3 --draft-vocab 32768
  python3 bench/gpu/bench_table.py "$OUT/bench.jsonl"
  PDSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_grammar.py \
    tests/engine/test_gpu.py::test_constrained_steps_in_halves_never_sync tests/engine/test_gpu_prefill.py 2>&1 \
    | tee "$OUT/tests.log" | tail -4
fi

if [[ $stage == ropeattn ]]; then
  PDSERVE_ROPE_IN_ATTENTION=1 timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    tests/engine/test_gpu.py 2>&1 | tail -3
  for on in 0 1 0 1; do
    for a in smollm2 llama-1b; do
      PDSERVE_ROPE_IN_ATTENTION=$on bench --arch $a --batch 1 --max-tokens 128 --spec-tokens 0 > /dev/null
    done
    PDSERVE_ROPE_IN_ATTENTION=$on bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 3 > /dev/null
  done
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'ms_per_step' in r: print(r['model'], r['batch'], r['spec_tokens'], r['ms_per_step'])"
fi

if [[ $stage == prefetch ]]; then  # weights asked for in L2 before the PDL wait: variants, twice
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py 2>&1 | tail -2
  for rep in 1 2; do for v in "PDSERVE_PREFETCH=0" "PDSERVE_PREFETCH=1" "PDSERVE_PREFETCH_MAX_MB=1e9"; do
    for a in smollm2 llama-1b; do
      env $v python3 -m deploy.cli bench engine --device cuda --arch $a --batch 1 --max-tokens 96 --spec-tokens 0 \
        | sed "s/^{/{\"variant\": \"$v\", /" >> "$OUT/bench.jsonl"
    done
    env $v python3 -m deploy.cli bench engine --device cuda --arch llama-1b --batch 64 --max-tokens 48 --spec-tokens 0 \
      | sed "s/^{/{\"variant\": \"$v\", /" >> "$OUT/bench.jsonl"
  done; done
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'ms_per_step' in r: print(r['variant'], r['model'], r['batch'], r['spec_tokens'], r['ms_per_step'])"
fi

if [[ $stage == final6 ]]; then  # session 6's defaults: the engine GPU tests, then the goal and regress rows
  PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py \
    tests/engine/test_first_token.py 2>&1 | tail -2
  bench --arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3 > /dev/null
  bench --arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768 > /dev/null
  bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 3 --profile > /dev/null
  bench --arch smollm2 --batch 128 --max-tokens 64 --spec-tokens 3 > /dev/null
  bench --arch llama-1b --batch 64 --max-tokens 64 --spec-tokens 0 > /dev/null
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'ms_per_step' in r: print(r['model'], r['batch'], r['spec_tokens'], r.get('draft_vocab'), r['ms_per_step'], r['tokens_per_s'], r.get('gpu_busy'), r.get('host_split'))"
fi

kernel_table() {  # kernel_table FILE: each profiled row's top kernels and idle gaps
  python3 -c "import json
for l in open('$1'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'top_kernels' not in r: continue
    print(r['model'], 'k', r['spec_tokens'], 'busy', r['gpu_busy'], {k: v for k, v in r.items() if k.endswith('_per_step')})
    for k in r['top_kernels']: print('  ', k)
    for g in r.get('top_gaps', []): print('  gap', g)"
}

if [[ $stage == b1prof ]]; then  # where a batch-1 step's time goes: top kernels and idle gaps
  bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  kernel_table "$OUT/bench.jsonl"
fi

if [[ $stage == hostsplit ]]; then  # is the b32 k=0 step-boundary gap the host's?
  which nsys ncu 2>&1 | head -2
  bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 3 --profile > /dev/null
  bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768 --profile > /dev/null
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'host_split' not in r: continue
    print(r['model'], 'b', r['batch'], 'k', r['spec_tokens'], r['ms_per_step'], 'busy', r.get('gpu_busy'), r['host_split'])
    for g in r.get('top_gaps', [])[:4]: print('  gap', g)
    if 'llama' in r['model']:
        for k in r['top_kernels'][:14]: print('  ', k)"
fi

ab() {  # ab VAR "bench args" ...: each bench with VAR=0, then VAR=1, twice; rows labelled "VAR=x"
  local var=$1; shift
  for rep in 1 2; do for on in 0 1; do for a in "$@"; do
    env "$var=$on" python3 -m deploy.cli bench engine --device cuda $a | sed "s/^{/{\"variant\": \"$var=$on\", /" >> "$OUT/bench.jsonl"
  done; done; done
}
# one engine bench of a variant, sized as a server: its name, then bench engine's arguments (its env is the
# caller's); its JSON lines, tagged with both, appended to bench.jsonl
vbench() {
  local v=$1; shift
  timeout 120 python3 -m deploy.cli bench engine --device cuda --max-model-len 4096 "$@" \
    | sed "s|^{|{\"variant\": \"$v $*\", |" >> "$OUT/bench.jsonl"
}
mid() {  # vbench at batch 1 for 64 tokens
  vbench "$@" --batch 1 --max-tokens 64
}
old() { PDSERVE_SPLIT_BLOCKS=16 PDSERVE_ONE_SPLIT_BLOCKS=16 PDSERVE_SHORT_KV_BLOCKS=16 "$@"; }  # session 12's splits

rows() {  # variant, model, batch, k, ms/step, GPU busy (profiler), the GPU's busy time over the timed step, host split
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'ms_per_step' in r:
        act = r['gpu_busy'] * r['profiled_ms_per_step'] / r['ms_per_step'] if r.get('gpu_busy') else None
        print(r.get('variant'), r['model'], r['batch'], r['spec_tokens'], r['ms_per_step'], r.get('gpu_busy'),
              act and round(act, 4), r.get('host_split'))"
}

if [[ $stage == midtiles ]]; then
  PDSERVE_MID_TILES=1 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py 2>&1 | tail -1
  ab PDSERVE_MID_TILES "--arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768" \
    "--arch llama-1b --batch 64 --max-tokens 64 --spec-tokens 0" "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 0"
  rows
fi

if [[ $stage == outkernel ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_publish.py 2>&1 | tail -1
  PDSERVE_OUTPUT_KERNEL=1 PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider \
    tests/engine/test_gpu.py 2>&1 | tail -1
  ab PDSERVE_OUTPUT_KERNEL "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3" \
    "--arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --profile" "--arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 0"
  rows
fi

if [[ $stage == mtpinput ]]; then
  python3 -m pytest -q -p no:cacheprovider tests/kernels/test_norm.py tests/kernels/test_linear.py 2>&1 | tail -1
  PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py 2>&1 | tail -1
  ab PDSERVE_MTP_INPUT_KERNEL "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3" \
    "--arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768"
  rows
fi

if [[ $stage == gemv ]]; then
  ab PDSERVE_GEMV "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3" \
    "--arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768"  # their k=0 rows too
  bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 3 --profile > /dev/null
  rows
  PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_gemv.py \
    tests/kernels/test_linear.py tests/engine/test_gpu.py 2>&1 | grep -E 'passed|failed|Error' | tail -5
fi

if [[ $stage == preload ]]; then  # the split-K kernel's first K block read into registers before the PDL wait
  ab PDSERVE_PRELOAD "--arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768" \
    "--arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --profile" "--arch llama-1b --batch 64 --max-tokens 48 --spec-tokens 0"
  rows
  PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_linear.py \
    tests/kernels/test_gemv.py 2>&1 | grep -E 'passed|failed|Error' | tail -5
fi

if [[ $stage == next11 ]]; then
  which nsys ncu 2>&1 | head -2
  ab PDSERVE_ATTN_PRELOAD "--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0" \
    "--arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768" \
    "--arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --profile"
  rows
  : > "$OUT/prof.jsonl"
  for k in 0 3; do
    python3 -m deploy.cli bench engine --device cuda --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens $k \
      --draft-vocab 32768 --profile >> "$OUT/prof.jsonl" 2>/dev/null
  done
  kernel_table "$OUT/prof.jsonl"
  PDSERVE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    tests/engine/test_gpu.py 2>&1 | grep -E 'passed|failed|Error' | tail -5
fi

if [[ $stage == embed ]]; then
  ab PDSERVE_EMBED_KERNEL "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3" \
    "--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768" \
    "--arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --profile"
  rows
  PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_norm.py \
    tests/engine/test_gpu.py 2>&1 | grep -E 'passed|failed|Error' | tail -5
fi

if [[ $stage == bigbatch ]]; then
  ab PDSERVE_ATTN_PRELOAD "--arch llama-1b --batch 64 --max-tokens 48 --spec-tokens 0" \
    "--arch smollm2 --batch 128 --max-tokens 64 --spec-tokens 0"
  for a in "--arch llama-1b --batch 64 --max-tokens 48 --spec-tokens 0" "--arch smollm2 --batch 128 --max-tokens 64 --spec-tokens 0"; do
    PDSERVE_EMBED_KERNEL=0 python3 -m deploy.cli bench engine --device cuda $a \
      | sed "s/^{/{\"variant\": \"PDSERVE_EMBED_KERNEL=0\", /" >> "$OUT/bench.jsonl"
  done
  rows
fi

if [[ $stage == b1inc ]]; then
  bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768 --profile > /dev/null
  bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    inc = r.get('layer_increments')
    if not inc: continue
    print(r['model'], 'k', r['spec_tokens'], r['ms_per_step'], 'ms; span', inc['step_us'], 'us; idle between steps', inc['boundary_idle_us'])
    for g in inc['groups']: print('  ', g)"
fi

if [[ $stage == tiles ]]; then
  for rep in 1 2; do for t in "" "2048x2048=32/128/2/4/4" "2048x2048=16/256/1/4/6" "2048x8192=32/128/2/4/4" \
      "2048x8192=32/128/8/4/4" "16384x2048=128/64/1/4/3"; do
    PDSERVE_TILES="$t" python3 -m deploy.cli bench engine --device cuda --arch llama-1b --batch 1 --max-tokens 64 \
      --spec-tokens 0 | sed "s|^{|{\"variant\": \"tiles=$t\", |" >> "$OUT/bench.jsonl"
  done; done
  rows
fi

if [[ $stage == pfetch ]]; then
  for rep in 1 2; do for v in "4 8" "8 8" "4 13" "8 13" "13 13"; do set -- $v
    PDSERVE_PREFETCH_MB=$1 PDSERVE_PREFETCH_MAX_MB=$2 python3 -m deploy.cli bench engine --device cuda --arch llama-1b \
      --batch 1 --max-tokens 64 --spec-tokens 0 | sed "s/^{/{\"variant\": \"prefetch_mb=$1 max_mb=$2\", /" >> "$OUT/bench.jsonl"
  done; done
  rows
fi

if [[ $stage == attnregs ]]; then
  PDSERVE_TEST_DEVICE=cuda timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    tests/kernels/test_engine_path.py tests/engine/test_gpu.py 2>&1 | grep -E 'passed|failed|Error' | tail -3
  cp kernels/paged_attention.py /tmp/pa_new.py
  for v in old new0 new old new; do
    if [[ $v == old ]]; then cp old_paged_attention.py kernels/paged_attention.py; else cp /tmp/pa_new.py kernels/paged_attention.py; fi
    last=1; [[ $v == new0 ]] && last=0
    for a in "--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0" "--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768" \
        "--arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 0" "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3" \
        "--arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0"; do
      PDSERVE_ATTN_PRELOAD_LAST=$last python3 -m deploy.cli bench engine --device cuda $a \
        | sed "s/^{/{\"variant\": \"$v\", /" >> "$OUT/bench.jsonl"
    done
  done
  cp /tmp/pa_new.py kernels/paged_attention.py
  rows
fi

if [[ $stage == attnfinal ]]; then
  PDSERVE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_paged_attention.py \
    tests/kernels/test_engine_path.py tests/engine/test_gpu.py 2>&1 | tail -4
  bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --profile > /dev/null
  for rows in 32 128; do
    PDSERVE_ATTN_PRELOAD_MAX_ROWS=$rows python3 -m deploy.cli bench engine --device cuda --arch llama-1b --batch 64 \
      --max-tokens 64 --spec-tokens 0 | sed "s/^{/{\"variant\": \"max_rows=$rows\", /" >> "$OUT/bench.jsonl"
    PDSERVE_ATTN_PRELOAD_MAX_ROWS=$rows python3 -m deploy.cli bench engine --device cuda --arch smollm2 --batch 128 \
      --max-tokens 128 --spec-tokens 0 | sed "s/^{/{\"variant\": \"max_rows=$rows\", /" >> "$OUT/bench.jsonl"
  done
  rows
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    inc = r.get('layer_increments')
    if not inc or r['batch'] != 1: continue
    print(r['model'], 'k', r['spec_tokens'], r['ms_per_step'], 'ms; span', inc['step_us'], 'us')
    for g in inc['groups']: print('  ', g)"
fi

if [[ $stage == attnbn ]]; then
  PDSERVE_ATTN_PRELOAD_BLOCK_N=128 PDSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_paged_attention.py 2>&1 | tail -1
  for rep in 1 2; do for bn in 64 128; do for a in "--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768" \
      "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3" "--arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0"; do
    PDSERVE_ATTN_PRELOAD_BLOCK_N=$bn python3 -m deploy.cli bench engine --device cuda $a \
      | sed "s/^{/{\"variant\": \"block_n=$bn\", /" >> "$OUT/bench.jsonl"
  done; done; done
  rows
fi

if [[ $stage == qkvsplit ]]; then
  for t in "" "3072x2048=32/128/2/4/4" "3072x2048=32/128/4/4/4"; do
    PDSERVE_TILES="$t" python3 -m deploy.cli bench engine --device cuda --arch llama-1b --batch 1 --max-tokens 64 \
      --spec-tokens 0 --profile | sed "s|^{|{\"variant\": \"tiles=$t\", |" >> "$OUT/bench.jsonl"
  done
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    inc = r.get('layer_increments')
    if not inc: continue
    print(r.get('variant'), r['ms_per_step'], 'ms; span', inc['step_us'], 'us')
    for g in inc['groups']: print('  ', g)"
fi

if [[ $stage == attnq1 ]]; then
  PDSERVE_ATTN_PRELOAD_BLOCK_N_Q1=128 PDSERVE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_paged_attention.py 2>&1 | tail -1
  for v in 64/64 64/128 128/128 64/64 64/128; do
    for a in "--arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3" "--arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0" \
        "--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768" \
        "--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0 --prompt-len 2048" \
        "--arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 0 --prompt-len 2048"; do
      PDSERVE_ATTN_PRELOAD_BLOCK_N=${v%/*} PDSERVE_ATTN_PRELOAD_BLOCK_N_Q1=${v#*/} python3 -m deploy.cli bench engine \
        --device cuda $a | sed "s|^{|{\"variant\": \"block_n=$v prompt=${a##*--prompt-len }\", |;s|prompt=--arch[^\"]*|prompt=64|" \
        >> "$OUT/bench.jsonl"
    done
  done
  rows
fi

if [[ $stage == splits ]]; then
  sp() {  # variant, then bench engine's arguments
    local v=$1; shift
    python3 -m deploy.cli bench engine --device cuda "$@" | sed "s|^{|{\"variant\": \"$v\", |" >> "$OUT/bench.jsonl"
  }
  for m in llama-1b smollm2; do
    sp "prompt=64 mml=bench" --arch $m --batch 1 --max-tokens 64 --spec-tokens 0
    for p in 64 2048; do for sb in 16 64 256; do
      PDSERVE_SPLIT_BLOCKS=$sb sp "prompt=$p mml=4096 split_blocks=$sb" --arch $m --batch 1 --max-tokens 64 \
        --spec-tokens 0 --prompt-len $p --max-model-len 4096
    done; done
  done
  sp "prompt=64 mml=bench" --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0
  sp "prompt=64 mml=4096" --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --max-model-len 4096
  sp "prompt=64 mml=4096" --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768 --max-model-len 4096
  rows
fi

if [[ $stage == splitinc ]]; then
  pv() {  # variant, then bench engine's arguments
    local v=$1; shift
    python3 -m deploy.cli bench engine --device cuda --profile "$@" | sed "s|^{|{\"variant\": \"$v\", |" >> "$OUT/bench.jsonl"
  }
  a="--arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0"
  pv "bench" $a
  pv "mml=4096" $a --max-model-len 4096
  PDSERVE_SPLIT_BLOCKS=256 pv "mml=4096 one split" $a --max-model-len 4096
  pv "mml=4096 prompt=2048" $a --max-model-len 4096 --prompt-len 2048
  pv "bench" --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0
  pv "mml=4096" --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --max-model-len 4096
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    inc = r.get('layer_increments')
    if not inc: continue
    print(r['variant'], r['model'], 'b', r['batch'], r['ms_per_step'], 'ms; span', inc['step_us'], 'us; busy', r['gpu_busy'])
    for g in inc['groups'] if r['batch'] == 1 else []: print('  ', g)
    for k in r['top_kernels'] if r['batch'] > 1 else []: print('  ', k)"
fi

if [[ $stage == shortkv ]]; then
  timeout 420 python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_gpu_prefill.py \
    tests/engine/test_first_token.py 2>&1 | tail -3
  skv() {  # PDSERVE_SHORT_KV_BLOCKS, then bench engine's arguments
    local v=$1; shift
    PDSERVE_SHORT_KV_BLOCKS=$v python3 -m deploy.cli bench engine --device cuda "$@" --max-model-len 4096 \
      | sed "s|^{|{\"variant\": \"short_kv_blocks=$v\", |" >> "$OUT/bench.jsonl"
  }
  for v in 0 16 0 16; do
    skv $v --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --draft-vocab 32768
    skv $v --arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3
    skv $v --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0
  done
  for v in 0 16; do skv $v --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0 --prompt-len 2048; done
  rows
fi

if [[ $stage == stamps ]]; then
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_stamps.py tests/engine/test_cuda_graphs.py \
    tests/engine/test_gpu.py tests/engine/test_gpu_prefill.py -k "stamp or constrained" 2>&1 | tail -3
  st() {  # variant, then bench engine's arguments
    local v=$1; shift
    python3 -m deploy.cli bench engine --device cuda "$@" | sed "s|^{|{\"variant\": \"$v\", |" >> "$OUT/bench.jsonl"
  }
  PDSERVE_STEP_STAMPS=1 st "stamps, profiled" --arch smollm2 --batch 32 --max-tokens 128 --spec-tokens 3 --profile
  for rep in 1 2; do
    st "no stamps" --arch smollm2 --batch 32 --max-tokens 128 --spec-tokens 0
    PDSERVE_STEP_STAMPS=1 st "stamps" --arch smollm2 --batch 32 --max-tokens 128 --spec-tokens 0
  done
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'ms_per_step' in r:
        print(r['variant'], r['model'], r['batch'], r['spec_tokens'], r['ms_per_step'], 'profiler', r.get('gpu_busy'),
              'stamped', r.get('gpu_busy_stamped'), r.get('stamped_step_us'), r.get('stamped_gap_us'))"
fi

if [[ $stage == final7 ]]; then
  timeout 300 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_stamps.py tests/engine/test_cuda_graphs.py \
    tests/engine/test_gpu.py tests/engine/test_gpu_prefill.py tests/engine/test_first_token.py 2>&1 \
    | tee "$OUT/tests.log" | tail -4
  f7() {  # bench engine's arguments, sized as a server
    python3 -m deploy.cli bench engine --device cuda --max-model-len 4096 "$@" >> "$OUT/bench.jsonl"
  }
  f7 --arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3
  f7 --arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768
  PDSERVE_STEP_STAMPS=1 f7 --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 3
  f7 --arch smollm2 --batch 128 --max-tokens 64 --spec-tokens 0
  f7 --arch llama-1b --batch 64 --max-tokens 64 --spec-tokens 0
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'ms_per_step' in r: print(r['model'], r['batch'], r['spec_tokens'], r.get('draft_vocab'), r['ms_per_step'],
                                  r['tokens_per_s'], r.get('gpu_busy_stamped'), r.get('stamped_gap_us'))"
fi

if [[ $stage == final8 ]]; then  # session 12: the GPU tests after the padding-row fix, compute-sanitizer
  timeout 220 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_stamps.py tests/engine/test_cuda_graphs.py \
    tests/engine/test_gpu.py tests/engine/test_gpu_prefill.py tests/engine/test_first_token.py > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log"
  timeout 150 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider \
    tests/kernels/test_paged_attention.py -k "rotary or rows_without" \
    tests/engine/test_gpu_prefill.py::test_constrained_first_tokens_replay_a_graph_and_equal_eager > "$OUT/memcheck.log" 2>&1
  grep -E "passed|failed|ERROR SUMMARY" "$OUT/memcheck.log" | tail -3
fi

if [[ $stage == warmup ]]; then  # a decode node's start-up graphs with one block-table width and with two
  for a in smollm2 llama-1b; do for run in cold warm; do for w in 0 16; do
    TRITON_CACHE_DIR=/tmp/tc_${a}_$w PDSERVE_SHORT_KV_BLOCKS=$w timeout 200 python3 bench/gpu/warmup_time.py --arch $a \
      --spec-tokens 3 | sed "s|^{|{\"run\": \"$run\", |" | tee -a "$OUT/warmup.jsonl"
  done; done; done
fi

if [[ $stage == sanitize ]]; then  # every kernel test on CUDA under compute-sanitizer's memcheck (out-of-bounds reads)
  timeout 540 compute-sanitizer --tool memcheck --print-limit 5 python3 -m pytest -q -p no:cacheprovider tests/kernels \
    > "$OUT/memcheck.log" 2>&1
  grep -E "passed|failed|ERROR SUMMARY|Invalid|at .* in .*\.py" "$OUT/memcheck.log" | sort | uniq -c | head -20
fi

if [[ $stage == midctx2 ]]; then  # a split per 128-key tile for mid-length contexts (session 12's knobs)
  for rep in 1 2; do for m in llama-1b smollm2; do for p in 256 640 1280 2048; do for k in 0 3; do
    [[ $k == 3 && ( $p == 1280 || $p == 2048 ) ]] && continue
    mid default --arch $m --prompt-len $p --spec-tokens $k
    PDSERVE_SPLIT_BLOCKS=8 PDSERVE_ONE_SPLIT_BLOCKS=16 PDSERVE_MAX_SPLITS=16 PDSERVE_SHORT_KV_BLOCKS=16,32,64 \
      mid tile3 --arch $m --prompt-len $p --spec-tokens $k
    [[ $rep == 1 ]] && PDSERVE_SPLIT_BLOCKS=8 PDSERVE_ONE_SPLIT_BLOCKS=16 PDSERVE_MAX_SPLITS=16 \
      PDSERVE_SHORT_KV_BLOCKS=16,64 mid tile2 --arch $m --prompt-len $p --spec-tokens $k
  done; done; done; done
  rows
  PDSERVE_SPLIT_BLOCKS=8 PDSERVE_ONE_SPLIT_BLOCKS=16 PDSERVE_MAX_SPLITS=16 PDSERVE_SHORT_KV_BLOCKS=16,32,64 \
    TRITON_CACHE_DIR=/tmp/tc_mid python3 bench/gpu/warmup_time.py --arch smollm2 --spec-tokens 3 | tee -a "$OUT/warmup.jsonl"
fi

if [[ $stage == final11 ]]; then  # session 13's split defaults: issue 30's rows as a server, and b2/b4 old / new
  vbench goal --arch llama-1b --batch 1 --max-tokens 96 --spec-tokens 3 --draft-vocab 32768
  vbench goal --arch smollm2 --batch 1 --max-tokens 96 --spec-tokens 3
  PDSERVE_STEP_STAMPS=1 vbench goal --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 3
  vbench goal --arch smollm2 --batch 128 --max-tokens 64 --spec-tokens 0
  vbench goal --arch llama-1b --batch 64 --max-tokens 64 --spec-tokens 0
  for m in llama-1b smollm2; do for b in 2 4; do for p in 400 900; do
    old vbench old --arch $m --batch $b --max-tokens 64 --spec-tokens 0 --prompt-len $p
    vbench new --arch $m --batch $b --max-tokens 64 --spec-tokens 0 --prompt-len $p
  done; done; done
  python3 -c "import json
for l in open('$OUT/bench.jsonl'):
    r = json.loads(l) if l.startswith('{') else {}
    if 'ms_per_step' in r: print(r['variant'], '|', r['batch'], r['spec_tokens'], r.get('draft_vocab'), r['ms_per_step'],
                                  r['tokens_per_s'], r.get('gpu_busy_stamped'))
    elif 'floor_ms_per_step' in r: print('  floor', r['floor_ms_per_step'], r['copy_tb_per_s'])"
fi

if [[ $stage == final10 ]]; then  # final9's GPU tests again, in full (its 230 s cut them at the 43rd)
  timeout 500 python3 -m pytest -q -p no:cacheprovider -rf tests/engine/test_gpu.py tests/engine/test_gpu_prefill.py \
    tests/engine/test_first_token.py > "$OUT/tests.log" 2>&1
  tail -8 "$OUT/tests.log"
fi

if [[ $stage == final9 ]]; then  # session 13's split defaults: the GPU tests, the 2-3k-token rows against a 192 width
  timeout 230 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_stamps.py tests/engine/test_cuda_graphs.py \
    tests/engine/test_gpu.py tests/engine/test_gpu_prefill.py tests/engine/test_first_token.py > "$OUT/tests.log" 2>&1
  tail -3 "$OUT/tests.log"
  t5() { PDSERVE_SHORT_KV_BLOCKS=16,32,64,128,192 "$@"; }
  for m in llama-1b smollm2; do for p in 2048 2560; do
    old mid old --arch $m --prompt-len $p --spec-tokens 0
    mid new --arch $m --prompt-len $p --spec-tokens 0
    t5 mid t5 --arch $m --prompt-len $p --spec-tokens 0
  done; done
  rows
  for a in smollm2 llama-1b; do for run in cold warm; do
    TRITON_CACHE_DIR=/tmp/tc_new_$a timeout 90 python3 bench/gpu/warmup_time.py --arch $a --spec-tokens 3 \
      | sed "s|^{|{\"run\": \"$run\", |" | tee -a "$OUT/warmup.jsonl"
  done; done
  for run in cold warm; do
    t5 env TRITON_CACHE_DIR=/tmp/tc_t5 timeout 90 python3 bench/gpu/warmup_time.py --arch smollm2 --spec-tokens 3 \
      | sed "s|^{|{\"run\": \"t5 $run\", |" | tee -a "$OUT/warmup.jsonl"
  done
fi

if [[ $stage == midctx3 ]]; then  # midctx2 without the 16-split cap (its cliff: 17 tiles in 16 splits), with and without a 128 width
  t3() { PDSERVE_SPLIT_BLOCKS=8 PDSERVE_ONE_SPLIT_BLOCKS=16 PDSERVE_MAX_SPLITS=0 PDSERVE_SHORT_KV_BLOCKS=16,32,64 "$@"; }
  t4() { PDSERVE_SPLIT_BLOCKS=8 PDSERVE_ONE_SPLIT_BLOCKS=16 PDSERVE_MAX_SPLITS=0 PDSERVE_SHORT_KV_BLOCKS=16,32,64,128 "$@"; }
  for rep in 1 2; do for m in llama-1b smollm2; do for p in 256 640 1280 2048 3072; do
    mid default --arch $m --prompt-len $p --spec-tokens 0
    [[ $rep == 1 ]] && t3 mid t3 --arch $m --prompt-len $p --spec-tokens 0
    t4 mid t4 --arch $m --prompt-len $p --spec-tokens 0
  done; done; done
  rows
  for run in cold warm; do
    t4 env TRITON_CACHE_DIR=/tmp/tc_t4 timeout 100 python3 bench/gpu/warmup_time.py --arch smollm2 --spec-tokens 3 \
      | sed "s|^{|{\"run\": \"$run\", |" | tee -a "$OUT/warmup.jsonl"
  done
fi

if [[ $stage == midctx ]]; then
  for w in 16 16,64 16,32,128 16 16,64; do for m in llama-1b smollm2; do for p in 256 640 1280; do
    PDSERVE_SHORT_KV_BLOCKS=$w python3 -m deploy.cli bench engine --device cuda --arch $m --batch 1 --max-tokens 64 \
      --spec-tokens 0 --prompt-len $p --max-model-len 4096 | sed "s|^{|{\"variant\": \"widths=$w prompt=$p\", |" \
      >> "$OUT/bench.jsonl"
  done; done; done
  rows
fi

if [[ $stage == preloadmid ]]; then
  for rep in 1 2; do for mb in 4 9 13; do
    PDSERVE_PRELOAD_MAX_MB=$mb python3 -m deploy.cli bench engine --device cuda --arch llama-1b --batch 1 --max-tokens 64 \
      --spec-tokens 3 --draft-vocab 32768 | sed "s/^{/{\"variant\": \"preload_max_mb=$mb\", /" >> "$OUT/bench.jsonl"
  done; done
  rows
fi

if [[ $stage == pdl ]]; then  # programmatic dependent launch off and on, same code otherwise
  for pdl in 0 1; do
    PDSERVE_PDL=$pdl bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 3 --profile
    PDSERVE_PDL=$pdl bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --profile
    PDSERVE_PDL=$pdl bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --profile
  done
  python3 bench/gpu/bench_table.py "$OUT/bench.jsonl"
fi

if [[ $stage == profile ]]; then
  bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 3 --profile
  bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --profile
  bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 3 --profile
  bench --arch smollm2 --batch 128 --max-tokens 128 --spec-tokens 3
  bench --arch llama-1b --batch 64 --max-tokens 64 --spec-tokens 3
  bench --arch smollm2 --batch 1 --max-tokens 64 --spec-tokens 3 --deterministic
  bench --arch smollm2 --batch 32 --max-tokens 64 --spec-tokens 0 --deterministic
  bench --arch llama-1b --batch 1 --max-tokens 64 --spec-tokens 0 --deterministic
  python3 bench/gpu/bench_table.py "$OUT/bench.jsonl"
fi

if [[ $stage == frspec ]]; then  # issue 30: the MTP step's cost with FR-Spec, GPU busy at batch 32
  python3 -m pytest -q -p no:cacheprovider tests/engine/test_gpu.py tests/engine/test_gpu_surface.py \
    tests/kernels/test_decode_tail.py tests/kernels/test_linear.py tests/kernels/test_norm.py \
    tests/kernels/test_penalties.py 2>&1 | tee "$OUT/tests.log" | tail -4
  bench --arch llama-1b --batch 1 --max-tokens 128 --spec-tokens 3 --profile
  bench --arch llama-1b --batch 1 --max-tokens 128 --spec-tokens 3 --profile --draft-vocab 32768
  bench --arch llama-1b --batch 1 --max-tokens 128 --spec-tokens 3 --profile --draft-vocab 16384
  bench --arch smollm2 --batch 32 --max-tokens 128 --spec-tokens 0 --profile
  python3 bench/gpu/gpu_gemv.py --draft 2>&1 | grep -v '^{' | tee "$OUT/draft_heads.txt"
  python3 bench/gpu/bench_table.py "$OUT/bench.jsonl"
fi
