"""The q/k/v GEMM of a fresh prefill step with rotary embedding and the K/V cache write in its
epilogue: one launch where cuBLAS + `kernels.rotary.rope_and_cache` took two.

    qkv = x @ w.T (+ b)            w [(Hq + 2 Hkv) D, K]: the heads of q, then k, then v
    q, k rotated as `kernels.rotary` rotates them (rotate_half, fp32, from the rounded GEMM
    output, no FMA); k and v written to their cache slots; returns [T, (Hq + 2 Hkv) D] holding
    rotated q, rotated k and v (what the fresh step's flash attention reads).

Only the order of the GEMM's fp32 sums differs from the two-kernel path.

Tiling: rotate_half pairs column d of a head with column d + D/2, so a program computes its
tile in "half columns": j in [0, (Hq + 2 Hkv) D/2) stands for head j // (D/2), offset j % (D/2);
one accumulator sums the first halves' weight rows (h D + d), a second the matching second
halves' (h D + D/2 + d), and the epilogue rotates the pair in registers, as `kernels.gemm_glu`
pairs gate and up rows. Weight rows are gathered by pointer loads (`_qkv_rope_kernel`), or by
a 3-D TMA descriptor over w viewed as [heads, 2, D/2, K] (`_qkv_rope_tma_kernel`, Hopper).
Opens with `wait_for_previous` (kernels/pdl.py); no host sync. Padding tokens write their slots
(the trash block), as the rotary kernel does. `qkv_rope_ref` is the meaning; the tests run
the kernel on the CPU under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.gemm_glu import _tile_ids
from kernels.norm import rms_norm_ref, rstd_of_partials
from kernels.pdl import pdl_args, wait_for_previous
from kernels.rotary import rope_and_cache_with_k

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: pointer loads only
    TensorDescriptor = None


class Config(NamedTuple):
    bm: int
    bh: int  # heads per program (a power of two): BH * D/2 half columns
    bk: int
    warps: int
    stages: int
    tma: bool = False
    group_m: int = 8


@triton.jit
def _rope_epilogue(acc1, acc2, rm, rj, M, HQ, HKV, HALF, b_ptr, pos_ptr, cos_ptr, sin_ptr, stride_cos,
                   cache_ptr, slot_ptr, stride_cache_kv, stride_cache_slot, stride_cache_h, y_ptr, stride_y,
                   ssi_ptr, NTI, K, eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, NTP: tl.constexpr):
    """The norm's row scale, bias, rotation of q and k, the stores of qkv and of k, v into the cache."""
    if NORM:
        rstd = rstd_of_partials(ssi_ptr, rm, M, NTI, K, eps, NTP)[:, None]
        acc1, acc2 = acc1 * rstd, acc2 * rstd
    head = rj // HALF
    d = rj % HALF
    col = head * (2 * HALF) + d  # the first half's column of qkv
    heads = HQ + 2 * HKV
    col_ok = head < heads
    if HAS_BIAS:
        acc1 += tl.load(b_ptr + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        acc2 += tl.load(b_ptr + col + HALF, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dtype = y_ptr.dtype.element_ty
    x1 = acc1.to(dtype).to(tl.float32)  # the GEMM's rounded output, as rope reads it
    x2 = acc2.to(dtype).to(tl.float32)
    row_ok = rm < M
    pos = tl.load(pos_ptr + rm, mask=row_ok, other=0)
    trig = pos[:, None] * stride_cos + d[None, :]
    c1 = tl.load(cos_ptr + trig)
    c2 = tl.load(cos_ptr + trig + HALF)
    s1 = tl.load(sin_ptr + trig)
    s2 = tl.load(sin_ptr + trig + HALF)
    rot = (head < HQ + HKV)[None, :]  # q and k heads; v passes through
    o1 = tl.where(rot, x1 * c1 - x2 * s1, x1).to(dtype)
    o2 = tl.where(rot, x2 * c2 + x1 * s2, x2).to(dtype)
    mask = row_ok[:, None] & col_ok[None, :]
    out = y_ptr + rm[:, None].to(tl.int64) * stride_y + col[None, :]
    tl.store(out, o1, mask=mask)
    tl.store(out + HALF, o2, mask=mask)
    kv = (head >= HQ) & col_ok
    is_v = (head >= HQ + HKV).to(tl.int64)
    kv_head = tl.where(kv, head - HQ - HKV * is_v, 0)
    slot = tl.load(slot_ptr + rm, mask=row_ok, other=0)
    dst = (cache_ptr + is_v[None, :] * stride_cache_kv + slot[:, None] * stride_cache_slot
           + (kv_head * stride_cache_h + d)[None, :])
    cache_ty = cache_ptr.dtype.element_ty
    tl.store(dst, o1.to(cache_ty), mask=row_ok[:, None] & kv[None, :])
    tl.store(dst + HALF, o2.to(cache_ty), mask=row_ok[:, None] & kv[None, :])


@triton.jit
def _qkv_rope_kernel(x_ptr, w_ptr, b_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, y_ptr,
                     M, K, HQ, HKV, HALF, stride_x, stride_w, stride_cos,
                     stride_cache_kv, stride_cache_slot, stride_cache_h, stride_y, ssi_ptr, NTI, eps,
                     HAS_BIAS: tl.constexpr, NORM: tl.constexpr, NTP: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr,
                     PDL: tl.constexpr):
    wait_for_previous(PDL)
    half_cols = (HQ + 2 * HKV) * HALF
    pid_m, pid_n = _tile_ids(M, half_cols, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rj = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    w_row = tl.where(rj < half_cols, (rj // HALF) * (2 * HALF) + rj % HALF, 0)
    a_ptrs = x_ptr + tl.where(rm < M, rm, 0)[:, None].to(tl.int64) * stride_x + rk[None, :]
    w1_ptrs = w_ptr + w_row[None, :].to(tl.int64) * stride_w + rk[:, None]  # [BK, BN]
    w2_ptrs = w1_ptrs + HALF * stride_w
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc2 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
        acc1 = tl.dot(a, tl.load(w1_ptrs + k0, mask=k_ok[:, None], other=0.0), acc1, input_precision=PRECISION)
        acc2 = tl.dot(a, tl.load(w2_ptrs + k0, mask=k_ok[:, None], other=0.0), acc2, input_precision=PRECISION)
    _rope_epilogue(acc1, acc2, rm, rj, M, HQ, HKV, HALF, b_ptr, pos_ptr, cos_ptr, sin_ptr, stride_cos,
                   cache_ptr, slot_ptr, stride_cache_kv, stride_cache_slot, stride_cache_h, y_ptr, stride_y,
                   ssi_ptr, NTI, K, eps, HAS_BIAS, NORM, NTP)


@triton.jit
def _qkv_rope_tma_kernel(x_desc, w_desc, b_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, y_ptr,
                         M, K, HQ, HKV, HALF, stride_cos, stride_cache_kv, stride_cache_slot, stride_cache_h, stride_y,
                         ssi_ptr, NTI, eps, HAS_BIAS: tl.constexpr, NORM: tl.constexpr, NTP: tl.constexpr,
                         BM: tl.constexpr, BH: tl.constexpr, D2: tl.constexpr,
                         BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """The same through TMA: x_desc [M, K] in [BM, BK] blocks, w_desc over w as [heads, 2, D/2, K]
    in [BH, 1, D/2, BK] blocks (D2 = D/2 = HALF; heads past the last read as zeros)."""
    wait_for_previous(PDL)
    half_cols = (HQ + 2 * HKV) * HALF
    pid_m, pid_n = _tile_ids(M, half_cols, BM, BH * D2, GROUP_M)
    m0, h0 = pid_m * BM, pid_n * BH
    acc1 = tl.zeros([BM, BH * D2], dtype=tl.float32)
    acc2 = tl.zeros([BM, BH * D2], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = x_desc.load([m0, k0])
        w1 = w_desc.load([h0, 0, 0, k0]).reshape(BH * D2, BK)
        w2 = w_desc.load([h0, 1, 0, k0]).reshape(BH * D2, BK)
        acc1 = tl.dot(a, w1.T, acc1, input_precision=PRECISION)
        acc2 = tl.dot(a, w2.T, acc2, input_precision=PRECISION)
    rm = m0 + tl.arange(0, BM)
    rj = h0 * D2 + tl.arange(0, BH * D2)
    _rope_epilogue(acc1, acc2, rm, rj, M, HQ, HKV, HALF, b_ptr, pos_ptr, cos_ptr, sin_ptr, stride_cos,
                   cache_ptr, slot_ptr, stride_cache_kv, stride_cache_slot, stride_cache_h, y_ptr, stride_y,
                   ssi_ptr, NTI, K, eps, HAS_BIAS, NORM, NTP)


def default_config(m: int, heads: int, head_dim: int, k: int) -> Config:
    """Tiles from a sweep on an H100 (bench/gpu/gpu_qkv_rope.py): 64 rows by 64
    output columns with pointer loads for short steps, TMA and twice the columns from 1024 tokens."""
    bh = max(1, 64 // head_dim)
    return Config(64, bh, 64, 4, 4) if m < 1024 else Config(64, 2 * bh, 64, 4, 4, True)


FUSED_MAX_WORK = 1.6e9  # tokens x q/k/v width x hidden up to which the fused kernel ran faster


def usable(x: torch.Tensor, w: torch.Tensor, head_dim: int) -> bool:
    """Where the fused kernel beats cuBLAS + the rotary kernel (bench/gpu/gpu_qkv_rope.py): steps
    of up to FUSED_MAX_WORK, where one launch fewer and no round trip of q/k/v through memory
    win. Above it the GEMM loses to cuBLAS: the epilogue's scattered cache stores and the narrow
    q/k/v width cost more than they save. A power-of-two head dim of 16..256."""
    work = x.numel() * w.shape[0]  # x [T, K]: T x K x N
    return (work <= FUSED_MAX_WORK and 16 <= head_dim <= 256
            and head_dim & (head_dim - 1) == 0)


def _tma_usable(x: torch.Tensor, w: torch.Tensor, cfg: Config) -> bool:
    hopper = os.environ.get("TRITON_INTERPRET") == "1" or (
        x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return (TensorDescriptor is not None and hopper and (x.stride(0) * x.element_size()) % 16 == 0
            and (w.stride(0) * w.element_size()) % 16 == 0)


def qkv_rope(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, heads: tuple[int, int, int],
             positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
             slot_mapping: torch.Tensor, config: Config | None = None,
             norm: tuple[float, torch.Tensor] | None = None) -> torch.Tensor:
    """The module docstring's qkv [T, (Hq + 2 Hkv) D]: x [T, K] (rows contiguous in K), w and b the
    fused projection, heads (Hq, Hkv, D), positions and slot_mapping [T] int64, cos and sin
    [max_positions, D] fp32, kv_cache [2, blocks, block_size, Hkv, D] contiguous. `norm` (eps,
    x's partial row sums of squares [T, tiles]): x is normalized first, by a weightless RMSNorm
    whose row scale the kernel applies to the GEMM's sums."""
    hq, hkv, d = heads
    t, k = x.shape
    n = (hq + 2 * hkv) * d
    assert w.shape == (n, k) and x.stride(-1) == 1 and w.stride(-1) == 1 and d % 2 == 0, (x.shape, w.shape)
    assert kv_cache.is_contiguous() and kv_cache.shape[3:] == (hkv, d) and cos.stride(-1) == 1 == sin.stride(-1)
    assert cos.stride(0) == sin.stride(0)
    y = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0:
        return y
    cfg = config or default_config(t, hq + 2 * hkv, d, k)
    half = d // 2
    bn = cfg.bh * half
    grid = (triton.cdiv(t, cfg.bm) * triton.cdiv((hq + 2 * hkv) * half, bn),)
    cache_strides = (kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3))
    eps, ssi = norm if norm is not None else (0.0, None)
    nti = ssi.shape[1] if ssi is not None else 1
    common = dict(HAS_BIAS=b is not None, NORM=ssi is not None, NTP=triton.next_power_of_2(nti), BM=cfg.bm, BK=cfg.bk, GROUP_M=cfg.group_m,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg.warps,
                  num_stages=cfg.stages, enable_fp_fusion=False, **pdl_args(x))
    bias = b if b is not None else y
    if cfg.tma and _tma_usable(x, w, cfg):
        x_desc = TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk])
        w_desc = TensorDescriptor.from_tensor(w.view(hq + 2 * hkv, 2, half, k), [cfg.bh, 1, half, cfg.bk])
        _qkv_rope_tma_kernel[grid](x_desc, w_desc, bias, positions, cos, sin, kv_cache, slot_mapping, y,
                                   t, k, hq, hkv, half, cos.stride(0), *cache_strides, y.stride(0),
                                   ssi if ssi is not None else y, nti, eps, BH=cfg.bh, D2=half, **common)
    else:
        _qkv_rope_kernel[grid](x, w, bias, positions, cos, sin, kv_cache, slot_mapping, y,
                               t, k, hq, hkv, half, x.stride(0), w.stride(0), cos.stride(0), *cache_strides,
                               y.stride(0), ssi if ssi is not None else y, nti, eps, BN=bn, **common)
    return y


def qkv_rope_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, heads: tuple[int, int, int],
                 positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, norm_eps: float | None = None) -> torch.Tensor:
    """cuBLAS (or CPU BLAS) + the rotary kernel's reference (after a weightless norm, `norm_eps`)."""
    hq, hkv, d = heads
    t = x.shape[0]
    h = rms_norm_ref(x, None, norm_eps) if norm_eps is not None else x
    qkv = torch.nn.functional.linear(h, w, b)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    q = q.view(t, hq, d)
    k, v = k.view(t, hkv, d), v.view(t, hkv, d)
    q_rot, k_rot = rope_and_cache_with_k(q, k, v, positions, cos, sin, kv_cache, slot_mapping)
    return torch.cat([q_rot.reshape(t, -1), k_rot.reshape(t, -1), v.reshape(t, -1)], dim=-1)
