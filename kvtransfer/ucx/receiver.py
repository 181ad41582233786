"""The UCX receiving side: receives posted at ``expect`` over the destination's own runs,
announced runs, retiring receives before blocks are handed back (see the package docstring)."""

from __future__ import annotations

import logging
import secrets
from typing import Any

from kvtransfer import wire
from kvtransfer.layout import coalesce
from kvtransfer.loop import LoopThread
from kvtransfer.receiver import ProtocolError, StreamingReceiver, _In, _log_failure
from kvtransfer.ucx.core import Done
from kvtransfer.ucx.link import CtrlReceiver, Peer, as_buffer
from kvtransfer.ucx.process import bind_device, driver, runtime
from kvtransfer.ucx.tags import ACK, CTRL, data_tag

log = logging.getLogger(__name__)


class UcxReceiver(StreamingReceiver):
    backend = "ucx"
    _owns_loop = False
    _preposts = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tag = CTRL | secrets.randbits(32)
        self._peers: dict[tuple[bytes, int], Peer] = {}
        self._posted: dict[str, dict[int, tuple[Any, _PostedRun]]] = {}  # rid -> tag -> pending receive
        self._ctrl = self._thread.submit(self._open_ctrl()).result(timeout=30)

    async def _open_ctrl(self) -> CtrlReceiver:
        self._data_lanes = driver().lanes()
        return CtrlReceiver(self._tag, self._dispatch, self._bad)

    def _make_loop(self) -> LoopThread:
        return runtime()

    def register(self, layout: Any) -> None:
        super().register(layout)
        bind_device(self._thread, layout.device)
        if layout.device.type == "cuda":
            # CUDA IPC pulls are copy-engine work a lane only enqueues and polls: one lane
            # keeps up, and a second only adds a spinning thread and a hand-over (BENCHMARKS.md,
            # KV between GPUs).
            self._data_lanes = self._data_lanes[:1]

    def _address(self) -> tuple[bytes, int]:
        return driver().address, self._tag

    def _lanes(self) -> list[bytes]:
        return [lane.address for lane in self._data_lanes]

    async def _reply(self, link: Any, msg: dict[str, Any]) -> None:
        await link.send_ctrl(msg)

    def _send(self, link: Any, msg: dict[str, Any]) -> None:
        """Post now, from the handler that decided it: no task, no loop pass before the ack
        leaves (the base's ``wait_for`` task took ~0.3 ms here). A posted send needs no
        timeout: a request stays tracked until UCX completes it."""
        try:
            sent = link.send_ctrl(msg)
        except Exception as exc:  # as the base logs a reply that failed: the peer may be gone
            log.debug("kvtransfer reply not posted: %r", exc)
            return
        sent.add_done_callback(_log_failure)

    def _bad(self, exc: Exception) -> None:
        if not isinstance(exc, wire.WireError):
            exc = wire.WireError(f"bad control message: {type(exc).__name__}: {exc}")
        self._protocol_error(None, exc)

    def _dispatch(self, msg: dict[str, Any]) -> None:
        if msg["t"] == "begin":
            # Authenticated before an endpoint is made to the address it names; a transfer this
            # receiver does not know is answered only through a peer it already has.
            known = self.authenticate(msg) is not None
            link: Any = self._peer(msg) if known else self._peers.get((msg["reply"], msg["ack_tag"]))
        else:
            with self._lock:
                rec = self._in.get(msg.get("rid", ""))
            link = rec.link if rec is not None else None
        self._on_message(msg, link)

    def _peer(self, msg: dict[str, Any]) -> Peer:
        key = (msg["reply"], msg["ack_tag"])
        if not isinstance(key[0], bytes) or not key[1] & ACK == ACK:
            raise ProtocolError(msg["rid"], "begin without a ucx reply address and ack tag")
        if key not in self._peers:
            try:
                ep = driver().endpoint(key[0])
            except Exception as exc:
                raise ProtocolError(msg["rid"], f"bad reply address: {exc}") from None
            self._peers[key] = Peer(ep, key[1])
        return self._peers[key]

    def _prepost(self, rec: _In) -> None:
        """Post every layer's receives over the destination's own runs; cold until ``begin``.

        Queued by ``expect``, which does not wait for it: the loop may be inside a copy.
        A ``begin`` or ``layers`` message handled in the same progress pass can come first;
        announced layers keep their own receives. (``finish`` cannot come first: the
        sender finishes only after all its data was received.)"""
        layers = [layer for layer in rec.layers if layer not in rec.announced]
        if not rec.state.terminal and layers:
            runs = [[r.index, r.count] for r in coalesce(rec.blocks, rec.blocks)]
            self._post(rec, layers, runs, announced=False, hot=rec.link is not None)

    def _on_begin(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        super()._on_begin(rec, msg, link)
        driver().heat([req for req, _run in self._posted.get(rec.rid, {}).values()])

    def _announce(self, rec: _In, layers: list[int], runs: list[list[int]]) -> None:
        """Other runs than the pre-posted ones: retire those layers' receives, post these."""
        self._check_runs(rec, runs)
        posted = self._posted.get(rec.rid, {})
        old = [(tag, req) for tag, (req, run) in posted.items() if run.layer in layers]
        self._retire(rec, old)
        for key in [k for k in rec.views if k[0] in layers]:
            del rec.views[key]
        self._post(rec, layers, runs, announced=True, hot=True)

    def _post(self, rec: _In, layers: list[int], runs: list[list[int]], announced: bool, hot: bool) -> None:
        assert self.layout is not None
        posted, lanes = self._posted.setdefault(rec.rid, {}), self._data_lanes
        for layer in layers:
            lane = lanes[layer % len(lanes)]
            rec.remaining[layer] = len(runs)
            for i, (index, count) in enumerate(runs):
                views = self.layout.run_buffers(layer, rec.blocks[index], count)
                rec.views[(layer, i)] = views
                run = _PostedRun(self, rec, layer, i, len(views))
                for p, v in enumerate(views):
                    tag = data_tag(rec.serial, layer, i * len(views) + p, announced)
                    posted[tag] = (lane.recv(as_buffer(v), tag, run.landed(posted, tag), hot), run)

    def _retire(self, rec: _In, posted: list[tuple[int, Any]]) -> None:
        """Take these receives out of play before their blocks are handed back."""
        table = self._posted.get(rec.rid, {})
        for tag, _req in posted:
            table.pop(tag)[1].live = False
        if not driver().retire(posted):
            log.warning("%s: %d receives still under way after the transfer ended",
                        rec.rid, sum(not req.completed for _tag, req in posted))

    def _end(self, rec: _In, state: Any, reason: str) -> None:
        if not rec.state.terminal:
            self._retire(rec, [(tag, req) for tag, (req, _run) in self._posted.get(rec.rid, {}).items()])
            self._posted.pop(rec.rid, None)
        super()._end(rec, state, reason)

    async def _close_transport(self) -> None:
        self._ctrl.closed = True


class _PostedRun:
    """The plane receives of one run of one layer; ``live`` until retired."""

    __slots__ = ("receiver", "rec", "layer", "run", "left", "live")

    def __init__(self, receiver: UcxReceiver, rec: _In, layer: int, run: int, planes: int) -> None:
        self.receiver, self.rec, self.layer, self.run, self.left = receiver, rec, layer, run, planes
        self.live = True

    def landed(self, posted: dict[int, Any], tag: int) -> Done:
        def done(exc: BaseException | None) -> None:
            if not self.live:
                return
            posted.pop(tag, None)
            if exc is not None:
                self.receiver._fail(self.rec, f"receive failed: {type(exc).__name__}: {exc}")
                return
            self.left -= 1
            if self.left == 0:
                self.receiver._on_run_done(self.rec.rid, self.layer, self.run)
        return done
