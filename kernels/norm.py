"""RMSNorm, optionally fused with the residual add in front of it: one program per row.

    rms_norm(x, w, eps)            = w * round_x(x * rsqrt(mean(x^2) + eps))
    add_rms_norm(d, r, w, eps)     = (rms_norm(s, w, eps), s)  with  s = round_x(r + d)

w None: no weight (a unit one), for a norm whose weight is folded into the next GEMM's
(`engine.model.llama.fuse_projections`).

x^2, the mean and rsqrt are fp32; `round_x` rounds to x's dtype, and the product with w is
rounded to the promoted dtype of w and x. These are the rounding steps of the torch code
(`engine.model.llama.RMSNorm` and the decoder layer's `x = x + delta`), which `*_ref` reproduces
bit for bit; the kernel differs only in the order of the fp32 sum over H.

Shapes: x, d, r [..., H] with the last dim contiguous (other strides are free for 2-D inputs;
higher ranks are flattened with `reshape`); w [H]. H need not be a power of two (the row is
one masked block of next_power_of_2(H)). The outputs are new contiguous tensors, except that
`add_rms_norm(None, r, ...)` hands back `r` itself as the new residual, and `rms_norm(x, w, eps,
out)` writes into `out` [rows, H] (any row stride: a column block of a wider tensor, so that
the MTP's norms write the halves of its eh_proj input and no cat runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def rstd_of_partials(ss_ptr, rm, M, NT, K, eps, NTP: tl.constexpr):
    """[BM] 1 / rms of rows `rm` (of width K) from their NT partial sums of squares
    (ss_ptr [M, NT] fp32, `store_partial_sumsq`), summed in one order whatever M is."""
    t = tl.arange(0, NTP)
    parts = tl.load(ss_ptr + rm[:, None].to(tl.int64) * NT + t[None, :],
                    mask=(rm[:, None] < M) & (t[None, :] < NT), other=0.0)
    return tl.rsqrt(tl.reduce(parts, 1, _add) / K + eps)


@triton.jit
def store_partial_sumsq(out, rm, rn, M, N, ss_ptr):
    """ss_ptr[rm, this column tile] := the row sums of squares of a GEMM's rounded output tile
    `out` [BM, BN] (columns rn; grid axis 1 tiles the columns)."""
    v = tl.where(rn[None, :] < N, out.to(tl.float32), 0.0)
    n_tiles = tl.num_programs(1)
    tl.store(ss_ptr + rm.to(tl.int64) * n_tiles + tl.program_id(1), tl.reduce(v * v, 1, _add), mask=rm < M)


@triton.jit
def _add_rms_norm_kernel(
    delta_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_delta, stride_residual, stride_out, stride_sum,  # row strides, in elements
    H, eps,
    HAS_DELTA: tl.constexpr, HAS_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA:  # torch adds in fp32 and rounds to the dtype
        d = tl.load(delta_ptr + row * stride_delta + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + d).to(sum_ptr.dtype.element_ty)
        tl.store(sum_ptr + row * stride_sum + cols, s, mask=mask)
        x = s.to(tl.float32)
    normed = _normed_row(x, weight_ptr, cols, mask, H, eps, sum_ptr.dtype.element_ty, HAS_WEIGHT)
    tl.store(out_ptr + row * stride_out + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _normed_row(x, weight_ptr, cols, mask, H, eps, round_ty: tl.constexpr, HAS_WEIGHT: tl.constexpr):
    """w * round(x * rsqrt(mean(x^2) + eps)) in fp32, for a row x [BLOCK] fp32 (zero past H)."""
    # tl.sum's reduction with our own combine: the kernel then calls no @jit function of
    # triton.language, so Triton's interpreter can run it even if triton was imported first
    inv_rms = tl.rsqrt(tl.reduce(x * x, 0, _add) / H + eps)
    normed = (x * inv_rms).to(round_ty).to(tl.float32)
    if HAS_WEIGHT:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        # exact in fp32 for bf16/fp16 operands, so one rounding to the output dtype, as torch
        normed = w * normed
    return normed


@triton.jit
def _mtp_input_kernel(ids_ptr, table_ptr, h_ptr, we_ptr, wh_ptr, out_ptr, stride_table, stride_h, stride_out,
                      H, eps_e, eps_h, E_WEIGHT: tl.constexpr, H_WEIGHT: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):
    """Row r of the MTP's eh_proj input: program (r, 0) writes enorm(table[ids[r]]) into its first
    H columns, program (r, 1) hnorm(h[r]) into the next H."""
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dst = out_ptr + row * stride_out + cols
    if tl.program_id(1) == 0:
        tok = tl.load(ids_ptr + row).to(tl.int64)
        x = tl.load(table_ptr + tok * stride_table + cols, mask=mask, other=0.0)
        normed = _normed_row(x.to(tl.float32), we_ptr, cols, mask, H, eps_e, x.dtype, E_WEIGHT)
        tl.store(dst, normed.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        x = tl.load(h_ptr + row * stride_h + cols, mask=mask, other=0.0)
        normed = _normed_row(x.to(tl.float32), wh_ptr, cols, mask, H, eps_h, x.dtype, H_WEIGHT)
        tl.store(dst + H, normed.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _embed_kernel(ids_ptr, table_ptr, out_ptr, ss_ptr, stride_table, stride_out, M, V, H,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Columns of row r: out[r] := table[ids[r]] (zeros for an id outside [0, V): never read out
    of bounds), and that tile's sum of squares into ss_ptr [M, tiles] (`store_partial_sumsq`)."""
    wait_for_previous(PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    tok = tl.load(ids_ptr + row).to(tl.int64)
    known = (tok >= 0) & (tok < V)
    x = tl.load(table_ptr + tl.where(known, tok, 0) * stride_table + cols, mask=cols < H, other=0.0)
    x = tl.where(known, x, 0.0).to(x.dtype)
    tl.store(out_ptr + row.to(tl.int64) * stride_out + cols, x, mask=cols < H)
    store_partial_sumsq(x[None, :], row + tl.zeros([1], dtype=tl.int32), cols, M, H, ss_ptr)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, H] with a contiguous last dim (a view whenever possible)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    return x.reshape(-1, x.shape[-1])


