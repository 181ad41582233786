"""The router binds only the configured interface: loopback by default (the issue saw `*:PORT`
while the log said 127.0.0.1)."""

from __future__ import annotations

from deploy.config import RouterConfig
from router import NodeDirectory, Router
from tests.listening import listening
from tests.router.conftest import MAX_MODEL_LEN, TINY


async def test_router_binds_loopback_by_default_and_the_configured_host_otherwise():
    assert RouterConfig().host == "127.0.0.1"
    for host, want in ((None, "127.0.0.1"), ("0.0.0.0", "0.0.0.0")):
        cfg = RouterConfig(port=0, http_port=0, status_interval_s=3600.0,
                           **({"host": host} if host else {}))  # type: ignore[arg-type]
        router = Router(TINY, NodeDirectory(), cfg, max_model_len=MAX_MODEL_LEN, num_speculative_tokens=0)
        await router.start()
        try:
            ports = {router.grpc_port, router.http_port}
            mine = {(ip, port) for ip, port in listening() if port in ports}
            assert mine == {(want, p) for p in ports}, mine
        finally:
            await router.stop()
