"""The OpenAI surface through the whole service (real HTTP on 127.0.0.1, the official `openai`
client, real tiny-model nodes in this process, PD with MTP k=2 and colocated): penalties and
logit_bias give the single-process engine's answer; fields still refused get a 400 naming them."""

from __future__ import annotations

import time

import httpx2
import openai
import pytest

from engine.engine import EngineConfig, LLMEngine
from engine.model.loader import load_model
from engine.sampling.sampling_params import SamplingParams
from tests.router.real_service import RealService

PROMPT = [256, 5, 17, 5, 99, 5, 17, 100, 31]  # BOS first, as a text prompt would have


@pytest.fixture(scope="module", params=["pd", "colocated"])
def service(request):
    s = RealService(request.param, max_model_len=256)
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


def engine_choices(engine, params: SamplingParams) -> list[str]:
    out = engine.generate([PROMPT], params)[0]
    return [engine.tokenizer.decode(r.output_ids) for r in (out, *out.children)]


def test_n_choices_equal_the_engine_streaming_and_not(service, engine):
    want = engine_choices(engine, SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=3, n=4))
    assert len(set(want)) == 4
    got = service.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, n=4, seed=3,
                                            extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3] and [c.text for c in got.choices] == want
    assert got.usage.completion_tokens == 40 and {c.finish_reason for c in got.choices} == {"length"}
    stream = service.client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "\x05\x11\x05c\x05\x11d\x1f"}], max_tokens=10, n=4,
        seed=3, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    texts, reasons, roles = ["", "", "", ""], [[], [], [], []], [0] * 4
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            roles[c.index] += c.delta.role == "assistant"
            reasons[c.index] += [c.finish_reason] if c.finish_reason else []
    assert texts == want and reasons == [["length"]] * 4 and roles == [1] * 4
    assert chunk.usage.completion_tokens == 40  # the last chunk: usage over every choice
    assert service.blocks_back()


def test_n_choices_share_the_prompts_blocks_as_health_shows(service):
    prompt = list(range(40, 90))  # 50 tokens: 3 full blocks before the last token's are shared
    stream = service.client.completions.create(model="tiny", prompt=prompt, max_tokens=150, n=4, temperature=1,
                                               stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    need = -(-(50 + 150 + 2 * 2 + 1) // 16)  # one choice's blocks (engine/runner/model_runner.kv_room_needed)
    want = (4 * need - 3 * 3, 3)  # 4 choices, 3 of them borrowing choice 0's 3 prompt blocks
    seen: set[tuple[int, int]] = set()
    deadline = time.monotonic() + 20
    # /health follows the nodes' Status every 50 ms. Right after the fork the last prompt block is
    # shared too, until the copy into each choice's own block has run (DecodeBatch.hold_no_sync): poll
    # for the steady state
    while want not in seen and time.monotonic() < deadline:
        nodes = httpx2.get(f"{service.base}/health").json()["nodes"]
        seen |= {(n["used_kv_blocks"], n["shared_kv_blocks"]) for n in nodes
                 if n["kind"] in ("decode", "colocated") and n["shared_kv_blocks"]}
    assert want in seen, seen
    assert sum(1 for _ in stream) > 0
    assert service.blocks_back()


def test_prompt_logprobs_and_echo_come_from_the_prefill(service, engine):
    ref = engine.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True, prompt_logprobs=3, logprobs=2))[0]
    tok = engine.tokenizer
    got = service.client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                            echo=True, extra_body={"ignore_eos": True, "prompt_logprobs": 3})
    choice = got.choices[0]
    assert choice.text == tok.decode(PROMPT) + tok.decode(ref.output_ids)
    lps = choice.logprobs
    assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.token_logprobs[1:] == pytest.approx([e.logprob for e in ref.prompt_logprobs + ref.logprobs], abs=1e-4)
    assert len(lps.top_logprobs) == len(PROMPT) + 4  # top-2 each, keyed by text (tokens of one text merge)
    assert all(1 <= len(t) <= 2 for t in lps.top_logprobs[1:])
    assert len(lps.tokens) == len(PROMPT) + 4 and lps.text_offset == sorted(lps.text_offset)
    plp = choice.model_extra["prompt_logprobs"]  # vLLM's form
    assert plp[0] is None and len(plp) == len(PROMPT)
    for entry, want in zip(plp[1:], ref.prompt_logprobs, strict=True):
        mine = entry[str(want.token_id)]
        assert mine["rank"] == want.rank and mine["logprob"] == pytest.approx(want.logprob, abs=1e-4)
        assert len(entry) <= 4 and all(str(i) in entry for i, _ in want.top)
    stream = service.client.completions.create(model="tiny", prompt="ab", max_tokens=3, temperature=0, echo=True,
                                               stream=True, n=2)
    texts = ["", ""]
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(t.startswith("ab") and len(t) > 2 for t in texts)
    chat = service.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "ab"}],
                                                  max_tokens=2, extra_body={"prompt_logprobs": 0})
    assert [e and list(e) for e in chat.model_extra["prompt_logprobs"]] == [None, ["97"], ["98"]]
    assert service.blocks_back()


@pytest.mark.parametrize("extra", [{"min_p": 0.1}, {"min_tokens": 3}, {"use_beam_search": True},
                                   {"functions": [{"name": "f"}]},
                                   {"include_stop_str_in_output": True}])
def test_unsupported_fields_are_named_and_neutral_values_pass(service, extra):
    with pytest.raises(openai.BadRequestError) as e:
        service.client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "a"}],
                                               max_tokens=2, extra_body=extra)
    assert next(iter(extra)) in e.value.body["message"]  # type: ignore[index]
    neutral = {"min_p": 0, "min_tokens": 0, "use_beam_search": False, "tools": [], "skip_special_tokens": True,
               "user": "u", "store": False}
    assert service.client.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body=neutral).choices
