"""The decode tail kernel (accept drafts, cut at stops and max_tokens, advance the state), the
uniform-metadata kernel and the step-inputs kernel (the state's rows and the verify metadata in
one launch): each Triton launcher equals its torch reference exactly, state included."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_tail import accept_and_advance_ref, accept_and_advance_triton
from kernels.step_meta import (
    StepState,
    step_inputs_ref,
    step_inputs_triton,
    uniform_meta_ref,
    uniform_meta_triton,
)

DEV = "cuda" if torch.cuda.is_available() else "cpu"
SLOTS, STOPS, VOCAB = 7, 8, 12


def _state(k: int, g: torch.Generator) -> dict[str, torch.Tensor]:
    def ints(*shape, hi):
        return torch.randint(0, hi, shape, generator=g).to(DEV)

    stops = torch.full((SLOTS, STOPS), -1)
    stops[:, 0] = torch.randint(0, VOCAB, (SLOTS,), generator=g)  # one stop id per slot, small vocab: hits
    stops[1, 1] = 3
    return {"drafts": ints(SLOTS, k, hi=VOCAB), "stop_ids": stops.to(DEV),
            "max_tokens": ints(SLOTS, hi=20) + 1, "num_generated": ints(SLOTS, hi=20),
            "seq_lens": ints(SLOTS, hi=50) + 5, "last_token": ints(SLOTS, hi=VOCAB),
            "done": (torch.rand(SLOTS, generator=g) < 0.25).to(DEV)}


ORDER = ("drafts", "stop_ids", "max_tokens", "num_generated", "seq_lens", "last_token", "done")


@pytest.mark.parametrize("k", [0, 1, 3, 4])
@pytest.mark.parametrize("greedy", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_tail_kernel_equals_reference_outputs_and_state(k, greedy, seed):
    g = torch.Generator().manual_seed(seed)
    state = _state(k, g)
    rows = torch.tensor([4, 0, 6, 2, 1, SLOTS - 1, SLOTS - 1], device=DEV)[: 3 + seed]
    rows = rows[(rows != SLOTS - 1) | state["done"][rows]]  # a row repeats only when done (padding)
    ids = torch.randint(0, VOCAB, (rows.shape[0], k + 1), generator=g).to(DEV)
    if greedy:  # drafts agree with the target for a random prefix
        agree = torch.rand(rows.shape[0], k, generator=g).to(DEV) < 0.7
        state["drafts"][rows] = torch.where(agree, ids[:, :k], state["drafts"][rows])
        n_emit = None
    else:
        n_emit = torch.randint(1, k + 2, (rows.shape[0],), generator=g).to(DEV)
        ids = torch.where(torch.arange(k + 1, device=DEV) < n_emit[:, None], ids, -1)
    ref_state = {n: t.clone() for n, t in state.items()}
    got = accept_and_advance_triton(ids, n_emit, rows, *(state[n] for n in ORDER))
    want = accept_and_advance_ref(ids, n_emit, rows, *(ref_state[n] for n in ORDER))
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    for name in ORDER:
        assert torch.equal(state[name], ref_state[name]), name


def test_tail_cuts_at_the_first_stop_and_at_max_tokens():
    state = {"drafts": torch.tensor([[5, 7, 9]]), "stop_ids": torch.tensor([[7] + [-1] * 7]),
             "max_tokens": torch.tensor([10]), "num_generated": torch.tensor([2]),
             "seq_lens": torch.tensor([20]), "last_token": torch.tensor([1]), "done": torch.tensor([False])}
    state = {n: t.to(DEV) for n, t in state.items()}
    ids = torch.tensor([[5, 7, 9, 4]], device=DEV)  # all drafts match; 7 is a stop id
    tokens, n, finished, new_len, last_at = accept_and_advance_triton(ids, None, torch.tensor([0], device=DEV),
                                                                      *(state[k] for k in ORDER))
    assert tokens.tolist() == [[5, 7, 9, 4]] and n.tolist() == [2] and finished.tolist() == [1]
    assert new_len.tolist() == [22] and state["last_token"].tolist() == [7] and state["done"].tolist() == [True]
    assert last_at.tolist() == [1]


@pytest.mark.parametrize("kernel", [accept_and_advance_triton, accept_and_advance_ref])
def test_tail_writes_tokens_counts_and_flags_into_the_packed_buffer(kernel):
    g = torch.Generator().manual_seed(9)
    state = _state(3, g)
    rows = torch.tensor([2, 5, 0], device=DEV)
    ids = torch.randint(0, VOCAB, (3, 4), generator=g).to(DEV)
    out = torch.full((3 * 6 + 5,), -7, dtype=torch.long, device=DEV)  # room for more segments after
    tokens, n, finished, _, last_at = kernel(ids, None, rows, *(state[k] for k in ORDER), out=out)
    assert torch.equal(out[:12].view(3, 4), tokens) and torch.equal(out[12:15], n) and torch.equal(out[15:18], finished)
    assert out[18:].tolist() == [-7] * 5
    assert last_at.tolist() == [r * 4 + max(c - 1, 0) for r, c in enumerate(n.tolist())]


@pytest.mark.parametrize("q", [1, 2, 4, 5])
@pytest.mark.parametrize("masked", [True, False])
@pytest.mark.parametrize("offset", [0, 2])
def test_uniform_meta_kernel_equals_reference(q, masked, offset):
    g = torch.Generator().manual_seed(q)
    rows, width, bs = 5, 6, 4
    tables = torch.randint(1, 40, (rows, width), generator=g).to(DEV)
    start = torch.randint(0, width * bs - q, (rows,), generator=g).to(DEV)
    start[0] = width * bs - 1  # positions past the table clamp to its last column
    mask = (torch.rand(rows, generator=g) < 0.4).to(DEV) if masked else None
    got = uniform_meta_triton(tables, start, mask, q, bs, offset)
    for a, b in zip(got, uniform_meta_ref(tables, start, mask, q, bs, offset), strict=True):
        assert torch.equal(a, b)
    assert got[0][0] == start[0] + offset


def _step_state(k: int, width: int, g: torch.Generator) -> StepState:
    state = _state(k, g)
    return StepState(state["seq_lens"], state["done"], state["last_token"], state["drafts"],
                     torch.randint(1, 40, (SLOTS, width), generator=g).to(DEV),
                     torch.rand(SLOTS, generator=g).to(DEV), torch.randint(0, 50, (SLOTS,), generator=g).to(DEV),
                     torch.rand(SLOTS, generator=g).to(DEV), torch.randint(0, 2**40, (SLOTS,), generator=g).to(DEV))


@pytest.mark.parametrize("k", [0, 1, 3])
@pytest.mark.parametrize("width", [5, 40])
def test_step_inputs_kernel_equals_the_gathers_and_metadata(k, width):
    g = torch.Generator().manual_seed(k + width)
    state = _step_state(k, width, g)
    rows = torch.tensor([4, 0, 6, 2, SLOTS - 1, SLOTS - 1], device=DEV)  # padding repeats a row
    got, want = step_inputs_triton(rows, state, k + 1, 4), step_inputs_ref(rows, state, k + 1, 4)
    for name, a, b in zip(got._fields, got, want, strict=True):
        if name == "meta":
            for x, y in zip(a, b, strict=True):
                assert torch.equal(x, y), name
        else:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    assert got.input_ids.view(-1, k + 1)[1].tolist() == [int(state.last_token[0]), *state.drafts[0].tolist()]
