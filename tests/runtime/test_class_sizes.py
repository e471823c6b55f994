"""No class in pipecompile/runtime spans more than 250 lines (from its `class` line to its end):
a stage's behaviours are small classes, not branches of one worker (DeepSpeed's engine is the
counter-example)."""

from __future__ import annotations

import ast
from pathlib import Path

import pipecompile.runtime

LIMIT = 250
RUNTIME = Path(pipecompile.runtime.__file__).parent


def _class_spans(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return [(f"{path.name}:{node.name}", node.end_lineno - node.lineno + 1)
            for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]


def test_no_runtime_class_spans_more_than_250_lines():
    spans = [span for path in sorted(RUNTIME.glob("*.py")) for span in _class_spans(path)]
    assert any(name.endswith(":StageWorker") for name, _ in spans)  # the walk found the worker
    assert [(name, n) for name, n in spans if n > LIMIT] == []


def test_the_span_counts_the_class_line_to_its_last_line(tmp_path):
    source = "class A:\n    x = 1\n\n    def f(self):\n        return 2\n\n\ny = 3\n"
    (tmp_path / "m.py").write_text(source)
    assert _class_spans(tmp_path / "m.py") == [("m.py:A", 5)]
