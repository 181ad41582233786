"""A bad day on real nodes (the tiny model, in this process, KV over tcp): memory pressure and busy nodes.

- A flood of long prompts beyond the KV of the decode node and of the prefill node (a few
  requests' worth of blocks each): requests wait in the router's queue, RESOURCE_EXHAUSTED comes
  only past it, none ends with another error, and every KV block is free again at the end.
- Busy is not down: nodes whose Status answers come past the router's deadline (the
  `status_delay_s` test hook) while they stream outputs and answer Prefill requests under full load
  are never taken out of service; the late answers are counted apart (DEADLINE_EXCEEDED).
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from router.client import RouterClient, build_request
from tests.router.real_service import RealService

LONG_PROMPT = "the flood of long prompts " * 4  # ~105 tokens of a 128-token context


def _ends(msgs: list) -> str:
    last = msgs[-1]
    return f"error:{last.error.code}" if last.HasField("error") else f"finished:{last.finished.reason}"


async def _flood(port: int, n: int, prompt: str, max_tokens: int) -> Counter[str]:
    async with RouterClient(f"127.0.0.1:{port}") as client:
        async def one(i: int) -> str:
            req = build_request(f"{i % 10}{prompt}", max_tokens=max_tokens, ignore_eos=True)
            return _ends([m async for m in client.stream(req)])

        return Counter(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.fixture
def small_kv():
    # Each request takes 8 of 20 blocks on D (prompt + max_tokens + MTP room) and 7 on P: two at
    # a time on each node; the router queues 4 more.
    svc = RealService(k=2, engine={"num_blocks": 20, "block_size": 16}, queue_size=4, overlap_reserve=True)
    yield svc
    svc.close()


def test_a_flood_beyond_the_nodes_kv_queues_then_refuses_and_frees_every_block(small_kv):
    svc = small_kv
    ends = asyncio.run(_flood(svc.router.grpc_port, 24, LONG_PROMPT, max_tokens=16))
    assert sum(ends.values()) == 24 and set(ends) <= {"finished:length", "error:RESOURCE_EXHAUSTED"}, ends
    assert ends["finished:length"] >= 2 + 4 and ends["error:RESOURCE_EXHAUSTED"] >= 1, ends  # served, and queued
    assert svc.blocks_back(), [(n.blocks.num_free, n.blocks.capacity) for n in svc.nodes]
    # and the service still serves once the flood is over
    assert asyncio.run(_flood(svc.router.grpc_port, 3, LONG_PROMPT, max_tokens=4)) == {"finished:length": 3}
    assert svc.blocks_back()


@pytest.mark.parametrize(("decode_blocks", "overlap"), [(6, True), (6, False), (20, False)])
def test_a_request_larger_than_a_nodes_whole_kv_is_refused_at_once_and_holds_up_no_one(decode_blocks, overlap):
    """A request that needs more KV blocks than a node has in all (the long prompt: 8 on D, 7 on P,
    of 6) would wait at the head of the queue for ever, and every request behind it too: it is
    refused RESOURCE_EXHAUSTED at once, by the decode node or (with 20 blocks on D) by the prefill
    node, and the small requests around it are served."""
    svc = RealService(k=2, engine={"num_blocks": 6}, decode_engine={"num_blocks": decode_blocks},
                      overlap_reserve=overlap, queue_size=4)
    try:
        async def main() -> list[str]:
            async with RouterClient(f"127.0.0.1:{svc.router.grpc_port}") as client:
                async def one(prompt: str, max_tokens: int) -> str:
                    req = build_request(prompt, max_tokens=max_tokens, ignore_eos=True, timeout_s=30)
                    return _ends([m async for m in client.stream(req)])

                return list(await asyncio.gather(one(LONG_PROMPT, 16), *(one(f"ab{i}", 8) for i in range(4))))

        ends = asyncio.run(main())
        assert ends == ["error:RESOURCE_EXHAUSTED"] + ["finished:length"] * 4, ends
        assert svc.blocks_back()
    finally:
        svc.close()


async def _load_until(port: int, done: asyncio.Event, concurrency: int) -> Counter[str]:
    """Keep `concurrency` requests in flight until `done` is set."""
    ends: Counter[str] = Counter()
    async with RouterClient(f"127.0.0.1:{port}") as client:
        async def worker(w: int) -> None:
            i = 0
            while not done.is_set():
                req = build_request(f"{w} busy {i}", max_tokens=24, ignore_eos=True)
                ends[_ends([m async for m in client.stream(req)])] += 1
                i += 1

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    return ends


def test_nodes_answering_status_late_under_full_load_stay_in_service():
    svc = RealService(k=2, rpc_timeout_s=1.0, status_failure_threshold=2)
    try:
        pool = svc.router.pool
        nodes = [pool.healthy("prefill")[0], pool.healthy("decode")[0]]

        async def main() -> Counter[str]:
            done = asyncio.Event()
            load = asyncio.create_task(_load_until(svc.router.grpc_port, done, concurrency=6))
            await asyncio.sleep(0.5)  # the nodes are busy before their Status turns late
            for node in svc.nodes:
                node.status_delay_s = 3.0  # past the router's 1 s deadline, each poll
            # more late answers in a row than the threshold allows a node that gives no other sign
            while min(n.status_failures["DEADLINE_EXCEEDED"] for n in nodes) < 4 and not load.done():
                await asyncio.sleep(0.05)
            for node in svc.nodes:
                node.status_delay_s = 0.0
            done.set()
            return await load

        ends = asyncio.run(main())
        assert set(ends) == {"finished:length"} and ends["finished:length"] >= 6, ends
        assert [n.downs for n in nodes] == [0, 0] and all(n.healthy for n in nodes)
        assert all(n.status_failures["DEADLINE_EXCEEDED"] >= 4 and n.status_failures["UNAVAILABLE"] == 0
                   for n in nodes)
        text = svc.call(svc.router.metrics_text())[0].decode()
        assert 'pdserve:node_status_failures_total{code="DEADLINE_EXCEEDED",kind="decode"' in text
        assert 'code="UNAVAILABLE"' not in text and "pdserve:node_failures_total{" not in text  # none taken out
        assert svc.blocks_back()
    finally:
        svc.close()
