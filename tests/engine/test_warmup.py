"""The start-up warm-up (engine/warmup.py): its dummy prompts touch no request's state.

On the CPU there are no graphs to capture, so this runs the warm-up's dummy steps through the
eager prefill (the same `prefill_forward` a graph captures): every KV block but the trash block
keeps its contents, the block manager hands out nothing, and the steps' keys are the variants the
warm-up means to cover. tests/engine/test_gpu_prefill.py checks the captured graphs on a GPU."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.prefill_graphs import pow2_buckets
from engine.prefill_step import key_for
from engine.sampling_params import SamplingParams
from engine.warmup import GREEDY, SAMPLED, VARIANTS, dummy_chunks, rows_for, warm_up
from tests.engine.conftest import DEVICE


@pytest.mark.parametrize("k", [0, 2])
def test_dummy_prompts_write_only_the_trash_block(tiny, k):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=k, device=DEVICE, enforce_eager=True))
    eng.generate([[5, 6, 7, 8] * 9], SamplingParams(max_tokens=6, ignore_eos=True))  # some real KV to keep
    before = [t.clone() for t in eng.runner.kv.layers]
    free = eng.blocks.num_free
    for params, lp in VARIANTS:
        out = eng.runner.prefill(dummy_chunks(64, 2, params, lp))
        assert out.first_token.shape == (2,) and (out.drafts is not None) == (k > 0)
    assert eng.blocks.num_free == free
    for old, new in zip(before, eng.runner.kv.layers, strict=True):
        assert torch.equal(old[:, 1:], new[:, 1:]), "a block other than the trash block changed"


def test_dummy_prompts_cover_the_variants():
    keys = {key_for(dummy_chunks(128, 4, p, lp), 128, 4, 32) for p, lp in VARIANTS}
    assert {(k.all_greedy, k.needs_filter, k.top_logprobs, k.fresh) for k in keys} == {
        (True, False, None, True), (True, False, 0, True), (False, False, None, True), (False, False, 0, True)}
    chunks = dummy_chunks(100, 3, SAMPLED, None)
    assert [c.end for c in chunks] == [34, 33, 33] and all(c.is_last and c.block_ids == [] for c in chunks)
    assert all(c.params.temperature == 0 for c in dummy_chunks(16, 1, GREEDY, None))


def test_rows_fit_the_context():
    rows = pow2_buckets(1, 32)
    assert rows_for(2048, rows, 4096) == 1
    assert rows_for(8192, rows, 2048) == 4  # one row of 8192 tokens would pass the context
    assert rows_for(16, rows, 4) == 4
    assert rows_for(16, [1, 2], 4) is None


def test_nothing_to_warm_without_graphs(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, enforce_eager=True))
    report = warm_up(eng.runner, decode=True, prefill=True, prefill_events=False, max_model_len=eng.max_model_len)
    assert (report.decode_graphs, report.prefill_graphs) == (0, 0)
