"""DecodeGraphs: the whole decode step as one CUDA graph per batch-size bucket.

A graph for bucket B replays `ModelRunner.decode_step` over `BatchState.step_rows[:B]`: the
running slots, then the spare slot as padding (always done, so its KV writes land in the
trash block and its outputs are dropped). Everything else the step reads (lengths, last
tokens, drafts, block tables, sampling parameters) lives in `BatchState` tensors and the KV
cache, which inserts write in place, so a step is: at most one small non-blocking copy (the
rows, only when the running set changed), one replay, and one copy of its packed outputs with
one event (engine/step_output.py). The step reads the state's rows through one gather kernel
(kernels/step_meta.py `step_inputs`).

Graphs are keyed by (B, all_greedy, needs_filter, penalized, constrained, logprobs) and captured on
first use; the greedy ones without penalties, grammar masks or logprobs for every bucket are
captured up front (`capture_greedy`). A constrained graph reads `BatchState.grammar_mask`.
A capture synchronizes the device once (torch's capture does), so it is a one-time cost
per key, paid before the loop runs for the keys captured up front.

Careful when editing: a capture runs the step once (warm-up, to compile kernels) with every
row on the spare slot, so it changes no request's state; the graphs' outputs are static
tensors, overwritten by the next replay of the same graph (the runner queues their one copy to
the host right after the replay, in stream order, into a pinned buffer of its own).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from engine.batch_state import BatchState, to_device_no_sync

MAX_TOP_LOGPROBS = 20  # graphs that carry logprobs compute this many; rows keep what they asked

GraphKey = tuple[int, bool, bool, bool, bool, bool]  # (bucket, *StepFlags, logprobs)
StepFlags = tuple[bool, bool, bool, bool]  # (all_greedy, needs_filter, penalized, constrained): host-known per launch
StepOutputs = Any  # engine.model_runner.StepOutputs: the step's static output tensors


class DecodeRunner(Protocol):
    """What the decode graphs use of the ModelRunner."""

    state: BatchState
    device: torch.device
    max_blocks: int

    def decode_step(self, rows: torch.Tensor, flags: StepFlags, lp_sel: Any, num_top: int,
                    num_kv_blocks: int) -> StepOutputs: ...


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
        self.graphs: dict[GraphKey, tuple[torch.cuda.CUDAGraph, StepOutputs]] = {}
        self.pool: Any = None  # all graphs share one memory pool (they never run at once)
        self._rows: list[int] = [runner.state.spare] * max_batch  # what `step_rows` holds

    def bucket(self, n: int) -> int:
        return next(b for b in self.buckets if b >= n)

    def replay(self, slots: list[int], flags: StepFlags, logprobs: bool) -> StepOutputs:
        """Run the step for `slots` (<= max_batch); outputs have the bucket's row count."""
        b = self.bucket(len(slots))
        key = (b, *flags, logprobs)
        if key not in self.graphs:
            self.capture(key)
        self._set_rows(slots + [self.runner.state.spare] * (b - len(slots)))
        graph, out = self.graphs[key]
        graph.replay()
        return out

    def capture_greedy(self) -> None:
        for b in self.buckets:
            self.capture((b, True, False, False, False, False))

    def _set_rows(self, rows: list[int]) -> None:
        if rows != self._rows[: len(rows)]:
            self.runner.state.step_rows[: len(rows)].copy_(to_device_no_sync(rows, torch.long, self.runner.device),
                                                          non_blocking=True)
            self._rows[: len(rows)] = rows

    def capture(self, key: GraphKey) -> None:
        b, all_greedy, needs_filter, penalized, constrained, logprobs = key
        r = self.runner
        if not all_greedy:
            r.state.ensure_draft_probs()
        if penalized:
            r.state.penalties.ensure()
        if constrained:
            r.state.ensure_grammar_mask()
        self._set_rows([r.state.spare] * b)
        rows = r.state.step_rows[:b]

        def step() -> StepOutputs:
            lp_sel = slice(None) if logprobs else None
            flags = (all_greedy, needs_filter, penalized, constrained)
            return r.decode_step(rows, flags, lp_sel, MAX_TOP_LOGPROBS, r.max_blocks)

        side = torch.cuda.Stream(r.device)
        side.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(side), torch.no_grad():
            step()  # warm-up: compiles kernels, sizes workspaces
        torch.cuda.current_stream(r.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad(), torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = step()
        self.pool = graph.pool()
        self.graphs[key] = (graph, out)
