"""Node selection policies: which decode node to reserve on, which prefill node to run on.

A policy receives the healthy candidates (`NodeLoad` views: the node's last `Status` plus
the router's own live counts) and hands back all of them in the order to try: the router
reserves on the first decode node that admits, and prefills on the first prefill node. A
policy never does I/O and never mutates a node; it may keep its own state (round robin's
cursor, the prefix policy's view of what each prefill node has seen, fed by `routed`).
"""

from __future__ import annotations

import hashlib
import itertools
from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from router.config import RouterConfig


@dataclass(frozen=True)
class NodeLoad:
    """What a policy may look at. Status fields are 0 until the node's first Status poll."""

    address: str
    free_blocks: int = 0  # decode: from the last Status
    running: int = 0  # from the last Status
    queued_tokens: int = 0  # prefill: from the last Status
    inflight: int = 0  # this router's requests on the node now (reserved on D / prefilling on P)
    inflight_tokens: int = 0  # prefill: prompt tokens this router's outstanding prefills compute (Policy.routed)


class Policy(ABC):
    name: str

    @abstractmethod
    def order_decode(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        """All of `nodes`, best first (the router tries Reserve in this order)."""

    @abstractmethod
    def order_prefill(self, nodes: Sequence[NodeLoad], prompt: Sequence[int] = ()) -> list[NodeLoad]:
        """All of `nodes`, best first, for a request of `prompt` (token ids)."""

    def routed(self, address: str, prompt: Sequence[int]) -> int:
        """The router sends a prefill of `prompt` to the node at `address`; returns the prompt
        tokens the node is expected to compute (what its outstanding load grows by)."""
        return len(prompt)


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

    def order_prefill(self, nodes: Sequence[NodeLoad], prompt: Sequence[int] = ()) -> list[NodeLoad]:
        return self._rotate("prefill", nodes)


class LeastLoad(Policy):
    """Decode: most free KV blocks per request in the batch, this one included (free / (1 + running),
    running = Status's + this router's in flight), then fewest running. Both count: a node with twice
    the batch needs twice the free KV to rank level, and since free blocks come only with each Status
    poll, the in-flight count, which moves with every placement, spreads a burst between two polls.
    Prefill: fewest queued prompt tokens (Status's + this router's outstanding), then fewest
    in flight. Ties break by address, so choices are deterministic."""

    name = "least_load"

    def order_decode(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        def key(n: NodeLoad) -> tuple[float, int, str]:
            running = n.running + n.inflight
            return -n.free_blocks / (1 + running), running, n.address

        return sorted(nodes, key=key)

    def order_prefill(self, nodes: Sequence[NodeLoad], prompt: Sequence[int] = ()) -> list[NodeLoad]:
        return sorted(nodes, key=lambda n: (prefill_load(n), n.running + n.inflight, n.address))


def prefill_load(n: NodeLoad) -> int:
    """Prompt tokens waiting on a prefill node: its last Status's plus this router's outstanding."""
    return n.queued_tokens + n.inflight_tokens


def chunk_hashes(prompt: Sequence[int], block_size: int) -> list[bytes]:
    """Hash chain of the prompt's full block-sized chunks before its last token (as the node's
    cache keys them, without its model seed or MTP lookahead: an approximate view)."""
    out, prev = [], b""
    for j in range((len(prompt) - 1) // block_size):
        chunk = prompt[j * block_size : (j + 1) * block_size]
        prev = hashlib.blake2b(prev + b"".join(t.to_bytes(4, "little") for t in chunk), digest_size=16).digest()
        out.append(prev)
    return out


class PrefixAware(Policy):
    """Prefill: cache-aware, as SGLang's router. Per prefill node, the hash chains of the prompts
    this router sent it (LRU, `view_blocks` per node) approximate what the node caches. A node
    costs its load (queued prompt tokens) plus what it would compute of this prompt (the prompt
    minus its longest remembered prefix); the cheapest goes first, then the least loaded, then
    the one sent the least (room in its cache). When loads are unbalanced (busiest - idlest >
    `balance_abs_tokens` and busiest > `balance_rel` x idlest), plain least load decides.
    Decode: as LeastLoad."""

    name = "prefix"
    MAX_VIEWS = 256  # nodes remembered (a restarted node comes back at a new address)

    def __init__(self, block_size: int = 16, balance_abs_tokens: int = 2048, balance_rel: float = 1.5,
                 view_blocks: int = 65536) -> None:
        self.block_size, self.view_blocks = block_size, view_blocks
        self.balance_abs_tokens, self.balance_rel = balance_abs_tokens, balance_rel
        self._least = LeastLoad()
        self._views: OrderedDict[str, OrderedDict[bytes, None]] = OrderedDict()

    def order_decode(self, nodes: Sequence[NodeLoad]) -> list[NodeLoad]:
        return self._least.order_decode(nodes)

    def order_prefill(self, nodes: Sequence[NodeLoad], prompt: Sequence[int] = ()) -> list[NodeLoad]:
        by_load = self._least.order_prefill(nodes)
        if not by_load or self.unbalanced(nodes):
            return by_load
        hashes = chunk_hashes(prompt, self.block_size)
        cost = {n.address: prefill_load(n) + len(prompt) - self.matched(n.address, hashes) for n in nodes}
        return sorted(by_load, key=lambda n: (cost[n.address], prefill_load(n), n.running + n.inflight,
                                              len(self._views.get(n.address, ())), n.address))

    def unbalanced(self, nodes: Sequence[NodeLoad]) -> bool:
        loads = [prefill_load(n) for n in nodes]
        if not loads:
            return False
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_tokens and hi > self.balance_rel * lo

    def matched(self, address: str, hashes: list[bytes]) -> int:
        """Prompt tokens of the longest prefix the node at `address` has been sent."""
        view = self._views.get(address)
        n = 0
        while view is not None and n < len(hashes) and hashes[n] in view:
            n += 1
        return n * self.block_size

    def routed(self, address: str, prompt: Sequence[int]) -> int:
        """Remember the prompt's chunks for `address`; the node computes what it did not hold."""
        hashes = chunk_hashes(prompt, self.block_size)
        work = len(prompt) - self.matched(address, hashes)
        view = self._views.setdefault(address, OrderedDict())
        self._views.move_to_end(address)
        for h in hashes:
            view[h] = None
            view.move_to_end(h)
        while len(view) > self.view_blocks:
            view.popitem(last=False)
        while len(self._views) > self.MAX_VIEWS:
            self._views.popitem(last=False)
        return work


POLICIES: dict[str, type[Policy]] = {RoundRobin.name: RoundRobin, LeastLoad.name: LeastLoad,
                                     PrefixAware.name: PrefixAware}


def make_policy(name: str, **options: Any) -> Policy:
    """The policy called `name`; `options` go to the prefix policy (block_size, thresholds)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(POLICIES)}") from None
    return cls(**options) if cls is PrefixAware else cls()


def policy_for(config: RouterConfig, block_size: int) -> Policy:
    """The policy `router.policy` names, the prefix policy with its settings from `config`."""
    if config.policy != "prefix":
        return make_policy(config.policy)
    return make_policy("prefix", block_size=block_size, balance_abs_tokens=config.prefix_balance_abs_tokens,
                       balance_rel=config.prefix_balance_rel, view_blocks=config.prefix_view_blocks)
