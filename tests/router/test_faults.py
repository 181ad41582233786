"""Faults: a full admission queue, a decode node dying mid-stream, prefill nodes failing,
membership changes. Every request still ends with exactly one terminal event."""

from __future__ import annotations

import asyncio

from router.client import build_request
from tests.router.conftest import cluster
from tests.router.fake_nodes import FakeDecode
from tests.router.test_lifecycle import collect, text, tokens


async def test_capacity_news_during_a_refused_retry_is_not_lost():
    """A woken request asks the nodes again; capacity that frees while those RPCs are out (with
    no waiter left in the queue to wake) must still reach it, not wait for the next poll."""
    async with cluster(n_decode=1, queue_size=1) as c:
        node = c.decode[0]
        node.refuse = True
        waiting = asyncio.create_task(collect(c, prompt="ab", max_tokens=4))
        await c.until(lambda: c.router.num_queued == 1)
        node.reserve_gate = asyncio.Event()
        await c.router.refresh()  # wakes it: it asks again, and the node decides "refused"
        await c.until(lambda: len(node.reserves) == 2 and c.router.num_queued == 0)
        node.refuse = False
        await c.router.refresh()  # capacity news while the refused answer is still on its way
        node.reserve_gate.set()
        msgs = await asyncio.wait_for(waiting, 50)  # status polls are an hour apart here
        assert text(msgs) == "chel" and msgs[-1].finished.reason == "length"
        assert len(node.reserves) == 3 and node.admitted
        await c.settled()


async def test_queue_full_is_resource_exhausted_and_queued_request_runs_when_capacity_frees():
    async with cluster(n_decode=2, queue_size=1) as c:
        for d in c.decode:
            d.refuse = True
        waiting = asyncio.create_task(collect(c, prompt="ab", max_tokens=4))
        await c.until(lambda: c.router.num_queued == 1)
        assert sum(len(d.reserves) for d in c.decode) == 2  # both decode nodes were asked first
        msgs = await collect(c, prompt="xy", max_tokens=4)
        assert len(msgs) == 1 and msgs[0].error.code == "RESOURCE_EXHAUSTED"
        assert "queue" in msgs[0].error.message and msgs[0].prompt_token_ids
        assert not waiting.done()
        c.decode[1].refuse = False
        await c.router.refresh()  # a Status round: capacity may have freed
        msgs = await waiting
        assert text(msgs) == "chel" and msgs[-1].finished.reason == "length"
        assert c.decode[1].admitted and not c.decode[0].admitted
        await c.settled()


async def test_queue_of_zero_answers_at_once_and_deadline_applies_while_queued():
    async with cluster(queue_size=0) as c:
        c.decode[0].refuse = True
        msgs = await collect(c, prompt="ab")
        assert msgs[-1].error.code == "RESOURCE_EXHAUSTED"
    async with cluster(queue_size=4) as c:
        c.decode[0].refuse = True
        msgs = await collect(c, prompt="ab", timeout_s=0.2)
        assert msgs[-1].error.code == "DEADLINE_EXCEEDED" and c.router.num_queued == 0
        await c.settled()


async def test_without_migration_decode_node_death_fails_its_requests_and_new_ones_go_to_the_live_node():
    async with cluster(n_decode=2, decode={"pause_after": 3}, migrate=False) as c:
        d0, d1 = c.decode
        d1.free_blocks_report = 5  # least-load prefers d0 (1000 free blocks)
        await c.router.refresh()
        streams = [c.client.stream(build_request("ab", max_tokens=40)) for _ in range(3)]
        for s in streams:
            assert (await s.read()).token_ids == [ord("c")]
        assert len(d0.admitted) == 3 and not d1.admitted
        await d0.die()
        for s in streams:
            rest = []
            while not rest or not (rest[-1].HasField("error") or rest[-1].HasField("finished")):
                rest.append(await s.read())
            assert rest[-1].error.code == "UNAVAILABLE" and d0.address in rest[-1].error.message
        health = await c.client.health()
        assert health.decode_nodes == 1 and health.serving
        d1.resume()
        msgs = await collect(c, prompt="ab", max_tokens=5)
        assert msgs[-1].finished.reason == "length" and len(d1.admitted) == 1
        # the dead node is replaced by a new one at another address (deploy restarts the actor)
        d2 = FakeDecode("d2")
        c.decode.append(d2)
        c.directory.replace("decode", d0.address, await d2.start())
        await c.until(lambda: len(c.router.pool.healthy("decode")) == 2)
        assert {n.address for n in c.router.pool.healthy("decode")} == {d1.address, d2.address}
        await c.settled()


