"""A decode step's MLP in one launch and its sum (`PDSERVE_FUSED_MLP=1`; off by default, not yet
measured on a GPU):

    fused_mlp(x, gate_up, down, norm) = x + down @ (silu(g) * u),  [g | u] = gate_up @ norm(x)

What it saves. kernels/linear.py runs this as three launches: gate/up (silu * up in its epilogue),
down (split in K) and down's split-K sum. Between gate/up and down the whole GPU waits for the
slowest gate/up program, then down's loads start again from nothing: on an H100 the two add 3-4 us
a Llama-1B layer over their weights' read (BENCHMARKS.md, session 10). Here a program owns BI rows of
the intermediate: it computes them (gate and up rows over the whole of K, the norm's row scale,
silu * up, rounded as the torch composition rounds), then at once multiplies them by the BI
columns of down they meet, for every output column, and stores that partial product. No program
waits for another until the sum launch (`_sum_partials_kernel`: the I / BI partials of a column tile
in one load, summed as a tree, with the residual add and the next norm's sums of squares), so down's
reads follow each program's gate/up reads with no gap across the GPU.

Neither loop builds its A operand: gate/up's loads x's rows as they are, down's takes the program's
silu * up rows from registers and loads only weights, so Triton pipelines both (kernels/linear.py's
text says why A tiles built inside a loop lost). Rounding: g and u rounded to the model dtype, silu and
the product too (`silu_mul`), as `linear_glu`; down's sums differ from kernels/linear.py's only in
their fp32 order (I / BI partials of BI terms, then a tree over the partials). Decode sizes only (up to
FUSED_MLP_MAX_M rows), outside the batch-invariant mode, where x carries its rows' sums of squares
(the weightless norm folded into gate/up) and I splits into at least MIN_PROGRAMS row blocks.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from kernels._dispatch import invariant, use_triton
from kernels.epilogue import gemm_epilogue, silu_mul
from kernels.norm import attach_row_sumsq, row_sumsq_of, rstd_of_partials
from kernels.pdl import pdl_args, wait_for_previous

ENABLED = os.environ.get("PDSERVE_FUSED_MLP", "0") == "1"
FUSED_MLP_MAX_M = 4  # decode and a k=3 verify at batch 1
MIN_PROGRAMS = 64  # I // BI at least this: fewer programs cannot pull the weights at the copy rate
BM = 16  # tl.dot's smallest M
BK = 128  # gate/up's K block
BN2 = 128  # down's output columns a loop step
ROW_BLOCK = int(os.environ.get("PDSERVE_FUSED_MLP_BI", "0"))  # BI for sweeps (0: `row_block` chooses)


@triton.jit
def _mlp_kernel(x_ptr, wgu_ptr, wd_ptr, ssi_ptr, ws_ptr, M, H, NI, stride_x, eps, NTI,  # NI: I
                NTP: tl.constexpr, BM: tl.constexpr, BI: tl.constexpr, BK: tl.constexpr, BN2: tl.constexpr,
                PRECISION: tl.constexpr, PDL: tl.constexpr):
    """Program p: intermediate rows p * BI .. p * BI + BI of every row of x, then their share of
    down's product, stored as partial p of ws [NI / BI, M, H] (fp32)."""
    pid = tl.program_id(1)
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    ri = pid * BI + tl.arange(0, BI)
    rk = tl.arange(0, BK)
    gate_rows = wgu_ptr + ri[:, None].to(tl.int64) * H
    up_rows = gate_rows + NI.to(tl.int64) * H
    g0 = tl.load(gate_rows + rk[None, :], mask=rk[None, :] < H, other=0.0)  # weights: before the wait
    u0 = tl.load(up_rows + rk[None, :], mask=rk[None, :] < H, other=0.0)
    wait_for_previous(PDL)
    x_rows = x_ptr + rm[:, None].to(tl.int64) * stride_x
    m_ok = rm[:, None] < M
    a0 = tl.load(x_rows + rk[None, :], mask=m_ok & (rk[None, :] < H), other=0.0)
    acc_g = tl.dot(a0, tl.trans(g0), input_precision=PRECISION)
    acc_u = tl.dot(a0, tl.trans(u0), input_precision=PRECISION)
    for k0 in range(BK, H, BK):  # in order
        kk = k0 + rk
        a = tl.load(x_rows + kk[None, :], mask=m_ok & (kk[None, :] < H), other=0.0)
        acc_g += tl.dot(a, tl.trans(tl.load(gate_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)),
                        input_precision=PRECISION)
        acc_u += tl.dot(a, tl.trans(tl.load(up_rows + kk[None, :], mask=kk[None, :] < H, other=0.0)),
                        input_precision=PRECISION)
    rstd = rstd_of_partials(ssi_ptr, rm, M, NTI, H, eps, NTP)[:, None]
    h = silu_mul(acc_g * rstd, acc_u * rstd, x_ptr.dtype.element_ty)  # [BM, BI], the model dtype
    rn = tl.arange(0, BN2)
    part = ws_ptr + pid.to(tl.int64) * M * H + rm[:, None] * H
    for n0 in range(0, H, BN2):
        cols = n0 + rn
        wd = tl.load(wd_ptr + cols[:, None].to(tl.int64) * NI + ri[None, :], mask=cols[:, None] < H, other=0.0)
        y = tl.dot(h, tl.trans(wd), input_precision=PRECISION)
        tl.store(part + cols[None, :], y, mask=m_ok & (cols[None, :] < H))


