"""GPU-only (skipped without CUDA): penalties, logit_bias and n > 1 on the CUDA-graph decode path
never sync in a launch (I3), and give the eager CPU reference's greedy tokens (fp32)."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPT = list(range(5, 45))
PARAMS = [SamplingParams(max_tokens=30, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.3,
                         logit_bias=((65, 3.0),)),
          SamplingParams(max_tokens=30, ignore_eos=True, temperature=0.8, seed=2, presence_penalty=0.5, n=3),
          SamplingParams(max_tokens=30, ignore_eos=True)]


def _run(eng: LLMEngine, checked: bool) -> list:
    ids = [eng.add_request(PROMPT, p) for p in PARAMS]
    eng.step()
    real = eng.runner.launch_decode

    def launch(*a, **kw):
        torch.cuda.set_sync_debug_mode("error" if checked else "default")
        try:
            return real(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    eng.runner.launch_decode = launch  # type: ignore[method-assign]
    try:
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.runner.launch_decode = real  # type: ignore[method-assign]
    return [eng.requests.pop(i) for i in ids]


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_penalties_and_forks_never_sync_and_match_the_cpu(k, eager):
    eng = LLMEngine(load_model("tiny", device="cuda", dtype="float32"),
                    EngineConfig(num_speculative_tokens=k, device="cuda", enforce_eager=eager))
    _run(eng, checked=False)  # captures the graphs this mix needs (a one-time sync each)
    got = _run(eng, checked=True)
    assert [len(c.output_ids) for c in (got[1], *got[1].children)] == [30] * 3
    cpu = LLMEngine(load_model("tiny", dtype="float32"), EngineConfig(num_speculative_tokens=k))
    want = cpu.generate([PROMPT, PROMPT], [PARAMS[0], PARAMS[2]])
    assert [got[0].output_ids, got[2].output_ids] == [w.output_ids for w in want]
    assert eng.num_free_blocks == eng.blocks.capacity
