"""FR-Spec draft vocabulary: drafts over the N most frequent tokens keep greedy output exact and
the sampled output's distribution; the draft distribution verification sees is the scattered
one (zero outside the set, sums to 1); the ranking file (the command that makes it is tested in
tests/mtp/test_vocab_rank.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from engine.engine import AUTO_DRAFT_VOCAB, EngineConfig, auto_draft_vocab
from engine.model.llama import CausalLM
from engine.runner import model_runner
from engine.sampling.sampler import STREAM_DRAFT, processed_probs, sample
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.draft_vocab import (
    DraftVocab,
    draft_tokens,
    rank_by_count,
    read_ranking,
    write_ranking,
)
from engine.spec_decode.verify import verify_rejection
from tests.engine.conftest import DEVICE
from tests.engine.test_engine import engine_for, prompts_of
from tests.engine.test_sampler import P_MIN, chi2_pvalue, tensors
from tests.engine.test_spec_decode import DRAFT, TARGET

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


# ---------------------------------------------------------------- the ranking


def test_rank_by_count_orders_by_count_then_id():
    counts = torch.tensor([0, 5, 2, 5, 0, 7, 2])
    assert rank_by_count(counts).tolist() == [5, 1, 3, 2, 6, 0, 4]


def test_read_ranking_rejects_bad_files(tmp_path):
    good = tmp_path / "good.safetensors"
    write_ranking(good, torch.tensor([3, 0, 1, 9]), {"note": "x"})
    assert read_ranking(good, 4).tolist() == [3, 0, 2, 1]
    for name, ids, message in [("dup", [0, 1, 1], "distinct"), ("range", [0, 4], "distinct token ids in 0..3")]:
        path = tmp_path / f"{name}.safetensors"
        save_file({"ids": torch.tensor(ids, dtype=torch.int32)}, str(path))
        with pytest.raises(ValueError, match=message):
            read_ranking(path, 4)


def ranked_tiny(tiny, tmp_path, counts: torch.Tensor):
    """`tiny` with a ranking made from `counts` beside it."""
    path = tmp_path / "tiny.vocab_rank.safetensors"
    write_ranking(path, counts, {"note": "test"})
    return dataclasses.replace(tiny, vocab_rank_path=str(path))


def output_counts(outputs, vocab: int) -> torch.Tensor:
    return sum(torch.bincount(torch.tensor(r.output_ids), minlength=vocab) for r in outputs)


# ---------------------------------------------------------------- one draft step


def test_draft_logits_are_the_full_logits_at_the_set(tiny):
    model = tiny.model
    ids = torch.tensor([7, 300, 0, 42, 5], device=DEVICE)
    vocab = DraftVocab.build(model.lm_head.weight, ids, 4)
    h = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    full = model.mtp_logits(h)
    sub = model.mtp_logits(h, vocab.weight)
    assert sub.shape == (6, 4) and vocab.ids.tolist() == [7, 300, 0, 42]
    torch.testing.assert_close(sub, full[:, vocab.ids], rtol=1e-5, atol=1e-5)


def test_draft_step_equals_full_vocabulary_sampling_with_minus_inf_outside_the_set():
    """Drafts and their distribution are what `sample`/`processed_probs` give for full logits
    that are -inf outside the set: the scattered distribution is zero there and sums to 1."""
    gen = torch.Generator().manual_seed(1)
    rows, vocab_size, n = 600, 40, 9
    temps = [0.0, 1.0, 0.7, 1.3, 0.0, 0.9] * (rows // 6)
    st = tensors(temps, top_k=[0, 0, 4, 0, 0, 20] * (rows // 6), top_p=[1.0, 1.0, 1.0, 0.8, 1.0, 0.9] * (rows // 6),
                 seed=list(range(1000, 1000 + rows)))
    full = torch.randn(rows, vocab_size, generator=gen) * 2
    ids = torch.randperm(vocab_size, generator=gen)
    vocab = DraftVocab(ids[:n], torch.empty(n, 1), vocab_size)
    positions = torch.randint(0, 5000, (rows,), generator=gen)
    tokens, probs = draft_tokens(full[:, vocab.ids], st, positions, vocab)
    assert probs is not None and probs.shape == (rows, vocab_size)
    masked = torch.full_like(full, float("-inf")).scatter(1, vocab.ids.expand(rows, -1), full[:, vocab.ids])
    assert torch.equal(tokens, sample(masked, st, positions, STREAM_DRAFT))
    torch.testing.assert_close(probs, processed_probs(masked, st), rtol=1e-6, atol=1e-7)
    outside = torch.ones(vocab_size, dtype=torch.bool)
    outside[vocab.ids] = False
    assert bool((probs[:, outside] == 0).all())
    torch.testing.assert_close(probs.sum(-1), torch.ones(rows))
    assert bool(torch.isin(tokens, vocab.ids).all())
    assert probs.gather(1, tokens[:, None]).min() > 0  # every draft has q > 0
    greedy_tokens, none = draft_tokens(full[:, vocab.ids], tensors([0.0] * rows), positions, vocab)
    assert none is None and torch.equal(greedy_tokens, masked.argmax(-1))


def test_rejection_sampling_with_a_draft_vocabulary_keeps_the_target_distribution():
    """Drafts over 5 of 8 tokens (the target's most likely token is outside the set) verified
    against the full target: every emitted position follows the target; and the test notices
    when verification is told the full-vocabulary draft distribution instead."""
    n, k = 120_000, 2
    st = tensors(1.0, n=n)
    positions = torch.arange(n) % 1000
    vocab = DraftVocab(torch.tensor([5, 2, 7, 3, 1]), torch.empty(5, 1), 8)
    draft_logits = torch.log(torch.tensor(DRAFT[:k]))[:, vocab.ids]  # [k, N]
    steps = [draft_tokens(draft_logits[i].expand(n, -1), st, positions + i, vocab) for i in range(k)]
    drafts = torch.stack([t for t, _ in steps], 1)
    draft_probs = torch.stack([p for _, p in steps], 1)
    target_logits = torch.log(torch.tensor(TARGET[: k + 1])).expand(n, -1, -1)
    tokens, emitted = verify_rejection(target_logits, draft_probs, drafts, st, positions)
    for i in range(k + 1):
        assert chi2_pvalue(tokens[emitted > i, i], np.array(TARGET[i])) > P_MIN
    assert (tokens[:, 0] == 0).float().mean() > 0.25  # token 0 is never drafted, still emitted
    assert (emitted > 1).float().mean() > 0.3
    full_probs = torch.softmax(torch.log(torch.tensor(DRAFT[0])), -1).expand(n, 1, -1)
    wrong, _ = verify_rejection(target_logits[:, :2], full_probs, drafts[:, :1], st, positions)
    assert chi2_pvalue(wrong[:, 0], np.array(TARGET[0])) < 1e-12


# ---------------------------------------------------------------- the engine


class OracleLogits:
    """`mtp_logits` (and `mtp_greedy_ids`, its argmax) that scores the reference continuation's next token highest (small seeded
    noise elsewhere), at the draft vocabulary's ids when the runner has one: drafts are right
    whenever the right token is in the set."""

    def __init__(self, sequences: dict[int, list[int]], vocab_size: int) -> None:
        width = max(len(s) for s in sequences.values()) + 16
        self.seeds = torch.tensor(list(sequences), device=DEVICE)
        self.table = torch.zeros(len(sequences), width, dtype=torch.long, device=DEVICE)
        for i, s in enumerate(sequences.values()):
            self.table[i, : len(s)] = torch.tensor(s)
        self.vocab_size, self.gen = vocab_size, torch.Generator().manual_seed(0)

    def install(self, monkeypatch) -> None:
        real_chain = model_runner.ModelRunner.draft_chain
        oracle = self

        def chain(runner, h, base, st, *rest):
            oracle.step = (runner, base, st, 0)
            return real_chain(runner, h, base, st, *rest)

        def logits(model, h, head_weight=None, float32=True):
            runner, base, st, j = oracle.step
            oracle.step = (runner, base, st, j + 1)
            row = (st.seed.unsqueeze(1) == oracle.seeds.unsqueeze(0)).float().argmax(1)
            right = oracle.table[row, (base + j + 1).clamp(max=oracle.table.shape[1] - 1)]
            full = torch.rand(h.shape[0], oracle.vocab_size, generator=oracle.gen).to(DEVICE)
            full = full.scatter(1, right.unsqueeze(1), 10.0)
            return full if head_weight is None else full[:, runner.draft_vocab.ids]

        monkeypatch.setattr(model_runner.ModelRunner, "draft_chain", chain)
        monkeypatch.setattr(CausalLM, "mtp_logits", logits)
        def greedy_ids(model, h, head_weight=None, id_map=None, out=None):
            ids = logits(model, h, head_weight).argmax(-1)
            ids = id_map[ids] if id_map is not None else ids
            return out.copy_(ids) if out is not None else ids

        monkeypatch.setattr(CausalLM, "mtp_greedy_ids", greedy_ids)


def test_greedy_output_with_a_draft_vocabulary_equals_plain(tiny, tmp_path):
    """Real MTP head, rankings from the model's own greedy text: small sets (drafts mostly
    outside) and large ones give plain greedy output token for token."""
    vocab = tiny.model.config.vocab_size
    prompts = prompts_of([5, 23, 9, 40], vocab, seed=3)
    plain = engine_for(tiny, 0).generate(prompts, GREEDY)
    ranked = ranked_tiny(tiny, tmp_path, output_counts(plain, vocab))
    for n in (4, 64):
        eng = engine_for(ranked, 3, draft_vocab_size=n)
        assert eng.runner.draft_vocab is not None and eng.runner.draft_vocab.size == n
        out = eng.generate(prompts, GREEDY)
        assert [r.output_ids for r in out] == [r.output_ids for r in plain]
        assert eng.num_free_blocks == eng.blocks.capacity


def test_oracle_drafts_accepted_only_inside_the_set_output_exact(tiny, tmp_path, monkeypatch):
    vocab = tiny.model.config.vocab_size
    prompts = prompts_of([5, 23, 9], vocab, seed=4)
    params = [SamplingParams(max_tokens=30, ignore_eos=True, seed=200 + i) for i in range(3)]
    plain = engine_for(tiny, 0).generate(prompts, params)
    counts = output_counts(plain, vocab)
    ranked = ranked_tiny(tiny, tmp_path, counts)
    oracle = OracleLogits({200 + i: p + r.output_ids for i, (p, r) in enumerate(zip(prompts, plain, strict=True))},
                          vocab)
    oracle.install(monkeypatch)
    accepted = {}
    for n in (0, int((counts > 0).sum()), 3):  # full, every output token, the 3 most frequent
        out = engine_for(ranked, 3, draft_vocab_size=n).generate(prompts, params)
        assert [r.output_ids for r in out] == [r.output_ids for r in plain]
        accepted[n] = sum(r.accepted_tokens for r in out)
    n_all = int((counts > 0).sum())
    assert accepted[n_all] == accepted[0] > 0  # the set holds every right draft
    assert 0 < accepted[3] < accepted[0]  # drafts outside the set are rejected


def test_draft_probs_passed_to_verify_are_zero_outside_the_set(tiny, tmp_path, monkeypatch):
    vocab = tiny.model.config.vocab_size
    prompts = prompts_of([6, 17, 11], vocab, seed=5)
    ranked = ranked_tiny(tiny, tmp_path, torch.arange(vocab))  # ids 319, 318, ... first
    seen = []
    real = model_runner.verify

    def spy(logits, drafts, dprobs, st, positions):
        if not st.all_greedy:
            seen.append((dprobs.clone(), drafts.clone(), st.temperature.clone()))
        return real(logits, drafts, dprobs, st, positions)

    monkeypatch.setattr(model_runner, "verify", spy)
    params = [SamplingParams(temperature=0.9, top_p=0.9, max_tokens=12, ignore_eos=True, seed=1), GREEDY,
              SamplingParams(temperature=1.2, max_tokens=12, ignore_eos=True, seed=2)]
    eng = engine_for(ranked, 2, draft_vocab_size=16)
    eng.generate(prompts, params)
    assert seen
    in_set = torch.arange(vocab, device=DEVICE) >= vocab - 16
    for dprobs, drafts, temperature in seen:
        sampled = temperature > 0
        p = dprobs[sampled]
        assert bool((p[..., ~in_set] == 0).all())
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:2], device=DEVICE))
        assert bool(in_set[drafts[sampled]].all())


def test_draft_vocabulary_off_and_errors(tiny, tmp_path):
    vocab = tiny.model.config.vocab_size
    for n in (0, vocab, vocab + 5):  # the full vocabulary: no ranking needed
        assert engine_for(tiny, 2, draft_vocab_size=n).runner.draft_vocab is None
    assert engine_for(tiny, 0, draft_vocab_size=16).runner.draft_vocab is None  # no drafts at all
    with pytest.raises(ValueError, match="needs a vocabulary ranking"):
        engine_for(tiny, 2, draft_vocab_size=16)
    with pytest.raises(ValueError, match="draft_vocab_size must be >= 0"):
        EngineConfig(num_speculative_tokens=2, draft_vocab_size=-1)
    assert engine_for(tiny, 2).runner.draft_vocab is None  # the default: tiny's vocabulary is under 32k
    path = tmp_path / "short.safetensors"
    save_file({"ids": torch.arange(8, dtype=torch.int32)}, str(path))
    with pytest.raises(ValueError, match="of 16 tokens from a ranking of 8"):
        engine_for(dataclasses.replace(tiny, vocab_rank_path=str(path)), 2, draft_vocab_size=16)


# ---------------------------------------------------------------- SmolLM2's shipped ranking


def test_auto_draft_vocab_is_32k_for_a_larger_ranked_vocabulary_else_full():
    assert auto_draft_vocab(AUTO_DRAFT_VOCAB + 1, ranked=True) == AUTO_DRAFT_VOCAB == 32768
    assert auto_draft_vocab(128256, ranked=False) == 0  # no ranking: no way to know the frequent tokens
    assert auto_draft_vocab(AUTO_DRAFT_VOCAB, ranked=True) == 0  # the set would be the whole vocabulary


@pytest.mark.smollm2
def test_smollm2_drafts_over_32k_tokens_by_default(smollm2):
    """SmolLM2's 49k vocabulary and shipped ranking: with no draft_vocab_size its drafts score the
    top 32k (FR-Spec), and 0 asks for all of them."""
    auto = engine_for(smollm2, 3, max_model_len=64).runner.draft_vocab
    assert auto is not None and auto.size == AUTO_DRAFT_VOCAB
    assert engine_for(smollm2, 3, max_model_len=64, draft_vocab_size=0).runner.draft_vocab is None


@pytest.mark.smollm2
def test_smollm2_ships_a_ranking_and_greedy_output_stays_exact(smollm2):
    assert smollm2.vocab_rank_path is not None
    vocab = smollm2.model.config.vocab_size
    assert sorted(read_ranking(smollm2.vocab_rank_path, vocab).tolist()) == list(range(vocab))
    tok = smollm2.tokenizer
    prompts = [tok.encode(t) for t in ["The capital of France is", "def fibonacci(n):"]]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = engine_for(smollm2, 0, max_model_len=128).generate(prompts, params)
    spec = engine_for(smollm2, 3, max_model_len=128, draft_vocab_size=2048).generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
