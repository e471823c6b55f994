"""Fail when a public function or method under pipecompile/ lacks type hints.

Public: a module-level function or a method of a module-level class whose names do not start
with an underscore (dunder methods other than __init__/__call__ are skipped). Every parameter but
self/cls needs an annotation, and the return too (except __init__).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path


def untyped(path: Path) -> list[str]:
    """`file:line name` of each public function in `path` with a missing annotation."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            found += _check(path, node, method=False)
        elif isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found += _check(path, item, method=True, owner=node.name)
    return found


def _check(path: Path, fn: ast.FunctionDef | ast.AsyncFunctionDef, *, method: bool,
           owner: str = "") -> list[str]:
    name = fn.name
    dunder = name.startswith("__") and name.endswith("__")
    if (name.startswith("_") and not dunder) or (dunder and name not in ("__init__", "__call__")):
        return []
    args = fn.args
    params = [*args.posonlyargs, *args.args, *args.kwonlyargs]
    if method and params and params[0].arg in ("self", "cls"):
        params = params[1:]
    params += [a for a in (args.vararg, args.kwarg) if a is not None]
    missing = [p.arg for p in params if p.annotation is None]
    if fn.returns is None and name != "__init__":
        missing.append("return")
    where = f"{owner}.{name}" if owner else name
    return [f"{path}:{fn.lineno} {where}: no type hint for {', '.join(missing)}"] if missing else []


def main(root: str = "pipecompile") -> int:
    problems = [p for f in sorted(Path(root).rglob("*.py")) for p in untyped(f)]
    for line in problems:
        print(line)
    if problems:
        print(f"{len(problems)} public functions without full type hints")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
