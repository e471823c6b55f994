"""The CLI's error contract for every failure: one line on stderr, exit status 2, no traceback
(``--debug`` prints it first); ``--version``. A model that fixes its batch size (``h.reshape(4,
8)``) is the case that escaped: under ``--capture fx`` the planning probe's torch error, under
the default capture a log line claiming a capture that then failed."""

from __future__ import annotations

import pytest

import pipecompile
from pipecompile.cli import main

FIXED = '''
import torch


class Fixed(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = h.reshape(4, 8)
        return self.b(h)


def make():
    torch.manual_seed(0)
    return Fixed(), (torch.randn(4, 8),)
'''


@pytest.fixture
def fixed(tmp_path):
    path = tmp_path / "fixed.py"
    path.write_text(FIXED)
    return f"{path}:make"


def _error_line(err: str) -> str:
    errors = [line for line in err.splitlines() if line.startswith("pipecompile: error:")]
    assert len(errors) == 1, err
    return errors[0]


def test_a_fixed_batch_under_capture_fx_is_one_line_naming_the_node(fixed, capsys):
    assert main(["plan", fixed, "--capture", "fx", "--microbatches", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    line = _error_line(err)
    assert "failed at node 'reshape'" in line and "micro-batch of 2 rows" in line
    assert "shape '[4, 8]' is invalid" in line and "microbatches=1" in line


def test_a_fixed_batch_under_export_says_so_and_claims_no_capture(fixed, capsys):
    assert main(["plan", fixed, "--microbatches", "2"]) == 2
    err = capsys.readouterr().err
    assert "captured with" not in err  # nothing was captured: the attempts say "trying"
    assert "; trying static shapes" in err
    assert "pipecompile: pipecompile:" not in err
    line = _error_line(err)
    assert "fixes its batch size" in line and "microbatches=1" in line
    assert "try capture='fx'" not in line  # fx captures it and fails on a micro-batch the same


def test_the_fixed_batch_model_plans_with_one_microbatch(fixed, capsys):
    assert main(["plan", fixed, "--microbatches", "1", "--json"]) == 0


def test_an_unexpected_error_is_one_line_and_debug_shows_the_traceback(fixed, capsys,
                                                                       monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("something inside\nspanning lines")

    monkeypatch.setattr(pipecompile, "compile", broken)
    for command in ("inspect", "plan", "export"):
        extra = ["--save", "unused"] if command == "export" else []
        assert main([command, fixed, *extra]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err
        assert _error_line(err) == ("pipecompile: error: RuntimeError: something inside "
                                    "spanning lines (--debug shows the traceback)")
    assert main(["plan", fixed, "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "in broken" in err
    assert _error_line(err) == "pipecompile: error: RuntimeError: something inside spanning lines"


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"pipecompile {pipecompile.__version__}"