async def read_to_end(stream) -> list:
    msgs = []
    while not msgs or not (msgs[-1].HasField("error") or msgs[-1].HasField("finished")):
        msgs.append(await stream.read())
    return msgs


async def start_on_d0(c, max_tokens: int):
    """A stream placed on d0 (d1 reports few free blocks), read until d0 pauses it after 4 tokens."""
    c.decode[1].free_blocks_report = 5
    await c.router.refresh()
    stream = c.client.stream(build_request("ab", max_tokens=max_tokens))
    msgs = [await stream.read()]
    while len(tokens(msgs)) < 4:
        msgs.append(await stream.read())
    assert len(c.decode[0].admitted) == 1 and not c.decode[1].admitted
    return stream, msgs


async def test_decode_node_death_moves_its_request_every_token_once():
    async with cluster(n_decode=2, decode={"pause_after": 4}) as c:
        d0, d1 = c.decode
        stream, msgs = await start_on_d0(c, max_tokens=10)
        d1.resume()
        await d0.die()
        msgs += await read_to_end(stream)
        assert not any(m.HasField("error") for m in msgs) and msgs[-1].finished.reason == "length"
        assert text(msgs) == "chel" + "m" + "hello"  # P's first token after "...l", then d1's script
        assert len(tokens(msgs)) == 10 == msgs[-1].finished.usage.completion_tokens
        p = c.prefill[0]
        prompt = list(msgs[0].prompt_token_ids)
        assert p.prompts == [(prompt, 10), (prompt + tokens(msgs)[:4], 6)]  # max_tokens counts what was sent
        assert len(d1.admitted) == 1 and c.router.migrations == 1
        await c.settled()


async def test_attempt_the_decode_node_gives_up_on_is_placed_again():
    """D ends an attempt with an error (its KV never came: the prefill node died mid-transfer):
    the request is placed again and finishes; P's first token was sent once."""
    async with cluster(n_decode=1) as c:
        c.decode[0].fail_transfers = 1
        msgs = await collect(c, prompt="ab", max_tokens=6)
        assert msgs[-1].finished.reason == "length" and text(msgs) == "c" + "dhell"
        p = c.prefill[0]
        assert [(len(q), n) for q, n in p.prompts] == [(3, 6), (4, 5)] and c.router.migrations == 1
        await c.settled()


async def test_request_with_no_decode_node_left_to_move_to_ends_with_one_error_naming_both():
    async with cluster(n_decode=1, decode={"pause_after": 2}, node_wait_s=0) as c:  # no wait for a replacement
        d0 = c.decode[0]
        stream = c.client.stream(build_request("ab", max_tokens=40))
        await stream.read()
        await d0.die()
        msgs = await read_to_end(stream)
        err = msgs[-1].error
        assert err.code == "UNAVAILABLE" and "no healthy decode node" in err.message and d0.address in err.message
        assert sum(m.HasField("error") or m.HasField("finished") for m in msgs) == 1
        await c.settled()


async def test_request_that_cannot_move_again_ends_with_one_clear_error():
    async with cluster(n_decode=2, decode={"pause_after": 4}, max_migrations=1) as c:
        d0, d1 = c.decode
        stream, msgs = await start_on_d0(c, max_tokens=40)
        await d0.die()
        await d1.until(lambda: len(d1.admitted) == 1 and d1.held == 1)
        await c.until(lambda: any(st.decode is not None and st.decode.address == d1.address
                                  and st.prefill is None for st in c.router.requests.values()))
        await d1.die()
        msgs += await read_to_end(stream)
        err = msgs[-1].error
        assert err.code == "UNAVAILABLE" and d1.address in err.message and "max_migrations" in err.message
        assert sum(m.HasField("error") or m.HasField("finished") for m in msgs) == 1
        await c.settled()


