"""The OpenAI request surface beyond plain sampling, checked at the router's door: penalties,
logit_bias, n, prompt_logprobs and the structured-output spec's size of a client `SamplingOptions`,
and their node `Sampling` form (the spec is compiled by router/validate.py).

Receives the client protobuf (untrusted; the HTTP door has turned OpenAI's JSON into it) and
raises `InvalidRequest` naming the field at fault; hands router/validate.py the node-side fields.
The nodes check the same ranges again (engine/sampling/sampling_params.py `check_surface`): what the router
accepts they accept, nothing more.
"""

from __future__ import annotations

import math
from typing import Any

from engine.grammar.structured import MAX_SPEC_CHARS
from engine.sampling.sampling_params import MAX_BIAS, MAX_LOGIT_BIAS, MAX_N
from protos import pdserve_pb2

MAX_PROMPT_LOGPROBS = 20
MAX_STRUCTURED_CHARS = 2 * MAX_SPEC_CHARS + 64  # a wire spec: its value JSON-escaped (engine/grammar/structured.py)


class SurfaceError(ValueError):
    """A surface field out of range (router/validate.py turns it into InvalidRequest)."""


def check_surface(s: pdserve_pb2.SamplingOptions, vocab: int) -> None:
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(s, name)
        if not -2.0 <= v <= 2.0:
            raise SurfaceError(f"{name} must be in [-2, 2], got {v}")
    if not (s.repetition_penalty == 0 or 0 < s.repetition_penalty <= 100):
        raise SurfaceError(f"repetition_penalty must be in (0, 100] (1 or 0 means off), got {s.repetition_penalty}")
    if len(s.logit_bias) > MAX_LOGIT_BIAS:
        raise SurfaceError(f"logit_bias has {len(s.logit_bias)} entries; at most {MAX_LOGIT_BIAS}")
    for token, bias in s.logit_bias.items():
        if not 0 <= token < vocab:
            raise SurfaceError(f"logit_bias has token id {token} outside the vocabulary (0..{vocab - 1})")
        if not (math.isfinite(bias) and -MAX_BIAS <= bias <= MAX_BIAS):
            raise SurfaceError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}")
    if not 0 <= s.n <= MAX_N:
        raise SurfaceError(f"n must be in 1..{MAX_N}, got {s.n}")
    if s.HasField("prompt_logprobs") and not 0 <= s.prompt_logprobs <= MAX_PROMPT_LOGPROBS:
        raise SurfaceError(f"prompt_logprobs must be in 0..{MAX_PROMPT_LOGPROBS}, got {s.prompt_logprobs}")
    if len(s.structured) > MAX_STRUCTURED_CHARS:
        raise SurfaceError(f"structured is {len(s.structured)} characters; at most {MAX_STRUCTURED_CHARS}")


def node_fields(s: pdserve_pb2.SamplingOptions) -> dict[str, Any]:
    """The node `Sampling` fields of the surface (checked already)."""
    return {"presence_penalty": s.presence_penalty, "frequency_penalty": s.frequency_penalty,
            "repetition_penalty": s.repetition_penalty or 1.0, "logit_bias": dict(s.logit_bias), "n": s.n or 1,
            "prompt_logprobs": s.prompt_logprobs if s.HasField("prompt_logprobs") else -1,
            "structured": s.structured}
