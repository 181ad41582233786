"""The router's HTTP front door: OpenAI-compatible `/v1/completions`, `/v1/chat/completions`,
`/v1/models`, plus `/health` and Prometheus `/metrics` (FastAPI on uvicorn, on the router's
own event loop; the two generate routes are served past FastAPI's middleware: `_serving`).

Receives HTTP requests; turns each body into a `GenerateRequest` (openai_protocol.py) and
hands it to the same lifecycle as the gRPC door (`Router.submit` / `Router.responses`, seen
here through the `Lifecycle` protocol, lifecycle.py: router.py builds this door, never the other way), so
validation, queueing, abort and the one-terminal rule are shared, not re-implemented. Answers
OpenAI's JSON (non-streaming) or server-sent events (`stream: true`), and errors as OpenAI's
`{"error": {...}}` with a status from the lifecycle's code (400, 404, 429, 503, ...).

Careful: a client that goes away must cancel its request. Every wait on the work races it against
`http.disconnect` (`_unless_disconnected`): a non-streaming response, the wait for a stream's first
message, and a stream's later events (`EventStream`; cancelling them closes `responses`, which
interrupts the request). Never block the loop: it also serves gRPC.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from functools import partial
from typing import Any, TypeVar

import anyio.lowlevel
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from protos import pdserve_pb2 as pb
from router.auth import authorized
from router.detokenize import TokenPieces
from router.lifecycle import Lifecycle
from router.openai_protocol import ChatCompletionRequest, CompletionRequest, Format, sse
from router.request import Outbox, RequestError, is_terminal
from router.tokenize_api import TokenizeDoor, add_tokenize_routes
from router.tool_api import ToolSettings
from router.ttft import Timeline
from router.validate import InvalidRequest

log = logging.getLogger(__name__)
T = TypeVar("T")
STATUS = {"INVALID_ARGUMENT": 400, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503,
          "DEADLINE_EXCEEDED": 504, "CANCELLED": 499}
ERROR_TYPE = {400: "invalid_request_error", 404: "invalid_request_error", 429: "rate_limit_error",
              503: "service_unavailable_error"}
TOKENIZE_IN_THREAD_BYTES = 8192
RAW_SEND = "pdserve.raw_send"  # the scope key of the server's own `send` (EventStream)


def error_body(code: str, message: str) -> dict:
    status = STATUS.get(code, 500)
    return {"error": {"message": message, "type": ERROR_TYPE.get(status, "server_error"), "param": None,
                      "code": "model_not_found" if code == "NOT_FOUND" else code.lower()}}


def error_response(code: str, message: str) -> JSONResponse:
    return JSONResponse(error_body(code, message), status_code=STATUS.get(code, 500))


def health_json(h: pb.HealthResponse) -> dict:
    """`GET /health`'s body: the summary, and per node (with the key, when one is set) its
    free/total KV blocks, those in use and those shared by several requests (n > 1 choices,
    prefix hits), running requests, queued prompt tokens and last error."""
    nodes = [{"address": n.address, "kind": n.kind, "node_id": n.node_id, "healthy": n.healthy,
              "free_kv_blocks": n.free_kv_blocks, "total_kv_blocks": n.total_kv_blocks,
              "used_kv_blocks": n.total_kv_blocks - n.free_kv_blocks, "shared_kv_blocks": n.shared_kv_blocks,
              "running_requests": n.running_requests, "queued_prompt_tokens": n.queued_prompt_tokens,
              "last_error": n.last_error} for n in h.nodes]
    return {"serving": h.serving, "prefill_nodes": h.prefill_nodes, "decode_nodes": h.decode_nodes,
            "colocated_nodes": h.colocated_nodes,
            "running_requests": h.running_requests, "queued_requests": h.queued_requests, "nodes": nodes}


def build_app(router: Lifecycle) -> FastAPI:
    app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)
    tok = router.model.tokenizer
    pieces = TokenPieces(tok) if tok is not None else None  # logprob entries' token texts, remembered

    @app.get("/health")
    async def health(raw: Request) -> Response:
        h = router.health(nodes=router.health_detail_allowed(raw.headers.get("authorization")))
        return JSONResponse(health_json(h), status_code=200 if h.serving else 503)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        if (denied := _denied(router, raw)) is not None:
            return denied
        return JSONResponse({"object": "list", "data": [
            {"id": m.name, "object": "model", "created": 0, "owned_by": "pdserve", "root": m.name,
             "max_model_len": m.max_model_len, "num_speculative_tokens": m.num_speculative_tokens}
            for m in router.list_models().models]})

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = await router.metrics_text()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await _generate(router, raw, CompletionRequest, pieces, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await _generate(router, raw, ChatCompletionRequest, pieces, chat=True)

    app.state.direct_posts = {"/v1/completions": completions, "/v1/chat/completions": chat_completions}

    add_tokenize_routes(app, TokenizeDoor(router, _parse, partial(_denied, router)))
    return app


def _denied(router: Lifecycle, raw: Request) -> Response | None:
    """401 in OpenAI's error JSON when an API key is set and the request lacks it (router/auth.py)."""
    key = router.config.api_key
    if key is None or authorized(raw.headers.get("authorization"), key):
        return None
    body = {"error": {"message": "missing or wrong API key (Authorization: Bearer KEY)",
                      "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}
    return JSONResponse(body, status_code=401)


async def _generate(router: Lifecycle, raw: Request, model: type[BaseModel], pieces: TokenPieces | None,
                    chat: bool) -> Response:
    timeline = Timeline()  # the request's TTFT begins (router/ttft.py)
    if (denied := _denied(router, raw)) is not None:
        return denied

    try:
        gen, fmt, req = await _prepare(router, raw, model, pieces, chat, timeline)
        st = await router.submit(gen, timeline)
    except RequestError as e:
        return error_response(e.code, e.message)
    msgs = router.responses(st)
    first = await _unless_disconnected(raw, anext(msgs))
    if first is None or first.HasField("error"):
        await msgs.aclose()
        return _from_error(first)
    if req.stream:
        opts = req.stream_options
        st.out.keeps_plain = True  # `_events` writes the plain logprobs of the messages after the first
        return EventStream(fmt.frame(first, first=True),
                           _events(fmt, first, msgs, bool(opts and opts.include_usage), st.out),
                           written=partial(router.metrics.first_token_written, st))
    rest = await _unless_disconnected(raw, _rest(first, msgs))
    if rest is None or rest[-1].HasField("error"):
        return _from_error(rest[-1] if rest else None)
    return JSONResponse(fmt.whole(rest))


async def _prepare(router: Lifecycle, raw: Request, model: type[BaseModel], pieces: TokenPieces | None,
                   chat: bool, timeline: Timeline) -> tuple[pb.GenerateRequest, Format, Any]:
    """The body as a GenerateRequest; raises RequestError (INVALID_ARGUMENT, NOT_FOUND), counted."""
    code, message = "INVALID_ARGUMENT", ""
    try:
        body, req = await _parse(raw, model)
        timeline.lap("parse")
        if req.model not in (None, "", router.model.name):
            code = "NOT_FOUND"
            raise InvalidRequest(f"the model {req.model!r} does not exist; this server serves "
                                 f"{router.model.name!r}")
        fmt = Format(chat, router.model.name, pieces, _logprobs_asked(req, chat), n=req.n or 1,
                     echo=bool(getattr(req, "echo", False)), prompt_logprobs=req.prompt_logprobs,
                     prompt_text=None if chat else req.prompt_text())
        gen = await _to_generate(router, req, fmt, len(body))  # a chat's template and tokens
        if chat:
            fmt.tools = req.tool_output()
        timeline.lap("tokenize")
        return gen, fmt, req
    except InvalidRequest as e:
        message = str(e)
    router.refused(code)
    raise RequestError(code, message)


async def _parse(raw: Request, model: type[BaseModel]) -> tuple[bytes, Any]:
    body = await raw.body()
    try:
        return body, model.model_validate_json(body)
    except ValidationError as e:
        raise InvalidRequest(_describe(e)) from None


def _describe(e: ValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(p) for p in err["loc"])
        parts.append(f"{where}: {err['msg']}" if where else err["msg"])
    return "invalid request body: " + "; ".join(parts)


def _logprobs_asked(req: Any, chat: bool) -> int | None:
    if chat:
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs  # type: ignore[no-any-return]


async def _to_generate(router: Lifecycle, req: Any, fmt: Format, size: int) -> pb.GenerateRequest:
    args: tuple[Any, ...] = (fmt.request_id, router.model.tokenizer, router.max_model_len)
    if fmt.chat:
        args = (*args, router.limits.max_prompt_bytes, ToolSettings(router.config.tool_call_parser,
                                                                   router.config.enable_auto_tool_choice))
    convert = partial(req.to_generate, *args)
    try:
        # chat templates render here, and tools' schemas compile: off the loop when long or with tools
        if size > TOKENIZE_IN_THREAD_BYTES or getattr(req, "tools", None):
            return await asyncio.to_thread(convert)  # type: ignore[no-any-return]
        return convert()  # type: ignore[no-any-return]
    except (ValueError, TypeError) as e:  # InvalidRequest is a ValueError; protobuf range errors too
        raise InvalidRequest(str(e)) from None


def _from_error(msg: pb.GenerateResponse | None) -> Response:
    if msg is None:  # the client went away: nobody reads this
        return Response(status_code=499)
    return error_response(msg.error.code, msg.error.message)


async def _rest(first: pb.GenerateResponse, msgs: AsyncGenerator[pb.GenerateResponse, None]) -> list[pb.GenerateResponse]:
    out = [first]
    async with aclosing(msgs):
        if not is_terminal(first):
            out += [m async for m in msgs]
    return out


async def _unless_disconnected(raw: Request, work: Awaitable[T]) -> T | None:
    """`work`'s result, or None (and `work` cancelled) if the client disconnects first."""
    return await _unless_gone(raw.receive, work)


async def _unless_gone(receive: Callable[[], Awaitable[Any]], work: Awaitable[T]) -> T | None:
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait([task, gone], return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
            await task
        return None
    return task.result()


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A server-sent event stream whose first event (the first token's) goes out with the headers,
    from the handler's own task, then `written` is called; the events after it come from `rest`,
    written by a task raced against the client's disconnect (which cancels it, closing `rest`).
    Careful: Starlette (ASGI < 2.4) writes a body from a task it starts beside its disconnect
    listener, a loop turn and a task group later, and that wait would sit inside every request's
    time to first token. The events after the first go to the server's own `send` (`RAW_SEND`, put
    in the scope by `HttpServer`) past any `send` wrappers of Starlette's and FastAPI's, which only
    note that a response started (the start went through them) and cost a coroutine each per event."""

    def __init__(self, first: str, rest: AsyncGenerator[str, None], written: Callable[[], None]) -> None:
        super().__init__(rest, media_type="text/event-stream")
        self.first, self.rest, self.written = first.encode(), rest, written

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await send({"type": "http.response.body", "body": self.first, "more_body": True})
        self.written()
        await _unless_gone(receive, self._rest(scope.get(RAW_SEND, send)))

    async def _rest(self, send: Any) -> None:
        async for chunk in self.rest:
            await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _events(fmt: Format, first: pb.GenerateResponse, msgs: AsyncGenerator[pb.GenerateResponse, None],
                  include_usage: bool, out: Outbox) -> AsyncGenerator[str, None]:
    """Server-sent events after the first message's (`EventStream` wrote that one), each message's
    plain logprobs from `out` (which keeps them out of the message); Starlette cancels this when the
    client goes, which closes `msgs`."""
    async with aclosing(msgs):
        msg, started = first, {first.index}  # choices that had their first chunk
        while not is_terminal(msg):
            msg = await anext(msgs)
            if msg.HasField("error"):
                yield sse(error_body(msg.error.code, msg.error.message))
                break
            start = msg.index not in started
            if msg.token_ids or msg.text or start or msg.finish_reason or is_terminal(msg):
                yield fmt.frame(msg, first=start, plain=out.taken_plain)
                started.add(msg.index)
        else:
            await anext(msgs, None)  # ends `msgs` now: it learns the terminal message was written
            if include_usage:
                yield sse(fmt.usage_chunk(msg))
    yield "data: [DONE]\n\n"


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Any:  # the process owner (Ray, the CLI, pytest) handles signals
        yield


def _serving(app: FastAPI) -> Callable[[dict[str, Any], Any, Any], Awaitable[None]]:
    """`app` with the server's own `send` in the scope (`RAW_SEND`: EventStream writes with it), and
    the generate routes (`app.state.direct_posts`: a POST to exactly their path) served past FastAPI's
    and Starlette's middleware and routing: a dozen layers per request (a coroutine each, most with
    a `send` wrapper) that these routes need none of. They read the raw request and answer every
    error themselves; an exception escaping them is uvicorn's to answer (a 500 if nothing was sent
    yet, as ServerErrorMiddleware's). Every other request goes through `app`."""
    posts: dict[str, Callable[[Request], Awaitable[Response]]] = getattr(app.state, "direct_posts", {})

    async def serve(scope: dict[str, Any], receive: Any, send: Any) -> None:
        scope[RAW_SEND] = send
        try:
            endpoint = posts.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
            if endpoint is None:
                await app(scope, receive, send)
            else:
                response = await endpoint(Request(scope, receive))
                await response(scope, receive, send)
        finally:
            del scope[RAW_SEND]  # the scope's server cycle would otherwise outlive the request, held in a ref cycle
    return serve


class HttpServer:
    """uvicorn serving `app` as a task on the running loop (HTTPS with a certificate and key)."""

    def __init__(self, app: FastAPI, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self.app = app
        self.tls = {"ssl_certfile": tls_cert, "ssl_keyfile": tls_key} if tls_cert else {}
        self._server: _Server | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, reuse_port: bool = False) -> int:
        """Bind (`port=0`: any free one) and serve; returns the bound port. `reuse_port`: other
        processes (a service's other router processes) may bind it too (SO_REUSEPORT)."""
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto says TCP,
        # and accepted ones inherit the listener's. With proto 0 a streamed response's first event waited
        # behind its headers for the client's delayed ACK: 40 ms on a kept-alive connection.
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        # httptools named (uvicorn's "auto" falls back to h11 silently): h11 parses and frames each
        # event in Python, a large share of the router's CPU per streamed token
        config = uvicorn.Config(_serving(self.app), log_level="warning", access_log=False, lifespan="off", http="httptools",
                                timeout_graceful_shutdown=2, **self.tls)  # type: ignore[arg-type]
        await anyio.lowlevel.checkpoint()  # loads anyio's asyncio backend now, not in the first streamed request (~16 ms)
        self._server = _Server(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)
        return int(sock.getsockname()[1])

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await asyncio.gather(self._task, return_exceptions=True)
