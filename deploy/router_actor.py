"""Thin async Ray actor around the plain Router (its gRPC server runs on the actor's loop)."""

from __future__ import annotations

import os
from typing import Any

from deploy.config import ServiceConfig


def rss_mb() -> float:
    """This process's resident memory in MiB (Linux; -1 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return -1.0
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


class RouterActor:
    def __init__(self, config_json: str) -> None:
        from router.directory import NodeDirectory

        self.cfg = ServiceConfig.model_validate_json(config_json)
        self.directory = NodeDirectory()
        self.router: Any = None

    async def start(self) -> str:
        from deploy.actors import node_tls
        from engine.loader import load_model_info
        from router.router import Router

        info = load_model_info(self.cfg.model.resolved_name())
        max_len = self.cfg.model.max_model_len or min(info.config.max_position_embeddings, 4096)
        self.router = Router(info, self.directory, self.cfg.router, max_model_len=max_len,
                             num_speculative_tokens=self.cfg.spec.num_speculative_tokens,
                             cluster_secret=self.cfg.cluster.secret, node_tls=node_tls(self.cfg),
                             block_size=self.cfg.cache.block_size)
        port = await self.router.start(self.cfg.router.port, self._host())
        return self._address(port)

    async def http_address(self) -> str | None:
        """host:port of the OpenAI-compatible HTTP door (None when it is off)."""
        return None if self.router is None or self.router.http_port is None else self._address(self.router.http_port)

    def _host(self) -> str:
        host = self.cfg.router.host
        if host == "auto":  # the Ray node's IP: reachable from other hosts, not every interface
            import ray

            host = ray.util.get_node_ip_address()
        return host

    def _address(self, port: int) -> str:
        host = self._host()
        return f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    async def set_nodes(self, kind: str, addresses: list[str]) -> None:
        """Make the directory's `kind` list equal `addresses` (the service watcher's view)."""
        current = set(self.directory.addresses(kind))  # type: ignore[arg-type]
        for addr in current - set(addresses):
            self.directory.remove(kind, addr)  # type: ignore[arg-type]
        for addr in addresses:
            if addr not in current:
                self.directory.add(kind, addr)  # type: ignore[arg-type]

    async def healthy_nodes(self) -> tuple[int, int]:
        """(prefill, decode) nodes the router can use now."""
        if self.router is None:
            return 0, 0
        h = self.router.health()
        return h.prefill_nodes, h.decode_nodes

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()

    async def status(self) -> dict[str, Any]:
        """For `pdserve status`: the router's view (health, queue, its nodes' last Status)."""
        import ray

        if self.router is None:
            return {"serving": False, "ray_node_id": ray.get_runtime_context().get_node_id()}
        h = self.router.health()
        nodes = {f"{k}/{a}": {"healthy": n.healthy, "last_error": n.last_error}
                 for (k, a), n in self.router.pool.nodes.items()}
        return {"serving": h.serving, "prefill_nodes": h.prefill_nodes, "decode_nodes": h.decode_nodes,
                "running_requests": h.running_requests, "queued_requests": self.router.num_queued,
                "migrations": self.router.migrations, "terminals": dict(self.router.counts), "rss_mb": rss_mb(),
                "nodes": nodes, "ray_node_id": ray.get_runtime_context().get_node_id()}
