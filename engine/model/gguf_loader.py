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
from typing import TypeVar

import numpy as np
import torch

from engine.model.config import ArchConfig
from engine.model.gguf_dequant import dequantize_to_torch
from engine.model.gguf_file import GGUFFile, GGUFTensor
from engine.model.gguf_meta import PERMUTED_ARCHITECTURES, gguf_architecture

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
        if arch in PERMUTED_ARCHITECTURES:
            values = _unpermute_if_qk(name, values, config)
        tensors[name] = values
    return tensors


def _unpermute_if_qk(name: str, values: torch.Tensor, config: ArchConfig) -> torch.Tensor:
    if ".self_attn.q_proj." in name:
        return unpermute_qk(values, config.num_attention_heads)
    if ".self_attn.k_proj." in name:
        return unpermute_qk(values, config.num_key_value_heads)
    return values
