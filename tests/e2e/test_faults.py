"""Faults on a live local Ray cluster: a decode actor killed mid-stream, a prefill actor
killed with requests in flight. Nothing hangs; every stream ends exactly once."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.sampling_params import SamplingParams
from router.client import RouterClient, build_request
from tests.e2e.conftest import run_async, start_service, wait_blocks_returned

pytestmark = pytest.mark.usefixtures("ray_cluster")


async def wait_for_nodes(client, prefill, decode, timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        h = await client.health()
        if h.prefill_nodes >= prefill and h.decode_nodes >= decode:
            return
        assert time.monotonic() < deadline, f"nodes did not rejoin: {h}"
        await asyncio.sleep(0.2)


async def stream_until_end(client, prompt, started: asyncio.Event, counter: list[int], n: int):
    """Consume one stream; returns the terminal message kinds seen and the token count."""
    terminals, tokens = [], 0
    async for msg in client.stream(build_request(prompt, max_tokens=2000, ignore_eos=True)):
        tokens += len(msg.token_ids)
        if tokens >= 3 and tokens - len(msg.token_ids) < 3:
            counter[0] += 1
            if counter[0] == n:
                started.set()
        if msg.HasField("finished"):
            terminals.append(("finished", msg.finished.reason))
        if msg.HasField("error"):
            terminals.append((msg.error.code, msg.error.message))
    return terminals, tokens


def test_decode_actor_killed_mid_stream(tiny_reference):
    service, address = start_service(1, 2, 2)
    try:
        async def main():
            async with RouterClient(address) as client:
                started, counter = asyncio.Event(), [0]
                tasks = [asyncio.create_task(stream_until_end(client, [i + 1, 2, 3], started, counter, 8))
                         for i in range(8)]
                await asyncio.wait_for(started.wait(), 60)
                service.kill("decode", 0)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
                after = await client.generate(build_request([9, 9, 9], max_tokens=8, ignore_eos=True))
                await wait_for_nodes(client, 1, 2)
                return results, after

        results, after = run_async(main())
        kinds = [t[0][0] for t, _ in results]
        assert all(len(t) == 1 for t, _ in results), "exactly one terminal per stream"
        assert "UNAVAILABLE" in kinds, "requests on the killed decode node end with an error"
        assert all(k in ("UNAVAILABLE", "finished") for k in kinds)
        assert all("decode" in t[0][1] for t, _ in results if t[0][0] == "UNAVAILABLE")
        ref = tiny_reference([[9, 9, 9]], SamplingParams(max_tokens=8, ignore_eos=True))
        assert after["token_ids"] == ref[0].output_ids  # new requests go to the live node
        wait_blocks_returned(service, timeout=60)
    finally:
        service.stop()


def test_prefill_actor_killed_requests_retried(tiny_reference):
    service, address = start_service(2, 1, 0, **{"router.prefill_retries": 3})
    prompts = [[(7 * i + j) % 256 for j in range(120)] for i in range(24)]
    try:
        async def main():
            async with RouterClient(address) as client:
                tasks = [asyncio.create_task(client.generate(build_request(p, max_tokens=6, ignore_eos=True)))
                         for p in prompts]
                await asyncio.sleep(0)
                service.kill("prefill", 0)
                results = await asyncio.wait_for(asyncio.gather(*tasks), 180)
                await wait_for_nodes(client, 2, 1)
                return results

        results = run_async(main())
        ref = tiny_reference(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
        assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]
        wait_blocks_returned(service, timeout=60)
    finally:
        service.stop()
