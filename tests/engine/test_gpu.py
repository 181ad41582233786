"""GPU-only checks (skipped without CUDA): the decode loop never syncs (I3) on the graph path
and the eager path, also with a draft vocabulary and with grammar-constrained rows (steps in two
halves around the masks), and each launch copies its outputs to the host
once, into one of two reused pinned buffers; the fast path (CUDA graphs + Triton kernels) gives
the eager torch reference's tokens; bf16 runs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.grammar.structured import StructuredSpec
from engine.model.loader import load_model
from engine.runner import model_runner
from engine.sampling.sampling_params import SamplingParams
from engine.spec_decode.draft_vocab import write_ranking
from kernels._dispatch import reference_kernels
from mtp.loop import grow_head

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PARAMS = [SamplingParams(max_tokens=40, ignore_eos=True),
          SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8, top_p=0.9, seed=1, logprobs=3)]


def _run(eng: LLMEngine, checked: bool, params: list[SamplingParams] = PARAMS,
         calls: tuple[str, ...] = ("runner.launch_decode",)) -> int:
    """Requests to the end; with `checked`, every call of `calls` (paths from the engine) runs under
    sync mode "error". Returns how many times the first was called."""
    for i, p in enumerate(params):
        eng.add_request(list(range(5, 12 + 7 * i)), p)
    eng.step()  # prefill (has its own read point) + first decode launch
    counts = dict.fromkeys(calls, 0)
    owners = [(eng if "." not in c else _owner(eng, c), c.rsplit(".", 1)[-1], c) for c in calls]
    reals = [getattr(o, n) for o, n, _ in owners]

    def wrap(real, path):
        def call(*a, **kw):
            torch.cuda.set_sync_debug_mode("error" if checked else "default")
            try:
                return real(*a, **kw)
            finally:
                torch.cuda.set_sync_debug_mode("default")
                counts[path] += 1
        return call

    for (o, n, path), real in zip(owners, reals, strict=True):
        setattr(o, n, wrap(real, path))
    try:
        while eng.has_unfinished():
            eng.step()
    finally:
        for (o, n, _), real in zip(owners, reals, strict=True):
            setattr(o, n, real)
    return counts[calls[0]]


def _owner(eng: LLMEngine, path: str):
    obj = eng
    for part in path.split(".")[:-1]:
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("k,features,draft_vocab", [(0, False, 0), (3, False, 0), (3, True, 0), (3, False, 64)])
def test_decode_launch_never_syncs(k, features, draft_vocab, eager, tmp_path):
    loaded = load_model("tiny", device="cuda", dtype="bfloat16")
    if features:  # a head that also reads target layer 0, with a wider MLP
        grow_head(loaded.model, 192, (0,), seed=3)
    if draft_vocab:  # drafts over 64 tokens of a made-up ranking
        rank = tmp_path / "tiny.vocab_rank.safetensors"
        write_ranking(rank, torch.arange(loaded.model.config.vocab_size) % 7, {})
        loaded = dataclasses.replace(loaded, vocab_rank_path=str(rank))
    eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, draft_vocab_size=draft_vocab, device="cuda",
                                         enforce_eager=eager))
    assert (eng.runner.graphs is None) == eager
    _run(eng, checked=False)  # captures the graphs this mix of requests needs (a one-time sync each)
    assert _run(eng, checked=True) > 5
    assert all(len(r.output_ids) == 40 for r in eng.requests.values())
    assert eng.runner.outputs.num_buffers == 2  # launch N+1 before reading N: double buffered


REGEX = SamplingParams(max_tokens=40, structured=StructuredSpec("regex", "[a-z ]{60}"))
CONSTRAINED = {  # constrained rows beside a free one; "apart": their slots not consecutive (their masks scattered)
    "mixed": [REGEX, dataclasses.replace(REGEX, temperature=0.9, seed=4, logprobs=2), PARAMS[0]],
    "greedy": [REGEX, PARAMS[0]],
    "apart": [REGEX, PARAMS[0], REGEX],
}


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("rows", ["mixed", "greedy", "apart"])
def test_constrained_steps_in_halves_never_sync(k, eager, rows):
    """A batch with grammar-constrained rows (greedy and sampled, or greedy alone: the masks inside
    the LM head's argmax) beside a free one: each step's forward half, its masks' fill and copy, and
    its second half are queued without a sync (the read of the previous step between them is the
    loop's one read point)."""
    eng = LLMEngine(load_model("tiny", device="cuda", dtype="bfloat16"),
                    EngineConfig(num_speculative_tokens=k, device="cuda", enforce_eager=eager))
    params = CONSTRAINED[rows]
    calls = ("runner.launch_forward", "runner.launch_finish", "batch.constrained.write_masks_no_sync")
    _run(eng, checked=False, params=params, calls=calls)  # captures the graphs
    assert _run(eng, checked=True, params=params, calls=calls) > 5
    assert all(len(r.output_ids) == 40 for r in eng.requests.values())
    assert eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.parametrize("rows", ["greedy", "apart"])
def test_a_constrained_step_copies_its_masks_to_the_device_once(rows):
    """A steady constrained batch (graphs, no insert, no finish): each step's masks come in one
    host-to-device copy, with the slot ids behind them where the slots are not consecutive."""
    from torch.profiler import ProfilerActivity, profile

    eng = LLMEngine(load_model("tiny", device="cuda", dtype="bfloat16"),
                    EngineConfig(num_speculative_tokens=0, device="cuda"))
    params = CONSTRAINED[rows]
    _run(eng, checked=False, params=params)  # captures the graphs
    for i, p in enumerate(params):
        eng.add_request(list(range(5, 12 + 7 * i)), p)
    for _ in range(5):  # the prefill, the inserts and their copies stay out of the count
        eng.step()
    torch.cuda.synchronize()
    constrained, writes = eng.batch.constrained, 0
    real = constrained.write_masks_no_sync

    def write(slots):
        nonlocal writes
        writes += 1
        return real(slots)

    constrained.write_masks_no_sync = write  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    constrained.write_masks_no_sync = real  # type: ignore[method-assign]
    gpu = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert writes == 5 and sum("HtoD" in n for n in gpu) == writes, gpu
    while eng.has_unfinished():
        eng.step()
    assert eng.num_free_blocks == eng.blocks.capacity


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("params", [PARAMS[:1], PARAMS], ids=["greedy", "with-logprobs"])
def test_each_decode_launch_copies_its_outputs_to_the_host_once(params, eager):
    """One device-to-host copy per launch (the packed outputs: tokens, counts, flags, logprobs):
    one publish kernel and no memcpy."""
    from torch.profiler import ProfilerActivity, profile

    eng = LLMEngine(load_model("tiny", device="cuda", dtype="bfloat16"),
                    EngineConfig(num_speculative_tokens=3, device="cuda", enforce_eager=eager))
    _run(eng, checked=False, params=params)  # captures the graphs
    for i, p in enumerate(params):
        eng.add_request(list(range(5, 12 + 7 * i)), p)
    eng.step()  # the prefill and its own read point stay out of the count
    torch.cuda.synchronize()  # and so does the copy of the launch it made
    launches, real = 0, eng.runner.launch_decode

    def launch(*a, **kw):
        nonlocal launches
        launches += 1
        return real(*a, **kw)

    eng.runner.launch_decode = launch  # type: ignore[method-assign]
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        while eng.has_unfinished():
            eng.step()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    copies = [e for e in gpu if "_publish_kernel" in e.name]  # the copy is a kernel writing pinned memory
    assert launches > 5 and len(copies) == launches
    assert not any("DtoH" in e.name for e in gpu)


@pytest.mark.parametrize("k", [0, 3])
def test_fast_path_greedy_equals_eager_reference_fp32(k):
    prompts = [list(range(3, 3 + n)) for n in (5, 17, 33, 2)]
    params = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=2)
    fast = LLMEngine(load_model("tiny", device="cuda", dtype="float32"),
                     EngineConfig(num_speculative_tokens=k, device="cuda"))
    assert fast.runner.graphs is not None
    got = fast.generate(prompts, params)
    with reference_kernels():
        ref_eng = LLMEngine(load_model("tiny", device="cuda", dtype="float32"),
                            EngineConfig(num_speculative_tokens=k, device="cuda", enforce_eager=True,
                                         attention_backend="torch"))
        ref = ref_eng.generate(prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in ref]
    for a, b in zip(got, ref, strict=True):
        assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)


