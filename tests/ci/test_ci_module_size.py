""".ci/check_module_size.py: CI fails on a module over the line cap and names it with its count."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _checker():
    spec = importlib.util.spec_from_file_location("check_module_size",
                                                  ROOT / ".ci" / "check_module_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_files_over_the_cap_are_listed_with_their_counts(tmp_path, capsys):
    checker = _checker()
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "short.py").write_text("x = 1\n" * 500)
    (package / "sub" / "long.py").write_text("x = 1\n" * 501)
    (package / "notes.txt").write_text("x\n" * 900)  # only Python modules count
    assert checker.oversized(package, 500) == [(package / "sub" / "long.py", 501)]
    assert checker.main([str(package), "--max-lines", "500"]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "pkg/sub/long.py: 501 lines, more than 500; split it into modules of one concept each"]
    assert checker.main([str(package), "--max-lines", "501"]) == 0
    assert capsys.readouterr().out == ""
