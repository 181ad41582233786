"""Request validation and tokenization: a client `GenerateRequest` -> a `Prepared` request.

Receives the raw protobuf from the network; hands the lifecycle a `Prepared` with the prompt
as token ids, the node-side `Sampling` (seed resolved, stop ids = EOS unless ignored + the
request's, max_tokens clipped to the context) and the router-side options (stop strings,
deadline). Every rule failure raises `InvalidRequest` with a message meant for the client;
the router answers INVALID_ARGUMENT and keeps serving. Never talks to a node.

Cheap checks run first (sizes, sampling, ids), so a huge or bad request is refused before
any tokenization work. A structured-output spec is compiled (router/structured_api.py) in a
worker thread: the compile, and xgrammar's first import, never block the event loop.
"""

from __future__ import annotations

import asyncio
import math
import random
import uuid
from dataclasses import dataclass
from typing import Any

from engine.grammar.structured import NEEDS_EOS
from protos import node_pb2, pdserve_pb2
from router.structured_api import StructuredError, check_wire
from router.validate_surface import SurfaceError, check_surface, node_fields

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 32
MAX_STOP_CHARS = 256
MAX_REQUEST_ID_CHARS = 200  # node-side ids add "<router>/" and "/<attempt>"; nodes take 256
MAX_SEED = 2**63 - 1
TOKENIZE_IN_THREAD_CHARS = 8192  # longer prompts are tokenized off the event loop


class InvalidRequest(ValueError):
    """A request the router refuses with INVALID_ARGUMENT."""


@dataclass(frozen=True)
class Limits:
    model_name: str
    vocab_size: int
    max_model_len: int
    max_prompt_bytes: int
    default_timeout_s: float


@dataclass
class Prepared:
    request_id: str
    prompt_ids: list[int]
    sampling: node_pb2.Sampling  # what P and D get
    stop: tuple[str, ...]  # stop strings, applied by the router
    logprobs: int | None
    timeout_s: float

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens


async def prepare(req: pdserve_pb2.GenerateRequest, tokenizer: Any, eos_ids: tuple[int, ...],
                  limits: Limits, rng: random.Random) -> Prepared:
    """Validate and tokenize `req`; raises InvalidRequest."""
    ids = check_cheap(req, tokenizer, limits)
    if req.sampling.structured:
        if req.sampling.ignore_eos:
            raise InvalidRequest(NEEDS_EOS)
        await check_structured(req.sampling.structured)
    prompt_ids = ids if ids is not None else await tokenize(req, tokenizer)
    if not prompt_ids:
        raise InvalidRequest("the prompt tokenizes to no tokens")
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(f"prompt is {len(prompt_ids)} tokens; the context is {limits.max_model_len} "
                             f"(room for >= 1 output token needed)")
    s = req.sampling
    stop_ids = [*s.stop_token_ids, *(() if s.ignore_eos else eos_ids)]
    sampling = node_pb2.Sampling(
        temperature=s.temperature, top_p=s.top_p if s.top_p > 0 else 1.0, top_k=s.top_k,
        seed=s.seed if s.HasField("seed") else rng.getrandbits(62),
        max_tokens=min(s.max_tokens, limits.max_model_len - len(prompt_ids)),
        logprobs=s.logprobs if s.HasField("logprobs") else -1,
        stop_token_ids=list(dict.fromkeys(stop_ids)), **node_fields(s),
    )
    return Prepared(req.request_id or uuid.uuid4().hex, prompt_ids, sampling, tuple(s.stop),
                    s.logprobs if s.HasField("logprobs") else None,
                    req.timeout_s if req.timeout_s > 0 else limits.default_timeout_s)


async def check_structured(wire: str) -> None:
    """The request's structured-output spec parses and compiles (off the loop); InvalidRequest."""
    try:
        await asyncio.to_thread(check_wire, wire)
    except StructuredError as e:
        raise InvalidRequest(str(e)) from None


