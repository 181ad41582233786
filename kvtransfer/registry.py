"""Backends by name. ``create_sender("ucx", timeout_s=5)`` imports only what it needs.

Each backend module defines one StreamingSender and one StreamingReceiver subclass;
their constructor keywords are the backend's options (e.g. tcp ``host``/``port``).
"""

from __future__ import annotations

import importlib
from typing import Any

from kvtransfer.base import KVReceiver, KVSender

BACKENDS: dict[str, tuple[str, str, str]] = {
    "ucx": ("kvtransfer.ucx", "UcxSender", "UcxReceiver"),
    "tcp": ("kvtransfer.tcp", "TcpSender", "TcpReceiver"),
    "ipc": ("kvtransfer.ipc", "IpcSender", "IpcReceiver"),
    "local": ("kvtransfer.local", "LocalSender", "LocalReceiver"),
}


def _cls(backend: str, which: int) -> Any:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kvtransfer backend {backend!r}; have {sorted(BACKENDS)}")
    module, *names = BACKENDS[backend]
    try:
        return getattr(importlib.import_module(module), names[which])
    except ModuleNotFoundError as e:
        if backend != "ucx" or e.name is None or not e.name.startswith("ucxx"):
            raise
        raise ModuleNotFoundError(UCX_MISSING) from e


# ucxx's wheels are built per CUDA major version, so the runtime install names none (pyproject.toml)
UCX_MISSING = ("the ucx KV backend needs ucxx: pip install 'pdserve[ucx-cu12]' or 'pdserve[ucx-cu13]', "
               "the one matching the CUDA major version `nvidia-smi` prints (or use kv_transfer.backend=tcp)")


def create_sender(backend: str, faults: dict[str, Any] | None = None, **options: Any) -> KVSender:
    """A sender of `backend`; `faults` (fault drills only: kvtransfer/faults.py) makes its links
    drop, delay, duplicate or truncate messages with the given probabilities."""
    sender: KVSender = _cls(backend, 0)(**options)
    if faults:
        from kvtransfer.faults import Faults, with_faults

        spec = Faults(**faults)
        if spec.any:
            sender = with_faults(sender, spec)
    return sender


def create_receiver(backend: str, **options: Any) -> KVReceiver:
    receiver: KVReceiver = _cls(backend, 1)(**options)
    return receiver
