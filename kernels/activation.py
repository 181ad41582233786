"""SwiGLU's elementwise half: silu(gate) * up, from one fused gate/up projection.

    out[t, i] = round(round(silu(g)) * u),   g = gate_up[t, i],  u = gate_up[t, I + i]
    silu(g) = g / (1 + exp(-g))   (fp32)

Rounding (to gate_up's dtype) follows torch's `nn.functional.silu(g) * u`, which `*_ref`
is: silu computed in fp32 and rounded, then the product rounded (exact in fp32 for bf16 and
fp16 operands, so one rounding). The kernel's exp and divide may differ from torch's in the
last fp32 bit.

Shapes: gate_up [..., 2I] with a contiguous last dim (gate: first I columns, up: last I);
returns [..., I] contiguous in gate_up's dtype. One program per (row, block of columns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._dispatch import use_triton
from kernels.pdl import pdl_args, wait_for_previous


@triton.jit
def _silu_and_mul_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, INTER, BLOCK: tl.constexpr, PDL: tl.constexpr):
    wait_for_previous(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < INTER
    g = tl.load(gate_up_ptr + row * stride_in + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up_ptr + row * stride_in + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    silu = (g / (1.0 + tl.exp(-g))).to(gate_up_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, (silu * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul_triton(gate_up: torch.Tensor) -> torch.Tensor:
    inter = gate_up.shape[-1] // 2
    assert gate_up.shape[-1] == 2 * inter, f"gate_up's last dim {gate_up.shape[-1]} is not even"
    x = gate_up if gate_up.stride(-1) == 1 else gate_up.contiguous()
    x = x.reshape(-1, 2 * inter)
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(inter), 1024)
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(inter, block))](
        x, out, x.stride(0), out.stride(0), inter,
        BLOCK=block, num_warps=4, enable_fp_fusion=False, **pdl_args(x),
    )
    return out.view(*gate_up.shape[:-1], inter)


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of a fused [..., 2I] projection: Triton on CUDA, else the reference."""
    if use_triton(gate_up):
        return silu_and_mul_triton(gate_up)
    return silu_and_mul_ref(gate_up)
