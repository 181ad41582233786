"""The prefill step: prompt chunks in, first tokens (+ logprobs, MTP drafts) out, on the device.

Receives a step's chunks as host integers and packs them into `PrefillInputs`, one int64 and
one float32 buffer on the device (filled by one non-blocking copy each from pinned memory).
`prefill_forward` reads only those buffers, so one CUDA graph per (tokens, rows) bucket
replays every step that fits (engine/runner/prefill_graphs.py), and the same function runs eagerly
for a step of exact size (CPU, `--enforce-eager`, steps beyond the largest bucket):

    prefill_meta (one kernel: positions, slots, per-row lengths, next ids) -> target forward
    -> hidden of each row's last token -> logits -> first token (+ logprobs)
    -> MTP over the step's tokens -> k chained drafts per row (rows whose prompt did not end
       in this chunk, and padding rows, write their draft KV to the trash block)

Every row gets a first token and drafts; only rows whose prompt ends here are read. Nothing
here syncs with the device; every shape comes from host integers (`PrefillKey`).
Careful when editing: padding tokens carry garbage through the model (their K/V goes to the
trash block); nothing computed for them may land in a real row (see kernels/prefill_meta.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.cache.kv_cache import KVCache
from engine.model.attention import TRASH_BLOCK, AttentionBackend, AttentionMetadata
from engine.model.llama import CausalLM
from engine.request import PrefillChunk
from engine.runner.prompt_logprobs import PromptLogprobPlan
from engine.runner.prompt_logprobs import compute as compute_prompt_logprobs
from engine.sampling.penalties import Penalties, apply_penalties
from engine.sampling.sampler import (
    STREAM_SAMPLE,
    LogprobsTensors,
    SamplingTensors,
    compute_logprobs,
    sample,
)
from engine.sampling.sampling_params import SamplingParams
from kernels.prefill_meta import prefill_meta
from kernels.token_mask import mask_logits


class PrefillRunner(Protocol):
    """What a prefill step uses of the ModelRunner."""

    model: CausalLM
    kv: KVCache
    backend: AttentionBackend
    k: int
    block_size: int
    num_target_layers: int
    max_blocks: int
    device: torch.device
    deterministic: bool  # batch-invariant kernels (`kernels._dispatch.batch_invariant`)

    def draft_chain(self, h: torch.Tensor, base: torch.Tensor, st: SamplingTensors, tables: torch.Tensor,
                    masked: Any, num_kv_blocks: int) -> tuple[torch.Tensor, torch.Tensor | None]: ...


@dataclass(frozen=True)
class PrefillKey:
    """What a prefill step's launches depend on (host-known): a CUDA graph's key."""

    tokens: int  # T: token slots (real tokens, then padding)
    rows: int  # R: row slots (real rows, then padding rows of no tokens)
    max_q: int  # an upper bound of any row's chunk length (T for a graph)
    all_greedy: bool
    needs_filter: bool
    top_logprobs: int | None  # top logprobs computed for every row; None: no logprobs
    fresh: bool  # no row has cached keys before its chunk (attention may skip the cache)
    constrained: bool = False  # first tokens sampled under grammar masks (`PrefillInputs.token_mask`)

    @property
    def shape(self) -> tuple[int, int, int, bool]:
        """What the kernels are compiled for, whatever the sampling (engine/runner/shapes.py)."""
        return self.tokens, self.rows, self.max_q, self.fresh


@dataclass
class PrefillResult:
    """Device outputs, one row per row slot (a graph's static tensors)."""

    first_token: torch.Tensor  # [R]
    logprobs: LogprobsTensors | None  # [R] rows, `top_logprobs` each
    drafts: torch.Tensor | None  # [R, k]
    draft_probs: torch.Tensor | None  # [R, k, V]; None when all greedy
    prompt_logprobs: LogprobsTensors | None = None  # the plan's positions (engine/runner/prompt_logprobs.py)


class PrefillInputs:
    """Device buffers a prefill step of up to `tokens` tokens and `rows` rows reads, and the
    pinned host buffers that fill them. int64: ids [T], query_start [R+1], start [R],
    row_next [R], is_last [R], base [R] (prompt length), seed [R], top_k [R], tables [R, W];
    float32: temperature [R], top_p [R]."""

    def __init__(self, tokens: int, rows: int, width: int, device: torch.device) -> None:
        self.tokens, self.rows, self.width, self.device = tokens, rows, width, device
        t, r = tokens, rows
        sizes = {"ids": t, "query_start": r + 1, "start": r, "row_next": r, "is_last": r, "base": r,
                 "seed": r, "top_k": r, "tables": r * width}
        pin = device.type == "cuda"
        n_int = sum(sizes.values())  # one buffer of ints then floats: one copy to the device
        self._host = torch.zeros(8 * n_int + 4 * 2 * r, dtype=torch.uint8, pin_memory=pin)
        self._dev = torch.zeros_like(self._host, device=device)
        self._host_i, self._host_f = self._host[: 8 * n_int].view(torch.long), self._host[8 * n_int :].view(torch.float32)
        self._dev_i, self._dev_f = self._dev[: 8 * n_int].view(torch.long), self._dev[8 * n_int :].view(torch.float32)
        self._np_i, self._np_f = self._host_i.numpy(), self._host_f.numpy()  # host views: list -> buffer in C
        self._copied: torch.cuda.Event | None = None
        views, at = {}, 0
        for name, n in sizes.items():
            views[name] = self._dev_i[at : at + n]
            at += n
        self.ids, self.query_start, self.start = views["ids"], views["query_start"], views["start"]
        self.row_next, self.is_last, self.base = views["row_next"], views["is_last"], views["base"]
        self.seed, self.top_k = views["seed"], views["top_k"]
        self.tables = views["tables"].view(r, width)
        self.temperature, self.top_p = self._dev_f[:r], self._dev_f[r:]
        self.token_mask: torch.Tensor | None = None  # [R, W] int32 grammar bitmasks (constrained keys)
        self._mask_host: torch.Tensor | None = None
        self._mask_copied: torch.cuda.Event | None = None

    def ensure_token_mask(self, words: int) -> torch.Tensor:
        """The rows' grammar bitmasks on the device, made on first use (all allowed)."""
        if self.token_mask is None or self.token_mask.shape[1] != words:
            self._mask_host = torch.full((self.rows, words), -1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
            self.token_mask = self._mask_host.to(self.device)
        return self.token_mask

    def fill_mask_no_sync(self, masks: torch.Tensor | None, words: int) -> None:
        """Rows' masks [n <= R, W] int32 on the host (None: none), the rest allowing everything,
        into `token_mask` by one non-blocking copy from pinned memory."""
        self.ensure_token_mask(words)
        assert self._mask_host is not None and self.token_mask is not None
        if self._mask_copied is not None:
            self._mask_copied.synchronize()  # the previous copy has left the host rows
        n = 0 if masks is None else masks.shape[0]
        if masks is not None and n:
            self._mask_host[:n].copy_(masks)
        self._mask_host[n:].fill_(-1)
        self.token_mask.copy_(self._mask_host, non_blocking=True)
        if self.device.type == "cuda":
            self._mask_copied = self._mask_copied or torch.cuda.Event()
            self._mask_copied.record()

    def fill_no_sync(self, chunks: list[PrefillChunk]) -> None:
        """Write the chunks (padding the rest) and start the copies to the device."""
        assert len(chunks) <= self.rows and sum(c.end - c.start for c in chunks) <= self.tokens
        if self._copied is not None:
            self._copied.synchronize()  # the host buffers' previous copy has left them
        # lists straight into numpy views of the pinned buffer: no torch op per field
        self._np_i[:] = self._ints(chunks)
        floats = [c.params.temperature for c in chunks] + [0.0] * (self.rows - len(chunks))
        self._np_f[:] = floats + [c.params.top_p for c in chunks] + [1.0] * (self.rows - len(chunks))
        self._dev.copy_(self._host, non_blocking=True)
        if self.device.type == "cuda":
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()

    def _ints(self, chunks: list[PrefillChunk]) -> list[int]:
        pad, w = self.rows - len(chunks), self.width
        ids: list[int] = []
        starts = [0]
        for c in chunks:
            ids += c.prompt[c.start : c.end]
            starts.append(starts[-1] + c.end - c.start)
        out = ids + [0] * (self.tokens - len(ids))
        out += starts + [starts[-1]] * pad
        out += [c.start for c in chunks] + [0] * pad
        out += [0 if c.is_last else c.prompt[c.end] for c in chunks] + [0] * pad
        out += [int(c.is_last) for c in chunks] + [0] * pad
        out += [len(c.prompt) for c in chunks] + [0] * pad
        out += [c.seed for c in chunks] + [0] * pad
        out += [c.params.top_k for c in chunks] + [0] * pad
        for c in chunks:
            row = c.block_ids[:w]
            out += row + [TRASH_BLOCK] * (w - len(row))
        return out + [TRASH_BLOCK] * (w * pad)

    def sampling(self, key: PrefillKey) -> SamplingTensors:
        return SamplingTensors(self.temperature, self.top_k, self.top_p, self.seed, key.all_greedy, key.needs_filter)


def key_for(chunks: list[PrefillChunk], tokens: int, rows: int, max_q: int) -> PrefillKey:
    """The key of a step of `chunks` run as `tokens` x `rows` slots; sampling flags and
    logprobs from the rows whose prompt ends here (the others' first tokens are not read)."""
    last: list[SamplingParams] = [c.params for c in chunks if c.is_last]
    sampled = [p for p in last if not p.greedy]
    asked = [p.logprobs for p in last if p.logprobs is not None]
    return PrefillKey(tokens, rows, max_q, all_greedy=not sampled,
                      needs_filter=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
                      top_logprobs=max(asked) if asked else None, fresh=all(c.start == 0 for c in chunks),
                      constrained=any(p.structured is not None for p in last))


LayerHook = Callable[[int], None]


FirstHook = Callable[["PrefillResult"], None]


@dataclass
class PrefillHead:
    """What the second part of a prefill step (MTP and drafts) reads of the first."""

    hidden: torch.Tensor
    meta: AttentionMetadata
    next_ids: torch.Tensor  # [T] each token's next id, first tokens put in (the MTP layer's input)
    last_idx: torch.Tensor  # [R] each row's last token in the step's flat order
    sampling: SamplingTensors


def prefill_forward(runner: PrefillRunner, inp: PrefillInputs, key: PrefillKey, on_layer: LayerHook | None = None,
                    penalties: Penalties | None = None, prompt_lp: PromptLogprobPlan | None = None,
                    token_mask: torch.Tensor | None = None, on_first: FirstHook | None = None) -> PrefillResult:
    """The whole step over `inp` (module docstring): `prefill_head`, `on_first(result)` once the
    first tokens (and logprobs) are queued (its drafts are not yet: a caller may queue the first
    tokens' copy to the host there, ahead of the MTP work), then `prefill_tail`."""
    head, out = prefill_head(runner, inp, key, on_layer, penalties, prompt_lp, token_mask)
    if on_first is not None:
        on_first(out)
    prefill_tail(runner, inp, key, head, out)
    return out


def prefill_head(runner: PrefillRunner, inp: PrefillInputs, key: PrefillKey, on_layer: LayerHook | None = None,
                 penalties: Penalties | None = None, prompt_lp: PromptLogprobPlan | None = None,
                 token_mask: torch.Tensor | None = None) -> tuple[PrefillHead, PrefillResult]:
    """The target forward and the first tokens; `on_layer(i)` right after layer i is queued.
    `runner` is the ModelRunner (model, KV cache, backend, k, draft chain). First tokens are sampled
    from logits masked by `token_mask` ([R, W] int32 grammar bitmasks, engine/runner/constrained.py), then
    with `penalties` applied (engine/sampling/penalties.py; logprobs stay the raw ones); `prompt_lp` asks
    for prompt logprobs (engine/runner/prompt_logprobs.py). A constrained key without `token_mask` reads
    the inputs' own (`PrefillInputs.token_mask`: a graph's)."""
    model = runner.model
    if token_mask is None and key.constrained:
        assert inp.token_mask is not None, "a constrained step's inputs carry its masks"
        token_mask = inp.token_mask
    m = prefill_meta(inp.ids, inp.query_start, inp.start, inp.tables, inp.row_next, inp.is_last, runner.block_size)
    meta = AttentionMetadata(m.slot_mapping, m.positions, inp.tables, m.token_row, m.token_col, key.max_q,
                             inp.width, seq_lens=m.seq_lens, query_start=inp.query_start, fresh=key.fresh,
                             cu_seqlens=inp.query_start.to(torch.int32) if key.fresh else None)
    hidden = model(inp.ids, meta.positions, runner.kv.layers, meta, runner.backend, on_layer)
    st = inp.sampling(key)
    logits = model.compute_logits(hidden.index_select(0, m.last_idx))
    scored = mask_logits(logits, token_mask) if token_mask is not None else logits
    first = sample(apply_penalties(scored, penalties) if penalties is not None else scored, st, inp.base, STREAM_SAMPLE)
    lps = compute_logprobs(logits, first, key.top_logprobs) if key.top_logprobs is not None else None
    out = PrefillResult(first, lps, None, None, compute_prompt_logprobs(model, hidden, prompt_lp) if prompt_lp else None)
    next_ids = m.next_ids.index_put((m.put_idx,), first)[: key.tokens] if runner.k else m.next_ids
    return PrefillHead(hidden, meta, next_ids, m.last_idx, st), out


def prefill_tail(runner: PrefillRunner, inp: PrefillInputs, key: PrefillKey, head: PrefillHead,
                 out: PrefillResult) -> None:
    """The MTP layer over the step's tokens, then k chained drafts per row into `out` (k > 0).
    MTP drafts are drawn unmasked."""
    if not runner.k:
        return
    model, meta = runner.model, head.meta
    mtp_cache = runner.kv.layers[runner.num_target_layers]
    mh = model.mtp_forward(head.next_ids, meta.positions, head.hidden, mtp_cache, meta, runner.backend)
    masked = inp.is_last == 0  # their drafts are not read: their KV goes to the trash block
    out.drafts, out.draft_probs = runner.draft_chain(mh.index_select(0, head.last_idx), inp.base, head.sampling,
                                                      inp.tables, masked, _draft_blocks(key, inp, runner))


def _draft_blocks(key: PrefillKey, inp: PrefillInputs, runner: PrefillRunner) -> int:
    """Block-table columns the draft chain may read: a fresh step's rows end by max_q + 2k + 1
    (fewer split-KV partitions for short prompts), others anywhere in the table."""
    if not key.fresh:
        return inp.width
    return min(inp.width, -(-(key.max_q + 2 * runner.k + 1) // runner.block_size))
