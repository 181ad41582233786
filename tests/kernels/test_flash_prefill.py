"""The prefill flash kernel equals its torch reference (kernels/flash_prefill.py): rows of any
length (0 too, and past a tile's end), grouped query heads, padding tokens after the last row,
strided q/k/v views (as the fused q/k/v GEMM hands them out), every block shape it launches."""

from __future__ import annotations

import pytest
import torch

from kernels.flash_prefill import default_config, flash_prefill, flash_prefill_ref


def packed(lens: list[int], pad: int, hq: int, hkv: int, d: int, device: str, dtype=torch.float32, seed: int = 0):
    """q, k, v as views of one [T, (Hq + 2 Hkv) * D] tensor, and query_start."""
    g = torch.Generator().manual_seed(seed)
    t = sum(lens) + pad
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(dtype).to(device)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
    cu = torch.tensor([0, *lens], dtype=torch.int32).cumsum(0, dtype=torch.int32).to(device)
    return q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), cu


@pytest.mark.parametrize("lens,pad,hq,hkv,d,config", [
    ([37], 0, 4, 2, 16, (16, 16, 4, 1)),
    ([1, 50, 0, 17], 11, 6, 2, 32, (32, 16, 4, 2)),
    ([64, 64], 0, 3, 1, 16, (32, 32, 4, 1)),
    ([5, 33], 3, 2, 2, 64, (16, 16, 4, 1)),
])
def test_kernel_equals_reference(device, lens, pad, hq, hkv, d, config):
    q, k, v, cu = packed(lens, pad, hq, hkv, d, device)
    scale = d**-0.5
    got = flash_prefill(q, k, v, cu, max(lens), scale, config)
    want = flash_prefill_ref(q, k, v, cu, scale)
    n = sum(lens)  # padding tokens' outputs are unwritten
    torch.testing.assert_close(got[:n], want[:n], atol=2e-5, rtol=2e-5)


def test_a_graph_bound_on_max_q_changes_nothing(device):
    """max_q above every row (a graph's bucket) launches more tiles, which find no queries."""
    q, k, v, cu = packed([9, 20], 4, 2, 1, 16, device, seed=1)
    exact = flash_prefill(q, k, v, cu, 20, 0.25, (16, 16, 4, 1))
    bound = flash_prefill(q, k, v, cu, 64, 0.25, (16, 16, 4, 1))
    torch.testing.assert_close(bound[:29], exact[:29], atol=0, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="16-bit against torch's flash attention on a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_matches_flash_attention(dtype):
    from kernels.flash_varlen import flash_varlen

    lens = [300, 1, 129, 700]
    q, k, v, cu = packed(lens, 13, 32, 8, 64, "cuda", dtype)
    for config in (None, (128, 64, 4, 3), (64, 64, 4, 3), (128, 32, 4, 4)):
        got = flash_prefill(q, k, v, cu, 1024, 0.125, config)[: sum(lens)]
        want = flash_varlen(q, k, v, cu, 1024, 0.125)[: sum(lens)]
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


def test_tiles_follow_the_step():
    assert default_config(512, 32, 16, 64)[:2] == (64, 64)
    assert default_config(4096, 32, 4, 64)[:3] == (128, 64, 8)
