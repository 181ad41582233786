"""Where a short prefill's host time goes on a GPU: packing the inputs, the CUDA graph's launch
call, and the GPU's run of the graph (SmolLM2 and Llama-1B shapes, random weights, 1 x 128).

For each shape: the prefill graph is captured by one step, then over 50 steps the host time of
`PrefillInputs.fill_no_sync`, of `CUDAGraph.replay()` (the launch call alone, the GPU idle
before it) and the GPU time of the replay (CUDA events around it), medians in us. "bare" is the
graph without the per-layer events (what runs where no one pushes KV layer by layer).
Usage: python bench/gpu/prefill_launch.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from bench.engine import random_model  # noqa: E402
from bench.prefill import _engine, _prompts, _ttft_step  # noqa: E402
from engine.prefill_step import PrefillChunk  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


class Args:
    device, enforce_eager, deterministic, draft_vocab = "cuda", False, False, 0


def measure(arch: str, n: int = 128, steps: int = 50) -> dict[str, float]:
    loaded = random_model(arch, "cuda", "bfloat16")
    eng = _engine(loaded, 0, 1, n, Args())  # type: ignore[arg-type]
    prompts = _prompts(loaded.model.config.vocab_size, 1, n)
    for _ in range(3):
        _ttft_step(eng, prompts)
    pg = eng.runner.prefill_graphs
    ((key, (graph, _, _, _)),) = pg.graphs.items()  # the step's graph (k = 0: no tail), captured without events
    inp = pg.inputs[(key.tokens, key.rows)]
    blocks = eng.blocks.allocate(eng.blocks.blocks_for(n + 8))
    chunk = PrefillChunk(prompts[0], 0, n, blocks, SamplingParams(max_tokens=1), 1)
    bare = graph
    pg._capture(key, inp, True)  # the same step with the per-layer event records (a prefill node's)
    graph = pg.graphs[key][0]  # (it takes the bare graph's place in the dict; `bare` keeps that one)
    res: dict[str, list[float]] = {"fill_us": [], "replay_call_us": [], "gpu_us": [], "bare_call_us": [],
                                   "bare_gpu_us": [], "step_us": []}
    for _ in range(steps):
        for g, call, gpu in ((graph, "replay_call_us", "gpu_us"), (bare, "bare_call_us", "bare_gpu_us")):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            inp.fill_no_sync([chunk])
            t1 = time.perf_counter()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            g.replay()
            t2 = time.perf_counter()
            b.record()
            b.synchronize()
            res["fill_us"].append(1e6 * (t1 - t0))
            res[call].append(1e6 * (t2 - t1))
            res[gpu].append(1e3 * a.elapsed_time(b))
    eng.blocks.free(blocks)
    res["step_us"] = [1e6 * _ttft_step(eng, prompts) for _ in range(steps)]
    return {k: round(statistics.median(v), 1) for k, v in res.items()}


def main() -> None:
    for arch in ("smollm2", "llama-1b"):
        print(arch, measure(arch), flush=True)


if __name__ == "__main__":
    main()
