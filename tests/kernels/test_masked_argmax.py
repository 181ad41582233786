"""The grammar mask inside the LM head's argmax (kernels/linear.py `linear_argmax(..., mask=)`)
against what it replaces: the logits masked by kernels/token_mask.py, then torch's argmax. Inputs
are small integers, so every logit is exact whatever the order of the sums (the kernel and the
torch composition agree bit for bit on any CPU) and ties are everywhere: the first allowed
column must win, across tiles too. Masks: random bits, every token allowed, one token allowed,
none allowed (torch's argmax of a row of -inf is 0, and so is the kernel's)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import linear as L
from kernels._dispatch import triton_on_cpu
from kernels.token_mask import mask_rows_ref

HIDDEN, VOCAB, STATES = 64, 1000, 7  # 32 words a row, the last one partial; several column tiles
ALL, NONE, ONE, TIED = 0, 1, 2, 3  # state rows: every token allowed, none, one per position, a tie's first barred


def small_ints(*shape: int, seed: int, device: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-2, 3, shape, generator=g).float().to(device)


def weights(device: str) -> torch.Tensor:
    """Random small-integer rows, rows 10, 500 and 900 equal (three tied columns, in three tiles)."""
    w = small_ints(VOCAB, HIDDEN, seed=1, device=device)
    w[500] = w[900] = w[10] = 2.0
    return w


def bitmasks(k1: int, device: str) -> torch.Tensor:
    """[STATES, k1, W]: the special state rows above, random bits in the rest."""
    words = -(-VOCAB // 32)
    g = torch.Generator().manual_seed(k1)
    bits = torch.randint(-(2**31), 2**31, (STATES, k1, words), generator=g, dtype=torch.int64).to(torch.int32)
    bits[ALL], bits[NONE], bits[ONE] = -1, 0, 0
    for i in range(k1):  # one token a position, the last word's too
        token = (37, 999, 480, 7)[i % 4]
        bits[ONE, i, token // 32] = 1 << (token % 32)
    bits[TIED] = -1
    bits[TIED, :, 10 // 32] &= ~(1 << 10)  # the first of the tied columns barred: the second must win
    return bits.to(device)


def composition(x: torch.Tensor, w: torch.Tensor, rows: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """Today's constrained greedy: the logits, masked by state row, then torch's argmax."""
    logits = L.linear_ref(x, w).view(rows.shape[0], -1, w.shape[0])
    return mask_rows_ref(logits, rows, bits).argmax(dim=-1).view(-1)


@pytest.mark.parametrize("k1", [1, 4])
def test_masked_argmax_in_the_gemm_equals_mask_then_argmax(device, k1):
    rows = torch.tensor([TIED, ONE, 5, NONE, ALL, 6, 4], device=device)
    x = small_ints(rows.shape[0] * k1, HIDDEN, seed=2, device=device)
    x[:k1] = 1.0  # the TIED row's positions: columns 10, 500 and 900 tie at the top (128)
    w = weights(device)
    bits = bitmasks(k1, device)
    got = L.linear_argmax_triton(x, w, mask=(rows, bits))
    assert got.dtype == torch.int64 and torch.equal(got, composition(x, w, rows, bits))
    per_row = got.view(rows.shape[0], k1)
    assert (per_row[0] == 500).all(), "the first allowed of the tied columns"
    assert per_row[1].tolist() == [(37, 999, 480, 7)[i % 4] for i in range(k1)], "the one token allowed"
    assert (per_row[3] == 0).all(), "nothing allowed: torch's argmax of all -inf"
    assert torch.equal(per_row[4], L.linear_argmax_triton(x, w).view(-1, k1)[4]), "everything allowed: unmasked"


@pytest.mark.parametrize("bn", [32, 64, 128])
def test_masked_argmax_of_tiles_over_several_words(device, bn):
    """Tiles of one, two and four bitmask words a row (the default tiles of this small weight are
    16 columns, within a word), the last tile running past the vocabulary's partial last word."""
    k1 = 4
    rows = torch.tensor([TIED, ONE, 5, NONE, ALL, 6], device=device)
    x = small_ints(rows.shape[0] * k1, HIDDEN, seed=6, device=device)
    x[:k1] = 1.0
    w, bits = weights(device), bitmasks(k1, device)
    got = L.linear_argmax_triton(x, w, mask=(rows, bits), config=(bn, HIDDEN, 1, 4, 3))
    assert torch.equal(got, composition(x, w, rows, bits))
    assert (got.view(rows.shape[0], k1)[0] == 500).all(), "the first allowed of the tied columns"


def test_masked_argmax_reads_the_state_rows_of_a_wider_bitmask_slice(device):
    """The bitmask as the batch state holds it (a spare state row, rows in any order, the same
    state row twice) and the grid's padding rows: only the rows named are read."""
    k1 = 2
    bits = bitmasks(k1, device)
    rows = torch.tensor([6, 6, 2], device=device)
    x = small_ints(rows.shape[0] * k1, HIDDEN, seed=3, device=device)
    w = weights(device)
    assert torch.equal(L.linear_argmax_triton(x, w, mask=(rows, bits)), composition(x, w, rows, bits))


def test_linear_argmax_masks_in_the_kernel_up_to_its_rows_and_in_the_composition_above(monkeypatch, device):
    """The public function: the kernel (with the mask) up to MASKED_MAX_M rows whatever the weight,
    mask_rows then torch's argmax above, and the same ids either way (on the CPU also the torch
    composition outside `triton_on_cpu`, and the kernel under Triton's interpreter within it)."""
    launched: list[int] = []
    real = L.linear_argmax_triton
    monkeypatch.setattr(L, "linear_argmax_triton", lambda x, *a, **kw: launched.append(x.shape[0]) or real(x, *a, **kw))
    monkeypatch.setattr(L, "MASKED_MAX_M", 8)
    monkeypatch.setattr(L, "FUSED_MAX_M", 4)
    monkeypatch.setattr(L, "SMALL_MAX_M", 4)  # this small weight's rows too: unmasked, 8 rows take the composition
    k1, w = 4, weights(device)
    bits = bitmasks(k1, device)
    for ids in ([5, TIED], [5, TIED, ONE]):  # 8 rows: the kernel; 12: the composition
        rows = torch.tensor(ids, device=device)
        x = small_ints(rows.shape[0] * k1, HIDDEN, seed=4, device=device)
        want = composition(x, w, rows, bits)
        if device == "cpu":
            assert torch.equal(L.linear_argmax(x, w, mask=(rows, bits)), want)  # the torch composition
        with triton_on_cpu() if device == "cpu" else contextlib.nullcontext():
            assert torch.equal(L.linear_argmax(x, w, mask=(rows, bits)), want)
    assert launched == [8]


def test_a_mask_with_a_draft_vocabulary_is_refused():
    w, rows = weights("cpu"), torch.tensor([0])
    with pytest.raises(AssertionError, match="draft vocabulary"):
        L.linear_argmax_triton(small_ints(1, HIDDEN, seed=5, device="cpu"), w, id_map=torch.arange(VOCAB),
                               mask=(rows, bitmasks(1, "cpu")))
