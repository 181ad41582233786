"""n > 1 (engine/sched/fork.py): choices share the prompt's KV blocks, each samples with its own seed
as a lone request with that seed would, greedy choices all equal the greedy answer, and every
block comes back."""

from __future__ import annotations

import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.sampling.sampling_params import SamplingParams
from engine.sched.fork import choice_seed, shared_blocks
from tests.engine.conftest import DEVICE

PROMPT = list(range(40, 90))  # 50 tokens: 3 full blocks before the last token's


def choices(req) -> list[list[int]]:
    return [req.output_ids] + [c.output_ids for c in req.children]


def test_seeded_choices_differ_and_each_is_its_seeds_lone_answer(tiny):
    eng = LLMEngine(tiny, EngineConfig(device=DEVICE))
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=7, n=4)
    got = choices(eng.generate([PROMPT], params)[0])
    assert len({tuple(c) for c in got}) == 4
    for i, out in enumerate(got):
        lone = SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=choice_seed(7, i))
        assert out == eng.generate([PROMPT], lone)[0].output_ids, i
    assert choices(eng.generate([PROMPT], params)[0]) == got  # the same on every run
    assert eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.parametrize("k", [0, 2])
def test_greedy_choices_share_blocks_and_equal_the_greedy_answer(tiny, k):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, device=DEVICE))
    want = eng.generate([PROMPT], SamplingParams(max_tokens=10, ignore_eos=True))[0].output_ids
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=10, ignore_eos=True, n=3))
    eng.step()  # admitted and prefilled: the children hold choice 0's first blocks
    need = eng.blocks.blocks_for(len(PROMPT) + 10 + 2 * k + 1)
    shared = shared_blocks(len(PROMPT), 16)
    assert eng.blocks.capacity - eng.num_free_blocks == 3 * need - 2 * shared
    assert eng.blocks.num_shared == shared
    while eng.has_unfinished():
        eng.step()
    assert choices(eng.requests.pop(rid)) == [want] * 3
    assert eng.num_free_blocks == eng.blocks.capacity and eng.blocks.num_shared == 0


def test_abort_ends_every_choice_and_a_first_token_finish_still_forks(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE))
    rid = eng.add_request(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=1, n=3))
    for _ in range(3):
        eng.step()
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    req = eng.requests.pop(rid)
    assert [r.finish_reason for r in (req, *req.children)] == ["abort"] * 3
    one = eng.generate([PROMPT], SamplingParams(max_tokens=1, ignore_eos=True, temperature=1.0, seed=1, n=3))[0]
    assert [len(c) for c in choices(one)] == [1, 1, 1]  # choice 0 ended at its first token; the others ran
    assert eng.num_free_blocks == eng.blocks.capacity
