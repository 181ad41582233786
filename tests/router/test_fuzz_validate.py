"""Fuzzing the request validators: the router's `prepare` (client GenerateRequest -> Prepared)
and the nodes' own checks of what the router sends (`check_request_id`, `sampling_from_proto`).

Every GenerateRequest the protobuf can carry ends in InvalidRequest or a Prepared that keeps
every rule the nodes rely on (a non-empty prompt of in-vocabulary ids with room for max_tokens in
the context, finite non-negative temperature, top_p in (0, 1], logprobs -1 or 0..20, a seed below
2**63, stop ids in the vocabulary, a finite positive deadline, a structured-output spec that
parses and compiles), and whatever the router accepts the nodes accept too. Any node Sampling
ends in ValueError or sane engine parameters."""

from __future__ import annotations

import asyncio
import json
import math
import random

from hypothesis import given
from hypothesis import strategies as st

from engine.grammar.structured import KINDS, StructuredSpec
from engine.sampling.sampling_params import MAX_LOGPROBS
from protos import node_pb2, pdserve_pb2
from protos.convert import check_request_id, sampling_from_proto
from router.validate import InvalidRequest, Limits, Prepared, prepare
from tests.fuzz import fuzz_settings
from tests.router.conftest import TINY

VOCAB = TINY.config.vocab_size
LIMITS = Limits("tiny", VOCAB, max_model_len=64, max_prompt_bytes=256, default_timeout_s=30.0)
INT32 = st.sampled_from([0, 1, -1, 20, 21, 63, 64, VOCAB - 1, VOCAB, 2**31 - 1, -(2**31)]) | st.integers(-(2**31), 2**31 - 1)
FLOATS = st.sampled_from([0.0, -0.0, 1.0, 0.5, -1.0, 1.0000001, float("nan"), float("inf"), float("-inf")]) | st.floats(
    width=32)
IDS = st.lists(st.integers(-2, VOCAB + 2) | INT32, max_size=8)
STRUCTURED = st.sampled_from(["", StructuredSpec("regex", "[a-z]+").to_wire(), StructuredSpec("json_object").to_wire(),
                              StructuredSpec.json_schema({"type": "object"}).to_wire(), '["regex", "(("]', "[]",
                              '["json_schema", "{"]', '["choice", "[]"]', "garbage"]) | st.text(max_size=40) | st.builds(
    lambda kind, value: json.dumps([kind, value]), st.sampled_from([*KINDS, "x"]), st.text(max_size=20))


