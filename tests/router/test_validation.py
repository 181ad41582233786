"""Bad requests fail at once with INVALID_ARGUMENT and a clear message; the router keeps
serving; nothing reaches the nodes."""

from __future__ import annotations

import json

import pytest

from protos import pdserve_pb2 as pb
from router.client import RouterError, build_request
from router.openai_protocol import CompletionRequest
from router.validate import InvalidRequest
from tests.router.conftest import MAX_MODEL_LEN, cluster


def both_prompts() -> pb.GenerateRequest:
    req = build_request("hi")
    req.prompt_token_ids.extend([1, 2])
    return req


def neither_prompt() -> pb.GenerateRequest:
    return pb.GenerateRequest(sampling=pb.SamplingOptions(max_tokens=4))


BAD = [
    (neither_prompt(), "prompt is empty"),
    (build_request(""), "prompt is empty"),
    (both_prompts(), "exactly one of prompt"),
    (build_request("x" * MAX_MODEL_LEN), f"context is {MAX_MODEL_LEN}"),
    (build_request([1] * MAX_MODEL_LEN), f"context is {MAX_MODEL_LEN}"),
    (build_request("x" * ((1 << 20) + 1)), "bytes; the limit is 1048576"),
    (build_request([1, 320]), "token id 320 outside the vocabulary"),
    (build_request([-1]), "token id -1 outside the vocabulary"),
    (build_request("hi", max_tokens=0), "max_tokens must be > 0"),
    (build_request("hi", max_tokens=-3), "max_tokens must be > 0"),
    (build_request("hi", logprobs=21), "logprobs must be in 0..20"),
    (build_request("hi", logprobs=-1), "logprobs must be in 0..20"),
    (build_request("hi", temperature=-0.1), "temperature must be >= 0"),
    (build_request("hi", temperature=float("nan")), "temperature must be >= 0"),
    (build_request("hi", top_p=1.5), "top_p must be in (0, 1]"),
    (build_request("hi", top_p=-0.5), "top_p must be in (0, 1]"),
    (build_request("hi", top_k=-1), "top_k must be >= 0"),
    (build_request("hi", model="llama-70b"), "unknown model 'llama-70b'; this router serves 'tiny'"),
    (build_request("hi", seed=2**63), "seed must be in"),
    (build_request("hi", stop=[""]), "stop strings must be"),
    (build_request("hi", stop_token_ids=[999]), "stop_token_ids has token id 999"),
    (build_request("hi", timeout_s=-1), "timeout_s must be >= 0"),
    (build_request("hi", request_id="r" * 201), "request_id is over 200"),
    (build_request([1, 2], chat=True), "chat=true needs a text prompt"),
]


async def test_every_bad_request_is_invalid_argument_and_service_keeps_serving():
    async with cluster() as c:
        for req, message in BAD:
            with pytest.raises(RouterError) as e:
                await c.client.generate(req)
            assert e.value.code == "INVALID_ARGUMENT", (message, e.value)
            assert message in e.value.message, (message, e.value.message)
        assert c.decode[0].reserves == [] and c.prefill[0].calls == []
        assert c.router.counts["invalid"] == len(BAD)
        ok = await c.client.generate(build_request("hi", max_tokens=3, model="tiny"))
        assert ok["finish_reason"] == "length" and ok["text"] == "jhe"
        assert (await c.client.health()).serving


async def test_prompt_at_the_limits_is_accepted_and_max_tokens_is_clipped():
    async with cluster() as c:
        out = await c.client.generate(build_request([65] * (MAX_MODEL_LEN - 1), max_tokens=50))
        assert out["finish_reason"] == "length" and len(out["token_ids"]) == 1  # room for one token
        out = await c.client.generate(build_request("x" * 100, top_p=0.0, max_tokens=2, request_id="r" * 200))
        assert out["finish_reason"] == "length"
        await c.settled()


@pytest.mark.parametrize(("prompt", "read"), [([5, 7], [5, 7]), (["12"], ["12"]), (["12", "ab"], ["12", "ab"]),
                                             ([1.0, 2], [1, 2]), ([[1, 2]], [[1, 2]]), ("x", "x")])
def test_a_completions_prompt_is_read_as_its_json_gives_it(prompt, read):
    """Ids and texts alike, whatever order the prompt's union tries them in (ids first: fast)."""
    assert CompletionRequest.model_validate_json(json.dumps({"prompt": prompt})).prompt == read


@pytest.mark.parametrize("bad", [2**31, -(2**31) - 1])
def test_a_completions_prompt_id_outside_int32_is_named(bad):
    req = CompletionRequest.model_validate_json(json.dumps({"prompt": [1, bad, 2]}))
    with pytest.raises(InvalidRequest, match=f"token id {bad} is out of range"):
        req.to_generate("cmpl-x", None, MAX_MODEL_LEN)
