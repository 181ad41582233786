"""The fresh-prefill q/k/v GEMM with rotary and the cache write in its epilogue
(kernels/qkv_rope.py) equals the GEMM + `kernels.rotary.rope_and_cache_with_k`: its output
(rotated q and k, v) and the K/V cache it writes, with and without bias, grouped heads, ragged
tokens and K, pointer and TMA loads; 16-bit against cuBLAS + the rotary kernel on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.qkv_rope import Config, _tma_usable, default_config, qkv_rope, qkv_rope_ref, usable


def case(t: int, heads: tuple[int, int, int], k: int, device: str, bias: bool, dtype=torch.float32, seed=0):
    hq, hkv, d = heads
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=g).to(dtype).to(device)
    w = (torch.randn((hq + 2 * hkv) * d, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn((hq + 2 * hkv) * d, generator=g).to(dtype).to(device) if bias else None
    positions = torch.randint(0, 64, (t,), generator=g).to(device)
    ang = torch.arange(64).float()[:, None] * torch.rand(d // 2, generator=g)[None, :]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(device), torch.cat([ang.sin()] * 2, -1).to(device)
    block = 4
    cache = torch.zeros(2, t // block + 2, block, hkv, d, dtype=dtype, device=device)
    slots = torch.randperm(cache.shape[1] * block, generator=g)[:t].to(device)
    return x, w, b, heads, positions, cos, sin, cache, slots


@pytest.mark.parametrize("t,heads,k,bias,config", [
    (7, (4, 2, 16), 40, False, Config(16, 2, 16, 4, 1)),   # ragged tokens and K, q/k/v heads in one tile
    (33, (6, 3, 32), 64, True, Config(16, 4, 32, 4, 2, group_m=2)),  # heads not a multiple of the tile
    (20, (2, 1, 64), 32, False, Config(16, 1, 16, 4, 1)),
])
@pytest.mark.parametrize("tma", [False, True])
def test_kernel_equals_gemm_then_rotary(device, t, heads, k, bias, config, tma):
    x, w, b, heads, pos, cos, sin, cache, slots = case(t, heads, k, device, bias)
    cfg = config._replace(tma=tma)
    if tma and not _tma_usable(x, w, cfg):
        pytest.skip("no tensor descriptors here (a GPU before Hopper, or an older Triton)")
    want_cache = cache.clone()
    want = qkv_rope_ref(x, w, b, heads, pos, cos, sin, want_cache, slots)
    got = qkv_rope(x, w, b, heads, pos, cos, sin, cache, slots, cfg)
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(cache, want_cache, atol=3e-5, rtol=3e-5)


def test_default_tiles_and_use_follow_the_step():
    assert default_config(128, 48, 64, 2048).bh < default_config(8192, 48, 64, 2048).bh
    w = torch.empty(3072, 2048)
    assert usable(torch.empty(128, 2048), w, 64) and not usable(torch.empty(8192, 2048), w, 64)
    assert not usable(torch.empty(128, 2048), w, 48)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-bit against cuBLAS + the rotary kernel on a GPU")
@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("t", [1, 128, 1000, 4096])
def test_16_bit_matches_cublas_and_rotary(t, tma):
    x, w, b, heads, pos, cos, sin, cache, slots = case(t, (32, 8, 64), 2048, "cuda", False, torch.bfloat16)
    want_cache = cache.clone()
    want = qkv_rope_ref(x, w, b, heads, pos, cos, sin, want_cache, slots)
    got = qkv_rope(x, w, b, heads, pos, cos, sin, cache, slots, default_config(t, 48, 64, 2048)._replace(tma=tma))
    torch.testing.assert_close(got.float(), want.float(), rtol=2**-6, atol=2e-2)
    torch.testing.assert_close(cache.float(), want_cache.float(), rtol=2**-6, atol=2e-2)


@pytest.mark.parametrize("tma", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_a_folded_norm_from_partial_sums_equals_norm_then_gemm_then_rotary(device, tma, bias):
    """norm = (eps, x's partial row sums of squares): the kernel normalizes x's rows itself (the
    norm's weight folded into w), the row scale applied to the sums before the bias and rotation."""
    x, w, b, heads, pos, cos, sin, cache, slots = case(33, (6, 3, 32), 64, device, bias)
    x = 3 * x
    partials = torch.stack([c.float().pow(2).sum(dim=1) for c in x.split([16, 16, 32], dim=1)], dim=1)
    cfg = Config(16, 4, 32, 4, 2, tma=tma, group_m=2)
    if tma and not _tma_usable(x, w, cfg):
        pytest.skip("no tensor descriptors here (a GPU before Hopper, or an older Triton)")
    want_cache = cache.clone()
    want = qkv_rope_ref(x, w, b, heads, pos, cos, sin, want_cache, slots, norm_eps=1e-5)
    got = qkv_rope(x, w, b, heads, pos, cos, sin, cache, slots, cfg, norm=(1e-5, partials))
    torch.testing.assert_close(got, want, atol=3e-5, rtol=3e-5)
    torch.testing.assert_close(cache, want_cache, atol=3e-5, rtol=3e-5)
