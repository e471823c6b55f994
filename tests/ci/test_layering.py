"""The floors of the package import only the floors below them (read from the source, so a new
upward import fails here, not in a review): the schedule is pure data, the IR reads only the
schedule, the runtime executes a RuntimeSpec over the IR without reading capture, the passes or
the planner (what it needs of them, such as eval-mode graphs, is handed in), and the planner
reads no output (reports read plans, never the other way)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pipecompile

PACKAGE = Path(pipecompile.__file__).parent

# The floors, bottom up; each may import the floors below it and itself. The package root (the
# public face: compile, Pipeline, cli) stands on all of them.
FLOORS = ("errors", "schedule", "ir", "runtime", "weights", "passes", "capture", "measure",
          "planner", "outputs")
ALLOWED: dict[str, frozenset[str]] = {
    floor: frozenset(FLOORS[: FLOORS.index(floor) + 1]) for floor in FLOORS}


def _imports(path: Path) -> set[str]:
    """The first name under `pipecompile` of every module `path` imports."""
    package = path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1]
    return _imports_of(path.read_text(), package)


def _imports_of(source: str, package: tuple[str, ...]) -> set[str]:
    """The first name under `pipecompile` of every module `source` (in `package`) imports."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(package[: len(package) - (node.level - 1)])
                parts = base + (node.module.split(".") if node.module else [])
                if not node.module:  # from . import x: x is the module
                    found.update(".".join(parts + [a.name]).split(".")[1] for a in node.names
                                 if len(parts) == 1)
                    if len(parts) > 1:
                        found.add(parts[1])
                    continue
            else:
                parts = (node.module or "").split(".")
            if parts[0] == "pipecompile" and len(parts) > 1:
                found.add(parts[1])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "pipecompile" and len(parts) > 1:
                    found.add(parts[1])
    return found


def _files(floor: str) -> list[Path]:
    folder = PACKAGE / floor
    return sorted(folder.rglob("*.py")) if folder.is_dir() else [PACKAGE / f"{floor}.py"]


@pytest.mark.parametrize("floor", sorted(ALLOWED))
def test_a_floor_imports_only_the_floors_below_it(floor):
    upward = {f"{path.relative_to(PACKAGE.parent)}: {name}"
              for path in _files(floor) for name in _imports(path) - ALLOWED[floor]}
    assert not upward, f"{floor}/ reads above its floor: {sorted(upward)}"


def test_the_check_sees_an_upward_import():
    """The reader itself: relative and absolute imports are both found."""
    source = ("from ..passes.split import split\nimport pipecompile.capture.capture\n"
              "from .. import compiler\nfrom . import spec\nimport torch\n")
    assert _imports_of(source, ("pipecompile", "runtime")) == {
        "passes", "capture", "compiler", "runtime"}
