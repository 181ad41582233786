"""What a decode step's boundary costs the GPU: a CUDA graph of many small kernels replayed in
the decode loop's pattern (launch N + 1, then wait for N's outputs on the host), with the
step's outputs reaching the host four ways:

- `memcpy`: a device-to-host copy after the graph, then an event (what the engine does now);
- `memcpy-in-graph`: the copy captured inside the graph (one pinned buffer per graph);
- `kernel-writes-host`: the graph's last kernel stores the outputs into mapped pinned memory
  (no copy engine in the step);
- `none`: only the event (no outputs: the bound).

Prints us per step of the loop and of one graph replayed alone (stream idle before it), and
the profiler's idle time at the boundary. Usage: python bench/gpu/graph_boundary.py [--kernels 157]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import triton
import triton.language as tl


@triton.jit
def _bump(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=m) * 1.0001 + 1.0, mask=m)


@triton.jit
def _publish(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(dst_ptr + offs, tl.load(src_ptr + offs, mask=offs < n), mask=offs < n)


def build(mode: str, kernels: int, x: torch.Tensor, out: torch.Tensor, host: list[torch.Tensor]):
    """A captured graph of `kernels` small launches, ending as `mode` says."""
    n = x.numel()

    def body() -> None:
        for _ in range(kernels):
            _bump[(triton.cdiv(n, 1024),)](x, n, BLOCK=1024)
        out.copy_(x[: out.numel()].to(out.dtype))
        if mode == "memcpy-in-graph":
            host[0].copy_(out, non_blocking=True)
        elif mode == "kernel-writes-host":
            _publish[(1,)](out, host[0], out.numel(), BLOCK=triton.next_power_of_2(out.numel()))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()  # compile and warm outside the capture
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        body()
    return g


def loop(mode: str, g: torch.cuda.CUDAGraph, out: torch.Tensor, host: torch.Tensor, steps: int) -> float:
    """us per step of the decode loop's pattern: launch N + 1, then wait for N and read it."""
    events = [torch.cuda.Event(), torch.cuda.Event()]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prev = None
    for i in range(steps):
        g.replay()
        if mode == "memcpy":
            host.copy_(out, non_blocking=True)
        ev = events[i % 2]
        ev.record()
        if prev is not None:
            prev.synchronize()
            host.tolist()
        prev = ev
    prev.synchronize()
    return 1e6 * (time.perf_counter() - t0) / steps


def alone(g: torch.cuda.CUDAGraph, reps: int = 20) -> float:
    """us of one replay with the stream idle before it (events around it)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return sorted(times)[len(times) // 2]


def boundary_idle(mode: str, g, out, host, steps: int = 20) -> float:
    """The profiler's idle us per step (gaps between GPU ops) in the loop."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        loop(mode, g, out, host, steps)
    ev = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                if e.device_type == torch.autograd.DeviceType.CUDA)
    idle, end = 0.0, ev[0][1]
    for s, e in ev[1:]:
        idle += max(0.0, s - end)
        end = max(end, e)
    return idle / steps


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels", type=int, default=157)
    p.add_argument("--elements", type=int, default=1 << 16)
    p.add_argument("--steps", type=int, default=300)
    args = p.parse_args()
    x = torch.zeros(args.elements, device="cuda")
    out = torch.zeros(256, dtype=torch.int64, device="cuda")
    rows = []
    for mode in ("memcpy", "memcpy-in-graph", "kernel-writes-host", "none"):
        host = torch.zeros(256, dtype=torch.int64, pin_memory=True)
        try:
            g = build(mode, args.kernels, x, out, [host])
        except Exception as exc:  # e.g. a kernel refused a host pointer
            print(json.dumps({"mode": mode, "error": repr(exc)[:300]}), flush=True)
            continue
        loop(mode, g, out, host, 50)  # warm
        per_step = loop(mode, g, out, host, args.steps)
        ok = host.tolist() == out.tolist() if mode != "none" else None  # the last step's outputs
        one = alone(g)
        rows.append({"mode": mode, "loop_us": round(per_step, 1), "alone_us": round(one, 1),
                     "idle_us_profiled": round(boundary_idle(mode, g, out, host), 1), "host_matches": ok})
        print(json.dumps(rows[-1]), flush=True)
    print(f"kernels {args.kernels}: mode | loop us/step | one graph alone us | profiled idle us/step | outputs reached the host")
    for r in rows:
        print(f"{r['mode']} | {r['loop_us']} | {r['alone_us']} | {r['idle_us_profiled']} | {r['host_matches']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
