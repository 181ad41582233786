"""Frequency-ranked draft vocabulary (FR-Spec, Zhao et al. 2025): MTP drafts score only the
N tokens the model produces most often.

Receives a ranking (every token id of the model by decreasing frequency in text the model
wrote itself; `pdserve draft-vocab` makes it, and a model's ranking ships beside its MTP head
as engine/model/mtp_heads/{name}.vocab_rank.safetensors) and the model's LM head. `DraftVocab.build`
gathers the head's rows for the first N ids once, when the runner is built: a draft step then
reads N x hidden of LM head instead of V x hidden (SmolLM2's tied 49152 x 576 head is ~40% of
the model's bytes, and k chained drafts read it k times). Hands on, per draft step:
  * logits [R, N]: `CausalLM.mtp_logits(h, head_weight=vocab.weight)`;
  * `draft_tokens`: draft ids in the FULL vocabulary (`ids[argmax]` for greedy rows) and, when
    some row samples, the draft distribution over the full vocabulary [R, V].

Why verification stays exact. The target still scores the full vocabulary. Greedy: every
emitted token is the target's argmax; a draft only decides how many are accepted.
Sampling: rejection sampling emits tokens with the target's distribution p whatever the draft
distribution q, provided each draft token was drawn from the q that verification is given.
Here q is the processed (temperature, top-k, top-p) distribution over the N scored tokens,
scattered into zeros [R, V]: a token outside the set has q = 0, so it is never drafted, and at
a rejection the residual max(p - q, 0) equals p there, so the target still emits it with the
right probability. The draft is drawn from that scattered q by the sampler's own race
(counter-based noise indexed by full-vocabulary id, STREAM_DRAFT at the draft's position), so
it equals what a full-vocabulary head would draw had it scored -inf outside the set (tested).

Must never: sync with the device. `draft_tokens` runs in the decode step, inside a CUDA graph:
shapes depend on R, N and V only, no `.item()`, `.tolist()`, `nonzero` or mask indexing.
`weight` is a copy made at build: a transform that replaces the LM head afterwards (tensor
parallelism, quantization) must rebuild the DraftVocab.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor

from engine.sampling.sampler import STREAM_DRAFT, SamplingTensors, processed_probs, race


@dataclass(frozen=True)
class DraftVocab:
    ids: Tensor  # [N] int64 on the device: full-vocabulary ids, most frequent first
    weight: Tensor  # [N, hidden]: the LM head's rows for `ids` (a copy)
    vocab_size: int  # V, the full vocabulary

    @classmethod
    def build(cls, lm_head_weight: Tensor, ranking: Tensor, size: int) -> DraftVocab:
        """The first `size` ids of `ranking` (host or device) and their LM head rows."""
        if not 0 < size <= ranking.shape[0]:
            raise ValueError(f"a draft vocabulary of {size} tokens from a ranking of {ranking.shape[0]} ids")
        ids = ranking[:size].to(device=lm_head_weight.device, dtype=torch.int64)
        return cls(ids, lm_head_weight.detach()[ids].contiguous(), int(lm_head_weight.shape[0]))

    @property
    def size(self) -> int:
        return int(self.ids.shape[0])

    def to_full(self, probs: Tensor) -> Tensor:
        """[R, N] distributions over the set -> [R, V], zero outside it."""
        out = probs.new_zeros(probs.shape[0], self.vocab_size)
        return out.scatter(1, self.ids.expand(probs.shape[0], -1), probs)


def draft_tokens(
    logits: Tensor, st: SamplingTensors, positions: Tensor, vocab: DraftVocab | None, out: Tensor | None = None
) -> tuple[Tensor, Tensor | None]:
    """(draft ids [R] int64 in the full vocabulary, the draft distribution [R, V] they were drawn
    from, or None when every row is greedy). `logits` are [R, V], or [R, N] with `vocab`; the
    ids of a sampled step are written into `out` [R] when given.

    Greedy rows take the argmax (first index on ties: with `vocab`, the most frequent of the
    tied tokens); sampled rows a draw from `processed_probs`, as `engine.sampling.sampler.sample` does.
    """
    greedy = logits.argmax(dim=-1)
    if vocab is not None:
        greedy = vocab.ids[greedy]
    if st.all_greedy:
        return (out.copy_(greedy) if out is not None else greedy), None
    probs = processed_probs(logits, st)
    if vocab is not None:
        probs = vocab.to_full(probs)
    drawn = race(probs, st.seed, positions, STREAM_DRAFT)
    if out is None:
        return torch.where(st.temperature <= 0, greedy, drawn), probs
    return torch.where(st.temperature <= 0, greedy, drawn, out=out), probs


# ---------------------------------------------------------------- the ranking file


def rank_by_count(counts: Tensor) -> Tensor:
    """Every id by decreasing count, ties by increasing id ([V] int64)."""
    return torch.sort(counts.to(torch.int64), descending=True, stable=True).indices


def write_ranking(path: str | Path, counts: Tensor, meta: dict[str, object]) -> Tensor:
    """Rank `counts` [V] and save `ids` (int32 [V], the ranking) and `counts` (int32 [V], in
    ranking order) with `meta` as JSON strings; returns the ranking."""
    ranking = rank_by_count(counts)
    tensors = {"ids": ranking.to(torch.int32), "counts": counts[ranking].clamp(max=2**31 - 1).to(torch.int32)}
    save_file(tensors, str(path), metadata={f"pdserve.{k}": json.dumps(v) for k, v in meta.items()})
    return ranking


def read_ranking(path: str | Path, vocab_size: int) -> Tensor:
    """The ranking in `path` as int64 [L] on the host, checked: distinct ids in 0..V-1."""
    with safe_open(str(path), framework="pt") as f:
        if "ids" not in f.keys():
            raise ValueError(f"{path}: not a vocabulary ranking (no 'ids' tensor)")
        ids = f.get_tensor("ids").to(torch.int64)
    if ids.dim() != 1 or ids.numel() == 0:
        raise ValueError(f"{path}: the ranking must be a non-empty 1-D tensor, got shape {tuple(ids.shape)}")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size or torch.unique(ids).numel() != ids.numel():
        raise ValueError(f"{path}: the ranking must hold distinct token ids in 0..{vocab_size - 1}")
    return ids
