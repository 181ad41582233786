"""The router's Prefill requests on one long-lived PrefillStream per prefill node
(router/prefill_stream.py), against the scripted fake nodes: a broken stream fails each request
on it once and the next request opens another; a request's error travels in its answer; a
cancelled request is cancelled on the node; two router channels each have their own stream."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
import pytest

from protos import node_pb2, node_pb2_grpc
from protos.convert import pack_token_ids
from protos.messages import FirstToken
from router.client import build_request
from router.prefill_stream import PrefillStreams
from tests.router.conftest import cluster
from tests.router.fake_nodes import FakeDecode, FakePrefill
from tests.router.test_lifecycle import collect, text


class _Node:
    """What PrefillStreams reads of the pool's Node: its stub (hashed by identity, as Node is)."""

    def __init__(self, stub: object) -> None:
        self.stub = stub


class _Channel:
    """A router process's side of one prefill node: its channel and its streams."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.node = _Node(node_pb2_grpc.PrefillControlStub(self.channel))
        self.streams = PrefillStreams()

    def prefill(self, rid: str, decode_address: str, prompt: tuple[int, ...] = (97, 98)) -> asyncio.Future:
        return self.streams.prefill(self.node, node_pb2.PrefillRequest(
            request_id=rid, prompt_token_ids_packed=pack_token_ids(list(prompt)),
            sampling=node_pb2.Sampling(max_tokens=4, logprobs=-1), descriptor_msgpack=b"\x80",
            decode_address=decode_address))

    async def close(self) -> None:
        await self.streams.close()
        await self.channel.close()


async def _nodes() -> tuple[FakePrefill, FakeDecode]:
    p, d = FakePrefill("p0"), FakeDecode("d0")
    await p.start()
    await d.start()
    return p, d


@contextlib.asynccontextmanager
async def _pair() -> AsyncIterator[tuple[FakePrefill, FakeDecode, _Channel]]:
    """A prefill and a decode fake node, and a router channel to the prefill node; all closed after."""
    p, d = await _nodes()
    router = _Channel(p.address)
    try:
        yield p, d, router
    finally:
        await router.close()
        await p.stop()
        await d.stop()


async def test_a_broken_stream_fails_each_request_on_it_once_and_the_next_opens_another():
    async with _pair() as (p, d, router):
        p.hold = asyncio.Event()
        waiting = [router.prefill(f"r{i}", d.address) for i in range(3)]
        await p.until(lambda: p.held == 3)
        port = int(p.address.rsplit(":", 1)[1])
        await p.die()
        for future in waiting:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await future
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        assert not router.streams._streams  # forgotten: the next request opens a new one
        p.dead, p.hold = False, None
        await p.start(port)
        payload = await router.prefill("r3", d.address)
        assert payload.msgpack and p.streams == 2 and p.calls[-1] == "r3"  # a second stream


async def test_a_requests_error_travels_in_its_answer_and_the_stream_stays():
    async with _pair() as (p, d, router):
        p.fail = True
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await router.prefill("bad", d.address)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "is down (test)" in e.value.details()
        p.fail = False
        assert (await router.prefill("good", d.address)).msgpack
        assert p.streams == 1 and p.calls == ["bad", "good"]


async def test_a_cancelled_request_is_cancelled_on_the_node_and_only_it():
    async with _pair() as (p, d, router):
        p.hold = asyncio.Event()
        gone, kept = router.prefill("gone", d.address), router.prefill("kept", d.address)
        await p.until(lambda: p.held == 2)
        gone.cancel()
        await p.until(lambda: p.cancels == ["gone"] and p.active == {"kept"})
        p.hold.set()
        assert (await kept).msgpack and p.streams == 1


async def test_two_router_channels_have_a_stream_each_and_get_their_own_answers():
    p, d = await _nodes()
    first, second = _Channel(p.address), _Channel(p.address)
    try:
        p.hold = asyncio.Event()
        a = first.prefill("a", d.address, prompt=(97,))
        b = second.prefill("b", d.address, prompt=(98,))
        await p.until(lambda: p.held == 2)
        assert p.streams == 2
        await first.close()  # one router goes away: its request is dropped, the other's goes on
        with pytest.raises(grpc.aio.AioRpcError):
            await a
        await p.until(lambda: p.active == {"b"})
        p.hold.set()
        got = FirstToken.unpack((await b).msgpack, 320, 8)
        assert (got.request_id, got.token) == ("b", 99)
    finally:
        await first.close()
        await second.close()
        await p.stop()
        await d.stop()


async def test_a_prefill_node_killed_mid_prefill_moves_each_request_once():
    """Through the router: P0 dies with three requests on its stream; each is retried once on P1
    and ends with exactly one terminal event (collect checks), the right text."""
    async with cluster(n_prefill=2) as c:
        busy, spare = c.prefill
        spare.queued_tokens = 10**6  # the policy sends every request to `busy` first
        await c.router.refresh()
        busy.hold = asyncio.Event()
        runs = [asyncio.create_task(collect(c, prompt="ab", max_tokens=3)) for _ in range(3)]
        await busy.until(lambda: busy.held == 3)
        await busy.die()
        for run in runs:
            assert text(await run) == "che"
        assert len(spare.calls) == len(set(spare.calls)) == 3
        await c.settled()


async def test_a_client_cancel_during_prefill_cancels_the_request_on_its_stream():
    async with cluster() as c:
        p = c.prefill[0]
        p.hold = asyncio.Event()
        stream = c.client.stream(build_request("ab", max_tokens=5))
        await p.until(lambda: len(p.active) == 1)
        stream.cancel()
        await p.until(lambda: p.cancels == p.calls and len(p.aborts) == 1 and not p.active)
        p.hold.set()
        await c.settled()


@pytest.mark.parametrize(("ended", "fails"), [
    (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNAVAILABLE),  # a node process that died mid-stream
    (grpc.StatusCode.UNKNOWN, grpc.StatusCode.UNAVAILABLE),
    (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
    (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.UNAUTHENTICATED),  # a refusal: no other node would differ
    (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.UNIMPLEMENTED),
])
def test_a_broken_stream_fails_its_requests_as_the_nodes_loss_unless_it_was_refused(ended, fails):
    """The router retries a request elsewhere only on UNAVAILABLE (router/pool.py `rpc_failed`), so a
    stream that broke, whatever status gRPC gave its end, must fail its requests so."""
    from router.prefill_stream import _stream_status

    error = grpc.aio.AioRpcError(ended, grpc.aio.Metadata(), grpc.aio.Metadata(), "Internal error from Core")
    code, details = _stream_status(error)
    assert code == fails and "Internal error from Core" in details
    assert _stream_status(ConnectionResetError())[0] == grpc.StatusCode.UNAVAILABLE
