"""ModelRunner: runs the model for a scheduler's step. Owns the KV cache and the BatchState.

Receives host integers from the scheduler (which requests, which tokens, which blocks) and
hands back device tensors wrapped in handles; the host reads a decode step's results from
`collect`, one step after launching it. Careful when editing:
  * nothing between `launch_decode` and `collect` may wait for the device (no .item(),
    .tolist(), .cpu(), data-dependent shapes); `collect` is the only read point;
  * rows whose slot is `done` on the device must write K/V only to the trash block, because
    the host may already have handed their blocks to a new request;
  * the MTP chain writes KV up to 2k positions past a request's length: the scheduler
    reserves that room (`kv_room_needed`);
  * everything the host reads of a decode step goes into the step's one packed buffer
    (engine/runner/step_output.py) and comes back by one copy: a new output is a new segment of
    `StepLayout`, never a copy of its own;
  * a decode step runs at the runner's k (verify k drafts, redraft k) or, with `adaptive_k`, at
    k = 0 too (plain decoding: engine/spec_decode/adaptive_k.py says why that stays exact); the
    step's k is a parameter of every decode method, never read from `self.k` inside them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

import settings
from engine.cache.kv_cache import KVCache
from engine.grammar.compiler import GrammarCompiler, mask_words
from engine.model.attention import AttentionBackend, AttentionMetadata
from engine.model.llama import CausalLM
from engine.request import LogprobColumns, PrefillChunk
from engine.runner.batch_state import BatchState, SlotInit, to_device_no_sync
from engine.runner.constrained import prefill_masks
from engine.runner.cuda_graphs import MAX_TOP_LOGPROBS, DecodeGraphs, StepFlags
from engine.runner.prefill_graphs import LayerReady, PrefillGraphs
from engine.runner.prefill_step import PrefillInputs, PrefillResult, key_for, prefill_forward
from engine.runner.prompt_logprobs import PromptLogprobPlan
from engine.runner.prompt_logprobs import plan as plan_prompt_logprobs
from engine.runner.shapes import ShapeLog
from engine.runner.step_output import HostCopy, HostOutputs, StepLayout, astuple_lp
from engine.sampling.penalties import PenaltyInit, prefill_penalties
from engine.sampling.sampler import LogprobsTensors, SamplingTensors, compute_logprobs
from engine.spec_decode.draft_vocab import DraftVocab, draft_tokens
from engine.spec_decode.verify import verify
from kernels._dispatch import batch_invariant, rows_a_sequence
from kernels.decode_tail import accept_and_advance
from kernels.step_meta import Meta, StepInputs, step_inputs, uniform_meta
from kernels.token_mask import mask_rows

# Decode attention's key splits (settings: PDSERVE_SPLIT_BLOCKS, ONE_SPLIT_BLOCKS, MAX_SPLITS). A
# row's split shares its actual 128-key tiles, and a split of about one tile with few empty ones
# keeps the most programs busy without a long combine:
# contexts of up to ONE_SPLIT_BLOCKS blocks attend in one split (no combine launch), longer ones in
# a split per SPLIT_BLOCKS blocks (8: one tile), at most MAX_SPLITS (0: no cap but the grid's, FULL_GRID).
SPLIT_BLOCKS = settings.SPLIT_BLOCKS
ONE_SPLIT_BLOCKS = settings.ONE_SPLIT_BLOCKS
MAX_SPLITS = settings.MAX_SPLITS
FULL_GRID = 264  # programs that fill an H100 twice (132 SMs)
# the decode graphs' narrower block-table widths (engine/runner/cuda_graphs.py), so a step's split count
# follows its widest row: up to 16 blocks one split, 32 four, 64 eight, 128 sixteen, 192 twenty-four,
# then max_blocks' count (33 at max_model_len 4096). "16" alone: one narrow width; 0: one width
SHORT_KV_BLOCKS = settings.SHORT_KV_BLOCKS
MAX_GRAPH_ROWS = 64  # prefill graphs' largest row bucket
MAX_GRAPH_TOKENS = 16384  # prefill graphs' largest token bucket: beyond it compute hides the launches (SmolLM2 4 x 4096 was host-bound eager)


def decode_splits(rows: int, kv_heads: int, num_kv_blocks: int) -> int:
    """Split-KV partitions for a decode step: enough programs to fill the GPU on long contexts,
    one (no combine launch) when the rows alone fill it or the context is short."""
    if rows * kv_heads >= FULL_GRID or num_kv_blocks <= ONE_SPLIT_BLOCKS:
        return 1
    splits = min(-(-num_kv_blocks // SPLIT_BLOCKS), FULL_GRID // (rows * kv_heads))
    return max(1, min(splits, MAX_SPLITS) if MAX_SPLITS else splits)


def _in_mode(method):
    """Run a runner method in the runner's kernel mode (batch-invariant with `deterministic`)."""

    @functools.wraps(method)
    def run(self, *args, **kwargs):
        with batch_invariant(self.deterministic):
            return method(self, *args, **kwargs)

    return run


