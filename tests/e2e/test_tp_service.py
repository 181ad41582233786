"""1P(TP2) + 1D(TP2) on a local Ray cluster: each node a placement group of two rank actors
(real gloo groups), KV rank to rank over tcp. Greedy output through the router equals the
single-process engine's, only rank 0 of each node emitted messages, every rank's blocks come
back, and killing one decode rank mid-stream ends every stream once, restarts the decode node's
whole group (not the prefill node's), which serves again."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine.sampling.sampling_params import SamplingParams
from router.client import RouterClient, build_request
from tests.e2e.conftest import router_health_settled, run_async, start_service, stream_until_end
from tests.e2e.test_service import generate_all, mixed_prompts

pytestmark = pytest.mark.usefixtures("ray_cluster")

TP = {"prefill.tp": 2, "decode.tp": 2, "kv_transfer.backend": "tcp",
      "router.node_wait_s": 0}  # a killed rank's streams end UNAVAILABLE rather than wait for its restart


def greedy_matches(address, tiny_reference, seed: int) -> None:
    prompts = mixed_prompts(4, seed=seed)
    results = run_async(generate_all(address, prompts, max_tokens=8, ignore_eos=True))
    ref = tiny_reference(prompts, SamplingParams(max_tokens=8, ignore_eos=True))
    assert [r["token_ids"] for r in results] == [r.output_ids for r in ref]


def wait_every_rank_free(svc, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        info = svc.node_info()
        if all(r["free_blocks"] == r["total_blocks"] for i in info.values() for r in i["ranks"]):
            return info
        assert time.monotonic() < deadline, f"KV blocks not returned: {info}"
        time.sleep(0.2)


def wait_serving_again(svc, key, old: str, timeout: float = 240.0) -> None:
    deadline = time.monotonic() + timeout
    while svc.addresses.get(key) in (None, old):
        assert time.monotonic() < deadline, "the TP group did not come back"
        time.sleep(0.2)


async def kill_rank_mid_stream(svc, address, n: int = 4) -> list:
    async with RouterClient(address) as client:
        started, counter = asyncio.Event(), [0]
        requests = [build_request([i + 1, 2, 3], max_tokens=2000, ignore_eos=True) for i in range(n)]
        tasks = [asyncio.create_task(stream_until_end(client, r, started, counter, n)) for r in requests]
        await asyncio.wait_for(started.wait(), 60)
        svc.kill("decode", 0, rank=1)
        return await asyncio.wait_for(asyncio.gather(*tasks), 120)


def test_1p_tp2_1d_tp2_equals_single_process_and_only_rank0_emits(tiny_reference):
    svc, address = start_service(1, 1, 2, **TP)
    try:
        greedy_matches(address, tiny_reference, seed=5)
        info = wait_every_rank_free(svc)
        emitted = {(role, rank): r["emitted"] for (role, _), i in info.items() for rank, r in enumerate(i["ranks"])}
        assert emitted[("prefill", 1)] == emitted[("decode", 1)] == 0
        assert emitted[("prefill", 0)] == 4 and emitted[("decode", 0)] > 0
        old = svc.addresses[("decode", 0)]
        results = run_async(kill_rank_mid_stream(svc, address))
        assert all(len(terminals) == 1 for terminals, _ in results), "exactly one terminal per stream"
        assert {terminals[0][0] for terminals, _ in results} == {"UNAVAILABLE"}
        wait_serving_again(svc, ("decode", 0), old)
        assert (svc.actors[("decode", 0)].launches, svc.actors[("prefill", 0)].launches) == (2, 1)
        health = run_async(router_health_settled(svc.router_address, nodes=2))
        assert len(health.nodes) == 2 and all(n.healthy for n in health.nodes), \
            "the router never saw the restarted node healthy"
        greedy_matches(svc.router_address, tiny_reference, seed=6)
        wait_every_rank_free(svc)
    finally:
        svc.stop()
