"""Grammar-constrained decoding with MTP (issue 28): the host side, masks for the device.

Receives the constrained requests of a decode batch (a `StructuredSpec` in their params) and,
after every step, their emitted tokens and new drafts; hands the device, before each launch,
one bitmask per verify position (`BatchState.grammar_mask`, kernels/token_mask.py). Verify
position i scores the token after [last, d_1..d_i], so its mask is the matcher's state after
the emitted tokens plus d_1..d_i (`write_masks_no_sync`): row 0 is the state itself, then each
draft is accepted tentatively and the next row filled, up to the first draft the grammar
rejects (later rows allow everything: a draft outside the grammar is never accepted at its
masked position, so nothing after it is kept), and the tentative drafts are rolled back.

Exactness comes from masked verification alone: greedy output equals constrained k = 0 output
token for token, sampled output keeps the masked distribution (rejection sampling against it).
Drafts are drawn unmasked by the MTP head (in prefill too); a draft the grammar forbids is
rejected at its masked position.

What this costs: the host must know step N's emitted tokens and drafts before the masks of step
N + 1, so while a constrained request runs DecodeBatch runs each step in two halves: the
forward of N + 1 (which needs no mask) is queued, step N is read and the masks are filled
while it runs, then the rest of N + 1 is queued (engine/sched/decode_batch.py), so the other requests
of the batch do not wait for the masks. An all-greedy step with no logprobs or penalties leaves its
LM head to the second half, where the masks apply inside the head's argmax (kernels/linear.py): no
logits are written, masked and read again. The forward has read the drafts by then, so a forbidden
draft cannot be replaced by the one token the grammar allows there. The host work per step is
O(constrained rows x (k + 1)) matcher calls (each a few to tens of µs).

A request's grammar state is (spec, tokens): a request inserted with emitted tokens (a decode
node's first token from the prefill node, a moved request's resumed output) replays them.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.grammar.compiler import GrammarCompiler, MaskFiller, Matcher
from engine.request import PrefillChunk, Request
from engine.runner.batch_state import BatchState
from engine.sampling.sampling_params import SamplingParams


def grammar_tokens(params: SamplingParams, prompt: list[int], output: list[int]) -> list[int]:
    """The tokens a request's grammar has seen: a moved request's resumed prompt tokens, then its output."""
    cut = len(prompt) - min(params.resumed_tokens, len(prompt))
    return prompt[cut:] + output


def prefill_masks(compiler: GrammarCompiler | None, chunks: list[PrefillChunk]) -> torch.Tensor | None:
    """[R, W] int32 masks of a prefill step's first tokens, on the host (None: no constrained
    prompt ends here). A spec that does not compile leaves its row unmasked: inserting the
    request into a decode batch ends it with that error."""
    ends = [r for r, c in enumerate(chunks) if c.is_last and c.params.structured is not None]
    if compiler is None or not ends:
        return None
    host = torch.full((len(chunks), compiler.words), -1, dtype=torch.int32)
    for r in ends:
        c = chunks[r]
        assert c.params.structured is not None
        try:
            compiler.matcher(c.params.structured, grammar_tokens(c.params, c.prompt, [])).fill_mask(host, r)
        except ValueError:
            pass
    return host


class MaskedRunner(Protocol):
    """What the constrained rows read of the ModelRunner: its MTP depth, its grammar compiler and
    the BatchState their masks go to (read at each use: the runner sets `grammar` after it is built)."""

    @property
    def k(self) -> int: ...
    @property
    def grammar(self) -> GrammarCompiler | None: ...
    @property
    def state(self) -> BatchState: ...


class ConstrainedRows:
    """The matchers of a decode batch's constrained requests, by slot, and their next masks."""

    def __init__(self, runner: MaskedRunner) -> None:
        self.runner, self.k = runner, runner.k
        self.matchers: dict[int, Matcher] = {}
        self.drafts: dict[int, list[int]] = {}  # slot -> the drafts its next launch verifies
        self._host: torch.Tensor | None = None  # flat int32: a step's masks, then its slots as int64; pinned on CUDA
        self._copied: torch.cuda.Event | None = None
        self._filler: MaskFiller | None = None

    @property
    def filler(self) -> MaskFiller:
        """Made on the first constrained step (its thread pool)."""
        if self._filler is None:
            self._filler = MaskFiller()
        return self._filler

    def __bool__(self) -> bool:
        return bool(self.matchers)

    def add(self, req: Request, drafts: torch.Tensor | list[int] | None) -> None:
        """Track `req` (slot taken): its matcher replays the tokens it has seen. ValueError when its
        spec does not compile or a token does not match. Device drafts are read here (a sync: the
        single-process engine inserts right after its prefill read point)."""
        assert req.slot is not None and req.params.structured is not None
        if self.runner.grammar is None:
            raise ValueError("structured output is not enabled on this engine")
        spec = req.params.structured
        self.matchers[req.slot] = self.runner.grammar.matcher(spec, grammar_tokens(req.params, req.prompt, req.output_ids))
        host = drafts.tolist() if isinstance(drafts, torch.Tensor) else list(drafts or [])
        self.drafts[req.slot] = host[: self.k]

    def remove(self, slot: int) -> None:
        if self.matchers.pop(slot, None) is not None:
            self.drafts.pop(slot, None)
            self.runner.state.clear_grammar_mask(slot)

    def advance(self, slot: int, tokens: list[int], drafts: list[int] | None) -> bool:
        """A step's emitted tokens and new drafts; False when the grammar rejects a token (a bug)."""
        m = self.matchers[slot]
        self.drafts[slot] = list(drafts or [])
        return all(m.accept(t) for t in tokens)

    def write_masks_no_sync(self, slots: list[int]) -> None:
        """The masks of the constrained slots among `slots` (module docstring) into the device's
        `grammar_mask`, from one pinned buffer by one copy (`_copy_no_sync`); stream-ordered, before
        the launch's second half."""
        mine = [s for s in slots if s in self.matchers]
        if not mine:
            return
        k1, words = self.k + 1, self.runner.state.ensure_grammar_mask().shape[-1]
        n_mask = len(mine) * k1 * words
        at = n_mask + n_mask % 2  # where the slots go, as int64 (8-byte aligned), after the masks
        flat = self._buffer(at + 2 * len(mine))
        self._fill_levels([self.matchers[s] for s in mine], [self.drafts.get(s, []) for s in mine],
                          flat[:n_mask].view(-1, words))
        self._copy_no_sync(mine, flat, at)

    def _copy_no_sync(self, mine: list[int], flat: torch.Tensor, at: int) -> None:
        """The masks at the start of `flat` into the state rows `mine`: consecutive slots (a batch
        of constrained requests admitted together) by one copy straight into their rows; others by
        one copy of the masks with the slot ids behind them (from `at`), then one scatter."""
        state, n = self.runner.state, len(mine)
        shape = (n, *state.ensure_grammar_mask().shape[1:])
        n_mask = shape[0] * shape[1] * shape[2]
        if mine == list(range(mine[0], mine[0] + n)):
            state.write_grammar_masks_no_sync(mine[0], flat[:n_mask].view(shape))
        else:
            flat[at : at + 2 * n].view(torch.int64).copy_(torch.tensor(mine, dtype=torch.int64))
            staged = flat[: at + 2 * n].to(state.device, non_blocking=True)
            state.write_grammar_masks_no_sync(staged[at:].view(torch.int64), staged[:n_mask].view(shape))
        if state.device.type == "cuda":
            self._copied = self._copied or torch.cuda.Event()
            self._copied.record()

    def _fill_levels(self, matchers: list[Matcher], drafts: list[list[int]], host: torch.Tensor) -> None:
        """Row j*(k+1) + i of `host` := matcher j's mask after its first i drafts, for the drafts
        the grammar takes (rows past the first one it refuses: all ones). One batched fill per
        verify position, over every row still going, then each matcher rolls its drafts back."""
        k1 = self.k + 1
        host[: len(matchers) * k1].fill_(-1)
        taken = [0] * len(matchers)
        live = list(range(len(matchers)))
        for i in range(k1):
            if i:
                live = [j for j in live if len(drafts[j]) >= i and matchers[j].accept(drafts[j][i - 1])]
                for j in live:
                    taken[j] = i
            self.filler.fill([matchers[j] for j in live], host, [j * k1 + i for j in live])
        for m, n in zip(matchers, taken, strict=True):
            m.rollback(n)

    def _buffer(self, size: int) -> torch.Tensor:
        """The host buffer (flat int32, at least `size`), reused once its last copy has run (in
        constrained mode it has: the step that read it was collected before the next masks are
        filled)."""
        if self._host is None or self._host.shape[0] < size:
            state = self.runner.state
            words = state.ensure_grammar_mask().shape[-1]
            cap = (state.capacity + 1) * ((self.k + 1) * words + 2) + 1  # every slot's masks and id
            self._host = torch.empty(max(size, cap), dtype=torch.int32, pin_memory=state.device.type == "cuda")
        elif self._copied is not None:
            self._copied.synchronize()
        return self._host
