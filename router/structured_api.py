"""Structured outputs at the router's doors (issue 28): the OpenAI and vLLM request fields that
ask for output matching a JSON schema, any JSON object, a regex, one of some choices or an EBNF
grammar, read into one `StructuredSpec` (engine/grammar/structured.py), and the check that it compiles.

Reads, from an OpenAI body (pydantic has checked the types):
  * `response_format`: {"type": "text"} (no constraint), {"type": "json_object"}, or
    {"type": "json_schema", "json_schema": {"name", "schema", "strict"}} (OpenAI's; what the
    `openai` client's `chat.completions.parse` sends);
  * vLLM's `structured_outputs` {"json", "regex", "choice", "grammar", "json_object"};
  * vLLM's older top-level `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.
More than one constraint is refused, naming two of the fields. Raises `StructuredError` (a
ValueError: the doors answer INVALID_ARGUMENT / 400 with its message).

`check_wire` is the door's rule for both doors (router/validate.py runs it off the event loop):
the spec parses and compiles with xgrammar without a tokenizer, so a bad schema, regex or grammar
is refused with the compiler's message before any node sees it. The token mask is the engine's
(engine/grammar/compiler.py); this module never builds one.
"""

from __future__ import annotations

import functools
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.grammar.structured import StructuredSpec


class StructuredError(ValueError):
    """A structured-output field the router refuses (INVALID_ARGUMENT, HTTP 400)."""


class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`; `strict` is accepted (the output is always held
    to the schema once the engine masks)."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`; other keys are refused by name unless null or false."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    json_: dict[str, Any] | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


def spec_of(req: Any) -> StructuredSpec | None:
    """The one constraint an OpenAI body asks for (None: none); StructuredError when it asks for
    more than one or one is malformed."""
    found = [*_response_format(req.response_format), *_structured_outputs(req.structured_outputs),
             *_guided(req)]
    if len(found) > 1:
        raise StructuredError(f"give one structured output constraint, got {found[0][0]} and {found[1][0]}")
    return found[0][1] if found else None


def _response_format(rf: ResponseFormat | None) -> list[tuple[str, StructuredSpec]]:
    if rf is None or rf.type == "text":
        return []
    if rf.type == "json_object":
        return [("response_format", StructuredSpec("json_object"))]
    if rf.json_schema is None or rf.json_schema.schema_ is None:
        raise StructuredError("response_format json_schema needs json_schema.schema")
    return [("response_format", _make("response_format.json_schema.schema", "json_schema", rf.json_schema.schema_))]


def _structured_outputs(so: StructuredOutputs | None) -> list[tuple[str, StructuredSpec]]:
    if so is None:
        return []
    for name, value in (so.model_extra or {}).items():
        if value not in (None, False):
            raise StructuredError(f"structured_outputs.{name} is not supported by this server")
    out = [(f"structured_outputs.{key}", _make(f"structured_outputs.{key}", kind, value))
           for key, kind, value in (("json", "json_schema", so.json_), ("regex", "regex", so.regex),
                                    ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar))
           if value is not None]
    if so.json_object:
        out.append(("structured_outputs.json_object", StructuredSpec("json_object")))
    return out


GUIDED = (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
          ("guided_grammar", "grammar"))


def _guided(req: Any) -> list[tuple[str, StructuredSpec]]:
    return [(name, _make(name, kind, getattr(req, name))) for name, kind in GUIDED
            if getattr(req, name) is not None]


def _make(field: str, kind: str, value: Any) -> StructuredSpec:
    """A spec from one field's value: a schema as an object (or JSON text), a string, a list."""
    try:
        if kind == "json_schema" and not isinstance(value, str):
            return StructuredSpec.json_schema(value)
        if kind == "choice":
            return StructuredSpec.choice(value)
        return StructuredSpec(kind, value)
    except (ValueError, TypeError) as e:
        raise StructuredError(f"{field}: {e}") from None


@functools.lru_cache(maxsize=64)  # clients repeat their schemas; failures are not kept
def check_wire(text: str) -> StructuredSpec | None:
    """The spec a request's `structured` wire string holds ("" = none), checked to compile;
    StructuredError otherwise. Blocks for the compile (and, once, xgrammar's import): call it
    off the event loop."""
    try:
        spec = StructuredSpec.from_wire(text)
    except ValueError as e:
        raise StructuredError(str(e)) from None
    if spec is not None:
        check_compiles(spec)
    return spec


def check_compiles(spec: StructuredSpec) -> None:
    """Compile `spec` with xgrammar, without a tokenizer (JSON schema with no free whitespace, as
    the engine compiles it); StructuredError with the compiler's message when it does not."""
    import xgrammar  # heavy (it imports torch): only when a structured request comes

    from engine.grammar.compiler import structural_tag_grammar

    build = {"json_schema": lambda v: xgrammar.Grammar.from_json_schema(v, any_whitespace=False),
             "regex": xgrammar.Grammar.from_regex, "grammar": xgrammar.Grammar.from_ebnf,
             "structural_tag": structural_tag_grammar}.get(spec.kind)
    if build is None:  # json_object, choice: StructuredSpec checked them
        return
    try:
        build(spec.value)
    except (RuntimeError, ValueError, TypeError) as e:
        raise StructuredError(f"the {_NAMES[spec.kind]} does not compile: {_compiler_message(e)}") from None


_NAMES = {"json_schema": "JSON schema", "regex": "regex", "grammar": "grammar", "structural_tag": "structural tag"}
_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[09:24:47] /project/cpp/x.cc:83: "


def _compiler_message(e: Exception) -> str:
    return _LOCATION.sub("", str(e).strip())
