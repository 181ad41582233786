"""What a captured decode step relies on, checked on the CPU: the buckets, and that padding a
step's rows with the spare slot (as a graph of a larger bucket does) changes neither the real
rows' results nor any state but the spare's and the trash block's. The step runs the
batch-invariant kernels (`--deterministic`), so "the same results" means the same bits on any
machine: with the default kernels more rows in a GEMM may round differently, and whether that
moves a token or the order of a top-3 would be the CPU's luck. The host reads the same of
both steps' packed outputs (`collect`). The graphs hold no step stamps by default; on a GPU,
with settings.STEP_STAMPS they stamp every step and give the same tokens."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import settings
from engine.engine import EngineConfig, LLMEngine
from engine.model.attention import TRASH_BLOCK
from engine.model.loader import load_model
from engine.runner.cuda_graphs import DecodeGraphs, bucket_sizes
from engine.runner.model_runner import DecodeHandle
from engine.sampling.sampling_params import SamplingParams

from .conftest import DEVICE

STATE = ("seq_lens", "last_token", "drafts", "num_generated", "max_tokens", "done", "stop_ids", "block_tables")


def test_buckets_are_powers_of_two_then_the_capacity():
    assert bucket_sizes(1) == [1]
    assert bucket_sizes(32) == [1, 2, 4, 8, 16, 32]
    assert bucket_sizes(48) == [1, 2, 4, 8, 16, 32, 48]


def _snapshot(runner) -> dict[str, torch.Tensor]:
    snap = {n: getattr(runner.state, n).clone() for n in STATE}
    snap.update({f"kv{i}": t.clone() for i, t in enumerate(runner.kv.layers)})
    return snap


def _restore(runner, snap: dict[str, torch.Tensor]) -> None:
    for n in STATE:
        getattr(runner.state, n).copy_(snap[n])
    for i, t in enumerate(runner.kv.layers):
        t.copy_(snap[f"kv{i}"])


def test_spare_padding_rows_change_nothing_but_the_spare_and_trash(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, max_num_seqs=4, device=DEVICE, deterministic=True))
    for n in (5, 19):
        eng.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=30, ignore_eos=True))
    eng.step()
    eng.step()
    runner, spare = eng.runner, eng.runner.state.spare
    rows = torch.tensor(sorted(eng.batch.running), device=DEVICE)
    before = _snapshot(runner)
    plain = runner.decode_step(rows, (True, False, False, False), slice(None), 3, runner.max_blocks)
    after_plain = _snapshot(runner)
    _restore(runner, before)
    padded_rows = torch.cat([rows, torch.full((2,), spare, device=DEVICE)])
    padded = runner.decode_step(padded_rows, (True, False, False, False), slice(None), 3, runner.max_blocks)
    after_padded = _snapshot(runner)
    r = rows.shape[0]
    assert torch.equal(padded.tokens[:r], plain.tokens) and torch.equal(padded.num_emitted[:r], plain.num_emitted)
    assert padded.num_emitted[r:].tolist() == [0, 0] and not padded.finished[r:].any()
    assert plain.logprobs is not None and padded.logprobs is not None
    assert torch.equal(padded.logprobs.top_ids[: r * 3], plain.logprobs.top_ids)
    assert torch.equal(padded.logprobs.top_logprobs[: r * 3], plain.logprobs.top_logprobs)
    for name in STATE:
        assert torch.equal(after_padded[name][:spare], after_plain[name][:spare]), name
    assert bool(after_padded["done"][spare])
    slots, lp = rows.tolist(), {0: 3, 1: 2}
    read = [runner.collect(DecodeHandle(slots, o.layout, runner.outputs.copy_no_sync(o.packed), {0: 0, 1: 1}), lp)
            for o in (plain, padded)]  # what the host reads of the packed outputs: the padding rows left out
    assert read[0] == read[1] and [len(t) for t in read[0].tokens] == plain.num_emitted.tolist()
    assert [len(ids) for ids in read[0].logprobs[1].top_ids] == [2] * len(read[0].tokens[1])
    keep = torch.arange(runner.kv.num_blocks, device=DEVICE) != TRASH_BLOCK
    for i in range(len(runner.kv.layers)):
        assert torch.equal(after_padded[f"kv{i}"][:, keep], after_plain[f"kv{i}"][:, keep])
        assert not torch.equal(after_padded[f"kv{i}"][:, keep], before[f"kv{i}"][:, keep])  # the step wrote


def test_graphs_stamp_nothing_by_default(monkeypatch):
    monkeypatch.setattr(settings, "STEP_STAMPS", settings.REGISTRY["PDSERVE_STEP_STAMPS"].read({}))
    runner = SimpleNamespace(state=SimpleNamespace(spare=4), device=torch.device("cuda"), short_blocks=(16,), max_blocks=64,
                             attention_splits=lambda rows, blocks: 1)
    assert DecodeGraphs(runner, 4).stamps is None  # type: ignore[arg-type]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="stamps read the GPU's clock: needs CUDA")
def test_step_stamps_change_no_token_and_stamp_every_step(monkeypatch):
    loaded = load_model("tiny", device="cuda", dtype="float32")
    prompts, params = [list(range(5, 12)), list(range(5, 30))], SamplingParams(max_tokens=20, ignore_eos=True)
    tokens = {}
    for on in ("0", "1"):
        monkeypatch.setattr(settings, "STEP_STAMPS", on == "1")
        eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=2, device="cuda"))
        stamps = eng.runner.graphs.stamps  # type: ignore[union-attr]
        assert (stamps is not None) == (on == "1")
        if stamps is not None:
            stamps.reset()
        tokens[on] = [r.output_ids for r in eng.generate(prompts, params)]
        if stamps is not None:
            spans = stamps.read()
            assert spans and all(0 < s < e for s, e in spans)
            assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:], strict=False))
    assert tokens["0"] == tokens["1"]


def _llama_1b_graphs(short_blocks: tuple[int, ...]) -> DecodeGraphs:
    """DecodeGraphs over a runner shaped as Llama-1B (8 kv heads) at max_model_len 4096 (257 blocks)."""
    from engine.runner.model_runner import decode_splits

    runner = SimpleNamespace(state=SimpleNamespace(spare=128), device=torch.device("cpu"), short_blocks=short_blocks,
                             max_blocks=257, attention_splits=lambda rows, blocks: decode_splits(rows, 8, blocks))
    return DecodeGraphs(runner, 128)  # type: ignore[arg-type]


def test_default_splits_give_a_row_about_one_key_tile_a_split(monkeypatch):
    """Up to 16 blocks one split (no combine), then a split per 8 blocks (one 128-key tile), capped
    by the grid (264 programs) alone; settings.MAX_SPLITS caps it further."""
    import engine.runner.model_runner as mr

    assert mr.SHORT_KV_BLOCKS == (16, 32, 64, 128, 192)
    assert [mr.decode_splits(1, 8, n) for n in (16, 17, 32, 64, 128, 192, 257)] == [1, 3, 4, 8, 16, 24, 33]
    assert [mr.decode_splits(r, 8, 257) for r in (2, 4, 16, 32)] == [16, 8, 2, 1]  # the grid's cap
    assert mr.decode_splits(1, 3, 2049) == 88  # SmolLM2's 3 kv heads at 32k: the grid caps it
    monkeypatch.setattr(mr, "MAX_SPLITS", 16)
    assert [mr.decode_splits(1, 8, n) for n in (64, 257)] == [8, 16]


def test_graph_keys_take_a_narrow_width_only_where_it_splits_the_keys_differently():
    """A step replays the narrowest width its widest row fits; a bucket keeps only the widths whose
    split count differs from the next wider one kept (from 32 rows the rows alone fill the GPU:
    one split at any width, so max_blocks only)."""
    graphs = _llama_1b_graphs((16, 32, 64, 128, 192))
    assert graphs.widths == {1: [16, 32, 64, 128, 192, 257], 2: [16, 32, 64, 257], 4: [16, 32, 257], 8: [16, 257],
                             16: [16, 257], 32: [257], 64: [257], 128: [257]}
    flags = (True, False, False, False)
    assert [graphs.key(1, flags, False, n)[-1] for n in (3, 16, 17, 33, 65, 128, 129, 193)] == [
        16, 16, 32, 64, 128, 128, 192, 257]
    assert graphs.key(3, flags, True, 16) == (4, *flags, True, 16)
    assert graphs.key(3, flags, False, 65) == (4, *flags, False, 257)
    assert graphs.key(40, flags, False, 2) == (64, *flags, False, 257)
    graphs = _llama_1b_graphs((16,))  # settings.SHORT_KV_BLOCKS (16,): one narrow width
    assert graphs.widths[1] == [16, 257] and graphs.widths[32] == [257]
    assert [graphs.key(1, flags, False, n)[-1] for n in (16, 17)] == [16, 257]
