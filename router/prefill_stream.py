"""PrefillStreams: this router process's Prefill requests to each prefill node, on one long-lived
PrefillStream call per node (protos/node.proto), a request and its answer matched by request id.

Receives a PrefillRequest for a node (`prefill`) and hands back an asyncio future that ends with
the first-token Payload, or with a grpc.aio.AioRpcError carrying the status code and message the
node put in its answer, so placement.py's retry and migration read it as any node call's failure.
The call goes over the node's channel (its TLS) with the stub's metadata (the cluster secret), as
every other node call does.

- A future cancelled (the request ended, its decode node was lost, its driver's deadline) sends a
  cancellation on the stream: the node drops the job.
- The stream's end (the node died, the connection broke, the router is stopping) fails every
  request still waiting on it, once each: UNAVAILABLE (the node's loss: they are tried elsewhere),
  or the status of a node that refused the stream (`_REFUSALS`); the next request opens a new stream.
- An answer is read only for an id this router is waiting for on that stream; its status code must
  be one gRPC knows (else INTERNAL), and its message is bounded. The first token itself is checked
  by its reader (placement.py).
Never blocks the event loop; the writes go through one writer task per stream (a write cancelled
midway would cancel the whole call, and with it every request on it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import grpc

from protos import node_pb2

log = logging.getLogger(__name__)

MAX_DETAILS = 4096  # characters of an answer's error message kept
_CODES = {code.value[0]: code for code in grpc.StatusCode}
Spawn = Callable[[Coroutine[Any, Any, Any]], "asyncio.Task[Any]"]


def rpc_error(code: grpc.StatusCode, details: str) -> grpc.aio.AioRpcError:
    """The error a request whose answer carries `code` fails with."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)


class PrefillStreams:
    """One open stream per prefill node (keyed by the pool's Node handle), opened on first use.
    Its tasks are its own, not the pool's background tasks (those end; these live as long as the
    stream): `close` ends them, before the pool closes the channels."""

    def __init__(self) -> None:
        self._streams: dict[Any, _Stream] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def prefill(self, node: Any, request: node_pb2.PrefillRequest) -> asyncio.Future[node_pb2.Payload]:
        """Send `request` to `node` now (on its stream's writer's next turn); the answer's future."""
        stream = self._streams.get(node)
        if stream is None or stream.ended:
            stream = self._streams[node] = _Stream(node.stub, self._spawn, lambda s: self._forget(node, s))
        return stream.send(request)

    async def close(self) -> None:
        """End every stream (what still waits on one fails UNAVAILABLE) and wait for their tasks."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def _forget(self, node: Any, stream: _Stream) -> None:
        if self._streams.get(node) is stream:
            del self._streams[node]


class _Stream:
    """One PrefillStream call and the requests waiting for their answers on it."""

    def __init__(self, stub: Any, spawn: Spawn, on_end: Callable[[_Stream], None]) -> None:
        self.call = stub.PrefillStream()
        self.waiting: dict[str, asyncio.Future[node_pb2.Payload]] = {}
        self.ended = False
        self._outbox: asyncio.Queue[node_pb2.PrefillStreamRequest] = asyncio.Queue()
        self._on_end = on_end
        self._writer = spawn(self._write())
        self._reader = spawn(self._read())

    def send(self, request: node_pb2.PrefillRequest) -> asyncio.Future[node_pb2.Payload]:
        rid = request.request_id
        future: asyncio.Future[node_pb2.Payload] = asyncio.get_running_loop().create_future()
        if rid in self.waiting:  # placement gives each attempt its own id: a bug, not the node's fault
            future.set_exception(rpc_error(grpc.StatusCode.INTERNAL, f"request id {rid!r} already waits on this stream"))
            return future
        self.waiting[rid] = future
        future.add_done_callback(lambda f: self._done(rid, f))
        self._outbox.put_nowait(node_pb2.PrefillStreamRequest(prefill=request))
        return future

    def _done(self, rid: str, future: asyncio.Future[node_pb2.Payload]) -> None:
        """A cancelled future's job is dropped on the node."""
        if self.waiting.get(rid) is future:
            del self.waiting[rid]
            if future.cancelled() and not self.ended:
                self._outbox.put_nowait(node_pb2.PrefillStreamRequest(cancel=node_pb2.AbortRequest(request_id=rid)))

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self._outbox.get())
        except asyncio.CancelledError:
            self._end(grpc.StatusCode.UNAVAILABLE, "the router is closing its prefill stream")
            raise
        except Exception as e:
            if not self.call.done():  # else the call's own status comes to the reader, which ends the stream
                self._end(*_stream_status(e))

    async def _read(self) -> None:
        status = (grpc.StatusCode.UNAVAILABLE, "the prefill stream ended")
        try:
            while (reply := await self.call.read()) is not grpc.aio.EOF:
                self._deliver(reply)
        except asyncio.CancelledError:
            self._end(grpc.StatusCode.UNAVAILABLE, "the router is closing its prefill stream")
            raise
        except Exception as e:
            status = _stream_status(e)
        self._end(*status)

    def _deliver(self, reply: node_pb2.PrefillStreamReply) -> None:
        future = self.waiting.pop(reply.request_id, None)
        if future is None or future.done():  # cancelled here already, or an id this router did not send
            return
        if reply.code == 0:
            future.set_result(node_pb2.Payload(msgpack=reply.first_token_msgpack))
            return
        code = _CODES.get(reply.code)
        if code is None or code is grpc.StatusCode.OK:
            future.set_exception(rpc_error(grpc.StatusCode.INTERNAL, f"the prefill node answered with status {reply.code}"))
        else:
            future.set_exception(rpc_error(code, reply.details[:MAX_DETAILS]))

    def _end(self, code: grpc.StatusCode, details: str) -> None:
        """The stream is over: every request still waiting fails (once), the next opens a new stream."""
        if self.ended:
            return
        self.ended = True
        self._on_end(self)
        waiting, self.waiting = self.waiting, {}
        for future in waiting.values():
            if not future.done():
                future.set_exception(rpc_error(code, details))
        self.call.cancel()
        for task in (self._writer, self._reader):
            if task is not asyncio.current_task():
                task.cancel()
        if waiting:
            log.warning("prefill stream ended with %d requests on it: %s %s", len(waiting), code.name, details)


# A stream's own status that says this router may not use the node at all, not that the stream broke:
# its requests fail with it. Any other end (a node process that died mid-stream ends it INTERNAL or
# UNKNOWN as often as UNAVAILABLE) is the node's loss, which the router answers by trying another node.
_REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED)


def _stream_status(error: BaseException) -> tuple[grpc.StatusCode, str]:
    """What the requests on a stream that ended with `error` fail with: a refusal's own status,
    else UNAVAILABLE (it broke, closed cleanly, was cancelled, or a write met it finished)."""
    if isinstance(error, grpc.aio.AioRpcError) and error.code() in _REFUSALS:
        return error.code(), f"the prefill stream was refused: {error.details() or ''}".rstrip()
    if isinstance(error, grpc.aio.AioRpcError):
        return grpc.StatusCode.UNAVAILABLE, f"the prefill stream broke ({error.code().name}): {error.details() or ''}".rstrip()
    return grpc.StatusCode.UNAVAILABLE, f"the prefill stream ended: {error!r}"
