"""Capture at start-up: the CUDA graphs a serving node meets, before it reports ready.

Graphs are otherwise captured on first use (engine/runner/cuda_graphs.py, engine/runner/prefill_graphs.py). On
a server that first use is a request: its step waits for the capture, and on a cold Triton cache
for the kernels' compilation too (seconds per new prefill bucket: the first requests' TTFT p99
in BENCHMARKS.md), and the node's loop answers nothing meanwhile. A node therefore
captures, before it serves (`model.warmup`, on by default for `pdserve up`; `pdserve generate` and
the benches capture on first use), every step shape its limits allow (engine/runner/shapes.py),
in three phases whose durations it logs:

- decode: every batch bucket at each of its block-table widths, greedy, sampled, and sampled with a
  top-k/top-p filter, each with and without logprobs (the greedy ones without logprobs are captured
  by `build_runner` already);
- prefill shapes: every (tokens, rows, longest chunk) bucket a step of whole or chunked prompts can
  fill, fresh, and resumed when a prompt can resume (past the token budget, or after a cached
  prefix), greedy: what the kernels are compiled for;
- prefill variants: every token bucket at the fewest rows whose rows fit `max_model_len`, greedy
  and sampled, with and without logprobs, fresh prompts; two equal prompts in every token bucket
  (greedy with logprobs, sampled without); then every row bucket once at the largest token bucket
  (greedy with logprobs).

A step's shape is then always one its kernels were compiled for (`ModelRunner.shapes` counts the
steps that met another: `cold`). Rarer keys of a warm shape (other sampling variants, top-k/top-p
in a prefill) run eagerly on first use (tens of ms of launches, not a capture's ~100 ms) and the
node captures them between steps when idle (`capture_deferred`), over dummy prompts
(engine/runner/dummy_prompts.py). Penalized and constrained decode keys are captured on first
use; prefill steps with penalties, prompt logprobs or grammars always run eagerly
(engine/runner/model_runner.py). The warm-up's steps are dummy prompts whose every block is the
trash block (engine/cache/kv_cache.py), so they change no request's state and no KV block. On
the CPU there is nothing to capture: the shapes are only marked covered.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from engine.runner.dummy_prompts import chunks_for_key, dummy_chunks
from engine.runner.prefill_graphs import PrefillGraphs
from engine.runner.prefill_step import PrefillKey
from engine.runner.shapes import ShapeLog
from engine.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GREEDY, SAMPLED = SamplingParams(max_tokens=1), SamplingParams(temperature=1.0, max_tokens=1)
VARIANTS = [(p, lp) for p in (GREEDY, SAMPLED) for lp in (None, 0)]  # (params, logprobs)
DECODE_FLAGS = [(True, False), (False, False), (False, True)]  # (all_greedy, needs_filter)


@dataclass
class WarmupReport:
    decode_graphs: int = 0
    prefill_graphs: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds


def warm_up(runner, *, decode: bool, prefill: bool, max_model_len: int) -> WarmupReport:
    """Capture the node's graphs (module docstring): `decode` for a node that decodes, `prefill`
    for one that prefills; mark the shapes covered (`runner.shapes`)."""
    t0, report = time.perf_counter(), WarmupReport()
    shapes: ShapeLog | None = runner.shapes
    if decode:
        start = time.perf_counter()
        report.decode_graphs = _warm_decode(runner.graphs) if runner.graphs is not None else 0
        if shapes is not None:
            shapes.warm.update(shapes.decode_shapes())
        report.phases["decode"] = time.perf_counter() - start
    if prefill:
        _warm_prefill_phases(runner, shapes, max_model_len, report)
    report.seconds = time.perf_counter() - t0
    if report.decode_graphs or report.prefill_graphs:
        phases = ", ".join(f"{name} {s:.1f} s" for name, s in report.phases.items())
        log.info("warm-up: %d decode and %d prefill graphs captured in %.1f s (%s)",
                 report.decode_graphs, report.prefill_graphs, report.seconds, phases)
    return report


def _warm_prefill_phases(runner, shapes: ShapeLog | None, max_model_len: int, report: WarmupReport) -> None:
    graphs: PrefillGraphs | None = runner.prefill_graphs
    start = time.perf_counter()
    before = len(graphs.graphs) if graphs is not None else 0
    if shapes is not None:
        for shape in shapes.prefill_shapes():
            if graphs is not None:
                _capture_shape(graphs, shape, max_model_len)
            shapes.warm.add(shape)
    report.phases["prefill shapes"] = time.perf_counter() - start
    if graphs is None:
        return
    start = time.perf_counter()
    _warm_prefill(graphs, max_model_len)
    report.phases["prefill variants"] = time.perf_counter() - start
    graphs.defer = True  # from now on a new key runs eagerly; `capture_deferred` when idle
    report.prefill_graphs = len(graphs.graphs) - before


def _capture_shape(graphs: PrefillGraphs, shape: tuple[int, int, int, bool], max_model_len: int) -> None:
    """The greedy graph of a prefill shape, over dummy prompts that make it."""
    tokens, rows, max_q, fresh = shape
    chunks = chunks_for_key(PrefillKey(tokens, rows, max_q, True, False, None, fresh), graphs.token_buckets,
                            graphs.row_buckets, max_model_len - 1)
    if chunks is not None and graphs.key(chunks) not in graphs.graphs:
        graphs.run(chunks)


def _warm_decode(graphs) -> int:
    before = len(graphs.graphs)
    for b in graphs.buckets:
        for width in graphs.widths[b]:
            for all_greedy, needs_filter in DECODE_FLAGS:
                for logprobs in (False, True):
                    key = (b, all_greedy, needs_filter, False, False, logprobs, width)
                    if key not in graphs.graphs:
                        graphs.capture(key)
    return len(graphs.graphs) - before


def _warm_prefill(graphs: PrefillGraphs, max_model_len: int) -> int:
    before = len(graphs.graphs)
    for tokens in graphs.token_buckets:
        rows = rows_for(tokens, graphs.row_buckets, max_model_len)
        if rows is None:
            continue
        for params, lp in VARIANTS:
            graphs.run(dummy_chunks(tokens, rows, params, lp))
    if len(graphs.row_buckets) > 1:  # two prompts in one step (a prefill node at a few requests/s)
        for tokens in graphs.token_buckets[1:]:
            if tokens // 2 <= max_model_len:
                for params, lp in ((GREEDY, 0), (SAMPLED, None)):
                    graphs.run(dummy_chunks(tokens, 2, params, lp))
    tokens = graphs.token_buckets[-1]
    for rows in graphs.row_buckets:
        if tokens >= rows and (tokens // rows) <= max_model_len:
            graphs.run(dummy_chunks(tokens, rows, GREEDY, 0))
    return len(graphs.graphs) - before


def rows_for(tokens: int, row_buckets: list[int], max_model_len: int) -> int | None:
    """The fewest rows (a row bucket) whose equal share of `tokens` fits `max_model_len`."""
    return next((r for r in row_buckets if -(-tokens // r) <= max_model_len and r <= tokens), None)


def capture_deferred(runner, max_model_len: int) -> bool:
    """Between steps of an idle node: capture one prefill graph a request's step ran eagerly
    (its key was not warmed up); False when there is none (engine/runner/prefill_graphs.py)."""
    graphs = runner.prefill_graphs
    return graphs is not None and graphs.capture_deferred(max_model_len)
