"""Per-request sampling parameters, validated where they are built.

`logprobs=None` asks for no logprob work; `logprobs=0` gives the sampled token's logprob and
rank; `logprobs=n` (n <= 20) adds the top-n alternatives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    max_tokens: int = 64
    logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.temperature < math.inf:  # NaN and inf too: nothing to sample from
            raise ValueError(f"temperature must be >= 0 and finite, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MAX_LOGPROBS}, got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be in 0..2**63-1, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
