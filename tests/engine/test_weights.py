"""Checkpoint loading and saving: safetensors (single, sharded), GGUF (tiny written here,
and the real SmolLM2 Q4_1 file), name resolution and the errors a user can hit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from engine.model import gguf_loader
from engine.model.config import ArchConfig
from engine.model.paths import INDEX_FILE, SINGLE_FILE, resolve_model
from engine.model.tokenizer import CONTROL_TOKEN, PreTokenizerSpec, byte_level_bpe
from engine.model.weights import (
    Checkpoint,
    expected_shapes,
    load_checkpoint,
    save_checkpoint,
)

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)


def tiny_config(**overrides: object) -> ArchConfig:
    base = ArchConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position_embeddings=256,
        bos_token_id=1,
        eos_token_ids=(2, 3),
    )
    return dataclasses.replace(base, **overrides)  # type: ignore[arg-type]


def random_tensors(
    config: ArchConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=gen).to(dtype) for n, s in expected_shapes(config).items()}


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == torch.float32, name
        torch.testing.assert_close(got[name], t.float(), rtol=0, atol=0, msg=name)


# -- safetensors ----------------------------------------------------------------------


def test_sharded_round_trip_keeps_tensors_and_config(tmp_path: Path) -> None:
    config = tiny_config()
    tensors = random_tensors(config)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    save_checkpoint(tmp_path, config, tensors, max_shard_bytes=total // 4)

    index = json.loads((tmp_path / INDEX_FILE).read_text())
    shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(shards) >= 3
    assert sorted(set(index["weight_map"].values())) == shards
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == total
    assert not (tmp_path / SINGLE_FILE).exists()

    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config == config
    assert ckpt.tokenizer is None
    assert_same_tensors(ckpt.tensors, tensors)


def test_single_file_qwen2_bf16_loads_as_float32(tmp_path: Path) -> None:
    config = tiny_config(model_type="qwen2", attention_bias=True)
    tensors = random_tensors(config, torch.bfloat16)
    assert "model.layers.1.self_attn.k_proj.bias" in tensors
    save_checkpoint(tmp_path, config, tensors)
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [SINGLE_FILE]
    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.config == config
    assert_same_tensors(ckpt.tensors, tensors)


def test_qwen3_qk_norm_tensors_round_trip(tmp_path: Path) -> None:
    config = tiny_config(model_type="qwen3", qk_norm=True)
    tensors = random_tensors(config)
    assert tensors["model.layers.0.self_attn.q_norm.weight"].shape == (config.head_dim,)
    save_checkpoint(tmp_path, config, tensors)
    assert load_checkpoint(str(tmp_path)).config.qk_norm


def test_tied_checkpoint_drops_lm_head(tmp_path: Path) -> None:
    config = tiny_config(tie_word_embeddings=True)
    tensors = random_tensors(config)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_checkpoint(tmp_path, config, tensors)
    assert "lm_head.weight" not in load_checkpoint(str(tmp_path)).tensors


def test_missing_and_misshapen_tensors_are_named(tmp_path: Path) -> None:
    config = tiny_config()
    tensors = random_tensors(config)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.norm.weight"] = torch.ones(7)
    save_checkpoint(tmp_path, config, tensors)
    with pytest.raises(ValueError, match=r"missing: model\.layers\.1\.mlp\.up_proj\.weight") as err:
        load_checkpoint(str(tmp_path))
    assert "model.norm.weight: (7,) (expected (32,))" in str(err.value)


def test_save_refuses_a_directory_with_weights(tmp_path: Path) -> None:
    config = tiny_config()
    save_checkpoint(tmp_path, config, random_tensors(config))
    with pytest.raises(FileExistsError, match="already holds safetensors"):
        save_checkpoint(tmp_path, config, random_tensors(config))


def test_hf_dir_with_tokenizer_files_merges_eos_ids(tmp_path: Path) -> None:
    config = tiny_config(vocab_size=len(tiny_vocab()))
    save_checkpoint(tmp_path, config, random_tensors(config))
    tiny_backend().save(str(tmp_path / "tokenizer.json"))
    tokenizer_config = {
        "bos_token": "<|im_start|>",
        "eos_token": {"content": "<|im_end|>"},
        "chat_template": TEMPLATE,
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))

    ckpt = load_checkpoint(str(tmp_path))
    assert ckpt.tokenizer is not None
    assert ckpt.config.eos_token_ids == (2, 3, 0)
    assert ckpt.tokenizer.eos_token_ids == (2, 3, 0)
    assert ckpt.tokenizer.bos_token_id == 1
    assert ckpt.tokenizer.encode("hello") == [
        ckpt.tokenizer.token_to_id("hell"),
        ckpt.tokenizer.token_to_id("o"),
    ]
    assert (
        ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
        == "<|im_start|>user\nhi<|im_end|>\n"
    )


# -- resolving names and bad input ----------------------------------------------------


def test_resolve_model_accepts_tiny_paths_and_smollm2(tmp_path: Path) -> None:
    assert resolve_model("tiny") == "tiny"
    save_checkpoint(tmp_path / "ckpt", tiny_config(), random_tensors(tiny_config()))
    assert resolve_model(str(tmp_path / "ckpt")) == str(tmp_path / "ckpt")
    gguf_file = tmp_path / "m.gguf"
    gguf_file.write_bytes(b"")
    assert resolve_model(str(gguf_file)) == str(gguf_file)


def test_resolve_model_rejects_unknown_names() -> None:
    with pytest.raises(ValueError) as err:
        resolve_model("nope")
    assert str(err.value) == (
        "unknown model 'nope': expected a path to a HF safetensors directory or .gguf file, 'smollm2', or 'tiny'"
    )


def test_directory_without_config_json_is_rejected(tmp_path: Path) -> None:
    (tmp_path / SINGLE_FILE).write_bytes(b"")
    with pytest.raises(ValueError, match="has no config.json"):
        resolve_model(str(tmp_path))
    with pytest.raises(ValueError, match="has no config.json"):
        load_checkpoint(str(tmp_path))


def test_directory_without_weights_is_rejected(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(tiny_config().to_hf_dict()))
    with pytest.raises(ValueError, match="has no model.safetensors"):
        load_checkpoint(str(tmp_path))


# -- GGUF: Q/K permutation and a tiny file written here -------------------------------


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (the transform unpermute_qk undoes)."""
    return (
        w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize(("n_head", "head_dim", "cols"), [(9, 64, 576), (3, 64, 576), (4, 8, 1)])
def test_unpermute_qk_inverts_llama_cpp_permute(n_head: int, head_dim: int, cols: int) -> None:
    w = np.random.default_rng(0).standard_normal((n_head * head_dim, cols)).astype(np.float32)
    permuted = llama_cpp_permute(w, n_head)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(gguf_loader.unpermute_qk(permuted, n_head), w)


def test_unpermute_moves_rope_pairs_to_halves() -> None:
    # One head, head_dim 4: GGUF rows pair (0, 2) and (1, 3) of HF as adjacent rows.
    gguf_rows = np.array([[0.0], [2.0], [1.0], [3.0]])
    assert gguf_loader.unpermute_qk(gguf_rows, 1)[:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_gguf_names_map_to_hf_names() -> None:
    assert (
        gguf_loader.hf_tensor_name("blk.12.attn_q.weight")
        == "model.layers.12.self_attn.q_proj.weight"
    )
    assert gguf_loader.hf_tensor_name("blk.0.attn_k.bias") == "model.layers.0.self_attn.k_proj.bias"
    assert (
        gguf_loader.hf_tensor_name("blk.3.ffn_norm.weight")
        == "model.layers.3.post_attention_layernorm.weight"
    )
    assert (
        gguf_loader.hf_tensor_name("blk.3.attn_k_norm.weight")
        == "model.layers.3.self_attn.k_norm.weight"
    )
    assert gguf_loader.hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_loader.hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.ffn_gate_exps.weight'"):
        gguf_loader.hf_tensor_name("blk.0.ffn_gate_exps.weight")


def tiny_vocab() -> list[str]:
    return SPECIALS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["he", "ll", "hell"]


def tiny_backend() -> HFTokenizer:
    vocab = tiny_vocab()
    types = [CONTROL_TOKEN] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS))
    return byte_level_bpe(vocab, MERGES, types, PreTokenizerSpec(digits=True))


