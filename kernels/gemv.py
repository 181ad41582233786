"""Decode GEMMs of one sequence (GEMV_MAX_M; its verify's rows too) over small weights: the weight
tile is read into registers before the programmatic-dependent-launch wait (kernels/pdl.py).

A program is one warp and owns BN whole rows of the weight (both halves' rows with silu * up). K
is read in slots of C columns (a warp's 16-byte loads side by side), S1 + S2 of them, two powers
of two, so K = 576 reads 3 slots of 256 rather than a padded 4. The program loads its slots of the
tile first, while the kernel before it still runs (weights are never written by a step), then
waits, reads x's rows and sums: each lane adds its columns' products over the slots in registers,
then the warp sums them once (5 shuffle levels a value, no exchange between warps), in fp32. The
rows only add registers, so a row's sum runs in one order whatever M is: row 0 of a launch of
several rows has the bits of the same row launched alone. The epilogue is the split-K kernel's
(kernels/epilogue.py), over all the rows at once: bias, silu * up, the residual add, the partial
sums of squares for the next norm, and a weightless norm's row scale from x's.

Why: a small model's batch-1 step (SmolLM2's: ~150 dependent launches of 0.7-3.5 MB weights)
is bound by each launch's latency, not by bandwidth. Holding the whole tile in registers before
the wait lets the weight read overlap the kernel before, which the split-K kernel's L2 prefetch
does only in part; a persistent kernel with a grid barrier between stages lost to both, the
barrier alone costing about a launch. One warp a program, because a tile spread over several
warps along K sums every output of every row across the warps too: its shuffles and shared-memory
exchanges grow with the rows, so a verify's four rows cost far more than one row; here they add
registers (docs/history/benchmarks-history.md has the comparison).

Not in the batch-invariant mode (the kernel is chosen by M); not for an argmax or a split-K
launch. bench/gpu/gpu_gemv_rows.py times it against the split-K kernel at 1 and 4 rows.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels._dispatch import sequences
from kernels.epilogue import gemm_epilogue
from kernels.norm import rstd_of_partials
from kernels.pdl import pdl_args, wait_for_previous

# Sequences: one, as a batch-1 step has. Its verify (`kernels._dispatch.rows_a_sequence`: up to
# GEMV_MAX_ROWS rows) takes the kernel too, though the split-K kernel ran that step faster: here a
# verify row has the plain step's bits, so greedy MTP gives plain decoding's answers (BENCHMARKS.md).
# Outside a decode step, a launch's rows are its sequences (one row).
GEMV_MAX_M = 1
GEMV_MAX_ROWS = 4
GEMV_MAX_TILE = 32768  # weight elements of a tile padded to a power of two of K
# weights above this many bytes keep the split-K kernel (Llama-1B's o projection, 8 MB, would fit a tile)
GEMV_MAX_BYTES = 4 * 2**20
GemvConfig = tuple[int, int, int]  # (BN, KP, WARPS); WARPS is 1

@functools.cache
def _programs(device_index: int | None) -> int:
    """The SM count (one program each); off CUDA (the interpreter runs programs one after
    another, each slowly) 8."""
    if device_index is None or not torch.cuda.is_available():
        return 8
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gemv_config(m: int, w: torch.Tensor, glu: bool, sms: int | None = None) -> GemvConfig | None:
    """(BN, KP, 1) when the kernel takes a launch of m rows (`kernels._dispatch.sequences` of them)
    over w, else None. It takes w when a tile of the smallest power of two of rows that leaves at
    most one tile per SM (`sms`: w's device's count) fits GEMV_MAX_TILE. Then BN halves (more
    programs, as many bytes on the busiest SM) until a lane holds at most `_lane_elements` of the
    weight's slots."""
    if sequences(m) > GEMV_MAX_M or m < 1 or m > GEMV_MAX_ROWS or w.numel() * w.element_size() > GEMV_MAX_BYTES:
        return None
    halves = 2 if glu else 1
    n_out, k, device = w.shape[0] // halves, w.shape[1], w.device
    sms = sms or _programs(device.index if device.type == "cuda" else None)
    kp = triton.next_power_of_2(k)
    bn = 1
    while triton.cdiv(n_out, bn) > sms:
        bn *= 2
    if bn * kp * halves > GEMV_MAX_TILE:
        return None
    s1, s2, c = slots(k, w.element_size())
    while bn > 1 and bn * halves * (s1 + s2) * c > _lane_elements(k, n_out, glu) * 32:
        bn //= 2
    return bn, kp, 1


def _lane_elements(k: int, n_out: int, glu: bool) -> int:
    """The weight elements a lane holds at most: 96 (half the programs) for silu * up's two halves
    and for more outputs than K (q/k/v), else 48. Neither bound was fastest for every projection
    inside a decode step's graph; this split was, at one row and at a verify's four
    (docs/history/benchmarks-history.md)."""
    return 96 if glu or n_out > k else 48


