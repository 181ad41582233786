"""Tests for engine/sampling/sampler.py: counter-based noise, processed distributions, sampling, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy import stats

from engine.sampling.sampler import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    SamplingTensors,
    _mix32,
    compute_logprobs,
    processed_probs,
    sample,
    uniform_noise,
)
from engine.sampling.sampling_params import SamplingParams

P_MIN = 1e-3  # p-value floor for statistical tests (deterministic: the noise is seeded)


def tensors(temperature, top_k=0, top_p=1.0, seed=None, n=None, device="cpu") -> SamplingTensors:
    """SamplingTensors for n rows (scalars broadcast; seed defaults to 0..n-1)."""
    n = n or len(temperature)
    col = lambda v: list(v) if isinstance(v, list | tuple) else [v] * n  # noqa: E731
    seeds = col(seed) if seed is not None else list(range(n))
    params = [
        SamplingParams(temperature=t, top_k=k, top_p=p)
        for t, k, p in zip(col(temperature), col(top_k), col(top_p), strict=True)
    ]
    return SamplingTensors.from_params(params, seeds, device)


def chi2_pvalue(samples: torch.Tensor, probs: np.ndarray) -> float:
    """Goodness of fit of integer samples to `probs` over its support; asserts nothing lands
    outside the support."""
    counts = np.bincount(samples.numpy(), minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, f"samples outside the support: {counts}"
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Straightforward one-row reference of processed_probs (float64)."""
    if temperature == 0:
        out = np.zeros_like(logits, dtype=np.float64)
        out[np.argmax(logits)] = 1.0
        return out
    x = logits.astype(np.float64) / temperature
    keep = np.ones(len(x), dtype=bool)
    if top_k > 0:
        keep &= x >= np.sort(x)[::-1][min(top_k, len(x)) - 1]
    p = np.where(keep, np.exp(x - x.max()), 0.0)
    p /= p.sum()
    if top_p < 1.0:
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]
        kept = order[before < top_p]
        keep = np.zeros(len(x), dtype=bool)
        keep[kept] = True
        p = np.where(keep, p, 0.0)
        p /= p.sum()
    return p


# ---------------------------------------------------------------- uniform_noise


def lowbias32_reference(x: int) -> int:
    m = 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x7FEB352D) & m
    x ^= x >> 15
    x = (x * 0x846CA68B) & m
    return x ^ (x >> 16)


def test_mix32_matches_unbounded_integer_reference():
    values = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, 0xDEADBEEF] + list(range(1000, 1100))
    got = _mix32(torch.tensor(values, dtype=torch.int64))
    assert got.tolist() == [lowbias32_reference(v) for v in values]
    assert _mix32(0xDEADBEEF) == lowbias32_reference(0xDEADBEEF)


def test_uniforms_lie_strictly_inside_unit_interval_and_are_deterministic():
    seeds = torch.tensor([0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1] * 1000, dtype=torch.int64)
    positions = torch.arange(6000, dtype=torch.int64) * 7919 + 2**40
    for stream in (STREAM_SAMPLE, STREAM_DRAFT, STREAM_ACCEPT):
        u = uniform_noise(seeds, positions, stream)
        assert u.dtype == torch.float32 and u.shape == (6000,)
        assert bool((u > 0).all()) and bool((u < 1).all())
        assert torch.equal(u, uniform_noise(seeds, positions, stream))
    wide = uniform_noise(seeds[:10], positions[:10], STREAM_SAMPLE, width=50_000)
    assert wide.shape == (10, 50_000) and bool((wide > 0).all()) and bool((wide < 1).all())


def test_uniform_extremes_are_representable():
    from engine.sampling.sampler import _to_uniform

    u = _to_uniform(torch.tensor([0, 2**32 - 1], dtype=torch.int64))
    assert 0 < u[0].item() < 1e-6 and 1 - 1e-6 < u[1].item() < 1


def test_uniforms_pass_ks_test():
    n = 100_000
    seeds = torch.arange(n, dtype=torch.int64) % 97
    positions = torch.arange(n, dtype=torch.int64) // 97
    assert (
        stats.kstest(uniform_noise(seeds, positions, STREAM_SAMPLE).numpy(), "uniform").pvalue
        > P_MIN
    )
    wide = uniform_noise(torch.arange(20), torch.full((20,), 5), STREAM_DRAFT, width=5000)
    assert stats.kstest(wide.flatten().numpy(), "uniform").pvalue > P_MIN


def _assert_independent(a: torch.Tensor, b: torch.Tensor, bins: int = 10):
    """2-D chi-squared independence test on a bins x bins grid, plus a correlation bound."""
    ia = (a * bins).long().clamp(max=bins - 1).numpy()
    ib = (b * bins).long().clamp(max=bins - 1).numpy()
    table = np.zeros((bins, bins))
    np.add.at(table, (ia, ib), 1)
    assert stats.chi2_contingency(table).pvalue > P_MIN
    assert abs(np.corrcoef(a.numpy(), b.numpy())[0, 1]) < 0.02


