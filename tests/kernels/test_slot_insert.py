"""kernels/slot_insert.py against its torch reference: every field of every inserted slot, nothing else."""

from __future__ import annotations

import pytest
import torch

from engine.runner.batch_state import BatchState, SlotInit
from kernels._dispatch import triton_on_cpu
from kernels.slot_insert import insert_rows, insert_rows_reference

FIELDS = ("seq_lens", "num_generated", "max_tokens", "top_k", "seed", "last_token", "temperature", "top_p",
          "stop_ids", "drafts", "block_tables", "done")


def _rows(state: BatchState, slots: list[int], g: torch.Generator) -> torch.Tensor:
    inits, width = [], state.block_tables.shape[1]
    for i, slot in enumerate(slots):
        r = torch.randint(1, 1000, (8,), generator=g).tolist()
        inits.append(state._pack(slot, SlotInit(
            seq_len=r[0], first_token=r[1], drafts=r[2:2 + state.k], draft_probs=None, num_generated=r[5],
            max_tokens=r[6], stop_ids=tuple(range(i % 9)), temperature=0.1 * i + 0.7, top_k=r[7],
            top_p=1.0 - 0.05 * i, seed=-i * 12345, block_ids=list(range(i + 1, i + 1 + min(i + 3, width))))))
    return torch.tensor(inits, dtype=torch.long)


@pytest.mark.parametrize(("k", "max_blocks"), [(3, 20), (0, 5), (1, 1500)])
def test_inserted_slots_equal_the_reference_and_nothing_else_changes(device: str, k: int, max_blocks: int) -> None:
    g = torch.Generator().manual_seed(k)
    got, want = (BatchState(8, k, max_blocks, 50, torch.device(device)) for _ in range(2))
    rows = _rows(got, [5, 0, 8, 2], g).to(device)  # slot 8: the spare row is a slot to the kernel too
    with triton_on_cpu():
        insert_rows(rows, got)
    insert_rows_reference(rows, want)
    for name in FIELDS:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name).cpu()), name
    assert not got.done[[5, 0, 8, 2]].any() and got.done[[1, 3, 4, 6, 7]].all()


def test_rows_of_another_width_are_refused() -> None:
    state = BatchState(4, 2, 6, 50, torch.device("cpu"))
    with pytest.raises(ValueError, match="columns"):
        insert_rows(torch.zeros(1, 9 + 8 + 2 + 5, dtype=torch.long), state)
