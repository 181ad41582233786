"""SyntheticNode: a test backend that speaks the colocated node's protocol without a model.

For measuring the host path alone (router gRPC stream -> detokenize -> HTTP -> client; `pdserve
bench host`): it admits whole requests (`submit`) as a colocated node does, up to
`max_num_seqs` at once, and every step (at most one per `step_s`) gives each running request
`tokens_per_step` new tokens (default k + 1: every draft accepted), the first step its first
token alone, as one output batch per step to every subscriber, exactly as the real node's loop
publishes. Tokens cycle through the request's own prompt ids (real text for the detokenizer),
with logprob columns when asked (-0.5, rank 1, top ids counting up). A request ends with one
terminal item at its max_tokens (EOS and stop ids are never produced), or "abort".

Never computes anything: it is not a model and makes no claim about one. It runs behind the real
servicer (decode_node/server.py, ColocatedServicer) and shares the decode node's commands
(decode_node/commands.py) and output streams with their owners rule (decode_node/streams.py: a
router's requests are dropped when its last output stream ends).
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from dataclasses import dataclass, field
from typing import Any, assert_never

from decode_node.commands import Abort, Command, First, OwnerBack, OwnerGone, Reserve, Submit
from decode_node.node import Reservation
from decode_node.streams import OutputStreams, Stream, owner_of
from engine.sampling.sampling_params import SamplingParams
from engine.sched.step_loop import StepLoop, drained
from protos.messages import OutputItem, TokenLogprobs


@dataclass
class _Running:
    prompt: list[int]
    max_tokens: int
    logprobs: int | None
    sent: int = 0
    steps: int = 0
    accepted: int = 0
    pieces: list[int] = field(default_factory=list)


class SyntheticNode(StepLoop):
    loop_name = "synthetic-loop"

    def __init__(self, vocab: int, k: int = 3, max_num_seqs: int = 256, step_s: float = 0.003,
                 tokens_per_step: int | None = None) -> None:
        super().__init__()
        self.vocab, self.k, self.max_num_seqs, self.step_s = vocab, k, max_num_seqs, step_s
        self.tokens_per_step = tokens_per_step or k + 1
        self.requests: dict[str, _Running] = {}
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.streams = OutputStreams(self._inbox)
        self._next_step = 0.0
        self.steps = 0  # steps that published a batch
        self.tokens = 0  # tokens published

    # ---- any thread (what ColocatedServicer calls) ---------------------------------------
    def submit(self, request_id: str, prompt: list[int], params: SamplingParams, seed: int,
               stop_ids: tuple[int, ...]) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Submit(request_id, list(prompt), params, seed, stop_ids, fut))
        self.wake()
        return fut

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._inbox.put(Abort(request_id, reason))
        self.wake()

    def subscribe(self, owner: str = "") -> Stream:
        return self.streams.subscribe(owner)

    def unsubscribe(self, q: queue.SimpleQueue, owner: str = "") -> None:
        self.streams.unsubscribe(q, owner)
        self.wake()

    def status(self) -> dict[str, Any]:
        free = self.max_num_seqs - len(self.requests)
        return {"free_blocks": free, "total_blocks": self.max_num_seqs, "running": len(self.requests),
                "queued_tokens": 0}

    def stop(self) -> None:
        self.stop_loop()
        self.streams.close()

    # ---- the loop thread -----------------------------------------------------------------
    def idle_wait_s(self) -> float:
        return max(0.0, self._next_step - time.monotonic()) if self.requests else 0.05

    def step(self) -> bool:
        items: list[OutputItem] = []
        self._drain_inbox(items)
        if self.requests and time.monotonic() >= self._next_step:
            self._next_step = time.monotonic() + self.step_s
            items += [self._advance(rid, r) for rid, r in list(self.requests.items())]
        if items:
            self._publish(items)
        return bool(items) and self.step_s == 0

    def _drain_inbox(self, items: list[OutputItem]) -> None:
        for cmd in drained(self._inbox):
            self._apply(cmd, items)

    def _apply(self, cmd: Command, items: list[OutputItem]) -> None:
        match cmd:
            case Submit():
                cmd.future.set_result(self._admit(cmd.request_id, cmd.prompt, cmd.params))
            case Reserve():  # only whole requests here: no KV ever arrives
                cmd.future.set_result(Reservation(False, "a synthetic node takes whole requests only"))
            case Abort() if cmd.request_id in self.requests:
                r = self.requests.pop(cmd.request_id)
                items.append(OutputItem(cmd.request_id, [], finish_reason="abort", steps=r.steps,
                                        accepted=r.accepted))
            case Abort() | First():
                pass  # an unknown (or ended) request; no first tokens come here
            case OwnerBack():
                self.streams.owner_back(cmd.owner)
            case OwnerGone():
                self.streams.owner_gone(cmd.owner)
                for rid in [r for r in self.requests if owner_of(r) == cmd.owner]:
                    self._inbox.put(Abort(rid, f"its router ({cmd.owner}) is gone"))
            case _:
                assert_never(cmd)

    def _admit(self, rid: str, prompt: list[int], params: SamplingParams) -> Reservation:
        if rid in self.requests or self.streams.refuses(rid) or not prompt:
            return Reservation(False, f"request {rid!r} refused")
        if len(self.requests) >= self.max_num_seqs:
            return Reservation(False, f"synthetic node full ({self.max_num_seqs} requests)")
        self.requests[rid] = _Running(prompt, params.max_tokens, params.logprobs)
        return Reservation(True)

    def _advance(self, rid: str, r: _Running) -> OutputItem:
        n = min(1 if r.sent == 0 else self.tokens_per_step, r.max_tokens - r.sent)
        toks = [r.prompt[(r.sent + i) % len(r.prompt)] for i in range(n)]
        if r.sent:
            r.steps, r.accepted = r.steps + 1, r.accepted + n - 1
        r.sent += n
        self.tokens += n
        lps = None
        if r.logprobs is not None:
            m = r.logprobs
            lps = TokenLogprobs([-0.5] * n, [1] * n, [[(t + j) % self.vocab for j in range(m)] for t in toks],
                                [[-0.5 - j for j in range(m)] for _ in toks])
        item = OutputItem(rid, toks, r.logprobs if lps else None, lps)
        if r.sent >= r.max_tokens:
            item.finish_reason, item.steps, item.accepted = "length", r.steps, r.accepted
            del self.requests[rid]
        return item

    def _publish(self, items: list[OutputItem]) -> None:
        self.steps += 1
        self.streams.publish(items)
