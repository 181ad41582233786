"""Dummy weights for real shapes (vLLM's `--load-format dummy`): named Hugging Face configs
written here, random weights drawn in place, and a stand-in tokenizer.

For measuring what a real model's size costs (an 8B model's step, KV and transfer) on machines
that have no weights and no network. Receives a shape name; hands on its `ArchConfig` and, to
engine/model/loader.py (which builds the module), the in-place fill. The weights mean nothing: a
dummy model has no EOS id, so every request runs to `max_tokens` (as with `ignore_eos`).

The fill draws every parameter on the device it lives on, in its dtype, from one seeded
generator (reproducible; an 8B model is ~300 launches, never a host copy), scaled as tiny's
weights are (engine/model/tiny.py `scale_random_`) so that logits are spread and greedy has winners.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.model.config import ArchConfig
from engine.model.tiny import scale_random_

if TYPE_CHECKING:  # torch is imported where weights are drawn: a router reads the shapes without it
    import torch

DUMMY_SEED = 0
_BYTES = 256
_PRINTABLE = 95  # ASCII ' '..'~'


def _llama3_rope(factor: float) -> dict[str, Any]:
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


# The fields of each model's config.json that pdserve reads (engine/model/config.py `from_hf_dict`).
DUMMY_SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": dict(model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
                         num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                         rope_theta=500000.0, rope_scaling=_llama3_rope(32.0), max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
    "llama-3.1-8b": dict(model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                         num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                         rope_theta=500000.0, rope_scaling=_llama3_rope(8.0), max_position_embeddings=131072,
                         rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Qwen2.5-7B-Instruct: biases on q, k and v (ArchConfig.attention_bias, implied by qwen2)
    "qwen2.5-7b": dict(model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
                       rope_theta=1000000.0, rope_scaling=None, max_position_embeddings=32768,
                       rms_norm_eps=1e-6, tie_word_embeddings=False),
    "smollm2-135m": dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                         num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         rope_theta=100000.0, rope_scaling=None, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def dummy_names() -> str:
    return ", ".join(sorted(DUMMY_SHAPES))


def dummy_config(name: str, **overrides: Any) -> ArchConfig:
    """The `ArchConfig` of shape `name`, with HF-style `overrides` (tests shrink the layer count);
    no EOS id. ValueError listing the shapes for an unknown name."""
    try:
        shape = DUMMY_SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown dummy shape {name!r}; known: {dummy_names()}") from None
    return ArchConfig.from_hf_dict({**shape, **overrides})


def fill_random_(model: torch.nn.Module, seed: int = DUMMY_SEED) -> None:
    """Every parameter drawn in place on its device and in its dtype from one generator seeded
    with `seed`, then scaled by engine/model/tiny.py `scale_random_`. A tied weight is drawn once."""
    import torch

    g = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale_random_(name, p.normal_(generator=g))


class DummyTokenizer:
    """Stand-in text for a dummy model: text in as its UTF-8 bytes (ids 0..255), ids out as those
    bytes below 256 and as one printable ASCII character each above (id mod 95), so every output
    token shows. No special tokens, no chat template (a single user message is sent plain)."""

    bos_token_id = None
    eos_token_ids: tuple[int, ...] = ()
    has_chat_template = False

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raw = bytes(i if i < _BYTES else ord(" ") + i % _PRINTABLE for i in ids)
        return raw.decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise ValueError("a dummy model has no chat template")
