"""The start-up warm-up (engine/runner/warmup.py) and deferred captures: dummy prompts touch no
request's state, and a dummy step can be made for any key a real step has.

On the CPU there are no graphs to capture, so this runs the warm-up's dummy steps through the
eager prefill (the same `prefill_forward` a graph captures): every KV block but the trash block
keeps its contents, the block manager hands out nothing, and the steps' keys are the variants the
warm-up means to cover. tests/engine/test_gpu_prefill.py checks the captured graphs on a GPU."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.request import PrefillChunk
from engine.runner.dummy_prompts import chunks_for_key, dummy_chunks
from engine.runner.prefill_graphs import EAGER_RUNS_BEFORE_CAPTURE, PrefillGraphs, pow2_buckets
from engine.runner.prefill_step import PrefillKey, key_for
from engine.runner.shapes import ShapeLog, backlog_order, decode_shapes, prefill_shapes
from engine.runner.warmup import (
    BACKLOG_QUIET_S,
    GREEDY,
    SAMPLED,
    VARIANTS,
    IdleCaptures,
    capture_deferred,
    rows_for,
    shape_status,
    warm_steps,
    warm_up,
)
from engine.sampling.sampling_params import SamplingParams
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
    graphs = PrefillGraphs(eng.runner, 512, 8)  # only its buckets: no graph is made on the CPU
    stale = graphs.key([PrefillChunk(list(range(1, 60)), 20, 59, [], SamplingParams(temperature=0.7, top_p=0.9), 1)])
    assert not stale.fresh
    out = eng.runner.prefill(chunks_for_key(stale, graphs.token_buckets, graphs.row_buckets, eng.max_model_len))
    assert out.first_token.shape == (1,)
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


def test_a_dummy_step_exists_for_every_real_key(tiny):
    import random

    eng = LLMEngine(tiny, EngineConfig(device=DEVICE, enforce_eager=True))
    graphs = PrefillGraphs(eng.runner, 2048, 32)
    rng = random.Random(0)
    variants = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=5),
                SamplingParams(logprobs=3), SamplingParams(temperature=1.0, top_p=0.5, logprobs=0)]
    for _ in range(300):
        chunks = []
        for _ in range(rng.randint(1, 20)):
            start = rng.choice([0, 0, rng.randint(1, 300)])
            n = rng.randint(1, 100)
            chunks.append(PrefillChunk([5] * (start + n), start, start + n, [], rng.choice(variants), 0))
        key = graphs.key(chunks)
        dummy = chunks_for_key(key, graphs.token_buckets, graphs.row_buckets, 4096)
        assert dummy is not None and graphs.key(dummy) == key, key
        assert all(c.block_ids == [] and c.is_last for c in dummy)


def test_nothing_deferred_without_graphs(tiny):
    eng = LLMEngine(tiny, EngineConfig(device=DEVICE, enforce_eager=True))
    assert capture_deferred(eng.runner, eng.max_model_len) is False


def test_rows_fit_the_context():
    rows = pow2_buckets(1, 32)
    assert rows_for(2048, rows, 4096) == 1
    assert rows_for(8192, rows, 2048) == 4  # one row of 8192 tokens would pass the context
    assert rows_for(16, rows, 4) == 4
    assert rows_for(16, [1, 2], 4) is None


@pytest.mark.parametrize("max_tokens", [512, 2048])  # a colocated node's step budget, a prefill node's
def test_every_warm_up_step_has_a_graph_key_of_its_own(tiny, max_tokens):
    """No two warm-up steps share a graph key (the second would only replay the first one's graph),
    and the largest token bucket still runs at every row bucket, greedy with logprobs."""
    eng = LLMEngine(tiny, EngineConfig(device=DEVICE, enforce_eager=True))
    graphs = PrefillGraphs(eng.runner, max_tokens, 32)
    steps = warm_steps(graphs.token_buckets, graphs.row_buckets, 4096, resumes=True)
    keys = [graphs.key(chunks) for chunks in steps]
    assert len(keys) == len(set(keys))
    top = graphs.token_buckets[-1]
    assert {k.rows for k in keys if k.tokens == top and k.all_greedy and k.top_logprobs is not None} == set(
        graphs.row_buckets)


def test_nothing_to_warm_without_graphs(tiny):
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, enforce_eager=True))
    report = warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    assert (report.decode_graphs, report.prefill_graphs) == (0, 0)


def test_a_deferred_eager_step_runs_in_the_runners_kernel_mode(tiny, prefill_modes):
    """`PrefillGraphs.run` may be called from outside the runner's `prefill` (the warm-up): its
    eager step (and its captures, tests/engine/test_gpu_prefill.py) still run batch-invariant
    kernels under `--deterministic`."""
    from kernels._dispatch import invariant

    for deterministic in (True, False):
        eng = LLMEngine(tiny, EngineConfig(device=DEVICE, enforce_eager=True, deterministic=deterministic))
        graphs = PrefillGraphs(eng.runner, 512, 8)
        graphs.defer = True
        assert not invariant()
        out = graphs.run(dummy_chunks(64, 2, GREEDY, None))
        assert out.first_token.shape == (2,) and graphs.pending
    assert prefill_modes == [True, False]


# ---- the shapes a node's steps can meet, and the warm-up covering them ----------------------------
def test_prefill_shapes_are_what_steps_under_the_limits_fill():
    """Every step of whole or chunked prompts (shorter than the context) within the largest buckets has
    an enumerated shape, every enumerated shape has a step, and nothing else is listed."""
    import random

    tokens, rows, context = pow2_buckets(16, 64), pow2_buckets(1, 4), 40
    log = ShapeLog(tokens, rows, {1: [4]}, context, resumes=True)
    listed = set(log.prefill_shapes())
    assert len(listed) == len(log.prefill_shapes())
    fresh_only = set(prefill_shapes(tokens, rows, context, resumes=False))
    assert fresh_only == {s for s in listed if s[3]} and fresh_only != listed
    assert (16, 4, 16, True) in listed and (64, 1, 64, True) in listed  # four short prompts; one of 33-39 tokens
    assert (64, 1, 32, True) not in listed and (64, 2, 16, True) not in listed  # 33+ tokens need longer chunks
    rng, met = random.Random(0), set()
    for _ in range(2000):
        chunks = []
        for _ in range(rng.randint(1, 4)):
            start = rng.choice([0, 0, rng.randint(1, 3), rng.randint(1, context - 2)])
            end = rng.randint(start + 1, context - 1)
            chunks.append(PrefillChunk([5] * end, start, end, [], GREEDY, 0))
        shape = log.prefill_shape(chunks)
        if sum(c.end - c.start for c in chunks) > 64:
            assert shape is None  # past the largest bucket: eager at its size
            continue
        assert shape in listed, chunks
        met.add(shape)
    assert len(met) > len(listed) // 2
    for shape in listed:  # and a step under the limits fills each listed one
        chunks = chunks_for_key(PrefillKey(*shape[:3], True, False, None, shape[3]), tokens, rows, context - 1)
        assert all(c.end < context for c in chunks) and len(chunks) <= 4 and sum(c.end - c.start for c in chunks) <= 64
        assert log.prefill_shape(chunks) == shape


def test_decode_shapes_are_every_bucket_at_its_widths():
    assert decode_shapes({1: [16, 64], 2: [16, 64], 4: [64]}) == [(1, 16), (1, 64), (2, 16), (2, 64), (4, 64)]
    log = ShapeLog([16], [1], {1: [16, 64], 2: [16, 64], 4: [64]}, 1024, resumes=False)
    assert log.decode_shape(3, 10) == (4, 64) and log.decode_shape(2, 10) == (2, 16) and log.decode_shape(1, 17) == (1, 64)


LIMITS = dict(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)  # 255-token prompts pass the budget
LENGTHS = [5, 17, 40, 100, 3, 9, 150, 2]


def varied(eng: LLMEngine) -> None:
    """Requests of varied lengths (some chunked past the token budget), batch sizes and sampling."""
    prompts = [[7 + i] * n for i, n in enumerate(LENGTHS)]
    params = [SamplingParams(max_tokens=2 + 3 * i, ignore_eos=True, temperature=0.0 if i % 2 else 0.8)
              for i in range(len(prompts))]
    eng.generate(prompts, params)
    eng.generate(prompts[3:4], params[3:4])


def test_before_ready_the_warm_up_covers_its_steps_and_lists_the_other_shapes(tiny):
    """The warm-up marks warm exactly the shapes of its own steps and every decode shape; every other
    listed shape waits in the backlog (likeliest first), and the node's status counts them."""
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, **LIMITS))
    shapes = eng.runner.shapes
    assert shapes is not None and shapes.resumes and not shapes.warm and not shapes.backlog
    report = warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    steps = {shapes.prefill_shape(c)
             for c in warm_steps(shapes.token_buckets, shapes.row_buckets, eng.max_model_len, shapes.resumes)}
    assert shapes.warm == steps | set(shapes.decode_shapes())
    assert {(t, 2, t, fresh) for t in shapes.token_buckets[1:] for fresh in (True, False)} <= steps  # two rows, any chunk
    listed = set(shapes.prefill_shapes())
    assert steps < listed and set(shapes.backlog) == listed - steps  # fewer graphs before ready
    assert shapes.backlog == sorted(shapes.backlog, key=backlog_order)
    assert shapes.backlog[0][3] and not shapes.backlog[-1][3]  # fresh prompts first, resumed ones last
    assert shape_status(eng.runner) == {"cold_shape_steps": 0, "graph_shapes_pending": len(listed - steps)}
    assert report.pending == len(listed - steps) and set(report.phases) == {"decode", "prefill"}


