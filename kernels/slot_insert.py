"""Newly prefilled requests into the decode state's slots, all of them and every field in one launch.

A decode node inserts the requests that finished prefill before each step (engine/runner/batch_state.py).
Their host values travel as one packed int64 row each (one staged copy); writing them into the
per-slot state with a scatter per state tensor takes a dozen launches, each with the host's
dispatch cost, on every step that inserts. Here program r writes row r into every tensor.

    rows [n, F] int64, each row: slot, seq_len, num_generated, max_tokens, top_k, seed, last_token,
        temperature's fp32 bits, top_p's fp32 bits (as int32 values), then S stop ids, k drafts and
        W block ids (F = 9 + S + k + W)
    seq_lens, num_generated, max_tokens, top_k, seed, last_token [N] int64; temperature, top_p [N]
    fp32; stop_ids [N, S], drafts [N, k], block_tables [N, W] int64; done [N] bool (set False),
    all contiguous; slots in [0, N).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton

SCALARS = ("seq_lens", "num_generated", "max_tokens", "top_k", "seed", "last_token")  # columns 1..6
FLOAT_COLUMNS = 7  # temperature, then top_p: fp32 bits
LISTS = 9  # the first column of the stop ids


@triton.jit
def _insert_kernel(rows, seq_lens, num_generated, max_tokens, top_k, seed, last_token, temperature,
                   top_p, stop_ids, drafts, block_tables, done, F, S, K, W,
                   SB: tl.constexpr, KB: tl.constexpr, WB: tl.constexpr):
    row = rows + tl.program_id(0).to(tl.int64) * F
    slot = tl.load(row)
    tl.store(seq_lens + slot, tl.load(row + 1))
    tl.store(num_generated + slot, tl.load(row + 2))
    tl.store(max_tokens + slot, tl.load(row + 3))
    tl.store(top_k + slot, tl.load(row + 4))
    tl.store(seed + slot, tl.load(row + 5))
    tl.store(last_token + slot, tl.load(row + 6))
    tl.store(temperature + slot, tl.load(row + 7).to(tl.int32).to(tl.float32, bitcast=True))
    tl.store(top_p + slot, tl.load(row + 8).to(tl.int32).to(tl.float32, bitcast=True))
    s = tl.arange(0, SB)
    tl.store(stop_ids + slot * S + s, tl.load(row + 9 + s, mask=s < S), mask=s < S)
    d = tl.arange(0, KB)
    tl.store(drafts + slot * K + d, tl.load(row + 9 + S + d, mask=d < K), mask=d < K)
    for start in range(0, W, WB):
        w = start + tl.arange(0, WB)
        tl.store(block_tables + slot * W + w, tl.load(row + 9 + S + K + w, mask=w < W), mask=w < W)
    tl.store(done + slot, tl.zeros((), dtype=tl.int1))


def insert_rows(rows: torch.Tensor, state) -> None:
    """Write the packed `rows` [n, F] (on the state's device) into `state`'s per-slot tensors (the
    fields the module docstring lists, by name); stream-ordered, never syncs. Off the GPU (and under
    `reference_kernels`) the torch reference does it."""
    n, f = rows.shape
    stops, width = state.stop_ids.shape[1], state.block_tables.shape[1]
    k = state.drafts.shape[1]
    if f != LISTS + stops + k + width:
        raise ValueError(f"rows of {f} columns for {stops} stop ids, {k} drafts and {width} blocks")
    if not use_triton(rows):
        insert_rows_reference(rows, state)
        return
    if n == 0:
        return
    _insert_kernel[(n,)](rows, *(getattr(state, name) for name in SCALARS), state.temperature, state.top_p,
                         state.stop_ids, state.drafts, state.block_tables, state.done, f, stops, k, width,
                         SB=triton.next_power_of_2(stops), KB=triton.next_power_of_2(max(k, 1)),
                         WB=min(1024, triton.next_power_of_2(width)))


def insert_rows_reference(rows: torch.Tensor, state) -> None:
    """`insert_rows` as torch scatters, one per state tensor."""
    slots = rows[:, 0]
    for col, name in enumerate(SCALARS, 1):
        getattr(state, name)[slots] = rows[:, col]
    state.temperature[slots] = rows[:, FLOAT_COLUMNS].to(torch.int32).view(torch.float32)
    state.top_p[slots] = rows[:, FLOAT_COLUMNS + 1].to(torch.int32).view(torch.float32)
    stops, k = state.stop_ids.shape[1], state.drafts.shape[1]
    state.stop_ids[slots] = rows[:, LISTS : LISTS + stops]
    if k:
        state.drafts[slots] = rows[:, LISTS + stops : LISTS + stops + k]
    state.block_tables[slots] = rows[:, LISTS + stops + k :]
    state.done[slots] = False
