"""Penalties and logit bias: the logits a request samples from, given the tokens it has seen.

Applied in this order to fp32 logits, before temperature, top-k and top-p (vLLM's order: the
bias is a logits processor that runs before its penalties); logprobs stay those of the raw
logits (vLLM's default `raw_logprobs`):

    logit_bias (OpenAI)     x[t] += bias[t]
    repetition (vLLM / HF)  for t in the prompt or the output: x[t] / r if x[t] > 0 else x[t] * r
    frequency (OpenAI)      x[t] -= f * count(t in the output)
    presence (OpenAI)       x[t] -= p * (count(t in the output) > 0)

State per slot (`PenaltyState`, owned by BatchState; its [S, V] tensors are made when the
first penalized request arrives, like the draft probabilities): output token counts (int32),
the prompt's tokens (bool), the bias (fp32) and the three scalars. Inserts write it with
scatters from host lists (stream-ordered); the decode step advances the counts itself with the
tokens it emitted (`count_no_sync`), so the host never reads it.

MTP: verify position i scores the token after [last, d_1..d_i], and it is only used when d_1..d_i
were accepted, so it is penalized as if they were output (`verify_penalties`): every emitted token
comes from exactly the distribution plain decoding would sample it from. Drafts themselves are
drawn unpenalized (a draft only decides how many tokens a step keeps: exactness does not depend
on it, acceptance does). The decode step reads the state rows through one kernel
(`PenaltyState.penalize_rows`, kernels/penalties.py, which also holds the formulas: `penalize`)
and counts its emitted tokens with another (atomic integer adds: the same counts in any order).

Must never sync with the device: this runs inside the decode step's CUDA graphs (no `.item()`,
no boolean-mask indexing, no value-dependent shapes; scatters, never `index_put_` with
accumulate).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from engine.sampling.sampling_params import SamplingParams
from kernels.penalties import count_emitted, penalize, penalize_rows, verify_penalize


@dataclass(frozen=True)
class Penalties:
    """Per-row penalty inputs for N rows of logits."""

    presence: Tensor  # [N] fp32
    frequency: Tensor  # [N] fp32
    repetition: Tensor  # [N] fp32; 1 = off
    bias: Tensor  # [N, V] fp32
    counts: Tensor  # [N, V] int32: each token's count in the output
    prompt: Tensor  # [N, V] bool: the token is in the prompt


def apply_penalties(logits: Tensor, p: Penalties) -> Tensor:
    """[N, V] fp32 penalized logits."""
    return penalize(logits.float(), p.bias, p.prompt, p.counts, p.presence[:, None], p.frequency[:, None],
                    p.repetition[:, None])


def verify_penalties(logits: Tensor, p: Penalties, drafts: Tensor) -> Tensor:
    """[R, k+1, V] fp32: verify position i penalized with drafts d_1..d_i counted as output."""
    return verify_penalize(logits, drafts, p.presence, p.frequency, p.repetition, p.bias, p.counts, p.prompt)


@dataclass(frozen=True)
class PenaltyInit:
    """What a penalized request brings to its slot (host values)."""

    presence: float
    frequency: float
    repetition: float
    bias: tuple[tuple[int, float], ...]
    prompt: list[int]  # tokens the repetition penalty counts as the prompt's
    output: list[int]  # tokens output so far

    @classmethod
    def of(cls, params: SamplingParams, prompt: list[int], output: list[int]) -> PenaltyInit | None:
        """None when `params` has no penalty. A moved request's last `resumed_tokens` prompt
        tokens were output: they count as output."""
        if not params.penalized:
            return None
        cut = len(prompt) - min(params.resumed_tokens, len(prompt))
        return cls(params.presence_penalty, params.frequency_penalty, params.repetition_penalty,
                   params.logit_bias, prompt[:cut], prompt[cut:] + output)


class _Pairs:
    """Host lists of (row, token[, value]) to scatter into [rows, V] tensors."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.prompt: list[int] = []
        self.counts: list[int] = []
        self.bias: list[int] = []
        self.bias_values: list[float] = []

    def add(self, row: int, init: PenaltyInit) -> None:
        base = row * self.vocab
        if init.repetition != 1.0:
            self.prompt += [base + t for t in set(init.prompt)]
        self.counts += [base + t for t in init.output]
        self.bias += [base + t for t, _ in init.bias]
        self.bias_values += [b for _, b in init.bias]

    def scatter_no_sync(self, prompt: Tensor, counts: Tensor, bias: Tensor) -> None:
        dev = prompt.device
        if self.prompt:
            prompt.view(-1).scatter_(0, _h2d(self.prompt, torch.int64, dev), True)
        if self.counts:
            index = _h2d(self.counts, torch.int64, dev)
            counts.view(-1).scatter_add_(0, index, torch.ones_like(index, dtype=counts.dtype))
        if self.bias:
            bias.view(-1).scatter_(0, _h2d(self.bias, torch.int64, dev), _h2d(self.bias_values, torch.float32, dev))


