"""The first tokens leave before the MTP drafts: `ModelRunner.prefill`'s `on_first` runs once the
first tokens (and logprobs) are queued and before the MTP layer and draft chain are, and the
engine queues their copy to the host there (engine/sched/chunked_prefill.py `HostFirst`), so its read
point waits for the target forward only."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.runner import prefill_step
from engine.runner.prefill_graphs import PrefillGraphs
from engine.sampling.sampling_params import SamplingParams
from engine.sched.chunked_prefill import HostFirst
from tests.engine.conftest import DEVICE

PROMPTS = [[5, 17, 5, 99, 5, 17, 200, 31], [7, 8, 9]]


@pytest.mark.parametrize("k", [0, 3])
def test_first_tokens_are_copied_before_the_drafts_are_queued(tiny, k, monkeypatch):
    """Eager, the tail is a `prefill_tail` call; with prefill graphs (CUDA) it is the replay of the
    key's tail graph (a capture's warm-up also calls `prefill_tail`: not part of the order)."""
    order: list = []
    capturing = [False]
    real_tail, real_start, real_capture = prefill_step.prefill_tail, HostFirst.start, PrefillGraphs._capture

    def tail(*a):
        if not capturing[0]:
            order.append("tail")
        return real_tail(*a)

    def start(out):
        order.append(("first", out.drafts is None, out.first_token.tolist()))
        return real_start(out)

    def capture(self, *a, **kw):
        capturing[0] = True
        try:
            return real_capture(self, *a, **kw)
        finally:
            capturing[0] = False

    monkeypatch.setattr(prefill_step, "prefill_tail", tail)
    monkeypatch.setattr(HostFirst, "start", staticmethod(start))
    monkeypatch.setattr(PrefillGraphs, "_capture", capture)
    if DEVICE == "cuda":
        real_replay = torch.cuda.CUDAGraph.replay

        def replay(graph):
            order.append(("replay", graph))
            return real_replay(graph)

        monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", replay)
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)
    engine = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, device=DEVICE))
    got = engine.generate(PROMPTS, params)
    graphs = engine.runner.prefill_graphs
    tails = [t for _, t, _, _ in graphs.graphs.values() if t is not None] if graphs is not None else []
    order = ["tail" if e[0] == "replay" and any(e[1] is t for t in tails) else e
             for e in order if e == "tail" or e[0] != "replay" or any(e[1] is t for t in tails)]
    assert order[0][:2] == ("first", True)  # one prefill step: first tokens, then drafts
    assert order[1:2] == (["tail"] if k or graphs is None else [])
    assert order[0][2] == [r.output_ids[0] for r in got]
    assert all(len(r.logprobs) == 6 for r in got)
    plain = LLMEngine(tiny, EngineConfig(num_speculative_tokens=0, device=DEVICE)).generate(PROMPTS, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]  # greedy: MTP changes no token
