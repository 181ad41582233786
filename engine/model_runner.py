"""ModelRunner: runs the model for a scheduler's step. Owns the KV cache and the BatchState.

Receives host integers from the scheduler (which requests, which tokens, which blocks) and
hands back device tensors wrapped in handles; the host reads a decode step's results from
`collect`, one step after launching it. Careful when editing:
  * nothing between `launch_decode` and `collect` may wait for the device (no .item(),
    .tolist(), .cpu(), data-dependent shapes); `collect` is the only read point;
  * rows whose slot is `done` on the device must write K/V only to the trash block, because
    the host may already have handed their blocks to a new request;
  * the MTP chain writes KV up to 2k positions past a request's length: the scheduler
    reserves that room (`kv_room_needed`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import TRASH_BLOCK, AttentionBackend, AttentionMetadata
from engine.batch_state import BatchState, SlotInit, to_device_no_sync
from engine.draft_vocab import DraftVocab, draft_tokens
from engine.kv_cache import KVCache
from engine.model import CausalLM
from engine.sampler import (
    STREAM_SAMPLE,
    LogprobsTensors,
    SamplingTensors,
    compute_logprobs,
    sample,
)
from engine.sampling_params import SamplingParams
from engine.spec_decode import verify


def kv_room_needed(num_tokens: int, k: int) -> int:
    """KV positions a request of `num_tokens` may write in its next step (verify + MTP chain)."""
    return num_tokens + 2 * k + 1


@dataclass
class PrefillChunk:
    """One request's slice [start, end) of its prompt for this step."""

    prompt: list[int]
    start: int
    end: int
    block_ids: list[int]
    params: SamplingParams
    seed: int

    @property
    def logprobs(self) -> int | None:
        return self.params.logprobs

    @property
    def is_last(self) -> bool:
        return self.end == len(self.prompt)


@dataclass
class PrefillOutput:
    """Device tensors for the rows whose prompt finished this step (order of `last_rows`)."""

    last_rows: list[int]  # indices into the step's chunk list
    first_token: torch.Tensor  # [R]
    logprobs: LogprobsTensors | None  # rows that asked, in order of `logprob_rows`
    logprob_rows: list[int]
    drafts: torch.Tensor | None  # [R, k]
    draft_probs: torch.Tensor | None  # [R, k, V]


@dataclass
class DecodeHandle:
    """A launched decode step. Device tensors; `collect` turns them into host lists."""

    slots: list[int]
    tokens: torch.Tensor  # [R, k+1]
    num_emitted: torch.Tensor  # [R]
    finished: torch.Tensor  # [R] bool
    logprobs: LogprobsTensors | None
    logprob_rows: list[int]
    event: torch.cuda.Event | None = None


