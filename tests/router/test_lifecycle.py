"""A request's life through the router against scripted fake nodes: streaming order, one
terminal event, detokenization, stop strings, stop ids, logprobs, abort, cancel, deadline."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from router.client import RouterError, build_request, result_json
from router.request import is_terminal
from tests.router.conftest import TINY, cluster

BOS, EOS = 256, 257


async def collect(c, **kw):
    """All messages of one stream; asserts the one-terminal-event rule."""
    msgs = [m async for m in c.client.responses(build_request(kw.pop("prompt", "ab"), **kw))]
    assert msgs and is_terminal(msgs[-1]), "the stream must end with a terminal message"
    assert not any(is_terminal(m) for m in msgs[:-1]), "exactly one terminal message, last"
    return msgs


async def read_rest(stream):
    out = []
    while (m := await stream.read()) is not grpc.aio.EOF:
        out.append(m)
    return out


def text(msgs):
    return "".join(m.text for m in msgs)


def tokens(msgs):
    return [t for m in msgs for t in m.token_ids]


async def test_first_token_first_then_decode_stream():
    async with cluster() as c:
        msgs = await collect(c, prompt="ab", max_tokens=8)
        assert msgs[0].token_ids == [ord("c")]  # P's first token arrives first, alone
        assert list(msgs[0].prompt_token_ids) == [BOS, ord("a"), ord("b")]
        assert all(not m.prompt_token_ids for m in msgs[1:])
        assert text(msgs) == "chello w" and len(tokens(msgs)) == 8
        fin = msgs[-1].finished
        assert fin.reason == "length"
        assert (fin.usage.prompt_tokens, fin.usage.completion_tokens) == (3, 8)
        # one message per decode step, or fewer: steps that came while a message still waited joined it
        assert 1 <= len([m for m in msgs[1:] if m.token_ids]) <= fin.usage.decode_steps
        assert fin.usage.accepted_draft_tokens == 7 - fin.usage.decode_steps
        (rid,) = c.decode[0].admitted
        assert c.decode[0].finished[rid] == "length" and c.prefill[0].calls == [rid]
        await c.settled()


async def test_concurrent_requests_are_routed_by_id():
    async with cluster(decode={"script": b"0123456789"}) as c:
        results = await asyncio.gather(*(collect(c, prompt=p, max_tokens=6) for p in ["a", "bb", "ccc", "x"]))
        assert [text(m) for m in results] == ["b01234", "c01234", "d01234", "y01234"]
        await c.settled()


async def test_eos_stops_unless_ignored():
    async with cluster(decode={"script": [ord("h"), ord("i"), EOS, ord("!")]}) as c:
        msgs = await collect(c, prompt="x", max_tokens=10)
        assert tokens(msgs) == [ord("y"), ord("h"), ord("i"), EOS]  # EOS is a token, not text
        assert text(msgs) == "yhi" and msgs[-1].finished.reason == "stop"
        msgs = await collect(c, prompt="x", max_tokens=6, ignore_eos=True)
        assert text(msgs) == "yhi!h" and msgs[-1].finished.reason == "length"
        msgs = await collect(c, prompt="x", max_tokens=10, stop_token_ids=[ord("i")], ignore_eos=True)
        assert text(msgs) == "yhi" and msgs[-1].finished.reason == "stop"
        await c.settled()


async def test_first_token_can_end_the_request():
    async with cluster() as c:
        msgs = await collect(c, prompt=[BOS], max_tokens=5)  # first token = EOS
        assert len(msgs) == 2 and tokens(msgs) == [EOS] and msgs[-1].finished.reason == "stop"
        msgs = await collect(c, prompt="ab", max_tokens=1)
        assert [m.text for m in msgs] == ["c", ""] and msgs[-1].finished.reason == "length"
        assert c.decode[0].aborts == []  # D released both by itself, after P's finished first token
        await c.settled()


async def test_stop_string_cuts_text_and_aborts_decode():
    async with cluster() as c:
        msgs = await collect(c, prompt="ab", max_tokens=30, stop=["lo w", "zzz"])
        assert text(msgs) == "chel" and msgs[-1].finished.reason == "stop"
        assert tokens(msgs)[-1] == ord("w")  # tokens up to the one completing the stop string
        (rid,) = c.decode[0].admitted
        await c.decode[0].until(lambda: rid in c.decode[0].aborts)
        # a stop string inside the first token's text
        msgs = await collect(c, prompt="ab", max_tokens=30, stop=["c"])
        assert text(msgs) == "" and msgs[-1].finished.reason == "stop"
        await c.settled()


async def test_multibyte_utf8_split_across_tokens_is_never_broken():
    expected = "héllo 世界 🙂 ñ"
    script = expected.encode("utf-8")
    async with cluster(decode={"script": script}) as c:
        msgs = await collect(c, prompt="a", max_tokens=1 + len(script))
        assert all("\ufffd" not in m.text for m in msgs)
        assert text(msgs) == "b" + expected
        # (bytes of a character are held until it is complete: tests/router/test_detokenize.py)
        assert TINY.tokenizer.decode(tokens(msgs)) == "b" + expected
        await c.settled()


async def test_logprobs_become_token_logprobs():
    async with cluster() as c:
        msgs = await collect(c, prompt="ab", max_tokens=5, logprobs=3)
        out = result_json(msgs, want_logprobs=True)
        assert [lp["token_id"] for lp in out["logprobs"]] == out["token_ids"]
        first = out["logprobs"][0]
        assert first["logprob"] == -0.5 and first["rank"] == 1
        assert first["top"] == [[ord("c"), -0.5], [ord("c") + 1, -1.5], [ord("c") + 2, -2.5]]
        assert all(lp["logprob"] == -0.25 and len(lp["top"]) == 3 for lp in out["logprobs"][1:])
        plain = await collect(c, prompt="ab", max_tokens=3)
        assert all(not m.logprobs for m in plain)
        zero = result_json(await collect(c, prompt="ab", max_tokens=3, logprobs=0), want_logprobs=True)
        assert all(lp["top"] == [] for lp in zero["logprobs"]) and len(zero["logprobs"]) == 3
        await c.settled()


async def test_abort_rpc_ends_the_request_with_reason_abort():
    async with cluster(decode={"pause_after": 3}) as c:
        d = c.decode[0]
        stream = c.client.stream(build_request("ab", max_tokens=50, request_id="victim"))
        got = [await stream.read(), await stream.read()]  # first token, then D's first batch
        assert got[0].token_ids == [ord("c")]
        assert await c.client.abort("victim") is True
        rest = await read_rest(stream)
        assert rest[-1].finished.reason == "abort" and not any(is_terminal(m) for m in got + rest[:-1])
        await d.until(lambda: len(d.aborts) == 1)
        assert await c.client.abort("victim") is False  # no longer in flight
        await c.settled()


async def test_duplicate_request_id_in_flight_is_refused():
    async with cluster(decode={"pause_after": 2}) as c:
        stream = c.client.stream(build_request("ab", max_tokens=20, request_id="same"))
        await stream.read()
        with pytest.raises(RouterError) as e:
            await collect(c, prompt="ab", request_id="same")
        assert e.value.code == "INVALID_ARGUMENT" and "already in flight" in e.value.message
        stream.cancel()
        await c.settled()
        msgs = await collect(c, prompt="ab", max_tokens=2, request_id="same")  # free again
        assert msgs[-1].finished.reason == "length"


async def test_cancel_50_streams_mid_generation_frees_everything():
    """Round robin over two P: 25 requests are decoding (paused on D), 25 are stuck in
    prefill on p0. Cancelling all 50 must reach every node that holds something."""
    async with cluster(n_prefill=2, decode={"pause_after": 4}, policy="round_robin") as c:
        d = c.decode[0]
        stuck, live = sorted(c.prefill, key=lambda p: p.address)  # round robin starts at the lowest
        stuck.hold = asyncio.Event()
        streams = [c.client.stream(build_request("ab", max_tokens=100, request_id=f"r{i}")) for i in range(50)]
        await stuck.until(lambda: len(stuck.active) == 25)
        await d.until(lambda: sum(s.generated == 4 for s in d.seqs.values()) == 25)  # paused mid-way
        await c.until(lambda: sum(len(st.tokens) == 4 for st in c.router.requests.values()) == 25)
        for s in streams:
            s.cancel()
        await c.settled()
        assert len(d.admitted) == 50 and sorted(d.aborts) == sorted(d.admitted)
        assert sorted(stuck.aborts) == sorted(stuck.calls) and len(stuck.calls) == 25
        assert live.aborts == [] and len(live.calls) == 25  # its prefills had all finished
        assert d.held == stuck.held == live.held == 0 and not d.finished
        assert c.router.counts["cancelled"] == 50 and not c.router.requests


async def test_cancel_while_prefill_is_outstanding_aborts_prefill_and_decode():
    async with cluster() as c:
        p, d = c.prefill[0], c.decode[0]
        p.hold = asyncio.Event()
        stream = c.client.stream(build_request("ab", max_tokens=5))
        await p.until(lambda: len(p.active) == 1)
        stream.cancel()
        await p.until(lambda: len(p.aborts) == 1)
        await d.until(lambda: len(d.aborts) == 1)
        assert p.aborts == d.aborts == d.admitted
        p.hold.set()
        await c.settled()


async def test_deadline_ends_with_deadline_exceeded_and_frees_nodes():
    async with cluster(decode={"pause_after": 2}) as c:
        d = c.decode[0]
        # 2 s: the first token (in-process nodes, loopback gRPC) comes long before, on any machine
        msgs = await collect(c, prompt="ab", max_tokens=50, timeout_s=2.0)
        assert msgs[-1].error.code == "DEADLINE_EXCEEDED" and "deadline" in msgs[-1].error.message
        assert tokens(msgs)[:1] == [ord("c")]
        await d.until(lambda: d.aborts == d.admitted)
        # the default deadline applies when the request gives none
        await c.settled()
    async with cluster(default_timeout_s=0.3) as c:
        p = c.prefill[0]
        p.hold = asyncio.Event()  # never released: the deadline hits during prefill
        msgs = await collect(c, prompt="ab", max_tokens=5)
        assert len(msgs) == 1 and msgs[0].error.code == "DEADLINE_EXCEEDED"
        assert list(msgs[0].prompt_token_ids) == [BOS, ord("a"), ord("b")]
        await p.until(lambda: len(p.aborts) == 1)
        p.hold.set()
        await c.settled()


async def test_api_key_refuses_grpc_calls_without_it_but_not_health():
    from router.client import RouterClient

    async with cluster(api_key="s3cret") as c:  # c.client sends no key
        with pytest.raises(RouterError) as e:
            await c.client.generate(build_request("ab", max_tokens=3))
        assert e.value.code == "UNAUTHENTICATED"
        assert (await c.client.health()).serving  # health checks stay open
        for key in ("wrong", "s3cret"):
            async with RouterClient(c.client.address, api_key=key) as keyed:
                if key == "wrong":
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        await keyed.list_models()
                    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                else:
                    assert (await keyed.generate(build_request("ab", max_tokens=3)))["finish_reason"] == "length"
                    assert await keyed.abort("nope") is False
        await c.settled()
