"""ColocatedNode: one engine that prefills and decodes its own requests (no KV transfer).

Receives, from the router, whole requests (`submit`: the prompt's token ids and the resolved
sampling) and aborts. Admission is the decode node's: a slot and KV blocks for the request's
whole life (its prompt's longest cached prefix shared when `enable_prefix_caching`), or a
refusal, on which the router queues. The prompt then waits in the single-process engine's
ChunkedPrefill (engine/sched/chunked_prefill.py). Each loop round runs one prefill step, at most
`max_num_batched_tokens` prompt tokens (a longer prompt is cut into chunks that later rounds
continue), and then one overlapped decode step of the running batch (DecodeBatch: MTP, the
decode step's CUDA graphs), so a running request waits at most one chunk between two of its
steps. A prompt that completes is inserted into the batch with its first token and drafts.

Hands on output items as a decode node does, the first token included as an ordinary item
(with its logprobs), and exactly one terminal item per admitted request, to every subscriber
of the output stream. Everything else is DecodeNode's: one loop thread owns the batch, the
runner, the block manager and the prefill queue; other threads only enqueue; a router's
requests are dropped when its last output stream ends ("Owners"); nothing is ever pending a
KV transfer here.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from typing import Any

import torch

from decode_node.commands import Submit
from decode_node.node import DecodeNode, Reservation
from engine.engine import EngineConfig
from engine.model.loader import LoadedModel
from engine.request import Request
from engine.runner.model_runner import kv_room_needed
from engine.sampling.sampling_params import SamplingParams
from engine.sched.chunked_prefill import ChunkedPrefill, Launched
from engine.tp.tensor_parallel import TPGroup
from protos.messages import OutputItem

log = logging.getLogger(__name__)


class ColocatedNode(DecodeNode):
    loop_name = "colocated-loop"
    prefills = True

    def __init__(self, loaded: LoadedModel, config: EngineConfig, tp: TPGroup | None = None) -> None:
        if tp is not None and tp.size > 1:
            raise ValueError("a colocated node runs on one device (tensor parallelism is not supported for it yet)")
        super().__init__(loaded, config, kv_backend=None)
        self.prefill = ChunkedPrefill(self.runner, self.prefix, self.batch, config.max_num_batched_tokens)
        self.counters = {"prefill_tokens": 0, "prefill_seconds": 0.0}
        self.prefill_steps = 0  # loop rounds that ran a prefill chunk (tests: interleaving)
        # request id -> [admitted, first chunk launched] (monotonic): the first item's queue and compute
        # time, which the router lays on the request's TTFT (router/ttft.py); loop thread only
        self._ttft: dict[str, list[float]] = {}

    # ---- any thread ------------------------------------------------------------------
    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int,
               stop_ids: tuple[int, ...]) -> concurrent.futures.Future:
        """Ask the loop to admit a whole request; the future gives a Reservation (no descriptor).
        A structured-output spec is compiled here, off the loop (engine/grammar/compiler.py)."""
        if self.runner.grammar is not None:
            self.runner.grammar.precompile(params.structured)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Submit(request_id, list(prompt), params, seed, stop_ids, fut))
        self.wake()
        return fut

    def status(self) -> dict[str, Any]:
        waiting = list(self.prefill.requests)  # a copy: the loop thread changes the list
        return {**super().status(), "queued_tokens": sum(len(r.prompt) - r.num_prefilled for r in waiting),
                **self.counters}

    # ---- the loop thread -------------------------------------------------------------
    def step(self) -> bool:
        """Commands, one prefill step (if a prompt waits), one decode step. Loop thread only. The
        prefill is queued first and read after the decode step is queued behind it, so the device
        never waits for this thread's reading of first tokens; the prompts it completes join the
        batch at its next launch."""
        items: list[OutputItem] = []
        self._drain_inbox(items)
        prefilled = bool(self.prefill.requests)
        launched = self._prefill_launch(items) if prefilled else None
        busy = self.batch.busy
        outputs = self.batch.step()
        self._count_accepted(outputs)
        items += [self._item(o) for o in outputs]
        if launched is not None:
            items += self._prefill_finish(*launched)
        self._publish(items)
        return self.captures.busy() if busy or prefilled or items else self.captures.idle()

    def _prefill_launch(self, items: list[OutputItem]) -> tuple[Launched, float] | None:
        chunks, reqs = self.prefill.schedule()
        now = time.monotonic()
        for req in reqs:
            marks = self._ttft.get(req.request_id)
            if marks is not None and len(marks) == 1:
                marks.append(now)
        start = time.perf_counter()
        try:
            launched = self.prefill.launch(chunks, reqs, inserted_late=True)
        except torch.AcceleratorError:  # the device is unusable: the loop ends (engine/sched/step_loop.py)
            raise
        except Exception as e:  # a failed step fails its requests; the node keeps serving
            self._prefill_failed(reqs, e, items)
            return None
        self.prefill_steps += 1
        self.counters["prefill_tokens"] += sum(c.end - c.start for c in chunks)
        return launched, time.perf_counter() - start

    def _prefill_finish(self, launched: Launched, spent: float) -> list[OutputItem]:
        start = time.perf_counter()
        items: list[OutputItem] = []
        try:
            outputs = self.prefill.finish(launched)
        except torch.AcceleratorError:
            raise
        except Exception as e:
            self._prefill_failed(launched.reqs, e, items)
            return items
        self.counters["prefill_seconds"] += spent + time.perf_counter() - start
        computed, items = time.monotonic(), [self._item(o) for o in outputs]
        for item in items:
            marks = self._ttft.pop(item.request_id, None) if item.tokens and not item.index else None
            if marks is not None and len(marks) == 2:
                item.queue_s, item.compute_s = marks[1] - marks[0], computed - marks[1]
        return items

    def _prefill_failed(self, reqs: list[Request], e: Exception, items: list[OutputItem]) -> None:
        log.exception("colocated prefill step failed")
        for req in reqs:
            items.append(OutputItem(req.request_id, [], error=f"prefill failed: {e}"))
            self._end(req, "error")

    def _submit(self, rid: str, prompt: list[int], params: SamplingParams, seed: int,
                stop_ids: tuple[int, ...]) -> Reservation:
        refusal = self._refusal(rid, len(prompt), prompt) or ("" if prompt else "the prompt is empty")
        if refusal:
            return Reservation(False, refusal)
        max_tokens = min(params.max_tokens, self.max_model_len - len(prompt))
        need = self.blocks.blocks_for(kv_room_needed(len(prompt) + max_tokens, self.k))
        if need > self.blocks.capacity:
            return self.never_fits(need)
        req = Request(rid, prompt, params, seed, stop_ids, max_tokens)
        hit = self._admit_group(req, prompt, need)
        if hit is None:
            return Reservation(False, f"colocated node full ({self.blocks.num_free} free blocks, need {need} "
                                      f"for each of {params.n} choices)")
        req.num_prefilled = req.num_cached_tokens = hit  # prefill starts after the cached prefix
        self.prefill.add(req)
        self._ttft[rid] = [time.monotonic()]
        return Reservation(True)

    def _end(self, req: Request, reason: str) -> None:
        self.prefill.drop(req)  # ended before (or while) its prompt was computed
        self._ttft.pop(req.request_id, None)
        super()._end(req, reason)
