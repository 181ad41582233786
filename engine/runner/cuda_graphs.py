"""DecodeGraphs: the whole decode step as one CUDA graph per batch-size bucket.

A graph for bucket B replays `ModelRunner.decode_step` over `BatchState.step_rows[:B]`: the
running slots, then the spare slot as padding (always done, so its KV writes land in the
trash block and its outputs are dropped). Everything else the step reads (lengths, last
tokens, drafts, block tables, sampling parameters) lives in `BatchState` tensors and the KV
cache, which inserts write in place, so a step is: at most one small non-blocking copy (the
rows, only when the running set changed), one replay, and one copy of its packed outputs with
one event (engine/runner/step_output.py). The step reads the state's rows through one gather kernel
(kernels/step_meta.py `step_inputs`).

Graphs are keyed by (B, all_greedy, needs_filter, penalized, constrained, logprobs, kv_blocks) and
captured on first use, one per k the runner's steps run at (`step_ks`: the runner's k, and 0 with
adaptive k, engine/spec_decode/adaptive_k.py; a capture takes every k of its key at once, and the
k = 0 graphs sit in `plain_graphs`). `step_costs` times the greedy ones per bucket at warm-up. `kv_blocks` is the block-table width the step's attention reads: the
runner's `max_blocks`, or the narrowest of `short_blocks` (16, 32, 64, 128, 192;
settings.SHORT_KV_BLOCKS) that every row's blocks fit (for the buckets whose attention the widths split
differently; the rest have fewer). Each width splits its keys as `decode_splits` says for it, so a
row's splits follow its context: up to 16 blocks one split and no combine launch, then about one
128-key tile a split (4, 8, 16, 24, then 33 at batch 1 for max_model_len 4096). Why several widths:
a step's attention reads only the block-table columns its width names, and its split count
follows the width, so a short context neither walks a long table nor pays for splits it cannot
fill; each width costs a capture per bucket at warm-up (BENCHMARKS.md has the trade). The greedy
ones without penalties, grammar masks or logprobs, for every bucket and its widths, are captured up
front (`capture_greedy`). A constrained graph reads `BatchState.grammar_mask`; a constrained step
also comes as two graphs (`halves`: the forward, then masks, verification and redraft), so the host
can write the masks between them (engine/sched/decode_batch.py).
A capture synchronizes the device once (torch's capture does), so it is a one-time cost
per key, paid before the loop runs for the keys captured up front. With `settings.STEP_STAMPS` each
graph opens and closes with a stamp of the GPU's clock (`stamps`, kernels/stamps.py; a halves
step: the first graph opens, the second closes); off, the graphs hold the step alone.

Careful when editing: a capture runs the step once (warm-up, to compile kernels) with every
row on the spare slot, so it changes no request's state; the graphs' outputs are static
tensors, overwritten by the next replay of the same graph (the runner queues their one copy to
the host right after the replay, in stream order, into a pinned buffer of its own).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch

from engine.runner.batch_state import BatchState, to_device_no_sync
from kernels.stamps import StepStamps, stamps_on

MAX_TOP_LOGPROBS = 20  # graphs that carry logprobs compute this many; rows keep what they asked

GraphKey = tuple[int, bool, bool, bool, bool, bool, int]  # (bucket, *StepFlags, logprobs, kv_blocks)
StepFlags = tuple[bool, bool, bool, bool]  # (all_greedy, needs_filter, penalized, constrained): host-known per launch
StepOutputs = Any  # engine.runner.model_runner.StepOutputs: the step's static output tensors


class DecodeRunner(Protocol):
    """What the decode graphs use of the ModelRunner."""

    state: BatchState
    device: torch.device
    k: int
    step_ks: tuple[int, ...]  # the k a decode step may run at: (k,), or (k, 0) with adaptive k
    max_blocks: int
    short_blocks: tuple[int, ...]  # the narrower graphs' block-table widths (16: one key split; 32, 64, ...)

    def attention_splits(self, rows: int, num_kv_blocks: int) -> int: ...

    def decode_step(self, rows: torch.Tensor, flags: StepFlags, lp_sel: Any, num_top: int,
                    num_kv_blocks: int, k: int) -> StepOutputs: ...

    def decode_forward(self, rows: torch.Tensor, flags: StepFlags, num_kv_blocks: int, k: int,
                       logprobs: bool = False) -> Any: ...

    def decode_finish(self, fwd: Any, rows: torch.Tensor, flags: StepFlags, lp_sel: Any, num_top: int,
                      num_kv_blocks: int) -> StepOutputs: ...


@contextmanager
def capturing(graph: torch.cuda.CUDAGraph, pool: Any) -> Iterator[None]:
    """Capture into `graph` (memory from `pool`), with no autograd and the garbage collector off:
    a collection during the capture can free another engine's graph, whose reset is not allowed
    while a stream captures and ends this capture with an error (seen when a test made an engine
    per token)."""
    was_enabled = gc.isenabled()
    gc.disable()  # dead cycles wait until the capture is over
    try:
        with torch.no_grad(), torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            yield
    finally:
        if was_enabled:
            gc.enable()


def decode_widths(runner: DecodeRunner, b: int) -> list[int]:
    """Bucket b's block-table widths: `max_blocks` and those of `short_blocks` that split the keys
    otherwise than the next wider width kept (a batch whose rows fill the GPU alone attends in one
    split at any width: `max_blocks` only), narrowest first."""
    kept = [runner.max_blocks]
    for w in sorted((w for w in runner.short_blocks if w < runner.max_blocks), reverse=True):
        if runner.attention_splits(b, w) != runner.attention_splits(b, kept[-1]):
            kept.append(w)
    return kept[::-1]


def width_for(widths: list[int], num_kv_blocks: int) -> int:
    """The narrowest of a bucket's `widths` that holds `num_kv_blocks` table columns."""
    return next((w for w in widths if w >= num_kv_blocks), widths[-1])


