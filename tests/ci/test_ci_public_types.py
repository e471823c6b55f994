""".ci/check_public_types.py: CI fails on a public function without full type hints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_public_types",
                                                  ROOT / ".ci" / "check_public_types.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_only_the_untyped_public_function_is_reported(tmp_path):
    checker = _checker()
    source = tmp_path / "module.py"
    source.write_text(
        "def typed(x: int, *, scale: float = 1.0) -> float:\n"
        "    return x * scale\n"
        "\n"
        "\n"
        "def untyped(x, y: int):\n"
        "    return x + y\n"
        "\n"
        "\n"
        "def _private(x):\n"  # private: not checked
        "    return x\n")
    assert checker.untyped(source) == [f"{source}:5 untyped: no type hint for x, return"]
