"""UCX transport (ucxx): shared memory on one host, CUDA IPC between GPUs, RDMA/TCP across.

Endpoints are made from *worker addresses* (carried in the descriptor and in
``begin``), not from IP:port, so UCX picks shared memory / CUDA IPC on one host;
endpoint error handling is off because with it UCX falls back to TCP (~0.7 GB/s vs
~5 GB/s here). A dead peer is therefore noticed by the ``timeout_s`` watchdogs.

Messages are tagged sends, not RMA: ucxx's Python API exposes no memory
registration or put/get, and large tagged sends already use UCX's zero-copy
rendezvous protocol (the receiver pulls). Tags:
- control to a receiver: ``CTRL | receiver id``; acks to a sender: ``ACK | sender id``;
  both carry ``wire.seal`` frames (magic, length, crc32) into a fixed buffer.
- data: ``serial << 36 | layer << 24 | run * planes + plane``, where ``serial`` is
  unique per request in the receiving process, so a stale message never matches
  another request's receive.

Careful: all ucxx calls run on one process-wide loop thread (``runtime()``), shared
by every UcxSender/UcxReceiver of the process. ucxx 0.52 cannot cancel a posted
receive from Python: after a FAILED transfer its receives stay posted under that
request's unique tags (a late send from an aborted sender could still land).
"""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
from typing import Any, cast

import numpy as np
import torch

from kvtransfer import wire
from kvtransfer.base import Descriptor
from kvtransfer.loop import LoopThread
from kvtransfer.receiver import ProtocolError, StreamingReceiver, _In
from kvtransfer.sender import Link, StreamingSender

os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
import ucxx  # noqa: E402  (reads UCX_* variables at import)

CTRL = 1 << 63
ACK = 3 << 62
_runtime: LoopThread | None = None
_runtime_lock = threading.Lock()
_endpoints: dict[bytes, asyncio.Future[Any]] = {}


