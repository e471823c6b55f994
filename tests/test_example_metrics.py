"""examples/metrics_tensorboard.py: without TensorBoard installed it stops before any work with
an error naming the extra that installs it (the example itself ran by hand with it installed)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from pipecompile.errors import MissingDependencyError

SCRIPT = Path(__file__).resolve().parents[1] / "examples" / "metrics_tensorboard.py"


def test_without_tensorboard_the_example_names_the_extra(monkeypatch, tmp_path):
    spec = importlib.util.spec_from_file_location("metrics_tensorboard", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(MissingDependencyError, match=r"pip install 'pipecompile\[tensorboard\]'"):
        module.main(["--logdir", str(tmp_path), "--steps", "1"])
    assert not any(tmp_path.iterdir())
