"""Causal attention of a step's queries over the paged KV cache (decode, verify and prefill).

What it computes. Row r of the batch owns the queries q[query_start[r] : query_start[r+1]]
(q_len of them, 0 allowed) and seq_lens[r] keys in the cache, this step's already written.
Its i-th query sits at position p = seq_len - q_len + i and attends to the row's keys at
positions 0..p, with softmax(scale * q.k) in fp32. Key position s lives in cache block
block_tables[r, s // block_size], slot s % block_size. Query head h reads kv head h // G.

Shapes and strides (G = Hq // Hkv, any of 1..8; D in {16, 32, 64, 128}):
    q             [T, Hq, D]    any float dtype; a strided view is fine (last stride 1)
    kv_cache      [2, num_blocks, block_size, Hkv, D]   contiguous; [0] = K, [1] = V
    block_tables  [R, W]        int64 or int32; padding holds block 0 (trash, always readable)
    seq_lens      [R]           int64
    query_start   [R + 1]       int64, cumulative
    returns       [T, Hq, D]    q.dtype, contiguous. Tokens outside every row's range
                                (T padded past query_start[R]) hold garbage (torch.empty).

Grid: (R, cdiv(max_q, BLOCK_Q), Hkv * num_splits). One program takes BLOCK_Q queries of one
row and the G query heads of one kv head, packed into the M = BLOCK_Q * G (padded to a power
of two) rows of `tl.dot`, so each K/V tile is read once per (row, query tile, kv head).
Keys are visited in tiles of BLOCK_N tokens, each token's block found through the table.
With num_splits > 1 (flash-decoding) the key tiles a program's queries can see (up to its last
query's position, so counted from the row's seq_len inside the kernel, not from W) are cut
into num_splits contiguous shares of cdiv(tiles, num_splits); each writes an unnormalized partial (acc, running max, running sum) to a
workspace and `_combine_splits_kernel`, grid (T, Hq), merges them. A share with no keys
writes the neutral partial (0, -inf, 0). Scores are kept in log2 units (exp2, log2(e) folded
into the scale), so the stored running max is one too.

Careful when editing: the launcher must stay CUDA-graph capturable. Shapes come only from
host ints (T, R, W, max_q, num_splits); nothing reads a tensor on the host, no `.item()`.
`paged_attention_ref` is the plain-torch meaning of all of the above; the tests hold the
kernel to it, on CPU through the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton
import triton.language as tl

import settings
from kernels._dispatch import VERIFY_ROWS, invariant, use_triton
from kernels.pdl import pdl_args, wait_for_previous
from kernels.rotary import rope_and_cache

HEAD_DIMS = (16, 32, 64, 128)
# With the step's keys written by the kernel (ROPE), the first key tile is read before the PDL
# wait, for launches of up to PRELOAD_KV_MAX_ROWS rows: a small batch's step is latency-bound and
# gains the overlap, while a larger one has enough programs in flight to hide the read anyway,
# and the held registers cost it occupancy.
PRELOAD_KV_MAX_ROWS = 32
# ... and the last tile too, where a tile's K and V are at most 64 x 64 (at D = 128 the two tiles
# would hold 128 registers a thread); the step's own keys then come from registers.
PRELOAD_LAST_ELEMS = 64 * 64
# Keys per tile for those launches: 128, one width for one query a row (plain decode) and for a
# verify's k + 1, so that a verify row sums its keys in a plain step's order (greedy MTP equals
# plain decoding); a 128-token context is one tile, and a long one takes half the loop trips.
PRELOAD_BLOCK_N = 128
# TEMPORARY (issue 50, PDSERVE_ATTN_VARIANT): how a preloading launch (decode, verify) walks its key
# tiles. Each way moves the same values and sums in the same order, so a query's bits are those of
# today's code whatever the variant; what differs is the work and the registers a tile takes for
# the step's own keys (k + 1 in a verify), which today grow with them: a select over the whole tile
# and two layout conversions through shared memory a key, and the preloaded first tile held in
# registers through the whole loop (254 registers at one query; at four, spills).
#   default       today: per key, a row of k_new / v_new selected into the tile
#   peel          the first (preloaded) tile attended before the loop, so it dies after it
#   peel-gather   peel, and a tile's step keys gathered from k_new / v_new at once (`tl.gather`)
#   peel-reload   peel, and the step's keys read back from the cache after a barrier (the
#                 preloaded tile: a masked re-read of the step's positions only)
ATTN_VARIANTS = {"default": (0, False), "peel": (0, True), "peel-gather": (1, True), "peel-reload": (2, True)}
ATTN_VARIANT = settings.ATTN_VARIANT
if ATTN_VARIANT not in ATTN_VARIANTS:
    raise ValueError(f"PDSERVE_ATTN_VARIANT must be one of {sorted(ATTN_VARIANTS)}, got {ATTN_VARIANT!r}")


def _variant_args() -> dict:
    """The kernel's constexprs for PDSERVE_ATTN_VARIANT (TEMPORARY)."""
    step_keys, peel = ATTN_VARIANTS[ATTN_VARIANT]
    return {"STEP_KEYS": step_keys, "PEEL": peel}


