"""Holds: what the nodes hold for each request, and the Aborts that free it.

Receives, from a request's driver, the node it placed an attempt on (`hold_decode`: a decode or
colocated node, by the attempt's node-side id; `hold_prefill`: a prefill node with an outstanding
Prefill request) and their ends (`drop_*`); from the NodePool, every decode node's output items,
which it hands to the request whose current attempt they belong to (`deliver`). Keeps each
node's in-flight counts (what the policy reads) equal to what is held. Sends Abort to a node that
may still hold a request (`release`, `spawn_abort_decode`), in the background, never blocking.

Careful: an item is delivered only while its node is the request's current decode node and its
id the current attempt's, so an old attempt's late items never reach a retried one.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from protos import node_pb2
from protos.messages import OutputItem
from router.pool import Node, NodePool
from router.request import RequestState

log = logging.getLogger(__name__)


class Holds:
    def __init__(self, pool: NodePool, rpc_timeout_s: float) -> None:
        self.pool = pool
        self.rpc_timeout_s = rpc_timeout_s
        self._by_node_rid: dict[str, RequestState] = {}

    def deliver(self, node: Node, items: list[OutputItem]) -> None:
        """A decode node's output items, each to its request's stream: to its `sink` while its driver
        waits for one, else to its events (the NodePool's callback)."""
        by_rid = self._by_node_rid
        for item in items:
            st = by_rid.get(item.request_id)
            if st is not None and st.decode is node and not st.done:
                sink = st.sink
                if sink is not None:
                    sink(item)
                else:
                    st.events.put_nowait(item)

    def hold_decode(self, st: RequestState, node: Node, node_rid: str) -> None:
        if st.node_rid != node_rid:  # a new attempt: nothing of an older one may be read
            st.events = asyncio.Queue()
        st.decode, st.decode_live, st.node_rid = node, True, node_rid
        st.lost = asyncio.get_running_loop().create_future()
        node.inflight += 1
        self._by_node_rid[node_rid] = st

    def drop_decode(self, st: RequestState) -> None:
        if st.decode is not None:
            st.decode.inflight -= 1
        st.decode, st.decode_live = None, False
        self._by_node_rid.pop(st.node_rid, None)

    def hold_prefill(self, st: RequestState, node: Node, work: int) -> None:
        st.prefill, st.prefill_work = node, work
        node.inflight += 1
        node.inflight_tokens += work

    def drop_prefill(self, st: RequestState) -> None:
        if st.prefill is not None:
            st.prefill.inflight -= 1
            st.prefill.inflight_tokens -= st.prefill_work
        st.prefill, st.prefill_work = None, 0

    async def abort_decode(self, st: RequestState, reason: str) -> None:
        """Drop the decode placement and wait for its Abort."""
        node, rid = st.decode, st.node_rid
        self.drop_decode(st)
        if node is not None:
            await self.send_abort(node, rid, reason)

    def spawn_abort_decode(self, st: RequestState, reason: str) -> None:
        """Drop the decode placement; Abort in the background if the node may still run it."""
        node, rid, live = st.decode, st.node_rid, st.decode_live
        self.drop_decode(st)
        if node is not None and live:
            self.spawn_abort(node, rid, reason)

    def release(self, st: RequestState, reason: str) -> None:
        """The request ended: free what the nodes still hold (Abort to P if a Prefill request was
        outstanding, to D unless D already ended it)."""
        prefill = st.prefill
        if prefill is not None:
            self.drop_prefill(st)
            self.spawn_abort(prefill, st.node_rid, reason)
        self.spawn_abort_decode(st, reason)

    def spawn_abort(self, node: Node, node_rid: str, reason: str) -> None:
        self.pool.spawn(self.send_abort(node, node_rid, reason))

    async def send_abort(self, node: Node, node_rid: str, reason: str) -> None:
        try:
            await node.stub.Abort(node_pb2.AbortRequest(request_id=node_rid, reason=reason),
                                  timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if not self.pool.rpc_failed(node, e, "Abort"):
                log.warning("Abort of %s on %s failed: %s", node_rid, node.address, e.details())
        except grpc.aio.UsageError as e:  # the channel was closed (node removed, router stopping)
            log.warning("Abort of %s on %s not sent: %s", node_rid, node.address, e)
