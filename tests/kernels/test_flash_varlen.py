"""Fresh prefill's flash attention (CUDA, 16-bit; skipped elsewhere) equals the paged kernel's
torch reference over the same keys: rows of several lengths, GQA, padding tokens left alone."""

from __future__ import annotations

import pytest
import torch

from kernels.flash_varlen import flash_varlen, flash_varlen_usable
from kernels.paged_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hq,hkv,dim", [(9, 3, 64), (32, 8, 64), (8, 8, 128)])
def test_flash_varlen_equals_the_reference(dtype, hq, hkv, dim):
    lens, bs, pad = [5, 130, 1, 64], 16, 7
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(lens)
    q = torch.randn(n + pad, hq, dim, device="cuda", generator=g).to(dtype)
    k = torch.randn(n + pad, hkv, dim, device="cuda", generator=g).to(dtype)
    v = torch.randn(n + pad, hkv, dim, device="cuda", generator=g).to(dtype)
    starts = torch.tensor([0] + lens, device="cuda").cumsum(0)
    # the same keys laid out in a paged cache: row r's blocks one after another from block 1
    width = max(-(-x // bs) for x in lens)
    cache = torch.zeros(2, 1 + len(lens) * width, bs, hkv, dim, device="cuda", dtype=dtype)
    tables = torch.zeros(len(lens), width, dtype=torch.long, device="cuda")
    for r, x in enumerate(lens):
        tables[r] = torch.arange(1 + r * width, 1 + (r + 1) * width)
        s = int(starts[r])
        for p in range(x):
            cache[0, tables[r, p // bs], p % bs] = k[s + p]
            cache[1, tables[r, p // bs], p % bs] = v[s + p]
    assert flash_varlen_usable(q, cache)
    scale = dim**-0.5
    got = flash_varlen(q, k, v, starts, max(lens) + 3, scale)
    want = paged_attention_ref(q, cache, tables, torch.tensor(lens, device="cuda"), starts, max(lens), scale)
    torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=2e-2, rtol=2e-2)
