"""One Prefill request on a PrefillStream of its own, from a synchronous PrefillControl stub: how
tests that drive a real prefill node's server send a prompt (the router sends its requests on
router/prefill_stream.py's long-lived streams). A failed request raises a grpc.RpcError with the
status code and message of its answer, as a refused stream does."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc

from protos import node_pb2

_CODES = {code.value[0]: code for code in grpc.StatusCode}


class PrefillFailed(grpc.RpcError):
    """A request's answer carried an error: its status code and message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def send_prefill(stub: Any, request: node_pb2.PrefillRequest, timeout: float = 60.0) -> node_pb2.Payload:
    """`request`'s first-token Payload from the node behind `stub` (PrefillFailed when its answer
    is an error, the stream's own grpc.RpcError when the stream is refused or breaks)."""
    answered = threading.Event()

    def requests() -> Iterator[node_pb2.PrefillStreamRequest]:
        yield node_pb2.PrefillStreamRequest(prefill=request)
        answered.wait(timeout)  # the end of writing ends the session, dropping the job: hold it open

    replies = stub.PrefillStream(requests(), timeout=timeout)
    try:
        reply = next(replies, None)
    finally:
        answered.set()
        replies.cancel()
    if reply is None:
        raise PrefillFailed(grpc.StatusCode.UNAVAILABLE, "the prefill stream ended without an answer")
    if reply.code != 0:
        raise PrefillFailed(_CODES.get(reply.code, grpc.StatusCode.UNKNOWN), reply.details)
    return node_pb2.Payload(msgpack=reply.first_token_msgpack)
