"""Short prefill steps' plain GEMMs (the o and down projections, residual add included), split
along K through Hopper's tensor memory accelerator:

    y = residual + x @ w.T        x [M, K], w [N, K], M a few hundred rows

Why: at 128-512 rows a Llama-1B layer's GEMMs read their weights once and are memory-bound, and
cuBLAS reaches only 1.2-1.7 TB/s there (H100, `bench/gpu/gpu_gemv.py --prefill`, 2026-11-26:
o 6.8 us, down 19.3 us at 128 rows): an N of 2048 makes 16-32 output tiles, too few programs to
keep the memory system busy. Splitting K in SPLIT parts gives SPLIT times as many programs, each
reading one slice of the weight; the fp32 partial sums go to a workspace that a second kernel
adds up in order (the same sum whatever ran first) with the residual, rounding once, as cuBLAS's
beta = 1 epilogue does. With SPLIT = 1 the first kernel does that itself.

Programs are ordered in groups of GROUP_M row tiles (kernels/gemm_glu.py's `_tile_ids`), so the
row tiles that share a weight tile run together. Starts with `wait_for_previous`
(kernels/pdl.py). `splitk_gemm_ref` is the meaning; tests run the kernel on the CPU under
TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from kernels.gemm_glu import TensorDescriptor, _tile_ids
from kernels.pdl import pdl_args, wait_for_previous

MAX_M = int(os.environ.get("PDSERVE_SPLITK_MAX_M", "0"))  # rows up to which it runs in `kernels.linear`


class Config(NamedTuple):
    bm: int
    bn: int
    bk: int
    split: int
    warps: int = 4
    stages: int = 4
    group_m: int = 8


@triton.jit
def _splitk_kernel(x_desc, w_desc, r_ptr, y_ptr, ws_ptr, M, N, K, stride_r, stride_y, k_per_split,
                   HAS_RES: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                   BK: tl.constexpr, GROUP_M: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Tile (pid_m, pid_n) over K slice program_id(1): x_desc [M, K] in [BM, BK] blocks, w_desc
    [N, K] in [BN, BK] blocks (out-of-range rows and columns read as zeros)."""
    wait_for_previous(PDL)
    pid_m, pid_n = _tile_ids(M, N, BM, BN, GROUP_M)
    pid_k = tl.program_id(1)
    m0, n0 = pid_m * BM, pid_n * BN
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = pid_k * k_per_split
    for k0 in range(k_lo, tl.minimum(k_lo + k_per_split, K), BK):
        acc = tl.dot(x_desc.load([m0, k0]), w_desc.load([n0, k0]).T, acc, input_precision=PRECISION)
    rm = m0 + tl.arange(0, BM)
    rn = n0 + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if SPLIT == 1:
        _store(acc, rm, rn, mask, r_ptr, stride_r, y_ptr, stride_y, HAS_RES)
    else:
        tl.store(ws_ptr + (pid_k * M + rm[:, None]).to(tl.int64) * N + rn[None, :], acc, mask=mask)


@triton.jit
def _store(acc, rm, rn, mask, r_ptr, stride_r, y_ptr, stride_y, HAS_RES: tl.constexpr):
    if HAS_RES:
        acc += tl.load(r_ptr + rm[:, None].to(tl.int64) * stride_r + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_kernel(ws_ptr, r_ptr, y_ptr, M, N, stride_r, stride_y, HAS_RES: tl.constexpr, SPLIT: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for s in range(SPLIT):  # in order
        acc += tl.load(ws_ptr + (s * M + rm[:, None]).to(tl.int64) * N + rn[None, :], mask=mask, other=0.0)
    _store(acc, rm, rn, mask, r_ptr, stride_r, y_ptr, stride_y, HAS_RES)


def default_config(m: int, n: int, k: int) -> Config:
    """Tiles by shape, from a sweep on an H100 (bench/gpu/gpu_splitk.py): enough programs to
    cover the SMs a few times over."""
    bm = 64 if m <= 64 else 128
    bn = 64
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    split = 1
    while tiles * split < 264 and k // (split * 2) >= 512:
        split *= 2
    return Config(bm, bn, 128 if bm <= 64 else 64, split)


def usable(x: torch.Tensor, w: torch.Tensor) -> bool:
    """TMA needs Hopper (or the interpreter), 16-byte aligned rows, and a contiguous x."""
    hopper = os.environ.get("TRITON_INTERPRET") == "1" or (
        x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9)
    return (TensorDescriptor is not None and hopper and x.dim() == 2 and x.is_contiguous() and w.is_contiguous()
            and (x.shape[1] * x.element_size()) % 16 == 0)


def splitk_gemm(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None,
                out: torch.Tensor | None = None, config: Config | None = None) -> torch.Tensor:
    """residual + x @ w.T into `out` ([M, N], may be `residual` itself: each element is read
    before it is written, by the same program), or a new tensor."""
    m, k = x.shape
    n = w.shape[0]
    assert w.shape[1] == k and usable(x, w), (x.shape, w.shape)
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    cfg = config or default_config(m, n, k)
    k_per = triton.cdiv(triton.cdiv(k, cfg.split), cfg.bk) * cfg.bk
    split = triton.cdiv(k, k_per)
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    r = residual if residual is not None else y
    pdl = pdl_args(x)
    x_desc = TensorDescriptor.from_tensor(x, [cfg.bm, cfg.bk])
    w_desc = TensorDescriptor.from_tensor(w, [cfg.bn, cfg.bk])
    grid = (triton.cdiv(m, cfg.bm) * triton.cdiv(n, cfg.bn), split)
    _splitk_kernel[grid](x_desc, w_desc, r, y, ws, m, n, k, r.stride(0), y.stride(0), k_per,
                         HAS_RES=residual is not None, SPLIT=split, BM=cfg.bm, BN=cfg.bn, BK=cfg.bk,
                         GROUP_M=cfg.group_m, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                         num_warps=cfg.warps, num_stages=cfg.stages, **pdl)
    if split > 1:
        _sum_kernel[(triton.cdiv(m, 64), triton.cdiv(n, 64))](
            ws, r, y, m, n, r.stride(0), y.stride(0), HAS_RES=residual is not None, SPLIT=split, BM=64, BN=64, **pdl)
    return y


def splitk_gemm_ref(x: torch.Tensor, w: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
    y = torch.nn.functional.linear(x.float(), w.float())
    return (y + residual.float() if residual is not None else y).to(x.dtype)
