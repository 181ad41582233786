"""DeepSeek-style MTP weights: stored at model.layers.{N}.* in a checkpoint or in a standalone
safetensors file, loaded into the MTP module and saved back bit-exactly."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from engine.model.llama import load_weights, mtp_state_dict, split_mtp_tensors
from engine.model.loader import build_model, read_mtp_file
from engine.model.tiny import random_tensors, tiny_config


def fresh_model():
    model = build_model(tiny_config())
    tensors = random_tensors(model, 5)
    target = {k: v for k, v in tensors.items() if not k.startswith("mtp.")}
    return model, target


def deepseek_mtp(num_layers: int, seed: int) -> dict[str, torch.Tensor]:
    """MTP tensors as DeepSeek-V3 checkpoints store them, shared parts included."""
    model = build_model(tiny_config())
    ours = mtp_state_dict(model)
    g = torch.Generator().manual_seed(seed)
    out = {f"model.layers.{num_layers}.{k}": torch.randn(v.shape, generator=g) for k, v in ours.items()}
    cfg = tiny_config()
    out[f"model.layers.{num_layers}.embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    out[f"model.layers.{num_layers}.shared_head.head.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g)
    return out


def test_checkpoint_mtp_weights_round_trip():
    n = tiny_config().num_hidden_layers
    model, target = fresh_model()
    stored = deepseek_mtp(n, seed=1)
    tgt, mtp = split_mtp_tensors({**target, **stored}, n)
    assert set(tgt) == set(target)
    load_weights(model, tgt, mtp)
    saved = mtp_state_dict(model)
    for key, value in saved.items():
        assert torch.equal(value, stored[f"model.layers.{n}.{key}"]), key
    assert "eh_proj.weight" in saved and "self_attn.q_proj.weight" in saved and "shared_head.norm.weight" in saved


@pytest.mark.parametrize("prefixed", [True, False])
def test_standalone_mtp_file_loads_bit_exactly(tmp_path, prefixed):
    n = tiny_config().num_hidden_layers
    model, target = fresh_model()
    stored = deepseek_mtp(n, seed=2)
    if not prefixed:
        stored = {k.split(f"layers.{n}.", 1)[1]: v for k, v in stored.items()}
    path = tmp_path / "mtp.safetensors"
    save_file(stored, str(path))
    load_weights(model, target, read_mtp_file(str(path), n))
    again = tmp_path / "again.safetensors"
    save_file(mtp_state_dict(model), str(again))
    reread = read_mtp_file(str(again), n)
    for key, value in reread.items():
        assert torch.equal(value, stored[(f"model.layers.{n}." if prefixed else "") + key])


def test_unexpected_mtp_weight_is_rejected():
    model, target = fresh_model()
    with pytest.raises(ValueError, match="unexpected MTP weight"):
        load_weights(model, target, {"mystery.weight": torch.zeros(1)})
