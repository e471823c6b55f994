"""stage_check: `pipecompile.load` reads a stage file as a graph and refuses anything else,
naming the file and line, before any of it runs; `trust_code=True` runs it as before."""

from __future__ import annotations

import shutil

import pytest
import torch

import pipecompile as pc
from pipecompile.outputs.stage_check import StageCodeError, check_stage_source


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 4)
    pipe = pc.compile(model, (x,), devices=2, microbatches=2)
    directory = tmp_path_factory.mktemp("saved")
    pipe.save(directory)
    with torch.no_grad():
        return directory, x, pipe(x)


def _copy(saved, tmp_path):
    directory = tmp_path / "program"
    shutil.copytree(saved[0], directory)
    return directory


def _forward_line(source: str) -> int:
    """The 1-based number of the line after `def forward` in the stage's class."""
    return next(i for i, line in enumerate(source.splitlines(), 1)
                if line.strip().startswith("def forward")) + 1


MODULE_LINES = {
    "a file write": "open({marker!r}, 'w').write('ran')",
    "an import of os": "import os",
    "a call of __import__": "__import__('os').system('touch {marker}')",
    "exec": "exec(\"open({marker!r}, 'w').write('ran')\")",
    "eval": "x = eval('1 + 1')",
    "a lambda": "f = lambda: open({marker!r}, 'w')",
    "a function": "def f():\n    return 0",
}

FORWARD_LINES = {
    "a file write": "        ran = open({marker!r}, 'w')",
    "a lambda": "        ran = (lambda: 0)()",
    "an attribute of the class": "        cls = self.__class__",
    "an attribute of torch": "        saver = torch.save",
    "a torch function": "        t = torch.load({marker!r})",
    "an attribute of an input": "        ran = input_1.__class__",
    "torch.ops used as a loader": "        ran = torch.ops.load_library({marker!r})",
    "a comprehension": "        ran = [i for i in range(3)]",
}


@pytest.mark.parametrize("what", MODULE_LINES)
def test_a_line_appended_to_a_stage_file_is_refused_with_its_file_and_line(what, saved, tmp_path):
    directory = _copy(saved, tmp_path)
    marker = tmp_path / "ran"
    stage = directory / "stage1.py"
    source = stage.read_text()
    line = len(source.splitlines()) + 1
    stage.write_text(source + MODULE_LINES[what].format(marker=str(marker)) + "\n")
    with pytest.raises(StageCodeError, match=rf"{stage}:{line}: .*trust_code=True"):
        pc.load(directory)
    assert not marker.exists()


@pytest.mark.parametrize("what", FORWARD_LINES)
def test_a_line_added_to_forward_is_refused_with_its_file_and_line(what, saved, tmp_path):
    directory = _copy(saved, tmp_path)
    marker = tmp_path / "ran"
    stage = directory / "stage0.py"
    lines = stage.read_text().splitlines()
    at = _forward_line("\n".join(lines))
    lines.insert(at - 1, FORWARD_LINES[what].format(marker=str(marker)))
    stage.write_text("\n".join(lines) + "\n")
    with pytest.raises(StageCodeError, match=rf"{stage}:{at}: "):
        pc.load(directory)
    assert not marker.exists()


def test_trust_code_runs_the_tampered_file_as_before(saved, tmp_path):
    directory = _copy(saved, tmp_path)
    marker = tmp_path / "ran"
    stage = directory / "stage1.py"
    stage.write_text(stage.read_text() + f"open({str(marker)!r}, 'w').write('ran')\n")
    loaded = pc.load(directory, trust_code=True)
    assert marker.read_text() == "ran"
    _, x, want = saved
    with torch.no_grad():
        assert torch.equal(loaded(x), want)


def test_every_file_save_writes_passes_the_check(saved):
    directory, x, want = saved
    for stage in sorted(directory.glob("stage*.py")):
        check_stage_source(stage.read_text(), str(stage))
    with torch.no_grad():
        assert torch.equal(pc.load(directory)(x), want)


def test_an_unknown_operator_and_a_subclass_of_something_else_are_refused():
    body = "class Stage0(torch.nn.Module):\n    def forward(self, x):\n        {}\n"
    header = "import torch\n"
    with pytest.raises(StageCodeError, match=r"s.py:4: torch.ops.aten.no_such_op.default"):
        check_stage_source(header + body.format("y = torch.ops.aten.no_such_op.default(x)"),
                           "s.py")
    with pytest.raises(StageCodeError, match=r"s.py:2: class Stage0"):
        check_stage_source(header + body.replace("torch.nn.Module", "object").format(
            "return (x,)"), "s.py")
    check_stage_source(header + body.format("y = torch.ops.aten.__and__.Tensor(x, x)"), "s.py")
    assert issubclass(StageCodeError, pc.PipecompileError)


def test_the_seeded_random_op_wrapper_is_allowed_under_its_own_name_only():
    header = "import torch\nfrom pipecompile.ir.rng import seeded_call as {}\n"
    body = ("class Stage0(torch.nn.Module):\n    def forward(self, x):\n"
            "        y = {}(torch.ops.aten.dropout.default, 'y', 0, x, 0.5, True)\n"
            "        return (y,)\n")
    name = "pipecompile_ir_rng_seeded_call"
    check_stage_source(header.format(name) + body.format(name), "s.py")
    with pytest.raises(StageCodeError, match=r"s.py:2: seeded_call imported as 'torch'"):
        check_stage_source(header.format("torch") + body.format("torch"), "s.py")
    with pytest.raises(StageCodeError, match=r"s.py:5: a call of 'open'"):
        check_stage_source(header.format(name) + body.format(name).replace(
            "torch.ops.aten.dropout.default", "open"), "s.py")
