"""Tool calling at the HTTP door (issue 53): OpenAI's `tools`, `tool_choice` and
`parallel_tool_calls` read into a `ToolPlan`, which says how the prompt shows the tools, which
grammar holds the output (a `StructuredSpec`, so the engine masks it exactly as any structured
output: under MTP and from P to D), and how router/tool_parser.py reads the calls back.

  * "none": no tools in the prompt, no grammar, plain text back.
  * "required" and a named function: the output is JSON, held by a JSON schema: one call
    {"name": ..., "arguments": {...}} (the named function's, or one of the tools'), or with
    `parallel_tool_calls` an array of at least one. The arguments match the function's
    `parameters` whatever the model.
  * "auto" (needs `--enable-auto-tool-choice` and `--tool-call-parser`, as in vLLM): the model
    writes text or calls in its own syntax (router/tool_parser.py's families); an xgrammar
    structural tag lets free text through until a call starts, then holds the call to its schema.

Tools are rendered by the model's chat template when it has a tools section; otherwise a
default system block (`default_block`, documented in docs/api.md) lists them. Raises
`InvalidRequest` naming the field for a tool choice that names no tool, a parameters schema that
does not compile, or "auto" with a model that has no chat template.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.grammar.structured import StructuredSpec
from router.structured_api import StructuredError, check_compiles
from router.tool_parser import FAMILIES, Family
from router.validate import InvalidRequest

MAX_TOOLS = 128
NAME = r"^[A-Za-z0-9_-]{1,64}$"  # OpenAI's rule for function names
EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class Function(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @property
    def schema_(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else EMPTY_PARAMETERS


class Tool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: Function


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolSettings:
    """The router's tool options (RouterConfig's `tool_call_parser`, `enable_auto_tool_choice`)."""

    parser: str | None = None
    enable_auto: bool = False


@dataclass(frozen=True)
class ToolPlan:
    """One request's tools: those the prompt shows, the grammar of its output, how to read it."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, for the chat template
    spec: StructuredSpec | None
    family: Family  # the calls' syntax, asked for and read back (FAMILIES["json"]: required and named)


def plan(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None,
         settings: ToolSettings) -> ToolPlan | None:
    """The request's ToolPlan; None when it calls no tools (no tools, or tool_choice "none")."""
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"tools has {len(tools)} tools; at most {MAX_TOOLS}")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise InvalidRequest("tools: function names must be unique")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return None
    _check_parameters(tools)
    dumped = [t.model_dump(exclude_none=True) for t in tools]
    parallel = True if parallel is None else parallel
    family = _auto_family(settings) if choice == "auto" else FAMILIES["json"]
    chosen = tools if choice in ("auto", "required") else [_named(tools, choice)]
    try:
        spec = (family.structural_tag(tools, parallel) if choice == "auto" else
                StructuredSpec.json_schema(_json_calls_schema(chosen, parallel and choice == "required")))
    except ValueError as e:  # too large a grammar for a spec
        raise InvalidRequest(f"tools: {e}") from None
    return ToolPlan(dumped, spec, family)


def _auto_family(settings: ToolSettings) -> Family:
    if not settings.enable_auto or settings.parser is None:
        raise InvalidRequest('tool_choice "auto" needs a server started with --enable-auto-tool-choice and '
                             '--tool-call-parser (or give tool_choice "required", "none" or a named function)')
    return FAMILIES[settings.parser]


def _named(tools: list[Tool], choice: Any) -> Tool:
    name = choice.function.name
    found = next((t for t in tools if t.function.name == name), None)
    if found is None:
        raise InvalidRequest(f"tool_choice.function.name: no tool is named {name[:64]!r}")
    return found


def _check_parameters(tools: list[Tool]) -> None:
    for i, t in enumerate(tools):
        try:
            error = _compile_error(StructuredSpec.json_schema(t.function.schema_))
        except ValueError as e:
            error = str(e)
        if error is not None:
            raise InvalidRequest(f"tools[{i}].function.parameters: {error}")


@functools.lru_cache(maxsize=256)  # clients send the same tools with every turn
def _compile_error(spec: StructuredSpec) -> str | None:
    try:
        check_compiles(spec)
    except StructuredError as e:
        return str(e)
    return None


def call_schema(tool: Tool) -> dict[str, Any]:
    """One call as JSON: {"name": the function's name, "arguments": its parameters}."""
    return {"type": "object", "properties": {"name": {"const": tool.function.name}, "arguments": tool.function.schema_},
            "required": ["name", "arguments"], "additionalProperties": False}


def _json_calls_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    one = call_schema(tools[0]) if len(tools) == 1 else {"anyOf": [call_schema(t) for t in tools]}
    return {"type": "array", "items": one, "minItems": 1} if parallel else one


# ---- the prompt -----------------------------------------------------------------------------
def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the model's chat template renders `tools` itself (as transformers decides)."""
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def prompt_messages(messages: list[dict[str, Any]], tool_plan: ToolPlan | None, tokenizer: Any,
                    settings: ToolSettings) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the chat template. A template with a tools section gets both as
    they are; any other gets the tools as a default system block, the assistant's earlier calls
    as text in the model's syntax (`Family.render_call`) and tool results as plain `tool` turns
    (a small model follows an exchange it can see, call then result, better than results
    dressed as user turns)."""
    has_template = bool(getattr(tokenizer, "has_chat_template", False))
    if tool_plan is not None and tool_plan.family.name != "json" and not has_template:
        raise InvalidRequest('tools: tool_choice "auto" needs a model with a chat template; this one has none')
    if has_template and template_takes_tools(tokenizer):
        return messages, tool_plan.tools if tool_plan is not None else None
    family = tool_plan.family if tool_plan is not None else FAMILIES[settings.parser or "hermes"]
    out = [_as_text(m, family) for m in messages]
    if tool_plan is not None and has_template:
        out = _with_system(out, default_block(tool_plan))
    return out, None


def _as_text(m: dict[str, Any], family: Family) -> dict[str, Any]:
    if m["role"] == "tool":
        return {"role": "tool", "content": m.get("content") or ""}  # the template's own way with roles
    if m.get("tool_calls"):
        calls = [family.render_call(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"]]
        text = "\n".join([m["content"], *calls] if m.get("content") else calls)
        return {"role": m["role"], "content": text}
    return {"role": m["role"], "content": m.get("content") or ""}


def _with_system(messages: list[dict[str, Any]], block: str) -> list[dict[str, Any]]:
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{"role": first["role"], "content": f"{first['content']}\n\n{block}"}, *messages[1:]]
    return [{"role": "system", "content": block}, *messages]


def default_block(tool_plan: ToolPlan) -> str:
    """The system block that shows tools to a model whose template has no tools section."""
    listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tool_plan.tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            f"</tools>\n\n{tool_plan.family.instructions}")


def call_arguments(arguments: Any) -> Any:
    """An earlier call's `arguments` as templates expect them: the JSON object when the string
    holds one (vLLM does the same), else the string."""
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except ValueError:
            return arguments
        return value if isinstance(value, dict) else arguments
    return arguments


class CallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(BaseModel):
    """An earlier assistant turn's call, as the client sends it back."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: CallFunction

    def for_template(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.function.name, "arguments": call_arguments(self.function.arguments)}}
