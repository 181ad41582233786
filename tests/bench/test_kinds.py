"""`pdserve bench`: every kind is a module of bench/ named as the kind, with the two functions
the CLI calls, and `pdserve bench --help` lists each one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench import BENCHES
from deploy.cli import main

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def test_every_bench_kind_is_a_module_of_the_bench_package():
    for name, module, _ in BENCHES:
        assert module == f"bench.{name}"
        tree = ast.parse((BENCH_DIR / f"{name}.py").read_text(encoding="utf-8"))  # not imported: see bench/__init__.py
        functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {"add_arguments", "run"} <= functions, name


def test_bench_help_lists_every_kind(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    for name, _, text in BENCHES:
        assert name in listed and text.split()[0] in listed, name