@st.composite
def sampling_options(draw: st.DrawFn) -> pdserve_pb2.SamplingOptions:
    s = pdserve_pb2.SamplingOptions(
        temperature=draw(FLOATS), top_p=draw(FLOATS), top_k=draw(INT32), max_tokens=draw(INT32),
        stop=draw(st.lists(st.text(max_size=300) | st.just(""), max_size=3)), stop_token_ids=draw(IDS),
        ignore_eos=draw(st.booleans()))
    if draw(st.booleans()):  # the surface: penalties, logit_bias, n, prompt_logprobs
        s.presence_penalty, s.frequency_penalty, s.repetition_penalty = draw(FLOATS), draw(FLOATS), draw(FLOATS)
        s.logit_bias.update(draw(st.dictionaries(st.integers(-2, VOCAB + 2) | INT32, FLOATS, max_size=3)))
        s.n = draw(st.sampled_from([0, 1, 2, 16, 17, -1]) | INT32)
        if draw(st.booleans()):
            s.prompt_logprobs = draw(INT32)
    if draw(st.booleans()):  # structured outputs: a wire spec, well-formed or not
        s.structured = draw(STRUCTURED)
    if draw(st.booleans()):
        s.seed = draw(st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        s.logprobs = draw(INT32)
    return s


@st.composite
def generate_requests(draw: st.DrawFn) -> pdserve_pb2.GenerateRequest:
    req = pdserve_pb2.GenerateRequest(
        request_id=draw(st.sampled_from(["", "r", "x" * 200, "x" * 201]) | st.text(max_size=16)),
        model=draw(st.sampled_from(["", "tiny", "other"])), chat=draw(st.booleans()),
        sampling=draw(sampling_options()), timeout_s=draw(FLOATS))
    if draw(st.booleans()):
        req.prompt = draw(st.text(max_size=80) | st.just("x" * 257))
    if draw(st.booleans()):
        req.prompt_token_ids.extend(draw(IDS | st.lists(st.integers(0, VOCAB - 1), min_size=60, max_size=70)))
    return req


def check_prepared(p: Prepared) -> None:
    s = p.sampling
    assert 0 < len(p.prompt_ids) < LIMITS.max_model_len and all(0 <= t < VOCAB for t in p.prompt_ids)
    assert 1 <= s.max_tokens and len(p.prompt_ids) + s.max_tokens <= LIMITS.max_model_len
    assert math.isfinite(s.temperature) and s.temperature >= 0 and 0 < s.top_p <= 1 and s.top_k >= 0
    assert s.logprobs == -1 or 0 <= s.logprobs <= MAX_LOGPROBS
    assert 0 <= s.seed < 2**63 and all(0 <= t < VOCAB for t in s.stop_token_ids)
    assert 0 < len(p.request_id) <= 200 and math.isfinite(p.timeout_s) and p.timeout_s > 0
    # what the router accepts, the nodes accept (their own validation of the same fields)
    check_request_id(f"0123abcd/{p.request_id}/1")
    params, seed, stops = sampling_from_proto(s, VOCAB)
    assert (params.max_tokens, seed, stops) == (s.max_tokens, s.seed, tuple(s.stop_token_ids))
    assert params.n == max(1, s.n) and dict(params.logit_bias) == dict(s.logit_bias)
    assert params.prompt_logprobs == (None if s.prompt_logprobs < 0 else s.prompt_logprobs)
    assert params.structured == StructuredSpec.from_wire(s.structured)


@fuzz_settings(400)
@given(generate_requests())
def test_every_generate_request_is_refused_or_safe_for_the_nodes(req: pdserve_pb2.GenerateRequest) -> None:
    try:
        prepared = asyncio.run(prepare(req, TINY.tokenizer, tuple(TINY.eos_token_ids), LIMITS, random.Random(0)))
    except InvalidRequest as e:
        assert str(e)  # a message for the client
        return
    check_prepared(prepared)


@fuzz_settings(400)
@given(st.builds(node_pb2.Sampling, temperature=FLOATS, top_p=FLOATS, top_k=INT32,
                 seed=st.integers(0, 2**64 - 1), max_tokens=INT32, logprobs=INT32, stop_token_ids=IDS,
                 presence_penalty=FLOATS, frequency_penalty=FLOATS, repetition_penalty=FLOATS,
                 logit_bias=st.dictionaries(st.integers(-2, VOCAB + 2), FLOATS, max_size=3), n=INT32,
                 prompt_logprobs=INT32, resumed_tokens=INT32, structured=STRUCTURED),
       st.text(max_size=300))
def test_node_side_checks_refuse_or_give_sane_parameters(s: node_pb2.Sampling, rid: str) -> None:
    try:
        assert check_request_id(rid) == rid and 0 < len(rid) <= 256
    except ValueError:
        pass
    try:
        params, seed, stops = sampling_from_proto(s, VOCAB)
    except ValueError:
        return
    assert math.isfinite(params.temperature) and params.temperature >= 0
    assert 0 < params.top_p <= 1 and params.top_k >= 0 and params.max_tokens > 0
    assert params.logprobs is None or 0 <= params.logprobs <= MAX_LOGPROBS
    assert 0 <= seed < 2**63 and all(0 <= t < VOCAB for t in stops)
    assert all(-2 <= x <= 2 for x in (params.presence_penalty, params.frequency_penalty))
    assert 0 < params.repetition_penalty <= 100 and 1 <= params.n <= 16 and params.resumed_tokens >= 0
    assert all(0 <= t < VOCAB and -100 <= b <= 100 for t, b in params.logit_bias)
    assert params.prompt_logprobs is None or 0 <= params.prompt_logprobs <= MAX_LOGPROBS
    assert params.structured is None or params.structured.kind in KINDS
