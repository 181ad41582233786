"""The built-in `tiny` model: a seeded random Llama with an MTP layer, and a byte tokenizer.

For fast tests and for trying the CLI without weights. Weights are drawn with fan-in scaling
so logits are spread (greedy has clear winners), not the near-uniform logits of a 0.02 init.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engine.model.config import ArchConfig

if TYPE_CHECKING:  # torch is imported where weights are made: a router reads tiny's config without it
    import torch

TINY_SEED = 1234
BYTE_VOCAB = 256
BOS_ID, EOS_ID = 256, 257


def tiny_config() -> ArchConfig:
    return ArchConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_theta=10000.0,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        model_type="llama",
        bos_token_id=BOS_ID,
        eos_token_ids=(EOS_ID,),
        num_mtp_layers=1,
    )


def random_tensors(model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights for every parameter of `model`, by name (HF + `mtp.*` names)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return {name: scale_random_(name, torch.randn(p.shape, generator=g))
            for name, p in model.named_parameters(remove_duplicate=False)}


def scale_random_(name: str, t: torch.Tensor) -> torch.Tensor:
    """Standard-normal draws `t` of parameter `name`, scaled in place for a sane forward: norms
    near 1, biases small, the embedding as drawn, weights by 1/sqrt(fan-in)."""
    if name.endswith("norm.weight"):
        return t.mul_(0.1).add_(1.0)
    if name.endswith("bias"):
        return t.mul_(0.1)
    if name.endswith("embed_tokens.weight"):
        return t
    return t.div_(t.shape[-1] ** 0.5)


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, BOS 256, EOS 257. No chat template."""

    bos_token_id = BOS_ID
    eos_token_ids = (EOS_ID,)
    has_chat_template = False
    vocab_size = tiny_config().vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [BOS_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i < BYTE_VOCAB).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        raise ValueError("the tiny model has no chat template")
