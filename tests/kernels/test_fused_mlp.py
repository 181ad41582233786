"""The decode MLP in one launch and its sum (kernels/fused_mlp.py) against the three launches of
kernels/linear.py it replaces and the torch composition: x + down @ silu_mul(gate_up @ rmsnorm(x)),
the norm weightless (folded into gate_up) and run from the sums of squares x's writer left; the
result carries its own for the next norm. Which calls it takes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import fused_mlp as FM
from kernels import gemv
from kernels import linear as L
from kernels._dispatch import batch_invariant, triton_on_cpu
from kernels.norm import row_sumsq_of


def randn(*shape, device="cpu", seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device)


def residual_stream(m: int, h: int, device) -> torch.Tensor:
    """x as the decoder writes it: a residual GEMM's output, carrying its rows' sums of squares."""
    a = randn(m, 48, device=device, seed=5)
    return L.linear_triton(a, randn(h, 48, device=device, seed=6, scale=0.2),
                           residual=randn(m, h, device=device, seed=7, scale=3.0))


def reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    g, u = (h @ gate_up.float().t()).chunk(2, dim=-1)
    return x.float() + (F.silu(g) * u) @ down.float().t()


@pytest.mark.parametrize(("m", "h", "inter"), [(1, 96, 1024), (4, 200, 2048), (3, 130, 4096)])
def test_the_fused_mlp_equals_the_three_launches_and_torch(device, monkeypatch, m, h, inter):
    """H not a multiple of the K block nor of down's column block; I in 64 blocks of 16, 32 and 64
    rows (FM.row_block)."""
    monkeypatch.setattr(gemv, "GEMV", False)
    x = residual_stream(m, h, device)
    gate_up = randn(2 * inter, h, device=device, seed=1, scale=h ** -0.5)
    down = randn(h, inter, device=device, seed=2, scale=inter ** -0.5)
    with triton_on_cpu():
        got = FM.fused_mlp(x, gate_up, down, 1e-5)
        three = L.linear_triton(L.linear_glu_triton(x, gate_up, norm=(None, 1e-5)), down, residual=x)
    assert FM.row_block(inter) == {1024: 16, 2048: 32, 4096: 64}[inter]
    torch.testing.assert_close(got, three, atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(got, reference(x, gate_up, down, 1e-5).to(got.dtype), atol=1e-4, rtol=1e-4)
    partials = row_sumsq_of(got)
    assert partials is not None
    torch.testing.assert_close(partials.sum(dim=1), got.float().pow(2).sum(dim=1), rtol=1e-5, atol=1e-3)


def test_which_mlp_calls_it_takes(device, monkeypatch):
    """On (PDSERVE_FUSED_MLP=1) it takes up to FUSED_MLP_MAX_M rows that carry their sums of
    squares, with an intermediate of at least MIN_PROGRAMS row blocks; not the batch-invariant mode."""
    gate_up, down = randn(2 * 1024, 64, device=device), randn(64, 1024, device=device)
    x = residual_stream(2, 64, device)
    with triton_on_cpu():
        monkeypatch.setattr(FM, "ENABLED", False)
        assert not FM.applies(x, gate_up, down)
        monkeypatch.setattr(FM, "ENABLED", True)
        assert FM.applies(x, gate_up, down)
        assert not FM.applies(residual_stream(FM.FUSED_MLP_MAX_M + 1, 64, device), gate_up, down)
        assert not FM.applies(x.clone(), gate_up, down)  # no sums of squares
        assert not FM.applies(x, gate_up[: 2 * 512], down[:, :512])  # 512 / 16 = 32 blocks: too few
        with batch_invariant():
            assert not FM.applies(x, gate_up, down)
    assert device == "cuda" or not FM.applies(x, gate_up, down)  # CPU tensors outside triton_on_cpu
