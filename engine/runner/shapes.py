"""Step shapes: which CUDA graph buckets a node's steps can meet under its limits, and which they met.

A prefill step's shape is its graph buckets (tokens, rows, longest chunk) and whether every chunk
starts a prompt (`fresh`); a decode step's is its batch bucket and block-table width
(engine/runner/prefill_graphs.py, engine/runner/cuda_graphs.py). Sampling flags and logprobs pick a
graph among a shape's variants, but the shape is what the kernels are compiled for and what the
limits decide: `max_num_batched_tokens` the token buckets, `max_num_seqs` the row and batch
buckets, `max_model_len` the longest chunk and the widths, and whether a prompt can be resumed
(chunked past the token budget, or after a cached prefix) the non-fresh shapes.

A node's warm-up (engine/runner/warmup.py) captures the shapes ordinary requests meet first before
it serves; the other shapes `prefill_shapes` and `decode_shapes` list wait in `ShapeLog.backlog`,
and the node captures them one at a time when it is idle (those a step met after a short lull). `ShapeLog` counts the steps that met a
shape with no graph yet (`cold`): on a GPU such a step runs eagerly, and its shape moves to the
head of the backlog. Holds integers only; never touches a device.
"""

from __future__ import annotations

import logging
from collections import Counter

from engine.request import PrefillChunk
from engine.runner.cuda_graphs import bucket_sizes, width_for
from engine.runner.dummy_prompts import chunks_for_key
from engine.runner.prefill_graphs import step_buckets
from engine.runner.prefill_step import PrefillKey

log = logging.getLogger(__name__)

PrefillShape = tuple[int, int, int, bool]  # (tokens, rows, longest chunk) buckets, fresh
DecodeShape = tuple[int, int]  # (batch bucket, block-table width)


def prefill_shapes(token_buckets: list[int], row_buckets: list[int], max_model_len: int,
                   resumes: bool) -> list[PrefillShape]:
    """Every prefill shape a step of whole or chunked prompts (each shorter than `max_model_len`)
    can have within the largest buckets; the non-fresh ones only when a prompt can be `resumes`d."""
    out = []
    for fresh in (True, False) if resumes else (True,):
        for tokens in token_buckets:
            for rows in row_buckets:
                for max_q in (b for b in token_buckets if b <= tokens):
                    key = PrefillKey(tokens, rows, max_q, True, False, None, fresh)
                    if chunks_for_key(key, token_buckets, row_buckets, max_model_len - 1) is not None:
                        out.append((tokens, rows, max_q, fresh))
    return out


def decode_shapes(widths: dict[int, list[int]]) -> list[DecodeShape]:
    """Every decode shape: each batch bucket at each of its widths (a row's context picks the width)."""
    return [(b, w) for b, ws in widths.items() for w in ws]


def backlog_order(shape: PrefillShape | DecodeShape) -> tuple[int, ...]:
    """Which shapes a request is likelier to meet first: decode before prefill (every running batch
    is a decode shape), fresh prompts before resumed ones, then fewer rows (a node at a few
    requests per second prefills one or two prompts a step), fewer tokens, one long chunk."""
    if len(shape) == 2:
        return (0, *shape)
    tokens, rows, max_q, fresh = shape  # type: ignore[misc]
    return (1, not fresh, rows, tokens, -max_q)


class ShapeLog:
    """The shapes a runner's steps met (`met`, counted), against those that have a graph (`warm`);
    `cold`: steps since the warm-up whose shape had none. `backlog`: the listed shapes still to
    capture, in the order the node captures them when idle (`plan`, `next_cold`)."""

    def __init__(self, token_buckets: list[int], row_buckets: list[int], widths: dict[int, list[int]],
                 max_model_len: int, resumes: bool) -> None:
        self.token_buckets, self.row_buckets, self.widths = token_buckets, row_buckets, widths
        self.max_model_len, self.resumes = max_model_len, resumes
        self.batch_buckets = bucket_sizes(max(widths))
        self.warm: set[PrefillShape | DecodeShape] = set()
        self.met: Counter[PrefillShape | DecodeShape] = Counter()
        self.cold = 0
        self.backlog: list[PrefillShape | DecodeShape] = []
        self.planned = False  # `cold` counts from the warm-up's `plan` on (before it, or without one, graphs come on first use)

    def prefill_shapes(self) -> list[PrefillShape]:
        return prefill_shapes(self.token_buckets, self.row_buckets, self.max_model_len, self.resumes)

    def decode_shapes(self) -> list[DecodeShape]:
        return decode_shapes(self.widths)

    def prefill_shape(self, chunks: list[PrefillChunk]) -> PrefillShape | None:
        """A step's shape; None past the largest buckets (such a step runs eagerly at its size)."""
        if sum(c.end - c.start for c in chunks) > self.token_buckets[-1] or len(chunks) > self.row_buckets[-1]:
            return None
        return (*step_buckets(chunks, self.token_buckets, self.row_buckets), all(c.start == 0 for c in chunks))

    def decode_shape(self, rows: int, num_kv_blocks: int) -> DecodeShape:
        b = next(b for b in self.batch_buckets if b >= rows)
        return b, width_for(self.widths[b], num_kv_blocks)

    def plan(self, decode: bool, prefill: bool) -> None:
        """The backlog: every listed shape of a node that `decode`s and/or `prefill`s that is not
        warm, likeliest first (`backlog_order`)."""
        listed: list[PrefillShape | DecodeShape] = [*(self.decode_shapes() if decode else []),
                                                    *(self.prefill_shapes() if prefill else [])]
        self.backlog = sorted((s for s in listed if s not in self.warm), key=backlog_order)
        self.planned = True

    def next_cold(self, met_only: bool = False) -> PrefillShape | DecodeShape | None:
        """The next backlog shape to capture (taken off it), None when none is left; with `met_only`
        only a shape that a step met (those lead the backlog: `note`)."""
        while self.backlog:
            if met_only and self.backlog[0] not in self.met:
                return None
            shape = self.backlog.pop(0)
            if shape not in self.warm:
                return shape
        return None

    def note(self, shape: PrefillShape | DecodeShape | None, eager: bool = True) -> None:
        """A step met `shape`; one with no graph of its own goes to the head of the backlog (if it is
        listed there), and is counted cold when it ran `eager` (not held by a larger shape's graph)."""
        if shape is None:
            return
        self.met[shape] += 1
        if shape not in self.warm and self.planned:
            if eager:
                self.cold += 1
                if self.met[shape] == 1:  # what warm-up missed, once a shape (a node's log: where a slow step came from)
                    log.info("a step met shape %s with no graph yet: it runs eagerly", shape)
            if shape in self.backlog and self.backlog[0] != shape:
                self.backlog.remove(shape)
                self.backlog.insert(0, shape)

    def status(self) -> dict[str, int]:
        """For the node's status: steps that met a shape with no graph, and shapes left to capture."""
        return {"cold_shape_steps": self.cold, "graph_shapes_pending": sum(s not in self.warm for s in self.backlog)}
