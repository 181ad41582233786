"""Prefills that outlast the KV timeout on real nodes (the tiny model, in this process, KV over ipc,
as issue 49's CPU runs): every attempt of a request fails (the decode node gives its reservation
up, the prefill node's lease ends), the request ends once with an error after its migrations, and
both nodes' KV blocks come back within the decode node's quarantine (the KV timeout, as deployed)
after the last failure: nothing is held for good.

The prefill node's steps are held by a hook until the decode node has given up the reservation in
flight, so the failure does not depend on how fast this CPU computes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from router.client import RouterClient, build_request
from tests.router.real_service import RealService

KV_TIMEOUT_S = 0.5


def _until(cond: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@pytest.fixture
def slow_prefills():
    svc = RealService(k=2, kv_backend="ipc", kv_timeout_s=KV_TIMEOUT_S, kv_quarantine_s=None)
    prefill, decode = svc.nodes
    compute = prefill.runner.prefill

    def outlasting(*a, **kw):
        # the attempt's reservation is made meanwhile (router.overlap_reserve) or before; the
        # step waits until the decode node gave it up (its KV did not come within the timeout)
        _until(lambda: bool(decode.pending), 10.0)
        assert _until(lambda: not decode.pending, 30.0), "the decode node kept a reservation past its KV timeout"
        return compute(*a, **kw)

    prefill.runner.prefill = outlasting
    yield svc
    svc.close()


def test_prefills_that_outlast_the_kv_timeout_fail_and_free_both_nodes_blocks(slow_prefills):
    svc = slow_prefills

    async def one(i: int) -> list:
        async with RouterClient(f"127.0.0.1:{svc.router.grpc_port}") as client:
            return [m async for m in client.stream(build_request(f"{i} a prompt that waits", max_tokens=16))]

    for i in range(2):  # one at a time: one reservation in flight, the one the hook waits on
        msgs = asyncio.run(one(i))
        ends = [m for m in msgs if m.HasField("error") or m.HasField("finished")]
        assert len(ends) == 1 and ends[0].HasField("error"), msgs
        # each attempt streamed its first token (from the prefill node) and moved on, at most
        # router.max_migrations times
        assert ends[0].error.code == "UNAVAILABLE" and "moved 3 times" in ends[0].error.message, ends[0].error
    # the quarantine is the KV timeout after the last failure; a generous bound for a loaded CPU
    assert svc.blocks_back(timeout=30 * KV_TIMEOUT_S + 10), [(n.blocks.num_free, n.blocks.capacity) for n in svc.nodes]
    assert not svc.nodes[0].leased and not svc.nodes[1].pending and not svc.nodes[1].quarantine
