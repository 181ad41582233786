"""Prompt logprobs (engine/runner/prompt_logprobs.py): every prompt token after the first gets the
logprob, rank and top-N of one fresh forward over the prompt, whatever the chunking, with MTP or
not, with a prefix-cache hit or not."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.sampling.sampling_params import SamplingParams
from tests.engine.conftest import DEVICE
from tests.engine.test_penalties import full_logits

PROMPT = [256, *range(60, 100)]  # 41 tokens


def reference(loaded, prompt: list[int]) -> list[torch.Tensor]:
    """log_softmax of the logits after each prefix prompt[:p], p = 1..len-1."""
    return [torch.log_softmax(full_logits(loaded, prompt[:p]), -1) for p in range(1, len(prompt))]


@pytest.mark.parametrize("k, budget, cache", [(0, 512, False), (2, 16, False), (2, 16, True)])
def test_prompt_logprobs_equal_a_fresh_forward(tiny, k, budget, cache):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, max_num_batched_tokens=budget,
                                       enable_prefix_caching=cache, device=DEVICE))
    params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=4)
    if cache:
        eng.generate([PROMPT], SamplingParams(max_tokens=2))  # its blocks cached: a prompt_logprobs request skips them
    out = eng.generate([PROMPT, PROMPT[:9]], [params, SamplingParams(max_tokens=3, ignore_eos=True)])
    assert out[1].prompt_logprobs is None
    got = out[0].prompt_logprobs
    assert got is not None and [e.token_id for e in got] == PROMPT[1:]
    for entry, row in zip(got, reference(tiny, PROMPT), strict=True):
        assert entry.logprob == pytest.approx(row[entry.token_id].item(), abs=1e-4)
        assert entry.rank == int((row > row[entry.token_id]).sum()) + 1
        top = torch.topk(row, 4)
        assert [i for i, _ in entry.top] == top.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=1e-4)
    assert eng.num_free_blocks == eng.blocks.capacity
