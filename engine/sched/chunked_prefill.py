"""ChunkedPrefill: admitted requests' prompts, computed a token budget at a time, into the decode batch.

Receives requests that hold their slot and their whole KV room already (admission is the
caller's: LLMEngine admits from its waiting queue, the colocated node at `Submit`). Each `step`
computes at most `budget` prompt tokens (FIFO; a prompt longer than what is left of the budget
is cut into chunks that later steps continue) as one prefill launch, registers the computed full
blocks with the prefix cache, and hands on, for every prompt that completes, its first token (an
output delta, with logprobs when asked) and the request itself, inserted into the decode batch
with its MTP drafts. The caller runs one decode step after each prefill step, so a running
request waits at most one budget's worth of prefill between two of its steps.

Holds integers and lists; tensors stay in the runner. Never syncs except at the prefill read
point (the first tokens), as LLMEngine always did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.cache.prefix_cache import PrefixCache
from engine.request import PrefillChunk, Request, RequestOutput
from engine.runner.model_runner import ModelRunner, PrefillOutput, logprob_columns
from engine.runner.prompt_logprobs import add_prompt_logprobs
from engine.runner.step_output import astuple_lp
from engine.sampling.sampler import LogprobsTensors
from engine.sched.decode_batch import DecodeBatch
from engine.sched.fork import fork_no_sync


class ChunkedPrefill:
    def __init__(self, runner: ModelRunner, prefix: PrefixCache, batch: DecodeBatch, budget: int) -> None:
        if budget <= 0:
            raise ValueError(f"the prefill token budget (max_num_batched_tokens) must be > 0, got {budget}")
        self.runner, self.prefix, self.batch, self.budget = runner, prefix, batch, budget
        self.requests: list[Request] = []  # admitted, prompt not fully computed; in arrival order

    @property
    def queued_tokens(self) -> int:
        """Prompt tokens still to compute."""
        return sum(len(r.prompt) - r.num_prefilled for r in self.requests)

    def add(self, req: Request) -> None:
        """A request holding its slot and blocks (`num_prefilled`: its cached prefix)."""
        self.requests.append(req)

    def drop(self, req: Request) -> None:
        """Forget a request (aborted); its blocks and slot are the caller's to free."""
        if req in self.requests:
            self.requests.remove(req)

    def schedule(self) -> tuple[list[PrefillChunk], list[Request]]:
        """This step's chunks: FIFO under the token budget."""
        budget, chunks, reqs = self.budget, [], []
        for req in self.requests:
            if budget <= 0:
                break
            end = min(len(req.prompt), req.num_prefilled + budget)
            chunks.append(PrefillChunk(req.prompt, req.num_prefilled, end, req.block_ids, req.params, req.seed))
            reqs.append(req)
            budget -= end - req.num_prefilled
        return chunks, reqs

    def step(self) -> list[RequestOutput]:
        """Compute this step's chunks (nothing when none is waiting); first tokens of completed prompts."""
        chunks, reqs = self.schedule()
        return self.run(chunks, reqs) if chunks else []

    def run(self, chunks: list[PrefillChunk], reqs: list[Request]) -> list[RequestOutput]:
        """Compute `chunks` and hand on the completed prompts at once (`launch` then `finish`)."""
        return self.finish(self.launch(chunks, reqs))

    def launch(self, chunks: list[PrefillChunk], reqs: list[Request], inserted_late: bool = False) -> Launched:
        """Queue the prefill of `chunks`, and the copies of what `finish` reads, without waiting.
        The caller may queue more work (a decode step) before `finish`: that wait is for the
        prefill alone, not for what was queued after it. `inserted_late`: the batch takes the
        completed prompts after the next prefill step is queued (the colocated node), so their
        device outputs are cloned first."""
        early = EarlyFirst()
        out = self.runner.prefill(chunks, on_first=early)
        for c, req in zip(chunks, reqs, strict=True):
            req.num_prefilled = c.end
            self.prefix.register(req.block_ids, req.block_hashes, c.end)
        add_prompt_logprobs(out, reqs)
        host = FirstTokenCopy.of(out, inserted_late, early.copy) if out.last_rows else None
        return Launched(chunks, reqs, out, host)

    def finish(self, launched: Launched) -> list[RequestOutput]:
        """First tokens of the completed prompts (the prefill read point); their requests go into
        the decode batch (its next launch) with their MTP drafts."""
        chunks, reqs, out, host = launched.chunks, launched.reqs, launched.out, launched.host
        if host is None:
            return []
        firsts, lp = host.read()
        lp_nums = {i: chunks[r].logprobs or 0 for i, r in enumerate(out.last_rows) if chunks[r].logprobs is not None}
        lps = logprob_columns(lp, lp_nums, out.logprob_rows, 1) if lp is not None else {}
        results = []
        for i, r in enumerate(out.last_rows):
            req = reqs[r]
            self.requests.remove(req)
            fork_no_sync(self.batch, req)  # n > 1: before the first token may end it
            results.append(self.batch.emit(req, [firsts[i]], lps.get(i)))
            results[-1].prompt_logprobs = req.prompt_logprobs
            if not req.finished:
                drafts = host.drafts[i] if host.drafts is not None else None
                probs = host.draft_probs[i] if host.draft_probs is not None else None
                self.batch.insert(req, host.first_token[i], drafts, probs)
        return results


