"""Speculative verification: decides which MTP draft tokens a decode step keeps.

Receives, per sequence b of a batch of B: the target's logits at the k+1 verify positions
`[B, k+1, V]` (position i scores the token after [last token, d_1..d_i]), the k draft tokens
`[B, k]`, the draft distributions they were drawn from `[B, k, V]` (None when every row is
greedy), one `SamplingTensors` row per sequence, and `positions[b]`, the sequence position of
the token that verify position 0 predicts (draft i lands at positions[b] + i).
Hands on: `tokens [B, k+1]` int64 whose first `num_emitted[b]` entries are the emitted tokens
(accepted drafts, then one target token) and -1 after, and `num_emitted [B]` in 1..k+1,
both on the device; the host reads them a step later from pinned buffers.

Greedy rows emit exactly what plain greedy decoding would (target argmax, first index on
ties). Sampled rows use rejection sampling (Leviathan et al. 2023, Chen et al. 2023), which
keeps the target's processed distribution exactly. Its noise is counter-based
(`engine.sampling.sampler.uniform_noise`): STREAM_ACCEPT at a draft's position for its accept test,
STREAM_SAMPLE at the emitted position for the residual or bonus token, so results do not
depend on batch composition or on which node runs the step.

Must never: sync with the device (no `.item()`, `.tolist()`, boolean-mask indexing, python
loops over rows, value-dependent shapes); `verify` branches only on the host flag
`st.all_greedy`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from engine.sampling.sampler import (
    STREAM_ACCEPT,
    STREAM_SAMPLE,
    SamplingTensors,
    processed_probs,
    race,
    uniform_noise,
)


def verify(
    target_logits: Tensor,
    draft_tokens: Tensor,
    draft_probs: Tensor | None,
    st: SamplingTensors,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """(tokens [B, k+1], num_emitted [B]): greedy verification when every row is greedy,
    else rejection sampling (which handles greedy rows too)."""
    if st.all_greedy:
        return verify_greedy(target_logits, draft_tokens)
    if draft_probs is None:
        raise ValueError("draft_probs is required when some row samples (temperature > 0)")
    return verify_rejection(target_logits, draft_probs, draft_tokens, st, positions)


def verify_greedy(target_logits: Tensor, draft_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """Accept drafts while they equal the target argmax; then emit the argmax at the first
    mismatch (or the bonus position k when all match)."""
    target_ids = target_logits.argmax(dim=-1)  # [B, k+1]
    k = draft_tokens.shape[1]
    matches = draft_tokens.to(torch.int64) == target_ids[:, :k]
    num_accepted = _leading_true(matches)
    return _emit(target_ids, num_accepted)


def verify_rejection(
    target_logits: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    st: SamplingTensors,
    positions: Tensor,
) -> tuple[Tensor, Tensor]:
    """Rejection sampling against the processed target distribution; `st` has one row per
    sequence. Greedy rows get exactly `verify_greedy`'s result."""
    batch, k1, vocab = target_logits.shape
    k = k1 - 1
    drafts = draft_tokens.to(torch.int64)
    p_draft = draft_probs.to(torch.float32)
    p_target = processed_probs(target_logits.reshape(batch * k1, vocab), st.repeat_interleave(k1))
    p_target = p_target.view(batch, k1, vocab)
    num_accepted = _num_accepted(p_target[:, :k], p_draft, drafts, st, positions)
    final = _final_token(p_target, p_draft, num_accepted, st, positions)
    tokens = torch.cat([drafts, final[:, None]], dim=1)  # [B, k+1]; final parked at column k
    tokens = tokens.scatter(1, num_accepted[:, None], final[:, None])
    tokens, num_emitted = _emit(tokens, num_accepted)
    # Greedy rows would come out the same given one-hot draft_probs; override so that any
    # draft_probs the caller passes for them cannot change greedy output.
    greedy_tokens, greedy_emitted = verify_greedy(target_logits, draft_tokens)
    greedy = st.temperature <= 0
    tokens = torch.where(greedy[:, None], greedy_tokens, tokens)
    return tokens, torch.where(greedy, greedy_emitted, num_emitted)


def _num_accepted(
    p_target: Tensor, p_draft: Tensor, drafts: Tensor, st: SamplingTensors, positions: Tensor
) -> Tensor:
    """[B] number of leading drafts accepted: draft i passes when u_i * p_d(d_i) <= p_t(d_i)
    (u_i <= p_t / p_d without dividing) and p_t(d_i) > 0."""
    k = drafts.shape[1]
    pt = p_target.gather(-1, drafts[..., None])[..., 0]  # [B, k]
    pd = p_draft.gather(-1, drafts[..., None])[..., 0]
    draft_pos = positions.to(torch.int64)[:, None] + torch.arange(k, device=drafts.device)
    u = _uniform_noise_rows(st.seed, draft_pos, STREAM_ACCEPT)
    return _leading_true((u * pd <= pt) & (pt > 0))


def _final_token(
    p_target: Tensor, p_draft: Tensor, num_accepted: Tensor, st: SamplingTensors, positions: Tensor
) -> Tensor:
    """[B] the token after the accepted drafts: a draw from normalize(max(p_t - p_d, 0)) at the
    rejected position (p_t itself if that is all zero), or from p_t[k] (the bonus)."""
    batch, k1, vocab = p_target.shape
    index = num_accepted[:, None, None].expand(batch, 1, vocab)
    pt = p_target.gather(1, index)[:, 0]  # [B, V] at the emitted position
    pad = p_draft.new_zeros(batch, 1, vocab)  # no draft at the bonus position
    pd = torch.cat([p_draft, pad], dim=1).gather(1, index)[:, 0]
    residual = (pt - pd).clamp(min=0)
    empty = residual.sum(dim=-1, keepdim=True) <= 0
    weights = torch.where(empty, pt, residual)
    return race(weights, st.seed, positions.to(torch.int64) + num_accepted, STREAM_SAMPLE)


def _uniform_noise_rows(seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """uniform_noise for a [B, n] grid of positions, each row b with seed[b]."""
    flat_seed = seed[:, None].expand_as(position).reshape(-1)
    return uniform_noise(flat_seed, position.reshape(-1), stream).view(position.shape)


def _leading_true(mask: Tensor) -> Tensor:
    """[B] int64 length of each row's leading run of True."""
    return torch.cumprod(mask.to(torch.int64), dim=1).sum(dim=1)


def _emit(tokens: Tensor, num_accepted: Tensor) -> tuple[Tensor, Tensor]:
    """Keep columns 0..num_accepted of `tokens` [B, k+1], -1 after; num_emitted = accepted + 1."""
    cols = torch.arange(tokens.shape[1], device=tokens.device)
    kept = cols[None, :] <= num_accepted[:, None]
    return torch.where(kept, tokens, torch.full_like(tokens, -1)), num_accepted + 1
