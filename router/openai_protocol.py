"""OpenAI request and response shapes: an HTTP body -> a `GenerateRequest`; the lifecycle's
`GenerateResponse`s -> completion / chat-completion objects and stream chunks.

Receives JSON bodies already parsed (untrusted: every field is type-checked by pydantic and
range-checked by router/validate.py, the same rules the gRPC door applies); hands http.py a
`GenerateRequest` and a `Format` that turns responses into OpenAI's JSON. Never talks to a
node and holds no request state: the lifecycle (router.py) owns that.

Accepted as vLLM does: unknown fields are ignored; `suffix` and `best_of` other than 1 or `n`
are refused with a 400 that names them; `n`, penalties, `logit_bias` and vLLM's
`prompt_logprobs` go through router/openai_surface.py; vLLM's extras `top_k`, `ignore_eos`,
`stop_token_ids` and `repetition_penalty` are honoured. Structured outputs (`response_format`,
vLLM's `structured_outputs` and `guided_*`) are read by router/structured_api.py; `tools`,
`tool_choice` and `parallel_tool_calls` by router/tool_api.py, and the calls come back through
router/tool_output.py.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, PrivateAttr

from protos import pdserve_pb2 as pb
from router.client import build_request
from router.openai_prompt import Entry, PromptInfo
from router.openai_surface import surface_kwargs
from router.request import PlainLogprobs
from router.structured_api import ResponseFormat, StructuredOutputs
from router.tool_api import (
    Tool,
    ToolCallIn,
    ToolChoice,
    ToolPlan,
    ToolSettings,
    plan,
    prompt_messages,
)
from router.tool_output import ToolOutput
from router.validate import InvalidRequest, encode_messages

INT32_MAX = 2**31 - 1


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")  # kept aside: router/openai_surface.py refuses some by name

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int | None = 1
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    prompt_logprobs: int | None = None
    response_format: ResponseFormat | None = None  # structured outputs: router/structured_api.py
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def sampling_kwargs(self, max_tokens: int | None, max_model_len: int) -> dict[str, Any]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if self.seed is not None and self.seed < 0:
            raise InvalidRequest(f"seed must be in 0..2**63-1, got {self.seed}")
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0  # vLLM: -1 = off
        return dict(temperature=1.0 if self.temperature is None else self.temperature,
                    top_p=1.0 if self.top_p is None else self.top_p, top_k=min(top_k, INT32_MAX),
                    seed=self.seed, max_tokens=max_model_len if max_tokens is None else min(max_tokens, INT32_MAX),
                    stop=stop, stop_token_ids=[_int32(t) for t in self.stop_token_ids or []],
                    ignore_eos=self.ignore_eos, model=self.model, **surface_kwargs(self))


class CompletionRequest(_Sampling):
    # token ids before texts: pydantic's smart union tries its members in this order, and a long prompt of
    # ids tried as list[str] first fails once per id (~10x the time of the whole body's parse)
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None

    def to_generate(self, request_id: str, tokenizer: Any, max_model_len: int) -> pb.GenerateRequest:
        if self.suffix:
            raise InvalidRequest("suffix is not supported")
        prompt: Any = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            if len(prompt) != 1:
                raise InvalidRequest(f"one prompt per request (batches are not supported), got {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, list):
            prompt = _int32s(prompt)
        kwargs = self.sampling_kwargs(self.max_tokens, max_model_len)
        if self.echo and self.logprobs is not None:  # the prompt's logprobs too, OpenAI's echo
            kwargs["prompt_logprobs"] = max(kwargs["prompt_logprobs"] or 0, self.logprobs)
        return build_request(prompt, logprobs=self.logprobs, request_id=request_id, **kwargs)

    def prompt_text(self) -> str | None:
        """The prompt as sent when it is text (what `echo` repeats); None for token ids."""
        p = self.prompt
        return p if isinstance(p, str) else p[0] if isinstance(p, list) and p and isinstance(p[0], str) else None


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCallIn] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def for_template(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            out["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None  # router/tool_api.py
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    _tool_plan: ToolPlan | None = PrivateAttr(None)

    def to_generate(self, request_id: str, tokenizer: Any, max_model_len: int, max_prompt_bytes: int,
                    tool_settings: ToolSettings | None = None) -> pb.GenerateRequest:
        if not self.messages:
            raise InvalidRequest("messages is empty")
        size = sum(len(m.text().encode("utf-8", errors="surrogatepass")) for m in self.messages)
        if size > max_prompt_bytes:
            raise InvalidRequest(f"prompt is {size} bytes; the limit is {max_prompt_bytes}")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs=true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        kwargs = self.sampling_kwargs(max_tokens, max_model_len)
        settings = tool_settings or ToolSettings()
        self._tool_plan = plan(self.tools, self.tool_choice, self.parallel_tool_calls, settings)
        if self._tool_plan is not None and self._tool_plan.spec is not None:
            if kwargs["structured"] is not None:
                raise InvalidRequest("give one structured output constraint, got tools and a structured output field")
            kwargs["structured"] = self._tool_plan.spec
        messages, tools = prompt_messages([m.for_template() for m in self.messages], self._tool_plan, tokenizer,
                                          settings)
        return build_request(encode_messages(tokenizer, messages, tools), logprobs=logprobs, request_id=request_id,
                             **kwargs)

    def tool_output(self) -> ToolOutput | None:
        """How the choices' text is read for tool calls (after `to_generate`); None: plain text."""
        return ToolOutput(self._tool_plan.family) if self._tool_plan is not None else None


