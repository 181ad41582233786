"""Causal varlen attention of a fresh prefill step: a Triton flash-attention kernel.

    out[t, h] = softmax(scale * q[t, h] . k[s, h // G]) v[s, h // G]   over the keys s of t's row
                with s <= t (rows: query_start, the same for queries and keys)

The meaning is `kernels.flash_varlen`'s (torch's flash attention 2), for the case it serves: a
step whose rows have no cached keys, so queries and keys are the step's own packed tokens.

Shapes and strides (G = Hq // Hkv; D a power of two, 16..256):
    q             [T, Hq, D]   a strided view is fine (last stride 1); fp16, bf16 or fp32
    k, v          [T, Hkv, D]  the same
    query_start   [R + 1]      int32 or int64, cumulative; tokens past query_start[R] are
                               padding: their output is left unwritten (torch.empty)
    max_q         host int >= every row's length (a graph passes its bucket)
    returns       [T, Hq, D]   q's dtype, contiguous

Grid: (cdiv(max_q, BLOCK_M), Hq, R). A program takes BLOCK_M queries of one row and one head;
the last query tile of a row goes first (the grid's first index is reversed), so the long
causal tiles start before the short ones. Keys below the tile's first query are visited
without a mask; the tiles on the diagonal with the causal mask. Scores are in log2 units
(exp2, log2(e) folded into the scale); sums in fp32, P rounded to the input dtype for the
P @ V product as flash attention does. It opens with `wait_for_previous` (kernels/pdl.py). No host sync: the launcher reads only host ints, so a
prefill CUDA graph captures it. `flash_prefill_ref` is the plain-torch meaning; the tests
hold the kernel to it, on the CPU through the Triton interpreter (TRITON_INTERPRET=1).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.pdl import pdl_args, wait_for_previous

_LOG2E = math.log2(math.e)
Config = tuple[int, int, int, int]  # (BLOCK_M, BLOCK_N, num_warps, num_stages)


@triton.jit
def _tile(q, k_ptrs, v_ptrs, n0, offs_m, offs_n, row_len, m_i, l_i, acc, qk_scale, stride_kt, stride_vt,
          MASK: tl.constexpr, PRECISION: tl.constexpr):
    """One key tile [n0, n0 + BLOCK_N) into the online softmax state (m_i, l_i, acc)."""
    keys = n0 + offs_n
    if MASK:
        ok = keys < row_len
        k = tl.load(k_ptrs + n0 * stride_kt, mask=ok[None, :], other=0.0)
        v = tl.load(v_ptrs + n0 * stride_vt, mask=ok[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs + n0 * stride_kt)
        v = tl.load(v_ptrs + n0 * stride_vt)
    s = tl.dot(q, k, input_precision=PRECISION) * qk_scale
    if MASK:
        s = tl.where((keys[None, :] <= offs_m[:, None]) & ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _flash_prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, query_start_ptr, qk_scale,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    head = tl.program_id(1)
    row = tl.program_id(2)
    start = tl.load(query_start_ptr + row).to(tl.int64)
    row_len = (tl.load(query_start_ptr + row + 1) - start).to(tl.int32)
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M  # the longest tiles first
    if m0 < row_len:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        kv_head = head // GROUP
        q = tl.load(q_ptr + (start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=(offs_m < row_len)[:, None], other=0.0)
        k_ptrs = k_ptr + (start + offs_n)[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]  # [D, N]
        v_ptrs = v_ptr + (start + offs_n)[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]  # [N, D]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for n0 in range(0, m0, BLOCK_N):  # keys below every query of the tile: no mask
            m_i, l_i, acc = _tile(q, k_ptrs, v_ptrs, n0, offs_m, offs_n, row_len, m_i, l_i, acc, qk_scale,
                                  stride_kt, stride_vt, False, PRECISION)
        for n0 in range(m0, tl.minimum(m0 + BLOCK_M, row_len), BLOCK_N):  # the diagonal
            m_i, l_i, acc = _tile(q, k_ptrs, v_ptrs, n0, offs_m, offs_n, row_len, m_i, l_i, acc, qk_scale,
                                  stride_kt, stride_vt, True, PRECISION)
        out = acc / l_i[:, None]
        tl.store(out_ptr + (start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=(offs_m < row_len)[:, None])


def default_config(max_q: int, heads: int, rows: int, head_dim: int) -> Config:
    """Tiles from a sweep on an H100 (bench/gpu/gpu_attn_prefill.py): 64 x 64 with 4 warps, and
    128 x 64 with 8 warps for rows of 4096 tokens and more, where the larger tile's fewer
    programs still fill the GPU (64-query tiles keep the short steps' programs many)."""
    if max_q >= 4096:
        return 128, 64, 8, 3
    return 64, 64, 4 if head_dim <= 64 else 8, 3


def flash_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: torch.Tensor,
                  max_q: int, scale: float, config: Config | None = None) -> torch.Tensor:
    """The module docstring's `out` (Triton on CUDA, or anywhere under TRITON_INTERPRET=1)."""
    t, hq, d = q.shape
    assert k.shape[1] and hq % k.shape[1] == 0 and d == triton.next_power_of_2(d), (q.shape, k.shape)
    rows = query_start.numel() - 1
    out = torch.empty(t, hq, d, dtype=q.dtype, device=q.device)
    if rows == 0 or t == 0 or max_q == 0:
        return out
    block_m, block_n, warps, stages = config or default_config(max_q, hq, rows, d)
    assert block_m % block_n == 0, "the diagonal's tiles start at the query tile"
    grid = (triton.cdiv(max_q, block_m), hq, rows)
    _flash_prefill_kernel[grid](
        q, k, v, out, query_start, scale * _LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        GROUP=hq // k.shape[1], HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=warps, num_stages=stages,
        **pdl_args(q))
    return out


def flash_prefill_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Plain torch, row by row, softmax in fp32; padding tokens' outputs are zero."""
    out = torch.zeros_like(q)
    group = q.shape[1] // k.shape[1]
    bounds = query_start.tolist()
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        qr = q[a:b].float().transpose(0, 1)  # [Hq, L, D]
        kr = k[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        vr = v[a:b].float().repeat_interleave(group, dim=1).transpose(0, 1)
        s = (qr @ kr.transpose(1, 2)) * scale
        causal = torch.ones(b - a, b - a, dtype=torch.bool, device=q.device).tril()
        p = s.masked_fill(~causal, float("-inf")).softmax(-1)
        out[a:b] = (p @ vr).transpose(0, 1).to(q.dtype)
    return out
