"""No import circles between the project's modules.

Walks every package at the repository root (a directory with an ``__init__.py``, tests/ left out)
with ``ast`` and builds the module import graph: an ``import`` anywhere in a module counts,
inside a function too; one under ``if TYPE_CHECKING:`` does not (it never runs). An edge goes to
the module a statement names (``from a.b import c`` names ``a.b.c`` when that is a module, else
``a.b``), not to the packages above it. A circle is a strongly connected component of that graph;
the test names one path around each.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Pairs whose circle is being removed elsewhere; an edge between the two is left out of the graph.
KNOWN_CIRCLES: set[frozenset[str]] = set()


def project_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under a root-level package."""
    modules: dict[str, Path] = {}
    for init in sorted(ROOT.glob("*/__init__.py")):
        if init.parent.name == "tests":
            continue
        for path in sorted(init.parent.rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement at or under ``node``, but for the body of ``if TYPE_CHECKING:``."""
    if isinstance(node, ast.Import | ast.ImportFrom):
        yield node
        return
    children: Iterable[ast.AST] = ast.iter_child_nodes(node)
    if isinstance(node, ast.If) and _is_type_checking(node.test):
        children = node.orelse
    for child in children:
        yield from _import_nodes(child)


def _base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names (relative imports resolved)."""
    if node.level == 0:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """``name`` or its longest prefix that is a project module; None outside the project."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports (at any level, TYPE_CHECKING blocks excepted)."""
    found: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        else:
            base = _base(module, path, node)
            names = [f"{base}.{alias.name}" if base else alias.name for alias in node.names]
        found |= {m for m in (_known(n, modules) for n in names) if m is not None and m != module}
    return found


def import_graph() -> dict[str, set[str]]:
    modules = project_modules()
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    for m, targets in graph.items():
        graph[m] = {t for t in targets if frozenset({m, t}) not in KNOWN_CIRCLES}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def path_around(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """The shortest circle through the component's first module: [a, b, ..., a]."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:  # breadth-first inside the component until an edge leads back to start
        following = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w not in came_from:
                    came_from[w] = v
                    following.append(w)
        frontier = following
    return component


def test_no_import_circles_between_modules():
    graph = import_graph()
    assert len(graph) > 50, "the walk found too few modules: is ROOT right?"
    found = [" -> ".join(path_around(graph, c)) for c in circles(graph)]
    assert not found, "import circles:\n  " + "\n  ".join(found)


def test_the_check_sees_function_level_imports_and_skips_type_checking(tmp_path):
    """The graph counts an import inside a function, resolves a relative one, and leaves out
    one under ``if TYPE_CHECKING:``; a circle is named as a path."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from pkg import b\n")
    (pkg / "b.py").write_text("from . import c\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n")
    modules = {"pkg": pkg / "__init__.py", **{f"pkg.{n}": pkg / f"{n}.py" for n in "abc"}}
    graph = {m: imports_of(m, p, modules) for m, p in modules.items()}
    assert graph == {"pkg": set(), "pkg.a": {"pkg.b"}, "pkg.b": {"pkg.c"}, "pkg.c": set()}
    assert circles(graph) == []
    graph["pkg.c"] = {"pkg.a"}
    assert [path_around(graph, c) for c in circles(graph)] == [["pkg.a", "pkg.b", "pkg.c", "pkg.a"]]
