"""Structured outputs at the router (router/structured_api.py): every OpenAI and vLLM form reads
into one StructuredSpec on the GenerateRequest, two at once or a malformed one is refused by
name, a spec that does not compile is refused with the compiler's message, and what the router
accepts reaches the nodes' SamplingParams intact (protos/convert.py)."""

from __future__ import annotations

import asyncio
import json
import random

import pytest

from engine.grammar.structured import StructuredSpec
from protos import node_pb2, pdserve_pb2
from protos.convert import sampling_from_proto, sampling_to_proto
from router.client import build_request
from router.openai_protocol import ChatCompletionRequest, CompletionRequest
from router.request import RequestState
from router.structured_api import StructuredError, check_wire
from router.validate import InvalidRequest, Limits, Prepared, prepare
from tests.router.conftest import TINY

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}
LIMITS = Limits("tiny", TINY.config.vocab_size, max_model_len=256, max_prompt_bytes=4096, default_timeout_s=30.0)

FORMS = [
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, StructuredSpec("json_object")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA, "strict": True}}},
     StructuredSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": SCHEMA}}, StructuredSpec.json_schema(SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, StructuredSpec("json_schema", json.dumps(SCHEMA))),
    ({"structured_outputs": {"regex": "[a-z]{1,5}"}}, StructuredSpec("regex", "[a-z]{1,5}")),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, StructuredSpec.choice(["yes", "no"])),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, StructuredSpec("grammar", 'root ::= "a" | "b"')),
    ({"structured_outputs": {"json_object": True}}, StructuredSpec("json_object")),
    ({"structured_outputs": {"json_object": False, "disable_any_whitespace": None}}, None),
    ({"guided_json": SCHEMA}, StructuredSpec.json_schema(SCHEMA)),
    ({"guided_regex": "\\d+"}, StructuredSpec("regex", "\\d+")),
    ({"guided_choice": ["a", "b c"]}, StructuredSpec.choice(["a", "b c"])),
    ({"guided_grammar": 'root ::= "x"+'}, StructuredSpec("grammar", 'root ::= "x"+')),
    ({"guided_regex": "a", "guided_decoding_backend": None, "guided_whitespace_pattern": None},
     StructuredSpec("regex", "a")),
]


def completion(**body) -> pdserve_pb2.GenerateRequest:
    return CompletionRequest.model_validate({"prompt": [1, 2, 3], "max_tokens": 4, **body}).to_generate("r", None, 256)


def chat(**body) -> pdserve_pb2.GenerateRequest:
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **body})
    return req.to_generate("r", TINY.tokenizer, 256, 4096)


@pytest.mark.parametrize("body, spec", FORMS)
def test_every_form_reads_into_one_spec_on_both_endpoints(body, spec):
    want = spec.to_wire() if spec else ""
    assert completion(**body).sampling.structured == want
    assert chat(**body).sampling.structured == want
    assert StructuredSpec.from_wire(want) == spec


@pytest.mark.parametrize("body, names", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, ["response_format", "guided_regex"]),
    ({"structured_outputs": {"regex": "a", "choice": ["x"]}}, ["structured_outputs.regex", "structured_outputs.choice"]),
    ({"guided_json": SCHEMA, "guided_choice": ["x"]}, ["guided_json", "guided_choice"]),
    ({"structured_outputs": {"json_object": True}, "response_format": {"type": "json_schema",
                                                                       "json_schema": {"schema": SCHEMA}}},
     ["response_format", "structured_outputs.json_object"]),
])
def test_two_constraints_are_refused_naming_both(body, names):
    for build in (completion, chat):
        with pytest.raises(InvalidRequest) as e:
            build(**body)
        assert all(n in str(e.value) for n in names), str(e.value)


@pytest.mark.parametrize("body, words", [
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"guided_whitespace_pattern": " *"}, "guided_whitespace_pattern"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "t"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "json_schema.schema"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
    ({"guided_regex": "x" * 70000}, "guided_regex"),
    ({"structured_outputs": {"json": 3}}, "structured_outputs.json"),
])
def test_malformed_or_unsupported_fields_are_named(body, words):
    with pytest.raises((InvalidRequest, ValueError)) as e:
        completion(**body)
    assert words in str(e.value), str(e.value)


@pytest.mark.parametrize("spec, words", [
    (StructuredSpec("regex", "a("), "parenthesis"),
    (StructuredSpec.json_schema({"type": "foo"}), "foo"),
    (StructuredSpec("grammar", "root ::= undefined_rule"), "undefined_rule"),
])
def test_a_spec_that_does_not_compile_is_refused_with_the_compilers_message(spec, words):
    with pytest.raises(StructuredError) as e:
        check_wire(spec.to_wire())
    assert words in str(e.value) and "/project/" not in str(e.value), str(e.value)


@pytest.mark.parametrize("wire", ['["regex"]', '["nope", "x"]', "not json", '["choice", "[]"]', '[1, 2]'])
def test_malformed_wire_specs_are_refused(wire):
    with pytest.raises(StructuredError):
        check_wire(wire)
    with pytest.raises(ValueError):
        sampling_from_proto(node_pb2.Sampling(max_tokens=3, structured=wire), TINY.config.vocab_size)


def prepared(spec: StructuredSpec | str | None) -> node_pb2.Sampling:
    req = build_request([1, 2, 3], max_tokens=4, structured=spec if isinstance(spec, StructuredSpec) else None)
    if isinstance(spec, str):
        req.sampling.structured = spec
    return asyncio.run(prepare(req, None, (0,), LIMITS, random.Random(0))).sampling


@pytest.mark.parametrize("spec", [s for _, s in FORMS if s is not None])
def test_the_grpc_door_hands_the_nodes_the_spec_and_they_read_it(spec):
    sampling = prepared(spec)
    assert sampling.structured == spec.to_wire()
    params, _, _ = sampling_from_proto(sampling, TINY.config.vocab_size)  # what P and D build
    assert params.structured == spec
    again = sampling_to_proto(params, 1, ())  # the TP nodes' hop to their other ranks
    assert sampling_from_proto(again, TINY.config.vocab_size)[0].structured == spec


@pytest.mark.parametrize("wire, words", [
    (StructuredSpec("regex", "[").to_wire(), "regex does not compile"),
    ('["json_schema", "{"]', "not valid JSON"),
    ("x" * 140000, "structured"),
])
def test_the_grpc_door_refuses_bad_specs(wire, words):
    with pytest.raises(InvalidRequest) as e:
        prepared(wire)
    assert words in str(e.value), str(e.value)


def test_no_spec_is_none_on_the_node():
    sampling = prepared(None)
    assert sampling.structured == ""
    assert sampling_from_proto(sampling, TINY.config.vocab_size)[0].structured is None


def test_a_moved_request_keeps_its_spec():
    """Migration re-places a request with `resume_sampling`: the spec goes with it, and
    `resumed_tokens` tells the engine how many of the new prompt's tokens the grammar has seen."""
    wire = StructuredSpec("regex", "[a-z]+").to_wire()
    st = RequestState(Prepared("r", [256, 97], node_pb2.Sampling(max_tokens=10, structured=wire), (), None, 60.0),
                      TINY.tokenizer)
    st.add_tokens([98, 99], None)
    moved = st.resume_sampling()
    assert moved.structured == wire and moved.resumed_tokens == 2 and moved.max_tokens == 8
    assert sampling_from_proto(moved, TINY.config.vocab_size)[0].structured == StructuredSpec("regex", "[a-z]+")
