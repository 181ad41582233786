"""DecodeNode: admits requests, receives their KV and first token, decodes with MTP.

Receives, from the router, reservations (`reserve`: blocks for the request's whole life
and a slot, or a refusal) and aborts; from prefill nodes, first-token messages (token,
drafts, draft probabilities) while the KV arrives through kvtransfer. When both are
complete the request is inserted into the running batch with asynchronous writes
(`DecodeBatch.insert`), and the overlapped decode loop (`DecodeBatch.step`) advances it.
Hands on output items (new tokens + logprobs, and exactly one terminal item per admitted
request) to the output streams: each owner's (router process's) items to that owner's streams
(`publish_to_owners`).

One thread (the loop) owns the batch, the runner and the block manager; other threads
only enqueue commands and wait on futures. A reservation whose KV or first token does not
arrive within `admission_timeout_s` ends with an error and frees its blocks.

Prefix cache (`EngineConfig.enable_prefix_caching`, config `decode.prefix_cache`): given the
prompt's token ids at `reserve`, the node hashes them as a prefill node does (engine/cache/prefix_cache.py:
model identity, and with MTP the token after each block, so a cached block is valid for the MTP
layer too), takes its longest cached prefix first (one reference each: pinned, never evicted while
the request holds it), and names that count in the descriptor (`skip`); only the blocks after it
are expected, and the prefill node sends only those. When the transfer is DONE the request's full
prompt blocks before its last token are registered (decode never writes into them); they stay
cached, evictable, once the request ends. A transfer that fails registers nothing.

Owners (a router instance; restarts: deploy/router_actor.py): a subscriber may name itself
(`subscribe(owner)`), and a request whose id begins with `owner + "/"` is that owner's. When the
owner's last open output stream ends (the router died, or it gave up the stream: either way it
has already counted those requests as lost), the loop aborts every request of that owner and
refuses its new reservations until it subscribes again, so a dead router's requests never hold
blocks here. Requests of an owner that never subscribed are never touched by this rule.

Blocks of a request that ends before its KV transfer is DONE are quarantined for
`kv_quarantine_s` before reuse: a transport may still land late bytes for it (ucx cannot
cancel a posted receive), and they must not overwrite another request's KV. Its cached prefix
blocks were never a destination: their references are dropped at once.
"""

from __future__ import annotations

import concurrent.futures
import queue
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, assert_never

import torch

from decode_node.commands import Abort, Command, First, OwnerBack, OwnerGone, Reserve, Submit
from decode_node.streams import OutputStreams, Stream, owner_of
from engine.engine import EngineConfig, build_runner, prefix_cache_for
from engine.model.loader import LoadedModel
from engine.request import Request, RequestOutput
from engine.runner.model_runner import kv_room_needed
from engine.runner.warmup import IdleCaptures, shape_status, warm_up
from engine.sampling.sampling_params import MAX_N, SamplingParams
from engine.sched.decode_batch import DecodeBatch
from engine.sched.fork import (
    allocate_children,
    choice_id,
    fork_no_sync,
    group_fits,
    make_children,
    shared_blocks,
)
from engine.sched.step_loop import StepLoop, drained
from engine.tp.tensor_parallel import TPGroup
from kvtransfer import KVLayout, KVReceiver, TransferState, create_receiver
from protos.messages import FirstToken, OutputItem, TokenLogprobs, token_logprobs

ERROR_PREFIX = "error: "  # a finish reason that is an error (engine/sched/decode_batch.py)


def _resumes_grammar(params: SamplingParams) -> bool:
    """A moved structured-output request: its grammar state replays the output at its prompt's end."""
    return params.structured is not None and params.resumed_tokens > 0


@dataclass
class Pending:
    """A reserved request waiting for its KV and first-token message."""

    request: Request
    deadline: float
    first: FirstToken | None = None
    kv_done: bool = False
    skip: int = 0  # leading prompt blocks taken from the prefix cache (not transferred)


@dataclass
class Reservation:
    admitted: bool
    reason: str = ""
    descriptor: dict[str, Any] = field(default_factory=dict)
    fits: bool = True  # False: refused for good, the request needs more KV blocks than the node has in all


