"""GPU-only (skipped without CUDA): prefill as CUDA graphs (engine/runner/prefill_graphs.py).

In fp32 the graphs give eager's greedy tokens and logprobs; a prefill step launches without a
sync once its graph is captured (I3 covers prefill); chunked prefill and cached prefixes give
one-shot prefill's tokens through the graphs; a replay hands every layer out as queued, in
order."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.request import PrefillChunk
from engine.sampling.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [list(range(3, 3 + n)) for n in (5, 17, 33, 2, 70)]


def engine(k: int, dtype: str = "float32", **kw) -> LLMEngine:
    return LLMEngine(load_model("tiny", device="cuda", dtype=dtype), EngineConfig(num_speculative_tokens=k, device="cuda", **kw))


@pytest.mark.parametrize("k", [0, 3])
def test_prefill_graphs_give_eager_tokens_and_logprobs_fp32(k):
    params = [SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=4, logprobs=1)]
    fast = engine(k)
    assert fast.runner.prefill_graphs is not None
    got = [fast.generate(PROMPTS, p) for p in params]
    assert fast.runner.prefill_graphs.graphs, "the prefills replayed graphs"
    eager = engine(k, enforce_eager=True)
    assert eager.runner.prefill_graphs is None
    want = [eager.generate(PROMPTS, p) for p in params]
    for a_run, b_run in zip(got, want, strict=True):
        assert [r.output_ids for r in a_run] == [r.output_ids for r in b_run]
        for a, b in zip(a_run, b_run, strict=True):
            assert [lp.logprob for lp in a.logprobs] == pytest.approx([lp.logprob for lp in b.logprobs], abs=1e-4)


@pytest.mark.parametrize("k", [0, 3])
def test_prefill_step_never_syncs_once_captured(k):
    eng = engine(k)
    runner = eng.runner
    params = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=3)
    blocks = eng.blocks.allocate(eng.blocks.blocks_for(64))
    chunks = [PrefillChunk(list(range(1, 41)), 0, 40, blocks, params, 7)]
    runner.prefill(chunks)  # captures
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = runner.prefill(chunks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.first_token.shape == (1,) and (out.drafts is not None) == (k > 0)
    eng.blocks.free(blocks)


def test_chunked_and_cached_prefixes_give_one_shot_tokens_through_graphs():
    shared = list(range(10, 58))  # three full blocks
    prompts = [shared + [5, 6, 7], shared + [9], list(range(100, 140))]
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    one_shot = [r.output_ids for r in engine(3).generate(prompts, params)]
    chunked = engine(3, max_num_batched_tokens=16)
    assert [r.output_ids for r in chunked.generate(prompts, params)] == one_shot
    cached = engine(3, enable_prefix_caching=True)
    cached.generate(prompts[:1], params)  # leaves the shared blocks cached
    assert [r.output_ids for r in cached.generate(prompts, params)] == one_shot
    assert any(not key.fresh for key in cached.runner.prefill_graphs.graphs), "a step ran after a cached prefix"


def test_a_replay_hands_every_layer_out_as_queued_in_order():
    """No graph-recorded events go out (they cannot be waited on before their node runs): after a
    replay the listener gets every layer with None, in order, and one graph serves with or
    without a listener."""
    eng = engine(3, dtype="bfloat16")
    seen: list[tuple[int, object]] = []
    blocks = eng.blocks.allocate(eng.blocks.blocks_for(200))
    chunk = PrefillChunk(list(range(1, 151)), 0, 150, blocks, SamplingParams(max_tokens=2), 1)
    eng.runner.prefill([chunk], on_layer=lambda i, ready: seen.append((i, ready)))
    eng.runner.prefill([chunk], on_layer=lambda i, ready: seen.append((i, ready))).first_token.tolist()
    layers = eng.runner.num_target_layers
    assert seen == [(i, None) for i in range(layers)] * 2
    eng.runner.prefill([chunk]).first_token.tolist()
    assert len(eng.runner.prefill_graphs.graphs) == 1
    eng.blocks.free(blocks)


def test_fused_prefill_kernels_run_and_agree_with_the_unfused_path(monkeypatch):
    """bf16 fresh prefill takes the q/k/v GEMM with rotary + K/V write (kernels/qkv_rope.py) and the
    gate/up GEMM with SwiGLU (kernels/gemm_glu.py); the batch-invariant mode, which takes neither,
    gives the same first tokens and logprobs to bf16 summation order."""
    import engine.model.attention as attention
    from kernels import gemm_glu

    calls = {"qkv_rope": 0, "glu": 0}

    def spy(name, fn):
        def wrapped(*args, **kw):
            calls[name] += 1
            return fn(*args, **kw)
        return wrapped

    monkeypatch.setattr(attention, "qkv_rope", spy("qkv_rope", attention.qkv_rope))
    monkeypatch.setattr(gemm_glu, "glu_gemm", spy("glu", gemm_glu.glu_gemm))
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=1)
    prompts = [*PROMPTS, list(range(5, 95))]  # 217 tokens: past the rows where the decode path's kernels run
    fused = engine(0, dtype="bfloat16", enforce_eager=True).generate(prompts, params)
    assert calls["qkv_rope"] > 0 and calls["glu"] > 0
    before = dict(calls)
    plain = engine(0, dtype="bfloat16", enforce_eager=True, deterministic=True).generate(prompts, params)
    assert calls == before, "in the batch-invariant mode neither fused kernel runs"
    for a, b in zip(fused, plain, strict=True):
        assert a.output_ids[0] == b.output_ids[0]
        assert abs(a.logprobs[0].logprob - b.logprobs[0].logprob) < 0.05


@pytest.mark.parametrize("k", [0, 3])
def test_warmed_up_node_captures_nothing_for_single_prompts(k):
    """After engine/runner/warmup.py, one prompt at a time (greedy, with logprobs) replays graphs the
    warm-up captured, and gives eager's tokens."""
    from engine.runner.warmup import warm_up

    eng = engine(k)
    report = warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    assert report.decode_graphs > 0 and report.prefill_graphs > 0
    pg, dg = eng.runner.prefill_graphs, eng.runner.graphs
    captured = (len(pg.graphs), len(dg.graphs))
    params = SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2)
    got = [eng.generate([p], params)[0].output_ids for p in PROMPTS]
    assert (len(pg.graphs), len(dg.graphs)) == captured, "a request met a key the warm-up left out"
    eager = engine(k, enforce_eager=True)
    assert got == [eager.generate([p], params)[0].output_ids for p in PROMPTS]


