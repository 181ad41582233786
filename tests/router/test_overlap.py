"""PD placement that reserves on the decode node while the prefill node computes
(`router.overlap_reserve`): the Prefill request carries no KV descriptor and an Attach call brings
it; with no room on a decode node the prefill is given up and the request queues; a refused
Attach moves the request. Against the scripted fake nodes."""

from __future__ import annotations

import asyncio

from prometheus_client.parser import text_string_to_metric_families

from tests.router.conftest import cluster
from tests.router.test_lifecycle import collect, text


async def test_the_prefill_starts_without_a_descriptor_and_gets_it_by_attach():
    async with cluster() as c:
        p, d = c.prefill[0], c.decode[0]
        msgs = await collect(c, prompt="ab", max_tokens=6)
        assert text(msgs) == "chello" and msgs[-1].finished.reason == "length"
        (rid,) = d.admitted
        assert p.calls == p.deferred == p.attaches == d.first_tokens == [rid]
        assert abandoned(c) == {}
        await c.settled()
    async with cluster(overlap_reserve=False) as c:
        msgs = await collect(c, prompt="ab", max_tokens=6)
        assert text(msgs) == "chello"
        assert c.prefill[0].calls and not c.prefill[0].deferred and not c.prefill[0].attaches
        await c.settled()
    async with cluster() as c:  # a prefill node whose Status says it takes no Attach (tensor parallel)
        c.prefill[0].takes_attach = False
        await c.router.refresh()
        assert text(await collect(c, prompt="ab", max_tokens=6)) == "chello"
        assert c.prefill[0].calls and not c.prefill[0].deferred
        await c.settled()


async def test_no_room_on_a_decode_node_gives_the_prefill_up_and_queues_without_asking_twice():
    async with cluster(queue_size=4) as c:
        p, d = c.prefill[0], c.decode[0]
        d.refuse = True
        waiting = asyncio.create_task(collect(c, prompt="ab", max_tokens=4))
        await c.until(lambda: c.router.num_queued == 1)
        assert len(d.reserves) == 1  # asked once, while P computed; then the queue
        await p.until(lambda: p.aborts == p.deferred)  # the prefill without a reservation is given up
        d.refuse = False
        await c.router.refresh()
        msgs = await asyncio.wait_for(waiting, 50)
        assert text(msgs) == "chel" and msgs[-1].finished.reason == "length"
        assert len(p.calls) == 2 and len(p.deferred) == 1 and not p.attaches  # the second came with its descriptor
        assert abandoned(c) == {"no_decode_at_once": len(p.prompts[0][0])}  # counted once, by its tokens
        await c.settled()


async def test_a_refused_attach_moves_the_request_after_its_first_token():
    """The first token goes out before the Attach is confirmed; a refused one moves the request on
    from that token (the second prefill's prompt holds it), as a decode node's loss would."""
    async with cluster() as c:
        p, d = c.prefill[0], c.decode[0]
        p.refuse_attaches = 1
        msgs = await collect(c, prompt="ab", max_tokens=5)
        assert text(msgs) == "c" + "dhel" and msgs[-1].finished.reason == "length"
        assert [len(q) for q, _ in p.prompts] == [3, 4]
        first, second = p.attaches
        await p.until(lambda: first in p.aborts)  # P drops the job it would hold until the KV timeout
        await d.until(lambda: first in d.aborts)  # and the first reservation went back
        assert d.first_tokens == [second]
        assert c.router.migrations == 1
        await c.settled()


class _CallOrder:
    """A node stub that notes in `order` when its `method` is called (after the work that decided it)."""

    def __init__(self, stub: object, method: str, order: list[str]) -> None:
        self._stub, self._method, self._order = stub, method, order

    def __getattr__(self, name: str) -> object:
        real = getattr(self._stub, name)
        if name != self._method:
            return real

        def call(*args: object, **kwargs: object) -> object:
            self._order.append(name)
            return real(*args, **kwargs)
        return call


class _StreamSendOrder:
    """A prefill node stub whose PrefillStream notes in `order` when a Prefill request is written."""

    def __init__(self, stub: object, order: list[str]) -> None:
        self._stub, self._order = stub, order

    def __getattr__(self, name: str) -> object:
        return getattr(self._stub, name)

    def PrefillStream(self, *args: object, **kwargs: object) -> object:  # noqa: N802
        return _WriteOrder(self._stub.PrefillStream(*args, **kwargs), self._order)  # type: ignore[attr-defined]


class _WriteOrder:
    def __init__(self, call: object, order: list[str]) -> None:
        self._call, self._order = call, order

    def __getattr__(self, name: str) -> object:
        return getattr(self._call, name)

    async def write(self, msg: object) -> None:
        if msg.WhichOneof("kind") == "prefill":  # type: ignore[attr-defined]
            self._order.append("Prefill")
        await self._call.write(msg)  # type: ignore[attr-defined]


async def test_the_prefill_request_goes_out_before_the_reservation_is_made():
    """With the reservation alongside, the Prefill request is on the first token's path and the Reserve
    is not: the prefill request leaves before the reservation's own work (the policy's order, the
    Reserve call), not after it."""
    async with cluster() as c:
        order: list[str] = []
        prefill = c.router.pool.find("prefill", c.prefill[0].address)
        decode = c.router.pool.find("decode", c.decode[0].address)
        assert prefill is not None and decode is not None
        prefill.stub = _StreamSendOrder(prefill.stub, order)
        decode.stub = _CallOrder(decode.stub, "Reserve", order)
        assert text(await collect(c, prompt="ab", max_tokens=3)) == "che"
        assert order == ["Prefill", "Reserve"]
        await c.settled()


def abandoned(c) -> dict[str, float]:
    """The router's prompt tokens of given-up Prefill requests, by reason (/metrics)."""
    text = c.router.metrics.exposition()[0].decode()
    return {s.labels["reason"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
            if s.name == "pdserve:prefill_abandoned_tokens_total"}
