"""The receiver's protocol, shared by every transport (decode side).

Receives: ``expect`` / ``poll`` / ``wait`` / ``on_end`` / ``abort`` from any thread, and from the
transport (on the loop thread) validated control messages with the ``Link`` they
came on, plus data for runs announced by a ``layers`` message (or, for a transport that
pre-posts, ucx, for the destination's own runs, prepared at ``expect``).
Hands on: one ``ack`` per request on its link (ok once every layer landed and the
sender said ``finish``; not ok with a reason on failure).
Never: writes outside the request's own destination blocks: every run is checked
against the block list given to ``expect``; nor closes a connection over a well-formed
message of a transfer it does not know (never expected, or ended and forgotten
``retain_s`` later: a late sender): that transfer alone fails (``_on_stray``).
Careful: state changes only on the loop thread; callers read it under ``_lock``. A
transport subclass provides ``_address``, ``_reply`` and, when the transport pulls data
(ucx), ``_prepost`` and ``_announce``.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer import wire
from kvtransfer.base import Descriptor, KVReceiver, TransferError, TransferState, TransferStatus
from kvtransfer.layout import KVLayout
from kvtransfer.loop import LoopThread

log = logging.getLogger(__name__)

RECENT_SERIALS = 1 << 16
ERRORS_KEPT = 256  # protocol errors kept for operators: strangers cannot grow the list
STRAY = "unknown or expired transfer"  # the reason a sender of a transfer the receiver does not know hears
_serials_lock = threading.Lock()
_serials_recent: collections.deque[int] = collections.deque()
_serials_taken: set[int] = set()


def _new_token() -> tuple[bytes, int]:
    """A transfer token and its serial, unlike the serials of this process's last
    ``RECENT_SERIALS`` transfers (live ones included): ucx data tags must not collide, and a
    stale message of an ended transfer must never match a new one's receive."""
    with _serials_lock:
        while True:
            tok = wire.new_token()
            serial = wire.token_serial(tok)
            if serial not in _serials_taken:
                break
        _serials_taken.add(serial)
        _serials_recent.append(serial)
        if len(_serials_recent) > RECENT_SERIALS:
            _serials_taken.discard(_serials_recent.popleft())
    return tok, serial


class ProtocolError(wire.WireError):
    """A well-formed message that breaks the protocol for request ``rid``."""

    def __init__(self, rid: str, text: str) -> None:
        super().__init__(f"{rid}: {text}")
        self.rid = rid


@dataclass
class _In:
    rid: str
    blocks: list[int]
    layers: list[int]
    tok: bytes  # the transfer token: every message of the sender must carry it
    serial: int  # derived from ``tok`` (ucx data tags)
    deadline: float
    state: TransferState = TransferState.WAITING
    reason: str = ""
    link: Any = None
    remaining: dict[int, int] = field(default_factory=dict)  # layer -> runs not landed
    views: dict[tuple[int, int], list[torch.Tensor]] = field(default_factory=dict)
    finish_layers: int | None = None
    announced: set[int] = field(default_factory=set)  # layers a ``layers`` message named
    done: concurrent.futures.Future[TransferStatus] = field(
        default_factory=concurrent.futures.Future
    )


