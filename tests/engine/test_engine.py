"""LLMEngine behaviour: greedy MTP exactness, joins at any step, logprobs, seeds, stops, blocks."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.runner import model_runner
from engine.runner.model_runner import ModelRunner
from engine.sampling.sampling_params import SamplingParams
from tests.engine.conftest import DEVICE

GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def prompts_of(lengths, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_schedule(engine, joins, params):
    """joins: list of (step index at which to add, prompt). Returns outputs in join order."""
    ids, step = [None] * len(joins), 0
    while step == 0 or engine.has_unfinished() or any(i is None for i in ids):
        for i, (at, prompt) in enumerate(joins):
            if at == step:
                ids[i] = engine.add_request(prompt, params)
        engine.step()
        step += 1
    return [engine.requests[i] for i in ids]


def engine_for(loaded, k, **kw):
    return LLMEngine(loaded, EngineConfig(num_speculative_tokens=k, block_shuffle_seed=7, device=DEVICE, **kw))


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_mtp_matches_plain_with_staggered_joins(tiny, k):
    prompts = prompts_of([3, 29, 11, 64, 1, 17], tiny.model.config.vocab_size)
    joins = list(zip([0, 0, 2, 3, 7, 12], prompts, strict=True))
    plain = run_schedule(engine_for(tiny, 0, max_num_batched_tokens=20), joins, GREEDY)
    eng = engine_for(tiny, k, max_num_batched_tokens=20)
    spec = run_schedule(eng, joins, GREEDY)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    assert all(len(r.output_ids) == GREEDY.max_tokens for r in spec)
    assert eng.num_free_blocks == eng.blocks.capacity


class OracleDrafts:
    """Test backend for drafts: proposes the reference continuation, so every draft is right."""

    def __init__(self, sequences: dict[int, list[int]]) -> None:
        width = max(len(s) for s in sequences.values()) + 16
        self.seeds = torch.tensor(list(sequences), device=DEVICE)
        self.table = torch.zeros(len(sequences), width, dtype=torch.long, device=DEVICE)
        for i, s in enumerate(sequences.values()):
            self.table[i, : len(s)] = torch.tensor(s)

    def __call__(self, runner, h, base, st, tables, masked, num_kv_blocks):
        row = (st.seed.unsqueeze(1) == self.seeds.unsqueeze(0)).float().argmax(1)
        cols = (base.unsqueeze(1) + torch.arange(1, runner.k + 1, device=DEVICE)).clamp(max=self.table.shape[1] - 1)
        return self.table[row.unsqueeze(1), cols], None


@pytest.mark.parametrize("k", [1, 2, 4])
def test_greedy_with_oracle_drafts_accepts_all_and_matches(tiny, k, monkeypatch):
    prompts = prompts_of([5, 23, 9], tiny.model.config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=21, ignore_eos=True, seed=100 + i) for i in range(3)]
    plain = engine_for(tiny, 0).generate(prompts, params)
    oracle = OracleDrafts({100 + i: p + r.output_ids for i, (p, r) in enumerate(zip(prompts, plain, strict=True))})
    monkeypatch.setattr(ModelRunner, "draft_chain", lambda self, *a: oracle(self, *a))
    spec = engine_for(tiny, k).generate(prompts, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]
    for r in spec:  # every step accepts all k drafts plus the bonus, except where max_tokens cuts
        assert r.steps == -(-(len(r.output_ids) - 1) // (k + 1))


def reference_logprobs(loaded, prompt, output):
    """log_softmax of the model's logits over prompt+output in one fresh prefill."""
    eng = engine_for(loaded, 0)
    seq = prompt + output
    runner = eng.runner
    blocks = eng.blocks.allocate(eng.blocks.blocks_for(len(seq)))
    from engine.model.attention import AttentionMetadata

    def t(x):
        return torch.tensor(x, device=DEVICE)

    n = len(seq)
    slots = [blocks[p // 16] * 16 + p % 16 for p in range(n)]
    meta = AttentionMetadata(t(slots), t(list(range(n))), t([blocks]), t([0] * n), t(list(range(n))), n, len(blocks))
    with torch.no_grad():
        hidden = loaded.model(t(seq), meta.positions, runner.kv.layers, meta, runner.backend)
        logits = loaded.model.compute_logits(hidden)
    return torch.log_softmax(logits, -1)[len(prompt) - 1 : n - 1]


@pytest.mark.parametrize("k", [0, 2])
def test_logprobs_equal_log_softmax_of_reference(tiny, k):
    prompts = prompts_of([7, 19], tiny.model.config.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=5),
              SamplingParams(max_tokens=12, ignore_eos=True, logprobs=0, temperature=0.9, seed=5)]
    out = engine_for(tiny, k).generate(prompts, params)
    for prompt, req in zip(prompts, out, strict=True):
        ref = reference_logprobs(tiny, prompt, req.output_ids)
        assert len(req.logprobs) == len(req.output_ids)
        for pos, (tok, lp) in enumerate(zip(req.output_ids, req.logprobs, strict=True)):
            row = ref[pos]
            assert lp.token_id == tok
            assert lp.logprob == pytest.approx(row[tok].item(), abs=1e-4)
            assert lp.rank == int((row > row[tok]).sum().item()) + 1
            n = req.params.logprobs
            top = torch.topk(row, n) if n else None
            assert len(lp.top) == n
            if top is not None:
                assert [i for i, _ in lp.top] == top.indices.tolist()
                assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_no_logprob_work_without_logprobs(tiny, monkeypatch):
    calls = []
    real = model_runner.compute_logprobs
    monkeypatch.setattr(model_runner, "compute_logprobs", lambda *a: calls.append(1) or real(*a))
    engine_for(tiny, 2).generate(prompts_of([5, 9], tiny.model.config.vocab_size), GREEDY)
    assert calls == []
    engine_for(tiny, 2).generate(prompts_of([5], tiny.model.config.vocab_size), SamplingParams(max_tokens=4, logprobs=1))
    assert calls


@pytest.mark.parametrize("k", [0, 3])
def test_seeded_sampling_is_independent_of_batch(tiny, k):
    vocab = tiny.model.config.vocab_size
    target = prompts_of([13], vocab, seed=8)[0]
    params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=20, seed=42, ignore_eos=True)
    alone = engine_for(tiny, k).generate([target], params)[0].output_ids
    others = prompts_of([4, 30, 8], vocab, seed=9)
    mixed = engine_for(tiny, k).generate(
        others[:2] + [target] + others[2:],
        [SamplingParams(temperature=1.0, seed=1, max_tokens=25), GREEDY, params, SamplingParams(max_tokens=3)],
    )
    assert mixed[2].output_ids == alone
    other_seed = engine_for(tiny, k).generate([target], SamplingParams(**{**params.__dict__, "seed": 43}))
    assert other_seed[0].output_ids != alone


