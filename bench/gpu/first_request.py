"""Why a service's first request is slow after the warm-up (issue 27): one ColocatedNode in this
process (random weights of `--arch`, the node's real loop thread, no Ray or gRPC), requests
submitted one at a time, the time from submit to the first output item, and cProfile of the loop
thread over the first request. Usage: python bench/gpu/first_request.py --arch smollm2 [--k 3]"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from bench.engine import random_model  # noqa: E402
from decode_node.colocated import ColocatedNode  # noqa: E402
from engine.engine import EngineConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="smollm2")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    t0 = time.perf_counter()
    loaded = random_model(args.arch, args.device, "bfloat16" if args.device == "cuda" else "float32")
    node = ColocatedNode(loaded, EngineConfig(num_speculative_tokens=args.k, device=args.device, max_num_seqs=32,
                                              max_num_batched_tokens=512, warmup=True))
    print(f"node built in {time.perf_counter() - t0:.1f} s (warm-up {node.warmup_s:.1f} s)", flush=True)
    prof = cProfile.Profile()
    orig = node.step

    def profiled_step() -> bool:  # the loop thread's steps while the first request runs
        if profiling.is_set():
            return prof.runcall(orig)
        return orig()

    profiling = threading.Event()
    node.step = profiled_step  # type: ignore[method-assign]
    node.start()
    q = node.subscribe()
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0)
    for i in range(args.requests):
        prompt = [(7 * i + j) % 1000 + 10 for j in range(args.prompt)]
        if i == 0:
            profiling.set()
        start = time.perf_counter()
        node.submit(f"r{i}", prompt, params, i, ()).result()
        first = None
        while True:
            items = q.get()
            if first is None and any(it.request_id == f"r{i}" and it.tokens for it in items):
                first = time.perf_counter() - start
            if any(it.request_id == f"r{i}" and it.finish_reason for it in items):
                break
        profiling.clear()
        print(f"request {i}: first token {1000 * first:.2f} ms, done {1000 * (time.perf_counter() - start):.1f} ms",
              flush=True)
        time.sleep(0.2)
    node.stop()
    out = io.StringIO()
    pstats.Stats(prof, stream=out).sort_stats("cumulative").print_stats(30)
    print(out.getvalue()[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
