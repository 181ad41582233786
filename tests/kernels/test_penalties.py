"""The decode step's penalty kernels (kernels/penalties.py) against their torch references: the
penalized logits at every verify position from the slot state read through the rows (fp32, the
same results), and the emitted tokens' counts added to that state."""

from __future__ import annotations

import pytest
import torch

from kernels.penalties import (
    count_emitted_ref,
    count_emitted_triton,
    penalize_rows_ref,
    penalize_rows_triton,
)

SLOTS, VOCAB = 6, 1500  # two vocabulary blocks, the second partial


def _state(g: torch.Generator, device: str) -> tuple[torch.Tensor, ...]:
    counts = torch.randint(0, 3, (SLOTS, VOCAB), generator=g, dtype=torch.int32) * (torch.rand(SLOTS, VOCAB, generator=g) < 0.05)
    bias = torch.where(torch.rand(SLOTS, VOCAB, generator=g) < 0.02, torch.randn(SLOTS, VOCAB, generator=g) * 5, 0.0)
    prompt = torch.rand(SLOTS, VOCAB, generator=g) < 0.05
    presence, frequency = torch.rand(SLOTS, generator=g) * 2, torch.rand(SLOTS, generator=g)
    repetition = 1 + torch.rand(SLOTS, generator=g)
    repetition[0] = 1.0  # off
    return tuple(t.to(device) for t in (presence, frequency, repetition, bias, counts.to(torch.int32), prompt))


@pytest.mark.parametrize("k", [0, 3])
def test_penalized_verify_logits_equal_the_gathered_reference(device, k):
    g = torch.Generator().manual_seed(k)
    state = _state(g, device)
    rows = torch.tensor([3, 0, 5, SLOTS - 1], device=device)
    logits = (torch.randn(4, k + 1, VOCAB, generator=g) * 4).to(device)
    drafts = torch.randint(0, VOCAB, (4, k), generator=g).to(device)
    drafts[0] = 7  # a draft repeated: counted once per earlier position
    got = penalize_rows_triton(logits, rows, drafts, *state)
    want = penalize_rows_ref(logits, rows, drafts, *state)
    assert got.dtype == torch.float32 and got.shape == (4, k + 1, VOCAB)
    exact = 0.0 if device == "cpu" else 1e-6  # the same IEEE ops in the same order; a GPU gets an ulp of slack
    torch.testing.assert_close(got, want, rtol=exact, atol=exact)


def test_emitted_tokens_are_counted_into_their_slots(device):
    counts = torch.zeros(SLOTS, VOCAB, dtype=torch.int32, device=device)
    rows = torch.tensor([2, 0, SLOTS - 1, SLOTS - 1], device=device)  # padding rows emit nothing
    tokens = torch.tensor([[4, 4, 9, -1], [1499, -1, -1, -1], [3, 3, 3, 3], [3, 3, 3, 3]], device=device)
    n = torch.tensor([3, 1, 0, 0], device=device)
    want = counts.clone()
    count_emitted_triton(counts, rows, tokens, n)
    count_emitted_ref(want, rows, tokens, n)
    assert torch.equal(counts, want) and int(counts[2, 4]) == 2 and int(counts.sum()) == 4