def test_after_ready_cold_shapes_are_counted_moved_ahead_and_captured_when_idle(tiny):
    """Varied requests right after the warm-up meet shapes with no graph: each such step that ran
    eagerly is counted (`cold`), and its shape goes to the head of the backlog. The idle captures take one shape a call,
    those first; once they are done the same requests meet no cold shape."""
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, **LIMITS))
    shapes = eng.runner.shapes
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    pending = len(shapes.backlog)
    varied(eng)
    cold = [s for s in shapes.met if s not in shapes.warm]
    eager = sum(shapes.met[s] for s in cold)  # on a GPU a larger shape's graph holds some (not counted)
    assert cold and (shapes.cold == eager if eng.runner.prefill_graphs is None else shapes.cold <= eager)
    assert any(not s[3] for s in cold), "chunked prompts resumed"
    assert set(shapes.backlog[: len(cold)]) == set(cold) and len(shapes.backlog) == pending
    assert shape_status(eng.runner) == {"cold_shape_steps": shapes.cold, "graph_shapes_pending": pending}
    order: list = []
    while True:  # the node idles
        before = set(shapes.warm)
        if not capture_deferred(eng.runner, eng.max_model_len):
            break
        order.append(shapes.warm - before)
    assert all(len(new) == 1 for new in order) and len(order) == pending, "one shape a call"
    assert set().union(*order[: len(cold)]) == set(cold), "the shapes requests met first"
    assert shape_status(eng.runner)["graph_shapes_pending"] == 0
    shapes.cold, shapes.met = 0, type(shapes.met)()
    varied(eng)
    assert shapes.cold == 0, [s for s in shapes.met if s not in shapes.warm]
    assert len({s[0] for s in shapes.met if len(s) == 2}) >= 3  # decode batches shrank through the buckets