_LOG2E = math.log2(math.e)
_TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _attend_key_tiles(
    q, q_pos, k_ptr, table_ptr, kv_end, tile_lo, tile_hi, qk_scale,
    stride_kv, stride_kb, stride_ks, k0, v0, k1, v1, new_lo, k_new, v_new,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr, DTYPE: tl.constexpr, PRECISION: tl.constexpr, PRE: tl.constexpr,
    PRE_LAST: tl.constexpr, Q_POW2: tl.constexpr, STEP_KEYS: tl.constexpr = 0, PEEL: tl.constexpr = False,
):
    """Online softmax of q [BLOCK_M, D] over key tiles [tile_lo, tile_hi): (acc, max, sum).
    PRE: the keys and values below position new_lo of the first tile came in k0 / v0, and with
    PRE_LAST those of the last in k1 / v1 (`_old_tile`, read before the PDL wait); and the step's
    own (from new_lo on) come in k_new / v_new [Q_POW2, D] as the program wrote them to the cache,
    so no tile reads them (one query tile a row: k_new's row j is position new_lo + j); how they
    enter a tile: STEP_KEYS (TEMPORARY, `ATTN_VARIANTS`). PEEL (TEMPORARY): the first tile is
    attended before the loop, so k0 / v0 are not held in registers through it (the same sums)."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    first = tile_lo
    if PRE and PEEL:
        first = tile_lo + 1
        if tile_lo < tile_hi:
            k_pos = tile_lo * BLOCK_N + tl.arange(0, BLOCK_N)
            k, v = _held_step_keys(k0, v0, k_ptr, table_ptr, tile_lo * BLOCK_N, k_pos, kv_end, new_lo, k_new, v_new,
                                   stride_kv, stride_kb, stride_ks, BLOCK_N, BLOCK_SIZE, HEAD_DIM, Q_POW2, STEP_KEYS)
            acc, m_i, l_i = _attend_tile(q, q_pos, k, v, k_pos, qk_scale, acc, m_i, l_i, DTYPE, PRECISION)
    for tile in range(first, tile_hi):
        k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k_ok = k_pos < kv_end
        if PRE:
            # STEP_KEYS reload: a tile read after the wait takes the step's keys from the cache (written
            # before a barrier); `held`: the tile came in registers from before the wait
            read = k_ok if STEP_KEYS == 2 else k_ok & (k_pos < new_lo)
            held = (tile == tile_lo) & (not PEEL)
            if tile == tile_lo and not PEEL:
                k, v = k0, v0
            elif PRE_LAST:
                held = tile == tile_hi - 1
                if tile == tile_hi - 1:
                    k, v = k1, v1
                else:
                    k, v = _tile_keys(k_ptr, table_ptr, k_pos, read, stride_kv, stride_kb,
                                      stride_ks, BLOCK_SIZE, HEAD_DIM)
            else:
                k, v = _tile_keys(k_ptr, table_ptr, k_pos, read, stride_kv, stride_kb,
                                  stride_ks, BLOCK_SIZE, HEAD_DIM)
            if STEP_KEYS != 2:
                k, v = _step_keys(k, v, tile * BLOCK_N, k_pos, new_lo, k_new, v_new, Q_POW2, BLOCK_N, HEAD_DIM,
                                  STEP_KEYS)
            elif held:
                k, v = _held_step_keys(k, v, k_ptr, table_ptr, tile * BLOCK_N, k_pos, kv_end, new_lo, k_new, v_new,
                                       stride_kv, stride_kb, stride_ks, BLOCK_N, BLOCK_SIZE, HEAD_DIM, Q_POW2,
                                       STEP_KEYS)
        else:
            k, v = _tile_keys(k_ptr, table_ptr, k_pos, k_ok, stride_kv, stride_kb, stride_ks, BLOCK_SIZE, HEAD_DIM)
        acc, m_i, l_i = _attend_tile(q, q_pos, k, v, k_pos, qk_scale, acc, m_i, l_i, DTYPE, PRECISION)
    return acc, m_i, l_i


@triton.jit
def _attend_tile(q, q_pos, k, v, k_pos, qk_scale, acc, m_i, l_i, DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile's step of the online softmax: (acc, max, sum) updated."""
    s = tl.dot(q, k.to(DTYPE), input_precision=PRECISION) * qk_scale
    s = tl.where(k_pos[None, :] <= q_pos[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees nothing yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(DTYPE), v.to(DTYPE), input_precision=PRECISION)
    l_i = l_i * alpha + tl.sum(p, 1)
    return acc, m_new, l_i


@triton.jit
def _held_step_keys(k, v, k_ptr, table_ptr, start, k_pos, kv_end, new_lo, k_new, v_new, stride_kv, stride_kb, stride_ks,
                    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                    Q_POW2: tl.constexpr, STEP_KEYS: tl.constexpr):
    """A tile read before the wait (older keys only) with the step's keys put in, if it holds any."""
    if start + BLOCK_N > new_lo:
        if STEP_KEYS == 2:  # re-read from the cache, where the program wrote them before a barrier
            new = (k_pos >= new_lo) & (k_pos < kv_end)
            kr, vr = _tile_keys(k_ptr, table_ptr, k_pos, new, stride_kv, stride_kb, stride_ks, BLOCK_SIZE, HEAD_DIM)
            k, v = tl.where(new[None, :], kr, k), tl.where(new[:, None], vr, v)
        else:
            k, v = _step_keys(k, v, start, k_pos, new_lo, k_new, v_new, Q_POW2, BLOCK_N, HEAD_DIM, STEP_KEYS)
    return k, v


@triton.jit
def _step_keys(k, v, start, k_pos, new_lo, k_new, v_new, Q_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, STEP_KEYS: tl.constexpr):
    """k / v with the step's keys from k_new / v_new, where the tile holds any (STEP_KEYS 0 or 1)."""
    if start + BLOCK_N > new_lo:
        if STEP_KEYS == 1:
            k, v = _gather_step_keys(k, v, k_pos, new_lo, k_new, v_new, Q_POW2, BLOCK_N, HEAD_DIM)
        else:
            k, v = _with_step_keys(k, v, k_pos, new_lo, k_new, v_new, Q_POW2)
    return k, v


@triton.jit
def _tile_keys(k_ptr, table_ptr, k_pos, mask, stride_kv, stride_kb, stride_ks,
               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K [D, BLOCK_N] and V [BLOCK_N, D] at positions k_pos where mask holds, zeros elsewhere."""
    block = tl.load(table_ptr + k_pos // BLOCK_SIZE, mask=mask, other=0).to(tl.int64)
    slot = block * stride_kb + (k_pos % BLOCK_SIZE) * stride_ks
    offs_d = tl.arange(0, HEAD_DIM)
    k = tl.load(k_ptr + slot[None, :] + offs_d[:, None], mask=mask[None, :], other=0.0)
    v = tl.load(k_ptr + stride_kv + slot[:, None] + offs_d[None, :], mask=mask[:, None], other=0.0)
    return k, v


@triton.jit
def _with_step_keys(k, v, k_pos, new_lo, k_new, v_new, Q_POW2: tl.constexpr):
    """k [D, BLOCK_N] and v [BLOCK_N, D] with the step's key j (rows of k_new / v_new, fp32
    holding cache-dtype values; rows past the step's keys are zeros and match no position) put
    at position new_lo + j."""
    rows = tl.arange(0, Q_POW2)[:, None]
    for j in tl.static_range(Q_POW2):
        at = k_pos == new_lo + j
        kj = tl.sum(tl.where(rows == j, k_new, 0.0), 0)
        vj = tl.sum(tl.where(rows == j, v_new, 0.0), 0)
        k = tl.where(at[None, :], kj[:, None].to(k.dtype), k)
        v = tl.where(at[:, None], vj[None, :].to(v.dtype), v)
    return k, v


@triton.jit
def _gather_step_keys(k, v, k_pos, new_lo, k_new, v_new, Q_POW2: tl.constexpr, BLOCK_N: tl.constexpr,
                      HEAD_DIM: tl.constexpr):
    """`_with_step_keys` in one step for any number of keys (TEMPORARY, STEP_KEYS gather): column n
    of the tile takes row n - (new_lo - tile start) of k_new / v_new where that is a step key."""
    j = tl.minimum(tl.maximum(k_pos - new_lo, 0), Q_POW2 - 1)
    at = (k_pos >= new_lo) & (k_pos < new_lo + Q_POW2)
    kg = tl.gather(tl.trans(k_new), tl.broadcast_to(j[None, :], [HEAD_DIM, BLOCK_N]), 1)
    vg = tl.gather(v_new, tl.broadcast_to(j[:, None], [BLOCK_N, HEAD_DIM]), 0)
    return tl.where(at[None, :], kg.to(k.dtype), k), tl.where(at[:, None], vg.to(v.dtype), v)


@triton.jit
def _old_tile(k_ptr, table_ptr, tile, end, stride_kv, stride_kb, stride_ks,
              BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """K [D, BLOCK_N] and V [BLOCK_N, D] of key tile `tile` below position `end` (at most the
    step's first key), zeros elsewhere. Read before the PDL wait: the row's metadata was written
    at the step's start, older keys by earlier steps, and the step's keys only by this kernel
    (ROPE), after the wait; under PDL the kernel before this one has itself waited for the one
    before it, so nothing in flight writes what is read here."""
    k_pos = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    return _tile_keys(k_ptr, table_ptr, k_pos, k_pos < end, stride_kv, stride_kb, stride_ks, BLOCK_SIZE, HEAD_DIM)


@triton.jit
def _write_step_keys(k_new_ptr, k_row, cos, sin, v_rows, dst, stride_kv, mask, HEAD_DIM: tl.constexpr):
    """The step's keys (rows k_new_ptr + k_row, rotated by cos / sin) and values (rows v_rows)
    written in the cache's dtype at dst (K) and dst + stride_kv (V), where mask holds; returns
    them as written, in fp32 [R, D]."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    cache_ty = dst.dtype.element_ty
    k = _rotate(k_new_ptr, k_row, mask, cos, sin, HEAD_DIM).to(k_new_ptr.dtype.element_ty).to(cache_ty)
    v = tl.load(v_rows + d, mask=mask, other=0.0).to(cache_ty)
    tl.store(dst + d, k, mask=mask)
    tl.store(dst + stride_kv + d, v, mask=mask)
    return k.to(tl.float32), v.to(tl.float32)


@triton.jit
def _rope_rows(pos_ptr, cos_ptr, sin_ptr, tokens, mask, stride_cos, HEAD_DIM: tl.constexpr):
    """cos and sin [R, D] at the positions of `tokens` [R] (rows where mask [R, D] holds)."""
    d = tl.arange(0, HEAD_DIM)[None, :]
    pos = tl.load(pos_ptr + tokens, mask=tl.max(mask.to(tl.int32), 1) > 0, other=0)[:, None]
    cos = tl.load(cos_ptr + pos * stride_cos + d, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * stride_cos + d, mask=mask, other=0.0)
    return cos, sin


@triton.jit
def _rotate(x_ptr, row_off, mask, cos, sin, HEAD_DIM: tl.constexpr):
    """Rows x[row_off + d] rotated by cos / sin (`_rope_rows`; rotate_half, fp32, the ops of
    kernels/rotary.py in its order: the launch turns fp fusion off): d < D/2 takes
    x[d] cos[d] - x[d + D/2] sin[d], d >= D/2 takes x[d] cos[d] + x[d - D/2] sin[d]."""
    half: tl.constexpr = HEAD_DIM // 2
    d = tl.arange(0, HEAD_DIM)[None, :]
    partner = (d + half) % HEAD_DIM
    x = tl.load(x_ptr + row_off + d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(x_ptr + row_off + partner, mask=mask, other=0.0).to(tl.float32)
    return x * cos + tl.where(d < half, -xp, xp) * sin


@triton.jit
def _paged_attention_kernel(
    q_ptr, kv_ptr, out_ptr, ws_acc_ptr, ws_max_ptr, ws_sum_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr, qk_scale,
    stride_qt, stride_qh, stride_kv, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_ot, stride_oh, stride_ws_split, stride_ws_t,
    k_new_ptr, v_new_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr,
    stride_knt, stride_knh, stride_vnt, stride_vnh, stride_cos,
    G: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    DTYPE: tl.constexpr, PRECISION: tl.constexpr, ROPE: tl.constexpr, Q_POW2: tl.constexpr,
    PDL: tl.constexpr, PRE: tl.constexpr = False, PRE_LAST: tl.constexpr = False,
    STEP_KEYS: tl.constexpr = 0, PEEL: tl.constexpr = False,
):
    row = tl.program_id(0)
    q_tile_start = tl.program_id(1) * BLOCK_Q
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    if not PRE:
        wait_for_previous(PDL)
    q_begin = tl.load(query_start_ptr + row)
    q_len = tl.load(query_start_ptr + row + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + row)
    k_base = kv_ptr + kv_head * stride_kh
    table = block_tables_ptr + row * stride_bt

    # M rows = (query i of the tile, head g of the group), i-major.
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM)
    q_idx = q_tile_start + offs_m // G
    heads = kv_head * G + offs_m % G
    tokens = q_begin + q_idx
    q_pos = seq_len - q_len + q_idx
    m_ok = (offs_m < BLOCK_Q * G) & (q_idx < q_len)
    q_row = tokens[:, None] * stride_qt + heads[:, None] * stride_qh

    # Keys the tile's last query sees, in BLOCK_N tiles; this split takes one share of them. The
    # shares are cut from the first query's tiles, the last split taking any after them: a verify's
    # first row then sums its keys in the shares of a plain step at its position.
    new_lo = seq_len - q_len  # the step's own keys start here
    kv_end = new_lo + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_end, BLOCK_N)
    per_split = tl.cdiv(tl.cdiv(new_lo + q_tile_start + 1, BLOCK_N), NUM_SPLITS)
    tile_lo = split * per_split
    tile_hi = tl.where(split == NUM_SPLITS - 1, num_tiles, tl.minimum(tile_lo + per_split, num_tiles))
    # ROPE: the step's keys in this split's share, rotated and written here with their values
    i = q_tile_start + tl.arange(0, Q_POW2)
    t_new = q_begin + i
    tile_of = (new_lo + i) // BLOCK_N
    mine = (i < q_len) & (i < q_tile_start + BLOCK_Q) & (tile_of >= tile_lo) & (tile_of < tile_hi)
    k_row = t_new[:, None] * stride_knt + kv_head * stride_knh
    if PRE:  # ROPE only: what the step's kernels before this one do not write (see `_old_tile`)
        old_end = tl.minimum(new_lo, kv_end)
        k0, v0 = _old_tile(k_base, table, tile_lo, old_end, stride_kv, stride_kb, stride_ks,
                           BLOCK_N, BLOCK_SIZE, HEAD_DIM)
        if PRE_LAST:  # (none if it is the first; a share with no tiles, as a row with no keys, reads tile_lo's none)
            k1, v1 = _old_tile(k_base, table, tl.maximum(tile_hi - 1, tile_lo),
                               tl.where(tile_hi - 1 > tile_lo, old_end, 0), stride_kv, stride_kb, stride_ks,
                               BLOCK_N, BLOCK_SIZE, HEAD_DIM)
        else:
            k1, v1 = k0, v0  # unused
    else:
        k0 = tl.zeros([HEAD_DIM, BLOCK_N], dtype=kv_ptr.dtype.element_ty)  # unused
        v0 = tl.zeros([BLOCK_N, HEAD_DIM], dtype=kv_ptr.dtype.element_ty)
        k1, v1 = k0, v0
    if ROPE:  # the positions' rotary rows and the step's slots: with PRE still before the wait
        q_cos, q_sin = _rope_rows(pos_ptr, cos_ptr, sin_ptr, tokens, m_ok[:, None], stride_cos, HEAD_DIM)
        k_cos, k_sin = _rope_rows(pos_ptr, cos_ptr, sin_ptr, t_new, mine[:, None], stride_cos, HEAD_DIM)
        slot = tl.load(slot_ptr + t_new, mask=mine, other=0)
    if PRE:
        wait_for_previous(PDL)
    if q_tile_start >= q_len:
        return

    if ROPE:  # q as it comes from the projection: rotated here, rounded to its dtype as the rotary kernel does
        q = _rotate(q_ptr, q_row, m_ok[:, None], q_cos, q_sin, HEAD_DIM).to(q_ptr.dtype.element_ty).to(DTYPE)
        k_new, v_new = _write_step_keys(
            k_new_ptr, k_row, k_cos, k_sin, v_new_ptr + t_new[:, None] * stride_vnt + kv_head * stride_vnh,
            kv_ptr + slot[:, None] * stride_ks + kv_head * stride_kh, stride_kv, mine[:, None], HEAD_DIM)
        if not PRE or STEP_KEYS == 2:
            tl.debug_barrier()  # the program's threads see these writes before they read the tiles
    else:
        q = tl.load(q_ptr + q_row + offs_d[None, :], mask=m_ok[:, None], other=0.0).to(DTYPE)
        k_new = tl.zeros([Q_POW2, HEAD_DIM], dtype=tl.float32)  # unused
        v_new = k_new
    acc, m_i, l_i = _attend_key_tiles(
        q, q_pos, k_base, table, kv_end, tile_lo, tile_hi, qk_scale, stride_kv, stride_kb, stride_ks,
        k0, v0, k1, v1, new_lo, k_new, v_new,
        BLOCK_M, BLOCK_N, BLOCK_SIZE, HEAD_DIM, DTYPE, PRECISION, PRE, PRE_LAST, Q_POW2, STEP_KEYS, PEEL,
    )

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        o_off = tokens[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_ptr + o_off, out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None])
    else:
        # Workspaces: max/sum [S, T, Hq], acc [S, T, Hq, D], all contiguous.
        ws = split * stride_ws_split + tokens * stride_ws_t + heads
        tl.store(ws_max_ptr + ws, m_i, mask=m_ok)
        tl.store(ws_sum_ptr + ws, l_i, mask=m_ok)
        tl.store(ws_acc_ptr + ws[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=m_ok[:, None])


@triton.jit
def _combine_splits_kernel(
    ws_acc_ptr, ws_max_ptr, ws_sum_ptr, out_ptr,
    stride_ws_split, stride_ws_t, stride_ot, stride_oh,
    NUM_SPLITS: tl.constexpr, SPLITS_POW2: tl.constexpr, HEAD_DIM: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t, h] = sum_s 2^(m_s - m) acc_s / sum_s 2^(m_s - m) l_s, with m = max_s m_s."""
    wait_for_previous(PDL)
    token = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_POW2)
    s_ok = splits < NUM_SPLITS
    ws = splits * stride_ws_split + token * stride_ws_t + head
    m_s = tl.load(ws_max_ptr + ws, mask=s_ok, other=float("-inf"))
    l_s = tl.load(ws_sum_ptr + ws, mask=s_ok, other=0.0)
    m = tl.max(m_s, 0)
    w = tl.exp2(m_s - tl.where(m == float("-inf"), 0.0, m))
    offs_d = tl.arange(0, HEAD_DIM)
    acc = tl.load(ws_acc_ptr + ws[:, None] * HEAD_DIM + offs_d[None, :], mask=s_ok[:, None], other=0.0)
    total = tl.sum(w * l_s, 0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))


# ----------------------------------------------------------------------------- launcher


@dataclass(frozen=True)
class _Tiles:
    block_q: int  # queries of one row per program
    block_m: int  # tl.dot M: block_q * G padded to a power of two >= 16
    block_n: int  # keys per inner-loop tile (a multiple of the cache's block_size)
    num_warps: int


def _tiles(max_q: int, group: int, head_dim: int, block_size: int, same_for_any_q: bool = False,
           min_block_n: int = 64) -> _Tiles:
    """Decode/verify (max_q * G <= 128) fit one query tile, M rounded up to a power of two so
    few variants compile; prefill packs M = 128 rows (128 // G queries). `same_for_any_q` (the
    batch-invariant mode): M = 128 whatever max_q, so a query's bits are the same in a decode
    step, a verify window and a prefill chunk (another M is another compiled kernel, whose fp32
    sums may round differently; decode then computes masked rows, cheap next to its K/V reads).
    `min_block_n`: the fewest keys a tile takes (PRELOAD_BLOCK_N for the launches that preload;
    64 in the batch-invariant mode whatever it says)."""
    block_m = 128 if same_for_any_q else min(128, max(16, triton.next_power_of_2(max_q * group)))
    block_q = max(1, block_m // group)
    block_n = max(block_size, 64 if same_for_any_q else min_block_n)
    num_warps = 8 if block_m == 128 and head_dim >= 64 else 4
    return _Tiles(block_q, block_m, block_n, num_warps)


def _launch_tiles(max_q: int, group: int, head_dim: int, block_size: int, rope: bool, pre: bool) -> _Tiles:
    """A launch's tiles; `rope`: a decode step's (keys written in the kernel), whose tiles are the
    same for one query a row and for a verify's up to VERIFY_ROWS (tl.dot's M sized for those:
    another M is another compiled kernel); `pre`: it preloads."""
    tile_q = max(max_q, VERIFY_ROWS) if rope else max_q
    return _tiles(tile_q, group, head_dim, block_size, same_for_any_q=invariant(),
                  min_block_n=PRELOAD_BLOCK_N if pre else 64)


def _dot_dtype(q: torch.Tensor, kv_cache: torch.Tensor) -> tl.dtype:
    """The dtype of tl.dot's operands: q's 16-bit dtype if the cache's is 16-bit too, else fp32.
    Off-GPU bf16 also runs in fp32: the interpreter's tl.dot multiplies bf16 as raw bits
    (triton-lang/triton#11584), and its docs say it supports no bf16 arithmetic."""
    if torch.float32 in (q.dtype, kv_cache.dtype):
        return tl.float32
    if q.dtype == torch.bfloat16 and not q.is_cuda:
        return tl.float32
    return _TL_DTYPES[q.dtype]


class NewKV(NamedTuple):
    """A step's own k and v as projected ([T, Hkv, D], last dim dense), for the kernel to rotate
    and write into the cache itself (`paged_attention_rope`)."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [T] int64
    cos: torch.Tensor  # [max_positions, D] fp32
    sin: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64


def paged_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    max_q: int,
    scale: float,
    num_splits: int = 1,
    new: NewKV | None = None,
) -> torch.Tensor:
    """The Triton path (CUDA tensors, or CPU ones under TRITON_INTERPRET=1). No host sync. With
    `new`, q is unrotated and the step's keys are not in the cache yet (`paged_attention_rope`)."""
    num_tokens, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, _ = kv_cache.shape
    assert head_dim in HEAD_DIMS, f"paged_attention: head_dim {head_dim} not in {HEAD_DIMS}"
    assert kv_cache.shape[-1] == head_dim, "q and kv_cache head_dim differ"
    assert num_q_heads % num_kv_heads == 0, f"Hq {num_q_heads} not a multiple of Hkv {num_kv_heads}"
    assert block_size & (block_size - 1) == 0, f"block_size {block_size} is not a power of two"
    assert q.stride(-1) == 1 and kv_cache.is_contiguous(), "q's last dim and kv_cache must be dense"
    assert block_tables.stride(-1) == 1 or block_tables.shape[-1] == 1, "block_tables' rows must be dense"
    assert num_q_heads // num_kv_heads <= 128, "more than 128 query heads per kv head"
    assert num_splits >= 1
    out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=q.dtype, device=q.device)
    rows = block_tables.shape[0]
    if rows == 0 or max_q == 0 or num_tokens == 0:
        return out
    group = num_q_heads // num_kv_heads
    pre = new is not None and rows <= PRELOAD_KV_MAX_ROWS
    tiles = _launch_tiles(max_q, group, head_dim, block_size, new is not None, pre)
    dtype = _dot_dtype(q, kv_cache)
    if num_splits == 1:
        ws_acc = ws_max = ws_sum = out  # unused by the kernel
    else:
        ws_max = torch.empty(num_splits, num_tokens, num_q_heads, dtype=torch.float32, device=q.device)
        ws_sum = torch.empty_like(ws_max)
        ws_acc = torch.empty(*ws_max.shape, head_dim, dtype=torch.float32, device=q.device)
    grid = (rows, triton.cdiv(max_q, tiles.block_q), num_kv_heads * num_splits)
    assert new is None or grid[1] == 1, "keys written in the kernel: one query tile a row (decode, verify)"
    nk = new if new is not None else NewKV(q, q, seq_lens, q, q, seq_lens)  # unused without ROPE
    _paged_attention_kernel[grid](
        q, kv_cache, out, ws_acc, ws_max, ws_sum,
        block_tables, seq_lens, query_start, scale * _LOG2E,
        q.stride(0), q.stride(1), kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2),
        kv_cache.stride(3), block_tables.stride(0), out.stride(0), out.stride(1),
        ws_max.stride(0), ws_max.stride(1),
        nk.k, nk.v, nk.positions, nk.cos, nk.sin, nk.slot_mapping,
        nk.k.stride(0), nk.k.stride(1), nk.v.stride(0), nk.v.stride(1), nk.cos.stride(0),
        G=group, BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n,
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, NUM_SPLITS=num_splits, DTYPE=dtype,
        PRECISION="ieee" if dtype == tl.float32 else "tf32",  # ieee: fp32 stays fp32, no TF32
        ROPE=new is not None, Q_POW2=triton.next_power_of_2(min(max_q, tiles.block_q)),
        num_warps=tiles.num_warps, num_stages=2, enable_fp_fusion=new is None,
        PRE=pre, PRE_LAST=pre and head_dim * tiles.block_n <= PRELOAD_LAST_ELEMS,
        **_variant_args(), **pdl_args(q),
    )
    if num_splits > 1:
        _combine_splits_kernel[(num_tokens, num_q_heads)](
            ws_acc, ws_max, ws_sum, out, ws_max.stride(0), ws_max.stride(1),
            out.stride(0), out.stride(1),
            NUM_SPLITS=num_splits, SPLITS_POW2=triton.next_power_of_2(num_splits),
            HEAD_DIM=head_dim, num_warps=1 if head_dim <= 64 else 2, **pdl_args(q),
        )
    return out