@pytest.mark.parametrize("k", [0, 3])
def test_graphs_of_every_table_width_give_eager_tokens_fp32(k, monkeypatch):
    """A row replays the graphs of the narrowest block-table width its blocks fit (`short_blocks`
    16, 32 and 48: 1, 4 and 6 key splits), and a row that grows past them, and a batch holding one,
    the full-width graphs (max_blocks: 65 at 1024 tokens, 9 splits). The tokens equal the eager
    reference's either way, and every width ran. (48 in place of the default's 64: with k=0 no row
    of tiny's 1024 positions outgrows 64 blocks.)"""
    monkeypatch.setattr(model_runner, "SHORT_KV_BLOCKS", (16, 32, 48))
    prompts = [[3 + (7 * i) % 200 for i in range(n)] for n in (5, 300, 600, 975)]
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    fast = LLMEngine(load_model("tiny", device="cuda", dtype="float32"),
                     EngineConfig(num_speculative_tokens=k, device="cuda", max_model_len=1024))
    graphs = fast.runner.graphs
    assert graphs is not None and graphs.widths[1] == graphs.widths[4] == [16, 32, 48, fast.runner.max_blocks]
    widths, real_key = [], graphs.key
    graphs.key = lambda *a: widths.append(real_key(*a)[-1]) or real_key(*a)  # type: ignore[method-assign]
    got = [fast.generate([p], params)[0].output_ids for p in prompts] + [
        r.output_ids for r in fast.generate(prompts, params)]
    assert set(widths) == set(graphs.widths[1])
    with reference_kernels():
        ref_eng = LLMEngine(load_model("tiny", device="cuda", dtype="float32"),
                            EngineConfig(num_speculative_tokens=k, device="cuda", enforce_eager=True,
                                         attention_backend="torch", max_model_len=1024))
        ref = [ref_eng.generate([p], params)[0].output_ids for p in prompts] + [
            r.output_ids for r in ref_eng.generate(prompts, params)]
    assert got == ref


def test_bf16_greedy_generates():
    loaded = load_model("tiny", device="cuda", dtype="bfloat16")
    eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=2, device="cuda"))
    out = eng.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=16, ignore_eos=True))
    assert len(out[0].output_ids) == 16


def test_seeded_sampling_same_alone_and_in_a_larger_bucket():
    loaded = load_model("tiny", device="cuda", dtype="float32")
    eng = LLMEngine(loaded, EngineConfig(num_speculative_tokens=3, device="cuda"))
    seeded = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.9, top_k=50, seed=11)
    alone = eng.generate([[7, 8, 9]], seeded)[0].output_ids
    others = SamplingParams(max_tokens=32, ignore_eos=True, temperature=0.7, seed=5)
    mixed = eng.generate([[1, 2], [3, 4, 5], [7, 8, 9], [6] * 9, [2, 2]],
                         [others, others, seeded, others, others])
    assert mixed[2].output_ids == alone
