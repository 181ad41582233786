"""Throughput of `mtp.dense_sampler.DenseSampler` (the training-data sampler) on random weights
of a real shape, with and without CUDA graphs, and whether greedy rows agree between the two:
python -m bench.gpu.dense_sampler [--rows R ...] [--new N]."""

import argparse
import random
import time

import torch

from bench.engine import random_model
from mtp.dense_sampler import DenseSampler

p = argparse.ArgumentParser()
p.add_argument("--arch", default="smollm2")
p.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
p.add_argument("--new", type=int, default=128)
p.add_argument("--device", default="cuda")
p.add_argument("--dtype", default="auto")
args = p.parse_args()
loaded = random_model(args.arch, args.device, args.dtype)
rng = random.Random(0)
cuda = args.device.startswith("cuda")
print("rows  new  graphs  seconds  tok/s")
for rows in args.rows:
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(30, 200))] for _ in range(rows)]
    for graphs in ([False, True] if cuda else [False]):
        sampler = DenseSampler(loaded.model, rows, 200 + args.new, graphs=graphs)
        sampler.sample(prompts, [1.0] * rows, 4, (), 0)  # warm-up
        torch.cuda.synchronize() if cuda else None
        t = time.perf_counter()
        out = sampler.sample(prompts, [0.8] * rows, args.new, (), 1)
        secs = time.perf_counter() - t
        new = sum(len(o) - len(x) for o, x in zip(out, prompts, strict=True))
        print(f"{rows:5d} {args.new:4d} {graphs!s:>6} {secs:8.2f} {new / secs:7.0f}")
if cuda:
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(5, 60))] for _ in range(64)]
    outs = [DenseSampler(loaded.model, 64, 60 + 100, graphs=g).sample(prompts, [0.0] * 64, 100, (), 0)
            for g in (False, True)]
    same = sum(a == b for a, b in zip(*outs, strict=True))
    print(f"greedy rows equal with and without graphs: {same}/64 ({loaded.model.lm_head.weight.dtype})")
