"""Inserting requests: many at once (one packed copy, a scatter per state tensor) leaves the
state exactly as inserting them one by one with the plain per-field writes would; host and
device first tokens mix; an insert queued for a request that ends first is dropped; and the
pinned staging pool reuses a buffer only once its copy has completed."""

from __future__ import annotations

import pytest
import torch

from engine.runner.batch_state import MAX_STOP_IDS, BatchState, SlotInit
from engine.runner.staging import PinnedStaging

from .conftest import DEVICE

K, VOCAB, BLOCKS = 2, 50, 6
FIELDS = ("seq_lens", "last_token", "drafts", "num_generated", "max_tokens", "done", "stop_ids",
          "block_tables", "temperature", "top_k", "top_p", "seed")


def _init(i: int, device_first: bool, probs: bool) -> SlotInit:
    first: torch.Tensor | int = torch.tensor(7 + i, device=DEVICE) if device_first else 7 + i
    drafts = torch.tensor([i, i + 1], device=DEVICE) if device_first else [i, i + 1]
    return SlotInit(seq_len=10 + i, first_token=first, drafts=drafts,
                    draft_probs=torch.full((K, VOCAB), 1.0 / VOCAB) if probs else None,
                    num_generated=1, max_tokens=20 + i, stop_ids=tuple(range(i % (MAX_STOP_IDS + 1))),
                    temperature=0.5 * i, top_k=i, top_p=1.0 - 0.1 * i, seed=2**40 + i, block_ids=[3 + i, 9])


def _expected(state: BatchState, slot: int, init: SlotInit) -> dict[str, torch.Tensor]:
    stops = list(init.stop_ids) + [-1] * (MAX_STOP_IDS - len(init.stop_ids))
    drafts = init.drafts.tolist() if isinstance(init.drafts, torch.Tensor) else init.drafts
    first = int(init.first_token)
    return {"seq_lens": init.seq_len, "last_token": first, "drafts": drafts, "num_generated": init.num_generated,
            "max_tokens": init.max_tokens, "done": False, "stop_ids": stops,
            "block_tables": init.block_ids + [0] * (BLOCKS - len(init.block_ids)),
            "temperature": torch.tensor(init.temperature, dtype=torch.float32).item(), "top_k": init.top_k,
            "top_p": torch.tensor(init.top_p, dtype=torch.float32).item(), "seed": init.seed}


@pytest.mark.parametrize("device_first", [False, True, "mixed"])
def test_many_inserts_write_every_field_of_every_slot(device_first):
    state = BatchState(8, K, BLOCKS, VOCAB, torch.device(DEVICE))
    inits = [(s, _init(i, device_first is True or (device_first == "mixed" and i % 2 == 0), probs=i == 2))
             for i, s in enumerate([5, 0, 3, 6])]
    state.insert_many_no_sync(inits)
    for slot, init in inits:
        for name, want in _expected(state, slot, init).items():
            assert getattr(state, name)[slot].tolist() == want, (slot, name)
    assert state.draft_probs is not None and torch.equal(state.draft_probs[3].cpu(), inits[2][1].draft_probs)
    untouched = [s for s in range(9) if s not in {5, 0, 3, 6}]
    assert state.done[untouched].all()  # the spare and free slots stay done


def test_too_many_stop_ids_is_a_clear_error():
    state = BatchState(2, K, BLOCKS, VOCAB, torch.device(DEVICE))
    bad = _init(0, False, False)
    bad.stop_ids = tuple(range(MAX_STOP_IDS + 1))
    with pytest.raises(ValueError, match="stop token ids"):
        state.insert_many_no_sync([(0, bad)])


def test_insert_queued_for_a_request_that_ends_first_is_dropped(tiny):
    from engine.engine import EngineConfig, LLMEngine
    from engine.sampling.sampling_params import SamplingParams

    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=K, max_num_seqs=2, device=DEVICE))
    rid = eng.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    chunks, reqs = eng._schedule_prefill()
    eng._run_prefill(chunks, reqs)  # inserted, not yet written
    slot = eng.requests[rid].slot
    assert slot in eng.batch._to_insert
    eng.abort(rid)
    assert slot not in eng.batch._to_insert and not eng.batch.running
    eng.step()
    assert bool(eng.runner.state.done[slot]) and eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned staging needs CUDA")
def test_staging_reuses_a_buffer_only_after_its_copy():
    staging = PinnedStaging(torch.device("cuda"))
    torch.cuda._sleep(50_000_000)  # keep the stream busy so the first copy stays pending
    first = staging.to_device(torch.arange(10))
    second = staging.to_device(torch.arange(10, 20))
    assert staging.num_buffers == 2  # the first buffer was still in flight
    torch.cuda.synchronize()
    staging.to_device(torch.arange(3))
    assert staging.num_buffers == 2  # reused once its event fired
    assert first.tolist() == list(range(10)) and second.tolist() == list(range(10, 20))
