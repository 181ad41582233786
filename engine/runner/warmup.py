"""Capture at start-up, then when idle: the CUDA graphs a serving node meets, never on a request's path.

Graphs are otherwise captured on first use (engine/runner/cuda_graphs.py, engine/runner/prefill_graphs.py). On
a server that first use is a request: its step waits for the capture, and on a cold Triton cache
for the kernels' compilation too (seconds per new prefill bucket: the first requests' TTFT p99
in BENCHMARKS.md), and the node's loop answers nothing meanwhile. Every step shape the limits
allow (engine/runner/shapes.py) is several times the graphs requests meet first, too many to capture
before `ready` without slowing start-up, so a node (`model.warmup`, on by default for `pdserve up`;
`pdserve generate` and the benches capture on first use) splits them:

- before it serves, the keys ordinary requests meet first, in two phases whose durations it logs:
  - decode: every batch bucket at each of its block-table widths (every decode shape), greedy and
    sampled (no top-k/top-p filter), with and without logprobs (the greedy ones without logprobs
    are captured by `build_runner` already);
  - prefill: every token bucket at the fewest rows whose rows fit `max_model_len`, greedy and
    sampled, with and without logprobs, fresh prompts; two prompts in every token bucket, the
    longer up to the whole bucket, and where prompts resume (chunked past the token budget, or
    after a cached prefix) a resumed chunk beside another too (greedy and sampled, with logprobs);
    then every row bucket once at the largest token bucket (greedy with logprobs), which compiles
    the kernels' row-count specializations. A later step of a shape with no graph replays the
    smallest of these that holds it padded (`PrefillGraphs.cover`) rather than run eagerly;
- after, when its loop is idle (`IdleCaptures`; `capture_deferred`, one graph a call, so a request
  arriving meanwhile waits at most one capture): after `QUIET_S` with no work, the keys and shapes
  requests' steps ran eagerly (`PrefillGraphs.pending`, `ShapeLog.met`); after `BACKLOG_QUIET_S`,
  every other prefill shape, greedy, likeliest first (`ShapeLog.backlog`), then the decode graphs
  with a top-k/top-p filter (`DecodeGraphs.deferred`).

A prefill step whose shape has no graph yet, and that no larger graph holds, runs eagerly (tens of ms
of launches) and never captures on its path; its shape moves to the head of the backlog and
`ModelRunner.shapes` counts it (`cold`). A new sampling variant of a shape that has a graph runs eagerly too, and is captured on
its path only once it came back `EAGER_RUNS_BEFORE_CAPTURE` times (a saturated node never idles;
the shape's kernels are compiled by then, so that capture is launches, not compilation). Decode keys
with penalties or grammars are captured on first use; prefill steps with penalties, prompt
logprobs or grammars always run eagerly (engine/runner/model_runner.py). Every capture runs over
dummy prompts whose every block is the trash block (engine/runner/dummy_prompts.py,
engine/cache/kv_cache.py), so it changes no request's state and no KV block. On the CPU there is
nothing to capture: the shapes are only marked covered, in the same order.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from engine.request import PrefillChunk
from engine.runner.dummy_prompts import chunks_for_key, dummy_chunks
from engine.runner.prefill_graphs import MAX_TOP_LOGPROBS, PrefillGraphs
from engine.runner.prefill_step import PrefillKey
from engine.runner.shapes import DecodeShape, PrefillShape, ShapeLog
from engine.sampling.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# A capture blocks the node's loop, and one that compiles kernels for a new shape blocks it for up to a
# second, so a node captures only once its loop has had no work for a while; otherwise, under a steady
# load even a light one, it would start one between any two requests and make the next one wait.
# Keys that requests met (they ran eagerly: their kernels are compiled already, the capture is only
# launches) wait for a short lull; the speculative backlog, most of which no request may ever meet,
# for a node with nothing to do.
QUIET_S = 1.0
BACKLOG_QUIET_S = 10.0
SLOW_CAPTURE_S = 0.05  # an idle capture at least this long is logged with its shape

GREEDY, SAMPLED = SamplingParams(max_tokens=1), SamplingParams(temperature=1.0, max_tokens=1)
VARIANTS = [(p, lp) for p in (GREEDY, SAMPLED) for lp in (None, 0)]  # (params, logprobs)


@dataclass
class WarmupReport:
    decode_graphs: int = 0
    prefill_graphs: int = 0
    seconds: float = 0.0
    phases: dict[str, float] = field(default_factory=dict)  # phase -> seconds
    pending: int = 0  # shapes left for the idle captures


def warm_up(runner, *, decode: bool, prefill: bool, max_model_len: int) -> WarmupReport:
    """Capture the node's first graphs (module docstring): `decode` for a node that decodes,
    `prefill` for one that prefills; mark their shapes warm and list the others (`runner.shapes`)
    for `capture_deferred`."""
    t0, report = time.perf_counter(), WarmupReport()
    shapes: ShapeLog | None = runner.shapes
    if decode:
        with _phase(report, "decode"):
            report.decode_graphs = _warm_decode(runner.graphs) if runner.graphs is not None else 0
            if shapes is not None:
                shapes.warm.update(shapes.decode_shapes())
            if runner.graphs is not None:
                runner.graphs.deferred = filter_keys(runner.graphs)
    if prefill:
        with _phase(report, "prefill"):
            report.prefill_graphs = _warm_prefill(runner, shapes, max_model_len)
        if runner.prefill_graphs is not None:
            runner.prefill_graphs.defer = True  # from now on a new key runs eagerly; `capture_deferred` when idle
    if shapes is not None:
        shapes.plan(decode, prefill)
        report.pending = shapes.status()["graph_shapes_pending"]
    report.seconds = time.perf_counter() - t0
    if report.decode_graphs or report.prefill_graphs:
        phases = ", ".join(f"{name} {s:.1f} s" for name, s in report.phases.items())
        log.info("warm-up: %d decode and %d prefill graphs captured in %.1f s (%s); %d shapes left to "
                 "capture when idle", report.decode_graphs, report.prefill_graphs, report.seconds, phases,
                 report.pending)
    return report


@contextmanager
def _phase(report: WarmupReport, name: str) -> Iterator[None]:
    start = time.perf_counter()
    yield
    report.phases[name] = time.perf_counter() - start


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


def filter_keys(graphs) -> list:
    """The decode keys of a sampled batch with a top-k/top-p filter, for the idle captures."""
    return [(b, False, True, False, False, logprobs, width)
            for b in graphs.buckets for width in graphs.widths[b] for logprobs in (False, True)]


def _warm_prefill(runner, shapes: ShapeLog | None, max_model_len: int) -> int:
    """Run (on a GPU: capture) the warm-up's prefill steps; mark their shapes warm."""
    graphs: PrefillGraphs | None = runner.prefill_graphs
    buckets = graphs if graphs is not None else shapes
    if buckets is None:
        return 0
    before = len(graphs.graphs) if graphs is not None else 0
    resumes = shapes is not None and shapes.resumes
    for chunks in warm_steps(buckets.token_buckets, buckets.row_buckets, max_model_len, resumes):
        if graphs is not None:
            graphs.run(chunks)
        if shapes is not None:
            shapes.warm.add(shapes.prefill_shape(chunks))  # type: ignore[arg-type]  # within the buckets
    return len(graphs.graphs) - before if graphs is not None else 0


