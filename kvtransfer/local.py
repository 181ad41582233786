"""In-process transport, for tests of the layers above: no network, same protocol.

A LocalReceiver registers under a name; a LocalSender in the same process finds
it by the descriptor's ``addr``. Control messages still go through msgpack
(``wire.encode``/``decode``) and runs are copied with ``Tensor.copy_``, in order, on
the receiver's loop thread, so the protocol and its checks are the real ones.
Not for production: both ends must live in one process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
from typing import Any

import torch

from kvtransfer import wire
from kvtransfer.base import Descriptor
from kvtransfer.receiver import StreamingReceiver
from kvtransfer.sender import Link, StreamingSender

_RECEIVERS: dict[str, LocalReceiver] = {}
_names = itertools.count()


class _LocalLink(Link):
    def __init__(self, sender: LocalSender, receiver: LocalReceiver) -> None:
        self.sender, self.receiver = sender, receiver

    async def send_ctrl(self, msg: dict[str, Any]) -> None:
        self.receiver._thread.call(self.receiver._deliver, self, wire.encode(msg))

    async def send_run(
        self, desc: Descriptor, layer: int, run: int, views: list[torch.Tensor], announced: bool,
        sent: Any = None,
    ) -> int:
        fut: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.receiver._thread.call(self.receiver._land, self, desc["rid"], layer, run, views, fut)
        await asyncio.wrap_future(fut)
        return 1


class LocalReceiver(StreamingReceiver):
    backend = "local"

    def __init__(self, name: str | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.name = name or f"local-{next(_names)}"
        _RECEIVERS[self.name] = self

    def _address(self) -> tuple[str, int]:
        return self.name, 0

    async def _reply(self, link: Any, msg: dict[str, Any]) -> None:
        data = wire.encode(msg)
        link.sender._thread.call(lambda: link.sender._on_message(wire.decode(data)))

    def _deliver(self, link: _LocalLink, data: bytes) -> None:
        try:
            self._on_message(wire.decode(data), link)
        except wire.WireError as exc:
            self._protocol_error(link, exc)

    def _land(self, link: _LocalLink, rid: str, layer: int, run: int, src: list[torch.Tensor],
              fut: concurrent.futures.Future[None]) -> None:
        try:
            views = self._views_for(rid, layer, run, sum(v.numel() for v in src), link)
            for dst, s in zip(views or [], src, strict=bool(views)):
                dst.copy_(s)
            self._on_run_done(rid, layer, run)
            fut.set_result(None)
        except Exception as exc:
            fut.set_exception(exc)

    async def _close_transport(self) -> None:
        _RECEIVERS.pop(self.name, None)


class LocalSender(StreamingSender):
    backend = "local"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._links: dict[str, _LocalLink] = {}

    def _reply_info(self) -> tuple[str, int]:
        return "", 0

    async def _open(self, desc: Descriptor) -> Link:
        receiver = _RECEIVERS.get(desc["addr"])
        if receiver is None:
            raise ConnectionError(f"no local receiver named {desc['addr']!r}")
        if desc["addr"] not in self._links:
            self._links[desc["addr"]] = _LocalLink(self, receiver)
        return self._links[desc["addr"]]