async def test_decode_node_recovers_after_its_status_succeeds_again():
    async with cluster(n_decode=1, node_wait_s=0) as c:
        d0 = c.decode[0]
        await d0.die()
        await c.until(lambda: not c.router.pool.healthy("decode"))
        msgs = await collect(c, prompt="ab")
        assert msgs[-1].error.code == "UNAVAILABLE" and "no healthy decode node" in msgs[-1].error.message
        back = FakeDecode("d0-again")
        c.decode.append(back)
        c.directory.replace("decode", d0.address, await back.start())
        await c.until(lambda: len(c.router.pool.healthy("decode")) == 1)
        assert (await collect(c, prompt="ab", max_tokens=3))[-1].finished.reason == "length"
        await c.settled()


async def test_node_restarted_at_the_same_address_is_probed_back_to_service():
    async with cluster(n_prefill=1, n_decode=1, status_interval_s=0.05) as c:
        d0 = c.decode[0]
        await d0.die()
        await c.until(lambda: not c.router.pool.healthy("decode"))
        again = FakeDecode("d0-restarted")
        c.decode.append(again)
        await again.start(port=int(d0.address.rsplit(":", 1)[1]))  # deploy restarted the actor
        await c.until(lambda: len(c.router.pool.healthy("decode")) == 1)  # periodic Status probes
        assert (await collect(c, prompt="ab", max_tokens=3))[-1].finished.reason == "length"
        assert len(again.admitted) == 1
        await c.settled()


async def test_node_reporting_itself_unhealthy_is_not_chosen():
    async with cluster(n_decode=2) as c:
        d0, d1 = c.decode
        d1.free_blocks_report = 1  # least-load would prefer d0 ...
        d0.report_unhealthy = True  # ... but d0 says it is unhealthy
        await c.router.refresh()
        await collect(c, prompt="ab", max_tokens=2)
        assert not d0.admitted and len(d1.admitted) == 1
        await c.settled()


async def test_prefill_unavailable_is_retried_on_the_other_prefill_node():
    async with cluster(n_prefill=2) as c:
        p0, p1 = c.prefill
        p1.queued_tokens = 1000  # least-load picks p0 first
        await c.router.refresh()
        p0.fail = True
        msgs = await collect(c, prompt="ab", max_tokens=4)
        assert text(msgs) == "chel" and msgs[-1].finished.reason == "length"
        d = c.decode[0]
        assert len(p0.calls) == 1 and len(p1.calls) == 1 and p0.calls[0] != p1.calls[0]
        assert d.reserves == [p0.calls[0], p1.calls[0]]  # re-reserved for the retry
        assert d.aborts == [p0.calls[0]]  # the first reservation was given back
        assert [n.address for n in c.router.pool.healthy("prefill")] == [p1.address]
        # p0 is not chosen while unhealthy
        await collect(c, prompt="ab", max_tokens=2)
        assert len(p0.calls) == 1 and len(p1.calls) == 2
        # ... and is chosen again once its Status succeeds
        p0.fail = False
        await c.router.refresh()
        await collect(c, prompt="ab", max_tokens=2)
        assert len(p0.calls) == 2
        await c.settled()


async def test_retry_after_prefill_crash_never_mixes_in_the_old_attempts_output():
    async with cluster(n_prefill=2) as c:
        p0, p1 = c.prefill
        p1.queued_tokens = 1000
        await c.router.refresh()
        p0.fail_after_first_token = True  # D decodes attempt 0, then P fails
        p0.hold_failure = asyncio.Event()
        run = asyncio.create_task(collect(c, prompt="ab", max_tokens=6))
        await c.decode[0].until(lambda: len(c.decode[0].finished) == 1)  # attempt 0 fully decoded
        await c.until(lambda: any(st.events.qsize() for st in c.router.requests.values()))
        c.decode[0].script = list(b"WORLD!")  # what attempt 1 will get
        p0.hold_failure.set()
        msgs = await run
        assert text(msgs) == "cWORLD" and msgs[-1].finished.reason == "length"
        assert msgs[-1].finished.usage.completion_tokens == 6
        d = c.decode[0]
        assert d.aborts == [p0.calls[0]] and d.first_tokens == [p0.calls[0], p1.calls[0]]
        await c.settled()


