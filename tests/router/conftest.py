"""Runs `async def` tests in a fresh event loop, uvloop's as in the router process (no plugin
needed), and the `cluster` harness: a Router on 127.0.0.1 in front of fake prefill and decode
nodes (tests/router/fake_nodes.py)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest
import uvloop

from deploy.config import RouterConfig
from engine.model.info import load_model_info
from router import NodeDirectory, Router
from router.client import RouterClient
from tests.router.fake_nodes import FakeDecode, FakePrefill

TEST_TIMEOUT_S = 60


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    if not inspect.iscoroutinefunction(pyfuncitem.obj):
        return None
    args = {name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames}
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:  # the router process's loop
        runner.run(asyncio.wait_for(pyfuncitem.obj(**args), TEST_TIMEOUT_S))
    return True


TINY = load_model_info("tiny")
MAX_MODEL_LEN = 256


@dataclass
class Cluster:
    router: Router
    client: RouterClient
    prefill: list[FakePrefill]
    decode: list[FakeDecode]
    directory: NodeDirectory

    async def until(self, pred: Callable[[], bool], timeout: float = 20.0) -> None:
        """Wait for router-side state (the router has no event to await): re-check on every
        change the fake nodes report and on a short tick."""
        async with asyncio.timeout(timeout):
            while not pred():
                await asyncio.sleep(0.005)

    async def settled(self) -> None:
        """I4: the router has nothing in flight, and no live fake node holds anything."""
        await self.until(lambda: not self.router.requests and not self.router.pool._tasks)
        for node in [*self.prefill, *self.decode]:
            if not node.dead:
                await node.until(lambda n=node: n.held == 0)


@asynccontextmanager
async def cluster(n_prefill: int = 1, n_decode: int = 1, *, decode: dict | None = None,
                  prefill: dict | None = None, **config: object) -> AsyncIterator[Cluster]:
    ps = [FakePrefill(f"p{i}", **(prefill or {})) for i in range(n_prefill)]
    ds = [FakeDecode(f"d{i}", **(decode or {})) for i in range(n_decode)]
    for node in [*ps, *ds]:
        await node.start()
    directory = NodeDirectory([p.address for p in ps], [d.address for d in ds])
    cfg = RouterConfig(**{"host": "127.0.0.1", "port": 0, "http_port": None, "status_interval_s": 3600.0,
                          **config})  # type: ignore[arg-type]
    router = Router(TINY, directory, cfg, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=2)
    port = await router.start()
    client = RouterClient(f"127.0.0.1:{port}")
    try:
        yield Cluster(router, client, ps, ds, directory)
    finally:
        await client.close()
        await router.stop()
        for node in [*ps, *ds]:
            await node.stop()
