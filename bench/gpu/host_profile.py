"""Where the decode loop's host time goes: the engine's steady decode under cProfile.

When the GPU idles between decode steps (`pdserve bench engine --profile` lists the gap
before each step's first kernel in `top_gaps`), the host took longer to finish one step's
bookkeeping and launch the next than the GPU took to run the step in flight. This runs the
same engine as `bench engine` (random weights of `--arch`, `--batch` requests decoding
together) and prints the wall time per step and the functions that take the host's time.
Usage: python bench/gpu/host_profile.py --arch smollm2 --batch 32 --device cuda [--spec-tokens 0]
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.engine import _engine, add_arguments, load  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--steps", type=int, default=48)
    args = p.parse_args()
    engine, prompts = _engine(load(args, args.device), args.spec_tokens, args)
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=args.steps + 16, ignore_eos=True))
    for _ in range(4):
        engine.step()  # prefill and the first launches
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    for _ in range(args.steps):
        engine.step()
    prof.disable()
    ms = 1e3 * (time.perf_counter() - start) / args.steps
    print(f"batch {args.batch} k {args.spec_tokens}: {ms:.3f} ms per step under cProfile (it adds overhead)")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
