"""A dummy model (random weights of a named shape, scaled down for the CPU) through the whole
service (real HTTP, the official `openai` client, PD with MTP k=2 and colocated): text in through
the stand-in tokenizer and text out, token-id prompts, every answer running to max_tokens."""

from __future__ import annotations

import pytest
import torch

from engine.model.dummy import DummyTokenizer, dummy_config
from engine.model.loader import ModelInfo, dummy_model
from tests.router.real_service import RealService

SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


@pytest.fixture(scope="module", params=["pd", "colocated"])
def service(request):
    config = dummy_config("llama-3.1-8b", **SMALL)
    info = ModelInfo("llama-3.1-8b", config, DummyTokenizer(config.vocab_size), ())
    s = RealService(request.param, max_model_len=256, model=(dummy_model(info, "cpu", torch.float32), info))
    yield s
    s.close()


def test_text_and_token_prompts_run_to_max_tokens(service):
    for prompt in ("Why is the sky blue?", [5, 128_000, 17, 99]):
        got = service.client.completions.create(model="llama-3.1-8b", prompt=prompt, max_tokens=11, temperature=0)
        assert (got.choices[0].finish_reason, got.usage.completion_tokens) == ("length", 11)
        assert got.choices[0].text  # meaningless text, one printable character or byte per token
    chat = service.client.chat.completions.create(
        model="llama-3.1-8b", messages=[{"role": "user", "content": "hi"}], max_tokens=7, temperature=0.8, seed=3)
    assert (chat.choices[0].finish_reason, chat.usage.completion_tokens) == ("length", 7)
    assert service.blocks_back()
