"""The sender's protocol, shared by every transport (prefill side).

Receives: ``start`` / ``send_layer`` / ``finish`` / ``abort`` calls from any thread.
Hands on: per request, on one ``Link`` to the receiver, a ``begin`` message, then
per group of layers a ``layers`` message (their runs) and one data send per layer and run,
then ``finish``; a group is every layer queued at that moment with the same source blocks
(one layer at a time while prefill computes; all at once when they were queued together),
so the receiver handles one announce, not one per layer;
then waits for the receiver's ``ack``. When the receiver pre-posts (``_preposted``: ucx)
it has already prepared every layer over the destination's own runs at ``expect``; layers
whose runs are exactly those (the source is contiguous wherever the destination is: the
usual case) go unannounced, and only the others are announced. Nothing on that path waits for a send to
complete when the link posts sends in order (ucx: ``send_ctrl``/``send_run`` return
futures); a coroutine link (tcp) writes each message before the next.
Never: blocks the caller on the network, or touches source blocks after the lease
ended. Careful: state changes only on the loop thread; the caller's thread reads
it under ``_lock``. A transport subclass provides ``_open`` and ``_reply_info`` and
calls ``_on_message`` / ``_on_link_lost`` from the loop thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer import wire
from kvtransfer.base import (
    Descriptor,
    KVSender,
    ReleaseCallback,
    TransferError,
    TransferState,
    TransferStatus,
)
from kvtransfer.layout import KVLayout, coalesce
from kvtransfer.loop import LoopThread

log = logging.getLogger(__name__)


def _synchronize(events: list[Any]) -> None:
    """Off the loop: return once every event (CUDA, recorded after a layer's write) has passed;
    an event handed with several layers is waited on once."""
    for event in {id(e): e for e in events}.values():
        event.synchronize()


class Link:
    """One connection from this sender to one receiver, shared by its requests."""

    @abstractmethod
    def send_ctrl(self, msg: dict[str, Any]) -> Awaitable[None]:
        """Send one control message: a coroutine, or (ucx) a future for a posted send."""

    @abstractmethod
    def send_run(
        self, desc: Descriptor, layer: int, run: int, views: list[torch.Tensor], announced: bool,
        sent: Callable[[BaseException | None], None] | None = None,
    ) -> Awaitable[int] | None:
        """Send one run's plane views. ``announced``: the layer's runs went in a ``layers``
        message (else they are the receiver's pre-posted ones).

        Either a coroutine that writes them (tcp), or None for sends posted already (ucx),
        which then call ``sent`` as each completes (an exception if it failed): one plain
        call per message, no future, since a prefill posts hundreds per request.
        """

    def run_messages(self, views: list[torch.Tensor]) -> int:
        """Transport messages that one run of these plane views takes (``messages``)."""
        return 1

    def views(self, layout: KVLayout, layer: int, first_block: int, count: int) -> list[Any]:
        """The source planes of one run, in the form ``send_run`` takes."""
        return layout.run_views(layer, first_block, count)


@dataclass
class _Out:
    rid: str
    desc: Descriptor
    deadline: float
    layers: frozenset[int] = frozenset()  # the descriptor's layers, for a cheap check per call
    queue: asyncio.Queue[tuple[Any, ...]] = field(default_factory=asyncio.Queue)
    state: TransferState = TransferState.WAITING
    reason: str = ""
    link: Link | None = None
    sent: set[int] = field(default_factory=set)
    runs_of: tuple[list[int], list[Any]] | None = None  # last (src, its runs): layers share blocks
    dst_runs: list[Any] | None = None  # the destination's own runs (what a pre-posting receiver posted)
    checked: tuple[list[int], int] | None = None  # last validated src blocks and their largest id
    pending: set[asyncio.Future[Any]] = field(default_factory=set)
    sent_cb: Callable[[BaseException | None], None] | None = None  # a posted data send completed
    task: asyncio.Task[None] | None = None
    done: concurrent.futures.Future[TransferStatus] = field(
        default_factory=concurrent.futures.Future
    )


class StreamingSender(KVSender):
    """KVSender over any ``Link``; see the module docstring for the roles."""

    backend = ""
    _owns_loop = True  # False when the transport shares one loop per process
    _preposted = False  # the receiver posts every layer's destination runs at ``expect``
    # The receiver prepares for data at ``begin`` (ucx heats its lanes), so ``start`` sends it at
    # once. Else ``begin`` goes with the transfer's first layer (or ``finish``/``abort``): the
    # caller's burst of calls then wakes the loop once, and the loop does not take the GIL from
    # the caller between them.
    _early_begin = True

    def __init__(
        self, timeout_s: float = 10.0, on_release: ReleaseCallback | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.on_release = on_release
        self.layout: KVLayout | None = None
        self.messages = 0  # data messages sent (all requests)
        self._lock = threading.Lock()
        self._out: dict[str, _Out] = {}
        self._thread = self._make_loop()
        self._thread.call(self._start_watchdog)

    def _make_loop(self) -> LoopThread:
        return LoopThread(f"kv-send-{self.backend}")

    # -- transport hooks -------------------------------------------------------------
    @abstractmethod
    async def _open(self, desc: Descriptor) -> Link:
        """Connect (or reuse a connection) to the receiver named by ``desc``."""

    @abstractmethod
    def _reply_info(self) -> tuple[str | bytes, int]:
        """(address, tag) the receiver answers to, carried in ``begin``."""

    async def _close_transport(self) -> None:
        """Close connections; runs on the loop at ``close``."""

    # -- caller side -------------------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        self.layout = layout

    def start(self, request_id: str, descriptor: Descriptor) -> None:
        desc = self._check_descriptor(descriptor)
        out = _Out(request_id, desc, time.monotonic() + self.timeout_s, frozenset(desc["layers"]))
        with self._lock:
            if request_id in self._out:
                raise TransferError(f"request {request_id!r} already started")
            self._out[request_id] = out
        if not self._early_begin:
            self._thread.defer(self._launch, out)  # sent at the latest on the watchdog's next tick
            return
        self._thread.call(self._launch, out)
        time.sleep(0)  # hand the GIL to the loop thread: connect and send ``begin`` now

    def _check_descriptor(self, descriptor: Descriptor) -> Descriptor:
        if self.layout is None:
            raise TransferError("register() the KV layout before start()")
        try:
            desc = wire.check(dict(descriptor))
        except wire.WireError as exc:
            raise TransferError(f"bad descriptor: {exc}") from None
        if desc["backend"] != self.backend:
            raise TransferError(f"descriptor for {desc['backend']!r}, sender is {self.backend!r}")
        if max(desc["layers"], default=-1) >= self.layout.num_layers:
            raise TransferError(f"descriptor layers {desc['layers']} beyond local cache")
        if self.layout.signature(desc["layers"]) != desc["layout"]:
            raise TransferError(
                f"layout mismatch: receiver {desc['layout']} != "
                f"sender {self.layout.signature(desc['layers'])}"
            )
        return desc

    def send_layer(
        self, request_id: str, layer: int, src_block_ids: Sequence[int], ready: Any = None
    ) -> None:
        out = self._get(request_id)
        if layer not in out.layers:
            raise TransferError(f"{request_id}: layer {layer} not in {out.desc['layers']}")
        assert self.layout is not None
        checked = out.checked  # the blocks of the previous layer, already validated
        if checked is None or checked[1] >= self.layout.num_blocks(layer) or checked[0] != src_block_ids:
            src = list(map(int, src_block_ids))
            if len(src) != len(out.desc["blocks"]):
                raise TransferError(f"{request_id}: {len(src)} blocks, expected {len(out.desc['blocks'])}")
            try:
                self.layout.check_blocks(layer, src)
            except ValueError as exc:
                raise TransferError(f"{request_id}: {exc}") from None
            out.checked = checked = (src, max(src, default=-1))
        src = checked[0]
        self._thread.call(self._enqueue, out, ("layer", layer, src, ready))

    def finish(self, request_id: str) -> None:
        self._thread.call(self._enqueue, self._get(request_id), ("finish",))

    def abort(self, request_id: str, reason: str = "aborted by sender") -> None:
        self._thread.call(self._end, self._get(request_id), TransferState.FAILED, reason, True)

    def poll(self, request_id: str) -> TransferStatus:
        out = self._get(request_id)
        with self._lock:
            return TransferStatus(out.state, out.reason)

    def wait(self, request_id: str, timeout: float | None = None) -> TransferStatus:
        try:
            return self._get(request_id).done.result(timeout)
        except concurrent.futures.TimeoutError:
            return self.poll(request_id)

    def held(self) -> list[str]:
        with self._lock:
            return [r for r, o in self._out.items() if not o.state.terminal]

    def close(self) -> None:
        if self._thread.loop.is_running():
            self._thread.submit(self._close_all()).result(timeout=10)
        if self._owns_loop:
            self._thread.stop()

    def _get(self, request_id: str) -> _Out:
        with self._lock:
            out = self._out.get(request_id)
        if out is None:
            raise TransferError(f"unknown request {request_id!r}")
        return out

    # -- loop side -----------------------------------------------------------------------
    def _launch(self, out: _Out) -> None:
        if out.state.terminal:  # a deferred start that ended first (lease expired, sender closed)
            return
        out.sent_cb = lambda exc: self._data_sent(out, exc)
        out.task = asyncio.ensure_future(self._drive(out))
        out.task.add_done_callback(lambda t: self._task_done(out, t))

    def _enqueue(self, out: _Out, op: tuple[Any, ...]) -> None:
        if not out.state.terminal:
            out.deadline = time.monotonic() + self.timeout_s
            out.queue.put_nowait(op)

    async def _drive(self, out: _Out) -> None:
        out.link = await self._open(out.desc)
        addr, tag = self._reply_info()
        begin = wire.make(
            "begin", rid=out.rid, tok=out.desc["tok"], reply=addr, ack_tag=tag, nblocks=len(out.desc["blocks"])
        )
        await self._post_ctrl(out, begin)
        self._set_state(out, TransferState.TRANSFERRING, "")
        held: tuple[Any, ...] | None = None  # taken from the queue but not part of the last group
        while True:
            op = held if held is not None else await out.queue.get()
            held = None
            if op[0] == "finish":
                break
            group = [op]
            while not out.queue.empty():  # join the layers queued meanwhile with the same blocks
                nxt = out.queue.get_nowait()
                if nxt[0] == "layer" and nxt[2] == op[2] and len(group) < wire.MAX_LIST:
                    group.append(nxt)
                else:
                    held = nxt
                    break
            await self._send_layers(out, group)
        await self._flush(out)
        await self._post_ctrl(out, wire.make("finish", rid=out.rid, tok=out.desc["tok"], layers=len(out.sent)))
        out.deadline = time.monotonic() + self.timeout_s  # the ack must come in time

    async def _flush(self, out: _Out) -> None:
        """Before ``finish``: every layer's data is on its way in order (the receiver acks only
        once it landed). Coroutine links write in turn; posted (ucx) sends are ordered already."""
        streaming = [f for f in out.pending if isinstance(f, asyncio.Task)]
        if streaming:
            await asyncio.gather(*streaming)

    async def _post_ctrl(self, out: _Out, msg: dict[str, Any]) -> None:
        """Send a control message: a posted send (ucx) is ordered before what follows, so it
        is only tracked, not waited for; a stream (tcp) is written first."""
        assert out.link is not None
        sent = out.link.send_ctrl(msg)
        if asyncio.isfuture(sent):
            self._track(out, sent)
        else:
            await sent

    @staticmethod
    def _take_group(out: _Out, group: list[tuple[Any, ...]]) -> tuple[list[int], list[int]]:
        """The group's layers (each sent once: marked now) and their shared source blocks."""
        layers = [op[1] for op in group]
        for layer in layers:
            if layer in out.sent:
                raise TransferError(f"layer {layer} sent twice")
            out.sent.add(layer)
        return layers, group[0][2]

    async def _send_layers(self, out: _Out, group: list[tuple[Any, ...]]) -> None:
        """One announce for the group's layers, then every run's data, posted at once."""
        layers, src = self._take_group(out, group)
        ready = [op[3] for op in group if op[3] is not None]
        if ready:  # one thread hop for the group: a replayed prefill hands every layer an event
            await asyncio.get_running_loop().run_in_executor(None, _synchronize, ready)
        if out.runs_of is None or out.runs_of[0] != src:
            out.runs_of = (src, coalesce(src, out.desc["blocks"]))
        runs = out.runs_of[1]
        assert out.link is not None and self.layout is not None
        if self._preposted and out.dst_runs is None:
            out.dst_runs = coalesce(out.desc["blocks"], out.desc["blocks"])
        announced = not self._preposted or runs != out.dst_runs
        if announced:
            pairs = [[r.index, r.count] for r in runs]
            await self._post_ctrl(out, wire.make("layers", rid=out.rid, tok=out.desc["tok"], layers=layers,
                                                 runs=pairs))
        # Every run's data is posted at once and never awaited here; a failure ends the lease.
        for layer in layers:
            for i, r in enumerate(runs):
                views = out.link.views(self.layout, layer, src[r.index], r.count)
                self.messages += out.link.run_messages(views)  # counted when posted
                writing = out.link.send_run(out.desc, layer, i, views, announced, out.sent_cb)
                if writing is not None:
                    self._track(out, writing)

    def _track(self, out: _Out, aw: Awaitable[Any]) -> None:
        fut = asyncio.ensure_future(aw)
        out.pending.add(fut)
        fut.add_done_callback(lambda f: self._run_sent(out, f))

    def _data_sent(self, out: _Out, exc: BaseException | None) -> None:
        """A send completed: a failure ends the lease, a success extends it."""
        if out.state.terminal:
            return
        if exc is not None:
            self._end(out, TransferState.FAILED, f"send to the receiver failed: {exc!r}", True)
        else:
            out.deadline = time.monotonic() + self.timeout_s

    def _run_sent(self, out: _Out, fut: asyncio.Future[Any]) -> None:
        out.pending.discard(fut)
        if not fut.cancelled():
            self._data_sent(out, fut.exception())

    def _task_done(self, out: _Out, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            self._end(out, TransferState.FAILED, f"transfer to the receiver failed: {type(exc).__name__}: {exc}", True)

    def _on_message(self, msg: dict[str, Any]) -> None:
        """An ``ack`` (or ``error``) from a receiver, already validated."""
        with self._lock:
            out = self._out.get(msg.get("rid", ""))
        if msg["t"] == "ack" and out is not None and not wire.authentic(msg, out.desc["tok"]):
            log.warning("sender drops an ack for %s without the transfer's token", out.rid)
        elif msg["t"] == "ack" and out is not None:
            state = TransferState.DONE if msg["ok"] else TransferState.FAILED
            reason = "" if msg["ok"] else f"receiver: {msg['reason']}"
            self._end(out, state, reason, False)
        elif msg["t"] not in ("ack", "error"):
            log.warning("sender ignores unexpected %s message", msg["t"])

    def _on_link_lost(self, link: Link, reason: str) -> None:
        with self._lock:
            outs = [o for o in self._out.values() if o.link is link and not o.state.terminal]
        for out in outs:
            self._end(out, TransferState.FAILED, f"lost the receiver: {reason}", False)

    def _set_state(self, out: _Out, state: TransferState, reason: str) -> None:
        with self._lock:
            if not out.state.terminal:
                out.state, out.reason = state, reason

    def _end(self, out: _Out, state: TransferState, reason: str, tell_peer: bool) -> None:
        """Make ``out`` terminal and end its lease; idempotent."""
        if out.state.terminal:
            return
        self._set_state(out, state, reason)
        if out.task is not None and out.task is not asyncio.current_task():
            out.task.cancel()
        for fut in list(out.pending):
            fut.cancel()
        if tell_peer:
            asyncio.ensure_future(self._tell_abort(out, reason))
        out.done.set_result(TransferStatus(state, reason))
        if self.on_release is not None:
            self.on_release(out.rid, TransferStatus(state, reason))

    async def _tell_abort(self, out: _Out, reason: str) -> None:
        try:
            msg = wire.make("abort", rid=out.rid, tok=out.desc["tok"], reason=reason[: wire.MAX_STR])
            link = out.link if out.link is not None else await asyncio.wait_for(
                self._open(out.desc), timeout=1.0
            )
            await asyncio.wait_for(link.send_ctrl(msg), timeout=1.0)
        except Exception as exc:  # the peer may be gone; that is why we abort
            log.debug("abort for %s not delivered: %r", out.rid, exc)

    def _start_watchdog(self) -> None:
        asyncio.ensure_future(self._watchdog())

    async def _watchdog(self) -> None:
        tick = min(0.1, self.timeout_s / 10)
        while True:
            await asyncio.sleep(tick)
            self._thread.run_deferred()
            now = time.monotonic()
            with self._lock:
                late = [o for o in self._out.values() if not o.state.terminal and now > o.deadline]
            for out in late:
                reason = f"lease expired: no progress for {self.timeout_s}s (receiver dead or stalled)"
                self._end(out, TransferState.FAILED, reason, True)
            self._forget_old(now)

    def _forget_old(self, now: float) -> None:
        with self._lock:
            old = [r for r, o in self._out.items() if o.state.terminal and now > o.deadline + 60]
            for r in old:
                del self._out[r]

    async def _close_all(self) -> None:
        for out in list(self._out.values()):
            self._end(out, TransferState.FAILED, "sender closed", True)
        await asyncio.sleep(0)
        await self._close_transport()
