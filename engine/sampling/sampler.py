"""Sampling and logprobs: turns a batch of logits into token ids, on the device, without syncing.

Receives: logits `[N, V]` (any float dtype, any device; computed on in fp32), one
`SamplingTensors` row per logits row, and each row's sequence position.
Hands on: sampled token ids `[N]` int64 (still on the device), the processed distribution
(`processed_probs`, which speculative verification needs), and `LogprobsTensors`.

Randomness is counter-based: the noise behind a token is a pure function of
(request seed, the token's position in the sequence, a stream id, vocab index), computed by
`uniform_noise`. No generator state exists, so a request's tokens do not depend on which other
requests share its batch, and a prefill node and a decode node (separate processes) draw the
same tokens as a single-process engine given the same seed.

Must never: sync with the device (`.item()`, `.tolist()`, `.cpu()`, `nonzero`, boolean-mask
indexing, python loops over rows, shapes that depend on values). Every function here runs
inside the decode loop under `torch.cuda.set_sync_debug_mode("error")`; the only host-side
decision (`all_greedy`, `needs_filter`) is a python bool fixed when the batch is built.

Careful when editing `_mix32`: the hash works on int64 tensors holding 32-bit values; every
intermediate stays below 2**63 and every value that is shifted right is non-negative (an
arithmetic shift of a negative int64 would smear the sign bit in). Changing a constant changes
every seeded sample the service has ever produced.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch
from torch import Tensor

from engine.sampling.sampling_params import SamplingParams

STREAM_SAMPLE = 0  # the target token at a position (plain sampling, residual and bonus tokens)
STREAM_DRAFT = 1  # the MTP draft token at a position
STREAM_ACCEPT = 2  # the accept/reject uniform for the draft at a position

_MASK32 = 0xFFFFFFFF
_GOLDEN = 0x9E3779B9
_UNIFORM_BITS = 23  # (m + 0.5) / 2**23 is exact in fp32 and lies strictly inside (0, 1)

_Word = TypeVar("_Word", int, Tensor)


@dataclass(frozen=True)
class SamplingTensors:
    """Per-row sampling parameters as device tensors (one row per sequence or per verify position).

    `all_greedy` and `needs_filter` are host-side flags fixed at construction, so that
    branching on them never reads the device.
    """

    temperature: Tensor  # [N] float32; 0 => greedy
    top_k: Tensor  # [N] int64; 0 => off
    top_p: Tensor  # [N] float32; 1 => off
    seed: Tensor  # [N] int64
    all_greedy: bool = False
    needs_filter: bool = True  # some sampled row uses top-k or top-p (skip the sort when False)

    @classmethod
    def from_params(
        cls, params: list[SamplingParams], seeds: list[int], device: torch.device | str
    ) -> SamplingTensors:
        """Builds the tensors on the host and copies them (non-blocking when pinned) to `device`.

        `seeds` are the resolved per-request seeds (the engine draws one when `params.seed` is None).
        """
        if len(params) != len(seeds):
            raise ValueError(f"{len(params)} params but {len(seeds)} seeds")
        sampled = [p for p in params if not p.greedy]
        return cls(
            temperature=_to_device([p.temperature for p in params], torch.float32, device),
            top_k=_to_device([p.top_k for p in params], torch.int64, device),
            top_p=_to_device([p.top_p for p in params], torch.float32, device),
            seed=_to_device(seeds, torch.int64, device),
            all_greedy=not sampled,
            needs_filter=any(p.top_k > 0 or p.top_p < 1.0 for p in sampled),
        )

    @property
    def num_rows(self) -> int:
        return self.temperature.shape[0]

    def repeat_interleave(self, n: int) -> SamplingTensors:
        """Each row `n` times in a row (for the k+1 verify positions of a sequence)."""
        return SamplingTensors(
            temperature=self.temperature.repeat_interleave(n),
            top_k=self.top_k.repeat_interleave(n),
            top_p=self.top_p.repeat_interleave(n),
            seed=self.seed.repeat_interleave(n),
            all_greedy=self.all_greedy,
            needs_filter=self.needs_filter,
        )


@dataclass(frozen=True)
class LogprobsTensors:
    """Logprobs of the raw logits (fp32, before temperature/top-k/top-p)."""

    token_logprob: Tensor  # [N] float32: logprob of the chosen token
    token_rank: Tensor  # [N] int64: 1 + number of vocab entries with a strictly greater logprob
    top_ids: Tensor  # [N, num_top] int64, by decreasing logprob
    top_logprobs: Tensor  # [N, num_top] float32


def _to_device(values: list, dtype: torch.dtype, device: torch.device | str) -> Tensor:
    host = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# ---------------------------------------------------------------- counter-based noise


def _mul32(x: _Word, c: int) -> _Word:
    """(x * c) mod 2**32 for `x` in [0, 2**32); split in 16-bit halves to stay < 2**63."""
    lo = x * (c & 0xFFFF)  # < 2**48
    hi = ((x * (c >> 16)) & 0xFFFF) << 16  # < 2**32
    return (lo + hi) & _MASK32


def _mix32(x: _Word) -> _Word:
    """A 32-bit bijective integer hash (Wellons' lowbias32); int64 tensors or python ints."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _row_hash(seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """[N] 32-bit hash of (seed, position, stream); every bit of seed and position counts."""
    h = torch.full_like(seed, _mix32((stream * _GOLDEN + 1) & _MASK32))
    words = (seed & _MASK32, (seed >> 32) & _MASK32, position & _MASK32, (position >> 32) & _MASK32)
    for word in words:
        h = _mix32(((h ^ word) + _GOLDEN) & _MASK32)
    return h


def _to_uniform(h: Tensor) -> Tensor:
    """32-bit hash -> float32 uniform in [2**-24, 1 - 2**-24] (never 0 or 1)."""
    m = (h >> (32 - _UNIFORM_BITS)).to(torch.float32)
    return (m + 0.5) * (2.0**-_UNIFORM_BITS)


def uniform_noise(seed: Tensor, position: Tensor, stream: int, width: int | None = None) -> Tensor:
    """Uniforms in (0, 1): `[N]`, or `[N, width]` with one per vocab index when `width` is set.

    A pure function of (seed[i], position[i], stream[, vocab index]); no generator, no sync.
    """
    h = _row_hash(seed.to(torch.int64), position.to(torch.int64), stream)
    if width is None:
        return _to_uniform(h)
    vocab = _mix32(torch.arange(width, device=seed.device, dtype=torch.int64) * 2 + 1)
    return _to_uniform(_mix32(h[:, None] ^ vocab[None, :]))


# ---------------------------------------------------------------- distributions and sampling


def processed_probs(logits: Tensor, st: SamplingTensors) -> Tensor:
    """[N, V] float32: temperature, then top-k, then top-p, renormalized.

    top-k keeps every entry tied with the k-th largest; top-p keeps the smallest prefix of the
    (stably) sorted distribution whose mass reaches top_p, always including the top token.
    Greedy rows (temperature 0) are one-hot at the argmax (first index on ties).
    """
    x = logits.to(torch.float32)
    greedy = st.temperature <= 0
    temp = torch.where(greedy, torch.ones_like(st.temperature), st.temperature)
    x = x / temp[:, None]
    if st.needs_filter:
        x = x.masked_fill(~_filter_mask(x, st), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    one_hot = _one_hot_argmax(logits)
    return torch.where(greedy[:, None], one_hot, probs)


def _filter_mask(x: Tensor, st: SamplingTensors) -> Tensor:
    """[N, V] bool: the entries top-k and top-p keep, for temperature-scaled logits `x`."""
    sorted_x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    vocab = x.shape[-1]
    k = torch.where(st.top_k > 0, st.top_k, torch.full_like(st.top_k, vocab)).clamp(1, vocab)
    kth = sorted_x.gather(-1, (k - 1)[:, None])
    keep = sorted_x >= kth
    probs = torch.softmax(sorted_x.masked_fill(~keep, float("-inf")), dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    top_p_off = (st.top_p >= 1.0)[:, None]
    keep = keep & ((mass_before < st.top_p[:, None]) | top_p_off)  # column 0: mass_before == 0
    return torch.zeros_like(keep).scatter(-1, order, keep)


def _one_hot_argmax(logits: Tensor) -> Tensor:
    """[N, V] float32 one-hot at the argmax of each row (first index on ties)."""
    out = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)
    return out.scatter(-1, logits.argmax(dim=-1, keepdim=True), 1.0)


def race(weights: Tensor, seed: Tensor, position: Tensor, stream: int) -> Tensor:
    """[N] int64: a draw from each row of unnormalized `weights` [N, V] (exponential race).

    argmax_i w_i / E_i with E_i = -log(u_i) i.i.d. Exp(1) picks i with probability w_i / sum(w).
    Rows must have some positive weight; zero-weight entries never win.
    """
    u = uniform_noise(seed, position, stream, weights.shape[-1])
    return (weights.to(torch.float32) / -torch.log(u)).argmax(dim=-1)


def sample(
    logits: Tensor, st: SamplingTensors, positions: Tensor, stream: int = STREAM_SAMPLE
) -> Tensor:
    """[N] int64 token ids: the argmax for greedy rows, else a draw from `processed_probs`.

    `positions[i]` is the sequence position of the token being sampled; with the row's seed and
    `stream` it fixes the noise, so the result does not depend on the rest of the batch.
    """
    greedy_ids = logits.argmax(dim=-1)
    if st.all_greedy:
        return greedy_ids
    drawn = race(processed_probs(logits, st), st.seed, positions, stream)
    return torch.where(st.temperature <= 0, greedy_ids, drawn)


# ---------------------------------------------------------------- logprobs


def compute_logprobs(logits: Tensor, token_ids: Tensor, num_top: int) -> LogprobsTensors:
    """Logprobs of `token_ids` [N] and the top `num_top` (may be 0) under log_softmax(logits).

    Uses the raw logits in fp32, not the temperature/top-k/top-p distribution. Rank counts the
    entries with a strictly greater logprob, so tied tokens share the best rank. Among tied
    values the order of `top_ids` is whatever `torch.topk` gives.
    """
    logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
    token_logprob = logprobs.gather(-1, token_ids.to(torch.int64)[:, None])
    token_rank = (logprobs > token_logprob).sum(dim=-1) + 1
    top_logprobs, top_ids = torch.topk(logprobs, num_top, dim=-1)
    return LogprobsTensors(
        token_logprob=token_logprob[:, 0],
        token_rank=token_rank,
        top_ids=top_ids,
        top_logprobs=top_logprobs,
    )
