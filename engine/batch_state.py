"""Persistent per-slot decode state, owned by the ModelRunner and advanced on the device.

Each running request occupies one slot. The decode step reads and writes these tensors
itself (lengths, last token, drafts, done flags), so the host can launch step N+1 before it
has read step N's results (ARCHITECTURE.md, "The decode step"). The host writes a slot only
when it inserts a request (`insert_no_sync`) or grows its block table (`set_blocks_no_sync`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention import TRASH_BLOCK

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
    first_token: torch.Tensor | int
    drafts: torch.Tensor | None  # [k]
    draft_probs: torch.Tensor | None  # [k, V]
    num_generated: int
    max_tokens: int
    stop_ids: tuple[int, ...]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    block_ids: list[int]


class BatchState:
    """One row per slot, plus a spare row (`spare`, never handed out, always done) that pads a
    CUDA graph's batch: its KV writes land in the trash block and its results are dropped.
    `step_rows` holds the rows a captured decode step reads (the running slots, then spares)."""

    def __init__(self, capacity: int, k: int, max_blocks: int, vocab: int, device: torch.device) -> None:
        def z(*shape, dtype=torch.long):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.capacity, self.k, self.vocab, self.device = capacity, k, vocab, device
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

    def _h2d(self, values, dtype) -> torch.Tensor:
        return to_device_no_sync(values, dtype, self.device)

    def set_blocks_no_sync(self, slot: int, start: int, block_ids: list[int]) -> None:
        if block_ids:
            self.block_tables[slot, start : start + len(block_ids)] = self._h2d(block_ids, torch.long)

    def insert_no_sync(self, slot: int, init: SlotInit) -> None:
        """Write a request into `slot` with async host-to-device copies, stream-ordered."""
        if len(init.stop_ids) > MAX_STOP_IDS:
            raise ValueError(f"at most {MAX_STOP_IDS} stop token ids per request")
        ints = [init.seq_len, init.num_generated, init.max_tokens, init.top_k, init.seed]
        vals = self._h2d(ints, torch.long)
        self.seq_lens[slot], self.num_generated[slot], self.max_tokens[slot] = vals[0], vals[1], vals[2]
        self.top_k[slot], self.seed[slot] = vals[3], vals[4]
        floats = self._h2d([init.temperature, init.top_p], torch.float32)
        self.temperature[slot], self.top_p[slot] = floats[0], floats[1]
        stops = list(init.stop_ids) + [-1] * (MAX_STOP_IDS - len(init.stop_ids))
        self.stop_ids[slot] = self._h2d(stops, torch.long)
        first = init.first_token
        self.last_token[slot] = first if isinstance(first, torch.Tensor) else self._h2d([first], torch.long)[0]
        if self.k and init.drafts is not None:
            self.drafts[slot] = init.drafts
        if init.draft_probs is not None:
            self.ensure_draft_probs()
            assert self.draft_probs is not None
            self.draft_probs[slot] = init.draft_probs
        self.block_tables[slot].fill_(TRASH_BLOCK)
        self.set_blocks_no_sync(slot, 0, init.block_ids)
        self.done[slot] = False

    def ensure_draft_probs(self) -> None:
        if self.draft_probs is None and self.k:
            self.draft_probs = torch.zeros(self.capacity + 1, self.k, self.vocab, device=self.device)

    def release(self, slot: int) -> None:
        self.done[slot] = True
        self.block_tables[slot].fill_(TRASH_BLOCK)
