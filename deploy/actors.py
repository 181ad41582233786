"""Thin Ray actors around the plain node objects (ARCHITECTURE I6).

A node actor loads the model, builds its PrefillNode or DecodeNode, starts the node's loop
and its gRPC server, and reports the server's address. All request traffic goes over gRPC;
Ray only places, watches and restarts the processes. Each actor restarts forever on death
(`max_restarts=-1`); a restarted actor binds a new port, which the controller notices.
"""

from __future__ import annotations

import os
import socket
from typing import Any

from deploy.config import ServiceConfig


def engine_config(cfg: ServiceConfig, role: str):
    from engine.engine import EngineConfig

    return EngineConfig(
        num_speculative_tokens=cfg.spec.num_speculative_tokens,
        draft_vocab_size=cfg.spec.draft_vocab_size,
        block_size=cfg.cache.block_size,
        max_num_seqs=cfg.decode.max_num_seqs,  # on P this sizes the KV pool for leases
        max_num_batched_tokens=cfg.prefill.max_num_batched_tokens,
        max_model_len=cfg.model.max_model_len,
        kv_cache_bytes=cfg.cache.kv_cache_bytes,
        num_blocks=cfg.cache.num_blocks,
        device=cfg.model.resolved_device(),
        enforce_eager=cfg.model.enforce_eager,
        deterministic=cfg.model.deterministic,
        enable_prefix_caching=cfg.prefill.prefix_cache and role == "prefill",
    )


def bind_host(cfg: ServiceConfig) -> str:
    """`cluster.node_host`, with 'auto' meaning this Ray node's IP (reachable from other hosts)."""
    if cfg.cluster.node_host != "auto":
        return cfg.cluster.node_host
    import ray

    return ray.util.get_node_ip_address()


class NodeActor:
    """One prefill or decode node in its own process."""

    def __init__(self, role: str, node_id: str, config_json: str, host: str | None = None) -> None:
        import torch

        from engine.loader import load_model

        cfg = ServiceConfig.model_validate_json(config_json)
        threads = max(1, int(cfg.prefill.num_cpus if role == "prefill" else cfg.decode.num_cpus))
        torch.set_num_threads(threads)
        device = cfg.model.resolved_device()
        loaded = load_model(cfg.model.resolved_name(), device=device, dtype=cfg.model.dtype,
                            mtp_path=cfg.model.mtp_path)
        host = host or bind_host(cfg)
        self.role, self.node_id, self.host = role, node_id, host
        kv: dict[str, Any] = {"kv_backend": cfg.kv_transfer.backend, "kv_timeout_s": cfg.kv_transfer.timeout_s}
        if cfg.kv_transfer.backend == "ucx":  # a local service's UCX listens on loopback only
            from kvtransfer.ucx import restrict_to_loopback

            restrict_to_loopback(host)
        if cfg.kv_transfer.backend == "tcp" and role == "decode":
            kv["kv_options"] = {"host": host}  # the tcp receiver listens where the node serves
        if cfg.kv_transfer.faults.any and role == "prefill":  # a fault drill: its KV links misbehave
            kv["kv_options"] = {"faults": cfg.kv_transfer.faults.model_dump()}
        if role == "prefill":
            from prefill_node.node import PrefillNode
            from prefill_node.server import DecodeClients, serve_prefill

            self._clients = DecodeClients(secret=cfg.cluster.secret)
            self.node: Any = PrefillNode(loaded, engine_config(cfg, role), self._clients.send_first_token, **kv)
            self.node.start()
            self.server, self.port = serve_prefill(self.node, node_id, host, secret=cfg.cluster.secret)
        elif role == "decode":
            from decode_node.node import DecodeNode
            from decode_node.server import serve_decode

            self.node = DecodeNode(loaded, engine_config(cfg, role), **kv)
            self.node.start()
            self.server, self.port = serve_decode(self.node, node_id, host, secret=cfg.cluster.secret)
        else:
            raise ValueError(f"unknown node role {role!r}")

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def info(self) -> dict[str, Any]:
        import ray

        return {"role": self.role, "node_id": self.node_id, "address": self.address(),
                "pid": os.getpid(), "host": socket.gethostname(),
                "ray_node_id": ray.get_runtime_context().get_node_id(), **self.node.status()}

    def stop(self) -> None:
        self.server.stop(grace=1)
        self.node.stop()
