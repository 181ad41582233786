"""Tensor parallelism: a transform applied to a built, loaded `CausalLM` (gpt-fast style).

Receives a model holding the full weights on every rank of a TP group and the group
(`TPGroup`); shards it in place, so the model code (engine/model/llama.py) stays single-device:
  * attention: q/k/v column-parallel by heads, o_proj row-parallel. KV heads are split
    across ranks (whole GQA groups per rank; a group's query heads split over several ranks,
    its KV head replicated, when there are fewer KV heads than ranks); heads may divide
    unevenly (SmolLM2: 9 query / 3 KV heads over 2 ranks), so ranks may hold different counts;
  * MLP: gate/up column-parallel, down_proj row-parallel (the MTP block the same way);
  * embedding and LM head vocab-parallel (tied ones share their shard): a lookup is a masked
    local lookup and an all-reduce; logits are all-gathered; a greedy argmax is distributed
    (each rank's best, then the best of those: the lowest id on ties, as a single device);
  * the MTP's eh_proj, norms and the rotary tables stay replicated; so does a draft
    vocabulary's head (built before this transform: engine/engine.py `build_runner`).
A row-parallel GEMM keeps its fused residual add on rank 0 alone, so the all-reduce of the
ranks' partial sums is the layer's output (`all_reduce(o_proj(attn) + (x on rank 0))`): no
separate add. On GPUs those all-reduces go through symmetric memory, one kernel each
(engine/tp/allreduce.py).

Hands on the model with `config` replaced by the rank's local view (its query and KV head
counts: the runner sizes this rank's KV cache from it), the whole model's as `full_config`
(what every rank sizes its block count from, so they agree), and `TPGroup` on it as `tp`. After
every collective every rank holds the same tensor, so every rank samples the same tokens
(counter-based noise); rank 0 alone reports them (engine/tp/launch.py).

Careful when editing: every rank must issue the same collectives in the same order, so
nothing here may branch on the rank except the shard boundaries and what a rank adds into its
own partial sums (`TPGroup.residual`); and fused projections
(`fuse_projections`) are views into one tensor: sharding unfuses, shards, then refuses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.model.config import ArchConfig
from engine.model.llama import MLP, Attention, CausalLM, DecoderLayer, RMSNorm, fuse_projections
from engine.tp.allreduce import SymmAllReduce
from engine.tp.allreduce import make as make_all_reduce
from kernels.linear import Norm, TokenMask, linear, linear_glu
from kernels.norm import forget_row_sumsq
from kernels.token_mask import mask_rows


@dataclass(frozen=True)
class TPGroup:
    """This process's place in a TP group and the torch.distributed group it talks over."""

    rank: int
    size: int
    group: Any = None  # a ProcessGroup; None: the default (world) group
    fast: SymmAllReduce | None = None  # GPUs: the one-shot all-reduce (engine/tp/allreduce.py)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks, in place; every rank gets the same tensor. Row sums of
        squares a GEMM left on this rank's partial `x` (kernels/linear.py) no longer hold."""
        forget_row_sumsq(x)
        if self.fast is not None and self.fast.accepts(x):
            return self.fast(x)
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def residual(self, x: torch.Tensor) -> torch.Tensor | None:
        """What this rank adds to its partial sums of a row-parallel GEMM: the residual stream
        on rank 0 alone, so the all-reduce of the partial sums is the layer's output."""
        return x if self.rank == 0 else None

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `x` (same shape on each), in rank order."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return parts


# ---------------------------------------------------------------- the plan


@dataclass(frozen=True)
class Shard:
    """What one rank holds, as global index ranges."""

    q_heads: range
    kv_heads: range
    vocab: range


