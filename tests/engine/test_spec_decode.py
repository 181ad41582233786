"""Tests for engine/spec_decode/verify.py: greedy verification and distribution-preserving rejection
sampling of MTP drafts."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from engine.sampling.sampler import (
    STREAM_ACCEPT,
    STREAM_DRAFT,
    STREAM_SAMPLE,
    SamplingTensors,
    processed_probs,
    race,
    sample,
    uniform_noise,
)
from engine.spec_decode.verify import verify, verify_greedy, verify_rejection
from tests.engine.test_sampler import P_MIN, chi2_pvalue, reference_probs, tensors

# ---------------------------------------------------------------- verify_greedy


def greedy_logits(argmaxes: list[list[int]], vocab: int) -> torch.Tensor:
    logits = torch.zeros(len(argmaxes), len(argmaxes[0]), vocab)
    for b, row in enumerate(argmaxes):
        for i, t in enumerate(row):
            logits[b, i, t] = 1.0
    return logits


def test_verify_greedy_hand_built_cases():
    logits = greedy_logits([[1, 2, 3, 4]] * 4, vocab=5)
    drafts = torch.tensor([[1, 2, 3], [0, 2, 3], [1, 2, 0], [1, 0, 3]])
    tokens, emitted = verify_greedy(logits, drafts)
    assert emitted.tolist() == [4, 1, 3, 2]
    assert tokens.tolist() == [
        [1, 2, 3, 4],  # all accepted: bonus token
        [1, -1, -1, -1],  # first rejected: target token there
        [1, 2, 3, -1],  # last rejected
        [1, 2, -1, -1],  # middle rejected; the later match does not count
    ]


def test_verify_greedy_without_drafts():
    logits = greedy_logits([[3], [0]], vocab=4)
    tokens, emitted = verify_greedy(logits, torch.zeros(2, 0, dtype=torch.int64))
    assert tokens.tolist() == [[3], [0]] and emitted.tolist() == [1, 1]


def reference_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> tuple[list, list]:
    tokens, emitted = [], []
    for b in range(logits.shape[0]):
        target = logits[b].argmax(-1).tolist()
        out = []
        for i, d in enumerate(drafts[b].tolist()):
            out.append(target[i])
            if d != target[i]:
                break
        else:
            out.append(target[-1])
        emitted.append(len(out))
        tokens.append(out + [-1] * (len(target) - len(out)))
    return tokens, emitted


def test_verify_greedy_random_cases_match_loop_reference():
    gen = torch.Generator().manual_seed(0)
    for k in (1, 2, 4):
        logits = torch.randint(0, 3, (300, k + 1, 4), generator=gen).float()  # many ties
        target = logits.argmax(-1)[:, :k]
        noise = torch.randint(0, 4, target.shape, generator=gen)
        drafts = torch.where(torch.rand(target.shape, generator=gen) < 0.8, target, noise)
        tokens, emitted = verify_greedy(logits, drafts)
        ref_tokens, ref_emitted = reference_greedy(logits, drafts)
        assert tokens.tolist() == ref_tokens and emitted.tolist() == ref_emitted
        assert set(emitted.tolist()) == set(range(1, k + 2))


# ---------------------------------------------------------------- rejection sampling: distribution

TARGET = [  # per verify position, over V=8
    [0.30, 0.20, 0.15, 0.12, 0.10, 0.08, 0.04, 0.01],
    [0.05, 0.05, 0.10, 0.10, 0.20, 0.20, 0.25, 0.05],
    [0.40, 0.02, 0.02, 0.02, 0.02, 0.02, 0.10, 0.40],
]
DRAFT = [
    [0.10, 0.10, 0.30, 0.05, 0.05, 0.20, 0.10, 0.10],
    [0.30, 0.05, 0.05, 0.30, 0.05, 0.05, 0.15, 0.05],
]


def run_rejection(target, draft, st: SamplingTensors, n: int, positions: torch.Tensor):
    """Drafts sampled as the engine does (STREAM_DRAFT at their positions), then verified."""
    k = len(draft)
    draft_logits = torch.log(torch.tensor(draft))  # [k, V]
    drafts = torch.stack(
        [sample(draft_logits[i].expand(n, -1), st, positions + i, STREAM_DRAFT) for i in range(k)],
        dim=1,
    )
    draft_probs = torch.stack(
        [processed_probs(draft_logits[i].expand(n, -1), st) for i in range(k)], dim=1
    )
    target_logits = torch.log(torch.tensor(target[: k + 1])).expand(n, -1, -1)
    tokens, emitted = verify_rejection(target_logits, draft_probs, drafts, st, positions)
    return drafts, draft_probs, tokens, emitted


@pytest.mark.parametrize("k", [1, 2])
def test_rejection_sampling_keeps_target_distribution(k):
    n = 120_000
    st = tensors(1.0, n=n)
    positions = torch.arange(n) % 1000
    drafts, _, tokens, emitted = run_rejection(TARGET, DRAFT[:k], st, n, positions)
    assert chi2_pvalue(tokens[:, 0], np.array(TARGET[0])) > P_MIN
    for i in range(1, k + 1):  # later emitted tokens, given they were emitted, follow TARGET[i]
        reached = emitted > i
        assert chi2_pvalue(tokens[reached, i], np.array(TARGET[i])) > P_MIN
    accepted = (emitted > 1).float().mean().item()
    expected = np.minimum(TARGET[0], DRAFT[0]).sum()
    assert abs(accepted - expected) < 5 * np.sqrt(expected * (1 - expected) / n)
    columns = torch.arange(k + 1)
    assert bool(((tokens == -1) == (columns >= emitted[:, None])).all())
    accepted_prefix = columns[:k] < (emitted - 1)[:, None]
    assert torch.equal(tokens[:, :k][accepted_prefix], drafts[accepted_prefix])


def test_rejection_sampling_keeps_filtered_target_distribution():
    n = 120_000
    temp, top_k, top_p = 0.8, 6, 0.9
    st = tensors(temp, top_k, top_p, n=n)
    positions = torch.arange(n) * 3
    _, _, tokens, emitted = run_rejection(TARGET, DRAFT[:2], st, n, positions)
    for i in range(3):
        expected = reference_probs(np.log(np.array(TARGET[i])), temp, top_k, top_p)
        assert (expected == 0).any()  # the filter is active
        assert chi2_pvalue(tokens[emitted > i, i], expected) > P_MIN


def test_distribution_test_has_power():
    """The same chi-squared test rejects the draft distribution and two classic bugs."""
    n = 120_000
    st = tensors(1.0, n=n)
    positions = torch.arange(n) % 1000
    drafts, draft_probs, _, _ = run_rejection(TARGET, DRAFT[:1], st, n, positions)
    target = np.array(TARGET[0])
    assert chi2_pvalue(drafts[:, 0], target) < 1e-12  # emitting drafts unverified
    # Bug 1: the verifier is told the draft came from the target, so it accepts every draft.
    target_logits = torch.log(torch.tensor(TARGET[:2])).expand(n, -1, -1)
    p_target = processed_probs(target_logits[:, 0], st)
    wrong, _ = verify_rejection(target_logits, p_target[:, None], drafts, st, positions)
    assert chi2_pvalue(wrong[:, 0], target) < 1e-12
    # Bug 2: on rejection, resample from the target instead of the residual.
    pd = draft_probs[:, 0].gather(1, drafts)[:, 0]
    pt = p_target.gather(1, drafts)[:, 0]
    accept = uniform_noise(st.seed, positions, STREAM_ACCEPT) * pd <= pt
    resampled = race(p_target, st.seed, positions, STREAM_SAMPLE)
    assert chi2_pvalue(torch.where(accept, drafts[:, 0], resampled), target) < 1e-12


# ---------------------------------------------------------------- rejection sampling: exact logic


def reference_rejection(target_logits, draft_probs, drafts, st: SamplingTensors, positions):
    """Row-by-row python loop of the algorithm, on the same noise primitives."""
    batch, k1, _ = target_logits.shape
    tokens, emitted = [], []
    for b in range(batch):
        row_st = SamplingTensors(
            st.temperature[b : b + 1], st.top_k[b : b + 1], st.top_p[b : b + 1], st.seed[b : b + 1]
        )
        if st.temperature[b] == 0:
            t, e = reference_greedy(target_logits[b : b + 1], drafts[b : b + 1])
            tokens.append(t[0])
            emitted.append(e[0])
            continue
        pt = processed_probs(target_logits[b], row_st.repeat_interleave(k1))
        seed, out = st.seed[b : b + 1], []
        for i in range(k1):
            pos = positions[b : b + 1] + i
            if i == k1 - 1:
                out.append(race(pt[i][None], seed, pos, STREAM_SAMPLE).item())
                break
            d = drafts[b, i].item()
            u = uniform_noise(seed, pos, STREAM_ACCEPT).item()
            if pt[i, d] > 0 and u * draft_probs[b, i, d] <= pt[i, d]:
                out.append(d)
                continue
            residual = (pt[i] - draft_probs[b, i]).clamp(min=0)
            weights = residual if residual.sum() > 0 else pt[i]
            out.append(race(weights[None], seed, pos, STREAM_SAMPLE).item())
            break
        emitted.append(len(out))
        tokens.append(out + [-1] * (k1 - len(out)))
    return tokens, emitted


def random_verify_inputs(batch: int, k: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    temps = [0.0, 1.0, 0.7, 1.3, 0.0, 0.9] * (batch // 6)
    st = tensors(
        temps,
        top_k=[0, 0, 4, 0, 0, 8] * (batch // 6),
        top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 0.9] * (batch // 6),
        seed=[int(s) for s in torch.randint(0, 2**62, (len(temps),), generator=gen)],
    )
    target_logits = torch.randn(len(temps), k + 1, vocab, generator=gen) * 2
    draft_logits = target_logits[:, :k] + torch.randn(len(temps), k, vocab, generator=gen)
    positions = torch.randint(0, 5000, (len(temps),), generator=gen)
    flat_st = st.repeat_interleave(k)
    draft_pos = (positions[:, None] + torch.arange(k)).reshape(-1)
    flat_logits = draft_logits.reshape(-1, vocab)
    drafts = sample(flat_logits, flat_st, draft_pos, STREAM_DRAFT).view(len(temps), k)
    draft_probs = processed_probs(flat_logits, flat_st).view(len(temps), k, vocab)
    return target_logits, draft_probs, drafts, st, positions


@pytest.mark.parametrize("k", [0, 1, 3])
def test_verify_rejection_matches_loop_reference(k):
    inputs = random_verify_inputs(batch=120, k=k, vocab=12, seed=k)
    tokens, emitted = verify_rejection(*inputs)
    ref_tokens, ref_emitted = reference_rejection(*inputs)
    assert tokens.tolist() == ref_tokens and emitted.tolist() == ref_emitted
    assert tokens.dtype == torch.int64 and emitted.dtype == torch.int64
    assert set(emitted.tolist()) == set(range(1, k + 2))  # every outcome occurs


def test_greedy_rows_in_mixed_batch_equal_verify_greedy():
    target_logits, draft_probs, drafts, st, positions = random_verify_inputs(120, 3, 12, seed=7)
    greedy = st.temperature == 0
    junk = torch.softmax(torch.randn_like(draft_probs), dim=-1)  # not one-hot: must not matter
    for probs in (draft_probs, torch.where(greedy[:, None, None], junk, draft_probs)):
        tokens, emitted = verify_rejection(target_logits, probs, drafts, st, positions)
        ref_tokens, ref_emitted = verify_greedy(target_logits, drafts)
        assert torch.equal(tokens[greedy], ref_tokens[greedy])
        assert torch.equal(emitted[greedy], ref_emitted[greedy])
    assert bool((emitted[greedy] > 1).any()) and bool((emitted[greedy] == 1).any())


def test_verify_rejection_does_not_depend_on_batch_composition():
    target_logits, draft_probs, drafts, st, positions = random_verify_inputs(60, 2, 12, seed=8)
    full = verify_rejection(target_logits, draft_probs, drafts, st, positions)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(9))[:25]
    sub_st = SamplingTensors(st.temperature[perm], st.top_k[perm], st.top_p[perm], st.seed[perm])
    sub = verify_rejection(
        target_logits[perm], draft_probs[perm], drafts[perm], sub_st, positions[perm]
    )
    assert torch.equal(sub[0], full[0][perm]) and torch.equal(sub[1], full[1][perm])


def test_verify_dispatch():
    target_logits, draft_probs, drafts, st, positions = random_verify_inputs(12, 2, 10, seed=10)
    greedy_st = tensors([0.0] * 12)
    out = verify(target_logits, drafts, None, greedy_st, positions)
    ref = verify_greedy(target_logits, drafts)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    out = verify(target_logits, drafts, draft_probs, st, positions)
    ref = verify_rejection(target_logits, draft_probs, drafts, st, positions)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    with pytest.raises(ValueError, match="draft_probs"):
        verify(target_logits, drafts, None, st, positions)


def test_accept_rate_of_identical_draft_is_one():
    """A draft drawn from the target itself is always accepted (u < 1 = p_t / p_d)."""
    target_logits, _, _, st, positions = random_verify_inputs(60, 3, 12, seed=11)
    k = 3
    flat_st = st.repeat_interleave(k)
    flat = target_logits[:, :k].reshape(-1, 12)
    draft_pos = (positions[:, None] + torch.arange(k)).reshape(-1)
    drafts = sample(flat, flat_st, draft_pos, STREAM_DRAFT).view(60, k)
    probs = processed_probs(flat, flat_st).view(60, k, 12)
    _, emitted = verify_rejection(target_logits, probs, drafts, st, positions)
    assert bool((emitted == k + 1).all())


# ---------------------------------------------------------------- device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_verify_matches_cpu_without_syncing():
    inputs = random_verify_inputs(batch=48, k=3, vocab=2000, seed=12)
    cpu_tokens, cpu_emitted = verify_rejection(*inputs)
    target_logits, draft_probs, drafts, st, positions = inputs
    st_d = SamplingTensors(
        st.temperature.cuda(), st.top_k.cuda(), st.top_p.cuda(), st.seed.cuda(), needs_filter=True
    )
    args = [t.cuda() for t in (target_logits, draft_probs, drafts)]
    positions_d = positions.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens, emitted = verify(args[0], args[2], args[1], st_d, positions_d)
        greedy = verify_greedy(args[0], args[2])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert torch.equal(tokens.cpu(), cpu_tokens) and torch.equal(emitted.cpu(), cpu_emitted)
    assert torch.equal(greedy[0].cpu(), verify_greedy(target_logits, drafts)[0])
