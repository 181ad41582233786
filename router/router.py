"""Router: the gRPC front door and every request's lifecycle.

A request's path through this file:
  Generate -> prepare (validate, tokenize; INVALID_ARGUMENT on failure) -> a driver task:
  reserve on a decode node D (policy order; all refuse -> bounded FIFO queue; full ->
  RESOURCE_EXHAUSTED) -> Prefill on a prefill node P (UNAVAILABLE -> abort on D, re-reserve,
  another P) -> P's first token streamed at once -> D's output items (routed here by the
  NodePool's one Outputs subscription per D) -> detokenize, stop strings -> one terminal.
A colocated service (the directory lists colocated nodes) places the whole request on one node
instead (Submit: admitted or refused as a reservation is, queued alike), and every token, the
first included, comes on that node's output stream; a colocated node is a decode node in every
other respect (its loss migrates its requests to another one).
A lost placement (D's stream broke, P could not reach D, D reported the attempt failed) raises
`AttemptLost` in the driver, which migrates the request (`router.migrate`): the old attempt is
aborted and the driver places it again with prompt + tokens already streamed, at most
`router.max_migrations` times, else one UNAVAILABLE terminal.

The driver task is the only writer of a request's placement; anything else ends a request by
`RequestState.interrupt` (client Abort, client cancel, router stop), which cancels the driver.
A decode node failure only `lose`s its requests' placements: each driver, awaiting that node
(`_unless_lost`), wakes up and migrates. `_driver_done` runs however the driver ended: it sends
the terminal if none was sent (the terminal guarantee) and `_release` frees what nodes still
hold (Abort to D unless D already ended the request, Abort to P if a Prefill call was
outstanding).

Careful: node-side request ids are per attempt (`router/request/attempt`), so an old
attempt's late output items can never reach a retried one. `router` is this instance's id
(`router_id`, new at every start) and also its Outputs subscriber name: a decode node drops an
instance's requests when that instance's last Outputs stream to it ends (decode_node/node.py,
"Owners"), so requests of a router that died (and was restarted by Ray) never hold KV blocks. Nothing here may block the loop.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any

import grpc

from deploy.config import RouterConfig
from protos import node_pb2, pdserve_pb2, pdserve_pb2_grpc
from protos.messages import FirstToken, MessageError, OutputItem, TokenLogprobs
from protos.tls import NodeTls
from router.admission import AdmissionQueue
from router.auth import ApiKeyInterceptor, authorized
from router.directory import NodeDirectory
from router.grpc_health import add_health_servicer
from router.http import HttpServer, build_app
from router.metrics import RouterMetrics, merge_expositions
from router.policy import Policy, make_policy
from router.pool import MAX_MESSAGE_BYTES, Node, NodePool
from router.request import Interrupt, RequestError, RequestState, is_terminal
from router.tls import server_credentials
from router.validate import InvalidRequest, Limits, prepare

log = logging.getLogger(__name__)

MAX_DRAFTS = 64  # bound on drafts in a first-token message (the router ignores them)
SHUTDOWN_GRACE_S = 2.0
NODE_WAIT_POLL_S = 0.05  # how often a request waiting for a healthy node looks again
PEER_METRICS_TIMEOUT_S = 2.0


class AttemptLost(Exception):
    """This placement of a request is lost (its decode node failed or gave up on it); the
    request may move to another decode node."""


class Router:
    def __init__(self, model: Any, directory: NodeDirectory, config: RouterConfig | None = None, *,
                 max_model_len: int | None = None, num_speculative_tokens: int | None = None,
                 policy: Policy | None = None, cluster_secret: str | None = None, node_tls: NodeTls | None = None,
                 block_size: int = 16) -> None:
        """`model`: engine.loader.ModelInfo (name, config, tokenizer, eos_token_ids).
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
        self.policy = policy or make_policy(self.config.policy, **prefix_options(self.config, block_size))
        self.router_id = uuid.uuid4().hex[:8]
        self.pool = NodePool(
            directory, vocab_size=model.config.vocab_size, subscriber=self.router_id,
            status_interval_s=self.config.status_interval_s, rpc_timeout_s=self.config.rpc_timeout_s,
            status_failure_threshold=self.config.status_failure_threshold, on_items=self._on_items, on_decode_failure=self._on_decode_failure,
            on_capacity=self._on_capacity, cluster_secret=cluster_secret, node_tls=node_tls)
        self.requests: dict[str, RequestState] = {}  # by client request id, in flight
        self._by_node_rid: dict[str, RequestState] = {}
        self._queue = AdmissionQueue(self.config.queue_size)
        self._rng = random.Random(int.from_bytes(os.urandom(8), "little"))
        self._server: grpc.aio.Server | None = None
        self._serving = False
        self.counts: Counter[str] = Counter()  # terminal kinds ("finished:stop", "error:UNAVAILABLE", ...)
        self.migrations = 0  # requests moved to another decode node (each move counts)
        self.metrics = RouterMetrics(model.name, lambda: len(self._queue), lambda: len(self.requests),
                                     lambda: list(self.pool.nodes.values()))
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
        bound = self.grpc_port = self._serve_grpc(host, port)
        await self.pool.start()
        assert self._server is not None
        await self._server.start()
        if http_port is not None:
            self.http = HttpServer(build_app(self), self.config.tls_cert, self.config.tls_key)
            self.http_port = await self.http.start(host, http_port, reuse_port=self.config.processes > 1)
        self._serving = True
        tls = "TLS" if self.config.tls_cert else "plain text"
        log.info("router %s serving %s on %s port %d (gRPC, %s)", self.router_id, self.model.name, host, bound, tls)
        return bound

    def _serve_grpc(self, host: str, port: int) -> int:
        """Build the gRPC server (API-key interceptor, TLS when configured) and bind it to
        `host` only; returns the bound port."""
        key, cert = self.config.api_key, self.config.tls_cert
        creds = server_credentials(cert, self.config.tls_key or "") if cert else None  # read first: clear errors
        self._server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
                                       interceptors=[ApiKeyInterceptor(key)] if key else None)
        pdserve_pb2_grpc.add_GenerationServicer_to_server(_Servicer(self), self._server)
        add_health_servicer(self._server, lambda: self.health().serving)  # grpc.health.v1 (k8s probes)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if creds is None:
            return self._server.add_insecure_port(address)
        return self._server.add_secure_port(address, creds)

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
        await self.pool.stop()

    async def refresh(self) -> None:
        """Poll every node's Status and reconcile membership now (also runs periodically)."""
        await self.pool.refresh()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    # ---- Generate: the one lifecycle behind every front door (gRPC here, HTTP in http.py) ----
    async def generate(self, request: pdserve_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pdserve_pb2.GenerateResponse]:
        try:
            st = await self.submit(request)
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        async with aclosing(self.responses(st)) as msgs:
            async for msg in msgs:
                yield msg

    async def submit(self, request: pdserve_pb2.GenerateRequest) -> RequestState:
        """Validate, tokenize and start `request`; raises RequestError (INVALID_ARGUMENT, or
        UNAVAILABLE when not serving) if it is refused before it starts. Read its messages with
        `responses`, which must be closed (aclosing) so a gone client frees the request."""
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
        st = RequestState(prep, self.model.tokenizer)
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
        """`st`'s messages until the terminal one; closing it early cancels the request."""
        try:
            while True:
                msg = await st.out.get()
                yield msg
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
                        first = None
                        if self._colocated:
                            await self._place_colocated(st)
                        else:
                            first = await self._place(st)
                        await self._stream(st, first)
                        return
                    except AttemptLost as e:
                        self._migrate(st, str(e))
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

    # ---- migration ------------------------------------------------------------------------
    def _migrate(self, st: RequestState, reason: str) -> None:
        """Give up a lost placement (Abort to its D if D may still hold it); RequestError when the
        request may not move again, else the driver places it anew (resume_prompt)."""
        self._spawn_abort_decode(st, f"migrating: {reason}")
        if not self.config.migrate:
            raise RequestError("UNAVAILABLE", reason)
        if len(st.choices) > 1 and st.num_tokens:
            raise RequestError("UNAVAILABLE", f"{reason} (a request of n > 1 choices does not move once it "
                                              f"has streamed tokens)")
        if st.migrations >= self.config.max_migrations:
            raise RequestError("UNAVAILABLE", f"{reason} (the request already moved {st.migrations} times, "
                                              f"router.max_migrations)")
        st.migrations += 1
        st.moved_from = reason
        self.migrations += 1
        self.metrics.migrations.inc()
        log.info("request %s moves to another decode node after %d tokens: %s", st.request_id,
                 len(st.tokens), reason)

    async def _unless_lost(self, st: RequestState, aw: Any) -> Any:
        """`await aw`, unless the placement is lost first: then `aw` is cancelled, AttemptLost."""
        task, lost = asyncio.ensure_future(aw), st.lost
        if lost is None:
            return await task
        try:
            await asyncio.wait((task, lost), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not task.done():
                task.cancel()  # also when the driver itself was cancelled
        if task.done() and not task.cancelled():
            return task.result()
        raise AttemptLost(lost.result())

    # ---- placement: reserve on D, prefill on P (or the whole request on a colocated node) ----
    @property
    def _colocated(self) -> bool:
        """Whether this is a colocated service: its directory lists colocated nodes."""
        return bool(self.pool.directory.addresses("colocated"))

    async def _place_colocated(self, st: RequestState) -> None:
        """Submit the whole request to a colocated node (policy order; all refuse -> the queue, as a
        decode reservation); every token comes on its output stream (`_stream` with no first token)."""
        st.attempt += 1
        start = time.monotonic()
        await self._reserve(st, st.attempt, st.resume_prompt(), st.resume_sampling(), "colocated")
        self.metrics.reserve_time.observe(time.monotonic() - start)

    async def _place(self, st: RequestState) -> FirstToken:
        tried: dict[str, str] = {}
        prompt, sampling = st.resume_prompt(), st.resume_sampling()
        for _ in range(self.config.prefill_retries + 1):
            placed = await self._place_overlapped(st, prompt, sampling, tried) if self._may_overlap(tried) else None
            if not isinstance(placed, tuple):  # reserve first: others wait in the queue, no node admitted,
                placed = await self._place_in_turn(st, prompt, sampling, tried, asked=placed)  # or a TP P
            prefill, payload = placed
            if payload is not None:
                return self._read_first(st, prefill, payload)
            tried[prefill.address] = prefill.last_error or "unavailable"
            await self._abort_decode(st, "the prefill node failed; retrying elsewhere")
        raise RequestError("UNAVAILABLE", _no_prefill_message(tried))

    def _may_overlap(self, tried: dict[str, str]) -> bool:
        """Whether to reserve while the prefill node computes (`router.overlap_reserve`): not while
        requests wait for a decode node (they go first), and only with a decode and a prefill node
        to ask."""
        return (self.config.overlap_reserve and not len(self._queue) and bool(self.pool.healthy("decode"))
                and any(n.address not in tried for n in self.pool.healthy("prefill")))

    async def _place_in_turn(self, st: RequestState, prompt: list[int], sampling: node_pb2.Sampling,
                             tried: dict[str, str], asked: int | None = None) -> tuple[Node, node_pb2.Payload | None]:
        """Reserve on a decode node (queueing if none admits), then prefill with its descriptor.
        `asked`: every decode node refused at this queue epoch already (`_reserve`)."""
        start = time.monotonic()
        decode, descriptor, prefill, work = await self._reserve_pair(st, prompt, sampling, tried, asked)
        reserved = time.monotonic()
        self.metrics.reserve_time.observe(reserved - start)
        req = node_pb2.PrefillRequest(
            request_id=st.node_rid, prompt_token_ids=prompt, sampling=sampling,
            descriptor_msgpack=descriptor, decode_address=decode.address)
        self._hold_prefill(st, prefill, work)  # still held if the driver is cancelled: _release aborts P
        payload = await self._await_prefill(st, prefill, prefill.stub.Prefill(req))
        self.metrics.prefill_time.observe(time.monotonic() - reserved)
        return prefill, payload

    async def _place_overlapped(self, st: RequestState, prompt: list[int], sampling: node_pb2.Sampling,
                                tried: dict[str, str]) -> tuple[Node, node_pb2.Payload | None] | int | None:
        """Prefill without a descriptor while reserving on a decode node, then hand P the descriptor
        (Attach). When no decode node admitted at once, P's job is given up and the answer is the
        router queue's epoch before they were asked: the caller reserves first (queueing), without
        asking them again unless capacity news came since; None when the prefill node takes no
        Attach (tensor parallel): the caller reserves first. AttemptLost when P could not take the
        descriptor."""
        prefill, work = self._choose_prefill(prompt, exclude=tried)
        if prefill.status is None or not prefill.status.takes_attach:  # a TP prefill node: reserve first
            return None
        st.attempt += 1
        reserve, start = self._reserve_request(st, st.attempt, prompt, sampling), time.monotonic()
        rid = reserve.request_id
        self._hold_prefill(st, prefill, work)
        call = asyncio.ensure_future(prefill.stub.Prefill(node_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids=prompt, sampling=sampling)))
        seen = self._queue.epoch
        try:
            found = await self._try_reserve(st, reserve, "decode")
        except BaseException:
            self._give_up_prefill(st, prefill, rid, call, "the reservation failed")
            raise
        if found is None:
            self._give_up_prefill(st, prefill, rid, call, "no decode node admitted the request at once")
            return seen
        self.metrics.reserve_time.observe(time.monotonic() - start)
        decode, descriptor = found
        attach = asyncio.ensure_future(prefill.stub.Attach(node_pb2.AttachRequest(
            request_id=rid, descriptor_msgpack=descriptor, decode_address=decode.address),
            timeout=self.config.rpc_timeout_s))
        try:
            payload = await self._await_prefill(st, prefill, call)
        except BaseException:
            attach.cancel()
            raise
        self.metrics.prefill_time.observe(time.monotonic() - start)
        if payload is not None:
            await self._attached(prefill, rid, attach)
        else:
            attach.cancel()
        return prefill, payload

    async def _attached(self, prefill: Node, rid: str, attach: asyncio.Future) -> None:
        """The Attach call's end; AttemptLost when P did not take the descriptor (its KV and first
        token then never reach the decode node, whose reservation is given up by the migration).
        Either way P is told to drop the job, which it would otherwise hold until the KV timeout."""
        try:
            await attach
        except asyncio.CancelledError:
            self.pool.spawn(self._send_abort(prefill, rid, "the request ended before its KV descriptor went out"))
            raise
        except grpc.aio.AioRpcError as e:
            self.pool.rpc_failed(prefill, e, "Attach")
            self.pool.spawn(self._send_abort(prefill, rid, "its KV descriptor was not taken"))
            raise AttemptLost(f"prefill node {prefill.address} did not take the KV descriptor: {e.details()}") from None

    def _give_up_prefill(self, st: RequestState, prefill: Node, rid: str, call: asyncio.Future, reason: str) -> None:
        call.cancel()
        self._drop_prefill(st)
        self.pool.spawn(self._send_abort(prefill, rid, reason))

    async def _reserve_pair(self, st: RequestState, prompt: list[int], sampling: node_pb2.Sampling,
                            tried: dict[str, str], asked: int | None = None) -> tuple[Node, bytes, Node, int]:
        """A decode reservation and the prefill node to fill it (with its work). When every prefill
        node went down while the reservation waited (node restarts), the reservation is given back
        and the request waits for one (`_await_node`, at most `node_wait_s` each time) rather than
        failing; the driver's deadline bounds the whole."""
        while True:
            if not await self._await_node("prefill", tried):
                raise RequestError("UNAVAILABLE", _no_prefill_message(tried))  # before reserving
            st.attempt += 1
            decode, descriptor = await self._reserve(st, st.attempt, prompt, sampling, asked=asked)
            asked = None
            try:
                prefill, work = self._choose_prefill(prompt, exclude=tried)
            except RequestError:
                await self._abort_decode(st, "no prefill node is up now; reserving again once one is")
                continue
            return decode, descriptor, prefill, work

    async def _await_prefill(self, st: RequestState, prefill: Node, call: Awaitable[Any]) -> node_pb2.Payload | None:
        """The Prefill call's answer (the caller held the prefill node); None when the prefill node is
        unavailable (try another). AttemptLost when the decode node fails meanwhile (the call is
        cancelled and P told to drop it), or P could not reach it (FAILED_PRECONDITION)."""
        try:
            payload: node_pb2.Payload = await self._unless_lost(st, call)
        except AttemptLost:
            self._drop_prefill(st)
            self.pool.spawn(self._send_abort(prefill, st.node_rid, "the decode node was lost"))
            raise
        except grpc.aio.AioRpcError as e:
            self._drop_prefill(st)
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise AttemptLost(f"prefill node {prefill.address}: {e.details()}") from None
            if not self.pool.rpc_failed(prefill, e, "Prefill"):
                raise RequestError(e.code().name, f"prefill node {prefill.address}: {e.details()}") from None
            return None
        self._drop_prefill(st)
        return payload

    def _choose_prefill(self, prompt: list[int], exclude: dict[str, str]) -> tuple[Node, int]:
        """The prefill node to use, and the prompt tokens it is expected to compute."""
        nodes = [n for n in self.pool.healthy("prefill") if n.address not in exclude]
        for load in self.policy.order_prefill([n.load() for n in nodes], prompt):
            node = self.pool.find("prefill", load.address)
            if node is not None:
                return node, self.policy.routed(node.address, prompt)
        raise RequestError("UNAVAILABLE", _no_prefill_message(exclude))

    async def _reserve(self, st: RequestState, attempt: int, prompt: list[int], sampling: node_pb2.Sampling,
                       kind: str = "decode", asked: int | None = None) -> tuple[Node, bytes]:
        """Reserve on the first decode node (policy order) that admits, or submit to the first
        colocated one (`kind`); queue when none does. `asked`: every node refused at this queue
        epoch already; unless capacity news came since, the request queues without asking again."""
        # FIFO: do not pass those already waiting
        wait, front = len(self._queue) > 0 or (asked is not None and self._queue.epoch == asked), False
        req = self._reserve_request(st, attempt, prompt, sampling)
        while True:
            if not wait:
                seen = self._queue.epoch
                found = await self._try_reserve(st, req, kind)
                if found is not None:
                    if len(self._queue):
                        self._queue.wake_one()  # capacity may remain for the next one
                    return found
                if self._queue.epoch != seen:  # capacity news came while the nodes were asked,
                    continue  # and no waiter was there to take it: ask again, do not wait for more
            wait = False
            if not await self._queue.wait(front):
                raise RequestError("RESOURCE_EXHAUSTED", f"no {kind} node can admit the request now and the "
                                   f"router's queue ({self._queue.size}) is full")
            front = True

    def _reserve_request(self, st: RequestState, attempt: int, prompt: list[int],
                         sampling: node_pb2.Sampling) -> node_pb2.ReserveRequest:
        """The Reserve (or Submit) of an attempt; its id is the one P and D know the attempt by."""
        return node_pb2.ReserveRequest(request_id=f"{self.router_id}/{st.request_id}/{attempt}",
                                       prompt_len=len(prompt), sampling=sampling, prompt_token_ids=prompt)

    async def _await_node(self, kind: str, exclude: dict[str, str] | None = None) -> bool:
        """Whether a healthy `kind` node (not in `exclude`) is there, waiting up to
        `node_wait_s` for one to come (back); never longer, so a dead service still answers."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.node_wait_s
        while not any(n.address not in (exclude or {}) for n in self.pool.healthy(kind)):  # type: ignore[arg-type]
            if loop.time() >= deadline:
                return False
            await asyncio.sleep(NODE_WAIT_POLL_S)
        return True

    async def _try_reserve(self, st: RequestState, req: node_pb2.ReserveRequest,
                           kind: str) -> tuple[Node, bytes] | None:
        if not await self._await_node(kind):
            raise RequestError("UNAVAILABLE", f"no healthy {kind} node")
        nodes = self.pool.healthy(kind)  # type: ignore[arg-type]
        node_rid = req.request_id
        for load in self.policy.order_decode([n.load() for n in nodes]):
            node = self.pool.find(kind, load.address)  # type: ignore[arg-type]
            if node is None or not node.healthy:
                continue
            self._hold_decode(st, node, node_rid)  # before the call: a cancel mid-call still aborts
            call = node.stub.Submit if kind == "colocated" else node.stub.Reserve
            try:
                reply = await call(req, timeout=self.config.rpc_timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.INVALID_ARGUMENT:  # the request itself: no node takes it
                    self._drop_decode(st)
                    raise RequestError("INVALID_ARGUMENT", f"{kind} node {node.address}: {e.details()}") from None
                if self.pool.rpc_failed(node, e, "Submit" if kind == "colocated" else "Reserve"):
                    self._drop_decode(st)
                else:  # it may have admitted: abort to be sure
                    self._spawn_abort_decode(st, "Reserve failed")
                continue
            if reply.admitted:
                return node, reply.descriptor_msgpack
            self._drop_decode(st)
        return None

    def _read_first(self, st: RequestState, prefill: Node, payload: node_pb2.Payload) -> FirstToken:
        try:
            first = FirstToken.unpack(payload.msgpack, self.model.config.vocab_size, MAX_DRAFTS)
        except MessageError as e:
            raise RequestError("INTERNAL", f"prefill node {prefill.address} sent a bad first token: {e}") from None
        if first.request_id != st.node_rid:
            raise RequestError("INTERNAL", f"prefill node {prefill.address} answered for {first.request_id!r}")
        return first

    # ---- streaming ------------------------------------------------------------------------
    async def _stream(self, st: RequestState, first: FirstToken | None) -> None:
        """Stream the first token (from P; None on a colocated node, where it is an output item
        too), then the node's output items until every choice has ended (router/request.py)."""
        if first is not None:
            ch = st.choices[0]
            ch.node_done = first.finished is not None  # D sends no terminal for it
            st.decode_live = not all(c.node_done for c in st.choices)
            st.set_prompt_logprobs(first.prompt_logprobs)
            complete = self._add_tokens(st, [first.token], first.logprobs)
            if first.finished or complete:
                st.finish_choice(0, "stop" if ch.text.stopped else first.finished or ch.stop_reason)
                self._stop_choice(st, 0)
        while not st.done:
            self._on_item(st, await self._next_item(st))

    def _on_item(self, st: RequestState, item: OutputItem) -> None:
        """One output item of choice `item.index`; AttemptLost when the node gave up the attempt."""
        if item.index >= len(st.choices):
            raise RequestError("INTERNAL", f"{st.decode.kind if st.decode else 'a'} node sent choice "
                                           f"{item.index} of a request of {len(st.choices)}")
        ch = st.choices[item.index]
        st.steps, st.accepted = st.steps + item.steps, st.accepted + item.accepted
        if item.error is not None and not item.malformed:  # the node ended every choice of this attempt
            for c in st.choices:  # (an item refused here: the node may still hold it, Abort goes)
                c.node_done = True
        ch.node_done = ch.node_done or item.finish_reason is not None
        st.decode_live = not all(c.node_done for c in st.choices)
        if ch.finish_reason is not None and item.error is None:
            return  # the router ended this choice already: late tokens
        st.set_prompt_logprobs(item.prompt_logprobs)  # a colocated node's first item
        complete = self._add_tokens(st, item.tokens, item.logprobs, item.index)
        if ch.text.stopped and ch.finish_reason is None:
            st.finish_choice(ch.index, "stop")
        if item.error is not None and not st.done:  # D gave up on this attempt (its KV never came, ...)
            assert st.decode is not None  # or sent an item refused here: move it
            raise AttemptLost(f"{st.decode.kind} node {st.decode.address}: {item.error}")
        if ch.finish_reason is not None:
            pass  # ended here already (a stop string, or earlier)
        elif item.finish_reason is not None:
            st.finish_choice(ch.index, item.finish_reason)
        elif complete:
            st.finish_choice(ch.index, ch.stop_reason)
        self._stop_choice(st, ch.index)

    def _stop_choice(self, st: RequestState, index: int) -> None:
        """A choice of an n > 1 request the router ended while the node still runs it: abort that
        choice alone (`{node id}#{index}`), so its siblings go on. With n = 1 the request's own end
        does it (`_release`)."""
        ch = st.choices[index]
        if len(st.choices) == 1 or ch.finish_reason is None or ch.node_done or st.done or st.decode is None:
            return
        ch.node_done = True
        st.decode_live = not all(c.node_done for c in st.choices)
        self.pool.spawn(self._send_abort(st.decode, f"{st.node_rid}#{index}", "the choice ended at the router"))

    async def _next_item(self, st: RequestState) -> OutputItem:
        """The next output item from the decode node; AttemptLost once it failed and every item it
        sent before is read (those tokens count: they are not computed again)."""
        if not st.events.empty():
            return st.events.get_nowait()
        item: OutputItem = await self._unless_lost(st, st.events.get())
        return item

    def _add_tokens(self, st: RequestState, tokens: list[int], logprobs: TokenLogprobs | None,
                    index: int = 0) -> bool:
        before = st.num_tokens
        complete = st.add_tokens(tokens, logprobs, index)
        self.metrics.tokens(st, st.num_tokens - before)
        return complete

    # ---- node callbacks (from the NodePool) -----------------------------------------------
    def _on_items(self, node: Node, items: list[OutputItem]) -> None:
        for item in items:
            st = self._by_node_rid.get(item.request_id)
            if st is not None and st.decode is node and not st.done:
                st.events.put_nowait(item)

    def _on_decode_failure(self, node: Node, reason: str) -> None:
        for st in list(self.requests.values()):
            if st.decode is node:
                st.lose(f"decode node {node.address} failed: {reason}")

    def _on_capacity(self) -> None:
        self._queue.wake_one()

    # ---- what nodes hold for a request ----------------------------------------------------
    def _hold_decode(self, st: RequestState, node: Node, node_rid: str) -> None:
        if st.node_rid != node_rid:  # a new attempt: nothing of an older one may be read
            st.events = asyncio.Queue()
        st.decode, st.decode_live, st.node_rid = node, True, node_rid
        st.lost = asyncio.get_running_loop().create_future()
        node.inflight += 1
        self._by_node_rid[node_rid] = st

    def _drop_decode(self, st: RequestState) -> None:
        if st.decode is not None:
            st.decode.inflight -= 1
        st.decode, st.decode_live = None, False
        self._by_node_rid.pop(st.node_rid, None)

    def _hold_prefill(self, st: RequestState, node: Node, work: int) -> None:
        st.prefill, st.prefill_work = node, work
        node.inflight += 1
        node.inflight_tokens += work

    def _drop_prefill(self, st: RequestState) -> None:
        if st.prefill is not None:
            st.prefill.inflight -= 1
            st.prefill.inflight_tokens -= st.prefill_work
        st.prefill, st.prefill_work = None, 0

    async def _abort_decode(self, st: RequestState, reason: str) -> None:
        node, rid = st.decode, st.node_rid
        self._drop_decode(st)
        if node is not None:
            await self._send_abort(node, rid, reason)

    def _spawn_abort_decode(self, st: RequestState, reason: str) -> None:
        node, rid, live = st.decode, st.node_rid, st.decode_live
        self._drop_decode(st)
        if node is not None and live:
            self.pool.spawn(self._send_abort(node, rid, reason))

    async def _send_abort(self, node: Node, node_rid: str, reason: str) -> None:
        try:
            await node.stub.Abort(node_pb2.AbortRequest(request_id=node_rid, reason=reason),
                                  timeout=self.config.rpc_timeout_s)
        except grpc.aio.AioRpcError as e:
            if not self.pool.rpc_failed(node, e, "Abort"):
                log.warning("Abort of %s on %s failed: %s", node_rid, node.address, e.details())
        except grpc.aio.UsageError as e:  # the channel was closed (node removed, router stopping)
            log.warning("Abort of %s on %s not sent: %s", node_rid, node.address, e)

    def _release(self, st: RequestState) -> None:
        if self.requests.get(st.request_id) is st:
            del self.requests[st.request_id]
        reason = st.terminal or "ended"
        prefill = st.prefill
        if prefill is not None:  # the Prefill call was still outstanding
            self._drop_prefill(st)
            self.pool.spawn(self._send_abort(prefill, st.node_rid, reason))
        self._spawn_abort_decode(st, reason)
        self.counts[st.terminal or "none"] += 1
        self.metrics.ended(st)
        self._queue.wake_one()

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

    # ---- Abort / Health / ListModels ------------------------------------------------------
    def health(self, nodes: bool = False) -> pdserve_pb2.HealthResponse:
        """Serving or not, and the counts; `nodes`: every node's last Status too (free KV blocks,
        running, queued, last error), so a leak is visible from outside."""
        p, d, c = (len(self.pool.healthy(kind)) for kind in ("prefill", "decode", "colocated"))
        out = pdserve_pb2.HealthResponse(serving=self._serving and ((p > 0 and d > 0) or c > 0), prefill_nodes=p,
                                         decode_nodes=d, colocated_nodes=c, running_requests=len(self.requests),
                                         queued_requests=len(self._queue))
        if nodes:
            out.nodes.extend(_node_health(n) for _, n in sorted(self.pool.nodes.items()))
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