def _h2d(values: list, dtype: torch.dtype, device: torch.device) -> Tensor:
    host = torch.tensor(values, dtype=dtype)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def prefill_penalties(inits: list[PenaltyInit | None], vocab: int, device: torch.device) -> Penalties | None:
    """Penalties for the rows of a prefill step (None: no row has any)."""
    if all(i is None for i in inits):
        return None
    n = len(inits)
    pairs = _Pairs(vocab)
    for row, init in enumerate(inits):
        if init is not None:
            pairs.add(row, init)
    out = Penalties(*_scalars(inits, device), bias=torch.zeros(n, vocab, device=device),
                    counts=torch.zeros(n, vocab, dtype=torch.int32, device=device),
                    prompt=torch.zeros(n, vocab, dtype=torch.bool, device=device))
    pairs.scatter_no_sync(out.prompt, out.counts, out.bias)
    return out


def _scalars(inits: list[PenaltyInit | None], device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    rows = [(i.presence, i.frequency, i.repetition) if i is not None else (0.0, 0.0, 1.0) for i in inits]
    t = _h2d(rows, torch.float32, device)
    return t[:, 0], t[:, 1], t[:, 2]


class PenaltyState:
    """Per-slot penalty state on the device (module docstring); `rows` includes the spare slot."""

    def __init__(self, rows: int, vocab: int, device: torch.device) -> None:
        self.rows, self.vocab, self.device = rows, vocab, torch.device(device)
        self.presence = torch.zeros(rows, device=device)
        self.frequency = torch.zeros(rows, device=device)
        self.repetition = torch.ones(rows, device=device)
        self.counts: Tensor | None = None
        self.prompt: Tensor | None = None
        self.bias: Tensor | None = None

    @property
    def enabled(self) -> bool:
        return self.counts is not None

    def ensure(self) -> None:
        if self.counts is None:
            shape, dev = (self.rows, self.vocab), self.device
            self.counts = torch.zeros(shape, dtype=torch.int32, device=dev)
            self.prompt = torch.zeros(shape, dtype=torch.bool, device=dev)
            self.bias = torch.zeros(shape, device=dev)

    def view(self, rows: Tensor) -> Penalties:
        """The inputs of state rows `rows` (gathers: a graph reads them at replay)."""
        assert self.counts is not None and self.prompt is not None and self.bias is not None
        return Penalties(self.presence[rows], self.frequency[rows], self.repetition[rows], self.bias[rows],
                         self.counts[rows], self.prompt[rows])

    def insert_no_sync(self, inits: list[tuple[int, PenaltyInit | None]]) -> None:
        """Write inserted slots: a penalized one gets its state, any other a neutral one (once
        the state exists: a slot may hold a penalized request's leftovers). Stream-ordered."""
        if not self.enabled and all(init is None for _, init in inits):
            return
        self.ensure()
        assert self.counts is not None and self.prompt is not None and self.bias is not None
        slots = _h2d([s for s, _ in inits], torch.int64, self.device)
        presence, frequency, repetition = _scalars([init for _, init in inits], self.device)
        self.presence[slots], self.frequency[slots], self.repetition[slots] = presence, frequency, repetition
        for t in (self.counts, self.prompt, self.bias):
            t.index_fill_(0, slots, 0)
        pairs = _Pairs(self.vocab)
        for slot, init in inits:
            if init is not None:
                pairs.add(slot, init)
        pairs.scatter_no_sync(self.prompt, self.counts, self.bias)

    def penalize_rows(self, logits: Tensor, rows: Tensor, drafts: Tensor) -> Tensor:
        """`verify_penalties(logits, self.view(rows), drafts)` in one kernel that reads the state
        rows itself (kernels/penalties.py): no [R, V] gathers."""
        assert self.counts is not None and self.prompt is not None and self.bias is not None
        return penalize_rows(logits, rows, drafts, self.presence, self.frequency, self.repetition, self.bias,
                             self.counts, self.prompt)

    def count_no_sync(self, rows: Tensor, tokens: Tensor, num_emitted: Tensor) -> None:
        """Add a step's emitted tokens (the first `num_emitted[r]` of `tokens[r]`) to the counts."""
        assert self.counts is not None
        count_emitted(self.counts, rows, tokens, num_emitted)
