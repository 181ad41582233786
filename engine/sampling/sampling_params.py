"""Per-request sampling parameters, validated where they are built.

`logprobs=None` asks for no logprob work; `logprobs=0` gives the sampled token's logprob and
rank; `logprobs=n` (n <= 20) adds the top-n alternatives. `prompt_logprobs` is the same for
every prompt token after the first (vLLM's). Penalties and `logit_bias` (applied by
engine/sampling/penalties.py) and `n` (engine/sched/fork.py) are range-checked by `check_surface`. `structured`
(engine/grammar/compiler.py) needs EOS among the request's stop ids: `engine.engine.resolve_request` checks it
(nodes get ignore_eos=True with the router's resolved stop ids, EOS among them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.grammar.structured import StructuredSpec

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
    presence_penalty: float = 0.0  # OpenAI's: minus this once a token is in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this times the token's count in the output
    repetition_penalty: float = 1.0  # vLLM's: logits of prompt and output tokens / (> 0) or * (<= 0) it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) added to the logits
    n: int = 1  # choices sampled from one prompt, sharing its KV blocks
    prompt_logprobs: int | None = None  # 0..20: logprobs of the prompt's tokens (+ top-n)
    resumed_tokens: int = 0  # a moved request: its prompt's last tokens were output (penalties count them)
    structured: StructuredSpec | None = None  # the output must match this (engine/grammar/compiler.py)

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
        check_surface(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether any penalty or bias changes the logits before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


MAX_N = 16
MAX_LOGIT_BIAS = 1024
MAX_BIAS = 100.0


def check_surface(p: SamplingParams) -> None:
    """Penalties, logit_bias, n, prompt_logprobs and resumed_tokens in range (ValueError)."""
    for name in ("presence_penalty", "frequency_penalty"):
        if not -2.0 <= getattr(p, name) <= 2.0:
            raise ValueError(f"{name} must be in [-2, 2], got {getattr(p, name)}")
    if not 0.0 < p.repetition_penalty <= 100.0:
        raise ValueError(f"repetition_penalty must be in (0, 100], got {p.repetition_penalty}")
    if len(p.logit_bias) > MAX_LOGIT_BIAS:
        raise ValueError(f"logit_bias has {len(p.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    if any(t < 0 or not -MAX_BIAS <= b <= MAX_BIAS for t, b in p.logit_bias):
        raise ValueError(f"logit_bias maps token ids >= 0 to biases in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
    if not 1 <= p.n <= MAX_N:
        raise ValueError(f"n must be in 1..{MAX_N}, got {p.n}")
    if p.prompt_logprobs is not None and not 0 <= p.prompt_logprobs <= MAX_LOGPROBS:
        raise ValueError(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {p.prompt_logprobs}")
    if p.resumed_tokens < 0:
        raise ValueError(f"resumed_tokens must be >= 0, got {p.resumed_tokens}")
