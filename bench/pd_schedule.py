"""`bench pd`'s workload (seeded arrivals and prompts), its node config and its per-request
traces: what both of its modes (bench/pd.py in one process, bench/pd_procs.py a process per node)
share."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass, field

from engine.engine import EngineConfig
from engine.sampling.sampling_params import SamplingParams

WARMUP_ITEMS = 3  # background outputs each before the timed phase starts


@dataclass
class Trace:
    """Arrival and output times of one request (monotonic seconds) and its tokens."""

    submitted: float = 0.0
    first: float | None = None
    items: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) of decode outputs
    tokens: list[int] = field(default_factory=list)
    ended: bool = False


def workload(args: argparse.Namespace, vocab: int) -> tuple[list[float], list[list[int]], list[list[int]]]:
    """(arrival offsets, prompts, background prompts), seeded."""
    rng = random.Random(args.seed)
    times, t = [], 0.0
    for _ in range(args.num_requests):
        t += rng.expovariate(args.rate)
        times.append(t)
    prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    background = [[rng.randrange(vocab) for _ in range(16)] for _ in range(args.background)]
    return times, prompts, background


def greedy_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def node_config(args: argparse.Namespace, device: str) -> EngineConfig:
    return EngineConfig(num_speculative_tokens=args.spec_tokens, device=device, max_num_seqs=args.max_num_seqs,
                        max_model_len=max(args.prompt_len + args.output_len, 16 + args.background_tokens) + 8,
                        kv_cache_bytes=args.kv_cache_bytes, max_num_batched_tokens=args.max_num_batched_tokens,
                        warmup=True)  # as a service's nodes: graphs captured before the first request
