"""Latency of one all-reduce on two local GPUs, as the TP decode step issues it: a CUDA graph of
REPS back-to-back in-place sums of [rows, hidden] bf16, replayed and timed; symmetric memory's
one-shot kernel (engine/tp_allreduce.py) beside NCCL's. Nothing else runs, so this is each
path's floor; inside a step a rank also waits for the slower rank's GEMM.
Usage: python bench/gpu/gpu_allreduce.py [--hidden 4096]   (two CUDA devices)"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.tensor_parallel import TPGroup  # noqa: E402
from engine.tp_allreduce import SymmAllReduce  # noqa: E402
from engine.tp_launch import spawn_ranks  # noqa: E402

REPS = 100
ROWS = (1, 4, 16, 64, 256)


def _time(fn, x: torch.Tensor) -> float:
    """Microseconds per call of fn(x), from a graph of REPS calls replayed 20 times."""
    for _ in range(3):
        fn(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(REPS):
            fn(x)
    graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(20):
        graph.replay()
    torch.cuda.synchronize()
    return 1e6 * (time.perf_counter() - start) / (20 * REPS)


def _rank(tp: TPGroup, hidden: int) -> list[tuple[int, float, float]]:
    device = torch.device("cuda", tp.rank)
    fast = SymmAllReduce(None, device, torch.bfloat16)
    out = []
    for rows in ROWS:
        x = torch.randn(rows, hidden, device=device).to(torch.bfloat16).mul_(1e-3)
        out.append((rows, _time(fast, x), _time(dist.all_reduce, x)))
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hidden", type=int, default=4096)
    args = p.parse_args()
    rows = spawn_ranks(2, _rank, (args.hidden,), device="cuda")[0]
    print(f"all-reduce of [rows, {args.hidden}] bf16 on 2 GPUs, us per call (graph of {REPS})")
    print("rows | one-shot symm | NCCL")
    for n, symm, nccl in rows:
        print(f"{n:4d} | {symm:13.2f} | {nccl:.2f}")


if __name__ == "__main__":
    main()
