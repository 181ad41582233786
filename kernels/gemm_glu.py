"""The gate/up GEMM of a prefill step with SwiGLU in its epilogue: one pass, no [T, 2I] tensor.

    out[t, i] = silu(g) * u,   g = x[t] . w[i],  u = x[t] . w[I + i]      (w = [gate; up], [2I, K])

rounded as `kernels.activation.silu_and_mul` rounds cuBLAS's output: g and u to x's dtype, silu
in fp32 then rounded, the product rounded (`kernels.epilogue.silu_mul`). Only the order of the
fp32 sums differs from cuBLAS + silu_and_mul.

Why: at prefill sizes the GEMM is compute-bound and the separate silu * up is a full memory pass
over [T, 2I] (several percent of a prefill step, BENCHMARKS.md), and one launch more per layer
for short prompts.

A program computes a BM x BN tile of `out` from two accumulators (BN gate rows and the matching
BN up rows of w), over K in BK steps. Programs are ordered in groups of GROUP_M row tiles, so
that consecutive programs share weight tiles in L2. Two ways to load the operands (`Config.tma`):
pointer loads that Triton pipelines through shared memory, or Hopper's tensor memory
accelerator from host-built descriptors (`triton.tools.tensor_descriptor`; a CUDA graph keeps
the descriptors, which name the buffers it captured). Starts with `wait_for_previous`
(kernels/pdl.py). `glu_gemm_ref` is the meaning; tests run the kernel on the CPU under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.activation import silu_and_mul_ref
from kernels.epilogue import silu_mul
from kernels.pdl import pdl_args, wait_for_previous

try:
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # an older Triton: pointer loads only
    TensorDescriptor = None


class Config(NamedTuple):
    bm: int
    bn: int  # output columns (gate rows) per program; it reads as many up rows
    bk: int
    warps: int
    stages: int
    tma: bool = False
    group_m: int = 8


@triton.jit
def _tile_ids(M, INTER, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of this program, row tiles grouped by GROUP_M for L2 reuse of w."""
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BM), tl.cdiv(INTER, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % size_m, (pid % per_group) // size_m


@triton.jit
def _glu_gemm_kernel(x_ptr, w_ptr, y_ptr, M, INTER, K, stride_x, stride_w, stride_y,
                     BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                     PRECISION: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    pid_m, pid_n = _tile_ids(M, INTER, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    a_ptrs = x_ptr + tl.where(rm < M, rm, 0)[:, None].to(tl.int64) * stride_x + rk[None, :]
    g_ptrs = w_ptr + tl.where(rn < INTER, rn, 0)[None, :].to(tl.int64) * stride_w + rk[:, None]  # [BK, BN]
    u_ptrs = g_ptrs + INTER.to(tl.int64) * stride_w
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs + k0, mask=k_ok[None, :], other=0.0)
        acc_g = tl.dot(a, tl.load(g_ptrs + k0, mask=k_ok[:, None], other=0.0), acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, tl.load(u_ptrs + k0, mask=k_ok[:, None], other=0.0), acc_u, input_precision=PRECISION)
    out = silu_mul(acc_g, acc_u, y_ptr.dtype.element_ty)
    mask = (rm[:, None] < M) & (rn[None, :] < INTER)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], out, mask=mask)


@triton.jit
def _glu_gemm_tma_kernel(x_desc, w_desc, y_ptr, M, INTER, K, stride_y,
                         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                         PRECISION: tl.constexpr, PDL: tl.constexpr):
    """The same through TMA descriptors: x_desc [M, K] in [BM, BK] blocks, w_desc [2I, K] in
    [BN, BK] blocks (out-of-range rows and columns read as zeros). INTER % BN == 0."""
    wait_for_previous(PDL)
    pid_m, pid_n = _tile_ids(M, INTER, BM, BN, GROUP_M)
    m0, n0 = pid_m * BM, pid_n * BN
    acc_g = tl.zeros([BM, BN], dtype=tl.float32)
    acc_u = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        a = x_desc.load([m0, k0])
        acc_g = tl.dot(a, w_desc.load([n0, k0]).T, acc_g, input_precision=PRECISION)
        acc_u = tl.dot(a, w_desc.load([INTER + n0, k0]).T, acc_u, input_precision=PRECISION)
    out = silu_mul(acc_g, acc_u, y_ptr.dtype.element_ty)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < INTER)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], out, mask=mask)


def default_config(m: int, inter: int, k: int) -> Config:
    """Tiles by the step's size, from a sweep on an H100 (bench/gpu/gpu_glu.py): TMA loads won at
    every size; 128 x 128 tiles with 8 warps for wide MLPs (Llama-1B's 8192 from 512 tokens,
    SmolLM2's 1536 from 4096), narrower tiles below, where 128 x 128 leaves most SMs idle."""
    if inter >= 4096:
        return Config(128, 64, 128, 8, 3, True) if m <= 256 else Config(128, 128, 64, 8, 4, True)
    if m <= 256:
        return Config(64, 64, 64, 4, 4, True)
    return Config(128, 64, 64, 4, 4, True) if m < 4096 else Config(128, 128, 64, 8, 3, True)


def tma_usable(x: torch.Tensor, w: torch.Tensor, cfg: Config) -> bool:
    inter = w.shape[0] // 2
    hopper = os.environ.get("TRITON_INTERPRET") == "1" or (
        x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return (TensorDescriptor is not None and hopper and inter % cfg.bn == 0 and (x.stride(0) * x.element_size()) % 16 == 0
            and (w.stride(0) * w.element_size()) % 16 == 0)


def glu_gemm(x: torch.Tensor, w: torch.Tensor, config: Config | None = None) -> torch.Tensor:
    """`out` [M, I] for x [M, K] (rows contiguous in K) and w [2I, K]; Triton (CUDA, or the CPU
    under TRITON_INTERPRET=1)."""
    m, k = x.shape
    inter = w.shape[0] // 2
    assert w.shape == (2 * inter, k) and x.stride(-1) == 1 and w.stride(-1) == 1, (x.shape, w.shape)
    y = torch.empty(m, inter, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(m, inter, k)
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(inter, cfg.bn),)
    common = dict(BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, GROUP_M=cfg.group_m,
                  PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                  num_warps=cfg.warps, num_stages=cfg.stages, **pdl_args(x))
    if cfg.tma and tma_usable(x, w, cfg):
        x_desc = TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk])
        w_desc = TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk])
        _glu_gemm_tma_kernel[grid](x_desc, w_desc, y, m, inter, k, y.stride(0), **common)
    else:
        _glu_gemm_kernel[grid](x, w, y, m, inter, k, x.stride(0), w.stride(0), y.stride(0), **common)
    return y


def glu_gemm_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return silu_and_mul_ref(torch.nn.functional.linear(x, w))
