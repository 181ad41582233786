"""Time of one `mtp.loop.train_step` on random weights of a real shape, with the top
CUDA kernels: python -m bench.gpu.mtp_train_step [--batch-tokens N] [--levels K]."""

import argparse
import random
import time

import torch

from bench.engine import random_model
from mtp import loop as mt

p = argparse.ArgumentParser()
p.add_argument("--arch", default="smollm2")
p.add_argument("--batch-tokens", type=int, nargs="+", default=[16384])
p.add_argument("--levels", type=int, default=3)
p.add_argument("--steps", type=int, default=10)
p.add_argument("--profile", action="store_true")
args = p.parse_args()
loaded = random_model(args.arch, "cuda", "auto")
model = loaded.model
mt.prepare_for_training(model)
mt.init_head(model, 0)
opt = torch.optim.AdamW(model.mtp.parameters(), lr=1e-4)
marker = (1, 520, 9531, 198)
rng = random.Random(0)
seqs = []
for _ in range(4000):
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(30, 300))] + list(marker)
    seqs.append(prompt + [rng.randrange(1000) for _ in range(rng.randrange(20, 320))])
print("batch_tokens  ms/step  tokens/s  answer-tokens/s  peak GiB")
for bt in args.batch_tokens:
    cfg = mt.TrainConfig(steps=1000, levels=args.levels, batch_tokens=bt, answer_marker=marker)
    plan = mt.plan_batches(seqs, bt, 768, 0)
    for rows in plan[:2]:
        mt.train_step(model, opt, *mt.batch_tensors(seqs, rows, 768, "cuda"), cfg)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t, toks, answer = time.perf_counter(), 0, 0
    for rows in plan[2 : 2 + args.steps]:
        ids, lengths = mt.batch_tensors(seqs, rows, 768, "cuda")
        mt.train_step(model, opt, ids, lengths, cfg)
        toks += int(lengths.sum())
        answer += int((lengths - mt.answer_starts(ids, marker)).sum())
    torch.cuda.synchronize()
    s = time.perf_counter() - t
    print(f"{bt:12d} {1000 * s / args.steps:8.1f} {toks / s:9.0f} {answer / s:16.0f} "
          f"{torch.cuda.max_memory_allocated() / 2**30:8.1f}")
if args.profile:
    from torch.profiler import ProfilerActivity, profile
    cfg = mt.TrainConfig(steps=1000, levels=args.levels, batch_tokens=args.batch_tokens[0], answer_marker=marker)
    plan = mt.plan_batches(seqs, args.batch_tokens[0], 768, 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for rows in plan[:3]:
            mt.train_step(model, opt, *mt.batch_tensors(seqs, rows, 768, "cuda"), cfg)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))
