"""Attention metadata of a prefill step, built on the device from a few per-row integers.

A prefill step holds R rows (prompt chunks) of q_len[r] = query_start[r+1] - query_start[r]
tokens each (0 allowed: padding rows), flattened into T >= query_start[R] tokens (the rest are
padding, so that one CUDA graph serves every step of up to T tokens). Row r's chunk starts at
position start[r]. For token t = query_start[r] + j of row r:

    positions[t]    = start[r] + j
    slot_mapping[t] = tables[r, min(p // bs, W-1)] * bs + p % bs        (p = positions[t])
    token_row[t], token_col[t] = r, j
    next_ids[t]     = ids[t + 1] if j < q_len[r] - 1 else row_next[r]   (the MTP layer's input)
    seq_lens[r]     = start[r] + q_len[r]
    last_idx[r]     = clamp(query_start[r+1] - 1, 0, T - 1)             (the row's last token)
    put_idx[r]      = query_start[r+1] - 1 if is_last[r] else T         (where its first token goes
                                                                          in next_ids; T: scratch)
Padding tokens t >= query_start[R]: position 0, a slot in the trash block (t % bs), row R (no
row: the torch reference backend cannot take them), column 0, next id 0; next_ids[T] = 0.

Shapes: ids [T], query_start [R+1], start, row_next, is_last [R], tables [R, W]; all int64.
Outputs int64: positions, slot_mapping, token_row, token_col [T]; next_ids [T+1]; seq_lens,
last_idx, put_idx [R]. One program per row plus one for the padding: a single launch, nothing
read on the host, so it sits inside the prefill step's CUDA graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous

_TILE = 128


class PrefillMeta(NamedTuple):
    positions: torch.Tensor
    slot_mapping: torch.Tensor
    token_row: torch.Tensor
    token_col: torch.Tensor
    next_ids: torch.Tensor
    seq_lens: torch.Tensor
    last_idx: torch.Tensor
    put_idx: torch.Tensor


@triton.jit
def _prefill_meta_kernel(ids_ptr, qstart_ptr, start_ptr, tables_ptr, row_next_ptr, is_last_ptr,
                         pos_ptr, slot_ptr, row_ptr, col_ptr, next_ptr, seq_ptr, last_ptr, put_ptr,
                         T, R, W, stride_t, BS: tl.constexpr, TILE: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    r = tl.program_id(0)
    j = tl.arange(0, TILE)
    zero = tl.zeros([TILE], dtype=tl.int64)
    if r == R:  # the padding tokens, and the scratch entry of next_ids
        lo = tl.load(qstart_ptr + R)
        for off in range(lo, T, TILE):
            t = off + j
            ok = t < T
            tl.store(pos_ptr + t, zero, mask=ok)
            tl.store(slot_ptr + t, (t % BS).to(tl.int64), mask=ok)
            tl.store(row_ptr + t, zero + R, mask=ok)
            tl.store(col_ptr + t, zero, mask=ok)
            tl.store(next_ptr + t, zero, mask=ok)
        tl.store(next_ptr + T, tl.zeros([], dtype=tl.int64))
    else:
        q0 = tl.load(qstart_ptr + r)
        q1 = tl.load(qstart_ptr + r + 1)
        start = tl.load(start_ptr + r)
        q_len = q1 - q0
        row_next = tl.load(row_next_ptr + r)
        for off in range(0, q_len, TILE):
            jj = off + j
            ok = jj < q_len
            t = q0 + jj
            pos = start + jj
            block = tl.load(tables_ptr + r * stride_t + tl.minimum(pos // BS, W - 1), mask=ok, other=0)
            tl.store(pos_ptr + t, pos, mask=ok)
            tl.store(slot_ptr + t, block * BS + pos % BS, mask=ok)
            tl.store(row_ptr + t, zero + r, mask=ok)
            tl.store(col_ptr + t, jj.to(tl.int64), mask=ok)
            nxt = tl.load(ids_ptr + t + 1, mask=ok & (jj < q_len - 1), other=0)
            tl.store(next_ptr + t, tl.where(jj == q_len - 1, row_next, nxt), mask=ok)
        tl.store(seq_ptr + r, start + q_len)
        tl.store(last_ptr + r, tl.minimum(tl.maximum(q1 - 1, 0), T - 1))
        last = tl.load(is_last_ptr + r) != 0
        tl.store(put_ptr + r, tl.where(last, q1 - 1, T))


def _outputs(t: int, r: int, device: torch.device) -> PrefillMeta:
    e = lambda n: torch.empty(n, dtype=torch.long, device=device)  # noqa: E731
    return PrefillMeta(e(t), e(t), e(t), e(t), e(t + 1), e(r), e(r), e(r))


def prefill_meta_triton(ids, query_start, start, tables, row_next, is_last, block_size: int) -> PrefillMeta:
    (t,), (r, w) = ids.shape, tables.shape
    out = _outputs(t, r, ids.device)
    _prefill_meta_kernel[(r + 1,)](
        ids, query_start, start, tables, row_next, is_last, *out, t, r, w, tables.stride(0),
        BS=block_size, TILE=_TILE, num_warps=4, **pdl_args(ids))
    return out


def prefill_meta_ref(ids, query_start, start, tables, row_next, is_last, block_size: int) -> PrefillMeta:
    """The same in torch, without reading any tensor on the host."""
    (t,), (r, w) = ids.shape, tables.shape
    dev = ids.device
    tok = torch.arange(t, device=dev)
    row = torch.searchsorted(query_start[1:], tok, right=True)  # R for padding tokens
    real = row < r
    rc = row.clamp(max=max(r - 1, 0))
    col = torch.where(real, tok - query_start[rc], 0) if r else torch.zeros_like(tok)
    pos = torch.where(real, start[rc] + col, 0) if r else torch.zeros_like(tok)
    block = tables[rc, (pos // block_size).clamp(max=w - 1)] if r else torch.zeros_like(tok)
    slot = torch.where(real, block * block_size + pos % block_size, tok % block_size)
    q_len = query_start[1:] - query_start[:-1]
    last_of_row = real & (col == (q_len[rc] - 1 if r else 0))
    following = torch.cat([ids[1:], ids.new_zeros(1)])
    nxt = torch.where(last_of_row, row_next[rc] if r else 0, following)
    nxt = torch.cat([torch.where(real, nxt, 0), ids.new_zeros(1)])
    last_idx = (query_start[1:] - 1).clamp(0, max(t - 1, 0))
    put = torch.where(is_last != 0, query_start[1:] - 1, t)
    return PrefillMeta(pos, slot, torch.where(real, row, r), col, nxt, start + q_len, last_idx, put)


def prefill_meta(ids, query_start, start, tables, row_next, is_last, block_size: int) -> PrefillMeta:
    """The step's metadata (module docstring): one Triton launch on CUDA, torch elsewhere."""
    args = (ids, query_start, start, tables, row_next, is_last)
    fn = prefill_meta_triton if use_triton(*args) else prefill_meta_ref
    return fn(*args, block_size)
