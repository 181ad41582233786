"""The router actor killed mid-stream on a live local Ray cluster: every open stream ends once, with
an error (the broken stream: UNAVAILABLE); the decode node drops the dead router's requests (its
Outputs stream ended) and the prefill node its Prefill requests (their PrefillStream ended), so every KV block comes back; Ray
restarts the router, which finds its nodes again and serves at the same address: a new request's
greedy tokens equal the single-process engine's."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from bench.chaos import RECONNECT_OPTIONS
from engine.sampling.sampling_params import SamplingParams
from router.client import RouterClient, build_request
from tests.e2e.conftest import run_async, start_service, wait_blocks_returned

pytestmark = pytest.mark.usefixtures("ray_cluster")


async def read_until_end(client, request, started: asyncio.Event):
    """(terminals, tokens) of one stream; a broken stream's error is a terminal. Sets `started`
    once the stream has 3 tokens."""
    terminals, tokens = [], []
    try:
        async for msg in client.stream(request, timeout=300):
            tokens += msg.token_ids
            if len(tokens) >= 3:
                started.set()
            if msg.HasField("finished"):
                terminals.append(("finished", msg.finished.reason))
            if msg.HasField("error"):
                terminals.append((msg.error.code, msg.error.message))
    except grpc.aio.AioRpcError as e:
        terminals.append((e.code().name, e.details() or ""))
    return terminals, tokens


def kill_router_mid_stream(service, address, requests):
    async def main():
        async with RouterClient(address) as client:
            starts = [asyncio.Event() for _ in requests]
            tasks = [asyncio.create_task(read_until_end(client, r, s)) for r, s in zip(requests, starts, strict=True)]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in starts)), 120)
            await asyncio.to_thread(service.kill_router)
            return await asyncio.wait_for(asyncio.gather(*tasks), 240)

    return run_async(main())


def wait_router_serving(service, timeout=120.0):
    import ray

    deadline = time.monotonic() + timeout
    while service.router_restarts < 1 or not ray.get(service.router.status.remote(), timeout=60)["serving"]:
        assert time.monotonic() < deadline, "the router did not serve again"
        time.sleep(0.2)


async def generate_after_restart(address, prompt, max_tokens):
    async with RouterClient(address, options=RECONNECT_OPTIONS) as client:
        request = build_request(prompt, max_tokens=max_tokens, ignore_eos=True)
        msgs = [m async for m in client.stream(request, timeout=120, wait_for_ready=True)]
    return [t for m in msgs for t in m.token_ids], msgs[-1]


def test_router_killed_mid_stream_ends_streams_once_frees_blocks_and_serves_again(tiny_reference):
    service, address = start_service(1, 1, 2)
    try:
        requests = [build_request([i + 1, 7, 9], max_tokens=900, ignore_eos=True) for i in range(4)]
        results = kill_router_mid_stream(service, address, requests)
        for terminals, tokens in results:
            assert len(terminals) == 1 and terminals[0][0] == "UNAVAILABLE" and terminals[0][1], terminals
            assert 3 <= len(tokens) < 900
        wait_blocks_returned(service, timeout=60)
        assert service.node_info()[("decode", 0)]["orphans_dropped"] >= 1  # dropped, not run to the end
        wait_router_serving(service)
        prompt = [5, 6, 7, 8]
        tokens, last = run_async(generate_after_restart(address, prompt, 24))
        ref = tiny_reference([prompt], [SamplingParams(max_tokens=24, ignore_eos=True)])[0].output_ids
        assert last.HasField("finished") and tokens == ref
        wait_blocks_returned(service)
    finally:
        service.stop()
