"""Copy KV blocks between two caches, every layer and plane of a request in one launch.

A KV transfer between GPUs of one host (kvtransfer/ipc.py) writes the request's blocks from the
prefill node's cache into the decode node's, which is mapped into the sender's process. With
one copy call per layer, plane and run of blocks, the host's cost per transfer grows with the
layer count (tens of calls per request); this kernel takes the planes as tables of addresses
and the two block lists as tensors, so a transfer is one launch whatever its shape.

Shapes: ``src_ptrs``/``dst_ptrs`` int64 ``[P]``, the address of block 0 of each plane (P =
layers x planes); ``src_blocks``/``dst_blocks`` int32 ``[B]``; every plane's blocks are
``block_bytes`` apart and ``block_bytes`` long, a multiple of 16. Program (p, b, c) moves the c-th
chunk of ``CHUNK`` 16-byte words of block b in plane p. Addresses in the tables may point into
another device's memory (peer-mapped): the stores then cross NVLink.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

WORD = 16  # bytes a thread moves per access (two int64)
CHUNK = 512  # words a program moves: 8 KiB


@triton.jit
def _block_copy_kernel(src_ptrs, dst_ptrs, src_blocks, dst_blocks, words, CHUNK: tl.constexpr):
    plane, block, chunk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    src = tl.load(src_ptrs + plane).to(tl.pointer_type(tl.int64))
    dst = tl.load(dst_ptrs + plane).to(tl.pointer_type(tl.int64))
    # Every block starts 16-byte aligned: said, so the accesses are 16 bytes wide.
    s = tl.multiple_of(src + tl.load(src_blocks + block).to(tl.int64) * words * 2, 16)
    d = tl.multiple_of(dst + tl.load(dst_blocks + block).to(tl.int64) * words * 2, 16)
    offs = chunk * CHUNK * 2 + tl.arange(0, CHUNK * 2)
    mask = offs < words * 2
    tl.store(d + offs, tl.load(s + offs, mask=mask), mask=mask)


def copy_blocks(src_ptrs: torch.Tensor, dst_ptrs: torch.Tensor, src_blocks: torch.Tensor,
                dst_blocks: torch.Tensor, block_bytes: int) -> None:
    """For every plane p and position i: block ``dst_blocks[i]`` of plane ``dst_ptrs[p]`` gets
    block ``src_blocks[i]`` of plane ``src_ptrs[p]``. All four tensors on the launching device;
    queued on the current stream, never syncs."""
    if block_bytes % WORD:
        raise ValueError(f"block_bytes {block_bytes} is not a multiple of {WORD}")
    words = block_bytes // WORD
    grid = (src_ptrs.numel(), src_blocks.numel(), triton.cdiv(words, CHUNK))
    if 0 not in grid:
        _block_copy_kernel[grid](src_ptrs, dst_ptrs, src_blocks, dst_blocks, words, CHUNK=CHUNK)


def warm_up(scratch: torch.Tensor, block_bytes: int) -> None:
    """Compile and load the kernel for blocks of ``block_bytes`` before a transfer needs it: copies
    block 0 of ``scratch`` (two blocks, flat uint8) onto its block 1, once per alignment
    of the arguments. Triton compiles one kernel per 16-byte alignment of each pointer argument,
    and a transfer's table or block list sliced after an odd count is 8 bytes off. Queued on the
    current stream; ``scratch`` must live until it ran."""
    base = scratch.data_ptr()
    for planes, blocks in ((1, 1), (1, 2), (2, 1), (2, 2)):
        table = torch.tensor([base] * planes + [base + block_bytes] * planes, dtype=torch.int64,
                             device=scratch.device)
        ids = torch.zeros(2 * blocks, dtype=torch.int64, device=scratch.device)  # block 0 of either plane
        copy_blocks(table[:planes], table[planes:], ids[:blocks], ids[blocks:], block_bytes)


def copy_blocks_reference(src: list[torch.Tensor], dst: list[torch.Tensor], src_blocks: list[int],
                          dst_blocks: list[int], block_bytes: int) -> None:
    """``copy_blocks`` over flat uint8 planes given as tensors (what the tables point at)."""
    for s, d in zip(src, dst, strict=True):
        rows_s, rows_d = s.view(-1, block_bytes), d.view(-1, block_bytes)
        rows_d[torch.tensor(dst_blocks, dtype=torch.long)] = rows_s[torch.tensor(src_blocks, dtype=torch.long)]
