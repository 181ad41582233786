"""NodePool: the router's connections to its prefill, decode and colocated nodes, and their health.

Receives membership from a NodeDirectory (reconciled on every change and every poll);
hands the lifecycle `Node` handles (stub + health + load) and calls it back with decode
output batches (`on_items`), decode node failures (`on_decode_failure`) and "capacity may
have freed" (`on_capacity`).

Health rules:
- A prefill node is selectable after a successful `Status`; a failed RPC marks it unhealthy
  until a later `Status` succeeds. Busy is not down: a `Status` past its deadline leaves a healthy
  node selectable while the node answered anything else meanwhile (an output batch, a Prefill or
  Reserve reply: `heard_from`), and otherwise until `status_failure_threshold` of them come in a
  row. Late answers (DEADLINE_EXCEEDED) and unreachable ones (UNAVAILABLE: a refused connection)
  are counted apart per node (`status_failures`, /metrics).
- A decode node is selectable only while this router's `Outputs` subscription to it is open
  (subscribed once per node; the node sends initial metadata, or a first batch, once the
  subscriber is registered, so no output can be missed). When the stream breaks, or an RPC
  to it fails with UNAVAILABLE, it is marked failed: `on_decode_failure` ends every request
  on it, and it is re-subscribed once a `Status` succeeds again.
- A colocated node (prefill and decode of its own requests, one process) streams its outputs
  as a decode node does, and is treated as one by every rule above.
- A prefill or decode node that came up is selectable once its pairs with every node of the other
  kind that is up were primed (router/priming.py: their KV path opened before a request needs it).
Never blocks the event loop; every RPC here has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from protos import node_pb2, node_pb2_grpc, pdserve_pb2
from protos.messages import MessageError, OutputItem, read_outputs
from protos.serving import with_secret
from protos.tls import NodeTls, node_aio_channel
from router.directory import KINDS, Kind, NodeDirectory
from router.policy import NodeLoad
from router.priming import Primer

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
RECENT_DOWNS = 32  # node failures kept for `pdserve status` (NodePool.recent_downs)
CHANNEL_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]


@dataclass(eq=False)
class Node:
    kind: Kind
    address: str
    channel: grpc.aio.Channel
    stub: Any  # DecodeControlStub, PrefillControlStub or ColocatedControlStub
    healthy: bool = False
    status: node_pb2.NodeStatus | None = None
    inflight: int = 0  # this router's requests reserved on (D) / prefilling on (P) the node
    inflight_tokens: int = 0  # P: prompt tokens those prefills compute (less a cached prefix: Policy.routed)
    last_error: str = ""
    late_status: int = 0  # Status calls in a row past their deadline, with no other answer meanwhile
    # time.monotonic() of the node's latest answer of any kind: not the loop's time, which uvloop
    # reads once per loop turn in whole milliseconds (an answer just before a Status's send would
    # tie with it and count as heard meanwhile)
    heard_at: float = float("-inf")
    status_failures: Counter[str] = field(default_factory=Counter)  # failed Status calls by gRPC code name
    downs: int = 0  # times this router took the node out of service
    primed: bool = False  # prefill, decode: its pairs with the nodes up of the other kind were primed
    removed: bool = False
    subscription: asyncio.Task[None] | None = field(default=None, repr=False)

    def load(self) -> NodeLoad:
        s = self.status
        return NodeLoad(self.address, s.free_blocks if s else 0, s.running if s else 0,
                        s.queued_tokens if s else 0, self.inflight, self.inflight_tokens)

    def health(self) -> pdserve_pb2.NodeHealth:
        """This node as the client API's NodeHealth: its last Status, health and last error."""
        s = self.status
        out = pdserve_pb2.NodeHealth(address=self.address, kind=self.kind, healthy=self.healthy,
                                     last_error=self.last_error[:1024])
        if s is not None:
            out.node_id, out.free_kv_blocks, out.total_kv_blocks = s.node_id, s.free_blocks, s.total_blocks
            out.running_requests, out.queued_prompt_tokens = s.running, s.queued_tokens
            out.shared_kv_blocks = s.shared_blocks
        return out