def bucket_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, ... below `max_batch`, then `max_batch` itself."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


class DecodeGraphs:
    def __init__(self, runner: DecodeRunner, max_batch: int) -> None:
        self.runner = runner
        self.max_batch = max_batch
        self.buckets = bucket_sizes(max_batch)
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}  # steps at the runner's k
        self.plain_graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}  # at k = 0 (adaptive k)
        # a constrained step in two halves (forward; masks, verify, redraft), the first's outputs kept for the second
        self.halves: dict[GraphKey, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph, Any, StepOutputs]] = {}
        self.pool: Any = None  # all graphs share one memory pool (they never run at once)
        self._rows: list[int] = [runner.state.spare] * max_batch  # what `step_rows` holds
        self.widths = {b: decode_widths(runner, b) for b in self.buckets}  # each bucket's kv_blocks, narrow first
        self.stamps = StepStamps(runner.device) if stamps_on(runner.device) else None  # settings.STEP_STAMPS
        self.deferred: list[GraphKey] = []  # keys a node captures when idle (engine/runner/warmup.py)

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def key(self, n: int, flags: StepFlags, logprobs: bool, num_kv_blocks: int) -> GraphKey:
        """The graph for n rows whose attention reads at most `num_kv_blocks` table columns."""
        b = self.bucket(n)
        return (b, *flags, logprobs, width_for(self.widths[b], num_kv_blocks))

    def replay(self, slots: list[int], flags: StepFlags, logprobs: bool, num_kv_blocks: int,
               k: int | None = None) -> StepOutputs:
        """Run the step for `slots` (<= max_batch) at `k` (default the runner's); outputs have the
        bucket's row count."""
        key = self.key(len(slots), flags, logprobs, num_kv_blocks)
        graphs = self._graphs_at(self.runner.k if k is None else k)
        if key not in graphs:
            self.capture(key)
        self._place(slots, key)
        graph, out = graphs[key]
        graph.replay()
        return out

    def _graphs_at(self, k: int) -> dict[GraphKey, tuple[torch.cuda.CUDAGraph, StepOutputs]]:
        return self.graphs if k == self.runner.k else self.plain_graphs

    def replay_forward(self, slots: list[int], flags: StepFlags, logprobs: bool, num_kv_blocks: int) -> None:
        """The first half of a constrained step for `slots` (`ModelRunner.launch_forward`)."""
        key = self.key(len(slots), flags, logprobs, num_kv_blocks)
        if key not in self.halves:
            self.capture_halves(key)
        self._place(slots, key)
        self.halves[key][0].replay()

    def replay_finish(self, n: int, flags: StepFlags, logprobs: bool, num_kv_blocks: int) -> StepOutputs:
        """The second half of the step `replay_forward` began for n rows (nothing in between
        changes the rows)."""
        _, graph, _, out = self.halves[self.key(n, flags, logprobs, num_kv_blocks)]
        graph.replay()
        return out

    def capture_greedy(self) -> None:
        for b in self.buckets:
            for width in self.widths[b]:
                self.capture((b, True, False, False, False, False, width))

    def _place(self, slots: list[int], key: GraphKey) -> None:
        """`slots` into the step's rows, padded to the key's bucket with the spare slot."""
        self._set_rows(slots + [self.runner.state.spare] * (key[0] - len(slots)))

    def _set_rows(self, rows: list[int]) -> None:
        if rows != self._rows[: len(rows)]:
            self.runner.state.step_rows[: len(rows)].copy_(to_device_no_sync(rows, torch.long, self.runner.device),
                                                          non_blocking=True)
            self._rows[: len(rows)] = rows

    def _prepare(self, key: GraphKey) -> None:
        """The state buffers a key's step reads, made before its capture; every row on the spare slot."""
        b, all_greedy, _, penalized, constrained, _, _ = key
        r = self.runner
        if not all_greedy:
            r.state.ensure_draft_probs()
        if penalized:
            r.state.penalties.ensure()
        if constrained:
            r.state.ensure_grammar_mask()
        self._set_rows([r.state.spare] * b)

    def capture(self, key: GraphKey) -> None:
        """The key's graph at every k the runner's steps run at."""
        for k in self.runner.step_ks:
            self._capture(key, k)

    def _capture(self, key: GraphKey, k: int) -> None:
        b, all_greedy, needs_filter, penalized, constrained, logprobs, width = key
        r = self.runner
        self._prepare(key)
        rows = r.state.step_rows[:b]

        def step() -> StepOutputs:
            lp_sel = slice(None) if logprobs else None
            flags = (all_greedy, needs_filter, penalized, constrained)
            self._stamp(end=False)
            out = r.decode_step(rows, flags, lp_sel, MAX_TOP_LOGPROBS, width, k)
            self._stamp(end=True)
            return out

        self._warm_up(step)
        graph = torch.cuda.CUDAGraph()
        with capturing(graph, self.pool):
            out = step()
        self.pool = graph.pool()
        self._graphs_at(k)[key] = (graph, out)

    def step_costs(self, repeats: int = 20) -> dict[int, tuple[float, float]]:
        """Per bucket, the seconds of a greedy step at k = 0 and at the runner's k (the bucket's
        narrowest width, every row on the spare slot), timed over `repeats` replays of each graph
        between CUDA events: what adaptive k weighs (engine/spec_decode/adaptive_k.py).
        Synchronizes the device: warm-up only, after `capture_greedy`."""
        costs = {}
        for b in self.buckets:
            key = (b, True, False, False, False, False, self.widths[b][0])
            if key not in self.graphs or key not in self.plain_graphs:
                self.capture(key)
            self._place([], key)
            costs[b] = (self._time(self.plain_graphs[key][0], repeats), self._time(self.graphs[key][0], repeats))
        return costs

    def _time(self, graph: torch.cuda.CUDAGraph, repeats: int) -> float:
        """Seconds per replay of `graph` (after one untimed replay)."""
        graph.replay()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1000 / repeats

    def capture_halves(self, key: GraphKey) -> None:
        """Two graphs for a constrained key: the forward, then the rest reading its outputs (kept
        alive with the graphs, so no later capture in the shared pool reuses their memory)."""
        b, *flags, logprobs, width = key
        r = self.runner
        self._prepare(key)
        rows = r.state.step_rows[:b]
        f = tuple(flags)
        lp_sel = slice(None) if logprobs else None

        def forward() -> Any:
            self._stamp(end=False)
            return r.decode_forward(rows, f, width, r.k, logprobs)  # type: ignore[arg-type]

        def finish(fwd: Any) -> StepOutputs:
            out = r.decode_finish(fwd, rows, f, lp_sel, MAX_TOP_LOGPROBS, width)  # type: ignore[arg-type]
            self._stamp(end=True)
            return out

        self._warm_up(lambda: finish(forward()))
        first, second = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with capturing(first, self.pool):
            fwd = forward()
        self.pool = first.pool()
        with capturing(second, self.pool):
            out = finish(fwd)
        self.halves[key] = (first, second, fwd, out)

    def _stamp(self, end: bool) -> None:
        """The step's start or end stamp of the GPU's clock, when stamps are on (kernels/stamps.py)."""
        if self.stamps is not None:
            (self.stamps.stamp_end if end else self.stamps.stamp_start)()

    def _warm_up(self, step) -> None:
        """Run `step` once on a side stream (compiles kernels, sizes workspaces) before a capture."""
        r = self.runner
        side = torch.cuda.Stream(r.device)
        side.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(side), torch.no_grad():
            step()
        torch.cuda.current_stream(r.device).wait_stream(side)