def _node_health(node: Node) -> pdserve_pb2.NodeHealth:
    s = node.status
    out = pdserve_pb2.NodeHealth(address=node.address, kind=node.kind, healthy=node.healthy,
                                 last_error=node.last_error[:1024])
    if s is not None:
        out.node_id, out.free_kv_blocks, out.total_kv_blocks = s.node_id, s.free_blocks, s.total_blocks
        out.running_requests, out.queued_prompt_tokens = s.running, s.queued_tokens
        out.shared_kv_blocks = s.shared_blocks
    return out


def freeze_heap() -> None:
    """Exclude everything alive now (the model info, the tokenizer, imported modules: hundreds of
    thousands of objects) from the garbage collector's full passes, as vLLM's API server does.
    Call once in a router's own process when it serves: each full collection otherwise walks that
    heap (~100 ms with SmolLM2's tokenizer), stalling every stream, and at saturation full
    collections come every few seconds."""
    gc.collect()
    gc.freeze()


def prefix_options(config: RouterConfig, block_size: int) -> dict[str, Any]:
    """The prefix policy's settings (no options for the other policies)."""
    if config.policy != "prefix":
        return {}
    return {"block_size": block_size, "balance_abs_tokens": config.prefix_balance_abs_tokens,
            "balance_rel": config.prefix_balance_rel, "view_blocks": config.prefix_view_blocks}


def _no_prefill_message(tried: dict[str, str]) -> str:
    if not tried:
        return "no healthy prefill node"
    return "prefill failed on every node tried: " + "; ".join(f"{a}: {why}" for a, why in tried.items())


class _Servicer(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router) -> None:
        self.router = router

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[pdserve_pb2.GenerateResponse]:  # noqa: N802
        async for msg in self.router.generate(request, context):  # grpc wants an async generator function
            yield msg

    async def Abort(self, request: Any, context: Any) -> pdserve_pb2.AbortResponse:  # noqa: N802
        return pdserve_pb2.AbortResponse(found=await self.router.abort(request.request_id))

    async def Health(self, request: Any, context: Any) -> pdserve_pb2.HealthResponse:  # noqa: N802
        header = dict(context.invocation_metadata() or ()).get("authorization")
        return self.router.health(nodes=self.router.health_detail_allowed(header))

    async def ListModels(self, request: Any, context: Any) -> pdserve_pb2.ListModelsResponse:  # noqa: N802
        return self.router.list_models()
