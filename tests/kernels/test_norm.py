"""The RMSNorm kernels: the Triton launchers match the torch references (fp32 to ~1e-6, bf16
to a rounding), the references are today's model code bit for bit, and the public functions
dispatch to the reference off CUDA and inside `reference_kernels()`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from kernels import _dispatch, norm

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]


def randn(*shape, dtype=torch.float32, device="cpu", seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype=dtype, device=device)


def assert_within_a_rounding(actual: torch.Tensor, expected: torch.Tensor, dtype=None) -> None:
    """fp32: the kernel sums over H in another order. bf16 (`dtype`: the narrowest the math
    rounds to): that can move a rounding by an ulp; Triton's interpreter also truncates
    fp32 -> bf16 casts where GPUs round to nearest even, an ulp more per cast."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if (dtype or expected.dtype) == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=2e-6, atol=1e-6)
    else:
        rtol = 2**-6 if actual.is_cuda else 2**-5  # 2**-7: one bf16 ulp, relative
        torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol, atol=1e-5)


def assert_same_sum(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """The residual add is one fp32 add and one cast, as torch's: bit for bit, except that the
    interpreter's bf16 cast truncates (within an ulp)."""
    if actual.dtype == torch.bfloat16 and not actual.is_cuda:
        torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=0)
    else:
        assert torch.equal(actual, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576, 1536])
@pytest.mark.parametrize("tokens", [1, 5])
def test_rms_norm_kernel_matches_reference(device, dtype, hidden, tokens):
    x = randn(tokens, hidden, dtype=dtype, device=device) * 3
    w = randn(hidden, dtype=dtype, device=device, seed=1)
    assert_within_a_rounding(norm.rms_norm_triton(x, w, EPS), norm.rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_a_weight_normalizes_only(device, dtype):
    """weight None: a norm whose weight is folded into the next GEMM's (engine.model.fold_norms)."""
    x = randn(5, 576, dtype=dtype, device=device) * 3
    got = norm.rms_norm_triton(x, None, EPS)
    assert_within_a_rounding(got, norm.rms_norm_ref(x, None, EPS))
    assert_within_a_rounding(norm.rms_norm_ref(x, None, EPS), norm.rms_norm_ref(x, torch.ones(576, dtype=dtype, device=device), EPS))


def test_rms_norm_kernel_reads_strided_rows_and_leading_dims(device):
    wide = randn(4, 200, device=device)
    x = wide[:, :72]  # row stride 200
    w = randn(72, device=device, seed=1)
    assert_within_a_rounding(norm.rms_norm_triton(x, w, EPS), norm.rms_norm_ref(x, w, EPS))
    heads = wide[:, :192].view(4, 3, 64)  # per-head q/k norm on a view of a fused projection
    w = randn(64, device=device, seed=2)
    out = norm.rms_norm_triton(heads, w, EPS)
    assert out.shape == (4, 3, 64) and out.is_contiguous()
    assert_within_a_rounding(out, norm.rms_norm_ref(heads, w, EPS))


@pytest.mark.parametrize("launch", ["rms_norm_triton", "rms_norm_ref"])
def test_rms_norm_writes_a_column_block_of_a_wider_output(device, launch):
    """The MTP's norms write their blocks of eh_proj's input in place of a cat."""
    x = randn(5, 64, device=device)
    w = randn(64, device=device, seed=1)
    wide = torch.full((5, 3 * 64), 7.0, device=device)
    got = getattr(norm, launch)(x, w, EPS, out=wide[:, 64:128])
    assert got.data_ptr() == wide[:, 64:128].data_ptr()
    assert_within_a_rounding(wide[:, 64:128].contiguous(), norm.rms_norm_ref(x, w, EPS))
    assert (wide[:, :64] == 7).all() and (wide[:, 128:] == 7).all()


def test_rms_norm_kernel_promotes_bf16_input_with_fp32_weight_like_torch(device):
    x = randn(3, 96, dtype=torch.bfloat16, device=device)
    w = randn(96, device=device, seed=1)
    out = norm.rms_norm_triton(x, w, EPS)
    assert out.dtype == torch.float32
    assert_within_a_rounding(out, norm.rms_norm_ref(x, w, EPS), dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [64, 576])
@pytest.mark.parametrize("tokens", [1, 5])
def test_add_rms_norm_kernel_matches_reference(device, dtype, hidden, tokens):
    residual = randn(tokens, hidden, dtype=dtype, device=device) * 4
    delta = randn(tokens, hidden, dtype=dtype, device=device, seed=1)
    w = randn(hidden, dtype=dtype, device=device, seed=2)
    normed, new_residual = norm.add_rms_norm_triton(delta, residual, w, EPS)
    assert_same_sum(new_residual, norm.add_rms_norm_ref(delta, residual, w, EPS)[1])
    # normed against the norm of the kernel's own sum (they differ under the interpreter)
    assert_within_a_rounding(normed, norm.rms_norm_ref(new_residual, w, EPS))


@pytest.mark.parametrize("launch", ["add_rms_norm_triton", "add_rms_norm_ref"])
def test_add_rms_norm_without_delta_returns_the_residual_itself(device, launch):
    fn = getattr(norm, launch)
    residual = randn(3, 576, device=device)
    w = randn(576, device=device, seed=1)
    normed, new_residual = fn(None, residual, w, EPS)
    assert new_residual is residual
    assert_within_a_rounding(normed, norm.rms_norm_ref(residual, w, EPS))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_rms_norm_equals_model_rmsnorm_bit_for_bit(dtype):
    from engine.model.llama import RMSNorm

    module = RMSNorm(576, EPS).to(dtype)
    with torch.no_grad():
        module.weight.copy_(randn(576, seed=1))
    x = randn(5, 576, dtype=dtype) * 3
    delta = randn(5, 576, dtype=dtype, seed=2)
    xf = x.float()  # the model's code before the kernels
    before = module.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    ref = norm.rms_norm_ref(x, module.weight, EPS)
    assert torch.equal(ref, before)
    assert torch.equal(ref, module(x))
    normed, new_residual = norm.add_rms_norm_ref(delta, x, module.weight, EPS)
    assert torch.equal(new_residual, x + delta)
    assert torch.equal(normed, module(x + delta))


def test_public_functions_run_the_reference_off_cuda_and_in_reference_kernels(device):
    x = randn(5, 576, device=device)
    delta = randn(5, 576, device=device, seed=1)
    w = randn(576, device=device, seed=2)
    with _dispatch.reference_kernels():
        assert torch.equal(norm.rms_norm(x, w, EPS), norm.rms_norm_ref(x, w, EPS))
        for got, want in zip(norm.add_rms_norm(delta, x, w, EPS), norm.add_rms_norm_ref(delta, x, w, EPS), strict=True):
            assert torch.equal(got, want)
    if device == "cpu":
        assert torch.equal(norm.rms_norm(x, w, EPS), norm.rms_norm_ref(x, w, EPS))
        assert torch.equal(norm.add_rms_norm(delta, x, w, EPS)[0], norm.add_rms_norm_ref(delta, x, w, EPS)[0])
    else:
        assert_within_a_rounding(norm.rms_norm(x, w, EPS), norm.rms_norm_ref(x, w, EPS))


def test_use_triton_needs_cuda_no_autograd_and_no_reference_kernels():
    def t(is_cuda=True, requires_grad=False):
        return SimpleNamespace(is_cuda=is_cuda, requires_grad=requires_grad)

    assert _dispatch.use_triton(t(), t())
    assert not _dispatch.use_triton(t(), t(is_cuda=False))
    assert not _dispatch.use_triton(t(), t(requires_grad=True))
    with torch.no_grad():
        assert _dispatch.use_triton(t(), t(requires_grad=True))
    with _dispatch.reference_kernels():
        assert not _dispatch.use_triton(t())
    assert _dispatch.use_triton(t())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weights", [(True, True), (False, True), (True, False)])
def test_mtp_input_is_the_gather_and_both_norms_bit_for_bit(device, dtype, weights):
    """One launch gives what the embedding gather, enorm and hnorm (three launches) give, each norm
    with its own weight (or none) and eps, the two halves side by side."""
    table = randn(50, 576, dtype=dtype, device=device) * 2
    h = randn(3, 576, dtype=dtype, device=device, seed=1) * 5
    ids = torch.tensor([7, 0, 49], device=device)
    we = randn(576, dtype=dtype, device=device, seed=2) if weights[0] else None
    wh = randn(576, dtype=dtype, device=device, seed=3) if weights[1] else None
    got = norm.mtp_input(ids, table, h, (we, 1e-5), (wh, 1e-6))
    assert got.shape == (3, 1152) and got.dtype == dtype
    assert torch.equal(got[:, :576], norm.rms_norm_triton(table[ids], we, 1e-5))
    assert torch.equal(got[:, 576:], norm.rms_norm_triton(h, wh, 1e-6))
    assert norm.mtp_input(ids[:0], table, h[:0], (we, 1e-5), (wh, 1e-6)).shape == (0, 1152)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 2048])
