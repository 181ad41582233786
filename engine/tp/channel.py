"""The control channel of a TP node: rank 0 hands every rank the inputs of each step.

A prefill or decode node of TP size N is N processes running the same engine. Rank 0 is
the node the network sees (its gRPC server, its outputs); its loop drains the node's inbox
and broadcasts what it drained (new requests, aborts, first tokens), in order, with its
clock (`now`) and whether to stop. Every rank then applies those commands and runs the same
step, so every rank's scheduler takes the same decisions. Facts only a rank knows (its own KV
transfers' states) are all-gathered, and every rank decides from the same gathered list.

`TPChannel` moves msgpack (never pickle, ARCHITECTURE I5) over a gloo group of its own, so
it works beside an NCCL model group; `Lockstep` is the loop of such a node (a StepLoop mixin).

Careful when editing: every rank must call `broadcast` and `gather` the same number of times
in the same order; a branch around them may depend only on state every rank shares (the
commands, the scheduler), never on the rank or on a local clock.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from engine.tp.tensor_parallel import TPGroup

PACKET_VERSION = 1


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


class TPChannel:
    """msgpack values from rank 0 to all (`broadcast`) and from all to all (`gather`)."""

    def __init__(self, tp: TPGroup) -> None:
        self.rank, self.size = tp.rank, tp.size
        self.group = dist.new_group(backend="gloo") if tp.size > 1 else None

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, value: Any = None) -> Any:
        """Rank 0's `value` on every rank (the others pass None)."""
        if self.size == 1:
            return value
        data = msgpack.packb(value, use_bin_type=True) if self.leader else b""
        n = torch.tensor([len(data)], dtype=torch.int64)
        dist.broadcast(n, src=0, group=self.group)
        buf = _tensor(data) if self.leader else torch.empty(int(n), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return msgpack.unpackb(buf.numpy().tobytes(), raw=False)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value`, in rank order, on every rank."""
        if self.size == 1:
            return [value]
        data = msgpack.packb(value, use_bin_type=True)
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        most = max(int(s) for s in sizes)
        mine = torch.zeros(most, dtype=torch.uint8)
        mine[: len(data)] = _tensor(data)
        parts = [torch.empty(most, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(parts, mine, group=self.group)
        return [msgpack.unpackb(p[: int(s)].numpy().tobytes(), raw=False) for p, s in zip(parts, sizes, strict=True)]


def rank_descriptor(descriptor: dict[str, Any], rank: int, size: int) -> dict[str, Any]:
    """Rank `rank`'s part of a TP decode node's KV descriptor: rank 0's own keys, with
    `tp_ranks` listing ranks 1..N-1's descriptors. {} (refused by the sender) when it does not
    carry one for each of `size` ranks."""
    desc = dict(descriptor)
    others = desc.pop("tp_ranks", [])
    if size == 1:
        return desc if not others else {}
    if not isinstance(others, list) or len(others) != size - 1 or not all(isinstance(d, dict) for d in others):
        return {}
    return desc if rank == 0 else dict(others[rank - 1])


def with_ranks(descriptors: list[dict[str, Any]]) -> dict[str, Any]:
    """One descriptor for a TP decode node from its ranks' own (rank order)."""
    return {**descriptors[0], "tp_ranks": descriptors[1:]} if len(descriptors) > 1 else descriptors[0]


class Lockstep:
    """A StepLoop mixin: rank 0 broadcasts each round's packet, every rank steps on it.

    The node class provides `_inbox` (a queue of the node's typed commands), `step`, `_stop`,
    `_wake`, `idle_wait_s`, and `_encode(command)` (a command as msgpack-able values; rank 0 only).
    During `step`, `self.commands` are the round's commands and `self.now` rank 0's clock."""

    channel: TPChannel
    commands: list[Any]
    now: float
    _inbox: Any
    _stop: Any
    _wake: Any

    # step, idle_wait_s, _encode: the node's (not declared here: this mixin comes first in the MRO)
    step: Any
    idle_wait_s: Any
    _encode: Any

    def _packet(self) -> dict[str, Any]:
        stop = self._stop.is_set()  # read first: a command queued before stop() still goes out
        cmds = []
        while not self._inbox.empty():
            cmds.append(self._encode(self._inbox.get_nowait()))
        return {"v": PACKET_VERSION, "stop": stop, "now": time.monotonic(), "cmds": cmds}

    def _run(self) -> None:
        while True:
            packet = self.channel.broadcast(self._packet() if self.channel.leader else None)
            if packet["stop"]:
                return
            self.now, self.commands = packet["now"], packet["cmds"]
            if not self.step() and self.channel.leader:
                self._wake.wait(self.idle_wait_s())
                self._wake.clear()
