"""Node selection policies: which decode node to reserve on, which prefill node to run on.

A policy receives the healthy candidates (`NodeLoad` views: the node's last `Status` plus
the router's own live counts) and hands back all of them in the order to try: the router
reserves on the first decode node that admits, and prefills on the first prefill node. A
policy never does I/O and never mutates a node; it may keep its own cursor (round robin).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class NodeLoad:
    """What a policy may look at. Status fields are 0 until the node's first Status poll."""

    address: str
    free_blocks: int = 0  # decode: from the last Status
    running: int = 0  # from the last Status
    queued_tokens: int = 0  # prefill: from the last Status
    inflight: int = 0  # this router's requests on the node now (reserved on D / prefilling on P)
    inflight_tokens: int = 0  # prefill: prompt tokens of this router's outstanding prefills


class Policy(ABC):
    name: str

    @abstractmethod
    def order_decode(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        """All of `nodes`, best first (the router tries Reserve in this order)."""

    @abstractmethod
    def order_prefill(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        """All of `nodes`, best first."""


class RoundRobin(Policy):
    """Each call starts one node further along (nodes sorted by address), per kind."""

    name = "round_robin"

    def __init__(self) -> None:
        self._cursor = {"decode": itertools.count(), "prefill": itertools.count()}

    def _rotate(self, kind: str, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        ordered = sorted(nodes, key=lambda n: n.address)
        if not ordered:
            return []
        start = next(self._cursor[kind]) % len(ordered)
        return ordered[start:] + ordered[:start]

    def order_decode(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        return self._rotate("decode", nodes)

    def order_prefill(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        return self._rotate("prefill", nodes)


class LeastLoad(Policy):
    """Decode: most free KV blocks, then fewest running (Status's + this router's in flight).
    Prefill: fewest queued prompt tokens (Status's + this router's outstanding), then fewest
    in flight. Ties break by address, so choices are deterministic."""

    name = "least_load"

    def order_decode(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        return sorted(nodes, key=lambda n: (-n.free_blocks, n.running + n.inflight, n.address))

    def order_prefill(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        return sorted(nodes, key=lambda n: (n.queued_tokens + n.inflight_tokens, n.running + n.inflight, n.address))


POLICIES: dict[str, type[Policy]] = {RoundRobin.name: RoundRobin, LeastLoad.name: LeastLoad}


def make_policy(name: str) -> Policy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
