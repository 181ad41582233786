"""Health says how many KV blocks each node has free (gRPC Health, GET /health, and the
`pdserve:kv_blocks_free` / `_total` gauges), so a leak is visible from outside: free < total
while a request holds blocks, back to total once it ends. With an API key the per-node detail
goes only to callers that send it; the summary stays open for probes."""

from __future__ import annotations

import asyncio
import json
import urllib.request

from router.client import RouterClient, build_request
from tests.router.conftest import cluster


def _get(url: str, key: str | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status, resp.read().decode()


def _decode_free(health) -> tuple[int, int]:
    [d] = [n for n in health.nodes if n.kind == "decode"]
    return d.free_kv_blocks, d.total_kv_blocks


async def test_health_and_metrics_show_free_kv_blocks_per_node():
    async with cluster(http_port=0, decode={"pause_after": 2}) as c:
        d = c.decode[0]
        h = await c.client.health()
        assert {(n.kind, n.address, n.healthy) for n in h.nodes} == {
            ("prefill", c.prefill[0].address, True), ("decode", d.address, True)}
        assert _decode_free(h) == (d.total_blocks, d.total_blocks)
        stream = c.client.stream(build_request("ab", max_tokens=40))
        await stream.read()
        await d.until(lambda: d.free_blocks < d.total_blocks)
        await c.router.refresh()  # a Status round (the fixture polls once an hour)
        free, total = _decode_free(await c.client.health())
        assert free == d.free_blocks < total == d.total_blocks
        base = f"http://127.0.0.1:{c.router.http_port}"
        status, body = await asyncio.to_thread(_get, f"{base}/health")
        nodes = {n["kind"]: n for n in json.loads(body)["nodes"]}
        assert status == 200 and nodes["decode"]["free_kv_blocks"] == free and nodes["decode"]["node_id"] == "d0"
        _, metrics = await asyncio.to_thread(_get, f"{base}/metrics")
        assert f'pdserve:kv_blocks_free{{kind="decode",node="{d.address}"}} {float(free)}' in metrics
        assert f'pdserve:kv_blocks_total{{kind="decode",node="{d.address}"}} {float(total)}' in metrics
        assert f'pdserve:graph_shapes_pending{{kind="decode",node="{d.address}"}} 0.0' in metrics  # no warm-up
        stream.cancel()
        await c.settled()
        await c.router.refresh()
        assert _decode_free(await c.client.health()) == (d.total_blocks, d.total_blocks)


async def test_per_node_detail_needs_the_api_key_when_one_is_set():
    async with cluster(http_port=0, api_key="s3cret") as c:
        bare = await c.client.health()  # c.client sends no key
        assert bare.serving and bare.decode_nodes == 1 and not bare.nodes
        async with RouterClient(c.client.address, "s3cret") as keyed:
            assert len((await keyed.health()).nodes) == 2
        base = f"http://127.0.0.1:{c.router.http_port}/health"
        assert json.loads((await asyncio.to_thread(_get, base))[1])["nodes"] == []
        assert len(json.loads((await asyncio.to_thread(_get, base, "s3cret"))[1])["nodes"]) == 2