def runtime() -> LoopThread:
    """The process's ucxx loop thread, started on first use."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            rt = LoopThread("kv-ucx")
            rt.submit(_start_progress()).result(timeout=60)
            _runtime = rt
    return _runtime


async def _start_progress() -> None:
    ucxx.continuous_ucx_progress()


def data_tag(serial: int, layer: int, index: int) -> int:
    if layer >= 1 << 12 or index >= 1 << 24:
        raise ValueError(f"layer {layer} or message {index} beyond the tag space")
    return ((serial & ((1 << 27) - 1)) << 36) | (layer << 24) | index


def _buffer(view: torch.Tensor) -> Any:
    return view if view.is_cuda else view.numpy()


async def endpoint(addr: bytes) -> Any:
    """A cached endpoint to the worker at ``addr`` (runs on the runtime loop)."""
    if addr not in _endpoints:
        address = ucxx.get_ucx_address_from_buffer(addr)
        _endpoints[addr] = asyncio.ensure_future(
            ucxx.create_endpoint_from_worker_address(address, endpoint_error_handling=False)
        )
    try:
        return await asyncio.shield(_endpoints[addr])
    except Exception:
        _endpoints.pop(addr, None)
        raise


class _Peer(Link):
    """Sends to one (worker, tag) pair: a receiver's control tag or a sender's ack tag."""

    def __init__(self, ep: Any, tag: int) -> None:
        self.ep, self.tag = ep, tag

    async def send_ctrl(self, msg: dict[str, Any]) -> None:
        await self.ep.send(np.frombuffer(wire.seal(msg), np.uint8), tag=self.tag, force_tag=True)

    async def send_run(self, desc: Descriptor, layer: int, run: int, views: list[torch.Tensor]) -> int:
        n = len(views)
        await asyncio.gather(*(
            self.ep.send(_buffer(v), tag=data_tag(desc["serial"], layer, run * n + p), force_tag=True)
            for p, v in enumerate(views)
        ))
        return n


async def _recv_loop(tag: int, handle: Any, on_error: Any) -> None:
    """Receive sealed control messages on ``tag`` forever; ``await handle(msg)`` each."""
    buf = np.zeros(wire.SEALED.size + wire.MAX_MESSAGE_BYTES, np.uint8)
    while True:
        buf[: wire.SEALED.size] = 0
        try:
            await ucxx.recv(buf, tag=tag)
            await handle(wire.unseal(memoryview(cast(Any, buf))))
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # truncated (oversized) receive, wire or protocol error
            on_error(exc)


def _spawn(tasks: set[asyncio.Task[Any]], coro: Any) -> None:
    task = asyncio.ensure_future(coro)
    tasks.add(task)
    task.add_done_callback(tasks.discard)


class UcxReceiver(StreamingReceiver):
    backend = "ucx"
    _owns_loop = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tag = CTRL | secrets.randbits(32)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._peers: dict[tuple[bytes, int], _Peer] = {}
        self._addr = self._thread.submit(_worker_address()).result(timeout=30)
        self._thread.call(_spawn, self._tasks, _recv_loop(self._tag, self._dispatch, self._bad))

    def _make_loop(self) -> LoopThread:
        return runtime()

    def _address(self) -> tuple[bytes, int]:
        return self._addr, self._tag

    async def _reply(self, link: Any, msg: dict[str, Any]) -> None:
        await link.send_ctrl(msg)

    def _bad(self, exc: Exception) -> None:
        if not isinstance(exc, wire.WireError):
            exc = wire.WireError(f"bad control message: {type(exc).__name__}: {exc}")
        self._protocol_error(None, exc)

    async def _dispatch(self, msg: dict[str, Any]) -> None:
        if msg["t"] == "begin":
            link: Any = await self._peer(msg)
        else:
            with self._lock:
                rec = self._in.get(msg.get("rid", ""))
            link = rec.link if rec is not None else None
        self._on_message(msg, link)

    async def _peer(self, msg: dict[str, Any]) -> _Peer:
        key = (msg["reply"], msg["ack_tag"])
        if not isinstance(key[0], bytes) or not key[1] & ACK == ACK:
            raise ProtocolError(msg["rid"], "begin without a ucx reply address and ack tag")
        if key not in self._peers:
            ep = await asyncio.wait_for(endpoint(key[0]), self.timeout_s)
            self._peers[key] = _Peer(ep, key[1])
        return self._peers[key]

    def _post_layer(self, rec: _In, layer: int) -> None:
        for (lay, run), views in list(rec.views.items()):
            if lay == layer:
                _spawn(self._tasks, self._recv_run(rec, layer, run, views))

    async def _recv_run(self, rec: _In, layer: int, run: int, views: list[torch.Tensor]) -> None:
        n = len(views)
        try:
            await asyncio.gather(*(
                ucxx.recv(_buffer(v), tag=data_tag(rec.serial, layer, run * n + p))
                for p, v in enumerate(views)
            ))
        except Exception as exc:
            self._fail(rec, f"receive failed: {type(exc).__name__}: {exc}")
            return
        self._on_run_done(rec.rid, layer, run)

    async def _close_transport(self) -> None:
        for task in list(self._tasks):
            task.cancel()


async def _worker_address() -> bytes:
    return bytes(ucxx.get_worker_address())


class UcxSender(StreamingSender):
    backend = "ucx"
    _owns_loop = False

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._tag = ACK | secrets.randbits(32)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._peers: dict[tuple[bytes, int], _Peer] = {}
        self._addr = self._thread.submit(_worker_address()).result(timeout=30)
        self._thread.call(_spawn, self._tasks, _recv_loop(self._tag, self._ack, self._bad))

    def _make_loop(self) -> LoopThread:
        return runtime()

    def _reply_info(self) -> tuple[bytes, int]:
        return self._addr, self._tag

    async def _ack(self, msg: dict[str, Any]) -> None:
        self._on_message(msg)

    def _bad(self, exc: Exception) -> None:
        self._on_message(wire.make("error", reason=str(exc)[: wire.MAX_STR]))

    async def _open(self, desc: Descriptor) -> Link:
        key = (desc["addr"], desc["tag"])
        if not isinstance(key[0], bytes) or key[1] & ACK != CTRL:
            raise ValueError("ucx descriptor without a worker address and control tag")
        if key not in self._peers:
            ep = await asyncio.wait_for(endpoint(key[0]), self.timeout_s)
            self._peers[key] = _Peer(ep, key[1])
        return self._peers[key]

    async def _close_transport(self) -> None:
        for task in list(self._tasks):
            task.cancel()
