"""kernels/publish.py: the step's packed words reach the destination as they are (on the CPU
under Triton's interpreter; on CUDA into pinned host memory)."""

from __future__ import annotations

import torch

from kernels.publish import BLOCK, publish


def test_publish_copies_every_word_into_the_destination(device):
    for n in (1, 7, BLOCK, 2 * BLOCK + 3):
        src = torch.arange(n, dtype=torch.long, device=device) * 3 - 2**40
        dst = torch.zeros(n, dtype=torch.long, pin_memory=device == "cuda")
        publish(src, dst)
        if device == "cuda":
            torch.cuda.synchronize()
        assert dst.tolist() == src.tolist()
