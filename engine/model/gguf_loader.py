"""GGUF file -> ArchConfig + tensors under Hugging Face names.

Receives a GGUF file (llama.cpp's format, any quantization the `gguf` package can
dequantize: Q4_0/Q4_1/Q8_0/K-quants/F16/BF16/F32), parsed by `engine.model.gguf_file`. Hands on
the model's `ArchConfig` (from the file's metadata) and every tensor dequantized (on the
device asked for, where `engine.model.gguf_dequant` can) and cast to the dtype asked for, in HF
layout and HF naming (`model.layers.{i}.self_attn.q_proj.weight`, ...). The tokenizer stored
in the same file is built by `engine.model.tokenizer.Tokenizer.from_gguf_metadata`.

Careful: llama.cpp's converter permutes the rows of q_proj and k_proj for the `llama`
architecture (`permute` in convert_hf_to_gguf.py: it pairs adjacent dims for RoPE,
HF pairs the two halves of each head). `unpermute_qk` undoes it. A wrong inverse loads
without error and generates garbage; the SmolLM2 "Paris" test guards it.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

import numpy as np
import torch

from engine.model.config import ArchConfig
from engine.model.gguf_dequant import dequantize_to_torch
from engine.model.gguf_file import GGUFFile, GGUFTensor

# llama.cpp architecture name -> HF model_type. Mistral GGUFs say "llama".
SUPPORTED_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Only llama.cpp's `llama` converter permutes Q/K rows; qwen2/qwen3 keep HF order.
_PERMUTED_ARCHITECTURES = ("llama",)

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_GLOBAL_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")

_Array = TypeVar("_Array", np.ndarray, torch.Tensor)

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


def hf_tensor_name(gguf_name: str) -> str:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`."""
    if m := _LAYER_RE.match(gguf_name):
        layer, part, kind = m.groups()
        if part in _LAYER_NAMES:
            return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    elif (m := _GLOBAL_RE.match(gguf_name)) and m.group(1) in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}: no Hugging Face name for it")


def unpermute_qk(w: _Array, n_head: int) -> _Array:
    """Undo llama.cpp's Q/K row permutation.

    The converter maps HF rows (head, half, i) to GGUF rows (head, i, half):
    `w.reshape(n_head, 2, rows // n_head // 2, *rest).swapaxes(1, 2)`. The inverse reads
    GGUF rows as (head, i, half) and swaps back. Works for weights and biases.
    """
    rows = w.shape[0]
    half = rows // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)  # type: ignore[return-value]


def dequantize_tensor(tensor: GGUFTensor, device: str | torch.device = "cpu") -> torch.Tensor:
    """One GGUF tensor as float32 on `device`, in numpy (row-major) order."""
    return dequantize_to_torch(tensor.data, tensor.tensor_type, device)


def load_gguf_tensors(reader: GGUFFile, config: ArchConfig, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of the file, dequantized on `device` and cast to `dtype`, HF-named,
    Q/K un-permuted for llama (a permutation: exact in any dtype)."""
    from tqdm import tqdm

    arch = gguf_architecture(reader)
    tensors: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc="loading weights", unit="tensor", leave=False, disable=None):
        name = hf_tensor_name(tensor.name)
        values = dequantize_tensor(tensor, device).to(dtype)
        if arch in _PERMUTED_ARCHITECTURES:
            values = _unpermute_if_qk(name, values, config)
        tensors[name] = values
    return tensors


def _unpermute_if_qk(name: str, values: torch.Tensor, config: ArchConfig) -> torch.Tensor:
    if ".self_attn.q_proj." in name:
        return unpermute_qk(values, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_qk(values, config.num_key_value_heads)
    return values
