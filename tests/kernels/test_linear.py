"""The fused decode GEMM (kernels/linear.py) against the torch composition it replaces: plain,
bias, residual add, RMSNorm in front, split-K, silu(gate) * up in the epilogue, the in-GEMM
argmax (first index on ties, across tiles too), the batch-invariant mode, and which path `linear` takes."""

from __future__ import annotations

import pytest
import torch

from kernels import gemv
from kernels import linear as L
from kernels._dispatch import batch_invariant, triton_on_cpu
from kernels.norm import row_sumsq_of


@pytest.fixture(autouse=True)
def split_k_kernel(monkeypatch):
    """These tests are the split-K kernel's: the GEMV that launches of a few rows over small
    weights take instead (kernels/gemv.py) is tested in test_gemv.py."""
    monkeypatch.setattr(gemv, "GEMV_MAX_M", 0)


def randn(*shape, device="cpu", seed=0, scale=1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g)).to(device)


CASES = [  # (M, K, N, bias, norm, residual)
    (1, 64, 40, False, False, False),
    (5, 300, 70, True, False, True),  # K and N not multiples of the tiles
    (2, 96, 33, False, True, False),
    (17, 80, 20, False, True, True),  # two row tiles
    (3, 4160, 24, True, False, True),  # split-K in four, summed by the second launch
    (3, 4160, 24, False, True, False),  # a norm needs the whole row: no split
]


@pytest.mark.parametrize(("m", "k", "n", "bias", "norm", "res"), CASES)
def test_fused_linear_matches_the_torch_composition(device, m, k, n, bias, norm, res):
    x = randn(m, k, device=device)
    w = randn(n, k, device=device, seed=1, scale=0.1)
    b = randn(n, device=device, seed=2) if bias else None
    nw = (randn(k, device=device, seed=3).abs() + 0.5, 1e-5) if norm else None
    r = randn(m, n, device=device, seed=4) if res else None
    out = L.linear_triton(x, w, b, nw, r)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, L.linear_ref(x, w, b, nw, r), atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("norm", [False, True])
def test_argmax_in_the_gemm_takes_the_first_of_tied_columns(device, norm):
    x = randn(6, 64, device=device)
    w = randn(1000, 64, device=device, seed=1)
    w[[10, 900, 911]] = 5 * x[0] / x[0].norm()  # row 0: a tie across tiles and inside one
    w[[300, 301]] = 5 * x[3] / x[3].norm()
    nw = (torch.ones(64, device=device), 1e-6) if norm else None
    ids = L.linear_argmax_triton(x, w, nw)
    assert ids.dtype == torch.int64
    assert torch.equal(ids, L.linear_ref(x, w, norm=nw).argmax(dim=-1))
    assert ids[0] == 10 and ids[3] == 300


def test_argmax_maps_through_a_draft_vocabulary_into_a_given_buffer(device):
    """A draft vocabulary's head: the argmax row, then its full-vocabulary id, in one launch pair
    and written into a row of the caller's [k, R] buffer (the kernel and the composition alike)."""
    x = randn(5, 64, device=device)
    w = randn(300, 64, device=device, seed=1)
    id_map = torch.randperm(5000, generator=torch.Generator().manual_seed(2))[:300].to(device)
    want = id_map[L.linear_ref(x, w).argmax(dim=-1)]
    for fn in (L.linear_argmax_triton, L.linear_argmax):
        buf = torch.full((3, 5), -1, dtype=torch.long, device=device)
        got = fn(x, w, None, id_map, buf[1])
        assert got.data_ptr() == buf[1].data_ptr() and torch.equal(buf[1], want)
        assert (buf[0] == -1).all() and (buf[2] == -1).all()


@pytest.mark.parametrize(("m", "k", "inter", "norm"), [(1, 64, 40, False), (17, 96, 33, True), (3, 300, 16, False)])
def test_gate_up_gemm_with_silu_in_its_epilogue_matches_the_composition(device, m, k, inter, norm):
    x = randn(m, k, device=device)
    w = randn(2 * inter, k, device=device, seed=1, scale=0.3)
    nw = (randn(k, device=device, seed=3).abs() + 0.5, 1e-5) if norm else None
    out = L.linear_glu_triton(x, w, nw)
    assert out.shape == (m, inter)
    torch.testing.assert_close(out, L.linear_glu_ref(x, w, nw), atol=5e-5, rtol=1e-5)


def test_invariant_mode_rows_alone_equal_rows_in_a_batch(device):
    x, w = randn(40, 4160, device=device), randn(24, 4160, device=device, seed=1)
    r = randn(40, 24, device=device, seed=2)
    with batch_invariant():
        one, seven, forty = (L.linear_triton(x[:m], w, residual=r[:m]) for m in (1, 7, 40))
    assert torch.equal(one, seven[:1]) and torch.equal(seven, forty[:7])


