"""Fault injection for KV transfers (fault drills and `pdserve bench chaos` only).

`with_faults(sender, faults)` makes a real sender's links misbehave on the way out: each
control message or data run is, with the given probabilities, dropped, delayed, duplicated
or (data runs) truncated, then handed to the real transport. The receiver must turn every one
of these into a failed transfer (never a block written with the wrong bytes), the decode node
into an error item for its request, and the router into a migration. Nothing here runs unless
`kv_transfer.faults` sets a probability above 0.

`truncate` is a tcp drill: a stream cut inside a run is what a lost connection does there.
UCX delivers a tagged message whole or not at all, so on ucx a short run is a sender bug, not a
wire fault, and the ucxx API gives a receiver no received length to check it by: a short run
would land short, in its own request's blocks only. Drills on ucx leave `truncate` at 0.

Careful: the links are patched in place (their `send_ctrl`/`send_run`), not wrapped, because
transports recognise a lost link by identity (`_on_link_lost`).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from kvtransfer.base import KVSender
from kvtransfer.sender import Link

KINDS = ("drop", "delay", "duplicate", "truncate")


class Faults:
    """Per-message probabilities of each fault, a delay bound, and what was injected."""

    def __init__(self, drop: float = 0.0, delay: float = 0.0, duplicate: float = 0.0, truncate: float = 0.0,
                 delay_s: float = 0.05, seed: int | None = None) -> None:
        self.p = {"drop": drop, "delay": delay, "duplicate": duplicate, "truncate": truncate}
        if any(not 0 <= v <= 1 for v in self.p.values()) or sum(self.p.values()) > 1:
            raise ValueError(f"fault probabilities must be in [0, 1] and sum to at most 1, got {self.p}")
        self.delay_s = delay_s
        self.rng = random.Random(seed)
        self.injected: Counter[str] = Counter()

    @property
    def any(self) -> bool:
        return any(self.p.values())

    def pick(self, data: bool) -> str | None:
        """The fault for the next message (truncation only for data runs), or None."""
        x, edge = self.rng.random(), 0.0
        for kind in KINDS:
            edge += self.p[kind]
            if x < edge:
                if kind == "truncate" and not data:
                    return None
                self.injected[kind] += 1
                return kind
        return None


def with_faults(sender: KVSender, faults: Faults) -> KVSender:
    """`sender` with every link it opens patched to inject `faults`."""
    opener: Callable[[Any], Awaitable[Link]] = sender._open  # type: ignore[attr-defined]

    async def open_faulty(desc: Any) -> Link:
        link = await opener(desc)
        if not getattr(link, "_faults_installed", False):
            _install(link, faults)
        return link

    setattr(sender, "_open", open_faulty)  # noqa: B010 (an instance attribute over the method)
    return sender


def _install(link: Link, faults: Faults) -> None:
    send_ctrl, send_run = link.send_ctrl, link.send_run

    def faulty_ctrl(msg: dict[str, Any]) -> Any:
        kind = faults.pick(data=False)
        if kind == "drop":
            return _done()
        if kind == "delay":
            return _later(faults.delay_s * faults.rng.random(), lambda: send_ctrl(msg))
        if kind == "duplicate":
            return _both(send_ctrl(msg), send_ctrl(msg))
        return send_ctrl(msg)

    def faulty_run(desc: Any, layer: int, run: int, views: list[Any], announced: bool, sent: Any = None) -> Any:
        kind = faults.pick(data=True)
        if kind == "drop":
            if sent is not None:
                sent(None)  # a posted send "completed": the receiver just never gets it
            return _done() if sent is None else None
        if kind == "truncate":
            views = _truncated(views)
        if kind == "delay":
            return _later(faults.delay_s * faults.rng.random(),
                          lambda: send_run(desc, layer, run, views, announced, sent))
        if kind == "duplicate":
            return _both(send_run(desc, layer, run, views, announced, None),
                         send_run(desc, layer, run, views, announced, sent))
        return send_run(desc, layer, run, views, announced, sent)

    setattr(link, "send_ctrl", faulty_ctrl)  # noqa: B010
    setattr(link, "send_run", faulty_run)  # noqa: B010
    setattr(link, "_faults_installed", True)  # noqa: B010


def _truncated(views: list[Any]) -> list[Any]:
    """All but the last plane; a single plane cut to half its blocks."""
    if len(views) > 1:
        return views[:-1]
    return [v[: v.shape[0] // 2] for v in views]  # torch (tcp) or numpy (ucx) planes


async def _done() -> int:
    return 1


async def _later(delay_s: float, send: Callable[[], Any]) -> Any:
    await asyncio.sleep(delay_s)
    sent = send()
    return await sent if sent is not None else 1


async def _both(first: Any, second: Any) -> Any:
    """Both sends (coroutines, futures or None for posted ones), in order."""
    if first is not None:
        await first
    return await second if second is not None else 1
