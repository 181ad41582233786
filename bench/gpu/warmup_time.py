"""A decode node's start-up graphs on random weights of a real shape: the runner's build (its
decode graphs, greedy without logprobs) and the serving warm-up (engine/warmup.py), timed apart,
with the graphs each captured. For PDSERVE_SHORT_KV_BLOCKS's cost at start-up: run it with the
variable set each way, each with its own TRITON_CACHE_DIR (cold) and then again (warm).

    python bench/gpu/warmup_time.py --arch smollm2 --spec-tokens 3
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from bench.engine import ARCHES, random_model
from engine.engine import EngineConfig, build_runner
from engine.warmup import warm_up


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=sorted(ARCHES), default="smollm2")
    p.add_argument("--spec-tokens", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=4096)
    args = p.parse_args()
    loaded = random_model(args.arch, "cuda", "bfloat16")
    config = EngineConfig(num_speculative_tokens=args.spec_tokens, device="cuda", max_model_len=args.max_model_len)
    t0 = time.perf_counter()
    runner, _, max_model_len = build_runner(loaded, config)
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    built = len(runner.graphs.graphs) if runner.graphs is not None else 0
    report = warm_up(runner, decode=True, prefill=False, max_model_len=max_model_len)
    print(json.dumps({"arch": args.arch, "short_kv_blocks": os.environ.get("PDSERVE_SHORT_KV_BLOCKS", "default"),
                      "triton_cache": os.environ.get("TRITON_CACHE_DIR", ""), "build_s": round(build_s, 2),
                      "graphs_at_build": built, "warmup_s": round(report.seconds, 2),
                      "warmup_graphs": report.decode_graphs}))


if __name__ == "__main__":
    main()
