"""A KV cache's memory opened by another process of the same host: the ``ipc`` backend's pool.

The receiver *exports* its cache once (``export``): per distinct storage an opening handle
(CUDA IPC, torch's ``_share_cuda_``; host memory: moved into shared memory, torch's
``_share_filename_cpu_``), and per layer and plane where its blocks start in which storage.
The sender *opens* that export once per receiver (``PeerPool.open``) and gets one flat byte
view per destination plane, in its own process: writing a run of blocks is a slice copy.

Careful:
- CUDA handles are opened in the sender's own device context, whatever GPU the memory lives
  on: CUDA maps another device's allocation there as peer memory (NVLink where the GPUs have
  it), also when that GPU is not visible to the sender (each Ray actor sees only its own).
- A CUDA allocation cannot be opened by the process that exported it; both ends in one
  process use the ``local`` backend.
- Moving host memory into shared memory replaces the storages' data pointers in place (every
  view follows), so the layout's cached byte views are rebuilt after it (``KVLayout.rebind``).
- Everything read from the export is validated before any view is made: a bad export cannot
  make the sender write outside the storages it names.
"""

from __future__ import annotations

import functools
import os
import socket
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtransfer.layout import KVLayout

MAX_STORAGES = 4096


@functools.cache
def host_id() -> str:
    """This host's identity: its name and boot id (a restarted host is another host)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"[:200]


def _handle(storage: torch.UntypedStorage) -> list[Any]:
    if storage.is_cuda:
        return list(storage._share_cuda_())
    return list(storage._share_filename_cpu_())


def export(layout: KVLayout) -> dict[str, Any]:
    """The fields of the ``pool`` message that lets a sender of this host open ``layout``.

    Host memory is moved into shared memory first (once; ``layout`` is rebound)."""
    storages: dict[int, tuple[int, torch.UntypedStorage]] = {}
    planes: list[list[list[int]]] = []
    for layer, tensors in enumerate(layout.planes):
        row: list[list[int]] = []
        for plane in tensors:
            storage = plane.untyped_storage()
            index = storages.setdefault(storage.data_ptr(), (len(storages), storage))[0]
            row.append([index, int(plane.storage_offset()) * plane.element_size(), layout.num_blocks(layer)])
        planes.append(row)
    handles = [_handle(s) for _, s in storages.values()]
    if layout.device.type == "cpu":
        layout.rebind()  # sharing moved the bytes
    return {"host": host_id(), "pid": os.getpid(), "mem": layout.device.type,
            "storages": handles, "planes": planes}


class PoolError(ValueError):
    """An export that cannot be opened here; the text says why."""


def _open_storage(handle: list[Any], device: torch.device) -> torch.UntypedStorage:
    try:
        if device.type == "cuda":
            dev, ipc, size, offset, ref, ref_offset, event, sync = handle
            del dev  # the exporter's index: mapped into our own device's context instead
            return torch.UntypedStorage._new_shared_cuda(
                device.index, ipc, size, offset, ref, ref_offset, event, sync)
        manager, name, size = handle
        return torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise PoolError(f"cannot open the receiver's KV memory: {type(exc).__name__}: {exc}") from None


@dataclass
class PeerPool:
    """One receiver's planes, opened in this process: ``planes[layer][plane]`` flat uint8."""

    planes: list[list[torch.Tensor]]
    block_bytes: list[list[int]]
    # The copier's address tables per set of layers: they live and die with the mapping.
    tables: dict[tuple[int, ...], Any] = field(default_factory=dict)

    @classmethod
    def open(cls, pool: dict[str, Any], local: KVLayout) -> PeerPool:
        """Open a validated ``pool`` message whose layout matches ``local`` plane for plane
        (the descriptor's signature was checked against ``local`` already)."""
        device = local.device
        if pool["host"] != host_id():
            raise PoolError(f"the receiver is on host {pool['host']!r}, this sender on {host_id()!r}: "
                            "the ipc backend needs both on one host (use ucx across hosts)")
        if pool["mem"] != device.type:
            raise PoolError(f"receiver KV in {pool['mem']} memory, sender's in {device.type}")
        if device.type == "cuda" and pool["pid"] == os.getpid():
            raise PoolError("sender and receiver share a process: use the local backend")
        if len(pool["planes"]) != local.num_layers or len(pool["storages"]) > MAX_STORAGES:
            raise PoolError(f"{len(pool['planes'])} layers exported, {local.num_layers} here")
        for i, row in enumerate(pool["planes"]):
            if len(row) != len(local.block_bytes(i)):
                raise PoolError(f"{len(row)} planes exported for a layer of {len(local.block_bytes(i))}")
        storages = [_open_storage(h, device) for h in pool["storages"]]
        planes = [cls._layer(storages, row, local.block_bytes(i), device)
                  for i, row in enumerate(pool["planes"])]
        return cls(planes, [local.block_bytes(i) for i in range(local.num_layers)])

    @staticmethod
    def _layer(storages: list[torch.UntypedStorage], row: list[list[int]], block_bytes: list[int],
               device: torch.device) -> list[torch.Tensor]:
        views = []
        for (index, offset, blocks), nbytes in zip(row, block_bytes, strict=True):
            if index >= len(storages) or offset + blocks * nbytes > storages[index].nbytes():
                raise PoolError(f"plane of {blocks} blocks at {offset} outside storage {index}")
            flat = torch.empty(0, dtype=torch.uint8, device=device)
            views.append(flat.set_(storages[index], offset, (blocks * nbytes,), (1,)))
        return views

    def check_blocks(self, blocks: list[int]) -> None:
        """IndexError unless every id is a block of every plane."""
        if blocks and (min(blocks) < 0 or max(blocks) >= self.num_blocks):
            raise IndexError(f"destination blocks outside the receiver's 0..{self.num_blocks - 1}")

    @functools.cached_property
    def num_blocks(self) -> int:
        return min(p.numel() // n for row, sizes in zip(self.planes, self.block_bytes, strict=True)
                   for p, n in zip(row, sizes, strict=True))
