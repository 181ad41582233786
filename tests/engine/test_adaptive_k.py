"""Adaptive k: the policy's rule on plain numbers, and greedy exactness of an engine whose decode
steps switch between k = K and k = 0 (engine/spec_decode/adaptive_k.py)."""

from __future__ import annotations

import pytest

from engine.engine import EngineConfig
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.adaptive_k import KPolicy
from tests.engine.test_engine import GREEDY, engine_for, prompts_of, run_schedule

K = 3
COSTS = {1: (1.0, 1.5), 4: (1.0, 1.5), 8: (2.0, 4.0)}  # gain = E / 1.5 up to 4 rows, E / 2 beyond


def measured(policy: KPolicy, tokens_per_row: float, steps: int = 1, rows: int = 1000) -> None:
    for _ in range(steps):
        policy.observe(policy.k, rows, round(tokens_per_row * rows))


def test_without_costs_or_drafts_k_is_fixed():
    assert [KPolicy(K).choose(4) for _ in range(3)] == [K] * 3
    assert KPolicy(0, COSTS).choose(4) == 0


def test_k_until_acceptance_is_measured_then_the_cheaper_per_token():
    p = KPolicy(K, COSTS)
    assert p.choose(1) == K and p.gain(1) is None
    measured(p, 2.0)  # 2 tokens a step at 1.5x the cost: gain 1.33
    assert p.gain(1) == pytest.approx(2.0 / 1.5) and p.choose(1) == K
    assert p.gain(8) == pytest.approx(1.0) and p.choose(8) == 0  # at 8 rows K costs 2x: no gain


def test_buckets_take_the_smallest_that_holds_the_batch():
    p = KPolicy(K, COSTS)
    assert p.cost(1) == (1.0, 1.5) and p.cost(2) == (1.0, 1.5) and p.cost(5) == (2.0, 4.0)
    assert p.cost(100) == (2.0, 4.0)  # beyond every bucket: the largest


def test_hysteresis_keeps_the_choice_near_the_threshold():
    p = KPolicy(K, {1: (1.0, 1.0)}, margin=0.1, hysteresis=0.1)  # enter K above 1.1, leave below 1.0
    measured(p, 1.05)
    assert p.choose(1) == K  # at K: 1.05 > 1.0, kept
    measured(p, 0.5, steps=40)
    assert p.choose(1) == 0
    p.tokens_per_step = 1.05
    assert p.choose(1) == 0  # at 0: 1.05 < 1.1, kept
    p.tokens_per_step = 1.2
    assert p.choose(1) == K


def test_plain_steps_reprobe_k_and_the_probe_remeasures():
    p = KPolicy(K, {1: (1.0, 2.0)}, probe_every=4, probe_steps=3)
    measured(p, 1.0)
    ks = [p.choose(1) for _ in range(4)]
    assert ks == [0] * 4
    assert [p.choose(1) for _ in range(3)] == [K] * 3  # the probe
    p.observe(K, 10, 10, stale=True)  # its first step verified stale drafts: not counted
    assert p.tokens_per_step == pytest.approx(1.0)
    p.observe(K, 10, 35)  # the first counted step replaces the average
    assert p.tokens_per_step == pytest.approx(3.5)
    measured(p, 3.5)
    assert p.choose(1) == K  # 3.5 tokens at 2x the cost pays
    p.observe(0, 10, 10)  # plain steps measure nothing
    assert p.tokens_per_step == pytest.approx(3.5)


def test_each_probe_that_ends_plain_doubles_the_wait_for_the_next():
    p = KPolicy(K, {1: (1.0, 2.0)}, probe_every=4, max_probe_every=16, probe_steps=2)
    measured(p, 1.0)
    waits = []
    for _ in range(5):
        ks = []
        while not ks or ks[-1] == 0:
            ks.append(p.choose(1))
        waits.append(len(ks) - 1)  # plain steps before the probe
        assert p.choose(1) == K  # the probe's second step
        measured(p, 1.0)  # it measured no gain
    assert waits == [4, 8, 16, 16, 16]
    p.tokens_per_step = 3.0  # drafts pay again: K, and the wait starts over
    assert p.choose(1) == K
    p.tokens_per_step = 1.0
    ks = []
    while not ks or ks[-1] == 0:
        ks.append(p.choose(1))
    assert len(ks) - 1 == 4


def test_average_moves_by_alpha():
    p = KPolicy(K, COSTS, alpha=0.25)
    p.observe(K, 4, 8)
    p.observe(K, 4, 16)
    assert p.tokens_per_step == pytest.approx(2.0 + 0.25 * (4.0 - 2.0))


@pytest.mark.parametrize("bad", [dict(alpha=0.0), dict(margin=-1.0), dict(probe_steps=1), dict(probe_rows=0), dict(max_probe_every=1), dict(costs={1: (0.0, 1.0)})])
def test_bad_policy_settings_are_errors(bad):
    with pytest.raises(ValueError):
        KPolicy(K, **bad)