@dataclass
class Launched:
    """A prefill step queued by `ChunkedPrefill.launch`, for its `finish`."""

    chunks: list[PrefillChunk]
    reqs: list[Request]
    out: PrefillOutput
    host: FirstTokenCopy | None  # None: no prompt completed in this step


@dataclass
class HostFirst:
    """A prefill step's first tokens and logprobs on their way to pinned host memory, with one
    event after the copies. Queued as soon as they are sampled (`ModelRunner.prefill`'s
    `on_first`), so their read waits for the target forward, not for the MTP drafts after it."""

    first: torch.Tensor  # host, [R]
    logprobs: LogprobsTensors | None
    done: Any  # a CUDA event after the copies; None on the CPU (the copies are done)

    @staticmethod
    def start(out: PrefillOutput) -> HostFirst:
        def to_host(t: torch.Tensor) -> torch.Tensor:
            if t.device.type == "cpu":
                return t.clone()
            dst = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            return dst.copy_(t, non_blocking=True)

        lp = LogprobsTensors(*(to_host(t) for t in astuple_lp(out.logprobs))) if out.logprobs is not None else None
        first = to_host(out.first_token)
        done = None
        if out.first_token.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return HostFirst(first, lp, done)

    def read(self) -> tuple[list[int], LogprobsTensors | None]:
        """The first tokens as host ints and the logprobs' host tensors, once the copies are done."""
        if self.done is not None:
            self.done.synchronize()  # the first tokens and these copies, not the drafts or work queued after them
        return self.first.tolist(), self.logprobs


class EarlyFirst:
    """An `on_first` for `ModelRunner.prefill`: queues the completed prompts' first tokens' copy to
    the host (`HostFirst`) there, ahead of the MTP drafts; `copy` is it (None: none completed)."""

    def __init__(self) -> None:
        self.copy: HostFirst | None = None

    def __call__(self, out: PrefillOutput) -> None:
        if out.last_rows:
            self.copy = HostFirst.start(out)


@dataclass
class FirstTokenCopy:
    """A prefill step's first tokens and logprobs on their way to the host (`HostFirst`), and the
    device outputs the batch inserts: cloned when the insert comes after the next prefill step
    (a prefill graph's outputs are overwritten by its next replay)."""

    first_token: torch.Tensor  # device, [R]
    drafts: torch.Tensor | None
    draft_probs: torch.Tensor | None
    host: HostFirst

    @staticmethod
    def of(out: PrefillOutput, clone_outputs: bool, early: HostFirst | None = None) -> FirstTokenCopy:
        """`early`: the copies queued before the drafts (else they are queued now, after them)."""
        def clone(t: torch.Tensor | None) -> torch.Tensor | None:
            return t.clone() if t is not None and clone_outputs else t

        first = out.first_token.clone() if clone_outputs else out.first_token
        return FirstTokenCopy(first, clone(out.drafts), clone(out.draft_probs),
                              early if early is not None else HostFirst.start(out))

    def read(self) -> tuple[list[int], LogprobsTensors | None]:
        return self.host.read()
