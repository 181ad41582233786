"""Model architecture config: the fields of a Llama-family `config.json` that pdserve uses.

Covers Llama 3.x (incl. llama3 rope scaling), SmolLM2, Qwen2 (qkv bias) and Qwen3 (q/k norm).
Frozen; derived values are properties. Unknown model types are rejected with a clear error.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ArchConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # HF's `rope_scaling` dict (llama3: factor, low_freq_factor, high_freq_factor,
    # original_max_position_embeddings); None for plain RoPE.
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # MTP layers stored after the target's layers (DeepSeek-V3 form); 0 when none ship.
    num_mtp_layers: int = 0
    # Shape of a pdserve-trained MTP head, read from its file: the block's MLP width (0: the
    # target's) and the target layers whose outputs it reads besides the final hidden state.
    mtp_intermediate_size: int = 0
    mtp_feature_layers: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def mtp_mlp_size(self) -> int:
        return self.mtp_intermediate_size or self.intermediate_size

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> ArchConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"unsupported model_type {model_type!r}; pdserve serves {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        heads = int(d["num_attention_heads"])
        hidden = int(d["hidden_size"])
        rope_theta, rope_scaling = _rope_fields(d)
        eos = d.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or hidden // heads),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            model_type=model_type,
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_mtp_layers=int(d.get("num_nextn_predict_layers", 0)),
        )

    def to_hf_dict(self) -> dict[str, Any]:
        d = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("extra", "eos_token_ids", "qk_norm", "num_mtp_layers", "mtp_intermediate_size",
                              "mtp_feature_layers")
        }
        d["eos_token_id"] = list(self.eos_token_ids)
        d["num_nextn_predict_layers"] = self.num_mtp_layers
        return d

    @classmethod
    def from_json_file(cls, path: str | Path) -> ArchConfig:
        return cls.from_hf_dict(json.loads(Path(path).read_text()))


def _rope_fields(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, rope_scaling) from either the classic keys or transformers 5's `rope_parameters`."""
    params = d.get("rope_parameters")
    if isinstance(params, dict):
        theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        return theta, (None if kind == "default" else dict(params))
    return float(d.get("rope_theta", 10000.0)), d.get("rope_scaling")