def _even(n: int, size: int, rank: int) -> range:
    """Rank `rank`'s share of n items split over `size` ranks (sizes differ by at most one)."""
    return range(rank * n // size, (rank + 1) * n // size)


def head_split(heads: int, kv_heads: int, size: int, rank: int) -> tuple[range, range]:
    """(query heads, KV heads) of a rank: whole GQA groups while there are as many KV heads as
    ranks; else each KV head is replicated on size/kv_heads ranks that split its query heads."""
    group = heads // kv_heads
    if kv_heads >= size:
        kv = _even(kv_heads, size, rank)
        return range(kv.start * group, kv.stop * group), kv
    per = size // kv_heads
    if size % kv_heads or group < per:
        raise ValueError(f"cannot split {heads} query / {kv_heads} KV heads over {size} ranks "
                         f"(with fewer KV heads than ranks, the ranks must divide evenly among them)")
    head, part = divmod(rank, per)
    q = _even(group, per, part)
    return range(head * group + q.start, head * group + q.stop), range(head, head + 1)


def plan(config: ArchConfig, size: int, rank: int) -> Shard:
    """The shard of `rank` in a group of `size`; raises a clear error for sizes that do not fit."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"tensor parallel size must be a power of two, got {size}")
    if config.vocab_size % size:
        raise ValueError(f"vocabulary of {config.vocab_size} does not split over {size} ranks")
    q, kv = head_split(config.num_attention_heads, config.num_key_value_heads, size, rank)
    return Shard(q, kv, _even(config.vocab_size, size, rank))


def max_kv_heads(config: ArchConfig, size: int) -> int:
    """The most KV heads any rank holds: every rank sizes its cache's block count from it, so
    the ranks' block managers (and schedulers) agree."""
    return max(len(plan(config, size, r).kv_heads) for r in range(size))


def check_tp_size(config: ArchConfig, size: int) -> None:
    """Plan every rank's shard: raises plan's clear error for a size the model does not split
    over (not a power of two, its vocabulary or its heads). Launchers call it before any rank
    starts, so a bad size is one error line, not N processes failing."""
    for rank in range(max(size, 1)):
        plan(config, size, rank)


def full_config(model: CausalLM) -> ArchConfig:
    """The whole model's config, also when `model` is already sharded (its `config` is then
    the rank's local view)."""
    return model.full_config if isinstance(model, TPCausalLM) else model.config


# ---------------------------------------------------------------- parallel modules


class TPAttention(Attention):
    """Attention over this rank's heads; o_proj's partial sums all-reduced, then the residual."""

    tp: TPGroup

    def forward(self, positions, x, kv_cache, meta, backend, norm):
        t = x.shape[0]
        q, k, v = self._project(x, norm)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        out = backend.rope_forward(self.rotary[0], positions, q, k, v, kv_cache, meta, self.scale)
        return self.tp.all_reduce(linear(out.reshape(t, -1), self.o_proj.weight, residual=self.tp.residual(x)))


class TPMLP(MLP):
    """The MLP over this rank's intermediate columns; down_proj's partial sums all-reduced."""

    tp: TPGroup

    def forward(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        if self.gate_up is not None:
            act = linear_glu(x, self.gate_up, norm=norm.spec)
        else:
            h = norm(x)
            act = F.silu(self.gate_proj(h)) * self.up_proj(h)
        return self.tp.all_reduce(linear(act, self.down_proj.weight, residual=self.tp.residual(x)))


class VocabParallelEmbedding(nn.Module):
    """Rows `vocab` of the embedding; ids outside it look up zeros, the all-reduce fills them."""

    def __init__(self, weight: nn.Parameter, vocab: range, tp: TPGroup) -> None:
        super().__init__()
        self.weight, self.start, self.tp = weight, vocab.start, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(nn.Module):
    """Rows `vocab` of the LM head: logits all-gathered, or a distributed argmax."""

    def __init__(self, weight: nn.Parameter, vocab: range, tp: TPGroup) -> None:
        super().__init__()
        self.weight, self.start, self.tp = weight, vocab.start, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """Full logits [..., V] on every rank."""
        return torch.cat(self.tp.all_gather(linear(h, self.weight)), dim=-1)

    def argmax(self, h: torch.Tensor, norm: Norm | None = None) -> torch.Tensor:
        """forward(norm(h)).argmax(-1), the first id on ties, gathering two numbers per row."""
        best, at = linear(h, self.weight, norm=norm).float().max(dim=-1)
        mine = torch.stack([best, (at + self.start).float()], dim=-1)  # ids < 2**24: exact in fp32
        every = torch.stack(self.tp.all_gather(mine), dim=-2)  # [..., size, 2]
        rank = every[..., 0].argmax(dim=-1, keepdim=True)  # first rank on ties: the lowest id
        return every[..., 1].gather(-1, rank).squeeze(-1).long()


class TPCausalLM(CausalLM):
    """A sharded CausalLM: the greedy paths take the distributed argmax."""

    tp: TPGroup
    full_config: ArchConfig  # before sharding (`config` is this rank's view)
    lm_head: ParallelLMHead  # type: ignore[assignment]

    def greedy_ids(self, hidden: torch.Tensor, mask: TokenMask | None = None) -> torch.Tensor:
        if mask is not None:  # the grammar's bits cover the whole vocabulary: the gathered logits, masked
            rows, bits = mask
            logits = self.compute_logits(hidden, float32=False)
            masked = mask_rows(logits.view(rows.shape[0], -1, logits.shape[-1]), rows, bits)
            return masked.argmax(-1).view(hidden.shape[:-1])
        return self.lm_head.argmax(hidden[..., : self.config.hidden_size])

    def mtp_greedy_ids(self, mtp_hidden: torch.Tensor, head_weight: torch.Tensor | None = None,
                       id_map: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if head_weight is not None:  # a draft vocabulary's head: replicated, scored locally
            return super().mtp_greedy_ids(mtp_hidden, head_weight, id_map, out)
        assert self.mtp is not None
        ids = self.lm_head.argmax(mtp_hidden, norm=self.mtp.shared_head.norm.spec)
        return out.copy_(ids) if out is not None else ids


# ---------------------------------------------------------------- the transform


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.detach().clone(), requires_grad=False)  # a clone: drop the full tensor


def _shard_rows(lin: nn.Linear, rows: range) -> None:
    lin.weight = _param(lin.weight[rows.start : rows.stop])
    if lin.bias is not None:
        lin.bias = _param(lin.bias[rows.start : rows.stop])
    lin.out_features = len(rows)


def _shard_cols(lin: nn.Linear, cols: range) -> None:
    lin.weight = _param(lin.weight[:, cols.start : cols.stop])
    lin.in_features = len(cols)


def _scaled(r: range, k: int) -> range:
    return range(r.start * k, r.stop * k)


def _shard_layer(layer: DecoderLayer, shard: Shard, tp: TPGroup) -> None:
    a, m = layer.self_attn, layer.mlp
    a.qkv, m.gate_up = None, None  # unfused; `apply_tensor_parallel` fuses the shards again
    d = a.head_dim
    _shard_rows(a.q_proj, _scaled(shard.q_heads, d))
    _shard_rows(a.k_proj, _scaled(shard.kv_heads, d))
    _shard_rows(a.v_proj, _scaled(shard.kv_heads, d))
    _shard_cols(a.o_proj, _scaled(shard.q_heads, d))
    a.num_heads, a.num_kv_heads = len(shard.q_heads), len(shard.kv_heads)
    inter = _even(m.gate_proj.out_features, tp.size, tp.rank)
    _shard_rows(m.gate_proj, inter)
    _shard_rows(m.up_proj, inter)
    _shard_cols(m.down_proj, inter)
    _become(a, TPAttention, tp)
    _become(m, TPMLP, tp)


def _become(module: nn.Module, cls: type[nn.Module], tp: TPGroup) -> None:
    """Turn `module` into its TP subclass `cls` in place: the same state, the TP forward."""
    module.__class__ = cls
    object.__setattr__(module, "tp", tp)  # a plain attribute (nn.Module's setattr is typed for tensors)


def _shard_vocab(model: CausalLM, shard: Shard, tp: TPGroup) -> None:
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    v = shard.vocab
    embed = _param(model.model.embed_tokens.weight[v.start : v.stop])
    head = embed if tied else _param(model.lm_head.weight[v.start : v.stop])
    model.model.embed_tokens = VocabParallelEmbedding(embed, v, tp)  # type: ignore[assignment]
    model.lm_head = ParallelLMHead(head, v, tp)  # type: ignore[assignment]


def apply_tensor_parallel(model: CausalLM, tp: TPGroup) -> TPCausalLM:
    """Shard `model` (full weights, on this rank's device) in place for rank `tp.rank` of
    `tp.size`; returns it as a TPCausalLM (as it is when already sharded so). Inference only."""
    if isinstance(model, TPCausalLM):
        if (model.tp.rank, model.tp.size) != (tp.rank, tp.size):
            raise ValueError(f"the model is already sharded for rank {model.tp.rank} of {model.tp.size}")
        return model  # already sharded for this rank (a second engine on the same loaded model)
    shard = plan(model.config, tp.size, tp.rank)
    weight = model.model.embed_tokens.weight
    tp = dataclasses.replace(tp, fast=make_all_reduce(tp.group, tp.size, weight.device, weight.dtype))
    fused = model.model.layers[0].self_attn.qkv is not None  # type: ignore[union-attr]
    layers: list[DecoderLayer] = [*model.model.layers]  # type: ignore[list-item]
    if model.mtp is not None:
        layers.append(model.mtp.block)
    with torch.no_grad():
        for layer in layers:
            _shard_layer(layer, shard, tp)
        _shard_vocab(model, shard, tp)
    whole = model.config
    model.config = dataclasses.replace(whole, num_attention_heads=len(shard.q_heads),
                                       num_key_value_heads=len(shard.kv_heads))
    _become(model, TPCausalLM, tp)
    object.__setattr__(model, "full_config", whole)
    if fused:
        fuse_projections(model)
    return model  # type: ignore[return-value]

