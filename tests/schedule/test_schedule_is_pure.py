"""pipecompile/schedule/ is the pure floor: its modules import neither torch nor the runtime nor
anything above them, so schedules can be generated, validated and simulated without a model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

FLOOR = Path(__file__).resolve().parents[2] / "pipecompile" / "schedule"
ALLOWED = ("pipecompile.schedule", "pipecompile.errors")


def _imports(path: Path) -> list[str]:
    """Every module `path` imports, absolute (relative imports resolved), lazy ones included."""
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = ["pipecompile", "schedule"][: 3 - node.level]
                names.append(".".join(base + ([node.module] if node.module else [])))
            else:
                names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", sorted(FLOOR.glob("*.py")), ids=lambda p: p.name)
def test_the_schedule_floor_imports_no_torch_and_nothing_above_it(path):
    for name in _imports(path):
        assert not name.startswith("torch"), f"{path.name} imports {name}"
        if name.startswith("pipecompile"):
            assert name.startswith(ALLOWED), f"{path.name} imports {name}"
