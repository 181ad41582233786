"""Build a ready model from a `--model` value: 'tiny', 'smollm2', a HF directory or a .gguf file;
with `load_format="dummy"` (vLLM's `--load-format dummy`), one of engine/model/dummy.py's named shapes
or any of those, with random weights.

Hands on a `LoadedModel` (module on its device and dtype, tokenizer, EOS ids). Models that ship
no MTP weights get the head shipped in engine/model/mtp_heads/{name}.safetensors when there is one
(`pdserve train-mtp` makes them; SmolLM2 has one), else the given MTP safetensors file, else a
seeded, untrained MTP module (drafts are then poor but harmless). A vocabulary ranking beside
the head file, or else beside the shipped head ({stem}.vocab_rank.safetensors, `pdserve
draft-vocab` makes it), is found too: `EngineConfig.draft_vocab_size` drafts over its first N
tokens (engine/spec_decode/draft_vocab.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from engine.model.config import ArchConfig
from engine.model.dummy import (
    DUMMY_SEED,
    fill_random_,
)
from engine.model.info import (
    ModelInfo,
    check_load_format,
    load_model_info,
    served_name,
)
from engine.model.llama import CausalLM, RotaryEmbedding, load_weights, split_mtp_tensors
from engine.model.tiny import TINY_SEED, ByteTokenizer, random_tensors, tiny_config

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
MTP_INIT_SEED = 4321
FEATURE_LAYERS_KEY = "pdserve.mtp_feature_layers"  # safetensors metadata of a head that reads them
POSITION_SLACK = 64  # rotary cache room past max positions for the MTP chain


@dataclass
class LoadedModel:
    name: str
    model: CausalLM
    tokenizer: Any  # engine.tokenizer.Tokenizer or tiny's ByteTokenizer
    eos_token_ids: tuple[int, ...]
    mtp_trained: bool
    vocab_rank_path: str | None = None  # the ranking beside the MTP head file, if any


def resolve_dtype(dtype: str | None, device: str) -> torch.dtype:
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPES)}") from None


def build_model(config: ArchConfig, with_mtp: bool = True, device: str = "cpu") -> CausalLM:
    """An fp32 model with uninitialized weights on `device`; `load_weights` fills every parameter."""
    positions = config.max_position_embeddings + POSITION_SLACK
    with torch.device(device), _no_init():
        model = CausalLM(config, positions, with_mtp)
    if torch.device(device).type != "cpu":
        _host_rotary(model, positions, device)
    return model


def empty_model(config: ArchConfig, device: str, dtype: torch.dtype) -> CausalLM:
    """What `_materialize(build_model(config), device, dtype)` gives (weights uninitialized, in
    `dtype` on `device`, fp32 rotary tables, eval mode), built there directly: no fp32 copy of
    the weights is made, and `load_weights` then copies within the device."""
    positions = config.max_position_embeddings + POSITION_SLACK
    with torch.device(device), _no_init(), _default_dtype(dtype):
        model = CausalLM(config, positions, with_mtp=True)
    _host_rotary(model, positions, device)
    return model.eval().requires_grad_(False)


def _host_rotary(model: CausalLM, positions: int, device: str) -> None:
    """The rotary tables computed on the host in fp32, as every load path computes them (a GPU's
    cos/sin may differ in the last bit), then moved to `device`."""
    host = RotaryEmbedding(model.config, positions)
    model.rotary.cos, model.rotary.sin = host.cos.to(device), host.sin.to(device)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


class _no_init:
    """Skip nn.Linear/nn.Embedding random init: every weight is overwritten by a checkpoint."""

    def __enter__(self) -> None:
        self.saved = (torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters)
        torch.nn.Linear.reset_parameters = lambda self: None  # type: ignore[method-assign]
        torch.nn.Embedding.reset_parameters = lambda self: None  # type: ignore[method-assign]

    def __exit__(self, *exc: object) -> None:
        torch.nn.Linear.reset_parameters, torch.nn.Embedding.reset_parameters = self.saved  # type: ignore[method-assign]


def _materialize(model: CausalLM, device: str, dtype: torch.dtype) -> CausalLM:
    rot_cos, rot_sin = model.rotary.cos, model.rotary.sin
    model = model.to(device=device, dtype=dtype)
    model.rotary.cos, model.rotary.sin = rot_cos.to(device), rot_sin.to(device)  # stay fp32
    return model.eval().requires_grad_(False)


def load_model(name: str, device: str = "cpu", dtype: str | None = None, mtp_path: str | None = None,
               load_format: str = "auto") -> LoadedModel:
    from engine.model.paths import resolve_model
    from engine.model.weights import load_checkpoint

    torch_dtype = resolve_dtype(dtype, device)
    if check_load_format(load_format) == "dummy":
        return load_dummy(name, device, torch_dtype, mtp_path)
    path = resolve_model(name)
    if path == "tiny":
        config = tiny_config()
        model = build_model(config)
        target, mtp = random_weights(model, TINY_SEED)
        if mtp_path is not None:
            mtp, config = read_head(mtp_path, config)
            model = build_model(config)
        load_weights(model, target, mtp)
        return LoadedModel("tiny", _materialize(model, device, torch_dtype), ByteTokenizer(), config.eos_token_ids,
                           mtp_path is not None, vocab_rank_path("tiny", mtp_path))
    ckpt = load_checkpoint(path, device, torch_dtype)
    config = ckpt.config
    target, mtp = split_mtp_tensors(ckpt.tensors, config.num_hidden_layers)
    if mtp_path is None and not mtp:
        mtp_path = mtp_path_default(served_name(name))  # a head shipped in engine/model/mtp_heads/
    if mtp_path is not None:
        mtp, config = read_head(mtp_path, config)
    else:
        config = head_config(config, mtp, ())  # the checkpoint's own MTP layer, if any
    model = empty_model(config, device, torch_dtype)
    trained = bool(mtp)
    if not mtp:
        assert model.mtp is not None
        mtp = _deepseek_names(random_tensors(model.mtp, MTP_INIT_SEED))
    load_weights(model, target, mtp)  # fp32 host MTP tensors round as `_materialize` would round them
    eos = ckpt.tokenizer.eos_token_ids if ckpt.tokenizer is not None else config.eos_token_ids
    return LoadedModel(served_name(name), model, ckpt.tokenizer, tuple(eos), trained,
                       vocab_rank_path(served_name(name), mtp_path))


def load_dummy(name: str, device: str, dtype: torch.dtype, mtp_path: str | None = None,
               seed: int = DUMMY_SEED) -> LoadedModel:
    """`name`'s shape (load_model_info's, as dummy) with seeded random weights drawn on `device` in
    `dtype`, the MTP head's too (untrained: for cost-only runs with k > 0)."""
    if mtp_path is not None:
        raise ValueError("a dummy model's MTP head is random: give no MTP file with load format 'dummy'")
    return dummy_model(load_model_info(name, "dummy"), device, dtype, seed)


