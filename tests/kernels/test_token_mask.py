"""The grammar-mask kernel (kernels/token_mask.py) against its torch reference: every verify
position of every row masked with its state row's bitmask, the kept logits unchanged bit for bit."""

from __future__ import annotations

import pytest
import torch

from kernels.token_mask import mask_rows_ref, mask_rows_triton

SLOTS, VOCAB = 5, 1500  # two vocabulary blocks, the second partial; 47 words, the last partial


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_verify_logits_equal_the_reference(device, k, dtype):
    g = torch.Generator().manual_seed(k)
    words = -(-VOCAB // 32)
    bitmask = torch.randint(-(2**31), 2**31, (SLOTS, k + 1, words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32)
    bitmask[1] = -1  # a slot without a grammar: every token allowed
    rows = torch.tensor([3, 1, SLOTS - 1, 0]).to(device)
    logits = (torch.randn(4, k + 1, VOCAB, generator=g) * 4).to(dtype).to(device)
    got = mask_rows_triton(logits, rows, bitmask.to(device))
    want = mask_rows_ref(logits, rows, bitmask.to(device))
    assert got.dtype == dtype and torch.equal(got, want)
    assert torch.equal(got[1], logits[1])
    assert bool(torch.isinf(got[0]).any())
