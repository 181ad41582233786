"""PrefillNode: prompts in, first tokens out; the KV goes to a decode node layer by layer.

Receives prefill jobs (prompt ids, resolved sampling, the decode node's kvtransfer
descriptor). Each step batches prompt chunks under a token budget (FIFO, chunked), runs the
target; as each target layer finishes for a prompt that completes in this step, its blocks
are handed to the KV sender (never blocking). Then the first token is sampled (with
logprobs), the MTP module drafts k tokens and its layer is pushed too, and the first-token
message goes back to the caller (who answers with it before the loop goes on, when no job waits:
`let_answer`) and, from a small pool of sender threads (off the loop and the caller's path;
prefill_node/first_token.py), to the decode node (through `first_token_sink`).
If the decode node cannot be reached, the transfer is aborted: the decode node fails the attempt
and the router moves the request on (after the first token it has streamed).

With the prefix cache on (`EngineConfig.enable_prefix_caching`), a job starts after its
longest cached prefix (engine/cache/prefix_cache.py) and its full prompt blocks are cached as they
are computed. Independently, a decode node with its own prefix cache says in the descriptor
(`skip`) how many leading prompt blocks it holds (pinned there for the request); only the blocks
after them are sent, for every layer, the MTP layer included. `skip` comes from the network: it
is checked against the prompt (never past its full blocks before the last token, and the
destination list must cover exactly the rest) before the transfer starts, and a job whose
descriptor fails the check is refused. The prefill node never guesses what the decode node holds.

The descriptor may also come after the job (`attach`): the router then reserves on the decode node
while this node computes, and its first token does not wait for the reservation. A job without
its descriptor computes as any other; its layers wait (with their CUDA events) and, once it is
done, so does its first-token message to the decode node; `attach` starts the transfer and
sends what waited. An attach that comes before its job waits for it here (the two calls race
through the server's threads; the server answers the Attach call meanwhile: `ATTACH_WAIT_S`). A job whose descriptor has not come within the KV timeout is dropped and
its blocks freed.

Source blocks stay leased until the decode node acknowledges, the job is aborted, or the
lease expires; only then are they freed (a cached block stays cached, evictable). A lease that
ends while its job still computes ends the job first (`TransferLost`), so no later chunk writes
blocks already freed. One thread (the loop) owns the scheduler, the runner and the block manager;
other threads only enqueue (`submit`, `abort`).
"""

from __future__ import annotations

import bisect
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, assert_never

import torch

from engine.engine import EngineConfig, build_runner, prefix_cache_for
from engine.model.loader import LoadedModel
from engine.request import PrefillChunk, TokenLogprob
from engine.runner.model_runner import PrefillOutput, kv_room_needed, unpack_logprobs
from engine.runner.prompt_logprobs import add_prompt_logprobs
from engine.runner.warmup import IdleCaptures, shape_status, warm_up
from engine.sampling.sampling_params import SamplingParams
from engine.sched.chunked_prefill import EarlyFirst, HostFirst
from engine.sched.step_loop import StepLoop, drained
from engine.tp.tensor_parallel import TPGroup
from kvtransfer import KVLayout, TransferState, TransferStatus, create_sender
from prefill_node.first_token import FirstTokenSends, FirstTokenSink, let_answer
from protos.messages import KV_TRANSFER_BUCKETS, FirstToken, TokenLogprobs, token_logprobs

log = logging.getLogger(__name__)


class NeverFits(ValueError):
    """A prompt that needs more KV blocks than the node has in all."""


class TransferLost(ConnectionError):
    """A job's KV transfer ended before its prefill did: the decode node gave it up (a timeout, an
    abort) or the lease expired. A ConnectionError, as an unreachable decode node is: the Prefill
    call answers FAILED_PRECONDITION and the router moves the request (prefill_node/server.py)."""


