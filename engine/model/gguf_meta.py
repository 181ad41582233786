"""GGUF metadata -> ArchConfig and EOS ids, without reading a tensor or importing torch.

Receives a GGUF file's header, metadata and tensor table (engine/model/gguf_file.py, memory-mapped);
hands on the model's `ArchConfig` and the ids that end generation. A router needs no more of a model
than this and its tokenizer (engine/model/info.py), so this module imports no tensor library:
a router process starts without torch. engine/model/gguf_loader.py reads the tensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.model.config import ArchConfig
from engine.model.gguf_file import GGUFFile

# llama.cpp architecture name -> HF model_type. Mistral GGUFs say "llama".
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Only llama.cpp's `llama` converter permutes Q/K rows; qwen2/qwen3 keep HF order.
PERMUTED_ARCHITECTURES = ("llama",)

# Chat-template markers that end an assistant turn; their ids join the EOS set.
END_OF_TURN_MARKERS = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def open_gguf(path: str) -> GGUFFile:
    """Memory-map a GGUF file (reads the header, metadata and tensor table only)."""
    return GGUFFile(path)


def read_field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """A metadata value as a Python object (str, int, float, list), or `default`."""
    return reader.fields.get(key, default)


def gguf_architecture(reader: GGUFFile) -> str:
    arch = read_field(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; pdserve reads {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return str(arch)


def gguf_eos_token_ids(reader: GGUFFile) -> tuple[int, ...]:
    """The ids that end generation: EOS, EOT/EOM when the file names them, and the
    end-of-turn marker its chat template uses (SmolLM2's `<|im_end|>`)."""
    ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        value = read_field(reader, f"tokenizer.ggml.{key}")
        if value is not None:
            ids.append(int(value))
    template = read_field(reader, "tokenizer.chat_template") or ""
    tokens: list[str] = read_field(reader, "tokenizer.ggml.tokens") or []
    for marker in END_OF_TURN_MARKERS:
        if marker in template and marker in tokens:
            ids.append(tokens.index(marker))
    return tuple(dict.fromkeys(ids))


def arch_config_from_gguf(reader: GGUFFile) -> ArchConfig:
    """Build the ArchConfig from `{arch}.*` and `tokenizer.ggml.*` metadata."""
    arch = gguf_architecture(reader)
    _reject_rope_scaling(reader, arch)
    heads = int(read_field(reader, f"{arch}.attention.head_count"))
    hidden = int(read_field(reader, f"{arch}.embedding_length"))
    tokens = read_field(reader, "tokenizer.ggml.tokens") or []
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    hf: dict[str, Any] = {
        "model_type": SUPPORTED_ARCHITECTURES[arch],
        "vocab_size": int(read_field(reader, f"{arch}.vocab_size", len(tokens))),
        "hidden_size": hidden,
        "intermediate_size": int(read_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(read_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(read_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(read_field(reader, f"{arch}.attention.key_length", hidden // heads)),
        "rms_norm_eps": _f32(read_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(read_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(read_field(reader, f"{arch}.context_length", 2048)),
        "tie_word_embeddings": not has_output,
        "bos_token_id": read_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(gguf_eos_token_ids(reader)),
    }
    if arch == "qwen2":
        hf["attention_bias"] = any(t.name.endswith("attn_q.bias") for t in reader.tensors)
    return ArchConfig.from_hf_dict(hf)


def _f32(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _reject_rope_scaling(reader: GGUFFile, arch: str) -> None:
    scaling = read_field(reader, f"{arch}.rope.scaling.type", "none")
    has_freqs = any(t.name == "rope_freqs.weight" for t in reader.tensors)
    if scaling != "none" or has_freqs:
        raise ValueError(
            "GGUF files with RoPE scaling (rope.scaling.type / rope_freqs, e.g. Llama 3.1) "
            "are not supported yet; load the HF safetensors checkpoint instead"
        )