class DecodeNode(StepLoop):
    loop_name = "decode-loop"
    prefills = False  # runs prefill steps itself (the colocated node): warmed up too

    def __init__(self, loaded: LoadedModel, config: EngineConfig, kv_backend: str | None = "ucx",
                 kv_timeout_s: float = 10.0, admission_timeout_s: float = 30.0,
                 kv_options: dict | None = None, kv_quarantine_s: float | None = None,
                 tp: TPGroup | None = None) -> None:
        super().__init__()
        self.loaded, self.config = loaded, config
        self.k = config.num_speculative_tokens
        self.runner, self.blocks, self.max_model_len = build_runner(loaded, config, tp=tp)
        # graphs captured before serving (their seconds), the rest when idle (engine/runner/warmup.py)
        self.warmup_s = 0.0
        if config.warmup and (tp is None or tp.size == 1):  # TP ranks capture in lockstep: not warmed yet
            self.warmup_s = warm_up(self.runner, decode=True, prefill=self.prefills,
                                    max_model_len=self.max_model_len).seconds
        # the quiet spells that let idle captures run count from here: a backlog captured right at
        # `ready` would hold the first requests (each waits for the capture in flight)
        self.captures = IdleCaptures(self.runner, self.max_model_len)
        self.prefix = prefix_cache_for(loaded, config, self.blocks)
        self.batch = DecodeBatch(self.runner, self.blocks, config.max_num_seqs)
        self.batch.keep_logprobs = False  # the output items carry them; nothing here reads them back
        self.vocab = loaded.model.config.vocab_size
        self.num_layers = loaded.model.config.num_hidden_layers + (1 if self.k else 0)
        self._receiver: KVReceiver | None = None  # None: KV never arrives from elsewhere (a colocated node)
        self._kv_block_bytes = 0
        if kv_backend is not None:
            self._receiver = create_receiver(kv_backend, timeout_s=kv_timeout_s, **(kv_options or {}))
            layout = KVLayout(self.runner.kv.layers, block_dim=1)
            self._receiver.register(layout)
            self._kv_block_bytes = sum(sum(layout.block_bytes(i)) for i in range(self.num_layers))
        self.kv_bytes = 0  # KV received (for /metrics)
        self.kv_skipped_bytes = 0  # KV not transferred: the prefix cache held those blocks
        self.draft_tokens = [0] * self.k  # per draft position: verified, accepted (for /metrics)
        self.accepted_per_pos = [0] * self.k
        self.admission_timeout_s = admission_timeout_s
        self.kv_quarantine_s = kv_timeout_s if kv_quarantine_s is None else kv_quarantine_s
        self.quarantine: list[tuple[float, list[int]]] = []  # (free after, blocks)
        self.pending: dict[str, Pending] = {}
        self.requests: dict[str, Request] = {}  # admitted and not yet ended
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        # request id -> {event: monotonic time} (first_received, kv_done, inserted); None: not kept
        self.timings: dict[str, dict[str, float]] | None = None
        self.streams = OutputStreams(self._inbox)  # the output streams and their owners ("Owners")
        self.orphans_dropped = 0  # requests aborted because their owner's stream ended

    # ---- any thread ------------------------------------------------------------------
    def reserve(self, request_id: str, prompt_len: int, params: SamplingParams, seed: int,
                stop_ids: tuple[int, ...], prompt: list[int] | None = None) -> concurrent.futures.Future:
        """Ask the loop to admit a request; the future gives a Reservation. `prompt` (its token
        ids, optional) lets the prefix cache supply the blocks it holds. A structured-output spec is
        compiled here, on the caller's thread, so the loop's insert finds it cached."""
        if self.runner.grammar is not None:
            self.runner.grammar.precompile(params.structured)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put(Reserve(request_id, prompt_len, params, seed, stop_ids, prompt, fut))
        self.wake()
        return fut

    def first_token(self, msg: FirstToken) -> None:
        self._inbox.put(First(msg))
        self.wake()

    def abort(self, request_id: str, reason: str = "aborted") -> None:
        self._inbox.put(Abort(request_id, reason))
        self.wake()

    def subscribe(self, owner: str = "") -> Stream:
        """A new output stream; `owner` (optional) names the requests it owns (ids `owner/...`)."""
        return self.streams.subscribe(owner)

    def unsubscribe(self, q: queue.SimpleQueue, owner: str = "") -> None:
        """End a stream; the owner's last one ending drops the owner's requests (loop thread)."""
        self.streams.unsubscribe(q, owner)
        self.wake()

    def status(self) -> dict[str, Any]:
        return {"free_blocks": self.blocks.num_free, "total_blocks": self.blocks.capacity,
                "running": len(self.requests), "queued_tokens": 0, "kv_bytes": self.kv_bytes,
                "kv_skipped_bytes": self.kv_skipped_bytes, "draft_tokens": list(self.draft_tokens),
                "accepted_per_pos": list(self.accepted_per_pos), "spec_decode_steps": list(self.batch.k_steps),
                **self.prefix.status(), **shape_status(self.runner)}

    @property
    def receiver(self) -> KVReceiver:
        """The KV receiver (pending requests only exist on a node that has one)."""
        assert self._receiver is not None, "this node receives no KV"
        return self._receiver

    def stop(self) -> None:
        self.stop_loop()
        if self._receiver is not None:
            self._receiver.close()
        self.streams.close()

    # ---- the loop thread -------------------------------------------------------------
    def _loop_failed(self, error: BaseException) -> None:
        """A step raised (a device error): every output stream ends, so routers move this node's
        requests elsewhere, and its Status says unhealthy, so they send no more."""
        self.streams.close()

    def idle_wait_s(self) -> float:
        # A transfer's end wakes the loop (``on_end``); the poll is for admission deadlines and a
        # receiver that cannot tell.
        return 0.002 if self.pending else 0.02

    def step(self) -> bool:
        """Commands, admissions of completed transfers, one decode step. Loop thread only."""
        items: list[OutputItem] = []
        self._release_quarantine()
        self._drain_inbox(items)
        self._admit_ready(items)
        busy, outputs = self.batch.busy, self.batch.step()
        self._count_accepted(outputs)
        items += [self._item(o) for o in outputs]
        self._publish(items)
        return self.captures.busy() if busy or items else self.captures.idle()

    def _drain_inbox(self, items: list[OutputItem]) -> None:
        for cmd in drained(self._inbox):
            self._apply(cmd, items)

    def _apply(self, cmd: Command, items: list[OutputItem]) -> None:
        """One command from the inbox (decode_node/commands.py). Loop thread only."""
        match cmd:
            case Reserve():
                cmd.future.set_result(self._reserve(cmd.request_id, cmd.prompt_len, cmd.params, cmd.seed,
                                                    cmd.stop_ids, cmd.prompt))
            case Submit():
                cmd.future.set_result(self._submit(cmd.request_id, cmd.prompt, cmd.params, cmd.seed, cmd.stop_ids))
            case First():
                self._on_first(cmd.msg, items)
            case Abort():
                self._abort(cmd.request_id, cmd.reason, items)
            case OwnerBack():
                self.streams.owner_back(cmd.owner)
            case OwnerGone():
                self._drop_owner(cmd.owner, items)
            case _:
                assert_never(cmd)

    def _submit(self, rid: str, prompt: list[int], params: SamplingParams, seed: int,
                stop_ids: tuple[int, ...]) -> Reservation:
        """A whole request: only a node that prefills takes one (ColocatedNode)."""
        return Reservation(False, "a decode node takes reservations, not whole requests")

    def _reserve(self, rid: str, prompt_len: int, params: SamplingParams, seed: int,
                 stop_ids: tuple[int, ...], prompt: list[int] | None) -> Reservation:
        refusal = self._refusal(rid, prompt_len, prompt)
        if not refusal and (params.penalized or params.n > 1 or _resumes_grammar(params)) and not prompt:
            refusal = ("penalties, logit_bias, n > 1 and a moved structured-output request need the prompt's "
                       "token ids with the reservation")
        if refusal:
            return Reservation(False, refusal)
        max_tokens = min(params.max_tokens, self.max_model_len - prompt_len)
        need = self.blocks.blocks_for(kv_room_needed(prompt_len + max_tokens, self.k))
        if need > self.blocks.capacity:
            return self.never_fits(need)
        keep = prompt if params.penalized or params.n > 1 or _resumes_grammar(params) else None  # they read it
        req = Request(rid, list(keep or []), params, seed, stop_ids, max_tokens, num_prompt_tokens=prompt_len)
        hit = self._admit_group(req, prompt or [], need)
        if hit is None:
            return Reservation(False, f"decode node full ({self.blocks.num_free} free blocks, need {need} "
                                      f"for each of {params.n} choices)")
        skip = hit // self.blocks.block_size
        kv_blocks = req.block_ids[skip : self.blocks.blocks_for(prompt_len)]
        try:
            descriptor = self.receiver.expect(rid, kv_blocks, list(range(self.num_layers)), skip=skip)
        except Exception as e:
            self._end(req, "abort")
            return Reservation(False, f"kv receiver refused: {e}")
        self.pending[rid] = Pending(req, time.monotonic() + self.admission_timeout_s, skip=skip)
        self.receiver.on_end(rid, self.wake)  # KV landing after the first token: admitted now, not at a poll
        return Reservation(True, "", descriptor)

    def never_fits(self, need: int) -> Reservation:
        """A refusal for good: waiting for blocks to free would wait forever (and hold up the queue
        behind it in the router)."""
        return Reservation(False, f"the request needs {need} KV blocks and the node has {self.blocks.capacity} "
                                  f"in all", fits=False)

    def _admit_group(self, req: Request, prompt: list[int], need: int) -> int | None:
        """A slot and `need` blocks for every choice of `req` (n > 1: engine/sched/fork.py), its cached
        prefix first; the prompt tokens that prefix holds, or None (nothing taken) when they do
        not fit. Every choice is then in `requests`."""
        n, bs = req.params.n, self.blocks.block_size
        hashes = self.prefix.hashes(prompt, req.params.prompt_logprobs is not None) if prompt else []
        shared = shared_blocks(req.num_prompt_tokens, bs)
        if len(self.batch.free_slots) < n or not group_fits(self.blocks, self.blocks.match(hashes), need, n, shared):
            return None
        got = self.prefix.allocate(prompt, hashes, need)
        assert got is not None  # checked above; nothing ran in between
        req.block_ids, req.block_hashes = got[0], hashes
        req.children = make_children(req)
        allocate_children(self.blocks, req, need, bs)
        for r in (req, *req.children):
            r.slot = self.batch.take_slot()
            self.requests[r.request_id] = r
        return got[1]

    def _refusal(self, rid: str, prompt_len: int, prompt: list[int] | None) -> str:
        """Why a reservation cannot even be tried ('' when it can)."""
        if rid in self.requests:
            return f"request {rid!r} is already on this decode node"
        if self.streams.refuses(rid):
            return f"the router that sent {rid!r} has no output stream open here"
        if not 0 < prompt_len < self.max_model_len:
            return f"prompt of {prompt_len} tokens does not fit the context {self.max_model_len}"
        if prompt and (len(prompt) != prompt_len or min(prompt) < 0 or max(prompt) >= self.vocab):  # C-level scans
            return f"prompt token ids must be {prompt_len} ids inside the vocabulary"
        return ""

    def _drop_owner(self, owner: str, items: list[OutputItem]) -> None:
        """The owner's last output stream ended: abort its requests, refuse its new ones."""
        self.streams.owner_gone(owner)
        for rid in [r for r in self.requests if owner_of(r) == owner]:
            self.orphans_dropped += 1
            self._abort(rid, f"its router ({owner}) is gone", items)

    def _on_first(self, msg: FirstToken, items: list[OutputItem]) -> None:
        p = self.pending.get(msg.request_id)
        if p is None:
            return  # aborted or unknown: nothing to do
        if msg.finished and not p.request.children:  # the first token ended it: the router has its terminal
            self._end(p.request, msg.finished)
            return
        self._mark(msg.request_id, "first_received")
        p.first = msg

    def _abort(self, rid: str, reason: str, items: list[OutputItem]) -> None:
        """Abort request `rid` (every choice), or one choice of it (`{id}#{i}`, `#0` the first)."""
        group, sep, index = rid.rpartition("#")
        if sep and index == "0":
            members = [self.requests.get(group)]
        else:
            members = [self.requests.get(rid)] + [self.requests.get(choice_id(rid, i)) for i in range(1, MAX_N)]
        for req in members:
            if req is not None:
                items.append(OutputItem(req.group_id, [], finish_reason="abort", steps=req.steps,
                                        accepted=req.accepted_tokens, index=req.index))
                self._end(req, "abort")

    def _admit_ready(self, items: list[OutputItem]) -> None:
        now = time.monotonic()
        for rid, p in list(self.pending.items()):
            state = self.receiver.poll(rid)
            if state.state == TransferState.DONE:
                self._kv_landed(p)
            if state.state == TransferState.FAILED:
                self._error(p, f"KV transfer failed: {state.reason}", items)
            elif state.state == TransferState.DONE and p.first is not None:
                self._insert(p)
            elif now > p.deadline:
                self._error(p, f"KV or first token did not arrive within {self.admission_timeout_s}s", items)

    def _count_accepted(self, outputs: list[RequestOutput]) -> None:
        """Each output is one request's step: k drafts verified, the first len - 1 accepted (none
        verified in a plain step of adaptive k)."""
        if self.batch.read_k == 0:
            return
        accepted = Counter(len(out.new_token_ids) - 1 for out in outputs)
        for pos in range(self.k):
            self.draft_tokens[pos] += len(outputs)
            self.accepted_per_pos[pos] += sum(n for a, n in accepted.items() if a > pos)

    def _kv_landed(self, p: Pending) -> None:
        """The request's transfer is DONE (once per request): count it, cache its full prompt blocks."""
        if p.kv_done:
            return
        p.kv_done, req = True, p.request
        self._mark(req.request_id, "kv_done")  # as seen here: the step after it ended (which wakes an idle loop)
        self.kv_bytes += (self.blocks.blocks_for(req.num_prompt_tokens) - p.skip) * self._kv_block_bytes
        self.kv_skipped_bytes += p.skip * self._kv_block_bytes
        self.prefix.register(req.block_ids, req.block_hashes, req.num_prompt_tokens)

    def _insert(self, p: Pending) -> None:
        assert p.first is not None
        req, msg = p.request, p.first
        del self.pending[req.request_id]
        self._mark(req.request_id, "inserted")
        req.output_ids = [msg.token]
        fork_no_sync(self.batch, req)  # n > 1: the other choices start from its prompt's KV
        if msg.finished:  # the first token ended it (the router has that terminal); its choices go on
            self._end(req, msg.finished)
            return
        drafts = list(msg.drafts) if self.k else None  # host values: staged with the step's other inserts
        probs = None
        if msg.draft_probs:
            probs = torch.frombuffer(bytearray(msg.draft_probs), dtype=torch.float32).view(self.k, self.vocab)
        self.batch.insert(req, msg.token, drafts, probs)

    def _mark(self, request_id: str, event: str) -> None:
        if self.timings is not None:
            self.timings.setdefault(request_id, {}).setdefault(event, time.monotonic())

    def _error(self, p: Pending, message: str, items: list[OutputItem]) -> None:
        items.append(OutputItem(p.request.request_id, [], error=message))
        self._end(p.request, "error")

    def _end(self, req: Request, reason: str) -> None:
        """Forget a request; if its KV may still be arriving, stop it and quarantine its blocks."""
        self.requests.pop(req.request_id, None)
        pending = self.pending.pop(req.request_id, None)
        if pending is not None:
            state = self.receiver.poll(req.request_id).state
            if state == TransferState.DONE:
                self._kv_landed(pending)  # complete KV: worth caching though the request ends
            else:
                if not state.terminal:
                    self.receiver.abort(req.request_id, f"request ended: {reason}")
                self.blocks.free(req.block_ids[: pending.skip])  # cached: never a destination
                self.quarantine.append((time.monotonic() + self.kv_quarantine_s, req.block_ids[pending.skip :]))
                req.block_ids = []
        if not req.finished:
            self.batch.finish(req, reason)
        if not req.forked:  # its other choices never started: they end with it
            for child in req.children:
                self.requests.pop(child.request_id, None)
                if not child.finished:
                    self.batch.finish(child, reason)

    def _release_quarantine(self) -> None:
        now = time.monotonic()
        due = [q for q in self.quarantine if q[0] <= now]
        for q in due:
            self.quarantine.remove(q)
            self.blocks.free(q[1])

    def _item(self, out: RequestOutput) -> OutputItem:
        own_id = choice_id(out.request_id, out.index)
        req = self.requests.get(own_id)
        n = req.params.logprobs if req is not None else None
        lps, c = None, out.new_logprobs
        if n is not None and c is not None and c.logprob:  # top columns: n x 0 may come as no rows (same wire)
            lps = TokenLogprobs(c.logprob, c.rank, c.top_ids, c.top_logprobs)
        item = OutputItem(out.request_id, out.new_token_ids, n if lps else None, lps, out.finish_reason,
                          index=out.index)
        if out.finish_reason is not None and out.finish_reason.startswith(ERROR_PREFIX):  # e.g. a grammar's
            item.finish_reason, item.error = None, out.finish_reason[len(ERROR_PREFIX) :]
        if out.prompt_logprobs is not None and req is not None:  # a colocated node's first token
            item.num_prompt_logprobs = req.params.prompt_logprobs
            item.prompt_logprobs = token_logprobs(out.prompt_logprobs)
        if out.finish_reason and req is not None:
            item.steps, item.accepted, item.cached_tokens = req.steps, req.accepted_tokens, req.num_cached_tokens
            self.requests.pop(own_id, None)
        return item

    def _publish(self, items: list[OutputItem]) -> None:
        if not items:
            return
        self.streams.publish(items)