@dataclass
class PrefillJob:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    seed: int
    stop_ids: tuple[int, ...]
    descriptor: dict[str, Any] | None  # None: it comes later (`PrefillNode.attach`)
    decode_address: str  # "" until the descriptor comes
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache keys of its full prompt blocks
    num_prefilled: int = 0  # a cache hit starts it after the cached prefix
    cached_tokens: int = 0  # that hit: prompt tokens served from the prefix cache
    skip: int = 0  # leading prompt blocks the decode node holds already: not sent
    aborted: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # asked: filled chunk by chunk
    held_layers: list[tuple[int, Any]] = field(default_factory=list)  # (layer, ready) computed before the descriptor
    held_first: FirstToken | None = None  # done before the descriptor: D's first-token message waits
    attach_by: float = 0.0  # monotonic deadline for a job without its descriptor
    received: float = field(default_factory=time.monotonic)  # its Prefill request came in (the server sets it)
    started: float | None = None  # its first chunk's step began: the end of its queue time
    answered: threading.Event | None = None  # a caller answers with its first token: set once it has (`let_answer`)

    @property
    def attached(self) -> bool:
        return self.descriptor is not None

    @property
    def remaining(self) -> int:
        return len(self.prompt) - self.num_prefilled

    def timed(self, first: FirstToken, computed: float) -> FirstToken:
        """`first` with the job's queue and compute time (TTFT parts: router/ttft.py)."""
        started = computed if self.started is None else self.started
        first.queue_s, first.compute_s = max(0.0, started - self.received), computed - started
        return first

    def first_token(self, token: int, drafts: list[int], probs: torch.Tensor | None, lp: list | None) -> FirstToken:
        """The first-token message: for the router (no drafts), or with the drafts for the decode node."""
        logprobs = None
        if lp is not None:
            value, rank, top = lp[0]
            logprobs = TokenLogprobs([value], [rank], [[i for i, _ in top]], [[v for _, v in top]])
        finished = "stop" if token in self.stop_ids else ("length" if self.params.max_tokens <= 1 else None)
        sampled = not self.params.greedy and probs is not None
        plp = None if self.prompt_logprobs is None else token_logprobs(self.prompt_logprobs)
        return FirstToken(self.request_id, token, self.params.logprobs, logprobs, drafts,
                          probs.contiguous().numpy().tobytes() if sampled else b"", finished,  # type: ignore[union-attr]
                          self.params.prompt_logprobs, plp, self.cached_tokens)


# ---- commands to the loop thread: queued by any thread, applied in order (`_drain_inbox`) ----
@dataclass(frozen=True)
class Submit:
    """Queue a prefill job (its caller waits on `job.future`)."""

    job: PrefillJob


@dataclass(frozen=True)
class Abort:
    """End request `request_id` wherever it is (queued, sending its KV, waiting for its descriptor)."""

    request_id: str
    reason: str


@dataclass(frozen=True)
class Attach:
    """The KV descriptor of a job submitted without one; `future` ends once the transfer started."""

    request_id: str
    descriptor: dict[str, Any]
    decode_address: str
    future: concurrent.futures.Future


Command = Submit | Abort | Attach


def _warm_up(runner: Any, config: EngineConfig, tp: TPGroup | None, max_model_len: int) -> float:
    """Seconds of the prefill graphs captured before serving; the rest are captured when idle
    (engine/runner/warmup.py). TP ranks capture in lockstep, later: none here."""
    if not config.warmup or (tp is not None and tp.size > 1):
        return 0.0
    return warm_up(runner, decode=False, prefill=True, max_model_len=max_model_len).seconds


