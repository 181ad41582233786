"""Paged KV cache: the block manager (host integers only; reference counts and the prefix cache)
and the per-layer cache tensors.

Block 0 is the trash block (padding writes land there) and is never handed out. Every layer,
the MTP layer included, uses the same block ids for a request, so one block table serves all.
"""

from __future__ import annotations

import random
from collections import OrderedDict, deque

import torch

from engine.model.attention import TRASH_BLOCK


class OutOfBlocks(RuntimeError):
    pass


class BlockManager:
    """Free list of block ids with reference counts, and an optional prefix cache.

    Not thread-safe: one owner (the scheduler) calls it. A block handed out by `allocate` has
    one reference; `acquire_cached` adds one per request that shares a cached block; `free`
    drops one and returns the block when none is left.

    Prefix cache: a full block whose KV is computed may be `register`ed under its hash (a hash
    chain of its tokens and every token before it: engine/cache/prefix_cache.py). When its last
    reference goes it stays cached and *evictable*: counted in `num_free`, found by `match`, and
    evicted (least recently freed first) only when `allocate` has no never-cached block left.
    So a block in use is never evicted, and `num_free` returns to `capacity` when every request
    has ended, cached blocks or not (`clear_cache` forgets the evictable ones).
    """

    def __init__(self, num_blocks: int, block_size: int, shuffle_seed: int | None = None) -> None:
        if num_blocks < 2:
            raise ValueError("need at least 2 KV blocks (block 0 is reserved)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        ids = [b for b in range(num_blocks) if b != TRASH_BLOCK]
        if shuffle_seed is not None:  # scattered block ids, used by tests
            random.Random(shuffle_seed).shuffle(ids)
        self._free: deque[int] = deque(ids)  # never cached (or forgotten)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; LRU first
        self._refs: dict[int, int] = {}  # block in use -> references
        self._hash_of: dict[int, bytes] = {}
        self._block_of: dict[bytes, int] = {}
        self.evictions = 0
        self.num_shared = 0  # blocks in use by more than one reference (prefix hits, n > 1 choices)

    @property
    def num_free(self) -> int:
        """Blocks `allocate` can hand out now (evictable cached ones included)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def refcount(self, block: int) -> int:
        return self._refs.get(block, 0)

    def allocate(self, n: int) -> list[int]:
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} KV blocks, {self.num_free} free")
        out = [self._take() for _ in range(n)]
        for b in out:
            self._refs[b] = 1
        return out

    def _take(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._block_of[self._hash_of.pop(block)]
        self.evictions += 1
        return block

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; the last one returns it (cached: evictable).
        A request's later blocks become evictable first (freed in reverse)."""
        cached = []
        for b in blocks:
            refs = self._refs.get(b)
            if refs is None:
                raise ValueError(f"double free of KV block {b}")
            if refs > 1:
                self._refs[b] = refs - 1
                self.num_shared -= refs == 2
            elif b in self._hash_of:
                del self._refs[b]
                cached.append(b)
            else:
                del self._refs[b]
                self._free.append(b)
        for b in reversed(cached):
            self._evictable[b] = None

    # ---- prefix cache ------------------------------------------------------------------
    def match(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest cached prefix of `hashes` (no reference taken)."""
        out = []
        for h in hashes:
            block = self._block_of.get(h)
            if block is None:
                break
            out.append(block)
        return out

    def can_allocate(self, cached: list[int], n: int) -> bool:
        """Whether `allocate_after(cached, n)` would succeed."""
        revived = sum(1 for b in cached if b in self._evictable)
        return n + revived <= self.num_free

    def allocate_after(self, cached: list[int], n: int) -> list[int]:
        """`cached` (a `match` result, one reference more each) followed by `n` new blocks."""
        if not self.can_allocate(cached, n):
            raise OutOfBlocks(f"need {n} KV blocks after {len(cached)} cached, {self.num_free} free")
        for b in cached:
            if b in self._evictable:
                del self._evictable[b]
            self._refs[b] = self._refs.get(b, 0) + 1
            self.num_shared += self._refs[b] == 2
        return cached + self.allocate(n)

    def register(self, block: int, h: bytes) -> bool:
        """Cache `block` (in use, its KV computed) under `h`; False when `h` or `block` is cached already."""
        if block not in self._refs:
            raise ValueError(f"KV block {block} is not in use; only computed blocks can be cached")
        if h in self._block_of or block in self._hash_of:
            return False
        self._block_of[h] = block
        self._hash_of[block] = h
        return True

    def clear_cache(self) -> int:
        """Forget every evictable cached block (they become plain free blocks); returns how many.
        Cached blocks in use stay cached."""
        n = len(self._evictable)
        for b in self._evictable:
            del self._block_of[self._hash_of.pop(b)]
            self._free.append(b)
        self._evictable.clear()
        return n


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
