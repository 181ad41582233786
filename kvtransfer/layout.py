"""Which bytes make block b of layer l, and how runs of blocks coalesce.

A KV cache is a list with one entry per layer (the MTP layer is one more entry).
An entry is either one tensor or a sequence of tensors (e.g. separate K and V).
``block_dim`` names the dimension that indexes blocks in every tensor (one int for
all layers, or one per layer):

- ``[2, num_blocks, block_size, heads, head_dim]`` (K and V stacked): block_dim=1;
  the leading dims are split into *planes* (here two: K and V).
- ``[num_blocks, 2, block_size, heads, head_dim]`` (block-major): block_dim=0, one plane.
- ``(K, V)`` each ``[num_blocks, block_size, heads, head_dim]``: block_dim=0, two planes.

A plane is ``[num_blocks, ...]`` and must be contiguous, so block b of a plane is
``block_bytes`` bytes at offset ``b * block_bytes`` and a run of consecutive blocks
is one contiguous byte range. Any dtype works: bytes are moved, not values.

A transfer of one layer is one message per (run, plane), where a run is a stretch
of ``src_block_ids`` and ``dst_block_ids`` that are consecutive on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Run:
    """``count`` blocks starting at position ``index`` of the block lists."""

    index: int
    count: int


def coalesce(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Split positions 0..n-1 into maximal runs consecutive in both ``src`` and ``dst``."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks for {len(dst)} destination blocks")
    runs: list[Run] = []
    start = 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            runs.append(Run(start, i - start))
            start = i
    return runs if src else []


def _flat_bytes(plane: torch.Tensor) -> Any:
    flat = plane.reshape(-1).view(torch.uint8)
    return flat.numpy() if flat.device.type == "cpu" else flat


def _planes_of(tensor: torch.Tensor, block_dim: int) -> list[torch.Tensor]:
    if not 0 <= block_dim < tensor.dim():
        raise ValueError(f"block_dim {block_dim} out of range for shape {tuple(tensor.shape)}")
    lead = tensor.flatten(0, block_dim - 1) if block_dim > 0 else tensor.unsqueeze(0)
    planes = list(lead.unbind(0))
    for p in planes:
        if not p.is_contiguous():
            raise ValueError(
                f"a plane of shape {tuple(p.shape)} (from {tuple(tensor.shape)}, "
                f"block_dim={block_dim}) is not contiguous; blocks must be byte ranges"
            )
    return planes


class KVLayout:
    """The planes of every layer of one KV cache; see the module docstring."""

    def __init__(
        self,
        layers: Sequence[torch.Tensor | Sequence[torch.Tensor]],
        block_dim: int | Sequence[int] = 1,
    ) -> None:
        dims = [block_dim] * len(layers) if isinstance(block_dim, int) else list(block_dim)
        if len(dims) != len(layers):
            raise ValueError(f"{len(dims)} block_dims for {len(layers)} layers")
        self.planes: list[list[torch.Tensor]] = []
        for entry, dim in zip(layers, dims, strict=True):
            tensors = [entry] if isinstance(entry, torch.Tensor) else list(entry)
            self.planes.append([p for t in tensors for p in _planes_of(t, dim)])
        devices = {p.device for layer in self.planes for p in layer}
        if len(devices) > 1:
            raise ValueError(f"KV tensors span several devices: {sorted(map(str, devices))}")
        self.device = devices.pop() if devices else torch.device("cpu")
        # Per layer: each plane's bytes of one block, and each plane as one flat byte buffer
        # (a numpy array for host memory, which transports take as is): a run is a slice.
        self._block_bytes = [[p[0].numel() * p.element_size() for p in layer] for layer in self.planes]
        self.rebind()
        self._num_blocks = [min(p.shape[0] for p in layer) for layer in self.planes]

    def rebind(self) -> None:
        """Make the flat byte views again: after the planes' storages moved (into shared memory)."""
        self._flat = [[_flat_bytes(p) for p in layer] for layer in self.planes]
        self._bytes = [[p.reshape(-1).view(torch.uint8) for p in layer] for layer in self.planes]

    def plane_bytes(self, layer: int) -> list[torch.Tensor]:
        """Each plane of ``layer`` as one flat uint8 tensor (block b: ``b * block_bytes`` on)."""
        return self._bytes[layer]

    @property
    def num_layers(self) -> int:
        return len(self.planes)

    def num_blocks(self, layer: int) -> int:
        return self._num_blocks[layer]

    def block_bytes(self, layer: int) -> list[int]:
        """Bytes of one block in each plane of ``layer``."""
        return list(self._block_bytes[layer])

    def signature(self, layers: Sequence[int]) -> list[list[int]]:
        """Per-layer plane block sizes: two caches can exchange blocks iff equal."""
        return [self.block_bytes(layer) for layer in layers]

    def byte_ranges(self, layer: int, block: int) -> list[tuple[int, int, int]]:
        """``(plane, byte offset, nbytes)`` for each piece of block ``block`` of ``layer``."""
        return [(i, block * n, n) for i, n in enumerate(self.block_bytes(layer))]

    def run_views(self, layer: int, first_block: int, count: int) -> list[torch.Tensor]:
        """One flat uint8 view per plane covering blocks first_block..first_block+count-1."""
        return [torch.as_tensor(b) for b in self.run_buffers(layer, first_block, count)]

    def run_buffers(self, layer: int, first_block: int, count: int) -> list[Any]:
        """As ``run_views``, but host memory as numpy arrays (what transports take; ~20x
        cheaper to make than a torch view, which matters at one per message)."""
        if first_block < 0 or first_block + count > self._num_blocks[layer]:
            raise ValueError(f"blocks {first_block}+{count} outside 0..{self._num_blocks[layer] - 1}")
        return [f[first_block * n : (first_block + count) * n]
                for f, n in zip(self._flat[layer], self._block_bytes[layer], strict=True)]

    def check_blocks(self, layer: int, block_ids: Sequence[int]) -> None:
        """Raise ValueError unless every id is a block of ``layer``."""
        n = self.num_blocks(layer)
        if not block_ids or (0 <= min(block_ids) and max(block_ids) < n):
            return
        bad = [b for b in block_ids if not 0 <= b < n]
        if bad:
            raise ValueError(f"block ids {bad[:4]} outside 0..{n - 1} of layer {layer}")
