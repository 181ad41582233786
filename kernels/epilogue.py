"""The epilogue of kernels/linear.py's decode GEMMs (the split-K kernel, its sum pass and the
register-tile GEMV of kernels/gemv.py): bias, silu(gate) * up, the residual add, the store and
the rows' partial sums of squares for the next GEMM's norm. Rounding as the torch composition."""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.norm import store_partial_sumsq


@triton.jit
def silu_mul(gate, up, dtype: tl.constexpr):
    """silu(gate) * up as `kernels.activation` computes it from the rounded GEMM outputs."""
    g = gate.to(dtype).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (silu * up.to(dtype).to(tl.float32)).to(dtype)


@triton.jit
def gemm_epilogue(acc, acc_up, rm, rn, M, N, b_ptr, r_ptr, stride_r, y_ptr, stride_y, sso_ptr,
                  HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, GLU: tl.constexpr, SS_OUT: tl.constexpr):
    """Writes the fp32 sums `acc` [BM, BN] (and `acc_up`, the up half's, with GLU) of rows rm,
    columns rn to y, with the ops above."""
    mask = (rm[:, None] < M) & (rn[None, :] < N)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if GLU:
        out = silu_mul(acc, acc_up, y_ptr.dtype.element_ty)
    else:
        out = acc.to(y_ptr.dtype.element_ty)
    if HAS_RES:  # torch: residual + round(x @ w.T), rounded again
        r = tl.load(r_ptr + rm[:, None].to(tl.int64) * stride_r + rn[None, :], mask=mask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rm[:, None].to(tl.int64) * stride_y + rn[None, :], out, mask=mask)
    if SS_OUT:  # for the next GEMM's norm (kernels.norm.rstd_of_partials)
        store_partial_sumsq(out, rm, rn, M, N, sso_ptr)
