"""Exact greedy MTP in bf16 (kernels/linear.py, "Exact MTP"): within a decode step's target forward,
a verify of k drafts launches each GEMM with the compiled kernel (the same path and constexprs,
but for the preload, which reorders no sum) that the plain step of the same batch launches, so
its rows get the plain step's bits. The
launches are recorded here, not run: which kernel and configuration a launch takes is decided on
the host, the same on any CPU; the bits themselves are checked on the GPU
(bench/gpu/gpu_deterministic.py, BENCHMARKS.md)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from kernels import gemv as G
from kernels import linear as L
from kernels._dispatch import rows_a_sequence, triton_on_cpu

# SmolLM2's decode weights (small: the kernel takes up to 128 rows of them) and a large head
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


class _Recorder:
    """Stands in for a Triton kernel: `kernel[grid](*args, **constexprs)` records the launch."""

    def __init__(self, name: str, launches: list):
        self.name, self.launches = name, launches

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            # the preload follows the rows (kernels/linear.py): when a block is read, not the sums
            kwargs.pop("PRELOAD", None)
            self.launches.append((self.name, tuple(sorted(kwargs.items()))))
        return launch


@pytest.fixture
def launches(monkeypatch) -> list:
    seen: list = []
    for name in ("_skinny_kernel", "_sum_splits_kernel", "_argmax_tiles_kernel"):
        monkeypatch.setattr(L, name, _Recorder(name, seen))

    def gemv(x2, w, b, residual, y, config, glu, norm, sumsq):
        seen.append(("gemv", (config, glu)))  # rows of the GEMV sum in one order whatever M is
    monkeypatch.setattr(L, "launch_gemv", gemv)
    monkeypatch.setattr(G, "_programs", lambda device_index: 132)  # an H100's or H200's SMs, as on the GPU
    return seen


def step_launches(launches: list, rows: int, per_sequence: int | None) -> list:
    """The launches of one step's GEMMs (plain: per_sequence 1; None: outside a step) over `rows` rows."""
    w = {name: torch.empty(n, k, dtype=torch.bfloat16) for name, (n, k) in SHAPES.items()}
    x = torch.zeros(rows, 576, dtype=torch.bfloat16)
    launches.clear()
    step = rows_a_sequence(per_sequence) if per_sequence else contextlib.nullcontext()
    with triton_on_cpu(), step:
        L.linear(x, w["qkv"], sumsq=True)  # (a plain GEMM takes the kernel only under PDL, on a GPU)
        L.linear(x, w["o"], residual=torch.zeros(rows, 576, dtype=torch.bfloat16))
        L.linear_glu(x, w["gate_up"])
        L.linear(torch.zeros(rows, 1536, dtype=torch.bfloat16), w["down"], residual=x.clone())
        L.linear_argmax(x, w["head"])
    return list(launches)


@pytest.mark.parametrize("batch", [1, 2, 4, 8, 16, 32])
@pytest.mark.parametrize("k", [1, 2, 3])
def test_a_verify_runs_the_kernels_of_the_plain_step_of_its_batch(launches, batch, k):
    plain = step_launches(launches, batch, 1)
    verify = step_launches(launches, batch * (k + 1), k + 1)
    assert len(plain) >= 5 and verify == plain


@pytest.mark.parametrize("batch", [1, 32])
def test_launched_by_rows_a_verify_would_run_other_kernels(launches, batch):
    """What the step's context changes: by rows alone, a verify's launches differ (the split-K
    kernel for the GEMV at batch 1, cuBLAS for the head past the fused kernel's 64 rows at batch
    32), and so may its bits. (Its row tile would not: a plain step's is sized as its verify's.)"""
    assert step_launches(launches, batch * 4, None) != step_launches(launches, batch, 1)


def test_outside_a_decode_step_the_row_tile_follows_the_rows(launches):
    """Prefill and the draft chain keep a launch's own rows: a small row tile for few rows."""
    w = torch.empty(960, 576, dtype=torch.bfloat16)
    with triton_on_cpu():
        L.linear(torch.zeros(8, 576, dtype=torch.bfloat16), w, sumsq=True)
        with rows_a_sequence(1):
            L.linear(torch.zeros(8, 576, dtype=torch.bfloat16), w, sumsq=True)
    (_, free), (_, step) = launches
    assert dict(free)["BM"] == 16 and dict(step)["BM"] == 32  # a step's: that of its 4-row verify


def test_the_batch_invariant_mode_keeps_its_own_tile(launches):
    from kernels._dispatch import batch_invariant

    with triton_on_cpu(), batch_invariant(), rows_a_sequence(4):
        L.linear(torch.zeros(64, 576, dtype=torch.bfloat16), torch.empty(960, 576, dtype=torch.bfloat16), sumsq=True)
    assert dict(launches[0][1])["BM"] == L.INVARIANT_BM
