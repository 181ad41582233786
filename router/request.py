"""One request's router-side state and the messages its client stream carries.

Receives the prepared request, then token batches (P's first token, D's output items);
hands the gRPC handler `GenerateResponse`s through `out`, ending with exactly one terminal
message. The terminal guarantee lives here: `finish`/`fail` close the request once; later
calls are no-ops, and nothing is emitted after the terminal message.

Who owns what: the lifecycle (router.py) drives the request and is the only writer of the
placement fields (`decode`, `prefill`, `node_rid`, `decode_live`, `lost`); the NodePool's
output reader only appends to `events`; anyone may `interrupt` (client abort, router stop) or
`lose` the decode node (it failed: the lifecycle moves the request elsewhere, `migrate`).

Batching: a request's messages wait in its `Outbox` until its door takes them; tokens that arrive
while a token message still waits there join that message, so a client that falls behind (the
router at saturation) gets several steps' tokens in one message (one SSE event), not a backlog of
small ones. The terminal message is never merged; order and the one-terminal rule hold.

A migrated attempt resumes: its prompt is the original one plus every token already streamed
(`resume_prompt`) and its max_tokens what is left (`resume_sampling`), so the client sees each
token once and max_tokens counts what was emitted before the move.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protos import node_pb2
from protos import pdserve_pb2 as pb
from protos.messages import OutputItem, TokenLogprobs
from router.detokenize import TextStream
from router.validate import Prepared

if TYPE_CHECKING:
    from router.pool import Node


class RequestError(Exception):
    """Ends a request with a terminal error (a gRPC status code name + message)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class Interrupt:
    """Why a request was stopped from outside its driver: a terminal to send, or none (the
    client went away: there is nobody to send it to)."""

    code: str | None  # None: finished with reason "abort"; "CANCELLED": client gone; else an error
    message: str = ""


