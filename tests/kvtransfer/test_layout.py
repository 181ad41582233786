"""layout.py: which bytes make a block, and how runs coalesce."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.layout import KVLayout, Run, coalesce
from tests.kvtransfer.peer import make_cache


def test_coalesce_needs_both_sides_consecutive() -> None:
    assert coalesce([4, 5, 6, 9], [0, 1, 7, 8]) == [Run(0, 2), Run(2, 1), Run(3, 1)]
    assert coalesce(list(range(256)), list(range(100, 356))) == [Run(0, 256)]
    assert coalesce([], []) == []
    with pytest.raises(ValueError):
        coalesce([1], [1, 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_stacked_kv_blocks_are_the_k_and_v_slices(dtype: torch.dtype) -> None:
    cache = torch.arange(2 * 5 * 3 * 4, dtype=torch.float32).reshape(2, 5, 3, 4).to(dtype)
    layout = KVLayout([cache], block_dim=1)
    assert layout.block_bytes(0) == [12 * cache.element_size()] * 2
    assert layout.byte_ranges(0, 2) == [(0, 24 * cache.element_size(), 12 * cache.element_size())] * 1 + [
        (1, 24 * cache.element_size(), 12 * cache.element_size())]
    k, v = layout.run_views(0, 2, 2)
    assert torch.equal(k, cache[0, 2:4].reshape(-1).view(torch.uint8))
    assert torch.equal(v, cache[1, 2:4].reshape(-1).view(torch.uint8))


def test_block_major_and_separate_kv_layouts() -> None:
    block_major = torch.randn(6, 2, 4, 8)
    k, v = torch.randn(6, 4, 8), torch.randn(6, 4, 8)
    layout = KVLayout([block_major, (k, v)], block_dim=[0, 0])
    assert len(layout.planes[0]) == 1 and len(layout.planes[1]) == 2
    (view,) = layout.run_views(0, 3, 1)
    assert torch.equal(view, block_major[3].reshape(-1).view(torch.uint8))
    assert layout.signature([0, 1]) == [[2 * 4 * 8 * 4], [4 * 8 * 4, 4 * 8 * 4]]


def test_non_contiguous_planes_and_bad_blocks_are_refused() -> None:
    with pytest.raises(ValueError, match="not contiguous"):
        KVLayout([torch.randn(5, 2, 4).transpose(0, 1)], block_dim=1)
    layout = KVLayout([torch.randn(2, 5, 4)], block_dim=1)
    with pytest.raises(ValueError, match="outside"):
        layout.check_blocks(0, [0, 5])


def test_run_buffers_are_the_run_views_bytes() -> None:
    """``run_buffers`` (what ucx posts) covers exactly the bytes of ``run_views``, for every
    dtype and layout, and refuses blocks outside the cache."""
    layers, dims = make_cache(6, seed=4)
    layout = KVLayout(layers, dims)
    for layer in range(layout.num_layers):
        views, bufs = layout.run_views(layer, 2, 3), layout.run_buffers(layer, 2, 3)
        assert [v.numpy().tobytes() for v in views] == [b.tobytes() for b in bufs]
        assert all(isinstance(b, np.ndarray) for b in bufs)
    with pytest.raises(ValueError, match="outside"):
        layout.run_buffers(0, 5, 2)
