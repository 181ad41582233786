"""The benchmarks' own dependencies (pyproject.toml's `bench` extra: plots, the OpenAI client,
schema checks, Hugging Face for --hf), imported where a kind needs them, so the runtime install
stays light and a missing one is one clear line naming the extra."""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, extra: str = "bench") -> ModuleType:
    """`module`, imported; a ModuleNotFoundError that names the extra when it is missing (the CLI
    prints it as its one `error:` line)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name is None or not module.startswith(e.name.split(".")[0]):
            raise  # the module is there; something it imports is broken
        raise ModuleNotFoundError(f"{module} is missing: pip install 'pdserve[{extra}]'", name=e.name) from e
