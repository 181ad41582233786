"""grpc.health.v1 on the router's port (what Kubernetes `grpc` probes call): "" is liveness,
"pdserve.v1.Generation" readiness (a prefill and a decode node healthy), others NOT_FOUND."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.grpc_health import GENERATION_SERVICE
from tests.router.conftest import cluster

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def check(port: int, service: str) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                                 timeout=5)
        return reply.status


async def test_liveness_and_readiness_follow_the_nodes():
    async with cluster(n_decode=1) as c:
        port = int(c.client.address.rsplit(":", 1)[1])
        assert await check(port, "") == SERVING
        assert await check(port, GENERATION_SERVICE) == SERVING
        await c.decode[0].die()
        await c.until(lambda: not c.router.pool.healthy("decode"))
        assert await check(port, GENERATION_SERVICE) == NOT_SERVING  # not ready: no decode node
        assert await check(port, "") == SERVING  # but alive: no restart wanted
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await check(port, "no.such.Service")
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
