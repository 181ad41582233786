"""Prompt logprobs (vLLM's `prompt_logprobs`): for every prompt token after the first, its logprob
given the tokens before it, its rank and the top-N, from the raw logits (as the sampled tokens'
logprobs are), computed by the prefill step that computes the position before it.

Receives a prefill step's chunks; `plan` picks, for the chunks whose request asked, the step's
token slots and the prompt token each one predicts (a chunk's last position predicts the next
chunk's first token; the prompt's last position predicts the first output token, which is not a
prompt token); `compute` turns the step's hidden states there into `LogprobsTensors`, a slice at
a time so that a long chunk never holds [T, V] logits at once; `split` reads them to the host,
per chunk, at the caller's read point (the prefill node's or the engine's, never the decode
loop's). A step that computes them runs eagerly (no prefill graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.request import PrefillChunk, TokenLogprob
from engine.sampling.sampler import LogprobsTensors, compute_logprobs
from engine.sampling.sampling_params import SamplingParams

SLICE = 256  # positions whose logits are made at once


@dataclass(frozen=True)
class PromptLogprobPlan:
    slots: list[int]  # the step's token slots whose logits give a prompt logprob
    targets: list[int]  # the prompt token each one predicts
    counts: list[int]  # per chunk of the step, how many (0 where none was asked)
    num_top: int


def plan(chunks: list[PrefillChunk]) -> PromptLogprobPlan | None:
    """What `chunks` (one step, in order) need; None when no chunk's request asked."""
    if all(c.params.prompt_logprobs is None for c in chunks):
        return None
    slots, targets, counts, at = [], [], [], 0
    for c in chunks:
        positions = range(c.start, min(c.end, len(c.prompt) - 1)) if c.params.prompt_logprobs is not None else ()
        slots += [at + p - c.start for p in positions]
        targets += [c.prompt[p + 1] for p in positions]
        counts.append(len(positions))
        at += c.end - c.start
    num_top = max(c.params.prompt_logprobs or 0 for c in chunks)
    return PromptLogprobPlan(slots, targets, counts, num_top)


def compute(model: Any, hidden: torch.Tensor, p: PromptLogprobPlan) -> LogprobsTensors:
    """Logprobs of `p.targets` from the step's `hidden` [T, H] at `p.slots` (none read to the host)."""
    parts = []
    for i in range(0, len(p.slots), SLICE):
        idx = _h2d(p.slots[i : i + SLICE], hidden.device)
        logits = model.compute_logits(hidden.index_select(0, idx))
        parts.append(compute_logprobs(logits, _h2d(p.targets[i : i + SLICE], hidden.device), p.num_top))
    if not parts:
        empty = torch.empty(0, dtype=torch.long, device=hidden.device)
        return LogprobsTensors(empty.float(), empty, empty.view(0, p.num_top), empty.float().view(0, p.num_top))
    return LogprobsTensors(*(torch.cat(cols) for cols in zip(*(_cols(x) for x in parts), strict=True)))


def _cols(lp: LogprobsTensors) -> tuple[torch.Tensor, ...]:
    return (lp.token_logprob, lp.token_rank, lp.top_ids, lp.top_logprobs)


def _h2d(values: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(values, dtype=torch.long)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def split(lp: LogprobsTensors, p: PromptLogprobPlan, num_top: list[int]) -> list[list[TokenLogprob]]:
    """Host entries per chunk (reads the device: the caller's read point); chunk i keeps its
    request's `num_top[i]` alternatives."""
    vals, ranks = lp.token_logprob.tolist(), lp.token_rank.tolist()
    ids, tops = lp.top_ids.tolist(), lp.top_logprobs.tolist()
    out, at = [], 0
    for count, n in zip(p.counts, num_top, strict=True):
        out.append([TokenLogprob(p.targets[j], vals[j], ranks[j], list(zip(ids[j][:n], tops[j][:n], strict=True)))
                    for j in range(at, at + count)])
        at += count
    return out


class _Asks(Protocol):
    params: SamplingParams
    prompt_logprobs: list[TokenLogprob] | None


class _StepLogprobs(Protocol):
    """What a prefill step's output carries of its prompt logprobs (ModelRunner's PrefillOutput)."""

    @property
    def prompt_logprobs(self) -> LogprobsTensors | None: ...
    @property
    def prompt_lp_plan(self) -> PromptLogprobPlan | None: ...


def add_prompt_logprobs(out: _StepLogprobs, owners: Sequence[_Asks]) -> None:
    """Append a step's prompt logprobs to the requests (or prefill jobs) of its chunks, in order."""
    if out.prompt_logprobs is None or out.prompt_lp_plan is None:
        return
    tops = [o.params.prompt_logprobs or 0 for o in owners]
    for owner, entries in zip(owners, split(out.prompt_logprobs, out.prompt_lp_plan, tops), strict=True):
        if owner.params.prompt_logprobs is not None:
            owner.prompt_logprobs = (owner.prompt_logprobs or []) + entries
