"""The all-reduce of a TP group's row-parallel layers on GPUs: one-shot, through symmetric memory.

A decode step of a TP model does two all-reduces a layer of a few KiB each (batch x hidden),
so their latency, not bandwidth, sets the cost: NCCL's ring takes ~10-20 us for such a
message. PyTorch's symmetric memory (`torch.distributed._symmetric_memory`) maps each rank's
buffer into every rank's address space over NVLink; its `one_shot_all_reduce_copy_out` op
copies the local partial sums into this rank's buffer, meets the other ranks at a barrier of
signal flags, reads every rank's buffer and sums them in rank order (the same order on every
rank, so every rank holds the same bits, as the engine needs), all in one kernel. Its
pointers are fixed at set-up, so it runs inside the decode step's CUDA graph.

`SymmAllReduce(tp, device, dtype)` owns one buffer of `MAX_BYTES`; a message larger than
that (a long prefill chunk), of another dtype, or not 16-byte aligned goes to NCCL, as on CPU
(gloo). `choose(device, size)` says which path a group takes: symm on CUDA for 2, 4 or 8
ranks, unless `settings.TP_ALLREDUCE` is 'nccl' (for a host whose GPUs share no NVLink, and for side-by-side timing).

Careful when editing: every rank must take the same path for each call (the choice depends
only on the tensor's shape and dtype, which every rank shares), or the ranks deadlock.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import settings

MAX_BYTES = 8 << 20  # 8 MiB: a decode step of 256 rows x 8192 hidden in bf16 and more
SIZES = (2, 4, 8)  # the group sizes the one-shot kernel is built for


def choose(device: torch.device, size: int, path: str | None = None) -> str:
    """'symm' or 'nccl' (on CPU 'gloo') for a group of `size` ranks on `device`; `path`: the
    choice asked for ('symm' or 'nccl'; None: `settings.TP_ALLREDUCE`)."""
    path = settings.TP_ALLREDUCE if path is None else settings.parse_allreduce(path)
    if device.type != "cuda":
        return "gloo"
    return "symm" if path != "nccl" and size in SIZES else "nccl"


class SymmAllReduce:
    """In-place sum over the group through a symmetric buffer (one-shot); see the module doc."""

    def __init__(self, group: Any, device: torch.device, dtype: torch.dtype) -> None:
        import torch.distributed._symmetric_memory as symm

        group = group if group is not None else dist.group.WORLD
        if getattr(symm, "get_backend", lambda _: "")(device) is None:
            symm.set_backend("CUDA")  # peer-mapped CUDA memory (not NVSHMEM: nothing more is needed)
        self.dtype = dtype
        self.buffer = symm.empty(MAX_BYTES // torch.finfo(dtype).bits * 8, dtype=dtype, device=device)
        symm.rendezvous(self.buffer, group)  # a collective: every rank of the group makes one
        self.group_name = group.group_name

    def accepts(self, x: torch.Tensor) -> bool:
        nbytes, offset = x.numel() * x.element_size(), x.storage_offset() * x.element_size()
        return (x.dtype == self.dtype and x.is_contiguous() and 0 < nbytes <= MAX_BYTES
                and nbytes % 16 == 0 and offset % 16 == 0)  # the op wants like alignment on both sides

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, written into `x` (which `accepts`)."""
        staging = self.buffer[: x.numel()].view(x.shape)
        return torch.ops.symm_mem.one_shot_all_reduce_copy_out(staging, x, "sum", self.group_name, x)


def make(group: Any, size: int, device: torch.device, dtype: torch.dtype) -> SymmAllReduce | None:
    """The group's symmetric all-reduce, or None where NCCL / gloo serve (see `choose`)."""
    if size == 1 or choose(device, size) != "symm" or not hasattr(torch.ops.symm_mem, "one_shot_all_reduce_copy_out"):
        return None  # (a torch without the op: NCCL; every rank runs the same torch)
    return SymmAllReduce(group, device, dtype)
