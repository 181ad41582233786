"""Penalties and logit bias (engine/sampling/penalties.py) against plain references of each formula: on
fixed logits, at every MTP verify position, in the per-slot state, and through the engine (greedy
with and without MTP, seeded sampling) against a token-by-token reference decode."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.attention import AttentionMetadata
from engine.runner.model_runner import ModelRunner
from engine.sampling.penalties import (
    PenaltyInit,
    PenaltyState,
    apply_penalties,
    prefill_penalties,
    verify_penalties,
)
from engine.sampling.sampler import SamplingTensors, sample
from engine.sampling.sampling_params import SamplingParams
from tests.engine.conftest import DEVICE
from tests.engine.test_engine import OracleDrafts

VOCAB = 40


def ref_penalize(logits: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """The formulas, one token at a time: bias (OpenAI), repetition (vLLM/HF), frequency, presence (OpenAI)."""
    counts, bias, out = Counter(output), dict(p.logit_bias), []
    for t, x in enumerate(logits):
        x += bias.get(t, 0.0)
        if t in prompt or counts[t]:
            x = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        x -= p.frequency_penalty * counts[t]
        x -= p.presence_penalty * (counts[t] > 0)
        out.append(x)
    return out


CASES = [  # (params, prompt, output)
    (SamplingParams(repetition_penalty=1.3), [1, 2, 2, 5], [7, 7, 1]),
    (SamplingParams(repetition_penalty=0.7, presence_penalty=0.5), [3], [3, 4, 4, 4]),
    (SamplingParams(frequency_penalty=-0.8, presence_penalty=-1.5), [9, 9], [0, 0, 8]),
    (SamplingParams(logit_bias=((5, 100.0), (6, -100.0), (7, 2.5)), frequency_penalty=2.0), [5], [6, 7, 7]),
]


def test_apply_penalties_equals_reference_on_fixed_logits():
    logits = torch.randn(len(CASES), VOCAB, generator=torch.Generator().manual_seed(0)) * 3
    inits = [PenaltyInit.of(p, prompt, output) for p, prompt, output in CASES]
    got = apply_penalties(logits, prefill_penalties(inits, VOCAB, torch.device("cpu")))  # type: ignore[arg-type]
    for row, (p, prompt, output) in enumerate(CASES):
        want = ref_penalize(logits[row].tolist(), prompt, output, p)
        assert got[row].tolist() == pytest.approx(want, abs=1e-5)
        assert got[row].tolist() != pytest.approx(logits[row].tolist(), abs=1e-3)  # the penalty did something


def test_every_verify_position_counts_the_drafts_before_it():
    k = 3
    logits = torch.randn(len(CASES), k + 1, VOCAB, generator=torch.Generator().manual_seed(1))
    drafts = torch.tensor([[7, 7, 2], [4, 9, 4], [0, 1, 2], [6, 6, 6]])
    inits = [PenaltyInit.of(p, prompt, output) for p, prompt, output in CASES]
    got = verify_penalties(logits, prefill_penalties(inits, VOCAB, torch.device("cpu")), drafts)  # type: ignore[arg-type]
    for row, (p, prompt, output) in enumerate(CASES):
        for i in range(k + 1):
            want = ref_penalize(logits[row, i].tolist(), prompt, output + drafts[row, :i].tolist(), p)
            assert got[row, i].tolist() == pytest.approx(want, abs=1e-5)


def test_state_resets_reused_slots_and_counts_emitted_tokens():
    state = PenaltyState(4, VOCAB, torch.device("cpu"))
    p = CASES[0][0]
    state.insert_no_sync([(0, PenaltyInit.of(p, [1, 2], [3])), (1, None)])
    state.insert_no_sync([(0, None)])  # slot 0 reused by an unpenalized request: neutral again
    state.insert_no_sync([(2, PenaltyInit.of(p, [1], [3, 3]))])
    rows = torch.tensor([2, 0, 3])
    state.count_no_sync(rows, torch.tensor([[4, 4, -1], [5, -1, -1], [6, 6, 6]]), torch.tensor([2, 1, 0]))
    view = state.view(rows)
    assert view.counts[0, [3, 4]].tolist() == [2, 2] and int(view.counts[0].sum()) == 4
    assert view.repetition.tolist() == pytest.approx([1.3, 1.0, 1.0]) and not bool(view.prompt[1].any())
    assert int(view.counts[1].sum()) == 1 and int(view.counts[2].sum()) == 0


def full_logits(loaded, seq: list[int]) -> torch.Tensor:
    """The model's logits after `seq`, from one fresh forward (no engine)."""
    eng = LLMEngine(loaded, EngineConfig(device=DEVICE))
    blocks = eng.blocks.allocate(eng.blocks.blocks_for(len(seq)))
    n = len(seq)

    def t(x):
        return torch.tensor(x, device=DEVICE)

    slots = [blocks[i // 16] * 16 + i % 16 for i in range(n)]
    meta = AttentionMetadata(t(slots), t(list(range(n))), t([blocks]), t([0] * n), t(list(range(n))), n, len(blocks),
                             seq_lens=t([n]), query_start=t([0, n]))  # the CUDA backend's paged kernel reads these
    with torch.no_grad():
        hidden = loaded.model(t(seq), meta.positions, eng.runner.kv.layers, meta, eng.runner.backend)
        return loaded.model.compute_logits(hidden)[-1].cpu()


def reference_decode(loaded, prompt: list[int], p: SamplingParams, seed: int) -> list[int]:
    """Token by token: full forward, the reference penalties, then the sampler's draw at that position."""
    out: list[int] = []
    for _ in range(p.max_tokens):
        logits = torch.tensor([ref_penalize(full_logits(loaded, prompt + out).tolist(), prompt, out, p)])
        st = SamplingTensors.from_params([p], [seed], "cpu")
        out.append(int(sample(logits, st, torch.tensor([len(prompt) + len(out)]))[0]))
    return out


PROMPT = [5, 17, 5, 99, 5, 17, 200, 31]


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=10, ignore_eos=True, seed=3, repetition_penalty=1.8, frequency_penalty=0.6),
    SamplingParams(max_tokens=10, ignore_eos=True, seed=3, presence_penalty=1.5, logit_bias=((65, 8.0), (66, -100.0))),
    SamplingParams(max_tokens=10, ignore_eos=True, seed=3, frequency_penalty=2.0,
                   logit_bias=((65, 9.0), (66, 9.0))),  # alternates between the two, by their counts
])
@pytest.mark.parametrize("k", [0, 2])
def test_greedy_with_penalties_equals_reference_with_and_without_mtp(tiny, params, k, monkeypatch):
    want = reference_decode(tiny, PROMPT, params, 0)
    plain = SamplingParams(max_tokens=10, ignore_eos=True, seed=4)
    alone = LLMEngine(tiny, EngineConfig(device=DEVICE)).generate([PROMPT, PROMPT[:3]], plain)
    assert want != alone[0].output_ids  # the penalties change the answer: this test can fail
    if k:  # drafts that are always right: every verify position's penalties decide what is kept
        oracle = OracleDrafts({3: PROMPT + want, 4: PROMPT[:3] + alone[1].output_ids})
        monkeypatch.setattr(ModelRunner, "draft_chain", lambda self, *a: oracle(self, *a))
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, device=DEVICE))
    got = eng.generate([PROMPT, PROMPT[:3]], [params, plain])
    assert got[0].output_ids == want
    assert got[1].output_ids == alone[1].output_ids  # an unpenalized neighbour in the same batch
    if k:
        assert got[0].steps < len(want) - 1  # drafts were accepted
    assert eng.num_free_blocks == eng.blocks.capacity


def test_seeded_sampling_with_penalties_equals_reference(tiny):
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=11, repetition_penalty=1.5,
                            presence_penalty=0.7, logit_bias=((120, 3.0),))
    got = LLMEngine(tiny, EngineConfig(device=DEVICE)).generate([PROMPT], params)[0].output_ids
    assert got == reference_decode(tiny, PROMPT, params, 11)


def test_logit_bias_forces_and_bans_tokens(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE))
    forced = eng.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((42, 100.0),)))
    assert forced[0].output_ids == [42] * 6
    plain = eng.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True))[0].output_ids
    banned = eng.generate([PROMPT], SamplingParams(max_tokens=6, ignore_eos=True,
                                                   logit_bias=tuple((t, -100.0) for t in set(plain))))
    assert not set(banned[0].output_ids) & set(plain)
