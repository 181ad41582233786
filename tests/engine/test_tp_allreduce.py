"""Which all-reduce a TP group takes (engine/tp/allreduce.py `choose`); the kernels themselves
are checked against NCCL on two GPUs (tests/engine/test_gpu_tp.py)."""

from __future__ import annotations

import pytest
import torch

import settings
from engine.tp.allreduce import choose, make


def test_gpus_take_the_one_shot_all_reduce_for_the_sizes_it_is_built_for():
    cuda = torch.device("cuda", 0)
    assert [choose(cuda, n, "symm") for n in (2, 4, 8)] == ["symm"] * 3
    assert choose(cuda, 16, "symm") == "nccl"  # no one-shot kernel for 16 ranks
    assert choose(cuda, 2, "nccl") == "nccl"  # the switch


def test_the_cpu_takes_gloo_whatever_the_switch_says():
    assert choose(torch.device("cpu"), 2, "symm") == "gloo"
    assert make(None, 2, torch.device("cpu"), torch.float32) is None
    assert make(None, 1, torch.device("cuda", 0), torch.bfloat16) is None  # one rank: nothing to reduce


def test_a_misspelt_switch_is_a_clear_error():
    with pytest.raises(ValueError, match="PDSERVE_TP_ALLREDUCE must be 'symm' or 'nccl', got 'nvls'"):
        choose(torch.device("cuda", 0), 2, "nvls")
    with pytest.raises(ValueError, match="PDSERVE_TP_ALLREDUCE must be 'symm' or 'nccl', got 'nvls'"):
        settings.REGISTRY["PDSERVE_TP_ALLREDUCE"].read({"PDSERVE_TP_ALLREDUCE": "nvls"})
