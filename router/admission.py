"""Admission: a reservation on a decode node (or a whole request on a colocated one), or a bounded
FIFO wait for one.

Receives, from a request's driver, an attempt to place (`Admission.reserve`): the nodes of the
kind are asked in policy order (Reserve, or Submit on a colocated node); the first that admits
answers with the KV descriptor P must fill (`Reserved`). When every healthy node refuses, the
request waits in the `AdmissionQueue` until capacity may have freed (a request on some node
ended, a node came back, a Status poll ran: `wake_one`), then asks again from the queue's head,
so order is kept. A full queue is RESOURCE_EXHAUSTED; no healthy node (after `node_wait_s`) is
UNAVAILABLE. The node asked is held (holds.py) before each call, so a cancel mid-call still
aborts it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import grpc

from protos import node_pb2
from protos.convert import pack_token_ids
from router.config import RouterConfig
from router.directory import KINDS, Kind
from router.holds import Holds
from router.policy import Policy
from router.pool import Node, NodePool
from router.request import RequestError, RequestState

NODE_WAIT_POLL_S = 0.05  # how often a request waiting for a healthy node looks again
# A Reserve or Submit refused for good: a bad request, or one that needs more KV than the node has
# in all (queueing it would hold up every request behind it until its deadline).
NEVER_ADMITTED = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)


class AdmissionQueue:
    """Requests that no decode node would admit, waiting (FIFO, bounded) for capacity. Holds
    futures only; never talks to a node."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._waiters: deque[asyncio.Future[None]] = deque()
        self.epoch = 0  # wake-ups so far: a request asking nodes meanwhile must ask again

    def __len__(self) -> int:
        return len(self._waiters)

    async def wait(self, front: bool = False) -> bool:
        """Wait for a wake-up; False at once when the queue is full (`front`: a woken request
        going back to the head, which is always let in)."""
        if not front and len(self._waiters) >= self.size:
            return False
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if front:
            self._waiters.appendleft(fut)
        else:
            self._waiters.append(fut)
        try:
            await fut
        finally:
            if fut in self._waiters:  # cancelled (deadline, abort) while waiting
                self._waiters.remove(fut)
        return True

    def wake_one(self) -> None:
        self.epoch += 1
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return


@dataclass(frozen=True)
class Reserved:
    """A node that admitted an attempt, and the KV descriptor it expects (empty from a colocated node)."""

    node: Node
    descriptor: bytes


class Admission:
    def __init__(self, router_id: str, config: RouterConfig, pool: NodePool, policy: Policy, holds: Holds) -> None:
        self.router_id, self.config, self.pool, self.policy, self.holds = router_id, config, pool, policy, holds
        self.queue = AdmissionQueue(config.queue_size)

    async def reserve(self, st: RequestState, attempt: int, prompt: list[int], sampling: node_pb2.Sampling,
                      kind: Kind = "decode", asked: int | None = None) -> Reserved:
        """Reserve on the first decode node (policy order) that admits, or submit to the first
        colocated one (`kind`); queue when none does. `asked`: every node refused at this queue
        epoch already; unless capacity news came since, the request queues without asking again.
        Laps the request's TTFT timeline: the nodes' calls are `reserve`, the waits `queue`."""
        timeline = st.timeline
        timeline.lap("queue")  # the driver's start, or what came before this attempt
        # FIFO: do not pass those already waiting
        wait, front = len(self.queue) > 0 or (asked is not None and self.queue.epoch == asked), False
        req = self.reserve_request(st, attempt, prompt, sampling)
        while True:
            if not wait:
                seen = self.queue.epoch
                found = await self.try_reserve(st, req, kind)
                timeline.lap("reserve")
                if found is not None:
                    if len(self.queue):
                        self.queue.wake_one()  # capacity may remain for the next one
                    return found
                if self.queue.epoch != seen:  # capacity news came while the nodes were asked,
                    continue  # and no waiter was there to take it: ask again, do not wait for more
            wait = False
            if not await self.queue.wait(front):
                raise RequestError("RESOURCE_EXHAUSTED", f"no {kind} node can admit the request now and the "
                                   f"router's queue ({self.queue.size}) is full")
            timeline.lap("queue")
            front = True

    def reserve_request(self, st: RequestState, attempt: int, prompt: list[int],
                        sampling: node_pb2.Sampling) -> node_pb2.ReserveRequest:
        """The Reserve (or Submit) of an attempt; its id is the one P and D know the attempt by."""
        return node_pb2.ReserveRequest(request_id=f"{self.router_id}/{st.request_id}/{attempt}",
                                       prompt_len=len(prompt), sampling=sampling,
                                       prompt_token_ids_packed=pack_token_ids(prompt))

    async def await_node(self, kind: Kind, exclude: dict[str, str] | None = None) -> bool:
        """Whether a healthy `kind` node (not in `exclude`) is there, waiting up to
        `node_wait_s` for one to come (back); never longer, so a dead service still answers."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.node_wait_s
        while not any(n.address not in (exclude or {}) for n in self.pool.healthy(kind)):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(NODE_WAIT_POLL_S)
        return True

    async def await_listed(self) -> bool:
        """Whether the directory lists any node, waiting up to `node_wait_s` for one: a service
        still starting serves before its nodes are up, and whether it is a PD or a colocated one
        is known only once they are listed."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.node_wait_s
        while not any(self.pool.directory.addresses(kind) for kind in KINDS):
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(NODE_WAIT_POLL_S)
        return True

    async def try_reserve(self, st: RequestState, req: node_pb2.ReserveRequest, kind: Kind) -> Reserved | None:
        """Ask each healthy node of `kind` once, in policy order; None when none admitted."""
        if not await self.await_node(kind):
            raise RequestError("UNAVAILABLE", f"no healthy {kind} node")
        nodes = self.pool.healthy(kind)
        node_rid = req.request_id
        for load in self.policy.order_decode([n.load() for n in nodes]):
            node = self.pool.find(kind, load.address)
            if node is None or not node.healthy:
                continue
            self.holds.hold_decode(st, node, node_rid)  # before the call: a cancel mid-call still aborts
            call = node.stub.Submit if kind == "colocated" else node.stub.Reserve
            try:
                reply = await call(req, timeout=self.config.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() in NEVER_ADMITTED:  # the request itself: no node takes it, now or later
                    self.holds.drop_decode(st)
                    raise RequestError(e.code().name, f"{kind} node {node.address}: {e.details()}") from None
                if self.pool.rpc_failed(node, e, "Submit" if kind == "colocated" else "Reserve"):
                    self.holds.drop_decode(st)
                else:  # it may have admitted: abort to be sure
                    self.holds.spawn_abort_decode(st, "Reserve failed")
                continue
            self.pool.heard_from(node)
            if reply.admitted:
                return Reserved(node, reply.descriptor_msgpack)
            self.holds.drop_decode(st)
        return None
