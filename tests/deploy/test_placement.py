"""Placement on N GPUs: by default every node takes one GPU per TP rank, so `--prefill P --decode D`
takes P + D GPUs (x TP), `--colocated N` takes N; on a CPU service no node asks for a GPU."""

from __future__ import annotations

import pytest

from deploy.config import ServiceConfig
from deploy.service import Service, gpus_needed
from deploy.tp_group import TPNodeGroup


def cfg(**over) -> ServiceConfig:
    return ServiceConfig.load(None, {"model.name": "tiny", "model.device": "cuda", **over})


@pytest.mark.parametrize(("over", "want"), [
    ({}, 2.0),  # 1P1D
    ({"prefill.num_nodes": 1, "decode.num_nodes": 3}, 4.0),
    ({"prefill.num_nodes": 2, "decode.num_nodes": 2}, 4.0),
    ({"colocated.num_nodes": 2}, 2.0),
    ({"prefill.tp": 2, "decode.tp": 2}, 4.0),  # TP inside a node: a GPU per rank
    ({"decode.num_nodes": 2, "prefill.num_gpus": 0.5, "decode.num_gpus": 0.5}, 1.5),  # shared GPUs, asked for
])
def test_gpus_needed(over, want):
    assert gpus_needed(cfg(**over)) == want


@pytest.mark.parametrize("over", [{"prefill.num_nodes": 1, "decode.num_nodes": 3}, {"colocated.num_nodes": 2}])
def test_every_node_takes_one_gpu_by_default(over):
    c = cfg(**over)
    service = Service(c)
    for role in c.node_counts:
        opts = service._node_options(role, 0)
        assert opts["num_gpus"] == 1 and opts["name"] == f"pdserve-{role}-0"
    cpu = Service(cfg(**over, **{"model.device": "cpu"}))
    assert all(cpu._node_options(role, 0)["num_gpus"] == 0 for role in c.node_counts)


def test_a_tp_node_takes_one_gpu_per_rank():
    c = cfg(**{"prefill.tp": 2, "decode.tp": 2})
    group = TPNodeGroup("decode", 0, c.model_dump_json(), 2, Service(c)._node_options("decode", 0))
    assert group.bundle() == {"CPU": 1.0, "GPU": 1.0}  # one bundle per rank, STRICT_PACK on one host
