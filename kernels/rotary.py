"""Rotary embedding on q and k fused with the write of k and v into the paged KV cache.

Non-interleaved RoPE ("rotate_half"), per token t at position p = positions[t], per head:

    x = [x1, x2] (halves of D)      out = x * cos[p] + [-x2, x1] * sin[p]       (fp32)
    out1 = x1 * cos[p, :D/2] - x2 * sin[p, :D/2]
    out2 = x2 * cos[p, D/2:] + x1 * sin[p, D/2:]

rounded to x's dtype, exactly the ops of `engine.model.llama.RotaryEmbedding.forward` (no FMA: the
kernel is compiled with fp fusion off, so it matches the reference bit for bit). Rotated q is
returned; rotated k (rounded to k's dtype, then to the cache's) and v go to their cache slots.

Shapes: q [T, Hq, D], k and v [T, Hkv, D], last dim contiguous, other strides free (views of
one fused projection [T, (Hq + 2 Hkv) D] are fine); positions, slot_mapping [T] int64;
cos, sin [max_positions, D] fp32; kv_cache [2, num_blocks, block_size, Hkv, D] contiguous
(0: K, 1: V), slot = block_id * block_size + offset. Returns q_rot [T, Hq, D] contiguous in
q's dtype; `rope_and_cache_with_k` also returns k_rot [T, Hkv, D] in k's dtype (what a fresh
prefill's flash attention reads instead of the cache). One program per token. Slots may repeat (padding writes the trash block): one
of the writers wins.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _rotate(row_ptrs, mask, cos1, cos2, sin1, sin2, HALF):
    """Rotated halves (fp32) of the rows at `row_ptrs` (pointers to each row's first half)."""
    x1 = tl.load(row_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _rope_and_cache_kernel(
    q_ptr, k_ptr, v_ptr, positions_ptr, cos_ptr, sin_ptr, cache_ptr, slots_ptr, q_out_ptr, k_out_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    stride_cos, stride_sin, stride_cache_kv, stride_cache_slot, stride_cache_h,
    HQ, HKV, HALF,
    BLOCK_HQ: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_HALF: tl.constexpr,
    K_OUT: tl.constexpr, PDL: tl.constexpr,
):
    wait_for_previous(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    slot = tl.load(slots_ptr + t)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    d_mask = d < HALF
    cos1 = tl.load(cos_ptr + pos * stride_cos + d, mask=d_mask, other=0.0)
    cos2 = tl.load(cos_ptr + pos * stride_cos + HALF + d, mask=d_mask, other=0.0)
    sin1 = tl.load(sin_ptr + pos * stride_sin + d, mask=d_mask, other=0.0)
    sin2 = tl.load(sin_ptr + pos * stride_sin + HALF + d, mask=d_mask, other=0.0)

    hq = tl.arange(0, BLOCK_HQ)[:, None]
    mask = (hq < HQ) & d_mask
    o1, o2 = _rotate(q_ptr + t * stride_qt + hq * stride_qh + d, mask, cos1, cos2, sin1, sin2, HALF)
    out = q_out_ptr + t * stride_ot + hq * stride_oh + d
    tl.store(out, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
    tl.store(out + HALF, o2.to(q_out_ptr.dtype.element_ty), mask=mask)

    hk = tl.arange(0, BLOCK_HKV)[:, None]
    mask = (hk < HKV) & d_mask
    o1, o2 = _rotate(k_ptr + t * stride_kt + hk * stride_kh + d, mask, cos1, cos2, sin1, sin2, HALF)
    k_dst = cache_ptr + slot * stride_cache_slot + hk * stride_cache_h + d
    cache_ty = cache_ptr.dtype.element_ty
    tl.store(k_dst, o1.to(k_ptr.dtype.element_ty).to(cache_ty), mask=mask)
    tl.store(k_dst + HALF, o2.to(k_ptr.dtype.element_ty).to(cache_ty), mask=mask)
    if K_OUT:  # [T, Hkv, D] contiguous
        k_out = k_out_ptr + (t * HKV + hk) * (2 * HALF) + d
        tl.store(k_out, o1.to(k_out_ptr.dtype.element_ty), mask=mask)
        tl.store(k_out + HALF, o2.to(k_out_ptr.dtype.element_ty), mask=mask)

    v_src = v_ptr + t * stride_vt + hk * stride_vh + d
    v_dst = k_dst + stride_cache_kv
    tl.store(v_dst, tl.load(v_src, mask=mask).to(cache_ty), mask=mask)
    tl.store(v_dst + HALF, tl.load(v_src + HALF, mask=mask).to(cache_ty), mask=mask)


def rope_and_cache_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
    k_out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`k_out` [T, Hkv, D] contiguous: also receives rotated k."""
    t, hq, dim = q.shape
    hkv = k.shape[1]
    assert k.shape == v.shape == (t, hkv, dim) and dim % 2 == 0, "q [T, Hq, D], k and v [T, Hkv, D], D even"
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "q, k, v need a contiguous last dim"
    assert cos.stride(-1) == sin.stride(-1) == 1 and cos.shape[-1] == sin.shape[-1] == dim
    assert kv_cache.is_contiguous() and kv_cache.shape[3:] == (hkv, dim), "kv_cache [2, N, B, Hkv, D]"
    q_out = torch.empty((t, hq, dim), dtype=q.dtype, device=q.device)
    half = dim // 2
    assert k_out is None or (k_out.shape == k.shape and k_out.is_contiguous())
    _rope_and_cache_kernel[(t,)](
        q, k, v, positions, cos, sin, kv_cache, slot_mapping, q_out, k_out if k_out is not None else q_out,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        q_out.stride(0), q_out.stride(1),
        cos.stride(0), sin.stride(0), kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        hq, hkv, half,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_HKV=triton.next_power_of_2(hkv),
        BLOCK_HALF=triton.next_power_of_2(half), K_OUT=k_out is not None, num_warps=4, enable_fp_fusion=False,
        **pdl_args(q),
    )
    return q_out


def _rotate_ref(x: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`engine.model.llama.RotaryEmbedding.forward` with its tables passed in."""
    c = cos[positions].unsqueeze(1)
    s = sin[positions].unsqueeze(1)
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * c + rotated * s).to(x.dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Scatter K/V into their cache slots (no sync); the cache layout's one writer in torch."""
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, heads, dim)
    flat[0].index_copy_(0, slots, k.to(kv_cache.dtype))
    flat[1].index_copy_(0, slots, v.to(kv_cache.dtype))


def rope_and_cache_ref(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    write_kv(kv_cache, _rotate_ref(k, positions, cos, sin), v, slot_mapping)
    return _rotate_ref(q, positions, cos, sin)


def rope_and_cache(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Rotate q and k; write rotated k and v to their cache slots; return rotated q (no sync)."""
    args = (q, k, v, positions, cos, sin, kv_cache, slot_mapping)
    if use_triton(*args):
        return rope_and_cache_triton(*args)
    return rope_and_cache_ref(*args)


def rope_and_cache_with_k(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rope_and_cache`, also returning rotated k [T, Hkv, D] (contiguous, k's dtype)."""
    args = (q, k, v, positions, cos, sin, kv_cache, slot_mapping)
    if use_triton(*args):
        k_rot = torch.empty(k.shape, dtype=k.dtype, device=k.device)
        return rope_and_cache_triton(*args, k_out=k_rot), k_rot
    k_rot = _rotate_ref(k, positions, cos, sin)
    write_kv(kv_cache, k_rot, v, slot_mapping)
    return _rotate_ref(q, positions, cos, sin), k_rot