def test_warmed_up_node_captures_no_new_shape_on_a_requests_path_and_none_is_cold_after_idling():
    """Right after the warm-up, greedy requests of varied lengths (some chunked past the token budget)
    in batches of varied sizes meet shapes with no graph: those steps run eagerly or in a larger
    shape's graph, and no graph is captured on their path. After an idle pause (the node's `capture_deferred` rounds) every listed
    shape has its graph, and the same requests meet no cold shape, capture nothing and give the
    eager steps' tokens (fp32)."""
    from engine.runner.warmup import capture_deferred, warm_up

    eng = engine(3, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    pg, dg, shapes = eng.runner.prefill_graphs, eng.runner.graphs, eng.runner.shapes
    before = len(pg.graphs)
    prompts = [[7 + i] * n for i, n in enumerate([5, 17, 40, 100, 3, 9, 150, 2])]
    params = [SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True) for i in range(len(prompts))]
    first = eng.generate(prompts, params)
    assert any(s not in shapes.warm for s in shapes.met) and pg.pending and len(pg.graphs) == before
    while capture_deferred(eng.runner, eng.max_model_len):  # the node idles
        pass
    assert shapes.status()["graph_shapes_pending"] == 0 and not pg.pending and not dg.deferred
    captured, shapes.cold = (len(pg.graphs), len(dg.graphs)), 0
    again = eng.generate(prompts, params)
    eng.generate(prompts[2:5], params[2:5])
    assert (len(pg.graphs), len(dg.graphs)) == captured and not pg.pending
    assert shapes.cold == 0 and len(shapes.met) >= 6
    assert [r.output_ids for r in again] == [r.output_ids for r in first]