def test_uniforms_independent_across_positions_streams_seeds_and_vocab():
    n = 50_000
    seeds = torch.arange(n, dtype=torch.int64) * 1_000_003
    pos = torch.arange(n, dtype=torch.int64) % 1000
    base = uniform_noise(seeds, pos, STREAM_SAMPLE)
    _assert_independent(base, uniform_noise(seeds, pos + 1, STREAM_SAMPLE))
    _assert_independent(base, uniform_noise(seeds, pos, STREAM_ACCEPT))
    _assert_independent(base, uniform_noise(seeds, pos, STREAM_DRAFT))
    _assert_independent(base, uniform_noise(seeds + 1, pos, STREAM_SAMPLE))
    # The high 32-bit words of the seed and the position count too.
    _assert_independent(base, uniform_noise(seeds + 2**32, pos, STREAM_SAMPLE))
    _assert_independent(base, uniform_noise(seeds, pos + 2**32, STREAM_SAMPLE))
    wide = uniform_noise(seeds[:500], pos[:500], STREAM_SAMPLE, width=101)
    _assert_independent(wide[:, :-1].flatten(), wide[:, 1:].flatten())  # neighbouring vocab ids
    _assert_independent(wide[:-1].flatten(), wide[1:].flatten())  # neighbouring rows


def test_uniform_noise_is_pinned():
    """Changing the hash changes every seeded output the service ever produced; do it knowingly."""
    u = uniform_noise(torch.tensor([0, 42, 2**63 - 1]), torch.tensor([0, 7, 123456]), STREAM_SAMPLE)
    assert u.tolist() == [0.4307556748390198, 0.11269897222518921, 0.10451894998550415]


# ---------------------------------------------------------------- processed_probs


def test_processed_probs_matches_reference():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 40, generator=gen) * 3
    logits[5, 3:8] = logits[5, 3]  # ties at the top-k boundary are kept together
    temps = [0.0, 0.5, 1.0, 1.7] * 16
    top_ks = [0, 1, 5, 12, 40, 100, 0, 3] * 8
    top_ps = [1.0, 0.9, 0.5, 0.05, 0.999, 1.0, 0.3, 0.7] * 8
    st = tensors(temps, top_ks, top_ps)
    got = processed_probs(logits, st)
    assert got.dtype == torch.float32
    for i in range(64):
        ref = reference_probs(logits[i].numpy(), temps[i], top_ks[i], top_ps[i])
        np.testing.assert_allclose(got[i].numpy(), ref, atol=1e-6)


def test_processed_probs_without_filters_is_softmax():
    logits = torch.randn(8, 30, dtype=torch.bfloat16)
    st = tensors([0.8] * 8)
    assert not st.needs_filter
    expected = torch.softmax(logits.float() / 0.8, dim=-1)
    torch.testing.assert_close(processed_probs(logits, st), expected)


# ---------------------------------------------------------------- sample


def test_sample_matches_fixed_distribution():
    probs = np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01])
    n = 100_000
    logits = torch.tensor(np.log(probs), dtype=torch.float32).expand(n, -1)
    st = tensors(1.0, n=n)
    tokens = sample(logits, st, torch.full((n,), 17))
    assert tokens.dtype == torch.int64
    assert chi2_pvalue(tokens, probs) > P_MIN


def test_sample_with_top_k_top_p_matches_processed_distribution():
    n = 100_000
    row = torch.tensor([2.0, 1.5, 1.4, 1.0, 0.3, 0.2, -1.0, 0.9, 1.9, -0.5])
    for temp, top_k, top_p in [(0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.85)]:
        st = tensors(temp, top_k, top_p, n=n)
        tokens = sample(row.expand(n, -1), st, torch.arange(n))
        ref = reference_probs(row.numpy(), temp, top_k, top_p)
        assert (ref > 0).sum() < len(ref)  # the filter is active
        assert chi2_pvalue(tokens, ref) > P_MIN


def test_greedy_rows_are_exact_argmax_in_mixed_batch():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(200, 1000, generator=gen)
    logits[0, [10, 20]] = 50.0  # tie: first index wins
    temps = [0.0, 1.0, 0.0, 0.5] * 50
    st = tensors(temps, top_k=[0, 0, 3, 50] * 50, top_p=[1.0, 0.9, 0.5, 1.0] * 50)
    tokens = sample(logits, st, torch.arange(200))
    greedy = torch.tensor(temps) == 0
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    assert tokens[0].item() == 10
    assert not torch.equal(tokens[~greedy], logits.argmax(-1)[~greedy])


def test_all_greedy_flag_and_path():
    logits = torch.randn(5, 17)
    st = tensors([0.0] * 5)
    assert st.all_greedy and not tensors([0.0, 0.3]).all_greedy
    assert torch.equal(sample(logits, st, torch.zeros(5, dtype=torch.int64)), logits.argmax(-1))


