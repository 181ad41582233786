"""GPU-only checks (skipped without CUDA): the decode launch never syncs (I3, also with a draft
vocabulary), bf16 runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.draft_vocab import write_ranking
from engine.engine import EngineConfig, LLMEngine
from engine.loader import load_model
from engine.mtp_train import grow_head
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("k,features,draft_vocab", [(0, False, 0), (3, False, 0), (3, True, 0), (3, False, 64)])
def test_decode_launch_never_syncs(k, features, draft_vocab, tmp_path):
    loaded = load_model("tiny", device="cuda", dtype="bfloat16")
    if features:  # a head that also reads target layer 0, with a wider MLP
        grow_head(loaded.model, 192, (0,), seed=3)
    if draft_vocab:  # drafts over 64 tokens of a made-up ranking
        rank = tmp_path / "tiny.vocab_rank.safetensors"
        write_ranking(rank, torch.arange(loaded.model.config.vocab_size) % 7, {})
        loaded = dataclasses.replace(loaded, vocab_rank_path=str(rank))
    eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, draft_vocab_size=draft_vocab, device="cuda"))
    params = [SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1, logprobs=3)]
    for i, p in enumerate(params):
        eng.add_request(list(range(5, 12 + 7 * i)), p)
    eng.step()  # prefill (has its own read point) + first decode launch
    launches = 0
    real = eng.runner.launch_decode

    def checked(*a, **kw):
        nonlocal launches
        torch.cuda.set_sync_debug_mode("error")
        try:
            return real(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")
            launches += 1

    eng.runner.launch_decode = checked  # type: ignore[method-assign]
    while eng.has_unfinished():
        eng.step()
    assert launches > 5
    assert all(len(r.output_ids) == 40 for r in eng.requests.values())


def test_bf16_greedy_generates():
    loaded = load_model("tiny", device="cuda", dtype="bfloat16")
    eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=2, device="cuda"))
    out = eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(out[0].output_ids) == 16
