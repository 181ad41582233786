"""Tool calling through the whole service (issue 53): the official `openai` client against real
HTTP on 127.0.0.1 and real tiny-model nodes in this process, 1P1D with MTP k = 3 and a colocated
node with k = 0.

"required" and named calls are written by the grammar, so with the random tiny model too they
parse and their arguments validate against the function's schema: over 50 schemas (`make test`
runs the first 10, which hold every kind of parameter; `make fuzz` all 50), streamed (assembled
by the client's own stream helper) and not, through PD at k = 3 and colocated at k = 0, the
greedy calls equal across the two. Bad tools are 400s naming the field."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import openai
import pytest

from tests.fuzz import long_run
from tests.router.real_service import RealService

MESSAGES = [{"role": "user", "content": "Call a tool."}]


@pytest.fixture(scope="module")
def services():
    pd = RealService("pd", k=3, max_model_len=512)
    colocated = RealService("colocated", k=0, max_model_len=512)
    yield {"pd": pd, "colocated": colocated}
    pd.close()
    colocated.close()


@pytest.fixture(params=["pd", "colocated"])
def service(services, request):
    return services[request.param]


def schema_of(i: int) -> dict[str, Any]:
    """The i-th of 50 parameter schemas: each JSON type, bounds, enums, nesting, optional keys.
    Strings and arrays are bounded so that a random model's call ends within max_tokens."""
    kinds: list[dict[str, Any]] = [
        {"type": "string", "maxLength": 1 + i % 6},
        {"type": "integer", "minimum": -i, "maximum": i * 3 + 1},
        {"type": "number", "minimum": 0, "maximum": 10},
        {"type": "boolean"},
        {"enum": ["red", "green", f"blue{i}"]},
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 1 + i % 3},
        {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 5},
                                          "tag": {"type": "string", "maxLength": 3}},
         "required": ["x", "tag"], "additionalProperties": False},
        {"type": "string", "pattern": "^[a-z]{2,4}$"},
        {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"type": "null"}]},
        {"type": "string", "format": "date"},
    ]
    props = {f"p{j}": kinds[(i + j * 3) % len(kinds)] for j in range(1 + i % 4)}
    required = sorted(props)[: 1 + (i % 3) % len(props)]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def tool(name: str, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [tool(f"f{i}", schema_of(i)) for i in range(50)]
# Schemas 0-9 use each of schema_of's ten kinds at least once, optional keys and nesting included.
NAMED_SCHEMAS = len(TOOLS) if long_run() else 10


def call(service: RealService, stream: bool, **kwargs: Any) -> Any:
    """The completion's message and finish reason, streamed through the client's stream helper or not."""
    args: dict[str, Any] = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 0, **kwargs}
    if not stream:
        got = service.client.chat.completions.create(**args)
        return got.choices[0].message, got.choices[0].finish_reason
    with service.client.chat.completions.stream(**args) as s:
        for _ in s:
            pass
        try:
            final = s.get_final_completion()
        except openai.LengthFinishReasonError as e:  # the helper parses only what ended on its own
            final = e.completion
    return final.choices[0].message, final.choices[0].finish_reason