def _int32(v: int) -> int:
    if not -(2**31) <= v <= INT32_MAX:
        raise InvalidRequest(f"token id {v} is out of range")
    return v


def _int32s(ids: list[int]) -> list[int]:
    """`ids` when each is an int32 (`_int32`): a prompt's thousands of ids checked by their bounds."""
    if ids and (min(ids) < -(2**31) or max(ids) > INT32_MAX):
        for v in ids:
            _int32(v)
    return ids


# ---- responses ------------------------------------------------------------------------------
@dataclass
class Format:
    """Builds one request's OpenAI objects; `chat` picks chat.completion(.chunk) over text_completion.
    n > 1: one choice per `index`; `echo` and `prompt_logprobs` read the first message's prompt
    (router/openai_prompt.py)."""

    chat: bool
    model: str
    tokenizer: Any
    logprobs: int | None  # None: no logprobs asked
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    n: int = 1
    echo: bool = False  # completions: the prompt before each choice's text (and logprobs)
    prompt_text: str | None = None  # the prompt as sent, for echo (None: token ids, decoded)
    prompt_logprobs: int | None = None  # vLLM's field, top-N
    text_offset: dict[int, int] = field(default_factory=dict)  # completions' logprobs.text_offset per choice
    prompt: PromptInfo | None = None  # from the first message
    tools: ToolOutput | None = None  # chat with tools: the choices' calls (router/tool_output.py)
    _frame_head: str | None = field(default=None, init=False, repr=False)

    @property
    def request_id(self) -> str:
        return ("chatcmpl-" if self.chat else "cmpl-") + self.id

    def _object(self, kind: str, choices: list[dict], usage: dict | None = None) -> dict:
        out: dict[str, Any] = {"id": self.request_id, "object": kind, "created": self.created,
                               "model": self.model, "choices": choices}
        if usage is not None:
            out["usage"] = usage
        return out

    def _see(self, msg: pb.GenerateResponse) -> None:
        if self.prompt is None:
            self.prompt = PromptInfo.of(msg, self.prompt_text, lambda ids: self._decode(ids))

    def chunk(self, msg: pb.GenerateResponse, first: bool = False) -> dict:
        """One stream chunk for `msg` (its choice's new text, logprobs and, on its last message,
        finish_reason); `first`: the choice's first chunk (chat: the role; echo: the prompt)."""
        self._see(msg)
        reason = msg.finish_reason or None
        if self.chat:
            lps = {"content": [self._chat_entry(lp) for lp in msg.logprobs]} if self.logprobs is not None else None
            delta = {"role": "assistant", "content": msg.text} if first else {"content": msg.text}
            if self.tools is not None:
                last = reason is not None or msg.HasField("finished")
                delta = ({"role": "assistant"} if first else {}) | self.tools.delta(msg.index, msg.text, last)
                reason = self.tools.finish_reason(msg.index, reason)
            elif not msg.text and not first:
                delta = {}
            choice = {"index": msg.index, "delta": delta, "logprobs": lps, "finish_reason": reason}
            return self._object("chat.completion.chunk", [choice])
        entries = _entries(msg.logprobs) if self.logprobs is not None or first else []
        text, entries = self._echoed(msg.text, entries) if first else (msg.text, entries)
        lps = self._logprobs(entries, msg.index) if self.logprobs is not None else None
        return self._object("text_completion", [{"index": msg.index, "text": text, "logprobs": lps,
                                                  "finish_reason": reason}])

    def frame(self, msg: pb.GenerateResponse, first: bool = False, plain: PlainLogprobs | None = None) -> str:
        """`sse(self.chunk(msg, first))`, the same bytes, `plain` (its plain logprobs, taken out of
        it: router/request.py's Outbox) put back in first. A chunk after its choice's first, without
        tools or top-N logprobs (most of a stream), is written as JSON text around the request's
        constant head instead of as dicts to encode."""
        if plain is not None and (first or self.chat or self.tools is not None or self.logprobs is None):
            plain.into(msg)  # the dict's path reads them from the message
            plain = None
        if first or self.tools is not None:
            return sse(self.chunk(msg, first))
        if self.chat:
            if self.logprobs is not None:
                return sse(self.chunk(msg, first))
            self._see(msg)
            delta = '{"content":' + _ENCODE_STR(msg.text) + "}" if msg.text else "{}"
            return f'{self._head()}{msg.index},"delta":{delta},"logprobs":null,"finish_reason":{_reason(msg)}}}]}}\n\n'
        lps: str | None = "null"
        if self.logprobs is not None:
            lps = self._logprobs_text(msg.index, plain) if plain is not None else self._protos_text(msg)
            if lps is None:
                return sse(self.chunk(msg, first))
        self._see(msg)
        return (f'{self._head()}{msg.index},"text":{_ENCODE_STR(msg.text)},"logprobs":{lps},'
                f'"finish_reason":{_reason(msg)}}}]}}\n\n')

    def _protos_text(self, msg: pb.GenerateResponse) -> str | None:
        """`_logprobs_text` of `msg`'s own TokenLogprobs; None when one has top-N alternatives."""
        plain = PlainLogprobs()
        for lp in msg.logprobs:  # one pass: each element read is a new wrapper
            if lp.top_ids:
                return None
            plain.token_ids.append(lp.token_id)
            plain.logprobs.append(lp.logprob)
        return self._logprobs_text(msg.index, plain)

    def _logprobs_text(self, index: int, plain: PlainLogprobs) -> str:
        """Choice `index`'s chunk's `logprobs` for tokens without top-N alternatives, as JSON text,
        as `_logprobs` makes them (text offsets moved on alike)."""
        token = self._token
        tokens = [token(t) for t in plain.token_ids]
        offset, offsets = self.text_offset.get(index, 0), []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        if tokens:
            self.text_offset[index] = offset
        return (f'{{"tokens":{_encode(tokens)},"token_logprobs":{_encode(plain.logprobs)},'
                f'"text_offset":{_encode(offsets)},"top_logprobs":[{",".join(["{}"] * len(tokens))}]}}')

    def _head(self) -> str:
        """A chunk's SSE text up to its choice's index (the same in every chunk of the request)."""
        if self._frame_head is None:
            kind = "chat.completion.chunk" if self.chat else "text_completion"
            self._frame_head = (f'data: {{"id":{_ENCODE_STR(self.request_id)},"object":"{kind}",'
                                f'"created":{self.created},"model":{_ENCODE_STR(self.model)},"choices":[{{"index":')
        return self._frame_head

    def usage_chunk(self, msg: pb.GenerateResponse) -> dict:
        return self._object("chat.completion.chunk" if self.chat else "text_completion", [], usage(msg))

    def whole(self, msgs: list[pb.GenerateResponse]) -> dict:
        """The non-streaming response: every message folded into its choice."""
        self._see(msgs[0])
        choices = [self._choice([m for m in msgs if m.index == i]) for i in range(self.n)]
        plp = None
        if self.prompt_logprobs is not None and self.prompt is not None:
            plp = self.prompt.vllm_logprobs(self.prompt_logprobs, self._token)
        if self.chat:
            out = self._object("chat.completion", choices, usage(msgs[-1]))
            if plp is not None:
                out["prompt_logprobs"] = plp
            return out
        for choice in choices:
            if plp is not None:
                choice["prompt_logprobs"] = plp
        return self._object("text_completion", choices, usage(msgs[-1]))

    def _choice(self, mine: list[pb.GenerateResponse]) -> dict:
        index = mine[0].index if mine else 0
        text = "".join(m.text for m in mine)
        reason = next((m.finish_reason for m in mine if m.finish_reason), None)
        if self.chat:
            lps = ({"content": [self._chat_entry(lp) for m in mine for lp in m.logprobs]}
                   if self.logprobs is not None else None)
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if self.tools is not None:
                message, reason = self.tools.message(text, reason)
            return {"index": index, "message": message, "logprobs": lps, "finish_reason": reason}
        entries = [e for m in mine for e in _entries(m.logprobs)]
        text, entries = self._echoed(text, entries)
        lps = self._logprobs(entries, index) if self.logprobs is not None else None
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": reason}

    def _echoed(self, text: str, entries: list[Entry]) -> tuple[str, list[Entry]]:
        """With `echo`, the prompt's text and logprob entries before a choice's own."""
        if not self.echo or self.prompt is None:
            return text, entries
        return self.prompt.text + text, self.prompt.echo_entries(self.logprobs or 0) + entries

    def _logprobs(self, entries: list[Entry], index: int) -> dict:
        tokens = [self._token(t) for t, _, _ in entries]
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset.get(index, 0))
            self.text_offset[index] = offsets[-1] + len(t)
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in entries], "text_offset": offsets,
                "top_logprobs": [None if top is None else {self._token(i): v for i, v in top}
                                 for _, _, top in entries]}

    def _chat_entry(self, lp: pb.TokenLogprob) -> dict:
        tok = self._token(lp.token_id)
        top = [{"token": (t := self._token(i)), "logprob": v, "bytes": list(t.encode("utf-8"))}
               for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
        return {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8")), "top_logprobs": top}

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer else ""


_JSON = json.JSONEncoder(separators=(",", ":"))  # json.dumps with options builds an encoder per call
_ENCODE_STR: Any = json.encoder.encode_basestring_ascii  # a str as the encoder writes it (ensure_ascii)
# _JSON's own C encoder, made once: `encode` makes one per call (without the circular-reference check:
# what goes out is built here, never circular)
_MAKE_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)  # None without CPython's _json
_C_ENCODER: Any = _MAKE_C_ENCODER and _MAKE_C_ENCODER(
    None, _JSON.default, json.encoder.encode_basestring_ascii, None, ":", ",", False, False, True)


def _encode(obj: Any) -> str:
    """`obj` as compact JSON, `_JSON.encode(obj)`'s text."""
    return "".join(_C_ENCODER(obj, 0)) if _C_ENCODER is not None else _JSON.encode(obj)


def sse(obj: dict) -> str:
    """A server-sent event carrying `obj` as compact JSON."""
    return f"data: {_encode(obj)}\n\n"


def _reason(msg: pb.GenerateResponse) -> str:
    """A chunk's `finish_reason` as JSON."""
    return _ENCODE_STR(msg.finish_reason) if msg.finish_reason else "null"


def _entries(lps: Any) -> list[Entry]:
    """A message's logprobs as (token id, logprob, [(top id, top logprob)]); tokens without top-N
    alternatives (`logprobs=0`) skip the pairing."""
    return [(lp.token_id, lp.logprob, list(zip(lp.top_ids, lp.top_logprobs, strict=True)) if lp.top_ids else [])
            for lp in lps]


def usage(msg: pb.GenerateResponse) -> dict:
    u = msg.finished.usage
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}
