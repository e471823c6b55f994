"""Quiet export: torch's export loggers below ERROR and the partial graph a failing export
prints are collected from the exporting thread only (the error's details); sys.stderr is never
replaced, other threads log and write as before, no logger's level changes, and with TORCH_LOGS
set torch logs as the user configured (its loggers' levels unchanged by a capture)."""

from __future__ import annotations

import io
import json
import logging
import os
import subprocess
import sys
import textwrap
import threading

import pytest
import torch
from torch.export import Dim, export

from pipecompile.capture.quiet import quiet as _quiet


def _torch_handler(name: str) -> tuple[logging.Logger, io.StringIO]:
    """A logger under torch._dynamo with a handler of its own writing to a buffer."""
    logger = logging.getLogger(name)
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger.addHandler(handler)
    logger.propagate = False
    return logger, stream


def test_quiet_collects_this_threads_records_and_changes_nothing_global():
    logger, shown = _torch_handler("torch._dynamo.test_quiet_child")
    levels = {n: logging.getLogger(n).level for n in ("torch._dynamo", "torch.export")}
    try:
        with _quiet(False) as collected:
            assert {n: logging.getLogger(n).level for n in levels} == levels
            logger.warning("guard failed: s0 > 1")
            logger.error("kept: an error")
            other = threading.Thread(target=logger.warning, args=("from another thread",))
            other.start()
            other.join()
        logger.warning("after the call")
    finally:
        logger.handlers.clear()
    assert "guard failed: s0 > 1" in collected.getvalue()
    assert shown.getvalue().splitlines() == ["kept: an error", "from another thread",
                                             "after the call"]


def test_with_torch_logs_set_torch_logs_as_configured(monkeypatch):
    monkeypatch.setenv("TORCH_LOGS", "+dynamic")
    logger, shown = _torch_handler("torch._dynamo.test_quiet_logs")
    try:
        with _quiet(False) as collected:
            logger.warning("guard failed: s0 > 1")
    finally:
        logger.handlers.clear()
    assert collected.getvalue() == ""
    assert shown.getvalue() == "guard failed: s0 > 1\n"


def test_a_pipecompile_record_in_the_exporting_thread_is_not_collected(caplog):
    with caplog.at_level(logging.INFO, logger="pipecompile"), _quiet(False) as collected:
        logging.getLogger("pipecompile.capture.test").info("still shown")
    assert [r.getMessage() for r in caplog.records] == ["still shown"]
    assert collected.getvalue() == ""


class _DataDependent(torch.nn.Module):
    """Branches on a value: export fails and prints the partial graph it traced."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.linear(x)
        return y * 2 if y.sum() > 0 else y


def test_a_failing_exports_partial_graph_is_collected_and_stderr_is_left_alone(capfd):
    stderr = sys.stderr
    written = threading.Event()

    def other_thread():
        written.wait(timeout=300)
        print("another thread, during the export", file=sys.stderr)

    other = threading.Thread(target=other_thread)
    other.start()
    with _quiet(False) as collected:
        assert sys.stderr is stderr  # nothing replaces the process's stderr
        print("the exporting thread's own line", file=sys.stderr)
        written.set()
        with pytest.raises(Exception, match="data-dependent"):
            export(_DataDependent(), (torch.randn(3, 4),), dynamic_shapes=({0: Dim("b")},))
        other.join(timeout=300)
    err = capfd.readouterr().err
    assert "another thread, during the export" in err
    assert "the exporting thread's own line" in err
    assert "def forward" not in err and "aten.linear.default" not in err
    assert "def forward(self" in collected.getvalue()
    assert "torch.ops.aten.linear.default" in collected.getvalue()


def test_with_torch_logs_set_a_capture_leaves_torchs_logger_levels(tmp_path):
    script = textwrap.dedent("""
        import json, logging, torch
        from pipecompile.capture.capture import capture

        def levels():
            return {n: lg.level for n, lg in logging.Logger.manager.loggerDict.items()
                    if n.startswith("torch") and isinstance(lg, logging.Logger)}

        before = levels()
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh())
        capture(model, (torch.randn(4, 4),))
        after = levels()
        print(json.dumps({"changed": sorted(n for n in before if after[n] != before[n]),
                          "shapes": after["torch.fx.experimental.symbolic_shapes"]}))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=600, env=dict(os.environ, TORCH_LOGS="+dynamic"),
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.splitlines()[-1])
    assert result == {"changed": [], "shapes": logging.DEBUG}  # +dynamic: DEBUG, kept
    assert "create_symbol" in done.stderr  # and torch's lines reached the terminal