async def test_every_prefill_node_failing_is_unavailable():
    async with cluster(n_prefill=2, prefill_retries=5, node_wait_s=0) as c:
        for p in c.prefill:
            p.fail = True
        msgs = await collect(c, prompt="ab")
        err = msgs[-1].error
        assert err.code == "UNAVAILABLE" and all(p.address in err.message for p in c.prefill)
        assert (await c.client.health()).serving is False
        await c.settled()
        d = c.decode[0]
        assert len(d.aborts) == len(d.reserves) == 2  # no reservation once no prefill node was left


async def test_directory_add_and_remove_are_seen_by_the_router():
    async with cluster(n_decode=1, decode={"pause_after": 2}) as c:
        d0 = c.decode[0]
        stream = c.client.stream(build_request("ab", max_tokens=20))
        await stream.read()
        extra = FakeDecode("d-extra")
        c.decode.append(extra)
        await asyncio.to_thread(c.directory.add, "decode", await extra.start())  # from another thread
        await c.until(lambda: len(c.router.pool.healthy("decode")) == 2)
        extra.resume()
        c.directory.remove("decode", d0.address)  # its request moves to the node still listed
        msgs = await read_to_end(stream)
        assert msgs[-1].finished.reason == "length" and msgs[-1].finished.usage.completion_tokens == 20
        await d0.until(lambda: d0.held == 0)  # the router gave its reservation back
        assert (await collect(c, prompt="ab", max_tokens=3))[-1].finished.reason == "length"
        assert len(extra.admitted) == 2
        await c.settled()


async def test_new_request_waits_for_a_replacement_decode_node_within_node_wait_s():
    async with cluster(n_decode=1, node_wait_s=50.0) as c:  # the bound: the next test
        d0 = c.decode[0]
        await d0.die()
        await c.until(lambda: not c.router.pool.healthy("decode"))
        waiting = asyncio.create_task(collect(c, prompt="ab", max_tokens=3))
        await asyncio.sleep(0.3)
        assert not waiting.done()  # no decode node: it waits instead of failing
        back = FakeDecode("d0-replacement")
        c.decode.append(back)
        c.directory.replace("decode", d0.address, await back.start())
        assert (await waiting)[-1].finished.reason == "length"
        assert len(back.admitted) == 1
        await c.settled()


async def test_wait_for_a_node_is_bounded_by_node_wait_s():
    async with cluster(n_decode=1, node_wait_s=0.2) as c:
        await c.decode[0].die()
        await c.until(lambda: not c.router.pool.healthy("decode"))
        msgs = await collect(c, prompt="ab")
        assert msgs[-1].error.code == "UNAVAILABLE" and "no healthy decode node" in msgs[-1].error.message
        await c.settled()


async def test_prefill_nodes_gone_while_a_reservation_waited_make_it_wait_not_fail():
    """Every prefill node goes down while a request's Reserve is out (node restarts): the
    reservation is given back and the request waits for a prefill node (`node_wait_s`), then
    finishes, instead of ending UNAVAILABLE "no healthy prefill node". (Reserving first: with
    `overlap_reserve` the Prefill request is out already and goes on.)"""
    async with cluster(node_wait_s=30.0, overlap_reserve=False) as c:
        d = c.decode[0]
        d.reserve_gate = asyncio.Event()
        request = asyncio.create_task(collect(c, prompt="ab", max_tokens=4))
        await c.until(lambda: len(d.reserves) == 1)
        c.router.pool.mark_failed(c.router.pool.find("prefill", c.prefill[0].address), "down (test)")
        d.reserve_gate.set()
        await c.until(lambda: len(d.aborts) == 1)  # the reservation went back
        await c.router.refresh()  # a Status round: the prefill node is back
        msgs = await asyncio.wait_for(request, 50)
        assert text(msgs) == "chel" and msgs[-1].finished.reason == "length"
        assert len(d.reserves) == 2
        await c.settled()


