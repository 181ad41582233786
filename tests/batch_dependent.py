"""A GEMM whose sums depend on the batch by construction, for the negative controls of the
batch-invariance tests (`--deterministic`).

Libraries pick their tiling and split-K from the number of rows M (cuBLAS on a GPU; CPU BLAS
too, but whether a given CPU's bf16 kernels change a row's bits with M is luck: one did for the
tests' prompts, another did not). Under `use_batch_dependent_gemm` the model's linear layers
(`kernels.linear`, whose torch path calls `F.linear`) sum K in SPLITS chunks whenever M > 1,
each partial rounded to the model dtype and the partials added in a row-dependent order
(row i starts at chunk i mod SPLITS), and in one pass when M = 1. So without the mode a row's
bits change with the batch and its place in it on every machine, and a test that says the mode
removes that can fail: the mode calls the GEMM one row at a time (M = 1, `linear_invariant_ref`)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

SPLITS = 4


def batch_dependent_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, w, b) as described above: one pass for a single row, else split-K with a
    row-dependent order of the rounded partial sums."""
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m <= 1 or x.shape[-1] < SPLITS:
        return F.linear(x, w, b)
    parts = torch.stack([F.linear(xc, wc) for xc, wc in zip(x2.tensor_split(SPLITS, -1),
                                                            w.tensor_split(SPLITS, -1), strict=True)])
    order = (torch.arange(m).view(1, m) + torch.arange(SPLITS).view(SPLITS, 1)) % SPLITS  # [SPLITS, M]
    ordered = parts.gather(0, order.view(SPLITS, m, 1).expand_as(parts))
    y = ordered[0]
    for part in ordered[1:]:
        y = y + part  # rounded to the dtype at every add
    if b is not None:
        y = y + b
    return y.view(*x.shape[:-1], w.shape[0])


def use_batch_dependent_gemm(monkeypatch: pytest.MonkeyPatch) -> None:
    """For the rest of the test, `kernels.linear` computes every F.linear as above."""
    import kernels.linear

    monkeypatch.setattr(kernels.linear, "F", SimpleNamespace(linear=batch_dependent_linear))