class Outbox:
    """A request's messages to its client, in order, for one reader (`get`). `open_tail` hands the
    last waiting message when it may still grow: a token message put `open` (not the first one,
    whose arrival is the time to first token; never a terminal one)."""

    def __init__(self) -> None:
        self._msgs: deque[pb.GenerateResponse] = deque()
        self._open = False  # the last message in _msgs may take more tokens
        self._waiter: asyncio.Future[None] | None = None

    def put(self, msg: pb.GenerateResponse, open_: bool = False) -> None:
        self._msgs.append(msg)
        self._open = open_ and not is_terminal(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def open_tail(self) -> pb.GenerateResponse | None:
        return self._msgs[-1] if self._open and self._msgs else None

    async def get(self) -> pb.GenerateResponse:
        while not self._msgs:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if len(self._msgs) == 1:
            self._open = False  # taken: it can no longer grow
        return self._msgs.popleft()

    def qsize(self) -> int:
        return len(self._msgs)

    def empty(self) -> bool:
        return not self._msgs


@dataclass
class RequestState:
    prep: Prepared
    tokenizer: Any
    out: Outbox = field(default_factory=Outbox)
    events: asyncio.Queue[OutputItem] = field(default_factory=asyncio.Queue)
    task: asyncio.Task[None] | None = None
    interrupt_reason: Interrupt | None = None
    # placement (written by the lifecycle only)
    node_rid: str = ""  # the id P and D know this attempt by
    decode: Node | None = None  # holds a reservation for this request
    decode_live: bool = False  # D may still hold it (no terminal from D yet)
    prefill: Node | None = None  # a Prefill call is outstanding there
    prefill_work: int = 0  # prompt tokens the policy expects it to compute (its inflight_tokens share)
    lost: asyncio.Future[str] | None = None  # set (a reason) when `decode` fails; one per placement
    attempt: int = 0  # placements tried (node-side ids carry it)
    migrations: int = 0  # times moved to another decode node
    moved_from: str = ""  # why it last moved (named in an error that ends it while moving)
    # results
    tokens: list[int] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0
    terminal: str | None = None  # "finished:<reason>", "error:<code>", "cancelled"
    arrival: float = field(default_factory=time.monotonic)  # for latency metrics
    last_token_at: float | None = None  # when the last token went out (metrics.py writes it)
    _first_sent: bool = False

    def __post_init__(self) -> None:
        self.text = TextStream(self.tokenizer, self.prep.stop)

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    @property
    def done(self) -> bool:
        return self.terminal is not None

    def interrupt(self, reason: Interrupt) -> bool:
        """Stop the driver from outside (first reason wins); False when already done."""
        if self.done or self.interrupt_reason is not None:
            return False
        self.interrupt_reason = reason
        if self.task is not None:
            self.task.cancel()
        return True

    def lose(self, reason: str) -> None:
        """The decode node of this placement failed: wake the lifecycle to move the request."""
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(reason)

    # ---- what a (re)placement sends -----------------------------------------------------
    def resume_prompt(self) -> list[int]:
        """The prompt to prefill: the client's, then every token it has already been sent."""
        return self.prep.prompt_ids + self.tokens

    def resume_sampling(self) -> node_pb2.Sampling:
        """The request's sampling, max_tokens less the tokens already sent (same seed: the
        noise behind a token depends on its position, not on which node draws it)."""
        if not self.tokens:
            return self.prep.sampling
        s = node_pb2.Sampling()
        s.CopyFrom(self.prep.sampling)
        s.max_tokens -= len(self.tokens)
        return s

    # ---- emitting -----------------------------------------------------------------------
    def add_tokens(self, tokens: list[int], logprobs: TokenLogprobs | None) -> bool:
        """Stream `tokens` (cut at a stop string or at max_tokens); True when the request is
        complete by the router's own rules (stop string, or max_tokens reached). They join the
        token message still waiting in `out`, if any (a new one otherwise)."""
        tokens = tokens[: max(0, self.prep.max_tokens - len(self.tokens))]
        if not tokens:
            return self.text.stopped or len(self.tokens) >= self.prep.max_tokens
        if self.text.stop:  # token by token: the stop string may end inside this batch
            tokens, text = self._add_until_stop(tokens)
        else:
            text = self.text.add_many(tokens)
        tail = self.out.open_tail()
        msg = tail if tail is not None else pb.GenerateResponse(request_id=self.request_id)
        self.tokens += tokens
        msg.token_ids.extend(tokens)
        msg.text += text
        if logprobs is not None:
            for i, tok in enumerate(tokens):
                msg.logprobs.add(token_id=tok, logprob=logprobs.logprob[i], rank=logprobs.rank[i],
                                 top_ids=logprobs.top_ids[i], top_logprobs=logprobs.top_logprobs[i])
        if msg is not tail:
            self._emit(msg)
        return self.text.stopped or len(self.tokens) >= self.prep.max_tokens

    def _add_until_stop(self, tokens: list[int]) -> tuple[list[int], str]:
        """Feed `tokens` one by one up to the one that completes a stop string."""
        text = ""
        for n, tok in enumerate(tokens, 1):
            text += self.text.add(tok)
            if self.text.stopped:
                return tokens[:n], text
        return tokens, text

    @property
    def stop_reason(self) -> str:
        return "stop" if self.text.stopped else "length"

    def finish(self, reason: str) -> None:
        if self.done:
            return
        msg = pb.GenerateResponse(request_id=self.request_id, text=self.text.finish())
        msg.finished.reason = reason
        u = msg.finished.usage
        u.prompt_tokens, u.completion_tokens = len(self.prep.prompt_ids), len(self.tokens)
        u.decode_steps, u.accepted_draft_tokens = self.steps, self.accepted
        self._emit(msg)
        self.terminal = f"finished:{reason}"

    def fail(self, code: str, message: str) -> None:
        if self.done:
            return
        msg = pb.GenerateResponse(request_id=self.request_id)
        msg.error.code, msg.error.message = code, message
        self._emit(msg)
        self.terminal = f"error:{code}"

    def close_cancelled(self) -> None:
        """The client is gone: end without a message."""
        if not self.done:
            self.terminal = "cancelled"

    def _emit(self, msg: pb.GenerateResponse) -> None:
        assert not self.done, "nothing after the terminal message"
        first = not self._first_sent
        if first:
            msg.prompt_token_ids.extend(self.prep.prompt_ids)
            self._first_sent = True
        self.out.put(msg, open_=not first)


def is_terminal(msg: pb.GenerateResponse) -> bool:
    return msg.HasField("finished") or msg.HasField("error")
