"""Persistent per-slot decode state, owned by the ModelRunner and advanced on the device.

Each running request occupies one slot. The decode step reads and writes these tensors
itself (lengths, last token, drafts, done flags), so the host can launch step N+1 before it
has read step N's results (ARCHITECTURE.md, "The decode step"). The host writes a slot only
when it inserts requests (`insert_many_no_sync`: every request inserted before a step goes in
one packed host-to-device copy through reused pinned memory and one launch, whatever
their number: kernels/slot_insert.py) or grows a block table (`set_blocks_no_sync`). The grammar masks of constrained
requests (`grammar_mask`, made when the first one arrives) are the exception: the host writes
them before each launch (engine/runner/constrained.py); every other slot's rows allow every token.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from engine.model.attention import TRASH_BLOCK
from engine.runner.staging import PinnedStaging
from engine.sampling.penalties import PenaltyInit, PenaltyState
from kernels.slot_insert import insert_rows
from kernels.step_meta import StepState

MAX_STOP_IDS = 8


def to_device_no_sync(values: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """Host list -> device tensor through pinned memory; the copy is stream-ordered, never waited on."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t


@dataclass
class SlotInit:
    """What a newly prefilled request brings to its slot (host values or device tensors)."""

    seq_len: int  # prompt length: tokens whose KV is in the cache
    first_token: torch.Tensor | int  # a device scalar (single-process engine) or a host int (node)
    drafts: torch.Tensor | list[int] | None  # [k], on the device with a device first token, else host
    draft_probs: torch.Tensor | None  # [k, V], device or host
    num_generated: int
    max_tokens: int
    stop_ids: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    block_ids: list[int]
    penalty: PenaltyInit | None = None  # penalties and logit bias (engine/sampling/penalties.py)


