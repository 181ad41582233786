"""The service on a Ray cluster of three raylets on this machine: a head (router), a prefill
host and a decode host, told apart by Ray custom resources. Placement follows the resources
(checked with ray.util.state), KV crosses raylets and greedy output equals the single-process
engine; `pdserve status` lists it all. Then the decode host dies whole (raylet SIGKILLed while
requests stream): every stream ends exactly once, the router marks the node down, and a
replacement host that joins is served again without restarting anything."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from deploy.config import ServiceConfig
from deploy.service import Service
from deploy.status import collect, render
from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from router.client import RouterClient, build_request
from tests.deploy.ray_nodes import RayNodes
from tests.e2e.conftest import BASE, run_async, stream_until_end, wait_blocks_returned
from tests.ray_temp import ray_temp_dir

ROLE_RESOURCES = {"prefill": "pdserve_prefill", "decode": "pdserve_decode", "router": "pdserve_router"}
PROMPTS = [[(5 * i + j) % 256 for j in range(3 + 7 * i)] for i in range(6)]


def service_config(address: str) -> ServiceConfig:
    return ServiceConfig.load(None, BASE | {
        "cluster.address": address, "spec.num_speculative_tokens": 2, "router.node_wait_s": 0,
        "prefill.resources": {"pdserve_prefill": 1}, "decode.resources": {"pdserve_decode": 1},
        "cluster.router_resources": {"pdserve_router": 1}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    import ray

    if ray.is_initialized():
        ray.shutdown()
    with ray_temp_dir(tmp_path_factory, "raynodes") as temp_dir:
        nodes = RayNodes(temp_dir)
        service = None
        try:
            nodes.start_head({"pdserve_router": 1})
            cfg = service_config(nodes.address)
            nodes.connect(cfg.cluster.namespace)
            nodes.add_node("prefill-host", {"pdserve_prefill": 1})
            nodes.wait_for("prefill-host", "pdserve_prefill")
            nodes.add_node("decode-host", {"pdserve_decode": 1})
            nodes.wait_for("decode-host", "pdserve_decode")
            service = Service(cfg)
            address = service.start(timeout_s=240)
            yield nodes, service, address
        finally:
            if service is not None:
                service.stop()
            ray.shutdown()
            nodes.shutdown()


@pytest.fixture(scope="module")
def reference():
    engine = LLMEngine(load_model("tiny"), EngineConfig(num_speculative_tokens=0))
    return [r.output_ids for r in engine.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))]


async def generate_all(address: str) -> list[dict]:
    async with RouterClient(address) as client:
        return list(await asyncio.gather(*(client.generate(build_request(p, max_tokens=12, ignore_eos=True))
                                           for p in PROMPTS)))


def test_actors_placed_by_resources_and_greedy_output_equals_local_engine(cluster, reference):
    import ray
    from ray.util.state import list_actors

    nodes, service, address = cluster
    resources = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    alive = list_actors(address=nodes.address, filters=[("state", "=", "ALIVE")])  # not "auto": other clusters may run
    placed = {a.name: a.node_id for a in alive if a.name}
    for name in ("pdserve-router", "pdserve-prefill-0", "pdserve-decode-0"):
        role = name.split("-")[1]
        offered = {r for r in ROLE_RESOURCES.values() if r in resources[placed[name]]}
        assert offered == {ROLE_RESOURCES[role]}, f"{name} placed on a node offering {offered}"
    assert len({placed["pdserve-prefill-0"], placed["pdserve-decode-0"]}) == 2  # KV crosses raylets
    assert [r["token_ids"] for r in run_async(generate_all(address))] == reference
    wait_blocks_returned(service, timeout=60.0)


def test_status_lists_nodes_placement_and_health(cluster):
    nodes, service, address = cluster
    state = collect()
    assert state["router"]["serving"] and state["router"]["decode_nodes"] == 1
    by_role = {n["role"]: n for n in state["nodes"]}
    assert by_role["decode"]["state"] == "up" and "pdserve_decode" in by_role["decode"]["ray_node_resources"]
    assert by_role["prefill"]["free_blocks"] == by_role["prefill"]["total_blocks"] > 0
    table = render(state)
    print(f"\n{table}")
    assert "pdserve-decode-0" in table and "pdserve_decode" in table


async def one_terminal(client, prompt) -> list[tuple[str, str]]:
    got: list[tuple[str, str]] = []
    async for msg in client.stream(build_request(prompt, max_tokens=4, ignore_eos=True)):
        if msg.HasField("finished"):
            got.append(("finished", msg.finished.reason))
        if msg.HasField("error"):
            got.append((msg.error.code, msg.error.message))
    return got


async def until_decode_nodes(client, want: int, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while (await client.health()).decode_nodes != want:
        assert time.monotonic() < deadline, f"router never saw {want} decode node(s)"
        await asyncio.sleep(0.1)


def test_decode_host_dies_and_a_replacement_serves_without_restart(cluster, reference):
    nodes, service, address = cluster

    async def main():
        async with RouterClient(address) as client:
            started, counter = asyncio.Event(), [0]
            requests = [build_request([i + 1, 2, 3], max_tokens=2000, ignore_eos=True) for i in range(6)]
            tasks = [asyncio.create_task(stream_until_end(client, r, started, counter, 6)) for r in requests]
            await asyncio.wait_for(started.wait(), 120)
            t_kill = time.monotonic()
            nodes.kill("decode-host")
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            t_ended = time.monotonic()
            await until_decode_nodes(client, 0)
            t_down = time.monotonic()
            during = await one_terminal(client, [7, 7, 7])
            t_join = time.monotonic()
            nodes.add_node("decode-host-2", {"pdserve_decode": 1})  # a new host, new ports
            await until_decode_nodes(client, 1)
            t_back = time.monotonic()
            after = await generate_all(address)
            times = {"streams_ended_s": t_ended - t_kill, "router_marked_down_s": t_down - t_kill,
                     "replacement_start_to_serving_s": t_back - t_join, "kill_to_serving_s": t_back - t_kill}
            return results, during, after, times

    results, during, after, times = run_async(main())
    print(f"\nnode-failure recovery: {json.dumps({k: round(v, 2) for k, v in times.items()})}")
    assert all(len(t) == 1 for t, _ in results), f"exactly one terminal per stream: {results}"
    kinds = {t[0][0] for t, _ in results}
    assert kinds <= {"UNAVAILABLE", "finished"} and "UNAVAILABLE" in kinds
    assert len(during) == 1 and during[0][0] == "UNAVAILABLE", during  # no decode host: a clear error
    assert [r["token_ids"] for r in after] == reference  # served again, by the replacement
    wait_blocks_returned(service, timeout=60.0)
