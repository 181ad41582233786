"""DecodeBatch: the running requests of a decode loop, in slots, stepped with overlap.

Receives requests that finished prefill (first token, drafts) and hands back per-step
output deltas. `step` launches decode step N+1 and only then reads step N's results, so
the host never waits for the device in between (ARCHITECTURE.md, "The decode step").
Requests inserted between two steps are written into the batch state together, right
before the next launch (one packed copy for all of them: `BatchState.insert_many_no_sync`).
Used by the single-process LLMEngine and by the decode node.

The launch is sized before the step in flight is read, from host integers only
(`plan_launch`): the rows that really run (next_real_bsz) and next_real_bsz * (k + 1) query
tokens, never from sequence lengths the host learns one step late.

With adaptive k (engine/spec_decode/adaptive_k.py) each launch asks `policy` for its k (0 or
the runner's k; a constrained step always runs at k) and each read step tells it how many tokens
its rows emitted; `k_steps[k]` counts the steps launched at each k.

While a grammar-constrained request runs, the masks of step N + 1 need step N's tokens and
drafts (engine/runner/constrained.py). The step then runs in two halves: the forward of N + 1 is
queued first, step N is read while it runs, the host writes N + 1's masks, and the rest of
N + 1 (masks, verification, redraft) is queued (`_step_in_halves`). The device waits for the
host only when the masks take longer than that forward, and the other requests of the batch
never wait for the masks.

Rules an editor must keep:
  * a request's KV blocks are freed only after the step in flight has been collected
    (`_free_after_collect`), so no launched step writes into a block handed to someone else;
  * a finished or aborted request's slot is marked done on the device first (`release`),
    so steps launched later mask it; results for rows whose request already ended are dropped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.cache.kv_cache import BlockManager
from engine.request import LogprobColumns, Request, RequestOutput
from engine.runner.batch_state import SlotInit
from engine.runner.constrained import ConstrainedRows
from engine.runner.cuda_graphs import StepFlags
from engine.runner.model_runner import DecodeHandle, ModelRunner
from engine.sampling.penalties import PenaltyInit
from engine.spec_decode.adaptive_k import KPolicy

InFlight = tuple[DecodeHandle, list[Request], dict[int, int]]


@dataclass(frozen=True)
class LaunchPlan:
    """The rows the next decode launch runs (`slots`, in slot order) and its size."""

    slots: list[int]
    tokens_per_row: int  # k + 1: each row verifies its last token and k drafts

    @property
    def num_tokens(self) -> int:
        """The launch's query tokens: next_real_bsz * (k + 1)."""
        return len(self.slots) * self.tokens_per_row


def plan_launch(known: dict[int, tuple[int, int]], in_flight: set[int], k: int) -> LaunchPlan:
    """The next launch, decided before the step in flight is read: integers only, no tensor.

    `known`: slot -> (tokens generated as far as the host has read, max_tokens) for every
    request of the batch, those inserted before this launch included; requests known to have
    ended (finished, aborted) are gone from it. `in_flight`: the slots of the step launched and
    not yet read. Each of them emits at least one token in that step, so a row with
    generated + 1 >= max_tokens surely finishes there: the next launch would only mask it, so
    it does not run (a stop token or a multi-token acceptance cannot be foreseen: such rows run
    masked). next_real_bsz = len(slots) picks the CUDA-graph bucket; KV room needs no
    prediction (admission reserved each request's whole life: `kv_room_needed`).
    """
    def ends_in_flight(slot: int) -> bool:
        generated, max_tokens = known[slot]
        return slot in in_flight and generated + 1 >= max_tokens

    return LaunchPlan([s for s in sorted(known) if not ends_in_flight(s)], k + 1)


