"""Diagnostic (GPU): does a request resumed by re-prefilling its prompt and the tokens it has (what a
migration does) keep the greedy tokens of the request never moved, under --deterministic?

`gpu_service.sh run fault` found two requests (chaos jobs 16 and 42 of seed 0) whose tokens left the
single-process reference only when the decode actor was killed, at k=0 as at k=3. This replays
those prompts in one process: the reference (one batch, k=0), then each job resumed at several
cuts, on a plain engine and on one warmed up as the nodes are; it prints the first differing
token index per (job, cut), -1 when equal.

    PYTHONPATH=/tmp/svc/site:$PWD:/tmp/svc/m python3 bench/gpu/resume_bits.py [--jobs 16,42,0,1,2,3]
"""

from __future__ import annotations

import argparse

from bench.chaos import make_jobs
from engine.engine import EngineConfig, LLMEngine
from engine.loader import load_model, load_model_info
from engine.sampling_params import SamplingParams
from engine.warmup import warm_up

CUTS = [1, 2, 3, 5, 8, 10, 16, 40]


def first_diff(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), -1 if len(a) == len(b) else min(len(a), len(b)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--jobs", default="16,42,0,1,2,3")
    p.add_argument("--k", type=int, default=0)
    p.add_argument("--probe", type=int, default=None, metavar="JOB",
                   help="instead: compare JOB's KV, layer by layer, never moved and resumed after one token")
    args = p.parse_args()
    ns = argparse.Namespace(seed=0, requests=256, min_prompt=16, max_prompt=256, min_output=128, max_output=384,
                            cancel_fraction=0.0)
    jobs = make_jobs(ns, load_model_info("smollm2").config.vocab_size)
    picked = [jobs[int(i)] for i in args.jobs.split(",")]
    loaded = load_model("smollm2", device="cuda", dtype="bfloat16")

    def engine(warm: bool) -> LLMEngine:
        eng = LLMEngine(loaded, EngineConfig(device="cuda", deterministic=True, num_speculative_tokens=args.k))
        if warm:
            warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
        return eng

    if args.probe is not None:
        probe(engine, jobs[args.probe])
        return
    ref_eng = engine(False)
    ref = [r.output_ids for r in ref_eng.generate([j.prompt for j in picked],
                                                  [SamplingParams(max_tokens=j.max_tokens, ignore_eos=True) for j in picked])]
    alone = [ref_eng.generate([j.prompt], SamplingParams(max_tokens=j.max_tokens, ignore_eos=True))[0].output_ids
             for j in picked]
    print("job prompt | alone vs batch | resumed at cut: first diff (plain engine / warmed engine)")
    for warm in (False, True):
        eng = engine(warm)
        for j, want, one in zip(picked, ref, alone, strict=True):
            diffs = []
            for cut in CUTS:
                got = eng.generate([j.prompt + want[:cut]], SamplingParams(max_tokens=j.max_tokens - cut,
                                                                         ignore_eos=True))[0].output_ids
                d = first_diff(got, want[cut:])
                diffs.append(f"{cut}:{d if d < 0 else d + cut}")
            print(f"{'warm' if warm else 'plain'} job {j.index} ({len(j.prompt)}) | alone {first_diff(one, want)} | "
                  + " ".join(diffs), flush=True)


def probe(engine, job, steps: int = 16) -> None:
    """Where the KV of a request never moved and of one resumed after its first token part: for
    each layer, the positions whose K or V bits differ (prefill wrote positions < prompt + 1 in
    the resumed one, decode wrote those >= prompt in the other)."""
    import torch

    def run(prompt: list[int], n: int) -> tuple[LLMEngine, list[int], list[int]]:
        eng = engine(False)
        rid = eng.add_request(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
        req = eng.requests[rid]
        blocks: list[int] = []
        while eng.has_unfinished():
            eng.step()
            blocks = blocks or list(req.block_ids)
        return eng, blocks, req.output_ids

    a, blocks_a, out_a = run(job.prompt, steps)
    b, blocks_b, out_b = run(job.prompt + out_a[:1], steps - 1)
    n = len(job.prompt) + steps - 1
    print(f"job {job.index}: prompt {len(job.prompt)}, tokens never moved {out_a}, resumed {out_a[:1] + out_b}")
    for layer, (ka, kb) in enumerate(zip(a.runner.kv.layers, b.runner.kv.layers, strict=True)):
        bs = ka.shape[2]
        ca = ka[:, blocks_a].reshape(2, -1, *ka.shape[3:])[:, :n]
        cb = kb[:, blocks_b].reshape(2, -1, *kb.shape[3:])[:, :n]
        diff = (ca != cb).flatten(2).any(-1)  # [2, n]
        pos = torch.nonzero(diff.any(0)).flatten().tolist()
        print(f"layer {layer} (block {bs}): K differs at {torch.nonzero(diff[0]).flatten().tolist()[:12]}, "
              f"V at {torch.nonzero(diff[1]).flatten().tolist()[:12]}" if pos else f"layer {layer}: same")


if __name__ == "__main__":
    main()