@triton.jit
def _sum_partials_kernel(ws_ptr, r_ptr, y_ptr, sso_ptr, M, N, stride_r, stride_y,
                         S: tl.constexpr, SP2: tl.constexpr, BN: tl.constexpr, PDL: tl.constexpr):
    """y[m, cols] = r[m, cols] + the S partials' sum (ws [S, M, N] fp32), read in one load (a loop
    of S dependent-free loads would wait on L2 S times) and summed as a tree, the same every run;
    with the rows' partial sums of squares for the next norm."""
    wait_for_previous(PDL)
    m = tl.program_id(0)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    s = tl.arange(0, SP2)
    parts = tl.load(ws_ptr + s[:, None].to(tl.int64) * M * N + m * N + rn[None, :],
                    mask=(s[:, None] < S) & (rn[None, :] < N), other=0.0)
    acc = tl.sum(parts, axis=0)[None, :]
    gemm_epilogue(acc, acc, m + tl.arange(0, 1), rn, M, N, r_ptr, r_ptr, stride_r, y_ptr, stride_y, sso_ptr,
                  False, True, False, True)


def row_block(inter: int) -> int | None:
    """BI: the widest power of two from 16 to 64 that splits `inter` into at least MIN_PROGRAMS
    blocks, or None."""
    for bi in (ROW_BLOCK,) if ROW_BLOCK else (64, 32, 16):
        if inter % bi == 0 and inter // bi >= MIN_PROGRAMS:
            return bi
    return None


def applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether `fused_mlp` takes this MLP call (see the module's text)."""
    m = x.numel() // x.shape[-1]
    return (ENABLED and use_triton(x, gate_up) and not invariant() and 0 < m <= FUSED_MLP_MAX_M
            and row_sumsq_of(x) is not None and row_block(down.shape[1]) is not None
            and x.stride(-1) == 1 and gate_up.is_contiguous() and down.is_contiguous())


def fused_mlp(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, eps: float) -> torch.Tensor:
    """x + down @ silu_mul(gate_up @ rmsnorm(x)) for x [..., H] whose writer left its rows' sums of
    squares (the norm's weight folded into gate_up); the result carries its own, for the next norm."""
    h, inter = x.shape[-1], down.shape[1]
    assert gate_up.shape == (2 * inter, h) and down.shape == (h, inter), "gate_up [2I, H] and down [H, I]"
    x2 = x.reshape(-1, h)
    ssi = row_sumsq_of(x)
    assert ssi is not None, "x carries no sums of squares for the norm"
    m, bi = x2.shape[0], row_block(inter)
    assert bi is not None
    ws = torch.empty(inter // bi, m, h, dtype=torch.float32, device=x.device)
    y = torch.empty(m, h, dtype=x.dtype, device=x.device)
    pdl = pdl_args(x2)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _mlp_kernel[(triton.cdiv(m, BM), inter // bi)](
        x2, gate_up, down, ssi, ws, m, h, inter, x2.stride(0), eps, ssi.shape[1],
        NTP=triton.next_power_of_2(ssi.shape[1]), BM=BM, BI=bi, BK=BK, BN2=BN2, PRECISION=precision,
        num_warps=4, num_stages=3, **pdl)
    parts, bn = inter // bi, 32
    sso = torch.empty(m, triton.cdiv(h, bn), dtype=torch.float32, device=x.device)
    _sum_partials_kernel[(m, triton.cdiv(h, bn))](ws, x2, y, sso, m, h, x2.stride(0), y.stride(0), S=parts,
                                                  SP2=triton.next_power_of_2(parts), BN=bn, num_warps=4, **pdl)
    out = y.view(x.shape)
    attach_row_sumsq(out, sso)
    return out
