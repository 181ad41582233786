"""The split-K prefill GEMM (kernels/gemm_splitk.py) equals the reference: ragged M, N and K
edges, one and several K slices (the workspace sum), with and without the residual, written in
place into the residual; fp32 to summation order, bf16 to a rounding on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import gemm_splitk
from kernels.gemm_splitk import Config, splitk_gemm, splitk_gemm_ref


def operands(m: int, n: int, k: int, device: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    r = torch.randn(m, n, generator=g).to(dtype).to(device)
    return x, w, r


def _skip_without_tma(x, w):
    if not gemm_splitk.usable(x, w):
        pytest.skip("no tensor descriptors here (a GPU before Hopper, or an older Triton)")


@pytest.mark.parametrize("m,n,k,config", [
    (5, 24, 48, Config(16, 16, 16, 1, stages=1)),     # ragged M and N, one slice
    (33, 32, 64, Config(16, 16, 16, 3, stages=1, group_m=2)),  # a ragged last K slice, grouped tiles
    (16, 48, 128, Config(16, 16, 32, 4, stages=1)),
])
@pytest.mark.parametrize("with_residual", [False, True])
def test_kernel_equals_reference(device, m, n, k, config, with_residual):
    x, w, r = operands(m, n, k, device)
    _skip_without_tma(x, w)
    res = r if with_residual else None
    got = splitk_gemm(x, w, res, config=config)
    assert got.shape == (m, n)
    torch.testing.assert_close(got, splitk_gemm_ref(x, w, res), atol=2e-5, rtol=2e-5)


def test_in_place_into_the_residual(device):
    x, w, r = operands(20, 32, 64, device)
    _skip_without_tma(x, w)
    want = splitk_gemm_ref(x, w, r)
    got = splitk_gemm(x, w, r, out=r, config=Config(16, 16, 16, 2, stages=1))
    assert got.data_ptr() == r.data_ptr()
    torch.testing.assert_close(r, want, atol=2e-5, rtol=2e-5)


def test_default_config_fills_the_gpu_and_keeps_slices_long():
    cfg = gemm_splitk.default_config(128, 2048, 8192)
    assert cfg.split > 1 and 8192 // cfg.split >= 512
    assert gemm_splitk.default_config(128, 2048, 512).split == 1
