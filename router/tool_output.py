"""A chat response's tool calls in OpenAI's shape (issue 53): router/openai_protocol.py's
`Format` hands each choice's text here when the request has tools.

Streaming, a choice's delta carries `content` (text outside calls) and `tool_calls` entries:
the first for a call holds its index, id, type and name with empty arguments, the next ones
fragments of its arguments, as the official client's stream helpers assemble them. Whole, the
message holds `content` (null when only calls were written) and `tool_calls`. A choice that
called a tool and ended on its own finishes with "tool_calls"; one cut by max_tokens keeps
"length".
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from router.tool_parser import (
    Arguments,
    CallStart,
    Content,
    Delta,
    Family,
    ToolCallParser,
    parse_all,
)


@dataclass
class ToolOutput:
    family: Family
    _parsers: dict[int, ToolCallParser] = field(default_factory=dict)

    def delta(self, index: int, text: str, last: bool) -> dict[str, Any]:
        """Choice `index`'s stream delta for its new `text` (`last`: its final piece)."""
        p = self._parsers.setdefault(index, ToolCallParser(self.family))
        deltas = p.feed(text) + (p.end() if last else [])
        out: dict[str, Any] = {}
        content = "".join(d.text for d in deltas if isinstance(d, Content))
        if content:
            out["content"] = content
        calls = _call_deltas(deltas)
        if calls:
            out["tool_calls"] = calls
        return out

    def finish_reason(self, index: int, reason: str | None) -> str | None:
        p = self._parsers.get(index)
        return "tool_calls" if reason == "stop" and p is not None and p.calls else reason

    def message(self, text: str, reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A whole choice's message and finish_reason."""
        content, calls = parse_all(self.family, text)
        message: dict[str, Any] = {"role": "assistant", "content": content if content.strip() or not calls else None}
        if calls:
            message["tool_calls"] = calls
        return message, "tool_calls" if calls and reason == "stop" else reason


def _call_deltas(deltas: list[Delta]) -> list[dict[str, Any]]:
    """Tool-call entries of one chunk: a call's start, then its argument fragments merged."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if isinstance(d, CallStart):
            out.append({"index": d.index, "id": d.id, "type": "function",
                        "function": {"name": d.name, "arguments": ""}})
        elif isinstance(d, Arguments):
            if out and out[-1]["index"] == d.index:
                out[-1]["function"]["arguments"] += d.text
            else:
                out.append({"index": d.index, "function": {"arguments": d.text}})
    return out