def test_a_request_never_captures_a_shape_with_no_graph(tiny, monkeypatch):
    """A node's prefill graphs past the warm-up (`defer`) run a step of a new shape eagerly however
    often it comes, and never capture on its path: only the idle captures do, one key a call, the
    keys requests met first. A sampling variant of a captured shape is captured on its path once it
    came back EAGER_RUNS_BEFORE_CAPTURE times (a busy node never idles): the test can fail. (The
    steps fill their buckets exactly: the CPU's attention takes no padding rows.)"""
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, **LIMITS))
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    pg = eng.runner.prefill_graphs = PrefillGraphs(eng.runner, 64, 8)  # its buckets: the CPU captures nothing
    pg.defer = True
    captured: list[PrefillKey] = []

    def on_path(key, inp):
        captured.append(key)
        raise AssertionError(f"{key} captured on a request's path")

    monkeypatch.setattr(pg, "_capture", on_path)
    prompt, params = [[9] * 64], SamplingParams(max_tokens=2, ignore_eos=True)
    for _ in range(EAGER_RUNS_BEFORE_CAPTURE + 2):
        eng.generate(prompt, params)
    eng.generate([[5] * 128, [6] * 16], [params, SamplingParams(max_tokens=3, temperature=0.8)])  # resumed
    eng.generate([[7] * 32] * 2 + [[8] * 16] * 4, params)  # two rows, then four
    assert not captured and {k.rows for k in pg.pending} == {1, 2, 4} and any(not k.fresh for k in pg.pending)
    met = list(pg.pending)
    monkeypatch.setattr(pg, "_capture", lambda key, inp: captured.append(key))  # the node idles
    for i in range(len(met)):
        assert capture_deferred(eng.runner, eng.max_model_len) and len(captured) == i + 1
    assert captured == met and not pg.pending
    shapes = eng.runner.shapes
    head = next(s for s in shapes.backlog if s not in shapes.warm)
    assert capture_deferred(eng.runner, eng.max_model_len) and len(captured) == len(met) + 1  # then the backlog
    assert captured[-1].shape == head and captured[-1].all_greedy and head in shapes.warm

    class Captured(Exception):
        pass

    def captures(key, inp):
        raise Captured(key)

    monkeypatch.setattr(pg, "_capture", captures)
    pg.shapes.add(met[0].shape)  # the 40-token prompt's shape now has a graph (another variant's)
    with pytest.raises(Captured):
        eng.generate(prompt, params)  # its key came back often enough: captured on its path


