"""A small client for the router's Generation service (async `RouterClient`, sync
`generate_via_router` for `pdserve generate --router HOST:PORT`).

Receives prompts and sampling options; hands back, per prompt, the same JSON shape as the
local `pdserve generate --json` (deploy/cli.py `result_json`): text, prompt_token_ids,
token_ids, logprobs ([{token_id, logprob, rank, top: [[id, lp], ...]}] or None),
finish_reason, stats {steps, accepted_tokens, mean_accepted_per_step}.
A failed request raises `RouterError` (a ValueError, so the CLI prints one `error:` line).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc

from engine.grammar.structured import StructuredSpec
from protos import pdserve_pb2 as pb
from protos import pdserve_pb2_grpc
from router.auth import client_metadata
from router.tls import channel_credentials

CHANNEL_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


class RouterError(ValueError):
    """A request that ended with an error: `code` is the gRPC status name."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


def build_request(prompt: str | Sequence[int], *, chat: bool = False, temperature: float = 0.0,
                  top_p: float = 1.0, top_k: int = 0, seed: int | None = None, max_tokens: int = 64,
                  logprobs: int | None = None, stop: Sequence[str] = (), stop_token_ids: Sequence[int] = (),
                  ignore_eos: bool = False, model: str | None = None, request_id: str = "",
                  timeout_s: float = 0.0, presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float = 0.0, logit_bias: dict[int, float] | None = None, n: int = 1,
                  prompt_logprobs: int | None = None, structured: StructuredSpec | None = None) -> pb.GenerateRequest:
    """A GenerateRequest from a text prompt (or a list of token ids) and sampling options;
    `structured`: what the output must match (engine/grammar/structured.py)."""
    sampling = pb.SamplingOptions(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens,
                                  stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos,
                                  presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                  repetition_penalty=repetition_penalty, logit_bias=logit_bias or {}, n=n,
                                  structured=structured.to_wire() if structured else "")
    if seed is not None:
        sampling.seed = seed
    if logprobs is not None:
        sampling.logprobs = logprobs
    if prompt_logprobs is not None:
        sampling.prompt_logprobs = prompt_logprobs
    req = pb.GenerateRequest(request_id=request_id, model=model or "", chat=chat, sampling=sampling,
                             timeout_s=timeout_s)
    if isinstance(prompt, str):
        req.prompt = prompt
    else:
        req.prompt_token_ids.extend(prompt)
    return req


def result_json(responses: Sequence[pb.GenerateResponse], want_logprobs: bool) -> dict:
    """Fold a finished stream into `pdserve generate --json`'s shape; raises RouterError on an error."""
    if not responses:
        raise RouterError("UNKNOWN", "the stream ended without a message")
    last = responses[-1]
    if last.HasField("error"):
        raise RouterError(last.error.code, last.error.message)
    if not last.HasField("finished"):
        raise RouterError("UNKNOWN", "the stream ended without a terminal message")
    token_ids = [t for r in responses for t in r.token_ids]
    lps = [{"token_id": lp.token_id, "logprob": lp.logprob, "rank": lp.rank,
            "top": [[i, v] for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]}
           for r in responses for lp in r.logprobs]
    usage = last.finished.usage
    steps = usage.decode_steps
    return {
        "text": "".join(r.text for r in responses),
        "prompt_token_ids": list(responses[0].prompt_token_ids),
        "token_ids": token_ids,
        "logprobs": lps if want_logprobs else None,
        "finish_reason": last.finished.reason,
        "stats": {"steps": steps, "accepted_tokens": usage.accepted_draft_tokens,
                  "mean_accepted_per_step": round((len(token_ids) - 1) / steps, 4) if steps else 0.0},
    }


class RouterClient:
    """Async client; `async with RouterClient("host:port") as c: ...`. With `tls_ca` (a PEM CA
    file, or "system" for the system's roots) it speaks TLS and checks the router's certificate."""

    def __init__(self, address: str, api_key: str | None = None, tls_ca: str | None = None,
                 options: Sequence[tuple[str, Any]] = ()) -> None:
        """`options`: more gRPC channel options (e.g. reconnect backoff)."""
        self.address = address
        opts = CHANNEL_OPTIONS + list(options)
        if tls_ca:
            creds = channel_credentials(None if tls_ca == "system" else tls_ca)
            self.channel = grpc.aio.secure_channel(address, creds, options=opts)
        else:
            self.channel = grpc.aio.insecure_channel(address, options=opts)
        self.stub = pdserve_pb2_grpc.GenerationStub(self.channel)
        self.metadata = client_metadata(api_key)  # `authorization: Bearer KEY` on every call

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    def stream(self, request: pb.GenerateRequest, timeout: float | None = None,
               wait_for_ready: bool | None = None) -> Any:
        """The raw response stream (a grpc.aio call: iterate it, `.cancel()` it). `wait_for_ready`:
        while the router cannot be reached, wait for it (until `timeout`) instead of failing at once
        with UNAVAILABLE; a stream that breaks once started ends with UNAVAILABLE either way."""
        return self.stub.Generate(request, timeout=timeout, metadata=self.metadata, wait_for_ready=wait_for_ready)

    async def responses(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateResponse]:
        """Responses until the terminal one; INVALID_ARGUMENT and other RPC failures raise RouterError."""
        try:
            async for msg in self.stream(request):
                yield msg
        except grpc.aio.AioRpcError as e:
            raise RouterError(e.code().name, e.details() or "") from None

    async def generate(self, request: pb.GenerateRequest) -> dict:
        msgs = [m async for m in self.responses(request)]
        return result_json(msgs, request.sampling.HasField("logprobs"))

    async def abort(self, request_id: str) -> bool:
        return bool((await self.stub.Abort(pb.AbortRequest(request_id=request_id), metadata=self.metadata)).found)

    async def health(self) -> pb.HealthResponse:
        return await self.stub.Health(pb.HealthRequest(), metadata=self.metadata)  # the key: per-node detail

    async def list_models(self) -> pb.ListModelsResponse:
        return await self.stub.ListModels(pb.ListModelsRequest(), metadata=self.metadata)


async def generate_many(address: str, prompts: Sequence[str], api_key: str | None = None,
                        tls_ca: str | None = None, **options: Any) -> list[dict]:
    """All prompts at once (the router batches them on the nodes); results in prompt order."""
    async with RouterClient(address, api_key, tls_ca) as client:
        results = await asyncio.gather(*(client.generate(build_request(p, **options)) for p in prompts),
                                       return_exceptions=True)
    for r in results:
        if isinstance(r, BaseException):
            raise r
    return list(results)  # type: ignore[arg-type]


def generate_via_router(address: str, prompts: list[str], *, chat: bool, temperature: float = 0.0,
                        top_p: float = 1.0, top_k: int = 0, seed: int | None = None, max_tokens: int = 64,
                        logprobs: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False,
                        model: str | None = None, timeout_s: float = 0.0, api_key: str | None = None,
                        tls_ca: str | None = None) -> list[dict]:
    """`pdserve generate --router HOST:PORT`: one dict per prompt, as `--json` prints locally."""
    return asyncio.run(generate_many(
        address, prompts, api_key, tls_ca, chat=chat, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
        max_tokens=max_tokens, logprobs=logprobs, stop=stop, ignore_eos=ignore_eos, model=model,
        timeout_s=timeout_s))
