"""Capture at start-up: the CUDA graphs a serving node meets, before it reports ready.

Graphs are otherwise captured on first use (engine/runner/cuda_graphs.py, engine/runner/prefill_graphs.py). On
a server that first use is a request: its step waits for the capture, and on a cold Triton cache
for the kernels' compilation too (seconds per new prefill bucket: the first requests' TTFT p99
in BENCHMARKS.md), and the node's loop answers nothing meanwhile. A node therefore
captures the keys ordinary requests meet before it serves (`model.warmup`, on by default for
`pdserve up`; `pdserve generate` and the benches capture on first use):

- decode: every batch bucket at its block-table widths (engine/runner/cuda_graphs.py), greedy and
  sampled (no top-k/top-p filter), with and without logprobs (the greedy ones without logprobs
  are captured by `build_runner` already);
- prefill: every token bucket at the fewest rows whose rows fit `max_model_len`, greedy and
  sampled, with and without logprobs, fresh prompts; two equal prompts in every token bucket
  (greedy with logprobs, sampled without); then every row bucket once at the largest token bucket
  (greedy with logprobs), which compiles the kernels' row-count specializations.

Rarer keys (top-k/top-p filters, cached prefixes, other token x row pairs) are not captured on a
request's path after the warm-up: their first steps run eagerly (tens of ms of launches, not a
capture's ~100 ms) and the node captures them between steps when idle (`capture_deferred`), over
dummy prompts (engine/runner/dummy_prompts.py). Steps with penalties, prompt logprobs or grammars always
run eagerly (engine/runner/model_runner.py). The warm-up's steps are
dummy prompts whose every block is the trash block (engine/cache/kv_cache.py), so they change no
request's state and no KV block.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from engine.runner.dummy_prompts import dummy_chunks
from engine.runner.prefill_graphs import PrefillGraphs
from engine.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)

GREEDY, SAMPLED = SamplingParams(max_tokens=1), SamplingParams(temperature=1.0, max_tokens=1)
VARIANTS = [(p, lp) for p in (GREEDY, SAMPLED) for lp in (None, 0)]  # (params, logprobs)


@dataclass
class WarmupReport:
    decode_graphs: int = 0
    prefill_graphs: int = 0
    seconds: float = 0.0


def warm_up(runner, *, decode: bool, prefill: bool, max_model_len: int) -> WarmupReport:
    """Capture the node's graphs (module docstring): `decode` for a node that decodes, `prefill`
    for one that prefills. Nothing to do without CUDA graphs."""
    t0, report = time.perf_counter(), WarmupReport()
    if decode and runner.graphs is not None:
        report.decode_graphs = _warm_decode(runner.graphs)
    if prefill and runner.prefill_graphs is not None:
        report.prefill_graphs = _warm_prefill(runner.prefill_graphs, max_model_len)
        runner.prefill_graphs.defer = True  # from now on a new key runs eagerly; `capture_deferred` when idle
    report.seconds = time.perf_counter() - t0
    if report.decode_graphs or report.prefill_graphs:
        log.info("warm-up: %d decode and %d prefill graphs captured in %.1f s",
                 report.decode_graphs, report.prefill_graphs, report.seconds)
    return report


def _warm_decode(graphs) -> int:
    before = len(graphs.graphs)
    for b in graphs.buckets:
        for width in graphs.widths[b]:
            for all_greedy in (True, False):
                for logprobs in (False, True):
                    key = (b, all_greedy, False, False, False, logprobs, width)
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
