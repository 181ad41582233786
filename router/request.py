"""One request's router-side state and the messages its client stream carries.

Receives the prepared request, then token batches (P's first token, D's output items);
hands the gRPC handler `GenerateResponse`s through `out`, ending with exactly one terminal
message. The terminal guarantee lives here: `finish`/`fail` close the request once; later
calls are no-ops, and nothing is emitted after the terminal message.

Who owns what: the lifecycle (router.py) drives the request and is the only writer of the
placement fields (`decode`, `prefill`, `node_rid`, `decode_live`, `lost`); the NodePool's
output reader only appends to `events`; anyone may `interrupt` (client abort, router stop) or
`lose` the decode node (it failed: the lifecycle moves the request elsewhere, `migrate`).

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
    out: asyncio.Queue[pb.GenerateResponse] = field(default_factory=asyncio.Queue)
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
    choices: list[Choice] = field(default_factory=list)
    steps: int = 0
    accepted: int = 0
    terminal: str | None = None  # "finished:<reason>", "error:<code>", "cancelled"
    arrival: float = field(default_factory=time.monotonic)  # for latency metrics
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
        return sum(len(c.tokens) for c in self.choices)

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
        that choice is complete by the router's own rules (stop string, or max_tokens reached)."""
        ch = self.choices[index]
        msg = pb.GenerateResponse(request_id=self.request_id, index=index)
        for i, tok in enumerate(tokens):
            if len(ch.tokens) >= self.prep.max_tokens:
                break
            ch.tokens.append(tok)
            msg.token_ids.append(tok)
            msg.text += ch.text.add(tok)
            if logprobs is not None:
                msg.logprobs.append(pb.TokenLogprob(
                    token_id=tok, logprob=logprobs.logprob[i], rank=logprobs.rank[i],
                    top_ids=logprobs.top_ids[i], top_logprobs=logprobs.top_logprobs[i]))
            if ch.text.stopped:
                break
        if msg.token_ids:
            self._emit(msg)
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

    def _emit(self, msg: pb.GenerateResponse, last: bool = False) -> None:
        assert not self.done or last, "nothing after the terminal message"
        if not self._first_sent:
            msg.prompt_token_ids.extend(self.prep.prompt_ids)
            msg.prompt_logprobs.extend(self.prompt_logprobs)
            self._first_sent = True
        self.out.put_nowait(msg)


def is_terminal(msg: pb.GenerateResponse) -> bool:
    return msg.HasField("finished") or msg.HasField("error")