def head_argmax(flags: StepFlags, logprobs: bool) -> bool:
    """Whether a decode step's target ids come out of the LM head's GEMM, with no logits written:
    all greedy, no logprobs, no penalties. A grammar-constrained step's masks then apply inside
    that GEMM too (kernels/linear.py `linear_argmax`), so its forward half computes no logits."""
    all_greedy, _, penalized, _ = flags
    return all_greedy and not logprobs and not penalized


def kv_room_needed(num_tokens: int, k: int) -> int:
    """KV positions a request of `num_tokens` may write in its next step (verify + MTP chain)."""
    return num_tokens + 2 * k + 1


@dataclass
class PrefillOutput:
    """Device tensors for the rows whose prompt finished this step (order of `last_rows`)."""

    last_rows: list[int]  # indices into the step's chunk list
    first_token: torch.Tensor  # [R]
    logprobs: LogprobsTensors | None  # rows that asked, in order of `logprob_rows`
    logprob_rows: list[int]
    drafts: torch.Tensor | None  # [R, k]
    draft_probs: torch.Tensor | None  # [R, k, V]
    prompt_logprobs: LogprobsTensors | None = None  # every chunk's that asked (engine/runner/prompt_logprobs.py)
    prompt_lp_plan: PromptLogprobPlan | None = None


@dataclass
class DecodeHandle:
    """A launched decode step: its packed outputs on their way to the host; `collect` reads them."""

    slots: list[int]  # the launch's rows are the first len(slots) of `layout`'s
    layout: StepLayout
    copy: HostCopy
    logprob_at: dict[int, int]  # row -> the row its logprob entries are at in the step's logprobs
    stale: bool = False  # a k > 0 step right after a k = 0 one: its drafts were left from before it

    @property
    def k(self) -> int:
        """The drafts the step verified per row."""
        return self.layout.k1 - 1


@dataclass
class StepOutputs:
    """What `ModelRunner.decode_step` leaves on the device (a graph's static outputs): views of
    `packed`, the one buffer the host copies (engine/runner/step_output.py)."""

    tokens: torch.Tensor  # [R, k+1], -1 past the emitted ones
    num_emitted: torch.Tensor  # [R]
    finished: torch.Tensor  # [R] int64, 0/1
    logprobs: LogprobsTensors | None  # rows of `lp_sel`, k+1 entries each
    packed: torch.Tensor  # int64, `layout.words`
    layout: StepLayout


@dataclass
class DecodeForward:
    """The first half of a decode step (`ModelRunner.decode_forward`): what the second reads."""

    x: StepInputs
    sampling: SamplingTensors
    meta: AttentionMetadata
    hidden: torch.Tensor
    logits: torch.Tensor | None  # [R, k+1, V] (a constrained step's that needs them: `head_argmax`), else None
    k: int  # the drafts this step verifies per row


@dataclass
class ForwardHandle:
    """A launched first half (`launch_forward`): `launch_finish` queues the second."""

    slots: list[int]
    flags: StepFlags
    logprobs: dict[int, int]
    num_kv_blocks: int
    forward: DecodeForward | None  # the eager half's tensors (None: a graph's, kept by `DecodeGraphs`)
    rows: torch.Tensor | None = None


