"""The decode step's inputs and attention metadata, each built by one kernel launch.

`uniform_meta`: attention metadata for R rows of q tokens each (a decode/verify step, an MTP
chain step), the rows starting at `start[r] + offset`:

    positions[r*q + j]   = start[r] + offset + j
    slot_mapping[r*q+j]  = tables[r, min(p // bs, W-1)] * bs + p % bs    (p = positions[...]);
                           a masked row writes the trash block instead:  p % bs
    seq_lens[r]          = p_last + 1            keys of row r once this step has written
    query_start[r]       = r * q                 (R+1 entries)
    token_row, token_col = r, j                  (the torch reference backend's padded layout)

`step_inputs`: what a decode step reads of the batch state for state rows `rows` [R], and the
metadata of its k+1 verify tokens per row, in one launch where torch takes ~11 (nine gathers,
a cat and the metadata):

    input_ids[r*q + j]     = last_token[rows[r]] (j = 0), drafts[rows[r], j-1] (j >= 1)
    seq, done, tables, temperature, top_k, top_p, seed [r] = the state's at rows[r]
    meta                   = uniform_meta(tables, seq, done, q)

Shapes: tables [R, W] int64, start [R] int64, masked [R] bool or None; outputs int64 but for the
state's own dtypes (done bool, temperature and top_p fp32). One program per row; inside a CUDA
graph each launch costs ~2 us, and a decode step has one of these per MTP chain step too.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous

TRASH_BLOCK = 0  # engine.model.attention.TRASH_BLOCK; kernels do not import the engine

Meta = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class StepState(NamedTuple):
    """The per-slot state tensors a decode step reads (engine.runner.batch_state.BatchState's)."""

    seq_lens: torch.Tensor  # [S] int64
    done: torch.Tensor  # [S] bool
    last_token: torch.Tensor  # [S] int64
    drafts: torch.Tensor  # [S, k] int64
    block_tables: torch.Tensor  # [S, W] int64
    temperature: torch.Tensor  # [S] fp32
    top_k: torch.Tensor  # [S] int64
    top_p: torch.Tensor  # [S] fp32
    seed: torch.Tensor  # [S] int64


class StepInputs(NamedTuple):
    """`step_state`'s rows for one step: the model's input ids [R*q], and `meta` (uniform_meta's)."""

    input_ids: torch.Tensor
    seq: torch.Tensor
    done: torch.Tensor
    tables: torch.Tensor
    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    seed: torch.Tensor
    meta: Meta


@triton.jit
def _write_meta(r, start, masked, table_row, W, pos_ptr, slot_ptr, seq_ptr, qstart_ptr, row_ptr, col_ptr, R,
                Q: tl.constexpr, QB: tl.constexpr, BS: tl.constexpr, HAS_MASK: tl.constexpr):
    """Row r's metadata: its q positions from `start`, read through its block table row."""
    j = tl.arange(0, QB)
    ok = j < Q
    pos = start + j
    col = tl.minimum(pos // BS, W - 1)
    block = tl.load(table_row + col, mask=ok, other=0)
    slot = block * BS + pos % BS
    if HAS_MASK:
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


@triton.jit
def _uniform_meta_kernel(tables_ptr, start_ptr, masked_ptr, pos_ptr, slot_ptr, seq_ptr, qstart_ptr,
                         row_ptr, col_ptr, W, stride_t, R, offset,
                         Q: tl.constexpr, QB: tl.constexpr, BS: tl.constexpr, HAS_MASK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    r = tl.program_id(0)
    start = tl.load(start_ptr + r) + offset
    masked = tl.load(masked_ptr + r)  # `start` again when there is no mask: not used
    _write_meta(r, start, masked, tables_ptr + r * stride_t, W, pos_ptr, slot_ptr, seq_ptr, qstart_ptr,
                row_ptr, col_ptr, R, Q, QB, BS, HAS_MASK)


@triton.jit
def _step_inputs_kernel(rows_ptr, seq_ptr, done_ptr, last_ptr, drafts_ptr, tables_ptr, temp_ptr, topk_ptr, topp_ptr,
                        seed_ptr, ids_out, seq_out, done_out, tables_out, temp_out, topk_out, topp_out, seed_out,
                        pos_ptr, slot_ptr, mseq_ptr, qstart_ptr, row_ptr, col_ptr, W, stride_t, R,
                        Q: tl.constexpr, QB: tl.constexpr, WB: tl.constexpr, BS: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    r = tl.program_id(0)
    row = tl.load(rows_ptr + r)
    seq = tl.load(seq_ptr + row)
    done = tl.load(done_ptr + row)
    tl.store(seq_out + r, seq)
    tl.store(done_out + r, done)
    tl.store(temp_out + r, tl.load(temp_ptr + row))
    tl.store(topk_out + r, tl.load(topk_ptr + row))
    tl.store(topp_out + r, tl.load(topp_ptr + row))
    tl.store(seed_out + r, tl.load(seed_ptr + row))
    j = tl.arange(0, QB)
    drafts = tl.load(drafts_ptr + row * (Q - 1) + j - 1, mask=(j >= 1) & (j < Q), other=0)
    tl.store(ids_out + r * Q + j, tl.where(j == 0, tl.load(last_ptr + row), drafts), mask=j < Q)
    table_row = tables_ptr + row * stride_t
    for c0 in range(0, W, WB):
        c = c0 + tl.arange(0, WB)
        tl.store(tables_out + r * W + c, tl.load(table_row + c, mask=c < W), mask=c < W)
    _write_meta(r, seq, done, table_row, W, pos_ptr, slot_ptr, mseq_ptr, qstart_ptr, row_ptr, col_ptr, R,
                Q, QB, BS, True)


def _meta_outputs(rows: int, q: int, device: torch.device) -> Meta:
    pos, slots, row, col = (torch.empty(rows * q, dtype=torch.long, device=device) for _ in range(4))
    seq = torch.empty(rows, dtype=torch.long, device=device)
    qstart = torch.empty(rows + 1, dtype=torch.long, device=device)
    if rows == 0:
        qstart.zero_()
    return pos, slots, seq, qstart, row, col


def uniform_meta_triton(tables: torch.Tensor, start: torch.Tensor, masked: torch.Tensor | None,
                        q: int, block_size: int, offset: int = 0) -> Meta:
    """(positions, slot_mapping, seq_lens, query_start, token_row, token_col)."""
    rows, width = tables.shape
    meta = _meta_outputs(rows, q, tables.device)
    if rows == 0:
        return meta
    pos, slots, seq, qstart, row, col = meta
    _uniform_meta_kernel[(rows,)](
        tables, start, masked if masked is not None else start, pos, slots, seq, qstart, row, col,
        width, tables.stride(0), rows, offset,
        Q=q, QB=triton.next_power_of_2(q), BS=block_size, HAS_MASK=masked is not None, num_warps=1, **pdl_args(tables),
    )
    return meta


def uniform_meta_ref(tables: torch.Tensor, start: torch.Tensor, masked: torch.Tensor | None,
                     q: int, block_size: int, offset: int = 0) -> Meta:
    rows, dev = tables.shape[0], tables.device
    positions = start.unsqueeze(1) + torch.arange(offset, offset + q, device=dev)  # [R, q]
    blocks = tables.gather(1, (positions // block_size).clamp(max=tables.shape[1] - 1))
    slots = blocks * block_size + positions % block_size
    if masked is not None:
        slots = torch.where(masked.unsqueeze(1), TRASH_BLOCK * block_size + positions % block_size, slots)
    return (positions.reshape(-1), slots.reshape(-1), positions[:, -1] + 1,
            torch.arange(0, (rows + 1) * q, q, device=dev),
            torch.arange(rows, device=dev).repeat_interleave(q), torch.arange(q, device=dev).repeat(rows))


def uniform_meta(tables: torch.Tensor, start: torch.Tensor, masked: torch.Tensor | None,
                 q: int, block_size: int, offset: int = 0) -> Meta:
    assert q >= 1, "every row has at least one token"
    if use_triton(tables, start):
        return uniform_meta_triton(tables, start, masked, q, block_size, offset)
    return uniform_meta_ref(tables, start, masked, q, block_size, offset)


def step_inputs_triton(rows: torch.Tensor, state: StepState, q: int, block_size: int) -> StepInputs:
    n, width, dev = rows.shape[0], state.block_tables.shape[1], rows.device

    def like(t: torch.Tensor, *shape: int) -> torch.Tensor:
        return torch.empty(shape or (n,), dtype=t.dtype, device=dev)

    x = StepInputs(like(state.last_token, n * q), like(state.seq_lens), like(state.done),
                   like(state.block_tables, n, width), like(state.temperature), like(state.top_k),
                   like(state.top_p), like(state.seed), _meta_outputs(n, q, dev))
    if n == 0:
        return x
    drafts = state.drafts if state.drafts.numel() else state.last_token  # k = 0: never read
    _step_inputs_kernel[(n,)](
        rows, state.seq_lens, state.done, state.last_token, drafts, state.block_tables, state.temperature,
        state.top_k, state.top_p, state.seed, *x[:8], *x.meta, width, state.block_tables.stride(0), n,
        Q=q, QB=triton.next_power_of_2(q), WB=min(1024, triton.next_power_of_2(width)), BS=block_size,
        num_warps=1, **pdl_args(rows),
    )
    return x


def step_inputs_ref(rows: torch.Tensor, state: StepState, q: int, block_size: int) -> StepInputs:
    seq, done, tables = state.seq_lens[rows], state.done[rows], state.block_tables[rows]
    ids = torch.cat([state.last_token[rows].unsqueeze(1), state.drafts[rows]], 1).reshape(-1)
    return StepInputs(ids, seq, done, tables, state.temperature[rows], state.top_k[rows], state.top_p[rows],
                      state.seed[rows], uniform_meta_ref(tables, seq, done, q, block_size))


def step_inputs(rows: torch.Tensor, state: StepState, q: int, block_size: int) -> StepInputs:
    """State rows `rows` [R] of a decode step with q = k + 1 tokens a row (module docstring)."""
    assert state.drafts.shape[1] == q - 1, "q = k + 1: the last token and k drafts"
    if use_triton(rows, state.seq_lens):
        return step_inputs_triton(rows, state, q, block_size)
    return step_inputs_ref(rows, state, q, block_size)
