"""Priming (router/priming.py): the router primes each prefill node for each decode node before
it chooses either, once per pair; a node joining later waits for its primes, a failed prime does
not keep a node out."""

from __future__ import annotations

import asyncio

from tests.router.conftest import cluster
from tests.router.fake_nodes import FakeDecode


async def test_every_pair_is_primed_once_before_the_router_serves() -> None:
    async with cluster(n_prefill=2, n_decode=2) as c:
        for p in c.prefill:  # the router's start returned: its nodes were primed already
            assert sorted(addr for _, addr in p.primes) == sorted(d.address for d in c.decode)
        for d in c.decode:
            assert len(d.primes) == 2
        rids = {rid for p in c.prefill for rid, _ in p.primes}
        assert rids == {rid for d in c.decode for rid in d.primes}  # each prefill node ran its decode node's
        assert c.router.health().serving
        await c.router.pool.refresh()  # a later round primes nothing again
        assert sum(len(p.primes) for p in c.prefill) == 4
        await c.settled()


async def test_a_decode_node_that_joins_is_chosen_only_once_primed() -> None:
    async with cluster() as c:
        [p] = c.prefill
        p.prime_hold = asyncio.Event()
        late = FakeDecode("late")
        await late.start()
        try:
            c.directory.add("decode", late.address)
            refresh = asyncio.ensure_future(c.router.pool.refresh())
            await p.until(lambda: any(addr == late.address for _, addr in p.primes))
            node = c.router.pool.find("decode", late.address)
            assert node is not None and node.healthy  # up (subscribed), not yet selectable
            assert [n.address for n in c.router.pool.healthy("decode")] == [c.decode[0].address]
            p.prime_hold.set()
            await refresh
            assert {n.address for n in c.router.pool.healthy("decode")} == {c.decode[0].address, late.address}
        finally:
            await late.stop()


async def test_a_failed_prime_leaves_the_node_selectable_and_is_not_retried() -> None:
    async with cluster(prefill={}) as c:
        [p] = c.prefill
        p.refuse_primes = True
        late = FakeDecode("late")
        await late.start()
        try:
            c.directory.add("decode", late.address)
            await c.until(lambda: len(c.router.pool.healthy("decode")) == 2)
            assert c.router.pool.primer.failed == 1
            await c.router.pool.refresh()
            assert len(late.primes) == 1
        finally:
            await late.stop()


async def test_a_decode_node_back_after_failing_is_primed_again() -> None:
    async with cluster() as c:
        [p], [d] = c.prefill, c.decode
        node = c.router.pool.find("decode", d.address)
        assert node is not None
        c.router.pool.mark_failed(node, "stream broke (test)")
        assert not c.router.pool.healthy("decode")
        await c.router.pool.refresh()  # Status answers: subscribed again, then primed again
        assert [n.address for n in c.router.pool.healthy("decode")] == [d.address]
        assert len(p.primes) == 2 and len(d.primes) == 2