def test_embed_with_sumsq_is_the_gather_with_its_rows_sums_of_squares(device, dtype, hidden):
    """The gather's rows bit for bit, and partial sums of squares (one per 1024-column tile) that
    add up to each row's; an id outside the vocabulary gives a zero row instead of a read out of
    bounds (the router rejects such ids before they get here)."""
    table = randn(50, hidden, dtype=dtype, device=device) * 2
    ids = torch.tensor([7, 0, 49, 50, -1], device=device)
    got = norm.embed_with_sumsq(ids, table)
    assert got.shape == (5, hidden) and got.dtype == dtype
    assert torch.equal(got[:3], table[ids[:3]]) and not got[3:].any()
    parts = norm.row_sumsq_of(got)
    assert parts is not None and parts.shape == (5, -(-hidden // 1024))
    torch.testing.assert_close(parts.sum(1)[:3], table[ids[:3]].float().pow(2).sum(1), rtol=1e-5, atol=0)
    assert not parts[3:].any()
    assert norm.embed_with_sumsq(ids[:0], table).shape == (0, hidden)


def test_the_first_layers_norm_runs_in_its_gemm_from_the_embeddings_sums(device):
    """A GEMM with a folded (weightless) norm over `embed_with_sumsq`'s rows gives what it gives
    over the plain gather, whose norm runs as a kernel first."""
    from kernels.linear import linear_triton

    table = randn(50, 576, device=device) * 2
    w = randn(96, 576, device=device, seed=1) * 0.05
    ids = torch.tensor([3, 11], device=device)
    folded = linear_triton(norm.embed_with_sumsq(ids, table), w, norm=(None, EPS))
    plain = linear_triton(table[ids], w, norm=(None, EPS))
    torch.testing.assert_close(folded, plain, rtol=2e-5, atol=2e-6)
