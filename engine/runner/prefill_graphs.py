"""PrefillGraphs: the whole prefill step as one CUDA graph per (tokens, rows) bucket.

A step of n tokens in r rows replays the graph of the smallest buckets T >= n, R >= r
(powers of two; T from 16 up to `max_tokens`, R up to `max_rows`): its chunks are packed into
that bucket's `PrefillInputs` (padding tokens write the trash block, padding rows have no
tokens), then one replay runs `prefill_forward`: metadata kernel, every layer, first tokens,
logprobs and the MTP drafts. The host cost no longer grows with the layers. Graphs are keyed by
`PrefillKey` (buckets, the longest chunk's power of two, which bounds the attention grid,
sampling flags, logprobs, fresh or not, grammar masks or not: a constrained key reads its
first tokens' masks from the bucket's `PrefillInputs.token_mask`) and captured on first use
(lazily: a capture is ~100 launches' worth of host time once per key, and the keys a server
meets are few), or, on a node past its warm-up (`defer`), off the request's path: a new key's
step replays the smallest captured graph that holds it padded (`cover`: larger buckets, the same
sampling), else runs eagerly, and its key waits in `pending` for the node's idle captures
(engine/runner/warmup.py); a step never captures a key whose shape (`PrefillKey.shape`) has no
graph yet. Steps beyond the largest
bucket run eagerly, where compute hides the launches.

Layer-wise KV push: after a replay, `on_layer(i, None)` hands every layer to the caller as
queued; the prefill node's sender then waits for an event it records after the replay, so a
replayed step's KV leaves after the whole step (an eager step's leaves layer by layer). Graphs
used to record an external event per layer for the sender to wait on, but such an event cannot
be waited on before its node runs: the wait sees the previous replay's record, and layers were
read before they were written (wrong tokens through the GPU service once the sender's copies left
the default stream). Overlapping a replayed step's push needs a signal the device
writes (or per-layer graphs): open.

Careful when editing: graphs share one memory pool of their own (not the decode graphs'); a
replay overwrites the static outputs of the previous prefill replay, so a step's outputs
must be read, or copied in stream order, before the next prefill step (both callers do:
the engine and the prefill node read first tokens to the host at once).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from engine.runner.cuda_graphs import capturing
from engine.runner.dummy_prompts import chunks_for_key
from engine.runner.prefill_step import (
    FirstHook,
    PrefillChunk,
    PrefillInputs,
    PrefillKey,
    PrefillResult,
    PrefillRunner,
    key_for,
    prefill_forward,
    prefill_head,
    prefill_tail,
)
from kernels._dispatch import batch_invariant

log = logging.getLogger(__name__)

MAX_TOP_LOGPROBS = 20  # graphs with logprobs compute this many; rows keep what they asked
# a deferred key's eager steps (~20-30 ms of launches each) before its step captures it; only a key whose
# shape has a graph (another variant's) is ever captured so: its kernels are compiled
EAGER_RUNS_BEFORE_CAPTURE = 4
MIN_TOKENS = 16

LayerReady = Callable[[int, Any], None]  # (layer, CUDA event after it, or None: already queued)


def pow2_buckets(low: int, high: int) -> list[int]:
    """low, 2 low, 4 low, ... below `high`, then `high`."""
    sizes, b = [], low
    while b < high:
        sizes.append(b)
        b *= 2
    return sizes + [high]


def step_buckets(chunks: list[PrefillChunk], token_buckets: list[int], row_buckets: list[int]) -> tuple[int, int, int]:
    """A step's (tokens, rows, longest chunk) buckets; the step must fit the largest ones."""
    n = sum(c.end - c.start for c in chunks)
    longest = max(c.end - c.start for c in chunks)
    return (next(b for b in token_buckets if b >= n), next(b for b in row_buckets if b >= len(chunks)),
            next(b for b in token_buckets if b >= longest))