def write_tiny_gguf(path: Path, config: ArchConfig, tensors: dict[str, torch.Tensor]) -> None:
    """What llama.cpp's converter does: llama metadata, GGUF names, Q/K rows permuted."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_theta)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    vocab = tiny_vocab()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(vocab)
    writer.add_token_types([CONTROL_TOKEN] * len(SPECIALS) + [1] * (len(vocab) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(0)
    writer.add_chat_template(TEMPLATE)
    hf_to_gguf = {gguf_loader.hf_tensor_name(g): g for g in gguf_names(config)}
    for name, t in tensors.items():
        writer.add_tensor(hf_to_gguf[name], gguf_layout(name, t.numpy(), config))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def gguf_names(config: ArchConfig) -> list[str]:
    parts = [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
        "attn_norm",
        "ffn_norm",
    ]
    names = ["token_embd.weight", "output_norm.weight", "output.weight"]
    return names + [f"blk.{i}.{p}.weight" for i in range(config.num_hidden_layers) for p in parts]


def gguf_layout(name: str, w: np.ndarray, config: ArchConfig) -> np.ndarray:
    if ".q_proj." in name:
        return llama_cpp_permute(w, config.num_attention_heads)
    if ".k_proj." in name:
        return llama_cpp_permute(w, config.num_key_value_heads)
    return w


def test_tiny_gguf_loads_hf_names_and_unpermuted_qk(tmp_path: Path) -> None:
    config = tiny_config(vocab_size=len(tiny_vocab()), tie_word_embeddings=True)
    tensors = random_tensors(config)
    write_tiny_gguf(tmp_path / "tiny.gguf", config, tensors)

    ckpt = load_checkpoint(resolve_model(str(tmp_path / "tiny.gguf")))
    assert ckpt.name == "tiny"
    # eos: the file's EOS (0) and the template's end of turn <|im_end|> (2)
    assert ckpt.config == dataclasses.replace(config, eos_token_ids=(0, 2))
    assert_same_tensors(ckpt.tensors, tensors)
    assert ckpt.tokenizer is not None
    hell = ckpt.tokenizer.token_to_id("hell")
    assert ckpt.tokenizer.encode("hello 42") == [hell, *ckpt.tokenizer.encode("o 42")]


# -- the real SmolLM2 GGUF ------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_ckpt() -> Checkpoint:
    try:
        path = resolve_model("smollm2")
    except ModuleNotFoundError as e:
        pytest.skip(str(e))
    return load_checkpoint(path)


@pytest.mark.smollm2
def test_smollm2_config(smollm2_ckpt: Checkpoint) -> None:
    c = smollm2_ckpt.config
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert (c.vocab_size, c.tie_word_embeddings, c.model_type) == (49152, True, "llama")
    assert (c.rope_theta, c.rms_norm_eps, c.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert c.bos_token_id == 1
    assert c.eos_token_ids == (2,)  # <|im_end|>: the GGUF's EOS and the template's end of turn


@pytest.mark.smollm2
def test_smollm2_tensors_have_hf_names_and_shapes(smollm2_ckpt: Checkpoint) -> None:
    shapes = expected_shapes(smollm2_ckpt.config)
    assert "lm_head.weight" not in shapes
    assert set(smollm2_ckpt.tensors) == set(shapes)
    for name, t in smollm2_ckpt.tensors.items():
        assert tuple(t.shape) == shapes[name] and t.dtype == torch.float32, name
        assert torch.isfinite(t).all(), name


@pytest.mark.smollm2
def test_smollm2_qk_match_transformers_reverse_permutation(smollm2_ckpt: Checkpoint) -> None:
    """transformers' GGUF loader (integrations) undoes the permutation independently of us:
    feed it the file's layout (our tensor re-permuted) and it must give our tensor back."""
    utils = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    processor = utils.LlamaTensorProcessor(
        config={"num_attention_heads": 9, "num_key_value_heads": 3}
    )
    for gguf_name, n_head in (("blk.7.attn_q.weight", 9), ("blk.7.attn_k.weight", 3)):
        ours = smollm2_ckpt.tensors[gguf_loader.hf_tensor_name(gguf_name)].numpy()
        as_in_file = llama_cpp_permute(ours, n_head)
        np.testing.assert_array_equal(processor.process(as_in_file, gguf_name).weights, ours)


@pytest.mark.smollm2
def test_smollm2_greedy_answer_mentions_paris(smollm2_ckpt: Checkpoint) -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**smollm2_ckpt.config.to_hf_dict())
        )
    result = model.load_state_dict(smollm2_ckpt.tensors, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys
    model.tie_weights()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    tokenizer = smollm2_ckpt.tokenizer
    assert tokenizer is not None
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False)
    answer = tokenizer.decode(out[0, len(ids) :].tolist())
    assert "Paris" in answer, answer
