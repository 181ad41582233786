"""The synthetic test backend (decode_node/synthetic.py) behind the real colocated servicer and a
real Router: the host path `bench host` measures, with exact token counts, logprobs, one terminal
per request, several requests' tokens in one batch to the right streams, and aborts."""

from __future__ import annotations

import asyncio

from decode_node.server import _more_steps, serve_colocated
from decode_node.synthetic import SyntheticNode
from deploy.config import RouterConfig
from engine.sampling.sampling_params import SamplingParams
from protos.messages import OutputItem
from router import NodeDirectory, Router
from router.client import RouterClient, build_request
from router.request import is_terminal
from tests.router.conftest import TINY


async def _service(node: SyntheticNode):
    node.start()
    server, port = serve_colocated(node, "synthetic", "127.0.0.1")
    cfg = RouterConfig(host="127.0.0.1", port=0, http_port=None, status_interval_s=3600.0)
    router = Router(TINY, NodeDirectory(colocated=[f"127.0.0.1:{port}"]), cfg, max_model_len=256)
    return server, router, RouterClient(f"127.0.0.1:{await router.start()}")


async def _stop(node: SyntheticNode, server, router: Router, client: RouterClient) -> None:
    await client.close()
    await router.stop()
    server.stop(grace=1)
    node.stop()


def test_synthetic_node_streams_exact_counts_to_each_request():
    asyncio.run(_exact_counts())


async def _exact_counts() -> None:
    node = SyntheticNode(TINY.config.vocab_size, k=3, step_s=0.001)
    server, router, client = await _service(node)
    try:
        prompts = ["abc", "hello", "xy", "the quick brown fox"]
        reqs = [build_request(p, max_tokens=10 + i, logprobs=1 if i % 2 else None, ignore_eos=True)
                for i, p in enumerate(prompts)]
        async def collect(r):
            return [m async for m in client.responses(r)]

        results = await asyncio.gather(*(collect(r) for r in reqs))
        for i, msgs in enumerate(results):
            assert is_terminal(msgs[-1]) and not any(is_terminal(m) for m in msgs[:-1])
            toks = [t for m in msgs for t in m.token_ids]
            ids = list(msgs[0].prompt_token_ids)
            assert toks == [ids[j % len(ids)] for j in range(10 + i)]  # the prompt's own ids, cycled
            assert msgs[-1].finished.reason == "length" and msgs[-1].finished.usage.completion_tokens == 10 + i
            assert len([lp for m in msgs for lp in m.logprobs]) == (10 + i if i % 2 else 0)
        await asyncio.sleep(0)
        assert node.status()["running"] == 0 and node.tokens == sum(10 + i for i in range(4))
    finally:
        await _stop(node, server, router, client)


def test_synthetic_node_ends_an_aborted_request_once():
    asyncio.run(_abort_once())


async def _abort_once() -> None:
    node = SyntheticNode(TINY.config.vocab_size, k=1, step_s=0.05)
    server, router, client = await _service(node)
    try:
        req = build_request("abc", max_tokens=200, ignore_eos=True, request_id="r1")
        stream = client.responses(req)
        first = await anext(stream)
        assert first.token_ids
        assert await client.abort("r1")
        rest = [m async for m in stream]
        assert rest[-1].finished.reason == "abort" and not any(is_terminal(m) for m in rest[:-1])
        assert router.counts["finished:abort"] == 1
    finally:
        await _stop(node, server, router, client)


def test_synthetic_node_refuses_past_max_num_seqs_and_unknown_owners():
    # one step and no more: the first request holds the one slot however late the second comes
    node = SyntheticNode(TINY.config.vocab_size, max_num_seqs=1, step_s=3600.0)
    node.start()
    try:
        params = SamplingParams(max_tokens=4)
        assert node.submit("a/1", [1, 2], params, 0, ()).result(5).admitted
        full = node.submit("a/2", [1, 2], params, 0, ()).result(5)
        assert not full.admitted and "full" in full.reason
    finally:
        node.stop()


def test_synthetic_node_keeps_the_decode_nodes_owners_rule():
    """As a decode node (test_node_servers.py): an owner's last output stream ending ends its
    requests (one abort terminal each) and refuses its new ones until it subscribes again; another
    owner's requests go on. The synthetic node once kept its own copy of this rule, with commands
    of another shape than the decode node's; it now runs the decode node's (decode_node/streams.py)."""
    node = SyntheticNode(TINY.config.vocab_size, step_s=3600.0)  # one step, the first token, then none
    node.start()
    try:
        params = SamplingParams(max_tokens=4)
        first, second = node.subscribe("r1"), node.subscribe("r1")
        node.subscribe("r2")
        watcher = node.subscribe()  # no owner: every item
        assert node.submit("r1/a/1", [1, 2], params, 0, ()).result(5).admitted
        assert node.submit("r2/a/1", [1, 2], params, 0, ()).result(5).admitted
        node.unsubscribe(first, "r1")
        assert node.submit("r1/b/1", [1, 2], params, 0, ()).result(5).admitted  # one stream is still open
        node.unsubscribe(second, "r1")
        refused = node.submit("r1/c/1", [1, 2], params, 0, ()).result(5)
        assert not refused.admitted
        ends: list[str] = []
        while len(ends) < 2:
            ends += [i.request_id for i in watcher.get(timeout=5) if i.finish_reason is not None]
        assert sorted(ends) == ["r1/a/1", "r1/b/1"] and set(node.requests) == {"r2/a/1"}
        node.subscribe("r1")
        assert node.submit("r1/d/1", [1, 2], params, 0, ()).result(5).admitted
    finally:
        node.stop()


def test_a_stream_behind_the_loop_sends_the_queued_steps_in_one_message_in_order():
    import queue

    q: queue.SimpleQueue = queue.SimpleQueue()
    steps = [[OutputItem("a", [i]), OutputItem("b", [10 + i])] for i in range(3)]
    for s in steps[1:]:
        q.put(s)
    items, stopping = _more_steps(q, steps[0])
    assert [(i.request_id, i.tokens) for i in items] == [(r, [t]) for s in range(3) for r, t in (("a", s), ("b", 10 + s))]
    assert not stopping and q.empty()
    q.put(None)
    assert _more_steps(q, steps[0]) == (steps[0], True)