def test_linear_runs_the_kernel_at_decode_sizes_and_the_composition_otherwise(monkeypatch):
    calls = []
    monkeypatch.setattr(L, "linear_triton", lambda x, *a, **kw: calls.append(x.shape[0]) or L.linear_ref(x, *a))
    w, big = randn(8, 16, seed=1), randn(8192, 2048, seed=2, scale=0.01)
    mid = randn(8, 2**18 + 1, seed=4)  # just over SMALL_WEIGHT elements
    r = lambda m: randn(m, 8, seed=3)  # noqa: E731
    with triton_on_cpu():
        L.linear(randn(L.FUSED_MAX_M, 16), w, residual=r(L.FUSED_MAX_M))  # kernel: an epilogue to fuse
        L.linear(randn(L.FUSED_MAX_M + 1, 16), w, residual=r(L.FUSED_MAX_M + 1))  # kernel: a small weight
        L.linear(randn(L.SMALL_MAX_M + 1, 16), w, residual=r(L.SMALL_MAX_M + 1))  # composition: too many rows
        L.linear(randn(L.FUSED_MAX_M + 1, mid.shape[1]), mid, residual=r(L.FUSED_MAX_M + 1))  # composition
        L.linear(randn(3, 16), w)  # composition: a plain GEMM of a small weight (cuBLAS)
        L.linear(randn(2, 2048), big)  # kernel: a plain GEMM of a large one
        with batch_invariant():
            L.linear(randn(L.FUSED_MAX_M + 5, 16), w)  # kernel: always in the mode
    L.linear(randn(2, 16), w, residual=r(2))  # CPU tensors outside triton_on_cpu: the reference
    assert calls == [L.FUSED_MAX_M, L.FUSED_MAX_M + 1, 2, L.FUSED_MAX_M + 5]


def residual_out(m: int, k: int, device, seed: int = 5, split: bool = False) -> torch.Tensor:
    """x as the decoder's residual stream is written: residual + a GEMM's output (this kernel's,
    which leaves x's rows' partial sums of squares on it; split-K for `split`)."""
    a = randn(m, 4160 if split else 48, device=device, seed=seed)
    w0 = randn(k, a.shape[1], device=device, seed=seed + 1, scale=0.2)
    return L.linear_triton(a, w0, residual=randn(m, k, device=device, seed=seed + 2, scale=3.0))


@pytest.mark.parametrize("split", [False, True])
def test_a_residual_gemm_leaves_its_rows_sums_of_squares(device, split):
    x = residual_out(9, 100, device, split=split)
    partials = row_sumsq_of(x)
    assert partials is not None and partials.shape[0] == 9
    torch.testing.assert_close(partials.sum(dim=1), x.float().pow(2).sum(dim=1), rtol=1e-5, atol=1e-4)
    x.add_(1.0)  # changed in place since: the sums no longer hold
    assert row_sumsq_of(x) is None


@pytest.mark.parametrize(("m", "k", "n", "glu"), [(3, 96, 40, False), (17, 300, 33, True), (70, 80, 24, False)])
def test_a_folded_norm_runs_inside_the_gemm(device, monkeypatch, m, k, n, glu):
    """norm = (None, eps): a weightless RMSNorm (its weight folded into w). Where x came from a
    residual GEMM, the kernel applies it itself from the sums of squares that GEMM left: no norm
    kernel runs, and the result is the composition's (norm, rounded, then the GEMM) to fp32 sums."""
    x = residual_out(m, k, device)
    w = randn(2 * n if glu else n, k, device=device, seed=1, scale=0.1)
    b = None if glu else randn(n, device=device, seed=2)
    monkeypatch.setattr(L, "rms_norm", lambda *a: pytest.fail("the norm ran as its own kernel"))
    if glu:
        got, want = L.linear_glu_triton(x, w, (None, 1e-5)), L.linear_glu_ref(x, w, (None, 1e-5))
    else:
        got, want = L.linear_triton(x, w, b, (None, 1e-5)), L.linear_ref(x, w, b, (None, 1e-5))
    torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def test_a_folded_norm_without_sums_runs_as_its_own_kernel(device):
    x = randn(5, 96, device=device, scale=3.0)  # not written by a residual GEMM
    w = randn(24, 96, device=device, seed=1)
    torch.testing.assert_close(L.linear_triton(x, w, None, (None, 1e-5)), L.linear_ref(x, w, None, (None, 1e-5)),
                               atol=5e-5, rtol=1e-5)
    x, w = residual_out(3, 4160, device), randn(24, 4160, device=device, seed=1, scale=0.1)  # split-K in four
    torch.testing.assert_close(L.linear_triton(x, w, None, (None, 1e-5)), L.linear_ref(x, w, None, (None, 1e-5)),
                               atol=5e-4, rtol=1e-5)


