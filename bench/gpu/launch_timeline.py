"""When does the host queue a decode step, against when the GPU ends the one before it?

Runs the engine as `bench engine` does (random weights of `--arch`, `--batch` requests) and
profiles a few steady decode steps with host and device activity (torch profiler, chrome trace).
For each graph launch it pairs the host's `cudaGraphLaunch` call with the graph's first kernel
on the GPU (same correlation id), and the previous step's output copy. Per step:

- `gap_us`: GPU idle between the previous step's output copy and this step's first kernel;
- `queued_early_us`: how long before that copy ended the host had returned from the launch
  (negative: the host was late, and the gap is the host's);
- `launch_call_us`: the host's time inside `cudaGraphLaunch`.

Tracing host ops slows the host (the profiler's overhead), so `queued_early_us` is a lower
bound of the real margin. Usage: python bench/gpu/launch_timeline.py --arch smollm2 --batch 32 --spec-tokens 0
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from bench.engine import _engine, _params, add_arguments, load  # noqa: E402
from bench.host_split import steady_batch  # noqa: E402


def trace_steps(args: argparse.Namespace, steps: int) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    loaded = load(args, args.device)
    engine, prompts = _engine(loaded, args.spec_tokens, args)
    params = _params(args)
    with steady_batch(engine, prompts, params, warm_steps=6):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                engine.step()
            torch.cuda.synchronize()
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        return [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]


def boundaries(events: list[dict]) -> list[dict]:
    launches = sorted((e for e in events if str(e.get("name", "")).startswith("cudaGraphLaunch")), key=lambda e: e["ts"])
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    by_corr: dict[int, list[dict]] = {}
    for e in gpu:
        by_corr.setdefault(e.get("args", {}).get("correlation", -1), []).append(e)
    copies = sorted((e for e in gpu if e.get("cat") == "gpu_memcpy"), key=lambda e: e["ts"])
    rows = []
    for call in launches:
        kernels = by_corr.get(call.get("args", {}).get("correlation", -2), [])
        if not kernels:
            continue
        first = min(k["ts"] for k in kernels)
        before = [c for c in copies if c["ts"] + c["dur"] <= first]
        if not before:
            continue
        copy_end = before[-1]["ts"] + before[-1]["dur"]
        rows.append({"gap_us": first - copy_end, "queued_early_us": copy_end - (call["ts"] + call["dur"]),
                     "launch_call_us": call["dur"]})
    return rows


def main() -> int:
    p = argparse.ArgumentParser()
    add_arguments(p)
    p.add_argument("--steps", type=int, default=12)
    args = p.parse_args()
    events = trace_steps(args, args.steps)
    rows = boundaries(events)
    for r in rows:
        print(json.dumps({k: round(v, 1) for k, v in r.items()}))
    if rows:
        med = {k: round(statistics.median(r[k] for r in rows), 1) for k in rows[0]}
        print(json.dumps({"arch": args.arch, "batch": args.batch, "k": args.spec_tokens, "steps": len(rows),
                          "median": med}))
    else:
        cats = sorted({str(e.get("cat")) for e in events})
        names = sorted({str(e.get("name"))[:40] for e in events if "cuda" in str(e.get("cat", "")).lower()})[:20]
        print("no graph launch paired with its kernels: categories", cats, "runtime names", names)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
