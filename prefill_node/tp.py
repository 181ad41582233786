"""TPPrefillNode: one rank of a prefill node of TP size N (engine/tp/channel.py).

Rank 0 is the node the router talks to; its prefill jobs and aborts reach ranks 1..N-1
through the channel, in order, and every rank runs the same prefill steps. Rank r pushes
its KV-head shard to rank r of the decode node (the descriptor's `tp_ranks`). Only rank 0
sends the first-token message and answers the caller. A job's source blocks are freed when
its lease has ended on every rank (the ranks' releases are all-gathered), so no rank frees a
block another rank's transport may still read, and the ranks' block managers stay equal; a
job whose descriptor one rank refuses is refused on every rank.
"""

from __future__ import annotations

import collections
import queue
import time
from typing import Any, assert_never

from engine.engine import EngineConfig
from engine.model.loader import LoadedModel
from engine.tp.channel import Lockstep, TPChannel, rank_descriptor
from engine.tp.tensor_parallel import TPGroup
from prefill_node.first_token import FirstTokenSink
from prefill_node.node import (
    Abort,
    Attach,
    Command,
    PrefillJob,
    PrefillNode,
    Submit,
)
from protos import node_pb2
from protos.convert import sampling_from_proto, sampling_to_proto
from protos.messages import FirstToken


class TPPrefillNode(Lockstep, PrefillNode):
    takes_attach = False  # ranks replay the leader's commands: a job comes with its descriptor
    loop_name = "tp-prefill-loop"

    def __init__(self, loaded: LoadedModel, config: EngineConfig, first_token_sink: FirstTokenSink,
                 tp: TPGroup, **kw: Any) -> None:
        self.emitted = 0  # first-token messages this rank sent (rank 0 only ever does)
        self._leader_sink = first_token_sink
        PrefillNode.__init__(self, loaded, config, self._send if tp.rank == 0 else self._not_sent, tp=tp, **kw)
        self.channel = TPChannel(tp)
        self.now, self.commands = time.monotonic(), []
        self._jobs: collections.deque[PrefillJob] = collections.deque()  # rank 0: submitted jobs, in order
        self._ended_on: dict[str, int] = {}  # request id -> ranks whose lease has ended

    def _send(self, address: str, msg: FirstToken) -> None:
        self.emitted += 1
        self._leader_sink(address, msg)

    def _not_sent(self, address: str, msg: FirstToken) -> None:
        """Ranks 1..N-1 compute the first token too, and keep it to themselves."""

    def _encode(self, cmd: Command) -> list[Any]:
        """A command as plain values for the other ranks (rank 0 keeps a submitted job)."""
        match cmd:
            case Submit():
                job = cmd.job
                self._jobs.append(job)
                sampling = sampling_to_proto(job.params, job.seed, job.stop_ids).SerializeToString()
                return ["submit", job.request_id, job.prompt, sampling, job.descriptor, job.decode_address]
            case Abort():
                return ["abort", cmd.request_id, cmd.reason]
            case Attach():  # the server refuses Attach here (takes_attach): nothing queues one
                raise TypeError("a tensor-parallel prefill node takes no Attach")
            case _:
                assert_never(cmd)

    def _drain_inbox(self) -> None:
        for cmd in self.commands:
            if cmd[0] == "submit":
                job = self._job(*cmd[1:])
                assert job.descriptor is not None  # the server refuses a job without one here (takes_attach)
                job.descriptor = rank_descriptor(job.descriptor, self.channel.rank, self.channel.size)
                self._mark(job.request_id, "queued")
                self.waiting.append(job)
                self.queued_tokens += len(job.prompt)
            else:
                self._abort_now(cmd[1], cmd[2])

    def _job(self, rid: str, prompt: list[int], sampling: bytes, descriptor: dict, address: str) -> PrefillJob:
        """Rank 0: the submitted job itself (its caller waits on its future); else a copy."""
        if self.channel.leader:
            return self._jobs.popleft()
        vocab = self.loaded.model.config.vocab_size
        params, seed, stops = sampling_from_proto(node_pb2.Sampling.FromString(sampling), vocab)
        return PrefillJob(rid, list(prompt), params, seed, stops, descriptor, address)

    def _start(self, job: PrefillJob) -> bool:
        """As PrefillNode's, and the ranks agree: a descriptor one rank refuses, all refuse."""
        if not PrefillNode._start(self, job):
            return False  # out of blocks: the same on every rank
        refused = self.channel.gather(not job.block_ids)
        if any(refused) and job.block_ids:
            self._undo_start(job)
        return True

    def _undo_start(self, job: PrefillJob) -> None:
        """Another rank refused the job's descriptor: end it as if this rank had (nothing was sent yet)."""
        self.sender.abort(job.request_id, "another tensor-parallel rank refused the KV descriptor")
        self.blocks.free(self.leased.pop(job.request_id))
        self.waiting.remove(job)
        self.queued_tokens -= job.remaining
        job.block_ids = []
        job.future.set_exception(ValueError("bad KV descriptor: another tensor-parallel rank refused it"))

    def _free_released(self) -> None:
        mine = []
        while True:
            try:
                mine.append(list(self._released.get_nowait()))
            except queue.Empty:
                break
        if not self.leased:
            return  # every rank agrees on the leases: none open, nothing to free
        for rank_released in self.channel.gather(mine):
            for rid, done, at in rank_released:
                if rid not in self.leased:
                    continue  # an undone start's (`_undo_start`)
                self._ended_on[rid] = self._ended_on.get(rid, 0) + 1
                if self._ended_on[rid] == self.channel.size:
                    del self._ended_on[rid]
                    self._release(rid, done, at)
