"""Primer: each prefill node's KV path to each decode node opened before the router chooses them.

A prefill node's first KV transfer to a decode node pays for what later ones reuse: the
connection (tcp), the endpoints (ucx), and with ipc the decode node's KV memory mapped into the
prefill node. The router, which introduces the two for every request, introduces them once more
as soon as both are up, with a priming transfer (kvtransfer/prime.py): the decode node's `Prime`
gives a descriptor of no blocks, the prefill node's `Prime` runs it. NodePool keeps a node that
came up out of selection until its pairs with every node of the other kind that is up were primed
(`NodePool.healthy`), so the service is ready (/health, `pdserve up`) only then, and a node that
joins later is primed before its first request.

A pair is primed once (the prefill node keeps its connection); forgetting a node (it went down)
primes its pairs again when it is back. A prime that fails (a node that takes none, a tensor
parallel one; a transport error) is logged and counts as done: that pair's first request pays
as it would have without priming.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Protocol

import grpc

from protos import node_pb2

log = logging.getLogger(__name__)


class Node(Protocol):
    """What priming needs of a node (router/pool.py's Node, which imports this module)."""

    @property
    def address(self) -> str: ...
    @property
    def kind(self) -> str: ...
    @property
    def stub(self) -> Any: ...


class Primer:
    def __init__(self, rpc_timeout_s: float,
                 spawn: Callable[[Coroutine[Any, Any, bool]], asyncio.Task[Any]]) -> None:
        self.rpc_timeout_s = rpc_timeout_s
        self._spawn = spawn  # the pool's: its tasks end with it
        self._pairs: dict[tuple[str, str], asyncio.Task[bool]] = {}  # (prefill, decode) address -> its prime
        self.primed = 0  # pairs primed (for tests and `pdserve status`)
        self.failed = 0  # primes that failed: those pairs' first transfers pay as before

    async def prime(self, prefill: Sequence[Node], decode: Sequence[Node]) -> None:
        """Prime every pair not primed yet; returns once each one's prime ended."""
        tasks = [self._pair(p, d) for p in prefill for d in decode]
        if tasks:  # shielded: a refresh cancelled mid-wait leaves the primes to the others waiting
            await asyncio.gather(*(asyncio.shield(t) for t in tasks), return_exceptions=True)

    def forget(self, node: Node) -> None:
        """`node` went down: its pairs are primed again when it is back (a new process, maybe)."""
        side = 0 if node.kind == "prefill" else 1
        for key in [k for k in self._pairs if k[side] == node.address]:
            del self._pairs[key]  # a prime under way ends by itself (its calls have deadlines)

    def _pair(self, p: Node, d: Node) -> asyncio.Task[bool]:
        key = (p.address, d.address)
        task = self._pairs.get(key)
        if task is None:
            task = self._pairs[key] = self._spawn(self._run(p, d))
        return task

    async def _run(self, p: Node, d: Node) -> bool:
        rid = f"prime-{secrets.token_hex(8)}"
        try:
            reply = await d.stub.Prime(node_pb2.PrimeRequest(request_id=rid), timeout=self.rpc_timeout_s)
            ack = await p.stub.Prime(node_pb2.AttachRequest(request_id=rid, descriptor_msgpack=reply.descriptor_msgpack,
                                                            decode_address=d.address), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            return self._failed(p, d, f"{e.code().name} {e.details() or ''}", e.code() == grpc.StatusCode.UNIMPLEMENTED)
        if not ack.ok:
            return self._failed(p, d, ack.reason, False)
        self.primed += 1
        log.info("prefill node %s primed for decode node %s", p.address, d.address)
        return True

    def _failed(self, p: Node, d: Node, reason: str, unsupported: bool) -> bool:
        self.failed += 1
        (log.info if unsupported else log.warning)(
            "prefill node %s not primed for decode node %s (its first request opens the path): %s",
            p.address, d.address, reason)
        return False