async def test_a_malformed_item_in_a_batch_moves_its_request_only():
    """One request's item of a multiplexed output batch is bad (a token outside the vocabulary):
    that item is refused and its request moves (prompt + tokens sent, recomputed; D gets an Abort
    for the attempt), while the batch's other requests and the node go on untouched."""
    async with cluster(decode={"pause_after": 3}) as c:
        d0 = c.decode[0]
        streams = [c.client.stream(build_request("ab", max_tokens=12)) for _ in range(3)]
        for s in streams:
            assert (await s.read()).token_ids == [ord("c")]
        await d0.until(lambda: len(d0.seqs) == 3 and all(s.generated == 3 for s in d0.seqs.values()))
        d0.corrupt = 1
        d0.resume()
        ends = [[ord("c")] + tokens(await read_to_end(s)) for s in streams]
        assert all(len(e) == 12 for e in ends) and c.router.migrations == 1
        await d0.until(lambda: len(d0.aborts) == 1)  # spawned as the request moves
        assert len(d0.aborts) == 1 and len(d0.admitted) == 4  # the moved request's new attempt
        assert (await c.client.health()).decode_nodes == 1 and c.router.counts["finished:length"] == 3
        await c.settled()


async def test_a_malformed_item_without_migration_ends_its_request_only():
    async with cluster(decode={"pause_after": 3}, migrate=False) as c:
        d0 = c.decode[0]
        streams = [c.client.stream(build_request("ab", max_tokens=12)) for _ in range(3)]
        for s in streams:
            await s.read()
        await d0.until(lambda: len(d0.seqs) == 3 and all(s.generated == 3 for s in d0.seqs.values()))
        d0.corrupt = 1
        d0.resume()
        ends = [await read_to_end(s) for s in streams]
        errors = [e[-1].error for e in ends if e[-1].HasField("error")]
        assert len(errors) == 1 and errors[0].code == "UNAVAILABLE" and "malformed output item" in errors[0].message
        await d0.until(lambda: len(d0.aborts) == 1)  # spawned as the request ends: it may land after its stream
        assert c.router.counts["finished:length"] == 2 and len(d0.aborts) == 1
        assert (await c.client.health()).decode_nodes == 1
        await c.settled()


async def test_a_busy_prefill_node_stays_selectable_until_its_status_is_late_three_times_in_a_row():
    """A Status past its deadline means busy, not gone: the node stays selectable (requests go on
    reaching it) until `status_failure_threshold` such answers come in a row; one answer in time
    resets the count. With a threshold of 1 the first late answer takes it out, as before."""
    async with cluster(n_prefill=1, rpc_timeout_s=0.3, node_wait_s=0) as c:
        p, pool = c.prefill[0], c.router.pool
        [node] = pool.healthy("prefill")
        p.status_delay_s = 1.0
        for late in (1, 2):
            await c.router.refresh()
            assert pool.healthy("prefill") == [node] and node.late_status == late and "busy" in node.last_error
        msgs = await collect(c, prompt="ab", max_tokens=3)  # still chosen while late
        assert msgs[-1].finished.reason == "length"
        p.status_delay_s = 0.0
        await c.router.refresh()  # in time: the count starts again
        assert node.late_status == 0 and node.last_error == ""
        p.status_delay_s = 1.0
        for _ in range(3):
            await c.router.refresh()
        assert pool.healthy("prefill") == [] and "DEADLINE_EXCEEDED" in node.last_error
        msgs = await collect(c, prompt="ab", max_tokens=3)
        assert msgs[-1].error.code == "UNAVAILABLE"  # no healthy prefill node, node_wait_s 0
        p.status_delay_s = 0.0
        await c.router.refresh()
        assert pool.healthy("prefill") == [node]
    async with cluster(n_prefill=1, rpc_timeout_s=0.3, status_failure_threshold=1) as c:
        c.prefill[0].status_delay_s = 1.0
        await c.router.refresh()
        assert c.router.pool.healthy("prefill") == []
