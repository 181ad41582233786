"""`pdserve bench`: every kind is a module of bench/ named as the kind, with the two functions
the CLI calls, found through the registry bench/ fills (never imported by deploy/), and
`pdserve bench --help` lists each one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench import BENCHES
from deploy.cli import main
from deploy.plugins import bench_kinds, bench_module

ROOT = Path(__file__).resolve().parents[2]
BENCH_DIR = ROOT / "bench"


def test_every_bench_kind_is_a_module_of_the_bench_package():
    for name, module, _ in BENCHES:
        assert module == f"bench.{name}"
        tree = ast.parse((BENCH_DIR / f"{name}.py").read_text(encoding="utf-8"))  # not imported: see bench/__init__.py
        functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        assert {"add_arguments", "run"} <= functions, name


def test_the_cli_finds_the_kinds_bench_registers():
    assert list(bench_kinds()) == [tuple(k) for k in BENCHES]
    assert bench_module("engine") == "bench.engine" and bench_module("no-such-kind") is None


def test_deploy_imports_no_benchmark_module():
    for path in (ROOT / "deploy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not any(n == "bench" or n.startswith("bench.") for n in names), path


def test_bench_help_lists_every_kind(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "--help"])
    assert done.value.code == 0
    listed = capsys.readouterr().out
    for name, _, text in BENCHES:
        assert name in listed and text.split()[0] in listed, name


def test_an_unknown_kind_is_an_error(capsys):
    with pytest.raises(SystemExit) as done:
        main(["bench", "no-such-kind"])
    assert done.value.code == 2
    assert "invalid choice: 'no-such-kind'" in capsys.readouterr().err
