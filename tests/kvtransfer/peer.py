"""A second process for the two-process tests: a receiver or sender driven over a pipe.

The parent sends msgpack commands with ``Connection.send_bytes`` (nothing pickled
crosses the pipe but the spawn arguments) and gets one msgpack reply per command.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import torch

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def make_cache(num_blocks: int, seed: int | None, block_size: int = 4) -> tuple[list[Any], list[int]]:
    """Four layers, every dtype and three layouts: stacked K/V, block-major, separate K/V.

    The last layer stands for the MTP layer. ``seed=None`` gives zeros (a destination).
    """
    g = torch.Generator().manual_seed(seed or 0)

    def t(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        x = torch.randn(*shape, generator=g) * 100 if seed is not None else torch.zeros(*shape)
        return x.to(dtype)

    layers: list[Any] = [
        t(2, num_blocks, block_size, 2, 8, dtype=torch.float32),  # [2, N, bs, h, d]
        t(num_blocks, 2, block_size, 2, 8, dtype=torch.bfloat16),  # [N, 2, bs, h, d]
        (t(num_blocks, block_size, 2, 8, dtype=torch.float16),  # (K, V)
         t(num_blocks, block_size, 2, 8, dtype=torch.float16)),
        t(2, num_blocks, block_size, 1, 8, dtype=torch.bfloat16),  # MTP layer
    ]
    return layers, [1, 0, 0, 1]


def block_bytes(layers: list[Any], dims: list[int], layer: int, blocks: list[int]) -> bytes:
    """The bytes of ``blocks`` of ``layer``, plane by plane (for comparing caches)."""
    from kvtransfer.layout import KVLayout

    layout = KVLayout(layers, dims)
    out = b""
    for b in blocks:
        for view in layout.run_views(layer, b, 1):
            out += view.numpy().tobytes()
    return out


class Peer:
    """Handle on a child process running ``serve(role, backend, ...)``."""

    def __init__(self, role: str, backend: str, num_blocks: int, timeout_s: float, seed: int | None) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=serve, args=(child, role, backend, num_blocks, timeout_s, seed), daemon=True
        )
        self.proc.start()
        assert self.call("ping") == "pong"

    def call(self, op: str, **args: Any) -> Any:
        self.conn.send_bytes(msgpack.packb({"op": op, **args}, use_bin_type=True))
        if not self.conn.poll(60):
            raise TimeoutError(f"peer did not answer {op}")
        reply = msgpack.unpackb(self.conn.recv_bytes(), raw=False)
        if "error" in reply:
            raise RuntimeError(f"peer {op}: {reply['error']}")
        return reply["ok"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(10)

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("exit")
            except (OSError, EOFError, TimeoutError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.kill()


def serve(conn: Connection, role: str, backend: str, num_blocks: int, timeout_s: float,
          seed: int | None) -> None:
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    from kvtransfer import KVLayout, create_receiver, create_sender

    layers, dims = make_cache(num_blocks, seed)
    end: Any = None
    if role in ("sender", "receiver"):
        end = (create_sender if role == "sender" else create_receiver)(backend, timeout_s=timeout_s)
        end.register(KVLayout(layers, dims))
    while True:
        cmd = msgpack.unpackb(conn.recv_bytes(), raw=False)
        if cmd["op"] == "exit":
            conn.send_bytes(msgpack.packb({"ok": None}))
            return
        try:
            result = _handle(end, layers, dims, cmd)
            conn.send_bytes(msgpack.packb({"ok": result}, use_bin_type=True))
        except Exception as exc:
            conn.send_bytes(msgpack.packb({"error": f"{type(exc).__name__}: {exc}"}))


def _handle(end: Any, layers: list[Any], dims: list[int], cmd: dict[str, Any]) -> Any:
    op = cmd.pop("op")
    if op == "ping":
        return "pong"
    if op in ("wait", "poll"):
        status = end.wait(cmd["rid"], cmd.get("timeout", 30)) if op == "wait" else end.poll(cmd["rid"])
        return [status.state.value, status.reason]
    if op == "dump":
        return block_bytes(layers, dims, cmd["layer"], cmd["blocks"])
    if op == "raw_ucx":
        return _raw_ucx(cmd["addr"], cmd["tag"], cmd["payload"])
    if op == "errors":
        return list(end.errors)
    if op == "held":
        return end.held()
    if op == "send_layers":
        for layer in cmd["layers"]:
            end.send_layer(cmd["rid"], layer, cmd["blocks"])
        return None
    return getattr(end, op)(**cmd)


def _raw_ucx(addr: bytes, tag: int, payload: bytes) -> None:
    """Send ``payload`` as-is to a ucx worker's tag, as a misbehaving peer would."""
    from kvtransfer import ucx

    ucx.runtime().submit(ucx.send_raw(addr, tag, payload)).result(timeout=30)
