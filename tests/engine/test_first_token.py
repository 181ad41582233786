"""The first tokens leave before the MTP drafts: `ModelRunner.prefill`'s `on_first` runs once the
first tokens (and logprobs) are queued and before the MTP layer and draft chain are, and the
engine queues their copy to the host there (engine/chunked_prefill.py `HostFirst`), so its read
point waits for the target forward only."""

from __future__ import annotations

import pytest

from engine import prefill_step
from engine.chunked_prefill import HostFirst
from engine.engine import EngineConfig, LLMEngine
from engine.sampling_params import SamplingParams
from tests.engine.conftest import DEVICE

PROMPTS = [[5, 17, 5, 99, 5, 17, 200, 31], [7, 8, 9]]


@pytest.mark.parametrize("k", [0, 3])
def test_first_tokens_are_copied_before_the_drafts_are_queued(tiny, k, monkeypatch):
    order: list = []
    real_tail, real_start = prefill_step.prefill_tail, HostFirst.start

    def tail(*a):
        order.append("tail")
        return real_tail(*a)

    def start(out):
        order.append(("first", out.drafts is None, out.first_token.tolist()))
        return real_start(out)

    monkeypatch.setattr(prefill_step, "prefill_tail", tail)
    monkeypatch.setattr(HostFirst, "start", staticmethod(start))
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    got = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, device=DEVICE)).generate(PROMPTS, params)
    assert order[0][:2] == ("first", True) and order[1] == "tail"  # one prefill step: first tokens, then drafts
    assert order[0][2] == [r.output_ids[0] for r in got]
    assert all(len(r.logprobs) == 6 for r in got)
    plain = LLMEngine(tiny, EngineConfig(num_speculative_tokens=0, device=DEVICE)).generate(PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]  # greedy: MTP changes no token
