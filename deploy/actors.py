"""Thin Ray actors around the plain node objects (ARCHITECTURE I6).

A node actor loads the model, builds its PrefillNode, DecodeNode or ColocatedNode, starts the node's loop
and its gRPC server, and reports the server's address. All request traffic goes over gRPC;
Ray only places, watches and restarts the processes. Each actor restarts forever on death
(`max_restarts=-1`); a restarted actor binds a new port, which the controller notices.
"""

from __future__ import annotations

import gc
import logging
import socket
import time
from typing import TYPE_CHECKING, Any

from deploy.config import ServiceConfig
from deploy.procmem import gc_paused, process_age_s, process_memory

EXIT_STEP_FAILED = 70  # a node process's exit status after its step loop failed (EX_SOFTWARE)
# The packages whose INFO lines a node process writes (warm-up phases, slow idle captures, a failed step)
NODE_LOGGERS = ("engine", "prefill_node", "decode_node", "kvtransfer", "deploy")

if TYPE_CHECKING:
    from protos.tls import NodeTls


def engine_config(cfg: ServiceConfig, role: str):
    from engine.engine import EngineConfig

    if role == "colocated":
        c = cfg.colocated
        return EngineConfig(
            num_speculative_tokens=cfg.spec.num_speculative_tokens, draft_vocab_size=cfg.spec.draft_vocab_size,
            spec_k_policy=cfg.spec.k_policy,
            block_size=cfg.cache.block_size, max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=c.max_num_batched_tokens, max_model_len=cfg.model.max_model_len,
            kv_cache_bytes=cfg.cache.kv_cache_bytes, num_blocks=cfg.cache.num_blocks,
            device=cfg.model.resolved_device(), enforce_eager=cfg.model.enforce_eager,
            deterministic=cfg.model.deterministic, enable_prefix_caching=c.prefix_cache, warmup=cfg.model.warmup,
        )
    return EngineConfig(
        num_speculative_tokens=cfg.spec.num_speculative_tokens,
        draft_vocab_size=cfg.spec.draft_vocab_size,
        spec_k_policy=cfg.spec.k_policy,
        block_size=cfg.cache.block_size,
        max_num_seqs=cfg.decode.max_num_seqs,  # on P this sizes the KV pool for leases
        max_num_batched_tokens=cfg.prefill.max_num_batched_tokens,
        max_model_len=cfg.model.max_model_len,
        kv_cache_bytes=cfg.cache.kv_cache_bytes,
        num_blocks=cfg.cache.num_blocks,
        device=cfg.model.resolved_device(),
        enforce_eager=cfg.model.enforce_eager,
        deterministic=cfg.model.deterministic,
        enable_prefix_caching=cfg.prefill.prefix_cache if role == "prefill" else cfg.decode.prefix_cache,
        warmup=cfg.model.warmup,
    )


def bind_host(cfg: ServiceConfig) -> str:
    """`cluster.node_host`, with 'auto' meaning this Ray node's IP (reachable from other hosts)."""
    if cfg.cluster.node_host != "auto":
        return cfg.cluster.node_host
    import ray

    return ray.util.get_node_ip_address()


def node_tls(cfg: ServiceConfig) -> NodeTls | None:
    """The node channels' mutual TLS (protos/tls.py `NodeTls`), read and checked from this host's
    `cluster.node_tls_*` files; None when off."""
    c = cfg.cluster
    if not c.node_tls:
        return None
    from protos.tls import NodeTls

    assert c.node_tls_ca is not None and c.node_tls_cert is not None and c.node_tls_key is not None
    return NodeTls.load(c.node_tls_ca, c.node_tls_cert, c.node_tls_key, c.node_tls_name)


class _Phases:
    """Seconds per start-up phase: `mark(name)` ends the phase that began at the last mark. The
    first phase, `process`, is the worker process's life before the constructor ran."""

    def __init__(self) -> None:
        self.phases: dict[str, float] = {"process": max(0.0, process_age_s())}
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = round(now - self._last, 2)
        self._last = now

    def split(self, name: str, part: str, seconds: float) -> None:
        """Report `seconds` of phase `name` as phase `part` of their own (when > 0)."""
        if seconds > 0:
            self.phases[name] = round(max(0.0, self.phases[name] - seconds), 2)
            self.phases[part] = round(seconds, 2)


