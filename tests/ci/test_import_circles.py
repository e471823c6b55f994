"""No two modules of the package import each other, directly or around a circle, counting the
imports made only for type checking and those inside functions: a circle means one of its
modules stands on the wrong floor (a record a lower module needs lives above it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pipecompile

PACKAGE = Path(pipecompile.__file__).parent


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module (`pkg/__init__.py` is `pkg`)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _edges(name: str, source: str, package: str, known: set[str]) -> set[str]:
    """The modules of `known` that `source` (module `name` in `package`) imports."""
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                target = f"{base}.{alias.name}"
                out.add(target if target in known else base)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
    return (out & known) - {name}


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return groups


def test_no_module_imports_itself_around_a_circle():
    modules = _modules()
    known = set(modules)
    edges = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges[name] = _edges(name, path.read_text(encoding="utf-8"), package, known)
    assert _circles(edges) == []


def test_the_check_sees_a_circle_through_a_type_only_import():
    known = {"p.a", "p.b", "p.c"}
    a = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .b import B\n"
    b = "def f():\n    from .c import g\n"
    c = "from p import a\n"
    edges = {"p.a": _edges("p.a", a, "p", known), "p.b": _edges("p.b", b, "p", known),
             "p.c": _edges("p.c", c, "p", known)}
    assert edges == {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}}
    assert _circles(edges) == [["p.a", "p.b", "p.c"]]
    assert _circles({"p.a": {"p.b"}, "p.b": set()}) == []
