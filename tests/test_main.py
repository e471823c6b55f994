"""__main__.py: `python -m pipecompile ...` is the `pipecompile` command: the same output and the
same exit status."""

from __future__ import annotations

import sys

import pytest

from pipecompile import cli


def _run_module(monkeypatch, argv):
    """Import pipecompile.__main__ with `argv` (the import runs the command and exits)."""
    monkeypatch.setattr(sys, "argv", ["pipecompile", *argv])
    with pytest.raises(SystemExit) as info:
        import pipecompile.__main__  # noqa: F401
    assert "pipecompile.__main__" not in sys.modules  # a failed import is not kept: rerunnable
    return info.value.code


def _run_cli(argv):
    try:
        return cli.main(argv)
    except SystemExit as exc:  # argparse exits on --help and on usage errors
        return exc.code


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["plan", "--help"], 0),
                                       (["no-such-command"], 2)])
def test_python_m_pipecompile_is_the_cli(monkeypatch, capsys, argv, code):
    assert _run_module(monkeypatch, argv) == code
    module_out = capsys.readouterr()
    assert _run_cli(argv) == code
    cli_out = capsys.readouterr()
    assert (module_out.out, module_out.err) == (cli_out.out, cli_out.err)
    shown = module_out.out + module_out.err
    assert "usage: pipecompile" in shown
    if code == 2:
        assert "invalid choice: 'no-such-command'" in module_out.err
