"""The register-tile GEMV (kernels/gemv.py), which kernels/linear.py's launches of a few rows over
small weights take: its choice of tiles, when `linear` takes it, and its results against the
torch composition with each epilogue (bias, residual add, silu * up, folded norm, sums of squares)
at 1-4 rows. tests/kernels/test_linear.py runs the split-K kernel's cases with this one off."""

from __future__ import annotations

import pytest
import torch

from kernels import gemv as G
from kernels import linear as L
from kernels._dispatch import batch_invariant, triton_on_cpu
from kernels.norm import attach_row_sumsq, row_sumsq_of


def randn(*shape, device="cpu", seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device)


def test_tiles_leave_one_per_sm_and_large_tiles_or_rows_keep_the_split_k_kernel(monkeypatch):
    """SmolLM2's weights at an H100's 132 SMs, bf16: one warp a program, K = 576 in 3 slots of 256
    columns (768 a row), 1536 in 6; a lane holds at most 96 weight elements for q/k/v and gate/up,
    48 for o and down."""
    monkeypatch.setattr(G, "GEMV_MAX_M", 4)
    bf = torch.bfloat16
    assert G.slots(576, 2) == (2, 1, 256) and G.slots(1536, 2) == (4, 2, 256) and G.slots(48, 4) == (1, 0, 64)
    assert G.gemv_config(1, torch.empty(960, 576, dtype=bf), False, 132) == (4, 1024, 1)  # q/k/v: 240 programs
    assert G.gemv_config(4, torch.empty(576, 576, dtype=bf), False, 132) == (2, 1024, 1)  # o: 288 programs
    assert G.gemv_config(4, torch.empty(576, 1536, dtype=bf), False, 132) == (1, 2048, 1)  # down: 576 programs
    # gate/up: 16 rows (96 programs) fit the tile, but 2 a program keep 96 elements a lane: 768 programs
    assert G.gemv_config(1, torch.empty(3072, 576, dtype=bf), True, 132) == (2, 1024, 1)
    assert G.gemv_config(1, torch.empty(64, 48, dtype=torch.float32), False, 132) == (1, 64, 1)  # K below a warp's width
    assert G.gemv_config(G.GEMV_MAX_M + 1, torch.empty(960, 576, dtype=bf), False) is None  # too many rows
    assert G.gemv_config(1, torch.empty(576, 8192, dtype=bf), False) is None  # 8 x 8192: too large a tile
    assert G.gemv_config(1, torch.empty(2048, 2048, dtype=bf), False) is None  # 8 MB: over GEMV_MAX_BYTES
    monkeypatch.setattr(G, "GEMV_MAX_M", 1)  # the default: batch 1 without drafts
    assert G.gemv_config(2, torch.empty(960, 576, dtype=bf), False, 132) is None


def test_linear_takes_it_for_a_few_rows_but_not_in_the_invariant_mode_or_for_an_argmax(device, monkeypatch):
    monkeypatch.setattr(G, "GEMV_MAX_M", 4)
    calls = []
    real = L.launch_gemv
    monkeypatch.setattr(L, "launch_gemv", lambda x2, *a: calls.append(x2.shape[0]) or real(x2, *a))
    w, r = randn(40, 64, device=device, seed=1, scale=0.1), randn(5, 40, device=device, seed=2)
    with triton_on_cpu():
        L.linear(randn(3, 64, device=device), w, residual=r[:3])  # here
        L.linear_glu(randn(2, 64, device=device), randn(80, 64, device=device, seed=3, scale=0.1))  # here
        L.linear(randn(5, 64, device=device), w, residual=r)  # five rows: the split-K kernel
        L.linear_argmax(randn(1, 64, device=device), w)  # an argmax: the split-K kernel's
        with batch_invariant():
            L.linear(randn(1, 64, device=device), w, residual=r[:1])  # the invariant mode: the split-K kernel
    assert calls == [3, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 2, 3, 4])
