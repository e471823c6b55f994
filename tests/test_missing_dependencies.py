"""A missing optional package is a `MissingDependencyError` (also a ModuleNotFoundError) that
names the extra installing it, for each feature that needs one: matplotlib (plot_timeline,
draw), onnx/onnxscript (export_onnx), onnxruntime (running a manifest)."""

from __future__ import annotations

import sys

import pytest
import torch

import pipecompile as pc
from pipecompile.errors import MissingDependencyError, require
from pipecompile.outputs.onnx_run import Chain


@pytest.fixture(scope="module")
def pipe():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    x = torch.randn(4, 4)
    return pc.compile(model, (x,), devices=2, microbatches=2, schedule="gpipe")


def _missing(monkeypatch, *names):
    for name in names:  # an entry of None makes `import name` fail as if it were not installed
        monkeypatch.setitem(sys.modules, name, None)


def test_plot_timeline_without_matplotlib_names_the_plot_extra(pipe, monkeypatch, tmp_path):
    _missing(monkeypatch, "matplotlib")
    with pytest.raises(MissingDependencyError) as info:
        pipe.plot_timeline(str(tmp_path / "t.png"))
    assert "pip install 'pipecompile[plot]'" in str(info.value)
    assert "plotting the timeline" in str(info.value)
    assert isinstance(info.value, ModuleNotFoundError) and info.value.name == "matplotlib"


def test_draw_without_matplotlib_names_the_plot_extra(pipe, monkeypatch, tmp_path):
    _missing(monkeypatch, "matplotlib")
    with pytest.raises(MissingDependencyError, match=r"pipecompile\[plot\]"):
        pipe.draw(str(tmp_path / "p.png"), backend="matplotlib")


def test_onnx_without_its_packages_names_the_onnx_extra(pipe, monkeypatch, tmp_path):
    _missing(monkeypatch, "onnxruntime")
    with pytest.raises(MissingDependencyError, match=r"running an ONNX manifest needs the "
                       r"package 'onnxruntime'.*pip install 'pipecompile\[onnx\]'"):
        Chain(tmp_path / "manifest.json")
    _missing(monkeypatch, "onnxscript")
    with pytest.raises(MissingDependencyError, match=r"'onnxscript'.*pipecompile\[onnx\]"):
        pipe.export_onnx(str(tmp_path / "onnx"))


def test_require_gives_the_module_and_names_a_package_of_no_extra(monkeypatch):
    assert require("json", purpose="x") is sys.modules["json"]
    _missing(monkeypatch, "somepkg")
    with pytest.raises(MissingDependencyError, match=r"x needs the package 'somepkg'.*"
                       r"pip install somepkg$"):
        require("somepkg.sub", purpose="x")


def test_every_extra_named_installs_its_package_and_the_test_extra_installs_all():
    import tomllib
    from pathlib import Path

    from pipecompile.errors import _EXTRAS

    root = Path(__file__).resolve().parents[1]
    project = tomllib.loads((root / "pyproject.toml").read_text())
    extras = project["project"]["optional-dependencies"]
    core = set(project["project"]["dependencies"])
    for package, extra in _EXTRAS.items():
        if package == "onnx_ir":  # comes with onnxscript
            assert "onnxscript" in extras[extra]
            continue
        assert package in extras[extra], (package, extra)
        assert package not in core  # optional, so not installed by `pip install pipecompile`
    needed = set().union(*(v for k, v in extras.items() if k not in ("test", "tensorboard")))
    assert needed <= set(extras["test"])
    # typed for its users: py.typed ships with the package
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["pipecompile"]
    assert (root / "pipecompile" / "py.typed").is_file()