class PrefillGraphs:
    def __init__(self, runner: PrefillRunner, max_tokens: int, max_rows: int) -> None:
        self.runner = runner
        self.token_buckets = pow2_buckets(MIN_TOKENS, max(max_tokens, MIN_TOKENS))
        self.row_buckets = pow2_buckets(1, max(max_rows, 1))
        self.inputs: dict[tuple[int, int], PrefillInputs] = {}
        # key -> (first tokens' graph, MTP drafts' graph or None at k = 0, static outputs, layer events)
        self.graphs: dict[PrefillKey, tuple[torch.cuda.CUDAGraph, torch.cuda.CUDAGraph | None, PrefillResult,
                                            list[Any]]] = {}
        self.pool: Any = None
        self.shapes: set[tuple[int, int, int, bool]] = set()  # the shapes of `graphs`' keys
        self.defer = False  # a new key runs eagerly and waits in `pending` for `capture_deferred` (nodes)
        self.pending: list[PrefillKey] = []
        self._eager_runs: dict[PrefillKey, int] = {}  # deferred keys' eager steps so far
        self.last_eager = False  # whether the last `run` ran eagerly (no graph held it)
        self._covers: dict[PrefillKey, PrefillKey | None] = {}  # `cover`'s answers until the next capture

    def fits(self, num_tokens: int, num_rows: int) -> bool:
        return num_tokens <= self.token_buckets[-1] and num_rows <= self.row_buckets[-1]

    def key(self, chunks: list[PrefillChunk]) -> PrefillKey:
        """The graph key of a step of `chunks` (its buckets, sampling flags, logprobs, freshness)."""
        t, r, max_q = step_buckets(chunks, self.token_buckets, self.row_buckets)
        key = key_for(chunks, t, r, max_q)
        if key.top_logprobs is not None:
            key = dataclasses.replace(key, top_logprobs=MAX_TOP_LOGPROBS)
        return key

    def run(self, chunks: list[PrefillChunk], on_layer: LayerReady | None = None,
            on_first: FirstHook | None = None, masks: torch.Tensor | None = None, words: int = 0) -> PrefillResult:
        """Pack `chunks` into their bucket (and the first tokens' grammar masks, [n, `words`] int32
        on the host, into its mask rows), replay (capturing on first use, or with `defer` running
        eagerly and capturing later), hand out the layer events. `on_first(result)` runs between the
        replay of the first tokens and that of the MTP drafts (`prefill_forward`). Never syncs,
        except a capture."""
        key = self.key(chunks)
        self.last_eager = False
        if key not in self.graphs and self.defer:
            cover = self.cover(key)
            if cover is not None or key.shape not in self.shapes or self._eager_runs.get(key, 0) < EAGER_RUNS_BEFORE_CAPTURE:
                # off the request's path: a captured key's graph that holds the step padded, else eager now
                # (no capture's ~100 ms); its own key is captured when the node idles (unless a graph of
                # its shape holds it: only logprobs it does not read are spared), or here once a variant
                # of a captured shape came back often enough to pay for its capture (a busy node never
                # idles); a shape with no graph is never captured here
                if key not in self.pending and (cover is None or cover.shape != key.shape):
                    self.pending.append(key)
                if cover is None:
                    return self._eager(key, chunks, on_layer, on_first, masks, words)
                key = cover
        inp = self._filled(key, chunks, masks, words)
        # No per-layer events in graphs: an event a graph's node records cannot be waited on from outside
        # before that node runs (the wait, or a host sync, sees the previous replay's record), so a KV
        # sender that waited on layer i's event could read layer i before this replay wrote it (wrong
        # tokens through the GPU service). A listener gets every layer once the replay is
        # queued, and its sender waits for an event recorded after the replay.
        if key not in self.graphs:
            if key in self.pending:
                self.pending.remove(key)
            self._capture(key, inp)
        head, tail, out, _ = self.graphs[key]
        head.replay()
        if on_first is not None:
            on_first(dataclasses.replace(out, drafts=None, draft_probs=None))  # the tail has not run yet
        if tail is not None:
            tail.replay()
        if on_layer is not None:
            for layer in range(self.runner.num_target_layers):
                on_layer(layer, None)
        return out

    def _eager(self, key: PrefillKey, chunks: list[PrefillChunk], on_layer: LayerReady | None,
               on_first: FirstHook | None, masks: torch.Tensor | None, words: int) -> PrefillResult:
        """The step at its own buckets with no graph (`last_eager`)."""
        self._eager_runs[key] = self._eager_runs.get(key, 0) + 1
        self.last_eager = True
        inp = self._filled(key, chunks, masks, words)
        hook = (lambda i: on_layer(i, None)) if on_layer is not None else None
        with self._kernel_mode():
            return prefill_forward(self.runner, inp, key, hook, on_first=on_first)

    def _filled(self, key: PrefillKey, chunks: list[PrefillChunk], masks: torch.Tensor | None,
                words: int) -> PrefillInputs:
        """`key`'s bucket inputs holding `chunks` (and, constrained, their first tokens' masks)."""
        inp = self._inputs(key)
        inp.fill_no_sync(chunks)
        if key.constrained:
            inp.fill_mask_no_sync(masks, words)
        return inp

    def cover(self, key: PrefillKey) -> PrefillKey | None:
        """The smallest captured key whose graph runs a step of `key` padded: buckets at least as
        large (padding tokens write the trash block, padding rows have no tokens), the same
        sampling flags, freshness and grammar, logprobs where the step has them. Its rows get their
        own tokens, up to the bits another bucket's kernels may round differently, as in any other
        batch; so never with batch-invariant kernels, whose steps keep their own bucket's bits."""
        if self.runner.deterministic:
            return None
        if key in self._covers:  # a busy node meets the same keys step after step
            return self._covers[key]
        fits = [k for k in self.graphs if k.tokens >= key.tokens and k.rows >= key.rows and k.max_q >= key.max_q
                and (k.all_greedy, k.needs_filter, k.fresh, k.constrained)
                == (key.all_greedy, key.needs_filter, key.fresh, key.constrained)
                and (key.top_logprobs is None or k.top_logprobs == key.top_logprobs)]
        found = min(fits, key=lambda k: (k.tokens, k.rows, k.max_q, k.top_logprobs is not None), default=None)
        self._covers[key] = found
        return found

    def capture_deferred(self, max_model_len: int) -> bool:
        """Capture one key a deferred step ran eagerly (`capture_key`); False when none is pending."""
        while self.pending:
            key = self.pending.pop(0)
            if key not in self.graphs and self.capture_key(key, max_model_len):
                return True
        return False

    def capture_key(self, key: PrefillKey, max_model_len: int) -> bool:
        """Capture `key`'s graph over dummy prompts (each at most `max_model_len` tokens) that write
        only the trash block (engine/runner/dummy_prompts.py); False when none makes it (it stays
        eager). Only between steps: the capture overwrites the inputs' buffers."""
        free = dataclasses.replace(key, constrained=False)  # dummy prompts have no grammar: the mask rows do
        chunks = chunks_for_key(free, self.token_buckets, self.row_buckets, max_model_len)
        if chunks is None or self.key(chunks) != free:
            log.info("prefill graph key %s: no dummy step makes it; it stays eager", key)
            return False
        inp = self._inputs(key)
        inp.fill_no_sync(chunks)
        if key.constrained:  # the mask rows a live step filled have the width; all allowed now
            assert inp.token_mask is not None
            inp.fill_mask_no_sync(None, inp.token_mask.shape[1])
        self._capture(key, inp)
        return True

    def _inputs(self, key: PrefillKey) -> PrefillInputs:
        inp = self.inputs.get((key.tokens, key.rows))
        if inp is None:
            inp = PrefillInputs(key.tokens, key.rows, self.runner.max_blocks, self.runner.device)
            self.inputs[(key.tokens, key.rows)] = inp
        return inp

    def _capture(self, key: PrefillKey, inp: PrefillInputs, with_events: bool = False) -> None:
        """Capture `key`'s graph over `inp`. `with_events` records an external event per layer
        (nothing serving waits on them)."""
        r = self.runner
        side = torch.cuda.Stream(r.device)
        side.wait_stream(torch.cuda.current_stream(r.device))
        with torch.cuda.stream(side), torch.no_grad(), self._kernel_mode():
            prefill_forward(r, inp, key)  # warm-up: compiles kernels (the same writes the replay makes)
        torch.cuda.current_stream(r.device).wait_stream(side)
        events = [torch.cuda.Event(external=True) for _ in range(r.num_target_layers if with_events else 0)]
        graph, tail = torch.cuda.CUDAGraph(), None
        with capturing(graph, self.pool), self._kernel_mode():
            head, out = prefill_head(r, inp, key, on_layer=(lambda i: events[i].record()) if with_events else None)
        self.pool = graph.pool()
        if r.k:  # the MTP layer and drafts: a graph of their own, so the first tokens can leave before them
            tail = torch.cuda.CUDAGraph()
            with capturing(tail, self.pool), self._kernel_mode():
                prefill_tail(r, inp, key, head, out)
        self.graphs[key] = (graph, tail, out, events)
        self.shapes.add(key.shape)
        self._covers.clear()  # a smaller graph may hold some keys now

    def _kernel_mode(self) -> AbstractContextManager[None]:
        """The runner's kernel mode (batch-invariant with `--deterministic`). The runner's own
        `prefill` sets it, but the warm-up and idle captures call in from outside: a graph they
        captured without it ran the ordinary kernels, and a deterministic service's tokens left
        the reference (the mode is resolved at capture and baked into the graph)."""
        return batch_invariant(self.runner.deterministic)
