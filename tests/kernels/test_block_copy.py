"""kernels/block_copy.py against its reference: every plane's blocks land, nothing else moves."""

from __future__ import annotations

import pytest
import torch

from kernels import block_copy
from kernels.block_copy import copy_blocks, copy_blocks_reference
from tests.kernels.bounds import reachable


def _planes(n: int, blocks: int, block_bytes: int, device: str, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (blocks * block_bytes,), generator=g, dtype=torch.uint8).to(device)
            for _ in range(n)]


@pytest.mark.parametrize(("block_bytes", "src_blocks", "dst_blocks"), [
    (64, [3, 4, 5], [0, 1, 2]),  # one run
    (96, [7, 0, 5, 1], [2, 9, 4, 3]),  # scattered both sides, a partial last word group
    (16 * 1100, [1, 2], [6, 0]),  # a block of several programs' chunks, the last one partial
])
def test_copied_blocks_equal_the_reference_and_nothing_else_changes(
        device: str, block_bytes: int, src_blocks: list[int], dst_blocks: list[int]) -> None:
    g = torch.Generator().manual_seed(block_bytes)
    src, dst = _planes(3, 8, block_bytes, device, g), _planes(3, 10, block_bytes, device, g)
    want = [d.clone() for d in dst]
    copy_blocks_reference(src, want, src_blocks, dst_blocks, block_bytes)
    table = torch.tensor([t.data_ptr() for t in src + dst], dtype=torch.int64, device=device)
    with reachable(*src, *dst):
        copy_blocks(table[:3], table[3:], torch.tensor(src_blocks, device=device),
                    torch.tensor(dst_blocks, device=device), block_bytes)
    for got, expected in zip(dst, want, strict=True):
        assert torch.equal(got.cpu(), expected.cpu())


def test_a_block_size_not_in_whole_words_is_refused() -> None:
    with pytest.raises(ValueError, match="multiple of 16"):
        copy_blocks(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                    torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 40)


def test_warm_up_launches_every_alignment_of_the_arguments_on_scratch_only(
        device: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A transfer's tables and block lists are slices, 8 bytes off after an odd count: Triton compiles
    a kernel per alignment, so the warm-up launches each (destination table, destination ids)."""
    seen = set()

    def spy(src_ptrs, dst_ptrs, src_blocks, dst_blocks, nbytes):
        seen.add((dst_ptrs.data_ptr() % 16, dst_blocks.data_ptr() % 16, src_ptrs.data_ptr() % 16,
                  src_blocks.data_ptr() % 16))
        copy_blocks(src_ptrs, dst_ptrs, src_blocks, dst_blocks, nbytes)

    monkeypatch.setattr(block_copy, "copy_blocks", spy)
    scratch = torch.zeros(2 * 96, dtype=torch.uint8, device=device)
    scratch[:96] = torch.arange(96, dtype=torch.uint8)
    with reachable(scratch):
        block_copy.warm_up(scratch, 96)
    assert seen == {(a, b, 0, 0) for a in (0, 8) for b in (0, 8)}
    assert torch.equal(scratch[96:].cpu(), torch.arange(96, dtype=torch.uint8))
