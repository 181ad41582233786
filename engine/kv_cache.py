"""Paged KV cache: the block manager (host integers only) and the per-layer cache tensors.

Block 0 is the trash block (padding writes land there) and is never handed out. Every layer,
the MTP layer included, uses the same block ids for a request, so one block table serves all.
"""

from __future__ import annotations

import random
from collections import deque

import torch

from engine.attention import TRASH_BLOCK


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    """Free list of block ids. Not thread-safe: one owner (the scheduler) calls it."""

    def __init__(self, num_blocks: int, block_size: int, shuffle_seed: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        ids = [b for b in range(num_blocks) if b != TRASH_BLOCK]
        if shuffle_seed is not None:  # scattered block ids, used by tests
            random.Random(shuffle_seed).shuffle(ids)
        self._free: deque[int] = deque(ids)
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfBlocks(f"need {n} KV blocks, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"double free of KV block {b}")
            self._used.remove(b)
            self._free.append(b)


class KVCache:
    """Per-layer tensors [2, num_blocks, block_size, kv_heads, head_dim]; the MTP layer is last."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
        self.layers = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.block_size = block_size
        self.num_blocks = num_blocks

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * elem
