"""The prefill gate/up GEMM with SwiGLU in its epilogue (kernels/gemm_glu.py) equals cuBLAS (or
CPU BLAS) + silu_and_mul: ragged M, N and K edges, both tile shapes it launches by default,
fp32 to summation order and bf16 to a rounding; the TMA form on a Hopper GPU."""

from __future__ import annotations

import pytest
import torch

from kernels import gemm_glu
from kernels.gemm_glu import Config, glu_gemm, glu_gemm_ref


def operands(m: int, inter: int, k: int, device: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype).to(device)
    w = (torch.randn(2 * inter, k, generator=g) / k**0.5).to(dtype).to(device)
    return x, w


@pytest.mark.parametrize("m,inter,k,config", [
    (5, 24, 40, Config(16, 16, 16, 4, 1)),     # every edge ragged: M, I and K tiles
    (33, 32, 64, Config(32, 16, 32, 4, 2, group_m=2)),  # grouped ordering over several row tiles
    (16, 48, 16, Config(16, 16, 16, 4, 1)),
])
def test_kernel_equals_reference(device, m, inter, k, config):
    x, w = operands(m, inter, k, device)
    got = glu_gemm(x, w, config)
    assert got.shape == (m, inter) and got.is_contiguous()
    torch.testing.assert_close(got, glu_gemm_ref(x, w), atol=2e-5, rtol=2e-5)


def test_tma_form_equals_reference(device):
    x, w = operands(37, 32, 64, device)
    cfg = Config(16, 16, 16, 4, 1, tma=True)
    if not gemm_glu.tma_usable(x, w, cfg):
        pytest.skip("no tensor descriptors here (a GPU before Hopper, or an older Triton)")
    torch.testing.assert_close(glu_gemm(x, w, cfg), glu_gemm_ref(x, w), atol=2e-5, rtol=2e-5)


def test_zero_rows(device):
    x, w = operands(0, 16, 16, device)
    assert glu_gemm(x, w, Config(16, 16, 16, 4, 1)).shape == (0, 16)


def test_default_tiles_follow_the_step():
    assert gemm_glu.default_config(128, 1536, 576).bm < gemm_glu.default_config(8192, 8192, 2048).bm


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-bit tiles and TMA on a GPU")
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("m", [1, 128, 1000, 4096])
def test_16_bit_matches_cublas_and_silu(m, tma):
    x, w = operands(m, 1536, 576, "cuda", torch.bfloat16)
    cfg = gemm_glu.default_config(m, 1536, 576)._replace(tma=tma)
    got, want = glu_gemm(x, w, cfg), glu_gemm_ref(x, w)
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=1e-2)
