"""One request's router-side state and the messages its client stream carries.

Receives the prepared request, then token batches (P's first token, D's output items);
hands the gRPC handler `GenerateResponse`s through `out`, ending with exactly one terminal
message. The terminal guarantee lives here: `finish`/`fail` close the request once; later
calls are no-ops, and nothing is emitted after the terminal message.

Who owns what: the request's driver (router.py) is the only writer of the placement fields
(`decode`, `prefill`, `node_rid`, `decode_live`, `lost`), through holds.py; the NodePool's
output reader only appends to `events`, or hands an item to `sink` (the stream's, set while the
driver waits for one: the same handling, in the reader's task); anyone may `interrupt` (client
abort, router stop) or `lose` the decode node (it failed: the driver moves the request elsewhere, migration.py).

Batching: a request's messages wait in its `Outbox` until its door takes them; tokens that arrive
while a token message still waits there join that message, so a client that falls behind (the
router at saturation) gets several steps' tokens in one message (one SSE event), not a backlog of
small ones. The terminal message is never merged; order and the one-terminal rule hold.

A migrated attempt resumes: its prompt is the original one plus every token already streamed
(`resume_prompt`) and its max_tokens what is left (`resume_sampling`), so the client sees each
token once and max_tokens counts what was emitted before the move.

n > 1: one `Choice` per index, each with its own tokens, text and stop strings. A choice ends
with a message that sets `finish_reason` and `index`; the one that ends the last choice also
carries the request's terminal `finished` (usage counts every choice's tokens). With n = 1 that
is the one terminal message, as always. Such a request moves to another node only while no
token has been streamed (its choices' prompts would differ).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from protos import node_pb2
from protos import pdserve_pb2 as pb
from protos.messages import OutputItem, TokenLogprobs
from router.detokenize import TextStream
from router.ttft import Timeline
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


class PlainLogprobs:
    """A message's tokens' logprobs while none has top-N alternatives (what most streams carry),
    as columns beside the message rather than one TokenLogprob each in it: building and reading
    those protos was a large part of a streamed token's cost. `into` writes them into the message,
    as `add_tokens` would have (a proto's logprob is a float32: `logprobs` hold them as such)."""

    __slots__ = ("token_ids", "logprobs", "ranks")

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.ranks: list[int] = []

    def extend(self, tokens: list[int], logprobs: TokenLogprobs) -> None:
        n = min(len(tokens), len(logprobs.logprob), len(logprobs.rank))  # as zip pairs them
        self.token_ids += tokens[:n]
        self.logprobs += array("f", logprobs.logprob[:n]).tolist()
        self.ranks += logprobs.rank[:n]

    def into(self, msg: pb.GenerateResponse) -> None:
        add = msg.logprobs.add
        for tok, lp, rank in zip(self.token_ids, self.logprobs, self.ranks, strict=True):
            add(token_id=tok, logprob=lp, rank=rank)


class Outbox:
    """A request's messages to its client, in order, for one reader (`get`). `open_tail` hands the
    last waiting message when it may still grow: a token message put `open` (not the first one,
    whose arrival is the time to first token; never a terminal one). A waiting message's plain
    logprobs (`plain_of`) go into it when it is taken, unless the reader `keeps_plain`: then the
    last message taken leaves them in `taken_plain` (router/http.py's event stream writes them)."""

    def __init__(self) -> None:
        self._msgs: deque[pb.GenerateResponse] = deque()
        self._open = False  # the last message in _msgs may take more tokens
        self._waiter: asyncio.Future[None] | None = None
        self._plain: dict[int, PlainLogprobs] = {}  # by id() of a message in _msgs (alive while there)
        self.keeps_plain = False
        self.taken_plain: PlainLogprobs | None = None

    def put(self, msg: pb.GenerateResponse, open_: bool = False) -> None:
        self._msgs.append(msg)
        self._open = open_ and not is_terminal(msg)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def open_tail(self) -> pb.GenerateResponse | None:
        return self._msgs[-1] if self._open and self._msgs else None

    def plain_of(self, msg: pb.GenerateResponse, create: bool = False) -> PlainLogprobs | None:
        """`msg`'s plain logprobs (a message waiting here); `create`: new ones if none."""
        plain = self._plain.get(id(msg))
        if plain is None and create:
            plain = self._plain[id(msg)] = PlainLogprobs()
        return plain

    def pop_plain(self, msg: pb.GenerateResponse) -> PlainLogprobs | None:
        return self._plain.pop(id(msg), None) if self._plain else None

    async def get(self) -> pb.GenerateResponse:
        while not self._msgs:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        if len(self._msgs) == 1:
            self._open = False  # taken: it can no longer grow
        msg = self._msgs.popleft()
        plain = self.pop_plain(msg)
        if self.keeps_plain:
            self.taken_plain = plain
        elif plain is not None:
            plain.into(msg)
        return msg

    def qsize(self) -> int:
        return len(self._msgs)

    def empty(self) -> bool:
        return not self._msgs


@dataclass(frozen=True)
class Wake:
    """Wakes a request's driver waiting on `events` once its `sink` took an item that ended the
    request (`error` None) or raised `error` (raised in the driver, as if it had read the item)."""

    error: Exception | None = None


@dataclass
class Choice:
    """One choice's router-side state (n > 1 requests have several)."""

    index: int
    text: TextStream
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # set once the client has been told it ended
    node_done: bool = False  # the node ended it (its terminal came, or it will send none)

    @property
    def stop_reason(self) -> str:
        return "stop" if self.text.stopped else "length"


@dataclass
class RequestState:
    prep: Prepared
    tokenizer: Any
    out: Outbox = field(default_factory=Outbox)
    # the decode node's items; `lose` queues the placement's `lost` behind them (router/stream.py)
    events: asyncio.Queue[OutputItem | asyncio.Future[str] | Wake] = field(default_factory=asyncio.Queue)
    # set while the driver waits on `events` with none queued: the node's items go straight to it
    # (router/stream.py), not through the queue and a wake-up of the driver per item
    sink: Callable[[OutputItem], None] | None = None
    task: asyncio.Task[None] | None = None
    interrupt_reason: Interrupt | None = None
    # placement (written by the lifecycle only)
    node_rid: str = ""  # the id P and D know this attempt by
    decode: Node | None = None  # holds a reservation for this request
    decode_live: bool = False  # D may still hold it (no terminal from D yet)
    prefill: Node | None = None  # a Prefill request is outstanding there
    prefill_work: int = 0  # prompt tokens the policy expects it to compute (its inflight_tokens share)
    lost: asyncio.Future[str] | None = None  # set (a reason) when `decode` fails; one per placement
    attempt: int = 0  # placements tried (node-side ids carry it)
    migrations: int = 0  # times moved to another decode node
    moved_from: str = ""  # why it last moved (named in an error that ends it while moving)
    # results
    choices: list[Choice] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0
    cached_tokens: int = 0  # prompt tokens the node served from its prefix cache (usage)
    terminal: str | None = None  # "finished:<reason>", "error:<code>", "cancelled"
    arrival: float = field(default_factory=time.monotonic)  # for latency metrics
    timeline: Timeline = field(default_factory=Timeline)  # the TTFT's parts (router/ttft.py), from the door's receipt
    last_token_at: float | None = None  # when the last token went out (metrics.py writes it)
    prompt_logprobs: list[pb.TokenLogprob] = field(default_factory=list)  # go out with the first message
    _first_sent: bool = False

    def __post_init__(self) -> None:
        n = max(1, self.prep.sampling.n)
        self.choices = [Choice(i, TextStream(self.tokenizer, self.prep.stop)) for i in range(n)]

    @property
    def request_id(self) -> str:
        return self.prep.request_id

    @property
    def tokens(self) -> list[int]:
        """Choice 0's tokens (the only ones of an n = 1 request)."""
        return self.choices[0].tokens

    @property
    def text(self) -> TextStream:
        return self.choices[0].text

    @property
    def num_tokens(self) -> int:
        ch = self.choices
        return len(ch[0].tokens) if len(ch) == 1 else sum(len(c.tokens) for c in ch)

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
        """The decode node of this placement failed: wake the lifecycle to move the request (a
        wait through `unless_lost`, and the stream's reader once it has read every item before)."""
        if self.lost is not None and not self.lost.done():
            self.lost.set_result(reason)
            self.events.put_nowait(self.lost)

    # ---- what a (re)placement sends -----------------------------------------------------
    def resume_prompt(self) -> list[int]:
        """The prompt to prefill: the client's, then every token it has already been sent."""
        return self.prep.prompt_ids + self.tokens

    def resume_sampling(self) -> node_pb2.Sampling:
        """The request's sampling, max_tokens less the tokens already sent (same seed: the
        noise behind a token depends on its position, not on which node draws it), which the
        penalties count as output (`resumed_tokens`)."""
        if not self.tokens:
            return self.prep.sampling
        s = node_pb2.Sampling()
        s.CopyFrom(self.prep.sampling)
        s.max_tokens -= len(self.tokens)
        s.resumed_tokens = len(self.tokens)  # penalties count them as output
        s.prompt_logprobs = -1  # sent with the first token already
        return s

    # ---- emitting -----------------------------------------------------------------------
    def set_prompt_logprobs(self, lps: TokenLogprobs | None) -> None:
        """The prompt's logprobs from the node (asked or not: a node sends them only when asked)
        for the first message; raises RequestError when they are not one per prompt token after
        the first."""
        if lps is None or self._first_sent:
            return
        ids = self.prep.prompt_ids
        if len(lps.logprob) != len(ids) - 1:
            raise RequestError("INTERNAL", f"a node sent {len(lps.logprob)} prompt logprobs for a prompt "
                                           f"of {len(ids)} tokens")
        self.prompt_logprobs = [pb.TokenLogprob(token_id=t, logprob=lp, rank=r, top_ids=i, top_logprobs=v)
                                for t, lp, r, i, v in zip(ids[1:], lps.logprob, lps.rank, lps.top_ids,
                                                          lps.top_logprobs, strict=True)]

    def add_tokens(self, tokens: list[int], logprobs: TokenLogprobs | None, index: int = 0) -> bool:
        """Stream `tokens` of choice `index` (cut at a stop string or at max_tokens); True when
        that choice is complete by the router's own rules (stop string, or max_tokens reached).
        They join the token message still waiting in `out` when it is the same choice's (a new
        one otherwise: choices never share a message)."""
        ch = self.choices[index]
        tokens = tokens[: max(0, self.prep.max_tokens - len(ch.tokens))]
        if not tokens:
            return ch.text.stopped or len(ch.tokens) >= self.prep.max_tokens
        if ch.text.stop:  # token by token: the stop string may end inside this batch
            tokens, text = _add_until_stop(ch.text, tokens)
        else:
            text = ch.text.add_many(tokens)
        tail = self.out.open_tail()
        if tail is not None and tail.index != index:
            tail = None  # another choice's message: never merged into
        msg = tail if tail is not None else pb.GenerateResponse(request_id=self.request_id, index=index)
        ch.tokens += tokens
        msg.token_ids.extend(tokens)
        msg.text += text
        if msg is not tail:  # put first: the outbox keeps plain logprobs only for its own messages
            self._emit(msg, open_=True)
        if logprobs is not None:
            _add_logprobs(self.out, msg, tokens, logprobs)
        return ch.text.stopped or len(ch.tokens) >= self.prep.max_tokens

    @property
    def stop_reason(self) -> str:
        return self.choices[0].stop_reason

    def finish_choice(self, index: int, reason: str) -> None:
        """End choice `index` (its last text, `finish_reason`); the last choice to end also ends
        the request (`finished`, usage over every choice)."""
        ch = self.choices[index]
        if self.done or ch.finish_reason is not None:
            return
        ch.finish_reason = reason
        msg = pb.GenerateResponse(request_id=self.request_id, text=ch.text.finish(), index=index,
                                  finish_reason=reason)
        if all(c.finish_reason is not None for c in self.choices):
            msg.finished.reason = reason
            u = msg.finished.usage
            u.prompt_tokens, u.completion_tokens = len(self.prep.prompt_ids), self.num_tokens
            u.decode_steps, u.accepted_draft_tokens = self.steps, self.accepted
            u.cached_tokens = min(self.cached_tokens, u.prompt_tokens)
            self.terminal = f"finished:{reason}"
        self._emit(msg, last=self.terminal is not None)

    def finish(self, reason: str) -> None:
        """End every choice not ended yet with `reason` (the request with it)."""
        for ch in self.choices:
            self.finish_choice(ch.index, reason)

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

    def _emit(self, msg: pb.GenerateResponse, last: bool = False, open_: bool = False) -> None:
        """Queue `msg`; `open_`: a token message that later tokens of its choice may join (never
        the first message: it carries the prompt and its logprobs, and its arrival is the time to
        first token)."""
        assert not self.done or last, "nothing after the terminal message"
        first = not self._first_sent
        if first:
            msg.prompt_token_ids.extend(self.prep.prompt_ids)
            msg.prompt_logprobs.extend(self.prompt_logprobs)
            self._first_sent = True
        self.out.put(msg, open_=open_ and not first)


def _add_logprobs(out: Outbox, msg: pb.GenerateResponse, tokens: list[int], logprobs: TokenLogprobs) -> None:
    """`tokens`' logprobs (the first len(tokens) of `logprobs`' rows): without top-N alternatives
    (`logprobs=0`, what most streams ask), as `msg`'s plain columns while it has no TokenLogprob
    (Outbox.plain_of); else one TokenLogprob per token, after the plain ones put in first."""
    if not any(logprobs.top_ids):
        plain = out.plain_of(msg, create=not msg.logprobs)
        if plain is not None:
            plain.extend(tokens, logprobs)
            return
    elif (plain := out.pop_plain(msg)) is not None:
        plain.into(msg)
    add = msg.logprobs.add
    if not any(logprobs.top_ids):  # protobuf's keyword path costs per field, even an empty one
        for tok, lp, rank in zip(tokens, logprobs.logprob, logprobs.rank, strict=False):
            add(token_id=tok, logprob=lp, rank=rank)
        return
    for i, tok in enumerate(tokens):
        add(token_id=tok, logprob=logprobs.logprob[i], rank=logprobs.rank[i], top_ids=logprobs.top_ids[i],
            top_logprobs=logprobs.top_logprobs[i])


def _add_until_stop(text: TextStream, tokens: list[int]) -> tuple[list[int], str]:
    """Feed `tokens` to `text` one by one up to the one that completes a stop string."""
    out = ""
    for n, tok in enumerate(tokens, 1):
        out += text.add(tok)
        if text.stopped:
            return tokens[:n], out
    return tokens, out


def is_terminal(msg: pb.GenerateResponse) -> bool:
    return msg.HasField("finished") or msg.HasField("error")
