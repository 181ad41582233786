"""Tensor parallelism on GPUs (skipped without two CUDA devices): NCCL groups of 2 local
processes, rank r on cuda:r, the decode step in CUDA graphs.

Greedy TP=2 equals TP=1 (one GPU) token for token on `tiny` in fp32, k = 0 and k = 3, with
logprobs within fp32 tolerance, through the symmetric-memory all-reduce and through NCCL's;
a seeded sampled request gives the same tokens; every rank samples rank 0's tokens. The
one-shot all-reduce equals NCCL's sum bit for bit, eagerly and replayed in a CUDA graph. No
rank's decode launch syncs with the host (I3), on the graph path and the eager one."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.tp.allreduce import MAX_BYTES, SymmAllReduce
from engine.tp.launch import rank_device, spawn_ranks
from engine.tp.tensor_parallel import TPGroup
from tests.engine.test_gpu import _run
from tests.engine.test_tensor_parallel import TINY_CASES, assert_same, rank_cases, run_cases

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@pytest.mark.parametrize("path", ["symm", "nccl"])
def test_tiny_tp2_on_gpus_equals_one_gpu(path, monkeypatch):
    monkeypatch.setenv("PDSERVE_TP_ALLREDUCE", path)  # the ranks (spawned) inherit it
    lengths = [5, 23, 9]
    _, tp1 = run_cases("tiny", lengths, TINY_CASES, None, device="cuda")
    (heads0, out0), (_, out1) = spawn_ranks(2, rank_cases, ("tiny", lengths, TINY_CASES, False, "cuda"), device="cuda")
    assert heads0 == 1
    assert out1 == out0  # every rank sampled the same tokens, with the same logprobs
    assert_same(out0, tp1, tol=1e-3)
    assert all(len(ids) == 12 for case in tp1 for ids, _ in case)


def _sums(tp: TPGroup, dtype: torch.dtype) -> list[tuple[int, bool, bool]]:
    """(rows, eager one-shot == NCCL, graph-replayed one-shot == NCCL) for several shapes."""
    device = torch.device(rank_device("cuda", tp.rank))
    fast = SymmAllReduce(None, device, dtype)
    g = torch.Generator(device).manual_seed(tp.rank)
    out = []
    for rows in (1, 3, 64, MAX_BYTES // (2048 * dtype.itemsize)):
        x = torch.randn(rows, 2048, generator=g, device=device).to(dtype)
        want = x.clone()
        dist.all_reduce(want)
        eager = fast(x.clone())
        static = x.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fast(static)
        static.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        out.append((rows, torch.equal(eager, want), torch.equal(static, want)))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_shot_all_reduce_equals_nccl(dtype):
    for rank_result in spawn_ranks(2, _sums, (dtype,), device="cuda"):
        assert all(eager and graph for _, eager, graph in rank_result), rank_result


def _launches(tp: TPGroup, k: int, eager: bool) -> int:
    device = rank_device("cuda", tp.rank)
    eng = LLMEngine(load_model("tiny", device=device, dtype="bfloat16"),
                    EngineConfig(num_speculative_tokens=k, device=device, enforce_eager=eager), tp=tp)
    assert (eng.runner.graphs is None) == eager
    _run(eng, checked=False)  # captures the graphs this mix of requests needs
    return _run(eng, checked=True)


@pytest.mark.parametrize("eager", [False, True])
@pytest.mark.parametrize("k", [0, 3])
def test_tp_decode_launch_never_syncs(k, eager):
    assert all(n > 5 for n in spawn_ranks(2, _launches, (k, eager), device="cuda"))
