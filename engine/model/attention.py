"""Attention over the paged KV cache: the backend interface and the pure-torch reference.

A step's tokens arrive flattened ([T, heads, head_dim]). `AttentionMetadata` says where each
token's K/V goes in the cache (`slot_mapping`), its position in its sequence, and which
request row and column of a padded [rows, max_q] layout it occupies. A query at position p
attends to every cached key of its request at positions <= p (so a verify block of k+1
tokens is causal inside itself, and prefill chunks see the earlier chunks).

Cache layout per layer: one tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = K, 1 = V). Block 0 is the trash block: padding and masked rows write there.
Nothing here syncs with the device; all shapes come from host-known integers.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kernels._dispatch import invariant
from kernels.flash_prefill import flash_prefill
from kernels.flash_varlen import flash_varlen_usable
from kernels.norm import rms_norm, row_sumsq_of
from kernels.paged_attention import NewKV, paged_attention, paged_attention_rope
from kernels.qkv_rope import qkv_rope
from kernels.qkv_rope import usable as qkv_rope_usable
from kernels.rotary import rope_and_cache, rope_and_cache_with_k, write_kv

TRASH_BLOCK = 0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset
    positions: torch.Tensor  # [T] int64: position of each token in its sequence
    block_tables: torch.Tensor  # [R, max_blocks] int64: rows' block ids (pad: TRASH_BLOCK)
    token_row: torch.Tensor  # [T] int64: which row each token belongs to
    token_col: torch.Tensor  # [T] int64: column of the token in the padded [R, max_q] layout
    max_q: int  # host-known: the longest query of any row
    num_kv_blocks: int  # host-known: how many block-table columns to read (covers every position)
    seq_lens: torch.Tensor | None = None  # [R] int64: keys per row after this step's writes
    query_start: torch.Tensor | None = None  # [R+1] int64: row r's tokens are [start[r], start[r+1])
    num_splits: int = 1  # host-known: split-KV partitions per row (flash-decoding)
    fresh: bool = False  # host-known: no row has keys before this step's (a prompt's first chunk):
    #                      attention may read this step's K/V directly instead of the cache
    cu_seqlens: torch.Tensor | None = None  # query_start as int32 (flash attention's), fresh steps

    @property
    def num_rows(self) -> int:
        return int(self.block_tables.shape[0])


class AttentionBackend(ABC):
    """Writes this step's K/V into the cache, then attends. Called once per layer per step."""

    def rope_forward(self, rope, positions, q, k, v, kv_cache, meta: AttentionMetadata, scale: float):
        """Rotary embedding on q and k, then `forward`; a backend may fuse the two."""
        return self.forward(rope(positions, q), rope(positions, k), v, kv_cache, meta, scale)

    def project_forward(self, x, norm: tuple[torch.Tensor | None, float], qkv: tuple[torch.Tensor, torch.Tensor | None],
                        heads: tuple[int, int, int], rope, positions, kv_cache, meta: AttentionMetadata,
                        scale: float) -> torch.Tensor | None:
        """attention(q, k, v) with q, k, v = split(norm(x) @ w.T + b) rotated, from the residual
        stream x and the fused projection `qkv` = (w, b), where this backend fuses the projection
        with rotary and the cache write for this step; None where it does not (the caller projects,
        then calls `rope_forward`). `heads` = (Hq, Hkv, D)."""
        return None

    @abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; returns [T, Hq, D]."""


class TorchAttention(AttentionBackend):
    """Reference backend: gathers each row's blocks into a padded tensor and runs masked SDPA;
    in batch-invariant mode, one token at a time over exactly its visible keys."""

    def forward(self, q, k, v, kv_cache, meta, scale):
        write_kv(kv_cache, k, v, meta.slot_mapping)
        if invariant():
            return attend_per_token(q, kv_cache, meta, scale)
        rows, max_q = meta.num_rows, meta.max_q
        _, _, block_size, hkv, dim = kv_cache.shape
        hq = q.shape[1]
        tables = meta.block_tables[:, : meta.num_kv_blocks]
        keys = kv_cache[0][tables].reshape(rows, -1, hkv, dim)  # [R, S, Hkv, D]
        values = kv_cache[1][tables].reshape(rows, -1, hkv, dim)
        qp = q.new_zeros(rows, max_q, hq, dim)
        qp[meta.token_row, meta.token_col] = q
        qpos = torch.full((rows, max_q), -1, dtype=torch.long, device=q.device)
        qpos[meta.token_row, meta.token_col] = meta.positions
        kpos = torch.arange(keys.shape[1], device=q.device)
        mask = kpos.view(1, 1, -1) <= qpos.unsqueeze(-1)  # [R, max_q, S]
        group = hq // hkv
        keys = keys.repeat_interleave(group, dim=2).transpose(1, 2).float()  # [R, Hq, S, D]
        values = values.repeat_interleave(group, dim=2).transpose(1, 2).float()
        scores = torch.matmul(qp.transpose(1, 2).float(), keys.transpose(-1, -2)) * scale
        scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        # rows of padding have no visible key; keep them finite
        scores = scores.masked_fill(~mask.any(-1, keepdim=True).unsqueeze(1), 0.0)
        probs = torch.softmax(scores, dim=-1)
        out = torch.matmul(probs, values).transpose(1, 2)  # [R, max_q, Hq, D]
        return out[meta.token_row, meta.token_col].to(q.dtype)


class TritonAttention(AttentionBackend):
    """The GPU path: rotary fused with the K/V write, then paged attention over the cache
    (`kernels/`). Needs `meta.seq_lens` and `meta.query_start`. Off CUDA the kernels' launchers
    run their torch references, so this backend also runs (slowly) on the CPU.

    A fresh prefill step (`meta.fresh`: no cached prefix) in 16-bit on CUDA attends over the
    step's own rotated K/V with a Triton flash kernel (kernels/flash_prefill.py: inside the prefill
    graph it beats torch's flash attention 2, kernels/flash_varlen.py, whose call also converts
    the lengths and clears its outputs; where that one is usable, so is this); the
    paged kernel serves chunked prefill over earlier chunks, cached prefixes, fp32, and the
    batch-invariant mode (whose reduction order must match decode's)."""

    def rope_forward(self, rope, positions, q, k, v, kv_cache, meta, scale):
        if meta.fresh and not invariant() and flash_varlen_usable(q, kv_cache):
            q, k = rope_and_cache_with_k(q, k, v, positions, rope.cos, rope.sin, kv_cache, meta.slot_mapping)
            return self._attend_fresh(q, k, v, meta, scale)
        if not invariant():  # rotary and the K/V write inside the attention kernel: one launch fewer a layer
            assert meta.seq_lens is not None and meta.query_start is not None, "metadata lacks seq_lens"
            new = NewKV(k, v, positions, rope.cos, rope.sin, meta.slot_mapping)
            return paged_attention_rope(q, new, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start,
                                        meta.max_q, scale, meta.num_splits)
        q = rope_and_cache(q, k, v, positions, rope.cos, rope.sin, kv_cache, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale)

    def project_forward(self, x, norm, qkv, heads, rope, positions, kv_cache, meta, scale):
        """Fresh 16-bit steps on CUDA: rms_norm, then one GEMM with rotary and the K/V write in its
        epilogue (kernels/qkv_rope.py; a norm folded into w runs in the GEMM too, where the GEMM
        that wrote x left its rows' sums of squares), then the fresh-step attention on its output."""
        hq, hkv, d = heads
        usable = flash_varlen_usable(x[:, :d], kv_cache)  # x's dtype and device; heads of d
        if not (meta.fresh and not invariant() and usable and qkv_rope_usable(x, qkv[0], d)):
            return None
        weight, eps = norm
        partials = row_sumsq_of(x) if weight is None else None  # left by the GEMM that wrote x
        h = x if partials is not None else rms_norm(x, weight, eps)
        w, b = qkv
        out = qkv_rope(h.reshape(-1, h.shape[-1]), w, b, heads, positions, rope.cos, rope.sin, kv_cache,
                       meta.slot_mapping, norm=(eps, partials) if partials is not None else None)
        t = out.shape[0]
        q, k, v = out.split([hq * d, hkv * d, hkv * d], dim=-1)
        return self._attend_fresh(q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d), meta, scale)

    @staticmethod
    def _attend_fresh(q, k, v, meta, scale):
        cu = meta.cu_seqlens if meta.cu_seqlens is not None else meta.query_start
        assert cu is not None, "metadata lacks query_start"
        return flash_prefill(q, k, v, cu, meta.max_q, scale)

    def forward(self, q, k, v, kv_cache, meta, scale):
        write_kv(kv_cache, k, v, meta.slot_mapping)
        return self._attend(q, kv_cache, meta, scale)

    @staticmethod
    def _attend(q, kv_cache, meta, scale):
        assert meta.seq_lens is not None and meta.query_start is not None, "metadata lacks seq_lens"
        splits = 1 if invariant() else meta.num_splits  # the split count depends on the batch
        return paged_attention(q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start,
                               meta.max_q, scale, splits)


