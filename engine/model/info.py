"""What a router needs of a model: its name, config, tokenizer and EOS ids, from the same
`--model` and `--load-format` values engine/model/loader.py takes, without reading a weight.

Imports no tensor library: a router process (deploy/router_actor.py) starts without torch. GGUF
metadata comes from engine/model/gguf_meta.py, paths from engine/model/paths.py, a dummy shape's
config from engine/model/dummy.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from engine.model import gguf_meta
from engine.model.config import ArchConfig
from engine.model.dummy import DUMMY_SHAPES, DummyTokenizer, dummy_config, dummy_names
from engine.model.paths import resolve_model
from engine.model.tiny import ByteTokenizer, tiny_config
from engine.model.tokenizer import Tokenizer

LOAD_FORMATS = ("auto", "dummy")  # vLLM's names: weights from the checkpoint, or random ones


@dataclass
class ModelInfo:
    """What a router needs of a model: its config and tokenizer, no weights."""

    name: str
    config: ArchConfig
    tokenizer: Any
    eos_token_ids: tuple[int, ...]


def load_model_info(name: str, load_format: str = "auto") -> ModelInfo:
    if check_load_format(load_format) == "dummy":
        return dummy_info(name)
    path = resolve_model(name)
    if path == "tiny":
        cfg = tiny_config()
        return ModelInfo("tiny", cfg, ByteTokenizer(), cfg.eos_token_ids)
    p = Path(path)
    if p.suffix == ".gguf":
        reader = gguf_meta.open_gguf(path)
        tok = Tokenizer.from_gguf_metadata(reader)
        return ModelInfo(served_name(name), gguf_meta.arch_config_from_gguf(reader), tok, tuple(tok.eos_token_ids))
    cfg = ArchConfig.from_json_file(p / "config.json")
    hf_tok = Tokenizer.from_hf_dir(p) if (p / "tokenizer.json").is_file() else None
    eos = tuple(hf_tok.eos_token_ids) if hf_tok is not None else cfg.eos_token_ids
    return ModelInfo(served_name(name), cfg, hf_tok, eos)


def dummy_info(name: str) -> ModelInfo:
    """A dummy model's config and tokenizer: a named shape's (engine/model/dummy.py) with the stand-in
    tokenizer, else the real model's (no weights read). No EOS id: requests run to max_tokens."""
    if name in DUMMY_SHAPES:
        config = dummy_config(name)
        return ModelInfo(name, config, DummyTokenizer(config.vocab_size), ())
    try:
        info = load_model_info(name)
    except ValueError as e:
        raise ValueError(f"{e}; with load format 'dummy', or a named shape: {dummy_names()}") from None
    tokenizer = info.tokenizer if info.tokenizer is not None else DummyTokenizer(info.config.vocab_size)
    return ModelInfo(info.name, replace(info.config, eos_token_ids=()), tokenizer, ())


def served_name(name: str) -> str:
    """The name clients use for a model: the alias itself, or the file/dir name of a path."""
    return name if name in ("smollm2", "tiny", *DUMMY_SHAPES) else Path(name).name.removesuffix(".gguf")


def check_load_format(load_format: str) -> str:
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; known: {', '.join(LOAD_FORMATS)}")
    return load_format
