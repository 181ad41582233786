"""Where the host's time goes in a decode step, without a profiler (`bench engine --profile`).

The decode loop launches step N + 1, then reads step N (engine/sched/decode_batch.py). If the host's
own work per step (planning, the launch, reading and emitting) takes longer than the GPU's
step, the GPU idles at the step boundary; if not, the host spends the rest blocked at the read
point. `host_split` times one run of steps with wall clocks around the launch and the read
point, so the two cases tell apart:

- `wait_us`: blocked in `HostCopy.wait` (the GPU is behind: the host is not the limit);
- `launch_us`: in the runner's `launch_decode` (graph replay, or the eager step's launches);
- `read_us`: the rest of `collect` (host lists from the pinned buffer);
- `other_us`: everything else in `LLMEngine.step` (planning, emitting, finishing).

Per step, in microseconds. Wrapping adds two clock reads a call; the profiler's CUDA-only trace
is not running meanwhile.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from engine.engine import LLMEngine
from engine.runner.step_output import HostCopy
from engine.sampling.sampling_params import SamplingParams


def _timed(fn: Callable[..., Any], spent: dict[str, float], key: str) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - t0
    return wrapper


@contextmanager
def steady_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                 warm_steps: int = 4) -> Iterator[None]:
    """The prompts decoding together: added, prefilled and `warm_steps` steps in when the body
    runs (it times steady decode steps); run to their end after it."""
    for p in prompts:
        engine.add_request(p, params)
    for _ in range(warm_steps):
        engine.step()  # prefill + the first launches
    yield
    while engine.has_unfinished():
        engine.step()


def host_split(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, steps: int) -> dict:
    """Run the prompts, and over `steps` decode steps of the whole batch (after its prefill and
    a few steps) time the host's parts of a step; then finish the requests."""
    with steady_batch(engine, prompts, params):
        total, spent = _timed_steps(engine, steps)
    us = {k: 1e6 * v / steps for k, v in spent.items()}
    split = {"step_us": 1e6 * total / steps, "wait_us": us["wait"], "launch_us": us["launch"],
             "read_us": us["collect"] - us["wait"], "other_us": 1e6 * total / steps - us["launch"] - us["collect"]}
    return {"host_split": {k: round(v, 1) for k, v in split.items()}}


def _timed_steps(engine: LLMEngine, steps: int) -> tuple[float, dict[str, float]]:
    """`steps` engine steps with the launch, the read and its wait wrapped in wall clocks:
    (seconds in all, seconds in each part)."""
    spent = {"launch": 0.0, "collect": 0.0, "wait": 0.0}
    runner = engine.runner
    launch, collect, wait = runner.launch_decode, runner.collect, HostCopy.wait
    runner.launch_decode = _timed(launch, spent, "launch")  # type: ignore[method-assign]
    runner.collect = _timed(collect, spent, "collect")  # type: ignore[method-assign]
    HostCopy.wait = _timed(wait, spent, "wait")  # type: ignore[method-assign]
    try:
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        total = time.perf_counter() - t0
    finally:
        del runner.launch_decode, runner.collect
        HostCopy.wait = wait  # type: ignore[method-assign]
    return total, spent
