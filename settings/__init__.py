"""Every environment variable pdserve reads: one typed setting each, read once, at import.

Per-service configuration (models, ports, node counts) lives in the pydantic configs that
`pdserve up` loads from YAML; what is here are the few tunables outside them: secrets a user
keeps out of files, the decode attention's key splits and graph widths for a GPU other than
the H100 they were tuned on, the KV transport's lanes, and profiling aids. vLLM's `envs.py`
is the model: a name, a type, a default and a one-line description per setting.

This package imports nothing of the project's, so kernels/, engine/ and kvtransfer/ may all
import it. A process reads the variables once, when it first imports this package, and a bad
value is an error then, naming the variable; processes it spawns read their own (inherited)
environment. A test changes a value with `monkeypatch.setattr`, on this package where the
reader looks it up at call time (`settings.STEP_STAMPS`), or on the reader's own copy
(`engine.runner.model_runner.MAX_SPLITS`).

docs/settings.md is generated from `REGISTRY`: `python -m settings > docs/settings.md`
(tests/settings/test_settings.py fails when the two disagree).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Setting(Generic[T]):
    """One environment variable: how to parse it, its default (as written in the environment;
    None: unset), and what it is for."""

    name: str
    type: str  # the type as the docs show it
    default: str | None
    parse: Callable[[str], T]
    doc: str

    def read(self, env: Mapping[str, str]) -> T | None:
        """The value in `env` (its default when unset or empty), parsed; None when both are unset."""
        raw = env.get(self.name) or self.default
        return None if raw is None else self.parse(raw)


REGISTRY: dict[str, Setting[Any]] = {}


def _register(name: str, type_name: str, default: str | None, parse: Callable[[str], T], doc: str) -> Setting[T]:
    setting = Setting(name, type_name, default, parse, doc)
    REGISTRY[name] = setting
    return setting


def _int_at_least(low: int) -> Callable[[str], int]:
    def parse(raw: str) -> int:
        value = int(raw)
        if value < low:
            raise ValueError(f"must be at least {low}, got {value}")
        return value

    return parse


def _bool(raw: str) -> bool:
    if raw not in ("0", "1"):
        raise ValueError(f"must be 0 or 1, got {raw!r}")
    return raw == "1"


def _widths(raw: str) -> tuple[int, ...]:
    """Comma-separated block counts; 0 (or nothing) leaves a width out."""
    return tuple(w for w in (int(v) for v in raw.split(",") if v.strip()) if w > 0)


def parse_allreduce(raw: str) -> str:
    if raw not in ("symm", "nccl"):
        raise ValueError(f"PDSERVE_TP_ALLREDUCE must be 'symm' or 'nccl', got {raw!r}")
    return raw


def _value(setting: Setting[T]) -> T:
    """The setting's value in this process's environment (a setting with a default is never None)."""
    try:
        value = setting.read(os.environ)
    except ValueError as e:
        raise ValueError(f"{setting.name}: {e}") from None
    return value  # type: ignore[return-value]


def _optional(setting: Setting[T]) -> T | None:
    return setting.read(os.environ)


# -- secrets ------------------------------------------------------------------------------------
API_KEY: str | None = _optional(_register(
    "PDSERVE_API_KEY", "str", None, str,
    "The bearer token clients must send, where `--api-key` is not given (unset: no auth)."))
CLUSTER_SECRET: str | None = _optional(_register(
    "PDSERVE_CLUSTER_SECRET", "str", None, str,
    "The router-node control calls' shared secret (unset: `pdserve up` makes a random one)."))

# -- decode attention and graphs ----------------------------------------------------------------
SPLIT_BLOCKS: int = _value(_register(
    "PDSERVE_SPLIT_BLOCKS", "int", "8", _int_at_least(1),
    "Decode attention's KV blocks per key split on long contexts (8 blocks: one 128-key tile)."))
ONE_SPLIT_BLOCKS: int = _value(_register(
    "PDSERVE_ONE_SPLIT_BLOCKS", "int", "16", _int_at_least(0),
    "Contexts of up to this many KV blocks attend in one split (no combine launch)."))
MAX_SPLITS: int = _value(_register(
    "PDSERVE_MAX_SPLITS", "int", "0", _int_at_least(0),
    "A cap on decode attention's key splits per row (0: none but the grid's)."))
SHORT_KV_BLOCKS: tuple[int, ...] = _value(_register(
    "PDSERVE_SHORT_KV_BLOCKS", "list[int]", "16,32,64,128,192", _widths,
    "Decode graphs' narrower block-table widths, comma-separated (0: one width; fewer: faster warm-up)."))

# TODO(attn4): an experiment's switch (issue 50), for one GPU comparison (`git show
# 0fcafc6:bench/gpu/attn_variants.sh`, run as a scratch script); once decided, delete it with the
# losing ways in kernels/paged_attention.py (`ATTN_VARIANTS`).
ATTN_VARIANT: str = _value(_register(
    "PDSERVE_ATTN_VARIANT", "str", "default", str,
    "Decode attention's way of adding a step's keys (default, peel, peel-gather, peel-reload; temporary, issue 50)."))

# -- tensor parallelism -------------------------------------------------------------------------
TP_ALLREDUCE: str = _value(_register(
    "PDSERVE_TP_ALLREDUCE", "str", "symm", parse_allreduce,
    "TP all-reduce on CUDA: 'symm' (one-shot through symmetric memory, 2/4/8 ranks) or 'nccl'."))

# -- KV transfer (UCX) --------------------------------------------------------------------------
UCX_LANES: int = _value(_register(
    "PDSERVE_UCX_LANES", "int", "2", _int_at_least(1),
    "KV receive lanes (a UCX worker and a thread each) per receiving process; layer l goes to lane l % lanes."))
UCX_SPIN: bool = _value(_register(
    "PDSERVE_UCX_SPIN", "bool", "1", _bool,
    "UCX workers busy-poll while KV receives are pending (0: they sleep on the worker's event)."))

# -- structured outputs -------------------------------------------------------------------------
MASK_THREADS: int = _value(_register(
    "PDSERVE_MASK_THREADS", "int", "1", _int_at_least(0),
    "Threads of xgrammar's batch matcher filling a step's grammar masks (0: one matcher at a time)."))

# -- profiling ----------------------------------------------------------------------------------
STEP_STAMPS: bool = _value(_register(
    "PDSERVE_STEP_STAMPS", "bool", "0", _bool,
    "Stamp the GPU clock at each decode graph step's start and end (CUDA; `pdserve bench engine`)."))


def table() -> str:
    """docs/settings.md: every setting's name, type, default and description."""
    lines = [
        "# Settings",
        "",
        "The environment variables pdserve reads, generated from `settings/__init__.py`",
        "(`python -m settings > docs/settings.md`; a test fails when this page and the module disagree).",
        "Each is read once, when a process starts; per-service configuration is `pdserve up`'s YAML instead.",
        "",
        "| name | type | default | description |",
        "|---|---|---|---|",
    ]
    for s in REGISTRY.values():
        default = "(unset)" if s.default is None else f"`{s.default}`"
        doc = s.doc.replace("|", r"\|")
        lines.append(f"| `{s.name}` | {s.type} | {default} | {doc} |")
    return "\n".join(lines) + "\n"
