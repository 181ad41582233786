"""The router's gRPC front door: the Generation service (protos/pdserve.proto) and grpc.health.v1.

Receives gRPC calls and hands each to the request lifecycle (`Lifecycle`, lifecycle.py: router.py
builds this door, never the other way): Generate is `submit` (a refusal before the request starts
is the call's status) and then `responses`, streamed until the terminal message; a client that
goes away closes `responses`, which cancels the request. Abort, Health and ListModels answer from
the lifecycle as they are. Binds only the configured host, with the API-key interceptor and TLS
when configured.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

import grpc

from protos import pdserve_pb2, pdserve_pb2_grpc
from router.auth import ApiKeyInterceptor
from router.grpc_health import add_health_servicer
from router.lifecycle import Lifecycle
from router.pool import MAX_MESSAGE_BYTES
from router.request import RequestError
from router.tls import server_credentials
from router.ttft import Timeline


def serve(router: Lifecycle, host: str, port: int) -> tuple[grpc.aio.Server, int]:
    """Build the gRPC server (API-key interceptor, TLS when configured) and bind it to `host`
    only; the server (not started) and the bound port."""
    config = router.config
    key, cert = config.api_key, config.tls_cert
    creds = server_credentials(cert, config.tls_key or "") if cert else None  # read first: clear errors
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", MAX_MESSAGE_BYTES)],
                             interceptors=[ApiKeyInterceptor(key)] if key else None)
    pdserve_pb2_grpc.add_GenerationServicer_to_server(_Servicer(router), server)
    add_health_servicer(server, lambda: router.health().serving)  # grpc.health.v1 (k8s probes)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if creds is None:
        return server, server.add_insecure_port(address)
    return server, server.add_secure_port(address, creds)


class _Servicer(pdserve_pb2_grpc.GenerationServicer):
    def __init__(self, router: Lifecycle) -> None:
        self.router = router

    async def Generate(self, request: Any, context: Any) -> AsyncIterator[pdserve_pb2.GenerateResponse]:  # noqa: N802
        timeline = Timeline()  # the request's TTFT begins (router/ttft.py); grpc decoded it already
        try:
            st = await self.router.submit(request, timeline)
        except RequestError as e:
            await context.abort(getattr(grpc.StatusCode, e.code), e.message)
        async with aclosing(self.router.responses(st)) as msgs:  # grpc wants an async generator function
            async for msg in msgs:
                yield msg

    async def Abort(self, request: Any, context: Any) -> pdserve_pb2.AbortResponse:  # noqa: N802
        return pdserve_pb2.AbortResponse(found=await self.router.abort(request.request_id))

    async def Health(self, request: Any, context: Any) -> pdserve_pb2.HealthResponse:  # noqa: N802
        header = dict(context.invocation_metadata() or ()).get("authorization")
        return self.router.health(nodes=self.router.health_detail_allowed(header))

    async def ListModels(self, request: Any, context: Any) -> pdserve_pb2.ListModelsResponse:  # noqa: N802
        return self.router.list_models()