class StreamingReceiver(KVReceiver):
    """KVReceiver over any transport; see the module docstring for the roles."""

    backend = ""
    _owns_loop = True  # False when the transport shares one loop per process
    _preposts = False  # ``_prepost`` posts receives: ``expect`` queues it on the loop

    def __init__(self, timeout_s: float = 10.0, retain_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.retain_s = retain_s
        self.layout: KVLayout | None = None
        self.errors: collections.deque[str] = collections.deque(maxlen=ERRORS_KEPT)  # newest last
        self.strays = 0  # well-formed messages for transfers this receiver did not know (``_on_stray``)
        self._largest_run = 0  # bytes of the longest run a ``data`` message can name (``register``)
        self._lock = threading.Lock()
        self._in: dict[str, _In] = {}
        self._thread = self._make_loop()
        self._thread.call(lambda: asyncio.ensure_future(self._watchdog()))

    def _make_loop(self) -> LoopThread:
        return LoopThread(f"kv-recv-{self.backend}")

    # -- transport hooks -------------------------------------------------------------
    @abstractmethod
    def _address(self) -> tuple[str | bytes, int]:
        """(address, control tag) that senders connect to."""

    @abstractmethod
    async def _reply(self, link: Any, msg: dict[str, Any]) -> None:
        """Send ``msg`` back on ``link``."""

    def _lanes(self) -> list[bytes]:
        """Addresses of the data lanes senders send to (ucx); none for a transport without."""
        return []

    def _prepost(self, rec: _In) -> None:
        """Within ``expect``, on the loop: a pulling transport prepares every layer here."""

    def _announce(self, rec: _In, layers: list[int], runs: list[list[int]]) -> None:
        """A ``layers`` message, validated but for ``runs``: check them, make the views."""
        self._check_runs(rec, runs)
        assert self.layout is not None
        for layer in layers:
            for i, (index, count) in enumerate(runs):
                rec.views[(layer, i)] = self.layout.run_views(layer, rec.blocks[index], count)
            rec.remaining[layer] = len(runs)

    async def _close_transport(self) -> None:
        """Close the listener and connections; runs on the loop at ``close``."""

    # -- caller side ---------------------------------------------------------------
    def register(self, layout: KVLayout) -> None:
        self.layout = layout
        self._largest_run = max(
            (layout.num_blocks(x) * sum(layout.block_bytes(x)) for x in range(layout.num_layers)), default=0
        )

    def expect(
        self, request_id: str, dst_block_ids: Sequence[int], layers: Sequence[int], skip: int = 0
    ) -> Descriptor:
        if self.layout is None:
            raise TransferError("register() the KV layout before expect()")
        blocks, layer_ids = [int(b) for b in dst_block_ids], [int(x) for x in layers]
        if len(set(layer_ids)) != len(layer_ids) or not layer_ids:
            raise TransferError(f"layers must be distinct and non-empty: {layer_ids}")
        try:  # once per distinct cache size: the check reads only the layer's block count
            for layer in {self.layout.num_blocks(x): x for x in layer_ids}.values():
                self.layout.check_blocks(layer, blocks)
        except (ValueError, IndexError) as exc:
            raise TransferError(f"{request_id}: {exc}") from None
        rec = _In(request_id, blocks, layer_ids, *_new_token(), time.monotonic() + self.timeout_s)
        with self._lock:
            if request_id in self._in:
                raise TransferError(f"request {request_id!r} already expected")
            self._in[request_id] = rec
        if self._preposts:  # queued, not awaited: `_prepost` copes with messages handled first
            self._thread.call(self._prepost, rec)
        addr, tag = self._address()
        return wire.make(
            "desc", rid=request_id, backend=self.backend, addr=addr, tag=tag,
            tok=rec.tok, lanes=self._lanes(), layers=layer_ids, blocks=blocks,
            layout=self.layout.signature(layer_ids), skip=int(skip),
        )

    def poll(self, request_id: str) -> TransferStatus:
        rec = self._get(request_id)
        with self._lock:
            return TransferStatus(rec.state, rec.reason)

    def wait(self, request_id: str, timeout: float | None = None) -> TransferStatus:
        try:
            return self._get(request_id).done.result(timeout)
        except concurrent.futures.TimeoutError:
            return self.poll(request_id)

    def abort(self, request_id: str, reason: str = "aborted by receiver") -> None:
        self._thread.call(self._fail, self._get(request_id), reason)

    def on_end(self, request_id: str, fn: Callable[[], None]) -> None:
        self._get(request_id).done.add_done_callback(lambda _: fn())

    def close(self) -> None:
        if self._thread.loop.is_running():
            self._thread.submit(self._close_all()).result(timeout=10)
        if self._owns_loop:
            self._thread.stop()

    def _get(self, request_id: str) -> _In:
        with self._lock:
            rec = self._in.get(request_id)
        if rec is None:
            raise TransferError(f"unknown request {request_id!r}")
        return rec

    # -- loop side: control ----------------------------------------------------------
    def _on_message(self, msg: dict[str, Any], link: Any) -> None:
        """Dispatch one validated message; raises ProtocolError/WireError on misuse."""
        kind = msg["t"]
        handler = {
            "begin": self._on_begin, "layers": self._on_layers,
            "finish": self._on_finish, "abort": self._on_abort,
        }.get(kind)
        if handler is None:
            raise wire.WireError(f"receiver does not accept {kind!r} messages")
        rec = self.authenticate(msg)
        if rec is None:
            self._on_stray(msg, link)
            return
        if rec.state.terminal:  # late message: tell a sender that begins too late
            if kind == "begin" and link is not None and rec.link is None:
                rec.link = link
                self._send(link, self._ack(rec, False, rec.reason))
            return
        bound = (rec.link is not None and rec.link is link) or (kind == "abort" and rec.link is None)
        if kind != "begin" and not bound:
            raise ProtocolError(rec.rid, f"{kind} before begin on this connection")
        rec.deadline = time.monotonic() + self.timeout_s
        handler(rec, msg, link)

    def authenticate(self, msg: dict[str, Any]) -> _In | None:
        """The request a sender's message names, if the message carries its token; None if this
        receiver does not know the request; else AuthError, before anything else is done with the
        message."""
        with self._lock:
            rec = self._in.get(msg["rid"])
        if rec is not None and not wire.authentic(msg, rec.tok):
            raise wire.AuthError(f"{rec.rid}: {msg['t']} without the transfer's token: not a sender the "
                                 "router introduced")
        return rec

    def _ack(self, rec: _In, ok: bool, reason: str) -> dict[str, Any]:
        return wire.make("ack", rid=rec.rid, tok=rec.tok, ok=ok, reason=reason[: wire.MAX_STR])

    def _on_stray(self, msg: dict[str, Any], link: Any) -> None:
        """A well-formed message for a transfer this receiver does not know: never expected here,
        or ended and forgotten ``retain_s`` later (a prefill job that queued past the KV timeout
        sends just that, on the connection its node's healthy transfers share). It concerns that
        transfer alone, so the connection stays up: the message is dropped, and a sender that
        waits for an answer (after ``begin`` or ``finish``) is told its transfer failed, under the
        message's own token (it learns nothing; only that sender takes it). Nothing is remembered
        of the request: memory stays bounded whatever ids a peer sends."""
        self.strays += 1
        if msg["t"] == "begin":
            log.info("kvtransfer %s receiver: %s for %s", self.backend, STRAY, msg["rid"][:80])
        if link is not None and msg["t"] in ("begin", "finish"):
            self._tell_stray(link, wire.make("ack", rid=msg["rid"], tok=msg["tok"], ok=False, reason=STRAY))

    def _tell_stray(self, link: Any, nack: dict[str, Any]) -> None:
        """Send ``_on_stray``'s answer; a transport may drop it when the peer does not read."""
        self._send(link, nack)

    def _on_begin(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        if rec.link is not None:
            raise ProtocolError(rec.rid, "begin twice")
        if msg["nblocks"] != len(rec.blocks):
            raise ProtocolError(rec.rid, f"{msg['nblocks']} blocks, expected {len(rec.blocks)}")
        rec.link = link
        self._set_state(rec, TransferState.TRANSFERRING, "")

    def _on_layers(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        layers = msg["layers"]
        if not layers:
            raise ProtocolError(rec.rid, "layers announce without layers")
        for layer in layers:
            if layer not in rec.layers or layer in rec.announced:
                raise ProtocolError(rec.rid, f"layer {layer} unexpected or repeated")
        if len(set(layers)) != len(layers):
            raise ProtocolError(rec.rid, f"layers {layers} repeated")
        rec.announced.update(layers)
        self._announce(rec, layers, msg["runs"])
        self._maybe_done(rec)

    def _check_runs(self, rec: _In, runs: list[list[int]]) -> None:
        """Runs must tile 0..n-1 in order, each over consecutive destination blocks."""
        pos = 0
        for index, count in runs:
            if index != pos or count == 0 or index + count > len(rec.blocks):
                raise ProtocolError(rec.rid, f"run {index}+{count} does not tile the blocks")
            first = rec.blocks[index]
            if rec.blocks[index : index + count] != list(range(first, first + count)):
                raise ProtocolError(rec.rid, f"run {index}+{count} is not contiguous here")
            pos += count
        if pos != len(rec.blocks):
            raise ProtocolError(rec.rid, f"runs cover {pos} of {len(rec.blocks)} blocks")

    def _on_finish(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        rec.finish_layers = msg["layers"]
        self._maybe_done(rec)

    def _on_abort(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        self._fail(rec, f"sender aborted: {msg['reason']}", tell_peer=False)

    # -- loop side: data ---------------------------------------------------------------
    def _views_for(self, rid: str, layer: int, run: int, nbytes: int, link: Any) -> list[torch.Tensor] | None:
        """Destination views of an announced, not yet landed run of ``nbytes`` bytes, for data
        arriving on ``link``: only the link an authenticated ``begin`` bound may write.

        None when the request already ended or is unknown here (late data: the caller discards
        it, so the stream stays in frame); WireError for more bytes than any run can hold.
        """
        if nbytes > self._largest_run:
            raise wire.WireError(f"{rid}: data run of {nbytes} bytes, longer than any here ({self._largest_run})")
        with self._lock:
            rec = self._in.get(rid)
        if rec is None:
            self.strays += 1
            return None
        if rec.state.terminal:
            return None
        if rec.link is not link:
            raise wire.AuthError(f"{rid}: data on a connection the transfer did not begin on")
        views = rec.views.get((layer, run))
        if views is None:
            raise ProtocolError(rid, f"data for unannounced run {run} of layer {layer}")
        if nbytes != sum(v.numel() for v in views):
            raise ProtocolError(rid, f"run {run} of layer {layer}: {nbytes} bytes, expected "
                                f"{sum(v.numel() for v in views)}")
        return views

    def _on_run_done(self, rid: str, layer: int, run: int) -> None:
        with self._lock:
            rec = self._in.get(rid)
        if rec is None or rec.state.terminal or rec.views.pop((layer, run), None) is None:
            return
        rec.remaining[layer] -= 1
        rec.deadline = time.monotonic() + self.timeout_s
        self._maybe_done(rec)

    def _maybe_done(self, rec: _In) -> None:
        if rec.finish_layers is None or any(rec.remaining.values()):
            return
        if rec.finish_layers != len(rec.layers) or len(rec.remaining) != len(rec.layers):
            self._fail(rec, f"sender finished after {len(rec.remaining)} of {len(rec.layers)} layers")
            return
        # The ack goes first: ending wakes the caller's thread waiting on this request, which
        # then holds the GIL while the ack would still be waiting to be posted.
        self._send(rec.link, self._ack(rec, True, ""))
        self._end(rec, TransferState.DONE, "")

    # -- loop side: endings -----------------------------------------------------------
    def _set_state(self, rec: _In, state: TransferState, reason: str) -> None:
        with self._lock:
            if not rec.state.terminal:
                rec.state, rec.reason = state, reason

    def _end(self, rec: _In, state: TransferState, reason: str) -> None:
        if rec.state.terminal:
            return
        self._set_state(rec, state, reason)
        rec.views.clear()
        rec.deadline = time.monotonic()
        rec.done.set_result(TransferStatus(state, reason))

    def _fail(self, rec: _In, reason: str, tell_peer: bool = True) -> None:
        if rec.state.terminal:
            return
        self._end(rec, TransferState.FAILED, reason)
        if tell_peer and rec.link is not None:
            self._send(rec.link, self._ack(rec, False, reason))

    def _send(self, link: Any, msg: dict[str, Any]) -> None:
        fut = asyncio.ensure_future(asyncio.wait_for(self._reply(link, msg), self.timeout_s))
        fut.add_done_callback(_log_failure)

    def _protocol_error(self, link: Any, exc: Exception) -> None:
        """A bad message on ``link``: fail its requests (and the named one), keep serving."""
        self.errors.append(str(exc))
        log.warning("kvtransfer %s receiver: %s", self.backend, exc)
        with self._lock:
            recs = [r for r in self._in.values() if link is not None and r.link is link]
            named = self._in.get(getattr(exc, "rid", ""))
        for rec in recs + ([named] if named is not None else []):
            self._fail(rec, f"protocol error: {exc}")

    def _on_link_lost(self, link: Any, reason: str) -> None:
        with self._lock:
            recs = [r for r in self._in.values() if r.link is link]
        for rec in recs:
            self._fail(rec, reason, tell_peer=False)

    async def _watchdog(self) -> None:
        tick = min(0.1, self.timeout_s / 10)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            with self._lock:
                recs = list(self._in.values())
            for rec in recs:
                if not rec.state.terminal and now > rec.deadline:
                    self._fail(rec, f"timed out: no message from the sender for {self.timeout_s}s")
                elif rec.state.terminal and now > rec.deadline + self.retain_s:
                    with self._lock:
                        self._in.pop(rec.rid, None)

    async def _close_all(self) -> None:
        for rec in list(self._in.values()):
            self._fail(rec, "receiver closed")
        await asyncio.sleep(0)
        await self._close_transport()


def _log_failure(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.debug("kvtransfer reply not delivered: %r", fut.exception())