def warm_steps(token_buckets: list[int], row_buckets: list[int], max_model_len: int,
               resumes: bool = False) -> list[list[PrefillChunk]]:
    """The warm-up's prefill steps (module docstring), as dummy prompts."""
    steps = []
    for tokens in token_buckets:
        rows = rows_for(tokens, row_buckets, max_model_len)
        if rows is not None:
            steps += [dummy_chunks(tokens, rows, params, lp) for params, lp in VARIANTS]
    if len(row_buckets) > 1:
        steps += _two_rows(token_buckets, row_buckets, max_model_len, resumes)
    tokens = token_buckets[-1]
    for rows in row_buckets:
        # its fewest rows ran above among the variants (greedy with logprobs too): that step again only replays a graph
        if tokens >= rows and (tokens // rows) <= max_model_len and rows != rows_for(tokens, row_buckets, max_model_len):
            steps.append(dummy_chunks(tokens, rows, GREEDY, 0))
    return steps


def _two_rows(token_buckets: list[int], row_buckets: list[int], max_model_len: int,
              resumes: bool) -> list[list[PrefillChunk]]:
    """Two prompts in a step, the longer up to the whole bucket (a node at a few requests per
    second); where prompts resume, also a resumed chunk beside another. Greedy and sampled, with
    logprobs: a later step of fewer tokens, rows or logprobs replays these graphs padded
    (`PrefillGraphs.cover`)."""
    steps = []
    for fresh in (True, False) if resumes else (True,):
        for tokens in token_buckets[1:]:
            for greedy in (True, False):
                key = PrefillKey(tokens, 2, tokens, greedy, False, MAX_TOP_LOGPROBS, fresh)
                chunks = chunks_for_key(key, token_buckets, row_buckets, max_model_len - 1)
                if chunks is not None:
                    steps.append(chunks)
    return steps


def rows_for(tokens: int, row_buckets: list[int], max_model_len: int) -> int | None:
    """The fewest rows (a row bucket) whose equal share of `tokens` fits `max_model_len`."""
    return next((r for r in row_buckets if -(-tokens // r) <= max_model_len and r <= tokens), None)


def capture_deferred(runner, max_model_len: int, met_only: bool = False) -> bool:
    """Between steps of an idle node: capture one graph (module docstring: a key a request's step
    ran eagerly, else the next backlog shape, else a decode filter key; with `met_only` only those
    that requests' steps met); False when none is left."""
    graphs: PrefillGraphs | None = runner.prefill_graphs
    shapes: ShapeLog | None = runner.shapes
    if graphs is not None and graphs.capture_deferred(max_model_len):
        if shapes is not None:
            shapes.warm.update(graphs.shapes)
        return True
    shape = shapes.next_cold(met_only) if shapes is not None else None
    if met_only and shape is None:
        return False
    if shape is not None:
        if _capture_shape(runner, shape, max_model_len):
            shapes.warm.add(shape)  # type: ignore[union-attr]
        return True
    decode = runner.graphs
    while decode is not None and decode.deferred:
        key = decode.deferred.pop(0)
        if key not in decode.graphs:
            decode.capture(key)
            return True
    return False


class IdleCaptures:
    """The deferred captures of one node's loop (loop thread only): the loop calls `busy()` after a
    round with work and `idle()` after one without; `idle` captures one graph (`capture_deferred`)
    once the loop has been idle `quiet_s` (what requests met) or `backlog_quiet_s` (the rest), and
    says whether it did (the loop then comes straight back for the next). The quiet clock starts at
    construction: a node makes it after its warm-up, so a long warm-up is not taken for a lull."""

    def __init__(self, runner, max_model_len: int, quiet_s: float = QUIET_S,
                 backlog_quiet_s: float = BACKLOG_QUIET_S) -> None:
        self.runner, self.max_model_len = runner, max_model_len
        self.quiet_s, self.backlog_quiet_s = quiet_s, backlog_quiet_s
        self.since = time.monotonic()  # the last round with work
        self.count, self.seconds = 0, 0.0  # idle captures made, and their time

    def busy(self) -> bool:
        self.since = time.monotonic()
        return True

    def idle(self) -> bool:
        quiet = time.monotonic() - self.since
        if quiet < self.quiet_s:
            return False
        start = time.perf_counter()
        captured = capture_deferred(self.runner, self.max_model_len, met_only=quiet < self.backlog_quiet_s)
        if captured:
            took = time.perf_counter() - start
            self.count, self.seconds = self.count + 1, self.seconds + took
            if took >= SLOW_CAPTURE_S:
                log.info("idle capture %d took %.3f s (%.1f s in all)", self.count, took, self.seconds)
        return captured


def shape_status(runner) -> dict[str, int]:
    """A node's status entries: steps that met a shape with no graph, and shapes left to capture."""
    shapes: ShapeLog | None = runner.shapes
    return shapes.status() if shapes is not None else {"cold_shape_steps": 0, "graph_shapes_pending": 0}


def _capture_shape(runner, shape: PrefillShape | DecodeShape, max_model_len: int) -> bool:
    """The greedy graph of a shape: a prefill shape over dummy prompts shorter than the context that
    make it, a decode shape over the spare slot. Without graphs there is nothing to capture (True);
    False when no dummy step makes the shape (its steps stay eager, and cold)."""
    if len(shape) == 2:
        b, width = shape  # type: ignore[misc]
        key = (b, True, False, False, False, False, width)
        if runner.graphs is not None and key not in runner.graphs.graphs:
            runner.graphs.capture(key)
        return True
    tokens, rows, max_q, fresh = shape  # type: ignore[misc]
    graphs: PrefillGraphs | None = runner.prefill_graphs
    greedy = PrefillKey(tokens, rows, max_q, True, False, None, fresh)
    return graphs is None or greedy in graphs.graphs or graphs.capture_key(greedy, max_model_len - 1)