def slots(k: int, element_size: int) -> tuple[int, int, int]:
    """(S1, S2, C) of `_slot_sums` for rows of k elements: C a warp's 16-byte loads side by side
    (at most k's power of two), S1 the largest power of two of C-column slots within k's, S2 the
    power of two that covers the rest (K = 576 in bf16: 2 + 1 slots of 256; 1536: 4 + 2)."""
    c = min(triton.next_power_of_2(k), 32 * max(1, 16 // element_size))
    n = triton.cdiv(k, c)
    s1 = 1 << (n.bit_length() - 1)
    return s1, triton.next_power_of_2(n - s1) if n > s1 else 0, c


@triton.jit
def _slot_tile(w_ptr, n3, s0, N, K, stride_w, GLU: tl.constexpr, S: tl.constexpr, C: tl.constexpr):
    """Slots s0 .. s0 + S of the tile: [S, BN, C] (and the up half's), column (s0 + s) * C + c."""
    kk = (s0 + tl.arange(0, S))[:, None, None] * C + tl.arange(0, C)[None, None, :]
    mask = (n3 < N) & (kk < K)
    at = w_ptr + n3.to(tl.int64) * stride_w + kk
    return tl.load(at, mask=mask, other=0.0), tl.load(at + N * stride_w, mask=mask & GLU, other=0.0)


@triton.jit
def _slot_products(x_ptr, w, u, m4, s0, M, K, stride_x, GLU: tl.constexpr, S: tl.constexpr, C: tl.constexpr):
    """x's slots s0 .. s0 + S times the tile's, summed over the slots: [MP, BN, C] (and up's)."""
    kk = ((s0 + tl.arange(0, S))[:, None, None] * C + tl.arange(0, C)[None, None, :])[None]
    x = tl.load(x_ptr + m4.to(tl.int64) * stride_x + kk, mask=(m4 < M) & (kk < K), other=0.0).to(tl.float32)
    p = tl.sum(w.to(tl.float32)[None] * x, axis=1)
    p_up = p
    if GLU:
        p_up = tl.sum(u.to(tl.float32)[None] * x, axis=1)
    return p, p_up


@triton.jit
def _slot_sums(x_ptr, w_ptr, rn, rm, M, N, K, stride_x, stride_w, GLU: tl.constexpr, S1: tl.constexpr,
               S2: tl.constexpr, C: tl.constexpr, PDL: tl.constexpr):
    """The sums [MP, BN] (and the up half's) of the tile's S1 + S2 slots with x's rows (the module's
    docstring): the tile is read before the wait."""
    n3 = rn[None, :, None]
    w, u = _slot_tile(w_ptr, n3, 0, N, K, stride_w, GLU, S1, C)  # before the wait
    if S2 > 0:
        w2, u2 = _slot_tile(w_ptr, n3, S1, N, K, stride_w, GLU, S2, C)
    wait_for_previous(PDL)
    m4 = rm[:, None, None, None]
    p, p_up = _slot_products(x_ptr, w, u, m4, 0, M, K, stride_x, GLU, S1, C)
    if S2 > 0:
        p2, p2_up = _slot_products(x_ptr, w2, u2, m4, S1, M, K, stride_x, GLU, S2, C)
        p += p2
        p_up += p2_up
    acc = tl.sum(p, axis=2)
    acc_up = acc
    if GLU:
        acc_up = tl.sum(p_up, axis=2)
    return acc, acc_up


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, b_ptr, r_ptr, y_ptr, ssi_ptr, sso_ptr,
                 M, N, K, stride_x, stride_w, stride_r, stride_y, eps, NTI,
                 HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr, NORM: tl.constexpr,
                 NTP: tl.constexpr, SS_OUT: tl.constexpr, MP: tl.constexpr, BN: tl.constexpr,
                 S1: tl.constexpr, S2: tl.constexpr, C: tl.constexpr, PDL: tl.constexpr):
    rn = tl.program_id(1) * BN + tl.arange(0, BN)  # grid axis 1 tiles the columns (store_partial_sumsq)
    rm = tl.arange(0, MP)
    acc, acc_up = _slot_sums(x_ptr, w_ptr, rn, rm, M, N, K, stride_x, stride_w, GLU, S1, S2, C, PDL)
    if NORM:  # a weightless RMSNorm of x, applied to the sums
        rstd = rstd_of_partials(ssi_ptr, rm, M, NTI, K, eps, NTP)[:, None]
        acc *= rstd
        acc_up *= rstd
    gemm_epilogue(acc, acc_up, rm, rn, M, N, b_ptr, r_ptr, stride_r, y_ptr, stride_y, sso_ptr,
                  HAS_BIAS, HAS_RES, GLU, SS_OUT)


def launch_gemv(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, residual: torch.Tensor | None,
                y: torch.Tensor, config: GemvConfig, glu: bool, norm, sumsq: bool) -> torch.Tensor | None:
    """One launch of the kernel for kernels.linear's `_launch` (same arguments; `norm` its
    RowNorm or None). Returns y's rows' partial sums of squares [M, tiles] with a residual add
    or `sumsq`."""
    m, k = x2.shape
    n_out = w.shape[0] // 2 if glu else w.shape[0]
    bn, _, warps = config
    tiles = triton.cdiv(n_out, bn)
    s1, s2, c = slots(k, w.element_size())
    r = residual if residual is not None else y
    sso = torch.empty(m, tiles, dtype=torch.float32, device=x2.device) if residual is not None or sumsq else None
    eps, ssi = norm if norm is not None else (0.0, None)
    nti = ssi.shape[1] if ssi is not None else 1
    _gemv_kernel[(1, tiles)](
        x2, w, b if b is not None else w, r, y, ssi if ssi is not None else y, sso if sso is not None else y,
        m, n_out, k, x2.stride(0), w.stride(0), r.stride(0), y.stride(0), eps, nti,
        HAS_BIAS=b is not None, HAS_RES=residual is not None, GLU=glu, NORM=ssi is not None,
        NTP=triton.next_power_of_2(nti), SS_OUT=sso is not None, MP=triton.next_power_of_2(m), BN=bn,
        S1=s1, S2=s2, C=c, num_warps=warps, num_stages=1, **pdl_args(x2))
    return sso
