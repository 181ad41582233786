"""Adaptive k on the GPU (skipped without CUDA): both steps are captured per bucket and timed at
start-up, a batch switching between them gives plain decoding's greedy tokens (fp32) with the
graphs, and its launches never sync (engine/spec_decode/adaptive_k.py)."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from tests.engine.test_adaptive_k import SWITCHES, K, Scripted
from tests.engine.test_gpu import PARAMS, _run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _adaptive(dtype: str, **kw) -> LLMEngine:
    eng = LLMEngine(load_model("tiny", device="cuda", dtype=dtype),
                    EngineConfig(num_speculative_tokens=K, device="cuda", spec_k_policy="adaptive", **kw))
    assert eng.runner.graphs is not None
    return eng


def test_both_steps_are_captured_and_timed_per_bucket():
    eng = _adaptive("bfloat16", max_num_seqs=8)
    graphs, costs = eng.runner.graphs, eng.runner.step_costs
    assert graphs is not None and set(costs) == set(graphs.buckets)
    assert all(c0 > 0 and ck > 0 for c0, ck in costs.values())
    assert set(graphs.plain_graphs) == set(graphs.graphs)
    assert eng.batch.policy is not None and eng.batch.policy.costs == costs


def test_switching_k_with_graphs_equals_plain_greedy_fp32():
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33, 2)]
    params = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=2)
    plain = LLMEngine(load_model("tiny", device="cuda", dtype="float32"),
                      EngineConfig(num_speculative_tokens=0, device="cuda")).generate(prompts, params)
    eng = _adaptive("float32")
    eng.batch.policy = Scripted(SWITCHES)
    got = eng.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in plain]
    assert eng.batch.k_steps[0] > 0 and eng.batch.k_steps[K] > 0
    assert eng.num_free_blocks == eng.blocks.capacity


def test_switching_k_launches_never_sync():
    eng = _adaptive("bfloat16")
    eng.batch.policy = Scripted(SWITCHES * 20)  # switches through both runs
    _run(eng, checked=False)  # captures the graphs this mix of requests needs (a one-time sync each)
    assert _run(eng, checked=True) > 5
    assert all(len(r.output_ids) == PARAMS[0].max_tokens for r in eng.requests.values())
    assert eng.batch.k_steps[0] > 0
