"""Router: the server and every request's driver.

A request's path: a front door (grpc_door.py, http.py) -> `submit` (validate, tokenize;
INVALID_ARGUMENT on failure) -> a driver task (`_drive`): placement (placement.py: reserve on a
decode node D, else the bounded queue, admission.py; prefill on a prefill node P; or the whole
request on a colocated node) -> the tokens, P's first one at once (stream.py) -> one terminal.
A lost placement raises `AttemptLost` in the driver, which migrates the request (migration.py)
and places it again.

The driver task is the only writer of a request's placement; anything else ends a request by
`RequestState.interrupt` (client Abort, client cancel, router stop), which cancels the driver.
A decode node failure only `lose`s its requests' placements: each driver, awaiting that node
(`unless_lost`), wakes up and migrates. `_driver_done` runs however the driver ended: it sends
the terminal if none was sent (the terminal guarantee) and `_release` frees what nodes still
hold (`Holds.release`).

Careful: node-side request ids are per attempt (`router/request/attempt`), so an old
attempt's late output items can never reach a retried one. `router` is this instance's id
(`router_id`, new at every start) and also its Outputs subscriber name: a decode node drops an
instance's requests when that instance's last Outputs stream to it ends (decode_node/node.py,
"Owners"), so requests of a router that died (and was restarted by Ray) never hold KV blocks.
Nothing here may block the loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from functools import partial
from typing import Any

import grpc

from protos import pdserve_pb2
from protos.tls import NodeTls
from router import grpc_door
from router.admission import Admission
from router.auth import authorized
from router.config import RouterConfig
from router.directory import NodeDirectory
from router.holds import Holds
from router.http import HttpServer, build_app
from router.metrics import RouterMetrics, merge_expositions
from router.migration import AttemptLost, Migration
from router.placement import Placement
from router.policy import Policy, policy_for
from router.pool import Node, NodePool
from router.request import Interrupt, RequestError, RequestState, is_terminal
from router.stream import Stream
from router.ttft import Timeline
from router.validate import InvalidRequest, Limits, prepare

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 2.0
YOUNG_GC_THRESHOLD = 10_000  # the router process's (`freeze_heap`); Python's default is 700
PEER_METRICS_TIMEOUT_S = 2.0


class Router:
    def __init__(self, model: Any, directory: NodeDirectory, config: RouterConfig | None = None, *,
                 max_model_len: int | None = None, num_speculative_tokens: int | None = None,
                 policy: Policy | None = None, cluster_secret: str | None = None, node_tls: NodeTls | None = None,
                 block_size: int = 16) -> None:
        """`model`: engine.model.info.ModelInfo (name, config, tokenizer, eos_token_ids).
        `max_model_len`: the context the nodes serve (default min(model positions, 4096)).
        `num_speculative_tokens`: for ListModels (default: what decode nodes report).
        `cluster_secret`: sent on every call to a node (nodes refuse calls without it).
        `node_tls`: mutual TLS on the node channels (protos/tls.py; None: plain text).
        `block_size`: the nodes' KV block size (the prefix policy's chunk of a prompt)."""
        self.config = config or RouterConfig()
        self.model = model
        self.max_model_len = max_model_len or min(model.config.max_position_embeddings, 4096)
        self.num_speculative_tokens = num_speculative_tokens
        self.limits = Limits(model.name, model.config.vocab_size, self.max_model_len,
                             self.config.max_prompt_bytes, self.config.default_timeout_s)
        self.policy = policy or policy_for(self.config, block_size)
        self.router_id = uuid.uuid4().hex[:8]
        self.pool = NodePool(
            directory, vocab_size=model.config.vocab_size, subscriber=self.router_id,
            status_interval_s=self.config.status_interval_s, rpc_timeout_s=self.config.rpc_timeout_s,
            status_failure_threshold=self.config.status_failure_threshold, on_items=lambda node, items: self.holds.deliver(node, items),
            on_decode_failure=self._on_decode_failure, on_capacity=self._on_capacity,
            cluster_secret=cluster_secret, node_tls=node_tls)
        self.requests: dict[str, RequestState] = {}  # by client request id, in flight
        self.metrics = RouterMetrics(model.name, lambda: self.num_queued, lambda: len(self.requests),
                                     lambda: list(self.pool.nodes.values()), lambda: self.pool.downs)
        self.holds = Holds(self.pool, self.config.rpc_timeout_s)
        self.admission = Admission(self.router_id, self.config, self.pool, self.policy, self.holds)
        self.placement = Placement(self.config, model.config.vocab_size, self.pool, self.policy,
                                   self.admission, self.holds,
                                   lambda n, why: self.metrics.prefill_abandoned.labels(model.name, why).inc(n))
        self.migration = Migration(self.config, self.metrics, self.holds)
        self.stream = Stream(self.metrics, self.holds)
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._server: grpc.aio.Server | None = None
        self._serving = False
        self.counts: Counter[str] = Counter()  # terminal kinds ("finished:stop", "error:UNAVAILABLE", ...)
        # the other router processes' /metrics text (a service of several: deploy/router_actor.py)
        self.peer_metrics: Callable[[], Awaitable[list[bytes]]] | None = None
        self.http: HttpServer | None = None
        self.grpc_port: int | None = None  # bound ports, once serving
        self.http_port: int | None = None

    # ---- server lifecycle -----------------------------------------------------------------
    async def start(self, port: int | None = None, host: str | None = None, http_port: int | None = -1) -> int:
        """Connect to the nodes (one Status round and the decode subscriptions), then serve gRPC
        and, unless `http_port` (default: the config's) is None, HTTP (`http.py`); returns the
        bound gRPC port (`port=0`: any free one; the HTTP one is `self.http_port`)."""
        host = host if host is not None else self.config.host
        port = port if port is not None else self.config.port
        http_port = self.config.http_port if http_port == -1 else http_port
        if getattr(self.model.tokenizer, "has_chat_template", False):  # compiled here, not on the first chat request
            self.model.tokenizer.prepare_chat_template()
        self._server, bound = grpc_door.serve(self, host, port)
        self.grpc_port = bound
        await self.pool.start()
        await self._server.start()
        if http_port is not None:
            self.http = HttpServer(build_app(self), self.config.tls_cert, self.config.tls_key)
            self.http_port = await self.http.start(host, http_port, reuse_port=self.config.processes > 1)
        self._serving = True
        tls = "TLS" if self.config.tls_cert else "plain text"
        log.info("router %s serving %s on %s port %d (gRPC, %s)", self.router_id, self.model.name, host, bound, tls)
        return bound

    async def stop(self) -> None:
        """End every request (UNAVAILABLE), free what nodes hold for them, stop serving."""
        self._serving = False
        drivers = [st.task for st in self.requests.values() if st.task is not None]
        for st in list(self.requests.values()):
            st.interrupt(Interrupt("UNAVAILABLE", "the router is shutting down"))
        await asyncio.gather(*drivers, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(SHUTDOWN_GRACE_S)
        if self.http is not None:
            await self.http.stop()
        await self.pool.drain(self.config.rpc_timeout_s)  # the Aborts just sent
        await self.placement.streams.close()
        await self.pool.stop()

    async def refresh(self) -> None:
        """Poll every node's Status and reconcile membership now (also runs periodically)."""
        await self.pool.refresh()

    @property
    def num_queued(self) -> int:
        return len(self.admission.queue)

    @property
    def migrations(self) -> int:
        """Requests moved to another decode node (each move counts)."""
        return self.migration.count

    # ---- the one lifecycle behind every front door ------------------------------------------
    async def submit(self, request: pdserve_pb2.GenerateRequest, timeline: Timeline | None = None) -> RequestState:
        """Validate, tokenize and start `request`; raises RequestError (INVALID_ARGUMENT, or
        UNAVAILABLE when not serving) if it is refused before it starts. Read its messages with
        `responses`, which must be closed (aclosing) so a gone client frees the request.
        `timeline`: the door's, begun at its receipt of the request (router/ttft.py)."""
        timeline = timeline or Timeline()
        timeline.lap("parse")
        if not self._serving:
            raise RequestError("UNAVAILABLE", "the router is not serving")
        try:
            prep = await prepare(request, self.model.tokenizer, tuple(self.model.eos_token_ids),
                                 self.limits, self._rng)
            if prep.request_id in self.requests:
                raise InvalidRequest(f"request id {prep.request_id!r} is already in flight")
        except InvalidRequest as e:
            self.refused("INVALID_ARGUMENT")
            raise RequestError("INVALID_ARGUMENT", str(e)) from None
        st = RequestState(prep, self.model.tokenizer, timeline=timeline)
        timeline.lap("tokenize")
        self.requests[prep.request_id] = st
        self.metrics.started(st)
        st.task = asyncio.create_task(self._drive(st))
        st.task.add_done_callback(partial(self._driver_done, st))
        return st

    def refused(self, code: str) -> None:
        """Count a request refused before it started (a front door's own checks included)."""
        self.counts["invalid" if code == "INVALID_ARGUMENT" else f"refused:{code}"] += 1
        self.metrics.refused(code)

    async def responses(self, st: RequestState) -> AsyncGenerator[pdserve_pb2.GenerateResponse, None]:
        """`st`'s messages until the terminal one; closing it early cancels the request. A door asks
        for the next message once it has written the last one: that is when the first token's
        TTFT ends (closed after a terminal first message: written too; closed otherwise: the client
        went away, and no TTFT is observed)."""
        try:
            while True:
                msg = await st.out.get()
                first = bool(msg.token_ids) and not st.timeline.written
                try:
                    yield msg
                except GeneratorExit:
                    if first and is_terminal(msg):
                        self.metrics.first_token_written(st)
                    raise
                if first:
                    self.metrics.first_token_written(st)
                if is_terminal(msg):
                    return
        finally:
            st.interrupt(Interrupt("CANCELLED", "the client cancelled"))

    async def abort(self, request_id: str) -> bool:
        st = self.requests.get(request_id)
        return st is not None and st.interrupt(Interrupt(None))

    async def _drive(self, st: RequestState) -> None:
        try:
            async with asyncio.timeout(st.prep.timeout_s):
                while True:
                    try:
                        if not await self.admission.await_listed():
                            raise RequestError("UNAVAILABLE", "the service lists no node (is it starting?)")
                        if self.placement.colocated:
                            await self.placement.place_colocated(st)
                            await self.stream.run(st, None)
                        else:
                            placed = await self.placement.place(st)
                            await self.stream.run(st, placed.first, placed.confirm)
                        return
                    except AttemptLost as e:
                        self.migration.move(st, str(e))
        except TimeoutError:
            st.fail("DEADLINE_EXCEEDED", f"request {st.request_id!r} passed its {st.prep.timeout_s:g} s deadline")
        except RequestError as e:
            moving = f"; it was moving off a lost decode node ({st.moved_from})" if st.moved_from else ""
            st.fail(e.code, e.message + moving)

    def _driver_done(self, st: RequestState, task: asyncio.Task[None]) -> None:
        """Runs however the driver ended (even cancelled before it started): the terminal
        guarantee, then free what the nodes hold."""
        if not st.done:
            reason = st.interrupt_reason
            error = None if task.cancelled() else task.exception()
            if reason is not None:
                if reason.code == "CANCELLED":
                    st.close_cancelled()
                elif reason.code is None:
                    st.finish("abort")
                else:
                    st.fail(reason.code, reason.message)
            elif error is not None:
                log.error("request %s failed in the router", st.request_id, exc_info=error)
                st.fail("INTERNAL", f"router error: {error!r}")
            else:
                st.fail("INTERNAL", "the request ended without a result")
        self._release(st)

    def _release(self, st: RequestState) -> None:
        if self.requests.get(st.request_id) is st:
            del self.requests[st.request_id]
        self.holds.release(st, st.terminal or "ended")
        self.counts[st.terminal or "none"] += 1
        self.metrics.ended(st)
        self.admission.queue.wake_one()

    # ---- node callbacks (from the NodePool) -----------------------------------------------
    def _on_decode_failure(self, node: Node, reason: str) -> None:
        for st in list(self.requests.values()):
            if st.decode is node:
                st.lose(f"decode node {node.address} failed: {reason}")

    def _on_capacity(self) -> None:
        self.admission.queue.wake_one()

    # ---- metrics / Health / ListModels ------------------------------------------------------
    async def metrics_text(self) -> tuple[bytes, str]:
        """`/metrics`: this process's figures, plus the other router processes' (summed) when the
        service runs several; a process that does not answer in PEER_METRICS_TIMEOUT_S is left out."""
        body, content_type = self.metrics.exposition()
        if self.peer_metrics is None:
            return body, content_type
        try:
            others = await asyncio.wait_for(self.peer_metrics(), PEER_METRICS_TIMEOUT_S)
        except Exception as e:  # a peer restarting: this process's figures, and say so in the log
            log.warning("other router processes' metrics not read: %r", e)
            return body, content_type
        return merge_expositions(body, others), content_type

    def health(self, nodes: bool = False) -> pdserve_pb2.HealthResponse:
        """Serving or not, and the counts; `nodes`: every node's last Status too (free KV blocks,
        running, queued, last error), so a leak is visible from outside."""
        p, d, c = (len(self.pool.healthy(kind)) for kind in ("prefill", "decode", "colocated"))
        out = pdserve_pb2.HealthResponse(serving=self._serving and ((p > 0 and d > 0) or c > 0), prefill_nodes=p,
                                         decode_nodes=d, colocated_nodes=c, running_requests=len(self.requests),
                                         queued_requests=self.num_queued)
        if nodes:
            out.nodes.extend(n.health() for _, n in sorted(self.pool.nodes.items()))
        return out

    def health_detail_allowed(self, authorization: str | None) -> bool:
        """Per-node detail needs the API key when one is set (the summary stays open)."""
        key = self.config.api_key
        return key is None or authorized(authorization, key)

    def list_models(self) -> pdserve_pb2.ListModelsResponse:
        k = self.num_speculative_tokens
        if k is None:
            nodes = self.pool.healthy("decode") + self.pool.healthy("colocated")
            k = max((n.status.num_speculative_tokens for n in nodes if n.status), default=0)
        info = pdserve_pb2.ModelInfo(name=self.model.name, max_model_len=self.max_model_len,
                                     num_speculative_tokens=k)
        return pdserve_pb2.ListModelsResponse(models=[info])


def freeze_heap() -> None:
    """Exclude everything alive now (the model info, the tokenizer, imported modules: hundreds of
    thousands of objects) from the garbage collector's full passes, as vLLM's API server does.
    Call once in a router's own process when it serves: each full collection otherwise walks that
    heap (~100 ms with SmolLM2's tokenizer), stalling every stream, and at saturation full
    collections come every few seconds. The youngest generation is collected after YOUNG_GC_THRESHOLD
    net new container objects, not 700: every output item and SSE event makes and drops some, and
    with 700 a collection came every few steps, each walking the requests' live state (objects that
    die young cost no collection; those are nearly all of a stream's)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, *gc.get_threshold()[1:])

