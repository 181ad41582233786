"""Tool calling's parts without a service (issue 53): the per-family call parser (streamed in any
split equals read whole; a trigger's start held back, then given back as text when no call
follows), the grammar an "auto" request gets (the model's syntax with each function's schema,
free text around it), and the prompt: a template with a tools section renders them itself, any
other gets the default system block and earlier calls in the model's syntax."""

from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from engine.grammar.compiler import GrammarCompiler
from engine.model.tiny import ByteTokenizer, tiny_config
from engine.model.tokenizer import Tokenizer
from router.openai_protocol import ChatCompletionRequest
from router.tool_api import ToolSettings, plan, prompt_messages
from router.tool_parser import FAMILIES, Arguments, CallStart, Content, ToolCallParser, parse_all
from router.validate import InvalidRequest

HERMES = ('Sure. <tool_call>\n{"name": "get_w", "arguments": {"city": "P}a\\"r{is", "n": [1, {"a": 2}]}}\n'
          '</tool_call>\n<tool_call>\n{"name": "b", "arguments": {}}\n</tool_call> done <tool')
CASES = [("hermes", HERMES), ("llama3_json", 'x {"name": "f", "parameters": {"a": "{"}} y'),
         ("json", '[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {"b": "}"}}]'),
         ("json", '{"name": "f", "arguments": {"a": [1, 2]}}')]
TOOLS = [{"type": "function", "function": {"name": "get_w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "b"}}]


def streamed(family: str, text: str, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
    p, deltas, i = ToolCallParser(FAMILIES[family]), [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        deltas += p.feed(text[i:j])
        i = j
    deltas += p.end()
    names = [d.name for d in deltas if isinstance(d, CallStart)]
    args = ["".join(d.text for d in deltas if isinstance(d, Arguments) and d.index == k) for k in range(len(names))]
    return "".join(d.text for d in deltas if isinstance(d, Content)), list(zip(names, args, strict=True))


@pytest.mark.parametrize("family, text", CASES)
def test_streamed_in_any_split_equals_read_whole(family, text):
    content, calls = parse_all(FAMILIES[family], text)
    whole = [(c["function"]["name"], c["function"]["arguments"]) for c in calls]
    assert all(json.loads(a) is not None for _, a in whole) and whole
    rng = random.Random(0)
    for _ in range(30):
        assert streamed(family, text, rng) == (content, whole)


def test_hermes_reads_text_around_calls_and_gives_back_a_lone_trigger_start():
    content, calls = parse_all(FAMILIES["hermes"], HERMES)
    assert content == "Sure. \n done <tool"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_w", {"city": 'P}a"r{is', "n": [1, {"a": 2}]}), ("b", {})]
    p = ToolCallParser(FAMILIES["hermes"])
    assert p.feed("hi <tool_") == [Content("hi ")]  # may be a call: held back
    assert p.end() == [Content("<tool_")]


def test_a_trigger_no_call_follows_is_text():
    text = "see <tool_call> in the docs" + "." * 200
    assert parse_all(FAMILIES["hermes"], text) == (text, [])


def compiled_accepts(spec, text: str) -> bool:
    m = GrammarCompiler(ByteTokenizer(), tiny_config().vocab_size).matcher(spec)
    return all(m.accept(b) for b in text.encode())


def test_auto_grammar_is_free_text_then_the_models_call_syntax_with_its_schema():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    tool_plan = plan(req.tools, "auto", False, ToolSettings("hermes", True))
    assert tool_plan is not None and tool_plan.spec is not None and tool_plan.spec.kind == "structural_tag"
    call = '<tool_call>\n{"name": "get_w", "arguments": {"city": "Rome"}}\n</tool_call>'
    assert compiled_accepts(tool_plan.spec, "Let me look. " + call)
    assert not compiled_accepts(tool_plan.spec, call.replace('"Rome"', '"Rome is far"'))  # maxLength 6
    assert not compiled_accepts(tool_plan.spec, call.replace('"city": ', '"town": '))
    assert not compiled_accepts(tool_plan.spec, call.replace("get_w", "get_x"))
    assert not compiled_accepts(tool_plan.spec, call + " and more")  # one call: nothing after it


def test_required_without_parallel_is_one_call_object():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    tool_plan = plan(req.tools, "required", False, ToolSettings())
    assert tool_plan is not None and tool_plan.spec is not None
    assert compiled_accepts(tool_plan.spec, '{"name": "b", "arguments": {}}')
    assert not compiled_accepts(tool_plan.spec, '[{"name": "b", "arguments": {}}]')


def chat_tokenizer(template: str) -> Tokenizer:
    return Tokenizer(HFTokenizer(models.BPE()), bos_token_id=None, eos_token_ids=(), chat_template=template)


CONVERSATION = [{"role": "user", "content": "weather?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_w", "arguments": '{"city": "Rome"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]


def rendered(template: str, choice: str = "auto") -> str:
    req = ChatCompletionRequest.model_validate({"messages": CONVERSATION, "tools": TOOLS, "tool_choice": choice})
    settings = ToolSettings("hermes", True)
    tok = chat_tokenizer(template)
    messages, tools = prompt_messages([m.for_template() for m in req.messages],
                                      plan(req.tools, req.tool_choice, None, settings), tok, settings)
    return tok.apply_chat_template(messages, tools=tools)


def test_a_template_with_a_tools_section_renders_tools_calls_and_results_itself():
    template = ("{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}|{{ m.role }}:"
                "{% for c in m.tool_calls or [] %}{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{{ m.tool_call_id or '' }}{{ m.content }}{% endfor %}")
    assert rendered(template) == "[get_w][b]|user:weather?|assistant:get_w(Rome)|tool:c1sunny"


def test_a_template_without_one_gets_the_default_block_and_calls_as_text():
    text = rendered("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert text.startswith("<system># Tools") and '"name": "get_w"' in text.split("</tools>\n")[0]
    assert '<assistant><tool_call>\n{"name": "get_w", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert text.endswith("<tool>sunny")
    assert "# Tools" not in rendered("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", "none")


def test_auto_with_a_model_without_a_template_is_refused():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    settings = ToolSettings("hermes", True)
    with pytest.raises(InvalidRequest, match="needs a model with a chat template"):
        prompt_messages([m.for_template() for m in req.messages], plan(req.tools, None, None, settings),
                        ByteTokenizer(), settings)


def test_llama3_json_auto_grammar_takes_its_parameters_key():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS})
    tool_plan = plan(req.tools, "auto", True, ToolSettings("llama3_json", True))
    assert tool_plan is not None and tool_plan.spec is not None
    call = '{"name": "get_w", "parameters": {"city": "Rome"}}'
    assert compiled_accepts(tool_plan.spec, "ok " + call + " " + call)  # parallel: more may follow
    assert not compiled_accepts(tool_plan.spec, call.replace("parameters", "arguments"))
    content, calls = parse_all(tool_plan.family, "ok " + call)
    assert content == "ok " and [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_w", '{"city": "Rome"}')]