def test_after_warm_up_a_new_key_runs_eagerly_then_is_captured_when_idle():
    """engine/runner/warmup.py defers: a key the warm-up left out (top-k filter) runs eagerly, waits in
    `pending`, and `capture_deferred` captures it over dummy prompts; the graph then gives the
    eager step's tokens (fp32, seeded)."""
    from engine.runner.warmup import capture_deferred, warm_up

    eng = engine(3)
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    pg = eng.runner.prefill_graphs
    captured = len(pg.graphs)
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.7, top_k=5, seed=3)
    eager = eng.generate([PROMPTS[1]], params)[0].output_ids
    assert len(pg.graphs) == captured and len(pg.pending) == 1
    assert capture_deferred(eng.runner, eng.max_model_len) and len(pg.graphs) == captured + 1 and not pg.pending
    assert eng.generate([PROMPTS[1]], params)[0].output_ids == eager
    assert len(pg.graphs) == captured + 1


def test_a_deferred_key_that_keeps_coming_is_captured_on_its_path():
    """A busy node never idles: a deferred key of a shape that has a graph (another sampling variant's)
    runs eagerly EAGER_RUNS_BEFORE_CAPTURE times, then the next step captures it as on first use."""
    from engine.runner.prefill_graphs import EAGER_RUNS_BEFORE_CAPTURE
    from engine.runner.warmup import warm_up

    eng = engine(0)
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    pg = eng.runner.prefill_graphs
    captured = len(pg.graphs)
    params = SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.7, top_k=5, seed=3)
    runs = [eng.generate([PROMPTS[1]], params)[0].output_ids for _ in range(EAGER_RUNS_BEFORE_CAPTURE)]
    assert len(pg.graphs) == captured and len(pg.pending) == 1
    runs.append(eng.generate([PROMPTS[1]], params)[0].output_ids)
    assert len(pg.graphs) == captured + 1 and not pg.pending
    assert all(r == runs[0] for r in runs)


def test_deterministic_warm_up_and_idle_captures_take_the_batch_invariant_kernels(prefill_modes):
    """The warm-up and `capture_deferred` call the graphs from outside the runner's `prefill`, which
    sets the kernel mode: with `--deterministic` every prefill they capture must still run the
    batch-invariant kernels (the mode is baked into the graph; without it a deterministic
    service's tokens left the reference, 2026-11-26)."""
    from engine.runner.warmup import capture_deferred, warm_up

    modes = prefill_modes
    eng = engine(3, dtype="bfloat16", deterministic=True)
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    assert modes and all(modes)
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.7, top_k=5, seed=3)
    eng.generate([PROMPTS[1]], params)  # a key the warm-up left out: eager, then pending
    modes.clear()
    assert capture_deferred(eng.runner, eng.max_model_len)
    assert modes and all(modes)


@pytest.mark.parametrize("k", [0, 3])
def test_deterministic_resume_from_a_reprefill_gives_the_same_bits(k):
    """A migrated request resumes by prefilling its prompt and the tokens it has: under
    `--deterministic` (bf16) its next tokens and their logprobs' bits must be those of the request
    that was never moved, which decoded those positions one step (or verify window) at a time."""
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1)
    prompts = [list(range(7, 7 + n)) for n in (9, 30, 77)]
    whole = engine(k, dtype="bfloat16", deterministic=True).generate(prompts, params)
    cut = 17
    resumed_prompts = [p + r.output_ids[:cut] for p, r in zip(prompts, whole, strict=True)]
    rest = SamplingParams(max_tokens=40 - cut, ignore_eos=True, logprobs=1)
    resumed = engine(k, dtype="bfloat16", deterministic=True).generate(resumed_prompts, rest)
    for a, b in zip(whole, resumed, strict=True):
        assert a.output_ids[cut:] == b.output_ids
        assert [lp.logprob for lp in a.logprobs[cut:]] == [lp.logprob for lp in b.logprobs]