def dummy_model(info: ModelInfo, device: str, dtype: torch.dtype, seed: int = DUMMY_SEED) -> LoadedModel:
    """A model of `info`'s config built on `device` in `dtype` and filled in place with random weights."""
    model = empty_model(info.config, device, dtype)
    fill_random_(model, seed)
    return LoadedModel(info.name, model, info.tokenizer, info.eos_token_ids, False, vocab_rank_path(info.name, None))


def random_weights(model: CausalLM, seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Seeded random target weights (HF names) and MTP weights (DeepSeek form): tiny, benches."""
    target = {k: v for k, v in random_tensors(model, seed).items() if not k.startswith("mtp.")}
    mtp = _deepseek_names(random_tensors(model.mtp, seed + 1)) if model.mtp is not None else {}
    return target, mtp


def _deepseek_names(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our `mtp.*` module names (relative to the module) -> DeepSeek form (block parts unprefixed)."""
    return {(k[len("block.") :] if k.startswith("block.") else k): v for k, v in tensors.items()}


def read_mtp_file(path: str, num_layers: int) -> dict[str, torch.Tensor]:
    """A standalone MTP safetensors file, keys bare or under `model.layers.{num_layers}.`."""
    tensors = load_file(path)
    _, prefixed = split_mtp_tensors(tensors, num_layers)
    return prefixed or tensors


def read_head(path: str, config: ArchConfig) -> tuple[dict[str, torch.Tensor], ArchConfig]:
    """A standalone MTP head file's tensors, and `config` with the head's shape."""
    mtp = read_mtp_file(path, config.num_hidden_layers)
    return mtp, head_config(config, mtp, read_feature_layers(path))


def read_feature_layers(path: str) -> tuple[int, ...]:
    """The target layers a head file says it reads (its metadata), () for DeepSeek-form heads."""
    with safe_open(path, framework="pt") as f:
        text = (f.metadata() or {}).get(FEATURE_LAYERS_KEY, "")
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{path}: bad {FEATURE_LAYERS_KEY} {text!r}") from None


def check_feature_layers(layers: tuple[int, ...], num_layers: int) -> None:
    """Feature layers are distinct, ascending, and before the last (whose output is given)."""
    if list(layers) != sorted(set(layers)) or any(not 0 <= i < num_layers - 1 for i in layers):
        raise ValueError(f"MTP feature layers {layers} must be distinct, ascending and in 0..{num_layers - 2}")


def head_config(config: ArchConfig, mtp: dict[str, torch.Tensor], feature_layers: tuple[int, ...]) -> ArchConfig:
    """`config` with the shape of the MTP head `mtp` (DeepSeek form): its MLP width and the
    target layers it reads; checked against the tensors."""
    if not mtp:
        return config
    gate = mtp.get("mlp.gate_proj.weight")
    width = int(gate.shape[0]) if gate is not None else config.intermediate_size
    check_feature_layers(feature_layers, config.num_hidden_layers)
    norms = sum(1 for k in mtp if k.startswith("fnorms."))
    if norms != len(feature_layers):
        raise ValueError(f"MTP head has {norms} feature norms but names {len(feature_layers)} feature layers")
    return replace(config, mtp_intermediate_size=0 if width == config.intermediate_size else width,
                   mtp_feature_layers=tuple(feature_layers))


RANK_SUFFIX = ".vocab_rank.safetensors"  # beside a head: {stem}.safetensors -> {stem}.vocab_rank.safetensors


def vocab_rank_path(name: str, head_path: str | None) -> str | None:
    """The vocabulary ranking beside the MTP head file, else beside the head shipped for `name`
    (a ranking belongs to the target and its tokenizer, not to one head)."""
    return ranking_path_beside(head_path) or ranking_path_beside(mtp_path_default(name))


def ranking_path_beside(head_path: str | None) -> str | None:
    """The ranking file beside an MTP head file, if there is one."""
    if head_path is None:
        return None
    p = Path(head_path)
    rank = p.with_name(p.name.removesuffix(".safetensors") + RANK_SUFFIX)
    return str(rank) if rank.is_file() else None


def mtp_path_default(name: str) -> str | None:
    """The shipped MTP head for `name` (engine/model/mtp_heads/{name}.safetensors), if there is one."""
    p = Path(__file__).parent / "mtp_heads" / f"{name}.safetensors"
    return str(p) if p.exists() else None


