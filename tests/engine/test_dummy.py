"""Dummy weights for real shapes (`load_format="dummy"`): each named shape builds its Hugging Face
parameter shapes (on the meta device: nothing is allocated), random weights are reproducible
from the seed, generation runs to max_tokens from token ids and from text, and names are checked."""

from __future__ import annotations

import pytest
import torch

from engine.engine import EngineConfig, LLMEngine
from engine.model.dummy import DUMMY_SHAPES, DummyTokenizer, dummy_config
from engine.model.llama import CausalLM
from engine.model.loader import ModelInfo, dummy_model, load_model, load_model_info
from engine.sampling.sampling_params import SamplingParams

# The parameter counts the model cards give (target only, tied embeddings counted once)
PARAMETERS = {"llama-3.2-1b": 1_235_814_400, "llama-3.1-8b": 8_030_261_248, "qwen2.5-7b": 7_615_616_512,
              "smollm2-135m": 134_515_008}
# A named shape scaled down for the CPU: its vocabulary, biases, tying and rope kept
SMALL = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=512)


def _meta_model(name: str) -> CausalLM:
    with torch.device("meta"):
        return CausalLM(dummy_config(name), 16, with_mtp=False)


@pytest.mark.parametrize("name", sorted(DUMMY_SHAPES))
def test_each_named_shape_builds_its_hf_parameters(name):
    model, c = _meta_model(name), DUMMY_SHAPES[name]
    assert sum(p.numel() for p in model.parameters()) == PARAMETERS[name]
    shapes = {k: tuple(p.shape) for k, p in model.named_parameters(remove_duplicate=False)}
    h, d = c["hidden_size"], c["head_dim"]
    assert shapes["model.embed_tokens.weight"] == (c["vocab_size"], h)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (c["num_attention_heads"] * d, h)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (c["num_key_value_heads"] * d, h)
    assert shapes["model.layers.0.mlp.gate_proj.weight"] == (c["intermediate_size"], h)
    assert sum(k.endswith("input_layernorm.weight") for k in shapes) == c["num_hidden_layers"]
    qwen = c["model_type"] == "qwen2"
    assert ("model.layers.0.self_attn.q_proj.bias" in shapes) == qwen
    assert ("model.layers.0.self_attn.o_proj.bias" in shapes) is False
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == c["tie_word_embeddings"]


def test_llama3_shapes_scale_rope_and_have_no_eos():
    for name in ("llama-3.2-1b", "llama-3.1-8b"):
        config = dummy_config(name)
        assert config.rope_scaling is not None and config.rope_scaling["rope_type"] == "llama3"
        assert config.eos_token_ids == ()
    assert dummy_config("qwen2.5-7b").attention_bias and dummy_config("qwen2.5-7b").rope_scaling is None


def _small(name: str, seed: int = 0):
    config = dummy_config(name, **SMALL)
    return dummy_model(ModelInfo(name, config, DummyTokenizer(config.vocab_size), ()), "cpu", torch.float32, seed)


def test_random_weights_are_reproducible_from_the_seed_and_in_the_model_dtype():
    a, b, c = _small("qwen2.5-7b"), _small("qwen2.5-7b"), _small("qwen2.5-7b", seed=1)
    for (name, pa), pb, pc in zip(a.model.named_parameters(), b.model.parameters(), c.model.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
        assert torch.isfinite(pa).all() and pa.dtype == torch.float32, name
    half = dummy_model(load_model_info("tiny", "dummy"), "cpu", torch.bfloat16)
    assert {p.dtype for p in half.model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("name,k", [("llama-3.1-8b", 0), ("qwen2.5-7b", 2)])
def test_dummy_generation_runs_to_max_tokens_from_ids_and_text(name, k):
    loaded = _small(name)
    engine = LLMEngine(loaded, EngineConfig(max_model_len=128, num_speculative_tokens=k))
    prompts = [[5, 150_000 % loaded.model.config.vocab_size, 7], loaded.tokenizer.encode("héllo, world")]
    done = engine.generate(prompts, SamplingParams(max_tokens=9))
    assert [(len(r.output_ids), r.finish_reason) for r in done] == [(9, "length"), (9, "length")]
    text = loaded.tokenizer.decode(done[1].output_ids)
    assert isinstance(text, str) and text  # meaningless, but text


def test_the_stand_in_tokenizer_reads_bytes_and_shows_every_token():
    tok = DummyTokenizer(128256)
    assert tok.encode("hé") == [104, 195, 169]
    assert tok.decode(tok.encode("héllo")) == "héllo"
    assert tok.decode([128255, 300, 1000]) == "".join(chr(32 + i % 95) for i in (128255, 300, 1000))


def test_a_real_model_as_dummy_keeps_its_config_and_tokenizer_but_not_its_eos():
    real, dummy = load_model_info("tiny"), load_model_info("tiny", "dummy")
    assert dummy.config.vocab_size == real.config.vocab_size and dummy.tokenizer is not None
    assert real.eos_token_ids and dummy.eos_token_ids == () and dummy.config.eos_token_ids == ()
    loaded = load_model("tiny", load_format="dummy")
    assert loaded.eos_token_ids == () and not loaded.mtp_trained


def test_names_and_formats_are_clear_errors():
    names = ", ".join(sorted(DUMMY_SHAPES))
    with pytest.raises(ValueError, match=f"unknown model 'llama-9b'.*named shape: {names}"):
        load_model_info("llama-9b", "dummy")
    with pytest.raises(ValueError, match=f"unknown dummy shape 'llama-9b'; known: {names}"):
        dummy_config("llama-9b")
    with pytest.raises(ValueError, match="'llama-3.1-8b' is a named shape without weights: .*--load-format dummy"):
        load_model("llama-3.1-8b")
    with pytest.raises(ValueError, match="unknown load format 'random'; known: auto, dummy"):
        load_model_info("tiny", "random")
    with pytest.raises(ValueError, match="MTP head is random"):
        load_model("tiny", load_format="dummy", mtp_path="head.safetensors")
