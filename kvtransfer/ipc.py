"""Same-host transport: the sender writes blocks straight into the receiver's mapped KV cache.

Between GPUs of one host this is CUDA IPC: the decode node's cache is opened once per peer in
the prefill node's process (``peer_pool``), and a group of layers is one batched copy on a
side stream, GPU to GPU over NVLink where the GPUs have it, never staged through the host. The
copy waits on the layer's ``ready`` event on that stream, so the transport thread never waits
for prefill compute. Between CPU processes the cache lives in shared memory and the copy runs
on the transport thread. No per-block or per-layer message crosses the wire: a transfer's cost does not
grow with its layer or block count.

Control is tcp's (one connection per receiver, the same framed messages): ``begin``, then at
``finish`` (once the last copy completed) the receiver acknowledges. On the first
authenticated ``begin`` of a connection the receiver answers ``pool``: how to open its memory.
The router primes each pair of nodes before it chooses them (``prime.py``: a transfer of no
blocks), so that opening and the connection are paid before the first request; the copy kernel
is compiled and loaded at ``register``.

Trust: the receiver opens its whole cache to a sender that presents one introduced transfer's
token, so a sender could write blocks beyond its descriptor's. Use it between nodes of one
operator on one host, as any peer-mapped transport (UCX ``cuda_ipc``, NIXL) requires; across
hosts, or where that is not so, use ucx or tcp. A failed transfer's destination blocks wait
in the decode node's quarantine before reuse, so a copy still in flight lands nowhere live.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import torch

from kernels.block_copy import WORD, copy_blocks, copy_blocks_reference
from kernels.block_copy import warm_up as warm_up_kernel
from kvtransfer import peer_pool, wire
from kvtransfer.base import TransferError, TransferState
from kvtransfer.layout import KVLayout
from kvtransfer.receiver import ProtocolError, _In
from kvtransfer.sender import _Out
from kvtransfer.tcp import TcpReceiver, TcpSender, _Conn

POOL_WAIT_S = 30.0  # opening a receiver's cache the first time maps every storage
SPIN_S = 100e-6  # how long ``_flush`` polls a copy's event before it waits in a thread


async def completed(event: Any, spin_s: float = SPIN_S) -> None:
    """Return once ``event`` (a CUDA event) completed. A small copy completes within tens of
    microseconds of its launch: polled on the loop for up to ``spin_s`` (each pass lets the
    loop's other work run), it costs no thread hand-over; a longer wait (a copy still queued
    behind prefill compute) blocks a pool thread, not the loop. Polling can't use a timer:
    the loop's ``epoll`` rounds any timeout up to a millisecond."""
    end = time.perf_counter() + spin_s
    while not event.query():
        if time.perf_counter() > end:
            await asyncio.get_running_loop().run_in_executor(None, event.synchronize)
            return
        await asyncio.sleep(0)


