"""The HTTP front door against scripted fake nodes, through the official `openai` client:
the same lifecycle as gRPC (same text, one terminal), OpenAI's error JSON and status codes,
and a client that disconnects cancels its request and frees what the nodes hold."""

from __future__ import annotations

import asyncio
import json
import re
import urllib.error
import urllib.request

import openai
import pytest

from router.client import build_request
from router.http import RAW_SEND, EventStream
from tests.router.conftest import TINY, cluster


def client(c) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{c.router.http_port}/v1", api_key="none",
                              max_retries=0)


async def test_completion_matches_grpc_streaming_and_not():
    async with cluster(http_port=0) as c:
        want = await c.client.generate(build_request("ab", max_tokens=8))
        oa = client(c)
        got = await oa.completions.create(model="tiny", prompt="ab", max_tokens=8, temperature=0)
        assert got.choices[0].text == want["text"] == "chello w"
        assert got.choices[0].finish_reason == "length"
        assert (got.usage.prompt_tokens, got.usage.completion_tokens) == (3, 8)
        stream = await oa.completions.create(model="tiny", prompt="ab", max_tokens=8, temperature=0, stream=True,
                                             stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want["text"]
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == 8 and not chunks[-1].choices
        await c.settled()


async def test_chat_with_logprobs_streaming_and_not():
    async with cluster(http_port=0) as c:
        oa = client(c)
        msgs = [{"role": "user", "content": "ab"}]
        got = await oa.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=5,
                                               temperature=0, logprobs=True, top_logprobs=2)
        choice = got.choices[0]
        assert choice.message.role == "assistant" and choice.message.content == "chell"
        assert [e.token for e in choice.logprobs.content] == list("chell")
        assert all(len(e.top_logprobs) == 2 for e in choice.logprobs.content)
        stream = await oa.chat.completions.create(model="tiny", messages=msgs, max_tokens=5, temperature=0,
                                                  stream=True, logprobs=True)
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == "chell"
        assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices[0].logprobs) == 5
        models = await oa.models.list()
        assert [m.id for m in models.data] == [TINY.name]
        await c.settled()


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(n=17), openai.BadRequestError, "n must be in 1..16"),
    (dict(model="gpt-4"), openai.NotFoundError, "does not exist"),
    (dict(max_tokens=0), openai.BadRequestError, "max_tokens"),
    (dict(logprobs=21), openai.BadRequestError, "logprobs"),
    (dict(prompt=[5000]), openai.BadRequestError, "vocabulary"),
    (dict(extra_body={"frequency_penalty": 3.0}), openai.BadRequestError, "frequency_penalty"),
    (dict(temperature="hot"), openai.BadRequestError, "temperature"),
])
async def test_bad_requests_get_openai_errors(kwargs, error, words):
    async with cluster(http_port=0) as c:
        args = {"model": "tiny", "prompt": "ab", "max_tokens": 4, **kwargs}
        with pytest.raises(error) as e:
            await client(c).completions.create(**args)
        assert words in e.value.body["message"]  # type: ignore[index]
        assert c.router.metrics.failure._metrics  # counted
        await c.settled()


async def test_full_queue_is_429_and_no_decode_node_is_503():
    async with cluster(http_port=0, queue_size=0, node_wait_s=0) as c:
        c.decode[0].refuse = True
        with pytest.raises(openai.RateLimitError):
            await client(c).completions.create(model="tiny", prompt="ab", max_tokens=4)
        await c.decode[0].die()
        await c.router.refresh()
        with pytest.raises(openai.InternalServerError) as e:
            await client(c).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                                    stream=True)
        assert e.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as err:
            await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{c.router.http_port}/health")
        assert err.value.code == 503 and json.loads(err.value.read())["decode_nodes"] == 0


async def test_disconnected_clients_cancel_their_requests():
    async with cluster(http_port=0, decode={"pause_after": 3}) as c:
        oa = client(c)
        stream = await oa.completions.create(model="tiny", prompt="ab", max_tokens=50, stream=True)
        async for _chunk in stream:
            break
        await stream.close()
        await c.until(lambda: c.router.counts["cancelled"] == 1)
        task = asyncio.create_task(oa.completions.create(model="tiny", prompt="ab", max_tokens=50))
        await c.until(lambda: len(c.decode[0].admitted) == 2)
        task.cancel()  # the client closes its connection
        await c.until(lambda: c.router.counts["cancelled"] == 2)
        assert c.decode[0].aborts  # the nodes were told
        await c.settled()


async def test_api_key_is_required_on_v1_and_not_on_health():
    async with cluster(http_port=0, api_key="s3cret") as c:
        base = f"http://127.0.0.1:{c.router.http_port}"
        for key in ("none", "s3cret-not"):
            wrong = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError):
                await wrong.completions.create(model="tiny", prompt="ab", max_tokens=3)
            with pytest.raises(openai.AuthenticationError):
                await wrong.models.list()
        right = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        got = await right.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0)
        assert got.choices[0].finish_reason == "length"
        status = await asyncio.to_thread(lambda: urllib.request.urlopen(f"{base}/health").status)
        assert status == 200  # probes need no key
        await c.settled()