def test_k_policy_config_is_checked():
    with pytest.raises(ValueError, match="spec_k_policy"):
        EngineConfig(num_speculative_tokens=K, spec_k_policy="sometimes")


class Scripted(KPolicy):
    """Runs the steps at the given k in turn (then K), recording what it is told."""

    def __init__(self, ks: list[int]) -> None:
        super().__init__(K, {1: (1.0, 1.0)})
        self.script, self.seen = list(ks), []

    def choose(self, batch: int) -> int:
        return self.script.pop(0) if self.script else K

    def observe(self, k: int, rows: int, tokens: int, stale: bool = False) -> None:
        self.seen.append((k, stale))


SWITCHES = [K, 0, 0, K, K, 0, K, 0, 0, 0, K, K, K, 0, K] * 4


def adaptive(tiny, policy: KPolicy, **kw):
    eng = engine_for(tiny, K, spec_k_policy="adaptive", **kw)
    assert eng.runner.step_ks == (K, 0) and eng.batch.policy is not None
    eng.batch.policy = policy
    return eng


def test_greedy_with_k_switching_every_few_steps_matches_plain_and_fixed_k(tiny):
    prompts = prompts_of([3, 29, 11, 64, 1, 17], tiny.model.config.vocab_size)
    joins = list(zip([0, 0, 2, 3, 7, 12], prompts, strict=True))
    plain = run_schedule(engine_for(tiny, 0, max_num_batched_tokens=20), joins, GREEDY)
    fixed = run_schedule(engine_for(tiny, K, max_num_batched_tokens=20), joins, GREEDY)
    policy = Scripted(SWITCHES)
    eng = adaptive(tiny, policy, max_num_batched_tokens=20)
    switching = run_schedule(eng, joins, GREEDY)
    assert [r.output_ids for r in switching] == [r.output_ids for r in plain] == [r.output_ids for r in fixed]
    assert eng.batch.k_steps[0] > 0 and eng.batch.k_steps[K] > 0 and sum(eng.batch.k_steps[1:K]) == 0
    stale = [i for i, (k, s) in enumerate(policy.seen) if s]
    assert stale and all(policy.seen[i - 1][0] == 0 and policy.seen[i][0] == K for i in stale)
    assert eng.num_free_blocks == eng.blocks.capacity


def test_policy_drops_to_plain_when_drafts_do_not_pay_and_stays_exact(tiny):
    """The tiny model's random MTP head is rarely right: at a K step of twice a plain step's
    cost the policy runs mostly plain steps, probing K now and then."""
    prompts = prompts_of([5, 23, 9, 14], tiny.model.config.vocab_size, seed=3)
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    plain = engine_for(tiny, 0).generate(prompts, params)
    eng = adaptive(tiny, KPolicy(K, {4: (1.0, 2.0)}, probe_every=8, probe_steps=3))
    out = eng.generate(prompts, params)
    assert [r.output_ids for r in out] == [r.output_ids for r in plain]
    steps = eng.batch.k_steps
    assert steps[0] > steps[K] > 1  # mostly plain, with probes
    assert eng.num_free_blocks == eng.blocks.capacity


def test_mixed_batch_with_switching_keeps_greedy_rows_and_logprobs_exact(tiny):
    """Sampled, penalized and logprob rows take the eager paths at both k; greedy rows (with or
    without logprobs) still equal plain decoding, and every request ends with its blocks freed."""
    vocab = tiny.model.config.vocab_size
    prompts = prompts_of([7, 19, 4, 12, 9], vocab, seed=4)
    params = [GREEDY, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0.9, seed=5, max_tokens=24, ignore_eos=True),
              SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0.7, top_p=0.9, seed=6, max_tokens=24, ignore_eos=True, logprobs=0)]
    plain = engine_for(tiny, 0).generate(prompts, params)
    eng = adaptive(tiny, Scripted(SWITCHES))
    out = eng.generate(prompts, params)
    for i in (0, 1, 3):
        assert out[i].output_ids == plain[i].output_ids
    for a, b in zip(out[1].logprobs, plain[1].logprobs, strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert all(len(r.output_ids) == 24 and r.finish_reason == "length" for r in out)
    assert eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.parametrize(("batch", "probe"), [(1, 4), (8, 4), (16, 3), (32, 2), (128, 2)])
def test_a_probe_counts_enough_rows_and_no_more(batch, probe):
    """A probe is its stale step plus the counted steps that give `probe_rows` rows' tokens (at most
    probe_steps - 1): a large batch measures its acceptance in one step, a small one in several."""
    p = KPolicy(K, {128: (1.0, 2.0)}, probe_every=4, probe_steps=4, probe_rows=32)
    measured(p, 1.0)
    ks = [p.choose(batch) for _ in range(4)]
    assert ks == [0] * 4
    assert [p.choose(batch) for _ in range(probe + 1)] == [K] * probe + [0]
