"""The whole service on a real local Ray cluster: router + P + D actors, gRPC on 127.0.0.1,
KV over ucx. One Ray cluster per session; services are started per test module/config."""

from __future__ import annotations

import asyncio
import time

import pytest

from deploy.config import ServiceConfig
from deploy.service import Service, init_ray
from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from tests.ray_temp import ray_temp_dir

BASE = {
    "model.name": "tiny", "router.host": "127.0.0.1", "router.port": 0, "router.http_port": 0,
    "router.status_interval_s": 0.5,
    "kv_transfer.backend": "ucx", "kv_transfer.timeout_s": 5.0, "prefill.num_cpus": 0.5, "decode.num_cpus": 0.5,
    "decode.max_num_seqs": 64,
}


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    import ray

    cfg = ServiceConfig.load(None, BASE)
    with ray_temp_dir(tmp_path_factory) as temp_dir:
        init_ray(cfg, temp_dir=temp_dir, num_cpus=8)
        yield
        ray.shutdown()


def start_service(prefill: int, decode: int, k: int, **extra) -> tuple[Service, str]:
    cfg = ServiceConfig.load(None, BASE | {"prefill.num_nodes": prefill, "decode.num_nodes": decode,
                                           "spec.num_speculative_tokens": k} | extra)
    service = Service(cfg)
    return service, service.start(timeout_s=180)


def wait_blocks_returned(service: Service, timeout: float = 30.0) -> None:
    """I4: every node's free KV blocks back to its total (leases and quarantines end by time)."""
    deadline = time.monotonic() + timeout
    while True:
        info = service.node_info()
        if all(i["free_blocks"] == i["total_blocks"] for i in info.values()):
            return
        assert time.monotonic() < deadline, f"KV blocks not returned: {info}"
        time.sleep(0.2)


async def stream_until_end(client, request, started: asyncio.Event, counter: list[int], n: int):
    """Consume one stream; returns the terminal messages seen and the tokens streamed. The n-th
    stream to pass its 3rd token sets `started`."""
    terminals, tokens = [], []
    async for msg in client.stream(request):
        before = len(tokens)
        tokens += msg.token_ids
        if len(tokens) >= 3 > before:
            counter[0] += 1
            if counter[0] == n:
                started.set()
        if msg.HasField("finished"):
            terminals.append(("finished", msg.finished.reason))
        if msg.HasField("error"):
            terminals.append((msg.error.code, msg.error.message))
    return terminals, tokens


@pytest.fixture(scope="session")
def tiny_reference():
    loaded = load_model("tiny")

    def run(prompts, params, k=0):
        eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k))
        return eng.generate(prompts, params)

    return run


def run_async(coro):
    return asyncio.run(coro)


async def router_health_settled(address: str, timeout: float = 30.0, nodes: int = 0, **client_kwargs):
    """The router's Health once it lists at least `nodes` nodes, every one healthy with all its
    blocks free (or the last one at `timeout`): its view is the nodes' last Status, polled every
    status_interval_s, and a restarted node joins it at the service's next watcher round (its old
    address may be gone from the view before the new one is in), so it follows the nodes late."""
    from router.client import RouterClient

    async with RouterClient(address, **client_kwargs) as client:
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            health = await client.health()
            settled = len(health.nodes) >= nodes and all(
                n.healthy and n.free_kv_blocks == n.total_kv_blocks > 0 for n in health.nodes)
            if settled or asyncio.get_running_loop().time() > deadline:
                return health
            await asyncio.sleep(0.1)