def check_cheap(req: pdserve_pb2.GenerateRequest, tokenizer: Any, limits: Limits) -> list[int] | None:
    """Everything that needs no tokenization; the prompt's ids when it came as ids (read from the
    message once: each read of a repeated field makes its ints anew), else None."""
    ids = None
    if len(req.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequest(f"request_id is over {MAX_REQUEST_ID_CHARS} characters")
    if req.model and req.model != limits.model_name:
        raise InvalidRequest(f"unknown model {req.model!r}; this router serves {limits.model_name!r}")
    has_text, has_ids = bool(req.prompt), bool(req.prompt_token_ids)
    if has_text == has_ids:
        raise InvalidRequest("give exactly one of prompt (text) and prompt_token_ids"
                             if has_text else "the prompt is empty: give prompt (text) or prompt_token_ids")
    if has_text:
        size = len(req.prompt.encode("utf-8", errors="surrogatepass"))
        if size > limits.max_prompt_bytes:
            raise InvalidRequest(f"prompt is {size} bytes; the limit is {limits.max_prompt_bytes}")
        if tokenizer is None:
            raise InvalidRequest("this model has no tokenizer; send prompt_token_ids")
    else:
        if req.chat:
            raise InvalidRequest("chat=true needs a text prompt, not prompt_token_ids")
        n = len(req.prompt_token_ids)
        if n >= limits.max_model_len:
            raise InvalidRequest(f"prompt is {n} tokens; the context is {limits.max_model_len} "
                                 f"(room for >= 1 output token needed)")
        ids = list(req.prompt_token_ids)
        _check_ids(ids, limits.vocab_size, "prompt_token_ids")
    if not (req.timeout_s >= 0 and math.isfinite(req.timeout_s)):
        raise InvalidRequest(f"timeout_s must be >= 0 (0 = the router's default), got {req.timeout_s}")
    check_sampling(req.sampling, tokenizer, limits)
    return ids


def check_sampling(s: pdserve_pb2.SamplingOptions, tokenizer: Any, limits: Limits) -> None:
    if s.max_tokens <= 0:
        raise InvalidRequest(f"max_tokens must be > 0, got {s.max_tokens}")
    if not (s.temperature >= 0 and math.isfinite(s.temperature)):
        raise InvalidRequest(f"temperature must be >= 0, got {s.temperature}")
    if not (0 <= s.top_p <= 1):
        raise InvalidRequest(f"top_p must be in (0, 1] (0 means off), got {s.top_p}")
    if s.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0 means off), got {s.top_k}")
    if s.HasField("logprobs") and not 0 <= s.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in 0..{MAX_LOGPROBS}, got {s.logprobs}")
    if s.HasField("seed") and s.seed > MAX_SEED:
        raise InvalidRequest(f"seed must be in 0..2**63-1, got {s.seed}")
    if len(s.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(s.stop)}")
    if any(not 0 < len(x) <= MAX_STOP_CHARS for x in s.stop):
        raise InvalidRequest(f"stop strings must be 1..{MAX_STOP_CHARS} characters")
    if s.stop and tokenizer is None:
        raise InvalidRequest("stop strings need a tokenizer, and this model has none")
    _check_ids(s.stop_token_ids, limits.vocab_size, "stop_token_ids")
    try:
        check_surface(s, limits.vocab_size)  # penalties, logit_bias, n, prompt_logprobs
    except SurfaceError as e:
        raise InvalidRequest(str(e)) from None


def _check_ids(ids: Any, vocab: int, what: str) -> None:
    if not ids or (min(ids) >= 0 and max(ids) < vocab):  # by the bounds: a prompt's thousands of ids at C speed
        return
    bad = next(t for t in ids if not 0 <= t < vocab)
    raise InvalidRequest(f"{what} has token id {bad} outside the vocabulary (0..{vocab - 1})")


async def tokenize(req: pdserve_pb2.GenerateRequest, tokenizer: Any) -> list[int]:
    """The text prompt as ids, as `pdserve generate` does locally: through the chat template when
    `chat` is set and the model has one (no added special tokens), else plain with BOS."""
    if len(req.prompt) > TOKENIZE_IN_THREAD_CHARS:
        return await asyncio.to_thread(encode_prompt, tokenizer, req.prompt, req.chat)
    return encode_prompt(tokenizer, req.prompt, req.chat)


def encode_prompt(tokenizer: Any, text: str, chat: bool) -> list[int]:
    if chat:
        return encode_messages(tokenizer, [{"role": "user", "content": text}])
    try:
        return list(tokenizer.encode(text, add_special_tokens=True))
    except Exception as e:  # unencodable text
        raise InvalidRequest(f"cannot tokenize the prompt: {e}") from None


def encode_messages(tokenizer: Any, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """A conversation through the model's chat template (no added special tokens), with `tools`
    when the template renders them (router/tool_api.py). A model with no template takes one user
    message, encoded plain with BOS (as `pdserve generate` does)."""
    if tokenizer is None:
        raise InvalidRequest("this model has no tokenizer; send prompt_token_ids")
    if not getattr(tokenizer, "has_chat_template", False):
        if len(messages) == 1 and messages[0]["role"] == "user":
            return encode_prompt(tokenizer, messages[0]["content"], chat=False)
        raise InvalidRequest("this model has no chat template: send a single user message")
    try:
        extra = {"tools": tools} if tools else {}
        rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, **extra)
        return list(tokenizer.encode(rendered, add_special_tokens=False))
    except Exception as e:  # template errors (raise_exception), unencodable text
        raise InvalidRequest(f"cannot tokenize the prompt: {e}") from None
