"""`bench serve`'s client: one request sent and timed (`sender`), and a rate's requests offered
(`offer`: Poisson arrivals, bounded concurrency), from this process.

Each sender also warms its client (`Sender.warm`: one `GET /v1/models`, or the gRPC health call)
before the clock starts: the client's connection and its HTTP stack's lazy imports (tens of ms in
httpx's first request) are not the service's time to first token; the service's completions path
stays cold, as a pool's or a load balancer's first request leaves it.

A request's tokens are counted as its messages bring them: gRPC stream messages carry token ids,
SSE events of the `openai` client one logprob entry per token (`logprobs=0` is asked for that).
`Result.chunks` counts the messages that carried tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import settings
from bench.extras import require


@dataclass
class Item:
    prompt: str | list[int]
    output_len: int


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    chunks: int = 0  # messages that carried tokens (SSE events, gRPC stream messages)
    itl: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class Sender:
    """`send(item)` makes one request to the target and times it; `warm()` makes the client's
    first request (module docstring); `close()` ends the client."""

    send: Any
    close: Any
    warm: Any


async def load(args: argparse.Namespace, items: list[Item], rate: float, bar: Any) -> list[Result]:
    client = sender(args)
    try:
        await client.warm()
        return await offer(args, items, rate, client.send, bar)
    finally:
        await client.close()


def sender(args: argparse.Namespace) -> Sender:
    """The target's client (`Sender`)."""
    key = getattr(args, "api_key", None) or settings.API_KEY
    ca = args.tls_ca
    if not args.base_url:
        return _grpc_sender(args.router, key, ca)
    if getattr(args, "http_client", "openai") == "raw":
        return _raw_http_sender(args.base_url, key, ca)
    return _http_sender(args.base_url, key, ca)


async def offer(args: argparse.Namespace, items: list[Item], rate: float, send: Any, bar: Any) -> list[Result]:
    """Send every item (Poisson arrivals at `rate`, at most `max_concurrency` in flight)."""
    rng = random.Random(args.seed + 1)
    limit = asyncio.Semaphore(args.max_concurrency or len(items))

    async def one(item: Item) -> Result:
        async with limit:
            res = await send(item)
        bar.update(1)
        return res

    tasks = []
    for item in items:
        tasks.append(asyncio.create_task(one(item)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    return list(await asyncio.gather(*tasks))


def _grpc_sender(address: str, api_key: str | None, tls_ca: str | None) -> Any:
    from router.client import RouterClient, build_request

    client = RouterClient(address, api_key, tls_ca)

    async def send(item: Item) -> Result:
        req = build_request(item.prompt, chat=isinstance(item.prompt, str), max_tokens=item.output_len,
                            ignore_eos=True)
        res, clock = Result(), _Clock()
        try:
            async for msg in client.responses(req):
                clock.tokens(res, len(msg.token_ids))
                if msg.HasField("error"):
                    res.error = f"{msg.error.code}: {msg.error.message}"
            res.ok = not res.error
        except Exception as e:
            res.error = str(e)
        res.e2e = clock.now()
        return res

    async def warm() -> None:
        await client.health()

    return Sender(send, client.close, warm)


def _http_sender(base_url: str, api_key: str | None, tls_ca: str | None) -> Any:
    import ssl

    openai = require("openai")

    http = None  # https with the system's roots, or with this CA:
    if tls_ca and tls_ca != "system":
        http = openai.DefaultAsyncHttpxClient(verify=ssl.create_default_context(cafile=tls_ca))
    client = openai.AsyncOpenAI(base_url=base_url.rstrip("/") + "/v1", api_key=api_key or "none", max_retries=0,
                                http_client=http)

    async def counts(item: Item) -> AsyncIterator[int]:
        stream = await client.completions.create(
            model="", prompt=item.prompt, max_tokens=item.output_len, temperature=0, stream=True,
            logprobs=0, extra_body={"ignore_eos": True})
        async for chunk in stream:
            lps = chunk.choices[0].logprobs if chunk.choices else None
            yield len(lps.tokens or []) if lps else 0  # one logprob entry per token

    async def warm() -> None:
        await client.models.list()

    return Sender(partial(_timed, counts), client.close, warm)


def _raw_http_sender(base_url: str, api_key: str | None, tls_ca: str | None) -> Any:
    """The same request as `_http_sender`, made with httpx (the `openai` client's own HTTP library)
    and `json`, as vLLM's benchmark_serving does with aiohttp: the clock then times the server,
    not the client's request building (the `openai` client walks a prompt of token ids element by
    element: ~6 ms for 512 ids, ~21 ms for 2048 on a 2-core CPU, inside every TTFT it times)."""
    import json
    import ssl

    httpx = require("httpx2")  # the openai client's own HTTP library

    verify: Any = ssl.create_default_context(cafile=tls_ca) if tls_ca and tls_ca != "system" else True
    headers = {"Authorization": f"Bearer {api_key or 'none'}"}
    client = httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, verify=verify, timeout=None,
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    async def counts(item: Item) -> AsyncIterator[int]:
        body = {"model": "", "prompt": item.prompt, "max_tokens": item.output_len, "temperature": 0,
                "stream": True, "logprobs": 0, "ignore_eos": True}
        async with client.stream("POST", "/v1/completions", content=json.dumps(body),
                                 headers={"Content-Type": "application/json"}) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread()).decode()[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(str(event["error"]))
                lps = event["choices"][0].get("logprobs") if event.get("choices") else None
                yield len(lps.get("tokens") or []) if lps else 0

    async def warm() -> None:
        (await client.get("/v1/models")).raise_for_status()

    return Sender(partial(_timed, counts), client.aclose, warm)


async def _timed(counts: Any, item: Item) -> Result:
    """One request: `counts(item)` yields the tokens each message brings; errors end it as failed."""
    res, clock = Result(), _Clock()
    try:
        async for n in counts(item):
            clock.tokens(res, n)
        res.ok = True
    except Exception as e:
        res.error = str(e)
    res.e2e = clock.now()
    return res


class _Clock:
    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.start

    def tokens(self, res: Result, n: int) -> None:
        if n <= 0:
            return
        t = time.perf_counter()
        res.chunks += 1
        if res.tokens == 0:
            res.ttft, n = t - self.start, n - 1
            res.tokens = 1
        if n > 0:
            res.itl += [(t - self.last) / n] * n
            res.tokens += n
        self.last = t


def counts(results: list[Result]) -> tuple[int, int]:
    """Output tokens and chunks of the requests that succeeded."""
    ok = [r for r in results if r.ok]
    return sum(r.tokens for r in ok), sum(r.chunks for r in ok)