@dataclass
class DecodeResult:
    slots: list[int]
    tokens: list[list[int]]  # emitted tokens per row
    finished: list[bool]
    logprobs: dict[int, list[tuple[float, int, list[tuple[int, float]]]]]  # row -> per token


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        k: int,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        max_model_len: int,
        device: torch.device,
        dtype: torch.dtype,
        draft_vocab: DraftVocab | None = None,
    ) -> None:
        cfg = model.config
        self.model, self.backend, self.k = model, backend, k
        self.draft_vocab = draft_vocab  # None: drafts score the full vocabulary
        self.block_size, self.device = block_size, device
        self.num_target_layers = cfg.num_hidden_layers
        layers = cfg.num_hidden_layers + (1 if k > 0 else 0)
        self.kv = KVCache(layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        self.max_blocks = -(-kv_room_needed(max_model_len, k) // block_size)
        self.state = BatchState(max_num_seqs, k, self.max_blocks, cfg.vocab_size, device)
        self._arange_k1 = torch.arange(k + 1, device=device)

    # ---- shared helpers -------------------------------------------------------------
    def _slots(self, tables: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor | None) -> torch.Tensor:
        """Slot ids for positions [R, q] given block tables [R, nb]; masked rows -> trash."""
        bs = self.block_size
        blocks = tables.gather(1, (positions // bs).clamp(max=tables.shape[1] - 1))
        slots = blocks * bs + positions % bs
        if masked is not None:
            slots = torch.where(masked.unsqueeze(1), TRASH_BLOCK * bs + positions % bs, slots)
        return slots

    def _meta_uniform(self, tables, positions, masked, num_kv_blocks) -> AttentionMetadata:
        """Metadata for R rows of q tokens each (decode/verify and MTP chain steps)."""
        rows, q = positions.shape
        return AttentionMetadata(
            slot_mapping=self._slots(tables, positions, masked).reshape(-1),
            positions=positions.reshape(-1),
            block_tables=tables,
            token_row=torch.arange(rows, device=self.device).repeat_interleave(q),
            token_col=torch.arange(q, device=self.device).repeat(rows),
            max_q=q,
            num_kv_blocks=min(num_kv_blocks, tables.shape[1]),
        )

    def _draft_chain(
        self, h: torch.Tensor, base: torch.Tensor, st: SamplingTensors, tables, masked, num_kv_blocks
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafts from the MTP hidden at position base-1; draft j lands at base + j.
        With a draft vocabulary the head scores its N tokens; drafts and their distributions
        [R, V] are in the full vocabulary (engine/draft_vocab.py)."""
        drafts: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        mtp_cache = self.kv.layers[self.num_target_layers]
        for j in range(1, self.k + 1):
            if j > 1:
                pos = (base + j - 2).unsqueeze(1)
                meta = self._meta_uniform(tables, pos, masked, num_kv_blocks)
                h = self.model.mtp_forward(drafts[-1], pos.reshape(-1), h, mtp_cache, meta, self.backend)
            dv = self.draft_vocab
            logits = self.model.mtp_logits(h, dv.weight if dv is not None else None)
            token, p = draft_tokens(logits, st, base + j, dv)
            drafts.append(token)
            if p is not None:
                probs.append(p)
        return torch.stack(drafts, 1), (torch.stack(probs, 1) if probs else None)

    # ---- prefill --------------------------------------------------------------------
    def prefill(self, chunks: list[PrefillChunk], on_layer: Callable[[int], None] | None = None) -> PrefillOutput:
        """Run target (+ MTP) over prompt chunks; sample first tokens and drafts for finished prompts.

        `on_layer(i)` is called after target layer i is queued (see CausalLM.forward).
        """
        dev, bs = self.device, self.block_size
        ids: list[int] = []
        pos: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        slots: list[int] = []
        next_ids: list[int] = []
        for r, c in enumerate(chunks):
            n = c.end - c.start
            ids += c.prompt[c.start : c.end]
            pos += range(c.start, c.end)
            rows += [r] * n
            cols += range(n)
            slots += [c.block_ids[p // bs] * bs + p % bs for p in range(c.start, c.end)]
            next_ids += c.prompt[c.start + 1 : c.end + 1] + ([0] if c.is_last else [])
        width = max(-(-c.end // bs) for c in chunks)
        tables = [c.block_ids[:width] + [TRASH_BLOCK] * (width - len(c.block_ids[:width])) for c in chunks]
        t = lambda x: to_device_no_sync(x, torch.long, dev)  # noqa: E731
        meta = AttentionMetadata(t(slots), t(pos), t(tables), t(rows), t(cols),
                                 max(c.end - c.start for c in chunks), width)
        hidden = self.model(t(ids), meta.positions, self.kv.layers, meta, self.backend, on_layer)
        return self._finish_prefill(chunks, hidden, meta, t(next_ids))

    def _finish_prefill(self, chunks, hidden, meta, next_ids) -> PrefillOutput:
        last_rows = [r for r, c in enumerate(chunks) if c.is_last]
        ends, acc = [], 0
        for c in chunks:
            acc += c.end - c.start
            ends.append(acc - 1)
        idx = to_device_no_sync([ends[r] for r in last_rows], torch.long, self.device)
        lp_rows = [i for i, r in enumerate(last_rows) if chunks[r].logprobs is not None]
        out = PrefillOutput(last_rows, torch.empty(0, dtype=torch.long), None, lp_rows, None, None)
        if last_rows:
            st = SamplingTensors.from_params(
                [chunks[r].params for r in last_rows], [chunks[r].seed for r in last_rows], self.device
            )
            logits = self.model.compute_logits(hidden[idx])
            base = to_device_no_sync([len(chunks[r].prompt) for r in last_rows], torch.long, self.device)
            out.first_token = sample(logits, st, base, STREAM_SAMPLE)
            out.logprobs = self._logprobs(logits, out.first_token, lp_rows, [chunks[r] for r in last_rows])
            next_ids = next_ids.index_put((idx,), out.first_token)
        if self.k:
            mtp_cache = self.kv.layers[self.num_target_layers]
            mh = self.model.mtp_forward(next_ids, meta.positions, hidden, mtp_cache, meta, self.backend)
            if last_rows:
                width = max(-(-kv_room_needed(len(chunks[r].prompt), self.k) // self.block_size) for r in last_rows)
                tables = self._pad_tables([chunks[r].block_ids for r in last_rows], width)
                out.drafts, out.draft_probs = self._draft_chain(mh[idx], base, st, tables, None, width)
        return out

    def _pad_tables(self, block_lists: list[list[int]], width: int) -> torch.Tensor:
        rows = [b[:width] + [TRASH_BLOCK] * (width - len(b[:width])) for b in block_lists]
        return to_device_no_sync(rows, torch.long, self.device)

    def _logprobs(self, logits, tokens, lp_rows, chunks_or_nums) -> LogprobsTensors | None:
        if not lp_rows:
            return None
        num_top = max(getattr(c, "logprobs", c) or 0 for c in (chunks_or_nums[i] for i in lp_rows))
        sel = to_device_no_sync(lp_rows, torch.long, self.device)
        return compute_logprobs(logits[sel], tokens[sel], num_top)

    # ---- insert ---------------------------------------------------------------------
    def insert_no_sync(self, slot: int, init: SlotInit) -> None:
        self.state.insert_no_sync(slot, init)

    # ---- decode ---------------------------------------------------------------------
    def launch_decode(
        self, slots: list[int], flags: tuple[bool, bool], logprobs: dict[int, int], num_kv_blocks: int
    ) -> DecodeHandle:
        """Verify [last, d1..dk] for every slot, accept, redraft; advance state on the device.

        `flags` = (all_greedy, needs_filter) for these rows, host-known; `logprobs` maps row
        index -> top-n for rows that asked. Never syncs.
        """
        all_greedy, needs_filter = flags
        s, k, dev = self.state, self.k, self.device
        rows = to_device_no_sync(slots, torch.long, dev)
        sampling = SamplingTensors(s.temperature[rows], s.top_k[rows], s.top_p[rows], s.seed[rows], all_greedy, needs_filter)
        done = s.done[rows]
        seq = s.seq_lens[rows]
        tables = s.block_tables[rows]
        positions = seq.unsqueeze(1) + self._arange_k1  # [R, k+1]
        inputs = torch.cat([s.last_token[rows].unsqueeze(1), s.drafts[rows]], 1)
        meta = self._meta_uniform(tables, positions, done, num_kv_blocks)
        hidden = self.model(inputs.reshape(-1), meta.positions, self.kv.layers, meta, self.backend)
        logits = self.model.compute_logits(hidden).view(len(slots), k + 1, -1)
        dprobs = None
        if not all_greedy:
            s.ensure_draft_probs()
            dprobs = s.draft_probs[rows] if s.draft_probs is not None else logits.new_zeros(len(slots), 0, logits.shape[-1])
        tokens, n_emit = verify(logits, s.drafts[rows], dprobs, sampling, seq + 1)
        n_emit, finished = self._apply_stops(rows, tokens, n_emit, done)
        lp_rows = sorted(logprobs)
        lps = None
        if lp_rows:
            sel = to_device_no_sync(lp_rows, torch.long, dev)
            flat = tokens[sel].clamp(min=0).reshape(-1)
            lps = compute_logprobs(logits[sel].reshape(flat.shape[0], -1), flat, max(logprobs.values()))
        new_len = seq + n_emit
        last = tokens.gather(1, (n_emit - 1).clamp(min=0).unsqueeze(1)).squeeze(1)
        s.last_token[rows] = torch.where(n_emit > 0, last, s.last_token[rows])
        s.seq_lens[rows] = new_len
        s.num_generated[rows] += n_emit
        s.done[rows] = done | finished
        if k:
            self._redraft(rows, tokens, n_emit, hidden, meta, new_len, sampling, done, num_kv_blocks)
        handle = DecodeHandle(slots, tokens, n_emit, finished & ~done, lps, lp_rows)
        return self._start_copy_to_host(handle)

    def _apply_stops(self, rows, tokens, n_emit, done):
        """Cut emitted tokens at the first stop id and at max_tokens; rows already done emit 0."""
        s = self.state
        valid = self._arange_k1.unsqueeze(0) < n_emit.unsqueeze(1)
        is_stop = (tokens.unsqueeze(-1) == s.stop_ids[rows].unsqueeze(1)).any(-1) & valid
        has_stop = is_stop.any(1)
        n = torch.where(has_stop, is_stop.float().argmax(1) + 1, n_emit)
        room = s.max_tokens[rows] - s.num_generated[rows]
        n = torch.minimum(n, room)
        n = torch.where(done, torch.zeros_like(n), n)
        finished = (has_stop | (s.num_generated[rows] + n >= s.max_tokens[rows])) & ~done
        return n, finished

    def _redraft(self, rows, tokens, n_emit, hidden, meta, new_len, st, masked, num_kv_blocks):
        """MTP over the verified positions, then chain k drafts from the last accepted one.

        MTP at position p reads (target hidden at p, token at p+1): the emitted tokens are
        exactly the tokens at p+1.. for the accepted positions; the rest is garbage whose KV
        is overwritten before it is ever read (the next step rewrites from new_len on).
        """
        s, k = self.state, self.k
        r = rows.shape[0]
        mtp_cache = self.kv.layers[self.num_target_layers]
        mtp_ids = tokens.clamp(min=0).reshape(-1)
        mh = self.model.mtp_forward(mtp_ids, meta.positions, hidden, mtp_cache, meta, self.backend)
        pick = (n_emit - 1).clamp(min=0) + torch.arange(r, device=self.device) * (k + 1)
        drafts, probs = self._draft_chain(mh[pick], new_len, st, meta.block_tables, masked, num_kv_blocks)
        s.drafts[rows] = drafts
        if probs is not None:
            s.ensure_draft_probs()
            assert s.draft_probs is not None
            s.draft_probs[rows] = probs

    def _start_copy_to_host(self, h: DecodeHandle) -> DecodeHandle:
        if self.device.type != "cuda":
            return h
        pin = lambda x: x.to("cpu", non_blocking=True)  # noqa: E731  (pinned by the allocator)
        h.tokens, h.num_emitted, h.finished = pin(h.tokens), pin(h.num_emitted), pin(h.finished)
        if h.logprobs is not None:
            lp = h.logprobs
            h.logprobs = LogprobsTensors(pin(lp.token_logprob), pin(lp.token_rank), pin(lp.top_ids), pin(lp.top_logprobs))
        h.event = torch.cuda.Event()
        h.event.record()
        return h

    @staticmethod
    def collect(h: DecodeHandle, num_top: dict[int, int]) -> DecodeResult:
        """The read point: waits for the step's copies, returns host lists."""
        if h.event is not None:
            h.event.synchronize()
        tokens, counts, finished = h.tokens.tolist(), h.num_emitted.tolist(), h.finished.tolist()
        emitted = [row[:n] for row, n in zip(tokens, counts, strict=True)]
        lps: dict[int, list] = {}
        if h.logprobs is not None:
            per_row = unpack_logprobs(h.logprobs, num_top, h.logprob_rows, width=len(tokens[0]))
            for row, entries in per_row.items():
                lps[row] = entries[: counts[row]]
        return DecodeResult(h.slots, emitted, finished, lps)


def unpack_logprobs(lp: LogprobsTensors, num_top: dict[int, int], rows: list[int], width: int):
    """Host lists per row: [(logprob, rank, [(id, logprob)...top-n]), ...] for `width` tokens each."""
    vals, ranks = lp.token_logprob.tolist(), lp.token_rank.tolist()
    top_ids, top_lps = lp.top_ids.tolist(), lp.top_logprobs.tolist()
    out = {}
    for i, row in enumerate(rows):
        n = num_top[row]
        entries = []
        for j in range(i * width, (i + 1) * width):
            entries.append((vals[j], ranks[j], list(zip(top_ids[j][:n], top_lps[j][:n], strict=True))))
        out[row] = entries
    return out
