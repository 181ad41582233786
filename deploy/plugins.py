"""Where the CLI finds what other packages add to it: the `pdserve bench` kinds, through the
`pdserve.bench` entry-point group. The package that holds the benchmarks fills the group
(pyproject.toml names `bench:BENCHES`), so deploy/ imports no benchmark module and a kind's
dependencies stay its own.

Each entry point names a list of (kind, module, one line for `--help`); a kind's module has
`add_arguments(parser)` and `run(args)` and is imported only when that kind runs.

Run from a source tree (PYTHONPATH set, nothing installed, as on the device machines), the group
is read from the tree's own pyproject.toml: the same declaration an install's metadata holds,
and the one to trust when an editable install's metadata is older than the tree.
"""

from __future__ import annotations

import functools
import importlib
import tomllib
from importlib import metadata
from pathlib import Path

BENCH_GROUP = "pdserve.bench"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"

BenchKind = tuple[str, str, str]  # (kind, module, one line for `pdserve bench --help`)


def _targets(group: str) -> list[str]:
    """The group's `module:attribute` values: the source tree's pyproject.toml when pdserve
    runs from one, else the installed distribution's entry points."""
    if PYPROJECT.is_file():
        project = tomllib.loads(PYPROJECT.read_text(encoding="utf-8")).get("project", {})
        if project.get("name") == "pdserve":
            return list(project.get("entry-points", {}).get(group, {}).values())
    return [ep.value for ep in metadata.entry_points(group=group)]


@functools.cache
def bench_kinds() -> tuple[BenchKind, ...]:
    """Every registered benchmark kind, in the order its provider lists them."""
    kinds: list[BenchKind] = []
    for target in _targets(BENCH_GROUP):
        module, _, attribute = target.partition(":")
        kinds += [(str(n), str(m), str(h)) for n, m, h in getattr(importlib.import_module(module), attribute)]
    return tuple(kinds)


def bench_module(kind: str) -> str | None:
    """The module that runs `kind`, or None when no provider registers it."""
    return next((m for n, m, _ in bench_kinds() if n == kind), None)
