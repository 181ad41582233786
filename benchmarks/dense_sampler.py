"""Throughput of `engine.mtp_train.sample_dense` (the training-data sampler) on random weights
of a real shape: python -m benchmarks.dense_sampler [--rows R ...] [--new N]."""

import argparse
import random
import time

import torch

from engine.bench import random_model
from engine.mtp_train import sample_dense

p = argparse.ArgumentParser()
p.add_argument("--arch", default="smollm2")
p.add_argument("--rows", type=int, nargs="+", default=[256, 1024])
p.add_argument("--new", type=int, default=128)
p.add_argument("--device", default="cuda")
args = p.parse_args()
loaded = random_model(args.arch, args.device, "auto")
rng = random.Random(0)
print("rows  new  seconds  tok/s")
for rows in args.rows:
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(30, 200))] for _ in range(rows)]
    sample_dense(loaded.model, prompts[:4], [1.0] * len(prompts[:4]), 4, (), 0)  # warm-up
    torch.cuda.synchronize() if args.device.startswith("cuda") else None
    t = time.perf_counter()
    out = sample_dense(loaded.model, prompts, [0.8] * rows, args.new, (), 1)
    secs = time.perf_counter() - t
    new = sum(len(o) - len(x) for o, x in zip(out, prompts, strict=True))
    print(f"{rows:5d} {args.new:4d} {secs:8.2f} {new / secs:7.0f}")