def test_stop_token_ends_request_and_frees_blocks(tiny):
    prompt = prompts_of([10], tiny.model.config.vocab_size, seed=11)[0]
    eng = engine_for(tiny, 2)
    full = eng.generate([prompt], GREEDY)[0].output_ids
    stop = full[5]
    cut = full.index(stop)
    out = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True, stop_token_ids=(stop,)))[0]
    assert out.output_ids == full[: cut + 1]
    assert out.finish_reason == "stop"
    assert eng.num_free_blocks == eng.blocks.capacity


def test_abort_mid_generation_frees_everything(tiny):
    eng = engine_for(tiny, 2, max_num_seqs=4)
    ids = [eng.add_request(p, GREEDY) for p in prompts_of([5, 8, 13, 3, 9, 4], tiny.model.config.vocab_size)]
    for _ in range(3):
        eng.step()
    for rid in ids[::2]:
        eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    reasons = [eng.requests[i].finish_reason for i in ids]
    assert reasons[::2] == ["abort"] * 3 and reasons[1::2] == ["length"] * 3
    assert eng.num_free_blocks == eng.blocks.capacity


def test_max_num_seqs_queues_requests(tiny):
    eng = engine_for(tiny, 1, max_num_seqs=2)
    prompts = prompts_of([4, 6, 8, 10, 12], tiny.model.config.vocab_size)
    out = eng.generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    ref = engine_for(tiny, 0).generate(prompts, SamplingParams(max_tokens=6, ignore_eos=True))
    assert [r.output_ids for r in out] == [r.output_ids for r in ref]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda e: e.add_request([], GREEDY), "prompt is empty"),
        (lambda e: e.add_request([1] * 5000, GREEDY), "context"),
        (lambda e: e.add_request([10**6], GREEDY), "vocabulary"),
        (lambda e: SamplingParams(logprobs=21), "logprobs"),
        (lambda e: SamplingParams(temperature=-0.5), "temperature"),
        (lambda e: EngineConfig(num_speculative_tokens=-1), "k"),
    ],
)
def test_bad_input_is_a_clear_error(tiny, make, message):
    eng = engine_for(tiny, 0)
    with pytest.raises(ValueError, match=message):
        make(eng)


@pytest.mark.smollm2
@pytest.mark.parametrize("k", [1, 2, 4])
def test_smollm2_greedy_mtp_matches_plain(smollm2, k):
    tok = smollm2.tokenizer
    texts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
    prompts = [tok.encode(t) for t in texts]
    joins = list(zip([0, 1, 3], prompts, strict=True))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = run_schedule(engine_for(smollm2, 0, max_model_len=256), joins, params)
    spec = run_schedule(engine_for(smollm2, k, max_model_len=256), joins, params)
    assert [r.output_ids for r in spec] == [r.output_ids for r in plain]


def test_a_max_model_len_past_the_models_positions_is_refused(tiny):
    """Past its positions a model has no rotary rows: a request that long would fail in its
    prefill (holding its KV blocks until then), so the engine refuses to be built."""
    limit = tiny.model.config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_model_len {2 * limit} is longer than the model's {limit} positions"):
        LLMEngine(tiny, EngineConfig(max_model_len=2 * limit))
    assert LLMEngine(tiny, EngineConfig(max_model_len=limit)).max_model_len == limit
