"""What a UCX sender and receiver say to each other through: ``Peer`` sends control messages
(sealed ``wire`` frames) to one tag and a transfer's data to the receiver's lanes;
``CtrlReceiver`` takes the sealed control messages that arrive on one tag."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from kvtransfer import wire
from kvtransfer.base import Descriptor
from kvtransfer.sender import Link
from kvtransfer.ucx.core import Done, ignore
from kvtransfer.ucx.process import driver
from kvtransfer.ucx.tags import data_tag


def as_buffer(view: Any) -> Any:
    return view.numpy() if isinstance(view, torch.Tensor) and not view.is_cuda else view


class Peer(Link):
    """Sends to one (worker, tag) pair: a receiver's control tag or a sender's ack tag."""

    def __init__(self, ep: Any, tag: int, lanes: list[Any] | None = None) -> None:
        self.ep, self.tag = ep, tag
        self.lanes = lanes or [ep]  # data endpoints: layer l goes to lanes[l % len]

    def send_ctrl(self, msg: dict[str, Any]) -> asyncio.Future[None]:
        """Post the send now (in order with later sends); the future says when it went."""
        return driver().send_future(self.ep, np.frombuffer(wire.seal(msg), np.uint8), self.tag)

    def run_messages(self, views: list[Any]) -> int:
        return len(views)  # one tagged message per plane

    def views(self, layout: Any, layer: int, first_block: int, count: int) -> list[Any]:
        return layout.run_buffers(layer, first_block, count)  # numpy slices for host memory

    def send_run(
        self, desc: Descriptor, layer: int, run: int, views: list[Any], announced: bool,
        sent: Done | None = None,
    ) -> None:
        """Post every plane's send at once; ``sent`` hears of each one's completion."""
        drv, n = driver(), len(views)
        ep = self.lanes[layer % len(self.lanes)]
        serial = wire.token_serial(desc["tok"])  # a sender without the token sends under other tags
        for p, v in enumerate(views):
            drv.send_data(ep, as_buffer(v), data_tag(serial, layer, run * n + p, announced), sent or ignore)


class CtrlReceiver:
    """Receives sealed control messages on one tag, one at a time, and hands them on.

    A message arriving while none is posted waits in UCX's unexpected queue; the
    receive is re-posted from the completion handler, so no message is lost.
    """

    def __init__(self, tag: int, handle: Callable[[dict[str, Any]], None],
                 on_error: Callable[[Exception], None]) -> None:
        self.tag, self.handle, self.on_error = tag, handle, on_error
        self.buf = np.zeros(wire.SEALED.size + wire.MAX_MESSAGE_BYTES, np.uint8)
        self.closed = False
        self._post()

    def _post(self) -> None:
        if not self.closed:
            self.buf[: wire.SEALED.size] = 0
            driver().recv(self.buf, self.tag, self._done)

    def _done(self, exc: BaseException | None) -> None:
        if self.closed:
            return
        try:
            if exc is not None:  # e.g. truncated: an oversized message
                raise exc
            self.handle(wire.unseal(memoryview(cast(Any, self.buf))))
        except Exception as e:  # wire or protocol error
            self.on_error(e)
        self._post()