def test_idle_captures_wait_for_a_quiet_spell(tiny):
    """A node's loop captures nothing until it has had no work for `quiet_s`: a request arriving
    between two others under a light load never waits for a capture. After that lull it captures
    only the shapes that requests' steps met, one a call; the rest of the backlog waits for a
    longer one (`backlog_quiet_s`)."""
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, **LIMITS))
    shapes = eng.runner.shapes
    warm_up(eng.runner, decode=True, prefill=True, max_model_len=eng.max_model_len)
    pending = len(shapes.backlog)
    varied(eng)
    met = {s for s in shapes.met if s not in shapes.warm}
    assert met and len(shapes.backlog) == pending
    waiting = IdleCaptures(eng.runner, eng.max_model_len, quiet_s=3600, backlog_quiet_s=3600)
    assert waiting.busy() and not waiting.idle() and len(shapes.backlog) == pending
    lull = IdleCaptures(eng.runner, eng.max_model_len, quiet_s=0, backlog_quiet_s=3600)
    while lull.idle():
        pass
    assert met <= shapes.warm and lull.count >= len(met) and len(shapes.backlog) == pending - len(met)
    idle = IdleCaptures(eng.runner, eng.max_model_len, quiet_s=0, backlog_quiet_s=0)
    assert idle.idle() and len(shapes.backlog) == pending - len(met) - 1


def test_an_idle_node_captures_its_backlog_and_its_status_says_so(tiny):
    """A colocated node (warm-up on) reports the shapes left, and its loop's idle rounds capture them
    (on the CPU: mark them) until none is left; its status fits the node's Status message."""
    from decode_node.colocated import ColocatedNode
    from protos import node_pb2

    node = ColocatedNode(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, warmup=True, **LIMITS))
    status = node.status()
    assert status["graph_shapes_pending"] > 0 and status["cold_shape_steps"] == 0
    assert node_pb2.NodeStatus(**status).graph_shapes_pending == status["graph_shapes_pending"]
    node.captures.backlog_quiet_s = 0.5  # a second and ten are a server's lulls (engine/runner/warmup.py)
    node.start()
    try:
        deadline = time.monotonic() + 60
        while node.status()["graph_shapes_pending"] and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        node.stop()
    assert node.status()["graph_shapes_pending"] == 0


