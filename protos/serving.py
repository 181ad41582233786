"""Starting the nodes' gRPC servers (threaded; the node loops do the real work), and the
cluster secret that router and nodes share. With a `NodeTls` (protos/tls.py) a server speaks
mutual TLS only: plain-text clients and clients without a certificate the cluster CA signed fail
their handshake (UNAVAILABLE); the secret is checked as well.

With a secret, every node RPC (Reserve, FirstToken, Abort, Prefill, Outputs, Status) must carry
it as `x-pdserve-cluster-secret` metadata, else UNAUTHENTICATED; it is compared in constant
time and never logged. Callers add it with `with_secret(stub, secret)`.

Keepalive: a server pings each client connection every `keepalive_s` and closes it when a
ping goes unanswered for as long again. A router whose host vanishes without resetting its
connections (power loss, a network partition) thereby ends its Outputs streams within about
2 x keepalive_s, and the decode node drops that router's requests (decode_node/node.py,
"Owners") instead of holding their blocks until TCP gives up.
"""

from __future__ import annotations

import functools
import hmac
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc

from protos.messages import MAX_MESSAGE_BYTES
from protos.tls import NodeTls

GRPC_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)]
KEEPALIVE_S = 20.0


def refuse_if_failed(node: Any, context: grpc.ServicerContext) -> None:
    """A node whose step loop failed (engine/sched/step_loop.py `loop_error`) takes no more work:
    UNAVAILABLE, so the router takes it out and tries another node (its process is ending)."""
    if node.loop_error is not None:
        context.abort(grpc.StatusCode.UNAVAILABLE, f"the node's step loop failed: {node.loop_error!r}")


def keepalive_options(seconds: float) -> list[tuple[str, int]]:
    """Server options: ping every `seconds` (with or without calls and data), close on no answer."""
    ms = max(int(seconds * 1000), 1)
    return [("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
            ("grpc.http2.min_time_between_pings_ms", ms),  # else 5 min between pings on an idle stream
            ("grpc.http2.ping_timeout_ms", ms)]  # else a minute before an unanswered ping counts
SECRET_HEADER = "x-pdserve-cluster-secret"
REFUSED = "missing or wrong cluster secret"


def secret_metadata(secret: str | None) -> tuple[tuple[str, str], ...] | None:
    return ((SECRET_HEADER, secret),) if secret else None


class _SecretStub:
    """A stub whose every call carries the cluster secret's metadata."""

    def __init__(self, stub: Any, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._stub, self._metadata = stub, metadata

    def __getattr__(self, name: str) -> Any:
        return functools.partial(getattr(self._stub, name), metadata=self._metadata)


def with_secret(stub: Any, secret: str | None) -> Any:
    """`stub` as is without a secret; else a stub that sends it on every call."""
    return stub if not secret else _SecretStub(stub, secret_metadata(secret))


class SecretInterceptor(grpc.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not carry the cluster secret."""

    def __init__(self, secret: str) -> None:
        self._secret = secret.encode()

    def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        given = dict(details.invocation_metadata or ()).get(SECRET_HEADER, "")
        if isinstance(given, str) and hmac.compare_digest(given.encode(), self._secret):
            return handler
        return refusing(handler, _refuse, _refuse_stream)


def _refuse(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


def _refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
    context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)
    yield  # pragma: no cover  (abort raises; this makes it a generator)


def refusing(handler: Any, refuse: Callable[..., Any], refuse_stream: Callable[..., Any]) -> Any:
    """A handler of `handler`'s kind and (de)serializers that answers with `refuse` (unary) or
    `refuse_stream` (server-streaming, and bidirectional: PrefillStream): what an auth interceptor
    hands back instead. No client-streaming method with a single answer is served."""
    io = (handler.request_deserializer, handler.response_serializer)
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, *io)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse_stream, *io)
    if handler.stream_stream is not None:
        return grpc.stream_stream_rpc_method_handler(refuse_stream, *io)
    raise ValueError("no client-streaming method with a single answer is served")


def start_server(register: Callable[[Any, grpc.Server], None], servicer: Any, host: str, port: int,
                 workers: int, secret: str | None = None, tls: NodeTls | None = None,
                 keepalive_s: float = KEEPALIVE_S) -> tuple[grpc.Server, int]:
    """`register` is the generated `add_*Servicer_to_server`; binds `host` only; with `secret`
    every call must carry it; with `tls` it serves mutual TLS only; pings clients every
    `keepalive_s`. Returns the server and its port."""
    creds = tls.server_credentials() if tls is not None else None
    options = GRPC_OPTIONS + keepalive_options(keepalive_s)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers), options=options,
                         interceptors=[SecretInterceptor(secret)] if secret else None)
    register(servicer, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    bound = server.add_secure_port(address, creds) if creds is not None else server.add_insecure_port(address)
    server.start()
    return server, bound
