"""What a request's output must match: a JSON schema, any JSON object, a regex, one of some
choices, an EBNF grammar (issue 28), or an xgrammar structural tag (free text until a trigger,
then a tagged JSON schema: the tool calls of issue 53). Only the description lives here; compiling it into a
token mask (xgrammar) is engine/grammar/compiler.py's.

`StructuredSpec` travels with a request from the router to the prefill and decode nodes as one
string (`to_wire` / `from_wire`), checked again on arrival: nothing read from the network is
trusted. A spec that cannot be compiled is the grammar module's error to name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC_CHARS = 65536  # a schema, regex or grammar longer than this is refused
MAX_CHOICES = 1024
NEEDS_EOS = "ignore_eos cannot be used with structured output: a finished grammar allows only EOS"


@dataclass(frozen=True)
class StructuredSpec:
    """`kind` is one of KINDS; `value` is the schema as JSON text (json_schema), the regex,
    the choices as a JSON list of strings (choice), the EBNF grammar, xgrammar's structural tag
    as JSON text (structural_tag), or "" (json_object)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.value, str) or len(self.value) > MAX_SPEC_CHARS:
            raise ValueError(f"a structured output {self.kind} must be a string of at most {MAX_SPEC_CHARS} characters")
        if self.kind == "json_object" and self.value:
            raise ValueError("json_object takes no value")
        if self.kind in ("regex", "grammar") and not self.value:
            raise ValueError(f"an empty {self.kind} matches nothing useful")
        if self.kind == "json_schema":
            _check_schema(self.value)
        if self.kind == "choice":
            _check_choices(self.value)
        if self.kind == "structural_tag":
            _check_structural_tag(self.value)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredSpec:
        return cls("choice", json.dumps(list(options), ensure_ascii=False))

    @classmethod
    def json_schema(cls, schema: dict | bool) -> StructuredSpec:
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False))

    @property
    def choices(self) -> list[str]:
        if self.kind != "choice":
            raise ValueError(f"a {self.kind} spec has no choices")
        return list(json.loads(self.value))

    def to_wire(self) -> str:
        return json.dumps([self.kind, self.value], ensure_ascii=False)

    @classmethod
    def from_wire(cls, text: str) -> StructuredSpec | None:
        """The spec a wire string holds ("" is none); ValueError on anything malformed."""
        if not text:
            return None
        if len(text) > 2 * MAX_SPEC_CHARS + 64:
            raise ValueError("structured output spec too long")
        try:
            kind, value = json.loads(text)
        except (ValueError, TypeError):
            raise ValueError("malformed structured output spec") from None
        if not isinstance(kind, str) or not isinstance(value, str):
            raise ValueError("malformed structured output spec")
        return cls(kind, value)


def _check_schema(value: str) -> None:
    try:
        schema = json.loads(value)
    except ValueError as e:
        raise ValueError(f"json_schema is not valid JSON: {e}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError(f"a JSON schema is an object or a boolean, got {type(schema).__name__}")


def _check_structural_tag(value: str) -> None:
    try:
        tag = json.loads(value)
    except ValueError as e:
        raise ValueError(f"structural_tag is not valid JSON: {e}") from None
    if not isinstance(tag, dict) or not isinstance(tag.get("format"), dict):
        raise ValueError('a structural tag is an object {"type": "structural_tag", "format": {...}}')


def _check_choices(value: str) -> None:
    try:
        options = json.loads(value)
    except ValueError:
        raise ValueError("choice must be a JSON list of strings") from None
    if not isinstance(options, list) or not options or not all(isinstance(o, str) and o for o in options):
        raise ValueError("choice must be a non-empty list of non-empty strings")
    if len(options) > MAX_CHOICES:
        raise ValueError(f"choice has {len(options)} options; at most {MAX_CHOICES}")