def test_a_step_with_no_graph_of_its_own_takes_the_smallest_captured_graph_that_holds_it(tiny):
    """PrefillGraphs.cover: larger buckets (tokens, rows, longest chunk), the same sampling flags,
    freshness and grammar, logprobs where the step asks; never with batch-invariant kernels."""
    eng = LLMEngine(tiny, EngineConfig(num_speculative_tokens=2, device=DEVICE, **LIMITS))
    pg = PrefillGraphs(eng.runner, 64, 8)

    def key(tokens, rows, max_q, greedy=True, lp=None, fresh=True, filt=False, constrained=False):
        return PrefillKey(tokens, rows, max_q, greedy, filt, lp, fresh, constrained)

    captured = [key(64, 2, 64, lp=20), key(32, 2, 32, lp=20), key(64, 8, 8, lp=20), key(32, 2, 32, fresh=False, lp=20),
                key(64, 2, 64, greedy=False, lp=20), key(32, 4, 32)]
    pg.graphs = dict.fromkeys(captured)  # type: ignore[arg-type]  # keys only: cover reads no graph
    assert pg.cover(key(32, 1, 16)) == key(32, 2, 32, lp=20)  # the smallest, logprobs computed and not read
    assert pg.cover(key(32, 3, 32)) == key(32, 4, 32)
    assert pg.cover(key(64, 1, 64, lp=20)) == key(64, 2, 64, lp=20)
    assert pg.cover(key(16, 1, 16, fresh=False)) == key(32, 2, 32, fresh=False, lp=20)
    assert pg.cover(key(16, 1, 16, greedy=False, lp=20)) == key(64, 2, 64, greedy=False, lp=20)
    for alone in (key(32, 3, 32, lp=20), key(64, 1, 64, fresh=False), key(16, 1, 16, filt=True, greedy=False),
                  key(16, 1, 16, constrained=True), key(64, 16, 64)):
        assert pg.cover(alone) is None, alone
    eng.runner.deterministic = True
    assert pg.cover(key(32, 1, 16)) is None


@pytest.mark.parametrize("kind", ["prefill", "colocated"])
def test_a_nodes_quiet_clock_starts_after_its_warm_up(tiny, monkeypatch, kind):
    """The backlog is captured after BACKLOG_QUIET_S with no work: counted from the end of the
    warm-up, not from before it, so a node whose warm-up took longer than that does not start
    capturing its backlog at `ready`, under its first requests."""
    from decode_node import node as decode_module
    from decode_node.colocated import ColocatedNode
    from engine.runner import warmup
    from prefill_node import node as prefill_module
    from prefill_node.node import PrefillNode

    module = prefill_module if kind == "prefill" else decode_module
    real = module.warm_up
    ended: list[float] = []

    def slow_warm_up(*args, **kwargs):
        report = real(*args, **kwargs)
        ended.append(time.monotonic() + BACKLOG_QUIET_S)  # as if the warm-up took longer than the quiet spell
        monkeypatch.setattr(warmup, "time", SimpleNamespace(monotonic=lambda: ended[0], perf_counter=time.perf_counter))
        return report

    monkeypatch.setattr(module, "warm_up", slow_warm_up)
    cfg = EngineConfig(num_speculative_tokens=2, device=DEVICE, warmup=True, **LIMITS)
    node = PrefillNode(tiny, cfg, lambda *a: None, kv_backend="tcp") if kind == "prefill" else ColocatedNode(tiny, cfg)
    try:
        assert ended and node.captures.since == ended[0]
        assert not node.captures.idle()  # no quiet spell yet: nothing is captured at `ready`
    finally:
        if kind == "prefill":
            node.sender.close()
