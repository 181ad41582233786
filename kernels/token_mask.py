"""Grammar masks on the logits: a token whose bit is 0 in its row's packed bitmask gets -inf.

    mask_logits(logits [..., V], bitmask [..., W] int32, W = ceil(V / 32)) -> [..., V]
        bit j of word w allows token 32 * w + j (xgrammar's layout: engine/grammar.py)

The torch version unpacks the bits with shifts and ands (an arithmetic shift of a word with bit
31 set smears the sign in, and `& 1` keeps the one bit asked for either way). It runs on any
device, inside the decode step's CUDA graphs: no sync, no value-dependent shape.
"""

from __future__ import annotations

import torch
from torch import Tensor


def allowed(bitmask: Tensor, vocab: int) -> Tensor:
    """[..., V] bool: the tokens `bitmask` [..., W] allows."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask[..., :, None] >> shifts) & 1  # [..., W, 32]
    return bits.flatten(-2)[..., :vocab].bool()


def mask_logits(logits: Tensor, bitmask: Tensor) -> Tensor:
    """`logits` with -inf at every token its row's bitmask disallows (a new tensor)."""
    return logits.masked_fill(~allowed(bitmask, logits.shape[-1]), float("-inf"))
