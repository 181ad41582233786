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
    "local": ("kvtransfer.local", "LocalSender", "LocalReceiver"),
}


def _cls(backend: str, which: int) -> Any:
    if backend not in BACKENDS:
        raise ValueError(f"unknown kvtransfer backend {backend!r}; have {sorted(BACKENDS)}")
    module, *names = BACKENDS[backend]
    return getattr(importlib.import_module(module), names[which])


def create_sender(backend: str, **options: Any) -> KVSender:
    sender: KVSender = _cls(backend, 0)(**options)
    return sender


def create_receiver(backend: str, **options: Any) -> KVReceiver:
    receiver: KVReceiver = _cls(backend, 1)(**options)
    return receiver
