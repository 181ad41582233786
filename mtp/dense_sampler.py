"""Batched sampling for MTP training data: many rows decode in lockstep over a contiguous KV cache.

Training data only, never serving. The paged engine pays for paging, scheduling and a
variable batch; here a wave of rows is left-padded to one prompt length, prefilled in one
forward, then decoded one column per step. A decode step's shapes depend only on how many
key columns it attends to, rounded up to `SPAN`, so on CUDA each such span is captured once
as a CUDA graph and replayed: the model's ~400 kernel launches per step become one replay.
The column, the next tokens, the rows' padding and key validity live in fixed tensors that
the graphs read; sampling (a generator draw per row) runs outside them.
Greedy rows equal the engine's output (tested).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from engine.model.attention import AttentionBackend
from engine.model.llama import CausalLM

SPAN = 64  # decode attends to key columns [0, span); span is a multiple of this
# Not cuDNN: it builds an execution plan per new shape on the host (8 ms forward, ~80 ms
# backward on an H100 host), and training batches and waves change shape every time.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


class DenseKVAttention(AttentionBackend):
    """Contiguous per-layer KV: [layer, row, kv head, column, dim]; rows left-padded.

    Called once per layer, in order. A prefill step (several tokens per row) writes columns
    [0, n) and attends causally over the valid ones. A decode step (one token per row)
    writes column `col` (a one-element tensor, so a captured graph follows it) and attends
    to the valid keys of columns [0, span) at or before it, with the query heads of each KV
    group as that group's query rows: two batched matmuls that read each K/V once (cuDNN's
    fused kernel took ~1.9x as long at this shape, 3 query rows per group). A query
    always sees itself: pad rows stay finite.
    """

    def __init__(self, model: CausalLM, batch: int, width: int, key_valid: torch.Tensor) -> None:
        c = model.config
        shape = (c.num_hidden_layers, batch, c.num_key_value_heads, width, c.head_dim)
        dtype = next(model.parameters()).dtype
        self.k = torch.zeros(shape, dtype=dtype, device=key_valid.device)
        self.v = torch.zeros_like(self.k)
        self.key_valid, self.layer = key_valid, 0
        self.col = torch.zeros(1, dtype=torch.long, device=key_valid.device)
        self.kcol = torch.arange(width, device=key_valid.device)
        self.span = width
        self.step_mask = key_valid[:, None, None, :]

    def begin_decode(self, span: int) -> None:
        """Set the next decode step's key span and mask (inside a captured graph too)."""
        self.span = span
        self.step_mask = (self.key_valid[:, :span] & (self.kcol[:span] <= self.col))[:, None, None, :]

    def forward(self, q, k, v, kv_cache, meta, scale):
        b, hkv, layer = self.k.shape[1], self.k.shape[2], self.layer
        n = q.shape[0] // b
        self.layer = (layer + 1) % self.k.shape[0]
        if n == 1:
            kl, vl = self.k[layer], self.v[layer]
            kl.index_copy_(2, self.col, k.unsqueeze(2))
            vl.index_copy_(2, self.col, v.unsqueeze(2))
            qg = q.view(b, hkv, -1, q.shape[-1])  # [row, kv head, query head of the group, dim]
            scores = torch.matmul(qg, kl[:, :, : self.span].transpose(-1, -2)).float() * scale
            probs = torch.softmax(scores.masked_fill(~self.step_mask, -math.inf), dim=-1)
            out = torch.matmul(probs.to(vl.dtype), vl[:, :, : self.span])
            return out.reshape(b, *q.shape[1:])
        self.k[layer, :, :, :n] = k.view(b, n, *k.shape[1:]).transpose(1, 2)
        self.v[layer, :, :, :n] = v.view(b, n, *v.shape[1:]).transpose(1, 2)
        col = self.kcol[:n]
        mask = ((col.view(1, -1, 1) >= col.view(1, 1, -1)) & self.key_valid[:, None, :n]) | torch.eye(
            n, dtype=torch.bool, device=q.device)
        qb = q.view(b, n, *q.shape[1:]).transpose(1, 2)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(qb, self.k[layer, :, :, :n], self.v[layer, :, :, :n],
                                                 attn_mask=mask.unsqueeze(1), scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(b * n, *q.shape[1:])


class DenseSampler:
    """Up to `batch` rows at a time, prompt + continuation <= `width` columns; reusable across
    waves (the cache and the captured graphs are kept). `graphs`: capture decode steps as
    CUDA graphs (default: on CUDA)."""

    def __init__(self, model: CausalLM, batch: int, width: int, graphs: bool | None = None) -> None:
        self.model, self.batch, self.width = model, batch, width
        dev = next(model.parameters()).device
        self.valid = torch.zeros(batch, width, dtype=torch.bool, device=dev)
        self.pad = torch.zeros(batch, dtype=torch.long, device=dev)
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.attn = DenseKVAttention(model, batch, width, self.valid)
        self.use_graphs = dev.type == "cuda" if graphs is None else graphs
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs share one memory pool

    def _decode_logits(self, span: int) -> torch.Tensor:
        """Logits [batch, vocab] of the tokens in `tok` at column `attn.col` (eager)."""
        self.attn.begin_decode(span)
        pos = (self.attn.col - self.pad).clamp(min=0)
        h = self.model(self.tok, pos, [None] * self.model.num_layers, None, self.attn)
        return self.model.compute_logits(h)

    def _decode(self, span: int) -> torch.Tensor:
        if not self.use_graphs:
            return self._decode_logits(span)
        if span not in self.graphs:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up: writes this column's K/V as the replay will
                self._decode_logits(span)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._decode_logits(span)
            self.pool = graph.pool()
            self.graphs[span] = (graph, out)
        graph, out = self.graphs[span]
        graph.replay()
        return out

    def sample(self, prompts: list[list[int]], temps: list[float], max_new: int, stop_ids: tuple[int, ...],
               seed: int) -> list[list[int]]:
        """Prompt + continuation per row, cut after the first stop id (temperature 0: greedy)."""
        rows, p = len(prompts), max(len(x) for x in prompts)
        if not 0 < rows <= self.batch or p + max_new > self.width:
            raise ValueError(f"{rows} rows of up to {p}+{max_new} tokens do not fit {self.batch}x{self.width}")
        b, dev = self.batch, self.pad.device
        prompts = prompts + [prompts[0]] * (b - rows)  # idle rows repeat the first prompt
        temp = torch.tensor(temps + [1.0] * (b - rows), device=dev, dtype=torch.float32).unsqueeze(1)
        lens = torch.tensor([len(x) for x in prompts])
        ids = torch.zeros(b, p + max_new, dtype=torch.long)
        for r, x in enumerate(prompts):
            ids[r, p - len(x) : p] = torch.tensor(x)
        ids = ids.to(dev)
        self.valid.copy_((torch.arange(self.width) >= (p - lens).unsqueeze(1)).to(dev))
        self.pad.copy_((p - lens).to(dev))
        gen = torch.Generator(device=dev).manual_seed(seed)
        done = torch.zeros(b, dtype=torch.bool, device=dev)
        stops = torch.tensor(stop_ids or (-1,), device=dev)
        with torch.no_grad():
            cols = torch.arange(p, device=dev).unsqueeze(0)
            h = self.model(ids[:, :p].reshape(-1), (cols - self.pad.unsqueeze(1)).clamp(min=0).reshape(-1),
                           [None] * self.model.num_layers, None, self.attn)
            logits = self.model.compute_logits(h.view(b, p, -1)[:, -1])
            col = p
            while True:
                nxt = _sample_rows(logits, temp, gen)
                ids[:, col] = nxt
                done |= torch.isin(nxt, stops)
                if col == p + max_new - 1 or (col % 16 == 0 and bool(done[:rows].all())):
                    break
                self.tok.copy_(nxt)
                self.attn.col.fill_(col)
                logits = self._decode(min(self.width, -(-(col + 1) // SPAN) * SPAN))
                col += 1
        out = ids[:rows, : col + 1].tolist()
        return [_cut(row[p - len(x) :], len(x), stop_ids) for row, x in zip(out, prompts, strict=False)]


def sample_dense(model: CausalLM, prompts: list[list[int]], temps: list[float], max_new: int,
                 stop_ids: tuple[int, ...], seed: int) -> list[list[int]]:
    """One wave through a fresh `DenseSampler` sized to it."""
    width = max(len(x) for x in prompts) + max_new
    return DenseSampler(model, len(prompts), width).sample(prompts, temps, max_new, stop_ids, seed)


def _sample_rows(logits: torch.Tensor, temp: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    probs = torch.softmax(logits / temp.clamp(min=1e-5), dim=-1)
    drawn = torch.multinomial(probs, 1, generator=gen).squeeze(1)
    return torch.where(temp.squeeze(1) > 0, drawn, logits.argmax(-1))


def _cut(seq: list[int], prompt_len: int, stop_ids: tuple[int, ...]) -> list[int]:
    for i in range(prompt_len, len(seq)):
        if seq[i] in stop_ids:
            return seq[: i + 1]
    return seq