class PrefillNode(StepLoop):
    loop_name = "prefill-loop"
    takes_attach = True  # a job may come without its descriptor (`attach`)

    def __init__(self, loaded: LoadedModel, config: EngineConfig, first_token_sink: FirstTokenSink,
                 kv_backend: str = "ucx", kv_timeout_s: float = 10.0, kv_options: dict | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.loaded, self.config, self.sink = loaded, config, first_token_sink
        self.k = config.num_speculative_tokens
        self.runner, self.blocks, self.max_model_len = build_runner(loaded, config, decodes=False, tp=tp)
        self.warmup_s = _warm_up(self.runner, config, tp, self.max_model_len)
        # the quiet spells that let idle captures run count from here: a backlog captured right at
        # `ready` would hold the first requests (each waits for the capture in flight)
        self.captures = IdleCaptures(self.runner, self.max_model_len)
        self.prefix = prefix_cache_for(loaded, config, self.blocks)
        self.num_layers = loaded.model.config.num_hidden_layers
        self._released: queue.SimpleQueue[tuple[str, bool, float]] = queue.SimpleQueue()
        self.sender = create_sender(kv_backend, timeout_s=kv_timeout_s, on_release=self._on_release,
                                    **(kv_options or {}))
        self._kv_block_bytes = register_cache(self.sender, self.runner, self.num_layers + (1 if self.k else 0))
        self._first_sends = FirstTokenSends(self.sender)  # each message goes with the node's `sink`
        self._sent_at: dict[str, float] = {}  # request id -> when its last layer was queued
        self.counters = {"prefill_tokens": 0, "prefill_seconds": 0.0, "kv_bytes": 0, "kv_seconds": 0.0,
                         "kv_skipped_bytes": 0}  # not sent: the decode node held those blocks
        self.kv_buckets = [0] * (len(KV_TRANSFER_BUCKETS) + 1)  # transfers per time bucket (/metrics' histogram)
        # request id -> {event: monotonic time} (queued, started, computed, first_sent, kv_acked);
        # None (serving): nothing kept. `pdserve bench pd` turns it on for the TTFT breakdown.
        self.timings: dict[str, dict[str, float]] | None = None
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self.waiting: list[PrefillJob] = []
        self.leased: dict[str, list[int]] = {}  # request id -> source blocks under lease
        self.kv_timeout_s = kv_timeout_s
        self.detached: dict[str, PrefillJob] = {}  # done, their descriptor not come yet
        self._early: dict[str, tuple[dict, str, concurrent.futures.Future, float]] = {}  # attaches before their job
        self.queued_tokens = 0

    # ---- any thread ------------------------------------------------------------------
    def submit(self, job: PrefillJob) -> concurrent.futures.Future:
        check_fits(len(job.prompt), self.max_model_len, self.blocks, self.k)
        if self.runner.grammar is not None:  # compiled off the loop; the prefill step finds it cached
            self.runner.grammar.precompile(job.params.structured)
        self._inbox.put(Submit(job))
        self.wake()
        return job.future

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._inbox.put(Abort(request_id, reason))
        self.wake()

    def attach(self, request_id: str, descriptor: dict[str, Any], decode_address: str) -> concurrent.futures.Future:
        """The KV descriptor of a job submitted without one; the future ends (None) once the transfer
        started, or with ValueError (a bad descriptor: the job fails) or KeyError (no such job)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Attach(request_id, descriptor, decode_address, future))
        self.wake()
        return future

    def status(self) -> dict[str, Any]:
        """Load, and cumulative counters for /metrics: kv_seconds sums, per transfer, the time from
        its last layer queued to the decode node's acknowledgement (what compute did not hide)."""
        return {"free_blocks": self.blocks.num_free, "total_blocks": self.blocks.capacity,
                "running": len(self.waiting), "queued_tokens": self.queued_tokens, **self.counters,
                **self.prefix.status(), "takes_attach": self.takes_attach,
                "kv_seconds_buckets": list(self.kv_buckets), **shape_status(self.runner)}

    def _loop_failed(self, error: BaseException) -> None:
        """A step raised (a device error): the jobs it held fail (their callers try another prefill
        node), and its Status says unhealthy, so no more come. Loop thread."""
        for job in [*self.waiting, *self.detached.values()]:
            if not job.future.done():
                job.future.set_exception(error)

    def stop(self) -> None:
        self.stop_loop()
        self._first_sends.close()
        self.sender.close()

    def _on_release(self, request_id: str, status: TransferStatus) -> None:
        self._released.put((request_id, status.state == TransferState.DONE, time.monotonic()))  # transport thread
        self.wake()

    # ---- the loop thread -------------------------------------------------------------
    def step(self) -> bool:
        """One scheduling step; returns whether there was work. Only the loop calls it."""
        self._drain_inbox()
        self._free_released()
        self._expire_unattached()
        jobs = self._admit_and_plan()
        if not jobs:
            return self.captures.idle()  # idle: one graph, after a quiet spell (engine/runner/warmup.py)
        self.captures.busy()
        chunks = [PrefillChunk(j.prompt, j.num_prefilled, j.num_prefilled + n, j.block_ids, j.params, j.seed)
                  for j, n in jobs]
        finishing = [j for (j, _), c in zip(jobs, chunks, strict=True) if c.is_last]
        mark_started([j for j, _ in jobs], time.monotonic())
        start, early = time.perf_counter(), EarlyFirst()  # early: the first tokens' copy to the host, ahead of the drafts
        try:
            out = self.runner.prefill(chunks, on_layer=lambda layer, ready: self._push_layer(finishing, layer, ready),
                                      on_first=early)
        except Exception as e:  # a failed step fails its jobs, the node keeps serving
            for j, _ in jobs:
                self._fail(j, f"prefill failed: {e}")
            return True
        for (j, n) in jobs:
            j.num_prefilled += n
            self.queued_tokens -= n
            self.prefix.register(j.block_ids, j.block_hashes, j.num_prefilled)
        add_prompt_logprobs(out, [j for j, _ in jobs])
        self._complete(finishing, out, chunks, early.copy)  # holds the step's read points
        self.counters["prefill_tokens"] += sum(n for _, n in jobs)
        self.counters["prefill_seconds"] += time.perf_counter() - start
        return True

    def _drain_inbox(self) -> None:
        for cmd in drained(self._inbox):
            match cmd:
                case Submit():
                    self._queue_job(cmd.job)
                case Attach():
                    self._attach_now(cmd.request_id, cmd.descriptor, cmd.decode_address, cmd.future)
                case Abort():
                    self._abort_now(cmd.request_id, cmd.reason)
                case _:
                    assert_never(cmd)

    def _queue_job(self, job: PrefillJob) -> None:
        self._mark(job.request_id, "queued")
        if not job.attached:
            job.attach_by = time.monotonic() + self.kv_timeout_s
        self.waiting.append(job)
        self.queued_tokens += len(job.prompt)
        early = self._early.pop(job.request_id, None)
        if early is not None:
            self._attach_now(job.request_id, *early[:3])

    def _abort_now(self, request_id: str, reason: str) -> None:
        for j in self.waiting:
            if j.request_id == request_id:
                self._fail(j, reason)  # out of the queue, its tokens off the queued count
                return
        if request_id in self.detached:
            self._release(self.detached.pop(request_id).request_id, False, time.monotonic())  # never sent
        elif request_id in self.leased:
            self.sender.abort(request_id, reason)
        early = self._early.pop(request_id, None)
        if early is not None:
            early[2].set_exception(KeyError(f"{request_id}: aborted ({reason})"))

    def _admit_and_plan(self) -> list[tuple[PrefillJob, int]]:
        """FIFO under the token budget; a job gets its blocks (its cached prefix first) when it starts."""
        budget, plan = self.config.max_num_batched_tokens, []
        for job in list(self.waiting):
            if budget <= 0:
                break
            if not job.block_ids:
                if not self._start(job):
                    break  # out of blocks: wait for leases to end
                if not job.block_ids:
                    continue  # refused (bad descriptor)
                self._mark(job.request_id, "started")
            n = min(job.remaining, budget)
            plan.append((job, n))
            budget -= n
        return plan

    def _start(self, job: PrefillJob) -> bool:
        """Take the job's blocks and start its transfer; False when the blocks are not there yet."""
        need = self.blocks.blocks_for(kv_room_needed(len(job.prompt), self.k))
        if not job.block_hashes:
            job.block_hashes = self.prefix.hashes(job.prompt, job.params.prompt_logprobs is not None)
        if not self.prefix.fits(job.block_hashes, need):
            return False
        if job.attached:
            try:
                self._start_transfer(job)
            except Exception as e:
                self.waiting.remove(job)
                self.queued_tokens -= job.remaining
                job.future.set_exception(ValueError(f"bad KV descriptor: {e}"))
                return True
        got = self.prefix.allocate(job.prompt, job.block_hashes, need)
        assert got is not None  # checked above; nothing ran in between
        job.block_ids, job.num_prefilled = got
        job.cached_tokens = job.num_prefilled
        self.queued_tokens -= job.num_prefilled
        self.leased[job.request_id] = job.block_ids
        return True

    def _start_transfer(self, job: PrefillJob) -> None:
        """Check the job's descriptor and start its transfer (raises on a bad descriptor)."""
        assert job.descriptor is not None
        job.skip = self._decode_holds(job)
        self.sender.start(job.request_id, job.descriptor)

    def _decode_holds(self, job: PrefillJob) -> int:
        """The descriptor's `skip` (prompt blocks the decode node holds), validated: at most the
        prompt's full blocks before its last token, and one destination per block after them."""
        assert job.descriptor is not None
        skip, dst = job.descriptor.get("skip", 0), job.descriptor.get("blocks")
        full = (len(job.prompt) - 1) // self.blocks.block_size
        if type(skip) is not int or not 0 <= skip <= full:
            raise ValueError(f"skip {skip!r} outside 0..{full} (the prompt's full blocks before its last token)")
        rest = self.blocks.blocks_for(len(job.prompt)) - skip
        if not isinstance(dst, list) or len(dst) != rest:
            raise ValueError(f"{len(dst) if isinstance(dst, list) else dst!r} destination blocks for {rest} to send")
        return skip

    def _push_layer(self, jobs: list[PrefillJob], layer: int, ready: Any = None) -> None:
        """Send `layer` of `jobs` once `ready` (a CUDA event after it) has passed; None: after
        the work queued so far."""
        if ready is None:
            ready = _event_after_queued_work(self.runner.device)
        for j in jobs:
            if j.attached:
                self._send_layer(j, layer, ready)
            else:
                j.held_layers.append((layer, ready))

    def _send_layer(self, job: PrefillJob, layer: int, ready: Any) -> None:
        nb = self.blocks.blocks_for(len(job.prompt))
        self.sender.send_layer(job.request_id, layer, job.block_ids[job.skip : nb], ready=ready)

    def _complete(self, jobs: list[PrefillJob], out: PrefillOutput, chunks: list[PrefillChunk],
                  early: HostFirst | None = None) -> None:
        """The step's completed prompts: their first tokens to the router as soon as they are on the
        host (`early`: copied ahead of the MTP drafts; the router ignores drafts), then, with the
        drafts, the first-token messages for the decode nodes."""
        if not jobs:
            return
        if self.k:
            self._push_layer(jobs, self.num_layers)  # the MTP layer, after the draft chain
        for j in jobs:
            if j.attached:
                self._finish_transfer(j)
            else:
                self.detached[j.request_id] = j
            self.waiting.remove(j)
        if early is None:
            early = HostFirst.start(out)
        firsts, lp = early.read()  # the first tokens' read point: the target forward, not the drafts
        computed = time.monotonic()
        for j in jobs:
            self._mark(j.request_id, "computed")
        lp_nums = {i: jobs[i].params.logprobs or 0 for i in out.logprob_rows}
        lps = unpack_logprobs(lp, lp_nums, out.logprob_rows, 1) if lp is not None else {}
        for i, j in enumerate(jobs):  # the router streams the first token while the drafts run
            j.future.set_result(j.timed(j.first_token(firsts[i], [], None, lps.get(i)), computed))
            self._mark(j.request_id, "first_sent")
        let_answer([j.answered for j in jobs if j.answered is not None], busy=bool(self.waiting))
        drafts = out.drafts.tolist() if out.drafts is not None else [[] for _ in jobs]  # the drafts' read point
        probs = out.draft_probs.float().cpu() if out.draft_probs is not None else None
        for i, j in enumerate(jobs):
            msg = j.first_token(firsts[i], drafts[i], probs[i] if probs is not None else None, lps.get(i))
            if j.attached:
                self._first_sends.send(self.sink, j.decode_address, msg)  # off this loop and the router's path
            else:
                j.held_first = msg

    def _finish_transfer(self, job: PrefillJob) -> None:
        """Every layer of `job` is queued: end its transfer and count its bytes."""
        self.sender.finish(job.request_id)
        self._sent_at[job.request_id] = time.monotonic()
        self.counters["kv_bytes"] += (self.blocks.blocks_for(len(job.prompt)) - job.skip) * self._kv_block_bytes
        self.counters["kv_skipped_bytes"] += job.skip * self._kv_block_bytes

    def _attach_now(self, rid: str, descriptor: dict[str, Any], address: str,
                    future: concurrent.futures.Future) -> None:
        """The descriptor of a job submitted without one: start its transfer and send what waited."""
        job = self.detached.get(rid) or next((j for j in self.waiting if j.request_id == rid), None)
        if job is None:  # its Prefill request has not come through yet (or the job is gone: it expires)
            self._early[rid] = (descriptor, address, future, time.monotonic() + self.kv_timeout_s)
            return
        if job.attached:
            future.set_exception(ValueError(f"{rid}: its KV descriptor came already"))
            return
        job.descriptor, job.decode_address = descriptor, address
        if job.block_ids:  # started: its blocks are there to send from
            try:
                self._start_transfer(job)
            except Exception as e:
                job.descriptor, job.decode_address = None, ""  # no transfer to abort: its blocks are freed
                future.set_exception(ValueError(f"bad KV descriptor: {e}"))
                self._abort_now(rid, f"bad KV descriptor: {e}")
                return
        for layer, ready in job.held_layers:
            self._send_layer(job, layer, ready)
        job.held_layers = []
        if rid in self.detached:
            del self.detached[rid]
            self._finish_transfer(job)
            assert job.held_first is not None
            self._first_sends.send(self.sink, job.decode_address, job.held_first)
        future.set_result(None)

    def _expire_unattached(self) -> None:
        """Drop jobs whose descriptor did not come in time (their blocks freed), and early attaches
        whose job never came."""
        now = time.monotonic()
        for rid, job in list(self.detached.items()):
            if job.attach_by < now:
                log.warning("%s: no KV descriptor came within %.0f s; dropped", rid, self.kv_timeout_s)
                self._release(self.detached.pop(rid).request_id, False, time.monotonic())
        for job in [j for j in self.waiting if not j.attached and j.attach_by < now]:
            self._fail(job, "no KV descriptor came in time")
        for rid, (_, _, future, by) in list(self._early.items()):
            if by < now:
                del self._early[rid]
                future.set_exception(KeyError(f"{rid}: no such prefill job"))

    def _fail(self, job: PrefillJob, reason: str) -> None:
        if job in self.waiting:
            self.waiting.remove(job)
            self.queued_tokens -= job.remaining
        if job.request_id in self.leased:
            if job.attached:
                self.sender.abort(job.request_id, reason)
            else:  # no transfer started: nothing will release its blocks but this
                self._release(job.request_id, False, time.monotonic())
        if not job.future.done():
            job.future.set_exception(RuntimeError(reason))

    def _mark(self, request_id: str, event: str, at: float | None = None) -> None:
        if self.timings is not None:
            self.timings.setdefault(request_id, {})[event] = time.monotonic() if at is None else at

    def _free_released(self) -> None:
        for rid, done, at in drained(self._released):
            self._release(rid, done, at)

    def _release(self, rid: str, done: bool, at: float) -> None:
        """The request's lease ended (its transfer DONE or not, at `at`): free its source blocks."""
        sent = self._sent_at.pop(rid, None)
        if done:
            self._mark(rid, "kv_acked", at)
        if done and sent is not None:
            took = max(0.0, at - sent)
            self.counters["kv_seconds"] += took
            self.kv_buckets[bisect.bisect_left(KV_TRANSFER_BUCKETS, took)] += 1
        blocks = self.leased.pop(rid, None)
        self.queued_tokens -= end_computing(self.waiting, rid)
        if blocks is not None:
            self.blocks.free(blocks)


def end_computing(waiting: list[PrefillJob], rid: str) -> int:
    """A lease that ended while its job still computes (the decode node gave the transfer up, or
    the lease expired during a long prefill): the job ends too, before its blocks are freed, since
    its later chunks would write blocks that another job may take, and its KV can no longer reach
    the decode node. Runs between steps (no chunk of it is in flight). The tokens it had left."""
    job = next((j for j in waiting if j.request_id == rid), None)
    if job is None:
        return 0
    waiting.remove(job)
    if not job.future.done():  # the decode node is the one that gave up: the router moves the request
        job.future.set_exception(TransferLost(f"{rid}: its KV transfer ended before its prefill did"))
    return job.remaining


def mark_started(jobs: list[PrefillJob], now: float) -> None:
    """A job's queue time ends when its first chunk's step begins."""
    for j in jobs:
        j.started = now if j.started is None else j.started


def check_fits(prompt_len: int, max_model_len: int, blocks: Any, k: int) -> None:
    """ValueError unless a prompt fits the context; NeverFits unless its KV fits the node's blocks
    (such a job would wait at the queue's head for ever, and every job behind it)."""
    if prompt_len >= max_model_len or not prompt_len:
        raise ValueError(f"prompt of {prompt_len} tokens does not fit the context {max_model_len}")
    need = blocks.blocks_for(kv_room_needed(prompt_len, k))
    if need > blocks.capacity:
        raise NeverFits(f"the prompt needs {need} KV blocks and the prefill node has {blocks.capacity} in all")


def register_cache(sender: Any, runner: Any, layers_sent: int) -> int:
    """Register the runner's KV cache with `sender`; the bytes of one block over the layers sent."""
    layout = KVLayout(runner.kv.layers, block_dim=1)
    sender.register(layout)
    return sum(sum(layout.block_bytes(i)) for i in range(layers_sent))


def _event_after_queued_work(device: torch.device) -> Any:
    """A CUDA event after the work queued so far (the transport waits on it); None on CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record()
    return event
