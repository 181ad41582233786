"""The UCX sending side: endpoints to a receiver's control tag and data lanes, from its
descriptor; acks come back on a tag of its own."""

from __future__ import annotations

import secrets
from typing import Any

from kvtransfer import wire
from kvtransfer.base import Descriptor
from kvtransfer.loop import LoopThread
from kvtransfer.sender import Link, StreamingSender
from kvtransfer.ucx.link import CtrlReceiver, Peer
from kvtransfer.ucx.process import bind_device, driver, runtime
from kvtransfer.ucx.tags import ACK, CTRL


class UcxSender(StreamingSender):
    backend = "ucx"
    _owns_loop = False
    _preposted = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tag = ACK | secrets.randbits(32)
        self._peers: dict[tuple[Any, ...], Peer] = {}
        self._ctrl = self._thread.submit(self._open_ctrl()).result(timeout=30)

    async def _open_ctrl(self) -> CtrlReceiver:
        return CtrlReceiver(self._tag, self._on_message, self._bad)

    def _make_loop(self) -> LoopThread:
        return runtime()

    def register(self, layout: Any) -> None:
        super().register(layout)
        bind_device(self._thread, layout.device)

    def _reply_info(self) -> tuple[bytes, int]:
        return driver().address, self._tag

    def _bad(self, exc: Exception) -> None:
        self._on_message(wire.make("error", reason=str(exc)[: wire.MAX_STR]))

    async def _open(self, desc: Descriptor) -> Link:
        addr, tag, lanes = desc["addr"], desc["tag"], desc["lanes"]
        if not isinstance(addr, bytes) or tag & ACK != CTRL:
            raise ValueError("ucx descriptor without a worker address and control tag")
        if not lanes or not all(isinstance(a, bytes) for a in lanes):
            raise ValueError("ucx descriptor without lane worker addresses")
        key = (addr, tag, *lanes)
        if key not in self._peers:
            drv = driver()
            self._peers[key] = Peer(drv.endpoint(addr), tag, [drv.data_endpoint(a) for a in lanes])
        return self._peers[key]

    async def _close_transport(self) -> None:
        self._ctrl.closed = True