@dataclass
class DecodeResult:
    slots: list[int]
    tokens: list[list[int]]  # emitted tokens per row
    finished: list[bool]
    logprobs: dict[int, LogprobColumns]  # row -> its emitted tokens' logprobs (rows that asked)
    drafts: list[list[int]] | None = None  # the next step's drafts per row (a constrained step's)


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
        cuda_graphs: bool = False,
        deterministic: bool = False,
        draft_vocab: DraftVocab | None = None,
        prefill_graph_tokens: int = 0,
        adaptive_k: bool = False,
    ) -> None:
        """`cuda_graphs`: the decode step as CUDA graphs; `prefill_graph_tokens` > 0: prefill
        steps of up to that many tokens (and up to `max_num_seqs`, at most 64, rows) as CUDA
        graphs too (engine/runner/prefill_graphs.py); `adaptive_k`: decode steps run at k or at 0,
        each captured (engine/spec_decode/adaptive_k.py)."""
        cfg = model.config
        self.model, self.backend, self.k = model, backend, k
        self.step_ks: tuple[int, ...] = (k, 0) if adaptive_k and k else (k,)  # the k a decode step may run at
        self.step_costs: dict[int, tuple[float, float]] = {}  # bucket -> seconds at k = 0, at k (adaptive k)
        self._last_k = k  # the k of the last decode step launched
        self.draft_vocab = draft_vocab  # None: drafts score the full vocabulary
        self.deterministic = deterministic  # prefill and decode steps run batch-invariant kernels
        self.block_size, self.device = block_size, device
        self.num_target_layers = cfg.num_hidden_layers
        layers = cfg.num_hidden_layers + (1 if k > 0 else 0)
        self.kv = KVCache(layers, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, dtype, device)
        self.max_blocks = -(-kv_room_needed(max_model_len, k) // block_size)
        self.short_blocks = SHORT_KV_BLOCKS  # narrower graph widths (engine/runner/cuda_graphs.py)
        self.state = BatchState(max_num_seqs, k, self.max_blocks, cfg.vocab_size, device)
        self.outputs = HostOutputs(device, StepLayout(max_num_seqs, k + 1, max_num_seqs, MAX_TOP_LOGPROBS, True).words)
        self.grammar: GrammarCompiler | None = None  # structured output (engine/grammar/compiler.py); None: refused
        self.shapes: ShapeLog | None = None  # the step shapes met, against the warm-up's (engine/runner/shapes.py)
        self.graphs = DecodeGraphs(self, max_num_seqs) if cuda_graphs else None
        self.prefill_graphs = (PrefillGraphs(self, prefill_graph_tokens, min(max_num_seqs, MAX_GRAPH_ROWS))
                               if prefill_graph_tokens > 0 else None)

    # ---- shared helpers -------------------------------------------------------------
    def _meta_uniform(self, tables, start, q, masked, num_kv_blocks, offset: int = 0) -> AttentionMetadata:
        """Metadata for R rows of q tokens at positions start[r] + offset.. (decode/verify, MTP
        chain); rows `masked` on the device write their K/V to the trash block."""
        meta = uniform_meta(tables, start, masked, q, self.block_size, offset)
        return self._attn_meta(meta, tables, q, num_kv_blocks)

    def attention_splits(self, rows: int, num_kv_blocks: int) -> int:
        """Key splits of a decode step's attention over `rows` rows and that many table columns."""
        return 1 if self.deterministic else decode_splits(rows, self.model.config.num_key_value_heads, num_kv_blocks)

    def _attn_meta(self, meta: Meta, tables: torch.Tensor, q: int, num_kv_blocks: int) -> AttentionMetadata:
        positions, slots, seq_lens, query_start, token_row, token_col = meta
        rows = tables.shape[0]
        return AttentionMetadata(
            slots, positions, tables, token_row, token_col, max_q=q,
            num_kv_blocks=min(num_kv_blocks, tables.shape[1]), seq_lens=seq_lens, query_start=query_start,
            num_splits=self.attention_splits(rows, num_kv_blocks),
        )

    def draft_chain(
        self, h: torch.Tensor, base: torch.Tensor, st: SamplingTensors, tables, masked, num_kv_blocks
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """k drafts [R, k] from the MTP hidden at position base-1; draft j lands at base + j.
        With a draft vocabulary the head scores its N tokens; drafts and their distributions
        [R, V] are in the full vocabulary (engine/spec_decode/draft_vocab.py). Each draft is written in
        place into a row of one [k, R] buffer (no gathers or stacks between the chain's steps)."""
        drafts = torch.empty(self.k, h.shape[0], dtype=torch.long, device=h.device)
        probs: list[torch.Tensor] = []
        mtp_cache = self.kv.layers[self.num_target_layers]
        for j in range(1, self.k + 1):
            if j > 1:
                meta = self._meta_uniform(tables, base, 1, masked, num_kv_blocks, offset=j - 2)
                h = self.model.mtp_forward(drafts[j - 2], meta.positions, h, mtp_cache, meta, self.backend)
            p = self._draft(h, st, base, j, drafts[j - 1])
            if p is not None:
                probs.append(p)
        return drafts.t(), (torch.stack(probs, 1) if probs else None)

    def _draft(self, h: torch.Tensor, st: SamplingTensors, base: torch.Tensor, j: int,
               out: torch.Tensor) -> torch.Tensor | None:
        """Draft j of every row (at position base + j) from the MTP hidden h into `out` [R];
        returns their distributions, or None when all are greedy."""
        dv = self.draft_vocab
        weight = dv.weight if dv is not None else None
        if st.all_greedy:  # the argmax (and the vocabulary's id map) inside the head's GEMM: no logits
            self.model.mtp_greedy_ids(h, weight, dv.ids if dv is not None else None, out=out)
            return None
        return draft_tokens(self.model.mtp_logits(h, weight, float32=False), st, base + j, dv, out=out)[1]

    # ---- prefill --------------------------------------------------------------------
    @_in_mode
    def prefill(self, chunks: list[PrefillChunk], on_layer: LayerReady | None = None,
                on_first: Callable[[PrefillOutput], None] | None = None) -> PrefillOutput:
        """Run target (+ MTP) over prompt chunks; sample first tokens and drafts for finished prompts.

        `on_layer(i, ready)` hands out target layer i once its work is queued: `ready` is a CUDA
        event after the layer (a graph replay queues every layer at once), or None when the
        layer is the last work queued. Replays a prefill graph when the step fits one
        (engine/runner/prefill_graphs.py; a constrained prompt's first token is sampled under its
        matcher's first mask, engine/runner/constrained.py, which the graph reads from its inputs), else
        runs the same step eagerly at its exact size (always with penalties or prompt logprobs).
        `on_first(output)` runs once the first tokens (and logprobs) of the completed prompts are
        queued, before the MTP layer and drafts are: `output` has no drafts (a caller queues the
        first tokens' copy to the host there, so they leave ahead of the drafts)."""
        n = sum(c.end - c.start for c in chunks)
        penalties = prefill_penalties([PenaltyInit.of(c.params, c.prompt, []) if c.is_last else None for c in chunks],
                                      self.state.vocab, self.device)
        prompt_lp = plan_prompt_logprobs(chunks)
        masks = prefill_masks(self.grammar, chunks)
        plain = penalties is None and prompt_lp is None
        first = (lambda res: on_first(self._last_rows(chunks, res))) if on_first is not None else None
        if plain and self.prefill_graphs is not None and self.prefill_graphs.fits(n, len(chunks)):
            words = self.grammar.words if self.grammar is not None else mask_words(self.state.vocab)
            res = self.prefill_graphs.run(chunks, on_layer, first, masks, words)
            if self.shapes is not None:
                self.shapes.note(self.shapes.prefill_shape(chunks), eager=self.prefill_graphs.last_eager)
            return self._last_rows(chunks, res)
        if plain and self.shapes is not None:
            self.shapes.note(self.shapes.prefill_shape(chunks))
        inp = PrefillInputs(n, len(chunks), self.max_blocks, self.device)  # eager: penalties, prompt logprobs
        inp.fill_no_sync(chunks)
        key = key_for(chunks, n, len(chunks), max(c.end - c.start for c in chunks))
        if masks is not None:
            inp.fill_mask_no_sync(masks, masks.shape[1])
        hook = (lambda i: on_layer(i, None)) if on_layer is not None else None
        res = prefill_forward(self, inp, key, hook, penalties, prompt_lp, on_first=first)
        out = self._last_rows(chunks, res)
        out.prompt_logprobs, out.prompt_lp_plan = res.prompt_logprobs, prompt_lp
        return out

    def _last_rows(self, chunks: list[PrefillChunk], res: PrefillResult) -> PrefillOutput:
        """The rows whose prompt finished this step, out of a step's per-row results."""
        last = [r for r, c in enumerate(chunks) if c.is_last]
        lp_rows = [i for i, r in enumerate(last) if chunks[r].logprobs is not None]
        pick = _picker(last, self.device)
        lps = None
        if res.logprobs is not None and lp_rows:
            sel = _picker([last[i] for i in lp_rows], self.device)
            lps = LogprobsTensors(*(sel(t) for t in astuple_lp(res.logprobs)))
        return PrefillOutput(last, pick(res.first_token), lps, lp_rows,
                             pick(res.drafts) if res.drafts is not None else None,
                             pick(res.draft_probs) if res.draft_probs is not None else None)

    # ---- insert ---------------------------------------------------------------------
    def insert_many_no_sync(self, inits: list[tuple[int, SlotInit]]) -> None:
        self.state.insert_many_no_sync(inits)

    # ---- decode ---------------------------------------------------------------------
    def launch_decode(
        self, slots: list[int], flags: StepFlags, logprobs: dict[int, int], num_kv_blocks: int, k: int | None = None
    ) -> DecodeHandle:
        """Verify [last, d1..dk] for every slot, accept, redraft; advance state on the device.
        `k`: the step's drafts, one of `step_ks` (default the runner's k).

        `flags` = (all_greedy, needs_filter, penalized, constrained) for these rows, host-known; `logprobs` maps row
        index -> top-n for rows that asked. Replays a captured graph when there is one for
        this batch size (`DecodeGraphs`), else runs the step eagerly. Then queues the one copy
        of the step's packed outputs to the host (engine/runner/step_output.py). Never syncs.
        """
        self._note_decode(slots, num_kv_blocks)
        k = self.k if k is None else k
        assert k in self.step_ks, f"this runner's decode steps run at k in {self.step_ks}"
        if self._graphed(slots):
            out = self.graphs.replay(slots, flags, bool(logprobs), num_kv_blocks, k)  # type: ignore[union-attr]
            return self._handle(slots, out, logprobs, True)
        rows = to_device_no_sync(slots, torch.long, self.device)
        out = self.decode_step(rows, flags, *self._logprob_rows(logprobs), num_kv_blocks, k)
        return self._handle(slots, out, logprobs, False)

    def _note_decode(self, slots: list[int], num_kv_blocks: int) -> None:
        if self.shapes is not None and len(slots) <= self.state.capacity:
            self.shapes.note(self.shapes.decode_shape(len(slots), num_kv_blocks))

    def _graphed(self, slots: list[int]) -> bool:
        """Whether a decode launch for `slots` replays a graph (its batch fits a bucket)."""
        return self.graphs is not None and len(slots) <= self.graphs.max_batch

    def _logprob_rows(self, logprobs: dict[int, int]) -> tuple[torch.Tensor | None, int]:
        """An eager step's (rows computing logprobs, on the device, or None; top-n)."""
        lp_rows = sorted(logprobs)
        sel = to_device_no_sync(lp_rows, torch.long, self.device) if lp_rows else None
        return sel, max(logprobs.values(), default=0)

    def _handle(self, slots: list[int], out: StepOutputs, logprobs: dict[int, int], graphed: bool) -> DecodeHandle:
        """A launched step: the one copy of its packed outputs queued, and where each row's
        logprobs are (a graph computes every row's; an eager step those `_logprob_rows` chose)."""
        lp_rows = sorted(logprobs)
        at = {row: row for row in lp_rows} if graphed else {row: i for i, row in enumerate(lp_rows)}
        k, last, self._last_k = out.layout.k1 - 1, self._last_k, out.layout.k1 - 1
        return DecodeHandle(slots, out.layout, self.outputs.copy_no_sync(out.packed), at, stale=k > 0 and last == 0)

    def launch_forward(self, slots: list[int], flags: StepFlags, logprobs: dict[int, int],
                       num_kv_blocks: int) -> ForwardHandle:
        """Queue the first half of a constrained step (`decode_forward`): the host writes the
        step's grammar masks while it runs, then queues the rest (`launch_finish`). Never syncs."""
        assert flags[3], "only a constrained step runs in halves"
        self._note_decode(slots, num_kv_blocks)
        if self._graphed(slots):
            self.graphs.replay_forward(slots, flags, bool(logprobs), num_kv_blocks)  # type: ignore[union-attr]
            return ForwardHandle(slots, flags, logprobs, num_kv_blocks, None)
        rows = to_device_no_sync(slots, torch.long, self.device)
        fwd = self.decode_forward(rows, flags, num_kv_blocks, self.k, bool(logprobs))
        return ForwardHandle(slots, flags, logprobs, num_kv_blocks, fwd, rows)

    def launch_finish(self, h: ForwardHandle) -> DecodeHandle:
        """Queue the second half of the step `h` began, and the one copy of its outputs."""
        if h.forward is None:
            assert self.graphs is not None
            out = self.graphs.replay_finish(len(h.slots), h.flags, bool(h.logprobs), h.num_kv_blocks)
            return self._handle(h.slots, out, h.logprobs, True)
        assert h.rows is not None
        out = self.decode_finish(h.forward, h.rows, h.flags, *self._logprob_rows(h.logprobs), h.num_kv_blocks)
        return self._handle(h.slots, out, h.logprobs, False)

    @_in_mode
    def decode_step(self, rows: torch.Tensor, flags: StepFlags, lp_sel: torch.Tensor | slice | None,
                    num_top: int, num_kv_blocks: int, k: int | None = None) -> StepOutputs:
        """One decode step over state rows `rows` [R] verifying k drafts each (default the runner's
        k; one of `step_ks`): what a CUDA graph captures.

        Logprobs (top `num_top`) are computed for the rows `lp_sel` selects (None: none).
        Reads every input from `BatchState` (one gather kernel: kernels/step_meta.py) and
        writes the advanced state back; what the host reads lands in one packed buffer.
        A constrained step may run as its two halves, `decode_forward` then `decode_finish`,
        with the host writing the grammar masks between them (engine/runner/constrained.py).
        """
        fwd = self.decode_forward(rows, flags, num_kv_blocks, k, lp_sel is not None)
        return self.decode_finish(fwd, rows, flags, lp_sel, num_top, num_kv_blocks)

    @_in_mode
    def decode_forward(self, rows: torch.Tensor, flags: StepFlags, num_kv_blocks: int,
                       k: int | None = None, logprobs: bool = False) -> DecodeForward:
        """The step's first half: its inputs, the target forward over [last, d1..dk], and the logits
        a constrained step masks (None where the LM head's GEMM takes the argmax itself, masked:
        `head_argmax`; `logprobs`: whether the step computes logprobs)."""
        r, k = rows.shape[0], self.k if k is None else k
        x = step_inputs(rows, self.state.step_state(k), k + 1, self.block_size)
        sampling = SamplingTensors(x.temperature, x.top_k, x.top_p, x.seed, flags[0], flags[1])
        meta = self._attn_meta(x.meta, x.tables, k + 1, num_kv_blocks)
        with rows_a_sequence(k + 1):  # a verify row runs its plain step's kernels, for its bits (kernels/linear.py)
            hidden = self.model(x.input_ids, meta.positions, self.kv.layers, meta, self.backend)
        # constrained: masked in the second half, inside the head's GEMM or on the logits made here
        logits = self._logits(hidden, flags, r, k) if flags[3] and not head_argmax(flags, logprobs) else None
        return DecodeForward(x, sampling, meta, hidden, logits, k)

    def _logits(self, hidden: torch.Tensor, flags: StepFlags, rows: int, k: int) -> torch.Tensor:
        """[R, k+1, V] verify logits: fp32 where a row samples or is penalized."""
        with rows_a_sequence(k + 1):
            return self.model.compute_logits(hidden, float32=not flags[0] or flags[2]).view(rows, k + 1, -1)

    @_in_mode
    def decode_finish(self, fwd: DecodeForward, rows: torch.Tensor, flags: StepFlags,
                      lp_sel: torch.Tensor | slice | None, num_top: int, num_kv_blocks: int) -> StepOutputs:
        """The step's second half: masks, penalties, verification, the state's advance, logprobs,
        the MTP redraft, and the packed outputs."""
        s, k, r = self.state, fwd.k, rows.shape[0]
        x, sampling, meta, hidden = fwd.x, fwd.sampling, fwd.meta, fwd.hidden
        drafts = x.input_ids.view(r, k + 1)[:, 1:]
        logits, ids, n_verified = self._verify_step(hidden, rows, drafts, sampling, x.seq, flags, lp_sel is not None,
                                                    fwd.logits)
        n_lp = r if isinstance(lp_sel, slice) else (0 if lp_sel is None else lp_sel.shape[0])
        layout = StepLayout(r, k + 1, n_lp if logits is not None else 0, num_top, drafts=flags[3] and k > 0)
        packed = layout.empty(self.device)
        tokens, n_emit, finished, new_len, last_at = accept_and_advance(
            ids, n_verified, rows, s.step_state(k).drafts, s.stop_ids, s.max_tokens, s.num_generated, s.seq_lens,
            s.last_token, s.done, out=packed)
        if flags[2]:
            s.penalties.count_no_sync(rows, tokens, n_emit)
        lps = None
        if layout.lp_rows:
            assert lp_sel is not None and logits is not None
            flat = tokens[lp_sel].clamp(min=0).reshape(-1)
            lps = compute_logprobs(logits[lp_sel].reshape(flat.shape[0], -1), flat, num_top)
            layout.write_logprobs(packed, lps)
        if k:  # the MTP reads every verify position's token: where none was kept, any id will do
            # (a k = 0 step leaves the drafts and the MTP's KV alone: engine/spec_decode/adaptive_k.py)
            mtp_ids = ids if n_verified is None else tokens.clamp(min=0)
            new = self._redraft(rows, mtp_ids, last_at, hidden, meta, new_len, sampling, x.done, num_kv_blocks)
            out_drafts = layout.drafts_view(packed)
            if out_drafts is not None:  # a constrained step: the host builds the next masks from them
                out_drafts.copy_(new)
        return StepOutputs(tokens, n_emit, finished, lps, packed, layout)

    def _verify_step(self, hidden: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor, sampling: SamplingTensors,
                     seq: torch.Tensor, flags: StepFlags, logprobs: bool, logits: torch.Tensor | None = None):
        """(logits [R, k+1, V] or None, target ids [R, k+1], verified counts or None when all greedy):
        the argmax (and the grammar masks) inside the LM head's GEMM when no logits are needed
        (`head_argmax`; `logits`: the forward half's, when it computed them). Grammar masks (verify
        position i of row r: `grammar_mask[rows[r], i]`) apply before penalties; logprobs are raw."""
        _, _, penalized, constrained = flags
        r, k1 = drafts.shape[0], drafts.shape[1] + 1
        if head_argmax(flags, logprobs):
            mask = (rows, self.state.ensure_grammar_mask()) if constrained else None
            with rows_a_sequence(k1):
                return None, self.model.greedy_ids(hidden, mask).view(r, k1), None
        logits = self._logits(hidden, flags, r, k1 - 1) if logits is None else logits
        scored = mask_rows(logits, rows, self.state.ensure_grammar_mask()) if constrained else logits
        scored = self.state.penalties.penalize_rows(scored, rows, drafts) if penalized else scored
        return (logits, *self._verify(scored, rows, drafts, sampling, seq))

    def _verify(self, logits: torch.Tensor, rows: torch.Tensor, drafts: torch.Tensor, sampling: SamplingTensors,
                seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(target ids [R, k+1], verified counts or None when all greedy) from the logits."""
        if sampling.all_greedy:
            return logits.argmax(dim=-1), None
        s = self.state
        s.ensure_draft_probs()
        k = drafts.shape[1]  # a k = 0 step's rows have no drafts, whatever the state holds
        dprobs = (s.draft_probs[rows, :k] if s.draft_probs is not None
                  else logits.new_zeros(rows.shape[0], 0, logits.shape[-1]))
        return verify(logits, drafts, dprobs, sampling, seq + 1)

    def _redraft(self, rows, mtp_ids, last_at, hidden, meta, new_len, st, masked, num_kv_blocks):
        """MTP over the verified positions, then chain k drafts from the last accepted one.

        MTP at position p reads (target hidden at p, token at p+1): the emitted tokens are
        exactly the tokens at p+1.. for the accepted positions; the rest is garbage whose KV
        is overwritten before it is ever read (the next step rewrites from new_len on).
        `last_at` [R]: each row's last kept position in the step's flat token order.
        """
        s = self.state
        mtp_cache = self.kv.layers[self.num_target_layers]
        mh = self.model.mtp_forward(mtp_ids.reshape(-1), meta.positions, hidden, mtp_cache, meta, self.backend)
        drafts, probs = self.draft_chain(mh[last_at], new_len, st, meta.block_tables, masked, num_kv_blocks)
        s.drafts[rows] = drafts
        if probs is not None:
            s.ensure_draft_probs()
            assert s.draft_probs is not None
            s.draft_probs[rows] = probs
        return drafts

    def collect(self, h: DecodeHandle, num_top: dict[int, int]) -> DecodeResult:
        """The read point: waits for the step's one copy, returns host lists, gives the buffer back."""
        h.copy.wait()
        n = len(h.slots)
        tokens, counts, finished, lp = h.layout.views(h.copy.host)
        toks, cnt = tokens[:n].tolist(), counts[:n].tolist()
        emitted = [row[:c] for row, c in zip(toks, cnt, strict=True)]
        lps: dict[int, LogprobColumns] = {}
        if lp is not None and h.logprob_at:
            lps = logprob_columns(lp, num_top, h.logprob_at, h.layout.k1, cnt)
        done = [bool(f) for f in finished[:n].tolist()]
        drafts = h.layout.drafts_view(h.copy.host)
        new_drafts = drafts[:n].tolist() if drafts is not None else None
        self.outputs.release(h.copy)
        return DecodeResult(h.slots, emitted, done, lps, new_drafts)


def logprob_columns(lp: LogprobsTensors, num_top: dict[int, int], rows: list[int] | dict[int, int], width: int,
                    counts: list[int] | None = None) -> dict[int, LogprobColumns]:
    """Per row, the logprobs of its first `counts[row]` tokens (default all `width`), as columns.
    `rows` as in `unpack_logprobs`. One `tolist` per column (none for the top columns when no row
    asked for top entries), then slices: no object per token (a row without top entries has empty
    top columns)."""
    at = rows if isinstance(rows, dict) else {row: i for i, row in enumerate(rows)}
    vals, ranks = lp.token_logprob.tolist(), lp.token_rank.tolist()
    wide = any(num_top[row] for row in at)
    top_ids = lp.top_ids.tolist() if wide else []
    top_lps = lp.top_logprobs.tolist() if wide else []
    out = {}
    for row, i in at.items():
        a, n = i * width, num_top[row]
        b = a + (width if counts is None else counts[row])
        if n:
            out[row] = LogprobColumns(vals[a:b], ranks[a:b], [x[:n] for x in top_ids[a:b]],
                                      [x[:n] for x in top_lps[a:b]])
        else:  # no top entries: no row of them either
            out[row] = LogprobColumns(vals[a:b], ranks[a:b], [], [])
    return out


def unpack_logprobs(lp: LogprobsTensors, num_top: dict[int, int], rows: list[int] | dict[int, int], width: int):
    """Host lists per row: [(logprob, rank, [(id, logprob)...top-n]), ...] for `width` tokens each.
    `rows`: the rows in the order of `lp`'s entries, or row -> its place there (row i's entries
    are then `lp`'s rows rows[i] * width..)."""
    at = rows if isinstance(rows, dict) else {row: i for i, row in enumerate(rows)}
    vals, ranks = lp.token_logprob.tolist(), lp.token_rank.tolist()
    top_ids, top_lps = lp.top_ids.tolist(), lp.top_logprobs.tolist()
    out = {}
    for row, i in at.items():
        n = num_top[row]
        entries = []
        for j in range(i * width, (i + 1) * width):
            entries.append((vals[j], ranks[j], list(zip(top_ids[j][:n], top_lps[j][:n], strict=True))))
        out[row] = entries
    return out


def _picker(rows: list[int], device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x[rows]: a view when the rows are 0..n-1 (the usual case), else one gather."""
    if rows == list(range(len(rows))):
        return lambda x: x[: len(rows)]
    idx = to_device_no_sync(rows, torch.long, device)
    return lambda x: x.index_select(0, idx)
