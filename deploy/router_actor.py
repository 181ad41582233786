"""Thin async Ray actor around the plain Router (its gRPC server runs on the actor's loop).

The loop is uvloop's: Ray runs an async actor on it when uvloop is importable (a dependency for
this process's sake: the doors' per-event socket work; `RAY_USE_UVLOOP=0` turns it off).

Restarts: the actor restarts forever (deploy/service.py). Ray re-runs only `__init__` in the new
process, so a restarted actor serves nothing and knows no node until the service's watcher gives
it the node list (`set_nodes`) and calls `ensure_serving` with the ports its predecessor bound:
clients keep the same address. The new Router has a new instance id; the dead one's requests are
dropped by the decode nodes once its Outputs streams end (decode_node/node.py, "Owners"), and by
the prefill nodes once its PrefillStreams end. Requests in flight at the death end at the client
with a broken stream (gRPC UNAVAILABLE); none is carried over.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from deploy.config import ServiceConfig
from deploy.procmem import process_memory


class RouterActor:
    def __init__(self, config_json: str) -> None:
        from deploy.actors import node_logging
        from router.directory import NodeDirectory

        node_logging(("router.metrics",))  # its first requests' TTFT parts (router/metrics.py)
        self.cfg = ServiceConfig.model_validate_json(config_json)
        self.directory = NodeDirectory()
        self.router: Any = None
        self.peers: list[Any] = []  # the service's other router actors (router.processes > 1)
        self._starting = asyncio.Lock()

    async def start(self, port: int | None = None, http_port: int | None = -1) -> str:
        """Serve, once (later calls return the address): gRPC on `port`, HTTP on `http_port`
        (defaults: the config's; -1: the config's HTTP port, None: no HTTP). Never leaves a
        half-started router behind: a failed start stops what it started and raises."""
        from deploy.actors import node_tls
        from engine.model.info import load_model_info
        from router.router import Router, freeze_heap

        async with self._starting:
            if self.router is not None:
                return self._address(self.router.grpc_port)
            info = load_model_info(self.cfg.model.resolved_name(), self.cfg.model.load_format)
            max_len = self.cfg.model.max_model_len or min(info.config.max_position_embeddings, 4096)
            router = Router(info, self.directory, self.cfg.router, max_model_len=max_len,
                            num_speculative_tokens=self.cfg.spec.num_speculative_tokens,
                            cluster_secret=self.cfg.cluster.secret, node_tls=node_tls(self.cfg),
                            block_size=self.cfg.cache.block_size)
            try:
                bound = await router.start(self.cfg.router.port if port is None else port, self._host(), http_port)
            except BaseException:
                with contextlib.suppress(Exception):
                    await router.stop()
                raise
            self.router = router
            router.peer_metrics = self._peer_metrics
            freeze_heap()  # this process is the router's alone
            return self._address(bound)

    async def ensure_serving(self, port: int, http_port: int | None, peers: list[Any] | None = None) -> str:
        """Start serving on these ports unless serving already (a process Ray restarted is not);
        returns the serving router's instance id (new at every start). `peers`: the service's
        other router actors (their /metrics are summed into this one's)."""
        if peers is not None:
            self.peers = peers
        if self.router is None:
            await self.start(port, http_port)
        return str(self.router.router_id)

    async def local_metrics(self) -> bytes:
        """This process's own /metrics text (what a peer sums into its own)."""
        return b"" if self.router is None else bytes(self.router.metrics.exposition()[0])

    async def _peer_metrics(self) -> list[bytes]:
        texts = await asyncio.gather(*(p.local_metrics.remote() for p in self.peers))
        return [t for t in texts if t]

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

    async def healthy_nodes(self) -> tuple[int, int, int]:
        """(prefill, decode, colocated) nodes the router can use now."""
        if self.router is None:
            return 0, 0, 0
        h = self.router.health()
        return h.prefill_nodes, h.decode_nodes, h.colocated_nodes

    async def stop(self) -> None:
        if self.router is not None:
            await self.router.stop()

    async def status(self) -> dict[str, Any]:
        """For `pdserve status`: the router's view (health, queue, its nodes' last Status)."""
        import ray

        if self.router is None:
            return {"serving": False, "ray_node_id": ray.get_runtime_context().get_node_id(), **process_memory()}
        h = self.router.health()
        nodes = {f"{k}/{a}": {"healthy": n.healthy, "last_error": n.last_error}
                 for (k, a), n in self.router.pool.nodes.items()}
        return {"serving": h.serving, "prefill_nodes": h.prefill_nodes, "decode_nodes": h.decode_nodes,
                "colocated_nodes": h.colocated_nodes,
                "running_requests": h.running_requests, "queued_requests": self.router.num_queued,
                "migrations": self.router.migrations, "terminals": dict(self.router.counts), **process_memory(),
                "primed_pairs": self.router.pool.primer.primed, "prime_failures": self.router.pool.primer.failed,
                "nodes": nodes, "node_failures": list(self.router.pool.recent_downs),
                "ray_node_id": ray.get_runtime_context().get_node_id()}