class NodeActor:
    """One prefill or decode node in its own process (or, with `tp`, one rank of one)."""

    server: Any = None
    port: int | None = None

    def __init__(self, role: str, node_id: str, config_json: str, host: str | None = None) -> None:
        cfg = ServiceConfig.model_validate_json(config_json)
        self._serve(cfg, role, node_id, host or bind_host(cfg))

    def _serve(self, cfg: ServiceConfig, role: str, node_id: str, host: str, tp: Any = None) -> None:
        """Load the model, build and start the node; its gRPC server unless a rank > 0 of a TP group.
        `startup` records how long each phase took (seconds; `pdserve up` prints the slowest node's)."""
        clock = _Phases()
        node_logging()
        with gc_paused():
            import torch

            from engine.cuda_init import start_cuda_init

            device = cfg.model.resolved_device()
            start_cuda_init(device)  # the context is made while the engine's modules import and the weights are read
            from engine.model.loader import load_model

            gc.freeze()  # the modules' objects, long-lived: freeze_node_heap's collection then walks only the node's own
        clock.mark("imports")
        threads = max(1, int(cfg.section(role).num_cpus))
        torch.set_num_threads(threads)
        tls = node_tls(cfg)  # before the model: a bad file fails the actor at once
        loaded = load_model(cfg.model.resolved_name(), device=device, dtype=cfg.model.dtype,
                            mtp_path=cfg.model.mtp_path, load_format=cfg.model.load_format)
        clock.mark("model_load")
        self.role, self.node_id, self.host = role, node_id, host
        kv = _kv_options(cfg, role, host) if role != "colocated" else {}
        if tp is not None:
            kv["tp"] = tp
        if role == "prefill":
            from prefill_node.server import DecodeClients, serve_prefill

            self._clients = DecodeClients(secret=cfg.cluster.secret, tls=tls)
            self.node: Any = _prefill_class(tp)(loaded, engine_config(cfg, role), self._clients.send_first_token, **kv)
            serve: Any = serve_prefill
        elif role == "decode":
            from decode_node.server import serve_decode

            self.node = _decode_class(tp)(loaded, engine_config(cfg, role), **kv)
            serve = serve_decode
        elif role == "colocated":
            from decode_node.colocated import ColocatedNode
            from decode_node.server import serve_colocated

            self.node = ColocatedNode(loaded, engine_config(cfg, role), tp=tp)
            serve = serve_colocated
        else:
            raise ValueError(f"unknown node role {role!r}")
        clock.mark("node_build")  # the runner: KV cache, CUDA graph capture, warm-up (split out below)
        clock.split("node_build", "warmup", getattr(self.node, "warmup_s", 0.0))
        freeze_node_heap()
        self.node.on_loop_error = end_process
        self.node.start()
        logging.getLogger(__name__).info("%s %s built: %s", role, node_id,
                                         ", ".join(f"{k} {v:.1f} s" for k, v in clock.phases.items()))
        if tp is None or tp.rank == 0:
            self.server, self.port = serve(self.node, node_id, host, secret=cfg.cluster.secret, tls=tls)
        clock.mark("serve")
        self.startup = clock.phases

    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def fail_next_step(self, message: str = "CUDA error: an illegal memory access was encountered (test)") -> None:
        """Test hook (fault drills): the node's next step raises the error a CUDA fault raises
        (torch.AcceleratorError), on any device; the process then ends and Ray starts a new one."""
        import torch

        self.node.fail_next_step(torch.AcceleratorError(message))

    def info(self) -> dict[str, Any]:
        import ray

        return {"role": self.role, "node_id": self.node_id, "address": self.address(), **process_memory(),
                "startup": getattr(self, "startup", {}),
                "host": socket.gethostname(), "emitted": getattr(self.node, "emitted", None),
                "orphans_dropped": getattr(self.node, "orphans_dropped", None),
                "restarted": ray.get_runtime_context().was_current_actor_reconstructed,
                "ray_node_id": ray.get_runtime_context().get_node_id(), **self.node.status()}

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=1)
        self.node.stop()