@pytest.mark.parametrize("k", [0, 3])
def test_mtp_drafts_replay_a_graph_of_their_own_after_the_first_tokens(k):
    """With MTP a prefill key has two graphs, the first tokens' and then the drafts' (the engine
    queues the first tokens' copy to the host between them: engine/sched/chunked_prefill.py)."""
    eng = engine(k)
    eng.generate(PROMPTS[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    tails = [tail for _, tail, _, _ in eng.runner.prefill_graphs.graphs.values()]
    assert tails and all((tail is not None) == (k > 0) for tail in tails)


def test_constrained_first_tokens_replay_a_graph_and_equal_eager():
    """A prompt with a grammar prefills through a graph (its first token's mask in the bucket's
    mask rows, beside a free prompt's all-allowed row) and gives eager's tokens (fp32); a
    deferred constrained key is captured over dummy prompts and replays the same."""
    import re

    from engine.grammar.structured import StructuredSpec
    from engine.model.tiny import EOS_ID
    from engine.runner.warmup import capture_deferred, warm_up

    regex = "[a-c]{3}x[0-9]{2}"
    spec = StructuredSpec("regex", regex)
    params = [SamplingParams(max_tokens=10, structured=spec), SamplingParams(max_tokens=10, structured=spec,
                                                                              temperature=0.9, seed=3),
              SamplingParams(max_tokens=10, ignore_eos=True)]
    fast = engine(3)
    got = fast.generate(PROMPTS[:3], params)
    assert any(key.constrained for key in fast.runner.prefill_graphs.graphs)
    want = engine(3, enforce_eager=True).generate(PROMPTS[:3], params)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    for r in got[:2]:
        assert r.output_ids[-1] == EOS_ID and re.fullmatch(regex, bytes(r.output_ids[:-1]).decode())
    node = engine(3)  # a node defers new keys: eager first, then captured when idle
    warm_up(node.runner, decode=True, prefill=True, max_model_len=node.max_model_len)
    pg = node.runner.prefill_graphs
    first = node.generate([PROMPTS[1]], params[0])[0].output_ids
    assert any(key.constrained for key in pg.pending)
    while pg.pending:  # the keys requests met come first in the idle captures
        assert capture_deferred(node.runner, node.max_model_len)
    assert any(key.constrained for key in pg.graphs)
    assert node.generate([PROMPTS[1]], params[0])[0].output_ids == first


def test_a_step_with_no_graph_of_its_own_replays_a_larger_one_and_gives_its_tokens():
    """After the warm-up, a resumed chunk beside a new prompt whose buckets no graph has exactly
    replays the smallest larger graph (`PrefillGraphs.cover`): not eager, nothing captured on its
    path, its key waits for the idle captures, and the tokens are eager's (fp32)."""
    from engine.runner.warmup import warm_up

    eng = engine(3, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    pg, shapes = eng.runner.prefill_graphs, eng.runner.shapes
    captured = set(pg.graphs)
    prompts, params = [[7] * 94, [8] * 20], SamplingParams(max_tokens=8, ignore_eos=True)
    got = [r.output_ids for r in eng.generate(prompts, params)]
    held = [s for s in shapes.met if len(s) == 4 and s not in shapes.warm]
    assert held and shapes.cold == 0 and set(pg.graphs) == captured and pg.pending
    assert got == [r.output_ids for r in engine(3, enforce_eager=True).generate(prompts, params)]
