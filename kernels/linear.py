"""Linear layers, y = x @ w.T (+ b), with a batch-invariant path for `--deterministic`.

    x [M, K] (rows contiguous in K), w [N, K] (an nn.Linear weight, rows contiguous), b [N] or None

`linear` is F.linear unless this thread is inside `kernels._dispatch.batch_invariant()`. Then a
row's result must not depend on how many rows share the call (cuBLAS and CPU BLAS pick their
tiling, split-K and kernels by M, so a row's reduction order changes with the batch):
  * CUDA: `linear_invariant_triton`, one fixed tile configuration (BLOCK_M x BLOCK_N, K in
    BLOCK_K steps accumulated in order, fp32) for every M, so each output element is summed
    in the same order whatever M is; grid (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N)), no split-K;
  * elsewhere: `linear_invariant_ref`, one GEMV per row (slow, and exactly as invariant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels._dispatch import invariant, use_triton

BLOCK_M, BLOCK_N, BLOCK_K = 32, 64, 64


@triton.jit
def _linear_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_x, stride_w, stride_y,
                   HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(x_ptr + rm[:, None].to(tl.int64) * stride_x + kk[None, :],
                    mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        b = tl.load(w_ptr + rn[:, None].to(tl.int64) * stride_w + kk[None, :],
                    mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += tl.dot(a, tl.trans(b), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def linear_invariant_triton(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    assert w.stride(-1) == 1 and w.shape[1] == k, f"weight {tuple(w.shape)} does not take {k} inputs"
    m, n = x2.shape[0], w.shape[0]
    y = torch.empty(m, n, dtype=torch.promote_types(x.dtype, w.dtype), device=x.device)
    if m:
        grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
        _linear_kernel[grid](x2, w, b if b is not None else w, y, m, n, k, x2.stride(0), w.stride(0), y.stride(0),
                             HAS_BIAS=b is not None, PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                             BM=BLOCK_M, BN=BLOCK_N, BK=BLOCK_K, num_warps=4, num_stages=3)
    return y.view(*lead, n)


def linear_invariant_ref(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """One F.linear per row: every row is computed as a batch of one."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = [F.linear(x2[i : i + 1], w, b) for i in range(x2.shape[0])]
    y = torch.cat(rows) if rows else F.linear(x2, w, b)
    return y.view(*x.shape[:-1], w.shape[0])


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    if not invariant():
        return F.linear(x, w, b)
    if use_triton(x, w):
        return linear_invariant_triton(x, w, b)
    return linear_invariant_ref(x, w, b)
