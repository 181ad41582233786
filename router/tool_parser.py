"""Reading tool calls out of a model's text (issue 53), one `ToolCallParser` per choice, fed
the text as it streams; and, per syntax (`Family`), the grammar that holds a call to it.

Families are named as vLLM's `--tool-call-parser`:
  * `hermes` (Hermes, Qwen 2.5): text, then `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`;
  * `llama3_json` (Llama 3.x JSON tool calling): text, then `{"name": ..., "parameters": {...}}`;
  * `json` (tool_choice "required" or a named function, router/tool_api.py): the whole output
    is one call object {"name", "arguments"}, or an array of them.

The parser hands back deltas in order: `Content` (text outside calls; a possible start of the
trigger is held back until it is known not to be one), `CallStart` (a call's index, id and
name, once its name is complete) and `Arguments` (fragments of its arguments' JSON, as they
come). Calls are held to their schema by the grammar, so the parser only follows their shape:
it never judges a call, and text it cannot read as a call stays content.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from engine.grammar.structured import StructuredSpec

HEADER = re.compile(r'\s*\{"name": "([A-Za-z0-9_-]{1,64})", "(?:arguments|parameters)": (?=\S)')
MAX_HEADER = 160  # characters from a trigger to a call's arguments, at most (a name is <= 64)
HEADER_LOOSE = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"(?:arguments|parameters)"\s*:\s*(?=\S)')


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Delta = Content | CallStart | Arguments


@dataclass(frozen=True)
class Family:
    """One tool-call syntax: how a call starts (`trigger`, part of the call when not `consumed`),
    the key of its arguments, what closes it (`tail`), and how a prompt asks for it."""

    name: str
    trigger: str
    consumed: bool  # the trigger is markup before the call's JSON (hermes), not its first bytes
    args_key: str
    tail: str  # after the arguments' closing brace
    text: bool  # text outside calls is content (False: the JSON family's brackets and commas)
    instructions: str
    render_call: Callable[[str, Any], str]

    def structural_tag(self, tools: list[Any], parallel: bool) -> StructuredSpec:
        """The StructuredSpec letting text through until the trigger, then one of `tools`'
        calls, its arguments held to the function's schema (`parallel`: more calls may follow)."""
        begin = ("<tool_call>\n" if self.consumed else "") + '{"name": "{}", "' + self.args_key + '": '
        tags = [{"type": "tag", "begin": begin.replace("{}", t.function.name),
                 "content": {"type": "json_schema", "json_schema": t.function.schema_}, "end": self.tail}
                for t in tools]
        fmt = {"type": "triggered_tags", "triggers": [self.trigger], "tags": tags,
               "stop_after_first": not parallel}
        return StructuredSpec("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))


def _json_call(key: str) -> Callable[[str, Any], str]:
    return lambda name, args: json.dumps({"name": name, key: _loaded(args)}, ensure_ascii=False)


def _loaded(args: Any) -> Any:
    try:
        return json.loads(args) if isinstance(args, str) else args
    except ValueError:
        return args


def _hermes_call(name: str, args: Any) -> str:
    return f"<tool_call>\n{_json_call('arguments')(name, args)}\n</tool_call>"


FAMILIES: dict[str, Family] = {
    "hermes": Family(
        "hermes", "<tool_call>", True, "arguments", "}\n</tool_call>", True,
        "For each function call, return a json object with function name and arguments within "
        "<tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>',
        _hermes_call),
    "llama3_json": Family(
        "llama3_json", '{"name": ', False, "parameters", "}", True,
        "When you call a function, respond with only a JSON object of the form "
        '{"name": function name, "parameters": dictionary of argument name and its value}. Do not use variables.',
        _json_call("parameters")),
    "json": Family(
        "json", "{", False, "arguments", "}", False,
        'Call functions by replying with only JSON: {"name": <function-name>, "arguments": <args-json-object>}, '
        "or a JSON array of such objects for several calls.",
        _json_call("arguments")),
}
PARSERS = ("hermes", "llama3_json")  # the names `--tool-call-parser` takes


@dataclass
class ToolCallParser:
    """Follows one choice's text; `feed` each new piece, `end` once at its end."""

    family: Family
    calls: int = 0  # calls started
    _buf: str = ""
    _pos: int = 0
    _state: str = "text"  # text, header, args, tail
    _trigger_at: int = 0
    _depth: int = 0
    _in_string: bool = False
    _escaped: bool = False
    ids: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        out: list[Delta] = []
        while self._step(out):
            pass
        return out

    def end(self) -> list[Delta]:
        """The text held back (a trigger's first characters that no call followed)."""
        out: list[Delta] = []
        if self._state == "header":
            self._pos = self._trigger_at
        if self._state in ("text", "header") and self.family.text and self._pos < len(self._buf):
            out.append(Content(self._buf[self._pos:]))
        self._pos = len(self._buf)
        return out

    def _step(self, out: list[Delta]) -> bool:
        """Advance one state; False when the text so far is read."""
        return {"text": self._text, "header": self._header, "args": self._args, "tail": self._tail}[self._state](out)

    def _text(self, out: list[Delta]) -> bool:
        trigger = self.family.trigger
        at = self._buf.find(trigger, self._pos)
        stop = at if at >= 0 else len(self._buf) - _held(self._buf, self._pos, trigger)
        if stop > self._pos and self.family.text:
            out.append(Content(self._buf[self._pos:stop]))
        self._pos = stop
        if at < 0:
            return False
        self._trigger_at = at
        self._pos += len(trigger) if self.family.consumed else 0
        self._state = "header"
        return True

    def _header(self, out: list[Delta]) -> bool:
        m = HEADER.match(self._buf, self._pos) or HEADER_LOOSE.match(self._buf, self._pos)
        if m is None:
            if len(self._buf) - self._pos <= MAX_HEADER:
                return False  # wait: the name may not be complete yet
            end = self._trigger_at + len(self.family.trigger)  # no call after all: the trigger is text
            if self.family.text:
                out.append(Content(self._buf[self._trigger_at:end]))
            self._pos, self._state = end, "text"
            return True
        self.ids.append(f"call_{uuid.uuid4().hex[:24]}")
        out.append(CallStart(self.calls, self.ids[-1], m.group(1)))
        self.calls += 1
        self._pos, self._state = m.end(), "args"
        self._depth, self._in_string, self._escaped = 0, False, False
        return True

    def _args(self, out: list[Delta]) -> bool:
        start, end = self._pos, self._scan_value()
        if end > start:
            out.append(Arguments(self.calls - 1, self._buf[start:end]))
        self._pos = end
        if self._depth > 0 or end == start or self._buf[end - 1] not in "}]":
            return False
        self._state = "tail"
        return True

    def _scan_value(self) -> int:
        """The end of the arguments' JSON in the buffer so far (its closing brace included)."""
        i = self._pos
        while i < len(self._buf):
            c = self._buf[i]
            i += 1
            if self._in_string:
                was_escaped, self._escaped = self._escaped, not self._escaped and c == "\\"
                self._in_string = was_escaped or c != '"'
            elif c == '"':
                self._in_string = True
            elif c in "{[":
                self._depth += 1
            elif c in "}]":
                self._depth -= 1
                if self._depth == 0:
                    return i
        return i

    def _tail(self, out: list[Delta]) -> bool:
        rest, tail = self._buf[self._pos:], self.family.tail
        if tail.startswith(rest):
            return False  # wait for the rest of it
        if rest.startswith(tail):
            self._pos += len(tail)
        self._state = "text"
        return True


def _held(buf: str, pos: int, trigger: str) -> int:
    """How many characters at the end of buf[pos:] could begin `trigger`."""
    for n in range(min(len(trigger) - 1, len(buf) - pos), 0, -1):
        if trigger.startswith(buf[len(buf) - n:]):
            return n
    return 0


def parse_all(family: Family, text: str) -> tuple[str, list[dict[str, Any]]]:
    """A whole choice's text as (content, tool_calls in OpenAI's shape)."""
    p = ToolCallParser(family)
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    args: list[list[str]] = []
    for d in [*p.feed(text), *p.end()]:
        if isinstance(d, Content):
            content.append(d.text)
        elif isinstance(d, CallStart):
            args.append([])
            calls.append({"id": d.id, "type": "function", "function": {"name": d.name, "arguments": ""}})
        else:
            args[d.index].append(d.text)
    for call, parts in zip(calls, args, strict=True):
        call["function"]["arguments"] = "".join(parts)
    return "".join(content), calls