def add_rms_norm_triton(
    delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor | None, eps: float,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = residual.shape[-1]
    assert weight is None or weight.shape == (h,), f"weight {tuple(weight.shape)} does not match hidden size {h}"
    r = _rows(residual)
    if delta is None:
        d, s = r, r  # not read, not written (HAS_DELTA is off)
    else:
        assert delta.shape == residual.shape, f"delta {tuple(delta.shape)} vs residual {tuple(residual.shape)}"
        d = _rows(delta)
        s = torch.empty(r.shape, dtype=torch.result_type(r, d), device=r.device)
    dtype = s.dtype if weight is None else torch.promote_types(weight.dtype, s.dtype)
    if out is None:
        out = torch.empty(r.shape, dtype=dtype, device=r.device)
    assert out.shape == r.shape and out.stride(-1) == 1 and out.dtype == dtype, "out: [rows, H], rows of any stride"
    block = triton.next_power_of_2(h)
    _add_rms_norm_kernel[(r.shape[0],)](
        d, r, weight.contiguous() if weight is not None else r, out, s,
        d.stride(0), r.stride(0), out.stride(0), s.stride(0),
        h, eps,
        HAS_DELTA=delta is not None, HAS_WEIGHT=weight is not None, BLOCK=block,
        num_warps=min(max(block // 256, 1), 8), enable_fp_fusion=False, **pdl_args(r),
    )
    new_residual = residual if delta is None else s.view(residual.shape)
    return (out.view(residual.shape) if out.is_contiguous() else out), new_residual


def add_rms_norm_ref(
    delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    new_residual = residual if delta is None else residual + delta
    return rms_norm_ref(new_residual, weight, eps), new_residual


def add_rms_norm(
    delta: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + delta), residual + delta); delta None: (rms_norm(residual), residual)."""
    tensors = tuple(t for t in (delta, residual, weight) if t is not None)
    if use_triton(*tensors):
        return add_rms_norm_triton(delta, residual, weight, eps)
    return add_rms_norm_ref(delta, residual, weight, eps)


def mtp_input(ids: torch.Tensor, table: torch.Tensor, h: torch.Tensor,
              e_norm: tuple[torch.Tensor | None, float], h_norm: tuple[torch.Tensor | None, float]) -> torch.Tensor:
    """[rows, 2H]: rms_norm(table[ids], *e_norm) | rms_norm(h, *h_norm), the MTP's eh_proj input
    (`engine.model.llama.CausalLM.mtp_forward`), in one launch where the embedding gather and the two
    norms took three; bit for bit what those give. `table` [V, H] and `h` [rows, H] of one dtype,
    the norms' weights (None: none) of one dtype."""
    rows, size = h.shape
    assert ids.shape == (rows,) and table.shape[1] == size and table.dtype == h.dtype
    assert table.stride(-1) == 1 and h.stride(-1) == 1
    we, wh = e_norm[0], h_norm[0]
    dtype = torch.promote_types(we.dtype if we is not None else h.dtype, h.dtype)
    assert dtype == torch.promote_types(wh.dtype if wh is not None else h.dtype, h.dtype), "one output dtype"
    out = torch.empty(rows, 2 * size, dtype=dtype, device=h.device)
    if rows:
        block = triton.next_power_of_2(size)
        _mtp_input_kernel[(rows, 2)](
            ids, table, h, we if we is not None else h, wh if wh is not None else h, out,
            table.stride(0), h.stride(0), out.stride(0), size, e_norm[1], h_norm[1],
            E_WEIGHT=we is not None, H_WEIGHT=wh is not None, BLOCK=block,
            num_warps=min(max(block // 256, 1), 8), enable_fp_fusion=False, **pdl_args(h))
    return out


def embed_with_sumsq(ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """table[ids] [rows, H], in one launch that also leaves its rows' partial sums of squares on
    it (`attach_row_sumsq`): the first layer's input norm then runs inside its q/k/v GEMM, as
    every later layer's does, instead of an embedding gather and a norm kernel. ids [rows]."""
    rows, (vocab, size) = ids.shape[0], table.shape
    assert ids.dim() == 1 and table.stride(-1) == 1
    out = torch.empty(rows, size, dtype=table.dtype, device=table.device)
    block = min(triton.next_power_of_2(size), 1024)
    tiles = triton.cdiv(size, block)
    sums = torch.empty(rows, tiles, dtype=torch.float32, device=table.device)
    if rows:
        _embed_kernel[(rows, tiles)](ids, table, out, sums, table.stride(0), out.stride(0), rows, vocab, size,
                                     BLOCK=block, num_warps=4, **pdl_args(table))
    attach_row_sumsq(out, sums)
    return out


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    return add_rms_norm_triton(None, x, weight, eps, out)[0]


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight is not None:
        y = weight * y
    return out.copy_(y.view(out.shape)) if out is not None else y


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
             out: torch.Tensor | None = None) -> torch.Tensor:
    """weight * normalize(x) over the last dim (weight None: normalize(x)): the Triton kernel on
    CUDA, else the reference; written into `out` [rows, H] (rows of any stride) when given."""
    if use_triton(*(t for t in (x, weight) if t is not None)):
        return rms_norm_triton(x, weight, eps, out)
    return rms_norm_ref(x, weight, eps, out)


# A tensor written by a GEMM that also stored its rows' partial sums of squares
# (`kernels.linear`, the residual GEMMs) carries them here, with its version: an in-place change
# since (cuBLAS's in-place add, an all-reduce) makes them stale, and they are then not used.
_ROW_SUMSQ = "_pdserve_row_sumsq"


def attach_row_sumsq(t: torch.Tensor, partials: torch.Tensor) -> None:
    setattr(t, _ROW_SUMSQ, (partials, t._version))


def row_sumsq_of(t: torch.Tensor) -> torch.Tensor | None:
    """The partial sums of squares [rows, tiles] fp32 of `t`'s rows, if they still hold."""
    got = getattr(t, _ROW_SUMSQ, None)
    return got[0] if got is not None and got[1] == t._version else None


def forget_row_sumsq(t: torch.Tensor) -> None:
    """`t` was changed in a way its version may not show (a collective writing it in place)."""
    if hasattr(t, _ROW_SUMSQ):
        delattr(t, _ROW_SUMSQ)
