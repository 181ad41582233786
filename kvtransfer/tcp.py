"""TCP transport over asyncio streams (no UCX): works between any two hosts.

One connection per (sender, receiver address), shared by the sender's requests.
Frames: ``wire.frame`` control messages; a ``data`` header is followed by exactly
``nbytes`` raw bytes (the run's planes back to back), so one run is one message
whatever the number of planes. The receiver reads into the run's destination views.

Faults: any bad frame (malformed, oversized, wrong version, unannounced data)
makes the receiver answer ``error``, close that connection and fail the requests
bound to it; its other connections keep serving. A well-formed message for a transfer
the receiver does not know (late: ended and forgotten) fails that transfer alone: it
is dropped (a ``data`` header's bytes read and discarded), the connection stays up. A closed connection fails the
open requests on both ends at once; a silent peer fails them after ``timeout_s``.
CUDA tensors are staged through host memory.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import numpy as np
import torch

from kvtransfer import wire
from kvtransfer.base import Descriptor
from kvtransfer.receiver import StreamingReceiver, _log_failure
from kvtransfer.sender import Link, StreamingSender

log = logging.getLogger(__name__)
STRAY_BUFFER = 1 << 16  # unsent bytes past which a receiver stops answering stray messages


async def read_msg(reader: asyncio.StreamReader) -> dict[str, Any] | None:
    """The next framed message, or None at a clean end of stream."""
    try:
        header = await reader.readexactly(wire.HEADER.size)
    except asyncio.IncompleteReadError as exc:
        if exc.partial:
            raise
        return None
    return wire.decode(await reader.readexactly(wire.frame_length(header)))


def _host_buffer(view: torch.Tensor) -> memoryview:
    array: Any = view.cpu().numpy() if view.is_cuda else view.numpy()
    return memoryview(array)


async def _read_into(reader: asyncio.StreamReader, views: list[torch.Tensor]) -> None:
    for view in views:
        data = await reader.readexactly(view.numel())
        src = np.frombuffer(data, np.uint8)
        if view.is_cuda:
            view.copy_(torch.from_numpy(src.copy()))
        else:
            view.numpy()[:] = src


async def _discard(reader: asyncio.StreamReader, nbytes: int) -> None:
    while nbytes > 0:
        nbytes -= len(await reader.readexactly(min(nbytes, 1 << 20)))


class _Conn(Link):
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer

    async def send_ctrl(self, msg: dict[str, Any]) -> None:
        self.writer.write(wire.frame(msg))
        await self.writer.drain()

    async def send_run(
        self, desc: Descriptor, layer: int, run: int, views: list[torch.Tensor], announced: bool,
        sent: Any = None,
    ) -> int:
        nbytes = sum(v.numel() for v in views)
        header = wire.make("data", rid=desc["rid"], layer=layer, run=run, nbytes=nbytes)
        self.writer.write(wire.frame(header))
        for view in views:  # no await between writes: frames never interleave
            self.writer.write(_host_buffer(view))
        await self.writer.drain()
        return 1


class TcpReceiver(StreamingReceiver):
    backend = "tcp"

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.host = host
        self._server = self._thread.submit(self._listen(host, port)).result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _listen(self, host: str, port: int) -> asyncio.Server:
        return await asyncio.start_server(self._serve, host, port)

    def _address(self) -> tuple[str, int]:
        return f"{self.host}:{self.port}", 0

    async def _reply(self, link: Any, msg: dict[str, Any]) -> None:
        await link.send_ctrl(msg)

    def _send(self, link: Any, msg: dict[str, Any]) -> None:
        """An ack (or the pool) is written now, from the handler that decided it: it leaves before
        ending the request wakes its waiter, not after the base's ``wait_for`` task got two loop
        passes (~0.1 ms on 2 cores). Only a write the socket did not take at once is drained, in
        a task with the timeout; a closed connection fails its requests in ``_serve``. A nack
        keeps the base's task: nothing waits on it, and on a connection closed for a protocol
        error the ``error`` goes first."""
        if msg["t"] == "ack" and not msg["ok"]:
            super()._send(link, msg)
            return
        try:
            link.writer.write(wire.frame(msg))
        except Exception as exc:  # as the base logs a reply that failed: the peer may be gone
            log.debug("kvtransfer reply not written: %r", exc)
            return
        if link.writer.transport.get_write_buffer_size():
            fut = asyncio.ensure_future(asyncio.wait_for(link.writer.drain(), self.timeout_s))
            fut.add_done_callback(_log_failure)

    def _tell_stray(self, link: Any, nack: dict[str, Any]) -> None:
        """Written at once, as an ack is, unless the peer leaves our earlier writes unread: a flood
        of stray messages must not grow the buffer (a real late sender's own lease ends it)."""
        try:
            if link.writer.transport.get_write_buffer_size() < STRAY_BUFFER:
                link.writer.write(wire.frame(nack))
        except Exception as exc:  # the peer may be gone: that closes the connection elsewhere
            log.debug("kvtransfer reply not written: %r", exc)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        link = _Conn(reader, writer)
        reason = "sender closed the connection"
        try:
            await self._read_loop(link)
        except wire.WireError as exc:
            self._protocol_error(link, exc)
            reason = f"connection closed after protocol error: {exc}"
            await _try_send(link, wire.make("error", reason=str(exc)[: wire.MAX_STR]))
            await _linger(link)
        except (OSError, asyncio.IncompleteReadError) as exc:
            reason = f"sender connection lost: {exc!r}"
        finally:
            self._on_link_lost(link, reason)
            writer.close()

    async def _read_loop(self, link: _Conn) -> None:
        while (msg := await read_msg(link.reader)) is not None:
            if msg["t"] == "data":
                views = self._views_for(msg["rid"], msg["layer"], msg["run"], msg["nbytes"], link)
                if views is None:
                    await _discard(link.reader, msg["nbytes"])
                    continue
                await _read_into(link.reader, views)
                self._on_run_done(msg["rid"], msg["layer"], msg["run"])
            else:
                self._on_message(msg, link)

    async def _close_transport(self) -> None:
        self._server.close()


async def _linger(link: _Conn, seconds: float = 1.0) -> None:
    """After an error reply: end our side, then read and drop what the peer still sends, for at
    most `seconds`. Closing with unread bytes makes the kernel reset the connection, and a reset
    can reach the peer before the error reply it was sent (which it then never reads)."""
    try:
        if link.writer.can_write_eof():
            link.writer.write_eof()
        async with asyncio.timeout(seconds):
            while await link.reader.read(1 << 16):
                pass
    except (TimeoutError, OSError):
        pass


async def _try_send(link: _Conn, msg: dict[str, Any]) -> None:
    try:
        await asyncio.wait_for(link.send_ctrl(msg), 1.0)
    except (TimeoutError, OSError):
        pass


class TcpSender(StreamingSender):
    backend = "tcp"
    _link_cls = _Conn
    _early_begin = False  # ``begin`` only binds the connection: it goes with the first layer

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._links: dict[str, asyncio.Future[_Conn]] = {}

    def _reply_info(self) -> tuple[str, int]:
        return "", 0  # replies come back on the same connection

    async def _open(self, desc: Descriptor) -> Link:
        addr = desc["addr"]
        if not isinstance(addr, str) or ":" not in addr:
            raise ValueError(f"tcp address must be 'host:port', got {addr!r}")
        if addr not in self._links:
            self._links[addr] = asyncio.ensure_future(self._connect(addr))
        try:
            return await asyncio.shield(self._links[addr])
        except Exception:
            self._links.pop(addr, None)
            raise

    async def _connect(self, addr: str) -> _Conn:
        host, port = addr.rsplit(":", 1)
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(host, int(port)), self.timeout_s
        )
        link = self._link_cls(reader, writer)
        asyncio.ensure_future(self._read_acks(addr, link))
        return link

    async def _read_acks(self, addr: str, link: _Conn) -> None:
        reason = "receiver closed the connection"
        try:
            while (msg := await read_msg(link.reader)) is not None:
                if msg["t"] == "error":
                    reason = f"receiver closed the connection: {msg['reason']}"
                    break
                self._on_link_message(link, msg)
        except (wire.WireError, OSError, asyncio.IncompleteReadError) as exc:
            reason = f"receiver connection lost: {exc!r}"
        self._links.pop(addr, None)
        link.writer.close()
        self._on_link_lost(link, reason)

    def _on_link_message(self, link: _Conn, msg: dict[str, Any]) -> None:
        """A validated message from the receiver on ``link``."""
        self._on_message(msg)

    async def _close_transport(self) -> None:
        for fut in list(self._links.values()):
            if fut.done() and not fut.cancelled() and fut.exception() is None:
                fut.result().writer.close()
        self._links.clear()