# ----------------------------------------------------------------------------- reference


def paged_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    max_q: int,
    scale: float,
    num_splits: int = 1,
) -> torch.Tensor:
    """Plain torch: lay the queries out as [R, max_q + 1] (the last column takes tokens outside
    every row), mask keys by position, fp32 softmax. `num_splits` only shapes the kernel's
    work. Tokens outside every row come back as zeros. Reads no tensor on the host."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    rows, group = block_tables.shape[0], num_q_heads // num_kv_heads
    if rows == 0:
        return torch.zeros_like(q)
    starts, seq_lens = query_start.long(), seq_lens.long()

    # Each row's keys and values in position order; what lies past seq_len is zeroed.
    keys = kv_cache[0][block_tables.long()].flatten(1, 2).float()  # [R, S, Hkv, D]
    values = kv_cache[1][block_tables.long()].flatten(1, 2).float()
    key_pos = torch.arange(keys.shape[1], device=q.device)
    in_cache = (key_pos[None, :] < seq_lens[:, None])[..., None, None]
    keys, values = torch.where(in_cache, keys, 0.0), torch.where(in_cache, values, 0.0)

    token = torch.arange(num_tokens, device=q.device)
    row = torch.searchsorted(starts[1:], token, right=True).clamp(max=rows - 1)
    in_row = (token >= starts[0]) & (token < starts[-1])
    col = torch.where(in_row, token - starts[row], max_q)
    q_pad = torch.zeros(rows, max_q + 1, num_q_heads, head_dim, device=q.device)
    q_pad[row, col] = q.float()
    q_len = starts[1:] - starts[:-1]
    q_pos = (seq_lens - q_len)[:, None] + torch.arange(max_q + 1, device=q.device)  # [R, Q]
    visible = key_pos[None, None, :] <= q_pos[..., None]  # [R, Q, S]

    q_pad = q_pad.view(rows, max_q + 1, num_kv_heads, group, head_dim)
    scores = torch.einsum("rqkgd,rskd->rkgqs", q_pad, keys) * scale
    scores = scores.masked_fill(~visible[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(visible.any(-1)[:, None, None, :, None], probs, 0.0)  # sees nothing
    out = torch.einsum("rkgqs,rskd->rqkgd", probs, values).flatten(2, 3)  # [R, Q, Hq, D]
    return torch.where(in_row[:, None, None], out[row, col], 0.0).to(q.dtype)


def paged_attention_rope(q: torch.Tensor, new: NewKV, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                         seq_lens: torch.Tensor, query_start: torch.Tensor, max_q: int, scale: float,
                         num_splits: int = 1) -> torch.Tensor:
    """`kernels.rotary.rope_and_cache` then `paged_attention`, as one launch where the kernel runs
    and the step's queries of a row fit one query tile (decode, verify, the MTP chain): each
    program rotates its queries, and writes the step's keys (rotated) and values that fall in
    its share of the row's keys; it attends to them as it holds them (PRE) or reads them back
    after a barrier. Elsewhere, the two calls."""
    group = q.shape[1] // kv_cache.shape[3]
    one_tile = max_q <= _tiles(max_q, group, q.shape[2], kv_cache.shape[2], invariant()).block_q
    if use_triton(q, kv_cache) and one_tile and q.shape[2] in HEAD_DIMS:
        return paged_attention_triton(q, kv_cache, block_tables, seq_lens, query_start, max_q, scale, num_splits, new)
    q_rot = rope_and_cache(q, new.k, new.v, new.positions, new.cos, new.sin, kv_cache, new.slot_mapping)
    return paged_attention(q_rot, kv_cache, block_tables, seq_lens, query_start, max_q, scale, num_splits)


def paged_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start: torch.Tensor,
    max_q: int,
    scale: float,
    num_splits: int = 1,
) -> torch.Tensor:
    """[T, Hq, D] attention output: the Triton kernel on CUDA, the torch reference elsewhere."""
    fn = paged_attention_triton if use_triton(q, kv_cache) else paged_attention_ref
    return fn(q, kv_cache, block_tables, seq_lens, query_start, max_q, scale, num_splits)
