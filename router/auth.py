"""Bearer-token auth on the client API (`pdserve up --api-key KEY`, as vLLM names it).

With `router.api_key` set, a call must carry `authorization: Bearer KEY`: gRPC metadata for
Generate, Abort and ListModels (else UNAUTHENTICATED), the HTTP header for `/v1/...` (else
401 in OpenAI's error JSON). Health checks stay open (pdserve's `Health`, the standard
`grpc.health.v1`, `GET /health`) so probes need no secret, and so does `/metrics`, as in vLLM.
Keys are compared in constant time. Without a key nothing is checked.
"""

from __future__ import annotations

import hmac
from typing import Any

import grpc

from protos.serving import refusing

OPEN_GRPC_METHODS = ("/pdserve.v1.Generation/Health", "/grpc.health.v1.Health/")


def authorized(header: str | None, key: str) -> bool:
    """Whether an `authorization` value is `Bearer KEY` (constant-time compare)."""
    if header is None or not header.startswith("Bearer "):
        return False
    return hmac.compare_digest(header[len("Bearer "):].encode(), key.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses gRPC calls without the bearer token, except the health checks."""

    def __init__(self, key: str) -> None:
        self.key = key

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_GRPC_METHODS):
            return handler
        header = dict(details.invocation_metadata or ()).get("authorization")
        return handler if authorized(header, self.key) else refusing(handler, _refuse, _refuse_stream)


async def _refuse(request: Any, context: Any) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key (authorization: Bearer KEY)")


async def _refuse_stream(request: Any, context: Any) -> Any:
    await _refuse(request, context)
    yield  # pragma: no cover  (abort raises; this makes it an async generator)


def client_metadata(key: str | None) -> tuple[tuple[str, str], ...] | None:
    return (("authorization", f"Bearer {key}"),) if key else None
