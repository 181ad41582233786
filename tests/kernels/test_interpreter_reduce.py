"""tests/interpreter.py's reduction (a combine of the kernel's own, run slice by slice) gives every
bit that Triton's own `generic_reduce` (one element at a time) gives: sums along each axis and
over all, with kept dims, and a (value, index) combine with ties, in each dtype the kernels use."""

from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _max_first(v1, i1, v2, i2):
    right = (v2 > v1) | ((v2 == v1) & (i2 < i1))
    return tl.where(right, v2, v1), tl.where(right, i2, i1)


@triton.jit
def _reductions_kernel(x_ptr, cols_ptr, rows_ptr, all_ptr, kept_ptr, max_ptr, at_ptr, M: tl.constexpr, N: tl.constexpr):
    rm = tl.arange(0, M)
    rn = tl.arange(0, N)
    x = tl.load(x_ptr + rm[:, None] * N + rn[None, :])
    tl.store(cols_ptr + rn, tl.reduce(x, 0, _add))
    tl.store(rows_ptr + rm, tl.reduce(x, 1, _add))
    tl.store(all_ptr, tl.reduce(x, None, _add))
    tl.store(kept_ptr + rm[:, None], tl.reduce(x, 1, _add, keep_dims=True))
    best, at = tl.reduce((x, rm[:, None] * N + rn[None, :]), 1, _max_first)
    tl.store(max_ptr + rm, best)
    tl.store(at_ptr + rm, at)


def reductions(x: torch.Tensor) -> list[torch.Tensor]:
    m, n = x.shape
    out = [x.new_empty(n), x.new_empty(m), x.new_empty(1), x.new_empty(m, 1), x.new_empty(m),
           torch.empty(m, dtype=torch.int32)]
    _reductions_kernel[(1,)](x, *out, M=m, N=n)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int32])
def test_slice_by_slice_reduction_equals_the_interpreters_bit_for_bit(dtype, monkeypatch):
    from triton.runtime import interpreter

    from tests.interpreter import _reduce_by_slices, per_element

    assert interpreter.ReduceOps.generic_reduce is _reduce_by_slices  # the session runs it
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(16, 64, generator=g) * 1000).to(dtype)  # large values: the order of the adds shows
    x[3] = 0
    x[3, 5] = x[3, 9] = 7  # a tie: the first index wins
    ours = reductions(x)
    monkeypatch.setattr(interpreter.ReduceOps, "generic_reduce", per_element[0])
    theirs = reductions(x)
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert int(ours[5][3]) == 3 * 64 + 5