class DecodeBatch:
    def __init__(self, runner: ModelRunner, blocks: BlockManager, max_num_seqs: int) -> None:
        self.runner, self.blocks = runner, blocks
        self.running: dict[int, Request] = {}  # slot -> request
        self.free_slots = list(range(max_num_seqs - 1, -1, -1))
        self._inflight: InFlight | None = None
        self._free_after_collect: list[list[int]] = []
        self._to_insert: dict[int, SlotInit] = {}  # slot -> what the next launch writes first
        self._held: list[tuple[torch.cuda.Event | None, list[int]]] = []  # blocks a queued copy still reads
        self.on_finish: Callable[[Request], None] | None = None
        self.constrained = ConstrainedRows(runner)  # grammar matchers of structured-output requests
        self._ended: list[RequestOutput] = []  # terminal outputs of requests ended at insert: the next step's
        # Request.logprobs gets every emitted token's entry (the single-process engine's answer); a
        # node, which hands the outputs' columns on and never reads them back, turns this off
        self.keep_logprobs = True
        # adaptive k: None where every step runs at the runner's k
        self.policy = KPolicy(runner.k, dict(runner.step_costs)) if len(runner.step_ks) > 1 else None
        self.k_steps = [0] * (runner.k + 1)  # decode steps launched at each k (for /metrics and benches)
        self.read_k = runner.k  # the k of the step the last `step` read

    @property
    def busy(self) -> bool:
        return bool(self.running) or self._inflight is not None or bool(self._held) or bool(self._ended)

    def hold_no_sync(self, blocks: list[int]) -> None:
        """Keep a reference on `blocks` until the device work queued so far has run (a fork's
        copy reads them: engine/sched/fork.py); `step` lets go of it. Never waits."""
        self.blocks.allocate_after(blocks, 0)
        event = None
        if self.runner.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        self._held.append((event, blocks))

    def _release_held(self) -> None:
        still: list[tuple[torch.cuda.Event | None, list[int]]] = []
        for event, blocks in self._held:
            if event is None or event.query():  # query: no wait
                self.blocks.free(blocks)
            else:
                still.append((event, blocks))
        self._held = still

    def take_slot(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def insert(self, req: Request, first: torch.Tensor | int, drafts: torch.Tensor | list[int] | None,
               draft_probs: torch.Tensor | None, seq_len: int | None = None) -> None:
        """Put a prefilled request (slot already taken) into the running batch; its state is
        written with the other inserts before the next launch. No sync. `seq_len`: the tokens
        whose KV is in its blocks (default: the prompt's; a forked choice starts one back).
        A structured-output request's matcher replays the tokens it has output (its grammar
        state); one whose spec does not compile, or does not match them, ends with that error."""
        assert req.slot is not None
        p = req.params
        if p.structured is not None:
            try:
                self.constrained.add(req, drafts)
            except ValueError as e:
                self.finish(req, f"error: {e}")
                self._ended.append(RequestOutput(req.group_id, [], None, req.finish_reason, req.index))
                return
        init = SlotInit(
            seq_len=req.num_prompt_tokens if seq_len is None else seq_len, first_token=first, drafts=drafts, draft_probs=draft_probs,
            num_generated=len(req.output_ids), max_tokens=req.max_tokens, stop_ids=req.stop_ids,
            temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, seed=req.seed, block_ids=req.block_ids,
            penalty=PenaltyInit.of(p, req.prompt, req.output_ids),
        )
        self._to_insert[req.slot] = init
        self.running[req.slot] = req

    def step(self) -> list[RequestOutput]:
        """Launch the next decode step (if any row really runs: `plan`), then read the previous one;
        while a constrained request runs, the launch's grammar masks need the previous step's
        tokens: the step runs in two halves around that read (`_step_in_halves`)."""
        previous, outputs, self._ended = self._inflight, self._ended, []
        self._release_held()
        if self._to_insert:
            self.runner.insert_many_no_sync(list(self._to_insert.items()))
            self._to_insert.clear()
        plan = self.plan(previous)
        if plan.slots and self.constrained:
            return outputs + self._step_in_halves(previous, plan.slots)
        self._inflight = self._launch(plan.slots) if plan.slots else None
        if previous is not None:
            outputs += self._collect(*previous)
            self._free_deferred()
        return outputs

    def _step_in_halves(self, previous: InFlight | None, slots: list[int]) -> list[RequestOutput]:
        """Queue the forward half of step N + 1, read step N while it runs, write N + 1's masks
        from N's tokens and drafts, then queue the rest of N + 1. The drafts N + 1 verifies are
        already read by its forward (engine/runner/constrained.py).
        Blocks freed while step N is read wait for N + 1: its forward may still write rows the
        host ended only now (the device learns of those after it was queued)."""
        reqs = [self.running[s] for s in slots]
        flags, lp = self._flags(slots, reqs)
        half = self.runner.launch_forward(slots, flags, lp, max(len(r.block_ids) for r in reqs))
        self.k_steps[self.runner.k] += 1
        ready, self._free_after_collect = self._free_after_collect, []  # ended before the forward was queued
        # `_inflight` still holds `previous` while it is read, so `finish` defers the blocks it frees
        outputs = self._collect(*previous) if previous is not None else []
        for blocks in ready:
            self.blocks.free(blocks)
        self.constrained.write_masks_no_sync(slots)
        self._inflight = self.runner.launch_finish(half), reqs, lp
        return outputs

    def plan(self, in_flight: InFlight | None) -> LaunchPlan:
        """The next launch's rows, from what the host knows before reading `in_flight` (a slot
        counts as in flight only while the request that step runs on it still holds it)."""
        known = {s: (len(r.output_ids), r.max_tokens) for s, r in self.running.items()}
        mine = set() if in_flight is None else {
            s for s, r in zip(in_flight[0].slots, in_flight[1], strict=True) if self.running.get(s) is r}
        return plan_launch(known, mine, self.runner.k)

    def _flags(self, slots: list[int], reqs: list[Request]) -> tuple[StepFlags, dict[int, int]]:
        """A launch's host-known flags (engine/runner/cuda_graphs.py) and its rows' logprob widths."""
        sampled = [r.params for r in reqs if not r.params.greedy]
        flags = (not sampled, any(p.top_k > 0 or p.top_p < 1.0 for p in sampled), any(r.params.penalized for r in reqs),
                 any(s in self.constrained.matchers for s in slots))
        lp = {i: r.params.logprobs for i, r in enumerate(reqs) if r.params.logprobs is not None}
        return flags, lp

    def _launch(self, slots: list[int]) -> InFlight:
        reqs = [self.running[s] for s in slots]
        flags, lp = self._flags(slots, reqs)
        width = max(len(r.block_ids) for r in reqs)
        k = self.policy.choose(len(slots)) if self.policy is not None else self.runner.k
        self.k_steps[k] += 1
        return self.runner.launch_decode(slots, flags, lp, width, k), reqs, lp

    def _collect(self, handle: DecodeHandle, reqs: list[Request], lp: dict[int, int]) -> list[RequestOutput]:
        res = self.runner.collect(handle, lp)
        self.read_k = handle.k
        if self.policy is not None:
            emitted = [len(t) for t, r in zip(res.tokens, reqs, strict=True) if t and not r.finished]
            self.policy.observe(handle.k, len(emitted), sum(emitted), handle.stale)
        outputs = []
        for row, req in enumerate(reqs):
            toks = res.tokens[row]
            if req.finished or not toks:
                continue
            if req.slot in self.constrained.matchers and not self._advance_grammar(req, toks, res.drafts, row):
                outputs.append(RequestOutput(req.group_id, [], None, req.finish_reason, req.index))
                continue
            req.steps += 1
            req.accepted_tokens += len(toks) - 1
            outputs.append(self.emit(req, toks, res.logprobs.get(row), device_finished=res.finished[row]))
        return outputs

    def _advance_grammar(self, req: Request, toks: list[int], drafts: list[list[int]] | None, row: int) -> bool:
        """Advance a constrained request's matcher over its emitted tokens; a token its grammar
        rejects (a masking bug) ends the request with an error instead of breaking the loop."""
        assert req.slot is not None
        if self.constrained.advance(req.slot, toks, drafts[row] if drafts is not None else None):
            return True
        self.finish(req, f"error: emitted tokens {toks} do not match the structured output")
        return False

    def emit(self, req: Request, toks: list[int], lps: LogprobColumns | None,
             device_finished: bool = False) -> RequestOutput:
        """Record new tokens (and their logprobs, per token, when `keep_logprobs`); finish the request
        on a stop token or at max_tokens."""
        req.output_ids += toks
        if lps is not None and self.keep_logprobs:
            req.logprobs += lps.entries(toks)
        if toks[-1] in req.stop_ids:
            self.finish(req, "stop")
        elif len(req.output_ids) >= req.max_tokens or device_finished:
            self.finish(req, "length")
        return RequestOutput(req.group_id, toks, lps, req.finish_reason, req.index)

    def finish(self, req: Request, reason: str) -> None:
        """End a request: mask its slot on the device, free its slot, free its blocks safely."""
        req.finish_reason = reason
        if req.slot is not None:
            self._to_insert.pop(req.slot, None)  # ended before its state was written
            self.constrained.remove(req.slot)
            if self.running.pop(req.slot, None) is not None:
                self.runner.state.release(req.slot)
            self.free_slots.append(req.slot)
            req.slot = None
        if req.block_ids:
            self._free_after_collect.append(req.block_ids)
            req.block_ids = []
        if self._inflight is None:
            self._free_deferred()
        if self.on_finish is not None:
            self.on_finish(req)

    def _free_deferred(self) -> None:
        for blocks in self._free_after_collect:
            self.blocks.free(blocks)
        self._free_after_collect.clear()
