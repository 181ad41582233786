"""Attention metadata for R rows of q tokens each (a decode/verify step, an MTP chain step).

    positions[r*q + j]   = start[r] + j
    slot_mapping[r*q+j]  = tables[r, min(p // bs, W-1)] * bs + p % bs    (p = positions[...]);
                           a masked row writes the trash block instead:  p % bs
    seq_lens[r]          = start[r] + q          keys of row r once this step has written
    query_start[r]       = r * q                 (R+1 entries)
    token_row, token_col = r, j                  (the torch reference backend's padded layout)

Shapes: tables [R, W] int64, start [R] int64, masked [R] bool or None; outputs int64.
One program per row; the torch version is ~20 launches, this is one (inside a CUDA graph
each launch costs ~2 us, a decode step has one of these per MTP chain step too).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous

TRASH_BLOCK = 0  # engine.attention.TRASH_BLOCK; kernels do not import the engine


@triton.jit
def _uniform_meta_kernel(tables_ptr, start_ptr, masked_ptr, pos_ptr, slot_ptr, seq_ptr, qstart_ptr,
                         row_ptr, col_ptr, W, stride_t, R,
                         Q: tl.constexpr, QB: tl.constexpr, BS: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    r = tl.program_id(0)
    j = tl.arange(0, QB)
    ok = j < Q
    start = tl.load(start_ptr + r)
    pos = start + j
    col = tl.minimum(pos // BS, W - 1)
    block = tl.load(tables_ptr + r * stride_t + col, mask=ok, other=0)
    slot = block * BS + pos % BS
    if HAS_MASK:
        masked = tl.load(masked_ptr + r)
        slot = tl.where(masked, pos % BS, slot)  # the trash block is block 0
    out = r * Q + j
    tl.store(pos_ptr + out, pos, mask=ok)
    tl.store(slot_ptr + out, slot, mask=ok)
    tl.store(row_ptr + out, tl.zeros_like(j).to(tl.int64) + r, mask=ok)
    tl.store(col_ptr + out, j.to(tl.int64), mask=ok)
    tl.store(seq_ptr + r, start + Q)
    tl.store(qstart_ptr + r, (r * Q).to(tl.int64))
    if r == R - 1:
        tl.store(qstart_ptr + R, ((r + 1) * Q).to(tl.int64))  # R may be specialized to a python int


Meta = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def uniform_meta_triton(tables: torch.Tensor, start: torch.Tensor, masked: torch.Tensor | None,
                        q: int, block_size: int) -> Meta:
    """(positions, slot_mapping, seq_lens, query_start, token_row, token_col)."""
    rows, width = tables.shape
    dev = tables.device
    pos, slots, row, col = (torch.empty(rows * q, dtype=torch.long, device=dev) for _ in range(4))
    seq = torch.empty(rows, dtype=torch.long, device=dev)
    qstart = torch.empty(rows + 1, dtype=torch.long, device=dev)
    if rows == 0:
        qstart.zero_()
        return pos, slots, seq, qstart, row, col
    _uniform_meta_kernel[(rows,)](
        tables, start, masked if masked is not None else start, pos, slots, seq, qstart, row, col,
        width, tables.stride(0), rows,
        Q=q, QB=triton.next_power_of_2(q), BS=block_size, HAS_MASK=masked is not None, num_warps=1, **pdl_args(tables),
    )
    return pos, slots, seq, qstart, row, col


def uniform_meta_ref(tables: torch.Tensor, start: torch.Tensor, masked: torch.Tensor | None,
                     q: int, block_size: int) -> Meta:
    rows, dev = tables.shape[0], tables.device
    positions = start.unsqueeze(1) + torch.arange(q, device=dev)  # [R, q]
    blocks = tables.gather(1, (positions // block_size).clamp(max=tables.shape[1] - 1))
    slots = blocks * block_size + positions % block_size
    if masked is not None:
        slots = torch.where(masked.unsqueeze(1), TRASH_BLOCK * block_size + positions % block_size, slots)
    return (positions.reshape(-1), slots.reshape(-1), positions[:, -1] + 1,
            torch.arange(0, (rows + 1) * q, q, device=dev),
            torch.arange(rows, device=dev).repeat_interleave(q), torch.arange(q, device=dev).repeat(rows))


def uniform_meta(tables: torch.Tensor, start: torch.Tensor, masked: torch.Tensor | None,
                 q: int, block_size: int) -> Meta:
    assert q >= 1, "every row has at least one token"
    if use_triton(tables, start):
        return uniform_meta_triton(tables, start, masked, q, block_size)
    return uniform_meta_ref(tables, start, masked, q, block_size)
