"""A service that is still starting: its router serves before its nodes are up (deploy/service.py
starts the router first; nodes load their model for tens of seconds). A request that arrives then
waits for its nodes (`router.node_wait_s`, default 60 s) and is served, in a PD service and in a
colocated one alike, whose kind the router learns only from the nodes listed; with no node listed
within the wait it ends UNAVAILABLE."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from decode_node.server import serve_colocated
from decode_node.synthetic import SyntheticNode
from router import NodeDirectory, Router
from router.client import RouterClient, build_request
from router.config import RouterConfig
from tests.router.conftest import MAX_MODEL_LEN, TINY
from tests.router.fake_nodes import FakeDecode, FakePrefill


def _router(directory: NodeDirectory, **config: object) -> Router:
    cfg = RouterConfig(**{"host": "127.0.0.1", "port": 0, "http_port": None, "status_interval_s": 0.05,
                          **config})  # type: ignore[arg-type]
    return Router(TINY, directory, cfg, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=2)


async def _collect(client: RouterClient, prompt: str, max_tokens: int) -> list:
    return [m async for m in client.stream(build_request(prompt, max_tokens=max_tokens))]


class _TemplatedTokenizer:
    """TINY's tokenizer with a chat template that counts its compilations."""

    has_chat_template = True

    def __init__(self, inner: object) -> None:
        self.inner, self.compiled = inner, 0

    def prepare_chat_template(self) -> None:
        self.compiled += 1

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


async def test_a_router_compiles_its_chat_template_before_it_serves():
    """jinja2's import and the template's compilation come before the router serves, not on its first
    chat request (a node never imports jinja2: tests/engine/test_model_info.py)."""
    tokenizer = _TemplatedTokenizer(TINY.tokenizer)
    router = Router(replace(TINY, tokenizer=tokenizer), NodeDirectory(),
                    RouterConfig(host="127.0.0.1", port=0, http_port=None), max_model_len=MAX_MODEL_LEN)
    await router.start()
    try:
        assert tokenizer.compiled == 1
    finally:
        await router.stop()


def test_node_wait_s_defaults_to_riding_out_a_restart():
    assert RouterConfig().node_wait_s == 60.0


async def test_a_request_sent_before_the_pd_nodes_are_up_waits_for_them_and_finishes():
    directory = NodeDirectory()  # the service's router serves; its nodes are still loading
    router = _router(directory)
    client = RouterClient(f"127.0.0.1:{await router.start()}")
    p, d = FakePrefill("p0"), FakeDecode("d0")
    try:
        early = asyncio.create_task(_collect(client, "ab", 4))
        await asyncio.sleep(0.3)
        assert not early.done() and len(router.requests) == 1  # waiting, not UNAVAILABLE
        directory.add("prefill", await p.start())  # the prefill node comes up first
        await asyncio.sleep(0.2)
        assert not early.done()
        directory.add("decode", await d.start())
        msgs = await asyncio.wait_for(early, 20)
        assert msgs[-1].finished.reason == "length" and msgs[-1].finished.usage.completion_tokens == 4
        assert router.counts["finished:length"] == 1 and not router.requests
    finally:
        await client.close()
        await router.stop()
        for node in (p, d):
            await node.stop()


async def test_a_request_sent_before_the_colocated_nodes_are_up_is_placed_on_one():
    directory = NodeDirectory()
    router = _router(directory)
    client = RouterClient(f"127.0.0.1:{await router.start()}")
    node = SyntheticNode(TINY.config.vocab_size, k=2, step_s=0.001)
    server = None
    try:
        early = asyncio.create_task(_collect(client, "ab", 5))
        await asyncio.sleep(0.3)
        assert not early.done()
        node.start()
        server, port = serve_colocated(node, "c0", "127.0.0.1")
        directory.add("colocated", f"127.0.0.1:{port}")
        msgs = await asyncio.wait_for(early, 20)
        assert msgs[-1].finished.reason == "length" and msgs[-1].finished.usage.completion_tokens == 5
    finally:
        await client.close()
        await router.stop()
        if server is not None:
            server.stop(grace=1)
        node.stop()


async def test_no_node_listed_within_node_wait_s_is_unavailable():
    router = _router(NodeDirectory(), node_wait_s=0.2)
    client = RouterClient(f"127.0.0.1:{await router.start()}")
    try:
        msgs = await _collect(client, "ab", 4)
        assert len(msgs) == 1 and msgs[0].error.code == "UNAVAILABLE" and "no node" in msgs[0].error.message
    finally:
        await client.close()
        await router.stop()