class _PoolConn(_Conn):
    """A control connection that also learns the receiver's pool (its first ``pool`` message)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        super().__init__(reader, writer)
        self.pool: asyncio.Future[peer_pool.PeerPool] = asyncio.get_running_loop().create_future()


class _Copier:
    """Queues one group's block copies: on CUDA one kernel launch per block size, on a side
    stream, after the group's ``ready`` events; on the CPU at once.

    The address tables of a set of layers are made once per peer pool (a prefill pushes the same
    layers for every request), and a request's two block lists go to the device once: a group
    then costs one kernel launch."""

    MAX_TABLES = 4096  # distinct layer sets kept per pool

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, pool: peer_pool.PeerPool, local: KVLayout, layers: list[int], blocks: Any,
             ready: Sequence[Any]) -> Any:
        """Blocks ``blocks`` (from ``blocks_for``) of ``layers`` from ``local`` into ``pool``;
        returns an event recorded after them (None on CPU: copied)."""
        if self.stream is None:
            src_blocks, dst_blocks = blocks
            for layer in layers:
                for s, d, n in zip(local.plane_bytes(layer), pool.planes[layer], pool.block_bytes[layer],
                                   strict=True):
                    copy_blocks_reference([s], [d], src_blocks, dst_blocks, n)
            return None
        tables = self._table(pool, local, layers)
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            for event in ready:
                self.stream.wait_event(event)
            b = blocks.numel() // 2
            for nbytes, table in tables:
                n = table.numel() // 2
                copy_blocks(table[:n], table[n:], blocks[:b], blocks[b:], nbytes)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def warm_up(self, local: KVLayout) -> None:
        """Before the first transfer: the copy kernel compiled and loaded for every block size of
        ``local`` (a first transfer would wait for it), and the pinned staging of block lists
        started. Scratch blocks only: nothing of the cache or of a peer is touched."""
        if self.stream is None:
            return
        sizes = sorted({n for i in range(local.num_layers) for n in local.block_bytes(i)})
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.blocks_for([0], [0])
            for nbytes in sizes:
                warm_up_kernel(torch.zeros(2 * nbytes, dtype=torch.uint8, device=self.device), nbytes)
        self.stream.synchronize()

    def warm_tables(self, pool: peer_pool.PeerPool, local: KVLayout) -> None:
        """A new pool's address tables for the layer sets a prefill pushes most: each layer alone
        (queued as it is computed) and all of them (queued together)."""
        if self.stream is None:
            return
        every = list(range(local.num_layers))
        for layers in [[layer] for layer in every] + [every]:
            self._table(pool, local, layers)

    def blocks_for(self, src_blocks: list[int], dst_blocks: list[int]) -> Any:
        """The two block lists as ``copy`` takes them: on CUDA one device tensor."""
        if self.stream is None:
            return src_blocks, dst_blocks
        host = torch.tensor(src_blocks + dst_blocks, dtype=torch.int64).pin_memory()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            return host.to(self.device, non_blocking=True)

    def _table(self, pool: peer_pool.PeerPool, local: KVLayout, layers: list[int]) -> list[tuple[int, torch.Tensor]]:
        """Per block size, the source then destination plane addresses of ``layers``."""
        key = tuple(layers)
        if key not in pool.tables:
            if len(pool.tables) >= self.MAX_TABLES:
                pool.tables.clear()
            by_size: dict[int, tuple[list[int], list[int]]] = {}
            for layer in layers:
                for s, d, n in zip(local.plane_bytes(layer), pool.planes[layer], pool.block_bytes[layer],
                                   strict=True):
                    srcs, dsts = by_size.setdefault(n, ([], []))
                    srcs.append(s.data_ptr())
                    dsts.append(d.data_ptr())
            pool.tables[key] = [(n, torch.tensor(srcs + dsts, dtype=torch.int64, device=self.device))
                                for n, (srcs, dsts) in by_size.items()]
        tables: list[tuple[int, torch.Tensor]] = pool.tables[key]
        return tables


class IpcSender(TcpSender):
    backend = "ipc"
    _link_cls = _PoolConn

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._copier: _Copier | None = None
        self._copied: dict[str, Any] = {}  # request id -> event after its last queued copy
        self._blocks: dict[str, tuple[Any, Any]] = {}  # request id -> (its source list, both lists as copied)

    def register(self, layout: KVLayout) -> None:
        odd = [n for i in range(layout.num_layers) for n in layout.block_bytes(i) if n % WORD]
        if layout.device.type == "cuda" and odd:
            raise TransferError(f"ipc on CUDA copies 16-byte words; blocks of {odd[0]} bytes are not")
        super().register(layout)
        self._copier = _Copier(layout.device)
        self._copier.warm_up(layout)  # the pool, the other first-use cost, opens at priming (prime.py)

    def _on_link_message(self, link: _Conn, msg: dict[str, Any]) -> None:
        if msg["t"] != "pool":
            return super()._on_link_message(link, msg)
        assert isinstance(link, _PoolConn) and self.layout is not None
        if link.pool.done():
            return
        try:
            pool = peer_pool.PeerPool.open(msg, self.layout)
        except peer_pool.PoolError as exc:
            link.pool.set_exception(exc)
            return
        assert self._copier is not None
        self._copier.warm_tables(pool, self.layout)
        link.pool.set_result(pool)

    async def _send_layers(self, out: _Out, group: list[tuple[Any, ...]]) -> None:
        """The group's layers in one batched copy into the receiver's blocks."""
        layers, src = self._take_group(out, group)
        assert isinstance(out.link, _PoolConn) and self.layout is not None and self._copier is not None
        opened = out.link.pool  # open since priming: no ``wait_for`` (two loop passes)
        pool = opened.result() if opened.done() else await asyncio.wait_for(asyncio.shield(opened), POOL_WAIT_S)
        dst = out.desc["blocks"]
        if not dst:  # nothing to copy (a priming transfer: it came for the pool, open now)
            return
        blocks = self._blocks.get(out.rid)
        if blocks is None or blocks[0] is not src:  # once a request: its block lists
            pool.check_blocks(dst)
            blocks = (src, self._copier.blocks_for(list(src), list(dst)))
            self._blocks[out.rid] = blocks
        ready = [op[3] for op in group if op[3] is not None]
        event = self._copier.copy(pool, self.layout, layers, blocks[1], ready)
        self.messages += 1
        if event is not None:
            self._copied[out.rid] = event

    async def _flush(self, out: _Out) -> None:
        """``finish`` goes once every copy completed: then the receiver may read the blocks."""
        event = self._copied.pop(out.rid, None)
        if event is not None:
            await completed(event)

    def _end(self, out: _Out, state: TransferState, reason: str, tell_peer: bool) -> None:
        self._copied.pop(out.rid, None)
        self._blocks.pop(out.rid, None)
        super()._end(out, state, reason, tell_peer)


class IpcReceiver(TcpReceiver):
    backend = "ipc"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._pool: dict[str, Any] | None = None
        self._pooled: set[int] = set()  # connections that were told the pool

    def register(self, layout: KVLayout) -> None:
        super().register(layout)
        self._pool = wire.make("pool", **peer_pool.export(layout))

    def _on_begin(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        super()._on_begin(rec, msg, link)
        if id(link) not in self._pooled and self._pool is not None:
            self._pooled.add(id(link))
            self._send(link, self._pool)

    def _on_link_lost(self, link: Any, reason: str) -> None:
        self._pooled.discard(id(link))
        super()._on_link_lost(link, reason)

    def _announce(self, rec: _In, layers: list[int], runs: list[list[int]]) -> None:
        raise ProtocolError(rec.rid, "ipc takes no layers announce: the sender writes the blocks")

    def _views_for(self, rid: str, layer: int, run: int, nbytes: int, link: Any) -> list[torch.Tensor] | None:
        raise ProtocolError(rid, "ipc takes no data messages: the sender writes the blocks")

    def _on_finish(self, rec: _In, msg: dict[str, Any], link: Any) -> None:
        rec.remaining = dict.fromkeys(rec.layers, 0)  # written by the sender, which finished after
        super()._on_finish(rec, msg, link)

