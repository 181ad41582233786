"""Causal varlen attention of a fresh prefill through PyTorch's flash attention.

    out[t, h] = softmax(scale * q[t, h] . k[s, h // G]) v[s, h // G]   over the keys s of t's row
                with s <= t (rows: query_start, the same for queries and keys)

q [T, Hq, D], k and v [T, Hkv, D] (last dim contiguous), query_start [R+1] int64 (cumulative;
tokens past query_start[R] are padding: their output is left unwritten), max_q >= every row's
length (host int). Returns [T, Hq, D] in q's dtype.

This is `torch.nn.attention.varlen.varlen_attn` (flash attention 2's varlen kernel), which
torch versions expose with different arguments: causal as `window_size=(-1, 0)` or
`is_causal=True`, GQA through `enable_gqa` or natively. Where the wrapper cannot take GQA,
the aten op under it is called (it does). fp16/bf16 on CUDA only (`flash_varlen_usable`);
everything else takes the paged kernel (kernels/paged_attention.py). No host sync: shapes
come from host ints, so it is captured in the prefill step's CUDA graph.

The engine's fresh steps run kernels/flash_prefill.py, which is faster inside the prefill graph;
this one is its reference on the GPU (tests, bench/gpu/gpu_attn_prefill.py), and
`flash_varlen_usable` says where that kernel serves.
"""

from __future__ import annotations

import functools
import inspect

import torch


@functools.cache
def _varlen_params() -> frozenset[str] | None:
    """The argument names of this torch's `varlen_attn`, or None when it has none."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return frozenset(inspect.signature(varlen_attn).parameters)


def flash_varlen_usable(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """fp16/bf16 CUDA tensors and a torch with varlen flash attention."""
    if not q.is_cuda:
        return False
    if q.dtype not in (torch.float16, torch.bfloat16) or kv_cache.dtype != q.dtype:
        return False
    return _varlen_params() is not None and q.shape[-1] <= 256


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_start: torch.Tensor,
                 max_q: int, scale: float) -> torch.Tensor:
    """The module docstring's `out`: flash attention 2, causal, over packed rows."""
    params = _varlen_params()
    assert params is not None, "this torch has no torch.nn.attention.varlen"
    cu = query_start if query_start.dtype == torch.int32 else query_start.to(torch.int32)
    gqa = q.shape[1] != k.shape[1]
    if gqa and "enable_gqa" not in params:
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max_q, max_q, 0.0, True, False, scale=scale)
        return out[0]
    from torch.nn.attention.varlen import varlen_attn

    kwargs: dict = {"enable_gqa": True} if gqa else {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    elif abs(scale - q.shape[-1] ** -0.5) > 1e-12:
        raise ValueError("this torch's varlen_attn takes no scale, and the model's is not 1/sqrt(head_dim)")
    out = varlen_attn(q, k, v, cu, cu, max_q, max_q, **kwargs)
    return out[0] if isinstance(out, tuple) else out
