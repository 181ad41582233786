"""The process's UCX: its loop thread and ``Driver``, started once on first use; restricting it
to loopback for a local service (before it starts); binding the threads that touch CUDA memory
to the device; a raw send for tests."""

from __future__ import annotations

import ipaddress
import os
import threading

import numpy as np
import torch

from kvtransfer.loop import LoopThread
from kvtransfer.ucx.worker import Driver

_runtime: LoopThread | None = None
_driver: Driver | None = None
_runtime_lock = threading.Lock()


def restrict_to_loopback(host: str) -> bool:
    """For a local service (``host`` a loopback address): make this process's UCX use only the
    loopback network device, so its TCP listeners do not bind the machine's outward addresses
    (shared memory and CUDA IPC are not network devices and stay). Must run before the first
    UcxSender/UcxReceiver of the process (UCX reads it when its context is made); an explicit
    ``UCX_NET_DEVICES`` wins. Other hosts are left alone: limiting UCX to one IP interface
    would also turn off RDMA devices. Returns whether it restricted."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback or "UCX_NET_DEVICES" in os.environ:
        return False
    with _runtime_lock:
        if _runtime is not None:
            raise RuntimeError("restrict_to_loopback() after UCX started in this process")
        os.environ["UCX_NET_DEVICES"] = "lo"
    return True


def runtime() -> LoopThread:
    """The process's ucxx loop thread, started on first use."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            rt = LoopThread("kv-ucx")
            rt.submit(_start_driver()).result(timeout=60)
            _runtime = rt
    return _runtime


def driver() -> Driver:
    runtime()
    assert _driver is not None
    return _driver


async def _start_driver() -> None:
    global _driver
    _driver = Driver()


async def send_raw(addr: bytes, tag: int, payload: bytes) -> None:
    """Send ``payload`` as-is to a worker's tag (runs on the runtime loop; for tests)."""
    drv = driver()
    await drv.send_future(drv.endpoint(addr), np.frombuffer(payload, np.uint8), tag)


def bind_device(thread: LoopThread, device: torch.device) -> None:
    """CUDA memory: the progressing (loop) thread needs the device's context current."""
    if device.type == "cuda":
        thread.submit(_set_device(device)).result(timeout=60)


async def _set_device(device: torch.device) -> None:
    _bind(device)
    for lane in driver().lanes():  # a lane's thread pulls (CUDA IPC) into this device's memory
        lane.call(lambda: _bind(device))


def _bind(device: torch.device) -> None:
    torch.cuda.set_device(device)
    torch.empty(1, device=device)  # creates the primary context if not yet there
