"""A router serving HTTP on 127.0.0.1 in front of real nodes in this process (the tiny model, or
a given (LoadedModel, ModelInfo) pair): a prefill and a decode node (KV over `kv_backend`: tcp, or
ipc through shared memory), or one colocated node. The router runs on its own loop
thread, so tests drive it with blocking clients (the `openai` client, httpx2)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any

import openai

from decode_node.colocated import ColocatedNode
from decode_node.node import DecodeNode
from decode_node.server import serve_colocated, serve_decode
from deploy.config import RouterConfig
from engine.engine import EngineConfig
from engine.model.loader import load_model, load_model_info
from prefill_node.node import PrefillNode
from prefill_node.server import DecodeClients, serve_prefill
from router import NodeDirectory, Router


class RealService:
    def __init__(self, mode: str = "pd", k: int = 2, max_model_len: int = 128, model: tuple[Any, Any] | None = None,
                 engine: dict[str, Any] | None = None, decode_engine: dict[str, Any] | None = None,
                 prefix_cache: bool = False, kv_backend: str = "tcp", kv_timeout_s: float = 5.0,
                 kv_quarantine_s: float | None = 0.2, **router: Any) -> None:
        """`engine`: more EngineConfig fields of every node (num_blocks, ...), `decode_engine` the
        decode node's own; `router`: RouterConfig's. `kv_quarantine_s` None: the KV timeout, as
        in a deployed service (deploy/actors.py)."""
        self.kv_timeout_s, self.kv_quarantine_s = kv_timeout_s, kv_quarantine_s
        loaded, info = model or (load_model("tiny"), load_model_info("tiny"))
        self.mode = mode
        self.config = EngineConfig(num_speculative_tokens=k, max_model_len=max_model_len,
                                   enable_prefix_caching=prefix_cache, **(engine or {}))
        self.decode_config = dataclasses.replace(self.config, **(decode_engine or {}))
        self.nodes: list[Any] = []
        self.servers: list[Any] = []
        if mode == "pd":
            directory = self._pd(loaded, kv_backend)
        else:
            node = ColocatedNode(loaded, self.config)
            node.start()
            self.nodes.append(node)
            self.servers.append(serve_colocated(node, "c0"))
            directory = NodeDirectory(colocated=[f"127.0.0.1:{self.servers[0][1]}"])
        config = RouterConfig(host="127.0.0.1", port=0, http_port=0, status_interval_s=0.05, default_timeout_s=60,
                              **router)
        self.router = Router(info, directory, config, max_model_len=max_model_len)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.call(self.router.start())
        self.base = f"http://127.0.0.1:{self.router.http_port}"
        self.client = openai.OpenAI(base_url=f"{self.base}/v1", api_key="none", max_retries=0)

    def _pd(self, loaded: Any, kv_backend: str) -> NodeDirectory:
        decode = DecodeNode(loaded, self.decode_config, kv_backend=kv_backend, kv_timeout_s=self.kv_timeout_s,
                            kv_quarantine_s=self.kv_quarantine_s)
        self.clients = DecodeClients()
        prefill = PrefillNode(loaded, self.config, self.clients.send_first_token, kv_backend=kv_backend,
                              kv_timeout_s=self.kv_timeout_s)
        self.nodes += [prefill, decode]
        for node in self.nodes:
            node.start()
        self.servers += [serve_prefill(prefill, "p0"), serve_decode(decode, "d0")]
        (_, pport), (_, dport) = self.servers
        return NodeDirectory([f"127.0.0.1:{pport}"], [f"127.0.0.1:{dport}"])

    def call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=60)

    def blocks_back(self, timeout: float = 10.0) -> bool:
        """I4: no request in flight and every node's KV blocks free again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if all(n.blocks.num_free == n.blocks.capacity for n in self.nodes) and not self.router.requests:
                return True
            time.sleep(0.02)
        return False

    def close(self) -> None:
        self.client.close()
        self.call(self.router.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        for server, _ in self.servers:
            server.stop(0)
        for node in self.nodes:
            node.stop()