def test_invariant_mode_with_a_folded_norm_rows_alone_equal_rows_in_a_batch(device):
    a, w0 = randn(40, 64, device=device), randn(576, 64, device=device, seed=1, scale=0.2)
    r, w = randn(40, 576, device=device, seed=2), randn(64, 576, device=device, seed=3)
    with batch_invariant():
        one, seven, forty = (L.linear_triton(L.linear_triton(a[:m], w0, residual=r[:m]), w, None, (None, 1e-5))
                             for m in (1, 7, 40))
    assert torch.equal(one, seven[:1]) and torch.equal(seven, forty[:7])


def test_the_l2_prefetch_takes_whole_rows_of_small_weights_and_the_first_lines_of_large_ones(monkeypatch):
    """`_prefetch_args` (CUDA with PDL only; shapes alone here): SmolLM2's gate/up (3072 x 576 bf16,
    9 lines a row) whole; Llama-1B's (16384 x 2048, 32 lines a row) capped at PREFETCH_BYTES: 2 lines
    a row at 4 MB; a split-K launch's row shares count once per split."""
    monkeypatch.setattr(L, "PREFETCH_BYTES", 4 * 2**20)
    small = L._prefetch_args(torch.empty(3072, 576, dtype=torch.bfloat16), 576, 1)
    assert small["PER_LINE"] == 64 and small["LINES"] == 16  # 9 lines, rounded up to a power of two
    big = L._prefetch_args(torch.empty(16384, 2048, dtype=torch.bfloat16), 2048, 1)
    assert big["LINES"] == 2 and big["LINES"] * big["PER_LINE"] * 2 * 16384 <= L.PREFETCH_BYTES
    split = L._prefetch_args(torch.empty(2048, 8192, dtype=torch.bfloat16), 2048, 4)
    assert split["LINES"] == 4  # 2048 rows x 4 shares x 4 lines x 128 B = 4 MB
    fp32 = L._prefetch_args(torch.empty(960, 576, dtype=torch.float32), 576, 1)
    assert fp32["PER_LINE"] == 32 and fp32["LINES"] == 32  # 18 lines of 32 floats


@pytest.mark.parametrize(("k", "n", "res"), [(2048, 3072, False), (2048, 2048, True)])
def test_mid_sized_weights_take_their_own_tiles_and_match_the_composition(device, k, n, res):
    """Llama-1B's 8-48 MB weights take 32-column tiles and deeper pipelines (q/k/v whole rows,
    o split in four); the results are the composition's."""
    assert L.tile_config(n, k) == ((32, 128, 1, 4, 6) if n > k else (32, 128, 4, 4, 4))
    x = randn(2, k, device=device)
    w = randn(n, k, device=device, seed=1, scale=0.05)
    r = randn(2, n, device=device, seed=4) if res else None
    torch.testing.assert_close(L.linear_triton(x, w, None, None, r), L.linear_ref(x, w, None, None, r),
                               atol=5e-5, rtol=1e-5)


@pytest.mark.parametrize("k", [96, 4160])  # whole rows, and split-K summed by the second launch
def test_a_gemm_asked_for_sums_of_squares_leaves_them_without_a_residual(device, k):
    """`sumsq`: a plain GEMM (the MTP's eh_proj) leaves its rows' sums of squares, so the norm of
    its output can run inside the next GEMM."""
    x = randn(3, k, device=device)
    w = randn(40, k, device=device, seed=1, scale=0.1)
    y = L.linear_triton(x, w, sumsq=True)
    torch.testing.assert_close(y, L.linear_ref(x, w), atol=5e-5, rtol=1e-5)
    partials = row_sumsq_of(y)
    assert partials is not None and partials.shape[0] == 3
    torch.testing.assert_close(partials.sum(dim=1), y.float().pow(2).sum(dim=1), rtol=1e-5, atol=1e-4)
    assert row_sumsq_of(L.linear_triton(x, w)) is None  # not asked: none


@pytest.mark.parametrize("glu", [False, True])
def test_the_first_k_block_read_before_the_wait_changes_no_bit(device, monkeypatch, glu):
    """The preload (small weights, few rows): the program's first K block is read before the PDL
    wait and its product taken ahead of the loop, in the loop's order; the sums are the same to
    the bit as without it (the path of larger launches)."""
    x, w = randn(3, 600, device=device), randn(64 if glu else 40, 600, device=device, seed=1, scale=0.1)
    run = (lambda: L.linear_glu_triton(x, w)) if glu else (lambda: L.linear_triton(x, w, residual=randn(3, 40, device=device)))
    monkeypatch.setattr(L, "PRELOAD_MAX_M", 0)
    off = run()
    monkeypatch.setattr(L, "PRELOAD_MAX_M", 32)
    assert torch.equal(run(), off)

