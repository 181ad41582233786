"""A request's time to first token, split into the parts it is made of.

Receives, from the front doors, the lifecycle, placement and the stream, one `lap` at the end of
each stretch of a request's way to its first token (`Timeline` lists them in order); hands
metrics.py the parts' durations once the first token is written to the client. Every stretch of
time between the door's receipt and that write is charged to exactly one part, on the router's
one clock, so the parts add up to the request's server-side TTFT: a lap charges everything since
the previous lap. The prefill node's queue and compute come from that node as durations (never
clock readings of another host) with its first token; `split_window` fits them into the router's
own measurement of the call that carried them, so a bad or late figure from the network can move
time between parts but never change their sum. Where two things ran at once (with
`overlap_reserve`, the Reserve alongside the Prefill request), the part on the critical path is the
request: the first token does not wait for the reservation's hand-off to the prefill node. Never
blocks, never talks to a node.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

PARTS = ("parse", "tokenize", "queue", "reserve", "prefill_queue", "prefill", "return", "write")
"""In request order. parse: the HTTP body read and parsed (gRPC: the handler's start); tokenize:
the chat template, validation and tokenization; queue: waiting for a decode node to admit the
request (the router's queue, the driver's start); reserve: the Reserve calls on decode nodes
(Submit on a colocated one); prefill_queue and prefill: the prefill (or colocated) node's queue
and compute, as it measured them; return: the rest of the prefill call, the first token's way
back included; write: from the first token's arrival at the router to its write to the client
(detokenizing, the SSE or gRPC frame)."""


@dataclass
class Timeline:
    """One request's laps on the router's monotonic clock, from the door's receipt."""

    start: float = field(default_factory=time.monotonic)
    parts: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PARTS, 0.0))
    last: float = -1.0
    written: bool = False  # the first token went out: no more laps

    def __post_init__(self) -> None:
        if self.last < 0:
            self.last = self.start

    def lap(self, part: str, now: float | None = None) -> float:
        """Charge the time since the previous lap to `part`; returns now."""
        now = time.monotonic() if now is None else now
        if not self.written:
            self.parts[part] += now - self.last
            self.last = now
        return now

    def prefill_window(self, queue_s: float | None, compute_s: float | None, end: float | None = None) -> None:
        """A prefill call opened at the previous lap brought its first token at `end` (default: now):
        charge its node's queue and compute as the node reported them (None: not reported) and the
        rest of the call to return."""
        end = time.monotonic() if end is None else end
        if self.written or end < self.last:
            return
        queue, prefill, back = split_window(end - self.last, queue_s or 0.0, compute_s or 0.0)
        self.parts["prefill_queue"] += queue
        self.parts["prefill"] += prefill
        self.parts["return"] += back
        self.last = end

    @property
    def total(self) -> float:
        return self.last - self.start


def split_window(window: float, queue_s: float, compute_s: float) -> tuple[float, float, float]:
    """A wait of `window` seconds for a first token that its node queued `queue_s` then computed
    `compute_s`: the queue, the compute and the rest (the way there and back), which add up to
    `window`. The node's figures are cut to the window, its queue first: two hosts' clocks tick at
    slightly different rates, a figure from the network may be anything, and a colocated node's
    queue starts inside its Submit call (charged to reserve) while the reply travels back."""
    compute = min(max(compute_s, 0.0), window)
    queue = min(max(queue_s, 0.0), window - compute)
    return queue, compute, max(0.0, window - queue - compute)  # >= 0 past float rounding too
