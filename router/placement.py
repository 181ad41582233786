"""Placement: where an attempt of a request runs, and its prefill.

Receives a request from its driver and hands back the first token (`place`: PD) or nothing
(`place_colocated`: the whole request on one node, every token on its output stream). In PD
mode the decode node D is reserved (admission.py: policy order, else the queue) and the
prefill node P (policy order, nodes that failed this request left out) computes the prompt
and pushes the KV to D; an unavailable P is retried on another one (`router.prefill_retries`)
after D's reservation is given back. With `router.overlap_reserve`, P starts before D is
reserved and receives D's descriptor by Attach, when no request waits in the queue and P
takes an Attach; otherwise D is reserved first. A colocated service (the directory lists
colocated nodes) places the whole request on one node instead (Submit: admitted or refused as a
reservation is, queued alike); a colocated node is a decode node in every other respect (its
loss migrates its requests to another one).

Raises AttemptLost (migration.py) when D is lost meanwhile or P could not reach D, and
RequestError for a terminal error. Never sends anything to the client.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from protos import node_pb2
from protos.convert import pack_token_ids
from protos.messages import FirstToken, MessageError
from router.admission import Admission, Reserved
from router.config import RouterConfig
from router.holds import Holds
from router.migration import AttemptLost, unless_lost
from router.policy import Policy
from router.pool import Node, NodePool
from router.prefill_stream import PrefillStreams
from router.request import RequestError, RequestState

MAX_DRAFTS = 64  # bound on drafts in a first-token message (the router ignores them)


@dataclass(frozen=True)
class Prefilled:
    """A Prefill request's end on `node`: its first token, or None when the node was unavailable
    (the caller tries another). `confirm`: with an overlapped reservation, the check that P took
    D's descriptor (Attach), awaited once the first token is on its way to the client (its
    failure, AttemptLost, moves the request on after that token, as a decode node's loss does)."""

    node: Node
    first: FirstToken | None
    confirm: Callable[[], Awaitable[None]] | None = None


@dataclass(frozen=True)
class ReserveFirst:
    """No prefill ran while reserving: reserve on D first, then prefill. `asked`: the queue epoch at
    which every decode node refused already (they are not asked again unless capacity news came
    since); None when they were not asked (P takes no Attach, being tensor parallel)."""

    asked: int | None


