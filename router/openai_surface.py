"""The OpenAI request fields beyond plain sampling, as router/openai_protocol.py reads them:
`n`, `best_of`, `presence_penalty`, `frequency_penalty`, vLLM's `repetition_penalty`, `logit_bias`
(JSON keys are token ids as strings), vLLM's `prompt_logprobs`, and structured outputs (read by
router/structured_api.py); tools are router/tool_api.py's; and the fields this server does not do (`UNSUPPORTED`), refused by
name rather than ignored.

Receives the parsed body (pydantic has checked the types); hands `build_request` keyword
arguments, or raises `InvalidRequest` naming the field. Ranges are checked again on the
protobuf by router/validate_surface.py (the gRPC door's rules); the ones here only keep what
JSON can hold (2**70, 1e308) from reaching a protobuf field as something else.
"""

from __future__ import annotations

from typing import Any

from engine.grammar.structured import StructuredSpec
from engine.sampling.sampling_params import MAX_LOGPROBS, MAX_N
from router.structured_api import StructuredError, spec_of
from router.validate import InvalidRequest

INT32 = 2**31


# Fields vLLM (or OpenAI) take that change what comes back, and pdserve does not do: a 400 names
# them unless they hold their neutral value. Structured outputs (`response_format`, vLLM's
# `structured_outputs` and `guided_json`/`_regex`/`_choice`/`_grammar`) are router/structured_api.py's;
# their backend and whitespace knobs are not taken (only null passes).
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "min_p": (0, 0.0), "min_tokens": (0,), "use_beam_search": (False,), "length_penalty": (1, 1.0),
    "bad_words": ([],), "allowed_token_ids": (), "include_stop_str_in_output": (False,),
    "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,), "truncate_prompt_tokens": (),
    "prompt_embeds": (), "logits_processors": (), "return_tokens_as_token_ids": (False,),
    "functions": ([],), "function_call": ("none",),
    "audio": (), "prediction": (), "continue_final_message": (False,), "add_generation_prompt": (True,),
    "chat_template": (), "documents": (), "modalities": (["text"],),
    "guided_decoding_backend": (), "guided_whitespace_pattern": (),
}


def check_unsupported(extra: dict[str, Any] | None) -> None:
    """A 400 naming the first field of `UNSUPPORTED` the body sets to something else than neutral
    (null is always neutral)."""
    for name, value in (extra or {}).items():
        if name in UNSUPPORTED and value is not None and value not in UNSUPPORTED[name]:
            raise InvalidRequest(f"{name} is not supported by this server (got {str(value)[:40]!r})")


def surface_kwargs(req: Any) -> dict[str, Any]:
    """build_request's penalty, bias, n, prompt_logprobs and structured arguments from an OpenAI body."""
    check_unsupported(req.model_extra)
    n = 1 if req.n is None else req.n
    if not 1 <= n <= MAX_N:
        raise InvalidRequest(f"n must be in 1..{MAX_N}, got {n}")
    if req.best_of not in (None, 1, n):
        raise InvalidRequest(f"best_of must be 1 or equal n (ranking best_of > n samples is not supported), "
                             f"got best_of={req.best_of}, n={n}")
    if req.prompt_logprobs is not None and req.stream:
        raise InvalidRequest("prompt_logprobs is not available with stream=true (as in vLLM)")
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must be in 0..{MAX_LOGPROBS}, got {req.prompt_logprobs}")
    if req.repetition_penalty is not None and not req.repetition_penalty > 0:
        raise InvalidRequest(f"repetition_penalty must be > 0 (1 is off), got {req.repetition_penalty}")
    return {"presence_penalty": _float("presence_penalty", req.presence_penalty),
            "frequency_penalty": _float("frequency_penalty", req.frequency_penalty),
            "repetition_penalty": _float("repetition_penalty", req.repetition_penalty),
            "logit_bias": _logit_bias(req.logit_bias), "n": n, "prompt_logprobs": req.prompt_logprobs,
            "structured": _structured(req)}


def _structured(req: Any) -> StructuredSpec | None:
    try:
        return spec_of(req)
    except StructuredError as e:
        raise InvalidRequest(str(e)) from None


def _float(name: str, v: float | None) -> float:
    if v is None:
        return 0.0
    if not abs(v) <= 1e6:  # NaN too; the exact range is validate_surface's
        raise InvalidRequest(f"{name} is out of range: {v}")
    return v


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float]:
    out = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}") from None
        if not 0 <= token < INT32:
            raise InvalidRequest(f"logit_bias has token id {token} outside the vocabulary")
        out[token] = _float(f"logit_bias[{key}]", value)
    return out