def attend_per_token(q, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Each query token alone, over its row's keys at positions <= its own (fp32 softmax): its
    result cannot depend on the batch, the row's other queries or the padding. Host loop
    (reads the metadata on the host): the CPU path of `--deterministic`."""
    _, _, block_size, hkv, dim = kv_cache.shape
    group = q.shape[1] // hkv
    out = torch.empty_like(q)
    rows, positions, tables = meta.token_row.tolist(), meta.positions.tolist(), meta.block_tables
    for t, (r, p) in enumerate(zip(rows, positions, strict=True)):
        blocks = tables[r, : p // block_size + 1]
        keys = kv_cache[0][blocks].reshape(-1, hkv, dim)[: p + 1].float().repeat_interleave(group, dim=1)
        values = kv_cache[1][blocks].reshape(-1, hkv, dim)[: p + 1].float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,shd->hs", q[t].float(), keys) * scale
        out[t] = torch.einsum("hs,shd->hd", torch.softmax(scores, dim=-1), values).to(q.dtype)
    return out


_BACKENDS: dict[str, type[AttentionBackend]] = {"torch": TorchAttention, "triton": TritonAttention}


def get_backend(name: str = "torch", device: str = "cpu") -> AttentionBackend:
    """`auto`: Triton on CUDA, the torch reference elsewhere."""
    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    try:
        return _BACKENDS[name]()
    except KeyError:
        raise ValueError(f"unknown attention backend {name!r}; known: auto, {', '.join(sorted(_BACKENDS))}") from None