class BatchState:
    """One row per slot, plus a spare row (`spare`, never handed out, always done) that pads a
    CUDA graph's batch: its KV writes land in the trash block and its results are dropped.
    `step_rows` holds the rows a captured decode step reads (the running slots, then spares)."""

    def __init__(self, capacity: int, k: int, max_blocks: int, vocab: int, device: torch.device) -> None:
        def z(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.capacity, self.k, self.vocab, self.device = capacity, k, vocab, device
        self._staging = PinnedStaging(torch.device(device))
        self.spare = capacity
        self.step_rows = torch.full((capacity,), self.spare, dtype=torch.long, device=device)
        n = capacity + 1  # the slots, then the spare
        self.seq_lens = z(n)
        self.last_token = z(n)
        self.drafts = z(n, k)
        self.draft_probs: torch.Tensor | None = None  # [n, k, V], made when a sampled request joins
        self.num_generated = z(n)
        self.max_tokens = z(n)
        self.done = torch.ones(n, dtype=torch.bool, device=device)
        self.stop_ids = torch.full((n, MAX_STOP_IDS), -1, dtype=torch.long, device=device)
        self.block_tables = torch.full((n, max_blocks), TRASH_BLOCK, dtype=torch.long, device=device)
        self.temperature = z(n, dtype=torch.float32)
        self.top_k = z(n)
        self.top_p = torch.ones(n, dtype=torch.float32, device=device)
        self.seed = z(n)
        self.penalties = PenaltyState(n, vocab, device)
        self.grammar_mask: torch.Tensor | None = None  # [n, k+1, ceil(V/32)] int32; all ones: no grammar

    def step_state(self, k: int | None = None) -> StepState:
        """The tensors a decode step gathers its rows from (kernels/step_meta.py `step_inputs`); `k`: the
        drafts it verifies a row, all of them (None) or none (0: a plain step sees no drafts). The
        kernels read `drafts` as a dense [S, k]: a width between is not offered."""
        drafts = self.drafts[:, :0] if k == 0 else self.drafts
        return StepState(self.seq_lens, self.done, self.last_token, drafts, self.block_tables,
                         self.temperature, self.top_k, self.top_p, self.seed)

    def _h2d(self, values, dtype) -> torch.Tensor:
        return to_device_no_sync(values, dtype, self.device)

    def set_blocks_no_sync(self, slot: int, start: int, block_ids: list[int]) -> None:
        if block_ids:
            self.block_tables[slot, start : start + len(block_ids)] = self._h2d(block_ids, torch.long)

    def insert_no_sync(self, slot: int, init: SlotInit) -> None:
        self.insert_many_no_sync([(slot, init)])

    def insert_many_no_sync(self, inits: list[tuple[int, SlotInit]]) -> None:
        """Write requests into their slots: one staged copy of every host value, then one
        scatter per state tensor for all of them; stream-ordered, never waited on."""
        for _, init in inits:
            if len(init.stop_ids) > MAX_STOP_IDS:
                raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request")
        if not inits:
            return
        inits = sorted(inits, key=lambda si: not isinstance(si[1].first_token, torch.Tensor))
        rows = self._staging.to_device(torch.tensor([self._pack(s, i) for s, i in inits], dtype=torch.long))
        self._scatter(rows)
        on_device = [i for _, i in inits if isinstance(i.first_token, torch.Tensor)]
        if on_device:  # they come first: rows [0, n)
            slots = rows[: len(on_device), 0]
            self.last_token[slots] = torch.stack([i.first_token for i in on_device])  # type: ignore[misc]
            if self.k and all(isinstance(i.drafts, torch.Tensor) for i in on_device):
                self.drafts[slots] = torch.stack([i.drafts for i in on_device])  # type: ignore[misc]
        for slot, init in inits:
            if init.draft_probs is not None:
                self.ensure_draft_probs()
                assert self.draft_probs is not None
                probs = init.draft_probs
                self.draft_probs[slot] = probs if probs.device == self.draft_probs.device else self._staging.to_device(probs)
        self.penalties.insert_no_sync([(slot, init.penalty) for slot, init in inits])

    def _pack(self, slot: int, init: SlotInit) -> list[int]:
        """One row of host values: slot, scalars, the two floats' bits, stop ids, drafts, blocks."""
        first = init.first_token if isinstance(init.first_token, int) else -1
        floats = struct.unpack("<2i", struct.pack("<2f", init.temperature, init.top_p))  # fp32 bits
        drafts = init.drafts if isinstance(init.drafts, list) else [0] * self.k
        stops = list(init.stop_ids) + [-1] * (MAX_STOP_IDS - len(init.stop_ids))
        blocks = init.block_ids + [TRASH_BLOCK] * (self.block_tables.shape[1] - len(init.block_ids))
        return [slot, init.seq_len, init.num_generated, init.max_tokens, init.top_k, init.seed, first,
                *floats, *stops, *drafts[: self.k], *blocks]

    def _scatter(self, rows: torch.Tensor) -> None:
        """The packed rows [n, F] (device) into the state tensors: one launch on a GPU, where a
        scatter per tensor would cost its dispatch on every step that inserts."""
        insert_rows(rows, self)

    def ensure_draft_probs(self) -> None:
        if self.draft_probs is None and self.k:
            self.draft_probs = torch.zeros(self.capacity + 1, self.k, self.vocab, device=self.device)

    def ensure_grammar_mask(self) -> torch.Tensor:
        if self.grammar_mask is None:
            words = -(-self.vocab // 32)
            self.grammar_mask = torch.full((self.capacity + 1, self.k + 1, words), -1, dtype=torch.int32,
                                           device=self.device)
        return self.grammar_mask

    def write_grammar_masks_no_sync(self, slots: torch.Tensor | int, masks: torch.Tensor) -> None:
        """Slots `slots` [n] (device) get `masks` [n, k+1, W] (device): a scatter; or the n slots
        from `slots` (an int) get them, from pinned host memory too: one copy. Stream-ordered."""
        if isinstance(slots, int):
            self.ensure_grammar_mask()[slots : slots + masks.shape[0]].copy_(masks, non_blocking=True)
        else:
            self.ensure_grammar_mask().index_copy_(0, slots, masks)

    def clear_grammar_mask(self, slot: int) -> None:
        """A slot whose constrained request left allows every token again (stream-ordered)."""
        if self.grammar_mask is not None:
            self.grammar_mask[slot].fill_(-1)

    def release(self, slot: int) -> None:
        self.done[slot] = True
        self.block_tables[slot].fill_(TRASH_BLOCK)
