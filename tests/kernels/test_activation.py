"""silu(gate) * up: the Triton launcher matches the torch reference (fp32 to ~1e-6, bf16 to
a rounding), the reference is the MLP's `silu(gate_proj(x)) * up_proj(x)` bit for bit, and the
public function dispatches to the reference off CUDA and inside `reference_kernels()`."""

from __future__ import annotations

import pytest
import torch

from kernels import _dispatch, activation

DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype=torch.float32, device="cpu", seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (3 * torch.randn(*shape, generator=g)).to(dtype=dtype, device=device)


def assert_within_a_rounding(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """fp32: the kernel's exp and divide may differ from torch's in the last bit. bf16: that
    can move silu's rounding by an ulp; Triton's interpreter also truncates fp32 -> bf16 casts
    where GPUs round to nearest even, an ulp more per cast."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
    else:
        rtol = 2**-6 if actual.is_cuda else 2**-5  # 2**-7: one bf16 ulp, relative
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [1, 96, 1500])  # 1500: two column blocks, the last one masked
@pytest.mark.parametrize("tokens", [1, 5])
def test_silu_and_mul_kernel_matches_reference(device, dtype, inter, tokens):
    gate_up = randn(tokens, 2 * inter, dtype=dtype, device=device)
    out = activation.silu_and_mul_triton(gate_up)
    assert out.shape == (tokens, inter) and out.is_contiguous()
    assert_within_a_rounding(out, activation.silu_and_mul_ref(gate_up))


def test_silu_and_mul_kernel_reads_strided_rows_and_leading_dims(device):
    wide = randn(6, 300, device=device)
    gate_up = wide[:, :200]  # row stride 300
    assert_within_a_rounding(activation.silu_and_mul_triton(gate_up), activation.silu_and_mul_ref(gate_up))
    batched = wide.view(2, 3, 300)
    out = activation.silu_and_mul_triton(batched)
    assert out.shape == (2, 3, 150)
    assert_within_a_rounding(out, activation.silu_and_mul_ref(batched))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_equals_the_mlp_math_bit_for_bit(dtype):
    gate, up = randn(5, 96, dtype=dtype), randn(5, 96, dtype=dtype, seed=1)
    fused = torch.cat([gate, up], dim=-1)
    assert torch.equal(activation.silu_and_mul_ref(fused), torch.nn.functional.silu(gate) * up)


def test_public_function_runs_the_reference_off_cuda_and_in_reference_kernels(device):
    gate_up = randn(5, 2 * 96, dtype=torch.bfloat16, device=device)
    ref = activation.silu_and_mul_ref(gate_up)
    with _dispatch.reference_kernels():
        assert torch.equal(activation.silu_and_mul(gate_up), ref)
    if device == "cpu":
        assert torch.equal(activation.silu_and_mul(gate_up), ref)
    else:
        assert_within_a_rounding(activation.silu_and_mul(gate_up), ref)