class Placement:
    def __init__(self, config: RouterConfig, vocab_size: int, pool: NodePool, policy: Policy,
                 admission: Admission, holds: Holds, abandoned: Callable[[int, str], None] = lambda n, why: None) -> None:
        self.config, self.vocab_size, self.pool, self.policy = config, vocab_size, pool, policy
        self.admission, self.holds = admission, holds
        self.abandoned = abandoned  # (prompt tokens, reason) of a Prefill request given up: it may run twice
        self.streams = PrefillStreams()  # a stream per prefill node; cancelling an answer's future drops P's job

    @property
    def colocated(self) -> bool:
        """Whether this is a colocated service: its directory lists colocated nodes."""
        return bool(self.pool.directory.addresses("colocated"))

    async def place_colocated(self, st: RequestState) -> None:
        """Submit the whole request to a colocated node (policy order; all refuse -> the queue, as a
        decode reservation); every token comes on its output stream."""
        st.attempt += 1
        await self.admission.reserve(st, st.attempt, st.resume_prompt(), st.resume_sampling(), "colocated")

    async def place(self, st: RequestState) -> Prefilled:
        """Reserve on D and prefill on P (retrying another P when one is unavailable): P's first
        token (never None here) and what must be confirmed after it (`Prefilled.confirm`)."""
        tried: dict[str, str] = {}
        prompt, sampling = st.resume_prompt(), st.resume_sampling()
        for _ in range(self.config.prefill_retries + 1):
            done: Prefilled | ReserveFirst = ReserveFirst(None)
            if self._may_overlap(tried):
                done = await self._place_overlapped(st, prompt, sampling, tried)
            if isinstance(done, ReserveFirst):  # others wait in the queue, no node admitted, or a TP P
                done = await self._place_in_turn(st, prompt, sampling, tried, asked=done.asked)
            if done.first is not None:
                return done
            st.timeline.lap("prefill_queue")  # a failed call: the request waited for a prefill it did not get
            tried[done.node.address] = done.node.last_error or "unavailable"
            self.abandoned(len(prompt), "prefill_failed")
            await self.holds.abort_decode(st, "the prefill node failed; retrying elsewhere")
        raise RequestError("UNAVAILABLE", _no_prefill_message(tried))

    def _may_overlap(self, tried: dict[str, str]) -> bool:
        """Whether to reserve while the prefill node computes (`router.overlap_reserve`): not while
        requests wait for a decode node (they go first), and only with a decode and a prefill node
        to ask."""
        return (self.config.overlap_reserve and not len(self.admission.queue) and bool(self.pool.healthy("decode"))
                and any(n.address not in tried for n in self.pool.healthy("prefill")))

    async def _place_in_turn(self, st: RequestState, prompt: list[int], sampling: node_pb2.Sampling,
                             tried: dict[str, str], asked: int | None = None) -> Prefilled:
        """Reserve on a decode node (queueing if none admits), then prefill with its descriptor.
        `asked`: every decode node refused at this queue epoch already (`Admission.reserve`)."""
        decode, prefill, work = await self._reserve_pair(st, prompt, sampling, tried, asked)
        st.timeline.lap("reserve")
        req = node_pb2.PrefillRequest(
            request_id=st.node_rid, prompt_token_ids_packed=pack_token_ids(prompt), sampling=sampling,
            descriptor_msgpack=decode.descriptor, decode_address=decode.node.address)
        self.holds.hold_prefill(st, prefill, work)  # still held if the driver is cancelled: release aborts P
        payload = await self._await_prefill(st, prefill, self.streams.prefill(prefill, req))
        return Prefilled(prefill, self._first_of(st, prefill, payload))

    async def _place_overlapped(self, st: RequestState, prompt: list[int], sampling: node_pb2.Sampling,
                                tried: dict[str, str]) -> Prefilled | ReserveFirst:
        """Prefill without a descriptor while reserving on a decode node, then hand P the descriptor
        (Attach). When no decode node admitted at once, P's job is given up and the caller reserves
        first (queueing), without asking them again unless capacity news came since; so too when
        the prefill node takes no Attach (tensor parallel). Whether P took the descriptor is learnt
        after the first token went out (`Prefilled.confirm`: AttemptLost when it did not)."""
        prefill, work = self._choose_prefill(prompt, exclude=tried)
        if prefill.status is None or not prefill.status.takes_attach:  # a TP prefill node: reserve first
            return ReserveFirst(None)
        st.attempt += 1
        reserve = self.admission.reserve_request(st, st.attempt, prompt, sampling)
        rid = reserve.request_id
        self.holds.hold_prefill(st, prefill, work)
        st.timeline.lap("queue")
        call = self.streams.prefill(prefill, node_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids_packed=reserve.prompt_token_ids_packed, sampling=sampling))
        arrived: list[float] = []  # when the first token came: the reservation may still have run then
        call.add_done_callback(lambda _: arrived.append(time.monotonic()))
        try:
            await asyncio.sleep(0)  # the request is sent on the loop's next turn: let it go before the reservation's work
            seen = self.admission.queue.epoch
            found = await self.admission.try_reserve(st, reserve, "decode")
        except BaseException:
            self._give_up_prefill(st, prefill, rid, call, "the reservation failed")
            self.abandoned(len(prompt), "reservation_failed")
            raise
        if found is None:
            self._give_up_prefill(st, prefill, rid, call, "no decode node admitted the request at once")
            self.abandoned(len(prompt), "no_decode_at_once")
            st.timeline.lap("reserve")
            return ReserveFirst(seen)
        attach = asyncio.ensure_future(prefill.stub.Attach(node_pb2.AttachRequest(
            request_id=rid, descriptor_msgpack=found.descriptor, decode_address=found.node.address),
            timeout=self.config.rpc_timeout_s))
        try:
            payload = await self._await_prefill(st, prefill, call)
            first = self._first_of(st, prefill, payload, arrived[0] if arrived else None)
        except BaseException:
            attach.cancel()
            raise
        if first is None:
            attach.cancel()
            return Prefilled(prefill, None)
        st.timeline.lap("reserve")  # where the first token came before the reservation: its wait for it
        return Prefilled(prefill, first, lambda: self._attached(prefill, rid, attach))

    async def _attached(self, prefill: Node, rid: str, attach: asyncio.Future) -> None:
        """The Attach call's end; AttemptLost when P did not take the descriptor (its KV and first
        token then never reach the decode node, whose reservation is given up by the migration).
        Either way P is told to drop the job, which it would otherwise hold until the KV timeout."""
        try:
            await attach
        except asyncio.CancelledError:
            self.holds.spawn_abort(prefill, rid, "the request ended before its KV descriptor went out")
            raise
        except grpc.aio.AioRpcError as e:
            self.pool.rpc_failed(prefill, e, "Attach")
            self.holds.spawn_abort(prefill, rid, "its KV descriptor was not taken")
            raise AttemptLost(f"prefill node {prefill.address} did not take the KV descriptor: {e.details()}") from None

    def _give_up_prefill(self, st: RequestState, prefill: Node, rid: str, call: asyncio.Future, reason: str) -> None:
        call.cancel()
        self.holds.drop_prefill(st)
        self.holds.spawn_abort(prefill, rid, reason)

    async def _reserve_pair(self, st: RequestState, prompt: list[int], sampling: node_pb2.Sampling,
                            tried: dict[str, str], asked: int | None = None) -> tuple[Reserved, Node, int]:
        """A decode reservation and the prefill node to fill it (with its work). When every prefill
        node went down while the reservation waited (node restarts), the reservation is given back
        and the request waits for one (`await_node`, at most `node_wait_s` each time) rather than
        failing; the driver's deadline bounds the whole."""
        while True:
            if not await self.admission.await_node("prefill", tried):
                raise RequestError("UNAVAILABLE", _no_prefill_message(tried))  # before reserving
            st.attempt += 1
            decode = await self.admission.reserve(st, st.attempt, prompt, sampling, asked=asked)
            asked = None
            try:
                prefill, work = self._choose_prefill(prompt, exclude=tried)
            except RequestError:
                await self.holds.abort_decode(st, "no prefill node is up now; reserving again once one is")
                continue
            return decode, prefill, work

    async def _await_prefill(self, st: RequestState, prefill: Node, call: Awaitable[Any]) -> node_pb2.Payload | None:
        """The Prefill request's answer (the caller held the prefill node); None when the prefill node is
        unavailable (try another). AttemptLost when the decode node fails meanwhile (the request is
        cancelled and P told to drop it), or P could not reach it (FAILED_PRECONDITION)."""
        try:
            payload: node_pb2.Payload = await unless_lost(st, call)
        except AttemptLost:
            self.holds.drop_prefill(st)
            self.holds.spawn_abort(prefill, st.node_rid, "the decode node was lost")
            raise
        except grpc.aio.AioRpcError as e:
            self.holds.drop_prefill(st)
            if e.code() == grpc.StatusCode.FAILED_PRECONDITION:
                raise AttemptLost(f"prefill node {prefill.address}: {e.details()}") from None
            if not self.pool.rpc_failed(prefill, e, "Prefill"):
                raise RequestError(e.code().name, f"prefill node {prefill.address}: {e.details()}") from None
            return None
        self.pool.heard_from(prefill)
        self.holds.drop_prefill(st)
        return payload

    def _choose_prefill(self, prompt: list[int], exclude: dict[str, str]) -> tuple[Node, int]:
        """The prefill node to use, and the prompt tokens it is expected to compute."""
        nodes = [n for n in self.pool.healthy("prefill") if n.address not in exclude]
        for load in self.policy.order_prefill([n.load() for n in nodes], prompt):
            node = self.pool.find("prefill", load.address)
            if node is not None:
                return node, self.policy.routed(node.address, prompt)
        raise RequestError("UNAVAILABLE", _no_prefill_message(exclude))

    def _first_of(self, st: RequestState, prefill: Node, payload: node_pb2.Payload | None,
                  arrived: float | None = None) -> FirstToken | None:
        """The first token of a Prefill request sent at the request's last TTFT lap, come at `arrived`
        (default: now), with its queue and compute (as the node measured them) laid on the TTFT's
        timeline; None when the node was unavailable."""
        if payload is None:
            return None
        first = self._read_first(st, prefill, payload)
        st.timeline.prefill_window(first.queue_s, first.compute_s, arrived)
        return first

    def _read_first(self, st: RequestState, prefill: Node, payload: node_pb2.Payload) -> FirstToken:
        try:
            first = FirstToken.unpack(payload.msgpack, self.vocab_size, MAX_DRAFTS)
        except MessageError as e:
            raise RequestError("INTERNAL", f"prefill node {prefill.address} sent a bad first token: {e}") from None
        if first.request_id != st.node_rid:
            raise RequestError("INTERNAL", f"prefill node {prefill.address} answered for {first.request_id!r}")
        return first


def _no_prefill_message(tried: dict[str, str]) -> str:
    if not tried:
        return "no healthy prefill node"
    return "prefill failed on every node tried: " + "; ".join(f"{a}: {why}" for a, why in tried.items())