def checked_calls(message: Any, tools: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """(name, arguments) of each call, each arguments object validated against its tool's schema."""
    schemas = {t["function"]["name"]: t["function"].get("parameters", {"type": "object"}) for t in tools}
    out = []
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        args = json.loads(c.function.arguments)
        jsonschema.validate(args, schemas[c.function.name])
        out.append((c.function.name, args))
    return out


def named_calls(service: RealService, schemas: range) -> list[list[tuple[str, Any]]]:
    """Each schema's tool called by name, streamed or not (alternately); its calls, checked."""
    out = []
    for i in schemas:
        choice = {"type": "function", "function": {"name": f"f{i}"}}
        message, reason = call(service, stream=i % 2 == 1, tools=TOOLS[i:i + 2], tool_choice=choice)
        assert reason == "tool_calls" and message.content is None, (i, message)
        out.append(checked_calls(message, TOOLS))
        assert [name for name, _ in out[-1]] == [f"f{i}"]
    return out


@pytest.mark.parametrize("first", range(0, NAMED_SCHEMAS, 10))
def test_named_calls_validate_and_k3_in_pd_equals_k0_colocated(services, first):
    """Each schema by name; the greedy call is the same through PD at k = 3 as colocated at
    k = 0. The two services run side by side, each one request at a time."""
    schemas = range(first, first + 10)
    with ThreadPoolExecutor(2) as pool:
        pd, colocated = pool.map(lambda s: named_calls(s, schemas), [services["pd"], services["colocated"]])
    assert pd == colocated
    assert all(s.blocks_back() for s in services.values())


@pytest.mark.parametrize("stream", [False, True])
def test_required_picks_one_of_the_tools_and_validates(service, stream):
    message, reason = call(service, stream, tools=TOOLS[:12], tool_choice="required", parallel_tool_calls=False)
    assert reason == "tool_calls"
    assert len(checked_calls(message, TOOLS)) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_required_calls_are_an_array_of_valid_calls(service, stream):
    """With parallel_tool_calls the grammar takes an array of calls; the random model may write
    many, so only the complete ones are checked when max_tokens cuts it."""
    message, reason = call(service, stream, tools=[tool("a", schema_of(0)), tool("b")], tool_choice="required",
                           max_tokens=120)
    assert reason in ("tool_calls", "length")
    complete = [c for c in message.tool_calls if reason == "tool_calls" or c is not message.tool_calls[-1]]
    assert checked_calls(type("M", (), {"tool_calls": complete})(), [tool("a", schema_of(0)), tool("b")])


def test_streamed_deltas_name_the_call_first_then_fragments(services):
    chunks = list(services["pd"].client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=200, temperature=0, stream=True, tools=TOOLS[3:4],
        tool_choice={"type": "function", "function": {"name": "f3"}}))
    entries = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert entries[0].index == 0 and entries[0].id and entries[0].type == "function"
    assert entries[0].function.name == "f3"
    assert all(e.index == 0 and e.id is None and e.function.name is None for e in entries[1:])
    assert json.loads("".join(e.function.arguments or "" for e in entries)) is not None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_answers_text(service):
    got = service.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4, tools=TOOLS[:2],
                                                 tool_choice="none")
    assert got.choices[0].message.tool_calls is None and got.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, words", [
    ({"tools": TOOLS[:2], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name: no tool is named 'nope'"),
    ({"tools": [tool("bad", {"type": "foo"})], "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"tools": TOOLS[:2], "tool_choice": "auto"}, "--enable-auto-tool-choice"),
    ({"tools": TOOLS[:2]}, "--enable-auto-tool-choice"),  # OpenAI's default with tools is "auto"
    ({"tools": [tool("a b")], "tool_choice": "required"}, "tools.0.function.name"),
    ({"tools": [tool("a"), tool("a")], "tool_choice": "required"}, "names must be unique"),
    ({"tool_choice": "required"}, "tool_choice needs tools"),
    ({"tools": [tool(f"big{i}", {"type": "object", "properties": {"a": {"enum": [f"{'v' * 50}{j}" for j in range(70)]}}})
                for i in range(20)], "tool_choice": "required"}, "tools: a structured output json_schema must be"),
    ({"tools": TOOLS[:1], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "got tools and a structured output field"),
])
def test_bad_tools_are_a_400_naming_the_field(services, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        services["pd"].client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                                      extra_body=extra)
    assert words in e.value.body["message"], e.value.body  # type: ignore[index]


def test_auto_needs_a_chat_template(services):
    """tiny has no chat template, so "auto" has no way to show it the tools."""
    service = RealService("colocated", k=0, max_model_len=128, tool_call_parser="hermes",
                          enable_auto_tool_choice=True)
    try:
        with pytest.raises(openai.BadRequestError) as e:
            service.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tools=TOOLS[:1])
        assert "needs a model with a chat template" in e.value.body["message"]  # type: ignore[index]
    finally:
        service.close()


@pytest.mark.parametrize("stream", [False, True])
def test_each_of_n_sampled_choices_is_a_valid_call(services, stream):
    args = {"model": "tiny", "messages": MESSAGES, "max_tokens": 400, "temperature": 1.0, "seed": 3, "n": 2,
            "tools": TOOLS[5:9], "tool_choice": "required", "parallel_tool_calls": False}
    client = services["pd"].client
    if stream:
        with client.chat.completions.stream(**args) as s:
            for _ in s:
                pass
            choices = s.get_final_completion().choices
    else:
        choices = client.chat.completions.create(**args).choices
    assert sorted(c.index for c in choices) == [0, 1]
    for c in choices:
        assert c.finish_reason == "tool_calls" and len(checked_calls(c.message, TOOLS)) == 1
