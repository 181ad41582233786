"""Stage 2 of `pdserve train-mtp`, the training forward: the frozen target's dense causal pass
and the MTP module's chained levels over the same sequence, through dense attention backends
that reuse the modules' own code (a test checks them against the engine's paged path), and
the per-level losses against the target's distribution."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from engine.model.attention import AttentionBackend
from engine.model.llama import CausalLM
from mtp.dense_sampler import SDPA_BACKENDS


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: tuple[int, int], scale: float,
            mask: torch.Tensor | None) -> torch.Tensor:
    """q: [B*L, Hq, D]; k, v: [B, S, Hkv, D] -> [B*L, Hq, D] (mask None: causal, S = L)."""
    b, n = shape
    hq, d = q.shape[1], q.shape[2]
    group = hq // k.shape[2]
    qb = q.view(b, n, hq, d).transpose(1, 2)
    kb = k.repeat_interleave(group, dim=2).transpose(1, 2).to(qb.dtype)
    vb = v.repeat_interleave(group, dim=2).transpose(1, 2).to(qb.dtype)
    with sdpa_kernel(SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale)
    return out.transpose(1, 2).reshape(b * n, hq, d)


class DenseCausalAttention(AttentionBackend):
    """Plain causal attention over a [batch, length] block of sequences; no KV cache."""

    def __init__(self, batch: int, length: int) -> None:
        self.shape = (batch, length)

    def forward(self, q, k, v, kv_cache, meta, scale):
        b, n = self.shape
        return _attend(q, k.view(b, n, *k.shape[1:]), v.view(b, n, *v.shape[1:]), self.shape, scale, None)


def chain_mask(level: int, length: int, device: torch.device) -> torch.Tensor:
    """[L, level*L] bool: level-1 keys at indices <= i, and index i's key of each later level."""
    idx = torch.arange(length, device=device)
    blocks = [idx.view(-1, 1) >= idx.view(1, -1)]
    blocks += [idx.view(-1, 1) == idx.view(1, -1)] * (level - 1)
    return torch.cat(blocks, dim=1)


class ChainAttention(AttentionBackend):
    """The MTP layer's attention over `levels` chained calls, as the engine's paged cache sees it.

    The engine writes level-1 keys for every verified position, then each chain step j at
    position p+j-1 overwrites that position with its own key; so level j at index i attends
    to level-1 keys at indices 0..i and to the keys of levels 2..j at index i. One instance
    per batch: call it once per level, in order."""

    def __init__(self, batch: int, length: int) -> None:
        self.shape = (batch, length)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def forward(self, q, k, v, kv_cache, meta, scale):
        b, n = self.shape
        self.keys.append(k.view(b, n, *k.shape[1:]))
        self.values.append(v.view(b, n, *v.shape[1:]))
        if len(self.keys) == 1:
            return _attend(q, self.keys[0], self.values[0], self.shape, scale, None)
        mask = chain_mask(len(self.keys), n, q.device)
        return _attend(q, torch.cat(self.keys, 1), torch.cat(self.values, 1), self.shape, scale, mask)


def target_hidden(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The target's final normed hidden states [B, L, H] for a padded id block [B, L]."""
    b, n = ids.shape
    pos = torch.arange(n, device=ids.device).repeat(b)
    with torch.no_grad():
        h = model(ids.reshape(-1), pos, [None] * model.num_layers, None, DenseCausalAttention(b, n))
    return h.view(b, n, -1)


def shift_left(ids: torch.Tensor, j: int) -> torch.Tensor:
    """ids[:, i + j] at index i (zeros past the end)."""
    return F.pad(ids[:, j:], (0, j))


def mtp_chain(model: CausalLM, ids: torch.Tensor, hidden: torch.Tensor, levels: int) -> list[torch.Tensor]:
    """Pre-norm MTP outputs [B, L, H] of chain levels 1..levels (level j: token at i+j, pos i+j-1)."""
    b, n = ids.shape
    attn = ChainAttention(b, n)
    base = torch.arange(n, device=ids.device).repeat(b)
    h_prev, outs = hidden.reshape(b * n, -1), []
    for j in range(1, levels + 1):
        nxt = shift_left(ids, j).reshape(-1)
        h_prev = model.mtp_forward(nxt, base + j - 1, h_prev, None, None, attn)
        outs.append(h_prev.view(b, n, -1))
    return outs


def _level_loss(model: CausalLM, mtp_h: torch.Tensor, tgt_h: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Cross-entropy of the MTP's distribution against the target's (soft labels; its gradient
    is KL's), the KL itself and the top-1 agreement (no grad), averaged over rows."""
    logits = model.mtp_logits(mtp_h)
    if logits.shape[0] == 0:  # no answer position at this level in the batch
        zero = logits.sum()
        return zero, zero.detach(), zero.detach()
    with torch.no_grad():
        logp = torch.log_softmax(model.compute_logits(tgt_h), dim=-1)
        p = logp.exp()
        entropy = -(p * logp).sum(-1).mean()
        agree = (logits.argmax(-1) == logp.argmax(-1)).float().mean()
    ce = F.cross_entropy(logits, p)
    return ce, ce.detach() - entropy, agree


def chain_losses(model: CausalLM, ids: torch.Tensor, lengths: torch.Tensor, levels: int,
                 starts: torch.Tensor | None = None) -> tuple[list[torch.Tensor], ...]:
    """Per-level loss, KL and top-1 agreement on a padded batch. Level j at index i predicts the
    token at i+j+1 from the target's state at i+j; it counts when that state is neither the
    row's last (nothing follows it) nor before `starts` (the answer's first index: drafts are
    only ever made for answer tokens after the first)."""
    hidden = target_hidden(model, ids)
    outs = mtp_chain(model, ids, hidden, levels)
    idx = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    first = starts.unsqueeze(1) if starts is not None else torch.zeros_like(lengths).unsqueeze(1)
    losses, kls, agrees = [], [], []
    for j, out in enumerate(outs, start=1):
        valid = (idx + j < lengths.unsqueeze(1) - 1) & (idx + j >= first)
        tgt = F.pad(hidden[:, j:], (0, 0, 0, j))  # the target's state at i+j
        loss, kl, agree = _level_loss(model, out[valid], tgt[valid])
        losses.append(loss)
        kls.append(kl)
        agrees.append(agree)
    return losses, kls, agrees