def test_each_epilogue_matches_the_torch_composition(device, monkeypatch, m, dtype):
    """A decoder layer's four GEMMs in a row, each through the kernel: q/k/v with a bias and the
    folded input norm, o with the residual add, gate/up with silu * up and the folded norm, down
    with the residual add (each residual GEMM leaving the sums of squares the next norm reads)."""
    monkeypatch.setattr(G, "GEMV_MAX_M", 4)
    tol = {"atol": 5e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 2e-2}
    h, q, inter = 96, 48, 72
    x = L.linear_triton(randn(m, 40, device=device).to(dtype), randn(h, 40, device=device, seed=9).to(dtype),
                        residual=randn(m, h, device=device, seed=8, scale=3.0).to(dtype))
    assert row_sumsq_of(x) is not None
    ws = [randn(*s, device=device, seed=i, scale=0.1).to(dtype) for i, s in
          enumerate([(q, h), (h, q), (2 * inter, h), (h, inter)])]
    bias = randn(q, device=device, seed=7).to(dtype)
    qkv = L.linear_triton(x, ws[0], bias, (None, 1e-5))
    torch.testing.assert_close(qkv, L.linear_ref(x, ws[0], bias, (None, 1e-5)), **tol)
    x2 = L.linear_triton(qkv, ws[1], residual=x)
    torch.testing.assert_close(x2, L.linear_ref(qkv, ws[1], residual=x), **tol)
    sums = row_sumsq_of(x2)
    assert sums is not None and sums.shape[0] == m
    torch.testing.assert_close(sums.sum(dim=1), x2.float().pow(2).sum(dim=1), rtol=1e-4, atol=1e-3)
    act = L.linear_glu_triton(x2, ws[2], (None, 1e-5))
    torch.testing.assert_close(act, L.linear_glu_ref(x2, ws[2], (None, 1e-5)), **tol)
    out = L.linear_triton(act, ws[3], residual=x2)
    torch.testing.assert_close(out, L.linear_ref(act, ws[3], residual=x2), **tol)


def test_a_plain_gemm_asked_for_sums_of_squares_leaves_them(device):
    x, w = randn(2, 72, device=device), randn(40, 72, device=device, seed=1, scale=0.1)
    y = L.linear_triton(x, w, sumsq=True)
    torch.testing.assert_close(y, L.linear_ref(x, w), atol=5e-5, rtol=1e-5)
    partials = row_sumsq_of(y)
    assert partials is not None
    torch.testing.assert_close(partials.sum(dim=1), y.float().pow(2).sum(dim=1), rtol=1e-5, atol=1e-4)


def _layer_outputs(x: torch.Tensor, w: torch.Tensor, w_glu: torch.Tensor, r: torch.Tensor) -> list[torch.Tensor]:
    """The kernel's plain, folded-norm, residual (with sums of squares) and silu * up launches."""
    y_res = L.linear_triton(x, w, residual=r)
    sums = row_sumsq_of(y_res)
    assert sums is not None
    return [L.linear_triton(x, w), L.linear_triton(x, w, norm=(None, 1e-5)), y_res, sums.sum(dim=1),
            L.linear_glu_triton(x, w_glu, (None, 1e-5))]


def test_long_rows_over_several_warp_widths(device, monkeypatch):
    """K = 300 (padded to 512, masked past 300): two or four warp widths of K (bf16, fp32); M = 1..4
    against the torch composition."""
    monkeypatch.setattr(G, "GEMV_MAX_M", 4)
    for dtype, tol in ((torch.float32, {"atol": 1e-4, "rtol": 1e-5}), (torch.bfloat16, {"atol": 3e-2, "rtol": 2e-2})):
        w, w_glu = (randn(*s, device=device, seed=i, scale=0.05).to(dtype) for i, s in enumerate([(24, 300), (48, 300)]))
        for m in (1, 2, 3, 4):
            x = randn(m, 300, device=device, seed=10 + m).to(dtype)
            attach_row_sumsq(x, x.float().pow(2).sum(dim=1, keepdim=True))
            r = randn(m, 24, device=device, seed=20 + m).to(dtype)
            y, y_norm, y_res, y_sums, act = _layer_outputs(x, w, w_glu, r)
            torch.testing.assert_close(y, L.linear_ref(x, w), **tol)
            torch.testing.assert_close(y_norm, L.linear_ref(x, w, norm=(None, 1e-5)), **tol)
            torch.testing.assert_close(y_res, L.linear_ref(x, w, residual=r), **tol)
            torch.testing.assert_close(y_sums, y_res.float().pow(2).sum(dim=1), rtol=1e-4, atol=1e-3)
            torch.testing.assert_close(act, L.linear_glu_ref(x, w_glu, (None, 1e-5)), **tol)


def test_a_verify_row_gives_the_bits_of_a_one_row_launch(device, monkeypatch):
    """Row 0 of a 4-row launch (its other rows different) has the bits of the same row launched
    alone: each row's sum runs in one order whatever M is."""
    monkeypatch.setattr(G, "GEMV_MAX_M", 4)
    w, w_glu = randn(24, 300, device=device, seed=1, scale=0.05), randn(48, 300, device=device, seed=2, scale=0.05)
    x4, r4 = randn(4, 300, device=device, seed=3), randn(4, 24, device=device, seed=4)
    attach_row_sumsq(x4, x4.pow(2).sum(dim=1, keepdim=True))
    x1, r1 = x4[:1].clone(), r4[:1].clone()
    attach_row_sumsq(x1, x4.pow(2).sum(dim=1, keepdim=True)[:1])
    for four, one in zip(_layer_outputs(x4, w, w_glu, r4), _layer_outputs(x1, w, w_glu, r1), strict=True):
        assert torch.equal(four[:1], one)
