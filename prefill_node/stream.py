"""PrefillSession: one router channel's PrefillStream on the prefill node.

Receives, in order, the channel's Prefill requests and cancellations (PrefillStreamRequest); hands
back one PrefillStreamReply per request, in the order the jobs end: the first-token message, or a
gRPC status code and message (prefill_node/intake.py). A cancellation, or the stream's end (the
router went away, the connection broke), drops the request's unfinished job ("prefill cancelled
by caller").

Threads: the gRPC handler thread runs `replies` (it blocks on the outbox); a reader thread of its
own reads the requests (`read_from`); the node's loop thread ends the jobs (their futures' callbacks
only queue them: the answer is packed on the handler's thread, off the loop's). Careful:
`close` must run when the RPC ends, or the handler thread waits on the outbox for ever.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import grpc

from prefill_node.intake import Refused, failure_status, submit
from prefill_node.node import PrefillNode
from protos import node_pb2

log = logging.getLogger(__name__)

CANCELLED = "prefill cancelled by caller"  # the abort reason of a job whose router stopped waiting


@dataclass(eq=False)
class _Open:
    """A request submitted from this stream and not yet answered or cancelled."""

    future: concurrent.futures.Future
    answered: threading.Event  # set once its answer went out (prefill_node/first_token.py `let_answer`)


class PrefillSession:
    def __init__(self, node: PrefillNode) -> None:
        self.node = node
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._outbox: queue.SimpleQueue[tuple[str, _Open | Refused] | None] = queue.SimpleQueue()
        self._closed = False

    def read_from(self, requests: Iterable[node_pb2.PrefillStreamRequest]) -> None:
        """Read the router's messages on a thread of their own until the stream ends."""
        threading.Thread(target=self._read, args=(requests,), name="prefill-stream", daemon=True).start()

    def replies(self) -> Iterator[node_pb2.PrefillStreamReply]:
        """The answers, as their jobs end, until the stream closes (the gRPC handler's generator)."""
        while (item := self._outbox.get()) is not None:
            rid, what = item
            if isinstance(what, Refused):
                yield _failed(rid, what.code, what.details)
                continue
            with self._lock:
                if self._open.get(rid) is not what:  # cancelled, or the stream closed: nobody waits for it
                    continue
                del self._open[rid]
            try:
                yield self._answer(rid, what.future)
            finally:  # sent (the server asks for the next answer once this one is written) or the stream ended
                what.answered.set()

    def close(self) -> None:
        """The stream ended: drop every unfinished job and end `replies`. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            dropped, self._open = self._open, {}
        for rid, entry in dropped.items():
            entry.answered.set()
            if not entry.future.done():
                self.node.abort(rid, CANCELLED)
        self._outbox.put(None)

    def _read(self, requests: Iterable[node_pb2.PrefillStreamRequest]) -> None:
        try:
            for msg in requests:
                kind = msg.WhichOneof("kind")
                if kind == "prefill":
                    self._start(msg.prefill)
                elif kind == "cancel":
                    self._cancel(msg.cancel.request_id)
                # neither: a message of a kind this node does not know; nothing to do
        except Exception as e:  # the stream broke (grpc.RpcError) or ended under the reader
            log.debug("prefill stream read ended: %r", e)
        finally:  # the router's end of writing is the session's end too: it awaits nothing more
            self.close()

    def _start(self, request: node_pb2.PrefillRequest) -> None:
        received = time.monotonic()  # the job's queue time starts (a TTFT part the first token carries back)
        rid = request.request_id  # echoed as sent: the router matches it against the ids it waits for
        answered = threading.Event()
        try:
            if rid in self._open:  # only this thread adds: no race with another start
                raise Refused(grpc.StatusCode.INVALID_ARGUMENT, f"request id {rid[:64]!r} is already open on this stream")
            _, future = submit(self.node, request, received, answered)
        except Refused as e:
            self._outbox.put((rid, e))
            return
        entry = _Open(future, answered)
        with self._lock:
            closed = self._closed
            if not closed:
                self._open[rid] = entry
        if closed:  # the stream ended meanwhile: nobody will read the answer
            self.node.abort(rid, CANCELLED)
            return
        future.add_done_callback(lambda _: self._outbox.put((rid, entry)))  # the loop's thread: queue only

    def _cancel(self, rid: str) -> None:
        with self._lock:
            entry = self._open.pop(rid, None)
        if entry is None:  # answered already, or never opened here: nothing of another stream is touched
            return
        entry.answered.set()
        if not entry.future.done():
            self.node.abort(rid, CANCELLED)

    def _answer(self, rid: str, future: concurrent.futures.Future) -> node_pb2.PrefillStreamReply:
        error = future.exception()
        if error is None:
            return node_pb2.PrefillStreamReply(request_id=rid, first_token_msgpack=future.result().pack())
        return _failed(rid, *failure_status(self.node, error))


def _failed(rid: str, code: grpc.StatusCode, details: str) -> node_pb2.PrefillStreamReply:
    return node_pb2.PrefillStreamReply(request_id=rid, code=code.value[0], details=details)
