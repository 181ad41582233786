"""The standard gRPC health service (grpc.health.v1) on the router's own port, for Kubernetes
`grpc` probes and gRPC-aware load balancers.

Two service names answer. "" is SERVING while the router's server runs (liveness: the process
is alive and answers RPCs). "pdserve.v1.Generation" is SERVING only while pdserve's own
`Health` (protos/pdserve.proto) says `serving`: at least one healthy prefill and one healthy
decode node (readiness: send traffic here). Any other name is NOT_FOUND, as the protocol says.
Check only; Watch is left unimplemented. Never blocks: it reads the router's current view.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

GENERATION_SERVICE = "pdserve.v1.Generation"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RouterHealth(health_pb2_grpc.HealthServicer):
    def __init__(self, serving: Callable[[], bool]) -> None:
        self.serving = serving  # pdserve Health's `serving` (nodes included)

    async def Check(self, request: Any, context: Any) -> health_pb2.HealthCheckResponse:  # noqa: N802
        if request.service == "":
            return health_pb2.HealthCheckResponse(status=SERVING)
        if request.service == GENERATION_SERVICE:
            return health_pb2.HealthCheckResponse(status=SERVING if self.serving() else NOT_SERVING)
        await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown service {request.service!r}")
        raise AssertionError("unreachable")  # abort raises


def add_health_servicer(server: Any, serving: Callable[[], bool]) -> None:
    health_pb2_grpc.add_HealthServicer_to_server(RouterHealth(serving), server)
