"""How the register-tile GEMV (kernels/gemv.py) takes its rows' sums from the weight tile: the
variants of issue 50 (a launch of 2-4 rows, a batch-1 verify, should cost what one row costs).

Each reads the program's weights [BN, K] (and the up half's rows N + rn with GLU) before the PDL
wait, waits, reads x's MP rows and returns the fp32 sums (acc, acc_up), [MP, BN] each, for one
epilogue over all the rows at once (kernels/epilogue.py). Every x load of every row is issued
before anything is stored, so the rows do not wait on each other's memory round trips.

  rows   one 2D [BN, KP] product and sum per row, the weight tile converted to fp32 once; each
         row sums as a one-row launch does (at MP = 1 it is that launch)
  bcast  one [MP, BN, KP] product (weights [1, BN, KP], x [MP, 1, KP]) summed once over K: one
         reduction (and one cross-warp exchange) for all rows
  chunk  as bcast over K in chunks of BK, with [MP, BN] accumulators: only the first chunk is
         read before the wait, fewer registers are held, any K fits
  lanes  the weight tile as [KP / C, BN, C] (C: a warp's 16-byte loads across K), so the warps
         split the tile's rows, not K: each sum is a warp's alone (no cross-warp exchange)

A row's sum runs in the same order whatever MP is within a variant (MP only adds registers), so
a verify row's bits equal a plain step's where both launches take the same variant; across
variants the order differs (bench/gpu/gpu_gemv_rows.py counts where bits agree on a GPU).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.pdl import wait_for_previous

SUMS_CODES = {"rows": 0, "bcast": 1, "chunk": 2, "lanes": 3}


@triton.jit
def rows_sums(x_ptr, w_ptr, rn, M, N, K, stride_x, stride_w,
              GLU: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    rk = tl.arange(0, KP)
    w_mask = (rn[:, None] < N) & (rk[None, :] < K)
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_w + rk[None, :]
    w = tl.load(w_rows, mask=w_mask, other=0.0)  # before the wait: weights are never written
    u = tl.load(w_rows + N * stride_w, mask=w_mask & GLU, other=0.0)
    wait_for_previous(PDL)
    wf = w.to(tl.float32)
    uf = u.to(tl.float32)
    rows = tl.arange(0, MP)[:, None]
    acc = tl.zeros([MP, BN], dtype=tl.float32)
    acc_up = tl.zeros([MP, BN], dtype=tl.float32)
    for m in tl.static_range(MP):
        rm = m + tl.zeros([1], dtype=tl.int32)
        x = tl.load(x_ptr + m * stride_x + rk, mask=(rk < K) & (rm < M), other=0.0).to(tl.float32)
        s = tl.sum(wf * x[None, :], axis=1)[None, :]
        s_up = s
        if GLU:
            s_up = tl.sum(uf * x[None, :], axis=1)[None, :]
        if MP == 1:
            acc, acc_up = s, s_up
        else:
            acc = tl.where(rows == m, s, acc)
            acc_up = tl.where(rows == m, s_up, acc_up)
    return acc, acc_up


@triton.jit
def bcast_sums(x_ptr, w_ptr, rn, M, N, K, stride_x, stride_w,
               GLU: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr, PDL: tl.constexpr):
    rk = tl.arange(0, KP)[None, None, :]
    n3 = rn[None, :, None]
    w_mask = (n3 < N) & (rk < K)
    w_rows = w_ptr + n3.to(tl.int64) * stride_w + rk
    w = tl.load(w_rows, mask=w_mask, other=0.0)  # [1, BN, KP], before the wait
    u = tl.load(w_rows + N * stride_w, mask=w_mask & GLU, other=0.0)
    wait_for_previous(PDL)
    rm = tl.arange(0, MP)[:, None, None]
    x = tl.load(x_ptr + rm.to(tl.int64) * stride_x + rk, mask=(rm < M) & (rk < K), other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x, axis=2)
    acc_up = acc
    if GLU:
        acc_up = tl.sum(u.to(tl.float32) * x, axis=2)
    return acc, acc_up


@triton.jit
def _chunk(x_ptr, w_ptr, n3, rm, k0, M, N, K, stride_x, stride_w, GLU: tl.constexpr, BK: tl.constexpr):
    """The weights [1, BN, BK] (and the up half's) of columns k0 ..., and x's [MP, 1, BK]."""
    rk = k0 + tl.arange(0, BK)[None, None, :]
    w_mask = (n3 < N) & (rk < K)
    w_rows = w_ptr + n3.to(tl.int64) * stride_w + rk
    w = tl.load(w_rows, mask=w_mask, other=0.0)
    u = tl.load(w_rows + N * stride_w, mask=w_mask & GLU, other=0.0)
    x = tl.load(x_ptr + rm.to(tl.int64) * stride_x + rk, mask=(rm < M) & (rk < K), other=0.0)
    return w, u, x


@triton.jit
def chunk_sums(x_ptr, w_ptr, rn, M, N, K, stride_x, stride_w,
               GLU: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr):
    n3 = rn[None, :, None]
    rk = tl.arange(0, BK)[None, None, :]
    w_mask = (n3 < N) & (rk < K)
    w_rows = w_ptr + n3.to(tl.int64) * stride_w + rk
    w = tl.load(w_rows, mask=w_mask, other=0.0)  # the first chunk, before the wait
    u = tl.load(w_rows + N * stride_w, mask=w_mask & GLU, other=0.0)
    wait_for_previous(PDL)
    rm = tl.arange(0, MP)[:, None, None]
    x = tl.load(x_ptr + rm.to(tl.int64) * stride_x + rk, mask=(rm < M) & (rk < K), other=0.0).to(tl.float32)
    acc = tl.sum(w.to(tl.float32) * x, axis=2)
    acc_up = acc
    if GLU:
        acc_up = tl.sum(u.to(tl.float32) * x, axis=2)
    for k0 in range(BK, K, BK):  # in order: a row's sum is the same whatever MP is
        w, u, xk = _chunk(x_ptr, w_ptr, n3, rm, k0, M, N, K, stride_x, stride_w, GLU, BK)
        xf = xk.to(tl.float32)
        acc += tl.sum(w.to(tl.float32) * xf, axis=2)
        if GLU:
            acc_up += tl.sum(u.to(tl.float32) * xf, axis=2)
    return acc, acc_up


@triton.jit
def lanes_sums(x_ptr, w_ptr, rn, M, N, K, stride_x, stride_w,
               GLU: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr, KP: tl.constexpr, C: tl.constexpr,
               PDL: tl.constexpr):
    # column k = r * C + c of [R, BN, C]: the fastest axis is one warp's width, so the layout puts
    # the warps on the weight's rows and a row's sum needs no exchange between warps
    kk = (tl.arange(0, KP // C)[:, None, None] * C + tl.arange(0, C)[None, None, :])  # [R, 1, C]
    n3 = rn[None, :, None]
    w_mask = (n3 < N) & (kk < K)
    w_rows = w_ptr + n3.to(tl.int64) * stride_w + kk
    w = tl.load(w_rows, mask=w_mask, other=0.0)  # [R, BN, C], before the wait
    u = tl.load(w_rows + N * stride_w, mask=w_mask & GLU, other=0.0)
    wait_for_previous(PDL)
    rm = tl.arange(0, MP)[:, None, None, None]
    # x's pointers spread over the weight's rows too, so that its layout is the weights' (warps on
    # BN): a thread reads its own rows' copies (from L1) instead of the tile being converted
    x_at = tl.broadcast_to(x_ptr + rm.to(tl.int64) * stride_x + kk[None], [MP, KP // C, BN, C])
    x = tl.load(x_at, mask=(rm < M) & (kk[None] < K), other=0.0)
    xf = x.to(tl.float32)  # [MP, R, BN, C]
    acc = tl.sum(tl.sum(w.to(tl.float32)[None] * xf, axis=1), axis=2)  # over R in registers, then the lanes
    acc_up = acc
    if GLU:
        acc_up = tl.sum(tl.sum(u.to(tl.float32)[None] * xf, axis=1), axis=2)
    return acc, acc_up


def lanes_width(kp: int, element_size: int) -> int:
    """C of `lanes_sums`: a warp's 16-byte loads side by side across K, at most KP."""
    return min(kp, 32 * max(1, 16 // element_size))


def chunk_width(kp: int, chunk: int) -> int:
    return min(kp, triton.next_power_of_2(chunk))


def tile_for(sums: str, bn: int, width: int, warps: int, glu: bool, element_size: int) -> tuple[int, int]:
    """(BN, WARPS) of a variant, from the one-row launch's; `width`: the K columns a program holds
    at once (KP, or a chunk's). bcast and chunk put every warp on K (a warp on BN would give x's
    load another layout than the weights', and the tile would be converted through shared
    memory); lanes gives each warp one row of the tile. Then BN halves (more programs than SMs,
    as many bytes on the busiest SM) until a thread holds at most 128 weight elements."""
    if sums == "rows":
        return bn, warps
    if sums == "lanes":
        bn = min(bn, 8)
        warps = bn
    else:
        warps = max(1, min(8, width // lanes_width(width, element_size)))
    while bn > 1 and bn * width * (2 if glu else 1) > 128 * 32 * warps:
        bn //= 2
        warps = bn if sums == "lanes" else warps
    return bn, warps