class NodePool:
    def __init__(self, directory: NodeDirectory, *, vocab_size: int, subscriber: str,
                 status_interval_s: float, rpc_timeout_s: float, status_failure_threshold: int = 3,
                 on_items: Callable[[Node, list[OutputItem]], None],
                 on_decode_failure: Callable[[Node, str], None],
                 on_capacity: Callable[[], None], cluster_secret: str | None = None,
                 node_tls: NodeTls | None = None) -> None:
        self.directory = directory
        self._secret = cluster_secret  # sent on every node call (protos/serving.py)
        self._tls = node_tls  # mutual TLS on every node channel (protos/tls.py); None: plain text
        self.vocab_size, self.subscriber = vocab_size, subscriber
        self.status_interval_s, self.rpc_timeout_s = status_interval_s, rpc_timeout_s
        self.status_failure_threshold = status_failure_threshold
        self.on_items, self.on_decode_failure, self.on_capacity = on_items, on_decode_failure, on_capacity
        self.nodes: dict[tuple[Kind, str], Node] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._poller: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._unsubscribe: Callable[[], None] | None = None
        self._closing = False
        self._round = 0  # refresh rounds
        self._dirty = False  # the directory changed since the last reconcile
        self._refresher: asyncio.Task[None] | None = None
        self._retired: list[tuple[Node, int]] = []  # removed nodes whose channels are still open
        self.downs: Counter[str] = Counter()  # nodes taken out of service, by kind (/metrics)
        # the latest of them, newest last: {"at": unix time, "kind", "address", "reason"} (`pdserve status`)
        self.recent_downs: deque[dict[str, Any]] = deque(maxlen=RECENT_DOWNS)
        self.primer = Primer(rpc_timeout_s, self.spawn)

    # ---- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._unsubscribe = self.directory.subscribe(self._directory_changed)
        await self.refresh()
        self._poller = asyncio.create_task(self._poll_forever())

    async def stop(self) -> None:
        self._closing = True
        if self._unsubscribe is not None:
            self._unsubscribe()
        tasks = [t for t in [self._poller, *self._tasks, *(n.subscription for n in self.nodes.values())] if t]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        channels = [n.channel for n in self.nodes.values()] + [n.channel for n, _ in self._retired]
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)
        self.nodes.clear()
        self._retired.clear()

    async def drain(self, timeout: float) -> None:
        """Wait (at most `timeout`) for the background tasks (Aborts) to finish."""
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=timeout)

    async def refresh(self) -> None:
        """Reconcile with the directory and probe every node now (Status, re-subscribe)."""
        self._round += 1
        self._reconcile()
        await asyncio.gather(*(self._probe(n) for n in list(self.nodes.values())))
        await self._prime()
        self.on_capacity()

    def healthy(self, kind: Kind) -> list[Node]:
        """The selectable nodes of `kind`: up and (prefill, decode) primed."""
        return [n for n in self._up(kind) if n.primed or kind == "colocated"]

    def _up(self, kind: Kind) -> list[Node]:
        return [n for (k, _), n in self.nodes.items() if k == kind and n.healthy and not n.removed]

    async def _prime(self) -> None:
        """Prime the pairs of prefill and decode nodes that are up; each of them is selectable once
        its pairs were (a node that is down now is primed again when it is back)."""
        prefill, decode = self._up("prefill"), self._up("decode")
        for node in self.nodes.values():
            if node.kind != "colocated" and node not in prefill and node not in decode:
                node.primed = False
                self.primer.forget(node)
        await self.primer.prime(prefill, decode)
        for node in prefill + decode:
            node.primed = node.healthy and not node.removed

    def find(self, kind: Kind, address: str) -> Node | None:
        return self.nodes.get((kind, address))

    @staticmethod
    def heard_from(node: Node) -> None:
        """`node` answered a call or sent an output batch: it is alive, however late its Status."""
        node.heard_at = time.monotonic()

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
        """Run `coro` in the background, tracked so stop() can end it."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("router background task failed", exc_info=task.exception())

    # ---- failures -----------------------------------------------------------------------
    def mark_failed(self, node: Node, reason: str) -> None:
        """A node answered UNAVAILABLE or its stream broke: not selectable until a Status
        succeeds; a decode node's requests all end (UNAVAILABLE)."""
        was_up = node.healthy or node.subscription is not None
        node.healthy, node.last_error, node.primed = False, reason, False
        self.primer.forget(node)
        if was_up:
            self._down(node, reason)
        if node.kind != "prefill":  # decode or colocated: its requests' outputs came from it
            sub, node.subscription = node.subscription, None
            if sub is not None and sub is not asyncio.current_task():
                sub.cancel()
            if was_up:
                log.warning("%s node %s failed: %s", node.kind, node.address, reason)
            self.on_decode_failure(node, reason)
        elif was_up:
            log.warning("prefill node %s failed: %s", node.address, reason)

    def _down(self, node: Node, reason: str) -> None:
        """Count `node` taken out of service (it was selectable or streaming until now)."""
        node.downs += 1
        self.downs[node.kind] += 1
        self.recent_downs.append({"at": round(time.time(), 3), "kind": node.kind, "address": node.address,
                                  "reason": reason[:300]})

    def rpc_failed(self, node: Node, err: grpc.aio.AioRpcError, what: str) -> bool:
        """Handle an RPC error from `node`; True when it means the node is unavailable."""
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        self.mark_failed(node, f"{what}: {err.details() or 'unavailable'}")
        return True

    # ---- membership ---------------------------------------------------------------------
    def _directory_changed(self) -> None:
        """Called on the directory writer's thread."""
        loop = self._loop
        if loop is None or loop.is_closed() or self._closing:
            return
        with contextlib.suppress(RuntimeError):  # loop closing
            loop.call_soon_threadsafe(self._schedule_refresh)

    def _schedule_refresh(self) -> None:
        """One refresh at a time; changes made during it get one more round."""
        self._dirty = True
        if self._refresher is None or self._refresher.done():
            self._refresher = self.spawn(self._refresh_while_dirty())

    async def _refresh_while_dirty(self) -> None:
        while self._dirty and not self._closing:
            self._dirty = False
            await self.refresh()

    def _reconcile(self) -> None:
        if self._closing:
            return
        wanted = {(k, a) for k in KINDS for a in self.directory.addresses(k)}
        for key in [k for k in self.nodes if k not in wanted]:
            node = self.nodes.pop(key)
            node.removed = True
            self.mark_failed(node, "removed from the node directory")
            self._retired.append((node, self._round))  # closed later: its Aborts are still to go
        for node, since in list(self._retired):
            if since < self._round - 1 and node.inflight == 0:
                self._retired.remove((node, since))
                self.spawn(node.channel.close(grace=self.rpc_timeout_s))
        for kind, address in wanted - set(self.nodes):
            channel = node_aio_channel(address, self._tls, CHANNEL_OPTIONS)
            stub_cls = {"decode": node_pb2_grpc.DecodeControlStub, "prefill": node_pb2_grpc.PrefillControlStub,
                        "colocated": node_pb2_grpc.ColocatedControlStub}[kind]
            stub = with_secret(stub_cls(channel), self._secret)
            self.nodes[(kind, address)] = Node(kind, address, channel, stub)

    # ---- probing ------------------------------------------------------------------------
    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.status_interval_s)
            try:
                await self.refresh()
            except Exception:  # keep polling whatever one round does
                log.exception("node status poll failed")

    async def _probe(self, node: Node) -> None:
        sent = time.monotonic()
        try:
            status = await node.stub.Status(node_pb2.StatusRequest(), timeout=self.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            node.status_failures[e.code().name] += 1
            if not self.rpc_failed(node, e, "Status") and not self._late_but_kept(node, e, sent):
                reason = f"Status: {e.code().name} {e.details()}"
                if node.healthy:
                    self._down(node, reason)
                node.healthy, node.last_error = False, reason
            return
        if node.removed:
            return
        self.heard_from(node)
        node.status, node.late_status = status, 0
        if not status.healthy:  # the node says so itself: not chosen, its requests go on
            if node.healthy:
                self._down(node, "the node reports itself unhealthy")
            node.healthy, node.last_error = False, "the node reports itself unhealthy"
        elif node.kind == "prefill" or node.subscription is not None:
            node.healthy, node.last_error = True, ""
        else:
            await self._subscribe(node)

    def _late_but_kept(self, node: Node, err: grpc.aio.AioRpcError, sent: float) -> bool:
        """Whether a Status past its deadline (sent at loop time `sent`) leaves `node` selectable:
        it was healthy, and it answered something else meanwhile (busy, not down), or fewer than
        `status_failure_threshold` late answers came in a row with nothing else heard."""
        if err.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
            node.late_status = 0
            return False
        if node.healthy and node.heard_at >= sent:
            node.late_status = 0
            node.last_error = "Status past its deadline while the node answers other calls: busy"
            return True
        node.late_status += 1
        if not node.healthy or node.late_status >= self.status_failure_threshold:
            return False
        node.last_error = f"Status past its deadline ({node.late_status} in a row): busy"
        log.warning("%s node %s: Status past its %.1f s deadline (%d in a row), kept", node.kind, node.address,
                    self.rpc_timeout_s, node.late_status)
        return True

    async def _subscribe(self, node: Node) -> None:
        call = node.stub.Outputs(node_pb2.OutputsRequest(subscriber=self.subscriber))
        try:
            await asyncio.wait_for(call.initial_metadata(), self.rpc_timeout_s)
        except (grpc.aio.AioRpcError, TimeoutError) as e:
            call.cancel()
            node.healthy, node.last_error = False, f"Outputs subscription failed: {e!r}"
            return
        if node.removed or node.subscription is not None:
            call.cancel()
            return
        node.subscription = asyncio.create_task(self._read_outputs(node, call))
        node.healthy, node.last_error = True, ""
        log.info("subscribed to %s node %s", node.kind, node.address)

    async def _read_outputs(self, node: Node, call: Any) -> None:
        reason = "the Outputs stream ended"
        try:
            async for payload in call:
                try:
                    items = read_outputs(payload.msgpack, self.vocab_size)  # a bad item: its request's error
                except MessageError as e:
                    reason = f"sent a malformed output batch ({e})"
                    break
                self.heard_from(node)
                self.on_items(node, items)
        except asyncio.CancelledError:
            call.cancel()
            raise
        except grpc.aio.AioRpcError as e:
            reason = f"the Outputs stream broke: {e.code().name} {e.details() or ''}".rstrip()
        call.cancel()
        if node.subscription is asyncio.current_task() and not self._closing:
            self.mark_failed(node, reason)
