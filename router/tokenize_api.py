"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them (same request and response shapes).

Receives untrusted JSON bodies (pydantic checks every type; sizes and token ids are checked here)
and answers from the router's own tokenizer: no node is involved and nothing is queued.

  /tokenize   {"prompt": str, "add_special_tokens": true}                       (completion form)
              {"messages": [...], "add_generation_prompt": true, "add_special_tokens": false}  (chat form)
              -> {"count", "max_model_len", "tokens", "token_strs"}  (`return_token_strs` fills the last)
  /detokenize {"tokens": [int, ...]} -> {"prompt": str}

With the defaults, the chat form gives exactly the ids a chat completion feeds the model
(router/validate.py `encode_messages`), and the completion form those of a text completion.
Both need the API key when one is set (they are model work, as /v1 is). Never blocks the loop:
long inputs are tokenized in a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict

from router.openai_protocol import ChatMessage
from router.validate import InvalidRequest, Limits, encode_messages

IN_THREAD_CHARS = 8192


class Served(Protocol):
    """What these routes read of the router (router/http.py's `Lifecycle` has it)."""

    model: Any  # engine.model.info.ModelInfo: name, tokenizer, config.vocab_size
    limits: Limits
    max_model_len: int


@dataclass(frozen=True)
class TokenizeDoor:
    served: Served
    parse: Callable[[Request, type[BaseModel]], Awaitable[Any]]  # the body, checked; raises InvalidRequest
    denied: Callable[[Request], Response | None]  # 401 without the API key, else None

    def model_name(self) -> str:
        return str(self.served.model.name)

    def tokenizer(self) -> Any:
        return self.served.model.tokenizer

    def max_model_len(self) -> int:
        return self.served.max_model_len

    def vocab_size(self) -> int:
        return int(self.served.model.config.vocab_size)

    def max_prompt_bytes(self) -> int:
        return self.served.limits.max_prompt_bytes


class TokenizeRequest(BaseModel):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: `prompt` or `messages`."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


def add_tokenize_routes(app: FastAPI, door: TokenizeDoor) -> None:
    @app.post("/tokenize")
    async def tokenize(raw: Request) -> Response:
        return await _answer(door, raw, TokenizeRequest, _tokenize)

    @app.post("/detokenize")
    async def detokenize(raw: Request) -> Response:
        return await _answer(door, raw, DetokenizeRequest, _detokenize)


async def _answer(door: TokenizeDoor, raw: Request, model: type[BaseModel], work: Any) -> Response:
    if (denied := door.denied(raw)) is not None:
        return denied
    try:
        _, req = await door.parse(raw, model)
        if req.model not in (None, "", door.model_name()):
            return _error(404, f"the model {req.model!r} does not exist; this server serves {door.model_name()!r}")
        if door.tokenizer() is None:
            raise InvalidRequest("this model has no tokenizer")
        size = _input_size(req)
        if size > door.max_prompt_bytes():
            raise InvalidRequest(f"the input is {size} characters or tokens long; the limit is {door.max_prompt_bytes()}")
        body = await asyncio.to_thread(work, door, req) if size > IN_THREAD_CHARS else work(door, req)
    except InvalidRequest as e:
        return _error(400, str(e))
    return JSONResponse(body)


def _input_size(req: Any) -> int:
    if isinstance(req, DetokenizeRequest):
        return len(req.tokens)
    return sum(len(m.text()) for m in req.messages or ()) + len(req.prompt or "")


def _tokenize(door: TokenizeDoor, req: TokenizeRequest) -> dict:
    tok = door.tokenizer()
    if (req.prompt is None) == (req.messages is None):
        raise InvalidRequest("give exactly one of prompt and messages")
    if req.messages is not None:
        ids = _chat_ids(tok, req)
    else:
        ids = _encode(tok, req.prompt or "", True if req.add_special_tokens is None else req.add_special_tokens)
    strs = [_token_str(tok, i) for i in ids] if req.return_token_strs else None
    return {"count": len(ids), "max_model_len": door.max_model_len(), "tokens": ids, "token_strs": strs}


def _chat_ids(tok: Any, req: TokenizeRequest) -> list[int]:
    messages = [{"role": m.role, "content": m.text()} for m in req.messages or ()]
    if not messages:
        raise InvalidRequest("messages is empty")
    special = bool(req.add_special_tokens)
    if req.add_generation_prompt and not special or not getattr(tok, "has_chat_template", False):
        return encode_messages(tok, messages)  # what a chat completion sends the model
    try:
        rendered = tok.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
    except Exception as e:  # template errors (raise_exception)
        raise InvalidRequest(f"cannot render the chat template: {e}") from None
    return _encode(tok, rendered, special)


def _encode(tok: Any, text: str, special: bool) -> list[int]:
    try:
        return list(tok.encode(text, add_special_tokens=special))
    except Exception as e:  # unencodable text
        raise InvalidRequest(f"cannot tokenize the prompt: {e}") from None


def _token_str(tok: Any, token_id: int) -> str:
    piece = tok.id_to_token(token_id) if hasattr(tok, "id_to_token") else None
    return piece if piece is not None else tok.decode([token_id], skip_special_tokens=False)


def _detokenize(door: TokenizeDoor, req: DetokenizeRequest) -> dict:
    vocab = door.vocab_size()
    bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
    if bad is not None:
        raise InvalidRequest(f"tokens has token id {bad} outside the vocabulary (0..{vocab - 1})")
    return {"prompt": door.tokenizer().decode(req.tokens, skip_special_tokens=False)}


def _error(status: int, message: str) -> JSONResponse:
    body = {"error": {"message": message, "type": "invalid_request_error", "param": None,
                      "code": "model_not_found" if status == 404 else "invalid_argument"}}
    return JSONResponse(body, status_code=status)
