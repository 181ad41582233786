"""TPDecodeNode: one rank of a decode node of TP size N (engine/tp/channel.py).

Rank 0 is the node the router and prefill nodes talk to; its reservations, first-token
messages and aborts reach ranks 1..N-1 through the channel, in order, and every rank applies
them to the same scheduler. Each rank receives its own KV-head shard from the prefill rank of
the same index: a reservation's descriptor is rank 0's with `tp_ranks` (the others'), and a
request is inserted only when its KV is DONE on every rank (their states are all-gathered).
Only rank 0 publishes output items.

Differences from DecodeNode, so the ranks' block managers and prefix caches stay equal: a
request's KV has landed when it has on every rank (then its blocks are cached, on every rank);
one that ends before that has its blocks quarantined on every rank, whatever its own transfer's
state, and quarantine ends by rank 0's clock.
"""

from __future__ import annotations

import collections
import concurrent.futures
import time
from typing import Any, assert_never

from decode_node.commands import Abort, Command, First, OwnerBack, OwnerGone, Reserve, Submit
from decode_node.node import DecodeNode, Reservation
from engine.engine import EngineConfig
from engine.model.loader import LoadedModel
from engine.request import Request
from engine.tp.channel import Lockstep, TPChannel, with_ranks
from engine.tp.tensor_parallel import TPGroup
from kvtransfer import TransferState
from protos import node_pb2
from protos.convert import sampling_from_proto, sampling_to_proto
from protos.messages import FirstToken, OutputItem


class TPDecodeNode(Lockstep, DecodeNode):
    loop_name = "tp-decode-loop"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, tp: TPGroup, **kw: Any) -> None:
        DecodeNode.__init__(self, loaded, config, tp=tp, **kw)
        self.channel = TPChannel(tp)
        self.now, self.commands = time.monotonic(), []
        self._futures: collections.deque = collections.deque()  # rank 0: reservations' futures, in order
        self.emitted = 0  # output batches this rank published (rank 0 only ever does)

    def _encode(self, cmd: Command) -> list[Any]:
        """A command as plain values for the other ranks (rank 0 keeps a reservation's future)."""
        match cmd:
            case Reserve():
                self._futures.append(cmd.future)
                sampling = sampling_to_proto(cmd.params, cmd.seed, cmd.stop_ids).SerializeToString()
                return ["reserve", cmd.request_id, cmd.prompt_len, sampling, cmd.prompt]
            case First():
                return ["first", cmd.msg.pack()]
            case Abort():
                return ["abort", cmd.request_id, cmd.reason]
            case OwnerBack():
                return ["owner_back", cmd.owner]
            case OwnerGone():
                return ["owner_gone", cmd.owner]
            case Submit():  # DecodeNode has no submit(): nothing queues one here
                raise TypeError("a tensor-parallel decode node takes no whole requests")
            case _:
                assert_never(cmd)

    def _decode(self, values: list[Any]) -> Command:
        """`_encode`'s values as the command again, on every rank (rank 0's reservation with its future)."""
        kind = values[0]
        if kind == "reserve":
            params, seed, stops = sampling_from_proto(node_pb2.Sampling.FromString(values[3]), self.vocab)
            future = self._futures.popleft() if self.channel.leader else concurrent.futures.Future()
            return Reserve(values[1], values[2], params, seed, stops, values[4], future)
        if kind == "first":
            return First(FirstToken.unpack(values[1], self.vocab, max_drafts=self.k))
        if kind == "abort":
            return Abort(values[1], values[2])
        if kind == "owner_back":
            return OwnerBack(values[1])
        if kind == "owner_gone":
            return OwnerGone(values[1])
        raise ValueError(f"unknown tensor-parallel command {kind!r}")

    def _drain_inbox(self, items: list[OutputItem]) -> None:
        reserved: list[tuple[Reserve, Reservation]] = []
        for values in self.commands:
            cmd = self._decode(values)
            if isinstance(cmd, Reserve):  # answered once every rank's descriptor is gathered
                reserved.append((cmd, self._reserve(cmd.request_id, cmd.prompt_len, cmd.params, cmd.seed,
                                                    cmd.stop_ids, cmd.prompt)))
            else:
                self._apply(cmd, items)
        if reserved:
            self._answer(reserved)

    def _answer(self, reserved: list[tuple[Reserve, Reservation]]) -> None:
        """Gather every rank's descriptors; a reservation stands only where every rank admitted it."""
        every = self.channel.gather([r.descriptor if r.admitted else None for _, r in reserved])
        for i, (cmd, res) in enumerate(reserved):
            descs = [mine[i] for mine in every]
            if res.admitted and None in descs:
                self._end(self.requests[cmd.request_id], "abort")
                res = Reservation(False, "a tensor-parallel rank of the decode node refused it")
            elif res.admitted:
                res.descriptor = with_ranks(descs)
            if self.channel.leader:
                cmd.future.set_result(res)

    def _admit_ready(self, items: list[OutputItem]) -> None:
        if not self.pending:
            return
        mine = {rid: [s.state.value, s.reason] for rid in self.pending for s in [self.receiver.poll(rid)]}
        late = [rid for rid, p in self.pending.items() if time.monotonic() > p.deadline] if self.channel.leader else []
        every = self.channel.gather([mine, late])
        for rid, p in list(self.pending.items()):
            states = [ranks[0][rid] for ranks in every]
            failed = [reason for state, reason in states if state == TransferState.FAILED.value]
            done = all(state == TransferState.DONE.value for state, _ in states)
            if done:
                self._kv_landed(p)  # on every rank at once: their prefix caches stay equal
            if failed:
                self._error(p, f"KV transfer failed: {failed[0]}", items)
            elif done and p.first is not None:
                self._insert(p)
            elif rid in every[0][1]:
                self._error(p, f"KV or first token did not arrive within {self.admission_timeout_s}s", items)

    def _end(self, req: Request, reason: str) -> None:
        """As DecodeNode's, but whether the KV landed is the ranks' agreed view (`kv_done`), not
        this rank's: unless it landed on every rank, every rank quarantines the request's blocks."""
        pending = self.pending.pop(req.request_id, None)
        if pending is not None and not pending.kv_done:
            if not self.receiver.poll(req.request_id).state.terminal:
                self.receiver.abort(req.request_id, f"request ended: {reason}")
            self.blocks.free(req.block_ids[: pending.skip])  # cached: never a destination
            self.quarantine.append((self.now + self.kv_quarantine_s, req.block_ids[pending.skip :]))
            req.block_ids = []
        DecodeNode._end(self, req, reason)

    def _release_quarantine(self) -> None:
        for q in [q for q in self.quarantine if q[0] <= self.now]:
            self.quarantine.remove(q)
            self.blocks.free(q[1])

    def _publish(self, items: list[OutputItem]) -> None:
        if self.channel.leader and items:
            self.emitted += 1
            DecodeNode._publish(self, items)