def node_logging(names: tuple[str, ...] = NODE_LOGGERS) -> None:
    """A node (or router) process's own log lines at INFO on its stderr, which Ray keeps in the
    session's logs (`worker-*.err`; `pdserve up` starts Ray with its logging configuration off).
    Once per process."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name in names:
        logger = logging.getLogger(name)
        if not logger.handlers:
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)


def end_process(error: BaseException) -> None:
    """A node's step loop failed (a device error): the process ends at once, whatever its other
    threads hold, and Ray starts the actor again (`max_restarts=-1`) with a fresh device context;
    its connections close with it, so routers move its requests (deploy/service.py re-lists it)."""
    import os

    logging.getLogger(__name__).critical("node process ends after a failed step: %r", error)
    logging.shutdown()
    os._exit(EXIT_STEP_FAILED)


def freeze_node_heap() -> None:
    """Exclude everything alive once the node is built (modules, the model, the runner, Triton's and
    the CUDA graphs' objects) from the garbage collector's full passes, as the router does
    (router.router.freeze_heap): the step loop makes objects every step, and each full collection
    would otherwise walk that whole heap on the loop thread. The imported modules' objects were frozen
    after the imports (NodeActor._serve), uncollected: this collection, on the way to ready, walks only
    what the node built. Once per node process."""
    gc.collect()
    gc.freeze()


def _kv_options(cfg: ServiceConfig, role: str, host: str) -> dict[str, Any]:
    kv: dict[str, Any] = {"kv_backend": cfg.kv_transfer.backend, "kv_timeout_s": cfg.kv_transfer.timeout_s}
    if cfg.kv_transfer.backend == "ucx":  # a local service's UCX listens on loopback only
        from kvtransfer.ucx import restrict_to_loopback

        restrict_to_loopback(host)
    if cfg.kv_transfer.backend in ("tcp", "ipc") and role == "decode":
        kv["kv_options"] = {"host": host}  # the control listener is where the node serves
    if cfg.kv_transfer.faults.any and role == "prefill":  # a fault drill: its KV links misbehave
        kv["kv_options"] = {"faults": cfg.kv_transfer.faults.model_dump()}
    return kv


def _prefill_class(tp: Any) -> type:
    if tp is None:
        from prefill_node.node import PrefillNode

        return PrefillNode
    from prefill_node.tp import TPPrefillNode

    return TPPrefillNode


def _decode_class(tp: Any) -> type:
    if tp is None:
        from decode_node.node import DecodeNode

        return DecodeNode
    from decode_node.tp import TPDecodeNode

    return TPDecodeNode


class TPRankActor(NodeActor):
    """Rank `rank` of a node of TP size `size`: built in two calls, since every rank must be
    up to join the group: rank 0's `rendezvous()` names the group's address, then every rank's
    `join(address)` joins it (gloo on the CPU, NCCL on its GPU) and builds its node."""

    def __init__(self, role: str, node_id: str, config_json: str, rank: int, size: int) -> None:
        self.cfg = ServiceConfig.model_validate_json(config_json)
        self.role, self.node_id, self.rank, self.size = role, node_id, rank, size
        self.host = bind_host(self.cfg)

    def rendezvous(self) -> str:
        with socket.socket() as s:
            s.bind((self.host, 0))
            return f"{self.host}:{s.getsockname()[1]}"

    def join(self, address: str) -> None:
        from datetime import timedelta

        import torch.distributed as dist

        from engine.tp.tensor_parallel import TPGroup

        cuda = self.cfg.model.resolved_device().startswith("cuda")
        dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://{address}", rank=self.rank,
                                world_size=self.size, timeout=timedelta(seconds=120))
        self._serve(self.cfg, self.role, self.node_id, self.host, TPGroup(self.rank, self.size))

    def address(self) -> str:
        """Rank 0: where the node serves; the others: '' (alive). Raises when the rank's loop has
        ended (a failed collective): the group must restart."""
        thread = getattr(getattr(self, "node", None), "_thread", None)
        if thread is None or not thread.is_alive():
            raise RuntimeError(f"{self.node_id} rank {self.rank}: its loop is not running")
        return f"{self.host}:{self.port}" if self.rank == 0 else ""