def test_sample_does_not_depend_on_batch_composition():
    gen = torch.Generator().manual_seed(2)
    n, vocab = 64, 500
    logits = torch.randn(n, vocab, generator=gen)
    temps = [0.0, 0.7, 1.0, 1.5] * 16
    top_ks = [0, 0, 20, 7] * 16
    top_ps = [1.0, 0.9, 1.0, 0.6] * 16
    seeds = [int(s) for s in torch.randint(0, 2**62, (n,), generator=gen)]
    positions = torch.randint(0, 4096, (n,), generator=gen)
    full = sample(logits, tensors(temps, top_ks, top_ps, seeds), positions)
    perm = torch.randperm(n, generator=gen)[:40]  # shuffled subset
    pick = lambda xs: [xs[i] for i in perm.tolist()]  # noqa: E731
    st = tensors(pick(temps), pick(top_ks), pick(top_ps), pick(seeds))
    assert torch.equal(sample(logits[perm], st, positions[perm]), full[perm])


def test_different_seeds_positions_and_streams_give_different_tokens():
    n, vocab = 1000, 1000
    logits = torch.zeros(n, vocab)
    by_seed = sample(logits, tensors(1.0, n=n), torch.full((n,), 3))
    assert by_seed.unique().numel() > 500
    one_seed = tensors(1.0, seed=7, n=n)
    by_pos = sample(logits, one_seed, torch.arange(n))
    assert by_pos.unique().numel() > 500
    by_stream = sample(logits, one_seed, torch.arange(n), stream=STREAM_DRAFT)
    assert (by_stream != by_pos).float().mean() > 0.99


def test_sample_accepts_low_precision_logits():
    logits = torch.randn(4, 64).to(torch.bfloat16)
    tokens = sample(logits, tensors([0.0, 1.0, 0.5, 0.0], top_k=[0, 10, 0, 0]), torch.arange(4))
    assert tokens.dtype == torch.int64 and tokens.shape == (4,)
    assert tokens[0] == logits[0].float().argmax()


# ---------------------------------------------------------------- compute_logprobs


def test_compute_logprobs_matches_log_softmax_and_reference():
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(16, 100, generator=gen) * 4
    tokens = torch.randint(0, 100, (16,), generator=gen)
    out = compute_logprobs(logits.to(torch.bfloat16).float(), tokens, num_top=5)
    ref = torch.log_softmax(logits.to(torch.bfloat16).float(), dim=-1)
    torch.testing.assert_close(out.token_logprob, ref[torch.arange(16), tokens])
    for i in range(16):
        row = ref[i].tolist()
        tok = tokens[i].item()
        assert out.token_rank[i].item() == 1 + sum(v > row[tok] for v in row)
        order = sorted(range(100), key=lambda j: -row[j])[:5]
        assert out.top_ids[i].tolist() == order
        assert out.top_logprobs[i].tolist() == pytest.approx([row[j] for j in order], abs=1e-6)


def test_compute_logprobs_ranks_ties_share_best_rank():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    out = compute_logprobs(logits, torch.tensor([2, 4]), num_top=0)
    assert out.token_rank.tolist() == [1, 1]
    rank_of = [
        compute_logprobs(logits, torch.tensor([t, 0]), 0).token_rank[0].item() for t in range(5)
    ]
    assert rank_of == [5, 1, 1, 4, 1]
    assert out.top_ids.shape == (2, 0) and out.top_logprobs.shape == (2, 0)
    assert out.token_rank.dtype == torch.int64


def test_compute_logprobs_uses_raw_logits():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.float16)
    out = compute_logprobs(logits, torch.tensor([0]), num_top=3)
    expected = torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]]), dim=-1)
    torch.testing.assert_close(out.top_logprobs, expected[:, [2, 1, 0]])
    assert out.top_ids.tolist() == [[2, 1, 0]] and out.token_rank.tolist() == [3]


# ---------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu_without_syncing():
    gen = torch.Generator().manual_seed(4)
    n, vocab = 32, 3000
    logits = torch.randn(n, vocab, generator=gen)
    temps, top_ks, top_ps = [0.0, 0.9, 1.2, 0.6] * 8, [0, 0, 50, 5] * 8, [1.0, 0.8, 1.0, 0.95] * 8
    positions = torch.randint(0, 10_000, (n,), generator=gen)
    cpu = sample(logits, tensors(temps, top_ks, top_ps), positions)
    st = tensors(temps, top_ks, top_ps, device="cuda")
    logits_d, positions_d = logits.cuda(), positions.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        noise = uniform_noise(st.seed, positions_d, STREAM_SAMPLE, width=vocab)
        tokens = sample(logits_d, st, positions_d)
        logprobs = compute_logprobs(logits_d, tokens, num_top=20)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(noise.cpu(), uniform_noise(torch.arange(n), positions, STREAM_SAMPLE, vocab))
    assert torch.equal(tokens.cpu(), cpu)
    torch.testing.assert_close(
        logprobs.token_logprob.cpu(), compute_logprobs(logits, cpu, 20).token_logprob
    )
