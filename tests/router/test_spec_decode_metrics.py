"""/metrics reports the decode node's steps by k (`pdserve:spec_decode_num_steps`), from its Status:
with adaptive k (engine/spec_decode/adaptive_k.py) the share of plain steps is visible."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from protos import node_pb2
from router.metrics import NodeCollector
from router.pool import Node


def test_steps_by_k_are_counters_per_node():
    status = node_pb2.NodeStatus(kind="decode", num_speculative_tokens=3, spec_decode_steps=[40, 0, 0, 9],
                                 draft_tokens=[9, 9, 9], accepted_per_pos=[5, 3, 1])
    node = Node("decode", "d:1", channel=None, stub=None, healthy=True, status=status)  # type: ignore[arg-type]
    registry = CollectorRegistry()
    registry.register(NodeCollector(lambda: [node]))
    text = generate_latest(registry).decode()
    assert 'pdserve:spec_decode_num_steps_total{k="0",kind="decode",node="d:1"} 40.0' in text
    assert 'pdserve:spec_decode_num_steps_total{k="3",kind="decode",node="d:1"} 9.0' in text
    assert 'pdserve:spec_decode_num_draft_tokens_total{kind="decode",node="d:1",position="0"} 9.0' in text