async def test_streams_are_not_held_by_nagle():
    """Every connection the HTTP door accepts has TCP_NODELAY: without it a streamed response's
    first event waited behind its headers for the client's delayed ACK (40 ms on a kept-alive
    connection). Checked on the server's own end of a live connection."""
    import socket

    async with cluster(http_port=0) as c:
        reader, writer = await asyncio.open_connection("127.0.0.1", c.router.http_port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        await reader.readuntil(b"\r\n\r\n")  # served: the server holds the accepted connection
        server = c.router.http._server
        socks = [conn.transport.get_extra_info("socket") for conn in server.server_state.connections]
        assert socks and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in socks)
        writer.close()
        await c.settled()


async def test_an_event_streams_first_event_goes_out_with_its_headers():
    """The first event is sent, and counted as written, by the handler's own task before the rest's
    generator starts (StreamingResponse would start writing from a task of its own)."""
    sent, order = [], []

    async def rest():
        order.append("rest started")
        yield "data: 2\n\n"

    async def send(msg):
        sent.append(msg)

    async def receive():
        await asyncio.sleep(60)  # the client stays (a disconnect would end the stream)

    stream = EventStream("data: 1\n\n", rest(), written=lambda: order.append(f"written after {len(sent)} sends"))
    await stream({"type": "http", "asgi": {"spec_version": "2.3"}}, receive, send)
    assert order == ["written after 2 sends", "rest started"]
    assert [m["type"] for m in sent] == ["http.response.start", *["http.response.body"] * 3]
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", b"data: 2\n\n", b""]
    assert [m.get("more_body") for m in sent[1:]] == [True, True, False]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in sent[0]["headers"]


async def test_an_event_streams_later_events_go_to_the_servers_own_send_until_the_client_leaves():
    """The start and first event go through the app's `send` (Starlette's wrappers see the response
    start); the later events to the server's own (`RAW_SEND`). A disconnect cancels the rest: its
    generator is closed, and no end of body is sent."""
    wrapped, raw, order = [], [], []
    left = asyncio.Event()

    async def rest():
        try:
            yield "data: 2\n\n"
            await asyncio.sleep(60)  # the node is slow: the client leaves meanwhile
            yield "data: 3\n\n"
        finally:
            order.append("rest closed")

    async def send(msg):
        wrapped.append(msg)

    async def raw_send(msg):
        raw.append(msg)
        left.set()

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    stream = EventStream("data: 1\n\n", rest(), written=lambda: order.append("written"))
    await stream({"type": "http", RAW_SEND: raw_send}, receive, send)
    assert [m["type"] for m in wrapped] == ["http.response.start", "http.response.body"]
    assert [(m["body"], m["more_body"]) for m in raw] == [(b"data: 2\n\n", True)]
    assert order == ["written", "rest closed"]


async def test_a_stream_whose_connection_is_paused_gets_its_later_tokens_merged_in_order():
    """While the server may not write to a connection (its transport paused it: the client reads
    slowly), a stream's events are neither written by the node's output reader nor lost: the
    tokens that come meanwhile join the waiting message, and once the connection drains the
    client gets them all, in order, in a few events, then one [DONE]."""
    async with cluster(http_port=0, decode={"pause_after": 3}) as c:
        reader, writer = await asyncio.open_connection("127.0.0.1", c.router.http_port)
        body = json.dumps({"model": "tiny", "prompt": "ab", "max_tokens": 30, "temperature": 0, "stream": True})
        writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
        await writer.drain()
        got = b""
        while len("".join(_texts(got))) < 3:  # every token the node sent before it paused was written
            got += await reader.read(65536)
        before = len(_events(got))
        (conn,) = c.router.http._server.server_state.connections
        conn.pause_writing()  # as the transport does when its buffer fills
        c.decode[0].resume()
        await c.until(lambda: c.router.counts["finished:length"] == 1)
        conn.resume_writing()
        while b"data: [DONE]" not in got:
            got += await reader.read(65536)
        writer.close()
        want = await c.client.generate(build_request("ab", max_tokens=30))
        assert "".join(_texts(got)) == want["text"] and len(want["text"]) == 30
        assert len(_events(got)) - before <= 4  # waited, merged, the terminal, [DONE]
        assert _events(got)[-1] == "[DONE]" and _events(got).count("[DONE]") == 1
        await c.settled()


def _events(raw: bytes) -> list[str]:
    return re.findall(r"data: (.*?)\n\n", raw.decode())


def _texts(raw: bytes) -> list[str]:
    return [json.loads(e)["choices"][0]["text"] for e in _events(raw) if e != "[DONE]"]
