"""Several router processes of one service (`router.processes`): they share the gRPC and HTTP
ports, each request is served whole by the one that took its connection, /metrics sums them all,
and a decode node sends each router only its own requests' tokens. (Here two Routers in one
process stand for two processes; deploy/service.py starts real ones.)"""

from __future__ import annotations

import asyncio
import queue

import openai

from decode_node.streams import publish_to_owners
from deploy.config import RouterConfig
from protos.messages import OutputItem
from router import Router
from tests.router.conftest import MAX_MODEL_LEN, TINY, cluster


async def test_two_routers_share_the_ports_and_metrics_sum_both():
    async with cluster(http_port=0, processes=2) as c:
        a = c.router
        cfg = RouterConfig(host="127.0.0.1", port=a.grpc_port, http_port=a.http_port, status_interval_s=3600.0,
                           processes=2)
        b = Router(TINY, c.directory, cfg, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=2)
        assert await b.start() == a.grpc_port and b.http_port == a.http_port
        try:
            async def own(r: Router) -> list[bytes]:
                return [r.metrics.exposition()[0]]

            a.peer_metrics, b.peer_metrics = (lambda: own(b)), (lambda: own(a))
            async def one() -> str | None:
                client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{a.http_port}/v1", api_key="none",
                                            max_retries=0)  # a connection of its own: either router may take it
                async with client:
                    done = await client.completions.create(model="", prompt="ab", max_tokens=5, temperature=0)
                return done.choices[0].finish_reason

            assert await asyncio.gather(*(one() for _ in range(12))) == ["length"] * 12
            assert a.counts["finished:length"] + b.counts["finished:length"] == 12
            for r in (a, b):
                text = (await r.metrics_text())[0].decode()
                assert 'pdserve:request_success_total{finished_reason="length",model_name="tiny"} 12.0' in text
                assert text.count("# TYPE pdserve:kv_blocks_free gauge") == 1
        finally:
            await b.stop()
        await c.settled()


def test_a_node_sends_each_router_only_its_own_requests():
    a, b, anyone = queue.SimpleQueue(), queue.SimpleQueue(), queue.SimpleQueue()
    items = [OutputItem("ra/x/0", [1]), OutputItem("rb/y/0", [2]), OutputItem("plain", [3]), OutputItem("ra/z/0", [4])]
    publish_to_owners(items, [(a, "ra"), (b, "rb"), (anyone, "")])
    assert [i.tokens for i in a.get_nowait()] == [[1], [4], [3]]
    assert [i.tokens for i in b.get_nowait()] == [[2], [3]]
    assert anyone.get_nowait() == items
    publish_to_owners([OutputItem("ra/x/0", [5])], [(a, "ra"), (b, "rb")])
    assert [i.tokens for i in a.get_nowait()] == [[5]] and b.empty()  # nothing of b's: no message
    publish_to_owners(items, [(a, "ra")])
    assert a.get_nowait() == items  # a lone stream: everything, as before
