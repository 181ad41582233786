"""The OpenAI surface through the whole service (real HTTP on 127.0.0.1, the official `openai`
client, real tiny-model nodes in this process, PD with MTP k=2 and colocated): penalties and
logit_bias give the single-process engine's answer; fields still refused get a 400 naming them."""

from __future__ import annotations

import openai
import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from tests.router.real_service import RealService

PROMPT = [256, 5, 17, 5, 99, 5, 17, 100, 31]  # BOS first, as a text prompt would have


@pytest.fixture(scope="module", params=["pd", "colocated"])
def service(request):
    s = RealService(request.param)
    yield s
    s.close()


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(load_model("tiny"), EngineConfig(num_speculative_tokens=2))  # as the service: seeded draws match


def engine_text(engine, params: SamplingParams) -> str:
    out = engine.generate([PROMPT], params)[0]
    return engine.tokenizer.decode(out.output_ids)


PENALIZED = [
    (dict(frequency_penalty=1.5, presence_penalty=0.5), dict(frequency_penalty=1.5, presence_penalty=0.5)),
    (dict(logit_bias={"65": 9.0, "66": 9.0}, frequency_penalty=2.0),
     dict(logit_bias=((65, 9.0), (66, 9.0)), frequency_penalty=2.0)),
    (dict(extra_body={"repetition_penalty": 2.0}), dict(repetition_penalty=2.0)),
]


@pytest.mark.parametrize("http, params", PENALIZED)
def test_penalties_through_the_service_equal_the_engine(service, engine, http, params):
    want = engine_text(engine, SamplingParams(max_tokens=12, ignore_eos=True, **params))
    assert want != engine_text(engine, SamplingParams(max_tokens=12, ignore_eos=True))  # the test can fail
    http = dict(http)
    extra = {"ignore_eos": True, **http.pop("extra_body", {})}
    got = service.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                            extra_body=extra, **http)
    assert got.choices[0].text == want
    chat = service.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "\x05\x11\x05c\x05\x11d\x1f"}], max_tokens=12,
        temperature=0, stream=True, extra_body=extra, **http)
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == want
    assert service.blocks_back()


def test_seeded_sampling_with_penalties_equals_the_engine(service, engine):
    params = dict(temperature=0.9, seed=5, presence_penalty=1.0, logit_bias={"120": 4.0})
    want = engine_text(engine, SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.9, seed=5,
                                              presence_penalty=1.0, logit_bias=((120, 4.0),)))
    got = service.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, extra_body={"ignore_eos": True},
                                            **params)
    assert got.choices[0].text == want


@pytest.mark.parametrize("kwargs, words", [
    (dict(frequency_penalty=2.5), "frequency_penalty"),
    (dict(presence_penalty=-3), "presence_penalty"),
    (dict(logit_bias={"5": 101}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"),
    (dict(logit_bias={"400": 1}), "logit_bias"),
    (dict(extra_body={"repetition_penalty": 0}), "repetition_penalty"),
    (dict(best_of=3), "best_of"),
    (dict(suffix="x"), "suffix"),
])
def test_refused_fields_are_named(service, kwargs, words):
    with pytest.raises(openai.BadRequestError) as e:
        service.client.completions.create(model="tiny", prompt="ab", max_tokens=3, **kwargs)
    assert words in e.value.body["message"]  # type: ignore[index]
