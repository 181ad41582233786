"""Structured outputs through the whole service (real HTTP and gRPC on 127.0.0.1, real tiny-model
nodes in this process, PD with MTP k=2 and colocated): a spec sent through either door arrives
intact in the SamplingParams the prefill and decode (or colocated) nodes build; the official
`openai` client's `chat.completions.parse` is served; bad specs are refused by the router and by
the nodes themselves.

Until the engine masks (engine/grammar/compiler.py, the structured-engine branch) the tiny model's text
is not held to the spec: what is checked here is the request surface and the wire."""

from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest
from pydantic import BaseModel, Field

import decode_node.server as decode_server
import prefill_node.intake as prefill_server  # where the prefill node reads a request
from engine.grammar.structured import StructuredSpec
from protos import node_pb2, node_pb2_grpc
from protos.convert import pack_token_ids
from router.client import RouterError, generate_many
from tests.prefill_stream import send_prefill
from tests.router.real_service import RealService

MESSAGES = [{"role": "user", "content": "Give me a person as JSON."}]
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


class Person(BaseModel):
    name: str = Field(max_length=12)
    age: int


@pytest.fixture(scope="module", params=["pd", "colocated"])
def service(request):
    s = RealService(request.param, max_model_len=256)
    yield s
    s.close()


@pytest.fixture
def seen(monkeypatch):
    """(node kind, SamplingParams) for every request a node reads off the wire."""
    got: list[tuple[str, object]] = []
    for mod, kind in ((prefill_server, "prefill"), (decode_server, "decode")):
        def spy(s, vocab, real=mod.sampling_from_proto, kind=kind):
            out = real(s, vocab)
            got.append((kind, out[0]))
            return out
        monkeypatch.setattr(mod, "sampling_from_proto", spy)
    return got


def specs_on_nodes(service, seen) -> dict[str, StructuredSpec | None]:
    assert service.blocks_back()
    kinds = {"prefill", "decode"} if service.mode == "pd" else {"decode"}  # colocated: decode_node/server.py
    assert {k for k, _ in seen} == kinds
    return {k: p.structured for k, p in seen}  # type: ignore[attr-defined]


@pytest.mark.parametrize("stream", [False, True])
def test_an_http_spec_reaches_the_nodes_sampling_params(service, seen, stream):
    got = service.client.chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=6, stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "ok", "schema": SCHEMA, "strict": True}})
    if stream:
        assert [c for c in got]
    spec = StructuredSpec.json_schema(SCHEMA)
    assert set(specs_on_nodes(service, seen).values()) == {spec}


def test_a_grpc_spec_reaches_the_nodes_sampling_params(service, seen):
    spec = StructuredSpec("regex", "[a-z]{1,8}")
    address = f"127.0.0.1:{service.router.grpc_port}"
    out = asyncio.run(generate_many(address, ["ab"], structured=spec, max_tokens=4))
    assert out[0]["finish_reason"]
    assert set(specs_on_nodes(service, seen).values()) == {spec}


def test_completions_with_guided_choice_reaches_the_nodes(service, seen):
    got = service.client.completions.create(model="tiny", prompt="ab", max_tokens=3,
                                            extra_body={"guided_choice": ["yes", "no"]})
    assert got.choices
    assert set(specs_on_nodes(service, seen).values()) == {StructuredSpec.choice(["yes", "no"])}


def test_openai_parse_is_served_with_the_models_schema(service, seen):
    raw = service.client.chat.completions.with_raw_response.parse(
        model="tiny", messages=MESSAGES, max_tokens=8, response_format=Person)
    assert raw.http_response.status_code == 200
    spec = set(specs_on_nodes(service, seen).values())
    assert len(spec) == 1
    (only,) = spec
    assert only is not None and only.kind == "json_schema"
    schema = json.loads(only.value)
    assert set(schema["properties"]) == {"name", "age"} and set(schema["required"]) == {"name", "age"}
    assert schema["additionalProperties"] is False and schema["properties"]["name"]["maxLength"] == 12


def test_openai_parse_gives_a_parsed_object(service):
    """Greedy: tiny's random sampled text may run past max_tokens or into byte sequences that are
    not UTF-8 (xgrammar's strings allow encoded surrogates), which no parser takes."""
    got = service.client.chat.completions.parse(model="tiny", messages=MESSAGES, max_tokens=128, temperature=0,
                                                response_format=Person)
    assert isinstance(got.choices[0].message.parsed, Person)


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "JSON schema does not compile"),
    ({"guided_regex": "a("}, "regex does not compile"),
    ({"structured_outputs": {"grammar": "root ::= nothing"}}, "grammar does not compile"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "response_format and guided_choice"),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar"}, "guided_decoding_backend"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"json": False}}, "cannot accept any value"),
])
def test_bad_specs_are_a_400_naming_the_field(service, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        service.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, extra_body=extra)
    assert words in e.value.body["message"], e.value.body  # type: ignore[index]


def test_the_grpc_door_refuses_a_spec_that_does_not_compile(service):
    address = f"127.0.0.1:{service.router.grpc_port}"
    with pytest.raises(RouterError) as e:
        asyncio.run(generate_many(address, ["ab"], structured=StructuredSpec("regex", "(("), max_tokens=2))
    assert e.value.code == "INVALID_ARGUMENT" and "regex does not compile" in e.value.message


def test_the_nodes_refuse_a_malformed_spec_and_keep_serving(service):
    bad = node_pb2.Sampling(max_tokens=3, structured='["regex", ""]')
    calls = []
    for server, port in service.servers:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        if service.mode == "colocated":
            stub = node_pb2_grpc.ColocatedControlStub(channel)
            calls.append(lambda stub=stub: stub.Submit(node_pb2.ReserveRequest(
                request_id="bad", prompt_len=2, prompt_token_ids_packed=pack_token_ids([1, 2]), sampling=bad)))
        elif server is service.servers[0][0]:
            stub = node_pb2_grpc.PrefillControlStub(channel)
            calls.append(lambda stub=stub: send_prefill(stub, node_pb2.PrefillRequest(
                request_id="bad", prompt_token_ids_packed=pack_token_ids([1, 2]), sampling=bad, descriptor_msgpack=b"\x80",
                decode_address="127.0.0.1:1")))
        else:
            stub = node_pb2_grpc.DecodeControlStub(channel)
            calls.append(lambda stub=stub: stub.Reserve(node_pb2.ReserveRequest(
                request_id="bad", prompt_len=2, sampling=bad)))
    for call in calls:
        with pytest.raises(grpc.RpcError) as e:
            call()
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "regex" in e.value.details()
    assert service.client.completions.create(model="tiny", prompt="ab", max_tokens=2).choices
    assert service.blocks_back()


def test_ignore_eos_with_a_spec_is_a_400(service):
    """A finished grammar allows only EOS: ignore_eos with a constraint is refused at the door,
    not retried against the nodes until the deadline."""
    with pytest.raises(openai.BadRequestError) as e:
        service.client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2,
                                               extra_body={"guided_regex": "[a-z]+", "ignore_eos": True})
    assert "ignore_eos cannot be used with structured output" in e.value.body["message"]  # type: ignore[index]
